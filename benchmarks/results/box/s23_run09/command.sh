# session 23 run 9: plain rows' ranks and addresses inside the branch; GPU tests (exact4 and the
# Gluon kernel), then the final grid (batch 8-64 x 32k-128k, SDPA and our bf16 kernel beside)
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 150 python3 -m pytest -q -rf --tb=short -x tests/test_kv_exact.py -p no:cacheprovider \
  -k "gluon or (exact4 and attention)" > $OUT/tests9.txt 2>&1
echo "tests rc $?"; tail -3 $OUT/tests9.txt
timeout 300 python3 benchmarks/bench_kv_exact.py --kv .boxdata/kv_pages_subset.npz --format exact4 \
  --k-set qwen_8k:K:8 --v-set qwen_8k:V:8 --batches 8,16,32,64 --contexts 32768,65536,131072 --rep 30 \
  --out $OUT/kv_exact4_gluon > $OUT/kv_exact4_gluon.log 2>&1
echo "bench rc $?"; sed -n '/| batch/,$p' $OUT/kv_exact4_gluon.md
