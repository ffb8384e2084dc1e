//! The exact page profile (docs/FORMAT.md, "Exact page profile"): 16-token pages of a paged KV
//! cache, each decodable on its own and by thousands of GPU threads at once.
//!
//! Read me first:
//! - A 16-bit value is split into an 8-bit *symbol* (bf16: the exponent; fp16: the high byte)
//!   and an 8-bit *raw* byte stored verbatim (bf16: sign and mantissa; fp16: the low byte).
//! - Symbols are coded with a STATIC canonical prefix code per channel, taken from a codebook
//!   calibrated once per (layer, K or V) and stored once, not per page. Symbol 256 is the
//!   escape: its code is followed by the 8 bits of a symbol that has no code of its own.
//! - A page of `C` channels has `C / 32` *streams*; stream `s` holds the symbols of channels
//!   `32s .. 32s + 31` of the 16 tokens, token-major. Each stream is padded to 32-bit words and
//!   its word count is in the page header, so a GPU thread per (page, stream) decodes 512 symbols
//!   with no dependency on any other stream.
//! - Bits are written into each little-endian u32 word from its most significant bit down.
//! - Version 2 (bf16 only, "context classes"): the symbol is sign and exponent (9 bits), the raw
//!   part the 7 mantissa bits, packed. After a page's first token the coded sign is the sign XOR
//!   the previous token's (same channel), and each symbol is coded with the table of its channel
//!   and *class*: 0 for a page's first token, else whether the previous token's exponent reaches
//!   the channel's split. Real K's signs and exponents persist from token to token.

use crate::codec::with_threads;
use crate::error::{corrupt, Error, Result};
use rayon::prelude::*;

/// Tokens per page.
pub const PAGE_TOKENS: usize = 16;
/// Channels per stream.
pub const STREAM_CHANNELS: usize = 32;
/// Symbols per stream (16 tokens x 32 channels).
pub const STREAM_SYMBOLS: usize = PAGE_TOKENS * STREAM_CHANNELS;
/// The escape symbol: its code is followed by 8 raw bits of a symbol without a code.
pub const ESC: usize = 256;
/// Symbols per channel table, the escape included.
pub const NSYM: usize = 257;
/// Longest code length. 12 bits keep the decoder's lookup table at 4096 entries per channel;
/// the reference calibrator uses 8 (a 512-byte table: measured on SmolLM2's KV, 8 instead of 12
/// costs 0.026 bits per value).
pub const MAX_CODE_LEN: u8 = 12;
/// Most channels in a codebook (keeps one page's header and size within u32).
pub const MAX_CHANNELS: usize = 1 << 16;
/// Codebook magic: "WZPB".
pub const CODEBOOK_MAGIC: [u8; 4] = *b"WZPB";
pub const CODEBOOK_VERSION: u8 = 1;
/// Version 2: sign and exponent coded in context classes (bf16 only).
pub const CODEBOOK_VERSION_CLASSES: u8 = 2;
/// Classes of a version-2 codebook: 0 for a page's first token, then 1 + (the previous token's
/// exponent >= the channel's split).
pub const CLASSES_V2: usize = 3;
/// Symbols per (channel, class) table of version 2, the escape (512) included.
pub const NSYM_V2: usize = 513;
/// dtype codes (as in the container index) the page profile accepts.
pub const DTYPE_BF16: u8 = 1;
pub const DTYPE_F16: u8 = 2;

/// One (layer, K or V) codebook: code lengths per channel (and class) and symbol, and the
/// canonical codes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageCodebook {
    /// 1 or 2 (CODEBOOK_VERSION_CLASSES)
    pub version: u8,
    pub dtype: u8,
    pub max_len: u8,
    pub channels: usize,
    /// Version 2: per channel, the exponent from which the previous token counts as high; empty
    /// in version 1.
    pub splits: Vec<u8>,
    /// `channels x classes x nsym` code lengths (version 1: 1 class of 257 symbols; version 2: 3
    /// of 513); 0 = no code.
    pub lengths: Vec<u8>,
    /// Canonical codes, the same shape (right-aligned in `lengths` bits).
    codes: Vec<u16>,
}

/// Size in bytes of a page header for `channels` channels: one u16 per stream, padded with
/// zeros to a multiple of 8 bytes so that the raw bytes and the code words stay aligned.
pub fn header_len(channels: usize) -> usize {
    (2 * (channels / STREAM_CHANNELS)).div_ceil(8) * 8
}

/// Split a 16-bit value into (symbol, raw byte).
#[inline]
fn split(dtype: u8, v: u16) -> (u8, u8) {
    if dtype == DTYPE_BF16 {
        (((v >> 7) & 0xFF) as u8, (((v >> 8) & 0x80) | (v & 0x7F)) as u8)
    } else {
        ((v >> 8) as u8, (v & 0xFF) as u8)
    }
}

#[inline]
fn join(dtype: u8, sym: u8, raw: u8) -> u16 {
    let (s, r) = (sym as u16, raw as u16);
    if dtype == DTYPE_BF16 {
        ((r & 0x80) << 8) | (s << 7) | (r & 0x7F)
    } else {
        (s << 8) | r
    }
}

/// Canonical codes from lengths: symbols sorted by (length, symbol), codes counting up.
/// Checks that the code is complete (Kraft sum exactly 1).
fn canonical(lengths: &[u8], max_len: u8, channel: usize) -> Result<Vec<u16>> {
    let mut count = [0u32; 16];
    for &l in lengths {
        if l > max_len {
            return corrupt(format!("codebook channel {channel}: code length {l} > max_len {max_len}"));
        }
        count[l as usize] += 1;
    }
    // Kraft sum in units of 2^-max_len.
    let kraft: u64 = (1..=max_len as usize).map(|l| (count[l] as u64) << (max_len as usize - l)).sum();
    if kraft != 1u64 << max_len {
        return corrupt(format!(
            "codebook channel {channel}: the code is not complete (Kraft sum {kraft}/{})",
            1u64 << max_len
        ));
    }
    // First code of each length: canonical order, codes of length l follow those of l - 1.
    let mut next_fixed = [0u32; 16];
    let mut c = 0u32;
    for l in 1..=max_len as usize {
        if l > 1 {
            c = (c + count[l - 1]) << 1;
        }
        next_fixed[l] = c;
    }
    let mut codes = vec![0u16; lengths.len()];
    for (s, &l) in lengths.iter().enumerate() {
        if l > 0 {
            codes[s] = next_fixed[l as usize] as u16;
            next_fixed[l as usize] += 1;
        }
    }
    Ok(codes)
}

impl PageCodebook {
    /// A version-1 codebook from its code lengths (`channels x 257`), checked like a parsed one.
    pub fn from_lengths(dtype: u8, max_len: u8, channels: usize, lengths: Vec<u8>) -> Result<Self> {
        Self::from_parts(CODEBOOK_VERSION, dtype, max_len, channels, Vec::new(), lengths)
    }

    /// A codebook of either version from its parts, checked like a parsed one (`splits`: one per
    /// channel in version 2, empty in version 1).
    pub fn from_parts(
        version: u8,
        dtype: u8,
        max_len: u8,
        channels: usize,
        splits: Vec<u8>,
        lengths: Vec<u8>,
    ) -> Result<Self> {
        if version != CODEBOOK_VERSION && version != CODEBOOK_VERSION_CLASSES {
            return Err(Error::UnsupportedVersion(version as u16, CODEBOOK_VERSION_CLASSES as u16));
        }
        if dtype != DTYPE_BF16 && (dtype != DTYPE_F16 || version != CODEBOOK_VERSION) {
            return Err(Error::Unsupported(format!("page codebook version {version} dtype code {dtype}")));
        }
        if max_len == 0 || max_len > MAX_CODE_LEN {
            return corrupt(format!("codebook max_len {max_len} not in 1..={MAX_CODE_LEN}"));
        }
        if channels == 0 || !channels.is_multiple_of(STREAM_CHANNELS) {
            return corrupt(format!("codebook channels {channels}: must be a positive multiple of 32"));
        }
        if channels > MAX_CHANNELS {
            return Err(Error::LimitExceeded(format!("codebook channels {channels} > {MAX_CHANNELS}")));
        }
        let (classes, nsym) = shape_of(version);
        let want_splits = if version == CODEBOOK_VERSION { 0 } else { channels };
        if splits.len() != want_splits {
            return corrupt(format!("codebook has {} splits, expected {want_splits}", splits.len()));
        }
        if lengths.len() != channels * classes * nsym {
            return corrupt(format!("codebook has {} lengths, expected {}", lengths.len(), channels * classes * nsym));
        }
        let mut codes = Vec::with_capacity(lengths.len());
        for (i, row) in lengths.chunks_exact(nsym).enumerate() {
            codes.extend(canonical(row, max_len, i / classes)?);
        }
        Ok(PageCodebook { version, dtype, max_len, channels, splits, lengths, codes })
    }

    /// Parse a serialized codebook (12-byte header, then the splits (version 2) and the lengths).
    pub fn parse(b: &[u8]) -> Result<Self> {
        if b.len() < 12 {
            return Err(Error::Truncated(format!("page codebook of {} bytes (header is 12)", b.len())));
        }
        if b[0..4] != CODEBOOK_MAGIC {
            return Err(Error::BadMagic);
        }
        let version = b[4];
        if version != CODEBOOK_VERSION && version != CODEBOOK_VERSION_CLASSES {
            return Err(Error::UnsupportedVersion(version as u16, CODEBOOK_VERSION_CLASSES as u16));
        }
        if b[7] != 0 {
            return corrupt("page codebook reserved byte 7 is not zero");
        }
        let channels = u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize;
        if channels > MAX_CHANNELS {
            return Err(Error::LimitExceeded(format!("codebook channels {channels} > {MAX_CHANNELS}")));
        }
        if version == CODEBOOK_VERSION_CLASSES && b[5] != DTYPE_BF16 {
            return Err(Error::Unsupported(format!("page codebook version 2 dtype code {}", b[5])));
        }
        let (classes, nsym) = shape_of(version);
        let n_splits = if version == CODEBOOK_VERSION { 0 } else { channels };
        let need = 12 + n_splits + channels * classes * nsym;
        if b.len() < need {
            return Err(Error::Truncated(format!("page codebook of {} bytes, header declares {need}", b.len())));
        }
        if b.len() > need {
            return corrupt(format!("page codebook of {} bytes, header declares {need}", b.len()));
        }
        let splits = b[12..12 + n_splits].to_vec();
        Self::from_parts(version, b[5], b[6], channels, splits, b[12 + n_splits..].to_vec())
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(12 + self.splits.len() + self.lengths.len());
        out.extend_from_slice(&CODEBOOK_MAGIC);
        out.extend_from_slice(&[self.version, self.dtype, self.max_len, 0]);
        out.extend_from_slice(&(self.channels as u32).to_le_bytes());
        out.extend_from_slice(&self.splits);
        out.extend_from_slice(&self.lengths);
        out
    }

    /// Tables per channel (1 in version 1, CLASSES_V2 in version 2).
    pub fn classes(&self) -> usize {
        shape_of(self.version).0
    }

    /// Symbols per table, the escape (the last) included: 257 or 513.
    pub fn nsym(&self) -> usize {
        shape_of(self.version).1
    }

    /// Bits of a symbol after the escape's code: 8 or 9.
    fn sym_bits(&self) -> u32 {
        if self.version == CODEBOOK_VERSION {
            8
        } else {
            9
        }
    }

    /// Index of table (channel, class) in `lengths`, in units of tables.
    #[inline]
    fn table(&self, channel: usize, class: usize) -> usize {
        channel * self.classes() + class
    }

    /// The class of a value of `channel` whose token in the page is not the first, from the
    /// previous token's symbol (0 in version 1).
    #[inline]
    fn class_after(&self, channel: usize, prev: usize) -> usize {
        if self.version == CODEBOOK_VERSION {
            0
        } else {
            1 + usize::from((prev & 0xFF) as u8 >= self.splits[channel])
        }
    }

    /// The coded symbol of `sym` after `prev` (same channel, previous token of the page): version
    /// 2 codes the sign as a change from the previous sign. Its own inverse.
    #[inline]
    fn coded_after(&self, sym: usize, prev: usize) -> usize {
        if self.version == CODEBOOK_VERSION {
            sym
        } else {
            sym ^ (prev & 0x100)
        }
    }

    /// Canonical code of (table, symbol); meaningful where the length is not 0. In version 1 the
    /// table is the channel.
    pub fn code(&self, table: usize, sym: usize) -> u16 {
        self.codes[table * self.nsym() + sym]
    }

    /// Calibrate a version-1 codebook from sample rows (`tokens x channels` 16-bit values, little
    /// endian): per channel, a Huffman code over the symbols seen plus the escape, with the
    /// rarest symbols moved to the escape until no code is longer than `max_len`.
    pub fn calibrate(dtype: u8, channels: usize, samples: &[u8], max_len: u8) -> Result<Self> {
        Self::calibrate_version(CODEBOOK_VERSION, dtype, channels, samples, max_len)
    }

    /// Calibrate a codebook of `version` (1, or 2 for bf16). Version 2 takes the sample rows as
    /// consecutive tokens in pages of 16 (row 0 starts a page): each table is fitted to the
    /// values of its class, and each channel's split is its median exponent.
    pub fn calibrate_version(version: u8, dtype: u8, channels: usize, samples: &[u8], max_len: u8) -> Result<Self> {
        if channels == 0 || !channels.is_multiple_of(STREAM_CHANNELS) || channels > MAX_CHANNELS {
            return Err(Error::InvalidArgument(format!(
                "channels {channels}: must be a positive multiple of 32, at most {MAX_CHANNELS}"
            )));
        }
        if !(2..=MAX_CODE_LEN).contains(&max_len) {
            return Err(Error::InvalidArgument(format!("max_len {max_len} not in 2..={MAX_CODE_LEN}")));
        }
        if version != CODEBOOK_VERSION && version != CODEBOOK_VERSION_CLASSES {
            return Err(Error::InvalidArgument(format!("page codebook version {version}: only 1 and 2")));
        }
        if dtype != DTYPE_BF16 && (dtype != DTYPE_F16 || version != CODEBOOK_VERSION) {
            return Err(Error::InvalidArgument(format!(
                "page profile dtype code {dtype}: only bf16 (1) and, in version 1, fp16 (2)"
            )));
        }
        if !samples.len().is_multiple_of(2 * channels) {
            return Err(Error::InvalidArgument(format!(
                "{} sample bytes are not whole rows of {channels} 16-bit values",
                samples.len()
            )));
        }
        let value = |t: usize, c: usize| {
            let i = 2 * (t * channels + c);
            u16::from_le_bytes([samples[i], samples[i + 1]])
        };
        let tokens = samples.len() / (2 * channels);
        let (classes, nsym) = shape_of(version);
        let mut splits = Vec::new();
        if version == CODEBOOK_VERSION_CLASSES {
            // the lower median of each channel's exponents (0 without samples)
            let mut hist = vec![0u64; channels * 256];
            for t in 0..tokens {
                for c in 0..channels {
                    hist[c * 256 + ((value(t, c) >> 7) & 0xFF) as usize] += 1;
                }
            }
            for c in 0..channels {
                let (mut below, half) = (0u64, (tokens as u64).div_ceil(2));
                let mut e = 0usize;
                while e < 255 && below + hist[c * 256 + e] < half {
                    below += hist[c * 256 + e];
                    e += 1;
                }
                splits.push(if tokens == 0 { 0 } else { e as u8 });
            }
        }
        let mut cb = PageCodebook { version, dtype, max_len, channels, splits, lengths: Vec::new(), codes: Vec::new() };
        let mut hist = vec![0u64; channels * classes * (nsym - 1)];
        for t in 0..tokens {
            for c in 0..channels {
                let sym = cb.split(value(t, c)).0 as usize;
                let (k, coded) = if t % PAGE_TOKENS == 0 {
                    (0, sym)
                } else {
                    let prev = cb.split(value(t - 1, c)).0 as usize;
                    (cb.class_after(c, prev), cb.coded_after(sym, prev))
                };
                hist[cb.table(c, k) * (nsym - 1) + coded] += 1;
            }
        }
        let mut lengths = vec![0u8; channels * classes * nsym];
        for (i, h) in hist.chunks_exact(nsym - 1).enumerate() {
            lengths[i * nsym..(i + 1) * nsym].copy_from_slice(&limited_lengths(h, max_len));
        }
        cb.lengths = lengths;
        Self::from_parts(version, dtype, max_len, channels, cb.splits, cb.lengths)
    }

    /// Raw size of one page in bytes.
    pub fn page_raw_len(&self) -> usize {
        PAGE_TOKENS * self.channels * 2
    }

    /// Bytes of a page's raw part: 16 x channels bytes (version 1), 16 x channels x 7 bits (2).
    pub fn page_raw_part(&self) -> usize {
        if self.version == CODEBOOK_VERSION {
            PAGE_TOKENS * self.channels
        } else {
            PAGE_TOKENS * self.channels * 7 / 8
        }
    }

    /// Split a 16-bit value into (symbol, raw bits).
    #[inline]
    fn split(&self, v: u16) -> (u16, u8) {
        if self.version == CODEBOOK_VERSION {
            let (s, r) = split(self.dtype, v);
            (s as u16, r)
        } else {
            (v >> 7, (v & 0x7F) as u8)
        }
    }
}

/// (classes, symbols per table) of a codebook version (version 1's for any other).
fn shape_of(version: u8) -> (usize, usize) {
    if version == CODEBOOK_VERSION_CLASSES {
        (CLASSES_V2, NSYM_V2)
    } else {
        (1, NSYM)
    }
}

/// Huffman code lengths over the seen symbols and the escape (count: 1 plus the counts moved
/// into it), demoting the rarest seen symbol to the escape until every length is <= max_len.
/// `hist` has one count per symbol; the result one length per symbol and the escape last.
fn limited_lengths(hist: &[u64], max_len: u8) -> Vec<u8> {
    let esc = hist.len();
    let mut live: Vec<usize> = (0..esc).filter(|&s| hist[s] > 0).collect();
    let mut esc_count = 1u64;
    loop {
        let mut weights: Vec<(u64, usize)> = live.iter().map(|&s| (hist[s], s)).collect();
        if weights.is_empty() {
            // No samples: a two-symbol code (symbol 0 and the escape) keeps the code complete.
            weights.push((0, 0));
        }
        weights.push((esc_count, esc));
        let lens = huffman_lengths(&weights);
        if lens.iter().all(|&(_, l)| l <= max_len as u32) {
            let mut out = vec![0u8; esc + 1];
            for (s, l) in lens {
                out[s] = l as u8;
            }
            return out;
        }
        // Drop the rarest seen symbol (ties: the larger symbol) into the escape.
        let (i, _) =
            live.iter().enumerate().min_by_key(|&(_, &s)| (hist[s], std::cmp::Reverse(s))).expect("escape alone fits");
        esc_count += hist[live[i]];
        live.remove(i);
    }
}

/// Plain Huffman code lengths for (weight, symbol) pairs (at least two).
fn huffman_lengths(w: &[(u64, usize)]) -> Vec<(usize, u32)> {
    // Nodes: leaves 0..n, then internal nodes; two-queue construction over sorted leaves.
    let n = w.len();
    let mut leaves: Vec<(u64, usize)> = w.to_vec();
    leaves.sort();
    let mut parent = vec![usize::MAX; 2 * n];
    let mut weight: Vec<u64> = leaves.iter().map(|x| x.0).collect();
    let (mut li, mut qi) = (0usize, n);
    let pick = |weight: &[u64], li: &mut usize, qi: &mut usize, len: usize| -> usize {
        if *li < n && (*qi >= len || weight[*li] <= weight[*qi]) {
            *li += 1;
            *li - 1
        } else {
            *qi += 1;
            *qi - 1
        }
    };
    for _ in 0..n - 1 {
        let len = weight.len();
        let a = pick(&weight, &mut li, &mut qi, len);
        let b = pick(&weight, &mut li, &mut qi, len);
        let id = weight.len();
        weight.push(weight[a] + weight[b]);
        parent[a] = id;
        parent[b] = id;
    }
    (0..n)
        .map(|i| {
            let (mut d, mut x) = (0u32, i);
            while parent[x] != usize::MAX {
                d += 1;
                x = parent[x];
            }
            (leaves[i].1, d)
        })
        .collect()
}

/// MSB-first bit writer into u32 words.
struct BitWriter {
    words: Vec<u32>,
    acc: u64,
    n: u32,
}

impl BitWriter {
    fn put(&mut self, code: u32, len: u32) {
        self.acc |= (code as u64) << (64 - self.n - len);
        self.n += len;
        if self.n >= 32 {
            self.words.push((self.acc >> 32) as u32);
            self.acc <<= 32;
            self.n -= 32;
        }
    }
    fn finish(mut self) -> Vec<u32> {
        if self.n > 0 {
            self.words.push((self.acc >> 32) as u32);
        }
        self.words
    }
}

/// Encode one page: `values` is 16 tokens x `channels` 16-bit values, little endian.
pub fn encode_page(cb: &PageCodebook, values: &[u8], out: &mut Vec<u8>) -> Result<()> {
    let c_n = cb.channels;
    if values.len() != cb.page_raw_len() {
        return Err(Error::InvalidArgument(format!("a page is {} bytes, got {}", cb.page_raw_len(), values.len())));
    }
    let v = |t: usize, c: usize| u16::from_le_bytes([values[2 * (t * c_n + c)], values[2 * (t * c_n + c) + 1]]);
    let (nsym, esc, sym_bits) = (cb.nsym(), cb.nsym() - 1, cb.sym_bits());
    let n_streams = c_n / STREAM_CHANNELS;
    let mut streams = Vec::with_capacity(n_streams);
    for s in 0..n_streams {
        let mut w = BitWriter { words: Vec::with_capacity(STREAM_SYMBOLS * 21 / 32 + 1), acc: 0, n: 0 };
        // each channel's previous symbol (before coding), for version 2's class and sign
        let mut prev = [0usize; STREAM_CHANNELS];
        for t in 0..PAGE_TOKENS {
            for c in s * STREAM_CHANNELS..(s + 1) * STREAM_CHANNELS {
                let sym = cb.split(v(t, c)).0 as usize;
                let p = std::mem::replace(&mut prev[c % STREAM_CHANNELS], sym);
                let (k, sym) = if t == 0 { (0, sym) } else { (cb.class_after(c, p), cb.coded_after(sym, p)) };
                let tb = cb.table(c, k);
                let l = cb.lengths[tb * nsym + sym];
                if l > 0 {
                    w.put(cb.code(tb, sym) as u32, l as u32);
                } else {
                    let le = cb.lengths[tb * nsym + esc];
                    if le == 0 {
                        return Err(Error::InvalidArgument(format!(
                            "channel {c}: symbol {sym} has no code and the codebook has no escape"
                        )));
                    }
                    w.put(cb.code(tb, esc) as u32, le as u32);
                    w.put(sym as u32, sym_bits);
                }
            }
        }
        streams.push(w.finish());
    }
    let hl = header_len(c_n);
    let start = out.len();
    out.resize(start + hl, 0);
    for (s, w) in streams.iter().enumerate() {
        // At most 512 x (12 + 9) bits = 336 words per stream: fits a u16.
        out[start + 2 * s..start + 2 * s + 2].copy_from_slice(&(w.len() as u16).to_le_bytes());
    }
    if cb.version == CODEBOOK_VERSION {
        for t in 0..PAGE_TOKENS {
            for c in 0..c_n {
                out.push(cb.split(v(t, c)).1);
            }
        }
    } else {
        // 7 bits a value, value i = t x C + c at bits 7i.., least significant bit first: each 8
        // values (16 x C is a multiple of 8) fill 7 bytes
        for vals in values.chunks_exact(16) {
            let x = vals.chunks_exact(2).enumerate().fold(0u64, |x, (j, b)| x | u64::from(b[0] & 0x7F) << (7 * j));
            out.extend_from_slice(&x.to_le_bytes()[..7]);
        }
    }
    for w in streams {
        for x in w {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    Ok(())
}

/// Length in bytes of the page that starts at `page[0]`, from its header alone (does not decode).
pub fn page_len(cb: &PageCodebook, page: &[u8]) -> Result<usize> {
    let hl = header_len(cb.channels);
    if page.len() < hl {
        return Err(Error::Truncated(format!("page of {} bytes, its header is {hl}", page.len())));
    }
    let words: usize =
        (0..cb.channels / STREAM_CHANNELS).map(|s| u16::from_le_bytes([page[2 * s], page[2 * s + 1]]) as usize).sum();
    Ok(hl + cb.page_raw_part() + 4 * words)
}

/// Decode one page of exactly `page.len()` bytes into `out` (16 x channels values, little endian).
/// Every rule of the format is checked; a violation is an error, never a panic.
pub fn decode_page(cb: &PageCodebook, page: &[u8], out: &mut [u8]) -> Result<()> {
    decode_page_with(cb, None, page, out)
}

/// The decoder's lookup table: entry `(table << max_len) + next max_len bits` holds
/// `symbol << 4 | length` (table: the channel in version 1, `channel x 3 + class` in version 2).
/// None when it would exceed 2^24 entries (32 MiB).
pub fn lookup_table(cb: &PageCodebook) -> Option<Vec<u16>> {
    let ml = cb.max_len as usize;
    let (tables, nsym) = (cb.channels * cb.classes(), cb.nsym());
    if tables << ml > 1 << 24 {
        return None;
    }
    let mut t = vec![0u16; tables << ml];
    for tb in 0..tables {
        for sym in 0..nsym {
            let l = cb.lengths[tb * nsym + sym] as usize;
            if l > 0 {
                let lo = (tb << ml) + ((cb.code(tb, sym) as usize) << (ml - l));
                t[lo..lo + (1 << (ml - l))].fill(((sym as u16) << 4) | l as u16);
            }
        }
    }
    Some(t)
}

fn decode_page_with(cb: &PageCodebook, lut: Option<&[u16]>, page: &[u8], out: &mut [u8]) -> Result<()> {
    // one copy of the loop per version, free of its per-value branches
    if cb.version == CODEBOOK_VERSION {
        decode_page_v::<false>(cb, lut, page, out)
    } else {
        decode_page_v::<true>(cb, lut, page, out)
    }
}

fn decode_page_v<const V2: bool>(cb: &PageCodebook, lut: Option<&[u16]>, page: &[u8], out: &mut [u8]) -> Result<()> {
    let c_n = cb.channels;
    if out.len() != cb.page_raw_len() {
        return Err(Error::BufferTooSmall { need: cb.page_raw_len() as u64, have: out.len() as u64 });
    }
    let hl = header_len(c_n);
    let n_streams = c_n / STREAM_CHANNELS;
    let total = page_len(cb, page)?;
    if page.len() < total {
        return Err(Error::Truncated(format!("page of {} bytes, its header declares {total}", page.len())));
    }
    if page.len() > total {
        return corrupt(format!("page of {} bytes, its header declares {total}", page.len()));
    }
    if page[2 * n_streams..hl].iter().any(|&b| b != 0) {
        return corrupt("page header padding is not zero");
    }
    let raw = &page[hl..hl + cb.page_raw_part()];
    // version 2's raw part unpacked into the output's low bytes first, 8 values from each 7
    // bytes (16 x C is a multiple of 8); the symbols join them below
    if V2 {
        for (b, o) in raw.chunks_exact(7).zip(out.chunks_exact_mut(16)) {
            let x = u64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], 0]);
            for (j, o) in o.chunks_exact_mut(2).enumerate() {
                o[0] = ((x >> (7 * j)) & 0x7F) as u8;
            }
        }
    }
    let mut pos = hl + cb.page_raw_part();
    let ml = cb.max_len as u32;
    let (nsym, esc, sym_bits) = (cb.nsym(), cb.nsym() - 1, cb.sym_bits());
    for s in 0..n_streams {
        let nw = u16::from_le_bytes([page[2 * s], page[2 * s + 1]]) as usize;
        // read again after page_len's check: a caller's buffer written by another thread (the GIL
        // is released) may now declare more words than the page holds, an error and not a panic
        let words =
            page.get(pos..pos + 4 * nw).ok_or_else(|| Error::Corrupt(format!("stream {s} runs past the page")))?;
        pos += 4 * nw;
        let word = |i: usize| -> u64 {
            if i < nw {
                u32::from_le_bytes([words[4 * i], words[4 * i + 1], words[4 * i + 2], words[4 * i + 3]]) as u64
            } else {
                0
            }
        };
        let total_bits = 32 * nw;
        // Peek `k` bits at `bitpos` (k <= 32); bits past the stream's end read as zero.
        let peek = |bitpos: usize, k: u32| -> u32 {
            let w = bitpos / 32;
            let two = (word(w) << 32) | word(w + 1);
            ((two << (bitpos % 32)) >> (64 - k)) as u32
        };
        // The stream's next bits, MSB first, left-aligned in `acc` (`avail` of them valid, at
        // least 32 after a refill: a code of up to 12 bits and an escape's 9 fit); words past the
        // stream's end read as zero, and `bitpos` counts the bits taken.
        let (mut acc, mut avail, mut next, mut bitpos) = (0u64, 0u32, 0usize, 0usize);
        let mut prev = [0usize; STREAM_CHANNELS];
        for t in 0..PAGE_TOKENS {
            for c in s * STREAM_CHANNELS..(s + 1) * STREAM_CHANNELS {
                if avail <= 32 {
                    acc |= word(next) << (32 - avail);
                    (avail, next) = (avail + 32, next + 1);
                }
                let k = if V2 && t > 0 {
                    1 + usize::from((prev[c % STREAM_CHANNELS] & 0xFF) as u8 >= cb.splits[c])
                } else {
                    0
                };
                let tb = if V2 { c * CLASSES_V2 + k } else { c };
                let x = (acc >> (64 - ml)) as u32;
                let (mut sym, l) = match lut {
                    Some(t) => {
                        let e = t[(tb << ml) + x as usize];
                        ((e >> 4) as usize, (e & 15) as u32)
                    }
                    None => {
                        // Canonical decode without a table: the symbol whose code prefixes x.
                        let lens = &cb.lengths[tb * nsym..(tb + 1) * nsym];
                        let mut found = None;
                        for (sym, &l) in lens.iter().enumerate() {
                            if l > 0 && (x >> (ml - l as u32)) as u16 == cb.code(tb, sym) {
                                found = Some((sym, l as u32));
                                break;
                            }
                        }
                        // A complete code always matches.
                        found.ok_or_else(|| Error::Corrupt("no code matched".into()))?
                    }
                };
                (acc, avail, bitpos) = (acc << l, avail - l, bitpos + l as usize);
                if sym == esc {
                    sym = (acc >> (64 - sym_bits)) as usize;
                    (acc, avail, bitpos) = (acc << sym_bits, avail - sym_bits, bitpos + sym_bits as usize);
                    if cb.lengths[tb * nsym + sym] != 0 {
                        return corrupt(format!(
                            "stream {s}: escaped symbol {sym} of channel {c} has a code of its own"
                        ));
                    }
                }
                if bitpos > total_bits {
                    return corrupt(format!("stream {s} runs past its {nw} words"));
                }
                let v = if V2 {
                    if t > 0 {
                        sym ^= prev[c % STREAM_CHANNELS] & 0x100;
                    }
                    prev[c % STREAM_CHANNELS] = sym;
                    ((sym as u16) << 7) | out[2 * (t * c_n + c)] as u16
                } else {
                    join(cb.dtype, sym as u8, raw[t * c_n + c])
                };
                out[2 * (t * c_n + c)..2 * (t * c_n + c) + 2].copy_from_slice(&v.to_le_bytes());
            }
        }
        if total_bits - bitpos >= 32 {
            return corrupt(format!("stream {s} has a spare word"));
        }
        if bitpos < total_bits && peek(bitpos, (total_bits - bitpos) as u32) != 0 {
            return corrupt(format!("stream {s}: padding bits are not zero"));
        }
    }
    Ok(())
}

/// Pages a parallel task encodes or decodes.
const TASK_PAGES: usize = 64;

/// Encode many pages (`values` = n x 16 x channels); returns the pages back to back and the
/// offset of each page (n + 1 offsets, the last = total length). With `align` > 1 every page
/// starts at a multiple of `align` bytes (zero bytes between pages), as the GPU pool places them.
/// One thread; `encode_pages_threads` writes the same bytes on several.
pub fn encode_pages(cb: &PageCodebook, values: &[u8], align: usize) -> Result<(Vec<u8>, Vec<u64>)> {
    encode_pages_threads(cb, values, align, 1)
}

/// `encode_pages` on `threads` threads (0: one per core), in tasks of `TASK_PAGES` pages: each
/// task's pages start at an aligned offset and end aligned, so the tasks' bytes put back to back
/// are the one-thread bytes. The first failing page in order gives the error.
pub fn encode_pages_threads(
    cb: &PageCodebook,
    values: &[u8],
    align: usize,
    threads: usize,
) -> Result<(Vec<u8>, Vec<u64>)> {
    let pr = cb.page_raw_len();
    if !values.len().is_multiple_of(pr) {
        return Err(Error::InvalidArgument(format!("{} bytes are not whole pages of {pr}", values.len())));
    }
    if align == 0 || !align.is_power_of_two() || align > 4096 {
        return Err(Error::InvalidArgument(format!("align {align}: must be a power of two <= 4096")));
    }
    let task = |values: &[u8]| -> Result<(Vec<u8>, Vec<u64>)> {
        // room for the pages at the raw size: most fit without growing (a page of real KV
        // codes to about 0.65 of it)
        let mut out = Vec::with_capacity(values.len() + align);
        let mut offs = Vec::with_capacity(values.len() / pr + 1);
        for page in values.chunks_exact(pr) {
            out.resize(out.len().div_ceil(align) * align, 0);
            offs.push(out.len() as u64);
            encode_page(cb, page, &mut out)?;
        }
        out.resize(out.len().div_ceil(align) * align, 0);
        offs.push(out.len() as u64);
        Ok((out, offs))
    };
    if threads == 1 || values.len() <= TASK_PAGES * pr {
        return task(values);
    }
    let parts: Vec<Result<(Vec<u8>, Vec<u64>)>> =
        with_threads(threads, || values.par_chunks(TASK_PAGES * pr).map(task).collect());
    let parts = parts.into_iter().collect::<Result<Vec<_>>>()?;
    let mut out = Vec::with_capacity(parts.iter().map(|(b, _)| b.len()).sum());
    let mut offs = Vec::with_capacity(values.len() / pr + 1);
    for (b, o) in parts {
        let base = out.len() as u64;
        offs.extend(o[..o.len() - 1].iter().map(|x| x + base));
        out.extend_from_slice(&b);
    }
    offs.push(out.len() as u64);
    Ok((out, offs))
}

/// Decode pages at `offsets` (n + 1 entries; page i is `buf[offsets[i] .. offsets[i] + its
/// length]`, and must end by `offsets[i + 1]`, the bytes after it up to there zero) into `out`
/// (n pages of raw values). One thread; `decode_pages_threads` on several.
pub fn decode_pages(cb: &PageCodebook, buf: &[u8], offsets: &[u64], out: &mut [u8]) -> Result<()> {
    decode_pages_threads(cb, buf, offsets, out, 1)
}

/// `decode_pages` on `threads` threads (0: one per core), in tasks of `TASK_PAGES` pages. On an
/// error the error is that of the first failing page in order, as on one thread (what `out`
/// holds then is unspecified).
pub fn decode_pages_threads(
    cb: &PageCodebook,
    buf: &[u8],
    offsets: &[u64],
    out: &mut [u8],
    threads: usize,
) -> Result<()> {
    let lut = if offsets.len() > 2 { lookup_table(cb) } else { None };
    decode_pages_with(cb, lut.as_deref(), buf, offsets, out, threads)
}

/// `decode_pages_threads` with the codebook's `lookup_table` already built (or None: a slower
/// decode without it), for a caller that decodes many times with one codebook. The table must be
/// this codebook's: only its length is checked, and another codebook's table of the same shape
/// decodes to wrong values (never a panic).
pub fn decode_pages_with(
    cb: &PageCodebook,
    lut: Option<&[u16]>,
    buf: &[u8],
    offsets: &[u64],
    out: &mut [u8],
    threads: usize,
) -> Result<()> {
    let pr = cb.page_raw_len();
    let n = offsets.len().saturating_sub(1);
    if out.len() != n * pr {
        return Err(Error::BufferTooSmall { need: (n * pr) as u64, have: out.len() as u64 });
    }
    if lut.is_some_and(|t| t.len() != (cb.channels * cb.classes()) << cb.max_len) {
        return Err(Error::InvalidArgument("lookup table not of this codebook".into()));
    }
    let page = |i: usize, out: &mut [u8]| -> Result<()> {
        let (a, b) = (offsets[i], offsets[i + 1]);
        if a > b || b > buf.len() as u64 {
            return corrupt(format!("page {i}: offsets {a}..{b} outside the {} byte buffer", buf.len()));
        }
        // the page's own errors name it
        let at = |e: Error| match e {
            Error::Corrupt(m) => Error::Corrupt(format!("page {i}: {m}")),
            Error::Truncated(m) => Error::Truncated(format!("page {i}: {m}")),
            e => e,
        };
        let region = &buf[a as usize..b as usize];
        let len = page_len(cb, region).map_err(at)?;
        if len > region.len() {
            return Err(Error::Truncated(format!(
                "page {i} of {len} bytes does not fit its {} byte slot",
                region.len()
            )));
        }
        decode_page_with(cb, lut, &region[..len], out).map_err(at)?;
        if region[len..].iter().any(|&b| b != 0) {
            return corrupt(format!("page {i}: the slack after it (bytes {}..{b}) is not zero", a + len as u64));
        }
        Ok(())
    };
    // pages [first, first + out's pages) into out
    let task = |first: usize, out: &mut [u8]| -> Result<()> {
        out.chunks_exact_mut(pr).enumerate().try_for_each(|(j, o)| page(first + j, o))
    };
    if threads == 1 || n <= TASK_PAGES || pr == 0 {
        return task(0, out);
    }
    let parts: Vec<Result<()>> = with_threads(threads, || {
        out.par_chunks_mut(TASK_PAGES * pr).enumerate().map(|(g, o)| task(g * TASK_PAGES, o)).collect()
    });
    parts.into_iter().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn sample(channels: usize, tokens: usize, seed: u64) -> Vec<u8> {
        // Gaussian-like values with a per-channel scale, as bf16, by a small LCG.
        let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
        let mut out = Vec::with_capacity(tokens * channels * 2);
        for _ in 0..tokens {
            for c in 0..channels {
                let mut acc = 0f32;
                for _ in 0..4 {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    acc += ((x >> 40) as f32 / (1u64 << 24) as f32) - 0.5;
                }
                let v = acc * (1 << (c % 7)) as f32;
                let b = (v.to_bits() >> 16) as u16;
                out.extend_from_slice(&b.to_le_bytes());
            }
        }
        out
    }

    #[test]
    fn threads_write_and_read_the_one_thread_bytes() {
        // 300 pages: 5 tasks, the last short; both versions, several alignments
        let ch = 64;
        let data = sample(ch, 16 * 300, 11);
        for version in [CODEBOOK_VERSION, CODEBOOK_VERSION_CLASSES] {
            let cb = PageCodebook::calibrate_version(version, DTYPE_BF16, ch, &data[..64 * 2 * ch], 8).unwrap();
            for align in [1, 8, 64] {
                let (b1, o1) = encode_pages(&cb, &data, align).unwrap();
                for threads in [0, 2, 3] {
                    let (b, o) = encode_pages_threads(&cb, &data, align, threads).unwrap();
                    assert!(b == b1 && o == o1, "version {version} align {align} threads {threads}");
                    let mut out = vec![0u8; data.len()];
                    decode_pages_threads(&cb, &b, &o, &mut out, threads).unwrap();
                    assert!(out == data);
                }
            }
            // two bad pages in different tasks: the error names the first, as on one thread
            let (mut b, o) = encode_pages(&cb, &data, 8).unwrap();
            for i in [70, 250] {
                b[o[i] as usize + 2 * (ch / STREAM_CHANNELS)] = 1; // header padding
            }
            let mut out = vec![0u8; data.len()];
            let one = decode_pages(&cb, &b, &o, &mut out).unwrap_err().to_string();
            assert!(one.contains("page 70: page header padding"), "{one}");
            for threads in [0, 2, 4] {
                let e = decode_pages_threads(&cb, &b, &o, &mut out, threads).unwrap_err().to_string();
                assert_eq!(e, one);
            }
        }
    }

    #[test]
    fn round_trip_and_ratio() {
        let ch = 64;
        let data = sample(ch, 64, 1);
        let cb = PageCodebook::calibrate(DTYPE_BF16, ch, &data, 8).unwrap();
        let cb2 = PageCodebook::parse(&cb.to_bytes()).unwrap();
        assert_eq!(cb, cb2);
        let (buf, offs) = encode_pages(&cb, &data, 8).unwrap();
        assert!(buf.len() < data.len() * 3 / 4, "{} vs {}", buf.len(), data.len());
        let mut out = vec![0u8; data.len()];
        decode_pages(&cb, &buf, &offs, &mut out).unwrap();
        assert_eq!(out, data);
        // The table-free decoder (one page at a time) agrees.
        let pr = cb.page_raw_len();
        let mut one = vec![0u8; pr];
        let len = page_len(&cb, &buf[offs[1] as usize..]).unwrap();
        decode_page(&cb, &buf[offs[1] as usize..offs[1] as usize + len], &mut one).unwrap();
        assert_eq!(one, data[pr..2 * pr]);
    }

    #[test]
    fn escape_for_unseen_symbols() {
        let ch = 32;
        let data = sample(ch, 16, 2);
        let cb = PageCodebook::calibrate(DTYPE_F16, ch, &data, 8).unwrap();
        // Values whose high bytes never occurred in calibration go through the escape.
        let other: Vec<u8> = (0..16 * ch).flat_map(|i| ((i as u16).wrapping_mul(7919)).to_le_bytes()).collect();
        let mut page = Vec::new();
        encode_page(&cb, &other, &mut page).unwrap();
        let mut out = vec![0u8; other.len()];
        decode_page(&cb, &page, &mut out).unwrap();
        assert_eq!(out, other);
    }

    #[test]
    fn hostile_pages_are_errors() {
        let ch = 32;
        let data = sample(ch, 16, 3);
        let cb = PageCodebook::calibrate(DTYPE_BF16, ch, &data, 8).unwrap();
        let mut page = Vec::new();
        encode_page(&cb, &data, &mut page).unwrap();
        let mut out = vec![0u8; data.len()];
        assert!(matches!(decode_page(&cb, &page[..page.len() - 1], &mut out), Err(Error::Truncated(_))));
        let mut longer = page.clone();
        longer.extend_from_slice(&[0, 0, 0, 0]);
        assert!(matches!(decode_page(&cb, &longer, &mut out), Err(Error::Corrupt(_))));
        let mut pad = page.clone();
        pad[2] = 1;
        assert!(matches!(decode_page(&cb, &pad, &mut out), Err(Error::Corrupt(_))));
        // Header says one word more than the stream needs: a spare word.
        let mut more = page.clone();
        more[0] += 1;
        more.extend_from_slice(&[0, 0, 0, 0]);
        assert!(matches!(decode_page(&cb, &more, &mut out), Err(Error::Corrupt(_))));
        let mut small = vec![0u8; 10];
        assert!(matches!(decode_page(&cb, &page, &mut small), Err(Error::BufferTooSmall { .. })));
    }

    #[test]
    fn slack_between_pages_must_be_zero() {
        // Pages at multiples of 32 bytes: the bytes between a page's end and the next page's start
        // (and after the last page, up to the last offset) are zeros; any bit set there is corrupt.
        let ch = 32;
        let data = sample(ch, 48, 5);
        let cb = PageCodebook::calibrate(DTYPE_BF16, ch, &data, 8).unwrap();
        let (buf, offs) = encode_pages(&cb, &data, 32).unwrap();
        let mut out = vec![0u8; data.len()];
        let mut slack = Vec::new();
        for i in 0..3 {
            let (a, b) = (offs[i] as usize, offs[i + 1] as usize);
            slack.extend(a + page_len(&cb, &buf[a..b]).unwrap()..b);
        }
        assert!(slack.len() >= 8, "{slack:?}");
        for &at in &slack {
            assert_eq!(buf[at], 0);
            for bit in [0, 7] {
                let mut bad = buf.clone();
                bad[at] ^= 1 << bit;
                assert!(matches!(decode_pages(&cb, &bad, &offs, &mut out), Err(Error::Corrupt(_))), "byte {at}");
            }
        }
        decode_pages(&cb, &buf, &offs, &mut out).unwrap();
        assert_eq!(out, data);
    }

    #[test]
    fn hostile_codebooks_are_errors() {
        let cb = PageCodebook::calibrate(DTYPE_BF16, 32, &sample(32, 16, 4), 8).unwrap();
        let b = cb.to_bytes();
        assert!(matches!(PageCodebook::parse(&b[..11]), Err(Error::Truncated(_))));
        assert!(matches!(PageCodebook::parse(&b[..b.len() - 1]), Err(Error::Truncated(_))));
        let mut m = b.clone();
        m[0] = b'X';
        assert!(matches!(PageCodebook::parse(&m), Err(Error::BadMagic)));
        let mut v = b.clone();
        v[4] = 3;
        assert!(matches!(PageCodebook::parse(&v), Err(Error::UnsupportedVersion(3, 2))));
        let mut d = b.clone();
        d[5] = 3;
        assert!(matches!(PageCodebook::parse(&d), Err(Error::Unsupported(_))));
        let mut k = b.clone();
        let i = (12..k.len()).find(|&i| k[i] > 0).unwrap();
        k[i] += 1; // breaks the Kraft sum
        assert!(matches!(PageCodebook::parse(&k), Err(Error::Corrupt(_))));
        let mut big = b.clone();
        big[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(PageCodebook::parse(&big), Err(Error::LimitExceeded(_))));
        let mut odd = b.clone();
        odd[8..12].copy_from_slice(&33u32.to_le_bytes());
        assert!(PageCodebook::parse(&odd).is_err());
    }

    /// Like `sample`, but each channel's sign persists over runs of tokens (as real K's does).
    fn persistent(channels: usize, tokens: usize, seed: u64) -> Vec<u8> {
        let mut x = sample(channels, tokens, seed);
        let mut r = seed | 1;
        for c in 0..channels {
            let mut sign = 0u8;
            for t in 0..tokens {
                r ^= r << 13;
                r ^= r >> 7;
                r ^= r << 17;
                if r.is_multiple_of(8) {
                    sign ^= 0x80;
                }
                let i = 2 * (t * channels + c) + 1;
                x[i] = (x[i] & 0x7F) | sign;
            }
        }
        x
    }

    #[test]
    fn classes_round_trip_and_code_persistent_signs_smaller() {
        let ch = 64;
        let data = persistent(ch, 256, 7);
        let cb1 = PageCodebook::calibrate(DTYPE_BF16, ch, &data, 8).unwrap();
        let cb2 = PageCodebook::calibrate_version(CODEBOOK_VERSION_CLASSES, DTYPE_BF16, ch, &data, 8).unwrap();
        assert_eq!((cb2.version, cb2.classes(), cb2.nsym(), cb2.splits.len()), (2, 3, 513, ch));
        assert_eq!(PageCodebook::parse(&cb2.to_bytes()).unwrap(), cb2);
        let (b1, o1) = encode_pages(&cb1, &data, 8).unwrap();
        let (b2, o2) = encode_pages(&cb2, &data, 8).unwrap();
        let mut out = vec![0u8; data.len()];
        decode_pages(&cb2, &b2, &o2, &mut out).unwrap();
        assert_eq!(out, data);
        // the sign costs about 0.54 bits instead of 1 (a flip every 8 tokens)
        assert!((b2.len() as f64) < 0.97 * b1.len() as f64, "{} vs {}", b2.len(), b1.len());
        decode_pages(&cb1, &b1, &o1, &mut out).unwrap();
        assert_eq!(out, data);
        // the table-free decoder agrees, page by page
        let pr = cb2.page_raw_len();
        for i in 0..o2.len() - 1 {
            let len = page_len(&cb2, &b2[o2[i] as usize..]).unwrap();
            let mut one = vec![0u8; pr];
            decode_page(&cb2, &b2[o2[i] as usize..o2[i] as usize + len], &mut one).unwrap();
            assert_eq!(one, data[i * pr..(i + 1) * pr]);
        }
    }

    #[test]
    fn classes_and_signs_follow_the_previous_token() {
        // Tables that each know one symbol (and the escape), split 128 in every channel:
        // class 0 (a page's first token) +1.0 (sign 0, exponent 127: 127); class 1 (previous
        // exponent below 128) "same sign, exponent 127" (127); class 2 (previous exponent 128 or
        // more) "sign changed, exponent 127" (256 + 127). A value costs 1 bit where its class's
        // table has its coded symbol, else 1 + 9 bits (the escape): a page's size tells which
        // table and which coded sign every token took.
        let ch = 32;
        let mut lengths = vec![0u8; ch * CLASSES_V2 * NSYM_V2];
        for c in 0..ch {
            for (k, sym) in [(0, 127), (1, 127), (2, 256 + 127)] {
                lengths[(c * CLASSES_V2 + k) * NSYM_V2 + sym] = 1;
                lengths[(c * CLASSES_V2 + k) * NSYM_V2 + 512] = 1;
            }
        }
        let cb = PageCodebook::from_parts(2, DTYPE_BF16, 8, ch, vec![128; ch], lengths).unwrap();
        let page_of =
            |f: &dyn Fn(usize) -> u16| -> Vec<u8> { (0..16 * ch).flat_map(|i| f(i / ch).to_le_bytes()).collect() };
        // +1.0 = 0x3F80, -1.0 = 0xBF80, -2.0 = 0xC000 (sign 1, exponent 128)
        let same = page_of(&|_| 0x3F80);
        let flip = page_of(&|t| if t % 2 == 0 { 0x3F80 } else { 0xBF80 });
        let two = page_of(&|t| if t % 2 == 0 { 0x3F80 } else { 0xC000 });
        // same: 1 bit a value. flip: after token 0 every value changes sign after exponent 127
        // (class 1, which has only "same sign"): escapes. two: odd tokens (-2.0 after +1.0: class
        // 1, sign changed) escape; even tokens after the first (+1.0 after -2.0: class 2, sign
        // changed, exponent 127) cost 1 bit.
        let per_stream = [16, (32 + 15 * 32 * 10usize).div_ceil(32), 32 * (1 + 8 * 10 + 7) / 32];
        for (v, words) in [(same, per_stream[0]), (flip, per_stream[1]), (two, per_stream[2])] {
            let mut p = Vec::new();
            encode_page(&cb, &v, &mut p).unwrap();
            assert_eq!(u16::from_le_bytes([p[0], p[1]]) as usize, words);
            let mut out = vec![0u8; v.len()];
            decode_page(&cb, &p, &mut out).unwrap();
            assert_eq!(out, v);
        }
    }

    #[test]
    fn hostile_class_codebooks_are_errors() {
        let data = persistent(32, 32, 9);
        let cb = PageCodebook::calibrate_version(2, DTYPE_BF16, 32, &data, 8).unwrap();
        let b = cb.to_bytes();
        assert_eq!(b.len(), 12 + 32 + 32 * 3 * 513);
        assert!(matches!(PageCodebook::parse(&b[..b.len() - 1]), Err(Error::Truncated(_))));
        assert!(matches!(PageCodebook::parse(&[b.as_slice(), &[0]].concat()), Err(Error::Corrupt(_))));
        let mut d = b.clone();
        d[5] = DTYPE_F16;
        assert!(matches!(PageCodebook::parse(&d), Err(Error::Unsupported(_))));
        assert!(matches!(PageCodebook::parse(&d[..100]), Err(Error::Unsupported(_))), "dtype before length");
        let mut k = b.clone();
        let i = (12 + 32..k.len()).find(|&i| k[i] > 0).unwrap();
        k[i] += 1;
        assert!(matches!(PageCodebook::parse(&k), Err(Error::Corrupt(_))));
        // a version-1 header over version-2 bytes (and the reverse) is a length mismatch
        let mut v1 = b.clone();
        v1[4] = 1;
        assert!(PageCodebook::parse(&v1).is_err());
        assert!(matches!(PageCodebook::calibrate_version(2, DTYPE_F16, 32, &data, 8), Err(Error::InvalidArgument(_))));
        assert!(matches!(PageCodebook::calibrate_version(3, DTYPE_BF16, 32, &data, 8), Err(Error::InvalidArgument(_))));
        // a version-2 page is 14 x channels raw bytes: cut or grown, it is refused
        let mut page = Vec::new();
        encode_page(&cb, &data[..cb.page_raw_len()], &mut page).unwrap();
        let mut out = vec![0u8; cb.page_raw_len()];
        assert!(matches!(decode_page(&cb, &page[..page.len() - 1], &mut out), Err(Error::Truncated(_))));
        assert!(matches!(decode_page(&cb, &[page.as_slice(), &[0; 4]].concat(), &mut out), Err(Error::Corrupt(_))));
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn prop_round_trip_classes(seed in any::<u64>(), cal in proptest::collection::vec(any::<u16>(), 32..256),
                                   pages in proptest::collection::vec(any::<u16>(), 512..=1024), ml in 8u8..=12) {
            let ch = 32;
            let mut calb: Vec<u8> = cal.iter().flat_map(|v| v.to_le_bytes()).collect();
            calb.truncate(calb.len() / (2 * ch) * 2 * ch);
            calb.extend(persistent(ch, 20, seed));
            let cb = PageCodebook::calibrate_version(2, DTYPE_BF16, ch, &calb, ml).unwrap();
            let n = pages.len() / 512 * 512;
            let mut vals: Vec<u8> = pages[..n].iter().flat_map(|v| v.to_le_bytes()).collect();
            vals.extend(persistent(ch, 16, seed ^ 1));
            let (buf, offs) = encode_pages(&cb, &vals, 8).unwrap();
            let mut out = vec![0u8; vals.len()];
            decode_pages(&cb, &buf, &offs, &mut out).unwrap();
            prop_assert_eq!(out, vals);
        }

        #[test]
        fn prop_flipped_class_page_errs_or_decodes(seed in any::<u64>(), at in any::<usize>(), bit in 0u8..8) {
            let data = persistent(32, 16, seed);
            let cb = PageCodebook::calibrate_version(2, DTYPE_BF16, 32, &data, 8).unwrap();
            let mut page = Vec::new();
            encode_page(&cb, &data, &mut page).unwrap();
            let i = at % page.len();
            page[i] ^= 1 << bit;
            let mut out = vec![0u8; data.len()];
            if decode_page(&cb, &page, &mut out).is_ok() {
                // the format is canonical: a page that decodes is the encoding of what it decodes to
                let mut again = Vec::new();
                encode_page(&cb, &out, &mut again).unwrap();
                prop_assert_eq!(again, page);
            }
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn prop_round_trip(seed in any::<u64>(), cal in proptest::collection::vec(any::<u16>(), 32..256),
                           pages in proptest::collection::vec(any::<u16>(), 512..=1024), f16 in any::<bool>(), ml in 8u8..=12) {
            let ch = 32;
            let dt = if f16 { DTYPE_F16 } else { DTYPE_BF16 };
            let mut calb: Vec<u8> = cal.iter().flat_map(|v| v.to_le_bytes()).collect();
            calb.truncate(calb.len() / (2 * ch) * 2 * ch);
            calb.extend(sample(ch, 2, seed));
            let cb = PageCodebook::calibrate(dt, ch, &calb, ml).unwrap();
            let n = pages.len() / 512 * 512;
            let vals: Vec<u8> = pages[..n].iter().flat_map(|v| v.to_le_bytes()).collect();
            let (buf, offs) = encode_pages(&cb, &vals, 8).unwrap();
            let mut out = vec![0u8; vals.len()];
            decode_pages(&cb, &buf, &offs, &mut out).unwrap();
            prop_assert_eq!(out, vals);
        }

        #[test]
        fn prop_hostile_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..4000), seed in any::<u64>()) {
            let cb = PageCodebook::calibrate(DTYPE_BF16, 32, &sample(32, 16, seed), 8).unwrap();
            let mut out = vec![0u8; cb.page_raw_len()];
            let _ = decode_page(&cb, &bytes, &mut out);
            let _ = PageCodebook::parse(&bytes);
        }

        #[test]
        fn prop_flipped_page_errs_or_decodes(seed in any::<u64>(), at in any::<usize>(), bit in 0u8..8) {
            let data = sample(32, 16, seed);
            let cb = PageCodebook::calibrate(DTYPE_BF16, 32, &data, 8).unwrap();
            let mut page = Vec::new();
            encode_page(&cb, &data, &mut page).unwrap();
            let i = at % page.len();
            page[i] ^= 1 << bit;
            let mut out = vec![0u8; data.len()];
            // Either a typed error or a decode (a flipped raw byte decodes to different values).
            let _ = decode_page(&cb, &page, &mut out);
        }
    }
}
