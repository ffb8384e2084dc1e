"""Shorter splits at small steps now that the merge is cheaper: min_split_tokens 2048 (default) / 1024 / 512 and
waves 2 / 4 for q4 (with the formats' 132 side tokens) and fp8 (waves 1 / 2), whole step by graph replay, two rounds."""
import sys, pathlib, dataclasses, json, os
import torch
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_decode_attention as bd
from weightszip.kernels import DEFAULT_CONFIGS
from weightszip.kernels import paged_decode as pd

gen = torch.Generator(device="cuda").manual_seed(6)
rows = []
points = [("llama70b-tp8", 8, 32768), ("llama70b-tp8", 8, 65536), ("llama70b-tp8", 8, 131072), ("llama70b-tp8", 16, 32768),
          ("llama70b-tp8", 16, 65536), ("llama70b-tp8", 32, 32768), ("llama8b", 8, 32768), ("llama8b", 8, 131072)]
for rnd in range(2):
    for shape, B, L in points:
        Hq, Hkv, D = bd.SHAPES[shape]
        for kind in ("q4", "fp8"):
            base = DEFAULT_CONFIGS[pd.PAGE_COMPACT if kind == "q4" else pd.PAGE_FP8]
            for waves, ms in ((base.waves, 2048), (base.waves, 1024), (base.waves, 512), (base.waves * 2, 1024), (base.waves * 2, 512)):
                cfg = dataclasses.replace(base, waves=waves, min_split_tokens=ms)
                if kind == "q4":
                    t, nb, info = bd.time_compact("q4", B, L, Hq, Hkv, D, 30, gen, cfg, (4, 128))
                else:
                    t, nb, info = bd.time_paged("fp8", B, L, Hq, Hkv, D, 30, gen, cfg)
                rows.append(dict(rnd=rnd, shape=shape, B=B, L=L, kind=kind, waves=waves, min_split=ms, t=t, items=info["items"],
                                 split=info["split_tokens"]))
                print(f"r{rnd} {shape} {B}x{L // 1024}k {kind} w{waves} ms{ms}: {t * 1e6:.1f} us items {info['items']} split {info['split_tokens']}", flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "split.json"), "w"))
