source scripts/box_setup.sh
for k in q4+rope24 q3+rope24 q3; do
  timeout 170 ncu --clock-control none -k regex:compact_split_kernel --launch-count 1 --set full --import-source yes -o /tmp/n_$k python3 benchmarks/ncu_probe.py $k > /dev/null 2>&1
  echo "== $k" >> $OUT/r/ncu.txt
  ncu --import /tmp/n_$k.ncu-rep --page source --csv --print-source sass > /tmp/n_$k.csv 2>/dev/null
  python3 benchmarks/ncu_stalls.py /tmp/n_$k.csv --top 14 >> $OUT/r/ncu.txt 2>&1
  ncu --import /tmp/n_$k.ncu-rep --page details 2>/dev/null | grep -E "DRAM Throughput|Duration|L1/TEX Cache Throughput|Issue Slots Busy|No Eligible|Warp Cycles Per Issued|Achieved Occupancy|Registers Per|Bank Conflicts|Shared" >> $OUT/r/ncu.txt
done
tail -150 $OUT/r/ncu.txt
