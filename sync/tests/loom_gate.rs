//! Loom model of the ordering gate (`chorus_sync::gate`), as tokio models
//! its own primitives (`tokio/src/sync/tests/loom_*.rs`). Run with
//! `cargo test --release --features loom --test loom_gate`.
//!
//! The drainer is a thread that handles wake-ups from a channel, as the
//! communicator's actor handles its mailbox; a lent turn runs on the
//! issuing thread or on a spawned thread (a task on the caller's runtime).
//! Every model checks, over every interleaving loom explores, that turns
//! run in issue order (GT-1), that the core is never held twice (GT-2: it
//! is moved, so a second holder could not exist; the model counts the
//! turns), and that nothing queued is left behind (GT-3: no lost wake-up).
#![cfg(feature = "loom")]

use chorus_sync::gate::{Gate, Issue, Next, Wake};
use loom::sync::mpsc::{channel, Sender};
use loom::sync::{Arc, Mutex};
use loom::thread;

/// A wake-up for the drainer.
enum Msg {
    Run,
    Stop,
}

/// One communicator: the gate (core = a token, ops = numbers), the log of
/// turns in the order they ran, and the drainer's mailbox.
struct Comm {
    gate: Gate<u32, u32>,
    log: Mutex<Vec<u32>>,
    mailbox: Sender<Msg>,
}

impl Comm {
    /// A turn of `op`; the core token must be the one the gate was given.
    fn turn(&self, core: u32, op: u32) -> u32 {
        assert_eq!(core, 42, "a turn ran without the core");
        self.log.lock().unwrap().push(op);
        core
    }

    fn wake(&self, w: Wake) {
        if w.drainer {
            self.mailbox.send(Msg::Run).unwrap();
        }
    }

    /// Give the core back after a turn.
    fn put_back(&self, core: u32) {
        match self.gate.put_back(core, false) {
            Ok(w) => self.wake(w),
            Err(_) => panic!("the gate closed in a model that never closes it"),
        }
    }
}

/// Issue `op` as a caller does; a lent turn runs here, or on a spawned
/// thread when `spawn` (then its handle is returned).
fn issue(comm: &Arc<Comm>, op: u32, may_lend: bool, spawn: bool) -> Option<thread::JoinHandle<()>> {
    match comm.gate.issue(op, may_lend) {
        Issue::Lend(core, op) if spawn => {
            let me = comm.clone();
            Some(thread::spawn(move || {
                let core = me.turn(core, op);
                me.put_back(core);
            }))
        }
        Issue::Lend(core, op) => {
            let core = comm.turn(core, op);
            comm.put_back(core);
            None
        }
        Issue::Queued { wake } => {
            if wake {
                comm.mailbox.send(Msg::Run).unwrap();
            }
            None
        }
        Issue::Closed(_) => panic!("closed"),
    }
}

/// Wait for a lent turn that ran on a thread of its own (`.await` on its
/// `Work`).
fn join(turn: Option<thread::JoinHandle<()>>) {
    if let Some(t) = turn {
        t.join().unwrap();
    }
}

/// Start a communicator and its drainer thread.
fn start() -> (Arc<Comm>, thread::JoinHandle<()>) {
    let (tx, rx) = channel();
    let comm = Arc::new(Comm {
        gate: Gate::new(42),
        log: Mutex::new(Vec::new()),
        mailbox: tx,
    });
    let me = comm.clone();
    let drainer = thread::spawn(move || {
        let step = |me: &Comm| {
            if let Next::Run(core, op) = me.gate.next() {
                let core = me.turn(core, op);
                me.put_back(core);
            }
        };
        loop {
            match rx.recv().unwrap() {
                Msg::Run => step(&me),
                Msg::Stop => {
                    // Every other thread is done: what is left in the
                    // mailbox are the drainer's own follow-up wake-ups.
                    while let Ok(Msg::Run) = rx.try_recv() {
                        step(&me);
                    }
                    return;
                }
            }
        }
    });
    (comm, drainer)
}

/// Stop the drainer (after every wake-up sent before) and check the log.
fn finish(comm: Arc<Comm>, drainer: thread::JoinHandle<()>, want: &[u32]) {
    comm.mailbox.send(Msg::Stop).unwrap();
    drainer.join().unwrap();
    assert_eq!(*comm.log.lock().unwrap(), want, "turns out of issue order");
    // GT-3: nothing left queued, the core at home.
    assert!(comm.gate.take_idle().is_some(), "an op was left queued");
}

/// The issue's sequence: `a = async(); b = async(); a.await; c = async();
/// b.await; c.await` — a lent turn on a task, a queued op, then a new op
/// issued while the queued one may not have started yet.
#[test]
fn gt_1_three_ops_async_await_then_issue_run_in_order() {
    loom::model(|| {
        let (comm, drainer) = start();
        let a = issue(&comm, 1, true, true);
        let b = issue(&comm, 2, true, true);
        join(a);
        let c = issue(&comm, 3, true, true);
        join(b);
        join(c);
        finish(comm, drainer, &[1, 2, 3]);
    });
}

/// The blocking form: `a = async(); b = async(); a.await; c = blocking()`,
/// the blocking op lent to the caller's own thread.
#[test]
fn gt_1_a_blocking_op_never_overtakes_a_queued_one() {
    loom::model(|| {
        let (comm, drainer) = start();
        let a = issue(&comm, 1, true, true);
        issue(&comm, 2, true, false);
        join(a);
        issue(&comm, 3, true, false);
        finish(comm, drainer, &[1, 2, 3]);
    });
}

/// Issuing handed from one thread to another (program order across
/// threads), with an op that may not be lent (a split or a finalize) in
/// the middle.
#[test]
fn gt_3_issue_handed_between_threads_loses_no_wake_up() {
    loom::model(|| {
        let (comm, drainer) = start();
        let a = issue(&comm, 1, true, true);
        let me = comm.clone();
        let second = thread::spawn(move || {
            issue(&me, 2, false, false);
            issue(&me, 3, true, false);
        });
        second.join().unwrap();
        join(a);
        finish(comm, drainer, &[1, 2, 3]);
    });
}

/// An abort while a lent turn runs and an op is queued: the drainer takes
/// the core out of turn once it comes back, closes the gate, and refuses
/// what is queued; nothing runs after the close (GT-5).
#[test]
fn gt_5_close_while_lent_refuses_the_queue_and_gets_the_core_back() {
    loom::model(|| {
        let gate: Arc<Gate<u32, u32>> = Arc::new(Gate::new(42));
        let returned = Arc::new(loom::sync::Notify::new());
        let log = Arc::new(Mutex::new(Vec::new()));
        let lent = match gate.issue(1, true) {
            Issue::Lend(core, op) => (core, op),
            _ => panic!("an idle gate must lend"),
        };
        let (g, r, l) = (gate.clone(), returned.clone(), log.clone());
        let holder = thread::spawn(move || {
            let (core, op) = lent;
            l.lock().unwrap().push(op);
            match g.put_back(core, false) {
                Ok(w) if w.waiter => r.notify(),
                Ok(_) => {}
                Err(_) => {} // closed: the holder shuts the core down itself
            }
        });
        let (g, r, l) = (gate.clone(), returned.clone(), log.clone());
        let issuer = thread::spawn(move || match g.issue(2, true) {
            Issue::Lend(core, op) => {
                l.lock().unwrap().push(op);
                if let Ok(w) = g.put_back(core, false) {
                    if w.waiter {
                        r.notify();
                    }
                }
                false
            }
            _ => true,
        });
        // The drainer's abort: take the core, waiting for its return.
        let core = loop {
            if let Some(c) = gate.take_now() {
                break Some(c);
            }
            if gate.is_closed() {
                break None;
            }
            returned.wait();
        };
        let (home, queued) = gate.close();
        assert!(core.is_some() != home.is_some() || (core.is_none() && home.is_none()));
        let queued_or_refused = issuer.join().unwrap();
        holder.join().unwrap();
        // Op 2 was either lent after op 1 returned (and so ran after it),
        // or queued and refused by the close (or refused at issue), never
        // both, never lost.
        let ran = log.lock().unwrap().clone();
        if queued_or_refused {
            assert_eq!(ran, vec![1]);
            assert!(queued.len() <= 1);
        } else {
            assert_eq!(ran, vec![1, 2]);
            assert!(queued.is_empty());
        }
    });
}
