"""The exact page profile on the CPU (docs/FORMAT.md, "Exact page profile"): calibrate a codebook
for one (layer, K or V), encode and decode 16-token pages with the Rust reference codec.

Two codebook versions, both read by the GPU codec (``weightszip.kernels.exact_page`` and
``exact_page2``) and the offload tier: 1 (the default) and 2 (bf16 only, ``calibrate(...,
version=2)``): sign and exponent coded together, the sign as a change from the previous token's,
in three context classes chosen by the previous token of the same channel; fewer bytes on real K
(BENCHMARKS.md, "Exact page profile, version 2").

Values are 16-bit patterns (bf16 or fp16) as a numpy ``uint16`` array (or anything
``np.asarray`` takes, torch tensors included via ``.view(torch.int16)``), shaped
``[n_pages, 16, channels]`` for pages and ``[tokens, channels]`` for calibration samples.

>>> import numpy as np
>>> rng = np.random.default_rng(0)
>>> x = (rng.standard_normal((64, 32)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
>>> cb = calibrate(x, "bfloat16")
>>> buf, offsets = encode_pages(cb, x.reshape(4, 16, 32))
>>> bool((decode_pages(cb, buf, offsets) == x.reshape(4, 16, 32)).all())
True
"""

from __future__ import annotations

import numpy as np

from weightszip import _core
from weightszip._tensors import bytes_buffer, int_arg, threads_default
from weightszip.errors import CorruptDataError, InvalidArgumentError

PAGE_TOKENS = _core.PAGE_TOKENS
STREAM_CHANNELS = _core.PAGE_STREAM_CHANNELS
DTYPE_CODES = {"bfloat16": 1, "float16": 2}
ESC = 256
NSYM = 257
# version 2: classes per channel and symbols per table (sign and exponent, then the escape)
CLASSES_V2 = 3
NSYM_V2 = 513


def _u16(x) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor: reinterpret as int16 bits without a float conversion
        import torch

        if x.element_size() != 2 or x.dtype.is_complex or x.dtype == torch.bool:
            # (viewed as int16 first, float32 became twice the channels)
            raise InvalidArgumentError(f"expected 16-bit values (uint16 bit patterns), got {x.dtype}")
        x = x.detach().cpu().resolve_neg().contiguous().view(torch.int16).numpy()
    a = np.asarray(x)
    if a.dtype.itemsize != 2 or a.dtype.kind not in "uif":
        raise InvalidArgumentError(f"expected 16-bit values (uint16 bit patterns), got {a.dtype}")
    if not a.dtype.isnative:  # ('>u2': the same numbers in the other byte order; their bytes would be swapped)
        a = a.astype(a.dtype.newbyteorder("="))
    return np.ascontiguousarray(a).view(np.uint16)


def _bytes(buf) -> np.ndarray:
    """A byte buffer (bytes, bytearray, memoryview or an array) as contiguous numpy uint8."""
    if isinstance(buf, (bytes, bytearray, memoryview)):
        return bytes_buffer(buf)[2]  # (a memoryview with strides: InvalidArgumentError)
    try:
        a = np.asarray(buf)
    except (TypeError, ValueError, RuntimeError) as e:
        raise InvalidArgumentError(f"page bytes must be a byte buffer or a uint8 array: {e}") from None
    if a.dtype not in (np.uint8, np.int8):  # (a float array's bytes are not pages; None is an object array)
        raise InvalidArgumentError(f"page bytes must be a byte buffer or a uint8 array, not {a.dtype}")
    return np.ascontiguousarray(a).view(np.uint8)


def _offsets_u64(offsets) -> list[int]:
    """Page offsets (a 1-D array of n + 1 integers) for the Rust decoders: int64 values cross as u64
    (two's complement), so a negative one lies past any buffer's end and the codecs tell hostile
    offsets apart as the references do (InvalidArgumentError for anything but 1-D integers)."""
    offs = np.asarray(offsets)
    if offs.ndim != 1 or offs.size < 1 or offs.dtype.kind not in "iu":
        raise InvalidArgumentError("offsets must be a 1-D array of n + 1 integers")
    return [int(o) % (1 << 64) for o in offs]


def calibrate(samples, dtype: str = "bfloat16", max_len: int = 8, version: int = 1) -> bytes:
    """A codebook (bytes) from ``[tokens, channels]`` sample values of one (layer, K or V).
    ``version=2`` (bf16 only) reads the samples as consecutive tokens, in pages of 16 from the
    first row, as the pages it will code."""
    if not isinstance(dtype, str) or dtype not in DTYPE_CODES:
        raise InvalidArgumentError(f"page profile dtype {dtype!r:.40}: only {sorted(DTYPE_CODES)}")
    a = _u16(samples)
    if a.ndim != 2:
        raise InvalidArgumentError(f"samples must be [tokens, channels], got shape {a.shape}")
    max_len = int_arg("max_len", max_len, 0, 255)
    version = int_arg("version", version, 0, 255)
    return _core.page_calibrate(DTYPE_CODES[dtype], a.shape[1], a.ctypes.data, a.nbytes, max_len, version)


def _info(codebook) -> tuple:
    if not isinstance(codebook, (bytes, bytearray, memoryview)):
        raise InvalidArgumentError(f"a codebook is bytes (from calibrate), not {type(codebook).__name__}")
    return _core.page_codebook_info(bytes(codebook))


def codebook_info(codebook: bytes) -> tuple[str, int, int, np.ndarray]:
    """(dtype, max_len, channels, lengths) of a checked codebook: lengths uint8 [channels, 257] in
    version 1, [channels, 3, 513] in version 2 (``codebook_version``)."""
    code, max_len, channels, lengths, version, _ = _info(codebook)
    dtype = {v: k for k, v in DTYPE_CODES.items()}[code]
    shape = (channels, NSYM) if version == 1 else (channels, CLASSES_V2, NSYM_V2)
    return dtype, max_len, channels, np.frombuffer(lengths, np.uint8).reshape(shape)


def codebook_version(codebook: bytes) -> int:
    """1 or 2, of a checked codebook."""
    return _info(codebook)[4]


def codebook_splits(codebook: bytes) -> np.ndarray:
    """Version 2: uint8 [channels], the exponent from which a channel's previous token counts as
    high (FORMAT.md); empty for version 1."""
    return np.frombuffer(_info(codebook)[5], np.uint8).copy()


def page_raw_part(version: int, channels: int) -> int:
    """Bytes of a page's raw part: a byte a value (version 1) or 7 bits (version 2)."""
    return PAGE_TOKENS * channels * (8 if version == 1 else 7) // 8


def encode_pages(codebook: bytes, values, align: int = 8, threads: int | None = None) -> tuple[bytes, np.ndarray]:
    """Encode ``[n, 16, channels]`` values; returns (pages back to back, int64 offsets [n + 1]).
    ``threads``: 0 for one per core (the default, or ``WEIGHTSZIP_THREADS``); any count writes the
    same bytes."""
    a = _u16(values)
    channels = _info(codebook)[2]
    if a.ndim != 3 or a.shape[1:] != (PAGE_TOKENS, channels):
        raise InvalidArgumentError(f"pages must be [n, {PAGE_TOKENS}, {channels}], got {a.shape}")
    align = int_arg("align", align, 0, 2**63 - 1)
    buf, offs = _core.page_encode(bytes(codebook), a.ctypes.data, a.nbytes, align, threads_default(threads))
    return buf, np.asarray(offs, np.int64)


def decode_pages(codebook: bytes, buf, offsets, threads: int | None = None) -> np.ndarray:
    """Decode the pages at ``offsets`` (n + 1 entries) of ``buf``; returns uint16 [n, 16, channels].
    Page i ends by ``offsets[i + 1]``, the slack after it zero (CorruptDataError if not; the
    first bad page in order is the one named, on any number of ``threads``, as in
    ``encode_pages``)."""
    threads = threads_default(threads)
    _, _, channels, _, version, _ = _info(codebook)
    src = _bytes(buf)
    offs = _offsets_u64(offsets)
    # the output is allocated for the pages up to the first one that cannot decode (outside the
    # buffer, offsets decreasing, or shorter than a header and a raw byte per value; pages are
    # checked in order, so the codec raises for it or an earlier one): hostile offsets cannot ask
    # for more memory than the buffer's bytes could decode to
    o = np.asarray(offs, np.uint64)
    least = -(-2 * (channels // STREAM_CHANNELS) // 8) * 8 + page_raw_part(version, channels)
    bad = np.flatnonzero((o[1:] < o[:-1]) | (o[1:] > src.nbytes) | (o[1:] - o[:-1] < least))
    n = len(offs) - 1 if bad.size == 0 else int(bad[0]) + 1
    out = np.empty((n, PAGE_TOKENS, channels), np.uint16)
    _core.page_decode(bytes(codebook), src.ctypes.data, src.nbytes, offs[:n + 1], out.ctypes.data, out.nbytes, threads)
    if n < len(offs) - 1:  # (the codec raised for page n - 1 or before; this says the same if not)
        raise CorruptDataError(f"page {n - 1}: offsets {offs[n - 1]}..{offs[n]} cannot hold a page")
    return out


def canonical_codes(lengths: np.ndarray) -> np.ndarray:
    """Canonical codes from code lengths [tables, symbols] (each table's symbols in (length, symbol)
    order): [channels, 257] in version 1, [channels x 3, 513] for version 2's tables."""
    lengths = np.asarray(lengths, np.int64)
    codes = np.zeros(lengths.shape, np.int64)
    for c in range(lengths.shape[0]):
        code, prev = 0, 0
        order = sorted((int(l), s) for s, l in enumerate(lengths[c]) if l > 0)
        for i, (l, s) in enumerate(order):
            if i > 0:
                code = (code + 1) << (l - prev)
            codes[c, s] = code
            prev = l
    return codes


def decode_table(codebook: bytes) -> tuple[np.ndarray, int]:
    """The decoder's lookup table: int16 entries ``symbol << 4 | length`` indexed by the next
    ``max_len`` bits of the stream, [channels, 2**max_len] (version 1) or [channels, 3,
    2**max_len] (version 2: a table per class; the escape is symbol 512); and max_len."""
    _, max_len, channels, lengths = codebook_info(codebook)
    flat = lengths.reshape(-1, lengths.shape[-1])
    codes = canonical_codes(flat)
    lut = np.zeros((flat.shape[0], 1 << max_len), np.int16)
    for c in range(flat.shape[0]):
        for s in np.nonzero(flat[c])[0]:
            l = int(flat[c, s])
            lo = int(codes[c, s]) << (max_len - l)
            lut[c, lo : lo + (1 << (max_len - l))] = (int(s) << 4) | l
    return lut.reshape(lengths.shape[:-1] + (1 << max_len,)), max_len


def encode_table(codebook: bytes) -> np.ndarray:
    """The encoder's table: int32 entries ``code << 5 | length`` (0: no code), [channels, 257]
    (version 1) or [channels, 3, 513] (version 2)."""
    _, _, _, lengths = codebook_info(codebook)
    codes = canonical_codes(lengths.reshape(-1, lengths.shape[-1])).reshape(lengths.shape)
    return ((codes << 5) | lengths.astype(np.int64)).astype(np.int32)


def header_len(channels: int) -> int:
    """Bytes of a page header: one u16 per stream, zero-padded to a multiple of 8."""
    return (2 * (channels // STREAM_CHANNELS) + 7) // 8 * 8
