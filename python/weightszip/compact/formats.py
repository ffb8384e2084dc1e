"""The compact formats as ``KVFormat``s of the evaluation harness.

``q4``, ``q3.5`` and ``q3`` are registered unbound: they need a model's calibration
(``weightszip calibrate``), given as ``bind(Calibration)`` or ``--calibration FILE`` on the
command line. A bound format hands back, for each layer's K or V, what the cache returns:
every token encoded with the layer's calibrated tables and decoded by the reference codec,
except the sinks and the recent window, which the cache keeps in bf16.
"""

from __future__ import annotations

import torch

from weightszip.compact import codec
from weightszip.compact.calibrate import BUDGET_CONTEXT, RECENT_WINDOW, SINK_TOKENS, TARGETS, Calibration
from weightszip.eval.formats import KINDS, FormatUnavailable, KVFormat, register_format


class CompactFormat(KVFormat):
    sink_tokens = SINK_TOKENS
    recent_window = RECENT_WINDOW
    # keys are coded at their positions (rotary offsets): roundtrip takes the first token's position
    position_aware = True

    def __init__(self, name: str, calibration: Calibration | None = None):
        if name not in TARGETS:
            raise codec.CompactCodecError(f"unknown compact format {name!r}; one of {', '.join(TARGETS)}")
        self.name = name
        self.calibration = calibration
        if calibration is not None:
            self.sink_tokens = calibration.sink_tokens
            self.recent_window = calibration.recent_window

    @property
    def description(self):  # type: ignore[override]
        return (
            f"{self.name}: calibrated per-channel scaling and offsets (K: pre-RoPE, turned to each position), Hadamard rotation, per-token u8 "
            f"scale, Lloyd codebooks (2-5 bits per layer and K/V, {TARGETS[self.name]} bits per value "
            f"at {BUDGET_CONTEXT} tokens all included), {self.sink_tokens} sink + {self.recent_window} "
            f"recent tokens in bf16"
        )

    def bind(self, calibration: Calibration) -> "CompactFormat":
        return CompactFormat(self.name, calibration)

    def check_available(self) -> None:
        if self.calibration is None:
            raise FormatUnavailable(
                f"{self.name} needs a calibration: `weightszip calibrate --model M --text A --text B -o M.wzcal`, "
                f"then --calibration M.wzcal (from Python: CompactFormat({self.name!r}, Calibration.load('M.wzcal')), "
                f"or weightszip.compact.formats.use_calibration('M.wzcal') before get_format)"
            )

    def _cal(self) -> Calibration:
        self.check_available()
        assert self.calibration is not None
        return self.calibration

    def widths(self, layer: int) -> tuple[int, int]:
        cal = self._cal()
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < cal.layers:
            raise codec.CompactCodecError(f"layer {layer!r} is outside the calibration's {cal.layers} layers")
        if self.name not in cal.allocation:  # (a calibration with "allocation": {} loads)
            raise codec.CompactCodecError(f"the calibration has no allocation for {self.name!r}")
        a = cal.allocation[self.name][layer]
        return a[0], a[1]

    def roundtrip(self, x, kind, layer=None, start: int = 0):
        """x [batch, kv_heads, tokens, head_dim] -> what the cache hands back; the tokens sit at
        positions start, start + 1, ... (the evaluation harness's windows start at 0)."""
        if kind not in KINDS:
            raise codec.CompactCodecError(f"kind must be 'k' or 'v', not {kind!r}")
        if layer is None:
            raise codec.CompactCodecError("compact formats need the layer index (their tables are per layer)")
        cal = self._cal()
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise codec.CompactCodecError(f"K/V must be a tensor [batch, kv_heads, tokens, head_dim], got "
                                          f"{tuple(getattr(x, 'shape', ()))}")
        b, h, t, d = x.shape
        if (h, d) != (cal.kv_heads, cal.head_dim):
            raise codec.CompactCodecError(f"K/V of {h} heads x {d} does not fit the calibration "
                                          f"({cal.kv_heads} x {cal.head_dim})")
        bits = self.widths(layer)[KINDS.index(kind)]
        tables = cal.tables(layer, kind, bits)
        if b == 1 and start == 0:
            return self._roundtrip_memo(x, kind, layer, tables)
        out = torch.empty_like(x)
        for i in range(b):
            xt = x[i].transpose(0, 1).cpu()  # [T, H, d]
            out[i] = codec.roundtrip(xt, tables, torch.arange(start, start + t)).transpose(0, 1).to(x.dtype).to(x.device)
        return out

    def _roundtrip_memo(self, x, kind, layer, tables):
        """Each token is coded on its own, so when a forward's K/V start with the previous call's
        tokens (greedy decoding re-running a growing sequence) only the new tokens are coded."""
        memo = self.__dict__.setdefault("_memo", {})
        key = (layer, kind)
        xt = x[0].transpose(0, 1).cpu()  # [T, H, d] (the reference codec runs on the CPU)
        prev = memo.get(key)
        n = 0
        if prev is not None:
            px, py = prev
            n = min(px.shape[0], xt.shape[0])
            if not torch.equal(px[:n], xt[:n]):
                n = 0
        if n == xt.shape[0]:
            y = py[:n]
        elif n:
            y = torch.cat([py[:n], codec.roundtrip(xt[n:], tables, torch.arange(n, xt.shape[0])).to(x.dtype)])
        else:
            y = codec.roundtrip(xt, tables, torch.arange(xt.shape[0])).to(x.dtype)
        memo[key] = (xt.clone(), y)
        return y.transpose(0, 1).unsqueeze(0).to(x.device)

    def stored_bits(self, n_quantized, head_dim, kv_heads, kind):  # per layer: averaged in bits_per_value
        raise NotImplementedError("compact formats count bits over all layers: use bits_per_value")

    def bits_per_value(self, context_len, head_dim=None, kv_heads=None):
        return self._cal().bits_per_value(self.name, context_len)


for _name in TARGETS:
    register_format(CompactFormat(_name))


def bind_formats(formats, calibration: Calibration | None):
    """Replace unbound compact formats (names or objects) in ``formats`` by bound ones."""
    out = []
    for f in formats:
        name = f if isinstance(f, str) else f.name
        if name in TARGETS:
            if calibration is None:
                CompactFormat(name).check_available()
            out.append(CompactFormat(name, calibration))
        else:
            out.append(f)
    return out


def use_calibration(calibration: "Calibration | str | None") -> None:
    """Bind the registered q4, q3.5 and q3 to ``calibration`` (a ``Calibration`` or the path of a
    .wzcal file), so ``get_format("q3")`` and the CLI's evaluations use it; None unbinds."""
    import os

    if isinstance(calibration, (str, os.PathLike)):
        calibration = Calibration.load(calibration)
    for name in TARGETS:
        register_format(CompactFormat(name, calibration), replace=True)
