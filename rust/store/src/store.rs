//! The store: a RAM tier and a disk tier behind one small lock, an I/O pool for batches.

use std::collections::{BTreeMap, HashMap};
use std::fs::{self, File, TryLockError};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex, MutexGuard, RwLock, RwLockReadGuard};

use rayon::prelude::*;
use weightszip_core::{Error, Result};
use xxhash_rust::xxh3::xxh3_64;

use crate::file::{self, key_hash, rel_path, Header, MAX_KEY_LEN, MAX_SEQ};
use crate::remote::RedisTier;

/// Bytes a RAM entry costs beyond its key and payload (maps, LRU node, Arcs): counted in the
/// budget so that a store of many tiny chunks stays bounded too.
const ENTRY_OVERHEAD: u64 = 160;

#[derive(Debug, Clone)]
pub struct StoreConfig {
    /// Folder of the disk tier; None keeps the store in RAM only.
    pub dir: Option<PathBuf>,
    /// RAM tier budget in bytes (payload + key + a fixed overhead per chunk). 0: every chunk goes
    /// straight to disk (or is dropped when there is no disk tier).
    pub ram_bytes: u64,
    /// Disk tier budget in bytes of chunk files; 0 means no limit (the file system's is the limit).
    pub disk_bytes: u64,
    /// Threads of the I/O pool that batched calls run on; 0 picks 4; at most
    /// `weightszip_core::codec::MAX_THREADS` (more are taken as that many).
    pub io_threads: usize,
    /// fsync each chunk file and its folder before a write counts as done.
    pub durable: bool,
    /// Write every put to disk before returning (its errors are the put's); otherwise chunks go
    /// to disk when the RAM tier evicts them (write-back).
    pub write_through: bool,
    /// Keep a chunk read from disk in the RAM tier.
    pub promote: bool,
    /// Largest payload accepted by put and believed in a file header.
    pub max_chunk_bytes: u64,
    /// A Redis server for the remote tier (`redis://host:port/db`): every put is also stored
    /// there, and a local miss is looked up there.
    pub redis_url: Option<String>,
    /// Prefix of the Redis keys (one namespace per model / deployment).
    pub redis_prefix: String,
    /// Connect, read and write timeout of the remote tier, in milliseconds.
    pub redis_timeout_ms: u64,
}

impl Default for StoreConfig {
    fn default() -> Self {
        StoreConfig {
            dir: None,
            ram_bytes: 1 << 30,
            disk_bytes: 0,
            io_threads: 0,
            durable: true,
            write_through: false,
            promote: true,
            max_chunk_bytes: 1 << 30,
            redis_url: None,
            redis_prefix: "wz:".into(),
            redis_timeout_ms: 5_000,
        }
    }
}

/// A chunk handed back by `get`: its tag (what the payload is) and its verified bytes.
#[derive(Debug, Clone)]
pub struct Chunk {
    pub tag: u32,
    pub data: Arc<Vec<u8>>,
}

#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    pub ram_chunks: u64,
    pub ram_bytes: u64,
    pub disk_chunks: u64,
    pub disk_bytes: u64,
    pub flushing_chunks: u64,
    pub puts: u64,
    pub hits_ram: u64,
    pub hits_disk: u64,
    pub hits_remote: u64,
    pub misses: u64,
    /// Chunks written to disk because the RAM tier evicted them.
    pub evicted_to_disk: u64,
    /// Chunks dropped from the store by a budget (RAM without a disk tier, or the disk budget).
    pub dropped: u64,
    /// Chunks whose checksum failed on a read (or whose file was damaged at open): removed.
    pub corrupt_evicted: u64,
    /// Failed writes of evicted chunks (the chunk was dropped); a put's own failure is its error.
    pub flush_errors: u64,
    /// Chunk files found at open that this store cannot read (above its `max_chunk_bytes`, or of a
    /// newer format version): left in place, outside the disk budget; `get` of their key is their
    /// error, `put` and `delete` replace or remove them.
    pub unreadable_chunks: u64,
}

#[derive(Clone)]
struct Value {
    key: Arc<[u8]>,
    data: Arc<Vec<u8>>,
    tag: u32,
    xxh: u64,
}

impl Value {
    fn cost(&self) -> u64 {
        self.data.len() as u64 + self.key.len() as u64 + ENTRY_OVERHEAD
    }
}

struct RamEntry {
    v: Value,
    seq: u64,
    tick: u64,
    /// Not on disk yet: eviction must write it.
    dirty: bool,
}

struct DiskEntry {
    seq: u64,
    bytes: u64,
    tick: u64,
}

/// A write the caller must do after releasing the lock.
struct Flush {
    hash: u128,
    v: Value,
    seq: u64,
}

#[derive(Default)]
struct State {
    ram: HashMap<u128, RamEntry>,
    ram_lru: BTreeMap<u64, u128>,
    ram_used: u64,
    /// Evicted (or being flushed) and not yet on disk: still readable.
    flushing: HashMap<u128, (Value, u64)>,
    disk: HashMap<u128, DiskEntry>,
    disk_lru: BTreeMap<u64, u128>,
    disk_used: u64,
    tick: u64,
    next_seq: u64,
    /// Deletes so far: a remote chunk read while a delete ran is not promoted (it would bring the
    /// deleted key back)
    deletes: u64,
    /// Chunk files found at open that this store cannot read (a newer writer's, or above its
    /// `max_chunk_bytes`), by key hash: their sequence number. Indexed, so that `get` reports them
    /// (their error, not a silent miss), `contains` counts them, and `put` / `delete` remove them
    /// (left on disk, a deleted key would come back at an open that reads them). Outside the disk
    /// budget and its LRU: this store never evicts what it cannot read.
    unreadable: HashMap<u128, u64>,
    /// Keys whose last put or delete failed in the remote tier, by key hash: the sequence number of
    /// that put (for a delete, the next number). Redis may still hold an older version or the
    /// deleted one, so this store does not read the key there (a miss) until a later put of it (a
    /// number at least that one) or a delete reaches Redis. Only failures add entries.
    remote_stale: HashMap<u128, u64>,
}

impl State {
    /// A new version's sequence number. Numbers stay below `MAX_SEQ` (open removes files named
    /// above it), so they never wrap around to ones older files hold.
    fn take_seq(&mut self) -> Result<u64> {
        let seq = self.next_seq;
        if seq >= MAX_SEQ {
            return Err(Error::LimitExceeded(format!("the store's sequence numbers reached {MAX_SEQ:#x}")));
        }
        self.next_seq = seq + 1;
        Ok(seq)
    }

    fn tick(&mut self) -> u64 {
        self.tick += 1;
        self.tick
    }

    fn remove_ram(&mut self, h: u128) -> Option<RamEntry> {
        let e = self.ram.remove(&h)?;
        self.ram_lru.remove(&e.tick);
        self.ram_used -= e.v.cost();
        Some(e)
    }

    fn insert_ram(&mut self, h: u128, v: Value, seq: u64, dirty: bool) {
        self.remove_ram(h);
        let tick = self.tick();
        self.ram_used += v.cost();
        self.ram_lru.insert(tick, h);
        self.ram.insert(h, RamEntry { v, seq, tick, dirty });
    }

    fn touch_ram(&mut self, h: u128) {
        let tick = self.tick();
        if let Some(e) = self.ram.get_mut(&h) {
            self.ram_lru.remove(&e.tick);
            e.tick = tick;
            self.ram_lru.insert(tick, h);
        }
    }

    fn remove_disk(&mut self, h: u128) -> Option<DiskEntry> {
        let e = self.disk.remove(&h)?;
        self.disk_lru.remove(&e.tick);
        self.disk_used -= e.bytes;
        Some(e)
    }

    /// Forget the unreadable file of `h` (State::unreadable), if any, queueing it for `unlink`;
    /// whether there was one.
    fn take_unreadable(&mut self, h: u128, unlink: &mut Vec<(u128, u64)>) -> bool {
        self.unreadable.remove(&h).map(|seq| unlink.push((h, seq))).is_some()
    }

    /// A put or delete of `h` numbered `seq` failed in the remote tier (State::remote_stale).
    fn mark_remote_stale(&mut self, h: u128, seq: u64) {
        let mark = self.remote_stale.entry(h).or_insert(seq);
        *mark = (*mark).max(seq);
    }

    /// A put or delete of `h` reached the remote tier: a failure of an operation numbered below
    /// `bound` (which this one replaced there) is no longer a reason to skip Redis for `h`.
    fn clear_remote_stale_below(&mut self, h: u128, bound: u64) {
        if self.remote_stale.get(&h).is_some_and(|&s| s < bound) {
            self.remote_stale.remove(&h);
        }
    }

    fn insert_disk(&mut self, h: u128, seq: u64, bytes: u64) -> Option<DiskEntry> {
        let old = self.remove_disk(h);
        let tick = self.tick();
        self.disk_used += bytes;
        self.disk_lru.insert(tick, h);
        self.disk.insert(h, DiskEntry { seq, bytes, tick });
        old
    }

    fn touch_disk(&mut self, h: u128) {
        let tick = self.tick();
        if let Some(e) = self.disk.get_mut(&h) {
            self.disk_lru.remove(&e.tick);
            e.tick = tick;
            self.disk_lru.insert(tick, h);
        }
    }

    /// The newest version of `h` anywhere in the store.
    fn current_seq(&self, h: u128) -> Option<u64> {
        [self.ram.get(&h).map(|e| e.seq), self.flushing.get(&h).map(|f| f.1), self.disk.get(&h).map(|e| e.seq)]
            .into_iter()
            .flatten()
            .max()
    }

    /// Evict least recently used RAM entries until the budget holds: dirty ones become flushes
    /// (when there is a disk tier), clean ones are dropped (their file is on disk already).
    fn evict_ram(&mut self, budget: u64, has_disk: bool, flushes: &mut Vec<Flush>, dropped: &mut u64) {
        while self.ram_used > budget {
            let Some((_, &h)) = self.ram_lru.iter().next() else {
                break;
            };
            let e = self.remove_ram(h).expect("LRU and map agree");
            if e.dirty && has_disk {
                self.flushing.insert(h, (e.v.clone(), e.seq));
                flushes.push(Flush { hash: h, v: e.v, seq: e.seq });
            } else if !self.disk.contains_key(&h) {
                *dropped += 1;
            }
        }
    }

    fn evict_disk(&mut self, budget: u64, unlink: &mut Vec<(u128, u64)>, dropped: &mut u64) {
        if budget == 0 {
            return;
        }
        while self.disk_used > budget {
            let Some((_, &h)) = self.disk_lru.iter().next() else {
                break;
            };
            let e = self.remove_disk(h).expect("LRU and map agree");
            unlink.push((h, e.seq));
            if !self.ram.contains_key(&h) {
                *dropped += 1;
            }
        }
    }
}

#[derive(Default)]
struct Counters {
    puts: AtomicU64,
    hits_ram: AtomicU64,
    hits_disk: AtomicU64,
    hits_remote: AtomicU64,
    misses: AtomicU64,
    evicted_to_disk: AtomicU64,
    dropped: AtomicU64,
    corrupt_evicted: AtomicU64,
    flush_errors: AtomicU64,
}

pub struct ChunkStore {
    cfg: StoreConfig,
    state: Mutex<State>,
    counters: Counters,
    pool: rayon::ThreadPool,
    remote: Option<RedisTier>,
    /// Whether `close` ran. Every call (but `install`, see there) holds it shared for its whole run,
    /// so `close` waits for those in flight before it flushes, and later ones fail. None takes it
    /// twice: a second read lock while `close` waits for the write lock can deadlock.
    closed: RwLock<bool>,
    /// Held for the store's life: one open store per folder.
    _lock: Option<File>,
}

/// Errors that mean "this chunk's bytes are not what was stored": the chunk is evicted. Not a
/// chunk of a newer writer (UnsupportedVersion, Unsupported) nor one above this store's
/// `max_chunk_bytes` (LimitExceeded): those are valid data this store cannot read, left in place
/// (a store opened with a larger limit, or a newer version, reads them).
fn is_damage(e: &Error) -> bool {
    matches!(e, Error::BadMagic | Error::Truncated(_) | Error::Corrupt(_) | Error::ChecksumMismatch(_))
}

/// Errors of a chunk this store cannot read but must not delete (`is_damage`'s complement among
/// the format's errors).
fn is_unreadable(e: &Error) -> bool {
    matches!(e, Error::UnsupportedVersion(..) | Error::Unsupported(_) | Error::LimitExceeded(_))
}

impl ChunkStore {
    /// Open (or create) a store. With a folder, the chunk files already there are indexed (their
    /// headers checked; payloads are checked when read), leftover temporary files of a writer that
    /// died are removed, and damaged files are removed and counted.
    pub fn open(cfg: StoreConfig) -> Result<ChunkStore> {
        if cfg.max_chunk_bytes == 0 {
            return Err(Error::InvalidArgument("max_chunk_bytes must be > 0".into()));
        }
        let threads = if cfg.io_threads == 0 { 4 } else { cfg.io_threads.min(weightszip_core::codec::MAX_THREADS) };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("wz-store-io-{i}"))
            .build()
            .map_err(|e| Error::InvalidArgument(format!("I/O pool: {e}")))?;
        let counters = Counters::default();
        let mut state = State { next_seq: 1, ..State::default() };
        let mut lock = None;
        if let Some(dir) = &cfg.dir {
            if dir.as_os_str().is_empty() {
                return Err(Error::InvalidArgument("the store's folder is an empty path".into()));
            }
            fs::create_dir_all(dir)?;
            let f = File::create(dir.join("LOCK"))?;
            match f.try_lock() {
                Ok(()) => {}
                Err(TryLockError::WouldBlock) => {
                    return Err(Error::InvalidArgument(format!(
                        "store folder {} is open in another store (of this process or another)",
                        dir.display()
                    )))
                }
                Err(TryLockError::Error(e)) => return Err(e.into()),
            }
            lock = Some(f);
            let (found, max_seq) = pool.install(|| scan(dir, cfg.max_chunk_bytes, &counters))?;
            state.next_seq = max_seq + 1; // above every file's number, indexed or not
                                          // Older versions of a key are removed whatever they hold, readable here or not: the
                                          // newest replaced them (an open that reads them all removes them too), and one left
                                          // behind a newest this store deletes would come back at such an open. A newest version
                                          // this store cannot read hides the older ones it could (they are not the key's value).
            let mut newest: HashMap<u128, (u64, Option<u64>)> = HashMap::new();
            let mut stale = Vec::new();
            for (h, seq, bytes) in found {
                match newest.get(&h) {
                    Some(&(s, _)) if s > seq => stale.push((h, seq)),
                    Some(&(s, _)) => {
                        stale.push((h, s));
                        newest.insert(h, (seq, bytes));
                    }
                    None => {
                        newest.insert(h, (seq, bytes));
                    }
                }
            }
            for (h, seq) in stale {
                let _ = fs::remove_file(dir.join(rel_path(h, seq)));
            }
            let mut order: Vec<(u64, u128, u64)> = Vec::with_capacity(newest.len());
            for (h, (seq, bytes)) in newest {
                match bytes {
                    Some(b) => order.push((seq, h, b)),
                    None => {
                        state.unreadable.insert(h, seq);
                    }
                }
            }
            order.sort_unstable();
            for (seq, h, bytes) in order {
                state.insert_disk(h, seq, bytes);
            }
        }
        let remote = match &cfg.redis_url {
            Some(url) => Some(RedisTier::connect(
                url,
                &cfg.redis_prefix,
                std::time::Duration::from_millis(cfg.redis_timeout_ms.max(1)),
            )?),
            None => None,
        };
        let store = ChunkStore {
            cfg,
            state: Mutex::new(state),
            counters,
            pool,
            remote,
            closed: RwLock::new(false),
            _lock: lock,
        };
        let mut unlink = Vec::new();
        let mut dropped = 0;
        store.lock().evict_disk(store.cfg.disk_bytes, &mut unlink, &mut dropped);
        store.counters.dropped.fetch_add(dropped, Relaxed);
        store.unlink(&unlink);
        Ok(store)
    }

    pub fn config(&self) -> &StoreConfig {
        &self.cfg
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // A panic while holding the lock leaves maps that are still consistent (every update is
        // a few map operations without I/O), so a poisoned lock is taken over.
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Held by an operation for its whole run (see `closed`); once the store is closed, the error of
    /// every call but `close` (and `config`): InvalidArgument, "the store is closed" (what the
    /// Python wrapper raises too).
    fn open_guard(&self) -> Result<RwLockReadGuard<'_, bool>> {
        let g = self.closed.read().unwrap_or_else(|p| p.into_inner());
        if *g {
            return Err(Error::InvalidArgument("the store is closed".into()));
        }
        Ok(g)
    }

    /// Stop taking calls (every method but this one and `config` fails with InvalidArgument, "the
    /// store is closed", from now on), wait for those in flight, and write every chunk that is only
    /// in RAM to disk: every put that returned Ok is on disk when this returns Ok. Closing twice is
    /// fine (a failed flush is tried again); the folder is released when the store is dropped.
    pub fn close(&self) -> Result<()> {
        *self.closed.write().unwrap_or_else(|p| p.into_inner()) = true;
        self.flush_dirty()
    }

    fn path(&self, h: u128, seq: u64) -> Option<PathBuf> {
        self.cfg.dir.as_ref().map(|d| d.join(rel_path(h, seq)))
    }

    fn unlink(&self, files: &[(u128, u64)]) {
        for &(h, seq) in files {
            if let Some(p) = self.path(h, seq) {
                let _ = fs::remove_file(p);
            }
        }
    }

    fn check_put(&self, key: &[u8], data: &[u8]) -> Result<()> {
        if key.is_empty() || key.len() > MAX_KEY_LEN {
            return Err(Error::InvalidArgument(format!("key of {} bytes (1..={MAX_KEY_LEN})", key.len())));
        }
        if data.len() as u64 > self.cfg.max_chunk_bytes {
            return Err(Error::LimitExceeded(format!(
                "chunk of {} bytes, the store's limit is {}",
                data.len(),
                self.cfg.max_chunk_bytes
            )));
        }
        Ok(())
    }

    /// Write one version's file. Returns its length.
    fn write_file(&self, h: u128, v: &Value, seq: u64) -> Result<u64> {
        let path = self.path(h, seq).expect("only called with a disk tier");
        let header = Header {
            tag: v.tag,
            key_len: v.key.len() as u32,
            payload_len: v.data.len() as u64,
            seq,
            key_hash: h,
            payload_xxh3: v.xxh,
        };
        file::write_chunk(&path, &header, &v.key, &v.data, self.cfg.durable)?;
        Ok(header.file_len())
    }

    /// Write an evicted chunk and move it from `flushing` to the disk tier, unless a newer put or
    /// a delete of its key came first (then the file just written is removed).
    fn flush(&self, f: Flush) -> Result<()> {
        let written = self.write_file(f.hash, &f.v, f.seq);
        let mut unlink = Vec::new();
        let mut dropped = 0;
        {
            let mut st = self.lock();
            let ours = st.flushing.get(&f.hash).map(|x| x.1) == Some(f.seq);
            match &written {
                Ok(bytes) if ours => {
                    st.flushing.remove(&f.hash);
                    st.insert_disk(f.hash, f.seq, *bytes);
                    if let Some(e) = st.ram.get_mut(&f.hash) {
                        if e.seq == f.seq {
                            e.dirty = false;
                        }
                    }
                    st.evict_disk(self.cfg.disk_bytes, &mut unlink, &mut dropped);
                }
                Ok(_) => unlink.push((f.hash, f.seq)),
                Err(_) => {
                    if ours {
                        st.flushing.remove(&f.hash);
                        match st.ram.get_mut(&f.hash) {
                            // flush_all's write of a chunk still in RAM: it stays there, dirty.
                            Some(e) if e.seq == f.seq => e.dirty = true,
                            _ => dropped += 1,
                        }
                    }
                }
            }
        }
        self.counters.dropped.fetch_add(dropped, Relaxed);
        self.unlink(&unlink);
        written.map(|_| ())
    }

    fn run_flushes(&self, flushes: Vec<Flush>, own: Option<(u128, u64)>) -> Result<()> {
        let mut result = Ok(());
        for f in flushes {
            let is_own = own == Some((f.hash, f.seq));
            if !is_own {
                self.counters.evicted_to_disk.fetch_add(1, Relaxed);
            }
            if let Err(e) = self.flush(f) {
                if is_own {
                    result = Err(e);
                } else {
                    self.counters.flush_errors.fetch_add(1, Relaxed);
                }
            }
        }
        result
    }

    /// Store `data` under `key` (replacing any older version). Write-back: the chunk goes to RAM
    /// and reaches disk when evicted; a failed write of another, evicted chunk is counted in
    /// `flush_errors`, not returned here. Write-through (or a zero RAM budget): the chunk is on
    /// disk when this returns, and a failed write (a full disk) is this call's error, leaving
    /// every chunk stored before it in place.
    pub fn put(&self, key: &[u8], data: Vec<u8>, tag: u32) -> Result<()> {
        let _open = self.open_guard()?;
        self.check_put(key, &data)?;
        let h = key_hash(key);
        let xxh = xxh3_64(&data);
        let v = Value { key: Arc::from(key), data: Arc::new(data), tag, xxh };
        let remote_value = self.remote.as_ref().map(|_| v.clone());
        self.counters.puts.fetch_add(1, Relaxed);
        let has_disk = self.cfg.dir.is_some();
        let mut flushes = Vec::new();
        let mut unlink = Vec::new();
        let mut dropped = 0;
        let seq;
        // A chunk larger than the RAM budget (a zero budget: every chunk) would be flushed by this
        // call at once: written first too, so that a failed write leaves the older version in place
        if has_disk && (self.cfg.write_through || v.cost() > self.cfg.ram_bytes) {
            seq = self.lock().take_seq()?;
            let bytes = self.write_file(h, &v, seq)?;
            let mut st = self.lock();
            if st.current_seq(h).is_some_and(|c| c > seq) {
                unlink.push((h, seq)); // a newer put of this key registered first
            } else {
                st.flushing.remove(&h);
                if let Some(old) = st.insert_disk(h, seq, bytes) {
                    unlink.push((h, old.seq));
                }
                st.take_unreadable(h, &mut unlink);
                st.insert_ram(h, v, seq, false);
                st.evict_ram(self.cfg.ram_bytes, true, &mut flushes, &mut dropped);
                st.evict_disk(self.cfg.disk_bytes, &mut unlink, &mut dropped);
            }
        } else {
            let mut st = self.lock();
            seq = st.take_seq()?;
            st.flushing.remove(&h);
            if let Some(old) = st.remove_disk(h) {
                unlink.push((h, old.seq));
            }
            st.take_unreadable(h, &mut unlink);
            st.insert_ram(h, v, seq, has_disk);
            st.evict_ram(self.cfg.ram_bytes, has_disk, &mut flushes, &mut dropped);
        }
        self.counters.dropped.fetch_add(dropped, Relaxed);
        self.unlink(&unlink);
        self.run_flushes(flushes, Some((h, seq)))?;
        if let (Some(remote), Some(v)) = (&self.remote, remote_value) {
            let header = Header {
                tag: v.tag,
                key_len: v.key.len() as u32,
                payload_len: v.data.len() as u64,
                seq,
                key_hash: h,
                payload_xxh3: v.xxh,
            };
            let r = remote.put(h, &file::encode_chunk(&header, &v.key, &v.data));
            let mut st = self.lock();
            match r {
                // Redis may keep an older version: read there after this version left the local
                // tiers (an eviction), it would replace it (see State::remote_stale)
                Err(e) => {
                    st.mark_remote_stale(h, seq);
                    return Err(e);
                }
                Ok(()) => st.clear_remote_stale_below(h, seq + 1),
            }
        }
        Ok(())
    }

    /// The chunk stored under `key`, verified; Ok(None) when absent. A chunk that fails its
    /// checksum is removed from the store and reported as the error (`ChecksumMismatch`,
    /// `Truncated`, `Corrupt`, ...); a second get then finds nothing.
    pub fn get(&self, key: &[u8]) -> Result<Option<Chunk>> {
        let _open = self.open_guard()?;
        let h = key_hash(key);
        // A file can vanish between the lookup and the read when a newer put or an eviction
        // replaces it; the next lookup then finds the newer state.
        for _ in 0..4 {
            let disk_seq;
            {
                let mut st = self.lock();
                let mem = if let Some(e) = st.ram.get(&h) {
                    Some((e.v.clone(), e.seq))
                } else {
                    st.flushing.get(&h).cloned()
                };
                if let Some((v, seq)) = mem {
                    st.touch_ram(h);
                    drop(st);
                    return self.check_mem(h, key, v, seq);
                }
                match (st.disk.get(&h), st.unreadable.get(&h)) {
                    (Some(e), _) => disk_seq = e.seq,
                    (None, Some(&seq)) => {
                        drop(st);
                        self.check_unreadable(h, seq)?;
                        continue;
                    }
                    (None, None) => {
                        drop(st);
                        return self.get_remote(h, key);
                    }
                }
                st.touch_disk(h);
            }
            let path = self.path(h, disk_seq).expect("disk entries exist only with a folder");
            // an older (or other) chunk file put in this one's place is damage: not what was stored
            // under this name (scan refuses it too)
            let read = file::read_chunk(&path, self.cfg.max_chunk_bytes).and_then(|r| match r {
                Some(fc) if fc.header.seq != disk_seq => {
                    Err(Error::Corrupt(format!("chunk file of sequence {disk_seq} holds sequence {}", fc.header.seq)))
                }
                other => Ok(other),
            });
            match read {
                Ok(None) => {
                    // Gone: replaced by a newer put or an eviction (the index has moved on), or
                    // deleted from outside the store (the index still names it): forget it, so that
                    // `contains` and the disk budget agree with the disk, and look again (the next
                    // lookup may find it in the remote tier).
                    let mut st = self.lock();
                    if st.disk.get(&h).map(|d| d.seq) == Some(disk_seq) {
                        st.remove_disk(h);
                    }
                    continue;
                }
                Ok(Some(fc)) => {
                    if fc.key != key {
                        // Two keys with one XXH3-128: never seen, but never returned either.
                        self.counters.misses.fetch_add(1, Relaxed);
                        return Ok(None);
                    }
                    self.counters.hits_disk.fetch_add(1, Relaxed);
                    let data = Arc::new(fc.payload);
                    if self.cfg.promote {
                        self.promote(h, disk_seq, fc.key, data.clone(), fc.header);
                    }
                    return Ok(Some(Chunk { tag: fc.header.tag, data }));
                }
                Err(e) if is_damage(&e) => {
                    {
                        let mut st = self.lock();
                        if st.disk.get(&h).map(|d| d.seq) == Some(disk_seq) {
                            st.remove_disk(h);
                        }
                    }
                    let _ = fs::remove_file(&path);
                    self.counters.corrupt_evicted.fetch_add(1, Relaxed);
                    return Err(e);
                }
                Err(e) => return Err(e),
            }
        }
        self.counters.misses.fetch_add(1, Relaxed);
        Ok(None)
    }

    fn get_remote(&self, h: u128, key: &[u8]) -> Result<Option<Chunk>> {
        let Some(remote) = &self.remote else {
            self.counters.misses.fetch_add(1, Relaxed);
            return Ok(None);
        };
        let (deletes, stale) = {
            let st = self.lock();
            (st.deletes, st.remote_stale.contains_key(&h)) // (before the read: see State::deletes)
        };
        if stale {
            // Redis may hold an older version or a deleted one (State::remote_stale): a miss
            self.counters.misses.fetch_add(1, Relaxed);
            return Ok(None);
        }
        let Some(buf) = remote.get(h)? else {
            self.counters.misses.fetch_add(1, Relaxed);
            return Ok(None);
        };
        let fc = match file::parse_chunk(&buf, self.cfg.max_chunk_bytes) {
            Ok(fc) => fc,
            Err(e) => {
                if is_damage(&e) {
                    let _ = remote.delete(h);
                    self.counters.corrupt_evicted.fetch_add(1, Relaxed);
                }
                return Err(e);
            }
        };
        if fc.key != key {
            self.counters.misses.fetch_add(1, Relaxed);
            return Ok(None);
        }
        self.counters.hits_remote.fetch_add(1, Relaxed);
        let data = Arc::new(fc.payload);
        if self.cfg.promote {
            // Kept locally under a sequence number of this store (the remote one is another
            // store's); dirty, so that eviction keeps it on this store's disk.
            let v =
                Value { key: Arc::from(fc.key), data: data.clone(), tag: fc.header.tag, xxh: fc.header.payload_xxh3 };
            // With a disk tier it lands there even when it does not fit the RAM budget.
            if v.cost() <= self.cfg.ram_bytes || self.cfg.dir.is_some() {
                let mut flushes = Vec::new();
                let mut dropped = 0;
                {
                    let mut st = self.lock();
                    if st.current_seq(h).is_none() && st.deletes == deletes {
                        let Ok(seq) = st.take_seq() else {
                            return Ok(Some(Chunk { tag: fc.header.tag, data }));
                        };
                        let has_disk = self.cfg.dir.is_some();
                        st.insert_ram(h, v, seq, has_disk);
                        st.evict_ram(self.cfg.ram_bytes, has_disk, &mut flushes, &mut dropped);
                    }
                }
                self.counters.dropped.fetch_add(dropped, Relaxed);
                let _ = self.run_flushes(flushes, None);
            }
        }
        Ok(Some(Chunk { tag: fc.header.tag, data }))
    }

    /// `get` of a key whose newest file this store cannot read (State::unreadable): that file's
    /// error (LimitExceeded, UnsupportedVersion, Unsupported), from its header read again; never a
    /// miss, never removed. Ok: look again, the index moved on (a put or delete came first, or the
    /// file is gone: forgotten, as a disk file deleted from outside; or it was replaced from
    /// outside by one this store reads: indexed in the disk tier, whose read verifies it).
    fn check_unreadable(&self, h: u128, seq: u64) -> Result<()> {
        let path = self.path(h, seq).expect("unreadable entries exist only with a folder");
        let read = file::read_header(&path, self.cfg.max_chunk_bytes);
        let mut st = self.lock();
        if st.unreadable.get(&h) != Some(&seq) {
            return Ok(());
        }
        match read {
            Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {
                st.unreadable.remove(&h);
                Ok(())
            }
            Ok((hd, _)) if hd.key_hash == h && hd.seq == seq => {
                st.unreadable.remove(&h);
                st.insert_disk(h, seq, hd.file_len());
                Ok(())
            }
            Ok((hd, _)) => Err(Error::Corrupt(format!("chunk file of sequence {seq} holds sequence {}", hd.seq))),
            // damage appeared meanwhile is reported, not removed: the next open removes it
            Err(e) => Err(e),
        }
    }

    fn check_mem(&self, h: u128, key: &[u8], v: Value, seq: u64) -> Result<Option<Chunk>> {
        if &*v.key != key {
            self.counters.misses.fetch_add(1, Relaxed);
            return Ok(None);
        }
        if xxh3_64(&v.data) != v.xxh {
            {
                let mut st = self.lock();
                if st.ram.get(&h).map(|e| e.seq) == Some(seq) {
                    st.remove_ram(h);
                }
                if st.flushing.get(&h).map(|f| f.1) == Some(seq) {
                    st.flushing.remove(&h);
                }
            }
            self.counters.corrupt_evicted.fetch_add(1, Relaxed);
            return Err(Error::ChecksumMismatch("chunk in the RAM tier".into()));
        }
        self.counters.hits_ram.fetch_add(1, Relaxed);
        Ok(Some(Chunk { tag: v.tag, data: v.data }))
    }

    fn promote(&self, h: u128, seq: u64, key: Vec<u8>, data: Arc<Vec<u8>>, header: Header) {
        let v = Value { key: Arc::from(key), data, tag: header.tag, xxh: header.payload_xxh3 };
        if v.cost() > self.cfg.ram_bytes {
            return;
        }
        let mut flushes = Vec::new();
        let mut dropped = 0;
        {
            let mut st = self.lock();
            if st.ram.contains_key(&h) || st.current_seq(h) != Some(seq) {
                return;
            }
            st.insert_ram(h, v, seq, false);
            st.evict_ram(self.cfg.ram_bytes, true, &mut flushes, &mut dropped);
        }
        self.counters.dropped.fetch_add(dropped, Relaxed);
        let _ = self.run_flushes(flushes, None);
    }

    /// Whether `key` is stored (without reading or verifying it). A local copy answers without
    /// asking the remote tier; a remote tier that cannot answer (down, a timeout) is this call's
    /// error, as for `get`, not a "no".
    pub fn contains(&self, key: &[u8]) -> Result<bool> {
        let _open = self.open_guard()?;
        let h = key_hash(key);
        let (local, stale) = {
            let st = self.lock();
            let local = st.ram.contains_key(&h)
                || st.flushing.contains_key(&h)
                || st.disk.contains_key(&h)
                || st.unreadable.contains_key(&h);
            (local, st.remote_stale.contains_key(&h))
        };
        // (not the remote copy of a key whose last put or delete failed there: `get` does not
        // read it, State::remote_stale)
        if local || stale {
            return Ok(local);
        }
        match &self.remote {
            Some(r) => r.exists(h),
            None => Ok(false),
        }
    }

    /// Remove `key` from every tier. Returns whether it was stored. A failure of the remote tier
    /// is this call's error (never a success while Redis may keep the chunk): the local copies are
    /// removed all the same, and this store reads the key no more from Redis until a later put or
    /// delete of it reaches Redis (State::remote_stale), so the deleted chunk does not come back
    /// here; another store sharing the Redis still reads it there until a delete succeeds.
    pub fn delete(&self, key: &[u8]) -> Result<bool> {
        let _open = self.open_guard()?;
        let h = key_hash(key);
        // puts numbered from here on started after this delete: a failure of theirs stays marked
        let started = self.lock().next_seq;
        // the remote copy first: a get between the two would read it again and promote it (the
        // local removal below counts in State::deletes, which stops a promote of a value read
        // before it)
        let remote = self.remote.as_ref().map(|r| r.delete(h));
        let mut unlink = Vec::new();
        let found;
        {
            let mut st = self.lock();
            st.deletes += 1;
            let a = st.remove_ram(h).is_some();
            let b = st.flushing.remove(&h).is_some();
            let c = st.remove_disk(h).map(|e| unlink.push((h, e.seq))).is_some();
            let d = st.take_unreadable(h, &mut unlink);
            found = a || b || c || d;
            match &remote {
                Some(Err(_)) => {
                    let next = st.next_seq;
                    st.mark_remote_stale(h, next);
                }
                Some(Ok(_)) => st.clear_remote_stale_below(h, started),
                None => {}
            }
        }
        self.unlink(&unlink);
        match remote {
            Some(Err(Error::Io(e))) => Err(Error::Io(std::io::Error::new(
                e.kind(),
                format!("{e} (deleting from the remote tier; the local copies are deleted, Redis may still hold it)"),
            ))),
            Some(Err(e)) => Err(e),
            Some(Ok(r)) => Ok(found || r),
            None => Ok(found),
        }
    }

    /// Write every chunk that is only in RAM to disk (no-op without a disk tier), on the I/O pool.
    pub fn flush_all(&self) -> Result<()> {
        let _open = self.open_guard()?;
        self.flush_dirty()
    }

    /// `flush_all` without the check for `close` (which, and `drop`, call it).
    fn flush_dirty(&self) -> Result<()> {
        if self.cfg.dir.is_none() {
            return Ok(());
        }
        let flushes: Vec<Flush> = {
            let mut st = self.lock();
            let st = &mut *st;
            let mut out = Vec::new();
            for (&h, e) in st.ram.iter_mut() {
                if e.dirty {
                    e.dirty = false;
                    st.flushing.insert(h, (e.v.clone(), e.seq));
                    out.push(Flush { hash: h, v: e.v.clone(), seq: e.seq });
                }
            }
            out
        };
        let results: Vec<Result<()>> = self.pool.install(|| flushes.into_par_iter().map(|f| self.flush(f)).collect());
        results.into_iter().collect()
    }

    /// `put` of many chunks on the I/O pool; one result per item, in order (each the closed error
    /// once the store is closed).
    pub fn put_many(&self, items: Vec<(Vec<u8>, Vec<u8>, u32)>) -> Vec<Result<()>> {
        self.pool.install(|| items.into_par_iter().map(|(k, d, t)| self.put(&k, d, t)).collect())
    }

    /// `get` of many keys on the I/O pool; one result per key, in order.
    pub fn get_many(&self, keys: &[Vec<u8>]) -> Vec<Result<Option<Chunk>>> {
        self.pool.install(|| keys.par_iter().map(|k| self.get(k)).collect())
    }

    /// Run `f` on the I/O pool (for callers that batch their own work, e.g. compression); not once
    /// the store is closed. (The check is not held while `f` runs: the puts `f` makes take it, and
    /// a read lock taken twice by one call can deadlock with a waiting `close`.)
    pub fn install<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T> {
        drop(self.open_guard()?);
        Ok(self.pool.install(f))
    }

    pub fn stats(&self) -> Result<Stats> {
        let _open = self.open_guard()?;
        let st = self.lock();
        let c = &self.counters;
        Ok(Stats {
            ram_chunks: st.ram.len() as u64,
            ram_bytes: st.ram_used,
            disk_chunks: st.disk.len() as u64,
            disk_bytes: st.disk_used,
            flushing_chunks: st.flushing.len() as u64,
            puts: c.puts.load(Relaxed),
            hits_ram: c.hits_ram.load(Relaxed),
            hits_disk: c.hits_disk.load(Relaxed),
            hits_remote: c.hits_remote.load(Relaxed),
            misses: c.misses.load(Relaxed),
            evicted_to_disk: c.evicted_to_disk.load(Relaxed),
            dropped: c.dropped.load(Relaxed),
            corrupt_evicted: c.corrupt_evicted.load(Relaxed),
            flush_errors: c.flush_errors.load(Relaxed),
            unreadable_chunks: st.unreadable.len() as u64,
        })
    }

    /// The path of the file that holds `key` on disk now, if it is there (for tools and tests); a
    /// file this store cannot read too (State::unreadable).
    pub fn file_of(&self, key: &[u8]) -> Result<Option<PathBuf>> {
        let _open = self.open_guard()?;
        let h = key_hash(key);
        let seq = {
            let st = self.lock();
            st.disk.get(&h).map(|e| e.seq).or_else(|| st.unreadable.get(&h).copied())
        };
        Ok(seq.and_then(|seq| self.path(h, seq)))
    }

    /// Drop `key` from the RAM tier only (it stays on disk if it was there): lets callers and
    /// tests force the next read to come from disk. Returns whether it was in RAM.
    pub fn evict_from_ram(&self, key: &[u8]) -> Result<bool> {
        let _open = self.open_guard()?;
        let h = key_hash(key);
        let mut flushes = Vec::new();
        {
            let mut st = self.lock();
            let Some(e) = st.remove_ram(h) else {
                return Ok(false);
            };
            if e.dirty && self.cfg.dir.is_some() {
                st.flushing.insert(h, (e.v.clone(), e.seq));
                flushes.push(Flush { hash: h, v: e.v, seq: e.seq });
            } else if !st.disk.contains_key(&h) {
                self.counters.dropped.fetch_add(1, Relaxed);
            }
        }
        let _ = self.run_flushes(flushes, None);
        Ok(true)
    }
}

impl Drop for ChunkStore {
    /// A store dropped without `close` (or after a failed one) still writes the chunks only in its
    /// RAM tier; a failure is reported on stderr, never a panic.
    fn drop(&mut self) {
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.flush_dirty()));
        match r {
            Ok(Ok(())) => {}
            Ok(Err(e)) => eprintln!("weightszip-store: writing chunks of a dropped store: {e}"),
            Err(_) => eprintln!("weightszip-store: writing chunks of a dropped store panicked"),
        }
    }
}

/// Chunk files found by `scan`: (key hash, sequence number, bytes on disk) each; bytes None for a
/// chunk this store cannot read (`is_unreadable`).
type Found = Vec<(u128, u64, Option<u64>)>;

/// Index the chunk files of a store folder (in parallel over its 256 subfolders). Also returns the
/// largest sequence number named by a file left there (indexed or not; 0 when none).
fn scan(dir: &Path, max_payload: u64, counters: &Counters) -> Result<(Found, u64)> {
    let me = std::process::id();
    // a damaged entry named like a chunk file: removed (a directory with its contents) and counted
    let damaged = |path: &Path| {
        let _ = file::remove_entry(path);
        counters.corrupt_evicted.fetch_add(1, Relaxed);
    };
    let per_sub: Vec<Result<(Found, u64)>> = (0..256u32)
        .into_par_iter()
        .map(|i| {
            let sub = dir.join(format!("{i:02x}"));
            file::ensure_subfolder(&sub)?;
            let mut out = Vec::new();
            let mut max_seq = 0;
            for entry in fs::read_dir(&sub)? {
                let entry = entry?;
                let name = entry.file_name();
                let Some(name) = name.to_str() else { continue };
                let path = entry.path();
                if let Some(pid) = file::temporary_pid(name) {
                    // A write that never reached its rename. This open holds the folder's lock, so
                    // its writer is gone (or is this process, whose earlier stores of this folder are
                    // closed): removed, unless its PID is another running process (a writer that
                    // shares the folder despite the lock; or a reused PID: a later open removes it).
                    // Never indexed, never counted as damage.
                    let stale = pid == me || weightszip_core::codec::process_gone(pid) != Some(false);
                    if stale && entry.file_type().is_ok_and(|t| t.is_file()) {
                        let _ = fs::remove_file(&path);
                    }
                    continue;
                }
                if name.ends_with(&format!(".{}", file::LEGACY_TMP_SUFFIX)) {
                    // An earlier version's temporary (`NAME.tmp`), written under the lock: its
                    // writer died.
                    let _ = fs::remove_file(&path);
                    continue;
                }
                let Some((h, seq)) = file::parse_name(name) else {
                    continue;
                };
                if (h >> 120) as u32 != i || seq >= MAX_SEQ {
                    // A chunk file outside the folder its hash names (moved or copied there): `get`
                    // would never read it, and indexed it could displace the file in its place. A
                    // sequence number this store never gives (next_seq would wrap around).
                    damaged(&path);
                    continue;
                }
                // every number a name holds counts, whatever is found there: a chunk this store
                // cannot read is left on disk, and a new version of its key must win over it when a
                // later open indexes both
                max_seq = max_seq.max(seq);
                if !entry.file_type().is_ok_and(|t| t.is_file()) {
                    // a directory, a link (dangling, looping, or to a file elsewhere), a FIFO: not
                    // a chunk file, and in the way of one
                    damaged(&path);
                    continue;
                }
                match file::read_header(&path, max_payload) {
                    Ok((hd, _)) if hd.key_hash == h && hd.seq == seq => out.push((h, seq, Some(hd.file_len()))),
                    Ok(_) => damaged(&path),
                    Err(e) if is_damage(&e) => damaged(&path),
                    // a chunk this store cannot read (a newer writer's, or above max_chunk_bytes):
                    // left on disk, indexed as such (State::unreadable)
                    Err(e) if is_unreadable(&e) => out.push((h, seq, None)),
                    Err(Error::Io(e)) if e.kind() == std::io::ErrorKind::NotFound => {}
                    Err(e) => return Err(e),
                }
            }
            Ok((out, max_seq))
        })
        .collect();
    let mut all = Vec::new();
    let mut max_seq = 0;
    for r in per_sub {
        let (found, m) = r?;
        all.extend(found);
        max_seq = max_seq.max(m);
    }
    Ok((all, max_seq))
}
