//! The stall check and the history check: mismatches that no data message
//! reveals, found through the heartbeats.
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
//! A backend whose library moves the data (`nccl`, `rccl`, `gloo`, `mpi`)
//! cannot check a fingerprint per message, and a mismatch there may not
//! stall at all (the ops complete with wrong results, or hang on the
//! device while the host runs on). For every backend the log also keeps a
//! *history hash*, every finished op's fingerprint folded into the one
//! before ([`crate::checks::chain`]); each heartbeat announces the last
//! finished op's sequence number and hash, and each rank compares what its
//! peers announce with its own hash after that op. Hashes that agree mean
//! the same ops up to there; the first difference is a fatal
//! `Mismatch` on the rank that sees it, within about two heartbeat
//! intervals after both ranks finished the op that differs, as long as
//! neither is [`HISTORY`] ops ahead of the other.
//!
//! # Invariants
//! - ST-1: the log costs O(1) per op (one uncontended lock at its start and
//!   at its end, no allocation after the first [`HISTORY`] ops) and
//!   O([`HISTORY`]) memory; a heartbeat grows by at most 80 bytes; a
//!   comparison scans at most [`HISTORY`] entries, once per peer's
//!   heartbeat read.
//! - ST-2: only ops whose fingerprint is nonzero are logged and compared;
//!   a sequence number this rank has not reached, or has forgotten, is
//!   never called a mismatch.
//! - ST-3: only ops that completed enter the history; an op that failed
//!   without ending the communicator failed alike on every rank (a
//!   mismatch its header exchange found, an op every rank refused), and
//!   its signatures may differ between ranks.
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
    /// `(seq, fingerprint, history hash after it)` of the last finished
    /// ops, oldest first.
    done: VecDeque<(u64, u64, u64)>,
    /// The history hash after the last finished op.
    chain: u64,
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

    /// The executor starts op `seq` with fingerprint `fp` at `since`
    /// ([ST-2](self#invariants)).
    pub(crate) fn begin(&self, seq: u64, fp: u64, kind: OpKind, since: Instant) {
        if fp == 0 {
            return;
        }
        self.lock().current = Some(Current {
            seq,
            fp,
            kind,
            since,
        });
    }

    /// The executor finished its current op. Only an op that `completed`
    /// enters the history ([ST-3](self#invariants)): one that failed without ending the
    /// communicator (a mismatch the header exchange found before any data
    /// moved, an op every rank refused) failed alike on every rank, and
    /// its signatures may differ between ranks.
    pub(crate) fn end(&self, completed: bool) {
        let mut g = self.lock();
        if let Some(c) = g.current.take().filter(|_| completed) {
            if g.done.len() == HISTORY {
                g.done.pop_front();
            }
            g.chain = crate::checks::chain(g.chain, c.fp);
            let chain = g.chain;
            g.done.push_back((c.seq, c.fp, chain));
        }
    }

    /// The current op, `(seq, fingerprint, kind)`, if it has run for at least `after`.
    pub(crate) fn stalled(&self, after: Duration) -> Option<(u64, u64, OpKind)> {
        self.lock()
            .current
            .filter(|c| c.since.elapsed() >= after)
            .map(|c| (c.seq, c.fp, c.kind))
    }

    /// The last finished op's sequence number and the history hash after it.
    pub(crate) fn latest(&self) -> Option<(u64, u64)> {
        self.lock().done.back().map(|&(s, _, c)| (s, c))
    }

    /// Compare the history hash `peer` announced after op `seq` with this
    /// rank's after the same op, if this rank still remembers it.
    pub(crate) fn check_history(
        &self,
        me: usize,
        peer: usize,
        seq: u64,
        chain: u64,
    ) -> Option<Disagreement> {
        let g = self.lock();
        let &(_, _, mine) = g.done.iter().rev().find(|(s, _, _)| *s == seq)?;
        (mine != chain).then(|| Disagreement {
            seq,
            detail: format!(
                "the ops of rank {peer} and rank {me} up to op #{seq} differ (history hashes \
                 {chain:#018x} and {mine:#018x}): the ranks issued different ops (kind, dtype, \
                 count, root, reduce op or split sizes) at or before op #{seq}; run with \
                 CHORUS_CHECKS=strict to have the op and field named"
            ),
        })
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
                .find(|(s, _, _)| *s == seq)
                .map(|&(_, f, _)| (f, false)),
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

/// What a heartbeat announces besides its counter.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Beat {
    /// The op the rank has been waiting in for an interval: `(seq, fingerprint)`.
    pub(crate) stall: Option<(u64, u64)>,
    /// The last op the rank finished: `(seq, history hash)`.
    pub(crate) latest: Option<(u64, u64)>,
}

/// A heartbeat value, ASCII: the counter, then `s <seq> <fingerprint>` for
/// a stall and `d <seq> <hash>` for the last finished op, each if any.
pub(crate) fn encode_beat(counter: u64, beat: Beat) -> Vec<u8> {
    let mut v = counter.to_string();
    if let Some((seq, fp)) = beat.stall {
        v.push_str(&format!(" s {seq} {fp:x}"));
    }
    if let Some((seq, chain)) = beat.latest {
        v.push_str(&format!(" d {seq} {chain:x}"));
    }
    v.into_bytes()
}

/// What a heartbeat value announces; nothing for a malformed part.
pub(crate) fn parse_beat(raw: &[u8]) -> Beat {
    let mut beat = Beat::default();
    let Ok(s) = std::str::from_utf8(raw) else {
        return beat;
    };
    let mut it = s.split(' ').skip(1);
    while let Some(tag) = it.next() {
        let (Some(seq), Some(h)) = (it.next(), it.next()) else {
            break;
        };
        let (Ok(seq), Ok(h)) = (seq.parse::<u64>(), u64::from_str_radix(h, 16)) else {
            break;
        };
        match tag {
            "s" => beat.stall = Some((seq, h)),
            "d" => beat.latest = Some((seq, h)),
            _ => break,
        }
    }
    beat
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn st_2_a_stall_is_compared_with_the_current_or_a_remembered_op_only() {
        let log = OpLog::default();
        log.begin(0, 11, OpKind::Broadcast, Instant::now());
        log.end(true);
        log.begin(1, 22, OpKind::Barrier, Instant::now());
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
        log.end(true);
        log.begin(2, 0, OpKind::Barrier, Instant::now());
        assert_eq!(log.current(), None);
    }

    /// Ops that failed alike on every rank without ending the
    /// communicator stay out of the history, so differing signatures of
    /// such an op do not make the histories differ.
    #[test]
    fn st_3_an_op_that_did_not_complete_stays_out_of_the_history() {
        let (a, b) = (OpLog::default(), OpLog::default());
        a.begin(0, 11, OpKind::ReduceScatter, Instant::now());
        a.end(false);
        b.begin(0, 12, OpKind::ReduceScatter, Instant::now());
        b.end(false);
        for l in [&a, &b] {
            l.begin(1, 33, OpKind::Barrier, Instant::now());
            l.end(true);
        }
        let (seq, chain) = a.latest().expect("op 1");
        assert_eq!(seq, 1);
        assert_eq!(b.check_history(1, 0, seq, chain), None);
        assert_eq!(b.check(1, 0, 0, 11), None, "op 0 is not remembered");
    }

    #[test]
    fn st_1_history_is_bounded() {
        let log = OpLog::default();
        for s in 0..(HISTORY as u64 + 10) {
            log.begin(s, s + 1, OpKind::AllReduce, Instant::now());
            log.end(true);
        }
        assert_eq!(log.lock().done.len(), HISTORY);
        assert_eq!(log.check(0, 1, 0, 999), None, "forgotten");
        assert!(log.check(0, 1, 20, 999).is_some());
    }

    #[test]
    fn beats_round_trip() {
        let none = Beat::default();
        assert_eq!(parse_beat(&encode_beat(7, none)), none);
        let both = Beat {
            stall: Some((3, 0xabc)),
            latest: Some((2, 0xdef)),
        };
        assert_eq!(parse_beat(&encode_beat(7, both)), both);
        assert_eq!(parse_beat(b"7 s x y"), none);
        assert_eq!(parse_beat(b"7 q 1 2"), none);
        let max = Beat {
            stall: Some((u64::MAX, u64::MAX)),
            latest: Some((u64::MAX, u64::MAX)),
        };
        assert!(encode_beat(u64::MAX, max).len() <= 20 + 80);
    }

    /// The history hashes of two ranks agree while they issue the same ops
    /// and differ from the first op that differs on.
    #[test]
    fn histories_agree_until_an_op_differs() {
        let (a, b) = (OpLog::default(), OpLog::default());
        for s in 0..5u64 {
            a.begin(s, 100 + s, OpKind::AllReduce, Instant::now());
            a.end(true);
            // Rank b's op #2 differs.
            b.begin(
                s,
                if s == 2 { 999 } else { 100 + s },
                OpKind::AllReduce,
                Instant::now(),
            );
            b.end(true);
        }
        for s in 0..2 {
            let (_, _, ha) = a.lock().done[s as usize];
            assert_eq!(b.check_history(1, 0, s, ha), None, "op {s}");
        }
        for s in 2..5 {
            let (_, _, ha) = a.lock().done[s as usize];
            let d = b.check_history(1, 0, s, ha).expect("differs");
            assert!(d.detail.contains(&format!("up to op #{s}")), "{}", d.detail);
        }
        assert_eq!(a.latest().map(|l| l.0), Some(4));
        // Not reached: no verdict.
        assert_eq!(a.check_history(0, 1, 9, 1), None);
    }

    #[test]
    fn stalled_waits_for_the_bound() {
        let log = OpLog::default();
        log.begin(4, 9, OpKind::Gather, Instant::now());
        assert_eq!(log.stalled(Duration::from_secs(3600)), None);
        assert_eq!(log.stalled(Duration::ZERO), Some((4, 9, OpKind::Gather)));
    }
}
