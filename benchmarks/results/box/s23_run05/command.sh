# session 23 run 5: the Gluon kernel as the exact4 default: the KV Exact / Exact4 and offload GPU tests
# whole, then the grid (batch 8-64 x 32k-128k) with the default and 8 warps
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 330 python3 -m pytest -q -rf --tb=short tests/test_kv_exact.py tests/test_offload.py -p no:cacheprovider \
  > $OUT/tests5.txt 2>&1
echo "tests rc $?"; tail -8 $OUT/tests5.txt
timeout 230 python3 benchmarks/bench_kv_exact.py --kv .boxdata/kv_pages_subset.npz --format exact4 \
  --k-set qwen_8k:K:8 --v-set qwen_8k:V:8 --batches 8,16,32,64 --contexts 32768,65536,131072 --rep 30 \
  --gluon 8:2 --out $OUT/x4final > $OUT/x4final.log 2>&1
echo "bench rc $?"; sed -n '/| batch/,$p' $OUT/x4final.md
