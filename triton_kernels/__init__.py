"""GPU kernels (Triton), each beside a plain-PyTorch reference of the same math.

This folder ships inside the package as ``weightszip.kernels``: ``python/weightszip/kernels/`` holds
one symbolic link per module here (maturin copies the linked files into the wheel; it does not follow
a linked folder). A new module needs its link (``tests/test_kernels_package.py`` checks). Import it
as ``weightszip.kernels``, never as a top-level ``triton_kernels`` (a PyPI package of that name exists). Needs torch and triton (``pip install weightszip[gpu]``); on a machine without a
GPU the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set before importing this).

* ``paged_decode``: decode attention over a paged KV cache (bf16 and fp8 e4m3 pages, side tokens,
  transformed-domain pages), split-K with a log-sum-exp merge, ``plan()``/``run()``;
  reference in ``paged_decode_ref``.
"""

from .paged_decode import (
    DEFAULT_CONFIGS,
    PAGE_TOKENS,
    KernelConfig,
    PagedDecodeAttention,
    dequantize_pages,
    transform_query,
)
from .paged_decode_ref import dequantize_pages_ref, paged_decode_ref, quantize_fp8_ref

__all__ = [
    "PagedDecodeAttention",
    "KernelConfig",
    "DEFAULT_CONFIGS",
    "PAGE_TOKENS",
    "dequantize_pages",
    "transform_query",
    "paged_decode_ref",
    "dequantize_pages_ref",
    "quantize_fp8_ref",
]
