"""Generation through the paged compact cache on the GPU (the kernels of ``weightszip.kernels``),
and through the reference codec, to check that both produce the same tokens.

``PagedCompactCache`` holds one sequence's cache for every layer of a model in the layout a paged
serving engine uses: per layer, K and V pools of compact pages (``compact_write`` writes them, one
16-token page per KV head, bits from the calibration's allocation) addressed through a block table,
and a bf16 side buffer with the sink tokens and the recent window. ``generate_paged`` runs a
transformers model with its own KV cache off: the prompt's forward fills the cache (its attention is
the reference format's, so the first new token is the reference's), then each new token's forward
writes its K/V (a token leaving the window is coded into its page at its position) and attends with
``PagedDecodeAttention`` (split-K, transformed domain, rotary K offsets). ``generate_reference`` is
greedy decoding with every forward inside ``weightszip.eval.kl.kv_format`` and the bound
``CompactFormat``: the reference codec's keys and values, no kernel.

    >>> out = generate_paged(model, cal, "q4", ids, max_new_tokens=64)           # doctest: +SKIP
    >>> ref = generate_reference(model, cal, "q4", ids, max_new_tokens=64)       # doctest: +SKIP
    >>> out.tokens == ref.tokens
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from weightszip._tensors import _check_size, _fits_in_memory, int_arg
from weightszip.compact import codec
from weightszip.compact.calibrate import Calibration
from weightszip.errors import InvalidArgumentError
from weightszip.models import attention_shape, greedy_decode

ATTN_NAME = "weightszip_paged_compact"


class PagedCompactCache:
    """One sequence's compact cache on the GPU, all layers (block table: identity)."""

    def __init__(self, calibration: Calibration, fmt: str, *, num_q_heads: int, max_tokens: int,
                 device="cuda", block_size: int = 16, sm_scale: float | None = None):
        from weightszip.kernels import PagedDecodeAttention, compact_tables, compact_write_tables

        if not isinstance(fmt, str) or fmt not in calibration.allocation:
            raise InvalidArgumentError(f"the calibration has no format {fmt!r:.40}")
        for name, x in (("max_tokens", max_tokens), ("block_size", block_size), ("num_q_heads", num_q_heads)):
            int_arg(name, x, 1, 2**62)
        if block_size % 16:
            raise InvalidArgumentError(f"block_size must be a multiple of 16, not {block_size}")
        cal = calibration
        self.cal, self.fmt = cal, fmt
        self.L, self.H, self.d = cal.layers, cal.kv_heads, cal.head_dim
        self.S, self.W = cal.sink_tokens, cal.recent_window
        self.hq = num_q_heads
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise InvalidArgumentError(f"device {device!r:.40}: {e}") from None
        self.block_size = block_size
        nblocks = max(1, -(-max_tokens // block_size))
        self.max_tokens = nblocks * block_size
        pool = nblocks * self.H * (block_size // 16) * sum(codec.page_bytes(b, self.d) for lk in cal.allocation[fmt]
                                                           for b in lk)
        _check_size((pool,), 1)  # (before any allocation: 10**12 tokens asked for a pool of exabytes)
        self.length = [0] * self.L
        self.layers = []
        attns = {}
        with _fits_in_memory(f"the {fmt} pages of {self.max_tokens} tokens ({pool} bytes) do not fit in memory"):
            self.block_table = torch.arange(nblocks, dtype=torch.int32, device=self.device).view(1, -1)
            for layer in range(self.L):
                kb, vb = cal.allocation[fmt][layer]
                kt, vt = cal.tables(layer, "k", kb), cal.tables(layer, "v", vb)
                read = compact_tables(kt, vt, self.device)
                # layers share an attention object (its plan) where they plan alike: the same widths, and
                # the rotary term in all or none (a layer's offsets can all be zero: ``plan(rope=)``)
                key = (kb, vb, "rope_phase" in read)
                if key not in attns:
                    attns[key] = PagedDecodeAttention(
                        num_q_heads, self.H, self.d, page_type="compact", block_size=block_size, sink_tokens=self.S,
                        window=self.W, sm_scale=sm_scale, device=self.device, k_bits=kb, v_bits=vb)
                self.layers.append(dict(
                    attn=attns[key],
                    k_pages=torch.zeros(nblocks, self.H, block_size // 16, codec.page_bytes(kb, self.d),
                                        dtype=torch.uint8, device=self.device),
                    v_pages=torch.zeros(nblocks, self.H, block_size // 16, codec.page_bytes(vb, self.d),
                                        dtype=torch.uint8, device=self.device),
                    k_side=torch.zeros(1, self.S + self.W, self.H, self.d, dtype=torch.bfloat16, device=self.device),
                    v_side=torch.zeros(1, self.S + self.W, self.H, self.d, dtype=torch.bfloat16, device=self.device),
                    k_write=compact_write_tables(kt, self.device),
                    v_write=compact_write_tables(vt, self.device),
                    read=read,
                ))
        self._rope_pos = None  # (``_rope_pos_table``)
        self._planned: dict[int, int] = {}

    def _rope_pos_table(self, attn) -> torch.Tensor | None:
        """The pages' cos and sin at every page position of the cache, for a kernel config with
        ``KernelConfig.gluon_rope_pos`` (None otherwise): a model's constant (every layer's rope_phase is
        the calibration's), made at the first call that asks for it."""
        if not attn.config.gluon_rope_pos:
            return None
        if self._rope_pos is None:
            from weightszip.kernels import rope_page_table

            self._rope_pos = rope_page_table(self.cal.rope_phase.to(self.device), self.max_tokens)
        return self._rope_pos

    def _check_layer(self, layer: int) -> None:
        int_arg("layer", layer, 0, self.L - 1)

    def _slot(self, p: int) -> int:
        return p if p < self.S else self.S + p % self.W

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """The next tokens' K and V of one layer, [n, kv_heads, head_dim] bf16 (post-RoPE), at
        positions length .. length + n - 1: tokens that leave the window (or arrive beyond it) are
        coded into their pages at their positions; the others go to the side buffer."""
        from weightszip.kernels import compact_write

        self._check_layer(layer)
        for name, x in (("k", k), ("v", v)):
            if not (isinstance(x, torch.Tensor) and x.dim() == 3 and tuple(x.shape[1:]) == (self.H, self.d)):
                raise InvalidArgumentError(f"{name} must be [n, {self.H}, {self.d}], not "
                                           f"{list(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
            if x.dtype != torch.bfloat16 or x.device.type != self.device.type:  # (checked before any write)
                raise InvalidArgumentError(f"{name} must be bf16 on {self.device}, not {x.dtype} on {x.device}")
        if k.shape != v.shape:
            raise InvalidArgumentError(f"k and v must have the same shape, not {list(k.shape)} and {list(v.shape)}")
        st = self.layers[layer]
        n = k.shape[0]
        old = self.length[layer]
        new = old + n
        if new > self.max_tokens:
            raise InvalidArgumentError(f"the cache holds {self.max_tokens} tokens; {new} do not fit")
        lo, hi = max(self.S, old - self.W), max(self.S, new - self.W)  # positions newly paged
        if hi > lo:
            pos = torch.arange(lo, hi, device=self.device)
            from_side = [p for p in range(lo, hi) if p < old]
            parts_k, parts_v = [], []
            if from_side:
                slots = torch.tensor([self._slot(p) for p in from_side], device=self.device)
                parts_k.append(st["k_side"][0, slots])
                parts_v.append(st["v_side"][0, slots])
            first_new = max(lo, old)
            if hi > first_new:
                parts_k.append(k[first_new - old: hi - old])
                parts_v.append(v[first_new - old: hi - old])
            kk, vv = torch.cat(parts_k).contiguous(), torch.cat(parts_v).contiguous()
            compact_write(kk, pos, st["k_pages"], st["k_write"], pos)  # identity block table: slot = position
            compact_write(vv, pos, st["v_pages"], st["v_write"])
        side = [p for p in range(old, new) if p < self.S or p >= new - self.W]  # distinct slots
        if side:
            idx = torch.tensor([p - old for p in side], device=self.device)
            slots = torch.tensor([self._slot(p) for p in side], device=self.device)
            st["k_side"][0, slots] = k[idx]
            st["v_side"][0, slots] = v[idx]
        self.length[layer] = new

    def attend(self, layer: int, q: torch.Tensor) -> torch.Tensor:
        """Attention of the last token's queries q [num_q_heads, head_dim] over the layer's cache:
        [num_q_heads, head_dim] in q's dtype."""
        from weightszip.kernels import rope_logit_coef, transform_query

        self._check_layer(layer)
        if not (isinstance(q, torch.Tensor) and tuple(q.shape) == (self.hq, self.d)
                and q.dtype in (torch.bfloat16, torch.float16, torch.float32)):
            raise InvalidArgumentError(f"q must be bf16, fp16 or fp32 [{self.hq}, {self.d}], not "
                                       f"{list(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}"
                                       f"{' ' + str(q.dtype) if isinstance(q, torch.Tensor) else ''}")
        st, L = self.layers[layer], self.length[layer]
        attn, t = st["attn"], st["read"]
        if self._planned.get(id(attn)) != L:
            attn.plan([L], self.block_table, rope="rope_phase" in t)
            self._planned[id(attn)] = L
        qb = q.unsqueeze(0)
        qt, bias = transform_query(qb, t["k_inv_transform"], t["k_mean"], self.H)
        rope = {}
        if "rope_phase" in t:
            rope = dict(rope_coef=rope_logit_coef(qb, t["k_rope_m"], self.H), rope_phase=t["rope_phase"],
                        rope_pairs=t["rope_pairs"], rope_pos_table=self._rope_pos_table(attn))
        out = attn.run(qb, st["k_pages"], st["v_pages"], k_side=st["k_side"], v_side=st["v_side"],
                       q_transformed=qt, logit_bias=bias, v_inv_transform=t["v_inv_transform"], v_mean=t["v_mean"],
                       k_codebook=t["k_codebook"], v_codebook=t["v_codebook"], k_grid=t["k_grid"], v_grid=t["v_grid"],
                       **rope)
        return out[0]


# ----------------------------------------------------------------------- the attention hook

_CACHE: PagedCompactCache | None = None
_PREFILL_FMT = None


def _paged_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``AttentionInterface`` function: the prompt (several queries) attends as the reference format
    does and fills the cache; a single new token is written and attends through the kernel."""
    from weightszip.eval.kl import windowed_attention

    cache = _CACHE
    if cache is None:
        raise RuntimeError("weightszip paged attention called outside paged_compact_attention()")
    layer = module.layer_idx
    b, hq, t, d = query.shape
    if b != 1:
        raise InvalidArgumentError("the paged compact cache holds one sequence")
    k = key[0].transpose(0, 1).to(torch.bfloat16).contiguous()  # [t, H, d]
    v = value[0].transpose(0, 1).to(torch.bfloat16).contiguous()
    if scaling is None:
        scaling = getattr(module, "scaling", None) or d**-0.5
    if t > 1:
        if cache.length[layer] != 0:
            raise InvalidArgumentError("a prompt must be the first thing the paged cache sees")
        fmt = _PREFILL_FMT
        out = windowed_attention(query, key, value, fmt.roundtrip(key, "k", layer), fmt.roundtrip(value, "v", layer),
                                 scaling=scaling, recent_window=fmt.recent_window, sink_tokens=fmt.sink_tokens)
        cache.append(layer, k, v)
        return out.transpose(1, 2).contiguous(), None
    cache.append(layer, k, v)
    o = cache.attend(layer, query[0, :, 0, :].contiguous())  # [Hq, d]
    return o.view(1, 1, hq, d).to(query.dtype), None


@contextlib.contextmanager
def paged_compact_attention(model, cache: PagedCompactCache):
    """Within the block, ``model``'s attention layers read and write ``cache``."""
    global _CACHE, _PREFILL_FMT
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    from weightszip.compact.formats import CompactFormat

    base = model.config._attn_implementation
    AttentionInterface.register(ATTN_NAME, _paged_attention)
    AttentionMaskInterface.register(ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS[base if base in ALL_MASK_ATTENTION_FUNCTIONS else "sdpa"])
    _CACHE, _PREFILL_FMT = cache, CompactFormat(cache.fmt, cache.cal)
    model.set_attn_implementation(ATTN_NAME)
    try:
        yield cache
    finally:
        _CACHE = _PREFILL_FMT = None
        model.set_attn_implementation(base)


# ------------------------------------------------------------------------------- generation


@dataclass
class Generation:
    tokens: list[int]
    logits: list[torch.Tensor] = field(repr=False)  # the last position's logits (float32, CPU) per step


def generate_paged(model, calibration: Calibration, fmt: str, input_ids: torch.Tensor, max_new_tokens: int,
                   *, block_size: int = 16, forced: Sequence[int] | None = None) -> Generation:
    """Greedy decoding of ``max_new_tokens`` after ``input_ids`` [1, n] through a
    ``PagedCompactCache`` on the model's device (the model's own KV cache off); ``forced``: the
    tokens fed instead of the argmax (teacher forcing, ``models.greedy_decode``)."""
    a = attention_shape(model)
    dev = model.device
    n = input_ids.shape[1]
    cache = PagedCompactCache(calibration, fmt, num_q_heads=a.num_q_heads, max_tokens=n + max_new_tokens, device=dev,
                              block_size=block_size, sm_scale=a.scale)
    with torch.inference_mode(), paged_compact_attention(model, cache):
        toks, logits = greedy_decode(model, input_ids, max_new_tokens, forced=forced)
    return Generation(toks, logits)


def generate_reference(model, calibration: Calibration | None, fmt: str | None, input_ids: torch.Tensor,
                       max_new_tokens: int, *, forced: Sequence[int] | None = None) -> Generation:
    """Greedy decoding with the reference codec: each step one forward over the whole sequence in
    which every attention layer sees the format's keys and values (``kl.kv_format``); ``fmt`` None:
    the model's own bf16 keys and values. ``forced`` as in ``generate_paged``."""
    from weightszip.compact.formats import CompactFormat
    from weightszip.eval.kl import kv_format
    from weightszip.models import check_forced

    forced = check_forced(forced, max_new_tokens)
    ctx = kv_format(model, CompactFormat(fmt, calibration)) if fmt is not None else contextlib.nullcontext()
    dev = model.device
    ids = input_ids.to(dev)
    toks, logits = [], []
    with torch.inference_mode(), ctx:
        for _ in range(max_new_tokens):
            out = model(input_ids=ids, use_cache=False, logits_to_keep=1).logits[0, -1].float()
            nxt = int(out.argmax())
            toks.append(nxt)
            logits.append(out.cpu())
            if forced is not None and len(toks) < max_new_tokens:
                nxt = forced[len(toks) - 1]
            ids = torch.cat([ids, torch.tensor([[nxt]], device=dev)], dim=1)
    return Generation(toks, logits)


def generate_cached(model, input_ids: torch.Tensor, max_new_tokens: int, *,
                    forced: Sequence[int] | None = None) -> Generation:
    """Greedy decoding through the model's own KV cache (its bf16 keys and values, one token at a
    time; no format): against ``generate_reference(model, None, None, ...)``, the rounding floor of
    one-token-at-a-time decoding against whole-sequence forwards. ``forced`` as in ``generate_paged``."""
    with torch.inference_mode():
        toks, logits = greedy_decode(model, input_ids, max_new_tokens, forced=forced, own_cache=True)
    return Generation(toks, logits)


def bf16_logit_tolerance(reference: Generation, ulps: int = 4) -> float:
    """``ulps`` units in the last place of bf16 at the magnitude of the reference's largest logit:
    how far two paths' bf16 logits may be apart from rounding alone (K and V computed one token at
    a time against a whole-sequence forward, fp32 split-K against one fp32 softmax)."""
    top = max(float(x.abs().max()) for x in reference.logits)
    return ulps * 2.0 ** (math.floor(math.log2(top)) - 7) if top > 0 else 0.0


def forced_agreement(candidate: Generation, reference: Generation, tolerance: float) -> dict:
    """Compare a teacher-forced ``candidate`` (fed the reference's tokens: ``forced=reference.tokens``)
    with the ``reference`` step by step. Returns the steps, the steps whose argmax differs with, at
    each, the reference's gap between its two best logits and the two paths' largest logit difference
    there, the largest logit difference over all steps, and ``ok``: every logit difference within
    ``tolerance`` and every differing argmax at a near tie (the reference's top-2 gap no larger than
    the logit difference at that step, so that rounding alone can flip it)."""
    if len(candidate.logits) != len(reference.logits):
        raise InvalidArgumentError(f"forced_agreement: {len(candidate.logits)} steps against "
                                   f"{len(reference.logits)}")
    diffs, splits = [], []
    for step, (c, r) in enumerate(zip(candidate.logits, reference.logits)):
        d = float((c.float() - r.float()).abs().max())
        diffs.append(d)
        if int(c.argmax()) != int(r.argmax()):
            top2 = r.float().topk(2).values
            splits.append(dict(step=step, margin=float(top2[0] - top2[1]), logit_diff=d))
    max_diff = max(diffs, default=0.0)
    ok = max_diff <= tolerance and all(s["margin"] <= s["logit_diff"] for s in splits)
    return dict(steps=len(diffs), argmax_differs=splits, max_logit_diff=max_diff, tolerance=tolerance, ok=ok)
