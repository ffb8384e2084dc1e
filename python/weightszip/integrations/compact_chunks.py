"""The compact KV formats (q4, q3.5, q3; `weightszip.compact`) as a `ChunkCodec` for the chunk
store, the LMCache serde and the SGLang backend: a KV chunk in LMCache's layout
[2, layers, tokens, kv_heads * head_dim] becomes the formats' 16-token pages.

    >>> from weightszip.compact.calibrate import Calibration                   # doctest: +SKIP
    >>> codec = CompactChunkCodec(Calibration.load("smollm2.wzcal"), "q4")
    >>> store.put_tensor("chunk-key", kv_chunk, codec=codec)                   # ~0.28 of bf16
    >>> store.get_tensor("chunk-key")                                          # what q4 hands back

Bytes: a 56-byte header (magic ``WZQC``, version 6, format index, two zero bytes, then u32 kinds,
layers, tokens, hidden, u64 start: the position of the chunk's first token, u64 calibration id: an
XXH3-64 of every table the format's codes depend on (``calibration_id``), u64 XXH3-64 of the pages
(every byte after the header), u64 XXH3-64 of header bytes 0-47; little-endian) and, for K then V,
each layer, each kv head, each 16 tokens, one page of ``weightszip.compact.codec.page_bytes(bits,
head_dim)`` bytes (docs/FORMAT.md, "Compact KV pages" and "Compact KV chunks"), bits from the
calibration's allocation for that layer and kind. Older versions still read, without checksums:
version 1 had no start and a 24-byte header (read as start 0), versions 2-4 a 32-byte header (bytes
0-31 above), version 5 a 48-byte header (bytes 0-31, then the two checksums, of bytes 0-39; no
calibration id); the page layout of each version is ``PAGE_VERSIONS`` (versions 1 and 2 bit planes at
every width, 3 width-4 codes as nibble rows, 4-6 also width-3 codes as crumb rows). Every token
of the chunk is coded:
the sink and recent-window tokens that the paged cache keeps in bf16 are the caller's to keep out of
offloaded chunks. Keys are coded at their positions (``encode(x, start=...)``): with a calibration
that carries rotary offsets (``Calibration.has_rope_offsets``) the position decides which offset is
taken off, so a wrong start costs accuracy (the offset no longer cancels the k_proj bias), never
consistency: decoding uses the start the chunk records.

``decode`` reads the header as data, not as the caller's arguments: a header that this codec cannot
read (nonzero bytes 6-7, a format other than the codec's, a shape that does not fit the calibration,
tokens not whole pages) is CorruptDataError, as damage is; a chunk of another format or model given
to this codec looks the same, and the message names both. So is a version-6 chunk coded with another
calibration (another model's, or this model's calibrated again: its codes would decode to other
values, silently): its calibration id is not this codec's. In a chunk of version 5 or 6 the header's
checksum is checked before any of its other fields is believed, and the pages' checksum before any
page is decoded (ChecksumMismatchError), after the length the header implies (TruncatedError): a
flipped bit anywhere in a chunk is a typed error, never wrong values.
"""

from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np
import torch

from weightszip import _core
from weightszip.compact import codec as cc
from weightszip.compact.calibrate import TARGETS
from weightszip.errors import (
    ChecksumMismatchError,
    CorruptDataError,
    InvalidArgumentError,
    TruncatedError,
    UnsupportedVersionError,
)

MAGIC = b"WZQC"
VERSION = 6
# the page layout version (``codec.PAGE_VERSION``) each chunk version holds
PAGE_VERSIONS = {1: 1, 2: 1, 3: 2, 4: 3, 5: 3, 6: 3}
_HEAD = struct.Struct("<4sBB2xIIIIQQQQ")  # 56 bytes: ... start, calibration id, pages' and header's XXH3-64
_HEAD_V5 = struct.Struct("<4sBB2xIIIIQQQ")  # 48 bytes: ... start, pages' XXH3-64, header's XXH3-64
_HEAD_V2 = struct.Struct("<4sBB2xIIIIQ")  # 32 bytes (versions 2-4), no checksums
_HEAD_V1 = struct.Struct("<4sBB2xIIII")  # 24 bytes, start 0
_FORMATS = tuple(TARGETS)


def _xxh3(data: Any) -> int:
    """XXH3-64 (seed 0) of a bytes-like object, as the container's checksums (docs/FORMAT.md)."""
    a = np.frombuffer(data, dtype=np.uint8)
    return _core.xxh3_64(a.ctypes.data, a.nbytes)


def _head_struct(version: int) -> struct.Struct:
    return _HEAD_V1 if version == 1 else _HEAD_V2 if version < 5 else _HEAD_V5 if version == 5 else _HEAD


def calibration_id(calibration, fmt: str) -> int:
    """XXH3-64 of everything a format's codes depend on in ``calibration``: its shape, the format's
    allocation of widths, and the tables ``Calibration.tables`` hands the coder (mu, mult, signs,
    e0, the allocated widths' codebooks, the rotary offsets and phases). Not its metadata or its
    kept-token counts, which do not change a code."""
    cal = calibration
    parts = [struct.pack("<III", cal.layers, cal.kv_heads, cal.head_dim), fmt.encode(),
             np.asarray(cal.allocation[fmt], dtype=np.uint8).tobytes()]
    for t in (cal.mu, cal.mult, cal.signs, cal.e0):
        parts.append(t.detach().cpu().contiguous().to(torch.int64).numpy().tobytes())
    for b in sorted({b for widths in cal.allocation[fmt] for b in widths}):
        parts += [struct.pack("<B", b), cal.codebooks[b].detach().cpu().contiguous().to(torch.float32).numpy().tobytes()]
    if cal.rope_m is not None:
        parts += [b"rope", cal.rope_m.detach().cpu().contiguous().numpy().tobytes(),
                  cal.rope_phase.detach().cpu().contiguous().numpy().tobytes()]
    return _xxh3(b"".join(parts))


def _as_bf16_torch(x: Any) -> torch.Tensor:
    """A bf16 chunk as a CPU torch tensor: a torch bf16 tensor, or a numpy array of ml_dtypes'
    bfloat16. Anything else is refused, not converted: a chunk decodes to bf16, so an fp16 or fp32
    chunk would come back as another dtype (and fp16 or int16 bits read as bf16 are other numbers)."""
    if isinstance(x, torch.Tensor):
        if x.dtype != torch.bfloat16:
            raise InvalidArgumentError(f"compact chunks take bf16 KV, got {x.dtype}")
        return x.detach().cpu()
    if not isinstance(x, np.ndarray) or x.dtype.name != "bfloat16":
        raise InvalidArgumentError(f"compact chunks take bf16 KV (a torch tensor, or numpy with ml_dtypes' bfloat16), "
                                   f"got {getattr(x, 'dtype', type(x).__name__)}")
    return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)


class CompactChunkCodec:
    """q4 / q3.5 / q3 pages for whole KV chunks, with one model's calibration."""

    def __init__(self, calibration, fmt: str = "q4", tag: int = 32 + 0):
        """``calibration``: a ``Calibration``, or the path of a .wzcal file (loaded)."""
        if isinstance(calibration, (str, os.PathLike)):
            from weightszip.compact.calibrate import Calibration

            calibration = Calibration.load(calibration)
        if fmt not in _FORMATS:
            raise InvalidArgumentError(f"compact format must be one of {', '.join(_FORMATS)}, not {fmt!r}")
        allocation = getattr(calibration, "allocation", {})
        if fmt not in allocation:
            raise InvalidArgumentError(f"the calibration has no allocation for {fmt!r} (it has "
                                       f"{', '.join(sorted(allocation)) or 'none'})")
        self.cal = calibration
        self.fmt = fmt
        self.tag = tag + _FORMATS.index(fmt)
        self.calibration_id = calibration_id(calibration, fmt)

    def owns(self, data: Any) -> bool | None:
        """Whether this codec is the one to decode a chunk: what lets chunks of several calibrations
        share a store and a tag. False when its (version-6, intact) header names another format or
        calibration; None when its header cannot tell (versions 1-5 record no calibration); True
        when it names this codec's, and also for bytes that are no intact chunk at all (damaged,
        cut, not a chunk), which every codec refuses alike: ``decode`` then says why."""
        try:
            head = bytes(memoryview(data)[: _HEAD.size])
        except TypeError:
            return True
        if len(head) < 5 or head[:4] != MAGIC or head[4] not in PAGE_VERSIONS:
            return True
        if head[4] < 6:
            return None
        if len(head) < _HEAD.size:
            return True
        fields = _HEAD.unpack(head)
        if _xxh3(head[: _HEAD.size - 8]) != fields[-1]:
            return True
        return fields[2] < len(_FORMATS) and _FORMATS[fields[2]] == self.fmt and fields[-3] == self.calibration_id

    def __repr__(self) -> str:
        return f"CompactChunkCodec({self.fmt}, calibration {self.calibration_id:016x}, tag {self.tag})"

    def _bits(self, layer: int, ki: int) -> int:
        return self.cal.allocation[self.fmt][layer][ki]

    def _check(self, kinds: int, layers: int, tokens: int, hidden: int, error: type = InvalidArgumentError) -> int:
        """Pages per head of a chunk [kinds, layers, tokens, hidden]; ``error`` when the shape does
        not fit (InvalidArgumentError for the caller's shapes, CorruptDataError for a header's)."""
        cal = self.cal
        if kinds != 2 or layers != cal.layers or hidden != cal.kv_heads * cal.head_dim:
            raise error(
                f"chunk [{kinds}, {layers}, {tokens}, {hidden}] does not fit the calibration "
                f"([2, {cal.layers}, T, {cal.kv_heads} x {cal.head_dim}])"
            )
        if tokens % cc.PAGE_TOKENS:
            raise error(f"chunk tokens must be a multiple of {cc.PAGE_TOKENS}, got {tokens}")
        return tokens // cc.PAGE_TOKENS

    def max_encoded_size(self, shape, dtype=None) -> int:
        """The bytes of a chunk of ``shape``; ``dtype`` (a torch dtype, where given) must be bf16, so
        that a serde sizing its buffers refuses a chunk it could store but never load back."""
        if dtype is not None and dtype != torch.bfloat16 and getattr(dtype, "name", None) != "bfloat16":
            raise InvalidArgumentError(f"compact chunks take bf16 KV, got {dtype}")
        kinds, layers, tokens, hidden = (int(s) for s in shape)
        pages = self._check(kinds, layers, tokens, hidden)
        heads, d = self.cal.kv_heads, self.cal.head_dim
        body = sum(
            pages * heads * cc.page_bytes(self._bits(layer, ki), d) for layer in range(layers) for ki in range(2)
        )
        return _HEAD.size + body

    def encode(self, x: Any, start: int = 0) -> bytes:
        """A chunk [2, layers, tokens, hidden] bf16 whose first token sits at position ``start``."""
        start = int(start)
        if not 0 <= start <= cc.POSITION_MAX - 1:
            raise InvalidArgumentError(f"start must lie in [0, 2**31), got {start}")
        t = _as_bf16_torch(x)
        if t.ndim != 4:
            raise InvalidArgumentError(f"a KV chunk is [2, layers, tokens, hidden], got {tuple(t.shape)}")
        kinds, layers, tokens, hidden = t.shape
        pages = self._check(kinds, layers, tokens, hidden)
        heads, d = self.cal.kv_heads, self.cal.head_dim
        if start + tokens > cc.POSITION_MAX:
            raise InvalidArgumentError(f"positions {start}..{start + tokens} exceed 2**31")
        positions = torch.arange(start, start + tokens)
        out = []
        for ki, kind in enumerate("kv"):
            for layer in range(layers):
                bits = self._bits(layer, ki)
                tables = self.cal.tables(layer, kind, bits)
                codes, sidx = cc.encode_tokens(t[ki, layer].reshape(tokens, heads, d), tables, positions)
                for h in range(heads):
                    for p in range(pages):
                        sl = slice(p * cc.PAGE_TOKENS, (p + 1) * cc.PAGE_TOKENS)
                        out.append(cc.pack_page(codes[sl, h], sidx[sl, h], bits, PAGE_VERSIONS[VERSION])
                                   .numpy().tobytes())
        body = b"".join(out)
        head = bytearray(_HEAD.pack(MAGIC, VERSION, _FORMATS.index(self.fmt), kinds, layers, tokens, hidden, start,
                                    self.calibration_id, _xxh3(body), 0))
        struct.pack_into("<Q", head, _HEAD.size - 8, _xxh3(memoryview(head)[: _HEAD.size - 8]))
        return bytes(head) + body

    def decode(self, data: bytes) -> torch.Tensor:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgumentError(f"a compact KV chunk is bytes, not {type(data).__name__}")
        if len(data) < _HEAD_V1.size:
            raise TruncatedError(f"compact chunk of {len(data)} bytes")
        magic, version, fi, kinds, layers, tokens, hidden = _HEAD_V1.unpack_from(data)
        if magic != MAGIC:
            raise CorruptDataError("not a compact KV chunk (magic)")
        if version not in PAGE_VERSIONS:
            raise UnsupportedVersionError(f"compact KV chunk version {version} (this reads 1-{VERSION})")
        if data[6:8] != b"\0\0":
            raise CorruptDataError(f"compact KV chunk header: pad bytes 6-7 are {bytes(data[6:8]).hex()}, not zero")
        head = _head_struct(version)
        if len(data) < head.size:
            raise TruncatedError(f"compact chunk of {len(data)} bytes")
        view = memoryview(data).cast("B")
        fields = head.unpack_from(data)
        if version >= 5:
            # every other header field is believed only once its checksum matches
            if _xxh3(view[: head.size - 8]) != fields[-1]:
                raise ChecksumMismatchError("compact KV chunk header checksum")
        start = 0 if version == 1 else fields[7]  # (the same place in the headers of versions 2-6)
        page_version = PAGE_VERSIONS[version]
        if start + tokens > cc.POSITION_MAX:
            raise CorruptDataError(f"chunk positions {start}..{start + tokens} exceed 2**31")
        if fi >= len(_FORMATS):
            raise CorruptDataError(f"compact KV chunk of format index {fi} (formats 0-{len(_FORMATS) - 1})")
        if _FORMATS[fi] != self.fmt:
            raise CorruptDataError(f"chunk is {_FORMATS[fi]}, this codec decodes {self.fmt}")
        if version >= 6 and fields[-3] != self.calibration_id:
            raise CorruptDataError(f"chunk was coded with calibration {fields[-3]:016x}, this codec's is "
                                   f"{self.calibration_id:016x} (another model's, or a calibration made again): "
                                   "its codes would decode to other values")
        pages = self._check(kinds, layers, tokens, hidden, CorruptDataError)
        want = self.max_encoded_size((kinds, layers, tokens, hidden)) - _HEAD.size + head.size
        if len(data) != want:
            raise TruncatedError(f"compact chunk has {len(data)} bytes, its header implies {want}")
        if version >= 5 and _xxh3(view[head.size:]) != fields[-2]:
            raise ChecksumMismatchError("compact KV chunk pages checksum")
        positions = torch.arange(start, start + tokens)
        heads, d = self.cal.kv_heads, self.cal.head_dim
        buf = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        out = torch.empty(kinds, layers, tokens, hidden, dtype=torch.bfloat16)
        pos = head.size
        for ki, kind in enumerate("kv"):
            for layer in range(layers):
                bits = self._bits(layer, ki)
                tables = self.cal.tables(layer, kind, bits)
                n = cc.page_bytes(bits, d)
                codes = torch.empty(tokens, heads, d, dtype=torch.uint8)
                sidx = torch.empty(tokens, heads, dtype=torch.uint8)
                for h in range(heads):
                    for p in range(pages):
                        c, s = cc.unpack_page(buf[pos : pos + n], bits, d, page_version)
                        sl = slice(p * cc.PAGE_TOKENS, (p + 1) * cc.PAGE_TOKENS)
                        codes[sl, h], sidx[sl, h] = c, s
                        pos += n
                x = cc.inverse(cc.dequantize(codes, sidx, tables), tables, positions)
                out[ki, layer] = x.reshape(tokens, hidden).to(torch.bfloat16)
        return out
