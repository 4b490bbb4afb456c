//! The completion thread of one NCCL/RCCL communicator: it finds when an
//! op finished on the device, so that no op polls the stream from the
//! thread that runs its turn (a tokio sleep costs at least a timer tick,
//! about 1 ms, per op).
//!
//! The backend enqueues an op's calls on the communicator's stream, then
//! submits it and awaits the returned oneshot. The
//! thread, which set the communicator's device once when it started, waits
//! for a non-blocking enqueue to settle (`ncclCommGetAsyncError` no longer
//! `ncclInProgress`), records an event (`*EventCreateWithFlags` with
//! `*EventDisableTiming`, `*EventRecord`) after the op on the stream, and
//! queries it with a short spin, then yields, then short sleeps, polling
//! `ncclCommGetAsyncError` meanwhile: a remote failure or an abort
//! completes the op with an error instead of leaving it waiting.
//!
//! # Invariants
//! - XT-1: one thread per communicator; it touches the NCCL communicator
//!   only through `ncclCommGetAsyncError` (thread-safe) and the stream only
//!   through event calls, and stopping it joins it, so the
//!   backend calls `ncclCommAbort`/`ncclCommDestroy` only once the thread
//!   has let go of the communicator. Stop runs at finalize, abort and drop;
//!   [`live_completion_threads`] counts threads not yet ended.
//! - XT-2: every submitted op gets one answer: `Ok` once its event
//!   completed and the communicator reports no error, else the error; an op
//!   still waiting when the thread stops gets a "stopped" error (its
//!   receiver sees the sender dropped).

use std::collections::VecDeque;
use std::ffi::c_int;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Duration;

use super::result::{self, CallError};
use super::{sys, Vendor};

/// Completion threads started and not yet ended, in this process.
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// Completion threads of `nccl`/`rccl` communicators that have not ended
/// yet in this process (XT-1): finalize, abort and drop end them.
pub fn live_completion_threads() -> usize {
    LIVE.load(Ordering::Acquire)
}

/// The answer to one submitted op (XT-2).
pub(super) type Done = tokio::sync::oneshot::Receiver<std::result::Result<(), CallError>>;

struct Job {
    /// `ncclComm_t` and stream, as integers (only used as handles).
    comm: usize,
    stream: usize,
    /// Where to publish a fence after the op, for `Work::wait_stream`.
    fence: Option<Arc<crate::FenceSlot>>,
    done: tokio::sync::oneshot::Sender<std::result::Result<(), CallError>>,
}

struct Queue {
    jobs: Mutex<VecDeque<Job>>,
    cv: Condvar,
    stop: AtomicBool,
}

/// One communicator's completion thread (XT-1).
pub(super) struct CompletionThread {
    queue: Arc<Queue>,
    handle: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for CompletionThread {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CompletionThread")
            .field("running", &self.handle.is_some())
            .finish()
    }
}

/// Decrements [`LIVE`] when the thread ends, however it ends.
struct Alive;

impl Drop for Alive {
    fn drop(&mut self) {
        LIVE.fetch_sub(1, Ordering::AcqRel);
    }
}

impl CompletionThread {
    /// Start the thread for a communicator on `device`; it sets the device
    /// once, and reports a failure to do so here.
    pub(super) fn start(
        api: Arc<Vendor>,
        device: c_int,
        name: &str,
    ) -> std::result::Result<CompletionThread, CallError> {
        let queue = Arc::new(Queue {
            jobs: Mutex::new(VecDeque::new()),
            cv: Condvar::new(),
            stop: AtomicBool::new(false),
        });
        let (ready_tx, ready_rx) = std::sync::mpsc::sync_channel(1);
        let q = queue.clone();
        LIVE.fetch_add(1, Ordering::AcqRel);
        let spawned = std::thread::Builder::new()
            .name(format!("xccl-done-{name}"))
            .spawn(move || {
                let _alive = Alive;
                // SAFETY: plain runtime call on this thread.
                let r = unsafe { (api.rt.set_device)(device) };
                let set = result::rt(&api.rt, "SetDevice", r);
                let ok = set.is_ok();
                let _ = ready_tx.send(set);
                if ok {
                    run(&api, device, &q);
                }
            });
        let handle = match spawned {
            Ok(h) => h,
            Err(e) => {
                LIVE.fetch_sub(1, Ordering::AcqRel);
                return Err(CallError {
                    call: "spawn completion thread",
                    code: 0,
                    nccl: false,
                    message: e.to_string(),
                });
            }
        };
        let mut me = CompletionThread {
            queue,
            handle: Some(handle),
        };
        match ready_rx.recv() {
            Ok(Ok(())) => Ok(me),
            Ok(Err(e)) => {
                me.stop();
                Err(e)
            }
            Err(_) => {
                me.stop();
                Err(CallError {
                    call: "completion thread",
                    code: 0,
                    nccl: false,
                    message: "ended before it started".into(),
                })
            }
        }
    }

    /// Wait (on the thread) for the op just enqueued on `stream` of `comm`.
    pub(super) fn submit(
        &self,
        comm: sys::ncclComm_t,
        stream: sys::Stream,
        fence: Option<Arc<crate::FenceSlot>>,
    ) -> Done {
        let (tx, rx) = tokio::sync::oneshot::channel();
        let job = Job {
            comm: comm as usize,
            stream: stream as usize,
            fence,
            done: tx,
        };
        if self.handle.is_some() && !self.queue.stop.load(Ordering::Acquire) {
            lock(&self.queue.jobs).push_back(job);
            self.queue.cv.notify_all();
        }
        // Else `job` (and its sender) is dropped: the op sees "stopped".
        rx
    }

    /// Stop and join the thread (XT-1); idempotent. Ops still waiting get
    /// "stopped" (XT-2).
    pub(super) fn stop(&mut self) {
        self.queue.stop.store(true, Ordering::Release);
        self.queue.cv.notify_all();
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
        lock(&self.queue.jobs).clear();
    }
}

impl Drop for CompletionThread {
    fn drop(&mut self) {
        self.stop();
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Spin, then yield, then sleep a little longer each time (up to 100 µs).
struct Backoff(u32);

impl Backoff {
    fn snooze(&mut self) {
        self.0 = self.0.saturating_add(1);
        match self.0 {
            0..=64 => {
                for _ in 0..32 {
                    std::hint::spin_loop();
                }
            }
            65..=256 => std::thread::yield_now(),
            n => std::thread::sleep(Duration::from_micros(u64::from((n - 256).min(100)))),
        }
    }
}

/// The thread's loop: one job at a time, in submission order.
fn run(api: &Arc<Vendor>, device: c_int, q: &Queue) {
    let mut pool: Vec<sys::Event> = Vec::new();
    loop {
        let job = {
            let mut jobs = lock(&q.jobs);
            loop {
                if q.stop.load(Ordering::Acquire) {
                    break None;
                }
                if let Some(j) = jobs.pop_front() {
                    break Some(j);
                }
                jobs = q.cv.wait(jobs).unwrap_or_else(|p| p.into_inner());
            }
        };
        let Some(job) = job else { break };
        let r = wait_op(api, device, q, &job, &mut pool);
        let _ = job.done.send(r);
    }
    for ev in pool {
        // SAFETY: created on this thread's device; no record pending on it.
        let _ = unsafe { (api.rt.event_destroy)(ev) };
    }
}

fn stopped() -> CallError {
    CallError {
        call: "completion thread",
        code: 0,
        nccl: false,
        message: "stopped (the communicator was aborted or finalized)".into(),
    }
}

/// Settle, record an event, wait for it (XT-2).
fn wait_op(
    api: &Arc<Vendor>,
    device: c_int,
    q: &Queue,
    job: &Job,
    pool: &mut Vec<sys::Event>,
) -> std::result::Result<(), CallError> {
    let comm = job.comm as sys::ncclComm_t;
    let mut b = Backoff(0);
    // A non-blocking enqueue is on the stream once the communicator settled.
    // SAFETY (every async_error below): the communicator lives until the
    // backend stopped this thread (XT-1).
    while !unsafe { result::async_error(&api.nccl, comm)? } {
        if q.stop.load(Ordering::Acquire) {
            return Err(stopped());
        }
        b.snooze();
    }
    let ev = match pool.pop() {
        Some(ev) => ev,
        None => {
            let mut ev: sys::Event = std::ptr::null_mut();
            // SAFETY: out-parameter call on this thread's device.
            let r = unsafe { (api.rt.event_create_with_flags)(&mut ev, sys::EVENT_DISABLE_TIMING) };
            result::rt(&api.rt, "EventCreateWithFlags", r)?;
            ev
        }
    };
    let out = (|| {
        // SAFETY: event of this device, stream of the communicator (same
        // device), alive while the job is.
        let r = unsafe { (api.rt.event_record)(ev, job.stream as sys::Stream) };
        result::rt(&api.rt, "EventRecord", r)?;
        if let Some(slot) = &job.fence {
            slot.publish(Arc::new(EventFence::record(api, device, job.stream)?));
        }
        let mut b = Backoff(0);
        loop {
            // SAFETY: live event.
            match unsafe { (api.rt.event_query)(ev) } {
                0 => break,
                sys::RT_NOT_READY => {}
                e => result::rt(&api.rt, "EventQuery", e)?,
            }
            // SAFETY: as above (XT-1).
            unsafe { result::async_error(&api.nccl, comm)? };
            if q.stop.load(Ordering::Acquire) {
                return Err(stopped());
            }
            b.snooze();
        }
        // A stream can drain because NCCL gave up on a failed peer: the
        // async error decides whether the op succeeded.
        // SAFETY: as above (XT-1).
        unsafe { result::async_error(&api.nccl, comm) }.map(|_| ())
    })();
    match &out {
        // Reusable: its last record completed.
        Ok(()) => pool.push(ev),
        // SAFETY: destroying an event with work pending is allowed (the
        // runtime releases it once that work completed).
        Err(_) => {
            let _ = unsafe { (api.rt.event_destroy)(ev) };
        }
    }
    out
}

/// An event recorded after an op, for [`Work::wait_stream`](crate::Work::wait_stream)
/// (XC-10); destroyed when the op's `Work` is done with it.
struct EventFence {
    api: Arc<Vendor>,
    device: c_int,
    ev: sys::Event,
}

// SAFETY: an event handle, used only through the thread-safe runtime calls
// below, with the device set.
unsafe impl Send for EventFence {}
// SAFETY: as above.
unsafe impl Sync for EventFence {}

impl EventFence {
    /// Create an event on the calling thread's device (the completion
    /// thread's, the communicator's) and record it on `stream`.
    fn record(
        api: &Arc<Vendor>,
        device: c_int,
        stream: usize,
    ) -> std::result::Result<EventFence, CallError> {
        let mut ev: sys::Event = std::ptr::null_mut();
        // SAFETY: out-parameter call on this thread's device.
        let r = unsafe { (api.rt.event_create_with_flags)(&mut ev, sys::EVENT_DISABLE_TIMING) };
        result::rt(&api.rt, "EventCreateWithFlags", r)?;
        let me = EventFence {
            api: api.clone(),
            device,
            ev,
        };
        // SAFETY: live event and stream of the same device.
        let r = unsafe { (api.rt.event_record)(ev, stream as sys::Stream) };
        result::rt(&api.rt, "EventRecord", r)?;
        Ok(me)
    }
}

impl crate::StreamFence for EventFence {
    fn wait_on(&self, stream: crate::DeviceStream) -> std::result::Result<(), String> {
        let rt = &self.api.rt;
        let _dev = super::DeviceGuard::set(rt, self.device).map_err(|e| e.to_string())?;
        // SAFETY: live event; the caller's stream (`DeviceStream::from_raw`).
        let r = unsafe { (rt.stream_wait_event)(stream.as_raw(), self.ev, 0) };
        result::rt(rt, "StreamWaitEvent", r).map_err(|e| e.to_string())
    }
}

impl Drop for EventFence {
    fn drop(&mut self) {
        // SAFETY: created by `record`, destroyed once; pending work on it
        // is allowed (the runtime frees it once that completed).
        let _ = unsafe { (self.api.rt.event_destroy)(self.ev) };
    }
}
