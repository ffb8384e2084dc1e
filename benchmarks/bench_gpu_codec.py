#!/usr/bin/env python3
"""Exact page profile: ratio on real KV (CPU) and GPU encode / decode throughput (Triton).

Real bf16 KV (benchmarks/capture_kv.py layout [K/V, layer, tokens, channels], uint16 bits) is
tiled along channels to the Llama-3.1-8B shape (8 KV heads x 128 = 1024 channels). For every
(model, layer, K/V) a codebook is calibrated on the first half of the tokens; ratios are measured
on the second half (held out). Bytes counted: page headers, raw bytes, code words, the padding of
each page to 8 bytes, and (column "+offs") an 8-byte offset per page in the pool; the codebook is
per model and listed apart.

    # ratio only (CPU): page profile vs the dense Rust codec on the same tiled bytes
    python benchmarks/bench_gpu_codec.py --ratio --kv /tmp/kv/smollm2_8k.npy --kv /tmp/kv/qwen_8k.npy
    # GPU: Triton encode / decode of >= 1 GiB (data tiled), checked against the Rust codec both ways
    python benchmarks/bench_gpu_codec.py --speed --kv .boxdata/kv_pages_subset.npz --gib 1 --out $OUT
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from weightszip import pages  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
LLAMA_C = 1024


def tile_channels(x: np.ndarray, c: int = LLAMA_C) -> np.ndarray:
    """[T, C0] -> [T, c] by repeating whole channel blocks (heads) and cutting at c."""
    reps = -(-c // x.shape[1])
    return np.ascontiguousarray(np.tile(x, (1, reps))[:, :c])


def load_sets(paths, layers_per_model=None):
    """Yields (name, kind, layer, [T, C] uint16) for every model file."""
    for p in paths:
        p = Path(p)
        if p.suffix == ".npz":
            z = np.load(p)
            for key in sorted(z.files):
                model, kind, layer = key.split(":")
                yield model, kind, int(layer), z[key]
        else:
            kv = np.load(p, mmap_mode="r")
            layers = range(kv.shape[1]) if layers_per_model is None else np.linspace(0, kv.shape[1] - 1, layers_per_model).round().astype(int)
            for layer in layers:
                for k, kind in enumerate("KV"):
                    yield p.stem, kind, int(layer), np.asarray(kv[k, layer])


def calibrated_sets(paths, channels: int = LLAMA_C, max_len: int = 8, version: int = 1):
    """(name, kind, codebook, x) for every real set: x [T, channels] uint16 bf16 bits (tiled along
    channels, T a multiple of 32), its codebook (of ``version``) calibrated on its first half."""
    out = []
    for model, kind, layer, x in load_sets(paths):
        x = tile_channels(x, channels)
        x = x[: x.shape[0] // 32 * 32]
        cb = pages.calibrate(x[: x.shape[0] // 2], "bfloat16", max_len, version=version)
        out.append((f"{model}:{kind}:{layer}", kind, cb, x))
    return out


def device_pages(sets, dev, page_tables):
    """All sets' pages on ``dev`` for one launch: (``page_tables`` of their codebooks stacked, int16
    pages [n, 16, C], int32 table ids [n]: every (model, layer, K/V) page names its codebook)."""
    import torch

    C = sets[0][3].shape[1]
    tb = page_tables.stack([page_tables.from_codebook(cb, dev) for _, _, cb, _ in sets])
    vu = torch.from_numpy(np.concatenate([x for *_, x in sets]).view(np.int16).reshape(-1, 16, C)).to(dev)
    tu = torch.cat([torch.full((x.shape[0] // 16,), i, dtype=torch.int32) for i, (*_, x) in enumerate(sets)]).to(dev)
    return tb, vu, tu


def ratio_main(args):
    import ml_dtypes
    import weightszip
    from tqdm import tqdm

    rows = []
    sets = list(load_sets(args.kv, args.layers))
    for model, kind, layer, x in tqdm(sets, desc="ratio"):
        x = tile_channels(x)
        T = x.shape[0] // 32 * 32
        cal, ev = x[: T // 2], x[T // 2 : T]
        cb = pages.calibrate(cal, "bfloat16", args.max_len)
        buf, offs = pages.encode_pages(cb, ev.reshape(-1, 16, LLAMA_C))
        assert (pages.decode_pages(cb, buf, offs) == ev.reshape(-1, 16, LLAMA_C)).all()
        n_pages = len(offs) - 1
        dense = weightszip.compress(ev.view(ml_dtypes.bfloat16), axis=1)
        dense_pages = sum(len(weightszip.compress(pg.view(ml_dtypes.bfloat16), axis=1)) for pg in ev.reshape(-1, 16, LLAMA_C)[:32])
        rows.append(dict(model=model, kind=kind, layer=layer, raw=ev.nbytes, pages=len(buf), n_pages=n_pages,
                         codebook=len(cb), dense=len(dense), dense_pages32=dense_pages, raw_pages32=32 * 16 * LLAMA_C * 2))
    out = {"command": " ".join(sys.argv), "date": dt.date.today().isoformat(), "machine": platform.processor() or platform.machine(),
           "max_len": args.max_len, "rows": rows, "summary": {}}
    lines = ["| model | K/V | page profile | +offs | dense Rust codec (whole half) | dense codec, 16-token pages | codebook KiB |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for model in sorted({r["model"] for r in rows}):
        for kind in ("K", "V", "K+V"):
            rs = [r for r in rows if r["model"] == model and (kind == "K+V" or r["kind"] == kind)]
            raw = sum(r["raw"] for r in rs)
            pg = sum(r["pages"] for r in rs) / raw
            pgo = (sum(r["pages"] + 8 * r["n_pages"] for r in rs)) / raw
            de = sum(r["dense"] for r in rs) / raw
            dp = sum(r["dense_pages32"] for r in rs) / sum(r["raw_pages32"] for r in rs)
            cbk = sum(r["codebook"] for r in rs) / 1024
            out["summary"][f"{model}:{kind}"] = dict(page=pg, page_offs=pgo, dense=de, dense_pages=dp, codebook_kib=cbk)
            lines.append(f"| {model} | {kind} | {pg:.4f} | {pgo:.4f} | {de:.4f} | {dp:.4f} | {cbk:.0f} |")
    table = "\n".join(lines)
    print(table)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "gpu_codec_ratio.json").write_text(json.dumps(out, indent=1))
    (RESULTS / "gpu_codec_ratio.md").write_text(table + "\n")


def _timed(fn, reps, torch):
    times = []
    if not torch.cuda.is_available():  # smoke runs in the interpreter: wall time, not quoted
        for i in range(reps + 1):
            t0 = time.perf_counter()
            fn()
            if i:
                times.append(time.perf_counter() - t0)
        return statistics.median(times), times
    for i in range(reps + 1):
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        if i:
            times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times), times


def speed_main(args):
    import torch

    try:
        from weightszip.kernels import exact_page, exact_page2
    except ImportError:  # a checkout without the python/weightszip/kernels link
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from triton_kernels import exact_page, exact_page2
    if args.page_version == 1:
        PageTables, gluon_applies = exact_page.PageTables, exact_page.gluon_applies
        decode_pages, encode_pages = exact_page.decode_pages, exact_page.encode_pages
    else:  # version 2 has the Triton decoder only
        PageTables, gluon_applies = exact_page2.PageTables2, (lambda *_: False)
        decode_pages, encode_pages = exact_page2.decode_pages, exact_page2.encode_pages

    dev = args.device
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    outdir = Path(args.out)
    outdir.mkdir(parents=True, exist_ok=True)
    res = {"command": " ".join(sys.argv), "date": dt.date.today().isoformat(), "gpu": torch.cuda.get_device_name() if dev == "cuda" else "cpu (interpreter)",
           "torch": torch.__version__, "groups": [], "checks": {}}
    import triton

    res["triton"] = triton.__version__
    res["page_version"] = args.page_version
    sets = calibrated_sets(args.kv, args.channels, args.max_len, args.page_version)
    groups = [(name, cb, x.reshape(-1, 16, args.channels)) for name, _, cb, x in sets]
    unique = sum(g[2].nbytes for g in groups)
    reps = max(1, -(-int(args.gib * (1 << 30)) // unique))
    print(f"{len(groups)} groups, {unique / 1e6:.1f} MB unique, tiled x{reps}", flush=True)
    tb, vu, tu = device_pages(sets, dev, PageTables)
    # Both directions on the unique pages: Triton encode == Rust encode (byte for byte, offsets
    # too); Triton decodes the Rust bytes; the validating Rust decoder reads the Triton bytes.
    rbufs, roffs, base = [], [], 0
    for _, cb, v in groups:
        b, o = pages.encode_pages(cb, v)
        rbufs.append(np.frombuffer(b, np.uint8))
        roffs.append(o[:-1] + base)
        base += len(b)
    rbuf = np.concatenate(rbufs)
    roff = np.concatenate(roffs + [np.array([base])])
    gbuf, goff = encode_pages(vu, tb, tu)
    ok_enc = bool(np.array_equal(gbuf.cpu().numpy(), rbuf)) and bool(np.array_equal(goff.cpu().numpy(), roff))
    dec = decode_pages(torch.from_numpy(rbuf.copy()).to(dev), torch.from_numpy(roff).to(dev), tb, table_ids=tu)
    ok_dec = bool(torch.equal(dec, vu))
    gb, go = gbuf.cpu().numpy(), goff.cpu().numpy()
    ok_rust = True
    first = 0
    for _, cb, v in groups:
        k = v.shape[0]
        ok_rust &= bool((pages.decode_pages(cb, gb, go[first : first + k + 1]) == v).all())
        first += k
    res["checks"] = {"triton_encode_equals_rust": ok_enc, "triton_decodes_rust_pages": ok_dec, "rust_decodes_triton_pages": ok_rust}
    res["ratio_all_tokens"] = len(rbuf) / vu.numel() / 2
    res["ratio_all_tokens_with_8B_offsets"] = (len(rbuf) + 8 * vu.shape[0]) / vu.numel() / 2
    print("checks", res["checks"], "ratio", res["ratio_all_tokens"], flush=True)
    big = vu.repeat(reps, 1, 1)
    tids = tu.repeat(reps)
    total_raw = big.numel() * 2
    res["raw_bytes"] = total_raw
    enc = {}

    def enc_all(bp=128):
        enc["b"], enc["o"] = encode_pages(big, tb, tids, block_pages=bp)

    out = torch.empty_like(big)

    def dec_all(bp=None, kernel="auto"):
        decode_pages(enc["b"], enc["o"], tb, out=out, table_ids=tids, block_pages=bp, kernel=kernel)

    enc_all()
    sync()
    res["ratio_tiled"] = enc["b"].numel() / total_raw
    dec_all()
    sync()
    res["checks"]["tiled_round_trip"] = bool(torch.equal(out, big))
    gluon = gluon_applies(enc["b"], tb, out)  # the Gluon decoder (opt-in) on the same bytes
    if gluon:
        out.zero_()
        dec_all(kernel="gluon")
        res["checks"]["tiled_round_trip_gluon"] = bool(torch.equal(out, big))
        # from page 16 on, every 64-page program straddles two of the 256-page sets (two codebooks)
        mixed = decode_pages(enc["b"], enc["o"][16:], tb, table_ids=tids[16:], block_pages=64, kernel="gluon")
        res["checks"]["gluon_mixed_codebook_programs"] = bool(torch.equal(mixed, big[16:]))
        del mixed
    t_enc, te = _timed(enc_all, args.repeats, torch)
    t_dec, td = _timed(dec_all, args.repeats, torch)
    if gluon:
        t_gl, _ = _timed(lambda: dec_all(kernel="gluon"), args.repeats, torch)
        res["decode_gluon_GBps"] = total_raw / t_gl / 1e9
    flat = big.reshape(-1)
    t_copy, _ = _timed(lambda: flat.clone(), args.repeats, torch)
    t_sum, _ = _timed(lambda: flat.view(torch.int32).sum(dtype=torch.int64), args.repeats, torch)
    res.update(encode_s=t_enc, decode_s=t_dec, encode_times=te, decode_times=td,
               encode_GBps=total_raw / t_enc / 1e9, decode_GBps=total_raw / t_dec / 1e9,
               d2d_copy_GBps_rw=2 * total_raw / t_copy / 1e9, read_probe_GBps=total_raw / t_sum / 1e9)
    sweep = {}
    for bp in args.block_pages:
        try:
            d, _ = _timed(lambda: dec_all(bp, "triton"), args.repeats, torch)
            e, _ = _timed(lambda: enc_all(bp), args.repeats, torch)
            sweep[bp] = dict(decode_GBps=total_raw / d / 1e9, encode_GBps=total_raw / e / 1e9)
            if gluon and bp in (32, 64, 128, 256):
                g, _ = _timed(lambda: dec_all(bp, "gluon"), args.repeats, torch)
                sweep[bp]["decode_gluon_GBps"] = total_raw / g / 1e9
        except Exception as ex:
            sweep[bp] = {"error": f"{type(ex).__name__}: {ex}"}
        print("block_pages", bp, sweep[bp], flush=True)
    res["block_pages_sweep"] = sweep
    dec_all()
    sync()
    res["checks"]["round_trip_after_sweep"] = bool(torch.equal(out, big))
    print(json.dumps({k: v for k, v in res.items() if k not in ("encode_times", "decode_times")}, indent=1), flush=True)
    # Peer: nvCOMP ANS on the same bytes (one buffer per group), where the wheel is installed.
    try:
        from nvidia import nvcomp

        codec = nvcomp.Codec(algorithm="ANS")
        flat8 = big.reshape(-1).view(torch.uint8)
        step = 64 << 20
        arrs = [nvcomp.as_array(flat8[i : i + step]) for i in range(0, flat8.numel(), step)]
        comp = [None] * len(arrs)

        def nv_enc():
            for i, a in enumerate(arrs):
                comp[i] = codec.encode(a)

        def nv_dec():
            for c in comp:
                codec.decode(c)

        nv_enc()
        sync()
        dec0 = torch.as_tensor(codec.decode(comp[0]), device=dev).view(torch.uint8)
        ok = bool(torch.equal(dec0.reshape(-1), flat8[:step]))
        te_nv, _ = _timed(nv_enc, args.repeats, torch)
        td_nv, _ = _timed(nv_dec, args.repeats, torch)
        csize = sum(c.buffer_size for c in comp)
        res["nvcomp_ans"] = dict(version=nvcomp.__version__, ratio=csize / total_raw, encode_GBps=total_raw / te_nv / 1e9,
                                 decode_GBps=total_raw / td_nv / 1e9, round_trip_ok=ok)
    except Exception as e:  # report, never hide
        res["nvcomp_ans"] = {"error": f"{type(e).__name__}: {e}"}
    print("nvcomp", res["nvcomp_ans"], flush=True)
    if args.dfloat11:
        try:
            res["dfloat11"] = dfloat11_speed(args, groups, reps, total_raw, torch)
        except Exception as e:  # report, never hide
            res["dfloat11"] = {"error": f"{type(e).__name__}: {e}"}
        print("dfloat11", res["dfloat11"], flush=True)
    if args.exact4:
        res["kv_exact4"] = exact4_speed(args, sets, reps, torch)
    (outdir / "gpu_codec_speed.json").write_text(json.dumps(res, indent=1))


def exact4_speed(args, sets, reps, torch):
    """KV Exact4 pages (kv_exact4_codec) on the same tiled bytes: the Triton encoder (sizes pass, the
    host's prefix sum and one sync, write pass) and the validating decoder, checked against the
    PyTorch reference and, where the extension has them, the Rust codec both ways; the attention
    kernel's tile loader (``dequantize_exact4_pages``, no checks) timed on the same pages."""
    from weightszip.kernels import kv_exact4_codec as C4
    from weightszip.kernels import kv_exact4_ref as R4
    from weightszip.kernels.paged_decode import dequantize_exact4_pages

    dev = args.device
    c = sets[0][3].shape[1]
    h, d = c // 128, 128
    vu = torch.from_numpy(np.concatenate([x for *_, x in sets]).view(np.int16).reshape(-1, 16, h, d)).to(dev)
    res = {"checks": {}}
    gb, go = C4.encode_pages(vu)
    rb, ro = R4.encode_pages(vu).to_bytes()
    res["checks"]["triton_encode_equals_reference"] = bool(torch.equal(gb, rb) and torch.equal(go, ro))
    res["checks"]["triton_decodes"] = bool(torch.equal(C4.decode_pages(rb, ro, h, d), vu))
    try:
        from weightszip import kv_exact

        hb, ho = kv_exact.cpu_encode_exact4_pages(vu.cpu().numpy().view(np.uint16))
        res["checks"]["triton_encode_equals_rust"] = bool(np.array_equal(gb.cpu().numpy(), np.frombuffer(hb, np.uint8))
                                                          and np.array_equal(go.cpu().numpy(), ho))
        back = kv_exact.cpu_decode_exact4_pages(gb.cpu().numpy(), go.cpu().numpy(), h, d)
        res["checks"]["rust_decodes_triton_pages"] = bool(np.array_equal(back, vu.cpu().numpy().view(np.uint16)))
    except (ImportError, AttributeError) as e:
        res["checks"]["rust"] = f"not in this build: {e}"
    res["ratio_all_tokens"] = gb.numel() / (2 * vu.numel())
    print("exact4 checks", res["checks"], "ratio", res["ratio_all_tokens"], flush=True)
    big = vu.repeat(reps, 1, 1, 1)
    total_raw = big.numel() * 2
    enc = {}

    def enc_all():
        enc["b"], enc["o"] = C4.encode_pages(big)

    enc_all()
    ent, lengths = C4.page_entries(big)
    starts = enc["o"][:-1].contiguous()

    def write_only():
        C4.write_pages(big, ent, starts, enc["b"])

    out = {}

    def dec_all():
        out["x"] = C4.decode_pages(enc["b"], enc["o"], h, d)

    def dec_into():
        C4.decode_pages(enc["b"], enc["o"], h, d, out=out["x"])

    def tiles():
        out["t"] = dequantize_exact4_pages(enc["b"], starts, h, d)

    dec_all()
    tiles()
    res["checks"]["tiled_round_trip"] = bool(torch.equal(out["x"], big))
    res["checks"]["tile_loader_round_trip"] = bool(torch.equal(out["t"], big))
    del out["t"]
    res["raw_bytes"] = total_raw
    res["ratio_tiled"] = enc["b"].numel() / total_raw
    for name, fn in (("encode", enc_all), ("encode_sizes_pass", lambda: C4.page_entries(big)),
                     ("encode_write_pass", write_only), ("decode_validating", dec_all), ("decode_validating_out", dec_into),
                     ("decode_tile_loader", tiles)):
        t, times = _timed(fn, args.repeats, torch)
        res[name + "_GBps"] = total_raw / t / 1e9
        res[name + "_times"] = times
        print("exact4", name, f"{total_raw / t / 1e9:.0f} GB/s", flush=True)
    dec_all()
    res["checks"]["round_trip_after_timing"] = bool(torch.equal(out["x"], big))
    return res


def dfloat11_speed(args, groups, reps, total_raw, torch):
    """DFloat11's GPU decoder (its decode.ptx through CuPy) on the same bytes: each (model, layer,
    K/V) set tiled ``reps`` times is one DFloat11 tensor with its own code (as DFloat11 codes one
    weight block), all sets decoded back to back; bit-exactness checked per set."""
    from concurrent.futures import ThreadPoolExecutor

    import cupy as cp

    import dfloat11_peer as dp

    utils = dp.load_utils(args.dfloat11)
    kern = cp.RawModule(path=str(Path(args.dfloat11) / "dfloat11" / "decode.ptx")).get_function("decode")
    first = groups[0][2].reshape(-1)[:50_000]
    e0, _ = dp.exponents(first)
    check = dp.check_against_reference(utils, e0, dp.build_codec(utils, e0)[0])

    def prep(g):
        x = np.tile(g[2].reshape(-1), reps)
        e, sm = dp.exponents(x)
        codec, luts = dp.build_codec(utils, e)
        enc, gaps, pos = dp.encode(e, codec)
        return x, sm, luts, enc, gaps, pos

    with ThreadPoolExecutor(8) as ex:
        prepared = list(ex.map(prep, groups))
    dev = torch.device("cuda")
    blobs, stored = [], 0
    for x, sm, luts, enc, gaps, pos in prepared:
        t = lambda a: torch.from_numpy(np.ascontiguousarray(a)).to(dev)  # noqa: E731
        shm = dp.shared_mem_bytes(pos)
        blobs.append(dict(luts=t(luts), enc=t(enc), sm=t(sm), pos=t(pos.view(np.uint8)), gaps=t(gaps), shm=shm,
                          out=torch.empty(x.size, dtype=torch.bfloat16, device=dev), src=t(x.view(np.int16))))
        stored += dp.compressed_bytes(enc, sm.size, pos, gaps) + luts.size
    del prepared
    kern.max_dynamic_shared_size_bytes = max(b["shm"] for b in blobs)

    def dec_all():
        for b in blobs:
            n_bytes, n = b["enc"].numel(), b["out"].numel()
            grid = -(-n_bytes // (dp.THREADS_PER_BLOCK * dp.BYTES_PER_THREAD))
            kern((grid,), (dp.THREADS_PER_BLOCK,), (b["luts"].data_ptr(), b["enc"].data_ptr(), b["sm"].data_ptr(),
                 b["pos"].data_ptr(), b["gaps"].data_ptr(), b["out"].data_ptr(), b["luts"].shape[0], n_bytes, n),
                 shared_mem=b["shm"])

    dec_all()
    torch.cuda.synchronize()
    exact = all(torch.equal(b["out"].view(torch.int16), b["src"]) for b in blobs)
    raw = sum(b["out"].numel() * 2 for b in blobs)
    td, times = _timed(dec_all, args.repeats, torch)
    return dict(version="dfloat11 0.5.0 (decode.ptx via CuPy %s)" % cp.__version__, raw_bytes=raw, same_bytes_as_ours=raw == total_raw,
                ratio=stored / raw, decode_GBps=raw / td / 1e9, decode_times=times, bit_exact=exact,
                encoder="numpy re-implementation of DFloat11's format (CPU)", encoder_check=check)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--kv", action="append", required=True, help=".npy from capture_kv.py or .npz subset (model:kind:layer keys)")
    ap.add_argument("--ratio", action="store_true")
    ap.add_argument("--speed", action="store_true")
    ap.add_argument("--layers", type=int, default=None, help="ratio: this many layers per model, evenly spaced (default all)")
    ap.add_argument("--max-len", type=int, default=8)
    ap.add_argument("--page-version", type=int, default=1, choices=(1, 2), help="speed: the page profile's version")
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--block-pages", type=lambda v: [int(x) for x in v.split(",")], default=[32, 64, 256])
    ap.add_argument("--out", default=str(RESULTS / "box"))
    ap.add_argument("--channels", type=int, default=LLAMA_C, help="speed: tile channels to this (Llama-3.1-8B: 1024)")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a smoke run under TRITON_INTERPRET=1")
    ap.add_argument("--dfloat11", default=None, help="speed: also time DFloat11's GPU decoder; a folder with the dfloat11 "
                    "and dahuffman wheels unpacked (needs CuPy)")
    ap.add_argument("--exact4", action="store_true", help="speed: also KV Exact4 pages (kv_exact4_codec) on the same bytes")
    args = ap.parse_args()
    if args.ratio:
        ratio_main(args)
    if args.speed:
        speed_main(args)


if __name__ == "__main__":
    main()
