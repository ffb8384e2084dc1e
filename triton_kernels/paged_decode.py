"""Paged decode attention: one query token per sequence against a paged KV cache, split-K.

Read me first:

* **Layout.** Per layer, K and V each live in a pool of blocks ``[num_blocks, kv_heads, block_size,
  head_dim]`` (``block_size`` a multiple of 16; a 16-token slice of one block and one KV head is a
  *page*). ``block_tables[b, i]`` is the block that holds positions ``[i * block_size, (i + 1) *
  block_size)`` of sequence ``b``, as in vLLM. Position ``p`` of a sequence sits in block
  ``block_tables[b, p // block_size]`` at slot ``p % block_size``.
* **Side tokens.** A format may keep ``S`` sink tokens (positions ``0..S-1``) and a recent window of
  ``W`` positions in bf16 outside the pages, in ``k_side``/``v_side`` ``[num_seqs, S + W, kv_heads,
  head_dim]``: sinks at slots ``0..S-1``, window position ``p >= S`` at slot ``S + p % W``. The pages
  then hold positions ``[S, L - W)`` only (a sequence of ``L`` tokens); slots of other positions are
  never read. Page tokens and side tokens share one softmax.
* **Page types** (a compile-time switch, ``PAGE_TYPE``): ``PAGE_BF16`` (the block holds bf16 values)
  and ``PAGE_FP8`` (e4m3 codes with one fp32 scale per KV head, value = ``fp32(code) * scale``). One
  step, ``_load_page_tile``, loads and dequantizes a tile of ``BLOCK_N`` tokens (``BLOCK_N / 16``
  pages); everything else is shared. ``PAGE_COMPACT``: the compact formats' pages (q4, q3.5, q3;
  ``codec.pack_page``), a pool ``uint8 [num_blocks, kv_heads, block_size / 16, page_bytes]`` per K
  and V with their own widths (``k_bits``/``v_bits``, constexprs); ``_compact_planes``/``_compact_values``
  unpack the codes (nibble rows at width 4, crumb rows at 3, bit planes otherwise) and return
  ``codebook[code]`` and the token's ``grid[k]``, whose fp32 product is ``codec.dequantize`` bit for
  bit (``dequantize_compact_pages``); the scale multiplies the fp32 logits (K) and the softmax
  weights (V). Products on the tensor cores (bf16 codebook values, q' and scaled weights) or, with
  ``KernelConfig.cuda_dot``, in fp32 on the CUDA cores.
  ``PAGE_EXACT`` and ``PAGE_EXACT4``: lossless pages in a byte heap (KV Exact, ``kv_exact_ref``; KV
  Exact4, ``kv_exact4_ref``), decoded into the same bf16 tiles as the uncompressed pages. On the GPU
  exact4 pages run the Gluon kernel (``kv_exact4_gluon``: pairs decoded into the tensor cores' register
  operands) where it applies, and its output equals the same kernel's over the bf16 pages (bf16 pages
  with a ``gluon`` config) bit for bit; the Triton kernel's exact4 path is the reference elsewhere.
* **Transformed domain.** A format may store pages in a transformed domain: the true key is ``y @ A_k
  + mu_k`` and the true value ``y @ A_v + mu_v``, ``y`` the dequantized page value, ``A`` a ``[head_dim,
  head_dim]`` matrix per KV head. Then ``q . k = (q @ A_k^T) . y + q . mu_k``: the split kernel gets
  the transformed query ``q'`` and a per-head logit bias ``b``, computes ``(q' . y + b) * sm_scale`` and
  sums ``p * y`` in the transformed domain; the merge applies ``A_v`` once to the merged page part and
  adds ``mu_v`` times the page part's softmax mass, then adds the side tokens (in the true domain).
  bf16 and fp8 pages use the identity (no transform, no bias, no mean); tests run the whole path with
  a random transform on bf16 pages.
* **Numerics.** Products on the tensor cores with bf16 operands (q, page values, and the softmax
  weights rounded to bf16, as flash attention does), every sum in fp32, the softmax in base 2 with the
  running maximum (log-sum-exp merge of the splits). fp8 codes convert to bf16 exactly; the fp8 scale
  multiplies the fp32 logits and the fp32 output sum. On the GPU fp8 pages run the Gluon kernel
  (``paged_decode_gluon.fp8_split_kernel``) where it applies, whose products are f16 (Hopper converts
  e4m3 to f16): q times sm_scale log2(e) and the softmax weights are rounded to f16 instead of bf16
  (3 more mantissa bits; q must stay below about 3.6e5 in magnitude, where f16 overflows). The stated
  tolerance against the fp64 reference (``paged_decode_ref``) is in ``tests/test_kernels_paged_decode.py``.
* **Schedule.** ``plan()`` cuts each sequence's paged range into splits of ``split_tokens`` tokens
  (a multiple of ``BLOCK_N``; chosen so that the grid fills the GPU a few times over) and lays out one
  work item per split; the split kernel runs a program per (work item, KV head), all the query heads
  of that KV head together (GQA); the merge kernel runs a program per (sequence, KV head).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import numpy as np
import torch
import triton
import triton.language as tl

from weightszip._tensors import _fits_in_memory, int_arg, no_overlap
from weightszip.errors import InvalidArgumentError

from ._interpreter_compat import apply as _interpreter_compat
from ._interpreter_compat import interpreting as _interpreting
from . import kv_exact4_ref

_interpreter_compat()

PAGE_BF16 = 0
PAGE_FP8 = 1
PAGE_COMPACT = 2
PAGE_EXACT = 3
PAGE_EXACT4 = 4
PAGE_TYPES = {"bf16": PAGE_BF16, "fp8": PAGE_FP8, "compact": PAGE_COMPACT, "exact": PAGE_EXACT,
              "exact4": PAGE_EXACT4}
PAGE_DTYPES = {PAGE_BF16: torch.bfloat16, PAGE_FP8: torch.float8_e4m3fn, PAGE_COMPACT: torch.uint8,
               PAGE_EXACT: torch.uint8, PAGE_EXACT4: torch.uint8}
EXACT_PAGES = (PAGE_EXACT, PAGE_EXACT4)  # lossless pages in a byte heap (one page per block)
EXACT4_MAX_HEADS = kv_exact4_ref.MAX_HEADS
COMPACT_BITS = (2, 3, 4, 5)
GRID_SIZE = 256  # scale steps per head of a compact format (codec.GRID_SIZE)
PAGE_TOKENS = 16  # tokens per page; a block is a whole number of pages
# The Gluon kernel's per-warp output accumulator (head_dim x GQA group padded to >= 8, fp32) fits its
# 128 registers up to this size without spilling (ptxas, sm_90: head_dim 128 x 8, 64 x 16, 32 x 32);
# larger ones (head_dim 256, groups of 16 at 128) run the Triton kernel
GLUON_MAX_ACC = 1024
# shared memory a Gluon program may take (the H200 gives a block up to 227 KiB)
GLUON_MAX_SMEM = 200 * 1024


def _compact_gluon_smem(k_bits: int, v_bits: int, head_dim: int, cfg, has_rope: bool, group: int = 1,
                        pos: bool = False) -> int:
    """Shared memory of the compact Gluon kernel at a config (pair tables, grids, staging slots; with
    ``gluon_rope_table`` the rotary term's tables for all head_dim / 32 chunks a head can list, at
    GQA ``group``; ``pos``: the slots' room for the pages' cos and sin, ``gluon_rope_pos`` or
    ``gluon_rope_lanes``, as many chunks)."""
    from .paged_decode_gluon import rope_table_words, smem_offsets

    warps = cfg.gluon_rope_warps if has_rope else cfg.gluon_warps
    use = has_rope and cfg.gluon_rope_table
    rope_words = rope_table_words(head_dim // 32, _pow2_at_least(group, 8)) if use else 0
    return smem_offsets(k_bits, v_bits, head_dim, warps, cfg.gluon_stages, cfg.gluon_copy_align,
                        cfg.v_padded(has_rope), rope_words, head_dim // 32 if use and pos else 0)[2]


def rope_page_table(rope_phase: torch.Tensor, tokens: int) -> torch.Tensor:
    """cos and sin of each RoPE pair's phase at each page's first position, for ``run``'s
    ``rope_pos_table``: fp32 [ceil(tokens / 16), d/2, 2] on rope_phase's device, row r (position
    16 r) pair i = (cos, sin) of 2 pi (16 r f_i mod 2**48) / 2**48, from the exact 48-bit phase in
    float64 (``rope_phase`` int64 [d/2]: ``compact_tables(...)["rope_phase"]``). A model's constant (every
    layer with the same phase steps can share it): 4 MiB at 128k tokens and head_dim 128."""
    _check(isinstance(rope_phase, torch.Tensor) and rope_phase.dtype == torch.int64 and rope_phase.dim() == 1
           and rope_phase.numel() > 0, "rope_phase must be a non-empty int64 [head_dim / 2]")
    tokens = int_arg("tokens", tokens, 1, 2**31 - 1)
    rows, f = -(-tokens // PAGE_TOKENS), rope_phase[None, :]
    with _fits_in_memory(f"rope_page_table of {tokens} tokens ({rows * f.numel() * 8} bytes) does not fit in memory"):
        out = torch.empty(rows, f.numel(), 2, dtype=torch.float32, device=rope_phase.device)
        for r0 in range(0, rows, 8192):  # (the int64 and float64 steps a block of rows at a time)
            p = torch.arange(r0, min(rows, r0 + 8192), dtype=torch.int64, device=f.device)[:, None] * PAGE_TOKENS
            # p f mod 2**48 with f in 16-bit halves (no product past 2**63), as codec.rope_cos_sin
            ph = ((((p * (f >> 16)) & 0xFFFFFFFF) << 16) + p * (f & 0xFFFF)) & (2**48 - 1)
            ang = ph.double() * (2 * math.pi / 2**48)
            out[r0:r0 + ang.shape[0], :, 0] = torch.cos(ang)
            out[r0:r0 + ang.shape[0], :, 1] = torch.sin(ang)
    return out


LOG2E = 1.4426950408889634
NEG_BIG = tl.constexpr(-1.0e30)  # finite "minus infinity" for the running max: exp2(NEG_BIG - NEG_BIG) stays 1, never NaN


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the split kernel.

    ``block_n``: tokens per loop step (a multiple of 16: ``block_n / 16`` pages per tile).
    ``num_warps``/``num_stages``: Triton's. ``waves``: the planner makes at most ``waves`` programs
    per multiprocessor in all where it can (``PagedDecodeAttention._fit_split``);
    ``min_split_tokens``: no split is shorter (fewer, longer splits cost less merging). Defaults
    chosen on the H200 (see BENCHMARKS.md, "Paged decode attention").
    """

    block_n: int = 128
    num_warps: int = 4
    num_stages: int = 2
    waves: int = 4
    # ... and at most this many where the step runs the compact Gluon kernel with the rotary term
    # (``plan(..., rope=True)``; 0: ``waves``). It fits one 16-warp program per multiprocessor, so 2 waves
    # run as two sequential waves with half-length splits (session 46, H100: 1 wave 1.00-1.32x, see the default)
    rope_waves: int = 0
    min_split_tokens: int = 1024
    cuda_dot: bool = False  # compact pages only: products on the CUDA cores in fp32 (no 16-row padding)
    # compact pages, tensor-core path, compiled only: when K and V are both at most ``reg_lut_bits``
    # wide, their codebooks are looked up in registers (byte permutes, ``_lut_lookup``) instead of
    # gathered from pair tables in memory; 0: never. Taken as 2 at most: widths 3 and 4 are crumb and
    # nibble rows, gathered as pairs. On the H200 (BENCHMARKS.md), with bit planes at width 3: q3
    # 3-11% faster at the 8B shape, slower at 70B TP8 batch 8 (where alone the Triton kernel still
    # runs, below ``gluon_min_work``); 16 entries 13-21% slower; q3.5 with only V in registers (a
    # per-kind choice, since dropped) 8-9% slower.
    reg_lut_bits: int = 3
    # fp8 pages, compiled only: ``gluon`` runs ``paged_decode_gluon.fp8_split_kernel`` (with
    # ``gluon_warps``, ``gluon_stages`` (at least 2), ``gluon_maxnreg``, ``gluon_min_work``); on in the
    # fp8 default (H200: 1.3-1.7x faster than the Triton kernel from batch 8 x 32k up, BENCHMARKS.md).
    # compact pages, compiled only: the Gluon split kernel (``paged_decode_gluon``) where it applies
    # (widths up to 4, the rotary term if ``gluon_rope``, head_dim x padded GQA group <= GLUON_MAX_ACC;
    # else the Triton kernel with the fields above): ``gluon_warps``
    # warps per program, each on its own pages (16 tokens per step); ``gluon_maxnreg``: a register cap
    # (0: none; 128 keeps two programs of 8 warps per multiprocessor); ``gluon_ahead``: bit 0 loads V's
    # plane words at the top of the step with K's, bit 1 K's words one step ahead (more registers)
    # exact4 pages, compiled only: ``gluon`` runs ``kv_exact4_gluon.exact4_split_kernel`` (``gluon_warps``,
    # ``gluon_stages`` (at least 2), ``gluon_maxnreg``, ``gluon_min_work``; head_dim 64 or 128, groups up
    # to 8); on in the exact4 default. bf16 pages with ``gluon`` run the same kernel (its bf16 mode: the
    # reference the exact4 pages' output equals bit for bit), else the Triton kernel
    gluon: bool = False
    # ... when the step's paged tokens times KV heads reach this (in session 8 the Triton kernel was
    # faster below 2**21 = batch 8 x 32k x 8 heads on the H200; the compact default used 2**18 in
    # sessions 13-21; both defaults now use 0)
    gluon_min_work: int = 1 << 21
    gluon_warps: int = 8
    gluon_maxnreg: int = 128
    gluon_ahead: int = 1
    # the Gluon kernel with the rotary-offset term too (``paged_decode_gluon._rope_logits``; GQA
    # groups up to 8), on ``gluon_rope_warps`` warps (no register cap): on the H200 with 24 of 64
    # RoPE pairs from batch 8 x 128k up 1.5-1.7x (q4) and 1.1-1.4x (q3) faster than the Triton kernel
    gluon_rope: bool = True
    gluon_rope_warps: int = 16
    # ... and from this step size (2**22; at batch 8 x 32k x 8 heads and 70B TP8 64 x 32k the Triton
    # kernel was as fast or faster with the rotary term, from 8 x 128k x 8 heads up the Gluon kernel)
    gluon_rope_min_work: int = 1 << 22
    # staged pages (gluon_stages > 0), a rotary term of at most gluon_rope_hoist chunks of 16 pairs (0 to
    # 4; 0: never): its query coefficients loaded and split into hi/lo bf16 once per program, before
    # the page loop, instead of on every page (``paged_decode_gluon._rope_coefs``; the same products,
    # so the same output bit for bit). H200, session 39 (against the kernel before, 3 rounds): up to
    # 32 pairs (2 chunks) q4 1.16-1.19x and q3 1.12-1.16x at the 8B and 70B TP8 shapes; with all 64
    # pairs (4 chunks, 17 local-memory accesses a page in the loop) q4 0.92-0.94x and q3.5 0.97-0.98x,
    # so 4 chunks keep them in the loop; the register path always does (ptxas spilled 132 bytes)
    gluon_rope_hoist: int = 2
    # the rotary term from tables made once per program in shared memory (``paged_decode_gluon.
    # _rope_table_logits``): per page cos and sin of the listed pairs' phases only, the rows' rotations
    # cos / sin (n theta) a constant operand, by the angle sum; not bit-identical to the direct form
    # (both within the fp32 tolerance of the reference). Offline (sm_90a SASS per page and warp, q4 at
    # the 8B shape): 802 -> 605 instructions with 2 chunks, 1454 -> 794 with 4. On for compact pages
    # (``DEFAULT_CONFIGS``) since session 40's A/B on an H100 (BENCHMARKS.md)
    gluon_rope_table: bool = False
    # ... with staged pages and ``run``'s ``rope_pos_table`` (``rope_page_table``): each page's cos and
    # sin of the listed pairs' phases copied into its slot with its codes (8 bytes a pair) instead of
    # computed (``paged_decode_gluon._issue_trig``); offline (sm_90a, q4 at the 8B shape) 605 -> 565
    # loop instructions a page with 2 chunks, 794 -> 706 with 4. Off: on an H100 (session 42, against
    # the tables alone) 1.017-1.020x with 64 listed pairs, 0.94-0.98x with 24 (BENCHMARKS.md)
    gluon_rope_pos: bool = False
    # ... with staged pages (and without ``gluon_rope_pos``): each page's cos and sin of the listed pairs'
    # phases computed once a warp, one value a lane (lane 2 i + s: pair i's cos for s = 0, sin for 1;
    # ``paged_decode_gluon._lane_trig``), stored into the page's slot and read back as the pos form reads
    # its copies, instead of every lane computing its B-operand fragment's 4 pairs x (cos, sin) (8 lanes
    # the same values): the same phases, the same MUFU.COS/SIN, so the same output bit for bit as the
    # tables alone (so on an H100, session 44), 4-7% fewer loop instructions, and no faster there:
    # 0.978-1.030x the tables (BENCHMARKS.md, "Each page's cos and sin once a warp, on an H100"). Off
    gluon_rope_lanes: bool = False
    # ... (the tables) 1 or 2: the term's mma.sync products in one dependent chain (6 a chunk), or the
    # cosine and sine products in two chains added at the end (another rounding of the same sum).
    # 1.015x the default on an H100 (BENCHMARKS.md, "Where the rotary term's time goes"), so 1
    gluon_rope_chains: int = 1
    # ... (the tables, query groups up to 4: the 8B shape) Q in the B operand's padding columns 4-7 and P
    # in 0-3, one product and one hi/lo split a chunk where there were two; the sums as gluon_rope_chains=2
    # (the same output bit for bit on an H100), 6-10% fewer loop instructions, 1.010x there while the
    # shared pipe was the limit; 1.024x with V padded (session 45), on in the compact default since then
    gluon_rope_fold: bool = False
    # ... (the tables, query groups narrower than the B operand's 8 columns) the lanes of the padding
    # columns load none of the term's records (predicated ld.shared; their P and Q are 0 either way):
    # the same output bit for bit, fewer shared-memory wavefronts (the term's limit on an H100, session 44;
    # on in the compact default since its A/B there, ``DEFAULT_CONFIGS``; the fold takes precedence where
    # both apply)
    gluon_rope_skip_pad: bool = False
    # 0, 2 or 4: each warp's next gluon_stages - 1 pages copied ahead into shared memory (cp.async,
    # no registers held) instead of loaded into registers (``gluon_ahead`` then has no effect)
    gluon_stages: int = 2
    # compact pages: the lazy running max by a warp vote (``paged_decode_gluon._vote_softmax_step``: no
    # shuffles on pages where no head's max moves; the same maxima as without it, so the same output
    # bit for bit). On by default for compact pages (``DEFAULT_CONFIGS``) since session 30's A/B
    gluon_vote: bool = False
    # compact pages with 4-bit V (q4) and head_dim 128, staged: V's 128-byte row pairs 160 bytes
    # apart in the slot (``paged_decode_gluon.v_padded_chunk``) so that the V operand's shared loads
    # are free of bank conflicts (16 wavefronts a load without, 4 with); the same words, so the same
    # output. Off: with the per-lane copies 0.93-1.01x at q4 on an H100, which cost more than the
    # loads save (as did two swizzles, removed; BENCHMARKS.md, session 31); for ``gluon_bulk_copy``
    gluon_v_pad: bool = False
    # ... where the rotary term runs (``gluon_rope``; any of its forms): V padded as ``gluon_v_pad`` pads
    # it, whatever that field says (``v_padded``). With the term the kernel is bound by the shared-memory
    # pipe, not by DRAM (Nsight Compute, session 44), and the padding's 12 fewer wavefronts a V load
    # pay: on an H100 (session 45, tables and skip) 1.011-1.112x in 12 rotary cases at q4, the same
    # output bit for bit; without the term 0.907-1.002x, so only there. On in the compact default
    gluon_rope_v_pad: bool = False
    # compact pages, staged: each side's planes at a 128-byte line of the slot and each page's copies
    # assigned so that every 8 lanes write one line (``paged_decode_gluon.aligned_copy_slot``): one
    # shared wavefront per 8 lanes where the default's copies cross a line in each (Nsight Compute:
    # 8.2-8.6 wavefronts a copy for 4); slots 12% larger at q4. Off: 0.98-1.035x on an H100 (session 31)
    gluon_copy_align: bool = False
    # compact pages, staged: each page's planes and scale indices copied by the copy engine
    # (``cp.async.bulk`` from one lane, completing on the slot's mbarrier) instead of 16-byte cp.async
    # from every lane, so the copies leave the load/store pipe's shared-memory wavefronts (8.2-8.6 a
    # copy, 4 copies a page) and a padded V (``gluon_v_pad``) costs them nothing more. Off: on an H100
    # 0.84-0.97x (0.89-0.92x with V padded), bit-identical (BENCHMARKS.md, session 33); the H200 untimed
    gluon_bulk_copy: bool = False
    # exact4 pages, head_dim 128: V's staged code and raw rows with their 16-byte chunks XOR-swizzled
    # (``kv_exact4_gluon._v_swizzle``) so the operand loads are free of bank conflicts; False: the
    # chunks in order (the copies' shared writes in order, the loads with bank conflicts). The same
    # words either way, so the same output; in order 1.002-1.005x on an H100 (noise; session 33)
    gluon_x4_v_swizzle: bool = True

    def __post_init__(self):
        """Launch parameters that would not compile, or would compile into the wrong kernel, are
        refused here with a typed error rather than by Triton at the first launch."""
        pow2 = (1, 2, 4, 8, 16)
        bad = [f"{name}={value!r} ({why})" for name, value, ok, why in (
            ("block_n", self.block_n, self.block_n > 0 and self.block_n % PAGE_TOKENS == 0, "a positive multiple of 16"),
            ("num_warps", self.num_warps, self.num_warps in pow2, "1, 2, 4, 8 or 16"),
            ("num_stages", self.num_stages, self.num_stages >= 1, ">= 1"),
            ("waves", self.waves, self.waves >= 1, ">= 1"),
            ("rope_waves", self.rope_waves, self.rope_waves >= 0, ">= 0"),
            ("min_split_tokens", self.min_split_tokens, self.min_split_tokens >= 1, ">= 1"),
            ("reg_lut_bits", self.reg_lut_bits, 0 <= self.reg_lut_bits <= 8, "0 to 8"),
            ("gluon_min_work", self.gluon_min_work, self.gluon_min_work >= 0, ">= 0"),
            ("gluon_rope_min_work", self.gluon_rope_min_work, self.gluon_rope_min_work >= 0, ">= 0"),
            ("gluon_warps", self.gluon_warps, self.gluon_warps in pow2, "1, 2, 4, 8 or 16"),
            ("gluon_rope_warps", self.gluon_rope_warps, self.gluon_rope_warps in pow2, "1, 2, 4, 8 or 16"),
            ("gluon_maxnreg", self.gluon_maxnreg, self.gluon_maxnreg == 0 or 24 <= self.gluon_maxnreg <= 255,
             "0 or 24 to 255"),
            ("gluon_ahead", self.gluon_ahead, self.gluon_ahead in (0, 1, 2, 3), "0 to 3"),
            ("gluon_rope_hoist", self.gluon_rope_hoist, self.gluon_rope_hoist in (0, 1, 2, 3, 4), "0 to 4"),
            ("gluon_rope_chains", self.gluon_rope_chains, self.gluon_rope_chains in (1, 2), "1 or 2"),
            # 2 or 4 slots per warp, as built and measured (8 would not fit beside q4's tables at 16
            # warps; 1 and 3 compile but never ran on a GPU)
            ("gluon_stages", self.gluon_stages, self.gluon_stages in (0, 2, 4), "0, 2 or 4"),
        ) if not ok]
        if bad:
            raise InvalidArgumentError("KernelConfig: " + "; ".join(bad))

    def v_padded(self, has_rope: bool) -> bool:
        """Whether the compact Gluon kernel pads V's staged row pairs at a launch with (``has_rope``)
        or without the rotary term (``gluon_v_pad``, ``gluon_rope_v_pad``)."""
        return self.gluon_v_pad or (has_rope and self.gluon_rope_v_pad)


# Chosen on the H200 (2026-11-30) by `bench_decode_attention.py --tune`: the best geometric-mean time
# over four grid points among the sweep in that script (benchmarks/results/decode_attention.json).
# The split geometry of bf16, fp8 and compact pages (2 programs per multiprocessor, splits of at least
# 2048 tokens) since session 13: the best geometric mean of each of the four kinds swept (bf16, fp8,
# q4, q3) over the 8 points of the issue-5 grid among 9 (waves, min_split_tokens) pairs
# (`benchmarks/results/box/s13_run04/split_sweep.json`): against the previous 4 (8 for fp8) x 1024,
# 3% (bf16), 17% (fp8), 7% (q4) and 8% (q3) less time; fp8 at 70B TP8 batch 8 x 128k 0.316 -> 0.145 ms
# (1024 splits of 1024 tokens, each program's fixed cost dominating). Since session 21 the planner
# keeps the count of programs within waves x multiprocessors (`_fit_split`; the even share rounded
# up to whole splits of each sequence had given up to 25% more): compact 9-10% less time in geometric
# mean over that grid at 2 waves (`box/s21_run03/plan_ab.json`), fp8 9% at 1 wave.
DEFAULT_CONFIGS = {
    PAGE_BF16: KernelConfig(block_n=128, num_warps=4, num_stages=2, waves=2, min_split_tokens=2048),
    # fp8: the Gluon kernel where it applies, at any step size (H200, `box/dec_fp8gluon.json`,
    # `box/s10_run31/dec_fp8_small.json`: 0.59-0.90 of the read bandwidth against the Triton kernel's
    # 0.44-0.54 from batch 8 x 32k x 8 heads up; at 70B TP8 batch 8 as fast or 3% faster), else the
    # Triton kernel with these fields
    # 1 program per multiprocessor since session 21 (`_fit_split`; `box/s21_run03/plan_ab.json`: against
    # 2, 9% less time in geometric mean over the 16 points of batch 8-64 x 32k/128k at both shapes,
    # 0.146 -> 0.114 ms at 70B TP8 8 x 128k; 8% more at 70B TP8 64 x 128k)
    PAGE_FP8: KernelConfig(block_n=128, num_warps=4, num_stages=3, waves=1, min_split_tokens=2048, gluon=True,
                           gluon_min_work=0),
    # `bench_decode_attention.py --tune-compact` (2026-11-30): 128 tokens/step, 4 warps, 1 stage (the
    # next tile's planes are prefetched by hand; 2 stages would stage the codebook gathers through
    # shared memory), tensor-core products (CUDA-core products 6-11x slower). On the GPU the Gluon
    # kernel runs where it applies: 8 warps, 128 registers, pages staged two deep in shared memory
    # (`benchmarks/results/box/decode_gluon_sweep_warps_s8.json`: the fastest of 6 register settings;
    # `decode_gluon_staged_s9_run1.json`, `decode_gluon_final_s9.json`: staging 1-5% faster, 16 warps
    # slower but at 64 x 128k); with the rotary term 16 warps (`decode_gluon_rope_s9_run*.json`).
    # At any step size since session 22 (as fp8): the Gluon kernel 1.9-2.2x faster than the Triton kernel
    # at every step measured below the old threshold of 2**18 of work, down to 70B TP8 batch 1 x 32k
    # (2**15; q4 with 132 side tokens, `box/s22_run03/probe.json`); with that threshold the formats' side
    # tokens (fewer paged tokens) had put 70B TP8 batch 8 x 32k on the Triton kernel. At 2**18 and up
    # (session 13, `box/s13_run01/dec_small.json`) 6-18% faster, 1.33-1.36x at 70B TP8 8 x 128k.
    # The lazy max by a warp vote (session 30, H100 A/B, bit-identical output): 0.995-1.13x for q4, q3.5, q3
    # (BENCHMARKS.md). The rotary term from tables, at any step size (session 40, H100 A/B against the
    # direct form: 1.26-1.78x where the Gluon kernel ran, 1.84-2.88x below the old 2**22 of work, where
    # the Triton kernel ran; GPU tests against the reference passed). The padding columns' rotary
    # records not loaded (session 44, H100 A/B: the same output bit for bit, 1.016x over 6 cases at 8B,
    # 0.999-1.032x; the shared-memory pipe 94.4% -> 88.8% of its peak under Nsight Compute). V padded
    # where the rotary term runs (session 45, H100 A/B at q4: 1.011-1.112x in 12 rotary cases at the 8B
    # and 70B TP8 shapes, bit-identical; 0.907-1.002x without the term, which stays unpadded). With V
    # padded the kernel waits on issue, not on the shared pipe, and the term's fold (Q in the padding
    # columns, groups up to 4; it takes precedence over the skip) pays: 1.024x over 20 cases on an H100,
    # 0.991-1.058x at 8B (session 45; the same sums as gluon_rope_chains=2, not bit-identical to the
    # tables alone: another fp32 rounding, within the same tolerance of the reference). Steps planned
    # with the rotary term (``plan(rope=True)``) fill one wave: only one of its 16-warp programs fits a
    # multiprocessor, so 2 waves ran as two in sequence (session 46, H100 A/B, q4 with 24 and 64 pairs,
    # 10 cases at 8B and 70B TP8 batch 8-64: 1.096x in geometric mean, 0.999-1.321x, 1.28-1.32x at 70B
    # TP8 8 x 128k; splits of at least 4096 tokens instead 0.80-1.01x).
    PAGE_COMPACT: KernelConfig(block_n=128, num_warps=4, num_stages=1, waves=2, min_split_tokens=2048, gluon=True,
                               gluon_min_work=0, gluon_vote=True, gluon_rope_table=True, gluon_rope_min_work=0,
                               gluon_rope_skip_pad=True, gluon_rope_v_pad=True, gluon_rope_fold=True, rope_waves=1),
    # `bench_kv_exact.py --tune` (2026-11-30): 32 tokens per step, 4 warps, 2 stages
    PAGE_EXACT: KernelConfig(block_n=32, num_warps=4, num_stages=2, waves=4, min_split_tokens=1024),
    # KV Exact4: `bench_kv_exact.py --format exact4 --tune` (H200, session 14): 32 tokens per step, 4
    # warps, 1 stage (box/s14_run06: 16 tokens 1.4x slower, 64 tokens 1.15x (8 warps) to 2.5x (4
    # warps); s14_run03: 8 warps at 32 tokens 1.7x; s14_run10: register caps 1.9-2.2x)
    # On the GPU since session 23 the Gluon kernel (``kv_exact4_gluon``; 4 warps, pages staged one ahead,
    # no register cap) for head_dim 64 or 128 and groups up to 8: 2.2-2.3x the Triton kernel's speed at
    # batch 8-64 x 32k-128k on the H200 (`box/s23_run04`: 0.88-0.92x the faster bf16 kernel against
    # 0.40x; 8 warps within 1%, a cap of 168 registers 1-3% slower), 1.00-1.06x at 11 of 12 points
    # since session 24 (`box/s24_run08`); the Triton kernel elsewhere, with the fields above
    PAGE_EXACT4: KernelConfig(block_n=32, num_warps=4, num_stages=1, waves=2, min_split_tokens=2048, gluon=True,
                              gluon_min_work=0, gluon_warps=4, gluon_stages=2, gluon_maxnreg=0),
}


# ----------------------------------------------------------------------------------------------------
# Kernels
# ----------------------------------------------------------------------------------------------------


@triton.jit
def _load_page_tile(pages_ptr, blk, slot, head, stride_blk, stride_head, stride_slot, valid,
                    HEAD_DIM: tl.constexpr, PAGE_TYPE: tl.constexpr):
    """Load and dequantize ``BLOCK_N`` tokens of one KV head (``blk``/``slot``: per token) as a bf16
    tile ``[BLOCK_N, HEAD_DIM]``. fp8 codes convert exactly; the per-head scale is applied by the
    caller to the fp32 products."""
    offs_d = tl.arange(0, HEAD_DIM)
    ptrs = (pages_ptr + blk.to(tl.int64)[:, None] * stride_blk + head * stride_head
            + slot[:, None] * stride_slot + offs_d[None, :])
    x = tl.load(ptrs, mask=valid[:, None], other=0.0)
    if PAGE_TYPE == 1:
        x = x.to(tl.bfloat16)
    return x


@triton.jit
def _compact_plane(pages_ptr, pbase, valid, p, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, NP: tl.constexpr):
    """Bit plane ``p`` of ``NP`` whole compact pages of one KV head as int32 words [16 NP, HEAD_DIM / 32]
    (word m of a token row: byte i bit j = bit p of the code of channel 32 m + 8 i + j); ``pbase``
    [NP]: each page's offset in bytes (a multiple of 16); tokens not ``valid`` read as 0. The address
    arithmetic is per page, not per token."""
    return _compact_rows(pages_ptr, pbase, valid, p * (16 * (HEAD_DIM // 32)), HEAD_DIM // 32, HEAD_DIM // 32, NP)


@triton.jit
def _compact_nibbles(pages_ptr, pbase, valid, HEAD_DIM: tl.constexpr, NP: tl.constexpr):
    """The nibble rows of ``NP`` width-4 pages as int32 words [16 NP, HEAD_DIM / 8] (word q of a token
    row: nibble j = the code of channel 8 q + j); as ``_compact_plane`` otherwise."""
    return _compact_rows(pages_ptr, pbase, valid, 0, HEAD_DIM // 8, HEAD_DIM // 8, NP)


@triton.jit
def _compact_rows(pages_ptr, pbase, valid, first, N: tl.constexpr, ROW: tl.constexpr, NP: tl.constexpr):
    """Words ``first`` .. ``first + N - 1`` of 16 rows of ``ROW`` int32 words (row r from word
    ``first + r ROW``) of each of ``NP`` pages (``pbase``: their byte offsets, multiples of 16) as
    [16 NP, N]; rows not ``valid`` read as 0."""
    wptr = pages_ptr.to(tl.pointer_type(tl.int32))
    offs = tl.arange(0, 16)[:, None] * ROW + tl.arange(0, N)[None, :]  # token-in-page x word
    vmask = tl.reshape(tl.broadcast_to(tl.reshape(valid, [NP, 16, 1]), [NP, 16, N]), [NP, 16 * N])
    w = tl.load(wptr + (pbase // 4)[:, None] + first + tl.reshape(offs, [16 * N])[None, :], mask=vmask, other=0)
    return tl.reshape(w, [NP * 16, N])


@triton.jit
def _crumb_codes(wc, wb, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The codes [BLOCK_N, HEAD_DIM] (channel order) of width-3 rows from their crumb words ``wc``
    [BLOCK_N, HEAD_DIM / 16] (word w: channel 16 w + q at bits 2 q, 2 q + 1) and bit-2 words ``wb``
    [BLOCK_N, HEAD_DIM / 32] (``codec.bit2_positions``: channel h HEAD_DIM / 2 + 16 g + 4 k + s at
    bit 8 k + s + 2 (s // 2) + 2 h of word g)."""
    M: tl.constexpr = HEAD_DIM // 32
    low = tl.reshape((wc[:, :, None] >> (2 * tl.arange(0, 16))[None, None, :]) & 3, [BLOCK_N, HEAD_DIM])
    hh = tl.arange(0, 2)[None, :, None, None, None]
    kk = tl.arange(0, 4)[None, None, None, :, None]
    ss = tl.arange(0, 4)[None, None, None, None, :]
    b2 = (wb[:, None, :, None, None] >> (8 * kk + ss + 2 * (ss // 2) + 2 * hh)) & 1  # [N, 2 (h), M (g), 4, 4]
    return low | (tl.reshape(b2, [BLOCK_N, HEAD_DIM]) << 2)


@triton.jit
def _compact_sidx(pages_ptr, pbase, valid, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, NP: tl.constexpr):
    """The u8 scale index of each of the ``16 NP`` tokens of ``NP`` pages, as int32 (0 if not ``valid``)."""
    offs_t = tl.arange(0, 16)
    sptr = pages_ptr + pbase[:, None] + BITS * 2 * HEAD_DIM + offs_t[None, :]
    return tl.load(tl.reshape(sptr, [NP * 16]), mask=valid, other=0).to(tl.int32)


@triton.jit
def _compact_values(w0, w1, w2, w3, w4, sidx, cb_ptr, grid_ptr, head,
                    HEAD_DIM: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr, PAIRS: tl.constexpr,
                    LUT: tl.constexpr = False):
    """From the bit planes ``w0..w{BITS-1}`` (``_compact_plane``; the others unused), or at width 4 the
    nibble-row words ``w0`` (``_compact_nibbles``), and scale indices of ``BLOCK_N`` tokens:
    ``codebook[head, code]`` [BLOCK_N, HEAD_DIM] (bf16 with ``PAIRS``, else the codebook's dtype) and
    each token's ``grid[head, k]`` fp32 [BLOCK_N]; the value attention reads is their fp32 product
    (codec.dequantize).

    Codes come from ``_plane_bytes`` (planes), the nibbles or ``_crumb_codes``. With ``PAIRS`` (widths
    up to 4, bf16 tensor-core operands), ``cb_ptr`` is the int32 pair table of ``compact_pair_table``
    (entry a | b << BITS = bf16 codebook[a] | codebook[b] << 16, the two values of channels 2 k,
    2 k + 1): one gather per two values. With ``LUT`` (compiled only), ``cb_ptr`` is
    ``compact_lut_table``'s and the codebook is looked up in registers (``_lut_lookup``; the tile's
    channels in ``_lut_order``; width 2)."""
    ROW_W: tl.constexpr = HEAD_DIM // 32
    tl.static_assert(not (LUT and BITS > 2), "register tables take width 2 (bit planes) only")
    if BITS == 4:  # nibble rows (``_compact_nibbles``): byte k of word q = codes of channels 8 q + 2 k, + 1
        if PAIRS:
            pcodes = (w0[:, :, None] >> (tl.arange(0, 4) * 8)[None, None, :]) & 0xFF  # [BLOCK_N, D / 8, 4]
            vals = _pair_values(cb_ptr + head * 256, pcodes, BLOCK_N, HEAD_DIM)
        else:
            codes = (w0[:, :, None] >> (tl.arange(0, 8) * 4)[None, None, :]) & 0xF  # [BLOCK_N, D / 8, 8]
            vals = tl.load(cb_ptr + head * 16 + tl.reshape(codes, [BLOCK_N, HEAD_DIM]))
    elif BITS == 3:  # crumb rows and the bit-2 words (``_crumb_codes``)
        codes = _crumb_codes(w0, w1, BLOCK_N, HEAD_DIM)
        if PAIRS:
            ca, cb = tl.split(tl.reshape(codes, [BLOCK_N, HEAD_DIM // 2, 2]))
            vals = _pair_values(cb_ptr + head * 64, ca | (cb << 3), BLOCK_N, HEAD_DIM)
        else:
            vals = tl.load(cb_ptr + head * 8 + codes)
    else:
        y = _plane_bytes(w0, w1, w2, w3, w4, BITS)
        if LUT:
            vals = _lut_lookup(y, cb_ptr, head, HEAD_DIM, BITS, BLOCK_N)
        elif PAIRS:
            ii = tl.arange(0, 4) * 8
            ya, yb = tl.split(tl.reshape(y, [BLOCK_N, ROW_W, 4, 2]))
            pc = ya | (yb << BITS)  # byte i: pair code of channels 8 i + 2 k, + 1
            pcodes = (pc[:, :, None, :] >> ii[None, None, :, None]) & 0xFF  # [BLOCK_N, ROW_W, 4 (i), 4 (k)]
            vals = _pair_values(cb_ptr + head * (1 << (2 * BITS)), pcodes, BLOCK_N, HEAD_DIM)
        else:
            vals = tl.load(cb_ptr + head * (1 << BITS) + _byte_codes(y, BLOCK_N, HEAD_DIM))
    g = tl.load(grid_ptr + head * 256 + sidx)
    return vals, g


@triton.jit
def _pair_values(table_ptr, pcodes, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The bf16 tile [BLOCK_N, HEAD_DIM] of the pair codes ``pcodes`` (channel pairs in channel order)
    gathered from a ``compact_pair_table`` row: each entry's low half, then its high half."""
    pv = tl.load(table_ptr + pcodes)
    lo = (pv & 0xFFFF).to(tl.int16).to(tl.bfloat16, bitcast=True)
    hi = (pv >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.reshape(tl.join(lo, hi), [BLOCK_N, HEAD_DIM])


# _lut_lookup's PTX: $4 holds four codes (one per byte, < 8) of channels 32 m + 8 i + j, i = 0..3;
# $5, $6 the table's low-byte words, $9, $10 its high-byte words ($7, $8, $11, $12 unused); $0..$3
# the bf16 values of the four codes. The codes become prmt selector nibbles. (A 16-entry variant,
# two picks and a merge per byte, ran 13-21% slower than the pair tables on the H200 and was dropped
# when width-4 pages became nibble rows; eight codes per call, as nibbles made from the planes
# directly, compiled to more instructions and ran 9% slower: BENCHMARKS.md.)
_LUT_SEL = """{
.reg .b32 a, b, s, t, u, lo, hi, p, q;
shr.b32 a, $4, 4;
or.b32 s, $4, a;
and.b32 s, s, 0x00FF00FF;
shr.b32 a, s, 8;
or.b32 s, s, a;
"""
_LUT_OUT = """prmt.b32 p, lo, hi, 0x5140;
prmt.b32 q, lo, hi, 0x7362;
mov.b32 {$0, $1}, p;
mov.b32 {$2, $3}, q;
}"""
_LUT_ASM_8 = tl.constexpr(_LUT_SEL + """prmt.b32 lo, $5, $6, s;
prmt.b32 hi, $9, $10, s;
""" + _LUT_OUT)
_LUT_CONSTRAINTS = tl.constexpr(",".join(["=h"] * 4 + ["r"] * 9))
_LUT_DTYPES = tl.constexpr((tl.bfloat16,) * 4)


@triton.jit
def _lut_lookup(y, lut_ptr, head, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, BLOCK_N: tl.constexpr):
    """The codebook values of ``_plane_bytes``'s codes ``y`` looked up in registers (compiled only:
    inline PTX): ``lut_ptr`` is ``compact_lut_table``'s int32 [H, 8] (the low bytes of the bf16
    codebook entries 4 r..4 r + 3 in word r, their high bytes in word 4 + r). Each int32 of ``y``
    holds four codes, one per byte; ``prmt`` picks their values' bytes out of the table words (one
    pick per byte; codebooks of up to 8 entries): four values cost about 11 instructions and no
    memory access.

    The tile [BLOCK_N, HEAD_DIM] comes out in ``_lut_order`` (the position m * 32 + j * 4 + a * 2 + b
    holds channel 32 m + 8 (a + 2 b) + j): q is read in that order and the output written back from
    it, so the products see the same pairs of values as in channel order (the fp32 sums may round
    differently)."""
    lb = lut_ptr + head * 8
    args = [y, tl.load(lb), tl.load(lb + 1), tl.load(lb + 2), tl.load(lb + 3),
            tl.load(lb + 4), tl.load(lb + 5), tl.load(lb + 6), tl.load(lb + 7)]
    tl.static_assert(BITS <= 2, "register tables take width 2 (bit planes) only")
    v0, v1, v2, v3 = tl.inline_asm_elementwise(_LUT_ASM_8, _LUT_CONSTRAINTS, args, dtype=_LUT_DTYPES,
                                               is_pure=True, pack=1)
    return _lut_tile(v0, v1, v2, v3, BLOCK_N, HEAD_DIM)


@triton.jit
def _lut_tile(v0, v1, v2, v3, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The tile [BLOCK_N, HEAD_DIM] from ``_lut_lookup``'s four outputs [BLOCK_N, HEAD_DIM / 32, 8]
    (v_i: channels 32 m + 8 i + j): [.., j, i % 2, i // 2], so channel 32 m + 8 i + j sits at
    position m * 32 + j * 4 + (i % 2) * 2 + i // 2 (``_lut_order``)."""
    return tl.reshape(tl.join(tl.join(v0, v1), tl.join(v2, v3)), [BLOCK_N, HEAD_DIM])


@triton.jit
def _lut_order(HEAD_DIM: tl.constexpr):
    """The channel at each position of ``_lut_lookup``'s tiles: [HEAD_DIM]."""
    pos = tl.arange(0, HEAD_DIM)
    m = pos // 32
    j = (pos // 4) % 8
    a = (pos // 2) % 2
    b = pos % 2
    return m * 32 + 8 * (a + 2 * b) + j


@triton.jit
def _plane_bytes(w0, w1, w2, w3, w4, BITS: tl.constexpr):
    """From the bit planes w0..w{BITS-1} [rows, HEAD_DIM / 32] (``_compact_plane``; the others
    unused): [rows, HEAD_DIM / 32, 8], entry j of word m holding in its byte i the code of channel
    32 m + 8 i + j. For each bit j, ``((P_p >> j) & 0x01010101) << p`` OR-ed over the planes puts
    four codes in four bytes: one shift and one and-or per plane for four codes."""
    jj = tl.arange(0, 8)
    y = (w0[:, :, None] >> jj[None, None, :]) & 0x01010101
    if BITS > 1:
        y = y | (((w1[:, :, None] >> jj[None, None, :]) & 0x01010101) << 1)
    if BITS > 2:
        y = y | (((w2[:, :, None] >> jj[None, None, :]) & 0x01010101) << 2)
    if BITS > 3:
        y = y | (((w3[:, :, None] >> jj[None, None, :]) & 0x01010101) << 3)
    if BITS > 4:
        y = y | (((w4[:, :, None] >> jj[None, None, :]) & 0x01010101) << 4)
    return y


@triton.jit
def _byte_codes(y, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """The codes of ``_plane_bytes`` one per channel: int32 [BLOCK_N, HEAD_DIM]."""
    ii = tl.arange(0, 4) * 8
    codes = (y[:, :, None, :] >> ii[None, None, :, None]) & 0xFF  # [BLOCK_N, ROW_W, 4 (i), 8 (j)]
    return tl.reshape(codes, [BLOCK_N, HEAD_DIM])


@triton.jit
def _compact_planes(pages_ptr, pbase, valid, HEAD_DIM: tl.constexpr, BITS: tl.constexpr, NP: tl.constexpr):
    """All bit planes (widths 2 and 5; unused ones are zeros), or at width 4 the nibble rows as ``w0``,
    at width 3 the crumb words as ``w0`` and the bit-2 words as ``w1``; and the scale indices of ``NP``
    pages."""
    zero = tl.zeros([NP * 16, HEAD_DIM // 32], dtype=tl.int32)
    w1 = zero
    w2 = zero
    w3 = zero
    w4 = zero
    if BITS == 4:
        w0 = _compact_nibbles(pages_ptr, pbase, valid, HEAD_DIM, NP)
    elif BITS == 3:  # crumb words, then the bit-2 words of each row
        w0 = _compact_rows(pages_ptr, pbase, valid, 0, HEAD_DIM // 16, 3 * HEAD_DIM // 32, NP)
        w1 = _compact_rows(pages_ptr, pbase, valid, HEAD_DIM // 16, HEAD_DIM // 32, 3 * HEAD_DIM // 32, NP)
    else:
        w0 = _compact_plane(pages_ptr, pbase, valid, 0, HEAD_DIM, BITS, NP)
        w1 = _compact_plane(pages_ptr, pbase, valid, 1, HEAD_DIM, BITS, NP)
    if BITS > 4:
        w2 = _compact_plane(pages_ptr, pbase, valid, 2, HEAD_DIM, BITS, NP)
        w3 = _compact_plane(pages_ptr, pbase, valid, 3, HEAD_DIM, BITS, NP)
        w4 = _compact_plane(pages_ptr, pbase, valid, 4, HEAD_DIM, BITS, NP)
    return w0, w1, w2, w3, w4, _compact_sidx(pages_ptr, pbase, valid, HEAD_DIM, BITS, NP)


@triton.jit
def _rows_of_pages(x, NP: tl.constexpr):
    """A per-page vector [NP] repeated for each of the page's 16 token rows: [16 NP]."""
    return tl.reshape(tl.broadcast_to(x[:, None], [NP, 16]), [NP * 16])


@triton.jit
def _popc(x, FAST: tl.constexpr):
    """Bits set in each int32 (the SM's popc; SWAR arithmetic in the interpreter)."""
    if FAST:
        return tl.inline_asm_elementwise("popc.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=True, pack=1)
    else:
        u = x.to(tl.uint32, bitcast=True)
        u = u - ((u >> 1) & 0x55555555)
        u = (u & 0x33333333) + ((u >> 2) & 0x33333333)
        u = (u + (u >> 4)) & 0x0F0F0F0F
        return ((u * 0x01010101) >> 24).to(tl.int32)


@triton.jit
def _exact_load(heap_ptr, poff, valid, head, num_heads, HEAD_DIM: tl.constexpr, NP: tl.constexpr):
    """The loads of ``16 NP`` tokens of one KV head from ``NP`` KV Exact pages (kv_exact_ref; ``poff``
    [NP] int64: each page's byte offset in the heap, a multiple of 16): code planes w0..w2 [16 NP,
    HEAD_DIM / 32] int32, raw bytes [16 NP, HEAD_DIM] int32, and each row's exception-list address
    [16 NP] int64. A page is read whole when any of its rows is ``valid`` (an exception's place in the
    list counts the escapes of every earlier row)."""
    BLOCK_N: tl.constexpr = NP * 16
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, BLOCK_N) % 16
    pvalid = tl.max(tl.reshape(valid, [NP, 16]).to(tl.int32), axis=1) > 0
    rowv = _rows_of_pages(pvalid, NP)
    hdr = (4 * (num_heads + 1) + 15) // 16 * 16
    poff = tl.multiple_of(poff, 16)  # (the kernel's contract; so the loads below are 16-byte wide)
    hbase = tl.multiple_of(poff + hdr + head * (22 * HEAD_DIM), 16)
    w0 = _compact_plane(heap_ptr, hbase, rowv, 0, HEAD_DIM, 3, NP)
    w1 = _compact_plane(heap_ptr, hbase, rowv, 1, HEAD_DIM, 3, NP)
    w2 = _compact_plane(heap_ptr, hbase, rowv, 2, HEAD_DIM, 3, NP)
    rbase = tl.multiple_of(_rows_of_pages(hbase + 6 * HEAD_DIM, NP) + offs_t * HEAD_DIM, 16)
    raw = tl.load(heap_ptr + rbase[:, None] + offs_d[None, :], mask=rowv[:, None], other=0).to(tl.int32)
    ex = tl.load(heap_ptr.to(tl.pointer_type(tl.int32)) + (poff + 4 * head) // 4, mask=pvalid, other=0)
    return w0, w1, w2, raw, _rows_of_pages(poff + ex, NP)


@triton.jit
def _exact_decode(heap_ptr, w0, w1, w2, raw, erow, valid, head, base_ptr, HEAD_DIM: tl.constexpr,
                  NP: tl.constexpr, FAST: tl.constexpr):
    """The bf16 tile [16 NP, HEAD_DIM] from ``_exact_load``'s planes, raw bytes and exception rows;
    rows not ``valid`` are zero.

    Codes from the three bit planes (``_plane_bytes``, as compact pages); exponent =
    base - code, or for code 7 (bit b of ``w0 & w1 & w2``'s word m is channel 32 m + b) the exception
    byte at rank r of the head's list: r = escapes in earlier rows of the page (a 16-row prefix sum of
    the rows' popcounts) + in earlier words of the row + popc(mask & (2^b - 1)) in the word. (A
    version working on [16 NP, HEAD_DIM / 32, 32] without the reshapes ran 1.3x slower on the H200.)"""
    BLOCK_N: tl.constexpr = NP * 16
    offs_d = tl.arange(0, HEAD_DIM)
    codes = _byte_codes(_plane_bytes(w0, w1, w2, w2, w2, 3), BLOCK_N, HEAD_DIM)
    m = w0 & w1 & w2  # escape bits
    wc = _popc(m, FAST)  # [BLOCK_N, ROW_W]
    row_tot = tl.reshape(tl.sum(wc, axis=1), [NP, 16])
    row_pre = tl.reshape(tl.cumsum(row_tot, axis=1) - row_tot, [BLOCK_N])
    word_pre = tl.cumsum(wc, axis=1) - wc
    sh = tl.arange(0, 32)[None, None, :]
    below = _popc(m[:, :, None] & ~(-1 << sh), FAST)  # [BLOCK_N, ROW_W, 32]
    rank = tl.reshape(below + word_pre[:, :, None], [BLOCK_N, HEAD_DIM]) + row_pre[:, None]
    esc = codes == 7
    e_esc = tl.load(heap_ptr + erow[:, None] + rank, mask=esc & valid[:, None], other=0).to(tl.int32)
    base = tl.load(base_ptr + head * HEAD_DIM + offs_d).to(tl.int32)
    e = tl.where(esc, e_esc, base[None, :] - codes)
    bits = ((raw & 0x80) << 8) | (e << 7) | (raw & 0x7F)
    if FAST:
        # A copy the compiler may not look through (not pure): Triton picks the tensor-core operand
        # layout (kWidth) from the narrowest load behind a dot operand, here the uint8 raw bytes,
        # which would give these tiles (and q) another k order inside each mma than bf16 pages get,
        # so other fp32 roundings. Behind the copy the tiles count as 16-bit values, as bf16 pages.
        bits = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [bits], dtype=tl.int32, is_pure=False, pack=1)
    x = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    return tl.where(valid[:, None], x, 0.0)


# _exact4_pair_ptx's PTX (four pairs): eight values of one token row, channels 8 m + r ($0..$7, bf16 bits) from the
# code word $8 (channel 8 m + r at bit 16 (r % 2) + 4 (r // 2)), the raw bytes $9 (channels 0-3) and
# $10 (4-7) and the window tops $11 (0-3) and $12 (4-7), two channels per 32-bit lane pair: k = the
# pair's codes << 7 (one shift and mask), t = their tops << 7 (a byte permute and a shift, or given
# ready: ``lanes``), e = t - k (no borrow: top >= 15 >= code), lanes with code 15 cleared (exponent
# 0: k + 0x7880 reaches bit 15 exactly there, which a sign-replicating byte permute spreads over the
# lane), and the sign / mantissa bits from a sign-replicating byte permute of the raw bytes. Eight
# instructions per two values (ten with the tops).
def _exact4_pair_ptx(p: int, words: bool = False, lanes: bool = False) -> str:
    """Pair ``p`` (channels 8 m + 2 p and 8 m + 2 p + 1). ``words``: the two values as one u32 (low
    half the first) in output $p, the inputs from $4 (``kv_exact4_codec``'s decoder). ``lanes``: the
    inputs after the raw words are the four pairs' tops << 7 in 16-bit lanes, not the two top words
    (``kv_exact4_codec._top_lanes``, once per channel for all 16 rows)."""
    a = 4 if words else 8  # the first input operand
    src_code = f"shl.b32 k, ${a}, {7 - 4 * p};" if p < 2 else f"shr.u32 k, ${a}, {4 * p - 7};"
    raw, sel = (f"${a + 1}", f"${a + 2}")[p // 2], ("0x9180", "0xB3A2")[p % 2]
    if lanes:
        top = f"mov.b32 t, ${a + 3 + p};"
    else:
        tword, tsel = (f"${a + 3}", f"${a + 4}")[p // 2], ("0x4140", "0x4342")[p % 2]
        top = f"prmt.b32 t, {tword}, 0, {tsel};\nshl.b32 t, t, 7;"
    out = f"mov.b32 ${p}, e;" if words else f"mov.b32 {{${2 * p}, ${2 * p + 1}}}, e;"
    return f"""{src_code}
and.b32 k, k, 0x07800780;
{top}
sub.u32 e, t, k;
add.u32 z, k, 0x78807880;
prmt.b32 z, z, 0, 0xBB99;
prmt.b32 x, {raw}, 0, {sel};
and.b32 x, x, 0x807F807F;
lop3.b32 e, e, z, x, 0xBA;
{out}
"""


def exact4_asm(words: bool = False, lanes: bool = False) -> str:
    """The PTX of ``_exact4_pair_ptx``'s four pairs: eight values of a token row's code word."""
    return "{\n.reg .b32 k, t, e, z, x;\n" + "".join(_exact4_pair_ptx(p, words, lanes) for p in range(4)) + "}"


_EXACT4_ASM = tl.constexpr(exact4_asm())
_EXACT4_CONSTRAINTS = tl.constexpr(",".join(["=h"] * 8 + ["r"] * 5))
_EXACT4_DTYPES = tl.constexpr((tl.int16,) * 8)


@triton.jit
def _exact4_load(heap_ptr, prow, valid, head, num_heads, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr):
    """The loads of ``BLOCK_N`` tokens (whole pages) of one KV head from KV Exact4 pages
    (kv_exact4_ref), each row on its own: ``prow`` [BLOCK_N] int64 the byte offset of each row's page
    (a multiple of 16), ``valid`` [BLOCK_N] the rows wanted. Returns int32 words [BLOCK_N, HEAD_DIM /
    8], word m of a row holding what channels 8 m .. 8 m + 7 need: the codes (all 15 in rows not
    ``valid``, so they decode to zeros), the raw bytes and the window tops of channels 8 m .. 8 m + 3
    and of 8 m + 4 .. 8 m + 7 (the rows' halves, kv_exact4_ref.half_order); and the head's header
    entry [BLOCK_N] (plain-row mask, plain rows before the head). A head's slot sits at a fixed
    place in its page, so no address depends on another load of the page; every tensor has the same
    shape, so one layout serves them all (no conversions through shared memory); the tops are read
    once per row (from L1 after the first)."""
    WR: tl.constexpr = HEAD_DIM // 8  # words per row and half-row
    I32: tl.constexpr = tl.pointer_type(tl.int32)
    offs_w = tl.arange(0, WR)[None, :]
    t = tl.arange(0, BLOCK_N) % 16
    prow = tl.multiple_of(prow, 16)  # (the kernel's contract; so the loads below are 16-byte wide)
    entry = tl.load((heap_ptr + prow + 4 * head).to(I32), mask=valid, other=0)
    hb = tl.multiple_of(prow + (4 * num_heads + 15) // 16 * 16 + head * (25 * HEAD_DIM), 16)
    vm = valid[:, None]
    # (rows not valid: tops 15, so their codes 15 decode to +0.0 in the compiled path's lane
    # arithmetic too, where a top below the code would borrow across the lanes)
    t0 = tl.load((heap_ptr + hb).to(I32)[:, None] + offs_w, mask=vm, other=0x0F0F0F0F)
    t1 = tl.load((heap_ptr + hb + HEAD_DIM // 2).to(I32)[:, None] + offs_w, mask=vm, other=0x0F0F0F0F)
    w = tl.load((heap_ptr + (hb + HEAD_DIM + t * (HEAD_DIM // 2))).to(I32)[:, None] + offs_w, mask=vm, other=-1)
    rb = hb + 9 * HEAD_DIM + t * HEAD_DIM
    r0 = tl.load((heap_ptr + rb).to(I32)[:, None] + offs_w, mask=vm, other=0)
    r1 = tl.load((heap_ptr + rb + HEAD_DIM // 2).to(I32)[:, None] + offs_w, mask=vm, other=0)
    return w, r0, r1, t0, t1, entry


@triton.jit
def _word_bytes(lo, hi, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr):
    """Channels 8 m + 4 h + b of words [BLOCK_N, HEAD_DIM / 8] (``lo``: h = 0, ``hi``: h = 1; byte b,
    little endian) as int32 [BLOCK_N, HEAD_DIM]."""
    jj = tl.arange(0, 4) * 8
    x = tl.join(lo, hi)  # [BLOCK_N, WR, 2]
    return tl.reshape((x[:, :, :, None] >> jj[None, None, None, :]) & 0xFF, [BLOCK_N, HEAD_DIM])


@triton.jit
def _exact4_decode(heap_ptr, w, r0, r1, t0, t1, entry, prow, valid, num_heads, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, FAST: tl.constexpr):
    """The bf16 tile [BLOCK_N, HEAD_DIM] from ``_exact4_load``'s words and masks (rows not ``valid``
    come out zero: their codes are all 15 and their raw bytes 0). Code of channel 8 m + r: the
    nibble of word m at bit 16 (r % 2) + 4 (r // 2); exponent = top - code, or 0 for code 15; bits =
    sign << 15 | exponent << 7 | mantissa. Compiled, eight values at a time in inline PTX
    (``_exact4_pair_ptx``, on pairs of 16-bit lanes); in the interpreter the same math per value.
    Plain rows (rare) are read as bf16, from after the slots at the row's rank (its head entry's
    count plus the mask bits below it), by loads predicated on the row: a tile without any costs
    instructions, not bytes."""
    offs_d = tl.arange(0, HEAD_DIM)
    if FAST:
        a0, a1, a2, a3, a4, a5, a6, a7 = tl.inline_asm_elementwise(
            _EXACT4_ASM, _EXACT4_CONSTRAINTS, [w, r0, r1, t0, t1], dtype=_EXACT4_DTYPES, is_pure=True, pack=1)
        # channel 8 m + r at position r of word m's eight (the joins nest with the last index inside)
        x = tl.reshape(tl.join(tl.join(tl.join(a0, a4), tl.join(a2, a6)), tl.join(tl.join(a1, a5), tl.join(a3, a7))),
                       [BLOCK_N, HEAD_DIM]).to(tl.bfloat16, bitcast=True)
    else:
        rr = tl.arange(0, 8)
        sh = (rr % 2) * 16 + (rr // 2) * 4
        code = tl.reshape((w[:, :, None] >> sh[None, None, :]) & 15, [BLOCK_N, HEAD_DIM])
        e = tl.where(code == 15, 0, _word_bytes(t0, t1, BLOCK_N, HEAD_DIM) - code)
        r = _word_bytes(r0, r1, BLOCK_N, HEAD_DIM)
        bits = ((r & 0x80) << 8) | (e << 7) | (r & 0x7F)
        x = bits.to(tl.int16).to(tl.bfloat16, bitcast=True)
    t = tl.arange(0, BLOCK_N) % 16
    rowp = (((entry >> t) & 1) != 0) & valid
    rank = ((entry >> 16) & 0xFFFF) + _popc(entry & ((1 << t) - 1) & 0xFFFF, FAST)
    row = tl.multiple_of(prow + (4 * num_heads + 15) // 16 * 16 + num_heads * (25 * HEAD_DIM)
                         + rank.to(tl.int64) * (2 * HEAD_DIM), 16)
    pb = tl.load((heap_ptr + row).to(tl.pointer_type(tl.bfloat16))[:, None] + offs_d[None, :],
                 mask=rowp[:, None], other=0.0)
    x = tl.where(rowp[:, None], pb, x)
    if FAST:
        # A copy the compiler may not look through (not pure), as in _exact_decode: Triton picks the
        # tensor-core operand layout (kWidth) from what it finds behind an operand (the loads' widths,
        # halved by the joins above), which would give these tiles (and q) another k order inside each
        # mma than bf16 pages get, so other fp32 roundings. Behind the copy they are bf16 pages' tiles.
        x = tl.inline_asm_elementwise("mov.b32 $0, $1;", "=r,r", [x], dtype=tl.bfloat16, is_pure=False, pack=2)
    return x


@triton.jit
def _bf16_split_dot(x, y):
    """x [M, K] . y [N, K]^T in fp32 with bf16 tensor-core products at about fp32 accuracy: each
    operand split as hi + lo (two bf16), three products (hi.hi + hi.lo + lo.hi)."""
    xh = x.to(tl.bfloat16)
    xl = (x - xh.to(tl.float32)).to(tl.bfloat16)
    yh = y.to(tl.bfloat16)
    yl = (y - yh.to(tl.float32)).to(tl.bfloat16)
    return tl.dot(xh, tl.trans(yh)) + tl.dot(xh, tl.trans(yl)) + tl.dot(xl, tl.trans(yh))


@triton.jit
def _cos_sin(x, FAST: tl.constexpr):
    """cos and sin of fp32 angles; FAST: the SFU's approximations (cos.approx / sin.approx, absolute
    error about 1e-6 near [-pi, pi], growing slowly with |x|); else Triton's (the interpreter's)."""
    if FAST:
        c = tl.inline_asm_elementwise("cos.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
        s = tl.inline_asm_elementwise("sin.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        c = tl.cos(x)
        s = tl.sin(x)
    return c, s


@triton.jit
def _rope_logits(coef_ptr, phase_ptr, pairs_ptr, n_pairs, coef_rows, g_valid, start, offs_n, BLOCK_G: tl.constexpr,
                 BLOCK_N: tl.constexpr, HALF: tl.constexpr, NCHUNK: tl.constexpr, FAST: tl.constexpr):
    """q . r(p) for the tile's keys (rotary offsets), p = start + n: sum over RoPE pairs i of
    A_i cos(phi_i(p)) + B_i sin(phi_i(p)). Only the ``n_pairs`` pairs listed at ``pairs_ptr`` (those
    with an offset in some KV head of the layer: the others have A = B = 0), 16 per chunk, NCHUNK
    chunks; a listed index outside [0, HALF) is clamped (no read out of bounds). The tile start's
    phase comes exactly from the 48-bit phase start * f_i (int64, 16 values per chunk); the angle at
    start + n adds n * theta_i in fp32 (n < BLOCK_N); coef rows hold A then B [2, HALF]."""
    acc = tl.zeros([BLOCK_G, BLOCK_N], dtype=tl.float32)
    s64 = tl.zeros([1], dtype=tl.int64) + start
    nf = offs_n.to(tl.float32)[:, None]
    for c in tl.static_range(NCHUNK):
        j = c * 16 + tl.arange(0, 16)
        jv = j < n_pairs
        offs_i = tl.minimum(tl.maximum(tl.load(pairs_ptr + j, mask=jv, other=0), 0), HALF - 1)
        f = tl.load(phase_ptr + offs_i)
        ph = ((((s64 * (f >> 16)) & 0xFFFFFFFF) << 16) + s64 * (f & 0xFFFF)) & 0xFFFFFFFFFFFF
        base = (ph >> 16).to(tl.float32) * 1.4629180792671596e-09  # 2 pi / 2**32
        theta = f.to(tl.float32) * 2.2321073814882276e-14  # 2 pi / 2**48
        cs, sn = _cos_sin(base[None, :] + nf * theta[None, :], FAST)
        m = g_valid[:, None] & jv[None, :]
        a = tl.load(coef_ptr + coef_rows[:, None] + offs_i[None, :], mask=m, other=0.0)
        b = tl.load(coef_ptr + coef_rows[:, None] + HALF + offs_i[None, :], mask=m, other=0.0)
        acc += _bf16_split_dot(a, cs) + _bf16_split_dot(b, sn)
    return acc


@triton.jit
def _paged_split_kernel(
    q_ptr, bias_ptr, k_pages_ptr, v_pages_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr,
    work_seq_ptr, work_start_ptr, work_end_ptr,
    ws_m_ptr, ws_l_ptr, ws_acc_ptr,
    k_cb_ptr, v_cb_ptr, k_grid_ptr, v_grid_ptr,
    rope_coef_ptr, rope_phase_ptr, rope_pairs_ptr, n_rope_pairs, k_off_ptr, v_off_ptr,
    qk_scale,  # sm_scale * log2(e)
    stride_qb, stride_qh,
    stride_kb, stride_kh, stride_kt,
    stride_vb, stride_vh, stride_vt,
    stride_bt,
    num_kv_heads,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr, PAGE_TYPE: tl.constexpr, HAS_BIAS: tl.constexpr,
    BITS_K: tl.constexpr, BITS_V: tl.constexpr, CUDA_DOT: tl.constexpr,
    PAIRS_K: tl.constexpr = False, PAIRS_V: tl.constexpr = False, HAS_ROPE: tl.constexpr = False,
    ROPE_CHUNKS: tl.constexpr = 0,
    FAST_TRIG: tl.constexpr = False,  # compiled only: SFU cos/sin (rotary term) and popc (exact pages)
    REG_LUT: tl.constexpr = False,  # compiled only: compact codebooks in registers (``_lut_lookup``)
):
    """One split: attention of the GROUP query heads of one KV head over page tokens
    ``[start, end)`` of one sequence. Writes the running max (base 2), the softmax mass and the
    unnormalized fp32 sum of p * y (transformed domain) to the workspace."""
    item = tl.program_id(0)
    head = tl.program_id(1)
    seq = tl.load(work_seq_ptr + item)
    t0 = tl.load(work_start_ptr + item)
    t1 = tl.load(work_end_ptr + item)

    offs_g = tl.arange(0, BLOCK_G)
    if REG_LUT:  # q, the K and V tiles and the output in _lut_lookup's channel order
        offs_d = _lut_order(HEAD_DIM)
    else:
        offs_d = tl.arange(0, HEAD_DIM)
    offs_n = tl.arange(0, BLOCK_N)
    g_valid = offs_g < GROUP
    q_rows = seq.to(tl.int64) * stride_qb + (head * GROUP + offs_g) * stride_qh
    q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=g_valid[:, None], other=0.0)
    if CUDA_DOT:
        q = q.to(tl.float32)
    else:
        q = q.to(tl.bfloat16)

    scale = qk_scale
    if PAGE_TYPE == 1:
        scale = scale * tl.load(k_scale_ptr + head)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + seq * (num_kv_heads * GROUP) + head * GROUP + offs_g,
                       mask=g_valid, other=0.0) * qk_scale
    else:
        bias = tl.zeros([BLOCK_G], dtype=tl.float32)

    coef_rows = (seq * (num_kv_heads * GROUP) + head * GROUP + offs_g).to(tl.int64) * HEAD_DIM
    m_i = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    bt_row = block_tables_ptr + seq.to(tl.int64) * stride_bt

    lo = t0 - t0 % BLOCK_N  # tiles stay aligned to BLOCK_N, so a tile is whole pages
    # The block ids of the next tile are loaded one iteration ahead: with the K/V addresses no longer
    # depending on a load of the same iteration, Triton's pipeliner keeps num_stages - 1 K/V tiles in
    # flight (shared memory grows with num_stages); without it, one (and fp8 ran no faster than bf16).
    NP: tl.constexpr = BLOCK_N // 16
    offs_p = tl.arange(0, NP) * 16
    PB_K: tl.constexpr = 16 * (BITS_K * HEAD_DIM // 8 + 1)  # bytes of a compact page
    PB_V: tl.constexpr = 16 * (BITS_V * HEAD_DIM // 8 + 1)
    if PAGE_TYPE == 2:
        # Compact: block ids per page (a tile is whole pages). The bit planes and scale indices of
        # the next tile are loaded one iteration ahead into registers (software pipelining by hand:
        # Triton's pipeliner would also stage the codebook gathers through shared memory), so the
        # HBM latency of a tile overlaps the decoding and products of the one before.
        pg0 = lo + offs_p
        blk0 = tl.load(bt_row + pg0 // BLOCK_SIZE, mask=(pg0 + 16 > t0) & (pg0 < t1), other=0)
        tok0 = lo + offs_n
        valid0 = (tok0 >= t0) & (tok0 < t1)
        pib = (pg0 % BLOCK_SIZE) // 16
        kb = blk0.to(tl.int64) * stride_kb + head * stride_kh + pib * PB_K
        vb = blk0.to(tl.int64) * stride_vb + head * stride_vh + pib * PB_V
        kw0, kw1, kw2, kw3, kw4, ks = _compact_planes(k_pages_ptr, kb, valid0, HEAD_DIM, BITS_K, NP)
        vw0, vw1, vw2, vw3, vw4, vs = _compact_planes(v_pages_ptr, vb, valid0, HEAD_DIM, BITS_V, NP)
        pg1 = lo + BLOCK_N + offs_p
        blk_next = tl.load(bt_row + pg1 // BLOCK_SIZE, mask=pg1 < t1, other=0)
    elif PAGE_TYPE == 3:
        # KV Exact: one page per block (BLOCK_SIZE 16). Software pipelining by hand, as for compact
        # pages: the next tile's planes, raw bytes and exception rows are loaded one iteration ahead,
        # its page offsets two ahead and its block ids three ahead; only the exception bytes (whose
        # addresses depend on the codes) are loaded in the iteration that uses them.
        pg0 = lo + offs_p
        tok0 = lo + offs_n
        valid0 = (tok0 >= t0) & (tok0 < t1)
        blk0 = tl.load(bt_row + pg0 // 16, mask=(pg0 + 16 > t0) & (pg0 < t1), other=0)
        pg1 = pg0 + BLOCK_N
        blk1 = tl.load(bt_row + pg1 // 16, mask=pg1 < t1, other=0)
        kw0, kw1, kw2, kraw, kerow = _exact_load(k_pages_ptr, tl.load(k_off_ptr + blk0), valid0, head,
                                                 num_kv_heads, HEAD_DIM, NP)
        vw0, vw1, vw2, vraw, verow = _exact_load(v_pages_ptr, tl.load(v_off_ptr + blk0), valid0, head,
                                                 num_kv_heads, HEAD_DIM, NP)
        koff_next = tl.load(k_off_ptr + blk1)
        voff_next = tl.load(v_off_ptr + blk1)
        pg2 = pg1 + BLOCK_N
        blk_next = tl.load(bt_row + pg2 // 16, mask=pg2 < t1, other=0)
    elif PAGE_TYPE == 4:
        # KV Exact4: every address per token row (no per-page vectors, whose broadcasts to rows would
        # go through shared memory); block ids three tiles ahead, page offsets two, the loads one
        tok0 = lo + offs_n
        valid0 = (tok0 >= t0) & (tok0 < t1)
        blk0 = tl.load(bt_row + tok0 // 16, mask=(tok0 - tok0 % 16 + 16 > t0) & (tok0 < t1), other=0)
        tok1 = tok0 + BLOCK_N
        blk1 = tl.load(bt_row + tok1 // 16, mask=tok1 < t1, other=0)
        kpo = tl.load(k_off_ptr + blk0)
        vpo = tl.load(v_off_ptr + blk0)
        kw, kr0, kr1, kt0, kt1, kent = _exact4_load(k_pages_ptr, kpo, valid0, head, num_kv_heads, HEAD_DIM, BLOCK_N)
        vw, vr0, vr1, vt0, vt1, vent = _exact4_load(v_pages_ptr, vpo, valid0, head, num_kv_heads, HEAD_DIM, BLOCK_N)
        koff_next = tl.load(k_off_ptr + blk1)
        voff_next = tl.load(v_off_ptr + blk1)
        tok2 = tok1 + BLOCK_N
        blk_next = tl.load(bt_row + tok2 // 16, mask=tok2 < t1, other=0)
    else:
        tok0 = lo + offs_n
        blk_next = tl.load(bt_row + tok0 // BLOCK_SIZE, mask=(tok0 >= t0) & (tok0 < t1), other=0)
    for start in range(lo, t1, BLOCK_N):
        tok = start + offs_n
        valid = (tok >= t0) & (tok < t1)
        blk = blk_next
        if PAGE_TYPE == 2:
            # issue the next tile's loads, then the block ids of the one after
            pgn = start + BLOCK_N + offs_p
            tokn = tok + BLOCK_N
            validn = tokn < t1
            pib = (pgn % BLOCK_SIZE) // 16
            kb = blk.to(tl.int64) * stride_kb + head * stride_kh + pib * PB_K
            vb = blk.to(tl.int64) * stride_vb + head * stride_vh + pib * PB_V
            nk0, nk1, nk2, nk3, nk4, nks = _compact_planes(k_pages_ptr, kb, validn, HEAD_DIM, BITS_K, NP)
            nv0, nv1, nv2, nv3, nv4, nvs = _compact_planes(v_pages_ptr, vb, validn, HEAD_DIM, BITS_V, NP)
            pg2 = pgn + BLOCK_N
            blk_next = tl.load(bt_row + pg2 // BLOCK_SIZE, mask=pg2 < t1, other=0)
            # Compact pages: value = codebook[code] * grid[k]; the per-token scale multiplies the
            # fp32 logits (K) and the softmax weights (V), so the products see codebook values only.
            k, k_g = _compact_values(kw0, kw1, kw2, kw3, kw4, ks, k_cb_ptr, k_grid_ptr, head,
                                     HEAD_DIM, BITS_K, BLOCK_N, PAIRS_K, REG_LUT)
            v, v_g = _compact_values(vw0, vw1, vw2, vw3, vw4, vs, v_cb_ptr, v_grid_ptr, head,
                                     HEAD_DIM, BITS_V, BLOCK_N, PAIRS_V, REG_LUT)
            kw0, kw1, kw2, kw3, kw4, ks = nk0, nk1, nk2, nk3, nk4, nks
            vw0, vw1, vw2, vw3, vw4, vs = nv0, nv1, nv2, nv3, nv4, nvs
            if CUDA_DOT:
                s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
            else:
                s = tl.dot(q, tl.trans(k))
            s = s * (k_g * scale)[None, :] + bias[:, None]
            if HAS_ROPE:
                s += _rope_logits(rope_coef_ptr, rope_phase_ptr, rope_pairs_ptr, n_rope_pairs, coef_rows, g_valid,
                                  start, offs_n, BLOCK_G, BLOCK_N, HEAD_DIM // 2, ROPE_CHUNKS, FAST_TRIG) * qk_scale
        elif PAGE_TYPE == 3:
            validn = (tok + BLOCK_N) < t1
            nk0, nk1, nk2, nkraw, nkerow = _exact_load(k_pages_ptr, koff_next, validn, head, num_kv_heads, HEAD_DIM, NP)
            nv0, nv1, nv2, nvraw, nverow = _exact_load(v_pages_ptr, voff_next, validn, head, num_kv_heads, HEAD_DIM, NP)
            koff_next = tl.load(k_off_ptr + blk)
            voff_next = tl.load(v_off_ptr + blk)
            pg3 = start + 3 * BLOCK_N + offs_p
            blk_next = tl.load(bt_row + pg3 // 16, mask=pg3 < t1, other=0)
            # the same bf16 tiles as the uncompressed cache's, so everything after is the bf16 path
            k = _exact_decode(k_pages_ptr, kw0, kw1, kw2, kraw, kerow, valid, head, k_cb_ptr, HEAD_DIM, NP, FAST_TRIG)
            v = _exact_decode(v_pages_ptr, vw0, vw1, vw2, vraw, verow, valid, head, v_cb_ptr, HEAD_DIM, NP, FAST_TRIG)
            kw0, kw1, kw2, kraw, kerow = nk0, nk1, nk2, nkraw, nkerow
            vw0, vw1, vw2, vraw, verow = nv0, nv1, nv2, nvraw, nverow
            s = tl.dot(q, tl.trans(k)) * scale + bias[:, None]
        elif PAGE_TYPE == 4:
            validn = (tok + BLOCK_N) < t1
            nk = _exact4_load(k_pages_ptr, koff_next, validn, head, num_kv_heads, HEAD_DIM, BLOCK_N)
            nv = _exact4_load(v_pages_ptr, voff_next, validn, head, num_kv_heads, HEAD_DIM, BLOCK_N)
            nkpo = koff_next
            nvpo = voff_next
            koff_next = tl.load(k_off_ptr + blk)
            voff_next = tl.load(v_off_ptr + blk)
            tok3 = tok + 3 * BLOCK_N
            blk_next = tl.load(bt_row + tok3 // 16, mask=tok3 < t1, other=0)
            k = _exact4_decode(k_pages_ptr, kw, kr0, kr1, kt0, kt1, kent, kpo, valid, num_kv_heads, HEAD_DIM,
                               BLOCK_N, FAST_TRIG)
            v = _exact4_decode(v_pages_ptr, vw, vr0, vr1, vt0, vt1, vent, vpo, valid, num_kv_heads, HEAD_DIM,
                               BLOCK_N, FAST_TRIG)
            kw, kr0, kr1, kt0, kt1, kent = nk
            vw, vr0, vr1, vt0, vt1, vent = nv
            kpo = nkpo
            vpo = nvpo
            s = tl.dot(q, tl.trans(k)) * scale + bias[:, None]
        else:
            tok_next = tok + BLOCK_N
            blk_next = tl.load(bt_row + tok_next // BLOCK_SIZE, mask=tok_next < t1, other=0)
            slot = tok % BLOCK_SIZE
            k = _load_page_tile(k_pages_ptr, blk, slot, head, stride_kb, stride_kh, stride_kt, valid,
                                HEAD_DIM, PAGE_TYPE)
            v = _load_page_tile(v_pages_ptr, blk, slot, head, stride_vb, stride_vh, stride_vt, valid,
                                HEAD_DIM, PAGE_TYPE)
            s = tl.dot(q, tl.trans(k)) * scale + bias[:, None]
        s = tl.where(valid[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if PAGE_TYPE == 2:
            pv = p * v_g[None, :]
            if CUDA_DOT:
                acc = acc * alpha[:, None] + tl.sum(pv[:, :, None] * v[None, :, :], axis=1)
            else:
                acc = acc * alpha[:, None] + tl.dot(pv.to(tl.bfloat16), v)
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v)
        m_i = m_new

    if PAGE_TYPE == 1:
        acc = acc * tl.load(v_scale_ptr + head)
    ws_row = item * num_kv_heads * GROUP + head * GROUP + offs_g
    tl.store(ws_m_ptr + ws_row, m_i, mask=g_valid)
    tl.store(ws_l_ptr + ws_row, l_i, mask=g_valid)
    tl.store(ws_acc_ptr + ws_row.to(tl.int64)[:, None] * HEAD_DIM + offs_d[None, :], acc,
             mask=g_valid[:, None])


def merge_launch(group: int, head_dim: int, block_g: int, transform: bool, side: bool, programs: int,
                 sms: int) -> tuple[int, int, int]:
    """The merge kernel's splits a step (BLOCK_I), warps and column blocks (programs per sequence
    and KV head, each writing ``head_dim / blocks`` output columns), for ``programs`` (sequence, KV
    head) pairs on ``sms`` multiprocessors. H200, group x head_dim 8 x 128 and 4 x 128, kernel time
    by graph replay (`box/s22_run02`, `s22_run05`; 70B TP8 and 8B, batch 8-64 x 32k):
    - no inverse V transform, no side tokens: one program of one warp, 4 splits a step (1.8-3.2 us);
    - the transform (a 128 x 128 fp32 product): 4 column blocks of one warp, 4 splits a step, 6.2-9.9
      us at batch 8 where one program of 4 warps and 16 splits took 11-17 (8 blocks spill), 6-16 us
      at batch 16-64 (as before or better);
    - the compact formats' 132 side tokens: 8 blocks of one warp, 4 splits a step (2 warps and 8
      without the transform), the side products split by V's columns, the scores computed in each:
      9.5-12.5 us with the transform at 70B batch 8-64 (14.5-20.2 before), 5.7-6.1 without
      (10.8-27.5); but each block reads all of K's side tokens, and from 8B batch 16 (128 pairs) one
      program of 4 warps, 16 splits a step is faster (15-45 us against 17-63): 8 blocks only while
      pairs x 8 <= 4 x sms.
    Wider shapes (one warp spilled 390-6200 bytes at 16 x 128 and up) keep 4 warps, 4 splits a step
    and one program. A block is at least 16 columns wide (the products' smallest tile)."""
    if group * head_dim > 8 * 128:
        return max(1, 64 // block_g), 4, 1
    if not transform and not side:
        return 4, 1, 1
    if side and programs * 8 > 4 * sms:
        return max(1, (256 if transform else 64) // block_g), 4, 1
    block_i, warps, blocks = (4, 1, 8 if side else 4) if transform else (8, 2, 8)
    return block_i, warps, max(1, min(blocks, head_dim // 16))


@triton.jit
def _merge_kernel(
    q_ptr, k_side_ptr, v_side_ptr, seq_lens_ptr, item_indptr_ptr,
    ws_m_ptr, ws_l_ptr, ws_acc_ptr, v_inv_ptr, v_mean_ptr, out_ptr,
    qk_scale,
    stride_qb, stride_qh,
    stride_sb, stride_st, stride_sh,
    stride_ob, stride_oh,
    num_kv_heads,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_DIM: tl.constexpr,
    SINKS: tl.constexpr, WINDOW: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_I: tl.constexpr,
    HAS_V_TRANSFORM: tl.constexpr, HAS_V_MEAN: tl.constexpr, BLOCK_C: tl.constexpr,
):
    """Per (sequence, KV head, block of BLOCK_C output columns): log-sum-exp merge of the page
    splits, the inverse transform and mean of the page part, then the side tokens (sinks and recent
    window, bf16) in the same softmax. The page part is merged over all HEAD_DIM columns where the
    transform mixes them, else over the block's; the side tokens' scores use every column of q and K."""
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    offs_c = tl.program_id(2) * BLOCK_C + tl.arange(0, BLOCK_C)  # the output columns
    g_valid = offs_g < GROUP

    m_i = tl.full([BLOCK_G], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    if HAS_V_TRANSFORM:
        offs_m = offs_d  # the columns merged
        acc = tl.zeros([BLOCK_G, HEAD_DIM], dtype=tl.float32)
    else:
        offs_m = offs_c
        acc = tl.zeros([BLOCK_G, BLOCK_C], dtype=tl.float32)
    i0 = tl.load(item_indptr_ptr + seq)
    i1 = tl.load(item_indptr_ptr + seq + 1)
    offs_i = tl.arange(0, BLOCK_I)
    # BLOCK_I splits per step, so that a (sequence, head) with many splits is not a chain of
    # dependent small loads.
    for c0 in range(i0, i1, BLOCK_I):
        it = c0 + offs_i
        ok = (it < i1)[:, None] & g_valid[None, :]
        row = it[:, None] * (num_kv_heads * GROUP) + head * GROUP + offs_g[None, :]
        m_s = tl.load(ws_m_ptr + row, mask=ok, other=NEG_BIG)
        l_s = tl.load(ws_l_ptr + row, mask=ok, other=0.0)
        a_s = tl.load(ws_acc_ptr + row.to(tl.int64)[:, :, None] * HEAD_DIM + offs_m[None, None, :],
                      mask=ok[:, :, None], other=0.0)
        m_new = tl.maximum(m_i, tl.max(m_s, axis=0))
        alpha = tl.exp2(m_i - m_new)
        beta = tl.exp2(m_s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(l_s * beta, axis=0)
        acc = acc * alpha[:, None] + tl.sum(a_s * beta[:, :, None], axis=0)
        m_i = m_new

    if HAS_V_TRANSFORM:
        a_ptrs = v_inv_ptr + head * HEAD_DIM * HEAD_DIM + offs_d[:, None] * HEAD_DIM + offs_c[None, :]
        acc = tl.dot(acc, tl.load(a_ptrs), input_precision="ieee")
    if HAS_V_MEAN:
        mu = tl.load(v_mean_ptr + head * HEAD_DIM + offs_c)
        acc = acc + l_i[:, None] * mu[None, :]

    if SINKS + WINDOW > 0:
        length = tl.load(seq_lens_ptr + seq)
        q_rows = seq.to(tl.int64) * stride_qb + (head * GROUP + offs_g) * stride_qh
        q = tl.load(q_ptr + q_rows[:, None] + offs_d[None, :], mask=g_valid[:, None], other=0.0)
        q = q.to(tl.bfloat16)
        win_lo = tl.maximum(length - WINDOW, SINKS)  # window positions [win_lo, length)
        n_win = length - win_lo
        offs_s = tl.arange(0, BLOCK_S)
        for s0 in range(0, SINKS + WINDOW, BLOCK_S):
            slot = s0 + offs_s
            is_sink = (slot < SINKS) & (slot < length)
            if WINDOW > 0:
                r = slot - SINKS
                is_win = (slot >= SINKS) & (slot < SINKS + WINDOW) & (((r - win_lo % WINDOW) + WINDOW) % WINDOW < n_win)
                ok = is_sink | is_win
            else:
                ok = is_sink
            offs = seq.to(tl.int64) * stride_sb + slot[:, None] * stride_st + head * stride_sh
            k = tl.load(k_side_ptr + offs + offs_d[None, :], mask=ok[:, None], other=0.0)
            v = tl.load(v_side_ptr + offs + offs_c[None, :], mask=ok[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k)) * qk_scale
            s = tl.where(ok[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.bfloat16), v)
            m_i = m_new

    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # l_i is 0 only in padding rows (g >= GROUP)
    o_rows = seq.to(tl.int64) * stride_ob + (head * GROUP + offs_g) * stride_oh
    tl.store(out_ptr + o_rows[:, None] + offs_c[None, :], o.to(out_ptr.dtype.element_ty),
             mask=g_valid[:, None])


@triton.jit
def _dequantize_pages_kernel(pages_ptr, scale_ptr, out_ptr, stride_blk, stride_head, stride_slot,
                             BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_TYPE: tl.constexpr):
    """The values the attention kernel reads, as fp32 ``[num_blocks, kv_heads, block_size, head_dim]``
    (through the same ``_load_page_tile`` step): for testing that they equal the reference decoder's."""
    blk_id = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    slot = tl.program_id(2) * 16 + tl.arange(0, 16)  # one 16-token page per program
    blk = tl.zeros([16], dtype=tl.int32) + blk_id
    valid = slot < BLOCK_SIZE
    x = _load_page_tile(pages_ptr, blk, slot, head, stride_blk, stride_head, stride_slot, valid,
                        HEAD_DIM, PAGE_TYPE).to(tl.float32)
    if PAGE_TYPE == 1:
        x = x * tl.load(scale_ptr + head)
    offs_d = tl.arange(0, HEAD_DIM)
    row = (blk_id.to(tl.int64) * num_heads + head) * BLOCK_SIZE + slot
    tl.store(out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], x)


@triton.jit
def _dequantize_compact_kernel(pages_ptr, cb_ptr, grid_ptr, out_ptr, stride_blk, stride_head,
                               BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BITS: tl.constexpr,
                               PAIRS: tl.constexpr):
    """The values the attention kernel reads from compact pages, fp32 ``codebook[code] * grid[k]``
    through the same ``_compact_planes``/``_compact_values`` steps, as ``[num_blocks, kv_heads, block_size, head_dim]``."""
    blk_id = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    pg = tl.program_id(2)
    slot = pg * 16 + tl.arange(0, 16)
    valid = slot < BLOCK_SIZE
    pbase = (tl.zeros([1], dtype=tl.int64) + blk_id.to(tl.int64) * stride_blk + head * stride_head
             + pg * (16 * (BITS * HEAD_DIM // 8 + 1)))
    w0, w1, w2, w3, w4, sidx = _compact_planes(pages_ptr, pbase, valid, HEAD_DIM, BITS, 1)
    vals, g = _compact_values(w0, w1, w2, w3, w4, sidx, cb_ptr, grid_ptr, head, HEAD_DIM, BITS, 16, PAIRS)
    x = vals.to(tl.float32) * g[:, None]
    offs_d = tl.arange(0, HEAD_DIM)
    row = (blk_id.to(tl.int64) * num_heads + head) * BLOCK_SIZE + slot
    tl.store(out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], x)


@triton.jit
def _dequantize_exact_kernel(heap_ptr, off_ptr, base_ptr, out_ptr, num_heads, n_pages, HEAD_DIM: tl.constexpr,
                             NP: tl.constexpr, FAST: tl.constexpr):
    """The bf16 bits the attention kernel reads from KV Exact pages ``NP * program_id(0) ..`` (at
    ``off_ptr[page]``), head ``program_id(1)``, through the same ``_exact_load``/``_exact_decode``
    (``NP`` pages per tile, as the attention kernel's ``BLOCK_N / 16``), into int16 ``[n, 16, H, D]``."""
    pg = tl.program_id(0) * NP + tl.arange(0, NP)
    head = tl.program_id(1)
    pok = pg < n_pages
    poff = tl.load(off_ptr + pg, mask=pok, other=0)
    valid = _rows_of_pages(pok, NP)
    w0, w1, w2, raw, erow = _exact_load(heap_ptr, poff, valid, head, num_heads, HEAD_DIM, NP)
    x = _exact_decode(heap_ptr, w0, w1, w2, raw, erow, valid, head, base_ptr, HEAD_DIM, NP, FAST)
    offs_n = tl.arange(0, NP * 16)
    offs_d = tl.arange(0, HEAD_DIM)
    row = (_rows_of_pages(pg.to(tl.int64), NP) * 16 + offs_n % 16) * num_heads + head
    tl.store(out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], x.to(tl.int16, bitcast=True), mask=valid[:, None])


@triton.jit
def _dequantize_exact4_kernel(heap_ptr, off_ptr, out_ptr, num_heads, n_pages, HEAD_DIM: tl.constexpr,
                              NP: tl.constexpr, FAST: tl.constexpr):
    """The bf16 bits the attention kernel reads from KV Exact4 pages ``NP * program_id(0) ..``, head
    ``program_id(1)``, through the same ``_exact4_load``/``_exact4_decode``, into int16 ``[n, 16, H, D]``."""
    offs_n = tl.arange(0, NP * 16)
    pg = (tl.program_id(0) * NP + offs_n // 16).to(tl.int64)
    head = tl.program_id(1)
    valid = pg < n_pages
    prow = tl.load(off_ptr + pg, mask=valid, other=0)
    w, r0, r1, t0, t1, entry = _exact4_load(heap_ptr, prow, valid, head, num_heads, HEAD_DIM, NP * 16)
    x = _exact4_decode(heap_ptr, w, r0, r1, t0, t1, entry, prow, valid, num_heads, HEAD_DIM, NP * 16, FAST)
    offs_d = tl.arange(0, HEAD_DIM)
    row = (pg * 16 + offs_n % 16) * num_heads + head
    tl.store(out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], x.to(tl.int16, bitcast=True), mask=valid[:, None])


# ----------------------------------------------------------------------------------------------------
# Host side: plan once per step, run per layer
# ----------------------------------------------------------------------------------------------------


def _pow2_at_least(n: int, floor: int) -> int:
    return max(floor, 1 << max(0, (int(n) - 1).bit_length()))


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise InvalidArgumentError(msg)


def _check_query(q, num_kv_heads: int) -> None:
    """The query helpers' q: [num_seqs, num_q_heads, head_dim], num_q_heads a multiple of num_kv_heads."""
    _check(isinstance(q, torch.Tensor) and q.dim() == 3, "q must be [num_seqs, num_q_heads, head_dim]")
    _check(isinstance(num_kv_heads, (int, np.integer)) and num_kv_heads > 0 and q.shape[1] % num_kv_heads == 0,
           f"num_q_heads ({q.shape[1]}) must be a positive multiple of num_kv_heads ({num_kv_heads})")


def rope_logit_coef(q: torch.Tensor, k_rope_m: torch.Tensor, num_kv_heads: int) -> torch.Tensor:
    """The per-query coefficients of the rotary-offset logit term: q . r(p) = sum_i A_i cos(phi_i(p)) +
    B_i sin(phi_i(p)) with A_i = q_a m_a + q_b m_b and B_i = q_b m_a - q_a m_b over RoPE pairs
    (a, b) = (i, i + d/2). q [num_seqs, num_q_heads, d]; k_rope_m [num_kv_heads, d] (the pre-RoPE key
    means in the model's units: ``compact_tables(...)["k_rope_m"]``). Returns fp32 [num_seqs,
    num_q_heads, 2, d/2] (A then B)."""
    _check_query(q, num_kv_heads)
    b_, hq, d = q.shape
    _check(d % 2 == 0, f"q's head_dim must be even (RoPE pairs), not {d}")
    _check(isinstance(k_rope_m, torch.Tensor) and tuple(k_rope_m.shape) == (num_kv_heads, d),
           f"k_rope_m must be [{num_kv_heads}, {d}]")
    g = hq // num_kv_heads
    qf = q.double().reshape(b_, num_kv_heads, g, 2, d // 2)
    m = k_rope_m.double().reshape(num_kv_heads, 1, 2, d // 2)
    qa, qb = qf[..., 0, :], qf[..., 1, :]
    ma, mb = m[..., 0, :], m[..., 1, :]
    coef = torch.stack([qa * ma + qb * mb, qb * ma - qa * mb], dim=-2)  # [b, h, g, 2, d/2]
    return coef.reshape(b_, hq, 2, d // 2).float().contiguous()


def transform_query(q: torch.Tensor, k_inv_transform: torch.Tensor | None, k_mean: torch.Tensor | None,
                    num_kv_heads: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``q'`` and the logit bias ``b`` for pages in a transformed domain (true key = ``y @ A_k + mu_k``):
    ``q' = q @ A_k^T`` and ``b = q . mu_k`` per query head, in fp32.

    q: [num_seqs, num_q_heads, head_dim]; k_inv_transform ``A_k``: [num_kv_heads, head_dim, head_dim] or
    None (identity); k_mean ``mu_k``: [num_kv_heads, head_dim] or None (zero).
    Returns q' [num_seqs, num_q_heads, head_dim] fp32 and b [num_seqs, num_q_heads] fp32 (or None).
    """
    _check_query(q, num_kv_heads)
    b_, hq, d = q.shape
    _check(k_inv_transform is None or (isinstance(k_inv_transform, torch.Tensor)
                                       and tuple(k_inv_transform.shape) == (num_kv_heads, d, d)),
           f"k_inv_transform must be [{num_kv_heads}, {d}, {d}] or None")
    _check(k_mean is None or (isinstance(k_mean, torch.Tensor) and tuple(k_mean.shape) == (num_kv_heads, d)),
           f"k_mean must be [{num_kv_heads}, {d}] or None")
    g = hq // num_kv_heads
    qf = q.float().reshape(b_, num_kv_heads, g, d)
    qt = qf if k_inv_transform is None else torch.einsum("bhgd,hed->bhge", qf, k_inv_transform.float())
    bias = None if k_mean is None else torch.einsum("bhgd,hd->bhg", qf, k_mean.float()).reshape(b_, hq)
    return qt.reshape(b_, hq, d), bias


class PagedDecodeAttention:
    """Decode attention over a paged KV cache (see the module docstring for layout and numerics).

    ``plan()`` once per decode step (the batch's lengths and block tables: it computes the split
    schedule and allocates the workspace), then ``run()`` per layer::

        attn = PagedDecodeAttention(num_q_heads=32, num_kv_heads=8, head_dim=128, page_type="fp8",
                                    device="cuda")
        attn.plan(seq_lens, block_tables)          # seq_lens: ints; block_tables: int32 [B, max_blocks]
        for layer in range(num_layers):
            out = attn.run(q[layer], k_pages[layer], v_pages[layer],
                           k_scale=k_scale[layer], v_scale=v_scale[layer])   # [B, 32, 128] bf16

    q: [num_seqs, num_q_heads, head_dim] (bf16); pages: [num_blocks, num_kv_heads, block_size,
    head_dim] (bf16 or float8_e4m3fn as ``page_type``); k_scale/v_scale (fp8): fp32 [num_kv_heads].
    """

    def __init__(self, num_q_heads: int, num_kv_heads: int, head_dim: int, *, page_type: str = "bf16",
                 block_size: int = 16, sink_tokens: int = 0, window: int = 0,
                 sm_scale: float | None = None, config: KernelConfig | None = None,
                 device: str | torch.device = "cuda", k_bits: int | None = None, v_bits: int | None = None):
        _check(page_type in PAGE_TYPES, f"page_type must be one of {sorted(PAGE_TYPES)}, not {page_type!r}")
        if page_type == "compact":
            _check(k_bits in COMPACT_BITS and v_bits in COMPACT_BITS,
                   f"compact pages need k_bits and v_bits in {COMPACT_BITS}, not {k_bits}, {v_bits}")
        else:
            _check(k_bits is None and v_bits is None, "k_bits/v_bits are for page_type 'compact' only")
        self.k_bits, self.v_bits = k_bits, v_bits
        for name, x in (("num_q_heads", num_q_heads), ("num_kv_heads", num_kv_heads), ("head_dim", head_dim),
                        ("block_size", block_size), ("sink_tokens", sink_tokens), ("window", window)):
            int_arg(name, x, -2**31, 2**31 - 1)  # (an integer; the ranges are checked below)
        _check(config is None or isinstance(config, KernelConfig), "config must be a KernelConfig")
        _check(num_q_heads > 0 and num_kv_heads > 0 and num_q_heads % num_kv_heads == 0,
               f"num_q_heads ({num_q_heads}) must be a positive multiple of num_kv_heads ({num_kv_heads})")
        _check(head_dim in (16, 32, 64, 128, 256), f"head_dim must be 16, 32, 64, 128 or 256, not {head_dim}")
        _check(page_type != "compact" or head_dim >= 32,
               f"compact pages need head_dim >= 32 (bit planes are read as 32-bit words), not {head_dim}")
        _check(block_size > 0 and block_size % PAGE_TOKENS == 0,
               f"block_size must be a positive multiple of {PAGE_TOKENS}, not {block_size}")
        exact = PAGE_TYPES[page_type] in EXACT_PAGES
        _check(not exact or block_size == PAGE_TOKENS,
               f"{page_type} pages: one {PAGE_TOKENS}-token page per block (block_size {PAGE_TOKENS}), not {block_size}")
        _check(not exact or head_dim >= 32, f"{page_type} pages need head_dim >= 32, not {head_dim}")
        _check(page_type != "exact4" or num_kv_heads <= EXACT4_MAX_HEADS,
               f"exact4 pages hold at most {EXACT4_MAX_HEADS} KV heads, not {num_kv_heads}")
        _check(sink_tokens >= 0 and window >= 0, "sink_tokens and window must be >= 0")
        self.page_type = PAGE_TYPES[page_type]
        self.page_type_name = page_type
        self.num_q_heads, self.num_kv_heads, self.head_dim = num_q_heads, num_kv_heads, head_dim
        self.group = num_q_heads // num_kv_heads
        self.block_size, self.sink_tokens, self.window = block_size, sink_tokens, window
        _check(sm_scale is None or (isinstance(sm_scale, numbers.Real) and not isinstance(sm_scale, bool)
                                    and math.isfinite(sm_scale) and sm_scale > 0),
               f"sm_scale must be a positive finite number, not {sm_scale!r:.40}")
        self.sm_scale = 1.0 / math.sqrt(head_dim) if sm_scale is None else float(sm_scale)
        self.config = config or DEFAULT_CONFIGS[self.page_type]
        _check(self.config.block_n % PAGE_TOKENS == 0 and self.config.block_n & (self.config.block_n - 1) == 0,
               f"config.block_n must be a power of two and a multiple of {PAGE_TOKENS}")
        try:
            self.device = torch.device(device)
        except (RuntimeError, TypeError) as e:
            raise InvalidArgumentError(f"device {device!r:.40}: {e}") from None
        self._plan = None
        self._pairs_cache: dict = {}
        self.last_split_kernel: str | None = None

    @staticmethod
    def _device_key(device) -> str:
        """A device's cache key, the same for "cuda" and the current "cuda:N" (plan() gets the
        object's device, run() the tensors')."""
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        return str(device)

    def _ones16(self, device) -> torch.Tensor:
        """16 bytes of 0xFF on ``device`` (the Gluon exact4 kernel's code-15 rows outside a split)."""
        key = ("ones16", self._device_key(device))
        if key not in self._pairs_cache:
            self._pairs_cache[key] = torch.full((16,), 255, dtype=torch.uint8, device=device)
        return self._pairs_cache[key]

    def _all_rope_pairs(self, half: int, device) -> torch.Tensor:
        key = (half, self._device_key(device))
        if key not in self._pairs_cache:
            self._pairs_cache[key] = torch.arange(half, dtype=torch.int32, device=device)
        return self._pairs_cache[key]

    def _pair_order(self, bits: int, device):
        """The Triton kernel's pair table gather index for ``bits`` (code order), made once (plan() makes
        the ones a run needs, so a run captured in a CUDA graph only gathers the tables; the Gluon
        kernel makes its own tables from the codebooks)."""
        key = ("pair_order", bits, self._device_key(device))
        if key not in self._pairs_cache:
            self._pairs_cache[key] = compact_pair_order(bits, device)
        return self._pairs_cache[key]

    # -- plan ------------------------------------------------------------------------------------------
    def _num_sms(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.get_device_properties(self.device).multi_processor_count
        return 4

    def _fit_split(self, spans: np.ndarray, bn: int, waves: int) -> int:
        """The default split: the shortest (a multiple of ``bn``, at least ``config.min_split_tokens``)
        whose items, times the KV heads, fit in ``waves`` programs per multiprocessor. Each
        sequence's span (``spans``: tokens from its first step, 0 for none) is cut into whole splits,
        so the even share of the total can give more programs than that (8 sequences of 128k at
        waves 1: 17 splits each of 8064 tokens, 136 programs on 132 multiprocessors, four of which
        then run two): the split grows until the count fits, or to the longest span (one item a
        sequence, where even that is more)."""
        budget = max(1, self._num_sms() * waves // self.num_kv_heads)

        def steps(n):  # n tokens in whole steps of bn, at least min_split_tokens
            return -(-max(int(n), self.config.min_split_tokens) // bn)

        lo_s = steps(-(-int(spans.sum()) // budget))
        hi_s = max(lo_s, steps(spans.max()))
        while lo_s < hi_s:  # the fewest steps whose items fit (items fall as the split grows)
            mid = (lo_s + hi_s) // 2
            if int((-(-spans // (mid * bn))).sum()) <= budget:
                hi_s = mid
            else:
                lo_s = mid + 1
        return lo_s * bn

    def _slot_trig(self, has_rope: bool, has_pos_table: bool) -> tuple[bool, bool]:
        """Where the Gluon kernel's slots get the pages' cos and sin of the rotary term (staged, from
        tables): (copied with the pages from the table run() was given, KernelConfig.gluon_rope_pos;
        computed once a warp, KernelConfig.gluon_rope_lanes)."""
        cfg = self.config
        staged_table = has_rope and cfg.gluon_rope_table and cfg.gluon_stages > 0
        pos_ok = bool(staged_table and cfg.gluon_rope_pos and has_pos_table)
        return pos_ok, bool(staged_table and cfg.gluon_rope_lanes and not pos_ok)

    def _compact_gluon_applies(self, has_rope: bool, paged_tokens: int, slot_trig: bool) -> bool:
        """Whether a step of ``paged_tokens`` over compact pages runs the Gluon split kernel (with the
        rotary term where ``has_rope``; ``slot_trig``: its slots hold the pages' cos and sin)."""
        cfg, D, G = self.config, self.head_dim, self.group
        return (self.page_type == PAGE_COMPACT and cfg.gluon and not cfg.cuda_dot
                and (cfg.gluon_rope or not has_rope) and not _interpreting()
                and max(self.k_bits, self.v_bits) <= 4
                and D * _pow2_at_least(G, 8) <= GLUON_MAX_ACC
                # with the rotary term, groups up to 8 (wider ones spill 200+ bytes at 16 warps)
                and not (has_rope and G > 8)
                and paged_tokens * self.num_kv_heads >= (cfg.gluon_rope_min_work if has_rope else cfg.gluon_min_work)
                # 2 warps at least, as fp8: only inline PTX touches its shared memory, so with one
                # warp (no cross-warp scratch) ptxas loses the symbol it is addressed by
                and (cfg.gluon_rope_warps if has_rope else cfg.gluon_warps) >= 2
                and _compact_gluon_smem(self.k_bits, self.v_bits, D, cfg, has_rope, G, slot_trig) <= GLUON_MAX_SMEM)

    def plan(self, seq_lens, block_tables: torch.Tensor, *, split_tokens: int | None = None,
             rope: bool = False) -> dict:
        """Split schedule and workspace for one decode step.

        seq_lens: the total length ``L`` of each sequence (side tokens included), ints >= 1, on the host
        (a list, numpy array or tensor). block_tables: int32 [num_seqs, max_blocks] on the device.
        split_tokens: tokens per split (a multiple of ``config.block_n``); default: enough splits to
        fill the GPU with at most ``config.waves`` programs per multiprocessor (``_fit_split``), or
        ``config.rope_waves`` (where positive) with ``rope`` (the step's run() calls pass the rotary
        term, ``rope_coef``/``rope_phase``) where the Gluon kernel with the term will run (compact pages;
        not the Triton kernel, which fits several programs a multiprocessor). ``rope`` sets only the
        split: any run() is correct after any plan(). Returns a summary (items, split size). The block
        tables are copied: changing the tensor after plan() changes nothing that run() reads (plan
        again for a new step).
        """
        _check(isinstance(rope, bool), f"rope must be a bool, not {type(rope).__name__}")
        try:
            raw = np.asarray(seq_lens.cpu() if isinstance(seq_lens, torch.Tensor) else seq_lens)
        except (TypeError, ValueError, RuntimeError) as e:
            raise InvalidArgumentError(f"seq_lens must be a 1-D sequence of integers: {e}") from None
        _check(raw.dtype.kind in "iu" or (raw.size == 0 and raw.dtype.kind == "f"),
               f"seq_lens must be integers, not {raw.dtype}")
        _check(raw.size == 0 or int(raw.max()) < 2**31, "seq_lens must be below 2**31")
        lens = raw.astype(np.int64)
        _check(lens.ndim == 1 and lens.size > 0, "seq_lens must be a non-empty 1-D sequence")
        _check(bool((lens >= 1).all()), "every sequence needs at least one token")
        _check(isinstance(block_tables, torch.Tensor) and block_tables.dtype == torch.int32
               and block_tables.dim() == 2 and block_tables.shape[0] == lens.size,
               f"block_tables must be int32 [num_seqs={lens.size}, max_blocks]")
        _check(block_tables.device == self.device or block_tables.device.type == self.device.type,
               "block_tables must be on the kernel's device")
        # (the kernels read entry j of a row at row + j: a strided view's other entries were never checked)
        _check(block_tables.shape[1] <= 1 or block_tables.stride(1) == 1,
               "block_tables must have contiguous rows (stride(1) == 1)")
        # (a copy: ids checked here cannot change before run(); ids written into the caller's
        # tensor after plan() were read unchecked, an illegal address past the pool)
        block_tables = block_tables.clone()
        bn = self.config.block_n
        S, W = self.sink_tokens, self.window
        lo = S
        hi = lens - W
        n_paged = np.maximum(hi - lo, 0)
        need_blocks = np.where(n_paged > 0, -(-hi // self.block_size), 0)
        _check(int(need_blocks.max()) <= block_tables.shape[1],
               f"block_tables has {block_tables.shape[1]} blocks per sequence; the longest needs "
               f"{int(need_blocks.max())}")
        a0 = (lo // bn) * bn
        spans = np.where(n_paged > 0, hi - a0, 0)  # tokens from each sequence's first step (0: none)
        if split_tokens is None:
            cfg = self.config
            # (the slots' room for cos and sin taken where the config may ask for it: the larger kernel)
            trig = any(self._slot_trig(True, True))
            one_wave = rope and cfg.rope_waves and self._compact_gluon_applies(True, int(n_paged.sum()), trig)
            split_tokens = self._fit_split(spans, bn, cfg.rope_waves if one_wave else cfg.waves)
        split_tokens = -(-int_arg("split_tokens", split_tokens, 1, 2**31 - 1) // bn) * bn
        n_items = -(-spans // split_tokens)
        seq_of = np.repeat(np.arange(lens.size), n_items)
        first = np.repeat(np.cumsum(n_items) - n_items, n_items)
        k = np.arange(seq_of.size) - first
        starts = np.maximum(a0 + k * split_tokens, lo)
        ends = np.minimum(a0 + (k + 1) * split_tokens, hi[seq_of])
        indptr = np.concatenate([[0], np.cumsum(n_items)])
        # Blocks the schedule reads, to check against the pool size in run() without a device sync there.
        max_block = -1
        if seq_of.size:
            cols = torch.arange(block_tables.shape[1], device=block_tables.device)
            used = cols[None, :] < torch.as_tensor(need_blocks, device=block_tables.device)[:, None]
            vals = block_tables[used]
            _check(bool((vals >= 0).all()), "block_tables holds a negative block id in a used position")
            max_block = int(vals.max())
        dev = self.device
        n_tot = max(int(seq_of.size), 1)
        g = self.group
        self._plan = dict(
            num_seqs=int(lens.size),
            device=torch.device(self._device_key(dev)),  # (what run() compares q's device with)
            seq_lens=torch.as_tensor(lens, dtype=torch.int32, device=dev),
            block_tables=block_tables,
            work_seq=torch.as_tensor(seq_of, dtype=torch.int32, device=dev),
            work_start=torch.as_tensor(starts, dtype=torch.int32, device=dev),
            work_end=torch.as_tensor(ends, dtype=torch.int32, device=dev),
            item_indptr=torch.as_tensor(indptr, dtype=torch.int32, device=dev),
            n_items=int(seq_of.size),
            split_tokens=split_tokens,
            paged_tokens=int(n_paged.sum()),
            paged_end=int(np.where(n_paged > 0, hi, 0).max()),  # (the paged tokens' last position + 1)
            max_block=max_block,
            ws_m=torch.empty(n_tot * self.num_kv_heads * g, dtype=torch.float32, device=dev),
            ws_l=torch.empty(n_tot * self.num_kv_heads * g, dtype=torch.float32, device=dev),
            ws_acc=torch.empty(n_tot * self.num_kv_heads * g * self.head_dim, dtype=torch.float32, device=dev),
        )
        if self.page_type == PAGE_COMPACT and dev.type == "cuda":
            for bits in {self.k_bits, self.v_bits} & {2, 3, 4}:  # (the Triton kernel's pair tables)
                self._pair_order(bits, dev)
        return {"items": int(seq_of.size), "split_tokens": split_tokens,
                "paged_tokens": int(n_paged.sum())}

    # -- run -------------------------------------------------------------------------------------------
    def _check_pages(self, name: str, pages: torch.Tensor) -> None:
        want = PAGE_DTYPES[self.page_type]
        _check(isinstance(pages, torch.Tensor) and pages.dtype == want,
               f"{name} must be a {want} tensor for page_type {self.page_type_name!r}")
        if self.page_type in EXACT_PAGES:
            _check(pages.dim() == 1 and pages.is_contiguous() and pages.data_ptr() % 16 == 0,
                   f"{name} ({self.page_type_name}) must be the contiguous 1-D uint8 page heap, 16-byte aligned")
            return
        if self.page_type == PAGE_COMPACT:
            bits = self.k_bits if name == "k_pages" else self.v_bits
            nbytes = compact_page_bytes(bits, self.head_dim)
            shape = (self.num_kv_heads, self.block_size // PAGE_TOKENS, nbytes)
            _check(pages.dim() == 4 and tuple(pages.shape[1:]) == shape,
                   f"{name} ({bits}-bit compact) must be uint8 [num_blocks, {shape[0]}, {shape[1]}, {shape[2]}], "
                   f"not {list(pages.shape)}")
            _check(pages.stride(3) == 1 and pages.stride(2) == nbytes, f"{name}: each block's pages must be contiguous")
            _check(pages.data_ptr() % 16 == 0 and pages.stride(1) % 16 == 0 and pages.stride(0) % 16 == 0,
                   f"{name}: pages must start at 16-byte aligned addresses (read as 32-bit words)")
            _check(self._plan["max_block"] < pages.shape[0],
                   f"block_tables reference block {self._plan['max_block']} but {name} has {pages.shape[0]}")
            return
        _check(pages.dim() == 4 and tuple(pages.shape[1:]) == (self.num_kv_heads, self.block_size, self.head_dim),
               f"{name} must be [num_blocks, {self.num_kv_heads}, {self.block_size}, {self.head_dim}], "
               f"not {list(pages.shape)}")
        _check(pages.stride(3) == 1, f"{name}: head_dim must be contiguous")
        _check(self._plan["max_block"] < pages.shape[0],
               f"block_tables reference block {self._plan['max_block']} but {name} has {pages.shape[0]}")

    def run(self, q: torch.Tensor, k_pages: torch.Tensor, v_pages: torch.Tensor, *,
            k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
            k_side: torch.Tensor | None = None, v_side: torch.Tensor | None = None,
            q_transformed: torch.Tensor | None = None, logit_bias: torch.Tensor | None = None,
            v_inv_transform: torch.Tensor | None = None, v_mean: torch.Tensor | None = None,
            k_codebook: torch.Tensor | None = None, v_codebook: torch.Tensor | None = None,
            k_grid: torch.Tensor | None = None, v_grid: torch.Tensor | None = None,
            rope_coef: torch.Tensor | None = None, rope_phase: torch.Tensor | None = None,
            rope_pairs: torch.Tensor | None = None, rope_pos_table: torch.Tensor | None = None,
            k_offsets: torch.Tensor | None = None, v_offsets: torch.Tensor | None = None,
            k_bases: torch.Tensor | None = None, v_bases: torch.Tensor | None = None,
            out: torch.Tensor | None = None) -> torch.Tensor:
        """Attention output [num_seqs, num_q_heads, head_dim] (q's dtype; or ``out``'s, bf16, fp16 or
        fp32, on q's device) for one layer.

        k_side/v_side: bf16 [num_seqs, sink_tokens + window, num_kv_heads, head_dim] (required when the
        format keeps side tokens). q_transformed [num_seqs, num_q_heads, head_dim] and logit_bias
        [num_seqs, num_q_heads] (fp32; see ``transform_query``) replace q and 0 for page tokens;
        v_inv_transform [num_kv_heads, head_dim, head_dim] and v_mean [num_kv_heads, head_dim] (fp32)
        map the page part of the output back (identity and zero when None).

        Compact pages (``page_type="compact"``, see ``compact_tables``): k_codebook/v_codebook
        [num_kv_heads, 2**bits] (fp32, or bf16 for the tensor-core path) and k_grid/v_grid fp32
        [num_kv_heads, 256]; the pages hold rotated-domain values, so q_transformed, logit_bias,
        v_inv_transform and v_mean carry the codec's transform (``compact_tables`` gives them).
        K tables with rotary offsets (``compact_tables(...)["rope_phase"]``) add ``q . r(p)`` to each page
        key's logit: rope_coef fp32 [num_seqs, num_q_heads, 2, head_dim / 2] (``rope_logit_coef``) and
        rope_phase int64 [head_dim / 2]; the page token at position p of its sequence turns by p * f.
        rope_pairs int32 [P] (``compact_tables(...)["rope_pairs"]``): the pairs with an offset in some
        KV head of the layer; the kernel computes only those (default: all head_dim / 2).
        rope_pos_table fp32 [rows, head_dim / 2, 2] (``rope_page_table(rope_phase, tokens)``, rows * 16 at
        least the planned sequences' paged tokens' end): the pages' cos and sin, which the Gluon kernel
        with ``KernelConfig.gluon_rope_pos`` copies with each page instead of computing; unused otherwise.

        KV Exact pages (``page_type="exact"``, kv_exact_ref): k_pages/v_pages are uint8 heaps (1-D;
        may be one tensor), k_offsets/v_offsets int64 [num_blocks] each block's page offset in its
        heap (a multiple of 16; every block the plan reads must hold a written page), k_bases/v_bases
        uint8 [num_kv_heads, head_dim] the layer's window tops. The tiles are the bf16 values
        bit for bit, so the output equals the bf16 pages' with the same config and plan.
        KV Exact4 pages (``page_type="exact4"``, kv_exact4_ref): heaps and offsets the same way; the
        pages hold their own window tops (no k_bases/v_bases).
        """
        _check(self._plan is not None, "call plan() before run()")
        pl = self._plan
        B, Hq, Hkv, D, G = pl["num_seqs"], self.num_q_heads, self.num_kv_heads, self.head_dim, self.group
        _check(isinstance(q, torch.Tensor) and tuple(q.shape) == (B, Hq, D) and q.stride(2) == 1,
               f"q must be [{B}, {Hq}, {D}] with head_dim contiguous")
        _check(q.dtype in (torch.bfloat16, torch.float16, torch.float32), "q must be bf16, fp16 or fp32")
        self._check_pages("k_pages", k_pages)
        self._check_pages("v_pages", v_pages)
        fp8 = self.page_type == PAGE_FP8
        if fp8:
            for name, t in (("k_scale", k_scale), ("v_scale", v_scale)):
                _check(isinstance(t, torch.Tensor) and t.dtype == torch.float32 and t.numel() == Hkv
                       and t.is_contiguous(), f"{name} must be contiguous fp32 [{Hkv}] for fp8 pages")
        compact = self.page_type == PAGE_COMPACT
        cfg = self.config
        has_rope = rope_coef is not None or rope_phase is not None
        pos_ok, lanes_ok = self._slot_trig(has_rope, rope_pos_table is not None)
        slot_trig = pos_ok or lanes_ok  # (the slots' room for the pages' cos and sin, either way)
        cuda_dot = compact and self.config.cuda_dot
        reg_lut = False  # codebooks in registers
        gluon_cbs = None  # the codebooks the Gluon kernel makes its pair tables from (KernelConfig.gluon)
        # fp8 pages on the Gluon kernel (KernelConfig.gluon)
        # (no logit bias: the kernel has none; 2 warps at least: with one, no Triton op touches shared
        # memory and ptxas loses the symbol the inline PTX addresses it by)
        fp8_stages = max(cfg.gluon_stages, 2)
        # (the fp8 and exact4 Gluon kernels: head_dim 64 or 128 and groups up to 8, the shapes their
        # GPU tests run; others compile for sm_90 but have not run on a GPU)
        gluon_shape = (cfg.gluon and not _interpreting() and logit_bias is None and cfg.gluon_warps >= 2
                       and D in (64, 128) and G <= 8  # (so D x the padded group <= GLUON_MAX_ACC)
                       and pl["paged_tokens"] * Hkv >= cfg.gluon_min_work)
        gluon_fp8 = (fp8 and gluon_shape
                     and all(t.stride(2) == D and t.data_ptr() % 16 == 0 and t.stride(0) % 16 == 0
                             and t.stride(1) % 16 == 0 for t in (k_pages, v_pages)))
        if gluon_fp8:
            from .paged_decode_gluon import fp8_smem_bytes

            gluon_fp8 = fp8_smem_bytes(D, cfg.gluon_warps, fp8_stages) <= GLUON_MAX_SMEM
        # KV Exact4 pages on the Gluon kernel (``kv_exact4_gluon``), and bf16 pages on the same kernel
        # (its bit-for-bit reference) when their config asks for it; the same limits as fp8's
        gluon_x4 = (self.page_type in (PAGE_EXACT4, PAGE_BF16) and gluon_shape
                    and all(t.data_ptr() % 16 == 0 for t in (k_pages, v_pages))
                    and (self.page_type == PAGE_EXACT4
                         or all(t.stride(2) == D and t.stride(0) % 8 == 0 and t.stride(1) % 8 == 0
                                for t in (k_pages, v_pages))))
        if gluon_x4:
            from .kv_exact4_gluon import smem_bytes as x4_smem_bytes

            gluon_x4 = x4_smem_bytes(D, cfg.gluon_warps, fp8_stages, self.page_type == PAGE_BF16) <= GLUON_MAX_SMEM
        if compact:
            for name, t, bits in (("k_codebook", k_codebook, self.k_bits), ("v_codebook", v_codebook, self.v_bits)):
                _check(isinstance(t, torch.Tensor) and t.dtype in (torch.float32, torch.bfloat16)
                       and tuple(t.shape) == (Hkv, 2**bits) and t.is_contiguous(),
                       f"{name} must be contiguous fp32 or bf16 [{Hkv}, {2**bits}]")
            for name, t in (("k_grid", k_grid), ("v_grid", v_grid)):
                _check(isinstance(t, torch.Tensor) and t.dtype == torch.float32
                       and tuple(t.shape) == (Hkv, GRID_SIZE) and t.is_contiguous(),
                       f"{name} must be contiguous fp32 [{Hkv}, {GRID_SIZE}]")
            if self._compact_gluon_applies(has_rope, pl["paged_tokens"], slot_trig):
                # the kernel makes its pair tables from the codebooks (``paged_decode_gluon._fill_tables``:
                # width 4 code order, width 3 crumb order, bit planes interleaved): no host-side ops
                gluon_cbs = (k_codebook, v_codebook)
            elif not cuda_dot:  # tensor-core operands are bf16: codebooks as register byte tables, or
                # (widths <= 4) packed pairs to gather, or bf16 values to gather
                # (register tables read the bit planes' code order: width 2, the only planes up to 4)
                lut_bits = min(self.config.reg_lut_bits, 2) if not _interpreting() else 0
                reg_lut = max(self.k_bits, self.v_bits) <= lut_bits
                k_codebook, v_codebook = (compact_lut_table(cb) if reg_lut
                                          else gather_pairs(cb, self._pair_order(bits, cb.device))
                                          if bits <= 4
                                          else cb.to(torch.bfloat16)
                                          for cb, bits in ((k_codebook, self.k_bits), (v_codebook, self.v_bits)))
        exact = self.page_type in EXACT_PAGES
        if exact:
            for name, t in (("k_offsets", k_offsets), ("v_offsets", v_offsets)):
                _check(isinstance(t, torch.Tensor) and t.dtype == torch.int64 and t.dim() == 1 and t.is_contiguous()
                       and t.numel() > pl["max_block"], f"{name} must be contiguous int64 [num_blocks > {pl['max_block']}]")
            for name, t in (("k_bases", k_bases), ("v_bases", v_bases)):
                if self.page_type == PAGE_EXACT4:
                    _check(t is None, f"{name}: exact4 pages hold their own window tops")
                else:
                    _check(isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.numel() == Hkv * D
                           and t.is_contiguous(), f"{name} must be contiguous uint8 [{Hkv}, {D}]")
        else:
            _check(k_offsets is None and v_offsets is None and k_bases is None and v_bases is None,
                   "k_offsets/v_offsets/k_bases/v_bases are for page_types 'exact' and 'exact4' only")
        if has_rope:
            _check(compact and not cuda_dot and D >= 32, "rotary offsets need compact pages, the tensor-core path and head_dim >= 32")
            _check(isinstance(rope_coef, torch.Tensor) and rope_coef.dtype == torch.float32
                   and tuple(rope_coef.shape) == (B, Hq, 2, D // 2) and rope_coef.is_contiguous(),
                   f"rope_coef must be contiguous fp32 [{B}, {Hq}, 2, {D // 2}]")
            _check(isinstance(rope_phase, torch.Tensor) and rope_phase.dtype == torch.int64
                   and tuple(rope_phase.shape) == (D // 2,) and rope_phase.is_contiguous(),
                   f"rope_phase must be contiguous int64 [{D // 2}]")
            if rope_pairs is None:
                rope_pairs = self._all_rope_pairs(D // 2, rope_phase.device)
            _check(isinstance(rope_pairs, torch.Tensor) and rope_pairs.dtype == torch.int32 and rope_pairs.dim() == 1
                   and rope_pairs.is_contiguous() and rope_pairs.device == rope_phase.device
                   and 0 < rope_pairs.numel() <= D // 2,
                   f"rope_pairs must be contiguous int32 [1..{D // 2}] of pair indices on rope_phase's device")
            if rope_pos_table is not None:
                rows = -(-pl["paged_end"] // PAGE_TOKENS)
                _check(isinstance(rope_pos_table, torch.Tensor) and rope_pos_table.dtype == torch.float32
                       and rope_pos_table.dim() == 3 and tuple(rope_pos_table.shape[1:]) == (D // 2, 2)
                       and rope_pos_table.is_contiguous() and rope_pos_table.device == rope_phase.device
                       and rope_pos_table.data_ptr() % 8 == 0,  # (copied 8 bytes at a time)
                       f"rope_pos_table must be contiguous fp32 [rows, {D // 2}, 2] on rope_phase's device, "
                       "8-byte aligned (rope_page_table)")
                _check(rope_pos_table.shape[0] >= rows, f"rope_pos_table has {rope_pos_table.shape[0]} rows; the "
                       f"planned pages need {rows} (rope_page_table(rope_phase, {rows * PAGE_TOKENS}))")
        else:
            _check(rope_pairs is None and rope_pos_table is None,
                   "rope_pairs and rope_pos_table need rope_coef and rope_phase")
        side = self.sink_tokens + self.window
        if side:
            for name, t in (("k_side", k_side), ("v_side", v_side)):
                _check(isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16
                       and tuple(t.shape) == (B, side, Hkv, D) and t.is_contiguous(),
                       f"{name} must be contiguous bf16 [{B}, {side}, {Hkv}, {D}]")
        named = dict(k_pages=k_pages, v_pages=v_pages, k_scale=k_scale, v_scale=v_scale, k_side=k_side, v_side=v_side,
                     q_transformed=q_transformed, logit_bias=logit_bias, v_inv_transform=v_inv_transform,
                     v_mean=v_mean, k_codebook=k_codebook, v_codebook=v_codebook, k_grid=k_grid, v_grid=v_grid,
                     rope_coef=rope_coef, rope_phase=rope_phase, rope_pairs=rope_pairs, k_offsets=k_offsets,
                     v_offsets=v_offsets, k_bases=k_bases, v_bases=v_bases, out=out)
        here = q.device  # (compared, not made into keys: this runs once per layer and step)
        _check(here == pl["device"], f"q is on {here}, the plan on {pl['device']}")
        for name, t in named.items():  # (a tensor elsewhere: Triton's error, or an illegal address on another GPU)
            if t is not None and not (isinstance(t, torch.Tensor) and t.device == here):
                raise InvalidArgumentError(f"{name} must be a tensor on q's device ({here}), not "
                                           f"{getattr(t, 'device', type(t).__name__)}")
        qp = q if q_transformed is None else q_transformed
        _check(tuple(qp.shape) == (B, Hq, D) and qp.stride(2) == 1, f"q_transformed must be [{B}, {Hq}, {D}]")
        _check(qp.dtype in (torch.bfloat16, torch.float16, torch.float32),
               f"q_transformed must be bf16, fp16 or fp32, not {qp.dtype}")
        if logit_bias is not None:
            _check(tuple(logit_bias.shape) == (B, Hq), f"logit_bias must be [{B}, {Hq}]")
            logit_bias = logit_bias.float().contiguous()
        if v_inv_transform is not None:
            _check(tuple(v_inv_transform.shape) == (Hkv, D, D), f"v_inv_transform must be [{Hkv}, {D}, {D}]")
            v_inv_transform = v_inv_transform.float().contiguous()
        if v_mean is not None:
            _check(tuple(v_mean.shape) == (Hkv, D), f"v_mean must be [{Hkv}, {D}]")
            v_mean = v_mean.float().contiguous()
        if out is None:
            out = torch.empty((B, Hq, D), dtype=q.dtype, device=q.device)
        _check(isinstance(out, torch.Tensor) and tuple(out.shape) == (B, Hq, D) and out.stride(2) == 1,
               f"out must be [{B}, {Hq}, {D}]")
        _check(out.dtype in (torch.bfloat16, torch.float16, torch.float32) and out.device == q.device,
               f"out must be bf16, fp16 or fp32 on q's device ({q.device}), not {out.dtype} on {out.device}")
        _check(no_overlap(out), "out's elements must not share memory (an expanded view)")

        block_g = _pow2_at_least(G, 16)
        split_block_g = _pow2_at_least(G, 1) if cuda_dot else block_g
        qk_scale = self.sm_scale * LOG2E
        dummy = pl["ws_m"]
        rope_chunks = -(-rope_pairs.numel() // 16) if has_rope else 0
        # which split kernel this call ran (tests and benchmarks read it)
        self.last_split_kernel = ("gluon_exact4" if gluon_x4 else "gluon_fp8" if gluon_fp8
                                  else "gluon_compact" if gluon_cbs is not None else "triton")
        if pl["n_items"] and gluon_x4:
            from . import kv_exact4_gluon as xg

            bf = self.page_type == PAGE_BF16
            kp, vp = (k_pages.view(torch.uint8), v_pages.view(torch.uint8)) if bf else (k_pages, v_pages)
            xg.exact4_split_kernel[(pl["n_items"], Hkv)](
                qp, kp, vp, dummy if bf else k_offsets, dummy if bf else v_offsets, self._ones16(qp.device),
                pl["block_tables"], pl["work_seq"], pl["work_start"], pl["work_end"],
                pl["ws_m"], pl["ws_l"], pl["ws_acc"], qk_scale, qp.stride(0), qp.stride(1),
                *((2 * k_pages.stride(0), 2 * k_pages.stride(1), 2 * v_pages.stride(0), 2 * v_pages.stride(1)) if bf
                  else (0, 0, 0, 0)),
                pl["block_tables"].stride(0), Hkv,
                GROUP=G, BLOCK_G=_pow2_at_least(G, 8), HEAD_DIM=D, STAGES=fp8_stages, BF16=bf,
                BLOCK_SIZE=self.block_size, V_SWIZZLE=cfg.gluon_x4_v_swizzle, num_warps=cfg.gluon_warps,
                **({"maxnreg": cfg.gluon_maxnreg} if cfg.gluon_maxnreg else {}))
        elif pl["n_items"] and gluon_fp8:
            from . import paged_decode_gluon as pg

            pg.fp8_split_kernel[(pl["n_items"], Hkv)](
                qp, k_pages, v_pages, pl["block_tables"], pl["work_seq"], pl["work_start"], pl["work_end"],
                pl["ws_m"], pl["ws_l"], pl["ws_acc"], k_scale, v_scale, qk_scale,
                qp.stride(0), qp.stride(1), k_pages.stride(0), k_pages.stride(1), v_pages.stride(0),
                v_pages.stride(1), pl["block_tables"].stride(0), Hkv,
                GROUP=G, BLOCK_G=_pow2_at_least(G, 8), HEAD_DIM=D, BLOCK_SIZE=self.block_size,
                STAGES=fp8_stages, num_warps=cfg.gluon_warps,
                **({"maxnreg": cfg.gluon_maxnreg} if cfg.gluon_maxnreg else {}))
        elif pl["n_items"] and gluon_cbs is not None:
            from . import paged_decode_gluon as pg

            k_cb, v_cb = gluon_cbs
            warps = cfg.gluon_rope_warps if has_rope else cfg.gluon_warps
            rope_table = has_rope and cfg.gluon_rope_table
            fold = rope_table and cfg.gluon_rope_fold and G <= 4  # (it takes the padding columns skip would skip)
            v_pad = cfg.v_padded(has_rope)
            tab_off, stage_off, _ = pg.smem_offsets(
                self.k_bits, self.v_bits, D, warps, cfg.gluon_stages, cfg.gluon_copy_align, v_pad,
                pg.rope_table_words(rope_chunks, _pow2_at_least(G, 8)) if rope_table else 0,
                rope_chunks if slot_trig else 0)
            pg.compact_split_kernel[(pl["n_items"], Hkv)](
                qp, logit_bias if logit_bias is not None else dummy, k_pages, v_pages, pl["block_tables"],
                pl["work_seq"], pl["work_start"], pl["work_end"], pl["ws_m"], pl["ws_l"], pl["ws_acc"],
                k_cb, v_cb, k_grid, v_grid,
                rope_coef if has_rope else dummy, rope_phase if has_rope else dummy,
                rope_pairs if has_rope else dummy, rope_pairs.numel() if has_rope else 0,
                rope_pos_table if pos_ok else dummy, rope_pos_table.shape[0] if pos_ok else 1, qk_scale,
                qp.stride(0), qp.stride(1), k_pages.stride(0), k_pages.stride(1), v_pages.stride(0),
                v_pages.stride(1), pl["block_tables"].stride(0), Hkv,
                GROUP=G, BLOCK_G=_pow2_at_least(G, 8), HEAD_DIM=D, BLOCK_SIZE=self.block_size,
                ROPE_CHUNKS=rope_chunks, ROPE_HOIST=0 < rope_chunks <= cfg.gluon_rope_hoist and not rope_table,
                ROPE_TABLE=rope_table, ROPE_POS=pos_ok, ROPE_LANES=lanes_ok,
                ROPE_CHAINS=cfg.gluon_rope_chains if rope_table else 1,
                ROPE_FOLD=fold, ROPE_SKIP=rope_table and cfg.gluon_rope_skip_pad and not fold,
                BITS_K=self.k_bits, BITS_V=self.v_bits,
                HAS_BIAS=logit_bias is not None, V_EARLY=bool(cfg.gluon_ahead & 1), K_AHEAD=bool(cfg.gluon_ahead & 2),
                num_warps=warps,
                STAGES=cfg.gluon_stages, TAB_OFF=tab_off, STAGE_OFF=stage_off, VOTE=cfg.gluon_vote,
                V_PAD=v_pad, COPY_ALIGN=cfg.gluon_copy_align, BULK_COPY=cfg.gluon_bulk_copy,
                # with the rotary term no cap: 16 warps hold 128 registers at most (ptxas spills 4-32
                # bytes at the Llama shapes; 8 warps uncapped were slower for q4, BENCHMARKS.md)
                **({"maxnreg": cfg.gluon_maxnreg} if cfg.gluon_maxnreg and not has_rope else {}))
        elif pl["n_items"]:
            _paged_split_kernel[(pl["n_items"], Hkv)](
                qp, logit_bias if logit_bias is not None else dummy, k_pages, v_pages,
                k_scale if fp8 else dummy, v_scale if fp8 else dummy, pl["block_tables"],
                pl["work_seq"], pl["work_start"], pl["work_end"],
                pl["ws_m"], pl["ws_l"], pl["ws_acc"],
                k_codebook if compact else (k_bases if k_bases is not None else dummy),
                v_codebook if compact else (v_bases if v_bases is not None else dummy),
                k_grid if compact else dummy, v_grid if compact else dummy,
                rope_coef if has_rope else dummy, rope_phase if has_rope else dummy,
                rope_pairs if has_rope else dummy, rope_pairs.numel() if has_rope else 0,
                k_offsets if exact else dummy, v_offsets if exact else dummy,
                qk_scale,
                qp.stride(0), qp.stride(1),
                *((0, 0, 0) if exact else (k_pages.stride(0), k_pages.stride(1), k_pages.stride(2))),
                *((0, 0, 0) if exact else (v_pages.stride(0), v_pages.stride(1), v_pages.stride(2))),
                pl["block_tables"].stride(0),
                Hkv,
                GROUP=G, BLOCK_G=split_block_g, HEAD_DIM=D, BLOCK_SIZE=self.block_size, BLOCK_N=cfg.block_n,
                PAGE_TYPE=self.page_type, HAS_BIAS=logit_bias is not None,
                BITS_K=self.k_bits or 0, BITS_V=self.v_bits or 0, CUDA_DOT=cuda_dot,
                PAIRS_K=compact and not cuda_dot and self.k_bits <= 4,
                PAIRS_V=compact and not cuda_dot and self.v_bits <= 4, HAS_ROPE=has_rope,
                ROPE_CHUNKS=rope_chunks,
                FAST_TRIG=(has_rope or exact) and not _interpreting(), REG_LUT=reg_lut,
                num_warps=cfg.num_warps, num_stages=cfg.num_stages,
            )
        ks = k_side if side else q
        vs = v_side if side else q
        merge_block_i, merge_warps, merge_blocks = merge_launch(G, D, block_g, v_inv_transform is not None, side > 0,
                                                                B * Hkv, self._num_sms())
        _merge_kernel[(B, Hkv, merge_blocks)](
            q, ks, vs, pl["seq_lens"], pl["item_indptr"],
            pl["ws_m"], pl["ws_l"], pl["ws_acc"],
            v_inv_transform if v_inv_transform is not None else dummy,
            v_mean if v_mean is not None else dummy, out,
            qk_scale,
            q.stride(0), q.stride(1),
            ks.stride(0) if side else 0, ks.stride(1) if side else 0, ks.stride(2) if side else 0,
            out.stride(0), out.stride(1),
            Hkv,
            GROUP=G, BLOCK_G=block_g, HEAD_DIM=D,
            SINKS=self.sink_tokens, WINDOW=self.window, BLOCK_S=_pow2_at_least(min(side, 64), 16),
            BLOCK_I=merge_block_i,
            HAS_V_TRANSFORM=v_inv_transform is not None, HAS_V_MEAN=v_mean is not None,
            BLOCK_C=D // merge_blocks, num_warps=merge_warps,
        )
        return out

    def bytes_read(self, kv_bytes_per_token: float) -> int:
        """Bytes the split kernel must read for the planned batch: every page token's K and V
        (``kv_bytes_per_token`` for one KV head, K and V together), the block-table entries each KV
        head reads, and q. The workspace round trip is not counted."""
        pl = self._plan
        ends = pl["work_end"].cpu().numpy().astype(np.int64)
        starts = pl["work_start"].cpu().numpy().astype(np.int64)
        tokens = int((ends - starts).sum())
        bt = 0
        bn = self.config.block_n
        for s, e in zip(starts, ends):
            bt += (-(-e // bn) - s // bn) * bn  # one int32 per token slot in each visited tile
        q_bytes = pl["num_seqs"] * self.num_q_heads * self.head_dim * 2
        return int(tokens * self.num_kv_heads * kv_bytes_per_token + bt * 4 * self.num_kv_heads + q_bytes)


def compact_page_bytes(bits: int, head_dim: int) -> int:
    """Bytes of one compact page (16 tokens of one KV head): codec.page_bytes."""
    return PAGE_TOKENS * (bits * head_dim // 8 + 1)


def compact_tables(k_tables, v_tables, device="cpu") -> dict:
    """The per-layer tensors the kernels need for compact pages, from the codec's tables of one layer
    (``k_tables``/``v_tables``: a ``codec.HeadTables`` per KV head): ``k_codebook``/``v_codebook`` fp32
    [H, 2**bits], ``k_grid``/``v_grid`` fp32 [H, 256] (for ``run``), the K transform ``k_inv_transform``
    [H, d, d] and ``k_mean`` [H, d] (for ``transform_query``: true key = y @ A_k + mu_k), and
    ``v_inv_transform``/``v_mean`` (for ``run``), all from ``codec.inverse_matrix``."""
    from weightszip.compact import codec

    out = {}
    for kind, tables in (("k", k_tables), ("v", v_tables)):
        _check(len(tables) > 0 and len({t.bits for t in tables}) == 1,
               f"{kind}_tables: one HeadTables per KV head, all of one bit width")
        a, mean = codec.inverse_matrix(tables)
        out[f"{kind}_codebook"] = torch.stack([t.codebook for t in tables]).contiguous().to(device)
        out[f"{kind}_grid"] = torch.stack([t.grid() for t in tables]).contiguous().to(device)
        out[f"{kind}_inv_transform"] = a.contiguous().to(device)
        out[f"{kind}_mean"] = mean.contiguous().to(device)
        out[f"{kind}_bits"] = tables[0].bits
    stacked = codec.stack_rope(k_tables)
    if stacked is not None:
        m, f = stacked
        _check(bool((f == f[0]).all()), "the KV heads of one layer share one rope_phase")
        out["k_rope_m"] = (m.double() * 2.0**-codec.FIXED_SHIFT).float().contiguous().to(device)
        out["rope_phase"] = f[0].contiguous().to(device)
        # the pairs (i, i + d/2) with an offset in some head: the kernel skips the others (A = B = 0)
        half = m.shape[-1] // 2
        active = ((m[:, :half] != 0) | (m[:, half:] != 0)).any(0)
        pairs = torch.nonzero(active).flatten().to(torch.int32)
        out["rope_pairs"] = (pairs if pairs.numel() else torch.zeros(1, dtype=torch.int32)).contiguous().to(device)
    return out


def _bf16_bits(codebook: torch.Tensor) -> torch.Tensor:
    """The bf16 bit patterns of a codebook [H, n] as int64 in 0..65535."""
    return codebook.to(torch.bfloat16).contiguous().view(torch.int16).to(torch.int64) & 0xFFFF


def _as_int32(words: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words held in int64 as int32 (the same bits)."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32).contiguous()


def pair_gather(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A pair table's gather index from the codes ``a``, ``b`` of each entry: ``a[x]`` at 2 x, ``b[x]``
    at 2 x + 1 (int64 [2 E]; what ``gather_pairs`` takes)."""
    return torch.stack((a, b), dim=-1).reshape(-1)


def gather_pairs(codebook: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """int32 [H, E] from a codebook [H, n] and a ``pair_gather`` index [2 E]: entry x holds the bf16
    bits of ``codebook[index[2 x]]`` in its low half and of ``codebook[index[2 x + 1]]`` in its high
    half. One gather of the codebook's bf16 bits as int16, read as int32 (little-endian, as torch's
    devices are): two device ops, none when a step's tables are made from a cached index."""
    bits16 = codebook.to(torch.bfloat16).contiguous().view(torch.int16)
    return bits16[:, index].view(torch.int32)


def compact_pair_order(bits: int, device) -> torch.Tensor:
    """``compact_pair_table``'s gather index: entry ``a | b << bits`` (device ops only)."""
    x = torch.arange(1 << 2 * bits, device=device)
    return pair_gather(x & ((1 << bits) - 1), x >> bits)


def compact_pair_table(codebook: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [H, 4**bits] from a codebook [H, 2**bits]: entry ``a | b << bits`` holds the bf16 bits of
    ``codebook[a]`` in its low half and of ``codebook[b]`` in its high half (channels 2 k and 2 k + 1
    of a tensor-core operand), so the kernel gathers two values at once (widths up to 4). ``order``:
    ``compact_pair_order`` made beforehand (None: made here)."""
    n = codebook.shape[1]
    return gather_pairs(codebook, compact_pair_order(n.bit_length() - 1, codebook.device) if order is None else order)


def compact_lut_table(codebook: torch.Tensor) -> torch.Tensor:
    """int32 [H, 8] from a codebook [H, 2**bits] (bits <= 3) for the register lookup (``_lut_lookup``):
    word r holds the low bytes of the bf16 bits of entries 4 r .. 4 r + 3 (entry 4 r in its lowest
    byte), word 4 + r their high bytes; entries past 2**bits are 0."""
    h, n = codebook.shape
    _check(n <= 8, "the register lookup takes codebooks of at most 8 entries")
    u = torch.nn.functional.pad(_bf16_bits(codebook), (0, 16 - n))
    shifts = torch.arange(0, 32, 8, device=u.device)
    lo = ((u & 0xFF).view(h, 4, 4) << shifts).sum(-1)
    hi = ((u >> 8).view(h, 4, 4) << shifts).sum(-1)
    return _as_int32(torch.cat([lo, hi], 1))


def dequantize_compact_pages(pages: torch.Tensor, bits: int, codebook: torch.Tensor, grid: torch.Tensor,
                             *, pairs: bool = False) -> torch.Tensor:
    """The fp32 rotated-domain values the attention kernel reads from compact ``pages`` uint8
    [num_blocks, kv_heads, block_size / 16, page_bytes], through its tile loader, as
    [num_blocks, kv_heads, block_size, head_dim] (for bit-exact comparison with codec.decode_page).
    ``pairs``: through the tensor-core path's packed pair table (``compact_pair_table``): the
    codebook is rounded to bf16 first, as the tensor-core products see it (widths up to 4)."""
    _check(bits in COMPACT_BITS, f"bits must be one of {COMPACT_BITS}")
    _check(pages.dtype == torch.uint8 and pages.dim() == 4 and pages.stride(3) == 1, "pages must be uint8 [nb, H, P, bytes]")
    nb, h, npg, nbytes = pages.shape
    d = (nbytes // PAGE_TOKENS - 1) * 8 // bits
    _check(compact_page_bytes(bits, d) == nbytes and d >= 32 and d & (d - 1) == 0,
           f"{nbytes} bytes is not a {bits}-bit page of a power-of-two head_dim >= 32")
    _check(pages.stride(2) == nbytes, "pages of a block must be contiguous")
    _check(pages.data_ptr() % 16 == 0 and pages.stride(1) % 16 == 0 and pages.stride(0) % 16 == 0,
           "pages must start at 16-byte aligned addresses (read as 32-bit words)")
    _check(codebook.dtype == torch.float32 and tuple(codebook.shape) == (h, 2**bits) and codebook.is_contiguous(),
           f"codebook must be contiguous fp32 [{h}, {2**bits}]")
    _check(grid.dtype == torch.float32 and tuple(grid.shape) == (h, GRID_SIZE) and grid.is_contiguous(),
           f"grid must be contiguous fp32 [{h}, {GRID_SIZE}]")
    _check(not pairs or bits <= 4, "pairs: widths up to 4 bits")
    bs = npg * PAGE_TOKENS
    out = torch.empty((nb, h, bs, d), dtype=torch.float32, device=pages.device)
    cb = compact_pair_table(codebook) if pairs else codebook
    _dequantize_compact_kernel[(nb, h, npg)](pages, cb, grid, out, pages.stride(0), pages.stride(1),
                                             BLOCK_SIZE=bs, HEAD_DIM=d, BITS=bits, PAIRS=pairs)
    return out


def dequantize_pages(pages: torch.Tensor, page_type: str, scale: torch.Tensor | None = None) -> torch.Tensor:
    """The fp32 values the attention kernel reads from ``pages`` [num_blocks, kv_heads, block_size,
    head_dim], through the kernel's own tile loader (for bit-exact comparison with the reference)."""
    _check(page_type in ("bf16", "fp8"), "page_type must be 'bf16' or 'fp8' (compact: dequantize_compact_pages)")
    pt = PAGE_TYPES[page_type]
    _check(pages.dtype == PAGE_DTYPES[pt] and pages.dim() == 4 and pages.stride(3) == 1,
           "pages must be [num_blocks, kv_heads, block_size, head_dim] of the page type's dtype")
    nb, h, bs, d = pages.shape
    _check(bs > 0 and bs % PAGE_TOKENS == 0, f"block_size must be a positive multiple of {PAGE_TOKENS}, not {bs}")
    _check(d in (16, 32, 64, 128, 256), f"head_dim must be 16, 32, 64, 128 or 256, not {d}")
    if pt == PAGE_FP8:
        _check(isinstance(scale, torch.Tensor) and scale.dtype == torch.float32 and scale.numel() == h
               and scale.is_contiguous(), f"fp8 pages need a contiguous fp32 scale per KV head ([{h}])")
    out = torch.empty((nb, h, bs, d), dtype=torch.float32, device=pages.device)
    _dequantize_pages_kernel[(nb, h, bs // PAGE_TOKENS)](pages, scale if scale is not None else out, out,
                                      pages.stride(0), pages.stride(1), pages.stride(2),
                                      BLOCK_SIZE=bs, HEAD_DIM=d, PAGE_TYPE=pt)
    return out


def dequantize_exact_pages(heap: torch.Tensor, offsets: torch.Tensor, bases: torch.Tensor, heads: int,
                           head_dim: int, *, pages_per_tile: int = 1) -> torch.Tensor:
    """The bf16 bits (int16 ``[n, 16, heads, head_dim]``) the attention kernel reads from the KV
    Exact pages at ``offsets`` (int64 [n]) of ``heap`` (uint8, 1-D), through its tile loader: for
    comparison with ``kv_exact_ref.decode_pages``. Pages are not validated (the kernel's contract).
    ``pages_per_tile``: pages decoded together (1, 2, 4, ...: the attention kernel's ``block_n / 16``)."""
    _check(heap.dtype == torch.uint8 and heap.dim() == 1 and heap.is_contiguous() and heap.data_ptr() % 16 == 0,
           "heap must be a contiguous, 16-byte aligned 1-D uint8 tensor")
    _check(offsets.dtype == torch.int64 and offsets.dim() == 1, "offsets must be int64 [n]")
    _check(head_dim >= 32 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two >= 32, not {head_dim}")
    _check(bases.dtype == torch.uint8 and bases.numel() == heads * head_dim, f"bases must be uint8 [{heads}, {head_dim}]")
    _check(pages_per_tile > 0 and pages_per_tile & (pages_per_tile - 1) == 0, "pages_per_tile must be a power of two")
    n = offsets.numel()
    out = torch.empty((n, PAGE_TOKENS, heads, head_dim), dtype=torch.int16, device=heap.device)
    if n:
        _dequantize_exact_kernel[(triton.cdiv(n, pages_per_tile), heads)](
            heap, offsets.contiguous(), bases.contiguous(), out, heads, n, HEAD_DIM=head_dim, NP=pages_per_tile,
            FAST=not _interpreting())
    return out


def dequantize_exact4_pages(heap: torch.Tensor, offsets: torch.Tensor, heads: int, head_dim: int, *,
                            pages_per_tile: int = 1) -> torch.Tensor:
    """The bf16 bits (int16 ``[n, 16, heads, head_dim]``) the attention kernel reads from the KV
    Exact4 pages at ``offsets`` (int64 [n]) of ``heap`` (uint8, 1-D), through its tile loader: for
    comparison with ``kv_exact4_ref.decode_pages``. Pages are not validated (the kernel's contract).
    ``pages_per_tile``: pages decoded together (the attention kernel's ``block_n / 16``)."""
    _check(heap.dtype == torch.uint8 and heap.dim() == 1 and heap.is_contiguous() and heap.data_ptr() % 16 == 0,
           "heap must be a contiguous, 16-byte aligned 1-D uint8 tensor")
    _check(offsets.dtype == torch.int64 and offsets.dim() == 1, "offsets must be int64 [n]")
    _check(head_dim >= 32 and head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two >= 32, not {head_dim}")
    _check(0 < heads <= EXACT4_MAX_HEADS, f"exact4 pages hold 1 to {EXACT4_MAX_HEADS} KV heads, not {heads}")
    _check(pages_per_tile > 0 and pages_per_tile & (pages_per_tile - 1) == 0, "pages_per_tile must be a power of two")
    n = offsets.numel()
    out = torch.empty((n, PAGE_TOKENS, heads, head_dim), dtype=torch.int16, device=heap.device)
    if n:
        _dequantize_exact4_kernel[(triton.cdiv(n, pages_per_tile), heads)](
            heap, offsets.contiguous(), out, heads, n, HEAD_DIM=head_dim, NP=pages_per_tile,
            FAST=not _interpreting())
    return out
