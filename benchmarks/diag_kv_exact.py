"""KV Exact diagnostics on the GPU (BENCHMARKS.md, "KV Exact", bit identity): the kernel's tile loader
(1, 2 and 4 pages per tile) over every page of a 131072-block pool (3 GB of heap, offsets past 2**31) against the bf16 pool;
the attention output of KV Exact pages against the bf16 kernel with the same config (differences
counted); the bf16 kernel against itself at two pipeline depths.

    python benchmarks/diag_kv_exact.py --kv .boxdata/kv_pages_subset.npz
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from bench_gpu_codec import load_sets  # noqa: E402
from bench_kv_exact import C, D, HKV, build_pool, llama_pages  # noqa: E402


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv", default=".boxdata/kv_pages_subset.npz")
    args = p.parse_args()
    from weightszip.kernels import KernelConfig, PagedDecodeAttention
    from weightszip.kernels import kv_exact_ref as R
    from weightszip.kernels.paged_decode import dequantize_exact_pages

    sets = {(m, k, layer): x for m, k, layer, x in load_sets([args.kv])}
    kp, vp = llama_pages(sets[("qwen2.5", "K", 8)]), llama_pages(sets[("qwen2.5", "V", 8)])
    kb = R.calibrate_bases(kp[:128].reshape(-1, C)).reshape(HKV, D)
    vb = R.calibrate_bases(vp[:128].reshape(-1, C)).reshape(HKV, D)
    n = 131072
    k_bf, k_heap, k_off, _ = build_pool(kp, kb, n)
    v_bf, v_heap, v_off, _ = build_pool(vp, vb, n)
    kb, vb = kb.cuda(), vb.cuda()
    for npt in (1, 2, 4):
        bad = 0
        for i in range(0, n, 16384):
            got = dequantize_exact_pages(k_heap, k_off[i:i + 16384].contiguous(), kb, HKV, D, pages_per_tile=npt)
            bad += int((got.view(torch.bfloat16).transpose(1, 2) != k_bf[i:i + 16384]).sum().item())
        print(json.dumps(dict(heap_bytes=k_heap.numel(), pages_per_tile=npt, loader_values_differing=bad)), flush=True)

    gen = torch.Generator(device="cuda").manual_seed(0)
    perm = torch.randperm(n, device="cuda", generator=gen).to(torch.int32)
    B, L, hq = 8, 32768, 32
    tables = {"perm": perm[:B * L // 16].view(B, -1),
              "seq": torch.arange(B * L // 16, device="cuda", dtype=torch.int32).view(B, -1)}

    def run(page_type, cfg, bt, q, side):
        att = PagedDecodeAttention(hq, HKV, D, page_type=page_type, window=16, config=cfg, device="cuda")
        att.plan([L] * B, bt)
        if page_type == "exact":
            return att.run(q, k_heap, v_heap, k_side=side[0], v_side=side[1], k_offsets=k_off, v_offsets=v_off,
                           k_bases=kb, v_bases=vb)
        return att.run(q, k_bf, v_bf, k_side=side[0], v_side=side[1])

    q = torch.randn(B, hq, D, dtype=torch.bfloat16, device="cuda", generator=gen)
    side = torch.randn(2, B, 16, HKV, D, dtype=torch.bfloat16, device="cuda", generator=gen)
    for stages in (1, 2):
        cfg = KernelConfig(block_n=32, num_warps=4, num_stages=stages, waves=4, min_split_tokens=1024)
        for name, bt in tables.items():
            a, e = run("bf16", cfg, bt, q, side), run("exact", cfg, bt, q, side)
            d = (a.float() - e.float()).abs()
            print(json.dumps(dict(stages=stages, table=name, equal=bool(torch.equal(a, e)), max_diff=float(d.max()),
                                  frac_differing=float((d > 0).float().mean()))), flush=True)
    outs = [run("bf16", KernelConfig(block_n=32, num_warps=4, num_stages=s, waves=4, min_split_tokens=1024),
                tables["perm"], q, side) for s in (1, 2)]
    print(json.dumps(dict(bf16_stages_1_vs_2_equal=bool(torch.equal(*outs)))), flush=True)


if __name__ == "__main__":
    main()
