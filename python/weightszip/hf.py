"""transformers cache classes: ``model.generate(..., cache=WeightszipCache(model.config))``.

Needs transformers >= 5.17 (`weightszip.models.TRANSFORMERS_MIN`; importing this module on an
older one raises ImportError). ``generate`` takes the cache as ``cache=`` from transformers 5.24
on; 5.17-5.23 call it ``past_key_values=`` (5.24 and later still accept that, with a
FutureWarning); ``GENERATE_CACHE_ARG`` is the name for the transformers installed.

The cache keeps the most recent tokens of every layer as plain tensors and seals older tokens
into pages of `page_tokens` (LMCache's chunk is 256). A sealed page is

* compressed losslessly (exact mode, the default): generation is token-for-token what a plain
  `DynamicCache` gives, in about 0.65x of the memory for real bf16 KV;
* or, with ``fmt=`` (any `weightszip.eval.formats.KVFormat`, e.g. ``get_format("int4-g32")``,
  or ``CompactFormat("q4", Calibration.load("model.wzcal"))`` from `weightszip.compact.formats`),
  first replaced by what that format hands back for it (its ``roundtrip``), with the tokens the
  format keeps in bf16 kept so (its first ``sink_tokens``, and at least its ``recent_window`` most
  recent: ``recent_tokens`` is raised to it). This reproduces the format's effect on the model's
  outputs; it does not store the format's encoding. The page is still kept by the exact codec,
  over the format's decoded values, so it takes about what an exact page takes (``memory_report``
  counts those bytes), not the format's bits per value;
* and, given a `ChunkStore` (`store=`), offloaded to it (RAM / disk / Redis tiers) and read back
  (verified) when attention needs it, instead of being kept by the cache.

    >>> from weightszip.hf import WeightszipCache                         # doctest: +SKIP
    >>> from weightszip.store import ChunkStore                           # doctest: +SKIP
    >>> cache = WeightszipCache(model.config, store=ChunkStore("/tmp/kv", ram_bytes=1 << 28))
    >>> out = model.generate(**inputs, max_new_tokens=64, cache=cache)    # transformers >= 5.24
    >>> cache.release()                 # the pages leave the store; the cache is done

Each step reads every cold page of a layer back (decode in Rust, off the GIL): that is the price
of not keeping them. `crop`, `batch_select_indices` and `batch_repeat_interleave` give what
`DynamicCache` gives (the last two decode every page and seal it again); beam search
(`reorder_cache`) and `copy.deepcopy` of a cache with a store raise
`UnsupportedCacheOperationError` / `InvalidArgumentError`.
"""

from __future__ import annotations

import copy
import logging
import numbers
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from weightszip.models import _version_tuple, require_transformers

transformers = require_transformers("weightszip.hf")

import torch  # noqa: E402
from transformers.cache_utils import Cache, DynamicLayer  # noqa: E402

import weightszip  # noqa: E402
from weightszip.errors import InvalidArgumentError, WeightszipError  # noqa: E402
from weightszip.store import ChunkStore  # noqa: E402

logger = logging.getLogger(__name__)

#: The keyword `generate` (and a model's forward) takes the cache under with the transformers
#: installed: "cache" from 5.24 on, "past_key_values" on 5.17-5.23.
#: ``model.generate(**inputs, **{GENERATE_CACHE_ARG: cache})`` runs on both.
GENERATE_CACHE_ARG = "cache" if _version_tuple(transformers.__version__) >= (5, 24) else "past_key_values"


class UnsupportedCacheOperationError(InvalidArgumentError, NotImplementedError):
    """An operation a `WeightszipCache` does not support (beam search's `reorder_cache`). Also a
    NotImplementedError, as transformers' caches raise for what they do not implement."""


@dataclass
class _Page:
    """One sealed page: its store keys (K, V) or its compressed K and V bytes, and its sizes."""

    ref: tuple[Any, Any]
    raw: int
    stored: int


def _full_attention_types(text: Any) -> list[str]:
    """The layer types transformers' DynamicCache would build for this (text) config."""
    try:
        from transformers.cache_utils import get_layer_types_and_kwargs
    except ImportError:  # (older transformers; 5.17 has it)
        get_layer_types_and_kwargs = None
    if get_layer_types_and_kwargs is not None:
        try:
            return list(get_layer_types_and_kwargs(text)[0])
        except (AttributeError, KeyError, TypeError, ValueError):
            pass  # (it also reads each type's kwargs, which a hand-made config may lack: the types below)
    types = getattr(text, "layer_types", None)
    if types is not None:
        return list(types)
    if getattr(text, "sliding_window", None) is not None:
        return ["sliding_attention"] * text.num_hidden_layers
    if getattr(text, "attention_chunk_size", None) is not None:
        return ["chunked_attention"] * text.num_hidden_layers
    return ["full_attention"] * text.num_hidden_layers


def _pad_tensor(pad_lengths: Any) -> torch.Tensor | None:
    if pad_lengths is None:
        return None
    pads = torch.as_tensor(pad_lengths).detach().cpu()
    if pads.ndim != 1 or pads.numel() == 0 or pads.dtype.is_floating_point or pads.dtype == torch.bool:
        raise InvalidArgumentError(f"pad_lengths is one int per batch row, got {pad_lengths!r}")
    pads = pads.to(torch.int64)
    if bool((pads < 0).any()):
        raise InvalidArgumentError(f"pad_lengths must be >= 0, got {pads.tolist()}")
    return pads


class WeightszipLayer(DynamicLayer):
    """One layer: a recent window of plain K/V [batch, heads, tokens, head_dim] and sealed pages.

    Invariant: ``cumulative_length`` = pages x ``page_tokens`` + the recent window's tokens. An
    update, crop or batch operation that fails leaves the layer as it was (pages it sealed are
    deleted again)."""

    def __init__(
        self,
        layer_idx: int,
        *,
        fmt: Any = None,
        store: ChunkStore | None = None,
        namespace: str = "",
        page_tokens: int = 256,
        recent_tokens: int = 128,
        pad_lengths: Any = None,
    ):
        super().__init__()
        if (any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in (page_tokens, recent_tokens))
                or page_tokens < 1 or recent_tokens < 0):
            raise InvalidArgumentError(f"page_tokens must be an int >= 1 and recent_tokens an int >= 0, got "
                                       f"{page_tokens!r}, {recent_tokens!r}")
        self.layer_idx = layer_idx
        self.fmt = fmt
        self.store = store
        self.namespace = namespace
        self.page_tokens = page_tokens
        # a format that keeps its recent window in bf16 (the compact ones: 128 tokens) is read as it
        # would be in a paged cache only if at least that many recent tokens stay plain here
        self.recent_tokens = max(recent_tokens, int(getattr(fmt, "recent_window", 0) or 0))
        # crop rolls a format's coded tokens back into the recent window, where the format would
        # have kept them in bf16: exact only without a format
        self.is_croppable = fmt is None
        self._pads0 = _pad_tensor(pad_lengths)
        self._pads = self._pads0
        self.cumulative_length = 0
        self._pages: list[_Page] = []  # oldest first
        # Store keys carry a generation: a batch operation seals every page again under the next
        # one, and deletes the old keys only once every layer's new pages are in the store.
        self._generation = 0
        # Tokens at the head of the recent window that a crop decoded back from a format's page:
        # already coded, they are sealed again as they are.
        self._hot_coded = 0
        self._unusable: str | None = None  # why the layer refuses to go on (until reset)

    # -- bookkeeping ------------------------------------------------------------------------------
    @property
    def raw_bytes(self) -> int:
        return sum(p.raw for p in self._pages)

    @property
    def stored_bytes(self) -> int:
        return sum(p.stored for p in self._pages)

    def _page_key(self, i: int, kind: str, generation: int | None = None) -> str:
        g = self._generation if generation is None else generation
        return f"{self.namespace}/L{self.layer_idx}{f'/g{g}' if g else ''}/P{i}/{kind}"

    def _check_usable(self) -> None:
        if self._unusable is not None:
            raise InvalidArgumentError(
                f"this WeightszipCache {self._unusable} (layer {self.layer_idx}); reset() makes it an empty cache again"
            )

    def _discard(self, pages: list[_Page]) -> None:
        """Delete pages from the store (no-op without one). Best effort: the pages are already out
        of the cache's view, so a store that cannot delete leaves garbage, not a wrong cache."""
        if self.store is None:
            return
        for p in pages:
            for key in p.ref:
                try:
                    self.store.delete(key)
                except WeightszipError as e:
                    logger.warning("weightszip.hf: could not delete %r from the store: %s", key, e)

    # -- pages ------------------------------------------------------------------------------------
    def _code(self, x: torch.Tensor, kind: str, start: int, pad: int) -> torch.Tensor:
        """What the format hands back for a page x (rows whose sequence starts at cache slot
        `pad`) that starts at cache slot `start`; padding slots and the format's sinks as given."""
        fmt, t = self.fmt, x.shape[-2]
        lo = min(max(pad - start, 0), t)  # padding slots at the head of this page
        if lo == t:
            return x
        pos = start + lo - pad  # the position of the page's first real token
        part = x[..., lo:, :]
        # formats that code keys at their positions (the compact formats' rotary offsets) are told
        # where the page's tokens are
        kw = {"start": pos} if getattr(fmt, "position_aware", False) else {}
        coded = fmt.roundtrip(part, kind, self.layer_idx, **kw).to(x.dtype)
        # the format's sink tokens (positions below sink_tokens) stay as they were, as the
        # format's own cache keeps them in bf16
        keep = min(int(getattr(fmt, "sink_tokens", 0) or 0) - pos, t - lo)
        if keep > 0:
            coded = torch.cat([part[..., :keep, :], coded[..., keep:, :]], dim=-2)
        return torch.cat([x[..., :lo, :], coded], dim=-2) if lo else coded

    def _coded(self, x: torch.Tensor, kind: str, start: int, already: int) -> torch.Tensor:
        pads = self._pads
        if pads is None or not bool(pads.any()):
            out = self._code(x, kind, start, 0)
        else:
            out = torch.cat([self._code(x[i : i + 1], kind, start, int(p)) for i, p in enumerate(pads.tolist())], dim=0)
        if already:
            out = torch.cat([x[..., :already, :], out[..., already:, :]], dim=-2)
        return out

    def _store_page(self, k: torch.Tensor, v: torch.Tensor, i: int, generation: int) -> _Page:
        """Seal K and V as page i (exact codec): into the store under generation's keys, or as bytes."""
        k, v = k.detach().cpu().contiguous(), v.detach().cpu().contiguous()
        raw = k.numel() * k.element_size() + v.numel() * v.element_size()
        if self.store is not None:
            keys = (self._page_key(i, "k", generation), self._page_key(i, "v", generation))
            return _Page(keys, raw, sum(self.store.put_tensors({keys[0]: k, keys[1]: v})))
        blobs = (weightszip.compress(k), weightszip.compress(v))
        return _Page(blobs, raw, len(blobs[0]) + len(blobs[1]))

    def _seal(self, k: torch.Tensor, v: torch.Tensor, already: int = 0) -> None:
        i = len(self._pages)
        if self.fmt is not None:
            start = i * self.page_tokens  # pages are sealed in order from cache slot 0
            k, v = self._coded(k, "k", start, already), self._coded(v, "v", start, already)
        self._pages.append(self._store_page(k, v, i, self._generation))

    def _load(self, pages: list[_Page], device: Any = None) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Decode pages to (K, V) on `device` (default: the CPU); WeightszipError if one is missing."""
        if not pages:
            return []
        if self.store is not None:
            flat = [key for p in pages for key in p.ref]
            got = self.store.get_tensors(flat, out="torch")
            if any(t is None for t in got):
                missing = [key for key, t in zip(flat, got) if t is None]
                raise WeightszipError(f"pages of layer {self.layer_idx} left the store: {missing[:2]}")
        else:
            got = [weightszip.decompress(b, out="torch") for p in pages for b in p.ref]
        if device is not None:
            got = [t.to(device) for t in got]
        return list(zip(got[0::2], got[1::2]))

    # -- the cache layer API ----------------------------------------------------------------------
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        self._check_usable()
        _check_states(key_states, value_states, (self.keys, self.values) if self.is_initialized else None)
        if not self.is_initialized:
            if self._pads is not None and self._pads.numel() != key_states.shape[0]:
                raise InvalidArgumentError(
                    f"pad_lengths has {self._pads.numel()} rows, the batch {key_states.shape[0]}"
                )
            self.lazy_initialization(key_states, value_states)
        # Attention in this step sees the pages sealed before it and every token since, as given:
        # a compact format changes what later steps read, never the step that wrote the tokens.
        cold = self._load(self._pages, self.device)
        hot_k = torch.cat([self.keys, key_states], dim=-2)
        hot_v = torch.cat([self.values, value_states], dim=-2)
        out_k = torch.cat([k for k, _ in cold] + [hot_k], dim=-2) if cold else hot_k
        out_v = torch.cat([v for _, v in cold] + [hot_v], dim=-2) if cold else hot_v
        before = len(self._pages)
        try:
            while hot_k.shape[-2] - self.page_tokens >= self.recent_tokens:
                already = self._hot_coded if len(self._pages) == before else 0
                self._seal(hot_k[..., : self.page_tokens, :], hot_v[..., : self.page_tokens, :], already)
                hot_k, hot_v = hot_k[..., self.page_tokens :, :], hot_v[..., self.page_tokens :, :]
        except BaseException:
            # the layer stays as it was: the pages sealed by this call leave again
            self._discard(self._pages[before:])
            del self._pages[before:]
            raise
        if len(self._pages) > before:
            self._hot_coded = 0
        self.keys, self.values = hot_k, hot_v
        self.cumulative_length += key_states.shape[-2]
        return out_k, out_v

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def crop(self, tokens_to_remove: int) -> None:
        """Remove ``-tokens_to_remove`` tokens from the end (a negative value, as transformers' own
        ``crop``); a positive value is the length to keep (transformers' older meaning, which
        5.18 and later refuse): nothing happens if the layer is not longer. Whole pages past the
        new end are dropped (and deleted from the store); a page cut in two is decoded back into
        the recent window. With a format the tokens that come back stay as the format coded them
        (where the format's own cache would again hold them in bf16): not croppable for
        transformers (`is_croppable`) then."""
        if (isinstance(tokens_to_remove, torch.Tensor) and tokens_to_remove.dim() == 0
                and not (tokens_to_remove.dtype.is_floating_point or tokens_to_remove.dtype.is_complex
                         or tokens_to_remove.dtype == torch.bool)):
            tokens_to_remove = int(tokens_to_remove)  # (some transformers versions pass a 0-d tensor)
        if isinstance(tokens_to_remove, bool) or not isinstance(tokens_to_remove, numbers.Integral):
            raise InvalidArgumentError(f"crop takes a whole number of tokens, got {tokens_to_remove!r}")
        n = self.get_seq_length()
        if tokens_to_remove > 0:
            target = min(tokens_to_remove, n)
        else:
            target = max(n - abs(tokens_to_remove), 0)
        if target == n or not self.is_initialized:
            return
        self._check_usable()
        sealed = len(self._pages) * self.page_tokens
        if target >= sealed:
            self.keys = self.keys[..., : target - sealed, :]
            self.values = self.values[..., : target - sealed, :]
            self._hot_coded = min(self._hot_coded, target - sealed)
        else:
            kept, partial = divmod(target, self.page_tokens)
            # the page cut in two is read first: if it cannot be, nothing has changed
            hot = self._load([self._pages[kept]], self.device)[0] if partial else None
            dropped = self._pages[kept:]
            self._pages = self._pages[:kept]
            if hot is None:
                self.keys, self.values = self.keys[..., :0, :], self.values[..., :0, :]
            else:
                self.keys = hot[0][..., :partial, :].to(self.keys.dtype)
                self.values = hot[1][..., :partial, :].to(self.values.dtype)
            self._hot_coded = partial if self.fmt is not None else 0
            self._discard(dropped)
        self.cumulative_length = target

    def _rebatch_prepare(self, fn: Callable[[torch.Tensor], torch.Tensor]):
        """Every page decoded, `fn` applied on the batch dimension, and sealed again under the next
        generation's keys; the recent window likewise. Changes nothing of the layer (commit does):
        on failure the new pages are deleted again and the old ones are untouched."""
        self._check_usable()
        if not self.is_initialized or self.get_seq_length() == 0:
            return None
        gen = self._generation + 1
        new: list[_Page] = []
        try:
            for i, (k, v) in enumerate(self._load(self._pages)):
                new.append(self._store_page(fn(k), fn(v), i, gen))
        except BaseException:
            self._discard(new)
            raise
        pads = None if self._pads is None else fn(self._pads)
        return new, fn(self.keys), fn(self.values), gen, pads

    def _rebatch_abort(self, plan) -> None:
        if plan is not None:
            self._discard(plan[0])

    def _rebatch_commit(self, plan) -> None:
        if plan is None:
            return
        old = self._pages
        self._pages, self.keys, self.values, self._generation, self._pads = plan
        self._discard(old)

    def _rebatch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self._rebatch_commit(self._rebatch_prepare(fn))

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row `repeats` times on the batch dimension, pages included."""
        self._rebatch(_repeat_fn(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices` on the batch dimension (in that order), pages included."""
        self._rebatch(_select_fn(indices))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        raise UnsupportedCacheOperationError(
            "WeightszipCache does not support beam search (reorder_cache at every step would decode "
            "and seal every page again); use num_beams=1"
        )

    def release(self) -> None:
        """Delete this layer's pages from the store; the layer then refuses updates until reset().
        Without a store there is nothing to release (the pages go with the cache): a no-op."""
        if self.store is None:
            return
        self._discard(self._pages)
        self._pages = []
        self._unusable = "was released: its pages left the store"

    def reset(self) -> None:
        """An empty layer again (its pages deleted from the store), released or not."""
        self._discard(self._pages)
        self._pages = []
        self.keys = self.values = None
        self.is_initialized = False
        self.cumulative_length = 0
        self._hot_coded = 0
        self._pads = self._pads0
        self._unusable = None

    def __deepcopy__(self, memo):
        return _deepcopy_without_store(self, memo)


def _repeat_fn(repeats: int) -> Callable[[torch.Tensor], torch.Tensor]:
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise InvalidArgumentError(f"repeats must be an int >= 1, got {repeats!r}")
    return lambda x: x.repeat_interleave(repeats, dim=0)


def _select_fn(indices: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    idx = torch.as_tensor(indices)
    if idx.dim() != 1 or idx.numel() == 0 or idx.dtype.is_floating_point or idx.dtype == torch.bool:
        # (a 0-d or 2-d index would change the rank of every tensor of the cache)
        raise InvalidArgumentError(f"indices must be a non-empty 1-D tensor of row numbers, got {tuple(idx.shape)} "
                                   f"{idx.dtype}")
    return lambda x: x[_rows(idx, x.shape[0]).to(x.device)]


def _rows(idx: torch.Tensor, n: int) -> torch.Tensor:
    if bool(((idx < -n) | (idx >= n)).any()):
        raise InvalidArgumentError(f"row indices {idx.tolist()} out of range for a batch of {n}")
    return idx


def _check_states(k: Any, v: Any, held: tuple[torch.Tensor, torch.Tensor] | None) -> None:
    """K and V of one update: 4-D tensors [batch, heads, tokens, head_dim] of one dtype that agree on
    batch, heads and tokens (head_dim may differ), and, after the first update, with the batch,
    heads, head_dims and dtype the layer holds (a K and V that disagreed were taken, and later steps
    handed back K and V of different lengths)."""
    if not (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor)) or k.dim() != 4 or v.dim() != 4 \
            or k.shape[:3] != v.shape[:3] or k.dtype != v.dtype:
        raise InvalidArgumentError(
            f"key and value states must be tensors [batch, heads, tokens, head_dim] of one dtype that agree on "
            f"batch, heads and tokens, got {tuple(getattr(k, 'shape', ()))} {getattr(k, 'dtype', type(k).__name__)} "
            f"and {tuple(getattr(v, 'shape', ()))} {getattr(v, 'dtype', type(v).__name__)}")
    if held is None or held[0].dim() != 4:  # (a layer rolled back or reset holds empty 1-D tensors)
        return
    for new, old in zip((k, v), held):
        if (new.shape[0], new.shape[1], new.shape[3], new.dtype) != (old.shape[0], old.shape[1], old.shape[3], old.dtype):
            raise InvalidArgumentError(f"states {tuple(new.shape)} {new.dtype} do not continue the layer's "
                                       f"[{old.shape[0]}, {old.shape[1]}, T, {old.shape[3]}] {old.dtype}")


def _deepcopy_without_store(obj: Any, memo: dict) -> Any:
    if obj.store is not None:
        raise InvalidArgumentError(
            "a WeightszipCache with a store cannot be deep-copied: both copies would read and write "
            "the same store keys (and a store is not copied); build a second cache, or copy one without a store"
        )
    new = obj.__class__.__new__(obj.__class__)
    memo[id(obj)] = new
    for name, value in obj.__dict__.items():
        setattr(new, name, copy.deepcopy(value, memo))
    return new


class WeightszipCache(Cache):
    """A cache for `model.generate`: sealed pages compressed exactly (default), or holding what the
    KV format `fmt` hands back (the format's effect on outputs; memory is the exact codec's over
    those values), kept in the cache or offloaded to `store`.

    Full-attention models only: a config with sliding-window or chunked layers (``layer_types``,
    or Mistral-style ``sliding_window`` / ``attention_chunk_size``) is refused.

    ``fmt`` codes cache slot i of a page as position i, and keeps slots below the format's
    ``sink_tokens`` in bf16. A left-padded batch (``generate`` pads every row to the longest) puts
    a shorter row's first tokens after its padding: pass ``pad_lengths=`` (the padding slots of
    each row, e.g. ``(attention_mask == 0).sum(1)``) and each row is coded at its own positions
    with its own first tokens kept; without it, those rows' sinks are quantized and their keys
    coded at the wrong positions. (Exact mode does not need it.)

    ``namespace`` prefixes the store keys of the cache's pages (default: a fresh ``hf-<uuid>`` per
    cache). Two caches on one store must not share one while both hold pages: they would write and
    read the same keys, each getting the other's pages (the store cannot tell them apart).

    ``release()`` deletes the pages from the store, and the cache then refuses further updates
    (InvalidArgumentError) until ``reset()``; without a store it does nothing. A cache with a store
    cannot be deep-copied (InvalidArgumentError); without one it can.
    """

    def __init__(
        self,
        config: Any,
        *,
        fmt: Any = None,
        store: ChunkStore | None = None,
        page_tokens: int = 256,
        recent_tokens: int = 128,
        namespace: str | None = None,
        pad_lengths: Any = None,
    ):
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        types = _full_attention_types(text)
        if set(types) != {"full_attention"}:
            raise InvalidArgumentError(f"WeightszipCache supports full-attention layers only, not {sorted(set(types))}")
        if isinstance(fmt, str):
            from weightszip.eval.formats import get_format

            fmt = get_format(fmt)
        ns = namespace or f"hf-{uuid.uuid4().hex}"
        layers = [
            WeightszipLayer(
                i, fmt=fmt, store=store, namespace=ns, page_tokens=page_tokens, recent_tokens=recent_tokens,
                pad_lengths=pad_lengths,
            )
            for i in range(text.num_hidden_layers)
        ]
        super().__init__(layers=layers)
        self.store = store

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        try:
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)
        except BaseException:
            # the failed layer is as it was; the layers this forward already updated are cropped
            # back to its length, so the cache stays one consistent length
            self._align_to(self.layers[layer_idx].get_seq_length())
            raise

    def _align_to(self, length: int) -> None:
        for layer in self.layers:
            if layer.get_seq_length() > length:
                try:
                    layer.crop(length - layer.get_seq_length())
                except Exception as e:  # cannot roll back: the layer refuses to go on
                    logger.warning("weightszip.hf: layer %d could not be rolled back: %s", layer.layer_idx, e)
                    layer._unusable = f"could not be rolled back after a failed update ({e})"

    def _rebatch(self, fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
        """Every layer's pages sealed again under new keys first; only then does any layer switch
        to them (and delete its old ones). A failure leaves the whole cache as it was."""
        plans: list[Any] = []
        try:
            for layer in self.layers:
                plans.append(layer._rebatch_prepare(fn))
        except BaseException:
            for layer, plan in zip(self.layers, plans):
                layer._rebatch_abort(plan)
            raise
        for layer, plan in zip(self.layers, plans):
            layer._rebatch_commit(plan)

    def batch_repeat_interleave(self, repeats: int) -> None:
        """Repeat every row `repeats` times (prefix sharing: prefill once, sample n continuations);
        decodes every page and seals it again."""
        self._rebatch(_repeat_fn(repeats))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep the rows `indices` (in that order); decodes every page and seals it again."""
        self._rebatch(_select_fn(indices))

    def memory_report(self) -> dict[str, int]:
        """Bytes of the sealed pages now held, over all layers: their tensors (raw) and what the
        exact codec made of them (stored). With ``fmt`` the tensors are the format's decoded values,
        so stored is the exact codec's size for those, not the format's encoding."""
        return {
            "sealed_raw_bytes": sum(layer.raw_bytes for layer in self.layers),
            "sealed_stored_bytes": sum(layer.stored_bytes for layer in self.layers),
            "sealed_pages": sum(len(layer._pages) for layer in self.layers),
        }

    def release(self) -> None:
        """Delete every page this cache put in its store. The cache then refuses further updates
        (InvalidArgumentError) until `reset()`. Without a store: a no-op (nothing was put in one;
        drop the cache or `reset()` it to free its pages)."""
        for layer in self.layers:
            layer.release()

    def __deepcopy__(self, memo):
        return _deepcopy_without_store(self, memo)
