//! One chunk of the dense profile: a run of units, coded independently of every other chunk.
//!
//! A unit (an element of a float tensor, or a byte of anything else) is split into a symbol (its
//! top `sym_bits` bits: sign and exponent for floats) and raw low bits. Symbols are coded with
//! interleaved rANS; each symbol's table is picked by a context, the symbol of the unit
//! `ctx_stride` units earlier (for KV laid out [tokens, channels], the same channel one token
//! back). The encoder measures which stride pays best for each chunk, and falls back to storing
//! the chunk raw when coding would not make it smaller. Byte layout: docs/FORMAT.md, "Chunk".

use crate::bytes::{put_u16, put_u32, Reader};
use crate::dtype::Split;
use crate::error::{corrupt, truncated, Result};
use crate::rans::{self, DecTable, EncTable, PROB_BITS, PROB_SCALE, RANS_L};

pub const MODE_STORED: u8 = 0;
pub const MODE_RANS: u8 = 1;
/// Most contexts one chunk may declare (context ids fit a byte).
pub const MAX_CONTEXTS: usize = 256;
/// Most lanes: 2^10. The GPU decoder runs a thread per lane; 32 lanes are enough on a CPU.
pub const MAX_LANES_LOG2: u32 = 10;
pub const DEFAULT_LANES_LOG2: u32 = 5;
/// Largest alphabet: 2^12 symbols, so a symbol always has a slot in a 4096-entry table.
pub const MAX_SYM_BITS: u32 = 12;

#[inline(always)]
fn load<const UB: usize>(d: &[u8], i: usize) -> u32 {
    match UB {
        1 => d[i] as u32,
        2 => u16::from_le_bytes([d[2 * i], d[2 * i + 1]]) as u32,
        _ => u32::from_le_bytes([d[4 * i], d[4 * i + 1], d[4 * i + 2], d[4 * i + 3]]),
    }
}

#[inline(always)]
fn store<const UB: usize>(d: &mut [u8], i: usize, v: u32) {
    match UB {
        1 => d[i] = v as u8,
        2 => d[2 * i..2 * i + 2].copy_from_slice(&(v as u16).to_le_bytes()),
        _ => d[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes()),
    }
}

/// A context model for one chunk: which previous symbols get their own table, and the tables.
struct Model {
    stride: usize,
    /// Previous-symbol values that own a context, ascending; context id = index + 1.
    keys: Vec<u16>,
    /// Quantised frequencies per context (empty vector: context never used).
    freqs: Vec<Vec<u16>>,
    /// Estimated coded size in bits, tables included.
    est_bits: f64,
}

fn table_bytes(freqs: &[u16]) -> usize {
    2 + 4 * freqs.iter().filter(|&&f| f > 0).count()
}

/// Build the model for one candidate stride from the chunk's symbols.
fn build_model(syms: &[u16], alphabet: usize, stride: usize) -> Model {
    let n = syms.len();
    if stride == 0 || stride >= n {
        let mut counts = vec![0u32; alphabet];
        for &s in syms {
            counts[s as usize] += 1;
        }
        let f = rans::quantize(&counts).unwrap_or_default();
        let est = rans::coded_bits(&counts, &f) + 8.0 * (table_bytes(&f) + 2) as f64;
        return Model { stride: 0, keys: vec![], freqs: vec![f], est_bits: est };
    }
    // counts[p * alphabet + s]: symbol s after previous symbol p; row `alphabet` = no previous.
    let mut counts = vec![0u32; (alphabet + 1) * alphabet];
    for &s in &syms[..stride] {
        counts[alphabet * alphabet + s as usize] += 1;
    }
    for i in stride..n {
        counts[syms[i - stride] as usize * alphabet + syms[i] as usize] += 1;
    }
    let mut global = vec![0u64; alphabet];
    for row in counts.chunks(alphabet) {
        for (g, &c) in global.iter_mut().zip(row) {
            *g += c as u64;
        }
    }
    let total = n as f64;
    // Gain of giving previous symbol p its own table: bits saved against the chunk-wide
    // distribution, less the table's own bytes.
    let mut gains: Vec<(f64, usize)> = Vec::new();
    for p in 0..alphabet {
        let row = &counts[p * alphabet..(p + 1) * alphabet];
        let np: u64 = row.iter().map(|&c| c as u64).sum();
        if np == 0 {
            continue;
        }
        let mut saved = 0.0;
        let mut nsym = 0;
        for (s, &c) in row.iter().enumerate() {
            if c > 0 {
                nsym += 1;
                let p_ctx = c as f64 / np as f64;
                let p_glob = global[s] as f64 / total;
                saved += c as f64 * (p_ctx / p_glob).log2();
            }
        }
        let gain = saved - 8.0 * (2 + 4 * nsym.max(2) + 2) as f64;
        if gain > 0.0 {
            gains.push((gain, p));
        }
    }
    gains.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
    gains.truncate(MAX_CONTEXTS - 1);
    let mut keys: Vec<u16> = gains.iter().map(|&(_, p)| p as u16).collect();
    keys.sort_unstable();
    let mut ctx_counts: Vec<Vec<u32>> = vec![vec![0u32; alphabet]; keys.len() + 1];
    let mut is_key = vec![usize::MAX; alphabet + 1];
    for (k, &p) in keys.iter().enumerate() {
        is_key[p as usize] = k + 1;
    }
    for p in 0..=alphabet {
        let row = &counts[p * alphabet..(p + 1) * alphabet];
        let ctx = if is_key[p] == usize::MAX { 0 } else { is_key[p] };
        for (acc, &c) in ctx_counts[ctx].iter_mut().zip(row) {
            *acc += c;
        }
    }
    let mut est = 8.0 * (2 * keys.len() + 2) as f64;
    let mut freqs = Vec::with_capacity(ctx_counts.len());
    for c in &ctx_counts {
        let f = rans::quantize(c).unwrap_or_default();
        est += rans::coded_bits(c, &f) + 8.0 * table_bytes(&f) as f64;
        freqs.push(f);
    }
    Model { stride, keys, freqs, est_bits: est }
}

/// Encode one chunk. `strides` are the context strides (in units) the encoder may choose from;
/// 0 (no context) is always tried.
pub fn encode_chunk(data: &[u8], split: Split, strides: &[usize], lanes_log2: u32) -> Vec<u8> {
    match split.unit_bits {
        8 => encode_impl::<1>(data, split, strides, lanes_log2),
        16 => encode_impl::<2>(data, split, strides, lanes_log2),
        32 => encode_impl::<4>(data, split, strides, lanes_log2),
        b => panic!("unit of {b} bits"),
    }
}

fn stored(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + 1);
    out.push(MODE_STORED);
    out.extend_from_slice(data);
    out
}

fn encode_impl<const UB: usize>(
    data: &[u8],
    split: Split,
    strides: &[usize],
    lanes_log2: u32,
) -> Vec<u8> {
    assert_eq!(data.len() % UB, 0);
    assert!(split.sym_bits >= 1 && split.sym_bits <= MAX_SYM_BITS);
    assert!(lanes_log2 <= MAX_LANES_LOG2);
    let n = data.len() / UB;
    let rbits = split.raw_bits();
    let alphabet = 1usize << split.sym_bits;
    let syms: Vec<u16> = (0..n).map(|i| (load::<UB>(data, i) >> rbits) as u16).collect();

    let mut best = build_model(&syms, alphabet, 0);
    for &s in strides {
        if s == 0 || s >= n {
            continue;
        }
        let m = build_model(&syms, alphabet, s);
        if m.est_bits < best.est_bits {
            best = m;
        }
    }
    let lanes = 1usize << lanes_log2;
    let raw_bytes = (n * rbits as usize).div_ceil(8);
    // Quick exit: if even the estimate cannot beat storing, store.
    let est_total = best.est_bits / 8.0 + raw_bytes as f64 + 4.0 * lanes as f64 + 16.0;
    if est_total >= data.len() as f64 {
        return stored(data);
    }

    // A unit's context must come from an earlier round of lanes, so that a GPU thread per lane can
    // decode in lockstep: use fewer lanes when the stride is short (byte data with stride 1 gets
    // a single lane).
    let mut lanes_log2 = lanes_log2;
    while best.stride != 0 && (1usize << lanes_log2) > best.stride {
        lanes_log2 -= 1;
    }
    let lanes = 1usize << lanes_log2;
    let mut ctx_of = vec![0u8; alphabet];
    for (k, &p) in best.keys.iter().enumerate() {
        ctx_of[p as usize] = (k + 1) as u8;
    }
    let tables: Vec<EncTable> = best.freqs.iter().map(|f| EncTable::new(f)).collect();
    let stride = best.stride;
    let mask = lanes - 1;
    let mut states = vec![RANS_L; lanes];
    let mut words: Vec<Vec<u16>> = (0..lanes).map(|_| Vec::with_capacity(n / lanes + 8)).collect();
    for i in (0..n).rev() {
        let ctx = if stride > 0 && i >= stride { ctx_of[syms[i - stride] as usize] } else { 0 };
        let es = &tables[ctx as usize].syms[syms[i] as usize];
        let lane = i & mask;
        rans::enc_put(&mut states[lane], &mut words[lane], es);
    }

    let mut out = Vec::with_capacity(raw_bytes + n / 2 + 4096);
    out.push(MODE_RANS);
    out.push(split.unit_bits as u8);
    out.push(split.sym_bits as u8);
    out.push(lanes_log2 as u8);
    put_u32(&mut out, stride as u32);
    put_u16(&mut out, (best.keys.len() + 1) as u16);
    for &k in &best.keys {
        put_u16(&mut out, k);
    }
    for f in &best.freqs {
        let present: Vec<(usize, u16)> =
            f.iter().enumerate().filter(|(_, &q)| q > 0).map(|(s, &q)| (s, q)).collect();
        put_u16(&mut out, present.len() as u16);
        for (s, q) in present {
            put_u16(&mut out, s as u16);
            put_u16(&mut out, q);
        }
    }
    for w in &words {
        put_u32(&mut out, (4 + 2 * w.len()) as u32);
    }
    for (w, &x) in words.iter().zip(&states) {
        put_u32(&mut out, x);
        for &word in w.iter().rev() {
            put_u16(&mut out, word);
        }
    }
    pack_low_bits::<UB>(data, n, rbits, &mut out);
    if out.len() >= data.len() + 1 {
        return stored(data);
    }
    out
}

/// Append the low `rbits` bits of every unit, least significant bit first.
fn pack_low_bits<const UB: usize>(data: &[u8], n: usize, rbits: u32, out: &mut Vec<u8>) {
    if rbits == 0 {
        return;
    }
    let mask = (1u64 << rbits) - 1;
    let mut acc: u64 = 0;
    let mut nbits = 0u32;
    for i in 0..n {
        acc |= (load::<UB>(data, i) as u64 & mask) << nbits;
        nbits += rbits;
        while nbits >= 8 {
            out.push(acc as u8);
            acc >>= 8;
            nbits -= 8;
        }
    }
    if nbits > 0 {
        out.push(acc as u8);
    }
}

/// Decode one chunk payload into `out`, whose length is the chunk's raw length.
pub fn decode_chunk(payload: &[u8], out: &mut [u8]) -> Result<()> {
    let mut r = Reader::new(payload);
    match r.u8("chunk mode")? {
        MODE_STORED => {
            let body = r.take(out.len(), "stored chunk")?;
            if r.remaining() != 0 {
                return corrupt("stored chunk longer than its raw length");
            }
            out.copy_from_slice(body);
            Ok(())
        }
        MODE_RANS => match r.u8("unit bits")? {
            8 => decode_impl::<1>(payload, r, out),
            16 => decode_impl::<2>(payload, r, out),
            32 => decode_impl::<4>(payload, r, out),
            b => corrupt(format!("unit of {b} bits")),
        },
        m => Err(crate::error::Error::Unsupported(format!("chunk mode {m}"))),
    }
}

fn decode_impl<const UB: usize>(full: &[u8], mut r: Reader, out: &mut [u8]) -> Result<()> {
    if out.len() % UB != 0 {
        return corrupt("chunk length is not a whole number of units");
    }
    let n = out.len() / UB;
    let sym_bits = r.u8("symbol bits")? as u32;
    if sym_bits == 0 || sym_bits > MAX_SYM_BITS || sym_bits > 8 * UB as u32 {
        return corrupt(format!("symbol bits {sym_bits} out of range"));
    }
    let rbits = 8 * UB as u32 - sym_bits;
    let alphabet = 1usize << sym_bits;
    let lanes_log2 = r.u8("lanes")? as u32;
    if lanes_log2 > MAX_LANES_LOG2 {
        return corrupt(format!("2^{lanes_log2} lanes is more than 2^{MAX_LANES_LOG2}"));
    }
    let lanes = 1usize << lanes_log2;
    let stride = r.u32("context stride")? as usize;
    let n_ctx = r.u16("context count")? as usize;
    if n_ctx == 0 || n_ctx > MAX_CONTEXTS || n_ctx > alphabet + 1 {
        return corrupt(format!("{n_ctx} contexts"));
    }
    if stride != 0 && stride < lanes {
        return corrupt(format!("context stride {stride} is shorter than the {lanes} lanes"));
    }
    // Each context costs at least its 2-byte key and 2-byte table size: check before allocating.
    if r.remaining() < 4 * n_ctx {
        return truncated("context keys and tables");
    }
    let mut ctx_of = vec![0u8; alphabet];
    let mut prev: i32 = -1;
    for k in 1..n_ctx {
        let key = r.u16("context key")?;
        if key as i32 <= prev || key as usize >= alphabet {
            return corrupt("context keys out of order or out of range");
        }
        prev = key as i32;
        ctx_of[key as usize] = k as u8;
    }
    let mut slot_sym: Vec<u16> = Vec::with_capacity(n_ctx * PROB_SCALE as usize);
    let mut sym_fs: Vec<u32> = Vec::with_capacity(n_ctx * alphabet);
    for _ in 0..n_ctx {
        let nsym = r.u16("table size")? as usize;
        if nsym > alphabet {
            return corrupt("frequency table larger than the alphabet");
        }
        let raw = r.take(4 * nsym, "frequency table")?;
        let pairs: Vec<(u16, u16)> = raw
            .chunks_exact(4)
            .map(|c| (u16::from_le_bytes([c[0], c[1]]), u16::from_le_bytes([c[2], c[3]])))
            .collect();
        rans::validate_pairs(&pairs, alphabet)?;
        let t = if pairs.is_empty() { DecTable::empty(alphabet) } else { DecTable::new(&pairs, alphabet) };
        slot_sym.extend_from_slice(&t.slot_sym);
        sym_fs.extend_from_slice(&t.sym_fs);
    }
    let mut lane_pos = vec![0usize; lanes];
    let mut lane_end = vec![0usize; lanes];
    let mut lane_len = vec![0usize; lanes];
    for l in lane_len.iter_mut() {
        *l = r.u32("lane length")? as usize;
    }
    let base = r.pos();
    let mut at = base;
    let mut states = vec![0u32; lanes];
    for l in 0..lanes {
        let len = lane_len[l];
        if len < 4 || len % 2 != 0 {
            return corrupt(format!("lane {l} length {len}"));
        }
        let bytes = r.take(len, "lane stream")?;
        states[l] = u32::from_le_bytes(bytes[..4].try_into().unwrap());
        if states[l] < RANS_L {
            return corrupt(format!("lane {l} initial state below the rANS lower bound"));
        }
        lane_pos[l] = at + 4;
        at += len;
        lane_end[l] = at;
    }
    let raw_len = (n * rbits as usize).div_ceil(8);
    let raw = r.take(raw_len, "raw low bits")?;
    if r.remaining() != 0 {
        return corrupt(format!("{} trailing bytes after the chunk", r.remaining()));
    }

    let mut syms = vec![0u16; n];
    let mut dec = LaneDecoder {
        slot_sym: &slot_sym,
        sym_fs: &sym_fs,
        alphabet,
        stream: full,
        max_pos: full.len() - 2,
        states: &mut states,
        pos: &mut lane_pos,
        mask: lanes - 1,
    };
    // The first `stride` units (all of them without context) use context 0.
    let head = if stride == 0 { n } else { stride.min(n) };
    let mut bad = false;
    for (i, s) in syms[..head].iter_mut().enumerate() {
        *s = dec.step(i, 0, &mut bad);
    }
    for i in head..n {
        let ctx = ctx_of[syms[i - stride] as usize] as usize;
        syms[i] = dec.step(i, ctx, &mut bad);
    }
    if bad {
        return corrupt("symbol decoded in an empty context");
    }
    for l in 0..lanes {
        if states[l] != RANS_L || lane_pos[l] != lane_end[l] {
            return corrupt(format!("lane {l} did not end in the initial state"));
        }
    }
    // Put symbols and raw low bits back together.
    let rmask = if rbits == 0 { 0 } else { (1u64 << rbits) - 1 };
    let mut acc: u64 = 0;
    let mut nbits = 0u32;
    let mut rp = 0usize;
    for i in 0..n {
        let mut low = 0u32;
        if rbits > 0 {
            while nbits < rbits {
                acc |= (raw[rp] as u64) << nbits;
                rp += 1;
                nbits += 8;
            }
            low = (acc & rmask) as u32;
            acc >>= rbits;
            nbits -= rbits;
        }
        store::<UB>(out, i, ((syms[i] as u32) << rbits) | low);
    }
    if acc != 0 {
        return corrupt("non-zero padding bits after the raw low bits");
    }
    Ok(())
}

/// The decoder's hot loop state. Indices into the tables are in range by construction: context
/// ids come from `ctx_of` (all < n_ctx), slots are masked to 12 bits, and every symbol in
/// `slot_sym` was validated below the alphabet size when the tables were built.
struct LaneDecoder<'a> {
    slot_sym: &'a [u16],
    sym_fs: &'a [u32],
    alphabet: usize,
    stream: &'a [u8],
    max_pos: usize,
    states: &'a mut [u32],
    pos: &'a mut [usize],
    mask: usize,
}

impl LaneDecoder<'_> {
    #[inline(always)]
    fn step(&mut self, i: usize, ctx: usize, bad: &mut bool) -> u16 {
        let lane = i & self.mask;
        let x = self.states[lane];
        let slot = x & (PROB_SCALE - 1);
        let s = self.slot_sym[ctx * PROB_SCALE as usize + slot as usize];
        let fs = self.sym_fs[ctx * self.alphabet + s as usize];
        let f = fs >> 16;
        // An empty context has frequency 0 everywhere: flag it and let the caller fail after the
        // loop (wrapping arithmetic keeps the meaningless state harmless until then).
        *bad |= f == 0;
        let x = f.wrapping_mul(x >> PROB_BITS).wrapping_add(slot).wrapping_sub(fs & 0xffff);
        // Branch-free refill: always read the next word (clamped inside the stream) and keep it
        // only when the state fell below L. A lane that reads past its own end is caught after
        // the loop, where every lane must end exactly at its end.
        let need = x < RANS_L;
        let p = self.pos[lane];
        let q = p.min(self.max_pos);
        let w = u16::from_le_bytes([self.stream[q], self.stream[q + 1]]) as u32;
        self.states[lane] = if need { (x << 16) | w } else { x };
        self.pos[lane] = p + 2 * need as usize;
        s
    }
}
