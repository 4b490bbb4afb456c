//! Which accepted, not yet authenticated data-link connections a listener
//! keeps: a pure policy, so that a flood of idle connections cannot hold a
//! rank's file descriptors or push its real peers out.
//!
//! A rank's real peers send their hello as soon as they connect, so their
//! handshakes finish within a round trip or two. A connection that stays
//! pending is idle or hostile. The policy bounds pending handshakes per
//! source address and per listener, and when a new connection would pass a
//! bound it closes the *oldest* pending one (from the same source when the
//! per-source bound is hit): a new connection, which is where a real peer's
//! is, always gets its chance, and what goes is what has waited longest
//! without proving anything. A peer whose connection is closed this way
//! connects again (the connector retries a handshake refused before any
//! answer, a few times).
//!
//! # Invariants
//! - LK-12: at most [`Admission::per_source`] handshakes from one address
//!   and [`Admission::total`] in all are pending at any time; admitting a
//!   connection never refuses it, it evicts the oldest pending ones instead.
//!   O(total) memory, O(total) work per admission.

use std::collections::VecDeque;
use std::net::IpAddr;

/// Pending handshakes allowed from one source address beyond the peers
/// this rank expects to accept from.
const SOURCE_SLACK: usize = 16;
/// Pending handshakes allowed per listener beyond the expected peers.
const TOTAL_SLACK: usize = 128;

/// The pending handshakes of one listener, oldest first ([LK-12]).
///
/// [LK-12]: self#invariants
#[derive(Debug)]
pub(crate) struct Admission {
    pending: VecDeque<(u64, IpAddr)>,
    per_source: usize,
    total: usize,
}

impl Admission {
    /// A policy for a listener that expects `peers` real connections.
    pub(crate) fn new(peers: usize) -> Admission {
        Admission {
            pending: VecDeque::new(),
            per_source: peers.saturating_add(SOURCE_SLACK),
            total: peers.saturating_add(TOTAL_SLACK),
        }
    }

    /// The bound per source address.
    #[cfg(test)]
    pub(crate) fn per_source(&self) -> usize {
        self.per_source
    }

    /// The bound per listener.
    #[cfg(test)]
    pub(crate) fn total(&self) -> usize {
        self.total
    }

    /// Admit connection `id` from `source`; returns the ids of the pending
    /// connections to close so that the bounds hold.
    pub(crate) fn admit(&mut self, id: u64, source: IpAddr) -> Vec<u64> {
        let mut evict = Vec::new();
        let from_source = self.pending.iter().filter(|(_, s)| *s == source).count();
        if from_source >= self.per_source {
            if let Some(k) = self.pending.iter().position(|(_, s)| *s == source) {
                if let Some((old, _)) = self.pending.remove(k) {
                    evict.push(old);
                }
            }
        }
        while self.pending.len() >= self.total {
            match self.pending.pop_front() {
                Some((old, _)) => evict.push(old),
                None => break,
            }
        }
        self.pending.push_back((id, source));
        evict
    }

    /// Connection `id`'s handshake ended (authenticated, refused, timed out
    /// or evicted).
    pub(crate) fn done(&mut self, id: u64) {
        if let Some(k) = self.pending.iter().position(|(i, _)| *i == id) {
            self.pending.remove(k);
        }
    }

    /// Handshakes pending now.
    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.pending.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::{Ipv4Addr, Ipv6Addr};

    fn ip(last: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(127, 0, 0, last))
    }

    #[test]
    fn lk12_one_source_is_held_to_its_bound_by_evicting_its_oldest() {
        let mut a = Admission::new(3);
        let cap = a.per_source();
        for id in 0..cap as u64 {
            assert!(a.admit(id, ip(9)).is_empty());
        }
        // Past the bound: the oldest from that source goes, the new one stays.
        assert_eq!(a.admit(100, ip(9)), vec![0]);
        assert_eq!(a.admit(101, ip(9)), vec![1]);
        assert_eq!(a.len(), cap);
        // Another source is not affected.
        assert!(a.admit(200, ip(1)).is_empty());
        assert_eq!(a.len(), cap + 1);
    }

    #[test]
    fn lk12_the_listener_is_held_to_its_total_by_evicting_the_oldest() {
        let mut a = Admission::new(0);
        let total = a.total();
        // Many sources, one connection each: only the total binds.
        let mut evicted = Vec::new();
        for id in 0..(total as u64 + 5) {
            let addr = IpAddr::V6(Ipv6Addr::from(id as u128 + 1));
            evicted.extend(a.admit(id, addr));
        }
        assert_eq!(evicted, vec![0, 1, 2, 3, 4]);
        assert_eq!(a.len(), total);
    }

    #[test]
    fn lk12_finished_handshakes_free_their_place() {
        let mut a = Admission::new(0);
        let cap = a.per_source() as u64;
        for id in 0..cap {
            assert!(a.admit(id, ip(2)).is_empty());
        }
        for id in 0..cap {
            a.done(id);
        }
        a.done(12345); // unknown ids are ignored
        assert_eq!(a.len(), 0);
        assert!(a.admit(cap, ip(2)).is_empty());
    }
}
