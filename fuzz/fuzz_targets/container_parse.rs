//! Property: no byte string makes the container reader or the entry decoder panic, hang or
//! allocate without bound; and a reader that accepts a container decodes it consistently.
//!
//! Every input is tried twice:
//!
//! 1. As-is: `Container::parse`, then every entry is decoded (entries over `MAX_ENTRY_RAW` bytes
//!    are skipped so one input cannot ask for gigabytes) and `verify` runs.
//! 2. Repaired: the preamble, end magic and index checksum are rewritten so that mutations of the
//!    index get past the XXH3 gate and reach `Index::parse`. Checksums are integrity checks, not
//!    secrets: anyone can write a container with a "valid" index over hostile contents, so the
//!    code behind them must be just as robust. On the repaired buffer we check that
//!    - `Container::parse` succeeds exactly when `Index::parse` does;
//!    - the index re-serialises to the very bytes it was parsed from (the format is canonical);
//!    - every chunk decodes (or fails) on its own with `decode_chunk`; with the chunk checksums
//!      also rewritten, `decode_entry` and `verify` then succeed exactly when every chunk of the
//!      entry decodes, and `decode_entry` gives the concatenation of the chunks.

#![no_main]

use libfuzzer_sys::fuzz_target;
use weightszip_core::chunk::decode_chunk;
use weightszip_core::codec::Container;
use weightszip_core::format::{index_checksum, parse_trailer, preamble, Index, END_MAGIC, PREAMBLE_LEN, TRAILER_LEN};

/// Entries with more raw bytes than this are not decoded.
const MAX_ENTRY_RAW: u64 = 64 << 20;
/// Raw bytes decoded per input over all entries, per pass.
const MAX_TOTAL_RAW: u64 = 128 << 20;

fn xxh3(b: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(b)
}

/// Pass 1: arbitrary bytes, as the library would see them.
fn as_is(data: &[u8]) {
    let Ok(c) = Container::parse(data) else {
        return;
    };
    let mut budget = MAX_TOTAL_RAW;
    for ei in 0..c.index.entries.len() {
        let Ok(need) = c.index.entries[ei].meta.raw_bytes() else {
            continue;
        };
        if need > MAX_ENTRY_RAW || need > budget {
            continue;
        }
        budget -= need;
        let mut out = vec![0u8; need as usize];
        let _ = c.decode_entry(ei, &mut out, 1);
    }
    if c.index.raw_bytes() <= MAX_TOTAL_RAW {
        let _ = c.verify(1);
    }
}

/// Rewrite the trailer checksum (and fixed preamble / end magic) so the index is accepted.
/// Returns the buffer and the index range, or None when the trailer's length field is unusable.
fn repair(data: &[u8]) -> Option<(Vec<u8>, usize, usize)> {
    let total = data.len();
    if (total as u64) < PREAMBLE_LEN + TRAILER_LEN {
        return None;
    }
    let mut buf = data.to_vec();
    buf[..PREAMBLE_LEN as usize].copy_from_slice(&preamble());
    buf[total - 8..].copy_from_slice(&END_MAGIC);
    let (io, il, _) = parse_trailer(&buf[total - TRAILER_LEN as usize..], total as u64).ok()?;
    let (io, il) = (io as usize, il as usize);
    let sum = index_checksum(&buf[..PREAMBLE_LEN as usize], &buf[io..io + il]);
    buf[total - 16..total - 8].copy_from_slice(&sum.to_le_bytes());
    Some((buf, io, il))
}

/// Build a container around `buf[..io]` (preamble and payloads) with `index` and a fresh trailer.
fn rebuild(buf: &[u8], io: usize, index: &Index) -> Vec<u8> {
    let ib = index.to_bytes();
    let mut v = buf[..io].to_vec();
    v.extend_from_slice(&ib);
    v.extend_from_slice(&(ib.len() as u64).to_le_bytes());
    v.extend_from_slice(&index_checksum(&buf[..PREAMBLE_LEN as usize], &ib).to_le_bytes());
    v.extend_from_slice(&END_MAGIC);
    v
}

/// Pass 2: a checksum-repaired copy.
fn repaired(data: &[u8]) {
    let Some((buf, io, il)) = repair(data) else {
        return;
    };
    let ib = &buf[io..io + il];
    let direct = Index::parse(ib, io as u64);
    let parsed = Container::parse(&buf);
    assert_eq!(
        direct.is_ok(),
        parsed.is_ok(),
        "Index::parse and Container::parse disagree: {:?} vs {:?}",
        direct.as_ref().err(),
        parsed.as_ref().err()
    );
    let Ok(c) = parsed else { return };
    assert_eq!(c.index, direct.unwrap());
    assert!(c.index.to_bytes() == ib, "index does not re-serialise to the bytes it was parsed from");

    // Decode each chunk on its own, bypassing the checksums; remember the results.
    let mut index = c.index.clone();
    let mut budget = MAX_TOTAL_RAW;
    // Per entry: None when skipped, else Some(Ok(raw bytes)) / Some(Err(())) for a failed chunk.
    let mut decoded: Vec<Option<Result<Vec<u8>, ()>>> = Vec::with_capacity(index.entries.len());
    for e in index.entries.iter_mut() {
        let need = e.meta.raw_bytes().expect("a parsed entry has a valid size");
        if need > MAX_ENTRY_RAW || need > budget {
            decoded.push(None);
            continue;
        }
        budget -= need;
        let mut whole = vec![0u8; need as usize];
        let mut ok = true;
        for k in 0..e.chunks.len() {
            let (a, b) = e.chunk_raw_range(k);
            let cr = &mut e.chunks[k];
            let stored = &buf[cr.offset as usize..(cr.offset + cr.stored_len as u64) as usize];
            let out = &mut whole[a as usize..b as usize];
            cr.stored_xxh3 = xxh3(stored);
            if decode_chunk(stored, out).is_ok() {
                cr.raw_xxh3 = xxh3(out);
            } else {
                ok = false;
            }
        }
        decoded.push(Some(if ok { Ok(whole) } else { Err(()) }));
    }

    // With every checksum made to match, the container decoder must agree with the chunk decoder.
    let fixed = rebuild(&buf, io, &index);
    let c2 = Container::parse(&fixed).expect("a container rebuilt from a parsed index must parse");
    assert_eq!(c2.index, index);
    let mut all_ok = true;
    for (ei, d) in decoded.iter().enumerate() {
        let Some(d) = d else { continue };
        let need = index.entries[ei].meta.raw_bytes().unwrap();
        let mut out = vec![0u8; need as usize];
        let r = c2.decode_entry(ei, &mut out, 1);
        match d {
            Ok(want) => {
                r.unwrap_or_else(|e| panic!("entry {ei}: every chunk decodes, decode_entry says {e}"));
                assert!(out == *want, "entry {ei}: decode_entry differs from its chunks");
            }
            Err(()) => {
                all_ok = false;
                assert!(r.is_err(), "entry {ei}: a chunk fails to decode but decode_entry succeeds");
            }
        }
    }
    if decoded.iter().all(|d| d.is_some()) {
        let v = c2.verify(1);
        assert_eq!(v.is_ok(), all_ok, "verify disagrees with the chunk decoder: {:?}", v.err());
    }
}

fuzz_target!(|data: &[u8]| {
    as_is(data);
    repaired(data);
});
