# session 22 run 2: merge-kernel variants (column blocks x splits a step x warps x transform matrix loaded first),
# against the repo's merge as it was at 475fb3b (one program per sequence and KV head), with and without 4 sinks +
# 128 window side tokens. The script was then given command-line arguments (../s22_run05/s22_merge.py); this run
# is that script with the arguments below, the launches ((4, 1), (8, 2), (16, 4)) and A_FIRST in (0, 1) with the
# transform, and `bi, nw = pd.merge_launch(...)` / grid (B, Hkv) for the repo's two-value launch then.
source .boxq/r/setup.sh; mkdir -p $OUT
timeout 540 python3 .boxq/x/s22_merge.py l70:8:32768,l70:8:65536,l70:32:32768,l8:8:32768 q4,fp8 0:0,4:128 2>&1 | grep -v -i warn > $OUT/s22_merge.txt
