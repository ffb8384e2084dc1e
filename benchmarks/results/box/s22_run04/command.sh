# session 22 run 4: the issue-5 grid without side tokens (as session 21's run 7 measured it), for the merge
# change alone; compact Gluon threshold 0
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 300 python3 benchmarks/bench_decode_attention.py --shapes llama8b,llama70b-tp8 --batches 8,16,32,64 \
  --contexts 32768,65536,131072 --kernels fp8,q4,q3.5,q3 --side 0,0 --rep 30 --out $OUT/noside > $OUT/noside.log 2>&1
echo "bench rc $?"; cat $OUT/noside.md
rm -f $OUT/*.partial.json
