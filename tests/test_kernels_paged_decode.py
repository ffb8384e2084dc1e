"""Paged decode attention (weightszip.kernels) against its plain-PyTorch reference.

On a machine without a GPU the kernels run in Triton's interpreter on small shapes (set before triton
is imported). On a GPU (TRITON_INTERPRET=0) the same tests run compiled, plus real shapes.

Stated tolerance: with an fp32 output, |kernel - reference| <= 2**-8 * max|v| (the reference is fp64
with exact softmax weights; the kernel rounds the softmax weights to bf16 for the tensor cores, 2**-9
relative each, and sums in fp32). A bf16 output adds its own rounding, 2**-8 * |reference|.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from hypothesis import given, settings, strategies as st  # noqa: E402

from weightszip.errors import InvalidArgumentError  # noqa: E402
from weightszip.kernels import (  # noqa: E402
    KernelConfig,
    PagedDecodeAttention,
    dequantize_pages,
    dequantize_pages_ref,
    paged_decode_ref,
    quantize_fp8_ref,
    rope_logit_coef,
    transform_query,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
TOL = 2.0**-8


def make_case(*, B, Hq, Hkv, D, lens, page_type="bf16", block_size=16, S=0, W=0, seed=0, spare_blocks=3):
    """Random cache: pages in a shuffled pool (blocks of a sequence scattered), side tokens, q."""
    g = torch.Generator().manual_seed(seed)
    blocks_per_seq = max(1, max(-(-L // block_size) for L in lens))
    nb = B * blocks_per_seq + spare_blocks
    perm = torch.randperm(nb, generator=g)[: B * blocks_per_seq].to(torch.int32).view(B, blocks_per_seq)
    k = (torch.randn(nb, Hkv, block_size, D, generator=g) * 2).to(torch.bfloat16)
    v = torch.randn(nb, Hkv, block_size, D, generator=g).to(torch.bfloat16)
    ks = vs = None
    if page_type == "fp8":
        ks = torch.rand(Hkv, generator=g) * 0.02 + 0.002
        vs = torch.rand(Hkv, generator=g) * 0.02 + 0.002
        k = quantize_fp8_ref(k.transpose(1, 2), ks).transpose(1, 2).contiguous()
        v = quantize_fp8_ref(v.transpose(1, 2), vs).transpose(1, 2).contiguous()
    side = S + W
    k_side = torch.randn(B, side, Hkv, D, generator=g).to(torch.bfloat16) if side else None
    v_side = torch.randn(B, side, Hkv, D, generator=g).to(torch.bfloat16) if side else None
    q = torch.randn(B, Hq, D, generator=g).to(torch.bfloat16)
    to = (lambda t: None if t is None else t.to(DEVICE))
    return dict(q=to(q), k=to(k), v=to(v), bt=to(perm), ks=to(ks), vs=to(vs), k_side=to(k_side),
                v_side=to(v_side), lens=list(lens), page_type=page_type, block_size=block_size, S=S, W=W)


SMALL = KernelConfig(block_n=32)


def run_kernel(c, *, split_tokens=None, config=SMALL, out_dtype=torch.float32, **extra):
    B, Hq, D = c["q"].shape
    Hkv = c["k"].shape[1]
    attn = PagedDecodeAttention(Hq, Hkv, D, page_type=c["page_type"], block_size=c["block_size"],
                                sink_tokens=c["S"], window=c["W"], device=DEVICE,
                                config=config)
    attn.plan(c["lens"], c["bt"], split_tokens=split_tokens)
    out = torch.empty(B, Hq, D, dtype=out_dtype, device=DEVICE)
    return attn.run(c["q"], c["k"], c["v"], k_scale=c["ks"], v_scale=c["vs"], k_side=c["k_side"],
                    v_side=c["v_side"], out=out, **extra)


def run_ref(c, **extra):
    return paged_decode_ref(c["q"], c["k"], c["v"], c["bt"], c["lens"], page_type=c["page_type"],
                            block_size=c["block_size"], k_scale=c["ks"], v_scale=c["vs"],
                            sink_tokens=c["S"], window=c["W"], k_side=c["k_side"], v_side=c["v_side"],
                            **extra)


def vmax(c):
    m = dequantize_pages_ref(c["v"], c["page_type"], c["vs"]).abs().max().item()
    if c["v_side"] is not None:
        m = max(m, c["v_side"].float().abs().max().item())
    return m


def assert_close(c, out, ref):
    err = (out.double() - ref).abs().max().item()
    assert err <= TOL * vmax(c), f"max error {err:.3g} > {TOL} * max|v| = {TOL * vmax(c):.3g}"


CASES = {
    # id: (page_type, Hq, Hkv, D, lens, block_size, S, W)
    "bf16-gqa4-plain": ("bf16", 8, 2, 64, [1, 40, 200], 16, 0, 0),
    "fp8-gqa4-plain": ("fp8", 8, 2, 64, [1, 40, 200], 16, 0, 0),
    "bf16-mha-sinks-window": ("bf16", 2, 2, 32, [3, 21, 130], 16, 4, 8),
    "fp8-gqa5-sinks-window": ("fp8", 10, 2, 32, [5, 60, 129], 16, 2, 11),
    "bf16-block32-window-only": ("bf16", 4, 1, 32, [17, 64, 161], 32, 0, 16),
    "fp8-block48-sinks-only": ("fp8", 6, 3, 16, [47, 48, 145], 48, 3, 0),
    "bf16-gqa16-head128": ("bf16", 16, 1, 128, [33, 100], 16, 1, 4),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_matches_reference(case):
    pt, Hq, Hkv, D, lens, bs, S, W = CASES[case]
    c = make_case(B=len(lens), Hq=Hq, Hkv=Hkv, D=D, lens=lens, page_type=pt, block_size=bs, S=S, W=W)
    # A small split size so that sequences have several splits and the merge is exercised.
    assert_close(c, run_kernel(c, split_tokens=64), run_ref(c))


def test_bf16_output_and_default_schedule():
    c = make_case(B=2, Hq=4, Hkv=2, D=32, lens=[50, 300], page_type="fp8", S=1, W=3, seed=3)
    ref = run_ref(c)
    out = run_kernel(c, out_dtype=torch.bfloat16, config=KernelConfig(block_n=64, min_split_tokens=64))
    assert out.dtype == torch.bfloat16
    err = (out.double() - ref).abs()
    assert (err <= TOL * vmax(c) + TOL * ref.abs()).all()


def test_split_count_does_not_change_result():
    c = make_case(B=2, Hq=4, Hkv=1, D=32, lens=[256, 97], seed=5)
    one = run_kernel(c, split_tokens=4096)
    many = run_kernel(c, split_tokens=32)
    # The bf16 rounding of the softmax weights depends on each split's running max, so the two
    # schedules agree to the stated tolerance, not bit for bit.
    assert (one - many).abs().max().item() <= TOL * vmax(c)
    ref = run_ref(c)
    assert_close(c, one, ref)
    assert_close(c, many, ref)


@pytest.mark.parametrize("sms", [1, 1000], ids=["one-merge-program", "column-blocks"])
def test_transformed_domain_pages(sms, monkeypatch):
    """Pages in a transformed domain (true key = y @ A_k + mu_k, true value = y @ A_v + mu_v): the
    kernel, given q' and b (transform_query) and A_v, mu_v, equals attention over the true keys and
    values, computed here without the reference. Both merge launches (``merge_launch``: one program
    per sequence and KV head, or blocks of output columns when there are few pairs for the
    multiprocessors), with the transform and, for the side tokens alone, without it."""
    from weightszip.kernels import paged_decode as pd

    monkeypatch.setattr(pd.PagedDecodeAttention, "_num_sms", lambda self: sms)
    B, Hq, Hkv, D, S, W = 2, 4, 2, 32, 2, 5
    assert pd.merge_launch(Hq // Hkv, D, 16, True, True, B * Hkv, sms)[2] == (1 if sms == 1 else 2)
    assert pd.merge_launch(Hq // Hkv, D, 16, False, True, B * Hkv, sms)[2] == (1 if sms == 1 else 2)
    lens = [40, 130]
    c = make_case(B=B, Hq=Hq, Hkv=Hkv, D=D, lens=lens, S=S, W=W, seed=7)
    assert_close(c, run_kernel(c, split_tokens=32), run_ref(c))
    g = torch.Generator().manual_seed(11)
    a_k = (torch.linalg.qr(torch.randn(Hkv, D, D, generator=g))[0] * 1.5).to(DEVICE)
    a_v = (torch.randn(Hkv, D, D, generator=g) / D**0.5).to(DEVICE)
    mu_k = torch.randn(Hkv, D, generator=g).to(DEVICE)
    mu_v = torch.randn(Hkv, D, generator=g).to(DEVICE)
    qt, bias = transform_query(c["q"], a_k, mu_k, Hkv)
    extra = dict(q_transformed=qt, logit_bias=bias, v_inv_transform=a_v, v_mean=mu_v)
    out = run_kernel(c, split_tokens=32, **extra)
    ref = run_ref(c, **extra)

    # Independent check of the reference: true K and V, plain softmax attention.
    sm = D**-0.5
    G = Hq // Hkv
    for b, L in enumerate(lens):
        pos = torch.arange(S, L - W, device=DEVICE)
        blk = c["bt"][b].long()[pos // 16]
        for h in range(Hkv):
            kt = c["k"][blk, h, pos % 16].double() @ a_k[h].double() + mu_k[h].double()
            vt = c["v"][blk, h, pos % 16].double() @ a_v[h].double() + mu_v[h].double()
            sl = [p for p in range(S)] + [S + p % W for p in range(L - W, L)]
            ks = torch.cat([kt, c["k_side"][b, sl, h].double()])
            vs = torch.cat([vt, c["v_side"][b, sl, h].double()])
            for gi in range(G):
                hq = h * G + gi
                w = torch.softmax(ks @ c["q"][b, hq].double() * sm, 0)
                # q' and b are fp32 (transform_query): agreement to fp32 rounding.
                assert torch.allclose(ref[b, hq], w @ vs, rtol=1e-5, atol=1e-5)
    # The page part goes through A_v after the bf16 products: scale the bound by A_v's gain.
    gain = max(torch.linalg.matrix_norm(a_v.double(), ord=2).max().item(), 1.0)
    err = (out.double() - ref).abs().max().item()
    assert err <= TOL * (vmax(c) * gain + mu_v.abs().max().item())


@pytest.mark.parametrize("page_type", ["bf16", "fp8"])
def test_dequantized_values_bit_exact(page_type):
    """The values the kernel's tile loader produces equal the reference decoder's, bit for bit: every
    fp8 code that is not NaN, with a per-head scale."""
    Hkv, bs, D = 2, 32, 16
    if page_type == "fp8":
        codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
        n = Hkv * bs * D
        raw = codes.repeat(-(-2 * n // codes.numel()))[: 2 * n].view(2, Hkv, bs, D)
        pages = raw.view(torch.float8_e4m3fn)
        scale = torch.tensor([0.0123, 3.5])
    else:
        pages = torch.randn(2, Hkv, bs, D).to(torch.bfloat16)
        pages.view(-1)[:4] = torch.tensor([float("inf"), -0.0, 1e-40, -3e38])
        scale = None
    pages = pages.to(DEVICE)
    scale = None if scale is None else scale.to(DEVICE)
    got = dequantize_pages(pages, page_type, scale)
    want = dequantize_pages_ref(pages, page_type, scale)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@settings(max_examples=6, deadline=None)
@given(
    lens=st.lists(st.integers(1, 120), min_size=1, max_size=3),
    group=st.sampled_from([1, 3, 4]),
    sinks=st.integers(0, 3),
    window=st.sampled_from([0, 1, 7, 16]),
    page_type=st.sampled_from(["bf16", "fp8"]),
    split=st.sampled_from([32, 64, 1024]),
)
def test_random_batches(lens, group, sinks, window, page_type, split):
    c = make_case(B=len(lens), Hq=2 * group, Hkv=2, D=16, lens=lens, page_type=page_type, S=sinks, W=window)
    assert_close(c, run_kernel(c, split_tokens=split), run_ref(c))


# -- bad input -----------------------------------------------------------------------------------------


def _attn(**kw):
    args = dict(num_q_heads=4, num_kv_heads=2, head_dim=32, device=DEVICE)
    args.update(kw)
    return PagedDecodeAttention(**args)


@pytest.mark.parametrize("kw", [
    dict(num_q_heads=5), dict(head_dim=48), dict(block_size=24), dict(page_type="q4x"), dict(window=-1),
], ids=["heads", "head_dim", "block_size", "page_type", "window"])
def test_bad_construction(kw):
    with pytest.raises(InvalidArgumentError):
        _attn(**kw)


def test_bad_plan_and_run():
    c = make_case(B=2, Hq=4, Hkv=2, D=32, lens=[20, 40])
    attn = _attn()
    with pytest.raises(InvalidArgumentError, match="plan"):
        attn.run(c["q"], c["k"], c["v"])
    with pytest.raises(InvalidArgumentError, match="at least one token"):
        attn.plan([0, 4], c["bt"])
    with pytest.raises(InvalidArgumentError, match="int32"):
        attn.plan([20, 40], c["bt"].long())
    with pytest.raises(InvalidArgumentError, match="blocks per sequence"):
        attn.plan([20, 4000], c["bt"])
    attn.plan([20, 40], c["bt"])
    with pytest.raises(InvalidArgumentError, match="q must be"):
        attn.run(c["q"][:1], c["k"], c["v"])
    with pytest.raises(InvalidArgumentError, match="k_pages"):
        attn.run(c["q"], c["k"].float(), c["v"])
    with pytest.raises(InvalidArgumentError, match="reference block"):
        attn.run(c["q"], c["k"][:2], c["v"][:2])
    fp8 = _attn(page_type="fp8")
    fp8.plan([20, 40], c["bt"])
    k8 = c["k"].to(torch.float8_e4m3fn)
    with pytest.raises(InvalidArgumentError, match="k_scale"):
        fp8.run(c["q"], k8, k8)
    side = _attn(sink_tokens=2, window=4)
    side.plan([20, 40], c["bt"])
    with pytest.raises(InvalidArgumentError, match="k_side"):
        side.run(c["q"], c["k"], c["v"])
    bad = c["bt"].clone()
    bad[1, 0] = -1
    with pytest.raises(InvalidArgumentError, match="negative"):
        attn.plan([20, 40], bad)


def test_plan_and_run_refuse_what_used_to_pass_unchecked():
    """From a review: block ids written into the table after plan() were read unchecked (a segfault in
    the interpreter, an illegal address on a GPU); integer q_transformed gave NaN; split_tokens=0.5
    planned no page tokens; an expanded `out` aliased its rows; fractional lengths were truncated;
    a NaN sm_scale, float sizes, non-tensor options and tensors elsewhere were accepted or raised
    TypeError/AttributeError/NotImplementedError."""
    c = make_case(B=2, Hq=4, Hkv=2, D=32, lens=[20, 40], S=2, W=4)
    attn = _attn(sink_tokens=2, window=4, config=SMALL)
    want = run_ref(c)
    bt = c["bt"].clone()
    attn.plan(c["lens"], bt)
    bt[1, 1] = 10**6  # (after plan: not what run reads)
    side = dict(k_side=c["k_side"], v_side=c["v_side"])
    out = attn.run(c["q"], c["k"], c["v"], **side)
    assert (out.double() - want).abs().max().item() <= TOL * vmax(c)
    for bad in ([20.9, 40.5], [20, None], ["a", "b"], [2**70, 1]):
        with pytest.raises(InvalidArgumentError, match="seq_lens"):
            attn.plan(bad, c["bt"])
    for split in (0.5, float("inf"), "64", True):
        with pytest.raises(InvalidArgumentError, match="split_tokens"):
            attn.plan(c["lens"], c["bt"], split_tokens=split)
    for rope in (1, None, "yes"):
        with pytest.raises(InvalidArgumentError, match="rope must be a bool"):
            attn.plan(c["lens"], c["bt"], rope=rope)
    attn.plan(c["lens"], c["bt"])
    for dt in (torch.int32, torch.float64, torch.uint8):
        with pytest.raises(InvalidArgumentError, match="q_transformed"):
            attn.run(c["q"], c["k"], c["v"], q_transformed=c["q"].to(dt), **side)
    with pytest.raises(InvalidArgumentError, match="share memory"):
        attn.run(c["q"], c["k"], c["v"], out=torch.empty(1, 4, 32, device=DEVICE).expand(2, 4, 32), **side)
    for name in ("q_transformed", "logit_bias", "v_inv_transform", "v_mean"):
        with pytest.raises(InvalidArgumentError, match=name):
            attn.run(c["q"], c["k"], c["v"], **{name: "x"}, **side)
    with pytest.raises(InvalidArgumentError, match="k_side must be a tensor on q's device"):
        attn.run(c["q"], c["k"], c["v"], k_side=c["k_side"].to("meta"), v_side=c["v_side"])
    for kw in (dict(sm_scale=float("nan")), dict(sm_scale="x"), dict(sm_scale=-1.0), dict(num_q_heads=4.0),
               dict(head_dim=32.0), dict(block_size=16.0), dict(sink_tokens=1.5), dict(config="x"),
               dict(device="nowhere")):
        with pytest.raises(InvalidArgumentError):
            _attn(**kw)


def test_plan_refuses_block_tables_with_strided_rows():
    """The kernels read a row's entries at row + j: a table whose columns are not adjacent in memory is
    refused (a transposed view of valid ids read block 0 twice; a column slice read the ids between)."""
    attn = _attn(num_q_heads=2, num_kv_heads=1)
    transposed = torch.tensor([[0, 0], [1, 1]], dtype=torch.int32, device=DEVICE).t()[:1]  # values [[0, 1]]
    assert transposed.tolist() == [[0, 1]] and transposed.stride(1) != 1
    with pytest.raises(InvalidArgumentError, match="contiguous rows"):
        attn.plan([32], transposed)
    sliced = torch.tensor([[0, 10**6, 1, 7]], dtype=torch.int32, device=DEVICE)[:, ::2]  # values [[0, 1]]
    with pytest.raises(InvalidArgumentError, match="contiguous rows"):
        attn.plan([32], sliced)
    # rows need not be adjacent: a row slice of a wider table, and a one-column table of any stride
    wide = torch.tensor([[0, 1, 7, 7], [1, 0, 7, 7]], dtype=torch.int32, device=DEVICE)
    attn.plan([32], wide[:1, :2])
    attn.plan([16], wide[:, ::2][:1, :1])


def test_fp8_scales_must_be_contiguous():
    """The kernels read a KV head's scale at scale + head: a strided scale tensor is refused."""
    c = make_case(B=1, Hq=4, Hkv=2, D=32, lens=[32], page_type="fp8")
    attn = _attn(page_type="fp8")
    attn.plan(c["lens"], c["bt"])
    strided = torch.stack([c["ks"], torch.full_like(c["ks"], 100.0)], 1).reshape(-1)[::2]  # values equal ks
    assert torch.equal(strided, c["ks"]) and not strided.is_contiguous()
    with pytest.raises(InvalidArgumentError, match="k_scale"):
        attn.run(c["q"], c["k"], c["v"], k_scale=strided, v_scale=c["vs"])
    with pytest.raises(InvalidArgumentError, match="scale"):
        dequantize_pages(c["k"], "fp8", strided)


def test_out_must_be_a_float_tensor():
    """out's dtype is the output's: an integer or fp8 buffer (which truncated the output) is refused;
    bf16, fp16 and fp32 are taken (the tests read fp32 outputs of bf16 queries)."""
    c = make_case(B=1, Hq=4, Hkv=2, D=32, lens=[20])
    attn = _attn()
    attn.plan(c["lens"], c["bt"])
    for dt in (torch.int32, torch.uint8, torch.float8_e4m3fn, torch.float64):
        with pytest.raises(InvalidArgumentError, match="out must be"):
            attn.run(c["q"], c["k"], c["v"], out=torch.zeros(1, 4, 32, dtype=dt, device=DEVICE))


def test_dequantize_pages_refuses_shapes_its_kernel_cannot_tile():
    """The kernel tiles 16 tokens of a power-of-two head_dim: a block_size of 24 or 8 left rows of the
    output unwritten, a head_dim of 48 failed inside Triton."""
    p = torch.randn(1, 1, 24, 32).to(torch.bfloat16).to(DEVICE)
    with pytest.raises(InvalidArgumentError, match="block_size"):
        dequantize_pages(p, "bf16")
    with pytest.raises(InvalidArgumentError, match="block_size"):
        dequantize_pages(p[:, :, :8], "bf16")
    with pytest.raises(InvalidArgumentError, match="head_dim"):
        dequantize_pages(torch.randn(1, 1, 16, 48).to(torch.bfloat16).to(DEVICE), "bf16")


def test_query_helpers_check_shapes():
    q = torch.randn(2, 4, 32)
    with pytest.raises(InvalidArgumentError, match="num_kv_heads"):
        transform_query(q[:, :3], None, None, 2)
    with pytest.raises(InvalidArgumentError, match="k_inv_transform"):
        transform_query(q, torch.eye(16).expand(2, 16, 16), None, 2)
    with pytest.raises(InvalidArgumentError, match="k_mean"):
        transform_query(q, None, torch.zeros(1, 32), 2)
    with pytest.raises(InvalidArgumentError, match="q must be"):
        transform_query(q[0], None, None, 2)
    with pytest.raises(InvalidArgumentError, match="k_rope_m"):
        rope_logit_coef(q, torch.zeros(2, 16), 2)
    with pytest.raises(InvalidArgumentError, match="num_kv_heads"):
        rope_logit_coef(q, torch.zeros(3, 32), 3)
    # a q whose heads are not adjacent in memory (head_dim contiguous, as run() takes it) works
    wide = torch.randn(2, 8, 32)[:, ::2]
    m = torch.randn(2, 32)
    qt, bias = transform_query(wide, torch.randn(2, 32, 32), m, 2)
    qt_c, bias_c = transform_query(wide.contiguous(), None, m, 2)
    assert torch.equal(bias, bias_c) and qt.shape == qt_c.shape
    assert torch.equal(rope_logit_coef(wide, m, 2), rope_logit_coef(wide.contiguous(), m, 2))


@settings(max_examples=60, deadline=None)
@given(lens=st.lists(st.integers(1, 40000), min_size=1, max_size=12), heads=st.sampled_from([1, 2, 8]),
       waves=st.integers(1, 3), rope_waves=st.integers(0, 3), rope=st.booleans(), gluon=st.booleans(),
       min_split=st.sampled_from([16, 1000, 2048]), block_n=st.sampled_from([16, 128]),
       sinks=st.sampled_from([0, 4, 200]), window=st.sampled_from([0, 64]))
def test_default_split_fits_the_programs(lens, heads, waves, rope_waves, rope, gluon, min_split, block_n, sinks,
                                         window):
    """The planner's default split (``_fit_split``) is the shortest whole number of steps, at least
    min_split_tokens, whose items times the KV heads fit in waves x multiprocessors (7 here; with
    ``plan(rope=True)``, rope_waves where positive and the Gluon kernel with the term would run, here
    as ``gluon`` says); where even one item a sequence is more, one item a sequence. Its schedule
    covers each sequence's paged tokens once (every item in range, consecutive, none empty)."""
    cfg = KernelConfig(block_n=block_n, num_warps=4, num_stages=1, waves=waves, rope_waves=rope_waves,
                       min_split_tokens=min_split)
    attn = PagedDecodeAttention(heads * 2, heads, 32, config=cfg, sink_tokens=sinks, window=window, device="cpu")
    attn._num_sms = lambda: 7
    asked = []
    attn._compact_gluon_applies = lambda has_rope, tokens, trig: asked.append((has_rope, tokens)) or gluon
    bt = torch.zeros(len(lens), -(-max(lens) // 16), dtype=torch.int32)
    info = attn.plan(lens, bt, rope=rope)
    split, budget = info["split_tokens"], 7 * (rope_waves if rope and rope_waves and gluon else waves) // heads
    assert asked in ([], [(True, info["paged_tokens"])])
    assert split % block_n == 0 and split >= min_split
    a0 = sinks // block_n * block_n
    spans = [max(n - window, 0) - a0 if n - window > sinks else 0 for n in lens]

    def items(t):
        return sum(-(-s // t) for s in spans)

    assert info["items"] == items(split)
    if items(split) > max(budget, 1):  # only where one item a sequence is already more
        assert items(split) == sum(s > 0 for s in spans)
    else:
        shorter = split - block_n
        assert shorter < min_split or items(shorter) > max(budget, 1)
    p = attn._plan
    seq, start, end = (p[k].tolist() for k in ("work_seq", "work_start", "work_end"))
    for i, n in enumerate(lens):
        mine = [(a, b) for s_, a, b in zip(seq, start, end) if s_ == i]
        lo, hi = sinks, n - window
        want = [(lo, hi)] if hi > lo else []
        assert [(mine[0][0], mine[-1][1])] == want if mine else want == []
        assert all(a < b for a, b in mine) and all(b == a2 for (_, b), (a2, _) in zip(mine, mine[1:]))


def test_one_wave_only_where_the_gluon_kernel_with_the_rotary_term_runs():
    """``rope_waves`` (1 in the compact default against ``waves`` 2) sets the split of a step planned with
    ``rope=True`` only where the Gluon kernel with the term will run: not in the interpreter (the
    Triton kernel), not for bf16 pages, not with ``rope=False``."""
    from weightszip.kernels import DEFAULT_CONFIGS
    from weightszip.kernels.paged_decode import PAGE_COMPACT

    cfg = DEFAULT_CONFIGS[PAGE_COMPACT]
    assert (cfg.waves, cfg.rope_waves) == (2, 1)
    lens, bt = [8192] * 4, torch.zeros(4, 512, dtype=torch.int32)
    attn = PagedDecodeAttention(8, 2, 64, page_type="compact", k_bits=4, v_bits=4, device="cpu")
    attn._num_sms = lambda: 8
    assert not attn._compact_gluon_applies(True, 4 * 8192, False)  # (this test runs on the CPU)
    two = attn.plan(lens, bt)["items"]
    assert attn.plan(lens, bt, rope=True)["items"] == two == 8  # 8 SMs x 2 waves / 2 KV heads
    attn._compact_gluon_applies = lambda has_rope, tokens, trig: has_rope
    assert attn.plan(lens, bt, rope=True)["items"] == 4 and attn.plan(lens, bt)["items"] == two
    bf16 = PagedDecodeAttention(8, 2, 64, config=cfg, device="cpu")
    assert not bf16._compact_gluon_applies(True, 4 * 8192, False)


_COMPILE_MERGE = """
import sys
from weightszip.kernels.paged_decode import _merge_kernel, merge_launch
from weightszip.kernels.paged_decode_gluon import compile_for_hopper

group, d, transform, side, programs = (int(x) for x in sys.argv[1:6])
block_g = max(16, 1 << (group - 1).bit_length())
block_i, warps, blocks = merge_launch(group, d, block_g, bool(transform), bool(side), programs, 132)
ptrs = {"q_ptr": "*bf16", "k_side_ptr": "*bf16", "v_side_ptr": "*bf16", "ws_m_ptr": "*fp32", "ws_l_ptr": "*fp32",
        "ws_acc_ptr": "*fp32", "v_inv_ptr": "*fp32", "v_mean_ptr": "*fp32", "out_ptr": "*bf16"}
const = dict(GROUP=group, BLOCK_G=block_g, HEAD_DIM=d, SINKS=4 if side else 0, WINDOW=64 if side else 0, BLOCK_S=64,
             BLOCK_I=block_i, HAS_V_TRANSFORM=bool(transform), HAS_V_MEAN=bool(transform), BLOCK_C=d // blocks)
# as a launch specializes them: 16-byte aligned pointers, strides of whole head_dim rows
aligned = (*ptrs, "seq_lens_ptr", "item_indptr_ptr", "stride_qb", "stride_qh", "stride_sb", "stride_st", "stride_sh",
           "stride_ob", "stride_oh")
k, spills = compile_for_hopper(_merge_kernel, const, ptrs, warps, divisible=aligned)
print("warps", warps, "blocks", blocks, "spills", spills)
"""


@pytest.mark.parametrize("case", [(4, 128, 0, 0, 8), (8, 128, 0, 0, 8), (8, 128, 1, 0, 8), (7, 128, 1, 0, 8),
                                  (16, 128, 0, 0, 8), (16, 128, 1, 0, 8), (8, 64, 1, 0, 8), (32, 128, 0, 0, 8),
                                  (8, 128, 0, 1, 8), (8, 128, 1, 1, 8), (4, 128, 1, 1, 8), (4, 128, 1, 0, 8),
                                  (4, 128, 1, 1, 256), (4, 128, 0, 1, 256)],
                         ids=["g4", "g8", "g8-transform", "g7-transform", "g16", "g16-transform", "g8-d64-transform",
                              "g32", "g8-side", "g8-side-transform", "g4-side-transform", "g4-transform",
                              "g4-side-transform-256", "g4-side-256"])
def test_merge_launch_compiles_without_spills(case, compile_in_child):
    """The merge kernel at the splits a step, warps and column blocks ``merge_launch`` gives for
    ``programs`` (sequence, KV head) pairs on 132 multiprocessors (one or two warps and 4-8 column
    blocks for the measured 8 x 128 and smaller with few pairs) compiles for sm_90 and ptxas spills
    at most 16 bytes (the 4-warp launch's own at 16 x 128 with the transform); one warp at 16 x 128
    spilled 952, 8 column blocks of one warp with the transform and no side tokens 78. Pointers and
    strides are compiled as a launch specializes them (multiples of 16): without that hint ptxas
    reports spills the launched kernel does not have (320 bytes for 8 blocks with side tokens)."""
    group, d, transform, side, programs = case
    out = compile_in_child(_COMPILE_MERGE, *case, timeout=600).split()
    assert out[-6:-1:2] == ["warps", "blocks", "spills"], out
    assert int(out[-1]) <= 16, out
    if group * d > 8 * 128 or (side and programs * 8 > 4 * 132):
        assert out[-5] == "4" and out[-3] == "1", out
    elif transform or side:
        assert int(out[-3]) > 1 and d // int(out[-3]) >= 16, out


# -- real shapes, GPU only -----------------------------------------------------------------------------


@pytest.mark.skipif(DEVICE != "cuda", reason="real shapes need the GPU")
@pytest.mark.parametrize("page_type", ["bf16", "fp8"])
@pytest.mark.parametrize("shape", [(32, 8, 128), (8, 1, 128)], ids=["llama8b", "llama70b-tp8"])
def test_real_shapes_gpu(page_type, shape):
    Hq, Hkv, D = shape
    lens = [4096, 1, 777, 16384 + 5]
    for S, W in ((0, 0), (4, 128)):
        c = make_case(B=len(lens), Hq=Hq, Hkv=Hkv, D=D, lens=lens, page_type=page_type, S=S, W=W, seed=S)
        out = run_kernel(c, config=None)
        assert_close(c, out, run_ref(c))


# -- the Gluon fp8 kernel (paged_decode_gluon.fp8_split_kernel; KernelConfig(gluon=True), the fp8 default) --


@pytest.mark.skipif(DEVICE != "cuda", reason="the Gluon kernel is compiled only (no interpreter)")
@pytest.mark.parametrize("block_size", [16, 48])
@pytest.mark.parametrize("shape", [(32, 8, 128), (8, 1, 128), (12, 4, 64)], ids=["llama8b", "llama70b-tp8", "gqa3-64"])
def test_gluon_fp8_matches_reference_gpu(shape, block_size):
    """The Gluon fp8 kernel against the fp64 reference within the stated tolerance, with and without
    sinks and a window; the slots past each sequence's end and the sinks' slots hold NaN codes (a
    cache's unwritten positions may), which must not reach the output (the kernel zero-fills rows
    outside each split)."""
    from weightszip.kernels import paged_decode_gluon as pg

    launches = []
    real = pg.fp8_split_kernel

    class Counted:  # the Gluon kernel must be the one that ran
        def __getitem__(self, grid):
            launches.append(grid)
            return real[grid]

    Hq, Hkv, D = shape
    lens = [4096, 1, 777, 16384 + 5]
    for S, W in ((0, 0), (4, 128)):
        c = make_case(B=len(lens), Hq=Hq, Hkv=Hkv, D=D, lens=lens, page_type="fp8", block_size=block_size, S=S,
                      W=W, seed=S)
        bound = TOL * vmax(c)  # before the NaN codes below (they are never read, but max() would see them)
        k8, v8 = c["k"].view(torch.uint8), c["v"].view(torch.uint8)
        for b, L in enumerate(lens):
            last = c["bt"][b, (L - 1) // block_size].item()
            k8[last, :, (L - 1) % block_size + 1:] = 0x7F  # an e4m3 NaN
            v8[last, :, (L - 1) % block_size + 1:] = 0x7F
            first = c["bt"][b, 0].item()  # the sinks' positions: kept beside the pages, never written there
            k8[first, :, :min(S, L)] = 0x7F
            v8[first, :, :min(S, L)] = 0x7F
        pg.fp8_split_kernel = Counted()
        try:
            out = run_kernel(c, config=KernelConfig(gluon=True, gluon_min_work=0))
        finally:
            pg.fp8_split_kernel = real
        assert launches, "the Gluon fp8 kernel did not run"
        assert torch.isfinite(out).all()
        err = (out.double() - run_ref(c)).abs().max().item()
        assert err <= bound, f"max error {err:.3g} > {bound:.3g}"


_COMPILE_GLUON_FP8 = """
import sys
from weightszip.kernels.paged_decode_gluon import compile_for_hopper, fp8_split_kernel

d, group, stages = (int(x) for x in sys.argv[1:4])
ptrs = {"q_ptr": "*bf16", "k_pages_ptr": "*fp8e4nv", "v_pages_ptr": "*fp8e4nv", "ws_m_ptr": "*fp32",
        "ws_l_ptr": "*fp32", "ws_acc_ptr": "*fp32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
const = dict(GROUP=group, BLOCK_G=max(8, 1 << (group - 1).bit_length()), HEAD_DIM=d, BLOCK_SIZE=16, STAGES=stages)
k, spills = compile_for_hopper(fp8_split_kernel, const, ptrs, 8, 128)
ptx = k.asm["ptx"]
print("zfill", "cp.async.cg.shared.global [a], [" in ptx and "16, %r" in ptx, "cvt", "cvt.rn.f16x2.e4m3x2" in ptx,
      "mma", "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32" in ptx, "shared", k.metadata.shared,
      "spills", spills)
"""


@pytest.mark.parametrize("case", [(128, 4, 2), (128, 8, 4), (64, 3, 2), (64, 16, 2)],
                         ids=["8b", "70b-4stages", "head64-gqa3", "head64-gqa16"])
def test_gluon_fp8_kernel_compiles_for_hopper(case, compile_in_child):
    """The Gluon fp8 kernel compiles for sm_90 without a GPU (a child process: this module runs Triton
    in its interpreter, which Gluon lacks): its operand layouts are asserted trivial at compile time,
    the pages come by zero-filling cp.async, e4m3 pairs convert to f16 pairs for f16 mma.sync, its
    shared memory is the staging PagedDecodeAttention budgets for (``fp8_smem_bytes``), and at 8 warps
    and 128 registers ptxas spills nothing."""
    from weightszip.kernels.paged_decode_gluon import fp8_smem_bytes

    out = compile_in_child(_COMPILE_GLUON_FP8, *case, timeout=600)
    d, _, stages = case
    assert out.split()[-10:] == ["zfill", "True", "cvt", "True", "mma", "True", "shared",
                                 str(fp8_smem_bytes(d, 8, stages)), "spills", "0"], out


@pytest.mark.parametrize("what", ["gluon", "default", "small-step", "wide-group", "group16", "head32", "bias",
                                  "one-warp"])
def test_gluon_fp8_kernel_is_chosen_where_it_applies(what, monkeypatch, launch_recorder):
    """fp8 pages run the Gluon kernel with ``KernelConfig(gluon=True)`` (the default), a large enough
    step (the default's ``gluon_min_work``), head_dim 64 or 128 and a GQA group up to 8 (the shapes
    its GPU tests cover), no logit bias and 2 warps or more; the Triton kernel otherwise.
    (Both kernels replaced by recorders; the GPU simulated by turning the interpreter flag off.)"""
    from weightszip.kernels import paged_decode as pd
    from weightszip.kernels import paged_decode_gluon as pg

    tri, glu = launch_recorder(), launch_recorder()
    monkeypatch.setattr(pd, "_interpreting", lambda: False)
    monkeypatch.setattr(pd, "_paged_split_kernel", tri)
    monkeypatch.setattr(pg, "fp8_split_kernel", glu)
    # a group of 32 at head_dim 64: 64 x 32 > GLUON_MAX_ACC; a group of 16 fits it but has not run on a GPU
    Hq = {"wide-group": 64, "group16": 32}.get(what, 8)
    c = make_case(B=2, Hq=Hq, Hkv=2, D=32 if what == "head32" else 64, lens=[40, 200], page_type="fp8")
    cfg = None if what == "default" else KernelConfig(block_n=32, gluon=True, gluon_warps=1 if what == "one-warp" else 8,
                                                      gluon_min_work=10**9 if what == "small-step" else 0)
    extra = {"logit_bias": torch.zeros(2, Hq, device=DEVICE)} if what == "bias" else {}
    default = pd.DEFAULT_CONFIGS[pd.PAGE_FP8]
    run_kernel(c, config=cfg if cfg is not None else default, **extra)
    assert default.gluon
    want = what == "gluon" or (what == "default" and (40 + 200) * 2 >= default.gluon_min_work)
    assert (len(glu.calls), len(tri.calls)) == ((1, 0) if want else (0, 1))
    if want:
        used = cfg if cfg is not None else default
        assert glu.calls[0]["STAGES"] == used.gluon_stages and glu.calls[0]["num_warps"] == used.gluon_warps


def _max_bank_ways(offsets) -> int:
    """The most distinct 32-bit words one bank serves in a warp's shared load at these byte offsets
    (one per lane): 1 is conflict-free."""
    words = {}
    for off in offsets:
        words.setdefault((off // 4) % 32, set()).add(off // 4)
    return max(len(w) for w in words.values())


@pytest.mark.parametrize("d", [64, 128])
def test_gluon_fp8_staging_slot_layout(d):
    """The fp8 kernel's staged page (``fp8_staged_offset``, the arithmetic of ``_fp8_chunk``): the 32
    rows' bytes land at distinct places inside the slot, K row 0's padding (where the carried block
    word goes, byte head_dim) holds no data; every global 32-byte sector of a row lands in one aligned
    32 bytes (a copy fetches each sector once); the K operand's 16-bit loads (lanes t, nl of
    ``k_layout``) and the V operand's byte loads (lanes j, tl of ``v_layout``, both rows of a pair)
    are free of bank conflicts, and a pair's odd row lies one row pitch after its even row (the
    load's immediate)."""
    from weightszip.kernels.paged_decode_gluon import _fp8_row, fp8_smem_bytes, fp8_staged_offset

    pitch, m = _fp8_row(d), d // 32
    slot = fp8_smem_bytes(d, 1, 1)
    offs = [fp8_staged_offset(r, b, d) for r in range(32) for b in range(d)]
    assert len(set(offs)) == len(offs) and min(offs) >= 0 and max(offs) < slot
    assert not set(range(d, d + 4)) & set(offs)
    for r in range(32):
        for k in range(d // 32):
            sector = sorted(fp8_staged_offset(r, 32 * k + b, d) for b in range(32))
            assert sector[0] % 32 == 0 and sector == list(range(sector[0], sector[0] + 32)), (r, k)
    for nh in range(2):  # K: register (nh, m, i), lane (nl, t): row 8 nh + nl, bytes 32 m + 8 i + 2 t
        for mm in range(m):
            for i in range(4):
                lanes = [fp8_staged_offset(8 * nh + nl, 32 * mm + 8 * i + 2 * t, d) for nl in range(8) for t in range(4)]
                assert _max_bank_ways(lanes) == 1, (d, nh, mm, i)
    for mm in range(m):  # V: register (m, i1, i0, th), lane (j, tl): rows 16 + 8 th + 2 tl (+ 1)
        for i1 in range(2):
            for i0 in range(2):
                for th in range(2):
                    for e in range(2):
                        lanes = [fp8_staged_offset(16 + 8 * th + 2 * tl + e, 32 * mm + 16 * i1 + 8 * i0 + j, d)
                                 for j in range(8) for tl in range(4)]
                        assert _max_bank_ways(lanes) == 1, (d, mm, i1, i0, th, e)
                    for tl in range(4):
                        for j in range(8):
                            ch, row = 32 * mm + 16 * i1 + 8 * i0 + j, 16 + 8 * th + 2 * tl
                            assert fp8_staged_offset(row + 1, ch, d) == fp8_staged_offset(row, ch, d) + pitch
