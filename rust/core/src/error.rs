//! One error type for the whole core. Each variant names what went wrong; the Python bindings map
//! every variant to its own exception class with an exhaustive `match`.

use thiserror::Error;

#[derive(Debug, Error)]
pub enum Error {
    /// The input does not start (or end) with the weightszip magic number.
    #[error("not a weightszip container: bad magic number")]
    BadMagic,
    /// The container declares a format version this build cannot read.
    #[error("unsupported format version {0} (this build reads version {1})")]
    UnsupportedVersion(u16, u16),
    /// A field holds a value this version does not define (a dtype, profile, chunk mode, kind,
    /// layout or flag): most likely written by a newer weightszip.
    #[error("unsupported feature: {0} (written by a newer weightszip?)")]
    Unsupported(String),
    /// The input ends before a structure it declares.
    #[error("truncated input: {0}")]
    Truncated(String),
    /// A structural field holds an impossible value.
    #[error("corrupt data: {0}")]
    Corrupt(String),
    /// A checksum over the index, a stored chunk or a decoded chunk did not match.
    #[error("checksum mismatch: {0}")]
    ChecksumMismatch(String),
    /// A declared size exceeds a hard limit of the format or a limit the caller set.
    #[error("limit exceeded: {0}")]
    LimitExceeded(String),
    /// The caller asked for something the codec does not do (bad dtype, shape, axis, buffer size).
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// An output buffer is smaller than the data it must hold.
    #[error("buffer too small: need {need} bytes, have {have}")]
    BufferTooSmall { need: u64, have: u64 },
    /// The output file exists and the caller asked not to replace it (`codec::OnExisting::Refuse`):
    /// it is left as it was. Holds the output's path.
    #[error("{0}: already exists; not overwritten")]
    OutputExists(String),
    /// The caller's progress callback asked the codec to stop (in Python: an interrupt, Ctrl-C,
    /// raised in or delivered during the callback). A file writer leaves no output and no
    /// temporary file.
    #[error("interrupted: {0}")]
    Interrupted(String),
    /// Reading or writing a file failed (the message names the file where the codec knows it).
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
}

pub type Result<T> = std::result::Result<T, Error>;

pub(crate) fn corrupt<T>(msg: impl Into<String>) -> Result<T> {
    Err(Error::Corrupt(msg.into()))
}

pub(crate) fn truncated<T>(msg: impl Into<String>) -> Result<T> {
    Err(Error::Truncated(msg.into()))
}
