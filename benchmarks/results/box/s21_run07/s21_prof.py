"""Kernel times (torch.profiler) of a decode step, split and merge kernels apart, at 70B TP8 small batches."""
import dataclasses, sys, pathlib, collections
import torch
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_decode_attention as bd
from weightszip.kernels import DEFAULT_CONFIGS, PagedDecodeAttention
from weightszip.kernels.paged_decode import PAGE_COMPACT, PAGE_FP8
gen = torch.Generator(device="cuda").manual_seed(0)
for shape, B, L in [("llama70b-tp8", 8, 32768), ("llama70b-tp8", 8, 65536), ("llama70b-tp8", 8, 131072),
                    ("llama70b-tp8", 16, 32768), ("llama70b-tp8", 32, 32768), ("llama8b", 8, 32768)]:
    Hq, Hkv, D = bd.SHAPES[shape]
    q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device="cuda", generator=gen)
    res = torch.empty(B, Hq, D, dtype=torch.bfloat16, device="cuda")
    for kind in ("fp8", "q4"):
        if kind == "fp8":
            k, v, bt = bd.make_paged(B, L, Hkv, D, torch.float8_e4m3fn, gen)
            kw = dict(k_scale=torch.full((Hkv,), 1 / 64, device="cuda"), v_scale=torch.full((Hkv,), 1 / 64, device="cuda"))
            base = DEFAULT_CONFIGS[PAGE_FP8]
            mk = lambda cfg: PagedDecodeAttention(Hq, Hkv, D, page_type="fp8", config=cfg, device="cuda")
        else:
            k, v, bt, tabs, extra = bd.compact_inputs(kind, B, L, Hq, Hkv, D, gen)
            kw = {**tabs, **extra}
            base = DEFAULT_CONFIGS[PAGE_COMPACT]
            mk = lambda cfg: PagedDecodeAttention(Hq, Hkv, D, page_type="compact", k_bits=4, v_bits=4, config=cfg, device="cuda")
        for waves in (1, 2):
            attn = mk(dataclasses.replace(base, waves=waves))
            info = attn.plan([L] * B, bt)
            for _ in range(5):
                attn.run(q, k, v, out=res, **kw)
            torch.cuda.synchronize()
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                for _ in range(20):
                    attn.run(q, k, v, out=res, **kw)
                torch.cuda.synchronize()
            t = collections.defaultdict(float)
            for e in prof.events():
                if e.device_type == torch.autograd.DeviceType.CUDA:
                    t[e.name[:28]] += e.device_time / 20
            print(f"{shape} {B}x{L // 1024}k {kind} w{waves} items {info['items']} split {info['split_tokens']}: "
                  + ", ".join(f"{n} {us:.1f}us" for n, us in sorted(t.items(), key=lambda x: -x[1])), flush=True)
        del k, v
        torch.cuda.empty_cache()
