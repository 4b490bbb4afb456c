//! Control plane: the rendezvous store, served over QUIC.
//!
//! Ranks find each other through a key-value [`Store`]: each rank publishes
//! its data-link address and waits for the others'. The store is served by
//! the `chorus-run` launcher, by the standalone `chorus-rendezvous` binary,
//! or by rank 0 (torchrun style, at `MASTER_ADDR:MASTER_PORT`), over QUIC
//! with TLS 1.3 ([`quic`]). Every
//! connection proves knowledge of the job secret with an HMAC challenge
//! before any store request is served; a peer without it is refused.
//!
//! Messages are rkyv-encoded, length-prefixed, size-bounded and validated
//! (bytecheck) before use ([`wire`]); a malformed frame closes only the
//! connection that sent it.
//!
//! # Invariants
//! - TP-1: no store request is served on a connection before it authenticated.
//! - TP-2: a frame larger than [`wire::MAX_FRAME`] is never buffered.
//! - TP-3: store keys are scoped by job, communicator name and epoch by
//!   their users, who delete them when done ([`Store::delete_prefix`]); the
//!   store itself has no process-wide counters.

use std::time::Duration;

use async_trait::async_trait;

#[cfg(feature = "etcd")]
pub mod etcd;
pub mod memory;
pub mod quic;
pub(crate) mod records;
pub mod store;
pub mod wire;

#[cfg(feature = "etcd")]
pub use etcd::EtcdStore;
pub use memory::MemoryStore;
pub use store::{RendezvousServer, StoreClient};

/// Errors of the control plane.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum TransportError {
    /// The peer could not prove the job secret (or we could not verify theirs).
    #[error("authentication failed with {peer}: {detail}; check that every rank uses the same job secret (CHORUS_SECRET)")]
    AuthFailed {
        /// Remote address.
        peer: String,
        /// What failed.
        detail: String,
    },
    /// Could not connect to the store within the deadline.
    #[error("could not reach the rendezvous store at {addr} within {after:?}: {detail}")]
    ConnectFailed {
        /// Store address.
        addr: String,
        /// How long we tried.
        after: Duration,
        /// Last error seen.
        detail: String,
    },
    /// A `wait` for keys did not complete in time.
    #[error("timed out after {after:?} waiting for store keys {keys:?}; a rank may not have started or may have died")]
    WaitTimeout {
        /// Keys still missing.
        keys: Vec<String>,
        /// The wait's timeout.
        after: Duration,
    },
    /// The connection to the store was lost.
    #[error("connection to the rendezvous store {addr} lost: {detail}")]
    ConnectionLost {
        /// Store address.
        addr: String,
        /// Details.
        detail: String,
    },
    /// A frame was malformed, too large, or failed validation.
    #[error("malformed control-plane frame: {0}")]
    Malformed(String),
    /// The store answered with an error.
    #[error("store error: {0}")]
    Store(String),
    /// Binding, TLS setup or other I/O failure.
    #[error("control-plane I/O error: {0}")]
    Io(String),
}

/// Result of [`Store::compare_set`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CompareSet {
    /// The value matched `expected` (or the key was absent and `expected` was
    /// `None`) and now holds `desired`.
    Swapped,
    /// The key holds this other value (or `None` if absent); nothing changed.
    Current(Option<Vec<u8>>),
}

/// A rendezvous key-value store shared by the ranks of a job.
///
/// Implemented by [`StoreClient`] (QUIC, across processes and hosts) and by
/// [`MemoryStore`] (in-process).
#[async_trait]
pub trait Store: Send + Sync {
    /// Set `key` to `value`, waking waiters.
    async fn set(&self, key: &str, value: Vec<u8>) -> Result<(), TransportError>;
    /// The value of `key`, if present. Does not wait.
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, TransportError>;
    /// Wait until every key in `keys` is present and return their values in
    /// order; `WaitTimeout` (naming the missing keys) after `timeout`.
    async fn wait(
        &self,
        keys: &[String],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, TransportError>;
    /// Atomically add `delta` to the integer at `key` (absent = 0) and return the new value.
    async fn add(&self, key: &str, delta: i64) -> Result<i64, TransportError>;
    /// Atomically set `key` to `desired` if it currently equals `expected`
    /// (`None` = absent).
    async fn compare_set(
        &self,
        key: &str,
        expected: Option<Vec<u8>>,
        desired: Vec<u8>,
    ) -> Result<CompareSet, TransportError>;
    /// Delete `key`; returns whether it existed.
    async fn delete(&self, key: &str) -> Result<bool, TransportError>;
    /// Delete every key that starts with `prefix` (a subtree such as
    /// `chorus/<job>/<comm>/0/epoch/3/`); returns how many went. An empty
    /// prefix, or one that does not end in `/`, is refused with
    /// [`TransportError::Store`] (it would reach other jobs' keys, or
    /// siblings such as `epoch/30/` for `epoch/3`).
    async fn delete_prefix(&self, prefix: &str) -> Result<u64, TransportError>;
}

/// Check a [`Store::delete_prefix`] prefix.
///
/// # Errors
/// [`TransportError::Store`] for an empty prefix or one not ending in `/`.
pub fn check_prefix(prefix: &str) -> Result<(), TransportError> {
    if prefix.is_empty() || !prefix.ends_with('/') {
        return Err(TransportError::Store(format!(
            "refusing to delete keys under {prefix:?}: a prefix must be non-empty and end in '/'"
        )));
    }
    Ok(())
}
