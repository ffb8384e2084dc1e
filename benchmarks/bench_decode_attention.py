"""Decode attention on the GPU: torch SDPA flash (bf16, dense cache) against our paged kernels
(bf16 and fp8 e4m3 pages, and the compact formats q4, q3.5, q3; one code path), over the issue-5 grid.

    python benchmarks/bench_decode_attention.py [--tune] [--tune-compact] [--check] [--write]
        [--out benchmarks/results/decode_attention]

Compact formats: bit widths per layer as in COMPACT below, the same in every layer (q4: K 4 + V 4
bits; q3.5: K 4 + V 3; q3: K 3 + V 3; head_dim 128: (bits * 16 + 1) bytes per token, KV head and
kind); random page bytes (every byte pattern is a valid page), random codebooks and scale grids,
and the transformed-domain path the formats use (q', logit bias, inverse V transform and mean), with
the tokens the formats keep in bf16 (``--side``: 4 sinks and the last 128 tokens by default, read by
the merge kernel; the pages hold the tokens between them).
``--tune-compact`` sweeps the compact kernel's launch parameters (tensor-core or CUDA-core
products, tokens per step, warps, stages) on q4 at four grid points; ``--write`` times the cache-write
kernel (one decode step's tokens and an 8k-token prefill, per layer and kind).

Shapes: Llama-3.1-8B layer (32 q heads, 8 kv heads, head_dim 128) and a 70B layer under 8-way tensor
parallelism (8 q heads, 1 kv head); batch 8, 16, 32, 64; context 32k, 64k, 128k (every sequence of a
batch at the full context). Random data (timing does not depend on the values); pages scattered over
the pool by a random permutation, as a long-running server's would be.

Time: each kernel call captured in a CUDA graph, replayed under ``triton.testing.do_bench`` (CUDA
events, L2 flushed before each replay, warm-up, median): GPU time without Python launch overhead.
``plan()`` runs once per step for all layers and is not timed. Bytes read are counted exactly: every
K and V byte of the cached tokens, the block-table entries each KV head reads, q, and (fp8) the
scales; the split workspace (written, then read by the merge) is not counted. Bandwidth efficiency =
bytes read / time / the read bandwidth of a plain ``sum`` over a 4 GiB tensor measured in the same run.

``--tune`` first sweeps the split kernel's launch parameters (tokens per step, warps, pipeline stages,
waves) at four grid points and uses, per page type, the one with the best geometric-mean time.
``--check`` compares the kernels with the fp64 reference at real shapes before timing.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import itertools
import json
import math
import pathlib
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]

SHAPES = {"llama8b": (32, 8, 128), "llama70b-tp8": (8, 1, 128)}
KERNELS = ("sdpa", "bf16", "fp8", "q4", "q3.5", "q3", "q4+rope", "q3.5+rope", "q3+rope", "q4+rope24", "q3+rope24",
           "q4+pairs", "q3.5+pairs", "q3+pairs", "q4+triton", "q3.5+triton", "q3+triton",
           "q4+rope+triton", "q4+rope24+triton", "q3+rope24+triton", "fp8+triton", "fp8+gluon", "q4+gluon",
           "q3.5+gluon", "q3+gluon", "q4+rope+table", "q3.5+rope+table", "q3+rope+table", "q4+rope24+table",
           "q3+rope24+table", "q4+rope+pos", "q3.5+rope+pos", "q3+rope+pos", "q4+rope24+pos", "q3+rope24+pos",
           "q4+rope+lanes", "q3.5+rope+lanes", "q3+rope+lanes", "q4+rope24+lanes", "q3+rope24+lanes")
COMPACT = {"q4": (4, 4), "q3.5": (4, 3), "q3": (3, 3)}  # (K bits, V bits) in every layer
# "+rope": the same with rotary K offsets (calibrations with rope_m: the per-key q . r(p) term) in every
# RoPE pair; "+rope24": in 24 of the 64 pairs (``rope_pairs``), what `weightszip calibrate
# --rope-min-ratio 2` keeps (27-42% of the pairs on SmolLM2 and Qwen2.5)
COMPACT.update({f"{k}+rope": v for k, v in list(COMPACT.items())})
COMPACT.update({f"{k}+rope24": COMPACT[k] for k in ("q4", "q3")})
# q4, q3.5, q3 and the "+rope" kinds: the Gluon kernel (paged_decode_gluon, the default on the GPU,
# from KernelConfig.gluon_min_work / gluon_rope_min_work of work; the Triton kernel below);
# "+triton": the Triton split kernel. Its codebook lookups (KernelConfig.reg_lut_bits): in registers
# when K and V are both 3 bits (q3), from pair tables in memory otherwise; "+pairs": always pair
# tables (width 4, nibble rows, always reads pairs: the "+lut4" kinds, registers at 16 entries, are gone).
LOOKUP = {"+pairs": 0}
COMPACT.update({f"{k}{v}": COMPACT[k] for k in ("q4", "q3.5", "q3") for v in LOOKUP})
COMPACT.update({f"{k}+triton": COMPACT[k] for k in ("q4", "q3.5", "q3")})
COMPACT.update({f"{k}+triton": COMPACT[k] for k in ("q4+rope", "q4+rope24", "q3+rope24")})
# "+gluon": the Gluon kernel at any amount of work (gluon_min_work 0), as "fp8+gluon"
COMPACT.update({f"{k}+gluon": COMPACT[k] for k in ("q4", "q3.5", "q3")})
# the rotary kinds' config suffixes (the compact default's fields they change; ``kind_config``):
ROPE_VARIANTS = {
    # the rotary term from tables in shared memory (KernelConfig.gluon_rope_table)
    "+table": {"gluon_rope_table": True},
    # ... with each page's cos and sin copied into its slot (KernelConfig.gluon_rope_pos; every rotary
    # kind passes ``rope_pos_table``, which the other configs leave unused)
    "+pos": {"gluon_rope_table": True, "gluon_rope_pos": True},
    # ... computed once a warp into its slot, a value a lane (KernelConfig.gluon_rope_lanes)
    "+lanes": {"gluon_rope_table": True, "gluon_rope_lanes": True},
    # ... Q in the B operand's padding columns (KernelConfig.gluon_rope_fold; groups up to 4)
    "+fold": {"gluon_rope_table": True, "gluon_rope_fold": True},
    # ... the padding columns' records not loaded (KernelConfig.gluon_rope_skip_pad; groups under 8), the
    # fold (on in the default since session 45, taking precedence) off
    "+skip": {"gluon_rope_table": True, "gluon_rope_skip_pad": True, "gluon_rope_fold": False},
}
COMPACT.update({f"{k}{v}": COMPACT[k] for k in ("q4+rope", "q3.5+rope", "q3+rope", "q4+rope24", "q3+rope24")
                for v in ROPE_VARIANTS})


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--batches", default="8,16,32,64")
    p.add_argument("--contexts", default="32768,65536,131072")
    p.add_argument("--tune", action="store_true", help="sweep launch parameters first and use the best")
    p.add_argument("--check", action="store_true", help="check kernels against the reference at real shapes")
    p.add_argument("--tune-compact", action="store_true", help="sweep the compact kernel's launch parameters")
    p.add_argument("--write", action="store_true", help="time the compact cache-write kernel")
    p.add_argument("--compact-sweep", default=COMPACT_SWEEP,
                   help="--tune-compact's configurations: block_n:warps:stages:cuda_dot,...")
    # "fp8": the fp8 default (the Gluon kernel where it applies); "fp8+triton": the Triton kernel;
    # "fp8+gluon": the Gluon kernel with gluon_min_work 0 (the default's value now; not by default,
    # nor the rotary kinds)
    p.add_argument("--kernels", default=",".join(k for k in KERNELS if "+rope" not in k and not k.endswith("+gluon")),
                   help=f"comma-separated, of {', '.join(KERNELS)}")
    p.add_argument("--side", default="4,128",
                   help="SINKS,WINDOW: the tokens the compact kinds keep in bf16 beside their pages (the "
                        "calibrated formats' defaults; 0,0 for pages only). bf16, fp8 and sdpa have none")
    p.add_argument("--rep", type=int, default=100, help="do_bench rep (ms)")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "decode_attention"),
                   help="output prefix: writes PREFIX.json, PREFIX.md, PREFIX.png")
    return p.parse_args(argv)


def config_changes(text: str) -> dict:
    """``field=value,...`` -> changes to a ``KernelConfig`` (int fields, and bool fields as 0/1 or
    true/false); a name that is no field, or a bool given anything else, is refused with SystemExit."""
    from weightszip.kernels import KernelConfig

    types = {f.name: f.type for f in dataclasses.fields(KernelConfig)}
    changes = {}
    for item in [t for t in text.split(",") if t]:
        key, eq, val = item.partition("=")
        if not eq or key not in types:
            raise SystemExit(f"{item!r} is not field=value of KernelConfig ({', '.join(types)})")
        if types[key] in (bool, "bool"):
            if val.lower() not in ("0", "1", "true", "false"):
                raise SystemExit(f"{key} takes 0/1/true/false, not {val!r}")
            changes[key] = val.lower() in ("1", "true")
        else:
            changes[key] = int(val)
    return changes


def bench(fn, rep, graph=True):
    """Median seconds of one call. With ``graph``, the call is captured in a CUDA graph first and
    the graph is replayed, so that Python and launch overhead (our run() validates its arguments and
    launches two kernels) is not timed: a server replays decode steps as graphs too."""
    import triton.testing

    if not graph:
        return triton.testing.do_bench(fn, warmup=25, rep=rep, return_mode="median") * 1e-3
    fn()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    t = triton.testing.do_bench(g.replay, warmup=25, rep=rep, return_mode="median") * 1e-3
    del g
    return t


def read_bandwidth(rep):
    x = torch.ones(1 << 30, dtype=torch.float32, device="cuda")  # 4 GiB
    t = bench(lambda: x.sum(), rep, graph=False)
    bw = x.numel() * 4 / t
    return bw


def make_paged(B, L, Hkv, D, dtype, gen):
    """Pool of B * L / 16 blocks [n, Hkv, 16, D], block table = a random permutation of the pool."""
    nblk = B * L // 16
    if dtype == torch.bfloat16:
        k = torch.randn(nblk, Hkv, 16, D, dtype=dtype, device="cuda", generator=gen)
        v = torch.randn(nblk, Hkv, 16, D, dtype=dtype, device="cuda", generator=gen)
    else:  # fp8 e4m3: random finite codes (0x00..0x7d, random sign)
        def codes():
            c = torch.randint(0, 0x7E, (nblk, Hkv, 16, D), dtype=torch.uint8, device="cuda", generator=gen)
            return (c | (torch.randint(0, 2, c.shape, dtype=torch.uint8, device="cuda", generator=gen) << 7)).view(dtype)
        k, v = codes(), codes()
    bt = torch.randperm(nblk, device="cuda", generator=gen).to(torch.int32).view(B, L // 16)
    return k, v, bt


def time_sdpa(B, L, Hq, Hkv, D, rep, gen):
    """torch SDPA with the flash backend on a dense bf16 cache [B, Hkv, L, D]; the faster of two ways
    to run GQA decode: enable_gqa=True with one query row, or the G query heads of a KV head as G
    query rows of one head (same math, no mask). Returns (seconds, variant, bytes read); seconds is
    None (variant says why) where the dense cache does not fit in what is left of GPU memory."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    G = Hq // Hkv
    nbytes = 2 * B * Hkv * L * D * 2 + B * Hq * D * 2
    try:
        k = torch.randn(B, Hkv, L, D, dtype=torch.bfloat16, device="cuda", generator=gen)
        v = torch.randn(B, Hkv, L, D, dtype=torch.bfloat16, device="cuda", generator=gen)
    except torch.OutOfMemoryError:
        # the dense cache beside what the caller holds (paged caches) does not fit: no SDPA figure
        k = v = None
        torch.cuda.empty_cache()
        return None, f"out of memory (dense bf16 K+V {nbytes / 2**30:.0f} GiB)", nbytes
    q = torch.randn(B, Hq, 1, D, dtype=torch.bfloat16, device="cuda", generator=gen)
    qg = q.view(B, Hkv, G, D)
    times = {}
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        try:
            times["enable_gqa"] = bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), rep)
        except RuntimeError as e:  # flash may refuse GQA in some builds
            print(f"sdpa enable_gqa: {e}", file=sys.stderr)
        times["rows"] = bench(lambda: F.scaled_dot_product_attention(qg, k, v), rep)
    best = min(times, key=times.get)
    return times[best], best, nbytes


def time_paged(kind, B, L, Hq, Hkv, D, rep, gen, config):
    from weightszip.kernels import PagedDecodeAttention

    dtype = torch.bfloat16 if kind == "bf16" else torch.float8_e4m3fn
    k, v, bt = make_paged(B, L, Hkv, D, dtype, gen)
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device="cuda", generator=gen)
    attn = PagedDecodeAttention(Hq, Hkv, D, page_type=kind, config=config, device="cuda")
    info = attn.plan([L] * B, bt)
    kw = {}
    if kind == "fp8":
        kw = dict(k_scale=torch.full((Hkv,), 1 / 64, device="cuda"), v_scale=torch.full((Hkv,), 1 / 64, device="cuda"))
    out = torch.empty(B, Hq, D, dtype=torch.bfloat16, device="cuda")
    t = bench(lambda: attn.run(q, k, v, out=out, **kw), rep)
    per_tok = 2 * D * (2 if kind == "bf16" else 1)
    nbytes = attn.bytes_read(per_tok) + (2 * Hkv * 4 if kind == "fp8" else 0)
    return t, nbytes, info


def kind_config(kind: str):
    """The compact default changed as a kind's last suffix asks (``+triton``, ``+gluon``, ``+table``,
    ``+pos``, ``+lanes``, ``+fold``, ``+skip``: ``ROPE_VARIANTS``; or a lookup width), or None (the default)
    for a kind without one."""
    suffix = "+" + kind.split("+")[-1]
    if not (suffix in LOOKUP or suffix in ROPE_VARIANTS or suffix in ("+triton", "+gluon")):
        return None
    from weightszip.kernels import DEFAULT_CONFIGS
    from weightszip.kernels.paged_decode import PAGE_COMPACT

    change = ({"gluon": True, "gluon_min_work": 0} if suffix == "+gluon" else ROPE_VARIANTS[suffix]
              if suffix in ROPE_VARIANTS else
              {"gluon": False, **({"reg_lut_bits": LOOKUP[suffix]} if suffix in LOOKUP else {})})
    return dataclasses.replace(DEFAULT_CONFIGS[PAGE_COMPACT], **change)


def compact_inputs(name, B, L, Hq, Hkv, D, gen):
    """Random compact pages (block size 16) and tables for format ``name``."""
    kb, vb = COMPACT[name]
    nblk = B * L // 16
    kp = torch.randint(0, 256, (nblk, Hkv, 1, 16 * (kb * D // 8 + 1)), dtype=torch.uint8, device="cuda", generator=gen)
    vp = torch.randint(0, 256, (nblk, Hkv, 1, 16 * (vb * D // 8 + 1)), dtype=torch.uint8, device="cuda", generator=gen)
    bt = torch.randperm(nblk, device="cuda", generator=gen).to(torch.int32).view(B, L // 16)

    def cb(bits):
        return torch.sort(torch.rand(Hkv, 2**bits, device="cuda", generator=gen) * 2 - 1, dim=1)[0].contiguous()

    grid = (2.0 ** (torch.arange(256, device="cuda") / 16 - 12)).float().expand(Hkv, 256).contiguous()
    tabs = dict(k_codebook=cb(kb).to(torch.bfloat16), v_codebook=cb(vb).to(torch.bfloat16), k_grid=grid, v_grid=grid)
    extra = dict(q_transformed=torch.randn(B, Hq, D, device="cuda", generator=gen),
                 logit_bias=torch.randn(B, Hq, device="cuda", generator=gen),
                 v_inv_transform=torch.randn(Hkv, D, D, device="cuda", generator=gen) / D,
                 v_mean=torch.randn(Hkv, D, device="cuda", generator=gen))
    if "+rope" in name:
        from weightszip.compact.calibrate import rope_phase_steps

        inv = 5e5 ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)  # Llama-3's RoPE base
        coef = torch.randn(B, Hq, 2, D // 2, device="cuda", generator=gen)
        from weightszip.kernels import rope_page_table

        phase = rope_phase_steps(inv).to("cuda")
        extra.update(rope_coef=coef, rope_phase=phase, rope_pos_table=rope_page_table(phase, L))
        n_pairs = int(name.split("+rope")[1].split("+")[0] or D // 2)
        if n_pairs < D // 2:  # the listed pairs only; the others' coefficients 0, as calibration leaves them
            pairs = torch.randperm(D // 2, device="cuda", generator=gen)[:n_pairs].sort().values
            off = torch.ones(D // 2, dtype=torch.bool, device="cuda")
            off[pairs] = False
            coef[..., off] = 0.0
            extra["rope_pairs"] = pairs.to(torch.int32).contiguous()
    return kp, vp, bt, tabs, extra


def time_compact(name, B, L, Hq, Hkv, D, rep, gen, config, side=(0, 0)):
    """Time, bytes read and plan info of the compact kernel for format ``name``; ``side`` = (sinks,
    window): the tokens the format keeps in bf16 (read by the merge kernel; the pages then hold the
    tokens between them)."""
    from weightszip.kernels import PagedDecodeAttention

    kb, vb = COMPACT[name]
    kp, vp, bt, tabs, extra = compact_inputs(name, B, L, Hq, Hkv, D, gen)
    S, W = side
    if S + W:
        extra = dict(extra, **{n: torch.randn(B, S + W, Hkv, D, device="cuda", generator=gen).to(torch.bfloat16)
                               for n in ("k_side", "v_side")})
    if config is not None and config.cuda_dot:
        tabs = {**tabs, "k_codebook": tabs["k_codebook"].float(), "v_codebook": tabs["v_codebook"].float()}
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device="cuda", generator=gen)
    attn = PagedDecodeAttention(Hq, Hkv, D, page_type="compact", k_bits=kb, v_bits=vb, config=config,
                                sink_tokens=S, window=W, device="cuda")
    rope = "rope_coef" in extra
    info = attn.plan([L] * B, bt, rope=rope)
    out = torch.empty(B, Hq, D, dtype=torch.bfloat16, device="cuda")
    t = bench(lambda: attn.run(q, kp, vp, out=out, **tabs, **extra), rep)
    from weightszip.kernels import DEFAULT_CONFIGS
    from weightszip.kernels.paged_decode import PAGE_COMPACT

    default = DEFAULT_CONFIGS[PAGE_COMPACT]
    if config is not None and config != default:  # the default kernel's output (fp32 sums aside)
        attn.config = default
        attn.plan([L] * B, bt, rope=rope)
        other = attn.run(q, kp, vp, **tabs, **extra).float()
        info["max_abs_diff_vs_default"] = float((out.float() - other).abs().max())
        info["max_abs_out"] = float(other.abs().max())
        attn.config = config
    per_tok = (kb * D // 8 + 1) + (vb * D // 8 + 1)
    # + the tables each program reads (codebooks, grids), q' (fp32) instead of a bf16 q, the side tokens
    nbytes = (attn.bytes_read(per_tok) + Hkv * (2**kb + 2**vb) * 2 + 2 * Hkv * 256 * 4 + B * Hq * (D * 2 + 4)
              + 2 * B * (S + W) * Hkv * D * 2)
    return t, nbytes, info


def time_write(shapes, rep):
    """Cache-write kernel: seconds per call and per token for one layer and kind."""
    from weightszip.compact import codec
    from weightszip.kernels.compact_write import compact_write

    gen = torch.Generator(device="cuda").manual_seed(3)
    rows = []
    for (name, (Hq, Hkv, D)), bits, n in itertools.product(shapes.items(), (3, 4), (8, 64, 8192)):
        x = torch.randn(n, Hkv, D, device="cuda", generator=gen).to(torch.bfloat16)
        nblk = n // 16 + 64
        pages = torch.zeros(nblk, Hkv, 1, 16 * (bits * D // 8 + 1), dtype=torch.uint8, device="cuda")
        slots = torch.randperm(nblk * 16, device="cuda", generator=gen)[:n]
        cb = torch.sort(torch.rand(2**bits, generator=torch.Generator().manual_seed(0)) * 2 - 1)[0]
        tables = dict(mu=torch.zeros(Hkv, D, dtype=torch.int64, device="cuda"),
                      mult=torch.full((Hkv, D), 2**16, dtype=torch.int64, device="cuda"),
                      signs=(torch.randint(0, 2, (Hkv, D), device="cuda", generator=gen) * 2 - 1).long(),
                      grid=codec.grid_table(4).expand(Hkv, 256).contiguous().cuda(),
                      thr=codec.thresholds(cb).expand(Hkv, -1).contiguous().cuda(), bits=bits)
        t = bench(lambda: compact_write(x, slots, pages, tables, check_slots=False), rep)
        rows.append(dict(shape=name, bits=bits, tokens=n, time_s=t, ns_per_token=t / n * 1e9))
        print(f"write {name} {bits}-bit x {n} tokens: {t * 1e6:.1f} us, {t / n * 1e9:.1f} ns/token", flush=True)
    return rows


COMPACT_SWEEP = "64:4:2:0,64:4:3:0,128:4:2:0,32:4:3:0,64:8:2:0,16:4:3:1,32:4:2:1,32:8:2:1"


def tune_compact(shapes, rep, spec=COMPACT_SWEEP):
    from weightszip.kernels import DEFAULT_CONFIGS, KernelConfig
    from weightszip.kernels.paged_decode import PAGE_COMPACT
    from tqdm import tqdm

    points = [("llama8b", 8, 32768), ("llama8b", 64, 131072), ("llama70b-tp8", 8, 32768),
              ("llama70b-tp8", 64, 131072)]
    points = [p for p in points if p[0] in shapes]
    sweep = [KernelConfig(block_n=bn, num_warps=w, num_stages=st, cuda_dot=bool(cd))
             for bn, w, st, cd in (map(int, c.split(":")) for c in spec.split(","))]
    gen = torch.Generator(device="cuda").manual_seed(4)
    result, scores = [], {}
    for cfg in tqdm(sweep, desc="tune compact", file=sys.stdout):
        ts = []
        for name, B, L in points:
            Hq, Hkv, D = shapes[name]
            try:
                t, _, _ = time_compact("q4", B, L, Hq, Hkv, D, rep // 2, gen, cfg)
            except Exception as e:  # out of resources or a compile failure: this configuration is skipped
                print(f"  {cfg}: {type(e).__name__}: {str(e)[:160]}", flush=True)
                t = math.inf
            ts.append(t)
            result.append(dict(config=cfg.__dict__, shape=name, batch=B, context=L, time_s=t))
        scores[cfg] = math.exp(sum(math.log(t) for t in ts) / len(ts))
        print(f"  {cfg}: geomean {scores[cfg] * 1e3:.3f} ms", flush=True)
    best = min(scores, key=scores.get)
    DEFAULT_CONFIGS[PAGE_COMPACT] = best
    print(f"tuned compact: {best}", flush=True)
    return result, best.__dict__


def check(shapes):
    """Kernel vs fp64 reference at real shapes (a few sequences of mixed length, side tokens too)."""
    from weightszip.kernels import (PagedDecodeAttention, dequantize_pages, dequantize_pages_ref,
                                    paged_decode_ref, quantize_fp8_ref)

    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for (name, (Hq, Hkv, D)), kind, (S, W) in itertools.product(shapes.items(), ("bf16", "fp8"), ((0, 0), (4, 128))):
        lens = [32768 + 3, 1, 5000, 200]
        nblk = sum(-(-L // 16) for L in lens) + 8
        k = torch.randn(nblk, Hkv, 16, D, device="cuda", generator=gen).to(torch.bfloat16)
        v = torch.randn(nblk, Hkv, 16, D, device="cuda", generator=gen).to(torch.bfloat16)
        ks = vs = None
        if kind == "fp8":
            ks = torch.full((Hkv,), 4 / 448, device="cuda")
            vs = torch.full((Hkv,), 3 / 448, device="cuda")
            k = quantize_fp8_ref(k.transpose(1, 2), ks).transpose(1, 2).contiguous()
            v = quantize_fp8_ref(v.transpose(1, 2), vs).transpose(1, 2).contiguous()
        perm = torch.randperm(nblk, device="cuda", generator=gen).to(torch.int32)
        bt = torch.zeros(len(lens), max(-(-L // 16) for L in lens), dtype=torch.int32, device="cuda")
        o = 0
        for i, L in enumerate(lens):
            n = -(-L // 16)
            bt[i, :n] = perm[o:o + n]
            o += n
        side = dict(k_side=None, v_side=None)
        if S + W:
            side = {n: torch.randn(len(lens), S + W, Hkv, D, device="cuda", generator=gen).to(torch.bfloat16)
                    for n in ("k_side", "v_side")}
        q = torch.randn(len(lens), Hq, D, device="cuda", generator=gen).to(torch.bfloat16)
        attn = PagedDecodeAttention(Hq, Hkv, D, page_type=kind, sink_tokens=S, window=W, device="cuda")
        attn.plan(lens, bt)
        out = attn.run(q, k, v, k_scale=ks, v_scale=vs, out=torch.empty(len(lens), Hq, D, device="cuda"), **side)
        ref = paged_decode_ref(q, k, v, bt, lens, page_type=kind, k_scale=ks, v_scale=vs, sink_tokens=S,
                               window=W, **side)
        vmax = dequantize_pages_ref(v, kind, vs).abs().max().item()
        err = (out.double() - ref).abs().max().item() / vmax
        exact = torch.equal(dequantize_pages(k, kind, ks).view(torch.int32),
                            dequantize_pages_ref(k, kind, ks).view(torch.int32))
        ok = err <= 2.0**-8 and exact
        rows.append(dict(shape=name, kind=kind, sinks=S, window=W, err_over_vmax=err, dequant_bit_exact=exact, ok=ok))
        print(f"check {name} {kind} S={S} W={W}: max err / max|v| = {err:.2e}, dequant bit-exact {exact}: "
              f"{'ok' if ok else 'FAIL'}", flush=True)
    return rows


def tune(shapes, rep):
    from weightszip.kernels import DEFAULT_CONFIGS, KernelConfig
    from weightszip.kernels.paged_decode import PAGE_TYPES

    points = [("llama8b", 8, 32768), ("llama8b", 64, 131072), ("llama70b-tp8", 8, 32768),
              ("llama70b-tp8", 64, 131072)]
    points = [p for p in points if p[0] in shapes]
    # Chosen from the resources ptxas reports for sm_90 (registers and shared memory bound the
    # programs per multiprocessor, hence the bytes in flight): 8 warps never paid.
    sweeps = {"bf16": [(64, 4, 3), (64, 4, 4), (128, 4, 2), (128, 4, 3), (32, 4, 5), (64, 2, 3)],
              "fp8": [(128, 4, 3), (128, 4, 4), (64, 4, 6), (64, 4, 4), (256, 4, 2), (128, 2, 3)]}
    import triton

    gen = torch.Generator(device="cuda").manual_seed(2)
    result, best = [], {}
    from tqdm import tqdm

    for kind in ("bf16", "fp8"):
        def sweep(configs, label):
            scores = {}
            for cfg in tqdm(configs, desc=f"tune {kind} {label}", file=sys.stdout):
                ts = []
                for name, B, L in points:
                    Hq, Hkv, D = shapes[name]
                    try:
                        t, _, _ = time_paged(kind, B, L, Hq, Hkv, D, rep // 2, gen, cfg)
                    except triton.runtime.errors.OutOfResources as e:  # too much shared memory: skipped
                        print(f"  {cfg}: {type(e).__name__}: {str(e)[:120]}")
                        t = math.inf
                    ts.append(t)
                    result.append(dict(kind=kind, config=cfg.__dict__, shape=name, batch=B, context=L, time_s=t))
                scores[cfg] = math.exp(sum(math.log(t) for t in ts) / len(ts))
            return min(scores, key=scores.get)

        b = sweep([KernelConfig(block_n=bn, num_warps=w, num_stages=s) for bn, w, s in sweeps[kind]], "launch")
        waves = [dataclasses.replace(b, waves=w, min_split_tokens=m)
                 for w, m in itertools.product((2, 4, 8), (512, 1024))]
        best[kind] = sweep(waves, "split")
        DEFAULT_CONFIGS[PAGE_TYPES[kind]] = best[kind]
        print(f"tuned {kind}: {best[kind]}", flush=True)
    return result, {k: v.__dict__ for k, v in best.items()}


def main(argv=None):
    args = parse_args(argv)
    from tqdm import tqdm

    from weightszip.kernels import DEFAULT_CONFIGS
    from weightszip.kernels.paged_decode import PAGE_TYPES

    shapes = {s: SHAPES[s] for s in args.shapes.split(",")}
    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    dev = torch.cuda.get_device_properties(0)
    meta = dict(date=datetime.date.today().isoformat(), gpu=dev.name, sms=dev.multi_processor_count,
                torch=torch.__version__, cmd=" ".join(sys.argv), random_data=True)
    import triton

    meta["triton"] = triton.__version__
    res = dict(meta=meta)
    if args.tune:
        res["tune"], res["tuned"] = tune(shapes, args.rep)
    if args.tune_compact:
        res["tune_compact"], res["tuned_compact"] = tune_compact(shapes, args.rep, args.compact_sweep)
    if args.check:  # after tuning: the configurations the grid uses are the ones checked
        res["check"] = check(shapes)
    if args.write:
        res["write"] = time_write(shapes, args.rep)
    torch.cuda.empty_cache()
    res["configs"] = {k: DEFAULT_CONFIGS[v].__dict__ for k, v in PAGE_TYPES.items()}
    kernels = [k for k in args.kernels.split(",") if k in KERNELS]
    res["meta"]["kernels"] = kernels
    side = tuple(int(x) for x in args.side.split(","))
    res["meta"]["compact_side_tokens"] = dict(sinks=side[0], window=side[1])
    bw0 = read_bandwidth(args.rep)
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    grid = list(itertools.product(shapes.items(), batches, contexts))
    free = torch.cuda.mem_get_info()[0]
    for (name, (Hq, Hkv, D)), B, L in tqdm(grid, desc="grid", file=sys.stdout):
        kv_bytes = 2 * B * Hkv * L * D * 2
        row = dict(shape=name, q_heads=Hq, kv_heads=Hkv, head_dim=D, batch=B, context=L)
        if kv_bytes * 1.5 > free:
            row["skipped"] = f"bf16 K+V {kv_bytes / 2**30:.0f} GiB does not fit"
            rows.append(row)
            continue
        if "sdpa" in kernels:
            t, how, nb = time_sdpa(B, L, Hq, Hkv, D, args.rep, gen)
            if t is None:
                row["sdpa_skipped"] = how
            else:
                row["sdpa"] = dict(time_s=t, bytes=nb, variant=how)
        for kind in [k for k in kernels if k != "sdpa"]:
            if kind in COMPACT:
                cfg = kind_config(kind)
                t, nb, info = time_compact(kind, B, L, Hq, Hkv, D, args.rep, gen, cfg, side)
            elif kind in ("fp8+gluon", "fp8+triton"):  # the fp8 default with the Gluon kernel forced / off
                from weightszip.kernels import DEFAULT_CONFIGS
                from weightszip.kernels.paged_decode import PAGE_FP8

                change = {"gluon": True, "gluon_min_work": 0} if kind == "fp8+gluon" else {"gluon": False}
                cfg = dataclasses.replace(DEFAULT_CONFIGS[PAGE_FP8], **change)
                t, nb, info = time_paged("fp8", B, L, Hq, Hkv, D, args.rep, gen, cfg)
            else:
                t, nb, info = time_paged(kind, B, L, Hq, Hkv, D, args.rep, gen, None)
            row[kind] = dict(time_s=t, bytes=nb, splits=info["items"], split_tokens=info["split_tokens"],
                             **{k: v for k, v in info.items() if k.startswith("max_")})
            torch.cuda.empty_cache()
        torch.cuda.empty_cache()
        rows.append(row)
        partial = pathlib.Path(args.out).with_suffix(".partial.json")
        partial.parent.mkdir(parents=True, exist_ok=True)
        partial.write_text(json.dumps(dict(res, rows=rows), indent=1))
    bw1 = read_bandwidth(args.rep)
    bw = max(bw0, bw1)
    res["read_bandwidth"] = dict(start=bw0, end=bw1, used=bw)
    for row in rows:
        if "skipped" in row:
            continue
        best_bf16 = min((row[k]["time_s"] for k in ("sdpa", "bf16") if k in row), default=None)
        for k in [k for k in kernels if k in row]:
            r = row[k]
            r["gbps"] = r["bytes"] / r["time_s"] / 1e9
            r["efficiency"] = r["bytes"] / r["time_s"] / bw
            if best_bf16 is not None:  # a run without sdpa/bf16 has no bf16 baseline
                r["speedup_vs_best_bf16"] = best_bf16 / r["time_s"]
            if "fp8" in row:
                r["speedup_vs_fp8"] = row["fp8"]["time_s"] / r["time_s"]
    res["rows"] = rows
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    md = table(res)
    out.with_suffix(".md").write_text(md)
    print(md)
    plot(res, out.with_suffix(".png"))


def table(res):
    bw = res["read_bandwidth"]["used"]
    kernels = res["meta"].get("kernels", list(KERNELS[:3]))
    comp = [k for k in kernels if k in COMPACT]
    lines = [f"read bandwidth (sum over 4 GiB): {bw / 1e12:.2f} TB/s; {res['meta']['gpu']}, "
             f"torch {res['meta']['torch']}, triton {res['meta']['triton']}, {res['meta']['date']}"
             + ("; compact kinds with {sinks} sinks + {window} recent tokens in bf16".format(
                 **res["meta"]["compact_side_tokens"]) if "compact_side_tokens" in res["meta"] else ""), "",
             "| shape | batch | context | " + " | ".join(f"{k} ms | eff" for k in kernels)
             + "".join(f" | {k} vs fp8" for k in comp if "fp8" in kernels) + " |",
             "|---|---:|---:|" + "---:|---:|" * len(kernels) + "---:|" * (len(comp) if "fp8" in kernels else 0)]
    for r in res["rows"]:
        if "skipped" in r:
            lines.append(f"| {r['shape']} | {r['batch']} | {r['context'] // 1024}k | skipped: {r['skipped']} |")
            continue
        cells = []
        for k in kernels:
            cells += [f"{r[k]['time_s'] * 1e3:.3f}", f"{r[k]['efficiency']:.2f}"] if k in r else ["-", "-"]
        if "fp8" in kernels:
            cells += [f"{r[k]['speedup_vs_fp8']:.2f}x" for k in comp]
        lines.append(f"| {r['shape']} | {r['batch']} | {r['context'] // 1024}k | " + " | ".join(cells) + " |")
    if res.get("write"):
        lines += ["", "| write kernel | bits | tokens | us per call | ns per token (one layer, one kind, all KV heads) |",
                  "|---|---:|---:|---:|---:|"]
        for w in res["write"]:
            lines.append(f"| {w['shape']} | {w['bits']} | {w['tokens']} | {w['time_s'] * 1e6:.1f} | {w['ns_per_token']:.1f} |")
    return "\n".join(lines) + "\n"


def plot(res, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib missing: no plot", file=sys.stderr)
        return
    rows = [r for r in res["rows"] if "skipped" not in r]
    shapes = sorted({r["shape"] for r in rows})
    fig, axes = plt.subplots(1, len(shapes), figsize=(7 * len(shapes), 4.5), squeeze=False)
    for ax, s in zip(axes[0], shapes):
        rs = [r for r in rows if r["shape"] == s]
        x = range(len(rs))
        labels = {"sdpa": "torch SDPA flash (bf16)", "bf16": "ours, bf16 pages", "fp8": "ours, fp8 pages",
                  "q4": "ours, q4 (K4 V4)", "q3.5": "ours, q3.5 (K4 V3)", "q3": "ours, q3 (K3 V3)"}
        for k in res["meta"].get("kernels", list(KERNELS[:3])):
            ax.plot(x, [r[k]["efficiency"] if k in r else float("nan") for r in rs], marker="o", label=labels.get(k, k))
        ax.set_xticks(list(x), [f"b{r['batch']}\n{r['context'] // 1024}k" for r in rs], fontsize=7)
        ax.set_ylabel("bytes read / time / read bandwidth")
        ax.set_title(s)
        ax.axhline(0.8, color="grey", lw=0.5, ls="--")
        ax.set_ylim(0, 1.2)
        ax.legend(fontsize=8)
    fig.suptitle(f"decode attention, {res['meta']['gpu']}, {res['meta']['date']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
