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


def torch_device(text: str) -> str:
    """--device: a torch device this machine has (cpu, cuda, cuda:1, ...), kept as given; a name torch
    does not know, or a CUDA device it does not see, is argparse's usage error (it was a RuntimeError
    traceback once the model had loaded). `meta` (shapes without data: nothing to measure) is refused
    too. Without torch it is taken as given (the command then says what to install)."""
    try:
        import torch
    except ImportError:
        return text
    try:
        d = torch.device(text)
    except (RuntimeError, ValueError, TypeError):
        raise argparse.ArgumentTypeError(f"not a torch device: {text!r} (e.g. cpu, cuda, cuda:1)") from None
    if d.type == "meta":
        raise argparse.ArgumentTypeError(f"{text!r}: holds no data, so nothing can be computed on it (e.g. cpu, cuda)")
    if d.type == "cuda":
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (d.index or 0) >= n:
            raise argparse.ArgumentTypeError(f"{text!r}: no such CUDA device here (torch sees {n})")
    elif d.type != "cpu":
        try:
            torch.empty(0, device=d)
        except Exception as e:  # (mps off a Mac, xpu without one: a RuntimeError, or another type)
            why = (str(e).splitlines() or [type(e).__name__])[0].split(". ")[0][:160]
            raise argparse.ArgumentTypeError(f"{text!r}: not usable here ({why})") from None
    return text
