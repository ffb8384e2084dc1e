# session 21 run 7: the merge kernel's launch (1 warp, 4 splits a step; 4 warps, 16 with the V transform) with
# the planner's split choice: GPU tests at real shapes, kernel times at small batches, the full issue-5 grid
# (.boxq/x/s21_prof.py is kept as ../s21_run05/s21_prof.py: the same file)
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 200 python3 -m pytest -q -rf --tb=short tests/test_kernels_paged_decode.py tests/test_kernels_compact.py -p no:cacheprovider \
  -k "(gpu and not gluon) or test_gluon_fp8_matches_reference_gpu or (gluon and gpu and default)" > $OUT/tests7.txt 2>&1
echo "tests rc $?"; tail -2 $OUT/tests7.txt
timeout 100 python3 .boxq/x/s21_prof.py 2>&1 | grep -v Warn | tee $OUT/prof7.txt
timeout 250 python3 benchmarks/bench_decode_attention.py --shapes llama8b,llama70b-tp8 --batches 8,16,32,64 \
  --contexts 32768,65536,131072 --kernels sdpa,bf16,fp8,q4,q3.5,q3 --rep 30 --out $OUT/final > $OUT/final.log 2>&1
echo "bench rc $?"; cat $OUT/final.md
rm -f $OUT/*.partial.json
