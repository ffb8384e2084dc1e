//! KV Exact pages (docs/FORMAT.md, "KV Exact pages, version 1"): lossless bf16 pages of a paged KV
//! cache that the GPU attention kernel decodes as tiles. The same bytes as the PyTorch reference
//! (`triton_kernels/kv_exact_ref.py`) and the kernel's tile loader.
//!
//! Read me first:
//! - A page is 16 tokens of one layer, `heads` KV heads of `head_dim` channels (a multiple of 32),
//!   values bf16 in token-major order (`v[t][h][d]`), K or V.
//! - Each value's exponent is a 3-bit code against a per-channel window top `base` (`base - e`
//!   when it lies in 0..=6, else 7 = escape and the exponent byte goes to the head's exception
//!   list); sign and mantissa are a raw byte stored verbatim.
//! - Layout: a header of `heads + 1` u32 offsets (padded to 16 bytes), then per head three code
//!   planes (`3 x 16 x head_dim / 8` bytes) and the raw bytes (`16 x head_dim`), then every head's
//!   exception bytes, then zeros to a multiple of 16.
//! - The decoder checks every rule, so a page that decodes re-encodes to the same bytes.

use crate::error::{Error, Result};

/// Tokens per page.
pub const PAGE_TOKENS: usize = 16;
/// Code of an exponent outside the window.
pub const ESCAPE: u8 = 7;
/// Exponents a window codes without escape.
pub const WINDOW: i32 = 7;
/// Pages start and end at multiples of this many bytes.
pub const ALIGN: usize = 16;
/// Most channels in a page (heads x head_dim), as for the exact page profile.
pub const MAX_CHANNELS: usize = 1 << 16;

fn corrupt(page: usize, what: &str) -> Error {
    Error::Corrupt(format!("KV Exact page {page}: {what}"))
}

/// The shape of a page: KV heads and channels per head.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    pub heads: usize,
    pub head_dim: usize,
}

impl Shape {
    pub fn new(heads: usize, head_dim: usize) -> Result<Self> {
        if heads == 0 || head_dim == 0 || !head_dim.is_multiple_of(32) {
            return Err(Error::InvalidArgument(format!(
                "KV Exact pages need heads > 0 and head_dim a positive multiple of 32, not {heads} x {head_dim}"
            )));
        }
        if heads.checked_mul(head_dim).is_none_or(|c| c > MAX_CHANNELS) {
            return Err(Error::LimitExceeded(format!("{heads} x {head_dim} channels (at most {MAX_CHANNELS})")));
        }
        Ok(Shape { heads, head_dim })
    }
    pub fn channels(&self) -> usize {
        self.heads * self.head_dim
    }
    /// Bytes of the header: `heads + 1` u32, padded to 16.
    pub fn header_bytes(&self) -> usize {
        (4 * (self.heads + 1)).div_ceil(ALIGN) * ALIGN
    }
    /// Fixed bytes of one head: three planes and the raw bytes.
    pub fn head_bytes(&self) -> usize {
        22 * self.head_dim
    }
    /// Bytes of a page before its exceptions.
    pub fn fixed_bytes(&self) -> usize {
        self.header_bytes() + self.heads * self.head_bytes()
    }
    /// Bytes of 16 tokens of bf16 values.
    pub fn raw_page_bytes(&self) -> usize {
        2 * PAGE_TOKENS * self.channels()
    }
}

fn code_of(base: u8, e: u8) -> u8 {
    let d = base as i32 - e as i32;
    if (0..WINDOW).contains(&d) {
        d as u8
    } else {
        ESCAPE
    }
}

/// Append one page to `out`: `values` are 16 x channels bf16 values as little-endian bytes
/// (token-major, channel = head x head_dim + d), `bases` one window top per channel.
pub fn encode_page(shape: Shape, bases: &[u8], values: &[u8], out: &mut Vec<u8>) -> Result<()> {
    let c = shape.channels();
    if bases.len() != c {
        return Err(Error::InvalidArgument(format!("{} window tops for {c} channels", bases.len())));
    }
    if values.len() != shape.raw_page_bytes() {
        return Err(Error::InvalidArgument(format!(
            "a page is {} bytes of bf16, got {}",
            shape.raw_page_bytes(),
            values.len()
        )));
    }
    let (h, d) = (shape.heads, shape.head_dim);
    let start = out.len();
    let fixed = shape.fixed_bytes();
    out.resize(start + fixed, 0);
    let mut exceptions: Vec<u8> = Vec::new();
    let mut ex = Vec::with_capacity(h + 1);
    for head in 0..h {
        ex.push((fixed + exceptions.len()) as u32);
        let hb = start + shape.header_bytes() + head * shape.head_bytes();
        for t in 0..PAGE_TOKENS {
            for dd in 0..d {
                let ch = head * d + dd;
                let i = 2 * (t * c + ch);
                let v = u16::from_le_bytes([values[i], values[i + 1]]);
                let e = ((v >> 7) & 0xFF) as u8;
                let raw = (((v >> 8) & 0x80) | (v & 0x7F)) as u8;
                let code = code_of(bases[ch], e);
                if code == ESCAPE {
                    exceptions.push(e);
                }
                for p in 0..3 {
                    if (code >> p) & 1 == 1 {
                        out[hb + p * PAGE_TOKENS * d / 8 + t * d / 8 + dd / 8] |= 1 << (dd % 8);
                    }
                }
                out[hb + 6 * d + t * d + dd] = raw;
            }
        }
    }
    ex.push((fixed + exceptions.len()) as u32);
    for (k, o) in ex.iter().enumerate() {
        out[start + 4 * k..start + 4 * k + 4].copy_from_slice(&o.to_le_bytes());
    }
    out.extend_from_slice(&exceptions);
    let len = (out.len() - start).div_ceil(ALIGN) * ALIGN;
    out.resize(start + len, 0);
    Ok(())
}

/// Encode `n` pages back to back: (bytes, offsets [n + 1]).
pub fn encode_pages(shape: Shape, bases: &[u8], values: &[u8]) -> Result<(Vec<u8>, Vec<u64>)> {
    let pb = shape.raw_page_bytes();
    if !values.len().is_multiple_of(pb) {
        return Err(Error::InvalidArgument(format!("{} bytes is not a whole number of {pb}-byte pages", values.len())));
    }
    let mut out = Vec::with_capacity(values.len() * 3 / 4);
    let mut offsets = vec![0u64];
    for page in values.chunks_exact(pb) {
        encode_page(shape, bases, page, &mut out)?;
        offsets.push(out.len() as u64);
    }
    Ok((out, offsets))
}

/// The exception list's offset k (0..=heads) from a page's header (the page holds the fixed bytes).
fn exception_offset(page: &[u8], k: usize) -> usize {
    u32::from_le_bytes([page[4 * k], page[4 * k + 1], page[4 * k + 2], page[4 * k + 3]]) as usize
}

/// A rule on one page's length and header (`index` names the page in errors).
type Rule = fn(Shape, &[u8], usize) -> Result<()>;

/// The rules on a page's length and header, in the order the reference decoder checks them: each
/// may index what the rules before it checked. Over pages stored back to back each rule runs on every
/// page before the next rule, as the reference does, so damage in several pages gives its error.
const HEADER_RULES: [Rule; 7] = [
    |shape, page, index| {
        let fixed = shape.fixed_bytes();
        if page.len() < fixed {
            return Err(Error::Truncated(format!(
                "KV Exact page {index}: {} bytes, a page has at least {fixed}",
                page.len()
            )));
        }
        Ok(())
    },
    |_, page, index| {
        if page.len().is_multiple_of(ALIGN) {
            Ok(())
        } else {
            Err(corrupt(index, "length is not a multiple of 16"))
        }
    },
    |shape, page, index| {
        if page[4 * (shape.heads + 1)..shape.header_bytes()].iter().any(|&b| b != 0) {
            return Err(corrupt(index, "nonzero header padding"));
        }
        Ok(())
    },
    |shape, page, index| {
        if exception_offset(page, 0) != shape.fixed_bytes() {
            return Err(corrupt(index, "first exception offset is wrong"));
        }
        Ok(())
    },
    |shape, page, index| {
        if (0..shape.heads).any(|k| exception_offset(page, k + 1) < exception_offset(page, k)) {
            return Err(corrupt(index, "exception offsets decrease"));
        }
        Ok(())
    },
    |shape, page, index| {
        if exception_offset(page, shape.heads) > page.len() {
            return Err(Error::Truncated(format!("KV Exact page {index}: exceptions run past the page's end")));
        }
        Ok(())
    },
    |shape, page, index| {
        if exception_offset(page, shape.heads).div_ceil(ALIGN) * ALIGN != page.len() {
            return Err(corrupt(index, "page longer than its exceptions and padding"));
        }
        Ok(())
    },
];

/// The zero padding after a page's exceptions (the reference's last rule).
fn check_tail(shape: Shape, page: &[u8], index: usize) -> Result<()> {
    if page[exception_offset(page, shape.heads)..].iter().any(|&b| b != 0) {
        return Err(corrupt(index, "nonzero padding after the exceptions"));
    }
    Ok(())
}

fn check_bases(shape: Shape, bases: &[u8]) -> Result<()> {
    let c = shape.channels();
    if bases.len() != c {
        return Err(Error::InvalidArgument(format!("{} window tops for {c} channels", bases.len())));
    }
    Ok(())
}

/// Decode one page of exactly `page.len()` bytes into `out` (16 x channels bf16, little endian),
/// checking every rule of the format (`index` names the page in errors). Never panics.
pub fn decode_page(shape: Shape, bases: &[u8], page: &[u8], out: &mut [u8], index: usize) -> Result<()> {
    check_bases(shape, bases)?;
    if out.len() != shape.raw_page_bytes() {
        return Err(Error::BufferTooSmall { need: shape.raw_page_bytes() as u64, have: out.len() as u64 });
    }
    for rule in HEADER_RULES {
        rule(shape, page, index)?;
    }
    decode_body(shape, bases, page, out, index)?;
    check_tail(shape, page, index)
}

/// The values of a page whose header rules hold, checking the rules on codes and exceptions.
fn decode_body(shape: Shape, bases: &[u8], page: &[u8], out: &mut [u8], index: usize) -> Result<()> {
    let (h, d, c) = (shape.heads, shape.head_dim, shape.channels());
    let hdr = shape.header_bytes();
    let ex: Vec<usize> = (0..=h).map(|k| exception_offset(page, k)).collect();
    for head in 0..h {
        let hb = hdr + head * shape.head_bytes();
        let mut next = ex[head];
        for t in 0..PAGE_TOKENS {
            for dd in 0..d {
                let ch = head * d + dd;
                let mut code = 0u8;
                for p in 0..3 {
                    code |= ((page[hb + p * PAGE_TOKENS * d / 8 + t * d / 8 + dd / 8] >> (dd % 8)) & 1) << p;
                }
                let e = if code == ESCAPE {
                    if next >= ex[head + 1] {
                        return Err(corrupt(index, "more escapes than exception bytes"));
                    }
                    // the offsets are read again after the header rules: a caller's buffer written by
                    // another thread (the GIL is released) may now point past the page
                    let e = *page.get(next).ok_or_else(|| corrupt(index, "an exception offset past the page"))?;
                    next += 1;
                    if code_of(bases[ch], e) != ESCAPE {
                        return Err(corrupt(index, "an escaped exponent has a code"));
                    }
                    e
                } else {
                    let e = bases[ch] as i32 - code as i32;
                    if e < 0 {
                        return Err(corrupt(index, "a code points below exponent 0"));
                    }
                    e as u8
                };
                let raw = page[hb + 6 * d + t * d + dd] as u16;
                let v = ((raw & 0x80) << 8) | ((e as u16) << 7) | (raw & 0x7F);
                let o = 2 * (t * c + ch);
                out[o..o + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        if next != ex[head + 1] {
            return Err(corrupt(index, "fewer escapes than exception bytes"));
        }
    }
    Ok(())
}

/// The checks before any page of pages stored back to back (KV Exact and KV Exact4, as their
/// references): `offsets` hold n + 1 entries and `out` n pages of `page_bytes`; the offsets run from
/// 0 to the buffer's end (else Truncated) without decreasing (else Corrupt), so every page lies
/// inside the buffer. Returns n.
pub(crate) fn check_spans(
    what: &str,
    buf_len: usize,
    offsets: &[u64],
    out_len: usize,
    page_bytes: usize,
) -> Result<usize> {
    if offsets.is_empty() {
        return Err(Error::InvalidArgument("offsets must hold n + 1 entries".into()));
    }
    let n = offsets.len() - 1;
    let need = n.checked_mul(page_bytes).ok_or_else(|| Error::LimitExceeded("too many pages".into()))?;
    if out_len != need {
        return Err(Error::BufferTooSmall { need: need as u64, have: out_len as u64 });
    }
    if offsets[0] != 0 || offsets[n] != buf_len as u64 {
        return Err(Error::Truncated(format!(
            "{what} page offsets cover bytes {}..{} of a {buf_len}-byte buffer",
            offsets[0], offsets[n]
        )));
    }
    // one past the end makes a later offset decrease: Corrupt, as the references say
    if let Some(i) = offsets.windows(2).position(|w| w[1] < w[0]) {
        return Err(Error::Corrupt(format!("{what} page {i}: offsets decrease")));
    }
    Ok(n)
}

/// Decode pages stored back to back (`offsets` [n + 1], page i = `buf[offsets[i]..offsets[i + 1]]`)
/// into `out` (n x 16 x channels bf16). Errors name the page; never panics. The rules run in the
/// reference decoder's order, each on every page before the next (`HEADER_RULES`; the values a page at
/// a time, then the padding after the exceptions), so several damaged pages give its error class.
pub fn decode_pages(shape: Shape, bases: &[u8], buf: &[u8], offsets: &[u64], out: &mut [u8]) -> Result<()> {
    let pb = shape.raw_page_bytes();
    let n = check_spans("KV Exact", buf.len(), offsets, out.len(), pb)?;
    if n > 0 {
        check_bases(shape, bases)?; // (check_spans checked out's size)
    }
    let page = |i: usize| &buf[offsets[i] as usize..offsets[i + 1] as usize];
    for rule in HEADER_RULES {
        for i in 0..n {
            rule(shape, page(i), i)?;
        }
    }
    for (i, dst) in out.chunks_exact_mut(pb).enumerate() {
        decode_body(shape, bases, page(i), dst, i)?;
    }
    for i in 0..n {
        check_tail(shape, page(i), i)?;
    }
    Ok(())
}

/// Window tops from sample values (bf16 little endian, `channels` per row): per channel the
/// exponent b whose window [b - 6, b] holds the most samples (the smallest on ties).
pub fn calibrate_bases(channels: usize, samples: &[u8]) -> Result<Vec<u8>> {
    if channels == 0 || samples.is_empty() || !samples.len().is_multiple_of(2 * channels) {
        return Err(Error::InvalidArgument(format!("samples must be whole rows of {channels} bf16 values")));
    }
    if channels > MAX_CHANNELS {
        // 2 KiB of histogram per channel: the pages' own limit keeps it at 128 MiB
        return Err(Error::LimitExceeded(format!("{channels} channels (at most {MAX_CHANNELS})")));
    }
    let mut hist = vec![[0u64; 256]; channels];
    for (i, v) in samples.chunks_exact(2).enumerate() {
        let e = (u16::from_le_bytes([v[0], v[1]]) >> 7) & 0xFF;
        hist[i % channels][e as usize] += 1;
    }
    Ok(hist
        .iter()
        .map(|hc| {
            let mut best = (0u64, 0u8);
            for top in 0..256usize {
                let lo = top.saturating_sub(WINDOW as usize - 1);
                let m: u64 = hc[lo..=top].iter().sum();
                if m > best.0 {
                    best = (m, top as u8);
                }
            }
            best.1
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample(shape: Shape, pages: usize, seed: u64) -> Vec<u8> {
        // bf16-like values: exponents around 120 with a geometric tail, random sign and mantissa
        let mut s = seed | 1;
        let mut next = || {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            s
        };
        let mut out = Vec::new();
        for _ in 0..pages * PAGE_TOKENS * shape.channels() {
            let r = next();
            let e = 124u16.saturating_sub((r % 64).trailing_zeros() as u16 * 2 + (r >> 60) as u16 % 3);
            let v = ((r >> 20) as u16 & 0x807F) | (e << 7);
            out.extend_from_slice(&v.to_le_bytes());
        }
        out
    }

    #[test]
    fn round_trip_and_size() {
        let shape = Shape::new(3, 64).unwrap();
        let vals = sample(shape, 8, 7);
        let bases = calibrate_bases(shape.channels(), &vals).unwrap();
        let (buf, offs) = encode_pages(shape, &bases, &vals).unwrap();
        let mut out = vec![0u8; vals.len()];
        decode_pages(shape, &bases, &buf, &offs, &mut out).unwrap();
        assert_eq!(out, vals);
        assert!(buf.len() * 16 >= vals.len() * 11, "at least 11 of 16 bits");
    }

    #[test]
    fn every_bf16_pattern() {
        let shape = Shape::new(2, 32).unwrap();
        let vals: Vec<u8> = (0..=u16::MAX).flat_map(|v| v.to_le_bytes()).collect();
        for base in [0u8, 3, 127, 255] {
            let bases = vec![base; 64];
            let (buf, offs) = encode_pages(shape, &bases, &vals).unwrap();
            let mut out = vec![0u8; vals.len()];
            decode_pages(shape, &bases, &buf, &offs, &mut out).unwrap();
            assert_eq!(out, vals);
        }
    }

    #[test]
    fn hostile_pages_are_errors() {
        let shape = Shape::new(2, 32).unwrap();
        let vals = sample(shape, 1, 3);
        let bases = calibrate_bases(64, &vals).unwrap();
        let (buf, offs) = encode_pages(shape, &bases, &vals).unwrap();
        let mut out = vec![0u8; vals.len()];
        assert!(decode_pages(shape, &bases, &buf[..buf.len() - 16], &[0, offs[1] - 16], &mut out).is_err());
        let mut bad = buf.clone();
        bad[0] ^= 1;
        assert!(matches!(decode_pages(shape, &bases, &bad, &offs, &mut out), Err(Error::Corrupt(_))));
        assert!(Shape::new(2, 48).is_err());
        assert!(decode_pages(shape, &bases, &buf, &[0, 5], &mut out).is_err());
        let mut two = vec![0u8; 2 * vals.len()];
        let n = buf.len() as u64;
        // a middle offset past the end: Corrupt, as the reference says (the offsets then decrease)
        assert!(matches!(decode_pages(shape, &bases, &buf, &[0, 1 << 20, n], &mut two), Err(Error::Corrupt(_))));
        assert!(matches!(decode_pages(shape, &bases, &buf, &[0, n + 16, n], &mut two), Err(Error::Corrupt(_))));
        // the offsets before any page: a truncated first page (16 bytes) ahead of an offset past the
        // end is the offsets' error (Corrupt), as the reference, not the page's (Truncated)
        let both = [buf.clone(), buf.clone()].concat();
        let mut three = vec![0u8; 3 * vals.len()];
        let offs3 = [0, 16, 1 << 20, 2 * n];
        assert!(matches!(decode_pages(shape, &bases, &both, &offs3, &mut three), Err(Error::Corrupt(_))));
        assert!(matches!(decode_pages(shape, &bases, &both, &[0, 16, n, 2 * n], &mut three), Err(Error::Truncated(_))));
    }

    #[test]
    fn rules_run_over_every_page_in_the_references_order() {
        // page 0 longer than its exceptions (Corrupt), page 1's exceptions past its end (Truncated):
        // the reference checks "past the end" on every page first, so page 1's Truncated is the error
        let shape = Shape::new(2, 32).unwrap();
        let vals = sample(shape, 2, 5);
        let bases = calibrate_bases(64, &vals).unwrap();
        let (buf, offs) = encode_pages(shape, &bases, &vals).unwrap();
        let (a, b) = (offs[1] as usize, buf.len());
        let mut page1 = buf[a..b].to_vec();
        let past = (page1.len() + 16) as u32;
        page1[8..12].copy_from_slice(&past.to_le_bytes()); // the last exception offset (heads = 2)
        let both = [&buf[..a], &[0u8; 16][..], &page1[..]].concat();
        let offs2 = [0, a as u64 + 16, both.len() as u64];
        let mut out = vec![0u8; vals.len()];
        match decode_pages(shape, &bases, &both, &offs2, &mut out) {
            Err(Error::Truncated(m)) => assert!(m.contains("page 1") && m.contains("past the page's end"), "{m}"),
            other => panic!("{other:?}"),
        }
        // each page alone breaks its own rule
        let mut one = vec![0u8; vals.len() / 2];
        assert!(matches!(decode_page(shape, &bases, &both[..a + 16], &mut one, 0), Err(Error::Corrupt(_))));
        assert!(matches!(decode_page(shape, &bases, &page1, &mut one, 1), Err(Error::Truncated(_))));
    }

    proptest! {
        #[test]
        fn prop_round_trip(seed in any::<u64>(), bases in proptest::collection::vec(any::<u8>(), 64)) {
            let shape = Shape::new(2, 32).unwrap();
            let vals = sample(shape, 2, seed);
            let (buf, offs) = encode_pages(shape, &bases, &vals).unwrap();
            let mut out = vec![0u8; vals.len()];
            decode_pages(shape, &bases, &buf, &offs, &mut out).unwrap();
            prop_assert_eq!(out, vals);
        }

        #[test]
        fn prop_damaged_page_errs_or_reencodes(seed in any::<u64>(), at in any::<usize>(), bit in 0u8..8) {
            let shape = Shape::new(2, 32).unwrap();
            let vals = sample(shape, 1, seed);
            let bases = calibrate_bases(64, &vals).unwrap();
            let (mut buf, offs) = encode_pages(shape, &bases, &vals).unwrap();
            let i = at % buf.len();
            buf[i] ^= 1 << bit;
            let mut out = vec![0u8; vals.len()];
            if decode_pages(shape, &bases, &buf, &offs, &mut out).is_ok() {
                let (again, _) = encode_pages(shape, &bases, &out).unwrap();
                prop_assert_eq!(again, buf);
            }
        }
    }
}
