#!/usr/bin/env python3
"""Exact page profile, version 1 against version 2 (context classes): bytes on real KV (CPU).

For every (model, layer, K/V) of each capture, both codebook versions are calibrated on the same
tokens and both encode the same held-out pages with the Rust reference codec; every page is
decoded again and compared. Bytes counted as the restore path moves them (BENCHMARKS.md, "Restore
and offload"): page bytes with their padding to 8 bytes, plus an 8-byte offset and a 4-byte table id
per page. The codebooks (stored once per model) are listed apart.

Two kinds of held-out data:

* ``--kv CAPTURE.npy``: calibrate on each layer's first half of tokens, code the second half
  (another stretch of the same text);
* ``--pair CAL.npy:EVAL.npy`` (two captures of one model over different texts): calibrate on the
  first half of CAL, code the second half of EVAL (another text).

    python benchmarks/bench_page_versions.py --kv /tmp/kv/smollm2_8k.npy --kv /tmp/kv/qwen_8k.npy \\
        --pair /tmp/kv/smollm2_8k.npy:/tmp/kv/smollm2_books_8k.npy --pair /tmp/kv/qwen_8k.npy:/tmp/kv/qwen_books_8k.npy

Writes ``benchmarks/results/page_versions.{json,md,png}`` (``page_versions_calN.*`` with
``--cal-tokens N``); ``--restore-session .boxdata/kv_pages_subset.npz`` instead counts the bytes of
bench_restore.py's session (``page_versions_restore_session.json``).

``--cpu-speed`` times the Rust page codec of both versions instead (the CPU path of offload and
restore) on the ``--kv`` captures' held-out pages, one call per (layer, K/V) as offload makes one
per chunk, on 1 thread and on every core, beside the dense codec (``weightszip.compress``) and
zstd -3 on the same bytes; best of ``--repeats``, every round trip checked
(``page_cpu_speed.{json,md}``).
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from weightszip import pages  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PER_PAGE = 8 + 4  # the restore's offset and table id of each page


def layer_sets(cal_path: str, eval_path: str, layers: int | None, cal_tokens: int | None = None):
    """(model, data, kind, layer, calibration tokens, held-out tokens) for each set."""
    cal = np.load(cal_path, mmap_mode="r")
    ev = cal if eval_path == cal_path else np.load(eval_path, mmap_mode="r")
    if cal.shape[1] != ev.shape[1] or cal.shape[3] != ev.shape[3]:
        raise SystemExit(f"{cal_path} and {eval_path} are not captures of one model")
    n = cal.shape[1]
    idx = range(n) if layers is None else np.linspace(0, n - 1, layers).round().astype(int)
    data = "same text" if eval_path == cal_path else "other text"
    for layer in idx:
        for k, kind in enumerate("KV"):
            a, b = np.asarray(cal[k, layer]), np.asarray(ev[k, layer])
            half_a, half_b = a.shape[0] // 32 * 16, b.shape[0] // 32 * 16
            yield Path(cal_path).stem, data, kind, int(layer), a[: cal_tokens or half_a], b[half_b: 2 * half_b]


def measure(cal: np.ndarray, ev: np.ndarray, max_len: int) -> dict:
    pg = ev.reshape(-1, pages.PAGE_TOKENS, ev.shape[1])
    row = {"raw": int(pg.nbytes), "n_pages": int(pg.shape[0])}
    for version in (1, 2):
        cb = pages.calibrate(cal, "bfloat16", max_len, version=version)
        buf, offs = pages.encode_pages(cb, pg)
        if not (pages.decode_pages(cb, buf, offs) == pg).all():
            raise SystemExit(f"version {version}: pages did not decode to their values")
        row[f"v{version}"] = len(buf) + PER_PAGE * pg.shape[0]
        row[f"v{version}_codebook"] = len(cb)
    return row


def main():
    from tqdm import tqdm

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", action="append", default=[], help="a capture (capture_kv.py .npy): halves of one text")
    ap.add_argument("--pair", action="append", default=[], help="CAL.npy:EVAL.npy, one model over two texts")
    ap.add_argument("--layers", type=int, default=None, help="this many layers per capture, evenly spaced (default all)")
    ap.add_argument("--max-len", type=int, default=8)
    ap.add_argument("--cal-tokens", type=int, default=None,
                    help="calibrate on this many first tokens (default: the first half; the restore benchmark uses 2048)")
    ap.add_argument("--restore-session", default=None, metavar="NPZ",
                    help="only the bytes of bench_restore.py's session over this subset (make_kv_subset.py): each set "
                         "tiled to 1024 channels, calibrated on its first half, its second half coded")
    ap.add_argument("--cpu-speed", action="store_true", help="time the CPU codecs instead (see above)")
    ap.add_argument("--repeats", type=int, default=5, help="--cpu-speed: best of this many")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    if args.restore_session:
        return restore_session(args)
    if args.cpu_speed:
        if not args.kv:
            ap.error("--cpu-speed needs --kv")
        return cpu_speed(args)
    jobs = [(p, p) for p in args.kv] + [tuple(p.split(":", 1)) for p in args.pair]
    if not jobs:
        ap.error("give --kv, --pair or --restore-session")
    sets = [s for c, e in jobs for s in layer_sets(c, e, args.layers, args.cal_tokens)]
    rows = []
    for model, data, kind, layer, cal, ev in tqdm(sets, desc="sets"):
        rows.append(dict(model=model, data=data, kind=kind, layer=layer, **measure(cal, ev, args.max_len)))
    summary, lines = [], ["| model | held out | K/V | version 1 | version 2 | v2 / v1 | restore bound v1 -> v2 | codebooks v1 / v2 (KiB) |",
                          "|---|---|---|---:|---:|---:|---:|---:|"]
    for model, data in dict.fromkeys((r["model"], r["data"]) for r in rows):
        for kind in ("K", "V", "K+V"):
            rs = [r for r in rows if (r["model"], r["data"]) == (model, data) and kind in ("K+V", r["kind"])]
            raw = sum(r["raw"] for r in rs)
            v1, v2 = sum(r["v1"] for r in rs) / raw, sum(r["v2"] for r in rs) / raw
            cb1, cb2 = (sum(r[f"v{v}_codebook"] for r in rs) / 1024 for v in (1, 2))
            summary.append(dict(model=model, data=data, kind=kind, v1=v1, v2=v2, codebook_kib_v1=cb1, codebook_kib_v2=cb2))
            lines.append(f"| {model} | {data} | {kind} | {v1:.4f} | {v2:.4f} | {v2 / v1:.4f} | {1 / v1:.3f}x -> "
                         f"{1 / v2:.3f}x | {cb1:.0f} / {cb2:.0f} |")
    table = "\n".join(lines)
    print(table)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python " + " ".join(sys.argv), "date": dt.date.today().isoformat(), "cal_tokens": args.cal_tokens,
            "machine": platform.processor() or platform.machine(), "max_len": args.max_len,
            "bytes": "pages padded to 8 bytes + 8-byte offset + 4-byte table id per page, over bf16"}
    stem = "page_versions" + (f"_cal{args.cal_tokens}" if args.cal_tokens else "")
    (out / f"{stem}.json").write_text(json.dumps(dict(meta, summary=summary, rows=rows), indent=1))
    (out / f"{stem}.md").write_text(f"`{meta['command']}`\n\n{table}\n")
    plot(summary, out / f"{stem}.png")


def restore_session(args):
    """The restore benchmark's session bytes in both versions (its sets weigh equally in it)."""
    from bench_gpu_codec import calibrated_sets
    from tqdm import tqdm

    out = {"command": "python " + " ".join(sys.argv), "date": dt.date.today().isoformat(), "max_len": args.max_len,
           "bytes": "pages padded to 8 bytes + 8-byte offset + 4-byte table id per page, over bf16"}
    for version in (1, 2):
        coded = raw = 0
        for _, _, cb, x in tqdm(calibrated_sets([args.restore_session], 1024, args.max_len, version), desc=f"v{version}"):
            ev = x[x.shape[0] // 2:].reshape(-1, pages.PAGE_TOKENS, 1024)
            buf, offs = pages.encode_pages(cb, ev)
            if not (pages.decode_pages(cb, buf, offs) == ev).all():
                raise SystemExit(f"version {version}: pages did not decode to their values")
            coded, raw = coded + len(buf) + PER_PAGE * ev.shape[0], raw + ev.nbytes
        out[f"v{version}"] = {"ratio": coded / raw, "bound": raw / coded}
        print(f"version {version}: {coded / raw:.4f} of bf16, restore bound {raw / coded:.3f}x")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "page_versions_restore_session.json").write_text(json.dumps(out, indent=1))


def _best(f, repeats: int):
    import time

    best, r = float("inf"), None
    for _ in range(repeats):
        t = time.perf_counter()
        r = f()
        best = min(best, time.perf_counter() - t)
    return best, r


def cpu_speed(args):
    """The CPU codecs' speed on every (layer, K/V) of the captures (see the module's docstring)."""
    import os

    import ml_dtypes
    import weightszip
    import zstandard
    from tqdm import tqdm

    cores = os.cpu_count() or 1
    sets = [s for p in args.kv for s in layer_sets(p, p, args.layers)]
    codebooks = {v: [pages.calibrate(cal, "bfloat16", args.max_len, version=v) for *_, cal, _ in sets] for v in (1, 2)}
    evs = [ev.reshape(-1, pages.PAGE_TOKENS, ev.shape[1]) for *_, ev in sets]
    raw = sum(ev.nbytes for ev in evs)
    rows = []

    def row(name, threads, encode, decode):
        te = td = 0.0
        stored = 0
        for i, ev in enumerate(tqdm(evs, desc=f"{name}, {threads} thread(s)", leave=False)):
            t, blob = _best(lambda: encode(i, ev), args.repeats)
            te += t
            t, back = _best(lambda: decode(i, blob), args.repeats)
            td += t
            if not np.array_equal(np.asarray(back).view(np.uint16).reshape(ev.shape), ev):
                raise SystemExit(f"{name}: set {i} did not round-trip")
            stored += len(blob[0]) + PER_PAGE * ev.shape[0] if isinstance(blob, tuple) else len(blob)
        rows.append(dict(codec=name, threads=threads, ratio=stored / raw, encode_MBps=raw / te / 1e6,
                         decode_MBps=raw / td / 1e6))
        print(f"{name:>26} {threads:>2} threads: ratio {stored / raw:.4f}, encode {raw / te / 1e6:7.0f} MB/s, "
              f"decode {raw / td / 1e6:7.0f} MB/s")

    for threads in dict.fromkeys((1, cores)):
        for v in (1, 2):
            cbs = codebooks[v]
            row(f"exact pages v{v} (Rust)", threads,
                lambda i, ev: pages.encode_pages(cbs[i], ev, threads=threads),
                lambda i, b: pages.decode_pages(cbs[i], b[0], b[1], threads=threads))
        row("weightszip.compress", threads,
            lambda i, ev: weightszip.compress(ev.view(ml_dtypes.bfloat16), threads=threads),
            lambda i, b: weightszip.decompress(b, threads=threads))
        row("zstd -3", threads,
            lambda i, ev: zstandard.ZstdCompressor(level=3, threads=threads if threads > 1 else 0).compress(ev.tobytes()),
            lambda i, b: np.frombuffer(zstandard.ZstdDecompressor().decompress(b), np.uint16))
    lines = ["| codec | threads | bytes / bf16 | encode MB/s | decode MB/s |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {r['codec']} | {r['threads']} | {r['ratio']:.4f} | {r['encode_MBps']:.0f} | {r['decode_MBps']:.0f} |"
              for r in rows]
    table = "\n".join(lines)
    print(table)
    meta = {"command": "python " + " ".join(sys.argv), "date": dt.date.today().isoformat(), "cores": cores,
            "machine": platform.processor() or platform.machine(), "sets": len(sets), "raw_bytes": raw,
            "timing": f"best of {args.repeats} per set, summed over the sets; exact pages' bytes count 12 per page"}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "page_cpu_speed.json").write_text(json.dumps(dict(meta, rows=rows), indent=1))
    (out / "page_cpu_speed.md").write_text(f"`{meta['command']}`\n\n{table}\n")
    plot_speed(rows, cores, out / "page_cpu_speed.png")


def plot_speed(rows, cores: int, path: Path):
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    codecs = list(dict.fromkeys(r["codec"] for r in rows))
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    for ax, key, what in zip(axes, ("encode_MBps", "decode_MBps"), ("encode", "decode")):
        x = np.arange(len(codecs))
        for j, threads in enumerate(dict.fromkeys(r["threads"] for r in rows)):
            vals = [next(r[key] for r in rows if r["codec"] == c and r["threads"] == threads) for c in codecs]
            ax.bar(x + (j - 0.5) * 0.4, vals, 0.4, label=f"{threads} thread(s)")
        labels = [f"{c}\n{next(r['ratio'] for r in rows if r['codec'] == c):.3f} of bf16" for c in codecs]
        ax.set_xticks(x, labels, fontsize=7)
        ax.set_title(f"{what} (MB/s of bf16, {cores} cores)")
        ax.legend(fontsize=8)
    fig.suptitle("CPU codecs on real KV (SmolLM2, Qwen2.5; per layer and K/V, held out)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("plot:", path)


def plot(summary, path: Path):
    try:
        import matplotlib
    except ImportError:
        print("no plot: matplotlib is not installed")
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rs = [s for s in summary if s["kind"] != "K+V"] + [s for s in summary if s["kind"] == "K+V"]
    labels = [f"{s['model']}\n{s['data']}\n{s['kind']}" for s in rs]
    x = np.arange(len(rs))
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(rs)), 4.5))
    ax.bar(x - 0.2, [s["v1"] for s in rs], 0.4, label="version 1")
    ax.bar(x + 0.2, [s["v2"] for s in rs], 0.4, label="version 2 (context classes)")
    ax.axhline(0.66, color="k", lw=0.8, ls="--", label="0.66 (issue 7)")
    ax.set_ylim(0.55, 0.7)
    ax.set_xticks(x, labels, fontsize=7)
    ax.set_ylabel("bytes in transit / bf16 bytes (held out)")
    ax.set_title("Exact page profile: version 1 vs version 2 on real KV")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print("plot:", path)


if __name__ == "__main__":
    main()
