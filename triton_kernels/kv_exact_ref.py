"""KV Exact pages: a lossless page format for bf16 KV that attention decodes as tiles (reference).

docs/FORMAT.md, "KV Exact pages, version 1", is the contract; this module is its reference
encoder and validating decoder, in plain PyTorch (runs on the CPU or the GPU). The attention
kernel reads the same pages through ``paged_decode`` (``page_type="exact"``), and
``dequantize_exact_pages`` there returns what its tile loader reads, for comparison with
``decode_pages`` here.

A bf16 value is a sign, an 8-bit exponent and 7 mantissa bits. Sign and mantissa are stored as a
*raw* byte; the exponent is a 3-bit *code*: ``code = base[c] - exponent`` when that lies in 0..6
(``base`` is a per-channel window top, calibrated once per layer and K or V: ``calibrate_bases``),
else the escape code 7 and the exponent byte in the page's exception list. Codes sit in three bit
planes per token row (the compact formats' layout), so a GPU unpacks a tile with shifts and
masks; an exception's place in the list is the number of escapes before it in the page's (token,
channel) order, which a tile computes with a prefix sum. No serial dependency: unlike the
Huffman-coded exact page profile (``exact_page_ref``) this decodes at tile speed, at about 0.70 of
bf16 instead of about 0.66.

Page layout (H KV heads, head_dim D a multiple of 32, 16 tokens)::

    header   u32 ex[H + 1], zero-padded to a multiple of 16 bytes (HDR bytes)
    head h   at HDR + h * 22 D:  planes [3][16][D / 8] bytes | raw [16][D] bytes
    escapes  head h's exponent bytes at ex[h] .. ex[h + 1] (token-major, then channel)
    padding  zeros to a multiple of 16 bytes
"""

from __future__ import annotations

import torch

from weightszip.errors import CorruptDataError, InvalidArgumentError, TruncatedError

PAGE_TOKENS = 16
CODE_BITS = 3
ESCAPE = 7  # the code of an exponent outside [base - 6, base]
WINDOW = 7  # exponents coded without escape
ALIGN = 16  # pages start and end at multiples of 16 bytes


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise InvalidArgumentError(msg)


def header_bytes(heads: int) -> int:
    """Bytes of the page header: ``heads + 1`` u32 offsets, padded to 16."""
    return -(-4 * (heads + 1) // ALIGN) * ALIGN


def head_bytes(head_dim: int) -> int:
    """Fixed bytes of one KV head in a page: three code planes (6 D) and the raw bytes (16 D)."""
    return (CODE_BITS * PAGE_TOKENS // 8 + PAGE_TOKENS) * head_dim


def fixed_bytes(heads: int, head_dim: int) -> int:
    """Bytes of a page before its exceptions: header and every head's planes and raw bytes."""
    return header_bytes(heads) + heads * head_bytes(head_dim)


def page_length(heads: int, head_dim: int, escapes: int) -> int:
    """Bytes of a page with ``escapes`` exceptions in all (padding included)."""
    return -(-(fixed_bytes(heads, head_dim) + escapes) // ALIGN) * ALIGN


def _bits(values: torch.Tensor) -> torch.Tensor:
    """16-bit patterns as int32 in [0, 65535]: bf16 or int16/uint16 input."""
    if values.dtype == torch.bfloat16:
        values = values.view(torch.int16)
    _check(values.dtype in (torch.int16, torch.uint16), f"values must be bf16 or their int16 bits, not {values.dtype}")
    return values.to(torch.int32) & 0xFFFF


def calibrate_bases(samples: torch.Tensor) -> torch.Tensor:
    """The window top per channel, uint8 [C], from samples ``[..., C]`` (bf16 or int16 bits) of one
    layer and kind: the exponent b whose window [b - 6, b] holds the most samples (the smallest b on
    ties). Any bases decode losslessly; good ones make fewer exceptions, so the pages are smaller."""
    e = (_bits(samples) >> 7) & 0xFF
    c = e.shape[-1]
    e = e.reshape(-1, c)
    _check(e.shape[0] > 0, "calibrate_bases needs at least one sample row")
    hist = torch.zeros((c, 256), dtype=torch.int64, device=e.device)
    hist.scatter_add_(1, e.T.contiguous().long(), torch.ones_like(e.T, dtype=torch.int64))
    cum = torch.nn.functional.pad(hist.cumsum(1), (1, 0))  # cum[:, j] = count of exponents < j
    top = torch.arange(256, device=e.device)
    window = cum[:, top + 1] - cum[:, (top - WINDOW + 1).clamp(min=0)]
    return window.argmax(1).to(torch.uint8)  # argmax returns the first maximum


def codes_of(bits: torch.Tensor, bases: torch.Tensor) -> torch.Tensor:
    """The 3-bit code of each value (int32 16-bit patterns ``[..., H, 16, D]`` or any shape ending in
    channels that broadcasts with ``bases``)."""
    d = bases.to(torch.int32) - ((bits >> 7) & 0xFF)
    return torch.where((d >= 0) & (d < WINDOW), d, ESCAPE)


class EncodedPages:
    """Pages coded but not yet placed: ``fixed`` uint8 [n, H * 22 D] (every head's planes and raw
    bytes), ``counts`` int64 [n, H] (escapes per head), ``escapes`` uint8 [sum counts] (all pages,
    page-major), ``lengths`` int64 [n] (bytes of each page, padded)."""

    def __init__(self, fixed, counts, escapes, heads, head_dim):
        self.fixed, self.counts, self.escapes = fixed, counts, escapes
        self.heads, self.head_dim = heads, head_dim
        self.lengths = ((fixed_bytes(heads, head_dim) + counts.sum(1) + ALIGN - 1) // ALIGN) * ALIGN

    def __len__(self) -> int:
        return self.fixed.shape[0]

    def header(self) -> torch.Tensor:
        """uint8 [n, HDR]: each page's u32 exception offsets, little endian, zero-padded."""
        n, h = self.counts.shape
        ex = fixed_bytes(h, self.head_dim) + torch.nn.functional.pad(self.counts.cumsum(1), (1, 0))
        words = ex.to(torch.int64)
        b = torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], dim=-1).reshape(n, 4 * (h + 1))
        return torch.nn.functional.pad(b, (0, header_bytes(h) - 4 * (h + 1))).to(torch.uint8)

    def write(self, buf: torch.Tensor, offsets: torch.Tensor) -> None:
        """Write every page into ``buf`` (uint8, 1-D) at ``offsets`` (int64 [n], multiples of 16, on
        buf's device): header, heads, escapes and the zero padding, all ``lengths[i]`` bytes."""
        n = len(self)
        if n == 0:
            return
        h, d = self.heads, self.head_dim
        dev = buf.device
        offsets = offsets.to(device=dev, dtype=torch.int64)
        fb = fixed_bytes(h, d)
        # header and heads: one indexed copy of [n, fb] bytes
        rows = torch.cat([self.header().to(dev), self.fixed.to(dev)], dim=1)
        buf[(offsets[:, None] + torch.arange(fb, device=dev)[None, :]).reshape(-1)] = rows.reshape(-1)
        # escapes and padding: page i's bytes fb .. lengths[i]
        tail = (self.lengths.to(dev) - fb)
        total = int(tail.sum())
        if total:
            page = torch.repeat_interleave(torch.arange(n, device=dev), tail)
            start = torch.cumsum(tail, 0) - tail
            pos = torch.arange(total, device=dev) - start[page]
            vals = torch.zeros(total, dtype=torch.uint8, device=dev)
            cnt = self.counts.sum(1).to(dev)
            is_esc = pos < cnt[page]
            vals[is_esc] = self.escapes.to(dev)
            buf[offsets[page] + fb + pos] = vals

    def to_bytes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages back to back: (uint8 buffer, int64 offsets [n + 1])."""
        offsets = torch.nn.functional.pad(self.lengths.cumsum(0), (1, 0))
        buf = torch.zeros(int(offsets[-1]), dtype=torch.uint8, device=self.fixed.device)
        self.write(buf, offsets[:-1])
        return buf, offsets


def encode_pages(values: torch.Tensor, bases: torch.Tensor) -> EncodedPages:
    """Code ``n`` pages. values: bf16 (or int16 bits) ``[n, 16, H, D]`` (token-major, as a model
    writes K or V); bases: uint8 ``[H, D]`` (or ``[H * D]``) of this layer and kind."""
    _check(isinstance(values, torch.Tensor) and values.dim() == 4 and values.shape[1] == PAGE_TOKENS,
           f"values must be a tensor [n, {PAGE_TOKENS}, kv_heads, head_dim]")
    n, _, h, d = values.shape
    _check(d % 32 == 0 and d > 0, f"head_dim must be a positive multiple of 32, not {d}")
    bases = _tops(bases, h, d, values.device)
    bits = _bits(values).permute(0, 2, 1, 3)  # [n, H, 16, D]
    code = codes_of(bits, bases[None, :, None, :])
    raw = (((bits >> 8) & 0x80) | (bits & 0x7F)).to(torch.uint8)
    jj = torch.arange(8, device=values.device, dtype=torch.int32)
    # plane p, token t, byte k: bit j = bit p of the code of channel 8 k + j
    planes = torch.stack([(((code >> p) & 1).reshape(n, h, PAGE_TOKENS, d // 8, 8) << jj).sum(-1)
                          for p in range(CODE_BITS)], dim=2).to(torch.uint8)  # [n, H, 3, 16, D/8]
    fixed = torch.cat([planes.reshape(n, h, -1), raw.reshape(n, h, -1)], dim=2).reshape(n, -1)
    esc = code == ESCAPE
    counts = esc.sum((2, 3)).to(torch.int64)
    escapes = ((bits >> 7) & 0xFF)[esc].to(torch.uint8)  # page, head, token, channel order
    return EncodedPages(fixed, counts, escapes, h, d)


def _tops(bases, h: int, d: int, device) -> torch.Tensor:
    """The window tops as uint8 [H, D] on ``device``: a uint8 tensor of H x D values (any shape)."""
    _check(isinstance(bases, torch.Tensor) and bases.dtype == torch.uint8 and bases.numel() == h * d,
           f"bases must be a uint8 tensor of {h} x {d} window tops")
    return bases.reshape(h, d).to(device)


def _u32(b: torch.Tensor) -> torch.Tensor:
    """Little-endian u32 from uint8 [..., 4k] as int64 [..., k]."""
    w = b.to(torch.int64).reshape(*b.shape[:-1], -1, 4)
    return w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)


def page_spans(buf: torch.Tensor, offsets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Pages stored back to back in ``buf``: (offsets as int64 on buf's device, each page's length),
    after checking that the offsets run from 0 to the buffer's end without decreasing (compared
    directly: sums and differences of hostile int64 offsets wrap). TruncatedError / CorruptDataError."""
    off = offsets.to(device=buf.device, dtype=torch.int64)
    if int(off[0]) != 0 or int(off[-1]) != buf.numel():
        raise TruncatedError(f"page offsets cover bytes {int(off[0])}..{int(off[-1])} of a {buf.numel()}-byte buffer")
    if bool((off[1:] < off[:-1]).any() or (off < 0).any() or (off > buf.numel()).any()):
        raise CorruptDataError("page offsets decrease or lie outside the buffer")
    return off, off[1:] - off[:-1]


def decode_pages(buf: torch.Tensor, offsets: torch.Tensor, bases: torch.Tensor, heads: int,
                 head_dim: int) -> torch.Tensor:
    """Validate and decode pages stored back to back: ``buf`` uint8 (1-D), ``offsets`` int64 [n + 1]
    (page i is ``buf[offsets[i]:offsets[i + 1]]``), bases uint8 [H, D]. Returns int16 bits
    ``[n, 16, H, D]``. Raises TruncatedError / CorruptDataError (with the page's index) for any
    input that an encoder could not have written; never reads outside ``buf``."""
    _check(isinstance(buf, torch.Tensor) and buf.dtype == torch.uint8 and buf.dim() == 1,
           "buf must be a 1-D uint8 tensor")
    _check(isinstance(offsets, torch.Tensor) and offsets.dim() == 1 and offsets.numel() >= 1
           and not offsets.is_floating_point(), "offsets must be an integer tensor [n + 1]")
    h, d = heads, head_dim
    _check(h > 0 and d > 0 and d % 32 == 0, f"head_dim must be a positive multiple of 32, not {d}")
    bases = _tops(bases, h, d, buf.device)
    off, length = page_spans(buf, offsets)
    n = off.numel() - 1
    fb = fixed_bytes(h, d)
    short = torch.nonzero(length < fb)
    if short.numel():
        i = int(short[0, 0])
        raise TruncatedError(f"page {i}: {int(length[i])} bytes, a page has at least {fb}")
    bad = torch.nonzero(length % ALIGN != 0)
    if bad.numel():
        raise CorruptDataError(f"page {int(bad[0, 0])}: length {int(length[int(bad[0, 0])])} is not a multiple of {ALIGN}")
    if n == 0:
        return torch.zeros((0, PAGE_TOKENS, h, d), dtype=torch.int16, device=buf.device)
    dev = buf.device
    rows = buf[off[:-1, None] + torch.arange(fb, device=dev)[None, :]]  # [n, fb]
    hdr = header_bytes(h)
    ex = _u32(rows[:, : 4 * (h + 1)])  # [n, H + 1]

    def fail(mask: torch.Tensor, what: str, cls=CorruptDataError):
        idx = torch.nonzero(mask)
        if idx.numel():
            raise cls(f"page {int(idx[0, 0])}: {what}")

    fail(rows[:, 4 * (h + 1): hdr].ne(0).any(1), "nonzero header padding")
    fail(ex[:, 0] != fb, f"first exception offset is not {fb}")
    fail((ex[:, 1:] < ex[:, :-1]).any(1), "exception offsets decrease")
    fail(ex[:, h] > length, "exceptions run past the page's end", TruncatedError)
    fail((ex[:, h] + ALIGN - 1) // ALIGN * ALIGN != length, "page longer than its exceptions and padding")
    body = rows[:, hdr:].reshape(n, h, -1)
    nplane = CODE_BITS * PAGE_TOKENS * d // 8
    planes = body[:, :, :nplane].reshape(n, h, CODE_BITS, PAGE_TOKENS, d // 8, 1).to(torch.int32)
    jj = torch.arange(8, device=dev, dtype=torch.int32)
    code = sum((((planes[:, :, p] >> jj) & 1) << p) for p in range(CODE_BITS)).reshape(n, h, PAGE_TOKENS, d)
    raw = body[:, :, nplane:].reshape(n, h, PAGE_TOKENS, d).to(torch.int32)
    esc = code == ESCAPE
    counts = esc.sum((2, 3))
    fail((counts != ex[:, 1:] - ex[:, :-1]).any(1), "escape count differs from the header")
    exp = bases.to(torch.int32)[None, :, None, :] - code
    fail(((exp < 0) & ~esc).flatten(1).any(1), "a code points below exponent 0")
    # escapes: page i, head h's list starts at off[i] + ex[i, h]; rank within the head
    flat_esc = esc.reshape(n * h, -1)
    per = counts.reshape(-1)
    total = int(per.sum())
    if total:
        start = torch.cumsum(per, 0) - per
        which = torch.repeat_interleave(torch.arange(n * h, device=dev), per)
        rank = torch.arange(total, device=dev) - start[which]
        src = off[which // h] + ex.reshape(n, h + 1)[which // h, which % h] + rank
        e_esc = buf[src].to(torch.int32)
        vals = exp.reshape(n * h, -1).clone()
        vals[flat_esc] = e_esc
        exp = vals.reshape(n, h, PAGE_TOKENS, d)
        where = torch.nonzero(flat_esc)  # (page * H + head, token * D + channel), in list order
        dd = bases.to(torch.int32)[where[:, 0] % h, where[:, 1] % d] - e_esc
        coded = (dd >= 0) & (dd < WINDOW)
        if bool(coded.any()):
            raise CorruptDataError(f"page {int(which[torch.nonzero(coded)[0, 0]]) // h}: an escaped exponent has a code")
    # padding after the exceptions must be zero
    pad_len = length - ex[:, h]
    pmax = int(pad_len.max())
    if pmax:
        pidx = ex[:, h, None] + torch.arange(pmax, device=dev)[None, :]
        pbytes = buf[(off[:-1, None] + pidx).clamp(max=buf.numel() - 1)]
        fail((pbytes.ne(0) & (pidx < length[:, None])).any(1), "nonzero padding after the exceptions")
    bits = ((raw & 0x80) << 8) | (exp << 7) | (raw & 0x7F)
    return bits.to(torch.int16).permute(0, 2, 1, 3).contiguous()


def decode_heap_pages(heap: torch.Tensor, offsets: torch.Tensor, bases: torch.Tensor, heads: int,
                      head_dim: int) -> torch.Tensor:
    """Decode the pages at ``offsets`` (int64 [n], their lengths read from their headers) of a heap
    (uint8, 1-D), through the validating ``decode_pages``: int16 bits [n, 16, H, D]."""
    h = heads
    off = offsets.to(device=heap.device, dtype=torch.int64)
    n = off.numel()
    if n == 0:
        return decode_pages(heap[:0], torch.zeros(1, dtype=torch.int64), bases, h, head_dim)
    if bool((off < 0).any() or (off > heap.numel() - 4 * (h + 1)).any()):  # (no sums: int64 wraps)
        raise TruncatedError("a page's header lies outside the heap")
    ex_end = _u32(heap[off[:, None] + 4 * h + torch.arange(4, device=heap.device)[None, :]])[:, 0]
    lens = (ex_end + ALIGN - 1) // ALIGN * ALIGN
    if bool((off > heap.numel() - lens).any()):
        raise TruncatedError("a page's header claims bytes past the end of the heap")
    starts = torch.nn.functional.pad(lens.cumsum(0), (1, 0))
    idx = torch.repeat_interleave(off - starts[:-1], lens) + torch.arange(int(starts[-1]), device=heap.device)
    return decode_pages(heap[idx], starts, bases, h, head_dim)
