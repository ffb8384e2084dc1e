//! The remote tier: chunks as values on a Redis server (`SET`, `GET`, `DEL`, `EXISTS`). A value
//! holds the same bytes as a chunk file (header, key, payload), so a remote read is verified
//! exactly like a disk read. Redis keys are `prefix` + the key's XXH3-128 in hex.

use std::sync::Mutex;
use std::time::Duration;

use redis::{Client, Connection, RedisError, RedisResult};
use weightszip_core::{Error, Result};

pub struct RedisTier {
    client: Client,
    prefix: String,
    timeout: Duration,
    /// Connections not in use; a connection whose command failed is dropped, not returned here.
    idle: Mutex<Vec<Connection>>,
}

fn io_err(e: RedisError) -> Error {
    Error::Io(std::io::Error::other(format!("redis: {e}")))
}

impl RedisTier {
    /// Connect and PING, so that a wrong address fails here and not at the first put.
    pub fn connect(url: &str, prefix: &str, timeout: Duration) -> Result<RedisTier> {
        let client = Client::open(url).map_err(|e| Error::InvalidArgument(format!("redis URL {url:?}: {e}")))?;
        let tier = RedisTier { client, prefix: prefix.to_string(), timeout, idle: Mutex::new(Vec::new()) };
        tier.with_conn(|c| redis::cmd("PING").query::<String>(c))?;
        Ok(tier)
    }

    fn with_conn<T>(&self, f: impl FnOnce(&mut Connection) -> RedisResult<T>) -> Result<T> {
        let idle = self.idle.lock().unwrap_or_else(|p| p.into_inner()).pop();
        let mut conn = match idle {
            Some(c) => c,
            None => {
                let c = self.client.get_connection_with_timeout(self.timeout).map_err(io_err)?;
                c.set_read_timeout(Some(self.timeout)).map_err(io_err)?;
                c.set_write_timeout(Some(self.timeout)).map_err(io_err)?;
                c
            }
        };
        let r = f(&mut conn).map_err(io_err)?;
        self.idle.lock().unwrap_or_else(|p| p.into_inner()).push(conn);
        Ok(r)
    }

    fn name(&self, hash: u128) -> String {
        format!("{}{hash:032x}", self.prefix)
    }

    pub fn put(&self, hash: u128, value: &[u8]) -> Result<()> {
        self.with_conn(|c| redis::cmd("SET").arg(self.name(hash)).arg(value).query::<()>(c))
    }

    pub fn get(&self, hash: u128) -> Result<Option<Vec<u8>>> {
        self.with_conn(|c| redis::cmd("GET").arg(self.name(hash)).query::<Option<Vec<u8>>>(c))
    }

    pub fn delete(&self, hash: u128) -> Result<bool> {
        self.with_conn(|c| redis::cmd("DEL").arg(self.name(hash)).query::<i64>(c)).map(|n| n > 0)
    }

    pub fn exists(&self, hash: u128) -> Result<bool> {
        self.with_conn(|c| redis::cmd("EXISTS").arg(self.name(hash)).query::<i64>(c)).map(|n| n > 0)
    }
}
