//! Errors returned by Chorus.
//!
//! Every layer has its own `thiserror` enum: the control plane reports
//! [`TransportError`]; everything a user can
//! see from a communicator is an [`Error`]. Errors carry the context needed to
//! act on them — the communicator's name, this rank, the operation and its
//! sequence number, the epoch — and their messages say what to do.

use std::time::Duration;

use crate::tensor::DType;
use crate::transport::TransportError;

/// Result type used across the public API.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// Everything that can go wrong on a communicator.
///
/// Errors are cheap to clone so that one failure (a dead peer, an abort) can
/// complete every outstanding [`Work`](crate::Work) with the same cause.
#[derive(Debug, Clone, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// `new_comm` was given a backend name that is not compiled in, not
    /// registered ([`register_backend`](crate::register_backend)) or does not exist.
    #[error("unknown backend {name:?}; backends built in or registered: {available:?}")]
    UnknownBackend {
        /// The name that was asked for.
        name: String,
        /// The names that would have been accepted.
        available: Vec<&'static str>,
    },

    /// The backend exists but cannot run here (missing library, no device).
    #[error("backend {backend} is unavailable: {reason}")]
    BackendUnavailable {
        /// Backend name.
        backend: &'static str,
        /// Why it cannot be used, e.g. which library was not found.
        reason: String,
    },

    /// A call was made with arguments that can never work, detected locally
    /// before any communication (root out of range, wrong dtype for the op, sizes
    /// that do not add up, ...).
    #[error("invalid argument to {op} on communicator {comm:?} (rank {rank}): {reason}")]
    InvalidArgument {
        /// Communicator name.
        comm: String,
        /// This rank.
        rank: usize,
        /// Operation name.
        op: &'static str,
        /// What is wrong and how to fix it.
        reason: String,
    },

    /// The ranks disagreed about an operation: different op, dtype, count, root or
    /// split sizes. Reported on every participating rank instead of hanging or
    /// exchanging corrupt data.
    #[error(
        "mismatch in {op} #{seq} on communicator {comm:?} (rank {rank}, epoch {epoch}): {detail}; \
         every rank must issue the same collectives in the same order with matching arguments"
    )]
    Mismatch {
        /// Communicator name.
        comm: String,
        /// This rank.
        rank: usize,
        /// Operation name (as issued by this rank).
        op: &'static str,
        /// Sequence number of the operation.
        seq: u64,
        /// Epoch of the communicator.
        epoch: u64,
        /// Which ranks disagreed and on what.
        detail: String,
        /// Whether the ranks are out of step (different ops at the same
        /// point), which aborts the communicator; a mere parameter mismatch
        /// (count, dtype, root...) leaves it usable.
        fatal: bool,
    },

    /// The operation did not complete within its timeout. The communicator is
    /// aborted afterwards (its links are in an unknown state).
    #[error(
        "{op} #{seq} on communicator {comm:?} (rank {rank}, epoch {epoch}) timed out after {after:?}; \
         a peer is slow, hung or did not issue the same operation"
    )]
    Timeout {
        /// Communicator name.
        comm: String,
        /// This rank.
        rank: usize,
        /// Operation name.
        op: &'static str,
        /// Sequence number.
        seq: u64,
        /// Epoch of the communicator.
        epoch: u64,
        /// The timeout that expired.
        after: Duration,
    },

    /// One or more peers failed (connection lost, process died, or a peer
    /// reported its own failure).
    #[error(
        "peer failure on communicator {comm:?} (rank {rank}, epoch {epoch}) during {op}: ranks {failed_ranks:?}: {detail}"
    )]
    PeerFailed {
        /// Communicator name.
        comm: String,
        /// This rank.
        rank: usize,
        /// Epoch of the communicator.
        epoch: u64,
        /// Operation in flight when the failure was seen.
        op: &'static str,
        /// Ranks known to have failed.
        failed_ranks: Vec<usize>,
        /// What was observed.
        detail: String,
    },

    /// Bytes received from `peer` did not match the checksum it sent with
    /// them (`CHORUS_CHECKSUM=1`): they were changed in transit or in a
    /// shared-memory ring. The op's output is not valid and the
    /// communicator is aborted.
    #[error(
        "corrupted data on communicator {comm:?} (rank {rank}, epoch {epoch}) during {op}: from rank {peer}: {detail}"
    )]
    Corrupted {
        /// Communicator name.
        comm: String,
        /// This rank.
        rank: usize,
        /// Epoch of the communicator.
        epoch: u64,
        /// Operation in flight.
        op: &'static str,
        /// The rank the bytes came from.
        peer: usize,
        /// What did not match.
        detail: String,
    },

    /// This rank lost the rendezvous store: it did not answer for `after`.
    /// This rank is alive, and its peers may be too; what failed is the
    /// store or the network path to it. Without the store the ranks can no
    /// longer agree on failures, so the communicator is aborted.
    #[error(
        "communicator {comm:?} (rank {rank}, epoch {epoch}) lost the rendezvous store during {op}: \
         no answer for {after:?}: {detail}; this rank is alive, the store or the network path to \
         it is not. Host the store where no rank's death takes it down (chorus-run does; or a \
         standalone chorus-rendezvous), then restart the job"
    )]
    StoreUnreachable {
        /// Communicator name.
        comm: String,
        /// This rank.
        rank: usize,
        /// Epoch of the communicator.
        epoch: u64,
        /// What was running when the store was found gone (`watchdog`, or an op).
        op: &'static str,
        /// How long the store had not answered.
        after: Duration,
        /// What was observed (the last store error, and any link loss seen meanwhile).
        detail: String,
    },

    /// The communicator was aborted (by `abort()`, or after an earlier fatal
    /// error). Every outstanding and later operation completes with this error.
    #[error("communicator {comm:?} (rank {rank}, epoch {epoch}) was aborted: {reason}")]
    Aborted {
        /// Communicator name.
        comm: String,
        /// This rank.
        rank: usize,
        /// Epoch of the communicator.
        epoch: u64,
        /// Ranks known to have failed, if the abort was caused by a failure.
        failed_ranks: Vec<usize>,
        /// Why it was aborted.
        reason: String,
    },

    /// The communicator was finalized; no further operations are accepted.
    #[error("communicator {comm:?} (rank {rank}) is finalized; create a new communicator")]
    Finalized {
        /// Communicator name.
        comm: String,
        /// This rank.
        rank: usize,
    },

    /// The reduction op is not defined for this dtype (e.g. `BXor` on `f32`).
    #[error(
        "reduce op {op} is not supported for dtype {dtype}; bitwise ops need an integer dtype"
    )]
    UnsupportedOp {
        /// The reduce op.
        op: String,
        /// The dtype it was applied to.
        dtype: DType,
    },

    /// The communicator's backend cannot do this (see
    /// [`Comm::capabilities`](crate::Comm::capabilities)): refused on every
    /// rank before any exchange; the communicator stays usable.
    #[error(
        "communicator {comm:?} (rank {rank}): backend {backend} does not support {op}: {detail}"
    )]
    NotSupported {
        /// Communicator name.
        comm: String,
        /// This rank.
        rank: usize,
        /// The backend.
        backend: &'static str,
        /// The method (`split`, `reconfigure`).
        op: &'static str,
        /// Why, and what to do instead.
        detail: String,
    },

    /// `reconfigure` could not form the next epoch: too few of the old ranks
    /// survived (a minority partition never forms its own epoch).
    #[error(
        "no quorum for epoch {epoch} of communicator {comm:?} (rank {rank}): only ranks \
         {survivors:?} of {old_size} survived; more than half (or ReconfigureOptions::min_size) \
         must, so this side stops instead of forming a split-brain epoch"
    )]
    NoQuorum {
        /// Communicator name.
        comm: String,
        /// This rank in the old epoch (`usize::MAX` for a joiner).
        rank: usize,
        /// The epoch that was not formed.
        epoch: u64,
        /// Old ranks that registered for it.
        survivors: Vec<usize>,
        /// Size of the old epoch.
        old_size: usize,
    },

    /// This rank was left out of a new epoch (it arrived after the membership
    /// was closed); create or join the communicator again.
    #[error("left out of epoch {epoch} of communicator {comm:?}: {reason}")]
    Excluded {
        /// Communicator name.
        comm: String,
        /// The epoch.
        epoch: u64,
        /// Why.
        reason: String,
    },

    /// A blocking method was called on a thread where blocking is not
    /// allowed: a worker of a current-thread tokio runtime, whose only
    /// thread would stop running every other task (including the I/O the
    /// call waits for).
    #[error(
        "{op} blocks, and was called on a current-thread tokio runtime, whose only thread it \
         would stop; {fix}, or call it from a multi-thread runtime or a plain thread",
        fix = would_block_fix(.op)
    )]
    WouldBlock {
        /// The method.
        op: &'static str,
    },

    /// Bootstrap or configuration problem (missing environment, bad address...).
    #[error("configuration error: {0}")]
    Config(String),

    /// The control plane (store, QUIC, authentication) failed.
    #[error(transparent)]
    Transport(#[from] TransportError),

    /// A bug in Chorus: please report it.
    #[error("internal error (please report): {0}")]
    Internal(String),
}

/// What to do instead of the blocking method `op` on a current-thread
/// runtime, for [`Error::WouldBlock`]'s message.
fn would_block_fix(op: &str) -> String {
    match op {
        "Work::wait" | "Work::wait_timeout" => {
            "await the Work instead (`work.await`; bound it with `tokio::time::timeout`)".into()
        }
        "Work::wait_stream" => {
            "await the Work instead (once it has completed, `wait_stream` returns at once)".into()
        }
        _ => format!("await its async form (e.g. `{op}_async(..).await`) instead"),
    }
}

impl Error {
    /// Whether the communicator can no longer be used after this error.
    ///
    /// A parameter `Mismatch` and `InvalidArgument` leave the communicator
    /// usable (the check happens before any data moves); timeouts, peer
    /// failures, aborts and ranks out of step (`Mismatch { fatal: true, .. }`)
    /// do not.
    pub fn is_fatal(&self) -> bool {
        matches!(
            self,
            Error::Timeout { .. }
                | Error::PeerFailed { .. }
                | Error::Corrupted { .. }
                | Error::StoreUnreachable { .. }
                | Error::Aborted { .. }
                | Error::Mismatch { fatal: true, .. }
                | Error::Transport(_)
                | Error::Internal(_)
        )
    }

    /// Ranks reported as failed by this error, if any.
    pub fn failed_ranks(&self) -> &[usize] {
        match self {
            Error::PeerFailed { failed_ranks, .. } | Error::Aborted { failed_ranks, .. } => {
                failed_ranks
            }
            _ => &[],
        }
    }
}
