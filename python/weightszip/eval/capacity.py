"""Capacity calculator: how many whole long-context sessions fit on a GPU (or a node), and what a
fleet for N concurrent sessions costs, per KV-cache format.

The arithmetic (every figure in GB = 1e9 bytes, computed exactly with fractions):

    KV bytes per token   = 2 (K and V) * layers * kv_heads * head_dim * bits_per_value / 8
    KV bytes per session = KV bytes per token * context tokens
    KV budget per GPU    = memory_fraction (0.92) * GPU memory - weights / gpus - activations (4 GB)
    sessions             = floor(gpus * budget per GPU / KV bytes per session)

Weights are bf16 (2 bytes per parameter) split evenly over `gpus` GPUs (tensor parallel). A session
is a whole conversation holding its full context in every layer; no prefix sharing, no eviction.
Models on more than one GPU are bought in whole nodes (8 GPUs by default).

    >>> r = compute("llama-3.1-8b", "h100-80gb-reported", gpus=1, context=131072)
    >>> [(f.name, f.sessions_per_unit) for f in r.formats]
    [('bf16', 3), ('fp8', 6), ('kv-exact', 4), ('kv-exact4', 4), ('int4-g32', 12), ('q4', 13), ('q3.5', 15), ('q3', 18)]

Formats and GPUs are registries that later code extends (`register_format`, `register_gpu`), e.g. with
the exact bits per value a compact format measures at a given context length.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from fractions import Fraction

from weightszip import _compact_budget as compact_budget
from weightszip.cli_args import positive_int
from weightszip.errors import InvalidArgumentError, WeightszipError

GB = 10**9
GIB = 2**30

MEMORY_FRACTION = Fraction(92, 100)
ACTIVATIONS_GB_PER_GPU = Fraction(4)
WEIGHT_BYTES_PER_PARAM = 2  # bf16
GPUS_PER_NODE = 8
PRICE_RESERVED = Fraction(2)  # $ per GPU-hour
PRICE_ON_DEMAND = Fraction(361, 100)
DEFAULT_CONTEXT = 131072
DEFAULT_SESSIONS = 1000


class CapacityError(InvalidArgumentError, ValueError):
    """An input the capacity calculator cannot use (unknown model, GPU or format; bad config; no room)."""


# Numbers are taken up to 1e30 in magnitude, and 0 or at least 1e-30: far past any real figure,
# and the floats the report prints stay finite (1e400 was an OverflowError; 1e99999999 hung in parsing).
NUMBER_EXPONENT_LIMIT = 30
# Counts (--context, --sessions, --gpus, --gpus-per-node) up to 1e15 and a config's sizes up to 2**31:
# past any real figure, and the report's floats stay finite (a 320-digit --context was an OverflowError).
COUNT_LIMIT = 10**15
CONFIG_INT_LIMIT = 2**31
CONFIG_MAX_BYTES = 16 * 2**20  # a config.json is kilobytes; /dev/zero was read until memory ran out


def _regular_file(path: str, what: str) -> None:
    """``files.check_regular_file`` as a CapacityError (a FIFO hung the read, a device was read
    without end; a NUL in the name); a missing file is left to the reader."""
    from weightszip.files import check_regular_file

    try:
        check_regular_file(path)
    except InvalidArgumentError as e:
        raise CapacityError(f"cannot read {what}: {e}") from None


def _parse_frac(x) -> Fraction:
    """`_frac` without the name: ValueError with the reason."""
    lim = NUMBER_EXPONENT_LIMIT
    out_of_range = ValueError(f"{x!r} is out of range (at most 1e{lim} in magnitude, and 0 or at least 1e-{lim})")
    try:
        if isinstance(x, Fraction):
            f = x
        elif isinstance(x, float):
            f = Fraction(repr(x))
        else:
            s = str(x).strip()
            try:
                d = Decimal(s)
            except InvalidOperation:
                f = Fraction(s)  # (a ratio, 3/4)
            else:
                if not d.is_finite():
                    raise ValueError
                # (the exponent first: Fraction itself computes 10**exponent, for 1e99999999 too)
                if not d.is_zero() and abs(d.adjusted()) > lim:
                    f = None
                else:
                    f = Fraction(d)
    except (ValueError, ZeroDivisionError):
        raise ValueError(f"{x!r} is not a number") from None
    if f is None or (f and not Fraction(1, 10**lim) <= abs(f) <= 10**lim):
        raise out_of_range
    return f


def _frac(x, what: str) -> Fraction:
    """A number as an exact fraction; floats go through their shortest decimal form (4.5 -> 9/2).
    CapacityError for what is not a finite number within NUMBER_EXPONENT_LIMIT."""
    try:
        return _parse_frac(x)
    except ValueError as e:
        raise CapacityError(f"{what}: {e}") from None


# --------------------------------------------------------------------------------------------------
# Registries


@dataclass(frozen=True)
class KVFormat:
    name: str
    bits_per_value: Fraction
    description: str = ""
    # a compact format's budget: ``bits_per_value`` holds at ``budget_context`` tokens (its bf16 tokens
    # and tables included), and ``bits_at`` spreads those over the context asked for; None: fixed bits
    budget_context: int | None = None

    def bits_at(self, context: int, layers: int, kv_heads: int, head_dim: int) -> Fraction:
        """Bits per value of a session of ``context`` tokens of a model of this shape."""
        if self.budget_context is None:
            return self.bits_per_value
        return compact_budget.budget_bits(self.bits_per_value, context, layers, kv_heads, head_dim)


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: Fraction
    note: str = ""


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    kv_heads: int
    head_dim: int
    params: Fraction
    source: str = "built in"
    notes: tuple = ()
    max_context: int | None = None

    @property
    def kv_values_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim

    @property
    def weight_bytes(self) -> Fraction:
        return self.params * WEIGHT_BYTES_PER_PARAM


FORMATS: dict[str, KVFormat] = {}
GPUS: dict[str, GPU] = {}
MODELS: dict[str, ModelSpec] = {}


def register_format(name: str, bits_per_value, description: str = "", *, budget: bool = False) -> KVFormat:
    """Add or replace a KV format by its bits per cached value, all overhead included.

    Replacing is allowed on purpose: code that implements a format registers the exact bits it
    measures (e.g. `register_format("q3.5", Fraction(7219, 2048))`) over the stated figure.
    ``budget=True``: the bits are a compact format's budget at ``compact_budget.BUDGET_CONTEXT`` tokens
    (q4, q3.5, q3 without a calibration), counted at each context by ``compact_budget.budget_bits``."""
    fmt = make_format(name, bits_per_value, description, budget=budget)
    FORMATS[name] = fmt
    return fmt


def make_format(name: str, bits_per_value, description: str = "", *, budget: bool = False,
                max_bits: int | None = 64) -> KVFormat:
    """A KVFormat checked as `register_format` checks it, not registered (for ``compute``'s
    ``extra_formats``). ``max_bits=None``: no upper bound (a calibration's exact bits at a short
    context, where its tables outweigh the tokens)."""
    if not isinstance(name, str) or not name or "," in name or name != name.strip():
        raise CapacityError(f"format name {name!r}: give a non-empty name without commas or spaces around it")
    bits = _frac(bits_per_value, f"format {name!r} bits per value")
    if bits <= 0 or (max_bits is not None and bits > max_bits):
        within = "positive" if max_bits is None else f"in (0, {max_bits}]"
        raise CapacityError(f"format {name!r}: bits per value must be {within}, got {float(bits)}")
    return KVFormat(name, bits, description, compact_budget.BUDGET_CONTEXT if budget else None)


def register_gpu(name: str, memory_gb, note: str = "") -> GPU:
    """Add or replace a GPU by its memory in GB (1e9 bytes)."""
    mem = _frac(memory_gb, f"GPU {name!r} memory")
    if mem <= 0:
        raise CapacityError(f"GPU {name!r}: memory must be positive")
    gpu = GPU(name, mem, note)
    GPUS[name] = gpu
    return gpu


register_format("bf16", 16, "bf16, as the model computes it")
register_format(
    "fp8", 8,
    "8 bits per value counted; fp8 e4m3 with a per-head scale: one fp32 per layer, KV head and K/V, "
    "fixed per model and not per token, so not counted",
)
# The lossless formats' size depends on the data: these are measured on held-out real K/V (SmolLM2-135M
# and Qwen2.5-0.5B, 16 (model, layer, K/V) sets of 4096 tokens tiled to 8 KV heads x 128; every page
# byte and its 8-byte offset counted) by `measure_exact_formats`: benchmarks/exact_formats_size.py,
# benchmarks/results/exact_formats_size.json. `--kv-sample` measures them on the user's own K/V.
EXACT_DEFAULT_BITS = {"kv-exact": Fraction("11.2296"), "kv-exact4": Fraction("12.6199")}
EXACT_FORMATS = {
    "kv-exact": "weightszip KV Exact pages (lossless, bit-identical answers)",
    "kv-exact4": "weightszip KV Exact4 pages (lossless, the faster-to-decode layout)",
}
for _name, _what in EXACT_FORMATS.items():
    register_format(
        _name, EXACT_DEFAULT_BITS[_name],
        f"{_what}, at their mean size on held-out real K/V ({float(EXACT_DEFAULT_BITS[_name] / 16):.4f} of bf16); "
        "the size depends on the data: measure yours with --kv-sample",
    )
del _name, _what

register_format(
    "int4-g32", Fraction(9, 2),
    "int4 asymmetric, groups of 32 along head_dim: 4-bit codes + 16 bits of scale and zero point per group "
    "(8 bits each; `weightszip eval` runs int4-g32 with a bf16 scale and zero point, 5.0 bits, a baseline a "
    "little more accurate than the one counted here)",
)
# q4, q3.5 and q3 are budgets at 131072 tokens, their bf16 tokens and tables included: counted at
# --context by compact_budget.budget_bits (no calibration) or exactly from one (--calibration).
COMPACT_BUDGET_NOTE = (
    f"budgets at {compact_budget.BUDGET_CONTEXT} tokens, all overhead counted; at another context the "
    f"{compact_budget.SINK_TOKENS} sink + {compact_budget.RECENT_WINDOW} recent tokens kept in bf16 and the tables "
    f"(at their bound: 5-bit codebooks, rotary offsets) are counted at that context, the codes and scales of the "
    f"other tokens at what the budget leaves them; --calibration M.wzcal counts a real calibration's exact bits "
    f"(at most about these)"
)
for _name, _target in compact_budget.TARGETS.items():
    register_format(
        _name, Fraction(_target).limit_denominator(1 << 20),
        f"weightszip compact format, a budget of {_target:g} bits per value at {compact_budget.BUDGET_CONTEXT} tokens "
        f"({compact_budget.SINK_TOKENS} sink + {compact_budget.RECENT_WINDOW} recent tokens in bf16 and the tables "
        "included; counted at --context)",
        budget=True,
    )
del _name, _target

register_gpu("h100-80gb", 80, "the 80 GB on its label")
register_gpu(
    "h100-80gb-reported", Fraction(855, 10),
    "an H100 80GB as the card reports it: nvidia-smi's 81559 MiB = 79.6 GiB = 85.5 GB",
)
register_gpu("h100-nvl-94gb", 94, "the 94 GB on its label")
register_gpu("h200", 141, "the 141 GB on its label")
register_gpu("b200", 180, "the 180 GB on its label")
register_gpu("a100-80gb", 80, "the 80 GB on its label")
register_gpu("a100-40gb", 40, "the 40 GB on its label")
register_gpu("l40s", 48, "the 48 GB on its label")
register_gpu("l4", 24, "the 24 GB on its label")
register_gpu("rtx-4090", 24, "the 24 GB on its label")

MODELS["llama-3.1-8b"] = ModelSpec(
    "llama-3.1-8b", layers=32, kv_heads=8, head_dim=128, params=Fraction(803, 100) * 10**9, max_context=131072
)
MODELS["llama-3.1-70b"] = ModelSpec(
    "llama-3.1-70b", layers=80, kv_heads=8, head_dim=128, params=Fraction(706, 10) * 10**9, max_context=131072
)


# --------------------------------------------------------------------------------------------------
# The lossless formats measured on a K/V sample

EXACT_OFFSET_BYTES = 8  # an int64 offset per page (block table entry), counted with the page
EXACT_PAGE_TOKENS = 16


def measure_exact_formats(sample) -> dict[str, Fraction]:
    """Bits per value of KV Exact and KV Exact4 pages on captured K or V values, encoded by the Rust
    codec (CPU), every page byte and its 8-byte offset counted.

    ``sample``: bf16 values as 16-bit patterns (numpy int16 / uint16) or a bf16 tensor, shaped
    ``[..., tokens, kv_heads, head_dim]``; each leading index (e.g. K / V, layer) is its own stream.
    Each stream is split in time: KV Exact's window tops are fitted on its first half and both formats
    are measured on whole pages of its second half (held out), so at least 64 tokens are needed.
    The last 16 tokens of a sequence (kept in bf16 by the caches) are not counted."""
    import numpy as np

    from weightszip import kv_exact

    dtype = str(getattr(sample, "dtype", ""))
    if dtype.replace("torch.", "") not in ("bfloat16", "int16", "uint16"):
        raise CapacityError(f"K/V sample: expected bf16 values or their 16-bit patterns (int16, uint16), found {dtype}")
    try:
        a = kv_exact._bf16_bits(sample)
    except Exception as e:  # noqa: BLE001 - any unusable input is the user's to fix
        raise CapacityError(f"K/V sample: {e}") from None
    if a.ndim < 3 or a.size == 0:
        raise CapacityError(f"K/V sample must be [..., tokens, kv_heads, head_dim], got shape {list(a.shape)}")
    t, h, d = a.shape[-3:]
    half = t // 2
    pages = (t - half) // EXACT_PAGE_TOKENS
    if t < 4 * EXACT_PAGE_TOKENS:
        raise CapacityError(f"K/V sample has {t} tokens: at least {4 * EXACT_PAGE_TOKENS} are needed "
                            "(the first half fits KV Exact's tops, whole pages of the second are measured)")
    raw = stored = stored4 = 0
    for x in a.reshape(-1, t, h, d):
        bases = kv_exact.cpu_calibrate_bases(x[:half].reshape(half, h * d))
        held = np.ascontiguousarray(x[half : half + pages * EXACT_PAGE_TOKENS]).reshape(pages, EXACT_PAGE_TOKENS, h, d)
        try:
            buf, _ = kv_exact.cpu_encode_pages(held, bases)
            buf4, _ = kv_exact.cpu_encode_exact4_pages(held)
        except WeightszipError as e:  # shapes the formats do not take (head_dim not a multiple of 32, ...)
            raise CapacityError(f"K/V sample of {h} KV heads x {d}: {e}") from None
        raw += held.nbytes
        stored += len(buf) + EXACT_OFFSET_BYTES * pages
        stored4 += len(buf4) + EXACT_OFFSET_BYTES * pages
    return {"kv-exact": Fraction(16 * stored, raw), "kv-exact4": Fraction(16 * stored4, raw)}


def load_kv_sample(path: str):
    """A K/V sample file for ``measure_exact_formats``: ``.npy`` (16-bit patterns of bf16 values) or a
    ``.pt`` file holding one tensor (bf16, or int16 patterns)."""
    import numpy as np

    _regular_file(path, "--kv-sample")
    try:
        if path.endswith(".pt"):
            import torch

            x = torch.load(path, map_location="cpu", weights_only=True)
            if not isinstance(x, torch.Tensor):
                raise CapacityError(f"--kv-sample {path}: expected one tensor, found {type(x).__name__}")
            return x
        x = np.load(path, allow_pickle=False)
    except CapacityError:
        raise
    except Exception as e:  # noqa: BLE001 - unpickling and numpy raise many kinds: all mean "not readable"
        raise CapacityError(f"--kv-sample {path}: cannot read it: {type(e).__name__}: {str(e)[:200]}") from None
    if x.dtype not in (np.int16, np.uint16):
        raise CapacityError(f"--kv-sample {path}: expected the 16-bit patterns of bf16 values (int16 or uint16), "
                            f"found {x.dtype}")
    return x


# --------------------------------------------------------------------------------------------------
# Models from a Hugging Face config.json

PARAM_FIELDS = ("num_parameters", "num_params", "n_params")
_MOE_FIELDS = ("num_local_experts", "num_experts", "n_routed_experts", "moe_intermediate_size")


def parse_count(text) -> Fraction:
    """'8.03e9', '8.03B', '70.6b', '135M', '1.5T' -> a parameter count."""
    try:
        s = str(text).strip().replace("_", "")
    except ValueError as e:  # (an int past Python's 4300-digit conversion limit)
        raise CapacityError(f"parameter count: {str(e)[:100]}") from None
    mult = 1
    if s and s[-1].lower() in "kmbt":
        mult = {"k": 10**3, "m": 10**6, "b": 10**9, "t": 10**12}[s[-1].lower()]
        s = s[:-1]
    n = _frac(s, "parameter count") * mult
    if n <= 0:
        raise CapacityError(f"parameter count must be positive, got {text!r}")
    return n


def _int_field(cfg: dict, key: str, path: str) -> int:
    v = cfg.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 < v <= CONFIG_INT_LIMIT:
        raise CapacityError(f"{path}: {key} must be a positive integer of at most {CONFIG_INT_LIMIT}, got {v!r:.60}")
    return v


def estimate_params(cfg: dict, head_dim: int, path: str = "config.json") -> int:
    """Parameters of a dense Llama-style decoder (Llama, Mistral, Qwen2, SmolLM): embeddings, attention
    q/k/v/o (+ q/k/v biases where `attention_bias` is true or the model is Qwen2), a gated MLP of three
    matrices, two RMSNorms per layer and a final one; the LM head unless `tie_word_embeddings` is true
    (absent means untied)."""
    for k in _MOE_FIELDS:
        if cfg.get(k):
            raise CapacityError(f"{path}: mixture-of-experts config ({k}={cfg[k]}); give the parameter count with --params")
    h = _int_field(cfg, "hidden_size", path)
    inter = _int_field(cfg, "intermediate_size", path)
    vocab = _int_field(cfg, "vocab_size", path)
    layers = _int_field(cfg, "num_hidden_layers", path)
    heads = _int_field(cfg, "num_attention_heads", path)
    kv = cfg.get("num_key_value_heads") or heads
    q_dim, kv_dim = heads * head_dim, kv * head_dim
    attn = h * q_dim + 2 * h * kv_dim + q_dim * h
    if cfg.get("attention_bias") or cfg.get("model_type") == "qwen2":
        attn += q_dim + 2 * kv_dim
    per_layer = attn + 3 * h * inter + 2 * h
    embed = vocab * h * (1 if cfg.get("tie_word_embeddings", False) else 2)
    return layers * per_layer + embed + h


def load_config(path: str, params=None) -> ModelSpec:
    """A ModelSpec from a Hugging Face config.json (or a directory holding one)."""
    try:
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        _regular_file(path, "model config")
        with open(path, encoding="utf-8") as f:
            text = f.read(CONFIG_MAX_BYTES + 1)
    except OSError as e:
        raise CapacityError(f"cannot read model config {path!r:.300}: {e.strerror or e}") from None
    if len(text) > CONFIG_MAX_BYTES:
        raise CapacityError(f"{path}: larger than {CONFIG_MAX_BYTES} bytes; not a model config")
    try:
        cfg = json.loads(text)
    except (ValueError, RecursionError) as e:  # (JSONDecodeError, 5000-digit ints, arrays nested 100000 deep)
        raise CapacityError(f"{path} is not valid JSON: {e!r:.200}") from None
    if not isinstance(cfg, dict):
        raise CapacityError(f"{path}: expected a JSON object")
    notes = []
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
        notes.append("read the language model from text_config")
    if cfg.get("kv_lora_rank"):
        raise CapacityError(f"{path}: multi-head latent attention (kv_lora_rank) caches a latent, not K and V; not supported")
    layers = _int_field(cfg, "num_hidden_layers", path)
    heads = _int_field(cfg, "num_attention_heads", path)
    if cfg.get("num_key_value_heads") is None:
        kv_heads = heads
        notes.append(f"no num_key_value_heads: assumed {heads} (one per attention head, no GQA)")
    else:
        kv_heads = _int_field(cfg, "num_key_value_heads", path)
    if cfg.get("head_dim") is not None:
        head_dim = _int_field(cfg, "head_dim", path)
    else:
        hidden = _int_field(cfg, "hidden_size", path)
        if hidden % heads:
            raise CapacityError(f"{path}: no head_dim, and hidden_size {hidden} is not a multiple of num_attention_heads {heads}")
        head_dim = hidden // heads
        notes.append(f"head_dim = hidden_size / num_attention_heads = {head_dim}")
    if params is not None:
        n = parse_count(params)
        notes.append("parameters from --params")
    else:
        field_name = next((k for k in PARAM_FIELDS if cfg.get(k) is not None), None)
        if field_name is not None:
            n = parse_count(cfg[field_name])
            notes.append(f"parameters from the config's {field_name}")
        else:
            try:
                n = Fraction(estimate_params(cfg, head_dim, path))
            except CapacityError as e:
                raise CapacityError(f"{e} (no parameter count in the config: give --params, e.g. --params 8.03B)") from None
            notes.append(
                "parameters estimated from the config as a dense Llama-style decoder (gated MLP, "
                + ("tied" if cfg.get("tie_word_embeddings", False) else "untied")
                + " embeddings); give --params for the exact count"
            )
    sw = cfg.get("sliding_window")
    if sw and cfg.get("use_sliding_window", True) is not False:
        notes.append(f"config has sliding_window={sw}: counted as full attention in every layer (an upper bound)")
    name = cfg.get("_name_or_path") or os.path.basename(os.path.dirname(os.path.abspath(path))) or path
    max_ctx = cfg.get("max_position_embeddings")
    return ModelSpec(
        str(name), layers, kv_heads, head_dim, n, source=path, notes=tuple(notes),
        max_context=max_ctx if isinstance(max_ctx, int) else None,
    )


def resolve_model(model: str | ModelSpec, params=None) -> ModelSpec:
    if isinstance(model, os.PathLike):
        model = os.fspath(model)
    if isinstance(model, ModelSpec):
        spec = model
    elif not isinstance(model, str):
        raise CapacityError(f"model must be a name, a config path or a ModelSpec, not {type(model).__name__}")
    elif model in MODELS:
        spec = MODELS[model]
    elif model.endswith(".json") or os.path.isdir(model) or os.path.sep in model:
        return load_config(model, params)
    else:
        raise CapacityError(
            f"unknown model {model!r}: built in are {', '.join(MODELS)}; or give the path of a Hugging Face config.json"
        )
    if params is not None:
        spec = ModelSpec(
            spec.name, spec.layers, spec.kv_heads, spec.head_dim, parse_count(params), spec.source,
            spec.notes + ("parameters from --params",), spec.max_context,
        )
    return spec


# --------------------------------------------------------------------------------------------------
# The calculation


@dataclass
class FormatRow:
    name: str
    bits_per_value: Fraction  # at the report's context
    description: str
    kv_bytes_per_token: Fraction
    kv_bytes_per_session: Fraction
    sessions_per_replica: int
    sessions_per_unit: int
    vs_bf16: float | None
    vs_fp8: float | None
    fleet_units: int | None
    fleet_gpus: int | None
    cost_reserved: Fraction | None
    cost_on_demand: Fraction | None
    budget_bits: Fraction | None = None  # a compact format's budget at compact_budget.BUDGET_CONTEXT


@dataclass
class Report:
    model: ModelSpec
    gpu: GPU
    memory_gb: Fraction
    memory_source: str
    gpus: int
    gpus_per_node: int
    context: int
    weight_bytes: Fraction
    weights_source: str
    memory_fraction: Fraction
    activations_gb: Fraction
    budget_per_gpu: Fraction
    budget_total: Fraction
    kv_replication: int
    unit: str
    unit_gpus: int
    replicas_per_unit: int
    sessions_target: int
    price_reserved: Fraction
    price_on_demand: Fraction
    formats: list[FormatRow] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def row(self, name: str) -> FormatRow:
        for r in self.formats:
            if r.name == name:
                return r
        raise KeyError(name)


def _sessions(budget: Fraction, per_session: Fraction) -> int:
    return math.floor(budget / per_session) if budget > 0 else 0


def compute(
    model,
    gpu: str = "h100-80gb",
    *,
    gpus: int = 1,
    context: int = DEFAULT_CONTEXT,
    formats=None,
    sessions: int = DEFAULT_SESSIONS,
    gpu_memory_gb=None,
    params=None,
    weights_gb=None,
    gpus_per_node: int = GPUS_PER_NODE,
    memory_fraction=MEMORY_FRACTION,
    activations_gb=ACTIVATIONS_GB_PER_GPU,
    price_reserved=PRICE_RESERVED,
    price_on_demand=PRICE_ON_DEMAND,
    extra_formats=None,
) -> Report:
    """Sessions per GPU (or node) and the fleet for `sessions` concurrent sessions, per format.
    ``extra_formats``: KVFormats (``make_format``) that add to or replace the registered ones for
    this call only (the CLI's --calibration and --kv-sample)."""
    spec = resolve_model(model, params)
    table = dict(FORMATS)
    if extra_formats is not None:
        if not (isinstance(extra_formats, dict) and all(isinstance(f, KVFormat) for f in extra_formats.values())):
            raise CapacityError("extra_formats must map names to KVFormat (make_format)")
        table.update({f.name: f for f in extra_formats.values()})
    if not isinstance(gpu, str):
        raise CapacityError(f"gpu must be a name, not {type(gpu).__name__}")
    if gpu in GPUS:
        g = GPUS[gpu]
    elif gpu_memory_gb is not None:
        g = GPU(str(gpu), _frac(gpu_memory_gb, "--gpu-memory-gb"), "given by --gpu-memory-gb")
    else:
        raise CapacityError(f"unknown GPU {gpu!r}: known are {', '.join(GPUS)}; or name any GPU with --gpu-memory-gb")
    for what, v in (("--gpus", gpus), ("--context", context), ("--sessions", sessions), ("--gpus-per-node", gpus_per_node)):
        if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= COUNT_LIMIT:
            raise CapacityError(f"{what} must be a positive integer of at most 1e15, got {v!r:.60}")
    if gpus > 1:
        if gpus <= gpus_per_node and gpus_per_node % gpus:
            raise CapacityError(f"--gpus {gpus} does not divide a {gpus_per_node}-GPU node; use 1, 2, 4 or 8 (or a multiple of the node)")
        if gpus > gpus_per_node and gpus % gpus_per_node:
            raise CapacityError(f"--gpus {gpus} is more than a node: give a multiple of {gpus_per_node}")
    if gpu_memory_gb is None:
        mem, mem_src = g.memory_gb, f"the default for {g.name}" + (f": {g.note}" if g.note else "") + "; --gpu-memory-gb overrides"
    else:
        mem, mem_src = _frac(gpu_memory_gb, "--gpu-memory-gb"), "--gpu-memory-gb"
        if mem <= 0:
            raise CapacityError("--gpu-memory-gb must be positive")
    frac = _frac(memory_fraction, "--memory-fraction")
    if not 0 < frac <= 1:
        raise CapacityError("--memory-fraction must be in (0, 1]")
    act = _frac(activations_gb, "--activations-gb")
    if act < 0:
        raise CapacityError("--activations-gb must not be negative")
    if weights_gb is not None:
        wbytes = _frac(weights_gb, "--weights-gb") * GB
        if wbytes < 0:
            raise CapacityError("--weights-gb must not be negative")
        wsrc = "--weights-gb"
    else:
        wbytes = spec.weight_bytes
        wsrc = f"bf16: {_num(spec.params / 10**9, 2)}B parameters x 2 bytes"
    pr, pod = _frac(price_reserved, "--price-reserved"), _frac(price_on_demand, "--price-on-demand")
    if pr < 0 or pod < 0:
        raise CapacityError("prices must not be negative")
    if isinstance(formats, str) or not (formats is None or hasattr(formats, "__iter__")):
        raise CapacityError(f"formats must be a list of format names, not {type(formats).__name__}")
    names = list(table) if formats is None else list(formats)
    if not names:
        raise CapacityError("--formats is empty")
    for n in names:
        if not isinstance(n, str) or n not in table:
            raise CapacityError(f"unknown format {n!r:.60}: known are {', '.join(table)}")

    budget_gpu = frac * mem * GB - wbytes / gpus - act * GB
    if budget_gpu <= 0:
        need = _num((wbytes / gpus + act * GB) / frac / GB, 1)
        raise CapacityError(
            f"no room for any KV cache: {spec.name}'s weights ({_num(wbytes / GB, 2)} GB) split over {gpus} GPU(s), "
            f"plus {_num(act, 1)} GB of activations, need more than {_num(frac * 100, 0)}% of {_num(mem, 1)} GB "
            f"(each GPU would need {need} GB); use more --gpus"
        )
    budget_total = budget_gpu * gpus
    # Tensor parallelism splits KV heads over GPUs; past one head per GPU, heads are replicated (as vLLM does).
    repl = -(-gpus // spec.kv_heads) if gpus > spec.kv_heads else 1
    if gpus == 1:
        unit, unit_gpus = "GPU", 1
    elif gpus <= gpus_per_node:
        unit, unit_gpus = "node", gpus_per_node
    else:
        unit, unit_gpus = f"{gpus // gpus_per_node}-node replica", gpus
    replicas_per_unit = unit_gpus // gpus

    def bits(f: KVFormat) -> Fraction:
        return f.bits_at(context, spec.layers, spec.kv_heads, spec.head_dim)

    def per_session(b: Fraction) -> tuple[Fraction, Fraction]:
        tok = Fraction(spec.kv_values_per_token) * b / 8 * repl
        return tok, tok * context

    ref = {n: _sessions(budget_total, per_session(bits(table[n]))[1]) for n in ("bf16", "fp8") if n in table}
    rep = Report(
        model=spec, gpu=g, memory_gb=mem, memory_source=mem_src, gpus=gpus, gpus_per_node=gpus_per_node,
        context=context, weight_bytes=wbytes, weights_source=wsrc, memory_fraction=frac, activations_gb=act,
        budget_per_gpu=budget_gpu, budget_total=budget_total, kv_replication=repl, unit=unit, unit_gpus=unit_gpus,
        replicas_per_unit=replicas_per_unit, sessions_target=sessions, price_reserved=pr, price_on_demand=pod,
    )
    for n in names:
        f = table[n]
        tok, sess = per_session(bits(f))
        s_rep = _sessions(budget_total, sess)
        s_unit = s_rep * replicas_per_unit
        units = -(-sessions // s_unit) if s_unit else None
        ngpu = units * unit_gpus if units is not None else None
        rep.formats.append(
            FormatRow(
                name=n, bits_per_value=bits(f), description=f.description, kv_bytes_per_token=tok,
                kv_bytes_per_session=sess, sessions_per_replica=s_rep, sessions_per_unit=s_unit,
                budget_bits=f.bits_per_value if f.budget_context is not None else None,
                vs_bf16=s_rep / ref["bf16"] if ref.get("bf16") else None,
                vs_fp8=s_rep / ref["fp8"] if ref.get("fp8") else None,
                fleet_units=units, fleet_gpus=ngpu,
                cost_reserved=ngpu * pr if ngpu is not None else None,
                cost_on_demand=ngpu * pod if ngpu is not None else None,
            )
        )
    rep.notes = _notes(rep)
    return rep


def _notes(r: Report) -> list[str]:
    n = [
        "GB = 1e9 bytes. A session is a whole conversation holding its full context in every layer "
        "(no prefix sharing, no eviction, no offload).",
        f"KV budget per GPU = {_g(r.memory_fraction)} x GPU memory (the rest: runtime, CUDA context, fragmentation) "
        f"- weights / GPUs - {_g(r.activations_gb)} GB of activations.",
    ]
    if r.gpus > 1:
        n.append(f"Tensor parallel over {r.gpus} GPUs: weights and KV heads split evenly; bought in whole {r.gpus_per_node}-GPU nodes.")
    if r.kv_replication > 1:
        n.append(
            f"{r.gpus} GPUs > {r.model.kv_heads} KV heads: each head is held on {r.kv_replication} GPUs, "
            f"so the cache costs {r.kv_replication}x."
        )
    if r.model.max_context and r.context > r.model.max_context:
        n.append(f"--context {r.context} is beyond the model's max_position_embeddings ({r.model.max_context}).")
    n.extend(r.model.notes)
    for f in r.formats:
        if f.name == "fp8":
            scales = 2 * r.model.layers * r.model.kv_heads * 4
            n.append(f"fp8: {f.description} ({scales} bytes for {r.model.name}).")
        elif f.name == "int4-g32" or f.name.startswith("kv-exact"):
            n.append(f"{f.name}: {f.description}.")
    budgets = [f for f in r.formats if f.budget_bits is not None]
    if budgets:
        at = ", ".join(f"{f.name} {_g(f.budget_bits)} -> {_num(f.bits_per_value, 3)}" for f in budgets)
        n.append(f"{', '.join(f.name for f in budgets)}: {COMPACT_BUDGET_NOTE}. Bits per value at {r.context} tokens "
                 f"for this model: {at}.")
    return n


# --------------------------------------------------------------------------------------------------
# Output


def _num(x, digits: int) -> str:
    return f"{float(x):.{digits}f}"


def _g(x) -> str:
    """80, 85.5, 0.92: no trailing zeros."""
    return f"{float(x):g}"


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _money(v) -> str:
    return "-" if v is None else f"${float(v):,.2f}"


def _table(headers: list[str], rows: list[list[str]], left: int = 1) -> list[str]:
    w = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells):
        return "  ".join(c.ljust(w[i]) if i < left else c.rjust(w[i]) for i, c in enumerate(cells)).rstrip()

    return [line(headers), line(["-" * x for x in w])] + [line(r) for r in rows]


def _describe(r: Report) -> list[str]:
    m = r.model
    mem_gib = r.memory_gb * GB / GIB
    return [
        f"model    {m.name} ({m.source}): {m.layers} layers, {m.kv_heads} KV heads, head_dim {m.head_dim}; "
        f"weights {_num(r.weight_bytes / GB, 2)} GB ({r.weights_source})",
        f"GPU      {r.gpus} x {r.gpu.name}, {_g(r.memory_gb)} GB each = {_num(mem_gib, 2)} GiB [{r.memory_source}]",
        f"context  {r.context} tokens per session",
        f"budget   {_g(r.memory_fraction)} x {_g(r.memory_gb)} GB - {_num(r.weight_bytes / r.gpus / GB, 2)} GB weights"
        + (f" (1/{r.gpus} of {_num(r.weight_bytes / GB, 2)})" if r.gpus > 1 else "")
        + f" - {_g(r.activations_gb)} GB activations = {_num(r.budget_per_gpu / GB, 2)} GB of KV per GPU"
        + (f"; {_num(r.budget_total / GB, 2)} GB over {r.gpus} GPUs" if r.gpus > 1 else ""),
    ]


def format_text(r: Report) -> str:
    out = [f"weightszip capacity: {r.model.name} on {r.gpus} x {r.gpu.name}, {r.context} tokens", ""]
    out += ["  " + s for s in _describe(r)]
    out.append("")
    multi = r.replicas_per_unit > 1
    unit_col = f"sessions/{r.unit}" if r.gpus == 1 or r.unit != "node" else f"sessions/node ({r.gpus_per_node} GPUs)"
    headers = ["format", "bits/value", "KV GB/session"] + ([f"sessions/{r.gpus}-GPU replica"] if multi else []) + [unit_col, "vs bf16", "vs fp8"]
    rows = []
    for f in r.formats:
        rows.append(
            [f.name, _num(f.bits_per_value, 2), _num(f.kv_bytes_per_session / GB, 2)]
            + ([str(f.sessions_per_replica)] if multi else [])
            + [str(f.sessions_per_unit), _x(f.vs_bf16), _x(f.vs_fp8)]
        )
    out += _table(headers, rows)
    out.append("")
    unit_plural = "GPUs" if r.unit == "GPU" else f"{r.unit}s"
    out.append(
        f"Fleet for {r.sessions_target} concurrent sessions ({_money(r.price_reserved)}/GPU-hour reserved, "
        f"{_money(r.price_on_demand)} on demand):"
    )
    bf = next((f for f in r.formats if f.name == "bf16"), None)
    headers = ["format", f"sessions/{r.unit}", unit_plural] + ([] if r.unit == "GPU" else ["GPUs"]) + ["$/hour reserved", "$/hour on demand", "cost vs bf16"]
    rows = []
    for f in r.formats:
        vs = "-"
        if bf is not None and bf.cost_reserved and f.cost_reserved is not None:
            vs = f"{float(f.cost_reserved / bf.cost_reserved):.2f}x"
        rows.append(
            [f.name, str(f.sessions_per_unit), "does not fit" if f.fleet_units is None else str(f.fleet_units)]
            + ([] if r.unit == "GPU" else ["-" if f.fleet_gpus is None else str(f.fleet_gpus)])
            + [_money(f.cost_reserved), _money(f.cost_on_demand), vs]
        )
    out += _table(headers, rows)
    out.append("")
    out += ["note: " + s for s in r.notes]
    return "\n".join(out) + "\n"


def to_dict(r: Report) -> dict:
    m = r.model
    return {
        "model": {
            "name": m.name, "source": m.source, "layers": m.layers, "kv_heads": m.kv_heads, "head_dim": m.head_dim,
            "params": float(m.params), "weights_gb": float(r.weight_bytes / GB), "weights_source": r.weights_source,
        },
        "gpu": {"name": r.gpu.name, "memory_gb": float(r.memory_gb), "memory_source": r.memory_source},
        "gpus": r.gpus,
        "gpus_per_node": r.gpus_per_node,
        "context": r.context,
        "memory_fraction": float(r.memory_fraction),
        "activations_gb_per_gpu": float(r.activations_gb),
        "kv_budget_gb_per_gpu": float(r.budget_per_gpu / GB),
        "kv_budget_gb_total": float(r.budget_total / GB),
        "kv_replication": r.kv_replication,
        "unit": r.unit,
        "unit_gpus": r.unit_gpus,
        "formats": [
            {
                "name": f.name, "bits_per_value": float(f.bits_per_value), "description": f.description,
                **({} if f.budget_bits is None else {"budget_bits_per_value": float(f.budget_bits),
                                                     "budget_context": compact_budget.BUDGET_CONTEXT}),
                "kv_bytes_per_token": float(f.kv_bytes_per_token), "kv_gb_per_session": float(f.kv_bytes_per_session / GB),
                "sessions_per_replica": f.sessions_per_replica, "sessions_per_unit": f.sessions_per_unit,
                "speedup_vs_bf16": f.vs_bf16, "speedup_vs_fp8": f.vs_fp8,
            }
            for f in r.formats
        ],
        "fleet": {
            "sessions": r.sessions_target,
            "price_reserved_per_gpu_hour": float(r.price_reserved),
            "price_on_demand_per_gpu_hour": float(r.price_on_demand),
            "rows": [
                {
                    "format": f.name, "units": f.fleet_units, "gpus": f.fleet_gpus,
                    "usd_per_hour_reserved": None if f.cost_reserved is None else float(f.cost_reserved),
                    "usd_per_hour_on_demand": None if f.cost_on_demand is None else float(f.cost_on_demand),
                }
                for f in r.formats
            ],
        },
        "notes": r.notes,
    }


def _import_pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CapacityError("--plot needs matplotlib, which is not installed: pip install matplotlib") from None
    return plt


def plot(r: Report, path: str) -> None:
    """A bar chart: sessions per GPU/node and the fleet's $/hour, per format."""
    plt = _import_pyplot()
    from matplotlib.ticker import MaxNLocator

    names = [f.name for f in r.formats]
    x = list(range(len(names)))
    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.4))
    bars = a.bar(x, [f.sessions_per_unit for f in r.formats], color="#4c72b0")
    a.bar_label(bars)
    a.set_xticks(x, names)
    a.yaxis.set_major_locator(MaxNLocator(integer=True))
    a.set_ylabel(f"concurrent sessions per {r.unit}")
    a.set_title(f"{r.context} tokens per session", fontsize=10)
    w = 0.4
    for off, attr, price, color, label in (
        (-w / 2, "cost_reserved", r.price_reserved, "#dd8452", "reserved"),
        (w / 2, "cost_on_demand", r.price_on_demand, "#c44e52", "on demand"),
    ):
        costs = [float(getattr(f, attr)) if getattr(f, attr) is not None else 0.0 for f in r.formats]
        bars = b.bar([i + off for i in x], costs, w, color=color, label=f"{label} (\\${float(price):.2f}/GPU-hour)")
        b.bar_label(bars, labels=[f"\\${c:,.0f}" if c else "n/a" for c in costs], fontsize=8)
    b.set_xticks(x, names)
    b.set_ylabel("fleet \\$/hour")
    b.legend(fontsize=8)
    b.set_title(f"fleet for {r.sessions_target} concurrent sessions", fontsize=10)
    fig.suptitle(
        f"{r.model.name} on {r.gpus} x {r.gpu.name} ({_g(r.memory_gb)} GB each; "
        f"KV budget {_num(r.budget_total / GB, 1)} GB)"
    )
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=120)
    except OSError as e:
        raise CapacityError(f"cannot write {path}: {e.strerror or e}") from None
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------------------------------
# CLI


def _tokens(text: str) -> int:
    """131072, 128k (= 131072), 1M (= 1048576)."""
    s = text.strip().lower()
    mult = {"k": 1024, "m": 1024 * 1024}.get(s[-1:], 1)
    try:
        v = int(s[:-1] if mult > 1 else s) * mult
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a token count (e.g. 131072 or 128k)") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1 token, got {text!r}")
    return v


def _number(text: str) -> Fraction:
    try:
        return _parse_frac(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _params(text: str) -> str:
    """--params: checked here (argparse's usage error), taken as given by `compute`."""
    try:
        parse_count(text)
    except CapacityError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def add_parser(subparsers) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "capacity",
        help="concurrent long-context sessions per GPU and fleet cost, per KV format",
        description="Concurrent whole sessions per GPU (or 8-GPU node) and the fleet cost, per KV-cache format. "
        "KV budget per GPU = 0.92 x memory - bf16 weights / gpus - 4 GB activations; GB = 1e9 bytes.",
    )
    p.add_argument("--model", required=True, help=f"{' | '.join(MODELS)} | path of a Hugging Face config.json")
    p.add_argument("--gpu", required=True, help=f"one of: {', '.join(GPUS)}")
    p.add_argument("--gpu-memory-gb", type=_number, help="memory per GPU in GB (1e9 bytes); default: the named GPU's figure")
    p.add_argument("--gpus", type=positive_int, default=1, help="GPUs per model replica (tensor parallel; default 1)")
    p.add_argument("--context", type=_tokens, default=DEFAULT_CONTEXT, help="tokens per session (default 131072; 128k works)")
    p.add_argument("--formats", help=f"comma-separated KV formats (default: {','.join(FORMATS)})")
    p.add_argument("--sessions", type=positive_int, default=DEFAULT_SESSIONS, help="concurrent sessions for the fleet table (default 1000)")
    p.add_argument("--params", type=_params, help="parameter count (8.03B, 70.6e9); overrides the model's or the config's")
    p.add_argument("--weights-gb", type=_number, help="weights in GB, instead of 2 bytes per parameter (e.g. fp8 weights)")
    p.add_argument("--gpus-per-node", type=positive_int, default=GPUS_PER_NODE, help="GPUs per node (default 8)")
    p.add_argument("--memory-fraction", type=_number, default=MEMORY_FRACTION, help="share of memory usable (default 0.92)")
    p.add_argument("--activations-gb", type=_number, default=ACTIVATIONS_GB_PER_GPU, help="activations per GPU in GB (default 4)")
    p.add_argument("--price-reserved", type=_number, default=PRICE_RESERVED, help="$ per GPU-hour reserved (default 2.00)")
    p.add_argument("--price-on-demand", type=_number, default=PRICE_ON_DEMAND, help="$ per GPU-hour on demand (default 3.61)")
    p.add_argument("--json", action="store_true", help="print machine-readable JSON")
    p.add_argument("--plot", metavar="PATH.png", help="write a bar chart (needs matplotlib)")
    p.add_argument("--calibration", metavar="M.wzcal", help="count q4, q3.5, q3 at the exact bits per value of this "
                   "model's calibration (from `weightszip calibrate`) at --context; without it they are counted as "
                   f"budgets of 4, 3.5 and 3 bits at {compact_budget.BUDGET_CONTEXT} tokens with the "
                   f"{compact_budget.SINK_TOKENS + compact_budget.RECENT_WINDOW} tokens kept in bf16 and the tables "
                   "spread over --context")
    p.add_argument("--kv-sample", metavar="KV.npy", help="count kv-exact and kv-exact4 at the size their pages take "
                   "on this captured K/V ([..., tokens, kv_heads, head_dim] bf16 bits, .npy or .pt; the second "
                   "half of its tokens measured), instead of their size on our real K/V")
    p.set_defaults(fn=run)
    return p


def _calibration_formats(path: str, model: str, context: int, params=None) -> dict[str, KVFormat]:
    """q4, q3.5 and q3 at the exact bits the calibration gives them for ``model`` (``params``:
    --params, for a config the estimator cannot count). Only those names: an allocation the file
    holds for another name (bf16, fp8) is not a format of ours and changes nothing."""
    from weightszip.compact.calibrate import Calibration, CalibrationError
    from weightszip.errors import WeightszipError

    spec = resolve_model(model, params)
    try:
        cal = Calibration.load(path)
        cal.check_model(spec.layers, spec.kv_heads, spec.head_dim)
    except (CalibrationError, WeightszipError, OSError) as e:
        raise CapacityError(f"--calibration {path}: {e}") from e
    return {name: make_format(name, cal.bits_fraction(name, context),
                              f"weightszip compact format, exact bits per value at {context} tokens from {path}",
                              max_bits=None)
            for name in compact_budget.TARGETS if name in cal.allocation}


def _check_plot(path: str, inputs: list[str]) -> None:
    """--plot: a .png/.pdf/.svg path that is none of the command's inputs and no directory, FIFO or
    device (``cli.refuse_output``, as `eval kl --plot`; an existing chart is replaced)."""
    from weightszip.cli import refuse_output

    if os.path.splitext(path)[1].lower() not in (".png", ".pdf", ".svg"):
        # (matplotlib refuses other suffixes after the work, and adds .png to a path without one)
        raise CapacityError(f"--plot {path}: give a .png (or .pdf, .svg) file")
    why = refuse_output(path, inputs, force=True)
    if why is None and os.path.isdir(path):
        why = f"{path}: is a directory"
    if why is not None:
        raise CapacityError(f"--plot {why}")


def run(args) -> int:
    formats = None
    if args.formats is not None:
        formats = [s.strip() for s in args.formats.split(",") if s.strip()]
    calibration, kv_sample = getattr(args, "calibration", None), getattr(args, "kv_sample", None)
    if args.plot:
        _import_pyplot()  # fail before printing anything
        inputs = [args.model, os.path.join(args.model, "config.json")] + [p for p in (calibration, kv_sample) if p]
        _check_plot(args.plot, inputs)
    extra: dict[str, KVFormat] = {}
    if calibration:
        extra.update(_calibration_formats(calibration, args.model, args.context, args.params))
    if kv_sample:
        for name, bits in measure_exact_formats(load_kv_sample(kv_sample)).items():
            extra[name] = make_format(name, bits, f"{EXACT_FORMATS[name]}, at the size its pages take on {kv_sample} "
                                      f"({float(bits / 16):.3f} of bf16)")
    r = compute(
        args.model, args.gpu, gpus=args.gpus, context=args.context, formats=formats, sessions=args.sessions,
        gpu_memory_gb=args.gpu_memory_gb, params=args.params, weights_gb=args.weights_gb,
        gpus_per_node=args.gpus_per_node, memory_fraction=args.memory_fraction, activations_gb=args.activations_gb,
        price_reserved=args.price_reserved, price_on_demand=args.price_on_demand, extra_formats=extra,
    )
    if args.plot:
        plot(r, args.plot)
    if args.json:
        d = to_dict(r)
        if args.plot:
            d["plot"] = args.plot
        json.dump(d, sys.stdout, indent=1)
        print()
    else:
        sys.stdout.write(format_text(r))
        if args.plot:
            print(f"wrote {args.plot}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m weightszip.eval.capacity ...` (the same as `weightszip capacity ...`)."""
    p = argparse.ArgumentParser(prog="weightszip")
    add_parser(p.add_subparsers(dest="cmd", required=True))
    args = p.parse_args(["capacity", *(sys.argv[1:] if argv is None else argv)])
    try:
        return run(args)
    except CapacityError as e:
        print(f"weightszip: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
