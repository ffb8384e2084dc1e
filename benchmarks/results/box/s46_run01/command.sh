# session 46 run 1: the real-shape rotary GPU test of the compact default (V padded + fold), the other
# rotary GPU tests; first piece of the SmolLM2 GGUF to /tmp/gg
source scripts/box_setup.sh > /dev/null
mkdir -p /tmp/gg && cp .boxq/p0/p0 /tmp/gg/p0
timeout 300 python3 -m pytest -q -rf --tb=short -p no:cacheprovider tests/test_kernels_compact.py \
  -k "rotary and gpu" > $OUT/r/rotary_gpu.txt 2>&1
echo "tests rc $?" >> $OUT/r/rotary_gpu.txt
tail -25 $OUT/r/rotary_gpu.txt
