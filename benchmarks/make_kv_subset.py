#!/usr/bin/env python3
"""Cut the GPU benchmarks' real-KV subset out of whole captures: a few layers per model, K and V,
the first N tokens, as one .npz small enough to travel with a GPU-box call.

Each key is ``model:kind:layer`` (model = the capture file's stem, kind = K or V), each array
[tokens, kv_heads * head_dim] uint16 (bf16 bits), the layout ``bench_gpu_codec.load_sets`` reads.
The default (4 layers evenly spaced per model, 4096 tokens) is the subset the GPU figures in
BENCHMARKS.md were measured on::

    python benchmarks/capture_kv.py --model smollm2 --text ../shared/data/text/paul_graham --tokens 8192 -o /tmp/kv/smollm2_8k.npy
    python benchmarks/capture_kv.py --model qwen2.5 --text ../shared/data/text/code/lua_src.c --tokens 8192 -o /tmp/kv/qwen_8k.npy
    python benchmarks/make_kv_subset.py /tmp/kv/smollm2_8k.npy /tmp/kv/qwen_8k.npy -o .boxdata/kv_pages_subset.npz
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def subset(paths, layers_per_model: int, tokens: int) -> dict[str, np.ndarray]:
    out = {}
    for p in map(Path, paths):
        kv = np.load(p)["kv"] if p.suffix == ".npz" else np.load(p, mmap_mode="r")  # [2, layers, tokens, channels]
        if kv.ndim != 4 or kv.shape[0] != 2 or kv.dtype != np.uint16:
            raise SystemExit(f"{p}: expected a capture_kv.py array [2, layers, tokens, C] uint16, got {kv.shape} {kv.dtype}")
        if kv.shape[2] < tokens:
            raise SystemExit(f"{p}: {kv.shape[2]} tokens, fewer than --tokens {tokens}")
        n_layers = kv.shape[1]  # layers i * L // (k - 1), the last one L - 1: 0/10/20/29 of 30, 0/8/16/23 of 24
        for layer in sorted({min(n_layers - 1, i * n_layers // max(1, layers_per_model - 1)) for i in range(layers_per_model)}):
            for k, kind in enumerate("KV"):
                out[f"{p.stem}:{kind}:{int(layer)}"] = np.ascontiguousarray(kv[k, layer, :tokens])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("captures", nargs="+", help=".npy (or .npz) files from capture_kv.py")
    ap.add_argument("-o", "--out", required=True, type=Path)
    ap.add_argument("--layers", type=int, default=4, help="layers per model, evenly spaced (first and last included)")
    ap.add_argument("--tokens", type=int, default=4096, help="the first this many tokens")
    a = ap.parse_args()
    sets = subset(a.captures, a.layers, a.tokens)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez(a.out, **sets)
    mb = sum(x.nbytes for x in sets.values()) / 1e6
    print(f"{len(sets)} sets, {mb:.1f} MB -> {a.out}: {', '.join(sorted(sets))}")


if __name__ == "__main__":
    main()
