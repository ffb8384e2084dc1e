#!/usr/bin/env python3
"""Restore and offload of a long session's KV as compressed bytes (weightszip.offload) against a
raw pinned copy of the bf16 cache, in one run on one GPU.

The session: Llama-3.1-8B shape (32 layers x K/V, 8 KV heads x 128 = 1024 channels), 131072
tokens = 524288 pages of 16 tokens, 17.2 GB of bf16, laid out [layer][K/V][page]. Its values are
real KV (benchmarks/capture_kv.py captures or the .npz subset of bench_gpu_codec.py), tiled along
channels (bench_gpu_codec.tile_channels) and along tokens; (layer, K/V) takes the real set
``layer % sets`` of its kind, with that set's codebook. Held out: each codebook is calibrated on
its set's first half and the session is tiled from the second halves only (``--in-sample``: from
all tokens, as runs before 2026-12-01 did).

Measured (wall time around a synchronized call, median of --repeats):
- raw: one pinned bf16 copy, host -> device and device -> host (the baseline);
- ours: restore (pinned chunks -> GPU pages, verify on and off) and offload (GPU pages ->
  pinned chunks), end to end; bytes in transit and ratio;
- parts: the compressed chunks' copies alone (H2D, D2H; same chunks and buffers), the decode
  alone and encode alone (chunks resident in GPU memory, so the "copies" are device-to-device);
- a chunk-size sweep (one run each);
- with ``--timeline``: one offload and one restore timed by CUDA events (when each chunk's copy
  starts and ends, the bus's idle time, the host's steps until the first copy);
- with ``--paired N``: N rounds of raw H2D, raw D2H, offload and restore, each speedup against its
  own round's raw copy (the bus drifts by about 1% between separate medians on the GPU box).

    python benchmarks/bench_restore.py --kv .boxdata/kv_pages_subset.npz --out $OUT
    # CPU smoke (Triton interpreter, tiny): TRITON_INTERPRET=1 python benchmarks/bench_restore.py \
    #   --kv tests/data/kv_smollm2_64tok.npy --device cpu --channels 32 --layers 2 --tokens 64 --repeats 1 --sweep 2
"""

from __future__ import annotations

import argparse
import datetime as dt
import gzip
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
try:  # an installed weightszip (the GPU box: wheel + python/ copied over it) comes first
    import weightszip._core  # noqa: F401
except ImportError:
    sys.path.insert(0, str(HERE.parents[0] / "python"))
from weightszip import offload as ol  # noqa: E402

sys.path.insert(0, str(HERE))
from bench_gpu_codec import calibrated_sets  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", action="append", required=True)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--channels", type=int, default=1024)
    ap.add_argument("--chunk-pages", type=int, default=8192)
    ap.add_argument("--depth", type=int, default=3)
    ap.add_argument("--block-pages", type=int, default=32, help="the encoder's pages per program")
    ap.add_argument("--decode-block-pages", type=int, default=None, help="the decoder's (default: its own)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--sweep", type=lambda v: [int(x) for x in v.split(",") if x], default=[2048, 4096, 16384])
    ap.add_argument("--in-sample", action="store_true", help="tile the session from all tokens (half of them calibrated the codebooks)")
    ap.add_argument("--trace", action="store_true", help="then one offload and one restore under torch.profiler: "
                    "where the copy engine sits idle (restore_trace_*.json.gz and a summary in restore.json)")
    ap.add_argument("--timeline", action="store_true", help="then one offload and one restore without the profiler, "
                    "timed by CUDA events: when each chunk's copy ends against the same copy alone (restore.json's "
                    "timeline and restore_timeline)")
    ap.add_argument("--paired", type=int, default=0, help="then this many rounds of raw H2D, raw D2H, offload, "
                    "restore: the median of each round's speedup against its own raw copy")
    ap.add_argument("--host-profile", action="store_true", help="then one offload under cProfile: the host's time "
                    "by function (restore_host_profile.txt)")
    ap.add_argument("--align-sweep", type=lambda v: [int(x) for x in v.split(",") if x], default=[],
                    help="then rounds of offload and restore into the pinned arena at each of these slice "
                         "alignments (HostArena(align=); e.g. 16,4096,2097152), each round against its own raw copies")
    ap.add_argument("--align-rounds", type=int, default=5)
    ap.add_argument("--max-len", type=int, default=8, help="the codebooks' longest code (pages.calibrate; 2 to 12)")
    ap.add_argument("--page-version", type=int, default=1, choices=(1, 2),
                    help="the codebooks' version (2: sign and exponent in context classes, bf16)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=str(HERE / "results"))
    args = ap.parse_args()

    import torch
    from tqdm import tqdm

    dev = torch.device(args.device)
    is_cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if is_cuda else (lambda: None)
    C = args.channels
    res = {"command": " ".join(sys.argv), "date": dt.date.today().isoformat(), "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name() if is_cuda else "cpu (Triton interpreter; not quoted)",
           "cpu": platform.processor() or platform.machine(), "args": vars(args), "checks": {}}
    steps = tqdm(total=9, desc="bench_restore")
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)

    def step(name):
        steps.set_postfix_str(name)
        steps.update(1)
        (outdir / "restore.json").write_text(json.dumps(res, indent=1, default=str))  # partial results survive a timeout

    def timed(fn, reps=args.repeats):
        ts = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts), ts

    # Real sets -> codebooks (one per set) and the session's pages on the device.
    by_kind = calibrated_sets(args.kv, C, args.max_len, args.page_version)
    sets = {kind: [(name, cb, x) for name, k, cb, x in by_kind if k == kind] for kind in "KV"}
    names = [name for kind in "KV" for name, _, _ in sets[kind]]
    cbs = [cb for kind in "KV" for _, cb, _ in sets[kind]]
    codec = ol.ExactPageCodec(cbs)
    per_group = args.tokens // 16
    n = args.layers * 2 * per_group
    x = torch.empty(n, 16, C, dtype=torch.int16, device=dev)
    tids = np.empty(n, np.int32)
    for layer in range(args.layers):
        for k, kind in enumerate("KV"):
            j = layer % len(sets[kind])
            xs = sets[kind][j][2]
            xs = xs if args.in_sample else xs[xs.shape[0] // 2 :]
            src = torch.from_numpy(np.ascontiguousarray(xs).view(np.int16).reshape(-1, 16, C)).to(dev)
            g = (2 * layer + k) * per_group
            for a in range(0, per_group, src.shape[0]):
                b = min(per_group, a + src.shape[0])
                x[g + a : g + b] = src[: b - a]
            tids[g : g + per_group] = (0 if kind == "K" else len(sets["K"])) + j
    x = x.view(torch.bfloat16)
    raw = x.numel() * 2
    res.update(sets=names, n_pages=n, raw_bytes=raw, held_out=not args.in_sample)
    codec.tables(dev)
    sync()
    step("session built")

    # Same bytes as the Rust codec on the session's first pages (also warms the Triton kernels).
    m = min(n, 600)
    sg = ol.offload(x[:m], codec, tids[:m], chunk_pages=256, backend="triton", block_pages=args.block_pages)
    sr = ol.offload(x[:m].cpu(), codec, tids[:m], chunk_pages=256, backend="rust")
    flat = lambda s: b"".join(bytes(c.host[: c.region_bytes].cpu().numpy()) for c in s.chunks)  # noqa: E731
    res["checks"]["gpu_session_bytes_equal_rust"] = flat(sg) == flat(sr)
    res["checks"]["rust_restores_gpu_session"] = bool(torch.equal(ol.restore(sg, backend="rust", device="cpu"), x[:m].cpu()))
    ol.restore(sg, torch.empty_like(x[:m]), block_pages=args.decode_block_pages)
    step("checked against Rust")

    # Pinned host memory, allocated once (not timed in the copies).
    t0 = time.perf_counter()
    host_raw = torch.empty(raw, dtype=torch.uint8, pin_memory=is_cuda)
    # The sessions go into the same pinned memory once the raw copies are timed (pinning 30 GB
    # took 14 s of device time in the first run).
    arena = ol.HostArena(0, buffer=host_raw)
    res["pinned_alloc_s"] = time.perf_counter() - t0
    res["pinned_bytes"] = raw
    step("pinned allocated")

    xb = x.view(-1).view(torch.uint8)
    out = torch.empty_like(x)
    ob = out.view(-1).view(torch.uint8)
    res["raw_d2h_s"], res["raw_d2h_times"] = timed(lambda: host_raw.copy_(xb, non_blocking=True))
    res["raw_h2d_s"], res["raw_h2d_times"] = timed(lambda: ob.copy_(host_raw, non_blocking=True))
    res["checks"]["raw_copy_round_trip"] = bool(torch.equal(out, x))
    step("raw copies")

    kw = dict(depth=args.depth, block_pages=args.block_pages)
    rkw = dict(depth=args.depth, block_pages=args.decode_block_pages)
    holder = {}

    def do_offload(cp=args.chunk_pages, host=arena):
        host.reset()
        holder["s"] = ol.offload(x, codec, tids, chunk_pages=cp, host=host, **kw)

    res["offload_s"], res["offload_times"] = timed(do_offload)
    s = holder["s"]
    res.update(chunks=len(s.chunks), compressed_bytes=s.nbytes, page_bytes=sum(c.nbytes for c in s.chunks),
               ratio=s.nbytes / raw, pinned_fallbacks=s.pinned_fallbacks)
    step("offload")
    out.zero_()
    res["restore_s"], res["restore_times"] = timed(lambda: ol.restore(s, out, verify=True, **rkw))
    res["checks"]["restore_bit_exact"] = bool(torch.equal(out, x))
    res["restore_noverify_s"], res["restore_noverify_times"] = timed(lambda: ol.restore(s, out, verify=False, **rkw))
    step("restore")

    # Parts: the same chunks' copies alone, through a ring of staging buffers on one stream.
    size = max(c.region_bytes for c in s.chunks)
    ring = [torch.empty(size, dtype=torch.uint8, device=dev) for _ in range(args.depth)]

    def h2d_only(sess=s):
        for i, c in enumerate(sess.chunks):
            ring[i % len(ring)][: c.region_bytes].copy_(c.host[: c.region_bytes], non_blocking=True)

    res["h2d_compressed_only_s"], _ = timed(h2d_only)
    # Chunks resident in GPU memory: restore / offload through the same code, copies now D2D.
    garena = ol.HostArena(int(raw * 0.75), device=dev)
    do_offload(host=garena)
    res["encode_only_s"], _ = timed(lambda: do_offload(host=garena))
    sdev = holder["s"]
    res["decode_only_s"], _ = timed(lambda: ol.restore(sdev, out, verify=True, **rkw))
    res["decode_only_noverify_s"], _ = timed(lambda: ol.restore(sdev, out, verify=False, **rkw))
    res["checks"]["decode_only_bit_exact"] = bool(torch.equal(out, x))

    def d2h_only():  # the same bytes at the same places as the session s (same sequence of arena slices)
        for c in sdev.chunks:
            host_raw[c.host.data_ptr() - garena.buffer.data_ptr() :][: c.region_bytes].copy_(c.host[: c.region_bytes], non_blocking=True)

    res["d2h_compressed_only_s"], _ = timed(d2h_only)
    del garena, sdev
    step("parts")

    sweep = {}
    for cp in args.sweep:
        off, _ = timed(lambda: do_offload(cp=cp), 1)
        rst, _ = timed(lambda: ol.restore(holder["s"], out, verify=True, **rkw), 1)
        sweep[cp] = dict(offload_s=off, restore_s=rst, chunks=len(holder["s"].chunks), ok=bool(torch.equal(out, x)))
    res["chunk_sweep"] = sweep
    step("sweep")

    if args.trace and is_cuda:
        try:
            res["trace"] = {"offload": copy_gaps(lambda: do_offload(), outdir / "restore_trace_offload.json.gz", "DtoH"),
                            "restore": copy_gaps(lambda: ol.restore(holder["s"], out, verify=True, **rkw), outdir / "restore_trace_restore.json.gz", "HtoD")}
        except Exception as e:  # report, never hide
            res["trace"] = {"error": f"{type(e).__name__}: {e}"}
        print("trace", json.dumps(res["trace"]), flush=True)

    if args.timeline and is_cuda:
        res["timeline"] = offload_timeline(lambda: do_offload(), lambda: holder["s"], dev)
        print("timeline", json.dumps({k: v for k, v in res["timeline"].items() if k != "chunks"}), flush=True)
        try:  # written after the offload's timeline was first measured (session 13): report, never hide
            res["restore_timeline"] = offload_timeline(lambda: ol.restore(holder["s"], out, verify=True, **rkw),
                                                       lambda: holder["s"], dev, direction="HtoD")
        except Exception as e:  # noqa: BLE001
            res["restore_timeline"] = {"error": f"{type(e).__name__}: {e}"}
        print("restore timeline", json.dumps({k: v for k, v in res["restore_timeline"].items() if k != "chunks"}),
              flush=True)

    if args.paired:
        # Rounds of (raw H2D, raw D2H, offload, restore), each speedup against the raw copy of its
        # own round: the bus's speed drifts between the runs' separate medians (about 1% on the box).
        # The raw D2H overwrites the pinned arena, so each round offloads again before restoring.
        rounds = []
        for _ in range(args.paired):
            r = {}
            r["raw_h2d"], _ = timed(lambda: ob.copy_(host_raw, non_blocking=True), 1)
            r["raw_d2h"], _ = timed(lambda: host_raw.copy_(xb, non_blocking=True), 1)
            r["offload"], _ = timed(lambda: do_offload(), 1)
            r["restore"], _ = timed(lambda: ol.restore(holder["s"], out, verify=True, **rkw), 1)
            rounds.append(r)
        res["paired"] = {"rounds": rounds,
                         "restore_speedup": statistics.median(r["raw_h2d"] / r["restore"] for r in rounds),
                         "offload_speedup": statistics.median(r["raw_d2h"] / r["offload"] for r in rounds)}
        res["checks"]["paired_restore_bit_exact"] = bool(torch.equal(out, x))
        print("paired", json.dumps({k: v for k, v in res["paired"].items() if k != "rounds"}), flush=True)

    if args.align_sweep:
        # Rounds of (raw H2D, raw D2H, then for each alignment, in an order rotated each round: offload
        # into the pinned buffer with slices at that alignment, restore, the restore's copies alone),
        # each speedup against its own round's raw copy (the bus drifts by about 1% between medians).
        aligns, rounds = list(args.align_sweep), []
        for i in range(args.align_rounds):
            r = {"raw_h2d": timed(lambda: ob.copy_(host_raw, non_blocking=True), 1)[0],
                 "raw_d2h": timed(lambda: host_raw.copy_(xb, non_blocking=True), 1)[0]}
            for a in aligns[i % len(aligns):] + aligns[: i % len(aligns)]:
                ar = ol.HostArena(0, buffer=host_raw, align=a)
                r[f"offload_{a}"], _ = timed(lambda: (ar.reset(), holder.update(a=ol.offload(
                    x, codec, tids, chunk_pages=args.chunk_pages, host=ar, **kw))), 1)
                sa = holder.pop("a")
                if sa.pinned_fallbacks or any(c.host.data_ptr() % a for c in sa.chunks):
                    raise RuntimeError(f"align {a}: {sa.pinned_fallbacks} chunks outside the arena or misaligned")
                out.zero_()
                r[f"restore_{a}"], _ = timed(lambda: ol.restore(sa, out, verify=True, **rkw), 1)
                res["checks"][f"align_{a}_restore_bit_exact"] = bool(torch.equal(out, x))
                r[f"h2d_only_{a}"], _ = timed(lambda: h2d_only(sa), 1)
                del sa
            rounds.append(r)
        med = statistics.median
        res["align_sweep"] = {"rounds": rounds, "by_align": {a: {
            "restore_speedup": med(r["raw_h2d"] / r[f"restore_{a}"] for r in rounds),
            "offload_speedup": med(r["raw_d2h"] / r[f"offload_{a}"] for r in rounds),
            "restore_s": med(r[f"restore_{a}"] for r in rounds), "offload_s": med(r[f"offload_{a}"] for r in rounds),
            "h2d_only_s": med(r[f"h2d_only_{a}"] for r in rounds)} for a in aligns},
            "raw_h2d_s": med(r["raw_h2d"] for r in rounds), "raw_d2h_s": med(r["raw_d2h"] for r in rounds)}
        print("align_sweep", json.dumps({k: v for k, v in res["align_sweep"].items() if k != "rounds"}), flush=True)

    if args.host_profile:
        import cProfile
        import io
        import pstats

        sync()
        prof = cProfile.Profile()
        prof.runcall(do_offload)
        sync()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(30)
        (outdir / "restore_host_profile.txt").write_text(text.getvalue())

    res["restore_speedup_vs_raw_h2d"] = res["raw_h2d_s"] / res["restore_s"]
    res["restore_noverify_speedup"] = res["raw_h2d_s"] / res["restore_noverify_s"]
    res["offload_speedup_vs_raw_d2h"] = res["raw_d2h_s"] / res["offload_s"]
    gb = lambda b, t: b / t / 1e9  # noqa: E731
    cb = res["compressed_bytes"]
    rows = [
        ("raw bf16 pinned copy H2D", raw, res["raw_h2d_s"], gb(raw, res["raw_h2d_s"]), 1.0),
        ("restore (verify)", cb, res["restore_s"], gb(raw, res["restore_s"]), res["restore_speedup_vs_raw_h2d"]),
        ("restore (no verify)", cb, res["restore_noverify_s"], gb(raw, res["restore_noverify_s"]), res["restore_noverify_speedup"]),
        ("  part: H2D of the compressed chunks alone", cb, res["h2d_compressed_only_s"], gb(raw, res["h2d_compressed_only_s"]), None),
        ("  part: decode alone (verify; chunks in GPU memory)", cb, res["decode_only_s"], gb(raw, res["decode_only_s"]), None),
        ("raw bf16 pinned copy D2H", raw, res["raw_d2h_s"], gb(raw, res["raw_d2h_s"]), 1.0),
        ("offload", cb, res["offload_s"], gb(raw, res["offload_s"]), res["offload_speedup_vs_raw_d2h"]),
        ("  part: D2H of the compressed chunks alone", cb, res["d2h_compressed_only_s"], gb(raw, res["d2h_compressed_only_s"]), None),
        ("  part: encode alone (chunks to GPU memory)", cb, res["encode_only_s"], gb(raw, res["encode_only_s"]), None),
    ]
    lines = ["| path | bytes moved (GB) | seconds | GB/s of bf16 KV | speedup vs raw copy |", "|---|---:|---:|---:|---:|"]
    for name, b, t, r, sp in rows:
        lines.append(f"| {name} | {b / 1e9:.2f} | {t:.4f} | {r:.1f} | {'' if sp is None else f'{sp:.2f}x'} |")
    table = "\n".join(lines)
    res["table_md"] = table
    steps.close()
    print(table)
    print(json.dumps({k: v for k, v in res.items() if not k.endswith("_times") and k != "table_md"}, indent=1))
    (outdir / "restore.json").write_text(json.dumps(res, indent=1))
    (outdir / "restore.md").write_text(table + "\n")


def offload_timeline(run, session, dev, first: int = 12, direction: str = "DtoH"):
    """One offload (``run``; with ``direction`` "HtoD" one restore) with no profiler: every event
    the call records (its ``_Streams.record``, swapped for timing events for this call) is timed
    against an event queued on the idle GPU just before the call, and the host's clock is read at
    each. Then each chunk's copy alone (the same bytes between a GPU buffer and the same pinned
    region, one stream, events around each) gives its duration, so each copy's start and the bus's
    idle time before it follow (start = end - duration). Times in ms from the call; ``chunks`` lists
    the first ``first``. ``host_steps``: when the host entered and left the call's steps (its helpers
    and kernels' wrappers, wrapped for this call) until the first chunk's copy was queued; for a
    restore also ``last_copy_to_end_ms``: the GPU's work after the last copy (the last chunk's decode
    and digest; the digests' move to the host after them is in ``call_ms`` only)."""
    import torch

    from weightszip.kernels import exact_page, regions

    recs, steps = [], []

    class Event(torch.cuda.Event):  # the host's wait for an event is a step too
        def synchronize(self):
            t = time.perf_counter()
            super().synchronize()
            steps.append(("event wait", t, time.perf_counter()))

    def record(self, name):
        ev = Event(enable_timing=True)
        ev.record(getattr(self, name))
        recs.append((name, ev, time.perf_counter()))
        return ev

    def stamped(label, fn):
        def call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                steps.append((label, t, time.perf_counter()))
        return call

    swaps = [(ol._Streams, "record", record)] + [
        (mod, name, stamped(f"{mod.__name__.rsplit('.', 1)[-1]}.{name}", getattr(mod, name)))
        for mod, names in [(ol, ["_check_pages", "_check_table_ids", "plan_chunks", "_IdStager", "_Digests",
                                 "_host_region", "_ring_buffer", "_Streams", "_digest_into", "_check_region"]),
                           (exact_page, ["page_layout", "encode_into", "decode_into"]), (regions, ["post"])]
        for name in names if hasattr(mod, name)] + [(ol._IdStager, "stage", stamped("offload._IdStager.stage", ol._IdStager.stage))]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in swaps]
    torch.cuda.synchronize()
    start = torch.cuda.Event(enable_timing=True)
    try:
        for obj, name, new in swaps:
            setattr(obj, name, new)
        start.record()
        h0 = time.perf_counter()
        run()
        h1 = time.perf_counter()
        torch.cuda.synchronize()
    finally:
        for obj, name, old in saved:
            setattr(obj, name, old)
    ends = [(start.elapsed_time(ev), (h - h0) * 1e3) for name, ev, h in recs if name == "copy"]
    comp_end = max((start.elapsed_time(ev) for name, ev, h in recs if name == "comp"), default=0.0)
    # Each chunk's copy alone, its region's own bytes (a D2H copy writes back what it first read,
    # untimed), so the session stays intact for the calls after this one.
    chunks = session().chunks
    gbuf = torch.empty(max(c.region_bytes for c in chunks), dtype=torch.uint8, device=dev)
    marks = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in chunks]
    for c, (m0, m1) in zip(chunks, marks):
        g, h = gbuf[: c.region_bytes], c.host[: c.region_bytes]
        src, dst = (g, h) if direction == "DtoH" else (h, g)
        if direction == "DtoH":
            g.copy_(h, non_blocking=True)
        m0.record()
        dst.copy_(src, non_blocking=True)
        m1.record()
    torch.cuda.synchronize()
    dur = [a.elapsed_time(b) for a, b in marks]
    starts = [e - d for (e, _), d in zip(ends, dur)]
    idle = [starts[0]] + [max(0.0, b - a[0]) for a, b in zip(ends, starts[1:])]
    first_queued = ends[0][1] if ends else 0.0
    host_steps = [(label, round((a - h0) * 1e3, 3), round((b - h0) * 1e3, 3)) for label, a, b in sorted(steps, key=lambda e: e[1])
                  if (a - h0) * 1e3 <= first_queued]
    return {"call_ms": (h1 - h0) * 1e3, "gpu_done_ms": max(ends[-1][0], comp_end), "last_copy_to_end_ms":
            max(0.0, comp_end - ends[-1][0]), "copies_alone_ms": sum(dur), "host_steps": host_steps,
            "first_copy_start_ms": starts[0], "bus_idle_between_ms": sum(idle[1:]),
            "after_last_copy_host_ms": (h1 - h0) * 1e3 - ends[-1][0],
            "chunks": [{"pages": c.n_pages, "copy_queued_host_ms": q, "copy_start_ms": st, "copy_end_ms": e,
                        "copy_alone_ms": d, "bus_idle_before_ms": i}
                       for c, (e, q), st, d, i in zip(chunks[:first], ends, starts, dur, idle)]}


def copy_gaps(fn, path, direction):
    """Run ``fn`` once under torch.profiler; from its CUDA timeline: when the first and last bus copy
    in ``direction`` ("DtoH" or "HtoD", at least 50 us) start and end relative to the first GPU
    activity, how long those copies ran, and the idle time between them (the copy engine waiting
    for the codec or the host); the call's wall time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    prof.export_chrome_trace(str(path))  # a ".gz" path: torch gzips it (Perfetto opens it as it is)
    with gzip.open(path, "rt") as f:
        ev = json.load(f)["traceEvents"]
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    cp = sorted((e for e in gpu if e["cat"] == "gpu_memcpy" and direction in e.get("name", "") and e["dur"] > 50),
                key=lambda e: e["ts"])
    if not cp:
        return {"wall_s": wall, "copies": 0}
    t_first = min(e["ts"] for e in gpu)
    t_end = max(e["ts"] + e["dur"] for e in gpu)
    busy = sum(e["dur"] for e in cp)
    gaps = [b["ts"] - (a["ts"] + a["dur"]) for a, b in zip(cp, cp[1:])]
    top = sorted(range(len(gaps)), key=gaps.__getitem__, reverse=True)[:5]
    return {"wall_s": wall, "copies": len(cp), "gpu_span_ms": (t_end - t_first) / 1e3,
            "first_copy_starts_ms": (cp[0]["ts"] - t_first) / 1e3, "after_last_copy_ms": (t_end - cp[-1]["ts"] - cp[-1]["dur"]) / 1e3,
            "copies_busy_ms": busy / 1e3, "gaps_between_copies_ms": sum(max(g, 0) for g in gaps) / 1e3,
            "largest_gaps_ms": [gaps[k] / 1e3 for k in top], "largest_gap_after_copy": top}


if __name__ == "__main__":
    main()
