//! Bindings of the KV Exact and KV Exact4 page codecs (weightszip_core::kvx, ::kvx4): the CPU
//! encoders and validating decoders that write and read the bytes of the GPU kernels. Buffers
//! cross as (address, length).

use pyo3::prelude::*;
use pyo3::types::PyBytes;
use weightszip_core::kvx::{self, Shape};
use weightszip_core::kvx4;

use crate::{slice, slice_mut, to_py};

/// Window tops (one byte per channel) from `rows x channels` bf16 sample values.
#[pyfunction]
fn kvx_calibrate<'py>(py: Python<'py>, channels: usize, addr: usize, len: usize) -> PyResult<Bound<'py, PyBytes>> {
    let b = py.allow_threads(|| kvx::calibrate_bases(channels, unsafe { slice(addr, len) })).map_err(to_py)?;
    Ok(PyBytes::new(py, &b))
}

/// Encode whole pages (n x 16 x heads x head_dim bf16); returns (pages back to back, n + 1 offsets).
#[pyfunction]
fn kvx_encode<'py>(
    py: Python<'py>,
    heads: usize,
    head_dim: usize,
    bases: &[u8],
    addr: usize,
    len: usize,
) -> PyResult<(Bound<'py, PyBytes>, Vec<u64>)> {
    let shape = Shape::new(heads, head_dim).map_err(to_py)?;
    let (buf, offs) =
        py.allow_threads(|| kvx::encode_pages(shape, bases, unsafe { slice(addr, len) })).map_err(to_py)?;
    Ok((PyBytes::new(py, &buf), offs))
}

/// Decode and validate the pages at `offsets` (n + 1 entries) of the buffer at `addr` into the
/// buffer at `out_addr` (n x 16 x heads x head_dim bf16).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn kvx_decode(
    py: Python<'_>,
    heads: usize,
    head_dim: usize,
    bases: &[u8],
    addr: usize,
    len: usize,
    offsets: Vec<u64>,
    out_addr: usize,
    out_len: usize,
) -> PyResult<()> {
    let shape = Shape::new(heads, head_dim).map_err(to_py)?;
    py.allow_threads(|| {
        kvx::decode_pages(shape, bases, unsafe { slice(addr, len) }, &offsets, unsafe { slice_mut(out_addr, out_len) })
    })
    .map_err(to_py)
}

/// Encode whole KV Exact4 pages (n x 16 x heads x head_dim bf16); returns (pages back to back,
/// n + 1 offsets).
#[pyfunction]
fn kvx4_encode<'py>(
    py: Python<'py>,
    heads: usize,
    head_dim: usize,
    addr: usize,
    len: usize,
) -> PyResult<(Bound<'py, PyBytes>, Vec<u64>)> {
    let shape = kvx4::Shape::new(heads, head_dim).map_err(to_py)?;
    let (buf, offs) = py.allow_threads(|| kvx4::encode_pages(shape, unsafe { slice(addr, len) })).map_err(to_py)?;
    Ok((PyBytes::new(py, &buf), offs))
}

/// Decode and validate the KV Exact4 pages at `offsets` (n + 1 entries) of the buffer at `addr`
/// into the buffer at `out_addr` (n x 16 x heads x head_dim bf16).
#[pyfunction]
#[allow(clippy::too_many_arguments)]
fn kvx4_decode(
    py: Python<'_>,
    heads: usize,
    head_dim: usize,
    addr: usize,
    len: usize,
    offsets: Vec<u64>,
    out_addr: usize,
    out_len: usize,
) -> PyResult<()> {
    let shape = kvx4::Shape::new(heads, head_dim).map_err(to_py)?;
    py.allow_threads(|| {
        kvx4::decode_pages(shape, unsafe { slice(addr, len) }, &offsets, unsafe { slice_mut(out_addr, out_len) })
    })
    .map_err(to_py)
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(kvx_calibrate, m)?)?;
    m.add_function(wrap_pyfunction!(kvx_encode, m)?)?;
    m.add_function(wrap_pyfunction!(kvx_decode, m)?)?;
    m.add_function(wrap_pyfunction!(kvx4_encode, m)?)?;
    m.add_function(wrap_pyfunction!(kvx4_decode, m)?)?;
    Ok(())
}
