"""A KV chunk <-> bytes, in a buffer the caller owns: the format the LMCache serde and the SGLang
backend write. Framework-free (torch only), so it is tested without LMCache installed.

    offset size field
         0    4 magic "WZKV"
         4    1 version (1)
         5    1 mode: 0 exact (a weightszip container follows), 1 codec (a ChunkCodec's bytes)
         6    2 codec tag (mode 1), little-endian; 0 in mode 0
         8    8 body length B, little-endian
        16    B body

Exact mode is bit-exact: the container carries dtype and shape, which must match the buffer the
chunk is decoded into. The codec mode is the hook for compact (lossy) formats: any
`weightszip.store.ChunkCodec` whose tag is registered with `weightszip.store.register_codec`.
"""

from __future__ import annotations

import struct
from typing import Any

import numpy as np

from weightszip import _core
from weightszip._tensors import as_buffer, check_level, meta_tuple, threads_default, LAYOUT_TENSOR
from weightszip.errors import BadMagicError, CorruptDataError, InvalidArgumentError, TruncatedError, UnsupportedVersionError

MAGIC = b"WZKV"
VERSION = 1
MODE_EXACT = 0
MODE_CODEC = 1
HEADER = struct.Struct("<4sBBHQ")
HEADER_LEN = HEADER.size  # 16


def exact_bound(raw_bytes: int) -> int:
    """An upper bound on the bytes `serialize_into` writes for `raw_bytes` of tensor in exact
    mode. The exact codec falls back to storing a chunk when coding would not shrink it (one mode
    byte); the rest is the container's header, index and per-chunk entries (measured: about 105
    bytes plus 36-60 per 1 MiB chunk; chunks hold whole rows, so there are at most about twice
    as many chunks as MiB)."""
    if raw_bytes < 0:
        raise InvalidArgumentError(f"raw_bytes must be >= 0, got {raw_bytes}")
    chunks = 2 * (-(-raw_bytes // _core.DEFAULT_CHUNK_BYTES)) + 1
    return HEADER_LEN + raw_bytes + 4096 + 128 * chunks


def _u8(t):
    """A flat uint8 view of a contiguous CPU torch tensor."""
    import torch

    if not isinstance(t, torch.Tensor):
        raise InvalidArgumentError(f"expected a torch tensor, got {type(t).__name__}")
    if t.device.type != "cpu" or not t.is_contiguous():
        raise InvalidArgumentError("buffers must be contiguous CPU tensors")
    return t.reshape(-1).view(torch.uint8)  # (flat first: a 0-d tensor has no bytes view)


def serialize_into(x: Any, out, *, codec=None, threads: int | None = None, level: int = _core.DEFAULT_LEVEL) -> int:
    """Encode the KV chunk `x` (torch tensor, any shape) into the uint8 buffer `out`; returns
    the bytes written. Exact codec unless `codec` (a ChunkCodec) is given; `level` is the exact
    codec's encoder level (1 fast, 2 the default: `weightszip.compress`), which a codec has none of."""
    dst = _u8(out)
    level = check_level(level)
    if codec is None:
        buf = as_buffer(x)
        body = _core.compress_buffers(
            [(meta_tuple(buf, "", -1, LAYOUT_TENSOR), buf.addr, buf.nbytes)],
            0,
            _core.DEFAULT_CHUNK_BYTES,
            threads_default(threads),
            _core.DEFAULT_LANES_LOG2,
            level,
        )
        head = HEADER.pack(MAGIC, VERSION, MODE_EXACT, 0, len(body))
    else:
        if level != _core.DEFAULT_LEVEL:
            raise InvalidArgumentError(f"level {level} is the exact codec's; a ChunkCodec takes none")
        tag = int(codec.tag)
        if not 0 < tag < 2**16:  # (the header's field is a u16; the store's tags are wider)
            raise InvalidArgumentError(f"a KV chunk's codec tag is a u16: {tag} does not fit")
        body = codec.encode(x)
        head = HEADER.pack(MAGIC, VERSION, MODE_CODEC, tag, len(body))
    n = HEADER_LEN + len(body)
    if n > dst.numel():
        raise InvalidArgumentError(f"serialized chunk needs {n} bytes, the buffer has {dst.numel()}")
    view = dst[:n].numpy()  # shares the buffer's memory
    view[:HEADER_LEN] = np.frombuffer(head, dtype=np.uint8)
    view[HEADER_LEN:] = np.frombuffer(body, dtype=np.uint8)
    return n


def deserialize_into(src, dst, *, threads: int | None = None, codec=None) -> None:
    """Decode bytes written by `serialize_into` (at the start of the uint8 buffer `src`, which may
    be longer) into the tensor `dst`, whose dtype and shape must be the chunk's. A codec-mode chunk
    is decoded by `codec` where its tag is the chunk's (and, for a codec with ``owns``, it does not
    disown the chunk), else by the codec registered for the tag (`weightszip.store.codec_for`)."""
    import torch

    if not isinstance(dst, torch.Tensor):
        raise InvalidArgumentError(f"dst must be a torch tensor, not {type(dst).__name__}")
    s = _u8(src)
    if s.numel() < HEADER_LEN:
        raise TruncatedError(f"serialized KV chunk of {s.numel()} bytes")
    magic, version, mode, tag, n = HEADER.unpack(s[:HEADER_LEN].numpy().tobytes())
    if magic != MAGIC:
        raise BadMagicError("not a weightszip KV chunk (bad magic)")
    if version != VERSION or mode not in (MODE_EXACT, MODE_CODEC):
        raise UnsupportedVersionError(f"KV chunk version {version}, mode {mode}")
    if mode == MODE_EXACT and tag != 0:  # (exact mode writes 0 there: any other is damage)
        raise CorruptDataError(f"exact-mode KV chunk with codec tag {tag}")
    if n > s.numel() - HEADER_LEN:
        raise TruncatedError(f"KV chunk declares {n} bytes, {s.numel() - HEADER_LEN} are there")
    body = s[HEADER_LEN : HEADER_LEN + n]
    if mode == MODE_CODEC:
        from weightszip.store import codec_for

        data = body.numpy().tobytes()
        owns = getattr(codec, "owns", None)
        if codec is None or int(codec.tag) != tag or (callable(owns) and owns(data) is False):
            codec = codec_for(tag, data)
        if codec is None:
            raise InvalidArgumentError(f"KV chunk made by codec tag {tag}, which is not registered")
        out = codec.decode(data)
        if not isinstance(out, torch.Tensor):
            # numpy (bf16 / fp8 as ml_dtypes types, which torch cannot take): move the bits.
            a = np.ascontiguousarray(out)
            ints = {1: np.int8, 2: np.int16, 4: np.int32, 8: np.int64}
            # (by name: bits of one 2-byte type read as another would be other numbers)
            if a.dtype.name != str(dst.dtype).removeprefix("torch.") or a.dtype.itemsize not in ints:
                raise InvalidArgumentError(f"codec decoded {a.dtype}; the buffer is {dst.dtype}")
            out = torch.from_numpy(a.view(ints[a.dtype.itemsize])).view(dst.dtype)
        if tuple(out.shape) != tuple(dst.shape) or out.dtype != dst.dtype:  # (no silent conversion)
            raise InvalidArgumentError(f"chunk is {out.dtype} {tuple(out.shape)}, the buffer {dst.dtype} {tuple(dst.shape)}")
        dst.copy_(out)
        return
    addr, length = body.data_ptr(), body.numel()
    index = _core.buffer_index(addr, length)
    if len(index["entries"]) != 1:
        raise InvalidArgumentError(f"KV chunk holds {len(index['entries'])} tensors")
    e = index["entries"][0]
    if not dst.is_contiguous() or dst.device.type != "cpu":
        raise InvalidArgumentError(f"the destination must be a contiguous CPU tensor (it is {dst.device}, "
                                   f"{'' if dst.is_contiguous() else 'not '}contiguous)")
    want = as_buffer(dst)
    if e["dtype"] != want.dtype or tuple(e["shape"]) != tuple(dst.shape):
        shape = tuple(e["shape"])
        raise InvalidArgumentError(
            f"chunk is {e['dtype']} {shape}; the destination is {dst.dtype} {tuple(dst.shape)} on {dst.device}"
        )
    _core.decode_buffer_entry(addr, length, 0, dst.data_ptr(), e["raw_bytes"], threads_default(threads))
