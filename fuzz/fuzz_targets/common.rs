//! What the page-decoder fuzz targets share (included by each with `mod common;`).

use weightszip_core::Error;

/// Truncated, Corrupt or another error (the class the Python bindings raise).
pub fn class(r: &Result<(), Error>) -> Option<&'static str> {
    match r {
        Ok(()) => None,
        Err(Error::Truncated(_)) => Some("truncated"),
        Err(Error::Corrupt(_)) => Some("corrupt"),
        Err(_) => Some("other"),
    }
}

/// The two page targets' first 9 bytes: the selector (heads = 1 + bits 0..1, head_dim = 32 x (1 + bit
/// 2); the other bits are the target's), (heads, head_dim), and bytes 1..9 as a u64 (the middle
/// offset of the two-page split); None when the input is shorter.
pub fn page_header(data: &[u8]) -> Option<(u8, (usize, usize), u64)> {
    let sel = *data.first()?;
    let raw_mid = u64::from_le_bytes(data.get(1..9)?.try_into().unwrap());
    Some((sel, (1 + (sel & 3) as usize, 32 * (1 + ((sel >> 2) & 1) as usize)), raw_mid))
}
