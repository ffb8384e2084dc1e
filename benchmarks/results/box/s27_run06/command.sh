# session 27: the rest of the tree's GPU tests (A1 timed out after 36/74 and 92/95), then the issue-5 grid
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 330 python3 -m pytest -q -rf --tb=short -p no:cacheprovider $(cat .boxq/x/ids_b_rest.txt) $(cat .boxq/x/ids_a_rest.txt) > $OUT/tests_rest.txt 2>&1
echo "tests rc $?"; tail -4 $OUT/tests_rest.txt
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv > $OUT/gpu.txt
timeout 250 python3 benchmarks/bench_decode_attention.py --shapes llama8b,llama70b-tp8 --batches 8,64 --contexts 32768,131072 \
  --kernels sdpa,bf16,fp8,q4,q3.5,q3 --rep 30 --out $OUT/grid > $OUT/grid.log 2>&1
echo "grid rc $?"; cat $OUT/grid.md 2>/dev/null | head -30
