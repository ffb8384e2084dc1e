"""Damaged and hostile input: always a typed error, never a crash, a hang or a huge allocation."""

import os
import struct

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import weightszip
from weightszip import _core, errors


def small_frame(real_kv) -> bytes:
    k = np.ascontiguousarray(real_kv[0, 0, :8, :64]).view(ml_dtypes.bfloat16)
    return weightszip.compress(k, chunk_bytes=512)


def test_every_truncation_is_a_typed_error(real_kv):
    blob = small_frame(real_kv)
    for cut in range(len(blob)):
        with pytest.raises(weightszip.WeightszipError):
            weightszip.decompress(blob[:cut])


def test_every_single_bit_flip_is_detected(real_kv):
    blob = small_frame(real_kv)
    assert len(blob) < 2000
    for bit in range(len(blob) * 8):
        bad = bytearray(blob)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(weightszip.WeightszipError):
            weightszip.decompress(bytes(bad))


def test_flip_in_a_chunk_is_a_checksum_mismatch(real_kv):
    blob = bytearray(small_frame(real_kv))
    blob[20] ^= 0x10  # inside the first chunk's payload (the preamble is 16 bytes)
    with pytest.raises(errors.ChecksumMismatchError):
        weightszip.decompress(bytes(blob))


def test_other_files_are_not_containers():
    for junk in [b"", b"\x89", b"\x89WZP"]:
        with pytest.raises(errors.TruncatedError):
            weightszip.decompress(junk)
    with pytest.raises(errors.BadMagicError):
        weightszip.decompress(b"PK\x03\x04" + bytes(60))
    with pytest.raises(errors.UnsupportedVersionError):
        weightszip.decompress(b"\x89WZP\r\n\x1a\n" + bytes(8))
    with pytest.raises(errors.BadMagicError):
        weightszip.decompress(bytes(100))


def test_newer_version_is_unsupported(real_kv):
    blob = bytearray(small_frame(real_kv))
    blob[8:10] = struct.pack("<H", 2)
    with pytest.raises(errors.UnsupportedVersionError):
        weightszip.decompress(bytes(blob))


def _reseal(blob: bytearray, index: bytes) -> bytes:
    """Rebuild a container around a modified index, with a correct index checksum: the checks
    after the checksum are what the hostile-input tests below must exercise."""
    (ilen,) = struct.unpack("<Q", blob[-24:-16])
    body = bytes(blob[: len(blob) - 24 - ilen])
    pre = np.frombuffer(body[:16] + index, np.uint8)
    sum_ = _core.xxh3_64(pre.ctypes.data, pre.nbytes)
    return body + index + struct.pack("<QQ", len(index), sum_) + b"WZPINDEX"


def _index(blob: bytes) -> bytearray:
    (ilen,) = struct.unpack("<Q", blob[-24:-16])
    return bytearray(blob[len(blob) - 24 - ilen : len(blob) - 24])


def test_declared_huge_shape_is_refused_before_allocating():
    blob = weightszip.compress(np.zeros((4, 4), np.float32))
    idx = _index(blob)
    # Entry layout: kind(1) reserved(3) count(4) | name_len(2) name(0) dtype layout profile flags
    # ndim axis | dims (8 each) ...
    dims_at = 8 + 2 + 4 + 2
    idx[dims_at : dims_at + 8] = struct.pack("<Q", 1 << 40)
    with pytest.raises((errors.CorruptDataError, errors.LimitExceededError)):
        weightszip.decompress(_reseal(bytearray(blob), bytes(idx)))


@pytest.mark.parametrize("dim", [1 << 63, (1 << 50) + 1, 1 << 50, 1 << 49])
def test_empty_tensor_with_a_huge_dimension_is_refused(dim):
    """An empty tensor ([0, 4]) whose other dimension is past the format's limit (``MAX_DIM``, 2^50;
    numpy and torch take less than 2^63), or within it but spanning more than 2^50 bytes of float32
    (numpy and torch size an empty array's strides from its other dimensions: [0, 2^50, 2^50] was
    their ValueError / RuntimeError): LimitExceededError when the index is read, not an error from
    numpy or torch when the tensor is allocated."""
    blob = weightszip.compress(np.zeros((0, 4), np.float32))
    idx = _index(blob)
    dims_at = 8 + 2 + 4 + 2  # (as above: the entry's first dimension; the second follows)
    idx[dims_at + 8 : dims_at + 16] = struct.pack("<Q", dim)
    bad = _reseal(bytearray(blob), bytes(idx))
    for read in (weightszip.info, weightszip.decompress, lambda b: weightszip.decompress(b, out="torch")):
        with pytest.raises(errors.LimitExceededError):
            read(bad)


def test_expansion_beyond_the_format_limit_is_refused():
    # A 64 MiB chunk of zeros is legal but highly compressed; shrink its stored length claim.
    blob = weightszip.compress(np.zeros(1 << 16, np.uint8), chunk_bytes=1 << 16)
    idx = _index(blob)
    at = len(idx) - 28 + 8  # stored_len of the only chunk
    idx[at : at + 4] = struct.pack("<I", 1)
    with pytest.raises((errors.LimitExceededError, errors.CorruptDataError)):
        weightszip.decompress(_reseal(bytearray(blob), bytes(idx)))


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=600))
def test_arbitrary_bytes_never_crash(b):
    try:
        weightszip.decompress(b)
    except weightszip.WeightszipError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_random_damage_to_a_real_frame_is_caught(real_kv, data):
    blob = bytearray(small_frame(real_kv))
    n = data.draw(st.integers(1, 8))
    for _ in range(n):
        i = data.draw(st.integers(0, len(blob) - 1))
        blob[i] = data.draw(st.integers(0, 255))
    try:
        out = weightszip.decompress(bytes(blob))
    except weightszip.WeightszipError:
        return
    # Only a no-op "damage" (same byte written back) may decode, and then it must be exact.
    assert out.tobytes() == np.ascontiguousarray(real_kv[0, 0, :8, :64]).tobytes()


def test_exception_hierarchy():
    assert len(errors.__all__) == 12
    for name in errors.__all__:
        cls = getattr(weightszip, name)
        assert cls is getattr(errors, name)
        assert issubclass(cls, weightszip.WeightszipError)
    assert issubclass(errors.TruncatedError, errors.CorruptDataError)
    assert issubclass(errors.ChecksumMismatchError, errors.CorruptDataError)
    assert issubclass(errors.UnsupportedFeatureError, errors.UnsupportedVersionError)
    assert issubclass(errors.OutputExistsError, errors.WeightszipIOError)


def test_missing_file_is_an_io_error(tmp_path):
    with pytest.raises(errors.WeightszipIOError):
        weightszip.load_file(tmp_path / "nope.wz")


def test_a_buffer_written_during_decoding_gives_typed_errors_only():
    """decompress releases the GIL; a caller's array written by another thread meanwhile may decode
    to anything or fail, but only with a WeightszipError (the chunk decoder checked its channel-group
    map in the caller's buffer and then read it again: 0.6% of such decodes were a Rust panic)."""
    import threading

    rng = np.random.default_rng(0)
    x = (rng.standard_normal((4096, 256)) * np.exp(rng.standard_normal(256) * 2)).astype(np.float32)
    blob = weightszip.compress(x, chunk_bytes=1 << 20)
    buf = np.frombuffer(blob, np.uint8).copy()
    orig = buf.copy()
    stop = threading.Event()

    def scribble():
        r = np.random.default_rng(1)
        while not stop.is_set():
            buf[16 : 16 + 4096] = orig[16 : 16 + 4096]
            buf[r.integers(16, 16 + 4096, 64)] = r.integers(0, 256, 64).astype(np.uint8)

    t = threading.Thread(target=scribble)
    t.start()
    other = []
    try:
        for _ in range(3000):
            try:
                weightszip.decompress(buf)
            except errors.WeightszipError:
                pass
            except BaseException as e:  # a Rust panic is pyo3's PanicException, a BaseException
                if isinstance(e, KeyboardInterrupt):
                    raise
                other.append(repr(e)[:200])
    finally:
        stop.set()
        t.join()
    assert other == []


def test_the_file_api_raises_typed_errors_for_ordinary_bad_input(tmp_path, monkeypatch):
    """Each was an untyped error (FileNotFoundError, UnicodeEncodeError, OverflowError, ValueError; a
    lone surrogate in an output path was a Rust panic), which `except WeightszipError` missed."""
    x = np.zeros(3, np.float32)
    missing = tmp_path / "nosuch"
    with pytest.raises(errors.WeightszipIOError, match=f"{missing}: No such file"):
        weightszip.compress_file(missing, tmp_path / "x.wz")
    with pytest.raises(errors.WeightszipIOError, match=f"{missing}: No such file"):
        weightszip.decompress_file(missing, tmp_path / "x")
    with pytest.raises(errors.InvalidArgumentError, match="surrogate"):
        weightszip.save_file({"\ud800": x}, tmp_path / "s.wz")
    for bad_path in ("\ud800.wz", "a\0b"):
        with pytest.raises(errors.InvalidArgumentError):
            weightszip.save_file({"x": x}, tmp_path / bad_path)
        (tmp_path / "f.bin").write_bytes(b"hello")
        with pytest.raises(errors.InvalidArgumentError):
            weightszip.compress_file(tmp_path / "f.bin", tmp_path / bad_path)
        with pytest.raises(errors.InvalidArgumentError):
            weightszip.compress_file(tmp_path / bad_path, tmp_path / "f.wz")
    for chunk in (-1, 2**64):
        with pytest.raises(errors.InvalidArgumentError, match="chunk_bytes"):
            weightszip.compress(x, chunk_bytes=chunk)
        with pytest.raises(errors.InvalidArgumentError, match="chunk_bytes"):
            weightszip.save_file({"x": x}, tmp_path / "s.wz", chunk_bytes=chunk)
        with pytest.raises(errors.InvalidArgumentError, match="chunk_bytes"):
            weightszip.compress_file(tmp_path / "f.bin", tmp_path / "f.wz", chunk_bytes=chunk)
    monkeypatch.setenv("WEIGHTSZIP_THREADS", "abc")
    with pytest.raises(errors.InvalidArgumentError, match="WEIGHTSZIP_THREADS='abc' is not an integer"):
        weightszip.compress(x)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.bin"]


def test_load_file_reads_one_version_of_a_file_replaced_while_it_loads(tmp_path, monkeypatch):
    """``load_file`` opened the file again for every tensor (and twice per tensor), so a checkpoint
    published over it meanwhile (write then rename, as every writer here does) gave a dict mixing
    both versions, or a checksum error on a healthy file. The core now reads the index and every
    tensor through one open file: the version that was there when the load began."""
    from weightszip import _tensors

    path, newer = tmp_path / "model.wz", tmp_path / "newer.wz"
    names = [f"t{i}" for i in range(4)]
    weightszip.save_file({n: np.zeros(1000, np.float32) for n in names}, path)
    weightszip.save_file({n: np.ones(1000, np.float32) for n in names}, newer)
    real, calls = _tensors.empty_like_entry, []

    def allocate_then_publish(entry, out):  # the newer version replaces the file as the first tensor is allocated
        if not calls:
            os.replace(newer, path)
        calls.append(entry["name"])
        return real(entry, out)

    monkeypatch.setattr(_tensors, "empty_like_entry", allocate_then_publish)
    got = weightszip.load_file(path)
    assert calls == names and sorted(got) == names
    assert all(not got[n].any() for n in names), {n: float(got[n][0]) for n in names}
    monkeypatch.undo()
    assert all(weightszip.load_file(path)[n].all() for n in names)  # (the newer version, now)


def test_decompress_writes_one_version_of_a_tensor_archive_replaced_while_it_reads(tmp_path, monkeypatch):
    """A tensor archive decompresses to .safetensors as a header built from its index, then the
    entries' bytes. The header came from an index read before the core opened the file to decode:
    an archive published over it in between gave one version's header over the other's data (here
    names and sizes that do not match the bytes). The header is now built from the index of the
    file the core decodes."""
    from safetensors.numpy import load_file as load_safetensors

    from weightszip import files

    path, newer, out = tmp_path / "model.wz", tmp_path / "newer.wz", tmp_path / "model.safetensors"
    weightszip.save_file({"a": np.arange(1000, dtype=np.float32), "b": np.zeros(10, np.int64)}, path)
    weightszip.save_file({"c": np.ones(3000, np.float16)}, newer)
    real, calls = files._safetensors_header, []

    def header_then_publish(index):
        calls.append([e["name"] for e in index["entries"]])
        if len(calls) == 1:
            os.replace(newer, path)
        return real(index)

    monkeypatch.setattr(files, "_safetensors_header", header_then_publish)
    files.decompress_file(path, out)
    got = load_safetensors(str(out))
    assert calls == [["a", "b"]] and sorted(got) == ["a", "b"], (calls, sorted(got))
    assert np.array_equal(got["a"], np.arange(1000, dtype=np.float32)) and not got["b"].any()
