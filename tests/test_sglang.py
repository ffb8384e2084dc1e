"""The SGLang HiCache backend, loaded by SGLang's own StorageBackendFactory ('dynamic'). SGLang
lives in its own folder (scripts/sglang_site.sh, run by .ci/run) named by WEIGHTSZIP_SGLANG_SITE;
without it these tests skip, unless WEIGHTSZIP_REQUIRE_SGLANG=1."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import weightszip  # noqa: E402
from test_store import real_kv  # noqa: E402


def _sglang():
    site = os.environ.get("WEIGHTSZIP_SGLANG_SITE")
    if site and site not in sys.path:
        sys.path.append(site)
    try:
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    except ImportError as e:
        if os.environ.get("WEIGHTSZIP_REQUIRE_SGLANG") == "1":
            pytest.fail(f"WEIGHTSZIP_REQUIRE_SGLANG=1 but sglang does not import: {e}")
        pytest.skip(f"sglang not importable (scripts/sglang_site.sh): {e}")
    return HiCacheStorageConfig, StorageBackendFactory


class HostPool:
    """Stands in for SGLang's MHA host pool (which needs a device KV pool): the attributes the
    backend reads."""

    head_num = 3
    head_dim = 64


def _pages(n_pages: int, page_tokens: int = 16) -> list:
    """Flat host pages of real SmolLM2 KV ([layers, 2, tokens, heads*dim] per page), bf16."""
    kv = torch.from_numpy(real_kv().view(np.int16).copy()).view(torch.bfloat16)  # [2, L, T, H]
    pages = []
    for p in range(n_pages):
        page = kv[:, :, p * page_tokens : (p + 1) * page_tokens, :].permute(1, 0, 2, 3).contiguous()
        pages.append(page.reshape(-1))
    return pages


def _backend(tmp_path: Path, **extra):
    Config, Factory = _sglang()
    cfg = Config(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=True,
        model_name="HuggingFaceTB/SmolLM2-135M",
        extra_config={
            "backend_name": "weightszip",
            "module_path": "weightszip.integrations.sglang",
            "class_name": "WeightszipHiCacheStorage",
            "path": str(tmp_path),
            "ram_bytes": 0,
            "durable": False,
            **extra,
        },
    )
    backend = Factory.create_backend("dynamic", cfg, None)
    backend.register_mem_pool_host(HostPool())
    return backend


@pytest.mark.skipif(__import__("shutil").which("redis-server") is None, reason="needs redis-server to stop one")
def test_a_redis_tier_that_cannot_answer_is_a_logged_miss(tmp_path, caplog):
    """HiCache asks batch_exists for the longest stored prefix: a page only Redis could answer for,
    with Redis gone, counts as absent (the pages are computed again) and says why in the log; the
    store's own contains raises for it."""
    from test_store_redis import _start_private

    p, url = _start_private()
    try:
        b = _backend(tmp_path, redis_url=url, redis_timeout_ms=500)
        pages = _pages(2)
        assert b.batch_set(["a", "b"], pages)
    finally:
        p.kill()
        p.wait()
    with caplog.at_level("WARNING", logger="weightszip.integrations.sglang"):
        assert b.batch_exists(["a", "elsewhere", "b"]) == 1
        assert b.exists("a") and not b.exists("elsewhere")
    assert sum("counted as absent" in r.getMessage() for r in caplog.records) == 2
    with pytest.raises(weightszip.WeightszipIOError):
        b.store.contains("elsewhere")


def test_sglang_dynamic_backend_round_trips_pages(tmp_path):
    b = _backend(tmp_path)
    from weightszip.integrations.sglang import WeightszipHiCacheStorage

    assert isinstance(b, WeightszipHiCacheStorage)
    pages = _pages(4)
    keys = [f"hash{i}" for i in range(4)]
    assert b.batch_set(keys, pages)
    assert b.exists("hash0") and not b.exists("other")
    assert b.batch_exists(keys[:2] + ["other"] + keys[2:]) == 2, "longest existing prefix"
    targets = [torch.zeros_like(p) for p in pages] + [torch.zeros_like(pages[0])]
    got = b.batch_get(keys + ["other"], targets)
    for g, p, t in zip(got, pages, targets):
        assert g is t and torch.equal(g.view(torch.int16), p.view(torch.int16))
    assert got[-1] is None
    st = b.get_stats()
    raw = sum(p.numel() * 2 for p in pages)
    assert st["disk_chunks"] == 4 and st["disk_bytes"] < 0.85 * raw, "pages are stored compressed"
    # One page, the single-key API, and a target of the wrong size is a miss, not a crash.
    assert b.set("one", pages[0]) and torch.equal(b.get("one", torch.empty_like(pages[0])), pages[0])
    assert b.get("one", torch.empty(10, dtype=torch.bfloat16)) is None


def test_sglang_level_option_reaches_the_encoder(tmp_path, monkeypatch):
    """``level`` in the extra config is the level the pages are coded at (the store's call sees it;
    they read back exactly); absent, the default; any other value is refused when the backend is
    built."""
    b = _backend(tmp_path / "a", level="1")
    seen = []
    real = b.store.put_tensors
    monkeypatch.setattr(b.store, "put_tensors", lambda items, **kw: seen.append(kw.get("level")) or real(items, **kw))
    pages = _pages(2)
    assert b.batch_set(["p0", "p1"], pages) and seen == [1]
    got = b.batch_get(["p0", "p1"], [torch.zeros_like(p) for p in pages])
    assert all(torch.equal(g.view(torch.int16), p.view(torch.int16)) for g, p in zip(got, pages))
    b.close()
    assert _backend(tmp_path / "b").level == weightszip._core.DEFAULT_LEVEL
    for bad in (0, 3, "fast", 1.5, True):
        with pytest.raises(weightszip.InvalidArgumentError, match="level"):
            _backend(tmp_path / "c", level=bad)


def test_sglang_backend_reports_a_damaged_page_as_a_miss(tmp_path):
    b = _backend(tmp_path)
    pages = _pages(2)
    assert b.batch_set(["a", "b"], pages)
    path = Path(b.store.file_of("a" + b.suffix))
    data = bytearray(path.read_bytes())
    data[-7] ^= 0x04
    path.write_bytes(bytes(data))
    got = b.batch_get(["a", "b"], [torch.empty_like(p) for p in pages])
    assert got[0] is None and torch.equal(got[1], pages[1])
    assert not b.exists("a"), "the damaged page was removed"
    b.close()


def test_sglang_backend_refuses_targets_and_pages_it_cannot_decode_into(tmp_path):
    """Targets the decoder cannot write whole at their address (a strided view, an expanded one,
    not a tensor) are misses and the memory around them is untouched; a page stored under the
    container tag whose bytes are not one is a miss too; keys that are not str, and a target list
    of another length than the keys, are typed errors; a value that is not a tensor is not stored."""
    b = _backend(tmp_path)
    pages = _pages(2)
    assert b.batch_set(["a", "b"], pages)
    n = pages[0].numel()
    base = torch.zeros(2 * n, dtype=pages[0].dtype)
    for target in (base[::2], torch.zeros(1, dtype=pages[0].dtype).expand(n), "not a tensor"):
        assert b.batch_get(["a"], [target]) == [None]
    assert not base.view(torch.int16).any(), "nothing written around a strided target"
    from weightszip.store import TAG_CONTAINER

    b.store.put("junk" + b.suffix, b"not a container at all", tag=TAG_CONTAINER)
    got = b.batch_get(["junk", "b"], [torch.empty_like(pages[0]), torch.empty_like(pages[1])])
    assert got[0] is None and torch.equal(got[1], pages[1])
    with pytest.raises(weightszip.InvalidArgumentError):
        b.batch_get(["a", "b"], [torch.empty_like(pages[0])])
    with pytest.raises(weightszip.InvalidArgumentError):
        b.batch_get([5])
    with pytest.raises(weightszip.InvalidArgumentError):
        b.batch_exists([b"a"])
    assert b.batch_set(["c"], [None]) is False and not b.exists("c")
    b.close()
    with pytest.raises(weightszip.InvalidArgumentError, match="durable"):
        _backend(tmp_path / "other", durable="no")
    _backend(tmp_path / "strings", durable="false").close()


def test_sglang_ranks_do_not_share_mha_pages(tmp_path):
    Config, Factory = _sglang()
    from weightszip.integrations.sglang import WeightszipHiCacheStorage
    from weightszip.store import ChunkStore

    store = ChunkStore(None)

    def rank(r, mla=False):
        cfg = Config(
            tp_rank=r, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=mla,
            enable_storage_metrics=False, is_page_first_layout=True, model_name="m", extra_config={},
        )
        return WeightszipHiCacheStorage(cfg, {}, store=store)

    p = _pages(1)
    assert rank(0).batch_set(["k"], p)
    assert not rank(1).exists("k")
    assert rank(0, mla=True).batch_set(["z"], p) and rank(1, mla=True).exists("z")


_RANK = r"""
import os, sys, time, torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
go, path, rank, tp, mla = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
cfg = HiCacheStorageConfig(tp_rank=rank, tp_size=tp, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
    is_mla_model=mla, enable_storage_metrics=False, is_page_first_layout=True, model_name="m",
    extra_config={"backend_name": "weightszip", "module_path": "weightszip.integrations.sglang",
                  "class_name": "WeightszipHiCacheStorage", "path": path, "durable": False})
b = set_up(lambda: StorageBackendFactory.create_backend("dynamic", cfg, None), lambda b: b.store.config.path)
page = torch.arange(3 * 64 * 4, dtype=torch.float32).to(torch.bfloat16) + rank
ok = b.batch_set([f"own{rank}", "shared"], [page, page])
print("set", ok, "exists", b.batch_exists([f"own{rank}", "shared"]), flush=True)
b.close()
"""


@pytest.mark.parametrize("mla", [False, True])
def test_sglang_tp_ranks_run_as_processes_on_one_path(tmp_path, side_by_side, mla):
    """Rank 0 and rank 1 of TP 2, two processes given the same path (as SGLang runs them): each opens
    its own subfolder, path/tp<rank>of2 (a store folder is one process's; the second rank failed,
    'open in another process'), and writes its pages there; a single-rank server keeps the path."""
    _sglang()
    site = os.environ.get("WEIGHTSZIP_SGLANG_SITE")
    runs = side_by_side(_RANK, [(tmp_path, r, 2, int(mla)) for r in (0, 1)], site=site)
    for r, (rc, out, err) in enumerate(runs):
        assert rc == 0 and f"open {tmp_path / f'tp{r}of2'}\n" in out and "set True exists 2" in out, (out, err[-3000:])
    b = _backend(tmp_path / "tp1of2")  # (rank 1's folder, opened as a single-rank store)
    assert b.store.config.path == str(tmp_path / "tp1of2")
    suffix = "_m" if mla else "_m_1_2"
    assert b.store.contains("own1" + suffix) and b.store.contains("shared" + suffix)
    assert not b.store.contains("own0" + suffix) and not b.store.contains("own0_m_0_2")
    b.close()


def test_sglang_rank_folders_name_every_parallel_dimension():
    Config, _ = _sglang()
    from weightszip.integrations.sglang import rank_folder

    def cfg(tp=(0, 1), pp=(0, 1), cp=(0, 1), dp=0):
        return Config(tp_rank=tp[0], tp_size=tp[1], pp_rank=pp[0], pp_size=pp[1], attn_cp_rank=cp[0],
                      attn_cp_size=cp[1], is_mla_model=False, enable_storage_metrics=False,
                      is_page_first_layout=True, model_name="m", dp_rank=dp)

    assert rank_folder(cfg()) is None, "one rank: the configured path itself"
    assert rank_folder(cfg(tp=(1, 2))) == "tp1of2"
    assert rank_folder(cfg(tp=(3, 4), pp=(1, 2))) == "tp3of4-pp1of2"
    assert rank_folder(cfg(pp=(1, 2))) == "pp1of2"
    assert rank_folder(cfg(tp=(0, 2), cp=(1, 2))) == "tp0of2-cp1of2"
    assert rank_folder(cfg(tp=(0, 2), dp=1)) == "dp1-tp0of2"


def test_sglang_extra_config_takes_every_store_option_and_refuses_unknown_keys(tmp_path):
    """Every ChunkStore option reaches the store (write_through, promote, max_chunk_bytes and
    redis_timeout_ms were dropped silently), yes/no values parse strictly, SGLang's own keys are let
    be, and a key that is neither is an InvalidArgumentError naming it and the accepted ones."""
    b = _backend(tmp_path, write_through="true", promote=False, max_chunk_bytes=1 << 20, redis_timeout_ms="250",
                 io_threads=3, disk_bytes=1 << 30, redis_prefix="m:", interface_v1=0, prefetch_threshold=256)
    c = b.store.config
    assert (c.write_through, c.promote, c.max_chunk_bytes, c.redis_timeout_ms) == (True, False, 1 << 20, 250)
    assert (c.io_threads, c.disk_bytes, c.redis_prefix, c.durable, c.ram_bytes) == (3, 1 << 30, "m:", False, 0)
    b.close()
    with pytest.raises(weightszip.InvalidArgumentError, match=r"'ram_byte'.*accepted: path, ram_bytes"):
        _backend(tmp_path, ram_byte=5)
    for bad in ({"promote": "no"}, {"ram_bytes": 1.5}, {"ram_bytes": "8GB"}, {"redis_prefix": 7},
                {"interface_v1": True}):
        with pytest.raises(weightszip.InvalidArgumentError, match=next(iter(bad))):
            _backend(tmp_path, **bad)


def _named(model_name, store, extra_config=None):
    Config, _ = _sglang()
    from weightszip.integrations.sglang import WeightszipHiCacheStorage

    cfg = Config(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                 enable_storage_metrics=False, is_page_first_layout=True, model_name=model_name,
                 extra_config={} if extra_config is None else extra_config)
    return WeightszipHiCacheStorage(cfg, store=store)


def test_sglang_extra_config_that_is_not_an_object_is_refused():
    # (a string, a list or a number: a ValueError or TypeError from dict())
    from weightszip.store import ChunkStore

    for bad in ("abc", [1], 5):
        with pytest.raises(weightszip.InvalidArgumentError, match="JSON object"):
            _named("m", ChunkStore(None), extra_config=bad)


def test_sglang_batch_set_refuses_sparse_and_meta_pages(tmp_path, caplog):
    # (torch's RuntimeError and NotImplementedError escaped batch_set; now the typed refusal, logged, False)
    b = _backend(tmp_path)
    page = _pages(1)[0]
    for bad in (torch.zeros(4, 4).to_sparse(), torch.zeros(4, device="meta")):
        assert b.batch_set(["bad", "good"], [bad, page]) is False
        assert not b.exists("bad") and not b.exists("good")
    assert "dense tensor" in caplog.text
    b.close()


def test_sglang_model_names_do_not_share_page_keys():
    """"org/m" and "org-m" were both "_org-m" in the keys: two servers sharing a store read each
    other's pages. A name without "-" or "%" keeps the key it had ("org/m" is "org-m")."""
    from weightszip.store import ChunkStore

    store = ChunkStore(None)
    page = _pages(1)[0]
    a, b = _named("org/m", store), _named("org-m", store)
    assert a.suffix == "_org-m_0_1" and _named("m", store).suffix == "_m_0_1"
    assert a.set("page", page) and a.exists("page")
    assert not b.exists("page") and b.get("page", torch.empty_like(page)) is None
    from weightszip.integrations.sglang import model_key

    names = ["org/m", "org-m", "org%2Dm", "org%m", "a/b-c", "a-b/c", "a/b/c", "a--b", "a/-b", "a-/b", "", "%", "%25"]
    assert len({model_key(n) for n in names}) == len(names)
