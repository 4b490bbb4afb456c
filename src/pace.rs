//! Pacing long steps: when a step that keeps working gives the runtime back.
//!
//! Used by the `cpu` backend's engines for their transfers, and above the
//! backends for the host passes of a turn (the `PremulSum` scaling before a
//! reduction and the `Avg` division after it, [`paced_pass`]).
//!
//! A step of the shared-memory engine or of the TCP links that keeps making
//! progress never has to wait, so without pacing it never returns `Pending`:
//! a 64 MiB all_reduce issued from a task ran its whole transfer inside the
//! `_async` call (28-94 ms), and everything else on that worker — a ticker,
//! heartbeats, the abort that should stop the op, the op's timeout — waited
//! behind it. A [`Pacer`] counts the bytes a step moves and tells it when a
//! slice of work is used up; the step then yields ([`tokio::task::yield_now`],
//! which lets the runtime run its timers and other tasks first) and goes on.
//!
//! # Invariants
//! - PA-1: a step that keeps moving bytes yields to the runtime at least once
//!   per [`SLICE`] of work, give or take one unit of work (the engines move at
//!   most a few hundred KiB per unit, [`CHECK_BYTES`] plus one chunk).
//! - PA-2: a step that moves fewer than [`CHECK_BYTES`] in all never reads
//!   the clock and never yields because of the pacer: a small op pays one
//!   addition and one comparison per unit of work.
//! - PA-3: the abort signal is checked between slices: the turn that runs the
//!   step awaits it in a biased `select!` ahead of the op, so every poll
//!   after a yield reads the signal first (an atomic load, SU-4) and an abort
//!   raised meanwhile drops the step and ends the op with the abort's error.
//!   The same holds on a blocked caller's thread (`may_block`, driven by
//!   `Handle::block_on`), where the yield returns to `block_on`'s loop.

use std::time::{Duration, Instant};

/// Work between two yields of a step that keeps making progress ([PA-1]).
///
/// [PA-1]: self#invariants
pub(crate) const SLICE: Duration = Duration::from_micros(100);

/// Bytes of work between two reads of the clock ([PA-2]): about 6 µs of
/// copying at memcpy speed, so the clock costs under 1 % of a large step.
///
/// [PA-2]: self#invariants
pub(crate) const CHECK_BYTES: usize = 64 << 10;

thread_local! {
    /// Pacer yields started on this thread ([`yields`]).
    static YIELDS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// How many pacer yields this thread has started so far: a loop that polls
/// transfers itself (the TCP direct path) compares two readings to tell a
/// transfer that yielded to give the runtime back ([PA-1]) from one that
/// waits for its socket. Only differences mean anything.
///
/// [PA-1]: self#invariants
pub(crate) fn yields() -> u64 {
    YIELDS.with(std::cell::Cell::get)
}

/// Counts the work of one step (or one transfer of a step) and says when to
/// yield. Create one per step; it starts a slice lazily, at the first
/// [`CHECK_BYTES`] of work, so a small step never reads the clock ([PA-2]).
///
/// [PA-2]: self#invariants
#[derive(Debug, Default)]
pub(crate) struct Pacer {
    /// Bytes since the clock was last read.
    bytes: usize,
    /// When the current slice began (at its first clock read).
    since: Option<Instant>,
}

impl Pacer {
    /// A pacer with no work counted.
    pub(crate) const fn new() -> Pacer {
        Pacer {
            bytes: 0,
            since: None,
        }
    }

    /// Count `n` bytes of work; true when the slice is used up and the step
    /// should yield (then call [`Pacer::yield_now`] or [`Pacer::rested`]).
    #[inline]
    pub(crate) fn spent(&mut self, n: usize) -> bool {
        self.bytes += n;
        self.bytes >= CHECK_BYTES && self.check_clock()
    }

    #[cold]
    fn check_clock(&mut self) -> bool {
        self.bytes = 0;
        let now = Instant::now();
        match self.since {
            None => {
                self.since = Some(now);
                false
            }
            Some(s) => now.duration_since(s) >= SLICE,
        }
    }

    /// The runtime just had its turn (the step yielded or waited): start a
    /// new slice with the next unit of work.
    pub(crate) fn rested(&mut self) {
        self.bytes = 0;
        self.since = None;
    }

    /// Give the runtime back ([PA-1]), then start a new slice.
    ///
    /// [PA-1]: self#invariants
    pub(crate) async fn yield_now(&mut self) {
        YIELDS.with(|y| y.set(y.get().wrapping_add(1)));
        tokio::task::yield_now().await;
        self.rested();
    }

    /// Count `n` bytes of work, and yield if that used up the slice.
    pub(crate) async fn account(&mut self, n: usize) {
        if self.spent(n) {
            self.yield_now().await;
        }
    }
}

/// Bytes one call of a [`paced_pass`] closure gets: a multiple of every
/// element size, small enough that a slice ends within a few pieces.
pub(crate) const PIECE: usize = 256 << 10;

/// Run `f` over `data` in pieces of [`PIECE`] bytes, yielding to the runtime
/// whenever a slice of work is used up ([PA-1]); `data` under
/// [`CHECK_BYTES`] runs in one call with no clock read ([PA-2]). For host
/// passes over a whole buffer (scaling, averaging), which would otherwise
/// hold a worker for milliseconds at tens of MiB. `f` must work on any
/// whole number of elements (every piece but the last is [`PIECE`] bytes).
///
/// [PA-1]: self#invariants
/// [PA-2]: self#invariants
pub(crate) async fn paced_pass(data: &mut [u8], mut f: impl FnMut(&mut [u8])) {
    let mut pace = Pacer::new();
    for piece in data.chunks_mut(PIECE) {
        f(piece);
        let n = piece.len();
        pace.account(n).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_paced_pass_covers_every_byte_in_order() {
        let mut data: Vec<u8> = (0..(3 * PIECE + 17)).map(|i| i as u8).collect();
        let want: Vec<u8> = data.iter().map(|b| b.wrapping_add(1)).collect();
        let mut pieces = 0;
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        rt.block_on(paced_pass(&mut data, |p| {
            pieces += 1;
            p.iter_mut().for_each(|b| *b = b.wrapping_add(1));
        }));
        assert_eq!(data, want);
        assert_eq!(pieces, 4);
    }

    #[test]
    fn pa_2_small_steps_never_read_the_clock() {
        let mut p = Pacer::new();
        for _ in 0..(CHECK_BYTES / 8 - 1) {
            assert!(!p.spent(8));
        }
        assert!(p.since.is_none(), "the clock was read below CHECK_BYTES");
    }

    #[test]
    fn pa_1_a_slice_ends_after_its_time() {
        let mut p = Pacer::new();
        let start = Instant::now();
        // The first check starts the slice.
        assert!(!p.spent(CHECK_BYTES));
        assert!(p.since.is_some());
        let mut yielded = false;
        while start.elapsed() < SLICE * 50 {
            if p.spent(CHECK_BYTES) {
                yielded = true;
                break;
            }
            std::hint::spin_loop();
        }
        assert!(yielded, "no yield within 50 slices of work");
        assert!(start.elapsed() >= SLICE);
        p.rested();
        assert!(p.since.is_none() && p.bytes == 0);
    }
}
