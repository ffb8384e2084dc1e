"""LMCache integration: a lossless `weightszip` serde for the multi-process (MP) server, and a
remote-storage plugin for the in-process mode backed by `weightszip.store.ChunkStore`.

Importing this module imports LMCache (``pip install lmcache``). docs/STORE.md gives the exact
configuration; in short:

MP mode (serde on an L2 adapter): start the server through our launcher, which registers the
serde type ``weightszip`` and then runs LMCache's own server with the same arguments::

    python -m weightszip.integrations.lmcache_server --host 127.0.0.1 --port 5555 \\
        --l1-size-gb 8 --eviction-policy LRU --disable-observability \\
        --l2-adapter '{"type": "fs", "base_path": "/data/kv", "serde": {"type": "weightszip"}}'

(LMCache requires ``--l1-size-gb`` and ``--eviction-policy``; ``--disable-observability`` where its
opentelemetry exporters are not installed, as with scripts/lmcache_site.sh. Or call `register()` in
any process before LMCache parses its L2 adapter config.)
Serde options: ``"mode": "exact"`` (default, bit-exact); ``"q4"``, ``"q3.5"`` or ``"q3"`` with
``"calibration": "/path/model.wzcal"`` (the compact formats, lossy); or ``"codec"`` with ``"codec":
"pkg.module:OBJECT"`` naming a `weightszip.store.ChunkCodec` (compact formats) that also has
``max_encoded_size(shape, dtype) -> int``; ``"threads"`` (codec threads per chunk, 0 = all
cores) and ``"max_workers"`` (chunks coded at once).

In-process mode (LMCache config YAML)::

    remote_storage_plugins: ["weightszip"]    # (not remote_url as well: a second backend, same folder)
    extra_config:
      remote_storage_plugin.weightszip.module_path: weightszip.integrations.lmcache
      remote_storage_plugin.weightszip.class_name: WeightszipConnector
      remote_storage_plugin.weightszip.path: /data/kv            # disk tier (omit: RAM only)
      remote_storage_plugin.weightszip.ram_bytes: 8589934592     # RAM tier budget
      remote_storage_plugin.weightszip.redis_url: redis://host:6379/0   # optional remote tier

Every `ChunkStore` option can be given so (another key under the prefix is refused); with several
workers (vLLM with TP > 1), each opens its own subfolder of ``path`` (`worker_folder`).
"""

from __future__ import annotations

import asyncio
import importlib
import os
from typing import Optional

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde.async_processor import AsyncSerdeProcessor
from lmcache.v1.distributed.serde.base import Deserializer, SerdeProcessor, Serializer
from lmcache.v1.distributed.serde.factory import get_registered_serde_types, register_serde_factory
from lmcache.v1.memory_management import MemoryFormat, MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

import weightszip
from weightszip import _core
from weightszip._tensors import _torch_maps, bytes_buffer
from weightszip.errors import CorruptDataError, InvalidArgumentError
from weightszip.integrations import kvserde
from weightszip.integrations._options import ENCODER_OPTIONS, encoder_level, integer, store_kwargs
from weightszip.store import TAG_CONTAINER, ChunkStore, register_codec, tag_kind

SERDE_NAME = "weightszip"


def _load_codec(spec: str):
    """'pkg.module:OBJECT' -> the object (a ChunkCodec instance, or a class to instantiate); a name
    that does not import, or an object that is no codec, is an `InvalidArgumentError`."""
    mod, _, attr = spec.partition(":")
    if not mod or not attr:
        raise InvalidArgumentError(f"codec must be 'module:object', got {spec!r}")
    try:
        obj = getattr(importlib.import_module(mod), attr)
    except (ImportError, AttributeError) as e:
        raise InvalidArgumentError(f"serde codec {spec!r}: {type(e).__name__}: {e}") from e
    codec = obj() if isinstance(obj, type) else obj
    missing = [m for m in ("tag", "encode", "decode", "max_encoded_size") if not hasattr(codec, m)]
    if missing:
        raise InvalidArgumentError(f"serde codec {spec!r} is no ChunkCodec with max_encoded_size: "
                                   f"it lacks {', '.join(missing)}")
    return codec


class WeightszipSerializer(Serializer):
    """KV chunk -> bytes: the exact codec (lossless) or a registered ChunkCodec."""

    def __init__(self, codec=None, threads: int = 0, level: int = _core.DEFAULT_LEVEL):
        self.codec = codec
        self.threads = threads
        self.level = level

    def serialize(self, src: MemoryObj, dst: MemoryObj, key: Optional[ObjectKey] = None) -> int:
        if src.tensor is None or dst.tensor is None:
            raise InvalidArgumentError("the weightszip serde needs src and dst with tensors")
        return kvserde.serialize_into(src.tensor, dst.tensor, codec=self.codec, threads=self.threads,
                                      level=self.level)

    def estimate_serialized_size(self, layout_desc: MemoryLayoutDesc) -> int:
        total = 0
        for shape, dtype in zip(layout_desc.shapes, layout_desc.dtypes, strict=True):
            if self.codec is not None:
                total += kvserde.HEADER_LEN + int(self.codec.max_encoded_size(tuple(shape), dtype))
            else:
                total += kvserde.exact_bound(int(torch.Size(shape).numel()) * dtype.itemsize)
        return total


class WeightszipDeserializer(Deserializer):
    """Bytes -> KV chunk. Chunks of its serde's codec's tag are decoded by that codec, not by whatever
    the process registered last under the tag (another serde's codec may share it)."""

    def __init__(self, threads: int = 0, codec=None):
        self.threads = threads
        self.codec = codec

    def deserialize(self, src: MemoryObj, dst: MemoryObj, key: Optional[ObjectKey] = None) -> None:
        if src.tensor is None or dst.tensor is None:
            raise InvalidArgumentError("the weightszip serde needs src and dst with tensors")
        kvserde.deserialize_into(src.tensor, dst.tensor, threads=self.threads, codec=self.codec)


#: The serde's options (the ``"serde"`` dict of an L2 adapter, less its ``type``), and the modes.
SERDE_OPTIONS = ("mode", "calibration", "codec", "threads", "max_workers", *ENCODER_OPTIONS)
_COMPACT_MODES = ("q4", "q3.5", "q3")


def create_serde(kwargs: dict[str, object]) -> SerdeProcessor:
    """LMCache serde factory: the ``"serde"`` dict of an L2 adapter, less its ``type``. Every option
    is checked here, when the adapter is built: an unknown key, an option the mode does not take, or
    a value of the wrong kind is an `InvalidArgumentError` naming it."""
    where = "weightszip serde"
    unknown = sorted(str(k) for k in kwargs if k not in SERDE_OPTIONS)
    if unknown:
        raise InvalidArgumentError(f"{where}: unknown option{'s' if len(unknown) > 1 else ''} "
                                   f"{', '.join(map(repr, unknown))}; accepted: {', '.join(SERDE_OPTIONS)}")
    mode = kwargs.get("mode", "exact")
    if mode not in ("exact", "codec", *_COMPACT_MODES):
        raise InvalidArgumentError(f"{where}: mode must be exact, q4, q3.5, q3 or codec, not {mode!r}")
    for name, modes in (("calibration", _COMPACT_MODES), ("codec", ("codec",)), ("level", ("exact",))):
        if name in kwargs and mode not in modes:
            raise InvalidArgumentError(f"{where}: \"{name}\" is the {' / '.join(modes)} mode's; mode {mode!r} takes none")
        if mode in modes and name != "level" and not isinstance(kwargs.get(name), (str, os.PathLike)):
            what = "the model's .wzcal file" if name == "calibration" else "\"module:object\""
            raise InvalidArgumentError(f"{where}: mode {mode!r} needs \"{name}\": {what}, not {kwargs.get(name)!r}")
    threads = integer(kwargs.get("threads", 0), "threads", where)
    max_workers = integer(kwargs.get("max_workers", 2), "max_workers", where)
    if threads < 0 or max_workers < 1:
        raise InvalidArgumentError(f"{where}: threads must be at least 0 (0: all cores) and max_workers at least 1, "
                                   f"not {threads} and {max_workers}")
    # the exact codec's encoder level: 1 encodes faster (BENCHMARKS.md, "Encoder levels")
    level = encoder_level(kwargs, where)
    codec = None
    if mode in _COMPACT_MODES:
        from weightszip.integrations.compact_chunks import CompactChunkCodec

        # (not replace=True: chunks say which calibration coded them, so several models' codecs
        # share the format's tag in one process)
        codec = register_codec(CompactChunkCodec(os.fspath(kwargs["calibration"]), str(mode)))
    elif mode == "codec":
        # Not registered: the serde's own deserializer decodes its chunks with it, and another
        # serde's codec of the same tag (registered or not) does not change that.
        codec = _load_codec(os.fspath(kwargs["codec"]))
    return AsyncSerdeProcessor(
        WeightszipSerializer(codec, threads, level), WeightszipDeserializer(threads, codec), max_workers=max_workers
    )


def register() -> None:
    """Register the serde type ``weightszip`` with LMCache (idempotent)."""
    if SERDE_NAME not in get_registered_serde_types():
        register_serde_factory(SERDE_NAME, create_serde)


def worker_folder(metadata) -> Optional[str]:
    """The subfolder of ``path`` that this worker's store opens, or None for ``path`` itself.

    With tensor or pipeline parallelism vLLM runs one LMCache engine per worker process, and a store
    folder is one process's (its lock): workers cannot share one, so each opens
    ``path/worker<id>of<world size>`` (``worker1of2``), from the engine's `LMCacheMetadata`, which
    the connector finds on its ``local_cpu_backend`` (as LMCache's own fs connector does; the
    dynamic adapter passes no metadata). A single worker (world size 1, or no metadata) keeps
    ``path`` itself, so stores written before workers had folders stay readable."""
    world = int(getattr(metadata, "world_size", 1) or 1)
    if world <= 1:
        return None
    return f"worker{int(metadata.worker_id)}of{world}"


class WeightszipConnector(RemoteConnector):
    """LMCache in-process remote storage on a `ChunkStore` (RAM, disk, Redis tiers), every chunk
    compressed losslessly by the exact codec off the GIL, and verified on every read.

    LMCache's DynamicConnectorAdapter builds it as ``cls(loop=, local_cpu_backend=, config=)``;
    options come from ``extra_config`` keys ``remote_storage_plugin.weightszip.<option>``, one per
    `ChunkStore` option (``path``, ``ram_bytes``, ``disk_bytes``, ``io_threads``, ``durable``,
    ``write_through``, ``promote``, ``max_chunk_bytes``, ``redis_url``, ``redis_prefix``,
    ``redis_timeout_ms``) beside LMCache's ``module_path`` and ``class_name``; another key under
    that prefix is an `InvalidArgumentError`. Each worker of a multi-worker engine opens its own
    subfolder of ``path`` (`worker_folder`).
    """

    PLUGIN = "weightszip"

    def __init__(self, loop=None, local_cpu_backend=None, config=None, *, store: ChunkStore | None = None):
        # RemoteConnector.__init__ needs engine metadata that the dynamic adapter does not pass;
        # nothing here uses what it sets up.
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        if store is None:
            extra = (getattr(config, "extra_config", None) or {}) if config is not None else {}
            prefix = f"remote_storage_plugin.{self.PLUGIN}."
            mine = {k[len(prefix):]: v for k, v in extra.items() if isinstance(k, str) and k.startswith(prefix)}
            where = f"LMCache extra_config {prefix}*"
            opts = store_kwargs(mine, where, ignore=("module_path", "class_name", *ENCODER_OPTIONS),
                                subfolder=worker_folder(getattr(local_cpu_backend, "metadata", None)))
            self.level = encoder_level(mine, where)
            store = ChunkStore(**opts)
        else:
            self.level = _core.DEFAULT_LEVEL
        self.store = store

    @staticmethod
    def _key(key) -> str:
        return key.to_string()

    async def exists(self, key) -> bool:
        return await asyncio.to_thread(self.exists_sync, key)

    def exists_sync(self, key) -> bool:
        # A Redis tier that cannot answer for a key is a logged miss of that key: LMCache's
        # batched lookups gather exists() over every key and count the whole batch as absent if
        # one raises, which would lose the locally held prefix
        return self.store.contains(self._key(key), errors="miss")

    def _put(self, key, memory_obj: MemoryObj) -> None:
        t = memory_obj.tensor
        if t is None:
            raise InvalidArgumentError("memory object has no tensor")
        # The memory format rides in the tag's upper bits, so get() allocates the same kind; the
        # store reads the chunk as a container all the same (tag_kind: get_tensor decodes it).
        tag = TAG_CONTAINER | (int(memory_obj.meta.fmt.value) << 8)
        self.store.put(self._key(key), weightszip.compress(t.cpu(), level=self.level), tag=tag)

    async def put(self, key, memory_obj: MemoryObj):
        await asyncio.to_thread(self._put, key, memory_obj)

    def _get(self, key) -> Optional[MemoryObj]:
        r = self.store.get_with_tag(self._key(key))
        if r is None:
            return None
        tag, data = r
        if tag_kind(tag) != TAG_CONTAINER:
            raise InvalidArgumentError(f"chunk {self._key(key)!r} has tag {tag}, not a weightszip container")
        addr, n, keep = bytes_buffer(data)
        entries = _core.buffer_index(addr, n)["entries"]
        if len(entries) != 1:
            raise CorruptDataError(f"chunk {self._key(key)!r} holds {len(entries)} tensors, not one")
        e = entries[0]
        try:
            fmt = MemoryFormat(tag >> 8)
        except ValueError as err:
            raise CorruptDataError(f"chunk {self._key(key)!r} has tag {tag}: no LMCache memory format {tag >> 8}") from err
        dtype = _torch_maps()[1].get(e["dtype"])
        if dtype is None:
            raise CorruptDataError(f"chunk {self._key(key)!r} holds {e['dtype']}, which torch has not")
        obj = self.local_cpu_backend.allocate(torch.Size(e["shape"]), dtype, fmt)
        if obj is None:
            return None  # LMCache's allocator is full: a miss, as its own connectors report it
        try:
            t = obj.tensor
        except (RuntimeError, ValueError):  # LMCache's own view of a buffer too small for the shape
            t = None
        if t is None or not t.is_contiguous() or t.numel() * t.element_size() < e["raw_bytes"]:
            # the decoder writes raw_bytes from the tensor's address: never past a smaller buffer
            release = getattr(obj, "ref_count_down", None)
            if release is not None:
                release()
            raise InvalidArgumentError(f"chunk {self._key(key)!r}: LMCache's allocator gave no contiguous buffer of "
                                       f"{e['raw_bytes']} bytes for {e['dtype']} {e['shape']}")
        _core.decode_buffer_entry(addr, n, 0, t.data_ptr(), e["raw_bytes"], 0)
        del keep
        return obj

    async def get(self, key) -> Optional[MemoryObj]:
        return await asyncio.to_thread(self._get, key)

    async def list(self) -> list[str]:
        # Files are named by key hash; the store does not enumerate keys.
        return []

    async def close(self):
        self.store.close()

    def remove_sync(self, key) -> bool:
        return self.store.delete(self._key(key))

    def __repr__(self) -> str:
        return f"WeightszipConnector({self.store!r})"
