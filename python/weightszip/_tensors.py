"""Tensors in and out of the codec: numpy arrays and CPU torch tensors, zero-copy in."""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Mapping
from typing import Any

import ml_dtypes
import numpy as np

from weightszip import _core
from weightszip.errors import InvalidArgumentError, LimitExceededError

FLAG_TORCH = 1
LAYOUT_TENSOR = 0
LAYOUT_FILE_BYTES = 1
LAYOUT_KV = 2
# the most bytes one tensor may hold (docs/FORMAT.md; rust/core/src/format.rs MAX_TENSOR_BYTES)
_MAX_TENSOR_BYTES = 1 << 50

# numpy dtype -> container dtype name (the names numpy / torch users know).
_NP_TO_NAME: dict[np.dtype, str] = {
    np.dtype(np.uint8): "uint8",
    np.dtype(ml_dtypes.bfloat16): "bfloat16",
    np.dtype(np.float16): "float16",
    np.dtype(np.float32): "float32",
    np.dtype(ml_dtypes.float8_e4m3fn): "float8_e4m3fn",
    np.dtype(ml_dtypes.float8_e5m2): "float8_e5m2",
    np.dtype(np.float64): "float64",
    np.dtype(np.int8): "int8",
    np.dtype(np.int16): "int16",
    np.dtype(np.int32): "int32",
    np.dtype(np.int64): "int64",
    np.dtype(np.uint16): "uint16",
    np.dtype(np.uint32): "uint32",
    np.dtype(np.uint64): "uint64",
    np.dtype(np.bool_): "bool",
}
_NAME_TO_NP = {v: k for k, v in _NP_TO_NAME.items()}


def _torch(load: bool = False):
    """torch if the caller already imported it (a torch tensor can only come from there), or if
    `load` asks for it; importing torch takes seconds, and numpy users should not pay that."""
    import sys

    if "torch" in sys.modules or load:
        try:
            import torch
        except ImportError:  # pragma: no cover - exercised only without torch
            return None
        return torch
    return None


def _torch_maps():
    torch = _torch(load=True)
    if torch is None:
        return {}, {}
    to_name = {
        torch.uint8: "uint8",
        torch.bfloat16: "bfloat16",
        torch.float16: "float16",
        torch.float32: "float32",
        torch.float8_e4m3fn: "float8_e4m3fn",
        torch.float8_e5m2: "float8_e5m2",
        torch.float64: "float64",
        torch.int8: "int8",
        torch.int16: "int16",
        torch.int32: "int32",
        torch.int64: "int64",
        torch.bool: "bool",
    }
    for name in ("uint16", "uint32", "uint64"):
        if hasattr(torch, name):
            to_name[getattr(torch, name)] = name
    return to_name, {v: k for k, v in to_name.items()}


def threads_default(threads: int | None) -> int:
    """0 lets the core use one thread per core; `WEIGHTSZIP_THREADS` overrides the default. A count
    above the core's cap (`MAX_THREADS`, 256) is taken as the cap, as the core itself does."""
    if threads is None:
        text = os.environ.get("WEIGHTSZIP_THREADS", "0")
        try:
            threads = int(text)
        except ValueError:
            raise InvalidArgumentError(f"WEIGHTSZIP_THREADS={text!r} is not an integer") from None
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 0:
        raise InvalidArgumentError(f"threads must be an integer >= 0 (0: one per core), got {threads!r}")
    return min(int(threads), _core.MAX_THREADS)


def check_path(path: str | os.PathLike) -> str:
    """`os.fspath(path)`, a name the operating system can take: one the file system encoding cannot
    encode (a lone surrogate) or that holds a NUL byte is InvalidArgumentError (the core's path
    conversion panicked on the first)."""
    p = os.fspath(path)
    try:
        b = os.fsencode(p)
    except UnicodeEncodeError:
        raise InvalidArgumentError(f"{p!r}: not a usable file name (a lone surrogate)") from None
    if b"\0" in b:
        raise InvalidArgumentError(f"{p!r}: a file name cannot hold a NUL byte")
    return p


def check_output(path: str | os.PathLike, overwrite: Any) -> str:
    """An output path (`check_path`) and the ``overwrite`` flag (a bool). The writers put a new file
    in place of the old by a rename, so an existing output that is no regular file (a device such as
    /dev/null, a FIFO, a socket) is refused: it would be replaced, not written into."""
    if not isinstance(overwrite, bool):
        raise InvalidArgumentError(f"overwrite must be a bool, got {overwrite!r}")
    p = check_path(path)
    try:
        st = os.stat(p)
    except OSError:
        return p  # (absent, or not reachable: the core's own open says why)
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):  # (a directory: the core's error)
        raise InvalidArgumentError(f"{p}: the output exists and is not a regular file (a device, FIFO or "
                                   "socket): it would be replaced by a file, not written into")
    return p


def check_level(level: int) -> int:
    """The encoder level: 1 (fewer candidate models per chunk) or 2 (the default: every candidate
    ranked on a sample of each chunk). Readers do not care which made a container."""
    return int_arg("level", level, _core.LEVEL_FAST, _core.DEFAULT_LEVEL)


def check_chunk_bytes(chunk_bytes: int) -> int:
    """`chunk_bytes` as the core takes it (a u64; the core checks the rest of the range: at least 1,
    at most its limit)."""
    return int_arg("chunk_bytes", chunk_bytes, 0, 2**64 - 1)


def check_name(name: Any) -> str:
    """A tensor name the container can hold: a str that is valid UTF-8 (no lone surrogates)."""
    if not isinstance(name, str):
        raise InvalidArgumentError(f"tensor names must be str, got {type(name).__name__}")
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidArgumentError(f"tensor name {name!r} is not valid UTF-8 (a lone surrogate)") from None
    return name


class _Buffer:
    """A contiguous CPU buffer: its address, length, and the object that keeps it alive."""

    __slots__ = ("addr", "nbytes", "owner", "dtype", "shape", "flags")

    def __init__(self, addr: int, nbytes: int, owner: Any, dtype: str, shape: tuple[int, ...], flags: int):
        self.addr, self.nbytes, self.owner = addr, nbytes, owner
        self.dtype, self.shape, self.flags = dtype, shape, flags


def _check_size(shape: tuple, itemsize: int) -> None:
    """A view (broadcast, expanded, strided) is copied to contiguous memory before coding: its
    contiguous size is checked against the format's limit first, so that a view of petabytes is
    LimitExceededError, not an attempt to allocate them."""
    n = itemsize
    for d in shape:
        n *= int(d)
    if n > _MAX_TENSOR_BYTES:
        raise LimitExceededError(f"a tensor of shape {tuple(shape)} is {n} bytes (limit {_MAX_TENSOR_BYTES})")


@contextlib.contextmanager
def _fits_in_memory(message: str):
    """An allocation that does not fit in memory: LimitExceededError(``message``), not numpy's
    MemoryError or torch's RuntimeError (its allocator says so with one)."""
    try:
        yield
    except MemoryError:
        raise LimitExceededError(message) from None
    except RuntimeError as e:
        if "can't allocate memory" not in str(e) and "out of memory" not in str(e):
            raise
        raise LimitExceededError(f"{message}: {e}") from None


def no_overlap(t: Any) -> bool:
    """Whether no two elements of the tensor ``t`` share memory (each dimension's stride, smallest
    first, at least the extent of the ones below it): an expanded or otherwise aliased view fails.
    (Sufficient, not necessary: an interleaved layout that does not alias can fail too.)"""
    extent = 1
    for stride, size in sorted((t.stride(i), t.size(i)) for i in range(t.dim()) if t.size(i) > 1):
        if stride < extent:
            return False
        extent = stride * size
    return True


def check_dense(x: Any) -> None:
    """A torch tensor with dense bytes to read, or InvalidArgumentError: a sparse or meta tensor has
    none (torch would raise its own error, a RuntimeError or NotImplementedError, on reading one)."""
    torch = _torch()
    if x.layout != torch.strided or x.device.type == "meta":
        raise InvalidArgumentError(f"expected a dense tensor with data, got layout {x.layout} on {x.device}")


def as_buffer(x: Any) -> _Buffer:
    """Zero-copy view of a numpy array or torch tensor (copied only when not contiguous or not on
    the CPU)."""
    torch = _torch()
    if torch is not None and isinstance(x, torch.Tensor):
        to_name, _ = _torch_maps()
        if x.dtype not in to_name:
            raise InvalidArgumentError(f"unsupported torch dtype {x.dtype}")
        check_dense(x)
        _check_size(tuple(x.shape), x.element_size())
        t = x.detach()
        with _fits_in_memory(f"a contiguous copy of the {x.dtype} view of shape {tuple(x.shape)} does not fit in memory"):
            if t.device.type != "cpu":
                t = t.cpu()
            # a lazy negation or conjugation (``c.conj().imag``) is a flag beside the storage: applied
            # here, or the stored bytes would be the un-negated values (contiguous() keeps the flag)
            t = t.resolve_neg().resolve_conj().contiguous()
        return _Buffer(t.data_ptr(), t.numel() * t.element_size(), t, to_name[x.dtype], tuple(t.shape), FLAG_TORCH)
    if isinstance(x, (np.ndarray, np.generic)):
        a = np.asarray(x)
        if a.dtype not in _NP_TO_NAME:
            raise InvalidArgumentError(f"unsupported numpy dtype {a.dtype}")
        if not a.flags.c_contiguous:
            _check_size(a.shape, a.dtype.itemsize)
            with _fits_in_memory(f"a contiguous copy of the {a.dtype} view of shape {a.shape} does not fit in memory"):
                a = a.copy(order="C")  # np.ascontiguousarray would turn a 0-d array into 1-d
        return _Buffer(a.ctypes.data, a.nbytes, a, _NP_TO_NAME[a.dtype], tuple(a.shape), 0)
    raise InvalidArgumentError(f"expected a numpy array or a torch tensor, got {type(x).__name__}")


def bytes_buffer(b: Any) -> tuple[int, int, Any]:
    """Address and length of a bytes-like object (bytes, bytearray, memoryview, uint8 array)."""
    if isinstance(b, np.ndarray):
        if b.dtype.hasobject:  # (pointers, not data)
            raise InvalidArgumentError(f"expected bytes-like input, got an array of {b.dtype}")
        a = np.ascontiguousarray(b.reshape(-1)).view(np.uint8)
    else:
        try:
            a = np.frombuffer(b, dtype=np.uint8)
        except (TypeError, ValueError, BufferError) as e:  # BufferError: a memoryview with strides
            raise InvalidArgumentError(f"expected contiguous bytes-like input, got {type(b).__name__}: {e}") from e
    return a.ctypes.data, a.nbytes, a


def int_arg(name: str, value: Any, lo: int, hi: int) -> int:
    """``value`` as an int in [lo, hi], else InvalidArgumentError (the Rust functions take unsigned
    integers: a value outside their type was an OverflowError from the conversion)."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
        raise InvalidArgumentError(f"{name} must be an integer from {lo} to {hi}, got {value!r}")
    return int(value)


def normalize_axis(axis: int, ndim: int) -> int:
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise InvalidArgumentError(f"axis must be an integer, got {axis!r}")
    if ndim == 0:
        return 0
    if not -ndim <= axis < ndim:
        raise InvalidArgumentError(f"axis {axis} out of range for a {ndim}-d tensor")
    return axis % ndim


#: The layout tags a writer may put in an entry (docs/FORMAT.md): a reader refuses any other.
LAYOUTS = (LAYOUT_TENSOR, LAYOUT_FILE_BYTES, LAYOUT_KV)


def meta_tuple(buf: _Buffer, name: str, axis: int, layout: int) -> tuple:
    if isinstance(layout, bool) or layout not in LAYOUTS:
        raise InvalidArgumentError(f"layout must be one of {LAYOUTS} (tensor, file bytes, KV), got {layout!r}")
    return (name, buf.dtype, list(buf.shape), normalize_axis(axis, len(buf.shape)), layout, buf.flags)


def empty_like_entry(entry: Mapping[str, Any], out: str | None):
    """Allocate the array an entry decodes into: torch when asked for (or when it came from torch),
    numpy otherwise. Returns (array, address). A tensor that does not fit in memory (a container's
    declared size can be far larger than its bytes: zeros compress very well) is LimitExceededError,
    not MemoryError."""
    with _fits_in_memory(f"tensor {entry['name']!r}: {entry['raw_bytes']} bytes do not fit in memory "
                         "(`weightszip decompress` writes a container to a file with bounded memory)"):
        return _empty_like_entry(entry, out)


def _empty_like_entry(entry: Mapping[str, Any], out: str | None):
    want_torch = out == "torch" or (out is None and entry["flags"] & FLAG_TORCH and _torch(load=True) is not None)
    if out not in (None, "torch", "numpy"):
        raise InvalidArgumentError(f"out must be None, 'numpy' or 'torch', not {out!r}")
    shape = tuple(entry["shape"])
    if want_torch:
        torch = _torch(load=True)
        if torch is None:
            raise InvalidArgumentError("out='torch' needs torch installed (pip install weightszip[torch])")
        _, from_name = _torch_maps()
        if entry["dtype"] not in from_name:
            raise InvalidArgumentError(f"torch has no dtype {entry['dtype']}")
        t = torch.empty(shape, dtype=from_name[entry["dtype"]])
        return t, t.data_ptr()
    a = np.empty(shape, dtype=_NAME_TO_NP[entry["dtype"]])
    return a, a.ctypes.data


def compress(
    x: Any,
    *,
    axis: int = -1,
    chunk_bytes: int = _core.DEFAULT_CHUNK_BYTES,
    threads: int | None = None,
    lanes_log2: int = _core.DEFAULT_LANES_LOG2,
    layout: int = LAYOUT_TENSOR,
    level: int = _core.DEFAULT_LEVEL,
) -> bytes:
    """Compress a numpy array or CPU torch tensor losslessly; returns a weightszip container.

    `axis` is the channel axis: the exponent of each value is coded in the context of the value
    one step back along the axis before it (for KV laid out [..., tokens, channels], the same
    channel one token earlier). Any dtype round-trips; bf16, fp16, fp32 and fp8 are modelled.
    `level=1` chooses each chunk's model among fewer candidates: on real bf16 KV 1.2-1.3x faster to
    encode (1.4-1.7x on 256-token LMCache chunks) for 0-0.16% more bytes, no faster on fp8 or small
    tensors; decoding is the same.

    >>> import numpy as np, weightszip
    >>> x = np.linspace(-3, 3, 4096, dtype=np.float32).reshape(64, 64)
    >>> bool((weightszip.decompress(weightszip.compress(x)) == x).all())
    True
    """
    buf = as_buffer(x)
    return _core.compress_buffers(
        [(meta_tuple(buf, "", axis, layout), buf.addr, buf.nbytes)],
        0,
        check_chunk_bytes(chunk_bytes),
        threads_default(threads),
        int_arg("lanes_log2", lanes_log2, 0, 2**32 - 1),
        check_level(level),
    )


def decompress(data: Any, *, out: str | None = None, threads: int | None = None):
    """Decompress a container made by `compress`: the same dtype, shape and bytes.

    Returns a torch tensor when the input was one (or `out='torch'`), else a numpy array (bf16 and
    fp8 as `ml_dtypes` types).
    """
    addr, n, keep = bytes_buffer(data)
    index = _core.buffer_index(addr, n)
    if len(index["entries"]) != 1:
        raise InvalidArgumentError(
            f"container holds {len(index['entries'])} entries; use load_file for archives"
        )
    arr, out_addr = empty_like_entry(index["entries"][0], out)
    _core.decode_buffer_entry(addr, n, 0, out_addr, index["entries"][0]["raw_bytes"], threads_default(threads))
    del keep
    return arr


def info(data: Any) -> dict:
    """The parsed index of an in-memory container (entries with dtype, shape, sizes)."""
    addr, n, _keep = bytes_buffer(data)
    return _core.buffer_index(addr, n)


def verify(data: Any, *, threads: int | None = None) -> None:
    """Decode every chunk and check every checksum; raises a `WeightszipError` on any damage."""
    addr, n, _keep = bytes_buffer(data)
    _core.verify_buffer(addr, n, threads_default(threads))


def save_file(
    tensors: Mapping[str, Any],
    path: str | os.PathLike,
    *,
    axis: int | Mapping[str, int] = -1,
    chunk_bytes: int = _core.DEFAULT_CHUNK_BYTES,
    threads: int | None = None,
    overwrite: bool = True,
    level: int = _core.DEFAULT_LEVEL,
) -> None:
    """Save a dict of named tensors to a .wz file (written atomically), like safetensors. With
    `overwrite=False` an existing `path` is left as it is and `OutputExistsError` raised, even if
    it was created while the file was being written; an existing `path` that is no regular file (a
    device, a FIFO) is refused (InvalidArgumentError). `level`: as `compress`'s."""
    bufs = []
    for name, x in tensors.items():
        check_name(name)
        ax = axis.get(name, -1) if isinstance(axis, Mapping) else axis
        bufs.append((name, as_buffer(x), ax))
    _core.save_buffers(
        check_output(path, overwrite),
        [(meta_tuple(b, name, ax, LAYOUT_TENSOR), b.addr, b.nbytes) for name, b, ax in bufs],
        check_chunk_bytes(chunk_bytes),
        threads_default(threads),
        _core.DEFAULT_LANES_LOG2,
        overwrite=overwrite,
        level=check_level(level),
    )


def load_file(path: str | os.PathLike, *, out: str | None = None, threads: int | None = None) -> dict:
    """Load every tensor of a .wz file into a dict (numpy, or torch for tensors saved from torch). A
    container whose entries share a name (the format allows it) cannot be a dict without losing one:
    InvalidArgumentError, before anything is decoded."""
    from weightszip.files import check_regular_file

    p = check_path(path)
    check_regular_file(p)
    result = {}

    def alloc(index):  # the index of the file the core opened once (a file replaced meanwhile: one version)
        seen: set[str] = set()
        for e in index["entries"]:  # one pass: up to 2**20 entries
            if e["name"] in seen:
                raise InvalidArgumentError(f"{p}: tensor name {e['name']!r} twice: a dict of the tensors would "
                                           "lose one of them")
            seen.add(e["name"])
        outs = []
        for e in index["entries"]:
            arr, addr = empty_like_entry(e, out)
            result[e["name"]] = arr
            outs.append((addr, e["raw_bytes"]))
        return outs

    _core.decode_file_entries(p, alloc, threads_default(threads))
    return result
