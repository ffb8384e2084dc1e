//! Interleaved rANS with 32-bit states and 16-bit renormalisation, static per-context tables.
//!
//! Read me first:
//! - Probabilities are quantised to `PROB_BITS` = 12 bits: every table's frequencies sum to 4096.
//!   12 bits keeps a decode table at 4096 two-byte entries per context (8 KiB, L1/L2 friendly) and
//!   costs < 0.1% over the plug-in entropy on the 10-60 symbol alphabets that real exponents use.
//! - A table holds at least two symbols, so no frequency reaches 4096 and every symbol costs at
//!   least -log2(4095/4096) = 3.5e-4 bits. That bounds how much output a stored byte can declare
//!   (see `MAX_EXPANSION` in the format module) and so how much a hostile file can make us allocate.
//! - State x lives in [L, L << 16) with L = 2^16. Encoding symbol (start s, freq f) first emits the
//!   low 16 bits while x >= f << 20 (= ((L >> PROB_BITS) << 16) * f), which keeps the next state
//!   below 2^32; decoding pulls one 16-bit word whenever x drops below L. One word at most per step.
//! - The encoder runs backwards and the decoder forwards; each lane's words are reversed after
//!   encoding so that the decoder reads every lane front to back. A lane starts with its final
//!   encoder state (u32 little endian) and must end in state L with every word consumed: that
//!   catches most corruption even before the chunk checksum does.
//! - Division in the encoder is replaced by a multiply with a 44-bit reciprocal: for d <= 4095 and
//!   x < 2^32, m = ceil(2^44 / d) gives floor(x / d) = (x * m) >> 44 exactly, because the rounding
//!   error e = m*d - 2^44 < d <= 2^12 and x * e < 2^44.

use crate::error::{corrupt, Result};

pub const PROB_BITS: u32 = 12;
pub const PROB_SCALE: u32 = 1 << PROB_BITS;
pub const RANS_L: u32 = 1 << 16;

/// Quantise symbol counts to frequencies summing to `PROB_SCALE`, each present symbol >= 1.
/// Returns `None` when no symbol occurs. When exactly one symbol occurs a second one (the next
/// symbol value, wrapping) is given frequency 1 so that no frequency equals `PROB_SCALE`.
pub fn quantize(counts: &[u32]) -> Option<Vec<u16>> {
    let alphabet = counts.len();
    let total: u64 = counts.iter().map(|&c| c as u64).sum();
    if total == 0 {
        return None;
    }
    let mut freqs: Vec<u16> = vec![0; alphabet];
    let present: Vec<usize> = (0..alphabet).filter(|&s| counts[s] > 0).collect();
    if present.len() == 1 {
        let s = present[0];
        freqs[s] = (PROB_SCALE - 1) as u16;
        freqs[(s + 1) % alphabet] = 1;
        return Some(freqs);
    }
    // Proportional share, at least 1 for every present symbol.
    let mut sum: i64 = 0;
    for &s in &present {
        let f = ((counts[s] as u64 * PROB_SCALE as u64) / total).max(1);
        freqs[s] = f as u16;
        sum += f as i64;
    }
    // Fix the rounding: move the difference onto the symbols where it costs the least bits.
    // Adding to / taking from the most frequent symbols changes their code length the least.
    let mut order = present.clone();
    order.sort_by(|&a, &b| counts[b].cmp(&counts[a]).then(a.cmp(&b)));
    let mut diff = PROB_SCALE as i64 - sum;
    let mut i = 0;
    while diff != 0 {
        let s = order[i % order.len()];
        if diff > 0 {
            freqs[s] += 1;
            diff -= 1;
        } else if freqs[s] > 1 {
            freqs[s] -= 1;
            diff += 1;
        }
        i += 1;
    }
    Some(freqs)
}

/// Encoder view of one symbol: everything needed to code it without a division.
#[derive(Clone, Copy, Default)]
pub struct EncSym {
    pub x_max: u32,
    pub start: u32,
    pub freq: u32,
    pub rcp: u64,
}

impl EncSym {
    pub fn new(start: u32, freq: u32) -> EncSym {
        debug_assert!((1..PROB_SCALE).contains(&freq));
        EncSym {
            // ((L >> PROB_BITS) << 16) * freq, see the module notes.
            x_max: freq << 20,
            start,
            freq,
            rcp: (1u64 << 44).div_ceil(freq as u64),
        }
    }
}

/// Encoder table for one context: `EncSym` per symbol value.
pub struct EncTable {
    pub syms: Vec<EncSym>,
}

impl EncTable {
    pub fn new(freqs: &[u16]) -> EncTable {
        let mut syms = vec![EncSym::default(); freqs.len()];
        let mut start = 0u32;
        for (s, &f) in freqs.iter().enumerate() {
            if f > 0 {
                syms[s] = EncSym::new(start, f as u32);
                start += f as u32;
            }
        }
        EncTable { syms }
    }
}

/// Code one symbol into a state already renormalised below `s.x_max`.
#[inline(always)]
pub fn enc_step(v: u32, s: &EncSym) -> u32 {
    let q = ((v as u128 * s.rcp as u128) >> 44) as u32;
    (q << PROB_BITS) + (v - q * s.freq) + s.start
}

/// Decoder table for one context: slot -> symbol, and symbol -> (freq << 16 | start).
pub struct DecTable {
    pub slot_sym: Vec<u16>,
    pub sym_fs: Vec<u32>,
}

impl DecTable {
    /// Build from (symbol, freq) pairs already validated: symbols strictly increasing and below the
    /// alphabet size, every freq >= 1, the sum exactly `PROB_SCALE`.
    pub fn new(pairs: &[(u16, u16)], alphabet: usize) -> DecTable {
        let mut slot_sym = vec![0u16; PROB_SCALE as usize];
        let mut sym_fs = vec![0u32; alphabet];
        let mut start = 0u32;
        for &(s, f) in pairs {
            let f = f as u32;
            sym_fs[s as usize] = (f << 16) | start;
            for slot in &mut slot_sym[start as usize..(start + f) as usize] {
                *slot = s;
            }
            start += f;
        }
        DecTable { slot_sym, sym_fs }
    }

    /// An empty context: decoding a symbol in it is an error. Its single slot entry points at a
    /// symbol with frequency 0, which the decoder treats as corruption.
    pub fn empty(alphabet: usize) -> DecTable {
        DecTable { slot_sym: vec![0u16; PROB_SCALE as usize], sym_fs: vec![0u32; alphabet] }
    }
}

/// Check a (symbol, freq) list read from a stream.
pub fn validate_pairs(pairs: &[(u16, u16)], alphabet: usize) -> Result<()> {
    if pairs.is_empty() {
        return Ok(());
    }
    if pairs.len() < 2 {
        return corrupt("a frequency table must hold 0 or at least 2 symbols");
    }
    let mut sum = 0u32;
    let mut prev: i32 = -1;
    for &(s, f) in pairs {
        if (s as i32) <= prev || s as usize >= alphabet {
            return corrupt("frequency table symbols out of order or out of range");
        }
        if f == 0 {
            return corrupt("zero frequency in a frequency table");
        }
        prev = s as i32;
        sum += f as u32;
    }
    if sum != PROB_SCALE {
        return corrupt(format!("frequency table sums to {sum}, not {PROB_SCALE}"));
    }
    Ok(())
}

/// Cost in bits of coding `counts` with `freqs` (for choosing between models).
pub fn coded_bits(counts: &[u32], freqs: &[u16]) -> f64 {
    let mut bits = 0.0;
    for (&c, &f) in counts.iter().zip(freqs) {
        if c > 0 {
            bits += c as f64 * (PROB_BITS as f64 - (f as f64).log2());
        }
    }
    bits
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantize_sums_and_keeps_every_symbol() {
        let counts = [1000u32, 1, 0, 5, 77777, 3];
        let f = quantize(&counts).unwrap();
        assert_eq!(f.iter().map(|&x| x as u32).sum::<u32>(), PROB_SCALE);
        for (c, q) in counts.iter().zip(&f) {
            assert_eq!(*c > 0, *q > 0);
        }
    }

    #[test]
    fn single_symbol_gets_a_partner() {
        let f = quantize(&[0, 0, 9, 0]).unwrap();
        assert_eq!(f, vec![0, 0, 4095, 1]);
        let f = quantize(&[0, 0, 0, 9]).unwrap();
        assert_eq!(f, vec![1, 0, 0, 4095]);
    }

    #[test]
    fn reciprocal_division_is_exact() {
        for d in 1..PROB_SCALE {
            let rcp = (1u64 << 44).div_ceil(d as u64);
            for x in [0u32, 1, d - 1, d, d + 1, 65535, 1 << 31, u32::MAX, u32::MAX - d, 123456789] {
                assert_eq!(((x as u128 * rcp as u128) >> 44) as u32, x / d, "x={x} d={d}");
            }
        }
    }
}
