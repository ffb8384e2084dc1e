# session 22 run 3: the column-parallel merge (merge_launch's blocks), the compact Gluon threshold at 2**16:
# GPU tests at real shapes, Gluon vs Triton below the old threshold, the issue-5 grid with the compact
# formats' side tokens (4 sinks + 128 recent, bench --side default)
source .boxq/r/setup.sh
mkdir -p $OUT
timeout 170 python3 -m pytest -q -rf --tb=short tests/test_kernels_paged_decode.py tests/test_kernels_compact.py -p no:cacheprovider \
  -k "(gpu and not gluon) or test_gluon_fp8_matches_reference_gpu or (gluon and gpu and default)" > $OUT/tests3.txt 2>&1
echo "tests rc $?"; tail -2 $OUT/tests3.txt
timeout 80 python3 .boxq/x/s22_probe.py 2>&1 | grep -v -i warn | tee $OUT/probe3.txt
timeout 280 python3 benchmarks/bench_decode_attention.py --shapes llama8b,llama70b-tp8 --batches 8,16,32,64 \
  --contexts 32768,65536,131072 --kernels sdpa,bf16,fp8,q4,q3.5,q3 --rep 30 --out $OUT/final > $OUT/final.log 2>&1
echo "bench rc $?"; cat $OUT/final.md
rm -f $OUT/*.partial.json
