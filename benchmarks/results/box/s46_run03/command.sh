# session 46 run 3: generation through the paged compact cache with the compact default (V padded and the
# fold on where the rotary term runs), Gluon forced at this size (SmolLM2-135M; /tmp/gg/p0, p1 from runs 1-2)
source scripts/box_setup.sh > /dev/null
python3 -m pip install -q --no-index --no-deps --target /tmp/gguf .boxq/gw/*.whl 2>&1 | tail -1; export PYTHONPATH=$PYTHONPATH:/tmp/gguf
cat /tmp/gg/p0 /tmp/gg/p1 .boxdata/gg/p2 > /tmp/gg/smollm2.gguf; md5sum /tmp/gg/smollm2.gguf
timeout 300 python3 benchmarks/e2e_generate.py --model /tmp/gg/smollm2.gguf --text tests/data/text/austen-emma-excerpt.txt \
  --prompt 2048 --new 64 --formats q4,q3.5,q3 --force-gluon --out $OUT/r/e2e_generate_gluon_rope > $OUT/r/e2e.log 2>&1
echo "e2e rc $?" >> $OUT/r/e2e.log
grep -v Warn $OUT/r/e2e.log | tail -30
