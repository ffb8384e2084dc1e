//! Bindings of the exact page profile (weightszip_core::page): codebook calibration and the
//! reference (CPU) page encoder and decoder. Buffers cross as (address, length) like in lib.rs.

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use weightszip_core::page::{self, PageCodebook};

use crate::{slice, slice_mut, to_py};

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
    let cb = PageCodebook::parse(codebook).map_err(to_py)?;
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
    let cb = PageCodebook::parse(codebook).map_err(to_py)?;
    let (buf, offs) = py
        .allow_threads(|| page::encode_pages_threads(&cb, unsafe { slice(addr, len) }, align, threads))
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
    let cb = PageCodebook::parse(codebook).map_err(to_py)?;
    py.allow_threads(|| {
        let out = unsafe { slice_mut(out_addr, out_len) };
        page::decode_pages_threads(&cb, unsafe { slice(addr, len) }, &offsets, out, threads)
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
