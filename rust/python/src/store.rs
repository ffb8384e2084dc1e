//! The chunk store (crate weightszip-store) as the Python class `_core.Store`. Every call releases
//! the GIL for its whole I/O and coding; batches run on the store's I/O pool.

use std::mem::ManuallyDrop;
use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};
use rayon::prelude::*;
use weightszip_core::codec::{self, EncodeOptions};
use weightszip_core::TensorMeta;
use weightszip_store::{Chunk, ChunkStore, StoreConfig};

use crate::{meta_of, slice, to_py, MetaTuple};

/// Tag of a chunk that holds a weightszip container (made by `put_tensors`).
pub const TAG_CONTAINER: u32 = 1;

#[pyclass(module = "weightszip._core", frozen)]
pub struct Store {
    /// Dropped by `Drop` below, with the GIL released.
    inner: ManuallyDrop<ChunkStore>,
}

impl Drop for Store {
    /// A store garbage-collected without `close` writes the chunks only in its RAM tier when it is
    /// dropped (`ChunkStore`'s drop: possibly gigabytes, with fsyncs): with the GIL released, as
    /// every call's I/O is, so that the process's other Python threads go on meanwhile (they
    /// stalled for the whole flush). Safe: Python drops a pyclass's value in its tp_dealloc, with
    /// the GIL held and no reference to the object left, and this class has neither weak
    /// references nor GC tracking, so no Python code can reach it while the GIL is released (as
    /// CPython's own files and sockets release it to close in their dealloc). `with_gil` only
    /// takes the token of the GIL held there.
    fn drop(&mut self) {
        // SAFETY: taken once, here, and `self.inner` is never used again.
        let inner = unsafe { ManuallyDrop::take(&mut self.inner) };
        Python::with_gil(|py| py.allow_threads(move || drop(inner)));
    }
}

fn chunk_to_py(py: Python<'_>, c: Option<Chunk>) -> PyObject {
    match c {
        None => py.None(),
        Some(c) => (c.tag, PyBytes::new(py, &c.data)).into_pyobject(py).expect("tuple").into_any().unbind(),
    }
}

#[pymethods]
impl Store {
    #[new]
    #[pyo3(signature = (dir, ram_bytes, disk_bytes, io_threads, durable, write_through, promote, max_chunk_bytes, redis_url=None, redis_prefix="wz:".to_string(), redis_timeout_ms=5000))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        dir: Option<PathBuf>,
        ram_bytes: u64,
        disk_bytes: u64,
        io_threads: usize,
        durable: bool,
        write_through: bool,
        promote: bool,
        max_chunk_bytes: u64,
        redis_url: Option<String>,
        redis_prefix: String,
        redis_timeout_ms: u64,
    ) -> PyResult<Store> {
        let cfg = StoreConfig {
            dir,
            ram_bytes,
            disk_bytes,
            io_threads,
            durable,
            write_through,
            promote,
            max_chunk_bytes,
            redis_url,
            redis_prefix,
            redis_timeout_ms,
        };
        let inner = py.allow_threads(|| ChunkStore::open(cfg)).map_err(to_py)?;
        Ok(Store { inner: ManuallyDrop::new(inner) })
    }

    /// Store the buffer at (addr, len) under `key` with `tag`.
    fn put(&self, py: Python<'_>, key: &[u8], addr: usize, len: usize, tag: u32) -> PyResult<()> {
        let key = key.to_vec();
        py.allow_threads(|| self.inner.put(&key, unsafe { slice(addr, len) }.to_vec(), tag)).map_err(to_py)
    }

    /// (tag, bytes) or None.
    fn get(&self, py: Python<'_>, key: &[u8]) -> PyResult<PyObject> {
        let key = key.to_vec();
        let c = py.allow_threads(|| self.inner.get(&key)).map_err(to_py)?;
        Ok(chunk_to_py(py, c))
    }

    /// Items (key, addr, len, tag); returns one None or exception object per item.
    fn put_many(&self, py: Python<'_>, items: Vec<(Bound<'_, PyBytes>, usize, usize, u32)>) -> Vec<PyObject> {
        let owned: Vec<(Vec<u8>, usize, usize, u32)> =
            items.iter().map(|(k, a, l, t)| (k.as_bytes().to_vec(), *a, *l, *t)).collect();
        let results = py.allow_threads(|| {
            let items: Vec<(Vec<u8>, Vec<u8>, u32)> =
                owned.into_iter().map(|(k, a, l, t)| (k, unsafe { slice(a, l) }.to_vec(), t)).collect();
            self.inner.put_many(items)
        });
        results.into_iter().map(|r| r.err().map_or_else(|| py.None(), |e| to_py(e).into_value(py).into_any())).collect()
    }

    /// One (tag, bytes), None or exception object per key.
    fn get_many(&self, py: Python<'_>, keys: Vec<Bound<'_, PyBytes>>) -> Vec<PyObject> {
        let keys: Vec<Vec<u8>> = keys.iter().map(|k| k.as_bytes().to_vec()).collect();
        let results = py.allow_threads(|| self.inner.get_many(&keys));
        results
            .into_iter()
            .map(|r| match r {
                Ok(c) => chunk_to_py(py, c),
                Err(e) => to_py(e).into_value(py).into_any(),
            })
            .collect()
    }

    /// Compress tensors (key, meta, addr, len) with the exact codec on the I/O pool, one chunk
    /// per tensor, and store them with tag TAG_CONTAINER. Returns the stored sizes in bytes, or
    /// an exception object per item. `level`: the encoder's (`EncodeOptions::level`).
    #[pyo3(signature = (items, chunk_bytes, lanes_log2, level=codec::LEVEL_DEFAULT))]
    fn put_tensors(
        &self,
        py: Python<'_>,
        items: Vec<(Bound<'_, PyBytes>, MetaTuple, usize, usize)>,
        chunk_bytes: u64,
        lanes_log2: u32,
        level: u8,
    ) -> PyResult<Vec<PyObject>> {
        let owned: Vec<(Vec<u8>, TensorMeta, usize, usize)> = items
            .iter()
            .map(|(k, m, a, l)| Ok((k.as_bytes().to_vec(), meta_of(m.clone())?, *a, *l)))
            .collect::<PyResult<_>>()?;
        // threads 0: the codec's chunks run on the pool this closure is installed on (the store's
        // I/O pool), beside the other tensors of the batch.
        let o = EncodeOptions { chunk_bytes, threads: 0, lanes_log2, level };
        let results: Vec<weightszip_core::Result<usize>> = py
            .allow_threads(|| {
                self.inner.install(|| {
                    owned
                        .into_par_iter()
                        .map(|(k, m, a, l)| {
                            let blob = codec::compress(&[(m, unsafe { slice(a, l) })], 0, &o)?;
                            let n = blob.len();
                            self.inner.put(&k, blob, TAG_CONTAINER)?;
                            Ok(n)
                        })
                        .collect()
                })
            })
            .map_err(to_py)?;
        Ok(results
            .into_iter()
            .map(|r| match r {
                Ok(n) => n.into_pyobject(py).expect("int").into_any().unbind(),
                Err(e) => to_py(e).into_value(py).into_any(),
            })
            .collect())
    }

    fn contains(&self, py: Python<'_>, key: &[u8]) -> PyResult<bool> {
        let key = key.to_vec();
        py.allow_threads(|| self.inner.contains(&key)).map_err(to_py)
    }

    fn delete(&self, py: Python<'_>, key: &[u8]) -> PyResult<bool> {
        let key = key.to_vec();
        py.allow_threads(|| self.inner.delete(&key)).map_err(to_py)
    }

    fn evict_from_ram(&self, py: Python<'_>, key: &[u8]) -> PyResult<bool> {
        let key = key.to_vec();
        py.allow_threads(|| self.inner.evict_from_ram(&key)).map_err(to_py)
    }

    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        py.allow_threads(|| self.inner.flush_all()).map_err(to_py)
    }

    /// Fail every later call (but close), wait for those in flight, flush: every acknowledged put
    /// is on disk when this returns.
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        py.allow_threads(|| self.inner.close()).map_err(to_py)
    }

    fn file_of(&self, py: Python<'_>, key: &[u8]) -> PyResult<Option<PathBuf>> {
        // (these wait for the store's lock, which a put of another thread may hold: not with the GIL)
        py.allow_threads(|| self.inner.file_of(key)).map_err(to_py)
    }

    fn stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = py.allow_threads(|| self.inner.stats()).map_err(to_py)?;
        let d = PyDict::new(py);
        for (k, v) in [
            ("ram_chunks", s.ram_chunks),
            ("ram_bytes", s.ram_bytes),
            ("disk_chunks", s.disk_chunks),
            ("disk_bytes", s.disk_bytes),
            ("flushing_chunks", s.flushing_chunks),
            ("puts", s.puts),
            ("hits_ram", s.hits_ram),
            ("hits_disk", s.hits_disk),
            ("hits_remote", s.hits_remote),
            ("misses", s.misses),
            ("evicted_to_disk", s.evicted_to_disk),
            ("dropped", s.dropped),
            ("corrupt_evicted", s.corrupt_evicted),
            ("flush_errors", s.flush_errors),
            ("unreadable_chunks", s.unreadable_chunks),
        ] {
            d.set_item(k, v)?;
        }
        Ok(d)
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Store>()?;
    m.add("STORE_TAG_CONTAINER", TAG_CONTAINER)?;
    Ok(())
}
