"""KV Exact4 pages on the GPU: the encoder (the cache-write path and a bulk codec) and a validating
decoder, byte for byte the reference's (``kv_exact4_ref``; docs/FORMAT.md, "KV Exact4 pages,
version 1").

    entries, lengths = page_entries(values)          # plain-row mask and count per (page, head); bytes
    offsets = <allocate lengths>                     # PageHeap.alloc, or a prefix sum (encode_pages)
    write_pages(values, entries, offsets, buf)       # every byte of every page
    bits = decode_pages(buf, offsets, heads, head_dim)   # checks every rule, as kv_exact4_ref does

values: bf16 (or int16 bits) ``[n, 16, H, D]``, token-major as a model writes K or V. The encoder
runs one program per (page, head): the sizes pass finds the head's window tops and its plain rows;
the host places the pages from their lengths; the write pass codes the head again and stores its
slot, its header entry and its plain rows (the (page, 0) program also the header's zero padding).
Programs write disjoint bytes. Its programs hold a head's 16 token rows as words: ``[D / 8, 16]``
tensors, word m of a row for channels 8 m .. 8 m + 7, as the format lays out codes (one u32 per
word), raw bytes and tops (a u32 per half: channels 8 m .. 8 m + 3 at byte 4 m, 8 m + 4 .. 8 m + 7
at byte D / 2 + 4 m). So every load and store is of whole u32 words at consecutive addresses, and
no value changes threads.

The decoder is the reference decoder's rules in one pass, one program per page: the offsets and
the header once, then its heads, all at once where they fit: tensors ``[heads, D / 8]``, a thread on
one word column (8 channels) of a head, through which the 16 rows pass (unrolled, loaded two rows
ahead), so what derives from the window tops is made once per column and the checks over rows
accumulate in registers; plain rows (rare) are loaded by inline PTX into that same layout. A
program stores the bits of the rules its page breaks (``ERRORS``, one bit each) and the host
raises the reference's error for the first rule, in the reference's order, that any page breaks,
naming the lowest such page: the same error class and page as ``kv_exact4_ref.decode_pages``.
Loads stay inside each page's bytes, so hostile offsets and headers read nothing outside the
buffer. ``decode_pages`` returns the values of pages that pass; the attention kernel's tile loader
(``paged_decode.dequantize_exact4_pages``) reads the same values and checks nothing.
"""

from __future__ import annotations

import threading

import torch
import triton
import triton.language as tl

from weightszip.errors import CorruptDataError, TruncatedError

from . import kv_exact4_ref as ref
from ._interpreter_compat import apply as _interpreter_compat
from ._interpreter_compat import interpreting as _interpreting
from .kv_exact_ref import _check
from .paged_decode import _popc, exact4_asm

_interpreter_compat()

I32 = tl.constexpr(tl.pointer_type(tl.int32))
# The attention kernel's tile decoder (paged_decode._exact4_pair_ptx), two values per u32 out.
_ASM_LANES = tl.constexpr(exact4_asm(words=True, lanes=True))
_ASM_LANES_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 4 + ["r"] * 7))
_ASM_DTYPES = tl.constexpr((tl.int32,) * 4)
_BYTE_TOPS = tl.constexpr(0x80808080 - (1 << 32))  # bit 7 of every byte, as an int32

# The decoder's rule bits, in the order kv_exact4_ref.decode_pages checks them: (bit, class, message).
ERRORS = (
    (1, TruncatedError, "shorter than its {fixed} bytes of header and slots"),
    (2, CorruptDataError, "nonzero header padding"),
    (4, CorruptDataError, "a head's count of earlier plain rows is wrong"),
    (8, TruncatedError, "shorter than its plain rows"),
    (16, CorruptDataError, "longer than its plain rows"),
    (32, CorruptDataError, "a plain row's codes or raw bytes are not zero"),
    (64, CorruptDataError, f"a window top below {ref.MIN_TOP}"),
    (128, CorruptDataError, "a plain row whose values all have codes"),
    (256, CorruptDataError, "a window top is not its channel's largest exponent"),
)
# Offsets out of order, outside the buffer or not multiples of 16: the host sorts out which (page_spans).
OFFSETS = tl.constexpr(1 << 16)
# The decoder's flags per element (bits that no nibble bit (0x11111111) or top flag (0x80808080) uses)
PLAIN_CODED = tl.constexpr(2)  # a plain row's codes or raw bytes are not zero
ABOVE = tl.constexpr(4)  # a value above its top, or a top no row reaches
ALL_FIT = tl.constexpr(8)  # a plain row whose values all have codes


@triton.jit
def _split4(x, WR: tl.constexpr):
    """int32 [WR, 16, 4] -> its four [WR, 16] slices (index 0 .. 3 of the last axis)."""
    a, b = tl.split(tl.reshape(x, [WR, 16, 2, 2]))  # a: indices 0, 2; b: 1, 3
    x0, x2 = tl.split(a)
    x1, x3 = tl.split(b)
    return x0, x1, x2, x3


@triton.jit
def _lo(x):
    return x & 0xFFFF


@triton.jit
def _hi(x):
    return (x >> 16) & 0xFFFF


@triton.jit
def _exp(v):
    return (v >> 7) & 0xFF


@triton.jit
def _top(v):
    """A channel's window top: max(15, its largest exponent) over the 16 rows: [WR, 16] -> [WR]."""
    return tl.maximum(tl.max(_exp(v), axis=1), 15)


@triton.jit
def _fits(v, top):
    """Whether each value has a code against its top (exponent 0, or top - 14 .. top); top broadcasts
    against v."""
    e = _exp(v)
    d = top - e
    return (e == 0) | ((d >= 0) & (d < 15))


@triton.jit
def _code(v, top):
    """The 4-bit code of each value that has one (0 where none); top broadcasts against v."""
    e = _exp(v)
    d = top - e
    return tl.where(e == 0, 15, tl.where((d >= 0) & (d < 15), d, 0))


@triton.jit
def _raw(v):
    return ((v >> 8) & 0x80) | (v & 0x7F)


@triton.jit
def _bytes4(a, b, c, d):
    return a | (b << 8) | (c << 16) | (d << 24)


@triton.jit
def _plain_rows(v0, v1, v2, v3, v4, v5, v6, v7, t0, t1, t2, t3, t4, t5, t6, t7):
    """1 for each plain row (a value without a code): int32 [16] (one reduction for all eight)."""
    fit = (_fits(v0, t0[:, None]) & _fits(v1, t1[:, None]) & _fits(v2, t2[:, None]) & _fits(v3, t3[:, None])
           & _fits(v4, t4[:, None]) & _fits(v5, t5[:, None]) & _fits(v6, t6[:, None]) & _fits(v7, t7[:, None]))
    return tl.max((~fit).to(tl.int32), axis=0)


@triton.jit
def _load_head(vals_ptr, page, head, H, D: tl.constexpr):
    """One (page, head)'s 16 rows as int32 [D / 8, 16, 4] (word q of group m of row t: channels 8 m
    + 2 q and 8 m + 2 q + 1) and its eight channels per group, v0 .. v7 [D / 8, 16] (16-bit
    patterns). Rows on the second axis: a thread holds several rows of a group, so the reductions
    over rows (the window tops) stay mostly inside threads."""
    WR: tl.constexpr = D // 8
    t = tl.arange(0, 16)
    row = (page.to(tl.int64) * 16 + t) * H + head
    idx = row[None, :, None] * (D // 2) + (tl.arange(0, WR) * 4)[:, None, None] + tl.arange(0, 4)[None, None, :]
    x = tl.load(vals_ptr.to(I32) + idx)
    x0, x1, x2, x3 = _split4(x, WR)
    return x, _lo(x0), _hi(x0), _lo(x1), _hi(x1), _lo(x2), _hi(x2), _lo(x3), _hi(x3)


@triton.jit
def _entries_kernel(vals_ptr, ent_ptr, H, D: tl.constexpr):
    """Sizes pass: entry (plain-row mask | plain rows << 16) of (page, head) = program ids."""
    page = tl.program_id(0)
    head = tl.program_id(1)
    _, v0, v1, v2, v3, v4, v5, v6, v7 = _load_head(vals_ptr, page, head, H, D)
    plain = _plain_rows(v0, v1, v2, v3, v4, v5, v6, v7, _top(v0), _top(v1), _top(v2), _top(v3),
                        _top(v4), _top(v5), _top(v6), _top(v7))
    t = tl.arange(0, 16)
    ent = tl.sum(plain << t, axis=0) | (tl.sum(plain, axis=0) << 16)
    tl.store(ent_ptr + page.to(tl.int64) * H + head, ent)


@triton.jit
def _write_kernel(vals_ptr, ent_ptr, off_ptr, buf_ptr, H, HDR, FIXED, D: tl.constexpr, HP: tl.constexpr):
    """Write pass: the slot, header entry and plain rows of (page, head) = program ids, the page at
    ``off_ptr[page]``; ``ent_ptr`` the sizes pass's entries (for the plain rows of earlier heads)."""
    WR: tl.constexpr = D // 8
    page = tl.program_id(0)
    head = tl.program_id(1)
    x, v0, v1, v2, v3, v4, v5, v6, v7 = _load_head(vals_ptr, page, head, H, D)
    t0, t1, t2, t3, t4, t5, t6, t7 = _top(v0), _top(v1), _top(v2), _top(v3), _top(v4), _top(v5), _top(v6), _top(v7)
    plain = _plain_rows(v0, v1, v2, v3, v4, v5, v6, v7, t0, t1, t2, t3, t4, t5, t6, t7)
    t = tl.arange(0, 16)
    hs = tl.arange(0, HP)
    ents = tl.load(ent_ptr + page.to(tl.int64) * H + hs, mask=hs < H, other=0)
    before = tl.sum(tl.where(hs < head, ents >> 16, 0), axis=0)
    base = tl.multiple_of(tl.load(off_ptr + page), 16)
    mask = tl.sum(plain << t, axis=0)
    tl.store((buf_ptr + base + 4 * head).to(I32), mask | (before << 16))
    if head == 0:  # the header's zero padding
        pad = 4 * H + tl.arange(0, 16)
        tl.store(buf_ptr + base + pad, tl.zeros([16], dtype=tl.uint8), mask=pad < HDR)
    slot = base + HDR + head * (25 * D)
    m4 = tl.arange(0, WR) * 4
    # tops, in half order
    sw = (buf_ptr + slot).to(I32)  # the slot as u32 words: tops [D / 4], codes [16][D / 8], raw [16][D / 4]
    m = tl.arange(0, WR)
    tl.store(sw + m, _bytes4(t0, t1, t2, t3))
    tl.store(sw + WR + m, _bytes4(t4, t5, t6, t7))
    # codes: word m of a row, channel 8 m + r at bit 16 (r % 2) + 4 (r // 2); plain rows zero
    cw = (_code(v0, t0[:, None]) | (_code(v1, t1[:, None]) << 16) | (_code(v2, t2[:, None]) << 4)
          | (_code(v3, t3[:, None]) << 20) | (_code(v4, t4[:, None]) << 8) | (_code(v5, t5[:, None]) << 24)
          | (_code(v6, t6[:, None]) << 12) | (_code(v7, t7[:, None]) << 28))
    coded = plain[None, :] == 0
    tl.store(sw + 2 * WR + m[:, None] + (t * WR)[None, :], tl.where(coded, cw, 0))
    # raw bytes (sign, mantissa), in half order; plain rows zero
    r0 = _bytes4(_raw(v0), _raw(v1), _raw(v2), _raw(v3))
    r1 = _bytes4(_raw(v4), _raw(v5), _raw(v6), _raw(v7))
    rows = 18 * WR + m[:, None] + (t * (2 * WR))[None, :]
    tl.store(sw + rows, tl.where(coded, r0, 0))
    tl.store(sw + WR + rows, tl.where(coded, r1, 0))
    # plain rows: their bf16 values after the slots, head-major then token
    rank = before + tl.cumsum(plain, axis=0) - plain
    start = rank.to(tl.int64) * (D // 2)  # words after the slots
    idx = start[None, :, None] + (m * 4)[:, None, None] + tl.arange(0, 4)[None, None, :]
    tl.store((buf_ptr + base + FIXED).to(I32) + idx, x, mask=(plain != 0)[None, :, None])


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _below15(x):
    """0x80 in each byte of x below 15 (SWAR: no borrow crosses a byte)."""
    return ~x & ~((x | _BYTE_TOPS) - 0x0F0F0F0F) & _BYTE_TOPS


@triton.jit
def _not15(x):
    """1 in each byte of x other than 15 (bit 0 of the byte)."""
    y = x ^ 0x0F0F0F0F
    y = y | (y >> 4)
    y = y | (y >> 2)
    return (y | (y >> 1)) & 0x01010101


@triton.jit
def _load16(ptr, mask, FAST: tl.constexpr):
    """The four u32 words at each 16-byte aligned byte address of ``ptr`` (0 where not ``mask``), in
    ptr's layout: compiled, one predicated 16-byte load per element in PTX, so the words need no
    layout of their own (Triton would give four strided loads another one, and convert)."""
    if FAST:
        return tl.inline_asm_elementwise(
            "{ .reg .pred p; setp.ne.b32 p, $5, 0; mov.b32 $0, 0; mov.b32 $1, 0; mov.b32 $2, 0; mov.b32 $3, 0;\n"
            "@p ld.global.v4.u32 {$0, $1, $2, $3}, [$4]; }",
            "=r,=r,=r,=r,l,r", [ptr.to(tl.int64, bitcast=True), mask.to(tl.int32)], dtype=(tl.int32,) * 4,
            is_pure=False, pack=1)
    else:
        w = ptr.to(I32)
        return (tl.load(w, mask=mask, other=0), tl.load(w + 1, mask=mask, other=0), tl.load(w + 2, mask=mask, other=0),
                tl.load(w + 3, mask=mask, other=0))


@triton.jit
def _lanes_nonzero(x):
    """Bit 0 / bit 16 where the low / high 16-bit lane of x (each below 0x8000) is not 0."""
    return ((x + 0x7FFF7FFF) >> 15) & 0x00010001


@triton.jit
def _plain_word(w, T, q: tl.constexpr):
    """Word q of plain rows' values (channels 8 m + 2 q, low half, and 8 m + 2 q + 1) against their
    tops (bytes 2 (q % 2) and 2 (q % 2) + 1 of ``T``: T0 for q < 2, else T1), two channels per op in
    16-bit lanes: (the channels' nibble bits (bit 4 q, 16 + 4 q) where the value does not reach its
    top, ABOVE where one lies above it, a bit per lane where a value has no code)."""
    e = (w >> 7) & 0x00FF00FF
    tb = (T >> (16 * (q % 2))) & 0xFFFF
    t = (tb & 0xFF) | ((tb & 0xFF00) << 8)
    d = (t | 0x01000100) - e  # lanes 256 + top - exponent, in 1 .. 511: no borrow between lanes
    r = d ^ 0x01000100  # lanes: top - exponent where it is 0 .. 255; 256 and up where the value is above
    miss = _lanes_nonzero(r) << (4 * q)
    above = tl.where((~d & 0x01000100) != 0, ABOVE, 0)
    no_code = _lanes_nonzero(e) & ((r + 0x7FF17FF1) >> 15) & 0x00010001  # not 0, not top - 14 .. top
    return miss, above, no_code


@triton.jit
def _plain_exps(x0, x1, x2, x3, T0, T1):
    """Per element of plain rows' words (values of channels 8 m .. 8 m + 7): the nibble bits of the
    channels whose value does not reach its top (bit 4 k for the channel of nibble k), ABOVE where
    some value lies above its top, and lane bits where a value has no code."""
    m0, a0, n0 = _plain_word(x0, T0, 0)
    m1, a1, n1 = _plain_word(x1, T0, 1)
    m2, a2, n2 = _plain_word(x2, T1, 2)
    m3, a3, n3 = _plain_word(x3, T1, 3)
    return m0 | m1 | m2 | m3, a0 | a1 | a2 | a3, n0 | n1 | n2 | n3


@triton.jit
def _top_lanes(T0, T1):
    """The four pairs' window tops << 7 in 16-bit lanes (pair p: channels 8 m + 2 p, 8 m + 2 p + 1),
    from a word column's top words: what ``paged_decode._exact4_pair_ptx`` makes of them in every
    row, made once per column here."""
    L0 = ((T0 & 0xFF) | ((T0 & 0xFF00) << 8)) << 7
    L1 = (((T0 >> 16) & 0xFF) | ((T0 >> 8) & 0xFF0000)) << 7
    L2 = ((T1 & 0xFF) | ((T1 & 0xFF00) << 8)) << 7
    L3 = (((T1 >> 16) & 0xFF) | ((T1 >> 8) & 0xFF0000)) << 7
    return L0, L1, L2, L3


@triton.jit
def _pair(k, R, L, SEL: tl.constexpr):
    """One pair's two values (a u32) in ``_exact4_pair_ptx``'s integer steps, for the interpreter: ``k``
    the codes << 7 in lanes, ``R`` the raw word, ``SEL`` its bytes (0: bytes 0 and 1, 1: 2 and 3), ``L``
    the tops << 7 in lanes."""
    k = k & 0x07800780
    e = L - k
    y = k + 0x78807880  # bit 15 of a lane set where its code is 15 (wraps as the u32 sum does)
    z = ((y >> 15) & 1) * 0xFFFF | (((y >> 31) & 1) * 0xFFFF) << 16
    a = (R >> (16 * SEL)) & 0xFF
    b = (R >> (16 * SEL + 8)) & 0xFF
    x = (a & 0x7F) | ((a & 0x80) << 8) | ((b & 0x7F) << 16) | ((b & 0x80) << 24)
    return (e & ~z) | x


@triton.jit
def _row_words(C, R0, R1, L0, L1, L2, L3, FAST: tl.constexpr):
    """A token row's eight values per code word, as four u32 of two values each (pair p: channels 8 m +
    2 p, 8 m + 2 p + 1): compiled, ``_exact4_pair_ptx`` with the tops given as lanes; in the
    interpreter the same integer steps."""
    if FAST:
        o0, o1, o2, o3 = tl.inline_asm_elementwise(_ASM_LANES, _ASM_LANES_CONSTRAINTS, [C, R0, R1, L0, L1, L2, L3],
                                                   dtype=_ASM_DTYPES, is_pure=True, pack=1)
    else:
        o0 = _pair(C << 7, R0, L0, 0)
        o1 = _pair(C << 3, R0, L1, 1)
        o2 = _pair(C >> 1, R1, L2, 0)
        o3 = _pair(C >> 5, R1, L3, 1)
    return o0, o1, o2, o3


@triton.jit
def _row_loads(sw, m, okw, t: tl.constexpr, WR: tl.constexpr):
    """Row ``t``'s code word and raw words of each word column (0 outside ``okw``)."""
    C = tl.load(sw + (2 + t) * WR + m, mask=okw, other=0)
    R0 = tl.load(sw + (18 + 2 * t) * WR + m, mask=okw, other=0)
    R1 = tl.load(sw + (19 + 2 * t) * WR + m, mask=okw, other=0)
    return C, R0, R1


@triton.jit
def _decode_kernel(buf_ptr, off_ptr, out_ptr, err_ptr, flag_ptr, size, n, H, HDR, FIXED, D: tl.constexpr,
                   HB: tl.constexpr, FAST: tl.constexpr):
    """Decode and check page ``program_id(0)``, ``buf[off_ptr[page]:off_ptr[page + 1]]``: writes its
    16 rows of int16 ``[n, 16, H, D]``, stores its rule bits (``ERRORS``) at ``err_ptr[page]`` and,
    where it breaks some rule, 1 at ``flag_ptr`` (zero before the launch; pinned host memory on a
    GPU, so the host reads it without a copy). The page's rules once, then its heads ``HB`` at a
    time (``_decode_heads``)."""
    page = tl.program_id(0)
    start = tl.load(off_ptr + page)
    end = tl.load(off_ptr + page + 1)
    # the offsets (compared, not subtracted: hostile int64s wrap): the page inside the buffer, aligned,
    # the first at 0 and the last ending at the buffer's end; else OFFSETS and nothing read
    fits = ((start >= 0) & (end >= start) & (end <= size) & (start % 16 == 0) & ((page > 0) | (start == 0))
            & ((page < n - 1) | (end == size)))
    base = tl.multiple_of(tl.where(fits, start, 0), 16)
    length = tl.where(fits, end - start, 0)
    ok = length >= FIXED
    err = tl.where(fits, tl.where(ok, 0, 1), OFFSETS)
    pad = 4 * H + tl.arange(0, 16)
    pb = tl.load(buf_ptr + base + pad, mask=(pad < HDR) & ok, other=0)
    err |= tl.where(tl.max(pb.to(tl.int32), axis=0) != 0, 2, 0)
    total = err * 0  # plain rows of the heads so far
    for h0 in range(0, H, HB):
        hs = h0 + tl.arange(0, HB)
        hv = (hs < H) & ok
        ent = tl.load((buf_ptr + base).to(I32) + hs, mask=hv, other=0)
        cnt = _popc(ent & 0xFFFF, False)  # (a few scalars a page: plain arithmetic)
        before = (ent >> 16) & 0xFFFF
        err |= tl.where(tl.max((hv & (before != total + tl.cumsum(cnt, axis=0) - cnt)).to(tl.int32), axis=0) != 0, 4, 0)
        total += tl.sum(cnt, axis=0)
        err |= _decode_heads(buf_ptr, base, length, ok, hs, ent, before, out_ptr, page, H, HDR, FIXED, D, HB, FAST)
    want = FIXED + total.to(tl.int64) * (2 * D)
    err |= tl.where(ok & (length < want), 8, 0) | tl.where(ok & (length > want), 16, 0)
    tl.store(err_ptr + page, err)
    tl.store(flag_ptr, 1, mask=err != 0)  # (a plain store: any page's 1 will do, and it may be host memory)


@triton.jit
def _decode_heads(buf_ptr, base, length, ok, hs, ent, before, out_ptr, page, H, HDR, FIXED,
                  D: tl.constexpr, HB: tl.constexpr, FAST: tl.constexpr):
    """The rule bits of heads ``hs`` of a page (``ok``: the page is long enough for its slots; ``ent``:
    the heads' header entries, ``before``: their stored counts of earlier plain rows),
    whose 16 rows it writes. Every tensor is ``[HB heads, D / 8 words]`` in one layout, a thread on
    one word column of a head: the window tops and what derives from them are made once per column,
    then the 16 rows pass through the same thread (unrolled), so the checks over rows (a top that
    some row reaches; a plain row's flags) accumulate in its registers and only the page's final
    OR crosses threads."""
    WR: tl.constexpr = D // 8
    hreal = hs < H  # heads that exist
    h2 = hs[:, None]
    m = tl.arange(0, WR)[None, :]
    okw = (hreal & ok)[:, None] & (m >= 0)  # [HB, WR]
    sw = (buf_ptr + (base + HDR + h2.to(tl.int64) * (25 * D))).to(I32)  # each head's slot as u32 words
    T0 = tl.load(sw + m, mask=okw, other=0x0F0F0F0F)
    T1 = tl.load(sw + WR + m, mask=okw, other=0x0F0F0F0F)
    L0, L1, L2, L3 = _top_lanes(T0, T1)
    flags = _below15(T0) | _below15(T1)  # tops below 15 (0x80 in their byte)
    n0 = _not15(T0)
    n1 = _not15(T1)
    # bit 4 k (nibble k holds channel r = 2 (k % 4) + k // 4): that channel's top is not 15, so some
    # row must reach it (a coded row with code 0, a plain row with the top as its exponent)
    need = ((n0 & 1) | ((n0 & 0x100) << 8) | ((n0 & 0x10000) >> 12) | ((n0 & 0x1000000) >> 4)
            | ((n1 & 1) << 8) | ((n1 & 0x100) << 16) | ((n1 & 0x10000) >> 4) | ((n1 & 0x1000000) << 4))
    miss = need  # the needed channels no row reaches yet
    pm = (ent & 0xFFFF)[:, None]  # plain-row masks [HB, 1]
    rows_plain = tl.reduce(ent & 0xFFFF, 0, _or)  # rows plain in some head of the block
    ow = out_ptr.to(I32) + ((page.to(tl.int64) * 16) * H + h2) * (D // 2)  # row 0 of each head
    oc = tl.arange(0, D // 2)[None, :]
    # each row's words loaded two rows ahead of their use (the rows are a chain through the flags)
    Ca, R0a, R1a = _row_loads(sw, m, okw, 0, WR)
    Cb, R0b, R1b = _row_loads(sw, m, okw, 1, WR)
    for t in tl.static_range(16):
        C, R0, R1 = Ca, R0a, R1a
        Ca, R0a, R1a = Cb, R0b, R1b
        if t + 2 < 16:
            Cb, R0b, R1b = _row_loads(sw, m, okw, t + 2, WR)
        o0, o1, o2, o3 = _row_words(C, R0, R1, L0, L1, L2, L3, FAST)
        plain = ((pm >> t) & 1) != 0  # [HB, 1]
        orow = ow + t * (H * (D // 2)) + oc
        words = tl.reshape(tl.join(tl.join(o0, o2), tl.join(o1, o3)), [HB, D // 2])
        tl.store(orow, words, mask=~plain & hreal[:, None])
        z = ~C
        z = z & (z >> 1)
        reach = z & (z >> 2)  # bit 4 k: nibble k is 0 (the channel's exponent is its top)
        if ((rows_plain >> t) & 1) != 0:  # plain rows (a few rows of a few pages): loaded in this layout
            # at their rank after the slots, read only where they lie inside the page
            rank = before[:, None] + _popc(pm & ((1 << t) - 1), FAST)
            pread = plain & okw & (FIXED + (rank + 1).to(tl.int64) * (2 * D) <= length)
            flags |= tl.where(plain & ((C | R0 | R1) != 0), PLAIN_CODED, 0)
            x0, x1, x2, x3 = _load16(buf_ptr + base + FIXED + rank.to(tl.int64) * (2 * D) + 16 * m, pread, FAST)
            words = tl.reshape(tl.join(tl.join(x0, x2), tl.join(x1, x3)), [HB, D // 2])
            tl.store(orow, words, mask=plain & hreal[:, None])
            pmiss, above, no_code = _plain_exps(x0, x1, x2, x3, T0, T1)
            reach = tl.where(plain, ~pmiss, reach)
            flags |= tl.where(plain, above, 0)
            # a plain row needs a value without a code (else the encoder had coded it)
            row_no_code = tl.max(no_code, axis=1)[:, None]  # [HB, 1]
            flags |= tl.where(plain & (row_no_code == 0), ALL_FIT, 0)
        miss &= ~reach
    # a needed channel that no row reaches: ABOVE (a top above every exponent); the flags as they are
    x = tl.where((miss & 0x11111111) != 0, ABOVE, 0) | flags
    bad = tl.reduce(tl.reduce(x, 1, _or), 0, _or)
    err = tl.where(ok & ((bad & PLAIN_CODED) != 0), 32, 0) | tl.where((bad & _BYTE_TOPS) != 0, 64, 0)
    err |= tl.where(ok & ((bad & ALL_FIT) != 0), 128, 0) | tl.where(ok & ((bad & ABOVE) != 0), 256, 0)
    return err


# ----------------------------------------------------------------------------------------------------
# Host side
# ----------------------------------------------------------------------------------------------------


def supports(heads: int, head_dim: int) -> bool:
    """Whether the kernels take pages of this shape (else use ``kv_exact4_ref``: the same bytes)."""
    return 1 <= heads <= ref.MAX_HEADS and head_dim in (32, 64, 128, 256)


def _values(values: torch.Tensor) -> torch.Tensor:
    _check(isinstance(values, torch.Tensor) and values.dim() == 4 and values.shape[1] == ref.PAGE_TOKENS,
           f"values must be [n, {ref.PAGE_TOKENS}, kv_heads, head_dim]")
    _check(values.dtype in (torch.bfloat16, torch.int16), "values must be bf16 or their int16 bits")
    _, _, h, d = values.shape
    _check(supports(h, d), f"the KV Exact4 kernels take kv_heads 1..{ref.MAX_HEADS} and head_dim 32, 64, 128 or 256, "
                           f"not {h} x {d}")
    v = values.contiguous().view(torch.int16)
    return v if v.data_ptr() % 16 == 0 else v.clone()  # (the kernels load 16-byte words)


def page_entries(values: torch.Tensor, *, num_warps: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (page, head)'s plain-row mask and count (``mask | count << 16``, int32 [n, H]) and each
    page's bytes (int64 [n]), on values' device (no sync)."""
    v = _values(values)
    n, _, h, d = v.shape
    ent = torch.empty((n, h), dtype=torch.int32, device=v.device)
    if n:
        _entries_kernel[(n, h)](v, ent, h, D=d, num_warps=num_warps)
    return ent, ref.page_length(h, d, (ent >> 16).sum(1, dtype=torch.int64))


def write_pages(values: torch.Tensor, entries: torch.Tensor, offsets: torch.Tensor, buf: torch.Tensor, *,
                num_warps: int = 1) -> None:
    """Write page i (``page_entries``' lengths[i] bytes) at ``buf[offsets[i]:]``: offsets int64 [n] on
    buf's device, multiples of 16, regions inside buf and disjoint (the caller's allocator)."""
    v = _values(values)
    n, _, h, d = v.shape
    _check(buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous() and buf.device == v.device
           and buf.data_ptr() % 16 == 0, "buf must be a 16-byte aligned contiguous 1-D uint8 tensor on values' device")
    _check(entries.dtype == torch.int32 and tuple(entries.shape) == (n, h) and entries.is_contiguous()
           and entries.device == v.device, f"entries must be contiguous int32 [{n}, {h}] (page_entries)")
    _check(offsets.dtype == torch.int64 and tuple(offsets.shape) == (n,) and offsets.is_contiguous()
           and offsets.device == v.device, f"offsets must be contiguous int64 [{n}] on values' device")
    if n:
        hdr = ref.header_bytes(h)
        _write_kernel[(n, h)](v, entries, offsets, buf, h, hdr, ref.page_length(h, d, 0), D=d,
                              HP=triton.next_power_of_2(h), num_warps=num_warps)


def encode_pages(values: torch.Tensor, *, num_warps: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages back to back, as ``kv_exact4_ref.encode_pages(values).to_bytes()``: (uint8 buffer, int64
    offsets [n + 1]). One host sync (the buffer's size)."""
    ent, lengths = page_entries(values, num_warps=num_warps)
    offsets = torch.nn.functional.pad(lengths.cumsum(0), (1, 0))
    buf = torch.empty(int(offsets[-1]), dtype=torch.uint8, device=lengths.device)
    write_pages(values, ent, offsets[:-1].contiguous(), buf, num_warps=num_warps)
    return buf, offsets


def decode_pages(buf: torch.Tensor, offsets: torch.Tensor, heads: int, head_dim: int, *,
                 out: torch.Tensor | None = None, num_warps: int | None = None, maxnreg: int | None = 64,
                 heads_per_step: int | None = None) -> torch.Tensor:
    """Validate and decode pages stored back to back (page i = ``buf[offsets[i]:offsets[i + 1]]``),
    as ``kv_exact4_ref.decode_pages``: int16 bits ``[n, 16, H, D]``, or its TruncatedError /
    CorruptDataError for the same rule and page (the offsets checked as ``page_spans`` checks them).
    ``out``: where to write them (contiguous int16 ``[n, 16, H, D]`` on buf's device; None: a new
    tensor); after an error its contents are unspecified. One host sync (the verdict, a flag in
    pinned host memory: no copy); misaligned pages go to the reference decoder. One program per page,
    ``num_warps`` warps (None: up to 4, a word column per thread), each thread on one word column (8
    channels) of a head for all 16 rows; ``maxnreg``: registers per thread (None: the compiler's
    choice, 111 at 4 warps; 64 spills nothing and lets 8 programs share an SM: H200, 1 GiB of real
    KV: the kernel 521 us against 622 uncapped; BENCHMARKS.md); ``heads_per_step``: a power of two, the
    heads a program takes at a time (None: as many as one column per thread covers)."""
    _check(isinstance(buf, torch.Tensor) and buf.dtype == torch.uint8 and buf.dim() == 1,
           "buf must be a 1-D uint8 tensor")
    _check(isinstance(offsets, torch.Tensor) and offsets.dim() == 1 and offsets.numel() >= 1
           and not offsets.is_floating_point(), "offsets must be an integer tensor [n + 1]")
    n, h, d = offsets.numel() - 1, heads, head_dim
    if out is not None:
        _check(isinstance(out, torch.Tensor) and out.dtype == torch.int16 and out.is_contiguous()
               and tuple(out.shape) == (n, ref.PAGE_TOKENS, h, d) and out.device == buf.device,
               f"out must be a contiguous int16 tensor [{n}, {ref.PAGE_TOKENS}, {h}, {d}] on buf's device")
        _check(out.numel() == 0 or buf.numel() == 0 or _disjoint(out, buf), "out must not overlap buf")
        if out.data_ptr() % 16:  # (the kernel stores whole aligned words): decode, then copy
            return out.copy_(decode_pages(buf, offsets, heads, head_dim, num_warps=num_warps, maxnreg=maxnreg,
                                          heads_per_step=heads_per_step))
    if buf.is_cuda and buf.device.index != torch.cuda.current_device():
        with torch.cuda.device(buf.device):  # (Triton launches on the current device's stream, read below)
            return decode_pages(buf, offsets, heads, head_dim, out=out, num_warps=num_warps, maxnreg=maxnreg,
                                heads_per_step=heads_per_step)
    buf = buf.contiguous()
    if not supports(heads, head_dim) or n == 0 or buf.data_ptr() % 16:
        # other shapes, no pages, or pages the kernel's aligned word loads cannot read: the reference
        # decoder (the same rules)
        return _into(ref.decode_pages(buf, offsets, heads, head_dim), out)
    off = offsets.to(device=buf.device, dtype=torch.int64).contiguous()
    # heads per step: one word column per thread (a head has D / 8), all heads at once where they fit
    wr = d // 8  # word columns per head
    if num_warps is None:
        num_warps = max(1, min(4, triton.next_power_of_2(h) * wr // 32))
    hb = min(triton.next_power_of_2(h), max(1, 32 * num_warps // wr)) if heads_per_step is None else heads_per_step
    _check(hb & (hb - 1) == 0 and 1 <= hb <= 256, "heads_per_step must be a power of two up to 256")
    if out is None:
        out = torch.empty((n, ref.PAGE_TOKENS, h, d), dtype=torch.int16, device=buf.device)
    page_err = torch.empty(n, dtype=torch.int32, device=buf.device)  # each page's rule bits (every page stores)
    flag, view = _verdict_flag(buf.device)
    fast = not _interpreting()
    _decode_kernel[(n,)](buf, off, out, page_err, flag, buf.numel(), n, h, ref.header_bytes(h),
                         ref.page_length(h, d, 0), D=d, HB=hb, FAST=fast, num_warps=num_warps,
                         **({"maxnreg": maxnreg} if fast and maxnreg else {}))
    if _flag_raised(view, buf.device):
        if bool((page_err & OFFSETS.value).any()):
            ref.page_spans(buf, offsets)  # raises, unless the offsets are only unaligned:
            return _into(ref.decode_pages(buf, offsets, heads, head_dim), out)
        for bit, cls, what in ERRORS:
            hit = torch.nonzero(page_err & bit)
            if hit.numel():
                raise cls(f"page {int(hit[0, 0])}: " + what.format(fixed=ref.page_length(h, d, 0)))
    return out


def _disjoint(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors' bytes do not overlap."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a0 + a.numel() * a.element_size() <= b0 or b0 + b.numel() * b.element_size() <= a0


def _into(values: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    """``values``, or copied into ``out`` (the caller's buffer) and ``out``."""
    return values if out is None else out.copy_(values)


_FLAGS = threading.local()  # per thread and device: a pinned int32 and its numpy view (calls sync before return)


def _verdict_flag(device: torch.device) -> tuple[torch.Tensor, object]:
    """A zeroed int32 [1] for ``_decode_kernel``'s flag and what reads it: on a GPU pinned host memory
    (mapped, so the kernel stores into it and the host reads it after a stream sync without a copy: a
    launch less than a device flag's zeroing and its read), kept per thread and device, cleared here
    through its numpy view; else a tensor on ``device``."""
    if device.type != "cuda":
        flag = torch.zeros(1, dtype=torch.int32, device=device)
        return flag, flag
    flags = _FLAGS.__dict__.setdefault("flags", {})
    pair = flags.get(device.index)
    if pair is None:
        flag = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        pair = flags[device.index] = (flag, flag.numpy())
    pair[1][0] = 0
    return pair


def _flag_raised(view, device: torch.device) -> bool:
    """Whether the decoder raised the flag read through ``view``: on a GPU after syncing ``device``'s
    current stream (the launch's)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return bool(view[0])
