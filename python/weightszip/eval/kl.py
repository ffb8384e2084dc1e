"""Teacher-forced KL and top-1 of a KV format against the bf16 cache, at every position.

One forward over a window of N tokens. In every attention layer, each query sees exactly the keys
and values the format hands back at decode time:

* a format without kept bf16 tokens: K and V (post-RoPE, before attention) are replaced by
  ``format.roundtrip(K)``, ``format.roundtrip(V)`` and the model's own attention runs on them
  (for ``bf16`` the very same tensors, so the logits equal a plain forward's bit for bit);
* a format with sink tokens or a recent window: the query at position t sees bf16 K/V for the
  sinks and for tokens in (t - W, t], round-tripped ones for the rest. No single K/V tensor
  expresses that, so ``windowed_attention`` (plain torch, fp32, causal, GQA, chunked over
  queries) replaces the model's attention in those layers.

The hook is a custom entry in transformers' ``AttentionInterface`` (and, for the masks, in
``AttentionMaskInterface``, mapped to the mask function of the model's own implementation); the
model's ``_attn_implementation`` points to it inside ``kv_format(model, fmt)``. Any model whose
attention dispatches through ``ALL_ATTENTION_FUNCTIONS`` works (Llama, Qwen2, Mistral, ...).
The evaluation runs one unpadded sequence (batch 1, no cache), so causality is all the mask says.

The score, at each position i, compares the next-token distributions: KL(P_bf16 || P_format) in
nats, from fp32 log-softmax of each forward's logits, and whether their argmax agree.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from weightszip.eval.formats import KVFormat, get_format

ATTN_PREFIX = "weightszip_kv_"
DEFAULT_CHUNK = 512  # queries per block of windowed_attention: SmolLM2 at 8k, [9 heads, 512, 8192] fp32 scores = 0.15 GB


# ------------------------------------------------------------------------- windowed attention


def windowed_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    key_q: torch.Tensor,
    value_q: torch.Tensor,
    *,
    scaling: float,
    recent_window: int,
    sink_tokens: int = 0,
    chunk: int = DEFAULT_CHUNK,
) -> torch.Tensor:
    """Causal attention in which query t sees key/value s in bf16 (``key``, ``value``) when s is
    one of the first ``sink_tokens`` or t - recent_window < s <= t, and as stored (``key_q``,
    ``value_q``) otherwise.

    query [batch, q_heads, T, head_dim]; key, value, key_q, value_q [batch, kv_heads, T, head_dim]
    (GQA: q_heads a multiple of kv_heads). fp32 scores, softmax and sums. Returns
    [batch, q_heads, T, head_dim] in the query's dtype.
    """
    b, hq, t, d = query.shape
    hkv, tk = key.shape[1], key.shape[2]
    if tk != t:
        raise ValueError(f"windowed_attention runs a whole sequence: {t} queries but {tk} keys")
    if hq % hkv:
        raise ValueError(f"{hq} query heads are not a multiple of {hkv} kv heads")
    g = hq // hkv
    f32 = torch.float32
    q = query.to(f32).reshape(b, hkv, g, t, d)
    kb, vb = key.to(f32), value.to(f32)
    kq = key_q.to(f32, copy=True)
    vq = value_q.to(f32, copy=True)
    s_n = min(sink_tokens, t)
    if s_n:  # sinks are bf16 for every query
        kq[:, :, :s_n] = kb[:, :, :s_n]
        vq[:, :, :s_n] = vb[:, :, :s_n]
    w = recent_window
    out = torch.empty(b, hkv, g, t, d, dtype=f32, device=query.device)
    kq_t, kb_t = kq.transpose(-1, -2), kb.transpose(-1, -2)
    for q0 in range(0, t, chunk):
        q1 = min(t, q0 + chunk)
        c = q1 - q0
        # Keys [0, b0) are seen as stored by every query of the block; keys [b0, q1) form the band
        # where bf16 (window), stored, and future (masked) keys mix.
        b0 = max(0, q0 - w + 1) if w > 0 else q0
        qc = q[:, :, :, q0:q1].reshape(b, hkv, g * c, d)
        tpos = torch.arange(q0, q1, device=query.device)[:, None]
        spos = torch.arange(b0, q1, device=query.device)[None, :]
        causal = spos <= tpos
        in_win = causal & (spos > tpos - w)  # [c, band]
        s_far = torch.matmul(qc, kq_t[..., :b0]) * scaling
        s_stored = torch.matmul(qc, kq_t[..., b0:q1]).view(b, hkv, g, c, -1)
        s_bf16 = torch.matmul(qc, kb_t[..., b0:q1]).view(b, hkv, g, c, -1)
        s_band = torch.where(in_win, s_bf16, s_stored) * scaling
        s_band = s_band.masked_fill(~causal, float("-inf")).view(b, hkv, g * c, -1)
        p = torch.softmax(torch.cat([s_far, s_band], dim=-1), dim=-1)
        p_far, p_band = p[..., :b0], p[..., b0:].view(b, hkv, g, c, -1)
        win = in_win.to(f32)
        o = torch.matmul(p_far, vq[:, :, :b0])
        o = o + torch.matmul((p_band * win).view(b, hkv, g * c, -1), vb[:, :, b0:q1])
        o = o + torch.matmul((p_band * (1 - win)).view(b, hkv, g * c, -1), vq[:, :, b0:q1])
        out[:, :, :, q0:q1] = o.view(b, hkv, g, c, d)
    return out.reshape(b, hq, t, d).to(query.dtype)


# ----------------------------------------------------------------------- the attention hook


@dataclass
class _Active:
    fmt: KVFormat
    base: str  # the model's own attention implementation ("sdpa", "eager", ...)
    chunk: int
    force_chunked: bool
    calls: int = 0
    chunked_calls: int = 0


_ACTIVE: _Active | None = None


def _base_attention(base: str, module):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base == "eager":  # each model file has its own eager function
        fn = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if fn is None:
            raise RuntimeError(f"{type(module).__name__} has no eager_attention_forward to fall back on")
        return fn
    return ALL_ATTENTION_FUNCTIONS[base]


def _kv_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """An ``AttentionInterface`` function: the active format's K/V, then attention."""
    st = _ACTIVE
    if st is None:
        raise RuntimeError("weightszip KV attention called outside weightszip.eval.kl.kv_format()")
    fmt, layer = st.fmt, getattr(module, "layer_idx", None)
    st.calls += 1
    observe = getattr(fmt, "observe", None)
    if observe is not None:  # calibration: sees the layer's queries, keys and values
        observe(module, query, key, value)
    key_q = fmt.roundtrip(key, "k", layer)
    value_q = fmt.roundtrip(value, "v", layer)
    if not (fmt.keeps_bf16 or st.force_chunked):
        fn = _base_attention(st.base, module)
        return fn(module, query, key_q, value_q, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    if kwargs.get("sliding_window"):
        raise NotImplementedError("windowed_attention does not model sliding-window attention layers")
    if scaling is None:
        scaling = getattr(module, "scaling", None) or query.shape[-1] ** -0.5
    st.chunked_calls += 1
    out = windowed_attention(
        query,
        key,
        value,
        key_q,
        value_q,
        scaling=scaling,
        recent_window=fmt.recent_window,
        sink_tokens=fmt.sink_tokens,
        chunk=st.chunk,
    )
    return out.transpose(1, 2).contiguous(), None


def _register(base: str) -> str:
    try:
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import AttentionInterface
    except ImportError as e:  # both arrived during 4.5x; tested on 5.24
        import transformers

        raise ImportError(
            f"weightszip.eval.kl needs transformers' AttentionInterface and AttentionMaskInterface "
            f"(transformers 5.x; tested on 5.24), this is {transformers.__version__}: {e}"
        ) from e

    name = ATTN_PREFIX + base
    AttentionInterface.register(name, _kv_attention)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[base])  # same masks as the model's own
    return name


@contextlib.contextmanager
def kv_format(model, fmt: KVFormat | str, *, chunk: int = DEFAULT_CHUNK, force_chunked: bool = False):
    """Within the block, every attention layer of ``model`` sees K/V as ``fmt`` hands them back.

    ``force_chunked`` runs ``windowed_attention`` even for formats without kept bf16 tokens (to
    measure its difference from the model's own attention)."""
    global _ACTIVE
    if isinstance(fmt, str):
        fmt = get_format(fmt)
    if _ACTIVE is not None:
        raise RuntimeError("kv_format() blocks do not nest")
    base = model.config._attn_implementation
    if base.startswith(ATTN_PREFIX):
        raise RuntimeError("the model is already inside kv_format()")
    name = _register(base)
    model.set_attn_implementation(name)
    if model.config._attn_implementation != name:
        raise RuntimeError(f"{type(model).__name__} did not accept a custom attention implementation")
    _ACTIVE = _Active(fmt=fmt, base=base, chunk=chunk, force_chunked=force_chunked)
    try:
        yield _ACTIVE
    finally:
        _ACTIVE = None
        model.set_attn_implementation(base)


def _run(model, call, fmt: KVFormat | str | None, **kw):
    with torch.inference_mode():
        if fmt is None:
            return call()
        with kv_format(model, fmt, **kw) as st:
            out = call()
        n_layers = model_kv_shape(model)[0]
        if st.calls != n_layers:  # e.g. a model whose attention does not dispatch through the interface
            raise RuntimeError(f"the format reached {st.calls} attention layers of {n_layers}")
        return out


def forward_logits(model, input_ids: torch.Tensor, fmt: KVFormat | str | None = None, **kw) -> torch.Tensor:
    """Logits [tokens, vocab] of one teacher-forced forward over ``input_ids`` [1, tokens];
    with ``fmt``, every attention layer sees the format's K/V (``kv_format``)."""
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError("forward_logits takes one sequence, input_ids of shape [1, tokens]")
    return _run(model, lambda: model(input_ids=input_ids, use_cache=False).logits[0], fmt, **kw)


def output_head(model):
    """The output layer when logits = head(last hidden state) exactly (a plain *ForCausalLM: no
    logit soft-capping or scale), else None."""
    cfg = model.config
    if getattr(cfg, "final_logit_softcapping", None) or getattr(cfg, "logit_scale", None) not in (None, 1, 1.0):
        return None
    if not hasattr(model, "model") or not hasattr(model, "lm_head"):
        return None
    return model.lm_head


def forward_hidden(model, input_ids: torch.Tensor, fmt: KVFormat | str | None = None, **kw) -> torch.Tensor:
    """The last hidden states [tokens, hidden] (after the final norm), which ``output_head`` turns
    into logits: a long window's logits (32k x 152k bf16 = 10 GB for Qwen2.5) are then made in
    row blocks instead of all at once."""
    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError("forward_hidden takes one sequence, input_ids of shape [1, tokens]")
    return _run(model, lambda: model.model(input_ids=input_ids, use_cache=False).last_hidden_state[0], fmt, **kw)


def _forward_for_kl(model, input_ids, fmt=None, **kw):
    head = output_head(model)
    if head is None:
        return forward_logits(model, input_ids, fmt, **kw), None
    return forward_hidden(model, input_ids, fmt, **kw), head


# ------------------------------------------------------------------------------------ scores


def kl_top1(
    ref_logits: torch.Tensor, logits: torch.Tensor, rows: int = 512, head=None
) -> tuple[np.ndarray, np.ndarray]:
    """Per position: KL(softmax(ref) || softmax(logits)) in nats (fp32 log-softmax, fp64 sum) and
    whether the argmaxes agree. Identical logits give exactly 0. With ``head``, the two inputs are
    last hidden states and ``head`` makes their logits, ``rows`` positions at a time."""
    if ref_logits.shape != logits.shape:
        raise ValueError(f"shapes differ: {tuple(ref_logits.shape)} vs {tuple(logits.shape)}")
    kls, agree = [], []
    for i in range(0, ref_logits.shape[0], rows):
        a, b = ref_logits[i : i + rows], logits[i : i + rows]
        if head is not None:
            with torch.inference_mode():
                a, b = head(a), head(b)
        lp = torch.log_softmax(a.float(), dim=-1)
        lq = torch.log_softmax(b.float(), dim=-1)
        kl = (lp.exp() * (lp - lq)).double().sum(-1)
        kls.append(kl.clamp_min(0.0))  # rounding can leave -1e-9 on near-identical rows
        agree.append(a.argmax(-1) == b.argmax(-1))
    return torch.cat(kls).cpu().numpy(), torch.cat(agree).cpu().numpy()


def buckets(kl: np.ndarray, agree: np.ndarray, n: int = 8) -> list[dict]:
    """Mean KL and top-1 over ``n`` equal spans of positions."""
    t = len(kl)
    edges = [round(i * t / n) for i in range(n + 1)]
    out = []
    for a, b in zip(edges, edges[1:]):
        if b > a:
            out.append({"start": a, "end": b, "kl": float(kl[a:b].mean()), "top1": float(agree[a:b].mean())})
    return out


@dataclass
class FormatResult:
    name: str
    description: str
    bits_per_value: float
    mean_kl: float
    top1: float
    kl_p99: float
    buckets: list[dict]
    seconds: float  # the format's forward, K/V round trips and attention included
    attention: str  # "model" (the model's own attention on round-tripped K/V) or "windowed"
    kl: np.ndarray = field(repr=False)
    agree: np.ndarray = field(repr=False)

    def summary(self) -> dict:
        return {
            "format": self.name,
            "description": self.description,
            "bits_per_value": self.bits_per_value,
            "mean_kl": self.mean_kl,
            "top1": self.top1,
            "kl_p99": self.kl_p99,
            "buckets": self.buckets,
            "seconds": round(self.seconds, 2),
            "attention": self.attention,
        }


def model_kv_shape(model) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a transformers causal LM."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    heads = cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    return cfg.num_hidden_layers, kv_heads, head_dim


def reference(model, input_ids: torch.Tensor):
    """The bf16 forward that formats are scored against (last hidden states, or logits for models
    whose logits are not a plain head of them), for ``evaluate_format``."""
    return _forward_for_kl(model, input_ids)[0]


def evaluate_format(
    model,
    input_ids: torch.Tensor,
    ref: torch.Tensor,
    fmt: KVFormat | str,
    *,
    n_buckets: int = 8,
    chunk: int = DEFAULT_CHUNK,
    force_chunked: bool = False,
) -> FormatResult:
    if isinstance(fmt, str):
        fmt = get_format(fmt)
    _, kv_heads, head_dim = model_kv_shape(model)
    t0 = time.perf_counter()
    out, head = _forward_for_kl(model, input_ids, fmt, chunk=chunk, force_chunked=force_chunked)
    seconds = time.perf_counter() - t0
    kl, agree = kl_top1(ref, out, head=head)
    del out
    n = input_ids.shape[1]
    return FormatResult(
        name=fmt.name,
        description=fmt.description,
        bits_per_value=fmt.bits_per_value(n, head_dim, kv_heads),
        mean_kl=float(kl.mean()),
        top1=float(agree.mean()),
        kl_p99=float(np.quantile(kl, 0.99)),
        buckets=buckets(kl, agree, n_buckets),
        seconds=seconds,
        attention="windowed" if (fmt.keeps_bf16 or force_chunked) else "model",
        kl=kl,
        agree=agree,
    )


def evaluate(
    model,
    input_ids: torch.Tensor,
    formats: list[str | KVFormat],
    *,
    n_buckets: int = 8,
    chunk: int = DEFAULT_CHUNK,
    force_chunked: bool = False,
    floor: bool = False,
    log=None,
) -> tuple[list[FormatResult], float]:
    """KL and top-1 of each format against the plain bf16 forward over ``input_ids`` [1, N].
    Returns the results and the seconds of the plain forward.

    ``floor`` adds a row ``bf16 (windowed attention: floor)``: bf16 K/V through
    ``windowed_attention`` instead of the model's own attention. Both are exact attention; they
    differ only in rounding (fp32 here, the model's kernel there), and what that difference does
    to the logits is the noise floor under every row that uses the windowed attention."""
    fmts = [get_format(f) if isinstance(f, str) else f for f in formats]  # fail before the forwards
    t0 = time.perf_counter()
    ref = reference(model, input_ids)
    ref_seconds = time.perf_counter() - t0
    if log:
        log(f"bf16 reference forward over {input_ids.shape[1]} tokens: {ref_seconds:.1f} s")
    results = []
    todo = [(f, force_chunked) for f in fmts] + ([(get_format("bf16"), True)] if floor else [])
    for fmt, forced in todo:
        r = evaluate_format(model, input_ids, ref, fmt, n_buckets=n_buckets, chunk=chunk, force_chunked=forced)
        if forced and not force_chunked:
            r.name = "bf16 (windowed attention: floor)"
            r.description = "bf16 K/V through the fp32 windowed attention instead of the model's own"
        if log:
            log(f"{r.name}: KL {r.mean_kl:.6f}, top-1 {r.top1:.4f}, {r.bits_per_value:.4f} bits/value, {r.seconds:.1f} s")
        results.append(r)
    return results, ref_seconds


# --------------------------------------------------------------------------------------- plot


def _moving_average(x: np.ndarray, width: int) -> np.ndarray:
    if width <= 1:
        return x.astype(np.float64)
    c = np.cumsum(np.concatenate([[0.0], x.astype(np.float64)]))
    out = np.empty(len(x))
    for i in range(len(x)):  # trailing window, shorter at the start
        a = max(0, i + 1 - width)
        out[i] = (c[i + 1] - c[a]) / (i + 1 - a)
    return out


def plot(results: list[FormatResult], path, title: str = "") -> None:
    """PNG: KL (log scale) and top-1 agreement against position, a trailing moving average over
    max(16, N/64) positions, one colour per format (bf16, KL 0, has no line on the log axis)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results[0].kl)
    width = max(16, n // 64)
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(12, 7), sharex=True)
    x = np.arange(n)
    for i, r in enumerate(results):
        label = f"{r.name} ({r.bits_per_value:.2f} b/v)"
        color = f"C{i % 10}"
        if r.mean_kl > 0:
            y = _moving_average(r.kl, width)
            ax1.plot(x, np.where(y > 0, y, np.nan), label=label, lw=1.2, color=color)
        ax2.plot(x, _moving_average(r.agree.astype(np.float64), width), label=label, lw=1.2, color=color)
    ax1.set_yscale("log")
    ax1.set_ylabel(f"KL(bf16 || format), nats\n(trailing mean over {width} positions)")
    ax1.grid(True, which="both", alpha=0.3)
    ax2.set_ylabel("top-1 agreement with bf16\n(same trailing mean)")
    ax2.set_xlabel("position in window (tokens)")
    ax2.grid(True, alpha=0.3)
    handles, labels = ax2.get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=8, loc="center right")  # one legend for both, colours shared
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0, 0.76, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def describe_position_buckets(results: list[FormatResult]) -> str:
    """A text table of mean KL per position bucket, one row per format."""
    if not results:
        return ""
    heads = [f"{b['start']}-{b['end']}" for b in results[0].buckets]
    width = max(11, max(len(h) for h in heads) + 1)
    lines = [f"{'KL by position':14s}" + "".join(f"{h:>{width}s}" for h in heads)]
    for r in results:
        lines.append(f"{r.name:14s}" + "".join(f"{b['kl']:>{width}.3g}" for b in r.buckets))
    return "\n".join(lines)


def fmt_kl(x: float) -> str:
    if x == 0:
        return "0"
    return f"{x:.3g}" if x < 1e-3 or x >= 1 else f"{x:.5f}"


__all__ = [
    "windowed_attention",
    "kv_format",
    "forward_logits",
    "forward_hidden",
    "reference",
    "kl_top1",
    "buckets",
    "evaluate",
    "evaluate_format",
    "FormatResult",
    "plot",
    "model_kv_shape",
]

