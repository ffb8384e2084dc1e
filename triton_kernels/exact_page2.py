"""Triton encoder and decoder of the exact page profile, version 2 (docs/FORMAT.md, "Exact page
profile, version 2"): the same bytes as the Rust codec (weightszip.pages with a version-2
codebook); reference in ``exact_page_ref`` (``encode_pages_ref2``, ``decode_pages_ref2``).

The kernels keep version 1's shape (``exact_page``): one GPU thread per (page, stream), a program
per stream and block of pages, a token's inputs and outputs as [pages, 8]-word tiles. What version
2 adds, per value: the class (the previous token's exponent against the channel's split) picks one
of the channel's 3 tables, the sign is coded as a change from the previous token's, and the 7
mantissa bits of a token's 32 values of a stream lie in 7 words (4 values in 28 bits each). The
previous token's values are the tiles the thread wrote (decoder) or read (encoder) one token
before, kept in registers.

    tables = PageTables2.from_codebook(codebook, device="cuda")   # a version-2 codebook
    buf, offsets = encode_pages(values, tables)                    # values: [n, 16, C] bf16
    out = decode_pages(buf, offsets, tables)                       # int16 [n, 16, C]

The decoder trusts its input, as version 1's; untrusted bytes go through the Rust decoder.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from weightszip.errors import InvalidArgumentError

from ._interpreter_compat import apply as _interpreter_compat
from .exact_page import (
    STREAM_CHANNELS,
    _append,
    _join8,
    _program_pages,
    _refill,
    _split8,
    _stream_start,
    _table_ids,
    _warps,
    _write_frame,
    check_decode_args,
    encodable,
    folded_encode_table,
    check_encode_args,
    header_len,
    layout_with,
)
from .exact_page_ref import ESC2

_interpreter_compat()

CLASSES = 3
NSYM = 512  # coded symbols per table (the escape is 512)


@dataclass
class PageTables2:
    """Version-2 codebook tables on a device, for G codebooks of one max_len and channel count:
    ``lut`` int16 [G, C, 3, 2**max_len] (decode, ``symbol << 4 | length``, escape 512), ``fenc``
    int32 [G, C, 3, 512] (encode, ``code << 5 | length`` with escapes folded in: the escape's code
    then the symbol's 9 bits), ``splits`` int32 [G, C]."""

    lut: torch.Tensor
    fenc: torch.Tensor
    splits: torch.Tensor
    max_len: int
    channels: int
    is_bf16: bool = True
    version: int = 2
    encodable: bool = True  # every table can code every symbol (``exact_page.encodable``)

    @classmethod
    def from_codebook(cls, codebook: bytes, device="cpu") -> "PageTables2":
        from weightszip.pages import codebook_info, codebook_splits, codebook_version, decode_table, encode_table

        if codebook_version(codebook) != 2:
            raise InvalidArgumentError("PageTables2 reads version-2 codebooks (version 1: exact_page.PageTables)")
        _, max_len, channels, lengths = codebook_info(codebook)
        lut, _ = decode_table(codebook)
        return cls(
            lut=torch.from_numpy(lut)[None].to(device),
            fenc=folded_encode_table(torch.from_numpy(encode_table(codebook)), 9)[None].to(device),
            splits=torch.from_numpy(codebook_splits(codebook).astype("int32"))[None].to(device),
            max_len=max_len,
            channels=channels,
            encodable=encodable(lengths),
        )

    @classmethod
    def stack(cls, tables: list["PageTables2"]) -> "PageTables2":
        t0 = tables[0]
        if any((t.max_len, t.channels) != (t0.max_len, t0.channels) for t in tables):
            raise InvalidArgumentError("stacked codebooks must share max_len and channels")
        return cls(torch.cat([t.lut for t in tables]), torch.cat([t.fenc for t in tables]),
                   torch.cat([t.splits for t in tables]), t0.max_len, t0.channels, encodable=all(t.encodable for t in tables))


@triton.jit
def _class_sym(v, pv, first, split):
    # v, pv: int32 bf16 patterns of a value and of the previous token's in its channel -> (its
    # table's class, its coded symbol: sign and exponent, the sign as a change after a first token)
    x = v >> 7
    p = pv >> 7
    k = tl.where(first, 0, 1 + ((p & 0xFF) >= split).to(tl.int32))
    y = tl.where(first, x, x ^ (p & 0x100))
    return k, y


@triton.jit
def _page_stream_bits2(vals_ptr, enc_ptr, split_ptr, tid_ptr, p, C: tl.constexpr, S: tl.constexpr, SP: tl.constexpr):
    # Bits of every stream of page p (int64) = the sum of its code lengths; [SP], 0 past S. Token
    # by token, the previous token's values carried (a [16, SP, 32] tile of them spills at C = 1024).
    tid = tl.load(tid_ptr + p).to(tl.int64)
    s = tl.arange(0, SP)[:, None]
    c = s * 32 + tl.arange(0, 32)[None, :]
    m = s < S
    split = tl.load(split_ptr + tid * C + c, mask=m, other=0)
    enc = enc_ptr + tid * (C * 3 * 512) + c * (3 * 512)
    pv = tl.zeros([SP, 32], dtype=tl.int32)
    bits = tl.zeros([SP, 32], dtype=tl.int32)
    for t in range(16):
        v = tl.load(vals_ptr + p * 16 * C + t * C + c, mask=m, other=0).to(tl.int32) & 0xFFFF
        k, y = _class_sym(v, pv, t == 0, split)
        bits += tl.load(enc + k * 512 + y, mask=m, other=0) & 31
        pv = v
    return tl.sum(bits, axis=1)


@triton.jit
def _layout_kernel2(vals_ptr, enc_ptr, split_ptr, tid_ptr, words_ptr, wstart_ptr, size_ptr, C: tl.constexpr,
                    S: tl.constexpr, SP: tl.constexpr, H: tl.constexpr, ALIGN: tl.constexpr):
    # One program per page: words per stream, each stream's first word, the page's padded size
    # (exact_page._layout_kernel's outputs, for version 2's pages).
    p = tl.program_id(0).to(tl.int64)
    words = (_page_stream_bits2(vals_ptr, enc_ptr, split_ptr, tid_ptr, p, C, S, SP) + 31) // 32
    sv = tl.arange(0, SP)
    tl.store(words_ptr + p * S + sv, words, mask=sv < S)
    tl.store(wstart_ptr + p * S + sv, tl.cumsum(words, 0) - words, mask=sv < S)
    size = H + 14 * C + 4 * tl.sum(words, 0).to(tl.int64)
    tl.store(size_ptr + p + 1, (size + ALIGN - 1) // ALIGN * ALIGN)
    if p == 0:
        tl.store(size_ptr, size * 0)


@triton.jit
def _encode4_2(x, xp, first, acc, nacc, wpos, ok, enc_ptr, tab, split_ptr, stab, buf32_ptr, c0):
    # Four values of one stream (channels c0..c0 + 3 of a token, packed in a uint64; xp: the
    # previous token's): their codes appended to the stream's bit accumulator (full words written
    # out), their mantissas returned as 28 bits (value j at bit 7j).
    mant = tl.zeros(x.shape, dtype=tl.uint32)
    for j in tl.static_range(4):
        v = ((x >> (16 * j)) & 0xFFFF).to(tl.int32)
        pv = ((xp >> (16 * j)) & 0xFFFF).to(tl.int32)
        k, y = _class_sym(v, pv, first, tl.load(split_ptr + stab + c0 + j))
        e = tl.load(enc_ptr + tab + ((c0 + j) * 3 + k) * 512 + y)  # escapes folded in
        acc, nacc, wpos = _append(acc, nacc, wpos, e >> 5, e & 31, ok, buf32_ptr)
        mant = mant | ((v & 0x7F).to(tl.uint32) << (7 * j))
    return mant, acc, nacc, wpos


@triton.jit
def _encode_kernel2(
    vals_ptr,  # int64 view of int16 [n, 16, C] (4 values per element)
    enc_ptr,  # int32 [G, C, 3, 512] (PageTables2.fenc)
    split_ptr,  # int32 [G, C]
    buf32_ptr,  # int32 view of the output buffer
    buf16_ptr,  # int16 view of the same buffer (headers)
    off_ptr,  # int64 [n + 1] page offsets in bytes (multiples of 8)
    words_ptr,  # int32 [n, S] words of each stream
    wstart_ptr,  # int32 [n, S] first word of each stream, relative to the page's code region
    tid_ptr,  # int32 [n] codebook of each page
    n_pages,
    C: tl.constexpr,
    S: tl.constexpr,
    H: tl.constexpr,
    TAIL_WORDS: tl.constexpr,  # most 4-byte words that pad a page to its alignment
    BLOCK_PAGES: tl.constexpr,
):
    # exact_page._encode_kernel's mapping and byte ownership (header word, header padding by
    # stream 0, the page's tail padding by the last stream); a token's 32 mantissas of a stream go
    # out as 7 words.
    s = tl.program_id(1)
    ok, p64, off, tid = _program_pages(off_ptr, tid_ptr, n_pages, BLOCK_PAGES)
    tab = tid * (C * 3 * 512)
    stab = tid * C
    wpos = _write_frame(buf16_ptr, buf32_ptr, off_ptr, words_ptr, wstart_ptr, ok, p64, off, s, S, H, 14 * C, TAIL_WORDS,
                        BLOCK_PAGES)
    raw_w = (off + H) // 4 + s * 7  # the stream's first mantissa word of token 0
    acc = tl.zeros([BLOCK_PAGES], dtype=tl.uint64)
    nacc = tl.zeros([BLOCK_PAGES], dtype=tl.int32)
    col = tl.arange(0, 8)[None, :]
    c = s * 32
    xp0 = tl.zeros([BLOCK_PAGES], dtype=tl.uint64)
    xp1, xp2, xp3, xp4, xp5, xp6, xp7 = xp0, xp0, xp0, xp0, xp0, xp0, xp0
    for t in range(16):
        first = t == 0
        xs = tl.load(vals_ptr + ((p64 * 16 + t) * (C // 4) + s * 8)[:, None] + col, mask=ok[:, None], other=0)
        x0, x1, x2, x3, x4, x5, x6, x7 = _split8(xs.to(tl.uint64, bitcast=True), BLOCK_PAGES)
        g0, acc, nacc, wpos = _encode4_2(x0, xp0, first, acc, nacc, wpos, ok, enc_ptr, tab, split_ptr, stab, buf32_ptr, c)
        g1, acc, nacc, wpos = _encode4_2(x1, xp1, first, acc, nacc, wpos, ok, enc_ptr, tab, split_ptr, stab, buf32_ptr, c + 4)
        g2, acc, nacc, wpos = _encode4_2(x2, xp2, first, acc, nacc, wpos, ok, enc_ptr, tab, split_ptr, stab, buf32_ptr, c + 8)
        g3, acc, nacc, wpos = _encode4_2(x3, xp3, first, acc, nacc, wpos, ok, enc_ptr, tab, split_ptr, stab, buf32_ptr, c + 12)
        g4, acc, nacc, wpos = _encode4_2(x4, xp4, first, acc, nacc, wpos, ok, enc_ptr, tab, split_ptr, stab, buf32_ptr, c + 16)
        g5, acc, nacc, wpos = _encode4_2(x5, xp5, first, acc, nacc, wpos, ok, enc_ptr, tab, split_ptr, stab, buf32_ptr, c + 20)
        g6, acc, nacc, wpos = _encode4_2(x6, xp6, first, acc, nacc, wpos, ok, enc_ptr, tab, split_ptr, stab, buf32_ptr, c + 24)
        g7, acc, nacc, wpos = _encode4_2(x7, xp7, first, acc, nacc, wpos, ok, enc_ptr, tab, split_ptr, stab, buf32_ptr, c + 28)
        # group q (28 bits) at bit 28q: word k = bits 32k.. = g_k >> 4k | g_(k+1) << (28 - 4k)
        w = _join8(g0 | (g1 << 28), (g1 >> 4) | (g2 << 24), (g2 >> 8) | (g3 << 20), (g3 >> 12) | (g4 << 16),
                   (g4 >> 16) | (g5 << 12), (g5 >> 20) | (g6 << 8), (g6 >> 24) | (g7 << 4), g7 * 0, BLOCK_PAGES)
        tl.store(buf32_ptr + (raw_w + t * (7 * S))[:, None] + col, w.to(tl.int32, bitcast=True), mask=ok[:, None] & (col < 7))
        xp0, xp1, xp2, xp3, xp4, xp5, xp6, xp7 = x0, x1, x2, x3, x4, x5, x6, x7
    tl.store(buf32_ptr + wpos, (acc >> 32).to(tl.uint32).to(tl.int32, bitcast=True), mask=ok & (nacc > 0))


@triton.jit
def _decode4_2(g, ap, first, buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr, lut_ptr, tab, split_ptr, stab, c0,
               L: tl.constexpr):
    # Four values of one stream (channels c0..c0 + 3 of a token) from their 28 mantissa bits and
    # the previous token's four values (ap): the values packed in a uint64, and the stream's bit
    # buffer after them (exact_page._decode4's refill scheme).
    acc = tl.zeros(g.shape, dtype=tl.uint64)
    for j in tl.static_range(4):
        buf, nbits, nxt, wnext = _refill(buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr)
        p = ((ap >> (16 * j)) & 0xFFFF).to(tl.int32) >> 7
        k = tl.where(first, 0, 1 + ((p & 0xFF) >= tl.load(split_ptr + stab + c0 + j)).to(tl.int32))
        e = tl.load(lut_ptr + tab + (((c0 + j) * 3 + k) << L) + (buf >> (64 - L)).to(tl.int32)).to(tl.int32)
        ln = e & 15
        y = e >> 4
        escaped = y == 512
        ey = ((buf << ln.to(tl.uint64)) >> 55).to(tl.int32)
        y = tl.where(escaped, ey, y)
        used = tl.where(escaped, ln + 9, ln)
        buf = buf << used.to(tl.uint64)
        nbits = nbits - used
        x = tl.where(first, y, y ^ (p & 0x100))
        v = (x << 7) | ((g >> (7 * j)) & 0x7F).to(tl.int32)
        acc = acc | (v.to(tl.uint64) << (16 * j))
    return acc, buf, nbits, nxt, wnext


@triton.jit
def _decode_kernel2(
    buf32_ptr,  # int32 view of the page buffer
    buf16_ptr,  # int16 view of the same buffer (headers)
    off_ptr,  # int64 [n + 1] page offsets in bytes (multiples of 8)
    lut_ptr,  # int16 [G, C, 3, 2**L]
    split_ptr,  # int32 [G, C]
    out_ptr,  # int64 view of int16 [n, 16, C]
    tid_ptr,  # int32 [n] codebook of each page
    n_pages,
    C: tl.constexpr,
    S: tl.constexpr,
    SP: tl.constexpr,
    H: tl.constexpr,
    L: tl.constexpr,
    BLOCK_PAGES: tl.constexpr,
):
    # exact_page._decode_kernel's mapping; a token's 7 mantissa words of the stream are one
    # [BLOCK_PAGES, 8]-word tile (the eighth masked), and the previous token's output tile stays in
    # registers for the classes and signs.
    s = tl.program_id(1)
    ok, p64, off, tid = _program_pages(off_ptr, tid_ptr, n_pages, BLOCK_PAGES)
    tab = tid * (C * 3 << L)
    stab = tid * C
    nw, wbase, buf, nbits, wnext, nxt = _stream_start(buf32_ptr, buf16_ptr, off, ok, s, S, SP, H, 14 * C, BLOCK_PAGES)
    raw_w = (off + H) // 4 + s * 7
    col = tl.arange(0, 8)[None, :]
    c = s * 32
    a0 = tl.zeros([BLOCK_PAGES], dtype=tl.uint64)
    a1, a2, a3, a4, a5, a6, a7 = a0, a0, a0, a0, a0, a0, a0
    M: tl.constexpr = 0xFFFFFFF
    for t in range(16):
        first = t == 0
        rw = tl.load(buf32_ptr + (raw_w + t * (7 * S))[:, None] + col, mask=ok[:, None] & (col < 7), other=0)
        r0, r1, r2, r3, r4, r5, r6, r7 = _split8(rw.to(tl.uint32, bitcast=True), BLOCK_PAGES)
        # group q's 28 bits start at bit 28q: in word q - 1 at bit 32 - 4q, continued in word q
        g0 = r0 & M
        g1 = ((r0 >> 28) | (r1 << 4)) & M
        g2 = ((r1 >> 24) | (r2 << 8)) & M
        g3 = ((r2 >> 20) | (r3 << 12)) & M
        g4 = ((r3 >> 16) | (r4 << 16)) & M
        g5 = ((r4 >> 12) | (r5 << 20)) & M
        g6 = ((r5 >> 8) | (r6 << 24)) & M
        g7 = (r6 >> 4) & M
        a0, buf, nbits, nxt, wnext = _decode4_2(g0, a0, first, buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr, lut_ptr, tab, split_ptr, stab, c, L)
        a1, buf, nbits, nxt, wnext = _decode4_2(g1, a1, first, buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr, lut_ptr, tab, split_ptr, stab, c + 4, L)
        a2, buf, nbits, nxt, wnext = _decode4_2(g2, a2, first, buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr, lut_ptr, tab, split_ptr, stab, c + 8, L)
        a3, buf, nbits, nxt, wnext = _decode4_2(g3, a3, first, buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr, lut_ptr, tab, split_ptr, stab, c + 12, L)
        a4, buf, nbits, nxt, wnext = _decode4_2(g4, a4, first, buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr, lut_ptr, tab, split_ptr, stab, c + 16, L)
        a5, buf, nbits, nxt, wnext = _decode4_2(g5, a5, first, buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr, lut_ptr, tab, split_ptr, stab, c + 20, L)
        a6, buf, nbits, nxt, wnext = _decode4_2(g6, a6, first, buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr, lut_ptr, tab, split_ptr, stab, c + 24, L)
        a7, buf, nbits, nxt, wnext = _decode4_2(g7, a7, first, buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr, lut_ptr, tab, split_ptr, stab, c + 28, L)
        tile = _join8(a0, a1, a2, a3, a4, a5, a6, a7, BLOCK_PAGES)
        tl.store(out_ptr + ((p64 * 16 + t) * (C // 4) + s * 8)[:, None] + col, tile.to(tl.int64, bitcast=True), mask=ok[:, None])


def page_layout(values: torch.Tensor, tables: PageTables2, tids: torch.Tensor, align: int = 8):
    """``exact_page.page_layout`` for version 2: (words per stream int32 [n, S], page offsets int64
    [n + 1], each stream's first word int32 [n, S]), on the device, without host reads."""
    return layout_with(lambda *outs, **kw: _layout_kernel2[(values.shape[0],)](
        values, tables.fenc, tables.splits, tids, *outs, **kw), values, tables, align)


def encode_into(values: torch.Tensor, tables: PageTables2, tids: torch.Tensor, buf: torch.Tensor, layout,
                block_pages: int = 128, align: int = 8, num_warps: int | None = None) -> None:
    """``exact_page.encode_into`` for version 2: write the pages at ``layout`` into ``buf``."""
    words, offsets, wstart = layout
    n, C = values.shape[0], tables.channels
    if not n:
        return
    S, H = C // STREAM_CHANNELS, header_len(C)
    _encode_kernel2[(triton.cdiv(n, block_pages), S)](
        values.view(torch.int64), tables.fenc, tables.splits, buf.view(torch.int32), buf.view(torch.int16), offsets,
        words, wstart, tids, n, C=C, S=S, H=H, TAIL_WORDS=align // 4 - 1, BLOCK_PAGES=block_pages,
        num_warps=_warps(block_pages, num_warps),
    )


def encode_pages(values: torch.Tensor, tables: PageTables2, table_ids: torch.Tensor | None = None, block_pages: int = 128,
                 align: int = 8):
    """Encode ``[n, 16, C]`` bf16 values (or their int16 bits) into version-2 pages, page i with
    codebook ``table_ids[i]`` (default 0); returns (uint8 buffer, int64 offsets [n + 1]), the bytes
    the Rust encoder writes with the same align."""
    values = check_encode_args(values, tables, align)
    tids = _table_ids(table_ids, values.shape[0], tables, values.device)
    layout = page_layout(values, tables, tids, align)
    buf = torch.empty(int(layout[1][-1]), dtype=torch.uint8, device=values.device)
    encode_into(values, tables, tids, buf, layout, block_pages, align)
    return buf, layout[1]


def decode_into(buf: torch.Tensor, offsets: torch.Tensor, tables: PageTables2, out: torch.Tensor, tids: torch.Tensor,
                block_pages: int | None = None, kernel: str = "auto", num_warps: int | None = None) -> None:
    """``exact_page.decode_into`` for version 2 (its Triton decoder; ``kernel`` "auto" or "triton")."""
    if kernel not in ("auto", "triton"):
        raise InvalidArgumentError(f"version-2 pages have the Triton decoder only, not {kernel!r}")
    C = tables.channels
    n = offsets.numel() - 1
    if not n:
        return
    block_pages = block_pages or 32
    S = C // STREAM_CHANNELS
    _decode_kernel2[(triton.cdiv(n, block_pages), S)](
        buf.view(torch.int32), buf.view(torch.int16), offsets, tables.lut, tables.splits, out.view(torch.int64), tids, n,
        C=C, S=S, SP=triton.next_power_of_2(S), H=header_len(C), L=tables.max_len, BLOCK_PAGES=block_pages,
        num_warps=_warps(block_pages, num_warps),
    )


def decode_pages(buf: torch.Tensor, offsets: torch.Tensor, tables: PageTables2, out: torch.Tensor | None = None,
                 table_ids: torch.Tensor | None = None, block_pages: int | None = None, kernel: str = "auto") -> torch.Tensor:
    """Decode the version-2 pages at ``offsets`` of ``buf`` into int16 [n, 16, C] (``out`` if
    given); the arguments as ``exact_page.decode_pages``'s (``kernel``: "auto" or "triton")."""
    if kernel not in ("auto", "triton"):
        raise InvalidArgumentError(f"version-2 pages have the Triton decoder only, not {kernel!r}")
    offsets, out = check_decode_args(buf, offsets, tables, out)
    n = offsets.numel() - 1
    decode_into(buf, offsets, tables, out, _table_ids(table_ids, n, tables, buf.device), block_pages, kernel)
    return out


assert ESC2 == NSYM  # the reference's escape is the symbol after the coded ones

__all__ = ["PageTables2", "CLASSES", "encode_pages", "decode_pages", "decode_into", "encode_into", "page_layout"]
