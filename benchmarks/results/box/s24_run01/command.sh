# session 24 run 1: ncu on the exact4 Gluon kernel (and its bf16 mode) at 32 x 64k
source .boxq/r/setup.sh
mkdir -p $OUT
nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem --format=csv > $OUT/clocks.txt
which ncu; ncu --version | tail -1
python3 .boxq/x/ncu_probe.py
timeout 200 ncu --clock-control none --kernel-name regex:exact4_split --launch-skip 2 --launch-count 1 --set full \
  --import-source yes -f -o $OUT/x4 python3 .boxq/x/ncu_probe.py > $OUT/ncu_x4.log 2>&1; echo "ncu rc $?"; tail -3 $OUT/ncu_x4.log
ncu --import $OUT/x4.ncu-rep --page details > $OUT/x4_details.txt 2>&1
ncu --import $OUT/x4.ncu-rep --page source --csv --print-source sass > $OUT/x4_source.csv 2>&1; echo "src rc $?"
PW=bf16 timeout 150 ncu --clock-control none --kernel-name regex:exact4_split --launch-skip 2 --launch-count 1 \
  --section SpeedOfLight --section SchedulerStats --section WarpStateStats --section ComputeWorkloadAnalysis \
  --section MemoryWorkloadAnalysis --section Occupancy --section LaunchStats -f -o $OUT/bf python3 .boxq/x/ncu_probe.py > $OUT/ncu_bf.log 2>&1; echo "ncu bf rc $?"
ncu --import $OUT/bf.ncu-rep --page details > $OUT/bf_details.txt 2>&1
ls -la $OUT
