"""Decode attention over compact pages (q4, q3.5, q3) in Gluon: the codes are decoded straight into
the tensor cores' register operands.

Why a second kernel: the Triton split kernel (``paged_decode._paged_split_kernel``) is bound by the
L1/shared-memory pipe on compact pages (Nsight Compute, BENCHMARKS.md): its codebook gathers go
through L1 and every dequantized tile takes a shared-memory round trip into the operand layout of
the tensor cores. Here, in Gluon (Triton's layout-explicit dialect, ``triton.experimental.gluon``):

* **Operands in registers.** ``S = Q K^T`` and ``O += P V`` run on ``mma.sync`` (m16n8k16, bf16, fp32
  accumulation) with K^T and V as B operands built directly in their register layout, and P reused
  from the accumulator layout as the A operand (no data movement). Each warp owns its own tiles and
  its own running softmax state (a batch dimension over the warps); the warps' states merge once at
  the end of the program.
* **Pair codes by bit arithmetic.** A thread's operand registers hold channel pairs (K^T: channels
  2c, 2c + 1 of one token) or token pairs (V: tokens 2t, 2t + 1 of one channel). With the page's bit
  planes (word m of a token row: byte i bit j = channel 32 m + 8 i + j), one shift and mask per plane
  word yields four pair codes, one per byte, whose bits interleave the two values' bits
  (``pair_index``).
* **Conflict-free table lookups.** The pair table (``interleaved_pair_table``: bf16 codebook[a] in the
  low half, codebook[b] in the high half) sits in shared memory 32 times over, copy ``l`` in bank ``l``;
  lane ``l`` reads copy ``l`` (``ld.shared`` through inline PTX, as Gluon has no shared-memory
  gather), so a warp's 32 lookups are one shared-memory wavefront whatever the codes.

Numerics equal the Triton kernel's: bf16 codebook values (``codebook[code]``) on the tensor cores,
fp32 sums, each token's grid scale on the fp32 logits (K) and on the softmax weights before their
bf16 rounding (V), base-2 softmax with a running maximum. The split schedule, the workspace and the
merge kernel are ``PagedDecodeAttention``'s.

Compiled only: Gluon has no interpreter mode, so the CPU tests compile this kernel for sm_90 and the
GPU tests compare it with the reference (``paged_decode_ref``) and the Triton kernel.
"""

from __future__ import annotations

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.runtime.jit import constexpr_function

NEG_BIG = gl.constexpr(-1.0e30)
# One 32-bit lookup in shared memory at byte offset $1 of the kernel's dynamic shared memory
# (``global_smem``; the pair tables are the kernel's first allocation, at offset 0: the GPU tests
# fail if they were not).
_LDS = gl.constexpr("{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $1; ld.shared.b32 $0, [a]; }")


def interleaved_pair_table(codebook: torch.Tensor) -> torch.Tensor:
    """int32 [H, 4**bits] from a codebook [H, 2**bits] (bits <= 4): entry ``x`` holds the bf16 bits of
    ``codebook[a]`` in its low half and of ``codebook[b]`` in its high half, where bit ``2 p`` of ``x``
    is bit ``p`` of ``a`` and bit ``2 p + 1`` bit ``p`` of ``b`` (the order ``pair_index`` makes)."""
    h, n = codebook.shape
    bits = n.bit_length() - 1
    x = torch.arange(n * n, device=codebook.device)
    a = torch.zeros_like(x)
    b = torch.zeros_like(x)
    for p in range(bits):
        a |= ((x >> (2 * p)) & 1) << p
        b |= ((x >> (2 * p + 1)) & 1) << p
    u = codebook.to(torch.bfloat16).contiguous().view(torch.int16).to(torch.int64) & 0xFFFF
    words = u[:, a] | (u[:, b] << 16)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def pair_index(w_lo: torch.Tensor, w_hi: torch.Tensor, shift: int, bits: int) -> torch.Tensor:
    """Reference of the kernel's pair codes (int64 words): for plane words ``w_lo``/``w_hi`` [bits, ...]
    of the pair's two values (the same words for a K channel pair), byte i of the result is the
    interleaved pair code of the bits at ``shift`` (``w_lo``) and ``shift + 1`` or ``shift`` of ``w_hi``.
    Used by the tests to state the bit order; the kernel computes the same in registers."""
    y = torch.zeros_like(w_lo[0])
    for p in range(bits):
        y |= ((w_lo[p] >> shift) & 0x01010101) << (2 * p)
        y |= ((w_hi[p] >> shift) & 0x01010101) << (2 * p + 1)
    return y


# ----------------------------------------------------------------------------------------------------
# layouts
# ----------------------------------------------------------------------------------------------------


@constexpr_function
def k_layout(nw: int, m: int, block_n: int) -> gl.BlockedLayout:
    """K^T pair tensor [NW, M, 4 (i), 4 (t), 2 (b), BN / 8 (nh), 8 (nl)]: channel 32 m + 8 i + 2 t + b
    of token 8 nh + nl. Registers b, i, m, nh and lanes t, nl: after merging (m, i, t, b) and (nh, nl),
    the mma.sync B-operand register layout of K^T [NW, HEAD_DIM, BN]."""
    return gl.BlockedLayout(size_per_thread=[1, m, 4, 1, 2, block_n // 8, 1],
                            threads_per_warp=[1, 1, 1, 4, 1, 1, 8], warps_per_cta=[nw, 1, 1, 1, 1, 1, 1],
                            order=[4, 2, 1, 5, 3, 6, 0])


@constexpr_function
def words_layout(layout: gl.BlockedLayout, dim_m: int) -> gl.BlockedLayout:
    """``layout`` with dim ``dim_m`` (a token row's plane words) first in its order: the same mapping on
    the words' shape (whose dims before it in ``layout``'s order have size 1), but Triton sees the
    words contiguous in registers and loads them as vectors."""
    order = [dim_m] + [d for d in layout.order if d != dim_m]
    return gl.BlockedLayout(layout.size_per_thread, layout.threads_per_warp, layout.warps_per_cta, order)


@constexpr_function
def v_layout(nw: int, m: int, block_n: int) -> gl.BlockedLayout:
    """V pair tensor [NW, BN / 8 (th), 4 (tl), 2 (e), M, 4 (i), 8 (j)]: token 8 th + 2 tl + e, channel
    32 m + 8 i + j. Registers e, th, i, m and lanes tl, j: merged, the B-operand layout of V [NW, BN,
    HEAD_DIM]."""
    return gl.BlockedLayout(size_per_thread=[1, block_n // 8, 1, 2, m, 4, 1],
                            threads_per_warp=[1, 1, 4, 1, 1, 1, 8], warps_per_cta=[nw, 1, 1, 1, 1, 1, 1],
                            order=[3, 1, 5, 4, 2, 6, 0])



@constexpr_function
def _axis_layout(layout, dim, rank):
    """``layout`` with every dim but ``dim`` sliced off (highest first)."""
    for d in reversed(range(rank)):
        if d != dim:
            layout = gl.SliceLayout(d, layout)
    return layout


@constexpr_function
def _other_dims(dim, rank):
    return tuple(d for d in range(rank) if d != dim)


@gluon.jit
def _axis(n: gl.constexpr, dim: gl.constexpr, rank: gl.constexpr, layout: gl.constexpr):
    """arange(n) along ``dim`` of a rank-``rank`` ``layout``, as a broadcastable [1, .., n, .., 1] tensor."""
    return gl.expand_dims(gl.arange(0, n, layout=_axis_layout(layout, dim, rank)), _other_dims(dim, rank))


@gluon.jit
def _lds(addr):
    """int32 at byte offset ``addr`` of the dynamic shared memory (elementwise)."""
    return gl.inline_asm_elementwise(_LDS, "=r,r", [addr], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _fill_table(tab, src_ptr, E: gl.constexpr, NW: gl.constexpr):
    """32 copies of the E-entry int32 table at ``src_ptr`` into ``tab`` (entry x, copy l at x * 32 + l)."""
    TL: gl.constexpr = gl.BlockedLayout([4], [32], [NW], [0])
    x = gl.arange(0, E * 32, layout=TL)
    tab.store(gl.load(src_ptr + x // 32))


@gluon.jit
def _tile_first(lo, j, NW: gl.constexpr, rank: gl.constexpr, layout: gl.constexpr):
    """First token of warp w's page in iteration j (warp w takes page j * NW + w of the split), as a
    [NW, 1, ...] tensor of ``layout``."""
    return lo + (j * NW + _axis(NW, 0, rank, layout)) * 16


@gluon.jit
def _page_offset(bt_row, first, t1, head, stride_b, stride_h, PB: gl.constexpr, BLOCK_SIZE: gl.constexpr):
    """Byte offset of the page holding token ``first`` (a page's first token) in the pool; 0 past t1."""
    blk = gl.load(bt_row + first // BLOCK_SIZE, mask=first < t1, other=0)
    return blk.to(gl.int64) * stride_b + head * stride_h + ((first % BLOCK_SIZE) // 16) * PB


@gluon.jit
def _scales(pages_ptr, grid_ptr, poff, first, r, t0, t1, head, SIDX_OFF: gl.constexpr):
    """grid[head, k] of page rows ``r`` (k: the row's scale index; 0 outside [t0, t1))."""
    valid = (first + r >= t0) & (first + r < t1)
    k = gl.load(pages_ptr + poff + SIDX_OFF + r, mask=valid, other=0).to(gl.int32)
    return gl.load(grid_ptr + head * 256 + k)


@gluon.jit
def _plane(pages_ptr, poff, first, r, m, t0, t1, p: gl.constexpr, M: gl.constexpr, L: gl.constexpr):
    """Word m of bit plane p of page rows ``r`` (0 outside [t0, t1)), relaid out to ``L``."""
    valid = (first + r >= t0) & (first + r < t1)
    # pages start 16-byte aligned (PagedDecodeAttention checks): a row's M words load as vectors
    wptr = (pages_ptr + poff).to(gl.pointer_type(gl.int32))
    w = gl.load(gl.multiple_of(wptr, [16] * 7) + p * (16 * M) + r * M + m, mask=valid, other=0)
    return gl.convert_layout(w, L, assert_trivial=True)


@gluon.jit
def _planes(pages_ptr, poff, first, r, m, t0, t1, BITS: gl.constexpr, M: gl.constexpr, L: gl.constexpr):
    """Bit planes 0..BITS-1 (up to 4; the fourth repeats the third when BITS is 3)."""
    w0 = _plane(pages_ptr, poff, first, r, m, t0, t1, 0, M, L)
    w1 = _plane(pages_ptr, poff, first, r, m, t0, t1, 1, M, L)
    w2 = _plane(pages_ptr, poff, first, r, m, t0, t1, 2, M, L)
    w3 = w2
    if BITS > 3:
        w3 = _plane(pages_ptr, poff, first, r, m, t0, t1, 3, M, L)
    return w0, w1, w2, w3


@gluon.jit
def _k_words(pages_ptr, poff, first, t0, t1, BITS: gl.constexpr, M: gl.constexpr, LK: gl.constexpr):
    """A K page's plane words for the K^T operand: [NW, M, 1, 1, 1, 2 (nh), 8 (nl)], row 8 nh + nl."""
    LW: gl.constexpr = words_layout(LK, 1)
    r = 8 * _axis(2, 5, 7, LW) + _axis(8, 6, 7, LW)
    return _planes(pages_ptr, gl.convert_layout(poff, LW, assert_trivial=True),
                   gl.convert_layout(first, LW, assert_trivial=True), r, _axis(M, 1, 7, LW), t0, t1, BITS, M, LK)


@gluon.jit
def _v_words(pages_ptr, poff, first, e: gl.constexpr, t0, t1, BITS: gl.constexpr, M: gl.constexpr, LV: gl.constexpr):
    """A V page's plane words of its even (e = 0) or odd (e = 1) rows: [NW, 2 (th), 4 (tl), 1, M, 1, 1],
    row 8 th + 2 tl + e."""
    LW: gl.constexpr = words_layout(LV, 4)
    r = 8 * _axis(2, 1, 7, LW) + 2 * _axis(4, 2, 7, LW) + e
    return _planes(pages_ptr, gl.convert_layout(poff, LW, assert_trivial=True),
                   gl.convert_layout(first, LW, assert_trivial=True), r, _axis(M, 4, 7, LW), t0, t1, BITS, M, LV)


@gluon.jit
def _k_operand(w0, w1, w2, w3, BITS: gl.constexpr, TAB: gl.constexpr, HEAD_DIM: gl.constexpr,
               BLOCK_N: gl.constexpr, NW: gl.constexpr, LK: gl.constexpr, OPB: gl.constexpr):
    """K^T [NW, HEAD_DIM, BN] bf16 in the B-operand layout: thread (t, nl) holds channel pairs 8 i + 2 t of
    each word, so ``(w_p >> 2 t) & 0x03030303`` puts plane p's bits of four pairs in four bytes."""
    t = _axis(4, 3, 7, LK)
    nl = _axis(8, 6, 7, LK)
    sh = 2 * t
    y = (w0 >> sh) & 0x03030303
    y |= ((w1 >> sh) & 0x03030303) << 2
    y |= ((w2 >> sh) & 0x03030303) << 4
    if BITS > 3:
        y |= ((w3 >> sh) & 0x03030303) << 6
    x = (y >> (8 * _axis(4, 2, 7, LK))) & 0xFF
    val = _lds(TAB + x * 128 + (t + 4 * nl) * 4)
    half = ((val >> (16 * _axis(2, 4, 7, LK))) & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return gl.convert_layout(gl.reshape(half, [NW, HEAD_DIM, BLOCK_N]), OPB, assert_trivial=True)


@gluon.jit
def _v_operand(a0, a1, a2, a3, b0, b1, b2, b3, BITS: gl.constexpr, TAB: gl.constexpr, HEAD_DIM: gl.constexpr,
               BLOCK_N: gl.constexpr, NW: gl.constexpr, LV: gl.constexpr, OPB: gl.constexpr):
    """V [NW, BN, HEAD_DIM] bf16 in the B-operand layout from the even (a) and odd (b) tokens' plane
    words: thread (tl, j) holds token pairs of channels 8 i + j."""
    j = _axis(8, 6, 7, LV)
    tl_ = _axis(4, 2, 7, LV)
    y = ((a0 >> j) & 0x01010101) | (((b0 >> j) & 0x01010101) << 1)
    y |= (((a1 >> j) & 0x01010101) << 2) | (((b1 >> j) & 0x01010101) << 3)
    y |= (((a2 >> j) & 0x01010101) << 4) | (((b2 >> j) & 0x01010101) << 5)
    if BITS > 3:
        y |= (((a3 >> j) & 0x01010101) << 6) | (((b3 >> j) & 0x01010101) << 7)
    x = (y >> (8 * _axis(4, 5, 7, LV))) & 0xFF
    val = _lds(TAB + x * 128 + (tl_ + 4 * j) * 4)
    half = ((val >> (16 * _axis(2, 3, 7, LV))) & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return gl.convert_layout(gl.reshape(half, [NW, BLOCK_N, HEAD_DIM]), OPB, assert_trivial=True)


@gluon.jit
def compact_split_kernel(
    q_ptr, bias_ptr, k_pages_ptr, v_pages_ptr, block_tables_ptr,
    work_seq_ptr, work_start_ptr, work_end_ptr,
    ws_m_ptr, ws_l_ptr, ws_acc_ptr,
    k_tab_ptr, v_tab_ptr, k_grid_ptr, v_grid_ptr,
    qk_scale,  # sm_scale * log2(e)
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_bt,
    num_kv_heads,
    GROUP: gl.constexpr, BLOCK_G: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    BITS_K: gl.constexpr, BITS_V: gl.constexpr, HAS_BIAS: gl.constexpr, TABLE_WORDS: gl.constexpr,
):
    """One split (work item) of one KV head, as ``paged_decode._paged_split_kernel`` on compact pages:
    the running max (base 2), softmax mass and unnormalized fp32 sum of p * y into the workspace.
    Each warp takes every NW-th page of the split (16 tokens per step). The next page's offset and
    scales are loaded one step ahead (a few registers); its plane words are not (they would need
    ~100 registers: every word is held by the 4 or 8 lanes that decode from it)."""
    NW: gl.constexpr = gl.num_warps()
    M: gl.constexpr = HEAD_DIM // 32
    BN: gl.constexpr = 16
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1], instr_shape=[1, 16, 8])
    OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    OPB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    LK: gl.constexpr = k_layout(NW, M, BN)
    LV: gl.constexpr = v_layout(NW, M, BN)
    ROW: gl.constexpr = gl.SliceLayout(2, MMA)  # [NW, BLOCK_G]
    COL: gl.constexpr = gl.SliceLayout(1, MMA)  # [NW, BN]
    EK: gl.constexpr = 1 << (2 * BITS_K)
    EV: gl.constexpr = 1 << (2 * BITS_V)
    PB_K: gl.constexpr = 16 * (BITS_K * HEAD_DIM // 8 + 1)
    PB_V: gl.constexpr = 16 * (BITS_V * HEAD_DIM // 8 + 1)

    item = gl.program_id(0)
    head = gl.program_id(1)
    seq = gl.load(work_seq_ptr + item)
    t0 = gl.load(work_start_ptr + item)
    t1 = gl.load(work_end_ptr + item)

    # the pair tables, K's then V's, 32 copies each: the kernel's first shared memory (offset 0)
    tab = gl.allocate_shared_memory(gl.int32, [TABLE_WORDS], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    _fill_table(tab.slice(0, EK * 32), k_tab_ptr + head * EK, EK, NW)
    _fill_table(tab.slice(EK * 32, EV * 32), v_tab_ptr + head * EV, EV, NW)
    gl.thread_barrier()

    # q (every warp the same) as the A operand [NW, BLOCK_G, HEAD_DIM]
    gq = _axis(BLOCK_G, 1, 3, OPA)
    dq = _axis(HEAD_DIM, 2, 3, OPA)
    wq = _axis(NW, 0, 3, OPA)
    q_ptrs = q_ptr + seq.to(gl.int64) * stride_qb + (head * GROUP + gq) * stride_qh + dq + 0 * wq
    q = gl.load(q_ptrs, mask=(gq < GROUP) & (wq >= 0), other=0.0).to(gl.bfloat16)
    g_row = _axis(BLOCK_G, 1, 2, ROW)
    if HAS_BIAS:
        bias = gl.load(bias_ptr + seq * (num_kv_heads * GROUP) + head * GROUP + g_row + 0 * _axis(NW, 0, 2, ROW),
                       mask=g_row < GROUP, other=0.0) * qk_scale
    else:
        bias = gl.zeros([NW, BLOCK_G], gl.float32, layout=ROW)

    m_i = gl.full([NW, BLOCK_G], NEG_BIG, gl.float32, layout=ROW)
    l_i = gl.zeros([NW, BLOCK_G], gl.float32, layout=ROW)
    acc = gl.zeros([NW, BLOCK_G, HEAD_DIM], gl.float32, layout=MMA)
    bt_row = block_tables_ptr + seq.to(gl.int64) * stride_bt
    lo = t0 - t0 % 16
    n_iter = gl.cdiv(t1 - lo, NW * 16)
    rc = _axis(BN, 1, 2, COL)

    # page 0's offsets (in the K, V and column layouts) and scales
    fk = _tile_first(lo, 0, NW, 7, LK)
    fv = _tile_first(lo, 0, NW, 7, LV)
    fc = _tile_first(lo, 0, NW, 2, COL)
    ok = _page_offset(bt_row, fk, t1, head, stride_kb, stride_kh, PB_K, BLOCK_SIZE)
    ov = _page_offset(bt_row, fv, t1, head, stride_vb, stride_vh, PB_V, BLOCK_SIZE)
    okc = _page_offset(bt_row, fc, t1, head, stride_kb, stride_kh, PB_K, BLOCK_SIZE)
    ovc = _page_offset(bt_row, fc, t1, head, stride_vb, stride_vh, PB_V, BLOCK_SIZE)
    kg = _scales(k_pages_ptr, k_grid_ptr, okc, fc, rc, t0, t1, head, BITS_K * 2 * HEAD_DIM)
    vg = _scales(v_pages_ptr, v_grid_ptr, ovc, fc, rc, t0, t1, head, BITS_V * 2 * HEAD_DIM)
    for j in range(0, n_iter):
        k0, k1, k2, k3 = _k_words(k_pages_ptr, ok, fk, t0, t1, BITS_K, M, LK)
        valid = (fc + rc >= t0) & (fc + rc < t1)
        # the next page's offsets and scales
        nfk = _tile_first(lo, j + 1, NW, 7, LK)
        nfv = _tile_first(lo, j + 1, NW, 7, LV)
        nfc = _tile_first(lo, j + 1, NW, 2, COL)
        nok = _page_offset(bt_row, nfk, t1, head, stride_kb, stride_kh, PB_K, BLOCK_SIZE)
        nov = _page_offset(bt_row, nfv, t1, head, stride_vb, stride_vh, PB_V, BLOCK_SIZE)
        nokc = _page_offset(bt_row, nfc, t1, head, stride_kb, stride_kh, PB_K, BLOCK_SIZE)
        novc = _page_offset(bt_row, nfc, t1, head, stride_vb, stride_vh, PB_V, BLOCK_SIZE)
        nkg = _scales(k_pages_ptr, k_grid_ptr, nokc, nfc, rc, t0, t1, head, BITS_K * 2 * HEAD_DIM)
        nvg = _scales(v_pages_ptr, v_grid_ptr, novc, nfc, rc, t0, t1, head, BITS_V * 2 * HEAD_DIM)

        kt = _k_operand(k0, k1, k2, k3, BITS_K, 0, HEAD_DIM, BN, NW, LK, OPB)
        s = mma_v2(q, kt, gl.zeros([NW, BLOCK_G, BN], gl.float32, layout=MMA))
        s = s * gl.expand_dims(kg * qk_scale, 1) + gl.expand_dims(bias, 2)
        s = gl.where(gl.expand_dims(valid, 1), s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=2))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - gl.expand_dims(m_new, 2))
        l_i = l_i * alpha + gl.sum(p, axis=2)
        pv = gl.convert_layout((p * gl.expand_dims(vg, 1)).to(gl.bfloat16), OPA, assert_trivial=True)
        # V's words only now: fewer registers live across the K half
        a0, a1, a2, a3 = _v_words(v_pages_ptr, ov, fv, 0, t0, t1, BITS_V, M, LV)
        b0, b1, b2, b3 = _v_words(v_pages_ptr, ov, fv, 1, t0, t1, BITS_V, M, LV)
        v = _v_operand(a0, a1, a2, a3, b0, b1, b2, b3, BITS_V, EK * 128, HEAD_DIM, BN, NW, LV, OPB)
        acc = mma_v2(pv, v, acc * gl.expand_dims(alpha, 2))
        m_i = m_new
        fk, fv, fc, ok, ov, kg, vg = nfk, nfv, nfc, nok, nov, nkg, nvg
    # every warp's last lookup before the merge below (whose scratch may reuse the tables' memory:
    # Triton's barrier analysis does not see the lookups, which are inline PTX)
    gl.thread_barrier()
    tab._keep_alive()
    # merge the warps' states
    m = gl.max(m_i, axis=0)
    sc = gl.exp2(m_i - gl.expand_dims(m, 0))
    l = gl.sum(l_i * sc, axis=0)
    o = gl.sum(acc * gl.expand_dims(sc, 2), axis=0)  # [BLOCK_G, HEAD_DIM], SliceLayout(0, MMA)
    OL: gl.constexpr = gl.SliceLayout(0, MMA)
    go = gl.expand_dims(gl.arange(0, BLOCK_G, layout=gl.SliceLayout(1, OL)), 1)
    do = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(0, OL)), 0)
    ws_row = item * num_kv_heads * GROUP + head * GROUP + go
    gl.store(ws_acc_ptr + ws_row.to(gl.int64) * HEAD_DIM + do, o, mask=(go < GROUP) & (do >= 0))
    ML: gl.constexpr = gl.SliceLayout(0, ROW)
    gm = gl.arange(0, BLOCK_G, layout=ML)
    ws_m_row = item * num_kv_heads * GROUP + head * GROUP + gm
    gl.store(ws_m_ptr + ws_m_row, m, mask=gm < GROUP)
    gl.store(ws_l_ptr + ws_m_row, l, mask=gm < GROUP)
