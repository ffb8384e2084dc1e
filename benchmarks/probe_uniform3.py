#!/usr/bin/env python3
"""A timing probe for a 3-bit page format that has not been built: what would the Gluon compact
decode kernel gain if its 3-bit operands needed no codebook lookup?

Today a width-3 operand pair (two codes) is a byte of pair code made from the crumb and bit-2 words,
one byte permute to its shared-memory address and one shared load from the 256-entry pair table
(``paged_decode_gluon._k_operand`` / ``_v_operand``): 64 table loads a page and warp, on the
shared-memory pipe that Nsight Compute shows the kernel bound by (BENCHMARKS.md, session 30).

The format this probes (not in docs/FORMAT.md; nothing here writes or reads it): a **uniform**
3-bit codebook, ``level(c) = beta (c - 3.5)``, and codes placed in each 16-bit half of a word at bits
0-2, 3-5, 6-8, 9-11, 12-14 (K: the two halves hold the two channels of an operand pair; V: a byte
permute puts row a's half beside row b's). ``(w & 0x00070007) | 0x43004300`` is then two bf16 values
128 + c (bf16 128 has exponent 7, so mantissa bits 0-6 count units), and ``(w & 0x00380038) | ...``
128 + 8 c; the kernel would scale q' by 1/8 in the second kind of slot and take 128 sum(q') and the
levels' offset off as per-head constants (or subtract 128 with one exact ``fma.rn.bf16x2`` a pair).
Four pairs cost about seven integer operations and no shared-memory load.

The probe compiles a second ``compact_split_kernel`` whose ``_k_operand`` / ``_v_operand`` do that
arithmetic on the words the kernel already loads (the same bytes, loads, copies and launch), and
times it against the tree on the same inputs. It times decode work, not a correct decoder: its
output is not attention over anything and is only checked to be finite. Variants (``--variants``):

- ``u0``: width-3 operands as above, without the subtraction; ``u1``: with it;
- ``s0``: ``u0`` plus the pair the planned layout keeps in spare bits (a lane's 32 codes of a row
  are three words, whose six 5-code halves leave 2 codes in their top bits): its whole decode;
- ``w0``: ``u0`` at widths 3 and 4 (nibbles to bits 0-3 and 3-6 of each half);
- ``r0``: width 3 by byte permutes from an 8-entry bf16 codebook in registers (any codebook, so no
  loss in quality): three ``prmt`` a pair and no shared-memory load.

``--mse`` measures what a uniform codebook costs on real KV, held out: about 11% more squared error
than the calibrated (Lloyd) one at 3 bits, 19% at 4 (BENCHMARKS.md, session 36).

    python benchmarks/probe_uniform3.py --sass                 # offline: loop instructions by pipe
    python benchmarks/probe_uniform3.py --formats q3,q3.5 --rounds 3 --out probe.json   # GPU
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import types
from pathlib import Path

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))
import weightszip.kernels.paged_decode_gluon as pg  # noqa: E402
from weightszip.kernels.paged_decode_gluon import _axis, _k_halves, _rotr  # noqa: E402,F401

_ORIG_K = pg._k_operand
_ORIG_V = pg._v_operand

# bf16x2 (128 + c) -> c: one HFMA2 by (1, -128), exact (c < 128)
_SUB128 = gl.constexpr("{ .reg .b32 one, c; mov.b32 one, 0x3F803F80; mov.b32 c, 0xC300C300;"
                       " fma.rn.bf16x2 $0, $1, one, c; }")
# ($1 & $2) | $3 as one LOP3 (ptxas splits an and and an or of two immediates into two)
_LOP3_AND_OR = gl.constexpr("lop3.b32 $0, $1, $2, $3, 0xEA;")
# bytes of $1's and $2's 16-bit halves side by side (selector $3: 0x5410 low halves, 0x7632 high)
_PRMT = gl.constexpr("prmt.b32 $0, $1, $2, $3;")


@gluon.jit
def _magic_pairs(x, i, BITS: gl.constexpr, SUB: gl.constexpr):
    """Pair ``i`` (0-3) of word ``x`` as two bf16 in one int32, the codes of each 16-bit half or'ed into
    bf16 128's mantissa: width 3, bits 3 (i & 1) .. of x >> 6 (i >> 1) (128 + c or 128 + 8 c); width 4,
    nibble i of each half, shifted to bits 0-3 or 3-6 (128 + c or 128 + 8 c). ``SUB``: less 128."""
    if BITS == 3:
        src = x >> (6 * (i >> 1))
        mask = 0x00070007 << (3 * (i & 1))
    else:
        src = x >> (8 * (i >> 1) + (i & 1))
        mask = 0x000F000F + (i & 1) * (0x00780078 - 0x000F000F)
    val = gl.inline_asm_elementwise(_LOP3_AND_OR, "=r,r,r,r", [src, mask, gl.full_like(x, 0x43004300) + 0 * i],
                                    dtype=gl.int32, is_pure=True, pack=1)
    if SUB:
        val = gl.inline_asm_elementwise(_SUB128, "=r,r", [val], dtype=gl.int32, is_pure=True, pack=1)
    return val


@gluon.jit
def _register_pairs(x, i, TABLES: gl.constexpr):
    """Pair ``i`` (0-3) of 8 codes in nibbles 0-2, 4-6 of the halves of ``x`` by byte permutes from
    an 8-entry bf16 codebook held in four registers (its low bytes in two, its high bytes in two):
    the 4 codes of half i >> 1 select 4 low and 4 high bytes (two ``prmt``), which a third ``prmt``
    interleaves into pair i & 1 of them. Any codebook, so no loss against the calibrated one; the
    tables here are constants standing for the codebook's bytes."""
    sel = (x >> (16 * (i >> 1))) & 0x7777
    lo = gl.inline_asm_elementwise(_PRMT, "=r,r,r,r", [gl.full_like(x, TABLES) + 0 * i, gl.full_like(x, TABLES ^ 0x5A5A5A5A) + 0 * i, sel],
                                   dtype=gl.int32, is_pure=True, pack=1)
    hi = gl.inline_asm_elementwise(_PRMT, "=r,r,r,r", [gl.full_like(x, TABLES ^ 0x3C3C3C3C) + 0 * i, gl.full_like(x, TABLES ^ 0x0F0F0F0F) + 0 * i, sel],
                                   dtype=gl.int32, is_pure=True, pack=1)
    return gl.inline_asm_elementwise(_PRMT, "=r,r,r,r", [lo, hi, 0x5140 + 0x2222 * (i & 1)], dtype=gl.int32,
                                     is_pure=True, pack=1)


@gluon.jit
def _spare_pair(val, a, b, c, last):
    """``val`` where ``last`` is false; else the pair whose codes the planned layout keeps in bits 15
    and 31 of a lane's three words (``a``, ``b``, ``c``): a lane's 32 codes of a row are 96 bits, three
    words whose six halves hold 5 codes each, so the last 2 codes (one pair) sit in the 6 spare bits."""
    sp = ((a >> 15) & 0x00010001) | ((b >> 14) & 0x00020002) | ((c >> 13) & 0x00040004) | 0x43004300
    return gl.where(last, sp, val)


@gluon.jit
def _k_probe(w0, w1, w2, w3, BITS: gl.constexpr, TAB: gl.constexpr, HEAD_DIM: gl.constexpr, NW: gl.constexpr,
             LK: gl.constexpr, OPA: gl.constexpr):
    """``_k_operand`` of a variant (``PROBE_SUB``, ``PROBE_WIDTHS``: ``probe_kernel`` binds them)."""
    SUB: gl.constexpr = PROBE_SUB
    WIDTHS: gl.constexpr = PROBE_WIDTHS
    if (BITS == 3 and (WIDTHS & 1) != 0) or (BITS == 4 and (WIDTHS & 2) != 0):
        t = _axis(4, 5, 7, LK)
        if BITS == 3:
            x = _rotr(w0, 4 * (t & 1)) ^ w1  # stands for the planned layout's lane word
        else:
            x = w0 + 0 * t  # nibble rows as they are: lane t's word
        if (WIDTHS & 8) != 0:
            val = _register_pairs(x, _axis(4, 4, 7, LK), 0x3F1E2D4C)
        else:
            val = _magic_pairs(x, _axis(4, 4, 7, LK), BITS, SUB)
        if BITS == 3 and (WIDTHS & 4) != 0:  # the spare-bit pair: the last of each lane row's 16
            last = (_axis(4, 4, 7, LK) == 3) & (_axis(w0.shape[3], 3, 7, LK) == w0.shape[3] - 1)
            val = _spare_pair(val, w0, w1, x, last)
        half = ((val >> (16 * _axis(2, 6, 7, LK))) & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
        return _k_halves(half, NW, HEAD_DIM, OPA)
    else:
        return _ORIG_K(w0, w1, w2, w3, BITS, TAB, HEAD_DIM, NW, LK, OPA)


@gluon.jit
def _v_probe(a0, a1, a2, a3, b0, b1, b2, b3, BITS: gl.constexpr, TAB: gl.constexpr, HEAD_DIM: gl.constexpr,
             NW: gl.constexpr, LV: gl.constexpr, OPA: gl.constexpr):
    """``_v_operand`` of a variant (as ``_k_probe``)."""
    SUB: gl.constexpr = PROBE_SUB
    WIDTHS: gl.constexpr = PROBE_WIDTHS
    if (BITS == 3 and (WIDTHS & 1) != 0) or (BITS == 4 and (WIDTHS & 2) != 0):
        j = _axis(8, 4, 8, LV)
        sel = 0x5410 + 0x2222 * (j & 1)
        x = gl.inline_asm_elementwise(_PRMT, "=r,r,r,r", [a0, b0, sel], dtype=gl.int32, is_pure=True, pack=1)
        if BITS == 3:
            x = x ^ a1  # stands for the planned layout's second word
        i = 2 * _axis(2, 2, 8, LV) + _axis(2, 3, 8, LV)
        if (WIDTHS & 8) != 0:
            val = _register_pairs(x, i, 0x3E1D2C4B)
        else:
            val = _magic_pairs(x, i, BITS, SUB)
        if BITS == 3 and (WIDTHS & 4) != 0:  # the spare-bit pair: the last of each lane's 16 a row pair
            val = _spare_pair(val, a0, b0, x, (i == 3) & (_axis(a0.shape[1], 1, 8, LV) == a0.shape[1] - 1))
        half = ((val >> (16 * _axis(2, 7, 8, LV))) & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
        return gl.convert_layout(gl.reshape(half, [NW, HEAD_DIM, 16]), OPA, assert_trivial=True)
    else:
        return _ORIG_V(a0, a1, a2, a3, b0, b1, b2, b3, BITS, TAB, HEAD_DIM, NW, LV, OPA)


def _rebind(jit_fn, **names):
    """A new Gluon function of ``jit_fn``'s source, its global ``names`` replaced."""
    fn = jit_fn.fn
    new = types.FunctionType(fn.__code__, dict(fn.__globals__, **names), fn.__name__, fn.__defaults__,
                             fn.__closure__)
    new.__annotations__, new.__module__, new.__qualname__ = fn.__annotations__, fn.__module__, fn.__qualname__
    new.__kwdefaults__ = fn.__kwdefaults__
    return gluon.jit(new)


def probe_kernel(sub: bool, widths: int):
    """A second ``compact_split_kernel`` whose ``_k_operand`` / ``_v_operand`` are ``_k_probe`` /
    ``_v_probe`` with ``PROBE_SUB`` = sub and ``PROBE_WIDTHS`` = widths."""
    consts = dict(PROBE_SUB=gl.constexpr(sub), PROBE_WIDTHS=gl.constexpr(widths))
    return _rebind(pg.compact_split_kernel, _k_operand=_rebind(_k_probe, **consts),
                   _v_operand=_rebind(_v_probe, **consts))


# (PROBE_SUB, PROBE_WIDTHS) of each variant. u0 / u1: width-3 operands without / with the subtraction;
# s0: u0 and the spare-bit pair (the planned layout's whole decode); w0: widths 3 and 4; r0: width 3 by
# byte permutes from register tables (any codebook) instead of the uniform codebook's arithmetic.
# PROBE_WIDTHS bits: 1 width 3, 2 width 4, 4 the spare pair, 8 register tables.
VARIANTS = {"tree": None, "u0": (False, 1), "u1": (True, 1), "s0": (False, 5), "w0": (False, 3), "r0": (False, 9)}
PROBE_SUB = gl.constexpr(False)  # (bound per variant by probe_kernel)
PROBE_WIDTHS = gl.constexpr(0)


def kernels(names):
    return {n: pg.compact_split_kernel if VARIANTS[n] is None else probe_kernel(*VARIANTS[n]) for n in names}


def sass(names) -> None:
    """Compile each variant at the 8B q3 / q3.5 launch (staged pages, vote) for sm_90 offline and print
    its main loop's instructions by pipe (``scripts/ptx_fingerprint.py``)."""
    from ptx_fingerprint import compact_launch, loop_mix

    for n, kern in kernels(names).items():
        for kb, vb in ((3, 3), (4, 3), (4, 4)):
            k, spills = pg.compile_for_hopper(kern, *compact_launch(kb, vb))
            print(f"{n:5} k{kb}v{vb} spills={spills} {loop_mix(k.asm['cubin'])}", flush=True)


def time_points(names, formats, points, rounds, rep, out) -> None:
    import bench_decode_attention as BD
    import weightszip.kernels.paged_decode as pd
    from weightszip.kernels import PagedDecodeAttention

    pd.GLUON_MAX_SMEM = 227 * 1024
    kern = kernels(names)
    res = {}
    for shape, B, L in points:
        Hq, Hkv, D = BD.SHAPES[shape]
        fp8_ms = BD.time_paged("fp8", B, L, Hq, Hkv, D, rep, torch.Generator(device="cuda").manual_seed(0), None)[0] * 1e3
        res[f"{shape}:{B}x{L}:fp8"] = {"fp8": dict(median_ms=fp8_ms)}
        print(f"{shape}:{B}x{L}:fp8 {fp8_ms:.4f} ms", flush=True)
        torch.cuda.empty_cache()
        for fmt in formats:
            gen = torch.Generator(device="cuda").manual_seed(0)
            kp, vp, bt, tabs, extra = BD.compact_inputs(fmt, B, L, Hq, Hkv, D, gen)
            q = torch.randn(B, Hq, D, dtype=torch.bfloat16, device="cuda", generator=gen)
            kb, vb = BD.COMPACT[fmt]
            att = PagedDecodeAttention(Hq, Hkv, D, page_type="compact", k_bits=kb, v_bits=vb, device="cuda")
            att.plan([L] * B, bt)

            def call(n):
                pg.compact_split_kernel = kern[n]  # run() launches pg.compact_split_kernel
                try:
                    return att.run(q, kp, vp, **tabs, **extra)
                finally:
                    pg.compact_split_kernel = kern["tree"]

            key = f"{shape}:{B}x{L}:{fmt}"
            row = res[key] = {n: dict(ms=[], finite=bool(torch.isfinite(call(n).float()).all())) for n in names}
            assert att.last_split_kernel == "gluon_compact", att.last_split_kernel
            for r in range(rounds):
                for n in names[r % len(names):] + names[: r % len(names)]:
                    row[n]["ms"].append(BD.bench(lambda n=n: call(n), rep) * 1e3)
            for n in names:
                row[n]["median_ms"] = sorted(row[n]["ms"])[len(row[n]["ms"]) // 2]
                row[n]["speedup"] = row[names[0]]["median_ms"] / row[n]["median_ms"]
                row[n]["vs_fp8"] = fp8_ms / row[n]["median_ms"]
            print(key, "  ".join(f"{n} {row[n]['median_ms']:.4f} ms ({row[n]['speedup']:.3f}x, {row[n]['vs_fp8']:.2f}x fp8"
                                 f"{'' if row[n]['finite'] else ' NONFINITE'})" for n in names), flush=True)
            torch.cuda.empty_cache()
    print("\nsummary: geometric-mean speedup over", names[0])
    for n in names[1:]:
        for fmt in formats:
            sp = [res[k][n]["speedup"] for k in res if k.endswith(":" + fmt)]
            fp8 = [res[k][n]["vs_fp8"] for k in res if k.endswith(":" + fmt)]
            print(f"  {n} {fmt}: {math.exp(sum(map(math.log, sp)) / len(sp)):.3f}x over {len(sp)} points "
                  f"({min(sp):.3f}-{max(sp):.3f}); against fp8 {min(fp8):.2f}-{max(fp8):.2f}x")
    if out:
        Path(out).write_text(json.dumps(dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                                             results=res), indent=1))


def mse(kv: str) -> None:
    """Held-out mean squared error of 3- and 4-bit codes in the rotated domain, relative to the values'
    mean square, with the calibrated (Lloyd) codebook and the best symmetric uniform one, on real KV
    (``make_kv_subset.py``'s npz: [tokens, heads * head_dim] bf16 bits per (model, K/V, layer)).
    Tables from tokens 4-2047 (``calibrate.fit_tables``, channel weights 1), errors on 2048 on."""
    import numpy as np

    from weightszip.compact import calibrate as C
    from weightszip.compact import codec

    z = np.load(kv)
    rng = np.random.default_rng(0)
    ratios = {3: [], 4: []}
    for key in z.files:
        x = torch.from_numpy(z[key].astype(np.int16)).view(torch.bfloat16)
        d = 64 if x.shape[1] % 64 == 0 else x.shape[1]
        x = x.view(x.shape[0], -1, d)
        h = x.shape[1]
        cal, ev = x[4:2048], x[2048:]
        signs = torch.from_numpy(np.where(rng.random(d) < 0.5, -1, 1)).to(torch.int64)
        mu, mult, e0, cbs = C.fit_tables(cal, torch.ones(h, d), key.split(":")[1].lower(), signs, rng)
        tab = [codec.HeadTables(mu[i], mult[i], signs, int(e0[i]), cbs[3], 3) for i in range(h)]
        grids = torch.stack([codec.grid_table(int(e)) for e in e0])
        u = C._normalized(codec.rotate(cal, tab).float(), grids).reshape(-1).numpy()
        y = codec.rotate(ev, tab).float()
        line = f"{key:16}"
        for bits in ratios:
            n = 2**bits
            best = None
            for step in np.linspace(0.2, 2.0, 451) / n:  # levels step * (c - (n - 1) / 2), |level| <= 1
                lev = step * (np.arange(n) - (n - 1) / 2)
                if np.abs(lev).max() > 1:
                    break
                e = float(((u - lev[np.abs(u[:, None] - lev[None]).argmin(1)]) ** 2).mean())
                best = (e, lev) if best is None or e < best[0] else best
            errs = []
            for cb in (cbs[bits], torch.from_numpy(best[1].astype(np.float32))):
                t = [codec.HeadTables(mu[i], mult[i], signs, int(e0[i]), cb, bits) for i in range(h)]
                yh = codec.dequantize(*codec.encode_tokens(ev, t), t)
                errs.append(float(((yh - y) ** 2).mean() / (y**2).mean()))
            ratios[bits].append(errs[1] / errs[0])
            line += (f"  {bits} bits: lloyd {errs[0]:.5f} uniform {errs[1]:.5f} ({ratios[bits][-1]:.3f}x,"
                     f" step {best[1][1] - best[1][0]:.4f})")
        print(line, flush=True)
    for bits, r in ratios.items():
        print(f"{bits} bits: uniform / lloyd, geometric mean over {len(r)} sets: "
              f"{math.exp(sum(map(math.log, r)) / len(r)):.3f}x ({min(r):.3f}-{max(r):.3f})")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="tree,u0,u1", help=f"of {list(VARIANTS)}; the first is the bar")
    ap.add_argument("--formats", default="q3,q3.5")
    ap.add_argument("--points", default="llama8b:8:32768,llama8b:64:32768,llama8b:64:131072,"
                    "llama70b-tp8:64:131072")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--rep", type=int, default=30)
    ap.add_argument("--out")
    ap.add_argument("--sass", action="store_true", help="offline: compile for sm_90, count the loop's SASS")
    ap.add_argument("--mse", metavar="NPZ", help="uniform against Lloyd codebooks on this KV subset (CPU)")
    a = ap.parse_args(argv)
    names = a.variants.split(",")
    if a.mse:
        mse(a.mse)
    elif a.sass:
        sass(names)
    else:
        pts = [(p.split(":")[0], int(p.split(":")[1]), int(p.split(":")[2])) for p in a.points.split(",")]
        time_points(names, a.formats.split(","), pts, a.rounds, a.rep, a.out)


if __name__ == "__main__":
    main()
