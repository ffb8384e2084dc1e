#!/usr/bin/env python3
"""One launch of each kernel named on the command line, for Nsight Compute (nothing is timed here):
``exact`` (the exact-page decoder on 268 MB of real pages, 32 and 64 pages per program), ``kvx4``
and ``kvx4-bf16`` (the split kernel over KV Exact4 pages of real KV and over the same pages in bf16,
both at the KV Exact4 config, batch 8 x 32k) and the
decode-attention split kernel for ``fp8`` (the default: the Gluon fp8 kernel; ``fp8+triton``: the Triton one) or a
compact kind of bench_decode_attention.py (``q4``, ``q3+rope24``, ``q4+rope24+lanes``, ...; its suffix changes
the compact default as there) at the Llama-3.1-8B shape,
batch 64 x 32k (random pages, made as bench_decode_attention.py makes them; ``--point
llama70b-tp8:8:32768``: another shape, batch and context, as ab_decode_configs.py names them).

    ncu --clock-control none -k regex:"_decode_kernel|_paged_split_kernel|compact_split_kernel|fp8_split_kernel" -c 8 \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis --section SchedulerStats \\
        python benchmarks/ncu_probe.py --kv .boxdata/kv_pages_subset.npz exact fp8 q4 q3 > ncu.txt
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_decode_attention import COMPACT, SHAPES, compact_inputs, kind_config, make_paged  # noqa: E402
from bench_gpu_codec import calibrated_sets, device_pages  # noqa: E402

from weightszip.kernels import PagedDecodeAttention  # noqa: E402
from weightszip.kernels.exact_page import PageTables, decode_pages, encode_pages  # noqa: E402


def exact(kv):
    tb, vu, tu = device_pages(calibrated_sets([kv]), "cuda", PageTables)
    vu, tu = vu.repeat(2, 1, 1), tu.repeat(2)
    b, o = encode_pages(vu, tb, tu)
    for bp in (32, 64):
        out = decode_pages(b, o, tb, table_ids=tu, block_pages=bp)
    torch.cuda.synchronize()
    print("exact: round trip", bool(torch.equal(out, vu)), f"{vu.numel() * 2 / 1e9:.2f} GB", flush=True)


def attention(kind, B=64, L=32768, Hq=32, Hkv=8, D=128):
    gen = torch.Generator(device="cuda")
    gen.manual_seed(0)
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device="cuda", generator=gen)
    if kind in ("fp8", "fp8+triton"):
        from weightszip.kernels import DEFAULT_CONFIGS
        from weightszip.kernels.paged_decode import PAGE_FP8

        k, v, bt = make_paged(B, L, Hkv, D, torch.float8_e4m3fn, gen)
        cfg = dataclasses.replace(DEFAULT_CONFIGS[PAGE_FP8], gluon=kind == "fp8")
        attn = PagedDecodeAttention(Hq, Hkv, D, page_type="fp8", device="cuda", config=cfg)
        attn.plan([L] * B, bt)
        s = torch.full((Hkv,), 1 / 64, device="cuda")
        attn.run(q, k, v, k_scale=s, v_scale=s)
    else:
        kp, vp, bt, tabs, extra = compact_inputs(kind, B, L, Hq, Hkv, D, gen)
        kb, vb = COMPACT[kind]
        from weightszip.kernels import DEFAULT_CONFIGS
        from weightszip.kernels.paged_decode import PAGE_COMPACT

        cfg = kind_config(kind) or DEFAULT_CONFIGS[PAGE_COMPACT]
        attn = PagedDecodeAttention(Hq, Hkv, D, page_type="compact", k_bits=kb, v_bits=vb, device="cuda", config=cfg)
        attn.plan([L] * B, bt, rope="rope_coef" in extra)
        attn.run(q, kp, vp, **tabs, **extra)
    torch.cuda.synchronize()
    print(kind, "ran", flush=True)


def kv_exact4(kv, bf16: bool, B=8, L=32768):
    """One decode-attention step over real KV as KV Exact4 pages (or the same pages in bf16)."""
    from bench_kv_exact import HKV, HQ, D, build_pool, llama_pages
    from bench_gpu_codec import load_sets

    from weightszip.kernels import DEFAULT_CONFIGS
    from weightszip.kernels.paged_decode import PAGE_EXACT4

    sets = {(m, k, layer): x for m, k, layer, x in load_sets([kv])}
    (mk, _, lk) = sorted(sets)[0]
    n = B * L // 16
    k_bf, k_heap, k_off, _ = build_pool(llama_pages(sets[(mk, "K", lk)]), None, n, "exact4")
    v_bf, v_heap, v_off, _ = build_pool(llama_pages(sets[(mk, "V", lk)]), None, n, "exact4")
    gen = torch.Generator(device="cuda").manual_seed(0)
    bt = torch.randperm(n, device="cuda", generator=gen).to(torch.int32).view(B, L // 16)
    q = torch.randn(B, HQ, D, dtype=torch.bfloat16, device="cuda", generator=gen)
    cfg = DEFAULT_CONFIGS[PAGE_EXACT4]
    attn = PagedDecodeAttention(HQ, HKV, D, page_type="bf16" if bf16 else "exact4", device="cuda", config=cfg)
    attn.plan([L] * B, bt)
    if bf16:
        attn.run(q, k_bf, v_bf)
    else:
        attn.run(q, k_heap, v_heap, k_offsets=k_off, v_offsets=v_off)
    torch.cuda.synchronize()
    print("kvx4-bf16" if bf16 else "kvx4", "ran", flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", default=".boxdata/kv_pages_subset.npz", help="real KV sets (for exact)")
    ap.add_argument("--point", default="llama8b:64:32768",
                    help="shape:batch:context of the decode-attention kernels, not exact or kvx4 (shapes: %s)"
                    % ", ".join(SHAPES))
    ap.add_argument("kernels", nargs="+", choices=["exact", "kvx4", "kvx4-bf16", "fp8", "fp8+triton", *COMPACT])
    args = ap.parse_args()
    parts = args.point.split(":")
    if (len(parts) != 3 or parts[0] not in SHAPES or not all(x.isascii() and x.isdigit() for x in parts[1:])
            or int(parts[1]) < 1 or int(parts[2]) < 16 or int(parts[2]) % 16):
        ap.error(f"--point must be shape:batch:context (a known shape, a positive batch, a context that is a "
                 f"positive multiple of 16), not {args.point!r}")
    shape, batch, context = parts
    Hq, Hkv, D = SHAPES[shape]
    for k in args.kernels:
        if k == "exact":
            exact(args.kv)
        elif k.startswith("kvx4"):
            kv_exact4(args.kv, k == "kvx4-bf16")
        else:
            attention(k, B=int(batch), L=int(context), Hq=Hq, Hkv=Hkv, D=D)


if __name__ == "__main__":
    main()
