"""The KV-chunk byte format (no LMCache needed), then the LMCache serde and connector against the
real `lmcache` package. LMCache's wheel requires CUDA packages, so it lives in its own folder
(scripts/lmcache_site.sh, run by .ci/run) named by WEIGHTSZIP_LMCACHE_SITE; without it the
LMCache tests skip, unless WEIGHTSZIP_REQUIRE_LMCACHE=1."""

from __future__ import annotations

import os
import sys
import time

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

torch = pytest.importorskip("torch")

import weightszip  # noqa: E402
from weightszip.integrations import kvserde  # noqa: E402
from weightszip.store import register_codec  # noqa: E402

from test_store import HalfCodec, real_kv  # noqa: E402


def real_kv_torch():
    return torch.from_numpy(real_kv().view(np.int16).copy()).view(torch.bfloat16)


def test_kv_chunk_format_round_trips_real_kv_exactly():
    x = real_kv_torch()
    buf = torch.empty(kvserde.exact_bound(x.numel() * 2) + 100, dtype=torch.uint8)
    n = kvserde.serialize_into(x, buf)
    assert n < 0.85 * x.numel() * 2
    y = torch.empty_like(x)
    kvserde.deserialize_into(buf, y)
    assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    # The decoder reads only the bytes the header declares: trailing garbage is ignored.
    buf[n:] = 0xAB
    kvserde.deserialize_into(buf, y)
    assert torch.equal(x.view(torch.int16), y.view(torch.int16))


def test_kv_chunk_format_writes_the_exact_codec_at_the_level_asked(monkeypatch):
    """``level`` reaches the encoder (the core's call sees it; its bytes equal `weightszip.compress`'s
    at that level) and the chunk decodes exactly; a bad level, or one given with a ChunkCodec, is
    refused."""
    from weightszip import _core

    x = real_kv_torch()
    seen = []
    real = _core.compress_buffers
    monkeypatch.setattr(_core, "compress_buffers", lambda *a: seen.append(a[-1]) or real(*a))
    for level in (1, 2):
        buf = torch.empty(kvserde.exact_bound(x.numel() * 2), dtype=torch.uint8)
        n = kvserde.serialize_into(x, buf, level=level)
        assert seen[-1] == level
        assert bytes(buf[kvserde.HEADER_LEN : n].numpy()) == bytes(weightszip.compress(x, level=level))
        y = torch.empty_like(x)
        kvserde.deserialize_into(buf, y)
        assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    kvserde.serialize_into(x, buf)
    assert seen[-1] == _core.DEFAULT_LEVEL
    for bad in (0, 3, "1", 1.0):
        with pytest.raises(weightszip.InvalidArgumentError, match="level"):
            kvserde.serialize_into(x, buf, level=bad)
    with pytest.raises(weightszip.InvalidArgumentError, match="level"):
        kvserde.serialize_into(x, buf, codec=register_codec(HalfCodec(), replace=True), level=1)


@settings(max_examples=25, deadline=None)
@given(
    shape=st.lists(st.integers(1, 40), min_size=1, max_size=4),
    dtype=st.sampled_from([torch.bfloat16, torch.float16, torch.float32, torch.uint8]),
    seed=st.integers(0, 2**31),
)
def test_exact_bound_holds_for_incompressible_chunks(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    x = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g).view(dtype).reshape(shape)
    buf = torch.empty(kvserde.exact_bound(n), dtype=torch.uint8)
    k = kvserde.serialize_into(x, buf)
    assert k <= buf.numel()
    y = torch.empty_like(x)
    kvserde.deserialize_into(buf[:k], y)
    assert torch.equal(x.view(torch.uint8), y.view(torch.uint8))


def test_kv_chunk_format_rejects_bad_input():
    x = real_kv_torch()
    buf = torch.empty(kvserde.exact_bound(x.numel() * 2), dtype=torch.uint8)
    n = kvserde.serialize_into(x, buf)
    with pytest.raises(weightszip.InvalidArgumentError, match="needs"):
        kvserde.serialize_into(x, torch.empty(100, dtype=torch.uint8))
    with pytest.raises(weightszip.TruncatedError):
        kvserde.deserialize_into(buf[: n - 1], torch.empty_like(x))
    with pytest.raises(weightszip.TruncatedError):
        kvserde.deserialize_into(buf[:5], torch.empty_like(x))
    bad = buf.clone()
    bad[0] ^= 1
    with pytest.raises(weightszip.BadMagicError):
        kvserde.deserialize_into(bad, torch.empty_like(x))
    bad = buf.clone()
    bad[n - 3] ^= 0x20
    with pytest.raises(weightszip.CorruptDataError):
        kvserde.deserialize_into(bad, torch.empty_like(x))
    with pytest.raises(weightszip.InvalidArgumentError, match="destination"):
        kvserde.deserialize_into(buf, torch.empty(x.shape, dtype=torch.float16))
    with pytest.raises(weightszip.InvalidArgumentError, match="destination"):
        kvserde.deserialize_into(buf, torch.empty(x.numel(), dtype=torch.bfloat16))
    # the codec tag of an exact-mode chunk (bytes 6-7) is 0: any other is damage
    for flip in (6, 7):
        bad = buf.clone()
        bad[flip] ^= 1
        with pytest.raises(weightszip.CorruptDataError, match="tag"):
            kvserde.deserialize_into(bad, torch.empty_like(x))


def test_kv_chunk_format_codec_mode():
    codec = register_codec(HalfCodec(), replace=True)
    x = real_kv_torch()
    buf = torch.empty(x.numel() * 2, dtype=torch.uint8)
    n = kvserde.serialize_into(real_kv(), buf, codec=codec)
    assert n == kvserde.HEADER_LEN + 32 + x.numel()
    y = torch.empty_like(x)
    kvserde.deserialize_into(buf, y)
    assert torch.equal(y.view(torch.int16), x.view(torch.int16) & ~0xFF)


def test_kv_chunk_format_codec_mode_does_not_convert_dtypes():
    """A codec-mode chunk decoded into a buffer of another dtype: refused (as exact mode refuses it),
    not converted; a 0-d output buffer or a numpy destination is a typed error too."""
    codec = register_codec(HalfCodec(), replace=True)
    x = real_kv_torch()
    buf = torch.empty(x.numel() * 2, dtype=torch.uint8)
    kvserde.serialize_into(real_kv(), buf, codec=codec)
    for dtype in (torch.float16, torch.float32):
        with pytest.raises(weightszip.InvalidArgumentError):
            kvserde.deserialize_into(buf, torch.empty(x.shape, dtype=dtype))
    with pytest.raises(weightszip.InvalidArgumentError):
        kvserde.deserialize_into(buf, np.empty(tuple(x.shape), np.float32))
    with pytest.raises(weightszip.InvalidArgumentError):
        kvserde.serialize_into(x, torch.tensor(1.0))

    class WideTag(HalfCodec):  # the store takes 32-bit tags; the chunk header holds 16 bits
        tag = 70_000

    with pytest.raises(weightszip.InvalidArgumentError, match="u16"):
        kvserde.serialize_into(real_kv(), buf, codec=WideTag())


# --- the real LMCache ----------------------------------------------------------------------------


def _lmcache():
    site = os.environ.get("WEIGHTSZIP_LMCACHE_SITE")
    if site and site not in sys.path:
        sys.path.append(site)
    try:
        import lmcache.v1.distributed.serde  # noqa: F401

        from weightszip.integrations import lmcache as wl
    except ImportError as e:
        if os.environ.get("WEIGHTSZIP_REQUIRE_LMCACHE") == "1":
            pytest.fail(f"WEIGHTSZIP_REQUIRE_LMCACHE=1 but lmcache does not import: {e}")
        pytest.skip(f"lmcache not importable (scripts/lmcache_site.sh): {e}")
    return wl


def _memory_obj(shape, dtype, nbytes=None):
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    size = nbytes if nbytes is not None else int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
    meta = MemoryObjMetadata(
        shape=torch.Size(shape), dtype=dtype, address=0, phy_size=size, ref_count=1, fmt=MemoryFormat.KV_2LTD
    )
    return TensorMemoryObj(torch.zeros(size, dtype=torch.uint8), meta, None)


def _wait(query, task):
    for _ in range(2000):
        r = query(task)
        if r is not None:
            return r
        time.sleep(0.005)
    raise AssertionError("serde task did not finish")


def test_lmcache_serde_through_lmcache_factory_and_async_processor():
    wl = _lmcache()
    from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
    from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor, get_registered_serde_types
    from lmcache.v1.distributed.serde.utils import serialized_layout_desc

    wl.register()
    wl.register()  # idempotent
    assert "weightszip" in get_registered_serde_types()
    proc = create_serde_processor(SerdeConfig(type="weightszip", kwargs={"max_workers": 2}))
    kv = real_kv_torch()  # LMCache's KV_2LTD layout [2, layers, tokens, hidden], bf16
    src = _memory_obj(kv.shape, torch.bfloat16)
    src.tensor.copy_(kv)
    layout = MemoryLayoutDesc(shapes=[kv.shape], dtypes=[torch.bfloat16])
    tmp_layout = serialized_layout_desc(layout, proc)
    (size,) = tmp_layout.shapes
    assert size[0] == proc.estimate_serialized_size(layout) >= kv.numel() * 2
    tmp = _memory_obj(size, torch.uint8)
    key = ObjectKey(chunk_hash=b"\x01" * 32, model_name="smollm2", kv_rank=0)
    assert _wait(proc.query_serialize_result, proc.submit_serialize([src], [tmp], [key])) is True
    # LMCache narrows the buffer to what serialize returned: the L2 adapter stores only that.
    stored = tmp.get_size()
    assert stored < 0.85 * kv.numel() * 2
    assert len(tmp.byte_array) == stored
    # Load path: the L2 adapter reads the stored bytes into a buffer of the estimated size.
    loaded = _memory_obj(size, torch.uint8)
    loaded.raw_data[:stored].copy_(tmp.raw_data[:stored])
    dst = _memory_obj(kv.shape, torch.bfloat16)
    assert _wait(proc.query_deserialize_result, proc.submit_deserialize([loaded], [dst], [key])) is True
    assert torch.equal(dst.tensor.view(torch.int16), kv.view(torch.int16))
    # A damaged stored chunk fails the task (LMCache reports a failed load), never wrong KV.
    loaded.raw_data[stored - 5] ^= 0x10
    dst2 = _memory_obj(kv.shape, torch.bfloat16)
    assert _wait(proc.query_deserialize_result, proc.submit_deserialize([loaded], [dst2], [key])) is False
    proc.close()
    with pytest.raises(weightszip.InvalidArgumentError):
        wl.create_serde({"mode": "zip"})


def test_lmcache_serde_level_option():
    """``"level"`` in the serde's kwargs reaches the exact codec (a JSON string or number); any other
    value, or a level with a lossy or custom codec's mode, is refused when the serde is made."""
    wl = _lmcache()
    for kwargs, level in (({"level": 1}, 1), ({"level": "1", "mode": "exact"}, 1), ({}, weightszip._core.DEFAULT_LEVEL)):
        proc = wl.create_serde(kwargs)
        assert proc._serializer.level == level  # (LMCache 0.5.6's AsyncSerdeProcessor keeps it there)
        proc.close()
    for bad in (0, 3, "fast", 1.5, True):
        with pytest.raises(weightszip.InvalidArgumentError, match="level"):
            wl.create_serde({"level": bad})
    with pytest.raises(weightszip.InvalidArgumentError, match="level"):
        wl.create_serde({"mode": "codec", "codec": "test_lmcache:SizedHalfCodec", "level": 1})


def test_lmcache_serde_codec_mode_loads_a_codec_by_name():
    wl = _lmcache()
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    proc = wl.create_serde({"mode": "codec", "codec": "test_lmcache:SizedHalfCodec"})
    kv = real_kv_torch()
    layout = MemoryLayoutDesc(shapes=[kv.shape], dtypes=[torch.bfloat16])
    assert proc.estimate_serialized_size(layout) == kvserde.HEADER_LEN + 32 + kv.numel()
    src = _memory_obj(kv.shape, torch.bfloat16)
    src.tensor.copy_(kv)
    tmp = _memory_obj((proc.estimate_serialized_size(layout),), torch.uint8)
    assert _wait(proc.query_serialize_result, proc.submit_serialize([src], [tmp], [None])) is True
    dst = _memory_obj(kv.shape, torch.bfloat16)
    assert _wait(proc.query_deserialize_result, proc.submit_deserialize([tmp], [dst], [None])) is True
    assert torch.equal(dst.tensor.view(torch.int16), kv.view(torch.int16) & ~0xFF)
    proc.close()


class SizedHalfCodec(HalfCodec):
    tag = 41

    def encode(self, x):
        return super().encode(x.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if isinstance(x, torch.Tensor) else x)

    def decode(self, data):
        return torch.from_numpy(super().decode(data).view(np.int16).copy()).view(torch.bfloat16)

    def max_encoded_size(self, shape, dtype):
        return 32 + int(np.prod(shape))


class LowHalfCodec(SizedHalfCodec):
    """SizedHalfCodec's tag, other bytes: keeps the low byte of each value instead of the top."""

    def encode(self, x):
        return super().encode(x.view(torch.int16).bitwise_left_shift(8) if isinstance(x, torch.Tensor) else x)

    def decode(self, data):
        return super().decode(data).view(torch.int16).bitwise_right_shift(8).bitwise_and(0xFF).view(torch.bfloat16)


def _serde_round_trip(proc, kv):
    from lmcache.v1.distributed.api import MemoryLayoutDesc

    src = _memory_obj(kv.shape, torch.bfloat16)
    src.tensor.copy_(kv)
    tmp = _memory_obj((proc.estimate_serialized_size(MemoryLayoutDesc(shapes=[kv.shape], dtypes=[kv.dtype])),),
                      torch.uint8)
    assert _wait(proc.query_serialize_result, proc.submit_serialize([src], [tmp], [None])) is True
    dst = _memory_obj(kv.shape, torch.bfloat16)
    assert _wait(proc.query_deserialize_result, proc.submit_deserialize([tmp], [dst], [None])) is True
    return dst.tensor


def test_lmcache_serdes_of_two_codecs_with_one_tag_each_decode_their_own():
    """A serde in codec mode decodes its chunks with its own codec: a second serde whose codec has
    the same tag (another format) made afterwards in the process does not change what the first
    one's chunks decode to (the process-wide registry used to take the last one)."""
    wl = _lmcache()
    kv = real_kv_torch()
    high = wl.create_serde({"mode": "codec", "codec": "test_lmcache:SizedHalfCodec"})
    low = wl.create_serde({"mode": "codec", "codec": "test_lmcache:LowHalfCodec"})
    try:
        assert torch.equal(_serde_round_trip(high, kv).view(torch.int16), kv.view(torch.int16) & ~0xFF)
        assert torch.equal(_serde_round_trip(low, kv).view(torch.int16), kv.view(torch.int16) & 0xFF)
    finally:
        high.close()
        low.close()


def test_lmcache_serde_options_are_checked_when_it_is_made():
    """Every serde option is checked by the factory (when LMCache builds the L2 adapter), as an
    InvalidArgumentError naming it: unknown or misspelt keys, options of another mode, values of the
    wrong kind or range, codecs that do not import or are no codec. They used to pass (``"levle"``,
    ``"calibration"`` in exact mode), be truncated (``"threads": 2.7``), fail untyped (ValueError,
    ModuleNotFoundError, AttributeError) or fail at every serialize (``"threads": -1``)."""
    wl = _lmcache()
    for kwargs, match in (
        ({"levle": 1}, "unknown option 'levle'"),
        ({"max_worker": 8, "x": 1}, "unknown options 'max_worker', 'x'"),
        ({"calibration": "m.wzcal"}, "calibration"),
        ({"mode": "exact", "codec": "test_lmcache:SizedHalfCodec"}, "codec"),
        ({"mode": "q4", "calibration": 5}, "calibration"),
        ({"mode": "codec", "codec": None}, "codec"),
        ({"mode": "codec", "codec": "no_such_module_here:X"}, "no_such_module_here"),
        ({"mode": "codec", "codec": "weightszip:no_such_thing"}, "no_such_thing"),
        ({"mode": "codec", "codec": "weightszip:compress"}, "no ChunkCodec"),
        ({"mode": 4}, "mode"),
    ) + tuple(({name: bad}, name) for name in ("threads", "max_workers") for bad in ("abc", 2.7, True, -1, "\u00b2")) + (
        ({"max_workers": 0}, "max_workers"),
    ):
        with pytest.raises(weightszip.InvalidArgumentError, match=match):
            wl.create_serde(kwargs)
    proc = wl.create_serde({"threads": "2", "max_workers": 3})
    assert proc._serializer.threads == 2  # (LMCache 0.5.6's AsyncSerdeProcessor keeps it there)
    proc.close()


def test_store_options_refuse_digits_that_are_no_number():
    """``str.isdigit`` accepts "²", which ``int`` refuses, and ``int`` refuses strings past 4300
    digits: both were a ValueError out of the connector's constructor."""
    from weightszip.integrations._options import store_kwargs

    for bad in ("\u00b2", "9" * 5000, "1_000", " ", "-1", "0x10"):
        with pytest.raises(weightszip.InvalidArgumentError, match="ram_bytes"):
            store_kwargs({"ram_bytes": bad}, "cfg")
    assert store_kwargs({"ram_bytes": " 4096 "}, "cfg") == {"ram_bytes": 4096}


def test_kv_chunk_into_a_destination_it_cannot_fill_says_why():
    x = real_kv_torch()
    buf = torch.empty(kvserde.exact_bound(x.numel() * 2), dtype=torch.uint8)
    kvserde.serialize_into(x, buf)
    with pytest.raises(weightszip.InvalidArgumentError, match="not contiguous"):
        kvserde.deserialize_into(buf, torch.empty(x.shape[::-1], dtype=x.dtype).permute(3, 2, 1, 0))


class _Allocator:
    """Stands in for LMCache's LocalCPUBackend.allocate (which needs a running engine); ``buffer``
    makes the raw bytes for n bytes."""

    def __init__(self, buffer=lambda n: torch.empty(n, dtype=torch.uint8)):
        self.buffer = buffer

    def allocate(self, shape, dtype, fmt=None):
        from lmcache.v1.memory_management import MemoryObjMetadata, TensorMemoryObj

        n = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        meta = MemoryObjMetadata(shape=torch.Size(shape), dtype=dtype, address=0, phy_size=n, ref_count=1, fmt=fmt)
        return TensorMemoryObj(self.buffer(n), meta, None)


def test_lmcache_connector_level_option_reaches_the_encoder(tmp_path, monkeypatch):
    """``remote_storage_plugin.weightszip.level`` is the level the connector's chunks are coded at
    (what it hands `weightszip.compress`); absent, the default; any other value is refused when the
    connector is built."""
    wl = _lmcache()

    def connector(folder, **opts):
        class Config:
            extra_config = {"remote_storage_plugin.weightszip.path": str(tmp_path / folder),
                            "remote_storage_plugin.weightszip.durable": False,
                            **{f"remote_storage_plugin.weightszip.{k}": v for k, v in opts.items()}}
        return wl.WeightszipConnector(loop=None, local_cpu_backend=_Allocator(), config=Config())

    conn = connector("a", level=1)
    seen = []
    real = weightszip.compress
    monkeypatch.setattr(weightszip, "compress", lambda x, **kw: seen.append(kw.get("level")) or real(x, **kw))
    kv = real_kv_torch()
    obj = _memory_obj(kv.shape, torch.bfloat16)
    obj.tensor.copy_(kv)
    from lmcache.utils import CacheEngineKey

    key = CacheEngineKey(model_name="smollm2", world_size=1, worker_id=0, chunk_hash=7, dtype=torch.bfloat16)
    conn._put(key, obj)
    assert seen == [1]
    assert torch.equal(conn.store.get_tensor(conn._key(key), out="torch").view(torch.int16), kv.view(torch.int16))
    conn.store.close()
    assert connector("b").level == weightszip._core.DEFAULT_LEVEL
    for bad in (0, 3, "fast", 1.5, True):
        with pytest.raises(weightszip.InvalidArgumentError, match="level"):
            connector("c", level=bad)


def test_lmcache_in_process_connector_on_the_chunk_store(tmp_path):
    wl = _lmcache()
    import asyncio

    from lmcache.utils import CacheEngineKey
    from lmcache.v1.memory_management import MemoryFormat
    from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

    class Config:
        extra_config = {
            "remote_storage_plugin.weightszip.path": str(tmp_path),
            "remote_storage_plugin.weightszip.ram_bytes": 0,
            "remote_storage_plugin.weightszip.durable": False,
        }

    conn = wl.WeightszipConnector(loop=None, local_cpu_backend=_Allocator(), config=Config())
    assert isinstance(conn, RemoteConnector)
    kv = real_kv_torch()
    obj = _memory_obj(kv.shape, torch.bfloat16)
    obj.tensor.copy_(kv)
    key = CacheEngineKey(model_name="smollm2", world_size=1, worker_id=0, chunk_hash=1234, dtype=torch.bfloat16)
    other = CacheEngineKey(model_name="smollm2", world_size=1, worker_id=0, chunk_hash=99, dtype=torch.bfloat16)

    async def run():
        assert not await conn.exists(key)
        await conn.put(key, obj)
        assert await conn.exists(key) and conn.exists_sync(key) and not conn.exists_sync(other)
        # What the connector stored is the compressed chunk.
        assert 0 < conn.store.stats()["disk_bytes"] < 0.85 * kv.numel() * 2
        back = await conn.get(key)
        assert back.meta.fmt == MemoryFormat.KV_2LTD
        assert torch.equal(back.tensor.view(torch.int16), kv.view(torch.int16))
        # the store itself reads the chunk as the container it is (its tag, 257, notes the format)
        assert conn.store.get_with_tag(conn._key(key))[0] == 257
        assert torch.equal(conn.store.get_tensor(conn._key(key), out="torch").view(torch.int16), kv.view(torch.int16))
        assert await conn.get(other) is None
        # a stored chunk that is not what the connector writes: a typed error, not an IndexError
        # or a ValueError (a memory format LMCache does not have; a container of two tensors)
        from weightszip.store import TAG_CONTAINER

        conn.store.put(conn._key(other), weightszip.compress(kv), tag=TAG_CONTAINER | (200 << 8))
        with pytest.raises(weightszip.CorruptDataError, match="memory format"):
            await conn.get(other)
        weightszip.save_file({"a": kv, "b": kv}, tmp_path / "two.wz")
        conn.store.put(conn._key(other), (tmp_path / "two.wz").read_bytes(), tag=TAG_CONTAINER | (int(MemoryFormat.KV_2LTD.value) << 8))
        with pytest.raises(weightszip.CorruptDataError, match="2 tensors"):
            await conn.get(other)
        # an allocator that hands out a smaller (or strided) buffer than the chunk needs: refused
        # before the decoder writes a byte
        class Given:  # a memory object whose tensor is what an allocator handed out
            def __init__(self, t):
                self.tensor, self.released = t, False

            def ref_count_down(self):
                self.released = True

        class Handing:
            def __init__(self, make):
                self.make, self.given = make, []

            def allocate(self, shape, dtype, fmt=None):
                self.given.append(Given(self.make(int(np.prod(shape)), dtype)))
                return self.given[-1]

        for make in (lambda n, dt: torch.empty(n - 1, dtype=dt), lambda n, dt: torch.empty(2 * n, dtype=dt)[::2]):
            conn.local_cpu_backend = Handing(make)
            with pytest.raises(weightszip.InvalidArgumentError, match="no contiguous buffer"):
                await conn.get(key)
            assert conn.local_cpu_backend.given[0].released
        conn.local_cpu_backend = _Allocator(lambda n: torch.empty(n - 2, dtype=torch.uint8))  # LMCache's own object
        with pytest.raises(weightszip.InvalidArgumentError, match="no contiguous buffer"):
            await conn.get(key)
        conn.local_cpu_backend = _Allocator()
        assert conn.remove_sync(key) and not conn.exists_sync(key)
        await conn.close()

    asyncio.run(run())
    with pytest.raises(weightszip.InvalidArgumentError, match="closed"):
        conn.store.get("x")


@pytest.mark.skipif(__import__("shutil").which("redis-server") is None, reason="needs redis-server to stop one")
def test_lmcache_lookup_with_redis_gone_keeps_the_local_prefix(tmp_path, caplog):
    """LMCache's batched lookup gathers exists() over every key and answers 0 for the whole batch if
    one raises: with the Redis tier gone, a key only Redis could answer for is a logged miss of that
    key, and the locally held prefix still counts (it was 0: the local hits were lost)."""
    wl = _lmcache()
    import asyncio

    from lmcache.utils import CacheEngineKey
    from test_store_redis import _start_private

    keys = [CacheEngineKey(model_name="smollm2", world_size=1, worker_id=0, chunk_hash=h, dtype=torch.bfloat16)
            for h in (1, 2, 3)]
    kv = real_kv_torch()
    obj = _memory_obj(kv.shape, torch.bfloat16)
    obj.tensor.copy_(kv)
    p, url = _start_private()
    try:

        class Config:
            extra_config = {
                "remote_storage_plugin.weightszip.path": str(tmp_path),
                "remote_storage_plugin.weightszip.redis_url": url,
                "remote_storage_plugin.weightszip.redis_timeout_ms": 500,
            }

        conn = wl.WeightszipConnector(loop=None, local_cpu_backend=_Allocator(), config=Config())

        async def put():
            await conn.put(keys[0], obj)
            await conn.put(keys[1], obj)

        asyncio.run(put())
    finally:
        p.kill()
        p.wait()
    with caplog.at_level("WARNING", logger="weightszip.integrations.lmcache"):
        assert conn.support_batched_async_contains()
        assert asyncio.run(conn.batched_async_contains("lookup", keys)) == 2
        assert conn.exists_sync(keys[0]) and not conn.exists_sync(keys[2])
    assert sum("counted as absent" in r.getMessage() for r in caplog.records) == 2
    with pytest.raises(weightszip.WeightszipIOError):
        conn.store.contains(conn._key(keys[2]))


def test_lmcache_example_runs():
    _lmcache()
    pytest.importorskip("gguf")
    import runpy
    from pathlib import Path

    from weightszip.models import ModelNotInstalled

    ex = runpy.run_path(str(Path(__file__).parent.parent / "examples" / "lmcache_serde.py"))
    try:
        assert ex["main"]() == 0
    except ModelNotInstalled as e:
        pytest.skip(str(e))


def test_lmcache_builds_the_connector_from_the_example_config(tmp_path):
    """LMCache's own config loader and ConnectorManager, on examples/lmcache_inprocess.yaml."""
    wl = _lmcache()
    from pathlib import Path

    from lmcache.v1.config import LMCacheEngineConfig
    from lmcache.v1.storage_backend.connector import ConnectorManager

    text = (Path(__file__).parent.parent / "examples" / "lmcache_inprocess.yaml").read_text()
    cfg_path = tmp_path / "lmcache.yaml"
    cfg_path.write_text(text.replace("/data/wz-kv", str(tmp_path / "kv")))
    cfg = LMCacheEngineConfig.from_file(str(cfg_path))
    # one way in: remote_storage_plugins (LMCache builds a RemoteBackend per plugin, whose url is
    # plugin://<name>); a remote_url as well would build a second backend on the same store folder
    assert cfg.remote_url is None and cfg.remote_storage_plugins == ["weightszip"]
    conn = ConnectorManager("plugin://weightszip", None, _Allocator(), cfg).create_connector()
    assert isinstance(conn, wl.WeightszipConnector)
    assert Path(conn.store.config.path) == tmp_path / "kv" and conn.store.config.ram_bytes == 8589934592
    conn.store.close()


def _server(module: str, tmp_path, timeout: float = 90.0, args: list | None = None) -> tuple[bool, str]:
    """Start LMCache's MP server (through `module`) on CPU with an fs L2 adapter using our serde, or
    with `args` (the value after ``--port`` replaced by a free port); return (came up, log). Stopped
    with SIGINT once up."""
    import json
    import signal
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1")
    site = os.environ.get("WEIGHTSZIP_LMCACHE_SITE")
    if site:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (env.get("PYTHONPATH"), site) if p)
    adapter = {"type": "fs", "base_path": str(tmp_path / "l2"), "serde": {"type": "weightszip"}}
    log = tmp_path / "server.log"
    with open(log, "w") as out:
        if args is None:
            args = ["--host", "127.0.0.1", "--port", "0", "--l1-size-gb", "0.25", "--eviction-policy", "LRU",
                    "--l2-adapter", json.dumps(adapter), "--disable-observability"]
        args = [str(port) if i and args[i - 1] == "--port" else a for i, a in enumerate(args)]
        p = subprocess.Popen([sys.executable, "-m", module, *args], stdout=out, stderr=subprocess.STDOUT, env=env)
        up = False
        try:
            deadline = time.time() + timeout
            while time.time() < deadline and p.poll() is None:
                if "Supported transfer mode" in log.read_text():
                    up = True
                    break
                time.sleep(0.2)
        finally:
            if p.poll() is None:
                p.send_signal(signal.SIGINT)
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
    return up, log.read_text()


def test_lmcache_server_starts_with_the_weightszip_serde_through_the_launcher(tmp_path):
    """The real MP server (CPU) builds its fs L2 adapter with "serde": {"type": "weightszip"}
    when started through our launcher, and refuses the config without it."""
    _lmcache()
    (tmp_path / "l2").mkdir()
    up, log = _server("weightszip.integrations.lmcache_server", tmp_path)
    assert up and "Initialized FSL2Adapter" in log, log[-3000:]
    up, log = _server("lmcache.v1.multiprocess.server", tmp_path)
    assert not up and "Unknown serde type 'weightszip'" in log, log[-3000:]


_WORKER = r"""
import asyncio, os, sys, time, torch
from lmcache.utils import CacheEngineKey
from lmcache.v1.config import LMCacheEngineConfig
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj
from lmcache.v1.metadata import LMCacheMetadata
from lmcache.v1.storage_backend.connector import ConnectorManager
go, config, worker, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])

class Backend:  # LocalCPUBackend's allocate and the engine metadata it carries
    metadata = LMCacheMetadata(model_name="m", world_size=world, local_world_size=world, worker_id=worker,
                               local_worker_id=worker, kv_dtype=torch.bfloat16, kv_shape=(2, 2, 16, 1, 8))
    def allocate(self, shape, dtype, fmt=None):
        n = torch.Size(shape).numel() * dtype.itemsize
        meta = MemoryObjMetadata(shape=torch.Size(shape), dtype=dtype, address=0, phy_size=n, ref_count=1, fmt=fmt)
        return TensorMemoryObj(torch.empty(n, dtype=torch.uint8), meta, None)

cfg = LMCacheEngineConfig.from_file(config)
conn = set_up(lambda: ConnectorManager("plugin://weightszip", None, Backend(), cfg).create_connector(),
              lambda c: c.store.config.path)
kv = torch.arange(2 * 2 * 16 * 8, dtype=torch.float32).reshape(2, 2, 16, 8).to(torch.bfloat16) + worker
obj = Backend().allocate(kv.shape, kv.dtype, MemoryFormat.KV_2LTD)
obj.tensor.copy_(kv)
key = CacheEngineKey(model_name="m", world_size=world, worker_id=worker, chunk_hash=7, dtype=torch.bfloat16)
async def run():
    await conn.put(key, obj)
    back = await conn.get(key)
    print("round trip", torch.equal(back.tensor.view(torch.int16), kv.view(torch.int16)), flush=True)
    await conn.close()
asyncio.run(run())
"""


def test_lmcache_workers_run_as_processes_on_one_path(tmp_path, side_by_side):
    """Two workers of one engine (vLLM with TP 2 runs one LMCache engine per worker process), built
    by LMCache's ConnectorManager from the example config: each opens path/worker<id>of2 (a store
    folder is one process's; the second worker failed, 'open in another process'); one worker keeps
    the configured path."""
    _lmcache()
    from pathlib import Path

    text = (Path(__file__).parent.parent / "examples" / "lmcache_inprocess.yaml").read_text()
    cfg = tmp_path / "lmcache.yaml"
    cfg.write_text(text.replace("/data/wz-kv", str(tmp_path / "kv")))
    runs = side_by_side(_WORKER, [(cfg, w, 2) for w in (0, 1)], site=os.environ.get("WEIGHTSZIP_LMCACHE_SITE"))
    for w, (rc, out, err) in enumerate(runs):
        assert rc == 0 and f"open {tmp_path / 'kv' / f'worker{w}of2'}\n" in out and "round trip True" in out, (
            out, err[-3000:])
    (rc, out, err), = side_by_side(_WORKER, [(cfg, 0, 1)], site=os.environ.get("WEIGHTSZIP_LMCACHE_SITE"))
    assert rc == 0 and f"open {tmp_path / 'kv'}\n" in out and "round trip True" in out, (out, err[-3000:])


def test_lmcache_connector_takes_every_store_option_and_refuses_unknown_keys(tmp_path):
    """Every ChunkStore option under remote_storage_plugin.weightszip. reaches the store (write_through,
    promote, max_chunk_bytes and redis_timeout_ms were dropped silently), flags parse strictly
    (durable "false" was bool("false"), True), LMCache's own keys and other plugins' are let be, and
    an unknown key of ours is an InvalidArgumentError naming it and the accepted ones."""
    wl = _lmcache()
    p = "remote_storage_plugin.weightszip."

    def connector(**opts):
        class Config:
            extra_config = {p + "module_path": "weightszip.integrations.lmcache", p + "class_name": "WeightszipConnector",
                            "remote_storage_plugin.other.path": 5, "something_else": True,
                            **{p + k: v for k, v in opts.items()}}

        return wl.WeightszipConnector(loop=None, local_cpu_backend=_Allocator(), config=Config())

    conn = connector(path=str(tmp_path), durable="false", write_through="true", promote=False, max_chunk_bytes=1 << 20,
                     redis_timeout_ms="250", io_threads=3, ram_bytes="4096", disk_bytes=0, redis_prefix="m:")
    c = conn.store.config
    assert (c.durable, c.write_through, c.promote, c.max_chunk_bytes, c.redis_timeout_ms) == (False, True, False, 1 << 20, 250)
    assert (c.path, c.io_threads, c.ram_bytes, c.disk_bytes, c.redis_prefix) == (str(tmp_path), 3, 4096, 0, "m:")
    conn.store.close()
    with pytest.raises(weightszip.InvalidArgumentError, match=r"'ram_byte'.*accepted: path, ram_bytes"):
        connector(ram_byte=5)
    for bad in ({"durable": "no"}, {"promote": 2}, {"ram_bytes": 1.5}, {"redis_url": 6379}):
        with pytest.raises(weightszip.InvalidArgumentError, match=next(iter(bad))):
            connector(**bad)


def test_lmcache_server_starts_with_the_documented_command(tmp_path):
    """docs/STORE.md's launch command, as written but for its port, L1 size and folder: it was
    '<LMCache server arguments>' plus the adapter, and the server needs --l1-size-gb and
    --eviction-policy, and --disable-observability where its opentelemetry exporters are not
    installed (as with scripts/lmcache_site.sh)."""
    _lmcache()
    import json
    import re
    import shlex
    from pathlib import Path

    doc = (Path(__file__).parent.parent / "docs" / "STORE.md").read_text()
    (block,) = [b for b in re.findall(r"```bash\n(.*?)```", doc, re.S) if "lmcache_server" in b]
    argv = shlex.split(block.replace("\\\n", " "))
    assert argv[:3] == ["python", "-m", "weightszip.integrations.lmcache_server"], argv
    args = argv[3:]
    for i, a in enumerate(args):
        if i and args[i - 1] == "--l1-size-gb":
            args[i] = "0.25"
        if i and args[i - 1] == "--l2-adapter":
            adapter = json.loads(a)
            assert adapter["serde"] == {"type": "weightszip"}
            adapter["base_path"] = str(tmp_path / "l2")
            args[i] = json.dumps(adapter)
    (tmp_path / "l2").mkdir()
    up, log = _server("weightszip.integrations.lmcache_server", tmp_path, args=args)
    assert up and "Initialized FSL2Adapter" in log, log[-3000:]
