source scripts/box_setup.sh
python3 benchmarks/bench_decode_attention.py --shapes llama8b,llama70b-tp8 --batches 8,64 --contexts 32768,131072 --kernels fp8,q4,q3.5,q3,q4+rope24,q3+rope24,q4+rope,q3.5+rope --rep 20 --out $OUT/r/fp8cmp 2>&1 | grep -v "it/s" > $OUT/r/fp8cmp.log
rm -f $OUT/r/fp8cmp.partial.json
tail -12 $OUT/r/fp8cmp.log
