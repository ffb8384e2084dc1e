"""GPU kernels (Triton), each beside a plain-PyTorch reference of the same math.

This folder ships inside the package as ``weightszip.kernels``: ``python/weightszip/kernels/`` holds
one symbolic link per module here (maturin copies the linked files into the wheel; it does not follow
a linked folder). A new module needs its link (``tests/test_kernels_package.py`` checks). Import it
as ``weightszip.kernels``, never as a top-level ``triton_kernels`` (a PyPI package of that name exists). Needs torch and triton (``pip install weightszip[gpu]``); on a machine without a
GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set before importing this).

* ``paged_decode``: decode attention over a paged KV cache (bf16 and fp8 e4m3 pages, side tokens,
  transformed-domain pages, and the compact formats' pages of nibble rows, crumb rows and bit planes:
  ``page_type="compact"``),
  split-K with a log-sum-exp merge, ``plan()``/``run()``; reference in ``paged_decode_ref``.
* ``paged_decode_gluon``: its split kernel for compact pages in Gluon (codes decoded into the
  tensor cores' registers; compiled only, GPU), which ``paged_decode`` runs where it applies; the
  same reference, and its decode math in PyTorch (``pair_index``, ``interleaved_pair_table``,
  ``k_nibble_channel``, ``v_nibble_channel``, ``nibble_pair_codes``, ``k_crumb_channel``,
  ``v_crumb_channel``, ``crumb_pair_codes_k``, ``crumb_pair_codes_v``).
* ``kv_exact4_gluon``: the split kernel for KV Exact4 pages in Gluon (pairs decoded into the tensor
  cores' registers; compiled only, GPU) and the same kernel over bf16 pages, its bit-for-bit
  reference; ``paged_decode`` runs it where it applies; the decode math's reference is
  ``kv_exact4_ref.pair_decode``, the attention's ``paged_decode_ref``.
* ``compact_write``: new bf16 K/V tokens into compact pages, the reference encoder's bytes bit for
  bit; reference in ``compact_write_ref``.
"""

from .compact_write import compact_write, compact_write_tables
from .compact_write_ref import compact_write_ref
from .paged_decode import (
    DEFAULT_CONFIGS,
    PAGE_TOKENS,
    KernelConfig,
    PagedDecodeAttention,
    compact_page_bytes,
    compact_tables,
    dequantize_compact_pages,
    dequantize_pages,
    rope_logit_coef,
    rope_page_table,
    transform_query,
)
from .paged_decode_ref import dequantize_compact_pages_ref, dequantize_pages_ref, paged_decode_ref, quantize_fp8_ref

__all__ = [
    "PagedDecodeAttention",
    "KernelConfig",
    "DEFAULT_CONFIGS",
    "PAGE_TOKENS",
    "dequantize_pages",
    "transform_query",
    "rope_logit_coef",
    "rope_page_table",
    "paged_decode_ref",
    "dequantize_pages_ref",
    "quantize_fp8_ref",
    "compact_tables",
    "compact_page_bytes",
    "dequantize_compact_pages",
    "dequantize_compact_pages_ref",
    "compact_write",
    "compact_write_tables",
    "compact_write_ref",
]
