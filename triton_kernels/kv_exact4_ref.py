"""KV Exact4 pages: lossless bf16 KV pages with 4-bit exponent codes and no exception list (reference).

docs/FORMAT.md, "KV Exact4 pages, version 1", is the contract; this module is its reference encoder
and validating decoder in plain PyTorch (CPU or GPU). The attention kernel reads the same pages
through ``paged_decode`` (``page_type="exact4"``); ``dequantize_exact4_pages`` there returns what its
tile loader reads, for comparison with ``decode_pages`` here.

Where KV Exact version 1 (``kv_exact_ref``: 3-bit codes against calibrated window tops, about 0.70 of
bf16) escapes 2-4% of the exponents into a list whose ranks every tile must compute, this format
trades size for decode work: each channel of each 16-token page has its own window top (the
largest exponent there), a 16-exponent window (4-bit codes, code 15 for exponent 0, so zeros and
subnormals never escape) leaves a few in a million of real K values and about 1e-4 of real V values
outside, and a KV head of a page holding any of them is stored as plain bf16. A tile then decodes with a shift, a
mask, a select and a few ors per value, and only tiles with a plain head take a second path. No
calibration.

A bf16 value is a sign ``s``, an exponent ``e`` (8 bits) and a mantissa ``m`` (7 bits). Stored: a
*raw* byte ``s << 7 | m`` and a 4-bit *code*: ``top - e`` when ``top - 14 <= e <= top`` and
``e >= 1``; 15 when ``e == 0``. ``top`` (u8, per page, head and channel) is ``max(15, the largest
exponent of the channel's 16 values)``.

Page layout (H KV heads, H <= 32, head_dim D a multiple of 32, 16 tokens)::

    header   u32 plain-head mask (bit h: head h stored as bf16), then 12 zero bytes
    slots    H slots of 25 D bytes, head h at 16 + 25 D h: a coded head's tops [D], codes
             [16][D / 2] and raw bytes [16][D]; a plain head's bf16 values [16][D] (little endian)
             of tokens 0-11 (24 D bytes), then D zero bytes
    tails    the values of tokens 12-15 of each plain head (8 D bytes), in head order

A coded head (nearly all of them) sits at a fixed place, so a tile's loads need only the page's
offset; the tail of a plain head is found from the mask.

Codes of a token row: u32 word m (little endian) holds channels 8 m .. 8 m + 7; channel 8 m + r is
the nibble at bit ``16 (r % 2) + 4 (r // 2)`` (so channels 2 k and 2 k + 1 sit 16 bits apart, in
the two halves of the word). Tops and raw bytes of a row are in *half order*: channel 8 m + 4 h + b
at byte ``h D / 2 + 4 m + b`` (h = 0, 1), so the u32 words a GPU thread needs for the code word m
(raw and top bytes of channels 8 m .. 8 m + 3 and 8 m + 4 .. 8 m + 7) are word m of each half. Pages are ``16 + 25 D H + 8 D P`` bytes for ``P`` plain heads.
"""

from __future__ import annotations

import torch

from weightszip.errors import CorruptDataError, InvalidArgumentError, TruncatedError

PAGE_TOKENS = 16
HEADER = 16
ZERO_CODE = 15  # the code of exponent 0
WINDOW = 15  # exponents top - 14 .. top take codes 0 .. 14
MIN_TOP = WINDOW  # every top >= 15, so top - code >= 1 for every code below 15
MAX_HEADS = 32
SLOT_TOKENS = 12  # a plain head's tokens 0-11 sit in its slot, 12-15 in its tail
TAIL_TOKENS = PAGE_TOKENS - SLOT_TOKENS
# bit position of channel 8 m + r's nibble in word m
NIBBLE_SHIFT = (0, 16, 4, 20, 8, 24, 12, 28)


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise InvalidArgumentError(msg)


def coded_head_bytes(head_dim: int) -> int:
    """Bytes of one coded KV head in a page (its slot): tops (D), codes (8 D) and raw bytes (16 D)."""
    return 25 * head_dim


def page_length(heads: int, head_dim: int, plain: int) -> int:
    """Bytes of a page with ``plain`` of its ``heads`` stored as bf16."""
    return HEADER + heads * coded_head_bytes(head_dim) + plain * TAIL_TOKENS * 2 * head_dim


def _bits(values: torch.Tensor) -> torch.Tensor:
    """16-bit patterns as int32 in [0, 65535]: bf16 or int16/uint16 input."""
    if values.dtype == torch.bfloat16:
        values = values.view(torch.int16)
    _check(values.dtype in (torch.int16, torch.uint16), f"values must be bf16 or their int16 bits, not {values.dtype}")
    return values.to(torch.int32) & 0xFFFF


def _check_shape(heads: int, head_dim: int) -> None:
    _check(0 < heads <= MAX_HEADS, f"KV Exact4 pages hold 1 to {MAX_HEADS} KV heads, not {heads}")
    _check(head_dim > 0 and head_dim % 32 == 0, f"head_dim must be a positive multiple of 32, not {head_dim}")


def tops_of(bits: torch.Tensor) -> torch.Tensor:
    """The window tops of pages: int32 16-bit patterns [..., 16, D] -> int32 [..., D]."""
    return ((bits >> 7) & 0xFF).amax(-2).clamp(min=MIN_TOP)


def codes_of(bits: torch.Tensor, tops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(code, fits) of each value (int32 16-bit patterns; ``tops`` broadcasts against them): the
    4-bit code, and whether the value has one (else its head is stored plain)."""
    e = (bits >> 7) & 0xFF
    d = tops.to(torch.int32) - e
    zero = e == 0
    fits = zero | ((d >= 0) & (d < WINDOW))
    return torch.where(zero, ZERO_CODE, torch.where(fits, d, 0)), fits


class EncodedPages:
    """Pages coded but not yet placed: ``heads_bytes`` uint8 [n, H, 33 D] (each head's bytes: a
    coded head's slot in the first 25 D; a plain head's slot, 25 D, then its tail, 8 D), ``plain``
    bool [n, H], ``lengths`` int64 [n]."""

    def __init__(self, heads_bytes: torch.Tensor, plain: torch.Tensor, heads: int, head_dim: int):
        self.heads_bytes, self.plain = heads_bytes, plain
        self.heads, self.head_dim = heads, head_dim
        self.lengths = page_length(heads, head_dim, 0) + plain.sum(1).to(torch.int64) * TAIL_TOKENS * 2 * head_dim

    def __len__(self) -> int:
        return self.heads_bytes.shape[0]

    def rows(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(uint8 [n, 16 + 33 D H] each page's bytes in its first ``lengths[i]``, the lengths)."""
        n, h, d = len(self), self.heads, self.head_dim
        dev = self.heads_bytes.device
        mask = (self.plain.to(torch.int64) << torch.arange(h, device=dev)).sum(1)
        out = torch.zeros((n, page_length(h, d, h)), dtype=torch.uint8, device=dev)
        for i in range(4):
            out[:, i] = ((mask >> (8 * i)) & 0xFF).to(torch.uint8)
        slot = coded_head_bytes(d)
        out[:, HEADER: HEADER + h * slot] = self.heads_bytes[:, :, :slot].reshape(n, -1)
        # tails: plain head h's tokens 12-15 at 16 + 25 D H + 8 D (its rank among the plain heads)
        rank = torch.cumsum(self.plain.to(torch.int64), 1) - self.plain.to(torch.int64)  # [n, H]
        tail = HEADER + h * slot + rank * 8 * d
        pos = torch.arange(8 * d, device=dev)
        pg, hh = torch.nonzero(self.plain, as_tuple=True)
        if pg.numel():
            out[pg[:, None], tail[pg, hh][:, None] + pos[None, :]] = self.heads_bytes[pg, hh, slot:]
        return out, self.lengths

    def write(self, buf: torch.Tensor, offsets: torch.Tensor) -> None:
        """Write every page into ``buf`` (uint8, 1-D) at ``offsets`` (int64 [n], multiples of 16)."""
        if len(self) == 0:
            return
        rows, lens = self.rows()
        dev = buf.device
        rows, lens = rows.to(dev), lens.to(dev)
        offsets = offsets.to(device=dev, dtype=torch.int64)
        pos = torch.arange(rows.shape[1], device=dev)
        keep = pos[None, :] < lens[:, None]
        buf[(offsets[:, None] + pos[None, :])[keep]] = rows[keep]

    def to_bytes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages back to back: (uint8 buffer, int64 offsets [n + 1])."""
        offsets = torch.nn.functional.pad(self.lengths.cumsum(0), (1, 0))
        buf = torch.zeros(int(offsets[-1]), dtype=torch.uint8, device=self.heads_bytes.device)
        self.write(buf, offsets[:-1])
        return buf, offsets


def half_order(d: int, device=None) -> torch.Tensor:
    """The channel at each byte of a row's tops or raw bytes (int64 [d])."""
    p = torch.arange(d, device=device)
    h, m, b = p // (d // 2), (p % (d // 2)) // 4, p % 4
    return 8 * m + 4 * h + b


def pack_codes(code: torch.Tensor) -> torch.Tensor:
    """Codes int32 [..., D] (0..15) -> their nibble words as uint8 [..., D / 2] (little endian)."""
    sh = torch.tensor(NIBBLE_SHIFT, dtype=torch.int64, device=code.device)
    words = (code.to(torch.int64).reshape(*code.shape[:-1], -1, 8) << sh).sum(-1)  # [..., D / 8]
    return torch.stack([(words >> (8 * i)) & 0xFF for i in range(4)], -1).reshape(*code.shape[:-1], -1).to(torch.uint8)


def unpack_codes(b: torch.Tensor) -> torch.Tensor:
    """``pack_codes``' inverse: uint8 [..., D / 2] -> int32 codes [..., D]."""
    w = b.to(torch.int64).reshape(*b.shape[:-1], -1, 4)
    words = w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)
    sh = torch.tensor(NIBBLE_SHIFT, dtype=torch.int64, device=b.device)
    return ((words[..., None] >> sh) & 15).reshape(*b.shape[:-1], -1).to(torch.int32)


def encode_pages(values: torch.Tensor) -> EncodedPages:
    """Code ``n`` pages. values: bf16 (or int16 bits) ``[n, 16, H, D]`` (token-major, as a model writes
    K or V)."""
    _check(isinstance(values, torch.Tensor) and values.dim() == 4 and values.shape[1] == PAGE_TOKENS,
           f"values must be [n, {PAGE_TOKENS}, kv_heads, head_dim], not {list(getattr(values, 'shape', []))}")
    n, _, h, d = values.shape
    _check_shape(h, d)
    bits = _bits(values).permute(0, 2, 1, 3)  # [n, H, 16, D]
    tops = tops_of(bits)  # [n, H, D]
    code, fits = codes_of(bits, tops[:, :, None, :])
    plain = ~fits.all(3).all(2)  # [n, H]
    raw = (((bits >> 8) & 0x80) | (bits & 0x7F)).to(torch.uint8)
    order = half_order(d, values.device)
    coded = torch.cat([tops[..., order].to(torch.uint8), pack_codes(code).reshape(n, h, -1),
                       raw[..., order].reshape(n, h, -1)], dim=2)  # [n, H, 25 D]
    le = torch.stack([bits & 0xFF, bits >> 8], -1).to(torch.uint8).reshape(n, h, -1)  # [n, H, 32 D]
    cut = SLOT_TOKENS * 2 * d
    spread = torch.cat([le[:, :, :cut], torch.zeros_like(le[:, :, :d]), le[:, :, cut:]], 2)  # [n, H, 33 D]
    heads_bytes = torch.where(plain[:, :, None], spread, torch.nn.functional.pad(coded, (0, 8 * d)))
    return EncodedPages(heads_bytes, plain, h, d)


def _u32(b: torch.Tensor) -> torch.Tensor:
    """Little-endian u32 from uint8 [..., 4k] as int64 [..., k]."""
    w = b.to(torch.int64).reshape(*b.shape[:-1], -1, 4)
    return w[..., 0] | (w[..., 1] << 8) | (w[..., 2] << 16) | (w[..., 3] << 24)


def decode_pages(buf: torch.Tensor, offsets: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Validate and decode pages stored back to back: ``buf`` uint8 (1-D), ``offsets`` int64 [n + 1]
    (page i is ``buf[offsets[i]:offsets[i + 1]]``). Returns int16 bits ``[n, 16, H, D]``. Raises
    TruncatedError / CorruptDataError (naming the page) for any input an encoder could not have
    written, so a page that passes re-encodes to the same bytes; never reads outside ``buf``."""
    _check(isinstance(buf, torch.Tensor) and buf.dtype == torch.uint8 and buf.dim() == 1, "buf must be a 1-D uint8 tensor")
    _check(isinstance(offsets, torch.Tensor) and offsets.dim() == 1 and offsets.numel() >= 1
           and not offsets.is_floating_point(), "offsets must be an integer tensor [n + 1]")
    h, d = heads, head_dim
    _check_shape(h, d)
    dev = buf.device
    off = offsets.to(device=dev, dtype=torch.int64)
    n = off.numel() - 1
    if int(off[0]) != 0 or int(off[-1]) != buf.numel():
        raise TruncatedError(f"page offsets cover bytes {int(off[0])}..{int(off[-1])} of a {buf.numel()}-byte buffer")
    length = off[1:] - off[:-1]
    if n == 0:
        return torch.zeros((0, PAGE_TOKENS, h, d), dtype=torch.int16, device=dev)

    def fail(mask: torch.Tensor, what: str, cls=CorruptDataError):
        idx = torch.nonzero(mask)
        if idx.numel():
            raise cls(f"page {int(idx[0, 0])}: {what}")

    fail(length < HEADER, f"shorter than its {HEADER}-byte header", TruncatedError)
    hdr = buf[off[:-1, None] + torch.arange(HEADER, device=dev)[None, :]]
    mask = _u32(hdr[:, :4])[:, 0]
    fail(hdr[:, 4:].ne(0).any(1), "nonzero header padding")
    fail(mask >> h != 0, f"the plain-head mask names a head beyond {h}")
    plain = ((mask[:, None] >> torch.arange(h, device=dev)) & 1).bool()  # [n, H]
    want = page_length(h, d, plain.sum(1))
    fail(length < want, "shorter than its heads", TruncatedError)
    fail(length > want, "longer than its heads")
    slot = coded_head_bytes(d)
    tail_len = TAIL_TOKENS * 2 * d
    rank = torch.cumsum(plain.to(torch.int64), 1) - plain.to(torch.int64)
    start = off[:-1, None] + HEADER + slot * torch.arange(h, device=dev)  # [n, H]
    tail = off[:-1, None] + HEADER + h * slot + rank * tail_len
    pos = torch.arange(slot + tail_len, device=dev)
    src = torch.where(pos < slot, start[:, :, None] + pos, tail[:, :, None] + pos - slot)
    # (a coded head's last 8 D positions point at a tail it does not have: read, clamped, unused)
    hb = buf[src.clamp(max=buf.numel() - 1)]  # [n, H, 33 D]: slot, tail
    # coded heads
    inv = torch.argsort(half_order(d, dev))  # channel -> byte
    tops = hb[:, :, :d][..., inv].to(torch.int32)  # [n, H, D]
    code = unpack_codes(hb[:, :, d: 9 * d].reshape(n, h, PAGE_TOKENS, d // 2))  # [n, H, 16, D]
    raw = hb[:, :, 9 * d: 25 * d].reshape(n, h, PAGE_TOKENS, d)[..., inv].to(torch.int32)
    e = torch.where(code == ZERO_CODE, 0, tops[:, :, None, :] - code)
    coded_bits = ((raw & 0x80) << 8) | (e << 7) | (raw & 0x7F)
    coded = ~plain
    fail((coded[:, :, None] & (tops < MIN_TOP)).flatten(1).any(1), f"a window top below {MIN_TOP}")
    fail((coded[:, :, None] & (tops != tops_of(coded_bits))).flatten(1).any(1),
         "a window top is not its channel's largest exponent")
    # plain heads: tokens 0-11 and D zero bytes in the slot, tokens 12-15 in the tail
    cut = SLOT_TOKENS * 2 * d
    fail((plain & hb[:, :, cut:slot].ne(0).any(2)).any(1), "nonzero padding in a plain head's slot")
    le = torch.cat([hb[:, :, :cut], hb[:, :, slot:]], 2).to(torch.int32).reshape(n, h, PAGE_TOKENS, d, 2)
    plain_bits = le[..., 0] | (le[..., 1] << 8)
    _, fits = codes_of(plain_bits, tops_of(plain_bits)[:, :, None, :])
    fail((plain & fits.all(3).all(2)).any(1), "a plain head whose values all have codes")
    bits = torch.where(plain[:, :, None, None], plain_bits, coded_bits)
    return bits.to(torch.int16).permute(0, 2, 1, 3).contiguous()


def heap_page_lengths(heap: torch.Tensor, offsets: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Each page's length from its header's plain-head mask (int64 [n]); checks the header lies in
    the heap. The page's own checks are ``decode_pages``'."""
    off = offsets.to(device=heap.device, dtype=torch.int64)
    if off.numel() == 0:
        return off.clone()
    if bool((off < 0).any() or (off + HEADER > heap.numel()).any()):
        raise TruncatedError("a page offset lies outside the heap")
    mask = _u32(heap[off[:, None] + torch.arange(4, device=heap.device)[None, :]])[:, 0]
    plain = torch.zeros_like(mask)
    for i in range(MAX_HEADS):
        plain += (mask >> i) & 1
    return page_length(heads, head_dim, plain)


def decode_heap_pages(heap: torch.Tensor, offsets: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Decode the pages at ``offsets`` (int64 [n], their lengths from their headers) of a heap (uint8,
    1-D) through the validating ``decode_pages``: int16 bits [n, 16, H, D]."""
    _check_shape(heads, head_dim)
    off = offsets.to(device=heap.device, dtype=torch.int64)
    lens = heap_page_lengths(heap, off, heads, head_dim)
    if bool((off + lens > heap.numel()).any()):
        raise TruncatedError("a page's header claims bytes past the end of the heap")
    starts = torch.nn.functional.pad(lens.cumsum(0), (1, 0))
    idx = torch.repeat_interleave(off - starts[:-1], lens) + torch.arange(int(starts[-1]), device=heap.device)
    return decode_pages(heap[idx], starts, heads, head_dim)


def _prmt(a: torch.Tensor, sel: int) -> torch.Tensor:
    """PTX ``prmt.b32 d, a, 0, sel`` (default mode) on int64 words holding u32: byte i of d is byte
    ``s & 3`` of a (s = nibble i of sel; bytes 4-7 are zero), or its sign bit replicated if ``s & 8``."""
    out = torch.zeros_like(a)
    for i in range(4):
        s = (sel >> (4 * i)) & 15
        b = (a >> (8 * (s & 3))) & 0xFF if s & 7 < 4 else torch.zeros_like(a)
        if s & 8:
            b = torch.where(b & 0x80 != 0, 0xFF, 0)
        out |= b << (8 * i)
    return out


def pair_decode(w: torch.Tensor, r0: torch.Tensor, r1: torch.Tensor, t0: torch.Tensor, t1: torch.Tensor) -> torch.Tensor:
    """The compiled tile decoder's math (``paged_decode._exact4_pair_ptx``) in PyTorch: from a token
    row's code word ``w``, raw words ``r0``/``r1`` and top words ``t0``/``t1`` (u32 in int64 tensors
    of one shape), the eight values' bf16 bits [..., 8] (channels 8 m .. 8 m + 7), two at a time in
    the 16-bit lanes of a u32."""
    m32 = 0xFFFFFFFF
    outs = []
    for p in range(4):
        k = ((w << (7 - 4 * p)) if p < 2 else (w >> (4 * p - 7))) & m32 & 0x07800780
        t = (_prmt((t0, t1)[p // 2], (0x4140, 0x4342)[p % 2]) << 7) & m32
        e = (t - k) & m32
        z = (((k + 0x00800080) & 0x08000800) >> 4) * 255 & m32
        e &= ~z & m32
        x = _prmt((r0, r1)[p // 2], (0x9180, 0xB3A2)[p % 2]) & 0x807F807F
        e |= x
        outs += [e & 0xFFFF, e >> 16]
    return torch.stack(outs, -1)
