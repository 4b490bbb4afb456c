//! Where Chorus's tasks run, and how blocking calls wait without blocking a
//! caller's async runtime.
//!
//! A communicator's actor, links and heartbeats run on one tokio runtime:
//! the one given in [`CommOptions::runtime`](crate::CommOptions::runtime),
//! else a multi-thread runtime owned by the library, started on first use.
//!
//! Blocking methods (`Work::wait`, the blocking collectives, `split`,
//! `finalize`, ...) are a facade over the async ones ([`blocking`]):
//! - on a plain thread they block it;
//! - on a worker of a multi-thread tokio runtime they block inside
//!   [`tokio::task::block_in_place`], which first hands that worker's other
//!   tasks to another thread, so the caller's runtime keeps running;
//! - on a current-thread runtime they refuse with [`Error::WouldBlock`]:
//!   its only thread would stop, and with it whatever the call waits for.
//!
//! Waiting for a future from a blocking call never polls a tokio
//! `JoinHandle` from a foreign executor (whose cooperative budget would
//! never be reset): the future runs as a task and hands its output back
//! through a plain channel.

use std::future::Future;
use std::sync::OnceLock;

use tokio::runtime::{Handle, RuntimeFlavor};

use crate::error::{Error, Result};

fn own_runtime() -> &'static tokio::runtime::Runtime {
    static RT: OnceLock<tokio::runtime::Runtime> = OnceLock::new();
    RT.get_or_init(|| {
        let threads = std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(2)
            .clamp(2, 8);
        match tokio::runtime::Builder::new_multi_thread()
            .worker_threads(threads)
            .thread_name("chorus-worker")
            .enable_all()
            .build()
        {
            Ok(rt) => rt,
            // Without a runtime nothing in Chorus can work; this only fails
            // when the OS refuses to create threads.
            Err(e) => panic!("chorus: cannot start its tokio runtime: {e}"),
        }
    })
}

/// The handle of Chorus's own runtime.
pub(crate) fn handle() -> Handle {
    own_runtime().handle().clone()
}

/// The runtime `options` asks for, else Chorus's own.
pub(crate) fn handle_for(options: &crate::CommOptions) -> Handle {
    options.runtime.clone().unwrap_or_else(handle)
}

/// Whether `options` leave the communicator on Chorus's own runtime (whose
/// workers may block), rather than on a runtime the caller gave.
pub(crate) fn is_own(options: &crate::CommOptions) -> bool {
    options.runtime.is_none()
}

/// Run `fut` as a task near its caller: on the caller's multi-thread
/// runtime when there is one, polled inside `rt`'s context so that the
/// timers and tasks it creates belong to `rt`; else as a task of `rt`.
/// `fut(may_block)` builds the future: `may_block` is false on the
/// caller's runtime (a worker of the caller's must never sleep in the
/// kernel), else `own_rt` (whether `rt` is Chorus's own runtime).
///
/// On a caller's worker the future is first polled once right here, in
/// the caller's task: a turn that completes at once (a small op whose
/// peers are ready) costs no task and no wake at all. Only a turn still
/// pending after that poll becomes a task; it starts on that worker when
/// the caller next awaits, and wakes the caller there (no hand-off across
/// threads). The first poll uses a no-op waker; the task's own first poll
/// follows at once and registers its real waker, as every future must
/// expect of a new poll.
///
/// Why not always a task: tokio runs a task spawned or woken from a worker
/// in that worker's LIFO slot, but at most three in a row; the fourth goes
/// to the run queue and wakes a parked worker, which may steal it. A caller
/// awaiting op after op (caller, turn, caller, turn, ...) hit that limit
/// every other op, and a 2-rank 8 B all_reduce awaited from a task took
/// 10-12 µs in about half the runs (about 2 context switches per op),
/// against 3.7 µs blocking.
pub(crate) fn spawn_near<F>(rt: &Handle, own_rt: bool, fut: impl FnOnce(bool) -> F)
where
    F: Future<Output = ()> + Send + 'static,
{
    match Handle::try_current() {
        Ok(h) if h.runtime_flavor() == RuntimeFlavor::MultiThread => {
            let mut task = InContext {
                rt: rt.clone(),
                fut: Box::pin(fut(false)),
            };
            let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
            if std::pin::Pin::new(&mut task).poll(&mut cx).is_pending() {
                h.spawn(task);
            }
        }
        _ => {
            rt.spawn(fut(own_rt));
        }
    }
}

/// `fut`, polled inside `rt`'s runtime context.
struct InContext<F> {
    rt: Handle,
    fut: std::pin::Pin<Box<F>>,
}

impl<F: Future> Future for InContext<F> {
    type Output = F::Output;
    fn poll(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<F::Output> {
        let this = self.get_mut();
        let _enter = this.rt.enter();
        this.fut.as_mut().poll(cx)
    }
}

/// Run `fut` as a task on `rt` and await it from any executor.
pub(crate) async fn run_on<F>(rt: &Handle, fut: F) -> Result<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    rt.spawn(fut)
        .await
        .map_err(|e| Error::Internal(format!("chorus task failed: {e}")))
}

/// Run `wait`, which blocks the calling thread, where that is allowed (see
/// the module docs); `op` names the method for [`Error::WouldBlock`].
pub(crate) fn blocking<T>(op: &'static str, wait: impl FnOnce() -> Result<T>) -> Result<T> {
    match Handle::try_current() {
        Err(_) => wait(),
        Ok(h) => match h.runtime_flavor() {
            RuntimeFlavor::CurrentThread => Err(Error::WouldBlock { op }),
            _ => tokio::task::block_in_place(wait),
        },
    }
}

/// Run the future `make` returns to its end on this (blocking) thread,
/// inside `rt`'s context. The future is built where it is pinned: a
/// turn's future is several kilobytes, and moving it in would copy them.
/// It is polled once first, with a no-op waker: a future that finishes in
/// that poll (a small op) costs no runtime entry, no parker and no waker.
/// Only one that must wait goes on under [`Handle::block_on`], which polls
/// it again with a real waker (every future registers its waker anew on
/// each poll, so the no-op one is never relied on). Call only where the
/// thread may block.
pub(crate) fn run_here<F: Future>(rt: &Handle, make: impl FnOnce() -> F) -> F::Output {
    let mut fut = std::pin::pin!(make());
    {
        let _in_rt = rt.enter();
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        if let std::task::Poll::Ready(out) = fut.as_mut().poll(&mut cx) {
            return out;
        }
    }
    rt.block_on(fut)
}

/// Block (where allowed) until `fut`, run as a task on `rt`, is done.
pub(crate) fn block_on<F>(op: &'static str, rt: &Handle, fut: F) -> Result<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    blocking(op, || {
        let (tx, rx) = std::sync::mpsc::sync_channel(1);
        rt.spawn(async move {
            let _ = tx.send(fut.await);
        });
        rx.recv().map_err(|_| {
            Error::Internal(format!(
                "{op}: the task ended without a result (its runtime shut down?)"
            ))
        })
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_on_works_from_a_plain_thread() {
        assert_eq!(block_on("t", &handle(), async { 7 }).unwrap(), 7);
    }

    #[test]
    fn blocking_on_a_current_thread_runtime_is_refused() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let r = rt.block_on(async { block_on("split", &handle(), async { 1 }) });
        match r {
            Err(Error::WouldBlock { op }) => assert_eq!(op, "split"),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn blocking_on_a_multi_thread_worker_keeps_the_runtime_running() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            // A task on the only worker, which must progress while another
            // task blocks in `block_on`.
            let (tx, rx) = tokio::sync::oneshot::channel::<()>();
            let ticker = tokio::spawn(async move {
                tokio::task::yield_now().await;
                let _ = tx.send(());
            });
            let waited =
                tokio::spawn(
                    async move { block_on("t", &handle(), async move { rx.await.is_ok() }) },
                );
            assert!(waited.await.unwrap().unwrap(), "the ticker never ran");
            ticker.await.unwrap();
        });
    }
}
