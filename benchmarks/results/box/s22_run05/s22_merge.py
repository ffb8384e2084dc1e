"""Merge-kernel variants with a column-parallel grid (program_id(2) = a block of DC output columns) against the
repo's merge, with and without side tokens (4 sinks + 128 window, as the compact formats keep), kernel time by
CUDA graph replay (no launch overhead). T = inverse V transform (q4 plans); fp8 plans have none."""
import sys, pathlib, dataclasses, itertools
import torch, triton, triton.language as tl
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_decode_attention as bd
from weightszip.kernels import DEFAULT_CONFIGS, PagedDecodeAttention
from weightszip.kernels import paged_decode as pd

NEG = tl.constexpr(-1.0e30)


@triton.jit
def merge_c(q_ptr, k_side_ptr, v_side_ptr, seq_lens_ptr, item_indptr_ptr, ws_m_ptr, ws_l_ptr, ws_acc_ptr,
            v_inv_ptr, v_mean_ptr, out_ptr, qk_scale, stride_qb, stride_qh, stride_sb, stride_st, stride_sh,
            stride_ob, stride_oh, num_kv_heads,
            GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, SINKS: tl.constexpr,
            WINDOW: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_I: tl.constexpr, HAS_T: tl.constexpr,
            HAS_MEAN: tl.constexpr, DC: tl.constexpr, A_FIRST: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    cb = tl.program_id(2)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_c = cb * DC + tl.arange(0, DC)
    g_valid = offs_g < GROUP
    if HAS_T:
        if A_FIRST:
            amat = tl.load(v_inv_ptr + head * HEAD_DIM * HEAD_DIM + offs_d[:, None] * HEAD_DIM + offs_c[None, :])
        offs_m = offs_d
        acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    else:
        offs_m = offs_c
        acc = tl.zeros([BLOCK_G, DC], dtype=tl.float32)
    m_i = tl.full([BLOCK_G], NEG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    i0 = tl.load(item_indptr_ptr + seq)
    i1 = tl.load(item_indptr_ptr + seq + 1)
    offs_i = tl.arange(0, BLOCK_I)
    for c0 in range(i0, i1, BLOCK_I):
        it = c0 + offs_i
        ok = (it < i1)[:, None] & g_valid[None, :]
        row = it[:, None] * (num_kv_heads * GROUP) + head * GROUP + offs_g[None, :]
        m_s = tl.load(ws_m_ptr + row, mask=ok, other=NEG)
        l_s = tl.load(ws_l_ptr + row, mask=ok, other=0.0)
        a_s = tl.load(ws_acc_ptr + row.to(tl.int64)[:, :, None] * HEAD_DIM + offs_m[None, None, :],
                      mask=ok[:, :, None], other=0.0)
        m_new = tl.maximum(m_i, tl.max(m_s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        beta = tl.exp2(m_s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(l_s * beta, axis=0)
        acc = acc * alpha[:, None] + tl.sum(a_s * beta[:, :, None], axis=0)
        m_i = m_new
    if HAS_T:
        if not A_FIRST:
            amat = tl.load(v_inv_ptr + head * HEAD_DIM * HEAD_DIM + offs_d[:, None] * HEAD_DIM + offs_c[None, :])
        acc = tl.dot(acc, amat, input_precision="ieee")
    if HAS_MEAN:
        acc = acc + l_i[:, None] * tl.load(v_mean_ptr + head * HEAD_DIM + offs_c)[None, :]
    if SINKS + WINDOW > 0:
        length = tl.load(seq_lens_ptr + seq)
        q_rows = seq.to(tl.int64) * stride_qb + (head * GROUP + offs_g) * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=g_valid[:, None], other=0.0).to(tl.bfloat16)
        win_lo = tl.maximum(length - WINDOW, SINKS)
        n_win = length - win_lo
        offs_s = tl.arange(0, BLOCK_S)
        for s0 in range(0, SINKS + WINDOW, BLOCK_S):
            slot = s0 + offs_s
            is_sink = (slot < SINKS) & (slot < length)
            if WINDOW > 0:
                r = slot - SINKS
                is_win = (slot >= SINKS) & (slot < SINKS + WINDOW) & (((r - win_lo % WINDOW) + WINDOW) % WINDOW < n_win)
                ok = is_sink | is_win
            else:
                ok = is_sink
            base = seq.to(tl.int64) * stride_sb + slot[:, None] * stride_st + head * stride_sh
            k = tl.load(k_side_ptr + base + offs_d[None, :], mask=ok[:, None], other=0.0)
            v = tl.load(v_side_ptr + base + offs_c[None, :], mask=ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v)
            m_i = m_new
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o_rows = seq.to(tl.int64) * stride_ob + (head * GROUP + offs_g) * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_c[None, :], o.to(out_ptr.dtype.element_ty), mask=g_valid[:, None])


def bench(f):
    return triton.testing.do_bench_cudagraph(f, rep=30, return_mode="median") * 1e3


gen = torch.Generator(device="cuda").manual_seed(0)
SHAPES = dict(l70=(8, 1, 128), l8=(32, 8, 128))
rows = []
for shape, B, L in [(x[0], int(x[1]), int(x[2])) for x in (a.split(":") for a in sys.argv[1].split(","))]:
    Hq, Hkv, D = SHAPES[shape]
    G = Hq // Hkv
    for kind in sys.argv[2].split(","):
        for S, W in [tuple(map(int, a.split(":"))) for a in sys.argv[3].split(",")]:
            q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device="cuda", generator=gen)
            side = {}
            if S + W:
                side = {n: torch.randn(B, S + W, Hkv, D, device="cuda", generator=gen).to(torch.bfloat16)
                        for n in ("k_side", "v_side")}
            if kind == "q4":
                k, v, bt, tabs, extra = bd.compact_inputs("q4", B, L, Hq, Hkv, D, gen)
                attn = PagedDecodeAttention(Hq, Hkv, D, page_type="compact", k_bits=4, v_bits=4, sink_tokens=S,
                                            window=W, device="cuda")
                attn.plan([L] * B, bt)
                ref = attn.run(q, k, v, **tabs, **extra, **side)
                vt, vm = extra["v_inv_transform"].contiguous(), extra["v_mean"].contiguous()
            else:
                k, v, bt = bd.make_paged(B, L, Hkv, D, torch.float8_e4m3fn, gen)
                attn = PagedDecodeAttention(Hq, Hkv, D, page_type="fp8", sink_tokens=S, window=W, device="cuda")
                attn.plan([L] * B, bt)
                sc = torch.ones(Hkv, device="cuda")
                ref = attn.run(q, k, v, k_scale=sc, v_scale=sc, **side)
                vt = vm = None
            pl = attn._plan
            full = lambda: attn.run(q, k, v, **(dict(**tabs, **extra) if kind == "q4" else dict(k_scale=sc, v_scale=sc)), **side, out=out0)
            out0 = torch.empty_like(ref)
            t_full = bench(full)
            # repo merge alone
            bg = 16 if G <= 16 else G
            bi, nw, nb = pd.merge_launch(G, D, bg, vt is not None, S + W > 0)
            ks = side.get("k_side", q); vs = side.get("v_side", q)
            st = (ks.stride(0), ks.stride(1), ks.stride(2)) if side else (0, 0, 0)
            dummy = torch.zeros(1, device="cuda")
            qk = float(D ** -0.5 * 1.4426950408889634)
            out = torch.empty_like(ref)

            def repo():
                pd._merge_kernel[(B, Hkv, nb)](q, ks, vs, pl["seq_lens"], pl["item_indptr"], pl["ws_m"], pl["ws_l"],
                                           pl["ws_acc"], vt if vt is not None else dummy, vm if vm is not None else dummy,
                                           out, qk, q.stride(0), q.stride(1), *st, out.stride(0), out.stride(1), Hkv,
                                           GROUP=G, BLOCK_G=bg, HEAD_DIM=D, SINKS=S, WINDOW=W,
                                           BLOCK_S=pd._pow2_at_least(min(S + W, 64), 16), BLOCK_I=bi,
                                           HAS_V_TRANSFORM=vt is not None, HAS_V_MEAN=vm is not None, BLOCK_C=D // nb, num_warps=nw)
            t_repo = bench(repo)
            err_repo = float((out.float() - ref.float()).abs().max())
            nitems = int(pl["item_indptr"][-1])
            head = f"{shape} B{B} L{L // 1024}k {kind} side{S + W} items {nitems} step {t_full:.1f}us repo-merge {t_repo:.1f}us (bi {bi} w {nw} blocks {nb}, err {err_repo:.1e})"
            print(head, flush=True)
            rows.append(dict(shape=shape, B=B, L=L, kind=kind, side=S + W, step=t_full, repo=t_repo, variant="repo"))
            for ncol, (bi2, nw2), af in itertools.product((1, 2, 4, 8), ((4, 1), (16, 4)),
                                                         (0,)):
                DC = D // ncol
                if DC < 16:
                    continue

                def var():
                    return merge_c[(B, Hkv, ncol)](q, ks, vs, pl["seq_lens"], pl["item_indptr"], pl["ws_m"], pl["ws_l"],
                                            pl["ws_acc"], vt if vt is not None else dummy, vm if vm is not None else dummy,
                                            out, qk, q.stride(0), q.stride(1), *st, out.stride(0), out.stride(1), Hkv,
                                            GROUP=G, BLOCK_G=bg, HEAD_DIM=D, SINKS=S, WINDOW=W,
                                            BLOCK_S=pd._pow2_at_least(min(S + W, 64), 16), BLOCK_I=bi2,
                                            HAS_T=vt is not None, HAS_MEAN=vm is not None, DC=DC, A_FIRST=af,
                                            num_warps=nw2)
                try:
                    out.zero_()
                    ck = var()
                    spills = ck.n_spills
                    t = bench(var)
                    err = float((out.float() - ref.float()).abs().max())
                    print(f"   ncol {ncol} bi {bi2} w {nw2} afirst {af}: {t:.1f}us spills {spills} err {err:.1e}", flush=True)
                    rows.append(dict(shape=shape, B=B, L=L, kind=kind, side=S + W, step=t_full, repo=t_repo,
                                     variant=f"ncol{ncol}_bi{bi2}_w{nw2}_af{af}", t=t, spills=spills, err=err))
                except Exception as e:
                    print("   fail", ncol, bi2, nw2, af, str(e)[-300:], flush=True)
            del k, v
import json, os
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "s22_merge.json"), "w"))
