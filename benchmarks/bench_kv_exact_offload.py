"""KV Exact offload and restore (issue 7, item 3): a Llama-3.1-8B-shaped session (32 layers, 8 KV heads
x 128, 131072 tokens: 17.18 GB in bf16) held as KV Exact pages in a ``KVExactCache`` on the GPU, moved to
pinned host memory as its compressed page bytes (``offload_sequence``, no decoding) and back into new
heap regions (``restore_sequence``), against a raw pinned copy of the same bf16 bytes in the same run.

    python benchmarks/bench_kv_exact_offload.py --kv .boxdata/kv_pages_subset.npz --out PREFIX

Data: real bf16 KV (the 16 (model, layer, K/V) sets of the .npz: SmolLM2-135M and Qwen2.5-0.5B, 4096
tokens each), tiled along channels to 8 KV heads x 128 and along tokens to the context; layer l takes
the K set l mod 8 and the V set l mod 8; each layer's window tops are calibrated on the first half of
its sets. The pages reach the cache through ``append`` (8192-token prefill chunks). Times: wall time of
the call with a device sync at the end, median of ``--repeats``; offload writes into a pinned
``HostArena`` allocated once (a serving system keeps one), and a first offload that allocates its own
pinned buffer is reported too. Checked: after the round trips the restored session's K and V equal
what was appended, bit for bit, in the first and last layer.
"""

from __future__ import annotations

import argparse
import datetime
import json
import pathlib
import sys
import time

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_gpu_codec import load_sets  # noqa: E402
from bench_kv_exact import HKV, HQ, C, D, llama_pages  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv", action="append", required=True)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--context", type=int, default=131072)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--chunk-mb", type=int, default=64, help="offload/restore chunk size")
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kv_exact_offload"))
    p.add_argument("--profile", action="store_true",
                   help="then one more offload and restore under cProfile (host time per function): PREFIX.profile.txt")
    return p.parse_args(argv)


DEV = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU only for a smoke run of the script


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(fn):
    sync()
    t = time.perf_counter()
    r = fn()
    sync()
    return time.perf_counter() - t, r


def main(argv=None):
    args = parse_args(argv)
    from tqdm import tqdm

    from weightszip.kernels import kv_exact_ref as R
    from weightszip.kv_exact import KVExactCache
    from weightszip.offload import HostArena

    if args.context % 8192:
        raise SystemExit("--context must be a multiple of 8192")
    sets = {}
    for model, kind, layer, x in load_sets(args.kv):
        sets.setdefault(kind, []).append(((model, layer), x))
    ks, vs = sets["K"], sets["V"]

    def tokens(x):  # [T, C0] uint16 -> bf16 tokens [T, 8, 128] on the GPU
        return llama_pages(x).to(DEV).view(torch.bfloat16).reshape(-1, HKV, D)

    L, T = args.layers, args.context
    per_layer = []
    for layer in range(L):
        k, v = tokens(ks[layer % len(ks)][1]), tokens(vs[layer % len(vs)][1])
        half = k.shape[0] // 2
        bk = R.calibrate_bases(k[:half].reshape(-1, C).view(torch.int16)).reshape(HKV, D)
        bv = R.calibrate_bases(v[:half].reshape(-1, C).view(torch.int16)).reshape(HKV, D)
        per_layer.append((k, v, bk, bv))
    bases = torch.stack([torch.stack([bk, bv]) for _, _, bk, bv in per_layer])
    raw_bytes = L * 2 * T * C * 2
    cache = KVExactCache(layers=L, kv_heads=HKV, head_dim=D, num_q_heads=HQ, heap_bytes=int(raw_bytes * 0.8),
                         max_seqs=2, max_tokens=T, bases=bases, device=DEV)
    seq = cache.add_sequence()
    for layer in tqdm(range(L), desc="fill", unit="layer"):
        k, v = per_layer[layer][:2]
        reps = 8192 // k.shape[0]
        kc, vc = k.repeat(reps, 1, 1)[None], v.repeat(reps, 1, 1)[None]
        for _ in range(T // 8192):
            cache.append(layer, [seq], kc, vc)
    sync()
    st = cache.stats()
    res = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "command": " ".join(sys.argv), "torch": torch.__version__, "gpu": torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
                    "layers": L, "context": T, "kv_heads": HKV, "head_dim": D, "chunk_mb": args.chunk_mb},
           "raw_bf16_bytes": raw_bytes, "cache_stats": {k: v for k, v in st.items() if k != "heap"}}

    # raw pinned copies of the same number of bf16 bytes
    dense = torch.empty(raw_bytes // 2, dtype=torch.bfloat16, device=DEV)
    host_raw = torch.empty(raw_bytes // 2, dtype=torch.bfloat16, pin_memory=DEV == "cuda")
    d2h, h2d = [], []
    for _ in tqdm(range(args.repeats), desc="raw copies"):
        d2h.append(timed(lambda: host_raw.copy_(dense, non_blocking=True))[0])
        h2d.append(timed(lambda: dense.copy_(host_raw, non_blocking=True))[0])
    del dense
    if DEV == "cuda":
        torch.cuda.empty_cache()

    chunk = args.chunk_mb << 20
    t_alloc, off = timed(lambda: cache.offload_sequence(seq, free=True, chunk_bytes=chunk))
    moved = off.nbytes
    seq = cache.restore_sequence(off, chunk_bytes=chunk)
    del off
    arena = HostArena(moved + (1 << 20))
    # the bound: one raw pinned copy of as many bytes as the offload moves
    dev_m = torch.empty(moved, dtype=torch.uint8, device=DEV)
    host_m = arena.buffer[:moved]
    d2h_m, h2d_m = [], []
    for _ in range(args.repeats):
        d2h_m.append(timed(lambda: host_m.copy_(dev_m, non_blocking=True))[0])
        h2d_m.append(timed(lambda: dev_m.copy_(host_m, non_blocking=True))[0])
    del dev_m, host_m
    if DEV == "cuda":
        torch.cuda.empty_cache()
    offl, rest, staged = [], [], []
    for _ in tqdm(range(args.repeats), desc="offload/restore"):
        arena.reset()
        t, off = timed(lambda: cache.offload_sequence(seq, free=True, chunk_bytes=chunk, host=arena))
        offl.append(t)
        t, seq = timed(lambda: cache.restore_sequence(off, chunk_bytes=chunk))
        rest.append(t)
        # the staged path: the same restore into a heap that lists a free region (a 4 KB hole below
        # the session), as a heap shared with other sequences does
        arena.reset()
        off = cache.offload_sequence(seq, free=True, chunk_bytes=chunk, host=arena)
        hole = cache.heap.alloc([4096, 4096])
        cache.heap.free(hole[:1], [4096])
        t, seq = timed(lambda: cache.restore_sequence(off, chunk_bytes=chunk))
        staged.append(t)
        cache.heap.free(hole[1:], [4096])
    if args.profile:  # where the host time of one round trip goes (after the timed ones)
        import cProfile
        import io
        import pstats

        arena.reset()
        text = io.StringIO()
        for name in ("offload", "restore"):
            prof = cProfile.Profile()
            prof.enable()
            if name == "offload":
                off = cache.offload_sequence(seq, free=True, chunk_bytes=chunk, host=arena)
            else:
                seq = cache.restore_sequence(off, chunk_bytes=chunk)
            sync()
            prof.disable()
            text.write(f"== {name}\n")
            pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(35)
        prof_path = pathlib.Path(args.out).with_suffix(".profile.txt")
        prof_path.parent.mkdir(parents=True, exist_ok=True)
        prof_path.write_text(text.getvalue())
    ok = True
    for layer in (0, L - 1):
        k, v = per_layer[layer][:2]
        kd, vd = cache.dense(layer, seq)
        reps = T // k.shape[0]
        ok &= torch.equal(kd.view(torch.int16), k.repeat(reps, 1, 1).view(torch.int16))
        ok &= torch.equal(vd.view(torch.int16), v.repeat(reps, 1, 1).view(torch.int16))

    med = lambda xs: float(np.median(xs))  # noqa: E731
    rows = [
        dict(path="raw bf16 pinned copy D2H", bytes=raw_bytes, seconds=med(d2h)),
        dict(path="raw pinned copy D2H of the bytes offload moves (the bound)", bytes=moved, seconds=med(d2h_m)),
        dict(path="KV Exact offload (into a pinned arena)", bytes=moved, seconds=med(offl)),
        dict(path="KV Exact offload, first call (allocates its pinned buffer)", bytes=moved, seconds=t_alloc),
        dict(path="raw bf16 pinned copy H2D", bytes=raw_bytes, seconds=med(h2d)),
        dict(path="raw pinned copy H2D of the bytes restore moves (the bound)", bytes=moved, seconds=med(h2d_m)),
        dict(path="KV Exact restore (empty heap: one copy straight into place)", bytes=moved, seconds=med(rest)),
        dict(path="KV Exact restore (heap with a free region: staged chunks)", bytes=moved, seconds=med(staged)),
    ]
    for r in rows:
        ref = med(d2h) if "D2H" in r["path"] or "offload" in r["path"] else med(h2d)
        r["GBps_of_bf16"] = raw_bytes / r["seconds"] / 1e9
        r["speedup_vs_raw"] = ref / r["seconds"]
    res.update(rows=rows, bytes_moved=moved, ratio_moved=moved / raw_bytes, bit_exact=bool(ok),
               all_seconds=dict(d2h=d2h, h2d=h2d, d2h_moved=d2h_m, h2d_moved=h2d_m, offload=offl, restore=rest, restore_staged=staged))
    print(json.dumps(res, indent=1), flush=True)
    write(res, args.out)
    if not ok:
        raise SystemExit("restored session differs from what was appended")


def write(res, prefix):
    prefix = pathlib.Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(res, indent=1) + "\n")
    m = res["meta"]
    lines = [f"KV Exact offload/restore: {m['layers']} layers x {m['context']} tokens x {m['kv_heads']} KV heads x "
             f"{m['head_dim']}, {res['raw_bf16_bytes'] / 1e9:.2f} GB bf16; moved {res['bytes_moved'] / 1e9:.3f} GB "
             f"({res['ratio_moved']:.4f}); bit-exact {res['bit_exact']}; {m['gpu']}, torch {m['torch']}, {m['date']}",
             "", "| path | bytes moved (GB) | seconds | GB/s of bf16 KV | speedup vs raw copy |", "|---|---:|---:|---:|---:|"]
    for r in res["rows"]:
        lines.append(f"| {r['path']} | {r['bytes'] / 1e9:.2f} | {r['seconds']:.4f} | {r['GBps_of_bf16']:.1f} | "
                     f"{r['speedup_vs_raw']:.2f}x |")
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
