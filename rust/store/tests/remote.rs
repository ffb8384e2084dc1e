//! The remote tier against a real Redis: a private redis-server on a free port of 127.0.0.1
//! (Debian's package; `.ci/run` installs it). Without the binary these tests pass trivially
//! unless WEIGHTSZIP_REQUIRE_REDIS=1, which CI sets: then they fail.

use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use weightszip_store::{ChunkStore, Error, StoreConfig};

struct Server {
    child: Child,
    url: String,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn server() -> Option<Server> {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let child = Command::new("redis-server")
        .args(["--port", &port.to_string(), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"])
        .stdout(Stdio::null())
        .spawn();
    let child = match child {
        Ok(c) => c,
        Err(e) => {
            assert!(
                std::env::var("WEIGHTSZIP_REQUIRE_REDIS").as_deref() != Ok("1"),
                "WEIGHTSZIP_REQUIRE_REDIS=1 but redis-server cannot start: {e}"
            );
            eprintln!("redis-server not found: remote tier tests not run");
            return None;
        }
    };
    let url = format!("redis://127.0.0.1:{port}/");
    let client = redis::Client::open(url.as_str()).unwrap();
    let start = Instant::now();
    loop {
        if let Ok(mut c) = client.get_connection() {
            if redis::cmd("PING").query::<String>(&mut c).is_ok() {
                break;
            }
        }
        assert!(start.elapsed() < Duration::from_secs(20), "redis-server did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    Some(Server { child, url })
}

fn store(url: &str, prefix: &str) -> ChunkStore {
    ChunkStore::open(StoreConfig {
        ram_bytes: 1 << 20,
        redis_url: Some(url.to_string()),
        redis_prefix: prefix.to_string(),
        ..StoreConfig::default()
    })
    .unwrap()
}

#[test]
fn chunks_put_by_one_store_are_read_by_another() {
    let Some(srv) = server() else { return };
    let a = store(&srv.url, "t1:");
    let b = store(&srv.url, "t1:");
    let other_namespace = store(&srv.url, "t2:");
    let payload: Vec<u8> = (0..100_000u32).map(|i| (i * 7 % 251) as u8).collect();
    a.put(b"chunk-1", payload.clone(), 5).unwrap();
    assert!(b.contains(b"chunk-1").unwrap());
    assert!(!other_namespace.contains(b"chunk-1").unwrap());
    let c = b.get(b"chunk-1").unwrap().unwrap();
    assert_eq!((c.tag, &*c.data), (5, &payload));
    assert_eq!(b.stats().unwrap().hits_remote, 1);
    // Promoted into b's RAM tier: the second read is local.
    b.get(b"chunk-1").unwrap().unwrap();
    assert_eq!(b.stats().unwrap().hits_ram, 1);
    assert!(b.get(b"nope").unwrap().is_none());
    // A delete reaches the remote tier.
    assert!(a.delete(b"chunk-1").unwrap());
    assert!(!a.contains(b"chunk-1").unwrap());
    assert!(store(&srv.url, "t1:").get(b"chunk-1").unwrap().is_none());
}

#[test]
fn a_damaged_remote_value_is_reported_and_removed() {
    let Some(srv) = server() else { return };
    let a = store(&srv.url, "d:");
    a.put(b"k", vec![3u8; 5000], 0).unwrap();
    let mut conn = redis::Client::open(srv.url.as_str()).unwrap().get_connection().unwrap();
    let name: String = redis::cmd("KEYS").arg("d:*").query::<Vec<String>>(&mut conn).unwrap().pop().unwrap();
    let mut v: Vec<u8> = redis::cmd("GET").arg(&name).query(&mut conn).unwrap();
    let n = v.len();
    v[n - 10] ^= 0x40;
    redis::cmd("SET").arg(&name).arg(&v).query::<()>(&mut conn).unwrap();
    let b = store(&srv.url, "d:");
    assert!(matches!(b.get(b"k"), Err(Error::ChecksumMismatch(_))));
    assert!(b.get(b"k").unwrap().is_none());
    assert_eq!(redis::cmd("EXISTS").arg(&name).query::<i64>(&mut conn).unwrap(), 0);
    // A value cut short is an error too, never a panic or an allocation of what it claims.
    redis::cmd("SET").arg(&name).arg(&v[..40]).query::<()>(&mut conn).unwrap();
    assert!(matches!(b.get(b"k"), Err(Error::Truncated(_))));
}

#[test]
fn an_unreachable_or_malformed_server_is_a_typed_error() {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let cfg = |url: String| StoreConfig { redis_url: Some(url), redis_timeout_ms: 500, ..StoreConfig::default() };
    assert!(matches!(ChunkStore::open(cfg(format!("redis://127.0.0.1:{port}/"))), Err(Error::Io(_))));
    assert!(matches!(ChunkStore::open(cfg("http://nope".into())), Err(Error::InvalidArgument(_))));
}

/// A delete or put that Redis refuses (here by an ACL; a timeout or a server gone alike) is the
/// call's error, and the copy Redis kept (the deleted chunk, the older version) is never read back
/// by this store: a delete returned true while Redis kept the chunk, and the next local miss
/// brought the deleted chunk back (found by a review, with a paused server).
#[test]
fn a_delete_or_put_refused_by_redis_is_an_error_and_the_old_copy_never_comes_back() {
    let Some(srv) = server() else { return };
    let mut conn = redis::Client::open(srv.url.as_str()).unwrap().get_connection().unwrap();
    let mut acl =
        |rule: &str| redis::cmd("ACL").arg("SETUSER").arg("default").arg(rule).query::<()>(&mut conn).unwrap();
    let s = store(&srv.url, "f:");
    let other = store(&srv.url, "f:");
    s.put(b"d", b"deleted".to_vec(), 0).unwrap();
    acl("-del");
    assert!(matches!(s.delete(b"d"), Err(Error::Io(_))));
    acl("+del");
    assert!(!s.contains(b"d").unwrap());
    assert_eq!(&**other.get(b"d").unwrap().unwrap().data, b"deleted", "Redis kept it");
    assert!(s.get(b"d").unwrap().is_none(), "the deleted chunk came back");
    assert!(s.delete(b"d").unwrap(), "a retried delete reaches Redis");
    assert!(store(&srv.url, "f:").get(b"d").unwrap().is_none());

    s.put(b"p", b"v1".to_vec(), 0).unwrap();
    acl("-set");
    assert!(matches!(s.put(b"p", b"v2".to_vec(), 0), Err(Error::Io(_))));
    acl("+set");
    assert_eq!(&**s.get(b"p").unwrap().unwrap().data, b"v2", "the local tiers keep it");
    s.evict_from_ram(b"p").unwrap(); // RAM only: dropped
    assert!(s.get(b"p").unwrap().is_none(), "the older version came back from Redis");
    // A put that reaches Redis makes it the key's copy again.
    s.put(b"p", b"v3".to_vec(), 0).unwrap();
    s.evict_from_ram(b"p").unwrap();
    assert_eq!(&**s.get(b"p").unwrap().unwrap().data, b"v3");
}
