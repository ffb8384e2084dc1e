"""Offload and restore of a session's KV cache as compressed bytes between GPU pages and
pinned host RAM (issue 7, item 3), with the GPU codec overlapped with the copies.

A session's KV is pages of 16 tokens, ``[n, 16, C]`` 16-bit values (bf16 / fp16 or their
int16 bits; C a multiple of 32), page i coded with codebook ``table_ids[i]`` of an
:class:`ExactPageCodec` (docs/FORMAT.md, "Exact page profile", e.g. one codebook per
(layer, K or V)). The codebooks are all of version 1 or all of version 2 (bf16: fewer bytes on
real K, ``pages.calibrate(..., version=2)``; BENCHMARKS.md, "Exact page profile, version 2").

    codec = ExactPageCodec([pages.calibrate(sample, "bfloat16") for sample in samples])
    session = offload(kv_pages, codec, table_ids)   # GPU pages -> compressed bytes in pinned RAM
    restore(session, kv_pages)                      # back into GPU pages, bit for bit

On a GPU (backend "triton"), pages travel in chunks of ``chunk_pages``:

- offload: chunk i is encoded on a compute stream into a ring of ``depth`` GPU buffers (page
  bytes, offsets and table ids side by side) while the copy stream moves chunk i-1 into pinned
  host memory in one copy (events order the two). The host needs each chunk's size before it
  queues the copy: the encoder's size pass runs one chunk ahead, and a kernel writes the size
  into pinned memory (``kernels.regions.post``), because a device-to-host copy of it would wait
  behind the previous chunks' copies on the copy engine.
- restore: the copy stream moves chunk i+1 .. i+depth-1 into a ring of ``depth`` GPU staging
  buffers while the compute stream decodes chunk i into its pages; a staging buffer is refilled
  only after the decode that read it (events), so GPU staging memory is bounded by
  ``depth`` x (largest chunk + slack).

Without CUDA (backend "rust") the Rust codec (weightszip.pages) writes and reads the same bytes,
so a session offloaded by either backend restores through the other.

One chunk in host memory (little-endian; offsets relative to the chunk's first byte)::

    page bytes (exact page profile, each page padded to 8 bytes) | int64 offsets [n + 1]
    | int32 table ids [n] | zero padding to 8 bytes

Integrity: every chunk carries a digest of its raw 16-bit pages, taken before encoding and
checked after decoding (``verify=True``): the sum over 64-bit words x[p, j] of
x[p, j] * a[j] * b[p] modulo 2**64, with fixed odd weights a, b (splitmix64 of the index, low
bit set). Any damaged 64-bit word of the decoded pages changes it (odd weights are invertible
mod 2**64); it is not a cryptographic hash. A mismatch raises ChecksumMismatchError. The Rust
decoder also rejects damaged structure (CorruptDataError / TruncatedError). The Triton decoder
does not validate: with ``verify=False`` damaged bytes decode to wrong values, but never read
or write out of bounds (offsets and table ids are clamped on the GPU; staging buffers carry
the slack that the largest word counts a page header can claim would reach).
"""

from __future__ import annotations

import contextlib
import functools
import numbers
import operator
import threading
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np
import torch

from weightszip import pages as _pages
from weightszip._tensors import int_arg
from weightszip.errors import (
    ChecksumMismatchError,
    CorruptDataError,
    InvalidArgumentError,
    LimitExceededError,
    TruncatedError,
    UnsupportedFeatureError,
)

PAGE_TOKENS = _pages.PAGE_TOKENS
STREAM_CHANNELS = _pages.STREAM_CHANNELS
_TORCH_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


class ExactPageCodec:
    """Codebooks of the exact page profile (one per table id) for a session; all share version,
    dtype, max_len and channel count. Builds the GPU tables once per device."""

    def __init__(self, codebooks: bytes | Sequence[bytes]):
        if isinstance(codebooks, (bytes, bytearray)):
            codebooks = [codebooks]
        self.codebooks = [bytes(cb) for cb in codebooks]
        if not self.codebooks:
            raise InvalidArgumentError("ExactPageCodec needs at least one codebook")
        # typed errors for bad codebooks
        full = [_pages.codebook_info(cb) for cb in self.codebooks]
        infos = [f[:3] + (_pages.codebook_version(cb),) for f, cb in zip(full, self.codebooks)]
        if len(set(infos)) != 1:
            raise InvalidArgumentError(f"codebooks must share dtype, max_len, channels and version, got {sorted(set(infos))}")
        self.dtype, self.max_len, self.channels, self.version = infos[0]
        self._tables = {}
        # Largest page the encoder can write: every symbol at the longest code (an escape is the
        # escape's code plus 8 bits, 9 in version 2), each stream rounded up to words, the page to 8
        # bytes.
        lens = [f[3] for f in full]
        maxbits = max(max(int(ln[..., :-1].max()), int(ln[..., -1].max()) + 7 + self.version) for ln in lens)
        S = self.channels // STREAM_CHANNELS
        words = -(-PAGE_TOKENS * STREAM_CHANNELS * maxbits // 32)
        raw = _pages.page_raw_part(self.version, self.channels)
        self.page_bound = (_pages.header_len(self.channels) + raw + 4 * S * words + 7) // 8 * 8

    def __len__(self) -> int:
        return len(self.codebooks)

    def kernels(self):
        """The GPU codec of the codebooks' version: the module ``weightszip.kernels.exact_page``
        (version 1) or ``exact_page2`` (version 2); both have ``page_layout``, ``encode_into`` and
        ``decode_into``."""
        if self.version == 1:
            from weightszip.kernels import exact_page as ep
        else:
            from weightszip.kernels import exact_page2 as ep
        return ep

    def tables(self, device):
        """The GPU tables of every codebook on ``device`` (cached): ``exact_page.PageTables`` or
        ``exact_page2.PageTables2``."""
        key = str(torch.device(device))
        if key not in self._tables:
            ep = self.kernels()
            t = ep.PageTables if self.version == 1 else ep.PageTables2
            self._tables[key] = t.stack([t.from_codebook(cb, device) for cb in self.codebooks])
        return self._tables[key]


@dataclass
class Chunk:
    """Pages ``start .. start + n_pages`` of a session: ``host`` holds page bytes (``nbytes``),
    offsets and table ids (module docstring); ``digest`` is the raw pages' digest."""

    start: int
    n_pages: int
    nbytes: int
    host: torch.Tensor
    digest: int

    @property
    def region_bytes(self) -> int:
        return _region_bytes(self.nbytes, self.n_pages)


@dataclass
class CompressedSession:
    """A session's KV as compressed chunks in host memory (pinned when CUDA is present)."""

    codec: ExactPageCodec
    n_pages: int
    dtype: torch.dtype
    chunks: list[Chunk] = field(default_factory=list)
    pinned_fallbacks: int = 0  # chunks that did not fit the HostArena and got their own allocation

    @property
    def channels(self) -> int:
        return self.codec.channels

    @property
    def raw_bytes(self) -> int:
        return self.n_pages * PAGE_TOKENS * self.channels * 2

    @property
    def nbytes(self) -> int:
        """Bytes in transit: every chunk's page bytes, offsets and table ids."""
        return sum(c.region_bytes for c in self.chunks)

    @property
    def ratio(self) -> float:
        return self.nbytes / self.raw_bytes if self.n_pages else 0.0


class HostArena:
    """One allocation of host memory (pinned when CUDA is present) handed out in slices whose
    addresses are multiples of ``align`` bytes (a power of two, 16 or more), so offloading allocates
    nothing per chunk; ``reset()`` makes it reusable (sessions that point into it are then invalid).
    ``device`` other than cpu makes a GPU-resident arena (benchmarks use it to time the codec without
    the bus). Threads may share one arena (sessions offloaded concurrently): ``take`` and ``reset``
    hold its lock. Each slice wastes up to ``align - 1`` bytes, so size an arena with room for that
    (a session's chunks: ``len(plan_chunks(...))`` slices)."""

    def __init__(self, nbytes: int, device="cpu", pin: bool | None = None, buffer: torch.Tensor | None = None,
                 align: int = 16):
        self._lock = threading.Lock()
        align = int_arg("align", align, 16, 1 << 30)
        if align & (align - 1):
            raise InvalidArgumentError(f"align must be a power of two, not {align}")
        self.align = align
        if buffer is not None:  # an existing uint8 buffer (e.g. pinned memory the caller already holds)
            if buffer.dtype != torch.uint8 or buffer.dim() != 1:
                raise InvalidArgumentError("an arena buffer must be a 1-D uint8 tensor")
            self.buffer, self.used = buffer, 0
            return
        if nbytes < 0:
            raise InvalidArgumentError("arena size must be >= 0")
        device = torch.device(device)
        if pin is None:
            pin = device.type == "cpu" and torch.cuda.is_available()
        if pin and not torch.cuda.is_available():
            raise UnsupportedFeatureError("a pinned host arena needs a CUDA GPU, and torch sees none (pin=False)")
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UnsupportedFeatureError(f"a host arena on {device} needs a CUDA GPU, and torch sees none")
        self.buffer = torch.empty(int(nbytes), dtype=torch.uint8, device=device, pin_memory=bool(pin))
        self.used = 0

    def take(self, nbytes: int) -> torch.Tensor | None:
        base = self.buffer.data_ptr()
        with self._lock:
            start = -(-(base + self.used) // self.align) * self.align - base
            if start + nbytes > self.buffer.numel():
                return None
            self.used = start + nbytes
        return self.buffer[start : start + nbytes]

    def reset(self) -> None:
        with self._lock:
            self.used = 0


def _region_bytes(nbytes: int, n: int) -> int:
    return nbytes + 8 * (n + 1) + (4 * n + 7) // 8 * 8


def _staging_slack(channels: int) -> int:
    # A damaged header can claim 65535 words for each of the S streams; the decoder then reads up
    # to the page's header, raw bytes and S * 65535 words past a (clamped) offset <= nbytes.
    s = channels // STREAM_CHANNELS
    return _pages.header_len(channels) + PAGE_TOKENS * channels + 4 * s * 65536 + 64


def plan_chunks(n_pages: int, chunk_pages: int) -> list[tuple[int, int]]:
    """(start, stop) page ranges of at most ``chunk_pages`` (``_plan``'s, cached: 0.1 ms of host
    time for a 128k-token session otherwise, before the first copy)."""
    try:
        n_pages, chunk_pages = operator.index(n_pages), operator.index(chunk_pages)
    except TypeError:
        raise InvalidArgumentError(f"n_pages and chunk_pages must be integers, got {n_pages!r}, {chunk_pages!r}") from None
    if chunk_pages < 1:
        raise InvalidArgumentError("chunk_pages must be >= 1")
    if n_pages > chunk_pages * _MAX_CHUNKS:  # (a plan of a billion one-page chunks took minutes and GBs)
        raise LimitExceededError(f"{n_pages} pages in chunks of {chunk_pages}: more than {_MAX_CHUNKS} chunks")
    return list(_plan(n_pages, chunk_pages))


#: The most chunks a plan may have (a 128k-token session is 74 chunks at the default size).
_MAX_CHUNKS = 1 << 16


@functools.lru_cache(maxsize=64)
def _plan(n_pages: int, chunk_pages: int) -> tuple[tuple[int, int], ...]:
    """(start, stop) page ranges of at most ``chunk_pages``. Chunks start at a quarter of that
    and grow by at most 1.25x from one to the next (the encoder runs at about 1.3x the bus on an
    H200, so chunk i + 1 is encoded while chunk i is copied and the bus never waits), and shrink
    towards the end by at most 1.5x down to a quarter (the decoder runs at 1.75x the bus: the
    restore ends with a short decode after the last copy)."""
    out, a = [], 0
    edge = max(1, chunk_pages // 4)
    while a < n_pages:
        rest = n_pages - a
        step = min(chunk_pages, max(edge, a // 4), max(edge, rest // 3), rest)
        out.append((a, a + step))
        a += step
    return tuple(out)


# --- digest ---------------------------------------------------------------------------------

_WEIGHTS: dict = {}


def _splitmix_odd(n: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z | np.uint64(1)).view(np.int64)


def _weights(n: int, device) -> torch.Tensor:
    key = str(device)
    w = _WEIGHTS.get(key)
    if w is None or w.numel() < n:
        w = torch.from_numpy(_splitmix_odd(max(n, 1024))).to(device)
        _WEIGHTS[key] = w
    return w[:n]


def digest(values: torch.Tensor) -> torch.Tensor:
    """int64 scalar tensor (on values' device): the digest of ``[n, 16, C]`` 16-bit pages,
    sum of x[p, j] * a[j] * b[p] over the pages' 64-bit words, modulo 2**64."""
    out = torch.zeros(1, dtype=torch.int64, device=values.device)
    _digest_into(values, out)
    return out[0]


def _digest_into(values: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (int64 [1], on values' device) += the digest of ``values``: one kernel on CUDA
    (``kernels.regions.weighted_sum``), its torch reference elsewhere."""
    from weightszip.kernels.regions import weighted_sum
    from weightszip.kernels.regions_ref import weighted_sum_ref

    n = values.shape[0]
    x = values.contiguous().view(torch.int16).reshape(n, -1).view(torch.int64)
    (weighted_sum if x.is_cuda else weighted_sum_ref)(x, _weights(x.shape[1], x.device), _weights(n, x.device), out)


class _Digests:
    """Each chunk's digest written into its slot of a device tensor as the chunk is processed, and
    all of them moved to pinned host memory by one kernel queued after the last (``read`` after the
    streams are synchronized): no stack of scalars and device-to-host copy after the last chunk,
    which cost about 0.5 ms of host time at the end of a restore (H200 profile)."""

    def __init__(self, n: int, device: torch.device, pinned: bool, pin_now: bool = True):
        # (made on the stream that writes the slots)
        self.dev = torch.zeros(n, dtype=torch.int64, device=device)
        self.pinned = pinned
        self.host = None if device.type != "cpu" else self.dev
        if pin_now:
            self.pin()

    def pin(self) -> None:
        """The host buffer ``collect`` moves the digests into (made by ``collect`` if not yet)."""
        if self.host is None:
            self.host = torch.zeros(self.dev.numel(), dtype=torch.int64, pin_memory=self.pinned)

    def put(self, i: int, values: torch.Tensor) -> None:
        _digest_into(values, self.dev[i : i + 1])

    def collect(self) -> None:
        """Queue the move to host memory on the current stream (after the last ``put``)."""
        self.pin()
        if self.host is not self.dev:
            from weightszip.kernels.regions import POST_MAX, post

            for a in range(0, self.dev.numel(), POST_MAX):
                post(self.dev[a : a + POST_MAX], self.host[a : a + POST_MAX])

    def read(self) -> list[int]:
        return self.host.tolist()


# --- streams --------------------------------------------------------------------------------


_STREAM_PAIRS: dict = {}


class _Streams:
    """A compute and a copy stream on CUDA; no-ops elsewhere (the Triton interpreter, tests).
    The same two streams for every call of one ``role`` on a device: torch's caching allocator
    keeps freed blocks for the stream they were allocated on, so new streams per call would
    cudaMalloc the staging and ring buffers (hundreds of MB) again on every call, before the first
    copy could start. One pair per role (offload, restore, KV Exact moves), so that an offload and a
    restore running at once keep their own copy streams (the two bus directions overlap); calls of
    the same role from several threads queue behind each other on its streams."""

    def __init__(self, device: torch.device, role: str):
        self.cuda = device.type == "cuda"
        if self.cuda:
            self.cur = torch.cuda.current_stream(device)
            key = (device.index if device.index is not None else torch.cuda.current_device(), role)
            if key not in _STREAM_PAIRS:
                _STREAM_PAIRS[key] = (torch.cuda.Stream(device), torch.cuda.Stream(device))
            self.comp, self.copy = _STREAM_PAIRS[key]
            # Work the caller queued on its stream (the pages, the output) comes first.
            self.comp.wait_stream(self.cur)
            self.copy.wait_stream(self.cur)

    def on(self, name: str):
        return torch.cuda.stream(getattr(self, name)) if self.cuda else contextlib.nullcontext()

    def record(self, name: str):
        if not self.cuda:
            return None
        ev = torch.cuda.Event()
        ev.record(getattr(self, name))
        return ev

    def wait(self, name: str, ev) -> None:
        if ev is not None:
            getattr(self, name).wait_event(ev)

    def join(self) -> None:
        """The caller's stream waits for both (no host wait): what it queues next comes after."""
        if self.cuda:
            self.cur.wait_stream(self.comp)
            self.cur.wait_stream(self.copy)

    def finish(self) -> None:
        self.join()
        if self.cuda:
            self.comp.synchronize()
            self.copy.synchronize()


# --- argument checks ------------------------------------------------------------------------


def _check_pages(values, codec: ExactPageCodec, what: str) -> None:
    if not isinstance(values, torch.Tensor):
        raise InvalidArgumentError(f"{what} must be a torch tensor, got {type(values).__name__}")
    C = codec.channels
    wrong_float = values.is_floating_point() and values.dtype != _TORCH_DTYPES[codec.dtype]
    if values.dim() != 3 or tuple(values.shape[1:]) != (PAGE_TOKENS, C) or values.element_size() != 2 or wrong_float:
        raise InvalidArgumentError(
            f"{what} must be [n, {PAGE_TOKENS}, {C}] {codec.dtype} (or int16 bits), got {tuple(values.shape)} {values.dtype}")


def _check_table_ids(table_ids, n: int, codec: ExactPageCodec, check_range: bool = True) -> np.ndarray:
    if table_ids is None:
        return np.zeros(n, np.int32)
    t = table_ids.detach().cpu().numpy() if isinstance(table_ids, torch.Tensor) else np.asarray(table_ids)
    if t.shape != (n,) or t.dtype.kind not in "iu":
        raise InvalidArgumentError(f"table_ids must be [{n}] integers, got {t.shape} {t.dtype}")
    if check_range:
        _check_id_range(t, len(codec))
    return t


def _check_id_range(t: np.ndarray, n_codebooks: int) -> None:
    if len(t) and (int(t.min()) < 0 or int(t.max()) >= n_codebooks):
        raise InvalidArgumentError(f"table ids must lie in [0, {n_codebooks})")


def _backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        return "triton" if device.type == "cuda" else "rust"
    if backend not in ("triton", "rust"):
        raise InvalidArgumentError(f"backend must be 'auto', 'triton' or 'rust', got {backend!r}")
    if backend == "triton":
        from weightszip.kernels._interpreter_compat import interpreting

        if not ((device.type == "cuda" and torch.cuda.is_available()) or interpreting()):
            raise UnsupportedFeatureError(f"backend 'triton' needs a CUDA GPU (or TRITON_INTERPRET=1) for pages on "
                                          f"{device}; backend 'rust' runs on the CPU")
    return backend


def _runs(tids: np.ndarray):
    """(a, b, table id) for every run of equal table ids."""
    cuts = [0, *(np.flatnonzero(np.diff(tids)) + 1).tolist(), len(tids)]
    return [(a, b, int(tids[a])) for a, b in zip(cuts[:-1], cuts[1:]) if b > a]


def _host_region(arena: HostArena | None, nbytes: int, session: CompressedSession) -> torch.Tensor:
    region = arena.take(nbytes) if arena is not None else None
    if region is None:
        if arena is not None:
            session.pinned_fallbacks += 1
        region = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    return region


# --- offload --------------------------------------------------------------------------------


def offload(pages_gpu: torch.Tensor, codec: ExactPageCodec, table_ids=None, *, chunk_pages: int = 8192,
            depth: int = 3, host: HostArena | None = None, backend: str = "auto", block_pages: int = 64) -> CompressedSession:
    """Compress ``[n, 16, C]`` pages into a :class:`CompressedSession` in host memory (slices of
    ``host`` when given, else pinned allocations per chunk). Returns when every byte has arrived.
    Table ids outside ``[0, len(codec))`` raise InvalidArgumentError (on the GPU path when the part
    of the ids that holds them is staged: no kernel reads them, the earlier chunks' work is
    finished and dropped, and ``host`` gets its slices back)."""
    _check_pages(pages_gpu, codec, "pages")
    if depth < 2:
        raise InvalidArgumentError("depth must be >= 2 (one chunk encoding while one is copied)")
    n = pages_gpu.shape[0]
    rust = _backend(backend, pages_gpu.device) == "rust"
    # The GPU path checks the ids as it stages them, in two parts (``_IdStager``): 0.3 ms of host
    # time for all of a 128k-token session's, before the bus could start.
    ids_given = _check_table_ids(table_ids, n, codec, check_range=rust)
    session = CompressedSession(codec, n, pages_gpu.dtype if pages_gpu.is_floating_point() else _TORCH_DTYPES[codec.dtype])
    if rust:
        tids = np.ascontiguousarray(ids_given, dtype=np.int32)  # no copy when it is already that
        for a, b in plan_chunks(n, chunk_pages):
            session.chunks.append(_rust_encode_chunk(codec, pages_gpu[a:b].cpu(), tids[a:b], a, host, session))
        return session

    from weightszip.kernels.regions import post

    ep = codec.kernels()

    dev = pages_gpu.device
    tables = codec.tables(dev)
    st = _Streams(dev, "offload")
    plan = plan_chunks(n, chunk_pages)

    def bits(a, b):  # a chunk's 16-bit patterns (a view unless the pages are strided)
        return pages_gpu[a:b].contiguous().view(torch.int16)

    if not plan:
        return session
    # The first chunks' ids before the bus starts (to the first chunk boundary at or past 4 *
    # chunk_pages pages: 11 chunks of the default plan, about 150 KB), the rest in one go once the
    # host is well ahead of the bus. Staged chunk by chunk, the host fell behind the bus in chunks
    # 1-5 (H200 box, BENCHMARKS.md: each staging about 0.25 ms of the offload's host time, though
    # its steps timed alone add up to 40 us).
    ids = _IdStager(ids_given, len(codec), dev, st)
    ids.stage(0, next(b for a, b in plan if b >= min(n, 4 * chunk_pages)))
    tids_dev = ids.dev
    arena_used = host.used if host is not None else 0
    bad_ids = None
    nslots = min(depth, len(plan))
    # Chunk i's size must reach the host before its copy is queued. The encoder's size pass
    # (no serial chain, ~870 GB/s on an H200) runs one chunk ahead of the encoding, and the size
    # comes back through pinned memory written by a kernel: a device-to-host copy would wait
    # behind the previous chunks' copies on the copy engine, and sizing every chunk up front
    # delays the first copy by the whole pass (20 ms for 17 GB).
    sizes = torch.zeros(len(plan), dtype=torch.int64, pin_memory=st.cuda)
    layouts, sized = [], []

    def size_pass(i):
        a, b = plan[i]
        with st.on("comp"):
            layouts.append(ep.page_layout(bits(a, b), tables, tids_dev[a:b]))
            post(layouts[i][1][-1:], sizes[i : i + 1])
            sized.append(st.record("comp"))

    ring = [None] * nslots
    max_pages = max(b - a for a, b in plan)
    d2h_done = []
    with st.on("comp"):
        digests = _Digests(len(plan), dev, st.cuda, pin_now=False)  # pinned with the rest of the ids
    size_pass(0)
    for i, (a, b) in enumerate(plan):
        if sized[i] is not None:
            sized[i].synchronize()
        nb = int(sizes[i])
        slot = i % nslots
        n_i = b - a
        nr = _region_bytes(nb, n_i)  # the chunk's bytes, offsets and table ids: one copy to the host
        with st.on("comp"):
            if i >= nslots:  # the ring buffer's previous chunk has reached the host (issued: nslots >= 2)
                st.wait("comp", d2h_done[i - nslots])
            if ring[slot] is None or ring[slot].numel() < nr:
                # Room for the largest chunk at this chunk's bytes per page, and a quarter more.
                # A buffer replaced here was last read by the copy the stream just waited for, and
                # the allocator hands its block out again only to work queued after that wait.
                full = max(nr, nb // n_i * max_pages + _region_bytes(0, max_pages))
                ring[slot] = _ring_buffer((full + full // 4) // 8 * 8 + 64, dev)
            buf = ring[slot]
            ep.encode_into(bits(a, b), tables, tids_dev[a:b], buf, layouts[i], block_pages)
            o, t = nb + 8 * (n_i + 1), nb + 8 * (n_i + 1) + 4 * n_i
            buf[nb:o].copy_(layouts[i][1].view(torch.uint8))
            buf[o:t].copy_(tids_dev[a:b].view(torch.uint8))
            buf[t:nr].zero_()
            layouts[i] = None  # its offsets are in the buffer now
            enc_done = st.record("comp")
        region = _host_region(host, nr, session)
        with st.on("copy"):  # queued before the digest: the bus starts as soon as the bytes are there
            st.wait("copy", enc_done)
            region.copy_(buf[:nr], non_blocking=True)
            d2h_done.append(st.record("copy"))
        session.chunks.append(Chunk(a, b - a, nb, region, 0))
        # The next chunk's size pass right behind this chunk's encoding (the host waits for it at
        # the top of the next round, while this chunk's copy runs), then this chunk's digest.
        # Queued ahead of the encoding, it delayed the first copy; one more chunk ahead, the host
        # had two size passes to queue during the first chunk's copy, and the bus waited.
        if i + 1 < len(plan):
            if ids.staged < plan[i + 1][1]:
                try:
                    ids.stage(ids.staged, n)
                except InvalidArgumentError as e:
                    bad_ids = e
                    break
                digests.pin()
            size_pass(i + 1)
        with st.on("comp"):
            digests.put(i, pages_gpu[a:b])
    if bad_ids is not None:  # nothing of this call is kept: its work ends, its arena slices are free again
        st.finish()
        if host is not None:
            host.used = arena_used
        raise bad_ids
    with st.on("comp"):
        digests.collect()
    st.finish()
    for c, d in zip(session.chunks, digests.read()):
        c.digest = int(d)
    return session


class _IdStager:
    """The table ids reach the GPU in parts, each before the first size pass that reads it:
    ``stage(a, b)`` checks ids ``[a, b)`` on the host (InvalidArgumentError outside
    ``[0, n_codebooks)``: nothing of that part is queued), copies them into one pinned buffer and
    queues their copy into ``dev`` on the compute stream; ``staged`` is the end of the last part.
    Staging all of a 128k-token session's ids (2 MB) and checking their range before the first
    chunk held the bus back about 0.9 ms (H200 host). From pinned memory the copy makes the host
    wait for nothing (from pageable memory it waits for the stream's queued work); torch's
    pinned-block cache keeps the buffer until the copies queued from it have run."""

    def __init__(self, ids: np.ndarray, n_codebooks: int, dev: torch.device, st: _Streams):
        self.ids, self.n_codebooks, self.st, self.staged = ids, n_codebooks, st, 0
        with st.on("comp"):  # used on the compute stream only
            self.dev = torch.empty(len(ids), dtype=torch.int32, device=dev)
        self.pinned = torch.empty(len(ids), dtype=torch.int32, pin_memory=True) if st.cuda else None

    def stage(self, a: int, b: int) -> None:
        part = self.ids[a:b]
        _check_id_range(part, self.n_codebooks)
        self.staged = b
        if self.pinned is None:
            self.dev[a:b] = torch.from_numpy(part.astype(np.int32))
            return
        self.pinned.numpy()[a:b] = part
        with self.st.on("comp"):
            self.dev[a:b].copy_(self.pinned[a:b], non_blocking=True)


def _ring_buffer(nbytes: int, device) -> torch.Tensor:
    return torch.empty(nbytes, dtype=torch.uint8, device=device)


def _rust_encode_chunk(codec, vals: torch.Tensor, tids: np.ndarray, start: int, host, session) -> Chunk:
    v = vals.contiguous().view(torch.int16).numpy().view(np.uint16)
    bufs, offs, base = [], [0], 0
    for a, b, t in _runs(tids):
        buf, o = _pages.encode_pages(codec.codebooks[t], v[a:b])
        bufs.append(np.frombuffer(buf, np.uint8))
        offs.extend((o[1:] + base).tolist())
        base += len(buf)
    n = len(tids)
    region = _host_region(host, _region_bytes(base, n), session)
    r = region.numpy()
    r[:base] = np.concatenate(bufs) if bufs else np.zeros(0, np.uint8)
    r[base : base + 8 * (n + 1)] = np.asarray(offs, "<i8").view(np.uint8)
    r[base + 8 * (n + 1) : base + 8 * (n + 1) + 4 * n] = tids.astype("<i4").view(np.uint8)
    r[base + 8 * (n + 1) + 4 * n :] = 0
    return Chunk(start, n, base, region, int(digest(vals)))


# --- restore --------------------------------------------------------------------------------


def _check_region(c: Chunk) -> None:
    if c.host.numel() < c.region_bytes:
        raise TruncatedError(f"chunk at page {c.start}: {c.host.numel()} bytes, expected {c.region_bytes}")


def _words(b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """uint8 bytes ``b`` as ``dtype`` words: a view, or a copy where the bytes do not start at a
    multiple of the word size (a host region may sit at any address)."""
    return (b if b.storage_offset() % dtype.itemsize == 0 else b.clone()).view(dtype)


def _chunk_parts(c: Chunk):
    """(page bytes, offsets int64, table ids int32) of a chunk region (on its device; views where
    the region is aligned)."""
    _check_region(c)
    host = c.host if c.host.is_contiguous() else c.host.contiguous()  # a strided view of the bytes
    o = c.nbytes
    offs = _words(host[o : o + 8 * (c.n_pages + 1)], torch.int64)
    t = o + 8 * (c.n_pages + 1)
    return host[:o], offs, _words(host[t : t + 4 * c.n_pages], torch.int32)


def _check_chunks(session: CompressedSession) -> None:
    """The chunks tile pages 0 .. n_pages exactly, in order, each a 1-D uint8 host region whose page
    bytes end at a multiple of 8 (where the encoders put the offsets): checked
    before anything is decoded, so that a session edited or damaged in memory cannot make restore
    write outside its output or leave pages unwritten (CorruptDataError). Then each region's size
    (TruncatedError) and its pages against its bytes (CorruptDataError), before anything is
    allocated."""
    at = 0
    for c in session.chunks:
        if not (isinstance(c, Chunk)
                and all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in (c.start, c.n_pages, c.nbytes))
                and c.nbytes >= 0 and c.nbytes % 8 == 0 and c.n_pages >= 1 and c.start == at
                and isinstance(c.host, torch.Tensor) and c.host.dtype == torch.uint8 and c.host.dim() == 1):
            raise CorruptDataError(f"session chunks must cover pages 0..{session.n_pages} in order; one at page "
                                   f"{getattr(c, 'start', '?')} (of {getattr(c, 'n_pages', '?')} pages) does not follow page {at}")
        at += c.n_pages
    if at != session.n_pages:
        raise CorruptDataError(f"session chunks cover pages 0..{at}, the session has {session.n_pages}")
    # Sizes against the bytes there are, before restore allocates its output for n_pages: a page
    # holds at least its header and its raw part (16 or 14 bytes a channel), so the pages a chunk
    # declares are at most its page bytes / that (the output then at most about 2.3x the bytes given).
    least = _pages.header_len(session.codec.channels) + _pages.page_raw_part(session.codec.version, session.codec.channels)
    for c in session.chunks:
        _check_region(c)
        if c.n_pages * least > c.nbytes:
            raise CorruptDataError(f"chunk at page {c.start}: {c.n_pages} pages cannot fit in its {c.nbytes} bytes "
                                   f"(a page is at least {least})")


def restore(session: CompressedSession, out_pages_gpu: torch.Tensor | None = None, *, depth: int = 3,
            verify: bool = True, backend: str = "auto", device=None, block_pages: int | None = None) -> torch.Tensor:
    """Decode ``session`` into ``out_pages_gpu`` ([n, 16, C], allocated on ``device`` when not
    given) and return it. Raises ChecksumMismatchError when ``verify`` finds a chunk whose
    decoded pages differ from what was offloaded; the Rust backend also raises CorruptDataError
    or TruncatedError for damaged structure. ``block_pages``: the GPU decoder's pages per program
    (default: ``exact_page.decode_into``'s)."""
    if not isinstance(session, CompressedSession):
        raise InvalidArgumentError(f"restore takes a CompressedSession, got {type(session).__name__}")
    _check_chunks(session)
    codec = session.codec
    if out_pages_gpu is None:
        dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        out_pages_gpu = torch.empty(session.n_pages, PAGE_TOKENS, codec.channels, dtype=session.dtype, device=dev)
    _check_pages(out_pages_gpu, codec, "out_pages")
    if out_pages_gpu.shape[0] != session.n_pages:
        raise InvalidArgumentError(f"out_pages holds {out_pages_gpu.shape[0]} pages, the session {session.n_pages}")
    if not out_pages_gpu.is_contiguous():
        raise InvalidArgumentError("out_pages must be contiguous")
    if depth < 2:
        raise InvalidArgumentError("restore needs depth >= 2 (one buffer copying while one decodes)")
    out16 = out_pages_gpu.view(torch.int16)
    if _backend(backend, out_pages_gpu.device) == "rust":
        for c in session.chunks:
            dec = _rust_decode_chunk(codec, c)
            if verify and int(digest(dec)) != c.digest:
                raise ChecksumMismatchError(f"chunk of pages {c.start}..{c.start + c.n_pages}: decoded pages differ from the offloaded ones")
            out16[c.start : c.start + c.n_pages].copy_(dec)
        return out_pages_gpu

    decode_into = codec.kernels().decode_into
    dev = out_pages_gpu.device
    tables = codec.tables(dev)
    chunks = session.chunks
    if not chunks:
        return out_pages_gpu
    slack = _staging_slack(codec.channels)
    size = max(c.region_bytes for c in chunks) + slack
    st = _Streams(dev, "restore")
    with st.on("copy"):  # allocated on the copy stream: its first use
        staging = [torch.empty(size, dtype=torch.uint8, device=dev) for _ in range(min(depth, len(chunks)))]
    nslots = len(staging)
    copied, decoded = [None] * len(chunks), [None] * len(chunks)
    with st.on("comp"):
        digests = _Digests(len(chunks), dev, st.cuda) if verify else None

    def issue_copy(i):
        with st.on("copy"):
            if i >= nslots:  # the buffer's previous chunk has been decoded
                st.wait("copy", decoded[i - nslots])
            c = chunks[i]
            staging[i % nslots][: c.region_bytes].copy_(c.host[: c.region_bytes], non_blocking=True)
            copied[i] = st.record("copy")

    for i in range(nslots - 1):
        issue_copy(i)
    G = len(codec)
    for i, c in enumerate(chunks):
        if i + nslots - 1 < len(chunks):
            issue_copy(i + nslots - 1)
        with st.on("comp"):
            st.wait("comp", copied[i])
            buf = staging[i % nslots]
            o = c.nbytes
            offs = buf[o : o + 8 * (c.n_pages + 1)].view(torch.int64).clamp(0, o)
            t = o + 8 * (c.n_pages + 1)
            tids = buf[t : t + 4 * c.n_pages].view(torch.int32).clamp(0, G - 1)
            dst = out16[c.start : c.start + c.n_pages]
            decode_into(buf, offs, tables, dst, tids, block_pages)  # ids clamped above: no host read
            if verify:
                digests.put(i, dst)
            decoded[i] = st.record("comp")
    if verify:
        with st.on("comp"):
            digests.collect()
    st.finish()
    if verify:
        for c, d in zip(chunks, digests.read()):
            if int(d) != c.digest:
                raise ChecksumMismatchError(f"chunk of pages {c.start}..{c.start + c.n_pages}: decoded pages differ from the offloaded ones")
    return out_pages_gpu


def _rust_decode_chunk(codec: ExactPageCodec, c: Chunk) -> torch.Tensor:
    body, offs, tids = _chunk_parts(c)
    body, offs, tids = body.cpu().numpy(), offs.cpu().numpy(), tids.cpu().numpy()
    if c.n_pages and (int(tids.min()) < 0 or int(tids.max()) >= len(codec)):
        raise CorruptDataError(f"chunk of pages {c.start}..{c.start + c.n_pages}: table id out of range")
    if int(offs.min()) < 0 or int(offs.max()) > c.nbytes:
        raise CorruptDataError(f"chunk of pages {c.start}..{c.start + c.n_pages}: page offset outside the chunk")
    out = np.empty((c.n_pages, PAGE_TOKENS, codec.channels), np.uint16)
    for a, b, t in _runs(tids):
        out[a:b] = _pages.decode_pages(codec.codebooks[t], body, offs[a : b + 1])
    return torch.from_numpy(out.view(np.int16))


__all__ = ["ExactPageCodec", "CompressedSession", "Chunk", "HostArena", "offload", "restore", "digest", "plan_chunks"]
