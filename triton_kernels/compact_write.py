"""Cache write for the compact KV formats (q4, q3.5, q3): new bf16 K or V tokens into their pages.

Read me first:

* **What it writes.** For each new token of one layer and kind (K or V), ``x [n, kv_heads, head_dim]``
  and its slot (vLLM's slot mapping: ``slot = block * block_size + offset``; a negative slot is
  padding and writes nothing), the kernel encodes every KV head with that head's calibrated tables
  and stores the codes (nibble rows at width 4, crumb rows and a bit-2 row at width 3 from head_dim
  32, else ``bits`` bit planes) and the u8 scale index
  into the token's page of the pool ``pages uint8 [num_blocks, kv_heads, block_size / 16,
  page_bytes]``, the layout ``paged_decode`` reads (``codec.pack_page``). The bytes are the reference encoder's
  (``codec.encode_tokens``) bit for bit; ``compact_write_ref`` is the plain-PyTorch reference.
* **Why bit for bit.** The front end is integer: ``xi = trunc(clamp(nan_to_0(x)) * 2**16)`` (a
  power-of-two product, exact), ``z = ((xi - mu) * mult) >> 16`` and the Walsh-Hadamard rotation in
  int64 (exact in any order). Then ``float32(y)`` (round to nearest even), the scale index by counting
  grid steps below ``max |y|``, and each code by counting ``float32(thr[j] * grid[k])`` below ``y``:
  every float operation is a single rounded product or a comparison, so no FMA contraction or
  summation order can change a byte.
* **Rotation.** ``H_d = H_{d1} (x) H_{d2}`` (``d = d1 * d2``, Sylvester order, channel ``c = d2 * c1 +
  c0``): the rotation is two small integer matrix products, ``d * (d1 + d2)`` additions per token
  instead of ``d * d``; signs of H from the parity of ``i & j``.
* **Rotary offsets** (K tables with ``rope_m``, docs/FORMAT.md): the token's position p turns the
  pre-RoPE key mean to ``r(p)`` in integer arithmetic (48-bit phase, two integer cos/sin tables,
  shifts) exactly as ``codec.rope_offset``, and ``z = ((xi - mu - r(p)) * mult) >> 16``.
* **Schedule.** One program per (token, KV head); a token's bytes in a page (its nibble row or its
  row of each plane, and its scale byte) belong to it alone, so tokens of one page are written independently.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from weightszip._tensors import no_overlap
from weightszip.errors import InvalidArgumentError

from ._interpreter_compat import apply as _interpreter_compat

_interpreter_compat()

PAGE_TOKENS = 16
GRID_SIZE = 256
BITS_CHOICES = (2, 3, 4, 5)


@triton.jit
def _hadamard_neg(N: tl.constexpr, LOG_N: tl.constexpr):
    """[N, N] booleans: True where the Sylvester-Hadamard entry (-1)**popcount(i & j) is -1."""
    i = tl.arange(0, N)
    a = i[:, None] & i[None, :]
    par = tl.zeros([N, N], dtype=tl.int32)
    for s in tl.static_range(LOG_N):
        par = par ^ ((a >> s) & 1)
    return par == 1


@triton.jit
def _rope_offset(pos, m_ptr, phase_ptr, trig_ptr, h, HEAD_DIM: tl.constexpr):
    """r(p) [HEAD_DIM] int64 of one head at position ``pos`` (``codec.rope_offset``): trig_ptr holds
    the coarse cos, coarse sin (4096 each), fine cos, fine sin (1024 each) int64 tables."""
    HALF: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HEAD_DIM)
    i = offs % HALF
    f = tl.load(phase_ptr + i)
    ph = ((((pos * (f >> 16)) & 0xFFFFFFFF) << 16) + pos * (f & 0xFFFF)) & 0xFFFFFFFFFFFF
    hi = ph >> 36
    lo = (ph >> 26) & 1023
    c1 = tl.load(trig_ptr + hi)
    s1 = tl.load(trig_ptr + 4096 + hi)
    c2 = tl.load(trig_ptr + 8192 + lo)
    s2 = tl.load(trig_ptr + 9216 + lo)
    cs = (c1 * c2 - s1 * s2) >> 30
    sn = (s1 * c2 + c1 * s2) >> 30
    a = tl.load(m_ptr + h * HEAD_DIM + i)
    b = tl.load(m_ptr + h * HEAD_DIM + HALF + i)
    return tl.where(offs < HALF, (a * cs - b * sn) >> 30, (a * sn + b * cs) >> 30)


@triton.jit
def _compact_write_kernel(
    x_ptr, slot_ptr, pages_ptr, mu_ptr, mult_ptr, signs_ptr, grid_ptr, thr_ptr,
    pos_ptr, rope_m_ptr, rope_phase_ptr, trig_ptr,
    stride_xt, stride_xh, stride_blk, stride_head,
    HEAD_DIM: tl.constexpr, D1: tl.constexpr, D2: tl.constexpr, LOG_D1: tl.constexpr, LOG_D2: tl.constexpr,
    BITS: tl.constexpr, BLOCK_SIZE: tl.constexpr, N_THR: tl.constexpr, BLOCK_THR: tl.constexpr,
    HAS_ROPE: tl.constexpr = False,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    ok = slot >= 0
    slot = tl.maximum(slot, 0)
    offs = tl.arange(0, HEAD_DIM)

    # 1. fixed point, exact integers from here on
    x = tl.load(x_ptr + t.to(tl.int64) * stride_xt + h * stride_xh + offs).to(tl.float32)
    x = tl.where(x != x, 0.0, x)
    x = tl.minimum(tl.maximum(x, -1048576.0), 1048576.0)
    xi = (x * 65536.0).to(tl.int64)  # exact product (power of two), truncation toward zero
    mu = tl.load(mu_ptr + h * HEAD_DIM + offs)
    mult = tl.load(mult_ptr + h * HEAD_DIM + offs)
    sg = tl.load(signs_ptr + h * HEAD_DIM + offs)
    if HAS_ROPE:
        pos = tl.load(pos_ptr + t).to(tl.int64)
        xi = xi - _rope_offset(pos, rope_m_ptr, rope_phase_ptr, trig_ptr, h, HEAD_DIM)
    z = (((xi - mu) * mult) >> 16) * sg

    # 2. rotation y = H_d z = (H_d1 (x) H_d2) z, in int64
    z2 = tl.reshape(z, [D1, D2])  # [c1, c0]
    n2 = _hadamard_neg(D2, LOG_D2)  # [i0, c0]
    t2 = tl.sum(tl.where(n2[None, :, :], -z2[:, None, :], z2[:, None, :]), axis=2)  # [c1, i0]
    n1 = _hadamard_neg(D1, LOG_D1)  # [i1, c1]
    y2 = tl.sum(tl.where(n1[:, :, None], -t2[None, :, :], t2[None, :, :]), axis=1)  # [i1, i0]
    yf = tl.reshape(y2, [HEAD_DIM]).to(tl.float32)  # round to nearest even

    # 3-4. scale index: k = #{i : grid[i] < max |y|}, at most 255
    m = tl.max(tl.abs(yf), axis=0)
    offs_g = tl.arange(0, 256)
    grid = tl.load(grid_ptr + h * 256 + offs_g)
    k = tl.minimum(tl.sum((grid < m).to(tl.int32), axis=0), 255)
    g = tl.load(grid_ptr + h * 256 + k)

    # 5. codes: #{j : y > float32(thr[j] * g)}
    offs_j = tl.arange(0, BLOCK_THR)
    j_ok = offs_j < N_THR
    thr = tl.load(thr_ptr + h * N_THR + offs_j, mask=j_ok, other=0.0)
    tk = thr * g
    code = tl.sum((j_ok[None, :] & (yf[:, None] > tk[None, :])).to(tl.int32), axis=1)  # [HEAD_DIM]

    # pack: the codes (``codec.pack_page``'s layout), then the 16 scale bytes
    ROW: tl.constexpr = HEAD_DIM // 8
    PLANE: tl.constexpr = 16 * ROW
    PAGE_BYTES: tl.constexpr = 16 * (BITS * ROW + 1)
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    page = blk * stride_blk + h * stride_head + (off // 16) * PAGE_BYTES
    tip = off % 16
    if BITS == 4:  # nibble rows: byte i = code 2 i | code 2 i + 1 << 4, token row t at t * HEAD_DIM / 2
        lo, hi = tl.split(tl.reshape(code, [HEAD_DIM // 2, 2]))
        offs_n = tl.arange(0, HEAD_DIM // 2)
        tl.store(pages_ptr + page + tip * (HEAD_DIM // 2) + offs_n, (lo | (hi << 4)).to(tl.uint8), mask=ok)
    elif BITS == 3 and HEAD_DIM >= 32:  # crumb rows, then the bit-2 words (``codec.bit2_positions``); row t at t * 3 HEAD_DIM / 8
        M: tl.constexpr = HEAD_DIM // 32
        row = page + tip * (3 * HEAD_DIM // 8)
        c4 = tl.reshape(code, [HEAD_DIM // 4, 4])
        crumb = tl.sum((c4 & 3) << (2 * tl.arange(0, 4))[None, :], axis=1)
        tl.store(pages_ptr + row + tl.arange(0, HEAD_DIM // 4), crumb.to(tl.uint8), mask=ok)
        # channel h HEAD_DIM / 2 + 16 g + 4 k + s: bit s + 2 (s // 2) + 2 h of byte k of word g
        b = (tl.reshape(code, [2, M, 4, 4]) >> 2) & 1
        hh = tl.arange(0, 2)[:, None, None, None]
        ss = tl.arange(0, 4)[None, None, None, :]
        byte = tl.sum(tl.sum(b << (ss + 2 * (ss // 2) + 2 * hh), axis=3), axis=0)  # [M, 4]
        offs_b = tl.arange(0, M)[:, None] * 4 + tl.arange(0, 4)[None, :]
        tl.store(pages_ptr + row + HEAD_DIM // 4 + offs_b, byte.to(tl.uint8), mask=ok)
    else:
        c2 = tl.reshape(code, [ROW, 8])
        w8 = (1 << tl.arange(0, 8))[None, :]
        offs_r = tl.arange(0, ROW)
        for p in tl.static_range(BITS):
            byte = tl.sum(((c2 >> p) & 1) * w8, axis=1)
            tl.store(pages_ptr + page + p * PLANE + tip * ROW + offs_r, byte.to(tl.uint8), mask=ok & (offs_r < ROW))
    tl.store(pages_ptr + page + BITS * PLANE + tip, k.to(tl.uint8), mask=ok)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise InvalidArgumentError(msg)


def compact_write_tables(tables, device="cpu") -> dict:
    """The tensors the write kernel needs for one (layer, kind), from a ``codec.HeadTables`` per KV
    head: mu, mult, signs int64 [H, d]; grid fp32 [H, 256]; thr fp32 [H, 2**bits - 1]; bits; and
    for K tables with rotary offsets rope_m int64 [H, d], rope_phase int64 [d/2], trig int64 [10240]
    (the codec's integer cos/sin tables)."""
    from weightszip.compact import codec

    _check(len(tables) > 0 and len({t.bits for t in tables}) == 1, "one HeadTables per KV head, all of one bit width")
    rope = {}
    stacked = codec.stack_rope(tables)
    if stacked is not None:
        m, f = stacked
        _check(bool((f == f[0]).all()), "the KV heads of one layer share one rope_phase")
        rope = dict(rope_m=m.contiguous().to(device), rope_phase=f[0].contiguous().to(device),
                    trig=torch.cat(codec.trig_tables()).contiguous().to(device))
    return dict(
        **rope,
        mu=torch.stack([t.mu for t in tables]).contiguous().to(device),
        mult=torch.stack([t.mult for t in tables]).contiguous().to(device),
        signs=torch.stack([t.signs for t in tables]).contiguous().to(device),
        grid=torch.stack([t.grid() for t in tables]).contiguous().to(device),
        thr=torch.stack([codec.thresholds(t.codebook) for t in tables]).contiguous().to(device),
        bits=tables[0].bits,
    )


def _check_args(x, slot_mapping, pages, tables):
    _check(isinstance(tables, dict), "tables must be the dict compact_write_tables makes")
    _check(isinstance(x, torch.Tensor) and x.dim() == 3 and x.dtype in (torch.bfloat16, torch.float16, torch.float32),
           "x must be [num_tokens, kv_heads, head_dim] bf16, fp16 or fp32")
    n, h, d = x.shape
    _check(d >= 16 and d & (d - 1) == 0 and d <= 256, f"head_dim must be a power of two in [16, 256], not {d}")
    bits = tables.get("bits")
    _check(bits in BITS_CHOICES, f"tables['bits'] must be one of {BITS_CHOICES}")
    for name, dt, shape in (("mu", torch.int64, (h, d)), ("mult", torch.int64, (h, d)), ("signs", torch.int64, (h, d)),
                            ("grid", torch.float32, (h, GRID_SIZE)), ("thr", torch.float32, (h, 2**bits - 1))):
        t = tables.get(name)
        _check(isinstance(t, torch.Tensor) and t.dtype == dt and tuple(t.shape) == shape and t.is_contiguous()
               and t.device == x.device, f"tables[{name!r}] must be contiguous {dt} {list(shape)} on x's device")
    # (contiguous: the kernel reads slot t at slot_mapping + t, and check_slots looks at the values)
    _check(isinstance(slot_mapping, torch.Tensor) and slot_mapping.dim() == 1 and slot_mapping.numel() == n
           and slot_mapping.dtype in (torch.int32, torch.int64) and slot_mapping.device == x.device
           and slot_mapping.is_contiguous(), f"slot_mapping must be contiguous int32 or int64 [{n}] on x's device")
    nbytes = PAGE_TOKENS * (bits * d // 8 + 1)
    _check(isinstance(pages, torch.Tensor) and pages.dtype == torch.uint8 and pages.dim() == 4
           and tuple(pages.shape[1:]) == (h, pages.shape[2], nbytes) and pages.shape[2] >= 1
           and pages.stride(3) == 1 and pages.stride(2) == nbytes and pages.device == x.device,
           f"pages must be uint8 [num_blocks, {h}, block_size / 16, {nbytes}] with each block's pages contiguous")
    _check(no_overlap(pages), "pages: no two blocks or heads may share memory (an expanded view)")
    return n, h, d, bits, pages.shape[2] * PAGE_TOKENS, nbytes


def compact_write(x: torch.Tensor, slot_mapping: torch.Tensor, pages: torch.Tensor, tables: dict,
                  positions: torch.Tensor | None = None, *, check_slots: bool = True) -> None:
    """Encode ``x`` [n, kv_heads, head_dim] (one layer's new K or V tokens) into ``pages`` in place.

    slot_mapping: contiguous int [n], ``block * block_size + offset``, negative = skip. tables: from
    ``compact_write_tables``. positions: contiguous int [n], each token's position in its sequence (needed when
    the tables carry rotary offsets: K of a calibration with ``rope_m``). ``check_slots`` verifies
    on the host that every slot lies in the pool and every position in [0, 2**31) (a device sync;
    pass False inside CUDA graphs once the caller guarantees it)."""
    n, h, d, bits, block_size, _ = _check_args(x, slot_mapping, pages, tables)
    rope = "rope_m" in tables
    if rope:
        _check(isinstance(positions, torch.Tensor) and positions.dim() == 1 and positions.numel() == n
               and positions.dtype in (torch.int32, torch.int64) and positions.device == x.device
               and positions.is_contiguous(),
               f"these tables carry rotary offsets: positions must be contiguous int32 or int64 [{n}] on x's device")
        for name, shape in (("rope_m", (h, d)), ("rope_phase", (d // 2,)), ("trig", (10240,))):
            t = tables[name]
            _check(isinstance(t, torch.Tensor) and t.dtype == torch.int64 and tuple(t.shape) == shape
                   and t.is_contiguous() and t.device == x.device, f"tables[{name!r}] must be contiguous int64 {list(shape)}")
    if n == 0:
        return
    if rope and check_slots:
        _check(int(positions.min()) >= 0 and int(positions.max()) < 2**31, "positions must lie in [0, 2**31)")
    if check_slots:
        _check(int(slot_mapping.max()) < pages.shape[0] * block_size,
               f"a slot lies beyond the pool ({pages.shape[0]} blocks of {block_size})")
    _check(x.stride(2) == 1, "x: head_dim must be contiguous")
    log_d = d.bit_length() - 1
    log1 = log_d // 2
    log2 = log_d - log1
    n_thr = 2**bits - 1
    _compact_write_kernel[(n, h)](
        x, slot_mapping, pages, tables["mu"], tables["mult"], tables["signs"], tables["grid"], tables["thr"],
        positions if rope else slot_mapping, tables["rope_m"] if rope else tables["mu"],
        tables["rope_phase"] if rope else tables["mu"], tables["trig"] if rope else tables["mu"],
        x.stride(0), x.stride(1), pages.stride(0), pages.stride(1),
        HEAD_DIM=d, D1=1 << log1, D2=1 << log2, LOG_D1=log1, LOG_D2=log2, BITS=bits, BLOCK_SIZE=block_size,
        N_THR=n_thr, BLOCK_THR=1 << (n_thr - 1).bit_length(), HAS_ROPE=rope,
        num_warps=4,
    )
