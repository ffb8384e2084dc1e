# session 27 run 4 (tree 8c21521; ab_decode2.py: the copy in ../s27_run02)
# (prepared in session 25) call C: launch settings of the tree's compact kernel (after the carry, pages
# are half fp8's, so fewer bytes are in flight per warp at 2 stages): 8 warps x 2 stages x 2 waves (the
# default) against 16 warps x 2 or 4 stages (1 program per SM; q4 at 16 x 4 needs 202 KiB, so the
# script raises the cap to the H200's 227 KiB), and splits of 1024 tokens (70B TP8 at batch 8: 128 programs of 2048)
# carry: [".boxq/w", ".boxq/r", ".boxq/x"]
source .boxq/r/setup.sh
mkdir -p $OUT
AB_VARIANTS=tree,tree@8:2:2:1024,tree@16:2:1,tree@16:4:1,tree@16:4:2 AB_FORMATS=q4,q3 \
AB_POINTS=llama8b:8:32768,llama8b:64:131072,llama70b-tp8:8:32768,llama70b-tp8:16:65536 \
timeout 560 python3 .boxq/x/ab_decode2.py > $OUT/ab_cfg.log 2>&1; echo "ab rc $?"; sed -n '/summary/,$p' $OUT/ab_cfg.log
