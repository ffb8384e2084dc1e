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

Entropy bounds flatter the contexts: a prefix code spends at least one bit a symbol, and a context
concentrates its channel's exponents on fewer symbols. So the same two models are also priced as
the page profile would code them: length-limited Huffman codes (max_len 8 or --max-len, the rarest symbols
escaped, as `PageCodebook::calibrate` in rust/core/src/page.rs builds them), calibrated on the
first half and charged on the second. The static code is the Rust calibrator's own codebook
(`pages.calibrate`); the per-context codes come from this script's copy of its length rule, which
is checked against the Rust lengths on every static channel first.

    python benchmarks/diag_exponent_context.py --kv .boxdata/kv_pages_subset.npz [--kv CAPTURE.npy] [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import heapq

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from bench_gpu_codec import load_sets  # noqa: E402

from weightszip import pages  # noqa: E402

PAGE = 16
MAX_LEN = 8
ESC = 256


def _huffman(weights: list[tuple[int, int]]) -> dict[int, int]:
    """Code lengths of a Huffman code over (weight, symbol) pairs (at least two)."""
    heap = [(w, i) for i, (w, _) in enumerate(weights)]
    heapq.heapify(heap)
    parent, nid = {}, len(weights)
    while len(heap) > 1:
        (wa, a), (wb, b) = heapq.heappop(heap), heapq.heappop(heap)
        parent[a] = parent[b] = nid
        heapq.heappush(heap, (wa + wb, nid))
        nid += 1
    out = {}
    for i, (_, sym) in enumerate(weights):
        d, j = 0, i
        while j in parent:
            j, d = parent[j], d + 1
        out[sym] = d
    return out


def limited_lengths(hist: np.ndarray, max_len: int = MAX_LEN) -> np.ndarray:
    """Bits to code each symbol 0..255 under the page profile's rule: Huffman over the seen symbols
    and the escape (count 1 plus the counts moved into it), the rarest seen symbol demoted to the
    escape until every length fits; an escaped symbol costs the escape's code and 8 bits."""
    live = [int(s) for s in np.flatnonzero(hist)]
    esc = 1
    while True:
        weights = [(int(hist[s]), s) for s in live] or [(0, 0)]
        lens = _huffman(weights + [(esc, ESC)])
        if max(lens.values()) <= max_len:
            cost = np.full(256, lens[ESC] + 8, np.int64)
            for sym, n in lens.items():
                if sym != ESC:
                    cost[sym] = n
            return cost
        rare = min(live, key=lambda s: (hist[s], -s))
        esc += int(hist[rare])
        live.remove(rare)


def codebook_costs(codebook: bytes) -> np.ndarray:
    """[channels, 256] bits per symbol under a page-profile codebook (escapes: escape code + 8)."""
    _, _, _, lengths = pages.codebook_info(codebook)
    lengths = lengths.astype(np.int64)
    return np.where(lengths[:, :256] > 0, lengths[:, :256], lengths[:, 256:257] + 8)


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
    ap.add_argument("--layers-per-model", type=int, default=4,
                    help="layers of each .npy capture, evenly spaced (default 4; a .npz subset keeps its own)")
    ap.add_argument("--max-len", type=int, default=MAX_LEN,
                    help=f"longest code of the Huffman pricing, 1..12 (default {MAX_LEN}, the calibrator's default)")
    ap.add_argument("--out", default=None, help="a JSON file for the results")
    args = ap.parse_args(argv)
    if not 1 <= args.max_len <= 12:
        ap.error("--max-len must be 1..12")
    rows = []
    for model, kind, layer, x in load_sets(args.kv, args.layers_per_model):
        e = (np.asarray(x, dtype=np.uint16) >> 7 & 0xFF).astype(np.int64)
        half = e.shape[0] // 2 // PAGE * PAGE
        static, prev, huff_static, huff_prev = [], [], [], []
        rust_costs = codebook_costs(pages.calibrate(np.asarray(x[:half], np.uint16), "bfloat16", args.max_len)) \
            if e.shape[1] % 32 == 0 else None
        for ch in range(e.shape[1]):
            tr, te = e[:half, ch], e[half:, ch]
            zeros_tr, zeros_te = np.zeros_like(tr), np.zeros_like(te)
            static.append(cross_entropy(tr, te, zeros_tr, zeros_te, 1))
            mode = int(np.bincount(tr).argmax())
            ctx_tr, ctx_te = context(tr, mode), context(te, mode)
            prev.append(cross_entropy(tr, te, ctx_tr, ctx_te, 5))
            mine = limited_lengths(np.bincount(tr, minlength=256), args.max_len)
            if rust_costs is not None:
                # Huffman's ties may give other lengths of the same total on the calibration half.
                assert (mine[tr].sum() == rust_costs[ch][tr].sum()), "the copy of the length rule disagrees with Rust"
            huff_static.append((mine if rust_costs is None else rust_costs[ch])[te].mean())
            bits = sum(limited_lengths(np.bincount(tr[ctx_tr == c], minlength=256), args.max_len)[te[ctx_te == c]].sum()
                       for c in range(5) if (ctx_te == c).any())
            huff_prev.append(bits / te.size)
        s, p = float(np.mean(static)), float(np.mean(prev))
        hs, hp = float(np.mean(huff_static)), float(np.mean(huff_prev))
        rows.append(dict(set=f"{model}:{kind}:{layer}", kind=kind, layer=layer, static_bits=s, prev_token_bits=p,
                         gain_bits=s - p, static_ratio=(8 + s) / 16, prev_token_ratio=(8 + p) / 16,
                         huffman_static_bits=hs, huffman_prev_token_bits=hp, huffman_gain_bits=hs - hp,
                         huffman_static_ratio=(8 + hs) / 16, huffman_prev_token_ratio=(8 + hp) / 16))
    print("| set | static bits | previous-token bits | gain | Huffman static | Huffman previous-token | Huffman gain |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['set']} | {r['static_bits']:.3f} | {r['prev_token_bits']:.3f} | {r['gain_bits']:.3f} | "
              f"{r['huffman_static_bits']:.3f} | {r['huffman_prev_token_bits']:.3f} | {r['huffman_gain_bits']:.3f} |")
    keys = ("static_ratio", "prev_token_ratio", "gain_bits", "huffman_static_ratio", "huffman_prev_token_ratio",
            "huffman_gain_bits")
    mean = {k: float(np.mean([r[k] for r in rows])) for k in keys}
    print(f"mean over sets, entropy bounds: ratio {mean['static_ratio']:.4f} -> {mean['prev_token_ratio']:.4f} "
          f"({mean['gain_bits']:.3f} bits per value)")
    print(f"mean over sets, Huffman codes (max_len {args.max_len}): ratio {mean['huffman_static_ratio']:.4f} -> "
          f"{mean['huffman_prev_token_ratio']:.4f} ({mean['huffman_gain_bits']:.3f} bits per value)")
    out = dict(command=" ".join(["python", "benchmarks/diag_exponent_context.py", *(argv or sys.argv[1:])]),
               max_len=args.max_len, rows=rows, mean=mean)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(out, indent=1))
    return out


if __name__ == "__main__":
    main()
