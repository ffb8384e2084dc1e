#!/usr/bin/env bash
# The GPU-box runs of docs/EVALUATION.md: the same CLI as on a laptop, with --device cuda.
#
#   MODEL=path/to/Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf TEXT=../shared/data/text \
#   OUT_DIR=benchmarks/results bash benchmarks/gpu_eval.sh STAGE [STAGE ...]
#
# Stages: calibrate (two 4096-token windows: CPython stdlib + Moby-Dick; never the evaluation
# text), kl16 / kl32 (KL and top-1 on code/lua_src.c at 16384 / 32768 tokens: fp8, int4-g32,
# kivi-2 and the compact formats, one forward per format, plus the windowed-attention floor),
# niah4k / niah8k / niah16k / niah32k (multi-key retrieval on paul_graham/, 30 prompts, the variant ladder's pilot
# picks the hardest variant bf16 still answers 80% of). Each stage writes its JSON (and PNG)
# report to OUT_DIR and a log beside it. Set NAME to change the report prefix (default qwen2.5).
set -euo pipefail
MODEL=${MODEL:?set MODEL to the model (smollm2, qwen2.5, a folder or a .gguf file)}
TEXT=${TEXT:-../shared/data/text}
OUT_DIR=${OUT_DIR:-benchmarks/results}
NAME=${NAME:-qwen2.5}
CAL=${CAL:-$OUT_DIR/$NAME.wzcal}
DEVICE=${DEVICE:-cuda}
WZ=${WZ:-python3 -m weightszip}
FORMATS=${FORMATS:-fp8,int4-g32,kivi-2,q4,q3.5,q3}
NIAH_FORMATS=${NIAH_FORMATS:-bf16,fp8,int4-g32,kivi-2,q4,q3.5,q3}
CAL_TEXTS=${CAL_TEXTS:-"$TEXT/code/cpython311_stdlib_asyncio_email_json_http_logging.py $TEXT/books/melville-moby_dick.txt"}
EVAL_TEXT=${EVAL_TEXT:-$TEXT/code/lua_src.c}
mkdir -p "$OUT_DIR"

for stage in "$@"; do
  echo "== $stage $(date -u +%H:%M:%S)"
  case $stage in
    calibrate)
      args=()
      for t in $CAL_TEXTS; do args+=(--text "$t"); done
      $WZ calibrate --model "$MODEL" "${args[@]}" --tokens 4096 --device "$DEVICE" -o "$CAL" --json \
        >"$OUT_DIR/${NAME}_calibration.json" 2>"$OUT_DIR/${NAME}_calibration.log"
      cat "$OUT_DIR/${NAME}_calibration.json" ;;
    kl16|kl32)
      w=$([ "$stage" = kl16 ] && echo 16384 || echo 32768)
      $WZ eval kl --model "$MODEL" --format "$FORMATS" --calibration "$CAL" --text "$EVAL_TEXT" \
        --window "$w" --device "$DEVICE" --save "$OUT_DIR/kl_${NAME}_${stage#kl}_gpu.json" \
        --plot "$OUT_DIR/kl_${NAME}_${stage#kl}_gpu.png" 2>"$OUT_DIR/kl_${NAME}_${stage#kl}_gpu.log" ;;
    niah4k|niah8k|niah16k|niah32k)
      n=${stage#niah}
      $WZ eval niah --model "$MODEL" --formats "$NIAH_FORMATS" --calibration "$CAL" --length "$n" --n "${NIAH_N:-30}" \
        --text "$TEXT/paul_graham" --device "$DEVICE" ${NIAH_ARGS:-} -o "$OUT_DIR/niah_${NAME}_${n}${NIAH_TAG:-}_gpu.json" \
        2>"$OUT_DIR/niah_${NAME}_${n}${NIAH_TAG:-}_gpu.log" ;;
    *) echo "unknown stage $stage" >&2; exit 2 ;;
  esac
done
