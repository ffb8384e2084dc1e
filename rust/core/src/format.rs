//! The container: preamble, chunk payloads, index, trailer. Every byte is specified in
//! docs/FORMAT.md; this module is the reference reader and writer of that text.
//!
//! The index sits at the end (as in Parquet and zip) so that an encoder can stream a file larger
//! than memory, keeping only the chunk table, and a reader finds it with one seek.

use std::io::Write;

use crate::bytes::{put_u16, put_u32, put_u64, Reader};
use crate::dtype::DType;
use crate::error::{corrupt, truncated, Error, Result};

/// 0x89 is not ASCII and not valid as the first byte of UTF-8, so no text file starts like this;
/// "WZP" names us; CR LF, Ctrl-Z and LF catch newline conversion and truncation by text tools
/// (the PNG signature's reasoning).
pub const MAGIC: [u8; 8] = [0x89, b'W', b'Z', b'P', b'\r', b'\n', 0x1a, b'\n'];
/// Last 8 bytes of every container: finding it tells a reader the trailer is where it expects.
pub const END_MAGIC: [u8; 8] = *b"WZPINDEX";
pub const VERSION: u16 = 1;
pub const PREAMBLE_LEN: u64 = 16;
pub const TRAILER_LEN: u64 = 24;

/// Hard limits (docs/FORMAT.md, "Limits"): a reader rejects anything beyond them before it
/// allocates.
pub const MAX_INDEX_LEN: u64 = 256 << 20;
pub const MAX_ENTRIES: u64 = 1 << 20;
pub const MAX_NAME_LEN: usize = 4096;
pub const MAX_NDIM: usize = 16;
pub const MAX_CHUNK_RAW: u64 = 64 << 20;
pub const MAX_TENSOR_BYTES: u64 = 1 << 50;
/// Each dimension of a shape, an empty tensor's too (numpy and torch take at most 2^63 - 1).
pub const MAX_DIM: u64 = 1 << 50;
/// A chunk may declare at most this many raw bytes per stored byte. Every coded symbol costs at
/// least -log2(4095/4096) bits (rans.rs), so 8 / 3.52e-4 = 22,708 one-byte units per stored byte
/// is the most a valid stream can hold; 32768 leaves room and is a power of two.
pub const MAX_EXPANSION: u64 = 32768;

pub const KIND_TENSORS: u8 = 0;
pub const KIND_FILE: u8 = 1;
pub const PROFILE_DENSE: u8 = 1;

/// Layout tags: what the entry's bytes are, so tools can show them and pick defaults.
pub const LAYOUT_TENSOR: u8 = 0;
pub const LAYOUT_FILE_BYTES: u8 = 1;
pub const LAYOUT_KV: u8 = 2;

pub const FLAG_TORCH: u8 = 1;

const CHUNK_REF_LEN: u64 = 28;
const MIN_ENTRY_LEN: u64 = 2 + 6 + 8 + 4;

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChunkRef {
    pub offset: u64,
    pub stored_len: u32,
    pub stored_xxh3: u64,
    pub raw_xxh3: u64,
}

/// What the caller says about a tensor; the writer adds the chunk table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorMeta {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<u64>,
    pub channel_axis: u8,
    pub layout: u8,
    pub flags: u8,
}

impl TensorMeta {
    pub fn new(dtype: DType, shape: Vec<u64>) -> TensorMeta {
        let axis = shape.len().saturating_sub(1) as u8;
        TensorMeta { name: String::new(), dtype, shape, channel_axis: axis, layout: LAYOUT_TENSOR, flags: 0 }
    }

    pub fn n_elems(&self) -> Result<u64> {
        self.shape
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| Error::LimitExceeded("element count overflows 64 bits".into()))
    }

    pub fn raw_bytes(&self) -> Result<u64> {
        let b = self
            .n_elems()?
            .checked_mul(self.dtype.size() as u64)
            .ok_or_else(|| Error::LimitExceeded("byte count overflows 64 bits".into()))?;
        if b > MAX_TENSOR_BYTES {
            return Err(Error::LimitExceeded(format!("{b} bytes in one tensor (limit {MAX_TENSOR_BYTES})")));
        }
        Ok(b)
    }

    /// Elements from the channel axis to the end: one step back along the axis before it.
    pub fn row_elems(&self) -> u64 {
        self.shape.iter().skip(self.channel_axis as usize).product::<u64>().max(1)
    }

    pub fn check(&self) -> Result<()> {
        if self.name.len() > MAX_NAME_LEN {
            return Err(Error::LimitExceeded(format!("name of {} bytes", self.name.len())));
        }
        if self.shape.len() > MAX_NDIM {
            return Err(Error::LimitExceeded(format!("{} dimensions (limit {MAX_NDIM})", self.shape.len())));
        }
        if let Some(&d) = self.shape.iter().find(|&&d| d > MAX_DIM) {
            return Err(Error::LimitExceeded(format!("dimension {d} (limit {MAX_DIM})")));
        }
        if !self.shape.is_empty() && self.channel_axis as usize >= self.shape.len() {
            return Err(Error::InvalidArgument(format!(
                "channel axis {} of a {}-d tensor",
                self.channel_axis,
                self.shape.len()
            )));
        }
        if self.shape.is_empty() && self.channel_axis != 0 {
            return Err(Error::InvalidArgument("channel axis of a 0-d tensor must be 0".into()));
        }
        self.raw_bytes()?;
        // An empty tensor's other dimensions too: numpy and torch size an array's strides from
        // them, so [0, 2^50, 2^50] (0 bytes) would fail there with their own errors.
        let span = self
            .shape
            .iter()
            .try_fold(self.dtype.size() as u64, |a, &d| a.checked_mul(d.max(1)))
            .filter(|&b| b <= MAX_TENSOR_BYTES);
        if span.is_none() {
            return Err(Error::LimitExceeded(format!(
                "shape {:?}: its non-zero dimensions span more than {MAX_TENSOR_BYTES} bytes",
                self.shape
            )));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    pub meta: TensorMeta,
    pub profile: u8,
    /// Elements per chunk (the last chunk may hold fewer); 0 exactly when the tensor is empty.
    pub chunk_elems: u64,
    pub chunks: Vec<ChunkRef>,
}

impl Entry {
    /// Byte range of chunk `k` within the tensor's raw bytes.
    pub fn chunk_raw_range(&self, k: usize) -> (u64, u64) {
        let size = self.meta.dtype.size() as u64;
        let total = self.meta.n_elems().unwrap_or(0) * size;
        let start = k as u64 * self.chunk_elems * size;
        let end = (start + self.chunk_elems * size).min(total);
        (start, end)
    }

    pub fn stored_bytes(&self) -> u64 {
        self.chunks.iter().map(|c| c.stored_len as u64).sum()
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Index {
    pub kind: u8,
    pub entries: Vec<Entry>,
}

impl Index {
    pub fn raw_bytes(&self) -> u64 {
        self.entries.iter().map(|e| e.meta.raw_bytes().unwrap_or(0)).sum()
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        let mut v = Vec::new();
        v.push(self.kind);
        v.extend_from_slice(&[0, 0, 0]);
        put_u32(&mut v, self.entries.len() as u32);
        for e in &self.entries {
            let m = &e.meta;
            put_u16(&mut v, m.name.len() as u16);
            v.extend_from_slice(m.name.as_bytes());
            v.extend_from_slice(&[m.dtype.code(), m.layout, e.profile, m.flags]);
            v.extend_from_slice(&[m.shape.len() as u8, m.channel_axis]);
            for &d in &m.shape {
                put_u64(&mut v, d);
            }
            put_u64(&mut v, e.chunk_elems);
            put_u32(&mut v, e.chunks.len() as u32);
            for c in &e.chunks {
                put_u64(&mut v, c.offset);
                put_u32(&mut v, c.stored_len);
                put_u64(&mut v, c.stored_xxh3);
                put_u64(&mut v, c.raw_xxh3);
            }
        }
        v
    }

    /// Parse and check an index. `payload_end` is the offset where the index starts: every chunk
    /// must lie in [PREAMBLE_LEN, payload_end), in order and back to back.
    pub fn parse(buf: &[u8], payload_end: u64) -> Result<Index> {
        let mut r = Reader::new(buf);
        let kind = r.u8("index kind")?;
        if kind > KIND_FILE {
            return Err(Error::Unsupported(format!("container kind {kind}")));
        }
        if r.take(3, "index reserved bytes")? != [0, 0, 0] {
            return corrupt("reserved index bytes are not zero");
        }
        let n_entries = r.u32("entry count")? as u64;
        if n_entries > MAX_ENTRIES {
            return Err(Error::LimitExceeded(format!("{n_entries} entries (limit {MAX_ENTRIES})")));
        }
        if n_entries * MIN_ENTRY_LEN > r.remaining() as u64 {
            return truncated(format!("{n_entries} entries cannot fit in {} index bytes", r.remaining()));
        }
        let mut entries = Vec::with_capacity(n_entries as usize);
        let mut next_offset = PREAMBLE_LEN;
        for ei in 0..n_entries {
            let name_len = r.u16("name length")? as usize;
            if name_len > MAX_NAME_LEN {
                return Err(Error::LimitExceeded(format!("name of {name_len} bytes")));
            }
            let name = std::str::from_utf8(r.take(name_len, "name")?)
                .map_err(|_| Error::Corrupt(format!("entry {ei}: name is not UTF-8")))?
                .to_string();
            let dtype = DType::from_code(r.u8("dtype")?)?;
            let layout = r.u8("layout")?;
            if layout > LAYOUT_KV {
                return Err(Error::Unsupported(format!("entry {ei}: layout tag {layout}")));
            }
            let profile = r.u8("profile")?;
            if profile != PROFILE_DENSE {
                return Err(Error::Unsupported(format!("entry {ei}: codec profile {profile}")));
            }
            let flags = r.u8("flags")?;
            if flags & !FLAG_TORCH != 0 {
                return Err(Error::Unsupported(format!("entry {ei}: flags {flags:#x}")));
            }
            let ndim = r.u8("ndim")? as usize;
            let channel_axis = r.u8("channel axis")?;
            if ndim > MAX_NDIM {
                return Err(Error::LimitExceeded(format!("entry {ei}: {ndim} dimensions")));
            }
            let mut shape = Vec::with_capacity(ndim);
            for _ in 0..ndim {
                shape.push(r.u64("dimension")?);
            }
            let meta = TensorMeta { name, dtype, shape, channel_axis, layout, flags };
            meta.check().map_err(|e| match e {
                Error::InvalidArgument(m) => Error::Corrupt(format!("entry {ei}: {m}")),
                other => other,
            })?;
            let size = dtype.size() as u64;
            let n = meta.n_elems()?;
            let chunk_elems = r.u64("chunk elements")?;
            let n_chunks = r.u32("chunk count")? as u64;
            let expect = if n == 0 {
                if chunk_elems != 0 {
                    return corrupt(format!("entry {ei}: an empty tensor must declare 0 elements per chunk"));
                }
                0
            } else {
                if chunk_elems == 0 {
                    return corrupt(format!("entry {ei}: zero elements per chunk"));
                }
                if chunk_elems.saturating_mul(size) > MAX_CHUNK_RAW {
                    return Err(Error::LimitExceeded(format!(
                        "entry {ei}: chunks of {chunk_elems} elements exceed {MAX_CHUNK_RAW} bytes"
                    )));
                }
                n.div_ceil(chunk_elems)
            };
            if n_chunks != expect {
                return corrupt(format!("entry {ei}: {n_chunks} chunks declared, {expect} implied by the shape"));
            }
            if n_chunks * CHUNK_REF_LEN > r.remaining() as u64 {
                return truncated(format!("entry {ei}: chunk table"));
            }
            let mut entry = Entry { meta, profile, chunk_elems, chunks: Vec::with_capacity(n_chunks as usize) };
            for k in 0..n_chunks as usize {
                let c = ChunkRef {
                    offset: r.u64("chunk offset")?,
                    stored_len: r.u32("chunk length")?,
                    stored_xxh3: r.u64("chunk checksum")?,
                    raw_xxh3: r.u64("content checksum")?,
                };
                entry.chunks.push(c);
                let c = &entry.chunks[k];
                let (a, b) = entry.chunk_raw_range(k);
                let raw = b - a;
                if c.offset != next_offset {
                    return corrupt(format!("entry {ei} chunk {k}: offset {} where {next_offset} was due", c.offset));
                }
                if c.stored_len == 0 || c.stored_len as u64 > raw + 1 {
                    return corrupt(format!("entry {ei} chunk {k}: {} stored bytes for {raw} raw", c.stored_len));
                }
                if raw > MAX_EXPANSION * c.stored_len as u64 {
                    return Err(Error::LimitExceeded(format!(
                        "entry {ei} chunk {k}: {raw} raw bytes from {} stored",
                        c.stored_len
                    )));
                }
                next_offset += c.stored_len as u64;
                if next_offset > payload_end {
                    return corrupt(format!("entry {ei} chunk {k} runs past the index"));
                }
            }
            entries.push(entry);
        }
        if r.remaining() != 0 {
            return corrupt(format!("{} trailing bytes in the index", r.remaining()));
        }
        if next_offset != payload_end {
            return corrupt(format!("{} unaccounted bytes before the index", payload_end - next_offset));
        }
        Ok(Index { kind, entries })
    }
}

pub fn preamble() -> [u8; 16] {
    let mut p = [0u8; 16];
    p[..8].copy_from_slice(&MAGIC);
    p[8..10].copy_from_slice(&VERSION.to_le_bytes());
    p
}

pub fn check_preamble(p: &[u8]) -> Result<()> {
    if p.len() < PREAMBLE_LEN as usize {
        if !p.is_empty() && !MAGIC.starts_with(&p[..p.len().min(8)]) {
            return Err(Error::BadMagic);
        }
        return truncated("shorter than the 16-byte preamble");
    }
    if p[..8] != MAGIC {
        return Err(Error::BadMagic);
    }
    let version = u16::from_le_bytes([p[8], p[9]]);
    if version != VERSION {
        return Err(Error::UnsupportedVersion(version, VERSION));
    }
    if p[10..16] != [0; 6] {
        return corrupt("reserved preamble bytes are not zero");
    }
    Ok(())
}

/// Index checksum: XXH3-64 (seed 0) of the preamble followed by the index bytes.
pub fn index_checksum(preamble: &[u8], index: &[u8]) -> u64 {
    let mut h = xxhash_rust::xxh3::Xxh3::new();
    h.update(preamble);
    h.update(index);
    h.digest()
}

/// Parse the trailer (last 24 bytes) of a container `total` bytes long: returns (index offset,
/// index length, index checksum).
pub fn parse_trailer(t: &[u8], total: u64) -> Result<(u64, u64, u64)> {
    if t.len() != TRAILER_LEN as usize || total < PREAMBLE_LEN + TRAILER_LEN {
        return truncated("shorter than preamble and trailer");
    }
    if t[16..24] != END_MAGIC {
        return corrupt("the container does not end with the index trailer (truncated?)");
    }
    let index_len = u64::from_le_bytes(t[0..8].try_into().unwrap());
    let checksum = u64::from_le_bytes(t[8..16].try_into().unwrap());
    if index_len > MAX_INDEX_LEN {
        return Err(Error::LimitExceeded(format!("index of {index_len} bytes (limit {MAX_INDEX_LEN})")));
    }
    if index_len > total - PREAMBLE_LEN - TRAILER_LEN {
        return truncated(format!("index of {index_len} bytes in a {total}-byte container"));
    }
    Ok((total - TRAILER_LEN - index_len, index_len, checksum))
}

/// Streaming writer: preamble first, then chunks as they come, index and trailer at `finish`.
pub struct Writer<W: Write> {
    w: W,
    pos: u64,
    kind: u8,
    entries: Vec<Entry>,
    open: bool,
    index_len: u64,
}

/// A chunk ready to be written: its payload and the checksum of the bytes it decodes to.
pub struct EncodedChunk {
    pub payload: Vec<u8>,
    pub raw_xxh3: u64,
}

impl<W: Write> Writer<W> {
    pub fn new(mut w: W, kind: u8) -> Result<Writer<W>> {
        w.write_all(&preamble())?;
        Ok(Writer { w, pos: PREAMBLE_LEN, kind, entries: Vec::new(), open: false, index_len: 8 })
    }

    pub fn begin_entry(&mut self, meta: TensorMeta, chunk_elems: u64) -> Result<()> {
        meta.check()?;
        self.close_entry()?;
        if self.entries.len() as u64 >= MAX_ENTRIES {
            return Err(Error::LimitExceeded(format!("more than {MAX_ENTRIES} entries")));
        }
        let n = meta.n_elems()?;
        let size = meta.dtype.size() as u64;
        if n == 0 && chunk_elems != 0 {
            return Err(Error::InvalidArgument("an empty tensor takes 0 elements per chunk".into()));
        }
        if n > 0 && (chunk_elems == 0 || chunk_elems.saturating_mul(size) > MAX_CHUNK_RAW) {
            return Err(Error::InvalidArgument(format!("{chunk_elems} elements per chunk")));
        }
        self.index_len += 2 + meta.name.len() as u64 + 6 + 8 * meta.shape.len() as u64 + 12;
        if self.index_len > MAX_INDEX_LEN {
            return Err(Error::LimitExceeded(format!("index beyond {MAX_INDEX_LEN} bytes")));
        }
        self.entries.push(Entry { meta, profile: PROFILE_DENSE, chunk_elems, chunks: Vec::new() });
        self.open = true;
        Ok(())
    }

    pub fn write_chunk(&mut self, c: &EncodedChunk) -> Result<()> {
        if !self.open {
            return Err(Error::InvalidArgument("write_chunk outside an entry".into()));
        }
        let e = self.entries.last().unwrap();
        let (a, b) = e.chunk_raw_range(e.chunks.len());
        if b <= a || c.payload.is_empty() || c.payload.len() as u64 > b - a + 1 {
            return Err(Error::InvalidArgument(format!(
                "chunk {} of {:?}: {} payload bytes for {} raw",
                e.chunks.len(),
                e.meta.name,
                c.payload.len(),
                b.saturating_sub(a)
            )));
        }
        self.index_len += CHUNK_REF_LEN;
        if self.index_len > MAX_INDEX_LEN {
            return Err(Error::LimitExceeded(format!("index beyond {MAX_INDEX_LEN} bytes")));
        }
        self.w.write_all(&c.payload)?;
        let e = self.entries.last_mut().unwrap();
        e.chunks.push(ChunkRef {
            offset: self.pos,
            stored_len: c.payload.len() as u32,
            stored_xxh3: xxhash_rust::xxh3::xxh3_64(&c.payload),
            raw_xxh3: c.raw_xxh3,
        });
        self.pos += c.payload.len() as u64;
        Ok(())
    }

    fn close_entry(&mut self) -> Result<()> {
        if self.open {
            let e = self.entries.last().unwrap();
            let n = e.meta.n_elems()?;
            let expect = if n == 0 { 0 } else { n.div_ceil(e.chunk_elems) };
            if e.chunks.len() as u64 != expect {
                return Err(Error::InvalidArgument(format!(
                    "entry {:?} got {} chunks, its shape needs {expect}",
                    e.meta.name,
                    e.chunks.len()
                )));
            }
            self.open = false;
        }
        Ok(())
    }

    pub fn finish(mut self) -> Result<(W, Index)> {
        self.close_entry()?;
        let index = Index { kind: self.kind, entries: self.entries };
        let bytes = index.to_bytes();
        if bytes.len() as u64 > MAX_INDEX_LEN {
            return Err(Error::LimitExceeded(format!("index of {} bytes", bytes.len())));
        }
        self.w.write_all(&bytes)?;
        put_trailer(&mut self.w, &bytes)?;
        self.w.flush()?;
        Ok((self.w, index))
    }
}

fn put_trailer<W: Write>(w: &mut W, index: &[u8]) -> Result<()> {
    let mut t = Vec::with_capacity(TRAILER_LEN as usize);
    put_u64(&mut t, index.len() as u64);
    put_u64(&mut t, index_checksum(&preamble(), index));
    t.extend_from_slice(&END_MAGIC);
    w.write_all(&t)?;
    Ok(())
}
