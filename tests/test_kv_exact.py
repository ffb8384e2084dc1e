"""KV Exact: the page format (reference encoder and validating decoder), the attention kernel's tile
loader and decode attention (bit-identical to the same kernel over bf16 pages), the page heap and the
paged cache. Real KV: tests/data/kv_smollm2_64tok.npy (SmolLM2-135M, 3 layers, 64 tokens, 3 KV heads
of 64), re-used at shifted positions to make longer sequences.

Without a GPU the kernels run in Triton's interpreter (set before triton is imported); on a GPU
(TRITON_INTERPRET=0) the same tests run compiled.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from hypothesis import given, settings, strategies as st  # noqa: E402

from weightszip.errors import (  # noqa: E402
    ChecksumMismatchError,
    CorruptDataError,
    InvalidArgumentError,
    LimitExceededError,
    TruncatedError,
    WeightszipError,
)
from weightszip.kernels import KernelConfig, PagedDecodeAttention, paged_decode_ref  # noqa: E402
from weightszip.kernels import kv_exact_ref as R  # noqa: E402
from weightszip.kernels import kv_exact4_ref as R4  # noqa: E402
from weightszip import kv_exact as kvx  # noqa: E402
from weightszip.kernels.paged_decode import dequantize_exact4_pages, dequantize_exact_pages  # noqa: E402
from weightszip.kv_exact import (  # noqa: E402
    KVExactCache,
    PageHeap,
    calibrate_bases,
    cpu_calibrate_bases,
    cpu_decode_pages,
    cpu_encode_pages,
)

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"
DATA = pathlib.Path(__file__).parent / "data"
H, D, HQ = 3, 64, 9
CFG = KernelConfig(block_n=32, num_warps=4, num_stages=1, waves=1, min_split_tokens=32)


@pytest.fixture(scope="module")
def real():
    """int16 bits [2 (K, V), 3 layers, 64 tokens, 3, 64] of real SmolLM2 KV."""
    meta = json.loads((DATA / "kv_smollm2_64tok.json").read_text())
    assert meta["num_kv_heads"] == H and meta["head_dim"] == D
    a = np.load(DATA / "kv_smollm2_64tok.npy")
    return torch.from_numpy(a.astype(np.int16)).reshape(2, 3, 64, H, D)


def tokens(real, kind, layer, pos, seq=0):
    """Real tokens at shifted positions (a longer sequence made of the 64 real ones)."""
    return real[kind, layer, (pos * 7 + seq * 3) % 64]


def pages_of(x):
    return x.reshape(-1, 16, *x.shape[1:])


# -- format ------------------------------------------------------------------------------------------


def test_roundtrip_real_kv_and_ratio(real):
    for layer in range(3):
        for kind in range(2):
            x = real[kind, layer]
            bases = R.calibrate_bases(x[:32].reshape(32, -1)).reshape(H, D)  # calibrated on other tokens
            buf, offs = R.encode_pages(pages_of(x), bases).to_bytes()
            assert torch.equal(R.decode_pages(buf, offs, bases, H, D), pages_of(x))
            ratio = buf.numel() / (x.numel() * 2)
            # 3-bit codes + raw byte = 11/16 = 0.6875, plus escapes and the header
            assert 0.6875 < ratio < 0.75, ratio


def test_every_bit_pattern_roundtrips():
    """All 65536 bf16 patterns (NaN, Inf, -0, subnormals) through the format, with any bases."""
    allbits = torch.arange(65536, dtype=torch.int32).to(torch.int16).reshape(-1, 16, 2, 32)
    for seed in range(3):
        bases = torch.randint(0, 256, (2, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        buf, offs = R.encode_pages(allbits, bases).to_bytes()
        assert torch.equal(R.decode_pages(buf, offs, bases, 2, 32), allbits)


def test_bases_choose_the_densest_window():
    e = torch.tensor([120] * 5 + [121] * 5 + [126] * 3 + [100] * 4)  # window [120, 126] holds 13
    x = (e << 7).to(torch.int16)[:, None].repeat(1, 32)
    assert R.calibrate_bases(x).tolist() == [126] * 32
    # calibrated bases make fewer escapes than arbitrary ones
    codes = R.codes_of(x.to(torch.int32) & 0xFFFF, R.calibrate_bases(x))
    assert int((codes == R.ESCAPE).sum()) == 4 * 32


def test_page_layout_by_hand():
    """One page, one head of 32 channels, every value 1.0 (exponent 127) but token 3, channel 5
    = 2**-40 (an escape) and token 0, channel 9 = -1.5."""
    x = torch.full((1, 16, 1, 32), 0x3F80, dtype=torch.int16)
    x[0, 3, 0, 5] = 0x2B80  # 2**-40: exponent 87
    x[0, 0, 0, 9] = torch.tensor(0xBFC0, dtype=torch.int32).to(torch.int16)  # -1.5
    bases = torch.full((1, 32), 127, dtype=torch.uint8)
    buf, offs = R.encode_pages(x, bases).to_bytes()
    b = buf.tolist()
    hdr = R.header_bytes(1)
    assert hdr == 16 and len(b) == offs[1] == 16 * ((hdr + 22 * 32 + 1 + 15) // 16)
    assert b[0:8] == [hdr + 704 & 0xFF, (hdr + 704) >> 8, 0, 0, (hdr + 705) & 0xFF, (hdr + 705) >> 8, 0, 0]
    planes = np.array(b[hdr: hdr + 192]).reshape(3, 16, 4)
    # code 7 at token 3, channel 5 (byte 0, bit 5) in all three planes; code 0 elsewhere
    want = np.zeros((3, 16, 4), dtype=np.int64)
    want[:, 3, 0] = 1 << 5
    assert (planes == want).all()
    raw = np.array(b[hdr + 192: hdr + 192 + 512]).reshape(16, 32)
    assert raw[0, 9] == 0x80 | 0x40 and raw[3, 5] == 0 and raw[1, 1] == 0
    assert b[hdr + 704] == 87 and set(b[hdr + 705:]) <= {0}


def test_rust_codec_writes_and_reads_the_reference_bytes(real):
    """The Rust codec (CPU) and the PyTorch reference (the GPU write path) write the same bytes,
    and each decodes the other's; the window tops are chosen alike."""
    allbits = torch.arange(65536, dtype=torch.int32).to(torch.int16).reshape(-1, 16, 2, 32)
    cases = [(pages_of(real[k, layer]), R.calibrate_bases(real[k, 0].reshape(64, -1)).reshape(H, D))
             for k in range(2) for layer in range(3)]
    cases.append((allbits, torch.full((2, 32), 130, dtype=torch.uint8)))
    for pages, bases in cases:
        h, d = pages.shape[2:]
        buf, offs = R.encode_pages(pages, bases).to_bytes()
        rbuf, roffs = cpu_encode_pages(pages, bases)
        assert rbuf == bytes(buf.numpy()) and (roffs == offs.numpy()).all()
        assert (cpu_decode_pages(rbuf, roffs, bases, h, d) == pages.numpy().view(np.uint16)).all()
        x = pages.reshape(-1, h * d)
        assert (cpu_calibrate_bases(x) == R.calibrate_bases(x).numpy()).all()


def test_rust_decoder_rejects_damage(real):
    buf, offs, bases = _one_page(real)
    raw = bytes(buf.numpy())
    with pytest.raises(WeightszipError):
        cpu_decode_pages(raw[:-16], offs.numpy(), bases, H, D)
    with pytest.raises(WeightszipError):
        cpu_decode_pages(raw, [0, -5, len(raw)], bases, H, D)
    bad = bytearray(raw)
    bad[0] ^= 1
    with pytest.raises(CorruptDataError):
        cpu_decode_pages(bytes(bad), offs.numpy(), bases, H, D)
    with pytest.raises(WeightszipError):
        cpu_decode_pages(raw, offs.numpy(), bases, H, 48)
    # offsets past the buffer's end in the middle: the reference's class (CorruptDataError: they
    # decrease after it), checked before any page (the first one here is 16 bytes, truncated)
    two = raw + raw
    for hostile, cls in (([0, 16, 1 << 20, len(two)], CorruptDataError), ([0, -16, len(two)], CorruptDataError),
                         ([-16, 16, len(two)], TruncatedError), ([0, 16, len(two) + 16], TruncatedError)):
        with pytest.raises(WeightszipError) as ref_err:
            R.decode_pages(torch.frombuffer(bytearray(two), dtype=torch.uint8), torch.tensor(hostile), bases, H, D)
        with pytest.raises(WeightszipError) as rust_err:
            cpu_decode_pages(two, hostile, bases, H, D)
        assert ref_err.type is cls and rust_err.type is cls, (hostile, ref_err.type, rust_err.type)


# -- hostile pages -----------------------------------------------------------------------------------


def _one_page(real):
    bases = R.calibrate_bases(real[0, 1].reshape(64, -1)).reshape(H, D)
    buf, offs = R.encode_pages(pages_of(real[0, 1])[:2], bases).to_bytes()
    return buf, offs, bases


def test_truncated_and_corrupt_pages_raise_typed_errors(real):
    buf, offs, bases = _one_page(real)
    with pytest.raises(WeightszipError):  # cut at the end
        R.decode_pages(buf[:-16], offs, bases, H, D)
    short = offs.clone()
    short[-1] -= 16
    with pytest.raises(WeightszipError):
        R.decode_pages(buf[:-16], short, bases, H, D)
    bad = buf.clone()
    bad[0] ^= 1  # first exception offset
    with pytest.raises(CorruptDataError):
        R.decode_pages(bad, offs, bases, H, D)
    bad = buf.clone()
    bad[R.header_bytes(H)] ^= 1  # a code bit: the escape count no longer matches, or decodes another value
    try:
        out = R.decode_pages(bad, offs, bases, H, D)
        assert not torch.equal(out, pages_of(real[0, 1])[:2])
    except CorruptDataError:
        pass
    with pytest.raises(InvalidArgumentError):
        R.decode_pages(buf, offs, bases, H, 48)


def _damaged(data, buf, offs, random_page):
    """Pages ``buf``/``offs`` damaged as hypothesis draws: bits flipped, cut short, replaced by
    ``random_page(n_random_bytes)`` (a page of random bytes, shaped as the format wants), or read at
    hostile offsets. Returns (bytes, offsets)."""
    kind = data.draw(st.sampled_from(["flip", "cut", "random", "offsets"]))
    if kind == "flip":
        bad = buf.clone()
        for i in data.draw(st.lists(st.integers(0, buf.numel() - 1), min_size=1, max_size=8)):
            bad[i] ^= 1 << data.draw(st.integers(0, 7))
        return bad, offs
    if kind == "cut":  # the buffer cut short, the offsets cut with it (or not)
        n = data.draw(st.integers(0, buf.numel() - 1))
        return buf[:n].clone(), offs.clamp(max=n) if data.draw(st.booleans()) else offs
    if kind == "random":
        rng = np.random.default_rng(data.draw(st.integers(0, 2**63 - 1)))
        bad = random_page(lambda n: torch.from_numpy(np.frombuffer(rng.bytes(n), np.uint8).copy()))
        return bad, torch.tensor([0, bad.numel()])
    # hostile offsets: anywhere in int64 (sums of them wrap), between the buffer's true ends or not
    inner = data.draw(st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(-64, buf.numel() + 64), max_size=4))
    ends = [0, *inner, buf.numel()] if data.draw(st.booleans()) else inner or [0]
    return buf, torch.tensor(ends, dtype=torch.int64)


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_fuzz_damaged_pages_never_crash(real, data):
    buf, offs, bases = _one_page(real)
    bad, o = _damaged(data, buf, offs, lambda rand: rand(data.draw(st.integers(0, 3)) * 16 + R.fixed_bytes(H, D)))
    try:
        rust = cpu_decode_pages(bytes(bad.numpy()), o.numpy(), bases, H, D)
    except WeightszipError as e:
        rust = e
    try:
        out = R.decode_pages(bad, o, bases, H, D)
    except WeightszipError as e:
        # both decoders reject the same pages, with the same class (Truncated or Corrupt): the Rust
        # decoder checks the reference's rules in its order, each over every page
        assert type(rust) is type(e), (rust, e)
        return
    assert not isinstance(rust, WeightszipError), rust
    assert rust is not None and (rust == out.numpy().view(np.uint16)).all()
    # a page that passes validation re-encodes to the same bytes (the format is canonical)
    b2, o2 = R.encode_pages(out.view(torch.int16), bases).to_bytes()
    assert torch.equal(b2, bad) and torch.equal(o2, o.to(torch.int64))


# -- kernel tile loader and attention ----------------------------------------------------------------


@pytest.mark.parametrize("shape", ["real-3x64", "random-8x128", "random-1x32"])
def test_write_kernel_bytes_equal_the_reference(real, shape):
    """The GPU write path (kv_exact_write: sizes pass, then every byte) writes the reference
    encoder's pages byte for byte at scattered offsets, and nothing between them: real SmolLM2 KV
    (3 heads x 64), random bit patterns (escapes everywhere) at 8 x 128 and 1 x 32."""
    from weightszip.kernels.kv_exact_write import page_counts, write_pages

    g = torch.Generator().manual_seed(len(shape))
    if shape == "real-3x64":
        vals = pages_of(real[1, 2])  # V of layer 2: [4, 16, 3, 64]
        bases = R.calibrate_bases(real[1, 2, :32].reshape(32, -1)).reshape(H, D)
    else:
        h, d = (8, 128) if shape == "random-8x128" else (1, 32)
        vals = torch.randint(-(2**15), 2**15, (5, 16, h, d), generator=g, dtype=torch.int32).to(torch.int16)
        vals[0] = vals[0] & 0x3FFF  # a page with few escapes beside the noisy ones
        bases = torch.randint(0, 256, (h, d), generator=g, dtype=torch.int32).to(torch.uint8)
    vals, bases = vals.to(DEVICE), bases.to(DEVICE)
    enc = R.encode_pages(vals, bases)
    counts, lengths = page_counts(vals, bases)
    assert torch.equal(counts.cpu(), enc.counts.cpu()) and torch.equal(lengths.cpu(), enc.lengths.cpu())
    gaps = torch.randint(1, 4, (len(enc),), generator=g) * 16
    offsets = (torch.cumsum(lengths.cpu() + gaps, 0) - lengths.cpu()).to(DEVICE)
    size = int(offsets[-1] + lengths[-1]) + 32
    want = torch.full((size,), 0xAB, dtype=torch.uint8, device=DEVICE)
    got = want.clone()
    enc.write(want, offsets)
    write_pages(vals, bases, counts, offsets, got)
    assert torch.equal(got, want)
    buf, offs = R.encode_pages(vals, bases).to_bytes()  # and the pages decode
    assert torch.equal(R.decode_pages(buf, offs, bases, vals.shape[2], vals.shape[3]), vals)
    with pytest.raises(InvalidArgumentError):
        write_pages(vals, bases, counts[:-1].contiguous(), offsets, got)
    with pytest.raises(InvalidArgumentError):
        page_counts(vals.float(), bases)


def test_kernel_tile_loader_equals_reference(real):
    allbits = torch.arange(65536, dtype=torch.int32).to(torch.int16).reshape(-1, 16, 2, 32)[:8]
    cases = [(pages_of(real[1, 2]), R.calibrate_bases(real[1, 0].reshape(64, -1)).reshape(H, D)),
             (allbits, torch.full((2, 32), 120, dtype=torch.uint8))]
    for pages, bases in cases:
        enc = R.encode_pages(pages, bases)
        n = len(enc)
        # scattered, out of order, with gaps
        offs = torch.tensor([(n - i) * 8192 + 48 * i for i in range(n)], dtype=torch.int64)
        heap = torch.full((int(offs.max()) + 8192,), 0xAB, dtype=torch.uint8)
        enc.write(heap, offs)
        for npt in (1, 2, 4):  # pages per tile, as the attention kernel's block_n / 16
            got = dequantize_exact_pages(heap.to(DEVICE), offs.to(DEVICE), bases.to(DEVICE), *pages.shape[2:],
                                         pages_per_tile=npt).cpu()
            assert torch.equal(got, pages), npt
        assert torch.equal(R.decode_heap_pages(heap, offs, bases, *pages.shape[2:]), pages)


def _paged_pair(real, lens, seed=0, ref=R, tiny=False):
    """bf16 pages in a shuffled pool and the same pages as KV Exact pages (``ref``: kv_exact_ref, or
    kv_exact4_ref for KV Exact4) in a heap; ring side buffers (heads and head_dim from ``real``'s
    last two dimensions). ``tiny``: every 7th token's channel 5 of head 0 set to 2**-60 in K and V
    (KV Exact4 stores those rows plain)."""
    H, D = real.shape[-2:]
    g = torch.Generator().manual_seed(seed)
    B = len(lens)
    per = [-(-L // 16) for L in lens]
    nb = sum(per) + 2
    perm = torch.randperm(nb, generator=g)
    bt = torch.zeros((B, max(per)), dtype=torch.int32)
    kp = torch.zeros((nb, H, 16, D), dtype=torch.int16)
    vp = torch.zeros_like(kp)
    side = torch.zeros((2, B, 16, H, D), dtype=torch.int16)
    i = 0
    for b, L in enumerate(lens):
        pos = torch.arange(L)
        kk, vv = tokens(real, 0, 1, pos, b), tokens(real, 1, 1, pos, b)
        if tiny:
            kk, vv = kk.clone(), vv.clone()
            kk[::7, 0, 5] = vv[::7, 0, 5] = 0x2180  # 2**-60: exponent 67, far below its channel's values
        for j in range(per[b]):
            blk = int(perm[i])
            i += 1
            bt[b, j] = blk
            n = min(16, L - 16 * j)
            kp[blk, :, :n] = kk[16 * j: 16 * j + n].transpose(0, 1)
            vp[blk, :, :n] = vv[16 * j: 16 * j + n].transpose(0, 1)
        for p in range(max(0, L - 16), L):
            side[0, b, p % 16], side[1, b, p % 16] = kk[p], vv[p]
    if ref is R:
        kb = R.calibrate_bases(real[0, 0].reshape(64, -1)).reshape(H, D)
        vb = R.calibrate_bases(real[1, 0].reshape(64, -1)).reshape(H, D)
        ke, ve = R.encode_pages(kp.transpose(1, 2), kb), R.encode_pages(vp.transpose(1, 2), vb)
    else:  # KV Exact4 pages hold their own window tops
        kb = vb = None
        ke, ve = ref.encode_pages(kp.transpose(1, 2)), ref.encode_pages(vp.transpose(1, 2))
    koff = torch.nn.functional.pad(ke.lengths.cumsum(0), (1, 0))[:-1] + 16
    voff = int(koff[-1] + ke.lengths[-1]) + torch.nn.functional.pad(ve.lengths.cumsum(0), (1, 0))[:-1]
    heap = torch.zeros(int(voff[-1] + ve.lengths[-1]) + 16, dtype=torch.uint8)
    ke.write(heap, koff)
    ve.write(heap, voff)
    q = torch.randn((B, HQ, D), generator=g).to(torch.bfloat16)
    to = (lambda t: t.to(DEVICE))
    bf = lambda t: to(t.view(torch.bfloat16))  # noqa: E731
    return dict(q=to(q), bt=to(bt), kp=bf(kp), vp=bf(vp), ks=bf(side[0]), vs=bf(side[1]), heap=to(heap),
                koff=to(koff), voff=to(voff), kb=kb if kb is None else to(kb), vb=vb if vb is None else to(vb))


@pytest.mark.parametrize("lens,split", [([150, 40, 97], 64), ([33], None), ([16, 17, 300], 32)])
def test_attention_bit_identical_to_bf16_pages(real, lens, split):
    """KV Exact pages give the output of the same kernel over the uncompressed bf16 pages bit for
    bit (compiled, both take the same tensor-core operand layouts: the test below)."""
    _exact_equals_bf16_pages(real, lens, split)


@pytest.mark.skipif(DEVICE != "cuda", reason="the operand layouts matter only compiled (the interpreter has none)")
def test_attention_bit_identical_to_bf16_pages_head_dim_128(real):
    """The same at head_dim 128 (Llama's), where the compiled kernels once differed in the last bits
    of 0.2-0.3% of the outputs: real KV widened to 128 channels (each head's 64 channels and those
    of the next token), the default config of exact pages."""
    from weightszip.kernels import DEFAULT_CONFIGS
    from weightszip.kernels.paged_decode import PAGE_EXACT

    wide = torch.cat([real, real.roll(1, dims=2)], dim=-1)
    _exact_equals_bf16_pages(wide, [1000, 4100, 300, 2048], None, DEFAULT_CONFIGS[PAGE_EXACT])


def _exact_equals_bf16_pages(real, lens, split, cfg=CFG, page_type="exact", tiny=False):
    H, D = real.shape[-2:]
    c = _paged_pair(real, lens, ref=R if page_type == "exact" else R4, tiny=tiny)
    outs = {}
    for pt in ("bf16", page_type):
        att = PagedDecodeAttention(HQ, H, D, page_type=pt, window=16, config=cfg, device=DEVICE)
        att.plan(lens, c["bt"], split_tokens=split)
        if pt == page_type:
            outs["exact"] = att.run(c["q"], c["heap"], c["heap"], k_side=c["ks"], v_side=c["vs"],
                                    k_offsets=c["koff"], v_offsets=c["voff"], k_bases=c["kb"], v_bases=c["vb"])
        else:
            outs[pt] = att.run(c["q"], c["kp"], c["vp"], k_side=c["ks"], v_side=c["vs"])
        # a config asking for the Gluon kernel gets it on the GPU (both page types), else the Triton one
        assert att.last_split_kernel == ("gluon_exact4" if cfg.gluon and DEVICE == "cuda" else "triton")
    assert torch.equal(outs["bf16"], outs["exact"])
    # and both are attention: against the fp64 reference
    ref = paged_decode_ref(c["q"].cpu(), c["kp"].cpu(), c["vp"].cpu(), c["bt"].cpu(), lens, window=16,
                           k_side=c["ks"].cpu(), v_side=c["vs"].cpu())
    vmax = float(c["vp"].float().abs().max())
    assert (outs["exact"].cpu().double() - ref).abs().max() <= 2**-8 * vmax + 2**-8 * ref.abs().max()


_COMPILE_OPERANDS = """
import re
from weightszip.kernels.paged_decode import DEFAULT_CONFIGS, PAGE_EXACT, _paged_split_kernel
from weightszip.kernels.paged_decode_gluon import compile_for_hopper

cfg = DEFAULT_CONFIGS[PAGE_EXACT]
for d, group in ((128, 4), (64, 3)):
    for page_type, pages in ((0, "*bf16"), (3, "*u8"), (4, "*u8")):
        const = dict(GROUP=group, BLOCK_G=16, HEAD_DIM=d, BLOCK_SIZE=16, BLOCK_N=cfg.block_n, PAGE_TYPE=page_type,
                     HAS_BIAS=False, BITS_K=4, BITS_V=4, CUDA_DOT=False, FAST_TRIG=page_type >= 3)
        ptrs = {"q_ptr": "*bf16", "k_pages_ptr": pages, "v_pages_ptr": pages, "ws_m_ptr": "*fp32", "ws_l_ptr": "*fp32",
                "ws_acc_ptr": "*fp32", "k_off_ptr": "*i64", "v_off_ptr": "*i64", "k_cb_ptr": "*u8", "v_cb_ptr": "*u8"}
        k, _ = compile_for_hopper(_paged_split_kernel, const, ptrs, cfg.num_warps, num_stages=cfg.num_stages)
        dots = re.findall(r"= tt\\.dot .*", k.asm["ttgir"])
        print(d, page_type, len(dots), "|".join(sorted(set(re.findall(r"#ttg\\.dot_op<[^>]*>", " ".join(dots))))))
"""


def test_compiled_exact_tiles_feed_the_tensor_cores_as_bf16_pages_do(compile_in_child):
    """Compiled for sm_90 (a child process, without a GPU), the KV Exact and KV Exact4 kernels' two
    products take the tensor-core operand layouts of the same kernel over bf16 pages: Triton picks the layout's k
    grouping (kWidth) from the narrowest load behind an operand, here the pages' uint8 raw bytes,
    which gave the exact tiles a different k order inside each mma.sync and so different fp32
    roundings on the H200 (BENCHMARKS.md, "KV Exact"); ``_exact_decode`` hides them behind a copy."""
    out = compile_in_child(_COMPILE_OPERANDS)
    rows = [line.split(maxsplit=3) for line in out.splitlines() if line[:1].isdigit()]
    assert len(rows) == 6, out
    got = {(int(d), int(pt)): (n, ops) for d, pt, n, ops in rows}
    for d in (128, 64):
        assert got[(d, 3)] == got[(d, 0)], got  # KV Exact
        assert got[(d, 4)] == got[(d, 0)], got  # KV Exact4 (its decoder's joins would halve the width)
        assert got[(d, 0)][0] == "2" and "kWidth = 2" in got[(d, 0)][1], got


def test_attention_argument_checks(real):
    c = _paged_pair(real, [40])
    att = PagedDecodeAttention(HQ, H, D, page_type="exact", window=16, config=CFG, device=DEVICE)
    att.plan([40], c["bt"])
    with pytest.raises(InvalidArgumentError):
        att.run(c["q"], c["heap"], c["heap"], k_side=c["ks"], v_side=c["vs"])  # no offsets/bases
    with pytest.raises(InvalidArgumentError):
        att.run(c["q"], c["heap"], c["heap"], k_side=c["ks"], v_side=c["vs"], k_offsets=c["koff"][:1],
                v_offsets=c["voff"], k_bases=c["kb"], v_bases=c["vb"])
    with pytest.raises(InvalidArgumentError):
        PagedDecodeAttention(HQ, H, D, page_type="exact", block_size=32, device=DEVICE)


@pytest.mark.parametrize("page_format", ["exact", "exact4"])
def test_attention_refuses_a_strided_heap(real, page_format):
    """The kernels read a page at heap + byte offset, not through the tensor's stride: a 1-D heap view
    with a stride is refused, by run() and by the tile-loader helpers (a view equal to the heap value
    for value gave NaN, or read past the pages). Here the raw bytes under the view are the heap, so the
    old code ran without a crash and without an error."""
    exact4 = page_format == "exact4"
    c = _paged_pair(real, [40], ref=R4 if exact4 else R)
    n = c["heap"].numel()
    big = torch.zeros(2 * n, dtype=torch.uint8, device=DEVICE)
    big[:n] = c["heap"]
    heap = big[::2]
    assert heap.dim() == 1 and not heap.is_contiguous()
    att = PagedDecodeAttention(HQ, H, D, page_type=page_format, window=16, config=CFG, device=DEVICE)
    att.plan([40], c["bt"])
    bases = {} if exact4 else {"k_bases": c["kb"], "v_bases": c["vb"]}
    with pytest.raises(InvalidArgumentError, match="contiguous 1-D uint8 page heap"):
        att.run(c["q"], heap, heap, k_side=c["ks"], v_side=c["vs"], k_offsets=c["koff"], v_offsets=c["voff"],
                **bases)
    with pytest.raises(InvalidArgumentError, match="contiguous"):
        if exact4:
            dequantize_exact4_pages(heap, c["koff"], H, D)
        else:
            dequantize_exact_pages(heap, c["koff"], c["kb"], H, D)


# -- heap and cache ----------------------------------------------------------------------------------


def test_page_heap_reuse_split_and_full():
    h = PageHeap(1024, device="cpu")
    a = h.alloc([256, 256, 128])
    assert a.tolist() == [0, 256, 512] and h.used == 640
    h.free(a[1:2], [256])
    assert h.alloc([256]).tolist() == [256]  # exact-size reuse
    h.free(a[1:2], [256])
    b = h.alloc([128, 128])  # the 256 hole is split
    assert sorted(b.tolist()) == [256, 384] or 640 in b.tolist()
    with pytest.raises(LimitExceededError):
        h.alloc([512, 512])
    before = h.stats()
    with pytest.raises(LimitExceededError):
        h.alloc([16, 4096])  # all or none
    assert h.stats() == before
    with pytest.raises(InvalidArgumentError):
        h.alloc([24])
    big = PageHeap(1024, device="cpu")  # a batch whose int64 sum wraps to 64 bytes: refused, no state change
    with pytest.raises(LimitExceededError):
        big.alloc([1 << 62] * 4 + [64] * 70)
    assert big.used == 0 and big.top == 0


def test_page_heap_refuses_what_it_did_not_hand_out():
    """free/release take back only regions alloc handed out and not yet freed, as they were handed
    out: a double free (which listed the region twice, so two later allocations overlapped), a region
    never handed out or past the heap, a misaligned one, a part of one, one of the wrong size, the same
    region twice in one call and mismatched lengths are InvalidArgumentError, the heap as before and
    the other regions of the call still live. alloc takes a scalar size and refuses non-integers."""
    h = PageHeap(1024, device="cpu")
    a = h.alloc([32, 32, 32])
    h.free(a[:1], [32])

    def refused(offsets, sizes):
        before = h.stats()
        with pytest.raises(InvalidArgumentError):
            h.free(offsets, sizes)
        assert h.stats() == before

    refused(a[:1], [32])  # double free
    refused([4096], [16])  # past the heap: never handed out
    refused([40], [16])  # misaligned, inside a live region
    refused([32], [16])  # the first half of a live region
    refused([48], [16])  # the second half
    refused([32], [64])  # the wrong size
    refused([32, 32], [32, 32])  # twice in one call
    refused([32, 64, 0], [32, 32, 32])  # one freed region among live ones: none goes back
    refused([32, 64], [32])  # lengths differ (an IndexError before)
    refused([32.0], [32])  # not integers
    refused([32], [0])
    assert h.used == 64
    assert h.alloc([32]).tolist() == [0]  # the freed region, once
    assert h.alloc([32]).tolist() == [96]
    h.free([32, 64, 0, 96], [32, 32, 32, 32])
    assert h.used == 0 and h.top == 0
    r = h.runs([], [])
    h.release(r)
    # alloc: a scalar size gives one offset; sizes that are not integers are refused (16.9 was 16)
    assert h.alloc(16).tolist() == [0]
    for bad in ([16.9], np.array([16.0]), [[16]], ["16"]):
        with pytest.raises(InvalidArgumentError):
            h.alloc(bad)
    assert h.used == 16 and h.top == 16


def test_page_heap_release_rechecks_a_stale_plan():
    """runs() checks the regions when it runs; release() of a plan made before the heap changed checks
    them again: a plan released twice is refused the second time."""
    h = PageHeap(1 << 16, device="cpu")
    a = h.alloc([16] * 2000)  # one batch: the live arrays
    h.free(a[::2], [16] * 1000)  # 1000 one-region holes
    b = h.alloc([16] * 5)  # into the holes, a small batch: the live dict
    assert set(b.tolist()) <= set(a[::2].tolist())
    plan = h.runs(b[:2], [16, 16])
    h.alloc([16])  # the heap changes after runs()
    h.release(plan)
    with pytest.raises(InvalidArgumentError, match="not allocated"):
        h.release(plan)
    with pytest.raises(InvalidArgumentError, match="not allocated"):
        h.free(b[:1], [16])
    h.free(b[2:], [16, 16, 16])
    with pytest.raises(InvalidArgumentError, match="not allocated"):
        h.free(a[:2], [16, 16])  # a[0] was freed above, a[1] is live: nothing changes
    h.free(a[1:2], [16])


def _run_cache(real, cache, seqs_prompts, steps, g):
    for layer in range(3):
        for s, p in seqs_prompts:
            pos = torch.arange(p)
            cache.append(layer, [s], tokens(real, 0, layer, pos, s)[None].view(torch.bfloat16).to(DEVICE),
                         tokens(real, 1, layer, pos, s)[None].view(torch.bfloat16).to(DEVICE))
    seqs = [s for s, _ in seqs_prompts]
    outs = []
    for _ in range(steps):
        cache.plan(seqs, new_tokens=1)
        for layer in range(3):
            new = [torch.tensor([int(cache.length[layer, s])]) for s in seqs]
            k = torch.stack([tokens(real, 0, layer, p, s) for p, s in zip(new, seqs)]).view(torch.bfloat16)
            v = torch.stack([tokens(real, 1, layer, p, s) for p, s in zip(new, seqs)]).view(torch.bfloat16)
            cache.append(layer, seqs, k.to(DEVICE), v.to(DEVICE))
            q = torch.randn((len(seqs), HQ, D), generator=g).to(torch.bfloat16).to(DEVICE)
            outs.append((layer, q, cache.attend(layer, q)))
    return outs


def _assert_cache_holds(real, cache, seqs):
    """Every layer's K and V of ``seqs`` read back (``dense``) are the tokens ``_run_cache`` wrote."""
    for layer in range(3):
        for s in seqs:
            k, v = cache.dense(layer, s)
            pos = torch.arange(int(cache.length[layer, s]))
            assert torch.equal(k.cpu().view(torch.int16), tokens(real, 0, layer, pos, s))
            assert torch.equal(v.cpu().view(torch.int16), tokens(real, 1, layer, pos, s))


def test_cache_prefill_decode_free_and_reuse(real):
    cache = KVExactCache(layers=3, kv_heads=H, head_dim=D, num_q_heads=HQ, heap_bytes=1 << 20, max_seqs=3,
                         max_tokens=256, device=DEVICE, config=CFG)
    s0, s1 = cache.add_sequence(), cache.add_sequence()
    outs = _run_cache(real, cache, [(s0, 70), (s1, 15)], steps=3, g=torch.Generator().manual_seed(1))
    _assert_cache_holds(real, cache, (s0, s1))
    # the last step's attention equals the bf16 kernel's over the same tokens
    layer, q, out = outs[-1]
    lens = [int(cache.length[layer, s]) for s in (s0, s1)]
    nb = max(-(-L // 16) for L in lens)
    kp = torch.zeros((2 * nb, H, 16, D), dtype=torch.bfloat16, device=DEVICE)
    vp = torch.zeros_like(kp)
    for b, s in enumerate((s0, s1)):
        k, v = cache.dense(layer, s)
        for j in range(-(-lens[b] // 16)):
            n = min(16, lens[b] - 16 * j)
            kp[b * nb + j, :, :n] = k[16 * j: 16 * j + n].transpose(0, 1)
            vp[b * nb + j, :, :n] = v[16 * j: 16 * j + n].transpose(0, 1)
    bt = torch.arange(2 * nb, dtype=torch.int32, device=DEVICE).view(2, nb)
    att = PagedDecodeAttention(HQ, H, D, page_type="bf16", window=16, config=CFG, device=DEVICE)
    att.plan(lens, bt)
    ring = cache.ring[layer][:, torch.as_tensor([s0, s1], device=DEVICE)]
    assert torch.equal(att.run(q, kp, vp, k_side=ring[0], v_side=ring[1]), out)
    st_ = cache.stats()
    assert 0.69 < st_["ratio_vs_bf16"] < 0.75
    used = cache.heap.used
    cache.free_sequence(s0)
    assert cache.heap.used < used
    s2 = cache.add_sequence()
    _run_cache(real, cache, [(s2, 40)], steps=1, g=torch.Generator().manual_seed(2))
    k, _ = cache.dense(2, s2)
    assert torch.equal(k.cpu().view(torch.int16), tokens(real, 0, 2, torch.arange(41), s2))


def test_cache_errors(real):
    cache = KVExactCache(layers=3, kv_heads=H, head_dim=D, num_q_heads=HQ, heap_bytes=8192, max_seqs=1,
                         max_tokens=64, device=DEVICE, config=CFG)
    s = cache.add_sequence()
    with pytest.raises(LimitExceededError):
        cache.add_sequence()
    x = tokens(real, 0, 0, torch.arange(64), 0)[None].view(torch.bfloat16).to(DEVICE)
    with pytest.raises(LimitExceededError):  # 4 pages of ~4.3 KB do not fit 8 KB
        cache.append(0, [s], x, x)
    with pytest.raises(InvalidArgumentError):
        cache.append(0, [s], x[:, :, :2], x[:, :, :2])
    with pytest.raises(InvalidArgumentError):
        cache.attend(0, torch.zeros((1, HQ, D), dtype=torch.bfloat16, device=DEVICE))
    with pytest.raises(InvalidArgumentError):
        cache.free_sequence(5)
    with pytest.raises(InvalidArgumentError):
        cache.append(0, [s, s], x[:, :1].expand(2, 1, H, D), x[:, :1].expand(2, 1, H, D))


def test_cache_checks_layers_and_empty_batches(real):
    """attend and dense refuse a layer out of range (-1 read the last layer, silently), plan([]) is a
    typed error that leaves the plan as it was, and append with no sequences appends nothing (both
    gave an IndexError: the index arrays of an empty list were float)."""
    cache = KVExactCache(layers=2, kv_heads=H, head_dim=D, num_q_heads=HQ, heap_bytes=1 << 16, max_seqs=2,
                         max_tokens=64, device=DEVICE, config=CFG)
    s = cache.add_sequence()
    x = tokens(real, 0, 0, torch.arange(20), 0)[None].view(torch.bfloat16).to(DEVICE)
    for layer in range(2):
        cache.append(layer, [s], x, x)
    cache.plan([s])
    q = torch.randn((1, HQ, D), generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).to(DEVICE)
    for layer in (-1, 2):
        with pytest.raises(InvalidArgumentError, match="out of range"):
            cache.attend(layer, q)
        with pytest.raises(InvalidArgumentError, match="out of range"):
            cache.dense(layer, s)
    planned = cache._planned
    with pytest.raises(InvalidArgumentError, match="at least one sequence"):
        cache.plan([])
    assert cache._planned is planned
    empty = x[:0, :3]
    cache.append(0, [], empty, empty)
    assert cache.length[0, s] == 20
    with pytest.raises(InvalidArgumentError):  # k must still be [0, T, H, D]
        cache.append(0, [], x[:, :3], x[:, :3])
    k, _ = cache.dense(1, s)
    assert torch.equal(k.cpu().view(torch.int16), tokens(real, 0, 0, torch.arange(20), 0))


def test_calibrate_bases_shape(real):
    k = real[0].view(torch.bfloat16)  # [3, 64, H, D]
    b = calibrate_bases(k, real[1].view(torch.bfloat16))
    assert b.shape == (3, 2, H, D) and b.dtype == torch.uint8
    assert torch.equal(b[1, 0].reshape(-1), R.calibrate_bases(real[0, 1].reshape(64, -1)))


# -- generation --------------------------------------------------------------------------------------


@pytest.mark.parametrize("page_format", ["exact", "exact4"])
def test_generation_through_the_cache_matches_bf16_pages(page_format):
    """SmolLM2's first 4 layers (real weights): greedy generation with every decode step's attention
    reading KV Exact (or Exact4) pages gives the tokens and logits of the same kernel over the pages
    decoded to bf16, bit for bit; the prompt (70 tokens) fills 4 pages per layer, the rest sits in
    the ring."""
    import copy

    pytest.importorskip("transformers")
    from weightszip.kv_exact import generate
    from weightszip.models import ModelNotInstalled, load_causal_lm, tokenize_text

    try:
        lm = load_causal_lm(os.environ.get("WEIGHTSZIP_TEST_SMOLLM2", "smollm2"), verbose=False)
    except ModelNotInstalled as e:
        pytest.skip(str(e))
    model = copy.deepcopy(lm.model)
    model.model.layers = model.model.layers[:4]
    model.config.num_hidden_layers = 4
    model = model.to(DEVICE)
    ids, _ = tokenize_text(lm.tokenizer, DATA / "text" / "austen-emma-excerpt.txt", 70)
    a_toks, a_logits, stats = generate(model, ids, 4, config=CFG, page_format=page_format)
    b_toks, b_logits, _ = generate(model, ids, 4, config=CFG, reference=True, page_format=page_format)
    assert a_toks == b_toks
    assert all(torch.equal(x, y) for x, y in zip(a_logits, b_logits))
    lo, hi = (0.69, 0.75) if page_format == "exact" else (0.77, 0.86)
    assert stats["pages"] == 4 * 2 * 4 and lo < stats["ratio_vs_bf16"] < hi


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.lists(st.integers(1, 40), min_size=1, max_size=6)), min_size=1, max_size=60),
       st.sampled_from([256, 2]))
def test_page_heap_regions_never_overlap(ops, bulk_min):
    """Random allocations (1-6 regions of 16..640 bytes at once) and frees (1-6 live regions at once,
    in any order, often neighbours): live regions stay inside the heap and disjoint, ``used`` is their
    total, a failed allocation changes nothing, and freeing everything empties the heap. With
    ``bulk_min`` 2 the batches go through the run placement (``_alloc_runs``) too."""
    h = PageHeap(4096, device="cpu")
    h.bulk_min = bulk_min
    live: dict[int, int] = {}
    for is_alloc, units in ops:
        if is_alloc or not live:
            before = (h.used, h.top, h.stats()["free_listed"])
            try:
                offs = h.alloc([16 * u for u in units])
            except LimitExceededError:
                assert (h.used, h.top, h.stats()["free_listed"]) == before
                continue
            live.update({int(o): 16 * u for o, u in zip(offs, units)})
        else:
            keys = sorted(live)
            pick = list(dict.fromkeys(keys[u % len(keys)] for u in units))
            h.free(pick, [live.pop(o) for o in pick])
        spans = sorted(live.items())
        assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))
        assert all(0 <= a and a + n <= h.capacity for a, n in spans)
        assert h.used == sum(live.values())
    h.free(list(live), list(live.values()))
    assert h.used == 0 and h.top == 0 and h.stats()["free_regions"] == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.lists(st.integers(1, 40), min_size=1, max_size=80)), min_size=1,
                max_size=60), st.sampled_from([64, 1]))
def test_page_heap_refuses_bad_frees_and_keeps_its_books(ops, small_batch):
    """Random allocations, frees of live regions, and frees that must be refused (a freed region again,
    a live region with another size or offset, a live one and a freed one together): the refused ones
    change nothing, the others keep working, and freeing everything empties the heap. Batches of up to
    80 regions: with ``small_batch`` 1 they go into the live arrays, with 64 mostly into the live dict."""
    h = PageHeap(1 << 15, device="cpu")
    h.small_batch = small_batch
    live: dict[int, int] = {}
    freed: dict[int, int] = {}
    for kind, units in ops:
        keys = sorted(live)
        if kind == 0 or not keys:
            try:
                offs = h.alloc([16 * u for u in units])
            except LimitExceededError:
                continue
            for o, u in zip(offs.tolist(), units):
                live[o] = 16 * u
                freed.pop(o, None)
        elif kind == 1:
            pick = list(dict.fromkeys(keys[u % len(keys)] for u in units))
            h.free(pick, [live[o] for o in pick])
            for o in pick:
                freed[o] = live.pop(o)
        else:
            o = keys[units[0] % len(keys)]
            bad = [([o], [live[o] + 16]), ([o + 16], [16]) if live[o] > 16 else ([o + 8], [16])]
            stale = [f for f in freed if f not in live]
            if stale:
                bad.append(([o, stale[0]], [live[o], freed[stale[0]]]))
            before = (h.stats(), len(live))
            for offs, sizes in bad:
                with pytest.raises(InvalidArgumentError):
                    h.free(offs, sizes)
                assert (h.stats(), len(live)) == before
        assert h.used == sum(live.values())
    h.free(list(live), list(live.values()))
    assert h.used == 0 and h.top == 0 and h.stats()["free_regions"] == 0


def _heap_with_hole(bases, hole: bool) -> KVExactCache:
    """An empty 3-layer cache; with ``hole``, its heap lists one free region (a restore then takes the
    staged path on a GPU, not the copy straight into place)."""
    c = KVExactCache(layers=3, kv_heads=H, head_dim=D, num_q_heads=HQ, heap_bytes=1 << 20, max_seqs=1,
                     max_tokens=256, device=DEVICE, config=CFG, bases=bases)
    if hole:
        a = c.heap.alloc([4096, 4096])
        c.heap.free(a[:1], [4096])
        assert c.heap.stats()["free_regions"] == 1
    return c


def test_offload_and_restore_a_sequence(real, monkeypatch):
    """A sequence leaves the cache as its compressed page bytes and comes back (into other heap
    regions and blocks) with the same values and the same attention output."""
    cache = KVExactCache(layers=3, kv_heads=H, head_dim=D, num_q_heads=HQ, heap_bytes=1 << 20, max_seqs=3,
                         max_tokens=256, device=DEVICE, config=CFG)
    s0, s1 = cache.add_sequence(), cache.add_sequence()
    g = torch.Generator().manual_seed(3)
    _run_cache(real, cache, [(s0, 50), (s1, 90)], steps=2, g=g)
    before = [cache.dense(layer, s1) for layer in range(3)]
    q = torch.randn((1, HQ, D), generator=g).to(torch.bfloat16).to(DEVICE)
    cache.plan([s1])
    out_before = cache.attend(2, q)
    from weightszip.offload import HostArena

    with pytest.raises(LimitExceededError):  # an arena without room: nothing changes
        cache.offload_sequence(s1, host=HostArena(100))
    arena = HostArena(1 << 20)
    kept = cache.offload_sequence(s1, free=False, host=arena)  # into the caller's arena, s1 stays
    assert kept.data.data_ptr() == arena.buffer.data_ptr() and arena.used == kept.data.numel()
    off = cache.offload_sequence(s1, chunk_bytes=9000)  # several chunks
    assert torch.equal(off.data, kept.data)
    assert off.data.numel() == int(off.sizes.sum()) and off.nbytes < 0.75 * 92 * 3 * 2 * H * D * 2 + off.ring.numel() * 2
    s2 = cache.add_sequence()  # takes the freed slot and regions first
    _run_cache(real, cache, [(s2, 40)], steps=1, g=g)
    s3 = cache.restore_sequence(off, chunk_bytes=9000)
    for layer in range(3):
        k, v = cache.dense(layer, s3)
        assert torch.equal(k, before[layer][0]) and torch.equal(v, before[layer][1])
    cache.plan([s3])
    assert torch.equal(cache.attend(2, q), out_before)
    staged = []
    real_pipelined = kvx._pipelined
    monkeypatch.setattr(kvx, "_pipelined", lambda *a, **k: staged.append(1) or real_pipelined(*a, **k))
    for hole in (False, True):  # into an empty heap (on a GPU: one copy straight into place), and
        # into one with a free region listed (on a GPU: staged chunks scattered into their regions)
        fresh = _heap_with_hole(off.bases, hole)
        staged.clear()
        s = fresh.restore_sequence(off, chunk_bytes=9000)
        assert len(staged) == (1 if hole and DEVICE == "cuda" else 0)
        for layer in range(3):
            k, v = fresh.dense(layer, s)
            assert torch.equal(k, before[layer][0]) and torch.equal(v, before[layer][1])
    other = KVExactCache(layers=3, kv_heads=H, head_dim=D, num_q_heads=HQ, heap_bytes=1 << 20, max_seqs=1,
                         max_tokens=256, device=DEVICE, config=CFG,
                         bases=torch.full((3, 2, H, D), 120, dtype=torch.uint8))
    with pytest.raises(InvalidArgumentError):
        other.restore_sequence(off)
    full = KVExactCache(layers=3, kv_heads=H, head_dim=D, num_q_heads=HQ, heap_bytes=20000, max_seqs=2,
                        max_tokens=256, device=DEVICE, config=CFG, bases=off.bases)
    with pytest.raises(LimitExceededError):
        full.restore_sequence(off)
    assert full.heap.used == 0 and not full._live


def test_restore_refuses_damaged_sequences(real):
    """An offloaded sequence whose parts disagree, or whose pages were damaged in host memory, is
    refused with a typed error and the cache is left as it was: sizes against lengths and data and
    every page header always; the codes too with ``verify=True``."""
    import dataclasses as dc

    cache = KVExactCache(layers=3, kv_heads=H, head_dim=D, num_q_heads=HQ, heap_bytes=1 << 20, max_seqs=3,
                         max_tokens=256, device=DEVICE, config=CFG)
    s0 = cache.add_sequence()
    g = torch.Generator().manual_seed(5)
    _run_cache(real, cache, [(s0, 70)], steps=1, g=g)
    off = cache.offload_sequence(s0, free=False)
    state = (cache.heap.used, cache.heap.top, sorted(cache._live), cache._calibrated.copy())

    def refused(bad, err, **kw):
        with pytest.raises(err):
            cache.restore_sequence(bad, **kw)
        assert (cache.heap.used, cache.heap.top, sorted(cache._live)) == state[:3]
        assert (cache._calibrated == state[3]).all()

    refused(dc.replace(off, data=off.data[:-16]), InvalidArgumentError)  # truncated
    no_page = off.sizes.copy()
    no_page[1, 0, 2] = 0  # a page missing where layer 1's length says one is
    refused(dc.replace(off, sizes=no_page), InvalidArgumentError)
    odd = off.sizes.copy()
    odd[0, 1, 0] += 8  # not a page size
    refused(dc.replace(off, sizes=odd), InvalidArgumentError)
    refused(dc.replace(off, lengths=off.lengths + 16), InvalidArgumentError)  # more tokens than pages
    wrap = off.sizes.copy()
    wrap[:2, :, 0] += 1 << 62  # four sizes near 2**62: their int64 sum wraps back to the data's length
    refused(dc.replace(off, sizes=wrap), InvalidArgumentError)
    hdr = off.data.clone()
    hdr[4:8] = 0xFF  # layer 0 K page 0: ex[1] far past the page
    refused(dc.replace(off, data=hdr), CorruptDataError)
    codes = off.data.clone()
    first = R.header_bytes(H)
    codes[[first, first + 2 * D, first + 4 * D]] = 0xFF  # 8 codes of token 0 become escapes
    refused(dc.replace(off, data=codes), CorruptDataError, verify=True)
    s1 = cache.restore_sequence(dc.replace(off, data=codes))  # the header alone is consistent: taken
    cache.free_sequence(s1)
    s2 = cache.restore_sequence(off, verify=True)  # the intact sequence passes every check
    for layer in range(3):
        assert all(torch.equal(a, b) for a, b in zip(cache.dense(layer, s2), cache.dense(layer, s0)))
    cache.free_sequence(s2)
    # A raw sign/mantissa byte flipped breaks no rule of the format: only a digest sees it.
    state = (cache.heap.used, cache.heap.top, sorted(cache._live), cache._calibrated.copy())
    signed = cache.offload_sequence(s0, free=False, digest=True)
    assert signed.digest is not None and off.digest is None and torch.equal(signed.data, off.data)
    raw = signed.data.clone()
    raw[first + 6 * D] ^= 0x01  # layer 0 K page 0: head 0's first raw byte (after its 3 code planes)
    s3 = cache.restore_sequence(dc.replace(off, data=raw), verify=True)  # no digest: taken, damaged
    assert not torch.equal(cache.dense(0, s3)[0], cache.dense(0, s0)[0])
    cache.free_sequence(s3)
    refused(dc.replace(signed, data=raw), ChecksumMismatchError, verify=True)
    ring = signed.ring.clone()
    ring.view(torch.int16)[0, 0, 0, 0, 0] ^= 1
    refused(dc.replace(signed, ring=ring), ChecksumMismatchError, verify=True)
    s4 = cache.restore_sequence(signed, verify=True)
    assert all(torch.equal(a, b) for a, b in zip(cache.dense(0, s4), cache.dense(0, s0)))


def test_cache_beyond_the_write_kernels_and_failed_copies_leave_no_trace(real, monkeypatch):
    """More KV heads than the write kernels take: the reference encoder stores the pages (the same
    bytes). Data at an odd host address restores; a restore whose copy or check fails gives its heap
    regions back (both restore paths), and a host arena hands out 16-byte aligned slices."""
    from weightszip.offload import HostArena

    big = KVExactCache(layers=1, kv_heads=65, head_dim=32, num_q_heads=65, heap_bytes=1 << 20, max_seqs=1,
                       max_tokens=64, device=DEVICE, config=CFG)
    s = big.add_sequence()
    x = real[0, 0, :16, :, :32].repeat(1, 22, 1)[:, :65].contiguous().view(torch.bfloat16)[None].to(DEVICE)
    big.append(0, [s], x, x)
    assert torch.equal(big.dense(0, s)[0], x[0])
    arena = HostArena(4096)
    arena.take(8)
    assert arena.take(16).data_ptr() % 16 == 0
    cache = KVExactCache(layers=3, kv_heads=H, head_dim=D, num_q_heads=HQ, heap_bytes=1 << 20, max_seqs=3,
                         max_tokens=256, device=DEVICE, config=CFG)
    s0 = cache.add_sequence()
    _run_cache(real, cache, [(s0, 40)], steps=1, g=torch.Generator().manual_seed(6))
    off = cache.offload_sequence(s0, free=False)
    used = cache.heap.used
    odd = torch.zeros(off.data.numel() + 8, dtype=torch.uint8)[8:]
    odd.copy_(off.data)
    import dataclasses as dc

    s1 = cache.restore_sequence(dc.replace(off, data=odd))  # an unaligned buffer still restores
    assert all(torch.equal(a, b) for a, b in zip(cache.dense(2, s1), cache.dense(2, s0)))
    cache.free_sequence(s1)
    assert cache.heap.used == used
    import weightszip.kv_exact as kvx

    def broken(*args, **kwargs):
        raise RuntimeError("copy or check failed")

    # a restore whose copy fails (the staged path on a GPU: a heap with a free region listed; the CPU
    # path) or whose check fails after the pages moved (straight into place or staged): nothing stays
    for where, hole in ((kvx, True), (KVExactCache, False), (KVExactCache, True)):
        fresh = _heap_with_hole(off.bases, hole)
        before = (fresh.heap.used, fresh.heap.top, fresh.heap.stats()["free_regions"])
        with monkeypatch.context() as m:
            m.setattr(where, "_copy_regions" if where is kvx else "_check_restored", broken)
            with pytest.raises(RuntimeError):
                fresh.restore_sequence(off, chunk_bytes=9000)
        assert (fresh.heap.used, fresh.heap.top, fresh.heap.stats()["free_regions"]) == before and not fresh._live
    monkeypatch.setattr(kvx, "_copy_regions", broken)
    arena = HostArena(1 << 20)
    arena.take(16)
    with pytest.raises(RuntimeError):  # an offload that fails gives the arena's space back
        cache.offload_sequence(s0, host=arena)
    assert arena.used == 16 and s0 in cache._live


@pytest.mark.parametrize("page_format", ["exact", "exact4"])
def test_write_kernels_and_reference_store_the_same_cache(real, page_format):
    """The same appends through the write kernels and through the reference encoder
    (``write_kernels=False``) leave the same heap bytes, offsets and sizes."""
    caches = [KVExactCache(layers=3, kv_heads=H, head_dim=D, num_q_heads=HQ, heap_bytes=1 << 20, max_seqs=2,
                           max_tokens=256, device=DEVICE, config=CFG, write_kernels=w, page_format=page_format)
              for w in (True, False)]
    for cache in caches:
        a, b = cache.add_sequence(), cache.add_sequence()
        _run_cache(real, cache, [(a, 50), (b, 33)], steps=3, g=torch.Generator().manual_seed(8))
    k, r = caches
    import weightszip.kv_exact as kvx

    assert kvx._write_kernels(k.device, H, D, page_format) is not None and not r.write_kernels  # two paths ran
    assert k.heap.used == r.heap.used > 0 and torch.equal(k.heap.buf, r.heap.buf)
    assert torch.equal(k.offsets, r.offsets) and (k.sizes == r.sizes).all()


def test_page_heap_merges_free_neighbours():
    h = PageHeap(64, device="cpu")
    a = h.alloc([32, 32])
    h.free(a, [32, 32])  # forward order: the first is not at the top when freed
    assert h.top == 0 and h.stats()["free_regions"] == 0
    assert h.alloc([48]).tolist() == [0]
    h = PageHeap(64, device="cpu")
    keep = h.alloc([16])
    with pytest.raises(LimitExceededError):
        h.alloc([16, 16, 16, 32])  # the rollback merges what it took
    assert h.alloc([48]).tolist() == [16]
    h.free(keep, [16])
    h2 = PageHeap(96, device="cpu")
    x = h2.alloc([16, 16, 16, 16])
    h2.free(x[[0, 2]], [16, 16])
    h2.free(x[1:2], [16])  # joins both neighbours into one 48-byte region
    assert h2.stats()["free_regions"] == 1 and h2.alloc([48]).tolist() == [0]


def test_page_heap_places_a_large_batch_in_runs():
    """A batch of many regions (a restored sequence) goes into the large free regions, largest
    first, then the top; holes too small for 64 of its regions stay free for single pages."""
    h = PageHeap(1 << 20, device="cpu")
    a = h.alloc([160] * 1000)  # 160000 bytes
    h.free(a[100:400], [160] * 300)  # a 48000-byte hole
    h.free(a[500:502], [160] * 2)  # a 320-byte hole: too small for a run
    b = h.alloc([160] * 500)  # 300 regions into the large hole, 200 at the top
    assert b[0] == a[100] and (np.diff(b[:300]) == 160).all() and b[300] == a[-1] + 160
    assert h.stats()["free_regions"] == 1 and h.stats()["free_listed"] == 320
    assert h.used == (1000 - 302 + 500) * 160
    with pytest.raises(LimitExceededError):  # all or nothing: the runs go back too
        h.alloc([160] * 10000)
    assert h.used == (1000 - 302 + 500) * 160 and h.stats()["free_listed"] == 320


def test_plan_reserves_the_blocks_of_pages_the_step_completes(real):
    """plan(new_tokens=10): the page that the appends complete gets its block id at plan time, so the
    kernel reads it (not another sequence's page through a stale block table)."""
    cache = KVExactCache(layers=1, kv_heads=H, head_dim=D, num_q_heads=HQ, heap_bytes=1 << 20, max_seqs=2,
                         max_tokens=128, device=DEVICE, config=CFG)
    a, b = cache.add_sequence(), cache.add_sequence()
    t = lambda kind, pos, s: tokens(real, kind, 0, pos, s)[None].view(torch.bfloat16).to(DEVICE)  # noqa: E731
    cache.append(0, [a], t(0, torch.arange(40), a), t(1, torch.arange(40), a))
    cache.append(0, [b], t(0, torch.arange(30), b), t(1, torch.arange(30), b))
    q = torch.randn((1, HQ, D), generator=torch.Generator().manual_seed(5)).to(torch.bfloat16).to(DEVICE)
    cache.plan([b], new_tokens=10)
    cache.append(0, [b], t(0, torch.arange(30, 40), b), t(1, torch.arange(30, 40), b))
    out = cache.attend(0, q)
    cache.plan([b])
    assert torch.equal(out, cache.attend(0, q))
    assert torch.equal(out, cache.attend(0, q, reference=True))


def test_failed_store_leaves_the_window_tops_unset(real):
    cache = KVExactCache(layers=1, kv_heads=H, head_dim=D, num_q_heads=HQ, heap_bytes=4096, max_seqs=1,
                         max_tokens=64, device=DEVICE, config=CFG)
    s = cache.add_sequence()
    x = tokens(real, 0, 0, torch.arange(16), s)[None].view(torch.bfloat16).to(DEVICE)
    with pytest.raises(LimitExceededError):
        cache.append(0, [s], x, x)
    assert not cache._calibrated.any() and int(cache.bases.sum()) == 0 and cache.heap.used == 0


def test_restore_checks_window_tops_only_where_pages_are(real):
    """A sequence without pages in some (layer, kind) restores into a cache whose window tops there
    differ; a cache without window tops adopts the sequence's."""
    src = KVExactCache(layers=3, kv_heads=H, head_dim=D, num_q_heads=HQ, heap_bytes=1 << 20, max_seqs=1,
                       max_tokens=64, device=DEVICE, config=CFG)
    s = src.add_sequence()
    x = tokens(real, 0, 0, torch.arange(20), s)[None].view(torch.bfloat16).to(DEVICE)
    src.append(0, [s], x, x)  # layer 0: one page; layers 1, 2: ring only
    src.append(1, [s], x[:, :10], x[:, :10])
    off = src.offload_sequence(s)
    dst = KVExactCache(layers=3, kv_heads=H, head_dim=D, num_q_heads=HQ, heap_bytes=1 << 20, max_seqs=1,
                       max_tokens=64, device=DEVICE, config=CFG)
    r = dst.restore_sequence(off)
    assert dst._calibrated[0].all() and not dst._calibrated[1:].any()
    k, _ = dst.dense(0, r)
    assert torch.equal(k.view(torch.int16), x[0].view(torch.int16))
    assert torch.equal(dst.dense(1, r)[0].view(torch.int16), x[0, :10].view(torch.int16))


def test_demo_row_on_real_kv():
    """The demo's KV Exact line: held-out pages of the real fixture, bit-exact, ratio about 0.70."""
    pytest.importorskip("ml_dtypes")
    from weightszip.demo import kv_exact_row

    meta = json.loads((DATA / "kv_smollm2_64tok.json").read_text())
    row = kv_exact_row(np.load(DATA / "kv_smollm2_64tok.npy"), meta)
    ratio = float(row.split("ratio ")[1].split(",")[0])
    assert "bit-exact" in row and 0.69 < ratio < 0.76


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 5), min_size=1, max_size=40), st.integers(1, 200))
def test_chunks_cover_regions_in_order(units, chunk_bytes):
    """Offload/restore's chunking: every non-empty region lies in exactly one chunk, the chunks in
    order and back to back, and each region's offset inside its chunk is what its predecessors in
    that chunk take (zero-size regions, which lie in no chunk or anywhere, included)."""
    sizes = np.asarray(units, dtype=np.int64) * 16
    chunks = list(kvx._chunks(sizes, chunk_bytes))
    local = kvx._chunk_local_offsets(torch.as_tensor(sizes), chunks).numpy()
    seen = np.zeros(sizes.size, dtype=int)
    pos = 0
    for i, j, p, acc in chunks:
        assert p == pos and acc == int(sizes[i:j].sum()) > 0 and (acc <= chunk_bytes or j == i + 1)
        seen[i:j] += 1
        assert (local[i:j] == np.cumsum(sizes[i:j]) - sizes[i:j]).all()
        pos += acc
    assert pos == int(sizes.sum()) and (seen[sizes > 0] == 1).all()


@pytest.mark.parametrize("copy_first", [False, True], ids=["gather-then-copy", "copy-then-scatter"])
def test_pipelined_moves_every_chunk_through_the_staging_buffers(copy_first):
    """Offload/restore's chunk pipeline (streams on a GPU, in order elsewhere): every chunk's bytes
    pass ``first`` then ``second`` through a staging buffer, and the result is the bytes in order
    (chunks of different sizes, more chunks than buffers)."""
    g = torch.Generator().manual_seed(7)
    sizes = np.asarray([3, 1, 4, 1, 5, 9, 2, 6], dtype=np.int64) * 16
    src = torch.randint(0, 256, (int(sizes.sum()),), dtype=torch.uint8, generator=g).to(DEVICE)
    dst = torch.zeros_like(src)
    chunks = list(kvx._chunks(sizes, 80))
    assert len(chunks) > 2

    def take(c, buf):
        buf[:c[3]].copy_(src[c[2]:c[2] + c[3]])

    def put(c, buf):
        dst[c[2]:c[2] + c[3]].copy_(buf[:c[3]])

    kvx._pipelined(torch.device(DEVICE), chunks, take, put, copy_first=copy_first)
    assert torch.equal(dst.cpu(), src.cpu())


# -- KV Exact4 pages ------------------------------------------------------------------------------------


def _random_pages(n, h, d, seed):
    """Random bit patterns (exponents everywhere: most rows plain) and pages of few exponents."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-(2**15), 2**15, (n, 16, h, d), generator=g, dtype=torch.int32)
    x[0] = (x[0] & 0x83FF) | 0x3C00  # exponents 120-127: coded
    x[1] = x[1] & 0x807F  # exponent 0: zeros and subnormals, code 15
    return x.to(torch.int16)


def test_exact4_roundtrip_real_kv_and_ratio(real):
    for layer in range(3):
        for kind in range(2):
            x = pages_of(real[kind, layer])
            enc = R4.encode_pages(x)
            buf, offs = enc.to_bytes()
            assert torch.equal(R4.decode_pages(buf, offs, H, D), x)
            ratio = buf.numel() / (x.numel() * 2)
            # 4-bit codes, a raw byte and a top per channel and page = 12.5 / 16, the header, plain rows
            assert 0.78 < ratio < 0.80, ratio
            assert int(enc.plain.sum()) < enc.plain.numel() // 20


def test_exact4_every_bit_pattern_roundtrips():
    """All 65536 bf16 patterns (NaN, Inf, -0, subnormals), and random ones (plain rows), through the
    format; a token row of a head is plain exactly when some value of it has no code."""
    allbits = torch.arange(65536, dtype=torch.int32).to(torch.int16).reshape(-1, 16, 2, 32)
    for x in (allbits, allbits[torch.randperm(allbits.shape[0], generator=torch.Generator().manual_seed(0))],
              _random_pages(6, 3, 64, 1)):
        enc = R4.encode_pages(x)
        buf, offs = enc.to_bytes()
        assert torch.equal(R4.decode_pages(buf, offs, x.shape[2], x.shape[3]), x)
        bits = x.to(torch.int32).permute(0, 2, 1, 3) & 0xFFFF
        _, fits = R4.codes_of(bits, R4.tops_of(bits)[:, :, None, :])
        assert torch.equal(enc.plain, ~fits.all(3))
    assert enc.plain.any() and not enc.plain.all()


def test_exact4_page_layout_by_hand():
    """Two heads of 32 channels, every value 1.0 (exponent 127) but: head 0 token 0 channel 9 = -1.5,
    token 2 channel 12 = 0.0 (code 15); head 1 token 3 channel 5 = 2**-40 and token 7 channel 0 =
    2**-50 (outside the window: those two rows are plain)."""
    x = torch.full((1, 16, 2, 32), 0x3F80, dtype=torch.int16)
    x[0, 0, 0, 9] = torch.tensor(0xBFC0, dtype=torch.int32).to(torch.int16)  # -1.5
    x[0, 2, 0, 12] = 0
    x[0, 3, 1, 5] = 0x2B80  # 2**-40: exponent 87
    x[0, 7, 1, 0] = 0x2680  # 2**-50: exponent 77
    buf, offs = R4.encode_pages(x).to_bytes()
    b = buf.tolist()
    assert len(b) == int(offs[1]) == 16 + 25 * 32 * 2 + 2 * 64
    # header: head 0 no plain rows; head 1 rows 3 and 7 plain, none before it
    assert b[:16] == [0, 0, 0, 0, (1 << 3) | (1 << 7), 0, 0, 0] + [0] * 8
    order = R4.half_order(32).tolist()  # channel at each byte of tops and raw rows
    head0 = b[16: 16 + 800]
    assert head0[:32] == [127] * 32  # tops
    codes = np.array(head0[32: 32 + 256]).reshape(16, 4, 4)  # token, word, byte
    words = codes[..., 0] | codes[..., 1] << 8 | codes[..., 2] << 16 | codes[..., 3] << 24
    # channel 12 = 8 * 1 + 4: word 1, nibble at bit 16 * 0 + 4 * 2 = 8 holds code 15
    assert words[2, 1] == 15 << 8 and (np.delete(words.reshape(-1), 2 * 4 + 1) == 0).all()
    raw = np.array(head0[288:]).reshape(16, 32)
    assert raw[0, order.index(9)] == 0x80 | 0x40 and raw[2, order.index(12)] == 0 and raw[1, 1] == 0
    # head 1: its plain rows' codes and raw bytes zero in the slot, their values after the slots
    head1 = b[816: 816 + 800]
    assert head1[:32] == [127] * 32
    raw1 = np.array(head1[288:]).reshape(16, 32)
    assert (raw1[[3, 7]] == 0).all() and (raw1[0] == 0).all()
    vals = x[0, :, 1].to(torch.int32) & 0xFFFF
    le = torch.stack([vals & 0xFF, vals >> 8], -1).reshape(16, 64).tolist()
    assert b[1616:] == le[3] + le[7]


def test_exact4_damaged_pages_raise_typed_errors(real):
    x = pages_of(real[1, 2])[:2]
    buf, offs = R4.encode_pages(x).to_bytes()
    hdr = R4.header_bytes(H)
    with pytest.raises(WeightszipError):
        R4.decode_pages(buf[:-16], offs, H, D)
    bad = buf.clone()
    bad[2] ^= 1  # head 0's count of earlier plain rows
    with pytest.raises(CorruptDataError):
        R4.decode_pages(bad, offs, H, D)
    bad = buf.clone()
    bad[4 * H] = 1  # header padding
    with pytest.raises(CorruptDataError):
        R4.decode_pages(bad, offs, H, D)
    bad = buf.clone()
    bad[hdr] = 14  # a top below 15
    with pytest.raises(CorruptDataError):
        R4.decode_pages(bad, offs, H, D)
    bad = buf.clone()
    rows = hdr + D + torch.arange(16) * (D // 2)  # head 0's code rows; channel 0: low nibble of byte 0
    assert bool(((bad[rows] & 15) < 14).all())
    bad[rows] += 1  # every exponent of channel 0 one lower: its top is no longer the largest (not canonical)
    with pytest.raises(CorruptDataError):
        R4.decode_pages(bad, offs, H, D)
    bad = buf.clone()
    bad[0] |= 1  # head 0 row 0 now plain: the page is shorter than its plain rows
    with pytest.raises(WeightszipError):
        R4.decode_pages(bad, offs, H, D)
    wrap = 6148914691236517205  # offsets whose differences wrap around int64
    for o in (torch.tensor([0, wrap, 2 * wrap - 2**64, buf.numel()]), torch.tensor([0, -16, buf.numel()])):
        with pytest.raises(CorruptDataError):
            R4.decode_pages(buf, o, H, D)
    for o in (2**63 - 8, -(2**63), buf.numel() - 8):
        with pytest.raises(TruncatedError):
            R4.decode_heap_pages(buf, torch.tensor([o]), H, D)
    with pytest.raises(InvalidArgumentError):
        R4.decode_pages(buf, offs, H, 48)
    with pytest.raises(InvalidArgumentError):
        R4.encode_pages(torch.zeros((1, 16, R4.MAX_HEADS + 1, 32), dtype=torch.int16))


@settings(max_examples=150, deadline=None)
@given(st.data())
def test_exact4_fuzz_damaged_pages_never_crash(real, data):
    """Flipped bits, cuts, random bytes and hostile offsets: a typed error, or pages that re-encode
    to the same bytes (the format is canonical)."""
    x = torch.cat([pages_of(real[1, 2])[:2], _random_pages(3, H, D, 2)[2:]])  # coded and plain rows
    buf, offs = R4.encode_pages(x).to_bytes()

    def random_page(rand):  # random slots and plain rows behind a consistent header
        masks = data.draw(st.lists(st.integers(0, 0xFFFF), min_size=H, max_size=H))
        cnt = [bin(m).count("1") for m in masks]
        bad = rand(R4.page_length(H, D, sum(cnt)))
        hdr = [v for h in range(H) for v in (masks[h] & 0xFF, masks[h] >> 8, sum(cnt[:h]) & 0xFF, sum(cnt[:h]) >> 8)]
        bad[: R4.header_bytes(H)] = torch.tensor(hdr + [0] * (R4.header_bytes(H) - 4 * H), dtype=torch.uint8)
        return bad

    bad, o = _damaged(data, buf, offs, random_page)
    try:
        out = R4.decode_pages(bad, o, H, D)
    except WeightszipError:
        return
    b2, o2 = R4.encode_pages(out).to_bytes()
    assert torch.equal(b2, bad) and torch.equal(o2, o.to(torch.int64))


def test_exact4_compiled_decoder_math_equals_the_reference():
    """``kv_exact4_ref.pair_decode`` (the compiled tile decoder's PTX, instruction for instruction,
    in PyTorch) gives every value that has a code bit for bit: all 65536 patterns and random ones."""
    allbits = torch.arange(65536, dtype=torch.int32).to(torch.int16).reshape(-1, 16, 2, 32)
    for x in (allbits, _random_pages(8, 2, 64, 3)):
        bits = x.to(torch.int32).permute(0, 2, 1, 3) & 0xFFFF  # [n, H, 16, D]
        tops = R4.tops_of(bits)
        code, fits = R4.codes_of(bits, tops[:, :, None, :])
        raw = ((bits >> 8) & 0x80) | (bits & 0x7F)
        sh = torch.tensor(R4.NIBBLE_SHIFT)
        w = (code.long().reshape(*code.shape[:-1], -1, 8) << sh).sum(-1)  # [n, H, 16, D / 8]
        byte = torch.tensor([0, 8, 16, 24])
        rw = (raw.long().reshape(*raw.shape[:-1], -1, 2, 4) << byte).sum(-1)  # [..., D / 8, 2 halves]
        tw = (tops.long().reshape(*tops.shape[:-1], -1, 2, 4) << byte).sum(-1)[:, :, None].expand(rw.shape)
        out = R4.pair_decode(w, rw[..., 0], rw[..., 1], tw[..., 0], tw[..., 1]).reshape(bits.shape)
        assert bool(((out == bits) | ~fits).all())
        assert fits.float().mean() > 0.1
    # a row the kernel does not want: codes all 15, raw 0, tops 15 (the loads' fill values): +0.0
    z = torch.zeros(1, dtype=torch.int64)
    assert R4.pair_decode(z + 0xFFFFFFFF, z, z, z + 0x0F0F0F0F, z + 0x0F0F0F0F).eq(0).all()


def test_exact4_kernel_tile_loader_equals_reference(real):
    cases = [pages_of(real[1, 2]), _random_pages(6, 3, 64, 4), _random_pages(5, 1, 32, 5)]
    for pages in cases:
        enc = R4.encode_pages(pages)
        n, span = len(enc), int(enc.lengths.max()) + 64
        offs = torch.tensor([(n - i) * span + 48 * i for i in range(n)], dtype=torch.int64)  # scattered
        heap = torch.full((int(offs.max()) + span,), 0xAB, dtype=torch.uint8)
        enc.write(heap, offs)
        for npt in (1, 2, 4):
            got = dequantize_exact4_pages(heap.to(DEVICE), offs.to(DEVICE), *pages.shape[2:], pages_per_tile=npt).cpu()
            assert torch.equal(got, pages), npt
        assert torch.equal(R4.decode_heap_pages(heap, offs, *pages.shape[2:]), pages)


@pytest.mark.parametrize("lens,split,tiny", [([150, 40, 97], 64, True), ([33], None, False), ([16, 17, 300], 32, True)])
def test_exact4_attention_bit_identical_to_bf16_pages(real, lens, split, tiny):
    """KV Exact4 pages give the output of the same kernel over the bf16 pages bit for bit, with
    plain rows (``tiny``: a value 2**-60 in every 7th token) and without."""
    if tiny:
        c = _paged_pair(real, [64], ref=R4, tiny=True)
        assert int(R4.heap_page_lengths(c["heap"].cpu(), c["koff"].cpu(), H, D).max()) > R4.page_length(H, D, 0)
    _exact_equals_bf16_pages(real, lens, split, page_type="exact4", tiny=tiny)


@pytest.mark.skipif(DEVICE != "cuda", reason="the operand layouts matter only compiled (the interpreter has none)")
def test_exact4_attention_bit_identical_to_bf16_pages_head_dim_128(real):
    from weightszip.kernels import DEFAULT_CONFIGS
    from weightszip.kernels.paged_decode import PAGE_EXACT4

    wide = torch.cat([real, real.roll(1, dims=2)], dim=-1)
    _exact_equals_bf16_pages(wide, [1000, 4100, 300, 2048], None, DEFAULT_CONFIGS[PAGE_EXACT4], page_type="exact4",
                             tiny=True)


GLUON_CFG = dataclasses.replace(CFG, gluon=True, gluon_min_work=0, gluon_warps=4, gluon_stages=2, gluon_maxnreg=0)


@pytest.mark.skipif(DEVICE != "cuda", reason="Gluon kernels run compiled only")
@pytest.mark.parametrize("lens,split,tiny,warps,stages",
                         [([150, 40, 97], 64, True, 4, 2), ([33], None, False, 4, 2), ([16, 17, 300], 32, True, 2, 4),
                          ([700, 5, 64, 129], 48, True, 8, 2)])
def test_exact4_gluon_attention_bit_identical_to_bf16_pages_gpu(real, lens, split, tiny, warps, stages):
    """The Gluon kernel (``kv_exact4_gluon``) over KV Exact4 pages gives its own output over the bf16
    pages bit for bit (both modes put the same values in the same operand registers), with plain rows
    and splits that start and end inside pages, and both are attention (the fp64 reference)."""
    from weightszip.kernels import kv_exact4_gluon  # noqa: F401 - the kernel module imports on the GPU

    cfg = dataclasses.replace(GLUON_CFG, gluon_warps=warps, gluon_stages=stages)
    _exact_equals_bf16_pages(real, lens, split, cfg, page_type="exact4", tiny=tiny)


@pytest.mark.skipif(DEVICE != "cuda", reason="Gluon kernels run compiled only")
@pytest.mark.parametrize("swizzle", [True, False], ids=["v-swizzled", "v-in-order"])
def test_exact4_gluon_attention_head_dim_128_gpu(real, swizzle):
    """At head_dim 128, with V's staged chunks swizzled (the default) or in order
    (``KernelConfig.gluon_x4_v_swizzle``): the exact4 pages give the bf16 pages' output bit for bit."""
    wide = torch.cat([real, real.roll(1, dims=2)], dim=-1)
    cfg = dataclasses.replace(GLUON_CFG, gluon_warps=8, gluon_x4_v_swizzle=swizzle)
    _exact_equals_bf16_pages(wide, [1000, 4100, 300, 2048], None, cfg, page_type="exact4", tiny=True)


_COMPILE_X4_GLUON = """
import sys
from weightszip.kernels import kv_exact4_gluon as xg
from weightszip.kernels.paged_decode_gluon import compile_for_hopper

ptrs = dict(q_ptr="*bf16", k_ptr="*u8", v_ptr="*u8", k_off_ptr="*i64", v_off_ptr="*i64", ones_ptr="*u8",
            ws_m_ptr="*fp32", ws_l_ptr="*fp32", ws_acc_ptr="*fp32")
for d, group, warps, stages, swz in ((128, 4, 4, 2, 1), (64, 3, 8, 4, 1), (128, 8, 8, 2, 1), (128, 4, 4, 2, 0)):
    for bf16 in (False, True) if swz else (False,):
        k, spill = compile_for_hopper(xg.exact4_split_kernel, dict(GROUP=group, BLOCK_G=8, HEAD_DIM=d, STAGES=stages,
                                      BF16=bf16, V_SWIZZLE=bool(swz)), ptrs, warps)
        print(d, group, warps, stages, int(bf16), spill, k.metadata.shared, xg.smem_bytes(d, warps, stages, bf16))
"""


def test_exact4_gluon_kernel_compiles_for_hopper(compile_in_child):
    """The Gluon exact4 kernel and its bf16 mode compile for sm_90 (a child process, no GPU) without
    spills, and their shared memory is exactly the staging slots (only inline PTX addresses it, by
    offsets from ``global_smem``: Triton must place nothing else there)."""
    out = compile_in_child(_COMPILE_X4_GLUON)
    rows = [list(map(int, line.split())) for line in out.splitlines() if line[:1].isdigit()]
    assert len(rows) == 7, out
    for d, group, warps, stages, bf16, spill, shared, want in rows:
        assert spill == 0 and shared == want, (d, group, warps, stages, bf16, spill, shared, want)


def test_exact4_gluon_channel_orders():
    """The operands' channel maps are permutations, the kernel's inline forms (``_k_stored_channel``,
    ``_v_stored_channel`` with order 16) agree with them, and each thread's channels sit in
    consecutive words: K thread t reads code words M t .. M t + M - 1, V thread j raw-row bytes
    4 M j .. 4 M j + 4 M - 1 (half order)."""
    from weightszip.kernels import kv_exact4_gluon as xg
    from weightszip.kernels.kv_exact4_ref import half_order

    for d in (32, 64, 128, 256):
        m = d // 32
        ch = torch.arange(d)
        k, v = xg.x4_k_channel(ch, d), xg.x4_v_channel(ch, d)
        assert sorted(k.tolist()) == list(range(d)) and sorted(v.tolist()) == list(range(d))
        # v's inline form in paged_decode_gluon._v_stored_channel (BITS == 16)
        assert torch.equal(v, 8 * ((ch % 4) * m + ch // 32) + 4 * ((ch % 8) // 4) + 2 * ((ch // 16) % 2) + (ch // 8) % 2)
        # K: column 32 mm + 8 i + 2 t + b -> code word m t + mm
        t = (ch // 2) % 4
        assert torch.equal(k // 8, m * t + ch // 32)
        # V: row 32 mm + 16 i1 + 8 i0 + j -> raw byte 4 m j + 4 mm + 2 i1 + i0 of a half-ordered row
        order = half_order(d)  # the channel at each byte of a raw row
        pos = torch.empty_like(order)
        pos[order] = torch.arange(d)  # the byte of each channel
        j = ch % 8
        assert torch.equal(pos[v], 4 * m * j + 4 * (ch // 32) + 2 * ((ch // 16) % 2) + (ch // 8) % 2)


def test_exact4_attention_argument_checks(real):
    c = _paged_pair(real, [40], ref=R4)
    att = PagedDecodeAttention(HQ, H, D, page_type="exact4", window=16, config=CFG, device=DEVICE)
    att.plan([40], c["bt"])
    with pytest.raises(InvalidArgumentError):  # exact4 pages hold their own tops
        att.run(c["q"], c["heap"], c["heap"], k_side=c["ks"], v_side=c["vs"], k_offsets=c["koff"],
                v_offsets=c["voff"], k_bases=torch.zeros((H, D), dtype=torch.uint8, device=DEVICE),
                v_bases=torch.zeros((H, D), dtype=torch.uint8, device=DEVICE))
    with pytest.raises(InvalidArgumentError):
        att.run(c["q"], c["heap"], c["heap"], k_side=c["ks"], v_side=c["vs"])  # no offsets
    with pytest.raises(InvalidArgumentError):
        PagedDecodeAttention(257, 257, 64, page_type="exact4", device=DEVICE)
    with pytest.raises(InvalidArgumentError):
        PagedDecodeAttention(HQ, H, D, page_type="exact4", block_size=32, device=DEVICE)


def _exact4_cache(**kw):
    args = dict(layers=3, kv_heads=H, head_dim=D, num_q_heads=HQ, heap_bytes=1 << 20, max_seqs=3, max_tokens=256,
                device=DEVICE, config=CFG, page_format="exact4")
    return KVExactCache(**{**args, **kw})


def test_exact4_cache_prefill_decode_offload_restore(real):
    """A KV Exact4 cache: every token back bit for bit, attention equal to the same kernel over the
    pages decoded to bf16 (``attend(reference=True)``), its size, and a sequence offloaded and
    restored (verified) into another cache; a KV Exact (version 1) sequence is refused."""
    cache = _exact4_cache()
    s0, s1 = cache.add_sequence(), cache.add_sequence()
    g = torch.Generator().manual_seed(7)
    outs = _run_cache(real, cache, [(s0, 70), (s1, 33)], steps=2, g=g)
    _assert_cache_holds(real, cache, (s0, s1))
    layer, q, out = outs[-1]
    assert torch.equal(cache.attend(layer, q, reference=True), out)
    assert 0.78 < cache.stats()["ratio_vs_bf16"] < 0.86
    off = cache.offload_sequence(s0)
    assert off.page_format == "exact4"
    other = _exact4_cache()
    s = other.restore_sequence(off, verify=True, chunk_bytes=9000)
    for layer in range(3):
        k, v = other.dense(layer, s)
        pos = torch.arange(int(other.length[layer, s]))
        assert torch.equal(k.cpu().view(torch.int16), tokens(real, 0, layer, pos, s0))
    v1 = KVExactCache(layers=3, kv_heads=H, head_dim=D, num_q_heads=HQ, heap_bytes=1 << 20, max_seqs=1,
                      max_tokens=256, device=DEVICE, config=CFG)
    with pytest.raises(InvalidArgumentError):
        v1.restore_sequence(off)
    with pytest.raises(InvalidArgumentError):
        _exact4_cache(bases=torch.zeros((3, 2, H, D), dtype=torch.uint8))
    with pytest.raises(InvalidArgumentError):
        _exact4_cache(page_format="exact5")


def test_exact4_restore_refuses_damaged_pages(real):
    """A page whose header disagrees with itself (a head's count of earlier plain rows) or with its
    size is refused always; damaged tops with ``verify=True``; the cache is left as it was."""
    import dataclasses as dc

    cache = _exact4_cache()
    s0 = cache.add_sequence()
    _run_cache(real, cache, [(s0, 70)], steps=1, g=torch.Generator().manual_seed(8))
    off = cache.offload_sequence(s0, free=False)
    state = (cache.heap.used, cache.heap.top, sorted(cache._live))

    def refused(bad, err, **kw):
        with pytest.raises(err):
            cache.restore_sequence(bad, **kw)
        assert (cache.heap.used, cache.heap.top, sorted(cache._live)) == state

    mask = off.data.clone()
    mask[0] ^= 1  # layer 0 K page 0: head 0's plain rows change, so the counts after it are wrong
    refused(dc.replace(off, data=mask), CorruptDataError)
    last = off.data.clone()
    last[4 * (H - 1)] ^= 1  # the last head's mask: the counts agree, the size does not
    refused(dc.replace(off, data=last), CorruptDataError)
    tops = off.data.clone()
    tops[R4.header_bytes(H)] = 3  # a window top below 15
    refused(dc.replace(off, data=tops), CorruptDataError, verify=True)
    wrap = off.sizes.copy()
    wrap[:2, :, 0] += 1 << 62  # four sizes near 2**62: their int64 sum wraps back to the data's length
    refused(dc.replace(off, sizes=wrap), InvalidArgumentError)
    s1 = cache.restore_sequence(dc.replace(off, data=tops))  # sizes and headers agree: taken unverified
    cache.free_sequence(s1)
    s2 = cache.restore_sequence(off, verify=True)
    for layer in range(3):
        assert all(torch.equal(a, b) for a, b in zip(cache.dense(layer, s2), cache.dense(layer, s0)))


@pytest.mark.parametrize("page_format", ["exact", "exact4"])
def test_restore_a_sequence_shorter_than_a_page(real, page_format):
    """A sequence of fewer than 16 tokens has no pages, only its bf16 ring: it offloads and restores
    (the size checks take an empty page list)."""
    cache = KVExactCache(layers=3, kv_heads=H, head_dim=D, num_q_heads=HQ, heap_bytes=1 << 20, max_seqs=2,
                         max_tokens=64, device=DEVICE, config=CFG, page_format=page_format)
    s0 = cache.add_sequence()
    _run_cache(real, cache, [(s0, 5)], steps=1, g=torch.Generator().manual_seed(9))
    off = cache.offload_sequence(s0, free=False)
    assert off.sizes.shape[2] == 0 and off.data.numel() == 0
    s1 = cache.restore_sequence(off, verify=True)
    for layer in range(3):
        assert all(torch.equal(a, b) for a, b in zip(cache.dense(layer, s1), cache.dense(layer, s0)))


def test_exact4_gluon_staging_slot_layout():
    """The staging slot (``x4_geometry``): the header chunks (bytes 0-31), the page offsets (32-47)
    and the carried address words (48-67) come before the first row; the K and V regions (tops, 16
    code rows, 16 raw rows) follow each other without overlap inside the slot; at head_dim 128 every
    row starts 32-byte aligned (a global sector's two chunks then land in one aligned 32 bytes: a
    copy fetches each sector once)."""
    from weightszip.kernels import kv_exact4_gluon as xg

    for d in (64, 128):
        kt, kc, kr, vt, vc, vr, kcs, krs, vcs, vrs, slot = xg.x4_geometry(d, False)
        assert kt >= 68 and kt % 16 == 0
        regions = [(kt, d), (kc, 16 * kcs), (kr, 16 * krs), (vt, d), (vc, 16 * vcs), (vr, 16 * vrs)]
        for (a, n), (b, _) in zip(regions, regions[1:]):
            assert a + n <= b, (d, a, n, b)
        assert vr + 16 * vrs <= slot and slot % 128 == 0 and slot == xg.slot_bytes(d)
        assert kcs >= d // 2 and krs >= d and vcs >= d // 2 and vrs >= d  # a row fits its stride
        if d == 128:
            starts = [s + r * stride for s, stride in ((kc, kcs), (kr, krs), (vc, vcs), (vr, vrs)) for r in range(16)]
            assert all(x % 32 == 0 for x in starts + [kt, vt]), starts
        # bf16 mode: K and V rows of 2 d bytes, after the same carried words
        _, _, kr16, _, _, vr16, _, krs16, _, vrs16, slot16 = xg.x4_geometry(d, True)
        assert kr16 >= 68 and kr16 % 32 == 0 and vr16 == kr16 + 16 * krs16 and vr16 + 16 * vrs16 <= slot16


def test_page_heap_live_arrays_keep_count_of_freed_entries_when_they_grow():
    """The live arrays grew (a batch from the top) by a copy that kept their freed (size 0) entries
    but reset the count of them to 0: a later merge then put new regions beside freed entries at the
    same offsets (200 duplicate offsets here), right only by the order of insertion. A rebuild now
    drops the freed entries: the count matches, and no offset is listed twice."""
    from weightszip.kv_exact import PageHeap

    h = PageHeap(1 << 30, device="cpu")
    a = h.alloc([16] * 600)
    h.free(a[0:580:2], [16] * 290)  # 290 one-region holes; fewer than half the entries: kept as size 0
    b = h.alloc([32] * 700)  # from the top, appended: the arrays grow
    c = h.alloc([16] * 200)  # into the holes, merged in
    lo, lz = h._live
    assert int((lz == 0).sum()) == h._live_dead and np.unique(lo).size == lo.size
    h.free(np.concatenate([a[1:580:2], a[580:]]), [16] * 310)
    h.free(b, [32] * 700)
    h.free(c, [16] * 200)
    assert h.used == 0
