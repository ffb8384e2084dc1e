"""Whole files: any file is restored byte for byte; safetensors, GGUF and .npy get tensor-aware
coding of their float tensors, everything else (headers, quantized blocks, padding) is coded as
bytes. The file is described as segments that cover it exactly, in order; the Rust core streams
it through with bounded memory."""

from __future__ import annotations

import json
import math
import os
import stat
import struct
from collections.abc import Callable
from typing import Any

import numpy as np

from weightszip import _core
from weightszip._tensors import (
    LAYOUT_FILE_BYTES,
    LAYOUT_TENSOR,
    _NAME_TO_NP,
    check_chunk_bytes,
    check_level,
    check_output,
    check_path,
    threads_default,
)
from weightszip.errors import InvalidArgumentError, WeightszipIOError

Segment = tuple  # (name, dtype name, shape, channel axis, layout, flags)

_SAFETENSORS_DTYPES = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "I8": "int8",
    "I16": "int16",
    "I32": "int32",
    "I64": "int64",
    "U8": "uint8",
    "U16": "uint16",
    "U32": "uint32",
    "U64": "uint64",
    "BOOL": "bool",
}
_TO_SAFETENSORS = {v: k for k, v in _SAFETENSORS_DTYPES.items()}
# GGUF (ggml) tensor types that hold plain floats; quantized block types are coded as bytes.
_GGML_FLOATS = {0: "float32", 1: "float16", 30: "bfloat16"}
# ggml quantized types: (bytes per block). Coding their bytes with the block as the row lets the
# coder use "same byte of the previous block" as context (the scales sit at fixed offsets).
_GGML_BLOCK_BYTES = {2: 18, 3: 20, 6: 22, 7: 24, 8: 34, 9: 36, 10: 84, 11: 110, 12: 144, 13: 176, 14: 210, 15: 292}
_SIZES = {name: np.dtype(dt).itemsize for name, dt in _NAME_TO_NP.items()}
# The container's limits (rust/core/src/format.rs): a segment beyond them stays plain bytes, and a
# file that would need more entries is coded as one byte segment, so that any file compresses.
_MAX_NAME_LEN, _MAX_NDIM, _MAX_DIM, _MAX_ENTRIES = 4096, 16, 1 << 50, 1 << 20


def _count(shape) -> int | None:
    """Elements of `shape` (exact, no wrap-around), or None if it is not a list of at most
    _MAX_NDIM sizes (a longer one could not be a segment, and its product could take long)."""
    if not isinstance(shape, list) or len(shape) > _MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
        return None
    return math.prod(shape)


def _fits(seg: Segment) -> bool:
    """Whether the container can hold `seg` as it is (its name, dimensions)."""
    try:
        name_len = len(seg[0].encode())
    except UnicodeEncodeError:
        return False
    shape = seg[2]
    return name_len <= _MAX_NAME_LEN and len(shape) <= _MAX_NDIM and all(0 <= d <= _MAX_DIM for d in shape)


def _bytes_segment(name: str, n: int) -> Segment:
    return (name, "uint8", [n], 0, LAYOUT_FILE_BYTES, 0)


def _tensor_segment(name: str, dtype: str, shape: list[int]) -> Segment:
    return (name, dtype, list(shape), max(len(shape) - 1, 0), LAYOUT_TENSOR, 0)


def _cover(extents: list[tuple[int, int, Segment]], size: int) -> list[Segment]:
    """Turn (start, end, segment) tensor extents into segments covering [0, size), filling gaps
    with byte segments. Overlapping or out-of-file extents are dropped (their bytes stay bytes)."""
    segs: list[Segment] = []
    pos = 0
    for start, end, seg in sorted(extents, key=lambda e: e[0]):
        if start < pos or end > size or end <= start:
            continue
        if start > pos:
            segs.append(_bytes_segment("", start - pos))
        segs.append(seg if _fits(seg) else _bytes_segment("", end - start))
        pos = end
    if pos < size:
        segs.append(_bytes_segment("", size - pos))
    if len(segs) > _MAX_ENTRIES:
        return [_bytes_segment("", size)]
    return segs


def _safetensors_segments(f, size: int) -> list[Segment] | None:
    head = f.read(8)
    if len(head) < 8:
        return None
    (n,) = struct.unpack("<Q", head)
    if n == 0 or n > min(size - 8, 100 << 20):
        return None
    try:
        header = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if not isinstance(header, dict):
        return None
    base = 8 + n
    extents = [(0, base, _bytes_segment("__header__", base))]
    for name, t in header.items():
        if name == "__metadata__" or not isinstance(t, dict):
            continue
        dtype = t.get("dtype")
        dtype = _SAFETENSORS_DTYPES.get(dtype) if isinstance(dtype, str) else None
        shape, offs = t.get("shape"), t.get("data_offsets")
        count = _count(shape)
        if (dtype is None or count is None or not isinstance(offs, list) or len(offs) != 2
                or not all(type(o) is int and o >= 0 for o in offs)):
            continue
        start, end = base + offs[0], base + offs[1]
        if end - start != count * _SIZES[dtype]:
            continue
        extents.append((start, end, _tensor_segment(name, dtype, shape)))
    return _cover(extents, size)


class _GGUFReader:
    def __init__(self, f, size: int):
        self.f, self.size = f, size

    def read(self, fmt: str):
        n = struct.calcsize("<" + fmt)
        b = self.f.read(n)
        if len(b) != n:
            raise ValueError("truncated GGUF header")
        return struct.unpack("<" + fmt, b)

    def string(self) -> str:
        (n,) = self.read("Q")
        if n > 1 << 24:
            raise ValueError("GGUF string too long")
        b = self.f.read(n)
        if len(b) != n:
            raise ValueError("truncated GGUF string")
        return b.decode("utf-8", errors="replace")

    _SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

    def value(self, vtype: int, depth: int = 0):
        if vtype in self._SCALARS:
            return self.read(self._SCALARS[vtype])[0]
        if vtype == 8:
            return self.string()
        if vtype == 9 and depth < 4:
            (etype,) = self.read("I")
            (count,) = self.read("Q")
            if count > self.size:
                raise ValueError("GGUF array longer than the file")
            if etype in self._SCALARS:
                width = struct.calcsize("<" + self._SCALARS[etype])
                self.f.seek(count * width, os.SEEK_CUR)
                return None
            return [self.value(etype, depth + 1) for _ in range(count)]
        raise ValueError(f"unknown GGUF value type {vtype}")


def _gguf_segments(f, size: int) -> list[Segment] | None:
    r = _GGUFReader(f, size)
    try:
        magic = f.read(4)
        if magic != b"GGUF":
            return None
        (version,) = r.read("I")
        if version not in (2, 3):
            return None
        n_tensors, n_kv = r.read("QQ")
        if n_tensors > 1 << 20 or n_kv > 1 << 20:
            return None
        alignment = 32
        for _ in range(n_kv):
            key = r.string()
            (vtype,) = r.read("I")
            v = r.value(vtype)
            if key == "general.alignment" and isinstance(v, int) and v > 0:
                alignment = v
        infos = []
        for _ in range(n_tensors):
            name = r.string()
            (nd,) = r.read("I")
            if nd > 8:
                return None
            dims = list(r.read("Q" * nd)) if nd else []
            gtype, offset = r.read("IQ")
            infos.append((name, dims, gtype, offset))
        data = -(-f.tell() // alignment) * alignment
    except (ValueError, struct.error):
        return None
    extents = [(0, data, _bytes_segment("__header__", data))]
    ordered = sorted(infos, key=lambda t: t[3])
    for i, (name, dims, gtype, offset) in enumerate(ordered):
        start = data + offset
        end = data + ordered[i + 1][3] if i + 1 < len(ordered) else size
        shape = list(reversed(dims))  # ggml's ne[0] varies fastest: numpy order is reversed
        if gtype in _GGML_FLOATS:
            dtype = _GGML_FLOATS[gtype]
            n = math.prod(shape) * _SIZES[dtype]
            if start + n <= end:
                extents.append((start, start + n, _tensor_segment(name, dtype, shape)))
                continue
        block = _GGML_BLOCK_BYTES.get(gtype)
        if block and shape and (math.prod(shape) // 256 * 256) and (end - start) % block == 0:
            n_blocks = (end - start) // block
            extents.append((start, end, (name, "uint8", [n_blocks, block], 1, LAYOUT_FILE_BYTES, 0)))
            continue
        extents.append((start, end, _bytes_segment(name, end - start)))
    return _cover(extents, size)


def _npy_segments(f, size: int) -> list[Segment] | None:
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    except Exception:  # noqa: BLE001 - numpy parses the header dict with ast (SyntaxError, TypeError,
        # tokenize.TokenError, ... on hostile bytes): a file that is not a valid .npy is compressed as bytes
        return None
    start = f.tell()
    name = {np.dtype(v): k for k, v in _NAME_TO_NP.items()}.get(np.dtype(dtype).newbyteorder("="))
    if fortran or name is None or np.dtype(dtype).byteorder == ">":
        return None
    n = math.prod(shape) * _SIZES[name]
    if start + n > size:
        return None
    return _cover([(0, start, _bytes_segment("__header__", start)), (start, start + n, _tensor_segment("", name, list(shape)))], size)


def check_regular_file(path: str | os.PathLike) -> None:
    """``path``, where it exists, must be a regular file: a FIFO or device has no size and would block
    or never end a read, a directory is not a file (InvalidArgumentError). A missing or unreadable
    one is left to the reader, which reports it (WeightszipIOError naming it)."""
    check_path(path)
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if not stat.S_ISREG(mode):
        raise InvalidArgumentError(f"{os.fspath(path)} is not a regular file")


def _io_error(path, e: OSError) -> WeightszipIOError:
    """A Python-side I/O error as the core reports its own: WeightszipIOError naming the file."""
    return WeightszipIOError(f"I/O error: {os.fspath(path)}: {e.strerror or e}")


def same_file(a: str | os.PathLike, b: str | os.PathLike) -> bool:
    """Whether paths `a` and `b` name one existing file (through symbolic or hard links, `..`)."""
    try:
        return os.path.samefile(a, b)
    except (OSError, ValueError):  # (one of them does not exist, or cannot be looked at: nothing to lose)
        return False


def _refuse_input_as_output(src, dst) -> None:
    """The writers never replace their input: `dst` naming `src` (or a link to it) is refused."""
    if same_file(src, dst):
        raise InvalidArgumentError(f"{os.fspath(dst)}: is the input file {os.fspath(src)}; not overwritten")


def _mode_of(path) -> int:
    """The permission bits of the input file `path`, which its output gets (as gzip and zstd do)."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except OSError as e:
        raise _io_error(path, e) from e


def file_segments(path: str | os.PathLike) -> tuple[str, list[Segment]]:
    """Describe a file as segments: ('safetensors' | 'gguf' | 'npy' | 'bytes', segments). A file
    that cannot be read is a WeightszipIOError naming it."""
    check_regular_file(path)
    try:
        size = os.path.getsize(path)
        f = open(path, "rb")
    except OSError as e:
        raise _io_error(path, e) from e
    with f:
        if size == 0 and f.read(1):  # /proc and /sys files report 0 bytes and then have data
            raise InvalidArgumentError(f"{os.fspath(path)} reports 0 bytes but has data (a /proc or /sys file?): "
                                       "copy it to a regular file first")
        for kind, parse in (("gguf", _gguf_segments), ("npy", _npy_segments), ("safetensors", _safetensors_segments)):
            f.seek(0)
            segs = parse(f, size)
            if segs is not None:
                return kind, segs
    return "bytes", ([_bytes_segment("", size)] if size else [])


def compress_file(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    chunk_bytes: int = _core.DEFAULT_CHUNK_BYTES,
    threads: int | None = None,
    progress: Callable[[int, int], Any] | None = None,
    overwrite: bool = True,
    level: int = _core.DEFAULT_LEVEL,
) -> dict:
    """Compress any file to a .wz container (written atomically); returns its index. `level`: 1
    (fast) or 2 (the default), as `weightszip.compress`'s. With
    `overwrite=False` an existing `dst` is left as it is and `OutputExistsError` raised, even if it
    was created while the container was being written. `dst` naming `src` itself (or a link to it)
    is refused (InvalidArgumentError), whatever `overwrite` says, and so is a `dst` that exists and is
    no regular file (a device such as /dev/null, a FIFO: the new file would replace it, not be
    written into it). The output gets the permission
    bits of `src` (as gzip and zstd do), or with `overwrite` those of the file it replaces.

    `progress(done, total)` is called as the work goes; an ordinary exception it raises is printed
    and the work goes on, but a KeyboardInterrupt (or other exception that is not an `Exception`),
    or one raised by a signal handler meanwhile (Ctrl-C), stops it: no output and no temporary file
    are left, and the exception is raised."""
    _, segs = file_segments(src)
    _refuse_input_as_output(src, dst)
    return _core.encode_file(
        os.fspath(src), check_output(dst, overwrite), segs, check_chunk_bytes(chunk_bytes), threads_default(threads),
        _core.DEFAULT_LANES_LOG2, progress, overwrite=overwrite, mode=_mode_of(src), level=check_level(level),
    )


def decompress_file(
    src: str | os.PathLike,
    dst: str | os.PathLike,
    *,
    threads: int | None = None,
    progress: Callable[[int, int], Any] | None = None,
    overwrite: bool = True,
) -> dict:
    """Restore the original file from a .wz made by `compress_file`, byte for byte. A container of
    named tensors (from `save_file`) is written out as a .safetensors file. Both stream with bounded
    memory, whatever the size of a tensor. `overwrite`, the input as output, the permission bits and
    `progress` as for `compress_file`."""
    check_regular_file(src)
    _refuse_input_as_output(src, dst)
    # (the header from the index the core read through the file it decodes: one read earlier could
    # describe another version of a file replaced meanwhile)
    return _core.decode_file(os.fspath(src), check_output(dst, overwrite), threads_default(threads), progress, overwrite=overwrite,
                             prefix=_safetensors_header, mode=_mode_of(src))


def _safetensors_header(index: dict) -> bytes:
    """The header (length and JSON) of the .safetensors file that holds a container of named tensors:
    the entries' bytes in order are its data section (each tensor's offsets are the sums of the raw
    sizes before it), so that the core's streaming decoder writes the file as this prefix, then the
    entries. Nothing for a container of a file (kind 1: the entries are the file)."""
    if index["kind"] == 1:
        return b""
    header, offset = {}, 0
    for e in index["entries"]:
        # (the container allows any names; a safetensors header is a JSON object of unique names,
        # "__metadata__" reserved: refuse what it cannot hold instead of writing a broken file)
        if e["name"] in header or e["name"] == "__metadata__":
            raise InvalidArgumentError(f"tensor name {e['name']!r} twice or reserved: the container cannot be "
                                       "written as a .safetensors file")
        header[e["name"]] = {
            "dtype": _TO_SAFETENSORS[e["dtype"]],
            "shape": e["shape"],
            "data_offsets": [offset, offset + e["raw_bytes"]],
        }
        offset += e["raw_bytes"]
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h


def file_info(path: str | os.PathLike) -> dict:
    """The checked index of a .wz file (entries, sizes) without decoding any chunk."""
    check_regular_file(path)
    return _core.file_index(os.fspath(path))


def verify_file(path: str | os.PathLike, *, threads: int | None = None, progress=None) -> dict:
    """Decode every chunk of a .wz file and check every checksum (nothing is written). `progress` as
    for `compress_file` (an interrupt stops it and is raised)."""
    check_regular_file(path)
    return _core.decode_file(os.fspath(path), None, threads_default(threads), progress)

