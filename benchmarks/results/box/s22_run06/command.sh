# session 22 run 6: merge_launch with the programs rule (column blocks only while pairs x 8 <= 4 x SMs
# with side tokens): GPU tests at real shapes, the issue-5 grid with the formats' side tokens (default
# --side 4,128) and without (--side 0,0)
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 170 python3 -m pytest -q -rf --tb=short tests/test_kernels_paged_decode.py tests/test_kernels_compact.py -p no:cacheprovider \
  -k "(gpu and not gluon) or test_gluon_fp8_matches_reference_gpu or (gluon and gpu and default)" > $OUT/tests6.txt 2>&1
echo "tests rc $?"; tail -2 $OUT/tests6.txt
timeout 150 python3 benchmarks/bench_decode_attention.py --shapes llama8b,llama70b-tp8 --batches 8,16,32,64 \
  --contexts 32768,65536,131072 --kernels sdpa,bf16,fp8,q4,q3.5,q3 --rep 30 --out $OUT/final > $OUT/final.log 2>&1
echo "bench rc $?"; cat $OUT/final.md
timeout 120 python3 benchmarks/bench_decode_attention.py --shapes llama8b,llama70b-tp8 --batches 8,16,32,64 \
  --contexts 32768,65536,131072 --kernels fp8,q4,q3.5,q3 --side 0,0 --rep 30 --out $OUT/noside > $OUT/noside.log 2>&1
echo "bench rc $?"; cat $OUT/noside.md
rm -f $OUT/*.partial.json
