"""Plain-PyTorch references of regions.copy_regions (the same copy through 16-byte row indices),
regions.post (a copy) and regions.weighted_sum."""

from __future__ import annotations

import torch


def rows16(offsets: torch.Tensor, sizes: torch.Tensor, total: int) -> torch.Tensor:
    """16-byte row indices of regions (byte offsets and sizes, multiples of 16) back to back;
    ``total`` their bytes (known on the host: no device sync)."""
    rows = sizes // 16
    first = torch.repeat_interleave(offsets // 16 - (torch.cumsum(rows, 0) - rows), rows, output_size=total // 16)
    return first + torch.arange(total // 16, device=offsets.device)


def copy_regions_ref(src: torch.Tensor, src_offsets: torch.Tensor, dst: torch.Tensor, dst_offsets: torch.Tensor,
                     sizes: torch.Tensor) -> None:
    total = int(sizes.sum())
    rows_dst = dst[: dst.numel() // 16 * 16].view(-1, 16)
    rows_dst[rows16(dst_offsets, sizes, total)] = src[: src.numel() // 16 * 16].view(-1, 16)[rows16(src_offsets, sizes, total)]


def post_ref(src: torch.Tensor, dst: torch.Tensor) -> None:
    dst.copy_(src)


def weighted_sum_ref(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, out: torch.Tensor) -> None:
    out += ((x * a).sum(1) * b).sum()
