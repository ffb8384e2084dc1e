//! Single-thread speed of the chunk coder on a raw little-endian file of bf16 values laid out
//! [rows, row_len]: `cargo run --release --example chunk_speed -- FILE ROW_LEN [CHUNK_BYTES]`.
//! A development tool; the figures that count come from benchmarks/.
use std::time::Instant;
use weightszip_core::codec::{encode_chunk_bytes, EncodeOptions};
use weightszip_core::{chunk, DType, TensorMeta};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let data = std::fs::read(&args[1]).expect("read");
    // WZ_ONLY=encode|decode limits the work (for instruction counting with callgrind).
    let only = std::env::var("WZ_ONLY").unwrap_or_default();
    let row: u64 = args[2].parse().unwrap();
    let cb: usize = args.get(3).map(|s| s.parse().unwrap()).unwrap_or(1 << 20);
    let data = &data[..data.len() / (2 * row as usize) * 2 * row as usize];
    let meta = TensorMeta::new(DType::BF16, vec![data.len() as u64 / 2 / row, row]);
    // WZ_LEVEL=1: the encoder's fast level (codec::LEVEL_FAST).
    let level = std::env::var("WZ_LEVEL").ok().and_then(|v| v.parse().ok()).unwrap_or(EncodeOptions::default().level);
    let rows_per = (cb / 2 / row as usize).max(1);
    let step = rows_per * row as usize * 2;
    let t = Instant::now();
    let enc: Vec<_> =
        data.chunks(step).map(|c| encode_chunk_bytes(c, &meta, EncodeOptions::default().lanes_log2, level)).collect();
    let te = t.elapsed().as_secs_f64();
    let stored: usize = enc.iter().map(|c| c.payload.len()).sum();
    let mut out = vec![0u8; step];
    let t = Instant::now();
    for (c, raw) in enc.iter().zip(data.chunks(step)) {
        if only == "encode" {
            break;
        }
        chunk::decode_chunk(&c.payload, &mut out[..raw.len()]).unwrap();
        assert_eq!(&out[..raw.len()], raw);
    }
    let td = t.elapsed().as_secs_f64();
    let mb = data.len() as f64 / 1e6;
    println!("ratio {:.4} encode {:.0} MB/s decode {:.0} MB/s", stored as f64 / data.len() as f64, mb / te, mb / td);
}
