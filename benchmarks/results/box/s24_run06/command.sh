# session 24 run 6: V pairs made before the softmax (new, not kept) against 417a8fd (quick): tests, A/B
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 150 python3 -m pytest -q -rf --tb=short -x tests/test_kv_exact.py -p no:cacheprovider \
  -k "gluon or (exact4 and attention)" > $OUT/tests.txt 2>&1
AB_VARIANTS=quick,new timeout 330 python3 .boxq/x/ab.py > $OUT/ab.log 2>&1
