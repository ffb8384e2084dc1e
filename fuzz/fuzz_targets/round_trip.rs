//! Property: whatever the dtype, shape, channel axis, chunk size, lane count and contents,
//! `compress` -> `Container::parse` -> decode gives back exactly the input bytes; the index
//! re-serialises to the bytes it was parsed from; `verify` passes; and the container does not
//! depend on the number of threads.
//!
//! The input is parsed by hand (missing bytes read as 0) so that seeds are easy to write
//! (`examples/seed_corpus.rs`) and every mutation maps to a valid parameter set:
//!
//! ```text
//! byte 0      bits 0-1: tensor count - 1 (3 means 3), bits 2-5: lanes_log2 (mod 11),
//!             bit 6: encode with 2 threads (and compare with 1), bit 7: container kind file
//! bytes 1-2   chunk_bytes - 1, u16 little endian (chunk_bytes 1..=65536)
//! per tensor, 6 bytes:
//!   t0        dtype (index into ALL_DTYPES, mod 15)
//!   t1        bits 0-1: ndim (0..=3), bits 2-3: channel axis (mod ndim),
//!             bits 4-5: data mode (0 raw pool, 1 2-bit bytes, 2 PRNG, 3 smooth elements),
//!             bit 6: layout KV instead of tensor, bit 7: torch flag
//!   t2 t3 t4  dimensions 0..=255 (the first ndim are used)
//!   t5        bits 0-3: name length, bits 4-5: rows repeat with this period (0: none;
//!             repeated rows make the encoder emit row references, MODE_ROWS)
//! rest        data pool: tensor contents and names are drawn from it
//! ```
//!
//! Tensors are shrunk (largest dimension halved) until they hold at most `MAX_RAW` bytes and the
//! encoder's per-chunk model work stays bounded, so tiny chunk sizes stay cheap to run.

#![no_main]

use libfuzzer_sys::fuzz_target;
use weightszip_core::codec::{chunk_elems_for, compress, Container, EncodeOptions};
use weightszip_core::dtype::ALL_DTYPES;
use weightszip_core::format::{
    parse_trailer, TensorMeta, FLAG_TORCH, KIND_FILE, KIND_TENSORS, LAYOUT_KV, LAYOUT_TENSOR, TRAILER_LEN,
};

const MAX_RAW: u64 = 64 << 10;
/// Bound on chunks x alphabet^2 per tensor (the context model counts pairs of symbols).
const MAX_MODEL_WORK: u64 = 1 << 20;

struct Bytes<'a> {
    d: &'a [u8],
    i: usize,
}

impl Bytes<'_> {
    fn u8(&mut self) -> u8 {
        let b = self.d.get(self.i).copied().unwrap_or(0);
        self.i += 1;
        b
    }
}

fn gen_data(mode: u8, size: usize, nbytes: usize, pool: &[u8], salt: usize) -> Vec<u8> {
    let at = |j: usize| {
        if pool.is_empty() {
            0
        } else {
            pool[(j + salt * 131) % pool.len()]
        }
    };
    match mode {
        0 => (0..nbytes).map(at).collect(),
        1 => (0..nbytes).map(|j| at(j) & 3).collect(),
        2 => {
            let mut s = xxhash_rust::xxh3::xxh3_64_with_seed(pool, salt as u64) | 1;
            (0..nbytes)
                .map(|_| {
                    s ^= s << 13;
                    s ^= s >> 7;
                    s ^= s << 17;
                    (s >> 24) as u8
                })
                .collect()
        }
        _ => {
            // One base element; each element flips bits of its lowest byte only.
            let base: Vec<u8> = (0..size).map(at).collect();
            (0..nbytes).map(|j| if j % size == 0 { base[0] ^ at(size + j / size) } else { base[j % size] }).collect()
        }
    }
}

fn raw_of(meta: &TensorMeta) -> u64 {
    meta.raw_bytes().expect("shapes here are small")
}

fuzz_target!(|data: &[u8]| {
    let mut b = Bytes { d: data, i: 0 };
    let g = b.u8();
    let n_tensors = ((g & 3) as usize).clamp(0, 2) + 1;
    let lanes_log2 = ((g >> 2) & 15) as u32 % 11;
    let two_threads = g & 0x40 != 0;
    let kind = if g & 0x80 != 0 { KIND_FILE } else { KIND_TENSORS };
    let chunk_bytes = u16::from_le_bytes([b.u8(), b.u8()]) as u64 + 1;
    // The default level: every chunk here is under the 2^17 units below which both levels search.
    let opts =
        EncodeOptions { chunk_bytes, threads: if two_threads { 2 } else { 1 }, lanes_log2, ..EncodeOptions::default() };
    let headers: Vec<[u8; 6]> = (0..n_tensors).map(|_| [b.u8(), b.u8(), b.u8(), b.u8(), b.u8(), b.u8()]).collect();
    let pool = data.get(b.i.min(data.len())..).unwrap_or(&[]);

    let mut tensors: Vec<(TensorMeta, Vec<u8>)> = Vec::new();
    for (ti, h) in headers.iter().enumerate() {
        let dtype = ALL_DTYPES[h[0] as usize % ALL_DTYPES.len()];
        let ndim = (h[1] & 3) as usize;
        let mut shape: Vec<u64> = h[2..2 + ndim].iter().map(|&d| d as u64).collect();
        let mut meta = TensorMeta::new(dtype, shape.clone());
        meta.channel_axis = if ndim == 0 { 0 } else { ((h[1] >> 2) & 3) % ndim as u8 };
        meta.layout = if h[1] & 0x40 != 0 { LAYOUT_KV } else { LAYOUT_TENSOR };
        meta.flags = if h[1] & 0x80 != 0 { FLAG_TORCH } else { 0 };
        let name_len = (h[5] & 15) as usize;
        meta.name = String::from_utf8_lossy(&pool[..name_len.min(pool.len())]).into_owned();
        let alphabet = 1u64 << dtype.split().sym_bits;
        loop {
            meta.shape = shape.clone();
            let raw = raw_of(&meta);
            let chunks = if raw == 0 { 0 } else { meta.n_elems().unwrap().div_ceil(chunk_elems_for(&meta, &opts)) };
            if raw <= MAX_RAW && chunks * alphabet * alphabet <= MAX_MODEL_WORK {
                break;
            }
            let big = (0..shape.len()).max_by_key(|&i| shape[i]).unwrap();
            shape[big] /= 2;
        }
        let mode = (h[1] >> 4) & 3;
        let mut bytes = gen_data(mode, dtype.size(), raw_of(&meta) as usize, pool, ti);
        let period = ((h[5] >> 4) & 3) as usize;
        let row = (meta.row_elems() as usize * dtype.size()).min(bytes.len());
        if period > 0 && row > 0 {
            for r in period..bytes.len() / row {
                bytes.copy_within((r % period) * row..(r % period + 1) * row, r * row);
            }
        }
        tensors.push((meta, bytes));
    }

    let refs: Vec<(TensorMeta, &[u8])> = tensors.iter().map(|(m, d)| (m.clone(), &d[..])).collect();
    let c = compress(&refs, kind, &opts).unwrap_or_else(|e| panic!("compress refused valid input: {e}"));
    if two_threads {
        let one = EncodeOptions { threads: 1, ..opts };
        assert!(compress(&refs, kind, &one).unwrap() == c, "output depends on the thread count");
    }

    let parsed = Container::parse(&c).unwrap_or_else(|e| panic!("own container does not parse: {e}"));
    assert_eq!(parsed.index.kind, kind);
    assert_eq!(parsed.index.entries.len(), tensors.len());
    let total = c.len() as u64;
    let (io, il, _) = parse_trailer(&c[(total - TRAILER_LEN) as usize..], total).unwrap();
    assert!(parsed.index.to_bytes() == c[io as usize..(io + il) as usize], "index does not re-serialise to its bytes");
    parsed.verify(opts.threads).unwrap_or_else(|e| panic!("verify failed on own container: {e}"));
    for (ei, (meta, bytes)) in tensors.iter().enumerate() {
        assert_eq!(&parsed.index.entries[ei].meta, meta);
        let back =
            parsed.decode_entry_vec(ei, opts.threads).unwrap_or_else(|e| panic!("entry {ei} does not decode: {e}"));
        assert!(back == *bytes, "entry {ei}: decoded bytes differ from the input");
    }
});
