"""argparse types shared by the command lines (`weightszip` and its eval, kv, calibrate commands):
a bad count is argparse's usage error (exit status 2), never a traceback."""

from __future__ import annotations

import argparse

from weightszip import _core

# The largest count taken (byte sizes: the core's are u64; a larger one was an OverflowError).
MAX_COUNT = 2**63 - 1


def _count(text: str) -> int:
    """An integer >= 0 (argparse's usage error otherwise)."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {n}")
    return n


def positive_int(text: str) -> int:
    """A count >= 1 (GPUs, sessions)."""
    n = _count(text)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def nonnegative_int(text: str) -> int:
    """A count (bytes, threads) >= 0 and at most MAX_COUNT."""
    n = _count(text)
    if n > MAX_COUNT:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_COUNT}, got {text}")
    return n


def thread_count(text: str) -> int:
    """--threads: >= 0 (0: the default); a count above the core's cap (MAX_THREADS, 256) is taken
    as the cap, as the core takes it (a typo's huge count neither fails nor spawns that many)."""
    return min(_count(text), _core.MAX_THREADS)
