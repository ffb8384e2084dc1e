#!/usr/bin/env python3
"""Chunk store throughput and latency per tier, on real KV chunks of LMCache's default shape.

Chunks are [2, layers, 256 tokens, kv_heads * head_dim] bf16 (LMCache's KV_2LTD layout and
chunk size), cut from a real KV capture (``benchmarks/capture_kv.py``, or
``weightszip.models.capture`` when ``--capture`` is given). Each tier (RAM; disk with fsync,
read back cold: the page cache of each chunk file is dropped with posix_fadvise before reading;
Redis: a private redis-server on 127.0.0.1, or ``--redis-url``) stores the same chunks two ways through the same path:

* ``exact``: ``ChunkStore.put_tensors`` (the exact codec in Rust on the store's I/O pool, off the
  GIL) and ``get_tensors`` (verify + decode back to bf16, bit-identical);
* ``raw``: the uncompressed chunk bytes through ``put_many`` / ``get_many`` (what a naive serde
  stores), turned back into an array with ``np.frombuffer``.

Per tier and way: one-chunk put and get latency (median, p90), batched put and get throughput in
GB/s of *uncompressed* KV, bytes stored per token (files and headers included), chunks per GB.

    python benchmarks/bench_store.py --kv /tmp/kv/smollm2_8k.npy --chunks 24 --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import time
from pathlib import Path

import ml_dtypes
import numpy as np
from tqdm import tqdm

from weightszip.store import ChunkStore

CHUNK_TOKENS = 256  # LMCache's default chunk_size


def load_chunks(path: Path, n: int) -> tuple[list[np.ndarray], dict]:
    kv = np.load(path, mmap_mode="r")
    meta = json.loads(path.with_suffix(".json").read_text()) if path.with_suffix(".json").exists() else {}
    tokens = kv.shape[2]
    n = min(n, tokens // CHUNK_TOKENS)
    chunks = [
        np.ascontiguousarray(kv[:, :, i * CHUNK_TOKENS : (i + 1) * CHUNK_TOKENS, :]).view(ml_dtypes.bfloat16)
        for i in range(n)
    ]
    return chunks, {"file": str(path), "model": meta.get("model", "?"), "shape": list(chunks[0].shape)}


def drop_page_cache(paths) -> None:
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def start_redis():
    """A private redis-server (no persistence) on a free port of 127.0.0.1."""
    import socket
    import subprocess

    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    p = subprocess.Popen(
        ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
    )
    for _ in range(200):
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.5) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    return p, f"redis://127.0.0.1:{port}/"
        except OSError:
            time.sleep(0.05)
    p.kill()
    raise RuntimeError("redis-server did not start")


def pct(xs, q):
    return float(np.percentile(np.asarray(xs), q))


def chunk_files(d: Path):
    return [p for p in d.glob("??/*.wzc")]


def run_tier(tier: str, way: str, chunks: list[np.ndarray], args) -> dict:
    raw_bytes = sum(c.nbytes for c in chunks)
    keys = [f"bench@{way}@{i}" for i in range(len(chunks))]
    tmp = Path(tempfile.mkdtemp(prefix="wz-bench-", dir=args.dir))
    try:
        def open_store(sub: str) -> ChunkStore:
            if tier == "ram":
                return ChunkStore(None, ram_bytes=4 * raw_bytes, io_threads=args.io_threads)
            if tier == "redis":
                # RAM budget 0: every put goes to Redis, every get comes from Redis.
                return ChunkStore(
                    None, ram_bytes=0, promote=False, io_threads=args.io_threads,
                    redis_url=args.redis_url, redis_prefix=f"bench-{sub}:",
                )
            return ChunkStore(
                tmp / sub, ram_bytes=0, write_through=True, durable=True, promote=False, io_threads=args.io_threads
            )

        codec = args.codecs.get(way)

        def put_one(s, k, c):
            if codec is not None:
                return s.put_tensor(k, c, codec=codec)
            return s.put_tensor(k, c) if way == "exact" else s.put(k, c.view(np.uint16))

        def get_one(s, k):
            if way == "exact" or codec is not None:
                return s.get_tensor(k)
            return np.frombuffer(s.get(k), dtype=ml_dtypes.bfloat16)

        def same(back, c):
            if codec is not None:  # lossy: the format's own round trip, checked once per chunk
                return tuple(back.shape) == c.shape
            return back.view(np.uint16).tobytes() == c.view(np.uint16).tobytes()

        put_lat, get_lat, put_batch, get_batch = [], [], [], []
        stored = 0
        for rep in range(args.repeats):
            s = open_store(f"single{rep}")
            for k, c in zip(keys, chunks):
                t = time.perf_counter()
                put_one(s, k, c)
                put_lat.append(time.perf_counter() - t)
            if tier == "disk":
                drop_page_cache(chunk_files(tmp / f"single{rep}"))
            for k, c in zip(keys, chunks):
                t = time.perf_counter()
                back = get_one(s, k)
                get_lat.append(time.perf_counter() - t)
                assert same(back, c)
            st = s.stats()
            if tier == "disk":
                stored = st["disk_bytes"]
            elif tier == "ram":
                stored = st["ram_bytes"]
            else:  # Redis values are chunk files' bytes: header + key + payload
                stored = sum(64 + len(k) + len(s.get(k)) for k in keys)
            for k in keys:
                s.delete(k)
            s.close()
            del s

            s = open_store(f"batch{rep}")
            t = time.perf_counter()
            if codec is not None:
                s.put_tensors(dict(zip(keys, chunks)), codec=codec)
            elif way == "exact":
                s.put_tensors(dict(zip(keys, chunks)))
            else:
                s.put_many({k: c.view(np.uint16) for k, c in zip(keys, chunks)})
            put_batch.append(time.perf_counter() - t)
            if tier == "disk":
                drop_page_cache(chunk_files(tmp / f"batch{rep}"))
            t = time.perf_counter()
            if way == "exact" or codec is not None:
                backs = s.get_tensors(keys)
            else:
                backs = [np.frombuffer(b, dtype=ml_dtypes.bfloat16) for b in s.get_many(keys)]
            get_batch.append(time.perf_counter() - t)
            assert all(same(b, c) for b, c in zip(backs, chunks))
            for k in keys:
                s.delete(k)
            s.close()
            del s, backs
        tokens = len(chunks) * CHUNK_TOKENS
        per_chunk = stored / len(chunks)
        return {
            "tier": tier,
            "way": way,
            "chunks": len(chunks),
            "raw_bytes_per_chunk": chunks[0].nbytes,
            "stored_bytes_per_chunk": per_chunk,
            "stored_fraction": stored / raw_bytes,
            "bytes_per_token": stored / tokens,
            "chunks_per_gb": 1e9 / per_chunk,
            "put_ms_median": 1e3 * pct(put_lat, 50),
            "put_ms_p90": 1e3 * pct(put_lat, 90),
            "get_ms_median": 1e3 * pct(get_lat, 50),
            "get_ms_p90": 1e3 * pct(get_lat, 90),
            "put_batch_gbps": raw_bytes / np.median(put_batch) / 1e9,
            "get_batch_gbps": raw_bytes / np.median(get_batch) / 1e9,
        }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def run_lmcache_serdes(chunks: list[np.ndarray], repeats: int) -> list[dict]:
    """Per-chunk serialize / deserialize through LMCache's serde classes: none (the bytes as they
    are, what LMCache stores without a serde), LMCache's fp8 serde (lossy), ours (exact)."""
    import torch
    from lmcache.v1.distributed.api import MemoryLayoutDesc
    from lmcache.v1.distributed.serde.fp8 import Fp8QuantizationDeserializer, Fp8QuantizationSerializer
    from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

    from weightszip.integrations.lmcache import WeightszipDeserializer, WeightszipSerializer

    def obj(shape, dtype):
        n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
        meta = MemoryObjMetadata(torch.Size(shape), dtype, 0, n, 1, fmt=MemoryFormat.KV_2LTD)
        return TensorMemoryObj(torch.zeros(n, dtype=torch.uint8), meta, None)

    class Naive:
        def serialize(self, src, dst, key=None):
            n = src.tensor.numel() * 2
            dst.tensor.view(-1)[:n].copy_(src.tensor.reshape(-1).view(torch.uint8))
            return n

        def estimate_serialized_size(self, layout):
            return torch.Size(layout.shapes[0]).numel() * 2

        def deserialize(self, src, dst, key=None):
            dst.tensor.copy_(src.tensor.view(-1)[: dst.tensor.numel() * 2].view(torch.bfloat16).view(dst.tensor.shape))

    serdes = [
        ("none (raw bytes)", Naive(), Naive(), True),
        ("LMCache fp8 (lossy)", Fp8QuantizationSerializer(), Fp8QuantizationDeserializer(), False),
        ("weightszip exact", WeightszipSerializer(threads=0), WeightszipDeserializer(threads=0), True),
    ]
    rows = []
    tensors = [torch.from_numpy(c.view(np.int16)).view(torch.bfloat16) for c in chunks]
    for name, ser, de, exact in tqdm(serdes, desc="lmcache serdes"):
        ser_t, de_t, stored = [], [], []
        for _ in range(repeats):
            for t in tensors:
                src = obj(t.shape, torch.bfloat16)
                src.tensor.copy_(t)
                size = ser.estimate_serialized_size(MemoryLayoutDesc(shapes=[t.shape], dtypes=[torch.bfloat16]))
                tmp = obj((size,), torch.uint8)
                a = time.perf_counter()
                n = ser.serialize(src, tmp, None)
                ser_t.append(time.perf_counter() - a)
                stored.append(n)
                dst = obj(t.shape, torch.bfloat16)
                a = time.perf_counter()
                de.deserialize(tmp, dst, None)
                de_t.append(time.perf_counter() - a)
                if exact:
                    assert torch.equal(dst.tensor.view(torch.int16), t.view(torch.int16))
        raw = tensors[0].numel() * 2
        rows.append({
            "serde": name,
            "exact": exact,
            "stored_fraction": float(np.mean(stored)) / raw,
            "serialize_ms_median": 1e3 * pct(ser_t, 50),
            "deserialize_ms_median": 1e3 * pct(de_t, 50),
            "serialize_gbps": raw / pct(ser_t, 50) / 1e9,
            "deserialize_gbps": raw / pct(de_t, 50) / 1e9,
        })
    return rows


def serde_table(rows: list[dict]) -> str:
    head = "| serde | bit-exact | stored / raw | serialize ms (GB/s) | deserialize ms (GB/s) |\n|---|---|---|---|---|\n"
    return head + "".join(
        f"| {r['serde']} | {'yes' if r['exact'] else 'no'} | {r['stored_fraction']:.3f} | "
        f"{r['serialize_ms_median']:.1f} ({r['serialize_gbps']:.2f}) | {r['deserialize_ms_median']:.1f} ({r['deserialize_gbps']:.2f}) |\n"
        for r in rows
    )


def table(rows: list[dict]) -> str:
    head = (
        "| tier | stored as | stored / raw | bytes per token | chunks per GB | put ms (median, p90) | "
        "get ms (median, p90) | batched put GB/s | batched get GB/s |\n|---|---|---|---|---|---|---|---|---|\n"
    )
    body = "".join(
        f"| {r['tier']} | {r['way']} | {r['stored_fraction']:.3f} | {r['bytes_per_token']:.0f} | "
        f"{r['chunks_per_gb']:.0f} | {r['put_ms_median']:.1f}, {r['put_ms_p90']:.1f} | "
        f"{r['get_ms_median']:.1f}, {r['get_ms_p90']:.1f} | {r['put_batch_gbps']:.2f} | {r['get_batch_gbps']:.2f} |\n"
        for r in rows
    )
    return head + body


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kv", type=Path, help="a capture from benchmarks/capture_kv.py (.npy, LMCache layout)")
    ap.add_argument("--capture", help="capture this model (e.g. smollm2) instead of --kv")
    ap.add_argument("--text", type=Path, help="text for --capture")
    ap.add_argument("--chunks", type=int, default=24, help="256-token chunks to use")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--io-threads", type=int, default=2)
    ap.add_argument("--tiers", default="ram,disk,redis")
    ap.add_argument("--redis-url", help="Redis for the redis tier (default: start a private redis-server)")
    ap.add_argument("--calibration", type=Path, help="a .wzcal of the model: adds the compact formats (RAM tier)")
    ap.add_argument("--lmcache", action="store_true", help="also time LMCache's serdes against ours (needs lmcache)")
    ap.add_argument("--dir", default=None, help="folder for the disk tier (default: the system's temp)")
    ap.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "store")
    a = ap.parse_args(argv)
    if a.capture:
        from weightszip.models import capture

        kv, meta = capture(a.capture, a.text, a.chunks * CHUNK_TOKENS)
        path = Path(tempfile.mkdtemp()) / "kv.npy"
        np.save(path, kv)
        path.with_suffix(".json").write_text(json.dumps(meta))
        a.kv = path
    if a.kv is None:
        ap.error("give --kv or --capture")
    chunks, src = load_chunks(a.kv, a.chunks)
    server = None
    if "redis" in a.tiers.split(",") and not a.redis_url:
        server, a.redis_url = start_redis()
    rows = []
    jobs = [(t, w) for t in a.tiers.split(",") for w in ("raw", "exact")]
    a.codecs = {}
    if a.calibration:
        from weightszip.compact.calibrate import Calibration
        from weightszip.integrations.compact_chunks import CompactChunkCodec
        from weightszip.store import register_codec

        cal = Calibration.load(a.calibration)
        for fmt in ("q4", "q3.5", "q3"):
            a.codecs[fmt] = register_codec(CompactChunkCodec(cal, fmt), replace=True)
            jobs.append(("ram", fmt))
    try:
        for tier, way in tqdm(jobs, desc="tiers"):
            rows.append(run_tier(tier, way, chunks, a))
    finally:
        if server is not None:
            server.kill()
            server.wait()
    info = {
        "command": "python benchmarks/bench_store.py " + " ".join(argv if argv is not None else os.sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.platform()}",
        "source": src,
        "rows": rows,
        "lmcache_serdes": run_lmcache_serdes(chunks, a.repeats) if a.lmcache else [],
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.with_suffix(".json").write_text(json.dumps(info, indent=1) + "\n")
    md = f"{info['command']}  \n{info['date']}, {info['machine']}; chunks {src['shape']} bf16 from {src['model']}\n\n"
    md += table(rows)
    if info["lmcache_serdes"]:
        md += "\nThrough LMCache's serde classes (one chunk at a time, in the calling thread):\n\n"
        md += serde_table(info["lmcache_serdes"])
    a.out.with_suffix(".md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
