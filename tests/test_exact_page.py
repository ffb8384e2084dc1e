"""Exact page profile: Rust codec (weightszip.pages), plain-PyTorch reference and Triton kernels
(weightszip.kernels.exact_page) write and read the same bytes, both ways, bit for bit.

Real data: SmolLM2-135M bf16 KV from tests/data (64 tokens, 192 channels). Triton runs in its
interpreter on a CPU (TRITON_INTERPRET=1, set before triton is imported), so shapes stay small.
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from weightszip import pages  # noqa: E402
from weightszip.errors import (  # noqa: E402
    BadMagicError,
    CorruptDataError,
    InvalidArgumentError,
    TruncatedError,
    UnsupportedVersionError,
)

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from weightszip.kernels import exact_page as ep  # noqa: E402
from weightszip.kernels import exact_page_ref as ref  # noqa: E402


def _pages(real_kv, layer=1, kind=0, channels=192):
    x = real_kv[kind, layer][:, :channels]  # [64, C] uint16 bits
    return x, x.reshape(4, 16, channels)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("kind", [0, 1], ids=["K", "V"])
def test_rust_round_trip_and_ratio_on_real_kv(real_kv, dtype, kind):
    x, p = _pages(real_kv, kind=kind)
    cb = pages.calibrate(x[:32], dtype)
    buf, offs = pages.encode_pages(cb, p)
    assert offs[0] == 0 and offs[-1] == len(buf) and (np.diff(offs) % 8 == 0).all()
    assert (pages.decode_pages(cb, buf, offs) == p).all()
    if dtype == "bfloat16":  # held-out half of real bf16 KV: well below 0.75 with all side data
        assert len(buf) / p.nbytes < 0.72


def test_reference_encoder_matches_rust_and_decoder_inverts(real_kv):
    x, p = _pages(real_kv)
    for dtype in ("bfloat16", "float16"):
        cb = pages.calibrate(x[:32], dtype)
        tb = ep.PageTables.from_codebook(cb)
        buf, offs = pages.encode_pages(cb, p)
        rbuf, roffs = ref.encode_pages_ref(torch.from_numpy(p.view(np.int16)), tb.enc[0], tb.is_bf16)
        assert bytes(rbuf.numpy()) == buf and (roffs.numpy() == offs).all()
        dec = ref.decode_pages_ref(rbuf, roffs, tb.lut[0], tb.max_len, tb.is_bf16)
        assert (dec.numpy().view(np.uint16) == p).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_triton_both_directions_bit_exact(real_kv, dtype):
    # Rust-encoded pages decoded by Triton; Triton-encoded pages byte-equal to Rust's and decoded by Rust.
    x, p = _pages(real_kv, layer=2, kind=0, channels=32)
    p = p[:2]
    cb = pages.calibrate(x[32:], dtype)
    tb = ep.PageTables.from_codebook(cb)
    buf, offs = pages.encode_pages(cb, p)
    t_in = torch.from_numpy(p.view(np.int16).copy())
    dec = ep.decode_pages(torch.from_numpy(np.frombuffer(buf, np.uint8).copy()), torch.from_numpy(offs), tb)
    assert torch.equal(dec, t_in)
    gbuf, goffs = ep.encode_pages(t_in, tb, block_pages=2)
    assert bytes(gbuf.numpy()) == buf and (goffs.numpy() == offs).all()
    assert (pages.decode_pages(cb, gbuf.numpy(), goffs.numpy()) == p).all()
    assert torch.equal(ep.stream_bits(t_in, tb), _ref_bits(t_in, tb))


@pytest.mark.parametrize("channels", [32, 96])
def test_triton_encoder_writes_every_byte(real_kv, channels):
    """``encode_into`` writes every byte of its pages (headers, their padding, raw bytes, code words,
    the padding to ``align``) into a buffer full of garbage, for align 8, 16 and 32: the bytes equal
    the Rust encoder's with the same align. (96 channels: 3 streams, a header of 6 bytes padded to 8;
    32: 1 stream, 2 bytes padded to 8.)"""
    x, p = _pages(real_kv, layer=1, kind=1, channels=channels)
    p = p[:3]
    cb = pages.calibrate(x[32:], "bfloat16")
    tb = ep.PageTables.from_codebook(cb)
    t_in = torch.from_numpy(p.view(np.int16).copy())
    tids = torch.zeros(len(p), dtype=torch.int32)
    for align in (8, 16, 32):
        want, woffs = pages.encode_pages(cb, p, align)
        layout = ep.page_layout(t_in, tb, tids, align)
        assert (layout[1].numpy() == woffs).all(), align
        buf = torch.full((len(want) + 64,), 0xAB, dtype=torch.uint8)
        ep.encode_into(t_in, tb, tids, buf, layout, block_pages=2, align=align)
        assert bytes(buf[: len(want)].numpy()) == want, align
        assert (buf[len(want):] == 0xAB).all(), align  # nothing past the last page


def _ref_bits(values, tb):
    lens = (tb.enc[0] & 31).to(torch.int64)
    v = values.to(torch.int32) & 0xFFFF
    sym, _ = ref.split_ref(v, tb.is_bf16)
    ch = torch.arange(tb.channels).expand_as(sym)
    ln = lens[ch, sym]
    ln = torch.where(ln == 0, lens[:, 256][ch] + 8, ln)
    n = values.shape[0]
    return ln.view(n, 16, -1, 32).sum((1, 3)).to(torch.int32)


def test_triton_escapes_and_bf16_specials():
    # Symbols never seen in calibration go through the escape; NaN, inf, -0 and subnormals survive.
    rng = np.random.default_rng(5)
    cal = (rng.standard_normal((64, 32)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    cb = pages.calibrate(cal, "bfloat16")
    special = np.array([0x7FC0, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x807F, 0x0000, 0xFFFF], np.uint16)
    p = rng.integers(0, 1 << 16, (1, 16, 32), dtype=np.uint16)
    p[0, 0, :8] = special
    buf, offs = pages.encode_pages(cb, p)
    tb = ep.PageTables.from_codebook(cb)
    dec = ep.decode_pages(torch.from_numpy(np.frombuffer(buf, np.uint8).copy()), torch.from_numpy(offs), tb)
    assert (dec.numpy().view(np.uint16) == p).all()
    gbuf, _ = ep.encode_pages(torch.from_numpy(p.view(np.int16)), tb)
    assert bytes(gbuf.numpy()) == buf


@settings(max_examples=25, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    n=st.integers(1, 3),
    max_len=st.integers(8, 12),
    dtype=st.sampled_from(["bfloat16", "float16"]),
    scale=st.floats(1e-3, 1e3),
)
def test_property_rust_and_reference_agree(seed, n, max_len, dtype, scale):
    rng = np.random.default_rng(seed)
    f = (rng.standard_normal((16 * (n + 1), 64)) * scale).astype(np.float32)
    bits = (f.view(np.uint32) >> 16).astype(np.uint16) if dtype == "bfloat16" else f.astype(np.float16).view(np.uint16)
    cb = pages.calibrate(bits[:16], dtype, max_len)
    p = bits[16:].reshape(n, 16, 64)
    buf, offs = pages.encode_pages(cb, p)
    assert (pages.decode_pages(cb, buf, offs) == p).all()
    tb = ep.PageTables.from_codebook(cb)
    rbuf, roffs = ref.encode_pages_ref(torch.from_numpy(p.view(np.int16)), tb.enc[0], tb.is_bf16)
    assert bytes(rbuf.numpy()) == buf and (roffs.numpy() == offs).all()


def test_hostile_inputs_raise_typed_errors(real_kv):
    x, p = _pages(real_kv, channels=32)
    cb = pages.calibrate(x, "bfloat16")
    buf, offs = pages.encode_pages(cb, p[:1])
    page = np.frombuffer(buf, np.uint8)
    with pytest.raises(TruncatedError):
        pages.decode_pages(cb, page[:40], [0, 40])
    bad = page.copy()
    bad[2] = 7  # header padding must be zero
    with pytest.raises(CorruptDataError):
        pages.decode_pages(cb, bad, offs)
    with pytest.raises(CorruptDataError):
        pages.decode_pages(cb, page, [0, len(page) + 8])
    with pytest.raises(BadMagicError):
        pages.codebook_info(b"XXXX" + cb[4:])
    with pytest.raises(UnsupportedVersionError):
        pages.codebook_info(cb[:4] + b"\x09" + cb[5:])
    with pytest.raises(TruncatedError):
        pages.codebook_info(cb[:-1])
    with pytest.raises(InvalidArgumentError):
        pages.calibrate(real_kv[0, 1][:, :33], "bfloat16")  # not a multiple of 32 channels
    with pytest.raises(InvalidArgumentError):
        pages.calibrate(x, "float32")
    with pytest.raises(InvalidArgumentError):
        pages.encode_pages(cb, p[:, :, :16])
    # Random bytes never crash the Rust decoder: a typed error or a decode.
    rng = np.random.default_rng(0)
    for _ in range(200):
        junk = rng.integers(0, 256, rng.integers(0, 3000), dtype=np.uint8)
        try:
            pages.decode_pages(cb, junk, [0, len(junk)])
        except CorruptDataError:
            pass


_COMPILE_CODEC = """
from weightszip.kernels import exact_page as ep, regions
from weightszip.kernels.paged_decode_gluon import compile_for_hopper

enc = {"vals_ptr": "*i64", "enc_ptr": "*i32", "buf32_ptr": "*i32", "buf16_ptr": "*i16", "off_ptr": "*i64",
       "words_ptr": "*i32", "wstart_ptr": "*i32", "tid_ptr": "*i32"}
for c, s, h, tail in ((1024, 32, 64, 1), (96, 3, 8, 3)):
    _, a = compile_for_hopper(ep._layout_kernel, dict(C=c, S=s, SP=32, H=h, ALIGN=4 * (tail + 1), IS_BF16=True),
                              {"vals_ptr": "*i16", "enc_ptr": "*i32", "tid_ptr": "*i32", "words_ptr": "*i32",
                               "wstart_ptr": "*i32", "size_ptr": "*i64"}, 4)
    _, b = compile_for_hopper(ep._encode_kernel, dict(C=c, S=s, H=h, TAIL_WORDS=tail, IS_BF16=True, BLOCK_PAGES=64),
                              enc, 2)
    print("spills", a, b)
k, w = compile_for_hopper(regions._weighted_sum_kernel, dict(ROWS=16, BLOCK=1024),
                          {"x_ptr": "*i64", "a_ptr": "*i64", "b_ptr": "*i64", "out_ptr": "*i64"}, 4)
print("spills", w, 0, "atomic", "atom.global.gpu.acq_rel.add.u64" in k.asm["ptx"])
"""


def test_codec_kernels_compile_for_hopper(compile_in_child):
    """The encoder's layout and encode kernels (headers and padding written in the kernel) and the
    offload's digest kernel compile for sm_90 without a GPU (a child process: this module runs
    Triton in its interpreter), without spills, the digest with a 64-bit atomic add."""
    out = compile_in_child(_COMPILE_CODEC)
    lines = [ln.split() for ln in out.splitlines() if ln.startswith("spills")]
    assert [ln[1:3] for ln in lines] == [["0", "0"]] * 3 and lines[-1][-1] == "True", out
