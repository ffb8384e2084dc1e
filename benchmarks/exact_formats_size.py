"""Bits per value of KV Exact and KV Exact4 pages on held-out real K/V: the figures `weightszip capacity`
counts for kv-exact and kv-exact4 by default (capacity.EXACT_DEFAULT_BITS).

    python benchmarks/exact_formats_size.py --kv .boxdata/kv_pages_subset.npz \
        --out benchmarks/results/exact_formats_size.json

Each (model, layer, K/V) set of the capture ([tokens, channels] bf16 bits) is tiled along channels to
the Llama-3.1-8B shape (8 KV heads x 128) and measured by `capacity.measure_exact_formats` (the Rust
encoders on the second half of its tokens, KV Exact's window tops fitted on the first half; every page
byte and its 8-byte offset counted), one set at a time and all together."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_codec import load_sets, tile_channels  # noqa: E402

from weightszip.eval.capacity import measure_exact_formats  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv", required=True, help="a KV capture (.npz of [tokens, channels] sets, as bench_gpu_codec reads)")
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    c = a.heads * a.head_dim
    sets, rows = [], []
    for model, kind, layer, x in load_sets([a.kv]):
        x = tile_channels(x, c)
        x = x[: x.shape[0] // 64 * 64].reshape(-1, a.heads, a.head_dim)
        bits = measure_exact_formats(x)
        rows.append({"set": f"{model}:{kind}:{layer}", "tokens": x.shape[0],
                     **{k: float(v) for k, v in bits.items()}, **{f"{k}_of_bf16": float(v / 16) for k, v in bits.items()}})
        sets.append(x)
        print(json.dumps(rows[-1]), flush=True)
    same = len({s.shape for s in sets}) == 1
    total = measure_exact_formats(np.stack(sets)) if same else None
    res = {"capture": a.kv, "shape": [a.heads, a.head_dim], "sets": rows,
           "all_sets_bits": {k: float(v) for k, v in total.items()} if total else None,
           "mean_of_sets_bits": {k: float(np.mean([r[k] for r in rows])) for k in ("kv-exact", "kv-exact4")}}
    print("all sets:", res["all_sets_bits"], "mean of sets:", res["mean_of_sets_bits"])
    Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
