# session 24 run 11 (run 10 the same without the summaries kept): ncu (warp states, source counters) of the fp8 and the compact (q4) Gluon split
# (.boxq/x/stalls.py: the script that became benchmarks/ncu_stalls.py; it listed every LDGSTS of the loop)
# kernels at the Llama-3.1-8B layer, batch 32 x 64k: do they wait on their block-table loads as the
# exact4 kernel did (run 1)?
source .boxq/r/setup.sh
mkdir -p $OUT
for k in fp8:fp8_split q4:compact_split; do
  name=${k%%:*}; rx=${k##*:}
  timeout 100 ncu --clock-control none --kernel-name regex:$rx --launch-skip 2 --launch-count 1 \
    --section SpeedOfLight --section WarpStateStats --section SourceCounters --section SchedulerStats \
    --section LaunchStats --import-source no -f -o $OUT/$name python3 benchmarks/bench_decode_attention.py \
    --kernels $name --shapes llama8b --batches 32 --contexts 65536 --rep 5 --out $OUT/bench_$name > $OUT/ncu_$name.log 2>&1
  echo "$name ncu rc $?"
  ncu --import $OUT/$name.ncu-rep --page details > $OUT/${name}_details.txt 2>&1
  ncu --import $OUT/$name.ncu-rep --page source --csv --print-source sass > $OUT/${name}_source.csv 2>&1
  grep -E "Duration|DRAM Throughput|L2 Cache Throughput|Issued Warp|Registers Per" $OUT/${name}_details.txt
  python3 .boxq/x/stalls.py $OUT/${name}_source.csv 25 > $OUT/${name}_stalls.txt 2>&1
done
mkdir -p /tmp/keep; mv $OUT/*_details.txt $OUT/*_stalls.txt /tmp/keep/; rm -rf $OUT/*; mv /tmp/keep/* $OUT/
