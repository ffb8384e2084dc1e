#!/usr/bin/env python3
"""The exact page profile's serial decode chain, counted (CPU, no timing): how many table lookups a
stream takes as the format is now, and as it would take with each stream's symbols in channel-major
order and table entries that hold several whole symbols.

Now (docs/FORMAT.md, "Exact page profile"): a stream holds 32 channels' symbols token-major, so
consecutive symbols use different channels' codes and a lookup yields one symbol: 512 lookups a
stream, the chain the GPU decoder is bound by (BENCHMARKS.md: about 0.5 TB/s against 1.5).
Channel-major, a channel's 16 symbols are consecutive and share one code, so one lookup of a W-bit
window can give every whole symbol in it (up to K). Same code lengths, so the same bits, words and
page bytes: the ratio does not change, only the order of the symbols. An escape (its code and 8 bits)
takes a lookup alone; a lookup never spans two channels.

    python benchmarks/diag_page_multisym.py --kv .boxdata/kv_pages_subset.npz --out results/page_multisym.json

Codebooks (max_len 8) are calibrated on each set's first half, lookups counted on the second.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_codec import LLAMA_C, load_sets, tile_channels  # noqa: E402

WINDOWS = (8, 10, 12)  # W: window bits a lookup indexes (8 = max_len: the table size of today)
PER_ENTRY = (2, 3, 4)  # K: symbols an entry may hold (3 x 8-bit symbols, count and length fit 32 bits)


def code_bits(x: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each value's code bits ([T, C]; an escaped symbol: the escape's code and 8) and escape mask."""
    sym = ((x >> 7) & 0xFF).astype(np.int64)  # bf16 exponent
    ln = lengths.astype(np.int64)[np.arange(x.shape[1])[None, :], sym]
    esc = ln == 0
    return np.where(esc, lengths[:, 256].astype(np.int64)[None, :] + 8, ln), esc


def lookups(bits: np.ndarray, esc: np.ndarray, window: int, per_entry: int) -> int:
    """Greedy lookups over runs ``bits`` [R, 16] (one channel's 16 symbols a run): a lookup takes
    the next symbols while their bits fit ``window`` and they number at most ``per_entry``; an escape
    alone."""
    used = np.zeros(bits.shape[0], np.int64)
    k = np.zeros(bits.shape[0], np.int64)
    n = np.zeros(bits.shape[0], np.int64)
    for t in range(bits.shape[1]):
        b, e = bits[:, t], esc[:, t]
        new = (t == 0) | (used + b > window) | (k >= per_entry) | e
        n += new
        used = np.where(new, b, used + b)
        k = np.where(e, per_entry, np.where(new, 1, k + 1))  # an escape closes its lookup
    return int(n.sum())


def main():
    from weightszip import pages

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", action="append", required=True, help="KV sets (.npz of make_kv_subset.py, or .npy)")
    ap.add_argument("--out", help="JSON of the counts")
    args = ap.parse_args()
    sets = list(load_sets(args.kv))
    rows, total = [], {}
    for model, kind, layer, x in tqdm(sets, desc="sets"):
        x = tile_channels(x, LLAMA_C)
        half = x.shape[0] // 2
        _, _, C, lengths = pages.codebook_info(pages.calibrate(x[:half], "bfloat16", 8))
        held = x[half:][: (x.shape[0] - half) // 16 * 16]
        bits, esc = code_bits(held, lengths)
        # channel-major runs: [pages, C, 16] -> [pages * C, 16]
        runs = bits.reshape(-1, 16, C).transpose(0, 2, 1).reshape(-1, 16)
        runs_esc = esc.reshape(-1, 16, C).transpose(0, 2, 1).reshape(-1, 16)
        row = {"set": f"{model}:{kind}:{layer}", "symbols": int(bits.size), "bits_per_symbol": float(bits.mean()),
               "escapes": float(esc.mean())}
        for w in WINDOWS:
            for k in PER_ENTRY:
                row[f"W{w}K{k}"] = lookups(runs, runs_esc, w, k)
        rows.append(row)
        for key, v in row.items():
            if isinstance(v, int):
                total[key] = total.get(key, 0) + v
    print("symbols per lookup (now: 1.00; channel-major, W-bit window, up to K symbols an entry):")
    print("| set | bits/symbol | escapes | " + " | ".join(f"W{w} K{k}" for w in WINDOWS for k in PER_ENTRY) + " |")
    print("|---|---:|---:|" + "---:|" * (len(WINDOWS) * len(PER_ENTRY)))
    for r in rows + [dict(total, set="all", bits_per_symbol=float("nan"), escapes=float("nan"))]:
        print(f"| {r['set']} | {r['bits_per_symbol']:.2f} | {r['escapes']:.3f} | "
              + " | ".join(f"{r['symbols'] / r[f'W{w}K{k}']:.2f}" for w in WINDOWS for k in PER_ENTRY) + " |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({"sets": rows, "all": total}, indent=1))


if __name__ == "__main__":
    main()
