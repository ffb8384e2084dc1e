"""The planner's split choice, A/B in one process (inputs built once per kind and point): 'old' = the split
main's planner picks at waves 2 (even share of the total, rounded up; given as split_tokens), 'w2' and 'w1' =
the tree's _fit_split at waves 2 and 1. Two rounds, each rule's median time the min of its rounds."""
import dataclasses, json, sys, pathlib
import torch
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_decode_attention as bd
from weightszip.kernels import DEFAULT_CONFIGS, PagedDecodeAttention
from weightszip.kernels.paged_decode import PAGE_COMPACT, PAGE_FP8

shapes = sys.argv[2].split(",")
batches = [int(x) for x in sys.argv[3].split(",")]
contexts = [int(x) for x in sys.argv[4].split(",")]
kinds = sys.argv[5].split(",")
rep = 20
out = []
gen = torch.Generator(device="cuda").manual_seed(0)
sms = torch.cuda.get_device_properties(0).multi_processor_count


def old_split(cfg, B, L, Hkv):
    target = max(1, sms * cfg.waves // Hkv)
    return max(-(-(B * L) // target), cfg.min_split_tokens)


for shape in shapes:
    Hq, Hkv, D = bd.SHAPES[shape]
    for B in batches:
        for L in contexts:
            q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device="cuda", generator=gen)
            res = torch.empty(B, Hq, D, dtype=torch.bfloat16, device="cuda")
            line = {}
            for kind in kinds:
                if kind == "fp8":
                    k, v, bt = bd.make_paged(B, L, Hkv, D, torch.float8_e4m3fn, gen)
                    kw = dict(k_scale=torch.full((Hkv,), 1 / 64, device="cuda"),
                              v_scale=torch.full((Hkv,), 1 / 64, device="cuda"))
                    base = DEFAULT_CONFIGS[PAGE_FP8]
                    mk = lambda cfg: PagedDecodeAttention(Hq, Hkv, D, page_type="fp8", config=cfg, device="cuda")
                else:
                    kb, vb = bd.COMPACT[kind]
                    k, v, bt, tabs, extra = bd.compact_inputs(kind, B, L, Hq, Hkv, D, gen)
                    kw = {**tabs, **extra}
                    base = DEFAULT_CONFIGS[PAGE_COMPACT]
                    mk = lambda cfg: PagedDecodeAttention(Hq, Hkv, D, page_type="compact", k_bits=kb, v_bits=vb,
                                                          config=cfg, device="cuda")
                w2 = dataclasses.replace(base, waves=2)
                rules = {"old": (w2, old_split(w2, B, L, Hkv)), "w2": (w2, None),
                         "w1": (dataclasses.replace(base, waves=1), None)}
                best, meta = {}, {}
                for rnd in range(2):
                    for name, (cfg, split) in rules.items():
                        attn = mk(cfg)
                        info = attn.plan([L] * B, bt, split_tokens=split)
                        t = bd.bench(lambda: attn.run(q, k, v, out=res, **kw), rep)
                        best[name] = min(best.get(name, 1e9), t)
                        meta[name] = (info["items"], info["split_tokens"])
                for name in rules:
                    out.append(dict(shape=shape, batch=B, context=L, kind=kind, rule=name, items=meta[name][0],
                                    split=meta[name][1], time_s=best[name]))
                line[kind] = best
                del k, v
                torch.cuda.empty_cache()
            txt = f"{shape} {B}x{L // 1024}k " + " ".join(
                f"{kd} " + "/".join(f"{line[kd][r] * 1e3:.4f}" for r in ("old", "w2", "w1")) for kd in kinds)
            if "fp8" in line:
                txt += " | vs fp8 old/w2/w1 " + " ".join(
                    "/".join(f"{line['fp8'][r] / line[kd][r]:.2f}" for r in ("old", "w2", "w1")) for kd in kinds if kd != "fp8")
            print(txt, flush=True)
            json.dump(out, open(sys.argv[1], "w"), indent=1)
