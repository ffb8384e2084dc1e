# session 24 run 8: the final grid (batch 8-64 x 32k-128k; SDPA and our bf16 kernel beside) at 417a8fd
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 420 python3 benchmarks/bench_kv_exact.py --kv .boxdata/kv_pages_subset.npz --format exact4 \
  --k-set qwen_8k:K:8 --v-set qwen_8k:V:8 --batches 8,16,32,64 --contexts 32768,65536,131072 --rep 30 \
  --out $OUT/kv_exact4_gluon > $OUT/kv_exact4_gluon.log 2>&1
echo "bench rc $?"; sed -n '/| batch/,$p' $OUT/kv_exact4_gluon.md | head -20
