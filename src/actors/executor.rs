//! The executor: runs a communicator's ops, one at a time, in order.
//!
//! For each op it (1) exchanges consistency headers with the participants and
//! checks them ([`crate::op`]); (2) sizes outputs that depend on peers (the
//! list form of all_to_all); (3) runs the transfer on the backend; (4)
//! post-processes (`Avg`) and completes the [`Work`](crate::Work). Steps 1-3
//! run under the op's timeout and can be cancelled by an abort.
//!
//! Invariants:
//! - EX-1: every request received completes exactly once.
//! - EX-2: after a fatal error (timeout, peer failure, desynchronised ranks,
//!   abort) the backend is aborted (BE-2) and every later request completes
//!   with `Error::Aborted` carrying the original cause, without touching the
//!   backend.
//! - EX-3: a non-fatal mismatch leaves the communicator usable: it is found
//!   before any payload moves (OP-2).
//! - EX-4: when a peer failure is known (watchdog notice, AC-5), the op in
//!   flight and every queued op complete with that `Error::PeerFailed`; a
//!   peer failure found by this rank's backend is published as a failure
//!   notice so that every rank learns of it (WD-2).
//! - EX-5: the watchdog task is stopped before the executor ends (WD-4).
//! - EX-6: ops run one at a time, in the order they take the core's lock,
//!   which is also the order of their sequence numbers. A queued op (async
//!   forms, or a blocking call while others are queued) runs on the executor
//!   task; a blocking call that finds nothing queued runs its op on the
//!   calling thread (`ExecHandle::try_run_inline`), saving the two
//!   cross-thread wake-ups of the queue (caller to task, task back to
//!   caller), which dominate small ops.
//! - EX-7: a backend that can fail between ops (BE-3) is polled every
//!   `IDLE_POLL` (100 ms) while the communicator is idle (no op holds the core).
//!   An error found so is fatal, like one an op returned: it is published
//!   (EX-4), recorded as the abort's cause (visible in `health()`), and the
//!   communicator is aborted (EX-2), without waiting for its next op.

use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use ractor::ActorRef;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::{CommInfo, CommMsg, Request};
use crate::backends::{cpu::reduce, Backend, IdleCtx, OpCtx, OpData, SplitArgs};
use crate::comm::STATE_ABORTED;
use crate::error::{Error, Result};
use crate::op::{check_collective, check_p2p, HeaderMismatch, OpHeader, OpKind, ReduceOp};
use crate::tensor::{checked_sum, Tensor};
use crate::work::Completion;

/// EX-7: how often an idle communicator polls its backend for errors the
/// library found on its own (BE-3). NCCL's own watchdogs poll at this scale;
/// one `ncclCommGetAsyncError` costs well under a microsecond.
pub(crate) const IDLE_POLL: std::time::Duration = std::time::Duration::from_millis(100);

/// Messages to the executor task: ops the actor forwards, and finalize.
pub(crate) enum ExecMsg {
    Run(Box<Request>),
    Finalize(Option<crate::work::Completer>),
}

/// What a `Comm` handle needs to run ops: the number of ops submitted and
/// not yet started, and the core (EX-6).
#[derive(Clone)]
pub(crate) struct ExecHandle {
    /// Ops submitted (in the actor's mailbox or the executor's queue) that
    /// the executor task has not started yet.
    pub(crate) queued: Arc<AtomicUsize>,
    pub(crate) core: Arc<tokio::sync::Mutex<ExecCore>>,
}

impl ExecHandle {
    /// EX-6: run `req` on the calling thread if no op is queued and the
    /// thread is outside any async runtime; otherwise give it back. When it
    /// runs here, its completer is completed before this returns.
    ///
    /// The core's lock orders it: an op queued earlier is counted in
    /// `queued` until the executor task holds the lock for it, so an op that
    /// finds `queued == 0` and then takes the lock runs (and takes its
    /// sequence number) after every op submitted before it. Waiting for the
    /// lock only ever waits for the op already running.
    pub(crate) fn try_run_inline(&self, req: Box<Request>) -> Option<Box<Request>> {
        if self.queued.load(Ordering::Acquire) != 0 || tokio::runtime::Handle::try_current().is_ok()
        {
            return Some(req);
        }
        let mut core = self.core.blocking_lock();
        let span = core.span();
        crate::runtime::handle().block_on(core.run_inline(req).instrument(span));
        None
    }
}

/// What a native split gave this rank (BE-4).
pub(crate) enum NativeSplit {
    /// The backend has no native split: connect the child from scratch.
    Unsupported,
    /// The child's backend, connected.
    Child(Box<dyn Backend>),
    /// This rank joins no child.
    NoChild,
}

impl ExecHandle {
    /// BE-4: split the backend's communicator, between ops (the split takes
    /// the core's lock like an op). Errors are fatal for this communicator,
    /// which is aborted before this returns.
    pub(crate) async fn native_split(&self, args: SplitArgs) -> Result<NativeSplit> {
        let mut core = self.core.lock().await;
        if core.closed {
            return Err(core.closed_error());
        }
        if !core.backend.splits_natively() {
            return Ok(NativeSplit::Unsupported);
        }
        match core.backend.split(args).await {
            Ok(Some(child)) => Ok(NativeSplit::Child(child)),
            Ok(None) => Ok(NativeSplit::NoChild),
            Err(e) => {
                let e = core.record_fatal(e).await;
                core.shutdown_aborted().await;
                Err(e)
            }
        }
    }
}

/// Everything an op runs against: the backend, the sequence numbers, the
/// failure state. Owned by the executor task behind a lock, which the
/// calling thread of a blocking op takes instead when the communicator is
/// idle (EX-6).
pub(crate) struct ExecCore {
    pub(crate) info: CommInfo,
    pub(crate) backend: Box<dyn Backend>,
    pub(crate) cancel: CancellationToken,
    pub(crate) abort_reason: Arc<Mutex<Option<String>>>,
    pub(crate) state: Arc<AtomicU8>,
    pub(crate) poison: Arc<Mutex<Option<Error>>>,
    pub(crate) actor: ActorRef<CommMsg>,
    /// Heartbeats of this communicator (EX-5).
    pub(crate) watchdog: Option<super::watchdog::Watchdog>,
    /// The error outstanding ops complete with after a peer failure (EX-4).
    pub(crate) revoke: Arc<Mutex<Option<Error>>>,
    /// Counts this backend as live until the executor ends.
    pub(crate) _live: LiveBackend,
    /// Next collective sequence number (AC-1).
    pub(crate) coll_seq: u64,
    /// Next point-to-point sequence number per peer (AC-2).
    pub(crate) p2p_seq: Vec<u64>,
    /// The backend is finalized or aborted: no op touches it again.
    pub(crate) closed: bool,
}

/// The executor task: runs queued ops in order, finalizes, shuts down.
pub(crate) struct Executor {
    pub(crate) core: Arc<tokio::sync::Mutex<ExecCore>>,
    pub(crate) rx: mpsc::UnboundedReceiver<ExecMsg>,
    pub(crate) queued: Arc<AtomicUsize>,
}

/// Counts a live backend (its links open) in [`crate::debug::live_backends`].
pub(crate) struct LiveBackend(());

impl LiveBackend {
    pub(crate) fn new() -> LiveBackend {
        crate::debug::LIVE_BACKENDS.fetch_add(1, Ordering::AcqRel);
        LiveBackend(())
    }
}

impl Drop for LiveBackend {
    fn drop(&mut self) {
        crate::debug::LIVE_BACKENDS.fetch_sub(1, Ordering::AcqRel);
    }
}

enum Outcome {
    Done(Result<Completion>),
    Cancelled,
}

impl Executor {
    pub(crate) async fn run(mut self) {
        let (span, cancel, poll) = {
            let core = self.core.lock().await;
            (
                core.span(),
                core.cancel.clone(),
                core.backend.polls_async_errors(),
            )
        };
        let shared = self.core.clone();
        async move {
            // EX-7: only backends that can fail on their own are polled.
            let mut idle = tokio::time::interval(IDLE_POLL);
            idle.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let msg = tokio::select! {
                    biased;
                    _ = cancel.cancelled() => {
                        let mut core = shared.lock().await;
                        core.shutdown_aborted().await;
                        self.drain(&core, |core| core.revoked_error());
                        return;
                    }
                    msg = self.rx.recv() => msg,
                    _ = idle.tick(), if poll => {
                        // An op in flight (inline, EX-6) holds the lock and
                        // watches the library itself: skip this tick.
                        let Ok(mut core) = shared.try_lock() else { continue };
                        if !core.poll_idle().await {
                            core.shutdown_aborted().await;
                            self.drain(&core, |core| core.revoked_error());
                            return;
                        }
                        continue;
                    }
                };
                match msg {
                    Some(ExecMsg::Run(req)) => {
                        let mut core = shared.lock().await;
                        // EX-6: from here on, an op run inline goes after this one.
                        self.queued.fetch_sub(1, Ordering::AcqRel);
                        if !core.run_queued(req).await {
                            core.shutdown_aborted().await;
                            self.drain(&core, |core| core.revoked_error());
                            return;
                        }
                    }
                    Some(ExecMsg::Finalize(done)) => {
                        let mut core = shared.lock().await;
                        core.finalize().await;
                        self.drain(&core, |core| Error::Finalized {
                            comm: core.info.name.clone(),
                            rank: core.info.rank,
                        });
                        if let Some(c) = done {
                            c.complete(Ok(Completion::Unit));
                        }
                        // Drain: requests queued behind Finalize complete with Finalized.
                        let _ = core.actor.drain();
                        return;
                    }
                    None => {
                        shared.lock().await.finalize().await;
                        return;
                    }
                }
            }
        }
        .instrument(span)
        .await
    }

    /// Close the queue and complete everything still in it with `err`.
    fn drain(&mut self, core: &ExecCore, err: impl Fn(&ExecCore) -> Error) {
        self.rx.close();
        while let Ok(msg) = self.rx.try_recv() {
            match msg {
                ExecMsg::Run(mut req) => {
                    self.queued.fetch_sub(1, Ordering::AcqRel);
                    if let Some(c) = req.completer.take() {
                        c.complete(Err(err(core)));
                    }
                }
                ExecMsg::Finalize(Some(c)) => c.complete(Ok(Completion::Unit)),
                ExecMsg::Finalize(None) => {}
            }
        }
    }
}

impl ExecCore {
    /// The communicator's tracing span.
    fn span(&self) -> tracing::Span {
        let info = &self.info;
        tracing::info_span!("comm", name = %info.name, rank = info.rank, size = info.size, epoch = info.epoch)
    }

    /// AC-1, AC-2: stamp `req` with its sequence numbers, in the order ops
    /// run on this rank.
    fn stamp(&mut self, req: &mut Request) {
        if req.kind == OpKind::P2P {
            // AC-2: each batch takes the next seq of every peer it touches, once.
            if let OpData::P2P { ops } = &mut req.data {
                let mut touched: Vec<usize> = ops.iter().map(|t| t.peer).collect();
                touched.sort_unstable();
                touched.dedup();
                for p in touched {
                    let Some(next) = self.p2p_seq.get_mut(p) else {
                        continue;
                    };
                    let s = *next;
                    *next += 1;
                    for t in ops.iter_mut().filter(|t| t.peer == p) {
                        t.seq = s;
                    }
                }
            }
        } else {
            req.seq = self.coll_seq;
            self.coll_seq += 1;
        }
    }

    /// The error of an op that reaches a closed core.
    fn closed_error(&self) -> Error {
        if self.state.load(Ordering::Acquire) == crate::comm::STATE_FINALIZED {
            Error::Finalized {
                comm: self.info.name.clone(),
                rank: self.info.rank,
            }
        } else {
            self.revoked_error()
        }
    }

    /// Run a queued op. Returns false if the communicator must shut down.
    async fn run_queued(&mut self, mut req: Box<Request>) -> bool {
        if self.closed {
            if let Some(c) = req.completer.take() {
                c.complete(Err(self.closed_error()));
            }
            return true;
        }
        self.stamp(&mut req);
        self.run_one(req).await
    }

    /// EX-6: run an op on the calling thread; shut the communicator down
    /// here if it failed fatally, and wake the executor task so it ends too.
    async fn run_inline(&mut self, req: Box<Request>) {
        if !self.run_queued(req).await {
            self.shutdown_aborted().await;
        }
    }

    /// Finalize path: heartbeats stopped, backend closed.
    async fn finalize(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        if let Some(w) = self.watchdog.take() {
            w.stop(true).await;
        }
        self.backend.finalize().await;
        self.state
            .compare_exchange(
                crate::comm::STATE_ACTIVE,
                crate::comm::STATE_FINALIZED,
                Ordering::AcqRel,
                Ordering::Acquire,
            )
            .ok();
    }

    fn abort_error(&self) -> Error {
        let reason = self
            .abort_reason
            .lock()
            .ok()
            .and_then(|r| r.clone())
            .unwrap_or_else(|| "aborted".into());
        let cause = self.poison.lock().ok().and_then(|p| p.clone());
        match cause {
            Some(e) => Error::Aborted {
                comm: self.info.name.clone(),
                rank: self.info.rank,
                epoch: self.info.epoch,
                failed_ranks: e.failed_ranks().to_vec(),
                reason: format!("an earlier operation failed: {e}"),
            },
            None => Error::Aborted {
                comm: self.info.name.clone(),
                rank: self.info.rank,
                epoch: self.info.epoch,
                failed_ranks: vec![],
                reason,
            },
        }
    }

    /// The error of an op revoked by an abort (EX-4).
    fn revoked_error(&self) -> Error {
        self.revoke
            .lock()
            .ok()
            .and_then(|r| r.clone())
            .unwrap_or_else(|| self.abort_error())
    }

    /// Abort path: backend aborted, heartbeats stopped, the actor asked to
    /// stop, the executor task woken to fail every queued request (EX-2).
    /// Runs once.
    async fn shutdown_aborted(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        if let Some(w) = self.watchdog.take() {
            w.stop(false).await;
        }
        self.state.store(STATE_ABORTED, Ordering::Release);
        let reason = self.abort_error().to_string();
        let failed = self
            .poison
            .lock()
            .ok()
            .and_then(|p| p.as_ref().map(|e| e.failed_ranks().to_vec()))
            .unwrap_or_default();
        self.backend.abort(&reason, &failed).await;
        // The executor task (if this ran inline) drains its queue and ends.
        self.cancel.cancel();
        // The actor has nothing left to do: ask it to stop (after any request
        // already in its mailbox, which it fails with `Aborted`), so no actor
        // outlives its communicator.
        let _ = self
            .actor
            .send_message(CommMsg::Abort { reason, done: None });
    }

    /// Run one request. Returns false if the communicator must shut down.
    async fn run_one(&mut self, mut req: Box<Request>) -> bool {
        let Some(completer) = req.completer.take() else {
            return true;
        };
        let ctx = OpCtx {
            comm: self.info.name.clone(),
            rank: self.info.rank,
            size: self.info.size,
            epoch: self.info.epoch,
            kind: req.kind,
            seq: req.seq,
        };
        let bytes = req.count * req.dtype.size();
        let span = tracing::debug_span!("op", op = req.kind.name(), seq = req.seq, bytes);
        let timeout = req.timeout;
        let cancel = self.cancel.clone();
        let outcome = {
            let fut = self.run_inner(&ctx, &mut req).instrument(span);
            tokio::select! {
                biased;
                _ = cancel.cancelled() => Outcome::Cancelled,
                r = tokio::time::timeout(timeout, fut) => match r {
                    Ok(r) => Outcome::Done(r),
                    Err(_) => Outcome::Done(Err(Error::Timeout {
                        comm: ctx.comm.clone(),
                        rank: ctx.rank,
                        op: ctx.kind.name(),
                        seq: ctx.seq,
                        epoch: ctx.epoch,
                        after: timeout,
                    })),
                },
            }
        };
        match outcome {
            Outcome::Cancelled => {
                completer.complete(Err(self.revoked_error()));
                false
            }
            Outcome::Done(Ok(c)) => {
                completer.complete(Ok(c));
                true
            }
            Outcome::Done(Err(e)) if !e.is_fatal() => {
                completer.complete(Err(e));
                true
            }
            Outcome::Done(Err(e)) => {
                let e = self.record_fatal(e).await;
                completer.complete(Err(e));
                false
            }
        }
    }

    /// EX-2, EX-4: a fatal error ends this communicator. Publish the peer
    /// failure it names (if any) as the epoch's failure notice, record it as
    /// the cause of the abort, and mark the communicator aborted. Returns the
    /// error to report, with the notice's failed ranks when another rank's
    /// notice came first.
    async fn record_fatal(&mut self, mut e: Error) -> Error {
        tracing::warn!(error = %e, "fatal error; aborting communicator");
        // EX-4: tell every rank, through the store, who failed. The first
        // notice of the epoch wins, and this rank reports the winner's failed
        // ranks: a rank that only saw a survivor close its links (because
        // that survivor aborted after seeing the real failure) must not blame
        // the survivor.
        if let (
            Error::PeerFailed {
                failed_ranks,
                detail,
                ..
            },
            Some(w),
        ) = (&mut e, &self.watchdog)
        {
            if !failed_ranks.is_empty() {
                if let Some(n) = w.config.publish(failed_ranks.clone(), detail.clone()).await {
                    if n.failed_ranks != *failed_ranks {
                        *detail = format!(
                            "{detail}; the epoch's failure notice (from rank {}) says ranks {:?} failed: {}",
                            n.by, n.failed_ranks, n.detail
                        );
                        *failed_ranks = n.failed_ranks;
                    }
                }
            }
        }
        if let Ok(mut p) = self.poison.lock() {
            p.get_or_insert(e.clone());
        }
        // Later submits must see the abort as soon as this op completes.
        self.state.store(STATE_ABORTED, Ordering::Release);
        e
    }

    /// EX-7: poll the backend for an error found while no op runs (BE-3).
    /// Returns false if the communicator must shut down.
    async fn poll_idle(&mut self) -> bool {
        if self.closed {
            return true;
        }
        let ctx = IdleCtx {
            comm: self.info.name.clone(),
            rank: self.info.rank,
            size: self.info.size,
            epoch: self.info.epoch,
        };
        match self.backend.poll_async_error(&ctx) {
            Ok(()) => true,
            Err(e) => {
                self.record_fatal(e).await;
                false
            }
        }
    }

    async fn run_inner(&mut self, ctx: &OpCtx, req: &mut Request) -> Result<Completion> {
        let n = ctx.size;
        let me = ctx.rank;
        if req.kind == OpKind::P2P {
            self.p2p_headers(ctx, req).await?;
        } else {
            let header = OpHeader {
                seq: req.seq,
                epoch: ctx.epoch,
                kind: req.kind as u8,
                dtype: req.dtype.code(),
                redop: req.user_op.map(|o| o.code()).unwrap_or(u8::MAX),
                root: req.root.map(|r| r as u32).unwrap_or(u32::MAX),
                count: req.count as u64,
                counts: req.counts.iter().map(|&c| c as u64).collect(),
                p2p: vec![],
            };
            let mut headers = vec![header.clone(); n];
            if n > 1 {
                let bytes = header.encode();
                let outgoing = (0..n)
                    .filter(|&p| p != me)
                    .map(|p| (p, req.seq, bytes.clone()))
                    .collect();
                let received = self.backend.exchange_headers(ctx, outgoing).await?;
                for (peer, raw) in received {
                    let h = OpHeader::decode(&raw).ok_or_else(|| {
                        ctx.peer_failed(vec![peer], "peer sent an undecodable op header")
                    })?;
                    if peer < n {
                        headers[peer] = h;
                    }
                }
                check_collective(&headers).map_err(|m| self.mismatch(ctx, m))?;
            }
            if let OpData::AllToAll {
                output,
                recv_counts,
                input,
                ..
            } = &mut req.data
            {
                if req.kind == OpKind::AllToAll {
                    // Output sizes come from the senders' headers (this rank's
                    // own for a world of one); never trusted to fit.
                    *recv_counts = headers.iter().map(|h| h.counts[me] as usize).collect();
                    *output = checked_sum(recv_counts)
                        .and_then(|total| Tensor::try_zeros(input.dtype(), total))
                        .ok_or_else(|| {
                            ctx.mismatch(format!(
                                "peers announce {recv_counts:?} elements for this rank, more than fits in memory"
                            ))
                        })?;
                }
            }
        }
        self.backend.execute(ctx, &mut req.data).await?;
        finish(ctx, req)
    }

    /// A `Mismatch` error; when the ranks are out of step the communicator
    /// is aborted after this op (EX-2), otherwise it stays usable (EX-3).
    fn mismatch(&self, ctx: &OpCtx, m: HeaderMismatch) -> Error {
        if m.fatal {
            ctx.mismatch(format!(
                "{}; the ranks are out of step, so the communicator is aborted",
                m.detail
            ))
        } else {
            Error::Mismatch {
                comm: ctx.comm.clone(),
                rank: ctx.rank,
                op: ctx.kind.name(),
                seq: ctx.seq,
                epoch: ctx.epoch,
                detail: m.detail,
                fatal: false,
            }
        }
    }

    async fn p2p_headers(&mut self, ctx: &OpCtx, req: &Request) -> Result<()> {
        let OpData::P2P { ops } = &req.data else {
            return Err(Error::Internal("p2p request without p2p data".into()));
        };
        let mut peers: Vec<usize> = ops.iter().map(|t| t.peer).collect();
        peers.sort_unstable();
        peers.dedup();
        let mut mine = Vec::with_capacity(peers.len());
        for &p in &peers {
            let seq = ops.iter().find(|t| t.peer == p).map(|t| t.seq).unwrap_or(0);
            let h = OpHeader {
                seq,
                epoch: ctx.epoch,
                kind: OpKind::P2P as u8,
                dtype: req.dtype.code(),
                redop: u8::MAX,
                root: u32::MAX,
                count: 0,
                counts: vec![],
                p2p: ops
                    .iter()
                    .filter(|t| t.peer == p)
                    .map(|t| (t.send, t.buf.dtype().code(), t.buf.len() as u64))
                    .collect(),
            };
            mine.push((p, seq, h));
        }
        let outgoing = mine.iter().map(|(p, s, h)| (*p, *s, h.encode())).collect();
        let received = self.backend.exchange_headers(ctx, outgoing).await?;
        // Check every peer; report the first problem (all peers were heard, so
        // every peer reaches its own verdict too).
        let mut first: Option<Error> = None;
        for ((peer, _, h), (_, raw)) in mine.iter().zip(received) {
            let theirs = OpHeader::decode(&raw).ok_or_else(|| {
                ctx.peer_failed(vec![*peer], "peer sent an undecodable op header")
            })?;
            if let Err(m) = check_p2p(ctx.rank, *peer, h, &theirs) {
                let fatal = m.fatal;
                let e = self.mismatch(ctx, m);
                if fatal {
                    return Err(e);
                }
                first.get_or_insert(e);
            }
        }
        match first {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }
}

fn finish(ctx: &OpCtx, req: &mut Request) -> Result<Completion> {
    let n = ctx.size;
    let avg = |t: &mut Tensor| {
        if req.user_op == Some(ReduceOp::Avg) {
            reduce::divide(t.dtype(), t.as_bytes_mut(), n);
        }
    };
    let data = std::mem::replace(&mut req.data, OpData::Barrier);
    Ok(match data {
        OpData::AllReduce { mut buf, .. } => {
            avg(&mut buf);
            Completion::Tensor(buf)
        }
        OpData::Reduce { mut buf, root, .. } => {
            if ctx.rank == root {
                avg(&mut buf);
                Completion::Tensor(buf)
            } else {
                Completion::Tensor(req.keep.take().unwrap_or(buf))
            }
        }
        OpData::ReduceScatter {
            mut output, input, ..
        } => {
            avg(&mut output);
            if req.return_input {
                Completion::Tensors(vec![output, input])
            } else {
                Completion::Tensor(output)
            }
        }
        OpData::AllGather { output, input, .. } if req.return_input => {
            Completion::Tensors(vec![output, input])
        }
        OpData::AllGather { output, .. }
        | OpData::Broadcast { buf: output, .. }
        | OpData::Scatter { output, .. } => Completion::Tensor(output),
        OpData::Gather { output, root, .. } => {
            if ctx.rank == root {
                let counts = vec![req.count; n];
                Completion::Tensors(
                    output
                        .split(&counts)
                        .ok_or_else(|| Error::Internal("gather output size".into()))?,
                )
            } else {
                Completion::Tensors(vec![])
            }
        }
        OpData::AllToAll {
            output,
            recv_counts,
            ..
        } => {
            if req.kind == OpKind::AllToAll {
                Completion::Tensors(
                    output
                        .split(&recv_counts)
                        .ok_or_else(|| Error::Internal("all_to_all output size".into()))?,
                )
            } else {
                Completion::Tensor(output)
            }
        }
        OpData::Barrier => Completion::Unit,
        OpData::P2P { ops } => Completion::Tensors(ops.into_iter().map(|t| t.buf).collect()),
    })
}

#[cfg(test)]
mod tests {
    //! EX-7 with a fake backend: a world of one rank, so every op reaches
    //! `execute` without a header exchange and no heartbeats run.
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use async_trait::async_trait;

    use crate::backends::{Backend, IdleCtx, OpCtx, OpData, SplitArgs};
    use crate::error::{Error, Result};
    use crate::{CommOptions, Device, ReduceOp, Tensor};

    /// What the fake backend saw.
    #[derive(Default)]
    struct Seen {
        polls: AtomicUsize,
        in_op: AtomicBool,
        polled_during_op: AtomicBool,
        aborted: AtomicBool,
        /// Make the next poll report this error.
        fail: std::sync::Mutex<Option<Error>>,
        /// Native splits asked for: (color, child rank, child size, child
        /// key prefix) per split, `None` for a rank joining no child.
        splits: std::sync::Mutex<Vec<Option<AskedSplit>>>,
        /// Make the next native split fail with this error.
        split_fail: std::sync::Mutex<Option<Error>>,
        /// What the children this backend split off saw.
        children: std::sync::Mutex<Vec<Arc<Seen>>>,
        executed: AtomicUsize,
    }

    /// A member's native split: (color, child rank, child size, key prefix).
    type AskedSplit = (u32, usize, usize, String);

    struct Fake {
        polls: bool,
        native_split: bool,
        seen: Arc<Seen>,
    }

    impl Fake {
        fn new(polls: bool, seen: &Arc<Seen>) -> Fake {
            Fake {
                polls,
                native_split: false,
                seen: seen.clone(),
            }
        }
    }

    #[async_trait]
    impl Backend for Fake {
        fn name(&self) -> &'static str {
            "cpu"
        }
        async fn exchange_headers(
            &mut self,
            _ctx: &OpCtx,
            _outgoing: Vec<(usize, u64, Vec<u8>)>,
        ) -> Result<Vec<(usize, Vec<u8>)>> {
            Ok(vec![])
        }
        async fn execute(&mut self, _ctx: &OpCtx, data: &mut OpData) -> Result<()> {
            self.seen.executed.fetch_add(1, Ordering::SeqCst);
            // A world of one: gathering is copying (split's agreement step).
            if let OpData::AllGather { input, output, .. } = data {
                output.as_bytes_mut().copy_from_slice(input.as_bytes());
            }
            self.seen.in_op.store(true, Ordering::SeqCst);
            // Long enough for several idle ticks to fall inside the op.
            tokio::time::sleep(super::IDLE_POLL * 3).await;
            self.seen.in_op.store(false, Ordering::SeqCst);
            Ok(())
        }
        async fn abort(&mut self, _reason: &str, _failed: &[usize]) {
            self.seen.aborted.store(true, Ordering::SeqCst);
        }
        async fn finalize(&mut self) {}
        fn polls_async_errors(&self) -> bool {
            self.polls
        }
        fn poll_async_error(&mut self, ctx: &IdleCtx) -> Result<()> {
            self.seen.polls.fetch_add(1, Ordering::SeqCst);
            if self.seen.in_op.load(Ordering::SeqCst) {
                self.seen.polled_during_op.store(true, Ordering::SeqCst);
            }
            match self.seen.fail.lock().expect("lock").take() {
                Some(Error::PeerFailed { detail, .. }) => Err(ctx.peer_failed(vec![], detail)),
                Some(e) => Err(e),
                None => Ok(()),
            }
        }
        fn splits_natively(&self) -> bool {
            self.native_split
        }
        async fn split(&mut self, args: SplitArgs) -> Result<Option<Box<dyn Backend>>> {
            self.seen.splits.lock().expect("lock").push(
                args.child
                    .as_ref()
                    .map(|c| (c.color, c.init.rank, c.init.size, c.init.key_prefix.clone())),
            );
            if let Some(e) = self.seen.split_fail.lock().expect("lock").take() {
                return Err(e);
            }
            Ok(args.child.map(|_| {
                let seen = Arc::new(Seen::default());
                self.seen.children.lock().expect("lock").push(seen.clone());
                Box::new(Fake::new(false, &seen)) as Box<dyn Backend>
            }))
        }
    }

    fn comm_over(name: &str, fake: Fake) -> crate::Comm {
        let store: Arc<dyn crate::transport::Store> =
            Arc::new(crate::transport::MemoryStore::new());
        let spec = crate::Spec {
            backend: "cpu".into(),
            device: Device::Cpu,
            rank: 0,
            size: 1,
            epoch: 0,
            key_prefix: format!("test/{name}/epoch/0"),
            ctx: Arc::new(crate::elastic::CommCtx {
                name: name.into(),
                base: format!("test/{name}"),
                store,
                secret: Arc::from(Vec::new()),
                bind_ip: std::net::Ipv4Addr::LOCALHOST.into(),
                options: CommOptions::single().with_timeout(Duration::from_secs(20)),
                server: None,
            }),
            parent: None,
        };
        crate::runtime::block_on(crate::start_with_backend(spec, Box::new(fake)))
            .expect("runtime")
            .expect("start")
    }

    /// Wait (bounded) until `cond` holds.
    fn eventually(what: &str, cond: impl Fn() -> bool) {
        let deadline = Instant::now() + Duration::from_secs(20);
        while !cond() {
            assert!(Instant::now() < deadline, "timed out waiting until {what}");
            std::thread::sleep(Duration::from_millis(5));
        }
    }

    #[test]
    fn ex_7_an_error_found_while_idle_aborts_the_communicator() {
        let seen = Arc::new(Seen::default());
        let comm = comm_over("idle-error", Fake::new(true, &seen));
        let t = comm
            .all_reduce(Tensor::from_slice(&[1.0f32, 2.0]), ReduceOp::Sum)
            .expect("healthy op");
        assert_eq!(t.to_vec::<f32>(), vec![1.0, 2.0]);
        *seen.fail.lock().expect("lock") = Some(Error::PeerFailed {
            comm: String::new(),
            rank: 0,
            epoch: 0,
            op: "",
            failed_ranks: vec![],
            detail: "remote process exited".into(),
        });
        // No op is submitted: the idle poll alone must find it.
        eventually("the communicator is aborted", || !comm.is_active());
        assert!(
            seen.aborted.load(Ordering::SeqCst),
            "backend not aborted (BE-2)"
        );
        let health = comm.health();
        match &health.failure {
            Some(Error::PeerFailed { op, detail, .. }) => {
                assert_eq!(*op, IdleCtx::OP);
                assert!(detail.contains("remote process exited"), "{detail}");
            }
            other => panic!("health does not carry the idle error: {other:?}"),
        }
        match comm.all_reduce(Tensor::from_slice(&[1.0f32]), ReduceOp::Sum) {
            Err(Error::Aborted { reason, .. }) => {
                assert!(reason.contains("remote process exited"), "{reason}")
            }
            other => panic!("expected Aborted after the idle error, got {other:?}"),
        }
        eventually("the poll stopped", || {
            let n = seen.polls.load(Ordering::SeqCst);
            std::thread::sleep(super::IDLE_POLL * 2);
            seen.polls.load(Ordering::SeqCst) == n
        });
    }

    #[test]
    fn ex_7_idle_polls_never_overlap_an_op_inline_or_queued() {
        let seen = Arc::new(Seen::default());
        let comm = comm_over("idle-poll-ops", Fake::new(true, &seen));
        eventually("the idle communicator is polled", || {
            seen.polls.load(Ordering::SeqCst) >= 2
        });
        // Inline (blocking, nothing queued) and queued (async) ops, each
        // spanning several poll intervals.
        comm.barrier().expect("barrier");
        let works: Vec<_> = (0..3).map(|_| comm.barrier_async()).collect();
        for w in works {
            w.wait().expect("queued barrier");
        }
        assert!(
            !seen.polled_during_op.load(Ordering::SeqCst),
            "the backend was polled while an op ran"
        );
        let before = seen.polls.load(Ordering::SeqCst);
        eventually("polling resumes after the ops", || {
            seen.polls.load(Ordering::SeqCst) > before
        });
        comm.finalize().expect("finalize");
        assert!(!seen.aborted.load(Ordering::SeqCst));
    }

    #[test]
    fn ex_7_backends_without_async_errors_are_never_polled() {
        let seen = Arc::new(Seen::default());
        let comm = comm_over("no-poll", Fake::new(false, &seen));
        // Ops spanning several poll intervals; any poll would be counted.
        comm.barrier().expect("barrier");
        comm.barrier_async().wait().expect("queued barrier");
        comm.finalize().expect("finalize");
        assert_eq!(seen.polls.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn be_4_a_native_split_hands_the_child_the_backend_it_returns() {
        let seen = Arc::new(Seen::default());
        let mut fake = Fake::new(false, &seen);
        fake.native_split = true;
        let comm = comm_over("native-split", fake);
        // Opting out still reaches the backend: the library may need every rank.
        assert!(comm
            .split_by_color(None, 0, "nobody")
            .expect("opt-out split")
            .is_none());
        let child = comm
            .split_by_color(Some(7), 3, "kid")
            .expect("split")
            .expect("member");
        let splits = seen.splits.lock().expect("lock").clone();
        assert_eq!(splits.len(), 2, "{splits:?}");
        assert_eq!(splits[0], None);
        let (color, rank, size, prefix) = splits[1].clone().expect("member split");
        // Colors reach the backend dense, ranks as the child ranks.
        assert_eq!((color, rank, size), (0, 0, 1));
        assert!(prefix.contains("/split/1/7/"), "{prefix}");
        // The child's ops run on the backend the split returned.
        child.barrier().expect("child barrier");
        let kids = seen.children.lock().expect("lock").clone();
        assert_eq!(kids.len(), 1);
        assert_eq!(kids[0].executed.load(Ordering::SeqCst), 1);
        comm.barrier().expect("parent still usable");
        comm.finalize().expect("finalize");
        assert!(!child.is_active(), "the parent finalizes its child");
    }

    #[test]
    fn be_4_a_failed_native_split_aborts_the_parent_with_the_cause() {
        let seen = Arc::new(Seen::default());
        let mut fake = Fake::new(false, &seen);
        fake.native_split = true;
        let comm = comm_over("native-split-fails", fake);
        *seen.split_fail.lock().expect("lock") = Some(Error::Internal(
            "ncclCommSplit: unhandled cuda error".into(),
        ));
        match comm.split(&[0], "kid") {
            Err(Error::Internal(m)) => assert!(m.contains("unhandled cuda error"), "{m}"),
            other => panic!("expected the split's error, got {other:?}"),
        }
        assert!(!comm.is_active(), "the parent must be aborted (BE-4)");
        assert!(
            seen.aborted.load(Ordering::SeqCst),
            "backend not aborted (BE-2)"
        );
        match comm.barrier() {
            Err(Error::Aborted { reason, .. }) => {
                assert!(reason.contains("unhandled cuda error"), "{reason}")
            }
            other => panic!("expected Aborted, got {other:?}"),
        }
    }
}
