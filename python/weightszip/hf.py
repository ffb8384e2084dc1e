"""transformers cache classes: `model.generate(..., past_key_values=WeightszipCache(model.config))`.

Needs transformers >= 5.17 (`weightszip.models.TRANSFORMERS_MIN`; importing this module on an
older one raises ImportError).

The cache keeps the most recent tokens of every layer as plain tensors and seals older tokens
into pages of `page_tokens` (LMCache's chunk is 256). A sealed page is

* compressed losslessly (exact mode, the default): generation is token-for-token what a plain
  `DynamicCache` gives, in about 0.65x of the memory for real bf16 KV;
* or passed through a compact KV format first (`fmt=`, any `weightszip.eval.formats.KVFormat`,
  e.g. ``get_format("int4-g32")``, or ``CompactFormat("q4", Calibration.load("model.wzcal"))``
  from `weightszip.compact.formats`): the model sees exactly what that format would hand back,
  with the tokens the format keeps in bf16 kept so (its first ``sink_tokens``, and at least its
  ``recent_window`` most recent: ``recent_tokens`` is raised to it);
* and, given a `ChunkStore` (`store=`), offloaded to it (RAM / disk / Redis tiers) and read back
  (verified) when attention needs it, instead of being kept by the cache.

    >>> from weightszip.hf import WeightszipCache                         # doctest: +SKIP
    >>> from weightszip.store import ChunkStore                           # doctest: +SKIP
    >>> cache = WeightszipCache(model.config, store=ChunkStore("/tmp/kv", ram_bytes=1 << 28))
    >>> out = model.generate(**inputs, max_new_tokens=64, past_key_values=cache)

Each step reads every cold page of a layer back (decode in Rust, off the GIL): that is the price
of not keeping them. Beam search (`reorder_cache`) is not supported.
"""

from __future__ import annotations

import uuid
from typing import Any

from weightszip.models import require_transformers

require_transformers("weightszip.hf")

import torch  # noqa: E402
from transformers.cache_utils import Cache, DynamicLayer  # noqa: E402

import weightszip  # noqa: E402
from weightszip.errors import InvalidArgumentError  # noqa: E402
from weightszip.store import ChunkStore  # noqa: E402


class WeightszipLayer(DynamicLayer):
    """One layer: a recent window of plain K/V [batch, heads, tokens, head_dim] and sealed pages."""

    is_croppable = False

    def __init__(
        self,
        layer_idx: int,
        *,
        fmt: Any = None,
        store: ChunkStore | None = None,
        namespace: str = "",
        page_tokens: int = 256,
        recent_tokens: int = 128,
    ):
        super().__init__()
        if page_tokens < 1 or recent_tokens < 0:
            raise InvalidArgumentError(f"page_tokens must be >= 1 and recent_tokens >= 0, got {page_tokens}, {recent_tokens}")
        self.layer_idx = layer_idx
        self.fmt = fmt
        self.store = store
        self.namespace = namespace
        self.page_tokens = page_tokens
        # a format that keeps its recent window in bf16 (the compact ones: 128 tokens) is read as it
        # would be in a paged cache only if at least that many recent tokens stay plain here
        self.recent_tokens = max(recent_tokens, int(getattr(fmt, "recent_window", 0) or 0))
        self.cumulative_length = 0
        # Sealed pages, oldest first: (key for the store, or the compressed K and V bytes).
        self._pages: list[Any] = []
        self.stored_bytes = 0
        self.raw_bytes = 0

    def _page_key(self, i: int, kind: str) -> str:
        return f"{self.namespace}/L{self.layer_idx}/P{i}/{kind}"

    def _seal(self, k: torch.Tensor, v: torch.Tensor) -> None:
        if self.fmt is not None:
            # formats that code keys at their positions (the compact formats' rotary offsets) are
            # told where the page starts: pages are sealed in order from position 0
            start = len(self._pages) * self.page_tokens
            kw = {"start": start} if getattr(self.fmt, "position_aware", False) else {}
            ck = self.fmt.roundtrip(k, "k", self.layer_idx, **kw).to(k.dtype)
            cv = self.fmt.roundtrip(v, "v", self.layer_idx, **kw).to(v.dtype)
            # the format's sink tokens (positions below sink_tokens) stay as they were, as the
            # format's own cache keeps them in bf16
            keep = min(int(getattr(self.fmt, "sink_tokens", 0) or 0) - start, k.shape[-2])
            if keep > 0:
                ck = torch.cat([k[..., :keep, :], ck[..., keep:, :]], dim=-2)
                cv = torch.cat([v[..., :keep, :], cv[..., keep:, :]], dim=-2)
            k, v = ck, cv
        k, v = k.detach().cpu().contiguous(), v.detach().cpu().contiguous()
        self.raw_bytes += k.numel() * k.element_size() + v.numel() * v.element_size()
        i = len(self._pages)
        if self.store is not None:
            keys = (self._page_key(i, "k"), self._page_key(i, "v"))
            self.stored_bytes += sum(self.store.put_tensors({keys[0]: k, keys[1]: v}))
            self._pages.append(keys)
        else:
            blobs = (weightszip.compress(k), weightszip.compress(v))
            self.stored_bytes += len(blobs[0]) + len(blobs[1])
            self._pages.append(blobs)

    def _cold(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        if not self._pages:
            return [], []
        if self.store is not None:
            flat = [k for pair in self._pages for k in pair]
            got = self.store.get_tensors(flat, out="torch")
            if any(t is None for t in got):
                missing = [k for k, t in zip(flat, got) if t is None]
                raise weightszip.WeightszipError(f"pages of layer {self.layer_idx} left the store: {missing[:2]}")
        else:
            got = [weightszip.decompress(b, out="torch") for pair in self._pages for b in pair]
        dev = self.device
        return [t.to(dev) for t in got[0::2]], [t.to(dev) for t in got[1::2]]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.cumulative_length += key_states.shape[-2]
        # Attention in this step sees the pages sealed before it and every token since, as given:
        # a compact format changes what later steps read, never the step that wrote the tokens.
        cold_k, cold_v = self._cold()
        hot_k = torch.cat([self.keys, key_states], dim=-2)
        hot_v = torch.cat([self.values, value_states], dim=-2)
        out_k = torch.cat(cold_k + [hot_k], dim=-2) if cold_k else hot_k
        out_v = torch.cat(cold_v + [hot_v], dim=-2) if cold_v else hot_v
        while hot_k.shape[-2] - self.page_tokens >= self.recent_tokens:
            self._seal(hot_k[..., : self.page_tokens, :], hot_v[..., : self.page_tokens, :])
            hot_k, hot_v = hot_k[..., self.page_tokens :, :], hot_v[..., self.page_tokens :, :]
        self.keys, self.values = hot_k, hot_v
        return out_k, out_v

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise NotImplementedError("WeightszipCache does not support beam search (its pages are sealed)")

    def release(self) -> None:
        """Delete this layer's pages from the store."""
        if self.store is not None:
            for pair in self._pages:
                for k in pair:
                    self.store.delete(k)
        self._pages = []

    def reset(self) -> None:
        self.release()
        super().reset()
        self.cumulative_length = 0
        self.stored_bytes = self.raw_bytes = 0


class WeightszipCache(Cache):
    """A cache for `model.generate`: sealed pages compressed exactly (default) or through a compact
    KV format `fmt`, kept in the cache or offloaded to `store`. Full-attention models only."""

    def __init__(
        self,
        config: Any,
        *,
        fmt: Any = None,
        store: ChunkStore | None = None,
        page_tokens: int = 256,
        recent_tokens: int = 128,
        namespace: str | None = None,
    ):
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        types = getattr(text, "layer_types", None) or ["full_attention"] * text.num_hidden_layers
        if set(types) != {"full_attention"}:
            raise InvalidArgumentError(f"WeightszipCache supports full-attention layers only, not {sorted(set(types))}")
        if isinstance(fmt, str):
            from weightszip.eval.formats import get_format

            fmt = get_format(fmt)
        ns = namespace or f"hf-{uuid.uuid4().hex}"
        layers = [
            WeightszipLayer(i, fmt=fmt, store=store, namespace=ns, page_tokens=page_tokens, recent_tokens=recent_tokens)
            for i in range(text.num_hidden_layers)
        ]
        super().__init__(layers=layers)
        self.store = store

    def memory_report(self) -> dict[str, int]:
        """Bytes of sealed pages before and after compression, over all layers."""
        return {
            "sealed_raw_bytes": sum(layer.raw_bytes for layer in self.layers),
            "sealed_stored_bytes": sum(layer.stored_bytes for layer in self.layers),
            "sealed_pages": sum(len(layer._pages) for layer in self.layers),
        }

    def release(self) -> None:
        """Delete every page this cache put in its store."""
        for layer in self.layers:
            layer.release()
