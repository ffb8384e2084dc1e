# session 27 run 5 (tree 8c21521): both pytest calls hit their timeouts (36 of 74 and 92 of 95 done, none failed); the rest in run 6
# (prepared in session 25) call A1, tree = wip/s25-carry-split: its GPU tests (KV Exact4 / offload
# whole; paged decode bf16/fp8/compact with the Gluon defaults)
# carry: [".boxq/w", ".boxq/r", ".boxq/x", ".boxdata", "python/weightszip/kernels/_pdg_main.py",
#         "python/weightszip/kernels/_x4_base.py"]
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 200 python3 -m pytest -q -rf --tb=short tests/test_kernels_paged_decode.py tests/test_kernels_compact.py -p no:cacheprovider \
  -k "(gpu and not gluon) or test_gluon_fp8_matches_reference_gpu or (gluon and gpu)" > $OUT/tests_b.txt 2>&1
echo "tests b rc $?"; tail -3 $OUT/tests_b.txt
timeout 230 python3 -m pytest -q -rf --tb=short tests/test_kv_exact.py tests/test_offload.py -p no:cacheprovider \
  > $OUT/tests_a.txt 2>&1
echo "tests a rc $?"; tail -3 $OUT/tests_a.txt
