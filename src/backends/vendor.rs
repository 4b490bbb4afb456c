//! The glue shared by the vendor backends whose library calls block
//! (`gloo`, `mpi`): a *vendor worker* thread per communicator for the
//! library, and a [`CpuBackend`] control mesh for everything else.
//!
//! A [`VendorBackend`] owns:
//! - the control mesh: the header exchange ([BE-1]), abort notices and
//!   finalize run over it, as for every vendor backend;
//! - one dedicated OS thread, the vendor worker, which opens the library's
//!   communicator ([`VendorComm`]), runs its ops and frees it. `execute`
//!   moves the op's [`OpData`] to the worker over a channel and awaits the
//!   reply (the data, filled, and the result) on a oneshot. No runtime
//!   thread ever blocks in a vendor call, so the backend works on every tokio
//!   runtime flavour, current-thread included, and when its future is
//!   polled by `Handle::block_on` on a thread outside the runtime; and the
//!   executor's op timeout and abort stay effective while a vendor call runs.
//!
//! # Invariants
//! - VW-1: the vendor communicator is created, used and released on its
//!   worker thread only, one op at a time, in the executor's order (so it
//!   need not be `Send`).
//! - VW-2: the worker thread ends when the backend is finalized, aborted or
//!   dropped. `finalize`, and `abort` of an idle worker, return only after
//!   the thread ended ([`live_workers`] counts threads not yet ended). A
//!   vendor call still in flight when `abort` runs (its `execute` future was
//!   dropped by a timeout or an abort) is not waited for, since some
//!   libraries cannot be interrupted (MP-3): the worker is told to stop and
//!   ends, releasing the library's communicator, when that call returns.
//!   `abort` itself stays bounded.
//! - VW-3: after `abort`, or after an op failed with a fatal error, every
//!   later `exchange_headers`/`execute` fails with that error (`Aborted` for
//!   an abort) without reaching the control mesh or the library.
//! - VW-4: errors keep their context (backend, communicator, rank, epoch,
//!   op, seq); a worker that is gone or panicked is `Internal` naming them,
//!   never a hang or a panic on the runtime.
//!
//! [BE-1]: crate::backends#invariants

use std::marker::PhantomData;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{mpsc, Arc};

use async_trait::async_trait;
use tokio::sync::oneshot;

use super::cpu::CpuBackend;
use super::{Backend, BackendInit, OpCtx, OpData, SplitArgs};
use crate::error::{Error, Result};

static LIVE_WORKERS: AtomicUsize = AtomicUsize::new(0);

/// Vendor worker threads of this process that have not ended yet ([VW-2]).
///
/// [VW-2]: self#invariants
pub(crate) fn live_workers() -> usize {
    LIVE_WORKERS.load(Ordering::Acquire)
}

/// The blocking part of a vendor backend: the library's communicator, owned
/// by its worker thread ([VW-1]).
///
/// [VW-1]: self#invariants
pub(crate) trait VendorComm: 'static {
    /// Backend name, as given to `new_comm`.
    const NAME: &'static str;
    /// What the backend can do beyond the ops.
    const CAPABILITIES: super::Capabilities;

    /// Run one op, blocking until the library returns. Errors carry `ctx`'s
    /// context; a fatal one stops the backend ([VW-3]).
    ///
    /// [VW-3]: self#invariants
    fn run(&mut self, ctx: &OpCtx, data: &mut OpData) -> Result<()>;

    /// Release the communicator at the end of the worker. `aborted`: the
    /// backend was aborted or failed, so peers may still be using theirs.
    fn close(self, aborted: bool);

    /// Split this communicator with the library's own call ([BE-4]), on its
    /// worker thread; called on every parent rank, `child` `None` on a rank
    /// that joins no child. Returns, on a member, how to open the child's
    /// communicator on the child's own worker thread ([VW-1]). Only called
    /// when [`VendorComm::CAPABILITIES`] says [`super::SplitMode::Native`].
    ///
    /// # Errors
    /// What the library reports; fatal for the parent.
    ///
    /// [BE-4]: crate::backends#invariants
    /// [VW-1]: self#invariants
    fn split(&mut self, child: Option<super::SplitChild>) -> Result<Option<OpenChild<Self>>>
    where
        Self: Sized,
    {
        let _ = child;
        Err(Error::Internal(format!(
            "backend {} has no native split",
            Self::NAME
        )))
    }
}

/// Opens a split's child communicator on the child's worker thread.
pub(crate) type OpenChild<C> = Box<dyn FnOnce() -> Result<C> + Send>;

/// A call run on the worker's communicator, given as `&mut dyn Any`.
type WorkerCall = Box<dyn FnOnce(&mut dyn std::any::Any) + Send>;

/// A request to the worker thread.
enum Job {
    Op(Box<OpJob>),
    /// Run a call on the worker's communicator (a split), which downcasts
    /// it to its `VendorComm` and answers on its own channel.
    Call(WorkerCall),
    Close {
        aborted: bool,
    },
}

/// One op for the worker: the data moves in and comes back in the reply.
struct OpJob {
    ctx: OpCtx,
    data: OpData,
    /// The executor's op span, parent of the worker's.
    span: tracing::Span,
    reply: oneshot::Sender<(OpData, Result<()>)>,
}

/// Counts a worker in [`live_workers`] and signals its end when dropped, the
/// last thing its thread does.
struct Alive(Option<oneshot::Sender<()>>);

impl Drop for Alive {
    fn drop(&mut self) {
        LIVE_WORKERS.fetch_sub(1, Ordering::AcqRel);
        drop(self.0.take());
    }
}

/// The handle on one vendor worker thread.
struct Worker {
    tx: Option<mpsc::Sender<Job>>,
    /// Set by `execute` before sending an op, cleared by the worker when the
    /// library call returned: while set, the worker may be stuck in it.
    busy: Arc<AtomicBool>,
    ended: Option<oneshot::Receiver<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Worker {
    /// Start the thread and open the vendor communicator on it with `open`.
    async fn start<C: VendorComm>(
        thread_name: String,
        open: impl FnOnce() -> Result<C> + Send + 'static,
    ) -> Result<Worker> {
        let (tx, rx) = mpsc::channel::<Job>();
        let (ready_tx, ready_rx) = oneshot::channel::<Result<()>>();
        let (ended_tx, ended_rx) = oneshot::channel::<()>();
        let busy = Arc::new(AtomicBool::new(false));
        let flag = busy.clone();
        LIVE_WORKERS.fetch_add(1, Ordering::AcqRel);
        let alive = Alive(Some(ended_tx));
        let thread = std::thread::Builder::new()
            .name(thread_name.clone())
            .spawn(move || {
                let _alive = alive;
                let comm = match std::panic::catch_unwind(AssertUnwindSafe(open)) {
                    Ok(Ok(c)) => c,
                    Ok(Err(e)) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                    Err(p) => {
                        let _ = ready_tx.send(Err(Error::Internal(format!(
                            "{}: opening the {} communicator panicked: {}",
                            thread_name,
                            C::NAME,
                            panic_message(&p)
                        ))));
                        return;
                    }
                };
                let _ = ready_tx.send(Ok(()));
                serve(comm, &rx, &flag);
            });
        let thread = match thread {
            Ok(t) => t,
            // The closure (and its `Alive`) was dropped: the count is right.
            Err(e) => {
                return Err(Error::Internal(format!(
                    "cannot start the {} worker thread: {e}",
                    C::NAME
                )))
            }
        };
        let mut worker = Worker {
            tx: Some(tx),
            busy,
            ended: Some(ended_rx),
            thread: Some(thread),
        };
        match ready_rx.await {
            Ok(Ok(())) => Ok(worker),
            Ok(Err(e)) => {
                worker.stop(true).await;
                Err(e)
            }
            Err(_) => {
                worker.stop(true).await;
                Err(Error::Internal(format!(
                    "the {} worker thread ended while opening its communicator",
                    C::NAME
                )))
            }
        }
    }

    /// Tell the worker to release its communicator and end; wait for it
    /// unless a vendor call is in flight ([VW-2]). Idempotent.
    ///
    /// [VW-2]: self#invariants
    async fn stop(&mut self, aborted: bool) {
        let Some(tx) = self.tx.take() else {
            return;
        };
        let _ = tx.send(Job::Close { aborted });
        drop(tx);
        if self.busy.load(Ordering::Acquire) {
            tracing::warn!(
                thread = self.thread.as_ref().and_then(|t| t.thread().name()),
                "a vendor call is still in flight; its worker thread ends when the call returns"
            );
            self.ended.take();
            self.thread.take();
            return;
        }
        if let Some(ended) = self.ended.take() {
            let _ = ended.await;
        }
        if let Some(t) = self.thread.take() {
            // The thread signalled its end as its last step: this returns at once.
            let _ = t.join();
        }
    }
}

impl Drop for Worker {
    fn drop(&mut self) {
        // Never block in Drop: the thread ends on its own once told to (or
        // once the channel closes), after any call in flight.
        if let Some(tx) = self.tx.take() {
            let _ = tx.send(Job::Close { aborted: true });
        }
    }
}

/// The worker's loop: run ops until told to close or the backend is gone.
fn serve<C: VendorComm>(mut comm: C, rx: &mpsc::Receiver<Job>, busy: &AtomicBool) {
    let aborted = loop {
        match rx.recv() {
            Ok(Job::Call(call)) => {
                // A panic drops the call's reply channel: the caller sees the
                // worker gone (VW-4).
                let _ = std::panic::catch_unwind(AssertUnwindSafe(|| call(&mut comm)));
                busy.store(false, Ordering::Release);
            }
            Ok(Job::Op(job)) => {
                let OpJob {
                    ctx,
                    mut data,
                    span,
                    reply,
                } = *job;
                let r = span.in_scope(|| {
                    std::panic::catch_unwind(AssertUnwindSafe(|| comm.run(&ctx, &mut data)))
                });
                busy.store(false, Ordering::Release);
                let r = r.unwrap_or_else(|p| {
                    Err(Error::Internal(format!(
                        "{} communicator {:?} (rank {}, epoch {}): {} (seq {}) panicked in the \
                         worker thread: {}",
                        C::NAME,
                        ctx.comm,
                        ctx.rank,
                        ctx.epoch,
                        ctx.kind.name(),
                        ctx.seq,
                        panic_message(&p)
                    )))
                });
                let _ = reply.send((data, r));
            }
            Ok(Job::Close { aborted }) => break aborted,
            // Dropped without a word: peers may be in any state.
            Err(_) => break true,
        }
    };
    comm.close(aborted);
}

/// Reduce-scatter as the vendor backends run it: after an all-reduce of
/// `input` (one block per rank, sizes `counts`), copy this rank's block
/// into `output` (sized by the executor, [BE-1]).
///
/// [BE-1]: crate::backends#invariants
pub(crate) fn keep_own_block(
    input: &crate::tensor::Tensor,
    output: &mut crate::tensor::Tensor,
    counts: &[usize],
    rank: usize,
) {
    let start = counts[..rank].iter().sum::<usize>() * input.dtype().size();
    let n = output.len_bytes();
    output
        .as_bytes_mut()
        .copy_from_slice(&input.as_bytes()[start..start + n]);
}

fn panic_message(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a non-string panic".into())
}

/// A vendor backend: the control mesh, the stopped guard and the worker
/// thread running `C` (module docs, [VW-1]..4).
///
/// [VW-1]: self#invariants
pub(crate) struct VendorBackend<C: VendorComm> {
    comm: String,
    rank: usize,
    size: usize,
    epoch: u64,
    ctrl: CpuBackend,
    /// Set by abort or a fatal op error; later ops fail with it ([VW-3]).
    ///
    /// [VW-3]: self#invariants
    stopped: Option<Error>,
    worker: Worker,
    _comm: PhantomData<fn() -> C>,
}

impl<C: VendorComm> std::fmt::Debug for VendorBackend<C> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VendorBackend")
            .field("backend", &C::NAME)
            .field("comm", &self.comm)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("epoch", &self.epoch)
            .finish_non_exhaustive()
    }
}

impl<C: VendorComm> VendorBackend<C> {
    /// Start the worker thread and open the library's communicator on it
    /// with `open`, then connect the control mesh.
    ///
    /// # Errors
    /// What `open` returns; control-mesh errors as `cpu`.
    pub(crate) async fn connect(
        init: BackendInit,
        open: impl FnOnce() -> Result<C> + Send + 'static,
    ) -> Result<VendorBackend<C>> {
        // (A NUL in a user's communicator name would make spawn panic.)
        let thread_name =
            format!("chorus-{}-{}-r{}", C::NAME, init.comm, init.rank).replace('\0', "?");
        let mut worker = Worker::start(thread_name, open).await?;
        let ctrl = match CpuBackend::connect(init.clone()).await {
            Ok(c) => c,
            Err(e) => {
                worker.stop(true).await;
                return Err(e);
            }
        };
        tracing::info!(backend = C::NAME, comm = %init.comm, rank = init.rank, size = init.size, "vendor communicator ready");
        Ok(VendorBackend {
            comm: init.comm,
            rank: init.rank,
            size: init.size,
            epoch: init.epoch,
            ctrl,
            stopped: None,
            worker,
            _comm: PhantomData,
        })
    }

    fn check_running(&self) -> Result<()> {
        match &self.stopped {
            Some(e) => Err(e.clone()),
            None => Ok(()),
        }
    }

    /// Send one op to the worker and wait for it ([VW-1], [VW-4]).
    ///
    /// [VW-1]: self#invariants
    /// [VW-4]: self#invariants
    async fn run_on_worker(&mut self, ctx: &OpCtx, data: &mut OpData) -> Result<()> {
        let gone = |what: &str| {
            Error::Internal(format!(
                "{} communicator {:?} (rank {}, epoch {}): {} (seq {}): the worker thread {what}",
                C::NAME,
                self.comm,
                self.rank,
                self.epoch,
                ctx.kind.name(),
                ctx.seq
            ))
        };
        let Some(tx) = &self.worker.tx else {
            return Err(gone("was stopped"));
        };
        let (reply, answer) = oneshot::channel();
        let job = Job::Op(Box::new(OpJob {
            ctx: ctx.clone(),
            data: std::mem::replace(data, OpData::Barrier),
            span: tracing::Span::current(),
            reply,
        }));
        self.worker.busy.store(true, Ordering::Release);
        if tx.send(job).is_err() {
            self.worker.busy.store(false, Ordering::Release);
            return Err(gone("has ended"));
        }
        match answer.await {
            Ok((back, r)) => {
                *data = back;
                r
            }
            Err(_) => Err(gone("ended during the op")),
        }
    }
}

#[async_trait]
impl<C: VendorComm> Backend for VendorBackend<C> {
    fn name(&self) -> &'static str {
        C::NAME
    }

    fn capabilities(&self) -> super::Capabilities {
        C::CAPABILITIES
    }

    async fn exchange_headers(
        &mut self,
        ctx: &OpCtx,
        outgoing: Vec<(usize, u64, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>> {
        self.check_running()?;
        self.ctrl.exchange_headers(ctx, outgoing).await
    }

    async fn execute(&mut self, ctx: &OpCtx, data: &mut OpData) -> Result<()> {
        self.check_running()?;
        let r = self.run_on_worker(ctx, data).await;
        if let Err(e) = &r {
            if e.is_fatal() {
                self.stopped = Some(e.clone());
            }
        }
        r
    }

    async fn abort(&mut self, reason: &str, failed: &[usize]) {
        self.abort_for(None, reason, failed).await;
    }

    async fn abort_for(&mut self, cause: Option<&Error>, reason: &str, failed: &[usize]) {
        if self.stopped.is_none() {
            self.stopped = Some(Error::Aborted {
                comm: self.comm.clone(),
                rank: self.rank,
                epoch: self.epoch,
                failed_ranks: failed.to_vec(),
                reason: format!("the {} communicator was aborted: {reason}", C::NAME),
            });
        }
        // The control links tell the peers when the cause is a mismatch.
        self.ctrl.abort_for(cause, reason, failed).await;
        self.worker.stop(true).await;
    }

    async fn finalize(&mut self) {
        self.ctrl.finalize().await;
        self.worker.stop(self.stopped.is_some()).await;
    }

    /// The library's split on the worker ([`VendorComm::split`]), bounded
    /// by `args.timeout`; a member then starts the child's own worker and
    /// control mesh. Any failure stops this backend ([VW-3]): a split is
    /// collective over the parent, so a rank that failed it cannot go on.
    ///
    /// [VW-3]: self#invariants
    async fn split(&mut self, args: SplitArgs) -> Result<Option<Box<dyn Backend>>> {
        self.check_running()?;
        let r = self.split_on_worker(&args).await;
        let open = match r {
            Ok(open) => open,
            Err(e) => {
                self.stopped = Some(e.clone());
                return Err(e);
            }
        };
        match (open, args.child) {
            (Some(open), Some(child)) => {
                let backend = VendorBackend::<C>::connect(child.init, open).await?;
                Ok(Some(Box::new(backend)))
            }
            (None, None) => Ok(None),
            _ => Err(self.split_error(
                "the library's split disagreed with Chorus on whether this rank joins a child",
            )),
        }
    }
}

impl<C: VendorComm> VendorBackend<C> {
    fn split_error(&self, what: impl std::fmt::Display) -> Error {
        Error::Internal(format!(
            "{} split of communicator {:?} (rank {}, epoch {}): {what}",
            C::NAME,
            self.comm,
            self.rank,
            self.epoch
        ))
    }

    /// Send the split to the worker and wait for its answer, at most
    /// `args.timeout` (a library call in flight is then left to the worker,
    /// [VW-2]).
    ///
    /// [VW-2]: self#invariants
    async fn split_on_worker(&mut self, args: &SplitArgs) -> Result<Option<OpenChild<C>>> {
        let Some(tx) = &self.worker.tx else {
            return Err(self.split_error("the worker thread was stopped"));
        };
        let (reply, answer) = oneshot::channel();
        let child = args.child.clone();
        let call = move |comm: &mut dyn std::any::Any| {
            let r = match comm.downcast_mut::<C>() {
                Some(c) => c.split(child),
                None => Err(Error::Internal(format!(
                    "the {} worker holds another kind of communicator",
                    C::NAME
                ))),
            };
            let _ = reply.send(r);
        };
        self.worker.busy.store(true, Ordering::Release);
        if tx.send(Job::Call(Box::new(call))).is_err() {
            self.worker.busy.store(false, Ordering::Release);
            return Err(self.split_error("the worker thread has ended"));
        }
        match tokio::time::timeout(args.timeout, answer).await {
            Ok(Ok(r)) => r,
            Ok(Err(_)) => Err(self.split_error("the worker thread ended during the split")),
            Err(_) => Err(self.split_error(format!(
                "not every parent rank reached the split within {:?}",
                args.timeout
            ))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::OpKind;
    use crate::tensor::{DType, Tensor};

    /// A fake library: all-reduce doubles the buffer; `Broadcast` blocks
    /// until `release` is signalled; `Gather` panics.
    struct Fake {
        release: Option<mpsc::Receiver<()>>,
        closed: Arc<std::sync::Mutex<Option<bool>>>,
    }

    impl VendorComm for Fake {
        const NAME: &'static str = "fake";
        const CAPABILITIES: super::super::Capabilities = super::super::Capabilities {
            split: super::super::SplitMode::Reconnect,
            elastic: true,
            in_place_all_gather: false,
            in_band_checks: false,
            headerless_ops: false,
            list_all_to_all: false,
        };

        fn run(&mut self, ctx: &OpCtx, data: &mut OpData) -> Result<()> {
            match data {
                OpData::AllReduce { buf, .. } => {
                    let v: Vec<f64> = buf.to_f64_vec().iter().map(|x| x * 2.0).collect();
                    *buf = Tensor::from_f64s(buf.dtype(), &v);
                    Ok(())
                }
                OpData::Broadcast { .. } => {
                    if let Some(r) = &self.release {
                        let _ = r.recv();
                    }
                    Ok(())
                }
                OpData::Gather { .. } => panic!("boom"),
                _ => Err(ctx.peer_failed(vec![], "unsupported")),
            }
        }

        fn close(self, aborted: bool) {
            if let Ok(mut c) = self.closed.lock() {
                *c = Some(aborted);
            }
        }
    }

    fn ctx(kind: OpKind, seq: u64) -> OpCtx {
        OpCtx {
            comm: "vw".into(),
            rank: 0,
            size: 1,
            epoch: 3,
            kind,
            seq,
            fingerprint: 0,
            headers: true,
            may_block: false,
            order: Default::default(),
        }
    }

    type Closed = Arc<std::sync::Mutex<Option<bool>>>;

    async fn worker(release: Option<mpsc::Receiver<()>>) -> (Worker, Closed) {
        let closed: Closed = Arc::default();
        let c = closed.clone();
        let w = Worker::start("chorus-test-worker".into(), move || {
            Ok(Fake { release, closed: c })
        })
        .await
        .expect("worker starts");
        (w, closed)
    }

    /// Send an op to the worker the way `VendorBackend::run_on_worker`
    /// does, without a control mesh.
    fn send(w: &Worker, ctx: &OpCtx, data: OpData) -> oneshot::Receiver<(OpData, Result<()>)> {
        let (reply, answer) = oneshot::channel();
        w.busy.store(true, Ordering::Release);
        let job = Job::Op(Box::new(OpJob {
            ctx: ctx.clone(),
            data,
            span: tracing::Span::none(),
            reply,
        }));
        assert!(w.tx.as_ref().expect("running").send(job).is_ok());
        answer
    }

    async fn run(w: &Worker, ctx: &OpCtx, data: OpData) -> (OpData, Result<()>) {
        send(w, ctx, data).await.expect("worker replies")
    }

    // Every test here shares the process-wide counter, so each only checks
    // that its own worker ended via its own `ended` channel and the
    // `closed` flag, not the counter's absolute value.

    #[test]
    fn vw_1_ops_run_on_the_worker_from_a_current_thread_runtime() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let (mut w, closed) = worker(None).await;
            let buf = Tensor::from_f64s(DType::F32, &[1.0, 2.0]);
            let (back, r) = run(
                &w,
                &ctx(OpKind::AllReduce, 1),
                OpData::AllReduce {
                    buf,
                    op: crate::op::ReduceOp::Sum,
                },
            )
            .await;
            assert!(r.is_ok(), "{r:?}");
            match back {
                OpData::AllReduce { buf, .. } => assert_eq!(buf.to_f64_vec(), vec![2.0, 4.0]),
                other => panic!("{other:?}"),
            }
            w.stop(false).await;
            assert_eq!(*closed.lock().expect("lock"), Some(false));
            assert!(w.thread.is_none());
        });
    }

    #[test]
    fn vw_1_ops_run_when_polled_by_handle_block_on_outside_the_runtime() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .build()
            .expect("runtime");
        let handle = rt.handle().clone();
        let out = std::thread::spawn(move || {
            handle.block_on(async {
                let (mut w, closed) = worker(None).await;
                let (_, r) = run(&w, &ctx(OpKind::Barrier, 1), OpData::Barrier).await;
                w.stop(false).await;
                let c = *closed.lock().expect("lock");
                (r.is_err(), c)
            })
        })
        .join()
        .expect("thread");
        // Barrier is "unsupported" in the fake, so it errors, typed.
        assert_eq!(out, (true, Some(false)));
    }

    #[tokio::test]
    async fn vw_2_stop_while_a_call_is_in_flight_returns_and_the_thread_ends_after_it() {
        let (release_tx, release_rx) = mpsc::channel();
        let (mut w, closed) = worker(Some(release_rx)).await;
        // Start a blocking op and drop its reply receiver, as a timed-out
        // `execute` would.
        drop(send(
            &w,
            &ctx(OpKind::Broadcast, 1),
            OpData::Broadcast {
                buf: Tensor::zeros(DType::U8, 1),
                root: 0,
            },
        ));
        let mut ended = w.ended.take().expect("end signal");
        // Returns although the call never does until released (VW-2).
        w.stop(true).await;
        assert!(w.thread.is_none() && w.tx.is_none());
        assert!(ended.try_recv().is_err(), "still in the call");
        assert!(release_tx.send(()).is_ok());
        let _ = ended.await;
        assert_eq!(*closed.lock().expect("lock"), Some(true));
    }

    #[tokio::test]
    async fn vw_4_a_panic_in_the_library_is_an_internal_error_with_context() {
        let (mut w, closed) = worker(None).await;
        let (_, r) = run(
            &w,
            &ctx(OpKind::Gather, 7),
            OpData::Gather {
                input: Tensor::zeros(DType::U8, 1),
                output: Tensor::zeros(DType::U8, 1),
                root: 0,
            },
        )
        .await;
        match r {
            Err(Error::Internal(m)) => {
                assert!(
                    m.contains("\"vw\"") && m.contains("seq 7") && m.contains("boom"),
                    "{m}"
                )
            }
            other => panic!("{other:?}"),
        }
        w.stop(false).await;
        assert_eq!(*closed.lock().expect("lock"), Some(false));
    }

    #[tokio::test]
    async fn vw_2_a_worker_that_fails_to_open_ends_and_reports_the_error() {
        let r = Worker::start::<Fake>("chorus-test-open".into(), || {
            Err(Error::Config("no library".into()))
        })
        .await;
        assert!(matches!(r, Err(Error::Config(_))), "{:?}", r.err());
    }

    async fn backend(release: Option<mpsc::Receiver<()>>) -> (VendorBackend<Fake>, Closed) {
        let closed: Closed = Arc::default();
        let c = closed.clone();
        let init = BackendInit {
            comm: "vw".into(),
            key_prefix: "comm/vw#0/epoch/3".into(),
            rank: 0,
            size: 1,
            epoch: 3,
            store: Arc::new(crate::transport::MemoryStore::new()),
            secret: Arc::from(&b"s"[..]),
            connect_timeout: std::time::Duration::from_secs(10),
            bind_ip: std::net::IpAddr::from([127, 0, 0, 1]),
            links: crate::backends::LinkPolicy::Auto,
            host_id: None,
            peers_failed: crate::backends::PeerFailures::none(),
        };
        let b = VendorBackend::connect(init, move || Ok(Fake { release, closed: c }))
            .await
            .expect("connects");
        (b, closed)
    }

    #[tokio::test]
    async fn vw_3_after_abort_ops_fail_aborted_without_reaching_the_library() {
        let (mut b, closed) = backend(None).await;
        let mut data = OpData::AllReduce {
            buf: Tensor::from_f64s(DType::I32, &[3.0]),
            op: crate::op::ReduceOp::Sum,
        };
        let c = ctx(OpKind::AllReduce, 1);
        assert!(b.execute(&c, &mut data).await.is_ok());
        match &data {
            OpData::AllReduce { buf, .. } => assert_eq!(buf.to_f64_vec(), vec![6.0]),
            other => panic!("{other:?}"),
        }
        b.abort("test", &[]).await;
        // VW-2: an idle worker has ended when abort returns, its
        // communicator released as aborted.
        assert_eq!(*closed.lock().expect("lock"), Some(true));
        assert!(b.worker.thread.is_none());
        for r in [
            b.execute(&ctx(OpKind::AllReduce, 2), &mut data).await,
            b.exchange_headers(&ctx(OpKind::AllReduce, 2), vec![])
                .await
                .map(|_| ()),
        ] {
            match r {
                Err(Error::Aborted {
                    comm,
                    rank,
                    epoch,
                    reason,
                    ..
                }) => {
                    assert_eq!((comm.as_str(), rank, epoch), ("vw", 0, 3));
                    assert!(
                        reason.contains("fake") && reason.contains("test"),
                        "{reason}"
                    );
                }
                other => panic!("{other:?}"),
            }
        }
        // The data came back untouched by the refused op.
        match &data {
            OpData::AllReduce { buf, .. } => assert_eq!(buf.to_f64_vec(), vec![6.0]),
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn vw_2_finalize_ends_the_worker_and_releases_cleanly() {
        let (mut b, closed) = backend(None).await;
        b.finalize().await;
        assert_eq!(*closed.lock().expect("lock"), Some(false));
        assert!(b.worker.thread.is_none() && b.worker.tx.is_none());
    }

    #[tokio::test]
    async fn vw_2_abort_during_a_stuck_call_returns_and_later_ops_fail() {
        let (release_tx, release_rx) = mpsc::channel();
        let (mut b, closed) = backend(Some(release_rx)).await;
        let c = ctx(OpKind::Broadcast, 1);
        let mut data = OpData::Broadcast {
            buf: Tensor::zeros(DType::U8, 4),
            root: 0,
        };
        // The executor's timeout: the call is stuck, the future is dropped.
        let stuck = tokio::time::timeout(
            std::time::Duration::from_millis(50),
            b.execute(&c, &mut data),
        )
        .await;
        assert!(stuck.is_err(), "the fake call blocks until released");
        let mut ended = b.worker.ended.take().expect("end signal");
        b.abort("timed out", &[]).await;
        assert!(ended.try_recv().is_err(), "still in the call");
        assert!(matches!(
            b.execute(&c, &mut data).await,
            Err(Error::Aborted { .. })
        ));
        assert!(release_tx.send(()).is_ok());
        let _ = ended.await;
        assert_eq!(*closed.lock().expect("lock"), Some(true));
    }
}
