//! Hooks: user callbacks that observe a communicator's ops and its abort,
//! like TorchComms' `register_pre_hook`, `register_post_hook` and
//! `register_abort_hook`.
//!
//! Every op issued on a communicator (every call that returned a `Work`
//! not already failed by argument checks) gets a process-wide, increasing
//! *op id* when it is issued. Pre hooks are called with it and the op's
//! description ([`PreHookArgs`]); post hooks with the same id, how long the
//! op took and its result ([`PostHookArgs`]); abort hooks once, with the
//! cause, when the communicator is aborted ([`AbortHookArgs`]).
//!
//! Hooks never run on a thread that runs or owns the communicator's core.
//! Each communicator with hooks queues its events, in the order they
//! happened, for a hook thread of its own (`chorus-hooks`, started with the
//! first event). Waiting for an op ([`crate::Work`]'s `wait`,
//! `wait_timeout` and `.await`) returns only after the op's pre and post
//! hooks ran, as TorchComms calls them around the op on the caller's side;
//! a blocking waiter runs the queued events itself, in order, when the hook
//! thread is not running one (a hand-off to a sleeping thread and back
//! costs two context switches). A slow hook delays its own communicator's
//! waits, never another communicator. A wait from inside a hook does not
//! wait for hooks. A hook that panics is caught and logged (`tracing`
//! error), and the op is unaffected.
//! A binding whose own hooks run on the caller's side, before an op is
//! issued, gives the op the id its hooks saw with [`reserve_op_id`] and
//! [`with_op_id`] (the Python package does, so its pre hooks can see the
//! op's tensors and stop the op by raising).
//! Registering returns a [`RemovableHandle`]; dropping it or calling
//! [`RemovableHandle::remove`] unregisters the hook.
//!
//! This module also holds the per-communicator `Observer` that the
//! completion path (`crate::work`) reports to: hooks and the flight
//! recorder ([`crate::flight_recorder`]).
//!
//! # Invariants
//!
//! | tag | rule |
//! |-----|------|
//! | HK-1 | each issued op is reported once to the pre hooks (when issued) and once to the post hooks (when completed), with the same op id, the pre call first; a communicator's events reach the hooks in the order they happened. |
//! | HK-2 | with no hook registered and the flight recorder off, issuing an op costs one atomic load and an empty check, and nothing is allocated. |
//! | HK-3 | abort hooks are called once per communicator, with the cause, before the ops still outstanding are failed; the abort waits for them at most [`ABORT_HOOK_DEADLINE`]. |
//! | HK-4 | once [`RemovableHandle::remove`] returned (or the handle was dropped), the hook is not called again, except for a call already running. |
//! | HK-5 | a panicking hook is caught and logged; it never reaches an op, a caller or the hook thread. |
//! | HK-6 | an op whose pre or post hooks were sent completes its `Work` with a ticket, signalled once they ran; waiting for the `Work`, except from inside a hook, also waits for the ticket. Each communicator's events are queued apart and run one at a time in order (by its hook thread or a waiter holding the queue's runner lock), so a ticket never waits behind another communicator's hooks. |
//! | HK-7 | an op issued inside [`with_op_id`] on that thread, the first one to be observed, takes the reserved id; every other op takes the next id of the process-wide sequence; a reservation never outlives its scope. |

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, OnceLock, RwLock, Weak};
use std::time::{Duration, Instant};

use chorus_sync::serial::SerialQueue;

use crate::error::Error;
use crate::flight_recorder::{DumpId, FlightRecorder, OpDesc};
use crate::hints::Hints;
use crate::tensor::DType;

/// How long an aborting communicator waits for its abort hooks.
pub const ABORT_HOOK_DEADLINE: Duration = Duration::from_secs(2);

/// What a pre hook sees: an op, when it is issued.
#[derive(Debug, Clone)]
pub struct PreHookArgs {
    /// Process-wide and increasing, in issue order (per issuing thread).
    pub op_id: u64,
    /// The op's name (`all_reduce`, `send`, `recv`, `batch_p2p`, ...).
    pub op: &'static str,
    /// The communicator's name.
    pub comm: String,
    /// This rank.
    pub rank: usize,
    /// Element type.
    pub dtype: DType,
    /// This rank's element count (for point-to-point, of all transfers).
    pub count: usize,
    /// This rank's payload in bytes.
    pub bytes: usize,
    /// The root of a rooted collective.
    pub root: Option<usize>,
    /// The peers of a point-to-point op (empty for collectives).
    pub peers: Vec<usize>,
    /// The [`crate::hints::TAG`] hint of the handle that issued it.
    pub tag: Option<String>,
    /// Every hint of the handle that issued it.
    pub hints: Arc<BTreeMap<String, String>>,
}

/// What a post hook sees: an op, when it completed.
#[derive(Debug, Clone)]
pub struct PostHookArgs {
    /// The op id its pre hook saw.
    pub op_id: u64,
    /// The op's name.
    pub op: &'static str,
    /// The communicator's name.
    pub comm: String,
    /// This rank.
    pub rank: usize,
    /// Its sequence number, if its turn started (see
    /// [`crate::FlightEntry::seq`]).
    pub seq: Option<u64>,
    /// From issue to completion.
    pub duration: Duration,
    /// From the start of its turn to completion; `None` if it never ran
    /// (failed while queued).
    pub run_duration: Option<Duration>,
    /// What the op's `Work` completes with (without the buffers).
    pub result: Result<(), Error>,
}

/// What an abort hook sees.
#[derive(Debug, Clone)]
pub struct AbortHookArgs {
    /// The communicator's name.
    pub comm: String,
    /// This rank.
    pub rank: usize,
    /// The communicator's epoch.
    pub epoch: u64,
    /// Why it is aborted.
    pub cause: Error,
}

type PreFn = dyn Fn(&PreHookArgs) + Send + Sync;
type PostFn = dyn Fn(&PostHookArgs) + Send + Sync;
type AbortFn = dyn Fn(&AbortHookArgs) + Send + Sync;

#[derive(Debug, Clone, Copy)]
enum Kind {
    Pre,
    Post,
    Abort,
}

/// One communicator's registered hooks.
#[derive(Default)]
pub(crate) struct HookSet {
    /// How many hooks are registered, of any kind.
    count: AtomicUsize,
    /// How many of each kind ([`Kind`] as index): an event nobody listens
    /// to is not sent to the hook thread (each send may wake it, ~µs).
    per_kind: [AtomicUsize; 3],
    next: AtomicU64,
    pre: RwLock<Vec<(u64, Arc<PreFn>)>>,
    post: RwLock<Vec<(u64, Arc<PostFn>)>>,
    abort: RwLock<Vec<(u64, Arc<AbortFn>)>>,
    /// This communicator's events not yet run, made with its hook thread
    /// by the first event. O(events not yet run).
    queue: OnceLock<Arc<HookQueue>>,
}

impl Drop for HookSet {
    fn drop(&mut self) {
        if let Some(q) = self.queue.get() {
            q.close();
        }
    }
}

fn read<T: Clone>(l: &RwLock<Vec<(u64, T)>>) -> Vec<T> {
    l.read()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .map(|(_, f)| f.clone())
        .collect()
}

fn remove_id<T>(l: &RwLock<Vec<(u64, T)>>, id: u64) -> bool {
    let mut v = l.write().unwrap_or_else(|e| e.into_inner());
    let before = v.len();
    v.retain(|(i, _)| *i != id);
    v.len() != before
}

impl HookSet {
    fn is_empty(&self) -> bool {
        self.count.load(Ordering::Acquire) == 0
    }

    fn add(self: &Arc<Self>, kind: Kind, push: impl FnOnce(u64)) -> RemovableHandle {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        push(id);
        self.per_kind[kind as usize].fetch_add(1, Ordering::AcqRel);
        self.count.fetch_add(1, Ordering::AcqRel);
        RemovableHandle {
            set: Arc::downgrade(self),
            kind,
            id,
        }
    }

    pub(crate) fn add_pre(self: &Arc<Self>, f: Arc<PreFn>) -> RemovableHandle {
        self.add(Kind::Pre, |id| {
            self.pre
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .push((id, f))
        })
    }

    pub(crate) fn add_post(self: &Arc<Self>, f: Arc<PostFn>) -> RemovableHandle {
        self.add(Kind::Post, |id| {
            self.post
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .push((id, f))
        })
    }

    pub(crate) fn add_abort(self: &Arc<Self>, f: Arc<AbortFn>) -> RemovableHandle {
        self.add(Kind::Abort, |id| {
            self.abort
                .write()
                .unwrap_or_else(|e| e.into_inner())
                .push((id, f))
        })
    }

    fn has(&self, kind: Kind) -> bool {
        self.per_kind[kind as usize].load(Ordering::Acquire) != 0
    }

    /// Queue `job` for this communicator's hook thread (started with the
    /// first event; it ends once the set is dropped and the queue ran dry).
    /// A thread waiting for one of the queued events may run it first
    /// ([`HookTicket`]). If the thread cannot be started, that is logged
    /// and only waiters run the jobs.
    fn dispatch(&self, job: Job) -> &Arc<HookQueue> {
        let queue = self.queue.get_or_init(|| {
            let q = Arc::new(HookQueue::default());
            let runner = q.clone();
            if let Err(e) = std::thread::Builder::new()
                .name("chorus-hooks".into())
                .spawn(move || runner.serve())
            {
                tracing::error!(error = %e, "cannot start a hook thread; this communicator's hooks run only when their ops are waited for");
            }
            q
        });
        queue.push(job);
        queue
    }
}

/// One communicator's hook events, in order: run one at a time by its hook
/// thread, or by a thread that waits for one of them (HK-6), whichever
/// holds the queue's runner (`chorus_sync::serial`, loom-checked).
/// O(events queued).
#[derive(Default)]
pub(crate) struct HookQueue(SerialQueue<Job>);

impl HookQueue {
    fn push(&self, job: Job) {
        self.0.push(job);
    }

    fn close(&self) {
        self.0.close();
    }

    /// The hook thread: run events as they come, until closed and empty.
    fn serve(&self) {
        ON_HOOK_THREAD.with(|on| on.set(true));
        self.0.serve();
    }

    /// On a waiting thread: run queued events, in order, until `done` is
    /// complete, unless another thread is running them now (then the
    /// caller waits for that). They run as on the hook thread
    /// ([`on_hook_thread`] is true meanwhile), so a hook that waits for an
    /// op does not wait for the events queued behind it.
    fn help(&self, done: &chorus_sync::oneshot::Receiver<()>) {
        let was = ON_HOOK_THREAD.with(|on| on.replace(true));
        self.0.help(|| done.is_complete());
        ON_HOOK_THREAD.with(|on| on.set(was));
    }
}

/// A registered hook; dropping it, or [`RemovableHandle::remove`],
/// unregisters the hook. Like TorchComms' `RemovableHandle`.
#[must_use = "dropping the handle unregisters the hook at once"]
pub struct RemovableHandle {
    set: Weak<HookSet>,
    kind: Kind,
    id: u64,
}

impl std::fmt::Debug for RemovableHandle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RemovableHandle")
            .field("kind", &self.kind)
            .field("id", &self.id)
            .finish()
    }
}

impl RemovableHandle {
    /// Unregister the hook now (the same as dropping the handle).
    pub fn remove(self) {
        drop(self)
    }
}

impl Drop for RemovableHandle {
    fn drop(&mut self) {
        let Some(set) = self.set.upgrade() else {
            return;
        };
        let removed = match self.kind {
            Kind::Pre => remove_id(&set.pre, self.id),
            Kind::Post => remove_id(&set.post, self.id),
            Kind::Abort => remove_id(&set.abort, self.id),
        };
        if removed {
            set.per_kind[self.kind as usize].fetch_sub(1, Ordering::AcqRel);
            set.count.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

// ------------------------------------------------------------ hook threads

type Job = Box<dyn FnOnce() + Send>;

thread_local! {
    /// Whether this thread is a communicator's hook thread.
    static ON_HOOK_THREAD: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Whether the calling thread is a hook thread: a wait there must not wait
/// for hooks, which would be queued behind the running one (HK-6).
pub(crate) fn on_hook_thread() -> bool {
    ON_HOOK_THREAD.with(|on| on.get())
}

/// Signalled (or dropped) once an op's hooks have run (HK-6); the op's
/// `Work` waits for it, running the queued hooks itself when no other
/// thread is running them.
pub(crate) struct HookTicket {
    done: chorus_sync::oneshot::Receiver<()>,
    queue: Arc<HookQueue>,
}

impl HookTicket {
    /// Whether the hooks have run: one atomic load.
    pub(crate) fn is_complete(&self) -> bool {
        self.done.is_complete()
    }

    /// Block until the hooks have run, running them here if no other
    /// thread is.
    pub(crate) fn wait(&mut self) {
        self.queue.help(&self.done);
        let _ = self.done.recv_blocking();
    }

    /// As [`HookTicket::wait`], at most `timeout`; `false` if they still
    /// run.
    pub(crate) fn wait_timeout(&mut self, timeout: Duration) -> bool {
        self.queue.help(&self.done);
        self.done.recv_blocking_timeout(timeout).is_ok()
    }

    /// For `.await`: never runs hooks on the caller's executor.
    pub(crate) fn poll(&mut self, cx: &mut std::task::Context<'_>) -> std::task::Poll<()> {
        self.done.poll_recv(cx).map(|_| ())
    }
}

/// Call `f`, catching and logging a panic.
fn call_caught(what: &'static str, comm: &str, f: impl FnOnce()) {
    if let Err(p) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)) {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
            .unwrap_or_else(|| "(non-string panic payload)".into());
        tracing::error!(comm, hook = what, panic = %msg, "a hook panicked; ignored");
    }
}

// ------------------------------------------------------------ observer

/// The op ids: process-wide and increasing.
static NEXT_OP_ID: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// The op id the next op issued on this thread takes ([`with_op_id`]).
    static RESERVED_OP_ID: std::cell::Cell<Option<u64>> = const { std::cell::Cell::new(None) };
}

/// Take a fresh op id from the process-wide sequence without issuing an op,
/// for [`with_op_id`].
///
/// A binding that runs hooks of its own on the caller's side (the Python
/// package runs its pre hooks before an op is issued, with the op's
/// tensors) takes the id here, calls its hooks with it, and issues the op
/// inside [`with_op_id`], so the op's post hooks and flight-recorder entry
/// carry the same id.
pub fn reserve_op_id() -> u64 {
    NEXT_OP_ID.fetch_add(1, Ordering::Relaxed)
}

/// Run `f` on this thread with `op_id` (from [`reserve_op_id`]) set aside
/// for the first op issued inside it that hooks or the flight recorder
/// see; any later op in `f` takes a fresh id. Returns what `f` returned and
/// whether an op took the id (not if the op failed its argument checks, or
/// nothing watches the communicator). The reservation ends with `f`, and
/// an outer one is restored (HK-7).
///
/// ```
/// let id = chorus::hooks::reserve_op_id();
/// let (got, taken) = chorus::hooks::with_op_id(id, || 7);
/// assert_eq!((got, taken), (7, false));
/// ```
pub fn with_op_id<R>(op_id: u64, f: impl FnOnce() -> R) -> (R, bool) {
    struct Restore(Option<u64>);
    impl Drop for Restore {
        fn drop(&mut self) {
            RESERVED_OP_ID.with(|r| r.set(self.0));
        }
    }
    let _restore = Restore(RESERVED_OP_ID.with(|r| r.replace(Some(op_id))));
    let out = f();
    let taken = RESERVED_OP_ID.with(|r| r.get()) != Some(op_id);
    (out, taken)
}

/// The id of an op issued now: the one reserved on this thread, else the
/// next of the sequence.
fn next_op_id() -> u64 {
    RESERVED_OP_ID
        .with(|r| r.take())
        .unwrap_or_else(reserve_op_id)
}

/// What watches one communicator's ops: its hooks and its flight recorder.
/// Shared by its handles and its actor.
pub(crate) struct Observer {
    pub(crate) hooks: Arc<HookSet>,
    pub(crate) recorder: Option<FlightRecorder>,
    /// Where the recorder is dumped when the communicator is aborted.
    dump_dir: Option<PathBuf>,
    id: DumpId,
}

impl Observer {
    pub(crate) fn new(
        comm: &str,
        rank: usize,
        size: usize,
        epoch: u64,
        backend: &'static str,
        recorder_size: usize,
        dump_dir: Option<PathBuf>,
    ) -> Observer {
        Observer {
            hooks: Arc::default(),
            recorder: FlightRecorder::new(recorder_size),
            dump_dir,
            id: DumpId {
                comm: comm.to_string(),
                rank,
                size,
                epoch,
                backend,
            },
        }
    }

    /// Whether an op issued with `hints` needs tracking at all.
    pub(crate) fn watching(&self, hints: &Hints) -> bool {
        !self.hooks.is_empty() || (self.recorder.is_some() && hints.record)
    }

    /// An op was issued: give it an op id, record it, tell the pre hooks.
    /// Call only when [`Observer::watching`].
    pub(crate) fn issue(self: &Arc<Self>, desc: OpDesc, hints: &Hints) -> Tracked {
        let op_id = next_op_id();
        let now = Instant::now();
        let rec = match &self.recorder {
            Some(r) if hints.record => Some(r.push(op_id, &desc, hints.tag.as_ref(), now)),
            _ => None,
        };
        let pre_sent = self.hooks.has(Kind::Pre);
        if pre_sent {
            let args = PreHookArgs {
                op_id,
                op: desc.op,
                comm: self.id.comm.clone(),
                rank: self.id.rank,
                dtype: desc.dtype,
                count: desc.count,
                bytes: desc.bytes,
                root: desc.root,
                peers: desc.peers.to_vec(),
                tag: hints.tag.as_deref().map(str::to_string),
                hints: hints.map.clone(),
            };
            let hooks = self.hooks.clone();
            self.hooks.dispatch(Box::new(move || {
                for f in read(&hooks.pre) {
                    call_caught("pre", &args.comm, || f(&args));
                }
            }));
        }
        Tracked {
            obs: self.clone(),
            op_id,
            op: desc.op,
            rec,
            issued: now,
            started: None,
            seq: None,
            pre_sent,
        }
    }

    /// The communicator was aborted with `cause` (once): the abort hooks,
    /// then the dump, each bounded in time.
    pub(crate) async fn aborted(&self, cause: &Error) {
        if self.hooks.has(Kind::Abort) {
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let hooks = self.hooks.clone();
            let args = AbortHookArgs {
                comm: self.id.comm.clone(),
                rank: self.id.rank,
                epoch: self.id.epoch,
                cause: cause.clone(),
            };
            self.hooks.dispatch(Box::new(move || {
                for f in read(&hooks.abort) {
                    call_caught("abort", &args.comm, || f(&args));
                }
                let _ = tx.send(());
            }));
            if tokio::time::timeout(ABORT_HOOK_DEADLINE, rx).await.is_err() {
                tracing::warn!(comm = %self.id.comm, rank = self.id.rank,
                    "abort hooks did not return within {ABORT_HOOK_DEADLINE:?}; aborting without them");
            }
        }
        if let (Some(r), Some(dir)) = (&self.recorder, &self.dump_dir) {
            let dump = r.dump(&self.id, Some(cause.to_string()));
            let dir = dir.clone();
            let write = tokio::task::spawn_blocking(move || {
                crate::flight_recorder::write_dump(&dir, &dump)
            });
            match tokio::time::timeout(crate::flight_recorder::DUMP_DEADLINE, write).await {
                Ok(Ok(Ok(path))) => tracing::warn!(comm = %self.id.comm, rank = self.id.rank,
                    path = %path.display(), "flight recorder dumped"),
                Ok(Ok(Err(e))) => tracing::error!(comm = %self.id.comm, rank = self.id.rank,
                    error = %e, "cannot write the flight recorder dump"),
                Ok(Err(e)) => tracing::error!(comm = %self.id.comm, error = %e,
                    "the flight recorder dump task failed"),
                Err(_) => tracing::error!(comm = %self.id.comm,
                    "the flight recorder dump did not finish within {:?}",
                    crate::flight_recorder::DUMP_DEADLINE),
            }
        }
    }
}

/// One issued op, as its observer follows it; carried by the op's
/// [`Completer`](crate::work::Completer).
pub(crate) struct Tracked {
    obs: Arc<Observer>,
    op_id: u64,
    op: &'static str,
    /// Its flight-recorder entry.
    rec: Option<u64>,
    pub(crate) issued: Instant,
    started: Option<Instant>,
    seq: Option<u64>,
    /// Whether its pre hooks were sent to the hook thread.
    pre_sent: bool,
}

impl Tracked {
    /// Its turn started at `now`, with sequence number `seq`.
    pub(crate) fn started(&mut self, seq: Option<u64>, now: Instant) {
        self.started = Some(now);
        self.seq = seq;
        if let (Some(r), Some(id)) = (&self.obs.recorder, self.rec) {
            r.started(id, seq, now);
        }
    }

    /// Record a failure before the op completes (the abort's dump shows it).
    pub(crate) fn failed(&self, error: &Error) {
        if let (Some(r), Some(id)) = (&self.obs.recorder, self.rec) {
            r.finished(id, Some(error.to_string()), Instant::now());
        }
    }

    /// It completes with `result` (FR-2: before its `Work` does). Returns
    /// the ticket its `Work` waits for when hooks were or are sent (HK-6).
    pub(crate) fn finish(self, result: Result<(), &Error>) -> Option<HookTicket> {
        let now = Instant::now();
        if let (Some(r), Some(id)) = (&self.obs.recorder, self.rec) {
            r.finished(id, result.err().map(|e| e.to_string()), now);
        }
        if self.obs.hooks.has(Kind::Post) {
            let args = PostHookArgs {
                op_id: self.op_id,
                op: self.op,
                comm: self.obs.id.comm.clone(),
                rank: self.obs.id.rank,
                seq: self.seq,
                duration: now.saturating_duration_since(self.issued),
                run_duration: self.started.map(|s| now.saturating_duration_since(s)),
                result: result.map_err(Error::clone),
            };
            let hooks = self.obs.hooks.clone();
            let (tx, done) = chorus_sync::oneshot::channel();
            let queue = self.obs.hooks.dispatch(Box::new(move || {
                for f in read(&hooks.post) {
                    call_caught("post", &args.comm, || f(&args));
                }
                let _ = tx.send(());
            }));
            return Some(HookTicket {
                done,
                queue: queue.clone(),
            });
        }
        if self.pre_sent {
            // No post hook: the ticket follows the pre call in the queue.
            let (tx, done) = chorus_sync::oneshot::channel();
            let queue = self.obs.hooks.dispatch(Box::new(move || {
                let _ = tx.send(());
            }));
            return Some(HookTicket {
                done,
                queue: queue.clone(),
            });
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hk_4_handles_unregister_once_and_outlive_their_set_safely() {
        let set = Arc::new(HookSet::default());
        assert!(set.is_empty());
        let pre = set.add_pre(Arc::new(|_| {}));
        let post = set.add_post(Arc::new(|_| {}));
        assert!(set.has(Kind::Pre) && set.has(Kind::Post) && !set.has(Kind::Abort));
        pre.remove();
        assert!(!set.has(Kind::Pre) && !set.is_empty());
        let abort = set.add_abort(Arc::new(|_| {}));
        drop(post);
        assert!(set.has(Kind::Abort) && !set.has(Kind::Post));
        drop(set);
        // The communicator is gone: dropping its last handle is a no-op.
        drop(abort);
    }

    #[test]
    fn hk_5_a_panic_is_caught() {
        let mut after = false;
        call_caught("pre", "c", || panic!("boom"));
        call_caught("pre", "c", || after = true);
        assert!(after);
    }
}
