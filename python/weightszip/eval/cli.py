"""`weightszip eval kl` and `weightszip kv dump`: the evaluation commands.

Registered into the main parser by ``add_parsers(subparsers)``; torch and transformers are
imported only when a command runs (``pip install 'weightszip[eval]'``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from weightszip.cli_args import nonnegative_int, positive_int, thread_count, torch_device


def _model_help() -> str:
    from weightszip.models import MODELS

    return f"one of {', '.join(sorted(MODELS))}, a transformers model folder, or a .gguf file"


def _split_formats(s: str) -> list[str]:
    names = [x.strip() for x in s.split(",") if x.strip()]
    if not names:
        raise SystemExit("weightszip: error: --format names no format")
    return names


def _layer_indices(text: str) -> list[int]:
    """--layers 0,5,29: distinct layer indices >= 0 (argparse's usage error otherwise; the model's
    count is checked once it is loaded)."""
    layers = [nonnegative_int(x.strip()) for x in text.split(",") if x.strip()]
    if not layers:
        raise argparse.ArgumentTypeError(f"names no layer: {text!r}")
    if len(set(layers)) != len(layers):
        raise argparse.ArgumentTypeError(f"a layer given twice: {text!r}")
    return layers


def _load(spec: str, threads: int | None, device: str | None = None):
    import torch

    from weightszip.models import load_causal_lm

    if threads:
        torch.set_num_threads(threads)
    lm = load_causal_lm(spec, verbose=False)
    if device and device != "cpu":
        lm.model.to(device)
    return lm


def add_device_arg(p) -> None:
    p.add_argument("--device", type=torch_device, default="cpu",
                   help="torch device for the model's forwards (default cpu; e.g. cuda)")


def _use_calibration(path):
    """--calibration FILE: bind the compact formats (q4, q3.5, q3) to a model's calibration; the
    Calibration, or None without one."""
    if not path:
        return None
    from weightszip.compact.calibrate import Calibration
    from weightszip.compact.formats import use_calibration

    from weightszip.errors import WeightszipError

    try:
        cal = Calibration.load(path)
    except WeightszipError as e:  # (a file that cannot be read: an I/O error, not only a ValueError)
        raise ValueError(f"--calibration {path}: {e}") from None
    use_calibration(cal)
    return cal


def check_calibration_fits(cal, path, model) -> str | None:
    """Why the calibration does not fit the loaded model (its layers, KV heads, head_dim), or None:
    checked right after the model loads, before any forward (a mismatch failed inside the formatted
    forward, after the bf16 reference one, or went unnoticed with more layers than the model's)."""
    if cal is None:
        return None
    from weightszip.compact.calibrate import CalibrationError
    from weightszip.eval import kl

    try:
        cal.check_model(*kl.model_kv_shape(model))
    except CalibrationError as e:
        return f"--calibration {path}: {e}"
    return None


def text_files(path) -> list[Path]:
    """The files `eval kl` reads from --text (a file, or a folder's *.txt by name), as models.read_text."""
    p = Path(path)
    if p.is_dir():
        return sorted(q for q in p.glob("*.txt") if q.is_file())
    return [p] if p.is_file() else []


def add_calibration_arg(p, evaluates: str | None = None) -> None:
    """--calibration; for a command that evaluates on text (``evaluates``: what it calls that text),
    also --allow-calibration-text (``provenance.held_out``)."""
    if evaluates is None:
        p.add_argument("--calibration", help="a .wzcal file from `weightszip calibrate` (needed by q4, q3.5, q3)")
        return
    p.add_argument("--calibration", help="a .wzcal file from `weightszip calibrate` (needed by q4, q3.5, q3; it must "
                   f"be the model's, and the {evaluates} must not be one of its calibration texts)")
    p.add_argument("--allow-calibration-text", action="store_true",
                   help=f"run even when the {evaluates} is or holds one of the calibration's texts (same SHA-256 or "
                   "path); refused without it, as the result would not be held out")


def _make_folder_for(path: Path) -> str | None:
    """Create the folder that the output `path` goes in, if missing (as --save and kv dump's -o always
    did), before any work; why `path` cannot be written there (a file where the folder should be, a
    directory at `path`), or None."""
    if path.parent.exists() and not path.parent.is_dir():
        return f"{path}: {path.parent} is not a folder"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        return f"{path}: cannot create its folder {path.parent} ({e.strerror or e})"
    if path.is_dir():
        return f"{path}: is a directory"
    return None


def _check_kl_outputs(a) -> str | None:
    """Why --save (with its .npz) or --plot cannot be written, or None: checked before the model is
    loaded, so that a slip costs no evaluation. Never an input (the --text file, a .txt file in a
    --text folder, the model's file), never a directory, not both options on one file; --plot's folder
    must exist, --save's is created."""
    from weightszip.cli import refuse_output
    from weightszip.files import same_file

    outs: list[tuple[str, Path]] = []
    if a.save:
        save = Path(a.save)
        if save.suffix == ".npz":
            return (f"--save {save}: the per-position arrays go to {save.with_suffix('.npz')} beside the report; "
                    "give the report another suffix (e.g. .json)")
        outs += [("--save", save), ("--save", save.with_suffix(".npz"))]
    if a.plot:
        outs.append(("--plot", Path(a.plot)))
    text = Path(a.text)
    for i, (flag, p) in enumerate(outs):
        if any(os.path.abspath(p) == os.path.abspath(q) for _, q in outs[:i]):
            return f"{flag} {p}: also written by another option"
        why = refuse_output(str(p), [a.text, a.model], force=True)
        if why is not None:
            return why
        if text.is_dir() and p.suffix == ".txt" and same_file(p.parent, text):
            return f"{flag} {p}: a .txt file in the --text folder would be read as text; not written"
        if flag == "--plot" and not p.parent.is_dir():
            return f"--plot {p}: no folder {p.parent}"
        why = _make_folder_for(p)
        if why is not None:
            return f"{flag} {why}"
    return None


def _cmd_eval_kl(a) -> int:
    why = _check_kl_outputs(a)
    if why is not None:
        print(f"weightszip: error: {why}", file=sys.stderr)
        return 2
    import torch
    import transformers

    from weightszip.eval import formats as F
    from weightszip.eval import kl
    from weightszip.models import ModelNotInstalled, tokenize_text

    from weightszip.eval import provenance

    names = _split_formats(a.format)
    try:
        cal = _use_calibration(a.calibration)
        fmts = [F.get_format(n) for n in names]
    except (KeyError, F.FormatUnavailable, ValueError, OSError) as e:
        print(f"weightszip: error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    if a.window < 2:
        print("weightszip: error: --window must be at least 2 tokens", file=sys.stderr)
        return 2
    overlap, why = provenance.held_out(cal, a.calibration, text_files(a.text), a.allow_calibration_text)
    if why is not None:
        print(f"weightszip: error: {why}", file=sys.stderr)
        return 2
    try:
        lm = _load(a.model, a.threads, a.device)
    except (ModelNotInstalled, ImportError, ValueError) as e:
        print(f"weightszip: error: {e}", file=sys.stderr)
        return 2
    why = check_calibration_fits(cal, a.calibration, lm.model)
    if why is not None:
        print(f"weightszip: error: {why}", file=sys.stderr)
        return 2
    try:
        ids, files = tokenize_text(lm.tokenizer, Path(a.text), a.window, a.offset)
    except (ValueError, OSError) as e:  # (a text shorter than --offset + --window, or none there)
        print(f"weightszip: error: {e}", file=sys.stderr)
        return 2
    ids = ids.to(lm.model.device)
    layers, kv_heads, head_dim = kl.model_kv_shape(lm.model)
    log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
    log(f"{lm.name}: {layers} layers, {kv_heads} kv heads x {head_dim}; {a.window} tokens of {', '.join(files)}")
    windowed = a.chunked or any(f.keeps_bf16 for f in fmts)
    results, ref_seconds = kl.evaluate(
        lm.model,
        ids,
        fmts,
        n_buckets=a.buckets,
        chunk=a.chunk,
        force_chunked=a.chunked,
        floor=windowed and not a.chunked and a.floor is not False,
        log=log,
    )
    rows = results
    report = {
        "model": lm.name,
        "model_source": lm.source,
        "text": str(a.text),
        "text_files": files,
        "offset_tokens": a.offset,
        "window": a.window,
        "layers": layers,
        "kv_heads": kv_heads,
        "head_dim": head_dim,
        "reference_forward_seconds": round(ref_seconds, 2),
        "threads": torch.get_num_threads(),
        "device": str(lm.model.device),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "attention": lm.model.config._attn_implementation,
        "calibration": None if cal is None else provenance.describe(a.calibration, cal, overlap),
        "results": [r.summary() for r in rows],
    }
    if a.plot:
        report["plot"] = str(a.plot)
    if a.save:
        report["per_position"] = str(Path(a.save).with_suffix(".npz"))
    # The results first: a plot or report that cannot be written (a full disk) loses no evaluation.
    _print_kl(a, report, rows, ref_seconds)
    sys.stdout.flush()
    if a.plot:
        kl.plot(rows, a.plot, title=f"{lm.name}, {a.window} tokens of {Path(a.text).name}")
    if a.save:
        import numpy as np

        save = Path(a.save)
        # Per-position scores beside the report (to re-plot or re-bucket without re-running).
        arrays = {}
        for i, r in enumerate(rows):
            arrays[f"kl_{i}"], arrays[f"agree_{i}"] = r.kl.astype(np.float32), r.agree
        np.savez_compressed(save.with_suffix(".npz"), names=np.array([r.name for r in rows]), **arrays)
        save.write_text(json.dumps(report, indent=1) + "\n")
    return 0


def _print_kl(a, report: dict, rows, ref_seconds: float) -> None:
    """The report as JSON (--json), or the table."""
    from weightszip.eval import kl

    if a.json:
        json.dump(report, sys.stdout, indent=1)
        print()
        return
    print(f"{'format':34s} {'bits/value':>10s} {'mean KL':>10s} {'top-1':>7s} {'KL p99':>9s} {'attention':>9s} {'time s':>7s}")
    for r in rows:
        print(
            f"{r.name:34s} {r.bits_per_value:10.4f} {kl.fmt_kl(r.mean_kl):>10s} {r.top1:7.4f} "
            f"{kl.fmt_kl(r.kl_p99):>9s} {r.attention:>9s} {r.seconds:7.1f}"
        )
    print(f"(bf16 reference forward: {ref_seconds:.1f} s; KL in nats, over all {a.window} positions)")
    print(kl.describe_position_buckets(rows))
    if a.plot:
        print(f"plot: {a.plot}")


def _cmd_kv_dump(a) -> int:
    import numpy as np

    import weightszip
    from weightszip.models import ModelNotInstalled, capture

    from weightszip.cli import refuse_output

    why = refuse_output(a.output, [a.text, a.model], a.force) or _make_folder_for(Path(a.output))
    if why is not None:
        print(f"weightszip: error: {why}", file=sys.stderr)
        return 2
    try:
        lm = _load(a.model, a.threads)
    except (ModelNotInstalled, ImportError, ValueError) as e:
        print(f"weightszip: error: {e}", file=sys.stderr)
        return 2
    import ml_dtypes

    try:  # (a layer the model does not have, a text shorter than --tokens)
        kv, meta = capture(a.model, Path(a.text), a.tokens, a.layers, a.threads, loaded=lm)
    except (ValueError, OSError) as e:
        print(f"weightszip: error: {e}", file=sys.stderr)
        return 2
    _, n_layers, n_tokens, width = kv.shape
    bf16 = kv.view(ml_dtypes.bfloat16)  # the bit patterns, typed: the container records bf16
    tensors = {}
    for j, i in enumerate(meta["layers"]):
        tensors[f"layer.{i}.k"] = bf16[0, j]
        tensors[f"layer.{i}.v"] = bf16[1, j]
    meta = dict(
        meta,
        layout="per layer: tensors layer.{i}.k and layer.{i}.v, [tokens, kv_heads*head_dim] bf16, "
        "a token's heads side by side (head h at columns h*head_dim..), post-RoPE",
        dtype="bfloat16",
        shape=[n_tokens, width],
    )
    tensors["__meta__"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    out = Path(a.output)
    t0 = time.perf_counter()
    try:
        # (without --force, a file created at OUTPUT since the check above is not replaced either)
        weightszip.save_file(tensors, out, threads=a.threads or None, overwrite=a.force)
    except weightszip.OutputExistsError as e:
        print(f"weightszip: error: {e} (use -f/--force to overwrite it)", file=sys.stderr)
        return 2
    except (weightszip.WeightszipError, OSError) as e:  # (a full disk, its folder gone meanwhile)
        print(f"weightszip: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    dt = time.perf_counter() - t0
    raw = kv.nbytes
    stored = out.stat().st_size
    print(
        f"{meta['model']}: {n_layers} layers x K,V [{n_tokens}, {width}] bf16 ({raw / 2**20:.1f} MiB) -> {out} "
        f"({stored / 2**20:.1f} MiB, {stored / raw:.4f}); forward {meta['forward_seconds']} s, save {dt:.1f} s"
    )
    return 0


def add_parsers(subparsers) -> None:
    """Register `eval` (sub-command `kl`) and `kv` (sub-command `dump`)."""
    e = subparsers.add_parser("eval", help="evaluate KV formats on a real model (KL and top-1 vs bf16)")
    esub = e.add_subparsers(dest="eval_cmd", required=True)
    k = esub.add_parser(
        "kl",
        help="teacher-forced KL(bf16 || format) and top-1 agreement at every position of a window",
        description="One forward over --window tokens of --text per format; in every attention layer each "
        "query sees the K/V the format hands back at decode time. Prints bits per value, mean KL (nats), "
        "top-1 agreement, KL per position bucket and the time of each format's forward.",
    )
    k.add_argument("--model", required=True, help=_model_help())
    k.add_argument("--format", required=True, help="format name(s), comma-separated (weightszip eval formats lists them)")
    k.add_argument("--text", required=True, help="text file, or folder of *.txt (held-out: not used for calibration; "
                   "with --calibration, a text of the calibration is refused)")
    k.add_argument("--window", type=positive_int, required=True, help="tokens in the window (the context the last position sees)")
    k.add_argument("--offset", type=nonnegative_int, default=0, help="skip this many tokens of the text first (default 0)")
    k.add_argument("--json", action="store_true", help="print a JSON report instead of the table")
    k.add_argument("--plot", help="write a PNG of KL and top-1 against position (into a folder that exists)")
    k.add_argument("--save", help="also write the JSON report to this file (and per-position KL, top-1 to .npz beside it; "
                   "its folder is created if missing)")
    k.add_argument("--threads", type=thread_count, default=0, help="torch CPU threads (default: torch's choice; at most 256)")
    k.add_argument("--buckets", type=positive_int, default=8, help="position buckets in the report (default 8)")
    k.add_argument("--chunk", type=positive_int, default=512, help="queries per block in the windowed attention")
    add_calibration_arg(k, evaluates="text")
    add_device_arg(k)
    k.add_argument(
        "--chunked", action="store_true", help="run every format through the windowed fp32 attention (bf16 then shows its floor)"
    )
    k.add_argument(
        "--no-floor", dest="floor", action="store_false", default=None,
        help="skip the extra bf16 row through the windowed attention (added when a format keeps bf16 tokens)",
    )
    k.set_defaults(fn=_cmd_eval_kl)

    from weightszip.eval import niah

    niah.add_parser(esub)

    f = esub.add_parser("formats", help="list the KV formats, their bits per value and whether they run here")
    f.add_argument("--context", type=positive_int, default=8192, help="context length for bits per value (default 8192)")
    f.add_argument("--head-dim", type=positive_int, default=64)
    f.add_argument("--kv-heads", type=positive_int, default=3)
    add_calibration_arg(f)
    f.set_defaults(fn=_cmd_eval_formats)

    v = subparsers.add_parser("kv", help="capture real KV caches")
    vsub = v.add_subparsers(dest="kv_cmd", required=True)
    d = vsub.add_parser(
        "dump",
        help="write every layer's bf16 K and V (post-RoPE) of a text into a .wz container",
        description="Tensors layer.{i}.k, layer.{i}.v: [tokens, kv_heads*head_dim] bf16; __meta__: uint8 JSON "
        "(model, text files, token ids, shapes).",
    )
    d.add_argument("--model", required=True, help=_model_help())
    d.add_argument("--text", required=True, help="text file, or folder of *.txt")
    d.add_argument("--tokens", type=positive_int, required=True)
    d.add_argument("-o", "--output", required=True, help="OUT.wz (an existing one is refused without --force)")
    d.add_argument("-f", "--force", action="store_true", help="overwrite OUTPUT if it exists (never an input)")
    d.add_argument("--layers", type=_layer_indices, help="comma-separated layer indices (default: all)")
    d.add_argument("--threads", type=thread_count, default=0, help="torch CPU threads (default: torch's; at most 256)")
    d.set_defaults(fn=_cmd_kv_dump)


def _cmd_eval_formats(a) -> int:
    from weightszip.eval import formats as F

    try:
        _use_calibration(a.calibration)
    except (ValueError, OSError) as e:
        print(f"weightszip: error: {e.args[0] if e.args else e}", file=sys.stderr)
        return 2
    status = F.available_formats()
    print(f"{'format':10s} {'bits/value':>10s}  {'kept bf16':>9s}  description (bits at {a.context} tokens, head_dim {a.head_dim})")
    for name, fmt in F.FORMATS.items():
        why = "" if status[name] is None else f"  [unavailable: {status[name]}]"
        try:
            bits = f"{fmt.bits_per_value(a.context, a.head_dim, a.kv_heads):10.4f}"
        except F.FormatUnavailable as e:
            bits = f"{'-':>10s}"
            why = why or f"  [unavailable: {e}]"
        kept = f"{fmt.sink_tokens}+{fmt.recent_window}" if fmt.keeps_bf16 else "-"
        print(f"{name:10s} {bits}  {kept:>9s}  {fmt.description}{why}")
    return 0
