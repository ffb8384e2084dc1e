//! Bindings of the exact page profile (weightszip_core::page): codebook calibration and the
//! reference (CPU) page encoder and decoder. Buffers cross as (address, length) like in lib.rs.

use std::collections::VecDeque;
use std::sync::{Arc, Mutex, OnceLock};

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use weightszip_core::page::{self, PageCodebook};

use crate::{slice, slice_mut, to_py};

/// A checked codebook with its decode table (built on the first decode), kept for the next call
/// with the same bytes.
struct Parsed {
    bytes: Vec<u8>,
    cb: PageCodebook,
    lut: OnceLock<Option<Vec<u16>>>,
}

impl Parsed {
    /// Bytes held, its decode table counted as built: the copy of the bytes, the parsed
    /// lengths and their 16-bit codes (about 4x the bytes), and the table (2 bytes an entry; none
    /// above 2^24 entries, see `page::lookup_table`).
    fn size(&self) -> usize {
        let entries = (self.cb.channels * self.cb.classes()) << self.cb.max_len;
        4 * self.bytes.len() + if entries <= 1 << 24 { 2 * entries } else { 0 }
    }

    fn lut(&self) -> Option<&[u16]> {
        self.lut.get_or_init(|| page::lookup_table(&self.cb)).as_deref()
    }
}

/// Bytes the cache of parsed codebooks may hold (a session's codebooks are decoded in turn: a
/// Llama-3.1-8B session's 64 version-2 codebooks and their tables take about 500 MiB, so they
/// thrash it, each call then parsing as it would without the cache). A codebook larger than
/// this is parsed for its call and not kept.
const CACHE_BYTES: usize = 64 << 20;

/// The parsed codebook of these bytes, from the cache (most recently used first) or parsed now.
/// Parsing a version-2 codebook and building its table takes about 1 ms for 192 channels.
fn parsed(codebook: &[u8]) -> PyResult<Arc<Parsed>> {
    static CACHE: Mutex<VecDeque<Arc<Parsed>>> = Mutex::new(VecDeque::new());
    {
        let mut c = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(i) = c.iter().position(|p| p.bytes == codebook) {
            let p = c.remove(i).expect("found");
            c.push_front(p.clone());
            return Ok(p);
        }
    }
    let cb = PageCodebook::parse(codebook).map_err(to_py)?;
    let p = Arc::new(Parsed { bytes: codebook.to_vec(), cb, lut: OnceLock::new() });
    if p.size() <= CACHE_BYTES {
        let mut c = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        c.push_front(p.clone());
        let mut total: usize = c.iter().map(|p| p.size()).sum();
        while total > CACHE_BYTES {
            total -= c.pop_back().expect("the total counts an entry").size();
        }
    }
    Ok(p)
}

/// Calibrate a codebook of `version` (1, or 2 for bf16) from `tokens x channels` 16-bit sample
/// values (version 2: consecutive tokens, in pages of 16 from the first); returns its bytes.
#[pyfunction]
#[pyo3(signature = (dtype, channels, addr, len, max_len, version=1))]
fn page_calibrate<'py>(
    py: Python<'py>,
    dtype: u8,
    channels: usize,
    addr: usize,
    len: usize,
    max_len: u8,
    version: u8,
) -> PyResult<Bound<'py, PyBytes>> {
    let cb = py
        .allow_threads(|| {
            PageCodebook::calibrate_version(version, dtype, channels, unsafe { slice(addr, len) }, max_len)
        })
        .map_err(to_py)?;
    Ok(PyBytes::new(py, &cb.to_bytes()))
}

type CodebookInfo<'py> = (u8, u8, usize, Bound<'py, PyBytes>, u8, Bound<'py, PyBytes>);

/// Check a codebook; returns (dtype code, max_len, channels, lengths as bytes, version, splits as
/// bytes: empty in version 1).
#[pyfunction]
fn page_codebook_info<'py>(py: Python<'py>, codebook: &[u8]) -> PyResult<CodebookInfo<'py>> {
    let p = parsed(codebook)?;
    let cb = &p.cb;
    Ok((cb.dtype, cb.max_len, cb.channels, PyBytes::new(py, &cb.lengths), cb.version, PyBytes::new(py, &cb.splits)))
}

/// Encode whole pages (n x 16 x channels values); returns (pages back to back, n + 1 offsets).
#[pyfunction]
fn page_encode<'py>(
    py: Python<'py>,
    codebook: &[u8],
    addr: usize,
    len: usize,
    align: usize,
    threads: usize,
) -> PyResult<(Bound<'py, PyBytes>, Vec<u64>)> {
    let p = parsed(codebook)?;
    let (buf, offs) = py
        .allow_threads(|| page::encode_pages_threads(&p.cb, unsafe { slice(addr, len) }, align, threads))
        .map_err(to_py)?;
    Ok((PyBytes::new(py, &buf), offs))
}

/// Decode pages at `offsets` (n + 1 entries) of the buffer at `addr` into the buffer at `out_addr`.
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn page_decode(
    py: Python<'_>,
    codebook: &[u8],
    addr: usize,
    len: usize,
    offsets: Vec<u64>,
    out_addr: usize,
    out_len: usize,
    threads: usize,
) -> PyResult<()> {
    let p = parsed(codebook)?;
    py.allow_threads(|| {
        let out = unsafe { slice_mut(out_addr, out_len) };
        page::decode_pages_with(&p.cb, p.lut(), unsafe { slice(addr, len) }, &offsets, out, threads)
    })
    .map_err(to_py)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("PAGE_TOKENS", page::PAGE_TOKENS)?;
    m.add("PAGE_STREAM_CHANNELS", page::STREAM_CHANNELS)?;
    m.add_function(wrap_pyfunction!(page_calibrate, m)?)?;
    m.add_function(wrap_pyfunction!(page_codebook_info, m)?)?;
    m.add_function(wrap_pyfunction!(page_encode, m)?)?;
    m.add_function(wrap_pyfunction!(page_decode, m)?)?;
    Ok(())
}
