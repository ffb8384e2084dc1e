"""Decoder of the exact page profile in Gluon (Hopper): the Triton decoder's mapping (one thread per
page and stream, a program per stream and block of pages) with the code tables and the stream
words in shared memory.

Why a second decoder: Nsight Compute on the H200 (BENCHMARKS.md) showed the Triton decoder
(``exact_page._decode_kernel``) stalled on global loads (long scoreboard: 15.7 of its 19.6 cycles
per instruction) at 44 instructions per symbol and warp: every symbol waits for a table entry in
global memory (a stream's 32 tables, 16 KB at max_len 8, times the codebooks of the programs
resident on a multiprocessor do not stay in L1: hit rate 21-23%) and for the stream word loaded at
the previous symbol. Here (``decode_kernel``), 28 instructions per symbol:

* **Tables in shared memory.** A program whose pages share one codebook (every program in
  practice: one layer's K or V pages lie together) copies its stream's 32 tables into shared
  memory once, and each symbol is one ``ld.shared`` (inline PTX at a constant offset per channel,
  as Gluon has no shared-memory gather).
* **Stream words in shared memory** (``STAGE``): each thread copies its stream's first STAGE words
  into its own slots (4-byte ``cp.async``; word i of lane l at slot i * B + l, so a warp's reads
  never share a bank) and waits for its own copies only. Read from global memory instead, the word
  loaded at one symbol is waited for at the next (a register the window's select reads every
  symbol): 331-353 GB/s against 511-517 staged on the H200.
* **Window tables** (``exact_page.window_table``): each entry holds the bits the symbol uses (its
  code, plus 8 for the escape), the symbol, and the escape flag in the sign bit, so a symbol is a
  lookup and a few integer operations.
* **A three-word bit window** (``cur``, ``nxt``, ``nn``): the next 32 bits are one funnel shift
  (``shf.l.clamp``); when the position passes a word the window moves by one word.
* **Whole-sector memory access per thread**: a token's 32 raw bytes as four 8-byte loads (fetched
  a token ahead), its 32 outputs as four 16-byte stores (inline PTX ``st.global.v4``).

Programs whose pages mix codebooks, or whose streams exceed STAGE words, take the same loop with
tables and words in global memory (``decode_stream``'s SHARED=False branch).

**Where it stands: not faster than the Triton decoder** (H200, BENCHMARKS.md: 517 / 524 GB/s against
469 / 508 in two runs, 499 against 509 in a third), so ``exact_page.decode_pages`` uses it only when
asked (``kernel="gluon"``). It runs fewer instructions (28 per symbol against 44) and no longer waits
on global memory (long-scoreboard stalls 2.2 cycles per instruction against 15.7), but waits on
shared memory instead (5.5) at 18% occupancy: the staged words (8 KB per warp) and the tables
(16 KB per program) fill shared memory, so too few decode chains run per multiprocessor. Two pages
per thread (two chains) measured slower (479 against 524 GB/s).

**The ring, measured slower** (``RING``; H200, session 12: 368 / 303 / 306 GB/s at 64 / 128 / 256
pages per program against 507 for the Triton decoder and 503 for 64 staged words; Nsight Compute:
35% occupancy against 9%, but 24% more instructions and 29.5 cycles per instruction against 6.1,
19 of them waiting on shared memory): STAGE = 16 slots per stream instead of 64 (2 KB of shared
memory per warp instead of 8), refilled every 8 symbols (``_refill``: 4-byte ``cp.async`` of the words after the last copied one into the slots of words
already read, waited for two refills later), and no limit on a stream's length. The slots must hold
the words of 16 symbols plus the lookahead: at least 3 refills + 1 (13 words at max_len 8, 16 at
10); ``window_decode_ref(..., ring=16)`` models the schedule with copies landing as late and as
early as the kernel allows, and decodes real and escape-heavy pages (CPU tests). With 128 pages per
program it compiles to 62 registers and 32 KB of shared memory: 24 warps per multiprocessor (32
at 256 pages) against 12 for the measured 64 words.

``window_decode_ref`` is the same math in PyTorch (the CPU tests hold it against the pages the Rust
encoder writes); Gluon has no interpreter, so the CPU tests compile the kernel for sm_90 and the
GPU tests compare it with the Triton decoder and the Rust codec. ``exact_page.decode_into`` runs it
(``kernel="gluon"``) on Hopper (capability 9.x) for max_len up to ``exact_page.MAX_SHARED_LEN``.
"""

from __future__ import annotations

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.runtime.jit import constexpr_function

from weightszip.errors import InvalidArgumentError

from .exact_page import PAGE_TOKENS, STREAM_CHANNELS, header_len
from .exact_page_ref import join_ref

HOPPER_SMEM = 227 * 1024  # shared memory a program may take on Hopper
_TOKENS = gl.constexpr(PAGE_TOKENS)
_CHANNELS = gl.constexpr(STREAM_CHANNELS)

# the next 32 bits of the window: (cur:nxt) << pos, upper half (pos clamped to 32)
_SHF = gl.constexpr("shf.l.clamp.b32 $0, $1, $2, $3;")
_CP_COMMIT_WAIT = gl.constexpr("cp.async.commit_group; cp.async.wait_group 0; mov.u32 $0, $1;")
_CP_COMMIT = gl.constexpr("cp.async.commit_group; mov.u32 $0, 0;")
# all this thread's copy groups but the newest have landed; passes $1 through (reads of the staged
# words take their addresses from it, so they cannot move above the wait)
_CP_WAIT_1 = gl.constexpr("cp.async.wait_group 1; mov.u32 $0, $1;")
# the 32-bit word at shared byte $1
_LDS32 = gl.constexpr("{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $1; ld.shared.b32 $0, [a]; }")
# four words to 16 bytes at $1 when $6 is not 0
_ST_V4 = gl.constexpr("{ .reg .pred p; setp.ne.b32 p, $6, 0; @p st.global.v4.b32 [$1], {$2, $3, $4, $5}; "
                      "mov.u32 $0, 0; }")


def window_decode_ref(buf: torch.Tensor, offsets: torch.Tensor, wlut: torch.Tensor, max_len: int,
                      is_bf16: bool, ring: int = 0, early: bool = False) -> torch.Tensor:
    """The kernel's math in PyTorch, every (page, stream) at once: the three-word window, the
    window-table entries, the escape's 8 bits taken from the top of the window. buf uint8 (length a
    multiple of 4), offsets int64 [n + 1], wlut int16 [C, 2**max_len] (``exact_page.window_table``).
    Returns int16 [n, 16, C].

    ``ring`` > 0: the kernel's RING schedule (``_refill``) with that many slots per stream, the window's
    third word read from its slot every symbol. A copy lands, in the kernel, at any time between its
    refill and the wait two refills later: ``early`` False lands it at that wait, True at once; the
    schedule is right if both decode the pages."""
    C = wlut.shape[0]
    S = C // STREAM_CHANNELS
    H = header_len(C)
    n = offsets.numel() - 1
    b = buf.to(torch.int64)
    words = b.view(-1, 4)
    words = words[:, 0] | words[:, 1] << 8 | words[:, 2] << 16 | words[:, 3] << 24
    off = offsets[:-1].to(torch.int64)
    hdr = (b[off[:, None] + 2 * torch.arange(S)] | b[off[:, None] + 2 * torch.arange(S) + 1] << 8)  # [n, S]
    start = torch.cumsum(hdr, 1) - hdr
    wbase = (off[:, None] + H + PAGE_TOKENS * C) // 4 + start  # [n, S]
    nw = hdr
    last = words.numel() - 1

    def word(k):  # word k of each stream, or (past its end) any value: the kernel keeps a stale one
        return torch.where(k < nw, words[torch.clamp(wbase + k, max=last)], 0)

    cur, nxt, nn = word(torch.zeros_like(nw)), word(torch.ones_like(nw)), word(torch.full_like(nw, 2))
    k = torch.full_like(nw, 3)
    pos = torch.zeros_like(nw)
    ch = torch.arange(S)[None, :] * STREAM_CHANNELS
    w = wlut.to(torch.int64)
    out = torch.zeros(n, PAGE_TOKENS, C, dtype=torch.int64)
    if ring:
        slots = torch.zeros(n, S, ring, dtype=torch.int64)
        for i in range(2, ring + 2):  # the initial copies, waited for
            slots[..., i % ring] = word(torch.full_like(nw, i))
        filled = torch.full_like(nw, ring + 2)
        pending = []  # per refill: (slot, value, mask) copies in flight
        refills = _ring_refill_words(max_len)

    def land(copies):
        for slot, value, m in copies:
            cur_v = slots.gather(2, slot[..., None])[..., 0]
            slots.scatter_(2, slot[..., None], torch.where(m, value, cur_v)[..., None])

    for t in range(PAGE_TOKENS):
        raw = b[off[:, None, None] + H + t * C + ch[..., None] + torch.arange(STREAM_CHANNELS)]  # [n, S, 32]
        for j in range(STREAM_CHANNELS):
            if ring and j % 8 == 0:  # _refill: wait for the copies of two refills ago, copy ahead
                if len(pending) >= 2:
                    land(pending.pop(-2))
                limit = k + ring - 1
                copies = [((filled + i) % ring, word(filled + i), (filled + i < limit) & (filled + i < nw))
                          for i in range(refills)]
                if early:
                    land(copies)
                    copies = []
                pending.append(copies)
                filled = torch.minimum(filled + refills, limit)
            peek = ((cur << pos) | (nxt >> (32 - pos))) & 0xFFFFFFFF
            e = w[ch + j, peek >> (32 - max_len)]
            used = e & 31
            sym = torch.where(e < 0, (peek >> (32 - used)) & 0xFF, (e >> 5) & 0xFF)
            pos = pos + used
            adv = pos >= 32
            cur, nxt = torch.where(adv, nxt, cur), torch.where(adv, nn, nxt)
            if ring:
                k = k + adv.to(k.dtype)
                nn = slots.gather(2, ((k - 1) % ring)[..., None])[..., 0]
            else:
                nn = torch.where(adv & (k < nw), word(k), nn)
                k = k + adv.to(k.dtype)
            pos = pos & 31
            out[:, t, ch[0] + j] = join_ref(sym, raw[..., j], is_bf16)
    return ((out + 0x8000) % 0x10000 - 0x8000).to(torch.int16)


@constexpr_function
def _smem_words(L, stage, block_pages):
    """The kernel's one shared buffer, in 4-byte words: a stream's 32 tables of 2**L int16 entries,
    then ``stage`` words per page, rounded up to a power of two (as Gluon's shapes are)."""
    return 1 << ((16 << L) + stage * block_pages - 1).bit_length()


@constexpr_function
def _cp_async4_asm(dst_imm, src_imm):
    """One 4-byte word from global $2 + src_imm to shared byte $1 + dst_imm of ``global_smem`` ($3
    bytes read: 4, or 0 for a zero); immediates, so the copies of a stream share two registers."""
    return ("{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $1; "
            f"cp.async.ca.shared.global [a+{dst_imm}], [$2+{src_imm}], 4, $3; mov.u32 $0, 0; }}")


@constexpr_function
def _cp_async4_pred_asm(src_imm):
    """One 4-byte word from global $2 + src_imm to shared byte $1 of ``global_smem`` when $3 is not 0."""
    return ("{ .reg .pred p; .reg .u32 a; setp.ne.b32 p, $3, 0; mov.u32 a, global_smem; add.u32 a, a, $1; "
            f"@p cp.async.ca.shared.global [a], [$2+{src_imm}], 4; mov.u32 $0, 0; }}")


@constexpr_function
def _ring_refill_words(L):
    """Words a stream can move past in 8 symbols (at most L + 8 bits each): what one refill of the
    ring must be able to add."""
    return (8 * (L + 8) + 31) // 32


@constexpr_function
def _lds16_asm(imm):
    """int16 at shared byte offset $1 + imm (sign-extended)."""
    return f"{{ .reg .u32 a; mov.u32 a, global_smem; add.u32 a, a, $1; ld.shared.s16 $0, [a+{imm}]; }}"


@gluon.jit
def _entry(peek, j: gl.constexpr, wlut_ptr, row, L: gl.constexpr, SHARED: gl.constexpr):
    """The window-table entry of channel j of the stream for the next bits ``peek``."""
    idx = (peek >> (32 - L)).to(gl.int32)
    if SHARED:
        return gl.inline_asm_elementwise(_lds16_asm(j * (2 << L)), "=r,r", [idx * 2], dtype=gl.int32,
                                         is_pure=True, pack=1)
    else:
        return gl.load(wlut_ptr + row + (j << L) + idx).to(gl.int32)


@gluon.jit
def _symbol(raws, j: gl.constexpr, st, ctx, L: gl.constexpr, IS_BF16: gl.constexpr, SHARED: gl.constexpr,
            STAGE: gl.constexpr, B: gl.constexpr, RING: gl.constexpr):
    """Channel j of the stream (of this token): its 16-bit value (raw byte from ``raws``, word j // 4
    of the token's raw bytes) and the window ``st`` after it (``ctx``: where words and tables are)."""
    cur, nxt, nn, pos, k, nw = st
    wptr, wlut_ptr, row, lane = ctx
    peek = gl.inline_asm_elementwise(_SHF, "=r,r,r,r", [nxt, cur, pos], dtype=gl.uint32, is_pure=True, pack=1)
    e = _entry(peek, j, wlut_ptr, row, L, SHARED)
    used = e & 31
    sym = gl.where(e < 0, ((peek >> (32 - used).to(gl.uint32)) & 0xFF).to(gl.int32), (e >> 5) & 0xFF)
    pos = pos + used
    adv = pos >= 32
    cur = gl.where(adv, nxt, cur)
    nxt = gl.where(adv, nn, nxt)
    if STAGE > 0:
        # the stream's words staged in shared memory (word i of lane l at slot i * B + l, so a warp's
        # reads never share a bank): nn re-read every symbol, a read the next one waits for briefly
        k = k + adv.to(gl.int32)
        if RING:  # word i in slot i mod STAGE
            slot = ((k - 1) & (STAGE - 1)) * B + lane
        else:
            slot = gl.minimum(k - 1, STAGE - 1) * B + lane
        nn = gl.inline_asm_elementwise(_LDS32, "=r,r", [(_CHANNELS << (L + 1)) + 4 * slot], dtype=gl.uint32,
                                       is_pure=True, pack=1)
    else:
        # past the stream's end the window keeps a stale word: bits a valid stream never uses
        nn = gl.load(wptr + k, mask=adv & (k < nw), other=nn)
        k = k + adv.to(gl.int32)
    pos = pos & 31
    raw = ((raws >> (8 * (j % 4))) & 0xFF).to(gl.int32)
    if IS_BF16:
        v = ((raw & 0x80) << 8) | (sym << 7) | (raw & 0x7F)
    else:
        v = (sym << 8) | raw
    return v, (cur, nxt, nn, pos, k, nw)


@gluon.jit
def _raw_words(buf64_ptr, rbase, t, ok, C: gl.constexpr):
    """A token's 32 raw bytes of the stream as 8 uint32 words (four 8-byte loads)."""
    a = gl.load(buf64_ptr + rbase + t * (C // 8), mask=ok, other=0).to(gl.uint64, bitcast=True)
    b = gl.load(buf64_ptr + rbase + t * (C // 8) + 1, mask=ok, other=0).to(gl.uint64, bitcast=True)
    c = gl.load(buf64_ptr + rbase + t * (C // 8) + 2, mask=ok, other=0).to(gl.uint64, bitcast=True)
    d = gl.load(buf64_ptr + rbase + t * (C // 8) + 3, mask=ok, other=0).to(gl.uint64, bitcast=True)
    return a, b, c, d


@gluon.jit
def _eight(raw64, q: gl.constexpr, st, ctx, L: gl.constexpr, IS_BF16: gl.constexpr, SHARED: gl.constexpr,
           STAGE: gl.constexpr, B: gl.constexpr, RING: gl.constexpr):
    """Channels 8q .. 8q + 7 (raw bytes in ``raw64``): four output words (pairs of values), the window
    after them."""
    lo = (raw64 & 0xFFFFFFFF).to(gl.uint32)
    hi = (raw64 >> 32).to(gl.uint32)
    v0, st = _symbol(lo, 8 * q, st, ctx, L, IS_BF16, SHARED, STAGE, B, RING)
    v1, st = _symbol(lo, 8 * q + 1, st, ctx, L, IS_BF16, SHARED, STAGE, B, RING)
    v2, st = _symbol(lo, 8 * q + 2, st, ctx, L, IS_BF16, SHARED, STAGE, B, RING)
    v3, st = _symbol(lo, 8 * q + 3, st, ctx, L, IS_BF16, SHARED, STAGE, B, RING)
    v4, st = _symbol(hi, 8 * q + 4, st, ctx, L, IS_BF16, SHARED, STAGE, B, RING)
    v5, st = _symbol(hi, 8 * q + 5, st, ctx, L, IS_BF16, SHARED, STAGE, B, RING)
    v6, st = _symbol(hi, 8 * q + 6, st, ctx, L, IS_BF16, SHARED, STAGE, B, RING)
    v7, st = _symbol(hi, 8 * q + 7, st, ctx, L, IS_BF16, SHARED, STAGE, B, RING)
    return (v0 | (v1 << 16), v2 | (v3 << 16), v4 | (v5 << 16), v6 | (v7 << 16)), st


@gluon.jit
def _refill(st, ctx, filled, ok, L: gl.constexpr, STAGE: gl.constexpr, B: gl.constexpr):
    """Before 8 symbols, the ring (STAGE slots per lane): wait for the copies issued two refills ago,
    then copy the words after ``filled`` into the slots of words already read, up to the STAGE - 1
    words after nn's (word k - 1). The copies issued here are waited for two refills later, so the
    ring must hold the words of 16 symbols and the lookahead: STAGE >= 3 refills + 1."""
    cur, nxt, nn, pos, k, nw = st
    wptr, wlut_ptr, row, lane = ctx
    lane = gl.inline_asm_elementwise(_CP_WAIT_1, "=r,r", [lane], dtype=gl.int32, is_pure=False, pack=1)
    limit = k + STAGE - 1
    src = wptr + filled
    for i in gl.static_range(_ring_refill_words(L)):
        w = filled + i
        gl.inline_asm_elementwise(_cp_async4_pred_asm(4 * i), "=r,r,l,r",
                                  [(_CHANNELS << (L + 1)) + 4 * ((w & (STAGE - 1)) * B + lane), src,
                                   (ok & (w < limit) & (w < nw)).to(gl.int32)], dtype=gl.int32, is_pure=False, pack=1)
    gl.inline_asm_elementwise(_CP_COMMIT, "=r,r", [lane], dtype=gl.int32, is_pure=False, pack=1)
    return (wptr, wlut_ptr, row, lane), gl.minimum(filled + _ring_refill_words(L), limit)


@gluon.jit
def _store4(ptr, ws, ok):
    gl.inline_asm_elementwise(_ST_V4, "=r,l,r,r,r,r,r", [ptr, ws[0], ws[1], ws[2], ws[3], ok.to(gl.int32)],
                              dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def decode_stream(buf32_ptr, buf64_ptr, out32_ptr, wlut_ptr, row, p64, ok, s, off, start, nw, lane, C: gl.constexpr,
                  H: gl.constexpr, L: gl.constexpr, IS_BF16: gl.constexpr, SHARED: gl.constexpr,
                  STAGE: gl.constexpr, B: gl.constexpr, RING: gl.constexpr):
    """Stream s of the pages ``p64`` (one per thread): its 16 tokens x 32 channels into ``out``."""
    wptr = buf32_ptr + (off + H + _TOKENS * C) // 4 + start
    if STAGE > 0:
        # the stream's first words (zeros past its end) into this lane's slots: STAGE of them, or
        # with RING words 2 .. STAGE + 1 (words 0-2 start in registers) in slots i mod STAGE; each
        # lane reads only its own slots, so it waits for its own copies (no barrier)
        dst = (_CHANNELS << (L + 1)) + 4 * lane
        for i in gl.static_range(2 * RING, STAGE + 2 * RING):
            gl.inline_asm_elementwise(_cp_async4_asm(4 * (i % STAGE) * B, 4 * i), "=r,r,l,r",
                                      [dst, wptr, gl.where(ok & (i < nw), 4, 0)], dtype=gl.int32, is_pure=False,
                                      pack=1)
        lane = gl.inline_asm_elementwise(_CP_COMMIT_WAIT, "=r,r", [lane], dtype=gl.int32, is_pure=False, pack=1)
    cur = gl.load(wptr, mask=ok & (nw > 0), other=0).to(gl.uint32, bitcast=True)
    nxt = gl.load(wptr + 1, mask=ok & (nw > 1), other=0).to(gl.uint32, bitcast=True)
    nn = gl.load(wptr + 2, mask=ok & (nw > 2), other=0).to(gl.uint32, bitcast=True)
    wptr = wptr.to(gl.pointer_type(gl.uint32), bitcast=True)
    st = (cur, nxt, nn, gl.zeros_like(nw), gl.full_like(nw, 3), nw)
    ctx = (wptr, wlut_ptr, row, lane)
    rbase = (off + H) // 8 + s * 4
    optr = out32_ptr + (p64 * _TOKENS * C + s * _CHANNELS) // 2
    filled = gl.full_like(nw, STAGE + 2)  # RING: the next word to copy
    ra, rb, rc, rd = _raw_words(buf64_ptr, rbase, 0, ok, C)
    for t in range(_TOKENS):
        na, nb, nc, nd = _raw_words(buf64_ptr, rbase, t + 1, ok & (t + 1 < _TOKENS), C)
        if RING:
            ctx, filled = _refill(st, ctx, filled, ok, L, STAGE, B)
        w, st = _eight(ra, 0, st, ctx, L, IS_BF16, SHARED, STAGE, B, RING)
        _store4(optr + t * (C // 2), w, ok)
        if RING:
            ctx, filled = _refill(st, ctx, filled, ok, L, STAGE, B)
        w, st = _eight(rb, 1, st, ctx, L, IS_BF16, SHARED, STAGE, B, RING)
        _store4(optr + t * (C // 2) + 4, w, ok)
        if RING:
            ctx, filled = _refill(st, ctx, filled, ok, L, STAGE, B)
        w, st = _eight(rc, 2, st, ctx, L, IS_BF16, SHARED, STAGE, B, RING)
        _store4(optr + t * (C // 2) + 8, w, ok)
        if RING:
            ctx, filled = _refill(st, ctx, filled, ok, L, STAGE, B)
        w, st = _eight(rd, 3, st, ctx, L, IS_BF16, SHARED, STAGE, B, RING)
        _store4(optr + t * (C // 2) + 12, w, ok)
        ra, rb, rc, rd = na, nb, nc, nd


@gluon.jit
def decode_kernel(
    buf32_ptr,  # int32 view of the page buffer
    buf16_ptr,  # int16 view (headers)
    buf64_ptr,  # int64 view (raw bytes)
    off_ptr,  # int64 [n + 1] page offsets in bytes (multiples of 8)
    wlut_ptr,  # int16 [G, C, 2**L] window tables (``exact_page.window_table``)
    out32_ptr,  # int32 view of int16 [n, 16, C] (16-byte aligned)
    tid_ptr,  # int32 [n] codebook of each page
    n_pages,
    C: gl.constexpr,
    S: gl.constexpr,
    SP: gl.constexpr,
    H: gl.constexpr,
    L: gl.constexpr,
    IS_BF16: gl.constexpr,
    BLOCK_PAGES: gl.constexpr,
    STAGE: gl.constexpr = 0,  # words per page and stream staged in shared memory (0: read from global)
    RING: gl.constexpr = False,  # the STAGE slots a ring refilled every 8 symbols (STAGE a power of two)
):
    """A program decodes stream s of BLOCK_PAGES pages, a thread one page; its 32 tables (and with
    STAGE the stream words) in shared memory when its pages share a codebook."""
    NW: gl.constexpr = gl.num_warps()
    HC: gl.constexpr = min(SP, 32)  # header words read at a time
    HL: gl.constexpr = gl.BlockedLayout([1, HC], [32, 1], [NW, 1], [1, 0])
    P1: gl.constexpr = gl.SliceLayout(1, HL)
    # every thread holds UN pages' table ids at a time: the uniformity test reduces in registers
    UN: gl.constexpr = 16
    UL: gl.constexpr = gl.BlockedLayout([UN], [32], [NW], [0])
    TL: gl.constexpr = gl.BlockedLayout([4], [32], [NW], [0])
    TW: gl.constexpr = _CHANNELS << L  # table entries of a stream

    s = gl.program_id(1)
    p0 = gl.program_id(0) * BLOCK_PAGES
    p = p0 + gl.arange(0, BLOCK_PAGES, layout=P1)
    ok = p < n_pages
    p64 = p.to(gl.int64)
    off = gl.load(off_ptr + p64, mask=ok, other=0)
    # words per stream from the header; this stream starts after the streams before it
    start = gl.zeros_like(p)
    nw = gl.zeros_like(p)
    for h in range(SP // HC):
        sj = h * HC + gl.expand_dims(gl.arange(0, HC, layout=gl.SliceLayout(0, HL)), 0)
        hdr = gl.load(buf16_ptr + gl.expand_dims(off // 2, 1) + sj, mask=gl.expand_dims(ok, 1) & (sj < S), other=0)
        hdr = hdr.to(gl.int32) & 0xFFFF
        start += gl.sum(gl.where(sj < s, hdr, 0), axis=1)
        nw += gl.sum(gl.where(sj == s, hdr, 0), axis=1)

    # the shared path when the program's pages share a codebook (and, with STAGE, every page's stream
    # fits its STAGE slots): every thread holds UN pages' table ids and word counts at a time, so the
    # test reduces in registers
    t0 = gl.load(tid_ptr + p0)
    fast = t0 == t0
    for c in range(BLOCK_PAGES // UN):
        pu = p0 + c * UN + gl.arange(0, UN, layout=UL)
        tu = gl.load(tid_ptr + pu, mask=pu < n_pages, other=t0)
        fast = fast & (gl.min(tu, 0) == t0) & (gl.max(tu, 0) == t0)
        if STAGE > 0 and not RING:
            ou = gl.load(off_ptr + pu, mask=pu < n_pages, other=0)
            wu = gl.load(buf16_ptr + ou // 2 + s, mask=pu < n_pages, other=0).to(gl.int32) & 0xFFFF
            fast = fast & (gl.max(wu, 0) <= STAGE)
    smem = gl.allocate_shared_memory(gl.int32, [_smem_words(L, STAGE, BLOCK_PAGES)],
                                     gl.SwizzledSharedLayout(1, 1, 1, [0]))
    lane = p - p0
    if fast:
        x = gl.arange(0, TW // 2, layout=TL)
        base = (t0.to(gl.int64) * C + s * _CHANNELS) << L
        smem.slice(0, TW // 2).store(gl.load(wlut_ptr.to(gl.pointer_type(gl.int32), bitcast=True) + base // 2 + x))
        gl.thread_barrier()
        decode_stream(buf32_ptr, buf64_ptr, out32_ptr, wlut_ptr, 0, p64, ok, s, off, start, nw, lane, C, H, L,
                      IS_BF16, True, STAGE, BLOCK_PAGES, RING)
    else:
        row = (gl.load(tid_ptr + p64, mask=ok, other=0).to(gl.int64) * C + s * _CHANNELS) << L
        decode_stream(buf32_ptr, buf64_ptr, out32_ptr, wlut_ptr, row, p64, ok, s, off, start, nw, lane, C, H, L,
                      IS_BF16, False, 0, BLOCK_PAGES, False)


def decode_into(buf: torch.Tensor, offsets: torch.Tensor, wlut: torch.Tensor, max_len: int, channels: int,
                is_bf16: bool, out: torch.Tensor, tids: torch.Tensor, block_pages: int = 32, stage: int = 64,
                ring: bool = False) -> None:
    """``exact_page.decode_into`` on Hopper: ``wlut`` the window tables (int16 [G, C, 2**max_len]),
    ``out`` int16 [n, 16, C], 16-byte aligned; ``stage``: words per page and stream staged in shared
    memory (0: read from global memory); no host reads."""
    if block_pages not in (32, 64, 128, 256):
        raise InvalidArgumentError(f"the Gluon decoder takes 32, 64, 128 or 256 pages per program, got {block_pages}")
    if not 0 <= stage <= 256:
        raise InvalidArgumentError(f"stage must lie in [0, 256] words, got {stage}")
    if ring and (stage & (stage - 1) or stage < 3 * _ring_refill_words(max_len) + 1):
        raise InvalidArgumentError(f"a ring needs a power of two of at least 3 refills + 1 words, got {stage}")
    smem = 4 * _smem_words(max_len, stage, block_pages)
    if smem > HOPPER_SMEM:
        raise InvalidArgumentError(f"{block_pages} pages per program and {stage} staged words need {smem} bytes of "
                                   f"shared memory, more than a Hopper program's {HOPPER_SMEM}")
    n = offsets.numel() - 1
    if not n:
        return
    S = channels // STREAM_CHANNELS
    grid = (-(-n // block_pages), S)
    decode_kernel[grid](
        buf.view(torch.int32), buf.view(torch.int16), buf.view(torch.int64), offsets, wlut, out.view(torch.int32),
        tids, n, C=channels, S=S, SP=triton.next_power_of_2(S), H=header_len(channels), L=max_len,
        IS_BF16=is_bf16, BLOCK_PAGES=block_pages, STAGE=stage, RING=ring, num_warps=block_pages // 32,
    )


__all__ = ["window_decode_ref", "decode_kernel", "decode_into"]
