# session 20 run 5: A/B of the lazy softmax max in one call: old (HEAD 7e4d739) and new kernel file
# alternated twice, 8B batch 8 and 64 at 128k and 70B TP8 64 x 32k
source .boxq/r/setup.sh
mkdir -p $OUT
for i in 1 2; do for v in old new; do
  cp .boxq/x/gluon_$v.py triton_kernels/paged_decode_gluon.py
  timeout 100 python3 benchmarks/bench_decode_attention.py --shapes llama8b --batches 8,64 --contexts 131072 \
    --kernels fp8,q4,q3.5,q3 --rep 30 --out $OUT/ab_${v}_$i > $OUT/ab_${v}_$i.log 2>&1; echo "== $v $i"; tail -2 $OUT/ab_${v}_$i.md
  timeout 60 python3 benchmarks/bench_decode_attention.py --shapes llama70b-tp8 --batches 64 --contexts 32768 \
    --kernels fp8,q4,q3.5,q3 --rep 30 --out $OUT/ab70_${v}_$i > $OUT/ab70_${v}_$i.log 2>&1; tail -1 $OUT/ab70_${v}_$i.md
done; done
rm -f $OUT/*.partial.json $OUT/*.png
