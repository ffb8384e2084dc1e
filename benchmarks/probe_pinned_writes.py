#!/usr/bin/env python3
"""Probe (GPU): can a Triton kernel write pinned host memory, at what bandwidth against a
device-to-host copy, and does a small device-to-host copy on another stream wait behind a large
one? The answers shaped offload's size read-back (kernels.regions.post). Prints its readings;
the H200 run of session 7 is in benchmarks/results/box/pinned_probe_s7.txt.

    python benchmarks/probe_pinned_writes.py
"""
import time, torch, triton, triton.language as tl

@triton.jit
def _cp(src, dst, n, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = i < n
    tl.store(dst + i, tl.load(src + i, mask=m), mask=m)

dev = torch.device("cuda")
src = torch.arange(1 << 20, dtype=torch.int64, device=dev)
h = torch.empty(1 << 20, dtype=torch.int64).pin_memory()
try:
    _cp[(triton.cdiv(src.numel(), 1024),)](src, h, src.numel(), BLOCK=1024)
    torch.cuda.synchronize()
    print("triton->pinned ok", bool((h == src.cpu()).all()))
except Exception as e:
    print("triton->pinned FAILED", type(e).__name__, e)
# bandwidth of kernel writes to pinned (int32 vectors)
for nbytes in (256 << 20, 1 << 30):
    s = torch.empty(nbytes // 4, dtype=torch.int32, device=dev).random_()
    hh = torch.empty(nbytes // 4, dtype=torch.int32).pin_memory()
    for _ in range(2):
        torch.cuda.synchronize(); t = time.perf_counter()
        _cp[(triton.cdiv(s.numel(), 4096),)](s, hh, s.numel(), BLOCK=4096)
        torch.cuda.synchronize(); dt = time.perf_counter() - t
    print(f"kernel write to pinned {nbytes/1e9:.2f} GB: {dt*1e3:.1f} ms {nbytes/dt/1e9:.1f} GB/s")
    torch.cuda.synchronize(); t = time.perf_counter()
    hh.copy_(s, non_blocking=True); torch.cuda.synchronize(); dt = time.perf_counter() - t
    print(f"memcpy D2H {nbytes/1e9:.2f} GB: {dt*1e3:.1f} ms {nbytes/dt/1e9:.1f} GB/s")
# small D2H on another stream behind a big D2H
big = torch.empty(4 << 30, dtype=torch.uint8, device=dev)
bigh = torch.empty(4 << 30, dtype=torch.uint8).pin_memory()
small = torch.ones(8, dtype=torch.int64, device=dev)
smallh = torch.empty(8, dtype=torch.int64).pin_memory()
s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
for trial in range(2):
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with torch.cuda.stream(s1):
        bigh.copy_(big, non_blocking=True)
    time.sleep(0.002)
    with torch.cuda.stream(s2):
        smallh.copy_(small, non_blocking=True)
        ev = torch.cuda.Event(); ev.record(s2)
    ev.synchronize(); t1 = time.perf_counter()
    with torch.cuda.stream(s2):
        _cp[(1,)](small, smallh, 8, BLOCK=8)
        ev2 = torch.cuda.Event(); ev2.record(s2)
    ev2.synchronize(); t2 = time.perf_counter()
    torch.cuda.synchronize(); t3 = time.perf_counter()
    print(f"small memcpy D2H done after {1e3*(t1-t0):.1f} ms; kernel write after {1e3*(t2-t1):.2f} ms more; big copy done at {1e3*(t3-t0):.1f} ms")
