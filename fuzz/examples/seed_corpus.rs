//! Writes the seed corpus: a few small, valid inputs per fuzz target, deterministic, all files
//! named `seed-*` (the fuzzer's own additions are git-ignored, see fuzz/.gitignore). Existing
//! `seed-*` files are replaced; re-run it whenever the format or the encoder changes.
//!
//!     cargo run --manifest-path fuzz/Cargo.toml --example seed_corpus -- fuzz/corpus
//!
//! - container_parse/: containers of several dtypes and shapes, with tiny chunk sizes so that each
//!   entry has several chunks: rANS-coded, stored and row-deduplicated ones, plus multi-entry,
//!   empty and 0-d containers.
//! - chunk_decode/:    `[raw length u16 LE] ++ chunk payload`, cut from those containers.
//! - round_trip/:      parameter strings in the layout documented in fuzz_targets/round_trip.rs.
//! - page_decode/:     KV Exact pages in the layout documented in fuzz_targets/page_decode.rs.
//! - kvx4_decode/:     KV Exact4 pages (one, or two with the middle offset between them), with and
//!   without plain rows, in the layout documented in fuzz_targets/kvx4_decode.rs.
//! - store_chunk/:     `[selector] ++ chunk store file` (fuzz_targets/store_chunk.rs): chunks of
//!   raw bytes and of a container, short and long keys, an empty payload.

use std::fs;
use std::path::{Path, PathBuf};

use weightszip_core::chunk::{MODE_RANS, MODE_ROWS, MODE_STORED};
use weightszip_core::codec::{compress, Container, EncodeOptions, KIND_TENSORS};
use weightszip_core::format::{KIND_FILE, LAYOUT_KV};
use weightszip_core::{DType, TensorMeta};

/// (file name, tensors, chunk bytes, lanes_log2, kind)
type Seed = (&'static str, Vec<(TensorMeta, Vec<u8>)>, u64, u32, u8);

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
}

/// Smooth float data, `rows` x `cols` elements (a sine per channel plus noise), as the dtype's bytes.
fn floats(dtype: DType, rows: usize, cols: usize, seed: u64) -> Vec<u8> {
    let mut r = Rng(seed | 1);
    let mut out = Vec::new();
    for t in 0..rows {
        for c in 0..cols {
            let noise = (r.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5;
            // Positive, within a factor of 3 per channel: few distinct sign/exponent symbols.
            let v = (1.0 + (c % 3) as f32) * (1.0 + 0.4 * (t as f32 * 0.05 * (c + 1) as f32).sin() + 0.1 * noise);
            let bits = v.to_bits();
            match dtype {
                DType::BF16 => out.extend_from_slice(&((bits >> 16) as u16).to_le_bytes()),
                DType::F32 => out.extend_from_slice(&bits.to_le_bytes()),
                DType::F16 => {
                    // Crude but valid-looking half: sign, clamped 5-bit exponent, top mantissa bits.
                    let sign = (bits >> 31) as u16;
                    let exp = (((bits >> 23) & 0xff) as i32 - 127 + 15).clamp(0, 30) as u16;
                    let man = ((bits >> 13) & 0x3ff) as u16;
                    out.extend_from_slice(&((sign << 15) | (exp << 10) | man).to_le_bytes());
                }
                DType::F8E4M3 | DType::F8E5M2 => out.push((bits >> 24) as u8 ^ (r.next() & 3) as u8),
                _ => unreachable!(),
            }
        }
    }
    out
}

/// Small-alphabet bytes (compressible), or fully random ones (stored chunks).
fn bytes(n: usize, seed: u64, alphabet: u64) -> Vec<u8> {
    let mut r = Rng(seed | 1);
    (0..n).map(|_| (r.next() % alphabet) as u8).collect()
}

fn counters_i32(n: usize) -> Vec<u8> {
    (0..n as i32).flat_map(|i| (i * 3 - 40).to_le_bytes()).collect()
}

/// Rows (of `len / rows` bytes) repeating with period `period`: row-dedup (MODE_ROWS) chunks.
fn repeat_rows(mut data: Vec<u8>, rows: usize, period: usize) -> Vec<u8> {
    let rb = data.len() / rows;
    for r in period..rows {
        data.copy_within((r % period) * rb..(r % period + 1) * rb, r * rb);
    }
    data
}

fn meta(dtype: DType, shape: &[u64], name: &str) -> TensorMeta {
    let mut m = TensorMeta::new(dtype, shape.to_vec());
    m.name = name.to_string();
    m
}

fn mode_name(m: u8) -> String {
    match m {
        MODE_STORED => "stored".into(),
        MODE_RANS => "rans".into(),
        MODE_ROWS => "rows".into(),
        m => format!("mode{m}"),
    }
}

fn write(dir: &Path, name: &str, data: &[u8]) {
    fs::write(dir.join(name), data).unwrap();
    println!("  {:<40} {:>6} bytes", dir.join(name).display(), data.len());
}

fn main() {
    let root = PathBuf::from(std::env::args().nth(1).unwrap_or_else(|| "corpus".into()));
    let dirs =
        ["container_parse", "chunk_decode", "round_trip", "page_decode", "kvx4_decode", "store_chunk"].map(|t| {
            let d = root.join(t);
            fs::create_dir_all(&d).unwrap();
            // Replace the previous seeds (their names may change); leave the fuzzer's files alone.
            for f in fs::read_dir(&d).unwrap() {
                let f = f.unwrap();
                if f.file_name().to_string_lossy().starts_with("seed-") {
                    fs::remove_file(f.path()).unwrap();
                }
            }
            d
        });

    let mut kv = meta(DType::BF16, &[48, 16], "layer0.k");
    kv.layout = LAYOUT_KV;
    let containers: Vec<Seed> = vec![
        ("bf16-48x16-c512", vec![(kv, floats(DType::BF16, 48, 16, 1))], 512, 0, KIND_TENSORS),
        (
            "f32-16x24-c512-l1",
            vec![(meta(DType::F32, &[16, 24], "w"), floats(DType::F32, 16, 24, 2))],
            512,
            1,
            KIND_TENSORS,
        ),
        (
            "f16-48x16-c512",
            vec![(meta(DType::F16, &[48, 16], "h"), floats(DType::F16, 48, 16, 3))],
            512,
            0,
            KIND_TENSORS,
        ),
        (
            "f8-2x16x32-c256",
            vec![(meta(DType::F8E4M3, &[2, 16, 32], "q"), floats(DType::F8E4M3, 32, 32, 4))],
            256,
            0,
            KIND_TENSORS,
        ),
        ("u8-file-c200", vec![(meta(DType::U8, &[700], ""), bytes(700, 5, 3))], 200, 0, KIND_FILE),
        (
            "bf16-rows-32x16-c512",
            vec![(meta(DType::BF16, &[32, 16], "v0"), repeat_rows(floats(DType::BF16, 32, 16, 8), 32, 3))],
            512,
            0,
            KIND_TENSORS,
        ),
        (
            "multi-i32-u8rand-bf16",
            vec![
                (meta(DType::I32, &[16, 24], "ids"), counters_i32(384)),
                (meta(DType::U8, &[90], "rand"), bytes(90, 6, 256)),
                (meta(DType::BF16, &[6, 10], "v"), floats(DType::BF16, 6, 10, 7)),
            ],
            384,
            0,
            KIND_TENSORS,
        ),
        (
            "empty-and-scalar",
            vec![
                (meta(DType::BF16, &[0, 5], "empty"), vec![]),
                (meta(DType::F64, &[], "scalar"), 2.5f64.to_le_bytes().to_vec()),
                (meta(DType::Bool, &[3], "mask"), vec![1, 0, 1]),
            ],
            16,
            0,
            KIND_TENSORS,
        ),
    ];

    println!("container_parse / chunk_decode:");
    let mut n_chunk_seeds = 0;
    for (name, tensors, chunk_bytes, lanes_log2, kind) in &containers {
        let opts = EncodeOptions { chunk_bytes: *chunk_bytes, threads: 1, lanes_log2: *lanes_log2 };
        let refs: Vec<(TensorMeta, &[u8])> = tensors.iter().map(|(m, d)| (m.clone(), &d[..])).collect();
        let c = compress(&refs, *kind, &opts).unwrap();
        let parsed = Container::parse(&c).unwrap();
        for (ei, (_, d)) in tensors.iter().enumerate() {
            assert_eq!(&parsed.decode_entry_vec(ei, 1).unwrap(), d);
        }
        write(&dirs[0], &format!("seed-{name}.wz"), &c);
        // Chunk payloads: the first of each (entry, mode), length-prefixed.
        let mut modes = [0usize; 256];
        for (ei, e) in parsed.index.entries.iter().enumerate() {
            let mut seen = [false; 256];
            for (k, cr) in e.chunks.iter().enumerate() {
                let payload = &c[cr.offset as usize..cr.offset as usize + cr.stored_len as usize];
                let m = payload[0];
                modes[m as usize] += 1;
                if seen[m as usize] {
                    continue;
                }
                seen[m as usize] = true;
                let (a, b) = e.chunk_raw_range(k);
                let mut seed = ((b - a) as u16).to_le_bytes().to_vec();
                seed.extend_from_slice(payload);
                let file = format!("seed-{name}-e{ei}-k{k}-{}", mode_name(m));
                write(&dirs[1], &file, &seed);
                n_chunk_seeds += 1;
            }
        }
        let counts: Vec<String> = (0..=255u8)
            .filter(|&m| modes[m as usize] > 0)
            .map(|m| format!("{} {}", modes[m as usize], mode_name(m)))
            .collect();
        println!("    ({name}: chunks {})", counts.join(", "));
    }
    assert!(n_chunk_seeds > 0);

    // round_trip parameter strings: global byte, chunk_bytes - 1 (u16 LE), 6 bytes per tensor, pool.
    // t1 = ndim | axis << 2 | mode << 4 | kv << 6 | torch << 7
    let pool: Vec<u8> = (0u8..64).map(|i| i.wrapping_mul(37) ^ 0x5a).collect();
    let rt: Vec<(&str, Vec<u8>)> = vec![
        // 1 tensor, lanes 2^0, chunk 32 bytes, bf16 [16, 8] axis 1, smooth elements.
        ("bf16-16x8-smooth-c32", vec![0x00, 31, 0, 1, 2 | 1 << 2 | 3 << 4, 16, 8, 0, 4]),
        // lanes 2^3, chunk 7 bytes (not a multiple of the element size), f32 [5, 9] axis 0, 2-bit bytes.
        ("f32-5x9-small-c7-l3", vec![3 << 2, 6, 0, 3, 2 | 1 << 4, 5, 9, 0, 0]),
        // 2 tensors, 2 threads: f16 [3, 4, 6] PRNG and u8 [100] raw pool, chunk 50 bytes.
        ("f16-u8-threads-c50", vec![0x01 | 0x40, 49, 0, 2, 3 | 2 << 2 | 2 << 4, 3, 4, 6, 3, 0, 1, 100, 0, 0, 0]),
        // 3 tensors, kind file, lanes 2^10: fp8 e5m2 [64], i64 scalar, bool [0, 4] (empty), chunk 1 byte.
        (
            "fp8-i64-bool-c1-l10",
            vec![
                0x02 | 10 << 2 | 0x80,
                0,
                0,
                5,
                1 | 3 << 4 | 1 << 7,
                64,
                0,
                0,
                7,
                10,
                0,
                0,
                0,
                0,
                2,
                14,
                2 | 1 << 6,
                0,
                4,
                0,
                0,
            ],
        ),
        // i16 [40, 3] axis 0 with the big default-ish chunk (65536 bytes): one chunk.
        ("i16-40x3-c65536", vec![0x00, 0xff, 0xff, 8, 2 | 3 << 4, 40, 3, 0, 5]),
        // bf16 [24, 16] axis 1, smooth, rows repeating with period 2 (t5 bits 4-5), chunk 256 bytes.
        ("bf16-24x16-rows2-c256", vec![0x00, 0xff, 0x00, 1, 2 | 1 << 2 | 3 << 4, 24, 16, 0, 3 | 2 << 4]),
    ];
    println!("round_trip:");
    for (name, mut params) in rt {
        params.extend_from_slice(&pool);
        write(&dirs[2], &format!("seed-{name}"), &params);
    }

    // page_decode: [selector] ++ window tops ++ one KV Exact page (1 or 2 heads of 32 or 64 channels)
    println!("page_decode:");
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for (heads, dims) in [(1usize, 1usize), (2, 1), (1, 2)] {
        let shape = weightszip_core::kvx::Shape::new(heads, 32 * dims).unwrap();
        let c = shape.channels();
        let values: Vec<u8> = (0..16 * c)
            .flat_map(|_| {
                let r = rng.next();
                let e = 124u16.saturating_sub((r % 64).trailing_zeros() as u16 * 2);
                (((r >> 20) as u16 & 0x807F) | (e << 7)).to_le_bytes()
            })
            .collect();
        let bases = weightszip_core::kvx::calibrate_bases(c, &values).unwrap();
        let mut input = vec![(((heads - 1) << 1) | ((dims - 1) << 3)) as u8];
        input.extend_from_slice(&bases);
        weightszip_core::kvx::encode_page(shape, &bases, &values, &mut input).unwrap();
        write(&dirs[3], &format!("seed-kvx-{heads}x{}", 32 * dims), &input);
    }

    // kvx4_decode: [selector] ++ middle offset (u64 LE) ++ one or two KV Exact4 pages (1 to 4 heads
    // of 32 or 64 channels); `tiny` values 2^-60 (one in `tiny` values) make plain rows
    println!("kvx4_decode:");
    let kvx4_seeds = [(1usize, 1usize, 0u64, 1usize), (2, 1, 40, 1), (3, 2, 200, 1), (4, 1, 25, 2), (1, 2, 0, 2)];
    for (heads, dims, tiny, pages) in kvx4_seeds {
        let shape = weightszip_core::kvx4::Shape::new(heads, 32 * dims).unwrap();
        let values: Vec<u8> = (0..pages * 16 * shape.channels())
            .flat_map(|_| {
                let r = rng.next();
                let e = 124u16.saturating_sub((r % 64).trailing_zeros() as u16 * 2);
                let tiny_here = tiny > 0 && (r >> 12).is_multiple_of(tiny);
                let v = if tiny_here { 0x2180 } else { ((r >> 20) as u16 & 0x807F) | (e << 7) };
                v.to_le_bytes()
            })
            .collect();
        let (buf, offs) = weightszip_core::kvx4::encode_pages(shape, &values).unwrap();
        let mut input = vec![((heads - 1) | ((dims - 1) << 2)) as u8];
        input.extend_from_slice(&offs[1].to_le_bytes());
        input.extend_from_slice(&buf);
        let plain = if tiny > 0 { "-plain" } else { "" };
        write(&dirs[4], &format!("seed-kvx4-{heads}x{}-{pages}p{plain}", 32 * dims), &input);
    }
    // store_chunk: [selector] ++ a chunk as the store writes it (header, key, payload); selector 0
    // (checksums as written, no limit) and 5 (repaired, limit = the payload's length)
    println!("store_chunk:");
    let values = vec![0x3fu8; 256];
    let container =
        compress(&[(meta(DType::BF16, &[4, 32], "k"), &values[..])], KIND_TENSORS, &EncodeOptions::default()).unwrap();
    let store_seeds: [(&[u8], u32, &[u8]); 4] = [
        (b"k", 0, b""),
        (b"session-7/layer-3", 0, b"raw payload bytes"),
        (b"c", 1, &container),
        (&[0x5a; 300], 2, &[1, 2, 3]),
    ];
    for (i, (key, tag, payload)) in store_seeds.into_iter().enumerate() {
        let header = weightszip_store::file::Header {
            tag,
            key_len: key.len() as u32,
            payload_len: payload.len() as u64,
            seq: 1 + i as u64,
            key_hash: weightszip_store::file::key_hash(key),
            payload_xxh3: xxhash_rust::xxh3::xxh3_64(payload),
        };
        for sel in [0u8, 5] {
            let mut input = vec![sel];
            input.extend_from_slice(&weightszip_store::file::encode_chunk(&header, key, payload));
            write(&dirs[5], &format!("seed-store-{i}-sel{sel}"), &input);
        }
    }
}
