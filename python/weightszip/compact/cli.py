"""``weightszip calibrate``: a model's calibration for the compact formats (q4, q3.5, q3)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from weightszip.cli_args import positive_int, thread_count, torch_device


def _cmd_calibrate(a) -> int:
    from weightszip.compact.calibrate import BUDGET_CONTEXT, TARGETS, CalibrationError, calibrate, text_windows
    from weightszip.models import ModelNotInstalled, load_causal_lm

    def fail(msg) -> int:
        print(f"weightszip: error: {msg}", file=sys.stderr)
        return 2

    if len(a.text) < 1:
        return fail("give at least one --text (two long windows of text are recommended)")
    if a.tokens < 256:
        return fail("--tokens must be at least 256")
    if not a.rope_min_ratio >= 0:
        return fail("--rope-min-ratio must be >= 0")
    for t in a.text:
        if not Path(t).exists():
            return fail(f"{t}: no such file or folder")
    from weightszip.cli import refuse_output

    if a.seed < 0:
        return fail(f"--seed must be >= 0, not {a.seed}")
    if not a.output:
        return fail("-o/--output is empty")
    from weightszip.eval.cli import _make_folder_for

    # before the calibration runs: never an input, a directory or a file where its folder should be
    why = refuse_output(a.output, [*a.text, a.model], a.force) or _make_folder_for(Path(a.output))
    if why is not None:
        return fail(why)
    if a.threads:
        import torch

        torch.set_num_threads(a.threads)
    try:
        lm = load_causal_lm(a.model, verbose=False)
    except (ModelNotInstalled, ImportError, ValueError) as e:
        return fail(e)
    if a.device != "cpu":
        lm.model.to(a.device)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    try:
        windows, info = text_windows(lm.tokenizer, [Path(t) for t in a.text], a.tokens)
    except ValueError as e:
        return fail(e)
    windows = [w.to(lm.model.device) for w in windows]
    t0 = time.perf_counter()
    try:
        cal = calibrate(lm.model, windows, n_query_samples=a.queries, seed=a.seed, rope_offsets=a.rope_offsets,
                        rope_min_ratio=a.rope_min_ratio,
                        meta={"model": lm.name, "model_source": lm.source, "texts": info}, log=log)
    except CalibrationError as e:
        return fail(e)
    seconds = time.perf_counter() - t0
    out = Path(a.output)
    from weightszip.errors import OutputExistsError

    try:
        # (without --force, a file created at OUTPUT since the check above is not replaced either)
        cal.save(out, overwrite=a.force)
    except OutputExistsError as e:
        return fail(f"{e} (use -f/--force to overwrite it)")
    size = os.path.getsize(out)
    summary = {
        "output": str(out),
        "bytes": size,
        "seconds": round(seconds, 1),
        "model": lm.name,
        "texts": info,
        "bits_per_value": {n: round(cal.bits_per_value(n, BUDGET_CONTEXT), 4) for n in TARGETS},
        "allocation": cal.allocation,
    }
    if a.json:
        print(json.dumps(summary, indent=1))
    else:
        print(f"wrote {out} ({size} bytes) in {seconds:.0f} s")
        for n in TARGETS:
            print(f"  {n:5s} {summary['bits_per_value'][n]:.4f} bits/value at {BUDGET_CONTEXT} tokens")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser(
        "calibrate",
        help="calibrate the compact KV formats (q4, q3.5, q3) for a model on text",
        description="One teacher-forced pass of the model over one window of each --text (two long windows "
        "recommended; never the text you evaluate on). The weights are read, not changed. Writes a small "
        ".wzcal file (a weightszip container) that `eval kl/niah --calibration` and the cache load.",
    )
    p.add_argument("--model", required=True, help="smollm2 | qwen2.5 | a model folder | a .gguf file")
    p.add_argument("--text", action="append", required=True, help="a text file or folder of .txt (repeat: one window each)")
    p.add_argument("--tokens", type=positive_int, default=4096, help="tokens per window (default 4096)")
    p.add_argument("-o", "--output", required=True,
                   help="the calibration file (M.wzcal); an existing one is refused without --force")
    p.add_argument("-f", "--force", action="store_true", help="overwrite OUTPUT if it exists (never an input)")
    p.add_argument("--queries", type=positive_int, default=256, help="queries sampled per window for the error estimates (default 256)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=thread_count, default=0, help="torch CPU threads (default: torch's; at most 256)")
    p.add_argument("--no-rope-offsets", dest="rope_offsets", action="store_false",
                   help="no rotary K offsets: the GPU decode kernel skips their per-key term (+40-78%% time), but quality drops on models whose keys carry a "
                   "bias (Qwen2.5: broken at 3 bits); see docs/EVALUATION.md")
    p.add_argument("--rope-min-ratio", type=float, default=0.25,
                   help="keep a RoPE pair's key offset only where it is at least this fraction of the pair's remaining "
                   "RMS (default 0.25; higher keeps fewer pairs)")
    p.add_argument("--device", type=torch_device, default="cpu", help="torch device for the model's forwards (default cpu; e.g. cuda)")
    p.add_argument("--json", action="store_true", help="print a JSON summary")
    p.set_defaults(fn=_cmd_calibrate)
