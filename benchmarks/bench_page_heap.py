"""KV Exact's page heap bookkeeping (``weightszip.kv_exact.PageHeap``, host side, no GPU): the
Python cost of allocating and freeing a Llama-3.1-8B-shaped 128k session's pages (32 layers x K/V x
8192 pages = 524,288 regions of 20.8-24 KB), and of restoring half of them into a heap left with
262,144 one-page holes, against the page-by-page placement the heap uses for small batches.

    python benchmarks/bench_page_heap.py [--out benchmarks/results/page_heap.json]

The heap's tensor is not allocated (only the bookkeeping is timed); wall time, best of --repeats.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np


def heap(capacity: int, bulk_min: int):
    from weightszip.kv_exact import PageHeap

    h = PageHeap(capacity, device="meta")  # the bookkeeping alone: a buffer without storage
    h.bulk_min = bulk_min
    return h


def best(fn, repeats):
    out = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t)
    return min(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=524288)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    sizes = np.random.default_rng(0).integers(1300, 1500, args.pages) * 16
    cap = int(sizes.sum()) * 2 + (1 << 20)
    res = {"pages": args.pages, "bytes": int(sizes.sum())}
    from tqdm import tqdm

    for mode, bulk_min in tqdm([("runs", 256), ("page by page", 1 << 62)], desc="placements"):
        def session():
            h = heap(cap, bulk_min)
            return h, h.alloc(sizes)

        def alloc_free():
            h, o = session()
            h.free(o, sizes)

        def fragmented_restore():  # the allocation alone is timed
            h, o = session()
            h.free(o[::2], sizes[::2])  # every other page: one-page holes (freed one by one: not touching)
            t = time.perf_counter()
            h.alloc(sizes[::2])
            return time.perf_counter() - t

        res[mode] = {"alloc_session_s": best(lambda: session(), args.repeats),
                     "alloc_and_free_session_s": best(alloc_free, args.repeats),
                     "restore_half_into_fragmented_s": min(fragmented_restore() for _ in range(args.repeats))}
    # "page by page" differs only where free regions are listed (the last column); a batch into a
    # heap with none goes to the top in one step in both modes, and frees coalesce in both
    print(f"{args.pages} pages, {res['bytes'] / 1e9:.2f} GB; best of {args.repeats}, seconds")
    print(f"{'':16s} {'alloc':>8s} {'alloc+free':>11s} {'realloc half into holes':>24s}")
    for mode in ("runs", "page by page"):
        r = res[mode]
        print(f"{mode:16s} {r['alloc_session_s']:8.4f} {r['alloc_and_free_session_s']:11.4f} "
              f"{r['restore_half_into_fragmented_s']:24.4f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
