# session 20 run 4: the decode grid with the lazy softmax max (compare s20_run01, the tables made in the kernel)
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 200 python3 benchmarks/bench_decode_attention.py --shapes llama8b,llama70b-tp8 --batches 8,64 --contexts 32768,131072 \
  --kernels sdpa,bf16,fp8,q4,q3.5,q3 --rep 30 --out $OUT/dec_s20b > $OUT/dec_log.txt 2>&1; tail -1 $OUT/dec_log.txt; cat $OUT/dec_s20b.md
rm -f $OUT/*.partial.json
