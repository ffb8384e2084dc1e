#!/usr/bin/env python3
"""The exact-page decoders side by side on the real pages of ``--kv`` (the 16 sets, tiled to the
Llama-3.1-8B shape as bench_gpu_codec.py tiles them, repeated ``--rep`` times), each checked for a
bit-exact round trip and timed (bench_gpu_codec's CUDA-event timing: median of 10 after one warm-up): the Triton decoder
(``triton:BLOCK_PAGES``) and the Gluon one (``gluon:BLOCK_PAGES:STAGE[:1]``, STAGE words per page
staged in shared memory, 0 for none; a last field 1: the STAGE slots are a ring refilled every 8
symbols); ``triton:BLOCK_PAGES:WARPS`` with fewer warps than BLOCK_PAGES / 32 gives each thread several
pages; ``enc:BLOCK_PAGES[:WARPS]`` times the Triton encoder's second pass (its bytes checked against
``encode_pages``'s). With ``--ncu`` one launch each, for Nsight Compute:

    python benchmarks/probe_exact_decoders.py --kv .boxdata/kv_pages_subset.npz
    ncu --clock-control none -k regex:"decode_kernel" -c 3 --section WarpStateStats ... \
        python benchmarks/probe_exact_decoders.py --ncu --rep 2 triton:32 gluon:64:0 gluon:64:64
"""
import argparse
import sys
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gpu_codec import _timed, calibrated_sets, device_pages  # noqa: E402

from weightszip.kernels import exact_page_gluon as eg  # noqa: E402
from weightszip.kernels.exact_page import PageTables, decode_into, encode_into, encode_pages, page_layout  # noqa: E402

ap = argparse.ArgumentParser()
ap.add_argument("--kv", default=".boxdata/kv_pages_subset.npz")
ap.add_argument("--rep", type=int, default=4)
ap.add_argument("--ncu", action="store_true")
ap.add_argument("variants", nargs="*", default=["triton:32", "gluon:32:0", "gluon:32:64", "gluon:64:64",
                                                   "gluon:64:16:1", "gluon:128:16:1", "gluon:256:16:1"])
a = ap.parse_args()
tb, vu, tu = device_pages(calibrated_sets([a.kv]), "cuda", PageTables)
vu, tu = vu.repeat(a.rep, 1, 1), tu.repeat(a.rep)
b, o = encode_pages(vu, tb, tu)
out = torch.empty_like(vu)
print(f"{vu.numel() * 2 / 1e9:.3f} GB of bf16, ratio {b.numel() / vu.numel() / 2:.4f}", flush=True)


layout = None


def run(v):
    global layout
    k, *rest = v.split(":")
    if k == "triton":  # triton:BLOCK_PAGES[:WARPS] (fewer warps than BLOCK_PAGES / 32: pages per thread)
        decode_into(b, o, tb, out, tu, int(rest[0]), kernel="triton", num_warps=int(rest[1]) if len(rest) > 1 else None)
    elif k == "enc":  # the Triton encoder's pass 2 into ``eb``, enc:BLOCK_PAGES[:WARPS]
        layout = layout or page_layout(vu, tb, tu)
        encode_into(vu, tb, tu, eb, layout, int(rest[0]), num_warps=int(rest[1]) if len(rest) > 1 else None)
    else:
        eg.decode_into(b, o, tb.wlut, tb.max_len, tb.channels, tb.is_bf16, out, tu, *map(int, rest))


eb = torch.empty_like(b)
for v in tqdm(a.variants, desc="decoders", disable=a.ncu):
    out.zero_()
    eb.zero_()
    run(v)
    torch.cuda.synchronize()
    ok = bool(torch.equal(eb, b) if v.startswith("enc") else torch.equal(out, vu))
    if a.ncu:
        print(v, "exact", ok, flush=True)
        continue
    t, _ = _timed(lambda: run(v), 10, torch)
    tqdm.write(f"{v:>14} exact {ok}  {t * 1e3:.3f} ms  {vu.numel() * 2 / t / 1e9:.0f} GB/s")
