"""Merge-kernel variants (page splits only, no side tokens) against the repo's, 70B TP8 plans: the loop with
the next step's loads issued first (prefetch), and the inverse V transform's product at tf32x3 vs ieee."""
import sys, pathlib, dataclasses
import torch, triton, triton.language as tl
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_decode_attention as bd
from weightszip.kernels import DEFAULT_CONFIGS, PagedDecodeAttention
from weightszip.kernels import paged_decode as pd


@triton.jit
def merge_v(item_indptr_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr, v_inv_ptr, v_mean_ptr, out_ptr, stride_ob, stride_oh,
            num_kv_heads, GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_I: tl.constexpr,
            HAS_T: tl.constexpr, PREC: tl.constexpr, PREFETCH: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    g_valid = offs_g < GROUP
    m_i = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    i0 = tl.load(item_indptr_ptr + seq)
    i1 = tl.load(item_indptr_ptr + seq + 1)
    offs_i = tl.arange(0, BLOCK_I)
    it = i0 + offs_i
    ok = (it < i1)[:, None] & g_valid[None, :]
    row = it[:, None] * (num_kv_heads * GROUP) + head * GROUP + offs_g[None, :]
    m_s = tl.load(ws_m_ptr + row, mask=ok, other=-1.0e30)
    l_s = tl.load(ws_l_ptr + row, mask=ok, other=0.0)
    a_s = tl.load(ws_acc_ptr + row.to(tl.int64)[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=ok[:, :, None], other=0.0)
    for c0 in range(i0, i1, BLOCK_I):
        if PREFETCH:
            it2 = c0 + BLOCK_I + offs_i
            ok2 = (it2 < i1)[:, None] & g_valid[None, :]
            row2 = it2[:, None] * (num_kv_heads * GROUP) + head * GROUP + offs_g[None, :]
            m_n = tl.load(ws_m_ptr + row2, mask=ok2, other=-1.0e30)
            l_n = tl.load(ws_l_ptr + row2, mask=ok2, other=0.0)
            a_n = tl.load(ws_acc_ptr + row2.to(tl.int64)[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=ok2[:, :, None], other=0.0)
        else:
            it = c0 + offs_i
            ok = (it < i1)[:, None] & g_valid[None, :]
            row = it[:, None] * (num_kv_heads * GROUP) + head * GROUP + offs_g[None, :]
            m_s = tl.load(ws_m_ptr + row, mask=ok, other=-1.0e30)
            l_s = tl.load(ws_l_ptr + row, mask=ok, other=0.0)
            a_s = tl.load(ws_acc_ptr + row.to(tl.int64)[:, :, None] * HEAD_DIM + offs_d[None, None, :], mask=ok[:, :, None], other=0.0)
        m_new = tl.maximum(m_i, tl.max(m_s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        beta = tl.exp2(m_s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(l_s * beta, axis=0)
        acc = acc * alpha[:, None] + tl.sum(a_s * beta[:, :, None], axis=0)
        m_i = m_new
        if PREFETCH:
            m_s = m_n
            l_s = l_n
            a_s = a_n
    if HAS_T:
        a_ptrs = v_inv_ptr + head * HEAD_DIM * HEAD_DIM + offs_d[:, None] * HEAD_DIM + offs_d[None, :]
        acc = tl.dot(acc, tl.load(a_ptrs), input_precision=PREC)
        acc = acc + l_i[:, None] * tl.load(v_mean_ptr + head * HEAD_DIM + offs_d)[None, :]
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = seq.to(tl.int64) * stride_ob + (head * GROUP + offs_g) * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty), mask=g_valid[:, None])


gen = torch.Generator(device="cuda").manual_seed(0)
for B, L, waves in [(8, 65536, 2), (8, 32768, 2), (32, 32768, 2)]:
    Hq, Hkv, D = 8, 1, 128
    k, v, bt, tabs, extra = bd.compact_inputs("q4", B, L, Hq, Hkv, D, gen)
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device="cuda", generator=gen)
    attn = PagedDecodeAttention(Hq, Hkv, D, page_type="compact", k_bits=4, v_bits=4,
                                config=dataclasses.replace(DEFAULT_CONFIGS[pd.PAGE_COMPACT], waves=waves), device="cuda")
    info = attn.plan([L] * B, bt)
    ref = attn.run(q, k, v, **tabs, **extra)
    pl = attn._plan
    vt, vm = extra["v_inv_transform"].contiguous(), extra["v_mean"].contiguous()
    out = torch.empty_like(ref)
    for has_t in (False, True):
        for prec in (["ieee", "tf32x3"] if has_t else ["ieee"]):
            for pf in (0, 1):
                for bi, nw in [(4, 1), (8, 2), (16, 4), (4, 4), (16, 8)]:
                    def f():
                        merge_v[(B, Hkv)](pl["item_indptr"], pl["ws_m"], pl["ws_l"], pl["ws_acc"], vt, vm, out,
                                          out.stride(0), out.stride(1), Hkv, GROUP=8, BLOCK_G=16, HEAD_DIM=D,
                                          BLOCK_I=bi, HAS_T=has_t, PREC=prec, PREFETCH=pf, num_warps=nw)
                    try:
                        t = triton.testing.do_bench(f, warmup=10, rep=40, return_mode="median")
                        err = float((out.float() - ref.float()).abs().max()) if has_t else -1
                        print(f"B{B} L{L // 1024}k items {info['items']} T {int(has_t)} {prec} pf {pf} BI {bi} w {nw}: {t * 1e3:.1f} us err {err:.2e}", flush=True)
                    except Exception as e:
                        print("fail", has_t, prec, pf, bi, nw, str(e)[:80], flush=True)
    del k, v
