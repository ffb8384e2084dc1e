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

# the Triton kernels run in the interpreter here, compiled on a GPU with TRITON_INTERPRET=0
DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"


def _dev(a):
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)


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
    tb = ep.PageTables.from_codebook(cb, device=DEVICE)
    buf, offs = pages.encode_pages(cb, p)
    t_in = _dev(p.view(np.int16))
    dec = ep.decode_pages(_dev(np.frombuffer(buf, np.uint8)), _dev(offs), tb)
    assert torch.equal(dec, t_in)
    gbuf, goffs = (a.cpu() for a in ep.encode_pages(t_in, tb, block_pages=2))
    assert bytes(gbuf.numpy()) == buf and (goffs.numpy() == offs).all()
    assert (pages.decode_pages(cb, gbuf.numpy(), goffs.numpy()) == p).all()
    assert torch.equal(ep.stream_bits(t_in, tb).cpu(), _ref_bits(t_in.cpu(), ep.PageTables.from_codebook(cb)))


@pytest.mark.parametrize("channels", [32, 96])
def test_triton_encoder_writes_every_byte(real_kv, channels):
    """``encode_into`` writes every byte of its pages (headers, their padding, raw bytes, code words,
    the padding to ``align``) into a buffer full of garbage, for align 8, 16 and 32: the bytes equal
    the Rust encoder's with the same align. (96 channels: 3 streams, a header of 6 bytes padded to 8;
    32: 1 stream, 2 bytes padded to 8.)"""
    x, p = _pages(real_kv, layer=1, kind=1, channels=channels)
    p = p[:3]
    cb = pages.calibrate(x[32:], "bfloat16")
    tb = ep.PageTables.from_codebook(cb, device=DEVICE)
    t_in = _dev(p.view(np.int16))
    tids = torch.zeros(len(p), dtype=torch.int32, device=DEVICE)
    for align in (8, 16, 32):
        want, woffs = pages.encode_pages(cb, p, align)
        layout = ep.page_layout(t_in, tb, tids, align)
        assert (layout[1].cpu().numpy() == woffs).all(), align
        buf = torch.full((len(want) + 64,), 0xAB, dtype=torch.uint8, device=DEVICE)
        ep.encode_into(t_in, tb, tids, buf, layout, block_pages=2, align=align)
        buf = buf.cpu()
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


def test_triton_decoder_checks_offsets_and_buf(real_kv):
    """The decoder reads offsets[i] and the page words at pointer + index: offsets must be a contiguous
    1-D integer tensor of at least one entry, buf contiguous 1-D uint8 (typed errors, not a segfault
    through a strided view's other entries, a Triton type error or a torch RuntimeError)."""
    x, p = _pages(real_kv, layer=2, kind=0, channels=32)
    cb = pages.calibrate(x[32:], "bfloat16")
    tb = ep.PageTables.from_codebook(cb, device=DEVICE)
    raw, offs_np = pages.encode_pages(cb, p[:2])
    buf, offs = _dev(np.frombuffer(raw, np.uint8)), _dev(offs_np)
    want = _dev(p[:2].view(np.int16))
    assert torch.equal(ep.decode_pages(buf, offs.to(torch.int32), tb), want)  # int32 offsets are taken
    # a strided view over memory that starts with the real offsets (the old code decoded those: no error)
    strided = torch.cat([offs, offs])[::2]
    assert not strided.is_contiguous()
    bad_offsets = [offs.double(), offs.view(1, -1), offs[:0], strided, offs.tolist()]
    for bad in bad_offsets:
        with pytest.raises(InvalidArgumentError, match="offsets"):
            ep.decode_pages(buf, bad, tb)
    for bad in (torch.stack([buf, buf], 1).reshape(-1)[::2], buf.view(-1, 8), buf.view(torch.int8)):
        with pytest.raises(InvalidArgumentError, match="buf"):
            ep.decode_pages(bad, offs, tb)


def test_triton_escapes_and_bf16_specials():
    # Symbols never seen in calibration go through the escape; NaN, inf, -0 and subnormals survive.
    rng = np.random.default_rng(5)
    cal = (rng.standard_normal((64, 32)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    cb = pages.calibrate(cal, "bfloat16")
    special = np.array([0x7FC0, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x807F, 0x0000, 0xFFFF], np.uint16)
    p = rng.integers(0, 1 << 16, (1, 16, 32), dtype=np.uint16)
    p[0, 0, :8] = special
    buf, offs = pages.encode_pages(cb, p)
    tb = ep.PageTables.from_codebook(cb, device=DEVICE)
    dec = ep.decode_pages(_dev(np.frombuffer(buf, np.uint8)), _dev(offs), tb, kernel="triton")
    assert (dec.cpu().numpy().view(np.uint16) == p).all()
    gbuf, _ = ep.encode_pages(_dev(p.view(np.int16)), tb)
    assert bytes(gbuf.cpu().numpy()) == buf


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


def test_a_bit_set_in_the_slack_between_pages_is_corrupt(real_kv):
    """The bytes between a page's end and the next offset (alignment slack, and after the last page)
    are zeros, as every encoder writes them: a bit flipped there is CorruptDataError, not ignored."""
    x, p = _pages(real_kv, channels=32)
    cb = pages.calibrate(x, "bfloat16")
    buf, offs = pages.encode_pages(cb, p, align=32)
    slack = [at for i in range(len(offs) - 1)
             for at in range(int(offs[i]) + _page_len(cb, buf, int(offs[i])), int(offs[i + 1]))]
    assert slack and not any(buf[at] for at in slack)
    for at in slack:
        bad = bytearray(buf)
        bad[at] ^= 0x10
        with pytest.raises(CorruptDataError, match="slack"):
            pages.decode_pages(cb, bytes(bad), offs)
    assert (pages.decode_pages(cb, buf, offs) == p).all()


def _page_len(cb: bytes, buf: bytes, at: int) -> int:
    """The length of the page at ``at`` from its header (FORMAT.md: H + 16 C + 4 words)."""
    _, _, channels, _ = pages.codebook_info(cb)
    words = np.frombuffer(buf, np.uint16, channels // 32, at).astype(np.int64).sum()
    return pages.header_len(channels) + 16 * channels + 4 * int(words)


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


# ---------------------------------------------------------------------------------------------------
# The Gluon decoder (exact_page_gluon): its math in PyTorch on the CPU, compiled for sm_90 on the CPU,
# run on a Hopper GPU (TRITON_INTERPRET=0) against the Rust codec and the Triton decoder.
# ---------------------------------------------------------------------------------------------------

from weightszip.kernels import exact_page_gluon as eg  # noqa: E402

HOPPER = (os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available()
          and torch.cuda.get_device_capability()[0] == 9)


def _rust_pages(bits, dtype, max_len, cal):
    cb = pages.calibrate(cal, dtype, max_len)
    buf, offs = pages.encode_pages(cb, bits)
    return cb, torch.from_numpy(np.frombuffer(buf, np.uint8).copy()), torch.from_numpy(offs)


@pytest.mark.parametrize("max_len", [8, 10, 12])
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_window_decoder_math_inverts_rust_pages(real_kv, dtype, max_len):
    """The Gluon decoder's math (window tables, three-word window, escapes from the window's top),
    in PyTorch, decodes the Rust encoder's pages of real K and V bit for bit."""
    for kind in (0, 1):
        x, p = _pages(real_kv, layer=1, kind=kind)
        cb, buf, offs = _rust_pages(p, dtype, max_len, x[:32])
        tb = ep.PageTables.from_codebook(cb)
        assert torch.equal(tb.wlut, ep.window_table(tb.lut))
        dec = eg.window_decode_ref(buf, offs, tb.wlut[0], tb.max_len, tb.is_bf16)
        assert (dec.numpy().view(np.uint16) == p).all()


def test_window_decoder_math_escapes_and_window_table():
    rng = np.random.default_rng(7)
    cal = (rng.standard_normal((64, 32)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    cb = pages.calibrate(cal, "bfloat16")
    p = rng.integers(0, 1 << 16, (3, 16, 32), dtype=np.uint16)  # most symbols escaped (up to 16-bit codes)
    p[0, 0, :8] = [0x7FC0, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x807F, 0x0000, 0xFFFF]
    _, buf, offs = _rust_pages(p, "bfloat16", 8, cal)
    tb = ep.PageTables.from_codebook(cb)
    dec = eg.window_decode_ref(buf, offs, tb.wlut[0], tb.max_len, True)
    assert (dec.numpy().view(np.uint16) == p).all()
    # entry layout: used bits in 0-4, symbol in 5-12, escape in the sign bit with 8 more bits used
    lut = tb.lut[0].to(torch.int32)
    w = tb.wlut[0].to(torch.int32)
    esc = (lut >> 4) == 256
    assert esc.any() and (~esc).any()
    assert torch.equal(w < 0, esc)
    assert torch.equal(w & 31, (lut & 15) + 8 * esc)
    assert torch.equal(torch.where(esc, 0, (w >> 5) & 0xFF), torch.where(esc, 0, lut >> 4))


@pytest.mark.parametrize("max_len", [8, 10])
def test_ring_schedule_keeps_every_word_the_window_reads(real_kv, max_len):
    """The Gluon decoder's RING schedule (16 slots per stream, refilled every 8 symbols, a copy waited
    for two refills later), modelled in PyTorch with each copy landing as late and as early as the
    kernel allows: real pages and escape-heavy ones (up to max_len + 8 bits per symbol) decode bit
    for bit. With 8 slots, under the bound of 3 refills + 1, the escape-heavy pages do not."""
    rng = np.random.default_rng(3)
    x, p = _pages(real_kv, layer=1, kind=0)
    p = p.copy()
    p[1:3] = rng.integers(0, 1 << 16, (2, 16, p.shape[2]), dtype=np.uint16)
    cb, buf, offs = _rust_pages(p, "bfloat16", max_len, x[:32])
    tb = ep.PageTables.from_codebook(cb)
    for early in (False, True):
        dec = eg.window_decode_ref(buf, offs, tb.wlut[0], max_len, True, ring=16, early=early)
        assert (dec.numpy().view(np.uint16) == p).all(), early
    short = eg.window_decode_ref(buf, offs, tb.wlut[0], max_len, True, ring=8)
    assert not (short.numpy().view(np.uint16) == p).all()


def test_gluon_decoder_refuses_what_it_cannot_run(real_kv):
    x, p = _pages(real_kv, channels=32)
    cb, buf, offs = _rust_pages(p, "bfloat16", 8, x)
    tb = ep.PageTables.from_codebook(cb)
    assert not ep.gluon_applies(buf, tb, torch.empty(4, 16, 32, dtype=torch.int16))  # not on a GPU
    with pytest.raises(InvalidArgumentError):
        ep.decode_pages(buf, offs, tb, kernel="gluon")
    with pytest.raises(InvalidArgumentError):
        ep.decode_pages(buf, offs, tb, kernel="cuda")
    with pytest.raises(InvalidArgumentError):
        ep.decode_pages(buf, offs, tb, out=torch.empty(4, 16, 64, dtype=torch.int16))
    with pytest.raises(InvalidArgumentError):  # not 8-byte aligned
        ep.decode_pages(buf, offs, tb, out=torch.empty(4 * 16 * 32 + 1, dtype=torch.int16)[1:].view(4, 16, 32))
    with pytest.raises(InvalidArgumentError):
        eg.decode_into(buf, offs, tb.wlut, 8, 32, True, torch.empty(4, 16, 32, dtype=torch.int16),
                       torch.zeros(4, dtype=torch.int32), block_pages=96)
    # 256 x 256 words: 512 KB of shared memory; rings of 24 (not a power of two) and 8 (too short) words
    for bp, stage, ring in ((32, 300, False), (256, 256, False), (64, 24, True), (64, 8, True)):
        with pytest.raises(InvalidArgumentError):
            eg.decode_into(buf, offs, tb.wlut, 8, 32, True, torch.empty(4, 16, 32, dtype=torch.int16),
                           torch.zeros(4, dtype=torch.int32), bp, stage, ring)


_COMPILE_GLUON_DECODER = """
from weightszip.kernels import exact_page_gluon as eg
from weightszip.kernels.paged_decode_gluon import compile_for_hopper

for c, bp, ml, st, ring in ((1024, 32, 8, 64, 0), (96, 32, 10, 0, 0), (192, 128, 8, 96, 0), (4096, 256, 8, 0, 0),
                            (1024, 128, 8, 16, 1), (96, 256, 10, 16, 1)):
    s = c // 32
    k, spill = compile_for_hopper(eg.decode_kernel, dict(C=c, S=s, SP=1 << (s - 1).bit_length(), H=(2 * s + 7) // 8 * 8,
                                  L=ml, IS_BF16=True, BLOCK_PAGES=bp, STAGE=st, RING=bool(ring)),
                                  {"buf16_ptr": "*i16", "buf64_ptr": "*i64", "off_ptr": "*i64", "wlut_ptr": "*i16"},
                                  bp // 32)
    ptx = k.asm["ptx"]
    print("case", c, bp, ml, st, spill, k.metadata.shared, "ld.shared.s16" in ptx, "st.global.v4.b32" in ptx,
          "shf.l.clamp.b32" in ptx, ("cp.async.ca.shared.global" in ptx) == (st > 0))
"""


def test_gluon_decoder_compiles_for_hopper(compile_in_child):
    """The Gluon decoder compiles for sm_90 without a GPU, spilling at most 16 bytes; its only shared
    memory is one buffer (so it lies at offset 0 of ``global_smem``, where the inline PTX reads the
    tables and the staged words): the stream's 32 tables, then STAGE words per page (all of a stream's
    first words, or a ring), rounded up to a power of two."""
    out = compile_in_child(_COMPILE_GLUON_DECODER)
    cases = [ln.split()[1:] for ln in out.splitlines() if ln.startswith("case")]
    assert len(cases) == 6, out
    for c, bp, ml, st, spill, shared, *flags in cases:
        words = (32 << int(ml)) // 2 + int(st) * int(bp)
        assert int(spill) <= 16 and int(shared) == 4 << (words - 1).bit_length(), out
        assert flags == ["True"] * 4, out


@pytest.mark.skipif(not HOPPER, reason="the Gluon decoder runs on a Hopper GPU (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("channels,block_pages,stage,ring", [(32, 32, 64, 0), (192, 32, 64, 0), (96, 64, 0, 0),
                                                            (192, 256, 64, 0), (96, 128, 96, 0), (32, 128, 16, 1),
                                                            (192, 256, 16, 1)])
def test_gluon_decoder_equals_rust_and_triton_on_gpu(real_kv, channels, block_pages, stage, ring):
    """Real K and V of three layers, each its own codebook, pages interleaved so that programs mix
    codebooks (the global-table path) or not (shared tables), a page count no block size divides;
    the Gluon decoder gives back the Rust encoder's inputs and equals the Triton decoder."""
    tabs, bufs, offs, bits, base = [], [], [], [], 0
    for kind, layer in [(0, 0), (1, 1), (0, 2)]:  # max_len 10 (stacked codebooks share it)
        x = real_kv[kind, layer][:, :channels]
        p = np.concatenate([x.reshape(4, 16, channels)] * 25)  # 100 pages
        cb, b, o = _rust_pages(p, "bfloat16", 10, x[:32])
        tabs.append(ep.PageTables.from_codebook(cb, device="cuda"))
        bufs.append(b)
        offs.append(o[:-1] + base)
        base += b.numel()
        bits.append(p)
    # pages 0-99 codebook 0 (uniform programs), then codebooks 1 and 2 alternating page by page
    # (mixed programs); pages out of the buffer's order: any offsets work
    order = list(range(100)) + [j for k in range(100) for j in (100 + k, 200 + k)]
    tb = ep.PageTables.stack(tabs)
    buf = torch.cat(bufs).cuda()
    offsets = torch.cat([torch.cat(offs)[order], torch.tensor([base])]).cuda()
    tid = torch.tensor([i for i in range(3) for _ in range(100)], dtype=torch.int32)[order].cuda()
    cat_bits = np.concatenate(bits)[order]
    want = torch.from_numpy(cat_bits.view(np.int16).copy()).cuda()
    g = torch.zeros_like(want)
    eg.decode_into(buf, offsets, tb.wlut, tb.max_len, channels, True, g, tid, block_pages, stage, bool(ring))
    t = ep.decode_pages(buf, offsets, tb, table_ids=tid, kernel="triton")
    assert torch.equal(t, want)
    assert torch.equal(g, want)
    assert torch.equal(ep.decode_pages(buf, offsets, tb, table_ids=tid, kernel="gluon"), want)  # its defaults
    # out 8 bytes past a 16-byte boundary: the Triton decoder takes it, "gluon" refuses; 2 bytes
    # past: refused (the Triton decoder writes 8-byte words)
    raw = torch.empty(want.numel() + 4, dtype=torch.int16, device="cuda")
    out = raw[4:].view(want.shape)
    assert not ep.gluon_applies(buf, tb, out)
    assert torch.equal(ep.decode_pages(buf, offsets, tb, out=out, table_ids=tid), want)
    with pytest.raises(InvalidArgumentError):
        ep.decode_pages(buf, offsets, tb, out=out, table_ids=tid, kernel="gluon")
    with pytest.raises(InvalidArgumentError):
        ep.decode_pages(buf, offsets, tb, out=raw[1:-3].view(want.shape), table_ids=tid)


@pytest.mark.skipif(not HOPPER, reason="the Gluon decoder runs on a Hopper GPU (TRITON_INTERPRET=0)")
@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_gluon_decoder_escapes_and_specials_on_gpu(dtype):
    rng = np.random.default_rng(11)
    cal = (rng.standard_normal((64, 64)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    p = rng.integers(0, 1 << 16, (70, 16, 64), dtype=np.uint16)
    p[:35] = cal[:16][None]  # half the pages mostly short codes, half mostly escapes
    p[0, 0, :8] = [0x7FC0, 0x7F80, 0xFF80, 0x8000, 0x0001, 0x807F, 0x0000, 0xFFFF]
    cb, buf, offs = _rust_pages(p, dtype, 8, cal)
    tb = ep.PageTables.from_codebook(cb, device="cuda")
    g = ep.decode_pages(buf.cuda(), offs.cuda(), tb, kernel="gluon")
    assert (g.cpu().numpy().view(np.uint16) == p).all()
    r = torch.zeros_like(g)  # the ring: escape-heavy streams at up to 16 bits per symbol
    eg.decode_into(buf.cuda(), offs.cuda(), tb.wlut, 8, 64, dtype == "bfloat16", r,
                   torch.zeros(len(p), dtype=torch.int32, device="cuda"), 128, 16, True)
    assert torch.equal(r, g)
