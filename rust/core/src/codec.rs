//! Tensors and files in and out of containers: chunking, parallel coding, checksums, streaming.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Read, Seek, SeekFrom, Write};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use rayon::prelude::*;

use crate::chunk::{self, DEFAULT_LANES_LOG2, MAX_LANES_LOG2};
use crate::dtype::DType;
use crate::error::{corrupt, Error, Result};
use crate::format::{
    self, check_preamble, index_checksum, parse_trailer, EncodedChunk, Entry, Index, TensorMeta, Writer, KIND_FILE,
    MAX_CHUNK_RAW, PREAMBLE_LEN, TRAILER_LEN,
};

#[derive(Debug, Clone, Copy)]
pub struct EncodeOptions {
    /// Target raw bytes per chunk; chunks hold whole rows when a row fits. 1 MiB keeps the
    /// per-chunk tables under 0.3% of the output on real KV while leaving enough chunks to spread
    /// over threads.
    pub chunk_bytes: u64,
    /// Worker threads; 0 means one per core.
    pub threads: usize,
    /// log2 of the rANS lanes per chunk.
    pub lanes_log2: u32,
    /// How hard the encoder looks for each chunk's model: `LEVEL_FAST` (1) or `LEVEL_DEFAULT` (2).
    /// Readers do not care which.
    pub level: u8,
}

/// Encoder level 1: each chunk's model is chosen among fewer candidates (the first context stride
/// only, with and without channel groups, each symbol width) and built once. On real bf16 KV
/// 1.2-1.3x faster to encode than level 2 (1.4-1.7x on 256-token LMCache chunks) for 0-0.16% more
/// bytes, and as fast to decode; no faster on fp8 or on tensors under 2^17 values, which both
/// levels search in full (BENCHMARKS.md, "Encoder levels").
pub const LEVEL_FAST: u8 = 1;
/// Encoder level 2 (the default): candidate symbol widths, context strides and channel groupings
/// ranked on a sample of the chunk, the best built in full.
pub const LEVEL_DEFAULT: u8 = 2;

impl Default for EncodeOptions {
    fn default() -> Self {
        EncodeOptions { chunk_bytes: 1 << 20, threads: 0, lanes_log2: DEFAULT_LANES_LOG2, level: LEVEL_DEFAULT }
    }
}

impl EncodeOptions {
    fn check(&self) -> Result<()> {
        if self.chunk_bytes == 0 || self.chunk_bytes > MAX_CHUNK_RAW {
            return Err(Error::InvalidArgument(format!("chunk size {} outside 1..={MAX_CHUNK_RAW}", self.chunk_bytes)));
        }
        if self.lanes_log2 > MAX_LANES_LOG2 {
            return Err(Error::InvalidArgument(format!("2^{} lanes", self.lanes_log2)));
        }
        if !(LEVEL_FAST..=LEVEL_DEFAULT).contains(&self.level) {
            return Err(Error::InvalidArgument(format!(
                "encoder level {} outside {LEVEL_FAST}..={LEVEL_DEFAULT}",
                self.level
            )));
        }
        Ok(())
    }
}

/// The most worker threads a call uses; a larger count is taken as this many (as zstd caps its
/// workers), so that a mistyped count neither spawns a thread for every chunk nor batches that many
/// chunks in memory (`batch_len`).
pub const MAX_THREADS: usize = 256;

/// Pools kept for reuse; past this many distinct counts the cache is emptied (pools in use stay
/// alive until their calls end), so varying counts cannot pile up idle threads.
const MAX_CACHED_POOLS: usize = 8;

/// Run `f` on a pool of `threads` workers (0: the global pool, one per core; at most
/// `MAX_THREADS`). Pools are cached. If the system refuses the threads, `f` runs on the global pool.
pub fn with_threads<T: Send>(threads: usize, f: impl FnOnce() -> T + Send) -> T {
    let threads = threads.min(MAX_THREADS);
    if threads == 0 {
        return f();
    }
    static POOLS: OnceLock<Mutex<HashMap<usize, Arc<rayon::ThreadPool>>>> = OnceLock::new();
    let pool = {
        let mut pools = POOLS.get_or_init(|| Mutex::new(HashMap::new())).lock().unwrap_or_else(|e| e.into_inner());
        match pools.get(&threads) {
            Some(p) => Some(p.clone()),
            None => match rayon::ThreadPoolBuilder::new().num_threads(threads).build() {
                Ok(p) => {
                    if pools.len() >= MAX_CACHED_POOLS {
                        pools.clear();
                    }
                    let p = Arc::new(p);
                    pools.insert(threads, p.clone());
                    Some(p)
                }
                Err(_) => None,
            },
        }
    };
    match pool {
        Some(p) => p.install(f),
        None => f(),
    }
}

/// Elements per chunk: whole rows (see `TensorMeta::row_elems`) when a row fits the target.
pub fn chunk_elems_for(meta: &TensorMeta, opts: &EncodeOptions) -> u64 {
    if meta.n_elems().unwrap_or(0) == 0 {
        return 0;
    }
    let size = meta.dtype.size() as u64;
    let target = (opts.chunk_bytes / size).max(1);
    let row = meta.row_elems();
    if row <= target {
        (target / row) * row
    } else {
        target
    }
}

/// Context strides, in coding units, that the encoder may choose from for this tensor.
fn strides_for(meta: &TensorMeta) -> Vec<usize> {
    let row = meta.row_elems() as usize;
    let size = meta.dtype.size();
    match meta.dtype {
        DType::BF16 | DType::F16 | DType::F32 | DType::F8E4M3 | DType::F8E5M2 => vec![row, 1],
        DType::U8 => vec![1, row],
        // Byte-coded multi-byte types: the same byte of the previous element or row.
        _ => vec![size, row * size],
    }
}

pub fn encode_chunk_bytes(raw: &[u8], meta: &TensorMeta, lanes_log2: u32, level: u8) -> EncodedChunk {
    // Rows that repeat exactly (layer 0's V: one row per token id) are looked for in tensors,
    // not in opaque file bytes.
    let row_bytes = if meta.dtype == DType::U8 { 0 } else { meta.row_elems() as usize * meta.dtype.size() };
    let search = level >= LEVEL_DEFAULT;
    let payload = chunk::encode_chunk(raw, meta.dtype.split(), &strides_for(meta), lanes_log2, row_bytes, search);
    EncodedChunk { payload, raw_xxh3: xxhash_rust::xxh3::xxh3_64(raw) }
}

/// Encode a whole in-memory tensor into chunks, in parallel.
pub fn encode_tensor_chunks(data: &[u8], meta: &TensorMeta, opts: &EncodeOptions) -> Result<(u64, Vec<EncodedChunk>)> {
    opts.check()?;
    meta.check()?;
    let expect = meta.raw_bytes()?;
    if data.len() as u64 != expect {
        return Err(Error::InvalidArgument(format!(
            "{} bytes given for a {} tensor of shape {:?} ({expect} bytes)",
            data.len(),
            meta.dtype.name(),
            meta.shape
        )));
    }
    let ce = chunk_elems_for(meta, opts);
    let cb = (ce * meta.dtype.size() as u64) as usize;
    let chunks = with_threads(opts.threads, || {
        data.par_chunks(cb.max(1)).map(|c| encode_chunk_bytes(c, meta, opts.lanes_log2, opts.level)).collect()
    });
    Ok((ce, chunks))
}

/// Compress tensors into one in-memory container.
pub fn compress(tensors: &[(TensorMeta, &[u8])], kind: u8, opts: &EncodeOptions) -> Result<Vec<u8>> {
    let mut w = Writer::new(Vec::new(), kind)?;
    for (meta, data) in tensors {
        let (ce, chunks) = encode_tensor_chunks(data, meta, opts)?;
        w.begin_entry(meta.clone(), ce)?;
        for c in &chunks {
            w.write_chunk(c)?;
        }
    }
    Ok(w.finish()?.0)
}

fn check_chunk(entry: &Entry, ei: usize, k: usize, stored: &[u8], out: &mut [u8]) -> Result<()> {
    let c = &entry.chunks[k];
    if xxhash_rust::xxh3::xxh3_64(stored) != c.stored_xxh3 {
        return Err(Error::ChecksumMismatch(format!("entry {ei} chunk {k}: stored bytes")));
    }
    chunk::decode_chunk(stored, out).map_err(|e| match e {
        Error::Corrupt(m) => Error::Corrupt(format!("entry {ei} chunk {k}: {m}")),
        Error::Truncated(m) => Error::Corrupt(format!("entry {ei} chunk {k}: {m}")),
        Error::Unsupported(m) => Error::Unsupported(format!("entry {ei} chunk {k}: {m}")),
        other => other,
    })?;
    if xxhash_rust::xxh3::xxh3_64(out) != c.raw_xxh3 {
        return Err(Error::ChecksumMismatch(format!("entry {ei} chunk {k}: decoded bytes")));
    }
    Ok(())
}

/// A parsed in-memory container.
pub struct Container<'a> {
    pub buf: &'a [u8],
    pub index: Index,
}

impl<'a> Container<'a> {
    pub fn parse(buf: &'a [u8]) -> Result<Container<'a>> {
        check_preamble(buf)?;
        let total = buf.len() as u64;
        if total < PREAMBLE_LEN + TRAILER_LEN {
            return Err(Error::Truncated(format!("{total} bytes is shorter than an empty container")));
        }
        let t = &buf[(total - TRAILER_LEN) as usize..];
        let (io, il, sum) = parse_trailer(t, total)?;
        let ib = &buf[io as usize..(io + il) as usize];
        if index_checksum(&buf[..PREAMBLE_LEN as usize], ib) != sum {
            return Err(Error::ChecksumMismatch("index".into()));
        }
        let index = Index::parse(ib, io)?;
        Ok(Container { buf, index })
    }

    /// Decode entry `ei` into `out` (exactly its raw size), chunks in parallel.
    pub fn decode_entry(&self, ei: usize, out: &mut [u8], threads: usize) -> Result<()> {
        let e = self.index.entries.get(ei).ok_or_else(|| Error::InvalidArgument(format!("no entry {ei}")))?;
        let need = e.meta.raw_bytes()?;
        if out.len() as u64 != need {
            return Err(Error::BufferTooSmall { need, have: out.len() as u64 });
        }
        if e.chunks.is_empty() {
            return Ok(());
        }
        let cb = (e.chunk_elems * e.meta.dtype.size() as u64) as usize;
        with_threads(threads, || {
            out.par_chunks_mut(cb).enumerate().try_for_each(|(k, o)| {
                let c = &e.chunks[k];
                let stored = &self.buf[c.offset as usize..(c.offset + c.stored_len as u64) as usize];
                check_chunk(e, ei, k, stored, o)
            })
        })
    }

    pub fn decode_entry_vec(&self, ei: usize, threads: usize) -> Result<Vec<u8>> {
        let need = self.index.entries.get(ei).map(|e| e.meta.raw_bytes()).transpose()?.unwrap_or(0);
        let mut v = vec![0u8; need as usize];
        self.decode_entry(ei, &mut v, threads)?;
        Ok(v)
    }

    /// Decode every chunk and check every checksum, keeping one chunk per thread in memory.
    pub fn verify(&self, threads: usize) -> Result<()> {
        with_threads(threads, || {
            self.index.entries.par_iter().enumerate().try_for_each(|(ei, e)| {
                (0..e.chunks.len()).into_par_iter().try_for_each(|k| {
                    let (a, b) = e.chunk_raw_range(k);
                    let c = &e.chunks[k];
                    let stored = &self.buf[c.offset as usize..(c.offset + c.stored_len as u64) as usize];
                    let mut out = vec![0u8; (b - a) as usize];
                    check_chunk(e, ei, k, stored, &mut out)
                })
            })
        })
    }
}

/// Read and check the preamble, trailer and index of a container file.
pub fn read_index<R: Read + Seek>(r: &mut R) -> Result<(Index, u64)> {
    let total = r.seek(SeekFrom::End(0))?;
    let mut pre = vec![0u8; (PREAMBLE_LEN.min(total)) as usize];
    r.seek(SeekFrom::Start(0))?;
    r.read_exact(&mut pre)?;
    check_preamble(&pre)?;
    if total < PREAMBLE_LEN + TRAILER_LEN {
        return Err(Error::Truncated(format!("{total} bytes is shorter than an empty container")));
    }
    let mut t = [0u8; TRAILER_LEN as usize];
    r.seek(SeekFrom::Start(total - TRAILER_LEN))?;
    r.read_exact(&mut t)?;
    let (io, il, sum) = parse_trailer(&t, total)?;
    let mut ib = vec![0u8; il as usize];
    r.seek(SeekFrom::Start(io))?;
    r.read_exact(&mut ib)?;
    if index_checksum(&pre, &ib) != sum {
        return Err(Error::ChecksumMismatch("index".into()));
    }
    Ok((Index::parse(&ib, io)?, total))
}

/// Read one chunk payload; a file that ends early (changed since its index was read) is truncated.
fn read_payload(f: &mut File, len: u32) -> Result<Vec<u8>> {
    let mut b = vec![0u8; len as usize];
    f.read_exact(&mut b).map_err(|err| match err.kind() {
        std::io::ErrorKind::UnexpectedEof => Error::Truncated("chunk payload".into()),
        _ => Error::Io(err),
    })?;
    Ok(b)
}

/// Chunks handed to the thread pool at once when streaming: bounds memory to about
/// `threads * STREAM_BATCH_PER_THREAD` chunks of input plus their output.
const STREAM_BATCH_PER_THREAD: usize = 4;

fn batch_len(threads: usize) -> usize {
    let t = if threads == 0 { rayon::current_num_threads() } else { threads.min(MAX_THREADS) };
    t.max(1) * STREAM_BATCH_PER_THREAD
}

/// Bytes of the output's name kept in its temporary file's name.
const TEMPORARY_NAME_PREFIX_MAX: usize = 160;

/// What a writer does if its output exists when the finished output is published.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnExisting {
    /// Replace it (an atomic rename over it); a regular file's permission mode is kept.
    #[default]
    Replace,
    /// Leave it and fail with `Error::OutputExists`: the output is published with no-replace
    /// semantics (a hard link to the finished temporary file, which fails if the name is taken,
    /// even by a file created while the output was being written).
    Refuse,
}

/// Where a file writer puts its output, and how.
#[derive(Debug, Clone, Copy)]
pub struct Output<'a> {
    pub path: &'a Path,
    /// What to do if `path` exists when the output is published.
    pub on_existing: OnExisting,
    /// Permission bits (read, write, execute: `mode & 0o777`) for the output, e.g. its input's, as
    /// gzip and zstd do; set on the temporary file before anything is written to it. None: the usual
    /// 0o666 less the umask. A regular file replaced under `OnExisting::Replace` keeps its own mode
    /// instead. Unix only (elsewhere ignored).
    pub mode: Option<u32>,
}

impl<'a> Output<'a> {
    pub fn new(path: &'a Path, on_existing: OnExisting) -> Self {
        Output { path, on_existing, mode: None }
    }
}

/// What a file writer calls with (bytes done, bytes in all) as it goes: an error (e.g.
/// `Error::Interrupted`) stops it, with no output and no temporary file left.
pub type Progress<'a> = &'a mut dyn FnMut(u64, u64) -> Result<()>;

/// `e`, its message prefixed with `path`: the file an I/O error happened on.
fn name_io(path: &Path, e: std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), format!("{}: {e}", path.display()))
}

/// `Error::Io` naming `path` (other errors as they are).
fn at(path: &Path) -> impl Fn(Error) -> Error + '_ {
    move |e| match e {
        Error::Io(io) => Error::Io(name_io(path, io)),
        other => other,
    }
}

/// `Error::Io` naming `path`, from an `std::io::Error`.
fn io_at(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |e| Error::Io(name_io(path, e))
}

/// Open the input file `path`; an error names it.
pub fn open_input(path: &Path) -> Result<File> {
    File::open(path).map_err(io_at(path))
}

/// The output file's writes: an error names the output (not its temporary file).
struct OutputWriter<'a> {
    file: File,
    path: &'a Path,
}

impl Write for OutputWriter<'_> {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.file.write(b).map_err(|e| name_io(self.path, e))
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.file.flush().map_err(|e| name_io(self.path, e))
    }
}

/// The part of the temporary names of `path`'s output before the PID: `.NAME.` (NAME cut, at a
/// character boundary, so that the temporary name stays within the file system's 255 bytes).
fn temporary_prefix(path: &Path) -> String {
    let mut name = path.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
    let mut cut = name.len().min(TEMPORARY_NAME_PREFIX_MAX);
    while !name.is_char_boundary(cut) {
        cut -= 1;
    }
    name.truncate(cut);
    format!(".{name}.")
}

/// The PID in a temporary file name of the output whose names start with `prefix`: the name is
/// exactly `PREFIX PID.N.XXXXXXXX.wz-partial` (N decimal, X lowercase hex; the Python writer's
/// names have the same shape). The name of another output that starts with this one's (NAME.1)
/// has more dot-separated parts, so it never matches. (Also the chunk store's temporaries'.)
pub fn temporary_pid(file_name: &str, prefix: &str) -> Option<u32> {
    let middle = file_name.strip_prefix(prefix)?.strip_suffix(".wz-partial")?;
    let parts: Vec<&str> = middle.split('.').collect();
    let decimal = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let hex8 = |s: &str| s.len() == 8 && s.bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b));
    if parts.len() != 3 || !decimal(parts[0]) || !decimal(parts[1]) || !hex8(parts[2]) {
        return None;
    }
    parts[0].parse().ok()
}

/// Whether process `pid` is known not to be running: on Linux, through /proc (where /proc is not
/// mounted, and on other systems, nothing is known, and None is returned).
pub fn process_gone(pid: u32) -> Option<bool> {
    if !Path::new("/proc/self").exists() {
        return None;
    }
    Some(!Path::new(&format!("/proc/{pid}")).exists())
}

/// Remove the temporary files of `path`'s output left by writers that died without cleaning up
/// (a SIGKILL, a power cut): those whose PID is not a running process (Linux only; see
/// `process_gone`). A live writer's file (this process's included) is never touched, nor any file
/// whose name is not exactly of the temporary shape.
fn remove_stale_temporaries(path: &Path) {
    let me = std::process::id();
    let prefix = temporary_prefix(path);
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(|n| temporary_pid(n, &prefix)) else { continue };
        if pid == me || process_gone(pid) != Some(true) {
            continue;
        }
        if e.file_type().is_ok_and(|t| t.is_file()) {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

/// A number another process cannot guess: `salt` and the time hashed through a `RandomState`
/// (seeded from the OS's random source, different on each call). For names, not for secrets.
pub fn random_u64(salt: u64) -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(salt);
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH);
    h.write_u128(now.map_or(0, |d| d.as_nanos()));
    h.finish()
}

/// A new, empty file beside `path` named `.NAME.PID.N.XXXXXXXX.wz-partial` (N: a per-process
/// counter, X: a random number), created exclusively: it never opens an existing file (a user's,
/// or another writer's of the same output), so concurrent writers of one output never share it.
/// (The chunk store writes its chunk files through it too.)
pub fn create_temporary(path: &Path) -> Result<(std::path::PathBuf, File)> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let prefix = temporary_prefix(path);
    let pid = std::process::id();
    let mut attempt = 0;
    loop {
        let n = COUNTER.fetch_add(1, Ordering::Relaxed);
        let tmp = path.with_file_name(format!("{prefix}{pid}.{n}.{:08x}.wz-partial", random_u64(n) as u32));
        match std::fs::OpenOptions::new().write(true).create_new(true).open(&tmp) {
            Ok(f) => return Ok((tmp, f)),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempt < 100 => attempt += 1,
            Err(e) => return Err(Error::Io(e)),
        }
    }
}

/// Removes the temporary file when dropped, unless disarmed: on an error, and on a panic too.
struct RemoveOnDrop<'a>(Option<&'a Path>);

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.0 {
            let _ = std::fs::remove_file(p);
        }
    }
}

fn output_exists(path: &Path) -> Error {
    Error::OutputExists(path.display().to_string())
}

/// Publish the finished temporary file `tmp` under `path` (see `OnExisting`). With `Refuse`, a
/// file system without hard links (some FUSE or network ones, FAT) gets a check for `path`, then a
/// rename: a file created between the two is replaced, as without the check.
fn publish(tmp: &Path, path: &Path, on_existing: OnExisting) -> Result<()> {
    match on_existing {
        OnExisting::Replace => std::fs::rename(tmp, path)?,
        OnExisting::Refuse => match std::fs::hard_link(tmp, path) {
            Ok(()) => {
                let _ = std::fs::remove_file(tmp);
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return Err(output_exists(path)),
            Err(_) => {
                if std::fs::symlink_metadata(path).is_ok() {
                    return Err(output_exists(path));
                }
                std::fs::rename(tmp, path)?;
            }
        },
    }
    Ok(())
}

/// Keep the permission mode of the regular file at `path` that `file` is about to replace (read,
/// write and execute bits only; Unix, elsewhere nothing). Whether there was one.
fn keep_mode(file: &File, path: &Path) -> Result<bool> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        if let Ok(m) = std::fs::metadata(path) {
            if m.is_file() {
                set_mode(file, m.permissions().mode())?;
                return Ok(true);
            }
        }
    }
    #[cfg(not(unix))]
    let _ = (file, path);
    Ok(false)
}

/// Give `file` the permission bits of `mode` (`mode & 0o777`; Unix, elsewhere nothing).
fn set_mode(file: &File, mode: u32) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        file.set_permissions(std::fs::Permissions::from_mode(mode & 0o777))?;
    }
    #[cfg(not(unix))]
    let _ = (file, mode);
    Ok(())
}

/// Write to `out.path` through a temporary file (see `create_temporary`) published under it on
/// success (see `OnExisting`), so a failed or interrupted run never leaves a partial file under
/// the final name, and the temporary file is removed on any failure or panic. First removes the
/// temporary files of earlier writers of the path that were killed (`remove_stale_temporaries`).
/// The output's mode: see `Output::mode`. An I/O error of the output names its path.
fn write_atomically(out: Output<'_>, f: impl FnOnce(&mut BufWriter<OutputWriter<'_>>) -> Result<()>) -> Result<()> {
    let (path, on_existing) = (out.path, out.on_existing);
    remove_stale_temporaries(path);
    let (tmp, file) = create_temporary(path).map_err(at(path))?;
    let guard = RemoveOnDrop(Some(&tmp));
    // (before any byte is written: no one can open the temporary file under a wider mode meanwhile)
    let replacing = on_existing == OnExisting::Replace && keep_mode(&file, path).map_err(at(path))?;
    if let (false, Some(mode)) = (replacing, out.mode) {
        set_mode(&file, mode).map_err(at(path))?;
    }
    let mut w = BufWriter::with_capacity(1 << 20, OutputWriter { file, path });
    f(&mut w)?;
    w.flush()?;
    let file = &w.get_ref().file;
    if on_existing == OnExisting::Replace {
        keep_mode(file, path).map_err(at(path))?; // (a file created at `path` meanwhile)
    }
    file.sync_all().map_err(io_at(path))?;
    drop(w);
    // (a publish that fails, e.g. onto a directory, leaves no temporary file behind either)
    publish(&tmp, path, on_existing).map_err(at(path))?;
    std::mem::forget(guard);
    Ok(())
}

/// Compress a file as a sequence of segments that cover it exactly, in order (tensors get
/// tensor-aware coding, the rest is coded as bytes). Memory stays bounded by the batch size.
/// A file written while it is read (longer, shorter or modified at the end than at the start)
/// is an error, and no output is left: the container would hold a mix, or a prefix, of it.
///
/// `progress` is called with (bytes done, bytes in all) after each batch of chunks; an error from it
/// stops the run with that error and no output.
pub fn encode_file(
    input: &Path,
    output: Output<'_>,
    segments: &[TensorMeta],
    opts: &EncodeOptions,
    progress: Progress<'_>,
) -> Result<Index> {
    opts.check()?;
    let mut f = open_input(input)?;
    let before = f.metadata().map_err(io_at(input))?;
    let total = before.len();
    let mut sum = 0u64;
    for s in segments {
        s.check()?;
        sum += s.raw_bytes()?;
    }
    if sum != total {
        return Err(Error::InvalidArgument(format!("segments cover {sum} bytes of a {total}-byte file")));
    }
    let mut index = None;
    write_atomically(output, |w| {
        let mut wr = Writer::new(w, KIND_FILE)?;
        let mut done = 0u64;
        progress(0, total)?;
        for meta in segments {
            let ce = chunk_elems_for(meta, opts);
            let cb = ce * meta.dtype.size() as u64;
            let mut left = meta.raw_bytes()?;
            wr.begin_entry(meta.clone(), ce)?;
            while left > 0 {
                let mut bufs = Vec::new();
                while left > 0 && bufs.len() < batch_len(opts.threads) {
                    let n = cb.min(left);
                    let mut b = vec![0u8; n as usize];
                    f.read_exact(&mut b).map_err(|e| match e.kind() {
                        std::io::ErrorKind::UnexpectedEof => changed(input, total, f.metadata().map_or(0, |m| m.len())),
                        _ => io_at(input)(e),
                    })?;
                    left -= n;
                    bufs.push(b);
                }
                let enc: Vec<EncodedChunk> = with_threads(opts.threads, || {
                    bufs.par_iter().map(|b| encode_chunk_bytes(b, meta, opts.lanes_log2, opts.level)).collect()
                });
                for (c, b) in enc.iter().zip(&bufs) {
                    wr.write_chunk(c)?;
                    done += b.len() as u64;
                }
                progress(done, total)?;
            }
        }
        unchanged_since(&mut f, &before, input)?;
        index = Some(wr.finish()?.1);
        Ok(())
    })?;
    Ok(index.unwrap())
}

/// The file read through `f` still has the length and modification time it had (`before`), and
/// ends where its length says: else an I/O error naming it ("changed while being compressed").
fn unchanged_since(f: &mut File, before: &std::fs::Metadata, path: &Path) -> Result<()> {
    let now = f.metadata().map_err(io_at(path))?;
    let grew = f.read(&mut [0u8; 1]).map_err(io_at(path))? != 0;
    if grew || now.len() != before.len() || now.modified().ok() != before.modified().ok() {
        return Err(changed(path, before.len(), now.len()));
    }
    Ok(())
}

fn changed(path: &Path, was: u64, now: u64) -> Error {
    Error::Io(std::io::Error::other(format!(
        "{}: changed while being compressed ({was} bytes at the start, {now} now); nothing written",
        path.display()
    )))
}

/// Decode a container file, writing `prefix` then the concatenation of its entries to `output` (for
/// a container of kind "file", with no prefix: the original file, byte for byte; for one of named
/// tensors, with a safetensors header as the prefix: the .safetensors file, the entries being its
/// data section in order). With `output` None, only verifies (`prefix` is not used). Memory stays
/// bounded by the batch size whatever the entries' sizes. `progress` as for `encode_file`, over the
/// entries' bytes.
pub fn decode_file(
    input: &Path,
    output: Option<Output<'_>>,
    prefix: &[u8],
    threads: usize,
    progress: Progress<'_>,
) -> Result<Index> {
    decode_file_with(input, output, &mut |_| Ok(prefix.to_vec()), threads, progress)
}

/// `decode_file` with the prefix made from the index of the file as this call opened it
/// (`prefix_of`; not called when only verifying): a header built from an index read earlier could
/// describe another version of a file replaced meanwhile.
pub fn decode_file_with(
    input: &Path,
    output: Option<Output<'_>>,
    prefix_of: &mut dyn FnMut(&Index) -> Result<Vec<u8>>,
    threads: usize,
    progress: Progress<'_>,
) -> Result<Index> {
    let mut f = open_input(input)?;
    let (index, _) = read_index(&mut f).map_err(at(input))?;
    let total = index.raw_bytes();
    let mut run = |sink: &mut dyn Write| -> Result<()> {
        let mut done = 0u64;
        progress(0, total)?;
        f.seek(SeekFrom::Start(PREAMBLE_LEN)).map_err(io_at(input))?;
        for (ei, e) in index.entries.iter().enumerate() {
            let mut k = 0;
            while k < e.chunks.len() {
                let end = (k + batch_len(threads)).min(e.chunks.len());
                let mut stored = Vec::with_capacity(end - k);
                for c in &e.chunks[k..end] {
                    stored.push(read_payload(&mut f, c.stored_len).map_err(at(input))?);
                }
                let decoded: Result<Vec<Vec<u8>>> = with_threads(threads, || {
                    stored
                        .par_iter()
                        .enumerate()
                        .map(|(j, s)| {
                            let (a, b) = e.chunk_raw_range(k + j);
                            let mut out = vec![0u8; (b - a) as usize];
                            check_chunk(e, ei, k + j, s, &mut out)?;
                            Ok(out)
                        })
                        .collect()
                });
                for d in decoded? {
                    sink.write_all(&d)?;
                    done += d.len() as u64;
                }
                progress(done, total)?;
                k = end;
            }
        }
        Ok(())
    };
    match output {
        Some(out) => {
            let prefix = prefix_of(&index)?;
            write_atomically(out, |w| {
                w.write_all(&prefix)?;
                run(w)
            })?
        }
        None => run(&mut std::io::sink())?,
    }
    Ok(index)
}

/// Sanity check used by tools: the container's entries are what `kind` promises.
pub fn expect_kind(index: &Index, kind: u8) -> Result<()> {
    if index.kind != kind {
        return corrupt(format!("container kind {} where {kind} was expected", index.kind));
    }
    Ok(())
}

pub use format::KIND_TENSORS;

/// Write tensors to a container file (atomically), one tensor at a time.
pub fn save_tensors(
    path: &Path,
    tensors: &[(TensorMeta, &[u8])],
    opts: &EncodeOptions,
    on_existing: OnExisting,
) -> Result<Index> {
    let mut index = None;
    write_atomically(Output::new(path, on_existing), |w| {
        let mut wr = Writer::new(w, format::KIND_TENSORS)?;
        for (meta, data) in tensors {
            let (ce, chunks) = encode_tensor_chunks(data, meta, opts)?;
            wr.begin_entry(meta.clone(), ce)?;
            for c in &chunks {
                wr.write_chunk(c)?;
            }
        }
        index = Some(wr.finish()?.1);
        Ok(())
    })?;
    Ok(index.unwrap())
}

/// Decode one entry of a container file into `out`, reading only that entry's chunks through `f`,
/// the file that `index` was read from (`input`: its name, for errors). Readers of several entries
/// keep one `f`, so a file replaced meanwhile (an atomic rename) is still read as one version.
pub fn decode_file_entry(
    input: &Path,
    f: &mut File,
    index: &Index,
    ei: usize,
    out: &mut [u8],
    threads: usize,
) -> Result<()> {
    let e = index.entries.get(ei).ok_or_else(|| Error::InvalidArgument(format!("no entry {ei}")))?;
    let need = e.meta.raw_bytes()?;
    if out.len() as u64 != need {
        return Err(Error::BufferTooSmall { need, have: out.len() as u64 });
    }
    if e.chunks.is_empty() {
        return Ok(());
    }
    f.seek(SeekFrom::Start(e.chunks[0].offset)).map_err(io_at(input))?;
    let cb = (e.chunk_elems * e.meta.dtype.size() as u64) as usize;
    let batch = batch_len(threads);
    for (bi, outs) in out.chunks_mut(cb * batch).enumerate() {
        let k0 = bi * batch;
        let mut stored = Vec::new();
        for c in &e.chunks[k0..(k0 + batch).min(e.chunks.len())] {
            stored.push(read_payload(f, c.stored_len).map_err(at(input))?);
        }
        with_threads(threads, || {
            outs.par_chunks_mut(cb)
                .zip(stored.par_iter())
                .enumerate()
                .try_for_each(|(j, (o, s))| check_chunk(e, ei, k0 + j, s, o))
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_while_writing_removes_the_temporary_file() {
        let d = std::env::temp_dir().join(format!("weightszip-core-panic-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        let out = d.join("out.wz");
        let r = std::panic::catch_unwind(|| {
            write_atomically(Output::new(&out, OnExisting::Replace), |w| {
                w.write_all(&[7u8; 3 << 20])?;
                panic!("a bug in the writer");
            })
        });
        assert!(r.is_err());
        assert_eq!(std::fs::read_dir(&d).unwrap().count(), 0, "neither the output nor a temporary file");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn temporary_names_are_recognised_exactly() {
        let p = temporary_prefix(Path::new("/x/out.wz"));
        assert_eq!(p, ".out.wz.");
        assert_eq!(temporary_pid(".out.wz.42.0.0123abcd.wz-partial", &p), Some(42));
        for n in [
            ".out.wz.42.0123abcd.wz-partial",
            ".out.wz.1.42.0.0123abcd.wz-partial",
            ".out.wz.x.0.0123abcd.wz-partial",
            ".out.wz.42.0.0123abc.wz-partial",
            ".out.wz.42..0123abcd.wz-partial",
            ".out.wz.42.0.0123abcd.wz-partial~",
            ".out.wz.99999999999.0.0123abcd.wz-partial",
        ] {
            assert_eq!(temporary_pid(n, &p), None, "{n}");
        }
    }
}
