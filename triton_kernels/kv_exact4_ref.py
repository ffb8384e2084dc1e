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
outside, and the token row (of one KV head) holding any of them is stored as plain bf16. A tile
then decodes with a few 32-bit operations per two values, and plain rows come from loads
predicated on the row. No calibration.

A bf16 value is a sign ``s``, an exponent ``e`` (8 bits) and a mantissa ``m`` (7 bits). Stored: a
*raw* byte ``s << 7 | m`` and a 4-bit *code*: ``top - e`` when ``top - 14 <= e <= top`` and
``e >= 1``; 15 when ``e == 0``. ``top`` (u8, per page, head and channel) is ``max(15, the largest
exponent of the channel's 16 values)``. A token row of a head with a value that has no code is
*plain*: its values are stored as bf16, its codes and raw bytes are zeros.

Page layout (H KV heads, 1 <= H <= 256, head_dim D a multiple of 32, 16 tokens; HDR = 4 H rounded
up to a multiple of 16)::

    header   per head h: u16 plain-row mask (bit t: token t is plain), u16 the plain rows of
             heads 0 .. h-1; zeros to HDR
    slots    H slots of 25 D bytes, head h at HDR + 25 D h: tops [D], codes [16][D / 2], raw
             bytes [16][D]
    plain    the plain rows' bf16 values (2 D bytes each, little endian), head-major, then token

Every slot sits at a fixed place, so a tile's loads need only the page's offset; a plain row is
found from its head's header entry (the rows before it: the entry's count plus the mask's bits
below it).

Codes of a token row: u32 word m (little endian) holds channels 8 m .. 8 m + 7; channel 8 m + r is
the nibble at bit ``16 (r % 2) + 4 (r // 2)`` (so channels 2 k and 2 k + 1 sit 16 bits apart, in
the two halves of the word). Tops and raw bytes of a row are in *half order*: channel 8 m + 4 h + b
at byte ``h D / 2 + 4 m + b`` (h = 0, 1), so the u32 words a GPU thread needs for the code word m
(raw and top bytes of channels 8 m .. 8 m + 3 and 8 m + 4 .. 8 m + 7) are word m of each half.
Pages are ``HDR + 25 D H + 2 D P`` bytes for ``P`` plain rows.
"""

from __future__ import annotations

import torch

from weightszip.errors import CorruptDataError, TruncatedError

from .kv_exact_ref import _bits, _check, _u32, page_spans

PAGE_TOKENS = 16
ALIGN = 16
ZERO_CODE = 15  # the code of exponent 0
WINDOW = 15  # exponents top - 14 .. top take codes 0 .. 14
MIN_TOP = WINDOW  # every top >= 15, so top - code >= 1 for every code below 15
MAX_HEADS = 256  # so a head's count of plain rows before it fits its u16
# bit position of channel 8 m + r's nibble in word m
NIBBLE_SHIFT = (0, 16, 4, 20, 8, 24, 12, 28)


def coded_head_bytes(head_dim: int) -> int:
    """Bytes of one coded KV head in a page (its slot): tops (D), codes (8 D) and raw bytes (16 D)."""
    return 25 * head_dim


def header_bytes(heads: int) -> int:
    """Bytes of a page's header: a u32 entry per head, zero-padded to a multiple of 16."""
    return -(-4 * heads // ALIGN) * ALIGN


def page_length(heads: int, head_dim: int, plain_rows):
    """Bytes of a page with ``plain_rows`` plain token rows (an int or an integer tensor)."""
    return header_bytes(heads) + heads * coded_head_bytes(head_dim) + plain_rows * 2 * head_dim


def _check_shape(heads: int, head_dim: int) -> None:
    _check(0 < heads <= MAX_HEADS, f"KV Exact4 pages hold 1 to {MAX_HEADS} KV heads, not {heads}")
    _check(head_dim > 0 and head_dim % 32 == 0, f"head_dim must be a positive multiple of 32, not {head_dim}")


def tops_of(bits: torch.Tensor) -> torch.Tensor:
    """The window tops of pages: int32 16-bit patterns [..., 16, D] -> int32 [..., D]."""
    return ((bits >> 7) & 0xFF).amax(-2).clamp(min=MIN_TOP)


def codes_of(bits: torch.Tensor, tops: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(code, fits) of each value (int32 16-bit patterns; ``tops`` broadcasts against them): the
    4-bit code, and whether the value has one (else its token row is stored plain)."""
    e = (bits >> 7) & 0xFF
    d = tops.to(torch.int32) - e
    zero = e == 0
    fits = zero | ((d >= 0) & (d < WINDOW))
    return torch.where(zero, ZERO_CODE, torch.where(fits, d, 0)), fits


class EncodedPages:
    """Pages coded but not yet placed: ``slots`` uint8 [n, H, 25 D] (every head's slot), ``plain`` bool
    [n, H, 16] (the plain rows), ``plain_values`` uint8 [sum plain, 2 D] (their bf16 values, page,
    head, token order), ``lengths`` int64 [n]."""

    def __init__(self, slots: torch.Tensor, plain: torch.Tensor, plain_values: torch.Tensor, heads: int,
                 head_dim: int):
        self.slots, self.plain, self.plain_values = slots, plain, plain_values
        self.heads, self.head_dim = heads, head_dim
        self.lengths = page_length(heads, head_dim, plain.sum((1, 2)).to(torch.int64))

    def __len__(self) -> int:
        return self.slots.shape[0]

    def header(self) -> torch.Tensor:
        """uint8 [n, HDR]: each head's u16 plain-row mask and u16 count of plain rows before it."""
        n, h = self.plain.shape[:2]
        dev = self.plain.device
        mask = (self.plain.to(torch.int64) << torch.arange(PAGE_TOKENS, device=dev)).sum(2)  # [n, H]
        cnt = self.plain.sum(2).to(torch.int64)
        before = torch.cumsum(cnt, 1) - cnt
        word = mask | (before << 16)
        b = torch.stack([(word >> (8 * i)) & 0xFF for i in range(4)], -1).reshape(n, 4 * h)
        return torch.nn.functional.pad(b, (0, header_bytes(h) - 4 * h)).to(torch.uint8)

    def write(self, buf: torch.Tensor, offsets: torch.Tensor) -> None:
        """Write every page into ``buf`` (uint8, 1-D) at ``offsets`` (int64 [n], multiples of 16)."""
        n = len(self)
        if n == 0:
            return
        d = self.head_dim
        dev = buf.device
        offsets = offsets.to(device=dev, dtype=torch.int64)
        fixed = torch.cat([self.header(), self.slots.reshape(n, -1)], 1).to(dev)  # [n, HDR + 25 D H]
        buf[(offsets[:, None] + torch.arange(fixed.shape[1], device=dev)[None, :]).reshape(-1)] = fixed.reshape(-1)
        if self.plain_values.numel():
            page = torch.nonzero(self.plain.reshape(n, -1))[:, 0].to(dev)  # each plain row's page, in order
            cnt = self.plain.sum((1, 2)).to(torch.int64).to(dev)
            rank = torch.arange(page.numel(), device=dev) - (torch.cumsum(cnt, 0) - cnt)[page]
            start = offsets[page] + fixed.shape[1] + rank * 2 * d
            pos = torch.arange(2 * d, device=dev)
            buf[(start[:, None] + pos[None, :]).reshape(-1)] = self.plain_values.to(dev).reshape(-1)

    def to_bytes(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The pages back to back: (uint8 buffer, int64 offsets [n + 1])."""
        offsets = torch.nn.functional.pad(self.lengths.cumsum(0), (1, 0))
        buf = torch.zeros(int(offsets[-1]), dtype=torch.uint8, device=self.slots.device)
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
    plain = ~fits.all(3)  # [n, H, 16]
    raw = ((bits >> 8) & 0x80) | (bits & 0x7F)
    code = torch.where(plain[..., None], 0, code)
    raw = torch.where(plain[..., None], 0, raw).to(torch.uint8)
    order = half_order(d, values.device)
    slots = torch.cat([tops[..., order].to(torch.uint8), pack_codes(code).reshape(n, h, -1),
                       raw[..., order].reshape(n, h, -1)], dim=2)  # [n, H, 25 D]
    le = torch.stack([bits & 0xFF, bits >> 8], -1).to(torch.uint8).reshape(n, h, PAGE_TOKENS, 2 * d)
    return EncodedPages(slots, plain, le[plain], h, d)


def _popc16(x: torch.Tensor) -> torch.Tensor:
    """Bits set in the low 16 bits of each int64."""
    return sum((x >> i) & 1 for i in range(PAGE_TOKENS))


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
    off, length = page_spans(buf, offsets)
    n = off.numel() - 1
    if n == 0:
        return torch.zeros((0, PAGE_TOKENS, h, d), dtype=torch.int16, device=dev)

    def fail(mask: torch.Tensor, what: str, cls=CorruptDataError):
        idx = torch.nonzero(mask)
        if idx.numel():
            raise cls(f"page {int(idx[0, 0])}: {what}")

    hdr_len = header_bytes(h)
    fixed = hdr_len + h * coded_head_bytes(d)
    fail(length < fixed, f"shorter than its {fixed} bytes of header and slots", TruncatedError)
    rows = buf[off[:-1, None] + torch.arange(fixed, device=dev)[None, :]]  # [n, fixed]
    entry = _u32(rows[:, : 4 * h])  # [n, H]
    mask, before = entry & 0xFFFF, entry >> 16
    cnt = _popc16(mask)
    fail(rows[:, 4 * h: hdr_len].ne(0).any(1), "nonzero header padding")
    fail((before != torch.cumsum(cnt, 1) - cnt).any(1), "a head's count of earlier plain rows is wrong")
    want = page_length(h, d, cnt.sum(1))
    fail(length < want, "shorter than its plain rows", TruncatedError)
    fail(length > want, "longer than its plain rows")
    plain = ((mask[:, :, None] >> torch.arange(PAGE_TOKENS, device=dev)) & 1).bool()  # [n, H, 16]
    slots = rows[:, hdr_len:].reshape(n, h, coded_head_bytes(d))
    inv = torch.argsort(half_order(d, dev))  # channel -> byte
    tops = slots[:, :, :d][..., inv].to(torch.int32)  # [n, H, D]
    code = unpack_codes(slots[:, :, d: 9 * d].reshape(n, h, PAGE_TOKENS, d // 2))  # [n, H, 16, D]
    raw = slots[:, :, 9 * d:].reshape(n, h, PAGE_TOKENS, d)[..., inv].to(torch.int32)
    fail((plain[..., None] & ((code != 0) | (raw != 0))).flatten(1).any(1),
         "a plain row's codes or raw bytes are not zero")
    fail((tops < MIN_TOP).flatten(1).any(1), f"a window top below {MIN_TOP}")
    e = torch.where(code == ZERO_CODE, 0, tops[:, :, None, :] - code)
    bits = ((raw & 0x80) << 8) | (e << 7) | (raw & 0x7F)
    total = int(cnt.sum())
    if total:  # plain rows: in (page, head, token) order after their page's slots
        where = torch.nonzero(plain)  # [total, 3]: page, head, token
        page = where[:, 0]
        per = cnt.sum(1)
        rank = torch.arange(total, device=dev) - (torch.cumsum(per, 0) - per)[page]
        start = off[page] + fixed + rank * 2 * d
        le = buf[start[:, None] + torch.arange(2 * d, device=dev)[None, :]].to(torch.int32).reshape(total, d, 2)
        pv = le[..., 0] | (le[..., 1] << 8)  # [total, D]
        _, fits = codes_of(pv, tops[page, where[:, 1]])
        bad = fits.all(1)
        if bool(bad.any()):
            raise CorruptDataError(f"page {int(page[torch.nonzero(bad)[0, 0]])}: a plain row whose values all have codes")
        bits[page, where[:, 1], where[:, 2]] = pv
    fail((tops != tops_of(bits)).flatten(1).any(1), "a window top is not its channel's largest exponent")
    return bits.to(torch.int16).permute(0, 2, 1, 3).contiguous()


def heap_page_lengths(heap: torch.Tensor, offsets: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Each page's length from its header (int64 [n]): its plain rows, counted from every head's mask.
    Raises CorruptDataError where a head's count of earlier plain rows disagrees with the masks (a
    kernel that trusts the counts then reads inside the page) and TruncatedError where a header lies
    outside the heap. The page's other checks are ``decode_pages``'."""
    off = offsets.to(device=heap.device, dtype=torch.int64)
    if off.numel() == 0:
        return off.clone()
    if bool((off < 0).any() or (off > heap.numel() - header_bytes(heads)).any()):  # (no sums: int64 wraps)
        raise TruncatedError("a page's header lies outside the heap")
    entry = _u32(heap[off[:, None] + torch.arange(4 * heads, device=heap.device)[None, :]])
    cnt = _popc16(entry & 0xFFFF)
    bad = ((entry >> 16) != torch.cumsum(cnt, 1) - cnt).any(1)
    if bool(bad.any()):
        raise CorruptDataError(f"page at offset {int(off[torch.nonzero(bad)[0, 0]])}: its header's counts of "
                               "plain rows disagree with its masks")
    return page_length(heads, head_dim, cnt.sum(1))


def decode_heap_pages(heap: torch.Tensor, offsets: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """Decode the pages at ``offsets`` (int64 [n], their lengths from their headers) of a heap (uint8,
    1-D) through the validating ``decode_pages``: int16 bits [n, 16, H, D]."""
    _check_shape(heads, head_dim)
    off = offsets.to(device=heap.device, dtype=torch.int64)
    lens = heap_page_lengths(heap, off, heads, head_dim)
    if bool((off > heap.numel() - lens).any()):
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
        z = _prmt((k + 0x78807880) & m32, 0xBB99)  # 0xFFFF in the lanes whose code is 15
        x = _prmt((r0, r1)[p // 2], (0x9180, 0xB3A2)[p % 2]) & 0x807F807F
        e = (e & ~z & m32) | x  # (lop3 0xBA)
        outs += [e & 0xFFFF, e >> 16]
    return torch.stack(outs, -1)
