"""KV Exact4 pages on the GPU (kernels.kv_exact4_codec): the encoder writes the reference encoder's
bytes; the validating decoder returns the reference decoder's values, or its error (class, page and
rule) for damaged pages. CPU runs use Triton's interpreter."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402
import pathlib  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

from weightszip.errors import CorruptDataError, InvalidArgumentError, TruncatedError  # noqa: E402
from weightszip.kernels import kv_exact4_codec as C4  # noqa: E402
from weightszip.kernels import kv_exact4_ref as R4  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"
DATA = pathlib.Path(__file__).parent / "data"
H, D = 3, 64


@pytest.fixture(scope="module")
def pages():
    """Six pages of real SmolLM2 K and V ([6, 16, 3, 64] int16 bits) with what real pages rarely hold:
    plain rows (a value far below its channel's top, one at 2**-60), exact zeros, a zero row,
    subnormals, and a channel whose top is 15 (the least)."""
    meta = json.loads((DATA / "kv_smollm2_64tok.json").read_text())
    assert meta["num_kv_heads"] == H and meta["head_dim"] == D
    a = np.load(DATA / "kv_smollm2_64tok.npy").astype(np.int16).reshape(2, 3, 64, H, D)
    x = torch.from_numpy(np.concatenate([a[0, 1, :48], a[1, 2, :48]])).reshape(6, 16, H, D).clone()
    x[0, 5, 1, 7] = 0x2000  # 2**-63: its row is plain
    x[1, 3, 2, 9] = -0x6000 + 0x1000  # a negative value far below its channel's top
    x[1, 4, 2, 9] = 0x2180  # a second plain row in the same head
    x[2, 2, 0, 9] = 0
    x[2, 3, 2, :] = 0
    x[3, 0, 0, 3] = 0x0001  # a subnormal: exponent 0, coded as 15
    x[4, :, 1, 5] = 0x0790  # exponent 15 in every row: top 15
    return x.to(DEVICE)


def _outcome(fn):
    try:
        return "ok", fn()
    except (TruncatedError, CorruptDataError) as e:
        return type(e).__name__, str(e)


def _same(a, b) -> bool:
    if a[0] != b[0]:
        return False
    return torch.equal(a[1], b[1]) if a[0] == "ok" else a[1] == b[1]


def test_encoder_writes_the_reference_bytes(pages):
    ref = R4.encode_pages(pages)
    assert ref.plain[0, 1, 5] and ref.plain[1, 2, 3] and ref.plain[1, 2, 4]  # the plain rows are there
    want, want_off = ref.to_bytes()
    got, off = C4.encode_pages(pages)
    assert torch.equal(off.cpu(), want_off.cpu()) and torch.equal(got.cpu(), want.cpu())
    # placed pages: the write pass at offsets of the caller's choice, bytes between them untouched
    ent, lengths = C4.page_entries(pages)
    assert torch.equal(lengths.cpu(), ref.lengths.cpu())
    assert torch.equal((ent & 0xFFFF).cpu(), (ref.plain.cpu().to(torch.int32) << torch.arange(16)).sum(2).to(torch.int32))
    gaps = torch.arange(len(pages), device=DEVICE) * 32
    starts = torch.nn.functional.pad(lengths.cumsum(0)[:-1], (1, 0)) + gaps
    buf = torch.full((int(starts[-1] + lengths[-1]) + 32,), 0xA5, dtype=torch.uint8, device=DEVICE)
    C4.write_pages(pages, ent, starts.contiguous(), buf)
    for i in range(len(pages)):
        s, n = int(starts[i]), int(lengths[i])
        assert torch.equal(buf[s:s + n].cpu(), want[int(want_off[i]):int(want_off[i + 1])].cpu())
        assert bool((buf[s + n:s + n + 32] == 0xA5).all())


def test_decoder_returns_the_values(pages):
    buf, off = R4.encode_pages(pages).to_bytes()
    assert torch.equal(C4.decode_pages(buf, off, H, D), pages)
    # heads one or two at a time (the plain rows of heads 1 and 2 counted across the steps)
    for step in (1, 2):
        assert torch.equal(C4.decode_pages(buf, off, H, D, heads_per_step=step), pages)
    for bad in (3, 0, 512):
        with pytest.raises(InvalidArgumentError):
            C4.decode_pages(buf, off, H, D, heads_per_step=bad)
    # offsets off the 16-byte grid (hostile): the reference decoder's verdict
    shifted = torch.cat([torch.zeros(8, dtype=torch.uint8, device=DEVICE), buf])
    got = _outcome(lambda: C4.decode_pages(shifted, torch.cat([off[:1], off + 8]), H, D))
    assert got[0] != "ok"
    assert _same(got, _outcome(lambda: R4.decode_pages(shifted, torch.cat([off[:1], off + 8]), H, D)))


def test_decoder_writes_into_the_callers_buffer(pages):
    """``out=``: the values land in the caller's tensor (the kernel's path and the reference's), the
    tensor comes back, and an out of the wrong shape, type or layout is refused before anything runs."""
    buf, off = R4.encode_pages(pages).to_bytes()
    out = torch.full_like(pages, -1)
    assert C4.decode_pages(buf, off, H, D, out=out) is out
    assert torch.equal(out, pages)
    x = pages[:2, :, :1, :].repeat(1, 1, 1, 2)[..., :96].contiguous()  # head_dim 96: the reference decoder
    xb, xo = R4.encode_pages(x).to_bytes()
    xout = torch.zeros_like(x)
    assert C4.decode_pages(xb, xo, 1, 96, out=xout) is xout
    assert torch.equal(xout, x)
    for bad in (pages.float(), pages[:-1].clone(), pages.transpose(2, 3).contiguous().transpose(2, 3),
                torch.empty((pages.shape[0], 16, H, D // 2), dtype=torch.int16, device=DEVICE)):
        with pytest.raises(InvalidArgumentError):
            C4.decode_pages(buf, off, H, D, out=bad)
    # an out off the 16-byte grid (2 bytes in): decoded, then copied in
    flat = torch.full((pages.numel() + 1,), -1, dtype=torch.int16, device=DEVICE)
    odd = flat[1:].view(pages.shape)
    assert odd.data_ptr() % 16 and C4.decode_pages(buf, off, H, D, out=odd) is odd and torch.equal(odd, pages)
    # an out over buf's bytes is refused (pages would be overwritten while programs read them)
    room = torch.zeros(buf.numel() + pages.numel() * 2, dtype=torch.uint8, device=DEVICE)
    room[: buf.numel()] = buf
    over = room[16:].view(torch.int16)[: pages.numel()].view(pages.shape)
    with pytest.raises(InvalidArgumentError, match="overlap"):
        C4.decode_pages(room[: buf.numel()], off, H, D, out=over)
    # a page that breaks a rule still raises with out= (what out then holds is unspecified), and the
    # next clean call is not told of it (the verdict flag is cleared per call)
    broken = _set(buf.clone(), 12, 1)[0]  # header padding
    got = _outcome(lambda: C4.decode_pages(broken, off, H, D, out=torch.empty_like(pages)))
    assert got[0] == "CorruptDataError" and _same(got, _outcome(lambda: R4.decode_pages(broken, off, H, D)))
    assert torch.equal(C4.decode_pages(buf, off, H, D, out=out), pages)


@pytest.mark.parametrize("rule, damage", [
    ("shorter than its plain rows", lambda b, o: (b[: int(o[1]) - 16], torch.tensor([0, int(o[1]) - 16]))),
    ("bytes of header and slots", lambda b, o: (b[:4800], torch.tensor([0, 4800]))),  # (16-byte aligned)
    ("nonzero header padding", lambda b, o: _set(b, 12, 1)),
    ("count of earlier plain rows", lambda b, o: _set(b, 4 + 2, 1)),
    ("longer than its plain rows", lambda b, o: (torch.cat([b[: int(o[1])], torch.zeros(128, dtype=torch.uint8,
                                                 device=b.device)]), torch.tensor([0, int(o[1]) + 128]))),
    ("codes or raw bytes are not zero", lambda b, o: _set(b, 16 + 25 * D * 1 + D + 5 * D // 2, 1)),
    ("codes or raw bytes are not zero", lambda b, o: _set(b, 16 + 25 * D * 1 + D + 5 * D // 2 + 3, 0x80)),  # sign bit
    ("codes or raw bytes are not zero", lambda b, o: _set(b, 16 + 25 * D * 1 + 9 * D + 5 * D + 3, 0x80)),  # raw
    ("window top below", lambda b, o: _set(b, 16 + 3, 14)),
    ("largest exponent", lambda b, o: _no_code_zero(b)),
])
def test_each_rule_gives_the_reference_error(pages, rule, damage):
    """Page 0 (a plain row in head 1) broken one rule at a time: the same class, page and message,
    with all heads in one step and one head a step."""
    buf, off = R4.encode_pages(pages[:1]).to_bytes()
    bad, boff = damage(buf.clone(), off)
    boff = boff.to(DEVICE)
    want = _outcome(lambda: R4.decode_pages(bad, boff, H, D))
    for step in (None, 1):
        got = _outcome(lambda: C4.decode_pages(bad, boff, H, D, heads_per_step=step))
        assert got[0] != "ok" and rule in got[1], got
        assert _same(got, want)


def _no_code_zero(b):
    """Channel 0 of head 0 coded 1 in every row: its largest exponent falls below its top."""
    for t in range(16):
        i = 16 + D + t * D // 2
        b[i] = (b[i] & 0xF0) | 1
    return b, torch.tensor([0, b.numel()])


def _set(b, i, v):
    b[i] = v
    return b, torch.tensor([0, b.numel()])


def test_plain_row_whose_values_all_have_codes_is_refused(pages):
    """A head's mask claims a plain row whose stored values all have codes (a canonical encoder codes
    that row): CorruptDataError, as the reference says."""
    x = pages[2:3].clone()  # no plain rows
    buf, off = R4.encode_pages(x).to_bytes()
    fixed = R4.page_length(H, D, 0)
    row = x[0, 6, 0].cpu()  # token 6 of head 0 becomes plain: header, zeroed slot row, its values
    hdr = buf[:16].clone()
    hdr[0] = 1 << 6
    hdr[6] = 1  # heads 1 and 2 count one plain row before them
    hdr[10] = 1
    body = buf[16:fixed].clone()
    body[D + 6 * D // 2: D + 7 * D // 2] = 0
    body[9 * D + 6 * D: 9 * D + 7 * D] = 0
    vals = torch.from_numpy(row.numpy().view(np.uint8).copy()).to(DEVICE)
    bad = torch.cat([hdr, body, vals])
    boff = torch.tensor([0, bad.numel()], device=DEVICE)
    got = _outcome(lambda: C4.decode_pages(bad, boff, H, D))
    assert got[0] == "CorruptDataError" and "all have codes" in got[1]
    assert _same(got, _outcome(lambda: R4.decode_pages(bad, boff, H, D)))


@settings(max_examples=12, deadline=None)
@given(data=st.data())
def test_damaged_pages_same_verdict_as_the_reference(pages, data):
    """Bit flips, byte overwrites and cuts anywhere in three pages: the kernel decodes what the
    reference decodes (the same values) and refuses what it refuses (the same error)."""
    buf, off = R4.encode_pages(pages[:3]).to_bytes()
    buf = buf.clone()
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, buf.numel() - 1))
        if data.draw(st.booleans()):
            buf[i] ^= 1 << data.draw(st.integers(0, 7))
        else:
            buf[i] = data.draw(st.integers(0, 255))
    if data.draw(st.booleans()):  # (at a multiple of 16: other offsets go to the reference decoder)
        cut = 16 * data.draw(st.integers(1, buf.numel() // 16))
        buf = buf[:cut].clone()
        off = off.clamp(max=cut)
    got = _outcome(lambda: C4.decode_pages(buf, off, H, D))
    assert _same(got, _outcome(lambda: R4.decode_pages(buf, off, H, D))), got


@pytest.mark.parametrize("change", [
    lambda o: o.index_put_((torch.tensor(0),), torch.tensor(16)),  # not from byte 0
    lambda o: o.index_put_((torch.tensor(3),), o[3] - 1),  # short of the buffer's end
    lambda o: o.index_put_((torch.tensor(1),), o[2] + 16),  # decreasing
    lambda o: o.index_put_((torch.tensor(2),), torch.tensor(-16)),  # negative
    lambda o: o.index_put_((torch.tensor(2),), torch.tensor(1 << 40)),  # past the buffer
    lambda o: o.index_put_((torch.tensor(1),), torch.tensor(-(1 << 63))),  # (differences wrap)
    lambda o: o.index_put_((torch.tensor(2),), o[2] - 8),  # unaligned, otherwise sound
])
def test_hostile_offsets_same_verdict_as_the_reference(pages, change):
    """Offsets that do not tile the buffer: the reference's error, read nothing outside the buffer;
    an unaligned split the kernels cannot take: the reference decoder's verdict."""
    buf, off = R4.encode_pages(pages[:3]).to_bytes()
    bad = change(off.cpu().clone()).to(DEVICE)
    got = _outcome(lambda: C4.decode_pages(buf, bad, H, D))
    assert _same(got, _outcome(lambda: R4.decode_pages(buf, bad, H, D))), got


def test_first_rule_broken_on_any_page_is_the_one_raised(pages):
    """Page 2's last head counts its earlier plain rows wrong, page 1 is too long, page 0 is sound: the
    count rule comes first in the reference's order, so its error names page 2."""
    one = [R4.encode_pages(pages[i:i + 1]).to_bytes()[0].clone() for i in range(3)]
    one[1] = torch.cat([one[1], torch.zeros(16, dtype=torch.uint8, device=DEVICE)])
    one[2][4 * (H - 1) + 2] ^= 1
    buf = torch.cat(one)
    off = torch.tensor([0, one[0].numel(), one[0].numel() + one[1].numel(), buf.numel()], device=DEVICE)
    got = _outcome(lambda: C4.decode_pages(buf, off, H, D))
    assert got[0] == "CorruptDataError" and got[1].startswith("page 2:") and "count" in got[1], got
    assert _same(got, _outcome(lambda: R4.decode_pages(buf, off, H, D)))


@settings(max_examples=15, deadline=None)
@given(data=st.data())
def test_plain_rows_and_tops_damaged_same_verdict(data):
    """The later rules, aimed at: pages of chosen tops (15, the least, up to 255) with plain rows,
    then a plain row's exponent moved (to its top, above it, to 0, into the window: its row all
    coded), its sign flipped, or a top moved; 1-4 heads of 32 or 64 channels. The kernel gives the
    reference's values or error."""
    h = data.draw(st.integers(1, 4))
    d = data.draw(st.sampled_from([32, 64]))
    n = data.draw(st.integers(1, 3))
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    top = rng.choice([15, 16, 20, 130, 255], size=(n, 1, h, d))
    e = np.where(rng.random((n, 16, h, d)) < 0.05, 0, top - rng.integers(0, 15, size=(n, 16, h, d)))
    plain = (rng.random((n, 16, h, 1)) < 0.2) & (np.arange(d) == rng.integers(0, d, size=(n, 16, h, 1)))
    e = np.clip(np.where(plain, top - rng.integers(15, 40, size=(n, 16, h, 1)), e), 1, 255)
    v = (rng.integers(0, 2, e.shape) << 15) | (e << 7) | rng.integers(0, 128, e.shape)
    x = torch.from_numpy(v.astype(np.uint16).view(np.int16)).to(DEVICE)
    enc = R4.encode_pages(x)
    buf, off = enc.to_bytes()
    buf = buf.clone()
    hdr = R4.header_bytes(h)
    fixed = hdr + 25 * d * h
    tops = torch.clamp(((x.to(torch.int32) >> 7) & 0xFF).amax(1), min=15).cpu()  # [n, H, D]
    for _ in range(data.draw(st.integers(1, 3))):
        p = data.draw(st.integers(0, n - 1))
        o = int(off[p])
        heads = [hh for hh in range(h) for tt in range(16) if enc.plain[p, hh, tt]]  # each plain row's head
        if heads and data.draw(st.booleans()):  # a value of a plain row, against its channel's top
            r = data.draw(st.integers(0, len(heads) - 1))
            c = data.draw(st.integers(0, d - 1))
            i = o + fixed + 2 * d * r + 2 * c
            val = int(buf[i]) | int(buf[i + 1]) << 8
            t = int(tops[p, heads[r], c])
            ex = data.draw(st.sampled_from([0, 1, t, min(t + 1, 255), max(t - 14, 1), (val >> 7) & 0xFF]))
            val = (val & 0x807F) | (ex << 7) ^ (0x8000 if data.draw(st.booleans()) else 0)
            buf[i], buf[i + 1] = val & 0xFF, val >> 8
        else:  # a top
            i = o + hdr + 25 * d * data.draw(st.integers(0, h - 1)) + data.draw(st.integers(0, d - 1))
            buf[i] = data.draw(st.sampled_from([14, 15, 16, (int(buf[i]) + 1) % 256, (int(buf[i]) - 1) % 256, 255]))
    step = data.draw(st.sampled_from([None, 1, 2]))  # all heads at once, or over several steps
    got = _outcome(lambda: C4.decode_pages(buf, off, h, d, heads_per_step=step))
    assert _same(got, _outcome(lambda: R4.decode_pages(buf, off, h, d))), got


def test_unaligned_values_and_other_shapes(pages):
    """Values 2 bytes off a 16-byte boundary encode (copied first); a shape the kernels do not take
    (head_dim 96) decodes through the reference decoder."""
    flat = torch.zeros(pages.numel() + 1, dtype=torch.int16, device=DEVICE)
    odd = flat[1:].view(pages.shape)
    odd.copy_(pages)
    assert odd.data_ptr() % 16 != 0
    assert torch.equal(C4.encode_pages(odd)[0], R4.encode_pages(pages).to_bytes()[0])
    x = pages[:2, :, :1, :].repeat(1, 1, 1, 2)[..., :96].contiguous()
    buf, off = R4.encode_pages(x).to_bytes()
    assert torch.equal(C4.decode_pages(buf, off, 1, 96), x)


def test_argument_checks(pages):
    with pytest.raises(InvalidArgumentError):
        C4.encode_pages(pages.float())
    with pytest.raises(InvalidArgumentError):
        C4.encode_pages(torch.zeros((1, 16, 2, 48), dtype=torch.int16, device=DEVICE))  # head_dim 48
    with pytest.raises(InvalidArgumentError):
        C4.decode_pages(torch.zeros(16, dtype=torch.uint8, device=DEVICE), torch.tensor([0, 16]), 257, 64)
    from weightszip.kv_exact import cpu_encode_exact4_pages

    with pytest.raises(InvalidArgumentError):  # float16 bits are not bf16 values
        cpu_encode_exact4_pages(torch.zeros((1, 16, H, D), dtype=torch.float16))
    ent, lengths = C4.page_entries(pages)
    with pytest.raises(InvalidArgumentError):  # entries of another shape
        C4.write_pages(pages, ent[:, :2].contiguous(), lengths, torch.empty(1 << 16, dtype=torch.uint8, device=DEVICE))
    assert C4.encode_pages(pages[:0])[0].numel() == 0
    assert C4.decode_pages(torch.zeros(0, dtype=torch.uint8, device=DEVICE), torch.tensor([0]), H, D).shape == (0, 16, H, D)


def test_rust_and_kernels_read_each_others_pages(pages):
    """Both ways with the Rust codec: the kernels decode Rust-encoded pages, Rust decodes the kernels'
    pages, and both encoders write the same bytes."""
    from weightszip.kv_exact import cpu_decode_exact4_pages, cpu_encode_exact4_pages

    host = pages.cpu().numpy().view(np.uint16)
    rbuf, roff = cpu_encode_exact4_pages(host)
    rb = torch.from_numpy(np.frombuffer(rbuf, np.uint8).copy()).to(DEVICE)
    assert torch.equal(C4.decode_pages(rb, torch.from_numpy(roff).to(DEVICE), H, D), pages)
    gb, go = C4.encode_pages(pages)
    assert torch.equal(gb, rb) and np.array_equal(go.cpu().numpy(), roff)
    assert np.array_equal(cpu_decode_exact4_pages(gb.cpu().numpy(), go.cpu().numpy(), H, D), host)
