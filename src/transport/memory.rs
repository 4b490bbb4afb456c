//! An in-process [`Store`]: the state behind the QUIC rendezvous server, also
//! usable directly by ranks that live in one process (and by single-rank
//! communicators, which need no network at all).
//!
//! The values sit in a sharded map (`dashmap`), so requests on different
//! keys, which is what the ranks of a job mostly send, do not wait for each
//! other; every operation on one key, `compare_set` and `add` included, is
//! one critical section on that key's shard. A `wait` on several keys reads
//! them one at a time and returns once it has seen every one present. A
//! waiter registers on the key it still misses, in a per-key table of wake-ups (`dashmap`), so a
//! write wakes only the waiters of its own key, not every waiter of the
//! job: a bootstrap of n ranks waiting on n keys each costs O(n) wake-ups
//! per write less than a store-wide notification.

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use dashmap::mapref::entry::Entry;
use dashmap::DashMap;
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
    map: DashMap<String, Vec<u8>>,
    /// Wake-ups of the tasks waiting for a key, by key; an entry lives
    /// while someone waits on it.
    waiters: DashMap<String, Arc<Notify>>,
}

impl MemoryStore {
    /// An empty store.
    pub fn new() -> MemoryStore {
        MemoryStore::default()
    }

    /// Number of keys (for tests and metrics).
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// Every key, sorted (for tests and for operators inspecting a store).
    pub fn keys(&self) -> Vec<String> {
        let mut k: Vec<String> = self.map.iter().map(|e| e.key().clone()).collect();
        k.sort();
        k
    }

    /// Whether the store holds no keys.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The values of `keys`, or the first key found missing.
    fn read_all(&self, keys: &[String]) -> Result<Vec<Vec<u8>>, String> {
        keys.iter()
            .map(|k| {
                self.map
                    .get(k.as_str())
                    .map(|v| v.clone())
                    .ok_or_else(|| k.clone())
            })
            .collect()
    }

    /// Wake the tasks waiting for `key`.
    fn changed(&self, key: &str) {
        if let Some(n) = self.waiters.get(key) {
            n.notify_waiters();
        }
    }

    /// Number of keys someone waits on (for tests).
    #[cfg(test)]
    fn waited_keys(&self) -> usize {
        self.waiters.len()
    }
}

/// A registration on one key's wake-ups; the key's entry goes when its
/// last waiter does.
struct Waiting<'a> {
    store: &'a MemoryStore,
    key: String,
    notify: Arc<Notify>,
}

impl<'a> Waiting<'a> {
    fn new(store: &'a MemoryStore, key: &str) -> Waiting<'a> {
        let notify = store
            .waiters
            .entry(key.to_string())
            .or_insert_with(|| Arc::new(Notify::new()))
            .clone();
        Waiting {
            store,
            key: key.to_string(),
            notify,
        }
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        // Clones are made under the entry's shard lock, which remove_if
        // also holds: a count of 2 (the map's and ours) means no one else.
        self.store
            .waiters
            .remove_if(&self.key, |_, n| Arc::strong_count(n) <= 2);
    }
}

#[async_trait]
impl Store for MemoryStore {
    async fn set(&self, key: &str, value: Vec<u8>) -> Result<(), TransportError> {
        self.map.insert(key.to_string(), value);
        self.changed(key);
        Ok(())
    }

    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, TransportError> {
        Ok(self.map.get(key).map(|v| v.clone()))
    }

    async fn wait(
        &self,
        keys: &[String],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        let deadline = tokio::time::Instant::now() + timeout;
        // The key this task is registered on: the first one found missing.
        let mut waiting: Option<Waiting<'_>> = None;
        loop {
            let first_missing = match self.read_all(keys) {
                Ok(values) => return Ok(values),
                Err(k) => k,
            };
            if tokio::time::Instant::now() >= deadline {
                let missing: Vec<String> = keys
                    .iter()
                    .filter(|k| !self.map.contains_key(k.as_str()))
                    .cloned()
                    .collect();
                if missing.is_empty() {
                    continue;
                }
                return Err(TransportError::WaitTimeout {
                    keys: missing,
                    after: timeout,
                });
            }
            if waiting.as_ref().is_none_or(|w| w.key != first_missing) {
                waiting = Some(Waiting::new(self, &first_missing));
            }
            let Some(w) = waiting.as_ref() else {
                continue;
            };
            // Register for the wake-up, then look again, so a set() between
            // the first look and the await is not missed.
            let notified = w.notify.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if self.map.contains_key(first_missing.as_str()) {
                continue;
            }
            let _ = tokio::time::timeout_at(deadline, notified).await;
        }
    }

    async fn add(&self, key: &str, delta: i64) -> Result<i64, TransportError> {
        let new = {
            let entry = self.map.entry(key.to_string());
            let cur = match &entry {
                Entry::Vacant(_) => 0,
                Entry::Occupied(e) => std::str::from_utf8(e.get())
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
            entry.insert(new.to_string().into_bytes());
            new
        };
        self.changed(key);
        Ok(new)
    }

    async fn compare_set(
        &self,
        key: &str,
        expected: Option<Vec<u8>>,
        desired: Vec<u8>,
    ) -> Result<CompareSet, TransportError> {
        let result = match (self.map.entry(key.to_string()), expected) {
            (Entry::Occupied(mut e), Some(want)) if *e.get() == want => {
                e.insert(desired);
                CompareSet::Swapped
            }
            (Entry::Vacant(e), None) => {
                e.insert(desired);
                CompareSet::Swapped
            }
            (Entry::Occupied(e), _) => CompareSet::Current(Some(e.get().clone())),
            (Entry::Vacant(_), Some(_)) => CompareSet::Current(None),
        };
        if result == CompareSet::Swapped {
            self.changed(key);
        }
        Ok(result)
    }

    async fn delete(&self, key: &str) -> Result<bool, TransportError> {
        Ok(self.map.remove(key).is_some())
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<u64, TransportError> {
        super::check_prefix(prefix)?;
        let mut removed = 0u64;
        self.map.retain(|k, _| {
            let gone = k.starts_with(prefix);
            removed += u64::from(gone);
            !gone
        });
        Ok(removed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn delete_prefix_removes_a_subtree_only() {
        let store = MemoryStore::new();
        for k in [
            "j/a/epoch/3/x",
            "j/a/epoch/3/y/z",
            "j/a/epoch/30/x",
            "j/b/epoch/3/x",
        ] {
            store.set(k, vec![1]).await.unwrap();
        }
        assert_eq!(store.delete_prefix("j/a/epoch/3/").await.unwrap(), 2);
        assert_eq!(store.get("j/a/epoch/30/x").await.unwrap(), Some(vec![1]));
        assert_eq!(store.len(), 2);
        for bad in ["", "j/a/epoch/3"] {
            assert!(matches!(
                store.delete_prefix(bad).await,
                Err(TransportError::Store(_))
            ));
        }
        assert_eq!(store.len(), 2);
    }

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
    async fn a_write_wakes_only_its_keys_waiters_and_entries_go_with_them() {
        let store = Arc::new(MemoryStore::new());
        let (s1, s2) = (store.clone(), store.clone());
        let on_a =
            tokio::spawn(async move { s1.wait(&["a".into()], Duration::from_secs(10)).await });
        let on_b =
            tokio::spawn(async move { s2.wait(&["b".into()], Duration::from_secs(10)).await });
        // Both registered (each waiter's entry exists before it sleeps).
        while store.waited_keys() < 2 {
            tokio::task::yield_now().await;
        }
        store.set("a", b"1".to_vec()).await.unwrap();
        assert_eq!(on_a.await.unwrap().unwrap(), vec![b"1".to_vec()]);
        assert!(!on_b.is_finished());
        assert_eq!(store.waited_keys(), 1);
        store.set("b", b"2".to_vec()).await.unwrap();
        assert_eq!(on_b.await.unwrap().unwrap(), vec![b"2".to_vec()]);
        assert_eq!(store.waited_keys(), 0);
    }

    /// `add` and `compare_set` are atomic per key under concurrency from
    /// many threads, while other keys are written at the same time.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_adds_and_compare_sets_on_one_key_are_atomic() {
        let store = Arc::new(MemoryStore::new());
        let tasks: Vec<_> = (0..16)
            .map(|t| {
                let s = store.clone();
                tokio::spawn(async move {
                    let mut won = 0;
                    for i in 0..200 {
                        s.add("count", 1).await.unwrap();
                        s.set(&format!("other/{t}/{i}"), vec![1]).await.unwrap();
                        let swapped = s
                            .compare_set(&format!("claim/{i}"), None, vec![t])
                            .await
                            .unwrap();
                        won += usize::from(swapped == CompareSet::Swapped);
                    }
                    won
                })
            })
            .collect();
        let mut won = 0;
        for t in tasks {
            won += t.await.unwrap();
        }
        assert_eq!(store.get("count").await.unwrap(), Some(b"3200".to_vec()));
        assert_eq!(won, 200, "exactly one claim of each key wins");
        assert_eq!(store.len(), 1 + 16 * 200 + 200);
        assert_eq!(store.delete_prefix("other/").await.unwrap(), 3200);
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
        store.set("empty", Vec::new()).await.unwrap();
        assert!(
            store.add("empty", 1).await.is_err(),
            "an empty value is no integer"
        );
        assert!(store.delete("k").await.unwrap());
        assert!(!store.delete("k").await.unwrap());
    }
}
