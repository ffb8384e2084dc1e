"""Split-geometry sweep (waves, min_split_tokens) of fp8 and the compact kinds on the kernel file in the
tree: inputs built once per kind and point, each configuration timed as bench_decode_attention does."""
import dataclasses, json, sys, pathlib
import torch
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_decode_attention as bd
from weightszip.kernels import DEFAULT_CONFIGS, PagedDecodeAttention
from weightszip.kernels.paged_decode import PAGE_COMPACT, PAGE_FP8

POINTS = [("llama70b-tp8", 8, 32768), ("llama70b-tp8", 8, 131072), ("llama8b", 8, 32768), ("llama8b", 64, 131072)]
GEOM = [(2, 2048), (1, 2048), (1, 4096), (2, 4096), (4, 1024), (2, 1024), (4, 2048), (1, 8192)]
rep = int(sys.argv[2]) if len(sys.argv) > 2 else 20
out = []
gen = torch.Generator(device="cuda").manual_seed(0)
for shape, B, L in POINTS:
    Hq, Hkv, D = bd.SHAPES[shape]
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device="cuda", generator=gen)
    res = torch.empty(B, Hq, D, dtype=torch.bfloat16, device="cuda")
    for kind in ("fp8", "q4", "q3.5", "q3"):
        if kind == "fp8":
            k, v, bt = bd.make_paged(B, L, Hkv, D, torch.float8_e4m3fn, gen)
            kw = dict(k_scale=torch.full((Hkv,), 1 / 64, device="cuda"), v_scale=torch.full((Hkv,), 1 / 64, device="cuda"))
            base = DEFAULT_CONFIGS[PAGE_FP8]
            mk = lambda cfg: PagedDecodeAttention(Hq, Hkv, D, page_type="fp8", config=cfg, device="cuda")
        else:
            kb, vb = bd.COMPACT[kind]
            k, v, bt, tabs, extra = bd.compact_inputs(kind, B, L, Hq, Hkv, D, gen)
            kw = {**tabs, **extra}
            base = DEFAULT_CONFIGS[PAGE_COMPACT]
            mk = lambda cfg: PagedDecodeAttention(Hq, Hkv, D, page_type="compact", k_bits=kb, v_bits=vb, config=cfg,
                                                  device="cuda")
        row = []
        for waves, ms in GEOM:
            cfg = dataclasses.replace(base, waves=waves, min_split_tokens=ms)
            attn = mk(cfg)
            info = attn.plan([L] * B, bt)
            t = bd.bench(lambda: attn.run(q, k, v, out=res, **kw), rep)
            row.append(t)
            out.append(dict(shape=shape, batch=B, context=L, kind=kind, waves=waves, min_split=ms, time_s=t,
                            info={a: b for a, b in info.items() if isinstance(b, (int, float))}))
        best = min(range(len(GEOM)), key=lambda i: row[i])
        print(f"{shape} {B}x{L // 1024}k {kind}: " + " ".join(f"{w}:{m}={t * 1e3:.4f}" for (w, m), t in zip(GEOM, row))
              + f" | best {GEOM[best]} {row[0] / row[best]:.3f}x", flush=True)
        del k, v
        torch.cuda.empty_cache()
json.dump(out, open(sys.argv[1], "w"), indent=1)
