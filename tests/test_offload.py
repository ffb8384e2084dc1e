"""Offload / restore of a session's KV as compressed bytes (weightszip.offload).

CPU (CI): the Rust backend on real SmolLM2 KV (tests/data), chunking edge cases, damaged bytes
and bad arguments; the Triton backend's pipeline (chunk slicing, staging ring, clamps, digests)
in Triton's interpreter at a small size, byte-equal to the Rust backend's sessions.
GPU (tests marked ``cuda``, skipped without CUDA; run on the GPU box): the same at a real size,
Llama-3.1-8B channel count (1024), thousands of pages, on real streams.
"""

import dataclasses
import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

torch = pytest.importorskip("torch")
CUDA = torch.cuda.is_available()
if not CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from weightszip import offload as ol  # noqa: E402
from weightszip import pages  # noqa: E402
from weightszip.kernels import exact_page as ep  # noqa: E402
from weightszip.errors import (  # noqa: E402
    BadMagicError,
    ChecksumMismatchError,
    CorruptDataError,
    InvalidArgumentError,
    TruncatedError,
    WeightszipError,
)

cuda = pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU (run on the GPU box)")


def _session_kv(real_kv, channels=192, tokens=64, version=1):
    """Pages [6 * tokens/16, 16, channels] of (layer, K/V) groups back to back, their table ids
    and one codebook per group (calibrated on the group's own tokens, of ``version``)."""
    groups = [real_kv[k, layer][:tokens, :channels] for layer in range(real_kv.shape[1]) for k in range(2)]
    cbs = [pages.calibrate(np.ascontiguousarray(g), "bfloat16", version=version) for g in groups]
    vals = np.concatenate([g.reshape(-1, 16, channels) for g in groups])
    tids = np.repeat(np.arange(len(groups)), tokens // 16)
    return torch.from_numpy(vals.view(np.int16).copy()).view(torch.bfloat16), tids, ol.ExactPageCodec(cbs)


def _flat(session):
    return b"".join(bytes(c.host[: c.region_bytes].cpu().numpy()) for c in session.chunks)


# --- Rust backend (CPU) ----------------------------------------------------------------------


@pytest.mark.parametrize("chunk_pages", [1, 3, 4, 7, 24, 1000])
def test_rust_round_trip_real_kv(real_kv, chunk_pages):
    x, tids, codec = _session_kv(real_kv)
    s = ol.offload(x, codec, tids, chunk_pages=chunk_pages, backend="rust")
    assert [(c.start, c.n_pages) for c in s.chunks] == [(a, b - a) for a, b in ol.plan_chunks(len(x), chunk_pages)]
    assert sum(c.n_pages for c in s.chunks) == len(x) == s.n_pages
    out = ol.restore(s, backend="rust", device="cpu")
    assert out.dtype == torch.bfloat16 and torch.equal(out.view(torch.int16), x.view(torch.int16))
    # Bytes in transit: page bytes plus 12 bytes of offsets and table ids per page (+ padding).
    assert s.nbytes == sum(c.nbytes + 8 * (c.n_pages + 1) + (4 * c.n_pages + 7) // 8 * 8 for c in s.chunks)
    assert s.ratio < 0.8  # real bf16 KV, in-sample codebooks


def test_chunk_bytes_are_the_rust_page_bytes(real_kv):
    # Each chunk's page bytes are the Rust encoder's pages of that chunk, one codebook per run.
    x, tids, codec = _session_kv(real_kv)
    s = ol.offload(x, codec, tids, chunk_pages=8, backend="rust")
    v = x.view(torch.int16).numpy().view(np.uint16)
    for c in s.chunks:
        body, offs, t = (p.numpy() for p in ol._chunk_parts(c))
        assert (t == tids[c.start : c.start + c.n_pages]).all()
        for p in range(c.n_pages):
            g = c.start + p
            ref, _ = pages.encode_pages(codec.codebooks[tids[g]], v[g : g + 1])
            assert bytes(body[offs[p] : offs[p + 1]]) == ref


def test_plan_chunks_edges():
    assert ol.plan_chunks(0, 8) == []
    assert ol.plan_chunks(1, 8) == [(0, 1)]
    assert ol.plan_chunks(10, 8) == [(0, 2), (2, 4), (4, 6), (6, 8), (8, 10)]
    sizes = [b - a for a, b in ol.plan_chunks(524288, 8192)]  # a 128k-token Llama-3.1-8B session
    assert sizes[:5] == [2048] * 5 and sizes[-1] <= 2048 and max(sizes) == 8192 and sizes.count(8192) >= 50
    assert ol.plan_chunks(3, 1) == [(0, 1), (1, 2), (2, 3)]
    with pytest.raises(InvalidArgumentError):
        ol.plan_chunks(4, 0)
    for n in range(0, 90):
        for cp in (1, 3, 8, 17):
            plan = ol.plan_chunks(n, cp)
            edge = max(1, cp // 4)
            assert [a for a, _ in plan] == [0, *(b for _, b in plan[:-1])][: len(plan)] and (plan[-1][1] if plan else 0) == n
            assert all(0 < b - a <= cp for a, b in plan)
            if plan:  # short first and last chunks: a short encode before the first copy, a short decode after the last
                assert plan[0][1] <= edge and plan[-1][1] - plan[-1][0] <= edge
            s = [b - a for a, b in plan]
            # growth: at most 1.25x (or up to the edge size), shrinking: at most 1.5x, rounding aside
            assert all(y <= max(edge, x * 5 // 4 + 1) for x, y in zip(s, s[1:]))
            assert all(x <= max(edge, y * 3 // 2 + 2) for x, y in zip(s, s[1:]))


def test_host_arena_hands_out_disjoint_slices_to_threads():
    # (take() read and wrote `used` without a lock: with frequent thread switches, 8 threads were
    # handed thousands of overlapping slices, and sessions offloaded into one arena came back damaged)
    import sys
    import threading

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    arena = ol.HostArena(8 * 3000 * 16, device="cpu", pin=False)
    got: list[list[int]] = [[] for _ in range(8)]

    def take(i):
        for _ in range(3000):
            got[i].append(arena.take(16).data_ptr())

    try:
        threads = [threading.Thread(target=take, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(old)
    starts = [p for g in got for p in g]
    assert len(starts) == len(set(starts)) == 8 * 3000
    assert arena.take(1) is None  # exactly full


@pytest.mark.parametrize("n_pages", [2**20, 2**40])
def test_restore_refuses_more_pages_than_the_bytes_hold_before_allocating(real_kv, n_pages):
    # (a region of exactly 12 N + 8 bytes, offsets and ids all 0, passed every check; restore then
    # allocated N x 16 x C bf16 values for its output before looking at a page: 2^40 pages asked
    # torch for 6 PB, an untyped RuntimeError; 2^20 pages 6 GB from 12 MB of host bytes)
    _, _, codec = _session_kv(real_kv)
    host = torch.zeros(ol._region_bytes(0, 2**20), dtype=torch.uint8)
    chunk = ol.Chunk(0, n_pages, 0, host, 0)
    s = ol.CompressedSession(codec, n_pages, torch.bfloat16, [chunk])
    with pytest.raises(TruncatedError if n_pages > 2**20 else CorruptDataError):
        ol.restore(s, backend="rust", device="cpu")


def test_one_page_and_empty_sessions(real_kv):
    x, tids, codec = _session_kv(real_kv)
    s = ol.offload(x[5:6], codec, tids[5:6], backend="rust")
    assert len(s.chunks) == 1 and s.chunks[0].n_pages == 1
    assert torch.equal(ol.restore(s, backend="rust", device="cpu"), x[5:6])
    e = ol.offload(x[:0], codec, tids[:0], backend="rust")
    assert e.chunks == [] and e.nbytes == 0 and ol.restore(e, device="cpu").shape == (0, 16, 192)


def test_host_arena_and_fallback(real_kv):
    x, tids, codec = _session_kv(real_kv)
    arena = ol.HostArena(1 << 20)
    s = ol.offload(x, codec, tids, chunk_pages=5, host=arena, backend="rust")
    assert s.pinned_fallbacks == 0 and all(c.host.data_ptr() % 8 == 0 for c in s.chunks)
    assert arena.used >= s.nbytes
    small = ol.HostArena(s.chunks[0].region_bytes + 8)  # room for the first chunk only
    s2 = ol.offload(x, codec, tids, chunk_pages=5, host=small, backend="rust")
    assert s2.pinned_fallbacks == len(s2.chunks) - 1
    assert _flat(s2) == _flat(s)
    assert torch.equal(ol.restore(s2, backend="rust", device="cpu"), x)


@pytest.mark.parametrize("align", [16, 4096, 1 << 21])
def test_host_arena_aligns_slice_addresses(real_kv, align):
    # HostArena(align=): every slice starts at an address that is a multiple of align (not of an
    # offset into the buffer, whose own start need not be aligned), slices do not overlap, and a
    # session offloaded into it restores as before
    x, tids, codec = _session_kv(real_kv)
    n = len(ol.offload(x, codec, tids, chunk_pages=5, backend="rust").chunks)
    buf = torch.zeros((n + 1) * align + (1 << 20) + 7, dtype=torch.uint8)[7:]  # its start off any alignment
    arena = ol.HostArena(0, buffer=buf, align=align)
    s = ol.offload(x, codec, tids, chunk_pages=5, host=arena, backend="rust")
    assert s.pinned_fallbacks == 0 and len(s.chunks) > 2
    ptrs = [c.host.data_ptr() for c in s.chunks]
    assert all(p % align == 0 for p in ptrs)
    assert all(a.data_ptr() + a.numel() <= b.data_ptr() for a, b in zip((c.host for c in s.chunks),
                                                                        (c.host for c in s.chunks[1:])))
    assert torch.equal(ol.restore(s, backend="rust", device="cpu"), x)
    # the slices' waste is bounded by align - 1 each
    assert arena.used <= buf.numel() and arena.used - sum(c.host.numel() for c in s.chunks) < len(s.chunks) * align


@pytest.mark.parametrize("align", [0, 8, 24, 4097, True, 2.0, -16])
def test_host_arena_refuses_bad_alignments(align):
    with pytest.raises(InvalidArgumentError, match="align"):
        ol.HostArena(64, device="cpu", pin=False, align=align)


def test_digest_matches_big_integer_reference():
    rng = np.random.default_rng(3)
    v = torch.from_numpy(rng.integers(-(1 << 15), 1 << 15, (3, 16, 32), dtype=np.int16))
    words = v.reshape(3, -1).view(torch.int64).numpy().astype(object)
    a = ol._splitmix_odd(words.shape[1]).astype(object)
    b = ol._splitmix_odd(3).astype(object)
    ref = sum(int(words[p, j]) * int(a[j]) * int(b[p]) for p in range(3) for j in range(words.shape[1])) % (1 << 64)
    assert int(ol.digest(v)) % (1 << 64) == ref


@settings(max_examples=30, deadline=None)
@given(pos=st.integers(0, 3 * 16 * 32 - 1), bit=st.integers(0, 15))
def test_digest_sees_every_single_bit_change(pos, bit):
    v = torch.from_numpy(np.random.default_rng(1).integers(-(1 << 15), 1 << 15, (3, 16, 32), dtype=np.int16))
    w = v.clone()
    w.view(-1)[pos] ^= np.int16(np.uint16(1 << bit).view(np.int16))
    assert int(ol.digest(v)) != int(ol.digest(w))


def test_damaged_bytes_raise_typed_errors(real_kv):
    x, tids, codec = _session_kv(real_kv)

    def fresh():
        return ol.offload(x, codec, tids, chunk_pages=8, backend="rust")

    H = pages.header_len(192)
    s = fresh()
    s.chunks[1].host[H + 5] ^= 0x40  # a raw byte (sign / mantissa) of the chunk's first page
    with pytest.raises(ChecksumMismatchError, match="pages 2..4"):
        ol.restore(s, backend="rust", device="cpu")
    s = fresh()
    c = s.chunks[1]
    c.host[c.nbytes + 8 : c.nbytes + 16].view(torch.int64)[0] = -8  # an offset
    with pytest.raises(CorruptDataError):
        ol.restore(s, backend="rust", device="cpu")
    s = fresh()
    c = s.chunks[1]
    c.host[c.nbytes + 8 * (c.n_pages + 1)] = 77  # a table id
    with pytest.raises(CorruptDataError):
        ol.restore(s, backend="rust", device="cpu")
    s = fresh()
    s.chunks[1].host = s.chunks[1].host[:-9]
    with pytest.raises(TruncatedError):
        ol.restore(s, backend="rust", device="cpu")


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_damaged_byte_is_caught_or_harmless(real_kv, data):
    # One damaged byte anywhere in a chunk: a typed error, or (padding, unused bits) the same pages.
    x, tids, codec = _session_kv(real_kv)
    s = ol.offload(x, codec, tids, chunk_pages=8, backend="rust")
    c = s.chunks[data.draw(st.integers(0, len(s.chunks) - 1))]
    pos = data.draw(st.integers(0, c.region_bytes - 1))
    c.host[pos] ^= data.draw(st.integers(1, 255))
    try:
        out = ol.restore(s, backend="rust", device="cpu")
    except WeightszipError:
        return
    assert torch.equal(out, x)


def test_bad_arguments(real_kv):
    x, tids, codec = _session_kv(real_kv)
    s = ol.offload(x, codec, tids, backend="rust")
    bad_calls = [
        lambda: ol.offload(x[:, :8], codec, tids),
        lambda: ol.offload(x.float(), codec, tids),
        lambda: ol.offload(x.view(torch.int16).view(torch.float16), codec, tids),  # fp16 into bf16 codebooks
        lambda: ol.offload(x.view(torch.int16).numpy(), codec, tids),
        lambda: ol.offload(x, codec, tids[:-1]),
        lambda: ol.offload(x, codec, tids + 6),
        lambda: ol.offload(x, codec, tids.astype(np.float32)),
        lambda: ol.offload(x, codec, tids, chunk_pages=0),
        lambda: ol.offload(x, codec, tids, depth=0),
        lambda: ol.offload(x, codec, tids, backend="cuda"),
        lambda: ol.restore(s, torch.empty(3, 16, 192, dtype=torch.bfloat16)),
        lambda: ol.restore(s, torch.empty(24, 16, 64, dtype=torch.bfloat16)),
        lambda: ol.restore(s, torch.empty(24, 16, 192, dtype=torch.float32)),
        lambda: ol.restore(s, torch.empty(192, 16, 24, dtype=torch.bfloat16).transpose(0, 2)),
        lambda: ol.restore(s, depth=1),
        lambda: ol.restore(b"not a session"),
        lambda: ol.ExactPageCodec([]),
        lambda: ol.ExactPageCodec([codec.codebooks[0], pages.calibrate(real_kv[0, 0][:, :64])]),
        lambda: ol.ExactPageCodec([codec.codebooks[0], pages.calibrate(real_kv[0, 0][:, :192], "float16")]),
    ]
    for i, call in enumerate(bad_calls):
        with pytest.raises(InvalidArgumentError):
            call()
            pytest.fail(f"call {i} did not raise")
    with pytest.raises(BadMagicError):
        ol.ExactPageCodec(b"XXXX" + codec.codebooks[0][4:])


# --- Triton backend: interpreter on the CPU, real streams on a GPU ---------------------------

TRITON_DEVICES = ["cuda"] if CUDA else ["cpu"]


@pytest.fixture(scope="module")
def small_session(real_kv):
    # Interpreter-sized: 32 channels, 2 groups x 3 pages (the interpreter runs every lane in numpy).
    x, tids, codec = _session_kv(real_kv[:, :1], channels=32, tokens=48)
    return x, tids, codec


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("chunk_pages", [1, 4, 64])  # 1: six chunks, the ids staged in two parts
def test_triton_round_trip_and_bytes_equal_rust(small_session, device, chunk_pages):
    x, tids, codec = small_session
    xd = x.to(device)
    s = ol.offload(xd, codec, tids, chunk_pages=chunk_pages, backend="triton")
    r = ol.offload(x, codec, tids, chunk_pages=chunk_pages, backend="rust")
    assert _flat(s) == _flat(r) and [c.digest for c in s.chunks] == [c.digest for c in r.chunks]
    out = torch.full_like(xd, 7)
    assert ol.restore(s, out, backend="triton") is out and torch.equal(out, xd)
    # Across backends: Triton restores the Rust session, Rust restores the Triton one.
    assert torch.equal(ol.restore(r, torch.empty_like(xd), backend="triton"), xd)
    assert torch.equal(ol.restore(s, backend="rust", device="cpu"), x)


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_version_2_sessions_triton_and_rust_agree(real_kv, device):
    """A session whose codebooks are version 2: the Triton offload writes the Rust backend's
    bytes, and each backend restores the other's session, bit for bit."""
    x, tids, codec = _session_kv(real_kv[:, :1], channels=32, tokens=48, version=2)
    assert codec.version == 2 and codec.kernels().__name__.endswith("exact_page2")
    xd = x.to(device)
    s = ol.offload(xd, codec, tids, chunk_pages=4, backend="triton")
    r = ol.offload(x, codec, tids, chunk_pages=4, backend="rust")
    assert _flat(s) == _flat(r) and [c.digest for c in s.chunks] == [c.digest for c in r.chunks]
    assert torch.equal(ol.restore(r, torch.empty_like(xd), backend="triton"), xd)
    assert torch.equal(ol.restore(s, backend="rust", device="cpu"), x)


def test_version_2_sessions_on_the_cpu_and_mixed_versions(real_kv):
    x, tids, codec = _session_kv(real_kv, version=2)
    s = ol.offload(x, codec, tids, chunk_pages=5, backend="rust")
    assert torch.equal(ol.restore(s, backend="rust", device="cpu"), x)
    # (test_exact_page_v2 checks the codec's page bound on the largest version-2 page)
    v1 = pages.calibrate(np.ascontiguousarray(real_kv[0, 0][:, :192]), "bfloat16")
    with pytest.raises(InvalidArgumentError, match=r"\('bfloat16', 8, 192, 1\), \('bfloat16', 8, 192, 2\)"):
        ol.ExactPageCodec([codec.codebooks[0], v1])


def test_id_stager_checks_each_part_before_staging_it():
    # The GPU path stages the table ids in parts; a part with an id outside the codebooks is
    # refused before anything of it reaches the device copy, which the kernels then never read.
    st = ol._Streams(torch.device("cpu"), "offload")
    ids = np.array([0, 1, 2, 5, 0, 1], np.int64)
    s = ol._IdStager(ids, 3, torch.device("cpu"), st)
    s.stage(0, 3)
    assert s.dev[:3].tolist() == [0, 1, 2] and s.dev.dtype == torch.int32
    before = s.dev[3:].clone()
    with pytest.raises(InvalidArgumentError, match="must lie in"):
        s.stage(3, 6)
    assert torch.equal(s.dev[3:], before)
    s.stage(4, 6)
    assert s.dev[4:].tolist() == [0, 1]
    with pytest.raises(InvalidArgumentError, match="must lie in"):
        ol._IdStager(np.array([-1], np.int32), 3, torch.device("cpu"), st).stage(0, 1)
    with pytest.raises(InvalidArgumentError):
        ol.plan_chunks(10, 8.5)


@pytest.mark.parametrize("device", TRITON_DEVICES)
@pytest.mark.parametrize("where,what", [("first", "negative"), ("last", "count"), ("last", "wraps")])
def test_triton_offload_rejects_table_ids_out_of_range_and_frees_its_arena(small_session, device, where, what,
                                                                         monkeypatch):
    # The Triton path checks the ids as it stages them, in two parts (with one-page chunks: pages
    # 0-3 before the first size pass, 4-5 at chunk 3, after four chunks are under way); the call
    # still raises, and the arena slices it took are free again. A uint64 id of 2**32 + 1 would
    # wrap to 1 as int32: it is caught too.
    x, tids, codec = small_session
    t = tids.astype(np.uint64 if what == "wraps" else np.int64)
    t[0 if where == "first" else -1] = {"negative": -1, "count": len(codec), "wraps": 2**32 + 1}[what]
    arena = ol.HostArena(1 << 20, device="cpu", pin=False)
    arena.take(16)
    staged, sized = [], []
    real_stage, real_layout = ol._IdStager.stage, ep.page_layout
    monkeypatch.setattr(ol._IdStager, "stage", lambda self, a, b: staged.append((a, b)) or real_stage(self, a, b))
    monkeypatch.setattr(ep, "page_layout", lambda *a, **k: sized.append(1) or real_layout(*a, **k))
    with pytest.raises(InvalidArgumentError, match="must lie in"):
        ol.offload(x.to(device), codec, t, chunk_pages=1, host=arena, backend="triton")
    assert staged == ([(0, 4)] if where == "first" else [(0, 4), (4, 6)])
    assert len(sized) == (0 if where == "first" else 4)  # the size passes of chunks 0-3 ran before the raise
    assert arena.used == 16
    s = ol.offload(x.to(device), codec, tids, chunk_pages=4, host=arena, backend="triton")  # the arena still serves
    assert torch.equal(ol.restore(s, torch.empty_like(x.to(device)), backend="triton"), x.to(device))


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_offload_grows_its_ring_for_a_larger_chunk(small_session, device, monkeypatch):
    # The encode ring is sized from the first chunk's bytes per page; a later chunk of random bits
    # (escapes everywhere: larger than raw) no longer fits its slot, which gets a new buffer.
    # Bytes, digests and the round trip stay exact.
    x, tids, codec = small_session
    made = []
    real = ol._ring_buffer
    monkeypatch.setattr(ol, "_ring_buffer", lambda n, dev: made.append(n) or real(n, dev))
    rng = np.random.default_rng(3)
    y = x.clone()  # the first chunk (2 pages): real KV, as calibrated
    y[2:] = torch.from_numpy(rng.integers(-(2**15), 2**15, y[2:].shape, dtype=np.int16)).view(torch.bfloat16)
    # chunks of 2 pages, two ring slots: chunk 2 reuses the slot sized for chunk 0
    s = ol.offload(y.to(device), codec, tids, chunk_pages=8, depth=2, backend="triton")
    r = ol.offload(y, codec, tids, chunk_pages=8, backend="rust")
    assert s.chunks[0].nbytes * 3 < s.chunks[-1].nbytes * 2  # past the ring's slack
    assert len(made) == 3 and made[2] > made[0]  # slot 0 was replaced by a larger buffer
    assert _flat(s) == _flat(r) and [c.digest for c in s.chunks] == [c.digest for c in r.chunks]
    back = ol.restore(s, torch.empty_like(y.to(device)), backend="triton")
    assert torch.equal(back.view(torch.int16), y.to(device).view(torch.int16))  # bits: random ones hold NaNs


@pytest.mark.parametrize("device", TRITON_DEVICES)
def test_triton_damaged_bytes_checksum_and_no_stray_reads(small_session, device):
    x, tids, codec = small_session
    xd = x.to(device)
    clean = ol.offload(xd, codec, tids, chunk_pages=8, backend="triton")  # chunks of 2 pages
    for damage in ("raw", "offset", "header", "table_id"):
        s = _copy(clean)
        c = s.chunks[1]
        if damage == "raw":
            c.host[pages.header_len(32) + 3] ^= 1
        elif damage == "offset":
            c.host[c.nbytes + 8 : c.nbytes + 16].view(torch.int64)[0] = 1 << 40  # clamped on the GPU
        elif damage == "header":
            c.host[0:2].view(torch.int16)[0] = 0  # the stream claims no words
        else:
            c.host[c.nbytes + 8 * (c.n_pages + 1)] = 99  # clamped
        with pytest.raises(ChecksumMismatchError, match="pages 2..4"):
            ol.restore(s, torch.empty_like(xd), backend="triton")
    s = _copy(clean)
    s.chunks[1].host[0:2].view(torch.int16)[0] = -1  # 65535 words: the reads stay inside the staging slack
    ol.restore(s, torch.empty_like(xd), backend="triton", verify=False)  # wrong values, no crash


def _copy(session):
    return dataclasses.replace(session, chunks=[dataclasses.replace(c, host=c.host.clone()) for c in session.chunks])


# --- GPU, real size --------------------------------------------------------------------------


def _tiled_llama(real_kv, reps):
    """Real KV tiled to 1024 channels (Llama-3.1-8B, 8 KV heads x 128) and along pages."""
    g = [np.tile(real_kv[k, layer], (1, 6))[:, :1024] for layer in range(real_kv.shape[1]) for k in range(2)]
    cbs = [pages.calibrate(a, "bfloat16") for a in g]
    vals = np.concatenate([a.reshape(-1, 16, 1024) for a in g])
    tids = np.repeat(np.arange(len(g)), 4)
    x = torch.from_numpy(vals.view(np.int16).copy()).cuda().view(torch.bfloat16).repeat(reps, 1, 1)
    return x, np.tile(tids, reps), ol.ExactPageCodec(cbs)


@cuda
@pytest.mark.parametrize("chunk_pages", [1000, 4096])
def test_gpu_real_size_round_trip(real_kv, chunk_pages):
    x, tids, codec = _tiled_llama(real_kv, 200)  # 4800 pages, 157 MB of bf16
    arena = ol.HostArena(x.numel() * 2)
    s = ol.offload(x, codec, tids, chunk_pages=chunk_pages, host=arena)
    assert s.pinned_fallbacks == 0 and s.chunks[0].host.is_pinned()
    out = ol.restore(s, torch.empty_like(x))
    assert torch.equal(out, x)
    # Bytes equal the Rust backend's on the first chunks; Rust restores the GPU session's start.
    head = ol.offload(x[:600].cpu(), codec, tids[:600], chunk_pages=chunk_pages, backend="rust")
    sg = ol.offload(x[:600], codec, tids[:600], chunk_pages=chunk_pages)
    assert _flat(head) == _flat(sg)
    assert torch.equal(ol.restore(sg, backend="rust", device="cpu"), x[:600].cpu())


@cuda
def test_gpu_edge_cases_and_damage(real_kv):
    x, tids, codec = _tiled_llama(real_kv, 3)  # 72 pages
    for n, chunk in [(1, 1), (5, 1), (72, 7), (72, 72), (33, 16)]:
        s = ol.offload(x[:n], codec, tids[:n], chunk_pages=chunk)
        assert torch.equal(ol.restore(s, torch.empty_like(x[:n]), depth=2), x[:n])
    s = ol.offload(x, codec, tids, chunk_pages=16)
    s.chunks[2].host[pages.header_len(1024) + 100] ^= 4
    with pytest.raises(ChecksumMismatchError):
        ol.restore(s, torch.empty_like(x))
    s.chunks[2].host[0:2].view(torch.int16)[0] = -1
    ol.restore(s, torch.empty_like(x), verify=False)
    torch.cuda.synchronize()  # no illegal address


@pytest.mark.parametrize("backend", ["rust", "triton"])
def test_restore_refuses_chunks_that_do_not_tile_the_session(small_session, backend):
    """A session edited or damaged in memory: a chunk moved past the end (the Triton path wrote
    outside its output), onto another, or missing (pages left unwritten): CorruptDataError before
    anything is decoded."""
    import copy

    x, tids, codec = small_session
    s = ol.offload(x, codec, tids, chunk_pages=2, backend="rust")
    assert len(s.chunks) >= 3
    # restored on the backend's device (Triton: the interpreter's CPU, else the GPU)
    x = x.to(TRITON_DEVICES[0] if backend == "triton" else "cpu")
    for edit in (lambda t: setattr(t.chunks[1], "start", 100), lambda t: setattr(t.chunks[1], "start", 0),
                 lambda t: setattr(t.chunks[1], "start", -2), lambda t: t.chunks.pop(1),
                 lambda t: setattr(t.chunks[2], "host", t.chunks[2].host.numpy()),
                 lambda t: setattr(t.chunks[1], "nbytes", t.chunks[1].nbytes + 1),  # offsets not where they go
                 lambda t: setattr(t.chunks[0], "n_pages", True)):
        bad = copy.copy(s)
        bad.chunks = [copy.copy(c) for c in s.chunks]
        edit(bad)
        with pytest.raises(CorruptDataError):
            ol.restore(bad, torch.zeros_like(x), backend=backend)
    assert torch.equal(ol.restore(s, torch.zeros_like(x), backend=backend).view(torch.int16), x.view(torch.int16))
    # intact chunks whose host bytes start at an odd address restore as they are
    moved = copy.copy(s)
    moved.chunks = [copy.copy(c) for c in s.chunks]
    for c in moved.chunks:
        odd = torch.zeros(c.host.numel() + 1, dtype=torch.uint8)[1:]
        odd.copy_(c.host)
        c.host = odd
    assert torch.equal(ol.restore(moved, torch.zeros_like(x), backend=backend).view(torch.int16), x.view(torch.int16))
    # and chunks whose host bytes are a strided view (every other byte of a larger buffer)
    for c in moved.chunks:
        wide = torch.zeros(2 * c.host.numel(), dtype=torch.uint8)
        wide[::2] = c.host
        c.host = wide[::2]
        assert not c.host.is_contiguous()
    assert torch.equal(ol.restore(moved, torch.zeros_like(x), backend=backend).view(torch.int16), x.view(torch.int16))
