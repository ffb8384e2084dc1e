# session 21 run 1: the table fill by inline-PTX stores (one barrier): Gluon GPU tests, then A/B of the
# kernel file at main (old) and the tree (new), alternated, 70B TP8 8 x 32k/128k and 8B 8/64 x 128k
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 230 python3 -m pytest -q -rf --tb=short tests/test_kernels_compact.py tests/test_kernels_paged_decode.py -p no:cacheprovider \
  -k "gluon and gpu" > $OUT/tests1.txt 2>&1
echo "tests rc $?"; tail -3 $OUT/tests1.txt
for i in 1; do for v in old new; do
  cp .boxq/x/gluon_$v.py triton_kernels/paged_decode_gluon.py
  timeout 60 python3 benchmarks/bench_decode_attention.py --shapes llama70b-tp8 --batches 8 --contexts 32768,131072 \
    --kernels fp8,q4,q3.5,q3 --rep 30 --out $OUT/ab70_${v}_$i > $OUT/ab70_${v}_$i.log 2>&1; echo "== $v $i"; tail -2 $OUT/ab70_${v}_$i.md
  timeout 100 python3 benchmarks/bench_decode_attention.py --shapes llama8b --batches 8,64 --contexts 131072 \
    --kernels fp8,q4,q3.5,q3 --rep 30 --out $OUT/ab_${v}_$i > $OUT/ab_${v}_$i.log 2>&1; tail -2 $OUT/ab_${v}_$i.md
done; done
cp .boxq/x/gluon_new.py triton_kernels/paged_decode_gluon.py
rm -f $OUT/*.partial.json $OUT/*.png $OUT/*.log
