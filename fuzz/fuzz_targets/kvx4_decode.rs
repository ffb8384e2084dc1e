//! Property: the KV Exact4 page decoder (weightszip_core::kvx4) never panics, hangs or allocates
//! without bound, whatever the bytes and offsets; a page that decodes re-encodes to exactly its
//! bytes (the format is canonical); `decode_pages` agrees with `decode_page` (the same values, the
//! same error class); two pages at any offsets decode exactly when each does alone.
//!
//! Input: byte 0 = selector: heads = 1 + bits 0..1, head_dim = 32 x (1 + bit 2); bit 3 set: the
//! middle offset of the two-page split is bytes 1..9 (u64 LE) as they are, anywhere in u64, else
//! taken modulo the page's length + 1; bit 4 set: the header's counts of earlier plain rows are
//! rewritten from its masks and the page cut or zero-padded to the length they give (so that
//! mutations reach the checks of the slots and plain rows). Bytes 9.. are the page (or pages).

#![no_main]

mod common;

use common::{class, page_header};
use libfuzzer_sys::fuzz_target;
use weightszip_core::kvx4::{self, Shape};
use weightszip_core::Error;

fuzz_target!(|data: &[u8]| {
    let Some((sel, (heads, head_dim), raw_mid)) = page_header(data) else { return };
    let shape = Shape::new(heads, head_dim).expect("valid shape");
    let mut page = data[9..].to_vec();
    if sel & 16 != 0 && page.len() >= 4 * shape.heads {
        let mut before = 0u32;
        for h in 0..shape.heads {
            let mask = u32::from(u16::from_le_bytes([page[4 * h], page[4 * h + 1]]));
            page[4 * h + 2..4 * h + 4].copy_from_slice(&(before as u16).to_le_bytes());
            before += mask.count_ones();
        }
        page.resize(shape.page_length(before as usize), 0);
    }
    let pb = shape.raw_page_bytes();

    // one page
    let mut out = vec![0xa5u8; pb];
    let one = kvx4::decode_page(shape, &page, &mut out, 0);
    if one.is_ok() {
        let mut again = Vec::new();
        kvx4::encode_page(shape, &out, &mut again).expect("decoded values re-encode");
        assert!(again == page, "a KV Exact4 page that decodes must re-encode to its own bytes");
    }
    let n = page.len() as u64;
    let mut buf = vec![0x5au8; pb];
    let many = kvx4::decode_pages(shape, &page, &[0, n], &mut buf);
    assert_eq!(class(&many), class(&one), "decode_pages and decode_page disagree: {many:?} vs {one:?}");
    if one.is_ok() {
        assert!(buf == out, "decode_pages and decode_page decode different values");
    }

    // two pages: the middle offset anywhere (past the end: an error, never a panic)
    let mid = if sel & 8 != 0 { raw_mid } else { raw_mid % (n + 1) };
    let mut two = vec![0u8; 2 * pb];
    let r = kvx4::decode_pages(shape, &page, &[0, mid, n], &mut two);
    if mid > n {
        assert!(matches!(r, Err(Error::Corrupt(_))), "a middle offset past the end: {r:?}");
        return;
    }
    let m = mid as usize;
    let (mut a, mut b) = (vec![0u8; pb], vec![0u8; pb]);
    let ra = kvx4::decode_page(shape, &page[..m], &mut a, 0);
    let rb = kvx4::decode_page(shape, &page[m..], &mut b, 1);
    assert_eq!(r.is_ok(), ra.is_ok() && rb.is_ok(), "two pages: {r:?}, alone: {ra:?}, {rb:?}");
    if r.is_ok() {
        assert!(two[..pb] == a[..] && two[pb..] == b[..], "two pages decode unlike each alone");
        let (again, offs) = kvx4::encode_pages(shape, &two).expect("decoded values re-encode");
        assert!(again == page && offs == [0, mid, n], "two decoded pages re-encode to other bytes");
    }
});
