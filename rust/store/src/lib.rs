//! weightszip-store: keys to compressed KV chunks, kept in a RAM tier with a byte budget and
//! LRU eviction into a disk tier of atomic, checksummed files (docs/STORE.md).
//!
//! Read me first:
//! * Every version of a key gets a sequence number, unique and increasing in the store, and its
//!   own file name (`hash-seq.wzc`). The newest version wins everywhere; a file is never
//!   overwritten, so a reader never sees a half-replaced file and no two writers share a name.
//! * One mutex guards the maps; no I/O happens under it. Eviction picks victims under the lock
//!   and writes them outside it; until written, a victim stays readable in `flushing`.
//! * Every read is verified: RAM chunks against the XXH3-64 taken at put, disk chunks against the
//!   file's checksums. A chunk that fails is evicted, counted, and reported as an error, never
//!   returned.

pub mod file;
pub mod remote;
mod store;

pub use store::{Chunk, ChunkStore, Stats, StoreConfig};
pub use weightszip_core::{Error, Result};
