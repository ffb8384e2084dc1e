"""Hostile inputs found by an audit of the Python-facing decoders (session 20): each is a typed
error (weightszip.errors, or the compact formats' CalibrationError / CompactCodecError), never an
untyped exception, an allocation the input's bytes cannot justify, or a silently wrong result."""

import json
import os
import resource
import struct
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import weightszip  # noqa: E402
from weightszip import errors, kv_exact, pages, store  # noqa: E402
from weightszip.kernels import kv_exact4_ref as ref4  # noqa: E402
from weightszip.kernels import kv_exact_ref as ref  # noqa: E402

from test_robustness import _index, _reseal  # noqa: E402


def _more_address_space(extra: int):
    """The process's address space limited to what it uses now plus ``extra`` bytes, for the test's
    body (a generator for the fixtures below)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        used = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
    resource.setrlimit(resource.RLIMIT_AS, (used + extra, hard))
    yield
    resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


@pytest.fixture
def small_address_space():
    """At most 2 GiB more address space for the test's body: an output sized from hostile offsets
    would fail with MemoryError instead of the typed error the decoders must raise first."""
    yield from _more_address_space(2 << 30)


def _exact4_pages(n=2, h=1, d=32):
    v = torch.randn(n, 16, h, d).to(torch.bfloat16)
    buf, offs = kv_exact.cpu_encode_exact4_pages(v)
    return buf, offs


def test_page_offsets_that_cannot_be_pages_are_refused_before_allocating(small_address_space):
    # 10**5 empty pages of 256 x 256 channels would be a 195 GiB output
    many = np.zeros(10**5, np.int64)
    with pytest.raises(errors.TruncatedError):
        kv_exact.cpu_decode_exact4_pages(b"", many, 256, 256)
    with pytest.raises(errors.TruncatedError):
        kv_exact.cpu_decode_pages(b"", many, np.zeros(256 * 256, np.uint8), 256, 256)
    # offsets that run from 0 to the end, one page too short: the first short page, named
    buf, offs = _exact4_pages(3)
    bad = offs.copy()
    bad[1] = 8
    with pytest.raises(errors.TruncatedError, match="page 0"):
        kv_exact.cpu_decode_exact4_pages(buf, bad, 1, 32)
    with pytest.raises(errors.TruncatedError, match="page 0"):  # the reference, for the same input
        ref4.decode_pages(torch.frombuffer(bytearray(buf), dtype=torch.uint8), torch.from_numpy(bad), 1, 32)
    down = offs.copy()
    down[1], down[2] = down[2], down[1]
    with pytest.raises(errors.CorruptDataError):
        kv_exact.cpu_decode_exact4_pages(buf, down, 1, 32)


def test_page_offsets_must_be_one_dimensional_integers():
    buf, offs = _exact4_pages(2)
    for bad in (offs.reshape(1, -1), offs.astype(np.float64), np.zeros(0, np.int64)):
        with pytest.raises(errors.InvalidArgumentError):
            kv_exact.cpu_decode_exact4_pages(buf, bad, 1, 32)
    x = np.zeros((16, 32), np.uint16)
    cb = pages.calibrate(x)
    pbuf, poffs = pages.encode_pages(cb, x[None])
    with pytest.raises(errors.InvalidArgumentError):
        pages.decode_pages(cb, pbuf, np.asarray(poffs).reshape(1, -1))


def test_exact_page_profile_offsets_negative_huge_or_too_many(small_address_space):
    x = np.zeros((16, 32), np.uint16)
    cb = pages.calibrate(x)
    buf, offs = pages.encode_pages(cb, x[None])
    for bad in ([0, -8, len(buf)], [0, 1 << 63, len(buf)], [0, len(buf) + 1]):
        with pytest.raises(errors.CorruptDataError):
            pages.decode_pages(cb, buf, np.asarray(bad, dtype=np.uint64 if bad[1] >= 1 << 63 else np.int64))
    # a million pages claimed over one page's bytes: the second page cannot be one
    many = np.full(10**6 + 1, len(buf), np.int64)
    many[0] = 0
    with pytest.raises(errors.TruncatedError):
        pages.decode_pages(cb, buf, many)
    assert (pages.decode_pages(cb, buf, offs) == x[None]).all()


def test_kv_exact_reference_checks_its_arguments():
    v = torch.zeros((1, 16, 1, 32), dtype=torch.int16)
    bases = torch.full((32,), 127, dtype=torch.uint8)
    enc = ref.encode_pages(v, bases.reshape(1, 32))
    buf, offs = enc.to_bytes()
    for bad_bases in (bases[:16], bases.numpy(), bases.to(torch.int32)):
        with pytest.raises(errors.InvalidArgumentError):
            ref.decode_pages(buf, offs, bad_bases, 1, 32)
        with pytest.raises(errors.InvalidArgumentError):
            ref.encode_pages(v, bad_bases)
    with pytest.raises(errors.InvalidArgumentError):
        ref.decode_pages(buf.numpy(), offs, bases, 1, 32)
    with pytest.raises(errors.InvalidArgumentError):
        ref.decode_pages(buf, offs.numpy(), bases, 1, 32)
    assert torch.equal(ref.decode_pages(buf, offs, bases, 1, 32), v)


def _calibration():
    from test_compact import _small_calibration

    return _small_calibration(layers=1)


def test_head_tables_refuse_the_most_negative_int64_and_levels_outside_one():
    from weightszip.compact import codec as cc

    tb = _calibration().tables(0, "v", 4)[0]
    fields = dict(tb.__dict__)
    mu = tb.mu.clone()
    mu[0] = -(2**63)  # abs() of it is itself: negative, so |mu| <= 2**37 held
    with pytest.raises(cc.CompactCodecError, match="mu"):
        cc.HeadTables(**{**fields, "mu": mu})
    rope_m = torch.zeros_like(tb.mu)
    rope_m[0] = -(2**63)
    with pytest.raises(cc.CompactCodecError, match="rope_m"):
        cc.HeadTables(**{**fields, "rope_m": rope_m, "rope_phase": torch.zeros(tb.mu.shape[0] // 2, dtype=torch.int64)})
    for last in (float("inf"), 1.5):
        cb = tb.codebook.clone()
        cb[-1] = last
        with pytest.raises(cc.CompactCodecError, match=r"\[-1, 1\]"):
            cc.HeadTables(**{**fields, "codebook": cb})


def test_calibration_files_with_malformed_metadata_or_tables(tmp_path):
    from weightszip.compact.calibrate import Calibration, CalibrationError

    cal = _calibration()
    path = tmp_path / "c.wzcal"
    cal.save(path)
    t0 = weightszip.load_file(path)
    meta = json.loads(bytes(t0["meta"]).decode())

    def load_with(raw_meta=None, **tables):
        t = {**t0, **tables}
        if raw_meta is not None:
            t["meta"] = np.frombuffer(raw_meta.encode(), np.uint8).copy()
        weightszip.save_file(t, tmp_path / "x.wzcal")
        return Calibration.load(tmp_path / "x.wzcal")

    mu_nan = t0["mu"].astype(np.float64)
    mu_nan[0, 0, 0, 0] = np.nan  # a cast to int64 would hide it (the most negative int64)
    cb_inf = t0["codebook_4"].copy()
    cb_inf[..., -1] = np.inf
    for raw, tables in (("[]", {}), (json.dumps(meta).replace('"layers": 1', '"layers": Infinity'), {}),
                        (json.dumps({**meta, "allocation": []}), {}), (None, {"mu": mu_nan}),
                        (None, {"codebook_4": cb_inf})):
        with pytest.raises(CalibrationError):
            load_with(raw, **tables)
    assert load_with().allocation == cal.allocation
    # session 37: metadata nested past Python's recursion limit (RecursionError), allocation widths
    # that int() took ("44" read as [4, 4], 4.9 as 4, an object as its keys), meta stored as another
    # dtype (cast to bytes silently)
    widths = meta["allocation"]["q4"]
    for alloc in ({"q4": ["44"] * len(widths)}, {"q4": [[4.9, 3.2]] * len(widths)}, {"q4": [{"4": 1, "3": 1}] * len(widths)},
                  {"q4": "44"}):
        with pytest.raises(CalibrationError, match="allocation"):
            load_with(json.dumps({**meta, "allocation": alloc}))
    with pytest.raises(CalibrationError, match="metadata"):
        load_with("[" * 100000 + "]" * 100000)
    for dtype in (np.int64, np.float32):
        with pytest.raises(CalibrationError, match="metadata"):
            load_with(None, meta=t0["meta"].astype(dtype))


def test_a_calibration_that_load_would_refuse_is_not_saved(tmp_path):
    import copy

    from weightszip.compact.calibrate import CalibrationError

    cal = _calibration()
    for spoil in (lambda c: c.mult.zero_(), lambda c: setattr(c, "sink_tokens", -5),
                  lambda c: setattr(c, "mu", c.mu.to(torch.int32))):
        bad = copy.deepcopy(cal)
        spoil(bad)
        with pytest.raises(CalibrationError):
            bad.save(tmp_path / "bad.wzcal")
        assert not (tmp_path / "bad.wzcal").exists()
    cal.allocation = {k: [[np.int64(b) for b in lk] for lk in v] for k, v in cal.allocation.items()}
    cal.save(tmp_path / "ok.wzcal")  # numpy widths are written as the numbers they are


def test_compact_codec_needs_the_format_in_the_calibration():
    from weightszip.integrations.compact_chunks import CompactChunkCodec

    cal = _calibration()
    cal.allocation = {"q4": cal.allocation["q4"]}
    CompactChunkCodec(cal, "q4")
    with pytest.raises(errors.InvalidArgumentError, match="q3"):
        CompactChunkCodec(cal, "q3")


def test_decompress_file_refuses_names_a_safetensors_file_cannot_hold(tmp_path):
    src = tmp_path / "a.wz"
    weightszip.save_file({"a": np.arange(4, dtype=np.int32), "b": np.arange(3, dtype=np.int32)}, src)
    blob = bytearray(src.read_bytes())
    idx = _index(bytes(blob))
    at = bytes(idx).find(b"\x01\x00b")  # entry 1's name: length 1, "b"
    assert at > 0
    idx[at + 2] = ord("a")
    src.write_bytes(_reseal(blob, bytes(idx)))
    dst = tmp_path / "a.safetensors"
    with pytest.raises(errors.InvalidArgumentError, match="twice"):
        weightszip.decompress_file(src, dst)
    assert not dst.exists()
    weightszip.verify_file(src)  # a valid container (names need not be unique) ...
    with pytest.raises(errors.InvalidArgumentError, match="twice"):  # ... that no dict holds whole
        weightszip.load_file(src)


def test_compact_errors_are_weightszip_errors(tmp_path):
    """The compact formats' errors are WeightszipErrors (one ``except`` catches every failure of the
    package; the CLI reports them as it does the codec's) and still ValueErrors."""
    from weightszip.compact.calibrate import Calibration, CalibrationError
    from weightszip.compact.codec import CompactCodecError, page_bytes
    from weightszip.errors import WeightszipError

    for cls in (CalibrationError, CompactCodecError):
        assert issubclass(cls, WeightszipError) and issubclass(cls, ValueError)
    junk = tmp_path / "junk.wzcal"
    junk.write_bytes(b"not a calibration")
    with pytest.raises(WeightszipError):
        Calibration.load(junk)
    with pytest.raises(WeightszipError):
        page_bytes(4, 100)  # head_dim not a power of two


def _safetensors_bytes(header, data: bytes) -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("<Q", len(h)) + h + data


@pytest.mark.parametrize(
    "raw",
    [
        # tensor entries the container cannot hold, or that are not sizes: the bytes stay bytes
        _safetensors_bytes({"x": {"dtype": "F32", "shape": [-1, -2], "data_offsets": [0, 8]}}, bytes(8)),
        _safetensors_bytes({"x": {"dtype": "F32", "shape": [[2]], "data_offsets": [0, 8]}}, bytes(8)),
        _safetensors_bytes({"x": {"dtype": ["F32"], "shape": [2], "data_offsets": [0, 8]}}, bytes(8)),
        _safetensors_bytes({"x": {"dtype": "F32", "shape": [1] * 40000, "data_offsets": [0, 4]}}, bytes(4)),
        _safetensors_bytes({"x": {"dtype": "F32", "shape": [1] * 17, "data_offsets": [0, 4]}}, bytes(4)),
        _safetensors_bytes({"x" * 5000: {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)),
        _safetensors_bytes({"\ud800": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)),
        struct.pack("<Q", 100000) + b"[" * 100000,  # JSON nested past Python's recursion limit
        # a .npy whose shape's product wraps around 2**64 to 4 elements
        b"\x93NUMPY\x01\x00" + struct.pack("<H", 117)
        + b"{'descr': '<f4', 'fortran_order': False, 'shape': (4611686018427387905, 4), }".ljust(116) + b"\n"
        + bytes(16),
        # .npy headers numpy's own parser fails on with other errors than ValueError: an unclosed
        # tuple (tokenize.TokenError), a descr that is not a dtype string (SyntaxError), bytes keys
        # beside str ones (TypeError)
        b"\x93NUMPY\x01\x00" + struct.pack("<H", 118)
        + b"{'descr': '<f4', 'fortran_order': False, 'shape': (4, ".ljust(117) + b"\n" + bytes(16),
        b"\x93NUMPY\x01\x00" + struct.pack("<H", 118)
        + b"{'descr': ',<f4', 'fortran_order': False, 'shape': (4,), }".ljust(117) + b"\n" + bytes(16),
        b"\x93NUMPY\x01\x00" + struct.pack("<H", 118)
        + b"{b'descr': '<f4', 'fortran_order': False, 'shape': (4,), }".ljust(117) + b"\n" + bytes(16),
    ],
    ids=["negative-dims", "nested-dims", "list-dtype", "40000-dims", "17-dims", "long-name", "surrogate-name",
         "deep-json", "npy-wrapping-shape", "npy-unclosed-tuple", "npy-bad-descr", "npy-bytes-key"],
)
def test_compress_file_codes_malformed_tensor_headers_as_bytes(tmp_path, raw):
    """Any file compresses (and comes back byte for byte): a header entry that is not a tensor the
    container can hold leaves its bytes as bytes, never an untyped error or a refusal."""
    src, wz, back = tmp_path / "m.safetensors", tmp_path / "m.wz", tmp_path / "back"
    src.write_bytes(raw)
    weightszip.compress_file(src, wz)
    weightszip.decompress_file(wz, back)
    assert back.read_bytes() == raw


def _gguf_string(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


_HOSTILE_GGUF = {
    "magic only": b"GGUF",
    "2**63 metadata entries": b"GGUF" + struct.pack("<IQQ", 3, 0, 2**63),
    "a key of 2**63 bytes": b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 2**63) + b"xx",
    "an array of 2**62 values": b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + _gguf_string(b"general.architecture")
    + struct.pack("<IIQ", 9, 4, 2**62) + bytes(16),
    "2**40 tensors of 2**32-1 dimensions": b"GGUF" + struct.pack("<IQQ", 3, 2**40, 1)
    + _gguf_string(b"general.architecture") + struct.pack("<I", 8) + _gguf_string(b"llama") + _gguf_string(b"t")
    + struct.pack("<I", 2**32 - 1) + bytes(8),
}


@pytest.mark.parametrize("name", list(_HOSTILE_GGUF))
def test_hostile_gguf_model_files_are_typed_errors(name, tmp_path, monkeypatch, capsys):
    # (a struct.error traceback from the GGUF reader in kv dump, calibrate, eval kl and eval niah)
    pytest.importorskip("transformers")
    from weightszip.cli import main
    from weightszip.models import ModelFileError, load_causal_lm

    monkeypatch.setenv("WEIGHTSZIP_CACHE", str(tmp_path / "cache"))
    p = tmp_path / "m.gguf"
    p.write_bytes(_HOSTILE_GGUF[name])
    with pytest.raises(ModelFileError, match="cannot read this GGUF file") as e:
        load_causal_lm(p, verbose=False)
    assert isinstance(e.value, errors.CorruptDataError) and "\n" not in str(e.value)
    text = tmp_path / "t.txt"
    text.write_text("hello " * 50)
    assert main(["kv", "dump", "--model", str(p), "--text", str(text), "--tokens", "8", "-o", str(tmp_path / "o.wz")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("weightszip: error:") and len(err.strip().splitlines()) == 1 and "Traceback" not in err


def test_page_decoders_refuse_a_buffer_written_while_they_read_it():
    """The page and KV Exact4 decoders run with the GIL released on the caller's live array: a
    header bit toggled by another thread between a decoder's check and its use of that header is a
    typed error or a decode, never a Rust panic (``PanicException`` is not an ``Exception``). Before
    the fix, here, some of either's 2000 decodes panicked."""
    import threading

    C = 512
    rng = np.random.default_rng(0)
    vals = (rng.standard_normal((4, 16, C)).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    cb = pages.calibrate(vals.reshape(-1, C), max_len=8)
    buf, offs = pages.encode_pages(cb, vals, align=8)
    src = np.frombuffer(buf, np.uint8).copy()
    last = 2 * (C // 32 - 1)  # the last stream's word count in page 0's header
    H, D = 4, 64
    buf4, offs4 = kv_exact.cpu_encode_exact4_pages(np.full((8, 16, H, D), 0x3F80, np.uint16))  # all 1.0
    src4 = np.frombuffer(buf4, np.uint8).copy()
    mask = int(offs4[-2]) + 4 * (H - 1)  # the last page's plain-row mask of its last head
    stop = threading.Event()

    def toggle():
        while not stop.is_set():
            src[last] ^= 0x40
            src4[mask] ^= 0x01

    outcomes = {}
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # the decoder back to the GIL at once, not after the toggler's 5 ms
    t = threading.Thread(target=toggle)
    t.start()
    try:
        for name, decode in (("pages", lambda: pages.decode_pages(cb, src, offs)),
                             ("exact4", lambda: kv_exact.cpu_decode_exact4_pages(src4, offs4, H, D))):
            for _ in range(2000):
                try:
                    decode()
                    kind = "decoded"
                except errors.WeightszipError as e:
                    kind = type(e).__name__
                except BaseException as e:  # noqa: BLE001 - a panic is what this test looks for
                    pytest.fail(f"{name}: {type(e).__name__}: {e}")
                outcomes[name, kind] = outcomes.get((name, kind), 0) + 1
    finally:
        stop.set()
        t.join()
        sys.setswitchinterval(switch)
    assert any(k == "decoded" for _, k in outcomes) and any(k != "decoded" for _, k in outcomes), outcomes


def test_kv_exact_calibration_refuses_more_channels_than_pages_hold():
    """2 KiB of histogram per channel: 8 MiB of samples as one row of 2^22 channels asked the Rust
    calibrator for 8 GiB and aborted the process; more than 65536 channels (the pages' limit) is now
    refused first, by the wrapper and by the Rust function."""
    with pytest.raises(errors.LimitExceededError, match="channels"):
        kv_exact.cpu_calibrate_bases(np.zeros((1, (1 << 16) + 1), np.uint16))
    from weightszip import _core

    a = np.zeros((1, (1 << 16) + 1), np.uint16)
    with pytest.raises(errors.LimitExceededError, match="channels"):
        _core.kvx_calibrate(a.shape[1], a.ctypes.data, a.nbytes)
    assert kv_exact.cpu_calibrate_bases(np.zeros((2, 1 << 16), np.uint16)).shape == (1 << 16,)


def test_torch_views_with_a_lazy_negation_round_trip_their_values():
    """``c.conj().imag`` is a view whose negation is a flag beside the storage; contiguous() keeps
    the flag, so the stored bytes were the un-negated values (the round trip came back negated)."""
    torch = pytest.importorskip("torch")
    x = torch.tensor([0.25 + 0.75j], dtype=torch.complex64).conj().imag
    assert x.is_neg() and x.is_contiguous()
    assert torch.equal(weightszip.decompress(weightszip.compress(x)), x)
    w = torch.tensor([[1.5 - 2j, -3 + 0.5j]] * 16, dtype=torch.complex64).conj().imag.to(torch.bfloat16)
    assert torch.equal(weightszip.decompress(weightszip.compress(w)), w)


def test_bit_pattern_inputs_and_integer_arguments_are_checked_before_rust():
    """torch tensors that are not 16-bit were viewed as int16 (float32: twice the channels, pages that
    later read as corrupt) where numpy arrays were refused; integers outside the Rust argument's
    type were OverflowError, a strided memoryview BufferError: all InvalidArgumentError now."""
    torch = pytest.importorskip("torch")
    f32 = torch.randn(64, 64)
    for call in (lambda: pages.calibrate(f32), lambda: kv_exact.cpu_calibrate_bases(f32),
                 lambda: kv_exact.cpu_encode_exact4_pages(torch.randn(2, 16, 2, 64)),
                 lambda: pages.calibrate(np.zeros((64, 64), np.uint16), max_len=300),
                 lambda: pages.calibrate(np.zeros((64, 64), np.uint16), max_len=-1),
                 lambda: pages.encode_pages(pages.calibrate(np.zeros((16, 32), np.uint16)),
                                            np.zeros((1, 16, 32), np.uint16), align=-8),
                 lambda: weightszip.compress(np.zeros(8, np.float32), lanes_log2=-1),
                 lambda: weightszip.compress(np.zeros(8, np.float32), lanes_log2=2**40),
                 lambda: weightszip.decompress(memoryview(weightszip.compress(np.zeros(8)))[::2]),
                 lambda: weightszip.info(memoryview(b"abcdef")[::2])):
        with pytest.raises(errors.InvalidArgumentError):
            call()
    bf = torch.randn(64, 64).to(torch.bfloat16)  # 16-bit torch input is still taken as its bits
    assert pages.calibrate(bf) == pages.calibrate(bf.view(torch.int16).numpy().view(np.uint16))


def _zero_bomb(n_chunks: int, chunk: int = 1 << 20) -> bytes:
    """A valid container of named tensors (checksums right, `info` and `verify` accept it): one uint8
    tensor of n_chunks * chunk zeros, its chunks all one chunk's payload (about 320 bytes for 1 MiB
    of zeros), so that a file of n_chunks * 350 bytes declares n_chunks MiB."""
    d = weightszip.compress(np.zeros(chunk, np.uint8), chunk_bytes=chunk)
    idx = bytes(_index(d))
    off, stored_len, stored_sum, raw_sum = struct.unpack("<QIQQ", idx[-28:])  # (the only chunk's record)
    payload = d[off: off + stored_len]
    body, records = bytearray(d[:16]), []
    for _ in range(n_chunks):
        records.append(struct.pack("<QIQQ", len(body), stored_len, stored_sum, raw_sum))
        body += payload
    # kind 0, 1 entry: name "a", uint8, tensor layout, profile, flags 0, 1 dim, axis 0; shape, chunk_elems, chunks
    index = struct.pack("<B3xIH", 0, 1, 1) + b"a" + bytes([0, 0, 1, 0, 1, 0]) + struct.pack("<QQI", n_chunks * chunk,
                                                                                              chunk, n_chunks)
    index += b"".join(records)
    pre = np.frombuffer(bytes(body[:16]) + index, np.uint8)
    sum_ = weightszip._core.xxh3_64(pre.ctypes.data, pre.nbytes)
    return bytes(body) + index + struct.pack("<QQ", len(index), sum_) + b"WZPINDEX"


@pytest.fixture
def tight_address_space():
    """At most 64 MiB more address space: a decoder that holds a whole 128 MiB tensor fails."""
    yield from _more_address_space(64 << 20)


def test_a_tensor_archive_decompresses_with_bounded_memory(tmp_path, tight_address_space):
    """A 40 kB archive of one 128 MiB tensor of zeros: `decompress` decoded each whole tensor into
    memory (a 1.6 MB file asked for 31 GiB: a MemoryError traceback); it now streams it to the
    .safetensors file as file containers are, within 64 MiB of address space."""
    src = tmp_path / "bomb.wz"
    src.write_bytes(_zero_bomb(128))
    assert weightszip.file_info(src)["entries"][0]["raw_bytes"] == 128 << 20
    dst = tmp_path / "bomb.safetensors"
    weightszip.decompress_file(src, dst, threads=1)
    with open(dst, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        assert json.loads(f.read(n))["a"] == {"dtype": "U8", "shape": [128 << 20], "data_offsets": [0, 128 << 20]}
    assert dst.stat().st_size == 8 + n + (128 << 20)


@pytest.mark.parametrize("out", ["numpy", "torch"])
def test_a_tensor_too_large_for_memory_is_a_limit_error(tmp_path, small_address_space, out):
    """load_file (and decompress) of a tensor that cannot be allocated: LimitExceededError, not numpy's
    MemoryError (or torch's RuntimeError)."""
    src = tmp_path / "bomb.wz"
    src.write_bytes(_zero_bomb(4096))  # 4 GiB declared, 1.4 MB stored
    with pytest.raises(errors.LimitExceededError, match="'a': 4294967296 bytes do not fit in memory"):
        weightszip.load_file(src, out=out)
    with pytest.raises(errors.LimitExceededError, match="do not fit in memory"):
        weightszip.decompress(src.read_bytes(), out=out)


# -- session 37's audit of the public API (arguments of the wrong kind, views, outputs) ----------


def test_arguments_of_the_wrong_kind_are_typed_errors(tmp_path):
    """Each was a TypeError or OverflowError out of the Rust conversion (or, for ``layout``, a
    container no reader accepts: tags 3-255 were written, then refused by every decoder)."""
    x = np.zeros((4, 4), np.float32)
    calls = [lambda v=v: weightszip.compress(x, layout=v) for v in (3, 255, 256, -1, "x", True)]
    calls += [lambda v=v: weightszip.compress(x, axis=v) for v in (None, "0", 1.5, True)]
    calls += [lambda v=v: weightszip.compress(x, threads=v) for v in ("2", 1.5, -1, True)]
    blob = weightszip.compress(x)
    calls += [lambda v=v: weightszip.decompress(blob, threads=v) for v in ("2", 1.5)]
    calls += [lambda v=v: weightszip.save_file({"a": x}, tmp_path / "o.wz", overwrite=v) for v in ("no", 0, None)]
    calls += [lambda: weightszip.save_file({"a": x}, tmp_path / "o.wz", axis="0")]
    calls += [lambda: store.ChunkStore(None, redis_url=5), lambda: store.ChunkStore(None, redis_prefix=None)]
    for call in calls:
        with pytest.raises(errors.InvalidArgumentError):
            call()
    assert not (tmp_path / "o.wz").exists()
    for layout in (0, 1, 2):  # the defined tags still write, and read back
        assert (weightszip.decompress(weightszip.compress(x, layout=layout)) == x).all()
    with store.ChunkStore(os.fsencode(tmp_path / "st")) as s:  # bytes, as its check says
        s.put("k", b"v")
        assert s.get("k") == b"v"


def test_page_codec_arguments_of_the_wrong_kind_are_typed_errors():
    v = np.arange(1, 64 * 64 + 1, dtype=np.uint16).reshape(4, 16, 2, 32)
    buf, offs = kv_exact.cpu_encode_exact4_pages(v)
    cb = pages.calibrate(v.reshape(64, 64))
    pbuf, poffs = pages.encode_pages(cb, v.reshape(4, 16, 64))
    for call in (lambda: kv_exact.cpu_decode_exact4_pages(buf, offs, 1.5, 32),
                 lambda: kv_exact.cpu_decode_exact4_pages(buf, offs, "2", 32),
                 lambda: kv_exact.cpu_decode_exact4_pages(buf, offs, 2, None),
                 lambda: pages.decode_pages(None, pbuf, poffs), lambda: pages.decode_pages("abc", pbuf, poffs)):
        with pytest.raises(errors.InvalidArgumentError):
            call()


def test_page_codecs_take_16_bit_values_in_either_byte_order():
    """``>u2`` holds the same numbers as ``u2`` in the other byte order: the page codecs read its
    bytes as native before, so every value came back byte-swapped, silently."""
    v = np.arange(1, 64 * 64 + 1, dtype=np.uint16).reshape(4, 16, 2, 32)
    big = v.astype(">u2")
    cb = pages.calibrate(v.reshape(64, 64))
    assert pages.calibrate(big.reshape(64, 64)) == cb
    pbuf, poffs = pages.encode_pages(cb, big.reshape(4, 16, 64))
    assert (pages.decode_pages(cb, pbuf, poffs) == v.reshape(4, 16, 64)).all()
    assert (kv_exact.cpu_decode_exact4_pages(*kv_exact.cpu_encode_exact4_pages(big), 2, 32) == v).all()
    bases = kv_exact.cpu_calibrate_bases(v.reshape(64, 64).view(np.int16))
    assert (kv_exact.cpu_decode_pages(*kv_exact.cpu_encode_pages(big, bases), bases, 2, 32) == v).all()


def test_views_larger_than_the_format_are_limit_errors_before_any_copy():
    """A broadcast or expanded view is copied to contiguous memory before coding: one of 4 PiB was
    numpy's MemoryError or torch's RuntimeError from the attempt."""
    with pytest.raises(errors.LimitExceededError, match="limit"):
        weightszip.compress(np.broadcast_to(np.float32(1), (2**25, 2**25)))
    with pytest.raises(errors.LimitExceededError, match="limit"):
        weightszip.compress(torch.ones(1, 1).expand(2**25, 2**25))


def test_a_view_that_does_not_fit_in_memory_is_a_limit_error(small_address_space):
    """Under the format's limit but over the memory there is (2 GiB more address space here)."""
    with pytest.raises(errors.LimitExceededError, match="memory"):
        weightszip.compress(np.broadcast_to(np.float32(1), (2**16, 2**16)))  # 16 GiB contiguous
    with pytest.raises(errors.LimitExceededError, match="memory"):
        weightszip.compress(torch.ones(1, 1).expand(2**16, 2**16))


def test_meta_and_sparse_tensors_are_typed_errors():
    for t in (torch.empty(4, device="meta"), torch.eye(3).to_sparse()):
        with pytest.raises(errors.InvalidArgumentError, match="dense"):
            weightszip.compress(t)


def test_an_output_that_is_a_fifo_is_refused_not_replaced(tmp_path):
    """The writers put a new file in place by a rename: a FIFO or device (``-o /dev/null`` as root)
    was replaced by a regular file. Now refused, with overwrite and with --force."""
    import stat

    from weightszip.cli import main as cli

    src = tmp_path / "a.bin"
    src.write_bytes(b"abc" * 100)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for call in (lambda: weightszip.compress_file(src, fifo),
                 lambda: weightszip.save_file({"a": np.zeros(3)}, fifo),
                 lambda: weightszip.decompress_file(tmp_path / "a.wz", fifo)):
        if not (tmp_path / "a.wz").exists():
            weightszip.compress_file(src, tmp_path / "a.wz")
        with pytest.raises(errors.InvalidArgumentError, match="not a regular file"):
            call()
    assert cli(["compress", str(src), "-o", str(fifo), "--force", "-q"]) == 1
    assert stat.S_ISFIFO(os.stat(fifo).st_mode)


def test_a_model_config_nested_past_the_recursion_limit_is_a_capacity_error(tmp_path):
    from weightszip.eval.capacity import CapacityError, load_config

    (tmp_path / "config.json").write_text("[" * 100000 + "]" * 100000)
    with pytest.raises(CapacityError, match="not valid JSON"):
        load_config(str(tmp_path))


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU says")
def test_cuda_objects_without_a_gpu_are_typed_errors():
    """A page heap or KV Exact cache on "cuda" (their default) and a pinned arena were torch's
    RuntimeError ("Found no NVIDIA driver") on a machine without a GPU."""
    from weightszip.offload import HostArena

    for make in (lambda: kv_exact.PageHeap(64), lambda: HostArena(8, pin=True),
                 lambda: kv_exact.KVExactCache(layers=1, kv_heads=1, head_dim=32, num_q_heads=1, heap_bytes=1 << 16,
                                               max_seqs=1, max_tokens=64)):
        with pytest.raises(errors.UnsupportedFeatureError, match="CUDA"):
            make()


def test_unknown_or_unavailable_kv_formats_are_weightszip_errors():
    from weightszip.eval.formats import FormatUnavailable, get_format

    with pytest.raises(errors.InvalidArgumentError, match="unknown KV format 'nope'") as e:
        get_format("nope")
    assert isinstance(e.value, KeyError)  # (as before: callers catching KeyError still do)
    assert issubclass(FormatUnavailable, errors.WeightszipError) and issubclass(FormatUnavailable, RuntimeError)


def test_compact_codec_inputs_out_of_range_are_refused_not_coded():
    """Zero tokens crashed the decoder (numpy's ``max(initial=)`` on a torch tensor), ``block < 1``
    handed back unwritten memory as codes, and pack_page stored codes -12 and scale index 300 as 4
    and 44, and widths or head_dims no page has as bytes unpack_page refuses."""
    from weightszip.compact import codec as cc

    cal = _calibration()
    tabs = cal.tables(0, "v", 4)
    h, d = cal.kv_heads, cal.head_dim
    assert cc.roundtrip(torch.zeros(0, h, d), tabs).shape == (0, h, d)
    x = torch.randn(32, h, d, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for block in (0, -1, 1.5, True):
        with pytest.raises(cc.CompactCodecError, match="block"):
            cc.encode_tokens(x, tabs, block=block)
    assert all(torch.equal(a, b) for a, b in zip(cc.encode_tokens(x, tabs, block=7), cc.encode_tokens(x, tabs)))
    codes, sidx = cc.encode_tokens(x[:16], tabs)
    c0, s0 = codes[:, 0], sidx[:, 0]
    for c, s, bits in ((c0.to(torch.int64) - 12, s0, 4), (c0, s0.to(torch.int64) + 300, 4), (c0.float(), s0, 4),
                       (c0, s0, 7), (c0[:, :12], s0, 4)):
        with pytest.raises(cc.CompactCodecError):
            cc.pack_page(c, s, bits)
    neg_c, neg_s = codes.to(torch.int64), sidx.to(torch.int64)
    neg_c[0, 0, 0], neg_s[0, 0] = -1, -1
    for c, s in ((neg_c, sidx), (codes, neg_s)):
        with pytest.raises(cc.CompactCodecError, match="lie in"):
            cc.dequantize(c, s, tabs)
    page = cc.pack_page(c0, s0, 4)
    assert all(torch.equal(a, b) for a, b in zip(cc.unpack_page(page, 4, d), (c0, s0)))


def test_compact_tables_and_formats_refuse_bad_layers_kinds_and_widths():
    """``tables(0, "x", 4)`` was a ValueError, ``tables(0, "k", 7)`` and ``table_bits("zz")`` a
    KeyError, a compact format's roundtrip at layer 5 of 1 an IndexError."""
    from weightszip.compact.calibrate import CalibrationError
    from weightszip.compact.codec import CompactCodecError
    from weightszip.compact.formats import CompactFormat

    cal = _calibration()
    for call in (lambda: cal.tables(0, "x", 4), lambda: cal.tables(0, "k", 7), lambda: cal.tables(1, "k", 4),
                 lambda: cal.tables(0.0, "k", 4), lambda: cal.table_bits("zz")):
        with pytest.raises(CalibrationError):
            call()
    fmt = CompactFormat("q4", cal)
    x = torch.zeros(1, cal.kv_heads, 16, cal.head_dim)
    for call in (lambda: fmt.roundtrip(x, "k", 5), lambda: fmt.roundtrip(x, "x", 0), lambda: fmt.roundtrip(x[0], "k", 0),
                 lambda: fmt.roundtrip(x[:, :, :, :8], "k", 0)):
        with pytest.raises(CompactCodecError):
            call()
    assert issubclass(CompactCodecError, errors.WeightszipError) and issubclass(CompactCodecError, ValueError)


def test_positions_sequence_numbers_and_chunk_plans_of_the_wrong_kind():
    """Float positions were truncated (0.5 coded as 0), ``append(0, [0.7], ...)`` appended to
    sequence 0, a plan of 10**9 one-page chunks ran for minutes, and a format of a calibration
    without its allocation was a KeyError."""
    from weightszip.compact import codec as cc
    from weightszip.compact.formats import CompactFormat
    from weightszip.offload import plan_chunks

    cal = _calibration()
    x = torch.randn(16, cal.kv_heads, cal.head_dim, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    tabs = cal.tables(0, "k", 4)
    with pytest.raises(cc.CompactCodecError, match="integers"):
        cc.encode_tokens(x, tabs, positions=torch.arange(16) + 0.5)
    assert all(torch.equal(a, b) for a, b in zip(cc.encode_tokens(x, tabs, positions=list(range(16))),
                                                 cc.encode_tokens(x, tabs, positions=torch.arange(16, dtype=torch.int32))))
    with pytest.raises(errors.LimitExceededError, match="chunks"):
        plan_chunks(10**9, 1)
    assert plan_chunks(524288, 8192)[-1][1] == 524288
    cache = kv_exact.KVExactCache(layers=1, kv_heads=1, head_dim=32, num_q_heads=1, heap_bytes=1 << 16, max_seqs=1,
                                  max_tokens=64, device="cpu")
    s = cache.add_sequence()
    kv = torch.zeros(1, 16, 1, 32, dtype=torch.bfloat16)
    for seqs in ([0.7], [True], ["0"]):
        with pytest.raises(errors.InvalidArgumentError, match="seqs"):
            cache.append(0, seqs, kv, kv)
    cache.append(0, [s], kv, kv)
    empty = _calibration()
    empty.allocation = {}
    with pytest.raises(cc.CompactCodecError, match="allocation"):
        CompactFormat("q4", empty).widths(0)


def test_page_profile_takes_byte_buffers_and_dtype_names_only():
    """decode_pages(cb, None, offs) and calibrate(x, ["bfloat16"]) were TypeErrors; a float32 array
    as the page bytes was read as its raw bytes."""
    x = np.arange(16 * 32, dtype=np.uint16).reshape(16, 32)
    cb = pages.calibrate(x)
    buf, offs = pages.encode_pages(cb, x.reshape(1, 16, 32))
    assert (pages.decode_pages(cb, buf, offs) == x.reshape(1, 16, 32)).all()
    for bad in (None, np.frombuffer(bytes(buf), np.uint8).astype(np.float32), [1, 2, 3]):
        with pytest.raises(errors.InvalidArgumentError, match="page bytes"):
            pages.decode_pages(cb, bad, offs)
    with pytest.raises(errors.InvalidArgumentError, match="dtype"):
        pages.calibrate(x, ["bfloat16"])
