//! weightszip core: the exact (lossless) codec for bf16 / fp16 / fp32 / fp8 tensors and the
//! container format, with no Python in it. docs/FORMAT.md specifies every byte.

pub mod bytes;
pub mod chunk;
pub mod codec;
pub mod dtype;
pub mod error;
pub mod format;
pub mod kvx;
pub mod kvx4;
pub mod page;
pub mod rans;

pub use codec::{compress, decode_file, encode_file, read_index, Container, EncodeOptions, OnExisting, Output};
pub use dtype::DType;
pub use error::{Error, Result};
pub use format::{Index, TensorMeta};
