#!/usr/bin/env python3
"""KV Exact4 GPU codec probe: encode and validating decode at several warps per program, and the
attention kernel's tile loader at several pages per tile, on real KV tiled to 1 GiB (H200 sweeps of
BENCHMARKS.md, "KV Exact4 as a GPU codec"). Checks the encoder against the reference first.

    python benchmarks/probe_exact4_codec.py --kv .boxdata/kv_pages_subset.npz --warps 1,2,4,8
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_codec import _timed, load_sets, tile_channels  # noqa: E402

from weightszip.kernels import kv_exact4_codec as C4  # noqa: E402
from weightszip.kernels import kv_exact4_ref as R4  # noqa: E402
from weightszip.kernels.paged_decode import dequantize_exact4_pages  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", action="append", required=True)
    ap.add_argument("--warps", default="1,2,4,8")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=10)
    args = ap.parse_args()
    xs = [tile_channels(x, 1024) for *_, x in load_sets(args.kv)]
    vu = torch.from_numpy(np.concatenate([x[: x.shape[0] // 16 * 16] for x in xs]).view(np.int16)
                          .reshape(-1, 16, 8, 128)).cuda()
    big = vu.repeat(-(-int(args.gib * (1 << 30)) // (vu.numel() * 2)), 1, 1, 1)
    raw = big.numel() * 2
    gb, go = C4.encode_pages(big)
    rb, ro = R4.encode_pages(vu).to_bytes()
    sb, so = C4.encode_pages(vu)
    print("encoder equals the reference", torch.equal(sb, rb) and torch.equal(so, ro), "ratio", gb.numel() / raw, flush=True)
    print("validating decode round trip", torch.equal(C4.decode_pages(gb, go, 8, 128), big), flush=True)
    starts = go[:-1].contiguous()
    for w in [int(a) for a in args.warps.split(",")]:
        ent, _ = C4.page_entries(big, num_warps=w)
        te, _ = _timed(lambda: C4.encode_pages(big, num_warps=w), args.repeats, torch)
        ts, _ = _timed(lambda: C4.page_entries(big, num_warps=w), args.repeats, torch)
        tw, _ = _timed(lambda: C4.write_pages(big, ent, starts, gb, num_warps=w), args.repeats, torch)
        td, _ = _timed(lambda: C4.decode_pages(gb, go, 8, 128, num_warps=w), args.repeats, torch)
        print(f"warps {w}: encode {raw / te / 1e9:.0f} GB/s (sizes {raw / ts / 1e9:.0f}, write {raw / tw / 1e9:.0f}), "
              f"validating decode {raw / td / 1e9:.0f} GB/s", flush=True)
    for npg in (1, 2, 4):
        tt, _ = _timed(lambda: dequantize_exact4_pages(gb, starts, 8, 128, pages_per_tile=npg), args.repeats, torch)
        print(f"tile loader {npg} pages/tile: {raw / tt / 1e9:.0f} GB/s", flush=True)
    flat = big.reshape(-1)
    tc, _ = _timed(lambda: flat.clone(), args.repeats, torch)
    print(f"d2d copy {2 * raw / tc / 1e9:.0f} GB/s (read + write)", flush=True)


if __name__ == "__main__":
    main()
