//! Actors: one [`CommActor`] per communicator, the single owner of its core.
//!
//! The actor owns the communicator's core (`executor::Core`: the backend
//! and through it the device stream, the sequence numbers, the
//! heartbeats) and is the only writer of its [`status`]. Every op is one
//! *turn* (`executor::Core::turn`), and the turn completes the op's
//! [`Work`](crate::Work) directly.
//!
//! **One ordering gate.** Between turns the core lives in the
//! communicator's `Home`, inside an ordering gate (`chorus_sync::gate`, a
//! small lock-held primitive with a loom model). A [`Comm`] handle hands
//! every op to the gate when it is issued (`Home::submit`), in the
//! caller's program order, and the gate decides who runs it:
//! - nothing ahead of it (no op queued, the core at home): the caller gets
//!   a `Lease` and runs the turn itself, on its own blocked thread or as a
//!   task next to it, instead of waking the actor, which is most of the
//!   cost of a small op. The lease is exclusive (the core is moved out of
//!   the gate, never shared), limited to one turn, and gives the core back
//!   when dropped; a fatal outcome goes back with it, for the actor;
//! - otherwise the op is queued behind the ones before it, and the actor
//!   runs the queue front to back, one turn per [`CommMsg::Run`]. Native
//!   splits and the finalize are queued the same way (`Home::enqueue`),
//!   so they too run in issue order.
//!
//! Which thread runs a turn is a scheduling choice: the same
//! `executor::Core::turn` runs, with the same ordering, timeout, abort and
//! error handling, and there is no other path to the backend.
//!
//! **Aborts never wait behind an op.** Anyone may ask for an abort through
//! the communicator's `status::AbortSignal` (a user's `abort()`, the
//! watchdog, the parent): the signal ends the turn in flight at once,
//! wherever it runs, and the actor then moves the status to `Aborted`,
//! aborts the backend, fails everything still queued, aborts its children
//! and stops.
//!
//! **Supervision** is ractor's tree: a split's actor is spawned linked under
//! its parent's, named `<name>/<epoch>/<rank>`. A child's abort signal is
//! derived from its parent's, so aborting a parent interrupts every
//! descendant's turn at once; the parent then aborts its children
//! concurrently under one deadline ([`CHILD_DEADLINE`]). Finalizing a
//! parent finalizes its children first, under the same deadline, and an
//! abort raised meanwhile is not delayed by it. A child that ends aborted
//! is reported in its parent's [`Comm::health`]. ractor's default
//! (stopping the parent when any child exits) is overridden.
//!
//! # Invariants
//!
//! | tag | rule |
//! |-----|------|
//! | AC-1 | collective sequence numbers are assigned in the order turns run, starting at 0, the same on every rank that issues the same ops. |
//! | AC-2 | point-to-point sequence numbers are counted per peer. |
//! | AC-3 | after `Abort` or `Finalize` the actor stops; every request still queued completes first (revoked, or after the finalize with `Finalized`). |
//! | AC-4 | children are aborted or finalized before their parent; a parent never stops with a live child. |
//! | AC-5 | after an abort caused by a peer failure, the op in flight and every queued op complete with that `Error::PeerFailed`; ops submitted once the status shows the abort fail with `Error::Aborted` carrying the failed ranks. |
//! | AC-6 | ops run in the order they were issued, whichever thread runs them: every path to the core (a lent turn, the actor's queue, a split, the finalize, the idle poll) goes through the gate, which lends the core only when nothing is queued or scheduled ahead (GT-1..GT-5 in `chorus_sync::gate`). |
//! | AC-7 | a lent turn that cannot finish (its task dropped, as when the caller's runtime shuts down) is fatal: the communicator aborts with a cause that says so (EX-9), and its peers learn it as they learn any failure. |
//!
//! [`Comm`]: crate::Comm
//! [`Comm::health`]: crate::Comm::health

use std::sync::{Arc, Mutex};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use tracing::Instrument;

use crate::backends::{Backend, OpData, P2PTransfer, SplitArgs};
use crate::error::{Error, Result};
use crate::op::{OpKind, ReduceOp};
use crate::tensor::{DType, Tensor};
use crate::work::{Completer, Completion};

pub mod executor;
pub(crate) mod stall;
pub mod status;
pub mod watchdog;

use chorus_sync::gate::{Gate, Issue, Next};
use executor::{Core, Fatal, NativeSplit, TurnEnd};
use status::{AbortSignal, State, StatusReader, StatusWriter};

/// How long a parent waits, in all, for its children to finalize or abort.
pub const CHILD_DEADLINE: Duration = Duration::from_secs(10);

/// How long an aborting actor waits for a lent core to come back before it
/// gives up on it (the lease then aborts the backend itself on return).
const LEASE_RETURN_DEADLINE: Duration = Duration::from_secs(10);

/// A request for one op, built and validated by the `Comm` handle.
#[derive(Debug)]
pub(crate) struct Request {
    pub(crate) kind: OpKind,
    /// The op as the user gave it (for Avg post-processing and headers).
    pub(crate) user_op: Option<ReduceOp>,
    pub(crate) dtype: DType,
    pub(crate) root: Option<usize>,
    /// This rank's element count, as carried in the header.
    pub(crate) count: usize,
    /// Split sizes, as carried in the header.
    pub(crate) counts: Vec<usize>,
    pub(crate) data: OpData,
    /// For reduce on non-root ranks: the input, returned unchanged.
    pub(crate) keep: Option<Tensor>,
    /// all_gather / reduce_scatter `_into`: complete with `[output, input]`
    /// so the caller gets both buffers back for reuse.
    pub(crate) return_input: bool,
    /// gather_single: complete with the root's whole output, unsplit.
    pub(crate) whole: bool,
    /// all_to_all_into: the caller's outputs, filled from the op's output
    /// at completion, and its inputs; both returned (`None` otherwise).
    pub(crate) fill: Option<(Vec<Tensor>, Vec<Tensor>)>,
    /// A window op (kinds `NewWindow` and `Window`), run by
    /// [`Backend::window`] instead of `execute`.
    pub(crate) window: Option<crate::backends::WindowOp>,
    pub(crate) timeout: Duration,
    /// The caller's stream the op is ordered with (`Comm::with_stream`).
    pub(crate) stream: Option<crate::DeviceStream>,
    pub(crate) completer: Option<Completer>,
    /// Collective sequence number (assigned by the executor).
    pub(crate) seq: u64,
    /// When the op was issued, set only when its turn starts at once on the
    /// issuing thread: the turn then starts from it rather than reading the
    /// clock again (the time between is the op's validation and the gate).
    pub(crate) issued: Option<std::time::Instant>,
}

impl Request {
    pub(crate) fn collective(
        kind: OpKind,
        user_op: Option<ReduceOp>,
        dtype: DType,
        root: Option<usize>,
        count: usize,
        counts: Vec<usize>,
        data: OpData,
    ) -> Request {
        Request {
            kind,
            user_op,
            dtype,
            root,
            count,
            counts,
            data,
            keep: None,
            return_input: false,
            whole: false,
            fill: None,
            window: None,
            timeout: Duration::from_secs(600),
            stream: None,
            completer: None,
            seq: 0,
            issued: None,
        }
    }

    /// A window op: `NewWindow` / `FreeWindow` for
    /// [`crate::backends::WindowOp::Create`] / `Free` (collective, header
    /// checked), `Window` for the one-sided others.
    pub(crate) fn window(op: crate::backends::WindowOp, count: usize) -> Request {
        let kind = match op {
            crate::backends::WindowOp::Create { .. } => OpKind::NewWindow,
            crate::backends::WindowOp::Free { .. } => OpKind::FreeWindow,
            _ => OpKind::Window,
        };
        let mut r =
            Request::collective(kind, None, DType::U8, None, count, vec![], OpData::Barrier);
        r.window = Some(op);
        r
    }

    pub(crate) fn p2p(transfers: Vec<P2PTransfer>) -> Request {
        let dtype = transfers
            .first()
            .map(|t| t.buf.dtype())
            .unwrap_or(DType::U8);
        Request::collective(
            OpKind::P2P,
            None,
            dtype,
            None,
            0,
            vec![],
            OpData::P2P { ops: transfers },
        )
    }
}

/// Messages a [`CommActor`] handles.
pub enum CommMsg {
    /// The gate scheduled a drain (AC-6): run the next queued turn, or a
    /// lent turn's fatal outcome.
    Run,
    /// Finalize, behind every op issued before (a parent finalizing its
    /// children, AC-4): queues [`Queued::Finalize`] in this actor's gate.
    #[allow(private_interfaces)]
    Finalize(Option<Completer>),
    /// Act on the abort signal: fail every outstanding op, tell the peers,
    /// stop. The cause travels on the signal, raised before this is sent.
    #[allow(private_interfaces)]
    Abort {
        /// Completed when the abort is done.
        done: Option<Completer>,
    },
    /// The watchdog declared these ranks failed (AC-5).
    PeerFailed {
        /// Ranks declared failed.
        failed_ranks: Vec<usize>,
        /// What was observed.
        detail: String,
    },
    /// Idle tick: poll the backend for asynchronous errors (EX-7).
    Poll,
}

impl std::fmt::Debug for CommMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CommMsg::Run => f.write_str("Run"),
            CommMsg::Finalize(_) => f.write_str("Finalize"),
            CommMsg::Abort { .. } => f.write_str("Abort"),
            CommMsg::PeerFailed { failed_ranks, .. } => write!(f, "PeerFailed({failed_ranks:?})"),
            CommMsg::Poll => f.write_str("Poll"),
        }
    }
}

/// Identity of a communicator on one rank.
#[derive(Debug, Clone)]
pub struct CommInfo {
    /// Name.
    pub name: String,
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// Epoch.
    pub epoch: u64,
    /// How ops are checked across ranks.
    pub checks: crate::checks::Checks,
}

impl CommInfo {
    /// The actor's name: `<name>/<epoch>/<rank>`.
    pub fn actor_name(&self) -> String {
        format!("{}/{}/{}", self.name, self.epoch, self.rank)
    }
}

/// What waits in the gate's queue for the actor: an op, or a turn that
/// only the actor runs (a native split, the finalize).
pub(crate) enum Queued {
    /// An op, as one turn.
    Op(Box<Request>),
    /// Split the backend's communicator with the library's own call.
    Split {
        /// The split.
        args: SplitArgs,
        /// Where the outcome goes.
        reply: tokio::sync::oneshot::Sender<Result<NativeSplit>>,
    },
    /// Finalize children, close the backend, stop. Completes the given
    /// completer when done.
    Finalize(Option<Completer>),
}

impl Queued {
    /// Complete without running: the core is gone (`error` says why). A
    /// finalize of a communicator that already ended has nothing to do.
    fn refuse(self, error: Error) {
        match self {
            Queued::Op(mut req) => {
                if let Some(c) = req.completer.take() {
                    c.complete(Err(error));
                }
            }
            Queued::Split { reply, .. } => {
                let _ = reply.send(Err(error));
            }
            Queued::Finalize(done) => {
                if let Some(c) = done {
                    c.complete(Ok(Completion::Unit));
                }
            }
        }
    }
}

/// Where the actor keeps its core between turns (the ordering gate, AC-6),
/// and the communicator's abort signal and status, as everyone else sees
/// them. Created by the actor's starter, shared with handles.
pub(crate) struct Home {
    /// The one way to the core (AC-6).
    gate: Gate<Box<Core>, Queued>,
    /// Notified when a lent core comes back to an actor waiting for it.
    returned: tokio::sync::Notify,
    /// A lent turn's fatal outcome, for the actor to handle.
    fatal: Mutex<Option<Box<Fatal>>>,
    pub(crate) signal: Arc<AbortSignal>,
    pub(crate) status: StatusReader,
    pub(crate) info: CommInfo,
    /// The owning actor, set when it starts.
    pub(crate) actor: std::sync::OnceLock<ActorRef<CommMsg>>,
    /// The runtime the communicator's tasks and I/O run on.
    pub(crate) rt: tokio::runtime::Handle,
    /// `rt` is Chorus's own runtime, whose workers may sleep in the kernel
    /// during a turn; a caller's runtime only ever gets turns that yield.
    pub(crate) own_rt: bool,
    /// The communicator's hooks and flight recorder.
    pub(crate) obs: Arc<crate::hooks::Observer>,
}

impl Home {
    pub(crate) fn new(
        info: CommInfo,
        signal: Arc<AbortSignal>,
        status: StatusReader,
        rt: tokio::runtime::Handle,
        own_rt: bool,
        obs: Arc<crate::hooks::Observer>,
    ) -> Home {
        Home {
            rt,
            own_rt,
            obs,
            gate: Gate::empty(),
            returned: tokio::sync::Notify::new(),
            fatal: Mutex::new(None),
            signal,
            status,
            info,
            actor: std::sync::OnceLock::new(),
        }
    }

    fn fatal(&self) -> std::sync::MutexGuard<'_, Option<Box<Fatal>>> {
        self.fatal.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Take `req`'s place in the communicator's order (AC-6). Returns a
    /// lease on the core when nothing is ahead of it and the communicator
    /// is active: the caller runs the turn now, on its own thread or task.
    /// Otherwise the op is queued for the actor (or refused, once the
    /// communicator ended).
    pub(crate) fn submit(self: &Arc<Home>, req: Box<Request>) -> Option<(Lease, Box<Request>)> {
        let may_lend = self.status.state() == State::Active && !self.signal.is_raised();
        match self.gate.issue(Queued::Op(req), may_lend) {
            Issue::Lend(core, Queued::Op(req)) => Some((
                Lease {
                    home: self.clone(),
                    core: Some(core),
                    fatal: None,
                    finished: false,
                },
                req,
            )),
            Issue::Lend(core, other) => {
                // `issue` lends the op it was given: never reached.
                self.put_back(core, false);
                other.refuse(Error::Internal("the gate lent another request".into()));
                None
            }
            Issue::Queued { wake } => {
                if wake {
                    self.wake_actor();
                }
                None
            }
            Issue::Closed(item) => {
                let error = closed_error(&self.info, &self.status);
                self.status.told(&error);
                item.refuse(error);
                None
            }
        }
    }

    /// Queue a turn only the actor runs (a native split, the finalize)
    /// behind every op issued before it (AC-6).
    pub(crate) fn enqueue(&self, item: Queued) {
        match self.gate.issue(item, false) {
            Issue::Queued { wake: true } => self.wake_actor(),
            Issue::Queued { wake: false } => {}
            Issue::Closed(item) => {
                let error = closed_error(&self.info, &self.status);
                self.status.told(&error);
                item.refuse(error)
            }
            Issue::Lend(core, item) => {
                // `issue` never lends what may not be lent: never reached.
                self.put_back(core, false);
                item.refuse(Error::Internal("the gate lent an actor-only turn".into()));
            }
        }
    }

    /// Give the core back after a turn (`reserve`: for the actor, which
    /// has a fatal outcome to handle), and wake whom the gate names. A
    /// core that comes back to a closed gate is shut down here.
    fn put_back(&self, core: Box<Core>, reserve: bool) {
        match self.gate.put_back(core, reserve) {
            Ok(w) => {
                if w.waiter {
                    self.returned.notify_one();
                }
                if w.drainer {
                    self.wake_actor();
                }
            }
            Err(core) => {
                // The actor ended meanwhile (it gave up waiting for this
                // core): close the backend here.
                self.complete_fatal();
                self.shut_down_orphan(core);
            }
        }
    }

    /// Close the gate for good (GT-5): a lent turn's fatal op completes with
    /// its error, every queued request is refused with the communicator's
    /// closed error (its status must already say why), and the core comes
    /// back if it was at home.
    fn close(&self) -> Option<Box<Core>> {
        let (core, queued) = self.gate.close();
        self.complete_fatal();
        if !queued.is_empty() {
            let error = closed_error(&self.info, &self.status);
            self.status.told(&error);
            for item in queued {
                item.refuse(error.clone());
            }
        }
        core
    }

    /// Complete the op of a lent turn's fatal outcome, if one is waiting.
    fn complete_fatal(&self) {
        if let Some(f) = self.fatal().take() {
            if let Some(c) = f.completer {
                self.status.told(&f.error);
                c.complete(Err(f.error));
            }
        }
    }

    /// Abort the backend of a core that no actor will take again, in the
    /// background.
    fn shut_down_orphan(&self, mut core: Box<Core>) {
        let cause = self.status.cause().or_else(|| {
            self.signal
                .cause(&self.info.name, self.info.rank, self.info.epoch)
        });
        self.rt
            .spawn(async move { core.shutdown_aborted(cause.as_ref()).await });
    }

    /// Tell the actor a drain is scheduled (AC-6). If the actor is gone,
    /// end the communicator here: nothing queued may wait forever.
    fn wake_actor(&self) {
        let sent = self
            .actor
            .get()
            .is_some_and(|a| a.send_message(CommMsg::Run).is_ok());
        if !sent && self.actor.get().is_some() {
            if let Some(core) = self.close() {
                self.shut_down_orphan(core);
            }
        }
    }
}

/// One turn's exclusive use of the core on a caller's thread or task,
/// granted by [`Home::submit`]; gives the core back to the gate when
/// dropped. A lease dropped before its turn finished (the caller's runtime
/// shut down under it) is fatal to the communicator (AC-7).
pub(crate) struct Lease {
    home: Arc<Home>,
    core: Option<Box<Core>>,
    fatal: Option<Box<Fatal>>,
    /// The turn ran to its end.
    finished: bool,
}

impl Lease {
    /// Run `req` as one turn (the completer is completed before this
    /// returns, unless the outcome is fatal: then the actor completes it).
    /// `may_block`: the thread running it may sleep in the kernel (a
    /// blocked caller's), see [`crate::backends::OpCtx::may_block`].
    pub(crate) async fn run(mut self, req: Box<Request>, may_block: bool) {
        let Some(core) = self.core.as_mut() else {
            return;
        };
        let span = core.span();
        let end = core
            .turn(req, &self.home.signal, may_block)
            .instrument(span)
            .await;
        self.finished = true;
        if let TurnEnd::Fatal(f) = end {
            self.fatal = Some(f);
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let Some(core) = self.core.take() else {
            return;
        };
        let mut fatal = self.fatal.take();
        if !self.finished {
            // AC-7: the turn's future was dropped mid-op; its completer was
            // completed with this cause by the turn itself (EX-9).
            let info = &self.home.info;
            let cause = executor::dropped_turn_error(&info.name, info.rank, info.epoch);
            self.home.signal.raise(cause.clone());
            let cause = self
                .home
                .signal
                .cause(&info.name, info.rank, info.epoch)
                .unwrap_or(cause);
            fatal = Some(Fatal::no_op(cause));
        }
        let reserve = fatal.is_some();
        if let Some(f) = fatal {
            *self.home.fatal() = Some(f);
        }
        self.home.put_back(core, reserve);
    }
}

/// Start-up arguments of a [`CommActor`].
pub struct CommArgs {
    pub(crate) backend: Box<dyn Backend>,
    pub(crate) home: Arc<Home>,
    pub(crate) status: StatusWriter,
    pub(crate) watchdog: Option<watchdog::WatchdogConfig>,
    pub(crate) keys: Option<executor::KeyRelease>,
}

/// The actor behind one communicator on one rank.
#[derive(Debug, Default)]
pub struct CommActor;

/// The actor's state.
pub struct CommState {
    home: Arc<Home>,
    status: StatusWriter,
    /// The core is gone for good (finalized or aborted).
    done: bool,
    /// The idle-poll ticker (EX-7).
    poll: Option<tokio::task::JoinHandle<()>>,
}

/// The error of a request that reaches a communicator whose core is gone:
/// revoked by the abort's cause (AC-5), or `Finalized`.
pub(crate) fn closed_error(info: &CommInfo, status: &StatusReader) -> Error {
    match status.state() {
        State::Aborted => executor::revoked_error(info, status.cause().as_ref()),
        _ => status.closed_error(&info.name, info.rank, info.epoch),
    }
}

impl CommState {
    fn info(&self) -> &CommInfo {
        &self.home.info
    }

    /// Give the core back to the gate after a turn; wake this actor again
    /// if ops queued up meanwhile (AC-6).
    fn offer(&self, core: Box<Core>) {
        self.home.put_back(core, false);
    }

    /// Take the core out of turn, to end the communicator: at once if it
    /// is at home, else when the lent turn that holds it returns it (an
    /// abort ends that turn at once), giving up after
    /// [`LEASE_RETURN_DEADLINE`]. `None` once the core is gone.
    async fn take_core_now(&mut self) -> Option<Box<Core>> {
        loop {
            if let Some(core) = self.home.gate.take_now() {
                return Some(core);
            }
            if self.done || self.home.gate.is_closed() {
                return None;
            }
            let returned = self.home.returned.notified();
            if tokio::time::timeout(LEASE_RETURN_DEADLINE, returned)
                .await
                .is_err()
            {
                tracing::warn!(comm = %self.info().name, rank = self.info().rank,
                    "a lent turn did not return within {LEASE_RETURN_DEADLINE:?}");
                return None;
            }
        }
    }

    /// Run what the gate gives this actor (one wake-up, one turn): a lent
    /// turn's fatal outcome first, else the queue's next entry.
    async fn drain(&mut self, myself: &ActorRef<CommMsg>) {
        let fatal = self.home.fatal().take();
        if let Some(f) = fatal {
            // The lease reserved the core for this (at home: GT-4).
            let core = self.home.gate.take_now();
            self.fail(myself, core, f).await;
            return;
        }
        let (mut core, item) = match self.home.gate.next() {
            Next::Run(core, item) => (core, item),
            Next::Idle => return,
        };
        match item {
            Queued::Op(req) => {
                let span = core.span();
                let may_block = self.home.own_rt;
                let end = core
                    .turn(req, &self.home.signal, may_block)
                    .instrument(span)
                    .await;
                self.after_turn(myself, core, end).await;
            }
            Queued::Split { args, reply } => match core.native_split(args).await {
                Ok(r) => {
                    self.after_turn(myself, core, TurnEnd::Done).await;
                    let _ = reply.send(Ok(r));
                }
                Err(e) => {
                    self.fail(myself, Some(core), Fatal::no_op(e.clone())).await;
                    let _ = reply.send(Err(e));
                }
            },
            Queued::Finalize(done) => {
                // AC-4: children first.
                finalize_children(myself, &self.home).await;
                if self.home.signal.is_raised() {
                    self.abort_now(myself, Some(core)).await;
                } else {
                    core.finalize().await;
                    self.status.finalize();
                    self.done = true;
                    if let Some(p) = self.poll.take() {
                        p.abort();
                    }
                    // AC-3: requests behind Finalize complete with Finalized.
                    let _ = self.home.close();
                    let _ = myself.drain();
                }
                if let Some(c) = done {
                    c.complete(Ok(Completion::Unit));
                }
            }
        }
    }

    /// After a turn: offer the core again, or act on the outcome.
    async fn after_turn(&mut self, myself: &ActorRef<CommMsg>, core: Box<Core>, end: TurnEnd) {
        match end {
            TurnEnd::Done if self.home.signal.is_raised() => {
                self.abort_now(myself, Some(core)).await
            }
            TurnEnd::Done => self.offer(core),
            TurnEnd::Fatal(f) => self.fail(myself, Some(core), f).await,
        }
    }

    /// A fatal outcome: record it (the status first, so that whoever sees
    /// the op's error sees the communicator aborted), complete the op, shut
    /// down.
    async fn fail(&mut self, myself: &ActorRef<CommMsg>, core: Option<Box<Core>>, f: Box<Fatal>) {
        let Fatal {
            cause,
            error,
            completer,
        } = *f;
        let first = self.status.abort(cause.clone());
        self.home.signal.raise(cause.clone());
        if first {
            // HK-3: the abort hooks and the flight recorder's dump come
            // before any op is failed; the dump shows this op failed.
            if let Some(c) = &completer {
                c.failing(&error);
            }
            self.home.obs.aborted(&cause).await;
        }
        if let Some(c) = completer {
            self.status.told(&error);
            c.complete(Err(error));
        }
        self.shutdown(myself, core, cause).await;
    }

    /// Act on a raised abort signal (or abort with a generic cause).
    async fn abort_now(&mut self, myself: &ActorRef<CommMsg>, core: Option<Box<Core>>) {
        if self.done {
            return;
        }
        let info = self.info().clone();
        let cause = self
            .home
            .signal
            .cause(&info.name, info.rank, info.epoch)
            .unwrap_or_else(|| executor::revoked_error(&info, None));
        self.home.signal.raise(cause.clone());
        let first = self.status.abort(cause.clone());
        tracing::warn!(comm = %info.name, rank = info.rank, epoch = info.epoch, %cause, "aborting communicator");
        if first {
            // HK-3: before the op in flight and the queued ones are failed.
            self.home.obs.aborted(&cause).await;
        }
        let core = match core {
            Some(c) => Some(c),
            None => self.take_core_now().await,
        };
        self.shutdown(myself, core, cause).await;
    }

    /// The end of an aborted communicator: backend aborted (EX-2), children
    /// aborted (AC-4), the mailbox drained (AC-3).
    async fn shutdown(
        &mut self,
        myself: &ActorRef<CommMsg>,
        core: Option<Box<Core>>,
        cause: Error,
    ) {
        self.done = true;
        // AC-3, GT-5: nothing runs any more; what is queued is revoked,
        // and a lent core that comes back later is closed by its lease.
        let at_home = self.home.close();
        let core = core.or(at_home);
        if let Some(p) = self.poll.take() {
            p.abort();
        }
        if let Some(mut core) = core {
            core.shutdown_aborted(Some(&cause)).await;
        }
        abort_children(myself).await;
        let _ = myself.drain();
    }
}

/// AC-4: abort every live child, concurrently, within [`CHILD_DEADLINE`]
/// in all. Their signals were raised with this communicator's.
async fn abort_children(myself: &ActorRef<CommMsg>) {
    let waits = myself.get_children().into_iter().map(|child| async move {
        let (work, completer) = crate::work::Work::new(crate::work::to_unit);
        if child
            .send_message(CommMsg::Abort {
                done: Some(completer),
            })
            .is_ok()
        {
            let _ = work.await;
        }
        let _ = child.wait(None).await;
    });
    let _ = tokio::time::timeout(CHILD_DEADLINE, futures::future::join_all(waits)).await;
}

/// AC-4: finalize every live child, concurrently, within [`CHILD_DEADLINE`]
/// in all; an abort of this communicator raised meanwhile ends the wait.
/// Children still running after the deadline are aborted.
async fn finalize_children(myself: &ActorRef<CommMsg>, home: &Home) {
    let children = myself.get_children();
    if children.is_empty() {
        return;
    }
    let waits = children.iter().map(|child| async move {
        let (work, completer) = crate::work::Work::new(crate::work::to_unit);
        if child
            .send_message(CommMsg::Finalize(Some(completer)))
            .is_ok()
        {
            let _ = work.await;
        }
        let _ = child.wait(None).await;
    });
    let finished = tokio::select! {
        biased;
        _ = home.signal.raised() => false,
        r = tokio::time::timeout(CHILD_DEADLINE, futures::future::join_all(waits)) => r.is_ok(),
    };
    if !finished && !home.signal.is_raised() {
        let info = &home.info;
        home.signal.raise_children(Error::Aborted {
            comm: info.name.clone(),
            rank: info.rank,
            epoch: info.epoch,
            failed_ranks: vec![],
            reason: format!(
                "parent communicator {:?} is finalizing and its children did not finish \
                 within {CHILD_DEADLINE:?}",
                info.name
            ),
        });
        abort_children(myself).await;
    }
}

impl Actor for CommActor {
    type Msg = CommMsg;
    type State = CommState;
    type Arguments = CommArgs;

    async fn pre_start(
        &self,
        myself: ActorRef<CommMsg>,
        args: CommArgs,
    ) -> std::result::Result<CommState, ActorProcessingErr> {
        crate::debug::LIVE_ACTORS.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let CommArgs {
            backend,
            home,
            status,
            watchdog,
            keys,
        } = args;
        let _ = home.actor.set(myself.clone());
        let watchdog =
            watchdog.and_then(|cfg| watchdog::Watchdog::start(cfg, myself.clone(), home.clone()));
        let core = Core::new(home.info.clone(), backend, watchdog).with_keys(keys);
        // EX-7: only backends that can fail on their own are polled.
        let poll = core
            .polls_async_errors()
            .then(|| myself.send_interval(executor::IDLE_POLL, || CommMsg::Poll));
        home.put_back(Box::new(core), false);
        Ok(CommState {
            home,
            status,
            done: false,
            poll,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<CommMsg>,
        message: CommMsg,
        state: &mut CommState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        // An abort asked for while this message waited goes first.
        if state.home.signal.is_raised() && !state.done {
            state.abort_now(&myself, None).await;
        }
        match message {
            CommMsg::Run => {
                if !state.done {
                    state.drain(&myself).await;
                }
            }
            CommMsg::Finalize(done) => state.home.enqueue(Queued::Finalize(done)),
            CommMsg::Abort { done } => {
                if !state.done {
                    state.abort_now(&myself, None).await;
                }
                if let Some(c) = done {
                    c.complete(Ok(Completion::Unit));
                }
            }
            CommMsg::PeerFailed {
                failed_ranks,
                detail,
            } => {
                // The watchdog raised the signal before sending this; raise
                // it here too in case this came another way.
                let info = state.info().clone();
                state.home.signal.raise(Error::PeerFailed {
                    comm: info.name,
                    rank: info.rank,
                    epoch: info.epoch,
                    op: "watchdog",
                    failed_ranks,
                    detail,
                });
                state.abort_now(&myself, None).await;
            }
            CommMsg::Poll => {
                // Lent, or ops are queued: those turns watch the library.
                if let Some(mut core) = state.home.gate.take_idle() {
                    match core.poll_idle().await {
                        None => state.offer(core),
                        Some(e) => state.fail(&myself, Some(core), Fatal::no_op(e)).await,
                    }
                }
            }
        }
        Ok(())
    }

    async fn handle_supervisor_evt(
        &self,
        _myself: ActorRef<CommMsg>,
        event: SupervisionEvent,
        state: &mut CommState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        // Override ractor's default (stop the parent when any child exits).
        tracing::debug!(comm = %state.info().name, rank = state.info().rank, ?event, "supervision event");
        let failure = match event {
            SupervisionEvent::ActorTerminated(cell, Some(mut last), _) => {
                last.take::<CommState>().ok().and_then(|child| {
                    (child.home.status.state() == State::Aborted).then(|| status::ChildFailure {
                        name: cell.get_name().unwrap_or_default(),
                        reason: child
                            .home
                            .status
                            .cause()
                            .map(|e| e.to_string())
                            .unwrap_or_else(|| "aborted".into()),
                    })
                })
            }
            SupervisionEvent::ActorFailed(cell, e) => Some(status::ChildFailure {
                name: cell.get_name().unwrap_or_default(),
                reason: format!("the child's actor failed: {e}"),
            }),
            _ => None,
        };
        if let Some(f) = failure {
            tracing::warn!(comm = %state.info().name, child = %f.name, reason = %f.reason, "child communicator failed");
            state.status.child_failed(f);
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        myself: ActorRef<CommMsg>,
        state: &mut CommState,
    ) -> std::result::Result<(), ActorProcessingErr> {
        // Stopped without a finalize or abort (e.g. killed): never leave a
        // backend, a child or an op behind.
        if !state.done {
            state.home.signal.raise(Error::Aborted {
                comm: state.info().name.clone(),
                rank: state.info().rank,
                epoch: state.info().epoch,
                failed_ranks: vec![],
                reason: "the communicator's actor stopped".into(),
            });
            let info = state.info().clone();
            let cause = state
                .home
                .signal
                .cause(&info.name, info.rank, info.epoch)
                .unwrap_or_else(|| executor::revoked_error(&info, None));
            if state.status.abort(cause.clone()) {
                state.home.obs.aborted(&cause).await;
            }
            let core = state.home.close();
            state.done = true;
            if let Some(mut core) = core {
                core.shutdown_aborted(Some(&cause)).await;
            }
        }
        if let Some(p) = state.poll.take() {
            p.abort();
        }
        if !myself.get_children().is_empty() {
            abort_children(&myself).await;
        }
        crate::debug::LIVE_ACTORS.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        Ok(())
    }
}
