"""Reference codec of the compact KV formats (q4, q3.5, q3): plain PyTorch, deterministic.

READY FOR KERNELS. The bytes are specified in docs/FORMAT.md ("Compact KV pages"); this module is
their reference implementation, and the GPU kernels must reproduce ``encode_tokens`` (codes and
scale indices) and ``dequantize`` (the values attention reads) bit for bit.

One token of one KV head (``head_dim`` values x, bf16, post-RoPE) of layer l, K or V, becomes
``head_dim`` b-bit codes and one u8 scale index, using that (layer, kind, head)'s calibrated
tables (``HeadTables``):

1. fixed point (exact integer arithmetic from here on)::

       xi = trunc(clamp(nan_to_0(float32(x)), -2**20, 2**20) * 2**16)            int64
       z  = ((xi - mu - r(p)) * mult) >> 16       (arithmetic shift; |mult| in [1, 2**24])

   ``mu`` (int64, per channel) is a calibrated offset, ``mult`` (int64, per channel) a calibrated
   per-channel scaling (2**16 / s_c up to a constant). ``r(p)`` (K only, zero for V and for
   calibrations without it) is the *rotary offset* of the token's position p: a calibrated
   pre-RoPE key mean ``rope_m`` turned by RoPE to position p in integer arithmetic
   (``rope_offset``), so a k_proj bias is taken off at every position, also in the pairs that
   turn fast.
2. rotation: ``y = H(signs * z)`` with H the unnormalized Sylvester-Hadamard matrix of order
   head_dim (a power of two) and ``signs`` a calibrated +-1 vector; still exact in int64
   (|y| < 2**53).
3. ``yf = float32(y)`` (round to nearest even), ``m = max |yf|``.
4. scale index ``k = #{i : grid[i] < m}`` clamped to 255, with ``grid[i] = ldexp(FRAC[i % 16],
   e0 + i // 16)`` (``FRAC[j]`` = float32(2**(j/16)), ``e0`` calibrated): the smallest grid step
   at or above the token's largest rotated value.
5. code of each value: ``#{j : yf > float32(thr[j] * grid[k])}`` over the 2**b - 1 ascending
   thresholds ``thr`` of the (layer, kind) codebook at b bits (products rounded to float32).

Decoding (what attention reads): ``yhat = float32(codebook[code] * grid[k])``, in the rotated
domain. The value in the model's own basis is ``xhat = inv(yhat)``::

    z_hat = signs * (H yhat) / head_dim ;  xhat = (z_hat * 2**16 / mult + mu + r(p)) * 2**-16

which is linear: attention computes q . xhat as ``q' . yhat + q . mu' + q . r(p) * 2**-16`` with
``q' = H(signs * q * w) / head_dim``, ``w = 2**16 / mult * 2**-16``, ``mu' = mu * 2**-16``
(``query_transform``), and sums V in the rotated domain, turning them back once per output
(``inverse_matrix``).

Only multiplications, comparisons and integer operations are rounded, each exactly once, so the
codes do not depend on summation order or FMA contraction: the CPU reference and a GPU kernel
agree bit for bit.

A page holds 16 tokens of one (layer, kv head, kind): the codes, then the 16 scale indices:
``16 * (b * head_dim / 8 + 1)`` bytes (``page_bytes``). Codes of width 4 are nibble rows (token t's
row at byte ``t * head_dim / 2``; byte i holds channel 2i in its low nibble, 2i + 1 in its high
nibble); codes of width 3 are crumb rows and a bit-2 row (token t's row at byte ``t * 3 head_dim / 8``:
head_dim/4 bytes of the codes' bits 0-1, channel 4i + s at bits 2s, 2s + 1 of byte i, then their
bits 2 in the order of ``bit2_positions``; from head_dim 32, bit planes below); widths 2 and 5 are
``b`` bit planes of [16 tokens] [head_dim/8 bytes] (bit j of byte i of plane p is bit p of the code
of channel 8i + j). Older layouts
(``PAGE_VERSION``): version 1 (compact chunks before version 3) holds bit planes at every width,
version 2 (chunks of version 3) at every width but 4.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from weightszip.errors import WeightszipError

PAGE_TOKENS = 16
FIXED_SHIFT = 16  # xi = trunc(x * 2**16)
MULT_SHIFT = 16  # z = ((xi - mu) * mult) >> 16
X_CLAMP = float(2**20)
MULT_MAX = 2**24
GRID_SIZE = 256
GRID_STEPS_PER_OCTAVE = 16
BITS_CHOICES = (2, 3, 4, 5)
# Page layout version: 2 stores width-4 codes as nibble rows (a GPU kernel reads a channel pair's
# two codes as one byte), 1 as bit planes like the other widths; 3 stores width-3 codes as crumb
# rows (their low two bits) and a bit-2 row in pair order (docs/FORMAT.md, "Page").
PAGE_VERSION = 3
# in a width-3 row's bit-2 word g (layout 3), channel 16 g + 4 k + s sits at bit 8 k + _BIT2_A[s] and
# channel d/2 + 16 g + 4 k + s at bit 8 k + _BIT2_B[s]
_BIT2_A = (0, 1, 4, 5)
_BIT2_B = (2, 3, 6, 7)
# Rotary offsets: RoPE pair i (channels i and i + d/2, transformers' rotate_half layout) turns by
# phase(p) = p * rope_phase[i] mod 2**48 (units of 2*pi / 2**48) at position p; cos and sin come
# from two integer tables (12 + 10 bits of the phase), values in units of 2**-30.
PHASE_BITS = 48
TRIG_SHIFT = 30
ROPE_M_MAX = 2**31
POSITION_MAX = 2**31
# float32(2 ** (j / 16)), j = 0..15: the fractional steps of the scale grid (exact values in FORMAT.md)
FRAC = np.array([2.0 ** (j / GRID_STEPS_PER_OCTAVE) for j in range(GRID_STEPS_PER_OCTAVE)], dtype=np.float32)


class CompactCodecError(WeightszipError, ValueError):
    """Inputs the compact codec cannot encode or decode (wrong shapes, tables or page bytes): a
    WeightszipError, as every failure of the package is, and a ValueError, as it has always been."""


def _check_pow2(head_dim: int) -> None:
    if head_dim < 8 or head_dim & (head_dim - 1):
        raise CompactCodecError(f"head_dim must be a power of two >= 8, not {head_dim}")


def check_table_values(codebooks, mu, mult, signs, e0s, rope_m=None, rope_phase=None) -> None:
    """The value rules of a head's tables (CompactCodecError), over tensors of any leading shape, so
    that one head (``HeadTables``) and a whole calibration's tables at once (``Calibration.validate``)
    are checked by the same code: codebooks (along their last axis) strictly ascending within [-1,
    1], mult in [1, 2**24], signs +-1, |mu| <= 2**37, each e0 a scale grid within float32's normal
    range, |rope_m| < 2**31 and rope_phase in [0, 2**48) where given. Shapes and dtypes are the
    caller's to check."""
    if not all(bool(torch.all(cb[..., 1:] > cb[..., :-1])) for cb in codebooks):
        raise CompactCodecError("codebook entries must be strictly ascending")
    if not all(bool(torch.all(cb.abs() <= 1)) for cb in codebooks):  # (NaN and infinities fail too)
        raise CompactCodecError("codebook entries must lie in [-1, 1]")
    if not bool(torch.all((mult >= 1) & (mult <= MULT_MAX))):
        raise CompactCodecError("mult must lie in [1, 2**24]")
    if not bool(torch.all(signs.abs() == 1)):
        raise CompactCodecError("signs must be +-1")
    # (compared both ways: abs() of the most negative int64 is itself, negative)
    if not bool(torch.all((mu >= -(2**37)) & (mu <= 2**37))):
        raise CompactCodecError("|mu| must be at most 2**37")
    for e0 in e0s:
        grid_table(int(e0))
    if rope_m is not None:
        if not bool(torch.all((rope_m > -ROPE_M_MAX) & (rope_m < ROPE_M_MAX))):
            raise CompactCodecError("|rope_m| must be below 2**31")
        if not bool(torch.all((rope_phase >= 0) & (rope_phase < 2**PHASE_BITS))):
            raise CompactCodecError("rope_phase must lie in [0, 2**48)")


def grid_table(e0: int) -> torch.Tensor:
    """The 256 scale steps of a head: float32 ``ldexp(FRAC[i % 16], e0 + i // 16)``, ascending."""
    i = np.arange(GRID_SIZE)
    g = np.ldexp(FRAC[i % GRID_STEPS_PER_OCTAVE].astype(np.float64), e0 + i // GRID_STEPS_PER_OCTAVE)
    with np.errstate(over="ignore", under="ignore"):
        g32 = g.astype(np.float32)
    if not np.all(np.isfinite(g32)) or not np.all(g32 > 0) or not np.all(g32.astype(np.float64) == g):
        raise CompactCodecError(f"scale grid exponent e0={e0} leaves float32's normal range")
    return torch.from_numpy(g32)


def thresholds(codebook: torch.Tensor) -> torch.Tensor:
    """float32 midpoints between consecutive (ascending) codebook entries, computed in float64."""
    cb = codebook.double()
    return ((cb[1:] + cb[:-1]) / 2).float()


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform (Sylvester order) along the last dimension. Exact for
    integer tensors; for float tensors a fixed butterfly order."""
    d = x.shape[-1]
    _check_pow2(d)
    lead = x.shape[:-1]
    y = x.reshape(-1, d)
    h = 1
    while h < d:
        y = y.view(-1, d // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack((a + b, a - b), dim=2).view(-1, d)
        h *= 2
    return y.view(*lead, d)


@dataclass(frozen=True)
class HeadTables:
    """The calibrated tables one (layer, kind, kv head) is coded with."""

    mu: torch.Tensor  # int64 [head_dim]
    mult: torch.Tensor  # int64 [head_dim], in [1, 2**24]
    signs: torch.Tensor  # int64 [head_dim], +-1
    e0: int
    codebook: torch.Tensor  # float32 [2**bits], ascending, within [-1, 1]
    bits: int
    rope_m: torch.Tensor | None = None  # int64 [head_dim], |.| < 2**31: pre-RoPE key mean (K only)
    rope_phase: torch.Tensor | None = None  # int64 [head_dim // 2] in [0, 2**48): phase per position

    def __post_init__(self):
        d = self.mu.shape[-1]
        _check_pow2(d)
        if self.bits not in BITS_CHOICES:
            raise CompactCodecError(f"bits must be one of {BITS_CHOICES}, not {self.bits}")
        if self.codebook.shape != (2**self.bits,) or self.codebook.dtype != torch.float32:
            raise CompactCodecError(f"codebook must be float32 [{2**self.bits}]")
        for name in ("mu", "mult", "signs"):
            t = getattr(self, name)
            if t.shape != (d,) or t.dtype != torch.int64:
                raise CompactCodecError(f"{name} must be int64 [{d}]")
        if (self.rope_m is None) != (self.rope_phase is None):
            raise CompactCodecError("rope_m and rope_phase come together")
        if self.rope_m is not None:
            if self.rope_m.shape != (d,) or self.rope_m.dtype != torch.int64:
                raise CompactCodecError(f"rope_m must be int64 [{d}]")
            if self.rope_phase.shape != (d // 2,) or self.rope_phase.dtype != torch.int64:
                raise CompactCodecError(f"rope_phase must be int64 [{d // 2}]")
        check_table_values([self.codebook], self.mu, self.mult, self.signs, [self.e0], self.rope_m, self.rope_phase)

    @property
    def has_rope_offset(self) -> bool:
        return self.rope_m is not None and bool(torch.any(self.rope_m != 0))

    @property
    def head_dim(self) -> int:
        return self.mu.shape[0]

    def grid(self) -> torch.Tensor:
        return grid_table(self.e0)

    def thresholds(self) -> torch.Tensor:
        return thresholds(self.codebook)


def _stack(tables: list[HeadTables]):
    """Per-head tables stacked along a head dimension: mu, mult, signs [H, d]; grid [H, 256]."""
    bits = {t.bits for t in tables}
    if len(bits) != 1:
        raise CompactCodecError("all heads of one (layer, kind) must use the same bits")
    mu = torch.stack([t.mu for t in tables])
    mult = torch.stack([t.mult for t in tables])
    signs = torch.stack([t.signs for t in tables])
    grid = torch.stack([t.grid() for t in tables])
    cb = torch.stack([t.codebook for t in tables])
    return mu, mult, signs, grid, cb, bits.pop()


def trig_tables():
    """(coarse cos, coarse sin [4096], fine cos, fine sin [1024]) int64 in units of 2**-30:
    round(cos/sin(2 pi j / 2**12) * 2**30) and round(cos/sin(2 pi j / 2**22) * 2**30)."""
    global _TRIG
    if _TRIG is None:
        j = np.arange(4096, dtype=np.float64)
        f = np.arange(1024, dtype=np.float64)
        one = float(2**TRIG_SHIFT)
        _TRIG = tuple(
            torch.from_numpy(np.rint(v * one).astype(np.int64))
            for v in (np.cos(2 * np.pi * j / 2**12), np.sin(2 * np.pi * j / 2**12),
                      np.cos(2 * np.pi * f / 2**22), np.sin(2 * np.pi * f / 2**22))
        )
    return _TRIG


_TRIG = None


def rope_cos_sin(positions: torch.Tensor, rope_phase: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Integer cos and sin (units of 2**-30) of each RoPE pair's phase at each position:
    positions int64 [T] (0 <= p < 2**31), rope_phase int64 [..., d/2] -> two int64 [T, ..., d/2].
    phase = p * f mod 2**48 (f split in 16-bit halves so no product exceeds 2**63); its top 12 bits
    index the coarse tables, the next 10 the fine ones; cos(a + b), sin(a + b) by the sum formulas,
    each product shifted right by 30 (floor)."""
    ch, sh, cf, sf = (t.to(positions.device) for t in trig_tables())
    p = positions.to(torch.int64).reshape(-1, *([1] * rope_phase.ndim))
    f = rope_phase.to(positions.device)
    phase = ((((p * (f >> 16)) & (2**32 - 1)) << 16) + p * (f & 0xFFFF)) & (2**PHASE_BITS - 1)
    hi = phase >> (PHASE_BITS - 12)
    lo = (phase >> (PHASE_BITS - 22)) & 1023
    c1, s1, c2, s2 = ch[hi], sh[hi], cf[lo], sf[lo]
    cos = (c1 * c2 - s1 * s2) >> TRIG_SHIFT
    sin = (s1 * c2 + c1 * s2) >> TRIG_SHIFT
    return cos, sin


def _int_positions(positions) -> torch.Tensor:
    """Token positions as int64; floats (0.5 was taken as 0), complex and bool are refused."""
    given = torch.as_tensor(positions)
    if given.dtype.is_floating_point or given.dtype.is_complex or given.dtype == torch.bool:
        raise CompactCodecError(f"positions are integers, got {given.dtype}")
    return given.to(torch.int64)


def _checked_positions(positions) -> torch.Tensor:
    positions = _int_positions(positions)
    if positions.ndim != 1:
        raise CompactCodecError("positions must be a 1-D tensor of token positions")
    if positions.numel() and (int(positions.min()) < 0 or int(positions.max()) >= POSITION_MAX):
        raise CompactCodecError("token positions must lie in [0, 2**31)")
    return positions


def stack_rope(tables: list[HeadTables]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(rope_m int64 [H, d], rope_phase int64 [H, d/2]) of one (layer, kind)'s heads, or None when
    none carries a rotary offset. A head without one gets zero means (and another head's phase)."""
    if not any(t.has_rope_offset for t in tables):
        return None
    d = tables[0].head_dim
    phase = next(t.rope_phase for t in tables if t.rope_phase is not None)
    m = torch.stack([t.rope_m if t.rope_m is not None else torch.zeros(d, dtype=torch.int64) for t in tables])
    f = torch.stack([t.rope_phase if t.rope_phase is not None else phase for t in tables])
    return m, f


def rotary_offsets(positions, rope_m: torch.Tensor, rope_phase: torch.Tensor) -> torch.Tensor:
    """The rotary offsets r(p): int64 [T, H, d] (units of 2**-16) of keys at ``positions`` [T]:
    ``rope_m`` [H, d] turned by RoPE (phase steps ``rope_phase`` [H, d/2] or [d/2]) to each
    position, pair (i, i + d/2): (a cos - b sin, a sin + b cos), each product of a 2**-16 value and
    a 2**-30 cosine shifted right by 30 (floor)."""
    positions = _checked_positions(positions)
    d = rope_m.shape[-1]
    cos, sin = rope_cos_sin(positions, rope_phase.expand(rope_m.shape[0], d // 2))  # [T, H, d/2]
    a, b = rope_m[:, : d // 2], rope_m[:, d // 2 :]
    return torch.cat([(a * cos - b * sin) >> TRIG_SHIFT, (a * sin + b * cos) >> TRIG_SHIFT], dim=-1)


def rope_offset(positions, tables: list[HeadTables]) -> torch.Tensor:
    """``rotary_offsets`` of a (layer, kind)'s heads: int64 [T, H, d], zero where the tables carry
    no rotary offsets (V, or calibrations without them)."""
    rope = stack_rope(tables)
    if rope is None:
        n = _checked_positions(positions).shape[0]
        return torch.zeros(n, len(tables), tables[0].head_dim, dtype=torch.int64)
    return rotary_offsets(positions, *rope)


def _offsets_for(x: torch.Tensor, tables: list[HeadTables], positions) -> torch.Tensor | None:
    """The rotary offsets [T, H, d] for x [T, H, d] at ``positions``, or None when the tables need
    none. Positions are required when they do: a key's bytes depend on its position."""
    if not any(t.has_rope_offset for t in tables):
        return None
    if positions is None:
        raise CompactCodecError("these K tables carry rotary offsets: give the tokens' positions")
    positions = _int_positions(positions).reshape(-1)
    if x.ndim != 3 or positions.shape[0] != x.shape[0]:
        raise CompactCodecError(f"positions [{positions.shape[0]}] do not match tokens {tuple(x.shape)}")
    return rope_offset(positions, tables)


def rotate(x: torch.Tensor, tables: list[HeadTables], positions=None, *, offsets=None) -> torch.Tensor:
    """Steps 1-2: x [T, H, d] (any float dtype; bf16 in the cache) -> y int64 [T, H, d].
    ``positions`` [T]: the tokens' positions, needed when the tables carry rotary offsets;
    ``offsets``: their ``rope_offset`` already computed (then positions are not read)."""
    mu, mult, signs, _, _, _ = _stack(tables)
    if x.shape[-2:] != mu.shape:
        raise CompactCodecError(f"expected [..., {mu.shape[0]}, {mu.shape[1]}], got {tuple(x.shape)}")
    xf = torch.nan_to_num(x.float(), nan=0.0).clamp(-X_CLAMP, X_CLAMP)
    xi = (xf * float(2**FIXED_SHIFT)).to(torch.int64)  # truncates toward zero
    r = offsets if offsets is not None else _offsets_for(xi, tables, positions)
    if r is not None:
        xi = xi - r
    z = ((xi - mu) * mult) >> MULT_SHIFT
    return fwht(z * signs)


def scale_steps(yf: torch.Tensor, grid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Step 4: rotated float32 values [t, H, d] and the heads' grids [H, 256] -> (scale index
    k [t, H] = #{i : grid[i] < max |y|} clamped to 255, its grid value [t, H, 1])."""
    m = yf.abs().amax(dim=-1)  # [t, H]
    k = torch.searchsorted(grid, m.t().contiguous()).t().clamp(max=GRID_SIZE - 1)  # a left search
    g = grid[torch.arange(grid.shape[0]).unsqueeze(0), k].unsqueeze(-1)
    return k, g


def encode_tokens(x: torch.Tensor, tables: list[HeadTables], positions=None, *, block: int = 4096, offsets=None):
    """Encode tokens: x [T, H, d] -> (codes uint8 [T, H, d], scale index uint8 [T, H]).
    ``positions`` [T] (int): the tokens' positions in their sequence, needed by K tables with
    rotary offsets (``HeadTables.has_rope_offset``), ignored otherwise (``offsets``: as for ``rotate``)."""
    if x.ndim != 3:
        raise CompactCodecError(f"expected [tokens, heads, head_dim], got {tuple(x.shape)}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:  # (block < 1 left codes unwritten)
        raise CompactCodecError(f"block must be an int >= 1, got {block!r}")
    mu, mult, signs, grid, cb, bits = _stack(tables)
    thr = torch.stack([thresholds(c) for c in cb])  # [H, 2**b - 1]
    t = x.shape[0]
    codes = torch.empty(x.shape, dtype=torch.uint8)
    sidx = torch.empty(x.shape[:2], dtype=torch.uint8)
    if positions is not None:
        positions = _int_positions(positions).reshape(-1)
        if positions.shape[0] != t:
            raise CompactCodecError(f"{positions.shape[0]} positions for {t} tokens")
    for a in range(0, t, block):
        pos = None if positions is None else positions[a : a + block]
        off = None if offsets is None else offsets[a : a + block]
        yf = rotate(x[a : a + block].cpu(), tables, pos, offsets=off).to(torch.float32)  # int64 -> fp32, round to nearest even
        k, g = scale_steps(yf, grid)
        tk = thr.unsqueeze(0) * g  # float32 products [t, H, 2**b - 1], ascending
        c = torch.searchsorted(tk.contiguous(), yf.contiguous())  # #{j : tk[j] < y} for each value
        codes[a : a + block] = c.to(torch.uint8)
        sidx[a : a + block] = k.to(torch.uint8)
    return codes, sidx


def dequantize(codes: torch.Tensor, sidx: torch.Tensor, tables: list[HeadTables]) -> torch.Tensor:
    """The values attention reads, in the rotated domain: float32 codebook[code] * grid[k];
    codes [T, H, d], sidx [T, H] -> [T, H, d]."""
    _, _, _, grid, cb, bits = _stack(tables)
    if codes.ndim != 3 or sidx.shape != codes.shape[:2] or codes.shape[1:] != (grid.shape[0], tables[0].head_dim):
        raise CompactCodecError("codes must be [T, H, d] and scale indices [T, H] for these tables")
    if codes.dtype.is_floating_point or sidx.dtype.is_floating_point:
        raise CompactCodecError(f"codes and scale indices are integers, got {codes.dtype} and {sidx.dtype}")
    if codes.numel() and not 0 <= int(codes.min()) <= int(codes.max()) < 2**bits:
        raise CompactCodecError(f"codes must lie in [0, {2**bits}): {bits} bits")
    if sidx.numel() and not 0 <= int(sidx.min()) <= int(sidx.max()) < grid.shape[1]:  # (-1 read as the last)
        raise CompactCodecError(f"scale indices must lie in [0, {grid.shape[1]})")
    h = torch.arange(grid.shape[0])
    g = grid[h.unsqueeze(0), sidx.long()]  # [T, H]
    vals = cb[h.view(1, -1, 1), codes.long()]  # [T, H, d]
    return vals * g.unsqueeze(-1)


def inverse(yhat: torch.Tensor, tables: list[HeadTables], positions=None, *, offsets=None) -> torch.Tensor:
    """Rotated-domain values [T, H, d] -> the model's basis (float32): the reference of what the
    cache's values are, for evaluation and for the attention tolerance tests. ``positions`` and
    ``offsets`` as for ``rotate``."""
    mu, mult, signs, _, _, _ = _stack(tables)
    d = mu.shape[-1]
    z = fwht(yhat.double()) / d * signs.double()
    off = mu.double()
    r = offsets if offsets is not None else _offsets_for(yhat, tables, positions)
    if r is not None:
        off = off + r.double()
    x = (z * float(2**MULT_SHIFT) / mult.double() + off) * 2.0**-FIXED_SHIFT
    return x.float()


def roundtrip(x: torch.Tensor, tables: list[HeadTables], positions=None) -> torch.Tensor:
    """x [T, H, d] -> what the cache hands back, float32 [T, H, d]."""
    r = _offsets_for(x, tables, positions) if x.ndim == 3 else None  # once, for both directions
    codes, sidx = encode_tokens(x, tables, positions, offsets=r)
    return inverse(dequantize(codes, sidx, tables), tables, positions, offsets=r)


def key_offset_logits(q: torch.Tensor, positions, tables: list[HeadTables]) -> torch.Tensor:
    """q . r(p) * 2**-16 for attention in the rotated domain with rotary offsets: q [H, G, d],
    positions [T] -> float32 [H, G, T] (zeros when the tables carry no rotary offsets), so that
    q . inverse(yhat, p) == q' . yhat + bias + key_offset_logits up to rounding."""
    positions = _int_positions(positions).reshape(-1)
    r = rope_offset(positions, tables).double() * 2.0**-FIXED_SHIFT  # [T, H, d]
    return torch.einsum("hgd,thd->hgt", q.double(), r).float()


def query_transform(q: torch.Tensor, tables: list[HeadTables]):
    """For attention in the rotated domain: q [..., H_kv, G, d] (G query heads per KV head) ->
    (q' [..., H_kv, G, d] float32, bias [..., H_kv, G] float32) with
    q . inverse(yhat) == q' . yhat + bias up to rounding."""
    mu, mult, signs, _, _, _ = _stack(tables)
    d = mu.shape[-1]
    w = (float(2**MULT_SHIFT) / mult.double()) * 2.0**-FIXED_SHIFT  # [H, d]
    qd = q.double()
    qp = fwht(qd * (signs.double() * w).unsqueeze(-2)) / d
    bias = (qd * (mu.double() * 2.0**-FIXED_SHIFT).unsqueeze(-2)).sum(-1)
    return qp.float(), bias.float()


def inverse_matrix(tables: list[HeadTables]) -> tuple[torch.Tensor, torch.Tensor]:
    """(A [H, d, d], mean [H, d]) float32 with inverse(yhat) == yhat @ A[h] + mean[h] (row vectors):
    a V sum over tokens with weights p turns back as (sum p yhat) @ A + mean * sum p."""
    mu, mult, signs, _, _, _ = _stack(tables)
    h, d = mu.shape
    eye = torch.eye(d, dtype=torch.float64)
    hy = fwht(eye) / d  # row j = H e_j / d
    w = (float(2**MULT_SHIFT) / mult.double()) * 2.0**-FIXED_SHIFT
    a = hy.unsqueeze(0) * (signs.double() * w).unsqueeze(1)  # [H, d, d]
    return a.float(), (mu.double() * 2.0**-FIXED_SHIFT).float()


# ------------------------------------------------------------------------------------- pages


def page_bytes(bits: int, head_dim: int) -> int:
    """Bytes of one page (16 tokens of one layer, kv head and kind)."""
    if bits not in BITS_CHOICES:
        raise CompactCodecError(f"bits must be one of {BITS_CHOICES}, not {bits}")
    _check_pow2(head_dim)
    return PAGE_TOKENS * (bits * head_dim // 8 + 1)


def _check_version(version: int) -> None:
    if not (isinstance(version, int) and 1 <= version <= PAGE_VERSION):
        raise CompactCodecError(f"page layout version {version} is not supported (this reads 1-{PAGE_VERSION})")


def nibble_rows(bits: int, version: int = PAGE_VERSION) -> bool:
    """Whether pages of this width and layout version hold nibble rows."""
    _check_version(version)
    return bits == 4 and version >= 2


def crumb_rows(bits: int, head_dim: int, version: int = PAGE_VERSION) -> bool:
    """Whether pages of this width, head_dim and layout version hold crumb rows and a bit-2 row (width
    3, head_dim 32 and up: a bit-2 word covers 32 channels; narrower heads keep bit planes)."""
    _check_version(version)
    return bits == 3 and version >= 3 and head_dim >= 32


def bit2_positions(head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each channel of a width-3 row (layout 3): the 32-bit word of the row's bit-2 part that holds
    its bit 2, and the bit's place in that word (int64 [head_dim] each)."""
    c = torch.arange(head_dim)
    half = head_dim // 2
    hi = c >= half
    r = torch.where(hi, c - half, c)  # 16 g + 4 k + s
    g, k, s = r // 16, (r // 4) % 4, r % 4
    q = torch.where(hi, torch.tensor(_BIT2_B)[s], torch.tensor(_BIT2_A)[s])
    return g, 8 * k + q


def pack_page(codes: torch.Tensor, sidx: torch.Tensor, bits: int, version: int = PAGE_VERSION) -> torch.Tensor:
    """codes uint8 [16, d], scale indices uint8 [16] -> page bytes uint8 [page_bytes(bits, d)]."""
    if codes.ndim != 2 or codes.shape[0] != PAGE_TOKENS or sidx.shape != (PAGE_TOKENS,):
        raise CompactCodecError("a page packs codes [16, head_dim] and 16 scale indices")
    d = codes.shape[1]
    page_bytes(bits, d)  # (a width or head_dim no page has: CompactCodecError, as unpack_page says)
    if codes.dtype.is_floating_point or sidx.dtype.is_floating_point:
        raise CompactCodecError(f"codes and scale indices are integers, got {codes.dtype} and {sidx.dtype}")
    c = codes.to(torch.int64)
    if not 0 <= int(c.min()) <= int(c.max()) < 2**bits:  # (-12 was packed as 4)
        raise CompactCodecError(f"codes must lie in [0, {2**bits}): {bits} bits")
    if not 0 <= int(sidx.min()) <= int(sidx.max()) <= 255:  # (300 was packed as 44)
        raise CompactCodecError("scale indices must lie in [0, 256)")
    if nibble_rows(bits, version):
        body = (c[:, 0::2] | (c[:, 1::2] << 4)).to(torch.uint8).reshape(-1)  # [16, d/2]
    elif crumb_rows(bits, d, version):
        crumbs = ((c & 3).view(PAGE_TOKENS, d // 4, 4) << (2 * torch.arange(4))).sum(-1)  # [16, d/4]
        g, pos = bit2_positions(d)
        words = torch.zeros(PAGE_TOKENS, d // 32, dtype=torch.int64)
        words.index_add_(1, g, ((c >> 2) & 1) << pos)
        b2 = (words.unsqueeze(-1) >> (8 * torch.arange(4))) & 0xFF  # [16, d/32, 4]: little-endian bytes
        body = torch.cat([crumbs, b2.reshape(PAGE_TOKENS, d // 8)], dim=1).to(torch.uint8).reshape(-1)
    else:
        weights = (2 ** torch.arange(8, dtype=torch.int64)).view(1, 1, 8)
        planes = []
        for p in range(bits):
            bit = ((c >> p) & 1).view(PAGE_TOKENS, d // 8, 8)
            planes.append((bit * weights).sum(-1))  # [16, d/8]
        body = torch.stack(planes).to(torch.uint8).reshape(-1)
    return torch.cat([body, sidx.to(torch.uint8)])


def unpack_page(page: torch.Tensor, bits: int, head_dim: int,
                version: int = PAGE_VERSION) -> tuple[torch.Tensor, torch.Tensor]:
    """Page bytes -> (codes uint8 [16, d], scale indices uint8 [16])."""
    n = page_bytes(bits, head_dim)
    if page.dtype != torch.uint8 or page.shape != (n,):
        raise CompactCodecError(f"a {bits}-bit page of head_dim {head_dim} is {n} uint8 bytes, got {page.dtype} {tuple(page.shape)}")
    if nibble_rows(bits, version):
        body = page[: n - PAGE_TOKENS].to(torch.int64).view(PAGE_TOKENS, head_dim // 2, 1)
        codes = torch.cat([body & 15, body >> 4], dim=2).view(PAGE_TOKENS, head_dim)
        return codes.to(torch.uint8), page[n - PAGE_TOKENS :].clone()
    if crumb_rows(bits, head_dim, version):
        rows = page[: n - PAGE_TOKENS].to(torch.int64).view(PAGE_TOKENS, 3 * head_dim // 8)
        crumbs = (rows[:, : head_dim // 4, None] >> (2 * torch.arange(4))) & 3
        b2 = rows[:, head_dim // 4 :].view(PAGE_TOKENS, head_dim // 32, 4)
        words = (b2 << (8 * torch.arange(4))).sum(-1)  # [16, d/32]
        g, pos = bit2_positions(head_dim)
        codes = crumbs.reshape(PAGE_TOKENS, head_dim) | (((words[:, g] >> pos) & 1) << 2)
        return codes.to(torch.uint8), page[n - PAGE_TOKENS :].clone()
    body = page[: n - PAGE_TOKENS].to(torch.int64).view(bits, PAGE_TOKENS, head_dim // 8, 1)
    shifts = torch.arange(8, dtype=torch.int64).view(1, 1, 1, 8)
    b = ((body >> shifts) & 1).view(bits, PAGE_TOKENS, head_dim)
    codes = torch.zeros(PAGE_TOKENS, head_dim, dtype=torch.int64)
    for p in range(bits):
        codes |= b[p] << p
    return codes.to(torch.uint8), page[n - PAGE_TOKENS :].clone()


def encode_page(x: torch.Tensor, head: HeadTables) -> torch.Tensor:
    """16 tokens of one kv head, x [16, d] (bf16) -> the page's bytes."""
    if x.shape != (PAGE_TOKENS, head.head_dim):
        raise CompactCodecError(f"a page is [16, {head.head_dim}] values, got {tuple(x.shape)}")
    codes, sidx = encode_tokens(x.unsqueeze(1), [head])
    return pack_page(codes[:, 0], sidx[:, 0], head.bits)


def decode_page(page: torch.Tensor, head: HeadTables) -> torch.Tensor:
    """A page's bytes -> the rotated-domain values attention reads, float32 [16, d]."""
    codes, sidx = unpack_page(page, head.bits, head.head_dim)
    return dequantize(codes.unsqueeze(1), sidx.unsqueeze(1), [head])[:, 0]
