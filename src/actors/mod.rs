//! Actors: one [`CommActor`] per communicator.
//!
//! The actor is the communicator's single point of control: its lifecycle
//! (finalize, abort, peer-failure notices) and its children. It owns the
//! communicator's executor ([`executor`]), which runs ops one at a time on
//! the backend: header exchange and mismatch check, the transfer itself,
//! the timeout, and exactly one completion per request. A [`Comm`] handle
//! submits ops as [`CommMsg::Submit`]; the actor forwards them to the
//! executor's queue in mailbox order. One fast path skips both: a blocking
//! op issued when nothing is queued runs on the calling thread (EX-6). The
//! executor stamps sequence numbers in the order ops run, which is the
//! mailbox order for queued ops. Handlers stay short and never block: a
//! long collective never delays an `Abort` waiting in the mailbox.
//!
//! Supervision: ractor's default `handle_supervisor_evt` stops a parent when
//! any child exits. A communicator must not die because a child (a split)
//! finalized, so `CommActor` overrides it and only records the event: a child
//! that stopped for any reason other than a clean finalize is recorded as a
//! child failure, visible through the parent's [`Comm::health`].
//!
//! Failure detection: the executor owns a [`watchdog`] task (heartbeats over
//! the store); when it declares peers failed it sends
//! [`CommMsg::PeerFailed`], and the actor revokes every outstanding op with
//! `Error::PeerFailed` (stamped with the epoch) and aborts the communicator.
//!
//! Invariants:
//! - AC-1: collective sequence numbers are assigned in the order ops run
//!   (EX-6), starting at 0, the same on every rank that issues the same ops.
//! - AC-2: point-to-point sequence numbers are counted per peer.
//! - AC-3: after `Abort` or `Finalize` the actor stops; every request still
//!   queued completes (aborted, or run to completion for finalize) first.
//! - AC-4: children (splits) are aborted or finalized before their parent; a
//!   parent never stops with a live child (SV-1: a child never outlives its
//!   parent).
//! - AC-5: after `PeerFailed`, every outstanding and queued op completes with
//!   that `Error::PeerFailed`; later ops fail with `Error::Aborted` carrying the
//!   failed ranks.
//!
//! [`Comm`]: crate::Comm
//! [`Comm::health`]: crate::Comm::health

use std::sync::atomic::{AtomicU8, AtomicUsize};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ractor::{Actor, ActorProcessingErr, ActorRef, SupervisionEvent};
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::backends::{Backend, OpData, P2PTransfer};
use crate::error::Error;
use crate::op::{OpKind, ReduceOp};
use crate::tensor::{DType, Tensor};
use crate::work::Completer;

pub mod executor;
pub mod watchdog;

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
    pub(crate) timeout: Duration,
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
            timeout: Duration::from_secs(600),
            completer: None,
            seq: 0,
        }
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
    /// Run an op (queued behind every op submitted before it). The
    /// submitter counted it in the executor's `queued` (EX-6).
    #[allow(private_interfaces)]
    Submit(Box<Request>),
    /// Run every queued op, close the backend, stop. Completes the given
    /// completer when done.
    #[allow(private_interfaces)]
    Finalize(Option<Completer>),
    /// Fail every outstanding op, tell the peers, stop.
    #[allow(private_interfaces)]
    Abort {
        /// Why.
        reason: String,
        /// Completed when the abort is done.
        done: Option<Completer>,
    },
    /// The watchdog declared these ranks failed: revoke every outstanding op
    /// with `Error::PeerFailed` and abort (AC-5).
    PeerFailed {
        /// Ranks declared failed.
        failed_ranks: Vec<usize>,
        /// What was observed.
        detail: String,
    },
    /// A child communicator (split) was created under this one (AC-4).
    #[allow(private_interfaces)]
    AddChild(Child, Option<Completer>),
}

impl std::fmt::Debug for CommMsg {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CommMsg::Submit(r) => write!(f, "Submit({})", r.kind.name()),
            CommMsg::Finalize(_) => f.write_str("Finalize"),
            CommMsg::Abort { reason, .. } => write!(f, "Abort({reason})"),
            CommMsg::PeerFailed { failed_ranks, .. } => write!(f, "PeerFailed({failed_ranks:?})"),
            CommMsg::AddChild(..) => f.write_str("AddChild"),
        }
    }
}

/// A child communicator as its parent tracks it.
#[derive(Clone)]
pub(crate) struct Child {
    pub(crate) actor: ActorRef<CommMsg>,
    pub(crate) state: Arc<AtomicU8>,
    pub(crate) poison: Arc<Mutex<Option<Error>>>,
    pub(crate) name: String,
}

/// A child that ended aborted (by a failure or an abort) failed; one that
/// finalized did not.
fn child_failure(c: Child) -> Option<crate::elastic::ChildFailure> {
    if c.state.load(std::sync::atomic::Ordering::Acquire) != crate::comm::STATE_ABORTED {
        return None;
    }
    let cause = c.poison.lock().ok().and_then(|p| p.clone());
    Some(crate::elastic::ChildFailure {
        name: c.name,
        reason: cause
            .map(|e| e.to_string())
            .unwrap_or_else(|| "aborted".into()),
    })
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

/// Start-up arguments of a [`CommActor`].
pub struct CommArgs {
    pub(crate) info: CommInfo,
    pub(crate) backend: Box<dyn Backend>,
    pub(crate) state: Arc<AtomicU8>,
    pub(crate) poison: Arc<Mutex<Option<Error>>>,
    pub(crate) health: Arc<Mutex<crate::elastic::HealthState>>,
    pub(crate) watchdog: Option<watchdog::WatchdogConfig>,
    /// Set by `pre_start`: how `Comm` handles reach the executor.
    pub(crate) exec_out: Arc<std::sync::OnceLock<executor::ExecHandle>>,
}

/// The actor behind one communicator on one rank.
#[derive(Debug, Default)]
pub struct CommActor;

/// The actor's state.
pub struct CommState {
    info: CommInfo,
    tx: mpsc::UnboundedSender<executor::ExecMsg>,
    /// Ops submitted and not yet started by the executor (EX-6).
    queued: Arc<AtomicUsize>,
    cancel: CancellationToken,
    abort_reason: Arc<Mutex<Option<String>>>,
    exec: Option<tokio::task::JoinHandle<()>>,
    revoke: Arc<Mutex<Option<Error>>>,
    poison: Arc<Mutex<Option<Error>>>,
    state: Arc<AtomicU8>,
    health: Arc<Mutex<crate::elastic::HealthState>>,
    children: Vec<Child>,
}

impl CommState {
    /// The error of a request that arrives after the executor ended.
    fn closed_error(&self) -> Error {
        crate::comm::closed_error(
            &self.info.name,
            self.info.rank,
            self.info.epoch,
            self.state.load(std::sync::atomic::Ordering::Acquire),
            &self.poison,
        )
    }

    /// AC-4: abort every live child and wait (bounded) for each to finish.
    async fn abort_children(&mut self, reason: &str) {
        for child in std::mem::take(&mut self.children) {
            let child = child.actor;
            let (work, completer) = crate::work::Work::new(crate::work::to_unit);
            if child
                .send_message(CommMsg::Abort {
                    reason: format!("parent communicator {:?}: {reason}", self.info.name),
                    done: Some(completer),
                })
                .is_ok()
            {
                let _ = tokio::time::timeout(Duration::from_secs(10), work).await;
            }
            let _ = tokio::time::timeout(Duration::from_secs(5), child.wait(None)).await;
        }
    }

    /// AC-4: finalize every live child and wait for each to finish.
    async fn finalize_children(&mut self) {
        for child in std::mem::take(&mut self.children) {
            let child = child.actor;
            let (work, completer) = crate::work::Work::new(crate::work::to_unit);
            if child
                .send_message(CommMsg::Finalize(Some(completer)))
                .is_ok()
            {
                let _ = work.await;
            }
            let _ = tokio::time::timeout(Duration::from_secs(5), child.wait(None)).await;
        }
    }

    /// Stop the executor after an abort, and wait for it.
    async fn stop_executor(&mut self, reason: String) {
        if let Ok(mut r) = self.abort_reason.lock() {
            r.get_or_insert(reason);
        }
        self.cancel.cancel();
        if let Some(h) = self.exec.take() {
            let _ = h.await;
        }
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
    ) -> Result<CommState, ActorProcessingErr> {
        let (tx, rx) = mpsc::unbounded_channel();
        let cancel = CancellationToken::new();
        let abort_reason = Arc::new(Mutex::new(None));
        let revoke = Arc::new(Mutex::new(None));
        crate::debug::LIVE_ACTORS.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let watchdog = args
            .watchdog
            .and_then(|cfg| watchdog::Watchdog::start(cfg, myself.clone()));
        let poison = args.poison.clone();
        let comm_state = args.state.clone();
        let core = Arc::new(tokio::sync::Mutex::new(executor::ExecCore {
            watchdog,
            revoke: revoke.clone(),
            _live: executor::LiveBackend::new(),
            p2p_seq: vec![0; args.info.size],
            coll_seq: 0,
            closed: false,
            info: args.info.clone(),
            backend: args.backend,
            cancel: cancel.clone(),
            abort_reason: abort_reason.clone(),
            state: args.state,
            poison: args.poison,
            actor: myself,
        }));
        let queued = Arc::new(AtomicUsize::new(0));
        let _ = args.exec_out.set(executor::ExecHandle {
            queued: queued.clone(),
            core: core.clone(),
        });
        let exec = executor::Executor {
            core,
            rx,
            queued: queued.clone(),
        };
        let handle = tokio::spawn(exec.run());
        Ok(CommState {
            info: args.info,
            tx,
            queued,
            cancel,
            abort_reason,
            exec: Some(handle),
            revoke,
            poison,
            state: comm_state,
            health: args.health,
            children: vec![],
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<CommMsg>,
        message: CommMsg,
        state: &mut CommState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            CommMsg::Submit(req) => {
                if let Err(mpsc::error::SendError(executor::ExecMsg::Run(mut req))) =
                    state.tx.send(executor::ExecMsg::Run(req))
                {
                    // The executor ended (finalized or aborted).
                    state
                        .queued
                        .fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
                    if let Some(c) = req.completer.take() {
                        c.complete(Err(state.closed_error()));
                    }
                }
            }
            CommMsg::Finalize(done) => {
                // AC-4: children first.
                state.finalize_children().await;
                // AC-3: queued behind every submitted op; the executor stops the actor.
                if let Err(mpsc::error::SendError(executor::ExecMsg::Finalize(Some(c)))) =
                    state.tx.send(executor::ExecMsg::Finalize(done))
                {
                    c.complete(Ok(crate::work::Completion::Unit));
                }
            }
            CommMsg::Abort { reason, done } => {
                tracing::warn!(comm = %state.info.name, rank = state.info.rank, %reason, "aborting communicator");
                state.abort_children(&reason).await;
                state.stop_executor(reason).await;
                if let Some(c) = done {
                    c.complete(Ok(crate::work::Completion::Unit));
                }
                // Drain, not stop: requests already queued complete with Aborted.
                let _ = myself.drain();
            }
            CommMsg::PeerFailed {
                failed_ranks,
                detail,
            } => {
                let info = &state.info;
                tracing::warn!(comm = %info.name, rank = info.rank, epoch = info.epoch, ?failed_ranks, %detail, "peer failure notice");
                let err = Error::PeerFailed {
                    comm: info.name.clone(),
                    rank: info.rank,
                    epoch: info.epoch,
                    op: "watchdog",
                    failed_ranks: failed_ranks.clone(),
                    detail: detail.clone(),
                };
                if let Ok(mut h) = state.health.lock() {
                    if h.failure.is_none() {
                        h.failure = Some(err.clone());
                    }
                }
                if let Ok(mut p) = state.poison.lock() {
                    p.get_or_insert(err.clone());
                }
                if let Ok(mut r) = state.revoke.lock() {
                    r.get_or_insert(err);
                }
                let reason = format!("ranks {failed_ranks:?} failed: {detail}");
                state.abort_children(&reason).await;
                state.stop_executor(reason).await;
                let _ = myself.drain();
            }
            CommMsg::AddChild(child, done) => {
                state
                    .children
                    .retain(|c| c.actor.get_status() != ractor::ActorStatus::Stopped);
                if child.actor.get_status() == ractor::ActorStatus::Stopped {
                    // It ended before we heard of it: supervision events
                    // overtake messages, so its termination may already have
                    // been handled (and not recognised as a child's).
                    if let Some(f) = child_failure(child) {
                        if let Ok(mut h) = state.health.lock() {
                            h.child_failures.push(f);
                        }
                    }
                } else {
                    state.children.push(child);
                }
                if let Some(c) = done {
                    c.complete(Ok(crate::work::Completion::Unit));
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
    ) -> Result<(), ActorProcessingErr> {
        // Override ractor's default (stop the parent when any child exits).
        tracing::debug!(comm = %state.info.name, rank = state.info.rank, ?event, "supervision event");
        let failure = match &event {
            SupervisionEvent::ActorTerminated(cell, _, _) => {
                let child = state
                    .children
                    .iter()
                    .position(|c| c.actor.get_id() == cell.get_id())
                    .map(|i| state.children.remove(i));
                child.and_then(child_failure).map(|f| (f.name, f.reason))
            }
            SupervisionEvent::ActorFailed(cell, e) => {
                state.children.retain(|c| c.actor.get_id() != cell.get_id());
                Some((cell.get_name().unwrap_or_default(), e.to_string()))
            }
            _ => None,
        };
        if let Some((name, reason)) = failure {
            if let Ok(mut h) = state.health.lock() {
                h.child_failures
                    .push(crate::elastic::ChildFailure { name, reason });
            }
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _myself: ActorRef<CommMsg>,
        state: &mut CommState,
    ) -> Result<(), ActorProcessingErr> {
        // AC-4: never leave a child behind.
        if !state.children.is_empty() {
            state.abort_children("parent communicator stopped").await;
        }
        // The executor finishes on its own after Finalize; if the actor is
        // stopped any other way, abort it so no op is left without a completion.
        if let Some(h) = state.exec.take() {
            if !h.is_finished() {
                if let Ok(mut r) = state.abort_reason.lock() {
                    r.get_or_insert_with(|| "communicator actor stopped".into());
                }
                state.cancel.cancel();
                let _ = h.await;
            } else {
                let _ = h.await;
            }
        }
        crate::debug::LIVE_ACTORS.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
        Ok(())
    }
}
