"""Plain-PyTorch reference of ``paged_decode``: the same math, one sequence at a time, in fp64.

Layout, side tokens and the transformed domain are as in ``paged_decode``'s docstring. The reference
gathers each sequence's page tokens through its block table, dequantizes them (``dequantize_pages_ref``:
the values a decoder must produce, bit for bit), and computes one softmax over page tokens and side
tokens with no splitting and no rounding of the softmax weights.
"""

from __future__ import annotations

import math

import torch


def dequantize_pages_ref(pages: torch.Tensor, page_type: str, scale: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 values of pages [num_blocks, kv_heads, block_size, head_dim]: bf16 as is; fp8 e4m3 as
    ``fp32(code) * scale[kv_head]``."""
    x = pages.float()
    if page_type == "fp8":
        x = x * scale.float().view(1, -1, 1, 1)
    elif page_type != "bf16":
        raise ValueError(f"unknown page type {page_type!r}")
    return x


def dequantize_compact_pages_ref(pages: torch.Tensor, bits: int, codebook: torch.Tensor,
                                 grid: torch.Tensor) -> torch.Tensor:
    """fp32 rotated-domain values of compact pages uint8 [num_blocks, kv_heads, block_size / 16,
    page_bytes] as [num_blocks, kv_heads, block_size, head_dim]: each page unpacked by
    ``codec.unpack_page`` and valued ``float32(codebook[head, code] * grid[head, k])``
    (``codec.dequantize``)."""
    from weightszip.compact import codec

    nb, h, npg, nbytes = pages.shape
    d = (nbytes // 16 - 1) * 8 // bits
    flat = pages.reshape(-1, nbytes).cpu()
    codes = torch.empty(flat.shape[0], 16, d, dtype=torch.uint8)
    sidx = torch.empty(flat.shape[0], 16, dtype=torch.uint8)
    for i in range(flat.shape[0]):
        codes[i], sidx[i] = codec.unpack_page(flat[i], bits, d)
    codes = codes.view(nb, h, npg * 16, d).long()
    sidx = sidx.view(nb, h, npg * 16).long()
    cb, gr = codebook.float().cpu(), grid.float().cpu()
    hh = torch.arange(h).view(1, h, 1)
    vals = cb[hh.unsqueeze(-1), codes] * gr[hh, sidx].unsqueeze(-1)
    return vals.to(pages.device)


def quantize_fp8_ref(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """bf16 [..., kv_heads, head_dim] -> e4m3 codes with one fp32 scale per KV head: round to nearest
    even of ``fp32(x) / scale``, saturated to +-448."""
    y = x.float() / scale.float().view(*([1] * (x.dim() - 2)), -1, 1)
    return y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def side_slots(length: int, sink_tokens: int, window: int) -> list[tuple[int, int]]:
    """(slot, position) of the side tokens a sequence of ``length`` tokens holds."""
    out = [(p, p) for p in range(min(sink_tokens, length))]
    for p in range(max(sink_tokens, length - window), length):
        out.append((sink_tokens + p % window, p))
    return out


def paged_positions(length: int, sink_tokens: int, window: int) -> range:
    """Positions a sequence of ``length`` tokens holds in its pages: ``[S, L - W)``."""
    return range(sink_tokens, max(sink_tokens, length - window))


def paged_decode_ref(q, k_pages, v_pages, block_tables, seq_lens, *, page_type="bf16", block_size=16,
                     k_scale=None, v_scale=None, sink_tokens=0, window=0, k_side=None, v_side=None,
                     q_transformed=None, logit_bias=None, v_inv_transform=None, v_mean=None,
                     sm_scale=None, k_bits=None, v_bits=None, k_codebook=None, v_codebook=None,
                     k_grid=None, v_grid=None, rope_coef=None, rope_phase=None) -> torch.Tensor:
    """Attention output [num_seqs, num_q_heads, head_dim] in fp64 (arguments as ``PagedDecodeAttention``).

    Page tokens: logit = (q' . y + b) * sm_scale with y the dequantized page keys (compact pages:
    ``k_bits``/``v_bits``, ``k_codebook``/``v_codebook``, ``k_grid``/``v_grid`` as in ``run``); their values are
    summed as y, mapped through ``v_inv_transform`` and offset by ``v_mean`` times their softmax mass.
    Side tokens: logit = q . k * sm_scale, value v, as stored (bf16). Rotary offsets (``rope_coef``,
    ``rope_phase``): page keys' logits gain sum_i A_i cos(phi_i) + B_i sin(phi_i), phi_i the exact
    phase p * f_i mod 2**48 of the key's position p, in fp64.
    """
    B, Hq, D = q.shape
    Hkv = k_pages.shape[1]
    G = Hq // Hkv
    sm_scale = D ** -0.5 if sm_scale is None else sm_scale
    if page_type == "compact":
        kd = dequantize_compact_pages_ref(k_pages, k_bits, k_codebook, k_grid).double()
        vd = dequantize_compact_pages_ref(v_pages, v_bits, v_codebook, v_grid).double()
    else:
        kd = dequantize_pages_ref(k_pages, page_type, k_scale).double()
        vd = dequantize_pages_ref(v_pages, page_type, v_scale).double()
    qp = (q if q_transformed is None else q_transformed).double()
    out = torch.zeros((B, Hq, D), dtype=torch.float64, device=q.device)
    lens = [int(x) for x in seq_lens]
    for b in range(B):
        L = lens[b]
        pos = torch.tensor(list(paged_positions(L, sink_tokens, window)), dtype=torch.long, device=q.device)
        blk = block_tables[b].long()[pos // block_size] if pos.numel() else pos
        slot = pos % block_size
        sides = side_slots(L, sink_tokens, window)
        sidx = torch.tensor([s for s, _ in sides], dtype=torch.long, device=q.device)
        for h in range(Hkv):
            yk = kd[blk, h, slot]  # [n, D]
            yv = vd[blk, h, slot]
            for g in range(G):
                hq = h * G + g
                lp = (yk @ qp[b, hq]) * sm_scale
                if logit_bias is not None:
                    lp = lp + float(logit_bias[b, hq]) * sm_scale
                if rope_coef is not None and pos.numel():
                    f = rope_phase.long().cpu()
                    ph = (pos.cpu()[:, None] * f[None, :]) % 2**48  # int64 products wrap mod 2**64: exact mod 2**48
                    ang = ph.double() * (2 * math.pi / 2**48)
                    co = rope_coef[b, hq].double().cpu()
                    lp = lp + ((torch.cos(ang) @ co[0] + torch.sin(ang) @ co[1]) * sm_scale).to(lp.device)
                if sides:
                    ks = k_side[b, sidx, h].double()
                    vs = v_side[b, sidx, h].double()
                    ls = (ks @ q[b, hq].double()) * sm_scale
                else:
                    ls = lp.new_zeros(0)
                    vs = yv.new_zeros((0, D))
                w = torch.softmax(torch.cat([lp, ls]), dim=0)
                wp, ws = w[: lp.numel()], w[lp.numel():]
                page_part = wp @ yv
                if v_inv_transform is not None:
                    page_part = page_part @ v_inv_transform[h].double()
                if v_mean is not None:
                    page_part = page_part + wp.sum() * v_mean[h].double()
                out[b, hq] = page_part + ws @ vs
    return out
