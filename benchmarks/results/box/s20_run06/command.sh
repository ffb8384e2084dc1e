# session 20 run 6: the final split (lazy max in the compact kernel only, the fp8 kernel as before):
# Gluon compact tests at both shapes (default and staged2), then q4/q3 A/B point against run 5's
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 150 python3 -m pytest -q -rf --tb=short tests/test_kernels_compact.py -p no:cacheprovider \
  -k "gluon and gpu and (default or rotary)" > $OUT/tests6.txt 2>&1
echo "tests rc $?"; tail -2 $OUT/tests6.txt
timeout 60 python3 benchmarks/bench_decode_attention.py --shapes llama8b --batches 8,64 --contexts 131072 \
    --kernels fp8,q4,q3.5,q3 --rep 30 --out $OUT/final > $OUT/final.log 2>&1; tail -2 $OUT/final.md
rm -f $OUT/*.partial.json $OUT/*.png
