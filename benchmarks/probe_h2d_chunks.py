#!/usr/bin/env python3
"""Do a restore's chunked copies run at the bus rate of one large copy? (issue 7, restore)

Restore copies a session's compressed chunks host -> device, one copy per chunk (74 for a
128k-token Llama-3.1-8B session at the default plan), from 16-byte aligned slices of one pinned
arena into a ring of staging buffers. bench_restore.py measured those copies alone at 54.8 GB/s
against 55.2 GB/s for the one raw copy of the bf16 cache (session 38, H100): 0.7% of the
restore's time. This probe times, in one process on the same pinned buffer, the same total bytes
copied

- ``one``: as one copy;
- ``plan16``: as the restore plan's chunks (sizes from ``offload.plan_chunks`` at the measured mean
  page size), 16-byte aligned in the arena (what restore does), into a ring of ``--depth`` buffers;
- ``plan4k`` / ``plan2m``: the same with each chunk starting at a multiple of 4 KiB / 2 MiB;
- ``plan16_onedst``: 16-byte aligned sources into one large destination (no ring);
- ``big16``: chunks of 4x the plan's size (fewer copies);
- ``two_streams``: the plan's chunks alternating between two copy streams;

both directions, rounds interleaved (the bus drifts by about 1% between separate medians), CUDA
events around each variant, median over rounds. Prints one table; ``--out`` writes JSON.

    python benchmarks/probe_h2d_chunks.py --rounds 7 --out $OUT/h2d_chunks.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
try:
    import weightszip._core  # noqa: F401  (an installed weightszip comes first)
except ImportError:
    sys.path.insert(0, str(HERE.parents[0] / "python"))
from weightszip.offload import plan_chunks  # noqa: E402


def layout(sizes, align):
    offs, a = [], 0
    for n in sizes:
        a = (a + align - 1) // align * align
        offs.append(a)
        a += n
    return offs, a


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=524288)
    ap.add_argument("--page-bytes", type=float, default=21725.4, help="mean compressed page bytes (session 38: 11396604496 / 524288)")
    ap.add_argument("--chunk-pages", type=int, default=8192)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--out")
    args = ap.parse_args()
    dev = torch.device("cuda")
    plan = plan_chunks(args.pages, args.chunk_pages)
    sizes = [int((b - a) * args.page_bytes) // 16 * 16 for a, b in plan]
    big = [sum(sizes[i : i + 4]) for i in range(0, len(sizes), 4)]
    total = sum(sizes)
    host = torch.empty(total + 2 * len(sizes) * (1 << 21) + (1 << 21), dtype=torch.uint8, pin_memory=True)
    host.fill_(7)
    dst = torch.empty(total + (1 << 21), dtype=torch.uint8, device=dev)
    ring = [torch.empty(max(big), dtype=torch.uint8, device=dev) for _ in range(args.depth)]
    s0, s1 = torch.cuda.Stream(), torch.cuda.Stream()
    lay = {"plan16": layout(sizes, 16), "plan4k": layout(sizes, 4096), "plan2m": layout(sizes, 1 << 21)}

    def chunks(szs, offs, h2d, onedst=False, streams=(s0,)):
        d = 0
        for i, (n, o) in enumerate(zip(szs, offs)):
            with torch.cuda.stream(streams[i % len(streams)]):
                g = dst[d : d + n] if onedst else ring[i % len(ring)][:n]
                if h2d:
                    g.copy_(host[o : o + n], non_blocking=True)
                else:
                    host[o : o + n].copy_(g, non_blocking=True)
            d += n

    def variants(h2d):
        one = (lambda: dst[:total].copy_(host[:total], non_blocking=True)) if h2d else (lambda: host[:total].copy_(dst[:total], non_blocking=True))
        big_offs = layout(big, 16)[0]
        return {
            "one": one,
            "plan16": lambda: chunks(sizes, lay["plan16"][0], h2d),
            "plan4k": lambda: chunks(sizes, lay["plan4k"][0], h2d),
            "plan2m": lambda: chunks(sizes, lay["plan2m"][0], h2d),
            "plan16_onedst": lambda: chunks(sizes, lay["plan16"][0], h2d, onedst=True),
            "big16": lambda: chunks(big, big_offs, h2d),
            "two_streams": lambda: chunks(sizes, lay["plan16"][0], h2d, streams=(s0, s1)),
        }

    def timed(fn):
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        cur = torch.cuda.current_stream()
        e0.record(cur)
        s0.wait_event(e0)
        s1.wait_event(e0)
        fn()
        cur.wait_stream(s0)
        cur.wait_stream(s1)
        e1.record(cur)
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / 1e3

    res = {"gpu": torch.cuda.get_device_name(), "total_bytes": total, "chunks": len(sizes), "big_chunks": len(big),
           "rounds": args.rounds, "times": {}}
    try:
        from tqdm import tqdm
    except ImportError:
        tqdm = None
    for direction in ("h2d", "d2h"):
        vs = variants(direction == "h2d")
        for fn in vs.values():  # warm-up
            timed(fn)
        times = {k: [] for k in vs}
        it = range(args.rounds)
        for _ in tqdm(it, desc=direction) if tqdm else it:
            for k, fn in vs.items():
                times[k].append(timed(fn))
        res["times"][direction] = times
    print(f"{res['gpu']}: {total / 1e9:.3f} GB, {len(sizes)} chunks (plan) / {len(big)} (big); median of {args.rounds} rounds")
    print("| variant | H2D s | H2D GB/s | vs one | D2H s | D2H GB/s | vs one |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    med = {d: {k: statistics.median(v) for k, v in res["times"][d].items()} for d in ("h2d", "d2h")}
    res["median_s"] = med
    for k in med["h2d"]:
        row = [k]
        for d in ("h2d", "d2h"):
            t = med[d][k]
            row += [f"{t:.5f}", f"{total / t / 1e9:.2f}", f"{med[d]['one'] / t:.4f}"]
        print("| " + " | ".join(row) + " |")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
