//! An in-process [`Store`]: the state behind the QUIC rendezvous server, also
//! usable directly by ranks that live in one process (and by single-rank
//! communicators, which need no network at all).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use async_trait::async_trait;
use tokio::sync::Notify;

use super::{CompareSet, Store, TransportError};

/// A key-value store in memory, safe to share between tasks.
///
/// ```
/// # tokio::runtime::Runtime::new().unwrap().block_on(async {
/// use chorus::transport::{MemoryStore, Store};
/// let store = MemoryStore::new();
/// store.set("a", b"1".to_vec()).await.unwrap();
/// assert_eq!(store.get("a").await.unwrap(), Some(b"1".to_vec()));
/// assert_eq!(store.add("n", 5).await.unwrap(), 5);
/// # });
/// ```
#[derive(Debug, Default)]
pub struct MemoryStore {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Notify,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // A panic while holding this lock cannot leave the map half-updated
        // (every critical section is a single map operation), so poisoning is ignored.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Number of keys (for tests and metrics).
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether the store holds no keys.
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn set(&self, key: &str, value: Vec<u8>) -> Result<(), TransportError> {
        self.lock().insert(key.to_string(), value);
        self.changed.notify_waiters();
        Ok(())
    }

    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, TransportError> {
        Ok(self.lock().get(key).cloned())
    }

    async fn wait(
        &self,
        keys: &[String],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            // Register for a wake-up before looking, so a set() between the
            // look and the await is not missed.
            let notified = self.changed.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            {
                let map = self.lock();
                let missing: Vec<String> = keys
                    .iter()
                    .filter(|k| !map.contains_key(k.as_str()))
                    .cloned()
                    .collect();
                if missing.is_empty() {
                    return Ok(keys.iter().map(|k| map[k.as_str()].clone()).collect());
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(TransportError::WaitTimeout {
                        keys: missing,
                        after: timeout,
                    });
                }
            }
            let _ = tokio::time::timeout_at(deadline, notified).await;
        }
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64, TransportError> {
        let new = {
            let mut map = self.lock();
            let cur = match map.get(key) {
                None => 0,
                Some(v) => std::str::from_utf8(v)
                    .ok()
                    .and_then(|s| s.parse::<i64>().ok())
                    .ok_or_else(|| {
                        TransportError::Store(format!(
                            "add on key {key:?}: value is not an integer"
                        ))
                    })?,
            };
            let new = cur
                .checked_add(delta)
                .ok_or_else(|| TransportError::Store(format!("add on key {key:?}: overflow")))?;
            map.insert(key.to_string(), new.to_string().into_bytes());
            new
        };
        self.changed.notify_waiters();
        Ok(new)
    }

    async fn compare_set(
        &self,
        key: &str,
        expected: Option<Vec<u8>>,
        desired: Vec<u8>,
    ) -> Result<CompareSet, TransportError> {
        let result = {
            let mut map = self.lock();
            let cur = map.get(key).cloned();
            if cur == expected {
                map.insert(key.to_string(), desired);
                CompareSet::Swapped
            } else {
                CompareSet::Current(cur)
            }
        };
        if result == CompareSet::Swapped {
            self.changed.notify_waiters();
        }
        Ok(result)
    }

    async fn delete(&self, key: &str) -> Result<bool, TransportError> {
        Ok(self.lock().remove(key).is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[tokio::test]
    async fn wait_returns_once_every_key_is_set() {
        let store = Arc::new(MemoryStore::new());
        let s2 = store.clone();
        let waiter = tokio::spawn(async move {
            s2.wait(&["a".into(), "b".into()], Duration::from_secs(10))
                .await
        });
        store.set("a", b"1".to_vec()).await.unwrap();
        store.set("b", b"2".to_vec()).await.unwrap();
        assert_eq!(
            waiter.await.unwrap().unwrap(),
            vec![b"1".to_vec(), b"2".to_vec()]
        );
    }

    #[tokio::test]
    async fn wait_times_out_naming_missing_keys() {
        let store = MemoryStore::new();
        store.set("a", vec![]).await.unwrap();
        let err = store
            .wait(&["a".into(), "zz".into()], Duration::from_millis(20))
            .await
            .unwrap_err();
        match err {
            TransportError::WaitTimeout { keys, .. } => assert_eq!(keys, vec!["zz".to_string()]),
            other => panic!("unexpected {other:?}"),
        }
    }

    #[tokio::test]
    async fn compare_set_and_add_and_delete() {
        let store = MemoryStore::new();
        assert_eq!(
            store.compare_set("k", None, b"x".to_vec()).await.unwrap(),
            CompareSet::Swapped
        );
        assert_eq!(
            store.compare_set("k", None, b"y".to_vec()).await.unwrap(),
            CompareSet::Current(Some(b"x".to_vec()))
        );
        assert_eq!(store.add("c", 2).await.unwrap(), 2);
        assert_eq!(store.add("c", -5).await.unwrap(), -3);
        assert!(store.add("k", 1).await.is_err());
        assert!(store.delete("k").await.unwrap());
        assert!(!store.delete("k").await.unwrap());
    }
}
