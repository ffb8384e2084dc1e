//! Speed of the exact page codec on one thread and several (a quick check; the benchmark with
//! peers is benchmarks/bench_page_versions.py --cpu-speed):
//! `cargo run --release -p weightszip-core --example page_speed -- VALUES.bin CHANNELS`
//! (bf16 values, little endian, tokens x channels; the first half calibrates, the second is coded).
use std::time::Instant;
use weightszip_core::page::*;

fn median(mut f: impl FnMut()) -> f64 {
    let mut ts: Vec<f64> = (0..21)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    ts.sort_by(|a, b| a.total_cmp(b));
    ts[10]
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let data = std::fs::read(&args[1]).expect("VALUES.bin");
    let ch: usize = args[2].parse().expect("CHANNELS");
    let pr = 2 * PAGE_TOKENS * ch;
    let half = data.len() / 2 / pr * pr;
    let vals = &data[half..2 * half];
    for version in [CODEBOOK_VERSION, CODEBOOK_VERSION_CLASSES] {
        let cb = PageCodebook::calibrate_version(version, DTYPE_BF16, ch, &data[..half], 8).unwrap();
        for threads in [1usize, 0] {
            let te = median(|| {
                std::hint::black_box(encode_pages_threads(&cb, vals, 8, threads).unwrap());
            });
            let (buf, offs) = encode_pages(&cb, vals, 8).unwrap();
            let mut out = vec![0u8; vals.len()];
            let td = median(|| decode_pages_threads(&cb, &buf, &offs, &mut out, threads).unwrap());
            assert!(out == vals);
            let mb = |t: f64| vals.len() as f64 / t / 1e6;
            println!("version {version}, threads {threads}: encode {:.0} MB/s, decode {:.0} MB/s", mb(te), mb(td));
        }
    }
}
