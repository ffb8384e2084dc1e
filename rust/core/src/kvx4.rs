//! KV Exact4 pages (docs/FORMAT.md, "KV Exact4 pages, version 1"): lossless bf16 pages of a paged
//! KV cache with 4-bit exponent codes against a window top per channel *and page*, read by the GPU
//! attention kernel (`page_type="exact4"`). The same bytes as the PyTorch reference encoder, and
//! the same verdicts as its validating decoder (`triton_kernels/kv_exact4_ref.py`).
//!
//! Read me first:
//! - A page is 16 tokens of one layer, `heads` KV heads (1 to 256) of `head_dim` channels (a
//!   multiple of 32), values bf16 in token-major order (`v[t][h][d]`), K or V. No calibration:
//!   each page carries its window tops.
//! - A value's exponent `e` is a 4-bit code against its channel's top in the page
//!   (`top = max(15, largest e of the channel's 16 values)`): `top - e` when that is 0..=14, 15
//!   for `e = 0` (zeros and subnormals). Sign and mantissa are a raw byte stored verbatim. A token
//!   row (of one head) with a value that has no code is stored *plain*, as its bf16 bytes.
//! - Layout: a header of one u32 per head (u16 plain-row mask, u16 plain rows of the heads before
//!   it), zeros to a multiple of 16; then a slot of `25 x head_dim` bytes per head (tops, 16 rows of
//!   packed codes, 16 rows of raw bytes; tops and raw bytes in *half order*, codes as nibbles of
//!   u32 words, see [`byte_of`] and [`NIBBLE_SHIFT`]); then the plain rows, head-major, then token.
//!   A page is `HDR + 25 D H + 2 D P` bytes for `P` plain rows, always a multiple of 16 (no
//!   padding after the plain rows).
//! - The decoder checks every rule, so a page that decodes re-encodes to the same bytes.
//!   [`decode_pages`] checks the pages' offsets and headers across all pages first, in the
//!   reference decoder's order, and then each page's body, so that the two raise the same error
//!   class ([`Error::Truncated`] / [`Error::Corrupt`]) for the same input
//!   (tests/test_kv_exact4_rust.py); with damaged bodies in several pages the page named may
//!   differ (every body rule is Corrupt).
//! - Rows are coded and decoded in channel order through small scratch rows (`to_half_order`,
//!   `pack_codes` and their inverses do the layout), so the per-value loops vectorize.

use crate::error::{Error, Result};
use crate::kvx;
/// Tokens per page; pages are padded to multiples of `ALIGN` bytes; at most `MAX_CHANNELS` (heads x
/// head_dim) per page, as for KV Exact pages: bounds every size (the reference has no such limit;
/// real models have a few thousand).
pub use crate::kvx::{ALIGN, MAX_CHANNELS, PAGE_TOKENS};
/// The code of exponent 0 (zeros and subnormals).
pub const ZERO_CODE: u8 = 15;
/// Exponents `top - 14 ..= top` take codes 0..=14.
pub const WINDOW: u8 = 15;
/// Every top is at least this, so `top - code >= 1` for every code below 15.
pub const MIN_TOP: u8 = 15;
/// Most KV heads in a page (a head's count of plain rows before it fits its u16).
pub const MAX_HEADS: usize = 256;
/// Bit position of channel `8 m + r`'s code in u32 word m of a row's codes.
pub const NIBBLE_SHIFT: [u32; 8] = [0, 16, 4, 20, 8, 24, 12, 28];

fn corrupt(page: usize, what: &str) -> Error {
    Error::Corrupt(format!("KV Exact4 page {page}: {what}"))
}

fn truncated(page: usize, what: &str) -> Error {
    Error::Truncated(format!("KV Exact4 page {page}: {what}"))
}

/// The shape of a page: KV heads and channels per head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub heads: usize,
    pub head_dim: usize,
}

impl Shape {
    pub fn new(heads: usize, head_dim: usize) -> Result<Self> {
        if heads > MAX_HEADS {
            return Err(Error::InvalidArgument(format!("KV Exact4 pages hold 1 to {MAX_HEADS} KV heads, not {heads}")));
        }
        kvx::Shape::new(heads, head_dim)?; // heads > 0, head_dim a positive multiple of 32, MAX_CHANNELS
        Ok(Shape { heads, head_dim })
    }
    pub fn channels(&self) -> usize {
        self.heads * self.head_dim
    }
    /// Bytes of the header: a u32 per head, padded to 16.
    pub fn header_bytes(&self) -> usize {
        (4 * self.heads).div_ceil(ALIGN) * ALIGN
    }
    /// Bytes of one head's slot: tops (D), codes (16 x D / 2), raw bytes (16 x D).
    pub fn slot_bytes(&self) -> usize {
        25 * self.head_dim
    }
    /// Bytes of a page before its plain rows.
    pub fn fixed_bytes(&self) -> usize {
        self.header_bytes() + self.heads * self.slot_bytes()
    }
    /// Bytes of a page with `plain_rows` plain token rows (at most 16 x heads).
    pub fn page_length(&self, plain_rows: usize) -> usize {
        self.fixed_bytes() + 2 * self.head_dim * plain_rows
    }
    /// Bytes of 16 tokens of bf16 values.
    pub fn raw_page_bytes(&self) -> usize {
        2 * PAGE_TOKENS * self.channels()
    }
}

/// Where channel `ch` of a row sits among its tops or raw bytes (*half order*: channel
/// `8 m + 4 h + b` at byte `h D / 2 + 4 m + b`).
pub fn byte_of(head_dim: usize, ch: usize) -> usize {
    let (m, r) = (ch / 8, ch % 8);
    (r / 4) * (head_dim / 2) + 4 * m + r % 4
}

/// Exponent of a bf16 bit pattern.
#[inline(always)]
fn exp_of(v: u16) -> u8 {
    (v >> 7) as u8
}

/// Whether exponent `e` has a code against `top`.
#[inline(always)]
fn fits(top: u8, e: u8) -> bool {
    e == 0 || (top >= e && top - e < WINDOW)
}

/// A row of tops or raw bytes from channel order to half order (channel `8 m + 4 h + b` to byte
/// `h D / 2 + 4 m + b`).
fn to_half_order(ch: &[u8], half: &mut [u8]) {
    let (lo, hi) = half.split_at_mut(ch.len() / 2);
    for ((c, l), h) in ch.chunks_exact(8).zip(lo.chunks_exact_mut(4)).zip(hi.chunks_exact_mut(4)) {
        l.copy_from_slice(&c[..4]);
        h.copy_from_slice(&c[4..]);
    }
}

/// `to_half_order`'s inverse.
fn from_half_order(half: &[u8], ch: &mut [u8]) {
    let (lo, hi) = half.split_at(ch.len() / 2);
    for ((c, l), h) in ch.chunks_exact_mut(8).zip(lo.chunks_exact(4)).zip(hi.chunks_exact(4)) {
        c[..4].copy_from_slice(l);
        c[4..].copy_from_slice(h);
    }
}

/// A row's codes (channel order, 0..=15) into its u32 words of nibbles (D / 2 bytes).
fn pack_codes(code: &[u8], words: &mut [u8]) {
    for (c, w) in code.chunks_exact(8).zip(words.chunks_exact_mut(4)) {
        let word = c.iter().zip(NIBBLE_SHIFT).fold(0u32, |word, (&c, s)| word | u32::from(c) << s);
        w.copy_from_slice(&word.to_le_bytes());
    }
}

/// `pack_codes`' inverse.
fn unpack_codes(words: &[u8], code: &mut [u8]) {
    for (w, c) in words.chunks_exact(4).zip(code.chunks_exact_mut(8)) {
        let word = u32::from_le_bytes([w[0], w[1], w[2], w[3]]);
        for (c, s) in c.iter_mut().zip(NIBBLE_SHIFT) {
            *c = (word >> s) as u8 & 15;
        }
    }
}

/// Code one token row of a head: `row` its bf16 values (2 D bytes LE), `tops` per channel. Writes
/// the row's codes and raw bytes in channel order (D bytes each); false when some value has no
/// code (the row is then plain, and what was written is meaningless).
fn code_row(row: &[u8], tops: &[u8], code: &mut [u8], raw: &mut [u8]) -> bool {
    let mut outside = false;
    for ((v, &top), (c, r)) in row.chunks_exact(2).zip(tops).zip(code.iter_mut().zip(raw.iter_mut())) {
        let v = u16::from_le_bytes([v[0], v[1]]);
        let e = exp_of(v);
        let d = top.wrapping_sub(e); // in the encoder every top is at least every exponent
        outside |= (e != 0) & (d >= WINDOW);
        *c = if e == 0 { ZERO_CODE } else { d & 15 };
        *r = (((v >> 8) & 0x80) | (v & 0x7F)) as u8;
    }
    !outside
}

/// Append one page to `out`: `values` are 16 x heads x head_dim bf16 values as little-endian
/// bytes, token-major (`v[t][h][d]`).
pub fn encode_page(shape: Shape, values: &[u8], out: &mut Vec<u8>) -> Result<()> {
    if values.len() != shape.raw_page_bytes() {
        return Err(Error::InvalidArgument(format!(
            "a page is {} bytes of bf16, got {}",
            shape.raw_page_bytes(),
            values.len()
        )));
    }
    let (h, d) = (shape.heads, shape.head_dim);
    let row = |t: usize, head: usize| &values[(t * h + head) * 2 * d..(t * h + head + 1) * 2 * d];
    let start = out.len();
    let hdr = shape.header_bytes();
    out.resize(start + shape.fixed_bytes(), 0);
    // channel order: tops, one row's codes and raw bytes
    let mut scratch = vec![0u8; 3 * d];
    let (tops, rest) = scratch.split_at_mut(d);
    let (code, raw) = rest.split_at_mut(d);
    let mut before = 0u32; // plain rows of the heads so far
    for head in 0..h {
        tops.fill(MIN_TOP);
        for t in 0..PAGE_TOKENS {
            for (top, v) in tops.iter_mut().zip(row(t, head).chunks_exact(2)) {
                *top = (*top).max(exp_of(u16::from_le_bytes([v[0], v[1]])));
            }
        }
        let s = start + hdr + head * shape.slot_bytes();
        let slot = &mut out[s..s + shape.slot_bytes()];
        let (slot_tops, rest) = slot.split_at_mut(d);
        let (slot_codes, slot_raw) = rest.split_at_mut(PAGE_TOKENS * d / 2);
        to_half_order(tops, slot_tops);
        let mut mask = 0u32;
        for t in 0..PAGE_TOKENS {
            if code_row(row(t, head), tops, code, raw) {
                pack_codes(code, &mut slot_codes[t * d / 2..(t + 1) * d / 2]);
                to_half_order(raw, &mut slot_raw[t * d..(t + 1) * d]);
            } else {
                mask |= 1 << t; // plain: its codes and raw bytes stay zero
            }
        }
        for t in (0..PAGE_TOKENS).filter(|t| mask >> t & 1 == 1) {
            out.extend_from_slice(row(t, head));
        }
        let entry = mask | (before << 16);
        out[start + 4 * head..start + 4 * head + 4].copy_from_slice(&entry.to_le_bytes());
        before += mask.count_ones();
    }
    Ok(())
}

/// Encode `n` pages back to back: (bytes, offsets [n + 1]).
pub fn encode_pages(shape: Shape, values: &[u8]) -> Result<(Vec<u8>, Vec<u64>)> {
    let pb = shape.raw_page_bytes();
    if !values.len().is_multiple_of(pb) {
        return Err(Error::InvalidArgument(format!("{} bytes is not a whole number of {pb}-byte pages", values.len())));
    }
    let mut out = Vec::with_capacity(values.len()); // more than enough unless 7 rows in 16 are plain
    let mut offsets = Vec::with_capacity(values.len() / pb + 1);
    offsets.push(0u64);
    for page in values.chunks_exact(pb) {
        encode_page(shape, page, &mut out)?;
        offsets.push(out.len() as u64);
    }
    Ok((out, offsets))
}

fn entry(page: &[u8], head: usize) -> u32 {
    u32::from_le_bytes([page[4 * head], page[4 * head + 1], page[4 * head + 2], page[4 * head + 3]])
}

// The header checks, one function per rule so that `decode_pages` can run each over all pages
// before the next, as the reference decoder does. Each takes a page of at least `fixed_bytes`.

fn check_padding(shape: Shape, page: &[u8], index: usize) -> Result<()> {
    if page[4 * shape.heads..shape.header_bytes()].iter().any(|&b| b != 0) {
        return Err(corrupt(index, "nonzero header padding"));
    }
    Ok(())
}

/// The page's plain rows, after checking each head's count of the plain rows before it.
fn check_counts(shape: Shape, page: &[u8], index: usize) -> Result<usize> {
    let mut before = 0u32;
    for head in 0..shape.heads {
        let e = entry(page, head);
        if e >> 16 != before {
            return Err(corrupt(index, "a head's count of earlier plain rows is wrong"));
        }
        before += (e & 0xFFFF).count_ones();
    }
    Ok(before as usize)
}

fn check_length(shape: Shape, page: &[u8], plain: usize, index: usize) -> Result<()> {
    let want = shape.page_length(plain);
    if page.len() < want {
        return Err(truncated(
            index,
            &format!("{} bytes, shorter than its {want} with {plain} plain rows", page.len()),
        ));
    }
    if page.len() > want {
        return Err(corrupt(index, &format!("{} bytes, longer than its {want} with {plain} plain rows", page.len())));
    }
    Ok(())
}

fn check_fixed(shape: Shape, page: &[u8], index: usize) -> Result<()> {
    let fixed = shape.fixed_bytes();
    if page.len() < fixed {
        let what = format!("{} bytes, shorter than its {fixed} bytes of header and slots", page.len());
        return Err(truncated(index, &what));
    }
    Ok(())
}

/// Decode a coded token row from its codes and raw bytes (channel order) against `tops` into
/// `dst` (2 D bytes, bf16 LE), raising `maxe` to each value's exponent.
#[allow(clippy::needless_range_loop)] // one index into rows of one length
fn decode_row(code: &[u8], raw: &[u8], tops: &[u8], maxe: &mut [u8], dst: &mut [u8]) {
    let d = tops.len();
    let (code, raw, maxe, dst) = (&code[..d], &raw[..d], &mut maxe[..d], &mut dst[..2 * d]);
    for c in 0..d {
        // every top is at least 15, so top - code >= 1 for codes below 15
        let e = if code[c] == ZERO_CODE { 0 } else { tops[c].wrapping_sub(code[c]) };
        maxe[c] = maxe[c].max(e);
        let b = u16::from(raw[c]);
        let v = ((b & 0x80) << 8) | (u16::from(e) << 7) | (b & 0x7F);
        dst[2 * c..2 * c + 2].copy_from_slice(&v.to_le_bytes());
    }
}

/// Decode the slots and plain rows of a page whose header and length have been checked.
fn decode_body(shape: Shape, page: &[u8], out: &mut [u8], index: usize) -> Result<()> {
    let (h, d) = (shape.heads, shape.head_dim);
    let (hdr, sb) = (shape.header_bytes(), shape.slot_bytes());
    let mut plain_at = shape.fixed_bytes();
    // channel order: tops, each channel's largest exponent in the head's 16 rows, one row's codes
    // and raw bytes
    let mut scratch = vec![0u8; 4 * d];
    let (tops, rest) = scratch.split_at_mut(d);
    let (maxe, rest) = rest.split_at_mut(d);
    let (code, raw) = rest.split_at_mut(d);
    for head in 0..h {
        let slot = &page[hdr + head * sb..hdr + (head + 1) * sb];
        let (slot_tops, rest) = slot.split_at(d);
        let (slot_codes, slot_raw) = rest.split_at(PAGE_TOKENS * d / 2);
        from_half_order(slot_tops, tops);
        if tops.iter().any(|&t| t < MIN_TOP) {
            return Err(corrupt(index, &format!("a window top below {MIN_TOP}")));
        }
        maxe.fill(0);
        let mask = entry(page, head);
        for t in 0..PAGE_TOKENS {
            let row_codes = &slot_codes[t * d / 2..(t + 1) * d / 2];
            let row_raw = &slot_raw[t * d..(t + 1) * d];
            let o = 2 * (t * h + head) * d;
            let dst = &mut out[o..o + 2 * d];
            if mask >> t & 1 == 1 {
                if row_codes.iter().chain(row_raw).any(|&b| b != 0) {
                    return Err(corrupt(index, "a plain row's codes or raw bytes are not zero"));
                }
                // the masks are read again after check_counts / check_length: a caller's buffer
                // written by another thread (the GIL is released) may now mark more plain rows than
                // the page holds, an error and not a panic
                let row = page
                    .get(plain_at..plain_at + 2 * d)
                    .ok_or_else(|| corrupt(index, "a plain row runs past the page"))?;
                plain_at += 2 * d;
                let mut coded = true;
                for ((v, &top), me) in row.chunks_exact(2).zip(tops.iter()).zip(maxe.iter_mut()) {
                    let e = exp_of(u16::from_le_bytes([v[0], v[1]]));
                    coded &= fits(top, e);
                    *me = (*me).max(e);
                }
                if coded {
                    return Err(corrupt(index, "a plain row whose values all have codes"));
                }
                dst.copy_from_slice(row);
                continue;
            }
            unpack_codes(row_codes, code);
            from_half_order(row_raw, raw);
            decode_row(code, raw, tops, maxe, dst);
        }
        if tops.iter().zip(maxe.iter()).any(|(&t, &e)| t != e.max(MIN_TOP)) {
            return Err(corrupt(index, "a window top is not its channel's largest exponent"));
        }
    }
    Ok(())
}

/// Decode one page of exactly `page.len()` bytes into `out` (16 x heads x head_dim bf16, little
/// endian, token-major), checking every rule of the format (`index` names the page in errors).
/// Never panics.
pub fn decode_page(shape: Shape, page: &[u8], out: &mut [u8], index: usize) -> Result<()> {
    if out.len() != shape.raw_page_bytes() {
        return Err(Error::BufferTooSmall { need: shape.raw_page_bytes() as u64, have: out.len() as u64 });
    }
    check_fixed(shape, page, index)?;
    check_padding(shape, page, index)?;
    let plain = check_counts(shape, page, index)?;
    check_length(shape, page, plain, index)?;
    decode_body(shape, page, out, index)
}

/// Decode pages stored back to back (`offsets` [n + 1], page i = `buf[offsets[i]..offsets[i + 1]]`)
/// into `out` (n x 16 x heads x head_dim bf16). Errors name the page; never panics.
///
/// The rules are checked in the reference decoder's order, each over all pages before the next:
/// the offsets (from 0 to the buffer's end: else Truncated; never decreasing: else Corrupt), then
/// every page at least its header and slots (Truncated), header padding, counts of plain rows,
/// length against the plain rows (Truncated when short, Corrupt when long), then each page's body.
pub fn decode_pages(shape: Shape, buf: &[u8], offsets: &[u64], out: &mut [u8]) -> Result<()> {
    let pb = shape.raw_page_bytes();
    let n = kvx::check_spans("KV Exact4", buf.len(), offsets, out.len(), pb)?;
    let page = |i: usize| &buf[offsets[i] as usize..offsets[i + 1] as usize];
    for i in 0..n {
        check_fixed(shape, page(i), i)?;
    }
    for i in 0..n {
        check_padding(shape, page(i), i)?;
    }
    let mut plain = Vec::with_capacity(n);
    for i in 0..n {
        plain.push(check_counts(shape, page(i), i)?);
    }
    // short pages (Truncated) before long ones (Corrupt)
    let short = plain.iter().enumerate().find(|&(i, &p)| page(i).len() < shape.page_length(p));
    for (i, &p) in short.into_iter().chain(plain.iter().enumerate()) {
        check_length(shape, page(i), p, i)?;
    }
    for (i, dst) in out.chunks_exact_mut(pb).enumerate() {
        decode_body(shape, page(i), dst, i)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    struct Rng(u64);

    impl Rng {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
    }

    /// bf16-like values: exponents around 120 with a geometric tail, random sign and mantissa; with
    /// `rare` > 0 about one value in `rare` far below its neighbours (2^-60: its row is plain) and as
    /// many exact zeros.
    fn sample(shape: Shape, pages: usize, seed: u64, rare: u64) -> Vec<u8> {
        let mut g = Rng(seed | 1);
        let mut out = Vec::new();
        for _ in 0..pages * PAGE_TOKENS * shape.channels() {
            let r = g.next();
            let e = 124u16.saturating_sub((r % 64).trailing_zeros() as u16 * 2 + (r >> 60) as u16 % 3);
            let mut v = ((r >> 20) as u16 & 0x807F) | (e << 7);
            if rare > 0 && (r >> 8).is_multiple_of(rare) {
                v = 0x2180 | (v & 0x8000); // +-2^-60
            } else if rare > 0 && (r >> 8) % rare == 1 {
                v &= 0x8000; // +-0
            }
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }

    fn decode_all(shape: Shape, buf: &[u8], offs: &[u64]) -> Result<Vec<u8>> {
        let mut out = vec![0u8; (offs.len() - 1) * shape.raw_page_bytes()];
        decode_pages(shape, buf, offs, &mut out).map(|_| out)
    }

    /// The plain rows of each page (sum of the header masks' bits).
    fn plain_rows(shape: Shape, buf: &[u8], offs: &[u64]) -> Vec<u32> {
        offs.windows(2)
            .map(|w| (0..shape.heads).map(|h| (entry(&buf[w[0] as usize..], h) & 0xFFFF).count_ones()).sum())
            .collect()
    }

    #[test]
    fn round_trip_sizes_and_plain_rows() {
        for (h, d, rare) in [(3, 64, 0), (3, 64, 400), (1, 32, 50), (8, 128, 3000), (5, 96, 7)] {
            let shape = Shape::new(h, d).unwrap();
            let vals = sample(shape, 6, 11 * h as u64 + d as u64, rare);
            let (buf, offs) = encode_pages(shape, &vals).unwrap();
            assert_eq!(decode_all(shape, &buf, &offs).unwrap(), vals);
            let plain = plain_rows(shape, &buf, &offs);
            for (w, &p) in offs.windows(2).zip(&plain) {
                assert_eq!((w[1] - w[0]) as usize, shape.page_length(p as usize));
            }
            let total: u32 = plain.iter().sum();
            if rare == 0 {
                assert_eq!(total, 0, "no value of the sample lies 15 binades below its channel's top");
                assert_eq!(buf.len(), 6 * (shape.header_bytes() + 25 * h * d)); // 25 of 32 bytes
            } else {
                assert!(total > 0, "rare tiny values make plain rows ({h} x {d}, 1 in {rare})");
            }
        }
    }

    #[test]
    fn shapes_and_lengths() {
        let s = Shape::new(3, 64).unwrap();
        assert_eq!((s.header_bytes(), s.slot_bytes(), s.fixed_bytes()), (16, 1600, 16 + 4800));
        assert_eq!(s.page_length(2), 16 + 4800 + 256);
        assert_eq!(Shape::new(5, 32).unwrap().header_bytes(), 32);
        assert_eq!(Shape::new(256, 32).unwrap().header_bytes(), 1024);
        assert!(matches!(Shape::new(0, 32), Err(Error::InvalidArgument(_))));
        assert!(matches!(Shape::new(257, 32), Err(Error::InvalidArgument(_))));
        assert!(matches!(Shape::new(2, 48), Err(Error::InvalidArgument(_))));
        assert!(matches!(Shape::new(2, 0), Err(Error::InvalidArgument(_))));
        assert!(matches!(Shape::new(256, 512), Err(Error::LimitExceeded(_))));
        assert!(matches!(Shape::new(1, usize::MAX - 31), Err(Error::LimitExceeded(_))));
        let order: Vec<usize> = (0..32).map(|c| byte_of(32, c)).collect();
        assert_eq!(&order[..12], &[0, 1, 2, 3, 16, 17, 18, 19, 4, 5, 6, 7]);
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(sorted, (0..32).collect::<Vec<_>>());
        let mut out = Vec::new();
        assert!(matches!(encode_page(s, &[0u8; 10], &mut out), Err(Error::InvalidArgument(_))));
        assert!(encode_pages(s, &[0u8; 10]).is_err());
        let (buf, offs) = encode_pages(s, &[]).unwrap();
        assert!(buf.is_empty() && offs == [0]);
        assert_eq!(decode_all(s, &[], &[0]).unwrap(), Vec::<u8>::new());
    }

    /// The layout test of tests/test_kv_exact.py (`test_exact4_page_layout_by_hand`), byte by byte.
    #[test]
    fn page_layout_by_hand() {
        let shape = Shape::new(2, 32).unwrap();
        let mut v = [[[0x3F80u16; 32]; 2]; 16]; // 1.0
        v[0][0][9] = 0xBFC0; // -1.5
        v[2][0][12] = 0; // 0.0: code 15
        v[3][1][5] = 0x2B80; // 2^-40: exponent 87, outside head 1's window
        v[7][1][0] = 0x2680; // 2^-50
        let vals: Vec<u8> = v.iter().flatten().flatten().flat_map(|x| x.to_le_bytes()).collect();
        let mut b = Vec::new();
        encode_page(shape, &vals, &mut b).unwrap();
        assert_eq!(b.len(), 16 + 25 * 32 * 2 + 2 * 64);
        assert_eq!(&b[..16], &[0, 0, 0, 0, (1 << 3) | (1 << 7), 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        let head0 = &b[16..816];
        assert!(head0[..32].iter().all(|&t| t == 127));
        let word = |t: usize, m: usize| u32::from_le_bytes(head0[32 + 16 * t + 4 * m..][..4].try_into().unwrap());
        for t in 0..16 {
            for m in 0..4 {
                // channel 12 = 8 + 4: word 1, nibble at bit 8 holds code 15
                assert_eq!(word(t, m), if (t, m) == (2, 1) { 15 << 8 } else { 0 });
            }
        }
        let raw0 = &head0[288..];
        assert_eq!(raw0[byte_of(32, 9)], 0x80 | 0x40);
        assert_eq!(raw0[2 * 32 + byte_of(32, 12)], 0);
        let head1 = &b[816..1616];
        assert!(head1[..32].iter().all(|&t| t == 127));
        let (codes1, raw1) = head1[32..].split_at(256);
        for t in [3, 7] {
            assert!(codes1[16 * t..16 * t + 16].iter().chain(&raw1[32 * t..32 * t + 32]).all(|&x| x == 0));
        }
        let row = |t: usize| vals[2 * (2 * t + 1) * 32..2 * (2 * t + 2) * 32].to_vec();
        assert_eq!(b[1616..].to_vec(), [row(3), row(7)].concat());
        let mut out = vec![0u8; vals.len()];
        decode_page(shape, &b, &mut out, 0).unwrap();
        assert_eq!(out, vals);
    }

    #[test]
    fn every_bf16_pattern() {
        // All 65536 patterns (NaN, Inf, -0, subnormals) as 64 pages of 2 x 32, in order and shuffled:
        // in order, each page holds exponents spread over a few binades; shuffled, most rows are plain
        for shuffle in [false, true] {
            let shape = Shape::new(2, 32).unwrap();
            let mut pats: Vec<u16> = (0..=u16::MAX).collect();
            if shuffle {
                let mut g = Rng(0x9e37_79b9_7f4a_7c15);
                for i in (1..pats.len()).rev() {
                    pats.swap(i, (g.next() % (i as u64 + 1)) as usize);
                }
            }
            let vals: Vec<u8> = pats.iter().flat_map(|v| v.to_le_bytes()).collect();
            let (buf, offs) = encode_pages(shape, &vals).unwrap();
            assert_eq!(decode_all(shape, &buf, &offs).unwrap(), vals);
            let plain: u32 = plain_rows(shape, &buf, &offs).iter().sum();
            // in order a page spans 8 exponents (and zeros): nothing plain; shuffled almost every row
            if shuffle {
                assert!(plain > 64 * 32 * 9 / 10, "{plain}");
            } else {
                assert_eq!(plain, 0);
            }
        }
        // one channel holding every exponent's zero-mantissa value: subnormals and zeros code 15
        let shape = Shape::new(1, 32).unwrap();
        let mut vals = vec![0u8; shape.raw_page_bytes()];
        for t in 0..16 {
            let v: u16 = [0x0000, 0x8000, 0x0001, 0x807F, 0x0080, 0x7F80, 0xFF80, 0x7FC0][t % 8] | (t as u16 >> 3);
            vals[2 * t * 32..2 * t * 32 + 2].copy_from_slice(&v.to_le_bytes());
        }
        let (buf, offs) = encode_pages(shape, &vals).unwrap();
        assert_eq!(decode_all(shape, &buf, &offs).unwrap(), vals);
    }

    /// The error of decoding, its class checked (Truncated or Corrupt); returns its message.
    fn expect_err(shape: Shape, buf: &[u8], offs: &[u64], truncated: bool) -> String {
        match decode_all(shape, buf, offs) {
            Err(Error::Truncated(m)) if truncated => m,
            Err(Error::Corrupt(m)) if !truncated => m,
            r => panic!("expected {}, got {:?}", if truncated { "Truncated" } else { "Corrupt" }, r.map(|_| ())),
        }
    }

    #[test]
    fn hostile_pages_are_errors() {
        let shape = Shape::new(3, 64).unwrap();
        let vals = sample(shape, 2, 5, 300);
        let (buf, offs) = encode_pages(shape, &vals).unwrap();
        let n = buf.len() as u64;
        let hdr = shape.header_bytes();
        let one = &buf[..offs[1] as usize];
        let whole = |b: &[u8]| [0, b.len() as u64];
        let plain_of = |h: usize| (0..16).filter(move |t| entry(one, h) >> t & 1 == 1);
        assert!(plain_of(0).count() > 0 && plain_of(2).count() > 0, "page 0 has plain rows in heads 0 and 2");
        // cut short: the last page by 16 bytes, a page by a byte, by a plain row, into its slots
        expect_err(shape, &buf[..buf.len() - 16], &[0, offs[1], n - 16], true);
        expect_err(shape, &one[..one.len() - 1], &whole(&one[..one.len() - 1]), true);
        expect_err(shape, &one[..one.len() - 128], &whole(&one[..one.len() - 128]), true);
        let cut = &one[..shape.fixed_bytes() - 1];
        assert!(expect_err(shape, cut, &whole(cut), true).contains("header and slots"));
        // one byte too many
        let long = [one, &[0]].concat();
        assert!(expect_err(shape, &long, &whole(&long), false).contains("longer"));
        // offsets: not from 0 to the end (Truncated), decreasing or past the end in the middle (Corrupt)
        expect_err(shape, &buf, &[0, offs[1]], true);
        expect_err(shape, &buf, &[16, offs[1], n], true);
        expect_err(shape, &buf, &[0, n + 16, n], false);
        expect_err(shape, &buf, &[0, u64::MAX, n], false);
        expect_err(shape, &buf, &[0, offs[1], 16, n], false);
        let wrap = 6148914691236517205u64; // differences that wrap around 2^64
        expect_err(shape, &buf, &[0, wrap, wrap.wrapping_mul(2), n], false);
        assert!(matches!(decode_pages(shape, &buf, &[], &mut []), Err(Error::InvalidArgument(_))));
        assert!(matches!(decode_pages(shape, &buf, &offs, &mut [0u8; 10]), Err(Error::BufferTooSmall { .. })));
        // a head's count of earlier plain rows
        let mut bad = buf.clone();
        bad[4 + 2] ^= 1;
        assert!(expect_err(shape, &bad, &offs, false).contains("count"));
        // a mask bit set on the last head: every count still right, the page is short of a row ...
        let mut bad = one.to_vec();
        let t = (0..16).find(|t| entry(one, 2) >> t & 1 == 0).unwrap();
        bad[8 + t / 8] ^= 1 << (t % 8);
        expect_err(shape, &bad, &whole(&bad), true);
        // ... or cleared: a row too long
        let mut bad = one.to_vec();
        let t = plain_of(2).next().unwrap();
        bad[8 + t / 8] ^= 1 << (t % 8);
        expect_err(shape, &bad, &whole(&bad), false);
        // header padding
        let mut bad = buf.clone();
        bad[4 * 3] = 1;
        assert!(expect_err(shape, &bad, &offs, false).contains("padding"));
        // channel 0 of head 0 made exponent 1 everywhere: its top is 15 (codes 14)
        let mut v0 = vals[..shape.raw_page_bytes()].to_vec();
        for t in 0..16 {
            v0[2 * t * 192..2 * t * 192 + 2].copy_from_slice(&0x0080u16.to_le_bytes());
        }
        let (b0, o0) = encode_pages(shape, &v0).unwrap();
        assert_eq!(b0[hdr], MIN_TOP);
        // a top below 15
        let mut bad = b0.clone();
        bad[hdr] = 1;
        assert!(expect_err(shape, &bad, &o0, false).contains("below"));
        // a top above its channel's largest exponent (the values at top 16 are the page at top 15
        // with every exponent one higher, which an encoder writes with top 15: not canonical)
        let mut bad = b0.clone();
        bad[hdr] = 16;
        assert!(expect_err(shape, &bad, &o0, false).contains("largest"));
        // a plain row's code or raw byte not zero
        let pt = plain_of(0).next().unwrap();
        for at in [hdr + 64 + pt * 32 + 3, hdr + 64 + 16 * 32 + pt * 64 + 60] {
            let mut bad = one.to_vec();
            bad[at] = 0x10;
            assert!(expect_err(shape, &bad, &whole(&bad), false).contains("plain row's codes"));
        }
        // a plain row whose values all have codes: the first plain row (head 0, token pt), every
        // value at its channel's top
        let mut bad = one.to_vec();
        let first = shape.fixed_bytes();
        for ch in 0..64 {
            let v = (u16::from(bad[hdr + byte_of(64, ch)]) << 7).to_le_bytes();
            bad[first + 2 * ch..first + 2 * ch + 2].copy_from_slice(&v);
        }
        assert!(expect_err(shape, &bad, &whole(&bad), false).contains("all have codes"));
        // a random body behind a consistent header: an error, never a panic
        let mut g = Rng(77);
        for _ in 0..200 {
            let mut bad = one.to_vec();
            for b in &mut bad[hdr..] {
                *b = g.next() as u8;
            }
            assert!(decode_all(shape, &bad, &whole(&bad)).is_err());
        }
    }

    /// decode_pages checks each header rule over all pages before the next, as the reference does:
    /// a later page's short length (Truncated) wins over an earlier page's bad body (Corrupt).
    #[test]
    fn errors_come_in_the_reference_order() {
        let shape = Shape::new(2, 32).unwrap();
        let vals = sample(shape, 2, 9, 0); // no plain rows
        let (buf, offs) = encode_pages(shape, &vals).unwrap();
        let hdr = shape.header_bytes();
        let mut bad = buf.clone();
        bad[hdr] = 3; // page 0: a top below 15
        let p1 = offs[1] as usize;
        bad[p1 + 4] |= 1; // page 1: a plain row on its last head, the page short of it
        match decode_all(shape, &bad, &offs) {
            Err(Error::Truncated(m)) => assert!(m.contains("page 1"), "{m}"),
            r => panic!("{:?}", r.map(|_| ())),
        }
        bad[p1 + 4] ^= 1;
        bad[p1 + 2] = 1; // page 1: a wrong count (Corrupt, before page 0's body)
        match decode_all(shape, &bad, &offs) {
            Err(Error::Corrupt(m)) => assert!(m.contains("page 1") && m.contains("count"), "{m}"),
            r => panic!("{:?}", r.map(|_| ())),
        }
        let mut cut = buf[..buf.len() - 1].to_vec();
        cut[hdr] = 3;
        expect_err(shape, &cut, &[0, offs[1], offs[2] - 1], true);
    }

    fn damaged_errs_or_reencodes(
        shape: Shape,
        vals: &[u8],
        flips: &[(usize, u8)],
    ) -> std::result::Result<(), TestCaseError> {
        let (mut buf, offs) = encode_pages(shape, vals).unwrap();
        for &(at, bit) in flips {
            let i = at % buf.len();
            buf[i] ^= 1 << bit;
        }
        if let Ok(out) = decode_all(shape, &buf, &offs) {
            let (again, o2) = encode_pages(shape, &out).unwrap();
            prop_assert_eq!(again, buf);
            prop_assert_eq!(o2, offs);
        }
        Ok(())
    }

    proptest! {
        #[test]
        fn prop_round_trip(
            seed in any::<u64>(), h in 1usize..5, dims in 1usize..4, rare in prop_oneof![Just(0u64), 2u64..2000]
        ) {
            let shape = Shape::new(h, 32 * dims).unwrap();
            let vals = sample(shape, 2, seed, rare);
            let (buf, offs) = encode_pages(shape, &vals).unwrap();
            prop_assert_eq!(decode_all(shape, &buf, &offs).unwrap(), vals);
        }

        #[test]
        fn prop_damaged_page_errs_or_reencodes(
            seed in any::<u64>(), flips in proptest::collection::vec((any::<usize>(), 0u8..8), 1..4)
        ) {
            let shape = Shape::new(2, 32).unwrap();
            damaged_errs_or_reencodes(shape, &sample(shape, 1, seed, 40), &flips)?;
        }

        #[test]
        fn prop_any_bytes_err_or_reencode(
            bytes in proptest::collection::vec(any::<u8>(), 0..2400), masks in any::<u32>()
        ) {
            // a consistent header over random slots and plain rows: reaches the body checks
            let shape = Shape::new(2, 32).unwrap();
            let (m0, m1) = (masks & 0xFFFF, masks >> 16);
            let p = (m0.count_ones() + m1.count_ones()) as usize;
            let mut page = vec![0u8; shape.page_length(p)];
            page[..4].copy_from_slice(&m0.to_le_bytes());
            page[4..8].copy_from_slice(&(m1 | m0.count_ones() << 16).to_le_bytes());
            for (d, s) in page[16..].iter_mut().zip(&bytes) {
                *d = *s;
            }
            let mut out = vec![0u8; shape.raw_page_bytes()];
            if decode_page(shape, &page, &mut out, 0).is_ok() {
                let mut again = Vec::new();
                encode_page(shape, &out, &mut again).unwrap();
                prop_assert_eq!(again, page);
            }
        }
    }
}
