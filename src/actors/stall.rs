//! The stall check: a mismatch that no data message reveals, found through
//! the heartbeats.
//!
//! With [`Checks::Fingerprint`](crate::checks::Checks::Fingerprint), a
//! mismatch is found when a message of one op reaches a rank running
//! another. Some mismatches send no such message: two ranks that each wait
//! for the other (a broadcast whose ranks name different roots) wait until
//! the op times out. The [`OpLog`] closes that gap. The executor records
//! each op it runs (sequence number and fingerprint) and keeps the last
//! [`HISTORY`] of them; the watchdog appends this rank's current op to its
//! heartbeat once it has run for a heartbeat interval (a *stall*), and
//! compares every stall a peer announces with the op this rank ran, or
//! runs, under that sequence number. A difference is a fatal
//! [`Error::Mismatch`](crate::Error::Mismatch), raised like a peer failure.
//!
//! A stalled rank waits for a peer; that peer is either stalled too (and
//! announces its own op) or has moved past the stalled sequence number (and
//! holds its fingerprint in its history), so one of the two sees the
//! difference within about two heartbeat intervals after the stall begins
//! (one to announce it, one for the other to read it), as long as the peer
//! is fewer than [`HISTORY`] ops ahead.
//!
//! # Invariants
//! - ST-1: the log costs O(1) per op (one uncontended lock at its start and
//!   at its end, no allocation after the first [`HISTORY`] ops) and
//!   O([`HISTORY`]) memory; a heartbeat grows by at most 40 bytes.
//! - ST-2: only ops whose fingerprint is nonzero are logged and compared;
//!   a sequence number this rank has not reached, or has forgotten, is
//!   never called a mismatch.
//!
//! [`HISTORY`]: HISTORY

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use crate::op::OpKind;

/// How many finished ops the log remembers ([ST-1](self#invariants)).
pub(crate) const HISTORY: usize = 1024;

#[derive(Debug, Clone, Copy)]
struct Current {
    seq: u64,
    fp: u64,
    kind: OpKind,
    since: Instant,
}

#[derive(Debug, Default)]
struct Inner {
    current: Option<Current>,
    /// `(seq, fingerprint)` of the last finished ops, oldest first.
    done: VecDeque<(u64, u64)>,
}

/// This rank's recent ops, written by the executor and read by the
/// watchdog ([module docs](self)).
#[derive(Debug, Default)]
pub(crate) struct OpLog {
    inner: Mutex<Inner>,
}

/// What this rank's op `seq` was, when a peer's stall disagrees with it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Disagreement {
    /// The peer's stalled sequence number.
    pub(crate) seq: u64,
    /// Human-readable detail.
    pub(crate) detail: String,
}

impl OpLog {
    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The executor starts op `seq` with fingerprint `fp` ([ST-2](self#invariants)).
    pub(crate) fn begin(&self, seq: u64, fp: u64, kind: OpKind) {
        if fp == 0 {
            return;
        }
        self.lock().current = Some(Current {
            seq,
            fp,
            kind,
            since: Instant::now(),
        });
    }

    /// The executor finished its current op, however it ended.
    pub(crate) fn end(&self) {
        let mut g = self.lock();
        if let Some(c) = g.current.take() {
            if g.done.len() == HISTORY {
                g.done.pop_front();
            }
            g.done.push_back((c.seq, c.fp));
        }
    }

    /// The current op, `(seq, fingerprint, kind)`, if it has run for at least `after`.
    pub(crate) fn stalled(&self, after: Duration) -> Option<(u64, u64, OpKind)> {
        self.lock()
            .current
            .filter(|c| c.since.elapsed() >= after)
            .map(|c| (c.seq, c.fp, c.kind))
    }

    /// The op this rank runs now, `(seq, kind)`.
    pub(crate) fn current(&self) -> Option<(u64, OpKind)> {
        self.lock().current.map(|c| (c.seq, c.kind))
    }

    /// Compare a stall `peer` announced (`seq`, `fp`) with this rank's op
    /// under `seq`, current or remembered ([ST-2](self#invariants)).
    pub(crate) fn check(&self, me: usize, peer: usize, seq: u64, fp: u64) -> Option<Disagreement> {
        let g = self.lock();
        let mine = match g.current {
            Some(c) if c.seq == seq => Some((c.fp, true)),
            _ => g
                .done
                .iter()
                .rev()
                .find(|(s, _)| *s == seq)
                .map(|&(_, f)| (f, false)),
        }?;
        (mine.0 != fp).then(|| Disagreement {
            seq,
            detail: format!(
                "rank {peer} has been waiting in op #{seq} with fingerprint {fp:#018x}, but rank {me} \
                 {} op #{seq} with fingerprint {:#018x}: the ranks issued different ops (kind, dtype, \
                 count, root, reduce op or split sizes); run with CHORUS_CHECKS=strict to have the \
                 field named",
                if mine.1 { "runs" } else { "ran" },
                mine.0
            ),
        })
    }
}

/// A heartbeat value: the counter, then this rank's stall, if any
/// (`<counter>` or `<counter> <seq> <fingerprint>`, ASCII).
pub(crate) fn encode_beat(counter: u64, stall: Option<(u64, u64)>) -> Vec<u8> {
    match stall {
        Some((seq, fp)) => format!("{counter} {seq} {fp:x}").into_bytes(),
        None => counter.to_string().into_bytes(),
    }
}

/// The stall a heartbeat value announces, if any; `None` for a malformed one.
pub(crate) fn parse_stall(beat: &[u8]) -> Option<(u64, u64)> {
    let s = std::str::from_utf8(beat).ok()?;
    let mut it = s.split(' ');
    let _counter = it.next()?;
    let seq = it.next()?.parse().ok()?;
    let fp = u64::from_str_radix(it.next()?, 16).ok()?;
    Some((seq, fp))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn st_2_a_stall_is_compared_with_the_current_or_a_remembered_op_only() {
        let log = OpLog::default();
        log.begin(0, 11, OpKind::Broadcast);
        log.end();
        log.begin(1, 22, OpKind::Barrier);
        // Current op, same and different.
        assert_eq!(log.check(0, 1, 1, 22), None);
        assert!(log.check(0, 1, 1, 23).is_some());
        // Remembered op.
        assert_eq!(log.check(0, 1, 0, 11), None);
        let d = log.check(0, 1, 0, 12).expect("differs");
        assert!(d.detail.contains("rank 0 ran op #0"), "{}", d.detail);
        // Not reached yet.
        assert_eq!(log.check(0, 1, 5, 1), None);
        // Unchecked ops are not logged.
        log.end();
        log.begin(2, 0, OpKind::Barrier);
        assert_eq!(log.current(), None);
    }

    #[test]
    fn st_1_history_is_bounded() {
        let log = OpLog::default();
        for s in 0..(HISTORY as u64 + 10) {
            log.begin(s, s + 1, OpKind::AllReduce);
            log.end();
        }
        assert_eq!(log.lock().done.len(), HISTORY);
        assert_eq!(log.check(0, 1, 0, 999), None, "forgotten");
        assert!(log.check(0, 1, 20, 999).is_some());
    }

    #[test]
    fn beats_round_trip() {
        assert_eq!(parse_stall(&encode_beat(7, None)), None);
        assert_eq!(
            parse_stall(&encode_beat(7, Some((3, 0xabc)))),
            Some((3, 0xabc))
        );
        assert_eq!(parse_stall(b"7 x y"), None);
        assert!(encode_beat(u64::MAX, Some((u64::MAX, u64::MAX))).len() <= 20 + 40);
    }

    #[test]
    fn stalled_waits_for_the_bound() {
        let log = OpLog::default();
        log.begin(4, 9, OpKind::Gather);
        assert_eq!(log.stalled(Duration::from_secs(3600)), None);
        assert_eq!(log.stalled(Duration::ZERO), Some((4, 9, OpKind::Gather)));
    }
}
