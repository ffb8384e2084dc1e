"""Decode attention over KV Exact4 pages in Gluon: lossless pages decoded straight into the tensor
cores' register operands (and the same kernel over bf16 pages, its bit-for-bit reference).

Why: the Triton kernel's exact4 path (``paged_decode._paged_split_kernel`` with ``PAGE_TYPE`` 4) runs
at 0.36-0.41x of the faster bf16 kernel on the H200 (BENCHMARKS.md, "KV Exact4"): 241 registers, 32
tokens a step, every decoded tile through shared memory into the operand layout; this one at
0.90-0.95x (session 23), then about 1.0x with its address chain carried and its rows aligned
(session 24; BENCHMARKS.md "KV Exact4 attention in Gluon"). Each warp takes every NW-th 16-token page of the split,
as ``paged_decode_gluon.fp8_split_kernel`` does:

* **Staged pages.** A warp copies its next page's slot of the head (window tops, code rows, raw rows;
  docs/FORMAT.md "KV Exact4 pages") and the 16-byte header chunk holding the head's entry into its own
  shared-memory slot by 16-byte ``cp.async`` (inline PTX: no CTA barrier), ``STAGES - 1`` pages
  ahead. Each lane's chunks are all K's or all V's (a chunk's source address is the lane's plus a
  constant). The rows land 32-byte aligned (a global sector's two chunks in one aligned 32 bytes:
  otherwise the copy fetches the sector twice, ncu: 16 sectors a warp's copy, not 22-32) at strides
  where the operand loads below are free of bank conflicts (K's raw rows 3 D / 2 bytes apart; V's,
  head_dim 128, code rows 96 and raw rows 128 with their chunks swizzled, ``_v_swizzle``). Rows
  outside the split are not read: V's code chunks there come from a buffer of 0xFF bytes (code 15:
  exponent 0) and the other chunks are zero-filled, so V's rows decode to +0.0 (finite: a softmax
  weight of 0 times them is 0; K's rows there get logits of -inf whatever they hold). The page's
  byte offset goes into the slot beside them (for its plain rows). The words are read back by
  ``ld.shared.v4`` (``_words``).
* **The address chain rides in the copies.** A page's copies also carry (4-byte ``cp.async``,
  ``_carry``) the heap offsets of the page STAGES on and the block-table entry of the page 2 STAGES
  on, so the loop has no global load whose latency a warp waits out (ptxas gives loads and shared
  loads the same scoreboards: before, a page's first product waited for the offset loads issued in
  the same iteration, ncu: 19% of the warps' stall samples).
* **Pairs decoded in registers** (``kv_exact4_ref.pair_decode``'s arithmetic: a funnel shift and a
  mask for the codes, two byte permutes for the window tops and the raw bytes with their sign bits
  spread, a subtraction, a permute that flags code 15, one select). K is the A operand of
  ``S^T = K Q^T`` and thread (t, nl) holds the channel pairs of code words ``M t .. M t + M - 1`` of
  its rows (channel order ``paged_decode_gluon._k_nibble_channel``; q goes through the same map); V^T
  is the A operand of ``O^T += V^T P^T``, thread (tl, j) holds token pairs of the channels of raw words
  ``M j .. M j + M - 1`` in half order (``x4_v_channel``; the sum goes back through it).
* **Plain rows** (a value outside its window: rare) are read as bf16 from after the slots, at the
  row's rank (its head entry's count plus the mask bits below it), behind one branch per thread
  (``_plain_fix``): a page without any costs a test and a branch.

``BF16`` (constexpr): the same kernel over bf16 pages ``[num_blocks, kv_heads, 16, head_dim]``: rows
staged the same way, pairs loaded as they are. Both modes put the same bf16 values in the same
operand registers, so over a cache and its exact4 encoding their outputs are equal bit for bit (the
GPU tests check it).

Numerics: q in bf16 times K on mma.sync (fp32 sums), the logits times sm_scale log2(e), base-2
softmax with a lazy running max (``paged_decode_gluon._lazy_softmax_step``: it moves by more than 8
only, so most pages skip the sum's rescale), weights rounded to bf16, fp32 sum; the merge is
``PagedDecodeAttention``'s. Compiled only (Gluon has no interpreter): the CPU tests check the channel
maps (``x4_k_channel``, ``x4_v_channel``) against the page layout and compile the kernel for sm_90;
the GPU tests compare it with its bf16 mode (bit for bit) and the fp64 reference
(``paged_decode_ref``).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.runtime.jit import constexpr_function

from .paged_decode_gluon import (_COMMIT, _CP4_ON, _STS, _WARP_SYNC, _axis, _block_of, _carry_block, _fresh_state,
                                 _k_halves, _lds, _lds_words, _lazy_softmax_step, _logits, _per_thread, _q_operand,
                                 _rescale, _rotr, _store_split, _tile_first, _vec_words, _wait_stage, _work_item, k_layout,
                                 k_nibble_channel, v_layout, words_layout)

# the channel-order code the shared helpers take for these operands (``_k_stored_channel``,
# ``_v_stored_channel``)
X4_ORDER = gl.constexpr(16)

# a 16-byte cp.async of $3 bytes (16, or 0: zero fill) from global $2 to shared byte $1 + $5 of
# global_smem, when $4 is not 0 ($5, uniform, added to the base first: one add a chunk)
_CP_ASYNC_ON = gl.constexpr("{ .reg .pred p; .reg .u32 a; setp.ne.b32 p, $4, 0; mov.u32 a, global_smem; "
                            "add.u32 a, a, $5; add.u32 a, a, $1; @p cp.async.cg.shared.global [a], [$2], 16, $3; "
                            "mov.u32 $0, 0; }")
# the carried words of a slot (bytes): the K and V page offsets of the page STAGES pages on (exact4),
# a block number further on (``_issue``)
_CARRY_OFFSETS = gl.constexpr(48)
_CARRY_BLOCK = gl.constexpr(64)
# a 64-bit store to shared byte $1 of global_smem (every lane the same value: the page offset)
_STS64 = gl.constexpr("{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $1; st.shared.b64 [a], $2; "
                      "mov.u32 $0, 0; }")
_LDS64 = gl.constexpr("{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $1; ld.shared.b64 $0, [a]; }")
_PRMT = gl.constexpr("prmt.b32 $0, $1, $2, $3;")
# rows a (at $1) and b (at $1 + $2) of one bf16 channel as a pair, a's value in the low half
_LDS_ROWS = gl.constexpr("{ .reg .u32 a; .reg .b16 x, y; mov.u32 a, global_smem; add.u32 a, a, $1; "
                         "ld.shared.b16 x, [a]; add.u32 a, a, $2; ld.shared.b16 y, [a]; mov.b32 $0, {x, y}; }")


# ----------------------------------------------------------------------------------------------------
# geometry (bytes)
# ----------------------------------------------------------------------------------------------------


@constexpr_function
def x4_geometry(head_dim, bf16):
    """Offsets in a warp's staging slot: (K tops, K codes, K raw, V tops, V codes, V raw, K code row
    stride, K raw row stride, V code row stride, V raw row stride, slot bytes). The slot starts with
    the K and the V header chunk (bytes 0 and 16), the K and V page offsets (32 and 40), the address
    chain's carried words (``_carry``: 48-67), then the rows from byte 96 (32-byte aligned: a global
    sector's two chunks land in one aligned 32 bytes, else a copy's sectors are fetched twice). bf16
    mode: the K rows at "K raw" and the V rows at "V raw", 2 head_dim bytes apart."""
    d = head_dim
    if bf16:
        kr, vr = 96, 96 + 32 * d
        return (0, 0, kr, 0, 0, vr, 0, 2 * d, 0, 2 * d, (96 + 64 * d + 127) // 128 * 128)
    kt = 96
    kc = kt + d
    kr = kc + 16 * (d // 2)
    vt = kr + 16 * (3 * d // 2)
    vc = vt + d
    # V's rows: at head_dim 128 at 32-byte multiples, their chunks swizzled (``_v_swizzle``); else padded
    # by 16 bytes
    vcs, vrs = (d // 2 + 32, d) if d == 128 else (d // 2 + 16, d + 16)
    vr = vc + 16 * vcs
    end = vr + 16 * vrs
    return (kt, kc, kr, vt, vc, vr, d // 2, 3 * d // 2, vcs, vrs, (end + 127) // 128 * 128)


def slot_bytes(head_dim: int, bf16: bool = False) -> int:
    """Bytes of one staging slot (a page of K and of V)."""
    return x4_geometry(head_dim, bf16)[10]


def smem_bytes(head_dim: int, num_warps: int, stages: int, bf16: bool = False) -> int:
    """Shared memory of the staging: ``stages`` slots per warp."""
    return num_warps * stages * slot_bytes(head_dim, bf16)


@constexpr_function
def _chunks_per_page(head_dim, bf16):
    """16-byte chunks a warp copies per page and side (K or V): bf16: 16 rows of 2 head_dim bytes;
    exact4: the head's slot (25 head_dim bytes), then the header chunk."""
    return 2 * head_dim if bf16 else 1 + 25 * head_dim // 16


@constexpr_function
def _chunk_lanes(head_dim, bf16):
    """Chunks per lane (a power of two) for K's and V's chunks of a page."""
    n = 2 * _chunks_per_page(head_dim, bf16)
    return 1 << ((n + 31) // 32 - 1).bit_length()


# ----------------------------------------------------------------------------------------------------
# channel orders (the operands' rows and columns against the stored channels)
# ----------------------------------------------------------------------------------------------------


# The stored channel of K operand column ``ch`` (32 m + 8 i + 2 t + b of ``k_layout``): channel
# 8 (M t + m) + 2 i + b, so thread t decodes code words M t .. M t + M - 1: the width-4 compact
# pages' order (exact4 code rows are nibble rows too)
x4_k_channel = k_nibble_channel


def x4_v_channel(ch, head_dim: int):
    """The stored channel of V^T operand row ``ch`` (32 m + 16 i1 + 8 i0 + j of ``v_layout``): the
    channel at byte 4 M j + 4 m + 2 i1 + i0 of a raw row in half order (channel 8 w + 4 h + b at byte
    h D / 2 + 4 w + b), i.e. 8 (M (j % 4) + m) + 4 (j // 4) + 2 i1 + i0."""
    m = head_dim // 32
    j = ch % 8
    return 8 * ((j % 4) * m + ch // 32) + 4 * (j // 4) + 2 * ((ch // 16) % 2) + (ch // 8) % 2


# ----------------------------------------------------------------------------------------------------
# the kernel's pieces
# ----------------------------------------------------------------------------------------------------


@gluon.jit
def _lds64(addr):
    """int64 at shared byte offset ``addr`` (elementwise)."""
    return gl.inline_asm_elementwise(_LDS64, "=l,r", [addr], dtype=gl.int64, is_pure=True, pack=1)


@gluon.jit
def _prmt(a, b, sel):
    return gl.inline_asm_elementwise(_PRMT, "=r,r,r,r", [a, b, sel], dtype=gl.int32, is_pure=True, pack=1)


@gluon.jit
def _pair(k7, t7, x):
    """Two values' bf16 bits from their codes at bits 7-10 and 23-26 (``k7``), their window tops at bits
    7-14 and 23-30 (``t7``) and their raw bytes with sign bits spread and masked (``x``): exponent
    top - code, or 0 for code 15 (``kv_exact4_ref.pair_decode``). No borrow crosses the halves where
    it matters: a page's tops are at least 15; in a page none of whose rows is read the tops are
    zero-filled, with K's codes 0 (no borrow) and V's 15 (both halves masked)."""
    z = _prmt(k7 + 0x78807880, 0, 0xBB99)  # 0xFFFF in the halves whose code is 15
    return ((t7 - k7) & ~z) | x


@gluon.jit
def _seed(dst, first, t1, bt_row, k_off_ptr, v_off_ptr, BF16: gl.constexpr, BLOCK_SIZE: gl.constexpr,
          STAGES: gl.constexpr, NW: gl.constexpr, SL: gl.constexpr):
    """The carried words of the slot at ``dst`` for the page of token ``first`` ([NW, 1] tensors), as
    the copies of the page STAGES before it would have carried them (``_carry``): bf16, its block;
    exact4, its K and V offsets and the block STAGES pages on. Every lane stores the same words."""
    blk = _block_of(bt_row, first, t1, BLOCK_SIZE)
    lane = _axis(32, 1, 2, SL)
    if BF16:
        gl.inline_asm_elementwise(_STS, "=r,r,r", [dst + _CARRY_BLOCK + 0 * lane, blk + 0 * lane], dtype=gl.int32,
                                  is_pure=False, pack=1)
    else:
        nxt = _block_of(bt_row, first + STAGES * NW * 16, t1, BLOCK_SIZE)
        gl.inline_asm_elementwise(_STS64, "=r,r,l", [dst + _CARRY_OFFSETS + 0 * lane, gl.load(k_off_ptr + blk) + 0 * lane],
                                  dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise(_STS64, "=r,r,l", [dst + _CARRY_OFFSETS + 8 + 0 * lane,
                                                     gl.load(v_off_ptr + blk) + 0 * lane],
                                  dtype=gl.int32, is_pure=False, pack=1)
        gl.inline_asm_elementwise(_STS, "=r,r,r", [dst + _CARRY_BLOCK + 0 * lane, nxt + 0 * lane], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _v_swizzle(row, RAW: gl.constexpr, HEAD_DIM: gl.constexpr, SWZ: gl.constexpr = True):
    """The XOR applied to the 16-byte chunk index of V's code (``RAW`` False) or raw row ``row`` in a
    slot (head_dim 128 with ``SWZ``; else 0): the operand loads of rows 0, 2, 4, 6 (and 1, 3, 5, 7) of a
    quarter warp then fall in distinct banks at row strides of 32-byte multiples (raw 128 bytes, codes
    96), and a global sector's two chunks stay one aligned 32 bytes. ``SWZ`` False
    (``KernelConfig.gluon_x4_v_swizzle``): the chunks in order, the loads with bank conflicts."""
    if (HEAD_DIM == 128) and SWZ:
        if RAW:
            return 2 * ((row // 2) % 4)
        else:
            return 2 * ((row // 4) % 2)
    else:
        return 0 * row


@gluon.jit
def _carried(dst, first, head, stride_kb, stride_kh, stride_vb, stride_vh, BF16: gl.constexpr,
             BLOCK_SIZE: gl.constexpr, HEAD_DIM: gl.constexpr):
    """What the slot at shared byte ``dst`` carries for the page (its first token ``first``) about to
    be issued into it (``_issue``): its K and V byte offsets and, exact4, the block of the page STAGES
    on (whose offsets the issue carries); bf16, the offsets from its block."""
    blk = _lds(dst + _CARRY_BLOCK)
    if BF16:
        b64 = blk.to(gl.int64)
        pib = ((first % BLOCK_SIZE) // 16) * (32 * HEAD_DIM)
        return b64 * stride_kb + head * stride_kh + pib, b64 * stride_vb + head * stride_vh + pib, blk
    else:
        return _lds64(dst + _CARRY_OFFSETS), _lds64(dst + _CARRY_OFFSETS + 8), blk


@gluon.jit
def _carry(dst, blk, fblk, t1, bt_row, k_off_ptr, v_off_ptr, BF16: gl.constexpr, BLOCK_SIZE: gl.constexpr,
           IL: gl.constexpr):
    """4-byte cp.asyncs into the slot at ``dst`` (a [NW, 1] tensor of ``SliceLayout(2, IL)``) of the
    address chain: exact4, lanes 0-3 the K and V offsets of block ``blk`` (two words each); lane 4
    (bf16: lane 0) the block of token ``fblk`` (block 0 past t1: the copy's zero fill)."""
    SL: gl.constexpr = gl.SliceLayout(2, IL)
    if BF16:
        _carry_block(dst + _CARRY_BLOCK, fblk, t1, bt_row, 0, BLOCK_SIZE, SL)
    else:
        lane = _axis(32, 1, 2, SL)
        bsrc = bt_row + fblk // BLOCK_SIZE
        bsize = gl.where(fblk < t1, 4, 0)
        b64 = blk.to(gl.int64) * 8
        osrc = gl.where(lane < 2, k_off_ptr.to(gl.pointer_type(gl.int32)) + (b64 // 4 + lane),
                        v_off_ptr.to(gl.pointer_type(gl.int32)) + (b64 // 4 + lane - 2))
        src = gl.where(lane < 4, osrc, bsrc.to(gl.pointer_type(gl.int32)) + 0 * lane)
        gl.inline_asm_elementwise(_CP4_ON, "=r,r,l,r,r", [dst + gl.where(lane < 4, _CARRY_OFFSETS + 4 * lane,
                                                                         _CARRY_BLOCK),
                                                          src, gl.where(lane < 4, 4, bsize), (lane < 5).to(gl.int32)],
                                  dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _issue(k_ptr, v_ptr, kpo, vpo, first, t0, t1, wdst, soff, ones_ptr, head, num_kv_heads, blk, fblk, bt_row, k_off_ptr,
           v_off_ptr, HEAD_DIM: gl.constexpr, BF16: gl.constexpr, BLOCK_SIZE: gl.constexpr, NW: gl.constexpr,
           IL: gl.constexpr, FULL: gl.constexpr, SWZ: gl.constexpr = True):
    """cp.async of one page of K and of V (``kpo``/``vpo``: byte offsets, ``first``: the page's first
    token, [NW, 1, 1] in ``IL``) into the warp's slot at shared byte ``wdst + soff`` (the warp's first
    slot, the slot's offset: a scalar, so a chunk's place is a loop invariant plus it), with the address chain's
    next words (``_carry``: the offsets of block ``blk``, the block of token ``fblk``), as one commit
    group; then the page offsets into the slot. Register i of a lane copies chunk 32 (i % (NCH / 2))
    + lane of K (i < NCH / 2) or of V: a register's side is a constant and its source address the
    lane's plus a constant, so a chunk costs a few instructions. ``FULL``: every warp's page lies inside
    the split (all but a split's first and last steps): no row is left out, every chunk copied whole."""
    G: gl.constexpr = x4_geometry(HEAD_DIM, BF16)
    NC: gl.constexpr = _chunks_per_page(HEAD_DIM, BF16)
    NCH: gl.constexpr = _chunk_lanes(HEAD_DIM, BF16)
    H2: gl.constexpr = NCH // 2
    D: gl.constexpr = HEAD_DIM
    ii = _axis(NCH, 2, 3, IL)
    is_v = ii >= H2
    kc = 32 * (ii % H2) + _axis(32, 1, 3, IL)  # the chunk of its side
    on = (kc < NC).to(gl.int32)
    # the page's rows read, as bits 4-19 (bit 20: any row, for the header and the tops), so that a
    # chunk's source size is (rv >> its row) & 16
    if FULL:
        rv = 0 * first + 0x1FFFF0
    else:
        lo = gl.minimum(gl.maximum(t0 - first, 0), 16)
        hi = gl.minimum(gl.maximum(t1 - first, 0), 16)
        rv = ((1 << hi) - (1 << lo)) << 4
        rv = rv | gl.where(rv != 0, 1 << 20, 0)
    base = gl.where(is_v, v_ptr + vpo, k_ptr + kpo)
    if BF16:
        row = kc // (D // 8)  # 2 D-byte rows
        src = base + 16 * kc
        dst_rel = gl.where(is_v, G[5], G[2]) + 16 * kc
        size = (rv >> row) & 16
    else:
        # chunk kq of the head's slot (tops D / 16 chunks, code rows of D / 32 from chunk D / 16, raw rows
        # of D / 16 from chunk 9 D / 16: lane pairs copy whole 32-byte sectors), then the header chunk
        # (kq = NQ)
        kq = kc
        is_hdr = kq == 25 * D // 16
        is_code = (kq >= D // 16) & (kq < 9 * D // 16)
        is_row = kq >= D // 16
        kcd = kq - D // 16
        kr = kq - 9 * D // 16
        crow = kcd // (D // 32)
        rrow = kr // (D // 16)
        row = gl.where(is_row, gl.where(is_code, crow, rrow), 16)
        dst_rel = gl.where(is_hdr, 16 * is_v.to(gl.int32),
                           gl.where(is_row, gl.where(is_code, gl.where(is_v, G[4], G[1]) + crow * gl.where(is_v, G[8], G[6])
                                                     + 16 * ((kcd % (D // 32)) ^ gl.where(is_v, _v_swizzle(crow, False, D, SWZ), 0)),
                                                     gl.where(is_v, G[5], G[2]) + rrow * gl.where(is_v, G[9], G[7])
                                                     + 16 * ((kr % (D // 16)) ^ gl.where(is_v, _v_swizzle(rrow, True, D, SWZ), 0))),
                                    gl.where(is_v, G[3], G[0]) + 16 * kq))
        hdr = (4 * num_kv_heads + 15) // 16 * 16
        src = gl.where(is_hdr, base + 16 * (head // 4), base + (hdr + head * (25 * D)) + 16 * kq)
        if FULL:
            size = 16 + 0 * kc
        else:
            size = (rv >> row) & 16
            # V's code chunks of rows not read: code 15 from the 0xFF buffer (K's rows not read are
            # zeros: their logits are masked, whatever their values)
            vc = is_v & is_code & (size == 0)
            src = gl.where(vc, ones_ptr, src)
            size = gl.where(vc, 16, size)
    _per_thread(_WARP_SYNC, NW)
    dst = wdst + soff
    gl.inline_asm_elementwise(_CP_ASYNC_ON, "=r,r,l,r,r,r", [wdst + dst_rel, src, size, on, soff + 0 * on], dtype=gl.int32,
                              is_pure=False, pack=1)
    SL: gl.constexpr = gl.SliceLayout(2, IL)
    _carry(gl.max(dst, axis=2), gl.max(blk, axis=2), gl.max(fblk, axis=2), t1, bt_row, k_off_ptr, v_off_ptr, BF16,
           BLOCK_SIZE, IL)
    _per_thread(_COMMIT, NW)
    if not BF16:
        # the page offsets at bytes 32 (K) and 40 (V): even lanes store K's, odd lanes V's
        side = _axis(32, 1, 2, SL) % 2
        gl.inline_asm_elementwise(_STS64, "=r,r,l", [gl.max(dst, axis=2) + 32 + 8 * side,
                                                     gl.where(side == 1, gl.max(vpo, axis=2), gl.max(kpo, axis=2))],
                                  dtype=gl.int32, is_pure=False, pack=1)


@constexpr_function
def _plain_fix_asm(n, two, row_bytes):
    """``n`` pairs of bf16 bits ($0.., tied to $n..) with the values of plain rows loaded, behind one
    branch on the last operand (any flag of the thread): plain rows are rare, so a thread pays the
    test and the branch, not the loads or their addresses. Operands of pair k: its row's flag
    $2n+k, row $3n+k, the head's entry $4n+k (plain-row mask, plain rows before the head), the
    plain rows' base $5n+k (the page's first plain row plus the lane's part) and the pair's own
    offset $6n+k; with ``two`` (V: a token pair), the flag of the odd row at $7n+k (the row + 1), the
    halves loaded separately. A plain row's place: its rank (the entry's count plus the mask bits
    below the row) times ``row_bytes``."""
    def addr(k, row):
        return (f"shl.b32 m, 1, {row}; add.s32 m, m, -1; and.b32 m, m, ${4 * n + k}; popc.b32 m, m; "
                f"shr.u32 c, ${4 * n + k}, 16; add.s32 m, m, c; mul.wide.u32 a, m, {row_bytes}; "
                f"add.s64 a, a, ${5 * n + k}; add.s64 a, a, ${6 * n + k}; ")
    parts = []
    for k in range(n):
        if two:
            parts.append(f"setp.ne.s32 q, ${2 * n + k}, 0; setp.ne.s32 r, ${7 * n + k}, 0; mov.b32 {{lo, hi}}, ${k}; "
                         + addr(k, f"${3 * n + k}") + f"@q ld.global.b16 lo, [a]; add.s32 w, ${3 * n + k}, 1; "
                         + addr(k, "w") + f"@r ld.global.b16 hi, [a]; mov.b32 ${k}, {{lo, hi}};")
        else:
            parts.append(f"setp.ne.s32 q, ${2 * n + k}, 0; " + addr(k, f"${3 * n + k}") + f"@q ld.global.b32 ${k}, [a];")
    last = (8 if two else 7) * n
    return (f"{{ .reg .pred p, q, r; .reg .b16 lo, hi; .reg .u32 m, c, w; .reg .u64 a; setp.eq.s32 p, ${last}, 0; "
            f"@p bra SKIP; {' '.join(parts)} SKIP: }}")


@constexpr_function
def _plain_fix_constraints(n, two):
    cons = ["=r"] * n + [str(k) for k in range(n)] + ["r"] * (3 * n) + ["l"] * (2 * n)
    return ",".join(cons + (["r"] * n if two else []) + ["r"] * n)


@gluon.jit
def _plain_fix(v, flag, row, entry, base, off, flag_b, anyp, TWO: gl.constexpr, ROW_BYTES: gl.constexpr,
               N: gl.constexpr):
    """Pairs ``v`` (bf16 bits, int32) with their plain rows' values (``_plain_fix_asm``): K pairs
    (one row: ``flag``/``row``), or V token pairs (``TWO``: rows ``row`` and ``row + 1``, flags
    ``flag`` and ``flag_b``)."""
    args = [v, flag.to(gl.int32), row, entry, base, off.to(gl.int64)]
    if TWO:
        args = args + [flag_b.to(gl.int32)]
    return gl.inline_asm_elementwise(_plain_fix_asm(N, TWO, ROW_BYTES), _plain_fix_constraints(N, TWO),
                                     args + [anyp], dtype=gl.int32, is_pure=True, pack=N)


@gluon.jit
def _plain_rows(base, side: gl.constexpr, fr, r, t0, t1, head):
    """For page rows ``r`` of the staged page (its first token ``fr``): whether each is plain (and
    read), and the head's entry in the staged header chunk of K (``side`` 0) or V (1)."""
    ent = _lds(base + 16 * side + 4 * (head % 4))
    return (((ent >> r) & 1) != 0) & (fr + r >= t0) & (fr + r < t1), ent


@gluon.jit
def _words(addr, VEC: gl.constexpr, L: gl.constexpr, DIM: gl.constexpr):
    """The 32-bit words at shared byte offsets ``addr`` (a tensor in ``words_layout(L, m)`` whose last
    dim has size 1), ``VEC`` consecutive words of dim m per ``ld.shared.v*``, relaid out to ``L`` and
    that last dim (``DIM``) dropped: a tensor of ``SliceLayout(DIM, L)``."""
    return gl.max(gl.convert_layout(_lds_words(addr, VEC), L, assert_trivial=True), axis=DIM)


@gluon.jit
def _page_offset_of(base, side: gl.constexpr):
    return _lds64(base + 32 + 8 * side)


@gluon.jit
def _k_operand(base, heap_ptr, fr, t0, t1, head, num_kv_heads, HEAD_DIM: gl.constexpr, BF16: gl.constexpr,
               NW: gl.constexpr, OPA: gl.constexpr):
    """K [NW, 16, HEAD_DIM] bf16 in the A-operand layout, as its two halves along the reduction
    (``_k_halves``), from the warp's staged page at shared byte
    ``base`` ([NW, 1, ..] in the pair layout): thread (t, nl) holds rows 8 nh + nl, channel pairs
    8 (M t + m) + 2 i + (0, 1) (``x4_k_channel``). The pairs are made in ``k_layout`` less its last
    dim (one int32 each), then split into values."""
    M: gl.constexpr = HEAD_DIM // 32
    G: gl.constexpr = x4_geometry(HEAD_DIM, BF16)
    LK: gl.constexpr = k_layout(NW, M)
    LP: gl.constexpr = gl.SliceLayout(6, LK)
    r = 8 * _axis(2, 1, 6, LP) + _axis(8, 2, 6, LP)
    m = _axis(M, 3, 6, LP)
    i = _axis(4, 4, 6, LP)
    t = _axis(4, 5, 6, LP)
    w = M * t + m  # the code word (8 channels) of the pair
    if BF16:
        val = _lds(base + G[2] + r * G[7] + 2 * (8 * w + 2 * i))
    else:
        # the words, M consecutive ones of a row per lane (vector loads), in the words' layout
        LW: gl.constexpr = words_layout(LK, 3)
        VEC: gl.constexpr = _vec_words(M)
        bw = gl.expand_dims(gl.convert_layout(base, gl.SliceLayout(6, LW), assert_trivial=True), 6)
        rw_ = 8 * _axis(2, 1, 7, LW) + _axis(8, 2, 7, LW)
        ww = 4 * (M * _axis(4, 5, 7, LW) + _axis(M, 3, 7, LW))
        hw = (_axis(4, 4, 7, LW) // 2) * (HEAD_DIM // 2)
        cw = _words(bw + G[1] + rw_ * G[6] + ww, VEC, LK, 6)
        tw = _words(bw + G[0] + hw + ww, VEC, LK, 6)
        rw = _words(bw + G[2] + rw_ * G[7] + hw + ww, VEC, LK, 6)
        k7 = _rotr(cw, 4 * i - 7) & 0x07800780  # nibble i of each half to bits 7-10
        t7 = _prmt(tw, 0, 0x4140 + 0x202 * (i % 2)) << 7  # tops of bytes 2 (i % 2), + 1
        x = _prmt(rw, 0, 0x9180 + 0x2222 * (i % 2)) & -2139127681  # 0x807F807F: raw bytes, signs spread
        val = _pair(k7, t7, x)
        rowp, ent = _plain_rows(base, 0, fr, r, t0, t1, head)
        hdr = (4 * num_kv_heads + 15) // 16 * 16
        prow = (heap_ptr.to(gl.int64) + _page_offset_of(base, 0) + hdr + num_kv_heads * (25 * HEAD_DIM)
                + (16 * M) * t)
        anyp = gl.expand_dims(gl.max(rowp.to(gl.int32), axis=1), 1)
        val = _plain_fix(val, rowp, r, ent, prow, 2 * (8 * m + 2 * i), rowp, anyp, False, 2 * HEAD_DIM, 32)
    half = ((gl.expand_dims(val, 6) >> (16 * _axis(2, 6, 7, LK))) & 0xFFFF).to(gl.int16).to(gl.bfloat16,
                                                                                        bitcast=True)
    return _k_halves(half, NW, HEAD_DIM, OPA)


@gluon.jit
def _v_operand(base, heap_ptr, fr, t0, t1, head, num_kv_heads, HEAD_DIM: gl.constexpr, BF16: gl.constexpr,
               NW: gl.constexpr, OPA: gl.constexpr, SWZ: gl.constexpr = True):
    """V^T [NW, HEAD_DIM, 16] bf16 in the A-operand layout from the warp's staged page: thread (tl, j)
    holds rows 8 th + 2 tl + (0, 1) of the channels at raw-row bytes 4 M j + 4 m + 2 i1 + i0
    (``x4_v_channel``); the token pairs made in ``v_layout`` less its last dim."""
    M: gl.constexpr = HEAD_DIM // 32
    G: gl.constexpr = x4_geometry(HEAD_DIM, BF16)
    LV: gl.constexpr = v_layout(NW, M)
    LP: gl.constexpr = gl.SliceLayout(7, LV)
    m = _axis(M, 1, 7, LP)
    i1 = _axis(2, 2, 7, LP)
    i0 = _axis(2, 3, 7, LP)
    j = _axis(8, 4, 7, LP)
    ra = 8 * _axis(2, 5, 7, LP) + 2 * _axis(4, 6, 7, LP)  # the pair's even row
    w = M * (j % 4) + m  # the code word of the channel
    bp = 2 * i1 + i0  # the channel's byte in its raw word
    pos = 4 * M * j + 4 * m  # the raw word's byte offset in a row
    if BF16:
        ch = 8 * w + 4 * (j // 4) + bp
        val = gl.inline_asm_elementwise(_LDS_ROWS, "=r,r,r", [base + G[5] + ra * G[9] + 2 * ch, G[9] + 0 * ra],
                                        dtype=gl.int32, is_pure=True, pack=1)
    else:
        LW: gl.constexpr = words_layout(LV, 1)
        VEC: gl.constexpr = _vec_words(M)
        bw = gl.expand_dims(gl.convert_layout(base, gl.SliceLayout(7, LW), assert_trivial=True), 7)
        raw_ = 8 * _axis(2, 5, 8, LW) + 2 * _axis(4, 6, 8, LW)
        jw = _axis(8, 4, 8, LW)
        mw = _axis(M, 1, 8, LW)
        cpos = 4 * (M * (jw % 4) + mw)  # the code word's byte in its row, then its chunk swizzled
        ca = _words(bw + G[4] + raw_ * G[8] + (cpos ^ (16 * _v_swizzle(raw_, False, HEAD_DIM, SWZ))), VEC, LV, 7)
        cb = _words(bw + G[4] + (raw_ + 1) * G[8] + (cpos ^ (16 * _v_swizzle(raw_ + 1, False, HEAD_DIM, SWZ))), VEC, LV, 7)
        bc = 2 * i0 + (j // 4)  # the byte of a code word holding the channel's nibble (nibble i1)
        k7 = _rotr(_prmt(ca, cb, bc * 0x11 + (bc + 4) * 0x1100), 4 * i1 - 7) & 0x07800780
        posw = 4 * M * jw + 4 * mw
        tw = _words(bw + G[3] + posw, VEC, LV, 7)
        t7 = _prmt(tw, 0, bp * 0x101 + 0x4040) << 7
        rwa = _words(bw + G[5] + raw_ * G[9] + (posw ^ (16 * _v_swizzle(raw_, True, HEAD_DIM, SWZ))), VEC, LV, 7)
        rwb = _words(bw + G[5] + (raw_ + 1) * G[9] + (posw ^ (16 * _v_swizzle(raw_ + 1, True, HEAD_DIM, SWZ))), VEC, LV, 7)
        x = _prmt(rwa, rwb, bp * 0x1111 + 0xC480) & -2139127681  # 0x807F807F
        val = _pair(k7, t7, x)
        pa, ent = _plain_rows(base, 1, fr, ra, t0, t1, head)
        pb, _ = _plain_rows(base, 1, fr, ra + 1, t0, t1, head)
        hdr = (4 * num_kv_heads + 15) // 16 * 16
        prow = (heap_ptr.to(gl.int64) + _page_offset_of(base, 1) + hdr + num_kv_heads * (25 * HEAD_DIM)
                + 2 * (8 * M * (j % 4) + 4 * (j // 4)))
        anyp = gl.expand_dims(gl.max((pa | pb).to(gl.int32), axis=5), 5)
        val = _plain_fix(val, pa, ra, ent, prow, 2 * (8 * m + bp), pb, anyp, True, 2 * HEAD_DIM, 32)
    half = ((gl.expand_dims(val, 7) >> (16 * _axis(2, 7, 8, LV))) & 0xFFFF).to(gl.int16).to(gl.bfloat16,
                                                                                        bitcast=True)
    return gl.convert_layout(gl.reshape(half, [NW, HEAD_DIM, 16]), OPA, assert_trivial=True)


@gluon.jit
def exact4_split_kernel(
    q_ptr, k_ptr, v_ptr, k_off_ptr, v_off_ptr, ones_ptr, block_tables_ptr,
    work_seq_ptr, work_start_ptr, work_end_ptr,
    ws_m_ptr, ws_l_ptr, ws_acc_ptr,
    qk_scale,  # sm_scale * log2(e)
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_bt,
    num_kv_heads,
    GROUP: gl.constexpr, BLOCK_G: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
    BF16: gl.constexpr = False, BLOCK_SIZE: gl.constexpr = 16, V_SWIZZLE: gl.constexpr = True,
):
    """One split of one KV head over KV Exact4 pages (``k_ptr``/``v_ptr``: the byte heaps,
    ``k_off_ptr``/``v_off_ptr``: int64 page offsets per block; 16-token blocks) or, with ``BF16``, bf16
    pages (``k_ptr``/``v_ptr`` as bytes, byte strides; ``BLOCK_SIZE`` tokens a block), as ``paged_decode._paged_split_kernel`` computes
    it: the running max (base 2), mass and unnormalized fp32 sum into the split's workspace rows.
    ``ones_ptr``: 16 bytes of 0xFF. No logit bias."""
    NW: gl.constexpr = gl.num_warps()
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1], instr_shape=[1, 16, 8])
    OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    OPB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    HEADS: gl.constexpr = gl.SliceLayout(1, MMA)  # [NW, BLOCK_G]
    ROWS: gl.constexpr = gl.SliceLayout(2, MMA)  # [NW, 16]
    M: gl.constexpr = HEAD_DIM // 32
    SLOT: gl.constexpr = x4_geometry(HEAD_DIM, BF16)[10]
    NCH: gl.constexpr = _chunk_lanes(HEAD_DIM, BF16)
    IL: gl.constexpr = gl.BlockedLayout([1, 1, NCH], [1, 32, 1], [NW, 1, 1], [2, 1, 0])
    LK: gl.constexpr = k_layout(NW, M)
    LV: gl.constexpr = v_layout(NW, M)

    item, head, seq, t0, t1 = _work_item(work_seq_ptr, work_start_ptr, work_end_ptr)
    # the staging slots at offset 0 (the merge's scratch reuses them after the loop)
    stg = gl.allocate_shared_memory(gl.int32, [NW * STAGES * SLOT // 4], gl.SwizzledSharedLayout(1, 1, 1, [0]))

    q_lo = _q_operand(q_ptr, seq, head, stride_qb, stride_qh, gl.bfloat16, GROUP, BLOCK_G, HEAD_DIM, NW, OPB, X4_ORDER, 0)
    q_hi = _q_operand(q_ptr, seq, head, stride_qb, stride_qh, gl.bfloat16, GROUP, BLOCK_G, HEAD_DIM, NW, OPB, X4_ORDER, 1)
    m_i, _, acc = _fresh_state(NW, BLOCK_G, HEAD_DIM, MMA, HEADS)
    l_t = gl.zeros([NW, 16, BLOCK_G], gl.float32, layout=MMA)  # the mass per thread (``_lazy_softmax_step``)
    bt_row = block_tables_ptr + seq.to(gl.int64) * stride_bt
    lo = t0 - t0 % 16
    n_iter = gl.cdiv(t1 - lo, NW * 16)
    rr = _axis(16, 1, 2, ROWS)
    wk = _axis(NW, 0, 6, gl.SliceLayout(6, LK))
    wv = _axis(NW, 0, 7, gl.SliceLayout(7, LV))
    wi = _axis(NW, 0, 3, IL)
    # the address chain rides in the copies (``_carry``), so no load in the loop waits for memory: each
    # slot starts with what the page issued into it needs, seeded here for the first STAGES pages
    NB: gl.constexpr = 1 if BF16 else 2
    SL: gl.constexpr = gl.SliceLayout(2, IL)
    wl = _axis(NW, 0, 2, SL)
    for s0 in gl.static_range(STAGES):
        _seed((wl * STAGES + s0) * SLOT, _tile_first(lo, s0, NW, 2, SL), t1, bt_row, k_off_ptr, v_off_ptr,
              BF16, BLOCK_SIZE, STAGES, NW, SL)
    _per_thread(_WARP_SYNC, NW)
    wdst = wi * (STAGES * SLOT)  # the warp's first slot
    for s0 in gl.static_range(STAGES - 1):
        f = _tile_first(lo, s0, NW, 3, IL)
        ko, vo, blk = _carried(wdst + s0 * SLOT, f, head, stride_kb, stride_kh, stride_vb, stride_vh,
                               BF16, BLOCK_SIZE, HEAD_DIM)
        _issue(k_ptr, v_ptr, ko, vo, f, t0, t1, wdst, s0 * SLOT, ones_ptr, head, num_kv_heads, blk,
               _tile_first(lo, s0 + NB * STAGES, NW, 3, IL), bt_row, k_off_ptr, v_off_ptr, HEAD_DIM, BF16,
               BLOCK_SIZE, NW, IL, False, V_SWIZZLE)
    for j in range(0, n_iter):
        # page j + STAGES - 1 into the slot page j - 1 used (which carried its offsets); page j landed
        f = _tile_first(lo, j + STAGES - 1, NW, 3, IL)
        soff = ((j + STAGES - 1) % STAGES) * SLOT
        ko, vo, blk = _carried(wdst + soff, f, head, stride_kb, stride_kh, stride_vb, stride_vh, BF16, BLOCK_SIZE, HEAD_DIM)
        fblk = _tile_first(lo, j + STAGES - 1 + NB * STAGES, NW, 3, IL)
        step0 = lo + (j + STAGES - 1) * (NW * 16)  # the step's first token
        if (step0 >= t0) & (step0 + NW * 16 <= t1):
            _issue(k_ptr, v_ptr, ko, vo, f, t0, t1, wdst, soff, ones_ptr, head, num_kv_heads, blk, fblk, bt_row, k_off_ptr,
                   v_off_ptr, HEAD_DIM, BF16, BLOCK_SIZE, NW, IL, True, V_SWIZZLE)
        else:
            _issue(k_ptr, v_ptr, ko, vo, f, t0, t1, wdst, soff, ones_ptr, head, num_kv_heads, blk, fblk, bt_row, k_off_ptr,
                   v_off_ptr, HEAD_DIM, BF16, BLOCK_SIZE, NW, IL, False, V_SWIZZLE)
        slot = _wait_stage(j % STAGES, STAGES - 1)
        fr = _tile_first(lo, j, NW, 2, ROWS)
        frk = _tile_first(lo, j, NW, 6, gl.SliceLayout(6, LK))
        k_lo, k_hi = _k_operand((wk * STAGES + slot) * SLOT, k_ptr, frk, t0, t1, head, num_kv_heads, HEAD_DIM,
                                BF16, NW, OPA)
        s = _logits(k_lo, k_hi, q_lo, q_hi, NW, BLOCK_G, MMA) * qk_scale
        p, alpha, m_new, l_t = _lazy_softmax_step(s, (fr + rr >= t0) & (fr + rr < t1), m_i, l_t)
        pt = gl.convert_layout(p.to(gl.bfloat16), OPB)
        frv = _tile_first(lo, j, NW, 7, gl.SliceLayout(7, LV))
        vt = _v_operand((wv * STAGES + slot) * SLOT, v_ptr, frv, t0, t1, head, num_kv_heads, HEAD_DIM, BF16, NW,
                        OPA, V_SWIZZLE)
        acc = mma_v2(vt, pt, _rescale(acc, alpha, m_new != m_i, HEAD_DIM, BLOCK_G))
        m_i = m_new
    _wait_stage(0, 0)  # the copies past the split's end, before the merge's scratch may reuse their memory
    stg._keep_alive()
    gl.thread_barrier()
    _store_split(m_i, gl.sum(l_t, axis=1), acc, 1.0, item, head, num_kv_heads, ws_m_ptr, ws_l_ptr, ws_acc_ptr, GROUP, BLOCK_G,
                 HEAD_DIM, MMA, HEADS, X4_ORDER)
