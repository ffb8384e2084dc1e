# session 21 run 4: the planner's split choice (_fit_split; fp8 at 1 wave): GPU tests of the kernels at real
# shapes (fp8 Gluon, Triton real shapes, compact Gluon defaults), the bf16 kernel's A/B of the rule, then the
# full issue-5 grid with the new defaults
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 200 python3 -m pytest -q -rf --tb=short tests/test_kernels_paged_decode.py tests/test_kernels_compact.py -p no:cacheprovider \
  -k "(gpu and not gluon) or test_gluon_fp8_matches_reference_gpu or (gluon and gpu and default)" > $OUT/tests4.txt 2>&1
echo "tests rc $?"; tail -2 $OUT/tests4.txt
timeout 100 python3 .boxq/x/s21_plan.py $OUT/plan_bf16.json llama70b-tp8,llama8b 8,16,32,64 32768,131072 bf16
timeout 280 python3 benchmarks/bench_decode_attention.py --shapes llama8b,llama70b-tp8 --batches 8,16,32,64 \
  --contexts 32768,65536,131072 --kernels sdpa,bf16,fp8,q4,q3.5,q3 --rep 30 --out $OUT/final > $OUT/final.log 2>&1
echo "bench rc $?"; cat $OUT/final.md
rm -f $OUT/*.partial.json
