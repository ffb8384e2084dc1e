//! One chunk file on disk: a 64-byte header, the key, the payload. docs/STORE.md specifies it.
//!
//! ```text
//! offset size field
//!      0    4 magic "WZCK"
//!      4    2 version (1), little-endian like every integer here
//!      6    2 flags (0; a reader rejects bits it does not know)
//!      8    4 tag: what the payload is (0 raw bytes, 1 weightszip container, 2.. compact formats)
//!     12    4 key length K (1..=MAX_KEY_LEN)
//!     16    8 payload length P
//!     24    8 sequence number of this version of the key (unique per store, increasing)
//!     32   16 XXH3-128 of the key (also the file's name)
//!     48    8 XXH3-64 of the payload
//!     56    8 XXH3-64 of bytes 0..56 followed by the key
//!     64    K key
//!   64+K    P payload
//! ```
//! Files are written as a temporary `.NAME.PID.N.XXXXXXXX.wz-partial` beside `NAME` (created
//! exclusively, so no two writes ever share one: `weightszip_core::codec::create_temporary`, as the
//! CLI writers do), fsynced, renamed to `NAME` and the folder fsynced, so that a reader (or a
//! restart after a crash) sees either the whole file or none of it. A directory in `NAME`'s place
//! (the one entry a rename cannot replace) is renamed aside first: `publish`.

use std::fs::{self, File};
use std::io::{ErrorKind, Read, Write};
use std::path::{Path, PathBuf};

use weightszip_core::{Error, Result};
use xxhash_rust::xxh3::{xxh3_128, xxh3_64};

pub const MAGIC: [u8; 4] = *b"WZCK";
pub const VERSION: u16 = 1;
pub const HEADER_LEN: usize = 64;
/// Keys longer than this are refused: they are names, not data.
pub const MAX_KEY_LEN: usize = 64 * 1024;
pub const SUFFIX: &str = "wzc";
/// The temporary name of earlier versions of this crate (`NAME` with its suffix replaced by
/// `tmp`, shared by every write of one name): still removed when a store is opened.
pub const LEGACY_TMP_SUFFIX: &str = "tmp";
/// Sequence numbers are below this: a file named with a larger one is damage (a store that believed
/// it would run out of numbers, or wrap around to numbers older files hold).
pub const MAX_SEQ: u64 = 1 << 63;
/// Length of a chunk file's name (`rel_path`'s last component).
const NAME_LEN: usize = 32 + 1 + 16 + 1 + SUFFIX.len();

pub fn key_hash(key: &[u8]) -> u128 {
    xxh3_128(key)
}

/// `HH/HHHH...-SSSS.wzc`: 256 subfolders by the hash's first byte; the name holds only hex digits,
/// so no key can name a path outside the store's folder.
pub fn rel_path(hash: u128, seq: u64) -> PathBuf {
    let h = format!("{hash:032x}");
    PathBuf::from(&h[..2]).join(format!("{h}-{seq:016x}.{SUFFIX}"))
}

/// Parse a file name written by `rel_path` (the last component only).
pub fn parse_name(name: &str) -> Option<(u128, u64)> {
    let stem = name.strip_suffix(&format!(".{SUFFIX}"))?;
    let (h, s) = stem.split_once('-')?;
    if h.len() != 32 || s.len() != 16 {
        return None;
    }
    Some((u128::from_str_radix(h, 16).ok()?, u64::from_str_radix(s, 16).ok()?))
}

/// The PID of the writer of a temporary chunk file (`write_chunk`'s names: `.NAME.PID.N.XXXXXXXX.wz-partial`
/// with NAME a chunk file's name); None for any other name.
pub fn temporary_pid(name: &str) -> Option<u32> {
    let chunk = name.strip_prefix('.')?.get(..NAME_LEN)?;
    parse_name(chunk)?;
    weightszip_core::codec::temporary_pid(name, &format!(".{chunk}."))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Header {
    pub tag: u32,
    pub key_len: u32,
    pub payload_len: u64,
    pub seq: u64,
    pub key_hash: u128,
    pub payload_xxh3: u64,
}

impl Header {
    pub fn file_len(&self) -> u64 {
        HEADER_LEN as u64 + self.key_len as u64 + self.payload_len
    }

    fn first56(&self) -> [u8; 56] {
        let mut b = [0u8; 56];
        b[0..4].copy_from_slice(&MAGIC);
        b[4..6].copy_from_slice(&VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&0u16.to_le_bytes());
        b[8..12].copy_from_slice(&self.tag.to_le_bytes());
        b[12..16].copy_from_slice(&self.key_len.to_le_bytes());
        b[16..24].copy_from_slice(&self.payload_len.to_le_bytes());
        b[24..32].copy_from_slice(&self.seq.to_le_bytes());
        b[32..48].copy_from_slice(&self.key_hash.to_le_bytes());
        b[48..56].copy_from_slice(&self.payload_xxh3.to_le_bytes());
        b
    }

    /// The 64 header bytes followed by the key.
    pub fn encode(&self, key: &[u8]) -> Vec<u8> {
        let mut out = Vec::with_capacity(HEADER_LEN + key.len());
        out.extend_from_slice(&self.first56());
        out.extend_from_slice(&[0u8; 8]);
        out.extend_from_slice(key);
        let sum = header_sum(&out[..56], key);
        out[56..64].copy_from_slice(&sum.to_le_bytes());
        out
    }

    /// Parse and check the fixed header (not yet the key or the payload; the store's payload limit
    /// is `check_limit`'s, once the header's checksum is believed).
    pub fn decode(b: &[u8; HEADER_LEN]) -> Result<(Header, u64)> {
        if b[0..4] != MAGIC {
            return Err(Error::BadMagic);
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != VERSION {
            return Err(Error::UnsupportedVersion(version, VERSION));
        }
        let flags = u16::from_le_bytes([b[6], b[7]]);
        if flags != 0 {
            return Err(Error::Unsupported(format!("chunk file flags {flags:#x}")));
        }
        let u32at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
        let u64at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        let h = Header {
            tag: u32at(8),
            key_len: u32at(12),
            payload_len: u64at(16),
            seq: u64at(24),
            key_hash: u128::from_le_bytes(b[32..48].try_into().unwrap()),
            payload_xxh3: u64at(48),
        };
        if h.key_len == 0 || h.key_len as usize > MAX_KEY_LEN {
            return Err(Error::Corrupt(format!("chunk file key length {}", h.key_len)));
        }
        Ok((h, u64at(56)))
    }
}

fn header_sum(first56: &[u8], key: &[u8]) -> u64 {
    let mut buf = Vec::with_capacity(56 + key.len());
    buf.extend_from_slice(first56);
    buf.extend_from_slice(key);
    xxh3_64(&buf)
}

/// A chunk read back from a file, every checksum checked.
#[derive(Debug)]
pub struct FileChunk {
    pub header: Header,
    pub key: Vec<u8>,
    pub payload: Vec<u8>,
}

fn fsync_dir(dir: &Path) -> Result<()> {
    File::open(dir)?.sync_all()?;
    Ok(())
}

/// Write a chunk file atomically: a new temporary file beside it (a unique name, created
/// exclusively: concurrent writes of one name never share it; its subfolder made again if it is
/// gone), write, fsync (when `durable`), rename (`publish`: a directory in the way is moved
/// aside), fsync the folder (when `durable`). On any error (or a panic) the temporary file is
/// removed and no file appears.
pub fn write_chunk(final_path: &Path, header: &Header, key: &[u8], payload: &[u8], durable: bool) -> Result<()> {
    let create = weightszip_core::codec::create_temporary;
    let (tmp, mut f) = match create(final_path) {
        // its subfolder removed, or something else put in its place, while the store is open: made
        // again as open makes it (not the store's folder: gone, its create_dir fails, as the write)
        Err(Error::Io(e)) if matches!(e.kind(), ErrorKind::NotFound | ErrorKind::NotADirectory) => {
            let Some(sub) = final_path.parent() else { return Err(e.into()) };
            ensure_subfolder(sub)?;
            create(final_path)?
        }
        r => r?,
    };
    let mut guard = RemoveOnDrop(Some(&tmp));
    f.write_all(&header.encode(key))?;
    f.write_all(payload)?;
    if durable {
        f.sync_all()?;
    }
    drop(f);
    publish(&tmp, final_path)?;
    guard.0 = None;
    if durable {
        if let Some(dir) = final_path.parent() {
            fsync_dir(dir)?;
        }
    }
    Ok(())
}

/// Directories a write moves out of its file's way before it gives up (more means something keeps
/// making them there while the write runs).
const MAX_MOVED_ASIDE: usize = 4;

/// Rename the finished temporary `tmp` to `final_path`. The rename replaces whatever entry has that
/// name (a file, a FIFO, a symbolic link: the name, never what it points to) but a directory; a
/// directory there (made while the store is open: open removes those) is moved aside and the rename
/// tried again, a bounded number of times. Nothing is followed, entered or deleted here.
fn publish(tmp: &Path, final_path: &Path) -> Result<()> {
    let mut moved = 0;
    loop {
        match fs::rename(tmp, final_path) {
            Ok(()) => return Ok(()),
            // (symlink_metadata: a symbolic link to a directory is not a directory here; the
            // rename replaces it)
            Err(_) if moved < MAX_MOVED_ASIDE && fs::symlink_metadata(final_path).is_ok_and(|m| m.is_dir()) => {
                move_aside(final_path)?;
                moved += 1;
            }
            Err(e) => return Err(e.into()),
        }
    }
}

/// Move the directory at a chunk file's name `path` out of the way, in one rename (not followed,
/// not entered, whatever it holds): to the same key's name in the same subfolder with a random
/// sequence number of 2^63 or more. No store gives such numbers; open removes an entry named so as
/// damage (with what it holds) and counts it. A directory gone meanwhile is fine.
fn move_aside(path: &Path) -> Result<()> {
    let Some((h, _)) = path.file_name().and_then(|n| n.to_str()).and_then(parse_name) else {
        return Err(Error::InvalidArgument(format!("{} is not a chunk file's name", path.display())));
    };
    let mut attempt = 0;
    loop {
        let aside = path.with_file_name(
            rel_path(h, MAX_SEQ | (weightszip_core::codec::random_u64(0) & (MAX_SEQ - 1))).file_name().expect("a name"),
        );
        match fs::rename(path, &aside) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
            // (a non-empty directory or a file at that name: another one)
            Err(_) if attempt < 8 => attempt += 1,
            Err(e) => return Err(e.into()),
        }
    }
}

/// Removes the temporary file when dropped, unless disarmed: on an error, and on a panic too.
struct RemoveOnDrop<'a>(Option<&'a Path>);

impl Drop for RemoveOnDrop<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.0 {
            let _ = fs::remove_file(p);
        }
    }
}

/// A subfolder `HH` of the store: a directory (or a link to one) is kept; anything else in its
/// place (a file, a dangling or looping link: never a directory, so nothing is recursed into) is
/// removed and the folder created. Open makes all 256 so; a write makes its own again when it
/// finds it gone.
pub fn ensure_subfolder(sub: &Path) -> Result<()> {
    match fs::symlink_metadata(sub) {
        Ok(m) if m.is_dir() => return Ok(()),
        Ok(m) if m.file_type().is_symlink() && fs::metadata(sub).is_ok_and(|t| t.is_dir()) => return Ok(()),
        Ok(_) => remove_entry(sub)?,
        Err(e) if e.kind() == ErrorKind::NotFound => {}
        Err(e) => return Err(e.into()),
    }
    match fs::create_dir(sub) {
        Err(e) if e.kind() != ErrorKind::AlreadyExists => Err(e.into()),
        _ => Ok(()),
    }
}

/// Read the header and key of a chunk file and check them (the header checksum covers both);
/// the payload is not read. Used when a store is opened.
pub fn read_header(path: &Path, max_payload: u64) -> Result<(Header, Vec<u8>)> {
    let mut f = open_regular(path)?;
    let file_len = f.metadata()?.len();
    let (h, key) = read_header_from(&mut f, file_len, max_payload)?;
    Ok((h, key))
}

fn read_header_from(f: &mut File, file_len: u64, max_payload: u64) -> Result<(Header, Vec<u8>)> {
    if file_len < HEADER_LEN as u64 {
        return Err(Error::Truncated(format!("chunk file of {file_len} bytes")));
    }
    let mut hb = [0u8; HEADER_LEN];
    f.read_exact(&mut hb)?;
    let (h, sum) = Header::decode(&hb)?;
    check_length(&h, file_len, "chunk file")?;
    let mut key = vec![0u8; h.key_len as usize];
    f.read_exact(&mut key)?;
    if header_sum(&hb[..56], &key) != sum {
        return Err(Error::ChecksumMismatch("chunk file header".into()));
    }
    if key_hash(&key) != h.key_hash {
        return Err(Error::ChecksumMismatch("chunk file key hash".into()));
    }
    check_limit(&h, max_payload)?;
    Ok((h, key))
}

/// The header's sizes against the bytes there are: a header declaring more is Truncated, less
/// Corrupt (damage: a store evicts it), whatever its payload length (no sum overflows).
fn check_length(h: &Header, len: u64, what: &str) -> Result<()> {
    let declared = (HEADER_LEN as u64 + h.key_len as u64).checked_add(h.payload_len);
    match declared {
        Some(d) if d == len => Ok(()),
        Some(d) if d < len => Err(Error::Corrupt(format!("{what} has {len} bytes, its header declares {d}"))),
        _ => Err(Error::Truncated(format!(
            "{what} has {len} bytes, its header declares {} payload bytes",
            h.payload_len
        ))),
    }
}

/// A verified header whose payload is above this store's `max_chunk_bytes`: valid data this store
/// does not read (LimitExceeded, which a store does not treat as damage), checked before the
/// payload is allocated.
fn check_limit(h: &Header, max_payload: u64) -> Result<()> {
    if h.payload_len > max_payload {
        return Err(Error::LimitExceeded(format!(
            "chunk declares {} payload bytes, the store's limit is {max_payload}",
            h.payload_len
        )));
    }
    Ok(())
}

/// Open a chunk file for reading, if it is a regular file (a FIFO or a device named like a chunk
/// would block the open or the read forever; a symbolic link is not followed): anything else is
/// Corrupt.
fn open_regular(path: &Path) -> Result<File> {
    if !fs::symlink_metadata(path)?.file_type().is_file() {
        return Err(Error::Corrupt(format!("{} is not a regular file", path.display())));
    }
    Ok(File::open(path)?)
}

/// Remove whatever sits at `path` (a directory entry named like a chunk file in one of a store's
/// subfolders): a directory with everything in it, anything else (a file, a symbolic link, not
/// what it points to; a FIFO) as a name. A missing entry is not an error.
pub fn remove_entry(path: &Path) -> std::io::Result<()> {
    let r = match fs::symlink_metadata(path) {
        Ok(m) if m.file_type().is_dir() => remove_tree(path),
        Ok(_) => fs::remove_file(path),
        Err(e) => Err(e),
    };
    not_found_is_ok(r)
}

fn not_found_is_ok(r: std::io::Result<()>) -> std::io::Result<()> {
    match r {
        Err(e) if e.kind() == ErrorKind::NotFound => Ok(()),
        r => r,
    }
}

/// Remove a directory and everything in it with a work list, not recursion: std's
/// `remove_dir_all` recurses once per level, so a crafted tree some thousands of levels deep
/// overflowed the stack of the thread removing it (an I/O pool thread at open: the process
/// aborted). Links are removed as names, never followed. A directory is removed once the ones
/// below it are; the depth reached is bounded by the path length the OS accepts (past it, an
/// error, ENAMETOOLONG).
fn remove_tree(root: &Path) -> std::io::Result<()> {
    let mut todo = vec![root.to_path_buf()];
    while let Some(dir) = todo.last() {
        let entries = match fs::read_dir(dir) {
            Err(e) if e.kind() == ErrorKind::NotFound => {
                todo.pop(); // (gone meanwhile)
                continue;
            }
            r => r?,
        };
        let mut below = Vec::new();
        for e in entries {
            let e = e?;
            if e.file_type()?.is_dir() {
                below.push(e.path());
            } else {
                not_found_is_ok(fs::remove_file(e.path()))?;
            }
        }
        if below.is_empty() {
            not_found_is_ok(fs::remove_dir(dir))?;
            todo.pop();
        } else {
            todo.extend(below);
        }
    }
    Ok(())
}

/// Read a whole chunk file and verify it: sizes against the file's length (before anything is
/// allocated), the header checksum, the key hash, the payload checksum. A missing file is
/// `Ok(None)`.
pub fn read_chunk(path: &Path, max_payload: u64) -> Result<Option<FileChunk>> {
    let mut f = match open_regular(path) {
        Ok(f) => f,
        Err(Error::Io(e)) if e.kind() == ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(e),
    };
    let file_len = f.metadata()?.len();
    let (header, key) = read_header_from(&mut f, file_len, max_payload)?;
    let mut payload = vec![0u8; header.payload_len as usize];
    f.read_exact(&mut payload).map_err(|e| {
        if e.kind() == ErrorKind::UnexpectedEof {
            Error::Truncated("chunk file payload".into())
        } else {
            e.into()
        }
    })?;
    if xxh3_64(&payload) != header.payload_xxh3 {
        return Err(Error::ChecksumMismatch("chunk file payload".into()));
    }
    Ok(Some(FileChunk { header, key, payload }))
}

/// A whole chunk (header, key, payload) in one buffer: what the remote tier stores as a value.
pub fn encode_chunk(header: &Header, key: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut out = header.encode(key);
    out.extend_from_slice(payload);
    out
}

/// Parse and verify a buffer made by `encode_chunk`, with the checks `read_chunk` makes.
pub fn parse_chunk(buf: &[u8], max_payload: u64) -> Result<FileChunk> {
    let Some(hb) = buf.first_chunk::<HEADER_LEN>() else {
        return Err(Error::Truncated(format!("chunk of {} bytes", buf.len())));
    };
    let (header, sum) = Header::decode(hb)?;
    check_length(&header, buf.len() as u64, "chunk")?;
    let key = &buf[HEADER_LEN..HEADER_LEN + header.key_len as usize];
    if header_sum(&buf[..56], key) != sum {
        return Err(Error::ChecksumMismatch("chunk header".into()));
    }
    if key_hash(key) != header.key_hash {
        return Err(Error::ChecksumMismatch("chunk key hash".into()));
    }
    check_limit(&header, max_payload)?;
    let payload = &buf[HEADER_LEN + key.len()..];
    if xxh3_64(payload) != header.payload_xxh3 {
        return Err(Error::ChecksumMismatch("chunk payload".into()));
    }
    Ok(FileChunk { header, key: key.to_vec(), payload: payload.to_vec() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_stay_inside() {
        let h = key_hash(b"../../etc/passwd");
        let p = rel_path(h, 7);
        assert_eq!(p.components().count(), 2);
        let name = p.file_name().unwrap().to_str().unwrap();
        assert_eq!(parse_name(name), Some((h, 7)));
        assert!(name.chars().all(|c| c.is_ascii_hexdigit() || c == '-' || c == '.' || c == 'w' || c == 'z'));
        assert_eq!(parse_name("0123.wzc"), None);
        assert_eq!(parse_name(&format!("{h:032x}-zz.wzc")), None);
    }

    #[test]
    fn temporary_names() {
        let dir = tempfile::tempdir().unwrap();
        let fin = dir.path().join(rel_path(key_hash(b"k"), 3));
        fs::create_dir_all(fin.parent().unwrap()).unwrap();
        let (a, _fa) = weightszip_core::codec::create_temporary(&fin).unwrap();
        let (b, _fb) = weightszip_core::codec::create_temporary(&fin).unwrap();
        assert_ne!(a, b);
        for t in [&a, &b] {
            let name = t.file_name().unwrap().to_str().unwrap();
            assert_eq!(temporary_pid(name), Some(std::process::id()), "{name}");
            assert_eq!(parse_name(name), None);
        }
        let chunk = fin.file_name().unwrap().to_str().unwrap();
        assert_eq!(temporary_pid(&format!(".{chunk}.42.0.0123abcd.wz-partial")), Some(42));
        for n in [
            format!("{chunk}.42.0.0123abcd.wz-partial"),
            format!(".{chunk}.42.0123abcd.wz-partial"),
            format!(".{chunk}.x.0.0123abcd.wz-partial"),
            format!(".{chunk}.42.0.0123abcd.wz-partial~"),
            ".0123.wzc.42.0.0123abcd.wz-partial".to_string(),
            chunk.to_string(),
            format!("{chunk}.tmp"),
        ] {
            assert_eq!(temporary_pid(&n), None, "{n}");
        }
    }

    /// Writers of one file name at once (a store folder shared despite its lock, or any caller of
    /// `write_chunk`): each has its own temporary, so every file that appears is some writer's
    /// whole file. (With one shared `NAME.tmp`, one writer truncated and renamed the other's
    /// half-written file.)
    #[test]
    fn concurrent_writes_of_one_name_publish_whole_files() {
        let dir = tempfile::tempdir().unwrap();
        let key = b"same key".as_slice();
        let fin = dir.path().join(rel_path(key_hash(key), 1));
        fs::create_dir_all(fin.parent().unwrap()).unwrap();
        std::thread::scope(|sc| {
            for t in 0..4u8 {
                let fin = &fin;
                sc.spawn(move || {
                    for i in 0..100u32 {
                        let payload = vec![t ^ i as u8; 64 * 1024 + 7 * i as usize];
                        let h = Header {
                            tag: 0,
                            key_len: key.len() as u32,
                            payload_len: payload.len() as u64,
                            seq: 1,
                            key_hash: key_hash(key),
                            payload_xxh3: xxh3_64(&payload),
                        };
                        write_chunk(fin, &h, key, &payload, false).unwrap();
                        read_chunk(fin, u64::MAX).unwrap().expect("a whole file");
                    }
                });
            }
        });
        let left: Vec<_> = fs::read_dir(fin.parent().unwrap()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert_eq!(left.len(), 1, "no temporary left: {left:?}");
    }

    /// A directory at a chunk file's name (made while a store is open) is moved aside, whole and
    /// not entered, and the file written; a link there is replaced, never followed. (The rename
    /// failed with "Is a directory": a write-back chunk was lost.)
    #[cfg(unix)]
    #[test]
    fn a_directory_in_a_files_place_is_moved_aside() {
        let dir = tempfile::tempdir().unwrap();
        let outside = tempfile::tempdir().unwrap();
        fs::write(outside.path().join("kept"), b"outside").unwrap();
        let key = b"k".as_slice();
        let payload = b"payload".as_slice();
        let h = Header {
            tag: 0,
            key_len: 1,
            payload_len: payload.len() as u64,
            seq: 5,
            key_hash: key_hash(key),
            payload_xxh3: xxh3_64(payload),
        };
        let fin = dir.path().join(rel_path(h.key_hash, 5));
        let sub = fin.parent().unwrap();
        fs::create_dir_all(fin.join("inner")).unwrap();
        std::os::unix::fs::symlink(outside.path().join("kept"), fin.join("inner/link")).unwrap();
        std::os::unix::fs::symlink(outside.path(), fin.join("dirlink")).unwrap();
        write_chunk(&fin, &h, key, payload, true).unwrap();
        assert_eq!(read_chunk(&fin, u64::MAX).unwrap().unwrap().payload, payload);
        let aside: Vec<_> = fs::read_dir(sub).unwrap().map(|e| e.unwrap().path()).filter(|p| p != &fin).collect();
        assert_eq!(aside.len(), 1, "{aside:?}");
        let (ah, aseq) = parse_name(aside[0].file_name().unwrap().to_str().unwrap()).unwrap();
        assert!(ah == h.key_hash && aseq >= MAX_SEQ, "{aside:?}");
        assert!(aside[0].join("inner/link").is_symlink() && aside[0].join("dirlink").is_symlink());
        assert_eq!(fs::read(outside.path().join("kept")).unwrap(), b"outside");
        // a symbolic link to a directory in the file's place: the link is replaced
        let h6 = Header { seq: 6, ..h };
        let fin6 = dir.path().join(rel_path(h.key_hash, 6));
        std::os::unix::fs::symlink(outside.path(), &fin6).unwrap();
        write_chunk(&fin6, &h6, key, payload, false).unwrap();
        assert!(fs::symlink_metadata(&fin6).unwrap().is_file());
        assert_eq!(fs::read_dir(outside.path()).unwrap().count(), 1);
    }

    #[test]
    fn header_round_trip_and_rejections() {
        let key = b"k1";
        let h = Header { tag: 3, key_len: 2, payload_len: 10, seq: 9, key_hash: key_hash(key), payload_xxh3: 5 };
        let enc = h.encode(key);
        let hb: [u8; 64] = enc[..64].try_into().unwrap();
        let (d, _) = Header::decode(&hb).unwrap();
        assert_eq!(d, h);
        assert!(matches!(check_limit(&d, 9), Err(Error::LimitExceeded(_))));
        let mut bad = hb;
        bad[0] ^= 1;
        assert!(matches!(Header::decode(&bad), Err(Error::BadMagic)));
        let mut bad = hb;
        bad[4] = 2;
        assert!(matches!(Header::decode(&bad), Err(Error::UnsupportedVersion(2, 1))));
        let mut bad = hb;
        bad[6] = 1;
        assert!(matches!(Header::decode(&bad), Err(Error::Unsupported(_))));
    }
}
