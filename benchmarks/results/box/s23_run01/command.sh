# session 23 run 1: the Gluon exact4 kernel's GPU tests (bit-identical to its bf16 mode, against the reference)
source .boxq/r/setup.sh
mkdir -p $OUT
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 400 python3 -m pytest -q -rf --tb=short -x tests/test_kv_exact.py -p no:cacheprovider \
  -k "gluon or (exact4 and attention)" > $OUT/tests1.txt 2>&1
echo "tests rc $?"; tail -40 $OUT/tests1.txt
