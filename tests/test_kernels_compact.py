"""Compact pages (q4, q3.5, q3) in the paged decode kernel and the cache-write kernel, against the
reference codec (weightszip.compact.codec) on real SmolLM2 KV.

On a machine without a GPU the kernels run in Triton's interpreter (set before triton is imported).

Stated tolerances (attention output, fp32, against the fp64 reference over the same dequantized
pages, |error| / max|v| with v the true-domain values, decoded pages and side tokens alike):
* CUDA-core path (``cuda_dot``): products and sums in fp32: 2**-16 without side tokens; with side
  tokens the merge's bf16 softmax weights for them (as for every page type) bring it to 2**-8.
* tensor-core path: q', the codebook values and the scaled softmax weights are rounded to bf16
  (2**-9 relative each) before the products: 2**-6.
"""

import collections
import dataclasses
import math
import os
import re

os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from weightszip.compact import calibrate as C  # noqa: E402
from weightszip.compact import codec  # noqa: E402
from weightszip.errors import InvalidArgumentError  # noqa: E402
from weightszip.kernels import (  # noqa: E402
    KernelConfig,
    PagedDecodeAttention,
    paged_decode_ref,
    rope_logit_coef,
    rope_page_table,
    transform_query,
)
from weightszip.kernels.compact_write import compact_write, compact_write_tables  # noqa: E402
from weightszip.kernels.compact_write_ref import compact_write_ref  # noqa: E402
from weightszip.kernels.paged_decode import (  # noqa: E402
    _lut_order,
    _lut_tile,
    compact_tables,
    dequantize_compact_pages,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
DATA = Path(__file__).resolve().parent / "data"


def real_kv():
    """Real SmolLM2 K and V (bf16, post-RoPE): [2 (K, V), 3 layers, 64 tokens, 3 heads, 64]."""
    a = np.load(DATA / "kv_smollm2_64tok.npy")
    return torch.from_numpy(a.astype(np.int16)).view(torch.bfloat16).view(2, 3, 64, 3, 64)


def tables_for(x, kind, bits, seed=0):
    h, d = x.shape[1], x.shape[2]
    rng = np.random.default_rng(seed)
    signs = torch.from_numpy(rng.choice([-1, 1], size=d)).to(torch.int64)
    mu, mult, e0, cbs = C.fit_tables(x.float(), torch.ones(h, d), kind, signs, rng)
    return [codec.HeadTables(mu[i], mult[i], signs, int(e0[i]), cbs[bits], bits) for i in range(h)]


KV = real_kv()


def pool(nb, h, block_size, bits, d):
    return torch.zeros(nb, h, block_size // 16, codec.page_bytes(bits, d), dtype=torch.uint8, device=DEVICE)


# -- the tile loader ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 3, 4, 5])
def test_dequantized_tile_equals_decode_page(bits):
    """Pages built by the reference (encode_page): the kernel's tile loader gives codec.decode_page's
    values bit for bit, every head with its own tables, pages of a 32-token block in any order."""
    kind = "k" if bits % 2 else "v"
    x = KV[0 if kind == "k" else 1, 2]  # [64, 3, 64]
    tabs = tables_for(x, kind, bits, seed=bits)
    h, d = 3, 64
    pages = pool(2, h, 32, bits, d).cpu()
    order = [3, 0, 2, 1]  # token page i goes to pool page order[i]
    for i, j in enumerate(order):
        for hh in range(h):
            pages[j // 2, hh, j % 2] = codec.encode_page(x[16 * i: 16 * (i + 1), hh], tabs[hh])
    ct = compact_tables(tabs, tabs, DEVICE)
    got = dequantize_compact_pages(pages.to(DEVICE), bits, ct["k_codebook"], ct["k_grid"]).cpu()
    for i, j in enumerate(order):
        for hh in range(h):
            want = codec.decode_page(pages[j // 2, hh, j % 2], tabs[hh])
            assert torch.equal(got[j // 2, hh, 16 * (j % 2): 16 * (j % 2) + 16].view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_pair_table_tile_equals_decode_page_in_bf16(bits):
    """The tensor-core path's loader (one gather of a packed pair of bf16 codebook values per two
    channels): every value is float32(bf16(codebook[code])) * grid[k], codec.decode_page's value with
    the codebook rounded to bf16, bit for bit; and the pair table packs (a, b) as the low/high half."""
    from weightszip.kernels.paged_decode import compact_pair_table

    kind = "v" if bits % 2 else "k"
    x = KV[0 if kind == "k" else 1, 1]  # [64, 3, 64]
    tabs = tables_for(x, kind, bits, seed=10 + bits)
    h, d = 3, 64
    pages = pool(2, h, 32, bits, d).cpu()
    for i in range(4):
        for hh in range(h):
            pages[i // 2, hh, i % 2] = codec.encode_page(x[16 * i: 16 * (i + 1), hh], tabs[hh])
    ct = compact_tables(tabs, tabs, DEVICE)
    got = dequantize_compact_pages(pages.to(DEVICE), bits, ct["k_codebook"], ct["k_grid"], pairs=True).cpu()
    n = 2**bits
    pt = compact_pair_table(ct["k_codebook"].cpu())
    cb16 = ct["k_codebook"].cpu().to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    a, b = 3 % n, n - 1
    assert int(pt[1, a | b << bits]) & 0xFFFFFFFF == int(cb16[1, a]) | int(cb16[1, b]) << 16
    for i in range(4):
        for hh in range(h):
            codes, sidx = codec.unpack_page(pages[i // 2, hh, i % 2], bits, d)
            cb = tabs[hh].codebook.to(torch.bfloat16).float()
            want = cb[codes.long()] * tabs[hh].grid()[sidx.long()][:, None]
            assert torch.equal(got[i // 2, hh, 16 * (i % 2): 16 * (i % 2) + 16].view(torch.int32), want.view(torch.int32))


# -- the write kernel ---------------------------------------------------------------------------------


def hostile(x):
    x = x.clone()
    x[3, 0, 5] = float("nan")
    x[4, 1, :] = float("inf")
    x[5, 2, 0] = -float("inf")
    x[6, 0, :] = 0.0
    x[7, 1, 3] = 3e38
    x[8, 2, :7] = -2.5e6
    x[9, 0, :] = float("nan")
    return x


@pytest.mark.parametrize("bits,kind", [(2, "k"), (3, "v"), (4, "k"), (5, "v")])
def test_write_kernel_bytes_equal_the_reference(bits, kind):
    x = KV[0 if kind == "k" else 1, 1]
    tabs = tables_for(x, kind, bits)
    xs = hostile(x[:48])
    g = torch.Generator().manual_seed(bits)
    nb, bs = 4, 32
    slots = torch.randperm(nb * bs, generator=g)[:48]
    slots[11] = -1  # padding: writes nothing
    got = pool(nb, 3, bs, bits, 64)
    want = got.clone().cpu()
    compact_write(xs.to(DEVICE), slots.to(DEVICE), got, compact_write_tables(tabs, DEVICE))
    compact_write_ref(xs, slots, want, tabs)
    assert torch.equal(got.cpu(), want)
    # Independent of compact_write_ref: whole pages against codec.encode_page.
    full = pool(1, 3, 16, bits, 64)
    compact_write(xs[16:32].to(DEVICE), torch.arange(16, device=DEVICE), full, compact_write_tables(tabs, DEVICE))
    for hh in range(3):
        assert torch.equal(full[0, hh, 0].cpu(), codec.encode_page(xs[16:32, hh], tabs[hh]))


def test_write_kernel_narrow_heads_at_width_3():
    """head_dim 16 at width 3: the write kernel keeps bit planes there, as the codec does (a bit-2 word
    covers 32 channels): whole pages equal codec.encode_page."""
    x = KV[1, 1][:16, :, :16].contiguous()
    tabs = tables_for(x, "v", 3)
    full = pool(1, 3, 16, 3, 16)
    compact_write(x.to(DEVICE), torch.arange(16, device=DEVICE), full, compact_write_tables(tabs, DEVICE))
    for hh in range(3):
        assert torch.equal(full[0, hh, 0].cpu(), codec.encode_page(x[:, hh], tabs[hh]))


def rope_tables(x, bits, seed=0):
    """K tables with rotary offsets fitted on x [T, H, d] (positions 0..T-1)."""
    h, d = x.shape[1], x.shape[2]
    rng = np.random.default_rng(seed)
    signs = torch.from_numpy(rng.choice([-1, 1], size=d)).to(torch.int64)
    inv = 1e4 ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
    phase = C.rope_phase_steps(inv)
    xb = (x.float() + torch.linspace(-3, 3, d)).to(torch.bfloat16)  # give the keys an offset to take off
    m = C._rope_offsets([xb], inv, phase)
    pos = torch.arange(x.shape[0])
    mu, mult, e0, cbs = C.fit_tables(xb.float(), torch.ones(h, d), "k", signs, rng, rope_m=m, rope_phase=phase, positions=pos)
    tabs = [codec.HeadTables(mu[i], mult[i], signs, int(e0[i]), cbs[bits], bits, rope_m=m[i], rope_phase=phase)
            for i in range(h)]
    assert all(t.has_rope_offset for t in tabs)
    return tabs, xb


def test_write_kernel_bytes_with_rotary_offsets():
    tabs, xb = rope_tables(KV[0, 1], 4)
    xs = hostile(xb[:48])
    g = torch.Generator().manual_seed(7)
    slots = torch.randperm(4 * 32, generator=g)[:48]
    positions = torch.randint(0, 2**31 - 1, (48,), generator=g)
    positions[:8] = torch.arange(8)
    got = pool(4, 3, 32, 4, 64)
    want = got.clone().cpu()
    t = compact_write_tables(tabs, DEVICE)
    compact_write(xs.to(DEVICE), slots.to(DEVICE), got, t, positions.to(DEVICE))
    compact_write_ref(xs, slots, want, tabs, positions)
    assert torch.equal(got.cpu(), want)
    other = pool(4, 3, 32, 4, 64)
    compact_write(xs.to(DEVICE), slots.to(DEVICE), other, t, (positions + 1).to(DEVICE))
    assert not torch.equal(other.cpu(), want)  # the bytes depend on the positions
    with pytest.raises(InvalidArgumentError, match="positions"):
        compact_write(xs.to(DEVICE), slots.to(DEVICE), got, t)
    with pytest.raises(InvalidArgumentError, match="positions"):
        compact_write(xs.to(DEVICE), slots.to(DEVICE), got, t, (positions - 2**31).to(DEVICE))


def test_write_kernel_bad_input():
    tabs = tables_for(KV[0, 0], "k", 4)
    t = compact_write_tables(tabs, DEVICE)
    x = KV[0, 0, :4].to(DEVICE)
    pages = pool(2, 3, 16, 4, 64)
    ok = torch.arange(4, device=DEVICE)
    with pytest.raises(InvalidArgumentError, match="beyond the pool"):
        compact_write(x, ok + 30, pages, t)
    with pytest.raises(InvalidArgumentError, match="slot_mapping"):
        compact_write(x, ok[:3], pages, t)
    with pytest.raises(InvalidArgumentError, match="pages must be"):
        compact_write(x, ok, pool(2, 3, 16, 3, 64), t)
    with pytest.raises(InvalidArgumentError, match="mult"):
        compact_write(x, ok, pages, {**t, "mult": t["mult"].int()})
    with pytest.raises(InvalidArgumentError, match="bits"):
        compact_write(x, ok, pages, {**t, "bits": 6})
    with pytest.raises(InvalidArgumentError, match="head_dim"):
        compact_write(x[:, :, :48], ok, pages, t)
    # (from a review) a pool whose blocks or heads share memory: the tokens overwrote each other
    for aliased in (pool(1, 3, 16, 4, 64).expand(4, -1, -1, -1), pool(2, 1, 16, 4, 64).expand(-1, 3, -1, -1)):
        with pytest.raises(InvalidArgumentError, match="share memory"):
            compact_write(x, ok, aliased, t)
    for tables in (None, [t]):
        with pytest.raises(InvalidArgumentError, match="tables"):
            compact_write(x, ok, pages, tables)


def test_write_kernel_refuses_strided_slots_and_positions():
    """The kernel reads token t's slot and position at ptr + t: a strided slot_mapping (whose values
    check_slots passed while the kernel wrote to the slots in between: out of the pool in general)
    or strided positions are refused before anything is written."""
    tabs = tables_for(KV[0, 0], "k", 4)
    t = compact_write_tables(tabs, DEVICE)
    x = KV[0, 0, :4].to(DEVICE)
    pages = pool(2, 3, 16, 4, 64)
    before = pages.clone()
    # values [0, 1, 2, 3]; the memory between holds other in-pool slots (so the old code wrote there)
    slots = torch.tensor([0, 5, 1, 6, 2, 7, 3, 8], device=DEVICE)[::2]
    assert slots.tolist() == [0, 1, 2, 3] and not slots.is_contiguous()
    with pytest.raises(InvalidArgumentError, match="slot_mapping must be contiguous"):
        compact_write(x, slots, pages, t)
    assert torch.equal(pages, before)
    rt, xb = rope_tables(KV[0, 1], 4)
    positions = torch.tensor([0, 9, 1, 9, 2, 9, 3, 9], device=DEVICE)[::2]
    with pytest.raises(InvalidArgumentError, match="positions must be contiguous"):
        compact_write(xb[:4].to(DEVICE), slots.contiguous(), pages, compact_write_tables(rt, DEVICE), positions)
    assert torch.equal(pages, before)


# -- attention -----------------------------------------------------------------------------------------


def make_case(*, lens, group, kb, vb, S, W, block_size=32, seed=0, rope=False):
    """A paged compact cache of real KV tokens (drawn from the fixture's 3 layers x 64 tokens);
    side tokens and q random. ``rope``: K tables with rotary offsets, keys written at their positions."""
    h, d = 3, 64
    ktab = rope_tables(KV[0, 1], kb, seed)[0] if rope else tables_for(KV[0, 1], "k", kb, seed)
    vtab = tables_for(KV[1, 1], "v", vb, seed)
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    per = max(-(-L // block_size) for L in lens)
    nb = B * per + 2
    bt = torch.randperm(nb, generator=g)[: B * per].view(B, per).to(torch.int32)
    kall, vall = KV[0].reshape(-1, h, d), KV[1].reshape(-1, h, d)
    idx, slots, positions = [], [], []
    for b, L in enumerate(lens):
        for p in range(S, max(S, L - W)):  # the positions the pages hold
            idx.append(int(torch.randint(0, kall.shape[0], (1,), generator=g)))
            slots.append(int(bt[b, p // block_size]) * block_size + p % block_size)
            positions.append(p)
    # Pages written by the reference writer (the write kernel has its own tests; in the interpreter
    # it would dominate this test's time).
    kp, vp = pool(nb, h, block_size, kb, d).cpu(), pool(nb, h, block_size, vb, d).cpu()
    slots_t = torch.tensor(slots, dtype=torch.int64)
    compact_write_ref(kall[idx], slots_t, kp, ktab, torch.tensor(positions, dtype=torch.int64))
    compact_write_ref(vall[idx], slots_t, vp, vtab)
    kp, vp = kp.to(DEVICE), vp.to(DEVICE)
    ks = vs = None
    if S + W:
        ks = (torch.randn(B, S + W, h, d, generator=g) * 2).to(torch.bfloat16).to(DEVICE)
        vs = torch.randn(B, S + W, h, d, generator=g).to(torch.bfloat16).to(DEVICE)
    q = torch.randn(B, h * group, d, generator=g).to(torch.bfloat16).to(DEVICE)
    ct = compact_tables(ktab, vtab, DEVICE)
    qt, bias = transform_query(q, ct["k_inv_transform"], ct["k_mean"], h)
    assert rope == ("rope_phase" in ct)
    rc = rope_logit_coef(q, ct["k_rope_m"], h) if rope else None
    # the pages' cos and sin (KernelConfig.gluon_rope_pos), exactly as many rows as the pages need
    pos_table = rope_page_table(ct["rope_phase"], max(lens) - W) if rope else None
    return dict(q=q, kp=kp, vp=vp, bt=bt.to(DEVICE), lens=lens, S=S, W=W, bs=block_size, kb=kb, vb=vb,
                ks=ks, vs=vs, ct=ct, qt=qt, bias=bias, ktab=ktab, vtab=vtab, rope_coef=rc,
                rope_phase=ct.get("rope_phase"), rope_pairs=ct.get("rope_pairs"), rope_pos_table=pos_table)


def run(c, cuda_dot, split_tokens=64, block_n=32, config=None):
    B, Hq, D = c["q"].shape
    ct = c["ct"]
    attn = PagedDecodeAttention(Hq, 3, D, page_type="compact", block_size=c["bs"], sink_tokens=c["S"],
                                window=c["W"], device=DEVICE, k_bits=c["kb"], v_bits=c["vb"],
                                config=config or KernelConfig(block_n=block_n, cuda_dot=cuda_dot))
    attn.plan(c["lens"], c["bt"], split_tokens=split_tokens)
    return attn.run(c["q"], c["kp"], c["vp"], k_side=c["ks"], v_side=c["vs"], q_transformed=c["qt"],
                    logit_bias=c["bias"], v_inv_transform=ct["v_inv_transform"], v_mean=ct["v_mean"],
                    k_codebook=ct["k_codebook"], v_codebook=ct["v_codebook"], k_grid=ct["k_grid"],
                    v_grid=ct["v_grid"], rope_coef=c["rope_coef"], rope_phase=c["rope_phase"],
                    rope_pairs=c["rope_pairs"], rope_pos_table=c["rope_pos_table"],
                    out=torch.empty(B, Hq, D, device=DEVICE))


def reference(c):
    ct = c["ct"]
    return paged_decode_ref(c["q"], c["kp"], c["vp"], c["bt"], c["lens"], page_type="compact", block_size=c["bs"],
                            sink_tokens=c["S"], window=c["W"], k_side=c["ks"], v_side=c["vs"],
                            q_transformed=c["qt"], logit_bias=c["bias"], v_inv_transform=ct["v_inv_transform"],
                            v_mean=ct["v_mean"], k_bits=c["kb"], v_bits=c["vb"], k_codebook=ct["k_codebook"],
                            v_codebook=ct["v_codebook"], k_grid=ct["k_grid"], v_grid=ct["v_grid"],
                            rope_coef=c["rope_coef"], rope_phase=c["rope_phase"])


def true_attention(c):
    """Attention over the reference-decoded cache in the model's basis: codec.inverse of
    codec.decode_page of every page, plain softmax with the side tokens (fp64): independent of the
    kernel's transformed-domain algebra and of paged_decode_ref."""
    q, S, W, bs = c["q"], c["S"], c["W"], c["bs"]
    B, Hq, D = q.shape
    G = Hq // 3
    out = torch.zeros(B, Hq, D, dtype=torch.float64)
    vmax = 0.0
    for b, L in enumerate(c["lens"]):
        pos = list(range(S, max(S, L - W)))
        sl = list(range(min(S, L))) + [S + p % W for p in range(max(S, L - W), L)] if W else list(range(min(S, L)))
        for h in range(3):
            def dec(pages, tab):
                rows = []
                for p in pos:
                    page = pages[int(c["bt"][b, p // bs]), h, (p % bs) // 16].cpu()
                    rows.append(codec.decode_page(page, tab[h])[p % 16])
                y = torch.stack(rows) if rows else torch.zeros(0, D)
                return codec.inverse(y.unsqueeze(1), [tab[h]], torch.tensor(pos, dtype=torch.int64))[:, 0].double()
            kt, vt = dec(c["kp"], c["ktab"]), dec(c["vp"], c["vtab"])
            if sl:
                kt = torch.cat([kt, c["ks"][b, sl, h].double().cpu()])
                vt = torch.cat([vt, c["vs"][b, sl, h].double().cpu()])
            vmax = max(vmax, vt.abs().max().item())
            for gi in range(G):
                w = torch.softmax(kt @ q[b, h * G + gi].double().cpu() * D**-0.5, 0)
                out[b, h * G + gi] = w @ vt
    return out, vmax


CASES = {
    # id: (lens, group, k bits, v bits, sinks, window)
    "q4-gqa4-sinks-window": ([70, 130, 5], 4, 4, 4, 4, 8),
    "k4v3-gqa2-no-side": ([45, 100], 2, 4, 3, 0, 0),
    "k3v3-mha-window": ([33, 97, 20], 1, 3, 3, 0, 16),
    "k5v2-gqa8-sinks": ([64, 81], 8, 5, 2, 2, 0),
}


@pytest.mark.parametrize("cuda_dot", [False, True], ids=["tensor-cores", "cuda-cores"])
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_attention_matches_reference(case, cuda_dot):
    lens, group, kb, vb, S, W = CASES[case]
    c = make_case(lens=lens, group=group, kb=kb, vb=vb, S=S, W=W, seed=len(case))
    out = run(c, cuda_dot).double().cpu()
    ref = reference(c).cpu()
    true, vmax = true_attention(c)
    # The reference's algebra (q', bias, A_v, mean; fp32 tables) equals attention over the decoded cache.
    assert (ref - true).abs().max().item() <= 1e-4 * vmax
    tol = (2.0**-8 if S + W else 2.0**-16) if cuda_dot else 2.0**-6
    err = (out - ref).abs().max().item()
    assert err <= tol * vmax, f"max error {err:.3g} > {tol:.3g} * max|v| {vmax:.3g}"


@pytest.mark.parametrize("case", ["q4-gqa4-sinks-window", "k3v3-mha-window"])
def test_attention_with_rotary_offsets_matches_reference(case):
    lens, group, kb, vb, S, W = CASES[case]
    c = make_case(lens=lens, group=group, kb=kb, vb=vb, S=S, W=W, seed=len(case), rope=True)
    out = run(c, False).double().cpu()
    ref = reference(c).cpu()
    true, vmax = true_attention(c)  # codec.inverse at each key's position: the rotary offset added back
    assert (ref - true).abs().max().item() <= 1e-4 * vmax
    err = (out - ref).abs().max().item()
    assert err <= 2.0**-6 * vmax, f"max error {err:.3g} > {2.0**-6:.3g} * max|v| {vmax:.3g}"
    # without the rotary term the output is wrong: the test can fail
    c2 = dict(c, rope_coef=None, rope_phase=None)
    assert (reference(c2).cpu() - true).abs().max().item() > 10 * 2.0**-6 * vmax


@pytest.mark.skipif(DEVICE != "cuda", reason="the Gluon kernel is compiled only (no interpreter)")
@pytest.mark.parametrize("stages", [0, 2])
@pytest.mark.parametrize("case", ["q4-gqa4-sinks-window", "k3v3-mha-window"])
def test_gluon_rotary_offsets_match_reference_gpu(case, stages):
    """The Gluon kernel's rotary-offset term (``KernelConfig.gluon_rope``) against the reference, as
    the Triton kernel's is above (pages loaded into registers or staged in shared memory)."""
    lens, group, kb, vb, S, W = CASES[case]
    c = make_case(lens=lens, group=group, kb=kb, vb=vb, S=S, W=W, seed=len(case), rope=True)
    cfg = KernelConfig(gluon=True, gluon_rope=True, gluon_min_work=0, gluon_rope_min_work=0, gluon_stages=stages)
    out = run(c, False, config=cfg).double().cpu()
    _, vmax = true_attention(c)
    err = (out - reference(c).cpu()).abs().max().item()
    assert err <= 2.0**-6 * vmax, f"max error {err:.3g} > {2.0**-6:.3g} * max|v| {vmax:.3g}"
    # the coefficients made before the page loop (``gluon_rope_hoist``, staged pages: here the default,
    # 2 chunks) or in it (1: the term has more chunks): the same products, so the same output bit for bit
    for hoist in (0, 1):
        other = run(c, False, config=dataclasses.replace(cfg, gluon_rope_hoist=hoist)).double().cpu()
        assert torch.equal(other, out), f"gluon_rope_hoist={hoist} differs from {cfg.gluon_rope_hoist}"
    # the term from tables (``gluon_rope_table``, the angle sum): another rounding of the same sum,
    # within the same tolerance of the reference and close to the direct form
    table = run(c, False, config=dataclasses.replace(cfg, gluon_rope_table=not cfg.gluon_rope_table)).double().cpu()
    err_t = (table - reference(c).cpu()).abs().max().item()
    assert err_t <= 2.0**-6 * vmax, f"table form: max error {err_t:.3g} > {2.0**-6:.3g} * max|v| {vmax:.3g}"
    assert (table - out).abs().max().item() <= 2.0**-10 * vmax
    # ... with each page's cos and sin computed once a warp into its slot (``gluon_rope_lanes``): the
    # same phases and SFU results as the table form's, so its output bit for bit (unstaged: the same kernel)
    lanes = run(c, False, config=dataclasses.replace(cfg, gluon_rope_table=True, gluon_rope_lanes=True))
    assert torch.equal(lanes.double().cpu(), table), "gluon_rope_lanes differs from the table form"
    # ... with its cosine and sine products in two chains (``gluon_rope_chains``): another rounding of
    # the same sum, close to the table form's
    chains = run(c, False, config=dataclasses.replace(cfg, gluon_rope_table=True, gluon_rope_chains=2))
    err_c = (chains.double().cpu() - reference(c).cpu()).abs().max().item()
    assert err_c <= 2.0**-6 * vmax, f"two chains: max error {err_c:.3g} > {2.0**-6:.3g} * max|v| {vmax:.3g}"
    assert (chains.double().cpu() - table).abs().max().item() <= 2.0**-10 * vmax
    # ... with the padding columns' records not loaded (``gluon_rope_skip_pad``): their P and Q are 0
    # either way, so the table form's output bit for bit
    skip = run(c, False, config=dataclasses.replace(cfg, gluon_rope_table=True, gluon_rope_skip_pad=True))
    assert torch.equal(skip.double().cpu(), table), "gluon_rope_skip_pad differs from the table form"
    # ... and V padded (``gluon_rope_v_pad``, the compact default's rotary launch): the same words
    vpad = run(c, False, config=dataclasses.replace(cfg, gluon_rope_table=True, gluon_rope_skip_pad=True,
                                                    gluon_rope_v_pad=True))
    assert torch.equal(vpad.double().cpu(), table), "gluon_rope_v_pad differs from the table form"
    # ... with Q in the padding columns (``gluon_rope_fold``, groups up to 4): the same two chains'
    # sums, so the same output as two chains bit for bit
    fold = run(c, False, config=dataclasses.replace(cfg, gluon_rope_table=True, gluon_rope_fold=True))
    assert torch.equal(fold, chains), "gluon_rope_fold differs from gluon_rope_chains=2"
    if stages:  # ... and with the page's cos and sin from the warp's lanes
        lf = run(c, False, config=dataclasses.replace(cfg, gluon_rope_table=True, gluon_rope_fold=True,
                                                      gluon_rope_lanes=True))
        assert torch.equal(lf, chains), "gluon_rope_fold with gluon_rope_lanes differs from gluon_rope_chains=2"
    # ... with the pages' cos and sin copied into their slots (``gluon_rope_pos``; staged only: on the
    # register path the same kernel as the table form, bit for bit): the phases' cos and sin from the
    # exact phase in float64, not the SFU's, so close to the table form, not equal
    pos = run(c, False, config=dataclasses.replace(cfg, gluon_rope_table=True, gluon_rope_pos=True)).double().cpu()
    if stages == 0:
        assert torch.equal(pos, table)
    else:
        err_p = (pos - reference(c).cpu()).abs().max().item()
        assert err_p <= 2.0**-6 * vmax, f"pos form: max error {err_p:.3g} > {2.0**-6:.3g} * max|v| {vmax:.3g}"
        assert (pos - table).abs().max().item() <= 2.0**-10 * vmax
        # the table is read: a table of another model's phases moves the output past the tolerance
        wrong = dict(c, rope_pos_table=rope_page_table(c["rope_phase"] // 3, max(c["lens"]) - c["W"]))
        bad = run(wrong, False, config=dataclasses.replace(cfg, gluon_rope_table=True, gluon_rope_pos=True))
        assert (bad.double().cpu() - reference(c).cpu()).abs().max().item() > 2.0**-6 * vmax


@pytest.mark.parametrize("what", ["gluon", "small-step", "5-bit", "rope-off", "rope-on", "rope-on-hoist-1", "rope-small-step",
                                  "wide-group", "rope-group-16", "config-off", "smem-fits", "smem-over", "rope-table",
                                  "rope-table-smem-fits", "rope-table-smem-over", "rope-table-pos",
                                  "rope-table-pos-smem-fits", "rope-table-pos-smem-over", "rope-table-pos-unstaged",
                                  "rope-table-pos-no-table", "rope-table-lanes", "rope-table-lanes-smem-over",
                                  "rope-table-lanes-unstaged", "rope-table-lanes-pos", "rope-table-chains2",
                                  "rope-on-chains2", "rope-table-fold", "rope-on-fold",
                                  "rope-table-skip", "rope-table-fold-skip", "rope-table-vpad", "gluon-rope-vpad"])
def test_gluon_kernel_is_chosen_where_it_applies(what, monkeypatch, launch_recorder):
    """PagedDecodeAttention runs the Gluon kernel for widths 2-4, without rotary offsets unless
    ``gluon_rope`` (and then for GQA groups up to 8), where the accumulator fits (head_dim x padded
    group <= GLUON_MAX_ACC) and the step is large enough (``gluon_min_work``; with the rotary term
    ``gluon_rope_min_work``) and the config's shared memory fits ``GLUON_MAX_SMEM``, on a GPU; the
    Triton kernel otherwise; with ``gluon_rope_table`` the rotary term's tables count in the shared
    memory (all head_dim / 32 chunks a head could list) and lie between the grids and the staging
    slots; with ``gluon_rope_pos`` too, staged and given ``rope_pos_table``, the slots hold the pages'
    cos and sin (as many chunks) and the kernel copies them; with ``gluon_rope_lanes`` instead (staged;
    ``gluon_rope_pos`` takes precedence where both apply) the slots hold the same room and the warp
    writes it; ``gluon_rope_chains``, ``gluon_rope_fold`` and ``gluon_rope_skip_pad`` reach the kernel with
    the tables only (the fold for groups up to 4, taking precedence over the skip); ``gluon_rope_v_pad``
    pads V (and its slots) with the rotary term only. (Both kernels replaced by recorders; the GPU is
    simulated by turning the interpreter flag off.)"""
    from weightszip.kernels import paged_decode as pd
    from weightszip.kernels import paged_decode_gluon as pg

    tri, glu = launch_recorder(), launch_recorder()
    monkeypatch.setattr(pd, "_interpreting", lambda: False)
    monkeypatch.setattr(pd, "_paged_split_kernel", tri)
    monkeypatch.setattr(pg, "compact_split_kernel", glu)
    kb, rope = (5 if what == "5-bit" else 4), what.startswith("rope")
    group = {"wide-group": 32, "rope-group-16": 16}.get(what, 2)  # head_dim 64: 16 fits GLUON_MAX_ACC
    c = make_case(lens=[200, 90], group=group, kb=kb, vb=3, S=0, W=0, rope=rope)
    table = what.startswith("rope-table")
    pos = what.startswith("rope-table-pos") or what == "rope-table-lanes-pos"
    lanes = what.startswith("rope-table-lanes")
    if what.endswith("no-table"):
        c = dict(c, rope_pos_table=None)
    cfg = KernelConfig(gluon=what != "config-off",
                       gluon_rope=what in ("rope-on", "rope-on-hoist-1", "rope-small-step", "rope-group-16",
                                           "rope-on-chains2", "rope-on-fold") or table,
                       gluon_rope_chains=2 if what.endswith("chains2") else 1, gluon_rope_fold="fold" in what,
                       gluon_rope_skip_pad=what.endswith("skip"), gluon_rope_v_pad=what.endswith("vpad"),
                       gluon_min_work=10**9 if what == "small-step" else 0,
                       gluon_rope_min_work=10**9 if what == "rope-small-step" else 0,
                       gluon_rope_hoist=1 if what == "rope-on-hoist-1" else KernelConfig.gluon_rope_hoist,
                       gluon_rope_table=table, gluon_rope_pos=pos, gluon_rope_lanes=lanes,
                       gluon_stages=0 if what.endswith("unstaged") else KernelConfig.gluon_stages)
    if "smem" in what:  # the config's shared memory against the cap: exactly at it, one byte over
        need = pd._compact_gluon_smem(kb, 3, c["q"].shape[-1], cfg, rope, group, pos or lanes)
        assert need > 0
        if table:  # the tables of all 2 chunks a head_dim-64 head could list, at the padded group of 8
            plain = dataclasses.replace(cfg, gluon_rope_table=False)
            slots = cfg.gluon_rope_warps * cfg.gluon_stages  # (with pos each holds 2 chunks of cos and sin)
            assert need - pd._compact_gluon_smem(kb, 3, c["q"].shape[-1], plain, True, group) == (
                4 * 2 * (512 + 64 * 8) + (pos or lanes) * slots * 2 * 128)
        monkeypatch.setattr(pd, "GLUON_MAX_SMEM", need - what.endswith("smem-over"))
    run(c, False, config=cfg)
    want_gluon = what in ("gluon", "rope-on", "rope-on-hoist-1", "smem-fits", "rope-table", "rope-table-smem-fits",
                          "rope-table-pos", "rope-table-pos-smem-fits", "rope-table-pos-unstaged",
                          "rope-table-pos-no-table", "rope-table-lanes", "rope-table-lanes-unstaged",
                          "rope-table-lanes-pos", "rope-table-chains2", "rope-on-chains2", "rope-table-fold",
                          "rope-on-fold", "rope-table-skip", "rope-table-fold-skip", "rope-table-vpad",
                          "gluon-rope-vpad")
    assert (len(glu.calls), len(tri.calls)) == ((1, 0) if want_gluon else (0, 1))
    if want_gluon:
        assert glu.calls[0]["ROPE_CHUNKS"] == (-(-c["rope_pairs"].numel() // 16) if rope else 0)
        assert glu.calls[0]["num_warps"] == (cfg.gluon_rope_warps if rope else cfg.gluon_warps)
        assert ("maxnreg" in glu.calls[0]) == (not rope)
        assert glu.calls[0]["STAGES"] == cfg.gluon_stages
        # the rotary term's coefficients hoisted whole (its 2 chunks here) or, past gluon_rope_hoist, not at all
        assert glu.calls[0]["ROPE_HOIST"] == (what in ("rope-on", "rope-on-chains2", "rope-on-fold"))
        assert glu.calls[0]["ROPE_CHAINS"] == (2 if what == "rope-table-chains2" else 1)
        assert glu.calls[0]["ROPE_FOLD"] == (what in ("rope-table-fold", "rope-table-fold-skip"))
        assert glu.calls[0]["ROPE_SKIP"] == (what == "rope-table-skip")  # (not with the fold)
        assert glu.calls[0]["ROPE_TABLE"] == table
        assert glu.calls[0]["V_PAD"] == (what == "rope-table-vpad")  # (with the rotary term only)
        pos_on = what in ("rope-table-pos", "rope-table-pos-smem-fits", "rope-table-lanes-pos")
        lanes_on = what == "rope-table-lanes"
        assert glu.calls[0]["ROPE_POS"] == pos_on
        assert glu.calls[0]["ROPE_LANES"] == lanes_on
        chunks = glu.calls[0]["ROPE_CHUNKS"]
        rope_words = pg.rope_table_words(chunks, 8) if table else 0
        assert (glu.calls[0]["TAB_OFF"], glu.calls[0]["STAGE_OFF"]) == pg.smem_offsets(
            kb, 3, c["q"].shape[-1], glu.calls[0]["num_warps"], cfg.gluon_stages, False, glu.calls[0]["V_PAD"],
            rope_words,
            chunks if pos_on or lanes_on else 0)[:2]
        # the table and its rows (the kernel clamps to the last row: it must cover the pages)
        args = glu.calls[0]["args"]
        if pos_on:
            i = next(i for i, a in enumerate(args) if a is c["rope_pos_table"])
            assert args[i + 1] == c["rope_pos_table"].shape[0]  # n_pos_rows


@pytest.mark.parametrize("bad", [dict(gluon_stages=3), dict(gluon_stages=8), dict(gluon_warps=6), dict(gluon_rope_warps=32),
                                 dict(block_n=24), dict(num_warps=0), dict(gluon_ahead=4), dict(gluon_maxnreg=8),
                                 dict(gluon_min_work=-1), dict(gluon_rope_hoist=5), dict(gluon_rope_hoist=-1),
                                 dict(gluon_rope_chains=0), dict(gluon_rope_chains=3), dict(rope_waves=-1),
                                 dict(waves=0)])
def test_kernel_config_refuses_what_would_not_compile(bad):
    """A KernelConfig outside what was built and measured (staging of 2 or 4 slots per warp: 8 slots of
    q4 at 16 warps overflow shared memory, other counts were never run on a GPU), that Triton could
    not compile or that would launch the wrong kernel is refused with a typed error naming the field,
    not at the first launch."""
    from weightszip.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError, match=next(iter(bad))):
        KernelConfig(**bad)
    KernelConfig(**{k: {"gluon_stages": 4, "gluon_warps": 16, "gluon_rope_warps": 8, "block_n": 32, "num_warps": 8,
                        "gluon_ahead": 3, "gluon_maxnreg": 0, "gluon_min_work": 0, "gluon_rope_hoist": 4,
                        "gluon_rope_chains": 2, "rope_waves": 0, "waves": 1}[k]
                    for k in bad})  # a valid value


def test_rotary_term_over_listed_pairs_only():
    """compact_tables lists the pairs with an offset; the kernel computes those only. With the other
    pairs' coefficients zero the output is the reference's (all pairs); leaving out a listed pair
    changes it beyond the tolerance (the list is used)."""
    lens, group, kb, vb, S, W = CASES["q4-gqa4-sinks-window"]
    c = make_case(lens=lens, group=group, kb=kb, vb=vb, S=S, W=W, seed=5, rope=True)
    half = c["q"].shape[-1] // 2
    listed = c["rope_pairs"].cpu()
    assert 16 < listed.numel() < half  # real K: most pairs carry an offset, a few none in any head
    keep = listed[torch.randperm(listed.numel(), generator=torch.Generator().manual_seed(1))[:20]].contiguous()
    rc = c["rope_coef"].clone()
    dropped = torch.ones(half, dtype=torch.bool)
    dropped[keep.long()] = False
    rc[..., dropped.to(rc.device)] = 0.0  # A and B of the unlisted pairs
    c2 = dict(c, rope_coef=rc, rope_pairs=keep.to(DEVICE))  # 20 pairs: two chunks, the second partial
    ref = reference(c2).cpu()
    _, vmax = true_attention(c)
    err = (run(c2, False).double().cpu() - ref).abs().max().item()
    assert err <= 2.0**-6 * vmax, err
    c3 = dict(c2, rope_pairs=keep[1:].to(DEVICE))  # pair 1 left out while its coefficients are not 0
    assert (run(c3, False).double().cpu() - ref).abs().max().item() > 4 * 2.0**-6 * vmax
    # compact_tables: pairs without an offset in any head are not listed
    tabs = [dataclasses.replace(t, rope_m=t.rope_m.clone()) for t in c["ktab"]]
    for t in tabs:
        t.rope_m[[0, 7, half, half + 7]] = 0  # pair 0: both halves 0; pair 7: both halves 0
        t.rope_m[half + 9] = 0  # pair 9: one half only, still listed
    pairs = compact_tables(tabs, c["vtab"], "cpu")["rope_pairs"].tolist()
    assert {0, 7, 9} <= set(listed.tolist())
    assert 0 not in pairs and 7 not in pairs and 9 in pairs and len(pairs) == listed.numel() - 2


def test_rope_page_table_holds_each_pages_phase():
    """``rope_page_table``'s row r: cos and sin of each pair's phase at position 16 r, from the exact
    48-bit phase (here in Python integers) in float64, rounded to fp32; the codec's integer cos and
    sin of the same positions (which turn the keys' offsets: ``codec.rope_cos_sin``) agree within
    their tables' resolution, so the table is the rotation the pages were written with."""
    inv = 5e5 ** (-torch.arange(0, 128, 2, dtype=torch.float64) / 128)  # Llama-3's RoPE base
    phase = C.rope_phase_steps(inv)
    t = rope_page_table(phase, 131072 + 5)
    assert t.shape == (8193, 64, 2) and t.dtype == torch.float32 and t.is_contiguous()
    rows = [0, 1, 2, 777, 8191, 8192]
    for r in rows:
        for i in (0, 1, 17, 40, 63):
            a = 2 * math.pi * ((16 * r * int(phase[i])) % 2**48) / 2**48
            assert abs(t[r, i, 0].item() - math.cos(a)) <= 1e-7 and abs(t[r, i, 1].item() - math.sin(a)) <= 1e-7
    cos, sin = codec.rope_cos_sin(torch.tensor(rows) * 16, phase)
    assert (t[rows, :, 0].double() - cos.double() * 2.0**-30).abs().max().item() < 2.0**-18
    assert (t[rows, :, 1].double() - sin.double() * 2.0**-30).abs().max().item() < 2.0**-18
    assert rope_page_table(phase, 16).shape[0] == 1 and rope_page_table(phase, 17).shape[0] == 2
    for bad_phase, tokens in ((phase.int(), 16), (phase[:0], 16), (phase, 0), (phase, 2**31), (phase, 1.5)):
        with pytest.raises(InvalidArgumentError):
            rope_page_table(bad_phase, tokens)


def test_rope_pos_table_checked_at_run():
    """``run``'s ``rope_pos_table`` must be fp32 [rows, head_dim / 2, 2] on the phase's device with
    rows for every planned page (the kernel clamps to its last row, so a short table would give
    wrong logits, not an error), and only comes with the rotary term."""
    c = make_case(lens=[70, 130], group=2, kb=4, vb=4, S=0, W=0, seed=3, rope=True)
    tab = c["rope_pos_table"]
    assert tab.shape[0] == -(-130 // 16)
    for bad, match in ((tab[:-1], "rows"), (tab.double(), "fp32"), (tab[:, :16], "fp32"),
                       (tab.transpose(1, 2).contiguous().transpose(1, 2), "contiguous"),
                       (torch.zeros(tab.numel() + 1, device=tab.device)[1:].view(tab.shape), "aligned")):
        with pytest.raises(InvalidArgumentError, match=match):
            run(dict(c, rope_pos_table=bad), False)
    plain = make_case(lens=[70, 130], group=2, kb=4, vb=4, S=0, W=0, seed=3)
    with pytest.raises(InvalidArgumentError, match="rope_pos_table need"):
        run(dict(plain, rope_pos_table=tab), False)


def test_split_schedule_does_not_matter():
    c = make_case(lens=[150, 40], group=4, kb=3, vb=4, S=0, W=0, seed=9)
    one = run(c, True, split_tokens=4096, block_n=64)
    many = run(c, True, split_tokens=32, block_n=16)
    _, vmax = true_attention(c)
    assert (one - many).abs().max().item() <= 2.0**-16 * vmax


def test_compact_bad_input():
    c = make_case(lens=[20, 40], group=2, kb=4, vb=3, S=0, W=0)
    with pytest.raises(InvalidArgumentError, match="k_bits"):
        PagedDecodeAttention(6, 3, 64, page_type="compact", device=DEVICE, k_bits=4, v_bits=6)
    with pytest.raises(InvalidArgumentError, match="are for page_type"):
        PagedDecodeAttention(6, 3, 64, page_type="bf16", device=DEVICE, k_bits=4)
    attn = PagedDecodeAttention(6, 3, 64, page_type="compact", device=DEVICE, k_bits=4, v_bits=3, block_size=32)
    attn.plan(c["lens"], c["bt"])
    ct = c["ct"]
    tabs = dict(k_codebook=ct["k_codebook"], v_codebook=ct["v_codebook"], k_grid=ct["k_grid"], v_grid=ct["v_grid"])
    with pytest.raises(InvalidArgumentError, match="v_pages"):
        attn.run(c["q"], c["kp"], c["kp"], **tabs)
    with pytest.raises(InvalidArgumentError, match="k_codebook"):
        attn.run(c["q"], c["kp"], c["vp"], **{**tabs, "k_codebook": ct["v_codebook"]})
    with pytest.raises(InvalidArgumentError, match="v_grid"):
        attn.run(c["q"], c["kp"], c["vp"], **{**tabs, "v_grid": None})
    with pytest.raises(InvalidArgumentError, match="not a 4-bit page"):
        dequantize_compact_pages(c["kp"][:, :, :, :-3], 4, ct["k_codebook"], ct["k_grid"])


# -- real shapes, GPU only -----------------------------------------------------------------------------


def _real_rope_m(Hkv, D, pairs, g):
    """Rotary offsets (``HeadTables.rope_m``, int64 [Hkv, D] in units of 2**-16) in ``pairs`` of the
    D / 2 RoPE pairs drawn at random (both channels of a pair, every head; 0 in the others, as
    calibration leaves them), a few key units each, and Llama-3's phase steps (base 500000)."""
    inv = 5e5 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    listed = torch.randperm(D // 2, generator=g)[:pairs]
    m = torch.zeros(Hkv, D, dtype=torch.float64)
    for c in (listed, listed + D // 2):
        m[:, c] = 3 * torch.randn(Hkv, pairs, generator=g, dtype=torch.float64)
    return torch.round(m * 2.0**codec.FIXED_SHIFT).to(torch.int64), C.rope_phase_steps(inv)


def _real_shape_case(shape, k_bits, v_bits, rope_pairs=0):
    """Llama shapes, head_dim 128, tables fitted on synthetic heavy-tailed KV; pages written by the
    write kernel (bytes checked against the reference on a slice); the reference's output and the
    tolerance scale. Returns (run, ref, vmax): ``run(config)`` the kernel's output. ``rope_pairs``:
    K tables with rotary offsets in that many pairs (``_real_rope_m``), keys written at their
    positions, the rotary term in the kernel and the reference."""
    Hq, Hkv, D = shape
    g = torch.Generator().manual_seed(1)
    calib = torch.randn(512, Hkv, D, generator=g) * (1 + 4 * torch.rand(D, generator=g)) + torch.randn(D, generator=g)
    rng = np.random.default_rng(0)
    signs = torch.from_numpy(rng.choice([-1, 1], size=D)).to(torch.int64)
    rope = dict(zip(("rope_m", "rope_phase"), _real_rope_m(Hkv, D, rope_pairs, g))) if rope_pairs else {}
    tabs = {}
    rotated = {"k": bool(rope), "v": False}  # (the rotary offsets are K's)
    for kind, bits in (("k", k_bits), ("v", v_bits)):
        kr = dict(rope, positions=torch.arange(calib.shape[0])) if rotated[kind] else {}
        mu, mult, e0, cbs = C.fit_tables(calib, torch.ones(Hkv, D), kind, signs, rng, **kr)
        tabs[kind] = [codec.HeadTables(mu[i], mult[i], signs, int(e0[i]), cbs[bits], bits,
                                       **({"rope_m": rope["rope_m"][i], "rope_phase": rope["rope_phase"]}
                                          if rotated[kind] else {}))
                      for i in range(Hkv)]
    lens, S, W = [3000, 1, 777, 4100], 4, 128
    per = max(-(-L // 16) for L in lens)
    nb = len(lens) * per + 4
    bt = torch.randperm(nb, generator=g)[: len(lens) * per].view(len(lens), per).to(torch.int32)
    slots = torch.cat([bt[b, torch.arange(L) // 16].long() * 16 + torch.arange(L) % 16 for b, L in enumerate(lens)])
    n = slots.numel()
    positions = torch.cat([torch.arange(L) for L in lens])
    x = {k: (torch.randn(n, Hkv, D, generator=g) * (1 + 4 * torch.rand(D, generator=g))).to(torch.bfloat16) for k in "kv"}
    pages = {}
    for kind, bits in (("k", k_bits), ("v", v_bits)):
        pos = positions if rotated[kind] else None
        pages[kind] = pool(nb, Hkv, 16, bits, D)
        compact_write(x[kind].cuda(), slots.cuda(), pages[kind], compact_write_tables(tabs[kind], "cuda"),
                      None if pos is None else pos.cuda())
        want = pool(nb, Hkv, 16, bits, D).cpu()
        compact_write_ref(x[kind][:256], slots[:256], want, tabs[kind], None if pos is None else pos[:256])
        blocks = bt[0, :16].long()
        assert torch.equal(pages[kind].cpu()[blocks], want[blocks])
    ct = compact_tables(tabs["k"], tabs["v"], "cuda")
    q = torch.randn(len(lens), Hq, D, generator=g).to(torch.bfloat16).cuda()
    qt, bias = transform_query(q, ct["k_inv_transform"], ct["k_mean"], Hkv)
    side = {k: torch.randn(len(lens), S + W, Hkv, D, generator=g).to(torch.bfloat16).cuda() for k in ("k_side", "v_side")}
    tables = dict(k_codebook=ct["k_codebook"], v_codebook=ct["v_codebook"], k_grid=ct["k_grid"], v_grid=ct["v_grid"])
    common = dict(q_transformed=qt, logit_bias=bias, v_inv_transform=ct["v_inv_transform"], v_mean=ct["v_mean"], **side)
    listed = {}
    if rope:
        assert ct["rope_pairs"].numel() == rope_pairs
        common.update(rope_coef=rope_logit_coef(q, ct["k_rope_m"], Hkv), rope_phase=ct["rope_phase"])
        listed = dict(rope_pairs=ct["rope_pairs"])

    def run(config):
        attn = PagedDecodeAttention(Hq, Hkv, D, page_type="compact", sink_tokens=S, window=W, k_bits=k_bits,
                                    v_bits=v_bits, config=config)
        attn.plan(lens, bt.cuda(), rope=bool(rope))  # (the split the default plans for such steps)
        return attn.run(q, pages["k"], pages["v"], out=torch.empty(len(lens), Hq, D, device="cuda"), **tables,
                        **common, **listed)

    ref = paged_decode_ref(q, pages["k"], pages["v"], bt.cuda(), lens, page_type="compact", sink_tokens=S, window=W,
                           k_bits=k_bits, v_bits=v_bits, **tables, **common)
    vals = codec.inverse(dequantize_compact_pages(pages["v"], v_bits, ct["v_codebook"], ct["v_grid"])
                         .permute(0, 2, 1, 3).cpu(), tabs["v"])
    vmax = max(vals.abs().max().item(), side["v_side"].float().abs().max().item())
    return run, ref, vmax


@pytest.mark.skipif(DEVICE != "cuda", reason="real shapes need the GPU")
@pytest.mark.parametrize("lookup", [(0, 4), (3, 3), (4, 4)],
                         ids=["k4v3-pair-tables", "k3v3-lut3-as-pairs", "k4v3-lut4-as-pairs"])
@pytest.mark.parametrize("cuda_dot", [False, True], ids=["tensor-cores", "cuda-cores"])
@pytest.mark.parametrize("shape", [(32, 8, 128), (8, 1, 128)], ids=["llama8b", "llama70b-tp8"])
def test_real_shapes_gpu(shape, cuda_dot, lookup):
    """Attention against the reference at the Llama shapes: K 4 / V 3 bits with the codebooks from
    pair tables, also when register tables are asked for (widths 4 and 3 are nibble and crumb rows,
    read as pairs), and K 3 / V 3 bits."""
    lut_bits, k_bits = lookup
    if cuda_dot and lookup != (0, 4):
        pytest.skip("the CUDA-core path has no codebook lookup choice")
    run, ref, vmax = _real_shape_case(shape, k_bits, 3)
    out = run(KernelConfig(block_n=32 if cuda_dot else 64, cuda_dot=cuda_dot, reg_lut_bits=lut_bits))
    tol = 2.0**-8 if cuda_dot else 2.0**-6
    assert (out.double() - ref).abs().max().item() <= tol * vmax


@pytest.mark.skipif(DEVICE != "cuda", reason="the Gluon kernel is compiled only (no interpreter)")
@pytest.mark.parametrize("bits", [(4, 4), (4, 3), (3, 3), (2, 3)], ids=["q4", "q3.5", "q3", "k2v3"])
@pytest.mark.parametrize("variant", [(8, 1, 128, 0), (4, 0, 0, 0), (2, 3, 0, 0), (8, 0, 128, 2), (16, 0, 128, 2),
                                     (4, 0, 128, 4)],
                         ids=["default", "w4", "w2-ahead3", "staged2", "w16-staged2", "w4-staged4"])
@pytest.mark.parametrize("shape", [(32, 8, 128), (8, 1, 128)], ids=["llama8b", "llama70b-tp8"])
def test_gluon_kernel_real_shapes_gpu(shape, variant, bits):
    """The Gluon split kernel against the reference within the tensor-core tolerance, and against the
    Triton kernel (the same bf16 operands; only the order of the fp32 sums differs)."""
    run, ref, vmax = _real_shape_case(shape, *bits)
    warps, ahead, maxnreg, stages = variant
    out = run(KernelConfig(gluon=True, gluon_min_work=0, gluon_warps=warps, gluon_ahead=ahead, gluon_maxnreg=maxnreg,
                           gluon_stages=stages))
    assert (out.double() - ref).abs().max().item() <= 2.0**-6 * vmax
    triton_out = run(KernelConfig(block_n=64, reg_lut_bits=0))
    assert (out.double() - triton_out.double()).abs().max().item() <= 2.0**-7 * vmax


@pytest.mark.skipif(DEVICE != "cuda", reason="the Gluon kernel is compiled only (no interpreter)")
@pytest.mark.parametrize("pairs", [24, 64])
@pytest.mark.parametrize("bits", [(4, 4), (4, 3)], ids=["q4", "q3.5"])
@pytest.mark.parametrize("shape", [(32, 8, 128), (8, 1, 128)], ids=["llama8b", "llama70b-tp8"])
def test_gluon_rotary_default_real_shapes_gpu(shape, bits, pairs):
    """The compact default with rotary offsets at the Llama shapes (head_dim 128: the tables, V padded
    at 4 bits (``gluon_rope_v_pad``), the fold at the 8B shape's 4 query heads a KV head
    (``gluon_rope_fold``), neither fold nor skip at 70B TP8's 8) against the reference; V padded gives
    the unpadded kernel's output bit for bit, the fold the two chains' (``gluon_rope_chains=2``)."""
    from weightszip.kernels.paged_decode import DEFAULT_CONFIGS, PAGE_COMPACT

    run, ref, vmax = _real_shape_case(shape, *bits, rope_pairs=pairs)
    cfg = DEFAULT_CONFIGS[PAGE_COMPACT]
    out = run(cfg)
    err = (out.double() - ref).abs().max().item()
    assert err <= 2.0**-6 * vmax, f"max error {err:.3g} > {2.0**-6:.3g} * max|v| {vmax:.3g}"
    assert torch.equal(run(dataclasses.replace(cfg, gluon_rope_v_pad=False)), out), "V padded differs"
    chains = run(dataclasses.replace(cfg, gluon_rope_fold=False, gluon_rope_chains=2))
    if shape[0] // shape[1] <= 4:
        assert torch.equal(chains, out), "the fold differs from two chains"
    else:  # (no padding column to fold into: the default is the tables' one chain)
        assert (chains.double() - out.double()).abs().max().item() <= 2.0**-10 * vmax


@pytest.mark.skipif(DEVICE != "cuda", reason="the Gluon kernel is compiled only (no interpreter)")
@pytest.mark.parametrize("bits", [(4, 2), (3, 5)], ids=["k4v2", "k3v5"])
def test_gluon_kernel_bit_plane_v_gpu(bits):
    """V at widths 2 and 5 (bit planes: the V operand's even/odd bit selects, which no case above
    reaches), staged, at the Llama-3.1-8B shape: against the reference and the Triton kernel as above."""
    run, ref, vmax = _real_shape_case((32, 8, 128), *bits)
    out = run(KernelConfig(gluon=True, gluon_min_work=0, gluon_warps=8, gluon_ahead=0, gluon_maxnreg=128,
                           gluon_stages=2))
    assert (out.double() - ref).abs().max().item() <= 2.0**-6 * vmax
    triton_out = run(KernelConfig(block_n=64, reg_lut_bits=0))
    assert (out.double() - triton_out.double()).abs().max().item() <= 2.0**-7 * vmax


@pytest.mark.skipif(DEVICE != "cuda", reason="the Gluon kernel is compiled only (no interpreter)")
@pytest.mark.parametrize("bits", [(4, 4), (3, 3), (2, 3)], ids=["q4", "q3", "k2v3"])
@pytest.mark.parametrize("variant", [(8, 1, 128, 0), (8, 0, 128, 2)], ids=["default", "staged2"])
@pytest.mark.parametrize("shape", [(32, 8, 128), (8, 1, 128)], ids=["llama8b", "llama70b-tp8"])
def test_gluon_vote_max_gives_the_same_output_gpu(shape, variant, bits):
    """``KernelConfig.gluon_vote`` (the lazy max by a warp vote) gives the default kernel's output bit
    for bit: the same maxima, so the same weights and sums in the same order."""
    run, ref, vmax = _real_shape_case(shape, *bits)
    warps, ahead, maxnreg, stages = variant
    cfg = KernelConfig(gluon=True, gluon_min_work=0, gluon_warps=warps, gluon_ahead=ahead, gluon_maxnreg=maxnreg,
                       gluon_stages=stages)
    out = run(cfg)
    assert torch.equal(run(dataclasses.replace(cfg, gluon_vote=True)), out)
    assert (out.double() - ref).abs().max().item() <= 2.0**-6 * vmax


@pytest.mark.skipif(DEVICE != "cuda", reason="the Gluon kernel is compiled only (no interpreter)")
@pytest.mark.parametrize("bits", [(4, 4), (3, 4), (4, 3)], ids=["q4", "k3v4", "q3.5"])
@pytest.mark.parametrize("stages", [2, 4])
@pytest.mark.parametrize("shape", [(32, 8, 128), (8, 1, 128), (9, 3, 64)], ids=["llama8b", "llama70b-tp8", "smollm2"])
def test_gluon_v_pad_and_copy_options_give_the_same_output_gpu(shape, stages, bits):
    """``KernelConfig.gluon_v_pad`` (V's staged row pairs padded), ``KernelConfig.gluon_copy_align``
    (the copies in whole 128-byte lines), each and both, and ``KernelConfig.gluon_bulk_copy`` (the
    copy engine, V as it lies or padded) read the same words, so the output is the default's bit for
    bit; where the padding does not apply (V at 3 bits, head_dim 64) it is the same kernel."""
    run, ref, vmax = _real_shape_case(shape, *bits)
    cfg = KernelConfig(gluon=True, gluon_min_work=0, gluon_warps=8, gluon_ahead=0, gluon_maxnreg=128,
                       gluon_stages=stages, gluon_vote=True)
    out = run(cfg)
    for pad, align, bulk in ((1, 0, 0), (0, 1, 0), (1, 1, 0), (0, 0, 1), (1, 0, 1)):
        change = dict(gluon_v_pad=bool(pad), gluon_copy_align=bool(align), gluon_bulk_copy=bool(bulk))
        assert torch.equal(run(dataclasses.replace(cfg, **change)), out), change
    assert (out.double() - ref).abs().max().item() <= 2.0**-6 * vmax


@pytest.mark.parametrize("bits", [(4, 4, 128), (3, 3, 128), (4, 3, 128), (2, 3, 64), (4, 4, 64), (4, 4, 32)],
                         ids=["q4", "q3", "q3.5", "k2v3-d64", "q4-d64", "q4-d32"])
def test_aligned_copies_copy_each_chunk_once_in_whole_lines(bits, monkeypatch):
    """``KernelConfig.gluon_copy_align``'s copy plan (``aligned_copy_slot`` run on tensors, the last
    chunks ``aligned_copy_last`` adds, the slot offsets): for both shifts of each side, every chunk
    of K and V is copied exactly once, into its place in the slot (the shift plus 16 per chunk, K and
    V apart, inside the slot); each step's 8-lane phases write within one 128-byte line (one shared
    wavefront), where the default plan's cross a line in every phase; the shared and global
    addresses agree mod 32 (a global sector's two halves land in one aligned 32 bytes); and a step
    reads at most 16 sectors."""
    from weightszip.kernels import paged_decode_gluon as pg

    monkeypatch.setattr(pg.gl, "where", torch.where)
    bk, bv, d = bits
    nk, nv = bk * d // 8, bv * d // 8
    steps = pg.copy_steps(nk, nv, True)
    koff, voff = pg.slot_k_offset(True), pg.slot_v_offset(16 * nk, True)
    slot = 4 * pg._slot_words(bk, bv, d, True)
    assert koff % 128 == 0 and voff % 128 == 0 and voff >= koff + 16 + 16 * nk and slot >= voff + 16 + 16 * nv
    i, lane = torch.arange(steps)[:, None], torch.arange(32)[None, :]

    def phases_lines(addr, on):
        return max(len({int(a) // 128 for a, o in zip(addr[s, 8 * p:8 * p + 8], on[s, 8 * p:8 * p + 8]) if o})
                   for s in range(addr.shape[0]) for p in range(4))

    for dk in (0, 1):
        for dv in (0, 1):
            is_v, q, on = pg.aligned_copy_slot.fn(i, lane, torch.tensor(dk), torch.tensor(dv), nk, nv)
            for side, n, shift, off in ((False, nk, dk, koff), (True, nv, dv, voff)):
                mine = on & (is_v == side)
                c = q - shift  # the page's chunk: its 32-byte-aligned start is 16 * shift before it
                got = sorted(c[mine].tolist())
                if shift and pg.aligned_copy_last(n):
                    got.append(n - 1)
                assert sorted(got) == list(range(n)), (side, dk, dv)
                shared = off + 16 * q
                assert torch.equal(shared[mine], (off + 16 * shift + 16 * c)[mine])  # where the readers look
                glob = 16 * q  # from the page's 32-byte-aligned start
                assert ((shared - glob)[mine] % 32 == 0).all()
                assert phases_lines(torch.where(mine, shared, 0), mine) == 1, (side, dk, dv)
                for s in range(steps):
                    assert len({int(g) // 32 for g in glob[s][mine[s]]}) <= 16
    # the default plan (chunk 32 s + lane, each side at its unaligned offset + shift): two lines
    c = lane + 32 * i
    on = c < nk + nv
    shared = torch.where(c < nk, pg.slot_k_offset(False) + 16 + 16 * c, pg.slot_v_offset(16 * nk, False) + 16 + 16 * (c - nk))
    assert phases_lines(shared, on) == 2


def test_v_pad_places_row_pairs_apart_its_reader_finds_them_without_bank_conflicts():
    """``v_padded_chunk`` (where the copies put V's 16-byte chunks with ``KernelConfig.gluon_v_pad``)
    and ``v_padded_word`` (where ``_v_words_staged`` reads them), run on tensors: the chunks in order,
    each 128-byte row pair one run, the pairs 160 bytes apart (every chunk at its source's address
    mod 32), inside the slot's padded V (``_slot_words``); the reader finds at its address the word
    it wants; and a staged V load (lane 4 j + tl reads the 4 words of chunk j >> 1 of row
    8 th + 2 tl + e, ``v_layout``) serves each phase of 8 lanes in one wavefront (its distinct
    chunks in distinct 16-byte bank groups), 4 a load, where the unpadded layout takes 16."""
    from weightszip.kernels import paged_decode_gluon as pg

    cv = torch.arange(64)
    placed = pg.v_padded_chunk.fn(cv)
    assert torch.equal(placed, 10 * (cv // 8) + cv % 8)  # row pairs 160 bytes apart, each one run
    v_bytes = 4 * pg._slot_words.fn(4, 4, 128, False, True) - 4 * pg._slot_words.fn(4, 4, 128)
    assert 16 * (int(placed.max()) + 1) <= 1024 + v_bytes  # inside the padded slot
    # the reader: row r, word q (of 16) is the chunk the copies placed, word q % 4 of it
    r, q = torch.meshgrid(torch.arange(16), torch.arange(16), indexing="ij")
    where = 16 * r + pg.v_padded_word.fn(q, r)
    assert torch.equal(where, 4 * placed[4 * r + q // 4] + q % 4)

    def wavefronts(padded, base):
        total = 0
        for th in range(2):
            for e in range(2):
                for phase in range(4):
                    lanes = range(8 * phase, 8 * phase + 8)
                    addrs = set()
                    for lane in lanes:
                        tl, j = lane % 4, lane // 4
                        row, q = 8 * th + 2 * tl + e, 4 * (j >> 1)
                        word = 16 * row + (pg.v_padded_word.fn(q, row) if padded else q)
                        addrs.add(base + 4 * word)
                    groups = collections.Counter((a % 128) // 16 for a in addrs)
                    total += max(groups.values())
        return total

    for base in (96, 112):  # V's planes in a slot: 96 + K's 1024 bytes + the shift (0 or 16), mod 128
        assert wavefronts(True, base) == 4 * 4
        assert wavefronts(False, base) == 4 * 16


# -- the register lookup's PTX (compiled only; Triton's interpreter cannot run inline assembly) ----------


def _run_lut_ptx(asm: str, inputs: list[int]) -> list[int]:
    """The instructions of the register lookup's PTX, run one by one on Python ints (b32 registers;
    prmt in its default mode: a selector nibble's bits 0-2 pick one of 8 bytes, bit 3 replicates the
    picked byte's sign)."""
    m32 = 0xFFFFFFFF

    def prmt(a, b, c):
        src = [(a >> 8 * i) & 0xFF for i in range(4)] + [(b >> 8 * i) & 0xFF for i in range(4)]
        out = 0
        for i in range(4):
            n = (c >> 4 * i) & 0xF
            v = src[n & 7]
            out |= ((0xFF if v & 0x80 else 0) if n & 8 else v) << 8 * i
        return out

    reg = {f"${k + 4}": v for k, v in enumerate(inputs)}
    out = {}

    def val(x):
        return reg[x] if x in reg else int(x, 0)

    for line in asm.splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith((".reg", "{", "}")):
            continue
        op, rest = line.split(None, 1)
        if op == "mov.b32":  # mov.b32 {$lo, $hi}, r: the two 16-bit halves of r
            lo, hi, r = re.fullmatch(r"\{(\$\d+), (\$\d+)\}, (\w+)", rest).groups()
            out[lo], out[hi] = val(r) & 0xFFFF, val(r) >> 16
            continue
        a = [t.strip() for t in rest.split(",")]
        fn = {"shr.b32": lambda x, y: x >> y, "or.b32": lambda x, y: x | y, "and.b32": lambda x, y: x & y}
        if op == "prmt.b32":
            reg[a[0]] = prmt(val(a[1]), val(a[2]), val(a[3]))
        else:
            reg[a[0]] = fn[op](val(a[1]), val(a[2])) & m32
    return [out[f"${k}"] for k in range(4)]


@pytest.mark.parametrize("bits", [2, 3])
def test_register_lookup_ptx_gives_the_codebook_values(bits):
    """``_lut_lookup``'s PTX with ``compact_lut_table``'s words gives bf16 codebook[code] for each of
    the four codes (one per byte) of a word, for every code in every byte."""
    from weightszip.kernels import paged_decode as P

    asm = P._LUT_ASM_8.value
    cb = torch.sort(torch.randn(3, 2**bits, generator=torch.Generator().manual_seed(bits)) * 3)[0]
    words = P.compact_lut_table(cb)
    want = cb.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    rng = np.random.default_rng(bits)
    for h in range(3):
        table = [int(w) & 0xFFFFFFFF for w in words[h]]
        codes = [[c] * 4 for c in range(2**bits)] + rng.integers(0, 2**bits, (200, 4)).tolist()
        for c in codes:
            y = sum(int(x) << 8 * i for i, x in enumerate(c))
            assert _run_lut_ptx(asm, [y] + table) == [int(want[h, x]) for x in c]


@triton.jit
def _lut_order_kernel(out_ptr, D: tl.constexpr):
    tl.store(out_ptr + tl.arange(0, D), _lut_order(D))


@triton.jit
def _lut_tile_kernel(out_ptr, BLOCK_N: tl.constexpr, D: tl.constexpr):
    # channel ids in the layout of _lut_lookup's four outputs: v_i[n, m, j] = 32 m + 8 i + j
    m = tl.arange(0, D // 32)[None, :, None]
    j = tl.arange(0, 8)[None, None, :]
    n = tl.zeros([BLOCK_N, 1, 1], dtype=tl.int32)
    v0 = n + m * 32 + j
    tile = _lut_tile(v0, v0 + 8, v0 + 16, v0 + 24, BLOCK_N, D)
    tl.store(out_ptr + tl.arange(0, BLOCK_N)[:, None] * D + tl.arange(0, D)[None, :], tile)


def test_register_lookup_tile_is_in_lut_order():
    """``_lut_lookup`` builds its tile with ``_lut_tile``: the channel at each position is the one
    ``_lut_order`` says (so q, the tile and the output agree)."""
    got = torch.empty(2, 128, dtype=torch.int32, device=DEVICE)
    _lut_tile_kernel[(1,)](got, BLOCK_N=2, D=128)
    want = torch.empty(128, dtype=torch.int32, device=DEVICE)
    _lut_order_kernel[(1,)](want, D=128)
    assert torch.equal(got.cpu(), want.cpu().expand(2, 128))


def test_register_lookup_channel_order_is_a_permutation():
    """``_lut_order``: the channel at each position of a register-lookup tile, as the kernel reads q
    and writes the output: every channel once, and the one the tile's layout puts there (position
    m * 32 + j * 4 + a * 2 + b holds channel 32 m + 8 (a + 2 b) + j; the kernel's function runs in
    Triton's interpreter, or compiled)."""
    pos = np.arange(128)
    m, j, a, b = pos // 32, (pos // 4) % 8, (pos // 2) % 2, pos % 2
    order = m * 32 + 8 * (a + 2 * b) + j
    assert sorted(order.tolist()) == list(range(128))
    got = torch.empty(128, dtype=torch.int32, device=DEVICE)
    _lut_order_kernel[(1,)](got, D=128)
    assert got.cpu().tolist() == order.tolist()


# -- the Gluon kernel's decode math on the CPU (the kernel itself is compiled only) ---------------------


def _plane_words(page: torch.Tensor, bits: int, d: int) -> torch.Tensor:
    """A compact page's bit planes (widths 2, 3, 5) or nibble rows (width 4: [1, 16 rows, d / 8]) as int64
    words [bits, 16 rows, d / 32] (little-endian, as the kernel reads)."""
    body = page[: bits * 16 * d // 8].to(torch.int64).view(1 if bits == 4 else bits, 16, -1, 4)
    return body[..., 0] | body[..., 1] << 8 | body[..., 2] << 16 | body[..., 3] << 24


@pytest.mark.parametrize("bits", [2])
def test_gluon_rotations_and_table_offsets_match_pair_index(bits):
    """The kernel's own formulas (funnel-shift rotates by 2 t - 2 p for K, by j - 2 p and j - 2 p - 1 with
    an even/odd bit select for V, the prmt byte select times 128 plus the lane's offset), emulated in
    PyTorch, give ``pair_index``'s codes and the word x * 32 + lane of the interleaved table, for every
    lane position and random words with all bits in play."""
    from weightszip.kernels.paged_decode_gluon import pair_index, pair_table_offset, rotated_pair_codes

    g = torch.Generator().manual_seed(10 + bits)
    w = torch.randint(0, 1 << 32, (bits, 2, 64), generator=g, dtype=torch.int64)  # [plane, row, word]
    for t in range(4):
        want = pair_index(w[:, 0], w[:, 0] >> 1, 2 * t, bits)
        assert torch.equal(rotated_pair_codes(w[:, 0], None, t, bits), want)
    for j in range(8):
        want = pair_index(w[:, 0], w[:, 1], j, bits)
        assert torch.equal(rotated_pair_codes(w[:, 0], w[:, 1], j, bits), want)
        for i in range(4):
            for lane in (0, 17, 31):
                off = pair_table_offset(want, i, lane)
                assert torch.equal(off // 4, ((want >> 8 * i) & 0xFF) * 64 + lane)  # row of 64 words
    assert int(want.max()) >= 1 << 24  # the top byte is in play (its bits wrap in the rotations)


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
def test_pair_tables_entry_by_entry(bits):
    """Each pair table (one gather of the codebook's bf16 bits by a cached index) holds, entry by entry,
    bf16 codebook[a] in its low half and codebook[b] in its high half for the entry's (a, b): code
    order (a | b << bits), interleaved bit order, and at width 3 the crumb byte; fp32 and bf16
    codebooks (bf16 rounding, -0.0, infinities kept bit for bit). The attention object makes each
    index once."""
    from weightszip.kernels.paged_decode import compact_pair_table
    from weightszip.kernels.paged_decode_gluon import crumb_pair_table, interleaved_pair_table

    g = torch.Generator().manual_seed(bits)
    cb = torch.randn(3, 1 << bits, generator=g) * 5
    cb[0, 0], cb[1, -1], cb[2, 0] = -0.0, float("inf"), 1 + 2.0**-10  # (rounds in bf16)
    n = 1 << bits

    def word(c, a, b):
        u = c.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
        w = int(u[a]) | int(u[b]) << 16
        return w - (1 << 32) if w >= 1 << 31 else w

    def interleave(x):
        return (sum(((x >> 2 * p) & 1) << p for p in range(bits)), sum(((x >> 2 * p + 1) & 1) << p for p in range(bits)))

    cases = [(compact_pair_table, lambda x: (x % n, x // n), n * n),
             (interleaved_pair_table, interleave, n * n)]
    if bits == 3:
        cases.append((crumb_pair_table, lambda x: ((x & 3) | ((x >> 4) & 1) << 2, ((x >> 2) & 3) | ((x >> 5) & 1) << 2), 256))
    for dtype in (torch.float32, torch.bfloat16):
        c = cb.to(dtype)
        for make, ab, entries in cases:
            t = make(c)
            assert t.dtype == torch.int32 and tuple(t.shape) == (3, entries) and t.is_contiguous()
            assert t.tolist() == [[word(c[h], *ab(x)) for x in range(entries)] for h in range(3)], make.__name__
    w = max(bits, 2)  # (compact pages are 2 bits wide at least)
    attn = PagedDecodeAttention(8, 2, 64, page_type="compact", k_bits=w, v_bits=w)
    assert attn._pair_order(w, "cpu") is attn._pair_order(w, "cpu")


def _check_operand_pairs(table, want, codes, d, k_pairs, v_pairs, k_channel, v_channel):
    """The Gluon kernel's operand pairs looked up in ``table`` (int64 words) are the codebook's bf16
    bits (``want`` [entries]) of the page's ``codes`` [16, d]: K lane t's pair codes ``k_pairs(t, m)``
    [16 rows], byte i, hold stored channels ``k_channel(32 m + 8 i + 2 t)`` and the next; V lane j's
    ``v_pairs(j, m)`` [8 row pairs], byte 2 i1 + i0, hold rows 2 r and 2 r + 1 of stored channel
    ``v_channel(32 m + 16 i1 + 8 i0 + j)``."""
    for t in range(4):
        for m in range(d // 32):
            y = k_pairs(t, m)
            for i in range(4):
                val = table[(y >> 8 * i) & 0xFF]
                s0 = k_channel(32 * m + 8 * i + 2 * t, d)
                assert s0 == k_channel(32 * m + 8 * i + 2 * t + 1, d) - 1
                assert torch.equal(val & 0xFFFF, want[codes[:, s0]])
                assert torch.equal(val >> 16, want[codes[:, s0 + 1]])
    for j in range(8):
        for m in range(d // 32):
            y = v_pairs(j, m)
            for i1 in range(2):
                for i0 in range(2):
                    val = table[(y >> 8 * (2 * i1 + i0)) & 0xFF]
                    s = v_channel(32 * m + 16 * i1 + 8 * i0 + j, d)
                    assert torch.equal(val & 0xFFFF, want[codes[0::2, s]])
                    assert torch.equal(val >> 16, want[codes[1::2, s]])


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_gluon_table_fill_orders_entries_as_the_host_indexes(bits):
    """The Gluon kernel makes its pair tables from the codebooks (``_fill_tables``): its entry codes
    (``_entry_codes``, its Python body run on a tensor) are the host's gather indexes (width 4 code
    order, width 3 crumb order, bit planes interleaved), which the lookup tests above check."""
    from weightszip.kernels.paged_decode import compact_pair_order
    from weightszip.kernels.paged_decode_gluon import _entry_codes, crumb_pair_order, interleaved_pair_order, table_entries

    order = (compact_pair_order(4, "cpu") if bits == 4 else crumb_pair_order("cpu") if bits == 3
             else interleaved_pair_order(bits, "cpu"))
    a, b = _entry_codes.fn(torch.arange(table_entries(bits)), bits)
    assert torch.equal(a, order[0::2]) and torch.equal(b, order[1::2])


class _Vals:
    """A tensor in a Gluon kernel's Python body run on the CPU (``_gluon_shim``): the integer and
    comparison operators the table fill uses, and ``.to`` with ``bitcast``."""

    def __init__(self, t):
        self.t = t

    @staticmethod
    def _v(o):
        return o.t if isinstance(o, _Vals) else o

    def __and__(self, o):
        return _Vals(self.t & self._v(o))

    __rand__ = __and__

    def __or__(self, o):
        return _Vals(self.t | self._v(o))

    def __rshift__(self, o):
        return _Vals(self.t >> self._v(o))

    def __lshift__(self, o):
        return _Vals(self.t << self._v(o))

    def __floordiv__(self, o):
        return _Vals(self.t // self._v(o))

    def __mod__(self, o):
        return _Vals(self.t % self._v(o))

    def __ge__(self, o):
        return _Vals(self.t >= self._v(o))

    def __lt__(self, o):
        return _Vals(self.t < self._v(o))

    def __invert__(self):
        return _Vals(~self.t)

    def __add__(self, o):
        return _Vals(self.t + self._v(o))

    __radd__ = __add__

    def __mul__(self, o):
        return _Vals(self.t * self._v(o))

    __rmul__ = __mul__

    def to(self, dtype, bitcast=False):
        return _Vals(self.t.view(dtype) if bitcast else self.t.to(dtype))


class _Ptr:
    """A pointer into a flat tensor; plus a ``_Vals`` of offsets, the addresses a masked load reads."""

    def __init__(self, buf, off=0):
        self.buf, self.off = buf, off

    def __add__(self, o):
        return (self, o.t) if isinstance(o, _Vals) else _Ptr(self.buf, self.off + o)


def _masked_load(addr, mask=True, other=0):
    ptr, idx = (addr, torch.tensor(0)) if isinstance(addr, _Ptr) else addr
    idx, mask = torch.broadcast_tensors(idx, torch.as_tensor(_Vals._v(mask)))
    out = torch.full(idx.shape, other, dtype=ptr.buf.dtype)
    out[mask] = ptr.buf[ptr.off + idx[mask]]
    return _Vals(out)


class _Shared:
    """Shared memory of int32 words: ``slice(start, n).store(values)``."""

    def __init__(self, words, buf=None):
        self.buf = torch.full((words,), -1, dtype=torch.int32) if buf is None else buf

    def slice(self, start, n):
        return _Shared(0, self.buf[start:start + n])

    def store(self, x):
        self.buf.copy_(x.t.to(torch.int32))


def test_gluon_table_fill_writes_the_host_tables(monkeypatch):
    """``_fill_tables`` (its Python body, the Gluon ops and its inline-PTX stores standing in on the
    CPU) writes the host's pair tables (``compact_pair_table``, ``crumb_pair_table``,
    ``interleaved_pair_table``) for every K and V width pair, fp32 and bf16 codebooks and each head's
    codebook: K's entry x in words 64 x .. 64 x + 31 (one copy a lane), V's in the next 32. Every entry
    a code can name is written (the buffer starts at -1, which no bf16 pair of these codebooks is);
    rows past the smaller table's entries are left as they were. (The conversion to bf16 is torch's
    here; on the GPU it is ``cvt.rn.bf16.f32``, the same rounding. The layouts stand in as whole
    tensors, so how the words spread over warps is not exercised here: the compile test and the GPU
    tests at 2-16 warps are.)"""
    import types

    from weightszip.kernels import paged_decode_gluon as pg
    from weightszip.kernels.paged_decode import compact_pair_table

    gl = types.SimpleNamespace(BlockedLayout=lambda *a: None, load=_masked_load,
                               arange=lambda a, b, layout=None: _Vals(torch.arange(a, b, dtype=torch.int32)),
                               bfloat16=torch.bfloat16, int16=torch.int16, int32=torch.int32)

    def axis(n, dim, rank, layout):
        return _Vals(torch.arange(n, dtype=torch.int32).reshape([n if d == dim else 1 for d in range(rank)]))

    def sts(addr, x):
        addr, x = torch.broadcast_tensors(addr.t, x.t)
        assert bool((addr % 4 == 0).all())
        tab.buf[addr.reshape(-1) // 4] = x.reshape(-1).to(torch.int32)

    fill = pg._fill_tables.fn
    for name, value in [("gl", gl), ("_axis", axis), ("_sts", sts)] + [
            (f, getattr(pg, f).fn) for f in ("_entry_codes", "_entry_row", "_bf16_bits", "_fill_table")]:
        monkeypatch.setitem(fill.__globals__, name, value)  # the module's globals: every function's
    host = {2: pg.interleaved_pair_table, 3: pg.crumb_pair_table, 4: compact_pair_table}
    gen = torch.Generator().manual_seed(0)
    for kb in (2, 3, 4):
        for vb in (2, 3, 4):
            for dtype in (torch.float32, torch.bfloat16):
                k_cb = (torch.randn(3, 1 << kb, generator=gen) * 3).to(dtype)
                v_cb = (torch.randn(3, 1 << vb, generator=gen) * 3).to(dtype)
                ek, ev = pg.table_entries(kb), pg.table_entries(vb)
                for head in range(3):
                    tab = _Shared(max(ek, ev) * 64)
                    fill(_Ptr(k_cb.reshape(-1)) + head * (1 << kb),
                                       _Ptr(v_cb.reshape(-1)) + head * (1 << vb), kb, vb, 8, 0)
                    rows = tab.buf.view(-1, 64)
                    for half, table, entries in ((rows[:, :32], host[kb](k_cb)[head], ek),
                                                 (rows[:, 32:], host[vb](v_cb)[head], ev)):
                        assert torch.equal(half[:entries], table[:, None].expand(-1, 32)), (kb, vb, dtype, head)
                        assert bool((half[entries:] == -1).all()), (kb, vb, dtype, head)


def _run_warp_ptx(asm: str, regs: dict) -> dict:
    """A lockstep interpreter of one warp for the PTX subset ``_vote_max_asm`` uses: ``regs`` maps
    operand numbers to 32-lane tensors (fp32 or int32); returns the operands after the block. Branches
    must be uniform (``bra.uni``), as the kernel promises."""
    body = asm.strip()[1:-1]
    stmts = [x.strip() for x in body.split(";") if x.strip()]
    labels, code = {}, []
    for x in stmts:
        while re.match(r"^\w+:", x):
            name, x = x.split(":", 1)
            labels[name] = len(code)
            x = x.strip()
        if x and not x.startswith(".reg"):
            code.append(x)
    env = {f"${k}": v.clone() for k, v in regs.items()}
    lane = torch.arange(32)

    def val(t):
        if t in env:
            return env[t]
        return torch.full((32,), float(t) if "." in t else int(t, 0))

    pc = 0
    while pc < len(code):
        x = code[pc]
        pc += 1
        guard = re.match(r"^@(!?)(\w+)\s+(.*)$", x)
        if guard:
            pred = env[guard.group(2)].bool()
            pred = ~pred if guard.group(1) else pred
            assert bool((pred == pred[0]).all()), "a divergent branch"
            if not bool(pred[0]):
                continue
            x = guard.group(3)
        op, args = x.split(None, 1)
        a = [t.strip() for t in args.split(",")]
        if op == "bra.uni":
            pc = labels[a[0]]
        elif op == "max.f32":
            env[a[0]] = torch.fmax(val(a[1]), val(a[2])).float()
        elif op == "add.f32":
            env[a[0]] = (val(a[1]).float() + val(a[2]).float()).float()
        elif op == "setp.gt.f32":
            env[a[0]] = val(a[1]).float() > val(a[2]).float()
        elif op == "or.pred":
            env[a[0]] = env[a[1]] | env[a[2]]
        elif op == "vote.sync.any.pred":
            env[a[0]] = env[a[1]].any().expand(32).clone()
        elif op == "shfl.sync.bfly.b32":
            env[a[0]] = val(a[1])[lane ^ int(a[2])].clone()
        elif op in ("selp.f32", "selp.u32"):
            env[a[0]] = torch.where(env[a[3]], val(a[1]), val(a[2]))
        elif op in ("mov.f32", "mov.u32"):
            env[a[0]] = val(a[1]).clone()
        else:
            raise AssertionError(f"unmodelled PTX: {x}")
    return {int(k[1:]): v for k, v in env.items() if k.startswith("$")}


@pytest.mark.parametrize("tiles", [1, 2])
def test_gluon_vote_max_asm_equals_its_reference(tiles):
    """``_vote_max_asm`` (the compact kernel's lazy max: a warp vote, shuffles only when a max moves),
    run by a lockstep interpreter of one warp over the mma.sync accumulator layout (lane l: rows
    l // 4 and l // 4 + 8, columns 2 (l % 4) + 8 t and the next), gives ``vote_max_ref``'s new maxima
    and flag bit for bit: pages below the threshold, pages that move one column or all, rows at -inf,
    the first page (max -1e30), and logits a hair above and at the threshold."""
    from weightszip.kernels import paged_decode_gluon as pg

    asm = pg._vote_max_asm(tiles)
    n, g = 4 * tiles, 8 * tiles
    gen = torch.Generator().manual_seed(tiles)
    lane = torch.arange(32)
    rows = torch.stack([lane // 4, lane // 4, lane // 4 + 8, lane // 4 + 8], dim=1)  # [32, 4] per tile
    cols = torch.stack([2 * (lane % 4), 2 * (lane % 4) + 1] * 2, dim=1)
    slack = float(pg.MAX_SLACK.value)
    cases = []
    for k in range(40):
        m = (torch.randn(g, generator=gen) * 4).float()
        s = (m[None, :] + torch.rand(16, g, generator=gen) * slack - slack).float()  # all below: no move
        if k % 4 == 1:
            s[torch.randint(16, (1,), generator=gen), torch.randint(g, (1,), generator=gen)] += 2 * slack + 1
        elif k % 4 == 2:
            s += 3 * slack
        elif k % 4 == 3:
            s[torch.rand(16, generator=gen) < 0.5] = float("-inf")
        cases.append((s, m))
    m0 = torch.full((g,), -1.0e30)
    cases += [(torch.randn(16, g, generator=gen), m0), (torch.full((16, g), float("-inf")), m0)]
    edge = torch.zeros(16, g)
    cases += [(edge + torch.nextafter(torch.tensor(slack), torch.tensor(99.0)), torch.zeros(g)),
              (edge + slack, torch.zeros(g))]
    moved = 0
    for s, m in cases:
        regs = {}
        for t in range(tiles):
            for e in range(4):
                regs[2 * n + 4 * t + e] = s[rows[:, e], cols[:, e] + 8 * t].float()
                regs[3 * n + 4 * t + e] = m[cols[:, e] + 8 * t].float()
        out = _run_warp_ptx(asm, regs)
        want_m, want_need = pg.vote_max_ref(s[None].float(), m[None].float())
        moved += int(want_need)
        for t in range(tiles):
            for e in range(4):
                assert torch.equal(out[4 * t + e], want_m[0, cols[:, e] + 8 * t]), (t, e)
                assert bool((out[n + 4 * t + e] == int(want_need)).all())
    assert 10 <= moved < len(cases)  # both paths ran


def test_gluon_vote_max_is_the_lazy_max(monkeypatch):
    """``vote_max_ref`` (the model of ``_vote_max_asm``) and ``_vote_softmax_step``'s Python body around
    it give ``_lazy_softmax_step``'s weights, rescale, max, mass and flag bit for bit over pages of
    logits that climb, jump and fall (the same sequence as the test below)."""
    import types

    from weightszip.kernels import paged_decode_gluon as pg

    def asm(text, constraints, args, dtype, is_pure, pack):
        s, m = args
        m_new, need = pg.vote_max_ref(s, m[:, 0, :], slack)
        return m_new[:, None, :].expand_as(s), need[:, None, None].expand_as(s)

    gl = types.SimpleNamespace(where=torch.where, maximum=torch.maximum, exp2=torch.exp2, int32=torch.int32,
                               float32=torch.float32, expand_dims=lambda x, d: x.unsqueeze(d),
                               max=lambda x, axis: x.amax(dim=axis), inline_asm_elementwise=asm,
                               reduce=lambda x, axis, fn: x.select(axis, 0))
    slack = float(pg.MAX_SLACK.value)
    for f in (pg._lazy_softmax_step, pg._vote_softmax_step):  # (one module: the same globals)
        monkeypatch.setitem(f.fn.__globals__, "gl", gl)
        monkeypatch.setitem(f.fn.__globals__, "MAX_SLACK", slack)
    monkeypatch.setitem(pg._vote_softmax_step.fn.__globals__, "_vote_max_asm", lambda t: "")
    monkeypatch.setitem(pg._vote_softmax_step.fn.__globals__, "_vote_max_constraints", lambda t: "")
    gen = torch.Generator().manual_seed(5)
    trend = torch.cat([torch.linspace(0, 6, 20), torch.full((5,), 36.0), torch.full((15,), -20.0)])
    nw, g = 2, 8
    m = torch.full((nw, g), -1.0e30)
    l_t = torch.zeros(nw, 16, g)
    for j in range(40):
        s = (torch.randn(nw, 16, g, generator=gen) * 2 + trend[j]).float()
        valid = torch.rand(nw, 16, generator=gen) > 0.1
        a = pg._lazy_softmax_step.fn(s, valid, m, l_t)
        b = pg._vote_softmax_step.fn(s, valid, m, l_t)
        for x, y in zip(a + ((a[2] != m).any(dim=1).to(torch.int32),), b):  # the flag: any head of the warp moved
            assert torch.equal(x, y), j
        m, l_t = a[2], a[3]


def test_gluon_lazy_softmax_gives_the_softmax(monkeypatch):
    """The compact kernel's running softmax (``_lazy_softmax_step``'s Python body on the CPU, the sum's
    rescale as ``_rescale`` does it: skipped where no head's max moved) over pages of logits that
    climb, jump and fall gives softmax(s) @ v of all rows at once within fp32 rounding, and its max
    moves only when a page's exceeds it by more than MAX_SLACK."""
    import types

    from weightszip.kernels import paged_decode_gluon as pg

    gl = types.SimpleNamespace(where=torch.where, maximum=torch.maximum, exp2=torch.exp2,
                               expand_dims=lambda x, d: x.unsqueeze(d), max=lambda x, axis: x.amax(dim=axis))
    slack = float(pg.MAX_SLACK.value)
    monkeypatch.setitem(pg._lazy_softmax_step.fn.__globals__, "gl", gl)
    monkeypatch.setitem(pg._lazy_softmax_step.fn.__globals__, "MAX_SLACK", slack)
    gen = torch.Generator().manual_seed(5)
    nw, g, d, pages = 2, 8, 16, 40
    # a slow climb (the max stays within the slack), a jump of 30, then logits far below the max
    trend = torch.cat([torch.linspace(0, 6, 20), torch.full((5,), 36.0), torch.full((15,), -20.0)])
    s = torch.randn(pages, nw, 16, g, generator=gen, dtype=torch.float64) * 2 + trend[:, None, None, None]
    v = torch.randn(pages, nw, 16, d, generator=gen, dtype=torch.float64)
    valid = torch.rand(pages, nw, 16, generator=gen) > 0.1
    m = torch.full((nw, g), -1.0e30, dtype=torch.float32)
    l_t = torch.zeros(nw, 16, g)
    acc = torch.zeros(nw, d, g)
    moves = 0
    for j in range(pages):
        p, alpha, m_new, l_t = pg._lazy_softmax_step.fn(s[j].float(), valid[j], m, l_t)
        moved = m_new != m
        moves += int(moved.any())
        assert bool((alpha[~moved] == 1).all()) and bool((p <= 2 ** slack).all())
        acc = acc * alpha[:, None, :] if bool(moved.any()) else acc
        acc = acc + torch.einsum("wrd,wrg->wdg", v[j].float(), p)
        m = m_new
    out = acc / l_t.sum(dim=1)[:, None, :]  # each warp's own softmax
    s_all = torch.where(valid[..., None], s, float("-inf")).permute(1, 0, 2, 3).reshape(nw, pages * 16, g)
    weights = torch.softmax(s_all * np.log(2.0), dim=1)  # (base 2: the kernel's logits carry log2(e))
    want = torch.einsum("wtg,wtd->wdg", weights, v.permute(1, 0, 2, 3).reshape(nw, pages * 16, d))
    torch.testing.assert_close(out.double(), want, rtol=1e-5, atol=1e-6)
    assert 2 <= moves <= 8  # the first page, the jump (and not on every page of the climb)


@pytest.mark.parametrize("d", [32, 64, 128])
def test_gluon_nibble_rows_give_the_codebook_values(d):
    """Width 4 (nibble rows): the Gluon kernel's operand math in PyTorch on random pages. K: lane t's
    words t M + m of a row, byte i, looked up in the code-order pair table, are the values of the
    stored channels ``k_nibble_channel`` maps its operand channels 32 m + 8 i + 2 t (+ 1) to. V: lane
    j's words (j >> 1) M + m of rows 2 r and 2 r + 1 through ``nibble_pair_codes``, byte 2 i1 + i0, are
    the two rows' values of ``v_nibble_channel``'s stored channel for 32 m + 16 i1 + 8 i0 + j. Both
    maps are permutations of the head_dim channels."""
    from weightszip.kernels.paged_decode import compact_pair_table
    from weightszip.kernels.paged_decode_gluon import k_nibble_channel, nibble_pair_codes, v_nibble_channel

    from weightszip.kernels.paged_decode_gluon import _k_nibble_channel, _v_nibble_channel

    mm = d // 32
    ch = torch.arange(d)
    assert sorted(k_nibble_channel(ch, d).tolist()) == sorted(v_nibble_channel(ch, d).tolist()) == list(range(d))
    # the kernel's own maps (their Python bodies, run on a tensor) are these
    assert torch.equal(_k_nibble_channel.fn(ch, d), k_nibble_channel(ch, d))
    assert torch.equal(_v_nibble_channel.fn(ch, d), v_nibble_channel(ch, d))
    assert torch.equal(k_nibble_channel(ch[1::2], d), k_nibble_channel(ch[0::2], d) + 1)  # b: the pair's halves
    g = torch.Generator().manual_seed(d)
    cb = torch.sort(torch.rand(2, 16, generator=g) * 2 - 1, dim=1)[0]
    table = compact_pair_table(cb)[1].to(torch.int64) & 0xFFFFFFFF
    want = cb[1].to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    for _ in range(3):
        page = torch.randint(0, 256, (codec.page_bytes(4, d),), dtype=torch.uint8, generator=g)
        codes = codec.unpack_page(page, 4, d)[0].long()  # [16, d]
        w = _plane_words(page, 4, d)[0]  # [16 rows, d / 8]
        _check_operand_pairs(table, want, codes, d, lambda t, m: w[:, t * mm + m],
                             lambda j, m: nibble_pair_codes(w[0::2, (j >> 1) * mm + m], w[1::2, (j >> 1) * mm + m], j),
                             k_nibble_channel, v_nibble_channel)


@pytest.mark.parametrize("d", [32, 64, 128])
def test_gluon_crumb_rows_give_the_codebook_values(d):
    """Width 3 (crumb rows and a bit-2 row): the Gluon kernel's operand math in PyTorch on random pages.
    K: lane t's crumb word (t >> 1) M + m and bit-2 word m through ``crumb_pair_codes_k``, byte i,
    looked up in ``crumb_pair_table``, are the values of the stored channels ``k_crumb_channel`` maps
    32 m + 8 i + 2 t (+ 1) to. V: lane j's crumb words (j >> 2) M + m and bit-2 words m of rows 2 r,
    2 r + 1 through ``crumb_pair_codes_v``, byte 2 i1 + i0, are the two rows' values of
    ``v_crumb_channel``'s stored channel for 32 m + 16 i1 + 8 i0 + j. The maps are permutations, and
    the kernel's own (``_k_stored_channel``, ``_v_stored_channel``) are these."""
    from weightszip.kernels.paged_decode_gluon import (_k_stored_channel, _v_stored_channel, crumb_pair_codes_k,
                                                       crumb_pair_codes_v, crumb_pair_table, k_crumb_channel,
                                                       v_crumb_channel)

    mm = d // 32
    ch = torch.arange(d)
    assert sorted(k_crumb_channel(ch, d).tolist()) == sorted(v_crumb_channel(ch, d).tolist()) == list(range(d))
    assert torch.equal(_k_stored_channel.fn(ch, d, 3), k_crumb_channel(ch, d))
    assert torch.equal(_v_stored_channel.fn(ch, d, 3), v_crumb_channel(ch, d))
    g = torch.Generator().manual_seed(d + 3)
    cb = torch.sort(torch.rand(2, 8, generator=g) * 2 - 1, dim=1)[0]
    table = crumb_pair_table(cb)[1].to(torch.int64) & 0xFFFFFFFF
    want = cb[1].to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    for _ in range(3):
        page = torch.randint(0, 256, (codec.page_bytes(3, d),), dtype=torch.uint8, generator=g)
        codes = codec.unpack_page(page, 3, d)[0].long()  # [16, d]
        body = page[: 6 * d].to(torch.int64).view(16, 3 * mm, 4)
        w = body[..., 0] | body[..., 1] << 8 | body[..., 2] << 16 | body[..., 3] << 24  # [16 rows, 3 M words]

        def v_pairs(j, m):
            c, p = w[:, (j >> 2) * mm + m], w[:, 2 * mm + m]
            return crumb_pair_codes_v(c[0::2], c[1::2], p[0::2], p[1::2], j)

        _check_operand_pairs(table, want, codes, d,
                             lambda t, m: crumb_pair_codes_k(w[:, (t >> 1) * mm + m], w[:, 2 * mm + m], t),
                             v_pairs, k_crumb_channel, v_crumb_channel)


@pytest.mark.parametrize("bits", [2])
def test_gluon_pair_codes_give_the_codebook_values(bits):
    """The Gluon kernel's operand math (``pair_index`` + ``interleaved_pair_table``), run in PyTorch on
    random pages: K's channel pairs (thread t: bits 2t, 2t + 1 of each byte of a row's word) and V's
    row pairs (thread j: bit j of each byte of two rows' words) look up bf16(codebook[code]) of both
    values, against the reference unpacker's codes."""
    from weightszip.kernels.paged_decode_gluon import interleaved_pair_table, pair_index

    d = 128
    g = torch.Generator().manual_seed(bits)
    cb = torch.sort(torch.rand(2, 2**bits, generator=g) * 2 - 1, dim=1)[0]
    table = interleaved_pair_table(cb)[1].to(torch.int64) & 0xFFFFFFFF
    want = cb[1].to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    for _ in range(3):
        page = torch.randint(0, 256, (codec.page_bytes(bits, d),), dtype=torch.uint8, generator=g)
        codes, _ = codec.unpack_page(page, bits, d)
        codes = codes.long()  # [16, d]
        w = _plane_words(page, bits, d)  # [bits, 16, d / 32]
        for t in range(4):  # K: channel pairs 32 m + 8 i + 2 t, + 1 of every row
            y = pair_index(w, w >> 1, 2 * t, bits)
            for i in range(4):
                val = table[(y >> 8 * i) & 0xFF]  # [16, d / 32]
                ch = torch.arange(d // 32) * 32 + 8 * i + 2 * t
                assert torch.equal(val & 0xFFFF, want[codes[:, ch]])
                assert torch.equal(val >> 16, want[codes[:, ch + 1]])
        for j in range(8):  # V: rows 2 r, 2 r + 1 of channel 32 m + 8 i + j
            y = pair_index(w[:, 0::2], w[:, 1::2], j, bits)
            for i in range(4):
                val = table[(y >> 8 * i) & 0xFF]  # [8, d / 32]
                ch = torch.arange(d // 32) * 32 + 8 * i + j
                assert torch.equal(val & 0xFFFF, want[codes[0::2][:, ch]])
                assert torch.equal(val >> 16, want[codes[1::2][:, ch]])


_COMPILE_GLUON = """
import re
import sys
from weightszip.kernels.paged_decode_gluon import compact_split_kernel, compile_for_hopper, rope_table_words, smem_offsets

kb, vb, d, group, chunks, stages = (int(x) for x in sys.argv[1:7])
vote = sys.argv[7:8] == ["1"]  # KernelConfig.gluon_vote
pad = sys.argv[8:9] == ["1"]  # KernelConfig.gluon_v_pad
align = sys.argv[9:10] == ["1"]  # KernelConfig.gluon_copy_align
bulk = sys.argv[10:11] == ["1"]  # KernelConfig.gluon_bulk_copy
hoist = sys.argv[11:12] == ["1"]  # KernelConfig.gluon_rope_hoist (the term's chunks within it)
table = sys.argv[12:13] == ["1"]  # KernelConfig.gluon_rope_table
pos = sys.argv[13:14] == ["1"]  # KernelConfig.gluon_rope_pos (staged: the slots hold the pages' cos and sin)
lanes = sys.argv[14:15] == ["1"]  # KernelConfig.gluon_rope_lanes (staged: the warp writes them there)
chains = 2 if sys.argv[15:16] == ["1"] else 1  # KernelConfig.gluon_rope_chains
fold = sys.argv[16:17] == ["1"]  # KernelConfig.gluon_rope_fold
skip = sys.argv[17:18] == ["1"]  # KernelConfig.gluon_rope_skip_pad
warps = 16 if chunks else 8  # as PagedDecodeAttention launches it (gluon_rope_warps, gluon_warps)
block_g = max(8, 1 << (group - 1).bit_length())
tab_off, stage_off, smem_end = smem_offsets(kb, vb, d, warps, stages, align, pad,
                                            rope_table_words(chunks, block_g) if table else 0,
                                            chunks if pos or lanes else 0)
ptrs = {"q_ptr": "*fp32", "bias_ptr": "*fp32", "k_pages_ptr": "*u8", "v_pages_ptr": "*u8", "ws_m_ptr": "*fp32",
        "ws_l_ptr": "*fp32", "ws_acc_ptr": "*fp32", "k_grid_ptr": "*fp32", "v_grid_ptr": "*fp32",
        "rope_coef_ptr": "*fp32", "rope_phase_ptr": "*i64", "k_cb_ptr": "*fp32", "v_cb_ptr": "*fp32",
        "rope_pos_ptr": "*fp32"}
const = dict(GROUP=group, BLOCK_G=block_g, HEAD_DIM=d, BLOCK_SIZE=16, BITS_K=kb,
             BITS_V=vb, HAS_BIAS=True, V_EARLY=True, K_AHEAD=False, ROPE_CHUNKS=chunks, STAGES=stages,
             TAB_OFF=tab_off, STAGE_OFF=stage_off, VOTE=vote, V_PAD=pad, COPY_ALIGN=align,
             BULK_COPY=bulk, ROPE_HOIST=hoist, ROPE_TABLE=table, ROPE_POS=pos, ROPE_LANES=lanes,
             ROPE_CHAINS=chains, ROPE_FOLD=fold, ROPE_SKIP=skip)
# ptxas's own report of the register allocation (the defaults: 8 warps, 128 registers; with the
# rotary term 16 warps, so 128 registers at most, as PagedDecodeAttention launches it)
k, spills = compile_for_hopper(compact_split_kernel, const, ptrs, warps, None if chunks else 128)
ptx = k.asm["ptx"]
# the tables and the staging buffer (inline PTX alone reads and writes them, at smem_offsets') are
# the kernel's whole shared memory: no Triton scratch shares their bytes while they live
# the staged copies: 16-byte cp.async per lane, or (bulk) the copy engine completing on the slots'
# mbarriers (and no 16-byte cp.async left)
copies = ("cp.async.bulk.shared::cluster.global.mbarrier" in ptx and "mbarrier.try_wait.parity" in ptx
          and "mbarrier.init" in ptx and "cp.async.cg.shared.global" not in ptx) if bulk else \
    ptx.count("cp.async.cg.shared.global") > 0
print("cp.async", copies, "shared", k.metadata.shared == smem_end)
print("lds", "ld.shared.b32" in ptx, "mma", "mma.sync.aligned.m16n8k16" in ptx, "cos", "cos.approx" in ptx,
      "v4", "ld.shared.v4.b32" in ptx, "spills", spills)
# the pages' cos and sin: 8-byte cp.async of the table's rows, and no phase computed in the loop
# (the 32-bit product's high word, ``mul.hi.u32``, appears only with the phase)
print("cp8", bool(re.search("cp[.]async[.]ca[.]shared[.]global [[]a[]], [[]%rd[0-9]+[]], 8;", ptx)),
      "mulhi", "mul.hi.u32" in ptx)
# the warp's own cos and sin: a predicated 4-byte store a lane and chunk into the slot
print("lanes", "@p st.shared.b32 [a]" in ptx)
# the folded columns: the sine products' columns 4-7 from the lane 2 on (shfl.sync.down by 2)
print("fold", bool(re.search(r"shfl[.]sync[.]down[.]b32 [^;]*, 2, 0x1f, 0xffffffff;", ptx)))
print("skip", "@p ld.shared.v4.b32" in ptx)
"""


@pytest.mark.parametrize("case", [(4, 4, 128, 4, 0, 0), (4, 3, 128, 8, 0, 0), (3, 3, 64, 3, 0, 0), (2, 3, 64, 3, 0, 0),
                                  (4, 4, 64, 16, 0, 0), (4, 4, 128, 4, 2, 0), (3, 3, 64, 3, 2, 0),
                                  (4, 4, 128, 4, 0, 2), (3, 3, 128, 4, 0, 2), (4, 3, 128, 8, 0, 4), (2, 3, 64, 3, 2, 2),
                                  (4, 4, 128, 4, 2, 2), (4, 4, 32, 4, 0, 2), (3, 4, 128, 4, 0, 2),
                                  (4, 4, 128, 4, 0, 2, 1), (3, 3, 128, 4, 0, 2, 1), (4, 4, 64, 16, 0, 0, 1),
                                  (4, 4, 128, 4, 2, 2, 1), (4, 4, 128, 4, 0, 2, 1, 1), (4, 4, 128, 8, 0, 4, 1, 1),
                                  (4, 4, 128, 4, 0, 2, 1, 1, 1), (3, 3, 128, 4, 0, 2, 1, 0, 1), (4, 3, 128, 8, 0, 4, 1, 0, 1),
                                  (2, 3, 64, 3, 0, 2, 1, 0, 1), (4, 4, 32, 4, 0, 2, 1, 1, 1),
                                  (4, 4, 128, 4, 0, 2, 1, 0, 0, 1), (4, 4, 128, 4, 0, 2, 1, 1, 0, 1),
                                  (3, 3, 128, 4, 0, 2, 1, 0, 0, 1), (4, 3, 128, 8, 0, 4, 1, 0, 0, 1),
                                  (3, 3, 64, 3, 0, 2, 1, 0, 0, 1), (4, 4, 128, 4, 2, 2, 1, 0, 0, 0, 1),
                                  (3, 3, 64, 3, 2, 2, 1, 0, 0, 0, 1), (4, 4, 128, 4, 2, 2, 1, 0, 0, 0, 0, 1),
                                  (4, 4, 128, 4, 4, 2, 1, 0, 0, 0, 0, 1), (3, 3, 64, 3, 2, 2, 1, 0, 0, 0, 0, 1),
                                  (4, 4, 128, 4, 2, 0, 1, 0, 0, 0, 0, 1), (4, 4, 128, 4, 2, 2, 1, 0, 0, 0, 0, 1, 1),
                                  (4, 4, 128, 4, 4, 2, 1, 0, 0, 0, 0, 1, 1), (3, 3, 64, 3, 1, 2, 1, 0, 0, 0, 0, 1, 1),
                                  (4, 4, 128, 4, 4, 2, 1, 0, 0, 1, 0, 1, 1),
                                  (4, 4, 128, 4, 2, 2, 1, 0, 0, 0, 0, 1, 0, 1),
                                  (4, 4, 128, 4, 3, 2, 1, 0, 0, 0, 0, 1, 0, 1),
                                  (3, 3, 64, 3, 1, 2, 1, 0, 0, 0, 0, 1, 0, 1),
                                  (4, 4, 128, 4, 2, 2, 1, 0, 0, 0, 0, 1, 0, 0, 1),
                                  (4, 4, 128, 4, 2, 2, 1, 0, 0, 0, 0, 1, 0, 0, 0, 1),
                                  (3, 3, 64, 3, 1, 2, 1, 0, 0, 0, 0, 1, 0, 1, 0, 1),
                                  (4, 4, 128, 4, 2, 2, 1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1),
                                  (4, 4, 128, 4, 2, 2, 1, 1, 0, 0, 0, 1, 0, 0, 0, 0, 1),
                                  (4, 4, 128, 4, 2, 2, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0),
                                  (4, 4, 128, 4, 4, 2, 1, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0)],
                         ids=["q4-8b", "q3.5-70b", "q3-smollm2", "k2v3-smollm2", "q4-64x16", "q4-8b-rope",
                              "q3-smollm2-rope", "q4-8b-staged", "q3-8b-staged", "q3.5-70b-staged4",
                              "k2v3-smollm2-rope-staged", "q4-8b-rope-staged", "q4-d32-staged", "k3v4-8b-staged",
                              "q4-8b-staged-vote", "q3-8b-staged-vote", "q4-64x16-vote", "q4-8b-rope-staged-vote",
                              "q4-8b-staged-vote-vpad", "q4-70b-staged4-vote-vpad", "q4-8b-staged-vote-vpad-align",
                              "q3-8b-staged-vote-align", "q3.5-70b-staged4-vote-align", "k2v3-smollm2-staged-vote-align",
                              "q4-d32-staged-vote-vpad-align",
                              "q4-8b-staged-vote-bulk", "q4-8b-staged-vote-vpad-bulk", "q3-8b-staged-vote-bulk",
                              "q3.5-70b-staged4-vote-bulk", "q3-smollm2-staged-vote-bulk",
                              "q4-8b-rope-staged-vote-hoist", "q3-smollm2-rope-staged-vote-hoist",
                              "q4-8b-rope-staged-vote-table", "q4-8b-rope4-staged-vote-table",
                              "q3-smollm2-rope-staged-vote-table", "q4-8b-rope-vote-table",
                              "q4-8b-rope-staged-vote-table-pos",
                              "q4-8b-rope4-staged-vote-table-pos", "q3-smollm2-rope1-staged-vote-table-pos",
                              "q4-8b-rope4-staged-vote-bulk-table-pos", "q4-8b-rope-staged-vote-table-lanes",
                              "q4-8b-rope3-staged-vote-table-lanes", "q3-smollm2-rope1-staged-vote-table-lanes",
                              "q4-8b-rope-staged-vote-table-chains2", "q4-8b-rope-staged-vote-table-fold",
                              "q3-smollm2-rope1-staged-vote-table-lanes-fold", "q4-8b-rope-staged-vote-table-skip",
                              "q4-8b-rope-staged-vote-vpad-table-skip", "q4-8b-rope-staged-vote-vpad-table-fold",
                              "q4-8b-rope4-staged-vote-vpad-table-fold"])
def test_gluon_kernel_compiles_for_hopper(case, compile_in_child):
    """The Gluon kernel compiles for sm_90 without a GPU (in a child process: this module runs Triton
    in its interpreter, which Gluon lacks). Its layout conversions are asserted trivial at compile
    time, so a wrong operand layout fails here; its lookups come from shared memory, its products
    from mma.sync, and at the default 128 registers ptxas spills nothing for the shapes it runs
    (head_dim x padded group <= GLUON_MAX_ACC; q4-64x16 is at that limit). The rotary-offset term
    (``KernelConfig.gluon_rope``) compiles at the 16 warps it runs on; the staged variants
    (``KernelConfig.gluon_stages``) issue cp.async, and the kernel's shared memory is exactly the
    pair tables and the staging buffer (``smem_offsets``: inline PTX addresses them, so no Triton
    scratch may lie in their bytes). The ``-vote`` cases: the lazy max by a warp vote
    (``KernelConfig.gluon_vote``); ``-vpad``: V's staged row pairs padded (``KernelConfig.gluon_v_pad``);
    ``-bulk``: the staged copies by the copy engine (``KernelConfig.gluon_bulk_copy``);
    ``-align``: the copies in whole 128-byte lines (``KernelConfig.gluon_copy_align``); ``-hoist``: the
    rotary term's coefficients made before the page loop (``KernelConfig.gluon_rope_hoist``); ``-table``:
    the rotary term from tables in shared memory (``KernelConfig.gluon_rope_table``, 16-byte records and
    fragments: ld.shared.v4 on every path), counted in the kernel's shared memory; ``-pos``: the pages'
    cos and sin copied into their slots (``KernelConfig.gluon_rope_pos``: 8-byte cp.async, no phase
    computed); ``-lanes``: written there by the warp, a value a lane (``KernelConfig.gluon_rope_lanes``:
    the phase computed, no 8-byte copy; 3 chunks: the stores of the fourth masked off); ``-chains2``: the
    table form's products in two chains (``KernelConfig.gluon_rope_chains``); ``-fold``: Q in the
    padding columns (``KernelConfig.gluon_rope_fold``: a warp shuffle folds the columns back); ``-skip``:
    no records loaded for the padding columns (``KernelConfig.gluon_rope_skip_pad``: predicated loads);
    ``-vpad-table-fold``: the compact default's launch with the rotary term at groups up to 4
    (``gluon_rope_v_pad``, ``gluon_rope_fold``), ``-vpad-table-skip`` at groups of 5-7."""
    stdout = compile_in_child(_COMPILE_GLUON, *case, timeout=600)
    rope = str(case[4] > 0)
    out = stdout.split()
    # staged words of a 128-wide head are read four at a time (ld.shared.v4)
    v4 = str((case[5] > 0 and case[2] >= 128) or case[11:12] == (1,))
    assert out[-24:-11] == ["cp.async", str(case[5] > 0), "shared", "True",
                           "lds", "True", "mma", "True", "cos", rope, "v4", v4, "spills"], stdout
    pos, lanes = case[12:13] == (1,), case[13:14] == (1,)
    assert out[-10:-8] == ["cp8", str(pos)], stdout
    if case[11:12] == (1,) and case[4] > 0:  # from tables: the page phase's product, or the pages' cos and sin
        assert out[-8:-6] == ["mulhi", str(not pos)], stdout
    assert out[-6:-4] == ["lanes", str(lanes)], stdout
    assert out[-4:-2] == ["fold", str(case[15:16] == (1,))], stdout
    assert out[-2:] == ["skip", str(case[16:17] == (1,))], stdout
    # with the rotary term ptxas spills a few words at 16 warps (4-32 bytes; 80 for q4 on the register
    # path since width 4 is nibble rows and the softmax mass is kept per thread; none staged, the
    # default; measured faster on the H200 than 8 warps without spills for q4, BENCHMARKS.md); none
    # otherwise
    assert int(out[-11]) <= (96 if case[4] else 0), stdout


_COMPILE_TRITON = """
import sys
from weightszip.kernels.paged_decode import DEFAULT_CONFIGS, PAGE_COMPACT, _paged_split_kernel
from weightszip.kernels.paged_decode_gluon import compile_for_hopper

kb, vb, mode = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cfg = DEFAULT_CONFIGS[PAGE_COMPACT]
cuda = mode == "cuda-dot"
const = dict(GROUP=4, BLOCK_G=16, HEAD_DIM=128, BLOCK_SIZE=16, BLOCK_N=32 if cuda else cfg.block_n, PAGE_TYPE=2,
             HAS_BIAS=True, BITS_K=kb, BITS_V=vb, CUDA_DOT=cuda, REG_LUT=mode == "registers",
             PAIRS_K=mode == "pairs", PAIRS_V=mode == "pairs")
cb = "*bf16" if cuda else "*i32"
ptrs = {"q_ptr": "*fp32", "k_pages_ptr": "*u8", "v_pages_ptr": "*u8", "ws_m_ptr": "*fp32", "ws_l_ptr": "*fp32",
        "ws_acc_ptr": "*fp32", "k_cb_ptr": cb, "v_cb_ptr": cb}
k, spills = compile_for_hopper(_paged_split_kernel, const, ptrs, cfg.num_warps, num_stages=cfg.num_stages)
print("mma", "mma.sync.aligned.m16n8k16" in k.asm["ptx"], "spills", spills)
"""


@pytest.mark.parametrize("case", [(4, 4, "pairs"), (4, 3, "pairs"), (3, 3, "pairs"), (2, 2, "registers"),
                                  (4, 4, "cuda-dot")],
                         ids=["q4-pairs", "q3.5-pairs", "q3-pairs", "k2v2-registers", "q4-cuda-dot"])
def test_triton_compact_kernel_compiles_for_hopper(case, compile_in_child):
    """The Triton split kernel compiles for sm_90 without a GPU at the widths and lookups it runs with
    (width 4 reads nibble rows, the others bit planes). The interpreter runs what the compiler may
    refuse (an early ``return`` under a constexpr ``if`` did, on the H200 only), so the compiled
    build is checked here too: tensor-core products where asked, and on them no spills (the CUDA-core
    products, 6-11x slower and never the default, spill at any width)."""
    out = compile_in_child(_COMPILE_TRITON, *case, timeout=600).split()
    assert out[-4:-1] == ["mma", str(case[2] != "cuda-dot"), "spills"], out
    assert case[2] == "cuda-dot" or out[-1] == "0", out
