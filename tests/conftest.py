import os
import pathlib

import numpy as np
import pytest

DATA = pathlib.Path(__file__).parent / "data"


@pytest.fixture(scope="session")
def real_kv() -> np.ndarray:
    """bf16 K and V of SmolLM2-135M (layers 0, 1, 15; 64 tokens), as uint16 bit patterns,
    [2, 3, 64, 192] (see tests/data/kv_smollm2_64tok.json)."""
    return np.load(DATA / "kv_smollm2_64tok.npy")


@pytest.fixture(autouse=True)
def _haystack_from_tests(monkeypatch):
    # The NIAH tests read their haystack from tests/data, never from ../shared.
    monkeypatch.setenv("WEIGHTSZIP_NIAH_TEXT", str(DATA / "text" / "haystack"))


@pytest.fixture(autouse=True)
def _single_thread_default(monkeypatch):
    # Tests pass threads explicitly where they care; keep the default deterministic and light.
    monkeypatch.setenv("WEIGHTSZIP_THREADS", os.environ.get("WEIGHTSZIP_THREADS", "2"))


class _Launches:
    """Stands in for a kernel: records each launch's keyword arguments (``kernel[grid](...)``)."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append(kwargs)


@pytest.fixture
def launch_recorder():
    """A factory of kernel stand-ins that record their launches (for tests of which kernel runs)."""
    return _Launches
