"""Plain-PyTorch reference of the exact page profile's GPU encoder and decoder (exact_page.py):
the same math, written for clarity (the encoder vectorized, the decoder one symbol at a time).

Layout (docs/FORMAT.md, "Exact page profile"): a page of ``[16, C]`` 16-bit values is
``header (u16 words per stream, zero-padded to 8 bytes) | raw bytes [16, C] | stream words``;
stream ``s`` codes the symbols of channels ``32s .. 32s+31``, token-major, MSB-first in u32 words.
"""

from __future__ import annotations

import torch

PAGE_TOKENS = 16
STREAM_CHANNELS = 32
ESC = 256


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
    """values: int16 [n, 16, C]; enc: int32 [C, 257] (code << 5 | length).
    Returns (uint8 buffer, int64 offsets [n + 1])."""
    n, T, C = values.shape
    S = C // STREAM_CHANNELS
    v = values.to(torch.int32) & 0xFFFF
    sym, raw = split_ref(v, is_bf16)
    ch = torch.arange(C).expand(n, T, C)
    e = enc[ch, sym].to(torch.int64)
    ln, code = e & 31, e >> 5
    esc = enc[:, ESC].to(torch.int64)[ch]
    escaped = ln == 0
    # An escaped symbol: the escape's code, then the symbol's 8 bits (at most 12 + 8 bits).
    code = torch.where(escaped, ((esc >> 5) << 8) | sym, code)
    ln = torch.where(escaped, (esc & 31) + 8, ln)
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
    sizes = H + T * C + 4 * words.sum(1)
    offsets = [0]
    pages = []
    for p in range(n):
        start = -(-offsets[-1] // align) * align
        hdr = torch.zeros(H, dtype=torch.uint8)
        hdr[: 2 * S] = _u16_bytes(words[p])
        body = [hdr, raw[p].reshape(-1).to(torch.uint8)]
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


def decode_pages_ref(buf: torch.Tensor, offsets: torch.Tensor, lut: torch.Tensor, max_len: int, is_bf16: bool) -> torch.Tensor:
    """buf: uint8; offsets: int64 [n + 1]; lut: int16 [C, 2**max_len] (symbol << 4 | length).
    Returns int16 [n, 16, C]. Trusts its input (pages this codec wrote); the Rust decoder validates."""
    C = lut.shape[0]
    S = C // STREAM_CHANNELS
    H = header_len(C)
    b = buf.tolist()
    L = lut.to(torch.int64).tolist()
    n = offsets.numel() - 1
    out = torch.zeros(n, PAGE_TOKENS, C, dtype=torch.int32)
    for p in range(n):
        o = int(offsets[p])
        nw = [b[o + 2 * s] | (b[o + 2 * s + 1] << 8) for s in range(S)]
        w0 = o + H + PAGE_TOKENS * C
        for s in range(S):
            start = w0 + 4 * sum(nw[:s])
            words = [int.from_bytes(bytes(b[start + 4 * i : start + 4 * i + 4]), "little") for i in range(nw[s])]
            stream = 0
            for w in words:
                stream = (stream << 32) | w
            total = 32 * len(words)
            pos = 0

            def peek(k: int) -> int:
                # Bits past the end read as zero.
                sh = total - pos - k
                return (stream >> sh) & ((1 << k) - 1) if sh >= 0 else ((stream << -sh) & ((1 << k) - 1))

            for t in range(PAGE_TOKENS):
                for c in range(s * STREAM_CHANNELS, (s + 1) * STREAM_CHANNELS):
                    e = L[c][peek(max_len)]
                    sym, ln = e >> 4, e & 15
                    pos += ln
                    if sym == ESC:
                        sym = peek(8)
                        pos += 8
                    out[p, t, c] = join_ref(sym, b[o + H + t * C + c], is_bf16)
    return ((out + 0x8000) % 0x10000 - 0x8000).to(torch.int16)
