"""Plain-PyTorch reference of ``compact_write``: the reference encoder (``codec.encode_tokens``) and
the page layout (``codec.pack_page``, one token's rows at a time) writing into the same pool."""

from __future__ import annotations

import torch


def compact_write_ref(x: torch.Tensor, slot_mapping: torch.Tensor, pages: torch.Tensor, head_tables,
                      positions: torch.Tensor | None = None) -> None:
    """x [n, kv_heads, head_dim] -> its codes and scale indices into ``pages`` uint8 [num_blocks,
    kv_heads, block_size / 16, page_bytes] (in place); ``head_tables``: a ``codec.HeadTables`` per
    KV head; a negative slot writes nothing; ``positions`` [n]: the tokens' positions (K tables with
    rotary offsets need them)."""
    from weightszip.compact import codec

    n, h, d = x.shape
    bits = head_tables[0].bits
    pos = None if positions is None else positions.cpu()
    codes, sidx = codec.encode_tokens(x.cpu(), head_tables, pos)  # [n, h, d], [n, h]
    row = d // 8
    plane = 16 * row
    block_size = pages.shape[2] * 16
    weights = 2 ** torch.arange(8, dtype=torch.int64)
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        blk, off = divmod(slot, block_size)
        pg, tip = divmod(off, 16)
        c = codes[t].to(torch.int64)  # [h, d]
        if codec.nibble_rows(bits):  # token row tip of d / 2 bytes
            byte = (c[:, 0::2] | (c[:, 1::2] << 4)).to(torch.uint8)
            pages[blk, :, pg, tip * (d // 2): (tip + 1) * (d // 2)] = byte.to(pages.device)
        for p in range(0 if codec.nibble_rows(bits) else bits):
            byte = (((c >> p) & 1).view(h, row, 8) * weights).sum(-1).to(torch.uint8)  # [h, row]
            pages[blk, :, pg, p * plane + tip * row: p * plane + (tip + 1) * row] = byte.to(pages.device)
        pages[blk, :, pg, bits * plane + tip] = sidx[t].to(pages.device)
