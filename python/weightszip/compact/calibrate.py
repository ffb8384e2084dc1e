"""Calibration of the compact KV formats: one offline pass of a model over two windows of text.

The model is only run (teacher-forced, no training; its weights are read, never changed). From
every attention layer it takes the post-RoPE queries, keys and values, and per (layer, K or V,
kv head) it derives:

* ``mu``: for V, the channel means (over the non-sink tokens), added back (times the softmax
  mass) after the sum; zero for K.
* ``rope_m`` (K): the pre-RoPE key mean of each KV head (the keys turned back by RoPE to position
  0 and averaged), kept in the RoPE pairs where it is at least a quarter of the pair's remaining
  RMS, zero in the others; with ``rope_phase`` (the model's RoPE frequencies as phase steps). The
  codec turns it to each key's position and takes it off before coding (``codec.rope_offset``). A
  post-RoPE key mean would be wrong: the pairs turn with position, so a mean over the calibration's
  positions does not hold at others. Models with a k_proj bias (Qwen2.5) need this: their keys are
  dominated by the bias (up to 200 times the rest in layer 0) in pairs that turn at every speed.
* ``mult``: a per-channel scaling before the rotation. Quantization noise after a random rotation
  is spread evenly over the rotated coordinates; undone by the scaling, channel c's error is
  proportional to s_c, while the noise level is proportional to sum_c b_c / s_c^2 (b_c: the
  channel's variance). What matters for K is the error in q . k, weighted by a_c = E[q_c^2]
  (over the KV head's query heads), for V the error after the output projection, weighted by
  a_c = the squared norms of W_o's columns for that channel. (sum a_c s_c^2)(sum b_c / s_c^2) is
  smallest for s_c = (b_c / a_c)^(1/4). K statistics (second moments) are pooled over RoPE's
  channel pairs (c, c + d/2), which a position's rotation mixes.
* ``e0``: the scale grid (16 octaves, 16 steps each) is centred on the median token maximum.
* codebooks at 2, 3, 4 and 5 bits per (layer, kind): Lloyd's algorithm (k-means in one
  dimension) on the normalized rotated values of the calibration tokens.
* a bit width per (layer, kind) for each format (q4, q3.5, q3): from the measured error each
  layer's K or V at each width causes in the residual stream (attention over sampled queries,
  sinks and the recent window kept in bf16, through W_o), relative to the residual stream it is
  added to (weighted by the post-attention norm's weights and divided by the stream's mean square
  at each sampled token: what the next norm reads), the widths that minimize the summed error
  within the format's bit budget at 131072 tokens (greedy on error saved per bit). The absolute
  error would rate early layers, whose residual stream is small (Qwen2.5: RMS 0.02 entering layer
  0, 3 at the last), as cheap and starve them.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import time
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from weightszip.compact import codec
from weightszip.compact.codec import BITS_CHOICES, GRID_STEPS_PER_OCTAVE, HeadTables
from weightszip.errors import WeightszipError

# (defined without torch, for the capacity calculator: weightszip._compact_budget)
from weightszip._compact_budget import BUDGET_CONTEXT, RECENT_WINDOW, SINK_TOKENS, TARGETS, table_bits_bound

# the most tokens a calibration file may ask to keep in bf16 (sinks, and the recent window): readers
# size their bf16 rings from these, so a file cannot make them allocate without bound
MAX_KEPT_TOKENS = 1 << 16
CALIBRATION_KIND = "weightszip-compact-calibration"
CALIBRATION_VERSION = 2  # reads 1 too (no rotary offsets)
ROPE_OFFSET_MIN_RATIO = 0.25
KINDS = ("k", "v")


class CalibrationError(WeightszipError, ValueError):
    """A calibration file that is not one, or does not fit the model it is used with: a
    WeightszipError, as every failure of the package is, and a ValueError, as it has always been."""


# ----------------------------------------------------------------------------- the calibration


@dataclass
class Calibration:
    """Everything the compact formats need for one model (see ``save``/``load`` for the file)."""

    layers: int
    kv_heads: int
    head_dim: int
    mu: torch.Tensor  # int64 [L, 2, H, d]
    mult: torch.Tensor  # int64 [L, 2, H, d]
    signs: torch.Tensor  # int64 [d]
    e0: torch.Tensor  # int64 [L, 2, H]
    codebooks: dict[int, torch.Tensor]  # bits -> float32 [L, 2, 2**bits]
    allocation: dict[str, list[list[int]]]  # format -> [layer][kind] bits
    rope_m: torch.Tensor | None = None  # int64 [L, H, d]: pre-RoPE K means (units of 2**-16); None: none
    rope_phase: torch.Tensor | None = None  # int64 [d/2]: RoPE phase step per position (2 pi / 2**48)
    sink_tokens: int = SINK_TOKENS
    recent_window: int = RECENT_WINDOW
    meta: dict = field(default_factory=dict)

    def tables(self, layer: int, kind: str, bits: int) -> list[HeadTables]:
        if isinstance(layer, bool) or not isinstance(layer, numbers.Integral) or not 0 <= layer < self.layers:
            raise CalibrationError(f"layer {layer!r} is outside the calibration's {self.layers} layers")
        if kind not in KINDS or bits not in self.codebooks:
            raise CalibrationError(f"tables are of kind {' or '.join(KINDS)} and widths {sorted(self.codebooks)}, "
                                   f"not {kind!r} and {bits!r}")
        ki = KINDS.index(kind)
        return [
            HeadTables(
                mu=self.mu[layer, ki, h],
                mult=self.mult[layer, ki, h],
                signs=self.signs,
                e0=int(self.e0[layer, ki, h]),
                codebook=self.codebooks[bits][layer, ki],
                bits=bits,
                rope_m=self.rope_m[layer, h] if (kind == "k" and self.rope_m is not None) else None,
                rope_phase=self.rope_phase if (kind == "k" and self.rope_m is not None) else None,
            )
            for h in range(self.kv_heads)
        ]

    @property
    def has_rope_offsets(self) -> bool:
        return self.rope_m is not None and bool(torch.any(self.rope_m != 0))

    def table_bits(self, fmt: str) -> int:
        """Bits of the tables a format reads (mu, mult, e0, signs, its codebooks), for the
        bits-per-value count: mu int64, mult u32, e0 one byte, signs one bit, codebooks float32;
        rotary offsets: rope_m 32 bits per K channel, rope_phase 48 bits per pair."""
        if fmt not in self.allocation:
            raise CalibrationError(f"the calibration has no allocation for {fmt!r} ({', '.join(self.allocation)})")
        alloc = self.allocation[fmt]
        per_head = self.head_dim * (64 + 32) + 8
        total = self.head_dim
        if self.rope_m is not None:
            total += self.layers * self.kv_heads * self.head_dim * 32 + self.head_dim // 2 * 48
        for layer in range(self.layers):
            for ki in range(2):
                total += self.kv_heads * per_head + 32 * 2 ** alloc[layer][ki]
        return total

    def bits_per_value(self, fmt: str, context_len: int) -> float:
        """Bits per cached value with ``context_len`` tokens: codes, scale indices, the kept bf16
        tokens and the tables, over all layers, K and V (``bits_fraction`` exactly)."""
        return float(self.bits_fraction(fmt, context_len))

    def bits_fraction(self, fmt: str, context_len: int) -> Fraction:
        if fmt not in self.allocation:
            raise CalibrationError(f"the calibration has no allocation for {fmt!r} ({', '.join(self.allocation)})")
        if context_len < 1:
            raise CalibrationError("context_len must be positive")
        alloc = self.allocation[fmt]
        kept = min(context_len, self.sink_tokens + self.recent_window)
        stored = context_len - kept
        values_per_token = self.head_dim * self.kv_heads
        total = 0
        for layer in range(self.layers):
            for ki in range(2):
                b = alloc[layer][ki]
                total += kept * values_per_token * 16
                total += stored * self.kv_heads * (b * self.head_dim + 8)
        total += self.table_bits(fmt)
        return Fraction(total, 2 * self.layers * context_len * values_per_token)

    def check_model(self, layers: int, kv_heads: int, head_dim: int) -> None:
        if (layers, kv_heads, head_dim) != (self.layers, self.kv_heads, self.head_dim):
            raise CalibrationError(
                f"the calibration is for {self.layers} layers x {self.kv_heads} kv heads x head_dim "
                f"{self.head_dim}, the model has {layers} x {kv_heads} x {head_dim}"
            )

    # --------------------------------------------------------------------------- file

    def save(self, path, *, overwrite: bool = True) -> None:
        """A weightszip container (checksummed) of named tensors: ``meta`` (UTF-8 JSON as uint8),
        ``mu``, ``mult``, ``signs``, ``e0`` and ``codebook_2`` .. ``codebook_5``. With
        ``overwrite=False`` an existing file is left as it is (``OutputExistsError``)."""
        import weightszip

        self.validate()  # (a calibration that load would refuse is not written)
        meta = dict(self.meta)
        meta.update(
            kind=CALIBRATION_KIND,
            version=CALIBRATION_VERSION,
            layers=self.layers,
            kv_heads=self.kv_heads,
            head_dim=self.head_dim,
            sink_tokens=self.sink_tokens,
            recent_window=self.recent_window,
            allocation={k: [[int(b) for b in lk] for lk in v] for k, v in self.allocation.items()},  # (numpy ints)
        )
        tensors = {
            "meta": np.frombuffer(json.dumps(meta, sort_keys=True).encode(), dtype=np.uint8).copy(),
            "mu": self.mu.numpy(),
            "mult": self.mult.numpy(),
            "signs": self.signs.numpy(),
            "e0": self.e0.numpy(),
        }
        for b, cb in self.codebooks.items():
            tensors[f"codebook_{b}"] = cb.numpy()
        if self.rope_m is not None:
            tensors["rope_m"] = self.rope_m.numpy()
            tensors["rope_phase"] = self.rope_phase.numpy()
        weightszip.save_file(tensors, path, overwrite=overwrite)

    @classmethod
    def load(cls, path) -> "Calibration":
        import weightszip

        t = weightszip.load_file(path)
        try:
            raw = np.asarray(t["meta"])
            if raw.dtype != np.uint8 or raw.ndim != 1:  # (an int64 or float array would be cast silently)
                raise ValueError(f"meta is {raw.dtype} {raw.shape}, not uint8 bytes")
            meta = json.loads(raw.tobytes().decode())
        except (KeyError, ValueError, UnicodeDecodeError, RecursionError) as e:  # (JSON nested 100000 deep)
            raise CalibrationError(f"{path}: no readable calibration metadata ({e!r:.200})") from e
        if not isinstance(meta, dict):
            raise CalibrationError(f"{path}: calibration metadata must be a JSON object")
        if meta.get("kind") != CALIBRATION_KIND:
            raise CalibrationError(f"{path} is not a weightszip compact calibration file")
        if meta.get("version") not in (1, CALIBRATION_VERSION):
            raise CalibrationError(f"{path}: calibration version {meta.get('version')} is not supported (this reads 1-{CALIBRATION_VERSION})")

        def table(name, dtype):  # a stored table of its documented dtype (a cast would hide NaN)
            a = np.asarray(t[name])
            if a.dtype != dtype:
                raise TypeError(f"calibration tensor {name} is {a.dtype}, not {np.dtype(dtype)}")
            return torch.from_numpy(a)

        def _list(x):  # a JSON array (a string or object would iterate as characters or keys)
            if not isinstance(x, list):
                raise TypeError(f"allocation entry {x!r:.60} is not a list")
            return x

        def _width(b):  # a JSON integer ("44" or 4.9 were read as [4, 4] and 4)
            if not isinstance(b, int) or isinstance(b, bool):
                raise TypeError(f"allocation width {b!r:.60} is not an integer")
            return b

        def count(name):  # a JSON integer (not a float, string or bool that int() would take)
            x = meta[name]
            if not isinstance(x, int) or isinstance(x, bool):
                raise TypeError(f"{name} is {x!r}, not an integer")
            return x

        try:
            L, H, d = count("layers"), count("kv_heads"), count("head_dim")
            if not isinstance(meta["allocation"], dict):
                raise TypeError("allocation is not an object")
            cal = cls(
                layers=L,
                kv_heads=H,
                head_dim=d,
                mu=table("mu", np.int64),
                mult=table("mult", np.int64),
                signs=table("signs", np.int64),
                e0=table("e0", np.int64),
                codebooks={b: table(f"codebook_{b}", np.float32) for b in BITS_CHOICES},
                allocation={k: [[_width(b) for b in _list(lk)] for lk in _list(v)] for k, v in meta["allocation"].items()},
                rope_m=table("rope_m", np.int64) if "rope_m" in t else None,
                rope_phase=table("rope_phase", np.int64) if "rope_phase" in t else None,
                sink_tokens=count("sink_tokens"),
                recent_window=count("recent_window"),
                meta=meta,
            )
        except (KeyError, TypeError, ValueError, OverflowError) as e:
            raise CalibrationError(f"{path}: incomplete calibration ({e!r})") from e
        cal.validate()
        return cal

    def validate(self) -> None:
        L, H, d = self.layers, self.kv_heads, self.head_dim
        if L < 1 or H < 1 or d < 8 or d & (d - 1):
            raise CalibrationError(f"a calibration needs layers >= 1, kv_heads >= 1 and head_dim a power of two "
                                   f">= 8, not {L} x {H} x {d}")
        shapes = {"mu": (L, 2, H, d), "mult": (L, 2, H, d), "signs": (d,), "e0": (L, 2, H)}
        for name, shape in shapes.items():
            if tuple(getattr(self, name).shape) != shape:
                raise CalibrationError(f"calibration tensor {name} has shape {tuple(getattr(self, name).shape)}, expected {shape}")
        if (self.rope_m is None) != (self.rope_phase is None):
            raise CalibrationError("rope_m and rope_phase come together")
        if self.rope_m is not None:
            if tuple(self.rope_m.shape) != (L, H, d) or tuple(self.rope_phase.shape) != (d // 2,):
                raise CalibrationError(f"rope_m must be [{L}, {H}, {d}] and rope_phase [{d // 2}]")
            if self.rope_m.dtype != torch.int64 or self.rope_phase.dtype != torch.int64:
                raise CalibrationError("rope_m and rope_phase must be int64")
        for b in BITS_CHOICES:
            if tuple(self.codebooks[b].shape) != (L, 2, 2**b):
                raise CalibrationError(f"codebook_{b} has shape {tuple(self.codebooks[b].shape)}")
        for fmt, alloc in self.allocation.items():
            if len(alloc) != L or any(len(a) != 2 or any(b not in BITS_CHOICES for b in a) for a in alloc):
                raise CalibrationError(f"allocation for {fmt} is not [layers][2] widths in {BITS_CHOICES}")
        if not (0 <= self.sink_tokens <= MAX_KEPT_TOKENS and 0 <= self.recent_window <= MAX_KEPT_TOKENS):
            raise CalibrationError(f"sink_tokens and recent_window must be in [0, {MAX_KEPT_TOKENS}], not "
                                   f"{self.sink_tokens} and {self.recent_window}")
        try:
            self._check_tables()
        except codec.CompactCodecError as e:
            raise CalibrationError(f"invalid calibration tables: {e}") from e

    def _check_tables(self) -> None:
        """Every head's tables pass ``HeadTables``'s rules (``codec.check_table_values``), checked over
        whole tensors: a file of a few KB can declare hundreds of thousands of (layer, head) pairs,
        and building their 8 ``HeadTables`` each (about 0.1 ms apiece) took minutes."""
        for name in ("mu", "mult", "signs", "e0"):
            if getattr(self, name).dtype != torch.int64:
                raise codec.CompactCodecError(f"{name} must be int64")
        cbs = [self.codebooks[b] for b in BITS_CHOICES]
        if any(cb.dtype != torch.float32 for cb in cbs):
            raise codec.CompactCodecError("codebooks must be float32")
        codec.check_table_values(cbs, self.mu, self.mult, self.signs, torch.unique(self.e0).tolist(),
                                 self.rope_m, self.rope_phase)


# ------------------------------------------------------------------------------ observation


class _Observer:
    """A KVFormat-shaped object for ``kl.kv_format``: keeps K/V (bf16) and query statistics."""

    name = "calibration-observer"
    description = "identity; records queries, keys and values"
    sink_tokens = 0
    recent_window = 0
    keeps_bf16 = False

    def __init__(self, n_query_samples: int, seed: int):
        self.n_query_samples = n_query_samples
        self.rng = np.random.default_rng(seed)
        self.k: dict[int, list] = {}
        self.v: dict[int, list] = {}
        self.q_sq: dict[int, torch.Tensor] = {}  # sum of q^2 [Hq, d] (non-sink tokens)
        self.q_n: dict[int, int] = {}
        self.q_samples: dict[int, list] = {}  # (positions, q [Hq, n, d]) per window
        self.o_proj: dict[int, torch.Tensor] = {}
        self.scaling: dict[int, float] = {}
        # the residual stream attention adds to: per window, the mean square over channels of each
        # token's stream after the addition (the post-attention norm's input) [T], and that norm's
        # weights squared [hidden] (absent for models without such a norm)
        self.stream_ms: dict[int, list] = {}
        self.norm_w2: dict[int, torch.Tensor] = {}

    def roundtrip(self, x, kind, layer=None):
        return x

    def observe(self, module, query, key, value):
        layer = module.layer_idx
        q = query[0].float().cpu()  # [Hq, T, d]
        t = q.shape[1]
        s = min(SINK_TOKENS, t)
        self.q_sq[layer] = self.q_sq.get(layer, 0) + (q[:, s:] ** 2).sum(1)
        self.q_n[layer] = self.q_n.get(layer, 0) + (t - s)
        self.k.setdefault(layer, []).append(key[0].transpose(0, 1).to(torch.bfloat16).cpu().clone())  # [T, H, d]
        self.v.setdefault(layer, []).append(value[0].transpose(0, 1).to(torch.bfloat16).cpu().clone())
        lo = min(t - 1, RECENT_WINDOW + SINK_TOKENS)  # queries that see some quantized tokens
        pos = np.sort(self.rng.choice(np.arange(lo, t), size=min(self.n_query_samples, t - lo), replace=False))
        self.q_samples.setdefault(layer, []).append((torch.from_numpy(pos), q[:, pos].clone()))
        if layer not in self.o_proj:
            self.o_proj[layer] = module.o_proj.weight.detach().float().cpu()
            self.scaling[layer] = float(getattr(module, "scaling", q.shape[-1] ** -0.5))


def _decoder_layers(model):
    inner = getattr(model, "model", model)
    layers = getattr(inner, "layers", None)
    return list(layers) if layers is not None else []


def observe(model, windows: list[torch.Tensor], n_query_samples: int = 256, seed: int = 0, progress=None) -> _Observer:
    """Run the model over each window of token ids [1, N] and record what calibration needs."""
    from weightszip.eval import kl

    obs = _Observer(n_query_samples, seed)
    hooks = []
    for i, layer in enumerate(_decoder_layers(model)):
        norm = getattr(layer, "post_attention_layernorm", None)
        if norm is None:
            continue
        w = getattr(norm, "weight", None)
        if w is not None:
            obs.norm_w2[i] = w.detach().float().cpu() ** 2

        def pre_hook(module, args, i=i):
            h = args[0][0].float()  # [T, hidden]
            obs.stream_ms.setdefault(i, []).append((h**2).mean(-1).cpu())

        hooks.append(norm.register_forward_pre_hook(pre_hook))
    try:
        for ids in windows:
            with torch.inference_mode(), kl.kv_format(model, obs):  # type: ignore[arg-type]
                model.model(input_ids=ids, use_cache=False)
            if progress:
                progress(1)
    finally:
        for h in hooks:
            h.remove()
    return obs


def rope_inv_freq(model, head_dim: int) -> torch.Tensor | None:
    """The model's RoPE frequencies (radians per position, float64 [head_dim/2]) from its rotary
    embedding module, or None when it has none we can read (then no rotary offsets)."""
    inner = getattr(model, "model", model)
    rot = getattr(inner, "rotary_emb", None)
    f = getattr(rot, "inv_freq", None)
    if f is None or tuple(f.shape) != (head_dim // 2,):
        return None
    f = f.detach().double().cpu()
    if not bool(torch.all(torch.isfinite(f) & (f >= 0) & (f <= 4))):
        return None
    return f


def rope_phase_steps(inv_freq: torch.Tensor) -> torch.Tensor:
    """int64 [d/2] phase steps (units of 2 pi / 2**48 per position) of RoPE frequencies."""
    steps = torch.round(inv_freq.double() / (2 * math.pi) * 2.0**codec.PHASE_BITS).to(torch.int64)
    return steps % 2**codec.PHASE_BITS


def pre_rope_mean(windows: list[torch.Tensor], inv_freq: torch.Tensor, skip: int = SINK_TOKENS) -> torch.Tensor:
    """Mean of the keys turned back to position 0 (float64 [H, d]): each window [T, H, d] holds
    positions 0..T-1; the first ``skip`` tokens of each are left out."""
    d = windows[0].shape[-1]
    total, n = 0, 0
    for x in windows:
        t = x.shape[0]
        pos = torch.arange(skip, t, dtype=torch.float64)
        ang = pos[:, None] * inv_freq[None, :]  # [T, d/2]
        c, s_ = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]
        k = x[skip:].double()
        a, b = k[..., : d // 2], k[..., d // 2 :]
        total = total + torch.cat([a * c + b * s_, b * c - a * s_], dim=-1).sum(0)
        n += t - skip
    return total / max(n, 1)


# ----------------------------------------------------------------------------- the statistics


def _pair_pool(x: torch.Tensor) -> torch.Tensor:
    """Average over RoPE's channel pairs (c, c + d/2) (rotate_half layout) along the last dim."""
    d = x.shape[-1]
    h = (x[..., : d // 2] + x[..., d // 2 :]) / 2
    return torch.cat([h, h], dim=-1)


def _scaling(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """s_c = (b_c / a_c)^(1/4) with both floored at 1e-6 of their maximum (per head, [H, d])."""
    a = torch.maximum(a, a.amax(-1, keepdim=True) * 1e-6 + 1e-30)
    b = torch.maximum(b, b.amax(-1, keepdim=True) * 1e-6 + 1e-30)
    return (b / a) ** 0.25


def _mult_from_scale(s: torch.Tensor) -> torch.Tensor:
    """Integer multipliers 2**20 * min(s) / s per head, clamped to [1, 2**24]."""
    m = torch.round(2.0**20 * s.amin(-1, keepdim=True) / s)
    return m.clamp(1, codec.MULT_MAX).to(torch.int64)


def lloyd(values: np.ndarray, levels: int, iters: int = 40) -> np.ndarray:
    """1-D k-means (Lloyd's algorithm) from quantile initialization; ascending, strictly
    increasing levels in [-1, 1]."""
    v = np.sort(values.astype(np.float64))
    c = np.quantile(v, (np.arange(levels) + 0.5) / levels)
    for _ in range(iters):
        edges = (c[1:] + c[:-1]) / 2
        idx = np.searchsorted(edges, v)
        sums = np.bincount(idx, weights=v, minlength=levels)
        cnt = np.bincount(idx, minlength=levels)
        new = np.where(cnt > 0, sums / np.maximum(cnt, 1), c)
        if np.allclose(new, c, atol=1e-9):
            c = new
            break
        c = new
    c = np.clip(np.sort(c), -1.0, 1.0)
    for i in range(1, levels):  # strictly increasing in float32
        if np.float32(c[i]) <= np.float32(c[i - 1]):
            c[i] = np.nextafter(np.float32(c[i - 1]), np.float32(2)).astype(np.float64)
    return c.astype(np.float32)


def _normalized(y: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
    """Rotated values [T, H, d] (float32) divided by their token's grid step (the encoder's k)."""
    return y / codec.scale_steps(y, grid)[1]


def _attention_error(q_samples, k_list, v_list, kq_list, vq_list, o_proj, scaling, n_q_heads,
                     stream_ms=None, norm_w2=None) -> float:
    """Mean squared error in the residual stream (after W_o) of attention outputs over sampled
    queries when K/V are replaced by kq/vq except the sinks and each query's recent window;
    relative to the stream when ``stream_ms`` (per window, [T]) is given: each sampled token's
    error weighted by ``norm_w2`` (the next norm's weights squared) and divided by its stream's
    mean square."""
    total, count = 0.0, 0
    ms_list = stream_ms if stream_ms is not None else [None] * len(q_samples)
    for (pos, q), k, v, kq, vq, ms in zip(q_samples, k_list, v_list, kq_list, vq_list, ms_list):
        hq, n, d = q.shape
        hkv = k.shape[1]
        g = hq // hkv
        kf, vf = k.float().transpose(0, 1), v.float().transpose(0, 1)  # [H, T, d]
        kqf, vqf = kq.float().transpose(0, 1), vq.float().transpose(0, 1)
        t = kf.shape[1]
        s_idx = torch.arange(t)
        causal = s_idx.unsqueeze(0) <= pos.unsqueeze(1)  # [n, T]
        exact = (s_idx.unsqueeze(0) < SINK_TOKENS) | (s_idx.unsqueeze(0) > pos.unsqueeze(1) - RECENT_WINDOW)
        qg = q.view(hkv, g, n, d)
        s_ref = torch.einsum("hgnd,htd->hgnt", qg, kf) * scaling
        s_q = torch.where(exact, s_ref, torch.einsum("hgnd,htd->hgnt", qg, kqf) * scaling)
        p_ref = torch.softmax(s_ref.masked_fill(~causal, float("-inf")), -1)
        p_q = torch.softmax(s_q.masked_fill(~causal, float("-inf")), -1)
        o_ref = torch.einsum("hgnt,htd->hgnd", p_ref, vf)
        o_q = torch.einsum("hgnt,htd->hgnd", p_q * exact, vf) + torch.einsum("hgnt,htd->hgnd", p_q * ~exact, vqf)
        diff = (o_ref - o_q).reshape(hq, n, d).permute(1, 0, 2).reshape(n, hq * d)
        err = (diff @ o_proj.T) ** 2  # [n, hidden]
        if norm_w2 is not None:
            err = err * norm_w2
        if ms is not None:
            err = err / (ms[pos].unsqueeze(-1) + 1e-12)
        total += float(err.sum())
        count += n
    return total / max(count, 1)


_PROBE_CODEBOOK = torch.tensor([-1.0, -0.5, 0.5, 1.0])  # any valid codebook: rotate() does not read it


def fit_tables(body: torch.Tensor, a: torch.Tensor, kind: str, signs: torch.Tensor, rng, lloyd_samples: int = 400_000,
               rope_m: torch.Tensor | None = None, rope_phase: torch.Tensor | None = None,
               positions: torch.Tensor | None = None):
    """Tables of one (layer, kind) from its calibration tokens ``body`` [T, H, d] (sinks left out)
    and the channel weights ``a`` [H, d] (E[q_c^2] for K, W_o column norms^2 for V): returns
    (mu int64 [H, d], mult int64 [H, d], e0 int64 [H], {bits: codebook float32 [2**bits]}).
    K with rotary offsets: ``rope_m`` int64 [H, d], ``rope_phase`` int64 [d/2] and the tokens'
    ``positions`` [T]."""
    t, h, d = body.shape
    if t < 1:
        raise CalibrationError("no calibration tokens")
    body = body.float()
    rope = [dict(rope_m=rope_m[i], rope_phase=rope_phase) if rope_m is not None else {} for i in range(h)]
    if kind == "k":
        # Post-RoPE keys are not stationary: a pair of channels turns with the position. Their
        # offset (``rope_m``, turned to each position) is taken off before the statistics; the
        # channel offset mu stays zero, and the scaling uses the pair's second moment, which the
        # turn leaves unchanged.
        mean = torch.zeros(h, d)
        resid = body
        if rope_m is not None:
            resid = body - codec.rotary_offsets(positions, rope_m, rope_phase).float() * 2.0**-codec.FIXED_SHIFT
        a, var = _pair_pool(a), _pair_pool((resid**2).mean(0))
    else:
        mean = body.mean(0)  # [H, d]
        var = ((body - mean) ** 2).mean(0)
    mu = torch.round(mean.double() * 2**codec.FIXED_SHIFT).to(torch.int64)
    mult = _mult_from_scale(_scaling(a.float(), var))
    heads0 = [HeadTables(mu[i], mult[i], signs, 0, _PROBE_CODEBOOK, 2, **rope[i]) for i in range(h)]
    y = codec.rotate(body.to(torch.bfloat16), heads0, positions).to(torch.float32)
    med = y.abs().amax(-1).median(0).values  # [H]
    e0 = torch.tensor([int(math.floor(math.log2(max(float(m), 1e-30)))) - 8 for m in med], dtype=torch.int64)
    grids = torch.stack([codec.grid_table(int(e)) for e in e0])
    u = _normalized(y, grids).reshape(-1).numpy()
    if u.size > lloyd_samples:
        u = rng.choice(u, size=lloyd_samples, replace=False)
    codebooks = {b: torch.from_numpy(lloyd(u, 2**b)) for b in BITS_CHOICES}
    return mu, mult, e0, codebooks


def calibrate(
    model,
    windows: list[torch.Tensor],
    *,
    n_query_samples: int = 256,
    seed: int = 0,
    lloyd_samples: int = 400_000,
    meta: dict | None = None,
    log=print,
    rope_offsets: bool = True,
    rope_min_ratio: float = ROPE_OFFSET_MIN_RATIO,
) -> Calibration:
    """Calibrate on token windows [1, N] (at least one; two long ones recommended).
    ``rope_offsets=False``: no rotary K offsets (faster GPU decode: the kernels skip the per-key
    rotary term; worse on models whose keys carry a bias, such as Qwen2.5)."""
    from tqdm.auto import tqdm

    from weightszip.eval.kl import model_kv_shape

    t0 = time.perf_counter()
    L, H, d = model_kv_shape(model)
    if d & (d - 1) or d < 8:
        raise CalibrationError(f"the compact formats need a power-of-two head_dim, this model has {d}")
    with tqdm(total=len(windows), desc="calibration forwards", unit="window") as bar:
        obs = observe(model, windows, n_query_samples=n_query_samples, seed=seed, progress=bar.update)
    t_forward = time.perf_counter() - t0
    rng = np.random.default_rng(seed)
    signs = torch.from_numpy(rng.choice([-1, 1], size=d)).to(torch.int64)
    inv_freq = rope_inv_freq(model, d) if rope_offsets else None
    rope_phase = rope_phase_steps(inv_freq) if inv_freq is not None else None
    mu = torch.zeros(L, 2, H, d, dtype=torch.int64)
    mult = torch.zeros(L, 2, H, d, dtype=torch.int64)
    e0 = torch.zeros(L, 2, H, dtype=torch.int64)
    rope_m = torch.zeros(L, H, d, dtype=torch.int64) if rope_phase is not None else None
    codebooks = {b: torch.zeros(L, 2, 2**b, dtype=torch.float32) for b in BITS_CHOICES}
    # filled layer by layer below; its tables() serve the error measurements of each finished layer
    cal = Calibration(L, H, d, mu, mult, signs, e0, codebooks, {}, rope_m=rope_m, rope_phase=rope_phase)
    dist = np.zeros((L, 2, len(BITS_CHOICES)))
    rope_kept = []
    for layer in tqdm(range(L), desc="calibration layers", unit="layer"):
        ks, vs = obs.k[layer], obs.v[layer]
        o_proj = obs.o_proj[layer]  # [hidden, Hq*d]
        hq = o_proj.shape[1] // d
        g = hq // H
        q_mean_sq = (obs.q_sq[layer] / obs.q_n[layer]).view(H, g, d).mean(1)  # [H, d]
        wo_sq = (o_proj**2).sum(0).view(hq, d).view(H, g, d).sum(1)  # [H, d]
        positions = torch.cat([torch.arange(SINK_TOKENS, x.shape[0]) for x in ks])
        if rope_m is not None:
            rope_m[layer] = _rope_offsets(ks, inv_freq, rope_phase, rope_min_ratio)
            rope_kept.append(int((rope_m[layer][..., : d // 2] != 0).logical_or(rope_m[layer][..., d // 2 :] != 0).sum()))
        for ki, (kind, xs) in enumerate((("k", ks), ("v", vs))):
            body = torch.cat([x[SINK_TOKENS:] for x in xs]).float()  # [T, H, d]
            a = q_mean_sq if kind == "k" else wo_sq
            rope_kw = dict(rope_m=rope_m[layer], rope_phase=rope_phase, positions=positions) if (kind == "k" and rope_m is not None) else {}
            m_, mult_, e0_, cbs = fit_tables(body, a, kind, signs, rng, lloyd_samples, **rope_kw)
            mu[layer, ki], mult[layer, ki], e0[layer, ki] = m_, mult_, e0_
            for b in BITS_CHOICES:
                codebooks[b][layer, ki] = cbs[b]
        # error each (kind, bits) causes in the residual stream, the other kind exact
        for ki, kind in enumerate(KINDS):
            for bi, b in enumerate(BITS_CHOICES):
                tabs = cal.tables(layer, kind, b)
                src = ks if kind == "k" else vs
                rq = [codec.roundtrip(x, tabs, torch.arange(x.shape[0])) for x in src]
                kq = rq if kind == "k" else ks
                vq = rq if kind == "v" else vs
                dist[layer, ki, bi] = _attention_error(
                    obs.q_samples[layer], ks, vs, kq, vq, o_proj, obs.scaling[layer], hq,
                    stream_ms=obs.stream_ms.get(layer), norm_w2=obs.norm_w2.get(layer),
                )
    allocation = {name: allocate(dist, target, L, H, d) for name, target in TARGETS.items()}
    meta = dict(meta or {})
    meta.update(
        calibration_seconds=round(time.perf_counter() - t0, 1),
        forward_seconds=round(t_forward, 1),
        window_tokens=[int(w.shape[1]) for w in windows],
        query_samples_per_window=n_query_samples,
        seed=seed,
        rope_offset_pairs_per_layer=rope_kept,
        rope_offset_min_ratio=rope_min_ratio,
        distortion={"bits": list(BITS_CHOICES), "relative_residual_mse": dist.tolist(),
                    "relative": bool(obs.stream_ms)},
        budget_context=BUDGET_CONTEXT,
    )
    cal.allocation, cal.meta = allocation, meta
    cal.validate()
    for name in TARGETS:
        log(f"{name}: {cal.bits_per_value(name, BUDGET_CONTEXT):.4f} bits/value at {BUDGET_CONTEXT} tokens; "
            f"K widths {[a[0] for a in allocation[name]]}, V widths {[a[1] for a in allocation[name]]}")
    return cal


def _rope_offsets(ks: list[torch.Tensor], inv_freq: torch.Tensor, rope_phase: torch.Tensor,
                  min_ratio: float = ROPE_OFFSET_MIN_RATIO) -> torch.Tensor:
    """rope_m int64 [H, d] of one layer from its calibration keys (windows [T, H, d] at positions
    0..T-1): the pre-RoPE mean in units of 2**-16, kept in the pairs where it is at least
    ``min_ratio`` (default ROPE_OFFSET_MIN_RATIO) of the RMS that remains once it is taken off (measured with the codec's
    own integer offsets), zero in the others."""
    d = ks[0].shape[2]
    m = pre_rope_mean(ks, inv_freq)  # float64 [H, d]
    lim = codec.ROPE_M_MAX - 1
    mi = torch.round(m * 2.0**codec.FIXED_SHIFT).clamp(-lim, lim).to(torch.int64)
    sq, n = 0, 0
    for x in ks:
        pos = torch.arange(SINK_TOKENS, x.shape[0])
        r = x[SINK_TOKENS:].double() - codec.rotary_offsets(pos, mi, rope_phase).double() * 2.0**-codec.FIXED_SHIFT
        sq = sq + (r**2).sum(0)
        n += r.shape[0]
    rms_pair = torch.sqrt((sq[:, : d // 2] + sq[:, d // 2 :]) / max(n, 1))  # [H, d/2]
    m_pair = torch.sqrt(m[:, : d // 2] ** 2 + m[:, d // 2 :] ** 2)
    keep = (m_pair >= min_ratio * rms_pair).repeat(1, 2)
    return mi * keep


def allocate(dist: np.ndarray, target: float, layers: int, kv_heads: int, head_dim: int, min_bits: int = BITS_CHOICES[0]) -> list[list[int]]:
    """Bit widths per (layer, kind) minimizing the summed error with the format's bits per value
    at BUDGET_CONTEXT tokens at most ``target`` (greedy: start at the smallest width, repeatedly
    widen the tensor with the largest error saved per bit while the budget allows)."""
    kept = SINK_TOKENS + RECENT_WINDOW
    ctx = BUDGET_CONTEXT
    overhead = kept * 16 / ctx + (ctx - kept) / ctx * 8 / head_dim
    # tables, bounded above by their size at 5-bit codebooks
    table = table_bits_bound(layers, kv_heads, head_dim)
    overhead += table / (2 * layers * ctx * head_dim * kv_heads)
    code_budget = (target - overhead) * ctx / (ctx - kept)  # average code width allowed
    n = layers * 2
    lo = BITS_CHOICES.index(min_bits)
    widths = np.full((layers, 2), lo, dtype=int)  # index into BITS_CHOICES
    if min_bits > code_budget:
        raise CalibrationError(f"{target} bits per value cannot hold {min_bits}-bit codes and their overhead")
    spent = min_bits * n
    while True:
        best, best_gain = None, 0.0
        for layer in range(layers):
            for ki in range(2):
                w = widths[layer, ki]
                if w + 1 >= len(BITS_CHOICES):
                    continue
                step = BITS_CHOICES[w + 1] - BITS_CHOICES[w]
                if spent + step > code_budget * n + 1e-9:
                    continue
                gain = (dist[layer, ki, w] - dist[layer, ki, w + 1]) / step
                if best is None or gain > best_gain:
                    best, best_gain = (layer, ki, step), gain
        if best is None:
            break
        layer, ki, step = best
        widths[layer, ki] += 1
        spent += step
    return [[BITS_CHOICES[widths[layer, ki]] for ki in range(2)] for layer in range(layers)]


def text_windows(tok, texts: list[Path], tokens: int) -> tuple[list[torch.Tensor], list[dict]]:
    """One window of ``tokens`` token ids from the start of each text (BOS as the tokenizer adds)."""
    from weightszip.models import tokenize_text

    out, info = [], []
    for p in texts:
        ids, files = tokenize_text(tok, Path(p), tokens)
        data = Path(p).read_bytes() if Path(p).is_file() else b"".join(Path(f).read_bytes() for f in files)
        out.append(ids)
        info.append({"text": str(p), "tokens": int(ids.shape[1]), "sha256": hashlib.sha256(data).hexdigest()})
    return out, info
