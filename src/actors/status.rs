//! A communicator's [`Status`]: its one record of whether it runs ops, and
//! why not.
//!
//! There is exactly one status per communicator. Its only writer is the
//! communicator's actor (`StatusWriter` is not `Clone` and lives in the
//! actor's state); handles, turns and the parent read it through
//! `StatusReader`. Anyone may *ask* for an abort through the
//! communicator's `AbortSignal` (a user's `abort()`, the watchdog, a
//! parent that is aborting, a turn that hit a fatal error): the signal
//! interrupts the op in flight at once and carries the first cause given,
//! and the actor turns it into the status.
//!
//! # Invariants
//!
//! | tag | rule |
//! |-----|------|
//! | [SU-1] | the state only moves forward: `Active` → `Finalized` or `Active` → `Aborted`, once. |
//! | [SU-2] | the cause is set together with the move to `Aborted` and never changes afterwards. |
//! | [SU-3] | the first cause raised on an `AbortSignal` wins; a child's signal is cancelled with its parent's, and then reports the parent's cause. |
//! | [SU-4] | asking whether an abort was raised ([`AbortSignal::is_raised`], and every poll of [`AbortSignal::raised`] after its first) reads atomic flags only, never the cancellation token's mutex: each signal sets its flag before it cancels its token, and a child reads its own flag and then its ancestors' (a chain as deep as the splits). |
//! | [SU-5] | when the cause is a fatal `Mismatch`, the first op to complete after the ranks' ops disagreed fails with that `Mismatch`: the op that found it, an op revoked or refused by it, or, when the communicator was aborted while idle (the heartbeats found it, or a peer's notice said so), the next op issued. Every later op gets `Aborted` carrying it. |
//!
//! [SU-1]: crate::actors::status#invariants
//! [SU-2]: crate::actors::status#invariants
//! [SU-3]: crate::actors::status#invariants
//! [SU-4]: crate::actors::status#invariants
//! [SU-5]: crate::actors::status#invariants

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::task::{Context, Poll, Waker};

use tokio_util::sync::{CancellationToken, WaitForCancellationFuture};

use crate::error::Error;

/// Whether a communicator still runs ops.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Accepting and running ops.
    Active,
    /// Finalized cleanly; later ops fail with [`Error::Finalized`].
    Finalized,
    /// Aborted (by a failure or by a user); later ops fail with
    /// [`Error::Aborted`] carrying the cause.
    Aborted,
}

impl State {
    fn from_u8(v: u8) -> State {
        match v {
            0 => State::Active,
            1 => State::Finalized,
            _ => State::Aborted,
        }
    }
}

/// A snapshot of a communicator's status.
#[derive(Debug, Clone)]
pub struct Status {
    /// Whether it runs ops.
    pub state: State,
    /// What aborted it, if it is aborted.
    pub cause: Option<Error>,
}

/// A child communicator (split) that stopped for another reason than a
/// clean finalize, as its parent's supervision saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChildFailure {
    /// The child actor's name (`<name>/<epoch>/<rank>`).
    pub name: String,
    /// Why it stopped.
    pub reason: String,
}

#[derive(Debug, Default)]
struct Cell {
    state: AtomicU8,
    cause: OnceLock<Error>,
    /// An op has failed with the abort's cause, a fatal mismatch ([SU-5]).
    ///
    /// [SU-5]: crate::actors::status#invariants
    mismatch_told: AtomicBool,
    child_failures: Mutex<Vec<ChildFailure>>,
}

/// Reads a communicator's status; cheap to clone.
#[derive(Debug, Clone)]
pub(crate) struct StatusReader(Arc<Cell>);

/// Writes a communicator's status: held by its actor alone ([SU-1], [SU-2]).
///
/// [SU-1]: crate::actors::status#invariants
/// [SU-2]: crate::actors::status#invariants
#[derive(Debug)]
pub(crate) struct StatusWriter(Arc<Cell>);

/// A new status, `Active`: its only writer and a reader.
pub(crate) fn status() -> (StatusWriter, StatusReader) {
    let cell = Arc::new(Cell::default());
    (StatusWriter(cell.clone()), StatusReader(cell))
}

impl StatusReader {
    /// The current state.
    pub(crate) fn state(&self) -> State {
        State::from_u8(self.0.state.load(Ordering::Acquire))
    }

    /// The cause of the abort, if aborted.
    pub(crate) fn cause(&self) -> Option<Error> {
        self.0.cause.get().cloned()
    }

    /// A snapshot.
    pub(crate) fn get(&self) -> Status {
        Status {
            state: self.state(),
            cause: self.cause(),
        }
    }

    /// Children that failed.
    pub(crate) fn child_failures(&self) -> Vec<ChildFailure> {
        self.0
            .child_failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Record that an op completes with `error`: a fatal mismatch told to
    /// one op is not told again ([SU-5]).
    ///
    /// [SU-5]: crate::actors::status#invariants
    pub(crate) fn told(&self, error: &Error) {
        told(&self.0, error);
    }

    /// The error of an op that reaches a communicator that no longer runs
    /// ops: `Aborted` carrying the cause, or `Finalized`; the cause itself
    /// when it is a fatal mismatch that no op was told yet ([SU-5]).
    ///
    /// [SU-5]: crate::actors::status#invariants
    pub(crate) fn closed_error(&self, name: &str, rank: usize, epoch: u64) -> Error {
        if self.state() == State::Aborted {
            if let Some(e @ Error::Mismatch { fatal: true, .. }) = self.0.cause.get() {
                if !self.0.mismatch_told.swap(true, Ordering::AcqRel) {
                    return e.clone();
                }
            }
        }
        match self.state() {
            State::Finalized | State::Active => Error::Finalized {
                comm: name.to_string(),
                rank,
            },
            State::Aborted => aborted_error(name, rank, epoch, self.cause().as_ref()),
        }
    }
}

/// `Aborted` for an op that meets a communicator aborted by `cause`.
pub(crate) fn aborted_error(name: &str, rank: usize, epoch: u64, cause: Option<&Error>) -> Error {
    match cause {
        // A user's abort (or a parent's) is its own reason.
        Some(Error::Aborted {
            failed_ranks,
            reason,
            ..
        }) => Error::Aborted {
            comm: name.to_string(),
            rank,
            epoch,
            failed_ranks: failed_ranks.clone(),
            reason: reason.clone(),
        },
        Some(e) => Error::Aborted {
            comm: name.to_string(),
            rank,
            epoch,
            failed_ranks: e.failed_ranks().to_vec(),
            reason: format!("an earlier operation failed: {e}"),
        },
        None => Error::Aborted {
            comm: name.to_string(),
            rank,
            epoch,
            failed_ranks: vec![],
            reason: "the communicator was aborted".into(),
        },
    }
}

/// [SU-5]: note that an op was failed with a fatal mismatch.
fn told(cell: &Cell, error: &Error) {
    if matches!(error, Error::Mismatch { fatal: true, .. }) {
        cell.mismatch_told.store(true, Ordering::Release);
    }
}

impl StatusWriter {
    /// Record that an op completes with `error` ([SU-5]).
    ///
    /// [SU-5]: crate::actors::status#invariants
    pub(crate) fn told(&self, error: &Error) {
        told(&self.0, error);
    }

    /// The current state.
    pub(crate) fn state(&self) -> State {
        State::from_u8(self.0.state.load(Ordering::Acquire))
    }

    /// `Active` → `Aborted` with `cause` ([SU-1], [SU-2]). Returns false if the
    /// communicator was no longer active.
    ///
    /// [SU-1]: crate::actors::status#invariants
    /// [SU-2]: crate::actors::status#invariants
    pub(crate) fn abort(&self, cause: Error) -> bool {
        if self.state() != State::Active {
            return false;
        }
        // The cause first, so a reader that sees `Aborted` sees its cause.
        let _ = self.0.cause.set(cause);
        self.0.state.store(2, Ordering::Release);
        true
    }

    /// `Active` → `Finalized` ([SU-1]). Returns false if it was not active.
    ///
    /// [SU-1]: crate::actors::status#invariants
    pub(crate) fn finalize(&self) -> bool {
        self.0
            .state
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }

    /// Record a child's failure.
    pub(crate) fn child_failed(&self, failure: ChildFailure) {
        self.0
            .child_failures
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(failure);
    }
}

/// A request to abort a communicator: raised by anyone, acted on by its
/// actor ([SU-3]).
///
/// [SU-3]: crate::actors::status#invariants
/// The token tree wakes whoever awaits [`AbortSignal::raised`]; the flags
/// answer [`AbortSignal::is_raised`] without a lock ([SU-4]).
///
/// [SU-3]: crate::actors::status#invariants
/// [SU-4]: crate::actors::status#invariants
#[derive(Debug)]
pub(crate) struct AbortSignal {
    token: CancellationToken,
    cause: OnceLock<Error>,
    /// Set by `raise`, before `token` is cancelled ([SU-4]).
    ///
    /// [SU-4]: crate::actors::status#invariants
    raised: AtomicBool,
    /// Cancelled with `token`, or alone to abort only the children.
    kids: CancellationToken,
    kids_cause: OnceLock<Error>,
    /// Set by `raise_children`, before `kids` is cancelled ([SU-4]).
    ///
    /// [SU-4]: crate::actors::status#invariants
    kids_raised: AtomicBool,
    parent: Option<(Arc<AbortSignal>, String)>,
}

impl AbortSignal {
    /// A signal of a top-level communicator.
    pub(crate) fn new() -> Arc<AbortSignal> {
        let token = CancellationToken::new();
        Arc::new(AbortSignal {
            kids: token.child_token(),
            token,
            cause: OnceLock::new(),
            raised: AtomicBool::new(false),
            kids_cause: OnceLock::new(),
            kids_raised: AtomicBool::new(false),
            parent: None,
        })
    }

    /// A child's signal: raised when `parent` is ([SU-3]). `parent_name`
    /// names the parent in the child's cause.
    ///
    /// [SU-3]: crate::actors::status#invariants
    pub(crate) fn child_of(parent: &Arc<AbortSignal>, parent_name: &str) -> Arc<AbortSignal> {
        let token = parent.kids.child_token();
        Arc::new(AbortSignal {
            kids: token.child_token(),
            token,
            cause: OnceLock::new(),
            raised: AtomicBool::new(false),
            kids_cause: OnceLock::new(),
            kids_raised: AtomicBool::new(false),
            parent: Some((parent.clone(), parent_name.to_string())),
        })
    }

    /// Ask every descendant, but not this communicator, to abort.
    pub(crate) fn raise_children(&self, cause: Error) {
        let _ = self.kids_cause.set(cause);
        // SU-4: the flag before the token, so a woken waiter sees it.
        self.kids_raised.store(true, Ordering::Release);
        self.kids.cancel();
    }

    /// Whether this signal's children are asked to abort: by
    /// `raise_children`, or with this signal itself ([SU-4]).
    ///
    /// [SU-4]: crate::actors::status#invariants
    fn kids_raised(&self) -> bool {
        self.kids_raised.load(Ordering::Acquire) || self.is_raised()
    }

    /// The cause a child reports for its parent's abort.
    fn cause_for_children(&self, comm: &str, rank: usize, epoch: u64) -> Option<Error> {
        match self.kids_cause.get() {
            Some(c) if self.cause.get().is_none() => Some(c.clone()),
            _ => self.cause(comm, rank, epoch),
        }
    }

    /// Ask for an abort because of `cause`; the first cause wins ([SU-3]).
    ///
    /// [SU-3]: crate::actors::status#invariants
    pub(crate) fn raise(&self, cause: Error) {
        let _ = self.cause.set(cause);
        // SU-4: the flag before the token, so a woken waiter sees it.
        self.raised.store(true, Ordering::Release);
        self.token.cancel();
    }

    /// Whether an abort was asked for (here or by an ancestor): atomic
    /// loads only ([SU-4]). The same answer as the token tree's, which
    /// links a child's token under its parent's `kids`.
    ///
    /// [SU-4]: crate::actors::status#invariants
    pub(crate) fn is_raised(&self) -> bool {
        self.raised.load(Ordering::Acquire)
            || self.parent.as_ref().is_some_and(|(p, _)| p.kids_raised())
    }

    /// Resolves once an abort is asked for. Polled again with the same
    /// waker, it reads the flags only ([SU-4]).
    ///
    /// [SU-4]: crate::actors::status#invariants
    pub(crate) fn raised(&self) -> Raised<'_> {
        Raised {
            signal: self,
            registered: None,
            wait: self.token.cancelled(),
        }
    }

    /// The cause of the requested abort: this signal's own, else the
    /// parent's (as a parent abort). `None` if not raised.
    pub(crate) fn cause(&self, comm: &str, rank: usize, epoch: u64) -> Option<Error> {
        if let Some(c) = self.cause.get() {
            return Some(c.clone());
        }
        if !self.is_raised() {
            return None;
        }
        let parent = self
            .parent
            .as_ref()
            .and_then(|(p, name)| Some((p.cause_for_children(name, rank, epoch)?, name)));
        Some(Error::Aborted {
            comm: comm.to_string(),
            rank,
            epoch,
            failed_ranks: parent
                .as_ref()
                .map(|(e, _)| e.failed_ranks().to_vec())
                .unwrap_or_default(),
            reason: match parent {
                Some((e, name)) => format!("parent communicator {name:?} aborted: {e}"),
                None => "the communicator was aborted".into(),
            },
        })
    }
}

pin_project_lite::pin_project! {
    /// The future of [`AbortSignal::raised`]. The token's waiter locks a
    /// mutex on every poll; this polls it only until it holds the current
    /// waker, and otherwise reads the flags ([SU-4]): every raise sets a
    /// flag before it cancels a token, so the wake-up the waiter gets finds
    /// the flag set.
    ///
    /// [SU-4]: crate::actors::status#invariants
    #[must_use = "futures do nothing unless polled"]
    pub(crate) struct Raised<'a> {
        signal: &'a AbortSignal,
        // The waker `wait` was last polled with.
        registered: Option<Waker>,
        #[pin]
        wait: WaitForCancellationFuture<'a>,
    }
}

impl Future for Raised<'_> {
    type Output = ();

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.project();
        if this.signal.is_raised() {
            return Poll::Ready(());
        }
        if this
            .registered
            .as_ref()
            .is_some_and(|w| w.will_wake(cx.waker()))
        {
            return Poll::Pending;
        }
        match this.wait.poll(cx) {
            Poll::Ready(()) => Poll::Ready(()),
            Poll::Pending => {
                *this.registered = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn user_abort(reason: &str) -> Error {
        Error::Aborted {
            comm: "c".into(),
            rank: 0,
            epoch: 0,
            failed_ranks: vec![],
            reason: reason.into(),
        }
    }

    #[test]
    fn st_1_state_moves_forward_once() {
        let (w, r) = status();
        assert_eq!(r.state(), State::Active);
        assert!(w.finalize());
        assert!(!w.abort(user_abort("late")), "finalized cannot abort");
        assert!(!w.finalize());
        assert_eq!(r.state(), State::Finalized);
        assert!(r.cause().is_none());
    }

    #[test]
    fn st_2_the_cause_is_set_with_the_abort_and_kept() {
        let (w, r) = status();
        assert!(w.abort(user_abort("first")));
        assert!(!w.abort(user_abort("second")));
        let s = r.get();
        assert_eq!(s.state, State::Aborted);
        match s.cause {
            Some(Error::Aborted { reason, .. }) => assert_eq!(reason, "first"),
            other => panic!("{other:?}"),
        }
        match r.closed_error("c", 0, 0) {
            Error::Aborted { reason, .. } => assert_eq!(reason, "first"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn st_3_first_cause_wins_and_children_inherit_the_parents() {
        let parent = AbortSignal::new();
        let child = AbortSignal::child_of(&parent, "world");
        assert!(!child.is_raised());
        parent.raise(user_abort("stop"));
        parent.raise(user_abort("ignored"));
        assert!(child.is_raised());
        match parent.cause("world", 0, 0) {
            Some(Error::Aborted { reason, .. }) => assert_eq!(reason, "stop"),
            other => panic!("{other:?}"),
        }
        match child.cause("kid", 0, 0) {
            Some(Error::Aborted { reason, comm, .. }) => {
                assert_eq!(comm, "kid");
                assert!(reason.contains("\"world\""), "{reason}");
                assert!(reason.contains("stop"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        // A child's own cause is its own.
        let other = AbortSignal::child_of(&AbortSignal::new(), "p");
        other.raise(user_abort("mine"));
        match other.cause("kid", 0, 0) {
            Some(Error::Aborted { reason, .. }) => assert_eq!(reason, "mine"),
            c => panic!("{c:?}"),
        }
    }

    #[test]
    fn su_4_flags_agree_with_the_token_tree_down_a_chain_of_splits() {
        let world = AbortSignal::new();
        let mid = AbortSignal::child_of(&world, "world");
        let leaf = AbortSignal::child_of(&mid, "mid");
        let sibling = AbortSignal::child_of(&world, "world");
        // Only the descendants of `mid`.
        mid.raise_children(user_abort("kids only"));
        assert!(!world.is_raised() && !mid.is_raised() && !sibling.is_raised());
        assert!(leaf.is_raised());
        assert_eq!(leaf.is_raised(), leaf.token.is_cancelled());
        // The root: everyone.
        world.raise(user_abort("all"));
        for s in [&world, &mid, &leaf, &sibling] {
            assert!(s.is_raised());
            assert_eq!(s.is_raised(), s.token.is_cancelled());
        }
        match sibling.cause("sib", 0, 0) {
            Some(Error::Aborted { reason, .. }) => assert!(reason.contains("all"), "{reason}"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn su_4_raised_wakes_its_waiter_and_then_resolves() {
        use std::sync::atomic::AtomicUsize;
        use std::task::Wake;
        struct Count(AtomicUsize);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let parent = AbortSignal::new();
        let child = AbortSignal::child_of(&parent, "world");
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        let mut fut = std::pin::pin!(child.raised());
        assert!(fut.as_mut().poll(&mut cx).is_pending());
        // Polled again with the same waker: the flags only, still pending.
        assert!(fut.as_mut().poll(&mut cx).is_pending());
        parent.raise(user_abort("stop"));
        assert_eq!(count.0.load(Ordering::SeqCst), 1, "the waiter was woken");
        assert!(fut.as_mut().poll(&mut cx).is_ready());
    }
}
