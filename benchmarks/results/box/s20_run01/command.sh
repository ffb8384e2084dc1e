# next session, run 1: branch tabfill (the Gluon kernel makes its pair tables from the codebooks) must be
# checked out in /work/main. GPU tests of the Gluon kernel, then the decode grid (compare with s19_run03 / s19_run08).
# Merge only if the tests pass and small steps are faster (the in-kernel fill costs each program more ALU work).
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 200 python3 -m pytest -q -rf --tb=short tests/test_kernels_compact.py -k "gluon and gpu" -p no:cacheprovider > $OUT/tests.txt 2>&1
echo "tests rc $?"; tail -4 $OUT/tests.txt
timeout 150 python3 benchmarks/bench_decode_attention.py --shapes llama8b,llama70b-tp8 --batches 8,64 --contexts 32768,131072 \
  --kernels sdpa,bf16,fp8,q4,q3.5,q3 --rep 30 --out $OUT/dec_s20 > $OUT/dec_log.txt 2>&1; tail -1 $OUT/dec_log.txt; cat $OUT/dec_s20.md
rm -f $OUT/*.partial.json
