"""Copy variable-size byte regions between two uint8 buffers on the GPU: region i is ``sizes[i]``
bytes from ``src[src_offsets[i]:]`` to ``dst[dst_offsets[i]:]``, every offset and size a multiple of
16 bytes. One program per region, 16-byte words (four int32) per lane. KV Exact moves a sequence's
pages (scattered over its heap) into one contiguous chunk for the bus and back with it; the torch
reference (``regions_ref``) does the same through an int64 index of every 16-byte row (8 bytes of
index per 16 bytes moved, built per chunk). The two were not timed against each other.

    copy_regions(src, src_offsets, dst, dst_offsets, sizes)   # uint8 buffers, int64 [n] each
    post(src, dst)   # a few int64 words from the GPU into pinned host memory, written by the SMs
    weighted_sum(x, a, b, out)   # out[0] += sum of x[p, j] * a[j] * b[p], int64 modulo 2**64

``weighted_sum`` is the offload's chunk digest (``offload.digest``) in one launch, added into a slot
of a device tensor (the torch formula makes a temporary the size of the chunk and takes five calls).

``post`` exists for sizes the host needs while bulk copies run: a device-to-host copy goes to a copy
engine and waits behind every copy queued before it in that direction (a 12 GB offload: up to 0.2 s),
while a kernel's stores reach pinned (mapped) host memory over the bus at once.

The caller guarantees that the destination regions do not overlap each other or the sources (the
reference does not check this either); bounds are the caller's too (``check=True`` verifies them
with one device sync).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weightszip.errors import InvalidArgumentError

from ._interpreter_compat import apply as _interpreter_compat

_interpreter_compat()

ALIGN = 16


@triton.jit
def _copy_regions_kernel(src_ptr, dst_ptr, src_off_ptr, dst_off_ptr, size_ptr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    # in int32 words, rounded down to whole 16-byte units, so that the alignment the hints promise
    # holds whatever the arguments are (a size off the contract copies less, never writes past)
    so = tl.multiple_of(tl.load(src_off_ptr + i) // 16 * 4, 4)
    do = tl.multiple_of(tl.load(dst_off_ptr + i) // 16 * 4, 4)
    n = tl.multiple_of(tl.load(size_ptr + i) // 16 * 4, 4)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        m = offs < n
        tl.store(dst_ptr + do + offs, tl.load(src_ptr + so + offs, mask=m), mask=m)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise InvalidArgumentError(msg)


def copy_regions(src: torch.Tensor, src_offsets: torch.Tensor, dst: torch.Tensor, dst_offsets: torch.Tensor,
                 sizes: torch.Tensor, *, check: bool = False, block: int = 1024) -> None:
    """Copy region i (``sizes[i]`` bytes) from ``src[src_offsets[i]:]`` to ``dst[dst_offsets[i]:]``.
    src, dst: contiguous 1-D uint8 on one device, 16-byte aligned; offsets and sizes: int64 [n] on that
    device, multiples of 16. ``check``: verify alignment and bounds first (a device sync)."""
    _check(src.dtype == torch.uint8 and dst.dtype == torch.uint8 and src.dim() == 1 and dst.dim() == 1
           and src.is_contiguous() and dst.is_contiguous(), "src and dst must be contiguous 1-D uint8")
    _check(src.device == dst.device, "src and dst must be on one device")
    _check(src.data_ptr() % ALIGN == 0 and dst.data_ptr() % ALIGN == 0 and src.numel() % 4 == 0
           and dst.numel() % 4 == 0, "src and dst must be 16-byte aligned, their lengths multiples of 4 bytes")
    n = sizes.numel()
    for name, t in (("src_offsets", src_offsets), ("dst_offsets", dst_offsets), ("sizes", sizes)):
        _check(t.dtype == torch.int64 and t.dim() == 1 and t.numel() == n and t.is_contiguous()
               and t.device == src.device, f"{name} must be contiguous int64 [{n}] on {src.device}")
    if check and n:
        ok = ((src_offsets % ALIGN == 0) & (dst_offsets % ALIGN == 0) & (sizes % ALIGN == 0) & (sizes >= 0)
              & (src_offsets >= 0) & (dst_offsets >= 0)
              & (src_offsets + sizes <= src.numel()) & (dst_offsets + sizes <= dst.numel()))
        _check(bool(ok.all()), "a region is unaligned or out of bounds")
    if n:
        _copy_regions_kernel[(n,)](src.view(torch.int32), dst.view(torch.int32), src_offsets, dst_offsets, sizes,
                                   BLOCK=block, num_warps=4)


@triton.jit
def _post_kernel(src_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    m = i < n
    tl.store(dst_ptr + i, tl.load(src_ptr + i, mask=m), mask=m)


POST_MAX = 1024


def post(src: torch.Tensor, dst: torch.Tensor) -> None:
    """``dst[:] = src`` by a kernel on the current stream: src int64 [n] on the GPU, dst int64 [n] in
    pinned host memory (or on the same device), n <= 1024. The host sees the words once an event
    recorded after this call has completed."""
    n = src.numel()
    _check(src.dtype == torch.int64 and dst.dtype == torch.int64 and src.dim() == 1 and dst.dim() == 1
           and dst.numel() == n and src.is_contiguous() and dst.is_contiguous(), "src and dst must be contiguous int64 [n]")
    _check(n <= POST_MAX, f"post moves at most {POST_MAX} words")
    _check(dst.device == src.device or dst.is_pinned() or src.device.type == "cpu",
           "dst must be on src's device or in pinned host memory")
    if n:
        # one block size for every n: a variant per power of two would compile on first use, on the
        # critical path of the first offload or restore with a new chunk count
        _post_kernel[(1,)](src, dst, n, BLOCK=POST_MAX, num_warps=1)


@triton.jit
def _weighted_sum_kernel(x_ptr, a_ptr, b_ptr, out_ptr, n_rows, W, ROWS: tl.constexpr, BLOCK: tl.constexpr):
    # ROWS rows per program; int64 products and sums wrap (modulo 2**64), as torch's do.
    total = tl.zeros([BLOCK], dtype=tl.int64)
    for r in range(ROWS):
        p = tl.program_id(0).to(tl.int64) * ROWS + r
        acc = tl.zeros([BLOCK], dtype=tl.int64)
        for j0 in range(0, W, BLOCK):
            j = j0 + tl.arange(0, BLOCK)
            m = (j < W) & (p < n_rows)
            acc += tl.load(x_ptr + p * W + j, mask=m, other=0) * tl.load(a_ptr + j, mask=m, other=0)
        total += acc * tl.load(b_ptr + p, mask=p < n_rows, other=0)
    tl.atomic_add(out_ptr, tl.sum(total, 0))


def weighted_sum(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    """``out[0] += sum over p, j of x[p, j] * a[j] * b[p]`` in int64 modulo 2**64, on the current stream:
    x int64 [n, W] contiguous, a int64 [W], b int64 [n], out int64 [1], all on one device (the
    reference: ``regions_ref.weighted_sum_ref``)."""
    n, w = x.shape if x.dim() == 2 else (-1, -1)
    _check(all(t.dtype == torch.int64 and t.is_contiguous() for t in (x, a, b, out)) and x.dim() == 2
           and tuple(a.shape) == (w,) and tuple(b.shape) == (n,) and out.numel() == 1,
           "weighted_sum takes contiguous int64 x [n, W], a [W], b [n], out [1]")
    _check(len({t.device for t in (x, a, b, out)}) == 1, "weighted_sum's tensors must be on one device")
    if n and w:
        rows = 16
        _weighted_sum_kernel[(triton.cdiv(n, rows),)](x, a, b, out, n, w, ROWS=rows, BLOCK=1024, num_warps=4)
