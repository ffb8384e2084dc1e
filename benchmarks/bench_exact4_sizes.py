#!/usr/bin/env python3
"""KV Exact4's validating GPU decoder at 1, 2 and 4 GiB of real KV: a new output tensor per call
against the caller's (``out=``), each call timed with its host sync (the verdict), median of
``--repeats``. Real K/V (``bench_gpu_codec.load_sets``) tiled to the Llama-3.1-8B shape (8 KV heads x
128). Needs a GPU.

    python benchmarks/bench_exact4_sizes.py --kv .boxdata/kv_pages_subset.npz --repeats 9 --out $OUT/sizes.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_codec import _timed, load_sets, tile_channels  # noqa: E402
from weightszip.kernels import kv_exact4_codec as C4  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv", action="append", required=True, help=".npy from capture_kv.py or .npz subset")
    ap.add_argument("--gib", default="1,2,4", help="sizes in GiB, comma-separated")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--out", default=None, help="a JSON file for the results")
    args = ap.parse_args()
    xs = [tile_channels(x, 1024) for *_, x in load_sets(args.kv)]
    vu = torch.from_numpy(np.concatenate([x[: x.shape[0] // 16 * 16] for x in xs]).view(np.int16)
                          .reshape(-1, 16, 8, 128)).cuda()
    rows = []
    for gib in (float(g) for g in args.gib.split(",")):
        big = vu.repeat(-(-int(gib * (1 << 30)) // (vu.numel() * 2)), 1, 1, 1)
        raw = big.numel() * 2
        gb, go = C4.encode_pages(big)
        exact = torch.equal(C4.decode_pages(gb, go, 8, 128), big)
        out = torch.empty_like(big)
        td, tds = _timed(lambda: C4.decode_pages(gb, go, 8, 128), args.repeats, torch)
        to, tos = _timed(lambda: C4.decode_pages(gb, go, 8, 128, out=out), args.repeats, torch)
        exact &= torch.equal(out, big)
        rows.append(dict(raw_bytes=raw, new_output_GBps=raw / td / 1e9, out_GBps=raw / to / 1e9,
                         new_output_times=tds, out_times=tos, exact=exact))
        print(f"{raw / 1e9:.2f} GB: validating decode {raw / td / 1e9:.0f} GB/s ({td * 1e6:.0f} us), out= "
              f"{raw / to / 1e9:.0f} GB/s ({to * 1e6:.0f} us; calls {min(tos) * 1e6:.0f}-{max(tos) * 1e6:.0f} us), "
              f"exact {exact}", flush=True)
        del big, gb, go, out
        torch.cuda.empty_cache()
    if args.out:
        Path(args.out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                                  command=" ".join(sys.argv), rows=rows), indent=1))


if __name__ == "__main__":
    main()
