# session 21 run 2: Gluon GPU tests with the inline-PTX table fill (run 1's were skipped: TRITON_INTERPRET
# unset), then the split-geometry sweep (waves, min_split_tokens) of fp8 and the compact kinds
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 300 python3 -m pytest -q -rf --tb=short tests/test_kernels_compact.py tests/test_kernels_paged_decode.py -p no:cacheprovider \
  -k "gluon and gpu" > $OUT/tests2.txt 2>&1
echo "tests rc $?"; tail -3 $OUT/tests2.txt
timeout 250 python3 .boxq/x/s21_sweep.py $OUT/split_sweep.json 20
