# session 20 run 2: branch tabfill, the Gluon GPU tests run 1 did not reach (its 200 s limit), then the
# rest of the compact GPU tests that touch the Gluon path
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 330 python3 -m pytest -q -rf --tb=short tests/test_kernels_compact.py -k "gluon and gpu and (llama70b or staged4)" -p no:cacheprovider > $OUT/tests2.txt 2>&1
echo "tests rc $?"; tail -4 $OUT/tests2.txt
