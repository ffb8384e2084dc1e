use proptest::prelude::*;
use weightszip_core::codec::{compress, Container, EncodeOptions, KIND_TENSORS, LEVEL_DEFAULT, LEVEL_FAST};
use weightszip_core::{DType, Error, TensorMeta};

fn roundtrip(dtype: DType, shape: Vec<u64>, data: &[u8], opts: &EncodeOptions) -> Vec<u8> {
    let meta = TensorMeta::new(dtype, shape);
    let c = compress(&[(meta.clone(), data)], KIND_TENSORS, opts).unwrap();
    let parsed = Container::parse(&c).unwrap();
    assert_eq!(parsed.index.entries[0].meta, meta);
    parsed.verify(opts.threads).unwrap();
    let back = parsed.decode_entry_vec(0, opts.threads).unwrap();
    assert_eq!(back, data);
    c
}

/// Smooth bf16 data with channel structure: compressible, like real KV.
fn kv_like(tokens: usize, channels: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut out = Vec::with_capacity(tokens * channels * 2);
    for t in 0..tokens {
        for c in 0..channels {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let scale = 1.0 + (c % 7) as f32 * 3.0;
            let noise = ((s >> 40) as f32 / (1u64 << 24) as f32) - 0.5;
            let v = scale * ((t as f32 * 0.01 * (c + 1) as f32).sin() + noise);
            out.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
        }
    }
    out
}

#[test]
fn bf16_kv_like_compresses_and_round_trips() {
    let data = kv_like(512, 192, 7);
    let opts = EncodeOptions { chunk_bytes: 64 << 10, ..Default::default() };
    let c = roundtrip(DType::BF16, vec![512, 192], &data, &opts);
    assert!(c.len() < data.len() * 3 / 4, "{} of {}", c.len(), data.len());
}

#[test]
fn every_lane_count_and_thread_count() {
    let data = kv_like(64, 96, 3);
    for lanes_log2 in [0, 1, 5, 10] {
        for threads in [1, 2] {
            for level in [LEVEL_FAST, LEVEL_DEFAULT] {
                let opts = EncodeOptions { chunk_bytes: 4096, threads, lanes_log2, level };
                roundtrip(DType::BF16, vec![64, 96], &data, &opts);
            }
        }
    }
}

/// The fast level ranks fewer candidate models: it must still round-trip every dtype, and
/// on KV-like bf16 (whose model it is meant for) cost little against the search.
#[test]
fn fast_level_round_trips_and_stays_close_to_the_search() {
    let data = kv_like(2048, 192, 11);
    // 512 KiB chunks: 1365 rows, 262080 units, past the size below which every level searches.
    let fast = EncodeOptions { chunk_bytes: 512 << 10, threads: 1, level: LEVEL_FAST, ..Default::default() };
    let full = EncodeOptions { level: LEVEL_DEFAULT, ..fast };
    let a = roundtrip(DType::BF16, vec![2048, 192], &data, &fast);
    let b = roundtrip(DType::BF16, vec![2048, 192], &data, &full);
    assert!(a.len() < data.len() * 3 / 4, "fast level did not compress: {} of {}", a.len(), data.len());
    assert!(a.len() as f64 <= b.len() as f64 * 1.02, "fast {} against searched {}", a.len(), b.len());
    for dt in weightszip_core::dtype::ALL_DTYPES {
        let bytes: Vec<u8> = (0..96 * 40 * dt.size()).map(|i| (i * 131 % 251) as u8 / 3).collect();
        roundtrip(dt, vec![96, 40], &bytes, &fast);
    }
}

#[test]
fn an_encoder_level_outside_its_range_is_an_invalid_argument() {
    for level in [0u8, 3, 255] {
        let opts = EncodeOptions { level, ..Default::default() };
        let meta = TensorMeta::new(DType::BF16, vec![4, 4]);
        match compress(&[(meta, &[0u8; 32][..])], KIND_TENSORS, &opts) {
            Err(Error::InvalidArgument(m)) => assert!(m.contains("level"), "{m}"),
            other => panic!("level {level}: {other:?}"),
        }
    }
}

#[test]
fn empty_and_scalar_tensors() {
    let opts = EncodeOptions::default();
    roundtrip(DType::BF16, vec![0, 5], &[], &opts);
    roundtrip(DType::F32, vec![], &1.5f32.to_le_bytes(), &opts);
    roundtrip(DType::U8, vec![0], &[], &opts);
}

#[test]
fn constant_data_uses_the_escape_symbol() {
    let data = vec![0u8; 1 << 16];
    // The raw low bits stay: 7 of 16 for bf16, 23 of 32 for fp32; byte-coded types shrink to tables.
    for (dt, most) in [(DType::U8, 0.01), (DType::F8E4M3, 0.01), (DType::BF16, 0.45), (DType::F32, 0.73)] {
        let n = (data.len() / dt.size()) as u64;
        let c = roundtrip(dt, vec![n], &data, &EncodeOptions::default());
        assert!((c.len() as f64) < data.len() as f64 * most, "{dt:?}: {} bytes", c.len());
    }
}

#[test]
fn wrong_byte_count_is_an_argument_error() {
    let meta = TensorMeta::new(DType::BF16, vec![3]);
    match compress(&[(meta, &[0u8; 5][..])], KIND_TENSORS, &EncodeOptions::default()) {
        Err(Error::InvalidArgument(_)) => {}
        other => panic!("{other:?}"),
    }
}

#[test]
fn truncation_and_bit_flips_give_typed_errors() {
    let data = kv_like(32, 64, 11);
    let meta = TensorMeta::new(DType::BF16, vec![32, 64]);
    let opts = EncodeOptions { chunk_bytes: 1024, ..Default::default() };
    let c = compress(&[(meta, &data[..])], KIND_TENSORS, &opts).unwrap();
    for cut in 0..c.len() {
        assert!(Container::parse(&c[..cut]).and_then(|p| p.decode_entry_vec(0, 1)).is_err());
    }
    for bit in 0..c.len() * 8 {
        let mut bad = c.clone();
        bad[bit / 8] ^= 1 << (bit % 8);
        let r = Container::parse(&bad).and_then(|p| p.decode_entry_vec(0, 1));
        assert!(r.is_err(), "flip of bit {bit} went unnoticed");
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn any_bytes_round_trip(
        dt in prop::sample::select(weightszip_core::dtype::ALL_DTYPES.to_vec()),
        n in 0usize..600,
        cols in 1usize..40,
        chunk_kib in 1u64..8,
        lanes_log2 in 0u32..7,
        level in 1u8..=2,
        seed in any::<u64>(),
        sparse in any::<bool>(),
    ) {
        let mut s = seed | 1;
        let bytes: Vec<u8> = (0..n * dt.size()).map(|_| {
            s ^= s << 13; s ^= s >> 7; s ^= s << 17;
            if sparse { (s % 3) as u8 } else { s as u8 }
        }).collect();
        let shape = if n % cols == 0 { vec![(n / cols) as u64, cols as u64] } else { vec![n as u64] };
        let opts = EncodeOptions { chunk_bytes: chunk_kib * 1024, threads: 1, lanes_log2, level };
        roundtrip(dt, shape, &bytes, &opts);
    }

    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..400)) {
        let _ = Container::parse(&bytes).and_then(|p| p.decode_entry_vec(0, 1));
    }

    #[test]
    fn arbitrary_chunk_payloads_never_panic(payload in prop::collection::vec(any::<u8>(), 0..300), n in 0usize..200) {
        let mut out = vec![0u8; n];
        let _ = weightszip_core::chunk::decode_chunk(&payload, &mut out);
    }
}

/// Found by the chunk_decode fuzzer: a group map that leaves the top declared group unused made
/// the decoder's consistency assert fire (a panic on untrusted input).
#[test]
fn unused_top_channel_group_is_not_a_panic() {
    let payload = [
        0x01, 0x08, 0x08, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x01, 0x01, 0x00, 0x00, 0x00,
        0x00, 0x00, 0x04, 0x00, 0x00, 0x00, 0x00, 0x01, 0x60, 0x00,
    ];
    let mut out = vec![0u8; 0x92a2];
    assert!(weightszip_core::chunk::decode_chunk(&payload, &mut out).is_err());
}

/// Row references can restore far more bytes per stored byte than coded symbols can; the encoder
/// must never write a chunk its own reader rejects for exceeding the expansion limit.
#[test]
fn huge_repeated_rows_stay_within_the_expansion_limit() {
    let data = vec![0u8; 64 << 20];
    let opts = EncodeOptions { chunk_bytes: 64 << 20, threads: 1, ..Default::default() };
    roundtrip(DType::I8, vec![16, 4 << 20], &data, &opts);
}
