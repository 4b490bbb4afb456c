//! [`Work`]: the handle of an operation in flight.
//!
//! Every request to a communicator gets exactly one completion ([WK-1]). The
//! executor holds a [`Completer`]; the user holds the [`Work`]. The completer
//! completes the work once; if it is dropped without completing (a bug, or
//! an actor that died), the work completes with an error instead of hanging
//! ([WK-2]).
//!
//! The completion travels through a lock-free one-shot
//! ([`chorus_sync::oneshot`], model-checked with loom): completing is one
//! atomic read-modify-write, and wakes a task or unparks a thread only if
//! one is waiting ([WK-5]).
//!
//! # Invariants
//! - WK-1: a `Work` completes exactly once; `wait()`, `.await` and
//!   `is_completed()` observe the same completion.
//! - WK-2: a dropped `Completer` completes its `Work` with `Error::Internal`.
//! - WK-3: dropping a `Work` does not cancel the op; it still runs to completion
//!   in order, and its result is discarded.
//! - WK-4: [`Work::wait_stream`] never blocks the host until the op
//!   finished when the backend published a fence for it (an op on device
//!   memory issued through [`Comm::with_stream`](crate::Comm::with_stream)):
//!   it waits only until the op was enqueued, then makes the stream wait.
//!   Once the work completed, the fence is dropped and `wait_stream` has
//!   nothing left to order.
//! - WK-5: a completion that nobody waits for makes no system call: no
//!   wake-up, no unpark, no condition-variable notify (the fence slot
//!   counts its waiters and notifies only when there are some).
//!   `is_completed()` is one atomic load.
//! - WK-6: the blocking waits (`wait`, `wait_timeout`, `wait_stream`) never
//!   block a worker of a tokio runtime in a way that stops its other tasks
//!   (the op's own turn may be one of them, queued on that very worker):
//!   on a multi-thread runtime they wait inside
//!   [`tokio::task::block_in_place`], on a current-thread runtime they
//!   refuse with [`Error::WouldBlock`] (see [`crate::runtime`]).
//! - WK-7: `wait`, `wait_timeout` and `.await` return an op's result only
//!   after its hooks have run (the hook ticket of HK-6 in
//!   [`crate::hooks`]), except when called from inside a hook, and for
//!   the ops Chorus issues and waits for inside another (`split`'s
//!   agreement). A blocking
//!   wait may run the communicator's queued hooks itself (so
//!   `wait_timeout` can overrun its timeout by a slow hook); `.await` never
//!   does. `is_completed()` reports the op itself.
//!
//! # Cancel safety
//! `Work` is a plain future over shared state: dropping it mid-poll loses
//! nothing but the result, and the op still completes ([WK-3]).
//!
//! [WK-1]: self#invariants
//! [WK-2]: self#invariants
//! [WK-3]: self#invariants
//! [WK-5]: self#invariants

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use chorus_sync::oneshot;

use crate::error::{Error, Result};
use crate::hooks::{on_hook_thread, HookTicket, Tracked};
use crate::tensor::Tensor;

/// What an op produces.
#[derive(Debug)]
pub(crate) enum Completion {
    /// Nothing (barrier).
    Unit,
    /// One tensor.
    Tensor(Tensor),
    /// Several tensors.
    Tensors(Vec<Tensor>),
    /// What a window op produced.
    Window(crate::backends::WindowDone),
}

/// A device stream handle: a raw `cudaStream_t` / `hipStream_t`, for
/// [`Comm::with_stream`](crate::Comm::with_stream) and
/// [`Work::wait_stream`]. Chorus never creates or destroys it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DeviceStream(usize);

impl DeviceStream {
    /// Wrap a raw stream (e.g. cudarc's `CudaStream::cu_stream()`, or
    /// PyTorch's `torch.cuda.current_stream().cuda_stream`).
    ///
    /// # Safety
    /// `raw` must be a stream of the communicator's device and runtime
    /// (the CUDA runtime for `nccl`, HIP for `rccl`; `0` is the legacy
    /// default stream), and stay valid while ops issued with it are being
    /// enqueued and while `wait_stream` calls on it run.
    pub unsafe fn from_raw(raw: *mut std::ffi::c_void) -> DeviceStream {
        DeviceStream(raw as usize)
    }

    /// The raw stream.
    pub fn as_raw(self) -> *mut std::ffi::c_void {
        self.0 as *mut std::ffi::c_void
    }
}

/// Makes a device stream wait for an op that is enqueued (an event
/// recorded after it). Published by a backend into the op's
/// [`FenceSlot`].
pub trait StreamFence: Send + Sync {
    /// Make `stream` wait for the op, without blocking the host.
    ///
    /// # Errors
    /// The runtime's reason.
    fn wait_on(&self, stream: DeviceStream) -> std::result::Result<(), String>;
}

#[derive(Default)]
enum FenceState {
    #[default]
    Pending,
    Ready(Arc<dyn StreamFence>),
    Closed,
}

#[derive(Default)]
struct Fence {
    state: FenceState,
    /// Threads blocked in `wait_stream` on this slot (WK-5: no notify
    /// without one).
    waiters: usize,
}

/// Where a backend publishes an op's [`StreamFence`] once the op is
/// enqueued (WK-4); closed when the op completes.
///
/// A mutex and a condition variable: only `wait_stream` on an op still
/// being enqueued (the rare device path) ever waits here, and publishing
/// or closing notifies only when a waiter is counted (WK-5).
#[derive(Default)]
pub struct FenceSlot {
    m: Mutex<Fence>,
    cv: Condvar,
}

impl std::fmt::Debug for FenceSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FenceSlot").finish_non_exhaustive()
    }
}

impl FenceSlot {
    fn lock(&self) -> std::sync::MutexGuard<'_, Fence> {
        self.m.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publish the op's fence (ignored once the op completed).
    pub fn publish(&self, fence: Arc<dyn StreamFence>) {
        let mut f = self.lock();
        if matches!(f.state, FenceState::Pending) {
            f.state = FenceState::Ready(fence);
        }
        let wake = f.waiters > 0;
        drop(f);
        if wake {
            self.cv.notify_all();
        }
    }

    /// The op completed: no fence is needed any more (WK-4).
    fn close(&self) {
        let mut f = self.lock();
        f.state = FenceState::Closed;
        let wake = f.waiters > 0;
        drop(f);
        if wake {
            self.cv.notify_all();
        }
    }

    /// The fence, `None` once closed; `Err(())` while the op is still
    /// being enqueued.
    fn try_get(&self) -> std::result::Result<Option<Arc<dyn StreamFence>>, ()> {
        match &self.lock().state {
            FenceState::Pending => Err(()),
            FenceState::Ready(f) => Ok(Some(f.clone())),
            FenceState::Closed => Ok(None),
        }
    }

    /// Block until the fence is published or the slot closed.
    fn wait(&self) -> Option<Arc<dyn StreamFence>> {
        let mut f = self.lock();
        loop {
            match &f.state {
                FenceState::Pending => {
                    // Counted under the lock, so a publish or close sees
                    // this waiter before it decides whether to notify.
                    f.waiters += 1;
                    f = self.cv.wait(f).unwrap_or_else(|e| e.into_inner());
                    f.waiters -= 1;
                }
                FenceState::Ready(fence) => return Some(fence.clone()),
                FenceState::Closed => return None,
            }
        }
    }
}

/// What a [`Completer`] sends: the op's result, and the ticket of its hooks
/// when it has some (WK-7).
struct Done {
    result: Result<Completion>,
    hooks: Option<HookTicket>,
}

/// The sending half: completes one [`Work`] exactly once.
pub(crate) struct Completer {
    tx: Option<oneshot::Sender<Done, FenceSlot>>,
    /// The fence slot of an op ordered with a device stream, which the
    /// backend may keep past the turn; `None` for other ops, whose slot
    /// lives in the one-shot's allocation (one allocation fewer per op).
    fence: Option<Arc<FenceSlot>>,
    /// The op as its communicator's hooks and flight recorder follow it.
    tracked: Option<Tracked>,
}

impl std::fmt::Debug for Completer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completer")
            .field("pending", &self.tx.is_some())
            .finish()
    }
}

impl Completer {
    /// The op's fence slot, for a backend to publish a fence in (WK-4).
    /// `None` once completed, and for a work made without one
    /// ([`Work::new`] rather than [`Work::ordered`]).
    pub(crate) fn fence_slot(&self) -> Option<Arc<FenceSlot>> {
        self.tx.as_ref().and(self.fence.clone())
    }

    /// Have the observer follow this op (hooks, flight recorder).
    pub(crate) fn track(&mut self, tracked: Tracked) {
        self.tracked = Some(tracked);
    }

    /// When the op was issued, if an observer recorded it.
    pub(crate) fn issued(&self) -> Option<std::time::Instant> {
        self.tracked.as_ref().map(|t| t.issued)
    }

    /// The op's turn started at `now`, with sequence number `seq`.
    pub(crate) fn started(&mut self, seq: Option<u64>, now: std::time::Instant) {
        if let Some(t) = &mut self.tracked {
            t.started(seq, now);
        }
    }

    /// Record, ahead of completing it, that the op fails with `error`.
    pub(crate) fn failing(&self, error: &Error) {
        if let Some(t) = &self.tracked {
            t.failed(error);
        }
    }

    /// Complete the work. The observer hears of it first.
    pub(crate) fn complete(mut self, result: Result<Completion>) {
        let hooks = self
            .tracked
            .take()
            .and_then(|t| t.finish(result.as_ref().map(|_| ())));
        if let Some(tx) = self.tx.take() {
            if let Some(slot) = self.fence.as_deref().or(tx.side()) {
                slot.close();
            }
            // `Err` hands the result back when the `Work` was dropped: it
            // is discarded (WK-3).
            let _ = tx.send(Done { result, hooks });
        }
    }
}

impl Drop for Completer {
    fn drop(&mut self) {
        if self.tx.is_some() {
            let me = Completer {
                tx: self.tx.take(),
                fence: self.fence.take(),
                tracked: self.tracked.take(),
            };
            me.complete(Err(Error::Internal(
                "operation dropped by the communicator without a completion".into(),
            )));
        }
    }
}

/// An operation in flight. Wait for it with [`Work::wait`] (blocking) or
/// `.await` (any executor); poll it with [`Work::is_completed`].
///
/// ```
/// # use chorus::{new_comm, CommOptions, Device, ReduceOp, Tensor};
/// let comm = new_comm("cpu", Device::Cpu, "doc-work", CommOptions::single())?;
/// let work = comm.all_reduce_async(Tensor::full(1.0f32, 4), ReduceOp::Sum);
/// let out = work.wait()?;
/// assert_eq!(out.to_vec::<f32>(), vec![1.0; 4]);
/// # Ok::<(), chorus::Error>(())
/// ```
#[must_use = "a Work does nothing unless waited on; dropping it discards the result"]
pub struct Work<T> {
    rx: oneshot::Receiver<Done, FenceSlot>,
    /// The result, received, while its hooks still run (WK-7).
    held: Option<Box<(Result<Completion>, HookTicket)>>,
    /// Chorus's own awaits of an op it issued (the agreement inside
    /// `split`): they need the result, not the hooks, and may run where a
    /// hook waits for them.
    skip_hooks: bool,
    /// The stream-ordered op's own fence slot (see [`Completer`]); else
    /// the one in the one-shot.
    fence: Option<Arc<FenceSlot>>,
    map: fn(Completion) -> Result<T>,
}

impl<T> std::fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("completed", &self.is_completed())
            .finish()
    }
}

/// The user's result from what the one-shot delivered.
fn finish<T>(map: fn(Completion) -> Result<T>, got: Option<Result<Completion>>) -> Result<T> {
    match got {
        Some(Ok(c)) => map(c),
        Some(Err(e)) => Err(e),
        // A `Completer` always sends, even when dropped (WK-2); `None`
        // means the result was already taken (a future polled after it
        // returned `Ready`).
        None => Err(Error::Internal(
            "work completion taken twice (a Work polled after it completed)".into(),
        )),
    }
}

impl<T> Work<T> {
    /// A work and its completer: one allocation, the one-shot, which
    /// also holds the fence slot `wait_stream` looks at.
    pub(crate) fn new(map: fn(Completion) -> Result<T>) -> (Work<T>, Completer) {
        Work::with_fence(map, None)
    }

    /// A work for an op ordered with a device stream: its fence slot is an
    /// `Arc` of its own, which the backend may hold past the turn
    /// ([`Completer::fence_slot`]).
    pub(crate) fn ordered(map: fn(Completion) -> Result<T>) -> (Work<T>, Completer) {
        Work::with_fence(map, Some(Arc::new(FenceSlot::default())))
    }

    fn with_fence(
        map: fn(Completion) -> Result<T>,
        fence: Option<Arc<FenceSlot>>,
    ) -> (Work<T>, Completer) {
        let (tx, rx) = oneshot::channel_with(FenceSlot::default());
        (
            Work {
                rx,
                held: None,
                skip_hooks: false,
                fence: fence.clone(),
                map,
            },
            Completer {
                tx: Some(tx),
                fence,
                tracked: None,
            },
        )
    }

    /// A work that is already complete with `result`.
    pub(crate) fn ready(map: fn(Completion) -> Result<T>, result: Result<Completion>) -> Work<T> {
        let (w, c) = Work::new(map);
        c.complete(result);
        w
    }

    /// Whether the op has completed (successfully or not): one atomic load.
    /// Its hooks may still be running (WK-7): `wait` waits for them.
    pub fn is_completed(&self) -> bool {
        self.held.is_some() || self.rx.is_complete()
    }

    /// Take the completion out of the one-shot once it is there: the result
    /// now, or held while its hooks still run (then `None`). Off a hook
    /// thread only; there the ticket is ignored.
    fn take_ready(&mut self, got: Option<Done>) -> Option<Option<Result<Completion>>> {
        match got {
            None => Some(None),
            Some(Done {
                result,
                hooks: Some(ticket),
            }) if !ticket.is_complete() && !self.skip_hooks && !on_hook_thread() => {
                self.held = Some(Box::new((result, ticket)));
                None
            }
            Some(done) => Some(Some(done.result)),
        }
    }

    /// This work, completing as soon as its op does, without waiting for
    /// its hooks: for Chorus's own waits on an op it issued inside another
    /// (a hook may be waiting for that other op).
    pub(crate) fn skip_hooks(mut self) -> Work<T> {
        self.skip_hooks = true;
        self
    }

    /// Receive the result, blocking, after its hooks (WK-7).
    fn recv_blocking(&mut self) -> Option<Result<Completion>> {
        if self.held.is_none() {
            let got = self.rx.recv_blocking();
            if let Some(ready) = self.take_ready(got) {
                return ready;
            }
        }
        let (result, mut ticket) = *self.held.take()?;
        ticket.wait();
        Some(result)
    }

    /// Whether a blocking wait can take the result here without going
    /// through [`crate::runtime::blocking`], because it will not block: the
    /// op has completed and this is not a current-thread runtime. (There
    /// `runtime::blocking` refuses, completed or not, so that whether a
    /// `wait` is refused never depends on timing.) On a worker of a
    /// multi-thread runtime this saves `block_in_place`'s hand-off of the
    /// worker to another thread, for an op whose turn finished in its
    /// first poll.
    fn done_here(&self) -> bool {
        use tokio::runtime::{Handle, RuntimeFlavor};
        let done = match &self.held {
            Some(held) => held.1.is_complete(),
            None => self.rx.is_complete(),
        };
        done && !matches!(
            Handle::try_current(),
            Ok(h) if h.runtime_flavor() == RuntimeFlavor::CurrentThread
        )
    }

    /// Block the calling thread until the op completes, and return its result.
    ///
    /// On a worker of a multi-thread tokio runtime it waits inside
    /// [`tokio::task::block_in_place`], so the worker's other tasks (the
    /// op's own turn may be one of them) move to another thread and keep
    /// running (WK-6). In async code, prefer `work.await`.
    ///
    /// # Errors
    /// The op's error: see each collective's `# Errors` section.
    /// [`Error::WouldBlock`] on a current-thread tokio runtime, whose only
    /// thread would stop (and with it, possibly, the op): await the `Work`
    /// there instead. The op itself still runs (WK-3).
    pub fn wait(mut self) -> Result<T> {
        if self.done_here() && self.held.is_none() {
            let got = self.rx.recv_blocking();
            if let Some(ready) = self.take_ready(got) {
                return finish(self.map, ready);
            }
            // Its hooks are still running: block below.
        }
        crate::runtime::blocking("Work::wait", || {
            let got = self.recv_blocking();
            finish(self.map, got)
        })
    }

    /// Make the device stream `stream` wait for this op, TorchComms'
    /// `work.wait()` (WK-4). For an op on device memory issued through
    /// [`Comm::with_stream`](crate::Comm::with_stream), this blocks the
    /// host only until the op is enqueued on the communicator's stream,
    /// then orders `stream` after it (an event and `cudaStreamWaitEvent`):
    /// work queued on `stream` afterwards sees the op's results. For any
    /// other op it blocks until the op completed. Either way `.await` and
    /// [`Work::wait`] still mean "finished". When it must block, it
    /// blocks as [`Work::wait`] does (WK-6).
    ///
    /// # Errors
    /// [`Error::Internal`] if the runtime refuses the wait; an op's own
    /// failure is reported by `wait`/`.await`, not here.
    /// [`Error::WouldBlock`] if it would have to block on a current-thread
    /// tokio runtime (await the `Work` first there: then it returns at
    /// once).
    pub fn wait_stream(&self, stream: DeviceStream) -> Result<()> {
        let slot = self.fence.as_deref().unwrap_or(self.rx.side());
        let fence = match slot.try_get() {
            Ok(fence) => fence,
            Err(()) => crate::runtime::blocking("Work::wait_stream", || Ok(slot.wait()))?,
        };
        match fence {
            Some(f) => f
                .wait_on(stream)
                .map_err(|e| Error::Internal(format!("wait_stream: {e}"))),
            None => Ok(()),
        }
    }

    /// Like [`Work::wait`], but give up after `timeout`, returning the work
    /// back so it can be waited on again.
    ///
    /// On a current-thread tokio runtime it returns
    /// `Ok(Err(Error::WouldBlock))` at once (WK-6): await the `Work` there,
    /// bounded with `tokio::time::timeout`.
    pub fn wait_timeout(mut self, timeout: Duration) -> std::result::Result<Result<T>, Work<T>> {
        if self.done_here() && self.held.is_none() {
            let got = self.rx.recv_blocking();
            if let Some(ready) = self.take_ready(got) {
                return Ok(finish(self.map, ready));
            }
        }
        let deadline = std::time::Instant::now() + timeout;
        let waited = crate::runtime::blocking("Work::wait_timeout", || {
            if self.held.is_none() {
                match self.rx.recv_blocking_timeout(timeout) {
                    Ok(got) => {
                        if let Some(ready) = self.take_ready(got) {
                            return Ok(Ok(ready));
                        }
                    }
                    Err(e) => return Ok(Err(e)),
                }
            }
            let Some(held) = &mut self.held else {
                return Ok(Ok(None));
            };
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if held.1.wait_timeout(left) {
                Ok(Ok(self.held.take().map(|held| held.0)))
            } else {
                Ok(Err(oneshot::Elapsed))
            }
        });
        match waited {
            Ok(Ok(got)) => Ok(finish(self.map, got)),
            Ok(Err(oneshot::Elapsed)) => Err(self),
            Err(e) => Ok(Err(e)),
        }
    }
}

impl<T> Future for Work<T> {
    type Output = Result<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        let this = self.get_mut();
        if this.held.is_none() {
            match this.rx.poll_recv(cx) {
                Poll::Ready(got) => {
                    if let Some(ready) = this.take_ready(got) {
                        return Poll::Ready(finish(this.map, ready));
                    }
                }
                Poll::Pending => return Poll::Pending,
            }
        }
        let Some(held) = &mut this.held else {
            return Poll::Ready(finish(this.map, None));
        };
        match held.1.poll(cx) {
            Poll::Ready(()) => Poll::Ready(finish(this.map, this.held.take().map(|held| held.0))),
            Poll::Pending => Poll::Pending,
        }
    }
}

pub(crate) fn to_unit(c: Completion) -> Result<()> {
    match c {
        Completion::Unit => Ok(()),
        other => Err(Error::Internal(format!(
            "expected no output, got {other:?}"
        ))),
    }
}

pub(crate) fn to_tensor(c: Completion) -> Result<Tensor> {
    match c {
        Completion::Tensor(t) => Ok(t),
        other => Err(Error::Internal(format!("expected a tensor, got {other:?}"))),
    }
}

pub(crate) fn to_tensors(c: Completion) -> Result<Vec<Tensor>> {
    match c {
        Completion::Tensors(t) => Ok(t),
        // A batch of one point-to-point transfer completes with its buffer.
        Completion::Tensor(t) => Ok(vec![t]),
        other => Err(Error::Internal(format!("expected tensors, got {other:?}"))),
    }
}

/// `[output, input]` of an `_into` op, as `(output, input)`.
pub(crate) fn to_pair(c: Completion) -> Result<(Tensor, Tensor)> {
    match c {
        Completion::Tensors(v) if v.len() == 2 => {
            let mut it = v.into_iter();
            match (it.next(), it.next()) {
                (Some(out), Some(input)) => Ok((out, input)),
                _ => Err(Error::Internal("expected two tensors".into())),
            }
        }
        other => Err(Error::Internal(format!(
            "expected two tensors, got {other:?}"
        ))),
    }
}

/// `outputs ++ inputs` of a list `_into` op (two lists of equal length),
/// as `(outputs, inputs)`.
pub(crate) fn to_lists(c: Completion) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
    match c {
        Completion::Tensors(mut v) if v.len() % 2 == 0 => {
            let inputs = v.split_off(v.len() / 2);
            Ok((v, inputs))
        }
        other => Err(Error::Internal(format!(
            "expected two lists of tensors, got {other:?}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropped_completer_completes_work_with_internal_error() {
        let (w, c) = Work::new(to_unit);
        drop(c);
        assert!(w.is_completed());
        assert!(matches!(w.wait(), Err(Error::Internal(_))));
    }

    #[test]
    fn wait_blocks_until_completed_from_another_thread() {
        let (w, c) = Work::new(to_tensor);
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(10));
            c.complete(Ok(Completion::Tensor(Tensor::full(3i32, 2))));
        });
        assert_eq!(w.wait().unwrap().to_vec::<i32>(), vec![3, 3]);
        t.join().unwrap();
    }

    #[test]
    fn wait_timeout_returns_the_work_back() {
        let (w, c) = Work::new(to_unit);
        let w = w.wait_timeout(Duration::from_millis(5)).unwrap_err();
        assert!(!w.is_completed());
        c.complete(Ok(Completion::Unit));
        assert!(w.wait_timeout(Duration::from_secs(5)).unwrap().is_ok());
    }

    /// Run `f` on a thread of its own and return its result, failing the
    /// test if it takes longer than a minute: a regression that hangs
    /// fails instead of hanging the suite.
    fn within<R: Send + 'static>(what: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let _ = tx.send(f());
        });
        match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(r) => r,
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                panic!("{what} did not finish within a minute (a blocked worker?)")
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("{what} panicked"),
        }
    }

    fn runtime(workers: usize) -> tokio::runtime::Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(workers)
            .enable_all()
            .build()
            .expect("runtime")
    }

    /// WK-6: the completing task is spawned from the waiting task, so it
    /// sits in that worker's LIFO slot, which no other worker steals; a
    /// `wait` that blocked the worker without `block_in_place` would never
    /// let it run. One and two workers.
    #[test]
    fn wk_6_wait_inside_a_task_lets_the_task_that_completes_it_run() {
        for workers in [1, 2] {
            let got = within("Work::wait inside a task", move || {
                runtime(workers).block_on(async {
                    tokio::spawn(async {
                        let (w, c) = Work::new(to_tensor);
                        tokio::spawn(async move {
                            c.complete(Ok(Completion::Tensor(Tensor::full(5u8, 3))));
                        });
                        w.wait()
                    })
                    .await
                    .expect("task")
                })
            });
            assert_eq!(got.expect("wait").to_vec::<u8>(), vec![5; 3]);
        }
    }

    /// WK-6 for the bounded wait: the same setting, through `wait_timeout`.
    #[test]
    fn wk_6_wait_timeout_inside_a_task_lets_the_task_that_completes_it_run() {
        let got = within("Work::wait_timeout inside a task", || {
            runtime(1).block_on(async {
                tokio::spawn(async {
                    let (w, c) = Work::new(to_unit);
                    tokio::spawn(async move { c.complete(Ok(Completion::Unit)) });
                    w.wait_timeout(Duration::from_secs(3600))
                        .is_ok_and(|r| r.is_ok())
                })
                .await
                .expect("task")
            })
        });
        assert!(got, "wait_timeout did not return the completion");
    }

    /// WK-6: on a current-thread runtime the blocking waits refuse at once
    /// with `WouldBlock`, whose message names the fix; `wait_timeout`
    /// refuses inside `Ok`, and `.await` then gets the result.
    #[test]
    fn wk_6_wait_on_a_current_thread_runtime_is_refused_naming_the_fix() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let (w, c) = Work::new(to_unit);
            match w.wait() {
                Err(e @ Error::WouldBlock { op: "Work::wait" }) => {
                    let msg = e.to_string();
                    assert!(msg.contains("await the Work instead"), "{msg}");
                }
                other => panic!("expected WouldBlock, got {other:?}"),
            }
            drop(c);

            // Refused even when already complete: never a matter of timing.
            let w = Work::ready(to_unit, Ok(Completion::Unit));
            assert!(w.is_completed());
            assert!(matches!(w.wait(), Err(Error::WouldBlock { .. })));

            let (w, c) = Work::new(to_unit);
            match w.wait_timeout(Duration::from_secs(3600)) {
                Ok(Err(Error::WouldBlock {
                    op: "Work::wait_timeout",
                })) => {}
                other => panic!("expected Ok(Err(WouldBlock)), got {other:?}"),
            }
            c.complete(Ok(Completion::Unit));

            let (w, c) = Work::new(to_unit);
            let done = tokio::spawn(async move { c.complete(Ok(Completion::Unit)) });
            w.await.expect("awaited");
            done.await.expect("completer task");
        });
    }

    /// WK-1: a `Work` polled once (its waker registered), then waited on
    /// from a plain thread, gets the completion; so does `.await` after a
    /// timed-out `wait_timeout`.
    #[test]
    fn wk_1_poll_then_wait_and_timeout_then_await_see_one_completion() {
        let (mut w, c) = Work::new(to_tensor);
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(Pin::new(&mut w).poll(&mut cx).is_pending());
        let t = std::thread::spawn(move || {
            c.complete(Ok(Completion::Tensor(Tensor::full(1i64, 1))));
        });
        assert_eq!(w.wait().expect("wait").to_vec::<i64>(), vec![1]);
        t.join().expect("completer thread");

        let (w, c) = Work::new(to_unit);
        let w = w
            .wait_timeout(Duration::ZERO)
            .expect_err("nothing completed it yet");
        c.complete(Ok(Completion::Unit));
        assert!(w.is_completed());
        within("await after a timed-out wait", move || {
            futures::executor::block_on(w).expect("awaited")
        });
    }

    struct RecordFence(Mutex<Vec<DeviceStream>>);

    impl StreamFence for RecordFence {
        fn wait_on(&self, stream: DeviceStream) -> std::result::Result<(), String> {
            self.0
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(stream);
            Ok(())
        }
    }

    /// WK-4: `wait_stream` blocked on an op still being enqueued returns
    /// once the fence is published, and orders the stream with it; after
    /// completion there is nothing to order.
    #[test]
    fn wk_4_wait_stream_waits_for_the_fence_then_orders_the_stream() {
        let (w, c) = Work::ordered(to_unit);
        let slot = c.fence_slot().expect("a pending op has a fence slot");
        let fence = Arc::new(RecordFence(Mutex::new(Vec::new())));
        // SAFETY: the fake fence only records the stream; it is never used.
        let stream = unsafe { DeviceStream::from_raw(std::ptr::null_mut()) };
        let waiter = std::thread::spawn(move || {
            w.wait_stream(stream).expect("wait_stream");
            w
        });
        slot.publish(fence.clone());
        let w = within("wait_stream", move || waiter.join().expect("waiter"));
        assert_eq!(*fence.0.lock().expect("fence"), vec![stream]);
        c.complete(Ok(Completion::Unit));
        w.wait_stream(stream).expect("closed fence");
        assert_eq!(fence.0.lock().expect("fence").len(), 1);
    }

    /// WK-4 for an op not ordered with a stream: no slot is handed to a
    /// backend, and `wait_stream` (on the slot inside the one-shot) blocks
    /// until the op completed, leaving its result to `wait`.
    #[test]
    fn wk_4_wait_stream_on_an_unordered_op_waits_for_its_completion() {
        let (w, c) = Work::new(to_unit);
        assert!(c.fence_slot().is_none());
        // SAFETY: no fence is ever published, so the stream is never used.
        let stream = unsafe { DeviceStream::from_raw(std::ptr::null_mut()) };
        let (tx, rx) = std::sync::mpsc::channel();
        let waiter = std::thread::spawn(move || {
            let r = w.wait_stream(stream);
            let _ = tx.send(());
            (r, w)
        });
        // Still blocked while the op runs.
        assert!(rx.recv_timeout(Duration::from_millis(50)).is_err());
        c.complete(Ok(Completion::Unit));
        let (r, w) = within("wait_stream", move || waiter.join().expect("waiter"));
        r.expect("wait_stream after completion");
        w.wait().expect("the result is still there");
    }
}
