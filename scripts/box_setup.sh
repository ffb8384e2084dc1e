# Sourced at the start of a GPU-box command (device tool): the checkout's Python and kernels with the
# Rust extension of our abi3 wheel, built here (`maturin build --release -o .boxq/w`) and carried
# (carry: [".boxq/w", ...]; .boxq/ and .boxdata/ are git-ignored, so they travel only when carried).
#
#     source scripts/box_setup.sh   # then python3 benchmarks/... with $OUT/r for results
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "${WZ_WHEELS:-.boxq/w}"/*.whl || exit 1
cp /tmp/site/weightszip/_core*.so python/weightszip/ || exit 1
# TRITON_INTERPRET=0: the test modules default it to 1 (the CPU interpreter) where it is unset, and
# their GPU tests skip under the interpreter (session 33's first call ran none of them).
# WEIGHTSZIP_NO_FETCH=1: the box reaches no package index, so a model not carried skips at once
# instead of waiting on pip's timeouts.
export PYTHONPATH=$PWD/python PYTHONUNBUFFERED=1 TRITON_INTERPRET=0 WEIGHTSZIP_NO_FETCH=1
mkdir -p "$OUT/r"
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,driver_version --format=csv > "$OUT/r/gpu.txt"; cat "$OUT/r/gpu.txt"
