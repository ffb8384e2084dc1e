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
