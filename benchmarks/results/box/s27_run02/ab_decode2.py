"""A/B of the compact (q4, q3) and fp8 Gluon split kernels across module variants (copies of
paged_decode_gluon.py from branches, in weightszip/kernels/_pdg_<name>.py; "tree" = the checkout's),
interleaved rounds, the same inputs; each variant's output compared with main's: bit for bit, and
the largest |difference| relative to the output's largest |value|.
env: AB_VARIANTS (default main,carry0,carry,split,tree; "name@W:S:V[:M]" runs the module's compact kernel with gluon_warps W,
gluon_stages S, waves V (and min_split_tokens M; fp8 keeps its default), the shared-memory cap raised to the H200's 227 KiB), AB_FORMATS (q4,q3,fp8),
AB_POINTS (shape:B:L,...), AB_ROUNDS (2)."""
import importlib, json, os, sys
sys.path.insert(0, "benchmarks")
import torch
import bench_decode_attention as BD
import dataclasses
import weightszip.kernels.paged_decode_gluon as pg
import weightszip.kernels.paged_decode as pd
from weightszip.kernels import PagedDecodeAttention

out_dir = os.environ["OUT"]
NAMES = ("compact_split_kernel", "fp8_split_kernel", "smem_offsets")
variants = {}
configs = {}
for v in os.environ.get("AB_VARIANTS", "main,carry0,carry,split,tree").split(","):
    base, _, cfg = v.partition("@")
    mod = pg if base == "tree" else importlib.import_module(f"weightszip.kernels._pdg_{base}")
    variants[v] = {n: getattr(mod, n) for n in NAMES}
    if cfg:
        w, st, wv, *ms = (int(x) for x in cfg.split(":"))
        c0 = pd.DEFAULT_CONFIGS[pd.PAGE_COMPACT]
        configs[v] = {pd.PAGE_COMPACT: dataclasses.replace(c0, gluon_warps=w, gluon_stages=st, waves=wv,
                                                           min_split_tokens=ms[0] if ms else c0.min_split_tokens)}
if configs:
    pd.GLUON_MAX_SMEM = 227 * 1024
tree = {n: getattr(pg, n) for n in NAMES}
formats = os.environ.get("AB_FORMATS", "q4,q3,fp8").split(",")
points = [(p.split(":")[0], int(p.split(":")[1]), int(p.split(":")[2])) for p in os.environ.get(
    "AB_POINTS", "llama8b:8:32768,llama8b:32:65536,llama8b:64:131072,llama70b-tp8:8:32768,llama70b-tp8:16:32768").split(",")]
res = {}
for shape, B, L in points:
    Hq, Hkv, D = BD.SHAPES[shape]
    gen = torch.Generator(device="cuda").manual_seed(0)
    inputs = {}
    for name in formats:
        if name == "fp8":
            k8, v8, bt8 = BD.make_paged(B, L, Hkv, D, torch.float8_e4m3fn, gen)
            q8 = torch.randn(B, Hq, D, dtype=torch.bfloat16, device="cuda", generator=gen)
            sc = dict(k_scale=torch.full((Hkv,), 1 / 64, device="cuda"), v_scale=torch.full((Hkv,), 1 / 64, device="cuda"))
            inputs["fp8"] = (q8, k8, v8, bt8, sc, {})
        else:
            kp, vp, bt, tabs, extra = BD.compact_inputs(name, B, L, Hq, Hkv, D, gen)
            q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device="cuda", generator=gen)
            inputs[name] = (q, kp, vp, bt, tabs, extra)

    def make_cases(var):
        cases = {}
        for name, (q, kp, vp, bt, tabs, extra) in inputs.items():
            if name == "fp8":
                cfg = configs.get(var, {}).get(pd.PAGE_FP8)
                att = PagedDecodeAttention(Hq, Hkv, D, page_type="fp8", device="cuda", config=cfg)
            else:
                kb, vb = BD.COMPACT[name]
                cfg = configs.get(var, {}).get(pd.PAGE_COMPACT)
                att = PagedDecodeAttention(Hq, Hkv, D, page_type="compact", k_bits=kb, v_bits=vb, device="cuda", config=cfg)
            att.plan([L] * B, bt)
            cases[name] = lambda att=att, q=q, kp=kp, vp=vp, tabs=tabs, extra=extra: att.run(q, kp, vp, **tabs, **extra)
        return cases

    ref = {}
    for rnd in range(int(os.environ.get("AB_ROUNDS", 2))):
        for var, fns in variants.items():
            for n, f in fns.items():
                setattr(pg, n, f)
            for name, fn in make_cases(var).items():
                o = fn().float()
                if name not in ref:
                    ref[name] = o.clone()
                same = bool(torch.equal(o, ref[name]))
                rel = float((o - ref[name]).abs().max() / ref[name].abs().max().clamp_min(1e-30))
                t = BD.bench(fn, 30) * 1e3
                key = f"{shape}:{B}x{L}:{name}:{var}"
                res.setdefault(key, []).append(dict(ms=round(t, 4), same_as_first=same, rel_diff=rel))
                print(f"{key} r{rnd} {t:.4f} ms same {same} rel {rel:.2e}", flush=True)
    for n, f in tree.items():
        setattr(pg, n, f)
    del inputs
    torch.cuda.empty_cache()
json.dump(res, open(f"{out_dir}/ab_decode.json", "w"), indent=1)
# summary: the median over rounds per variant, and each against the first variant
print("\nsummary (ms, median of rounds; x = first variant / this)")
keys = sorted({k.rsplit(":", 1)[0] for k in res})
first = next(iter(variants))
for k in keys:
    row = {v: sorted(r["ms"] for r in res[f"{k}:{v}"])[len(res[f"{k}:{v}"]) // 2] for v in variants if f"{k}:{v}" in res}
    print(k, "  ".join(f"{v} {t:.4f} ({row[first] / t:.3f}x)" for v, t in row.items()))
