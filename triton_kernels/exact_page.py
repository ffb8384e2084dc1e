"""Triton encoder and decoder of the exact page profile (docs/FORMAT.md, "Exact page profile"):
the same bytes as the Rust codec (weightszip.pages); reference in ``exact_page_ref``.

One GPU thread per (page, stream): a stream is 16 tokens x 32 channels = 512 symbols with its
own word count in the page header, so threads never wait on each other. A program takes one
stream index ``s`` for ``BLOCK_PAGES`` pages, so at every step all its threads read the same
channel's table (a few cache lines) and differ only in the page. A token's raw bytes (decoder)
or input values (encoder) of the program's pages, and the decoder's outputs, move as one
[pages, 8]-word tile per token (whole 32-byte sectors; Triton hands each thread its row through
shared memory): one access per thread and four symbols made the kernels L2-bound. The decoder
also merges a stream word loaded at the previous refill; the encoder looks each symbol up once in
a table with the escapes folded in (``folded_encode_table``). H200 (BENCHMARKS.md): decode 159 ->
470-510 GB/s, encode 124 -> 320-330 GB/s of bf16. ``exact_page_gluon`` is a Gluon decoder with the
tables and stream words in shared memory (``decode_pages(..., kernel="gluon")``), not faster.

    tables = PageTables.from_codebook(codebook, device="cuda")
    buf, offsets = encode_pages(values, tables)        # values: [n, 16, C] bf16/fp16/int16
    out = decode_pages(buf, offsets, tables)           # int16 [n, 16, C], bit-identical

The decoder trusts its input (pages it or the Rust encoder wrote, e.g. its own GPU pool): it
does not validate; untrusted bytes go through the Rust decoder (weightszip.pages).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from weightszip.errors import InvalidArgumentError

from ._interpreter_compat import apply as _interpreter_compat
from .exact_page_ref import ESC  # the canonical decode table's escape symbol

_interpreter_compat()

PAGE_TOKENS = 16
STREAM_CHANNELS = 32


def header_len(channels: int) -> int:
    return (2 * (channels // STREAM_CHANNELS) + 7) // 8 * 8


@dataclass
class PageTables:
    """Codebook tables on a device: ``lut`` int16 [G, C, 2**max_len] (decode), ``enc`` int32
    [G, C, 257] (encode) for G codebooks (e.g. every layer's K and V) of one dtype, max_len and
    channel count; a page names its codebook by a table id (default 0). The kernels read the forms
    derived from them: ``fenc`` (the encoders) and ``wlut`` (the Gluon decoder)."""

    lut: torch.Tensor
    enc: torch.Tensor
    max_len: int
    channels: int
    is_bf16: bool
    wlut: torch.Tensor | None = None  # the Gluon decoder's window tables (``window_table``)
    fenc: torch.Tensor | None = None  # the encoder's tables, escapes folded in (``folded_encode_table``)
    encodable: bool = True  # every table can code every symbol (``encodable``)

    def __post_init__(self):
        if self.wlut is None:
            self.wlut = window_table(self.lut)
        if self.fenc is None:
            self.fenc = folded_encode_table(self.enc)

    @classmethod
    def from_codebook(cls, codebook: bytes, device="cpu") -> "PageTables":
        from weightszip.pages import codebook_info, codebook_version, decode_table, encode_table

        if codebook_version(codebook) != 1:
            raise InvalidArgumentError("PageTables reads version-1 codebooks (version 2: exact_page2.PageTables2)")
        dtype, max_len, channels, lengths = codebook_info(codebook)
        lut, _ = decode_table(codebook)
        return cls(
            lut=torch.from_numpy(lut)[None].to(device),
            enc=torch.from_numpy(encode_table(codebook))[None].to(device),
            max_len=max_len,
            channels=channels,
            is_bf16=dtype == "bfloat16",
            encodable=encodable(lengths),
        )

    @classmethod
    def stack(cls, tables: list["PageTables"]) -> "PageTables":
        t0 = tables[0]
        if any((t.max_len, t.channels, t.is_bf16) != (t0.max_len, t0.channels, t0.is_bf16) for t in tables):
            raise InvalidArgumentError("stacked codebooks must share dtype, max_len and channels")
        return cls(torch.cat([t.lut for t in tables]), torch.cat([t.enc for t in tables]), t0.max_len, t0.channels,
                   t0.is_bf16, encodable=all(t.encodable for t in tables))  # window and folded tables derived


def window_table(lut: torch.Tensor) -> torch.Tensor:
    """The Gluon decoder's table (``exact_page_gluon``) from the canonical one (int16 ``symbol << 4 |
    length``, any shape): int16 ``used | symbol << 5``, where ``used`` is the bits the entry's symbol
    takes (its code; for the escape the code plus the 8 symbol bits after it) and an escape has
    symbol 0 and the sign bit set. Device ops only."""
    e = lut.to(torch.int32)
    sym, ln = e >> 4, e & 15
    esc = sym == ESC
    w = torch.where(esc, (ln + 8) | 0x8000, ln | (sym << 5))
    return ((w + 0x8000) % 0x10000 - 0x8000).to(torch.int16)


def folded_encode_table(enc: torch.Tensor, sym_bits: int = 8) -> torch.Tensor:
    """The encoder's table from the canonical one (int32 [..., 2**sym_bits + 1], ``code << 5 |
    length``, length 0 for a symbol that takes the escape, the last entry the escape's code): int32
    [..., 2**sym_bits] with every symbol's own bits, an escaped symbol's being the escape's code
    followed by its ``sym_bits`` bits (at most 12 + 9 bits: ``code << 5 | length`` fits). One lookup
    per symbol; device ops only."""
    n = 1 << sym_bits
    e, esc = enc[..., :n], enc[..., n:]
    sym = torch.arange(n, dtype=enc.dtype, device=enc.device)
    escaped = ((((esc >> 5) << sym_bits) | sym) << 5) | ((esc & 31) + sym_bits)
    return torch.where((e & 31) == 0, escaped, e).contiguous()


def encodable(lengths) -> bool:
    """Whether the encoders can code every value with these code lengths ([..., symbols + escape]):
    every table with a symbol of no code has an escape. A codebook may lack it (it decodes), but
    the GPU encoders would write such a symbol with a length-0 escape, a page no decoder reads; the
    Rust encoder refuses the value."""
    import numpy as np

    lengths = np.asarray(lengths)
    return not bool(((lengths[..., :-1] == 0).any(-1) & (lengths[..., -1] == 0)).any())


def check_encodable(tables) -> None:
    if not tables.encodable:
        raise InvalidArgumentError("a codebook table has symbols without a code and no escape: the encoder cannot "
                                   "code every value (pages.calibrate always gives the escape a code)")


@triton.jit
def _split(v, IS_BF16: tl.constexpr):
    # v: 16-bit patterns in a wider unsigned int -> (symbol, raw byte)
    if IS_BF16:
        return (v >> 7) & 0xFF, ((v >> 8) & 0x80) | (v & 0x7F)
    else:
        return (v >> 8) & 0xFF, v & 0xFF


@triton.jit
def _page_stream_bits(vals_ptr, enc_ptr, tid_ptr, p, C: tl.constexpr, S: tl.constexpr, SP: tl.constexpr,
                      IS_BF16: tl.constexpr):
    # Bits of every stream of page p (int64) = the sum of its code lengths; [SP], 0 past S.
    enc_ptr += tl.load(tid_ptr + p).to(tl.int64) * (C * 256)
    t = tl.arange(0, 16)[:, None, None]
    s = tl.arange(0, SP)[None, :, None]
    j = tl.arange(0, 32)[None, None, :]
    c = s * 32 + j
    m = s < S
    v = tl.load(vals_ptr + p * 16 * C + t * C + c, mask=m, other=0).to(tl.int32) & 0xFFFF
    sym, _ = _split(v, IS_BF16)
    ln = tl.load(enc_ptr + c * 256 + sym, mask=m, other=0) & 31
    return tl.sum(tl.sum(ln, axis=2), axis=0)


@triton.jit
def _stream_bits_kernel(
    vals_ptr,  # int16 [n, 16, C]
    enc_ptr,  # int32 [G, C, 256] (folded_encode_table)
    bits_ptr,  # int32 [n, S]
    tid_ptr,  # int32 [n] codebook of each page
    C: tl.constexpr,
    S: tl.constexpr,
    SP: tl.constexpr,  # next power of two >= S
    IS_BF16: tl.constexpr,
):
    # One program per page: bits of every stream = sum of its code lengths.
    p = tl.program_id(0).to(tl.int64)
    bits = _page_stream_bits(vals_ptr, enc_ptr, tid_ptr, p, C, S, SP, IS_BF16)
    sv = tl.arange(0, SP)
    tl.store(bits_ptr + p * S + sv, bits, mask=sv < S)


@triton.jit
def _layout_kernel(
    vals_ptr,  # int16 [n, 16, C]
    enc_ptr,  # int32 [G, C, 256] (folded_encode_table)
    tid_ptr,  # int32 [n] codebook of each page
    words_ptr,  # int32 [n, S] out: words of each stream
    wstart_ptr,  # int32 [n, S] out: each stream's first word in the page's code region
    size_ptr,  # int64 [n + 1] out: 0, then each page's size padded to ALIGN (offsets once summed)
    C: tl.constexpr,
    S: tl.constexpr,
    SP: tl.constexpr,
    H: tl.constexpr,
    ALIGN: tl.constexpr,
    IS_BF16: tl.constexpr,
):
    # One program per page: pass 1 of the encoder in one launch (page_layout).
    p = tl.program_id(0).to(tl.int64)
    words = (_page_stream_bits(vals_ptr, enc_ptr, tid_ptr, p, C, S, SP, IS_BF16) + 31) // 32
    sv = tl.arange(0, SP)
    tl.store(words_ptr + p * S + sv, words, mask=sv < S)
    tl.store(wstart_ptr + p * S + sv, tl.cumsum(words, 0) - words, mask=sv < S)
    size = H + 16 * C + 4 * tl.sum(words, 0).to(tl.int64)
    tl.store(size_ptr + p + 1, (size + ALIGN - 1) // ALIGN * ALIGN)
    if p == 0:
        tl.store(size_ptr, size * 0)


@triton.jit
def _split8(x, B: tl.constexpr):
    # [B, 8] -> its 8 columns (each [B]); the inverse of _join8
    k0, k1 = tl.split(tl.reshape(x, [B, 2, 2, 2]))
    k0j0, k0j1 = tl.split(k0)
    k1j0, k1j1 = tl.split(k1)
    w0, w4 = tl.split(k0j0)
    w2, w6 = tl.split(k0j1)
    w1, w5 = tl.split(k1j0)
    w3, w7 = tl.split(k1j1)
    return w0, w1, w2, w3, w4, w5, w6, w7


@triton.jit
def _join8(w0, w1, w2, w3, w4, w5, w6, w7, B: tl.constexpr):
    # 8 columns [B] -> [B, 8] (column q = 4i + 2j + k of [B, i, j, k])
    k0 = tl.join(tl.join(w0, w4), tl.join(w2, w6))
    k1 = tl.join(tl.join(w1, w5), tl.join(w3, w7))
    return tl.reshape(tl.join(k0, k1), [B, 8])


@triton.jit
def _program_pages(off_ptr, tid_ptr, n_pages, BLOCK_PAGES: tl.constexpr):
    # This program's pages: (in range, index int64, first byte, codebook id int64).
    p = tl.program_id(0) * BLOCK_PAGES + tl.arange(0, BLOCK_PAGES)
    ok = p < n_pages
    p64 = p.to(tl.int64)
    off = tl.load(off_ptr + p64, mask=ok, other=0)
    tid = tl.load(tid_ptr + p64, mask=ok, other=0).to(tl.int64)
    return ok, p64, off, tid


@triton.jit
def _write_frame(buf16_ptr, buf32_ptr, off_ptr, words_ptr, wstart_ptr, ok, p64, off, s, S: tl.constexpr,
                 H: tl.constexpr, RAW: tl.constexpr, TAIL_WORDS: tl.constexpr, BLOCK_PAGES: tl.constexpr):
    # The bytes of a page that are not its raw part or code words, each written by one stream's
    # program: stream s's word count in the header, the header's padding (stream 0), the zero words
    # that pad the page after its last code word (the last stream). Returns the stream's first
    # code word (a word index into the buffer). RAW: bytes of the page's raw part.
    nw = tl.load(words_ptr + p64 * S + s, mask=ok, other=0)
    tl.store(buf16_ptr + off // 2 + s, nw.to(tl.int16), mask=ok)
    for k in tl.static_range((H - 2 * S) // 2):
        tl.store(buf16_ptr + off // 2 + S + k, tl.zeros([BLOCK_PAGES], dtype=tl.int16), mask=ok & (s == 0))
    wpos = (off + H + RAW) // 4 + tl.load(wstart_ptr + p64 * S + s, mask=ok, other=0)
    end = wpos + nw  # past the stream's last word: for the last stream, the page's padding
    nxt = tl.load(off_ptr + p64 + 1, mask=ok, other=0) // 4
    for k in tl.static_range(TAIL_WORDS):
        tl.store(buf32_ptr + end + k, tl.zeros([BLOCK_PAGES], dtype=tl.int32), mask=ok & (s == S - 1) & (end + k < nxt))
    return wpos


@triton.jit
def _append(acc, nacc, wpos, code, ln, ok, buf32_ptr):
    # A code of ln bits appended MSB-first to the stream's bit accumulator, a full word written
    # out; nacc < 32 before, so nacc + ln <= 53 < 64.
    acc = acc | (code.to(tl.uint64) << (64 - nacc - ln).to(tl.uint64))
    nacc = nacc + ln
    full = nacc >= 32
    tl.store(buf32_ptr + wpos, (acc >> 32).to(tl.uint32).to(tl.int32, bitcast=True), mask=ok & full)
    acc = tl.where(full, acc << 32, acc)
    nacc = tl.where(full, nacc - 32, nacc)
    wpos = tl.where(full, wpos + 1, wpos)
    return acc, nacc, wpos


@triton.jit
def _stream_start(buf32_ptr, buf16_ptr, off, ok, s, S: tl.constexpr, SP: tl.constexpr, H: tl.constexpr,
                  RAW: tl.constexpr, BLOCK_PAGES: tl.constexpr):
    # Stream s of each page: its word count (header), its first word (after the streams before it),
    # and the decoder's bit buffer loaded with its first two words, the third staged in nxt.
    sj = tl.arange(0, SP)[None, :]
    hdr = tl.load(buf16_ptr + off[:, None] // 2 + sj, mask=ok[:, None] & (sj < S), other=0).to(tl.int32) & 0xFFFF
    start = tl.sum(tl.where(sj < s, hdr, 0), axis=1)
    nw = tl.sum(tl.where(sj == s, hdr, 0), axis=1)
    wbase = (off + H + RAW) // 4 + start
    w0 = tl.load(buf32_ptr + wbase, mask=ok & (nw > 0), other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
    w1 = tl.load(buf32_ptr + wbase + 1, mask=ok & (nw > 1), other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
    buf = (w0 << 32) | w1
    nbits = tl.full([BLOCK_PAGES], 64, tl.int32)
    wnext = tl.full([BLOCK_PAGES], 2, tl.int32)
    nxt = tl.load(buf32_ptr + wbase + 2, mask=ok & (nw > 2), other=0).to(tl.uint32, bitcast=True).to(tl.uint64)
    return nw, wbase, buf, nbits, wnext, nxt


@triton.jit
def _refill(buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr):
    # Before each symbol: afterwards nbits > 32 (a symbol takes at most 12 + 9 bits). ``nxt`` holds
    # stream word ``wnext``, loaded at the previous refill, so a refill does not wait for memory (the
    # load's latency overlaps the symbols decoded before the next refill); past the stream's end: 0.
    need = nbits <= 32
    buf = buf | tl.where(need, nxt << tl.where(need, 32 - nbits, 0).to(tl.uint64), 0)
    nbits = tl.where(need, nbits + 32, nbits)
    wnext = tl.where(need, wnext + 1, wnext)
    nxt = tl.load(buf32_ptr + wbase + wnext, mask=ok & need & (wnext < nw), other=tl.where(need, 0, nxt.to(tl.uint32).to(tl.int32, bitcast=True)))
    nxt = nxt.to(tl.uint32, bitcast=True).to(tl.uint64)
    return buf, nbits, nxt, wnext


@triton.jit
def _encode4(x, acc, nacc, wpos, ok, enc_ptr, tab, buf32_ptr, c0, IS_BF16: tl.constexpr):
    # Four values of one stream (channels c0..c0 + 3 of a token, packed in a uint64): their codes
    # appended to the stream's bit accumulator (full words written out), their raw bytes returned.
    raws = tl.zeros(x.shape, dtype=tl.uint32)
    for j in tl.static_range(4):
        v = ((x >> (16 * j)) & 0xFFFF).to(tl.uint32)
        sym, raw = _split(v, IS_BF16)
        raws = raws | (raw << (8 * j))
        e = tl.load(enc_ptr + tab + (c0 + j) * 256 + sym.to(tl.int32))  # escapes folded in
        acc, nacc, wpos = _append(acc, nacc, wpos, e >> 5, e & 31, ok, buf32_ptr)
    return raws, acc, nacc, wpos


@triton.jit
def _encode_kernel(
    vals_ptr,  # int64 view of int16 [n, 16, C] (4 values per element)
    enc_ptr,  # int32 [G, C, 256] (folded_encode_table)
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
    IS_BF16: tl.constexpr,
    BLOCK_PAGES: tl.constexpr,
):
    # The decoder's mapping (one thread per page and stream, a program per stream and block of
    # pages); a token's 32 input values and 32 raw bytes of every page move as one tile each. Every
    # byte of a page is written here (so ``buf`` need not be zero): the program of stream s writes
    # the stream's word count in the header, that of stream 0 the header's padding, that of the
    # last stream the zero words that pad the page after its last code word.
    s = tl.program_id(1)
    ok, p64, off, tid = _program_pages(off_ptr, tid_ptr, n_pages, BLOCK_PAGES)
    tab = tid * (C * 256)
    wpos = _write_frame(buf16_ptr, buf32_ptr, off_ptr, words_ptr, wstart_ptr, ok, p64, off, s, S, H, 16 * C, TAIL_WORDS,
                        BLOCK_PAGES)
    raw_w = (off + H) // 4 + s * 8  # the stream's first raw word of token 0
    acc = tl.zeros([BLOCK_PAGES], dtype=tl.uint64)
    nacc = tl.zeros([BLOCK_PAGES], dtype=tl.int32)
    col = tl.arange(0, 8)[None, :]
    c = s * 32
    for t in range(16):
        xs = tl.load(vals_ptr + ((p64 * 16 + t) * (C // 4) + s * 8)[:, None] + col, mask=ok[:, None], other=0)
        x0, x1, x2, x3, x4, x5, x6, x7 = _split8(xs.to(tl.uint64, bitcast=True), BLOCK_PAGES)
        r0, acc, nacc, wpos = _encode4(x0, acc, nacc, wpos, ok, enc_ptr, tab, buf32_ptr, c, IS_BF16)
        r1, acc, nacc, wpos = _encode4(x1, acc, nacc, wpos, ok, enc_ptr, tab, buf32_ptr, c + 4, IS_BF16)
        r2, acc, nacc, wpos = _encode4(x2, acc, nacc, wpos, ok, enc_ptr, tab, buf32_ptr, c + 8, IS_BF16)
        r3, acc, nacc, wpos = _encode4(x3, acc, nacc, wpos, ok, enc_ptr, tab, buf32_ptr, c + 12, IS_BF16)
        r4, acc, nacc, wpos = _encode4(x4, acc, nacc, wpos, ok, enc_ptr, tab, buf32_ptr, c + 16, IS_BF16)
        r5, acc, nacc, wpos = _encode4(x5, acc, nacc, wpos, ok, enc_ptr, tab, buf32_ptr, c + 20, IS_BF16)
        r6, acc, nacc, wpos = _encode4(x6, acc, nacc, wpos, ok, enc_ptr, tab, buf32_ptr, c + 24, IS_BF16)
        r7, acc, nacc, wpos = _encode4(x7, acc, nacc, wpos, ok, enc_ptr, tab, buf32_ptr, c + 28, IS_BF16)
        raws = _join8(r0, r1, r2, r3, r4, r5, r6, r7, BLOCK_PAGES)
        tl.store(buf32_ptr + (raw_w + t * (C // 4))[:, None] + col, raws.to(tl.int32, bitcast=True), mask=ok[:, None])
    tl.store(buf32_ptr + wpos, (acc >> 32).to(tl.uint32).to(tl.int32, bitcast=True), mask=ok & (nacc > 0))


@triton.jit
def _decode4(raws, buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr, lut_ptr, tab, c0, L: tl.constexpr, IS_BF16: tl.constexpr):
    # Four symbols of one stream (channels c0..c0 + 3 of a token) with their raw bytes: the four
    # 16-bit values packed in a uint64, and the stream's bit buffer after them. ``nxt`` holds
    # stream word ``wnext``, loaded at the previous refill, so a refill does not wait for memory
    # (the load's latency overlaps the symbols decoded before the next refill).
    acc = tl.zeros(raws.shape, dtype=tl.uint64)
    for j in tl.static_range(4):
        buf, nbits, nxt, wnext = _refill(buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr)
        e = tl.load(lut_ptr + tab + (c0 + j) * (1 << L) + (buf >> (64 - L)).to(tl.int32)).to(tl.int32)
        ln = e & 15
        sym = e >> 4
        escaped = sym == 256
        esym = ((buf << ln.to(tl.uint64)) >> 56).to(tl.int32)
        sym = tl.where(escaped, esym, sym)
        used = tl.where(escaped, ln + 8, ln)
        buf = buf << used.to(tl.uint64)
        nbits = nbits - used
        raw = ((raws >> (8 * j)) & 0xFF).to(tl.int32)
        if IS_BF16:
            v = ((raw & 0x80) << 8) | (sym << 7) | (raw & 0x7F)
        else:
            v = (sym << 8) | raw
        acc = acc | (v.to(tl.uint64) << (16 * j))
    return acc, buf, nbits, nxt, wnext


@triton.jit
def _decode_kernel(
    buf32_ptr,  # int32 view of the page buffer
    buf16_ptr,  # int16 view of the same buffer (headers)
    off_ptr,  # int64 [n + 1] page offsets in bytes (multiples of 8)
    lut_ptr,  # int16 [C, 2**L]
    out_ptr,  # int64 view of int16 [n, 16, C]
    tid_ptr,  # int32 [n] codebook of each page
    n_pages,
    C: tl.constexpr,
    S: tl.constexpr,
    SP: tl.constexpr,
    H: tl.constexpr,
    L: tl.constexpr,
    IS_BF16: tl.constexpr,
    BLOCK_PAGES: tl.constexpr,
):
    # A thread decodes one stream (32 channels) of one page; the program's threads take the same
    # stream of BLOCK_PAGES pages (they share the stream's 32 code tables). A token's 32 raw bytes
    # and 32 outputs of every page are one [BLOCK_PAGES, 8]-word tile each: whole 32-byte sectors
    # (one 4- or 8-byte access per thread and symbol group would touch a sector for 4 or 8 bytes).
    s = tl.program_id(1)
    ok, p64, off, tid = _program_pages(off_ptr, tid_ptr, n_pages, BLOCK_PAGES)
    tab = tid * (C << L)
    nw, wbase, buf, nbits, wnext, nxt = _stream_start(buf32_ptr, buf16_ptr, off, ok, s, S, SP, H, 16 * C, BLOCK_PAGES)
    raw_w = (off + H) // 4 + s * 8  # the stream's first raw word of token 0
    col = tl.arange(0, 8)[None, :]
    c = s * 32
    for t in range(16):
        rw = tl.load(buf32_ptr + (raw_w + t * (C // 4))[:, None] + col, mask=ok[:, None], other=0)
        r0, r1, r2, r3, r4, r5, r6, r7 = _split8(rw.to(tl.uint32, bitcast=True), BLOCK_PAGES)
        a0, buf, nbits, nxt, wnext = _decode4(r0, buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr, lut_ptr, tab, c, L, IS_BF16)
        a1, buf, nbits, nxt, wnext = _decode4(r1, buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr, lut_ptr, tab, c + 4, L, IS_BF16)
        a2, buf, nbits, nxt, wnext = _decode4(r2, buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr, lut_ptr, tab, c + 8, L, IS_BF16)
        a3, buf, nbits, nxt, wnext = _decode4(r3, buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr, lut_ptr, tab, c + 12, L, IS_BF16)
        a4, buf, nbits, nxt, wnext = _decode4(r4, buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr, lut_ptr, tab, c + 16, L, IS_BF16)
        a5, buf, nbits, nxt, wnext = _decode4(r5, buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr, lut_ptr, tab, c + 20, L, IS_BF16)
        a6, buf, nbits, nxt, wnext = _decode4(r6, buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr, lut_ptr, tab, c + 24, L, IS_BF16)
        a7, buf, nbits, nxt, wnext = _decode4(r7, buf, nbits, nxt, wnext, nw, ok, wbase, buf32_ptr, lut_ptr, tab, c + 28, L, IS_BF16)
        tile = _join8(a0, a1, a2, a3, a4, a5, a6, a7, BLOCK_PAGES)
        tl.store(out_ptr + ((p64 * 16 + t) * (C // 4) + s * 8)[:, None] + col, tile.to(tl.int64, bitcast=True), mask=ok[:, None])


def _table_ids(table_ids, n, tables, device) -> torch.Tensor:
    if table_ids is None:
        return torch.zeros(n, dtype=torch.int32, device=device)
    if table_ids.shape != (n,):
        raise InvalidArgumentError(f"table_ids must be [{n}], got {tuple(table_ids.shape)}")
    if n and (int(table_ids.min()) < 0 or int(table_ids.max()) >= tables.lut.shape[0]):
        raise InvalidArgumentError(f"table ids must lie in [0, {tables.lut.shape[0]})")
    return table_ids.to(device=device, dtype=torch.int32).contiguous()


def stream_bits(values: torch.Tensor, tables: PageTables, table_ids: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [n, S]: coded bits of every stream of every page (what ``page_layout`` sizes pages from)."""
    n, C = values.shape[0], tables.channels
    S = C // STREAM_CHANNELS
    tids = _table_ids(table_ids, n, tables, values.device)
    bits = torch.empty(n, S, dtype=torch.int32, device=values.device)
    if n:
        _stream_bits_kernel[(n,)](values, tables.fenc, bits, tids, C=C, S=S, SP=triton.next_power_of_2(S), IS_BF16=tables.is_bf16)
    return bits


def page_layout(values: torch.Tensor, tables: PageTables, tids: torch.Tensor, align: int = 8):
    """Where ``n`` pages will lie, on the device and without host reads (``tids``: int32 [n] table
    ids, already checked): (words per stream int32 [n, S], page offsets int64 [n + 1], pages padded
    to ``align``, each stream's first word int32 [n, S]). Pass 1 of the encoder: one kernel and a
    prefix sum (the offload calls it once per chunk, and the host's calls per chunk are what bound
    its first chunks)."""
    return layout_with(lambda *outs, **kw: _layout_kernel[(values.shape[0],)](
        values, tables.fenc, tids, *outs, **kw, IS_BF16=tables.is_bf16), values, tables, align)


def layout_with(launch, values: torch.Tensor, tables, align: int):
    """``page_layout`` of either version: its outputs allocated, ``launch(words, wstart, offsets,
    C=, S=, SP=, H=, ALIGN=)`` running the version's layout kernel (one program a page), the prefix sum."""
    check_encodable(tables)
    n, C = values.shape[0], tables.channels
    S = C // STREAM_CHANNELS
    dev = values.device
    words = torch.empty(n, S, dtype=torch.int32, device=dev)
    wstart = torch.empty(n, S, dtype=torch.int32, device=dev)
    offsets = torch.empty(n + 1, dtype=torch.int64, device=dev)
    if n:
        launch(words, wstart, offsets, C=C, S=S, SP=triton.next_power_of_2(S), H=header_len(C), ALIGN=align)
        offsets[1:].cumsum_(0)
    else:
        offsets.zero_()
    return words, offsets, wstart


def _warps(block_pages: int, num_warps: int | None) -> int:
    """The codec kernels' warps: ``num_warps`` if given, else one page per thread (at most 8 warps)."""
    return num_warps or max(1, min(8, block_pages // 32))


def encode_into(values: torch.Tensor, tables: PageTables, tids: torch.Tensor, buf: torch.Tensor, layout,
                block_pages: int = 128, align: int = 8, num_warps: int | None = None) -> None:
    """Pass 2: write the pages at ``layout`` (``page_layout``'s, with the same ``align``) into ``buf``
    (uint8, at least ``offsets[-1]`` bytes, need not be zero), headers and padding included; one
    kernel, no host reads. ``num_warps`` (default: a page per thread) below ``block_pages / 32``
    gives each thread several pages' serial chains."""
    words, offsets, wstart = layout
    n, C = values.shape[0], tables.channels
    if not n:
        return
    S, H = C // STREAM_CHANNELS, header_len(C)
    _encode_kernel[(triton.cdiv(n, block_pages), S)](
        values.view(torch.int64), tables.fenc, buf.view(torch.int32), buf.view(torch.int16), offsets, words, wstart,
        tids, n, C=C, S=S, H=H, TAIL_WORDS=align // 4 - 1, IS_BF16=tables.is_bf16, BLOCK_PAGES=block_pages,
        num_warps=_warps(block_pages, num_warps),
    )


def check_encode_args(values: torch.Tensor, tables, align: int) -> torch.Tensor:
    """The encoders' argument checks; returns the values as contiguous int16 bits."""
    C = tables.channels
    if values.dim() != 3 or values.shape[1:] != (PAGE_TOKENS, C) or values.element_size() != 2:
        raise InvalidArgumentError(f"values must be 16-bit [n, {PAGE_TOKENS}, {C}], got {tuple(values.shape)} {values.dtype}")
    if align % 8:
        raise InvalidArgumentError("align must be a multiple of 8 (pages are read as 8-byte words)")
    return values.contiguous().view(torch.int16)


def encode_pages(values: torch.Tensor, tables: PageTables, table_ids: torch.Tensor | None = None, block_pages: int = 128, align: int = 8):
    """Encode ``[n, 16, C]`` 16-bit values (bf16, fp16 or their int16 bits) into pages, page i
    with codebook ``table_ids[i]`` (default 0); returns (uint8 buffer, int64 offsets [n + 1]),
    the bytes the Rust encoder writes with the same align."""
    values = check_encode_args(values, tables, align)
    tids = _table_ids(table_ids, values.shape[0], tables, values.device)
    layout = page_layout(values, tables, tids, align)
    buf = torch.empty(int(layout[1][-1]), dtype=torch.uint8, device=values.device)
    encode_into(values, tables, tids, buf, layout, block_pages, align)
    return buf, layout[1]


# the Gluon decoder: a stream's 32 tables of 2**max_len int16 entries in shared memory (16 KB at
# max_len 8, 64 KB at 10)
MAX_SHARED_LEN = 10
# the Gluon decoder's pages per program and stream words staged per page, its fastest on the H200
# (2026-12-01, 537 MB of real pages, two runs: 32 pages and 64 words 517 / 524 GB/s against the
# Triton decoder's 469 / 508 in the same runs; BENCHMARKS.md)
GLUON_BLOCK_PAGES = 32
GLUON_STAGE = 64


def decode_pages(buf: torch.Tensor, offsets: torch.Tensor, tables: PageTables, out: torch.Tensor | None = None,
                 table_ids: torch.Tensor | None = None, block_pages: int | None = None, kernel: str = "auto") -> torch.Tensor:
    """Decode the pages at ``offsets`` (int64 or int32 [n + 1], contiguous, multiples of 8) of ``buf``
    (contiguous 1-D uint8, its length a multiple of 8), page i with codebook ``table_ids[i]`` (default 0), into int16
    [n, 16, C] (``out`` if given). ``kernel``: "auto" or "triton" (the Triton decoder), "gluon" (the
    Gluon one, ``exact_page_gluon``: Hopper only, not faster on the H200; BENCHMARKS.md)."""
    if kernel not in ("auto", "triton", "gluon"):
        raise InvalidArgumentError(f"kernel must be auto, triton or gluon, got {kernel!r}")
    offsets, out = check_decode_args(buf, offsets, tables, out)
    n = offsets.numel() - 1
    if kernel == "gluon" and not gluon_applies(buf, tables, out):
        raise InvalidArgumentError(f"the Gluon decoder needs a Hopper GPU, max_len <= {MAX_SHARED_LEN} and a "
                                   "16-byte aligned out")
    decode_into(buf, offsets, tables, out, _table_ids(table_ids, n, tables, buf.device), block_pages, kernel)
    return out


def check_decode_args(buf: torch.Tensor, offsets: torch.Tensor, tables, out: torch.Tensor | None):
    """The decoders' argument checks; returns (int64 offsets, out: the given one or a new one)."""
    # (the kernels read both at pointer + index: strided views would be read through the bytes between)
    if (not isinstance(buf, torch.Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1 or not buf.is_contiguous()
            or buf.numel() % 8):
        raise InvalidArgumentError("buf must be contiguous 1-D uint8 with a length that is a multiple of 8")
    if (not isinstance(offsets, torch.Tensor) or offsets.dtype not in (torch.int32, torch.int64) or offsets.dim() != 1
            or offsets.numel() < 1 or not offsets.is_contiguous() or offsets.device != buf.device):
        raise InvalidArgumentError("offsets must be a contiguous 1-D int32 or int64 tensor [n + 1] on buf's device")
    offsets = offsets.to(torch.int64)
    n = offsets.numel() - 1
    if out is None:
        out = torch.empty(n, PAGE_TOKENS, tables.channels, dtype=torch.int16, device=buf.device)
    elif (out.shape != (n, PAGE_TOKENS, tables.channels) or out.dtype != torch.int16 or not out.is_contiguous()
          or out.data_ptr() % 8):
        raise InvalidArgumentError(f"out must be contiguous int16 [{n}, {PAGE_TOKENS}, {tables.channels}], 8-byte aligned")
    return offsets, out


def gluon_applies(buf: torch.Tensor, tables: PageTables, out: torch.Tensor) -> bool:
    """Whether the Gluon decoder (``exact_page_gluon``) can run these pages: on Hopper (capability 9.x),
    tables of max_len up to MAX_SHARED_LEN (16 KB of shared memory per stream at 8), out 16-byte
    aligned."""
    return (buf.is_cuda and torch.cuda.get_device_capability(buf.device)[0] == 9
            and tables.max_len <= MAX_SHARED_LEN and out.data_ptr() % 16 == 0)


def decode_into(buf: torch.Tensor, offsets: torch.Tensor, tables: PageTables, out: torch.Tensor, tids: torch.Tensor,
                block_pages: int | None = None, kernel: str = "auto", num_warps: int | None = None) -> None:
    """``decode_pages`` without argument checks or host reads (the table ids' range check reads
    them back): ``tids`` int32 [n] on buf's device, already in range (the restore path clamps
    them on the GPU), ``out`` contiguous int16 [n, 16, C]. The Triton decoder (``kernel`` "auto" or
    "triton"; block_pages default 32; ``num_warps`` as ``encode_into``'s) or the Gluon one ("gluon";
    default GLUON_BLOCK_PAGES)."""
    C = tables.channels
    n = offsets.numel() - 1
    if not n:
        return
    if kernel == "gluon":
        from .exact_page_gluon import decode_into as gluon_decode_into

        bp = block_pages or GLUON_BLOCK_PAGES
        gluon_decode_into(buf, offsets, tables.wlut, tables.max_len, C, tables.is_bf16, out, tids, bp, GLUON_STAGE)
        return
    block_pages = block_pages or 32
    S = C // STREAM_CHANNELS
    grid = (triton.cdiv(n, block_pages), S)
    _decode_kernel[grid](
        buf.view(torch.int32), buf.view(torch.int16), offsets, tables.lut, out.view(torch.int64), tids, n,
        C=C, S=S, SP=triton.next_power_of_2(S), H=header_len(C), L=tables.max_len,
        IS_BF16=tables.is_bf16, BLOCK_PAGES=block_pages, num_warps=_warps(block_pages, num_warps),
    )


__all__ = ["PageTables", "encode_pages", "decode_pages", "decode_into", "gluon_applies", "stream_bits", "header_len"]
