# session 20 run 3: the lazy softmax max and the skipped rescale (both Gluon kernels): GPU tests of the
# Gluon kernels (a subset: every kind at both shapes, staged, rotary; the fp8 kernel), then generation
# through the paged compact cache (SmolLM2-135M; /tmp/gg/p0, p1 uploaded by the two calls before)
source .boxq/r/setup.sh
python3 -m pip install -q --no-index --no-deps --target /tmp/gguf .boxq/gw/*.whl 2>&1 | tail -1; export PYTHONPATH=$PYTHONPATH:/tmp/gguf
mkdir -p $OUT
cat /tmp/gg/p0 /tmp/gg/p1 .boxdata/gg/p2 > /tmp/gg/smollm2.gguf; md5sum /tmp/gg/smollm2.gguf
timeout 170 python3 -m pytest -q -rf --tb=short tests/test_kernels_compact.py tests/test_kernels_paged_decode.py -p no:cacheprovider \
  -k "(gluon and gpu and (default or staged2 or rotary)) or test_gluon_fp8_matches_reference_gpu or test_real_shapes_gpu" > $OUT/tests3.txt 2>&1
echo "tests rc $?"; tail -3 $OUT/tests3.txt
timeout 170 python3 benchmarks/e2e_generate.py --model /tmp/gg/smollm2.gguf --text tests/data/text/austen-emma-excerpt.txt \
  --prompt 2048 --new 64 --formats q4,q3.5,q3 --out $OUT/e2e_generate_s20 2>&1 | grep -v Warn | tail -5
timeout 150 python3 benchmarks/e2e_generate.py --model /tmp/gg/smollm2.gguf --text tests/data/text/austen-emma-excerpt.txt \
  --prompt 2048 --new 64 --formats q4,q3.5,q3 --force-gluon --out $OUT/e2e_generate_gluon_s20 2>&1 | grep -v Warn | tail -5
