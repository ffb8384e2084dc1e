# session 27 run 3 (tree 8c21521; base = main 7a3b703's kernel)
# (prepared in session 25) call A2: the exact4 A/B: main's kernel (base) against the tree's two logit
# chains (new), and the tree's at a 168-register cap with 3 programs per SM planned (3 CTAs fit in
# shared memory; ptxas spills 8 bytes there, offline), bit identity with the bf16 mode at each point
# carry: [".boxq/w", ".boxq/r", ".boxq/x", ".boxdata", "python/weightszip/kernels/_pdg_main.py",
#         "python/weightszip/kernels/_x4_base.py"]
source .boxq/r/setup.sh
mkdir -p $OUT
AB_VARIANTS=base,new,new:2:168:3 AB_ROUNDS=2 AB_BATCHES=16,64 AB_CONTEXTS=32768,131072 timeout 420 python3 .boxq/x/ab.py > $OUT/ab_x4.log 2>&1
echo "ab x4 rc $?"; grep -E "^(base|new)" $OUT/ab_x4.log
