//! Property: no byte string makes the chunk store's reader of a chunk (a file on disk, or a value
//! the remote tier hands back, written by another machine) panic, hang or allocate more than it
//! was given; the file reader and the buffer reader agree; and what they accept is canonical.
//!
//! Input: byte 0 selects the case, the rest is the chunk (docs/STORE.md, `rust/store/src/file.rs`).
//! - bit 0: repair the three checksums (key hash, payload XXH3, header XXH3) when the declared key
//!   fits, so that mutations get past the checksum gates to the checks behind them. Checksums are
//!   integrity checks, not secrets: a hostile writer computes them too.
//! - bits 1-2: the reader's payload limit: unlimited, 0, the declared payload length, or one less.
//!
//! Checked:
//! - `parse_chunk` never panics; when it accepts, `encode_chunk` gives back the very bytes, the
//!   header's file length is the buffer's, and the payload is within the limit;
//! - `read_chunk` of the same bytes in a file gives the same result (the same chunk, or an error of
//!   the same kind);
//! - with the checksums repaired, a well-formed header whose sizes match and whose payload is within
//!   the limit is accepted (the reader refuses nothing else).

#![no_main]

use libfuzzer_sys::fuzz_target;
use std::mem::discriminant;
use weightszip_store::file::{encode_chunk, key_hash, parse_chunk, read_chunk, HEADER_LEN, MAX_KEY_LEN};
use xxhash_rust::xxh3::xxh3_64;

fn u32at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes(b[o..o + 4].try_into().unwrap())
}

fn u64at(b: &[u8], o: usize) -> u64 {
    u64::from_le_bytes(b[o..o + 8].try_into().unwrap())
}

/// Rewrite the checksums of `buf` as a writer would; false when the declared key does not fit.
fn repair(buf: &mut [u8]) -> bool {
    if buf.len() < HEADER_LEN {
        return false;
    }
    let key_len = u32at(buf, 12) as usize;
    if HEADER_LEN + key_len > buf.len() {
        return false;
    }
    let key = buf[HEADER_LEN..HEADER_LEN + key_len].to_vec();
    let hash = key_hash(&key).to_le_bytes();
    buf[32..48].copy_from_slice(&hash);
    let payload_sum = xxh3_64(&buf[HEADER_LEN + key_len..]).to_le_bytes();
    buf[48..56].copy_from_slice(&payload_sum);
    let mut summed = buf[..56].to_vec();
    summed.extend_from_slice(&key);
    let sum = xxh3_64(&summed).to_le_bytes();
    buf[56..64].copy_from_slice(&sum);
    true
}

fuzz_target!(|data: &[u8]| {
    let Some((&sel, rest)) = data.split_first() else {
        return;
    };
    let mut buf = rest.to_vec();
    let repaired = sel & 1 == 1 && repair(&mut buf);
    let declared = if buf.len() >= HEADER_LEN { u64at(&buf, 16) } else { 0 };
    let limit = match (sel >> 1) & 3 {
        0 => u64::MAX,
        1 => 0,
        2 => declared,
        _ => declared.saturating_sub(1),
    };

    let parsed = parse_chunk(&buf, limit);
    if let Ok(c) = &parsed {
        assert_eq!(encode_chunk(&c.header, &c.key, &c.payload), buf, "an accepted chunk is not canonical");
        assert_eq!(c.header.file_len(), buf.len() as u64);
        assert!(c.payload.len() as u64 <= limit, "a payload over the limit was read");
    }

    let path = std::env::temp_dir().join(format!("weightszip-fuzz-store-{}.wzc", std::process::id()));
    std::fs::write(&path, &buf).expect("scratch file");
    let read = read_chunk(&path, limit);
    let _ = std::fs::remove_file(&path);
    match (&parsed, &read) {
        (Ok(a), Ok(Some(b))) => {
            assert!(a.header == b.header && a.key == b.key && a.payload == b.payload)
        }
        (Err(a), Err(b)) => assert_eq!(discriminant(a), discriminant(b), "parse_chunk: {a}; read_chunk: {b}"),
        (a, b) => panic!("parse_chunk and read_chunk disagree: {a:?} / {b:?}"),
    }

    if repaired && buf.len() >= HEADER_LEN {
        let key_len = u32at(&buf, 12) as usize;
        let well_formed = buf[0..4] == *b"WZCK"
            && u16::from_le_bytes([buf[4], buf[5]]) == 1
            && u16::from_le_bytes([buf[6], buf[7]]) == 0
            && (1..=MAX_KEY_LEN).contains(&key_len)
            && ((HEADER_LEN + key_len) as u64).checked_add(declared) == Some(buf.len() as u64)
            && declared <= limit;
        assert_eq!(parsed.is_ok(), well_formed, "{parsed:?}");
    }
});
