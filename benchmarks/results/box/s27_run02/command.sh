# session 27 run 2: the tree = wip/s25-carry-split 8c21521 (now main); variants from .boxq/x/mk_variants.sh:
#   # (session 25) writes the A/B variant modules (untracked, git-excluded) from the branches; run on the
#   # development machine with the tree checked out at wip/s25-carry-split ("tree"), then carry
#   # python/weightszip/kernels/_pdg_* and _x4_base.py (or list them in the run's carry)
#   set -e
#   K=python/weightszip/kernels
#   git show main:triton_kernels/paged_decode_gluon.py > $K/_pdg_main.py
#   git show 2e8d416:triton_kernels/paged_decode_gluon.py > $K/_pdg_carry0.py   # s24 carry, fp8 rows 144 apart
#   git show wip/s24-compact-carry:triton_kernels/paged_decode_gluon.py > $K/_pdg_carry.py  # + fp8 rows aligned
#   git show wip/s25-split-logits:triton_kernels/paged_decode_gluon.py > $K/_pdg_split.py   # main + two logit chains
#   git show main:triton_kernels/kv_exact4_gluon.py | sed 's/from .paged_decode_gluon import/from ._pdg_main import/' > $K/_x4_base.py
#   ls -la $K/_pdg_* $K/_x4_base.py
# (prepared in session 25) call B: the decode A/B of the compact (q4, q3) and fp8 Gluon kernels:
# main, carry0 (s24 carry), carry (+ fp8 rows aligned), split (main + two logit chains), tree (carry +
# split); outputs compared with main's
# carry: [".boxq/w", ".boxq/r", ".boxq/x", "python/weightszip/kernels/_pdg_main.py",
#         "python/weightszip/kernels/_pdg_carry0.py", "python/weightszip/kernels/_pdg_carry.py",
#         "python/weightszip/kernels/_pdg_split.py"]
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 560 python3 .boxq/x/ab_decode2.py > $OUT/ab_decode.log 2>&1; echo "ab rc $?"; sed -n '/summary/,$p' $OUT/ab_decode.log
