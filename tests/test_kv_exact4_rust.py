"""KV Exact4 pages: the Rust codec (weightszip_core::kvx4, through ``kv_exact.cpu_encode_exact4_pages``
/ ``cpu_decode_exact4_pages``) against the PyTorch reference (``kv_exact4_ref``): the same bytes and
offsets from the same values, each decodes the other's pages, and on damaged or hostile input both
decoders accept the same pages (decoding them to the same values) and reject the rest with the same
error class (TruncatedError or CorruptDataError). CPU only. Real KV: tests/data/kv_smollm2_64tok.npy
(conftest's ``real_kv``: SmolLM2-135M, 3 layers, 64 tokens, 3 KV heads of 64).
"""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import re  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from hypothesis import given, settings, strategies as st  # noqa: E402

from weightszip.errors import (  # noqa: E402
    CorruptDataError,
    InvalidArgumentError,
    LimitExceededError,
    TruncatedError,
    WeightszipError,
)
from weightszip.kernels import kv_exact4_ref as R4  # noqa: E402
from weightszip.kv_exact import cpu_decode_exact4_pages, cpu_encode_exact4_pages  # noqa: E402

H, D = 3, 64
TINY = 0x2180  # 2**-60: far below any real channel's top, so its token row is plain


@pytest.fixture(scope="module")
def real(real_kv):
    """int16 bits [2 (K, V), 3 layers, 64 tokens, 3, 64] of real SmolLM2 KV."""
    return torch.from_numpy(real_kv.astype(np.int16)).reshape(2, 3, 64, H, D)


def pages_of(x):
    return x.reshape(-1, 16, *x.shape[1:])


def with_specials(x: torch.Tensor, seed: int, every: int = 300) -> torch.Tensor:
    """``x`` (int16 bits [n, 16, h, d]) with about one value in ``every`` replaced by +-2**-60 (a plain
    row), and as many by exact zeros, -0 and subnormals (code 15, never plain)."""
    g = torch.Generator().manual_seed(seed)
    y = x.clone().to(torch.int32)
    r = torch.randint(0, every, y.shape, generator=g)
    sign = torch.randint(0, 2, y.shape, generator=g) << 15
    y = torch.where(r == 0, TINY | sign, y)
    y = torch.where(r == 1, sign, y)  # +-0
    y = torch.where(r == 2, sign | torch.randint(1, 128, y.shape, generator=g), y)  # subnormals
    return y.to(torch.int16)


def random_pages(n, h, d, seed):
    """Random bit patterns (most rows plain), a page of exponents 120-127 (coded) and one of zeros and
    subnormals (code 15)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(-(2**15), 2**15, (n, 16, h, d), generator=g, dtype=torch.int32)
    x[0] = (x[0] & 0x83FF) | 0x3C00
    x[1] = x[1] & 0x807F
    return x.to(torch.int16)


def plain_rows(buf: bytes, offs, heads: int) -> int:
    """Plain rows of all pages, from their header masks."""
    b = np.frombuffer(buf, np.uint8)
    return sum(int.from_bytes(b[o + 4 * h: o + 4 * h + 2].tobytes(), "little").bit_count()
               for o in offs[:-1] for h in range(heads))


def u16(t: torch.Tensor) -> np.ndarray:
    return t.numpy().view(np.uint16)


def check_same_bytes(x: torch.Tensor):
    """Both encoders write the same bytes and offsets for ``x`` and each decoder reads both back."""
    h, d = x.shape[2:]
    buf, offs = R4.encode_pages(x).to_bytes()
    rbuf, roffs = cpu_encode_exact4_pages(x)
    assert roffs.dtype == np.int64 and roffs.tolist() == offs.tolist()
    assert rbuf == bytes(buf.numpy())
    assert (cpu_decode_exact4_pages(bytes(buf.numpy()), offs.numpy(), h, d) == u16(x)).all()
    rt = torch.frombuffer(bytearray(rbuf), dtype=torch.uint8)
    assert torch.equal(R4.decode_pages(rt, torch.from_numpy(roffs), h, d), x)
    return rbuf, roffs


def test_same_bytes_on_real_kv(real):
    for kind in range(2):
        for layer in range(3):
            x = pages_of(real[kind, layer])
            rbuf, roffs = check_same_bytes(x)
            assert 0.78 < len(rbuf) / (x.numel() * 2) < 0.80


def test_same_bytes_with_plain_rows_zeros_and_subnormals(real):
    x = torch.cat([pages_of(real[k, layer]) for k in range(2) for layer in range(3)])  # [24, 16, 3, 64]
    for seed, every in [(1, 300), (2, 40), (3, 5000)]:
        y = with_specials(x, seed, every)
        rbuf, roffs = check_same_bytes(y)
        assert plain_rows(rbuf, roffs, H) > 0, "the injected 2**-60 values make plain rows"
    # zeros and subnormals alone never make a row plain: the plain rows of the real values alone
    z = with_specials(x, 4, 50)
    z = torch.where(z.to(torch.int32) & 0x7FFF == TINY, 0, z.to(torch.int32)).to(torch.int16)
    rbuf, roffs = check_same_bytes(z)
    assert bool((z == 0).any()) and bool(((z > 0) & (z < 128)).any())
    assert plain_rows(rbuf, roffs, H) == plain_rows(*cpu_encode_exact4_pages(x), H)


@pytest.mark.parametrize("shape", [(1, 32), (2, 32), (5, 96), (17, 32)])
def test_same_bytes_on_random_bits_and_every_pattern(shape):
    """Random patterns at several shapes (17 heads: a padded header), and all 65536 bf16 patterns
    (NaN, Inf, -0, subnormals) in order and shuffled."""
    h, d = shape
    rbuf, roffs = check_same_bytes(random_pages(4, h, d, h * d))
    assert 0 < plain_rows(rbuf, roffs, h) < 4 * 16 * h
    if shape == (2, 32):
        allbits = torch.arange(65536, dtype=torch.int32).to(torch.int16).reshape(-1, 16, 2, 32)
        check_same_bytes(allbits)
        perm = torch.randperm(allbits.shape[0] * 16, generator=torch.Generator().manual_seed(0))
        check_same_bytes(allbits.reshape(-1, 2, 32)[perm].reshape(-1, 16, 2, 32))


def test_argument_checks():
    x = torch.zeros((1, 16, 2, 32), dtype=torch.int16)
    buf, offs = cpu_encode_exact4_pages(x)
    for h, d in [(2, 48), (0, 32), (257, 32), (2, 0)]:
        with pytest.raises(InvalidArgumentError):
            cpu_decode_exact4_pages(buf, offs, h, d)
        with pytest.raises(InvalidArgumentError):
            R4.decode_pages(torch.frombuffer(bytearray(buf), dtype=torch.uint8), torch.from_numpy(offs), h, d)
    with pytest.raises(InvalidArgumentError):
        cpu_encode_exact4_pages(torch.zeros((1, 16, 257, 32), dtype=torch.int16))
    with pytest.raises(InvalidArgumentError):
        cpu_encode_exact4_pages(torch.zeros((1, 16, 2, 48), dtype=torch.int16))
    with pytest.raises(InvalidArgumentError):
        cpu_encode_exact4_pages(torch.zeros((1, 8, 2, 32), dtype=torch.int16))
    with pytest.raises(InvalidArgumentError):
        cpu_decode_exact4_pages(buf, [], 2, 32)
    with pytest.raises(LimitExceededError):  # the Rust codec's bound on a page's channels
        cpu_encode_exact4_pages(torch.zeros((1, 16, 256, 512), dtype=torch.int16))
    assert cpu_decode_exact4_pages(b"", [0], 2, 32).shape == (0, 16, 2, 32)


# -- damaged and hostile pages: the same verdicts ---------------------------------------------------


def verdict(decode):
    """("ok", values) or ("err", the error's class, the page its message names or None)."""
    try:
        out = decode()
    except (TruncatedError, CorruptDataError) as e:
        assert type(e) in (TruncatedError, CorruptDataError), type(e)
        m = re.search(r"page (\d+)", str(e))
        return "err", type(e), int(m.group(1)) if m else None
    return "ok", np.asarray(out).view(np.uint16)


def same_verdict(bad: torch.Tensor, offs: torch.Tensor, h=H, d=D):
    """Both decoders on the same bytes and offsets: the same verdict; returns it."""
    rust = verdict(lambda: cpu_decode_exact4_pages(bytes(bad.numpy()), offs.numpy(), h, d))
    ref = verdict(lambda: R4.decode_pages(bad, offs, h, d).numpy())
    assert rust[0] == ref[0], (rust[:2], ref[:2])
    if ref[0] == "ok":
        assert (rust[1] == ref[1]).all()
        b2, o2 = R4.encode_pages(torch.from_numpy(ref[1].view(np.int16))).to_bytes()  # canonical
        assert torch.equal(b2, bad) and torch.equal(o2, offs.to(torch.int64))
    else:
        assert rust[1] is ref[1], (rust, ref)
    return rust, ref


@pytest.fixture(scope="module")
def pages(real):
    """Five pages: two real V pages, one with injected plain rows, one of random bits (mostly plain
    rows) and one of coded exponents; as (values, bytes, offsets)."""
    x = torch.cat([pages_of(real[1, 2])[:2], with_specials(pages_of(real[0, 1])[1:2], 5, 100),
                   random_pages(3, H, D, 7)[2:], random_pages(3, H, D, 8)[:1]])
    buf, offs = R4.encode_pages(x).to_bytes()
    return x, buf, offs


def test_hostile_examples_agree(pages):
    """Hand-made damage, each with the error class both decoders must give."""
    x, buf, offs = pages
    n = buf.numel()
    hdr = R4.header_bytes(H)
    cases = []  # (bytes, offsets, expected class)

    def case(b, o, cls):
        cases.append((b, torch.as_tensor(o, dtype=torch.int64), cls))

    case(buf[:-16], offs.clamp(max=n - 16), TruncatedError)  # the last page short of a row
    case(buf[:-16], offs, TruncatedError)  # offsets past the end
    case(buf, offs[:-1], TruncatedError)  # offsets short of the end
    wrap = 6148914691236517205  # differences that wrap around int64
    case(buf, [0, wrap, 2 * wrap - 2**64, n], CorruptDataError)
    case(buf, [0, -16, n], CorruptDataError)
    case(buf, [0, -(2**63), n], CorruptDataError)
    case(buf, [0, 2**63 - 1, n], CorruptDataError)
    case(buf, [0, n + 16, n], CorruptDataError)
    case(buf, [-16, n], TruncatedError)
    case(buf, [0, int(offs[2]), int(offs[1]), n], CorruptDataError)
    case(buf, [0, 16, n], TruncatedError)  # a page shorter than its header and slots
    bad = buf.clone()
    bad[2] ^= 1  # head 0's count
    case(bad, offs, CorruptDataError)
    bad = buf.clone()
    bad[4 * H] = 1  # header padding
    case(bad, offs, CorruptDataError)
    bad = buf.clone()
    bad[hdr] = 14  # a top below 15
    case(bad, offs, CorruptDataError)

    def free_row(o, head):  # a coded token row of the page at o, head ``head``
        mask = int.from_bytes(bytes(buf[o + 4 * head: o + 4 * head + 2].numpy()), "little")
        return next(t for t in range(16) if not mask >> t & 1)

    bad = buf.clone()
    t = free_row(0, H - 1)
    bad[4 * (H - 1) + t // 8] ^= 1 << (t % 8)  # page 0's last head claims one more plain row: short
    case(bad, offs, TruncatedError)
    bad = buf.clone()
    bad[int(offs[4]) - 1] ^= 1  # a plain value of page 3 (random bits) changed: an error or another page
    assert int(offs[4]) - int(offs[3]) > R4.page_length(H, D, 0)
    cases.append((bad, offs, None))
    # page 2 (injected plain rows): its first plain row's values all given codes (each at its
    # channel's top), or a code or raw byte of that row not zero
    o2 = int(offs[2])
    masks = [int.from_bytes(bytes(buf[o2 + 4 * h: o2 + 4 * h + 2].numpy()), "little") for h in range(H)]
    head = next(h for h in range(H) if masks[h])
    row = (masks[head] & -masks[head]).bit_length() - 1
    slot = o2 + hdr + head * R4.coded_head_bytes(D)
    tops = buf[slot: slot + D][torch.argsort(R4.half_order(D))].to(torch.int32)  # channel order
    first = o2 + R4.page_length(H, D, 0)
    bad = buf.clone()
    bad[first: first + 2 * D] = torch.stack([(tops << 7) & 0xFF, tops >> 1], -1).reshape(-1).to(torch.uint8)
    case(bad, offs, CorruptDataError)
    for at in (slot + D + row * D // 2, slot + 9 * D + row * D + 5):
        bad = buf.clone()
        bad[at] = 0x20
        case(bad, offs, CorruptDataError)
    # page 0 corrupt in its body, page 4 short of a row: the reference checks lengths first
    bad = buf.clone()
    bad[hdr] = 14
    o4 = int(offs[4])
    t = free_row(o4, H - 1)
    bad[o4 + 4 * (H - 1) + t // 8] ^= 1 << (t % 8)
    case(bad, offs, TruncatedError)
    for b, o, cls in cases:
        rust, ref = same_verdict(b, o)
        if cls is not None:
            assert rust[0] == "err" and rust[1] is cls, (rust, cls)


def _damaged(data, buf, offs):
    """``buf``/``offs`` damaged as hypothesis draws: (bytes, offsets, the one page damaged or None)."""
    kind = data.draw(st.sampled_from(["flip", "flips", "cut", "random", "offsets"]))
    if kind in ("flip", "flips"):
        bad = buf.clone()
        at = data.draw(st.lists(st.integers(0, buf.numel() - 1), min_size=1, max_size=1 if kind == "flip" else 8))
        for i in at:
            bad[i] ^= 1 << data.draw(st.integers(0, 7))
        page = int(torch.searchsorted(offs, torch.tensor(at[0]), right=True)) - 1 if kind == "flip" else None
        return bad, offs, page
    if kind == "cut":  # the buffer cut short, the offsets cut with it (or not)
        n = data.draw(st.integers(0, buf.numel() - 1))
        return buf[:n].clone(), offs.clamp(max=n) if data.draw(st.booleans()) else offs, None
    if kind == "random":  # random slots and plain rows behind a consistent header
        rng = np.random.default_rng(data.draw(st.integers(0, 2**63 - 1)))
        masks = data.draw(st.lists(st.integers(0, 0xFFFF) | st.sampled_from([0, 1, 0x8000]), min_size=H, max_size=H))
        cnt = [bin(m).count("1") for m in masks]
        bad = torch.from_numpy(np.frombuffer(rng.bytes(R4.page_length(H, D, sum(cnt))), np.uint8).copy())
        hdr = [v for h in range(H) for v in (masks[h] & 0xFF, masks[h] >> 8, sum(cnt[:h]) & 0xFF, sum(cnt[:h]) >> 8)]
        bad[: R4.header_bytes(H)] = torch.tensor(hdr + [0] * (R4.header_bytes(H) - 4 * H), dtype=torch.uint8)
        if data.draw(st.booleans()):  # tops all valid (>= 15): reaches the later rules
            for h in range(H):
                s = R4.header_bytes(H) + h * R4.coded_head_bytes(D)
                bad[s: s + D] = bad[s: s + D] % 64 + 15
        return bad, torch.tensor([0, bad.numel()]), 0
    # hostile offsets: anywhere in int64 (sums of them wrap), between the buffer's true ends or not
    inner = data.draw(st.lists(st.integers(-(2**63), 2**63 - 1) | st.integers(-64, buf.numel() + 64)
                               | st.sampled_from(offs.tolist()), max_size=4))
    ends = [0, *inner, buf.numel()] if data.draw(st.booleans()) else inner or [0]
    return buf, torch.tensor(ends, dtype=torch.int64), None


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_fuzz_damaged_pages_same_verdict(pages, data):
    """Flipped bits, cuts, random pages and hostile offsets: both decoders accept (the same values,
    which re-encode to the same bytes) or both raise the same class; for damage inside one page,
    both name that page."""
    _, buf, offs = pages
    bad, o, page = _damaged(data, buf, offs)
    rust, ref = same_verdict(bad, o)
    if rust[0] == "err" and page is not None:
        assert rust[2] == ref[2] == page, (rust, ref, page)
