# session 24 run 5: issue without row masks on full steps (FULL), slot offset uniform: tests, A/B (base: session start, quick: 1a291dc), ncu
# (.boxq/x/ab.py as run: the copy in ../s24_run04/ab.py)
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 150 python3 -m pytest -q -rf --tb=short -x tests/test_kv_exact.py -p no:cacheprovider \
  -k "gluon or (exact4 and attention)" > $OUT/tests.txt 2>&1
echo "tests rc $?"; tail -3 $OUT/tests.txt
AB_VARIANTS=base,quick,new timeout 330 python3 .boxq/x/ab.py > $OUT/ab.log 2>&1; echo "ab rc $?"; grep -E "^(base|new|quick) " $OUT/ab.log
timeout 100 ncu --clock-control none --kernel-name regex:exact4_split --launch-skip 2 --launch-count 1 --set full \
  --import-source yes -f -o $OUT/x4 python3 .boxq/x/ncu_probe.py > $OUT/ncu_x4.log 2>&1; echo "ncu rc $?"
ncu --import $OUT/x4.ncu-rep --page details > $OUT/x4_details.txt 2>&1
ncu --import $OUT/x4.ncu-rep --page source --csv --print-source sass > $OUT/x4_source.csv 2>&1
grep -E "Duration|L2 Cache Throughput|DRAM Throughput|Issued Warp|Registers Per" $OUT/x4_details.txt
