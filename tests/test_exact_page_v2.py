"""Exact page profile, version 2 (docs/FORMAT.md, "Exact page profile, version 2"): sign and
exponent coded in context classes chosen by the previous token. The Rust codec on real KV and on
hostile input.

Real data: SmolLM2-135M layer 15 bf16 K and V over 1024 tokens (tests/data/kv_smollm2_1k_layer15),
calibrated on the first 512 tokens and measured on the last 512.
"""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from weightszip import pages
from weightszip.errors import CorruptDataError, InvalidArgumentError, TruncatedError, UnsupportedFeatureError


def _halves(real_kv_1k, kind):
    x = real_kv_1k[kind, 0]
    return x[:512], x[512:].reshape(-1, 16, x.shape[1])


@pytest.mark.parametrize("kind", [0, 1], ids=["K", "V"])
def test_round_trip_and_smaller_than_version_1_on_real_kv(real_kv_1k, kind):
    cal, ev = _halves(real_kv_1k, kind)
    size = {}
    for version in (1, 2):
        cb = pages.calibrate(cal, "bfloat16", version=version)
        assert pages.codebook_version(cb) == version
        buf, offs = pages.encode_pages(cb, ev)
        assert offs[0] == 0 and offs[-1] == len(buf) and (np.diff(offs) % 8 == 0).all()
        assert (pages.decode_pages(cb, buf, offs) == ev).all()
        size[version] = len(buf) / ev.nbytes
    # held out, one layer: K's signs and exponents persist from token to token, V's hardly
    # (this layer: K 0.967 of version 1, V 1.0004; bench_page_versions.py over every layer of two
    # models and two texts in BENCHMARKS.md)
    if kind == 0:
        assert size[2] < 0.98 * size[1], size
    else:
        assert size[2] < 1.005 * size[1], size


def test_codebook_fields(real_kv_1k):
    cal, _ = _halves(real_kv_1k, 0)
    cb = pages.calibrate(cal, "bfloat16", max_len=10, version=2)
    dtype, max_len, channels, lengths = pages.codebook_info(cb)
    assert (dtype, max_len, channels, lengths.shape) == ("bfloat16", 10, 192, (192, 3, 513))
    assert len(cb) == 12 + 192 + 192 * 3 * 513
    # each split is its channel's lower median exponent over the calibration tokens
    e = (cal >> 7) & 0xFF
    want = [int(np.sort(e[:, c])[(len(e) + 1) // 2 - 1]) for c in range(192)]
    assert pages.codebook_splits(cb).tolist() == want
    assert pages.codebook_splits(pages.calibrate(cal)).size == 0
    # every table is a complete code: its Kraft sum is one
    kraft = np.where(lengths > 0, 2.0 ** -lengths.astype(np.float64), 0).sum(-1)
    assert np.allclose(kraft, 1.0)


def test_unseen_values_take_the_escape(real_kv_1k):
    cal, _ = _halves(real_kv_1k, 1)
    cb = pages.calibrate(cal[:64], "bfloat16", version=2)
    rng = np.random.default_rng(3)
    odd = rng.integers(0, 1 << 16, size=(2, 16, 192), dtype=np.uint16)  # NaNs, infinities, subnormals
    odd[0, 0, 0] = 0xFFC0  # a NaN (sign 1, exponent 255) starting a page: class 0, coded as itself
    lengths = pages.codebook_info(cb)[3]
    assert lengths[0, 0, 0xFFC0 >> 7] == 0 and lengths[0, 0, 512] > 0  # so it takes the escape
    buf, offs = pages.encode_pages(cb, odd)
    assert (pages.decode_pages(cb, buf, offs) == odd).all()


def crafted_codebook(channels: int, lengths_of_table, splits: int = 128, max_len: int = 8) -> bytes:
    """A version-2 codebook's bytes (FORMAT.md) with every table's lengths from
    ``lengths_of_table``: uint8 [513]."""
    head = b"WZPB" + bytes([2, 1, max_len, 0]) + channels.to_bytes(4, "little") + bytes([splits] * channels)
    return head + np.tile(np.asarray(lengths_of_table, np.uint8), 3 * channels).tobytes()


def test_page_bound_is_tight_for_escapes_of_nine_bits():
    """Every value escaped, the escape's code the longest (8 bits): 8 + 9 bits a value, the largest
    page the codec's bound allows, exactly (a bound built on 8 escaped bits would be 4 words a
    stream short)."""
    from weightszip import offload as ol

    t = np.zeros(513, np.uint8)
    t[:255] = 8
    t[512] = 8  # 256 codes of 8 bits: complete
    cb = crafted_codebook(32, t)
    # negative first, then alternating signs: every coded symbol has bit 8 set (>= 256): escaped
    x = np.where(np.arange(16) % 2 == 0, 0xBF80, 0x3F80).astype(np.uint16)[None, :, None].repeat(32, 2)
    buf, offs = pages.encode_pages(cb, x, align=8)
    assert int(offs[1]) == ol.ExactPageCodec(cb).page_bound == pages.header_len(32) + 14 * 32 + 4 * 512 * 17 // 32
    assert (pages.decode_pages(cb, buf, offs) == x).all()


def test_a_codebook_without_escape_decodes_but_does_not_encode_what_it_lacks():
    t = np.zeros(513, np.uint8)
    t[127] = t[383] = 1  # +-2^0 only, and no escape: complete, so it parses
    cb = crafted_codebook(32, t)
    ok = np.full((1, 16, 32), 0x3F80, np.uint16)  # +1.0 everywhere: coded symbol 127 throughout
    buf, offs = pages.encode_pages(cb, ok)
    assert (pages.decode_pages(cb, buf, offs) == ok).all()
    with pytest.raises(InvalidArgumentError, match="escape"):
        pages.encode_pages(cb, np.full((1, 16, 32), 0x4000, np.uint16))  # 2.0: exponent 128, no code


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 3), max_len=st.integers(2, 12), cal_tokens=st.integers(0, 40))
def test_property_round_trip(seed, n, max_len, cal_tokens):
    rng = np.random.default_rng(seed)
    base = rng.standard_normal((n * 16 + cal_tokens, 32)).astype(np.float32)
    base *= np.exp2(rng.integers(-8, 8, size=(1, 32)))
    base[rng.random(base.shape) < 0.05] *= -1e30
    x = (base.view(np.uint32) >> 16).astype(np.uint16)
    cb = pages.calibrate(x[:cal_tokens], "bfloat16", max_len, version=2)
    p = x[cal_tokens:].reshape(n, 16, 32)
    buf, offs = pages.encode_pages(cb, p)
    assert (pages.decode_pages(cb, buf, offs) == p).all()


def test_hostile_input_raises_typed_errors(real_kv_1k):
    cal, ev = _halves(real_kv_1k, 0)
    cb = pages.calibrate(cal, "bfloat16", version=2)
    buf, offs = pages.encode_pages(cb, ev[:2])
    page = bytes(buf[: offs[1]])
    with pytest.raises(TruncatedError):
        pages.codebook_info(cb[:-1])
    with pytest.raises(CorruptDataError):
        pages.codebook_info(cb + b"\0")
    with pytest.raises(UnsupportedFeatureError):
        pages.codebook_info(cb[:5] + b"\x02" + cb[6:])  # fp16 is version 1 only
    with pytest.raises(InvalidArgumentError):
        pages.calibrate(cal, "float16", version=2)
    with pytest.raises(InvalidArgumentError):
        pages.calibrate(cal, "bfloat16", version=3)
    with pytest.raises((TruncatedError, CorruptDataError)):
        pages.decode_pages(cb, page[:-8], [0, len(page) - 8])
    # a version-1 codebook does not read version-2 pages as values: the raw part's length differs
    with pytest.raises((TruncatedError, CorruptDataError)):
        pages.decode_pages(pages.calibrate(cal), buf, offs)
    # any single bit flipped: a typed error or other values, never a crash
    rng = np.random.default_rng(0)
    for at in rng.integers(0, len(page), 64):
        bad = bytearray(page)
        bad[at] ^= 1 << int(rng.integers(0, 8))
        try:
            pages.decode_pages(cb, bytes(bad), [0, len(page)])
        except (CorruptDataError, TruncatedError):
            pass


# ---------------------------------------------------------------------------------------------------
# The Triton encoder and decoder (weightszip.kernels.exact_page2) and their plain-PyTorch reference
# (exact_page_ref.encode_pages_ref2 / decode_pages_ref2): the Rust codec's bytes, both ways. Triton
# runs in its interpreter here (TRITON_INTERPRET=1, set before triton is imported), compiled on a GPU
# with TRITON_INTERPRET=0.
# ---------------------------------------------------------------------------------------------------

import os  # noqa: E402

os.environ.setdefault("TRITON_INTERPRET", "1")
torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from weightszip.kernels import exact_page as ep  # noqa: E402
from weightszip.kernels import exact_page2 as ep2  # noqa: E402
from weightszip.kernels import exact_page_ref as ref  # noqa: E402

DEVICE = "cuda" if os.environ.get("TRITON_INTERPRET") != "1" and torch.cuda.is_available() else "cpu"


def _dev(a):
    return torch.from_numpy(np.ascontiguousarray(a)).to(DEVICE)


def _small(real_kv_1k, kind=0, channels=64, n=3):
    x = np.ascontiguousarray(real_kv_1k[kind, 0][:, :channels])
    return pages.calibrate(x[:512], version=2), x[512: 512 + 16 * n].reshape(n, 16, channels)


@pytest.mark.parametrize("kind", [0, 1], ids=["K", "V"])
def test_reference_and_triton_write_and_read_the_rust_bytes(real_kv_1k, kind):
    cb, p = _small(real_kv_1k, kind)
    buf, offs = pages.encode_pages(cb, p)
    tb = ep2.PageTables2.from_codebook(cb)
    t_in = torch.from_numpy(p.view(np.int16))
    rbuf, roffs = ref.encode_pages_ref2(t_in, torch.from_numpy(pages.encode_table(cb)), tb.splits[0])
    assert bytes(rbuf.numpy()) == buf and (roffs.numpy() == offs).all()
    assert torch.equal(ref.decode_pages_ref2(rbuf, roffs, tb.lut[0], tb.splits[0], tb.max_len), t_in)
    tbd = ep2.PageTables2.from_codebook(cb, device=DEVICE)
    gbuf, goffs = (a.cpu() for a in ep2.encode_pages(_dev(p.view(np.int16)), tbd, block_pages=2))
    assert bytes(gbuf.numpy()) == buf and (goffs.numpy() == offs).all()
    dec = ep2.decode_pages(_dev(np.frombuffer(buf, np.uint8)), _dev(offs), tbd, block_pages=2)
    assert torch.equal(dec.cpu(), t_in)


def test_triton_escapes_specials_and_table_ids(real_kv_1k):
    # values never seen in calibration (NaN, infinities, subnormals, -0, sign changes everywhere) go
    # through the escape's 9 bits; two codebooks in one launch, pages naming theirs
    cb0, p = _small(real_kv_1k, 0, channels=32, n=2)
    cb1 = pages.calibrate(np.ascontiguousarray(real_kv_1k[1, 0][:512, :32]), version=2)
    rng = np.random.default_rng(11)
    odd = rng.integers(0, 1 << 16, size=(2, 16, 32), dtype=np.uint16)
    odd[0, :, :4] = [0x7FC0, 0xFF80, 0x0001, 0x8000]
    allp = np.concatenate([p, odd])
    tids = np.array([0, 1, 1, 0], np.int32)
    want = [pages.encode_pages(cb, allp[i: i + 1]) for i, cb in zip(range(4), (cb0, cb1, cb1, cb0))]
    tb = ep2.PageTables2.stack([ep2.PageTables2.from_codebook(cb, DEVICE) for cb in (cb0, cb1)])
    gbuf, goffs = (a.cpu() for a in ep2.encode_pages(_dev(allp.view(np.int16)), tb, _dev(tids), block_pages=2))
    for i, (wb, _) in enumerate(want):
        a = int(goffs[i])
        assert bytes(gbuf[a: a + len(wb)].numpy()) == wb, i
    dec = ep2.decode_pages(_dev(gbuf.numpy()), _dev(goffs.numpy()), tb, table_ids=_dev(tids), block_pages=2)
    assert (dec.cpu().numpy().view(np.uint16) == allp).all()


@pytest.mark.parametrize("channels", [32, 96])
def test_triton_encoder_writes_every_byte(real_kv_1k, channels):
    """``encode_into`` writes every byte of its pages into a buffer full of garbage, for align 8, 16
    and 32 (96 channels: 3 streams, a 6-byte header padded to 8)."""
    cb, p = _small(real_kv_1k, 1, channels=channels, n=3)
    tb = ep2.PageTables2.from_codebook(cb, device=DEVICE)
    t_in = _dev(p.view(np.int16))
    tids = torch.zeros(len(p), dtype=torch.int32, device=DEVICE)
    for align in (8, 16, 32):
        want, woffs = pages.encode_pages(cb, p, align)
        layout = ep2.page_layout(t_in, tb, tids, align)
        assert (layout[1].cpu().numpy() == woffs).all(), align
        buf = torch.full((len(want) + 64,), 0xAB, dtype=torch.uint8, device=DEVICE)
        ep2.encode_into(t_in, tb, tids, buf, layout, block_pages=2, align=align)
        buf = buf.cpu()
        assert bytes(buf[: len(want)].numpy()) == want, align
        assert (buf[len(want):] == 0xAB).all(), align


@settings(max_examples=6, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), max_len=st.integers(2, 12), persist=st.floats(0.0, 1.0))
def test_property_rust_reference_and_triton_agree(seed, max_len, persist):
    # random bf16 values whose signs persist from token to token with probability ``persist``
    rng = np.random.default_rng(seed)
    v = (rng.standard_normal((48, 32)) * np.exp2(rng.integers(-6, 6, size=(1, 32)))).astype(np.float32)
    flip = np.cumsum(rng.random((48, 32)) > persist, 0) % 2 == 1
    x = (np.where(flip, -v, v).view(np.uint32) >> 16).astype(np.uint16)
    cb = pages.calibrate(x[:16], "bfloat16", max_len, version=2)
    p = x[16:].reshape(2, 16, 32)
    buf, offs = pages.encode_pages(cb, p)
    tb = ep2.PageTables2.from_codebook(cb, DEVICE)
    rbuf, _ = ref.encode_pages_ref2(torch.from_numpy(p.view(np.int16)), torch.from_numpy(pages.encode_table(cb)),
                                    tb.splits[0].cpu())
    assert bytes(rbuf.numpy()) == buf
    gbuf, _ = ep2.encode_pages(_dev(p.view(np.int16)), tb, block_pages=2)
    assert bytes(gbuf.cpu().numpy()) == buf
    dec = ep2.decode_pages(_dev(np.frombuffer(buf, np.uint8)), _dev(offs), tb, block_pages=2)
    assert (dec.cpu().numpy().view(np.uint16) == p).all()


def test_gpu_encoder_refuses_a_codebook_without_escape():
    # the Rust encoder refuses the values such a codebook cannot code; the GPU encoder, which does
    # not look at the values on the host, refuses the codebook (it would write undecodable pages)
    t = np.zeros(513, np.uint8)
    t[127] = t[383] = 1
    tb = ep2.PageTables2.from_codebook(crafted_codebook(32, t))
    assert not tb.encodable
    with pytest.raises(InvalidArgumentError, match="escape"):
        ep2.encode_pages(torch.full((1, 16, 32), 0x3F80, dtype=torch.int16), tb)
    t1 = np.zeros(257, np.uint8)
    t1[127] = t1[128] = 1
    cb1 = b"WZPB" + bytes([1, 1, 8, 0]) + (32).to_bytes(4, "little") + np.tile(t1, 32).tobytes()
    tb1 = ep.PageTables.from_codebook(cb1)
    assert not tb1.encodable and not ep.PageTables.stack([tb1, tb1]).encodable
    with pytest.raises(InvalidArgumentError, match="escape"):
        ep.encode_pages(torch.full((1, 16, 32), 0x3F80, dtype=torch.int16), tb1)


def test_versions_are_not_mixed_up(real_kv_1k):
    cb2, p = _small(real_kv_1k, 0, channels=32, n=1)
    cb1 = pages.calibrate(np.ascontiguousarray(real_kv_1k[0, 0][:512, :32]))
    with pytest.raises(InvalidArgumentError, match="version-1"):
        ep.PageTables.from_codebook(cb2)
    with pytest.raises(InvalidArgumentError, match="version-2"):
        ep2.PageTables2.from_codebook(cb1)
    tb = ep2.PageTables2.from_codebook(cb2)
    with pytest.raises(InvalidArgumentError, match="values"):
        ep2.encode_pages(torch.zeros(1, 16, 64, dtype=torch.int16), tb)
    with pytest.raises(InvalidArgumentError, match="offsets"):
        ep2.decode_pages(torch.zeros(8, dtype=torch.uint8), torch.zeros(2, dtype=torch.float32), tb)
    with pytest.raises(InvalidArgumentError, match="Triton decoder only"):
        ep2.decode_into(torch.zeros(8, dtype=torch.uint8), torch.zeros(2, dtype=torch.int64), tb,
                        torch.zeros(1, 16, 32, dtype=torch.int16), torch.zeros(1, dtype=torch.int32), kernel="gluon")


_COMPILE_V2 = """
from weightszip.kernels import exact_page2 as ep2
from weightszip.kernels.paged_decode_gluon import compile_for_hopper

for c, s, h in ((1024, 32, 64), (96, 3, 8)):
    _, a = compile_for_hopper(ep2._layout_kernel2, dict(C=c, S=s, SP=32 if s > 3 else 4, H=h, ALIGN=8),
                              {"vals_ptr": "*i16", "enc_ptr": "*i32", "split_ptr": "*i32", "tid_ptr": "*i32",
                               "words_ptr": "*i32", "wstart_ptr": "*i32", "size_ptr": "*i64"}, 4)
    _, b = compile_for_hopper(ep2._encode_kernel2, dict(C=c, S=s, H=h, TAIL_WORDS=1, BLOCK_PAGES=128),
                              {"vals_ptr": "*i64", "enc_ptr": "*i32", "split_ptr": "*i32", "buf32_ptr": "*i32",
                               "buf16_ptr": "*i16", "off_ptr": "*i64", "words_ptr": "*i32", "wstart_ptr": "*i32",
                               "tid_ptr": "*i32"}, 4)
    _, d = compile_for_hopper(ep2._decode_kernel2, dict(C=c, S=s, SP=32 if s > 3 else 4, H=h, L=8, BLOCK_PAGES=32),
                              {"buf32_ptr": "*i32", "buf16_ptr": "*i16", "off_ptr": "*i64", "lut_ptr": "*i16",
                               "split_ptr": "*i32", "out_ptr": "*i64", "tid_ptr": "*i32"}, 1)
    print("spills", a, b, d)
"""


def test_version_2_kernels_compile_for_hopper(compile_in_child):
    """The version-2 layout, encode and decode kernels compile for sm_90 without a GPU, without spills,
    at the Llama-3.1-8B width (1024 channels) and at 3 streams."""
    out = compile_in_child(_COMPILE_V2)
    lines = [ln.split() for ln in out.splitlines() if ln.startswith("spills")]
    assert [ln[1:] for ln in lines] == [["0", "0", "0"]] * 2, out


@pytest.mark.parametrize("version", [1, 2])
def test_threads_write_and_read_the_same_bytes_and_name_the_first_bad_page(real_kv_1k, version):
    # 384 pages (K and V of 1024 tokens, three times): 6 tasks of 64 pages on 2 or more threads
    cal, _ = _halves(real_kv_1k, 0)
    pg = np.concatenate([real_kv_1k[:, 0].reshape(-1, 16, real_kv_1k.shape[-1])] * 3)
    cb = pages.calibrate(cal, "bfloat16", version=version)
    buf, offs = pages.encode_pages(cb, pg, threads=1)
    for threads in (0, 2, 3):
        b, o = pages.encode_pages(cb, pg, threads=threads)
        assert b == buf and (o == offs).all()
        assert (pages.decode_pages(cb, buf, offs, threads=threads) == pg).all()
    bad = bytearray(buf)
    for i in (100, 150):  # two pages in different tasks: a header padding byte set
        bad[offs[i] + 2 * 192 // 32] = 1
    for threads in (1, 0, 2):
        with pytest.raises(CorruptDataError, match="page 100: page header padding"):
            pages.decode_pages(cb, bytes(bad), offs, threads=threads)
    with pytest.raises(InvalidArgumentError, match="threads"):
        pages.encode_pages(cb, pg, threads=-1)


def test_parsed_codebooks_are_kept_by_their_bytes(real_kv_1k):
    # The bindings keep parsed codebooks for the next call: alternating codebooks each decode
    # their own pages, and a codebook changed in place is parsed anew (a broken one is refused,
    # never served from what its old bytes parsed to).
    cal_k, ev_k = _halves(real_kv_1k, 0)
    cal_v, ev_v = _halves(real_kv_1k, 1)
    cbs = [pages.calibrate(c, "bfloat16", version=v) for v in (1, 2) for c in (cal_k, cal_v)]
    coded = [pages.encode_pages(cb, ev) for cb, ev in zip(cbs, [ev_k, ev_v] * 2)]
    for _ in range(2):
        for cb, ev, (buf, offs) in zip(cbs, [ev_k, ev_v] * 2, coded):
            assert (pages.decode_pages(cb, buf, offs) == ev).all()
    cb = bytearray(cbs[3])
    buf, offs = coded[3]
    assert (pages.decode_pages(cb, buf, offs) == ev_v).all()
    cb[8] ^= 0xFF  # the channel count: 192 -> 63, the length no longer the declared one
    with pytest.raises(CorruptDataError, match="header declares"):
        pages.decode_pages(cb, buf, offs)
    cb[8] ^= 0xFF
    assert (pages.decode_pages(cb, buf, offs) == ev_v).all()
