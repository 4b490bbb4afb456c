//! The communicator's core and the turns that run its ops.
//!
//! `Core` is everything an op runs against: the backend (and through it
//! the device stream), the sequence numbers and the heartbeats. Its owner
//! is the communicator's actor ([`super::CommActor`]); nothing else holds
//! it. An op is one *turn*: `Core::turn` takes `&mut Core` and one
//! request, and for that op
//!
//! 1. stamps its sequence numbers (`Core::stamp`) and marks the op started
//!    for its hooks and flight-recorder entry ([`crate::hooks`]);
//! 2. with strict checks, exchanges consistency headers with the
//!    participants and checks them ([`crate::op`]); the backend sees the
//!    op's buffers as it does ([`Backend::exchange_headers_with_data`]), so
//!    a small op's payload may travel with them, unused until the check
//!    passed ([BE-5]). With fingerprint (or no) checks on a backend that
//!    runs ops without the exchange, no header is sent and the op's
//!    fingerprint goes to the backend in [`OpCtx`] instead (EX-10,
//!    [`crate::checks`]);
//! 3. sizes outputs that depend on peers (the list form of all_to_all);
//! 4. runs the transfer on the backend;
//! 5. post-processes (`Avg`) and completes the [`Work`](crate::Work).
//!
//! Before step 2 it scales the input for `PremulSum` (host buffers); like
//! the `Avg` division this is a paced pass that gives the runtime back
//! every slice of work (`crate::pace`).
//!
//! Steps 2–4 run under the op's timeout and end early when the
//! communicator's `AbortSignal` is raised. A turn completes its op itself
//! unless the outcome is fatal: then it hands the op back
//! (`TurnEnd::Fatal`) so that the actor records the failure in the
//! communicator's status *before* the op completes, and every caller that
//! sees the error also sees the communicator aborted.
//!
//! # Invariants
//!
//! | tag | rule |
//! |-----|------|
//! | EX-1 | every request a turn receives completes exactly once (by the turn, or by the actor for a fatal outcome). |
//! | EX-2 | after a fatal error (timeout, peer failure, desynchronised ranks, abort) the backend is aborted before anything else touches it, and no later turn runs. |
//! | EX-3 | a non-fatal mismatch leaves the communicator usable: it is found before any payload moves. |
//! | EX-4 | a peer failure this rank's backend found is published as the epoch's failure notice; the op adopts the notice that won when the store answers within `NOTICE_ADOPT`, and never waits longer for it (publishing goes on in the background); a failure naming the rank that hosts the store (store on rank 0) does not wait at all, since the store died with it. When no notice came and the store has been silent for several heartbeat rounds, the op completes with `StoreUnreachable` instead ([WD-5]). A fatal mismatch is published too, as a mismatch notice ([WD-8]); a peer failure that names no rank (a vendor library's remote error) reads the notice instead of publishing one, and a mismatch notice turns a peer failure into that `Mismatch`. |
//! | EX-5 | the watchdog task is stopped before the backend is closed. |
//! | EX-6 | sequence numbers are stamped when a turn starts, so they follow the order in which turns run, which is the order the actor started them. |
//! | EX-7 | a backend that can fail between ops ([`Backend::polls_async_errors`]) is polled every `IDLE_POLL` while the communicator is idle, never during a turn; an error found so is fatal, like one an op returned. |
//! | EX-8 | a clean finalize counts this rank out of the epoch's keys; the last rank out deletes every key under the epoch's prefix (and the joiners' pointer to it), bounded by `KEY_RELEASE`, so a reused store keeps no finished job's keys. |
//! | EX-9 | a turn dropped before its end (the task running it was dropped, as when its runtime shuts down) raises the abort signal and completes its op with that cause; the communicator then aborts like after any fatal error, and its peers learn it as they learn any failure. |
//! | EX-10 | an op skips the header exchange exactly when the mode is not strict, the backend runs ops without it ([`Capabilities::headerless_ops`](crate::backends::Capabilities::headerless_ops)), and the op is not a window's creation or release; a point-to-point op or an all_to_all_single (sizes that agree only pair by pair) skips its exchange only where the backend also checks in band, message lengths included, or checks are off, and the list form of all_to_all (whose output sizes the backend then learns from its messages) only where the backend checks in band. [`OpCtx::headers`] says which happened. A skipping op carries a nonzero [`OpCtx::fingerprint`] only in fingerprint mode, which a backend that checks in band ([`Capabilities::in_band_checks`](crate::backends::Capabilities::in_band_checks)) checks on every message. In fingerprint mode every collective is in the watchdog's op log while it runs and, if it completed, after ([`super::stall`]), so a mismatch that sends no message, or that a backend cannot see, is found from the heartbeats; such a mismatch revokes the op as itself. |
//!
//! [WD-5]: crate::actors::watchdog#invariants
//! [WD-8]: crate::actors::watchdog#invariants
//! [BE-5]: crate::backends#invariants

use std::sync::atomic::Ordering;
use std::task::Poll;
use std::time::Duration;

use tracing::Instrument;

use super::status::AbortSignal;
use super::{CommInfo, Request};
use crate::backends::{Backend, IdleCtx, OpCtx, OpData, SplitArgs};
use crate::checks::{self, Checks};
use crate::error::{Error, Result};
use crate::kernels;
use crate::op::{check_collective, check_p2p, HeaderMismatch, OpHeader, OpKind, ReduceOp};
use crate::tensor::{checked_sum, Tensor};
use crate::work::{Completer, Completion};

/// How often an idle communicator polls its backend for errors the library
/// found on its own (EX-7). NCCL's own watchdogs poll at this scale; one
/// `ncclCommGetAsyncError` costs well under a microsecond.
pub(crate) const IDLE_POLL: Duration = Duration::from_millis(100);

/// How long a failing op waits for the store to tell it which failure
/// notice won (EX-4) before it completes with its own view.
pub(crate) const NOTICE_ADOPT: Duration = Duration::from_millis(100);

/// Longest a finalizing rank spends releasing the epoch's store keys (EX-8).
pub(crate) const KEY_RELEASE: Duration = Duration::from_secs(1);

/// The store keys of one communicator epoch, released at finalize (EX-8).
pub(crate) struct KeyRelease {
    pub(crate) store: std::sync::Arc<dyn crate::transport::Store>,
    /// `chorus/<job>/<name>/<instance>/epoch/<epoch>`: every key of the
    /// epoch (its splits' too) lives under it.
    pub(crate) prefix: String,
    pub(crate) size: usize,
    /// The joiners' pointer (`latest` key, value) to this epoch.
    pub(crate) latest: (String, Vec<u8>),
}

impl KeyRelease {
    /// Count this rank out; the last one deletes the epoch's keys.
    async fn release(&self) {
        let prefix = &self.prefix;
        let work = async {
            let out = self.store.add(&format!("{prefix}/finalized"), 1).await?;
            if usize::try_from(out).is_ok_and(|n| n >= self.size) {
                let n = self.store.delete_prefix(&format!("{prefix}/")).await?;
                let (key, value) = &self.latest;
                // Only if it still points here (not at a later epoch).
                if self.store.get(key).await?.as_ref() == Some(value) {
                    self.store.delete(key).await?;
                }
                tracing::debug!(%prefix, keys = n, "last rank out: deleted the epoch's keys");
            }
            Ok::<_, crate::transport::TransportError>(())
        };
        match tokio::time::timeout(KEY_RELEASE, work).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                tracing::warn!(%prefix, error = %e, "cannot release the epoch's store keys")
            }
            Err(_) => tracing::warn!(%prefix, "the store did not answer; the epoch's keys stay"),
        }
    }
}

/// How a turn ended.
pub(crate) enum TurnEnd {
    /// The op completed (successfully, or with a non-fatal error).
    Done,
    /// The op failed fatally: the actor records the cause, completes the
    /// op, and aborts the communicator.
    Fatal(Box<Fatal>),
}

/// A fatal outcome, for the actor to act on.
pub(crate) struct Fatal {
    /// What ends the communicator.
    pub(crate) cause: Error,
    /// The error the op itself completes with.
    pub(crate) error: Error,
    /// The op's completer (`None` for a fatal error found outside an op).
    pub(crate) completer: Option<Completer>,
}

impl Fatal {
    /// A fatal error found outside an op (a failed split, an idle poll).
    pub(crate) fn no_op(cause: Error) -> Box<Fatal> {
        Box::new(Fatal {
            error: cause.clone(),
            cause,
            completer: None,
        })
    }
}

/// The error an op completes with when the abort `cause` revokes it: a
/// peer failure as itself (every rank then names the same ranks, AC-5), the
/// loss of the store as itself, a mismatch found by the heartbeats' stall
/// or history check as itself (EX-10), anything else as `Aborted` carrying
/// the cause.
pub(crate) fn revoked_error(info: &CommInfo, cause: Option<&Error>) -> Error {
    match cause {
        Some(
            e @ (Error::PeerFailed { .. }
            | Error::StoreUnreachable { .. }
            | Error::Mismatch { fatal: true, .. }),
        ) => e.clone(),
        other => super::status::aborted_error(&info.name, info.rank, info.epoch, other),
    }
}

/// The cause of an abort whose turn was dropped before its end (EX-9):
/// the task running it was dropped, as when its runtime shuts down.
pub(crate) fn dropped_turn_error(comm: &str, rank: usize, epoch: u64) -> Error {
    Error::Aborted {
        comm: comm.to_string(),
        rank,
        epoch,
        failed_ranks: vec![],
        reason: "a turn was dropped before it finished (the tokio runtime running it shut \
                 down?); how far its op got is unknown, so the communicator cannot go on"
            .into(),
    }
}

/// Holds a turn's completer while the turn runs (EX-9): dropped with it
/// still inside, it raises the abort signal and completes the op with the
/// cause, so neither the caller nor the peers wait for an op nobody runs.
struct TurnGuard<'a> {
    signal: &'a AbortSignal,
    ctx: &'a OpCtx,
    completer: Option<Completer>,
}

impl TurnGuard<'_> {
    fn complete(&mut self, result: Result<Completion>) {
        if let Some(c) = self.completer.take() {
            c.complete(result);
        }
    }
}

impl Drop for TurnGuard<'_> {
    fn drop(&mut self) {
        if let Some(c) = self.completer.take() {
            let ctx = self.ctx;
            let cause = dropped_turn_error(&ctx.comm, ctx.rank, ctx.epoch);
            tracing::warn!(comm = %ctx.comm, rank = ctx.rank, op = ctx.kind.name(), seq = ctx.seq,
                "a turn was dropped before it finished; aborting the communicator");
            self.signal.raise(cause.clone());
            c.complete(Err(cause));
        }
    }
}

/// What a native split gave this rank ([`Backend::split`]).
pub(crate) enum NativeSplit {
    /// The backend has no native split: connect the child from scratch.
    Unsupported,
    /// The child's backend, connected.
    Child(Box<dyn Backend>),
    /// This rank joins no child.
    NoChild,
}

/// Everything an op runs against; owned by the communicator's actor.
pub(crate) struct Core {
    pub(crate) info: CommInfo,
    backend: Box<dyn Backend>,
    /// Heartbeats of this communicator (EX-5).
    watchdog: Option<super::watchdog::Watchdog>,
    /// Counts this backend as live until the core is dropped.
    _live: LiveBackend,
    /// The epoch's store keys, released at finalize (EX-8).
    keys: Option<KeyRelease>,
    /// Next collective sequence number (AC-1).
    coll_seq: u64,
    /// Next point-to-point sequence number per peer (AC-2).
    p2p_seq: Vec<u64>,
    /// `info.name`, shared with every op's context.
    name: std::sync::Arc<str>,
    /// The backend is finalized or aborted: no op touches it again.
    closed: bool,
    /// The backend's device memory, for outputs of device ops sized or
    /// split here (never read on the host, CM-4).
    mem: Option<std::sync::Arc<dyn crate::backends::DeviceMemory>>,
    /// The mode is not strict and the backend runs ops without the header
    /// exchange (EX-10): read once, from its capabilities.
    skip: bool,
    /// Ops whose sizes agree only pair by pair (point-to-point and
    /// all_to_all_single) skip their exchange too: `skip`, and either the
    /// backend checks every message in band (its length included) or
    /// checks are off. The op log compares no sizes per pair (a p2p op has
    /// no place in it at all, since its peers differ per rank), so nothing
    /// else would find a size mismatch there.
    skip_pairs: bool,
    /// The backend checks every message in band, lengths included
    /// ([`Capabilities::in_band_checks`](crate::backends::Capabilities::in_band_checks)).
    in_band: bool,
    /// The backend runs a list all_to_all from and into the caller's
    /// tensors ([`Capabilities::list_all_to_all`](crate::backends::Capabilities::list_all_to_all));
    /// for the others [`lower_list`] concatenates them.
    lists: bool,
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

impl Core {
    pub(crate) fn new(
        info: CommInfo,
        backend: Box<dyn Backend>,
        watchdog: Option<super::watchdog::Watchdog>,
    ) -> Core {
        Core {
            mem: backend.device_memory(),
            skip: info.checks != Checks::Strict && backend.capabilities().headerless_ops,
            in_band: backend.capabilities().in_band_checks,
            lists: backend.capabilities().list_all_to_all,
            skip_pairs: info.checks != Checks::Strict
                && backend.capabilities().headerless_ops
                && (backend.capabilities().in_band_checks || info.checks == Checks::Off),
            p2p_seq: vec![0; info.size],
            name: info.name.as_str().into(),
            info,
            backend,
            watchdog,
            keys: None,
            _live: LiveBackend::new(),
            coll_seq: 0,
            closed: false,
        }
    }

    /// Release `keys` at finalize (EX-8).
    pub(crate) fn with_keys(mut self, keys: Option<KeyRelease>) -> Core {
        self.keys = keys;
        self
    }

    /// The communicator's tracing span.
    pub(crate) fn span(&self) -> tracing::Span {
        let info = &self.info;
        crate::hot_span!(INFO, "comm", name = %info.name, rank = info.rank, size = info.size, epoch = info.epoch)
    }

    /// Whether the backend asks to be polled while idle (EX-7).
    pub(crate) fn polls_async_errors(&self) -> bool {
        self.backend.polls_async_errors()
    }

    /// The error an op completes with when the abort `cause` revokes it.
    pub(crate) fn revoked_error(&self, cause: Option<&Error>) -> Error {
        revoked_error(&self.info, cause)
    }

    /// One turn: run `req` to completion (EX-1). See the module docs.
    pub(crate) async fn turn(
        &mut self,
        mut req: Box<Request>,
        signal: &AbortSignal,
        may_block: bool,
    ) -> TurnEnd {
        let Some(mut completer) = req.completer.take() else {
            return TurnEnd::Done;
        };
        self.stamp(&mut req);
        if !self.lists {
            if let Err(e) = lower_list(&mut req, self.info.name.as_str(), self.info.rank) {
                completer.complete(Err(e));
                return TurnEnd::Done;
            }
        }
        let signature = self.signature(&req);
        // One clock read for the turn (none when it starts on the issuing
        // thread right after the issue was recorded): the timeout counts
        // from here, and the flight recorder and the stall check see the
        // same start.
        let start = match req.issued.take() {
            Some(t) => tokio::time::Instant::from_std(t),
            None => tokio::time::Instant::now(),
        };
        let started = start.into_std();
        completer.started(
            match &req.data {
                OpData::P2P { ops } => Some(ops.first().map(|t| t.seq).unwrap_or(0)),
                // One-sided window ops take no sequence number.
                _ if req.kind == OpKind::Window => None,
                _ => Some(req.seq),
            },
            started,
        );
        let ctx = OpCtx {
            comm: self.name.clone(),
            rank: self.info.rank,
            size: self.info.size,
            epoch: self.info.epoch,
            kind: req.kind,
            seq: req.seq,
            fingerprint: self.fingerprint(&req, signature),
            headers: req.kind != OpKind::Window && !self.skips_headers(req.kind),
            may_block,
            order: crate::backends::StreamOrder {
                // WK-4: a fence only for ops ordered with a stream.
                fence: req.stream.and(completer.fence_slot()),
                wait_for: req.stream,
            },
        };
        // EX-9: a turn dropped before its end completes its op with a
        // fatal cause and raises the abort signal.
        let mut guard = TurnGuard {
            signal,
            ctx: &ctx,
            completer: Some(completer),
        };
        let bytes = req.count * req.dtype.size();
        let span = crate::hot_span!(DEBUG, "op", op = req.kind.name(), seq = req.seq, bytes);
        let timeout = req.timeout;
        // EX-10: the stall check sees this op while it runs.
        let log = self
            .watchdog
            .as_ref()
            .and_then(|w| w.config.ops.clone())
            .filter(|_| req.kind != OpKind::P2P);
        if let Some(l) = &log {
            l.begin(ctx.seq, signature, ctx.kind, started);
        }
        let outcome = {
            let mut fut = std::pin::pin!(self.run_inner(&ctx, &mut req).instrument(span));
            // An op that finishes in its first poll (a small op, or one on a
            // thread that may block) needs neither the abort signal's waker
            // nor a timer: both are armed only if it has to wait. An abort
            // asked for before the turn still wins over the op.
            if signal.is_raised() {
                None
            } else if let Poll::Ready(r) = futures::poll!(fut.as_mut()) {
                Some(r)
            } else {
                // As `tokio::time::timeout` does with a duration too long
                // for the clock: no deadline.
                let deadline = start
                    .checked_add(timeout)
                    .unwrap_or_else(|| start + Duration::from_secs(86_400 * 365 * 30));
                tokio::select! {
                    biased;
                    _ = signal.raised() => None,
                    r = tokio::time::timeout_at(deadline, fut) => Some(match r {
                        Ok(r) => r,
                        Err(_) => Err(Error::Timeout {
                            comm: ctx.comm.to_string(),
                            rank: ctx.rank,
                            op: ctx.kind.name(),
                            seq: ctx.seq,
                            epoch: ctx.epoch,
                            after: timeout,
                        }),
                    }),
                }
            }
        };
        if let Some(l) = &log {
            l.end(matches!(outcome, Some(Ok(_))));
        }
        match outcome {
            None => {
                let cause = signal
                    .cause(&self.info.name, self.info.rank, self.info.epoch)
                    .unwrap_or_else(|| self.revoked_error(None));
                TurnEnd::Fatal(Box::new(Fatal {
                    error: self.revoked_error(Some(&cause)),
                    cause,
                    completer: guard.completer.take(),
                }))
            }
            Some(Ok(c)) => {
                guard.complete(Ok(c));
                TurnEnd::Done
            }
            Some(Err(e)) if !e.is_fatal() => {
                guard.complete(Err(e));
                TurnEnd::Done
            }
            Some(Err(e)) => {
                let e = self.adopt_notice(e, ctx.seq).await;
                TurnEnd::Fatal(Box::new(Fatal {
                    cause: e.clone(),
                    error: e,
                    completer: guard.completer.take(),
                }))
            }
        }
    }

    /// EX-4: publish the peer failure `e` names (if any) as the epoch's
    /// failure notice, and report the notice that won, when the store
    /// answers within [`NOTICE_ADOPT`]: a rank that only saw a survivor
    /// close its links (because that survivor aborted after seeing the real
    /// failure) must not blame the survivor. A store that does not answer in
    /// time (it may be on the dead rank) delays nothing: publishing goes on
    /// in the background. A fatal mismatch is published too, marked as one
    /// ([WD-8]); a peer failure that names no rank (a vendor library's
    /// remote error) reads the notice instead, and a notice that says the
    /// ranks issued different ops turns any peer failure into that
    /// mismatch (`seq`: the op that failed, or the last one when idle).
    ///
    /// [WD-8]: super::watchdog#invariants
    pub(crate) async fn adopt_notice(&mut self, mut e: Error, seq: u64) -> Error {
        tracing::warn!(error = %e, "fatal error; aborting communicator");
        let Some(w) = &self.watchdog else {
            return e;
        };
        let config = w.config.clone();
        let (failed_ranks, detail, op) = match &mut e {
            Error::Mismatch {
                fatal: true,
                detail,
                ..
            } => {
                let detail = detail.clone();
                let publish = tokio::spawn(async move { config.publish_mismatch(detail).await });
                let _ = tokio::time::timeout(NOTICE_ADOPT, publish).await;
                return e;
            }
            Error::PeerFailed {
                failed_ranks,
                detail,
                op,
                ..
            } => (failed_ranks, detail, *op),
            _ => return e,
        };
        let adopted = if failed_ranks.is_empty() {
            // A failure that names no rank (a vendor library's remote
            // error): the epoch's notice may say who, or that it was a
            // mismatch. Only read, and only for NOTICE_ADOPT.
            tokio::time::timeout(NOTICE_ADOPT, config.notice())
                .await
                .ok()
                .flatten()
        } else {
            let (ranks, text) = (failed_ranks.clone(), detail.clone());
            let down = config.clone();
            let host_lost = config.store_host.is_some_and(|h| failed_ranks.contains(&h));
            let publish = tokio::spawn(async move { config.publish(ranks, text).await });
            if host_lost {
                // The rank that died hosted the store, which died with it:
                // asking it would only wait out NOTICE_ADOPT. Publish in the
                // background (a restarted store may still take it).
                drop(publish);
                return e;
            }
            match tokio::time::timeout(NOTICE_ADOPT, publish).await {
                Ok(Ok(Some(n))) => Some(n),
                // WD-5: the store has been silent for several heartbeat
                // rounds, so the peer that closed its link most likely
                // aborted because it lost the store too; say that, not that
                // the peer died.
                _ => {
                    return match down.store_down() {
                        Some(after) => {
                            let last = down
                                .health
                                .last_error()
                                .unwrap_or_else(|| "no answer".into());
                            Error::StoreUnreachable {
                                comm: self.info.name.clone(),
                                rank: self.info.rank,
                                epoch: self.info.epoch,
                                op,
                                after,
                                detail: format!(
                                    "{last}; meanwhile ranks {failed_ranks:?} went away ({detail})"
                                ),
                            }
                        }
                        None => e,
                    }
                }
            }
        };
        match adopted {
            Some(n) if n.mismatch => self.mismatch_notice(op, seq, detail, &n),
            Some(n) if n.failed_ranks != *failed_ranks => {
                *detail = format!(
                    "{detail}; the epoch's failure notice (from rank {}) says ranks {:?} failed: {}",
                    n.by, n.failed_ranks, n.detail
                );
                *failed_ranks = n.failed_ranks;
                e
            }
            _ => e,
        }
    }

    /// [WD-8]: the fatal mismatch a failure notice reports, for an op that
    /// failed with a peer failure (`seen`) because a peer aborted over it.
    ///
    /// [WD-8]: super::watchdog#invariants
    fn mismatch_notice(
        &self,
        op: &'static str,
        seq: u64,
        seen: &str,
        n: &super::watchdog::Notice,
    ) -> Error {
        Error::Mismatch {
            comm: self.info.name.clone(),
            rank: self.info.rank,
            op,
            seq,
            epoch: self.info.epoch,
            detail: format!(
                "the epoch's failure notice (from rank {}) says the ranks issued different ops: \
                 {}; this rank saw: {seen}; the communicator is aborted",
                n.by, n.detail
            ),
            fatal: true,
        }
    }

    /// EX-7: poll the backend for an error found while no op runs. `Some`
    /// is fatal.
    pub(crate) async fn poll_idle(&mut self) -> Option<Error> {
        if self.closed {
            return None;
        }
        let ctx = IdleCtx {
            comm: self.info.name.clone(),
            rank: self.info.rank,
            size: self.info.size,
            epoch: self.info.epoch,
        };
        match self.backend.poll_async_error(&ctx) {
            Ok(()) => None,
            Err(e) => Some(self.adopt_notice(e, self.coll_seq.saturating_sub(1)).await),
        }
    }

    /// Split the backend's communicator with the library's own call, as one
    /// turn ([`Backend::split`]). An error is fatal for this communicator.
    pub(crate) async fn native_split(&mut self, args: SplitArgs) -> Result<NativeSplit> {
        if self.backend.capabilities().split != crate::backends::SplitMode::Native {
            return Ok(NativeSplit::Unsupported);
        }
        match self.backend.split(args).await {
            Ok(Some(child)) => Ok(NativeSplit::Child(child)),
            Ok(None) => Ok(NativeSplit::NoChild),
            Err(e) => Err(e),
        }
    }

    /// Abort path (EX-2, EX-5): heartbeats stopped, peers told, links
    /// closed. Runs once.
    pub(crate) async fn shutdown_aborted(&mut self, cause: Option<&Error>) {
        if self.closed {
            return;
        }
        self.closed = true;
        if let Some(w) = self.watchdog.take() {
            w.stop(false).await;
        }
        let reason = self.revoked_error(cause).to_string();
        let failed = cause.map(|e| e.failed_ranks().to_vec()).unwrap_or_default();
        self.backend.abort_for(cause, &reason, &failed).await;
    }

    /// Finalize path (EX-5): heartbeats stopped cleanly, backend closed.
    pub(crate) async fn finalize(&mut self) {
        if self.closed {
            return;
        }
        self.closed = true;
        if let Some(w) = self.watchdog.take() {
            w.stop(true).await;
        }
        self.backend.finalize().await;
        if let Some(k) = self.keys.take() {
            k.release().await;
        }
    }

    /// AC-1, AC-2: stamp `req` with its sequence numbers, in the order ops
    /// run on this rank.
    fn stamp(&mut self, req: &mut Request) {
        if req.kind == OpKind::P2P {
            // AC-2: each batch takes the next seq of every peer it touches, once.
            if let OpData::P2P { ops } = &mut req.data {
                let mut touched: smallvec::SmallVec<[usize; 4]> =
                    ops.iter().map(|t| t.peer).collect();
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
        } else if req.kind != OpKind::Window {
            // One-sided window ops pair with nothing on other ranks.
            req.seq = self.coll_seq;
            self.coll_seq += 1;
        }
    }

    /// EX-10: whether an op of `kind` runs without the header exchange:
    /// the mode is not strict, and the op is not a window's creation or
    /// release; point-to-point and all_to_all_single, whose sizes agree
    /// only pair by pair, by `skip_pairs`; the list form of all_to_all,
    /// whose output sizes come from the headers unless the backend learns
    /// them from its messages, also only where it checks in band.
    fn skips_headers(&self, kind: OpKind) -> bool {
        match kind {
            OpKind::P2P | OpKind::AllToAllSingle => self.skip_pairs,
            // The backend learns the sizes from the messages.
            OpKind::AllToAll => self.skip_pairs && self.in_band,
            OpKind::NewWindow | OpKind::FreeWindow => false,
            _ => self.skip,
        }
    }

    /// EX-10: the fingerprint the op's messages carry (`signature` is
    /// the op's, from [`Core::signature`]): nonzero only when it skips the
    /// header exchange with checks on. For point-to-point the backend
    /// fingerprints each message itself ([`crate::checks::p2p_fingerprint`]);
    /// nonzero only says so.
    fn fingerprint(&self, req: &Request, signature: u64) -> u64 {
        if !self.skips_headers(req.kind) {
            return 0;
        }
        if req.kind == OpKind::P2P {
            return u64::from(self.info.checks == Checks::Fingerprint);
        }
        signature
    }

    /// EX-10: the fingerprint of a collective in fingerprint mode, whether
    /// or not its headers are exchanged (the watchdog's op log records
    /// every collective, [`super::stall`]); 0 otherwise.
    fn signature(&self, req: &Request) -> u64 {
        if self.info.checks != Checks::Fingerprint
            || matches!(req.kind, OpKind::P2P | OpKind::Window)
        {
            return 0;
        }
        checks::fingerprint(&checks::Signature {
            seq: req.seq,
            epoch: self.info.epoch,
            kind: req.kind,
            dtype: req.dtype,
            redop: req.user_op.map(|o| o.code()).unwrap_or(u8::MAX),
            root: req.root.map(|r| r as u32).unwrap_or(u32::MAX),
            count: req.count as u64,
            counts: &req.counts,
        })
    }

    async fn run_inner(&mut self, ctx: &OpCtx, req: &mut Request) -> Result<Completion> {
        let n = ctx.size;
        let me = ctx.rank;
        // Before any byte travels (a small op's payload goes with its header).
        let copy = !self.backend.leaves_input_unchanged(ctx, &req.data);
        prepare(ctx, req, copy).await?;
        if req.kind == OpKind::Window {
            let op = req
                .window
                .take()
                .ok_or_else(|| Error::Internal("window request without its op".into()))?;
            return Ok(Completion::Window(self.backend.window(ctx, op).await?));
        }
        if req.kind == OpKind::P2P {
            if !self.skip_pairs {
                self.p2p_headers(ctx, req).await?;
            }
        } else if !self.skips_headers(req.kind) {
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
                let mut bytes = Some(header.encode());
                let last = if me == n - 1 { n - 2 } else { n - 1 };
                let outgoing = (0..n)
                    .filter(|&p| p != me)
                    .map(|p| {
                        // The last peer takes the encoded header itself.
                        let b = if p == last {
                            bytes.take()
                        } else {
                            bytes.clone()
                        };
                        (p, req.seq, b.unwrap_or_default())
                    })
                    .collect();
                let received = self
                    .backend
                    .exchange_headers_with_data(ctx, outgoing, &req.data)
                    .await?;
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
            // EX-10: a list-form all_to_all that exchanged headers sizes its
            // output from them.
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
                    let total = checked_sum(recv_counts);
                    *output = match (&self.mem, input.is_device()) {
                        (Some(mem), true) => total
                            .ok_or_else(|| "sizes overflow".to_string())
                            .and_then(|t| mem.zeros(input.dtype(), t))
                            .map_err(|e| {
                                ctx.mismatch(format!(
                                    "peers announce {recv_counts:?} elements for this rank, \
                                     which cannot be allocated on {}: {e}",
                                    mem.device()
                                ))
                            })?,
                        _ => total
                            .and_then(|total| Tensor::try_zeros(input.dtype(), total))
                            .ok_or_else(|| {
                                ctx.mismatch(format!(
                                    "peers announce {recv_counts:?} elements for this rank, more than fits in memory"
                                ))
                            })?,
                    };
                }
            }
        }
        if let Some(op) = req.window.take() {
            // NewWindow, FreeWindow: collective, after the header check.
            return Ok(Completion::Window(self.backend.window(ctx, op).await?));
        }
        self.backend.execute(ctx, &mut req.data).await?;
        average(ctx, req).await;
        finish(ctx, req, self.mem.as_deref())
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
                comm: ctx.comm.to_string(),
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
        let received = self
            .backend
            .exchange_headers_with_data(ctx, outgoing, &req.data)
            .await?;
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

/// Split `t` into tensors of `counts`: on the host, or on the device
/// through the backend's memory (CM-4: never read on the host).
fn split_any(
    t: &Tensor,
    counts: &[usize],
    mem: Option<&dyn crate::backends::DeviceMemory>,
) -> std::result::Result<Vec<Tensor>, String> {
    match (t.is_device(), mem) {
        (true, Some(mem)) => crate::backends::device_split(mem, t, counts),
        (true, None) => Err("a device tensor without device memory".into()),
        (false, _) => t.split(counts).ok_or_else(|| "out of memory".to_string()),
    }
}

/// The local step before a reduction, on host buffers (a device backend
/// applies `PremulSum` itself and reduces in place, CM-4):
/// - a non-root rank of `reduce` works on a copy, so that its caller gets
///   its tensor back unchanged (`keep`), unless `copy` is false (the
///   backend leaves that buffer unchanged) and no step below changes it;
/// - scale for `PremulSum`, and make every boolean 0 or 1 so that
///   [`ReduceOp::combine_op_on`] holds.
///
/// Paced, so a large buffer gives the runtime back as the transfers do.
async fn prepare(ctx: &OpCtx, req: &mut Request, copy: bool) -> Result<()> {
    // Scaling and 0/1 booleans below change the buffer in place.
    let changes = matches!(req.user_op, Some(ReduceOp::PremulSum(_)))
        || req.dtype == crate::tensor::DType::Bool;
    if let OpData::Reduce { buf, root, .. } = &mut req.data {
        if ctx.rank != *root && !buf.is_device() && req.keep.is_none() && (copy || changes) {
            let mut copy = Tensor::try_zeros(buf.dtype(), buf.len()).ok_or_else(|| {
                Error::InvalidArgument {
                    comm: ctx.comm.to_string(),
                    rank: ctx.rank,
                    op: ctx.kind.name(),
                    reason: format!(
                        "cannot allocate the working copy of {} elements a non-root rank \
                         reduces from",
                        buf.len()
                    ),
                }
            })?;
            let src = buf.as_bytes();
            let mut at = 0;
            crate::pace::paced_pass(copy.as_bytes_mut(), |piece| {
                piece.copy_from_slice(&src[at..at + piece.len()]);
                at += piece.len();
            })
            .await;
            req.keep = Some(std::mem::replace(buf, copy));
        }
    }
    let user_op = req.user_op;
    let t = match &mut req.data {
        OpData::AllReduce { buf, .. } | OpData::Reduce { buf, .. } => buf,
        OpData::ReduceScatter { input, .. } => input,
        _ => return Ok(()),
    };
    if t.is_device() {
        return Ok(());
    }
    let dtype = t.dtype();
    if let Some(ReduceOp::PremulSum(s)) = user_op {
        crate::pace::paced_pass(t.as_bytes_mut(), |p| kernels::scale(dtype, p, s)).await;
    }
    if dtype == crate::tensor::DType::Bool {
        crate::pace::paced_pass(t.as_bytes_mut(), kernels::normalize_bools).await;
    }
    Ok(())
}

/// `Avg`: divide the result by the world size on the host (a device
/// backend applied it itself, ncclAvg, CM-4). Paced like [`prepare`].
async fn average(ctx: &OpCtx, req: &mut Request) {
    if req.user_op != Some(ReduceOp::Avg) {
        return;
    }
    let t = match &mut req.data {
        OpData::AllReduce { buf, .. } => buf,
        OpData::Reduce { buf, root, .. } if ctx.rank == *root => buf,
        OpData::ReduceScatter { output, .. } => output,
        _ => return,
    };
    if t.is_device() {
        return;
    }
    let (dtype, n) = (t.dtype(), ctx.size);
    crate::pace::paced_pass(t.as_bytes_mut(), |p| kernels::divide(dtype, p, n)).await;
}

/// A list all_to_all for a backend that takes one tensor each way: the
/// inputs concatenated, a receive buffer of the outputs' total length, and
/// the lists kept in `req.fill` for [`finish`] to fill and hand back. O(the
/// data) copied in, and out again at completion.
fn lower_list(req: &mut Request, comm: &str, rank: usize) -> Result<()> {
    let OpData::AllToAllList { inputs, outputs } = &mut req.data else {
        return Ok(());
    };
    let (inputs, outputs) = (std::mem::take(inputs), std::mem::take(outputs));
    let dtype = req.dtype;
    let send_counts: Vec<usize> = inputs.iter().map(Tensor::len).collect();
    let recv_counts: Vec<usize> = outputs.iter().map(Tensor::len).collect();
    let no_memory = |what: &str| Error::InvalidArgument {
        comm: comm.to_string(),
        rank,
        op: "all_to_all",
        reason: format!("no memory for {what}"),
    };
    let input =
        Tensor::concat(dtype, &inputs).ok_or_else(|| no_memory("the concatenated inputs"))?;
    let output = crate::tensor::checked_sum(&recv_counts)
        .and_then(|total| Tensor::try_zeros(dtype, total))
        .ok_or_else(|| no_memory("the receive buffer"))?;
    req.data = OpData::AllToAll {
        input,
        output,
        send_counts,
        recv_counts,
    };
    req.fill = Some((outputs, inputs));
    Ok(())
}

fn finish(
    ctx: &OpCtx,
    req: &mut Request,
    mem: Option<&dyn crate::backends::DeviceMemory>,
) -> Result<Completion> {
    let n = ctx.size;
    let data = std::mem::replace(&mut req.data, OpData::Barrier);
    Ok(match data {
        OpData::AllReduce { buf, .. } => Completion::Tensor(buf),
        OpData::AllToAllList {
            mut outputs,
            inputs,
        } => {
            outputs.extend(inputs);
            Completion::Tensors(outputs)
        }
        OpData::Reduce { buf, root, .. } => {
            if ctx.rank == root {
                Completion::Tensor(buf)
            } else {
                Completion::Tensor(req.keep.take().unwrap_or(buf))
            }
        }
        OpData::ReduceScatter { output, input, .. } => {
            if req.return_input {
                Completion::Tensors(vec![output, input])
            } else {
                Completion::Tensor(output)
            }
        }
        OpData::AllGather { output, input, .. } if req.return_input => {
            Completion::Tensors(vec![output, input])
        }
        // The `_into` forms give back what the caller passed: off the root,
        // the buffer the op did not use is in `keep`.
        OpData::Gather {
            output,
            input,
            root,
        } if req.return_input => {
            let output = if ctx.rank == root {
                output
            } else {
                req.keep.take().unwrap_or(output)
            };
            Completion::Tensors(vec![output, input])
        }
        OpData::Scatter {
            output,
            input,
            root,
        } if req.return_input => {
            let input = if ctx.rank == root {
                input
            } else {
                req.keep.take().unwrap_or(input)
            };
            Completion::Tensors(vec![output, input])
        }
        OpData::AllGather { output, .. }
        | OpData::Broadcast { buf: output, .. }
        | OpData::Scatter { output, .. } => Completion::Tensor(output),
        OpData::Gather { output, .. } if req.whole => Completion::Tensor(output),
        OpData::Gather { output, root, .. } => {
            if ctx.rank == root {
                let counts = vec![req.count; n];
                Completion::Tensors(split_any(&output, &counts, mem).map_err(|e| {
                    Error::InvalidArgument {
                        comm: ctx.comm.to_string(),
                        rank: ctx.rank,
                        op: ctx.kind.name(),
                        reason: format!("cannot split the output into {n} x {}: {e}", req.count),
                    }
                })?)
            } else {
                Completion::Tensors(vec![])
            }
        }
        OpData::AllToAll { output, input, .. } if req.return_input => {
            Completion::Tensors(vec![output, input])
        }
        OpData::AllToAll {
            output,
            recv_counts,
            ..
        } => {
            if let Some((mut fill, inputs)) = req.fill.take() {
                // all_to_all_into: the caller's outputs, one per sender,
                // then its inputs, handed back.
                let lens: Vec<usize> = fill.iter().map(Tensor::len).collect();
                if lens != recv_counts {
                    return Err(ctx.mismatch(format!(
                        "peers sent {recv_counts:?} elements for this rank, but its outputs hold {lens:?}"
                    )));
                }
                let from = output.as_bytes();
                let mut at = 0;
                for t in &mut fill {
                    let n = t.len_bytes();
                    t.as_bytes_mut().copy_from_slice(&from[at..at + n]);
                    at += n;
                }
                fill.extend(inputs);
                return Ok(Completion::Tensors(fill));
            }
            if req.kind == OpKind::AllToAll {
                Completion::Tensors(
                    // Sizes come from the peers' headers.
                    split_any(&output, &recv_counts, mem).map_err(|e| {
                        ctx.mismatch(format!(
                            "cannot split the {recv_counts:?} elements peers sent: {e}"
                        ))
                    })?,
                )
            } else {
                Completion::Tensor(output)
            }
        }
        OpData::Barrier => Completion::Unit,
        // A lone send or receive gives its buffer back as it is (no
        // vector to build for it).
        OpData::P2P { mut ops } if ops.len() == 1 => match ops.pop() {
            Some(t) => Completion::Tensor(t.buf),
            None => Completion::Tensors(Vec::new()),
        },
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
    use crate::transport::TransportError;
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
        fn capabilities(&self) -> crate::backends::Capabilities {
            crate::backends::Capabilities {
                split: if self.native_split {
                    crate::backends::SplitMode::Native
                } else {
                    crate::backends::SplitMode::Reconnect
                },
                elastic: true,
                in_place_all_gather: false,
                in_band_checks: false,
                headerless_ops: false,
                list_all_to_all: false,
            }
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

    /// A store that never answers, as one on a killed rank's host.
    struct SilentStore;

    #[async_trait]
    impl crate::transport::Store for SilentStore {
        async fn set(&self, _: &str, _: Vec<u8>) -> std::result::Result<(), TransportError> {
            std::future::pending().await
        }
        async fn get(&self, _: &str) -> std::result::Result<Option<Vec<u8>>, TransportError> {
            std::future::pending().await
        }
        async fn wait(
            &self,
            _: &[String],
            _: Duration,
        ) -> std::result::Result<Vec<Vec<u8>>, TransportError> {
            std::future::pending().await
        }
        async fn add(&self, _: &str, _: i64) -> std::result::Result<i64, TransportError> {
            std::future::pending().await
        }
        async fn compare_set(
            &self,
            _: &str,
            _: Option<Vec<u8>>,
            _: Vec<u8>,
        ) -> std::result::Result<crate::transport::CompareSet, TransportError> {
            std::future::pending().await
        }
        async fn delete(&self, _: &str) -> std::result::Result<bool, TransportError> {
            std::future::pending().await
        }
        async fn delete_prefix(&self, _: &str) -> std::result::Result<u64, TransportError> {
            std::future::pending().await
        }
    }

    fn peer_failed(rank: usize) -> Error {
        Error::PeerFailed {
            comm: "w".into(),
            rank: 1,
            epoch: 0,
            op: "all_reduce",
            failed_ranks: vec![rank],
            detail: format!("receiving from rank {rank} failed: reset"),
        }
    }

    /// EX-4 with the store on rank 0: a failure naming rank 0 completes at
    /// once (the store died with it); one naming another rank still asks
    /// the store, for at most NOTICE_ADOPT. Virtual time, so exact.
    #[tokio::test(start_paused = true)]
    async fn ex4_a_failure_of_the_store_host_does_not_wait_for_the_store() {
        let config = crate::actors::watchdog::WatchdogConfig {
            prefix: "test/w/epoch/0".into(),
            rank: 1,
            size: 4,
            epoch: 0,
            interval: Duration::from_millis(100),
            timeout: Duration::from_secs(1),
            store: Arc::new(SilentStore),
            health: Default::default(),
            store_host: Some(0),
            ops: None,
        };
        let info = super::CommInfo {
            name: "w".into(),
            rank: 1,
            size: 4,
            epoch: 0,
            checks: crate::checks::Checks::Strict,
        };
        let seen = Arc::new(Seen::default());
        let mut core = super::Core::new(
            info,
            Box::new(Fake::new(false, &seen)),
            Some(crate::actors::watchdog::Watchdog::detached(config)),
        );
        let t0 = tokio::time::Instant::now();
        let e = core.adopt_notice(peer_failed(0), 0).await;
        assert_eq!(t0.elapsed(), Duration::ZERO, "waited on a dead store");
        assert_eq!(e.failed_ranks(), [0]);
        let e = core.adopt_notice(peer_failed(2), 0).await;
        assert_eq!(t0.elapsed(), super::NOTICE_ADOPT);
        assert_eq!(e.failed_ranks(), [2]);
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
                job: "test".into(),
                base: format!("test/{name}"),
                store,
                secret: Arc::from(Vec::new()),
                bind_ip: std::net::Ipv4Addr::LOCALHOST.into(),
                options: CommOptions::single().with_timeout(Duration::from_secs(20)),
                server: None,
                store_host: None,
                lineage: None,
            }),
            parent: None,
        };
        crate::runtime::block_on(
            "test",
            &crate::runtime::handle(),
            crate::start_with_backend(spec, Box::new(fake)),
        )
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
