# session 46 run 2: one wave of programs with the rotary term (waves=1 against the default's 2) and longer
# splits (min_split_tokens 4096 against 2048); second piece of the SmolLM2 GGUF to /tmp/gg
source scripts/box_setup.sh > /dev/null
mkdir -p /tmp/gg && cp .boxq/p1/p1 /tmp/gg/p1; ls -l /tmp/gg
timeout 420 python3 benchmarks/ab_decode_configs.py default w1:waves=1 ms4k:min_split_tokens=4096 \
  w1ms4k:waves=1,min_split_tokens=4096 --formats q4+rope24,q4+rope \
  --points llama8b:8:32768,llama8b:8:131072,llama70b-tp8:8:32768,llama70b-tp8:8:131072,llama70b-tp8:64:131072 \
  --rounds 3 --out $OUT/r/ab_w1.json 2>&1 | grep -v "it/s" > $OUT/r/ab_w1.log
cat $OUT/r/ab_w1.log
