//! Loom models of the one-shot (`src/oneshot.rs`): every interleaving of
//! its atomic operations, cell accesses, parks and wake-ups, for each race
//! the completion of a `Work` can meet. A lost wake-up shows as a loom
//! deadlock, a racy cell access as a loom causality error, a leak or a
//! double drop as a failed drop count or a leaked loom `Arc`.
//!
//! Run with `cargo test --release --features loom` in `sync/`.
#![cfg(feature = "loom")]

use std::future::poll_fn;
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use chorus_sync::oneshot::{self, Elapsed};
use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::Arc;
use loom::thread;

/// Counts its drops, to pin that a value is dropped exactly once (OS-6).
struct Tracked(Arc<AtomicUsize>);

impl Drop for Tracked {
    fn drop(&mut self) {
        self.0.fetch_add(1, Ordering::SeqCst);
    }
}

/// OS-3: a send racing a task's poll wakes the task, or the poll sees the
/// value; `block_on` deadlocks if neither happens.
#[test]
fn os_3_send_races_a_task_poll() {
    loom::model(|| {
        let (tx, mut rx) = oneshot::channel();
        let sender = thread::spawn(move || tx.send(1u32).is_ok());
        let got = loom::future::block_on(poll_fn(|cx| rx.poll_recv(cx)));
        assert_eq!(got, Some(1));
        assert!(sender.join().unwrap());
    });
}

/// OS-3, OS-5: a send racing a blocking receiver unparks it, or the
/// receiver sees the value before it parks.
#[test]
fn os_3_send_races_a_blocking_receiver() {
    loom::model(|| {
        let (tx, mut rx) = oneshot::channel();
        let sender = thread::spawn(move || tx.send(2u32).is_ok());
        assert_eq!(rx.recv_blocking(), Some(2));
        assert!(sender.join().unwrap());
    });
}

/// OS-2: the task's waker changes between polls (a first poll with
/// another waker, then `block_on`'s) while the send races both polls: the
/// waker replaced under the sender's nose is never used after it is
/// dropped, and the latest one is woken.
#[test]
fn os_2_waker_replaced_between_polls_while_send_races() {
    loom::model(|| {
        let (tx, mut rx) = oneshot::channel();
        let sender = thread::spawn(move || tx.send(3u32).is_ok());
        let first = rx.poll_recv(&mut Context::from_waker(Waker::noop()));
        let got = match first {
            Poll::Ready(v) => v,
            Poll::Pending => loom::future::block_on(poll_fn(|cx| rx.poll_recv(cx))),
        };
        assert_eq!(got, Some(3));
        assert!(sender.join().unwrap());
    });
}

/// OS-2: a task waker registered first, then a blocking receive on the
/// same receiver (a `Work` polled once, then waited on), racing the send.
#[test]
fn os_2_poll_then_blocking_receive_while_send_races() {
    loom::model(|| {
        let (tx, mut rx) = oneshot::channel();
        let sender = thread::spawn(move || tx.send(4u32).is_ok());
        let got = match rx.poll_recv(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(v) => v,
            Poll::Pending => rx.recv_blocking(),
        };
        assert_eq!(got, Some(4));
        assert!(sender.join().unwrap());
    });
}

/// A sender dropped without sending closes the one-shot and wakes the
/// waiting task: `None`, never a hang.
#[test]
fn sender_dropped_unsent_wakes_a_task_with_none() {
    loom::model(|| {
        let (tx, mut rx) = oneshot::channel::<u32>();
        let sender = thread::spawn(move || drop(tx));
        let got = loom::future::block_on(poll_fn(|cx| rx.poll_recv(cx)));
        assert_eq!(got, None);
        sender.join().unwrap();
    });
}

/// As above, for a parked thread.
#[test]
fn sender_dropped_unsent_unparks_a_blocking_receiver_with_none() {
    loom::model(|| {
        let (tx, mut rx) = oneshot::channel::<u32>();
        let sender = thread::spawn(move || drop(tx));
        assert_eq!(rx.recv_blocking(), None);
        sender.join().unwrap();
    });
}

/// OS-6: a receiver dropped while the value is sent: the value is dropped
/// exactly once, by the sender (handed back) or with the shared state, and
/// nothing leaks (loom checks its `Arc`s at the end of each run).
#[test]
fn os_6_receiver_dropped_with_a_value_inside() {
    loom::model(|| {
        let drops = Arc::new(AtomicUsize::new(0));
        let (tx, rx) = oneshot::channel();
        let value = Tracked(drops.clone());
        let sender = thread::spawn(move || tx.send(value).is_ok());
        drop(rx);
        let _delivered = sender.join().unwrap();
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    });
}

/// OS-6 with a waiter registered: a task polled once, then the receiver
/// dropped while the send races; the waker and the value are each dropped
/// once.
#[test]
fn os_6_receiver_dropped_after_registering_a_waker() {
    loom::model(|| {
        let drops = Arc::new(AtomicUsize::new(0));
        let (tx, mut rx) = oneshot::channel();
        let value = Tracked(drops.clone());
        let sender = thread::spawn(move || tx.send(value).is_ok());
        match rx.poll_recv(&mut Context::from_waker(Waker::noop())) {
            Poll::Ready(v) => assert!(v.is_some()),
            Poll::Pending => drop(rx),
        }
        let _delivered = sender.join().unwrap();
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    });
}

/// OS-7: a timed receive that times out while the send races withdraws
/// its thread and leaves the receiver usable; a later blocking receive
/// still gets the value.
#[test]
fn os_7_timed_out_receive_racing_send_leaves_the_receiver_usable() {
    loom::model(|| {
        let (tx, mut rx) = oneshot::channel();
        let sent = Arc::new(AtomicUsize::new(0));
        let sender = {
            let sent = sent.clone();
            thread::spawn(move || {
                let ok = tx.send(5u32).is_ok();
                sent.store(1 + usize::from(ok), Ordering::Release);
            })
        };
        let got = match rx.recv_blocking_timeout(Duration::ZERO) {
            Ok(v) => v,
            Err(Elapsed) => rx.recv_blocking(),
        };
        assert_eq!(got, Some(5));
        // Not `join()` yet: when the withdrawal found the value, the
        // sender may still unpark this thread (harmless, OS-5), and loom
        // would take that unpark for the end of a join.
        while sent.load(Ordering::Acquire) == 0 {
            thread::yield_now();
        }
        assert_eq!(sent.load(Ordering::Acquire), 2);
        sender.join().unwrap();
    });
}
