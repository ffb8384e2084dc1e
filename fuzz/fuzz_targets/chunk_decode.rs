//! Property: `decode_chunk` never panics, whatever the payload and output length, and when it
//! succeeds it has written every output byte (two decodes into differently pre-filled buffers
//! agree), and a stored chunk decodes to its body.
//!
//! Input: bytes 0..2 are the output length (u16 little endian, so at most 65535 bytes); the rest
//! is the chunk payload.

#![no_main]

use libfuzzer_sys::fuzz_target;
use weightszip_core::chunk::{decode_chunk, MODE_STORED};

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let n = u16::from_le_bytes([data[0], data[1]]) as usize;
    let payload = &data[2..];
    let mut out = vec![0xa5u8; n];
    if decode_chunk(payload, &mut out).is_err() {
        return;
    }
    let mut again = vec![0x5au8; n];
    decode_chunk(payload, &mut again).expect("a payload that decoded once must decode again");
    assert!(out == again, "decode_chunk left output bytes unwritten or is not deterministic");
    if payload[0] == MODE_STORED {
        assert!(out[..] == payload[1..], "stored chunk decoded to something else than its body");
    }
});
