"""Small-sample statistics for paired pass/fail evaluations (every format answers the same prompts).

* ``wilson``: the Wilson score interval of a proportion.
* ``newcombe_paired``: the difference of two paired proportions with Newcombe's hybrid score
  interval (Newcombe 1998, Stat Med 17:2635-2650, method 10). Unlike the paired bootstrap or the
  exact interval conditional on the discordant pairs, it does not collapse to [0, 0] when no pair
  is discordant: with 20 prompts, "no prompt changed" still leaves a few points either way.
* ``mcnemar_exact_p``: the exact two-sided McNemar test (discordant pairs ~ Binomial(m, 1/2)).
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054  # the 97.5% quantile of the standard normal


def wilson(x: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval for a proportion x/n."""
    if n <= 0:
        return (0.0, 1.0)
    p = x / n
    den = 1 + z * z / n
    center = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, center - half), min(1.0, center + half))


def paired_table(a: list[bool], b: list[bool]) -> tuple[int, int, int, int]:
    """(both right, only a right, only b right, both wrong) over the same prompts."""
    if len(a) != len(b):
        raise ValueError("paired results must cover the same prompts")
    n11 = sum(1 for x, y in zip(a, b) if x and y)
    n10 = sum(1 for x, y in zip(a, b) if x and not y)
    n01 = sum(1 for x, y in zip(a, b) if y and not x)
    return n11, n10, n01, len(a) - n11 - n10 - n01


def newcombe_paired(n11: int, n10: int, n01: int, n00: int, z: float = Z95) -> tuple[float, float, float]:
    """Difference p_a - p_b of two paired proportions (p_a = (n11+n10)/n, p_b = (n11+n01)/n) and
    its hybrid score interval, Newcombe (1998) method 10: Wilson intervals of each marginal
    combined with the (continuity-adjusted) phi correlation of the paired table."""
    n = n11 + n10 + n01 + n00
    if n == 0:
        raise ValueError("no pairs")
    pa, pb = (n11 + n10) / n, (n11 + n01) / n
    la, ua = wilson(n11 + n10, n, z)
    lb, ub = wilson(n11 + n01, n, z)
    margins = (n11 + n10) * (n01 + n00) * (n11 + n01) * (n10 + n00)
    phi = 0.0
    if margins > 0:
        a = n11 * n00 - n10 * n01
        if a > n / 2:
            phi = (a - n / 2) / math.sqrt(margins)
        elif a < 0:
            phi = a / math.sqrt(margins)
    d = pa - pb
    lo = d - math.sqrt(max(0.0, (pa - la) ** 2 - 2 * phi * (pa - la) * (ub - pb) + (ub - pb) ** 2))
    hi = d + math.sqrt(max(0.0, (ua - pa) ** 2 - 2 * phi * (ua - pa) * (pb - lb) + (pb - lb) ** 2))
    return d, max(-1.0, lo), min(1.0, hi)


def mcnemar_exact_p(n10: int, n01: int) -> float:
    """Two-sided exact McNemar test: the discordant pairs against Binomial(n10 + n01, 1/2)."""
    m = n10 + n01
    if m == 0:
        return 1.0
    k = min(n10, n01)
    tail = sum(math.comb(m, i) for i in range(k + 1)) / 2**m
    return min(1.0, 2 * tail)


def paired_difference(a: list[bool], b: list[bool]) -> dict:
    n11, n10, n01, n00 = paired_table(a, b)
    d, lo, hi = newcombe_paired(n11, n10, n01, n00)
    return {"diff": d, "ci95": [lo, hi], "only_format": n10, "only_reference": n01,
            "both": n11, "neither": n00, "mcnemar_p": mcnemar_exact_p(n10, n01)}


__all__ = ["Z95", "wilson", "paired_table", "newcombe_paired", "mcnemar_exact_p", "paired_difference"]
