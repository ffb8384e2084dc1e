"""How small can a tile-decodable lossless KV page get? KV Exact codes each bf16 exponent in a fixed
3-bit code against a per-channel window (raw sign + mantissa byte kept): 11 bits per value plus
escapes, about 0.70 of bf16. This measures, on real KV (held-out halves), the options with fixed
code widths per channel and the bound any static per-channel exponent code has:

- 3-bit: KV Exact as it is (window of 7 exponents, escape = 8 more bits);
- 2-bit: window of 3, escape = 8 more bits;
- mixed: each channel takes 2 or 3 bits, whichever its calibration half codes smaller;
- entropy: the empirical entropy of each channel's exponent on the held-out half (a per-channel
  Huffman or ANS code approaches it: the exact page profile's Huffman pages reach 0.662-0.666);
- page-adaptive: no calibration; each 16-token page codes each channel in the fewest bits that span
  its 16 exponents (width 0-8) above their minimum, with a 12-bit header per page and channel
  (4-bit width, 8-bit base): still fixed-width, so still tile-decodable.
- static: the cross-entropy of the held-out exponents under each channel's distribution counted
  on the calibration half (add-0.01 smoothing): what a static per-channel entropy code calibrated
  once can reach, at best;
- static + mantissa bit: the same for the exponent and the mantissa's top bit coded as one symbol
  (7 raw bits left): whether the top mantissa bit, given the exponent, is worth coding.

Every ratio is (8 raw bits + exponent bits) / 16, page headers not counted (but for page-adaptive's
per-channel header, which is the scheme).

    python benchmarks/diag_kv_exact_widths.py --kv .boxdata/kv_pages_subset.npz [--out JSON]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_gpu_codec import load_sets  # noqa: E402


def best_tops(e: np.ndarray, width: int) -> np.ndarray:
    """Per channel, the window top whose window of 2**width - 1 exponents holds the most values."""
    w = 2**width - 1
    tops = np.arange(256)
    out = np.empty(e.shape[1], dtype=np.int64)
    for c in range(e.shape[1]):
        cs = np.concatenate([[0], np.cumsum(np.bincount(e[:, c], minlength=256))])
        out[c] = (cs[np.minimum(tops + 1, 256)] - cs[np.maximum(tops - w + 1, 0)]).argmax()
    return out


def code_bits(e: np.ndarray, tops: np.ndarray, width: int) -> np.ndarray:
    """Mean exponent bits per channel: the code plus 8 bits per escape."""
    d = tops[None, :] - e
    esc = ~((d >= 0) & (d < 2**width - 1))
    return width + 8 * esc.mean(0)


def page_adaptive_bits(e: np.ndarray) -> float:
    """Mean exponent bits per value when each 16-token page codes each channel in the bits its
    exponents span (ceil(log2(max - min + 1))), plus 12 header bits per page and channel."""
    p = e[: e.shape[0] // 16 * 16].reshape(-1, 16, e.shape[1])
    width = np.ceil(np.log2(p.max(1) - p.min(1) + 1))
    return float((16 * width + 12).mean() / 16)


def entropy_bits(e: np.ndarray) -> np.ndarray:
    out = np.empty(e.shape[1])
    for c in range(e.shape[1]):
        p = np.bincount(e[:, c], minlength=256) / e.shape[0]
        p = p[p > 0]
        out[c] = -(p * np.log2(p)).sum()
    return out


def static_bits(cal: np.ndarray, ev: np.ndarray, n_symbols: int) -> np.ndarray:
    """Mean bits per held-out symbol, per channel, under the channel's calibration-half counts
    (plus 0.01 each, so unseen symbols cost a finite amount)."""
    out = np.empty(cal.shape[1])
    for c in range(cal.shape[1]):
        p = np.bincount(cal[:, c], minlength=n_symbols) + 0.01
        out[c] = -np.log2(p[ev[:, c]] / p.sum()).mean()
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv", action="append", required=True)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    rows = []
    for model, kind, layer, x in load_sets(args.kv):
        xi = x.astype(np.int32)
        e = (xi >> 7) & 0xFF  # [T, C] exponents
        em = (xi >> 6) & 0x1FF  # exponent and the mantissa's top bit
        cal, ev = e[: e.shape[0] // 2], e[e.shape[0] // 2:]
        t3, t2 = best_tops(cal, 3), best_tops(cal, 2)
        b3, b2 = code_bits(ev, t3, 3), code_bits(ev, t2, 2)
        pick2 = code_bits(cal, t2, 2) < code_bits(cal, t3, 3)
        mixed = np.where(pick2, b2, b3)  # the width is calibration data per channel, like the window top
        ratio = lambda b: float((8 + b.mean()) / 16)  # noqa: E731
        raw = ((xi >> 8) & 0x80) | (xi & 0x7F)  # sign + mantissa byte
        rows.append(dict(model=model, kind=kind, layer=layer, three_bit=ratio(b3), two_bit=ratio(b2), mixed=ratio(mixed),
                         two_bit_channels=float(pick2.mean()), entropy=ratio(entropy_bits(ev)),
                         page_adaptive=float((8 + page_adaptive_bits(ev)) / 16),
                         raw_byte_entropy_bits=float(entropy_bits(raw[raw.shape[0] // 2:]).mean()),
                         static=ratio(static_bits(cal, ev, 256)),
                         static_mantissa_bit=float((7 + static_bits(em[: len(em) // 2], em[len(em) // 2:], 512).mean()) / 16)))
        r = rows[-1]
        print(f"{model:8s} {kind} layer {layer:2d}: 3-bit {r['three_bit']:.4f}  2-bit {r['two_bit']:.4f}  "
              f"mixed {r['mixed']:.4f} ({r['two_bit_channels']:.0%} 2-bit)  entropy {r['entropy']:.4f}  "
              f"page-adaptive {r['page_adaptive']:.4f}  static {r['static']:.4f}  +mantissa bit {r['static_mantissa_bit']:.4f}  "
              f"raw byte {r['raw_byte_entropy_bits']:.3f} bits")
    mean = {k: float(np.mean([r[k] for r in rows]))
            for k in ("three_bit", "two_bit", "mixed", "entropy", "page_adaptive", "static", "static_mantissa_bit",
                      "raw_byte_entropy_bits")}
    print("mean: " + "  ".join(f"{k} {v:.4f}" for k, v in mean.items()))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(dict(rows=rows, mean=mean), indent=1) + "\n")


if __name__ == "__main__":
    main()
