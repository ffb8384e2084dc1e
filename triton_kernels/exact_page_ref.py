"""Plain-PyTorch reference of the exact page profile's GPU encoders and decoders (exact_page.py,
version 1; exact_page2.py, version 2): the same math, written for clarity (the encoders
vectorized, the decoders one symbol at a time).

Layout (docs/FORMAT.md, "Exact page profile"): a page of ``[16, C]`` 16-bit values is
``header (u16 words per stream, zero-padded to 8 bytes) | raw part | stream words``; stream ``s``
codes the symbols of channels ``32s .. 32s+31``, token-major, MSB-first in u32 words. Version 1:
the raw part is a byte per value, the symbol the exponent (bf16) or high byte (fp16). Version 2
(bf16): the raw part is 7 mantissa bits per value, packed; the symbol sign and exponent, coded
with the table of the value's class, the sign as a change from the previous token's.
"""

from __future__ import annotations

import torch

PAGE_TOKENS = 16
STREAM_CHANNELS = 32
ESC = 256
ESC2 = 512  # version 2's escape


def header_len(channels: int) -> int:
    return (2 * (channels // STREAM_CHANNELS) + 7) // 8 * 8


def split_ref(v: torch.Tensor, is_bf16: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(symbol, raw byte) of int32 16-bit patterns."""
    if is_bf16:
        return (v >> 7) & 0xFF, ((v >> 8) & 0x80) | (v & 0x7F)
    return (v >> 8) & 0xFF, v & 0xFF


def join_ref(sym: int, raw: int, is_bf16: bool) -> int:
    if is_bf16:
        return ((raw & 0x80) << 8) | (sym << 7) | (raw & 0x7F)
    return (sym << 8) | raw


def encode_pages_ref(values: torch.Tensor, enc: torch.Tensor, is_bf16: bool, align: int = 8):
    """Version 1. values: int16 [n, 16, C]; enc: int32 [C, 257] (code << 5 | length).
    Returns (uint8 buffer, int64 offsets [n + 1])."""
    n, T, C = values.shape
    v = values.to(torch.int32) & 0xFFFF
    sym, raw = split_ref(v, is_bf16)
    ch = torch.arange(C).expand(n, T, C)
    e = enc[ch, sym].to(torch.int64)
    esc = enc[:, ESC].to(torch.int64)[ch]
    code, ln = _with_escapes(e, esc, sym, 8)
    return _assemble(code, ln, raw.reshape(n, -1).to(torch.uint8), align)


def classes_ref(v: torch.Tensor, splits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Version 2: (class, coded symbol) of int32 bf16 patterns [n, 16, C]; splits [C]."""
    x = v >> 7
    prev = torch.cat([torch.zeros_like(x[:, :1]), x[:, :-1]], 1)
    first = (torch.arange(v.shape[1]) == 0)[None, :, None]
    k = torch.where(first, 0, 1 + ((prev & 0xFF) >= splits.to(torch.int32)).to(torch.int32))
    y = torch.where(first, x, x ^ (prev & 0x100))
    return k, y


def encode_pages_ref2(values: torch.Tensor, enc: torch.Tensor, splits: torch.Tensor, align: int = 8):
    """Version 2. values: int16 bf16 [n, 16, C]; enc: int32 [C, 3, 513] (code << 5 | length);
    splits [C]. Returns (uint8 buffer, int64 offsets [n + 1])."""
    n, T, C = values.shape
    v = values.to(torch.int32) & 0xFFFF
    k, y = classes_ref(v, splits)
    ch = torch.arange(C).expand(n, T, C)
    e = enc[ch, k, y].to(torch.int64)
    esc = enc[ch, k, ESC2].to(torch.int64)
    code, ln = _with_escapes(e, esc, y, 9)
    # mantissas: value i's 7 bits at raw bits 7i.., least significant first
    bits = ((v & 0x7F).reshape(n, -1, 1) >> torch.arange(7)) & 1
    raw = (bits.reshape(n, -1, 8) << torch.arange(8)).sum(-1).to(torch.uint8)
    return _assemble(code, ln, raw, align)


def _with_escapes(e: torch.Tensor, esc: torch.Tensor, sym: torch.Tensor, sym_bits: int):
    """(code, length) of every symbol: its own, or the escape's code followed by its bits."""
    ln, code = e & 31, e >> 5
    escaped = ln == 0
    code = torch.where(escaped, ((esc >> 5) << sym_bits) | sym, code)
    ln = torch.where(escaped, (esc & 31) + sym_bits, ln)
    return code, ln


def _assemble(code: torch.Tensor, ln: torch.Tensor, raw: torch.Tensor, align: int):
    """Pages from every value's code and length ([n, 16, C], int64) and each page's raw part
    (uint8 [n, R]): streams packed, headers written, pages placed at multiples of ``align``."""
    n, T, C = code.shape
    S = C // STREAM_CHANNELS
    # Stream order: [n, S, 16 tokens x 32 channels].
    code = code.view(n, T, S, STREAM_CHANNELS).permute(0, 2, 1, 3).reshape(n, S, -1)
    ln = ln.view(n, T, S, STREAM_CHANNELS).permute(0, 2, 1, 3).reshape(n, S, -1)
    end = torch.cumsum(ln, -1)
    pos = end - ln
    bits = end[..., -1]
    words = (bits + 31) // 32
    W = int(words.max()) + 2 if n else 2
    # Place each code in a 64-bit window at its bit position, MSB first, and split the window
    # into the two u32 words it touches; codes never overlap, so adding is or-ing.
    win = code << (64 - (pos & 31) - ln)
    hi, lo = (win >> 32) & 0xFFFFFFFF, win & 0xFFFFFFFF
    acc = torch.zeros(n, S, W, dtype=torch.int64)
    acc.scatter_add_(2, pos >> 5, hi)
    acc.scatter_add_(2, (pos >> 5) + 1, lo)
    H = header_len(C)
    sizes = H + raw.shape[1] + 4 * words.sum(1)
    offsets = [0]
    pages = []
    for p in range(n):
        start = -(-offsets[-1] // align) * align
        hdr = torch.zeros(H, dtype=torch.uint8)
        hdr[: 2 * S] = _u16_bytes(words[p])
        body = [hdr, raw[p]]
        for s in range(S):
            body.append(_u32_bytes(acc[p, s, : int(words[p, s])]))
        page = torch.cat(body)
        assert page.numel() == int(sizes[p])
        if start > offsets[-1]:
            pages.append(torch.zeros(start - offsets[-1], dtype=torch.uint8))
        pages.append(page)
        offsets[-1] = start
        offsets.append(start + page.numel())
    end_ = -(-offsets[-1] // align) * align
    if end_ > offsets[-1]:
        pages.append(torch.zeros(end_ - offsets[-1], dtype=torch.uint8))
    offsets[-1] = end_
    buf = torch.cat(pages) if pages else torch.zeros(0, dtype=torch.uint8)
    return buf, torch.tensor(offsets, dtype=torch.int64)


def _u16_bytes(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.int64)
    return torch.stack([x & 0xFF, (x >> 8) & 0xFF], -1).reshape(-1).to(torch.uint8)


def _u32_bytes(x: torch.Tensor) -> torch.Tensor:
    x = x.to(torch.int64)
    return torch.stack([(x >> (8 * i)) & 0xFF for i in range(4)], -1).reshape(-1).to(torch.uint8)


class _Stream:
    """MSB-first bit reader over one stream's words; bits past the end read as zero."""

    def __init__(self, words: list[int]):
        self.bits, self.total, self.pos = 0, 32 * len(words), 0
        for w in words:
            self.bits = (self.bits << 32) | w

    def take(self, k: int, peek: bool = False) -> int:
        sh = self.total - self.pos - k
        v = (self.bits >> sh) & ((1 << k) - 1) if sh >= 0 else ((self.bits << -sh) & ((1 << k) - 1))
        if not peek:
            self.pos += k
        return v


def _streams(b: list[int], o: int, C: int, raw_len: int):
    """Yields (s, _Stream) for every stream of the page at byte ``o``."""
    S = C // STREAM_CHANNELS
    nw = [b[o + 2 * s] | (b[o + 2 * s + 1] << 8) for s in range(S)]
    w0 = o + header_len(C) + raw_len
    for s in range(S):
        start = w0 + 4 * sum(nw[:s])
        yield s, _Stream([int.from_bytes(bytes(b[start + 4 * i : start + 4 * i + 4]), "little") for i in range(nw[s])])


def _symbol(st: _Stream, entry: int, max_len: int, esc: int, sym_bits: int) -> int:
    """Decode one symbol from the table entry of the stream's next ``max_len`` bits."""
    sym, ln = entry >> 4, entry & 15
    st.pos += ln
    return st.take(sym_bits) if sym == esc else sym


def _int16(out: torch.Tensor) -> torch.Tensor:
    return ((out + 0x8000) % 0x10000 - 0x8000).to(torch.int16)


def decode_pages_ref(buf: torch.Tensor, offsets: torch.Tensor, lut: torch.Tensor, max_len: int, is_bf16: bool) -> torch.Tensor:
    """Version 1. buf: uint8; offsets: int64 [n + 1]; lut: int16 [C, 2**max_len] (symbol << 4 |
    length). Returns int16 [n, 16, C]. Trusts its input (pages this codec wrote); the Rust decoder
    validates."""
    C = lut.shape[0]
    H = header_len(C)
    b = buf.tolist()
    L = lut.to(torch.int64).tolist()
    n = offsets.numel() - 1
    out = torch.zeros(n, PAGE_TOKENS, C, dtype=torch.int32)
    for p in range(n):
        o = int(offsets[p])
        for s, st in _streams(b, o, C, PAGE_TOKENS * C):
            for t in range(PAGE_TOKENS):
                for c in range(s * STREAM_CHANNELS, (s + 1) * STREAM_CHANNELS):
                    sym = _symbol(st, L[c][st.take(max_len, peek=True)], max_len, ESC, 8)
                    out[p, t, c] = join_ref(sym, b[o + H + t * C + c], is_bf16)
    return _int16(out)


def decode_pages_ref2(buf: torch.Tensor, offsets: torch.Tensor, lut: torch.Tensor, splits: torch.Tensor,
                      max_len: int) -> torch.Tensor:
    """Version 2. buf: uint8; offsets: int64 [n + 1]; lut: int16 [C, 3, 2**max_len] (symbol << 4 |
    length, escape 512); splits [C]. Returns int16 bf16 bits [n, 16, C]. Trusts its input."""
    C = lut.shape[0]
    H = header_len(C)
    b = buf.tolist()
    L = lut.to(torch.int64).tolist()
    sp = splits.tolist()
    n = offsets.numel() - 1
    out = torch.zeros(n, PAGE_TOKENS, C, dtype=torch.int32)
    for p in range(n):
        o = int(offsets[p])
        raw = int.from_bytes(bytes(b[o + H : o + H + PAGE_TOKENS * C * 7 // 8]), "little")
        for s, st in _streams(b, o, C, PAGE_TOKENS * C * 7 // 8):
            for t in range(PAGE_TOKENS):
                for c in range(s * STREAM_CHANNELS, (s + 1) * STREAM_CHANNELS):
                    prev = int(out[p, t - 1, c]) >> 7 if t else 0
                    k = 0 if t == 0 else 1 + ((prev & 0xFF) >= sp[c])
                    y = _symbol(st, L[c][k][st.take(max_len, peek=True)], max_len, ESC2, 9)
                    x = y if t == 0 else y ^ (prev & 0x100)
                    out[p, t, c] = (x << 7) | ((raw >> (7 * (t * C + c))) & 0x7F)
    return _int16(out)
