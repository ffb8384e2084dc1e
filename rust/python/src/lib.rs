//! Thin PyO3 layer: converts arguments, releases the GIL, maps errors. No codec logic here.
//!
//! Buffers cross as (address, length) pairs taken by the Python wrapper from numpy / torch /
//! bytes objects it keeps alive for the call: the abi3 (Python >= 3.10) limited API has no buffer
//! protocol, and this keeps input zero-copy and lets decoding write straight into the array that
//! Python returns.

use std::path::PathBuf;

mod kvx;
mod page;

mod store;

use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyKeyboardInterrupt};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use weightszip_core::codec::{self, EncodeOptions, OnExisting, Output};
use weightszip_core::format::{Index, TensorMeta};
use weightszip_core::{DType, Error};

create_exception!(_core, WeightszipError, PyException, "Base class of every weightszip error.");
create_exception!(_core, BadMagicError, WeightszipError, "The input is not a weightszip container.");
create_exception!(_core, UnsupportedVersionError, WeightszipError, "The container's format version is not supported.");
create_exception!(
    _core,
    UnsupportedFeatureError,
    UnsupportedVersionError,
    "The container uses a feature this version does not know."
);
create_exception!(_core, CorruptDataError, WeightszipError, "The container is corrupt or truncated.");
create_exception!(_core, TruncatedError, CorruptDataError, "The container ends before a structure it declares.");
create_exception!(_core, ChecksumMismatchError, CorruptDataError, "A checksum did not match.");
create_exception!(_core, LimitExceededError, WeightszipError, "A declared size exceeds a hard limit.");
create_exception!(_core, InvalidArgumentError, WeightszipError, "The call's arguments are not usable.");
create_exception!(_core, BufferTooSmallError, InvalidArgumentError, "An output buffer has the wrong size.");
create_exception!(_core, WeightszipIOError, WeightszipError, "Reading or writing a file failed.");
create_exception!(_core, OutputExistsError, WeightszipIOError, "The output file exists and was not to be overwritten.");

pub(crate) fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    // Exhaustive on purpose: a new variant must be given its exception class here.
    match e {
        Error::BadMagic => BadMagicError::new_err(msg),
        Error::UnsupportedVersion(..) => UnsupportedVersionError::new_err(msg),
        Error::Unsupported(_) => UnsupportedFeatureError::new_err(msg),
        Error::Truncated(_) => TruncatedError::new_err(msg),
        Error::Corrupt(_) => CorruptDataError::new_err(msg),
        Error::ChecksumMismatch(_) => ChecksumMismatchError::new_err(msg),
        Error::LimitExceeded(_) => LimitExceededError::new_err(msg),
        Error::InvalidArgument(_) => InvalidArgumentError::new_err(msg),
        Error::BufferTooSmall { .. } => BufferTooSmallError::new_err(msg),
        Error::OutputExists(_) => OutputExistsError::new_err(msg),
        // (only a progress callback stops the codec so, and `Progress::error` hands back what it raised)
        Error::Interrupted(_) => PyKeyboardInterrupt::new_err(msg),
        Error::Io(_) => WeightszipIOError::new_err(msg),
    }
}

/// # Safety contract
/// The Python wrapper passes the address and length of a live, contiguous buffer that it keeps
/// referenced for the whole call and does not mutate concurrently.
pub(crate) unsafe fn slice<'a>(addr: usize, len: usize) -> &'a [u8] {
    if len == 0 {
        &[]
    } else {
        std::slice::from_raw_parts(addr as *const u8, len)
    }
}

pub(crate) unsafe fn slice_mut<'a>(addr: usize, len: usize) -> &'a mut [u8] {
    if len == 0 {
        &mut []
    } else {
        std::slice::from_raw_parts_mut(addr as *mut u8, len)
    }
}

fn opts(chunk_bytes: u64, threads: usize, lanes_log2: u32, level: u8) -> EncodeOptions {
    EncodeOptions { chunk_bytes, threads, lanes_log2, level }
}

/// `overwrite=False`: the output is published only if its name is free at that moment.
fn on_existing(overwrite: bool) -> OnExisting {
    if overwrite {
        OnExisting::Replace
    } else {
        OnExisting::Refuse
    }
}

/// (name, dtype name, shape, channel axis, layout, flags)
type MetaTuple = (String, String, Vec<u64>, u8, u8, u8);

fn meta_of(t: MetaTuple) -> PyResult<TensorMeta> {
    let (name, dtype, shape, channel_axis, layout, flags) = t;
    let dtype = DType::from_name(&dtype).map_err(to_py)?;
    Ok(TensorMeta { name, dtype, shape, channel_axis, layout, flags })
}

fn index_to_py(py: Python<'_>, index: &Index) -> PyResult<PyObject> {
    let entries = PyList::empty(py);
    for e in &index.entries {
        let d = PyDict::new(py);
        d.set_item("name", &e.meta.name)?;
        d.set_item("dtype", e.meta.dtype.name())?;
        d.set_item("shape", e.meta.shape.clone())?;
        d.set_item("channel_axis", e.meta.channel_axis)?;
        d.set_item("layout", e.meta.layout)?;
        d.set_item("flags", e.meta.flags)?;
        d.set_item("raw_bytes", e.meta.raw_bytes().map_err(to_py)?)?;
        d.set_item("stored_bytes", e.stored_bytes())?;
        d.set_item("chunks", e.chunks.len())?;
        d.set_item("chunk_elems", e.chunk_elems)?;
        entries.append(d)?;
    }
    let out = PyDict::new(py);
    out.set_item("kind", index.kind)?;
    out.set_item("entries", entries)?;
    Ok(out.into_any().unbind())
}

/// Compress tensors given as (meta, address, length) into an in-memory container.
#[pyfunction]
#[pyo3(signature = (tensors, kind, chunk_bytes, threads, lanes_log2, level=codec::LEVEL_DEFAULT))]
fn compress_buffers<'py>(
    py: Python<'py>,
    tensors: Vec<(MetaTuple, usize, usize)>,
    kind: u8,
    chunk_bytes: u64,
    threads: usize,
    lanes_log2: u32,
    level: u8,
) -> PyResult<Bound<'py, PyBytes>> {
    let metas: Vec<(TensorMeta, usize, usize)> =
        tensors.into_iter().map(|(m, a, l)| Ok((meta_of(m)?, a, l))).collect::<PyResult<_>>()?;
    let o = opts(chunk_bytes, threads, lanes_log2, level);
    let out = py
        .allow_threads(|| {
            let items: Vec<(TensorMeta, &[u8])> =
                metas.iter().map(|(m, a, l)| (m.clone(), unsafe { slice(*a, *l) })).collect();
            codec::compress(&items, kind, &o)
        })
        .map_err(to_py)?;
    Ok(PyBytes::new(py, &out))
}

/// Save tensors to a container file, written atomically.
#[pyfunction]
#[pyo3(signature = (path, tensors, chunk_bytes, threads, lanes_log2, overwrite=true, level=codec::LEVEL_DEFAULT))]
#[allow(clippy::too_many_arguments)]
fn save_buffers(
    py: Python<'_>,
    path: PathBuf,
    tensors: Vec<(MetaTuple, usize, usize)>,
    chunk_bytes: u64,
    threads: usize,
    lanes_log2: u32,
    overwrite: bool,
    level: u8,
) -> PyResult<PyObject> {
    let metas: Vec<(TensorMeta, usize, usize)> =
        tensors.into_iter().map(|(m, a, l)| Ok((meta_of(m)?, a, l))).collect::<PyResult<_>>()?;
    let o = opts(chunk_bytes, threads, lanes_log2, level);
    let index = py
        .allow_threads(|| {
            let items: Vec<(TensorMeta, &[u8])> =
                metas.iter().map(|(m, a, l)| (m.clone(), unsafe { slice(*a, *l) })).collect();
            codec::save_tensors(&path, &items, &o, on_existing(overwrite))
        })
        .map_err(to_py)?;
    index_to_py(py, &index)
}

/// Parse and check the index of an in-memory container.
#[pyfunction]
fn buffer_index(py: Python<'_>, addr: usize, len: usize) -> PyResult<PyObject> {
    let index =
        py.allow_threads(|| codec::Container::parse(unsafe { slice(addr, len) }).map(|c| c.index)).map_err(to_py)?;
    index_to_py(py, &index)
}

/// Decode entry `entry` of an in-memory container into the buffer at `out_addr`.
#[pyfunction]
fn decode_buffer_entry(
    py: Python<'_>,
    addr: usize,
    len: usize,
    entry: usize,
    out_addr: usize,
    out_len: usize,
    threads: usize,
) -> PyResult<()> {
    py.allow_threads(|| {
        let c = codec::Container::parse(unsafe { slice(addr, len) })?;
        c.decode_entry(entry, unsafe { slice_mut(out_addr, out_len) }, threads)
    })
    .map_err(to_py)
}

/// Decode every chunk of an in-memory container and check every checksum.
#[pyfunction]
fn verify_buffer(py: Python<'_>, addr: usize, len: usize, threads: usize) -> PyResult<()> {
    py.allow_threads(|| codec::Container::parse(unsafe { slice(addr, len) })?.verify(threads)).map_err(to_py)
}

/// Read and check the index of a container file.
#[pyfunction]
fn file_index(py: Python<'_>, path: PathBuf) -> PyResult<PyObject> {
    let index = py
        .allow_threads(|| -> weightszip_core::Result<Index> {
            let mut f = codec::open_input(&path)?;
            Ok(codec::read_index(&mut f)?.0)
        })
        .map_err(to_py)?;
    index_to_py(py, &index)
}

/// Decode every entry of a container file through one open file, so that a file replaced meanwhile
/// (an atomic rename) is read as one version: its index goes to `alloc(index)`, which returns each
/// entry's output buffer as (address, length) and keeps the buffers alive; returns the index.
#[pyfunction]
fn decode_file_entries(py: Python<'_>, path: PathBuf, alloc: PyObject, threads: usize) -> PyResult<PyObject> {
    let (mut f, index) = py
        .allow_threads(|| -> weightszip_core::Result<_> {
            let mut f = codec::open_input(&path)?;
            let (index, _) = codec::read_index(&mut f)?;
            Ok((f, index))
        })
        .map_err(to_py)?;
    let index_py = index_to_py(py, &index)?;
    let outs: Vec<(usize, usize)> = alloc.call1(py, (index_py.clone_ref(py),))?.extract(py)?;
    if outs.len() != index.entries.len() {
        return Err(InvalidArgumentError::new_err(format!(
            "alloc returned {} buffers for {} entries",
            outs.len(),
            index.entries.len()
        )));
    }
    py.allow_threads(|| -> weightszip_core::Result<()> {
        for (ei, &(addr, len)) in outs.iter().enumerate() {
            codec::decode_file_entry(&path, &mut f, &index, ei, unsafe { slice_mut(addr, len) }, threads)?;
        }
        Ok(())
    })
    .map_err(to_py)?;
    Ok(index_py)
}

/// The Python side of a file writer's progress, called once per batch of chunks: the caller's
/// callback, if any, then a check for signals (Ctrl-C while Rust works runs Python's handler here).
struct Progress {
    cb: Option<PyObject>,
    /// What stops the codec: an exception that is not an `Exception` (KeyboardInterrupt,
    /// SystemExit, ...) raised by the callback, or any raised by a signal handler.
    stopped: Option<PyErr>,
}

impl Progress {
    fn new(cb: Option<PyObject>) -> Self {
        Progress { cb, stopped: None }
    }

    fn call(&mut self, done: u64, total: u64) -> weightszip_core::Result<()> {
        Python::with_gil(|py| {
            if let Some(cb) = &self.cb {
                if let Err(e) = cb.call1(py, (done, total)) {
                    if e.is_instance_of::<PyException>(py) {
                        // An ordinary error of a progress callback does not stop the codec: it is
                        // reported and the work goes on.
                        e.print(py);
                    } else {
                        self.stopped = Some(e);
                    }
                }
            }
            if self.stopped.is_none() {
                if let Err(e) = py.check_signals() {
                    self.stopped = Some(e);
                }
            }
            match &self.stopped {
                Some(e) => Err(Error::Interrupted(format!("{e}"))),
                None => Ok(()),
            }
        })
    }

    /// The Python exception for the codec's error `e`: what stopped it, if that was this.
    fn error(&mut self, e: Error) -> PyErr {
        match (e, self.stopped.take()) {
            (Error::Interrupted(_), Some(stopped)) => stopped,
            (e, _) => to_py(e),
        }
    }
}

/// Compress a file as segments (tensor-aware where the caller found tensors), streaming. `mode`: the
/// output's permission bits (`Output::mode`). An interrupt in or during `progress` stops it, with no
/// output, and is raised.
#[pyfunction]
#[pyo3(signature = (input, output, segments, chunk_bytes, threads, lanes_log2, progress=None, overwrite=true, mode=None, level=codec::LEVEL_DEFAULT))]
#[allow(clippy::too_many_arguments)]
fn encode_file(
    py: Python<'_>,
    input: PathBuf,
    output: PathBuf,
    segments: Vec<MetaTuple>,
    chunk_bytes: u64,
    threads: usize,
    lanes_log2: u32,
    progress: Option<PyObject>,
    overwrite: bool,
    mode: Option<u32>,
    level: u8,
) -> PyResult<PyObject> {
    let segs: Vec<TensorMeta> = segments.into_iter().map(meta_of).collect::<PyResult<_>>()?;
    let o = opts(chunk_bytes, threads, lanes_log2, level);
    let mut p = Progress::new(progress);
    let out = Output { path: &output, on_existing: on_existing(overwrite), mode };
    let index = py
        .allow_threads(|| codec::encode_file(&input, out, &segs, &o, &mut |d, t| p.call(d, t)))
        .map_err(|e| p.error(e))?;
    index_to_py(py, &index)
}

/// Decode a container file to `output` (None: verify only), streaming: `prefix` first, then the
/// entries' bytes (see `codec::decode_file`). `mode` and interrupts as for `encode_file`.
#[pyfunction]
#[pyo3(signature = (input, output, threads, progress=None, overwrite=true, prefix=None, mode=None))]
#[allow(clippy::too_many_arguments)]
fn decode_file(
    py: Python<'_>,
    input: PathBuf,
    output: Option<PathBuf>,
    threads: usize,
    progress: Option<PyObject>,
    overwrite: bool,
    prefix: Option<PyObject>,
    mode: Option<u32>,
) -> PyResult<PyObject> {
    let mut p = Progress::new(progress);
    let out = output.as_deref().map(|path| Output { path, on_existing: on_existing(overwrite), mode });
    // `prefix(index)` (the index of the file as this call opened it) -> bytes; what it raises is
    // kept here and raised, the codec stopped with nothing written
    let mut prefix_error: Option<PyErr> = None;
    let mut prefix_of = |index: &Index| -> weightszip_core::Result<Vec<u8>> {
        let Some(make) = &prefix else { return Ok(Vec::new()) };
        Python::with_gil(|py| {
            index_to_py(py, index).and_then(|i| make.call1(py, (i,))).and_then(|b| b.extract::<Vec<u8>>(py)).map_err(
                |e| {
                    let msg = format!("prefix: {e}");
                    prefix_error = Some(e);
                    Error::InvalidArgument(msg)
                },
            )
        })
    };
    let index = py
        .allow_threads(|| codec::decode_file_with(&input, out, &mut prefix_of, threads, &mut |d, t| p.call(d, t)))
        .map_err(|e| prefix_error.take().unwrap_or_else(|| p.error(e)))?;
    index_to_py(py, &index)
}

/// XXH3-64 (seed 0) of a buffer: the checksum the format uses, for tools that build containers.
#[pyfunction]
fn xxh3_64(py: Python<'_>, addr: usize, len: usize) -> u64 {
    py.allow_threads(|| xxhash_rust::xxh3::xxh3_64(unsafe { slice(addr, len) }))
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("FORMAT_VERSION", weightszip_core::format::VERSION)?;
    m.add("DEFAULT_CHUNK_BYTES", EncodeOptions::default().chunk_bytes)?;
    m.add("DEFAULT_LANES_LOG2", EncodeOptions::default().lanes_log2)?;
    m.add("DEFAULT_LEVEL", codec::LEVEL_DEFAULT)?;
    m.add("LEVEL_FAST", codec::LEVEL_FAST)?;
    m.add("WeightszipError", py.get_type::<WeightszipError>())?;
    m.add("BadMagicError", py.get_type::<BadMagicError>())?;
    m.add("UnsupportedVersionError", py.get_type::<UnsupportedVersionError>())?;
    m.add("UnsupportedFeatureError", py.get_type::<UnsupportedFeatureError>())?;
    m.add("CorruptDataError", py.get_type::<CorruptDataError>())?;
    m.add("TruncatedError", py.get_type::<TruncatedError>())?;
    m.add("ChecksumMismatchError", py.get_type::<ChecksumMismatchError>())?;
    m.add("LimitExceededError", py.get_type::<LimitExceededError>())?;
    m.add("InvalidArgumentError", py.get_type::<InvalidArgumentError>())?;
    m.add("BufferTooSmallError", py.get_type::<BufferTooSmallError>())?;
    m.add("WeightszipIOError", py.get_type::<WeightszipIOError>())?;
    m.add("OutputExistsError", py.get_type::<OutputExistsError>())?;
    m.add("MAX_THREADS", codec::MAX_THREADS)?;
    m.add_function(wrap_pyfunction!(compress_buffers, m)?)?;
    m.add_function(wrap_pyfunction!(save_buffers, m)?)?;
    m.add_function(wrap_pyfunction!(buffer_index, m)?)?;
    m.add_function(wrap_pyfunction!(decode_buffer_entry, m)?)?;
    m.add_function(wrap_pyfunction!(verify_buffer, m)?)?;
    m.add_function(wrap_pyfunction!(file_index, m)?)?;
    m.add_function(wrap_pyfunction!(decode_file_entries, m)?)?;
    m.add_function(wrap_pyfunction!(encode_file, m)?)?;
    m.add_function(wrap_pyfunction!(decode_file, m)?)?;
    m.add_function(wrap_pyfunction!(xxh3_64, m)?)?;
    page::register(m)?;
    kvx::register(m)?;
    store::register(m)?;
    Ok(())
}
