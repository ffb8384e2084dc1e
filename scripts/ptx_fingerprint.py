"""Compile every Gluon decode kernel in the configurations its tests and launches use, for sm_90 and
without a GPU, and print one line per configuration: its name, a hash of its PTX with the debug line
information taken out, its shared memory and ptxas' spill bytes.

A refactor of a kernel that leaves every hash as it was leaves the code the GPU runs as it was, so it
can land from a machine without a GPU. Usage (no TRITON_INTERPRET: Gluon does not run in the
interpreter)::

    PYTHONPATH=python python scripts/ptx_fingerprint.py > before.txt
    # edit the kernels
    PYTHONPATH=python python scripts/ptx_fingerprint.py > after.txt && diff before.txt after.txt

``--dump DIR`` also writes each configuration's normalised PTX there, for a diff of what changed.
``--only SUBSTRING`` compiles the configurations whose name contains it. ``--loop`` adds the SASS
of each kernel's main loop (its longest backward branch; one 16-token page per warp and iteration in
these kernels) counted by pipe: an offline measure of the work per page, not a timing.
"""
from __future__ import annotations

import argparse
import collections
import hashlib
import os
import re
import subprocess
import sys

from tqdm import tqdm

_DEBUG = re.compile(r"^(\s*(\.loc|\.file)\b.*|\$L__tmp\d+:)$\n?", re.M)


def normalise(ptx: str) -> str:
    """The PTX without line directives, debug labels and debug sections (they move with every edit of
    the source)."""
    ptx = _DEBUG.sub("", ptx)
    cut = ptx.find(".section\t.debug")
    if cut < 0:
        cut = ptx.find(".section .debug")
    return ptx if cut < 0 else ptx[:cut]


# SASS opcodes by the pipe that runs them on sm_90 (the rest: control, uniform datapath, shuffles);
# lmem: local-memory loads and stores (ptxas' spills) inside the loop
_PIPES = {"alu": "LOP3 SHF IADD3 ISETP SEL PRMT LEA IMNMX VIMNMX FLO POPC BMSK SGXT PLOP3 FSEL FSETP FMNMX".split(),
          "fma": "IMAD FFMA FMUL FADD HFMA2 HADD2 HMUL2 VIADD".split(),
          "lds": "LDS LDSM".split(), "mma": ["HMMA"], "xu": "MUFU F2F I2F F2I F2FP I2FP".split(),
          "lmem": "LDL STL".split()}


def loop_mix(cubin: bytes) -> str:
    """The main loop's SASS instruction count and its split by pipe (``_PIPES``)."""
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    cuobjdump = os.path.join(os.path.dirname(get_ptxas(90).path), "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([cuobjdump, "-sass", f.name], capture_output=True, text=True, check=True).stdout
    code = [(int(a, 16), t.strip()) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    back = [(a - int(m.group(1), 16), int(m.group(1), 16), a) for a, t in code
            for m in [re.search(r"\bBRA\b.*?(0x[0-9a-f]+)", t)] if m and int(m.group(1), 16) <= a]
    # the main loop: the back branch spanning the most HMMA, the shortest such (a wait's retry path
    # placed after the loop branches back into it across the loop's tail)
    hmma = [a for a, t in code if "HMMA" in t]
    back = [(-sum(lo <= a <= hi for a in hmma), span, lo, hi) for span, lo, hi in back]
    if not back:
        return "loop=none"
    _, _, lo, hi = min(back)
    ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0]
                              for a, t in code if lo <= a <= hi)
    pipes = {p: sum(n for o, n in ops.items() if o in names) for p, names in _PIPES.items()}
    return f"loop={sum(ops.values())} " + " ".join(f"{p}={n}" for p, n in pipes.items())


_COMPACT_PTRS = {"q_ptr": "*fp32", "bias_ptr": "*fp32", "k_pages_ptr": "*u8", "v_pages_ptr": "*u8",
                 "ws_m_ptr": "*fp32", "ws_l_ptr": "*fp32", "ws_acc_ptr": "*fp32", "k_grid_ptr": "*fp32",
                 "v_grid_ptr": "*fp32", "rope_coef_ptr": "*fp32", "rope_phase_ptr": "*i64", "k_cb_ptr": "*fp32",
                 "v_cb_ptr": "*fp32", "rope_pos_ptr": "*fp32"}


def compact_launch(kb, vb, d=128, group=4, chunks=0, stages=2, bias=False, opts=("VOTE",)):
    """``compile_for_hopper``'s arguments after the kernel for ``compact_split_kernel`` at a launch:
    (constexprs, pointer types, warps, register cap). ``opts``: the constexpr flags set (VOTE,
    V_PAD, COPY_ALIGN, BULK_COPY, ROPE_TABLE, ROPE_POS, ROPE_LANES, ROPE_CHAINS, ROPE_FOLD, ROPE_SKIP); the
    defaults are the 8B launch with the vote."""
    from weightszip.kernels import KernelConfig
    from weightszip.kernels import paged_decode_gluon as pg

    warps = 16 if chunks else 8
    hoist = 0 < chunks <= KernelConfig().gluon_rope_hoist  # as PagedDecodeAttention launches it
    block_g = max(8, 1 << (group - 1).bit_length())
    rope_words = pg.rope_table_words(chunks, block_g) if "ROPE_TABLE" in opts and chunks else 0
    trig = chunks if ("ROPE_POS" in opts or "ROPE_LANES" in opts) and stages else 0
    tab_off, stage_off, _ = pg.smem_offsets(kb, vb, d, warps, stages, "COPY_ALIGN" in opts, "V_PAD" in opts,
                                            rope_words, trig)
    const = dict(GROUP=group, BLOCK_G=block_g, HEAD_DIM=d, BLOCK_SIZE=16,
                 BITS_K=kb, BITS_V=vb, HAS_BIAS=bias, V_EARLY=True, K_AHEAD=False, ROPE_CHUNKS=chunks,
                 ROPE_HOIST=hoist, STAGES=stages, TAB_OFF=tab_off, STAGE_OFF=stage_off, **dict.fromkeys(opts, True))
    if "ROPE_CHAINS" in opts:  # KernelConfig.gluon_rope_chains=2
        const["ROPE_CHAINS"] = 2
    return const, _COMPACT_PTRS, warps, None if chunks else 128


def configurations():
    """(name, build) pairs; build() returns (kernel, constexprs, pointers, warps, maxnreg)."""
    from weightszip.kernels import kv_exact4_gluon as xg
    from weightszip.kernels import paged_decode_gluon as pg

    # (bits_k, bits_v, head_dim, group, rope chunks, stages, logit bias): the compile tests' cases, then
    # the benchmarks' launches (Llama-3.1-8B and 70B TP8 in q4, q3.5 and q3, no bias)
    cases = [(4, 4, 128, 4, 0, 0), (4, 3, 128, 8, 0, 0), (3, 3, 64, 3, 0, 0), (2, 3, 64, 3, 0, 0), (4, 4, 64, 16, 0, 0),
             (4, 4, 128, 4, 2, 0), (3, 3, 64, 3, 2, 0), (4, 4, 128, 4, 0, 2), (3, 3, 128, 4, 0, 2), (4, 3, 128, 8, 0, 4),
             (2, 3, 64, 3, 2, 2), (4, 4, 128, 4, 2, 2), (4, 4, 32, 4, 0, 2), (3, 4, 128, 4, 0, 2)]
    cases = [c + (True, ()) for c in cases] + [(kb, vb, 128, g, 0, 2, False, ()) for kb, vb in ((4, 4), (4, 3), (3, 3))
                                                for g in (4, 8)]
    # the kernel's options at the 8B launch (staged, no bias), each named in the line by its suffix:
    # VOTE (KernelConfig.gluon_vote, the compact default since session 30), V_PAD, COPY_ALIGN and BULK_COPY
    # (gluon_v_pad, gluon_copy_align, gluon_bulk_copy: opt-in)
    cases += [(kb, vb, 128, 4, 0, 2, False, opts) for kb, vb, opts in (
        (4, 4, ("VOTE",)), (3, 3, ("VOTE",)), (4, 4, ("VOTE", "V_PAD")), (4, 4, ("VOTE", "V_PAD", "COPY_ALIGN")),
        (4, 4, ("VOTE", "BULK_COPY")), (4, 4, ("VOTE", "V_PAD", "BULK_COPY")), (3, 3, ("VOTE", "BULK_COPY")),
        (4, 4, ("VOTE", "COPY_ALIGN")), (3, 3, ("VOTE", "COPY_ALIGN")))]
    # the rotary term at its launches (16 warps, staged, the vote): 24-32 listed pairs (2 chunks) and all
    # 64 (4) at the 8B shape, and the shipped SmolLM2 calibration's shape (head_dim 64, 3 query heads a KV head)
    cases += [(kb, vb, d, g, chunks, 2, False, ("VOTE",)) for kb, vb, d, g, chunks in (
        (4, 4, 128, 4, 2), (3, 3, 128, 4, 2), (4, 4, 128, 4, 4), (4, 3, 64, 3, 2), (3, 3, 64, 3, 2))]
    # ... and from tables (KernelConfig.gluon_rope_table), staged and on the register path
    cases += [(kb, vb, d, g, chunks, stages, False, ("VOTE", "ROPE_TABLE")) for kb, vb, d, g, chunks, stages in (
        (4, 4, 128, 4, 2, 2), (3, 3, 128, 4, 2, 2), (4, 4, 128, 4, 4, 2), (3, 3, 128, 4, 4, 2), (4, 3, 64, 3, 2, 2),
        (3, 3, 64, 3, 2, 2), (4, 4, 128, 4, 2, 0), (2, 3, 64, 3, 2, 0))]
    # ... with the pages' cos and sin copied into their slots (KernelConfig.gluon_rope_pos), staged
    cases += [(kb, vb, d, g, chunks, 2, False, ("VOTE", "ROPE_TABLE", "ROPE_POS")) for kb, vb, d, g, chunks in (
        (4, 4, 128, 4, 2), (3, 3, 128, 4, 2), (4, 4, 128, 4, 4), (3, 3, 128, 4, 4), (4, 3, 64, 3, 2), (3, 3, 64, 3, 1))]
    # ... with each page's cos and sin computed once a warp, a value a lane (KernelConfig.gluon_rope_lanes)
    cases += [(kb, vb, d, g, chunks, 2, False, ("VOTE", "ROPE_TABLE", "ROPE_LANES")) for kb, vb, d, g, chunks in (
        (4, 4, 128, 4, 2), (3, 3, 128, 4, 2), (4, 4, 128, 4, 4), (3, 3, 128, 4, 4), (4, 3, 64, 3, 2), (3, 3, 64, 3, 1),
        (4, 4, 128, 4, 3))]
    # ... the table form's products in two chains (KernelConfig.gluon_rope_chains=2)
    cases += [(kb, vb, d, g, chunks, 2, False, ("VOTE", "ROPE_TABLE", "ROPE_CHAINS")) for kb, vb, d, g, chunks in (
        (4, 4, 128, 4, 2), (3, 3, 128, 4, 2), (4, 4, 128, 4, 4), (4, 3, 64, 3, 2))]
    # ... Q in the padding columns (KernelConfig.gluon_rope_fold)
    cases += [(kb, vb, d, g, chunks, 2, False, ("VOTE", "ROPE_TABLE", "ROPE_FOLD")) for kb, vb, d, g, chunks in (
        (4, 4, 128, 4, 2), (3, 3, 128, 4, 2), (4, 4, 128, 4, 4), (4, 3, 64, 3, 2))]
    cases += [(4, 4, 128, 4, 2, 2, False, ("VOTE", "ROPE_TABLE", "ROPE_LANES", "ROPE_FOLD"))]
    # ... the padding columns' lanes loading no records (KernelConfig.gluon_rope_skip_pad)
    cases += [(kb, vb, d, g, chunks, 2, False, ("VOTE", "ROPE_TABLE", "ROPE_SKIP")) for kb, vb, d, g, chunks in (
        (4, 4, 128, 4, 2), (3, 3, 128, 4, 2), (4, 4, 128, 4, 4), (4, 3, 64, 3, 2))]
    cases += [(4, 4, 128, 4, 2, 2, False, ("VOTE", "ROPE_TABLE", "ROPE_LANES", "ROPE_SKIP"))]
    # ... and V padded (KernelConfig.gluon_rope_v_pad), with the skip (groups of 5-7) or the fold (up to 4):
    # the compact default's rotary launches since session 45
    cases += [(4, 4, 128, 4, chunks, 2, False, ("VOTE", "V_PAD", "ROPE_TABLE", rope))
              for rope in ("ROPE_SKIP", "ROPE_FOLD") for chunks in (2, 4)]
    suffix = {"VOTE": " vote", "V_PAD": " vpad", "BULK_COPY": " bulk", "COPY_ALIGN": " align",
              "ROPE_TABLE": " table", "ROPE_POS": " pos", "ROPE_LANES": " lanes",
              "ROPE_CHAINS": " chains2", "ROPE_FOLD": " fold",
              "ROPE_SKIP": " skip"}
    for kb, vb, d, group, chunks, stages, bias, opts in cases:
        def build(kb=kb, vb=vb, d=d, group=group, chunks=chunks, stages=stages, bias=bias, opts=opts):
            return (pg.compact_split_kernel, *compact_launch(kb, vb, d, group, chunks, stages, bias, opts))
        name = f"compact k{kb}v{vb} d{d} g{group} rope{chunks} stages{stages}{' bias' if bias else ''}"
        yield name + "".join(suffix[o] for o in opts), build

    fp8_ptrs = {"q_ptr": "*bf16", "k_pages_ptr": "*fp8e4nv", "v_pages_ptr": "*fp8e4nv", "ws_m_ptr": "*fp32",
                "ws_l_ptr": "*fp32", "ws_acc_ptr": "*fp32", "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}
    for d, group, stages in ((128, 4, 2), (128, 8, 4), (64, 3, 2), (64, 16, 2), (128, 8, 2)):
        def build(d=d, group=group, stages=stages):
            const = dict(GROUP=group, BLOCK_G=max(8, 1 << (group - 1).bit_length()), HEAD_DIM=d, BLOCK_SIZE=16,
                         STAGES=stages)
            return pg.fp8_split_kernel, const, fp8_ptrs, 8, 128
        yield f"fp8 d{d} g{group} stages{stages}", build

    x4_ptrs = dict(q_ptr="*bf16", k_ptr="*u8", v_ptr="*u8", k_off_ptr="*i64", v_off_ptr="*i64", ones_ptr="*u8",
                   ws_m_ptr="*fp32", ws_l_ptr="*fp32", ws_acc_ptr="*fp32")
    for d, group, warps, stages in ((128, 4, 4, 2), (64, 3, 8, 4), (128, 8, 8, 2), (128, 4, 8, 2)):
        for bf16 in (False, True):
            def build(d=d, group=group, warps=warps, stages=stages, bf16=bf16):
                const = dict(GROUP=group, BLOCK_G=8, HEAD_DIM=d, STAGES=stages, BF16=bf16)
                return xg.exact4_split_kernel, const, x4_ptrs, warps, None
            yield f"exact4 d{d} g{group} w{warps} stages{stages} bf16={int(bf16)}", build

    def build_x4_in_order():  # KernelConfig.gluon_x4_v_swizzle=False: V's staged chunks in order
        const = dict(GROUP=4, BLOCK_G=8, HEAD_DIM=128, STAGES=2, V_SWIZZLE=False)
        return xg.exact4_split_kernel, const, x4_ptrs, 4, None
    yield "exact4 d128 g4 w4 stages2 v-in-order", build_x4_in_order


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dump", help="write each configuration's normalised PTX into this folder")
    ap.add_argument("--only", default="", help="compile the configurations whose name contains this")
    ap.add_argument("--loop", action="store_true", help="add the main loop's SASS instructions by pipe")
    args = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        ap.error("unset TRITON_INTERPRET: Gluon kernels compile only outside the interpreter")
    from weightszip.kernels.paged_decode_gluon import compile_for_hopper

    todo = [(n, b) for n, b in configurations() if args.only in n]
    if args.dump:
        os.makedirs(args.dump, exist_ok=True)
    for name, build in tqdm(todo, desc="compiling", unit="kernel", file=sys.stderr):
        kernel, const, ptrs, warps, maxnreg = build()
        k, spills = compile_for_hopper(kernel, const, ptrs, warps, maxnreg)
        ptx = normalise(k.asm["ptx"])
        digest = hashlib.sha256(ptx.encode()).hexdigest()[:16]
        mix = f" {loop_mix(k.asm['cubin'])}" if args.loop else ""
        print(f"{name:<44} {digest} shared={k.metadata.shared} spills={spills}{mix}", flush=True)
        if args.dump:
            with open(os.path.join(args.dump, re.sub(r"[^\w.=-]+", "_", name) + ".ptx"), "w") as f:
                f.write(ptx)
    return 0


if __name__ == "__main__":
    sys.exit(main())
