source scripts/box_setup.sh > /dev/null
timeout 110 python3 benchmarks/bench_decode_attention.py --shapes llama8b --batches 8,64 --contexts 32768,131072 --kernels fp8,q4+rope24,q3+rope24,q4+rope,q3.5+rope --rep 20 --out $OUT/r/fp8cmp_fold > $OUT/r/fp8cmp_fold.log 2>&1
rm -f $OUT/r/fp8cmp_fold.partial.json
grep "^|" $OUT/r/fp8cmp_fold.log
