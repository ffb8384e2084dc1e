"""KV-cache formats as the attention layer sees them: what the cache hands back at decode time,
and what it costs in bits per cached value.

A format is judged on real models by ``weightszip.eval.kl`` (KL and top-1 against the bf16 cache).
Each format here is a reference in plain PyTorch: deterministic, on any device.

The interface (``KVFormat``):

* ``roundtrip(x, kind, layer=None)``: ``x`` is one layer's K or V, [batch, kv_heads, tokens,
  head_dim], bf16, post-RoPE, for every token of the window; ``kind`` is ``"k"`` or ``"v"``.
  Returns what the cache returns for those tokens (same shape, bf16) when they are read back in
  their stored (quantized) form. Statistics that span tokens (an fp8 scale per head, a KIVI key
  group of 32 tokens) are taken over the tokens given, i.e. the window, as a calibrated or
  prefill-time scale would be.
* ``sink_tokens`` and ``recent_window``: tokens the cache keeps in bf16. The first
  ``sink_tokens`` tokens always; and, for a query at position t, the ``recent_window`` tokens
  (t - recent_window, t], a window that moves with the query (the query's own token included).
  All other tokens are seen as ``roundtrip`` returns them. ``keep_bf16_mask(T)`` spells it out.
* ``bits_per_value(context_len, head_dim, kv_heads)``: exact bits per cached K or V value for a
  cache holding ``context_len`` tokens, averaged over K and V and over the heads of one layer,
  every scale, zero point and kept bf16 token included.

Baselines registered here: ``bf16``, ``fp8`` (e4m3, per-head scale), ``int4-g32`` and
``int4-g64`` (asymmetric, groups along head_dim), ``kivi-2`` (KIVI's 2-bit scheme), and the
quantized caches that transformers ships: ``quanto``, ``hqq`` (4 bits, groups of 64, residual
128, their defaults) and ``hf-fp8``; those three are available only where their packages import
(``FormatUnavailable`` says why otherwise). Later formats join through ``register_format``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from weightszip.errors import InvalidArgumentError, UnsupportedFeatureError

KINDS = ("k", "v")
BF16_BITS = 16


class FormatUnavailable(UnsupportedFeatureError, RuntimeError):
    """A registered format that cannot run here (its package is missing or fails), with the reason:
    a `weightszip.WeightszipError` (UnsupportedFeatureError), and a RuntimeError as it always was."""


class UnknownFormatError(InvalidArgumentError, KeyError):
    """A format name that is not registered: an InvalidArgumentError, and a KeyError as it always was."""

    __str__ = Exception.__str__  # (KeyError's would quote the message)


class KVFormat:
    """Base class of a KV format; see the module docstring for the contract."""

    name: str = ""
    description: str = ""
    sink_tokens: int = 0
    recent_window: int = 0

    def roundtrip(self, x: torch.Tensor, kind: str, layer: int | None = None) -> torch.Tensor:
        raise NotImplementedError

    def stored_bits(self, n_quantized: int, head_dim: int, kv_heads: int, kind: str) -> int:
        """Bits that ``n_quantized`` tokens of one layer's K (or V) take in stored form, every
        scale and zero point included (the kept bf16 tokens are counted by ``bits_per_value``)."""
        raise NotImplementedError

    @property
    def keeps_bf16(self) -> bool:
        return self.sink_tokens > 0 or self.recent_window > 0

    def kept_tokens(self, context_len: int) -> int:
        """Tokens held in bf16 when the cache holds ``context_len`` tokens."""
        return min(context_len, self.sink_tokens + self.recent_window)

    def bits_per_value(self, context_len: int, head_dim: int, kv_heads: int) -> float:
        if context_len < 1 or head_dim < 1 or kv_heads < 1:
            raise ValueError("context_len, head_dim and kv_heads must be positive")
        kept = self.kept_tokens(context_len)
        total = 0
        for kind in KINDS:
            total += kept * head_dim * kv_heads * BF16_BITS
            total += self.stored_bits(context_len - kept, head_dim, kv_heads, kind)
        return total / (2 * context_len * head_dim * kv_heads)

    def keep_bf16_mask(self, n_tokens: int) -> torch.Tensor:
        """[queries, keys] bool: True where query t sees key s in bf16 (sinks, and s in
        (t - recent_window, t]); keys s > t are never seen. For small n (tests, plots)."""
        t = torch.arange(n_tokens).unsqueeze(1)
        s = torch.arange(n_tokens).unsqueeze(0)
        causal = s <= t
        return causal & ((s < self.sink_tokens) | (s > t - self.recent_window))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def _check(x: torch.Tensor, kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"kind must be 'k' or 'v', not {kind!r}")
    if x.ndim != 4:
        raise ValueError(f"expected [batch, kv_heads, tokens, head_dim], got shape {tuple(x.shape)}")


# --------------------------------------------------------------------------------------- bf16


class BF16(KVFormat):
    name = "bf16"
    description = "the bf16 cache itself (identity): 16 bits per value"

    def roundtrip(self, x, kind, layer=None):
        _check(x, kind)
        return x  # the same tensor: the evaluation's bf16 row is the plain forward, bit for bit

    def stored_bits(self, n_quantized, head_dim, kv_heads, kind):
        return n_quantized * head_dim * kv_heads * BF16_BITS


# ---------------------------------------------------------------------------------------- fp8

FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_BITS_FP32 = 32


class FP8PerHead(KVFormat):
    """fp8 e4m3 with one scale per (layer, kv head, K or V): scale = amax / 448 over the head's
    values in the window, stored as fp32 (32 bits per head, per layer, per K/V, counted)."""

    name = "fp8"
    description = "fp8 e4m3, scale = amax/448 per (layer, kv head, K/V), one fp32 scale each"

    def roundtrip(self, x, kind, layer=None):
        _check(x, kind)
        xf = x.float()
        amax = xf.abs().amax(dim=(2, 3), keepdim=True)  # [batch, heads, 1, 1]
        scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return (q.float() * scale).to(x.dtype)

    def stored_bits(self, n_quantized, head_dim, kv_heads, kind):
        return n_quantized * head_dim * kv_heads * 8 + kv_heads * SCALE_BITS_FP32


# ------------------------------------------------------------------------- asymmetric integers


def _affine_roundtrip(xf: torch.Tensor, dim: int, bits: int, param_dtype: torch.dtype) -> torch.Tensor:
    """Asymmetric (min/max) quantization of ``xf`` (fp32) in groups that span dimension ``dim``:
    codes in [0, 2^bits - 1], x ~ code * scale + zero with zero = group min, scale =
    (max - min) / (2^bits - 1), both stored in ``param_dtype`` (and used as stored)."""
    levels = (1 << bits) - 1
    mn = xf.amin(dim=dim, keepdim=True)
    mx = xf.amax(dim=dim, keepdim=True)
    zero = mn.to(param_dtype).float()
    scale = ((mx - mn) / levels).to(param_dtype).float()
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((xf - zero) / safe).clamp(0, levels)
    return torch.where(scale > 0, codes * scale + zero, zero.expand_as(xf))


def _whole_groups(name: str, head_dim: int, group: int) -> None:
    """Formats that group channels along head_dim run only where the groups tile it (their
    roundtrip refuses the rest), so they have no size there either."""
    if head_dim % group:
        raise FormatUnavailable(f"{name} needs head_dim a multiple of {group}, not {head_dim}")


@dataclass(frozen=True, repr=False)
class IntGroupHeadDim(KVFormat):
    """Asymmetric integer codes in groups of ``group`` consecutive channels of one token and head
    (along head_dim), with a scale and a zero point per group in ``param_dtype``."""

    bits: int = 4
    group: int = 32
    param_dtype: torch.dtype = torch.bfloat16
    name: str = "int4-g32"

    @property
    def description(self):  # type: ignore[override]
        pb = torch.finfo(self.param_dtype).bits
        return (
            f"int{self.bits} asymmetric, groups of {self.group} along head_dim, "
            f"{str(self.param_dtype).split('.')[-1]} scale + zero per group "
            f"({self.bits} + {2 * pb}/{self.group} bits)"
        )

    def roundtrip(self, x, kind, layer=None):
        _check(x, kind)
        b, h, t, d = x.shape
        if d % self.group:
            raise ValueError(f"head_dim {d} is not a multiple of the group size {self.group}")
        xf = x.float().reshape(b, h, t, d // self.group, self.group)
        return _affine_roundtrip(xf, -1, self.bits, self.param_dtype).reshape(b, h, t, d).to(x.dtype)

    def stored_bits(self, n_quantized, head_dim, kv_heads, kind):
        _whole_groups(self.name, head_dim, self.group)
        groups = head_dim // self.group
        pb = torch.finfo(self.param_dtype).bits
        return n_quantized * kv_heads * (head_dim * self.bits + groups * 2 * pb)


@dataclass(frozen=True, repr=False)
class KIVI(KVFormat):
    """KIVI (Liu et al. 2024, arXiv:2402.02750): asymmetric ``bits``-bit codes; keys per channel
    over groups of ``group`` consecutive tokens (aligned at token 0), values per token over groups
    of ``group`` channels; a scale and a zero point per group in ``param_dtype``; the most recent
    ``recent_window`` tokens in bf16.

    KIVI proper keeps the 0..group-1 keys of the unfinished token group in full precision, and a
    residual of R values; here both K and V keep exactly ``recent_window`` (>= group) recent
    tokens, which contains KIVI's key residual: every key seen quantized belongs to a complete
    group of past tokens, so the key statistics never look ahead. Scales are bf16 (KIVI: fp16;
    bf16 cannot overflow on large K channels).
    """

    bits: int = 2
    group: int = 32
    recent_window: int = 32
    param_dtype: torch.dtype = torch.bfloat16
    name: str = "kivi-2"

    def __post_init__(self):
        if self.recent_window < self.group:
            raise ValueError("KIVI needs recent_window >= group, so that key groups are complete when read")

    @property
    def description(self):  # type: ignore[override]
        return (
            f"KIVI-{self.bits}: K per channel over groups of {self.group} tokens, V per token over "
            f"groups of {self.group} channels, bf16 scale + zero per group, last {self.recent_window} tokens bf16"
        )

    def roundtrip(self, x, kind, layer=None):
        _check(x, kind)
        b, h, t, d = x.shape
        xf = x.float()
        if kind == "v":
            if d % self.group:
                raise ValueError(f"head_dim {d} is not a multiple of the group size {self.group}")
            g = xf.reshape(b, h, t, d // self.group, self.group)
            return _affine_roundtrip(g, -1, self.bits, self.param_dtype).reshape(b, h, t, d).to(x.dtype)
        full = (t // self.group) * self.group
        out = torch.empty_like(xf)
        if full:
            g = xf[:, :, :full].reshape(b, h, full // self.group, self.group, d)
            out[:, :, :full] = _affine_roundtrip(g, 3, self.bits, self.param_dtype).reshape(b, h, full, d)
        if full < t:  # an unfinished group: only ever read inside the bf16 window
            out[:, :, full:] = _affine_roundtrip(xf[:, :, full:], 2, self.bits, self.param_dtype)
        return out.to(x.dtype)

    def stored_bits(self, n_quantized, head_dim, kv_heads, kind):
        pb = torch.finfo(self.param_dtype).bits
        if kind == "v":
            _whole_groups(self.name, head_dim, self.group)
            groups_per_token = head_dim // self.group
            return n_quantized * kv_heads * (head_dim * self.bits + groups_per_token * 2 * pb)
        # Keys: whole token groups are stored once a group leaves the window (the group's later
        # tokens are then held twice, bf16 in the window and quantized, for up to group-1 steps;
        # counted as the quantized tokens rounded up to whole groups).
        token_groups = math.ceil(n_quantized / self.group)
        return kv_heads * (
            token_groups * self.group * head_dim * self.bits + token_groups * head_dim * 2 * pb
        )


# ------------------------------------------------------------- transformers' quantized caches


class TransformersQuantizedCache(KVFormat):
    """One of transformers' ``QuantizedCache`` backends (``cache_utils.QuantoQuantizedLayer``,
    ``HQQQuantizedLayer``), wrapped: ``roundtrip`` is the layer's own ``_quantize`` then
    ``_dequantize`` of the whole window's K or V, with the layer's defaults (``nbits`` 4,
    ``q_group_size`` 64, ``axis_key`` = ``axis_value`` = 0, ``residual_length`` 128).

    The residual of ``residual_length`` bf16 tokens becomes a recent window that moves with the
    query. The cache itself keeps 0..residual_length tokens in bf16 (none right after a prefill or
    a flush) and re-quantizes everything at each flush, so this emulation is the favourable case.
    Bits: ``nbits`` per value plus a bf16 scale and a bf16 zero point (or shift) per group of
    ``q_group_size`` values, plus the window in bf16.
    """

    backend = ""
    layer_class_name = ""

    def __init__(self, name: str, nbits: int = 4, q_group_size: int = 64, residual_length: int = 128):
        self.name = name
        self.nbits = nbits
        self.q_group_size = q_group_size
        self.recent_window = residual_length
        self._layer = None
        self.description = (
            f"transformers QuantizedCache(backend={self.backend!r}): {nbits} bits, groups of {q_group_size}, "
            f"bf16 scale + zero per group, last {residual_length} tokens bf16"
        )

    def _get_layer(self):
        if self._layer is None:
            try:
                from transformers import cache_utils

                cls = getattr(cache_utils, self.layer_class_name)
                self._layer = cls(nbits=self.nbits, q_group_size=self.q_group_size, residual_length=self.recent_window)
            except Exception as e:  # ImportError, or the backend refusing this platform
                reason = f"{type(e).__name__}: {e}"
                UNAVAILABLE[self.name] = reason
                raise FormatUnavailable(f"format {self.name!r} is unavailable: {reason}") from e
        return self._layer

    def check_available(self) -> None:
        self._get_layer()

    def roundtrip(self, x, kind, layer=None):
        _check(x, kind)
        ql = self._get_layer()
        ql.lazy_initialization(x, x)  # sets the dtype and device the backend dequantizes to
        axis = ql.axis_key if kind == "k" else ql.axis_value
        y = ql._dequantize(ql._quantize(x.contiguous(), axis=axis))
        return y.to(x.dtype).reshape(x.shape)

    def stored_bits(self, n_quantized, head_dim, kv_heads, kind):
        values = n_quantized * head_dim * kv_heads
        return values * self.nbits + math.ceil(values / self.q_group_size) * 2 * BF16_BITS


class Quanto(TransformersQuantizedCache):
    backend = "quanto"
    layer_class_name = "QuantoQuantizedLayer"


class HQQ(TransformersQuantizedCache):
    backend = "hqq"
    layer_class_name = "HQQQuantizedLayer"


class TransformersFP8Cache(KVFormat):
    """transformers' ``QuantizedCache(backend="fp8")`` (``Fp8QuantizedLayer``): e4m3 with one fp32
    scale per layer for all of K (and one for V), amax / 448 over the prefill (here the window)."""

    name = "hf-fp8"
    description = "transformers QuantizedCache(backend='fp8'): e4m3, one fp32 scale per layer and K/V"

    def __init__(self):
        self._layer = None

    def check_available(self) -> None:
        self._get_layer()

    def _get_layer(self):
        if self._layer is None:
            try:
                from transformers.cache_utils import Fp8QuantizedLayer

                self._layer = Fp8QuantizedLayer()
            except Exception as e:
                reason = f"{type(e).__name__}: {e}"
                UNAVAILABLE[self.name] = reason
                raise FormatUnavailable(f"format {self.name!r} is unavailable: {reason}") from e
        return self._layer

    def roundtrip(self, x, kind, layer=None):
        _check(x, kind)
        ql = self._get_layer()
        ql.keys = x[:0]  # _dequantize casts to self.keys.dtype
        return ql._dequantize(ql._quantize(x)).reshape(x.shape)

    def stored_bits(self, n_quantized, head_dim, kv_heads, kind):
        return n_quantized * head_dim * kv_heads * 8 + SCALE_BITS_FP32


# ---------------------------------------------------------------------------------- registry

FORMATS: dict[str, KVFormat] = {}
UNAVAILABLE: dict[str, str] = {}  # name -> why it cannot run here (filled on first use)


def register_format(fmt: KVFormat, *, replace: bool = False) -> KVFormat:
    """Make ``fmt`` available to ``get_format`` and the CLI under ``fmt.name``."""
    if not fmt.name:
        raise ValueError("a format needs a name")
    if fmt.name in FORMATS and not replace:
        raise ValueError(f"format {fmt.name!r} is already registered (pass replace=True)")
    if fmt.recent_window < 0 or fmt.sink_tokens < 0:
        raise ValueError("recent_window and sink_tokens must be >= 0")
    FORMATS[fmt.name] = fmt
    UNAVAILABLE.pop(fmt.name, None)
    return fmt


def get_format(name: str) -> KVFormat:
    """The registered format ``name``; raises ``FormatUnavailable`` (with the reason) for one that
    cannot run here, ``UnknownFormatError`` (an InvalidArgumentError and a KeyError) for an unknown name."""
    try:
        fmt = FORMATS[name]
    except KeyError:
        raise UnknownFormatError(f"unknown KV format {name!r}; registered: {', '.join(FORMATS)}") from None
    check: Callable[[], None] | None = getattr(fmt, "check_available", None)
    if check is not None:
        check()
    return fmt


def available_formats() -> dict[str, str | None]:
    """Every registered format -> None if it runs here, else the reason it does not."""
    out: dict[str, str | None] = {}
    for name in FORMATS:
        try:
            get_format(name)
            out[name] = None
        except FormatUnavailable as e:
            out[name] = UNAVAILABLE.get(name) or str(e) or "unavailable"
    return out


register_format(BF16())
register_format(FP8PerHead())
register_format(IntGroupHeadDim(bits=4, group=32, name="int4-g32"))
register_format(IntGroupHeadDim(bits=4, group=64, name="int4-g64"))
register_format(KIVI(bits=2, group=32, recent_window=32, name="kivi-2"))
register_format(Quanto("quanto"))
register_format(HQQ("hqq"))
register_format(TransformersFP8Cache())

# The compact formats (q4, q3.5, q3) register themselves; they need a model's calibration.
import weightszip.compact.formats  # noqa: E402,F401
