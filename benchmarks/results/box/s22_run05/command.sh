# session 22 run 5: merge-kernel variants at larger batches (q4, with and without the 132 side tokens)
source .boxq/r/setup.sh; mkdir -p $OUT
timeout 400 python3 .boxq/x/s22_merge.py l8:32:32768,l8:64:32768,l70:64:32768,l8:16:32768 q4 0:0,4:128 2>&1 | grep -v -i warn | tee $OUT/s22_merge5.txt
