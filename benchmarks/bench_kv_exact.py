"""KV Exact on the GPU (issue 7, item 2): page size on real KV, decode attention that decodes the
pages in its inner loop against our bf16 paged kernel and torch SDPA flash, the write path, and
sessions per 80 GB H100.

    python benchmarks/bench_kv_exact.py --kv .boxdata/kv_pages_subset.npz [--tune] [--format exact4] --out PREFIX

``--format exact4`` measures KV Exact4 pages (4-bit exponent codes, plain bf16 heads for values
outside the window; kv_exact4_ref) instead of KV Exact version 1, through the same kernel (the
write path: the cache's reference encoder, the only one KV Exact4 has).

Data: real bf16 KV (the 16 (model, layer, K/V) sets of the .npz: SmolLM2-135M and Qwen2.5-0.5B,
4096 tokens each), tiled along channels to the Llama-3.1-8B shape (8 KV heads x 128).
- Ratio: per set, window tops calibrated on tokens 0-2047 and pages of tokens 2048-4095 coded
  (held out); every byte of a page counted, plus the 8-byte page offset.
- Attention: one layer, K pages from ``--k-set`` and V pages from ``--v-set`` (their 256 distinct
  pages, each stored again at its own place in the pool, so every block is its own memory), the
  window tops calibrated on the first half. Pools for the largest batch x context, block tables
  a random permutation of the pool (as a long-running server's). Each grid point first checks that
  the KV Exact output equals the bf16 kernel's with the same config bit for bit. Times: CUDA
  graph replay under do_bench (bench_decode_attention.bench), median, L2 flushed.
- Write path: ``KVExactCache`` storing the pages one decode step completes (one page per sequence,
  64 sequences) and an 8k-token prefill, per layer (code, allocate, write; wall time with a sync).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import pathlib
import sys
import time

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from bench_decode_attention import bench, config_changes, read_bandwidth, time_sdpa  # noqa: E402
from bench_gpu_codec import load_sets, tile_channels  # noqa: E402

HQ, HKV, D = 32, 8, 128
C = HKV * D


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv", action="append", required=True)
    p.add_argument("--k-set", default="qwen2.5:K:8")
    p.add_argument("--v-set", default="qwen2.5:V:8")
    p.add_argument("--batches", default="8,16,32,64")
    p.add_argument("--contexts", default="32768,65536,131072")
    p.add_argument("--tune", action="store_true", help="sweep the exact kernel's launch parameters first")
    p.add_argument("--sweep", default="32:4:1,32:4:2,64:4:1,64:4:2,64:8:2,128:4:2,128:8:2,64:4:3",
                   help="block_n:warps:stages[:waves[:min_split_tokens]],... for --tune")
    p.add_argument("--format", choices=["exact", "exact4"], default="exact", help="the page format measured")
    p.add_argument("--gluon", default="",
                   help="exact4: also the Gluon kernel (kv_exact4_gluon) at these WARPS:STAGES[:MAXNREG] configs "
                        "(comma-separated; '+field=value' after one changes another KernelConfig field, as "
                        "8:2:0+gluon_x4_v_swizzle=0), each beside the same kernel over the bf16 pages")
    p.add_argument("--no-sdpa", action="store_true")
    p.add_argument("--write-only", action="store_true", help="skip the attention grid: ratios, write path, capacity")
    p.add_argument("--rep", type=int, default=100)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kv_exact"))
    return p.parse_args(argv)


def llama_pages(x: np.ndarray) -> torch.Tensor:
    """[T, C0] uint16 -> int16 pages [T / 16, 16, 8, 128] (channels tiled to 1024)."""
    t = tile_channels(x, C).astype(np.int16)
    return torch.from_numpy(t).reshape(-1, 16, HKV, D)


def page_format(name: str):
    """A format's (calibrate(samples [T, C]) -> window tops [HKV, D] or None, encode(pages, tops),
    dequantize(heap, offsets, tops) through the kernel's tile loader). KV Exact4 pages hold their
    own window tops: no calibration, and the tops (None) are not passed on."""
    from weightszip.kernels import kv_exact4_ref, kv_exact_ref
    from weightszip.kernels.paged_decode import dequantize_exact4_pages, dequantize_exact_pages

    if name == "exact4":
        return (lambda samples: None, lambda pages, tops: kv_exact4_ref.encode_pages(pages),
                lambda heap, offs, tops: dequantize_exact4_pages(heap, offs, HKV, D))
    return (lambda samples: kv_exact_ref.calibrate_bases(samples).reshape(HKV, D),
            lambda pages, tops: kv_exact_ref.encode_pages(pages, tops.to(pages.device)),
            lambda heap, offs, tops: dequantize_exact_pages(heap, offs, tops, HKV, D))


def ratio_table(sets, fmt="exact"):
    calibrate, encode, _ = page_format(fmt)
    rows = []
    for (model, kind, layer), x in sets.items():
        p = llama_pages(x)
        half = p.shape[0] // 2
        enc = encode(p[half:], calibrate(p[:half].reshape(-1, C)))
        page_bytes = int(enc.lengths.sum())
        raw = p[half:].numel() * 2
        row = dict(model=model, kind=kind, layer=layer, pages=int(p.shape[0] - half), ratio=page_bytes / raw,
                   ratio_with_offsets=(page_bytes + 8 * len(enc)) / raw)
        if fmt == "exact4":
            row["plain_rows"] = float(enc.plain.float().mean())
        else:
            row["escapes"] = float(enc.counts.sum()) / p[half:].numel()
        rows.append(row)
    return rows


def build_pool(pages: torch.Tensor, bases, n_blocks: int, fmt="exact"):
    """bf16 pool [n, 8, 16, 128] and a KV Exact (or Exact4) heap + offsets [n] holding ``pages``
    (int16 [U, 16, 8, 128]) again and again, block i = page i % U, each copy at its own address."""
    _, encode, _ = page_format(fmt)
    U = pages.shape[0]
    reps = -(-n_blocks // U)
    pg = pages.cuda()
    bf = pg.transpose(1, 2).contiguous().view(torch.bfloat16).repeat(reps, 1, 1, 1)[:n_blocks].contiguous()
    buf, offs = encode(pg, bases).to_bytes()
    heap = buf.repeat(reps)
    offsets = (offs[:-1][None, :] + torch.arange(reps, device="cuda")[:, None] * buf.numel()).reshape(-1)[:n_blocks].contiguous()
    return bf, heap, offsets, int(buf.numel()) / (U * 16 * C * 2)


def sweep_config(spec: str, waves: int, min_split: int):
    """``block_n:warps:stages[:waves[:min_split_tokens]]`` -> KernelConfig (the format's defaults for
    the fields left out)."""
    from weightszip.kernels import KernelConfig

    v = [int(x) for x in spec.split(":")]
    v += [waves, min_split][len(v) - 3:]
    return KernelConfig(block_n=v[0], num_warps=v[1], num_stages=v[2], waves=v[3], min_split_tokens=v[4])


def main(argv=None):
    args = parse_args(argv)
    from tqdm import tqdm

    from weightszip.kernels import DEFAULT_CONFIGS, PagedDecodeAttention
    from weightszip.kernels.paged_decode import PAGE_BF16, PAGE_TYPES

    fmt = args.format
    calibrate, _, dequantize = page_format(fmt)

    sets = {}
    for model, kind, layer, x in load_sets(args.kv):
        sets[(model, kind, layer)] = x
    res = {"meta": {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "command": " ".join(sys.argv), "torch": torch.__version__}}
    import triton

    res["meta"]["triton"] = triton.__version__
    res["meta"]["format"] = fmt
    res["ratio"] = ratio_table(sets, fmt)
    r = np.array([row["ratio_with_offsets"] for row in res["ratio"]])
    print(f"held-out ratio (with offsets): mean {r.mean():.4f} min {r.min():.4f} max {r.max():.4f}", flush=True)
    if not torch.cuda.is_available():
        write(res, args.out)
        return
    res["meta"]["gpu"] = torch.cuda.get_device_name()
    res["meta"]["read_bw"] = read_bandwidth(args.rep)

    def key(s):
        m, k, l_ = s.split(":")
        return (m, k, int(l_))

    kp, vp = llama_pages(sets[key(args.k_set)]), llama_pages(sets[key(args.v_set)])
    half = kp.shape[0] // 2
    kb, vb = calibrate(kp[:half].reshape(-1, C)), calibrate(vp[:half].reshape(-1, C))
    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    n_blocks = max(batches) * max(contexts) // 16
    t0 = time.time()
    k_bf, k_heap, k_off, k_ratio = build_pool(kp, kb, n_blocks, fmt)
    v_bf, v_heap, v_off, v_ratio = build_pool(vp, vb, n_blocks, fmt)
    kbd, vbd = (None, None) if kb is None else (kb.cuda().contiguous(), vb.cuda().contiguous())
    torch.cuda.synchronize()
    res["pool"] = dict(blocks=n_blocks, k_ratio=k_ratio, v_ratio=v_ratio, build_s=time.time() - t0,
                       k_set=args.k_set, v_set=args.v_set)
    print(f"pool: {n_blocks} blocks, page ratio K {k_ratio:.4f} V {v_ratio:.4f}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(0)
    perm = torch.randperm(n_blocks, device="cuda", generator=gen).to(torch.int32)

    def setup(B, L, cfg, page_type):
        bt = perm[: B * L // 16].view(B, L // 16)
        q = torch.randn(B, HQ, D, dtype=torch.bfloat16, device="cuda", generator=gen)
        side = torch.randn(2, B, 16, HKV, D, dtype=torch.bfloat16, device="cuda", generator=gen)
        att = PagedDecodeAttention(HQ, HKV, D, page_type=page_type, window=16, config=cfg, device="cuda")
        att.plan([L] * B, bt)
        out = torch.empty(B, HQ, D, dtype=torch.bfloat16, device="cuda")
        if page_type == fmt:
            fn = lambda: att.run(q, k_heap, v_heap, k_side=side[0], v_side=side[1], k_offsets=k_off,  # noqa: E731
                                 v_offsets=v_off, k_bases=kbd, v_bases=vbd, out=out)
        else:
            fn = lambda: att.run(q, k_bf, v_bf, k_side=side[0], v_side=side[1], out=out)  # noqa: E731
        fn.att = att
        return fn, out, q, side

    def time_kernel(B, L, cfg, page_type, kernel=None):
        """Seconds per call; with ``kernel`` (a dict), ``kernel["name"]`` = the split kernel the
        timed calls ran (a Gluon config the kernel cannot take runs the Triton one)."""
        fn, *_ = setup(B, L, cfg, page_type)
        t = bench(fn, args.rep)
        if kernel is not None:
            kernel["name"] = fn.att.last_split_kernel
        return t

    def identical(B, L, cfg):
        """KV Exact output == the bf16 kernel's with the same config, plan, q and side tokens."""
        fn, out, q, side = setup(B, L, cfg, fmt)
        fn()
        att_b = PagedDecodeAttention(HQ, HKV, D, page_type="bf16", window=16, config=cfg, device="cuda")
        att_b.plan([L] * B, perm[: B * L // 16].view(B, L // 16))
        return bool(torch.equal(att_b.run(q, k_bf, v_bf, k_side=side[0], v_side=side[1]), out))

    # the kernel's tile loader reads the pool's pages back bit for bit
    n_chk = min(n_blocks, 4096)
    got = dequantize(k_heap, k_off[:n_chk].contiguous(), kbd)
    res["loader_bit_exact"] = bool(torch.equal(got.view(torch.bfloat16).transpose(1, 2), k_bf[:n_chk]))
    print(f"tile loader bit-exact on {n_chk} pages: {res['loader_bit_exact']}", flush=True)

    exact_cfg = DEFAULT_CONFIGS[PAGE_TYPES[fmt]]
    waves, min_split = exact_cfg.waves, exact_cfg.min_split_tokens
    if args.tune and not args.write_only:
        points = [(8, max(contexts)), (max(batches), min(contexts))]
        sweep = []
        for spec in tqdm(args.sweep.split(","), desc="tune"):
            cfg = sweep_config(spec, waves, min_split)
            try:
                ts = [time_kernel(B, L, cfg, fmt) for B, L in points]
                same = identical(8, min(contexts), cfg)
            except Exception as e:  # noqa: BLE001 - a config that does not compile is skipped, said so
                print(f"config {spec}: {type(e).__name__}: {e}", file=sys.stderr)
                continue
            sweep.append(dict(config=spec, times=ts, geomean=math.exp(np.mean(np.log(ts))), bit_identical=same))
            print(json.dumps(sweep[-1]), flush=True)
        res["tune"] = sweep
        best = min(sweep, key=lambda r: r["geomean"])["config"]
        exact_cfg = sweep_config(best, waves, min_split)
        print(f"best exact config {best}", flush=True)
    res["meta"]["exact_config"] = vars(exact_cfg) if hasattr(exact_cfg, "__dict__") else str(exact_cfg)

    # the Gluon kernel (exact4 only): its configs, each also run over the bf16 pages (its reference)
    gluon_cfgs = {}
    for spec in [s for s in args.gluon.split(",") if s] if fmt == "exact4" else []:
        launch, *more = spec.split("+")
        w, st, *reg = (int(v) for v in launch.split(":"))
        gluon_cfgs[spec] = dataclasses.replace(exact_cfg, gluon=True, gluon_warps=w, gluon_stages=st,
                                               gluon_maxnreg=reg[0] if reg else 0, gluon_min_work=0,
                                               **config_changes(",".join(more)))
    res["meta"]["gluon_configs"] = list(gluon_cfgs)

    rows = []
    bytes_tok = (k_ratio + v_ratio) / 2 * 2 * C * 2 + 2 * 8 / 16
    for B in [] if args.write_only else batches:
        for L in contexts:
            row = dict(batch=B, context=L)
            row["bit_identical"] = identical(B, L, exact_cfg)
            row["exact_ms"] = time_kernel(B, L, exact_cfg, fmt) * 1e3
            row["bf16_ms"] = time_kernel(B, L, DEFAULT_CONFIGS[PAGE_BF16], "bf16") * 1e3
            row["bf16_same_config_ms"] = time_kernel(B, L, exact_cfg, "bf16") * 1e3
            if not args.no_sdpa:
                t, how, _ = time_sdpa(B, L, HQ, HKV, D, args.rep, gen)
                if t is None:  # out of memory beside the paged caches: the bar is the bf16 kernels alone
                    row["sdpa_skipped"] = how
                else:
                    row["sdpa_ms"], row["sdpa_how"] = t * 1e3, how
            best = min(row["bf16_ms"], row.get("sdpa_ms", math.inf))
            row["exact_vs_best_bf16"] = best / row["exact_ms"]  # > 1: exact faster
            row["exact_GBps"] = B * L * bytes_tok / (row["exact_ms"] * 1e-3) / 1e9
            for spec, gcfg in gluon_cfgs.items():
                ran = {}
                g = dict(bit_identical=identical(B, L, gcfg), ms=time_kernel(B, L, gcfg, fmt, ran) * 1e3,
                         bf16_ms=time_kernel(B, L, gcfg, "bf16") * 1e3)
                g["kernel"] = ran["name"]
                g["vs_best_bf16"] = best / g["ms"]
                g["GBps"] = B * L * bytes_tok / (g["ms"] * 1e-3) / 1e9
                row[f"gluon_{spec}"] = g
            if gluon_cfgs:
                top = min(gluon_cfgs, key=lambda sp: row[f"gluon_{sp}"]["ms"])
                row["gluon_best"] = top
                # the bar: the fastest bf16 kernel measured, the Gluon kernel's bf16 mode included
                fastest_bf16 = min([best] + [row[f"gluon_{sp}"]["bf16_ms"] for sp in gluon_cfgs])
                row["gluon_vs_fastest_bf16"] = fastest_bf16 / row[f"gluon_{top}"]["ms"]
            rows.append(row)
            print(json.dumps(row), flush=True)
            torch.cuda.empty_cache()
    res["grid"] = rows

    # write path: KVExactCache stores pages (code + allocate + write), per layer: the Triton write
    # kernels and the reference encoder (torch ops), the same pages, in the same run
    res["write_path"] = {name: write_path(kp, vp, kb, vb, kernels, page_format=fmt) for name, kernels in
                         (("kernels", True), ("reference", False))}
    print(json.dumps(res["write_path"]), flush=True)

    # capacity: sessions of Llama-3.1-8B at 128k on an 80 GB H100
    from fractions import Fraction

    from weightszip.eval import capacity

    bits = Fraction((k_ratio + v_ratio) / 2 * 16 + 2 * 8 * 8 / (16 * 2 * C)).limit_denominator(100000)
    name = "kv-" + fmt
    capacity.register_format(name, bits, f"{fmt} pages (lossless), measured bytes incl. page offsets")
    rep = capacity.compute("llama-3.1-8b", "h100-80gb", context=131072, formats=["bf16", "fp8", name])
    res["capacity"] = {r.name: dict(bits=float(r.bits_per_value), sessions=r.sessions_per_replica) for r in rep.formats}
    print(json.dumps(res["capacity"]), flush=True)
    write(res, args.out)


def write_path(kp, vp, kb, vb, write_kernels: bool, rounds: int = 4, page_format: str = "exact") -> dict:
    """Wall time (with a sync) of 8192-token prefills of one sequence and of decode steps of 64
    sequences, one layer; a warm-up first (prefill and a page-completing decode step: kernel
    compilation and torch's lazy CUDA module loads are not timed). Median of ``rounds`` prefills
    (fresh sequences) and of ``rounds`` page-completing steps (every 16th step: 63 of the 64
    sequences complete a page), and of the steps between them."""
    from weightszip.kv_exact import KVExactCache

    wp = {}
    n_pre = rounds + 1
    cache = KVExactCache(layers=1, kv_heads=HKV, head_dim=D, num_q_heads=HQ, heap_bytes=8 << 30,
                         max_seqs=64 + n_pre, max_tokens=8192 + 16 * (rounds + 2),
                         bases=None if kb is None else torch.stack([kb, vb])[None], device="cuda",
                         write_kernels=write_kernels, page_format=page_format)
    pk = kp.cuda().view(torch.bfloat16)
    pv = vp.cuda().view(torch.bfloat16)
    tok_k = pk.reshape(-1, HKV, D)
    tok_v = pv.reshape(-1, HKV, D)
    pre_k = tok_k[None, :4096].repeat(1, 2, 1, 1)
    pre_v = tok_v[None, :4096].repeat(1, 2, 1, 1)
    prefill = []
    for _ in range(n_pre):  # the first is the warm-up
        s = cache.add_sequence()
        torch.cuda.synchronize()
        t = time.time()
        cache.append(0, [s], pre_k, pre_v)
        torch.cuda.synchronize()
        prefill.append(time.time() - t)
    wp["prefill_8192_tokens_s"] = float(np.median(prefill[1:]))
    wp["prefill_8192_tokens_first_s"] = prefill[0]
    seqs = [cache.add_sequence() for _ in range(64)]
    for i, s in enumerate(seqs):  # 15 tokens: the next step completes a page (but in seqs[0])
        cache.append(0, [s], tok_k[None, 16 * i:16 * i + (16 if i == 0 else 15)],
                     tok_v[None, 16 * i:16 * i + (16 if i == 0 else 15)])
    k1 = tok_k[None, :1].repeat(64, 1, 1, 1)
    v1 = tok_v[None, 1:2].repeat(64, 1, 1, 1)
    full, none = [], []
    for step in range(16 * (rounds + 1)):  # round 0 is the warm-up
        torch.cuda.synchronize()
        t = time.time()
        cache.append(0, seqs, k1, v1)
        torch.cuda.synchronize()
        dt = time.time() - t
        if step >= 16:
            (full if step % 16 == 0 else none).append(dt)
    wp["decode_step_64_seqs_63_pages_complete_s"] = float(np.median(full))
    wp["decode_step_64_seqs_63_pages_complete_all_s"] = full
    wp["decode_step_64_seqs_no_page_s"] = float(np.median([x for i, x in enumerate(none) if i % 15 != 14]))
    wp["stats"] = {k: v for k, v in cache.stats().items() if k != "heap"}
    return wp


def write(res, prefix):
    prefix = pathlib.Path(prefix)
    prefix.parent.mkdir(parents=True, exist_ok=True)
    prefix.with_suffix(".json").write_text(json.dumps(res, indent=1))
    what = "plain_rows" if res["meta"].get("format") == "exact4" else "escapes"
    lines = [f"| model | K/V | layer | {what.replace('_', ' ')} | ratio | +offsets |", "|---|---|---:|---:|---:|---:|"]
    for r in res["ratio"]:
        lines.append(f"| {r['model']} | {r['kind']} | {r['layer']} | {r[what]:.4f} | {r['ratio']:.4f} | {r['ratio_with_offsets']:.4f} |")
    if res.get("grid"):
        lines += ["", "| batch | context | exact ms | bf16 ms | bf16 same cfg ms | sdpa ms | exact vs best | exact GB/s | bit-identical |",
                  "|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
        for r in res["grid"]:
            sdpa = f"{r['sdpa_ms']:.3f}" if "sdpa_ms" in r else "-"  # absent: not timed (out of memory, --no-sdpa)
            lines.append(f"| {r['batch']} | {r['context']} | {r['exact_ms']:.3f} | {r['bf16_ms']:.3f} | "
                         f"{r['bf16_same_config_ms']:.3f} | {sdpa} | "
                         f"{r['exact_vs_best_bf16']:.2f}x | {r['exact_GBps']:.0f} | {r['bit_identical']} |")
        specs = res["meta"].get("gluon_configs") or []
        if specs:
            lines += ["", "Gluon kernel (`kv_exact4_gluon`), each config over the exact4 pages and over the bf16 pages:", "",
                      "| batch | context | " + " | ".join(f"{s} ms | {s} bf16 ms | {s} bit-identical" for s in specs)
                      + " | best vs fastest bf16 |", "|---:|---:|" + "---:|---:|---|" * len(specs) + "---:|"]
            for r in res["grid"]:
                cells = " | ".join(f"{r['gluon_' + s]['ms']:.3f} | {r['gluon_' + s]['bf16_ms']:.3f} | "
                                   f"{r['gluon_' + s]['bit_identical']}" for s in specs)
                lines.append(f"| {r['batch']} | {r['context']} | {cells} | {r['gluon_vs_fastest_bf16']:.2f}x |")
        plot(res, prefix.with_suffix(".png"))
    prefix.with_suffix(".md").write_text("\n".join(lines) + "\n")


def plot(res, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    grid = res["grid"]
    batches = sorted({r["batch"] for r in grid})
    fig, axes = plt.subplots(1, len(batches), figsize=(4 * len(batches), 3.5), squeeze=False)
    for ax, B in zip(axes[0], batches):
        rows = [r for r in grid if r["batch"] == B]
        ctx = [r["context"] // 1024 for r in rows]
        exact = "KV Exact4" if res["meta"].get("format") == "exact4" else "KV Exact"
        for k, lab in (("exact_ms", exact), ("bf16_ms", "bf16 paged"), ("sdpa_ms", "SDPA flash")):
            if any(k in r for r in rows):  # SDPA is missing where it ran out of memory
                ax.plot(ctx, [r.get(k, math.nan) for r in rows], marker="o", label=lab)
        if all("gluon_best" in r for r in rows):
            ax.plot(ctx, [r["gluon_" + r["gluon_best"]]["ms"] for r in rows], marker="s", label=exact + " (Gluon)")
            ax.plot(ctx, [r["gluon_" + r["gluon_best"]]["bf16_ms"] for r in rows], marker="x", ls=":",
                    label="bf16 (Gluon, same kernel)")
        ax.set_title(f"batch {B}")
        ax.set_xlabel("context (k tokens)")
        ax.set_ylabel("ms per layer")
        ax.legend()
    fig.suptitle(f"Decode attention, Llama-3.1-8B layer, {res['meta']['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
