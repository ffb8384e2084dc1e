"""Decode attention over compact pages (q4, q3.5, q3) in Gluon: the codes are decoded straight into
the tensor cores' register operands.

Why a second kernel: the Triton split kernel (``paged_decode._paged_split_kernel``) is bound by the
L1/shared-memory pipe on compact pages (Nsight Compute, BENCHMARKS.md): its codebook gathers go
through L1 and every dequantized tile takes a shared-memory round trip into the operand layout of
the tensor cores. Here, in Gluon (Triton's layout-explicit dialect, ``triton.experimental.gluon``):

* **Operands in registers.** The products are transposed, ``S^T = K Q^T`` and ``O^T += V^T P^T`` on
  ``mma.sync`` (m16n8k16, bf16, fp32 accumulation), so the GQA group sits on the 8-wide side; K and
  V^T are A operands built directly in their register layout, Q^T and P^T the B operands. Each warp
  owns every NW-th page of the split and its own running softmax state (a batch dimension over the
  warps); the warps' states merge once at the end of the program.
* **Pair codes by bit arithmetic.** A thread's operand registers hold channel pairs (K: channels
  2c, 2c + 1 of one token) or token pairs (V^T: tokens 2t, 2t + 1 of one channel). Width 4 (nibble
  rows, page layout version 2): a K pair's two codes are one byte of the row as loaded, and a V
  pair's are one byte of a nibble select of two rows' words (two rotates and a select per four
  pairs), looked up in the code-order table (``compact_pair_table``). Width 3 (crumb rows and a
  bit-2 row, layout version 3): a K pair's code is a crumb nibble beside two bits of the bit-2 word
  (two rotates and a select per four pairs, ``crumb_pair_codes_k``), a V pair's four rotates and
  three selects per four pairs (``crumb_pair_codes_v``; table ``crumb_pair_table``). The operand
  channels are permuted (``k_nibble_channel``, ``v_nibble_channel``, ``k_crumb_channel``,
  ``v_crumb_channel``) so each lane reads consecutive words, and q' and the output go through the
  same maps. Width 2 (bit planes: word m of a token row, byte i bit j = channel 32 m + 8 i + j): one
  rotate (funnel shift) and mask per plane word yields its bits of four pair codes, one per byte,
  whose bits interleave the two values' bits (``pair_index``).
  A pair's table address is one byte permute (``_lookup``).
* **Conflict-free table lookups.** The pair tables (bf16 codebook[a] in the low half, codebook[b] in
  the high half) sit in shared memory 32 times over, one 256-byte row per pair code holding K's 32
  copies and then V's, copy ``l`` in bank ``l`` (``_fill_tables``: each thread loads every code a of
  a codebook against a few codes b and stores its words by inline PTX, one barrier after); lane
  ``l`` reads copy ``l`` (``ld.shared`` through inline PTX, as Gluon has no shared-memory gather),
  so a warp's 32 lookups are one shared-memory wavefront whatever the codes, and a lookup's address
  is the pair code in bits 8-15 beside the lane's offset: one byte permute.
* **Pages staged by cp.async** (``STAGES``, ``KernelConfig.gluon_stages``): each warp copies its next
  page's bit planes into its own slots of shared memory (16-byte ``cp.async`` through inline PTX,
  so Triton inserts no block-wide barrier; a warp waits for its own copies and syncs its own lanes),
  so no registers hold the page in flight, and read back 2 or 4 words per ``ld.shared``. On the
  H200 staging gave 1-5% over the register path with bit planes (7-18% with nibble rows); the kernel
  is bound by instruction issue and its integer/logic (ALU) pipe, not by memory latency: q4 about
  490 SASS instructions per 16-token page and warp, about 200 on the ALU pipe (with bit planes at
  width 4: 750 and 390; BENCHMARKS.md).
* **No global load in the loop** (staged path): a page's copies also bring, in the same commit
  group, the block-table entry of the page STAGES steps on into its slot's header (``_seed_block``
  seeds the first steps, ``_carried_offsets`` reads it back), the page's grid-scale indices, and
  the head's grids are staged in shared memory once (``_fill_grids``); the planes sit at their
  page offset mod 32, so a copy touches 16 sectors. On the H200 0-15% over loading the addresses in
  the loop, the output unchanged (1-17% with the two chains below; BENCHMARKS.md, session 27).
* **Two product chains for the logits** (``_k_halves``, ``_logits``): the 8 dependent ``mma.sync``
  of a page's ``K Q^T`` as two chains over the two halves of head_dim, summed at the end (a
  different fp32 rounding of the sum, within the stated tolerance; 1-2% for KV Exact4, none here).
* **The lazy max by a warp vote** (``VOTE``, ``KernelConfig.gluon_vote``, the compact default): one
  vote asks whether any logit of the warp exceeds its column's max + MAX_SLACK, and the row shuffles
  run only then (``_vote_softmax_step``, ``_vote_max_asm``; the same maxima, so the same output). On
  an H100 0.995-1.13x (q4, q3.5, q3; BENCHMARKS.md, session 30).
* **V's row pairs padded** (``V_PAD``, ``KernelConfig.gluon_v_pad``, q4 at head_dim 128; with the
  rotary term ``KernelConfig.gluon_rope_v_pad``, on in the compact default): V's 128-byte row pairs
  160 bytes apart in the slot (``v_padded_chunk``), which removes the 4-way bank conflicts of the V
  operand's shared loads. With the per-lane copies it made q4 0.93-1.01x on an H100 without the
  term, as did two swizzles tried before it (removed, session 31): any layout but the page's own
  costs those copies more than the loads save where DRAM is the other limit. With the term, bound
  by the shared-memory pipe, it made q4 1.011-1.112x (session 45).
* **Aligned copies** (``COPY_ALIGN``, ``KernelConfig.gluon_copy_align``; opt-in): each 8 lanes of a
  page's copies write one 128-byte line (``aligned_copy_slot``), where the default's cross a line
  (two shared wavefronts a phase). Within noise on an H100 (session 31).
* **Bulk copies** (``BULK_COPY``, ``KernelConfig.gluon_bulk_copy``; opt-in, not yet run on a GPU):
  lane 0 of each warp has the copy engine move a page's planes and scale indices
  (``cp.async.bulk``, ``_bulk_issue_asm``) and every lane waits on the slot's mbarrier
  (``SLOT_BAR``, ``_bulk_wait``) instead of 128 lanes' 16-byte cp.async: the copies then leave the
  load/store pipe (about 34 of a page's ~190 shared wavefronts a warp on the H100), and V's padded
  layout (``V_PAD``) costs them nothing more. The block's carry stays a 4-byte cp.async.
* **The rotary-offset term** (``ROPE_CHUNKS``): the per-key ``q . r(p)`` of calibrations with rotary
  K offsets, as the Triton kernel's, on the tensor cores (``_rope_logits``).

Numerics equal the Triton kernel's: bf16 codebook values (``codebook[code]``) on the tensor cores,
fp32 sums, each token's grid scale on the fp32 logits (K) and on the softmax weights before their
bf16 rounding (V), base-2 softmax with a running maximum. The split schedule, the workspace and the
merge kernel are ``PagedDecodeAttention``'s.

``fp8_split_kernel``: the same pattern for fp8 e4m3 pages (the baseline the compact formats are
measured against, whose Triton kernel reaches only half of bf16's bandwidth efficiency): pages staged
by zero-filling cp.async into padded rows (32-byte aligned, chunks swizzled by ``_fp8_chunk``; the
block numbers carried in K row 0's padding), e4m3 pairs converted to f16 pairs in registers (Hopper has
no e4m3 -> bf16 conversion), f16 products. About 470 instructions per 16-token page and warp (the
compact kernel: 750 for half the bytes). The fp8 default on the GPU (``KernelConfig.gluon``; on the
H200 0.59-0.90 of read bandwidth against the Triton kernel's 0.44-0.54, BENCHMARKS.md) for head_dim
64 or 128 and GQA groups up to 8, the shapes its GPU tests cover; the Triton kernel otherwise.

Compiled only: Gluon has no interpreter mode, so the CPU tests run its decode math in PyTorch
(``pair_index``, ``interleaved_pair_table``) and compile it for sm_90, and the GPU tests compare it
with the reference (``paged_decode_ref``) and the Triton kernel. ``PagedDecodeAttention`` runs it
for widths 2-4 on steps large enough (``KernelConfig.gluon*``).
"""

from __future__ import annotations

import functools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import mma_v2
from triton.runtime.jit import constexpr_function

from .paged_decode import gather_pairs, pair_gather

NEG_BIG = gl.constexpr(-1.0e30)
# One 32-bit lookup in shared memory at byte offset $1 of the kernel's dynamic shared memory
# (``global_smem``; the pair tables lie at TAB_OFF and the staging slots at STAGE_OFF,
# ``smem_offsets``: bytes only inline PTX touches, the compile test checks no Triton scratch does).
_LDS = gl.constexpr("{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $1; ld.shared.b32 $0, [a]; }")


@constexpr_function
def _lds_vec_asm(n):
    """``n`` (2 or 4) consecutive 32-bit words at the byte offset of the first of ``n`` packed
    addresses ($n; the others are not read), in one vector load."""
    outs = ", ".join(f"${i}" for i in range(n))
    return (f"{{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, ${n}; ld.shared.v{n}.b32 {{{outs}}}, [a]; }}")


@constexpr_function
def _vec_words(m):
    """Words per staged vector load when a thread reads ``m`` consecutive words of a row: 4 at most."""
    return min(m, 4)


@constexpr_function
def _lds_vec_constraints(n):
    return ",".join(["=r"] * n + ["r"] * n)


def interleaved_pair_order(bits: int, device) -> torch.Tensor:
    """``interleaved_pair_table``'s gather index (``paged_decode.pair_gather``): for each interleaved
    pair code x (4**bits), the codes a, b whose bits it interleaves (bit 2 p of x is bit p of a, bit
    2 p + 1 bit p of b). Device ops only."""
    x = torch.arange(1 << 2 * bits, device=device)
    return pair_gather(sum(((x >> 2 * p) & 1) << p for p in range(bits)),
                       sum(((x >> 2 * p + 1) & 1) << p for p in range(bits)))


def interleaved_pair_table(codebook: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [H, 4**bits] from a codebook [H, 2**bits] (bits <= 4): entry ``x`` holds the bf16 bits of
    ``codebook[a]`` in its low half and of ``codebook[b]`` in its high half (``interleaved_pair_order``,
    the order ``pair_index`` makes; pass it to skip recomputing it); ``paged_decode.compact_pair_table``
    packs the same pairs in code order. The reference of the tables the kernel makes in shared
    memory (``_fill_tables``) at width 2 (bit planes). Device ops only."""
    if order is None:
        order = interleaved_pair_order(codebook.shape[1].bit_length() - 1, codebook.device)
    return gather_pairs(codebook, order)


def pair_index(w_lo: torch.Tensor, w_hi: torch.Tensor, shift: int, bits: int) -> torch.Tensor:
    """Reference of the kernel's pair codes (int64 words): for plane words ``w_lo``/``w_hi`` [bits, ...]
    of the pair's two values (the same words for a K channel pair), byte i of the result is the
    interleaved pair code of the bits at ``shift`` (``w_lo``) and ``shift + 1`` or ``shift`` of ``w_hi``.
    Used by the tests to state the bit order; the kernel computes the same in registers by other
    formulas (``rotated_pair_codes``)."""
    y = torch.zeros_like(w_lo[0])
    for p in range(bits):
        y |= ((w_lo[p] >> shift) & 0x01010101) << (2 * p)
        y |= ((w_hi[p] >> shift) & 0x01010101) << (2 * p + 1)
    return y


def _rotr32(w: torch.Tensor, n: int) -> torch.Tensor:
    n %= 32
    return ((w >> n) | (w << (32 - n))) & 0xFFFFFFFF


def rotated_pair_codes(w_a: torch.Tensor, w_b: torch.Tensor | None, lane: int, bits: int) -> torch.Tensor:
    """The kernel's pair-code formulas in PyTorch (int64 words holding 32-bit values), to hold them
    against ``pair_index``. K (``w_b`` None; ``lane`` = t): plane p's word rotated right by 2 t - 2 p and
    masked to bits 2 p, 2 p + 1 of each byte. V (``lane`` = j): rows a and b rotated right by j - 2 p
    and j - 2 p - 1, the even bits taken from a and the odd from b, masked the same way."""
    y = torch.zeros_like(w_a[0])
    for p in range(bits):
        mask = 0x03030303 << (2 * p)
        if w_b is None:
            y |= _rotr32(w_a[p], 2 * lane - 2 * p) & mask
        else:
            y |= ((_rotr32(w_a[p], lane - 2 * p) & 0x55555555) | (_rotr32(w_b[p], lane - 2 * p - 1) & 0xAAAAAAAA)) & mask
    return y


def pair_table_offset(y: torch.Tensor, i: int, lane: int) -> torch.Tensor:
    """The kernel's table address of byte ``i`` of pair-code word ``y`` in lane ``lane``'s K copy (byte
    offset past the tables' start; V's copies are 128 bytes further): ``prmt`` with selector
    0x55i4 puts byte i in bits 8-15 beside the lane's offset 4 x lane in bits 0-7."""
    return ((y >> (8 * i)) & 0xFF) * 256 + 4 * lane


def k_nibble_channel(ch, head_dim: int):
    """The stored channel a width-4 K operand position reads (ints or int tensors): the kernel's K
    channel ``32 m + 8 i + 2 t + b`` (``k_layout``) is stored channel ``2 (4 (t M + m) + i) + b``, so
    lane t's pair codes are bytes of M consecutive words of a nibble row (M = head_dim / 32). Q is
    read through the same map, so the products see the stored pairs."""
    mm = head_dim // 32
    m, i, t, b = ch // 32, (ch // 8) % 4, (ch // 2) % 4, ch % 2
    return 8 * (t * mm + m) + 2 * i + b


def v_nibble_channel(ch, head_dim: int):
    """The stored channel of a width-4 V^T operand row (ints or int tensors): the kernel's V channel
    ``32 m + 16 i1 + 8 i0 + j`` (``v_layout``) is stored channel ``8 ((j >> 1) M + m) + 2 (2 i1 + i0) +
    (j & 1)``, so lane j reads M consecutive words of each row and its pairs are byte 2 i1 + i0 of one
    nibble select of two rows' words; the output is written back through the same map."""
    mm = head_dim // 32
    m, i1, i0, j = ch // 32, (ch // 16) % 2, (ch // 8) % 2, ch % 8
    return 8 * ((j >> 1) * mm + m) + 2 * (2 * i1 + i0) + (j & 1)


def nibble_pair_codes(a: torch.Tensor, b: torch.Tensor, lane: int) -> torch.Tensor:
    """The V operand's pair codes from two rows' nibble words (int64 tensors holding 32-bit words), by
    the kernel's formula: rotate row a's word right by 4 (j & 1) and row b's by 4 (j & 1) - 4, low
    nibbles from a, high from b."""
    sh = 4 * (lane & 1)
    return (_rotr32(a, sh) & 0x0F0F0F0F) | (_rotr32(b, sh - 4) & 0xF0F0F0F0)


@constexpr_function
def table_entries(bits):
    """Entries of the kernel's pair table at a width: 4**bits (bit planes, nibble rows), 256 at width 3
    (crumb rows: a pair code is a byte whose top two bits the table ignores)."""
    return 256 if bits == 3 else 1 << 2 * bits


def k_crumb_channel(ch, head_dim: int):
    """The stored channel a width-3 operand position reads (ints or int tensors), K's and V^T's alike.
    K: operand channel ``32 m + 8 i + 2 t + b`` is stored channel ``(t >> 1) d/2 + 16 m + 4 i + 2 (t &
    1) + b``: lane t reads crumb words ``(t >> 1) M + m`` and bit-2 words m of a row
    (``codec.bit2_positions``). V^T: with ``i = 2 i1 + i0`` and ``j = 2 t + b`` the same channel
    ``32 m + 16 i1 + 8 i0 + j`` is stored channel ``(j >> 2) d/2 + 16 m + 4 (2 i1 + i0) + (j & 3)``:
    lane j reads crumb words ``(j >> 2) M + m`` and bit-2 words m of two rows, and its pairs are byte
    2 i1 + i0 of one select."""
    m, i, t, b = ch // 32, (ch // 8) % 4, (ch // 2) % 4, ch % 2
    return (t >> 1) * (head_dim // 2) + 16 * m + 4 * i + 2 * (t & 1) + b


v_crumb_channel = k_crumb_channel  # (one map: see k_crumb_channel)


def crumb_pair_codes_k(c: torch.Tensor, p: torch.Tensor, lane: int) -> torch.Tensor:
    """The K operand's width-3 pair codes by the kernel's formula (int64 tensors holding 32-bit words):
    lane t's crumb word rotated right by 4 (t & 1) in the low nibbles, the bit-2 word rotated right by
    4 (t & 1) - 4 + 2 (t >> 1) in the high ones (bits 6-7 of each byte are not part of the code)."""
    return (_rotr32(c, 4 * (lane & 1)) & 0x0F0F0F0F) | (_rotr32(p, 4 * (lane & 1) - 4 + 2 * (lane >> 1)) & 0xF0F0F0F0)


def crumb_pair_codes_v(ca, cb, pa, pb, lane: int) -> torch.Tensor:
    """The V operand's width-3 pair codes (rows a and b: crumb words ``ca``, ``cb``, bit-2 words ``pa``,
    ``pb``) by the kernel's formula for lane j: s = j & 3, the crumbs of channel 4 k + s from a to
    bits 0-1 and from b to bits 2-3, its bit 2 from a to bit 4 and from b to bit 5."""
    s = lane & 3
    pos = s + 2 * (s >> 1) + 2 * (lane >> 2)
    t1 = (_rotr32(ca, 2 * s) & 0x03030303) | (_rotr32(cb, 2 * s - 2) & 0xFCFCFCFC)
    u = (_rotr32(pa, pos - 4) & 0x10101010) | (_rotr32(pb, pos - 5) & 0xEFEFEFEF)
    return (t1 & 0x0F0F0F0F) | (u & 0xF0F0F0F0)


def crumb_pair_order(device) -> torch.Tensor:
    """``crumb_pair_table``'s gather index: for each byte x, a = (x & 3) | (x >> 4 & 1) << 2 and
    b = (x >> 2 & 3) | (x >> 5 & 1) << 2 (device ops only)."""
    x = torch.arange(256, device=device)
    return pair_gather((x & 3) | (((x >> 4) & 1) << 2), ((x >> 2) & 3) | (((x >> 5) & 1) << 2))


def crumb_pair_table(codebook: torch.Tensor, order: torch.Tensor | None = None) -> torch.Tensor:
    """int32 [H, 256] from a width-3 codebook [H, 8]: entry x holds bf16 codebook[a] in its low half
    and codebook[b] in its high half, a and b as ``crumb_pair_order`` makes them from the byte
    ``crumb_pair_codes_*`` make (bits 6-7 ignored). ``order``: that index made beforehand. Device ops only."""
    return gather_pairs(codebook, crumb_pair_order(codebook.device) if order is None else order)


@gluon.jit
def _k_nibble_channel(ch, HEAD_DIM: gl.constexpr):
    """``k_nibble_channel`` in the kernel."""
    M: gl.constexpr = HEAD_DIM // 32
    return 8 * (((ch // 2) % 4) * M + ch // 32) + 2 * ((ch // 8) % 4) + ch % 2


@gluon.jit
def _v_nibble_channel(ch, HEAD_DIM: gl.constexpr):
    """``v_nibble_channel`` in the kernel."""
    M: gl.constexpr = HEAD_DIM // 32
    return 8 * (((ch % 8) >> 1) * M + ch // 32) + 2 * ((ch // 8) % 4) + (ch % 2)


@gluon.jit
def _k_stored_channel(ch, HEAD_DIM: gl.constexpr, BITS: gl.constexpr):
    """The stored channel of K operand channel ``ch`` at a width (``k_nibble_channel``,
    ``k_crumb_channel``; bit planes: ``ch``; 16: KV Exact4 pages, ``kv_exact4_gluon.x4_k_channel``, the
    nibble rows' order)."""
    if BITS == 4 or BITS == 16:
        return _k_nibble_channel(ch, HEAD_DIM)
    elif BITS == 3:
        return ((ch // 2) % 4 >> 1) * (HEAD_DIM // 2) + 16 * (ch // 32) + 4 * ((ch // 8) % 4) + 2 * ((ch // 2) % 2) + ch % 2
    else:
        return ch


@gluon.jit
def _v_stored_channel(ch, HEAD_DIM: gl.constexpr, BITS: gl.constexpr):
    """The stored channel of V^T operand row ``ch`` at a width (``v_nibble_channel``,
    ``v_crumb_channel``; bit planes: ``ch``; 16: KV Exact4 pages, ``kv_exact4_gluon.x4_v_channel``)."""
    if BITS == 4:
        return _v_nibble_channel(ch, HEAD_DIM)
    elif BITS == 16:
        return 8 * ((ch % 4) * (HEAD_DIM // 32) + ch // 32) + 4 * ((ch % 8) // 4) + 2 * ((ch // 16) % 2) + (ch // 8) % 2
    elif BITS == 3:
        return ((ch % 8) >> 2) * (HEAD_DIM // 2) + 16 * (ch // 32) + 4 * ((ch // 8) % 4) + (ch % 4)
    else:
        return ch


def compile_for_hopper(kernel, constexprs: dict, pointers: dict, num_warps: int, maxnreg: int | None = None,
                       num_stages: int | None = None, divisible: tuple[str, ...] = ()):
    """Compile a Gluon or Triton kernel (of any module here) for sm_90 without a GPU (as the CPU tests
    do): arguments in ``constexprs`` are constants, those in ``pointers`` have the given pointer types,
    other ``*_ptr`` arguments are int32 pointers, ``qk_scale`` fp32, the rest int32; the arguments
    named in ``divisible`` are taken as multiples of 16 (as a launch specializes aligned pointers and
    strides). Returns the compiled kernel and the bytes ptxas spills (its own report of the PTX, as the
    driver would assemble it)."""
    import inspect
    import re
    import subprocess
    import tempfile

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import get_ptxas
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource, GluonJITFunction

    # constexpr parameters not given take their defaults, as at a launch (else they would compile
    # as i32 arguments: another kernel than the one that runs)
    constexprs = {**{p.name: p.default for p in kernel.params
                     if p.is_constexpr and p.default is not inspect.Parameter.empty}, **constexprs}
    missing = [p.name for p in kernel.params if p.is_constexpr and p.name not in constexprs]
    if missing:
        raise ValueError(f"compile_for_hopper: no value for constexpr parameters {missing}")
    sig = {n: "constexpr" if n in constexprs else pointers.get(
        n, "*i32" if n.endswith("_ptr") else "fp32" if n == "qk_scale" else "i32") for n in kernel.arg_names}
    source = GluonASTSource if isinstance(kernel, GluonJITFunction) else ASTSource
    options = {"num_warps": num_warps, **({"maxnreg": maxnreg} if maxnreg else {}),
               **({"num_stages": num_stages} if num_stages else {})}
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in divisible}
    k = triton.compile(source(fn=kernel, signature=sig, constexprs=constexprs, attrs=attrs),
                       target=GPUTarget("cuda", 90, 32), options=options)
    with tempfile.TemporaryDirectory() as tmp:
        path = f"{tmp}/k.ptx"
        with open(path, "w") as f:
            f.write(k.asm["ptx"])
        log = subprocess.run([get_ptxas(90).path, "-arch=sm_90a", "-v", path, "-o", path + ".o"],
                             capture_output=True, text=True, check=True).stderr
    return k, sum(int(x) for x in re.findall(r"(\d+) bytes spill stores", log))


# ----------------------------------------------------------------------------------------------------
# layouts
# ----------------------------------------------------------------------------------------------------


@constexpr_function
def k_layout(nw: int, m: int) -> gl.BlockedLayout:
    """K pair tensor [NW, 2 (nh), 8 (nl), M, 4 (i), 4 (t), 2 (b)]: channel 32 m + 8 i + 2 t + b of page
    row 8 nh + nl. Registers b, nh, i, m and lanes t, nl: after merging (nh, nl) and (m, i, t, b), the
    mma.sync A-operand register layout of K [NW, 16, HEAD_DIM]."""
    return gl.BlockedLayout(size_per_thread=[1, 2, 1, m, 4, 1, 2], threads_per_warp=[1, 1, 8, 1, 1, 4, 1],
                            warps_per_cta=[nw, 1, 1, 1, 1, 1, 1], order=[6, 1, 4, 3, 5, 2, 0])


@constexpr_function
def v_layout(nw: int, m: int) -> gl.BlockedLayout:
    """V pair tensor [NW, M, 2 (i1), 2 (i0), 8 (j), 2 (th), 4 (tl), 2 (e)]: channel 32 m + 16 i1 + 8 i0 + j
    of page row 8 th + 2 tl + e. Registers e, i0, th, i1, m and lanes tl, j: merged, the A-operand
    layout of V^T [NW, HEAD_DIM, 16]."""
    return gl.BlockedLayout(size_per_thread=[1, m, 2, 2, 1, 2, 1, 2], threads_per_warp=[1, 1, 1, 1, 8, 1, 4, 1],
                            warps_per_cta=[nw, 1, 1, 1, 1, 1, 1, 1], order=[7, 3, 5, 2, 1, 6, 4, 0])


@constexpr_function
def words_layout(layout: gl.BlockedLayout, dim_m: int) -> gl.BlockedLayout:
    """``layout`` with dim ``dim_m`` (a page row's plane words) first in its order: the same mapping on
    the words' shape (whose dims before it in ``layout``'s order have size 1), but Triton sees the
    words contiguous in registers and loads them as vectors."""
    order = [dim_m] + [d for d in layout.order if d != dim_m]
    return gl.BlockedLayout(layout.size_per_thread, layout.threads_per_warp, layout.warps_per_cta, order)


@constexpr_function
def _axis_layout(layout, dim, rank):
    """``layout`` with every dim but ``dim`` sliced off (highest first)."""
    for d in reversed(range(rank)):
        if d != dim:
            layout = gl.SliceLayout(d, layout)
    return layout


# the head's K and V scale grids (256 fp32 each) after the pair tables (staged path)
_GRID_WORDS = gl.constexpr(512)


@constexpr_function
def _table_words(ek, ev):
    """Shared words of the pair tables: one 64-word row per entry (``_fill_tables``), as many rows as
    the larger table has entries (a power of two)."""
    return max(ek, ev) * 64


# a staged compact page's slot (bytes): a 64-byte header (the block number the copies carried at 0,
# the planes' shifts at 4, K's and V's 16 scale-index bytes at 16 and 32), then K's planes at 64 and
# V's at 96 + K's bytes, each shifted by its page's byte offset mod 32 (16 or 0) so that a global
# sector's two chunks land in one aligned 32 bytes
SLOT_HDR = gl.constexpr(64)


@constexpr_function
def slot_k_offset(align):
    """Byte offset of K's planes in a slot, before their shift: after the header, or (``align``,
    ``KernelConfig.gluon_copy_align``) at 128, so that the copies write whole 128-byte lines."""
    return 128 if align else SLOT_HDR.value


@constexpr_function
def slot_v_offset(k_bytes, align):
    """Byte offset of V's planes in a slot, before their shift (``k_bytes``: K's planes): 32 bytes
    after K's (the K shift's room and V's 32-byte alignment), or (``align``) at the first 128-byte
    line after K's planes and shift."""
    return slot_k_offset(True) + (k_bytes + 16 + 127) // 128 * 128 if align else SLOT_HDR.value + 32 + k_bytes


@constexpr_function
def _slot_words(bits_k, bits_v, head_dim, align=False, vpad=False, trig_chunks=0):
    """Shared words of one staged page (``SLOT_HDR``'s layout: header, K's bit planes, V's; 16 rows of
    head_dim bits per plane, 32-byte aligned with 16 bytes of room each), rounded up to 128 bytes
    (``vpad``: ``KernelConfig.gluon_v_pad``, V's 128-byte row pairs 160 bytes apart), then
    ``trig_chunks`` x 128 bytes for the page's rotary cos and sin (``slot_trig_offset``)."""
    v_bytes = bits_v * head_dim * 2
    if vpad and bits_v == 4 and head_dim == 128:
        v_bytes = v_bytes * 5 // 4
    # V's planes and 16 bytes of room for V's shift (``_issue_page``)
    b = slot_v_offset(bits_k * head_dim * 2, align) + 16 + v_bytes
    return (b + 127) // 128 * 32 + 32 * trig_chunks


@constexpr_function
def slot_trig_offset(bits_k, bits_v, head_dim, align=False, vpad=False):
    """Byte offset in a slot of the page's rotary cos and sin (``KernelConfig.gluon_rope_pos``): after
    the planes (``_slot_words`` without them), 8 bytes per listed pair (cos, sin of its phase at the
    page's first position, fp32), 16 pairs (128 bytes) per chunk (``_issue_trig``)."""
    return 4 * _slot_words(bits_k, bits_v, head_dim, align, vpad)


@constexpr_function
def rope_table_words(chunks, block_g):
    """Shared words of the rotary term's tables (``_rope_table_fill``), after the scale grids: per
    chunk of 16 pairs the rows' rotations (4 A-operand fragments of 32 lanes x 4 words) and the
    pairs' records (16 pairs x ``block_g`` heads, 4 words each)."""
    return chunks * (512 + 64 * block_g)


@functools.lru_cache(maxsize=None)  # asked at every launch of PagedDecodeAttention.run
def smem_offsets(bits_k: int, bits_v: int, head_dim: int, num_warps: int, stages: int,
                 align: bool = False, vpad: bool = False, rope_words: int = 0,
                 trig_chunks: int = 0) -> tuple[int, int, int]:
    """Byte offsets of the pair tables and of the staging buffer in the kernel's shared memory, and
    the end of both (``align``: ``KernelConfig.gluon_copy_align``'s slots; ``vpad``:
    ``KernelConfig.gluon_v_pad``'s; ``rope_words``: the rotary term's tables after the grids,
    ``rope_table_words``; ``trig_chunks``: the slots' room for the pages' rotary cos and sin,
    ``KernelConfig.gluon_rope_pos``). Only inline PTX reads and
    writes them (from ``global_smem``), so their order is ours: the kernel's two allocations, made
    first and live through the loop, reserve [0, end) in whichever order Triton places them (the
    compile test checks that the kernel's shared memory is exactly that: no Triton scratch lies in it)."""
    tab = (_table_words(table_entries(bits_k), table_entries(bits_v)) + _GRID_WORDS.value + rope_words) * 4
    stg = num_warps * stages * _slot_words(bits_k, bits_v, head_dim, align, vpad, trig_chunks) * 4
    return 0, tab, tab + stg


@constexpr_function
def copy_steps(nk, nv, align):
    """cp.async steps (of 32 lanes) per staged page: K's and V's ``nk`` + ``nv`` 16-byte chunks as one
    run, or (``align``) each side's own, rounded up to a power of two (the steps' arange)."""
    n = (nk + 31) // 32 + (nv + 31) // 32 if align else (nk + nv + 31) // 32
    return 1 << (n - 1).bit_length()


@gluon.jit
def aligned_copy_slot(i, lane, dk, dv, NK: gl.constexpr, NV: gl.constexpr):
    """``KernelConfig.gluon_copy_align``'s copies: (V's?, q, copied?) of lane ``lane`` at step ``i``.
    K's steps come first, ceil(NK / 32) of them, then V's. Lane l of a side's step s copies the 16
    bytes at q = 32 s + l from the page's 32-byte-aligned start to position q of the side's
    128-byte-aligned place in the slot, so that each 8 lanes write one 128-byte line: one shared
    wavefront a phase, where the default's copies, from a start 64 or 96 (+ 16) bytes into a line,
    cross a line in every phase (two wavefronts; Nsight Compute counted 8.2-8.6 a copy for 4).
    A side whose page lies 16 bytes past a 32-byte boundary (``dk`` / ``dv`` 1, its shift) thus has
    its chunk q - 1 at q, as the readers expect; q = 0 is not copied, nor q past the chunks, and the
    last chunk, when no step reaches it (``aligned_copy_last``), is copied apart. Integer arithmetic
    and ``gl.where``, so the tests run it on torch tensors (``.fn``)."""
    IK: gl.constexpr = (NK + 31) // 32
    is_v = i >= IK
    q = 32 * gl.where(is_v, i - IK, i) + lane
    d = gl.where(is_v, dv, dk)
    return is_v, q, (q >= d) & (q < gl.where(is_v, NV, NK) + d)


@constexpr_function
def aligned_copy_last(n):
    """Whether a side of ``n`` chunks, shifted, needs its last chunk copied apart from its steps
    (``aligned_copy_slot``: their q stop at 32 ceil(n / 32) - 1, and the last chunk is at n)."""
    return n % 32 == 0


# One 16-byte cp.async (global $2 to shared byte offset $1 of ``global_smem``) when $3 is not 0
_CP_ASYNC = gl.constexpr("{ .reg .pred p; .reg .u32 a; setp.ne.b32 p, $3, 0; mov.u32 a, global_smem; "
                         "add.u32 a, a, $1; @p cp.async.cg.shared.global [a], [$2], 16; mov.u32 $0, 0; }")
# a warp barrier (the slot about to be overwritten was last read by this warp's lanes), nothing else
_WARP_SYNC = gl.constexpr("bar.warp.sync -1; mov.u32 $0, 0;")
_COMMIT = gl.constexpr("cp.async.commit_group; mov.u32 $0, 0;")


@constexpr_function
def _cp_wait_asm(n):
    """Wait until at most ``n`` of this thread's commit groups are in flight, then a warp barrier (the
    staged words were copied by the warp's other lanes); passes $1 through, so the loads whose
    addresses derive from it cannot be scheduled before the wait."""
    return f"cp.async.wait_group {n}; bar.warp.sync -1; mov.u32 $0, $1;"


@constexpr_function
def _other_dims(dim, rank):
    return tuple(d for d in range(rank) if d != dim)


@gluon.jit
def _axis(n: gl.constexpr, dim: gl.constexpr, rank: gl.constexpr, layout: gl.constexpr):
    """arange(n) along ``dim`` of a rank-``rank`` ``layout``, as a broadcastable [1, .., n, .., 1] tensor."""
    return gl.expand_dims(gl.arange(0, n, layout=_axis_layout(layout, dim, rank)), _other_dims(dim, rank))


@gluon.jit
def _lds(addr):
    """int32 at byte offset ``addr`` of the dynamic shared memory (elementwise)."""
    return gl.inline_asm_elementwise(_LDS, "=r,r", [addr], dtype=gl.int32, is_pure=True, pack=1)


# int32 $2 to shared byte offset $1 of ``global_smem`` (Triton does not see it: no barrier added)
_STS = gl.constexpr("{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $1; st.shared.b32 [a], $2; mov.u32 $0, 0; }")


@gluon.jit
def _sts(addr, x):
    """Store int32 ``x`` at byte offset ``addr`` of the dynamic shared memory (elementwise)."""
    gl.inline_asm_elementwise(_STS, "=r,r,r", [addr, x], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _per_thread(asm: gl.constexpr, NW: gl.constexpr):
    """``asm`` once in every thread (not pure: kept in program order with the other inline PTX)."""
    WL: gl.constexpr = gl.BlockedLayout([1, 1], [1, 32], [NW, 1], [1, 0])
    gl.inline_asm_elementwise(asm, "=r,r", [gl.zeros([NW, 32], gl.int32, layout=WL)], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _carried_offsets(dst, first, head, stride_kb, stride_kh, stride_vb, stride_vh, PB_K: gl.constexpr,
                     PB_V: gl.constexpr, BLOCK_SIZE: gl.constexpr):
    """The K and V byte offsets of the page of token ``first`` from the block its slot at ``dst``
    carries (header byte 0: seeded, or copied by the copies of the page STAGES before)."""
    blk = _lds(dst).to(gl.int64)
    pib = (first % BLOCK_SIZE) // 16
    return blk * stride_kb + head * stride_kh + pib * PB_K, blk * stride_vb + head * stride_vh + pib * PB_V


# a 4-byte cp.async of $3 bytes (4, or 0: zero fill) from global $2 to shared byte $1, when $4 is not 0
_CP4_ON = gl.constexpr("{ .reg .pred p; .reg .u32 a; setp.ne.b32 p, $4, 0; mov.u32 a, global_smem; "
                       "add.u32 a, a, $1; @p cp.async.ca.shared.global [a], [$2], 4, $3; mov.u32 $0, 0; }")


@gluon.jit
def _carry_block(dst, fblk, t1, bt_row, LANE: gl.constexpr, BLOCK_SIZE: gl.constexpr, SL: gl.constexpr):
    """A 4-byte cp.async from lane ``LANE`` of each warp (``dst``, ``fblk``: [NW, 1] of ``SL``): the block
    of token ``fblk`` (block 0 past t1: the copy's zero fill) to shared byte ``dst``."""
    lane = _axis(32, 1, 2, SL)
    gl.inline_asm_elementwise(_CP4_ON, "=r,r,l,r,r", [dst + 0 * lane, bt_row + fblk // BLOCK_SIZE + 0 * lane,
                                                      gl.where(fblk < t1, 4, 0) + 0 * lane, (lane == LANE).to(gl.int32)],
                              dtype=gl.int32, is_pure=False, pack=1)


# the slot header's mbarrier (``KernelConfig.gluon_bulk_copy``: 8 bytes at 48, after V's scale indices)
SLOT_BAR = gl.constexpr(48)
_BULK = "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes"


@constexpr_function
def _bulk_issue_asm(k_bytes, v_bytes, koff, voff, vpad):
    """One lane's bulk copies of a page into a slot (``_issue_page`` with ``BULK``): $1 the predicate,
    $2 the slot's shared byte offset, $3/$4 K's/V's shift, $5/$6 the K/V page in global memory. The
    slot's mbarrier (``SLOT_BAR``) expects the bytes, then K's planes, K's 16 scale-index bytes, V's
    planes (``vpad``: as ``v_padded_chunk`` places them, one 128-byte row pair a copy) and
    V's scale indices complete on it. No proxy fence: the warp's earlier reads of the slot (generic
    proxy) completed before this (their values fed the products, and a warp barrier precedes), and a
    generic-to-async fence orders generic *writes* before async reads (a bulk store), not this; its
    ``MEMBAR.ALL.CTA`` would also wait out the warp's outstanding 4-byte carry copies each page."""
    tx = k_bytes + v_bytes + 32
    lines = ["{ .reg .pred p; .reg .u32 g, bar, d; .reg .u64 s; setp.ne.b32 p, $1, 0;",
             "mov.u32 g, global_smem; add.u32 g, g, $2; add.u32 bar, g, %d;" % SLOT_BAR.value,
             "@p mbarrier.arrive.expect_tx.shared::cta.b64 _, [bar], %d;" % tx,
             "add.u32 d, g, %d; add.u32 d, d, $3; @p %s [d], [$5], %d, [bar];" % (koff, _BULK, k_bytes),
             "add.u32 d, g, 16; add.u64 s, $5, %d; @p %s [d], [s], 16, [bar];" % (k_bytes, _BULK),
             "add.u32 d, g, %d; add.u32 d, d, $4;" % voff]
    if vpad:
        for pair in range(v_bytes // 128):
            lines.append("add.u64 s, $6, %d; @p %s [d], [s], 128, [bar]; add.u32 d, d, 160;" % (128 * pair, _BULK))
    else:
        lines.append("@p %s [d], [$6], %d, [bar];" % (_BULK, v_bytes))
    lines.append("add.u32 d, g, 32; add.u64 s, $6, %d; @p %s [d], [s], 16, [bar]; mov.u32 $0, 0; }" % (v_bytes, _BULK))
    return " ".join(lines)


@constexpr_function
def _warp_slot_asm(stage_off, stages, slot_bytes, slot):
    """PTX that sets u32 ``a`` to the shared address of this thread's warp's slot ``slot`` (an operand
    or a constant) mbarrier (the warp from %tid.x: ``_slot_base``'s order, warp-major)."""
    return ("mov.u32 t, %%tid.x; shr.u32 t, t, 5; mul.lo.u32 t, t, %d; add.u32 t, t, %s; mul.lo.u32 t, t, %d; "
            "mov.u32 a, global_smem; add.u32 a, a, t; add.u32 a, a, %d;"
            % (stages, slot, slot_bytes, stage_off + SLOT_BAR.value))


@constexpr_function
def _bulk_wait_asm(stage_off, stages, slot_bytes):
    """Every thread waits for phase parity $2 of its warp's slot $1's mbarrier (the page's bulk copies
    landed; acquire: their bytes are visible), then passes $1 through (``_wait_stage``'s pattern)."""
    return ("{ .reg .pred p; .reg .u32 t, a; " + _warp_slot_asm(stage_off, stages, slot_bytes, "$1") +
            " WAIT: mbarrier.try_wait.parity.shared::cta.b64 p, [a], $2; @!p bra WAIT; mov.u32 $0, $1; }")


@constexpr_function
def _bulk_init_asm(stage_off, stages, slot_bytes):
    """Lane 0 of each warp initialises its ``stages`` slots' mbarriers (one arrival a phase: the
    issuing lane's expect_tx), fences the initialisation for the copy engine; then a warp barrier."""
    body = " ".join("@p mbarrier.init.shared::cta.b64 [a], 1; add.u32 a, a, %d;" % slot_bytes for _ in range(stages))
    return ("{ .reg .pred p; .reg .u32 t, a, l; mov.u32 l, %tid.x; and.b32 l, l, 31; setp.eq.u32 p, l, 0; " +
            _warp_slot_asm(stage_off, stages, slot_bytes, "0") + " " + body +
            " @p fence.mbarrier_init.release.cluster; bar.warp.sync -1; mov.u32 $0, $1; }")


@gluon.jit
def _bulk_wait(slot, parity, STAGE_OFF: gl.constexpr, STAGES: gl.constexpr, SLOTW: gl.constexpr):
    """Wait for the bulk copies of this warp's slot ``slot`` (phase ``parity``); returns ``slot``."""
    return gl.inline_asm_elementwise(_bulk_wait_asm(STAGE_OFF, STAGES, 4 * SLOTW), "=r,r,r", [slot, parity],
                                     dtype=gl.int32, is_pure=False, pack=1)


# an 8-byte cp.async (global $2 to shared byte offset $1 of ``global_smem``) when $3 is not 0
_CP8_ON = gl.constexpr("{ .reg .pred p; .reg .u32 a; setp.ne.b32 p, $3, 0; mov.u32 a, global_smem; "
                       "add.u32 a, a, $1; @p cp.async.ca.shared.global [a], [$2], 8; mov.u32 $0, 0; }")


@gluon.jit
def _issue_trig(d2, trow, tp0, tp1, TOFF: gl.constexpr, NCHUNK: gl.constexpr, SL: gl.constexpr):
    """The page's rotary cos and sin (``KernelConfig.gluon_rope_pos``) into the slot at ``d2`` ([NW, 1]
    of ``SL``) + TOFF, 8 bytes per listed pair i (``slot_trig_offset``), from its row of
    ``rope_page_table`` (``trow``: the row's first element, [NW, 1]); lane l copies pairs l and (with
    more than 2 chunks) l + 32, at element offsets ``tp0`` / ``tp1`` ([1, 32]: 2 x the listed pair) in
    the row. Issued with the page's copies, so its commit group covers them."""
    lane = _axis(32, 1, 2, SL)
    on = (lane < 16 * NCHUNK).to(gl.int32) + 0 * d2
    gl.inline_asm_elementwise(_CP8_ON, "=r,r,l,r", [d2 + TOFF + 8 * lane, trow + tp0, on], dtype=gl.int32,
                              is_pure=False, pack=1)
    if NCHUNK > 2:
        on = (lane < 16 * NCHUNK - 32).to(gl.int32) + 0 * d2
        gl.inline_asm_elementwise(_CP8_ON, "=r,r,l,r", [d2 + (TOFF + 256) + 8 * lane, trow + tp1, on], dtype=gl.int32,
                                  is_pure=False, pack=1)


@gluon.jit
def _issue_page(k_pages_ptr, v_pages_ptr, ok, ov, dst, fblk, t1, bt_row, NK: gl.constexpr, NV: gl.constexpr,
                NCH: gl.constexpr, BLOCK_SIZE: gl.constexpr, NW: gl.constexpr, IL: gl.constexpr,
                VPAD: gl.constexpr = False, ALIGN: gl.constexpr = False, BULK: gl.constexpr = False,
                TRIG: gl.constexpr = 0, TOFF: gl.constexpr = 0, trow=None, tp0=None, tp1=None):
    """cp.async of one page's K and V planes (``ok``/``ov``: its byte offsets, [NW, 1, 1] in ``IL``;
    chunk c = lane + 32 i, K's first) into a slot of ``SLOT_HDR``'s layout at ``dst``: the planes shifted
    by their pages' offsets mod 32, the two scale-index chunks into the header, and the block of token
    ``fblk`` (block 0 past t1: the copy's zero fill) carried to header byte 0, as one commit group;
    then the shifts into header word 1. No global load waits: the slot's next page takes its block
    from there (``_carried_offsets``). ``VPAD``: V's chunks in ``v_padded_chunk``'s places;
    ``ALIGN``: each side's chunks by ``aligned_copy_slot``, at ``slot_k_offset`` / ``slot_v_offset``;
    ``BULK``: the planes and scale indices by the copy engine instead (``_bulk_issue_asm``; the
    block's carry and the shifts as above). ``TRIG`` chunks: the page's rotary cos and sin too
    (``_issue_trig``, at slot byte TOFF)."""
    KB: gl.constexpr = 16 * NK
    KOFF: gl.constexpr = slot_k_offset(ALIGN)
    VOFF: gl.constexpr = slot_v_offset(KB, ALIGN)
    c = _axis(32, 1, 3, IL) + 32 * _axis(NCH, 2, 3, IL)
    sk = (ok & 16).to(gl.int32)
    sv = (ov & 16).to(gl.int32)
    # the warp's page, one value per lane ([NW, 32] of SL) for the header lanes and the copy engine
    SL: gl.constexpr = gl.SliceLayout(2, IL)
    lane = _axis(32, 1, 2, SL)
    d2 = gl.max(dst, axis=2)
    skl = gl.max(sk, axis=2)
    svl = gl.max(sv, axis=2)
    if BULK:
        # lane 0: the copy engine (K's and V's planes and scale indices, one mbarrier phase)
        _per_thread(_WARP_SYNC, NW)
        z = 0 * lane
        gl.inline_asm_elementwise(_bulk_issue_asm(KB, 16 * NV, KOFF, VOFF, VPAD), "=r,r,r,r,r,l,l",
                                  [(lane == 0).to(gl.int32), d2 + z, skl + z, svl + z,
                                   k_pages_ptr + gl.max(ok, axis=2) + z, v_pages_ptr + gl.max(ov, axis=2) + z],
                                  dtype=gl.int32, is_pure=False, pack=1)
    else:
        if ALIGN:
            is_v, q, cp = aligned_copy_slot(_axis(NCH, 2, 3, IL), _axis(32, 1, 3, IL), sk >> 4, sv >> 4, NK, NV)
            src = gl.where(is_v, v_pages_ptr + (ov - sv) + 16 * q, k_pages_ptr + (ok - sk) + 16 * q)
            on = cp.to(gl.int32)
            if VPAD:
                off = dst + gl.where(is_v, VOFF + sv + 16 * v_padded_chunk(q - (sv >> 4)), KOFF + 16 * q)
            else:
                off = dst + gl.where(is_v, VOFF, KOFF) + 16 * q
        else:
            src = gl.where(c < NK, k_pages_ptr + ok + 16 * c, v_pages_ptr + ov + 16 * (c - NK))
            on = (c < NK + NV).to(gl.int32) + 0 * sk
            cv = c - NK
            if VPAD:
                cv = v_padded_chunk(cv)
            off = dst + gl.where(c < NK, KOFF + sk + 16 * c, VOFF + sv + 16 * cv)
        _per_thread(_WARP_SYNC, NW)
        gl.inline_asm_elementwise(_CP_ASYNC, "=r,r,l,r", [off, src, on], dtype=gl.int32, is_pure=False, pack=1)
        okl = gl.max(ok, axis=2)
        ovl = gl.max(ov, axis=2)
        # lanes 0 and 1: the scale indices (16 bytes after each side's planes)
        ssrc = gl.where(lane == 0, k_pages_ptr + okl + KB, v_pages_ptr + ovl + 16 * NV)
        soff = d2 + 16 + 16 * lane
        son = lane < 2
        if ALIGN:
            # lanes 3 and 4: K's and V's last chunk, when shifted and no step reached it
            if aligned_copy_last(NK):
                ssrc = gl.where(lane == 3, k_pages_ptr + okl + 16 * (NK - 1), ssrc)
                soff = gl.where(lane == 3, d2 + KOFF + 16 * NK, soff)
                son = son | ((lane == 3) & (skl != 0))
            if aligned_copy_last(NV):
                vlast = (NV - 1) + 0 * lane
                if VPAD:
                    vlast = v_padded_chunk(vlast)
                ssrc = gl.where(lane == 4, v_pages_ptr + ovl + 16 * (NV - 1), ssrc)
                soff = gl.where(lane == 4, d2 + VOFF + svl + 16 * vlast, soff)
                son = son | ((lane == 4) & (svl != 0))
        gl.inline_asm_elementwise(_CP_ASYNC, "=r,r,l,r", [soff, ssrc, son.to(gl.int32)],
                                  dtype=gl.int32, is_pure=False, pack=1)
    if TRIG > 0:
        _issue_trig(d2, trow, tp0, tp1, TOFF, TRIG, SL)
    # lane 2: the block the slot's next page is in
    _carry_block(d2, gl.max(fblk, axis=2), t1, bt_row, 2, BLOCK_SIZE, SL)
    _per_thread(_COMMIT, NW)
    _sts(d2 + 4 + 0 * lane, skl + (svl << 16) + 0 * lane)


@gluon.jit
def _seed_block(dst, first, t1, bt_row, BLOCK_SIZE: gl.constexpr, SL: gl.constexpr):
    """The block of token ``first`` into header byte 0 of the slot at ``dst`` ([NW, 1] of ``SL``), as
    the copies STAGES pages before would have carried it (every lane stores it)."""
    lane = _axis(32, 1, 2, SL)
    blk = _block_of(bt_row, first, t1, BLOCK_SIZE)
    _sts(dst + 0 * lane, blk + 0 * lane)


@gluon.jit
def _staged_scales(base, r, grid_off, side: gl.constexpr):
    """grid[head, k] of rows ``r`` of the staged page whose slot is at shared byte ``base`` (k: the
    row's scale-index byte in the header, ``side`` 0 K, 1 V; the grid at ``grid_off``, staged)."""
    w = _lds(base + 16 + 16 * side + (r // 4) * 4)
    k = (w >> (8 * (r % 4))) & 0xFF
    return _lds(grid_off + 1024 * side + 4 * k).to(gl.float32, bitcast=True)


@gluon.jit
def _fill_grids(k_grid, v_grid, OFF: gl.constexpr, NW: gl.constexpr):
    """The head's K and V scale grids (256 fp32 each, rows ``k_grid``, ``v_grid``) at shared byte OFF."""
    GL: gl.constexpr = gl.BlockedLayout([1], [32], [NW], [0])
    i = gl.arange(0, 256, layout=GL)
    _sts(OFF + 4 * i, gl.load(k_grid + i).to(gl.int32, bitcast=True))
    _sts(OFF + 1024 + 4 * i, gl.load(v_grid + i).to(gl.int32, bitcast=True))


@gluon.jit
def _wait_stage(slot, N: gl.constexpr):
    """This warp's stages but the last ``N`` have landed and are visible to all its lanes; returns
    ``slot`` (a scalar) through the wait: the staged loads' addresses are computed from it."""
    return gl.inline_asm_elementwise(_cp_wait_asm(N), "=r,r", [slot], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _staged_plane(base, r, m, p: gl.constexpr, M: gl.constexpr, L: gl.constexpr, VEC: gl.constexpr = 1):
    """Word m of bit plane p of rows ``r`` (rows of M words) from a staged page at shared byte ``base``
    (derived from ``_wait_stage``'s result), relaid out to ``L``. ``VEC`` (2 or 4): the words are
    loaded VEC at a time (``ld.shared.v2``/``.v4``): the addresses' layout must hold VEC consecutive,
    VEC-word aligned words of a row in consecutive registers (``words_layout``)."""
    return gl.convert_layout(_lds_words(base + p * (64 * M) + r * (4 * M) + 4 * m, VEC), L, assert_trivial=True)


@gluon.jit
def _lds_words(addr, VEC: gl.constexpr):
    """The int32 words at shared byte offsets ``addr``, ``VEC`` (1, 2 or 4) consecutive ones per
    ``ld.shared`` (``ld.shared.v2``/``.v4``: ``addr``'s layout must hold VEC consecutive, VEC-word
    aligned words in consecutive registers, ``words_layout``)."""
    if VEC > 1:
        return gl.inline_asm_elementwise(_lds_vec_asm(VEC), _lds_vec_constraints(VEC), [addr], dtype=gl.int32,
                                         is_pure=True, pack=VEC)
    else:
        return _lds(addr)


@gluon.jit
def _entry_codes(x, BITS: gl.constexpr):
    """The codes (a, b) of pair-table entry ``x`` at a width, as the host's gather indexes order them:
    width 4 code order (``paged_decode.compact_pair_order``), width 3 the crumb byte
    (``crumb_pair_order``), else interleaved bits (``interleaved_pair_order``)."""
    if BITS == 4:
        a = x & 15
        b = x >> 4
    elif BITS == 3:
        a = (x & 3) | (((x >> 4) & 1) << 2)
        b = ((x >> 2) & 3) | (((x >> 5) & 1) << 2)
    else:
        a = x & 1
        b = (x >> 1) & 1
        if BITS == 2:
            a |= ((x >> 2) & 1) << 1
            b |= ((x >> 3) & 1) << 1
    return a, b


@gluon.jit
def _bf16_bits(cb, a):
    """The bf16 bits of codebook[a] in the low half of an int32 (cb: fp32 or bf16 codebook row;
    rounded to nearest even as torch's ``.to(torch.bfloat16)``)."""
    return gl.load(cb + a).to(gl.bfloat16).to(gl.int16, bitcast=True).to(gl.int32) & 0xFFFF


@gluon.jit
def _entry_row(a, b, BITS: gl.constexpr):
    """The pair-table entry of codes (a, b) at a width: ``_entry_codes``' inverse (at width 3 the
    entry in rows 0-63; rows 64 r + x, r = 1..3, hold the same pair)."""
    if BITS == 4:
        x = a | (b << 4)
    elif BITS == 3:
        x = (a & 3) | ((b & 3) << 2) | ((a >> 2) << 4) | ((b >> 2) << 5)
    elif BITS == 2:
        x = (a & 1) | ((b & 1) << 1) | ((a >> 1) << 2) | ((b >> 1) << 3)
    else:
        x = a | (b << 1)
    return x


@gluon.jit
def _fill_table(cb, BITS: gl.constexpr, OFF: gl.constexpr, NW: gl.constexpr):
    """32 copies of one pair table (codebook row ``cb``) at shared byte offset OFF: entry x of lane l
    at byte OFF + 256 x + 4 l. A thread holds every code a (its N loads of codebook[a]) against a few
    codes b (in rows h = b + N r: width 3 repeats its 64 entries 4 times), so it loads and converts
    N + E / (N NW) codebook values and stores E / NW words, in bank l of lane l. The stores are
    inline PTX: Triton would put a CTA barrier before each of its stores into the buffer."""
    N: gl.constexpr = 1 << BITS
    H: gl.constexpr = table_entries(BITS) // N
    L3: gl.constexpr = gl.BlockedLayout([1, N, 1], [1, 1, 32], [NW, 1, 1], [2, 1, 0])
    h = _axis(H, 0, 3, L3)
    a = _axis(N, 1, 3, L3)
    word = _bf16_bits(cb, a) | (_bf16_bits(cb, h % N) << 16)  # [1, N, 1] | [H, 1, 1]: N + H / NW loads
    row = _entry_row(a, h % N, BITS) + (h // N) * (N * N)
    _sts(OFF + 256 * row + 4 * _axis(32, 2, 3, L3), word)


@gluon.jit
def _fill_tables(k_cb, v_cb, BITS_K: gl.constexpr, BITS_V: gl.constexpr, NW: gl.constexpr,
                 TAB_OFF: gl.constexpr):
    """32 copies of the K and V pair tables, made from the codebook rows ``k_cb``, ``v_cb`` (fp32 or
    bf16; entry x = bf16 codebook[a] | bf16 codebook[b] << 16 for x's codes (a, b), ``_entry_codes``),
    at shared byte TAB_OFF, one 64-word row per entry: K's entry x for lane l at word 64 x + l, V's at
    64 x + 32 + l. Lane l reads copy l, in bank l, so a warp's lookups never conflict, and a lookup's
    byte address is the pair code in bits 8-15 beside the lane's offset in bits 0-7 (``_lookup``: one
    byte permute). The words past a table's entries (the smaller one's rows) are left unwritten:
    no code reads them."""
    _fill_table(k_cb, BITS_K, TAB_OFF, NW)
    _fill_table(v_cb, BITS_V, TAB_OFF + 128, NW)


@gluon.jit
def _tile_first(lo, j, NW: gl.constexpr, rank: gl.constexpr, layout: gl.constexpr):
    """First token of warp w's page in iteration j (warp w takes page j * NW + w of the split), as a
    [NW, 1, ...] tensor of ``layout``."""
    return lo + (j * NW + _axis(NW, 0, rank, layout)) * 16


@gluon.jit
def _block_of(bt_row, first, t1, BLOCK_SIZE: gl.constexpr):
    """The block holding token ``first`` (a page's first token); block 0 past t1."""
    return gl.load(bt_row + first // BLOCK_SIZE, mask=first < t1, other=0)


@gluon.jit
def _page_offset(bt_row, first, t1, head, stride_b, stride_h, PB: gl.constexpr, BLOCK_SIZE: gl.constexpr):
    """Byte offset of the page holding token ``first`` (a page's first token) in the pool; 0 past t1."""
    blk = _block_of(bt_row, first, t1, BLOCK_SIZE)
    return blk.to(gl.int64) * stride_b + head * stride_h + ((first % BLOCK_SIZE) // 16) * PB


@gluon.jit
def _scales(pages_ptr, grid_ptr, bt_row, first, r, t0, t1, head, stride_b, stride_h, PB: gl.constexpr,
            BLOCK_SIZE: gl.constexpr, SIDX_OFF: gl.constexpr):
    """grid[head, k] of page rows ``r`` of the page of ``first`` (k: the row's scale index, stored after
    the planes; 0 outside [t0, t1))."""
    valid = (first + r >= t0) & (first + r < t1)
    poff = _page_offset(bt_row, first, t1, head, stride_b, stride_h, PB, BLOCK_SIZE)
    k = gl.load(pages_ptr + poff + SIDX_OFF + r, mask=valid, other=0).to(gl.int32)
    return gl.load(grid_ptr + head * 256 + k)


@gluon.jit
def _plane(pages_ptr, poff, r, m, p: gl.constexpr, M: gl.constexpr, L: gl.constexpr):
    """Word m of bit plane p of page rows ``r``, relaid out to ``L``. Not masked: the page is in the
    pool (past the split's end ``_page_offset`` gives block 0's), and rows outside [t0, t1) get
    logits of -inf and softmax weights of 0 (their values are finite codebook entries)."""
    # pages start 16-byte aligned (PagedDecodeAttention checks; "// 16 * 16" tells the compiler): a
    # row's M words load as vectors
    wptr = (pages_ptr + poff // 16 * 16).to(gl.pointer_type(gl.int32))
    return gl.convert_layout(gl.load(wptr + p * (16 * M) + r * M + m), L, assert_trivial=True)


@gluon.jit
def _plane_or_staged(pages_ptr, off, r, m, p: gl.constexpr, M: gl.constexpr, L: gl.constexpr, STAGED: gl.constexpr,
                     VEC: gl.constexpr = 1):
    if STAGED:
        return _staged_plane(off, r, m, p, M, L, VEC)
    else:
        return _plane(pages_ptr, off, r, m, p, M, L)


@gluon.jit
def _planes(pages_ptr, off, r, m, BITS: gl.constexpr, M: gl.constexpr, L: gl.constexpr, STAGED: gl.constexpr = False):
    """Bit planes 0..BITS-1 (2 or 3; the ones past BITS repeat the last, unused) of the page at byte
    ``off`` of the pool, or (``STAGED``) at shared byte ``off``. (Width 4 is nibble rows: ``_words``.)"""
    VEC: gl.constexpr = _vec_words(M)
    w0 = _plane_or_staged(pages_ptr, off, r, m, 0, M, L, STAGED, VEC)
    w1 = _plane_or_staged(pages_ptr, off, r, m, 1, M, L, STAGED, VEC)
    w2 = w1
    w3 = w1
    if BITS > 2:
        w2 = _plane_or_staged(pages_ptr, off, r, m, 2, M, L, STAGED, VEC)
        w3 = w2
    return w0, w1, w2, w3


@gluon.jit
def _words(pages_ptr, off, r, m, q4, q3, BITS: gl.constexpr, M: gl.constexpr, L: gl.constexpr, STAGED: gl.constexpr):
    """``_planes`` of rows ``r``, word ``m`` of each plane row; at width 4 (nibble rows of 4 M words)
    word ``q4`` of each row as the first of four (the others repeat it, unused); at width 3 (rows of
    2 M crumb words and M bit-2 words) crumb word ``q3`` and bit-2 word m as the first two."""
    if BITS == 4:
        w = _plane_or_staged(pages_ptr, off, r, q4, 0, 4 * M, L, STAGED, _vec_words(M))
        return w, w, w, w
    elif BITS == 3:
        c = _plane_or_staged(pages_ptr, off, r, q3, 0, 3 * M, L, STAGED, _vec_words(M))
        p = _plane_or_staged(pages_ptr, off, r, 2 * M + m, 0, 3 * M, L, STAGED, _vec_words(M))
        return c, p, p, p
    else:
        return _planes(pages_ptr, off, r, m, BITS, M, L, STAGED)


@gluon.jit
def _k_word_index(M: gl.constexpr, LW: gl.constexpr):
    """Word m of plane rows (and of the bit-2 words), the nibble-row word (``k_nibble_channel``) of
    lane t, t M + m, and its crumb word (``k_crumb_channel``), (t >> 1) M + m."""
    m = _axis(M, 3, 7, LW)
    t = _axis(4, 5, 7, LW)
    return m, t * M + m, (t >> 1) * M + m


@gluon.jit
def _v_word_index(M: gl.constexpr, LW: gl.constexpr):
    """Word m of plane rows (and of the bit-2 words), the nibble-row word (``v_nibble_channel``) of
    lane j, (j >> 1) M + m, and its crumb word (``v_crumb_channel``), (j >> 2) M + m."""
    m = _axis(M, 1, 8, LW)
    j = _axis(8, 4, 8, LW)
    return m, (j >> 1) * M + m, (j >> 2) * M + m


@gluon.jit
def v_padded_chunk(cv):
    """Where a staged V page of 128-channel nibble rows (4 16-byte chunks a row) holds its chunk ``cv``
    with ``KernelConfig.gluon_v_pad``: its 128-byte row pairs 160 bytes apart (the slot's V takes
    1280 bytes for 1024), each pair one run as copied. The V operand's staged reads
    (``_v_words_staged``: lane 4 j + tl reads chunk j >> 1 of rows 2 tl + e, 8 th + 2 tl + e, one
    16-byte ``ld.shared.v4`` each) find unpadded rows 2 tl + e, 128 bytes apart, in one bank group:
    4 wavefronts a phase, 16 a load instead of 4 (Nsight Compute, H100, BENCHMARKS.md). Padded, pair
    p starts 32 p mod 128 bytes into the bank groups, so a phase's 4 rows fall in 4 groups (one
    wavefront), and 160 keeps each chunk's address mod 32.

    Session 31 measured this and two swizzles (chunks permuted within a row, or whole 32-byte
    sectors moved within a row pair) on an H100 with the per-lane cp.async copies: q4 0.91-1.01x,
    since a copy whose lanes' bytes do not land as one contiguous run costs more global sectors and
    shared wavefronts (18-21.5 and 12.4-13.9 a V copy against 16.5 and 8.2) than the loads save.
    The swizzles were removed; the padding is kept for ``KernelConfig.gluon_bulk_copy``, whose copy
    engine moves each pair as a run. Plain integer arithmetic, so the tests run it on torch tensors
    (``.fn``)."""
    return cv + 2 * (cv >> 3)


@gluon.jit
def v_padded_word(q4, r):
    """``v_padded_chunk`` for a reader: the place of word ``q4`` (of 16) of row ``r``, as words from
    row r's unpadded start (8 words of padding a row pair before it)."""
    return q4 + 8 * (r >> 1)


@gluon.jit
def _k_words(pages_ptr, poff, BITS: gl.constexpr, M: gl.constexpr, LK: gl.constexpr):
    """A K page's words for the K operand, row 8 nh + nl: plane words [NW, 2 (nh), 8 (nl), M, 1, 1, 1],
    or at width 4 nibble words [NW, 2, 8, M, 1, 4 (t), 1]."""
    LW: gl.constexpr = words_layout(LK, 3)
    r = 8 * _axis(2, 1, 7, LW) + _axis(8, 2, 7, LW)
    m, q4, q3 = _k_word_index(M, LW)
    return _words(pages_ptr, gl.convert_layout(poff, LW, assert_trivial=True), r, m, q4, q3, BITS, M, LK, False)


@gluon.jit
def _v_words(pages_ptr, poff, e: gl.constexpr, BITS: gl.constexpr, M: gl.constexpr, LV: gl.constexpr):
    """A V page's words of its even (e = 0) or odd (e = 1) rows, row 8 th + 2 tl + e: plane words
    [NW, M, 1, 1, 1, 2 (th), 4 (tl), 1], or at width 4 nibble words [NW, M, 1, 1, 8 (j), 2, 4, 1]."""
    LW: gl.constexpr = words_layout(LV, 1)
    r = 8 * _axis(2, 5, 8, LW) + 2 * _axis(4, 6, 8, LW) + e
    m, q4, q3 = _v_word_index(M, LW)
    return _words(pages_ptr, gl.convert_layout(poff, LW, assert_trivial=True), r, m, q4, q3, BITS, M, LV, False)


@gluon.jit
def _slot_base(slot, STAGE_OFF: gl.constexpr, STAGES: gl.constexpr, SLOTW: gl.constexpr, NW: gl.constexpr,
               rank: gl.constexpr, L: gl.constexpr):
    """Shared byte offset of each warp's slot ``slot`` ([NW, 1, ...] in ``L``): warp w's slots are
    consecutive."""
    return STAGE_OFF + (_axis(NW, 0, rank, L) * STAGES + slot) * (4 * SLOTW)


@gluon.jit
def _k_words_staged(slot, STAGE_OFF: gl.constexpr, STAGES: gl.constexpr, SLOTW: gl.constexpr, BITS: gl.constexpr,
                    M: gl.constexpr, NW: gl.constexpr, LK: gl.constexpr, ALIGN: gl.constexpr = False):
    """``_k_words`` from the warp's staged page in ``slot`` (its planes at ``slot_k_offset`` plus their
    shift)."""
    LW: gl.constexpr = words_layout(LK, 3)
    r = 8 * _axis(2, 1, 7, LW) + _axis(8, 2, 7, LW)
    base = _slot_base(slot, STAGE_OFF, STAGES, SLOTW, NW, 7, LW)
    base = base + slot_k_offset(ALIGN) + (_lds(base + 4) & 0xFFFF)
    m, q4, q3 = _k_word_index(M, LW)
    return _words(None, base, r, m, q4, q3, BITS, M, LK, True)


@gluon.jit
def _v_words_staged(slot, e: gl.constexpr, STAGE_OFF: gl.constexpr, STAGES: gl.constexpr, SLOTW: gl.constexpr,
                    K_BYTES: gl.constexpr, BITS: gl.constexpr, M: gl.constexpr, NW: gl.constexpr, LV: gl.constexpr,
                    VPAD: gl.constexpr = False, ALIGN: gl.constexpr = False):
    """``_v_words`` from the warp's staged page in ``slot`` (V's planes at ``slot_v_offset`` of K's
    ``K_BYTES``, plus their shift; ``VPAD``: nibble rows of 128 channels in padded row pairs,
    ``v_padded_word``)."""
    LW: gl.constexpr = words_layout(LV, 1)
    r = 8 * _axis(2, 5, 8, LW) + 2 * _axis(4, 6, 8, LW) + e
    base = _slot_base(slot, STAGE_OFF, STAGES, SLOTW, NW, 8, LW)
    base = base + slot_v_offset(K_BYTES, ALIGN) + (_lds(base + 4) >> 16)
    m, q4, q3 = _v_word_index(M, LW)
    if VPAD:
        q4 = v_padded_word(q4, r)
    return _words(None, base, r, m, q4, q3, BITS, M, LV, True)


# rotate right by $2 mod 32 (a funnel shift of the word with itself)
_ROTR = gl.constexpr("shf.r.wrap.b32 $0, $1, $1, $2;")


@gluon.jit
def _rotr(w, n):
    return gl.inline_asm_elementwise(_ROTR, "=r,r,r", [w, n & 31], dtype=gl.int32, is_pure=True, pack=1)


# the bits of $1 where $3 is set and of $2 where it is clear: one LOP3 (written as two ands and an or,
# with two immediate masks, ptxas makes two)
_SELECT = gl.constexpr("lop3.b32 $0, $1, $2, $3, 0xE4;")


@gluon.jit
def _select(a, b, mask: gl.constexpr):
    """``(a & mask) | (b & ~mask)`` in one instruction (``_SELECT``)."""
    return gl.inline_asm_elementwise(_SELECT, "=r,r,r,r", [a, b, gl.full_like(a, mask)], dtype=gl.int32,
                                     is_pure=True, pack=1)


# byte i of $1 in bits 8-15 beside byte 0 of $2 in bits 0-7, bits 16-31 zero (prmt with selector
# $3 = 0x55i4: bytes 1-3 of $2 are zero): a table row's byte address, one instruction on the ALU pipe
_BYTE_ADDR = gl.constexpr("prmt.b32 $0, $1, $2, $3;")


@gluon.jit
def _lookup(y, i, lane4, TAB: gl.constexpr):
    """The pair table entry of byte ``i`` of ``y`` (a pair code) in this lane's copy: byte offset
    TAB + code * 256 + lane4 (``_fill_tables``; lane4 < 128; i is a register index, so the selector is
    a constant)."""
    addr = gl.inline_asm_elementwise(_BYTE_ADDR, "=r,r,r,r", [y, lane4, 0x5504 + 16 * i], dtype=gl.int32,
                                     is_pure=True, pack=1)
    return _lds(TAB + addr)


@gluon.jit
def _k_operand(w0, w1, w2, w3, BITS: gl.constexpr, TAB: gl.constexpr, HEAD_DIM: gl.constexpr, NW: gl.constexpr,
               LK: gl.constexpr, OPA: gl.constexpr):
    """K [NW, 16, HEAD_DIM] bf16 in the A-operand layout, as its two halves along the reduction
    (``_k_halves``): thread (t, nl) holds the channel pairs
    8 i + 2 t of each word: rotating plane p's word right by 2 t - 2 p and masking puts its bits of
    four pairs at bits 2 p, 2 p + 1 of four bytes (``pair_index``; ``rotated_pair_codes``)."""
    t = _axis(4, 5, 7, LK)
    if BITS == 4:  # nibble rows: byte i of lane t's word m is the pair code (``k_nibble_channel``)
        y = w0
    elif BITS == 3:
        # crumb rows: lane t's crumb word (w0) rotated by 4 (t & 1) gives four pairs' crumbs in the low
        # nibbles, the bit-2 word (w1) rotated by 4 (t & 1) - 4 + 2 (t >> 1) their bits 2 at bits 4-5
        # (``k_crumb_channel``, ``crumb_pair_codes_k``)
        y = _select(_rotr(w0, 4 * (t & 1)), _rotr(w1, 4 * (t & 1) - 4 + 2 * (t >> 1)), 0x0F0F0F0F)
    else:
        # plane p's bits 2 t, 2 t + 1 of each byte rotated to bits 2 p, 2 p + 1 (one funnel shift each)
        y = _rotr(w0, 2 * t) & 0x03030303
        y |= _rotr(w1, 2 * t - 2) & 0x0C0C0C0C
        if BITS > 2:
            y |= _rotr(w2, 2 * t - 4) & 0x30303030
    val = _lookup(y, _axis(4, 4, 7, LK), (t + 4 * _axis(8, 2, 7, LK)) * 4, TAB)  # lane t + 4 nl: copy t + 4 nl
    half = ((val >> (16 * _axis(2, 6, 7, LK))) & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return _k_halves(half, NW, HEAD_DIM, OPA)


@gluon.jit
def _v_operand(a0, a1, a2, a3, b0, b1, b2, b3, BITS: gl.constexpr, TAB: gl.constexpr, HEAD_DIM: gl.constexpr,
               NW: gl.constexpr, LV: gl.constexpr, OPA: gl.constexpr):
    """V^T [NW, HEAD_DIM, 16] bf16 in the A-operand layout from the even (a) and odd (b) rows' plane
    words: thread (tl, j) holds the row pairs of channels 8 i + j."""
    j = _axis(8, 4, 8, LV)
    if BITS == 4:
        # nibble rows: the even (j even) or odd nibbles of row a's word to the low nibbles, row b's to
        # the high ones: byte k = the code pair of channel 8 q + 2 k + (j & 1) (``v_nibble_channel``)
        sh = 4 * (j & 1)
        y = _select(_rotr(a0, sh), _rotr(b0, sh - 4), 0x0F0F0F0F)
    elif BITS == 3:
        # crumb rows (``v_crumb_channel``, ``crumb_pair_codes_v``): channel 4 k + s (s = j & 3) of the
        # rows' crumb words (a0, b0) to bits 0-1 and 2-3 of byte k, its bit 2 from the bit-2 words
        # (a1, b1) to bits 4 and 5
        s = j & 3
        pos = s + 2 * (s >> 1) + 2 * (j >> 2)
        t1 = _select(_rotr(a0, 2 * s), _rotr(b0, 2 * s - 2), 0x03030303)
        u = _select(_rotr(a1, pos - 4), _rotr(b1, pos - 5), 0x10101010)
        y = _select(t1, u, 0x0F0F0F0F)
    else:
        # bit j of each byte of row a's plane p to bit 2 p, of row b's to bit 2 p + 1: two funnel
        # shifts, a bit select of the even bits from a and the odd from b, and the plane's mask
        y = _select(_rotr(a0, j), _rotr(b0, j - 1), 0x55555555) & 0x03030303
        y |= _select(_rotr(a1, j - 2), _rotr(b1, j - 3), 0x55555555) & 0x0C0C0C0C
        if BITS > 2:
            y |= _select(_rotr(a2, j - 4), _rotr(b2, j - 5), 0x55555555) & 0x30303030
    i = 2 * _axis(2, 2, 8, LV) + _axis(2, 3, 8, LV)
    val = _lookup(y, i, (_axis(4, 6, 8, LV) + 4 * j) * 4, TAB)  # lane tl + 4 j reads copy tl + 4 j
    half = ((val >> (16 * _axis(2, 7, 8, LV))) & 0xFFFF).to(gl.int16).to(gl.bfloat16, bitcast=True)
    return gl.convert_layout(gl.reshape(half, [NW, HEAD_DIM, 16]), OPA, assert_trivial=True)


# cos and sin on the SFU (absolute error about 1e-6 near [-pi, pi]), as the Triton kernel's FAST path
_COS = gl.constexpr("cos.approx.f32 $0, $1;")
_SIN = gl.constexpr("sin.approx.f32 $0, $1;")


@gluon.jit
def _split_bf16(x):
    """x (fp32) as hi + lo bf16 (about fp32 accuracy in three bf16 products)."""
    hi = x.to(gl.bfloat16)
    return hi, (x - hi.to(gl.float32)).to(gl.bfloat16)


@gluon.jit
def _phase_words(f, z):
    """A pair's 48-bit phase step ``f`` (int64) as two int32 words, f >> 16 and (f & 0xFFFF) << 16
    (``_page_trig``'s), broadcast to ``z``'s shape."""
    return ((f >> 16) & 0xFFFFFFFF).to(gl.int32) + z, ((f & 0xFFFF) << 16).to(gl.int32) + z


@gluon.jit
def _page_trig(first, fh, fl):
    """cos and sin (fp32, the SFU's) of a pair's phase at token ``first``: the 48-bit product's top 32
    bits, ``first * (f >> 16) + (first * (f & 0xFFFF)) >> 16`` mod 2**32 (the latter as the high word
    of ``first * fl``), in turns of 2 pi. One function for the table form and ``_lane_trig``, so that
    both give the same bits."""
    top = first * fh + gl.umulhi(first, fl)
    base = top.to(gl.uint32, bitcast=True).to(gl.float32) * 1.4629180792671596e-09  # 2 pi / 2**32
    return (gl.inline_asm_elementwise(_COS, "=r,r", [base], dtype=gl.float32, is_pure=True, pack=1),
            gl.inline_asm_elementwise(_SIN, "=r,r", [base], dtype=gl.float32, is_pure=True, pack=1))


@gluon.jit
def _rope_pair(pairs_ptr, j, n_pairs, HALF: gl.constexpr):
    """The RoPE pair listed at ``j`` (0 past the list), clamped into [0, HALF)."""
    return gl.minimum(gl.maximum(gl.load(pairs_ptr + j, mask=j < n_pairs, other=0), 0), HALF - 1)


@gluon.jit
def _rope_query_row(seq, head, num_kv_heads, g, GROUP: gl.constexpr, HALF: gl.constexpr):
    """Where query head ``g`` of KV head ``head`` keeps its rotary coefficients in ``coef_ptr`` (int64
    elements): A of pair i at + i, B at + HALF + i."""
    return (seq * (num_kv_heads * GROUP) + head * GROUP + g).to(gl.int64) * (2 * HALF)


@gluon.jit
def _rope_coefs(coef_ptr, pairs_ptr, n_pairs, seq, head, num_kv_heads, c: gl.constexpr, GROUP: gl.constexpr,
                BLOCK_G: gl.constexpr, HALF: gl.constexpr, NW: gl.constexpr, OPB: gl.constexpr):
    """Chunk ``c``'s query coefficients A and B of the rotary-offset logits (16 listed pairs x the
    query heads, 0 past the list and the group) as hi/lo bf16 B operands (ah, al, bh, bl): the same for
    every page, so made once per program, before the page loop (``_rope_logits``)."""
    jb = _axis(16, 1, 3, OPB)  # pair within the chunk (B operand rows)
    gb = _axis(BLOCK_G, 2, 3, OPB)
    jj = c * 16 + jb
    rows = _rope_query_row(seq, head, num_kv_heads, gb, GROUP, HALF) + 0 * _axis(NW, 0, 3, OPB)
    ib = _rope_pair(pairs_ptr, jj, n_pairs, HALF)
    m = (jj < n_pairs) & (gb < GROUP)
    ah, al = _split_bf16(gl.load(coef_ptr + rows + ib, mask=m, other=0.0))
    bh, bl = _split_bf16(gl.load(coef_ptr + rows + HALF + ib, mask=m, other=0.0))
    return ah, al, bh, bl


@gluon.jit
def _rope_chunk(acc, coefs, phase_ptr, pairs_ptr, n_pairs, s64, nf, c: gl.constexpr, HALF: gl.constexpr,
                OPA: gl.constexpr):
    """``acc`` plus chunk ``c``'s rotary-offset logits of a page (``_rope_logits``)."""
    ah, al, bh, bl = coefs
    ja = c * 16 + _axis(16, 2, 3, OPA)
    f = gl.load(phase_ptr + _rope_pair(pairs_ptr, ja, n_pairs, HALF))
    ph = ((((s64 * (f >> 16)) & 0xFFFFFFFF) << 16) + s64 * (f & 0xFFFF)) & 0xFFFFFFFFFFFF
    base = (ph >> 16).to(gl.float32) * 1.4629180792671596e-09  # 2 pi / 2**32
    theta = f.to(gl.float32) * 2.2321073814882276e-14  # 2 pi / 2**48
    ang = base + nf * theta
    ch, cl = _split_bf16(gl.inline_asm_elementwise(_COS, "=r,r", [ang], dtype=gl.float32, is_pure=True, pack=1))
    sh, sl = _split_bf16(gl.inline_asm_elementwise(_SIN, "=r,r", [ang], dtype=gl.float32, is_pure=True, pack=1))
    acc = mma_v2(ch, ah, mma_v2(ch, al, mma_v2(cl, ah, acc)))
    return mma_v2(sh, bh, mma_v2(sh, bl, mma_v2(sl, bh, acc)))


@gluon.jit
def _rope_logits(r0, r1, r2, r3, coef_ptr, phase_ptr, pairs_ptr, n_pairs, seq, head, num_kv_heads, first,
                 GROUP: gl.constexpr, BLOCK_G: gl.constexpr, HALF: gl.constexpr, NCHUNK: gl.constexpr,
                 HOIST: gl.constexpr, NW: gl.constexpr, MMA: gl.constexpr, OPA: gl.constexpr, OPB: gl.constexpr):
    """The rotary-offset logits q . r(p) of a page's 16 keys, transposed [NW, 16 rows, BLOCK_G], as
    ``paged_decode._rope_logits`` computes them: per listed RoPE pair i (16 per chunk), the exact
    48-bit phase of the page's first position ``first`` ([NW, 1, 1], OPA), the angle of row n by one
    fp32 multiply-add, cos/sin on the SFU, and the sums over pairs as hi/lo-split bf16 products on
    the tensor cores (``cos [16 rows, 16 pairs]`` the A operand, the query's A / B coefficients
    [16 pairs, BLOCK_G] the B operands). With ``HOIST`` the chunks' coefficients are ``r0`` .. ``r3``
    (``_rope_coefs``, made before the page loop); without, each chunk loads its own here."""
    acc = gl.zeros([NW, 16, BLOCK_G], gl.float32, layout=MMA)
    s64 = first.to(gl.int64)
    nf = _axis(16, 1, 3, OPA).to(gl.float32)  # row within the page
    for c in gl.static_range(NCHUNK):
        if HOIST:
            coefs = (r0, r1, r2, r3)[c]
        else:
            coefs = _rope_coefs(coef_ptr, pairs_ptr, n_pairs, seq, head, num_kv_heads, c, GROUP, BLOCK_G, HALF, NW,
                                OPB)
        acc = _rope_chunk(acc, coefs, phase_ptr, pairs_ptr, n_pairs, s64, nf, c, HALF, OPA)
    return acc


# the rotary term from tables (``KernelConfig.gluon_rope_table``): every value of a thread in one
# inline-PTX call (pack = the thread's elements), so the order of its registers is the same for the
# store and the load whatever it is, at one address per thread plus constant offsets
@constexpr_function
def _thread_lds_asm(words, off):
    """Load ``words`` 32-bit words (a multiple of 4) into $0.. from the shared byte offset in the
    first packed address (``$words``, the same for all of them) plus ``off``, 16 bytes per
    ``ld.shared.v4``."""
    loads = " ".join(f"ld.shared.v4.b32 {{{', '.join(f'${4 * v + i}' for i in range(4))}}}, [a+{off + 16 * v}];"
                     for v in range(words // 4))
    return f"{{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, ${words}; {loads} }}"


@constexpr_function
def _thread_lds_pred_asm(words, off):
    """``_thread_lds_asm`` where the first packed predicate (``${2 words}``) is not 0, zeros elsewhere
    (the lanes whose loads are off move no shared-memory bytes)."""
    loads = " ".join(f"@p ld.shared.v4.b32 {{{', '.join(f'${4 * v + i}' for i in range(4))}}}, [a+{off + 16 * v}];"
                     for v in range(words // 4))
    zeros = " ".join(f"mov.b32 ${i}, 0;" for i in range(words))
    return (f"{{ .reg .u32 a; .reg .pred p; setp.ne.u32 p, ${2 * words}, 0; {zeros} mov.u32 a, global_smem; "
            f"add.u32 a, a, ${words}; {loads} }}")


@constexpr_function
def _thread_sts_asm(words, elems, off):
    """Store the ``words`` 32-bit words after ``elems`` packed addresses at the first address plus
    ``off``; the ``words`` outputs are dummies (0)."""
    d = words + elems
    stores = " ".join(f"st.shared.v4.b32 [a+{off + 16 * v}], {{{', '.join(f'${d + 4 * v + i}' for i in range(4))}}};"
                      for v in range(words // 4))
    zeros = " ".join(f"mov.b32 ${i}, 0;" for i in range(words))
    return f"{{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, ${words}; {stores} {zeros} }}"


@constexpr_function
def _thread_constraints(words, elems, stored):
    return ",".join(["=r"] * words + ["r"] * (elems + stored))


@gluon.jit
def _lds_thread(addr, OFF: gl.constexpr, W: gl.constexpr):
    """An int32 tensor whose W values in each thread lie at the thread's ``addr`` (the same for all its
    elements) + OFF, in the thread's register order (``_sts_thread``)."""
    return gl.inline_asm_elementwise(_thread_lds_asm(W, OFF), _thread_constraints(W, W, 0), [addr],
                                     dtype=gl.int32, is_pure=True, pack=W)


@gluon.jit
def _lds_thread_if(addr, on, OFF: gl.constexpr, W: gl.constexpr):
    """``_lds_thread`` in the threads where ``on`` (int32, the same for a thread's elements) is not 0;
    0 in the others."""
    return gl.inline_asm_elementwise(_thread_lds_pred_asm(W, OFF), _thread_constraints(W, W, W), [addr, on],
                                     dtype=gl.int32, is_pure=True, pack=W)


@gluon.jit
def _lds_record(addr, on, OFF: gl.constexpr, W: gl.constexpr, SKIP: gl.constexpr):
    """``_lds_thread_if`` with ``SKIP``, else ``_lds_thread`` (``on`` unused)."""
    if SKIP:
        return _lds_thread_if(addr, on, OFF, W)
    else:
        return _lds_thread(addr, OFF, W)


@gluon.jit
def _lds_thread_bf16(addr, OFF: gl.constexpr, W: gl.constexpr):
    """``_lds_thread`` of a bf16 tensor: 2 W values a thread."""
    return gl.inline_asm_elementwise(_thread_lds_asm(W, OFF), _thread_constraints(W, 2 * W, 0), [addr],
                                     dtype=gl.bfloat16, is_pure=True, pack=2 * W)


@gluon.jit
def _sts_thread(addr, x, OFF: gl.constexpr, W: gl.constexpr):
    """``_lds_thread``'s inverse: a thread's W int32 values of ``x`` to its ``addr`` + OFF."""
    gl.inline_asm_elementwise(_thread_sts_asm(W, W, OFF), _thread_constraints(W, W, W), [addr, x], dtype=gl.int32,
                              is_pure=False, pack=W)


@gluon.jit
def _sts_thread_bf16(addr, x, OFF: gl.constexpr, W: gl.constexpr):
    """``_sts_thread`` of a bf16 tensor: 2 W values a thread."""
    gl.inline_asm_elementwise(_thread_sts_asm(W, 2 * W, OFF), _thread_constraints(W, 2 * W, W), [addr, x],
                              dtype=gl.bfloat16, is_pure=False, pack=2 * W)


@gluon.jit
def _rope_frag_base(OFF, NW: gl.constexpr, OPA: gl.constexpr):
    """[NW, 16, 16] shared byte offsets in the A-operand layout: the thread's 16 bytes of a fragment
    at OFF. Lane 4 (n % 8) + (i % 8) / 2 holds rows n, n + 8 and columns i, i + 1, i + 8, i + 9 of
    a 16 x 16 operand (mma.sync's fragment): its 8 bf16 values, one ``ld.shared.v4``."""
    n = _axis(16, 1, 3, OPA)
    i = _axis(16, 2, 3, OPA)
    return OFF + ((n % 8) * 4 + (i % 8) // 2) * 16 + 0 * _axis(NW, 0, 3, OPA)


@gluon.jit
def _rope_rec_base(OFF, BLOCK_G: gl.constexpr, NW: gl.constexpr, OPB: gl.constexpr):
    """[NW, 16, BLOCK_G] shared byte offsets in the B-operand layout: the thread's BLOCK_G / 2 words
    of a record array at OFF (pair k, head g: lane 4 (g % 8) + (k % 8) / 2 holds pairs k, k + 1,
    k + 8, k + 9 of heads g, g + 8, .., mma.sync's B fragment), one ``ld.shared.v4`` per 4 words."""
    k = _axis(16, 1, 3, OPB)
    g = _axis(BLOCK_G, 2, 3, OPB)
    return OFF + ((g % 8) * 4 + (k % 8) // 2) * (2 * BLOCK_G) + 0 * _axis(NW, 0, 3, OPB)


@gluon.jit
def _rope_table_fill(coef_ptr, phase_ptr, pairs_ptr, n_pairs, seq, head, num_kv_heads, OFF: gl.constexpr,
                     c: gl.constexpr, NCHUNK: gl.constexpr, GROUP: gl.constexpr, BLOCK_G: gl.constexpr,
                     HALF: gl.constexpr, NW: gl.constexpr, OPA: gl.constexpr, OPB: gl.constexpr,
                     FOLD: gl.constexpr = False):
    """Chunk ``c``'s tables of the rotary term at shared byte OFF (``rope_table_words``; every warp
    writes the same bytes), for ``_rope_table_logits``:

    - the rows' rotations: cos(n theta_i) and sin(n theta_i) for row n of a page and listed pair i,
      split into hi/lo bf16 (4 A-operand fragments of 512 bytes at OFF + 2048 c);
    - per (pair i, query head g), 4 arrays after all chunks' fragments: the query's coefficients A and
      B (0 past the list and the group) and the pair's phase step f as two 32-bit words, f >> 16 and
      (f & 0xFFFF) << 16.

    ``FOLD`` (``KernelConfig.gluon_rope_fold``, groups up to 4 of 8 columns): column g < 4 holds head g's
    (A, B) and column g + 4 its (B, -A), so that one product ``a cos b + b sin b`` gives P in the first
    columns and Q in the others (``_rope_table_logits``)."""
    n = _axis(16, 1, 3, OPA).to(gl.float32)
    ja = c * 16 + _axis(16, 2, 3, OPA)
    step = gl.load(phase_ptr + _rope_pair(pairs_ptr, ja, n_pairs, HALF))  # the pair's phase step
    theta = step.to(gl.float32) * 2.2321073814882276e-14  # 2 pi / 2**48
    ang = n * theta + 0.0 * _axis(NW, 0, 3, OPA).to(gl.float32)
    ch, cl = _split_bf16(gl.inline_asm_elementwise(_COS, "=r,r", [ang], dtype=gl.float32, is_pure=True, pack=1))
    sh, sl = _split_bf16(gl.inline_asm_elementwise(_SIN, "=r,r", [ang], dtype=gl.float32, is_pure=True, pack=1))
    fa = _rope_frag_base(OFF, NW, OPA)
    _sts_thread_bf16(fa, ch, c * 2048, 4)
    _sts_thread_bf16(fa, cl, c * 2048 + 512, 4)
    _sts_thread_bf16(fa, sh, c * 2048 + 1024, 4)
    _sts_thread_bf16(fa, sl, c * 2048 + 1536, 4)
    k = _axis(16, 1, 3, OPB)
    g = _axis(BLOCK_G, 2, 3, OPB)
    z = 0 * g + 0 * k + 0 * _axis(NW, 0, 3, OPB)  # [NW, 16, BLOCK_G]
    jb = c * 16 + k
    ib = _rope_pair(pairs_ptr, jb, n_pairs, HALF)
    gq = g
    if FOLD:
        gl.static_assert(GROUP <= 4 and BLOCK_G == 8, "the folded records take groups up to 4 of 8 columns")
        gq = g % 4
    m = (jb < n_pairs) & (gq < GROUP) & (z == 0)
    rows = _rope_query_row(seq, head, num_kv_heads, gq, GROUP, HALF)
    a = gl.load(coef_ptr + rows + ib, mask=m, other=0.0)
    b = gl.load(coef_ptr + rows + HALF + ib, mask=m, other=0.0)
    if FOLD:
        a, b = gl.where(g < 4, a, b), gl.where(g < 4, b, -a)
    a = a.to(gl.int32, bitcast=True)
    b = b.to(gl.int32, bitcast=True)
    f = gl.load(phase_ptr + ib)
    fh, fl = _phase_words(f, z)
    W: gl.constexpr = BLOCK_G // 2  # words of a thread in one array
    ARR: gl.constexpr = 128 * W  # bytes of one array (32 lanes)
    ra = _rope_rec_base(OFF + NCHUNK * 2048, BLOCK_G, NW, OPB)
    _sts_thread(ra, a, 4 * c * ARR, W)
    _sts_thread(ra, b, (4 * c + 1) * ARR, W)
    _sts_thread(ra, fh, (4 * c + 2) * ARR, W)
    _sts_thread(ra, fl, (4 * c + 3) * ARR, W)


@constexpr_function
def _lds_trig_asm(off):
    """A thread's page cos and sin ($0-$3, $4-$7) of listed pairs k0, k0 + 1, k0 + 8 and k0 + 9 (its B
    operand's registers, ``_trig_order``) from (cos, sin) pairs 8 bytes apart at the shared byte
    offset of the first packed address ($8, pair k0) plus ``off``: two ``ld.shared.v4``."""
    return ("{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $8; "
            f"ld.shared.v4.b32 {{$0, $4, $1, $5}}, [a+{off}]; ld.shared.v4.b32 {{$2, $6, $3, $7}}, [a+{off + 64}]; }}")


@constexpr_function
def _trig_order(ll):
    """Whether the registers of a thread's [NW, 16 pairs, 8 heads] B operand (its linear layout ``ll``)
    are pairs k0, k0 + 1, k0 + 8, k0 + 9 in this order, as ``_lds_trig_asm`` loads them."""
    return [list(b) for b in ll.reg_bases] == [[0, 1, 0], [0, 8, 0]]


@gluon.jit
def _lds_trig(taddr, OFF: gl.constexpr, PURE: gl.constexpr = True):
    """(cos, sin) fp32 [NW, 16, 8] in the B-operand layout: listed pair k's at ``taddr`` + OFF (``taddr``:
    the slot's pair 0 + 8 k, ``slot_trig_offset``). ``PURE`` False: kept in program order with the other
    inline PTX (after ``_lane_trig``'s stores and warp barrier)."""
    return gl.inline_asm_elementwise(_lds_trig_asm(OFF), "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r", [taddr],
                                     dtype=(gl.float32, gl.float32), is_pure=PURE, pack=4)


# int32 $2 to shared byte offset $1 of ``global_smem`` where $3 is not 0
_STS_ON = gl.constexpr("{ .reg .u32 a; .reg .pred p; setp.ne.u32 p, $3, 0; mov.u32 a, global_smem; add.u32 a, a, $1; "
                       "@p st.shared.b32 [a], $2; mov.u32 $0, 0; }")


@constexpr_function
def _lane_trig_layout(chunks, nw):
    """``_lane_trig``'s layout: [nw, 32, chunks rounded up to a power of two], lane l of warp w holding
    element (w, l, c) of every chunk c in its registers."""
    cp = 1 << max(0, int(chunks) - 1).bit_length()
    return gl.BlockedLayout([1, 1, cp], [1, 32, 1], [nw, 1, 1], [2, 1, 0])


@gluon.jit
def _lane_trig_consts(phase_ptr, pairs_ptr, n_pairs, TOFF: gl.constexpr, NCHUNK: gl.constexpr, CP: gl.constexpr,
                      HALF: gl.constexpr, NW: gl.constexpr, L3: gl.constexpr):
    """``KernelConfig.gluon_rope_lanes``' per-lane constants, [NW, 32, CP] in ``L3`` (CP: NCHUNK rounded up
    to a power of two; chunk c in a thread's registers): lane l of chunk c takes listed pair 16 c + l // 2,
    its cosine for even l and its sine for odd. Returns its phase step as ``_rope_table_fill``'s two
    words (f >> 16, (f & 0xFFFF) << 16), whether it is a sine, whether chunk c is listed at all, and its
    value's byte offset from a slot (TOFF + 8 x the pair + 4 for the sine: where ``_lds_trig`` reads)."""
    lane = _axis(32, 1, 3, L3)
    c = _axis(CP, 2, 3, L3)
    z = 0 * _axis(NW, 0, 3, L3) + 0 * lane + 0 * c
    f = gl.load(phase_ptr + _rope_pair(pairs_ptr, 16 * c + lane // 2, n_pairs, HALF))
    fh, fl = _phase_words(f, z)
    return fh, fl, (lane % 2 + z) == 1, (c < NCHUNK).to(gl.int32) + z, TOFF + 4 * lane + 128 * c + z


@gluon.jit
def _lane_trig(addr, first, fh, fl, odd, on, NW: gl.constexpr):
    """``KernelConfig.gluon_rope_lanes``: the page's cos and sin of its listed pairs' phases at its first
    position ``first`` ([NW, 1, 1]), one value a lane and chunk (``_lane_trig_consts``), into its slot
    (``addr``: the slot's byte offset plus the value's), then a warp barrier so that every lane reads
    all 32 values. The phase, its float and the MUFU.COS / MUFU.SIN as ``_rope_table_logits`` computes
    them per fragment, so the same bits."""
    cb, sb = _page_trig(first, fh, fl)
    v = gl.where(odd, sb, cb).to(gl.int32, bitcast=True)
    gl.inline_asm_elementwise(_STS_ON, "=r,r,r,r", [addr, v, on], dtype=gl.int32, is_pure=False, pack=1)
    _per_thread(_WARP_SYNC, NW)


@gluon.jit
def _trig_row(rope_pos_ptr, first, n_pos_rows, HALF: gl.constexpr):
    """The row of ``rope_page_table`` of the page of token ``first`` (a multiple of 16): its first
    element's address; past the table's last row, the last (pages past the split's end are copied
    but not used)."""
    return rope_pos_ptr + gl.minimum(first // 16, n_pos_rows - 1).to(gl.int64) * (2 * HALF)


@gluon.jit
def _rope_table_logits(first, OFF: gl.constexpr, BLOCK_G: gl.constexpr, NCHUNK: gl.constexpr,
                       NW: gl.constexpr, MMA: gl.constexpr, OPA: gl.constexpr, OPB: gl.constexpr,
                       POS: gl.constexpr = False, taddr=None, PURE: gl.constexpr = True,
                       CHAINS: gl.constexpr = 1, FOLD: gl.constexpr = False, SKIP: gl.constexpr = False,
                       GROUP: gl.constexpr = 8):
    """``_rope_logits`` from the tables at OFF (``_rope_table_fill``), by the angle sum: with phase
    b_i of the page's first position ``first`` ([NW, 1, 1], OPB) and row n's angle b_i + n theta_i,

        A_i cos(b_i + n theta_i) + B_i sin(b_i + n theta_i) = cos(n theta_i) P_i + sin(n theta_i) Q_i,
        P_i = A_i cos b_i + B_i sin b_i,  Q_i = B_i cos b_i - A_i sin b_i,

    so a page takes cos and sin of its 16 listed pairs' phases only (not of 16 rows x 16 pairs), and
    the rows' rotations are a constant A operand. The phase is the same 32 bits as ``_rope_chunk``'s
    48-bit product's top (``first * (f >> 16) + (first * (f & 0xFFFF)) >> 16`` mod 2**32, the latter
    as the high word of ``first * ((f & 0xFFFF) << 16)``); P and Q are split hi/lo as the cosines are.
    ``POS`` (``KernelConfig.gluon_rope_pos``): cos b_i and sin b_i read from the page's slot instead
    (``_lds_trig`` at ``taddr``, copied with the page from ``rope_page_table``, or ``_lane_trig``'s, which
    then passes ``PURE`` False). ``CHAINS`` (``KernelConfig.gluon_rope_chains``): 1, the 6 ``mma.sync`` of
    each chunk in one dependent chain through all chunks; 2, the cosine and sine products in two chains
    added at the end (another rounding of the same sum). ``FOLD`` (``KernelConfig.gluon_rope_fold``;
    ``_rope_table_fill``'s folded records): the B operand's columns 4-7, padding in a group of up to
    4, carry Q (``x = a cos b + b sin b`` is P in columns 0-3 and Q in 4-7), so a chunk splits 4
    values a thread instead of 8; the cosine products' columns 0-3 plus the sine products' columns 4-7
    (from the lane 2 on, ``_fold_columns``) are the sum of the two chains, the same bits as ``CHAINS``
    2 wherever P and Q round as there. ``SKIP`` (``KernelConfig.gluon_rope_skip_pad``): the threads of
    the columns past ``GROUP`` (padding, whose records are 0) load no records and take A = B = 0 and
    phase 0, so P and Q there are 0 as from their records: the same output bit for bit, with fewer
    shared-memory wavefronts."""
    acc = gl.zeros([NW, 16, BLOCK_G], gl.float32, layout=MMA)
    acc2 = gl.zeros([NW, 16, BLOCK_G], gl.float32, layout=MMA)
    fa = _rope_frag_base(OFF, NW, OPA)
    ra = _rope_rec_base(OFF + NCHUNK * 2048, BLOCK_G, NW, OPB)
    W: gl.constexpr = BLOCK_G // 2
    ARR: gl.constexpr = 128 * W
    if POS:
        gl.static_assert(_trig_order(gl.to_linear_layout(OPB, [NW, 16, BLOCK_G])),
                         "the page's cos and sin load as a thread's pairs k0, k0 + 1, k0 + 8, k0 + 9")
    if SKIP:
        gl.static_assert(not FOLD, "the folded records fill the padding columns")
        on = (_axis(BLOCK_G, 2, 3, OPB) < GROUP).to(gl.int32) + 0 * _axis(16, 1, 3, OPB) + 0 * _axis(NW, 0, 3, OPB)
    else:
        on = 0
    for c in gl.static_range(NCHUNK):
        a = _lds_record(ra, on, 4 * c * ARR, W, SKIP)
        b = _lds_record(ra, on, (4 * c + 1) * ARR, W, SKIP)
        if POS:
            cb, sb = _lds_trig(taddr, 128 * c, PURE)
        else:
            fh = _lds_record(ra, on, (4 * c + 2) * ARR, W, SKIP)
            fl = _lds_record(ra, on, (4 * c + 3) * ARR, W, SKIP)
            cb, sb = _page_trig(first, fh, fl)
        a = a.to(gl.float32, bitcast=True)
        b = b.to(gl.float32, bitcast=True)
        ph, pl = _split_bf16(a * cb + b * sb)
        if FOLD:
            qh, ql = ph, pl  # (Q in columns 4-7)
        else:
            qh, ql = _split_bf16(b * cb - a * sb)
        ch = _lds_thread_bf16(fa, c * 2048, 4)
        cl = _lds_thread_bf16(fa, c * 2048 + 512, 4)
        sh = _lds_thread_bf16(fa, c * 2048 + 1024, 4)
        sl = _lds_thread_bf16(fa, c * 2048 + 1536, 4)
        acc = mma_v2(ch, ph, mma_v2(ch, pl, mma_v2(cl, ph, acc)))
        if CHAINS == 2 or FOLD:
            acc2 = mma_v2(sh, qh, mma_v2(sh, ql, mma_v2(sl, qh, acc2)))
        else:
            acc = mma_v2(sh, qh, mma_v2(sh, ql, mma_v2(sl, qh, acc)))
    if FOLD:
        acc = _fold_columns(acc, acc2, BLOCK_G, NW, MMA)
    elif CHAINS == 2:
        acc = acc + acc2
    return acc


_SHFL_DOWN2 = gl.constexpr("shfl.sync.down.b32 $0, $1, 2, 0x1f, 0xffffffff;")


@gluon.jit
def _fold_columns(acc, acc2, BLOCK_G: gl.constexpr, NW: gl.constexpr, MMA: gl.constexpr):
    """Columns 0-3 of ``acc`` plus columns 4-7 of ``acc2`` ([NW, 16, 8] mma.sync accumulators), in
    columns 0-3, and 0 in 4-7: lane l holds columns 2 (l % 4) and 2 (l % 4) + 1 of its rows, so lane
    l + 2 holds the same rows' columns 4 on (one ``shfl.sync.down`` a register)."""
    gl.static_assert(BLOCK_G == 8, "a fold of 8 columns")
    up = gl.inline_asm_elementwise(_SHFL_DOWN2, "=r,r", [acc2], dtype=gl.float32, is_pure=True, pack=1)
    col = _axis(BLOCK_G, 2, 3, MMA) + 0 * _axis(16, 1, 3, MMA) + 0 * _axis(NW, 0, 3, MMA)
    return gl.where(col < 4, acc + up, 0.0)


@gluon.jit
def _q_operand(q_ptr, seq, head, stride_qb, stride_qh, dtype: gl.constexpr, GROUP: gl.constexpr,
               BLOCK_G: gl.constexpr, HEAD_DIM: gl.constexpr, NW: gl.constexpr, OPB: gl.constexpr,
               K_BITS: gl.constexpr, PART: gl.constexpr):
    """Q^T of the KV head's query heads (every warp the same) as the B operand [NW, HEAD_DIM, BLOCK_G]
    in ``dtype``, heads past the group 0; with ``K_BITS`` (compact pages) its channels in the K
    operand's order (``_k_stored_channel``); ``PART`` 0 or 1: that half of the reduction index k
    ([NW, HEAD_DIM // 2, BLOCK_G]: ``_k_halves``' halves of K)."""
    dq = _k_stored_channel(PART * (HEAD_DIM // 2) + _axis(HEAD_DIM // 2, 1, 3, OPB), HEAD_DIM, K_BITS)
    gq = _axis(BLOCK_G, 2, 3, OPB)
    wq = _axis(NW, 0, 3, OPB)
    q_ptrs = q_ptr + seq.to(gl.int64) * stride_qb + (head * GROUP + gq) * stride_qh + dq + 0 * wq
    return gl.load(q_ptrs, mask=(gq < GROUP) & (wq >= 0), other=0.0).to(dtype)


@gluon.jit
def _k_halves(half, NW: gl.constexpr, HEAD_DIM: gl.constexpr, OPA: gl.constexpr):
    """The K pair tensor ``half`` ([NW, 2, 8, M, 4, 4, 2] in ``k_layout``: reduction index
    k = 32 m + 8 i + 2 t + b) as two A operands [NW, 16, HEAD_DIM // 2], k below HEAD_DIM // 2 and the
    rest: a split of each thread's registers (no data moves), so the logits sum over two
    independent chains of HEAD_DIM / 32 products (``_logits``) instead of one of HEAD_DIM / 16."""
    M: gl.constexpr = HEAD_DIM // 32
    # (m, i) as one register index 4 m + i (k = 8 (4 m + i) + 2 t + b), its high bit split off
    x = gl.permute(gl.reshape(half, [NW, 2, 8, 2, 2 * M, 4, 2]), [0, 1, 2, 4, 5, 6, 3])
    lo, hi = gl.split(x)
    return (gl.convert_layout(gl.reshape(lo, [NW, 16, HEAD_DIM // 2]), OPA, assert_trivial=True),
            gl.convert_layout(gl.reshape(hi, [NW, 16, HEAD_DIM // 2]), OPA, assert_trivial=True))


@gluon.jit
def _logits(k_lo, k_hi, q_lo, q_hi, NW: gl.constexpr, BLOCK_G: gl.constexpr, MMA: gl.constexpr):
    """S^T = K Q^T [NW, 16, BLOCK_G] (fp32) as the sum of the two halves' products (``_k_halves``),
    each its own chain of mma.sync."""
    z = gl.zeros([NW, 16, BLOCK_G], gl.float32, layout=MMA)
    return mma_v2(k_lo, q_lo, z) + mma_v2(k_hi, q_hi, z)


@gluon.jit
def _work_item(work_seq_ptr, work_start_ptr, work_end_ptr):
    """This program's work item and KV head (grid axes 0 and 1), and the item's sequence and token
    range [t0, t1) from ``PagedDecodeAttention.plan``'s schedule."""
    item = gl.program_id(0)
    return (item, gl.program_id(1), gl.load(work_seq_ptr + item), gl.load(work_start_ptr + item),
            gl.load(work_end_ptr + item))


@gluon.jit
def _fresh_state(NW: gl.constexpr, BLOCK_G: gl.constexpr, HEAD_DIM: gl.constexpr, MMA: gl.constexpr,
                 HEADS: gl.constexpr):
    """Each warp's softmax state before its first page: running max, mass and the fp32 sum of p v."""
    return (gl.full([NW, BLOCK_G], NEG_BIG, gl.float32, layout=HEADS), gl.zeros([NW, BLOCK_G], gl.float32, layout=HEADS),
            gl.zeros([NW, HEAD_DIM, BLOCK_G], gl.float32, layout=MMA))


@gluon.jit
def _softmax_step(s, valid, m_i, l_i):
    """One page of the running base-2 softmax of each warp: logits ``s`` [NW, 16, BLOCK_G] (rows not
    ``valid`` [NW, 16] get -inf), the running max and mass [NW, BLOCK_G]; the page's weights, the old
    sum's rescale, the new max and mass."""
    s = gl.where(gl.expand_dims(valid, 2), s, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=1))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - gl.expand_dims(m_new, 1))
    return p, alpha, m_new, l_i * alpha + gl.sum(p, axis=1)


# The compact kernel's running max moves only when a page's max exceeds it by more than this (base
# 2): the weights are then at most 2**8 (fp32 and bf16 hold them), and most pages leave the sum
# unscaled (``_rescale`` skips the multiply when no head of the warp moved). Not in the fp8 kernel,
# which is bound by memory: measured 1-3% slower with it (BENCHMARKS.md, session 20)
MAX_SLACK = gl.constexpr(8.0)


@constexpr_function
def _vote_max_asm(tiles):
    """The lazy running max of ``_lazy_softmax_step`` for one thread's ``tiles`` n-tiles of a
    [16, 8 tiles] logit block in the mma.sync accumulator layout (4 values a tile: rows r and r + 8 of
    columns c and c + 1; the rows' other 14 values on the lanes 4, 8 and 16 apart), with the running
    max of each value's column beside it: $0.. the new max of each value's column, then 4 ``tiles``
    flags (1 if any max of the warp moved); inputs the logits, then the maxima. A warp vote decides
    first: no logit of the warp above its column's max + MAX_SLACK (most pages), no max moves and no
    shuffle runs; else each column's max over its 16 rows by three butterfly shuffles."""
    n = 4 * tiles
    s, m = n * 2, n * 3  # operand numbers of the logits and of the maxima
    lines = [".reg .pred p, q, any;", ".reg .f32 c<%d>, t<%d>, x;" % (2 * tiles, 2 * tiles)]
    for t in range(tiles):
        for j in range(2):  # the tile's two columns
            i, k = 2 * t + j, 4 * t + j
            lines += [f"max.f32 c{i}, ${s + k}, ${s + k + 2};", f"add.f32 t{i}, ${m + k}, {MAX_SLACK.value:.1f};"]
            lines += [f"setp.gt.f32 p, c{i}, t{i};"] if i == 0 else [f"setp.gt.f32 q, c{i}, t{i};", "or.pred p, p, q;"]
    lines += ["vote.sync.any.pred any, p, 0xffffffff;", "@!any bra.uni KEEP;"]
    for i in range(2 * tiles):
        for lane in (4, 8, 16):
            lines += [f"shfl.sync.bfly.b32 x, c{i}, {lane}, 0x1f, 0xffffffff;", f"max.f32 c{i}, c{i}, x;"]
    for t in range(tiles):
        for j in range(2):
            i, k = 2 * t + j, 4 * t + j
            lines += [f"max.f32 c{i}, c{i}, ${m + k};", f"setp.gt.f32 q, c{i}, t{i};",
                      f"selp.f32 ${k}, c{i}, ${m + k}, q;", f"mov.f32 ${k + 2}, ${k};"]
    lines += ["bra.uni DONE;", "KEEP:"]
    lines += [f"mov.f32 ${k}, ${m + k};" for k in range(n)]
    lines += ["DONE:", "selp.u32 $%d, 1, 0, any;" % n] + [f"mov.u32 ${n + k}, ${n};" for k in range(1, n)]
    return "{ " + " ".join(lines) + " }"


def vote_max_ref(s: torch.Tensor, m_i: torch.Tensor, slack: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """PyTorch model of ``_vote_max_asm`` over whole warps: logits ``s`` [NW, 16, G] and running maxima
    ``m_i`` [NW, G] (fp32) to the new maxima [NW, G] and ``need`` [NW] (int32, 1 where the warp's
    vote found a logit above its column's max + MAX_SLACK). Equal to ``_lazy_softmax_step``'s max
    and flag: no logit above the threshold leaves every column's max where it was."""
    slack = MAX_SLACK.value if slack is None else slack
    thresh = m_i + slack
    vote = (s > thresh[:, None, :]).flatten(1).any(dim=1)
    m_c = torch.maximum(m_i, s.amax(dim=1))
    return torch.where(vote[:, None] & (m_c > thresh), m_c, m_i), vote.to(torch.int32)


@constexpr_function
def _vote_max_constraints(tiles):
    n = 4 * tiles
    return ",".join(["=f"] * n + ["=r"] * n + ["f"] * (2 * n))


@gluon.jit
def _first(a, b):
    """A reduction's combine that keeps its first operand (for values every thread already holds)."""
    return a


@gluon.jit
def _lazy_softmax_step(s, valid, m_i, l_t):
    """``_softmax_step`` with a lazy max and the mass kept per thread (``l_t`` [NW, 16, BLOCK_G]: the
    rows each thread holds, summed across them at the end): the max moves only by more than
    MAX_SLACK (the result is the same at any max the weights do not overflow at: the merge divides
    the sum by the mass at one max), so ``alpha`` is 1 on most pages, and no shuffles sum the mass."""
    s = gl.where(gl.expand_dims(valid, 2), s, float("-inf"))
    m_c = gl.maximum(m_i, gl.max(s, axis=1))
    m_new = gl.where(m_c > m_i + MAX_SLACK, m_c, m_i)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - gl.expand_dims(m_new, 1))
    return p, alpha, m_new, l_t * gl.expand_dims(alpha, 1) + p


@gluon.jit
def _vote_softmax_step(s, valid, m_i, l_t):
    """``_lazy_softmax_step`` (the same outputs) with the new max from ``_vote_max_asm`` (a warp vote
    first, shuffles only when a max moves), and also ``need`` [NW], 1 where a max of the warp moved.
    Both reach the heads' layout by a reduction that keeps its first operand (every thread already
    holds its columns' values: no shuffle is left after dead-code elimination)."""
    s = gl.where(gl.expand_dims(valid, 2), s, float("-inf"))
    TILES: gl.constexpr = s.shape[2] // 8
    m3, moved = gl.inline_asm_elementwise(_vote_max_asm(TILES), _vote_max_constraints(TILES),
                                          [s, gl.expand_dims(m_i, 1)], dtype=(gl.float32, gl.int32),
                                          is_pure=True, pack=4 * TILES)
    m_new = gl.reduce(m3, 1, _first)
    need = gl.reduce(gl.reduce(moved, 1, _first), 1, _first)
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m3)
    return p, alpha, m_new, l_t * gl.expand_dims(alpha, 1) + p, need


@constexpr_function
def _rescale_asm(n):
    """``n`` values ($0.., tied to their inputs) times their factors ($2n..) unless the flag $3n is
    0: a branch, uniform when the flag is (``_rescale``), around the multiplies."""
    muls = " ".join(f"mul.f32 ${i}, ${i}, ${2 * n + i};" for i in range(n))
    return f"{{ .reg .pred p; setp.eq.s32 p, ${3 * n}, 0; @p bra.uni SKIP; {muls} SKIP: }}"


@constexpr_function
def _rescale_constraints(n):
    return ",".join(["=f"] * n + [str(i) for i in range(n)] + ["f"] * n + ["r"] * n)


@gluon.jit
def _rescale(acc, alpha, moved, HEAD_DIM: gl.constexpr, BLOCK_G: gl.constexpr):
    """``acc`` [NW, HEAD_DIM, BLOCK_G] times ``alpha`` [NW, BLOCK_G] per head, skipped in a warp none
    of whose heads' max ``moved`` (the common case past the first pages: see ``MAX_SLACK``)."""
    need = gl.max(moved.to(gl.int32), axis=1)  # [NW]: one value per warp (a reduction within it)
    return _rescale_if(acc, alpha, need, HEAD_DIM, BLOCK_G)


@gluon.jit
def _rescale_if(acc, alpha, need, HEAD_DIM: gl.constexpr, BLOCK_G: gl.constexpr):
    """``_rescale`` with the warp's flag given: skipped in a warp whose ``need`` [NW] is 0."""
    n: gl.constexpr = min(32, HEAD_DIM * BLOCK_G // 32)  # a thread's values (all of them: one branch)
    return gl.inline_asm_elementwise(_rescale_asm(n), _rescale_constraints(n),
                                     [acc, gl.expand_dims(alpha, 1), gl.expand_dims(gl.expand_dims(need, 1), 1)],
                                     dtype=gl.float32, is_pure=True, pack=n)


@gluon.jit
def _store_split(m_i, l_i, acc, out_scale, item, head, num_kv_heads, ws_m_ptr, ws_l_ptr, ws_acc_ptr,
                 GROUP: gl.constexpr, BLOCK_G: gl.constexpr, HEAD_DIM: gl.constexpr, MMA: gl.constexpr,
                 HEADS: gl.constexpr, V_BITS: gl.constexpr = 0):
    """The warps' softmax states merged and written to the split's workspace rows (max, mass and the
    unnormalized sum times ``out_scale``), as ``paged_decode._paged_split_kernel`` writes them (with
    ``V_BITS``, compact pages, the sum's rows from the V operand's order, ``_v_stored_channel``, back
    to channel order)."""
    m = gl.max(m_i, axis=0)
    sc = gl.exp2(m_i - gl.expand_dims(m, 0))
    l = gl.sum(l_i * sc, axis=0)
    o = gl.sum(acc * gl.expand_dims(sc, 1), axis=0) * out_scale  # [HEAD_DIM, BLOCK_G], SliceLayout(0, MMA)
    OL: gl.constexpr = gl.SliceLayout(0, MMA)
    do = gl.expand_dims(gl.arange(0, HEAD_DIM, layout=gl.SliceLayout(1, OL)), 1)
    do = _v_stored_channel(do, HEAD_DIM, V_BITS)
    go = gl.expand_dims(gl.arange(0, BLOCK_G, layout=gl.SliceLayout(0, OL)), 0)
    ws_row = item * num_kv_heads * GROUP + head * GROUP + go
    gl.store(ws_acc_ptr + ws_row.to(gl.int64) * HEAD_DIM + do, o, mask=(go < GROUP) & (do >= 0))
    ML: gl.constexpr = gl.SliceLayout(0, HEADS)
    gm = gl.arange(0, BLOCK_G, layout=ML)
    ws_m_row = item * num_kv_heads * GROUP + head * GROUP + gm
    gl.store(ws_m_ptr + ws_m_row, m, mask=gm < GROUP)
    gl.store(ws_l_ptr + ws_m_row, l, mask=gm < GROUP)


@gluon.jit
def compact_split_kernel(
    q_ptr, bias_ptr, k_pages_ptr, v_pages_ptr, block_tables_ptr,
    work_seq_ptr, work_start_ptr, work_end_ptr,
    ws_m_ptr, ws_l_ptr, ws_acc_ptr,
    k_cb_ptr, v_cb_ptr, k_grid_ptr, v_grid_ptr,
    rope_coef_ptr, rope_phase_ptr, rope_pairs_ptr, n_rope_pairs, rope_pos_ptr, n_pos_rows,
    qk_scale,  # sm_scale * log2(e)
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_bt,
    num_kv_heads,
    GROUP: gl.constexpr, BLOCK_G: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    BITS_K: gl.constexpr, BITS_V: gl.constexpr, HAS_BIAS: gl.constexpr,
    V_EARLY: gl.constexpr = False, K_AHEAD: gl.constexpr = False, ROPE_CHUNKS: gl.constexpr = 0,
    ROPE_HOIST: gl.constexpr = False, ROPE_TABLE: gl.constexpr = False, ROPE_POS: gl.constexpr = False,
    ROPE_LANES: gl.constexpr = False, ROPE_CHAINS: gl.constexpr = 1, ROPE_FOLD: gl.constexpr = False,
    ROPE_SKIP: gl.constexpr = False, STAGES: gl.constexpr = 0, TAB_OFF: gl.constexpr = 0,
    STAGE_OFF: gl.constexpr = 0, VOTE: gl.constexpr = False,
    V_PAD: gl.constexpr = False, COPY_ALIGN: gl.constexpr = False, BULK_COPY: gl.constexpr = False,
):
    """One split (work item) of one KV head, as ``paged_decode._paged_split_kernel`` on compact pages:
    the running max (base 2; lazy, ``_lazy_softmax_step``), softmax mass and unnormalized fp32 sum of
    p * y into the workspace.

    Transposed products, so the GQA group is the narrow side (n = 8 on mma.sync, not m = 16):
    ``S^T = K Q^T`` [16 rows, BLOCK_G heads] and ``O^T += V^T P^T`` [HEAD_DIM, BLOCK_G], K and V^T the
    A operands decoded in registers, Q^T and P^T the B operands. Each warp takes every NW-th page of
    the split (16 rows per step). With STAGES > 0 each warp's next STAGES - 1 pages are copied ahead
    into its shared-memory slots with their scale indices and, carried in the same copies, the block
    number of the page STAGES on (``_issue_page``); the head's scale grids are staged once: the loop
    has no global load a warp waits for. With STAGES = 0 the next page's offsets and scales are
    loaded one step ahead (a few registers) and its words at the step (a plane word is held by the 4
    or 8 lanes that decode from it, a nibble-row word by 1 lane for K and 2 for V)."""
    NW: gl.constexpr = gl.num_warps()
    M: gl.constexpr = HEAD_DIM // 32
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1], instr_shape=[1, 16, 8])
    OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    OPB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    LK: gl.constexpr = k_layout(NW, M)
    LV: gl.constexpr = v_layout(NW, M)
    HEADS: gl.constexpr = gl.SliceLayout(1, MMA)  # [NW, BLOCK_G]
    ROWS: gl.constexpr = gl.SliceLayout(2, MMA)  # [NW, 16]
    EK: gl.constexpr = table_entries(BITS_K)
    EV: gl.constexpr = table_entries(BITS_V)
    PB_K: gl.constexpr = 16 * (BITS_K * HEAD_DIM // 8 + 1)
    PB_V: gl.constexpr = 16 * (BITS_V * HEAD_DIM // 8 + 1)

    item, head, seq, t0, t1 = _work_item(work_seq_ptr, work_start_ptr, work_end_ptr)

    # Shared memory, addressed by inline PTX alone (``smem_offsets``): the pair tables at TAB_OFF (then,
    # with STAGES > 0, the head's scale grids) and,
    # with STAGES > 0, each warp's next STAGES - 1 pages copied into its own slots (cp.async, no
    # registers held) at STAGE_OFF. Both allocations are made first and live to the end of the loop,
    # so Triton places no scratch of its own in them (the compile test checks that the kernel's
    # shared memory is exactly theirs).
    # (with ROPE_TABLE the rotary term's tables after the grids, at ROPE_OFF: ``rope_table_words``)
    RT: gl.constexpr = ROPE_TABLE and ROPE_CHUNKS > 0
    RF: gl.constexpr = RT and ROPE_FOLD and GROUP <= 4 and BLOCK_G == 8  # (KernelConfig.gluon_rope_fold)
    RS: gl.constexpr = RT and ROPE_SKIP and GROUP < BLOCK_G and not RF  # (KernelConfig.gluon_rope_skip_pad)
    ROPE_WORDS: gl.constexpr = rope_table_words(ROPE_CHUNKS, BLOCK_G) if RT else 0
    tab = gl.allocate_shared_memory(gl.int32, [_table_words(EK, EV) + _GRID_WORDS + ROPE_WORDS],
                                    gl.SwizzledSharedLayout(1, 1, 1, [0]))
    # (with ROPE_POS, staged, each page's rotary cos and sin ride in its slot: ``rope_page_table``'s
    # row of the page, at TOFF, ``slot_trig_offset``)
    RP: gl.constexpr = RT and ROPE_POS and STAGES > 0
    TRIG: gl.constexpr = ROPE_CHUNKS if RP else 0
    TOFF: gl.constexpr = slot_trig_offset(BITS_K, BITS_V, HEAD_DIM, COPY_ALIGN, V_PAD)
    # (with ROPE_LANES instead, staged, the same room of the slot written by the warp: ``_lane_trig``)
    RL: gl.constexpr = RT and ROPE_LANES and STAGES > 0 and not RP
    SLOTW: gl.constexpr = _slot_words(BITS_K, BITS_V, HEAD_DIM, COPY_ALIGN, V_PAD, ROPE_CHUNKS if RP or RL else 0)
    if STAGES > 0:
        stg = gl.allocate_shared_memory(gl.int32, [NW * STAGES * SLOTW], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    # the pair tables, made from the codebooks: 32 copies of K's and V's entry x in row x
    _fill_tables(k_cb_ptr + head * (1 << BITS_K), v_cb_ptr + head * (1 << BITS_V), BITS_K, BITS_V, NW, TAB_OFF)
    GRID_OFF: gl.constexpr = TAB_OFF + 4 * _table_words(EK, EV)
    if STAGES > 0:
        _fill_grids(k_grid_ptr + head * 256, v_grid_ptr + head * 256, GRID_OFF, NW)
    ROPE_OFF: gl.constexpr = GRID_OFF + 4 * _GRID_WORDS
    if RT:
        for c in gl.static_range(ROPE_CHUNKS):
            _rope_table_fill(rope_coef_ptr, rope_phase_ptr, rope_pairs_ptr, n_rope_pairs, seq, head, num_kv_heads,
                             ROPE_OFF, c, ROPE_CHUNKS, GROUP, BLOCK_G, HEAD_DIM // 2, NW, OPA, OPB, RF)
    NK: gl.constexpr = BITS_K * HEAD_DIM // 8
    NV: gl.constexpr = BITS_V * HEAD_DIM // 8
    NCH: gl.constexpr = copy_steps(NK, NV, COPY_ALIGN)
    # KernelConfig.gluon_v_pad, for the layout it is made for (nibble rows of 128 channels)
    VPAD: gl.constexpr = V_PAD and BITS_V == 4 and HEAD_DIM == 128
    # KernelConfig.gluon_bulk_copy: the staged pages by the copy engine
    BULK: gl.constexpr = BULK_COPY and STAGES > 0
    IL: gl.constexpr = gl.BlockedLayout([1, 1, NCH], [1, 32, 1], [NW, 1, 1], [2, 1, 0])
    gl.thread_barrier()

    q_lo = _q_operand(q_ptr, seq, head, stride_qb, stride_qh, gl.bfloat16, GROUP, BLOCK_G, HEAD_DIM, NW, OPB, BITS_K, 0)
    q_hi = _q_operand(q_ptr, seq, head, stride_qb, stride_qh, gl.bfloat16, GROUP, BLOCK_G, HEAD_DIM, NW, OPB, BITS_K, 1)
    g_h = _axis(BLOCK_G, 1, 2, HEADS)
    if HAS_BIAS:
        bias = gl.load(bias_ptr + seq * (num_kv_heads * GROUP) + head * GROUP + g_h + 0 * _axis(NW, 0, 2, HEADS),
                       mask=g_h < GROUP, other=0.0) * qk_scale
    else:
        bias = gl.zeros([NW, BLOCK_G], gl.float32, layout=HEADS)

    m_i, _, acc = _fresh_state(NW, BLOCK_G, HEAD_DIM, MMA, HEADS)
    l_t = gl.zeros([NW, 16, BLOCK_G], gl.float32, layout=MMA)  # the mass per thread (``_lazy_softmax_step``)
    bt_row = block_tables_ptr + seq.to(gl.int64) * stride_bt
    lo = t0 - t0 % 16
    n_iter = gl.cdiv(t1 - lo, NW * 16)
    rr = _axis(16, 1, 2, ROWS)

    # page 0's offsets (in the K, V and row layouts) and scales
    fr = _tile_first(lo, 0, NW, 2, ROWS)
    if STAGES == 0:
        ok = _page_offset(bt_row, _tile_first(lo, 0, NW, 7, LK), t1, head, stride_kb, stride_kh, PB_K, BLOCK_SIZE)
        ov = _page_offset(bt_row, _tile_first(lo, 0, NW, 8, LV), t1, head, stride_vb, stride_vh, PB_V, BLOCK_SIZE)
        kg = _scales(k_pages_ptr, k_grid_ptr, bt_row, fr, rr, t0, t1, head, stride_kb, stride_kh, PB_K, BLOCK_SIZE,
                     BITS_K * 2 * HEAD_DIM)
        vg = _scales(v_pages_ptr, v_grid_ptr, bt_row, fr, rr, t0, t1, head, stride_vb, stride_vh, PB_V, BLOCK_SIZE,
                     BITS_V * 2 * HEAD_DIM)
    else:
        # the block numbers ride in the copies (``_issue_page``: each page's copies carry the block of
        # the page STAGES on, into its slot's header), so no load in the loop waits for memory; the
        # first STAGES slots are seeded here
        SL: gl.constexpr = gl.SliceLayout(2, IL)
        for s0 in gl.static_range(STAGES):
            _seed_block(_slot_base(s0, STAGE_OFF, STAGES, SLOTW, NW, 2, SL), _tile_first(lo, s0, NW, 2, SL), t1,
                        bt_row, BLOCK_SIZE, SL)
        _per_thread(_WARP_SYNC, NW)
        if BULK:
            gl.inline_asm_elementwise(_bulk_init_asm(STAGE_OFF, STAGES, 4 * SLOTW), "=r,r", [lo], dtype=gl.int32,
                                      is_pure=False, pack=1)
        tp0 = 0
        tp1 = 0
        if RP:  # each lane's listed pairs' element offsets in a row of ``rope_page_table``
            lane_t = _axis(32, 1, 2, SL)
            tp0 = 2 * _rope_pair(rope_pairs_ptr, lane_t, n_rope_pairs, HEAD_DIM // 2)
            tp1 = 2 * _rope_pair(rope_pairs_ptr, lane_t + 32, n_rope_pairs, HEAD_DIM // 2)
        if RL:  # each lane's pair and cos or sin per chunk (KernelConfig.gluon_rope_lanes)
            L3: gl.constexpr = _lane_trig_layout(ROPE_CHUNKS, NW)
            lfh, lfl, lodd, lon, loff = _lane_trig_consts(rope_phase_ptr, rope_pairs_ptr, n_rope_pairs, TOFF,
                                                          ROPE_CHUNKS, L3.size_per_thread[2], HEAD_DIM // 2, NW, L3)
        for s0 in gl.static_range(STAGES - 1):
            dst0 = _slot_base(s0, STAGE_OFF, STAGES, SLOTW, NW, 3, IL)
            ok0, ov0 = _carried_offsets(dst0, _tile_first(lo, s0, NW, 3, IL), head, stride_kb, stride_kh, stride_vb,
                                        stride_vh, PB_K, PB_V, BLOCK_SIZE)
            trow0 = _trig_row(rope_pos_ptr, _tile_first(lo, s0, NW, 2, SL), n_pos_rows, HEAD_DIM // 2) if RP else 0
            _issue_page(k_pages_ptr, v_pages_ptr, ok0, ov0, dst0, _tile_first(lo, s0 + STAGES, NW, 3, IL), t1,
                        bt_row, NK, NV, NCH, BLOCK_SIZE, NW, IL, VPAD, COPY_ALIGN, BULK, TRIG, TOFF, trow0, tp0, tp1)
    if K_AHEAD and STAGES == 0:
        k0, k1, k2, k3 = _k_words(k_pages_ptr, ok, BITS_K, M, LK)
    # the rotary term's query coefficients, the same for every page: made here with ROPE_HOIST, staged
    # (KernelConfig.gluon_rope_hoist; on the register path, where the pages' words are live across the
    # loop too, ptxas spilled 132 bytes for q4 at the 8B shape with them)
    RH: gl.constexpr = ROPE_HOIST and STAGES > 0 and not RT
    if ROPE_CHUNKS > 0:
        gl.static_assert(ROPE_CHUNKS <= 4, "the rotary term takes at most 64 pairs (head_dim 128)")
        HALF: gl.constexpr = HEAD_DIM // 2
        r0 = _rope_coefs(rope_coef_ptr, rope_pairs_ptr, n_rope_pairs, seq, head, num_kv_heads, 0, GROUP, BLOCK_G,
                         HALF, NW, OPB)
        r1 = r0
        r2 = r0
        r3 = r0
        if RH and ROPE_CHUNKS > 1:
            r1 = _rope_coefs(rope_coef_ptr, rope_pairs_ptr, n_rope_pairs, seq, head, num_kv_heads, 1, GROUP, BLOCK_G,
                             HALF, NW, OPB)
        if RH and ROPE_CHUNKS > 2:
            r2 = _rope_coefs(rope_coef_ptr, rope_pairs_ptr, n_rope_pairs, seq, head, num_kv_heads, 2, GROUP, BLOCK_G,
                             HALF, NW, OPB)
        if RH and ROPE_CHUNKS > 3:
            r3 = _rope_coefs(rope_coef_ptr, rope_pairs_ptr, n_rope_pairs, seq, head, num_kv_heads, 3, GROUP, BLOCK_G,
                             HALF, NW, OPB)
    for j in range(0, n_iter):
        if STAGES > 0:
            # page j + STAGES - 1 into the slot page j - 1 used (which carried its block); page j landed
            dstj = _slot_base((j + STAGES - 1) % STAGES, STAGE_OFF, STAGES, SLOTW, NW, 3, IL)
            sok, sov = _carried_offsets(dstj, _tile_first(lo, j + STAGES - 1, NW, 3, IL), head, stride_kb, stride_kh,
                                        stride_vb, stride_vh, PB_K, PB_V, BLOCK_SIZE)
            trow = _trig_row(rope_pos_ptr, _tile_first(lo, j + STAGES - 1, NW, 2, SL), n_pos_rows,
                             HEAD_DIM // 2) if RP else 0
            _issue_page(k_pages_ptr, v_pages_ptr, sok, sov, dstj, _tile_first(lo, j + 2 * STAGES - 1, NW, 3, IL), t1,
                        bt_row, NK, NV, NCH, BLOCK_SIZE, NW, IL, VPAD, COPY_ALIGN, BULK, TRIG, TOFF, trow, tp0, tp1)
            slot = _wait_stage(j % STAGES, STAGES - 1)
            if BULK:
                slot = _bulk_wait(slot, (j // STAGES) & 1, STAGE_OFF, STAGES, SLOTW)
            k0, k1, k2, k3 = _k_words_staged(slot, STAGE_OFF, STAGES, SLOTW, BITS_K, M, NW, LK, COPY_ALIGN)
            sbase = _slot_base(slot, STAGE_OFF, STAGES, SLOTW, NW, 2, ROWS)
            kg = _staged_scales(sbase, rr, GRID_OFF, 0)
            vg = _staged_scales(sbase, rr, GRID_OFF, 1)
        elif not K_AHEAD:
            k0, k1, k2, k3 = _k_words(k_pages_ptr, ok, BITS_K, M, LK)
        if V_EARLY and STAGES == 0:
            a0, a1, a2, a3 = _v_words(v_pages_ptr, ov, 0, BITS_V, M, LV)
            b0, b1, b2, b3 = _v_words(v_pages_ptr, ov, 1, BITS_V, M, LV)
        valid = (fr + rr >= t0) & (fr + rr < t1)
        if STAGES > 0:
            vg = gl.where(valid, vg, 0.0)  # rows outside the split: the page's byte, not index 0
        # the next page's offsets (for the register path) and scales
        nfr = _tile_first(lo, j + 1, NW, 2, ROWS)
        if STAGES == 0:
            nok = _page_offset(bt_row, _tile_first(lo, j + 1, NW, 7, LK), t1, head, stride_kb, stride_kh, PB_K,
                               BLOCK_SIZE)
            nov = _page_offset(bt_row, _tile_first(lo, j + 1, NW, 8, LV), t1, head, stride_vb, stride_vh, PB_V,
                               BLOCK_SIZE)
            nkg = _scales(k_pages_ptr, k_grid_ptr, bt_row, nfr, rr, t0, t1, head, stride_kb, stride_kh, PB_K,
                          BLOCK_SIZE, BITS_K * 2 * HEAD_DIM)
            nvg = _scales(v_pages_ptr, v_grid_ptr, bt_row, nfr, rr, t0, t1, head, stride_vb, stride_vh, PB_V,
                          BLOCK_SIZE, BITS_V * 2 * HEAD_DIM)

        k_lo, k_hi = _k_operand(k0, k1, k2, k3, BITS_K, TAB_OFF, HEAD_DIM, NW, LK, OPA)
        s = _logits(k_lo, k_hi, q_lo, q_hi, NW, BLOCK_G, MMA)
        s = s * gl.expand_dims(kg * qk_scale, 2) + gl.expand_dims(bias, 1)
        if RL:  # the page's cos and sin, a value a lane, into its slot where RP's copies would be
            _lane_trig(_slot_base(slot, STAGE_OFF, STAGES, SLOTW, NW, 3, L3) + loff, _tile_first(lo, j, NW, 3, L3),
                       lfh, lfl, lodd, lon, NW)
        if RP or RL:
            taddr = _slot_base(slot, STAGE_OFF, STAGES, SLOTW, NW, 3, OPB) + TOFF + 8 * _axis(16, 1, 3, OPB)
            s += _rope_table_logits(_tile_first(lo, j, NW, 3, OPB), ROPE_OFF, BLOCK_G, ROPE_CHUNKS, NW, MMA,
                                    OPA, OPB, True, taddr + 0 * _axis(BLOCK_G, 2, 3, OPB), not RL,
                                    ROPE_CHAINS, RF, RS, GROUP) * qk_scale
        elif RT:
            s += _rope_table_logits(_tile_first(lo, j, NW, 3, OPB), ROPE_OFF, BLOCK_G, ROPE_CHUNKS, NW, MMA,
                                    OPA, OPB, CHAINS=ROPE_CHAINS, FOLD=RF, SKIP=RS, GROUP=GROUP) * qk_scale
        elif ROPE_CHUNKS > 0:
            s += _rope_logits(r0, r1, r2, r3, rope_coef_ptr, rope_phase_ptr, rope_pairs_ptr, n_rope_pairs, seq, head,
                              num_kv_heads, _tile_first(lo, j, NW, 3, OPA), GROUP, BLOCK_G, HEAD_DIM // 2,
                              ROPE_CHUNKS, RH, NW, MMA, OPA, OPB) * qk_scale
        if VOTE:  # KernelConfig.gluon_vote: the lazy max by a warp vote
            p, alpha, m_new, l_t, need = _vote_softmax_step(s, valid, m_i, l_t)
        else:
            p, alpha, m_new, l_t = _lazy_softmax_step(s, valid, m_i, l_t)
        pt = gl.convert_layout((p * gl.expand_dims(vg, 2)).to(gl.bfloat16), OPB)
        if STAGES > 0:
            a0, a1, a2, a3 = _v_words_staged(slot, 0, STAGE_OFF, STAGES, SLOTW, NK * 16, BITS_V, M, NW, LV, VPAD,
                                             COPY_ALIGN)
            b0, b1, b2, b3 = _v_words_staged(slot, 1, STAGE_OFF, STAGES, SLOTW, NK * 16, BITS_V, M, NW, LV, VPAD,
                                             COPY_ALIGN)
        else:
            if K_AHEAD:
                k0, k1, k2, k3 = _k_words(k_pages_ptr, nok, BITS_K, M, LK)
            if not V_EARLY:  # V's words only now: fewer registers live across the K half
                a0, a1, a2, a3 = _v_words(v_pages_ptr, ov, 0, BITS_V, M, LV)
                b0, b1, b2, b3 = _v_words(v_pages_ptr, ov, 1, BITS_V, M, LV)
        vt = _v_operand(a0, a1, a2, a3, b0, b1, b2, b3, BITS_V, TAB_OFF + 128, HEAD_DIM, NW, LV, OPA)
        if VOTE:
            acc = mma_v2(vt, pt, _rescale_if(acc, alpha, need, HEAD_DIM, BLOCK_G))
        else:
            acc = mma_v2(vt, pt, _rescale(acc, alpha, m_new != m_i, HEAD_DIM, BLOCK_G))
        m_i = m_new
        fr = nfr
        if STAGES == 0:
            ok, ov, kg, vg = nok, nov, nkg, nvg
    # every warp's last lookup before the merge below (whose scratch may reuse the tables' memory:
    # Triton's barrier analysis does not see the lookups, which are inline PTX)
    if STAGES > 0:
        _wait_stage(0, 0)  # the copies past the split's end, before the merge's scratch may reuse their memory
        if BULK:
            for s0 in gl.static_range(STAGES - 1):
                _bulk_wait((n_iter + s0) % STAGES, ((n_iter + s0) // STAGES) & 1, STAGE_OFF, STAGES, SLOTW)
        stg._keep_alive()
    gl.thread_barrier()
    tab._keep_alive()

    _store_split(m_i, gl.sum(l_t, axis=1), acc, 1.0, item, head, num_kv_heads, ws_m_ptr, ws_l_ptr, ws_acc_ptr,
                 GROUP, BLOCK_G, HEAD_DIM, MMA, HEADS, BITS_V)


# ----------------------------------------------------------------------------------------------------
# fp8 pages (the baseline): the same schedule, pages staged by cp.async, e4m3 pairs converted to f16
# ----------------------------------------------------------------------------------------------------

# the e4m3 pair at shared byte offset $1 (two consecutive channels of a row) as f16x2
_LDS_E4M3X2 = gl.constexpr("{ .reg .b16 h; .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $1; "
                           "ld.shared.b16 h, [a]; cvt.rn.f16x2.e4m3x2 $0, h; }")
@constexpr_function
def _lds_e4m3_rows_asm(row_bytes):
    """The e4m3 values at shared byte offsets $1 and $1 + row_bytes (one channel of two rows) as f16x2
    ($1's in the low half)."""
    return ("{ .reg .b16 h; .reg .u32 a, x, y; mov.u32 a, global_smem; add.u32 a, a, $1; "
            f"ld.shared.u8 x, [a]; ld.shared.u8 y, [a+{row_bytes}]; "
            "prmt.b32 x, x, y, 0x3340; cvt.u16.u32 h, x; cvt.rn.f16x2.e4m3x2 $0, h; }")
# a 16-byte cp.async that zero-fills when $3 is 0 (the source size): rows past the split's end
_CP_ASYNC_ZFILL = gl.constexpr("{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $1; "
                               "cp.async.cg.shared.global [a], [$2], 16, $3; mov.u32 $0, 0; }")


@constexpr_function
def _fp8_row(head_dim):
    """Bytes per staged row: head_dim and 32 of padding, so that every row starts 32-byte aligned (a
    global sector's two 16-byte chunks land in one aligned 32 bytes: each 512-byte copy fetches 16
    sectors, not the 24 of a 16-byte pad). Rows 8 apart in banks alias rows 4 apart, so bit 2 of the
    row swaps the two 16-byte chunks of each 32 (``_fp8_chunk``): the rows a K or V load reads at one
    column then fill distinct banks, and a load's address stays a lane part plus an immediate."""
    return head_dim + 32


@gluon.jit
def _fp8_chunk(row, c):
    """The byte offset, within its staged row, of 16-byte chunk ``c`` of page row ``row``
    (``fp8_staged_offset``)."""
    return 16 * (c ^ ((row >> 2) & 1))


def fp8_staged_offset(row, byte, head_dim: int):
    """Where byte ``byte`` of row ``row`` (0-15 K, 16-31 V) of a staged fp8 page lies in its slot
    (``_fp8_issue`` writes it there, ``_fp8_k_operand`` / ``_fp8_v_operand`` read it): the kernel's
    arithmetic (``_fp8_chunk``) on integers or integer tensors."""
    return row * _fp8_row(head_dim) + 16 * ((byte // 16) ^ ((row >> 2) & 1)) + byte % 16


def fp8_smem_bytes(head_dim: int, num_warps: int, stages: int) -> int:
    """Shared memory of ``fp8_split_kernel``'s staging: a K and a V page of 16 padded rows
    (``_fp8_row``) per slot, ``stages`` slots per warp."""
    return num_warps * stages * 32 * _fp8_row(head_dim)


@gluon.jit
def _fp8_carried(dst, first, head, stride_kb, stride_kh, stride_vb, stride_vh, PB: gl.constexpr,
                 BLOCK_SIZE: gl.constexpr):
    """The K and V byte offsets of the page of token ``first`` from the block its slot at ``dst``
    carries (seeded, or copied by the copies of the page STAGES before) at byte ``PB // 16``: K row
    0's padding (``_fp8_row``; PB = 16 head_dim)."""
    return _carried_offsets(dst + PB // 16, first, head, stride_kb, stride_kh, stride_vb, stride_vh, PB, PB, BLOCK_SIZE)


@gluon.jit
def _fp8_issue(k_pages_ptr, v_pages_ptr, ok, ov, first, t0, t1, dst, fblk, bt_row, CPR: gl.constexpr,
               NCH: gl.constexpr, BLOCK_SIZE: gl.constexpr, NW: gl.constexpr, IL: gl.constexpr):
    """cp.async of one fp8 page of K and of V (16 rows x 16 CPR bytes each, ``ok``/``ov`` their byte
    offsets, ``first`` the page's first token, all [NW, 1, 1] in ``IL``) into the warp's slot at ``dst``
    (K's rows, then V's, each row padded: ``_fp8_row``): chunk c = lane + 32 i; rows outside [t0, t1)
    are zero-filled (positions a cache never wrote, past a sequence's end or the sinks' slots, may hold
    NaN codes, and a softmax weight of 0 times NaN is NaN). The same commit group carries the block of
    token ``fblk`` (block 0 past t1) into K row 0's padding, whose next page takes its offsets
    from it (``_fp8_carried``): no global load in the loop."""
    c = _axis(32, 1, 3, IL) + 32 * _axis(NCH, 2, 3, IL)  # 0 .. 32 CPR - 1: K's 16 CPR chunks, then V's
    is_v = c >= 16 * CPR
    cc = c % (16 * CPR)
    row = cc // CPR
    src = gl.where(is_v, v_pages_ptr + ov, k_pages_ptr + ok) + 16 * cc
    size = gl.where((first + row >= t0) & (first + row < t1), 16, 0)
    ROW: gl.constexpr = _fp8_row(16 * CPR)
    off = dst + (is_v.to(gl.int32) * 16 + row) * ROW + _fp8_chunk(row, cc % CPR)
    _per_thread(_WARP_SYNC, NW)
    gl.inline_asm_elementwise(_CP_ASYNC_ZFILL, "=r,r,l,r", [off, src, size], dtype=gl.int32, is_pure=False, pack=1)
    # lane 0: the block the slot's next page is in, into K row 0's padding (byte head_dim: ``_fp8_carried``)
    _carry_block(gl.max(dst, axis=2) + 16 * CPR, gl.max(fblk, axis=2), t1, bt_row, 0, BLOCK_SIZE,
                 gl.SliceLayout(2, IL))
    _per_thread(_COMMIT, NW)


@gluon.jit
def _fp8_k_operand(slot, STAGES: gl.constexpr, HEAD_DIM: gl.constexpr, NW: gl.constexpr, OPA: gl.constexpr):
    """K [NW, 16, HEAD_DIM] f16 in the A-operand layout, as its two halves along the reduction
    (``_k_halves``), from the warp's staged page in ``slot``: the K
    pair tensor of ``k_layout`` (channels 32 m + 8 i + 2 t + b of row 8 nh + nl), one 16-bit load and
    one e4m3x2 conversion per pair."""
    M: gl.constexpr = HEAD_DIM // 32
    LK: gl.constexpr = k_layout(NW, M)
    row = 8 * _axis(2, 1, 7, LK) + _axis(8, 2, 7, LK)
    i = _axis(4, 4, 7, LK)
    col = _fp8_chunk(row, 2 * _axis(M, 3, 7, LK) + i // 2) + 8 * (i % 2) + 2 * _axis(4, 5, 7, LK)
    addr = _slot_base(slot, 0, STAGES, 8 * _fp8_row(HEAD_DIM), NW, 7, LK) + row * _fp8_row(HEAD_DIM) + col
    val = gl.inline_asm_elementwise(_LDS_E4M3X2, "=r,r", [addr], dtype=gl.int32, is_pure=True, pack=1)
    half = ((val >> (16 * _axis(2, 6, 7, LK))) & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True)
    return _k_halves(half, NW, HEAD_DIM, OPA)


@gluon.jit
def _fp8_v_operand(slot, STAGES: gl.constexpr, HEAD_DIM: gl.constexpr, NW: gl.constexpr, OPA: gl.constexpr):
    """V^T [NW, HEAD_DIM, 16] f16 in the A-operand layout from the warp's staged page in ``slot`` (V
    after K's 16 rows): the V pair tensor of ``v_layout`` (rows 8 th + 2 tl + e of channel
    32 m + 16 i1 + 8 i0 + j), two byte loads, a byte permute and one conversion per row pair."""
    M: gl.constexpr = HEAD_DIM // 32
    LV: gl.constexpr = v_layout(NW, M)
    ROW: gl.constexpr = _fp8_row(HEAD_DIM)
    row = 8 * _axis(2, 5, 8, LV) + 2 * _axis(4, 6, 8, LV)  # the pair's even row (the odd one: same chunk order)
    col = _fp8_chunk(row, 2 * _axis(M, 1, 8, LV) + _axis(2, 2, 8, LV)) + 8 * _axis(2, 3, 8, LV) + _axis(8, 4, 8, LV)
    a = _slot_base(slot, 0, STAGES, 8 * ROW, NW, 8, LV) + (16 + row) * ROW + col
    val = gl.inline_asm_elementwise(_lds_e4m3_rows_asm(ROW), "=r,r", [a], dtype=gl.int32, is_pure=True, pack=1)
    half = ((val >> (16 * _axis(2, 7, 8, LV))) & 0xFFFF).to(gl.int16).to(gl.float16, bitcast=True)
    return gl.convert_layout(gl.reshape(half, [NW, HEAD_DIM, 16]), OPA, assert_trivial=True)


@gluon.jit
def fp8_split_kernel(
    q_ptr, k_pages_ptr, v_pages_ptr, block_tables_ptr, work_seq_ptr, work_start_ptr, work_end_ptr,
    ws_m_ptr, ws_l_ptr, ws_acc_ptr, k_scale_ptr, v_scale_ptr,
    qk_scale,  # sm_scale * log2(e)
    stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_bt,
    num_kv_heads,
    GROUP: gl.constexpr, BLOCK_G: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_SIZE: gl.constexpr,
    STAGES: gl.constexpr,
):
    """One split of one KV head over fp8 e4m3 pages ([num_blocks, kv_heads, block_size, head_dim], one
    fp32 scale per KV head), as ``paged_decode._paged_split_kernel`` with ``PAGE_TYPE`` fp8 computes it,
    on ``compact_split_kernel``'s pattern: transposed products on mma.sync, each warp on every NW-th
    16-token page with its own softmax state, the pages staged STAGES - 1 ahead per warp by cp.async.
    The e4m3 codes convert exactly to f16 (Hopper converts e4m3 pairs to f16 pairs, not bf16), so the
    products are f16: q times sm_scale log2(e) and the softmax weights are rounded to f16 (the Triton
    kernel rounds q and the weights to bf16); the K scale multiplies the fp32 logits, the V scale the
    fp32 sum. No logit bias (PagedDecodeAttention runs the Triton kernel when there is one)."""
    NW: gl.constexpr = gl.num_warps()
    MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NW, 1, 1], instr_shape=[1, 16, 8])
    OPA: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
    OPB: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
    HEADS: gl.constexpr = gl.SliceLayout(1, MMA)  # [NW, BLOCK_G]
    ROWS: gl.constexpr = gl.SliceLayout(2, MMA)  # [NW, 16]
    CPR: gl.constexpr = HEAD_DIM // 16  # 16-byte chunks per row
    SLOT: gl.constexpr = 32 * _fp8_row(HEAD_DIM)  # bytes per slot: a K and a V page, padded rows
    NCH: gl.constexpr = CPR  # chunks per lane: 32 CPR in all
    IL: gl.constexpr = gl.BlockedLayout([1, 1, NCH], [1, 32, 1], [NW, 1, 1], [2, 1, 0])
    PB: gl.constexpr = 16 * HEAD_DIM  # bytes per 16-token page of one head

    item, head, seq, t0, t1 = _work_item(work_seq_ptr, work_start_ptr, work_end_ptr)
    # the staging slots at offset 0 (the merge's scratch reuses them after the loop)
    stg = gl.allocate_shared_memory(gl.int32, [NW * STAGES * SLOT // 4], gl.SwizzledSharedLayout(1, 1, 1, [0]))

    # q times sm_scale log2(e) in f16 (|q| up to about 3.6e5 before f16 overflows, not 65504)
    q_lo = (_q_operand(q_ptr, seq, head, stride_qb, stride_qh, gl.float32, GROUP, BLOCK_G, HEAD_DIM, NW, OPB, 0, 0)
            * qk_scale).to(gl.float16)
    q_hi = (_q_operand(q_ptr, seq, head, stride_qb, stride_qh, gl.float32, GROUP, BLOCK_G, HEAD_DIM, NW, OPB, 0, 1)
            * qk_scale).to(gl.float16)
    k_scale = gl.load(k_scale_ptr + head)
    v_scale = gl.load(v_scale_ptr + head)
    m_i, l_i, acc = _fresh_state(NW, BLOCK_G, HEAD_DIM, MMA, HEADS)
    bt_row = block_tables_ptr + seq.to(gl.int64) * stride_bt
    lo = t0 - t0 % 16
    n_iter = gl.cdiv(t1 - lo, NW * 16)
    rr = _axis(16, 1, 2, ROWS)
    # the block numbers ride in the copies (``_fp8_issue``), seeded here for the first STAGES slots
    SL: gl.constexpr = gl.SliceLayout(2, IL)
    for s0 in gl.static_range(STAGES):
        _seed_block(_slot_base(s0, 0, STAGES, SLOT // 4, NW, 2, SL) + HEAD_DIM, _tile_first(lo, s0, NW, 2, SL), t1,
                    bt_row, BLOCK_SIZE, SL)
    _per_thread(_WARP_SYNC, NW)
    for s0 in gl.static_range(STAGES - 1):
        f = _tile_first(lo, s0, NW, 3, IL)
        dst0 = _slot_base(s0, 0, STAGES, SLOT // 4, NW, 3, IL)
        ok0, ov0 = _fp8_carried(dst0, f, head, stride_kb, stride_kh, stride_vb, stride_vh, PB, BLOCK_SIZE)
        _fp8_issue(k_pages_ptr, v_pages_ptr, ok0, ov0, f, t0, t1, dst0, _tile_first(lo, s0 + STAGES, NW, 3, IL),
                   bt_row, CPR, NCH, BLOCK_SIZE, NW, IL)
    for j in range(0, n_iter):
        # page j + STAGES - 1 into the slot page j - 1 used (which carried its block); page j landed
        sfirst = _tile_first(lo, j + STAGES - 1, NW, 3, IL)
        dstj = _slot_base((j + STAGES - 1) % STAGES, 0, STAGES, SLOT // 4, NW, 3, IL)
        sok, sov = _fp8_carried(dstj, sfirst, head, stride_kb, stride_kh, stride_vb, stride_vh, PB, BLOCK_SIZE)
        _fp8_issue(k_pages_ptr, v_pages_ptr, sok, sov, sfirst, t0, t1, dstj,
                   _tile_first(lo, j + 2 * STAGES - 1, NW, 3, IL), bt_row, CPR, NCH, BLOCK_SIZE, NW, IL)
        slot = _wait_stage(j % STAGES, STAGES - 1)
        fr = _tile_first(lo, j, NW, 2, ROWS)
        k_lo, k_hi = _fp8_k_operand(slot, STAGES, HEAD_DIM, NW, OPA)
        s = _logits(k_lo, k_hi, q_lo, q_hi, NW, BLOCK_G, MMA) * k_scale
        p, alpha, m_new, l_i = _softmax_step(s, (fr + rr >= t0) & (fr + rr < t1), m_i, l_i)
        pt = gl.convert_layout(p.to(gl.float16), OPB)
        vt = _fp8_v_operand(slot, STAGES, HEAD_DIM, NW, OPA)
        acc = mma_v2(vt, pt, acc * gl.expand_dims(alpha, 1))
        m_i = m_new
    _wait_stage(0, 0)  # the copies past the split's end, before the merge's scratch may reuse their memory
    stg._keep_alive()
    gl.thread_barrier()
    _store_split(m_i, l_i, acc, v_scale, item, head, num_kv_heads, ws_m_ptr, ws_l_ptr, ws_acc_ptr, GROUP, BLOCK_G,
                 HEAD_DIM, MMA, HEADS)
