"""The compact formats' budget (q4, q3.5, q3), without torch: the constants that
``weightszip.compact.calibrate`` allocates bits by, and the bits per value a budget implies at
another context length, for the capacity calculator (which runs without torch).

A format's name is a budget at ``BUDGET_CONTEXT`` tokens, everything included: the first
``SINK_TOKENS`` and the last ``RECENT_WINDOW`` tokens kept in bf16, each other token's codes and its
u8 scale per KV head, and the tables (``Calibration.table_bits``). The kept tokens and the tables do
not grow with the context, so a shorter context costs more bits per value than the name says.
"""

from __future__ import annotations

from fractions import Fraction

SINK_TOKENS = 4
RECENT_WINDOW = 128
BUDGET_CONTEXT = 131072
TARGETS = {"q4": 4.0, "q3.5": 3.5, "q3": 3.0}
SCALE_BITS = 8  # the u8 scale index per token and KV head
MAX_CODEBOOK_BITS = 5


def table_bits_bound(layers: int, kv_heads: int, head_dim: int, rope: bool = False) -> int:
    """Bits of a calibration's tables at most (``Calibration.table_bits`` with every codebook at
    ``MAX_CODEBOOK_BITS``): signs one bit per channel; per layer, K/V and head mu int64 and mult u32
    per channel and e0 one byte; a float32 codebook per layer and K/V; with ``rope``, the rotary
    offsets (32 bits per K channel) and phases (48 bits per pair). ``calibrate.allocate`` reserves
    it without the rotary tables."""
    total = head_dim + layers * 2 * (kv_heads * (head_dim * (64 + 32) + 8) + 32 * 2**MAX_CODEBOOK_BITS)
    if rope:
        total += layers * kv_heads * head_dim * 32 + head_dim // 2 * 48
    return total


def budget_bits(target, context: int, layers: int, kv_heads: int, head_dim: int) -> Fraction:
    """Bits per cached value at ``context`` tokens of a format whose budget is ``target`` bits at
    ``BUDGET_CONTEXT`` (exactly ``target`` there), with no calibration at hand: the kept bf16 tokens
    and the tables (at their bound, rotary tables included) are counted at ``context``, and the
    codes and scales of every other token take what the budget leaves them at ``BUDGET_CONTEXT``.
    A calibration's allocation stays within the budget, so its real figure
    (``Calibration.bits_fraction``) is at most about this one at every context."""
    if context < 1:
        raise ValueError("context must be positive")
    kept = SINK_TOKENS + RECENT_WINDOW
    values = 2 * layers * kv_heads * head_dim  # per token
    tables = table_bits_bound(layers, kv_heads, head_dim, rope=True)
    t = Fraction(target).limit_denominator(1 << 20) if isinstance(target, float) else Fraction(target)
    coded = (t * BUDGET_CONTEXT * values - kept * 16 * values - tables) / ((BUDGET_CONTEXT - kept) * values)
    total = min(context, kept) * 16 * values + max(0, context - kept) * coded * values + tables
    return total / (context * values)
