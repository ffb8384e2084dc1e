"""kernels.regions.copy_regions against its torch reference (regions_ref): random variable-size
regions gathered into one buffer and scattered back, bad arguments refused. On a machine without a
GPU the kernel runs in Triton's interpreter."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import numpy as np  # noqa: E402
import pytest  # noqa: E402

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

from weightszip.errors import InvalidArgumentError  # noqa: E402
from weightszip.kernels.regions import copy_regions, post  # noqa: E402
from weightszip.kernels.regions_ref import copy_regions_ref, post_ref  # noqa: E402

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
DEVICE = "cpu" if INTERPRET or not torch.cuda.is_available() else "cuda"


def _case(seed, n=37, max_rows=300):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, max_rows, n) * 16  # empty regions too
    gaps = rng.integers(0, 4, n) * 16
    src_off = np.cumsum(sizes + gaps) - sizes  # scattered regions, in a shuffled order
    order = rng.permutation(n)
    src = torch.from_numpy(rng.integers(0, 256, int(src_off.max() + sizes.max()) + 64, dtype=np.uint8)).to(DEVICE)
    t = lambda a: torch.as_tensor(np.ascontiguousarray(a), dtype=torch.int64, device=DEVICE)  # noqa: E731
    so, sz = t(src_off[order]), t(sizes[order])
    return src, so, sz, torch.cumsum(sz, 0) - sz


@pytest.mark.parametrize("seed", [0, 1])
def test_gather_and_scatter_equal_the_reference(seed):
    src, so, sz, packed = _case(seed)
    total = int(sz.sum())
    out = torch.full((total + 32,), 7, dtype=torch.uint8, device=DEVICE)
    want = out.clone()
    copy_regions(src, so, out, packed, sz, block=64)  # several loop steps per region
    copy_regions_ref(src, so, want, packed, sz)
    assert torch.equal(out, want) and bool((out[total:] == 7).all())
    back = torch.zeros_like(src)
    want_back = torch.zeros_like(src)
    copy_regions(out, packed, back, so, sz)
    copy_regions_ref(out, packed, want_back, so, sz)
    assert torch.equal(back, want_back)
    # every region came back to its place, and nothing else was written
    mask = torch.zeros(src.numel(), dtype=torch.bool, device=DEVICE)
    for o, n in zip(so.tolist(), sz.tolist()):
        mask[o:o + n] = True
    assert torch.equal(back[mask], src[mask]) and not bool(back[~mask].any())


def test_bad_arguments():
    src, so, sz, packed = _case(2, n=5)
    out = torch.empty(int(sz.sum()), dtype=torch.uint8, device=DEVICE)
    with pytest.raises(InvalidArgumentError):
        copy_regions(src.view(torch.int32) if src.numel() % 4 == 0 else src[None], so, out, packed, sz)
    with pytest.raises(InvalidArgumentError):
        copy_regions(src, so.to(torch.int32), out, packed, sz)
    with pytest.raises(InvalidArgumentError):
        copy_regions(src, so[:-1], out, packed, sz)
    with pytest.raises(InvalidArgumentError):  # out of bounds, found by check=True
        copy_regions(src, so, out[:-16], packed, sz, check=True)
    with pytest.raises(InvalidArgumentError):  # unaligned offset
        copy_regions(src, so + 4, out, packed, sz, check=True)
    copy_regions(src, so[:0], out, packed[:0], sz[:0])  # no regions: nothing to do


@pytest.mark.parametrize("n", [1, 3, 64, 1024])
def test_post_equals_the_reference(n):
    src = torch.from_numpy(np.random.default_rng(n).integers(-(2**62), 2**62, n)).to(DEVICE)
    pinned = DEVICE == "cuda"
    dst = torch.full((n + 1,), -1, dtype=torch.int64, pin_memory=pinned)
    want = dst.clone()
    post(src, dst[:n])
    if pinned:
        torch.cuda.synchronize()
    post_ref(src, want[:n])
    assert torch.equal(dst, want) and int(dst[n]) == -1  # nothing past the words


def test_post_refuses_bad_arguments():
    src = torch.zeros(4, dtype=torch.int64, device=DEVICE)
    for dst, s in ((torch.zeros(3, dtype=torch.int64), src), (torch.zeros(4, dtype=torch.int32), src),
                   (torch.zeros(2048, dtype=torch.int64), torch.zeros(2048, dtype=torch.int64, device=DEVICE))):
        with pytest.raises(InvalidArgumentError):
            post(s, dst)
    if DEVICE == "cuda":
        with pytest.raises(InvalidArgumentError, match="pinned"):
            post(src, torch.zeros(4, dtype=torch.int64))  # pageable host memory: not for a kernel


@pytest.mark.parametrize("n,w", [(1, 1), (37, 4096), (40, 1500), (16, 1024)])
def test_weighted_sum_equals_the_reference(n, w):
    """The offload's digest kernel: int64 products and sums modulo 2**64, added into out, for row
    counts around its 16 rows per program and widths around its 1024-word block; and on the offload's
    digest itself (kernel on a GPU, reference elsewhere) against a big-integer sum."""
    from weightszip import offload as ol
    from weightszip.kernels.regions import weighted_sum
    from weightszip.kernels.regions_ref import weighted_sum_ref

    rng = np.random.default_rng(n * w)
    t = lambda a: torch.from_numpy(a).to(DEVICE)  # noqa: E731
    x = t(rng.integers(-(2**63), 2**63 - 1, (n, w), dtype=np.int64))
    a, b = t(ol._splitmix_odd(w)), t(ol._splitmix_odd(n))
    out = t(np.array([12345], np.int64))
    want = out.clone()
    weighted_sum(x, a, b, out)
    weighted_sum_ref(x, a, b, want)
    exact = (sum(int(v) * int(u) for v, u in zip(x.cpu().numpy().astype(object) @ a.cpu().numpy().astype(object),
                                                 b.cpu().numpy().astype(object))) + 12345) % 2**64
    assert torch.equal(out, want) and int(out) % 2**64 == exact
    with pytest.raises(InvalidArgumentError):
        weighted_sum(x.int(), a, b, out)
