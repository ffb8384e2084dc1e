#!/usr/bin/env python3
"""A/B of compact-page decode kernel configurations on the GPU: the same random pages and queries for
every variant, rounds interleaved (variant order rotated each round), each variant's output compared
with the first variant's bit for bit (and its largest difference relative to the output's largest
value), median time per variant and its ratio to the first.

A variant is ``default`` (``DEFAULT_CONFIGS[PAGE_COMPACT]``) or comma-separated ``field=value``
changes to it, ``name:`` optional in front (``bulk:gluon_bulk_copy=1,gluon_v_pad=1``); values are
int, ``true``/``false`` or ``0``/``1`` for bools. ``name@FILE`` is the default configuration run by
another copy of the Gluon kernels' module (``paged_decode_gluon.py``, e.g. from an earlier commit:
``git show REF:triton_kernels/paged_decode_gluon.py > FILE``), to time a change of the kernels'
source against what it replaced::

    python benchmarks/ab_decode_configs.py default bulk:gluon_bulk_copy=1 \\
        --formats q4,q3 --points llama8b:8:32768,llama8b:64:131072 --rounds 3 --out ab.json

``--once`` runs each case once without timing (for Nsight Compute: ``ncu --kernel-name regex:split``).
The summary gives each variant's geometric-mean speedup over the first and whether every output was
bit-identical. Needs a CUDA GPU; the shared-memory cap is raised to the H200's/H100's 227 KiB.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_decode_attention as BD  # noqa: E402
from weightszip.kernels import PagedDecodeAttention  # noqa: E402
import weightszip.kernels.paged_decode as pd  # noqa: E402

DEFAULT_POINTS = "llama8b:8:32768,llama8b:64:32768,llama8b:64:131072,llama70b-tp8:8:32768,llama70b-tp8:64:131072"


def parse_variant(spec: str) -> tuple[str, dict]:
    """``[name:]field=value,...``, ``default`` or ``name@FILE`` -> (name, changes); a ``name@FILE``
    variant's changes are ``{"@": FILE}``."""
    if "@" in spec:
        name, _, path = spec.partition("@")
        return name, {"@": path}
    name, sep, body = spec.partition(":")
    if not sep:
        name, body = spec, spec
    return name, ({} if body in ("", "default") else BD.config_changes(body))


def kernel_module(path: str, name: str):
    """The Gluon kernels' module loaded from ``path`` as a module of ``weightszip.kernels`` (its
    relative imports resolve there; Triton reads its kernels' source from the file)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"weightszip.kernels._ab_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def run_with(mod, att, inp, kw):
    """``att.run`` with ``mod`` as ``weightszip.kernels.paged_decode_gluon`` (the launcher imports the
    module by that name at each call)."""
    import importlib

    import weightszip.kernels as kernels

    key = "weightszip.kernels.paged_decode_gluon"
    own = importlib.import_module(key)
    sys.modules[key] = mod
    kernels.paged_decode_gluon = mod
    try:
        return att.run(*inp, **kw)
    finally:
        sys.modules[key] = own
        kernels.paged_decode_gluon = own


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("variants", nargs="+", help="default | [name:]field=value,...")
    ap.add_argument("--formats", default="q4,q3", help="compact formats (bench_decode_attention.COMPACT keys)")
    ap.add_argument("--points", default=DEFAULT_POINTS, help="shape:batch:context,...")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=30, help="do_bench milliseconds per timing")
    ap.add_argument("--once", action="store_true", help="run each case once, untimed (for a profiler)")
    ap.add_argument("--out", help="JSON of every timing")
    args = ap.parse_args(argv)

    variants = dict(parse_variant(v) for v in args.variants)
    base = pd.DEFAULT_CONFIGS[pd.PAGE_COMPACT]
    files = {n: ch.pop("@") for n, ch in variants.items() if "@" in ch}
    modules = {n: kernel_module(f, n) for n, f in files.items()}
    configs = {n: dataclasses.replace(base, **ch) for n, ch in variants.items()}
    pd.GLUON_MAX_SMEM = 227 * 1024
    names = list(configs)
    points = [(p.split(":")[0], int(p.split(":")[1]), int(p.split(":")[2])) for p in args.points.split(",")]
    res: dict[str, dict] = {}
    for shape, B, L in points:
        Hq, Hkv, D = BD.SHAPES[shape]
        for fmt in args.formats.split(","):
            gen = torch.Generator(device="cuda").manual_seed(0)
            kp, vp, bt, tabs, extra = BD.compact_inputs(fmt, B, L, Hq, Hkv, D, gen)
            q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device="cuda", generator=gen)
            kb, vb = BD.COMPACT[fmt]
            fns, atts = {}, {}
            for n, cfg in configs.items():
                att = atts[n] = PagedDecodeAttention(Hq, Hkv, D, page_type="compact", k_bits=kb, v_bits=vb,
                                                     device="cuda", config=cfg)
                att.plan([L] * B, bt, rope="rope_coef" in extra)
                fns[n] = lambda att=att, inp=(q, kp, vp), kw={**tabs, **extra}, mod=modules.get(n): (
                    att.run(*inp, **kw) if mod is None else run_with(mod, att, inp, kw))
            key = f"{shape}:{B}x{L}:{fmt}"
            outs = {n: fns[n]().float() for n in names}
            ref = outs[names[0]]
            row = res[key] = {n: dict(ms=[], same=bool(torch.equal(o, ref)), kernel=atts[n].last_split_kernel,
                                      rel=float((o - ref).abs().max() / ref.abs().max().clamp_min(1e-30)))
                              for n, o in outs.items()}
            if args.once:
                torch.cuda.synchronize()
                print(key, {n: (row[n]["same"], f"{row[n]['rel']:.1e}") for n in names}, flush=True)
                continue
            for r in range(args.rounds):
                order = names[r % len(names):] + names[: r % len(names)]
                for n in order:
                    row[n]["ms"].append(BD.bench(fns[n], args.rep) * 1e3)
            med = {n: sorted(row[n]["ms"])[len(row[n]["ms"]) // 2] for n in names}
            for n in names:
                row[n]["median_ms"] = med[n]
                row[n]["speedup"] = med[names[0]] / med[n]
            print(key, "  ".join(f"{n} {med[n]:.4f} ms ({row[n]['speedup']:.3f}x{'' if row[n]['same'] else ' DIFF %.1e' % row[n]['rel']})"
                                 for n in names), flush=True)
            del kp, vp, bt, tabs, extra, q, fns, atts, outs, ref
            torch.cuda.empty_cache()
    if not args.once:
        print("\nsummary: geometric-mean speedup over", names[0])
        for n in names[1:]:
            sp = [res[k][n]["speedup"] for k in res]
            same = all(res[k][n]["same"] for k in res)
            g = math.exp(sum(math.log(s) for s in sp) / len(sp))
            print(f"  {n}: {g:.3f}x over {len(sp)} cases (min {min(sp):.3f}, max {max(sp):.3f}), bit-identical {same}")
    if args.out:
        meta = dict(variants={n: variants[n] for n in names}, kernel_files=files, device=torch.cuda.get_device_name(),
                    torch=torch.__version__)
        Path(args.out).write_text(json.dumps(dict(meta=meta, results=res), indent=1))


if __name__ == "__main__":
    main()
