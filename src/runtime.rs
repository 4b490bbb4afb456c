//! Chorus's own tokio runtime.
//!
//! Communicator actors, executors and links run on a runtime owned by the
//! library, so that blocking calls (`Work::wait`, the blocking collectives)
//! work from any thread — a plain `main`, a thread pool, or even a task of the
//! caller's own async runtime — without starving the I/O they wait for.

use std::future::Future;
use std::sync::OnceLock;

use crate::error::{Error, Result};

fn runtime() -> &'static tokio::runtime::Runtime {
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

/// The handle of Chorus's runtime.
pub(crate) fn handle() -> tokio::runtime::Handle {
    runtime().handle().clone()
}

/// Run `fut` on Chorus's runtime and await it from any executor.
pub(crate) async fn run<F>(fut: F) -> Result<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    handle()
        .spawn(fut)
        .await
        .map_err(|e| Error::Internal(format!("chorus task failed: {e}")))
}

/// Run `fut` on Chorus's runtime and block the calling thread until it is done.
pub(crate) fn block_on<F>(fut: F) -> Result<F::Output>
where
    F: Future + Send + 'static,
    F::Output: Send + 'static,
{
    futures::executor::block_on(run(fut))
}
