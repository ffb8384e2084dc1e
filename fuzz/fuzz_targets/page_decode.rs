//! Property: the page decoders never panic, hang or allocate without bound, whatever the bytes.
//! KV Exact (weightszip_core::kvx): a page that decodes re-encodes to exactly its bytes (the
//! format is canonical); `decode_pages` agrees with `decode_page` and takes any page offsets.
//! Exact page profile (weightszip_core::page): decoding is deterministic, the lookup-table decoder
//! agrees with the table-free one (and on several threads), and a page that decodes re-encodes to
//! exactly its bytes (both versions are canonical).
//!
//! Input: byte 0 = selector. Bit 0 clear: KV Exact, heads = 1 + bits 1..2, head_dim = 32 x (1 + bit
//! 3); then `heads x head_dim` window tops, then the page. Bit 0 set: exact page profile with
//! 32 x (1 + bit 1) channels and a codebook of version 1 + bit 2 calibrated from a sample seeded by
//! byte 1; the rest is the page.

#![no_main]

use libfuzzer_sys::fuzz_target;
use weightszip_core::kvx::{self, Shape};
use weightszip_core::page::{self, PageCodebook, DTYPE_BF16};

fuzz_target!(|data: &[u8]| {
    if data.len() < 2 {
        return;
    }
    let sel = data[0];
    if sel & 1 == 0 {
        let heads = 1 + ((sel >> 1) & 3) as usize;
        let head_dim = 32 * (1 + ((sel >> 3) & 1) as usize);
        let shape = Shape::new(heads, head_dim).expect("valid shape");
        let c = shape.channels();
        if data.len() < 1 + c {
            return;
        }
        let (bases, page) = (&data[1..1 + c], &data[1 + c..]);
        let mut out = vec![0u8; shape.raw_page_bytes()];
        let one = kvx::decode_page(shape, bases, page, &mut out, 0).is_ok();
        if one {
            let mut again = Vec::new();
            kvx::encode_page(shape, bases, &out, &mut again).expect("decoded values re-encode");
            assert!(again == page, "a KV Exact page that decodes must re-encode to its own bytes");
        }
        // decode_pages: the same verdict for the page alone; any two-page split of the bytes (the
        // middle offset taken from the input, possibly past the end) is an error or two pages
        let n = page.len() as u64;
        let mut buf = vec![0u8; shape.raw_page_bytes()];
        assert_eq!(kvx::decode_pages(shape, bases, page, &[0, n], &mut buf).is_ok(), one);
        let mid = u64::from(data[0] >> 4) * 97 % (2 * n + 1);
        let mut two = vec![0u8; 2 * shape.raw_page_bytes()];
        let _ = kvx::decode_pages(shape, bases, page, &[0, mid, n], &mut two);
    } else {
        let channels = 32 * (1 + ((sel >> 1) & 1) as usize);
        let mut s = u64::from(data[1]) | 0x100;
        let sample: Vec<u8> = (0..64 * channels)
            .flat_map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                let e = 124u16.saturating_sub((s % 64).trailing_zeros() as u16 * 2);
                (((s >> 20) as u16 & 0x807F) | (e << 7)).to_le_bytes()
            })
            .collect();
        let version = 1 + ((sel >> 2) & 1);
        let cb = PageCodebook::calibrate_version(version, DTYPE_BF16, channels, &sample, 8).expect("calibration");
        let page = &data[2..];
        let mut out = vec![0xa5u8; 2 * page::PAGE_TOKENS * channels];
        let one = page::decode_page(&cb, page, &mut out).is_ok();
        // decode_pages (a page and the zero bytes after it in its slot) with the lookup table
        // gives the table-free decoder's verdict, error and values; on several threads, a run of
        // copies of a good page decodes to copies of its values, and with one copy in the second
        // task spoiled, the error names that copy
        let lut = page::lookup_table(&cb);
        let n = page.len() as u64;
        let (mut tabled, mut plain) = (vec![0u8; out.len()], vec![0u8; out.len()]);
        let with_lut = page::decode_pages_with(&cb, lut.as_deref(), page, &[0, n], &mut tabled, 1);
        let without = page::decode_pages_with(&cb, None, page, &[0, n], &mut plain, 1);
        assert_eq!(with_lut.as_ref().map_err(|e| e.to_string()), without.as_ref().map_err(|e| e.to_string()));
        if with_lut.is_ok() {
            assert!(tabled == plain, "the table decoder and the table-free decoder disagree");
        }
        if one {
            assert!(tabled == out, "decode_pages and decode_page disagree");
            let copies = 130;
            let mut buf = page.repeat(copies);
            let offs: Vec<u64> = (0..=copies as u64).map(|i| i * n).collect();
            let mut many = vec![0u8; copies * out.len()];
            page::decode_pages_threads(&cb, &buf, &offs, &mut many, 2).expect("copies of a good page decode");
            assert!(many.chunks_exact(out.len()).all(|c| c == out.as_slice()));
            // header padding of copy 100 (page headers are 8-byte aligned: one stream's or two
            // streams' word counts, then padding)
            buf[100 * n as usize + 2 * (channels / page::STREAM_CHANNELS)] = 1;
            let e = page::decode_pages_threads(&cb, &buf, &offs, &mut many, 2).expect_err("a spoiled copy");
            assert!(e.to_string().contains("page 100:"), "{e}");
        }
        if one {
            let mut again = vec![0x5au8; out.len()];
            page::decode_page(&cb, page, &mut again).expect("a page that decoded once decodes again");
            assert!(out == again, "page decoding is not deterministic or leaves bytes unwritten");
            let mut bytes = Vec::new();
            page::encode_page(&cb, &out, &mut bytes).expect("decoded values re-encode");
            assert!(bytes == page, "a page profile page that decodes must re-encode to its own bytes");
        }
    }
});
