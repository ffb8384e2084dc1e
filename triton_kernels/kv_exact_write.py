"""KV Exact pages written on the GPU: the cache-write path of ``KVExactCache`` as two Triton kernels,
byte for byte the pages of the reference encoder (``kv_exact_ref.encode_pages(...).write``;
docs/FORMAT.md, "KV Exact pages, version 1").

    counts, lengths = page_counts(values, bases)          # escapes per (page, head); page bytes
    offsets = <allocate lengths>                          # e.g. PageHeap.alloc (host)
    write_pages(values, bases, counts, offsets, buf)      # every byte of every page

values: bf16 (or int16 bits) ``[n, 16, H, D]``, token-major as a model writes K or V; bases: uint8
``[H, D]``, the layer's window tops. The sizes pass reads each page once and counts escapes per
(page, head); the host allocates from the lengths (one device sync); the write pass codes each
(page, head) again and stores its three code planes, raw bytes and exceptions (their place: a prefix
count of the escapes before them in token-major order), the (page, 0) program the header and the
(page, H - 1) program the zero padding. Programs write disjoint bytes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weightszip.errors import InvalidArgumentError

from . import kv_exact_ref as ref
from ._interpreter_compat import apply as _interpreter_compat

_interpreter_compat()


@triton.jit
def _codes(vals_ptr, bases_ptr, page, head, H, D: tl.constexpr):
    """(code int32 [16, D], exponent int32 [16, D], 16-bit patterns int32 [16, D]) of one (page, head)."""
    t = tl.arange(0, 16)
    c = tl.arange(0, D)
    row = (page.to(tl.int64) * 16 + t) * H + head
    bits = tl.load(vals_ptr + row[:, None] * D + c[None, :]).to(tl.int32) & 0xFFFF
    e = (bits >> 7) & 0xFF
    d = tl.load(bases_ptr + head * D + c).to(tl.int32)[None, :] - e
    code = tl.where((d >= 0) & (d < 7), d, 7)
    return code, e, bits


@triton.jit
def _count_kernel(vals_ptr, bases_ptr, counts_ptr, H, D: tl.constexpr):
    page = tl.program_id(0)
    head = tl.program_id(1)
    code, _, _ = _codes(vals_ptr, bases_ptr, page, head, H, D)
    n = tl.sum(tl.sum((code == 7).to(tl.int32), axis=1), axis=0)
    tl.store(counts_ptr + page.to(tl.int64) * H + head, n.to(tl.int64))


@triton.jit
def _write_kernel(vals_ptr, bases_ptr, counts_ptr, offsets_ptr, buf_ptr, H, FIXED, HDR,
                  D: tl.constexpr, HP: tl.constexpr):
    page = tl.program_id(0)
    head = tl.program_id(1)
    code, e, bits = _codes(vals_ptr, bases_ptr, page, head, H, D)
    base = tl.load(offsets_ptr + page)
    hs = tl.arange(0, HP)
    cnt = tl.load(counts_ptr + page.to(tl.int64) * H + hs, mask=hs < H, other=0)
    ex_h = FIXED + tl.sum(tl.where(hs < head, cnt, 0), axis=0)  # this head's first exception byte
    # planes [3][16][D / 8]: bit j of byte (p, t, k) is bit p of the code of channel 8 k + j
    hb = base + HDR + head * (22 * D)
    t = tl.arange(0, 16)
    k = tl.arange(0, D // 8)
    jj = tl.arange(0, 8)
    for p in tl.static_range(3):
        b = tl.sum(tl.reshape((code >> p) & 1, [16, D // 8, 8]) << jj[None, None, :], axis=2)
        tl.store(buf_ptr + hb + p * (2 * D) + t[:, None] * (D // 8) + k[None, :], b.to(tl.uint8))
    # raw [16][D]: sign as bit 7, mantissa bits 6..0
    c = tl.arange(0, D)
    raw = ((bits >> 8) & 0x80) | (bits & 0x7F)
    tl.store(buf_ptr + hb + 6 * D + t[:, None] * D + c[None, :], raw.to(tl.uint8))
    # exceptions: the exponent bytes of escaped values, token-major, at ex[head] + their rank
    ei = tl.reshape((code == 7).to(tl.int32), [16 * D])
    esc = ei != 0
    rank = tl.cumsum(ei, axis=0) - ei
    tl.store(buf_ptr + base + ex_h + rank, tl.reshape(e, [16 * D]).to(tl.uint8), mask=esc)
    if head == 0:  # header: u32 ex[0..H] little endian, zero-padded to HDR bytes
        ex = FIXED + tl.cumsum(cnt, axis=0) - cnt  # ex[k] for k < HP (k <= H used)
        tot = tl.sum(cnt, axis=0)
        ex = tl.where(hs == H, FIXED + tot, ex)
        for i in tl.static_range(4):
            tl.store(buf_ptr + base + 4 * hs + i, ((ex >> (8 * i)) & 0xFF).to(tl.uint8), mask=hs <= H)
        pad = 4 * (H + 1) + tl.arange(0, 16)
        tl.store(buf_ptr + base + pad, tl.zeros([16], dtype=tl.uint8), mask=pad < HDR)
    if head == H - 1:  # zero padding after the last exception, to a multiple of 16
        end = FIXED + tl.sum(cnt, axis=0)
        z = end + tl.arange(0, 16)
        tl.store(buf_ptr + base + z, tl.zeros([16], dtype=tl.uint8), mask=z < (end + 15) // 16 * 16)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise InvalidArgumentError(msg)


MAX_HEADS = 64  # the kernels' header pass holds every head's count in one block


def supports(heads: int, head_dim: int) -> bool:
    """Whether the kernels take pages of this shape (else use ``kv_exact_ref``: the same bytes)."""
    return 1 <= heads <= MAX_HEADS and head_dim in (32, 64, 128, 256)


def _prepare(values: torch.Tensor, bases: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    _check(isinstance(values, torch.Tensor) and values.dim() == 4 and values.shape[1] == ref.PAGE_TOKENS,
           f"values must be [n, {ref.PAGE_TOKENS}, kv_heads, head_dim]")
    _check(values.dtype in (torch.bfloat16, torch.int16), "values must be bf16 or their int16 bits")
    n, _, h, d = values.shape
    _check(supports(h, d), f"the write kernels take kv_heads 1..{MAX_HEADS} and head_dim 32, 64, 128 or 256, not {h} x {d}")
    _check(isinstance(bases, torch.Tensor) and bases.dtype == torch.uint8 and bases.numel() == h * d,
           f"bases must be uint8 [{h}, {d}]")
    return values.contiguous().view(torch.int16), bases.reshape(h, d).to(values.device).contiguous()


def page_counts(values: torch.Tensor, bases: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Escapes per (page, head), int64 [n, H], and each page's bytes (padding included), int64 [n],
    on values' device (no sync)."""
    v, b = _prepare(values, bases)
    n, _, h, d = v.shape
    counts = torch.empty((n, h), dtype=torch.int64, device=v.device)
    if n:
        _count_kernel[(n, h)](v, b, counts, h, D=d, num_warps=4)
    fixed = ref.fixed_bytes(h, d)
    lengths = (fixed + counts.sum(1) + ref.ALIGN - 1) // ref.ALIGN * ref.ALIGN
    return counts, lengths


def write_pages(values: torch.Tensor, bases: torch.Tensor, counts: torch.Tensor, offsets: torch.Tensor,
                buf: torch.Tensor) -> None:
    """Write page i (``page_counts``'s lengths[i] bytes) at ``buf[offsets[i]:]``: offsets int64 [n] on
    buf's device, multiples of 16, regions inside buf and disjoint (the caller's allocator)."""
    v, b = _prepare(values, bases)
    n, _, h, d = v.shape
    _check(buf.dtype == torch.uint8 and buf.dim() == 1 and buf.is_contiguous() and buf.device == v.device,
           "buf must be a contiguous 1-D uint8 tensor on values' device")
    _check(counts.dtype == torch.int64 and tuple(counts.shape) == (n, h) and counts.is_contiguous()
           and counts.device == v.device, f"counts must be contiguous int64 [{n}, {h}] (page_counts)")
    _check(offsets.dtype == torch.int64 and tuple(offsets.shape) == (n,) and offsets.is_contiguous()
           and offsets.device == v.device, f"offsets must be contiguous int64 [{n}] on values' device")
    if n:
        _write_kernel[(n, h)](v, b, counts, offsets, buf, h, ref.fixed_bytes(h, d), ref.header_bytes(h),
                              D=d, HP=triton.next_power_of_2(h + 1), num_warps=4)
