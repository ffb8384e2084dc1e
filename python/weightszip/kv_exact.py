"""KV Exact: a paged KV cache held losslessly compressed in GPU memory, read inside attention.

Pages (16 tokens of one layer, all KV heads; docs/FORMAT.md "KV Exact pages") live in one byte heap
per cache, each page at its own offset and of its own size (``PageHeap`` allocates them). A page is
written when its 16th token arrives; the last 16 tokens of every sequence stay in a bf16 ring, which
the attention kernel reads as its recent window. The decode-attention kernel (``paged_decode``,
``page_type="exact"``) decodes pages in its inner loop into the same bf16 tiles an uncompressed
cache would give, so its output is bit for bit the output of the same kernel over bf16 pages.

    cache = KVExactCache(layers=32, kv_heads=8, head_dim=128, num_q_heads=32,
                         heap_bytes=40 << 30, max_seqs=64, max_tokens=131072)
    s = cache.add_sequence()
    for layer in range(32):                       # prefill
        cache.append(layer, [s], k[layer][None], v[layer][None])     # [1, T, H, D] bf16
    cache.plan([s], new_tokens=1)                 # once per decode step
    for layer in range(32):
        cache.append(layer, [s], k_new, v_new)    # [1, 1, H, D]
        out = cache.attend(layer, q)              # [1, num_q_heads, D]
    cache.free_sequence(s)

Window tops (``bases``, one byte per channel per layer and K/V) set the page size, never the
values: pass calibrated ones (``calibrate_bases`` over sample KV) or let the cache take them from
the first page each layer writes.

``page_format="exact4"`` holds KV Exact4 pages instead (docs/FORMAT.md "KV Exact4 pages":
``kv_exact4_ref``): 0.78-0.82 of bf16 on real KV (mean 0.789) instead of 0.70, with no calibration
(each page carries its window tops), and attention that decodes them 2.4-2.7x faster than KV
Exact's (still 0.36-0.40x of bf16 attention on the H200: BENCHMARKS.md, "KV Exact4"). Its pages are
written by ``kernels.kv_exact4_codec`` (Triton; the reference encoder's bytes) where the kernels run.

Also here: ``offload_sequence`` / ``restore_sequence`` (a sequence's compressed pages to host memory
and back, no decoding), ``generate`` / ``kv_exact_attention`` (a transformers model's attention
reading the cache; ``attend(reference=True)`` runs the same kernel over the pages decoded to bf16),
and ``cpu_encode_pages`` / ``cpu_decode_pages`` and ``cpu_encode_exact4_pages`` /
``cpu_decode_exact4_pages`` (the Rust codecs: the same bytes on the CPU, validating every page).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import numbers
from collections import deque
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import numpy as np
import torch

from weightszip import _core
from weightszip._tensors import int_arg
from weightszip.errors import (
    ChecksumMismatchError,
    CorruptDataError,
    InvalidArgumentError,
    LimitExceededError,
    TruncatedError,
    UnsupportedFeatureError,
)
from weightszip.kernels import kv_exact4_ref as ref4
from weightszip.kernels import kv_exact_ref as ref
from weightszip.pages import _bytes, _offsets_u64, _u16

PAGE = ref.PAGE_TOKENS


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise InvalidArgumentError(msg)


def _to_device(x, device: torch.device, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Host data (lists, numpy) on ``device`` without a host wait: on CUDA through pinned memory and
    a non-blocking copy (a copy from pageable memory waits for the stream's queued work, so every
    index array of a decode step would hold the host until the GPU caught up)."""
    t = torch.as_tensor(x, dtype=dtype)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _bases(bases, channels: int) -> bytes:
    b = bases.detach().cpu().numpy() if isinstance(bases, torch.Tensor) else np.asarray(bases)
    _check(b.dtype == np.uint8 and b.size == channels, f"bases must be {channels} uint8 window tops")
    return b.tobytes()


def _bf16_bits(values) -> np.ndarray:
    """bf16 values (a bf16 tensor, or int16 / uint16 bit patterns) as uint16 bits; float16 refused
    (KV Exact pages hold bf16: float16 bits would code as other numbers)."""
    _check(str(getattr(values, "dtype", "")) not in ("torch.float16", "float16"),
           "KV Exact pages hold bfloat16 values (or their 16-bit patterns), not float16")
    return _u16(values)


def cpu_calibrate_bases(samples) -> np.ndarray:
    """Window tops uint8 [C] from ``[rows, C]`` bf16 samples, by the Rust codec (the same choice as
    ``kv_exact_ref.calibrate_bases``)."""
    a = _u16(samples)
    _check(a.ndim == 2 and a.size > 0, "samples must be [rows, channels]")
    _check_channels(1, a.shape[1])
    return np.frombuffer(_core.kvx_calibrate(a.shape[1], a.ctypes.data, a.nbytes), np.uint8).copy()


def cpu_encode_pages(values, bases) -> tuple[bytes, np.ndarray]:
    """KV Exact pages of ``[n, 16, H, D]`` bf16 values by the Rust codec (the bytes the GPU kernels
    read and ``kv_exact_ref.encode_pages`` writes): (pages back to back, int64 offsets [n + 1])."""
    a = _bf16_bits(values)
    _check(a.ndim == 4 and a.shape[1] == PAGE, f"values must be [n, {PAGE}, heads, head_dim], got {a.shape}")
    _, _, h, d = a.shape
    buf, offs = _core.kvx_encode(h, d, _bases(bases, h * d), a.ctypes.data, a.nbytes)
    return buf, np.asarray(offs, np.int64)


def _check_channels(heads: int, head_dim: int) -> None:
    """The Rust codecs' limit on a page's channels (heads x head_dim), checked before the offsets."""
    if heads * head_dim > 1 << 16:
        raise LimitExceededError(f"{heads} x {head_dim} channels (at most {1 << 16})")


def _check_spans(offs: list[int], buf_len: int, min_page: int) -> None:
    """The decoders' first rules, on the offsets alone and before the output is allocated, so that
    hostile offsets cannot ask for more memory than the bytes could decode to: they run from 0 to the
    buffer's end (TruncatedError), do not decrease (CorruptDataError), and no page is shorter than
    ``min_page`` (TruncatedError naming it; the references' order). After them n pages hold at least
    n x ``min_page`` bytes."""
    o = np.asarray(offs, dtype=np.uint64)
    if int(o[0]) != 0 or int(o[-1]) != buf_len:
        raise TruncatedError(f"page offsets cover bytes {int(o[0])}..{int(o[-1])} of a {buf_len}-byte buffer")
    down = np.flatnonzero(o[1:] < o[:-1])
    if down.size:
        raise CorruptDataError(f"page {int(down[0])}: offsets decrease")
    short = np.flatnonzero(np.diff(o) < min_page)
    if short.size:
        i = int(short[0])
        raise TruncatedError(f"page {i}: {int(o[i + 1] - o[i])} bytes, a page has at least {min_page}")


def cpu_decode_pages(buf, offsets, bases, heads: int, head_dim: int) -> np.ndarray:
    """Validate and decode KV Exact pages stored back to back (page i = ``buf[offsets[i]:offsets[i +
    1]]``) by the Rust codec: uint16 ``[n, 16, heads, head_dim]``. Damaged or hostile bytes raise
    TruncatedError / CorruptDataError naming the page."""
    heads, head_dim = int_arg("heads", heads, 0, 2**31), int_arg("head_dim", head_dim, 0, 2**31)
    src = _bytes(buf)
    offs = _offsets_u64(offsets)
    _check(heads > 0 and head_dim > 0 and head_dim % 32 == 0,
           f"KV Exact pages need heads > 0 and head_dim a positive multiple of 32, not {heads} x {head_dim}")
    _check_channels(heads, head_dim)
    tops = _bases(bases, heads * head_dim)
    _check_spans(offs, src.nbytes, ref.fixed_bytes(heads, head_dim))
    out = np.empty((len(offs) - 1, PAGE, heads, head_dim), np.uint16)
    _core.kvx_decode(heads, head_dim, tops, src.ctypes.data, src.nbytes, offs, out.ctypes.data, out.nbytes)
    return out


def cpu_encode_exact4_pages(values) -> tuple[bytes, np.ndarray]:
    """KV Exact4 pages of ``[n, 16, H, D]`` bf16 values by the Rust codec (the bytes the GPU kernels
    read and ``kv_exact4_ref.encode_pages(values).to_bytes()`` writes): (pages back to back, int64
    offsets [n + 1])."""
    a = _bf16_bits(values)
    _check(a.ndim == 4 and a.shape[1] == PAGE, f"values must be [n, {PAGE}, heads, head_dim], got {a.shape}")
    _, _, h, d = a.shape
    buf, offs = _core.kvx4_encode(h, d, a.ctypes.data, a.nbytes)
    return buf, np.asarray(offs, np.int64)


def cpu_decode_exact4_pages(buf, offsets, heads: int, head_dim: int) -> np.ndarray:
    """Validate and decode KV Exact4 pages stored back to back (page i = ``buf[offsets[i]:offsets[i +
    1]]``) by the Rust codec: uint16 ``[n, 16, heads, head_dim]``. Damaged or hostile bytes raise
    TruncatedError / CorruptDataError naming the page, the same class as ``kv_exact4_ref.decode_pages``
    raises for the same input."""
    heads, head_dim = int_arg("heads", heads, 0, 2**31), int_arg("head_dim", head_dim, 0, 2**31)
    src = _bytes(buf)
    offs = _offsets_u64(offsets)
    _check(0 < heads <= ref4.MAX_HEADS, f"KV Exact4 pages hold 1 to {ref4.MAX_HEADS} KV heads, not {heads}")
    _check(head_dim > 0 and head_dim % 32 == 0, f"head_dim must be a positive multiple of 32, not {head_dim}")
    _check_channels(heads, head_dim)
    _check_spans(offs, src.nbytes, ref4.page_length(heads, head_dim, 0))
    out = np.empty((len(offs) - 1, PAGE, heads, head_dim), np.uint16)
    _core.kvx4_decode(heads, head_dim, src.ctypes.data, src.nbytes, offs, out.ctypes.data, out.nbytes)
    return out


@dataclass
class OffloadedSequence:
    """One sequence of a ``KVExactCache`` in host memory, as its compressed page bytes: ``data``
    (uint8, pinned when the cache is on a GPU) holds every page in (layer, K/V, page) order,
    ``sizes`` int64 [layers, 2, pages] their lengths; ``ring`` the bf16 ring [layers, 2, 16, H, D];
    ``lengths`` the tokens per layer; ``bases`` the window tops the pages were coded with (KV Exact
    pages); ``page_format`` the cache's ("exact" or "exact4"); ``digest`` (with
    ``offload_sequence(digest=True)``, else None) the XXH3-64 of ``data`` and of the ring's bytes,
    which ``restore_sequence(verify=True)`` checks: the pages carry no checksum of their own."""

    data: torch.Tensor
    sizes: np.ndarray
    ring: torch.Tensor
    lengths: np.ndarray
    bases: torch.Tensor
    page_format: str = "exact"
    digest: int | None = None

    @property
    def nbytes(self) -> int:
        return int(self.data.numel() + self.ring.numel() * 2)


def _sequence_digest(data: torch.Tensor, ring: torch.Tensor) -> int:
    """XXH3-64 of an offloaded sequence's page bytes, then of its ring's (host tensors), combined."""
    parts = np.asarray([_core.xxh3_64(t.data_ptr(), t.numel() * t.element_size())
                        for t in (data.contiguous(), ring.contiguous())], dtype=np.uint64)
    return _core.xxh3_64(parts.ctypes.data, parts.nbytes)


def usable_device(device, what: str = "the cache") -> torch.device:
    """``torch.device(device)``, where torch can use it: a CUDA device without a GPU (or a CUDA build of
    torch) is UnsupportedFeatureError, not torch's RuntimeError from the first allocation."""
    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise InvalidArgumentError(f"{what}: not a device: {device!r} ({e})") from None
    if d.type == "cuda" and not torch.cuda.is_available():
        raise UnsupportedFeatureError(f"{what} on {d} needs a CUDA GPU, and torch sees none (device='cpu' runs it "
                                      "on the CPU)")
    return d


def _kernels_run(device: torch.device) -> bool:
    """Whether Triton kernels run on ``device``'s tensors: a GPU, or the CPU in Triton's interpreter."""
    from weightszip.kernels._interpreter_compat import interpreting

    return device.type == "cuda" or interpreting()


def _write_kernels(device: torch.device, heads: int, head_dim: int, page_format: str = "exact"):
    """The write kernels of ``page_format`` (kernels.kv_exact_write; exact4: kernels.kv_exact4_codec)
    for a cache on a GPU (or in Triton's interpreter) of a shape they take, else None (the reference
    encoder writes the same bytes)."""
    if _kernels_run(device):
        if page_format == "exact4":
            from weightszip.kernels import kv_exact4_codec as kernels
        else:
            from weightszip.kernels import kv_exact_write as kernels
        if kernels.supports(heads, head_dim):
            return kernels
    return None


def _copy_regions(src: torch.Tensor, src_offsets: torch.Tensor, dst: torch.Tensor, dst_offsets: torch.Tensor,
                  sizes: torch.Tensor) -> None:
    """Byte regions from src to dst (kernels.regions on a GPU or in Triton's interpreter for 16-byte
    aligned buffers, its torch reference otherwise)."""
    aligned = src.data_ptr() % 16 == 0 and dst.data_ptr() % 16 == 0 and src.numel() % 4 == 0 and dst.numel() % 4 == 0
    if aligned and src.device == dst.device and _kernels_run(src.device):
        from weightszip.kernels.regions import copy_regions

        copy_regions(src, src_offsets, dst, dst_offsets, sizes)
    else:
        from weightszip.kernels.regions_ref import copy_regions_ref

        copy_regions_ref(src, src_offsets, dst, dst_offsets, sizes)


def _chunks(sizes: np.ndarray, chunk_bytes: int):
    """Runs of consecutive regions of about ``chunk_bytes`` bytes (at least one region each, empty
    runs skipped): (first, end, byte position, bytes) per run."""
    ends = np.cumsum(sizes)
    i, pos, n = 0, 0, sizes.size
    while i < n:
        j = max(i + 1, int(np.searchsorted(ends, pos + chunk_bytes, side="right")))
        acc = int(ends[j - 1]) - pos
        if acc:
            yield i, j, pos, acc
        pos, i = pos + acc, j


def _chunk_local_offsets(sizes: torch.Tensor, chunks) -> torch.Tensor:
    """Each region's byte offset inside its chunk (``_chunks``'s runs), int64 on sizes' device."""
    # runs of regions with one chunk start each: the chunks, and the empty runs between them (start 0)
    bounds = np.asarray([0] + [x for i, j, _, _ in chunks for x in (i, j)] + [sizes.numel()], dtype=np.int64)
    pos = np.asarray([x for _, _, p, _ in chunks for x in (0, p)] + [0], dtype=np.int64)
    dev = sizes.device
    starts = torch.repeat_interleave(torch.as_tensor(pos, device=dev), torch.as_tensor(np.diff(bounds), device=dev),
                                     output_size=sizes.numel())
    return torch.cumsum(sizes, 0) - sizes - starts


def _pipelined(device: torch.device, chunks, first, second, *, copy_first: bool = False) -> None:
    """Run ``first(chunk, buf)`` then ``second(chunk, buf)`` for every chunk through two staging
    buffers on the GPU, on ``offload._Streams``'s copy stream (the bus copies: ``second``, or
    ``first`` with ``copy_first``) and compute stream (the gathers and scatters): chunk n's copy
    overlaps the kernel of chunk n + 1 (offload) or n - 1 (restore). Returns with the current stream
    ordered after all of it (no sync), also when a chunk fails; the buffers go back to the caching
    allocator only then, so it never hands them out while a copy still reads or writes them."""
    from weightszip.offload import _Streams

    if not chunks:
        return
    st = _Streams(device, "kv-exact-restore" if copy_first else "kv-exact-offload")
    roles = ("copy", "comp") if copy_first else ("comp", "copy")
    size = max(c[3] for c in chunks)
    bufs = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(min(2, len(chunks)))]
    handed = [None] * len(bufs)  # first -> second: the buffer's chunk is ready
    freed = [None] * len(bufs)  # second -> first: the buffer may be refilled
    try:
        for n, c in enumerate(chunks):
            b = n % len(bufs)
            with st.on(roles[0]):
                st.wait(roles[0], freed[b])
                first(c, bufs[b])
                handed[b] = st.record(roles[0])
            with st.on(roles[1]):
                st.wait(roles[1], handed[b])
                second(c, bufs[b])
                freed[b] = st.record(roles[1])
    finally:
        st.join()
    del bufs


def _int_array(x, name: str) -> np.ndarray:
    """``x`` (a scalar, sequence or array of integers) as a flat int64 array; other numbers refused
    (a float would be truncated: 16.9 bytes taken as 16)."""
    a = x if isinstance(x, np.ndarray) else np.asarray(x)
    if a.dtype != np.int64:
        if a.size == 0:
            return np.zeros(0, dtype=np.int64)  # (np.asarray([]) is float64)
        _check(a.dtype.kind in "iu", f"{name} must be integers, not {a.dtype}")
        a = a.astype(np.int64)
    return a.reshape(-1)


class HeapRuns(NamedTuple):
    """``PageHeap.runs``: the regions to free as runs of touching ones (run offsets and bytes, lists;
    their total bytes), the regions themselves (offsets ascending, sizes) and where the heap found
    them live when ``runs`` ran (for ``release``)."""

    offsets: list
    sizes: list
    total: int
    regions: tuple[np.ndarray, np.ndarray]
    found: tuple  # (the heap's version, entries in the live arrays: indices or a slice, keys of the live dict)


class PageHeap:
    """Variable-size regions (multiples of 16 bytes) in one uint8 tensor.

    Free regions are kept by size (sets of offsets) and merged with free neighbours as they are
    freed, and space freed at the top lowers the top. An allocation takes a free region of its exact
    size, else fresh space at the top, else the smallest larger free region (split, the rest stays
    free). Pages of a layer differ by a few dozen bytes, so exact-size reuse is the common case.
    ``alloc`` is all or nothing: on LimitExceededError the heap is as before (free space merged).
    ``free``/``release`` take back only regions that ``alloc`` handed out and that are not freed yet
    (offset and size as given): anything else (a double free, a region never handed out, a part of
    one) is InvalidArgumentError with the heap as before. Not thread-safe: its owner (a
    ``KVExactCache``, itself one model's cache) makes one call at a time."""

    # The live regions (for free's checks), updated per batch: int64 arrays with room to grow, offsets
    # ascending (a freed entry keeps its offset with size 0 until the arrays are rebuilt), to which a
    # batch above them (from the top: a fresh heap, a prefill, a restore) is appended in place; a batch
    # that lands in holes below goes into a dict when it is small against them (a decode step
    # allocates a few pages per call: merging each into the arrays would copy them all), and the dict
    # into the arrays when it grows to a quarter of them; a larger batch is merged in.
    small_batch = 64

    def __init__(self, capacity: int, device="cuda", guard: int = 0):
        _check(int(capacity) >= ref.ALIGN, "heap capacity must be at least 16 bytes")
        _check(0 <= int(guard) <= 1 << 20, "guard must be 0..1 MiB")
        self.capacity = int(capacity) // ref.ALIGN * ref.ALIGN
        # ``guard`` zero bytes after the last allocatable one: reads that a damaged page could send
        # past its end (at most 16 * head_dim bytes, see KVExactCache) stay inside the buffer
        self.buf = torch.zeros(self.capacity + int(guard), dtype=torch.uint8, device=usable_device(device, "a page heap"))
        self.top = 0
        self.used = 0
        self._by_size: dict[int, set[int]] = {}
        self._sizes: list[int] = []  # sorted sizes with free regions
        self._start: dict[int, int] = {}  # free region offset -> size
        self._end: dict[int, int] = {}  # free region end -> offset
        self._live_buf = np.zeros((2, 0), dtype=np.int64)  # [offsets, sizes] of live regions, room to grow
        self._live_n = 0  # entries in use (see small_batch)
        self._live_dead = 0  # entries of size 0 (freed since the last rebuild)
        self._live_recent: dict[int, int] = {}  # offset -> size of regions from small batches
        self._version = 0  # changes with every alloc and release (``runs``' lookups stay valid until then)

    def _add(self, off: int, size: int) -> None:
        group = self._by_size.setdefault(size, set())
        if not group:
            bisect.insort(self._sizes, size)
        group.add(off)
        self._start[off] = size
        self._end[off + size] = off

    def _remove(self, off: int) -> int:
        size = self._start.pop(off)
        del self._end[off + size]
        group = self._by_size[size]
        group.discard(off)
        if not group:
            self._sizes.remove(size)
        return size

    def _release(self, off: int, size: int) -> None:
        """Make a region free, merged with free neighbours; free space at the top lowers the top."""
        if off + size in self._start:
            size += self._remove(off + size)
        if off in self._end:
            prev = self._end[off]
            size += self._remove(prev)
            off = prev
        if off + size == self.top:
            self.top = off
        else:
            self._add(off, size)

    def _take(self, size: int) -> int | None:
        group = self._by_size.get(size)
        if group:
            off = next(iter(group))
            self._remove(off)
            return off
        if self.top + size <= self.capacity:
            off = self.top
            self.top += size
            return off
        i = bisect.bisect_right(self._sizes, size)
        if i == len(self._sizes):
            return None
        big = self._sizes[i]
        off = next(iter(self._by_size[big]))
        self._remove(off)
        self._add(off + size, big - size)
        return off

    bulk_min = 256  # batches of at least this many regions are placed in runs (``_alloc_runs``)

    def _alloc_runs(self, sizes: np.ndarray, out: np.ndarray) -> int:
        """Place a batch's regions back to back in runs: the free regions that hold at least 64 of
        them, largest first, each taking as many of the next regions as fit (its rest stays free), then
        the top. Fills ``out`` for the first k regions and returns k (the caller places the rest one by
        one, into smaller free regions, or rolls back). A restore of a whole sequence (hundreds of
        thousands of pages) into a heap with free regions then costs a few numpy calls per large free
        region, not a Python step per page; small holes are left to single pages (decode steps)."""
        ends = np.cumsum(sizes)
        min_run = 64 * int(ends[-1]) // sizes.size
        i = 0
        for size in sorted((z for z in self._sizes if z >= min_run), reverse=True):
            for off in sorted(self._by_size.get(size, ())):
                if i == sizes.size:
                    return i
                base = int(ends[i - 1]) if i else 0
                j = int(np.searchsorted(ends, base + size, side="right"))
                if j == i:
                    continue  # the next region does not fit here
                used = int(ends[j - 1]) - base
                self._remove(off)
                if used < size:
                    self._add(off + used, size - used)
                out[i:j] = off + ends[i:j] - sizes[i:j] - base
                i = j
        if i < sizes.size:
            base = int(ends[i - 1]) if i else 0
            j = int(np.searchsorted(ends, base + self.capacity - self.top, side="right"))
            out[i:j] = self.top + ends[i:j] - sizes[i:j] - base
            self.top += int(ends[j - 1]) - base if j > i else 0
            i = j
        return i

    def alloc(self, sizes) -> np.ndarray:
        """Offsets (int64 [n]) of new regions of ``sizes`` bytes (integers, multiples of 16: one, or a
        1-D sequence of n), all or none."""
        _check(np.ndim(sizes) <= 1, "sizes must be an integer or a 1-D sequence of integers")
        sizes = _int_array(sizes, "sizes")
        _check(bool((sizes > 0).all() and (sizes % ref.ALIGN == 0).all()), "sizes must be positive multiples of 16")
        if sizes.size and int(sizes.max()) > self.capacity:  # (then no sum of a batch below wraps int64)
            raise LimitExceededError(f"KV Exact heap: a region of {int(sizes.max())} bytes is larger than the heap "
                                     f"({self.capacity} bytes)")
        out = np.empty(sizes.size, dtype=np.int64)
        # in runs when the batch is large, or when no free region is listed (then every region comes
        # from the top, back to back: what the loop below would do one by one)
        bulk = sizes.size >= self.bulk_min or (sizes.size and not self._start)
        first = self._alloc_runs(sizes, out) if bulk else 0
        for i in range(first, sizes.size):
            s = int(sizes[i])
            off = self._take(s)
            if off is None:
                for o, z in zip(out[:i].tolist(), sizes[:i].tolist()):
                    self._release(o, z)
                raise LimitExceededError(
                    f"KV Exact heap full: {s} bytes wanted, {self.capacity - self.used} free of {self.capacity} "
                    f"(largest free region {max(self._sizes[-1] if self._sizes else 0, self.capacity - self.top)})")
            out[i] = off
        self.used += int(sizes.sum())
        self._add_live(out, sizes)
        return out

    @property
    def _live(self) -> np.ndarray:
        """[offsets, sizes] of the live arrays' entries (a view)."""
        return self._live_buf[:, :self._live_n]

    def _set_live(self, live: np.ndarray, room: int = 0) -> None:
        """The live arrays rebuilt from ``live`` with ``room`` to grow: freed entries (size 0) are
        dropped here, as the count of them starts again at 0."""
        if self._live_dead:
            live = live[:, live[1] > 0]
        buf = np.empty((2, live.shape[1] + room), dtype=np.int64)
        buf[:, :live.shape[1]] = live
        self._live_buf, self._live_n, self._live_dead = buf, live.shape[1], 0

    def _add_live(self, offs: np.ndarray, sizes: np.ndarray) -> None:
        """Record newly allocated regions as live."""
        self._version += 1
        if offs.size > self.small_batch:
            if not bool((offs[1:] > offs[:-1]).all()):  # (from the top they come in order)
                order = np.argsort(offs)
                offs, sizes = offs[order], sizes[order]
            if self._append_live(offs, sizes):
                return
        n_live = self._live_n - self._live_dead
        if offs.size <= max(self.small_batch, n_live // 8):  # into the dict (a decode step's few pages)
            self._live_recent.update(zip(offs.tolist(), sizes.tolist()))
            if len(self._live_recent) <= max(1024, n_live // 4):
                return
            offs = np.fromiter(self._live_recent, dtype=np.int64, count=len(self._live_recent))
            sizes = np.fromiter(self._live_recent.values(), dtype=np.int64, count=offs.size)
            self._live_recent = {}
            order = np.argsort(offs)
            offs, sizes = offs[order], sizes[order]
            if self._append_live(offs, sizes):
                return
        live = self._live  # merged in, freed entries dropped
        if self._live_dead:
            live = live[:, live[1] > 0]
        at = np.searchsorted(live[0], offs)
        self._set_live(np.stack([np.insert(live[0], at, offs), np.insert(live[1], at, sizes)]))

    def _append_live(self, offs: np.ndarray, sizes: np.ndarray) -> bool:
        """Regions (offsets ascending) appended to the live arrays in place if they lie above them."""
        n, k = self._live_n, offs.size
        if n and offs[0] <= self._live_buf[0, n - 1]:
            return False
        if n + k > self._live_buf.shape[1]:
            self._set_live(self._live, room=max(n, k, 1024))
            n = self._live_n  # (freed entries dropped)
        self._live_buf[0, n:n + k], self._live_buf[1, n:n + k] = offs, sizes
        self._live_n += k
        return True

    def _in_arrays(self, o: np.ndarray, z: np.ndarray) -> tuple[np.ndarray | slice, np.ndarray | None]:
        """The regions (offsets ``o`` ascending, sizes ``z`` > 0) found live in the live arrays: (their
        entries there, indices or a slice; which regions were found, None for all)."""
        lo, lz = self._live
        if not lo.size:
            return np.zeros(0, dtype=np.int64), np.zeros(o.size, dtype=bool)
        i0 = int(np.searchsorted(lo, o[0]))
        stretch = slice(i0, i0 + o.size)
        if i0 + o.size <= lo.size and np.array_equal(lo[stretch], o) and np.array_equal(lz[stretch], z):
            return stretch, None  # (a sequence restored in one batch, a whole session)
        idx = np.minimum(np.searchsorted(lo, o), lo.size - 1)
        hit = (lo[idx] == o) & (lz[idx] == z)  # (a freed entry has size 0: no hit)
        return idx[hit], hit

    def _find_live(self, o: np.ndarray, z: np.ndarray) -> tuple[int, np.ndarray | slice, list]:
        """Where the regions (offsets ``o`` ascending, sizes ``z`` > 0) are recorded live:
        (version, their entries in the live arrays: indices or a slice, their keys in the live dict);
        InvalidArgumentError if one is not (nothing changes)."""
        recent = self._live_recent
        if o.size <= self.small_batch and recent:  # a few regions: the dict first, in Python
            ol = o.tolist()
            found = [recent.get(a) == b for a, b in zip(ol, z.tolist())]
            keys = [a for a, f in zip(ol, found) if f]
            if len(keys) == o.size:
                return self._version, slice(0, 0), keys
            rest = np.flatnonzero(~np.asarray(found))
            idx, hit = self._in_arrays(o[rest], z[rest])
            bad = rest[:0] if hit is None else rest[~hit]
        else:
            idx, hit = self._in_arrays(o, z)
            keys, bad = [], np.zeros(0, dtype=np.int64)
            if hit is not None and not hit.all():
                rest = np.flatnonzero(~hit)
                keys = o[rest].tolist()
                got = np.fromiter(map(recent.get, keys, itertools.repeat(0)), dtype=np.int64, count=rest.size)
                bad = rest[got != z[rest]]
        if bad.size:
            raise InvalidArgumentError(
                f"KV Exact heap: region at offset {int(o[bad[0]])} of {int(z[bad[0]])} bytes is not allocated "
                f"(freed already, never handed out by alloc, or not as allocated)"
                + (f"; {bad.size - 1} more such regions" if bad.size > 1 else ""))
        return self._version, idx, keys

    def free(self, offsets, sizes) -> None:
        """Return regions (offsets and sizes as ``alloc`` gave them) to the heap: all or none
        (InvalidArgumentError when one is not allocated, the heap as before)."""
        self.release(self.runs(offsets, sizes))

    def runs(self, offsets, sizes) -> HeapRuns:
        """The regions as runs of touching ones (run offsets, run bytes, total bytes), for
        ``release``, checked to be live (InvalidArgumentError, nothing changes). The sort and the
        check are the costly part of a free; a caller can do them while it waits."""
        offsets, sizes = _int_array(offsets, "offsets"), _int_array(sizes, "sizes")
        _check(offsets.size == sizes.size, f"{offsets.size} offsets but {sizes.size} sizes")
        if not offsets.size:
            return HeapRuns([], [], 0, (offsets, sizes), (self._version, offsets, []))
        _check(bool((sizes > 0).all()), "sizes must be positive")
        # regions that touch each other go back as one run (a freed sequence is a few runs, not
        # one release per page: 524288 single releases took 1.1 s of Python)
        order = np.argsort(offsets, kind="stable")
        o, z = offsets[order], sizes[order]
        ends = o[:-1] + z[:-1]
        if bool((o[1:] < ends).any()):
            i = int(np.flatnonzero(o[1:] < ends)[0])
            raise InvalidArgumentError(f"KV Exact heap: the regions to free overlap (offset {int(o[i + 1])} lies in "
                                       f"the region at {int(o[i])} of {int(z[i])} bytes; freed twice?)")
        found = self._find_live(o, z)
        cut = np.flatnonzero(o[1:] != ends) + 1
        starts = np.concatenate([[0], cut])
        return HeapRuns(o[starts].tolist(), np.add.reduceat(z, starts).tolist(), int(z.sum()), (o, z), found)

    def release(self, runs: HeapRuns) -> None:
        """Return ``runs(offsets, sizes)``'s regions to the heap: all or none, as ``free`` (their
        liveness is checked again if the heap changed since ``runs``)."""
        _check(isinstance(runs, HeapRuns), "release takes what runs() returned")
        if not runs.total:
            return
        version, idx, keys = runs.found
        if version != self._version:
            version, idx, keys = self._find_live(*runs.regions)
        self._version += 1
        self._live_buf[1, idx] = 0
        self._live_dead += idx.stop - idx.start if isinstance(idx, slice) else idx.size
        if keys:
            deque(map(self._live_recent.pop, keys), maxlen=0)
        if self._live_dead == self._live_n:  # all freed (a whole session): the arrays empty, room kept
            self._live_n = self._live_dead = 0
        elif self._live_dead * 2 > self._live_n:  # mostly freed entries: drop them
            live = self._live
            self._set_live(live[:, live[1] > 0])
        for off, n in zip(runs.offsets, runs.sizes):
            self._release(off, n)
        self.used -= runs.total

    def stats(self) -> dict:
        return {"capacity": self.capacity, "used": self.used, "top": self.top,
                "free_listed": sum(self._start.values()), "free_regions": len(self._start)}


def calibrate_bases(k_samples: torch.Tensor, v_samples: torch.Tensor) -> torch.Tensor:
    """Window tops uint8 [layers, 2, kv_heads, head_dim] from sample K and V ``[layers, T, kv_heads,
    head_dim]`` (bf16): the calibration of a model, made once from any text."""
    _check(k_samples.dim() == 4 and k_samples.shape == v_samples.shape, "samples must be [layers, T, H, D], K and V alike")
    L, _, h, d = k_samples.shape
    out = torch.empty((L, 2, h, d), dtype=torch.uint8)
    for layer in range(L):
        for kind, x in enumerate((k_samples, v_samples)):
            out[layer, kind] = ref.calibrate_bases(x[layer].reshape(-1, h * d)).reshape(h, d).cpu()
    return out


class KVExactCache:
    """A batch of sequences' KV Exact cache, every layer (see the module docstring)."""

    def __init__(self, *, layers: int, kv_heads: int, head_dim: int, num_q_heads: int, heap_bytes: int,
                 max_seqs: int, max_tokens: int, bases: torch.Tensor | None = None, device="cuda",
                 sm_scale: float | None = None, config=None, write_kernels: bool = True,
                 page_format: str = "exact"):
        """``write_kernels``: store pages through the Triton write kernels where they run (a GPU, or
        the interpreter); False: the reference encoder always (the same bytes; benchmarks compare).
        ``page_format``: "exact" (KV Exact pages) or "exact4" (KV Exact4 pages: no ``bases``)."""
        from weightszip.kernels import PagedDecodeAttention

        _check(page_format in ("exact", "exact4"), f"page_format must be 'exact' or 'exact4', not {page_format!r}")
        _check(layers > 0 and kv_heads > 0 and max_seqs > 0 and max_tokens > 0, "sizes must be positive")
        _check(head_dim >= 32 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two >= 32, not {head_dim}")
        _check(page_format == "exact" or (bases is None and kv_heads <= ref4.MAX_HEADS),
               f"exact4 pages hold their own window tops (no bases) and at most {ref4.MAX_HEADS} KV heads")
        self.page_format = page_format
        self._exact4 = page_format == "exact4"
        self.L, self.H, self.D, self.hq = layers, kv_heads, head_dim, num_q_heads
        self.device = usable_device(device, "a KV Exact cache")
        self.write_kernels = bool(write_kernels)
        self.heap = PageHeap(heap_bytes, self.device, guard=PAGE * head_dim)
        self.max_seqs = max_seqs
        self.max_pages = -(-max_tokens // PAGE)
        self.num_blocks = max_seqs * self.max_pages
        self.offsets = torch.zeros((layers, 2, self.num_blocks), dtype=torch.int64, device=self.device)
        self.sizes = np.zeros((layers, 2, self.num_blocks), dtype=np.int64)
        self.block_table = torch.zeros((max_seqs, self.max_pages), dtype=torch.int32, device=self.device)
        self._bt = np.full((max_seqs, self.max_pages), -1, dtype=np.int64)
        self._free_blocks = list(range(self.num_blocks - 1, -1, -1))
        self.ring = torch.zeros((layers, 2, max_seqs, PAGE, kv_heads, head_dim), dtype=torch.bfloat16, device=self.device)
        self.length = np.zeros((layers, max_seqs), dtype=np.int64)
        self._live: set[int] = set()
        self._free_slots = list(range(max_seqs - 1, -1, -1))
        if bases is None:
            self.bases = torch.zeros((layers, 2, kv_heads, head_dim), dtype=torch.uint8, device=self.device)
            self._calibrated = np.full((layers, 2), self._exact4)  # (exact4: nothing to calibrate)
        else:
            _check(tuple(bases.shape) == (layers, 2, kv_heads, head_dim) and bases.dtype == torch.uint8,
                   f"bases must be uint8 [{layers}, 2, {kv_heads}, {head_dim}]")
            self.bases = bases.to(self.device).contiguous()
            self._calibrated = np.ones((layers, 2), dtype=bool)
        self.attn = PagedDecodeAttention(num_q_heads, kv_heads, head_dim, page_type=page_format, block_size=PAGE,
                                         window=PAGE, sm_scale=sm_scale, config=config, device=self.device)
        self._planned: tuple[np.ndarray, np.ndarray] | None = None
        self._rows: torch.Tensor | None = None

    # -- sequences -------------------------------------------------------------------------------------
    def add_sequence(self) -> int:
        if not self._free_slots:
            raise LimitExceededError(f"KV Exact cache holds at most {self.max_seqs} sequences")
        s = self._free_slots.pop()
        self._live.add(s)
        self.length[:, s] = 0
        return s

    def free_sequence(self, seq: int) -> None:
        """Free a sequence's pages and block ids."""
        self._free(self._free_plan(seq))

    def _free_plan(self, seq: int, offsets: np.ndarray | None = None):
        """What freeing ``seq`` takes (nothing changes yet): its blocks and its pages' heap runs.
        ``offsets``: its pages' offsets [L, 2, pages] read back already (else read here, a sync)."""
        self._check_seq(seq)
        blocks = self._bt[seq][self._bt[seq] >= 0]
        sz = self.sizes[:, :, blocks]  # [L, 2, pages]
        have = sz > 0
        runs = self.heap.runs([], [])
        if have.any():  # every layer's pages in one read-back and one free
            if offsets is None or offsets.shape != sz.shape:
                offsets = self.offsets[:, :, torch.as_tensor(blocks, device=self.device)].cpu().numpy()
            runs = self.heap.runs(offsets[have], sz[have])
        return seq, blocks, runs

    def _free(self, plan) -> None:
        seq, blocks, runs = plan
        self.heap.release(runs)
        self.sizes[:, :, blocks] = 0
        self._free_blocks.extend(blocks.tolist())
        self._bt[seq] = -1
        self.length[:, seq] = 0
        self._live.discard(seq)
        self._free_slots.append(seq)

    def _check_seq(self, seq: int) -> None:
        _check(seq in self._live, f"sequence {seq} is not in the cache")

    def _check_layer(self, layer: int) -> None:
        _check(0 <= layer < self.L, f"layer {layer} out of range")

    # -- writes ----------------------------------------------------------------------------------------
    def append(self, layer: int, seqs, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``T`` tokens per sequence: k, v bf16 [len(seqs), T, kv_heads, head_dim]. Pages that
        fill are coded and stored (all sequences' pages in one coding pass); the last 16 tokens of each
        sequence go to its bf16 ring. No sequences (or T = 0): nothing to append."""
        self._check_layer(layer)
        _check(all(isinstance(s, numbers.Integral) and not isinstance(s, bool) for s in seqs),
               f"seqs must be sequence numbers (integers), got {list(seqs)!r:.80}")  # (0.7 was sequence 0)
        seqs = [int(s) for s in seqs]
        for s in seqs:
            self._check_seq(s)
        _check(len(set(seqs)) == len(seqs), "a sequence appears twice in one append")
        n, T = len(seqs), k.shape[1] if k.dim() == 4 else -1
        for name, x in (("k", k), ("v", v)):
            _check(isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16
                   and tuple(x.shape) == (n, T, self.H, self.D), f"{name} must be bf16 [{n}, T, {self.H}, {self.D}]")
        if T == 0 or n == 0:
            return
        L0 = self.length[layer, seqs]
        _check(bool((L0 + T <= self.max_pages * PAGE).all()), f"a sequence would exceed {self.max_pages * PAGE} tokens")
        k, v = k.to(self.device), v.to(self.device)
        rows = _to_device(seqs, self.device)
        # Pages completed by this append: per sequence, ring positions of its open page + new tokens.
        r = L0 % PAGE
        nfull = (r + T) // PAGE
        if nfull.any():
            if T == 1:  # a decode step: the completing sequences' rings hold 15 tokens of the page
                c = np.flatnonzero(nfull)
                ct = _to_device(c, self.device)
                pk = self.ring[layer, 0, rows[ct]].clone()
                pv = self.ring[layer, 1, rows[ct]].clone()
                pk[:, PAGE - 1], pv[:, PAGE - 1] = k[ct, 0], v[ct, 0]
                where = [(seqs[i], int(L0[i]) // PAGE) for i in c]
            else:
                pages_k, pages_v, where = [], [], []
                for i, s in enumerate(seqs):
                    if nfull[i]:
                        n_ = int(nfull[i]) * PAGE
                        pages_k.append(torch.cat([self.ring[layer, 0, s, : r[i]], k[i]], 0)[:n_])
                        pages_v.append(torch.cat([self.ring[layer, 1, s, : r[i]], v[i]], 0)[:n_])
                        where.extend((s, int(L0[i]) // PAGE + j) for j in range(int(nfull[i])))
                pk = torch.cat(pages_k).view(-1, PAGE, self.H, self.D)
                pv = torch.cat(pages_v).view(-1, PAGE, self.H, self.D)
            self._store_pages(layer, where, pk, pv)
        # ring: positions max(L0, L0 + T - 16) .. L0 + T - 1 at slot p % 16, all sequences at once
        keep = min(T, PAGE)
        slots = (_to_device(L0, self.device)[:, None] + (T - keep)
                 + torch.arange(keep, device=self.device)[None, :]) % PAGE
        self.ring[layer, 0][rows[:, None], slots] = k[:, T - keep:]
        self.ring[layer, 1][rows[:, None], slots] = v[:, T - keep:]
        self.length[layer, seqs] = L0 + T

    def _store_pages(self, layer: int, where, kp: torch.Tensor, vp: torch.Tensor) -> None:
        """Code and store pages (all or nothing: on a full heap, what this call allocated is freed and
        LimitExceededError raised, the cache as before)."""
        new_blocks = []
        for s, j in where:
            if self._bt[s, j] < 0:
                if not self._free_blocks:
                    self._free_blocks.extend(self._bt[s_, j_] for s_, j_ in new_blocks)
                    for s_, j_ in new_blocks:
                        self._bt[s_, j_] = -1
                    raise LimitExceededError("KV Exact cache: no free block ids")
                self._bt[s, j] = self._free_blocks.pop()
                new_blocks.append((s, j))
        blocks_np = np.asarray([self._bt[s, j] for s, j in where], dtype=np.int64)
        _check(bool((self.sizes[layer, :, blocks_np] == 0).all()), "a page of this layer is already stored")
        blocks_t = _to_device(blocks_np, self.device)
        encoded, placed, new_bases = [], [], {}  # encoded: (writer of the pages at given offsets, lengths)
        kernel = _write_kernels(self.device, self.H, self.D, self.page_format) if self.write_kernels else None
        buf = self.heap.buf
        try:
            for kind, pages in ((0, kp), (1, vp)):
                if self._exact4:  # (kernels: plain rows per (page, head) now, every byte once placed)
                    if kernel:
                        entries, lengths = kernel.page_entries(pages)
                        encoded.append((partial(kernel.write_pages, pages, entries, buf=buf), lengths))
                    else:
                        enc = ref4.encode_pages(pages)
                        encoded.append((partial(enc.write, buf), enc.lengths))
                    continue
                bases = self.bases[layer, kind]
                if not self._calibrated[layer, kind]:  # the first pages of this layer and kind choose
                    bases = new_bases[kind] = ref.calibrate_bases(pages.reshape(-1, self.H * self.D)).view(self.H, self.D)
                if kernel:  # the write kernels: escapes per (page, head) now, every byte once placed
                    counts, lengths = kernel.page_counts(pages, bases)
                    encoded.append((partial(kernel.write_pages, pages, bases, counts, buf=buf), lengths))
                else:
                    enc = ref.encode_pages(pages, bases)
                    encoded.append((partial(enc.write, buf), enc.lengths))
            sizes_kv = torch.stack([e[-1] for e in encoded]).cpu().numpy()  # one sync for K and V
            for sizes in sizes_kv:
                placed.append((self.heap.alloc(sizes), sizes))
        except BaseException:  # a full heap, or anything else: nothing of this call stays
            for offs, sizes in placed:
                self.heap.free(offs, sizes)
            for s, j in new_blocks:
                self._free_blocks.append(int(self._bt[s, j]))
                self._bt[s, j] = -1
            raise
        for kind, bases in new_bases.items():
            self.bases[layer, kind] = bases
            self._calibrated[layer, kind] = True
        seq_idx = _to_device([s for s, _ in where], self.device)
        page_idx = _to_device([j for _, j in where], self.device)
        self.block_table[seq_idx, page_idx] = blocks_t.to(torch.int32)
        for kind, ((write, _), (offs, sizes)) in enumerate(zip(encoded, placed)):
            offs_t = _to_device(offs, self.device)
            write(offs_t)
            self.offsets[layer, kind, blocks_t] = offs_t
            self.sizes[layer, kind, blocks_np] = sizes

    # -- attention -------------------------------------------------------------------------------------
    def plan(self, seqs, new_tokens: int = 0) -> dict:
        """Plan one decode step for ``seqs``: attention will see each sequence's current length plus
        ``new_tokens`` (the tokens each layer appends before it attends)."""
        seqs = [int(s) for s in seqs]
        _check(len(seqs) > 0, "plan needs at least one sequence")
        for s in seqs:
            self._check_seq(s)
        lens = self.length[0, seqs] + int(new_tokens)
        _check(bool((lens >= 1).all()), "every sequence needs at least one token")
        _check(bool((lens <= self.max_pages * PAGE).all()), f"a sequence would exceed {self.max_pages * PAGE} tokens")
        # Block ids for the pages this step's appends complete, now: the kernel reads the block
        # table as planned, and pages below length - 16 are read from their blocks.
        rows_np, cols_np = [], []
        for s, n in zip(seqs, lens.tolist()):
            for j in np.flatnonzero(self._bt[s, : n // PAGE] < 0).tolist():
                if not self._free_blocks:
                    raise LimitExceededError("KV Exact cache: no free block ids")
                self._bt[s, j] = self._free_blocks.pop()
                rows_np.append(s)
                cols_np.append(j)
        if rows_np:
            self.block_table[_to_device(rows_np, self.device), _to_device(cols_np, self.device)] = \
                _to_device(self._bt[rows_np, cols_np], self.device, torch.int32)
        rows = _to_device(seqs, self.device)
        self._planned = (np.asarray(seqs), lens)
        self._rows = rows  # attend() reads every layer's ring at these rows
        self._bt_rows = self.block_table[rows].contiguous()
        return self.attn.plan(lens, self._bt_rows)

    def attend(self, layer: int, q: torch.Tensor, out: torch.Tensor | None = None, *,
               reference: bool = False) -> torch.Tensor:
        """Decode attention of ``q`` [len(seqs), num_q_heads, head_dim] over layer ``layer`` of the
        planned sequences (their length must be the planned one). ``reference``: the same kernel
        (config, plan) over the pages decoded to a bf16 pool first, for checking that compression
        changes nothing (slow: it decodes every page the plan reads)."""
        self._check_layer(layer)
        _check(self._planned is not None, "call plan() before attend()")
        seqs, lens = self._planned
        _check(bool((self.length[layer, seqs] == lens).all()),
               f"layer {layer}: the sequences' lengths differ from the planned ones (append first)")
        ring = self.ring[layer][:, self._rows]
        if reference:
            from weightszip.kernels import PagedDecodeAttention
            from weightszip.kernels.paged_decode import dequantize_exact4_pages, dequantize_exact_pages

            used = np.unique(self._bt[seqs][self._bt[seqs] >= 0])
            pools = []
            for kind in range(2):
                pool = torch.zeros((self.num_blocks, self.H, PAGE, self.D), dtype=torch.bfloat16, device=self.device)
                if used.size:
                    ut = torch.as_tensor(used, device=self.device)
                    offs = self.offsets[layer, kind, ut].contiguous()
                    if self._exact4:
                        bits = dequantize_exact4_pages(self.heap.buf, offs, self.H, self.D)
                    else:
                        bits = dequantize_exact_pages(self.heap.buf, offs, self.bases[layer, kind], self.H, self.D)
                    pool[ut] = bits.view(torch.bfloat16).transpose(1, 2)
                pools.append(pool)
            att = PagedDecodeAttention(self.hq, self.H, self.D, page_type="bf16", block_size=PAGE, window=PAGE,
                                       sm_scale=self.attn.sm_scale, config=self.attn.config, device=self.device)
            att.plan(lens, self._bt_rows)
            return att.run(q, pools[0], pools[1], k_side=ring[0], v_side=ring[1], out=out)
        bases = {} if self._exact4 else {"k_bases": self.bases[layer, 0], "v_bases": self.bases[layer, 1]}
        return self.attn.run(q, self.heap.buf, self.heap.buf, k_side=ring[0], v_side=ring[1],
                             k_offsets=self.offsets[layer, 0], v_offsets=self.offsets[layer, 1], out=out, **bases)

    # -- offload ---------------------------------------------------------------------------------------
    def offload_sequence(self, seq: int, *, free: bool = True, chunk_bytes: int = 64 << 20,
                         host=None, digest: bool = False) -> OffloadedSequence:
        """Copy a sequence's pages (their compressed bytes: no decoding) and ring to host memory,
        in chunks of about ``chunk_bytes``; ``free``: then free it in the cache. ``host``: a
        ``weightszip.offload.HostArena`` (pinned) to take the bytes from, so that nothing is
        allocated per call (LimitExceededError when it has too little room left, the cache as before);
        else a pinned allocation (when the cache is on a GPU) per call. On a GPU the chunks are
        gathered into two staging buffers and copied on a side stream, and with ``free`` the free's
        bookkeeping is prepared while they move. ``digest``: also the XXH3-64 of the bytes on the host
        (about 15 GB/s on one core, so several times the copy's time over PCIe), which
        ``restore_sequence(verify=True)`` checks: without it, damage to a page's raw bytes is not
        detectable (the page formats have no checksum)."""
        self._check_seq(seq)
        pages = int(self.length[:, seq].max()) // PAGE
        blocks = self._bt[seq, :pages]
        _check(bool((blocks >= 0).all()), "a page of the sequence has no block")
        sizes = self.sizes[:, :, blocks].copy()  # [L, 2, pages]
        pin = self.device.type == "cuda"
        arena_used = None if host is None else host.used
        if host is not None:
            data = host.take(int(sizes.sum()))
            if data is None:
                raise LimitExceededError(f"host arena: no room for {int(sizes.sum())} bytes")
            pin = pin and data.is_pinned()
        else:
            data = torch.empty(int(sizes.sum()), dtype=torch.uint8, pin_memory=pin)
        try:
            bt = torch.as_tensor(blocks, device=self.device)
            offs = self.offsets[:, :, bt].reshape(-1)  # (layer, kind, page) order, as sizes
            sz = torch.as_tensor(sizes.reshape(-1), device=self.device)
            chunks = list(_chunks(sizes.reshape(-1), chunk_bytes))
            local = _chunk_local_offsets(sz, chunks)
            # the offsets on the host for the free, read back ahead of the gathers
            offs_host = torch.empty(offs.shape, dtype=torch.int64, pin_memory=pin)
            offs_host.copy_(offs, non_blocking=pin)
            got = torch.cuda.Event() if pin else None
            if got is not None:
                got.record(torch.cuda.current_stream(self.device))
            if self.device.type == "cpu":  # the pages straight into their place
                for i, j, pos, acc in chunks:
                    _copy_regions(self.heap.buf, offs[i:j], data[pos:pos + acc], local[i:j], sz[i:j])
            else:  # gathered into a staging buffer (one kernel), copied over the bus on a copy stream
                def gather(c, buf):
                    i, j, _, acc = c
                    _copy_regions(self.heap.buf, offs[i:j], buf[:acc], local[i:j], sz[i:j])

                def copy(c, buf):
                    data[c[2]:c[2] + c[3]].copy_(buf[:c[3]], non_blocking=pin)

                _pipelined(self.device, chunks, gather, copy)
            if free:  # the free's bookkeeping while the copies run; it takes effect after them
                if got is not None:
                    got.synchronize()
                plan = self._free_plan(seq, offs_host.numpy().reshape(sizes.shape))
            ring = self.ring[:, :, seq].to("cpu", copy=True)  # a copy even when the cache is on the CPU
            if pin:
                torch.cuda.current_stream(self.device).synchronize()
        except BaseException:  # the arena's space goes back (nothing else took from it meanwhile)
            if host is not None:
                if pin:  # once no copy queued before the failure still writes into it
                    torch.cuda.current_stream(self.device).synchronize()
                host.used = arena_used
            raise
        out = OffloadedSequence(data, sizes, ring, self.length[:, seq].copy(), self.bases.cpu().clone(),
                                self.page_format, _sequence_digest(data, ring) if digest else None)
        if free:
            self._free(plan)
        return out

    def restore_sequence(self, off: OffloadedSequence, *, chunk_bytes: int = 64 << 20, verify: bool = False) -> int:
        """A new sequence holding an offloaded one (pages copied back as they are, into new heap
        regions). Layers and kinds where both hold pages need the same window tops
        (InvalidArgumentError otherwise); where the cache has none yet, it adopts the sequence's. On
        a full heap or no free slot or block ids, LimitExceededError and the cache as before.

        Checked always: shapes, sizes against lengths and data, and every page's header (its
        exception offsets inside the page), so attention never reads outside the heap. ``verify``:
        the sequence's digest where it has one (``offload_sequence(digest=True)``;
        ChecksumMismatchError on any changed byte), and every page through the validating decoder
        (CorruptDataError / TruncatedError where a page breaks the format's rules). Without a digest,
        damage to a page's raw sign and mantissa bytes breaks no rule and is not detected. A failed
        check leaves the cache as before.

        On a GPU from host memory: into a heap with no free region listed, one copy straight to the
        top of the heap, with the allocation and checks done while it moves; otherwise chunks of
        about ``chunk_bytes`` through two staging buffers (copies on a side stream, scattered into
        their regions by a kernel)."""
        _check(getattr(off, "page_format", "exact") == self.page_format,
               f"the sequence holds {getattr(off, 'page_format', None)!r} pages, this cache {self.page_format!r} pages")
        sizes = np.asarray(off.sizes)
        _check(sizes.ndim == 3 and sizes.shape[:2] == (self.L, 2) and sizes.dtype.kind in "iu",
               f"sizes must be integers [{self.L}, 2, pages]")
        L, _, pages = sizes.shape
        _check(pages <= self.max_pages and isinstance(off.ring, torch.Tensor) and off.ring.dtype == torch.bfloat16
               and tuple(off.ring.shape) == (self.L, 2, PAGE, self.H, self.D),
               "the offloaded sequence does not fit this cache's shape")
        _check(isinstance(off.bases, torch.Tensor) and off.bases.dtype == torch.uint8
               and tuple(off.bases.shape) == (self.L, 2, self.H, self.D), f"bases must be uint8 [{self.L}, 2, {self.H}, {self.D}]")
        lengths = np.asarray(off.lengths)
        _check(lengths.shape == (L,) and lengths.dtype.kind in "iu" and bool((lengths >= 0).all())
               and bool((lengths // PAGE <= pages).all()) and int(lengths.max(initial=0)) // PAGE == pages,
               f"lengths must be [{L}] tokens per layer, with pages for every whole 16 of them")
        # a page where a layer's length says one is, nothing elsewhere, and every size one a page can
        # have: checked before anything is summed, allocated or copied (sizes near 2**63 would wrap
        # the sum below back to the data's length)
        need = np.arange(pages)[None, None, :] < (lengths // PAGE)[:, None, None]
        if self._exact4:
            lo, hi = ref4.page_length(self.H, self.D, 0), ref4.page_length(self.H, self.D, PAGE * self.H)
        else:
            lo, hi = ref.page_length(self.H, self.D, 0), ref.page_length(self.H, self.D, PAGE * self.H * self.D)
        inside = np.where(need, sizes, lo)
        _check(not np.where(need, 0, sizes).any() and int(inside.min(initial=lo)) >= lo
               and int(inside.max(initial=lo)) <= hi,
               "page sizes do not match the sequence's lengths or are not page sizes")
        _check(isinstance(off.data, torch.Tensor) and off.data.dtype == torch.uint8 and off.data.dim() == 1
               and off.data.numel() == int(sizes.sum()),
               f"data must be uint8 [{int(sizes.sum())}] (the pages' bytes), not {getattr(off.data, 'shape', None)}")
        if verify and getattr(off, "digest", None) is not None:
            if off.data.device.type != "cpu" or off.ring.device.type != "cpu":
                raise InvalidArgumentError("a digest is checked on host memory: data and ring must be CPU tensors")
            if _sequence_digest(off.data, off.ring) != off.digest:
                raise ChecksumMismatchError("the offloaded sequence's bytes do not match its digest")
        has = sizes.any(axis=2)  # (layer, kind) with pages
        mine = self.bases.cpu()
        for layer, kind in zip(*np.nonzero(has & self._calibrated & (not self._exact4))):
            _check(torch.equal(off.bases[layer, kind], mine[layer, kind]),
                   f"layer {layer} {'KV'[kind]}: the sequence was coded with other window tops")
        if len(self._free_blocks) < pages:
            raise LimitExceededError("KV Exact cache: no free block ids")
        if not self._free_slots:
            raise LimitExceededError(f"KV Exact cache holds at most {self.max_seqs} sequences")
        # Straight into place: with no free region listed, the allocation below puts the pages back
        # to back at the top of the heap in the data's order, so one copy of the data to the top
        # (free space: harmless if anything below fails) starts now on a side stream, and the host
        # work below runs while it moves (no host-to-device copy of ours waits behind it: the sizes
        # go over first, the offsets are computed on the GPU). The current stream waits for it before
        # anything reads the pages (also on failure), so nothing later reads or writes there before
        # it lands.
        flat = sizes.reshape(-1).astype(np.int64)
        nz = np.flatnonzero(flat)
        sz = torch.as_tensor(flat, device=self.device)
        total = off.data.numel()
        direct = (self.device.type == "cuda" and off.data.device.type == "cpu" and not self.heap._start
                  and self.heap.top + total <= self.heap.capacity)
        top = self.heap.top
        if direct:
            from weightszip.offload import _Streams

            st = _Streams(self.device, "kv-exact-restore")
            with st.on("copy"):
                self.heap.buf[top:top + total].copy_(off.data, non_blocking=True)
        try:
            offs = np.zeros(flat.size, dtype=np.int64)
            offs[nz] = self.heap.alloc(flat[nz])  # all or nothing
        finally:
            if direct:
                st.join()
        try:
            # where the pages landed is where they were allocated (else they are copied again)
            direct = direct and bool(np.array_equal(offs[nz], top + np.cumsum(flat[nz]) - flat[nz]))
            if direct:
                offs_t = torch.where(sz > 0, top + torch.cumsum(sz, 0) - sz, 0)
            else:
                offs_t = torch.as_tensor(offs, device=self.device)
                chunks = list(_chunks(flat, chunk_bytes))
                local = _chunk_local_offsets(sz, chunks)
                if self.device.type == "cpu" or off.data.device == self.device:
                    for i, j, pos, acc in chunks:
                        chunk = off.data[pos:pos + acc].to(self.device)
                        _copy_regions(chunk, local[i:j], self.heap.buf, offs_t[i:j], sz[i:j])
                else:  # over the bus into a staging buffer on a copy stream, scattered from there
                    def copy(c, buf):
                        buf[:c[3]].copy_(off.data[c[2]:c[2] + c[3]], non_blocking=True)

                    def scatter(c, buf):
                        i, j, _, acc = c
                        _copy_regions(buf[:acc], local[i:j], self.heap.buf, offs_t[i:j], sz[i:j])

                    _pipelined(self.device, chunks, copy, scatter, copy_first=True)
            # while the pages move: every page's header
            self._check_restored(offs_t.view(L, 2, pages), sz.view(L, 2, pages), has, off.bases, verify)
        except BaseException:  # damaged pages or sizes, or a failed copy: the regions go back (what
            # the copies still write lands in them before any later kernel on this stream reads them)
            self.heap.free(offs[nz], flat[nz])
            raise
        seq = self.add_sequence()
        for layer, kind in zip(*np.nonzero(has & ~self._calibrated)):  # the cache adopts them
            self.bases[layer, kind] = off.bases[layer, kind].to(self.device)
            self._calibrated[layer, kind] = True
        blocks = np.asarray([self._free_blocks.pop() for _ in range(pages)], dtype=np.int64)
        self._bt[seq, :pages] = blocks
        bt = torch.as_tensor(blocks, device=self.device)
        self.block_table[seq, :pages] = bt.to(torch.int32)
        self.offsets[:, :, bt] = offs_t.view(L, 2, pages)
        self.sizes[:, :, blocks] = sizes
        self.ring[:, :, seq] = off.ring.to(self.device)
        self.length[:, seq] = off.lengths
        return seq

    def _check_restored(self, offs: torch.Tensor, sizes: torch.Tensor, has: np.ndarray, bases: torch.Tensor,
                        verify: bool) -> None:
        """Restored pages (in the heap at ``offs`` [L, 2, pages], ``sizes`` the same shape, 0 for no
        page): each header's exception offsets start after the fixed part, never decrease and end in
        the page (KV Exact4: each head's count of earlier plain rows agrees with the masks, and the
        length they give is the page's size), one device sync; with ``verify``, the validating
        decoder over every page."""
        h = self.H
        present = sizes > 0
        po, pz = offs[present], sizes[present]
        if po.numel():
            if self._exact4:
                ok = ref4.heap_page_lengths(self.heap.buf, po, h, self.D) == pz
            else:
                ex = ref._u32(self.heap.buf[po[:, None] + torch.arange(4 * (h + 1), device=po.device)[None, :]])
                ok = ((ex[:, 0] == ref.fixed_bytes(h, self.D)) & (ex[:, 1:] >= ex[:, :-1]).all(1)
                      & ((ex[:, h] + ref.ALIGN - 1) // ref.ALIGN * ref.ALIGN == pz))
            if not bool(ok.all()):
                bad = int(torch.nonzero(~ok)[0, 0])
                layer, kind, page = (int(x) for x in torch.nonzero(present)[bad])
                raise CorruptDataError(f"restored page {page} of layer {layer} {'KV'[kind]}: its header does not "
                                       f"describe a page of {int(pz[bad])} bytes")
        if verify:
            for layer, kind in zip(*np.nonzero(has)):
                self._decode_heap_pages(offs[layer, kind][present[layer, kind]], bases[layer, kind])

    def _decode_heap_pages(self, offsets: torch.Tensor, bases: torch.Tensor) -> torch.Tensor:
        """The pages of the heap at ``offsets`` through the validating reference decoder of the
        cache's format (``bases``: the window tops they were coded with; KV Exact pages only)."""
        if self._exact4:
            return ref4.decode_heap_pages(self.heap.buf, offsets, self.H, self.D)
        return ref.decode_heap_pages(self.heap.buf, offsets, bases.to(self.device), self.H, self.D)

    # -- inspection ------------------------------------------------------------------------------------
    def dense(self, layer: int, seq: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A sequence's K and V of one layer as bf16 [length, H, D], decoded by the reference decoder
        (validating every page) and the ring."""
        self._check_layer(layer)
        self._check_seq(seq)
        n = int(self.length[layer, seq])
        full = n // PAGE
        out = []
        for kind in range(2):
            blocks = torch.as_tensor(self._bt[seq, :full], device=self.device)
            bits = self._decode_heap_pages(self.offsets[layer, kind, blocks], self.bases[layer, kind])
            paged = bits.view(torch.bfloat16).reshape(full * PAGE, self.H, self.D)
            tail = self.ring[layer, kind, seq, : n - full * PAGE]
            out.append(torch.cat([paged, tail], 0))
        return out[0], out[1]

    def stats(self) -> dict:
        """Bytes held: pages (heap bytes in use), per-page side data (an int64 offset per page and
        kind), and the bf16 rings; against bf16 pages of the same tokens."""
        pages = int((self.sizes > 0).sum())
        page_bytes = int(self.sizes.sum())
        side = pages * 8
        tokens = int(self.length[0, list(self._live)].sum()) if self._live else 0  # per layer
        paged_tokens = pages // 2 * PAGE
        bf16 = paged_tokens * self.H * self.D * 2 * 2
        return {"pages": pages, "page_bytes": page_bytes, "offset_bytes": side,
                "ring_bytes": self.ring.numel() * 2, "tokens": tokens, "paged_tokens": paged_tokens,
                "ratio_vs_bf16": (page_bytes + side) / bf16 if bf16 else None, "heap": self.heap.stats()}


# ------------------------------------------------------------------- generation through the cache

_ATTN_NAME = "weightszip_kv_exact"
_STATE: dict = {}


def _kv_exact_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """``AttentionInterface`` function: the prompt attends with torch SDPA (causal) and fills the cache;
    a single new token is appended and attends through the cache's kernel."""
    cache: KVExactCache = _STATE["cache"]
    seq = _STATE["seq"]
    layer = module.layer_idx
    b, hq, t, d = query.shape
    _check(b == 1, "generation through the KV Exact cache runs one sequence")
    k = key.transpose(1, 2).to(torch.bfloat16).contiguous()  # [1, t, H, d]
    v = value.transpose(1, 2).to(torch.bfloat16).contiguous()
    if scaling is None:
        scaling = getattr(module, "scaling", None) or d**-0.5
    _check(abs(scaling - cache.attn.sm_scale) <= 1e-6 * cache.attn.sm_scale,
           f"the model's attention scale {scaling} is not the cache's {cache.attn.sm_scale}")
    if int(cache.length[layer, seq]) == 0:  # the prompt (any length), causal, then into the cache
        out = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                               enable_gqa=True)
        cache.append(layer, [seq], k, v)
        return out.transpose(1, 2).contiguous(), None
    _check(t == 1, "after the prompt, one token per forward")
    cache.append(layer, [seq], k, v)
    o = cache.attend(layer, query[:, :, 0, :].to(torch.bfloat16).contiguous(), reference=_STATE["reference"])
    return o.view(1, 1, hq, d).to(query.dtype), None


@contextlib.contextmanager
def kv_exact_attention(model, cache: KVExactCache, seq: int, *, reference: bool = False):
    """Within the block, ``model``'s attention layers (transformers) read and write ``cache``
    (sequence ``seq``); ``reference``: through the same kernel over bf16 pages decoded from it."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    from transformers.modeling_utils import AttentionInterface

    base = model.config._attn_implementation
    AttentionInterface.register(_ATTN_NAME, _kv_exact_attention)
    AttentionMaskInterface.register(_ATTN_NAME, ALL_MASK_ATTENTION_FUNCTIONS[base if base in ALL_MASK_ATTENTION_FUNCTIONS else "sdpa"])
    _STATE.update(cache=cache, seq=seq, reference=reference)
    model.set_attn_implementation(_ATTN_NAME)
    try:
        yield cache
    finally:
        _STATE.clear()
        model.set_attn_implementation(base)


def generate(model, input_ids: torch.Tensor, max_new_tokens: int, *, reference: bool = False, config=None,
             heap_bytes: int | None = None, page_format: str = "exact") -> tuple[list[int], list[torch.Tensor], dict]:
    """Greedy decoding of ``max_new_tokens`` after ``input_ids`` [1, n] with the model's attention
    reading a ``KVExactCache`` of ``page_format`` pages (KV Exact: window tops from the prompt's own
    pages). Returns (tokens, the last position's fp32 logits per step, the cache's stats).
    ``reference``: the same, with every decode step's attention run by the same kernel over the
    pages decoded to bf16."""
    from weightszip.models import attention_shape, greedy_decode

    a = attention_shape(model)
    dev = model.device
    total = input_ids.shape[1] + max_new_tokens
    per_token = a.layers * 2 * a.num_kv_heads * a.head_dim * 2
    cache = KVExactCache(layers=a.layers, kv_heads=a.num_kv_heads, head_dim=a.head_dim, num_q_heads=a.num_q_heads,
                         heap_bytes=heap_bytes or per_token * (total + PAGE) + (1 << 16), max_seqs=1, max_tokens=total,
                         device=dev, sm_scale=a.scale, config=config, page_format=page_format)
    seq = cache.add_sequence()
    with torch.inference_mode(), kv_exact_attention(model, cache, seq, reference=reference):
        toks, logits = greedy_decode(model, input_ids, max_new_tokens, before_step=lambda: cache.plan([seq], new_tokens=1))
    return toks, logits, cache.stats()
