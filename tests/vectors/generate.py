#!/usr/bin/env python3
"""Golden vectors for the weightszip container format, version 1 (docs/FORMAT.md).

    python tests/vectors/generate.py            # write missing files; refuse to change any file
    python tests/vectors/generate.py --check    # only compare; exit 1 on any difference
    python tests/vectors/generate.py --force    # overwrite differing files (unreleased format only)

Writes
  valid/NAME.wz      containers made by the reference encoder (the installed `weightszip`), each
                     with its expected output: NAME.npy (one tensor), NAME.npz (named tensors) or
                     NAME.out (the original bytes of a file-kind container);
  invalid/NAME.wz    containers crafted from a valid vector so that exactly one rule of
                     FORMAT.md is broken (checksums recomputed wherever they would otherwise fire
                     first), and invalid/EXPECTED.json: file name -> Python exception class;
  MANIFEST.json      what each vector exercises, its expected dtype, and which valid vector and
                     rule each invalid vector comes from.

.npy cannot name bfloat16 or float8 dtypes: for those the expected array holds the bit patterns
(uint16 / uint8, same bytes) and MANIFEST.json names the container dtype.

Everything is deterministic: the data come from an integer PRNG (no transcendental functions, no
numpy RNG streams), .npy / .npz files are written byte by byte here, and the encoder is
deterministic. Before writing, every vector is checked twice: by the real decoder (valid ones
decode to their expected output, invalid ones raise exactly their expected exception) and by the
small reference reader below, written from FORMAT.md alone (it must agree with both).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import struct
import sys
import tempfile
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np

import weightszip
from weightszip import _core, errors

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
KV_PATH = REPO / "tests" / "data" / "kv_smollm2_64tok.npy"
KV_SHA256 = "2b63216025521fce805d2c69dc6649862fef8bb73fa4daa6f181c80a334ab6f0"  # of the array bytes

# ---------------------------------------------------------------------------------------------
# Format constants (FORMAT.md)

MAGIC = bytes([0x89, 0x57, 0x5A, 0x50, 0x0D, 0x0A, 0x1A, 0x0A])
END_MAGIC = b"WZPINDEX"
VERSION = 1
DTYPES = [  # code -> (name, size)
    ("uint8", 1), ("bfloat16", 2), ("float16", 2), ("float32", 4), ("float8_e4m3fn", 1),
    ("float8_e5m2", 1), ("float64", 8), ("int8", 1), ("int16", 2), ("int32", 4), ("int64", 8),
    ("uint16", 2), ("uint32", 4), ("uint64", 8), ("bool", 1),
]
DTYPE_CODE = {name: code for code, (name, _) in enumerate(DTYPES)}
MAX_INDEX_LEN = 256 << 20
MAX_ENTRIES = 1 << 20
MAX_NAME_LEN = 4096
MAX_NDIM = 16
MAX_TENSOR_BYTES = 1 << 50
MAX_DIM = 1 << 50
MAX_CHUNK_RAW = 64 << 20
MAX_EXPANSION = 32768
PROB_BITS, M, RANS_L = 12, 4096, 1 << 16

# numpy dtype of the decoded array, and the dtype its expected .npy is stored as.
NP_DTYPE = {
    "uint8": np.uint8, "bfloat16": ml_dtypes.bfloat16, "float16": np.float16,
    "float32": np.float32, "float8_e4m3fn": ml_dtypes.float8_e4m3fn,
    "float8_e5m2": ml_dtypes.float8_e5m2, "float64": np.float64, "int8": np.int8,
    "int16": np.int16, "int32": np.int32, "int64": np.int64, "uint16": np.uint16,
    "uint32": np.uint32, "uint64": np.uint64, "bool": np.bool_,
}
BITS_DTYPE = {"bfloat16": np.uint16, "float8_e4m3fn": np.uint8, "float8_e5m2": np.uint8}

# Error kinds of FORMAT.md ("corrupt" and the bracketed ones) -> Python exception class.
KIND_TO_CLASS = {
    "corrupt": "CorruptDataError",
    "truncated": "TruncatedError",
    "checksum": "ChecksumMismatchError",
    "limit": "LimitExceededError",
    "magic": "BadMagicError",
    "version": "UnsupportedVersionError",
    "unsupported": "UnsupportedFeatureError",
}


def xxh3(b: bytes) -> int:
    a = np.frombuffer(bytes(b) or b"\0", dtype=np.uint8)
    return _core.xxh3_64(a.ctypes.data, len(b))


# ---------------------------------------------------------------------------------------------
# Deterministic data: splitmix64 in numpy uint64 arithmetic (wraps, bit-exact everywhere).

def _splitmix(seed: int, n: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        x = (np.arange(1, n + 1, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)) + np.uint64(seed)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


def rand_bytes(seed: int, n: int) -> np.ndarray:
    return (_splitmix(seed, n) >> np.uint64(56)).astype(np.uint8)


def rand_normal(seed: int, shape, scale: float = 1.0) -> np.ndarray:
    """Approximately normal float64 values: a sum of four uniforms (Irwin-Hall), centred and
    scaled. Only integer arithmetic and exactly rounded float operations: identical everywhere."""
    n = int(np.prod(shape, dtype=np.int64))
    u = (_splitmix(seed, 4 * n) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    s = u.reshape(4, n).sum(axis=0) - 2.0
    return (s * (scale * 1.7320508075688772)).reshape(shape)


# ---------------------------------------------------------------------------------------------
# Deterministic .npy / .npz writers (numpy's own embed nothing variable, but spell them out).

def npy_bytes(a: np.ndarray) -> bytes:
    a = np.asarray(a)
    if not a.flags.c_contiguous:
        a = a.copy(order="C")  # (np.ascontiguousarray would make a 0-d array 1-d)
    assert a.dtype.byteorder in "<|=" and a.dtype.kind in "biuf", a.dtype
    shape = f"({a.shape[0]},)" if a.ndim == 1 else "(" + ", ".join(str(d) for d in a.shape) + ")"
    header = "{'descr': '%s', 'fortran_order': False, 'shape': %s, }" % (a.dtype.str, shape)
    total = 10 + len(header) + 1
    header += " " * (-total % 64) + "\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(header)) + header.encode("latin1") + a.tobytes()


def npz_bytes(arrays: list[tuple[str, np.ndarray]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as z:
        for name, a in arrays:
            info = zipfile.ZipInfo(name + ".npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.create_system = 3
            info.external_attr = 0o644 << 16
            info.compress_type = zipfile.ZIP_STORED
            z.writestr(info, npy_bytes(a))
    return buf.getvalue()


def as_bits(a: np.ndarray, dtype: str) -> np.ndarray:
    """The array to store in an expected .npy: itself, or its bit patterns (see module doc)."""
    return a.view(BITS_DTYPE[dtype]) if dtype in BITS_DTYPE else a


# ---------------------------------------------------------------------------------------------
# Container model: parse a valid container, change fields, serialize with checksums recomputed
# (an explicit override keeps a stale or wrong value where a vector needs one).

@dataclass
class Chunk:
    payload: bytes
    raw_xxh3: int
    gap_before: bytes = b""  # bytes inserted before this payload (not covered by any chunk)
    offset: int | None = None  # None: the real position
    stored_len: int | None = None  # None: len(payload)
    stored_xxh3: int | None = None  # None: XXH3-64 of the payload


@dataclass
class Entry:
    name: bytes
    dtype: int
    layout: int
    profile: int
    flags: int
    ndim: int
    channel_axis: int
    shape: list[int]
    chunk_elems: int
    chunks: list[Chunk]
    n_chunks: int | None = None  # None: len(chunks)


@dataclass
class Container:
    entries: list[Entry]
    kind: int = 0
    magic: bytes = MAGIC
    version: int = VERSION
    preamble_reserved: bytes = bytes(6)
    index_reserved: bytes = bytes(3)
    index_extra: bytes = b""  # appended to the index
    index_cut: int = 0  # bytes removed from the end of the index
    index_len: int | None = None
    index_checksum: int | None = None
    end_magic: bytes = END_MAGIC


class _R:
    def __init__(self, b: bytes, pos: int = 0):
        self.b, self.pos = b, pos

    def take(self, n: int) -> bytes:
        assert self.pos + n <= len(self.b)
        s = self.b[self.pos:self.pos + n]
        self.pos += n
        return s

    def u(self, fmt: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt)))[0]


def parse(buf: bytes) -> Container:
    """Parse a container known to be valid (one that we just made)."""
    assert buf[:8] == MAGIC and buf[-8:] == END_MAGIC
    index_len, checksum = struct.unpack("<QQ", buf[-24:-8])
    io_ = len(buf) - 24 - index_len
    assert checksum == xxh3(buf[:16] + buf[io_:io_ + index_len])
    r = _R(buf[io_:io_ + index_len])
    kind = r.u("B")
    r.take(3)
    entries = []
    for _ in range(r.u("I")):
        name = r.take(r.u("H"))
        dtype, layout, profile, flags, ndim, axis = r.take(6)
        shape = [r.u("Q") for _ in range(ndim)]
        chunk_elems, n_chunks = r.u("Q"), r.u("I")
        chunks = []
        for _ in range(n_chunks):
            off, ln, sx, rx = struct.unpack("<QIQQ", r.take(28))
            assert sx == xxh3(buf[off:off + ln])
            chunks.append(Chunk(buf[off:off + ln], rx))
        entries.append(Entry(name, dtype, layout, profile, flags, ndim, axis, shape, chunk_elems, chunks))
    assert r.pos == index_len
    c = Container(entries, kind=kind)
    assert build(c) == buf, "parse/build does not round-trip"
    return c


def build(c: Container) -> bytes:
    pre = c.magic + struct.pack("<H", c.version) + c.preamble_reserved
    out = bytearray(pre)
    idx = bytearray([c.kind]) + c.index_reserved + struct.pack("<I", len(c.entries))
    for e in c.entries:
        idx += struct.pack("<H", len(e.name)) + e.name
        idx += bytes([e.dtype, e.layout, e.profile, e.flags, e.ndim, e.channel_axis])
        idx += b"".join(struct.pack("<Q", d) for d in e.shape)
        idx += struct.pack("<QI", e.chunk_elems, len(e.chunks) if e.n_chunks is None else e.n_chunks)
        for ch in e.chunks:
            out += ch.gap_before
            pos = len(out)
            out += ch.payload
            idx += struct.pack(
                "<QIQQ",
                pos if ch.offset is None else ch.offset,
                len(ch.payload) if ch.stored_len is None else ch.stored_len,
                xxh3(ch.payload) if ch.stored_xxh3 is None else ch.stored_xxh3,
                ch.raw_xxh3,
            )
    idx += c.index_extra
    if c.index_cut:
        idx = idx[:-c.index_cut]
    out += idx
    out += struct.pack(
        "<QQ",
        len(idx) if c.index_len is None else c.index_len,
        xxh3(pre + idx) if c.index_checksum is None else c.index_checksum,
    )
    out += c.end_magic
    return bytes(out)


@dataclass
class Rans:
    """A RANS chunk payload, field by field (FORMAT.md, "RANS (mode 1)")."""

    unit_bits: int
    sym_bits: int
    ctx_shift: int
    lanes_log2: int
    stride: int
    n_groups: int
    groups: bytes  # channel-group map: ctx_stride bytes when n_groups > 1, else empty
    listed: list[tuple[int, int]]  # (context key, context id), keys ascending
    tables: list[list[tuple[int, int]]]
    lanes: list[bytes]
    low: bytes
    n_ctx: int | None = None  # None: len(tables)
    n_listed: int | None = None  # None: len(listed)
    lane_len: list[int] | None = None  # None: the lanes' lengths

    @staticmethod
    def parse(p: bytes) -> Rans:
        r = _R(p)
        assert r.u("B") == 1
        unit_bits, sym_bits, ctx_shift, lanes_log2 = r.take(4)
        stride, n_groups = r.u("I"), r.u("B")
        groups = r.take(stride) if n_groups > 1 else b""
        n_ctx, n_listed = r.u("H"), r.u("H")
        listed = [(r.u("H"), r.u("B")) for _ in range(n_listed)]
        tables = []
        for _ in range(n_ctx):
            nsym = r.u("H")
            tables.append([(r.u("H"), r.u("H")) for _ in range(nsym)])
        lens = [r.u("I") for _ in range(1 << lanes_log2)]
        lanes = [r.take(n) for n in lens]
        low = p[r.pos:]
        x = Rans(unit_bits, sym_bits, ctx_shift, lanes_log2, stride, n_groups, groups, listed, tables,
                 lanes, low)
        assert x.build() == p
        return x

    def build(self) -> bytes:
        out = bytearray([1, self.unit_bits, self.sym_bits, self.ctx_shift, self.lanes_log2])
        out += struct.pack("<IB", self.stride, self.n_groups) + self.groups
        out += struct.pack("<HH", len(self.tables) if self.n_ctx is None else self.n_ctx,
                           len(self.listed) if self.n_listed is None else self.n_listed)
        out += b"".join(struct.pack("<HB", k, c) for k, c in self.listed)
        for t in self.tables:
            out += struct.pack("<H", len(t)) + b"".join(struct.pack("<HH", s, f) for s, f in t)
        lens = [len(b) for b in self.lanes] if self.lane_len is None else self.lane_len
        out += b"".join(struct.pack("<I", n) for n in lens)
        out += b"".join(self.lanes) + self.low
        return bytes(out)


@dataclass
class Rows:
    """A ROWS chunk payload, field by field (FORMAT.md, "ROWS (mode 2)")."""

    row_bytes: int
    n_rows: int
    refs: list[tuple[int, int]]  # (referencing row, source row), rows ascending
    inner: bytes  # a STORED or RANS payload holding the unique rows
    n_refs: int | None = None  # None: len(refs)

    @staticmethod
    def parse(p: bytes) -> Rows:
        r = _R(p)
        assert r.u("B") == 2
        row_bytes, n_rows, n_refs = r.u("I"), r.u("I"), r.u("I")
        refs = [(r.u("I"), r.u("I")) for _ in range(n_refs)]
        x = Rows(row_bytes, n_rows, refs, p[r.pos:])
        assert x.build() == p
        return x

    def build(self) -> bytes:
        n_refs = len(self.refs) if self.n_refs is None else self.n_refs
        out = bytearray([2]) + struct.pack("<III", self.row_bytes, self.n_rows, n_refs)
        out += b"".join(struct.pack("<II", row, src) for row, src in self.refs)
        return bytes(out + self.inner)


def chunk_mode(ch: Chunk) -> int:
    return ch.payload[0]


# ---------------------------------------------------------------------------------------------
# Reference reader, written from FORMAT.md alone: the rule order is the one the document gives.

class Reject(Exception):
    def __init__(self, kind: str, msg: str):
        super().__init__(f"[{kind}] {msg}")
        self.kind = kind


class _Cur:
    """Bounds-checked reads; running out is `short_kind` ([truncated] in the index, corrupt in a
    chunk payload, whose length the index fixes)."""

    def __init__(self, b: bytes, short_kind: str, pos: int = 0):
        self.b, self.pos, self.short_kind = b, pos, short_kind

    def left(self) -> int:
        return len(self.b) - self.pos

    def take(self, n: int, what: str) -> bytes:
        if n > self.left():
            raise Reject(self.short_kind, f"{what}: {n} bytes needed, {self.left()} left")
        s = self.b[self.pos:self.pos + n]
        self.pos += n
        return s

    def u(self, fmt: str, what: str) -> int:
        return struct.unpack("<" + fmt, self.take(struct.calcsize("<" + fmt), what))[0]


def ref_read(buf: bytes) -> tuple[int, list[dict]]:
    """Check and decode a whole container; returns (kind, entries with their raw bytes)."""
    total = len(buf)
    if total < 16:
        k = min(total, 8)
        raise Reject("truncated" if buf[:k] == MAGIC[:k] else "magic", "shorter than the preamble")
    if buf[:8] != MAGIC:
        raise Reject("magic", "magic")
    if struct.unpack("<H", buf[8:10])[0] != VERSION:
        raise Reject("version", "version")
    if buf[10:16] != bytes(6):
        raise Reject("corrupt", "reserved preamble bytes")
    if total < 40:
        raise Reject("truncated", "shorter than preamble and trailer")
    t = buf[-24:]
    if t[16:] != END_MAGIC:
        raise Reject("corrupt", "end magic")
    index_len, checksum = struct.unpack("<QQ", t[:16])
    if index_len > MAX_INDEX_LEN:
        raise Reject("limit", "index length")
    if index_len > total - 40:
        raise Reject("truncated", "index longer than the container")
    I = total - 24 - index_len
    index = buf[I:I + index_len]
    if xxh3(buf[:16] + index) != checksum:
        raise Reject("checksum", "index checksum")

    r = _Cur(index, "truncated")
    kind = r.u("B", "kind")
    if kind > 1:
        raise Reject("unsupported", f"kind {kind}")
    if r.take(3, "reserved") != bytes(3):
        raise Reject("corrupt", "reserved index bytes")
    n_entries = r.u("I", "n_entries")
    if n_entries > MAX_ENTRIES:
        raise Reject("limit", "entries")
    if n_entries * 20 > r.left():
        raise Reject("truncated", "entries cannot fit")
    pos = 16
    entries = []
    for _ in range(n_entries):
        name_len = r.u("H", "name_len")
        if name_len > MAX_NAME_LEN:
            raise Reject("limit", "name length")
        try:
            name = r.take(name_len, "name").decode("utf-8")
        except UnicodeDecodeError:
            raise Reject("corrupt", "name is not UTF-8") from None
        dtype = r.u("B", "dtype")
        if dtype >= len(DTYPES):
            raise Reject("unsupported", f"dtype {dtype}")
        layout = r.u("B", "layout")
        if layout > 2:
            raise Reject("unsupported", f"layout {layout}")
        profile = r.u("B", "profile")
        if profile != 1:
            raise Reject("unsupported", f"profile {profile}")
        flags = r.u("B", "flags")
        if flags & ~1:
            raise Reject("unsupported", f"flags {flags:#x}")
        ndim = r.u("B", "ndim")
        axis = r.u("B", "channel_axis")
        if ndim > MAX_NDIM:
            raise Reject("limit", "ndim")
        shape = [r.u("Q", "shape") for _ in range(ndim)]
        if any(d > MAX_DIM for d in shape):
            raise Reject("limit", "dimension")
        if (ndim > 0 and axis >= ndim) or (ndim == 0 and axis != 0):
            raise Reject("corrupt", "channel_axis")
        size = DTYPES[dtype][1]
        n = span = 1
        for d in shape:
            n *= d
            span *= max(d, 1)
        if n >= 1 << 64 or n * size >= 1 << 64 or n * size > MAX_TENSOR_BYTES:
            raise Reject("limit", "tensor bytes")
        if span * size > MAX_TENSOR_BYTES:
            raise Reject("limit", "non-zero dimensions' span")
        chunk_elems = r.u("Q", "chunk_elems")
        n_chunks = r.u("I", "n_chunks")
        if n == 0:
            if chunk_elems != 0:
                raise Reject("corrupt", "empty tensor with chunk_elems != 0")
            expect = 0
        else:
            if chunk_elems == 0:
                raise Reject("corrupt", "chunk_elems 0")
            if chunk_elems * size > MAX_CHUNK_RAW:
                raise Reject("limit", "chunk bytes")
            expect = -(-n // chunk_elems)
        if n_chunks != expect:
            raise Reject("corrupt", "n_chunks")
        if n_chunks * 28 > r.left():
            raise Reject("truncated", "chunk table")
        chunks = []
        for k in range(n_chunks):
            off, stored_len, sx, rx = struct.unpack("<QIQQ", r.take(28, "chunk"))
            a = k * chunk_elems * size
            raw_len = min(a + chunk_elems * size, n * size) - a
            if off != pos:
                raise Reject("corrupt", "chunk offset")
            if not 1 <= stored_len <= raw_len + 1:
                raise Reject("corrupt", "stored_len")
            if raw_len > MAX_EXPANSION * stored_len:
                raise Reject("limit", "expansion")
            if off + stored_len > I:
                raise Reject("corrupt", "chunk runs into the index")
            pos += stored_len
            chunks.append((off, stored_len, sx, rx, raw_len))
        entries.append(dict(name=name, dtype=DTYPES[dtype][0], layout=layout, flags=flags,
                            shape=shape, chunk_elems=chunk_elems, chunks=chunks))
    if r.left() != 0:
        raise Reject("corrupt", "trailing index bytes")
    if pos != I:
        raise Reject("corrupt", "gap before the index")
    for e in entries:
        raw = bytearray()
        for off, stored_len, sx, rx, raw_len in e["chunks"]:
            p = buf[off:off + stored_len]
            if xxh3(p) != sx:
                raise Reject("checksum", "stored bytes")
            d = ref_decode_chunk(p, raw_len)
            if xxh3(d) != rx:
                raise Reject("checksum", "decoded bytes")
            raw += d
        e["raw"] = bytes(raw)
    return kind, entries


def ref_decode_chunk(p: bytes, raw_len: int) -> bytes:
    """Decode one payload (mode STORED, RANS or ROWS) into exactly raw_len bytes."""
    if p[:1] == b"\x02":
        return ref_decode_rows(p, raw_len)
    return ref_decode_units(p, raw_len)


def ref_decode_rows(p: bytes, raw_len: int) -> bytes:
    """FORMAT.md, "ROWS (mode 2)": references to earlier rows, then the unique rows."""
    r = _Cur(p, "corrupt", 1)
    row_bytes = r.u("I", "row_bytes")
    n_rows = r.u("I", "n_rows")
    n_refs = r.u("I", "n_refs")
    if row_bytes == 0 or n_rows * row_bytes != raw_len:
        raise Reject("corrupt", "n_rows x row_bytes is not the chunk's raw length")
    if n_refs > n_rows or 8 * n_refs > r.left():
        raise Reject("corrupt", "n_refs")
    refs, prev = [], -1
    for _ in range(n_refs):
        row, src = r.u("I", "row"), r.u("I", "src")
        if row <= prev:
            raise Reject("corrupt", "referencing rows not strictly ascending")
        if row >= n_rows or src >= row:
            raise Reject("corrupt", "row reference out of range")
        prev = row
        refs.append((row, src))
    referencing = {row for row, _ in refs}
    if any(src in referencing for _, src in refs):
        raise Reject("corrupt", "a reference to a referencing row")
    inner = p[r.pos:]
    if inner[:1] == b"\x02":
        raise Reject("corrupt", "nested ROWS payload")
    unique = ref_decode_units(inner, (n_rows - n_refs) * row_bytes)
    src_of = dict(refs)
    out, u = bytearray(), 0
    for row in range(n_rows):
        if row in src_of:
            s = src_of[row] * row_bytes
            out += out[s:s + row_bytes]
        else:
            out += unique[u:u + row_bytes]
            u += row_bytes
    return bytes(out)


def ref_decode_units(p: bytes, raw_len: int) -> bytes:
    """FORMAT.md, "STORED (mode 0)" and "RANS (mode 1)"."""
    r = _Cur(p, "corrupt")
    mode = r.u("B", "mode")
    if mode == 0:
        if len(p) != raw_len + 1:
            raise Reject("corrupt", "STORED length")
        return p[1:]
    if mode != 1:
        raise Reject("unsupported", f"chunk mode {mode}")
    unit_bits = r.u("B", "unit_bits")
    if unit_bits not in (8, 16, 32):
        raise Reject("corrupt", "unit_bits")
    U = unit_bits // 8
    if raw_len % U:
        raise Reject("corrupt", "raw_len not a multiple of U")
    n = raw_len // U
    sym_bits = r.u("B", "sym_bits")
    if not 1 <= sym_bits <= min(12, unit_bits):
        raise Reject("corrupt", "sym_bits")
    rbits = unit_bits - sym_bits
    A = 1 << sym_bits
    ctx_shift = r.u("B", "ctx_shift")
    if ctx_shift >= sym_bits:
        raise Reject("corrupt", "ctx_shift >= sym_bits")
    lanes_log2 = r.u("B", "lanes_log2")
    if lanes_log2 > 10:
        raise Reject("corrupt", "lanes_log2")
    LANES = 1 << lanes_log2
    stride = r.u("I", "ctx_stride")
    n_groups = r.u("B", "n_groups")
    if not 1 <= n_groups <= 16 or (n_groups > 1 and not 1 <= stride <= 65536):
        raise Reject("corrupt", "n_groups")
    groups = r.take(stride, "channel-group map") if n_groups > 1 else b""
    if any(g >= n_groups for g in groups):
        raise Reject("corrupt", "channel group out of range")
    n_keys = (A >> ctx_shift) * n_groups
    n_ctx = r.u("H", "n_ctx")
    if not (1 <= n_ctx <= 256 and n_ctx <= n_keys + 1):
        raise Reject("corrupt", "n_ctx")
    if 0 < stride < LANES:
        raise Reject("corrupt", "ctx_stride shorter than LANES")
    n_listed = r.u("H", "n_listed")
    if n_listed > n_keys:
        raise Reject("corrupt", "n_listed")
    if r.left() < 3 * n_listed + 2 * n_ctx:
        raise Reject("corrupt", "no room for the listed keys and the tables")
    ctx_of, prev = {}, -1
    for _ in range(n_listed):
        key, c = r.u("H", "key"), r.u("B", "context id")
        if key <= prev:
            raise Reject("corrupt", "listed keys not strictly ascending")
        if key >= n_keys:
            raise Reject("corrupt", f"listed key {key} >= n_keys = {n_keys}")
        if c >= n_ctx:
            raise Reject("corrupt", f"context id {c} >= n_ctx = {n_ctx}")
        ctx_of[key] = c
        prev = key
    tables = []
    for _ in range(n_ctx):
        nsym = r.u("H", "nsym")
        if nsym > A:
            raise Reject("corrupt", "nsym")
        pairs = [(r.u("H", "sym"), r.u("H", "freq")) for _ in range(nsym)]
        if nsym == 1:
            raise Reject("corrupt", "table of one symbol")
        syms = [s for s, _ in pairs]
        if any(s >= A for s in syms) or any(a >= b for a, b in zip(syms, syms[1:])):
            raise Reject("corrupt", "table symbols")
        if any(f == 0 for _, f in pairs):
            raise Reject("corrupt", "zero freq")
        if nsym and sum(f for _, f in pairs) != M:
            raise Reject("corrupt", "freqs do not sum to 4096")
        slot, start = [None] * M, 0
        for s, f in pairs:
            for j in range(start, start + f):
                slot[j] = (s, f, start)
            start += f
        tables.append(slot if nsym else None)
    lane_len = [r.u("I", "lane_len") for _ in range(LANES)]
    lanes, x, lp = [], [], []
    for ln in lane_len:
        if ln < 4 or ln % 2:
            raise Reject("corrupt", "lane_len")
        b = r.take(ln, "lane")
        lanes.append(b)
        x.append(struct.unpack("<I", b[:4])[0])
        lp.append(4)
        if x[-1] < RANS_L:
            raise Reject("corrupt", "initial state")
    low = r.take(-(-n * rbits // 8), "low bits")
    if r.left():
        raise Reject("corrupt", "trailing payload bytes")
    sym = [0] * n
    for i in range(n):
        lane = i % LANES
        if stride > 0 and i >= stride:
            key = (sym[i - stride] >> ctx_shift) * n_groups + (groups[i % stride] if n_groups > 1 else 0)
            c = ctx_of.get(key, 0)
        else:
            c = 0
        T = tables[c]
        if T is None:
            raise Reject("corrupt", "symbol in an empty context")
        s, f, b = T[x[lane] & (M - 1)]
        y = f * (x[lane] >> PROB_BITS) + (x[lane] & (M - 1)) - b
        if y < RANS_L:
            if lp[lane] + 2 > lane_len[lane]:
                raise Reject("corrupt", "lane runs dry")
            y = (y << 16) | struct.unpack("<H", lanes[lane][lp[lane]:lp[lane] + 2])[0]
            lp[lane] += 2
        x[lane] = y
        sym[i] = s
    for lane in range(LANES):
        if x[lane] != RANS_L or lp[lane] != lane_len[lane]:
            raise Reject("corrupt", "lane end state")
    bits = int.from_bytes(low, "little")
    if rbits and bits >> (n * rbits):
        raise Reject("corrupt", "non-zero padding bits")
    out = bytearray()
    mask = (1 << rbits) - 1
    for i in range(n):
        out += ((sym[i] << rbits) | ((bits >> (i * rbits)) & mask)).to_bytes(U, "little")
    return bytes(out)


# ---------------------------------------------------------------------------------------------
# Valid vectors

@dataclass
class Valid:
    name: str
    exercises: str
    wz: bytes
    expected_name: str  # NAME.npy / NAME.npz / NAME.out
    expected: bytes
    api: str  # how a test decodes it: "decompress", "load_file", "decompress_file"
    arrays: list = field(default_factory=list)  # [(entry name, container dtype, array)]
    original: bytes = b""

    @property
    def container(self) -> Container:
        return parse(self.wz)


def _compress_file(data: bytes) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "src.txt", Path(d) / "dst.wz"
        src.write_bytes(data)
        weightszip.compress_file(src, dst)
        return dst.read_bytes()


def _save_file(tensors: dict) -> bytes:
    with tempfile.TemporaryDirectory() as d:
        dst = Path(d) / "archive.wz"
        weightszip.save_file(tensors, dst)
        return dst.read_bytes()


def tensor_vector(name: str, exercises: str, x: np.ndarray, dtype: str, **opts) -> Valid:
    wz = weightszip.compress(x, **opts)
    return Valid(name, exercises, wz, name + ".npy", npy_bytes(as_bits(x, dtype)), "decompress",
                 arrays=[("", dtype, x)])


TEXT = (
    "weightszip golden vector: a short text file compressed with compress_file.\n"
    "Bytes are coded as uint8 units; the context of a byte is the byte before it (stride 1),\n"
    "so the reference encoder codes this chunk with a single lane.\n\n"
    + "".join(
        f"line {i:02d}: the quick brown fox jumps over the lazy dog; "
        f"pack my box with five dozen liquor jugs.\n"
        for i in range(24)
    )
).encode()


def make_valid() -> list[Valid]:
    v: list[Valid] = []

    kv_all = np.load(KV_PATH)
    assert kv_all.dtype == np.uint16 and kv_all.shape == (2, 3, 64, 192), (kv_all.dtype, kv_all.shape)
    assert hashlib.sha256(kv_all.tobytes()).hexdigest() == KV_SHA256, "tests/data KV changed"
    kv = np.ascontiguousarray(kv_all[0:1, :, :32, :]).view(ml_dtypes.bfloat16)
    v.append(tensor_vector(
        "bf16_kv_channel_context",
        "real bf16 KV (SmolLM2-135M, K of 3 layers, first 32 tokens), layout tag 2 (KV): RANS "
        "with 9-bit sign+exponent symbols, 7 raw mantissa bits, ctx_stride = one row (192 "
        "channels), one channel group, previous symbols mapped to their own tables and to the "
        "shared table (context 1), 32 lanes",
        kv, "bfloat16", layout=2))

    # Layer 0, KV heads 0 and 1, token-major: row t = K[t] followed by V[t] (256 channels). K and
    # V channels differ in magnitude, so grouping the channels pays even on 64 tokens.
    kv = np.concatenate([kv_all[0, 0, :, :128], kv_all[1, 0, :, :128]], axis=1)
    kv = np.ascontiguousarray(kv).view(ml_dtypes.bfloat16)
    v.append(tensor_vector(
        "bf16_grouped_contexts",
        "real bf16 KV (SmolLM2-135M layer 0, KV heads 0-1, 64 tokens) laid out token-major, row "
        "t = K[t] then V[t] (256 channels): RANS with ctx_stride 256 and n_groups = 8, a 256-byte "
        "channel-group map, context keys sym x 8 + group (keys beyond the 512-symbol alphabet), "
        "many keys sharing their group's table",
        kv, "bfloat16", layout=2))

    # Layer 0's V depends only on the token id: rows of repeated tokens repeat exactly.
    kv = np.ascontiguousarray(kv_all[1, 0]).view(ml_dtypes.bfloat16)
    v.append(tensor_vector(
        "rows_mode_repeated_rows",
        "real bf16 KV (SmolLM2-135M, V of layer 0, 64 tokens, 43 distinct token ids): mode ROWS "
        "with row_bytes 384, 21 row references (a row equal to an earlier one, as layer 0's V of "
        "a repeated token is), the 43 unique rows in an inner RANS payload",
        kv, "bfloat16", layout=2))

    x = rand_normal(2, (11, 37, 23), 0.05).astype(np.float16)
    v.append(tensor_vector(
        "f16_odd_shape",
        "float16 of shape (11, 37, 23): 6-bit symbols, 10 raw bits per unit, low-bit stream "
        "ending in 6 padding bits",
        x, "float16"))

    # int4-quantized weights dequantized with a power-of-two scale per column: the top mantissa
    # bits are far from uniform given the exponent, and columns differ in magnitude.
    q = np.clip(np.round(rand_normal(21, (128, 64), 2.5)), -8, 7)
    scale = np.exp2((rand_bytes(23, 64) % 8).astype(np.int64) - 6)
    x = (q * scale[None, :] / 16).astype(np.float16)
    v.append(tensor_vector(
        "f16_wide_symbols_context_shift",
        "float16 int4-dequantized weights (q/16 times a power-of-two scale per column, 128 x 64): "
        "8-bit symbols (sign, 5 exponent bits and the top 2 mantissa bits, 8 raw bits), "
        "ctx_shift 2 (the key drops the previous symbol's 2 mantissa bits: (sym >> 2) x 8 + group, "
        "n_keys = 64 x 8 = 512), ctx_stride 64 with 8 channel groups",
        x, "float16"))

    x = np.array(-1.5e-3, dtype=np.float32)
    v.append(tensor_vector("f32_scalar", "a 0-d float32 tensor (ndim 0, one element): a STORED chunk",
                           x, "float32"))

    x = np.zeros((4, 0, 3), dtype=np.float16)
    v.append(tensor_vector("empty_tensor", "a tensor of shape (4, 0, 3): chunk_elems 0, no chunks",
                           x, "float16"))

    x = (rand_normal(5, (64, 96), 0.5)).astype(ml_dtypes.float8_e4m3fn)
    v.append(tensor_vector(
        "fp8_e4m3_whole_byte_symbols",
        "float8_e4m3fn: 8-bit units coded whole (sym_bits 8, no low bits)", x, "float8_e4m3fn"))

    x = (rand_normal(6, (48, 80), 0.01)).astype(ml_dtypes.float8_e5m2)
    v.append(tensor_vector("fp8_e5m2", "float8_e5m2: 8-bit units coded whole", x, "float8_e5m2"))

    x = np.round(rand_normal(7, (40, 64), 30.0)).astype(np.int32)
    v.append(tensor_vector(
        "int32_byte_coded",
        "int32 coded as bytes (unit_bits 8): context = the same byte of the previous element "
        "(ctx_stride 4), so the encoder lowers the lanes to 4",
        x, "int32"))

    x = rand_bytes(8, 3000)
    v.append(tensor_vector(
        "stored_chunk_incompressible",
        "uniformly random bytes: RANS would not be smaller, so the chunk is STORED (mode 0)",
        x, "uint8"))

    x = rand_normal(9, (48, 64), 0.02).astype(ml_dtypes.bfloat16)
    v.append(tensor_vector("single_lane", "bfloat16 coded with lanes_log2 = 0 (one rANS lane)",
                           x, "bfloat16", lanes_log2=0))

    x = rand_normal(10, (120, 64), 0.02).astype(ml_dtypes.bfloat16)
    x[32:48] = rand_bytes(100, 16 * 64 * 2).view(ml_dtypes.bfloat16).reshape(16, 64)
    v.append(tensor_vector(
        "many_chunks_small_chunk_size",
        "chunk_bytes 2048 on a (120, 64) bfloat16 tensor: 8 chunks of 16 rows, the last one of 8 "
        "rows; chunk 2 holds random bit patterns and is STORED, the others RANS; payloads back "
        "to back",
        x, "bfloat16", chunk_bytes=2048))

    archive = {
        "embed.weight": rand_normal(11, (16, 32), 0.02).astype(ml_dtypes.bfloat16),
        "layers.0.norm.weight": (1.0 + rand_normal(12, (32,), 0.01)).astype(np.float32),
        "layers.0.attn.scale": np.array([0.125, 0.25, 0.5], dtype=np.float16),
    }
    wz = _save_file(archive)
    v.append(Valid(
        "named_tensors_archive",
        "save_file of three named tensors (bfloat16, float32, float16): three entries with "
        "names, one container",
        wz, "named_tensors_archive.npz",
        npz_bytes([(k, as_bits(a, weightszip._tensors._NP_TO_NAME[a.dtype])) for k, a in archive.items()]),
        "load_file",
        arrays=[(k, weightszip._tensors._NP_TO_NAME[a.dtype], a) for k, a in archive.items()]))

    wz = _compress_file(TEXT)
    v.append(Valid("file_kind_text",
                   "compress_file of a short text: container kind 1 (file), one uint8 segment "
                   "with layout tag 1, ctx_stride 1 and a single lane",
                   wz, "file_kind_text.out", TEXT, "decompress_file", original=TEXT))

    x = np.zeros(8192, dtype=np.int8)
    v.append(tensor_vector(
        "constant_tensor_escape_symbol",
        "all zeros (int8, coded as bytes, one dimension: a single row, so no row references): "
        "one symbol occurs, so its table gives it 4095 and the next symbol value 1 (a table needs "
        "two symbols); 8192 units from a few hundred bytes, most of them the 32 lane headers",
        x, "int8"))

    x = np.tile(rand_bytes(31, 128).view(np.int8), (64, 1))
    v.append(tensor_vector(
        "rows_mode_stored_inner",
        "one row of 128 random bytes (int8) repeated 64 times: mode ROWS, rows 1-63 all "
        "reference row 0, and the one unique (incompressible) row is an inner STORED payload",
        x, "int8"))

    wz = _save_file({})
    v.append(Valid("empty_container",
                   "no entries: the 48-byte container of FORMAT.md's example, byte for byte",
                   wz, "empty_container.npz", npz_bytes([]), "load_file"))
    return v


def _rans_chunks(c: Container) -> list[Rans]:
    return [Rans.parse(ch.payload) for e in c.entries for ch in e.chunks if chunk_mode(ch) == 1]


def check_valid_properties(v: dict[str, Valid]) -> None:
    """Each vector exercises what its name says (the encoder may change; then rename, add)."""
    c = v["bf16_kv_channel_context"].container
    (r,) = _rans_chunks(c)
    assert c.entries[0].layout == 2 and (r.unit_bits, r.sym_bits, r.ctx_shift, r.lanes_log2) == (16, 9, 0, 5)
    assert r.stride == 192 and r.n_groups == 1 and r.groups == b"", (r.stride, r.n_groups)
    ids = [cid for _, cid in r.listed]
    assert len(r.tables) >= 3 and len(set(ids)) >= 2 and len(ids) > len(set(ids)), (len(r.tables), ids)

    c = v["f16_wide_symbols_context_shift"].container
    (r,) = _rans_chunks(c)
    assert (r.unit_bits, r.sym_bits, r.ctx_shift) == (16, 8, 2), (r.unit_bits, r.sym_bits, r.ctx_shift)
    assert r.stride == 64 and r.n_groups == 8 and len(r.listed) >= 2, (r.stride, r.n_groups)
    assert max(k for k, _ in r.listed) < 512

    c = v["bf16_grouped_contexts"].container
    (r,) = _rans_chunks(c)
    assert chunk_mode(c.entries[0].chunks[0]) == 1 and (r.unit_bits, r.sym_bits) == (16, 9)
    assert r.stride == 256 and r.n_groups == 8 and len(r.groups) == 256, (r.stride, r.n_groups)
    assert set(r.groups) == set(range(8)), sorted(set(r.groups))
    assert max(k for k, _ in r.listed) >= 512 and len(r.listed) > len(r.tables)

    c = v["rows_mode_repeated_rows"].container
    (ch,) = c.entries[0].chunks
    w = Rows.parse(ch.payload)
    got = (w.row_bytes, w.n_rows, len(w.refs))
    assert chunk_mode(ch) == 2 and got == (384, 64, 21), got
    assert w.inner[0] == 1

    c = v["f16_odd_shape"].container
    (r,) = _rans_chunks(c)
    n = 11 * 37 * 23
    assert (r.unit_bits, r.sym_bits) == (16, 6) and (n * 10) % 8 == 2

    c = v["f32_scalar"].container
    assert c.entries[0].ndim == 0 and c.entries[0].shape == [] and chunk_mode(c.entries[0].chunks[0]) == 0

    c = v["empty_tensor"].container
    assert c.entries[0].chunk_elems == 0 and c.entries[0].chunks == []

    for name, want in (("fp8_e4m3_whole_byte_symbols", 4), ("fp8_e5m2", 5)):
        c = v[name].container
        (r,) = _rans_chunks(c)
        assert c.entries[0].dtype == want and (r.unit_bits, r.sym_bits, r.low) == (8, 8, b"")

    c = v["int32_byte_coded"].container
    (r,) = _rans_chunks(c)
    assert (r.unit_bits, r.sym_bits, r.stride, r.lanes_log2) == (8, 8, 4, 2), (r.stride, r.lanes_log2)

    c = v["stored_chunk_incompressible"].container
    assert [chunk_mode(ch) for ch in c.entries[0].chunks] == [0]

    c = v["single_lane"].container
    (r,) = _rans_chunks(c)
    assert r.lanes_log2 == 0

    c = v["many_chunks_small_chunk_size"].container
    e = c.entries[0]
    assert e.chunk_elems == 1024 and len(e.chunks) == 8
    modes = [chunk_mode(ch) for ch in e.chunks]
    assert modes[2] == 0 and modes.count(1) >= 5, modes

    c = v["named_tensors_archive"].container
    assert [e.name for e in c.entries] == [b"embed.weight", b"layers.0.norm.weight", b"layers.0.attn.scale"]

    c = v["file_kind_text"].container
    (r,) = _rans_chunks(c)
    assert c.kind == 1 and c.entries[0].layout == 1 and r.stride == 1 and r.lanes_log2 == 0

    c = v["rows_mode_stored_inner"].container
    (ch,) = c.entries[0].chunks
    w = Rows.parse(ch.payload)
    assert (w.row_bytes, w.n_rows, w.refs) == (128, 64, [(i, 0) for i in range(1, 64)])
    assert w.inner == b"\0" + rand_bytes(31, 128).tobytes()

    c = v["constant_tensor_escape_symbol"].container
    (r,) = _rans_chunks(c)
    assert r.listed == [] and r.tables == [[(0, 4095), (1, 1)]], (r.listed, r.tables)

    doc_example = bytes.fromhex(
        "89575a500d0a1a0a0100000000000000" "0000000000000000"
        "0800000000000000d7a4c9f2ee75f799" "575a50494e444558")
    assert v["empty_container"].wz == doc_example


# ---------------------------------------------------------------------------------------------
# Invalid vectors: (name, base vector, FORMAT.md rule broken, bytes)

def _flip(b: bytes, at: int, mask: int = 0x01) -> bytes:
    b = bytearray(b)
    b[at] ^= mask
    return bytes(b)


def _with_rans(c: Container, change, entry: int = 0, chunk: int = 0) -> Container:
    """Change the RANS payload of one chunk; its stored checksum is recomputed by build()."""
    ch = c.entries[entry].chunks[chunk]
    r = Rans.parse(ch.payload)
    change(r)
    ch.payload = r.build()
    return c


def make_invalid(v: dict[str, Valid]) -> list[tuple[str, str, str, bytes]]:
    out = []

    def add(name, base, rule, data):
        out.append((name, base, rule, data))

    def C(base):  # a fresh parsed copy of a valid vector
        return v[base].container

    scalar = "f32_scalar"

    add("bad_magic", scalar, "magic (first byte 0x89 with its high bit stripped)",
        _flip(v[scalar].wz, 0, 0x80))

    c = C(scalar); c.version = 2
    add("version_2", scalar, "version must be 1 (index checksum recomputed)", build(c))

    c = C(scalar); c.preamble_reserved = b"\0\0\0\0\0\1"
    add("reserved_preamble_nonzero", scalar, "preamble bytes 10-15 must be zero (index checksum recomputed)", build(c))

    add("truncated_in_preamble", scalar, "an input shorter than 16 bytes that starts with the magic",
        v[scalar].wz[:12])

    add("truncated_below_minimum_size", "empty_container",
        "a container shorter than 40 bytes (the 48-byte empty container cut inside its trailer)",
        v["empty_container"].wz[:36])

    add("truncated_in_trailer", "f16_odd_shape",
        "the last 5 bytes cut off: the trailer does not end with WZPINDEX (corrupt, per the "
        "trailer rules: the end magic check has no [truncated] kind)",
        v["f16_odd_shape"].wz[:-5])

    c = C(scalar); c.index_len = len(v[scalar].wz) - 40 + 1
    add("index_longer_than_container", scalar, "index_len <= total_len - 40", build(c))

    c = C(scalar); c.index_len = MAX_INDEX_LEN + 1
    add("index_len_beyond_limit", scalar, "index_len <= 256 MiB", build(c))

    c = C("named_tensors_archive"); c.index_cut = 10
    add("truncated_in_index", "named_tensors_archive",
        "the index ends 10 bytes into the last chunk record: the chunk table does not fit in the "
        "index (index_len and index checksum describe the shortened index)", build(c))

    c = C("f16_odd_shape")
    c.entries[0].chunks[0].payload = c.entries[0].chunks[0].payload[:-3]
    add("truncated_in_chunk", "f16_odd_shape",
        "a RANS payload missing its last 3 low-bit bytes (stored_len, stored checksum and index "
        "checksum describe the shortened payload): fields run past the payload's end, corrupt",
        build(c))

    c = C("f16_odd_shape")
    wz = v["f16_odd_shape"].wz
    index_start = len(wz) - 24 - struct.unpack("<Q", wz[-24:-16])[0]
    add("index_checksum_mismatch", "f16_odd_shape", "index_checksum (one bit of the first shape "
        "dimension flipped, checksum left as it was)", _flip(wz, index_start + 8 + 2 + 6))

    c = C("f16_odd_shape")
    ch = c.entries[0].chunks[0]
    ch.stored_xxh3 = xxh3(ch.payload)
    ch.payload = _flip(ch.payload, len(ch.payload) // 2)
    add("stored_checksum_mismatch", "f16_odd_shape", "stored_xxh3 (one payload byte flipped)", build(c))

    c = _with_rans(C("f16_odd_shape"), lambda r: setattr(r, "low", _flip(r.low, len(r.low) // 2)))
    add("content_checksum_mismatch", "f16_odd_shape",
        "raw_xxh3 (one raw low-bit byte flipped; stored and index checksums recomputed, so the "
        "chunk decodes, to the wrong bytes)", build(c))

    c = C(scalar); c.entries[0].dtype = 15
    add("unknown_dtype_code", scalar, "dtype code 15 is not defined: [unsupported]", build(c))

    c = C(scalar); c.entries[0].profile = 2
    add("unknown_profile", scalar, "profile 2 is not defined: [unsupported]", build(c))

    c = C(scalar); c.entries[0].layout = 3
    add("unknown_layout_tag", scalar, "layout tag 3 is not defined: [unsupported]", build(c))

    c = C(scalar); c.entries[0].flags = 0x80
    add("unknown_flags_bit", scalar, "flags bit 7 is not defined: [unsupported]", build(c))

    c = C(scalar); c.kind = 2
    add("unknown_container_kind", scalar, "container kind 2 is not defined: [unsupported]", build(c))

    c = C(scalar); c.index_reserved = b"\0\1\0"
    add("index_reserved_nonzero", scalar, "index bytes 1-3 must be zero", build(c))

    c = C("stored_chunk_incompressible")
    ch = c.entries[0].chunks[0]
    ch.payload = b"\x03" + ch.payload[1:]
    add("unknown_chunk_mode", "stored_chunk_incompressible",
        "chunk mode 3 is not defined: [unsupported] (stored checksum recomputed)", build(c))

    c = C("many_chunks_small_chunk_size")
    c.entries[0].chunks[1].gap_before = b"\0"
    add("chunk_offset_gap", "many_chunks_small_chunk_size",
        "chunk 1 starts one byte after chunk 0 ends: offset = running position", build(c))

    c = C("stored_chunk_incompressible")
    c.entries[0].chunks[0].payload += b"\0"
    add("chunk_stored_len_exceeds_raw_plus_one", "stored_chunk_incompressible",
        "stored_len <= raw_len + 1 (a STORED payload with one extra byte)", build(c))

    c = C("constant_tensor_escape_symbol")
    e = c.entries[0]
    s, size = len(e.chunks[0].payload), DTYPES[e.dtype][1]
    n = MAX_EXPANSION * s // size + 1  # raw_len just above 32768 x stored_len
    assert n * size <= MAX_CHUNK_RAW
    e.shape, e.chunk_elems, e.channel_axis = [n], n, 0
    e.ndim = 1
    add("declared_expansion_beyond_limit", "constant_tensor_escape_symbol",
        f"raw_len <= 32768 x stored_len: a {s}-byte payload declares {size * n} raw bytes", build(c))

    def sum_4097(r):
        s0, f0 = r.tables[0][0]
        r.tables[0][0] = (s0, f0 + 1)
    c = _with_rans(C("f16_odd_shape"), sum_4097)
    add("frequency_table_sum_not_4096", "f16_odd_shape",
        "the freqs of a table sum to 4096 (first freq + 1: 4097)", build(c))

    def one_symbol(r):
        assert r.tables == [[(0, 4095), (1, 1)]]
        r.tables = [[(0, 4096)]]
    c = _with_rans(C("constant_tensor_escape_symbol"), one_symbol)
    add("frequency_table_single_symbol", "constant_tensor_escape_symbol",
        "a non-empty table holds at least 2 symbols ({0: 4096})", build(c))

    def swap_keys(r):
        r.listed[0], r.listed[1] = r.listed[1], r.listed[0]
    c = _with_rans(C("bf16_kv_channel_context"), swap_keys)
    add("context_keys_out_of_order", "bf16_kv_channel_context",
        "listed context keys strictly ascending (the first two (key, context id) records swapped)",
        build(c))

    def key_beyond(r):
        n_keys = (1 << (r.sym_bits - r.ctx_shift)) * r.n_groups
        key, cid = r.listed[-1]
        assert n_keys == 512 and key < n_keys
        r.listed[-1] = (n_keys, cid)
    c = _with_rans(C("f16_wide_symbols_context_shift"), key_beyond)
    add("listed_key_out_of_range", "f16_wide_symbols_context_shift",
        "listed keys < n_keys = 2^(sym_bits - ctx_shift) x n_groups (the last key set to "
        "2^(8-2) x 8 = 512, still below 2^sym_bits x n_groups = 2048; the keys stay ascending)",
        build(c))

    def shift_too_wide(r):
        assert r.ctx_shift == 2
        r.ctx_shift = r.sym_bits
    c = _with_rans(C("f16_wide_symbols_context_shift"), shift_too_wide)
    add("context_shift_not_below_sym_bits", "f16_wide_symbols_context_shift",
        "ctx_shift < sym_bits (ctx_shift set to 8 with 8-bit symbols)", build(c))

    def ctx_id_beyond(r):
        key, _ = r.listed[0]
        r.listed[0] = (key, len(r.tables))
    c = _with_rans(C("bf16_grouped_contexts"), ctx_id_beyond)
    add("context_id_out_of_range", "bf16_grouped_contexts",
        "listed context ids < n_ctx (the first record's id set to n_ctx = 9)", build(c))

    def group_beyond(r):
        assert r.n_groups == 8
        g = bytearray(r.groups)
        g[0] = 8
        r.groups = bytes(g)
    c = _with_rans(C("bf16_grouped_contexts"), group_beyond)
    add("group_out_of_range", "bf16_grouped_contexts",
        "every channel-group map byte < n_groups (byte 0 set to 8 with n_groups = 8)", build(c))

    def groups_no_stride(r):
        assert r.n_groups == 8
        r.stride, r.groups = 0, b""
    c = _with_rans(C("bf16_grouped_contexts"), groups_no_stride)
    add("groups_with_stride_zero", "bf16_grouped_contexts",
        "n_groups > 1 requires 1 <= ctx_stride <= 65536 (ctx_stride set to 0 and the map, "
        "0 bytes long at that stride, removed; n_groups stays 8)", build(c))

    def short_stride(r):
        assert r.lanes_log2 == 5
        r.stride = 16
    c = _with_rans(C("bf16_kv_channel_context"), short_stride)
    add("stride_shorter_than_lanes", "bf16_kv_channel_context",
        "ctx_stride is 0 or >= LANES (16 with 32 lanes)", build(c))

    def many_contexts(r):
        assert r.stride == 0 and r.n_groups == 1 and r.sym_bits == 8 and r.listed == []
        r.n_ctx = 256  # <= n_keys + 1 = 257
        assert len(r.build()) - 13 < 3 * 0 + 2 * 256  # bytes after n_listed (header: 13 bytes)
    c = _with_rans(C("constant_tensor_escape_symbol"), many_contexts)
    add("context_count_exceeds_payload", "constant_tensor_escape_symbol",
        "n_ctx = 256 (n_listed = 0) in a payload with fewer than 3 x n_listed + 2 x n_ctx = 512 "
        "bytes after n_listed", build(c))

    def drop_last_word(r):
        lane = next(i for i, b in enumerate(r.lanes) if len(b) >= 6)
        r.lanes[lane] = r.lanes[lane][:-2]
    c = _with_rans(C("bf16_kv_channel_context"), drop_last_word)
    add("lane_stream_overrun", "bf16_kv_channel_context",
        "every lane ends in state RANS_L with all its words consumed (the last refill word of "
        "lane 0 removed and lane_len[0] lowered by 2: the lane runs dry)", build(c))

    def padding(r):
        r.low = r.low[:-1] + bytes([r.low[-1] | 0x80])
    c = _with_rans(C("f16_odd_shape"), padding)
    add("nonzero_padding_bits", "f16_odd_shape",
        "the padding bits after the low bits are zero (top bit of the last byte set)", build(c))

    rows = "rows_mode_repeated_rows"

    def _with_rows(change):
        c = C(rows)
        ch = c.entries[0].chunks[0]
        w = Rows.parse(ch.payload)
        change(w)
        ch.payload = w.build()  # stored checksum recomputed by build()
        return build(c)

    def swap_refs(w):
        w.refs[0], w.refs[1] = w.refs[1], w.refs[0]
    add("rows_ref_out_of_order", rows,
        "referencing rows strictly ascending (the first two (row, src) records swapped)",
        _with_rows(swap_refs))

    def chain(w):
        # The first reference whose source an earlier reference shares: point it at that
        # earlier referencing row instead (same bytes, so only the rule can catch it).
        k, j = next((k, j) for k in range(len(w.refs)) for j in range(k) if w.refs[j][1] == w.refs[k][1])
        w.refs[k] = (w.refs[k][0], w.refs[j][0])
    add("rows_ref_to_reference", rows,
        "a src is never itself a referencing row (a reference repointed at an earlier "
        "referencing row with the same bytes, so following the chain would decode correctly)",
        _with_rows(chain))

    def nest(w):
        outer = Rows(w.row_bytes, w.n_rows, [], w.build())
        w.refs, w.inner = outer.refs, outer.inner
    add("rows_nested", rows,
        "the inner payload is STORED or RANS, never ROWS (the valid ROWS payload wrapped in a "
        "ROWS payload with no references, which would otherwise decode to the same bytes)",
        _with_rows(nest))

    def count(w):
        w.n_rows += 1
    add("rows_count_mismatch", rows,
        "n_rows x row_bytes = the chunk's raw length (n_rows one too many)", _with_rows(count))

    c = C("empty_tensor"); c.entries[0].chunk_elems = 1
    add("empty_tensor_nonzero_chunk_elems", "empty_tensor", "an empty tensor declares chunk_elems = 0",
        build(c))

    c = C("empty_tensor"); c.entries[0].shape = [2**26, 0, 2**26]
    add("empty_tensor_span_beyond_limit", "empty_tensor", "an entry's non-zero dimensions times its "
        "dtype's size are at most 2^50 bytes, an empty tensor's too (2^26 x 0 x 2^26 float32: 2^54)", build(c))

    c = C(scalar); c.index_extra = bytes(4)
    add("index_trailing_bytes", scalar, "the index ends exactly after the last entry record "
        "(4 zero bytes appended; index_len and checksum cover them)", build(c))

    c = C(scalar)
    e = c.entries[0]
    e.ndim, e.shape, e.channel_axis, e.chunk_elems = 17, [1] * 17, 16, 1
    add("too_many_dimensions", scalar, "ndim <= 16 (17 dimensions of size 1)", build(c))

    c = C("named_tensors_archive")
    c.entries[0].name = b"embed\xffweight"
    add("name_not_utf8", "named_tensors_archive", "names are valid UTF-8 (a 0xFF byte)", build(c))
    return out


# ---------------------------------------------------------------------------------------------
# Checks with the real decoder

def real_outcome(data: bytes, api: str) -> tuple[str, object]:
    """('ok', result) or ('error', exception class name) from one decoder entry point."""
    try:
        with tempfile.TemporaryDirectory() as d:
            p = Path(d) / "x.wz"
            p.write_bytes(data)
            if api == "decompress":
                res = weightszip.decompress(data, out="numpy")
            elif api == "verify":
                res = weightszip.verify(data)
            elif api == "load_file":
                res = weightszip.load_file(p, out="numpy")
            elif api == "decompress_file":
                weightszip.decompress_file(p, Path(d) / "out")
                res = (Path(d) / "out").read_bytes()
            else:
                raise ValueError(api)
        return "ok", res
    except errors.WeightszipError as e:
        return "error", type(e).__name__


def same(a: np.ndarray, b: np.ndarray) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def check_valid(v: Valid) -> None:
    kind, entries = ref_read(v.wz)  # the reference reader (FORMAT.md)
    assert kind == (1 if v.api == "decompress_file" else 0)
    if v.api == "decompress_file":
        assert b"".join(e["raw"] for e in entries) == v.original
    else:
        assert [(e["name"], e["dtype"], e["raw"]) for e in entries] == [
            (n, dt, a.tobytes()) for n, dt, a in v.arrays
        ], v.name
        for e, (_, _, a) in zip(entries, v.arrays):
            assert tuple(e["shape"]) == a.shape
    st, res = real_outcome(v.wz, "verify")
    assert st == "ok", (v.name, res)
    st, res = real_outcome(v.wz, v.api)
    assert st == "ok", (v.name, res)
    if v.api == "decompress":
        assert same(res, v.arrays[0][2]), v.name
    elif v.api == "load_file":
        assert list(res) == [n for n, _, _ in v.arrays]
        assert all(same(res[n], a) for n, _, a in v.arrays)
    else:
        assert res == v.original


def check_expected_file(v: Valid) -> None:
    """The expected-output file reads back (with numpy) as exactly the decoded data."""
    if v.expected_name.endswith(".npy"):
        ((_, dt, a),) = v.arrays
        assert same(np.load(io.BytesIO(v.expected)), as_bits(a, dt)), v.name
    elif v.expected_name.endswith(".npz"):
        z = np.load(io.BytesIO(v.expected))
        assert z.files == [n for n, _, _ in v.arrays], v.name
        for n, dt, a in v.arrays:
            assert same(z[n], as_bits(a, dt)), (v.name, n)
    else:
        assert v.expected == v.original


def check_invalid(name: str, data: bytes, single_entry: bool) -> str:
    try:
        ref_read(data)
    except Reject as e:
        want = KIND_TO_CLASS[e.kind]
    else:
        raise AssertionError(f"{name}: the reference reader accepts it")
    apis = ["verify", "load_file", "decompress_file"] + (["decompress"] if single_entry else [])
    got = {api: real_outcome(data, api) for api in apis}
    bad = {api: g for api, g in got.items() if g != ("error", want)}
    if bad:
        raise AssertionError(f"{name}: FORMAT.md says {want}, the decoder gives {bad}")
    return want


# ---------------------------------------------------------------------------------------------

def render() -> dict[Path, bytes]:
    valid = make_valid()
    vd = {x.name: x for x in valid}
    assert len(vd) == len(valid)
    check_valid_properties(vd)
    files: dict[Path, bytes] = {}
    manifest = {"format_version": VERSION, "valid": {}, "invalid": {}}
    for x in valid:
        check_valid(x)
        check_expected_file(x)
        files[HERE / "valid" / (x.name + ".wz")] = x.wz
        files[HERE / "valid" / x.expected_name] = x.expected
        manifest["valid"][x.name + ".wz"] = {
            "exercises": x.exercises,
            "expected": x.expected_name,
            "decode_with": x.api,
            "entries": [
                {"name": n, "dtype": dt, "shape": list(a.shape),
                 "npy_dtype": np.dtype(BITS_DTYPE.get(dt, NP_DTYPE[dt])).name}
                for n, dt, a in x.arrays
            ],
        }
    expected = {}
    for name, base, rule, data in make_invalid(vd):
        fname = name + ".wz"
        assert fname not in expected
        expected[fname] = check_invalid(name, data, len(vd[base].arrays) == 1)
        files[HERE / "invalid" / fname] = data
        manifest["invalid"][fname] = {"from": base + ".wz", "breaks": rule, "raises": expected[fname]}
    files[HERE / "invalid" / "EXPECTED.json"] = (json.dumps(expected, indent=2, sort_keys=True) + "\n").encode()
    files[HERE / "MANIFEST.json"] = (json.dumps(manifest, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()
    for p, b in files.items():
        if p.suffix == ".wz":
            assert len(b) < 64 << 10, (p.name, len(b))
    total = sum(len(b) for b in files.values())
    assert total < 768 << 10, total  # raised from 600 KiB when ROWS and channel groups came in
    return files


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = ap.add_mutually_exclusive_group()
    g.add_argument("--check", action="store_true", help="compare with the files on disk, write nothing")
    g.add_argument("--force", action="store_true",
                   help="overwrite files whose content differs (never for a released format version)")
    args = ap.parse_args(argv)

    files = render()
    missing = [p for p in files if not p.exists()]
    differ = [p for p in files if p.exists() and p.read_bytes() != files[p]]
    known = set(files)
    stray = sorted(p for d in ("valid", "invalid") if (HERE / d).is_dir()
                   for p in (HERE / d).iterdir() if p not in known)
    rel = lambda p: p.relative_to(REPO)  # noqa: E731
    for p in stray:
        print(f"note: {rel(p)} is not produced by generate.py (left alone)", file=sys.stderr)
    if args.check:
        for p in missing:
            print(f"missing: {rel(p)}", file=sys.stderr)
        for p in differ:
            print(f"differs: {rel(p)}", file=sys.stderr)
        print(f"{len(files) - len(missing) - len(differ)} of {len(files)} files identical")
        return 1 if missing or differ else 0
    if differ and not args.force:
        for p in differ:
            print(f"refusing to change {rel(p)}", file=sys.stderr)
        print("existing vectors must not change; add new vectors under new names "
              "(--force only while the format version is unreleased)", file=sys.stderr)
        return 1
    for p in missing + differ:
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(files[p])
    print(f"{len(files)} files: {len(missing)} written, {len(differ)} overwritten, "
          f"{len(files) - len(missing) - len(differ)} unchanged")
    return 0


if __name__ == "__main__":
    sys.exit(main())
