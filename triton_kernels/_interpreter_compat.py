"""Two fixes for Triton's interpreter (``TRITON_INTERPRET=1``), seen with triton 3.6.0 and numpy 2.4.6;
compiled kernels are untouched.

* The interpreter holds every scalar as a one-element numpy array and turns it into a loop bound with
  ``int(array)``, which numpy 2.4 no longer allows for arrays of one dimension: every ``for i in
  range(lo, hi)`` with run-time bounds fails. We patch the attribute it installs while a kernel runs.
* It keeps bf16 values as their uint16 bit patterns and ``tl.dot`` multiplies those integers (only
  8-bit floats are converted first). We widen bf16 operands to fp32 (exact) before the product.
* Its bf16 -> fp32 cast flushes bf16 subnormals to zero; the GPU widens exactly (a 16-bit shift),
  and so do we.
"""

from __future__ import annotations

import numpy as np


def interpreting() -> bool:
    """Whether kernels run in Triton's interpreter (``TRITON_INTERPRET=1``), as Triton itself reads it."""
    try:
        from triton import knobs
    except ImportError:  # pragma: no cover - other triton layouts
        import os

        return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
    return bool(knobs.runtime.interpret)


def apply() -> None:
    try:
        from triton import knobs
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover - other triton layouts: nothing to patch
        return
    if not knobs.runtime.interpret or getattr(interpreter, "_weightszip_index_patch", False):
        return
    original = getattr(interpreter, "_patch_lang_tensor", None)
    if original is None:  # pragma: no cover
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = patched

    builder = interpreter.InterpreterBuilder
    dot = builder.create_dot

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        import triton.language as tl

        def widen(x):
            if x.dtype.scalar == tl.bfloat16:
                data = (x.data.astype(np.uint32) << 16).view(np.float32)
                return interpreter.TensorHandle(data, tl.float32)
            return x

        return dot(self, widen(a), widen(b), d, input_precision, max_num_imprecise_acc)

    builder.create_dot = create_dot

    cast = builder.cast_impl

    def cast_impl(self, src, dst_type):
        import triton.language as tl

        if src.dtype.scalar == tl.bfloat16 and dst_type.scalar == tl.float32:
            return interpreter.TensorHandle((src.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return cast(self, src, dst_type)

    builder.cast_impl = cast_impl
    interpreter._weightszip_index_patch = True
