# session 27 run 1: three calls (the GGUF in three parts); the tree at main 7a3b703
# call 1 (carry .boxq/e2e/p1):
#   mkdir -p /tmp/e2e /tmp/site && python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .boxq/e2e/p1/gguf-*.whl && cp .boxq/e2e/p1/part_00 /tmp/e2e/ && ls -la /tmp/e2e /tmp/site | head
# call 2 (carry .boxq/e2e/p2):
#   cp .boxq/e2e/p2/part_01 /tmp/e2e/ && ls -la /tmp/e2e
# call 3 (carry .boxq/e2e/p3, .boxq/w, .boxq/r, .boxq/x); .boxq/x/e2e_gen.py is now benchmarks/e2e_kv_exact.py
source .boxq/r/setup.sh
export PYTHONPATH=$PYTHONPATH:/tmp/site
mkdir -p $OUT
cat /tmp/e2e/part_00 /tmp/e2e/part_01 .boxq/e2e/p3/part_02 > /tmp/e2e/SmolLM2-135M-Instruct.Q4_1.gguf
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  /tmp/e2e/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c
export SMOLLM2_GGUF=/tmp/e2e/SmolLM2-135M-Instruct.Q4_1.gguf WEIGHTSZIP_TEST_SMOLLM2=/tmp/e2e/SmolLM2-135M-Instruct.Q4_1.gguf
export WEIGHTSZIP_CACHE=/tmp/e2e/cache
timeout 200 python3 -m pytest -q -rf --tb=short tests/test_kv_exact.py -k generation -p no:cacheprovider > $OUT/tests_gen.txt 2>&1
echo "tests rc $?"; tail -3 $OUT/tests_gen.txt
timeout 300 python3 .boxq/x/e2e_gen.py > $OUT/e2e_gen.log 2>&1; echo "e2e rc $?"; tail -6 $OUT/e2e_gen.log
