"""Would the exact page profile get smaller if each exponent were coded in the context of the one
before it in its channel? Within a page, a stream is decoded in token order (FORMAT.md, "Exact page
profile"), so the previous token's exponent of the same channel is already known to the decoder:
conditioning on it costs no parallelism, only more tables. This measures the gain on real KV
(held-out halves), as cross-entropies in bits per value of a code calibrated on the first half:

- static: one distribution per channel (what version 1 codes, less Huffman's rounding);
- previous token: one distribution per channel and context, the context the previous token's
  exponent against the channel's most common one (<= -2, -1, 0, >= +1), and a fifth for a page's
  first token (no previous one in the page).

Distributions are smoothed (0.5 on the symbols the channel's calibration half has, 1e-3 elsewhere).
A ratio is (8 raw bits + exponent bits) / 16, side data not counted.

    python benchmarks/diag_exponent_context.py --kv .boxdata/kv_pages_subset.npz [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_gpu_codec import load_sets  # noqa: E402

PAGE = 16


def cross_entropy(train: np.ndarray, test: np.ndarray, ctx_train: np.ndarray, ctx_test: np.ndarray, n_ctx: int) -> float:
    """Bits per symbol of ``test`` under per-context distributions fitted on ``train``."""
    seen = np.bincount(train, minlength=256) > 0
    bits = 0.0
    for c in range(n_ctx):
        te = test[ctx_test == c]
        if te.size:
            cnt = np.bincount(train[ctx_train == c], minlength=256) + 0.5 * seen + 1e-3
            bits -= np.log2(cnt[te] / cnt.sum()).sum()
    return bits / test.size


def context(e: np.ndarray, mode: int) -> np.ndarray:
    prev = np.roll(e, 1)
    ctx = np.clip(prev - mode + 2, 0, 3)
    ctx[::PAGE] = 4
    return ctx


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv", action="append", required=True, help=".npy from capture_kv.py or .npz subset")
    ap.add_argument("--out", default=None, help="a JSON file for the results")
    args = ap.parse_args(argv)
    rows = []
    for model, kind, layer, x in load_sets(args.kv):
        e = (np.asarray(x, dtype=np.uint16) >> 7 & 0xFF).astype(np.int64)
        half = e.shape[0] // 2 // PAGE * PAGE
        static, prev = [], []
        for ch in range(e.shape[1]):
            tr, te = e[:half, ch], e[half:, ch]
            zeros_tr, zeros_te = np.zeros_like(tr), np.zeros_like(te)
            static.append(cross_entropy(tr, te, zeros_tr, zeros_te, 1))
            mode = int(np.bincount(tr).argmax())
            prev.append(cross_entropy(tr, te, context(tr, mode), context(te, mode), 5))
        s, p = float(np.mean(static)), float(np.mean(prev))
        rows.append(dict(set=f"{model}:{kind}:{layer}", kind=kind, layer=layer, static_bits=s, prev_token_bits=p,
                         gain_bits=s - p, static_ratio=(8 + s) / 16, prev_token_ratio=(8 + p) / 16))
    print("| set | static bits | previous-token bits | gain | ratio static | ratio previous-token |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['set']} | {r['static_bits']:.3f} | {r['prev_token_bits']:.3f} | {r['gain_bits']:.3f} | "
              f"{r['static_ratio']:.4f} | {r['prev_token_ratio']:.4f} |")
    mean = {k: float(np.mean([r[k] for r in rows])) for k in ("static_ratio", "prev_token_ratio", "gain_bits")}
    print(f"mean over sets: ratio {mean['static_ratio']:.4f} -> {mean['prev_token_ratio']:.4f} "
          f"({mean['gain_bits']:.3f} bits per value)")
    out = dict(command=" ".join(["python", "benchmarks/diag_exponent_context.py", *(argv or sys.argv[1:])]),
               rows=rows, mean=mean)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
