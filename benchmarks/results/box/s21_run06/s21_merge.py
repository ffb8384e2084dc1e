"""The merge kernel alone at 70B TP8 8 x 64k (256 items, 32 a sequence) and 8 x 32k: BLOCK_I and num_warps."""
import sys, pathlib, triton
import torch
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_decode_attention as bd
from weightszip.kernels import DEFAULT_CONFIGS, PagedDecodeAttention, KernelConfig
from weightszip.kernels import paged_decode as pd
import dataclasses
gen = torch.Generator(device="cuda").manual_seed(0)
for B, L, waves in [(8, 65536, 2), (8, 32768, 1), (32, 32768, 1)][:int(sys.argv[1]) if len(sys.argv) > 1 else 3]:
    Hq, Hkv, D = 8, 1, 128
    k, v, bt = bd.make_paged(B, L, Hkv, D, torch.float8_e4m3fn, gen)
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device="cuda", generator=gen)
    attn = PagedDecodeAttention(Hq, Hkv, D, page_type="fp8", config=dataclasses.replace(DEFAULT_CONFIGS[pd.PAGE_FP8], waves=waves), device="cuda")
    info = attn.plan([L] * B, bt)
    kw = dict(k_scale=torch.full((Hkv,), 1 / 64, device="cuda"), v_scale=torch.full((Hkv,), 1 / 64, device="cuda"))
    ref = attn.run(q, k, v, **kw)
    pl = attn._plan
    out = torch.empty_like(ref)
    vt = torch.randn(Hkv, D, D, device='cuda') / D
    for bi, nw in [(4, 1), (4, 2), (8, 1), (8, 2), (16, 2), (16, 4), (2, 1), (4, 4)]:
        for tr in (False, True):
            def f():
                pd._merge_kernel[(B, Hkv)](q, q, q, pl["seq_lens"], pl["item_indptr"], pl["ws_m"], pl["ws_l"], pl["ws_acc"],
                    vt, q, out, 1.0, q.stride(0), q.stride(1), 0, 0, 0, out.stride(0), out.stride(1), Hkv,
                    GROUP=8, BLOCK_G=16, HEAD_DIM=D, SINKS=0, WINDOW=0, BLOCK_S=16, BLOCK_I=bi,
                    HAS_V_TRANSFORM=tr, HAS_V_MEAN=False, num_warps=nw)
            try:
                t = triton.testing.do_bench(f, warmup=10, rep=50, return_mode="median")
                print(f"B{B} L{L // 1024}k items {info['items']} BLOCK_I {bi} warps {nw} transform {tr}: {t * 1e3:.1f} us", flush=True)
            except Exception as e:
                print("fail", bi, nw, str(e)[:100])
