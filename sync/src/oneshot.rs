//! A lock-free one-shot: one value, from one [`Sender`] to one
//! [`Receiver`], which may wait for it as a task (`poll_recv`) or as a
//! parked thread (`recv_blocking`, `recv_blocking_timeout`).
//!
//! It is what completes a `Work` in Chorus: a completion is one atomic
//! read-modify-write, plus a wake-up only when someone waits, so the common
//! case (an op done before anyone looks) makes no system call. The protocol
//! is that of tokio's `sync::oneshot`, cut down to one waiter and extended
//! to a waiter that is a thread.
//!
//! # Protocol
//! Shared state: one atomic word `state` and two cells, `value` (an
//! `Option<T>`) and `waiter` (an `Option` of a `Waker` or a `Thread`).
//! The bits of `state`:
//! - `WAITER`: `waiter` holds the receiver's waiter, and the sender may
//!   read it;
//! - `COMPLETE`: the sender is done: `value` holds the value, or nothing
//!   if the sender was dropped without sending (the one-shot is *closed*);
//! - `RX_CLOSED`: the receiver is gone.
//!
//! Sending writes `value`, then sets `COMPLETE` with one `AcqRel`
//! `fetch_or`, and wakes the waiter only if the word it replaced had
//! `WAITER` set. Waiting writes the waiter into `waiter` (while `WAITER`
//! is clear), then sets `WAITER` with one `AcqRel` `fetch_or`, and takes
//! the value at once if the word it replaced had `COMPLETE` set.
//!
//! # Invariants
//! - OS-1: `value` is written only by the sender, before it sets
//!   `COMPLETE`; the receiver reads it only after it has seen `COMPLETE`
//!   (acquire). The sender reads it back only when its `COMPLETE` RMW
//!   found `RX_CLOSED` (the receiver is gone and will not read it). So
//!   the two never access `value` at the same time.
//! - OS-2: `waiter` is written only by the receiver, and only while
//!   `WAITER` is clear and the sender therefore does not read it. The
//!   sender reads it (shared, to wake it by reference) only when the word
//!   its `COMPLETE` RMW replaced had `WAITER` set. To replace a waiter,
//!   the receiver first clears `WAITER` with an RMW; if that RMW finds
//!   `COMPLETE` already set, the sender may be reading the waiter right
//!   now, so the receiver leaves it alone (it is dropped with the shared
//!   state) and takes the value instead.
//! - OS-3: no lost wake-up: the receiver's `WAITER` RMW and the sender's
//!   `COMPLETE` RMW are on one word, so one comes first and the other sees
//!   its bit: either the sender sees `WAITER` and wakes the waiter, or
//!   the receiver sees `COMPLETE` and does not wait.
//! - OS-4: no wake-up without a waiter: a send that finds `WAITER` clear
//!   neither wakes nor unparks anything; a completion nobody waits for is
//!   one atomic RMW and makes no system call.
//! - OS-5: a wake-up without a value is harmless: `park` returning
//!   spuriously, an old waker firing or an unpark left over from an
//!   earlier wait only make the receiver look at `COMPLETE` again; it
//!   concludes from that bit alone.
//! - OS-6: the value is dropped exactly once: by the receiver that takes
//!   it, by the sender that gets it back, or with the shared state when
//!   the last of the two handles is dropped.
//! - OS-7: a blocking receive that times out withdraws its waiter (as in
//!   OS-2) and leaves the receiver usable; if withdrawing finds `COMPLETE`,
//!   it returns the value rather than a timeout.
//!
//! Every operation is O(1): a bounded number of atomic operations, no
//! loop but the park loop of a blocking receive.
//!
//! ```
//! # #[cfg(not(feature = "loom"))] { // loom's types only work inside a model
//! use chorus_sync::oneshot;
//!
//! let (tx, mut rx) = oneshot::channel();
//! let t = std::thread::spawn(move || tx.send(7).is_ok());
//! assert_eq!(rx.recv_blocking(), Some(7));
//! assert!(t.join().unwrap());
//! # }
//! ```

use std::fmt;
use std::task::{Context, Poll, Waker};
use std::time::{Duration, Instant};

use crate::sync::atomic::{AtomicUsize, Ordering};
use crate::sync::{thread, Arc, UnsafeCell};

/// `waiter` holds the receiver's waiter; the sender may read it (OS-2).
const WAITER: usize = 0b001;
/// The sender is done; `value` holds the value, or nothing (closed).
const COMPLETE: usize = 0b010;
/// The receiver was dropped.
const RX_CLOSED: usize = 0b100;

/// Who to wake when the value arrives.
enum Waiter {
    /// A task, woken through its waker.
    Task(Waker),
    /// A thread parked in a blocking receive.
    Thread(thread::Thread),
}

impl Waiter {
    fn wake(&self) {
        match self {
            Waiter::Task(w) => w.wake_by_ref(),
            Waiter::Thread(t) => t.unpark(),
        }
    }
}

struct Inner<T, S> {
    state: AtomicUsize,
    value: UnsafeCell<Option<T>>,
    waiter: UnsafeCell<Option<Waiter>>,
    /// What the two halves share besides the value ([`channel_with`]):
    /// set at creation, then only read through shared references.
    side: S,
}

// SAFETY: the cells are only accessed as the protocol allows (OS-1, OS-2):
// `value` by one side at a time, `waiter` written by the receiver only
// while the sender does not read it. A `T` moves from one thread to
// another, hence `T: Send`; `Waker` and `Thread` are `Send + Sync`.
// `side` is an ordinary field, shared as `&S`, hence `S: Send + Sync`.
unsafe impl<T: Send, S: Send + Sync> Send for Inner<T, S> {}
// SAFETY: as above; shared references only reach the cells through the
// protocol.
unsafe impl<T: Send, S: Send + Sync> Sync for Inner<T, S> {}

/// A timed receive ([`Receiver::recv_blocking_timeout`]) ran out of time
/// before the value arrived. The receiver is still usable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the value did not arrive within the timeout; the receiver can wait again")]
pub struct Elapsed;

/// The sending half: sends one value, or closes the one-shot when dropped
/// without sending.
pub struct Sender<T, S = ()> {
    inner: Option<Arc<Inner<T, S>>>,
}

/// The receiving half: waits for the value as a task or as a thread.
pub struct Receiver<T, S = ()> {
    inner: Arc<Inner<T, S>>,
}

impl<T, S> fmt::Debug for Sender<T, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Sender")
            .field("sent", &self.inner.is_none())
            .finish()
    }
}

impl<T, S> fmt::Debug for Receiver<T, S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Receiver")
            .field("complete", &self.is_complete())
            .finish()
    }
}

/// A new one-shot: its sending and receiving halves.
pub fn channel<T>() -> (Sender<T>, Receiver<T>) {
    channel_with(())
}

/// A new one-shot whose halves also share `side`, in the same allocation:
/// for state that lives exactly as long as the one-shot and that both
/// halves read ([`Sender::side`], [`Receiver::side`]), at no extra
/// allocation. `side` takes no part in the protocol; it is shared as any
/// `&S` is, so it synchronises itself where it needs to.
pub fn channel_with<T, S>(side: S) -> (Sender<T, S>, Receiver<T, S>) {
    let inner = Arc::new(Inner {
        state: AtomicUsize::new(0),
        value: UnsafeCell::new(None),
        waiter: UnsafeCell::new(None),
        side,
    });
    (
        Sender {
            inner: Some(inner.clone()),
        },
        Receiver { inner },
    )
}

impl<T, S> Inner<T, S> {
    /// Set `COMPLETE` and wake the waiter if there is one (OS-3, OS-4);
    /// the state word it replaced.
    fn complete(&self) -> usize {
        let prev = self.state.fetch_or(COMPLETE, Ordering::AcqRel);
        if prev & (WAITER | RX_CLOSED) == WAITER {
            // The receiver may act between the RMW and the read below.
            crate::sync::preemption_point();
            // SAFETY: OS-2: `WAITER` was set when `COMPLETE` was, so the
            // receiver no longer writes `waiter`; it may only read it.
            self.waiter.with(|w| unsafe {
                if let Some(w) = &*w {
                    w.wake();
                }
            });
        }
        prev
    }
}

impl<T, S> Sender<T, S> {
    /// What the halves share besides the value ([`channel_with`]).
    /// Always `Some` on a sender that can still send (only `send` and
    /// `drop` give the shared state up).
    pub fn side(&self) -> Option<&S> {
        self.inner.as_deref().map(|i| &i.side)
    }

    /// Send `value`, waking the receiver if it waits (and making no system
    /// call if it does not, OS-4).
    ///
    /// # Errors
    /// `Err(value)` if the receiver was dropped: the value is handed back.
    pub fn send(mut self, value: T) -> Result<(), T> {
        let Some(inner) = self.inner.take() else {
            return Err(value);
        };
        // SAFETY: OS-1: `COMPLETE` is not set yet (only this sender sets
        // it), so the receiver does not touch `value`.
        inner.value.with_mut(|v| unsafe { *v = Some(value) });
        let prev = inner.complete();
        if prev & RX_CLOSED != 0 {
            // SAFETY: OS-1: the receiver is gone and never reads `value`
            // again; its `RX_CLOSED` RMW was acquired by ours.
            if let Some(v) = inner.value.with_mut(|v| unsafe { (*v).take() }) {
                return Err(v);
            }
        }
        Ok(())
    }

    /// Whether the receiver was dropped (a send would hand the value
    /// back).
    pub fn is_closed(&self) -> bool {
        self.inner
            .as_ref()
            .is_none_or(|i| i.state.load(Ordering::Acquire) & RX_CLOSED != 0)
    }
}

impl<T, S> Drop for Sender<T, S> {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.take() {
            // Closed: complete with no value, waking a waiter.
            inner.complete();
        }
    }
}

impl<T, S> Receiver<T, S> {
    /// What the halves share besides the value ([`channel_with`]).
    pub fn side(&self) -> &S {
        &self.inner.side
    }

    /// Whether the sender is done (sent, or dropped without sending): one
    /// atomic load. Once true, a receive returns at once.
    pub fn is_complete(&self) -> bool {
        self.inner.state.load(Ordering::Acquire) & COMPLETE != 0
    }

    /// Take the value.
    ///
    /// Only after `COMPLETE` was seen with acquire ordering.
    fn take(&mut self) -> Option<T> {
        // SAFETY: OS-1: `COMPLETE` was seen, so the sender no longer
        // touches `value`, and `&mut self` excludes another receive.
        self.inner.value.with_mut(|v| unsafe { (*v).take() })
    }

    /// Make `waiter` the one the sender wakes (OS-2, OS-3), unless the
    /// registered one is already equivalent (`same`). `Ready` with the
    /// value if the sender completed meanwhile.
    fn register(
        &mut self,
        same: impl FnOnce(&Waiter) -> bool,
        waiter: impl FnOnce() -> Waiter,
    ) -> Poll<Option<T>> {
        let inner = &*self.inner;
        let state = inner.state.load(Ordering::Acquire);
        if state & COMPLETE != 0 {
            return Poll::Ready(self.take());
        }
        if state & WAITER != 0 {
            // SAFETY: OS-2: while `WAITER` is set only reads happen (ours
            // and the sender's), and only this receiver could write.
            let unchanged = inner
                .waiter
                .with(|w| unsafe { (*w).as_ref().is_some_and(same) });
            if unchanged {
                // The sender sees `WAITER` when it completes (OS-3).
                return Poll::Pending;
            }
            let prev = inner.state.fetch_and(!WAITER, Ordering::AcqRel);
            if prev & COMPLETE != 0 {
                // The sender saw `WAITER` and may be reading the waiter:
                // leave it, take the value.
                return Poll::Ready(self.take());
            }
        }
        // SAFETY: OS-2: `WAITER` is clear and `COMPLETE` was not set when
        // it was cleared, so the sender will not read `waiter`.
        inner.waiter.with_mut(|w| unsafe { *w = Some(waiter()) });
        let prev = inner.state.fetch_or(WAITER, Ordering::AcqRel);
        if prev & COMPLETE != 0 {
            return Poll::Ready(self.take());
        }
        Poll::Pending
    }

    /// Withdraw the waiter (OS-7): `Some(value)` if the sender completed
    /// meanwhile.
    fn withdraw(&mut self) -> Option<Option<T>> {
        let prev = self.inner.state.fetch_and(!WAITER, Ordering::AcqRel);
        if prev & COMPLETE != 0 {
            return Some(self.take());
        }
        if prev & WAITER != 0 {
            // SAFETY: OS-2: `WAITER` is now clear with `COMPLETE` unset, so
            // the sender will not read `waiter`.
            self.inner.waiter.with_mut(|w| unsafe { *w = None });
        }
        None
    }

    /// Poll for the value as a task: `Ready(Some(value))`, `Ready(None)`
    /// if the sender was dropped without sending (or the value was
    /// already received), else `Pending`, and the task's waker is woken
    /// when the sender completes. The waker of the latest poll is the one
    /// woken.
    pub fn poll_recv(&mut self, cx: &mut Context<'_>) -> Poll<Option<T>> {
        let waker = cx.waker();
        self.register(
            |w| matches!(w, Waiter::Task(old) if old.will_wake(waker)),
            || Waiter::Task(waker.clone()),
        )
    }

    /// Block the calling thread until the sender is done: `Some(value)`, or
    /// `None` if the sender was dropped without sending (or the value was
    /// already received).
    pub fn recv_blocking(&mut self) -> Option<T> {
        // Without a deadline there is no `Elapsed`.
        self.recv_until(None).unwrap_or_default()
    }

    /// [`Receiver::recv_blocking`], giving up after `timeout`.
    ///
    /// # Errors
    /// [`Elapsed`] if the sender is still not done after `timeout`; the
    /// receiver is left as it was, ready to wait again (OS-7).
    pub fn recv_blocking_timeout(&mut self, timeout: Duration) -> Result<Option<T>, Elapsed> {
        self.recv_until(Instant::now().checked_add(timeout))
    }

    fn recv_until(&mut self, deadline: Option<Instant>) -> Result<Option<T>, Elapsed> {
        if self.inner.state.load(Ordering::Acquire) & COMPLETE != 0 {
            return Ok(self.take());
        }
        let me = thread::current();
        let id = me.id();
        if let Poll::Ready(v) = self.register(
            |w| matches!(w, Waiter::Thread(t) if t.id() == id),
            || Waiter::Thread(me),
        ) {
            return Ok(v);
        }
        loop {
            match deadline {
                None => thread::park(),
                Some(deadline) => {
                    let now = Instant::now();
                    if now >= deadline {
                        return match self.withdraw() {
                            Some(v) => Ok(v),
                            None => Err(Elapsed),
                        };
                    }
                    crate::sync::park_timeout(deadline - now);
                }
            }
            // OS-5: conclude from `COMPLETE` alone.
            if self.inner.state.load(Ordering::Acquire) & COMPLETE != 0 {
                return Ok(self.take());
            }
        }
    }
}

impl<T, S> Drop for Receiver<T, S> {
    fn drop(&mut self) {
        // OS-1: from here on the sender may take the value back. A waiter
        // or a value left inside is dropped with the shared state (OS-6).
        self.inner.state.fetch_or(RX_CLOSED, Ordering::AcqRel);
    }
}

#[cfg(all(test, not(feature = "loom")))]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize as StdAtomicUsize;
    use std::sync::Arc as StdArc;
    use std::task::Wake;

    /// A waker that counts its wake-ups.
    #[derive(Default)]
    struct Count(StdAtomicUsize);

    impl Wake for Count {
        fn wake(self: StdArc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
        fn wake_by_ref(self: &StdArc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    }

    fn woken(c: &StdArc<Count>) -> usize {
        c.0.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// The side value is shared by both halves until the sender sends,
    /// and dropped once, with the last half (OS-6 holds for it too).
    #[test]
    fn the_side_value_is_shared_and_dropped_once() {
        struct Side(StdArc<StdAtomicUsize>);
        impl Drop for Side {
            fn drop(&mut self) {
                self.0.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            }
        }
        let drops = StdArc::new(StdAtomicUsize::new(0));
        let (tx, mut rx) = channel_with::<u8, _>(Side(drops.clone()));
        assert!(std::ptr::eq(tx.side().expect("before sending"), rx.side()));
        assert_eq!(tx.send(3), Ok(()));
        assert_eq!(rx.recv_blocking(), Some(3));
        assert_eq!(drops.load(std::sync::atomic::Ordering::SeqCst), 0);
        let _ = rx.side();
        drop(rx);
        assert_eq!(drops.load(std::sync::atomic::Ordering::SeqCst), 1);
    }

    #[test]
    fn os_4_send_without_a_waiter_wakes_nothing() {
        let (tx, mut rx) = channel();
        assert!(!rx.is_complete());
        tx.send(5u32).unwrap();
        assert!(rx.is_complete());
        assert_eq!(rx.recv_blocking(), Some(5));
        // Received once: the one-shot now reports nothing.
        assert_eq!(rx.recv_blocking(), None);
    }

    #[test]
    fn os_3_a_registered_task_is_woken_once_by_send() {
        let (tx, mut rx) = channel();
        let count = StdArc::new(Count::default());
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        assert!(rx.poll_recv(&mut cx).is_pending());
        assert!(rx.poll_recv(&mut cx).is_pending());
        assert_eq!(woken(&count), 0);
        tx.send("v").unwrap();
        assert_eq!(woken(&count), 1);
        assert_eq!(rx.poll_recv(&mut cx), Poll::Ready(Some("v")));
    }

    #[test]
    fn os_2_the_latest_waker_is_the_one_woken() {
        let (tx, mut rx) = channel();
        let (a, b) = (StdArc::new(Count::default()), StdArc::new(Count::default()));
        let (wa, wb) = (Waker::from(a.clone()), Waker::from(b.clone()));
        assert!(rx.poll_recv(&mut Context::from_waker(&wa)).is_pending());
        assert!(rx.poll_recv(&mut Context::from_waker(&wb)).is_pending());
        tx.send(1u8).unwrap();
        assert_eq!((woken(&a), woken(&b)), (0, 1));
    }

    #[test]
    fn dropped_sender_closes_the_one_shot() {
        let (tx, mut rx) = channel::<String>();
        let count = StdArc::new(Count::default());
        let waker = Waker::from(count.clone());
        assert!(rx.poll_recv(&mut Context::from_waker(&waker)).is_pending());
        drop(tx);
        assert_eq!(woken(&count), 1);
        assert!(rx.is_complete());
        assert_eq!(rx.recv_blocking(), None);
    }

    #[test]
    fn send_to_a_dropped_receiver_hands_the_value_back() {
        let (tx, rx) = channel();
        assert!(!tx.is_closed());
        drop(rx);
        assert!(tx.is_closed());
        assert_eq!(tx.send(vec![1, 2]), Err(vec![1, 2]));
    }

    #[test]
    fn os_6_a_value_never_received_is_dropped_once() {
        let value = StdArc::new(());
        let (tx, rx) = channel();
        tx.send(value.clone()).unwrap();
        assert_eq!(StdArc::strong_count(&value), 2);
        drop(rx);
        assert_eq!(StdArc::strong_count(&value), 1);
    }

    #[test]
    fn recv_blocking_waits_for_a_send_from_another_thread() {
        let (tx, mut rx) = channel();
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let t = std::thread::spawn(move || {
            // Sends only once the receiver is about to wait or waiting;
            // either way it must be woken.
            go_rx.recv().unwrap();
            tx.send(42u64).unwrap();
        });
        go_tx.send(()).unwrap();
        assert_eq!(rx.recv_blocking(), Some(42));
        t.join().unwrap();
    }

    #[test]
    fn os_7_timed_out_receiver_stays_usable() {
        let (tx, mut rx) = channel();
        assert_eq!(rx.recv_blocking_timeout(Duration::ZERO), Err(Elapsed));
        assert_eq!(
            rx.recv_blocking_timeout(Duration::from_millis(1)),
            Err(Elapsed)
        );
        let t = std::thread::spawn(move || tx.send(9i8).unwrap());
        assert_eq!(
            rx.recv_blocking_timeout(Duration::from_secs(60)),
            Ok(Some(9))
        );
        t.join().unwrap();
    }

    #[test]
    fn recv_blocking_after_a_poll_replaces_the_task_waker() {
        let (tx, mut rx) = channel();
        let count = StdArc::new(Count::default());
        let waker = Waker::from(count.clone());
        assert!(rx.poll_recv(&mut Context::from_waker(&waker)).is_pending());
        let t = std::thread::spawn(move || tx.send(3u16).unwrap());
        assert_eq!(rx.recv_blocking(), Some(3));
        t.join().unwrap();
    }

    #[test]
    fn many_rounds_across_threads_never_lose_a_wake_up() {
        for i in 0..2_000u32 {
            let (tx, mut rx) = channel();
            let t = std::thread::spawn(move || tx.send(i).unwrap());
            assert_eq!(rx.recv_blocking(), Some(i));
            t.join().unwrap();
        }
    }
}
