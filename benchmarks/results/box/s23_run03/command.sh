# session 23 run 3: the Gluon exact4 kernel with plain rows behind one branch per thread and the
# chunk copies per side: GPU tests, then the grid (three configs)
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 120 python3 -m pytest -q -rf --tb=short -x tests/test_kv_exact.py -p no:cacheprovider \
  -k "gluon or (exact4 and attention)" > $OUT/tests3.txt 2>&1
echo "tests rc $?"; tail -3 $OUT/tests3.txt
timeout 400 python3 benchmarks/bench_kv_exact.py --kv .boxdata/kv_pages_subset.npz --format exact4 \
  --k-set qwen_8k:K:8 --v-set qwen_8k:V:8 --batches 8,32,64 --contexts 32768,131072 --rep 30 --no-sdpa \
  --gluon 4:2,8:2,2:2 --out $OUT/x4g > $OUT/x4g.log 2>&1
echo "bench rc $?"; tail -2 $OUT/x4g.log | cut -c1-300; sed -n '/Gluon kernel/,$p' $OUT/x4g.md
