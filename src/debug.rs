//! Process-wide counters for tests and diagnostics: how many communicator
//! actors, backends (each owning its data links) and watchdog tasks are
//! alive in this process, and how many messages the cpu backend sent.
//!
//! They let a test prove that finalize and abort leave nothing behind
//! (SV-1: no orphan actor, link or heartbeat task survives its communicator).
//!
//! ```
//! let actors = chorus::debug::live_actors();
//! let comm = chorus::new_comm("cpu", chorus::Device::Cpu, "dbg", chorus::CommOptions::single())?;
//! assert!(chorus::debug::live_actors() >= actors + 1);
//! comm.finalize()?;
//! # Ok::<(), chorus::Error>(())
//! ```

use std::sync::atomic::{AtomicUsize, Ordering};

pub(crate) static LIVE_ACTORS: AtomicUsize = AtomicUsize::new(0);
pub(crate) static LIVE_BACKENDS: AtomicUsize = AtomicUsize::new(0);
pub(crate) static LIVE_WATCHDOGS: AtomicUsize = AtomicUsize::new(0);
pub(crate) static SINGLE_COPY_READS: AtomicUsize = AtomicUsize::new(0);
pub(crate) static LIVE_WINDOWS: AtomicUsize = AtomicUsize::new(0);
pub(crate) static DATA_MESSAGES: AtomicUsize = AtomicUsize::new(0);

/// Messages (Header and Data frames, on TCP links and shared-memory rings)
/// the cpu backend has sent in this process since it started; Abort frames
/// are not counted. A test takes the difference around an op to see how
/// many messages the op's algorithm sent.
pub fn data_messages_sent() -> usize {
    DATA_MESSAGES.load(Ordering::Acquire)
}

/// One-sided windows ([`Comm::new_window`](crate::Comm::new_window)) whose
/// memory is still allocated in this process; finalize and abort free them.
pub fn live_windows() -> usize {
    LIVE_WINDOWS.load(Ordering::Acquire)
}

/// Communicator actors alive in this process (started and not yet stopped).
pub fn live_actors() -> usize {
    LIVE_ACTORS.load(Ordering::Acquire)
}

/// Backends whose links are still open in this process.
pub fn live_backends() -> usize {
    LIVE_BACKENDS.load(Ordering::Acquire)
}

/// Watchdog (heartbeat) tasks running in this process.
pub fn live_watchdogs() -> usize {
    LIVE_WATCHDOGS.load(Ordering::Acquire)
}

/// Payloads this process has read straight from a same-host peer's memory
/// (`process_vm_readv`, the cpu backend's single-copy path for large
/// transfers) instead of through a shared-memory ring.
pub fn single_copy_reads() -> usize {
    SINGLE_COPY_READS.load(Ordering::Acquire)
}
