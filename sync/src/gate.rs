//! The ordering gate: one place where an op takes its turn.
//!
//! A communicator runs its ops one at a time, against one *core* (its
//! backend, device stream and sequence numbers), in the order they were
//! issued. Several threads may run a turn: the communicator's actor (the
//! *drainer*), or the caller that issued the op when nothing is ahead of
//! it (a *lent* turn: the op runs on the caller's thread or task instead of
//! waking the actor). The gate is the only way to the core, and it decides
//! who runs what, so that order holds whichever thread runs a turn.
//!
//! [`Gate::issue`] is called in the caller's program order. Under one lock
//! it either hands the core to the caller (nothing queued, the core at
//! home, no drain scheduled: [`Issue::Lend`]) or appends the op to the
//! queue ([`Issue::Queued`]). Whoever holds the core gives it back with
//! [`Gate::put_back`]; if ops queued up meanwhile, exactly one party is told
//! to wake the drainer, which takes them one at a time with
//! [`Gate::next`]. The drainer may also take the core out of turn to end
//! the communicator ([`Gate::take_now`], [`Gate::close`]): an abort never
//! waits behind queued ops.
//!
//! Costs: every operation is O(1) under one uncontended lock; the queue
//! holds the ops issued but not started (O(ops in flight), independent of
//! the number of ranks).
//!
//! # Invariants
//!
//! | tag | rule |
//! |-----|------|
//! | GT-1 | turns start in issue order: an op is lent only when the queue is empty, the core is at home and no drain is scheduled; a queued op starts only from the queue's front. |
//! | GT-2 | the core is held by at most one party (it is moved, never shared). |
//! | GT-3 | no lost wake-up: whenever the core is at home and the queue is not empty, a drain is scheduled (`scheduled`), and exactly one caller was told to wake the drainer for it. |
//! | GT-4 | a scheduled drain reserves the core for the drainer: no lend and no [`Gate::take_idle`] until the drainer runs [`Gate::next`]. |
//! | GT-5 | after [`Gate::close`] nothing is lent or queued again: [`Gate::issue`] returns the op, [`Gate::put_back`] returns the core. |
//!
//! The loom model in `tests/loom_gate.rs` checks these over issue, lend,
//! return, drain and close interleavings.

use std::collections::VecDeque;

use crate::sync::{lock, Mutex};

/// See the [module docs](self).
#[derive(Debug)]
pub struct Gate<C, R> {
    inner: Mutex<Inner<C, R>>,
}

#[derive(Debug)]
struct Inner<C, R> {
    /// The core, while nobody holds it.
    core: Option<C>,
    /// Issued, not started, in issue order.
    queue: VecDeque<R>,
    /// A drain is scheduled: the drainer was (or is about to be) woken and
    /// will call [`Gate::next`] (GT-3, GT-4).
    scheduled: bool,
    /// The drainer waits for the core to come back ([`Gate::take_now`]).
    wanted: bool,
    /// No more turns (GT-5).
    closed: bool,
}

/// What [`Gate::issue`] decided.
#[derive(Debug)]
pub enum Issue<C, R> {
    /// Nothing is ahead: run the op's turn now with the core, then
    /// [`Gate::put_back`] it.
    Lend(C, R),
    /// Queued behind earlier ops. `wake`: this caller must wake the drainer
    /// (GT-3); otherwise someone else will.
    Queued {
        /// Wake the drainer.
        wake: bool,
    },
    /// The gate is closed (GT-5): the op comes back, unrun.
    Closed(R),
}

/// What [`Gate::next`] gave the drainer.
#[derive(Debug)]
pub enum Next<C, R> {
    /// Run this op's turn with the core, then [`Gate::put_back`] it.
    Run(C, R),
    /// Nothing to do: the queue is empty, or the core is held by a lent
    /// turn whose return will schedule the drain again.
    Idle,
}

/// Whom [`Gate::put_back`] asks the returning party to wake.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[must_use]
pub struct Wake {
    /// Wake the drainer: a drain is scheduled (GT-3).
    pub drainer: bool,
    /// The drainer waits for the core in [`Gate::take_now`]: notify it.
    pub waiter: bool,
}

impl<C, R> Gate<C, R> {
    /// A gate holding `core`, with nothing queued.
    pub fn new(core: C) -> Gate<C, R> {
        let gate = Gate::empty();
        lock(&gate.inner).core = Some(core);
        gate
    }

    /// A gate whose core is not there yet: ops issued now queue, and
    /// [`Gate::put_back`] installs the core (scheduling their drain).
    pub fn empty() -> Gate<C, R> {
        Gate {
            inner: Mutex::new(Inner {
                core: None,
                queue: VecDeque::new(),
                scheduled: false,
                wanted: false,
                closed: false,
            }),
        }
    }

    /// Take `req`'s place in the order. Call it in program order. With
    /// `may_lend` false the op is always queued, for the drainer to run.
    pub fn issue(&self, req: R, may_lend: bool) -> Issue<C, R> {
        let mut g = lock(&self.inner);
        if g.closed {
            return Issue::Closed(req);
        }
        if may_lend && g.queue.is_empty() && !g.scheduled {
            if let Some(core) = g.core.take() {
                return Issue::Lend(core, req);
            }
        }
        g.queue.push_back(req);
        let wake = g.core.is_some() && !g.scheduled;
        if wake {
            g.scheduled = true;
        }
        Issue::Queued { wake }
    }

    /// The drainer's step, once per wake-up: the next queued op with the
    /// core, or [`Next::Idle`]. Consumes the scheduled drain.
    pub fn next(&self) -> Next<C, R> {
        let mut g = lock(&self.inner);
        g.scheduled = false;
        if g.closed || g.core.is_none() {
            // Held by a lent turn: its `put_back` schedules the drain.
            return Next::Idle;
        }
        match g.queue.pop_front() {
            Some(req) => match g.core.take() {
                Some(core) => Next::Run(core, req),
                None => {
                    g.queue.push_front(req);
                    Next::Idle
                }
            },
            None => Next::Idle,
        }
    }

    /// Give the core back after a turn. `reserve`: schedule a drain even
    /// with nothing queued (the turn left something for the drainer to
    /// handle, such as a fatal outcome). Returns whom to wake, or the core
    /// itself when the gate closed meanwhile (GT-5).
    pub fn put_back(&self, core: C, reserve: bool) -> Result<Wake, C> {
        let mut g = lock(&self.inner);
        if g.closed {
            return Err(core);
        }
        g.core = Some(core);
        let mut wake = Wake {
            waiter: std::mem::take(&mut g.wanted),
            drainer: false,
        };
        if (reserve || !g.queue.is_empty()) && !g.scheduled {
            g.scheduled = true;
            wake.drainer = true;
        }
        Ok(wake)
    }

    /// The core, if it is at home and idle: nothing queued, no drain
    /// scheduled (GT-4). For work between turns (polling a backend).
    pub fn take_idle(&self) -> Option<C> {
        let mut g = lock(&self.inner);
        if g.closed || g.scheduled || !g.queue.is_empty() {
            return None;
        }
        g.core.take()
    }

    /// The drainer takes the core out of turn (to end the communicator),
    /// whatever is queued; `None` while a turn holds it: the holder's
    /// [`Gate::put_back`] then tells it to notify the waiter.
    pub fn take_now(&self) -> Option<C> {
        let mut g = lock(&self.inner);
        let core = g.core.take();
        g.wanted = core.is_none() && !g.closed;
        core
    }

    /// Close the gate (GT-5): returns the core if it is at home, and every
    /// op still queued, in issue order, for the caller to refuse.
    pub fn close(&self) -> (Option<C>, VecDeque<R>) {
        let mut g = lock(&self.inner);
        g.closed = true;
        g.scheduled = false;
        g.wanted = false;
        (g.core.take(), std::mem::take(&mut g.queue))
    }

    /// Whether [`Gate::close`] was called.
    pub fn is_closed(&self) -> bool {
        lock(&self.inner).closed
    }
}

#[cfg(all(test, not(feature = "loom")))]
mod tests {
    use super::*;

    fn lend(g: &Gate<u8, u32>, op: u32) -> u8 {
        match g.issue(op, true) {
            Issue::Lend(c, r) => {
                assert_eq!(r, op);
                c
            }
            other => panic!("expected a lend, got {other:?}"),
        }
    }

    #[test]
    fn gt_1_an_idle_gate_lends_and_a_busy_one_queues() {
        let g: Gate<u8, u32> = Gate::new(7);
        let core = lend(&g, 1);
        // Held: the next op queues and nobody needs waking yet.
        assert!(matches!(g.issue(2, true), Issue::Queued { wake: false }));
        assert!(matches!(g.issue(3, true), Issue::Queued { wake: false }));
        // The holder returns the core: it must wake the drainer (GT-3).
        assert_eq!(
            g.put_back(core, false).unwrap(),
            Wake {
                drainer: true,
                waiter: false
            }
        );
        // Scheduled: a new op may not jump the queue (GT-4).
        assert!(matches!(g.issue(4, true), Issue::Queued { wake: false }));
        assert!(g.take_idle().is_none());
        let mut ran = vec![];
        while let Next::Run(c, r) = g.next() {
            ran.push(r);
            if !g.put_back(c, false).unwrap().drainer {
                break;
            }
        }
        assert_eq!(ran, vec![2, 3, 4]);
        // Drained: the next op is lent again.
        let core = lend(&g, 5);
        assert_eq!(g.put_back(core, false).unwrap(), Wake::default());
    }

    #[test]
    fn gt_3_an_op_that_may_not_be_lent_schedules_the_drain_once() {
        let g: Gate<u8, u32> = Gate::new(7);
        assert!(matches!(g.issue(1, false), Issue::Queued { wake: true }));
        assert!(matches!(g.issue(2, true), Issue::Queued { wake: false }));
        assert!(matches!(g.next(), Next::Run(7, 1)));
    }

    #[test]
    fn gt_5_close_refuses_what_is_queued_and_later() {
        let g: Gate<u8, u32> = Gate::new(7);
        let core = lend(&g, 1);
        let _ = g.issue(2, true);
        assert!(g.take_now().is_none());
        let (home, queued) = g.close();
        assert!(home.is_none());
        assert_eq!(queued, vec![2]);
        assert!(matches!(g.issue(3, true), Issue::Closed(3)));
        assert_eq!(g.put_back(core, false), Err(7));
    }

    #[test]
    fn take_now_is_told_when_the_core_returns() {
        let g: Gate<u8, u32> = Gate::new(7);
        let core = lend(&g, 1);
        assert!(g.take_now().is_none());
        let w = g.put_back(core, true).unwrap();
        assert!(w.waiter && w.drainer);
        assert_eq!(g.take_now(), Some(7));
    }
}
