//! Worker-thread counts: a huge count (a typo, or a hostile caller) is capped at `MAX_THREADS`
//! instead of spawning a thread for each (and batching that many chunks in memory), and the
//! round trip still holds.

use weightszip_core::codec::{compress, with_threads, Container, EncodeOptions, MAX_THREADS};
use weightszip_core::{DType, TensorMeta};

#[test]
fn a_huge_thread_count_is_capped() {
    assert_eq!(with_threads(1_000_000, rayon::current_num_threads), MAX_THREADS);
    assert_eq!(with_threads(3, rayon::current_num_threads), 3);
}

#[test]
fn encode_and_decode_with_a_huge_thread_count_round_trip() {
    let data: Vec<u8> = (0..300_000u32).map(|i| (i.wrapping_mul(2654435761) >> 24) as u8).collect();
    let opts = EncodeOptions { threads: usize::MAX, chunk_bytes: 16 << 10, ..EncodeOptions::default() };
    let meta = TensorMeta::new(DType::U8, vec![data.len() as u64]);
    let enc = compress(&[(meta, &data[..])], 0, &opts).unwrap();
    let c = Container::parse(&enc).unwrap();
    c.verify(usize::MAX).unwrap();
    assert_eq!(c.decode_entry_vec(0, usize::MAX).unwrap(), data);
}
