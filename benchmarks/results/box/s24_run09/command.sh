# session 24 run 9: the final tree's GPU tests: KV Exact / Exact4 and offload whole, and the paged
# decode selection of session 22 (bf16 / fp8 / compact, Triton and Gluon defaults)
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 330 python3 -m pytest -q -rf --tb=short tests/test_kv_exact.py tests/test_offload.py -p no:cacheprovider \
  > $OUT/tests_a.txt 2>&1
echo "tests a rc $?"; tail -4 $OUT/tests_a.txt
timeout 200 python3 -m pytest -q -rf --tb=short tests/test_kernels_paged_decode.py tests/test_kernels_compact.py -p no:cacheprovider \
  -k "(gpu and not gluon) or test_gluon_fp8_matches_reference_gpu or (gluon and gpu and default)" > $OUT/tests_b.txt 2>&1
echo "tests b rc $?"; tail -4 $OUT/tests_b.txt
