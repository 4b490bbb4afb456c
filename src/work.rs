//! [`Work`]: the handle of an operation in flight.
//!
//! Every request to a communicator gets exactly one completion ([WK-1]). The
//! executor holds a [`Completer`]; the user holds the [`Work`]. The completer
//! completes the work once; if it is dropped without completing (a bug, or
//! an actor that died), the work completes with an error instead of hanging
//! ([WK-2]).
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
//!
//! # Cancel safety
//! `Work` is a plain future over shared state: dropping it mid-poll loses
//! nothing but the result, and the op still completes ([WK-3]).
//!
//! [WK-1]: self#invariants
//! [WK-2]: self#invariants
//! [WK-3]: self#invariants

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::task::{Context, Poll, Waker};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::hooks::Tracked;
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

#[derive(Default)]
struct Slot {
    result: Option<Result<Completion>>,
    taken: bool,
    waker: Option<Waker>,
}

#[derive(Default)]
struct State {
    done: AtomicBool,
    slot: Mutex<Slot>,
    cv: Condvar,
    fence: Arc<FenceSlot>,
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

/// Where a backend publishes an op's [`StreamFence`] once the op is
/// enqueued (WK-4); closed when the op completes.
#[derive(Default)]
pub struct FenceSlot {
    m: Mutex<FenceState>,
    cv: Condvar,
}

impl std::fmt::Debug for FenceSlot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FenceSlot").finish_non_exhaustive()
    }
}

impl FenceSlot {
    fn state(&self) -> std::sync::MutexGuard<'_, FenceState> {
        self.m.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Publish the op's fence (ignored once the op completed).
    pub fn publish(&self, fence: Arc<dyn StreamFence>) {
        let mut st = self.state();
        if matches!(*st, FenceState::Pending) {
            *st = FenceState::Ready(fence);
        }
        self.cv.notify_all();
    }

    /// The op completed: no fence is needed any more (WK-4).
    fn close(&self) {
        *self.state() = FenceState::Closed;
        self.cv.notify_all();
    }
}

impl State {
    fn lock(&self) -> std::sync::MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The sending half: completes one [`Work`] exactly once.
pub(crate) struct Completer {
    state: Option<Arc<State>>,
    /// The op as its communicator's hooks and flight recorder follow it.
    tracked: Option<Box<Tracked>>,
}

impl std::fmt::Debug for Completer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completer")
            .field("pending", &self.state.is_some())
            .finish()
    }
}

impl Completer {
    /// The op's fence slot, for a backend to publish a fence in (WK-4).
    pub(crate) fn fence_slot(&self) -> Option<Arc<FenceSlot>> {
        self.state.as_ref().map(|s| s.fence.clone())
    }

    /// Have the observer follow this op (hooks, flight recorder).
    pub(crate) fn track(&mut self, tracked: Box<Tracked>) {
        self.tracked = Some(tracked);
    }

    /// The op's turn started, with sequence number `seq`.
    pub(crate) fn started(&mut self, seq: Option<u64>) {
        if let Some(t) = &mut self.tracked {
            t.started(seq);
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
        if let Some(t) = self.tracked.take() {
            (*t).finish(result.as_ref().map(|_| ()));
        }
        if let Some(state) = self.state.take() {
            state.fence.close();
            let waker = {
                let mut slot = state.lock();
                slot.result = Some(result);
                state.done.store(true, Ordering::Release);
                slot.waker.take()
            };
            state.cv.notify_all();
            if let Some(w) = waker {
                w.wake();
            }
        }
    }
}

impl Drop for Completer {
    fn drop(&mut self) {
        if self.state.is_some() {
            let me = Completer {
                state: self.state.take(),
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
    state: Arc<State>,
    map: fn(Completion) -> Result<T>,
}

impl<T> std::fmt::Debug for Work<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Work")
            .field("completed", &self.is_completed())
            .finish()
    }
}

impl<T> Work<T> {
    pub(crate) fn new(map: fn(Completion) -> Result<T>) -> (Work<T>, Completer) {
        let state = Arc::new(State::default());
        (
            Work {
                state: state.clone(),
                map,
            },
            Completer {
                state: Some(state),
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

    /// Whether the op has completed (successfully or not).
    pub fn is_completed(&self) -> bool {
        self.state.done.load(Ordering::Acquire)
    }

    fn take(&self, slot: &mut Slot) -> Result<T> {
        slot.taken = true;
        match slot.result.take() {
            Some(Ok(c)) => (self.map)(c),
            Some(Err(e)) => Err(e),
            None => Err(Error::Internal("work completion taken twice".into())),
        }
    }

    /// Block the calling thread until the op completes, and return its result.
    ///
    /// # Errors
    /// The op's error: see each collective's `# Errors` section.
    pub fn wait(self) -> Result<T> {
        let mut slot = self.state.lock();
        while slot.result.is_none() && !slot.taken {
            slot = self.state.cv.wait(slot).unwrap_or_else(|e| e.into_inner());
        }
        self.take(&mut slot)
    }

    /// Make the device stream `stream` wait for this op, TorchComms'
    /// `work.wait()` (WK-4). For an op on device memory issued through
    /// [`Comm::with_stream`](crate::Comm::with_stream), this blocks the
    /// host only until the op is enqueued on the communicator's stream,
    /// then orders `stream` after it (an event and `cudaStreamWaitEvent`):
    /// work queued on `stream` afterwards sees the op's results. For any
    /// other op it blocks until the op completed. Either way `.await` and
    /// [`Work::wait`] still mean "finished".
    ///
    /// # Errors
    /// [`Error::Internal`] if the runtime refuses the wait; an op's own
    /// failure is reported by `wait`/`.await`, not here.
    pub fn wait_stream(&self, stream: DeviceStream) -> Result<()> {
        let fence = {
            let slot = &self.state.fence;
            let mut st = slot.state();
            loop {
                match &*st {
                    FenceState::Pending => {
                        st = slot.cv.wait(st).unwrap_or_else(|e| e.into_inner());
                    }
                    FenceState::Ready(f) => break Some(f.clone()),
                    FenceState::Closed => break None,
                }
            }
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
    pub fn wait_timeout(self, timeout: Duration) -> std::result::Result<Result<T>, Work<T>> {
        let deadline = std::time::Instant::now() + timeout;
        let mut slot = self.state.lock();
        while slot.result.is_none() && !slot.taken {
            let now = std::time::Instant::now();
            if now >= deadline {
                drop(slot);
                return Err(self);
            }
            slot = self
                .state
                .cv
                .wait_timeout(slot, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
        Ok(self.take(&mut slot))
    }
}

impl<T> Future for Work<T> {
    type Output = Result<T>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        let this = self.get_mut();
        let mut slot = this.state.lock();
        if slot.result.is_some() || slot.taken {
            return Poll::Ready(this.take(&mut slot));
        }
        match &slot.waker {
            Some(w) if w.will_wake(cx.waker()) => {}
            _ => slot.waker = Some(cx.waker().clone()),
        }
        Poll::Pending
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
}
