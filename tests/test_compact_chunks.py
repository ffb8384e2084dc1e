"""Compact formats (q4, q3.5, q3) as a ChunkCodec: through the chunk store and the KV serde
format, on real SmolLM2 KV, with a small calibration made as test_compact makes it."""

from __future__ import annotations

import struct

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import weightszip  # noqa: E402
from weightszip.compact import codec as cc  # noqa: E402
from weightszip.integrations import kvserde  # noqa: E402
from weightszip.integrations.compact_chunks import CompactChunkCodec  # noqa: E402
from weightszip.store import ChunkStore, register_codec  # noqa: E402

from test_compact import _small_calibration  # noqa: E402
from test_store import real_kv  # noqa: E402


@pytest.fixture(scope="module")
def cal():
    return _small_calibration(layers=3)


def _kv():
    return torch.from_numpy(real_kv().view(np.int16).copy()).view(torch.bfloat16)  # [2, 3, 64, 192]


def _expected(kv, cal, fmt):
    """What the format hands back, token by token, from the reference codec."""
    out = torch.empty_like(kv)
    for ki, kind in enumerate("kv"):
        for layer in range(3):
            bits = cal.allocation[fmt][layer][ki]
            x = kv[ki, layer].reshape(64, cal.kv_heads, cal.head_dim)
            out[ki, layer] = cc.roundtrip(x, cal.tables(layer, kind, bits)).reshape(64, -1).to(torch.bfloat16)
    return out


@pytest.mark.parametrize("fmt", ["q4", "q3.5", "q3"])
def test_compact_chunks_decode_to_what_the_format_hands_back(cal, fmt):
    kv = _kv()
    codec = CompactChunkCodec(cal, fmt)
    blob = codec.encode(kv)
    assert len(blob) == codec.max_encoded_size(kv.shape)
    assert len(blob) < 0.4 * kv.numel() * 2
    back = codec.decode(blob)
    assert torch.equal(back.view(torch.int16), _expected(kv, cal, fmt).view(torch.int16))
    assert not torch.equal(back, kv)


def test_compact_chunks_through_the_store_and_the_serde_format(cal, tmp_path):
    kv = _kv()
    codec = register_codec(CompactChunkCodec(cal, "q4"), replace=True)
    with ChunkStore(tmp_path, ram_bytes=0) as s:
        (n,) = s.put_tensors({"c": kv}, codec=codec)
        assert s.get_with_tag("c")[0] == codec.tag
        assert torch.equal(s.get_tensor("c").view(torch.int16), _expected(kv, cal, "q4").view(torch.int16))
    buf = torch.empty(kvserde.HEADER_LEN + codec.max_encoded_size(kv.shape), dtype=torch.uint8)
    assert kvserde.serialize_into(kv, buf, codec=codec) == buf.numel()
    dst = torch.empty_like(kv)
    kvserde.deserialize_into(buf, dst)
    assert torch.equal(dst.view(torch.int16), _expected(kv, cal, "q4").view(torch.int16))


def test_compact_chunks_reject_bad_input(cal):
    codec = CompactChunkCodec(cal, "q3")
    kv = _kv()
    with pytest.raises(weightszip.InvalidArgumentError, match="calibration"):
        codec.encode(kv[:, :2])
    with pytest.raises(weightszip.InvalidArgumentError, match="multiple of 16"):
        codec.encode(kv[:, :, :40])
    with pytest.raises(weightszip.InvalidArgumentError):
        CompactChunkCodec(cal, "q5")
    blob = codec.encode(kv)
    with pytest.raises(weightszip.TruncatedError):
        codec.decode(blob[:-1])
    with pytest.raises(weightszip.CorruptDataError):
        codec.decode(b"XXXX" + blob[4:])
    with pytest.raises(weightszip.CorruptDataError, match="q3"):
        CompactChunkCodec(cal, "q4").decode(blob)
    import torch

    for other in (np.frombuffer(blob, dtype=np.uint8), torch.frombuffer(bytearray(blob), dtype=torch.uint8), None):
        with pytest.raises(weightszip.InvalidArgumentError, match="bytes"):
            codec.decode(other)
    assert torch.equal(codec.decode(memoryview(bytearray(blob))), codec.decode(blob))


def test_compact_chunks_take_bf16_only(cal):
    """A chunk decodes to bf16, so only bf16 goes in: fp16 or int16 bits read as bf16 were other
    numbers (an fp16 chunk of max 4.4 came back with max 848), and an fp16 or fp32 chunk would come
    back as bf16. numpy's bf16 (ml_dtypes) codes as torch's does."""
    import ml_dtypes

    codec = CompactChunkCodec(cal, "q4")
    kv = _kv()
    blob = codec.encode(kv)
    assert codec.encode(kv.view(torch.int16).numpy().view(ml_dtypes.bfloat16)) == blob
    for other in (kv.to(torch.float16), kv.float(), kv.view(torch.int16), kv.to(torch.float16).numpy(),
                  kv.view(torch.int16).numpy(), kv.float().numpy(), kv.tolist()):
        with pytest.raises(weightszip.InvalidArgumentError, match="bf16"):
            codec.encode(other)
    assert codec.max_encoded_size(kv.shape, torch.bfloat16) == len(blob)
    for dtype in (torch.float16, torch.float32):
        with pytest.raises(weightszip.InvalidArgumentError, match="bf16"):
            codec.max_encoded_size(kv.shape, dtype)
    with ChunkStore(None) as s, pytest.raises(weightszip.InvalidArgumentError, match="bf16"):
        s.put_tensor("k", kv.to(torch.float16).numpy(), codec=codec)


def test_lmcache_serde_in_a_compact_mode(cal, tmp_path):
    from test_lmcache import _lmcache, _memory_obj, _wait

    wl = _lmcache()
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    path = tmp_path / "small.wzcal"
    cal.save(path)
    with pytest.raises(weightszip.InvalidArgumentError, match="calibration"):
        wl.create_serde({"mode": "q4"})
    proc = wl.create_serde({"mode": "q3.5", "calibration": str(path)})
    kv = _kv()
    size = proc.estimate_serialized_size(MemoryLayoutDesc(shapes=[kv.shape], dtypes=[torch.bfloat16]))
    assert size == kvserde.HEADER_LEN + CompactChunkCodec(cal, "q3.5").max_encoded_size(kv.shape)
    src = _memory_obj(kv.shape, torch.bfloat16)
    src.tensor.copy_(kv)
    tmp = _memory_obj((size,), torch.uint8)
    assert _wait(proc.query_serialize_result, proc.submit_serialize([src], [tmp], [None])) is True
    assert tmp.get_size() == size
    dst = _memory_obj(kv.shape, torch.bfloat16)
    assert _wait(proc.query_deserialize_result, proc.submit_deserialize([tmp], [dst], [None])) is True
    assert torch.equal(dst.tensor.view(torch.int16), _expected(kv, cal, "q3.5").view(torch.int16))
    # an fp16 model's chunks: refused when LMCache sizes their buffers (coded, they would never load)
    with pytest.raises(weightszip.InvalidArgumentError, match="bf16"):
        proc.estimate_serialized_size(MemoryLayoutDesc(shapes=[kv.shape], dtypes=[torch.float16]))
    proc.close()


def _with_rope(cal):
    """The small calibration with rotary K offsets in every layer and head."""
    import copy

    from weightszip.compact import calibrate as C

    c = copy.deepcopy(cal)
    g = torch.Generator().manual_seed(5)
    c.rope_m = (torch.randn(c.layers, c.kv_heads, c.head_dim, generator=g) * 2**17).to(torch.int64)
    c.rope_phase = C.rope_phase_steps(1e4 ** (-torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
    c.validate()
    return c


HEAD = 56  # a version-6 chunk's header


def _reseal(blob) -> bytes:
    """A version-6 chunk with both checksums recomputed over its (changed) bytes: what a writer of
    those header fields would make, to reach the checks behind the checksums."""
    b = bytearray(blob)
    struct.pack_into("<Q", b, 40, _xxh3(bytes(b[HEAD:])))
    struct.pack_into("<Q", b, 48, _xxh3(bytes(b[:48])))
    return bytes(b)


def _xxh3(b: bytes) -> int:
    a = np.frombuffer(b, dtype=np.uint8)
    return weightszip._core.xxh3_64(a.ctypes.data, a.nbytes)


def _as_version4(blob: bytes) -> bytes:
    """A version-6 chunk as version 4 wrote it: the 32-byte header without checksums, the same pages."""
    return blob[:4] + bytes([4]) + blob[5:32] + blob[HEAD:]


def _as_version5(blob: bytes) -> bytes:
    """A version-6 chunk as version 5 wrote it: the 48-byte header with both checksums (of bytes 0-39)
    and no calibration id, the same pages."""
    head = bytearray(blob[:4] + bytes([5]) + blob[5:32] + struct.pack("<QQ", _xxh3(blob[HEAD:]), 0))
    struct.pack_into("<Q", head, 40, _xxh3(bytes(head[:40])))
    return bytes(head) + blob[HEAD:]


def test_compact_chunks_record_their_start_position(cal):
    rc = _with_rope(cal)
    codec = CompactChunkCodec(rc, "q4")
    kv = _kv()
    at0, at4096 = codec.encode(kv), codec.encode(kv, start=4096)
    assert at0 != at4096  # keys are coded at their positions
    assert struct.unpack_from("<Q", at4096, 24)[0] == 4096
    for blob, start in ((at0, 0), (at4096, 4096)):
        back = codec.decode(blob)
        want = torch.empty_like(kv)
        for ki, kind in enumerate("kv"):
            for layer in range(3):
                x = kv[ki, layer].reshape(64, rc.kv_heads, rc.head_dim)
                tabs = rc.tables(layer, kind, rc.allocation["q4"][layer][ki])
                want[ki, layer] = cc.roundtrip(x, tabs, torch.arange(start, start + 64)).reshape(64, -1).to(torch.bfloat16)
        assert torch.equal(back.view(torch.int16), want.view(torch.int16))
    with pytest.raises(weightszip.InvalidArgumentError, match="start"):
        codec.encode(kv, start=-1)
    with pytest.raises(weightszip.InvalidArgumentError, match="2\\*\\*31"):
        codec.encode(kv, start=2**31 - 32)
    bad = bytearray(at0)
    struct.pack_into("<Q", bad, 24, 2**40)  # a hostile start position
    with pytest.raises(weightszip.ChecksumMismatchError, match="header"):
        codec.decode(bytes(bad))
    with pytest.raises(weightszip.CorruptDataError, match="positions"):
        codec.decode(_reseal(bad))  # (a writer's own bad start: the structural check behind the checksum)
    with pytest.raises(weightszip.CorruptDataError, match="positions"):
        codec.decode(_as_version4(bytes(bad)))
    # one bit of the start flipped in a version-4 chunk (no checksum) decodes, at other positions;
    # in a version-5 chunk it is a checksum error
    for bit in (0, 12, 30):
        bad = bytearray(at4096)
        bad[24 + bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(weightszip.ChecksumMismatchError):
            codec.decode(bytes(bad))
        assert codec.decode(_as_version4(bytes(bad))).shape == kv.shape


def _repack_pages(codec, blob: bytes, header: bytes, version: int = 1) -> bytes:
    """``blob`` (a chunk of this version) with its pages in layout ``version`` (1: bit planes at every
    width), after ``header``: the bytes an older writer made."""
    cal, d = codec.cal, codec.cal.head_dim
    kinds, layers, tokens = 2, cal.layers, struct.unpack_from("<I", blob, 16)[0]
    out, pos = [header], HEAD
    for ki in range(kinds):
        for layer in range(layers):
            bits = codec._bits(layer, ki)
            n = cc.page_bytes(bits, d)
            for _ in range(cal.kv_heads * tokens // cc.PAGE_TOKENS):
                c, s = cc.unpack_page(torch.frombuffer(bytearray(blob[pos : pos + n]), dtype=torch.uint8), bits, d)
                out.append(cc.pack_page(c, s, bits, version=version).numpy().tobytes())
                pos += n
    assert pos == len(blob)
    return b"".join(out)


def test_compact_chunks_read_older_versions(cal):
    """Chunks of versions 1 (24-byte header, no start) and 2 (a start) hold pages of layout version 1
    (bit planes at every width), version 3 of layout 2 (nibble rows at width 4), version 4 of layout 3
    (crumb rows at width 3), as version 5 does behind its checksums: all decode as the version-5 chunk
    of the same KV (version 1 at start 0); q3's allocation has 3- and 4-bit layers, so the layouts
    differ in its bytes. The older versions carry no checksum and are read without one."""
    codec = CompactChunkCodec(cal, "q3")
    assert any(4 in kinds for kinds in cal.allocation["q3"]) and any(3 in kinds for kinds in cal.allocation["q3"])
    kv = _kv()
    v6 = codec.encode(kv, start=7)
    magic, version, fi, kinds, layers, tokens, hidden, start, cal_id, pages_sum, head_sum = struct.unpack_from(
        "<4sBB2xIIIIQQQQ", v6)
    assert version == 6 and start == 7 and len(v6) == codec.max_encoded_size(kv.shape)
    assert cal_id == codec.calibration_id and pages_sum == _xxh3(v6[HEAD:]) and head_sum == _xxh3(v6[:48])
    v5 = _as_version5(v6)
    head = struct.pack("<4sBB2xIIIIQ", magic, 2, fi, kinds, layers, tokens, hidden, start)
    v2 = _repack_pages(codec, v6, head)
    v3 = _repack_pages(codec, v6, head[:4] + bytes([3]) + head[5:], version=2)
    v4 = _as_version4(v6)
    assert v4 == _repack_pages(codec, v6, head[:4] + bytes([4]) + head[5:], version=3)
    v1 = _repack_pages(codec, codec.encode(kv), struct.pack("<4sBB2xIIII", magic, 1, fi, kinds, layers, tokens,
                                                             hidden))
    assert v2[32:] != v4[32:] and v3[32:] != v4[32:] and v2[32:] != v3[32:]
    for old in (v2, v3, v4, v5):
        assert torch.equal(codec.decode(old).view(torch.int16), codec.decode(v6).view(torch.int16))
    assert torch.equal(codec.decode(v1).view(torch.int16), codec.decode(codec.encode(kv)).view(torch.int16))
    for old in (v1, v2, v3, v4, v5, v6):
        for cut in (1, len(old) - HEAD, len(old) - 20, len(old) - 25):
            with pytest.raises(weightszip.TruncatedError):
                codec.decode(old[:-cut])
    # a page bit flipped in an old chunk decodes (to other valid codes); in version 5 it is caught
    bad4 = bytearray(v4)
    bad4[100] ^= 0x10
    assert not torch.equal(codec.decode(bytes(bad4)).view(torch.int16), codec.decode(v4).view(torch.int16))
    for new, head in ((v5, 48), (v6, HEAD)):
        bad = bytearray(new)
        bad[100 + head - 32] ^= 0x10
        with pytest.raises(weightszip.ChecksumMismatchError, match="pages"):
            codec.decode(bytes(bad))
    with pytest.raises(weightszip.UnsupportedVersionError, match="version 7"):
        codec.decode(v6[:4] + bytes([7]) + v6[5:])
    with pytest.raises(weightszip.CorruptDataError, match="magic"):
        codec.decode(b"WZQX" + v6[4:])


def test_damaged_compact_chunk_headers_are_corrupt_data(cal):
    """The header is data read from a file, not the caller's argument: a bit flipped in its magic,
    format index, pad bytes, kinds, layers, tokens, hidden or the high bits of its start is
    CorruptDataError (TruncatedError where the header then implies another length), never
    InvalidArgumentError. Bytes 6-7 must be zero, in version 1's 24-byte header too. (The version
    byte's flips are UnsupportedVersionError; the start's low bits are any position.)"""
    codec = CompactChunkCodec(cal, "q3")
    kv = _kv()[:, :, :32]
    blob = codec.encode(kv, start=100)
    assert blob[6:8] == b"\0\0"
    bits = [8 * byte + b for byte in [0, 1, 2, 3, *range(5, 24)] for b in range(8)] + list(range(8 * 24 + 31, 8 * 32))
    for bit in bits:
        bad = bytearray(blob)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(weightszip.CorruptDataError):
            codec.decode(bytes(bad))
    for pad in (b"\1\0", b"\0\x80"):
        with pytest.raises(weightszip.CorruptDataError, match="pad"):
            codec.decode(blob[:6] + pad + blob[8:])
    v1 = _repack_pages(codec, codec.encode(kv), blob[:4] + bytes([1]) + blob[5:24])
    assert torch.equal(codec.decode(v1).view(torch.int16), codec.decode(codec.encode(kv)).view(torch.int16))
    with pytest.raises(weightszip.CorruptDataError, match="pad"):
        codec.decode(v1[:7] + b"\4" + v1[8:])
    # decoding a chunk with another format's codec: the chunk's bytes do not fit, so the same class
    with pytest.raises(weightszip.CorruptDataError, match="q3"):
        CompactChunkCodec(cal, "q4").decode(blob)


def test_every_bit_flip_of_a_compact_chunk_is_a_typed_error(cal):
    """Version 5: every single-bit flip of a whole (small, real) chunk is an error, never values. The
    magic's flips are CorruptDataError, the version byte's UnsupportedVersionError or (read as a
    version 1 or 4 header, whose length then disagrees) TruncatedError, the pad bytes' CorruptDataError,
    every other bit's (header fields, the checksums, every page byte) ChecksumMismatchError."""
    codec = CompactChunkCodec(_with_rope(cal), "q3")
    kv = _kv()[:, :, :16]
    blob = codec.encode(kv, start=100)
    codec.decode(blob)
    assert len(blob) < 16_000
    for bit in range(8 * len(blob)):
        bad = bytearray(blob)
        bad[bit // 8] ^= 1 << (bit % 8)
        byte = bit // 8
        if byte < 4:
            want = weightszip.CorruptDataError
        elif byte == 4:
            want = (weightszip.UnsupportedVersionError, weightszip.TruncatedError)
        elif byte in (6, 7):
            want = weightszip.CorruptDataError
        else:
            want = weightszip.ChecksumMismatchError
        try:
            codec.decode(bytes(bad))
        except want:
            continue
        raise AssertionError(f"bit {bit} (byte {byte}) flipped: decoded without the error expected")


def test_hostile_compact_chunks_give_typed_errors_or_the_coded_values(cal):
    """Bit flips and truncations anywhere in a chunk: a typed error (version 5: always), or (a flip
    inside the page bytes of a version-4 chunk, which has no checksum and where every bit pattern is a
    valid code) values the format can hand back: finite and within the calibration's reach. Never a
    crash, a hang or an unbounded allocation."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    codec = CompactChunkCodec(_with_rope(cal), "q3")
    kv = _kv()[:, :, :32]
    blob = codec.encode(kv, start=100)
    v4 = _as_version4(blob)
    errors = (weightszip.WeightszipError,)

    @settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
    @given(st.integers(0, len(blob) * 8 - 1), st.integers(0, len(blob)))
    def check(bit, cut):
        bad = bytearray(blob)
        bad[bit // 8] ^= 1 << (bit % 8)
        with pytest.raises(errors):
            codec.decode(bytes(bad))
        if cut < len(blob):
            with pytest.raises(weightszip.TruncatedError):
                codec.decode(blob[:cut])
        bit %= len(v4) * 8
        bad = bytearray(v4)
        bad[bit // 8] ^= 1 << (bit % 8)
        try:
            out = codec.decode(bytes(bad))
        except errors:
            pass
        else:
            assert out.shape == kv.shape and bool(torch.isfinite(out.float()).all())
        if cut < len(v4):
            with pytest.raises(errors):
                codec.decode(v4[:cut])

    check()


def test_a_chunk_coded_with_another_calibration_is_refused(cal, tmp_path):
    """A chunk says which calibration coded it (version 6): decoded with another (another model's, or
    this model's calibrated again after a restart) it is CorruptDataError, not other values. (Version
    5 had no such field: a reviewer decoded a real SmolLM2 chunk with the wrong calibration and got
    values with RMS error 22.6 against 0.16, silently.)"""
    kv = _kv()
    mine, other = CompactChunkCodec(cal, "q4"), CompactChunkCodec(_with_rope(cal), "q4")
    assert mine.calibration_id != other.calibration_id
    assert CompactChunkCodec(cal, "q4").calibration_id == mine.calibration_id  # a function of the tables
    assert CompactChunkCodec(cal, "q3").calibration_id != mine.calibration_id  # and of the format
    blob = mine.encode(kv)
    assert mine.owns(blob) is True and other.owns(blob) is False
    assert mine.owns(_as_version5(blob)) is None
    # bytes no codec can read are anyone's: decode says why (not "which codec?")
    assert mine.owns(b"x") and other.owns(blob[:30]) and other.owns(blob[:8] + b"\0" + blob[9:])
    with pytest.raises(weightszip.CorruptDataError, match="calibration"):
        other.decode(blob)
    assert torch.equal(mine.decode(blob).view(torch.int16), _expected(kv, cal, "q4").view(torch.int16))
    # the path of a saved calibration is taken too (it was "the calibration has no allocation for 'q4'")
    cal.save(tmp_path / "m.wzcal")
    assert CompactChunkCodec(tmp_path / "m.wzcal", "q4").calibration_id == mine.calibration_id
    assert CompactChunkCodec(str(tmp_path / "m.wzcal"), "q4").owns(blob)


def test_codecs_of_several_calibrations_share_a_store(cal, tmp_path, monkeypatch):
    """Two models' q4 codecs in one process (one tag): each chunk decodes with its own; registering a
    second load of the same calibration is no error (it was: "tag 32 is taken"); after a reopen, in a
    process that registered nothing, `codec=` decodes; a chunk of version 5 (no calibration id) with
    two codecs registered names the ambiguity instead of guessing."""
    from weightszip import store as st

    monkeypatch.setattr(st, "_CODECS", {})
    kv = _kv()
    a, b = CompactChunkCodec(cal, "q4"), CompactChunkCodec(_with_rope(cal), "q4")
    with ChunkStore(tmp_path, ram_bytes=0) as s:
        s.put_tensor("a", kv, codec=a)
        s.put_tensor("b", kv, codec=b)
        s.put_tensor("a2", kv, codec=CompactChunkCodec(cal, "q4"))  # the same calibration, loaded again
        assert len(st._CODECS[a.tag]) == 2
        for key, c in (("a", a), ("b", b), ("a2", a)):
            assert torch.equal(s.get_tensor(key).view(torch.int16), c.decode(c.encode(kv)).view(torch.int16))
        assert not torch.equal(s.get_tensor("a").view(torch.int16), s.get_tensor("b").view(torch.int16))
        s.put("v5", _as_version5(a.encode(kv)), tag=a.tag)
        with pytest.raises(weightszip.InvalidArgumentError, match="does not say"):
            s.get_tensor("v5")
        assert s.get_tensor("v5", codec=a).shape == kv.shape
        damaged = bytearray(b.encode(kv))
        damaged[20] ^= 1
        s.put("bad", bytes(damaged), tag=a.tag)
        with pytest.raises(weightszip.ChecksumMismatchError):  # the damage, not "which codec?"
            s.get_tensor("bad")
    monkeypatch.setattr(st, "_CODECS", {})
    with ChunkStore(tmp_path, ram_bytes=0) as s:
        with pytest.raises(weightszip.InvalidArgumentError, match="no registered codec"):
            s.get_tensor("b")
        assert torch.equal(s.get_tensor("b", codec=b).view(torch.int16), b.decode(b.encode(kv)).view(torch.int16))
        with pytest.raises(weightszip.CorruptDataError, match="calibration"):
            s.get_tensor("b", codec=a)
    # a codec that cannot tell its chunks apart still needs replace=True to take a tag
    class Plain:
        tag = 99

        def encode(self, x):
            return b""

        def decode(self, data):
            return None

    register_codec(Plain())
    with pytest.raises(weightszip.InvalidArgumentError, match="taken"):
        register_codec(Plain())
    register_codec(Plain(), replace=True)
