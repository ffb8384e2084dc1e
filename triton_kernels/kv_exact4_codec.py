"""KV Exact4 pages on the GPU: the encoder (the cache-write path and a bulk codec) and a validating
decoder, byte for byte the reference's (``kv_exact4_ref``; docs/FORMAT.md, "KV Exact4 pages,
version 1").

    entries, lengths = page_entries(values)          # plain-row mask and count per (page, head); bytes
    offsets = <allocate lengths>                     # PageHeap.alloc, or a prefix sum (encode_pages)
    write_pages(values, entries, offsets, buf)       # every byte of every page
    bits = decode_pages(buf, offsets, heads, head_dim)   # checks every rule, as kv_exact4_ref does

values: bf16 (or int16 bits) ``[n, 16, H, D]``, token-major as a model writes K or V. One program
per (page, head) in every kernel. The sizes pass finds the head's window tops and its plain rows;
the host places the pages from their lengths; the write pass codes the head again and stores its
slot, its header entry and its plain rows (the (page, 0) program also the header's zero padding).
Programs write disjoint bytes.

Each program holds a head's 16 token rows as words: ``[D / 8, 16]`` tensors, word m of a row for
channels 8 m .. 8 m + 7, as the format lays out codes (one u32 per word), raw bytes and tops (a u32
per half: channels 8 m .. 8 m + 3 at byte 4 m, 8 m + 4 .. 8 m + 7 at byte D / 2 + 4 m). So every
load and store is of whole u32 words at consecutive addresses, and no value changes threads.

The decoder is the reference decoder's rules in one pass: a program flags what its head breaks
(``ERRORS``, one bit each) and the host raises the reference's error for the first rule, in the
reference's order, that any page breaks, naming the lowest such page: the same error class and
page as ``kv_exact4_ref.decode_pages``. Loads stay inside each page's bytes, so hostile headers
read nothing outside the buffer. ``decode_pages`` returns the values of a page that passes; the
attention kernel's tile loader (``paged_decode.dequantize_exact4_pages``) reads the same values and
checks nothing.
"""

from __future__ import annotations

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
_ASM_WORDS = tl.constexpr(exact4_asm(words=True))
_ASM_CONSTRAINTS = tl.constexpr(",".join(["=r"] * 4 + ["r"] * 5))
_ASM_DTYPES = tl.constexpr((tl.int32,) * 4)

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


@triton.jit
def _split4(x, WR: tl.constexpr):
    """int32 [WR, 16, 4] -> its four [WR, 16] slices (index 0 .. 3 of the last axis)."""
    a, b = tl.split(tl.reshape(x, [WR, 16, 2, 2]))  # a: indices 0, 2; b: 1, 3
    x0, x2 = tl.split(a)
    x1, x3 = tl.split(b)
    return x0, x1, x2, x3


@triton.jit
def _join4(x0, x1, x2, x3, WR: tl.constexpr):
    """``_split4``'s inverse."""
    return tl.reshape(tl.join(tl.join(x0, x2), tl.join(x1, x3)), [WR, 16, 4])


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
    """Whether each value has a code against its top (exponent 0, or top - 14 .. top)."""
    e = _exp(v)
    d = top[:, None] - e
    return (e == 0) | ((d >= 0) & (d < 15))


@triton.jit
def _code(v, top):
    """The 4-bit code of each value that has one (0 where none)."""
    e = _exp(v)
    d = top[:, None] - e
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
    fit = (_fits(v0, t0) & _fits(v1, t1) & _fits(v2, t2) & _fits(v3, t3) & _fits(v4, t4) & _fits(v5, t5)
           & _fits(v6, t6) & _fits(v7, t7))
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
    cw = (_code(v0, t0) | (_code(v1, t1) << 16) | (_code(v2, t2) << 4) | (_code(v3, t3) << 20)
          | (_code(v4, t4) << 8) | (_code(v5, t5) << 24) | (_code(v6, t6) << 12) | (_code(v7, t7) << 28))
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
def _byte(w, i: tl.constexpr):
    return (w >> (8 * i)) & 0xFF


@triton.jit
def _nib(w, s: tl.constexpr):
    return (w >> s) & 15


@triton.jit
def _value(code, top, raw):
    """A coded value's bits from its code, window top and raw byte."""
    e = tl.where(code == 15, 0, top[:, None] - code)
    return ((raw & 0x80) << 8) | ((e & 0xFF) << 7) | (raw & 0x7F)


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _top_flags(v, top, ok, r: tl.constexpr):
    """Channel r's part of the tops check, per value: bit r if its exponent is above its top, bit 8 + r
    if it reaches the top (or the top is 15, the least)."""
    e = _exp(v)
    t = top[:, None]
    return tl.where(ok[None, :], ((e > t).to(tl.int32) << r) | (((e == t) | (t == 15)).to(tl.int32) << (8 + r)), 0)


@triton.jit
def _decode_kernel(buf_ptr, off_ptr, out_ptr, err_ptr, H, HDR, FIXED, D: tl.constexpr, HP: tl.constexpr,
                   FAST: tl.constexpr):
    """Decode and check (page, head) = program ids: the page is ``buf[off_ptr[page]:off_ptr[page +
    1]]`` (bounds checked by the host); writes its 16 rows of int16 ``[n, 16, H, D]`` and ORs its
    rule bits (``ERRORS``) into ``err_ptr[page]`` (zeros before the launch)."""
    WR: tl.constexpr = D // 8
    page = tl.program_id(0)
    head = tl.program_id(1)
    base = tl.multiple_of(tl.load(off_ptr + page), 16)  # (the host checks)
    length = tl.load(off_ptr + page + 1) - base
    ok = length >= FIXED
    err = tl.where(ok, 0, 1)
    hs = tl.arange(0, HP)
    ents = tl.load((buf_ptr + base + 4 * hs).to(I32), mask=(hs < H) & ok, other=0)
    cnt = _popc(ents & 0xFFFF, FAST)
    ent = tl.sum(tl.where(hs == head, ents, 0), axis=0)
    before = (ent >> 16) & 0xFFFF
    err |= tl.where(ok & (before != tl.sum(tl.where(hs < head, cnt, 0), axis=0)), 4, 0)
    want = FIXED + tl.sum(cnt, axis=0).to(tl.int64) * (2 * D)
    err |= tl.where(ok & (length < want), 8, 0) | tl.where(ok & (length > want), 16, 0)
    if head == 0:
        pad = 4 * H + tl.arange(0, 16)
        pb = tl.load(buf_ptr + base + pad, mask=(pad < HDR) & ok, other=0)
        err |= tl.where(tl.max(pb.to(tl.int32), axis=0) != 0, 2, 0)
    sw = (buf_ptr + base + HDR + head * (25 * D)).to(I32)  # the slot as u32 words
    m = tl.arange(0, WR)
    T0 = tl.load(sw + m, mask=ok, other=0x0F0F0F0F)
    T1 = tl.load(sw + WR + m, mask=ok, other=0x0F0F0F0F)
    t = tl.arange(0, 16)
    okt = (t >= 0) & ok
    okr = okt[None, :]
    C = tl.load(sw + 2 * WR + m[:, None] + (t * WR)[None, :], mask=okr, other=0)
    rows = 18 * WR + m[:, None] + (t * (2 * WR))[None, :]
    R0 = tl.load(sw + rows, mask=okr, other=0)
    R1 = tl.load(sw + WR + rows, mask=okr, other=0)
    t0, t1, t2, t3 = _byte(T0, 0), _byte(T0, 1), _byte(T0, 2), _byte(T0, 3)
    t4, t5, t6, t7 = _byte(T1, 0), _byte(T1, 1), _byte(T1, 2), _byte(T1, 3)
    low = ((t0 < 15) | (t1 < 15) | (t2 < 15) | (t3 < 15) | (t4 < 15) | (t5 < 15) | (t6 < 15) | (t7 < 15))
    err |= tl.where(tl.max(low.to(tl.int32), axis=0) != 0, 64, 0)
    # the coded rows: word q of a row holds channels 8 m + 2 q (low half) and 8 m + 2 q + 1
    if FAST:
        o0, o1, o2, o3 = tl.inline_asm_elementwise(
            _ASM_WORDS, _ASM_CONSTRAINTS, [C, R0, R1, tl.broadcast_to(T0[:, None], [WR, 16]), tl.broadcast_to(T1[:, None], [WR, 16])], dtype=_ASM_DTYPES, is_pure=True, pack=1)
    else:
        o0 = _value(_nib(C, 0), t0, _byte(R0, 0)) | (_value(_nib(C, 16), t1, _byte(R0, 1)) << 16)
        o1 = _value(_nib(C, 4), t2, _byte(R0, 2)) | (_value(_nib(C, 20), t3, _byte(R0, 3)) << 16)
        o2 = _value(_nib(C, 8), t4, _byte(R1, 0)) | (_value(_nib(C, 24), t5, _byte(R1, 1)) << 16)
        o3 = _value(_nib(C, 12), t6, _byte(R1, 2)) | (_value(_nib(C, 28), t7, _byte(R1, 3)) << 16)
    if (ent & 0xFFFF) != 0:  # plain rows (a few heads of a few pages): every value checked
        plain = ((ent >> t) & 1) != 0
        # at their rank after the slots, read only where they lie inside the page
        rank = before + _popc(ent & ((1 << t) - 1) & 0xFFFF, FAST)
        pread = plain & ok & (FIXED + rank.to(tl.int64) * (2 * D) + 2 * D <= length)
        idx = (rank.to(tl.int64) * (D // 2))[None, :, None] + (m * 4)[:, None, None] + tl.arange(0, 4)[None, None, :]
        x0, x1, x2, x3 = _split4(tl.load((buf_ptr + base + FIXED).to(I32) + idx, mask=pread[None, :, None], other=0), WR)
        pl = plain[None, :]
        nonzero = (tl.where(pl, C | R0 | R1, 0) != 0).to(tl.int32)  # (as flags: the words are signed)
        err |= tl.where(tl.max(tl.max(nonzero, axis=1), axis=0) != 0, 32, 0)
        o0, o1, o2, o3 = tl.where(pl, x0, o0), tl.where(pl, x1, o1), tl.where(pl, x2, o2), tl.where(pl, x3, o3)
        v0, v1, v2, v3, v4, v5, v6, v7 = _lo(o0), _hi(o0), _lo(o1), _hi(o1), _lo(o2), _hi(o2), _lo(o3), _hi(o3)
        misses = _plain_rows(v0, v1, v2, v3, v4, v5, v6, v7, t0, t1, t2, t3, t4, t5, t6, t7)
        err |= tl.where(tl.max((plain & (misses == 0)).to(tl.int32), axis=0) != 0, 128, 0)
        # every top is max(15, its channel's largest exponent): none above it, and one at it (or 15)
        flags = (_top_flags(v0, t0, okt, 0) | _top_flags(v1, t1, okt, 1) | _top_flags(v2, t2, okt, 2)
                 | _top_flags(v3, t3, okt, 3) | _top_flags(v4, t4, okt, 4) | _top_flags(v5, t5, okt, 5)
                 | _top_flags(v6, t6, okt, 6) | _top_flags(v7, t7, okt, 7))
        flags = tl.reduce(flags, 1, _or)  # [WR]
        wrong = ((flags & 0xFF) != 0) | ((flags >> 8) != 0xFF)
    else:
        # coded rows only: a coded exponent is top - code (at most its top), so a top above 15 must
        # have a row with code 0. Zero nibbles of the code words (bit 4 k for nibble k), over rows.
        z = ~C
        z = z & (z >> 1)
        z = tl.reduce(z & (z >> 2) & 0x11111111, 1, _or)  # [WR]
        # nibble k = 4 (r % 2) + r // 2 holds channel r
        need = (((t0 != 15).to(tl.int32)) | ((t1 != 15).to(tl.int32) << 16) | ((t2 != 15).to(tl.int32) << 4)
                | ((t3 != 15).to(tl.int32) << 20) | ((t4 != 15).to(tl.int32) << 8) | ((t5 != 15).to(tl.int32) << 24)
                | ((t6 != 15).to(tl.int32) << 12) | ((t7 != 15).to(tl.int32) << 28))
        wrong = (need & ~z) != 0
    err |= tl.where(ok & (tl.max(wrong.to(tl.int32), axis=0) != 0), 256, 0)
    tl.atomic_or(err_ptr + page, err, mask=err != 0)
    out = _join4(o0, o1, o2, o3, WR)
    orow = (page.to(tl.int64) * 16 + t) * H + head
    oidx = orow[None, :, None] * (D // 2) + (m * 4)[:, None, None] + tl.arange(0, 4)[None, None, :]
    tl.store(out_ptr.to(I32) + oidx, out)


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
                 num_warps: int = 2) -> torch.Tensor:
    """Validate and decode pages stored back to back (page i = ``buf[offsets[i]:offsets[i + 1]]``),
    as ``kv_exact4_ref.decode_pages``: int16 bits ``[n, 16, H, D]``, or its TruncatedError /
    CorruptDataError for the same rule and page. Two host syncs (the offsets' check, the verdict)."""
    _check(isinstance(buf, torch.Tensor) and buf.dtype == torch.uint8 and buf.dim() == 1,
           "buf must be a 1-D uint8 tensor")
    _check(isinstance(offsets, torch.Tensor) and offsets.dim() == 1 and offsets.numel() >= 1
           and not offsets.is_floating_point(), "offsets must be an integer tensor [n + 1]")
    if not supports(heads, head_dim):  # other shapes: the reference decoder (the same rules)
        return ref.decode_pages(buf, offsets, heads, head_dim)
    buf = buf.contiguous()
    off, _ = ref.page_spans(buf, offsets)
    n, h, d = off.numel() - 1, heads, head_dim
    out = torch.empty((n, ref.PAGE_TOKENS, h, d), dtype=torch.int16, device=buf.device)
    if n == 0:
        return out
    if buf.data_ptr() % 16 or bool((off % 16 != 0).any()):  # the kernel's aligned word loads
        return ref.decode_pages(buf, offsets, heads, head_dim)
    page_err = torch.zeros(n, dtype=torch.int32, device=buf.device)
    _decode_kernel[(n, h)](buf, off.contiguous(), out, page_err, h, ref.header_bytes(h), ref.page_length(h, d, 0),
                           D=d, HP=triton.next_power_of_2(h), FAST=not _interpreting(), num_warps=num_warps)
    if bool(page_err.any()):
        for bit, cls, what in ERRORS:
            hit = torch.nonzero(page_err & bit)
            if hit.numel():
                raise cls(f"page {int(hit[0, 0])}: " + what.format(fixed=ref.page_length(h, d, 0)))
    return out
