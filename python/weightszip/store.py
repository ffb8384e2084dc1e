"""A chunk store for KV cache chunks: keys to compressed chunks in a RAM tier (byte budget, LRU)
that evicts into a disk tier of atomic, checksummed files. The store is Rust (crate
weightszip-store); every call releases the GIL, and batched calls run on its I/O thread pool.

    >>> import numpy as np, tempfile, weightszip.store as ws
    >>> kv = np.random.default_rng(0).standard_normal((2, 4, 256, 64)).astype(np.float16)
    >>> with tempfile.TemporaryDirectory() as d, ws.ChunkStore(d, ram_bytes=1 << 20) as store:
    ...     n = store.put_tensor("prefix-hash-0", kv)      # exact codec, in Rust, off the GIL
    ...     back = store.get_tensor("prefix-hash-0")
    ...     bool((back == kv).all()), n < kv.nbytes
    (True, True)

Chunks are opaque bytes with a tag saying what they are: `TAG_RAW` (any bytes), `TAG_CONTAINER`
(a weightszip container, made by `put_tensor`), or the tag of a `ChunkCodec` registered with
`register_codec` (compact formats plug in there). A tag whose low byte is below `FIRST_CODEC_TAG`
is that kind of the store's whatever its upper 24 bits, which are the writer's own note (`tag_kind`).
docs/STORE.md describes the files on disk and what survives a crash.
"""

from __future__ import annotations

import logging
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from weightszip import _core
from weightszip._tensors import as_buffer, bytes_buffer, check_level, check_path, decompress, meta_tuple, LAYOUT_TENSOR
from weightszip.errors import CorruptDataError, InvalidArgumentError, WeightszipError, WeightszipIOError

logger = logging.getLogger(__name__)

TAG_RAW = 0
TAG_CONTAINER = _core.STORE_TAG_CONTAINER
#: Tags below this are the store's own; registered codecs use tags from here on.
FIRST_CODEC_TAG = 16


def tag_kind(tag: int) -> int:
    """What a chunk of `tag` is: `TAG_RAW`, `TAG_CONTAINER` (or another of the store's kinds) when
    the tag's low byte is below `FIRST_CODEC_TAG`, its upper 24 bits being the writer's own note
    (the LMCache connector keeps LMCache's memory format there, so that it allocates the same kind
    of memory object on get: 257 is a container of format 1); else the tag itself, a codec's. Codec
    tags therefore have a low byte of 16 or more."""
    return tag & 0xFF if tag & 0xFF < FIRST_CODEC_TAG else tag


class ChunkCodec(Protocol):
    """A lossy or lossless encoding of a KV chunk into bytes (e.g. a compact q4 format).

    `encode(x)` gets the chunk (a torch tensor or numpy array) and returns bytes that
    `decode(data)` turns back into a tensor of the same shape and dtype.
    """

    tag: int

    def encode(self, x: Any) -> bytes: ...

    def decode(self, data: bytes) -> Any: ...


_CODECS: dict[int, list[ChunkCodec]] = {}


def _same_coding(a: ChunkCodec, b: ChunkCodec) -> bool:
    """Two codecs that make and read the same bytes (two loads of one calibration, say)."""
    ida, idb = getattr(a, "calibration_id", None), getattr(b, "calibration_id", None)
    return type(a) is type(b) and ida is not None and ida == idb and getattr(a, "fmt", None) == getattr(b, "fmt", None)


def register_codec(codec: ChunkCodec, *, replace: bool = False) -> ChunkCodec:
    """Make `codec` known by its tag, so that `get_tensor` (and the LMCache serde) can decode chunks
    stored with it. Registration lasts for the process: after a store is opened again, register its
    codecs again (or pass `codec=` to `get_tensor`). Several codecs may share a tag when each can tell
    its own chunks (an `owns(data)` method: `CompactChunkCodec`, one per calibration of a format, so
    one process serves several models); a codec that codes as a registered one does (the same
    calibration loaded again) takes its place. Otherwise a tag holds one codec, and another needs
    `replace=True`."""
    tag = int(codec.tag)
    if not FIRST_CODEC_TAG <= tag < 2**32:
        raise InvalidArgumentError(f"codec tags start at {FIRST_CODEC_TAG}, got {tag}")
    if tag_kind(tag) != tag:
        raise InvalidArgumentError(f"codec tag {tag} has a low byte below {FIRST_CODEC_TAG}: such tags are the "
                                   f"store's kinds of chunk with a writer's note (tag_kind({tag}) is {tag_kind(tag)})")
    held = [] if replace else [c for c in _CODECS.get(tag, []) if c is not codec and not _same_coding(c, codec)]
    if held and not all(callable(getattr(c, "owns", None)) for c in [*held, codec]):
        raise InvalidArgumentError(f"tag {tag} is taken by {held[0]!r} (replace=True to replace it)")
    _CODECS[tag] = [*held, codec]
    return codec


def codec_for(tag: int, data: Any) -> ChunkCodec | None:
    """The registered codec that decodes a chunk of ``tag`` (None when none is registered): the one
    registered, or, where several share the tag, the one whose ``owns(data)`` says so."""
    held = _CODECS.get(tag, [])
    if len(held) <= 1:
        return held[0] if held else None
    said = [(c, c.owns(data)) for c in held]
    mine = [c for c, yes in said if yes]
    if mine:
        return mine[0]
    if any(yes is None for _, yes in said):
        raise InvalidArgumentError(f"{len(held)} codecs share tag {tag} and this chunk (an older version) does not "
                                   "say which coded it: decode it with the right one (codec=)")
    raise CorruptDataError(f"none of the {len(held)} codecs registered for tag {tag} coded this chunk "
                           f"({', '.join(map(repr, held))})")


def _tag(tag) -> int:
    """A chunk's tag: an int in [0, 2**32) (a float or bool is refused, not truncated)."""
    if isinstance(tag, bool) or not isinstance(tag, numbers.Integral) or not 0 <= int(tag) < 2**32:
        raise InvalidArgumentError(f"a chunk's tag is an int in [0, 2**32), not {tag!r}")
    return int(tag)


def _key(key: str | bytes) -> bytes:
    if isinstance(key, str):
        try:
            key = key.encode()
        except UnicodeEncodeError as e:  # (a lone surrogate)
            raise InvalidArgumentError(f"key {key!r} is not valid UTF-8 text: {e}") from e
    elif isinstance(key, (bytearray, memoryview)):
        key = bytes(key)
    if not isinstance(key, bytes):
        raise InvalidArgumentError(f"keys are str or bytes, got {type(key).__name__}")
    return key


def _batch(items: Any, what: str) -> list:
    """The items of a batch as a list: any iterable but one str or bytes (a key, not a batch of its
    characters)."""
    if isinstance(items, (str, bytes, bytearray, memoryview)):
        raise InvalidArgumentError(f"{what}, not one key ({items!r})")
    try:
        return list(items)
    except TypeError as e:
        raise InvalidArgumentError(f"{what}, not {type(items).__name__}") from e


def _keys(keys: Any) -> list[bytes]:
    """A batch's keys: an iterable of keys."""
    return [_key(k) for k in _batch(keys, "a batch of keys is an iterable of keys")]


def _pairs(items: Any) -> list[tuple[Any, Any]]:
    """A batch's (key, value) items: a mapping or an iterable of pairs."""
    if isinstance(items, Mapping):
        return list(items.items())
    pairs = _batch(items, "a batch is a mapping or (key, value) pairs")
    for p in pairs:
        if not isinstance(p, (tuple, list)) or len(p) != 2:
            raise InvalidArgumentError(f"a batch's items are (key, value) pairs, not {p!r}")
    return [tuple(p) for p in pairs]


def _check_errors(errors: str) -> None:
    if errors not in ("raise", "miss"):
        raise InvalidArgumentError(f"errors must be 'raise' or 'miss', not {errors!r}")


def _no_repeats(keys: Sequence[bytes]) -> None:
    """A batch's keys are distinct: its items are written in parallel, so of two with one key any
    could be the one kept."""
    seen = set()
    for k in keys:
        if k in seen:
            raise InvalidArgumentError(f"key {k!r} is given twice in one batch")
        seen.add(k)


def _raise_first(results: Sequence[Any]) -> None:
    for r in results:
        if isinstance(r, BaseException):
            raise r


@dataclass(frozen=True)
class StoreConfig:
    """What `ChunkStore` takes (also accepted as keyword arguments)."""

    #: Folder of the disk tier; None keeps the store in RAM only.
    path: str | os.PathLike | None = None
    #: RAM tier budget: payload + key + ~160 bytes per chunk.
    ram_bytes: int = 1 << 30
    #: Disk tier budget in bytes of chunk files; 0: no limit but the file system's.
    disk_bytes: int = 0
    #: Threads of the I/O pool for batched calls; 0 picks 4.
    io_threads: int = 0
    #: fsync every chunk file and its folder before the write counts as done.
    durable: bool = True
    #: Every put is on disk when it returns (its errors are the put's); else write-back.
    write_through: bool = False
    #: Keep chunks read from disk in the RAM tier.
    promote: bool = True
    #: Largest chunk accepted (and believed in a file header).
    max_chunk_bytes: int = 1 << 30
    #: Remote tier: a Redis server (``redis://host:port/db``). Every put is stored there too
    #: (the put fails if it cannot be), and a local miss is looked up there.
    redis_url: str | None = None
    #: Prefix of the Redis keys: one namespace per model or deployment.
    redis_prefix: str = "wz:"
    #: Connect, read and write timeout of the remote tier, in milliseconds.
    redis_timeout_ms: int = 5000


class ChunkStore:
    """Keys (str or bytes) to chunks, in RAM with LRU eviction into a disk folder.

    Thread-safe; one open store per folder (a lock file enforces it). Reads are always verified: a
    damaged chunk is removed and its error (`ChecksumMismatchError`, `TruncatedError`, ...)
    raised, never its bytes returned. Write-back by default: chunks reach disk when the RAM tier
    evicts them or on `flush()` / `close()`; `write_through=True` puts them there at once.
    """

    def __init__(self, path: str | os.PathLike | None = None, **kwargs: Any):
        cfg = StoreConfig(path=path, **kwargs)
        if cfg.path is not None and not isinstance(cfg.path, (str, bytes, os.PathLike)):
            raise InvalidArgumentError(f"path is a str, bytes or os.PathLike, not {type(cfg.path).__name__}")
        if cfg.path is not None and not os.fspath(cfg.path):
            raise InvalidArgumentError("path is empty (None keeps the store in RAM only)")
        if cfg.path is not None:
            check_path(os.fsdecode(cfg.path))  # (bytes as the file system encodes them; no NUL)
        if cfg.redis_url is not None and not isinstance(cfg.redis_url, str):
            raise InvalidArgumentError(f"redis_url must be a str or None, got {cfg.redis_url!r}")
        if not isinstance(cfg.redis_prefix, str):
            raise InvalidArgumentError(f"redis_prefix must be a str, got {cfg.redis_prefix!r}")
        for name in ("durable", "write_through", "promote"):
            if not isinstance(getattr(cfg, name), bool):
                raise InvalidArgumentError(f"{name} must be a bool, got {getattr(cfg, name)!r}")
        for name in ("ram_bytes", "disk_bytes", "io_threads", "max_chunk_bytes", "redis_timeout_ms"):
            v = getattr(cfg, name)
            if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v < 2**63:
                raise InvalidArgumentError(f"{name} must be an int in [0, 2**63), got {v!r}")
        self.config = cfg
        self._inner: _core.Store | None = _core.Store(
            None if cfg.path is None else os.fsdecode(cfg.path),
            cfg.ram_bytes,
            cfg.disk_bytes,
            cfg.io_threads,
            bool(cfg.durable),
            bool(cfg.write_through),
            bool(cfg.promote),
            cfg.max_chunk_bytes,
            cfg.redis_url,
            cfg.redis_prefix,
            cfg.redis_timeout_ms,
        )

    @property
    def _s(self) -> _core.Store:
        if self._inner is None:
            raise InvalidArgumentError("the store is closed")
        return self._inner

    # -- bytes --------------------------------------------------------------------------------
    def put(self, key: str | bytes, data: Any, tag: int = TAG_RAW) -> None:
        """Store bytes-like `data` (bytes, bytearray, memoryview, numpy array) under `key`."""
        addr, n, keep = bytes_buffer(data)
        self._s.put(_key(key), addr, n, _tag(tag))
        del keep

    def get(self, key: str | bytes) -> bytes | None:
        """The bytes stored under `key`, or None."""
        r = self._s.get(_key(key))
        return None if r is None else r[1]

    def get_with_tag(self, key: str | bytes) -> tuple[int, bytes] | None:
        return self._s.get(_key(key))

    def put_many(self, items: Mapping[Any, Any] | Iterable[tuple[Any, Any]], tag: int = TAG_RAW) -> None:
        """Store many chunks on the I/O pool. Every item is attempted; the first error is raised."""
        keep, args = [], []
        for k, d in _pairs(items):
            addr, n, owner = bytes_buffer(d)
            keep.append(owner)
            args.append((_key(k), addr, n, _tag(tag)))
        _no_repeats([a[0] for a in args])
        _raise_first(self._s.put_many(args))

    def get_many(self, keys: Iterable[str | bytes], *, errors: str = "raise") -> list[bytes | None]:
        """Read many chunks on the I/O pool; None for a missing key. A damaged chunk is removed
        either way; `errors='raise'` raises its error, `errors='miss'` reports it as None."""
        _check_errors(errors)
        out = []
        for r in self._s.get_many(_keys(keys)):
            if isinstance(r, BaseException):
                if errors == "raise":
                    raise r
                out.append(None)
            else:
                out.append(None if r is None else r[1])
        return out

    def get_many_with_tags(self, keys: Iterable[str | bytes]) -> list:
        """Like `get_many`, one entry per key: (tag, bytes), None (missing) or the exception of a
        damaged chunk (already removed), for callers that decide per chunk."""
        return self._s.get_many(_keys(keys))

    # -- tensors ------------------------------------------------------------------------------
    def put_tensor(self, key: str | bytes, x: Any, *, codec: ChunkCodec | None = None, axis: int = -1,
                   level: int = _core.DEFAULT_LEVEL) -> int:
        """Store a tensor (numpy or CPU torch); returns the bytes stored. Without `codec`, the
        exact codec compresses it in Rust, off the GIL, at encoder `level` (1 fast, 2 the default:
        `weightszip.compress`'s); with one, `codec.encode` does."""
        return self.put_tensors({key: x}, codec=codec, axis=axis, level=level)[0]

    def put_tensors(
        self, items: Mapping[Any, Any] | Iterable[tuple[Any, Any]], *, codec: ChunkCodec | None = None, axis: int = -1,
        level: int = _core.DEFAULT_LEVEL,
    ) -> list[int]:
        """Store many tensors, compressed in parallel on the I/O pool. Returns bytes stored each."""
        level = check_level(level)
        pairs = _pairs(items)
        if codec is not None:
            register_codec(codec)
            blobs = [(k, codec.encode(x)) for k, x in pairs]
            self.put_many(blobs, tag=codec.tag)
            return [len(b) for _, b in blobs]
        bufs = [(_key(k), as_buffer(x)) for k, x in pairs]
        _no_repeats([k for k, _ in bufs])
        res = self._s.put_tensors(
            [(k, meta_tuple(b, "", axis, LAYOUT_TENSOR), b.addr, b.nbytes) for k, b in bufs],
            _core.DEFAULT_CHUNK_BYTES,
            _core.DEFAULT_LANES_LOG2,
            level,
        )
        del bufs
        _raise_first(res)
        return list(res)

    def _decode(self, key: Any, r: tuple[int, bytes] | None, out: str | None, codec: ChunkCodec | None = None):
        if r is None:
            return None
        tag, data = r
        if tag_kind(tag) == TAG_CONTAINER:
            return decompress(data, out=out)
        if codec is not None:
            if int(codec.tag) != tag:
                raise InvalidArgumentError(f"chunk {key!r} has tag {tag}, the codec given makes tag {codec.tag}")
            return codec.decode(data)
        found = codec_for(tag, data)
        if found is not None:
            return found.decode(data)
        raise InvalidArgumentError(f"chunk {key!r} has tag {tag}, which no registered codec decodes "
                                   "(codecs are registered per process: register_codec, or codec=)")

    def get_tensor(self, key: str | bytes, *, out: str | None = None, codec: ChunkCodec | None = None):
        """The tensor stored under `key` (exact: bit-identical; a codec's: its decode, with `codec`
        or the registered one for its tag), or None."""
        return self._decode(key, self._s.get(_key(key)), out, codec)

    def get_tensors(self, keys: Iterable[str | bytes], *, out: str | None = None, errors: str = "raise",
                    codec: ChunkCodec | None = None) -> list:
        _check_errors(errors)
        keys = _batch(keys, "a batch of keys is an iterable of keys")  # (as given, for messages)
        res = self._s.get_many([_key(k) for k in keys])
        out_list = []
        for k, r in zip(keys, res):
            if isinstance(r, BaseException):
                if errors == "raise":
                    raise r
                r = None
            out_list.append(self._decode(k, r, out, codec))
        return out_list

    # -- management ---------------------------------------------------------------------------
    def contains(self, key: str | bytes, *, errors: str = "raise") -> bool:
        """Whether `key` is stored (not read nor verified). A local copy answers without asking
        Redis; when Redis is asked and cannot answer (down, a timeout), `errors='raise'` raises
        WeightszipIOError, as `get`; `errors='miss'` logs it and answers False (what a serving
        engine's lookup wants: the key is computed again)."""
        _check_errors(errors)
        try:
            return self._s.contains(_key(key))
        except WeightszipIOError as e:
            if errors == "raise":
                raise
            logger.warning("weightszip store: %r counted as absent: %s", key, e)
            return False

    __contains__ = contains

    def delete(self, key: str | bytes) -> bool:
        """Remove `key` from every tier; whether it was there. WeightszipIOError when Redis cannot
        delete it (the local copies are deleted; this store reads the key no more from Redis)."""
        return self._s.delete(_key(key))

    def evict_from_ram(self, key: str | bytes) -> bool:
        """Move `key` out of the RAM tier (to disk when there is one)."""
        return self._s.evict_from_ram(_key(key))

    def flush(self) -> None:
        """Write every chunk that is only in RAM to the disk tier."""
        self._s.flush()

    def file_of(self, key: str | bytes) -> str | None:
        """The chunk file that holds `key` now, if it is on disk."""
        p = self._s.file_of(_key(key))
        return None if p is None else os.fspath(p)

    def stats(self) -> dict[str, int]:
        """Counts and bytes per tier, hits, misses, evictions, damaged chunks removed."""
        return dict(self._s.stats())

    def close(self) -> None:
        """Flush to disk and release the folder (its lock) once nothing else holds the store.

        Calls racing with close either fail (InvalidArgumentError: the store is closed) or finish
        first: every put that returned is on disk when close returns. A store dropped without
        close writes its chunks too."""
        inner = self._inner
        if inner is not None:
            try:
                inner.close()
            finally:
                self._inner = None

    def __enter__(self) -> "ChunkStore":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"ChunkStore({self.config.path!r}, ram_bytes={self.config.ram_bytes})"


__all__ = [
    "ChunkStore",
    "StoreConfig",
    "ChunkCodec",
    "register_codec",
    "codec_for",
    "TAG_RAW",
    "TAG_CONTAINER",
    "FIRST_CODEC_TAG",
    "tag_kind",
    "WeightszipError",
]
