"""Plain-PyTorch reference of ``compact_write``: the reference encoder (``codec.encode_tokens``) and
the page layout (``codec.unpack_page`` / ``codec.pack_page``: a token's slot replaced in its page)
writing into the same pool."""

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
    block_size = pages.shape[2] * 16
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        blk, off = divmod(slot, block_size)
        pg, tip = divmod(off, 16)
        for hh in range(h):  # the page through the codec: every byte pattern unpacks and packs back unchanged
            page_codes, page_sidx = codec.unpack_page(pages[blk, hh, pg].cpu(), bits, d)
            page_codes[tip], page_sidx[tip] = codes[t, hh], sidx[t, hh]
            pages[blk, hh, pg] = codec.pack_page(page_codes, page_sidx, bits).to(pages.device)
