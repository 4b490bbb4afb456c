//! A store wrapper for tests: every request goes to the inner store after a
//! hook has seen it, and the hook may fail it or swallow a `set`. The
//! fault tests cut ranks off and mute their heartbeats with it; the scale
//! tests count requests with it.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use chorus::transport::{CompareSet, Store, TransportError};

/// Which request the hook sees.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Req {
    Set,
    Get,
    Wait,
    Add,
    CompareSet,
    Delete,
    DeletePrefix,
}

/// What the hook decides: `Ok(true)` forwards the request, `Ok(false)`
/// drops a `set` (it succeeds without reaching the store; other requests
/// are forwarded), `Err` fails it.
pub type Hook = dyn Fn(Req, &str) -> Result<bool, TransportError> + Send + Sync;

/// `inner`, behind `hook` (see [`Hook`]). For `wait` the hook sees the
/// first key.
pub struct Hooked {
    pub inner: Arc<dyn Store>,
    pub hook: Box<Hook>,
}

#[async_trait]
impl Store for Hooked {
    async fn set(&self, key: &str, value: Vec<u8>) -> Result<(), TransportError> {
        if !(self.hook)(Req::Set, key)? {
            return Ok(());
        }
        self.inner.set(key, value).await
    }
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, TransportError> {
        (self.hook)(Req::Get, key)?;
        self.inner.get(key).await
    }
    async fn wait(
        &self,
        keys: &[String],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        (self.hook)(Req::Wait, keys.first().map_or("", String::as_str))?;
        self.inner.wait(keys, timeout).await
    }
    async fn add(&self, key: &str, delta: i64) -> Result<i64, TransportError> {
        (self.hook)(Req::Add, key)?;
        self.inner.add(key, delta).await
    }
    async fn compare_set(
        &self,
        key: &str,
        expected: Option<Vec<u8>>,
        desired: Vec<u8>,
    ) -> Result<CompareSet, TransportError> {
        (self.hook)(Req::CompareSet, key)?;
        self.inner.compare_set(key, expected, desired).await
    }
    async fn delete(&self, key: &str) -> Result<bool, TransportError> {
        (self.hook)(Req::Delete, key)?;
        self.inner.delete(key).await
    }
    async fn delete_prefix(&self, prefix: &str) -> Result<u64, TransportError> {
        (self.hook)(Req::DeletePrefix, prefix)?;
        self.inner.delete_prefix(prefix).await
    }
}
