//! Actors: one [`CommActor`] per communicator, the single owner of its core.
//!
//! The actor owns the communicator's core (`executor::Core`: the backend
//! and through it the device stream, the sequence numbers, the
//! heartbeats) and is the only writer of its [`status`]. Every op is one
//! *turn* of the actor (`executor::Core::turn`). A [`Comm`] handle asks
//! for a turn with [`CommMsg::Submit`]; the actor runs it in its handler and
//! the turn completes the op's [`Work`](crate::Work) directly: one hand-off
//! from the caller to the owner, one back.
//!
//! **Turns on a blocked caller's thread.** Between turns the actor keeps
//! its core in its `Home`, where it *offers* it: a caller that is about to
//! block on a communicator with nothing queued accepts the offer
//! (`Home::lend`), receives a `Lease` and runs that one turn on its own
//! thread instead of waking the actor, which is most of the cost of a small
//! op. The lease is exclusive (the core is moved out of the home, never
//! shared), limited to one turn, and returns the core when it is dropped; a
//! fatal outcome goes back with it, for the actor to handle. Which thread
//! runs a turn is a scheduling choice of the actor's: the same
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
//! | AC-6 | a request counted as pending (sent to the mailbox, not yet started) keeps the core out of any lease, so a blocked caller never overtakes an op submitted before it. |
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
pub mod status;
pub mod watchdog;

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
    /// A window op (kinds `NewWindow` and `Window`), run by
    /// [`Backend::window`] instead of `execute`.
    pub(crate) window: Option<crate::backends::WindowOp>,
    pub(crate) timeout: Duration,
    /// The caller's stream the op is ordered with (`Comm::with_stream`).
    pub(crate) stream: Option<crate::DeviceStream>,
    pub(crate) completer: Option<Completer>,
    /// Collective sequence number (assigned by the executor).
    pub(crate) seq: u64,
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
            window: None,
            timeout: Duration::from_secs(600),
            stream: None,
            completer: None,
            seq: 0,
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
    /// Run an op as one turn, after every request submitted before it
    /// (counted as pending by the submitter, AC-6).
    #[allow(private_interfaces)]
    Submit(Box<Request>),
    /// Split the backend's communicator with the library's own call, as one
    /// turn (counted as pending).
    #[allow(private_interfaces)]
    Split {
        /// The split.
        args: SplitArgs,
        /// Where the outcome goes.
        reply: tokio::sync::oneshot::Sender<Result<NativeSplit>>,
    },
    /// Finalize children, run every queued op, close the backend, stop
    /// (counted as pending). Completes the given completer when done.
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
    /// A lease came back with a fatal outcome for the actor to handle.
    Wake,
    /// Idle tick: poll the backend for asynchronous errors (EX-7).
    Poll,
}

impl std::fmt::Debug for CommMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CommMsg::Submit(r) => write!(f, "Submit({})", r.kind.name()),
            CommMsg::Split { .. } => f.write_str("Split"),
            CommMsg::Finalize(_) => f.write_str("Finalize"),
            CommMsg::Abort { .. } => f.write_str("Abort"),
            CommMsg::PeerFailed { failed_ranks, .. } => write!(f, "PeerFailed({failed_ranks:?})"),
            CommMsg::Wake => f.write_str("Wake"),
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
}

impl CommInfo {
    /// The actor's name: `<name>/<epoch>/<rank>`.
    pub fn actor_name(&self) -> String {
        format!("{}/{}/{}", self.name, self.epoch, self.rank)
    }
}

#[derive(Default)]
struct Slot {
    /// The core, while the actor offers it.
    core: Option<Box<Core>>,
    /// Requests in the mailbox that need the core and have not started (AC-6).
    pending: usize,
    /// The actor is waiting for a lent core.
    wanted: bool,
    /// A lent turn's fatal outcome.
    fatal: Option<Box<Fatal>>,
    /// The actor shut down: a core that comes back now is closed by its lease.
    closed: bool,
}

/// Where the actor keeps its core between turns, offered to blocked
/// callers, and the communicator's abort signal and status, as everyone
/// else sees them. Created by the actor's starter, shared with handles.
pub(crate) struct Home {
    slot: Mutex<Slot>,
    returned: tokio::sync::Notify,
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
            slot: Mutex::new(Slot::default()),
            returned: tokio::sync::Notify::new(),
            signal,
            status,
            info,
            actor: std::sync::OnceLock::new(),
        }
    }

    fn slot(&self) -> std::sync::MutexGuard<'_, Slot> {
        self.slot.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Accept the actor's offer of its core for one turn on this thread:
    /// `Some` only if the communicator is active, nothing is pending
    /// (AC-6) and the actor is not running a turn.
    pub(crate) fn lend(self: &Arc<Home>) -> Option<Lease> {
        if self.status.state() != State::Active || self.signal.is_raised() {
            return None;
        }
        let mut slot = self.slot();
        if slot.pending != 0 || slot.fatal.is_some() {
            return None;
        }
        let core = slot.core.take()?;
        Some(Lease {
            home: self.clone(),
            core: Some(core),
            fatal: None,
        })
    }

    /// Count a request about to be sent to the mailbox (AC-6).
    pub(crate) fn count_pending(&self) {
        self.slot().pending += 1;
    }

    /// Undo [`Home::count_pending`] for a request that was not delivered.
    pub(crate) fn uncount_pending(&self) {
        let mut slot = self.slot();
        slot.pending = slot.pending.saturating_sub(1);
    }
}

/// One turn's exclusive use of the core on a caller's thread, granted by
/// [`Home::lend`]; returns the core to the actor when dropped.
pub(crate) struct Lease {
    home: Arc<Home>,
    core: Option<Box<Core>>,
    fatal: Option<Box<Fatal>>,
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
        if let TurnEnd::Fatal(f) = end {
            self.fatal = Some(f);
        }
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let fatal = self.fatal.take();
        let wake = fatal.is_some();
        {
            let mut slot = self.home.slot();
            if slot.closed {
                // The actor gave up waiting for this lease and shut down.
                if let Some(mut core) = self.core.take() {
                    let cause = self.home.status.cause();
                    self.home
                        .rt
                        .spawn(async move { core.shutdown_aborted(cause.as_ref()).await });
                }
                if let Some(f) = fatal {
                    if let Some(c) = f.completer {
                        c.complete(Err(f.error));
                    }
                }
                return;
            }
            slot.core = self.core.take();
            if fatal.is_some() {
                slot.fatal = fatal;
            }
            if std::mem::take(&mut slot.wanted) {
                self.home.returned.notify_one();
            }
        }
        if wake {
            // The actor is alive: it stops only once it holds the core.
            if let Some(actor) = self.home.actor.get() {
                let _ = actor.send_message(CommMsg::Wake);
            }
        }
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

    fn closed_error(&self) -> Error {
        closed_error(&self.home.info, &self.home.status)
    }

    /// Put the core back where blocked callers may lease it.
    fn offer(&self, core: Box<Core>) {
        self.home.slot().core = Some(core);
    }

    /// Take the core for a turn; `counted`: the request was counted as
    /// pending (AC-6). A fatal outcome a lease left behind is handled
    /// first. `None` once the core is gone.
    async fn take_core(&mut self, myself: &ActorRef<CommMsg>, counted: bool) -> Option<Box<Core>> {
        let mut counted = counted;
        loop {
            let (core, fatal) = {
                let mut slot = self.home.slot();
                if std::mem::take(&mut counted) {
                    slot.pending = slot.pending.saturating_sub(1);
                }
                let (core, fatal) = (slot.core.take(), slot.fatal.take());
                if core.is_none() && !self.done {
                    slot.wanted = true;
                }
                (core, fatal)
            };
            match (core, fatal) {
                (Some(core), Some(f)) => {
                    self.fail(myself, Some(core), f).await;
                    return None;
                }
                (Some(core), None) => return Some(core),
                (None, _) if self.done => return None,
                (None, _) => {
                    // Lent to a blocked caller: its turn returns it (an
                    // abort ends that turn at once).
                    if self.home.signal.is_raised() {
                        if tokio::time::timeout(
                            LEASE_RETURN_DEADLINE,
                            self.home.returned.notified(),
                        )
                        .await
                        .is_err()
                        {
                            tracing::warn!(comm = %self.info().name, rank = self.info().rank,
                                "a lent turn did not return within {LEASE_RETURN_DEADLINE:?}");
                            return None;
                        }
                    } else {
                        self.home.returned.notified().await;
                    }
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
            None => self.take_core(myself, false).await,
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
        {
            let mut slot = self.home.slot();
            slot.wanted = false;
            slot.closed = true;
        }
        if let Some(p) = self.poll.take() {
            p.abort();
        }
        if let Some(mut core) = core {
            core.shutdown_aborted(Some(&cause)).await;
        }
        abort_children(myself).await;
        let _ = myself.drain();
    }

    /// Complete `req` without running it: the core is gone.
    fn refuse(&self, mut req: Box<Request>) {
        if let Some(c) = req.completer.take() {
            c.complete(Err(self.closed_error()));
        }
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
        home.slot().core = Some(Box::new(core));
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
            CommMsg::Submit(req) => match state.take_core(&myself, true).await {
                None => state.refuse(req),
                Some(mut core) => {
                    let span = core.span();
                    let may_block = state.home.own_rt;
                    let end = core
                        .turn(req, &state.home.signal, may_block)
                        .instrument(span)
                        .await;
                    state.after_turn(&myself, core, end).await;
                }
            },
            CommMsg::Split { args, reply } => match state.take_core(&myself, true).await {
                None => {
                    let _ = reply.send(Err(state.closed_error()));
                }
                Some(mut core) => match core.native_split(args).await {
                    Ok(r) => {
                        state.after_turn(&myself, core, TurnEnd::Done).await;
                        let _ = reply.send(Ok(r));
                    }
                    Err(e) => {
                        state
                            .fail(&myself, Some(core), Fatal::no_op(e.clone()))
                            .await;
                        let _ = reply.send(Err(e));
                    }
                },
            },
            CommMsg::Finalize(done) => {
                if !state.done {
                    // AC-4: children first.
                    finalize_children(&myself, &state.home).await;
                }
                match state.take_core(&myself, true).await {
                    Some(mut core) if !state.home.signal.is_raised() => {
                        core.finalize().await;
                        state.status.finalize();
                        state.done = true;
                        if let Some(p) = state.poll.take() {
                            p.abort();
                        }
                        // AC-3: requests behind Finalize complete with Finalized.
                        let _ = myself.drain();
                    }
                    Some(core) => state.abort_now(&myself, Some(core)).await,
                    None if !state.done => state.abort_now(&myself, None).await,
                    None => {}
                }
                if let Some(c) = done {
                    c.complete(Ok(Completion::Unit));
                }
            }
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
            CommMsg::Wake => {
                if let Some(core) = state.take_core(&myself, false).await {
                    state.after_turn(&myself, core, TurnEnd::Done).await;
                }
            }
            CommMsg::Poll => {
                let idle = {
                    let mut slot = state.home.slot();
                    if slot.pending == 0 && slot.fatal.is_none() {
                        slot.core.take()
                    } else {
                        None
                    }
                };
                // Lent, or ops are queued: those turns watch the library.
                if let Some(mut core) = idle {
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
            let core = state.home.slot().core.take();
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
