"""SGLang HiCache storage backend on `weightszip.store.ChunkStore`: every page stored losslessly
compressed (exact codec, in Rust off the GIL), verified on every read, in RAM / disk / Redis tiers.

Load it with SGLang's dynamic backend (``pip install sglang``)::

    python -m sglang.launch_server --model-path ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "weightszip",
            "module_path": "weightszip.integrations.sglang", "class_name": "WeightszipHiCacheStorage",
            "path": "/data/hicache", "ram_bytes": 8589934592}'

Options in the extra config: every `weightszip.store.ChunkStore` option under its own name
(``path``: disk tier, omit for RAM only; ``ram_bytes``, ``disk_bytes``, ``io_threads``, ``durable``,
``write_through``, ``promote``, ``max_chunk_bytes``, ``redis_url``, ``redis_prefix``,
``redis_timeout_ms``), beside SGLang's own keys; any other key is an `InvalidArgumentError`. The
backend uses SGLang's generic page path (``batch_get`` / ``batch_set`` of flat host pages), not the
zero-copy ``interface_v1``.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any, List, Optional

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from weightszip import _core
from weightszip._tensors import as_buffer, bytes_buffer, check_dense
from weightszip.errors import InvalidArgumentError, WeightszipError
from weightszip.integrations._options import ENCODER_OPTIONS, encoder_level, flag, store_kwargs
from weightszip.store import TAG_CONTAINER, ChunkStore

logger = logging.getLogger(__name__)

#: Keys of the extra config that are SGLang's (its dynamic loader's, and those its cache controller
#: reads or pops), not store options.
SGLANG_KEYS = (
    "backend_name", "module_path", "class_name", "interface_v1", "tp_lcm_size", "file_storage_path",
    "prefetch_threshold", "prefetch_timeout_base", "prefetch_timeout_per_ki_token",
    "hicache_storage_pass_prefix_keys",
)


def model_key(name: Optional[str]) -> str:
    """The model's part of the page keys: its name with "/" as "-" (as SGLang's file backend spells
    it), and "%" and "-" escaped as "%25" and "%2D", so that no two names share one ("org/m" is
    "org-m", "org-m" is "org%2Dm": two servers sharing a store never read each other's pages). A
    name without "-" or "%" keeps the key it had before the escapes."""
    return (name or "").replace("%", "%25").replace("-", "%2D").replace("/", "-")


def rank_folder(cfg: HiCacheStorageConfig) -> Optional[str]:
    """The subfolder of ``path`` that this rank's store opens, or None for ``path`` itself.

    Every rank SGLang runs (tensor, pipeline and attention-context parallel, and each data-parallel
    attention group) is a process of its own, and a store folder is one process's (its lock): ranks
    cannot share one, so each opens ``path/<name>``, named by every parallel dimension larger than
    one (``tp1of2``, ``tp0of4-pp1of2``, ``dp1-tp0of2``). A single-rank server keeps ``path`` itself,
    so stores written before ranks had folders stay readable. MLA pages, which the ranks share by
    key, are stored on disk once per rank (a Redis tier holds them once)."""
    parts = []
    dp_rank = int(getattr(cfg, "dp_rank", 0) or 0)  # (SGLang versions before dp_rank: always 0)
    if dp_rank:
        parts.append(f"dp{dp_rank}")
    for name, rank, size in (("tp", cfg.tp_rank, cfg.tp_size), ("pp", cfg.pp_rank, cfg.pp_size),
                             ("cp", getattr(cfg, "attn_cp_rank", 0), getattr(cfg, "attn_cp_size", 1))):
        if int(size) > 1:
            parts.append(f"{name}{int(rank)}of{int(size)}")
    return "-".join(parts) or None


class WeightszipHiCacheStorage(HiCacheStorage):
    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None, *, store=None):
        extra = storage_config.extra_config or {}
        if not isinstance(extra, Mapping):
            raise InvalidArgumentError(f"HiCache extra config must be a JSON object, not {type(extra).__name__}")
        extra = dict(extra)
        model = model_key(storage_config.model_name)
        # Same sharing rule as SGLang's file backend: MLA pages are shared by the TP ranks (through
        # a Redis tier; each rank's disk folder is its own), MHA pages are per rank.
        if storage_config.is_mla_model:
            self.suffix = f"_{model}"
        else:
            self.suffix = f"_{model}_{storage_config.tp_rank}_{storage_config.tp_size}"
        if storage_config.pp_size > 1:
            self.suffix += f"_{storage_config.pp_size}_{storage_config.pp_rank}"
        self.level = encoder_level(extra, "HiCache extra config")  # the exact codec's, for batch_set
        if store is None:
            opts = store_kwargs(extra, "HiCache extra config", ignore=SGLANG_KEYS + ENCODER_OPTIONS,
                                subfolder=rank_folder(storage_config))
            if flag(extra.get("interface_v1", False), "interface_v1", "HiCache extra config"):
                raise InvalidArgumentError("HiCache extra config: the weightszip backend has no zero-copy "
                                           "interface_v1; leave it out")
            store = ChunkStore(**opts)
        self.store = store

    def _k(self, key: str) -> str:
        if not isinstance(key, str):
            raise InvalidArgumentError(f"HiCache keys are str, not {type(key).__name__}")
        return key + self.suffix

    def _row(self, n: int) -> int:
        """Elements per token row of a page (heads x head_dim), when the host pool says: the codec
        models each channel against the same channel of the previous token."""
        pool = getattr(self, "mem_pool_host", None)
        row = int(getattr(pool, "head_num", 0) or 0) * int(getattr(pool, "head_dim", 0) or 0)
        if getattr(pool, "kv_lora_rank", None) is not None:  # MLA: one latent row per token
            row = int(pool.kv_lora_rank) + int(getattr(pool, "qk_rope_head_dim", 0) or 0)
        return row if row > 0 and n % row == 0 else 0

    def _encode(self, value: torch.Tensor) -> Any:
        check_dense(value)  # (a sparse or meta page: refused as as_buffer refuses it, not torch's error)
        v = value.detach().cpu().contiguous().reshape(-1)
        row = self._row(v.numel())
        return v.view(-1, row) if row else v

    # -- generic page interface ---------------------------------------------------------------
    def set(self, key: str, value: Optional[Any] = None, target_location=None, target_sizes=None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations=None, target_sizes=None) -> bool:
        if values is None or len(values) != len(keys):
            return False
        if not all(isinstance(v, torch.Tensor) for v in values):
            logger.error("weightszip HiCache: storing %d pages failed: a value is not a tensor", len(keys))
            return False
        try:
            # (a key twice in one batch names one page by its hash: the last value is stored)
            pages = dict(zip((self._k(k) for k in keys), values))
            self.store.put_tensors([(k, self._encode(v)) for k, v in pages.items()], level=self.level)
            return True
        except WeightszipError as e:
            logger.error("weightszip HiCache: storing %d pages failed: %s", len(keys), e)
            return False

    def _decode_into(self, data: bytes, target: torch.Tensor) -> Optional[torch.Tensor]:
        if not (isinstance(target, torch.Tensor) and target.device.type == "cpu" and target.is_contiguous()):
            # the decoder writes the page's bytes from the target's address on: only a contiguous
            # host tensor is that many bytes there (a strided or expanded view is not; a GPU one is
            # not host memory)
            logger.error("weightszip HiCache: a page's target must be a contiguous CPU tensor, not %s",
                         f"{target.device} strides {target.stride()}" if isinstance(target, torch.Tensor)
                         else type(target).__name__)
            return None
        addr, n, keep = bytes_buffer(data)
        entries = _core.buffer_index(addr, n)["entries"]
        if len(entries) != 1:
            logger.error("weightszip HiCache: stored page holds %d tensors, not one", len(entries))
            return None
        e = entries[0]
        t = target.view(-1)
        if e["raw_bytes"] != t.numel() * t.element_size() or e["dtype"] != as_buffer(t[:0]).dtype:
            logger.error("weightszip HiCache: stored page is %s %s, target %s %s", e["dtype"], e["shape"], t.dtype, t.numel())
            return None
        _core.decode_buffer_entry(addr, n, 0, t.data_ptr(), e["raw_bytes"], 0)
        del keep
        return target

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes=None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None, target_sizes=None) -> List[torch.Tensor | None]:
        if target_locations is None:
            target_locations = [None] * len(keys)
        if len(target_locations) != len(keys):
            raise InvalidArgumentError(f"{len(keys)} keys and {len(target_locations)} target locations")
        out: List[torch.Tensor | None] = []
        # A damaged page comes back as a miss (it is removed from the store and logged), as does a
        # page that is not one container (logged).
        for key, r, target in zip(keys, self.store.get_many_with_tags([self._k(k) for k in keys]), target_locations):
            if r is None or isinstance(r, BaseException):
                if isinstance(r, BaseException):
                    logger.warning("weightszip HiCache: page %s failed verification: %s", key, r)
                out.append(None)
                continue
            tag, data = r
            if tag != TAG_CONTAINER:
                out.append(None)
                continue
            try:
                if target is None or (isinstance(target, torch.Tensor) and target.numel() == 0):
                    import weightszip

                    out.append(weightszip.decompress(data, out="torch").reshape(-1))
                else:
                    out.append(self._decode_into(data, target))
            except WeightszipError as e:
                logger.warning("weightszip HiCache: page %s is not a readable container: %s", key, e)
                out.append(None)
        return out

    # (a Redis tier that cannot answer is a logged miss here: the pages are computed again)
    def exists(self, key: str) -> bool:
        return self.store.contains(self._k(key), errors="miss")

    def batch_exists(self, keys: List[str], extra_info=None) -> int:
        for i, k in enumerate(keys):
            if not self.exists(k):
                return i
        return len(keys)

    def clear(self) -> None:
        # Chunk files are named by key hash, so the store cannot list what it holds; deleting the
        # store's folder (with the server stopped) clears it.
        logger.warning("weightszip HiCache: clear() is not supported; remove the store folder instead")

    def get_stats(self):
        return self.store.stats()

    def close(self) -> None:
        self.store.close()
