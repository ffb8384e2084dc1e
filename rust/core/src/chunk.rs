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
use crate::format::MAX_EXPANSION;
use crate::rans::{self, DecTable, EncTable, PROB_BITS, PROB_SCALE, RANS_L};

pub const MODE_STORED: u8 = 0;
pub const MODE_RANS: u8 = 1;
pub const MODE_ROWS: u8 = 2;
/// Dedup pays when at least this fraction (1/16) of a chunk's rows repeat an earlier row: each
/// repeat costs an 8-byte reference. Layer 0's V depends only on the token id, so 77-90% of its
/// rows repeat on real text.
const ROWS_MIN_SHARE: usize = 16;
/// Most contexts one chunk may declare (context ids fit a byte).
pub const MAX_CONTEXTS: usize = 256;
/// Most lanes: 2^10. The GPU decoder runs a thread per lane; 32 lanes are enough on a CPU.
pub const MAX_LANES_LOG2: u32 = 10;
pub const DEFAULT_LANES_LOG2: u32 = 5;
/// Fewest units per lane the encoder allows before it halves the lane count.
const MIN_UNITS_PER_LANE: usize = 256;
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

/// Most channel groups a chunk may declare.
pub const MAX_GROUPS: usize = 16;
/// Longest stride that may carry a channel-group map (the map is `stride` bytes).
pub const MAX_GROUP_STRIDE: usize = 1 << 16;
/// Channel groups the encoder tries for float data. On real bf16 KV, (previous symbol, one of 8
/// groups of channels ranked by mean exponent) costs 0.15-0.22 bits per value less than the
/// previous symbol alone (SmolLM2 and Qwen2.5 K and V); 8 groups keep the tables learnable.
const FLOAT_GROUPS: usize = 8;

/// A context model for one chunk. The context key of unit i (i >= stride) is
/// `sym[i - stride] * n_groups + group[i % stride]`; keys that pay for a table of their own get
/// context ids 1.., the rest (and units i < stride) share context 0.
struct Model {
    stride: usize,
    n_groups: usize,
    /// Channel group of each position in a stride (empty when n_groups == 1).
    groups: Vec<u8>,
    /// (key, context id) for every key listed, keys ascending; unlisted keys use context 0.
    key_ctx: Vec<(u16, u8)>,
    /// Quantised frequencies per context (empty vector: context never used).
    freqs: Vec<Vec<u16>>,
    /// Estimated coded size in bits, tables included.
    est_bits: f64,
    /// Context key of every unit (when built over the whole chunk with a stride).
    keys: Vec<u16>,
}

/// Append the context keys of units a..b: `(sym[i - stride] >> shift) * n_groups + group[i % stride]`, or
/// `none` (no previous unit) for i < stride. `groups` is empty for a single group.
#[allow(clippy::too_many_arguments)]
fn unit_keys(
    syms: &[u16],
    stride: usize,
    groups: &[u8],
    n_groups: usize,
    shift: u32,
    none: usize,
    a: usize,
    b: usize,
    out: &mut Vec<u16>,
) {
    let head = b.min(stride.max(a));
    out.extend(std::iter::repeat_n(none as u16, head - a));
    if head >= b {
        return;
    }
    let prev = &syms[head - stride..b - stride];
    if groups.is_empty() {
        out.extend(prev.iter().map(|&p| p >> shift));
        return;
    }
    // Row segments: within one, the units' channels run on with the previous row's symbols, so
    // each segment is one zip of two slices (which the compiler vectorises).
    out.reserve(prev.len());
    let mut c = head % stride;
    let mut rest = prev;
    while !rest.is_empty() {
        let len = rest.len().min(stride - c);
        let (seg, tail) = rest.split_at(len);
        out.extend(
            seg.iter().zip(&groups[c..c + len]).map(|(&p, &g)| ((p >> shift) as usize * n_groups + g as usize) as u16),
        );
        rest = tail;
        c = 0;
    }
}

fn table_bytes(freqs: &[u16]) -> usize {
    2 + 4 * freqs.iter().filter(|&&f| f > 0).count()
}

/// Chunks of fewer units than this are ranked on all their units, and searched at every level.
const FULL_BELOW: usize = 1 << 17;

/// Up to 8 evenly spread windows covering about 1/8 of `n` units (all of them when small).
fn sample_windows(n: usize) -> Vec<(usize, usize)> {
    if n < FULL_BELOW {
        return vec![(0, n)];
    }
    let w = n / 64;
    (0..8).map(|k| (k * n / 8, k * n / 8 + w)).collect()
}

/// Rank the `stride` channel positions by their mean symbol magnitude (the symbol without its
/// top bit: the exponent for floats) and cut them into `g` equal groups.
fn channel_groups(syms: &[u16], stride: usize, g: usize, sym_bits: u32) -> Vec<u8> {
    let mag_mask = (1u32 << (sym_bits - 1)) - 1;
    let mut sum = vec![0u64; stride];
    for row in syms.chunks(stride) {
        for (acc, &s) in sum.iter_mut().zip(row) {
            *acc += (s as u32 & mag_mask) as u64;
        }
    }
    let mut order: Vec<usize> = (0..stride).collect();
    order.sort_by_key(|&c| (sum[c], c));
    let mut groups = vec![0u8; stride];
    for (rank, &c) in order.iter().enumerate() {
        groups[c] = (rank * g / stride) as u8;
    }
    groups
}

/// The count of each cell of a `n_keys` x `ns` table from units' cell ids (key id in the high
/// half, symbol id in the low). Two tables, for even and odd units, summed after: a run of units
/// in one cell then increments two counters in turn instead of waiting on each store of the same one.
fn count_cells(cells: &[u32], n_keys: usize, ns: usize) -> Vec<u32> {
    let len = n_keys * ns;
    let mut counts = vec![0u32; 2 * len];
    let (even, odd) = counts.split_at_mut(len);
    let mut pairs = cells.chunks_exact(2);
    for p in &mut pairs {
        even[(p[0] >> 16) as usize * ns + (p[0] & 0xffff) as usize] += 1;
        odd[(p[1] >> 16) as usize * ns + (p[1] & 0xffff) as usize] += 1;
    }
    for &c in pairs.remainder() {
        even[(c >> 16) as usize * ns + (c & 0xffff) as usize] += 1;
    }
    for (e, &o) in even.iter_mut().zip(odd.iter()) {
        *e += o;
    }
    counts.truncate(len);
    counts
}

/// Build the model for one stride and grouping from the symbols of `windows` (ranges of unit
/// indices; the context of a unit may lie before its window).
fn build_model(
    syms: &[u16],
    alphabet: usize,
    stride: usize,
    groups: &[u8],
    shift: u32,
    windows: &[(usize, usize)],
) -> Model {
    let n = syms.len();
    let n_groups = if groups.is_empty() { 1 } else { groups.iter().map(|&g| g as usize + 1).max().unwrap_or(1) };
    if stride == 0 || stride >= n {
        let mut counts = vec![0u32; alphabet];
        for &(a, b) in windows {
            for &s in &syms[a..b] {
                counts[s as usize] += 1;
            }
        }
        let f = rans::quantize(&counts).unwrap_or_default();
        let sampled: u64 = counts.iter().map(|&c| c as u64).sum();
        let scale = if sampled > 0 { n as f64 / sampled as f64 } else { 1.0 };
        let est = rans::coded_bits(&counts, &f) * scale + 8.0 * (table_bytes(&f) + 2) as f64;
        return Model {
            stride: 0,
            n_groups: 1,
            groups: vec![],
            key_ctx: vec![],
            freqs: vec![f],
            est_bits: est,
            keys: vec![],
        };
    }
    let none = (alphabet >> shift) * n_groups; // key of units without a previous one
    let mut wkeys: Vec<u16> = Vec::new();
    let mut wsyms: Vec<u16> = Vec::new();
    for &(a, b) in windows {
        unit_keys(syms, stride, groups, n_groups, shift, none, a, b, &mut wkeys);
        wsyms.extend_from_slice(&syms[a..b]);
    }
    // Dense ids for the keys and symbols that occur, so the 2-D count table stays small.
    let mut key_id = vec![u32::MAX; none + 1];
    let mut keys_seen: Vec<usize> = Vec::new();
    let mut sym_id = vec![u32::MAX; alphabet];
    let mut syms_seen: Vec<usize> = Vec::new();
    // Each unit's (key id, symbol id), the key id in the high half: one pass of lookups, then a
    // count pass that reads them in order (keys < 2^15 + 1 and symbols < 2^12 fit).
    let mut cells: Vec<u32> = Vec::with_capacity(wkeys.len());
    for (&k, &s) in wkeys.iter().zip(&wsyms) {
        let mut kid = key_id[k as usize];
        if kid == u32::MAX {
            kid = keys_seen.len() as u32;
            key_id[k as usize] = kid;
            keys_seen.push(k as usize);
        }
        let mut sid = sym_id[s as usize];
        if sid == u32::MAX {
            sid = syms_seen.len() as u32;
            sym_id[s as usize] = sid;
            syms_seen.push(s as usize);
        }
        cells.push(kid << 16 | sid);
    }
    let ns = syms_seen.len();
    let counts = count_cells(&cells, keys_seen.len(), ns);
    let mut global = vec![0u64; ns];
    for row in counts.chunks(ns) {
        for (g, &c) in global.iter_mut().zip(row) {
            *g += c as u64;
        }
    }
    let total: f64 = global.iter().sum::<u64>() as f64;
    // On a sample, scale the coded bits up to the whole chunk so they weigh right against the
    // (fixed) cost of the tables.
    let scale = if total > 0.0 { n as f64 / total } else { 1.0 };
    // Context ids: 0 for units without a previous one, 1..=n_groups for each group's keys that
    // have no table of their own, then one per key whose own table pays for itself.
    let group_of = |key: usize| if key == none { usize::MAX } else { key % n_groups };
    let mut group_counts = vec![vec![0u64; ns]; n_groups];
    for (kid, &key) in keys_seen.iter().enumerate() {
        if key != none {
            for (g, &c) in group_counts[group_of(key)].iter_mut().zip(&counts[kid * ns..(kid + 1) * ns]) {
                *g += c as u64;
            }
        }
    }
    let group_totals: Vec<f64> = group_counts.iter().map(|g| g.iter().sum::<u64>() as f64).collect();
    // Gain of a key's own table: bits saved against its group's distribution, less the table.
    let mut gains: Vec<(f64, usize)> = Vec::new();
    for (kid, &key) in keys_seen.iter().enumerate() {
        if key == none {
            continue;
        }
        let gi = group_of(key);
        let row = &counts[kid * ns..(kid + 1) * ns];
        let nk: u64 = row.iter().map(|&c| c as u64).sum();
        let mut saved = 0.0;
        let mut nsym = 0;
        for (j, &c) in row.iter().enumerate() {
            if c > 0 {
                nsym += 1;
                let p_group = group_counts[gi][j] as f64 / group_totals[gi];
                saved += c as f64 * ((c as f64 / nk as f64) / p_group).log2();
            }
        }
        let gain = saved * scale - 8.0 * (2 + 4 * nsym.max(2)) as f64;
        if gain > 0.0 {
            gains.push((gain, key));
        }
    }
    gains.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap().then(a.1.cmp(&b.1)));
    gains.truncate(MAX_CONTEXTS - 1 - n_groups);
    let mut own: Vec<usize> = gains.iter().map(|&(_, k)| k).collect();
    own.sort_unstable();
    let n_ctx = 1 + n_groups + own.len();
    let mut ctx_counts: Vec<Vec<u32>> = vec![vec![0u32; alphabet]; n_ctx];
    let mut key_ctx: Vec<(u16, u8)> = Vec::new();
    let mut sorted_seen: Vec<(usize, usize)> = keys_seen.iter().enumerate().map(|(kid, &k)| (k, kid)).collect();
    sorted_seen.sort_unstable();
    for &(key, kid) in &sorted_seen {
        let ctx = if key == none {
            0
        } else {
            match own.binary_search(&key) {
                Ok(p) => 1 + n_groups + p,
                Err(_) => 1 + group_of(key),
            }
        };
        if key != none {
            key_ctx.push((key as u16, ctx as u8));
        }
        for (j, &c) in counts[kid * ns..(kid + 1) * ns].iter().enumerate() {
            ctx_counts[ctx][syms_seen[j]] += c;
        }
    }
    let mut est = 8.0 * (3 * key_ctx.len() + 5 + if n_groups > 1 { stride } else { 0 }) as f64;
    let mut freqs = Vec::with_capacity(ctx_counts.len());
    for c in &ctx_counts {
        let f = rans::quantize(c).unwrap_or_default();
        est += rans::coded_bits(c, &f) * scale + 8.0 * table_bytes(&f) as f64;
        freqs.push(f);
    }
    let groups = if n_groups > 1 { groups.to_vec() } else { vec![] };
    let full = windows == [(0, n)];
    Model { stride, n_groups, groups, key_ctx, freqs, est_bits: est, keys: if full { wkeys } else { vec![] } }
}

/// Encode one chunk. `strides` are the context strides (in units) the encoder may choose from;
/// 0 (no context) is always tried.
///
/// With `row_bytes` > 0 the encoder also looks for rows (of that many bytes) that repeat an
/// earlier row of the chunk exactly, and codes them as references (mode ROWS).
///
/// With `search` the candidate models (symbol widths, no context or each stride, channel
/// groupings) are ranked on a sample, and the best built (both widths in full when close); without
/// it only the first stride is ranked, with and without groups, and the sample's choice is built
/// (chunks of fewer than 2^17 units are searched either way).
pub fn encode_chunk(
    data: &[u8],
    split: Split,
    strides: &[usize],
    lanes_log2: u32,
    row_bytes: usize,
    search: bool,
) -> Vec<u8> {
    let plain = encode_units(data, split, strides, lanes_log2, search);
    if row_bytes > 0 && data.len().is_multiple_of(row_bytes) && data.len() / row_bytes >= 4 {
        if let Some(rows) = encode_rows(data, split, strides, lanes_log2, row_bytes, search) {
            // Keep the smaller, and never one a reader must reject: references can restore far
            // more bytes per stored byte than coded symbols can (docs/FORMAT.md, "Limits").
            if rows.len() < plain.len() && (data.len() as u64) <= MAX_EXPANSION * rows.len() as u64 {
                return rows;
            }
        }
    }
    plain
}

/// Mode ROWS, when enough rows repeat: references for the repeats, then the unique rows coded
/// as one ordinary payload (STORED or RANS).
fn encode_rows(
    data: &[u8],
    split: Split,
    strides: &[usize],
    lanes_log2: u32,
    row_bytes: usize,
    search: bool,
) -> Option<Vec<u8>> {
    let n_rows = data.len() / row_bytes;
    let mut first: std::collections::HashMap<&[u8], u32> = std::collections::HashMap::with_capacity(n_rows);
    let mut refs: Vec<(u32, u32)> = Vec::new();
    let mut unique: Vec<u8> = Vec::new();
    for (i, row) in data.chunks_exact(row_bytes).enumerate() {
        match first.entry(row) {
            std::collections::hash_map::Entry::Occupied(e) => refs.push((i as u32, *e.get())),
            std::collections::hash_map::Entry::Vacant(e) => {
                e.insert(i as u32);
                unique.extend_from_slice(row);
            }
        }
    }
    if refs.len() * ROWS_MIN_SHARE < n_rows {
        return None;
    }
    let mut out = Vec::with_capacity(13 + 8 * refs.len() + unique.len() / 2);
    out.push(MODE_ROWS);
    put_u32(&mut out, row_bytes as u32);
    put_u32(&mut out, n_rows as u32);
    put_u32(&mut out, refs.len() as u32);
    for &(row, src) in &refs {
        put_u32(&mut out, row);
        put_u32(&mut out, src);
    }
    out.extend_from_slice(&encode_units(&unique, split, strides, lanes_log2, search));
    (out.len() <= data.len()).then_some(out)
}

fn encode_units(data: &[u8], split: Split, strides: &[usize], lanes_log2: u32, search: bool) -> Vec<u8> {
    match split.unit_bits {
        8 => encode_impl::<1>(data, split, strides, lanes_log2, search),
        16 => encode_impl::<2>(data, split, strides, lanes_log2, search),
        32 => encode_impl::<4>(data, split, strides, lanes_log2, search),
        b => panic!("unit of {b} bits"),
    }
}

fn stored(data: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(data.len() + 1);
    out.push(MODE_STORED);
    out.extend_from_slice(data);
    out
}

/// The best candidate of one symbol width: (estimated total bits, symbol bits, context shift,
/// stride, channel groups, symbols).
type Finalist = (f64, u32, u32, usize, Vec<u8>, Vec<u16>);

fn encode_impl<const UB: usize>(
    data: &[u8],
    split: Split,
    strides: &[usize],
    lanes_log2: u32,
    search: bool,
) -> Vec<u8> {
    assert_eq!(data.len() % UB, 0);
    assert!(split.sym_bits >= 1 && split.sym_bits <= MAX_SYM_BITS);
    assert!(lanes_log2 <= MAX_LANES_LOG2);
    let n = data.len() / UB;
    // A small chunk is always searched: it is cheap in absolute terms, and there the tables weigh
    // most against the coded bits (one fixed model cost 5-10% on SmolLM2's K and V of 37k units).
    let search = search || n < FULL_BELOW;
    // Symbol widths to try: the dtype's (sign and exponent for floats) and, for floats, two more
    // mantissa bits with the context still keyed on sign and exponent (ctx_shift 2): on real
    // weights the mantissa's top bits given the exponent carry 0.05-0.09 bits.
    let mut widths = vec![(split.sym_bits, 0u32)];
    if split.grouped && split.sym_bits + 2 <= MAX_SYM_BITS.min(split.unit_bits) {
        widths.push((split.sym_bits + 2, 2));
    }
    // Candidate contexts: no context and every stride, each stride also with channel groups where
    // the data are floats. Without a search, only the first stride (the previous row, for
    // tensors), with and without groups: groups pay within one layer's rows and cost where a
    // chunk mixes layers (an LMCache chunk [2, layers, 256, channels]).
    let strides = if search { strides } else { &strides[..strides.len().min(1)] };
    // Choose on a sample (the model estimate is a sum over units, so a spread-out sample ranks
    // the candidates the same way), then build the chosen model on every unit.
    let sample = sample_windows(n);
    // Best candidate per symbol width: (estimated bits, stride, groups, symbols).
    let mut finalists: Vec<Finalist> = Vec::new();
    for &(sym_bits, shift) in &widths {
        let rbits = split.unit_bits - sym_bits;
        let alphabet = 1usize << sym_bits;
        let syms: Vec<u16> = (0..n).map(|i| (load::<UB>(data, i) >> rbits) as u16).collect();
        let no_context = || build_model(&syms, alphabet, 0, &[], shift, &sample).est_bits;
        let usable = strides.iter().any(|&st| st != 0 && st < n);
        let mut best = (if search || !usable { no_context() } else { f64::INFINITY }, 0usize, Vec::new());
        for &st in strides {
            if st == 0 || st >= n {
                continue;
            }
            let mut choices = vec![Vec::new()];
            if split.grouped && (2 * FLOAT_GROUPS..=MAX_GROUP_STRIDE).contains(&st) {
                choices.push(channel_groups(&syms, st, FLOAT_GROUPS, sym_bits));
            }
            for g in choices {
                let est = build_model(&syms, alphabet, st, &g, shift, &sample).est_bits;
                if est < best.0 {
                    best = (est, st, g);
                }
            }
        }
        finalists.push((best.0 + (n * rbits as usize) as f64, sym_bits, shift, best.1, best.2, syms));
    }
    // A sample sees fewer of the rare symbols, so it underestimates the tables of the wider
    // alphabet: when the wider width looks better, build both in full and keep the smaller
    // (without a search, the sample's choice stands).
    if finalists.len() == 2 {
        if finalists[1].0 >= finalists[0].0 {
            finalists.truncate(1);
        } else if !search || finalists[1].0 < 0.98 * finalists[0].0 {
            // A margin of 2% is far beyond what the tables' underestimate can close.
            finalists.remove(0);
        }
    }
    let mut chosen: Option<(f64, u32, u32, Model, Vec<u16>)> = None;
    for (_, sym_bits, shift, stride, groups, syms) in finalists {
        let m = build_model(&syms, 1usize << sym_bits, stride, &groups, shift, &[(0, n)]);
        let total = m.est_bits + (n * (split.unit_bits - sym_bits) as usize) as f64;
        if chosen.as_ref().is_none_or(|c| total < c.0) {
            chosen = Some((total, sym_bits, shift, m, syms));
        }
    }
    let (_, sym_bits, shift, best, syms) = chosen.expect("at least one candidate");
    let split = Split { sym_bits, ..split };
    let rbits = split.raw_bits();
    let alphabet = 1usize << sym_bits;
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
    // Each lane costs 8 bytes (its length and final state): small chunks (a 16-token page is a
    // few thousand units) get one lane per 256 units at most.
    while lanes_log2 > 0 && (n >> lanes_log2) < MIN_UNITS_PER_LANE {
        lanes_log2 -= 1;
    }
    let lanes = 1usize << lanes_log2;
    let g = best.n_groups;
    let mut ctx_of = vec![0u8; (alphabet >> shift) * g];
    for &(key, c) in &best.key_ctx {
        ctx_of[key as usize] = c;
    }
    // Flat encoder table: entry ctx * alphabet + symbol.
    let mut enc: Vec<rans::EncSym> = Vec::with_capacity(best.freqs.len() * alphabet);
    for f in &best.freqs {
        if f.is_empty() {
            enc.extend(std::iter::repeat_n(rans::EncSym::default(), alphabet));
        } else {
            enc.extend_from_slice(&EncTable::new(f).syms);
        }
    }
    let stride = best.stride;
    let mask = lanes - 1;
    // Context of every unit, computed forwards (it only reads symbols).
    // `keys` holds `none` = alphabet * g for units without a previous one: context 0.
    ctx_of.push(0);
    let ctx: Vec<u8> = if stride > 0 { best.keys.iter().map(|&k| ctx_of[k as usize]).collect() } else { vec![0u8; n] };
    let mut states = vec![RANS_L; lanes];
    // Each symbol emits at most one word, so a lane never needs more than its symbol count.
    let per_lane = n.div_ceil(lanes);
    let mut words = vec![0u16; lanes * per_lane];
    let mut counts = vec![0usize; lanes];
    for i in (0..n).rev() {
        let lane = i & mask;
        let es = &enc[ctx[i] as usize * alphabet + syms[i] as usize];
        let base = lane * per_lane;
        let x = states[lane];
        // Renormalise without a branch (it goes either way about as often): the low half is
        // always written at the lane's next place, which counts only when the word is emitted.
        let emit = x >= es.x_max;
        let c = counts[lane];
        words[base + c] = x as u16;
        counts[lane] = c + emit as usize;
        states[lane] = rans::enc_step(if emit { x >> 16 } else { x }, es);
    }

    let mut out = Vec::with_capacity(raw_bytes + n / 2 + 4096);
    out.push(MODE_RANS);
    out.push(split.unit_bits as u8);
    out.push(split.sym_bits as u8);
    out.push(shift as u8);
    out.push(lanes_log2 as u8);
    put_u32(&mut out, stride as u32);
    out.push(g as u8);
    out.extend_from_slice(&best.groups);
    put_u16(&mut out, best.freqs.len() as u16);
    put_u16(&mut out, best.key_ctx.len() as u16);
    for &(key, c) in &best.key_ctx {
        put_u16(&mut out, key);
        out.push(c);
    }
    for f in &best.freqs {
        let present: Vec<(usize, u16)> = f.iter().enumerate().filter(|(_, &q)| q > 0).map(|(s, &q)| (s, q)).collect();
        put_u16(&mut out, present.len() as u16);
        for (s, q) in present {
            put_u16(&mut out, s as u16);
            put_u16(&mut out, q);
        }
    }
    for &c in &counts {
        put_u32(&mut out, (4 + 2 * c) as u32);
    }
    for lane in 0..lanes {
        put_u32(&mut out, states[lane]);
        let w = &words[lane * per_lane..lane * per_lane + counts[lane]];
        out.extend(w.iter().rev().flat_map(|x| x.to_le_bytes()));
    }
    if std::env::var_os("WZ_DEBUG").is_some() {
        let tbytes: usize = best.freqs.iter().map(|f| table_bytes(f)).sum();
        let lane_bytes: usize = counts.iter().map(|c| 4 + 2 * c).sum();
        eprintln!(
            "chunk n={n} stride={stride} groups={g} ctx={} table_bytes={tbytes} sym_bits/unit={:.3} est={:.3}",
            best.freqs.len(),
            lane_bytes as f64 * 8.0 / n as f64,
            best.est_bits / n as f64
        );
    }
    pack_low_bits::<UB>(data, n, rbits, &mut out);
    if out.len() > data.len() {
        return stored(data);
    }
    out
}

/// Append the low `rbits` bits of every unit, least significant bit first.
fn pack_low_bits<const UB: usize>(data: &[u8], n: usize, rbits: u32, out: &mut Vec<u8>) {
    if rbits == 0 {
        return;
    }
    let len = (n * rbits as usize).div_ceil(8);
    out.reserve(len);
    let mask = (1u64 << rbits) - 1;
    // A 64-bit accumulator, flushed 32 bits at a time (rbits <= 31, so a unit's bits always fit
    // beside fewer than 32 pending ones): no read-modify-write of memory per unit, whose
    // overlapping 8-byte windows defeated store forwarding.
    let (mut acc, mut pending) = (0u64, 0u32);
    for i in 0..n {
        acc |= (load::<UB>(data, i) as u64 & mask) << pending;
        pending += rbits;
        if pending >= 32 {
            out.extend_from_slice(&(acc as u32).to_le_bytes());
            acc >>= 32;
            pending -= 32;
        }
    }
    out.extend_from_slice(&acc.to_le_bytes()[..pending.div_ceil(8) as usize]);
}

/// Read the low bits of unit `i` from the packed raw section (see `pack_low_bits`).
#[inline(always)]
fn low_bits(raw: &[u8], i: usize, rbits: u32, mask: u64) -> u32 {
    let bit = i * rbits as usize;
    let at = bit >> 3;
    let v = if at + 8 <= raw.len() {
        u64::from_le_bytes(raw[at..at + 8].try_into().unwrap())
    } else {
        let mut b = [0u8; 8];
        b[..raw.len() - at].copy_from_slice(&raw[at..]);
        u64::from_le_bytes(b)
    };
    ((v >> (bit & 7)) & mask) as u32
}

/// Decode one chunk payload into `out`, whose length is the chunk's raw length.
pub fn decode_chunk(payload: &[u8], out: &mut [u8]) -> Result<()> {
    if payload.first() == Some(&MODE_ROWS) {
        return decode_rows(payload, out);
    }
    decode_units(payload, out)
}

fn decode_rows(payload: &[u8], out: &mut [u8]) -> Result<()> {
    let mut r = Reader::new(payload);
    r.u8("chunk mode")?;
    let row_bytes = r.u32("row bytes")? as usize;
    let n_rows = r.u32("row count")? as usize;
    let n_refs = r.u32("reference count")? as usize;
    if row_bytes == 0 || n_rows.checked_mul(row_bytes) != Some(out.len()) {
        return corrupt(format!("{n_rows} rows of {row_bytes} bytes in a {}-byte chunk", out.len()));
    }
    if n_refs > n_rows || 8 * n_refs > r.remaining() {
        return corrupt(format!("{n_refs} row references"));
    }
    let mut refs = Vec::with_capacity(n_refs);
    let mut prev: i64 = -1;
    for _ in 0..n_refs {
        let row = r.u32("referencing row")? as usize;
        let src = r.u32("referenced row")? as usize;
        if row as i64 <= prev || row >= n_rows || src >= row {
            return corrupt("row references out of order or out of range");
        }
        prev = row as i64;
        refs.push((row, src));
    }
    for &(_, src) in &refs {
        if refs.binary_search_by_key(&src, |&(row, _)| row).is_ok() {
            return corrupt("a row reference points at another reference");
        }
    }
    let inner = &payload[r.pos()..];
    if inner.first() == Some(&MODE_ROWS) {
        return corrupt("nested row references");
    }
    let mut unique = vec![0u8; (n_rows - n_refs) * row_bytes];
    decode_units(inner, &mut unique)?;
    let mut next_ref = 0;
    let mut u = 0;
    for row in 0..n_rows {
        let at = row * row_bytes;
        if next_ref < refs.len() && refs[next_ref].0 == row {
            let src = refs[next_ref].1 * row_bytes;
            out.copy_within(src..src + row_bytes, at);
            next_ref += 1;
        } else {
            out[at..at + row_bytes].copy_from_slice(&unique[u..u + row_bytes]);
            u += row_bytes;
        }
    }
    Ok(())
}

fn decode_units(payload: &[u8], out: &mut [u8]) -> Result<()> {
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
    if !out.len().is_multiple_of(UB) {
        return corrupt("chunk length is not a whole number of units");
    }
    let n = out.len() / UB;
    let sym_bits = r.u8("symbol bits")? as u32;
    if sym_bits == 0 || sym_bits > MAX_SYM_BITS || sym_bits > 8 * UB as u32 {
        return corrupt(format!("symbol bits {sym_bits} out of range"));
    }
    let rbits = 8 * UB as u32 - sym_bits;
    let alphabet = 1usize << sym_bits;
    let shift = r.u8("context shift")? as u32;
    if shift >= sym_bits {
        return corrupt(format!("context shift {shift} of {sym_bits}-bit symbols"));
    }
    let lanes_log2 = r.u8("lanes")? as u32;
    if lanes_log2 > MAX_LANES_LOG2 {
        return corrupt(format!("2^{lanes_log2} lanes is more than 2^{MAX_LANES_LOG2}"));
    }
    let lanes = 1usize << lanes_log2;
    let stride = r.u32("context stride")? as usize;
    let n_groups = r.u8("channel groups")? as usize;
    if n_groups == 0 || n_groups > MAX_GROUPS || (n_groups > 1 && (stride == 0 || stride > MAX_GROUP_STRIDE)) {
        return corrupt(format!("{n_groups} channel groups with context stride {stride}"));
    }
    // Copied out of the input (at most MAX_GROUP_STRIDE bytes): the hot loop indexes with it
    // unchecked, and a caller's buffer (a numpy array, a bytearray) may be written by another
    // thread while the GIL is released; checks made on the copy stay true.
    let groups: Vec<u8> = if n_groups > 1 { r.take(stride, "channel group map")?.to_vec() } else { Vec::new() };
    if groups.iter().any(|&g| g as usize >= n_groups) {
        return corrupt("channel group out of range");
    }
    let n_keys = (alphabet >> shift) * n_groups;
    let n_ctx = r.u16("context count")? as usize;
    if n_ctx == 0 || n_ctx > MAX_CONTEXTS || n_ctx > n_keys + 1 {
        return corrupt(format!("{n_ctx} contexts"));
    }
    if stride != 0 && stride < lanes {
        return corrupt(format!("context stride {stride} is shorter than the {lanes} lanes"));
    }
    let n_listed = r.u16("listed keys")? as usize;
    if n_listed > n_keys {
        return corrupt(format!("{n_listed} keys listed of {n_keys}"));
    }
    // Each listed key takes 3 bytes and each table at least 2: check before allocating.
    if r.remaining() < 3 * n_listed + 2 * n_ctx {
        return truncated("context keys and tables");
    }
    let mut ctx_of = vec![0u8; n_keys];
    let mut prev: i32 = -1;
    for _ in 0..n_listed {
        let key = r.u16("context key")?;
        let c = r.u8("context id")?;
        if key as i32 <= prev || key as usize >= n_keys || c as usize >= n_ctx {
            return corrupt("context keys out of order or out of range");
        }
        prev = key as i32;
        ctx_of[key as usize] = c;
    }
    let mut slot_sym: Vec<u16> = Vec::with_capacity(n_ctx * PROB_SCALE as usize);
    let mut sym_fs: Vec<u32> = Vec::with_capacity(n_ctx * alphabet);
    for _ in 0..n_ctx {
        let nsym = r.u16("table size")? as usize;
        if nsym > alphabet {
            return corrupt("frequency table larger than the alphabet");
        }
        let raw = r.take(4 * nsym, "frequency table")?;
        let pairs: Vec<(u16, u16)> =
            raw.chunks_exact(4).map(|c| (u16::from_le_bytes([c[0], c[1]]), u16::from_le_bytes([c[2], c[3]]))).collect();
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
        if len < 4 || !len.is_multiple_of(2) {
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
    let ok = decode_symbols(
        &DecodeTables {
            slot_sym: &slot_sym,
            sym_fs: &sym_fs,
            alphabet,
            ctx_of: &ctx_of,
            groups: &groups,
            n_groups,
            shift,
        },
        full,
        stride,
        &mut states,
        &mut lane_pos,
        &mut syms,
    );
    if !ok {
        return corrupt("symbol decoded in an empty context");
    }
    for l in 0..lanes {
        if states[l] != RANS_L || lane_pos[l] != lane_end[l] {
            return corrupt(format!("lane {l} did not end in the initial state"));
        }
    }
    // Put symbols and raw low bits back together.
    if rbits == 0 {
        for (i, &sym) in syms.iter().enumerate() {
            store::<UB>(out, i, sym as u32);
        }
        return Ok(());
    }
    let used = n * rbits as usize;
    if !used.is_multiple_of(8) && raw[raw.len() - 1] >> (used % 8) != 0 {
        return corrupt("non-zero padding bits after the raw low bits");
    }
    let rmask = (1u64 << rbits) - 1;
    for (i, &sym) in syms.iter().enumerate() {
        store::<UB>(out, i, ((sym as u32) << rbits) | low_bits(raw, i, rbits, rmask));
    }
    Ok(())
}

/// Validated decoder tables of one chunk.
struct DecodeTables<'a> {
    /// ctx * 4096 + slot -> symbol.
    slot_sym: &'a [u16],
    /// ctx * alphabet + symbol -> freq << 16 | start (freq 0: symbol absent / empty context).
    sym_fs: &'a [u32],
    alphabet: usize,
    /// context key (previous symbol * groups + channel group) -> context id.
    ctx_of: &'a [u8],
    /// channel group of each position in a stride; empty for a single group.
    groups: &'a [u8],
    /// number of channel groups declared (the map need not use every group).
    n_groups: usize,
    /// low symbol bits left out of the context key.
    shift: u32,
}

/// The hot loop: decode every symbol of a chunk, unit i from lane i mod L. Returns false if a
/// symbol was decoded in an empty context. A lane that runs past its stream reads (clamped,
/// in-bounds) garbage and is caught by the caller, which requires every lane to end exactly at
/// its end in state L.
///
/// Indexing is unchecked where the invariants below make it safe:
/// - `ctx_of` has `alphabet` entries, each < n_ctx; every decoded symbol is < alphabet (tables
///   are built from validated (symbol, freq) pairs, and an empty context yields symbol 0);
/// - `slot_sym` has n_ctx * 4096 entries and slots are masked to 12 bits;
/// - `sym_fs` has n_ctx * alphabet entries;
/// - lanes = states.len() = pos.len() is a power of two; stream reads are clamped to len - 2.
fn decode_symbols(
    t: &DecodeTables,
    stream: &[u8],
    stride: usize,
    states: &mut [u32],
    pos: &mut [usize],
    syms: &mut [u16],
) -> bool {
    let n = syms.len();
    let lanes = states.len();
    let mask = lanes - 1;
    let max_pos = stream.len() - 2;
    let g = t.n_groups;
    let shift = t.shift;
    assert!(
        shift < 16
            && t.ctx_of.len() == (t.alphabet >> shift) * g
            && t.sym_fs.len() * PROB_SCALE as usize == t.slot_sym.len() * t.alphabet
    );
    assert!(pos.len() == lanes && lanes.is_power_of_two() && stream.len() >= 2);
    let mut bad = false;
    let mut step = |i: usize, ctx: usize, syms: &mut [u16]| unsafe {
        let lane = i & mask;
        let x = *states.get_unchecked(lane);
        let slot = x & (PROB_SCALE - 1);
        let s = *t.slot_sym.get_unchecked(ctx * PROB_SCALE as usize + slot as usize);
        let fs = *t.sym_fs.get_unchecked(ctx * t.alphabet + s as usize);
        let f = fs >> 16;
        bad |= f == 0;
        let x = f.wrapping_mul(x >> PROB_BITS).wrapping_add(slot).wrapping_sub(fs & 0xffff);
        // Branch-free refill: always read the next word, keep it only if the state fell below L.
        let p = *pos.get_unchecked(lane);
        let q = p.min(max_pos);
        let w = u16::from_le_bytes([*stream.get_unchecked(q), *stream.get_unchecked(q + 1)]) as u32;
        // Arithmetic, not `if`: the compiler turns an `if` into a branch that mispredicts on
        // about one step in six.
        let need = (x < RANS_L) as u32;
        *states.get_unchecked_mut(lane) = (x << (need << 4)) | (w & need.wrapping_neg());
        *pos.get_unchecked_mut(lane) = p + 2 * need as usize;
        *syms.get_unchecked_mut(i) = s;
    };
    let head = if stride == 0 { n } else { stride.min(n) };
    for i in 0..head {
        step(i, 0, syms);
    }
    if t.groups.is_empty() {
        for i in head..n {
            // SAFETY: i - stride < i < n; symbols are < alphabet = ctx_of.len().
            let ctx = unsafe { *t.ctx_of.get_unchecked((*syms.get_unchecked(i - stride) >> shift) as usize) } as usize;
            step(i, ctx, syms);
        }
    } else {
        assert!(t.groups.len() == stride && t.groups.iter().all(|&x| (x as usize) < g));
        let mut c = 0usize; // i % stride, for i from head = stride
        for i in head..n {
            // SAFETY: c < stride = groups.len(); key = sym * g + group < alphabet * g.
            let ctx = unsafe {
                let key = (*syms.get_unchecked(i - stride) >> shift) as usize * g + *t.groups.get_unchecked(c) as usize;
                *t.ctx_of.get_unchecked(key)
            } as usize;
            step(i, ctx, syms);
            c += 1;
            if c == stride {
                c = 0;
            }
        }
    }
    !bad
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `unit_keys` against a unit-at-a-time reference of its formula, for windows that start and
    /// end inside rows, before the first full row and across many rows, with and without groups.
    #[test]
    fn unit_keys_match_the_formula_unit_by_unit() {
        let syms: Vec<u16> = (0..1000u32).map(|i| (i.wrapping_mul(2654435761) >> 21) as u16).collect();
        for &(stride, n_groups) in &[(1usize, 1usize), (7, 1), (7, 3), (64, 4), (999, 2), (1000, 1)] {
            let groups: Vec<u8> =
                if n_groups > 1 { (0..stride).map(|c| (c * 5 % n_groups) as u8).collect() } else { vec![] };
            let (shift, none) = (2u32, 60_000usize);
            for &(a, b) in &[
                (0usize, 1000usize),
                (0, 3),
                (5, 6),
                (3, 500),
                (stride.min(999), 1000),
                (998, 1000),
                (400, 400),
                (10, 500),
                (130, 900),
            ] {
                let mut got = Vec::new();
                unit_keys(&syms, stride, &groups, n_groups, shift, none, a, b, &mut got);
                let want: Vec<u16> = (a..b)
                    .map(|i| {
                        if i < stride {
                            none as u16
                        } else {
                            let g = if groups.is_empty() { 0 } else { groups[i % stride] as usize };
                            ((syms[i - stride] >> shift) as usize * n_groups + g) as u16
                        }
                    })
                    .collect();
                assert_eq!(got, want, "stride {stride} groups {n_groups} window {a}..{b}");
            }
        }
    }

    /// `count_cells` against one counter per cell, for odd and even unit counts.
    #[test]
    fn cell_counts_equal_a_plain_count() {
        for n in [0usize, 1, 2, 3, 1001] {
            let cells: Vec<u32> = (0..n as u32).map(|i| (i * 7 % 5) << 16 | (i * 3 % 4)).collect();
            let mut want = vec![0u32; 5 * 4];
            for &c in &cells {
                want[(c >> 16) as usize * 4 + (c & 0xffff) as usize] += 1;
            }
            assert_eq!(count_cells(&cells, 5, 4), want, "{n} units");
        }
    }

    /// `pack_low_bits` against a bit-at-a-time packer, for every unit width and low-bit count and
    /// unit counts around the 32-bit flush boundaries; `low_bits` reads every unit back.
    #[test]
    fn low_bits_pack_like_a_bit_at_a_time_packer() {
        fn check<const UB: usize>(data: &[u8]) {
            for rbits in 1..(8 * UB as u32) {
                for n in [0, 1, 2, 3, 31, 32, 33, 63, 64, 65, data.len() / UB] {
                    let mut want = vec![0u8; (n * rbits as usize).div_ceil(8)];
                    for i in 0..n {
                        let v = load::<UB>(data, i);
                        for b in 0..rbits as usize {
                            let bit = i * rbits as usize + b;
                            want[bit / 8] |= (((v >> b) & 1) as u8) << (bit % 8);
                        }
                    }
                    let mut got = vec![0xAA]; // bytes already in the payload stay in front
                    pack_low_bits::<UB>(data, n, rbits, &mut got);
                    assert_eq!(got[0], 0xAA);
                    assert_eq!(&got[1..], &want[..], "UB {UB} rbits {rbits} n {n}");
                    let mask = (1u64 << rbits) - 1;
                    for i in 0..n {
                        assert_eq!(low_bits(&want, i, rbits, mask) as u64, load::<UB>(data, i) as u64 & mask);
                    }
                }
            }
        }
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let data: Vec<u8> = (0..4 * 203)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect();
        check::<1>(&data);
        check::<2>(&data);
        check::<4>(&data);
    }
}
