//! Behaviour of the chunk store: tiers, budgets, persistence, damage, limits, concurrency.

use std::fs;
use std::path::Path;
use std::sync::Arc;

use weightszip_store::{file, ChunkStore, Error, StoreConfig};

/// A value that names its key and version and is checkable on its own: 16 bytes of id and
/// version, then bytes drawn from them, of a length drawn from them.
fn value(id: u64, version: u64) -> Vec<u8> {
    let mut s = id.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ version.wrapping_mul(0xD1B5_4A32_D192_ED03) | 1;
    let len = 16 + (s % 1500) as usize;
    let mut v = Vec::with_capacity(len);
    v.extend_from_slice(&id.to_le_bytes());
    v.extend_from_slice(&version.to_le_bytes());
    while v.len() < len {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v.push(s as u8);
    }
    v
}

fn check_value(v: &[u8]) -> (u64, u64) {
    let id = u64::from_le_bytes(v[..8].try_into().unwrap());
    let version = u64::from_le_bytes(v[8..16].try_into().unwrap());
    assert_eq!(v, value(id, version).as_slice(), "bytes of ({id}, {version}) damaged");
    (id, version)
}

fn key(id: u64) -> Vec<u8> {
    format!("model@1@0@{id:016x}").into_bytes()
}

fn cfg(dir: Option<&Path>, ram: u64) -> StoreConfig {
    StoreConfig { dir: dir.map(|d| d.to_path_buf()), ram_bytes: ram, durable: false, ..StoreConfig::default() }
}

fn chunk_files(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut out = Vec::new();
    for sub in fs::read_dir(dir).unwrap() {
        let sub = sub.unwrap().path();
        if sub.is_dir() {
            for f in fs::read_dir(&sub).unwrap() {
                out.push(f.unwrap().path());
            }
        }
    }
    out
}

#[test]
fn ram_tier_keeps_the_budget_and_drops_least_recently_used() {
    let s = ChunkStore::open(cfg(None, 10_000)).unwrap();
    for id in 0..20 {
        s.put(&key(id), vec![id as u8; 1000], 0).unwrap();
        if id >= 1 {
            assert!(s.get(&key(0)).unwrap().is_some(), "key 0 is used all the time, so it stays");
        }
    }
    let st = s.stats().unwrap();
    assert!(st.ram_bytes <= 10_000, "{st:?}");
    assert!(st.dropped >= 10, "{st:?}");
    assert!(s.contains(&key(0)).unwrap());
    assert!(s.contains(&key(19)).unwrap());
    assert!(!s.contains(&key(1)).unwrap());
    let c = s.get(&key(19)).unwrap().unwrap();
    assert_eq!(*c.data, vec![19u8; 1000]);
}

#[test]
fn evicted_chunks_go_to_disk_and_come_back() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(cfg(Some(dir.path()), 8_000)).unwrap();
    for id in 0..50 {
        s.put(&key(id), value(id, 0), 7).unwrap();
    }
    let st = s.stats().unwrap();
    assert!(st.ram_bytes <= 8_000);
    assert!(st.disk_chunks > 30, "{st:?}");
    assert_eq!(st.dropped, 0);
    for id in 0..50 {
        let c = s.get(&key(id)).unwrap().expect("nothing lost");
        assert_eq!(c.tag, 7);
        assert_eq!(check_value(&c.data), (id, 0));
    }
    assert!(s.stats().unwrap().hits_disk > 0);
    s.flush_all().unwrap();
    drop(s);
    // Everything flushed is found again by a new store on the same folder.
    let s = ChunkStore::open(cfg(Some(dir.path()), 8_000)).unwrap();
    assert_eq!(s.stats().unwrap().disk_chunks, 50);
    for id in 0..50 {
        assert_eq!(check_value(&s.get(&key(id)).unwrap().unwrap().data), (id, 0));
    }
}

#[test]
fn write_through_puts_are_on_disk_when_put_returns() {
    let dir = tempfile::tempdir().unwrap();
    let s =
        ChunkStore::open(StoreConfig { write_through: true, durable: true, ..cfg(Some(dir.path()), 1 << 20) }).unwrap();
    for id in 0..10 {
        s.put(&key(id), value(id, 1), 0).unwrap();
        assert!(s.file_of(&key(id)).unwrap().unwrap().exists());
    }
    // A newer version replaces the file; the older file is gone.
    let old = s.file_of(&key(3)).unwrap().unwrap();
    s.put(&key(3), value(3, 2), 0).unwrap();
    assert!(!old.exists());
    drop(s); // no flush: write-through needs none
    let s = ChunkStore::open(cfg(Some(dir.path()), 1 << 20)).unwrap();
    for id in 0..10 {
        let want = if id == 3 { 2 } else { 1 };
        assert_eq!(check_value(&s.get(&key(id)).unwrap().unwrap().data), (id, want));
    }
    assert_eq!(chunk_files(dir.path()).len(), 10);
}

/// A chunk file deleted from outside the store (an operator cleaning the disk) is forgotten at the
/// next get: a miss, and `contains` and the disk's byte count agree with the disk (they kept
/// naming and counting it).
#[test]
fn a_chunk_file_deleted_from_outside_is_forgotten_by_get() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(StoreConfig { write_through: true, ..cfg(Some(dir.path()), 0) }).unwrap();
    s.put(&key(1), value(1, 1), 0).unwrap();
    s.put(&key(2), value(2, 1), 0).unwrap();
    let before = s.stats().unwrap();
    assert_eq!(before.disk_chunks, 2);
    let gone = s.file_of(&key(1)).unwrap().unwrap();
    let gone_bytes = fs::metadata(&gone).unwrap().len();
    fs::remove_file(&gone).unwrap();
    assert!(s.get(&key(1)).unwrap().is_none());
    assert!(!s.contains(&key(1)).unwrap());
    let after = s.stats().unwrap();
    assert_eq!(after.disk_chunks, 1);
    assert_eq!(after.disk_bytes, before.disk_bytes - gone_bytes);
    assert_eq!(check_value(&s.get(&key(2)).unwrap().unwrap().data), (2, 1));
    s.put(&key(1), value(1, 2), 0).unwrap();
    assert_eq!(check_value(&s.get(&key(1)).unwrap().unwrap().data), (1, 2));
}

#[test]
fn a_damaged_file_is_reported_and_evicted_never_returned() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(StoreConfig { write_through: true, ..cfg(Some(dir.path()), 0) }).unwrap();
    for id in 0..4 {
        s.put(&key(id), value(id, 0), 0).unwrap();
    }
    // Flip one payload byte of key 0, cut key 1 short, break key 2's header.
    let p0 = s.file_of(&key(0)).unwrap().unwrap();
    let mut b = fs::read(&p0).unwrap();
    let n = b.len();
    b[n - 1] ^= 0x10;
    fs::write(&p0, &b).unwrap();
    let p1 = s.file_of(&key(1)).unwrap().unwrap();
    let b = fs::read(&p1).unwrap();
    fs::write(&p1, &b[..b.len() - 5]).unwrap();
    let p2 = s.file_of(&key(2)).unwrap().unwrap();
    let mut b = fs::read(&p2).unwrap();
    b[10] ^= 1; // the tag: covered by the header checksum
    fs::write(&p2, &b).unwrap();

    assert!(matches!(s.get(&key(0)), Err(Error::ChecksumMismatch(_))));
    assert!(matches!(s.get(&key(1)), Err(Error::Truncated(_))));
    assert!(matches!(s.get(&key(2)), Err(Error::ChecksumMismatch(_))));
    for id in 0..3 {
        assert!(s.get(&key(id)).unwrap().is_none(), "evicted after the failed read");
        assert!(!s.contains(&key(id)).unwrap());
    }
    assert!(!p0.exists() && !p1.exists() && !p2.exists());
    assert_eq!(s.stats().unwrap().corrupt_evicted, 3);
    assert_eq!(check_value(&s.get(&key(3)).unwrap().unwrap().data), (3, 0));
}

#[test]
fn open_removes_temporaries_damaged_and_superseded_files() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(StoreConfig { write_through: true, ..cfg(Some(dir.path()), 0) }).unwrap();
    s.put(&key(1), value(1, 0), 0).unwrap();
    let older = s.file_of(&key(1)).unwrap().unwrap();
    let older_bytes = fs::read(&older).unwrap();
    s.put(&key(1), value(1, 1), 0).unwrap();
    s.put(&key(2), value(2, 0), 0).unwrap();
    let p1 = s.file_of(&key(1)).unwrap().unwrap();
    let p2 = s.file_of(&key(2)).unwrap().unwrap();
    drop(s);
    // A writer that died before its rename, a garbage file under a chunk name, and the older
    // version of key 1 back beside the newer one (a crash between rename and unlink).
    let tmp = p1.with_extension("tmp"); // (an earlier version's temporary name)
    fs::write(&tmp, b"partial").unwrap();
    fs::write(&p2, b"not a chunk file at all, longer than sixty-four bytes ............").unwrap();
    fs::write(&older, &older_bytes).unwrap();
    let (_, seq1) = file::parse_name(p1.file_name().unwrap().to_str().unwrap()).unwrap();
    let s = ChunkStore::open(cfg(Some(dir.path()), 1 << 20)).unwrap();
    assert!(!tmp.exists());
    assert!(!p2.exists());
    assert!(!older.exists());
    assert_eq!(s.stats().unwrap().disk_chunks, 1);
    assert_eq!(s.stats().unwrap().corrupt_evicted, 1);
    assert!(s.get(&key(2)).unwrap().is_none());
    assert_eq!(check_value(&s.get(&key(1)).unwrap().unwrap().data), (1, 1));
    // New versions get sequence numbers above every file found.
    s.put(&key(5), value(5, 0), 0).unwrap();
    s.flush_all().unwrap();
    let (_, seq5) =
        file::parse_name(s.file_of(&key(5)).unwrap().unwrap().file_name().unwrap().to_str().unwrap()).unwrap();
    assert!(seq5 > seq1);
}

/// Temporaries `.NAME.PID.N.RANDOM.wz-partial` at open (which holds the folder's lock): those of a
/// writer that exited and of this process (whose stores of the folder are closed) are removed; one
/// of a running process (a writer sharing the folder despite the lock) is left alone; none is
/// indexed or counted as damage.
#[cfg(target_os = "linux")]
#[test]
fn open_removes_temporaries_of_writers_that_are_gone() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(StoreConfig { write_through: true, ..cfg(Some(dir.path()), 0) }).unwrap();
    s.put(&key(1), value(1, 0), 0).unwrap();
    let p1 = s.file_of(&key(1)).unwrap().unwrap();
    drop(s);
    let name1 = p1.file_name().unwrap().to_str().unwrap().to_string();
    let mut exited = std::process::Command::new("true").spawn().unwrap();
    let exited_pid = exited.id();
    exited.wait().unwrap();
    let partial = |pid: u32| p1.with_file_name(format!(".{name1}.{pid}.0.0123abcd.wz-partial"));
    let (gone, own) = (partial(exited_pid), partial(std::process::id()));
    let live = partial(std::os::unix::process::parent_id());
    for t in [&gone, &own, &live] {
        fs::write(t, b"half a chunk").unwrap();
        assert!(file::temporary_pid(t.file_name().unwrap().to_str().unwrap()).is_some());
    }
    let s = ChunkStore::open(cfg(Some(dir.path()), 1 << 20)).unwrap();
    assert!(!gone.exists() && !own.exists());
    assert!(live.exists(), "a running writer's temporary is left alone");
    let st = s.stats().unwrap();
    assert_eq!((st.disk_chunks, st.corrupt_evicted), (1, 0));
    assert_eq!(check_value(&s.get(&key(1)).unwrap().unwrap().data), (1, 0));
}

#[test]
fn open_removes_chunk_files_outside_their_hash_folder() {
    // A chunk file lives in the folder named by its hash's first byte; `get` looks nowhere else. A
    // valid file moved into another folder is not this store's (removed at open, like damage, so
    // `contains` and `get` agree), and a copy of one there must not displace the original.
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(StoreConfig { write_through: true, ..cfg(Some(dir.path()), 0) }).unwrap();
    for id in 1..=3 {
        s.put(&key(id), value(id, 0), 0).unwrap();
    }
    let (p1, p2) = (s.file_of(&key(1)).unwrap().unwrap(), s.file_of(&key(2)).unwrap().unwrap());
    drop(s);
    let elsewhere = |p: &Path| {
        let sub = p.parent().unwrap().file_name().unwrap().to_str().unwrap();
        let other = format!("{:02x}", (u8::from_str_radix(sub, 16).unwrap()).wrapping_add(1));
        dir.path().join(other).join(p.file_name().unwrap())
    };
    let (moved, copied) = (elsewhere(&p1), elsewhere(&p2));
    fs::rename(&p1, &moved).unwrap();
    fs::copy(&p2, &copied).unwrap();
    let s = ChunkStore::open(cfg(Some(dir.path()), 1 << 20)).unwrap();
    assert!(!s.contains(&key(1)).unwrap());
    assert!(s.get(&key(1)).unwrap().is_none());
    assert!(!moved.exists() && !copied.exists());
    assert_eq!(check_value(&s.get(&key(2)).unwrap().unwrap().data), (2, 0));
    assert!(s.contains(&key(3)).unwrap());
    assert_eq!(s.stats().unwrap().disk_chunks, 2);
    assert_eq!(s.stats().unwrap().corrupt_evicted, 2);
}

#[test]
fn disk_budget_evicts_oldest_files() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(StoreConfig { disk_bytes: 20_000, ..cfg(Some(dir.path()), 0) }).unwrap();
    for id in 0..40 {
        s.put(&key(id), vec![1u8; 1000], 0).unwrap();
    }
    let st = s.stats().unwrap();
    assert!(st.disk_bytes <= 20_000, "{st:?}");
    assert!(st.dropped > 0);
    assert!(s.contains(&key(39)).unwrap());
    assert!(!s.contains(&key(0)).unwrap());
    let on_disk: u64 = chunk_files(dir.path()).iter().map(|p| fs::metadata(p).unwrap().len()).sum();
    assert_eq!(on_disk, st.disk_bytes);
}

#[test]
fn keys_cannot_name_paths_outside_the_folder() {
    let dir = tempfile::tempdir().unwrap();
    let inner = dir.path().join("store");
    let s = ChunkStore::open(StoreConfig { write_through: true, ..cfg(Some(&inner), 0) }).unwrap();
    for k in [&b"../../escape"[..], b"/etc/passwd", b"a/../../b", b"\0\xff", b"."] {
        s.put(k, b"x".to_vec(), 0).unwrap();
        assert_eq!(*s.get(k).unwrap().unwrap().data, b"x");
        assert!(s.file_of(k).unwrap().unwrap().starts_with(&inner));
    }
    let names: Vec<_> = fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, vec![std::ffi::OsString::from("store")]);
}

#[test]
fn bad_arguments_and_lying_headers_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(StoreConfig { max_chunk_bytes: 4096, write_through: true, ..cfg(Some(dir.path()), 0) })
        .unwrap();
    assert!(matches!(s.put(b"", vec![1], 0), Err(Error::InvalidArgument(_))));
    assert!(matches!(s.put(&vec![b'k'; 70_000], vec![1], 0), Err(Error::InvalidArgument(_))));
    assert!(matches!(s.put(b"big", vec![0; 4097], 0), Err(Error::LimitExceeded(_))));
    s.put(b"k", vec![0; 100], 0).unwrap();
    // A header that declares a payload far beyond the file (and the limit) must fail before
    // allocating it: a truncated file (damage: evicted)
    let p = s.file_of(b"k").unwrap().unwrap();
    let mut b = fs::read(&p).unwrap();
    b[16..24].copy_from_slice(&(u64::MAX / 2).to_le_bytes());
    fs::write(&p, &b).unwrap();
    assert!(matches!(s.get(b"k"), Err(Error::Truncated(_))));
    assert!(s.get(b"k").unwrap().is_none());
    // One process per folder.
    assert!(matches!(ChunkStore::open(cfg(Some(dir.path()), 0)), Err(Error::InvalidArgument(_))));
    drop(s);
    ChunkStore::open(cfg(Some(dir.path()), 0)).unwrap();
}

#[test]
fn delete_and_replace_across_tiers() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(cfg(Some(dir.path()), 4_000)).unwrap();
    for id in 0..20 {
        s.put(&key(id), value(id, 0), 0).unwrap();
    }
    for id in 0..20 {
        s.put(&key(id), value(id, 1), 0).unwrap();
    }
    for id in (0..20).step_by(3) {
        assert!(s.delete(&key(id)).unwrap());
        assert!(!s.delete(&key(id)).unwrap());
    }
    s.flush_all().unwrap();
    for id in 0..20 {
        let got = s.get(&key(id)).unwrap();
        if id % 3 == 0 {
            assert!(got.is_none());
        } else {
            assert_eq!(check_value(&got.unwrap().data), (id, 1));
        }
    }
    // One file per stored key: replaced and deleted versions left nothing behind.
    let keys_left = (0..20).filter(|id| id % 3 != 0).count();
    assert_eq!(chunk_files(dir.path()).len(), keys_left);
}

#[test]
fn batched_put_and_get_keep_order() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(StoreConfig { io_threads: 3, ..cfg(Some(dir.path()), 20_000) }).unwrap();
    let items: Vec<_> = (0..64).map(|id| (key(id), value(id, 0), id as u32)).collect();
    assert!(s.put_many(items).into_iter().all(|r| r.is_ok()));
    let mut keys: Vec<_> = (0..64).map(key).collect();
    keys.push(b"absent".to_vec());
    let got = s.get_many(&keys);
    for (id, r) in got.iter().enumerate() {
        match r.as_ref().unwrap() {
            Some(c) => {
                assert_eq!(c.tag, id as u32);
                assert_eq!(check_value(&c.data), (id as u64, 0));
            }
            None => assert_eq!(id, 64),
        }
    }
}

/// Threads putting the same key at once, write-through (every put writes a file): each write has
/// its own temporary, so none renames another's half-written file into place. Every read returns
/// intact bytes of some version, the last put wins, and no temporary is left.
#[test]
fn concurrent_puts_of_one_key_never_share_a_temporary() {
    const THREADS: u64 = 4;
    const PUTS: u64 = 200;
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(ChunkStore::open(StoreConfig { write_through: true, ..cfg(Some(dir.path()), 0) }).unwrap());
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let s = s.clone();
            std::thread::spawn(move || {
                for i in 0..PUTS {
                    s.put(&key(7), value(7, t * PUTS + i), 0).unwrap();
                    let c = s.get(&key(7)).unwrap().expect("a version of key 7");
                    assert_eq!(check_value(&c.data).0, 7);
                }
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    let st = s.stats().unwrap();
    assert_eq!((st.corrupt_evicted, st.flush_errors), (0, 0));
    let got = check_value(&s.get(&key(7)).unwrap().unwrap().data);
    let files = chunk_files(dir.path());
    assert_eq!(files.len(), 1, "one file, no temporaries: {files:?}");
    drop(s);
    let s = ChunkStore::open(cfg(Some(dir.path()), 1 << 20)).unwrap();
    assert_eq!(check_value(&s.get(&key(7)).unwrap().unwrap().data), got);
}

/// Eight threads of mixed put / get / delete / evict on shared keys: every read returns the
/// intact bytes of some version of the key it asked for, and at the end each key holds exactly
/// the last version its writer put (each key has one writer thread; readers read every key).
#[test]
fn eight_threads_of_mixed_operations_lose_nothing() {
    const THREADS: u64 = 8;
    const KEYS_PER_THREAD: u64 = 40;
    const OPS: u64 = 6_000;
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(ChunkStore::open(StoreConfig { disk_bytes: 0, ..cfg(Some(dir.path()), 60_000) }).unwrap());
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let s = s.clone();
            std::thread::spawn(move || {
                let mut last: Vec<Option<u64>> = vec![None; KEYS_PER_THREAD as usize];
                let mut r = 0x1234_5678u64 + t;
                for op in 0..OPS {
                    r ^= r << 13;
                    r ^= r >> 7;
                    r ^= r << 17;
                    let own = (r >> 8) % KEYS_PER_THREAD;
                    let id = t * KEYS_PER_THREAD + own;
                    match r % 10 {
                        0..=3 => {
                            s.put(&key(id), value(id, op), 0).unwrap();
                            last[own as usize] = Some(op);
                        }
                        4 => {
                            s.delete(&key(id)).unwrap();
                            last[own as usize] = None;
                        }
                        5 => {
                            s.evict_from_ram(&key(id)).unwrap();
                        }
                        _ => {
                            // Read any thread's key.
                            let other = (r >> 20) % (THREADS * KEYS_PER_THREAD);
                            if let Some(c) = s.get(&key(other)).unwrap() {
                                assert_eq!(check_value(&c.data).0, other);
                            }
                        }
                    }
                }
                last
            })
        })
        .collect();
    let lasts: Vec<_> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let st = s.stats().unwrap();
    assert!(st.evicted_to_disk > 0 && st.hits_disk > 0, "both tiers used: {st:?}");
    assert_eq!(st.flush_errors, 0);
    assert_eq!(st.corrupt_evicted, 0);
    for (t, last) in lasts.iter().enumerate() {
        for (own, want) in last.iter().enumerate() {
            let id = t as u64 * KEYS_PER_THREAD + own as u64;
            let got = s.get(&key(id)).unwrap().map(|c| check_value(&c.data).1);
            assert_eq!(got, *want, "key {id}");
        }
    }
    s.flush_all().unwrap();
    let stored = lasts.iter().flatten().filter(|v| v.is_some()).count();
    assert_eq!(chunk_files(dir.path()).len(), stored, "one file per stored key, no leftovers");
}

// -- found by a review (session 25): sequence numbers, entries that are not chunk files, puts lost
// at drop and close -----------------------------------------------------------------------------

fn seq_of(p: &Path) -> u64 {
    file::parse_name(p.file_name().unwrap().to_str().unwrap()).unwrap().1
}

/// A chunk of key `k` written as a valid file of sequence number `seq` (what a crafted or a
/// foreign file could hold).
fn write_raw(dir: &Path, k: &[u8], payload: &[u8], seq: u64) -> std::path::PathBuf {
    let h = file::key_hash(k);
    let p = dir.join(file::rel_path(h, seq));
    fs::create_dir_all(p.parent().unwrap()).unwrap();
    let hd = file::Header {
        tag: 0,
        key_len: k.len() as u32,
        payload_len: payload.len() as u64,
        seq,
        key_hash: h,
        payload_xxh3: xxhash_rust::xxh3::xxh3_64(payload),
    };
    file::write_chunk(&p, &hd, k, payload, false).unwrap();
    p
}

#[test]
fn files_a_store_cannot_read_still_hold_their_sequence_numbers() {
    // A chunk above a later open's max_chunk_bytes is left on disk, unreadable there. A new version of
    // its key put then must get a larger number: at the next open that indexes both, the newest
    // wins (the older one took a lower number and the new file was deleted as stale).
    let dir = tempfile::tempdir().unwrap();
    let big = |max| StoreConfig { max_chunk_bytes: max, ..cfg(Some(dir.path()), 1 << 20) };
    let s = ChunkStore::open(big(1 << 20)).unwrap();
    s.put(b"X", b"x".to_vec(), 0).unwrap();
    s.put(b"Y", b"y".to_vec(), 0).unwrap();
    s.put(b"K", b"OLD".repeat(1000), 0).unwrap();
    s.delete(b"Y").unwrap();
    s.close().unwrap();
    drop(s);
    let s = ChunkStore::open(big(1000)).unwrap();
    assert!(matches!(s.get(b"K"), Err(Error::LimitExceeded(_))));
    s.put(b"K", b"NEW".to_vec(), 0).unwrap();
    s.close().unwrap();
    drop(s);
    let s = ChunkStore::open(big(1 << 20)).unwrap();
    assert_eq!(&**s.get(b"K").unwrap().unwrap().data, b"NEW");
    assert_eq!(&**s.get(b"X").unwrap().unwrap().data, b"x");
    assert_eq!(chunk_files(dir.path()).len(), 2, "the older K is deleted as stale");
}

#[test]
fn sequence_numbers_near_the_top_are_damage_and_never_wrap() {
    // A file named with a number next_seq would wrap past (crafted, or copied from elsewhere): the
    // next put took 2**64 - 1 and the one after 0 (or overflowed), and was lost at the next open.
    for bad in [u64::MAX, u64::MAX - 1, file::MAX_SEQ] {
        let dir = tempfile::tempdir().unwrap();
        let s = ChunkStore::open(StoreConfig { write_through: true, ..cfg(Some(dir.path()), 1 << 20) }).unwrap();
        s.put(&key(1), value(1, 0), 0).unwrap();
        drop(s);
        let crafted = write_raw(dir.path(), &key(2), b"crafted", bad);
        let s = ChunkStore::open(cfg(Some(dir.path()), 1 << 20)).unwrap();
        assert!(!crafted.exists(), "{bad:#x}");
        assert_eq!(s.stats().unwrap().corrupt_evicted, 1);
        assert!(s.get(&key(2)).unwrap().is_none());
        for v in 0..3 {
            s.put(&key(2), value(2, v), 0).unwrap();
            s.put(&key(3 + v), value(3 + v, 0), 0).unwrap();
        }
        s.close().unwrap();
        drop(s);
        let s = ChunkStore::open(cfg(Some(dir.path()), 1 << 20)).unwrap();
        assert_eq!(check_value(&s.get(&key(2)).unwrap().unwrap().data), (2, 2));
        for id in [1, 3, 4, 5] {
            assert_eq!(check_value(&s.get(&key(id)).unwrap().unwrap().data).0, id);
        }
        assert!(chunk_files(dir.path()).iter().all(|p| seq_of(p) < 16));
    }
    // the largest number allowed is kept, and a put after it is a typed error, not a wrap
    let dir = tempfile::tempdir().unwrap();
    let top = write_raw(dir.path(), &key(1), b"top", file::MAX_SEQ - 1);
    let s = ChunkStore::open(cfg(Some(dir.path()), 1 << 20)).unwrap();
    assert!(top.exists());
    assert_eq!(&**s.get(&key(1)).unwrap().unwrap().data, b"top");
    assert!(matches!(s.put(&key(1), b"next".to_vec(), 0), Err(Error::LimitExceeded(_))));
    assert_eq!(&**s.get(&key(1)).unwrap().unwrap().data, b"top");
}

#[cfg(unix)]
#[test]
fn entries_that_are_not_chunk_files_are_removed_at_open() {
    use std::os::unix::fs::symlink;
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(StoreConfig { write_through: true, ..cfg(Some(dir.path()), 1 << 20) }).unwrap();
    s.put(&key(1), value(1, 0), 0).unwrap();
    let p1 = s.file_of(&key(1)).unwrap().unwrap();
    drop(s);
    let seq1 = seq_of(&p1);
    let sub = p1.parent().unwrap();
    let named = |k: &[u8], seq: u64| dir.path().join(file::rel_path(file::key_hash(k), seq));
    // a directory where the next version of key 1 goes (with something in it), a symlink loop, a
    // dangling symlink, a symlink to a valid chunk file kept outside the store
    let in_the_way = named(&key(1), seq1 + 1);
    fs::create_dir_all(in_the_way.join("inner")).unwrap();
    fs::write(in_the_way.join("inner/f"), b"x").unwrap();
    let looping = named(&key(2), 5);
    fs::create_dir_all(looping.parent().unwrap()).unwrap();
    symlink(looping.file_name().unwrap(), &looping).unwrap();
    let dangling = named(&key(3), 6);
    fs::create_dir_all(dangling.parent().unwrap()).unwrap();
    symlink(dir.path().join("nowhere"), &dangling).unwrap();
    let outside = tempfile::tempdir().unwrap();
    let target = write_raw(outside.path(), &key(4), b"elsewhere", 7);
    let linked = named(&key(4), 7);
    fs::create_dir_all(linked.parent().unwrap()).unwrap();
    symlink(&target, &linked).unwrap();
    // a regular file and a dangling link where two subfolders go
    let free: Vec<_> = (0..256u32)
        .map(|i| dir.path().join(format!("{i:02x}")))
        .filter(|d| d != sub && fs::read_dir(d).map_or(true, |mut r| r.next().is_none()))
        .take(2)
        .collect();
    for d in &free {
        let _ = fs::remove_dir(d);
    }
    fs::write(&free[0], b"a file").unwrap();
    symlink(dir.path().join("nowhere"), &free[1]).unwrap();

    let s = ChunkStore::open(StoreConfig { write_through: false, ..cfg(Some(dir.path()), 1 << 20) }).unwrap();
    for p in [&in_the_way, &looping, &dangling, &linked] {
        assert!(fs::symlink_metadata(p).is_err(), "{} left", p.display());
    }
    assert!(target.exists(), "a link is removed, not what it points to");
    assert!(free.iter().all(|d| fs::symlink_metadata(d).unwrap().is_dir()));
    assert_eq!(s.stats().unwrap().corrupt_evicted, 4);
    assert_eq!(s.stats().unwrap().disk_chunks, 1);
    assert!(s.get(&key(4)).unwrap().is_none());
    // write-back puts of every key reach disk (the directory blocked key 1's next version)
    for id in 1..=4 {
        s.put(&key(id), value(id, 1), 0).unwrap();
    }
    s.flush_all().unwrap();
    assert_eq!(s.stats().unwrap().flush_errors, 0);
    s.close().unwrap();
    drop(s);
    let s = ChunkStore::open(cfg(Some(dir.path()), 1 << 20)).unwrap();
    assert_eq!(s.stats().unwrap().corrupt_evicted, 0, "nothing left to count again");
    for id in 1..=4 {
        assert_eq!(check_value(&s.get(&key(id)).unwrap().unwrap().data), (id, 1));
    }
}

#[test]
fn a_dropped_store_writes_its_write_back_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(cfg(Some(dir.path()), 1 << 20)).unwrap();
    for id in 0..10 {
        s.put(&key(id), value(id, 0), 0).unwrap();
    }
    assert!(chunk_files(dir.path()).is_empty(), "write-back: still only in RAM");
    drop(s);
    let s = ChunkStore::open(cfg(Some(dir.path()), 1 << 20)).unwrap();
    for id in 0..10 {
        assert_eq!(check_value(&s.get(&key(id)).unwrap().unwrap().data), (id, 0));
    }
}

#[test]
fn close_fails_later_puts_and_keeps_every_acknowledged_one() {
    let dir = tempfile::tempdir().unwrap();
    let s = Arc::new(ChunkStore::open(cfg(Some(dir.path()), 1 << 30)).unwrap());
    for id in 0..2000 {
        s.put(&key(id), value(id, 0), 0).unwrap();
    }
    let handles: Vec<_> = (0..4u64)
        .map(|t| {
            let s = s.clone();
            std::thread::spawn(move || {
                let mut acked = Vec::new();
                for i in 0.. {
                    let id = 10_000 + t * 1_000_000 + i;
                    match s.put(&key(id), value(id, 0), 0) {
                        Ok(()) => acked.push(id),
                        Err(Error::InvalidArgument(m)) => {
                            assert!(m.contains("closed"), "{m}");
                            break;
                        }
                        Err(e) => panic!("{e}"),
                    }
                }
                acked
            })
        })
        .collect();
    std::thread::sleep(std::time::Duration::from_millis(20));
    s.close().unwrap();
    // every put that returned Ok is on disk now, before the store is dropped
    let files = chunk_files(dir.path()).len();
    let acked: Vec<u64> = handles.into_iter().flat_map(|h| h.join().unwrap()).collect();
    assert_eq!(files, 2000 + acked.len());
    assert!(matches!(s.put(b"late", b"x".to_vec(), 0), Err(Error::InvalidArgument(_))));
    assert!(matches!(s.get(&key(0)), Err(Error::InvalidArgument(_))));
    s.close().unwrap();
    drop(s);
    let s = ChunkStore::open(cfg(Some(dir.path()), 1 << 30)).unwrap();
    assert_eq!(s.stats().unwrap().disk_chunks as usize, 2000 + acked.len());
    for id in acked {
        assert_eq!(check_value(&s.get(&key(id)).unwrap().unwrap().data).0, id);
    }
}

// -- found by a review (session 26): entries made in a chunk's place while the store is open --------

/// Something made at the name of a key's next chunk file while the store is open: a directory
/// (empty, or holding links out of the store), a symbolic link to a directory outside, a socket.
/// The put goes ahead (a directory failed its rename: a write-through put was an error, a write-back
/// chunk was dropped and counted in flush_errors, and its older version with it); nothing outside
/// the store is followed or touched, and the next open removes the directory moved aside.
#[cfg(unix)]
#[test]
fn an_entry_made_in_a_chunks_place_while_open_loses_no_put() {
    use std::os::unix::fs::symlink;
    for write_through in [true, false] {
        for kind in ["empty directory", "directory", "link to a directory", "socket"] {
            let what = format!("{kind}, write_through={write_through}");
            let dir = tempfile::tempdir().unwrap();
            let outside = tempfile::tempdir().unwrap();
            fs::write(outside.path().join("kept"), b"outside").unwrap();
            let s = ChunkStore::open(StoreConfig { write_through, ..cfg(Some(dir.path()), 1 << 20) }).unwrap();
            s.put(&key(1), value(1, 0), 0).unwrap();
            s.flush_all().unwrap();
            let p = s.file_of(&key(1)).unwrap().unwrap();
            let next = dir.path().join(file::rel_path(file::key_hash(&key(1)), seq_of(&p) + 1));
            let _socket;
            match kind {
                "empty directory" => fs::create_dir(&next).unwrap(),
                "directory" => {
                    fs::create_dir_all(next.join("inner")).unwrap();
                    symlink(outside.path().join("kept"), next.join("inner/link")).unwrap();
                    symlink(outside.path(), next.join("dirlink")).unwrap();
                }
                "link to a directory" => symlink(outside.path(), &next).unwrap(),
                _ => _socket = std::os::unix::net::UnixListener::bind(&next).unwrap(),
            }
            s.put(&key(1), value(1, 1), 0).unwrap();
            s.flush_all().unwrap(); // (write-back: the file is written here)
            assert_eq!(s.stats().unwrap().flush_errors, 0, "{what}");
            assert_eq!(s.file_of(&key(1)).unwrap(), Some(next.clone()), "{what}");
            assert!(fs::symlink_metadata(&next).unwrap().is_file(), "{what}");
            assert_eq!(check_value(&s.get(&key(1)).unwrap().unwrap().data), (1, 1), "{what}");
            s.close().unwrap();
            drop(s);
            assert_eq!(fs::read(outside.path().join("kept")).unwrap(), b"outside", "{what}");
            assert_eq!(fs::read_dir(outside.path()).unwrap().count(), 1, "{what}");
            let s = ChunkStore::open(cfg(Some(dir.path()), 1 << 20)).unwrap();
            let moved_aside = kind.ends_with("directory") && !kind.starts_with("link");
            assert_eq!(s.stats().unwrap().corrupt_evicted, moved_aside as u64, "{what}");
            assert_eq!(check_value(&s.get(&key(1)).unwrap().unwrap().data), (1, 1), "{what}");
            assert_eq!(chunk_files(dir.path()), vec![next], "{what}: nothing else left");
            assert_eq!(fs::read(outside.path().join("kept")).unwrap(), b"outside", "{what}");
        }
    }
}

/// Every call after `close` (but `close` itself and `config`) is the error that puts and gets
/// were, which the Python wrapper raises for every call: `delete` removed files of a closed store,
/// `contains`, `stats`, `file_of` answered, `flush_all` wrote, `evict_from_ram` said false.
#[test]
fn every_call_after_close_is_the_closed_error() {
    let dir = tempfile::tempdir().unwrap();
    let s = ChunkStore::open(cfg(Some(dir.path()), 1 << 20)).unwrap();
    s.put(&key(1), value(1, 0), 0).unwrap();
    s.put(&key(2), value(2, 0), 0).unwrap();
    s.close().unwrap();
    let closed = |r: Result<(), Error>, call: &str| match r {
        Err(Error::InvalidArgument(m)) => assert!(m.contains("the store is closed"), "{call}: {m}"),
        other => panic!("{call} after close: {other:?}"),
    };
    closed(s.put(&key(3), value(3, 0), 0), "put");
    closed(s.get(&key(1)).map(drop), "get");
    closed(s.contains(&key(1)).map(drop), "contains");
    closed(s.delete(&key(1)).map(drop), "delete");
    closed(s.stats().map(drop), "stats");
    closed(s.file_of(&key(1)).map(drop), "file_of");
    closed(s.evict_from_ram(&key(2)).map(drop), "evict_from_ram");
    closed(s.flush_all(), "flush_all");
    closed(s.install(|| ()), "install");
    for r in s.put_many(vec![(key(4), value(4, 0), 0)]) {
        closed(r, "put_many");
    }
    for r in s.get_many(&[key(1)]) {
        closed(r.map(drop), "get_many");
    }
    s.close().unwrap();
    assert_eq!(s.config().dir.as_deref(), Some(dir.path()));
    drop(s);
    // nothing was deleted or written after close
    let s = ChunkStore::open(cfg(Some(dir.path()), 1 << 20)).unwrap();
    assert_eq!(chunk_files(dir.path()).len(), 2);
    for id in [1, 2] {
        assert_eq!(check_value(&s.get(&key(id)).unwrap().unwrap().data), (id, 0));
    }
}

/// A key's subfolder removed (with what it held) or replaced by a file or a dangling link while the
/// store is open: a later put of the key failed ("No such file or directory", "Not a directory":
/// a write-back chunk was dropped). The write makes the subfolder again, as open does; a store
/// whose whole folder is gone still fails, not made again.
#[cfg(unix)]
#[test]
fn a_subfolder_removed_while_open_is_made_again() {
    for write_through in [true, false] {
        for kind in ["removed", "file", "dangling link"] {
            let what = format!("{kind}, write_through={write_through}");
            let dir = tempfile::tempdir().unwrap();
            let s = ChunkStore::open(StoreConfig { write_through, ..cfg(Some(dir.path()), 1 << 20) }).unwrap();
            s.put(&key(1), value(1, 0), 0).unwrap();
            s.flush_all().unwrap();
            let sub = s.file_of(&key(1)).unwrap().unwrap().parent().unwrap().to_path_buf();
            fs::remove_dir_all(&sub).unwrap();
            match kind {
                "file" => fs::write(&sub, b"a file").unwrap(),
                "dangling link" => std::os::unix::fs::symlink(dir.path().join("nowhere"), &sub).unwrap(),
                _ => {}
            }
            s.put(&key(1), value(1, 1), 0).unwrap();
            s.flush_all().unwrap();
            assert_eq!(s.stats().unwrap().flush_errors, 0, "{what}");
            assert!(fs::symlink_metadata(&sub).unwrap().is_dir(), "{what}");
            s.close().unwrap();
            drop(s);
            let s = ChunkStore::open(cfg(Some(dir.path()), 1 << 20)).unwrap();
            assert_eq!(check_value(&s.get(&key(1)).unwrap().unwrap().data), (1, 1), "{what}");
        }
    }
    // the store's folder itself gone: an error, nothing made again
    let parent = tempfile::tempdir().unwrap();
    let dir = parent.path().join("store");
    let s = ChunkStore::open(StoreConfig { write_through: true, ..cfg(Some(&dir), 1 << 20) }).unwrap();
    fs::remove_dir_all(&dir).unwrap();
    assert!(matches!(s.put(&key(1), value(1, 0), 0), Err(Error::Io(_))));
    assert!(!dir.exists());
}

/// A chunk file this store cannot read (above its max_chunk_bytes, or of a newer format version) is
/// its error on `get`, named by `contains` and counted, replaced by `put` and removed by `delete`:
/// it was a silent miss, and a key deleted meanwhile came back at an open that reads it. A newest
/// version this store cannot read hides the older one it can (that one was returned).
#[test]
fn chunks_a_store_cannot_read_are_reported_not_missed() {
    let dir = tempfile::tempdir().unwrap();
    let limit = |max| StoreConfig { max_chunk_bytes: max, ..cfg(Some(dir.path()), 1 << 20) };
    let s = ChunkStore::open(limit(1 << 20)).unwrap();
    for k in [&b"big"[..], b"gone", b"new", b"v2"] {
        s.put(k, vec![7; 2000], 0).unwrap();
    }
    s.close().unwrap();
    drop(s);
    // "v2" patched to a newer format version; "old" has a readable older version under a newest
    // one too big for the next open (a crash between a put's rename and its unlink leaves that)
    let v2 = ChunkStore::open(limit(1 << 20)).unwrap().file_of(b"v2").unwrap().unwrap();
    let mut b = fs::read(&v2).unwrap();
    b[4..6].copy_from_slice(&2u16.to_le_bytes());
    fs::write(&v2, &b).unwrap();
    write_raw(dir.path(), b"old", b"older version", 1000);
    write_raw(dir.path(), b"old", &[1; 2000], 1001);

    let s = ChunkStore::open(limit(1000)).unwrap();
    assert_eq!(s.stats().unwrap().unreadable_chunks, 5);
    assert!(s.contains(b"big").unwrap() && s.contains(b"v2").unwrap());
    assert!(matches!(s.get(b"big"), Err(Error::LimitExceeded(_))));
    assert!(matches!(s.get(b"big"), Err(Error::LimitExceeded(_))), "every time, never removed");
    assert!(matches!(s.get(b"v2"), Err(Error::UnsupportedVersion(2, 1))));
    assert!(matches!(s.get(b"old"), Err(Error::LimitExceeded(_))), "not the older version");
    assert!(s.delete(b"gone").unwrap());
    assert!(!s.contains(b"gone").unwrap() && s.get(b"gone").unwrap().is_none());
    s.put(b"new", b"small".to_vec(), 0).unwrap();
    assert_eq!(&**s.get(b"new").unwrap().unwrap().data, b"small");
    let st = s.stats().unwrap();
    assert_eq!((st.unreadable_chunks, st.corrupt_evicted, st.disk_bytes), (3, 0, 0));
    s.close().unwrap();
    drop(s);

    let s = ChunkStore::open(limit(1 << 20)).unwrap();
    assert_eq!(&**s.get(b"big").unwrap().unwrap().data, &[7; 2000]);
    assert_eq!(&**s.get(b"old").unwrap().unwrap().data, &[1; 2000]);
    assert!(s.get(b"gone").unwrap().is_none(), "a deleted key came back");
    assert_eq!(&**s.get(b"new").unwrap().unwrap().data, b"small");
    assert!(matches!(s.get(b"v2"), Err(Error::UnsupportedVersion(2, 1))));
    // big, old, new, v2: the older "old" and the replaced "new" are gone
    assert_eq!(chunk_files(dir.path()).len(), 4);
}

/// A directory named like a chunk file holding a tree 2,000 levels deep (the most a 4 KiB path
/// allows with one-letter names): removed whole from a thread with a 128 KiB stack. std's
/// remove_dir_all, which the store used, recursed once per level and overflowed such a stack
/// (the process aborted); the work list does not recurse.
#[cfg(unix)]
#[test]
fn a_deep_directory_in_a_chunk_files_place_is_removed_without_recursion() {
    let dir = tempfile::tempdir().unwrap();
    let top = dir.path().join(file::rel_path(file::key_hash(&key(1)), 1));
    fs::create_dir_all(top.parent().unwrap()).unwrap();
    let mut p = top.clone();
    fs::create_dir(&p).unwrap();
    for level in 0..2000 {
        p.push(if level % 2 == 0 { "d" } else { "e" });
        fs::create_dir(&p).unwrap();
        if level % 500 == 0 {
            fs::write(p.with_file_name("f"), b"x").unwrap();
        }
    }
    assert!(p.as_os_str().len() > 4000, "{}", p.as_os_str().len());
    let t = top.clone();
    let r = std::thread::Builder::new()
        .stack_size(128 << 10)
        .spawn(move || file::remove_entry(&t))
        .unwrap()
        .join()
        .unwrap();
    r.unwrap();
    assert!(fs::symlink_metadata(&top).is_err());
    assert!(top.parent().unwrap().is_dir(), "only the entry is removed");
}
