//! Collective algorithms as sans-IO schedules.
//!
//! A [`Schedule`] is pure data: for one rank, an ordered list of [`Step`]s,
//! each a set of [`Transfer`]s (sends and receives with peers, on element
//! ranges of the op's buffers) that may run concurrently. Schedules are built
//! by pure functions of `(rank, size, counts, root)`; they contain no sockets,
//! no timers and no dtype. The cpu backend executes them over its links; the
//! in-memory harness in the tests executes N ranks at once and checks results.
//!
//! Execution semantics (shared by the backend and the harness):
//! - SC-1: steps run in order; a step completes when all its transfers have.
//! - SC-2: within a step, every `Send` reads its range as it was *before* the
//!   step; every `Recv` is applied (copy or reduce) after all of the step's
//!   transfers completed.
//! - SC-3: sends and receives between one ordered pair of ranks are matched in
//!   order, and a matched pair has the same length.
//! - SC-4: every schedule is deadlock-free even if a send completes only when
//!   the matching receive is posted (rendezvous semantics).
//!
//! STUB: algorithms to be implemented.

use std::ops::Range;

/// Which buffer of the op a transfer reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BufId {
    /// The op's source buffer (e.g. the concatenated inputs of scatter/all_to_all).
    Src,
    /// The op's destination / working buffer (in-place ops use only this one).
    Dst,
}

/// What to do with received data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecvAction {
    /// Overwrite the range.
    Copy,
    /// Combine into the range with the op's reduce operator.
    Reduce,
}

/// One transfer, in elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transfer {
    /// Send `buf[range]` to `peer`.
    Send {
        /// Destination rank.
        peer: usize,
        /// Buffer to read.
        buf: BufId,
        /// Element range.
        range: Range<usize>,
    },
    /// Receive `range.len()` elements from `peer` into `buf[range]`.
    Recv {
        /// Source rank.
        peer: usize,
        /// Buffer to write.
        buf: BufId,
        /// Element range.
        range: Range<usize>,
        /// Copy or reduce.
        action: RecvAction,
    },
    /// Copy `Src[src]` into `Dst[dst]` locally (same length).
    LocalCopy {
        /// Source range in `Src`.
        src: Range<usize>,
        /// Destination range in `Dst`.
        dst: Range<usize>,
    },
}

/// A set of transfers that may proceed concurrently.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Step {
    /// The transfers.
    pub transfers: Vec<Transfer>,
}

/// The steps one rank runs for one op.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Schedule {
    /// Steps in order.
    pub steps: Vec<Step>,
}
