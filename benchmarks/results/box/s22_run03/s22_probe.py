"""Gluon vs Triton compact split kernel below the compact default's gluon_min_work (2**18 before session 22):
q4 with 4 sinks + 128 window tokens, whole step time (graph replay), 70B TP8 and 8B shapes."""
import sys, pathlib, dataclasses, json, os
import torch
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "benchmarks"))
import bench_decode_attention as bd
from weightszip.kernels import DEFAULT_CONFIGS
from weightszip.kernels import paged_decode as pd

gen = torch.Generator(device="cuda").manual_seed(5)
base = DEFAULT_CONFIGS[pd.PAGE_COMPACT]
rows = []
for shape, B, L in [("llama70b-tp8", 1, 32768), ("llama70b-tp8", 2, 32768), ("llama70b-tp8", 4, 32768),
                    ("llama70b-tp8", 8, 8192), ("llama70b-tp8", 8, 16384), ("llama70b-tp8", 8, 32768),
                    ("llama8b", 1, 8192), ("llama8b", 1, 32768), ("llama8b", 4, 8192)]:
    Hq, Hkv, D = bd.SHAPES[shape]
    r = dict(shape=shape, B=B, L=L)
    for name, cfg in (("gluon", dataclasses.replace(base, gluon=True, gluon_min_work=0)),
                      ("triton", dataclasses.replace(base, gluon=False))):
        t, nb, info = bd.time_compact("q4", B, L, Hq, Hkv, D, 30, gen, cfg, (4, 128))
        r[name] = t * 1e6
    rows.append(r)
    print(f"{shape} B{B} L{L // 1024}k work {B * (L - 132) * Hkv}: gluon {r['gluon']:.1f} us, triton {r['triton']:.1f} us", flush=True)
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "probe.json"), "w"))
