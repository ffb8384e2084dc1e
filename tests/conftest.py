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


@pytest.fixture(scope="session")
def real_kv_1k() -> np.ndarray:
    """bf16 K and V of SmolLM2-135M layer 15 over 1024 tokens, as uint16 bit patterns,
    [2, 1, 1024, 192] (see tests/data/kv_smollm2_1k_layer15.json): enough tokens to calibrate
    on one half and measure on the other."""
    return np.load(DATA / "kv_smollm2_1k_layer15.npy")


@pytest.fixture(autouse=True)
def _haystack_from_tests(monkeypatch):
    # The NIAH tests read their haystack from tests/data, never from ../shared.
    monkeypatch.setenv("WEIGHTSZIP_NIAH_TEXT", str(DATA / "text" / "haystack"))


@pytest.fixture(autouse=True)
def _single_thread_default(monkeypatch):
    # Tests pass threads explicitly where they care; keep the default deterministic and light.
    monkeypatch.setenv("WEIGHTSZIP_THREADS", os.environ.get("WEIGHTSZIP_THREADS", "2"))


class _Launches:
    """Stands in for a kernel: records each launch's keyword arguments (``kernel[grid](...)``), its
    positional ones under ``"args"``."""

    def __init__(self):
        self.calls = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append({**kwargs, "args": args})


@pytest.fixture
def launch_recorder():
    """A factory of kernel stand-ins that record their launches (for tests of which kernel runs)."""
    return _Launches


def _compile_in_child(code: str, *args, timeout: int = 900) -> str:
    """Run ``code`` (a script that compiles kernels for sm_90 and prints what it found) in a child
    Python without TRITON_INTERPRET (test modules run Triton in its interpreter, which cannot compile
    for a GPU, and Gluon has none); returns its stdout, failing the test on a non-zero exit."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code, *map(str, args)], capture_output=True, text=True, env=env,
                       timeout=timeout)
    assert r.returncode == 0, r.stderr[-3000:]
    return r.stdout


@pytest.fixture
def compile_in_child():
    """``compile_in_child(code, *args)``: a kernel-compiling script run in a child process (its stdout)."""
    return _compile_in_child


@pytest.fixture
def fake_lm(monkeypatch):
    """``weightszip.models.load_causal_lm`` answering at once with a stand-in model of 2 layers
    (max_position_embeddings 64) and a tokenizer of one token per character: for the CLI's checks
    that need a loaded model but fail before any forward. Returns the stand-in."""
    import types

    torch = pytest.importorskip("torch")
    from weightszip import models

    def tok(text, add_special_tokens=True, return_tensors="pt"):
        return types.SimpleNamespace(input_ids=torch.tensor([[ord(c) % 256 for c in text]]))

    cfg = types.SimpleNamespace(num_hidden_layers=2, num_attention_heads=1, max_position_embeddings=64)
    lm = models.LoadedModel(model=types.SimpleNamespace(config=cfg, device=torch.device("cpu")), tokenizer=tok,
                            name="fake", source="fake", key=None, gguf_file=None, pip_packages=(), load_seconds=0.0)
    monkeypatch.setattr(models, "load_causal_lm", lambda *a, **k: lm)
    return lm


_SET_UP = r"""
import os, sys, time
def set_up(make, describe):
    # make() the child's object (its store opened), print one line, wait for GO (see _side_by_side)
    try:
        made = make()
    except Exception as e:
        print("FAILED", type(e).__name__, e, flush=True)
        sys.exit(1)
    print("open", describe(made), flush=True)
    while not os.path.exists(sys.argv[1]):
        time.sleep(0.01)
    return made
"""


def _side_by_side(code: str, argvs, *, site: str | None = None, timeout: float = 180) -> list:
    """Run ``code`` in one child Python per argument list, all at once: each child gets ``GO`` (a
    path) then its arguments, prints one line once it is set up (its store open, say), and waits
    for ``GO`` to exist before going on, so that every child is set up while the others are
    (``code`` may call ``set_up(make, describe)``, defined for it, to do that).
    ``site`` joins the children's PYTHONPATH (an integration's package folder). Returns
    (exit status, stdout, stderr) per child."""
    import subprocess
    import sys
    import tempfile

    import weightszip

    paths = [os.path.dirname(os.path.dirname(weightszip.__file__)), site, os.environ.get("PYTHONPATH")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    with tempfile.TemporaryDirectory() as d:
        go = os.path.join(d, "go")
        procs = [subprocess.Popen([sys.executable, "-c", _SET_UP + code, go, *map(str, a)], stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, env=env) for a in argvs]
        try:
            first = [p.stdout.readline() for p in procs]  # (empty when a child ended without one)
            open(go, "w").close()
            outs = [p.communicate(timeout=timeout) for p in procs]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
    return [(p.returncode, f + o, e) for p, f, (o, e) in zip(procs, first, outs)]


@pytest.fixture
def side_by_side():
    """``side_by_side(code, argvs, site=None)``: ``code`` run in several child processes at once
    (each set up while the others are); their (exit status, stdout, stderr)."""
    return _side_by_side
