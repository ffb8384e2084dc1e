//! Property: the KV Exact page decoder (weightszip_core::kvx, 3-bit exponent codes against
//! per-channel window tops, an exception list) never panics, hangs or allocates without bound,
//! whatever the bytes, window tops and offsets; a page that decodes re-encodes to exactly its bytes
//! (the format is canonical); `decode_pages` agrees with `decode_page` (the same values, the same
//! error class); two pages at any offsets decode exactly when each does alone.
//!
//! Input: byte 0 = selector: heads = 1 + bits 0..1, head_dim = 32 x (1 + bit 2); bit 3 set: the
//! middle offset of the two-page split is bytes 1..9 (u64 LE) as they are, anywhere in u64, else
//! taken modulo the page's length + 1. Then one window top per channel (heads x head_dim bytes),
//! then the page (or pages).

#![no_main]

mod common;

use common::{class, page_header};
use libfuzzer_sys::fuzz_target;
use weightszip_core::kvx::{self, Shape};

fuzz_target!(|data: &[u8]| {
    let Some((sel, (heads, head_dim), raw_mid)) = page_header(data) else { return };
    let shape = Shape::new(heads, head_dim).expect("valid shape");
    let c = shape.channels();
    if data.len() < 9 + c {
        return;
    }
    let bases = &data[9..9 + c];
    let page = &data[9 + c..];
    let pb = shape.raw_page_bytes();

    // one page
    let mut out = vec![0xa5u8; pb];
    let one = kvx::decode_page(shape, bases, page, &mut out, 0);
    if one.is_ok() {
        let mut again = Vec::new();
        kvx::encode_page(shape, bases, &out, &mut again).expect("decoded values re-encode");
        assert!(again == page, "a KV Exact page that decodes must re-encode to its own bytes");
    }
    let n = page.len() as u64;
    let mut buf = vec![0x5au8; pb];
    let many = kvx::decode_pages(shape, bases, page, &[0, n], &mut buf);
    assert_eq!(class(&many), class(&one), "decode_pages and decode_page disagree: {many:?} vs {one:?}");
    if one.is_ok() {
        assert!(buf == out, "decode_pages and decode_page decode different values");
    }

    // two pages: the middle offset anywhere (past the end: an error, never a panic)
    let mid = if sel & 8 != 0 { raw_mid } else { raw_mid % (n + 1) };
    let mut two = vec![0u8; 2 * pb];
    let r = kvx::decode_pages(shape, bases, page, &[0, mid, n], &mut two);
    if mid > n {
        assert!(r.is_err(), "a middle offset past the end decoded");
        return;
    }
    let m = mid as usize;
    let (mut a, mut b) = (vec![0u8; pb], vec![0u8; pb]);
    let ra = kvx::decode_page(shape, bases, &page[..m], &mut a, 0);
    let rb = kvx::decode_page(shape, bases, &page[m..], &mut b, 1);
    assert_eq!(r.is_ok(), ra.is_ok() && rb.is_ok(), "two pages: {r:?}, alone: {ra:?}, {rb:?}");
    if r.is_ok() {
        assert!(two[..pb] == a[..] && two[pb..] == b[..], "two pages decode unlike each alone");
        let (again, offs) = kvx::encode_pages(shape, bases, &two).expect("decoded values re-encode");
        assert!(again == page && offs == [0, mid, n], "two decoded pages re-encode to other bytes");
    }
});
