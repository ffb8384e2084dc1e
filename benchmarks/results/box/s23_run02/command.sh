# session 23 run 2: KV Exact4 attention, Triton and the new Gluon kernel (three configs, each beside its
# bf16 mode), real Qwen2.5 layer-8 K and V pages tiled to the Llama-3.1-8B shape; the kernel-choice assertion tests
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 120 python3 -m pytest -q -rf --tb=short -x tests/test_kv_exact.py -p no:cacheprovider \
  -k "gluon or (exact4 and attention)" > $OUT/tests2.txt 2>&1
echo "tests rc $?"; tail -3 $OUT/tests2.txt
timeout 450 python3 benchmarks/bench_kv_exact.py --kv .boxdata/kv_pages_subset.npz --format exact4 \
  --k-set qwen_8k:K:8 --v-set qwen_8k:V:8 --batches 8,32,64 --contexts 32768,131072 --rep 30 \
  --gluon 4:2,8:2,8:4 --out $OUT/x4g > $OUT/x4g.log 2>&1
echo "bench rc $?"; tail -5 $OUT/x4g.log; cat $OUT/x4g.md
