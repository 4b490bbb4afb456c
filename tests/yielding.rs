//! Long transfers give the runtime back (issue 25).
//!
//! Each of 2 in-process ranks runs on a single-worker multi-thread tokio
//! runtime that is also its communicator's runtime
//! (`CommOptions::with_runtime`), so the op's turn, the task that issues it
//! and a 1 ms ticker all share one worker thread. A 64 MiB `all_reduce_async`
//! must return its `Work` at once (the turn is polled once inline, then
//! continues as a task) and the ticker must keep ticking while the transfer
//! runs, over shared memory and over TCP (`CHORUS_SHM=0`); an abort raised
//! while a large transfer is in flight must end it promptly.
//!
//! The test machine is shared with other builds, so the bounds apply to
//! what the runtime itself spent: the time the OS kept the worker thread
//! waiting for a CPU (its `schedstat` runqueue wait) is taken out; one run
//! had a 57 ms tick gap that was all the OS's. The bounds are generous
//! against the issue's targets (< 1 ms to issue, < 5 ms of ticker stall)
//! and still fail a turn that runs the transfer inline (it spends 10-16 ms
//! of its own in the issuing call). The measured figures are logged
//! (`RUST_LOG=yielding=info`, `--nocapture`) and repeated in every failure
//! message. The tests of this binary run one at a time (they measure, and
//! one sets `CHORUS_SHM`).

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use chorus::{Comm, Error, ReduceOp, Tensor};
use tokio::runtime::{Handle, Runtime};

/// Bytes of the large all_reduce (f32 elements).
const BIG: usize = 64 << 20;
/// Measured rounds after one warm-up round.
const ROUNDS: usize = 3;
/// Bounds, generous for a loaded machine, on what the runtime itself spent
/// (the worker's runqueue wait taken out). Measured with pacing: 0.02-0.9
/// ms to issue; ticker stalls (the 1 ms period included) with a median of
/// 1.4-1.9 ms per run over shared memory and 2.4-2.9 ms over TCP, and a
/// worst of 9.7 ms under load 4 on 2 cores. Without: 10-16 ms to issue,
/// every stall 10-21 ms. The issue's targets: < 1 ms, < 5 ms.
const ISSUE_BOUND: Duration = Duration::from_millis(5);
/// For the median stall over ranks and rounds.
const STALL_BOUND: Duration = Duration::from_millis(8);
/// For the worst stall.
const WORST_STALL_BOUND: Duration = Duration::from_millis(25);
/// From the abort to the end of the aborted op (measured 3-14 ms).
const ABORT_BOUND: Duration = Duration::from_millis(200);

/// One test at a time: they time things, and one changes `CHORUS_SHM`.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn init_tracing() {
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("yielding=info")),
        )
        .with_test_writer()
        .try_init();
}

/// One single-worker multi-thread runtime per rank.
fn runtimes(n: usize) -> Vec<Runtime> {
    (0..n)
        .map(|r| {
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(1)
                .thread_name(format!("rank-{r}-worker"))
                .enable_all()
                .build()
                .expect("build a rank's runtime")
        })
        .collect()
}

/// Run `body` on every rank as a task of that rank's runtime, whose handle
/// is also the communicator's runtime.
fn on_rank_runtimes<T, F, Fut>(name: &str, body: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(Comm) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = T> + Send + 'static,
{
    let rts = runtimes(2);
    let handles: Arc<Vec<Handle>> = Arc::new(rts.iter().map(|r| r.handle().clone()).collect());
    let hs = handles.clone();
    let body = Arc::new(body);
    let out = common::run_ranks_on(
        "cpu",
        2,
        name,
        move |rank, o| o.with_runtime(hs[rank].clone()),
        move |comm| {
            let h = handles[comm.rank()].clone();
            let body = body.clone();
            // The body runs as a task on the rank's only worker, like a
            // service's request handler would.
            h.block_on(h.spawn(async move { body(comm).await }))
                .expect("rank task panicked")
        },
    );
    drop(rts);
    out
}

/// How long the calling thread has waited for a CPU while runnable (Linux
/// `schedstat`; zero where unavailable). Other engineers' builds share the
/// 2 cores: a gap the OS made by not running the worker is not a stall of
/// the runtime, so the bounds apply to what is left after this wait.
fn runqueue_wait() -> Duration {
    std::fs::read_to_string("/proc/thread-self/schedstat")
        .ok()
        .and_then(|s| s.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map(Duration::from_nanos)
        .unwrap_or_default()
}

/// What the ticker saw.
#[derive(Debug, Clone, Copy, Default)]
struct Ticks {
    /// The largest gap between two ticks.
    gap: Duration,
    /// The largest gap less the time the worker waited for a CPU in it:
    /// the longest time the runtime did not get back to its timers.
    stall: Duration,
}

/// A 1 ms ticker on the current runtime (whose only worker it then shares
/// with the op's turn) until `stop` is set. Resolves `started` after its
/// first tick.
fn ticker(
    stop: Arc<AtomicBool>,
    started: tokio::sync::oneshot::Sender<()>,
) -> tokio::task::JoinHandle<Ticks> {
    tokio::spawn(async move {
        let mut iv = tokio::time::interval(Duration::from_millis(1));
        iv.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        iv.tick().await;
        let _ = started.send(());
        let mut seen = Ticks::default();
        let (mut last, mut last_wait) = (Instant::now(), runqueue_wait());
        while !stop.load(Ordering::Acquire) {
            iv.tick().await;
            let (now, wait) = (Instant::now(), runqueue_wait());
            let gap = now - last;
            seen.gap = seen.gap.max(gap);
            seen.stall = seen.stall.max(gap.saturating_sub(wait - last_wait));
            (last, last_wait) = (now, wait);
        }
        seen
    })
}

/// The figures of one measured op on one rank.
#[derive(Debug, Clone, Copy)]
struct Figures {
    /// The `_async` call returning its `Work`.
    issue: Duration,
    /// Of that, time the worker waited for a CPU.
    issue_os_wait: Duration,
    /// The 1 ms ticker while the op ran.
    ticks: Ticks,
    /// Issue to completion.
    total: Duration,
}

impl Figures {
    /// The issue time the runtime spent ([`runqueue_wait`] taken out).
    fn issue_own(&self) -> Duration {
        self.issue.saturating_sub(self.issue_os_wait)
    }
}

fn input(rank: usize, n: usize) -> Tensor {
    Tensor::from_vec(
        (0..n)
            .map(|i| ((rank + 1) * (i % 7)) as f32)
            .collect::<Vec<f32>>(),
    )
}

/// `op` over 2 ranks of [`input`] (`Sum`, `Avg`, or `PremulSum(2)`).
fn expected(op: ReduceOp, i: usize) -> f32 {
    let sum = (3 * (i % 7)) as f32;
    match op {
        ReduceOp::Avg => sum / 2.0,
        ReduceOp::PremulSum(_) => sum * 2.0,
        _ => sum,
    }
}

async fn measured_all_reduce(comm: Comm, op: ReduceOp) -> Vec<Figures> {
    let n = BIG / 4;
    let rank = comm.rank();
    // Warm-up: first-touch pages and link setup are not what this measures.
    let mut t = comm
        .all_reduce_async(input(rank, n), op)
        .await
        .expect("warm-up all_reduce");
    let mut figures = Vec::new();
    for round in 0..ROUNDS {
        // Refill in place (no new pages), then line both ranks up.
        for (i, v) in t.as_mut_slice::<f32>().iter_mut().enumerate() {
            *v = ((rank + 1) * (i % 7)) as f32;
        }
        comm.all_reduce_async(Tensor::full(1u8, 1), ReduceOp::Sum)
            .await
            .expect("line up");
        let stop = Arc::new(AtomicBool::new(false));
        let (started_tx, started) = tokio::sync::oneshot::channel();
        let tick = ticker(stop.clone(), started_tx);
        started.await.expect("ticker started");
        let (w0, t0) = (runqueue_wait(), Instant::now());
        let work = comm.all_reduce_async(t, op);
        let (issue, issue_os_wait) = (t0.elapsed(), runqueue_wait() - w0);
        let out = work.await.expect("64 MiB all_reduce");
        let total = t0.elapsed();
        stop.store(true, Ordering::Release);
        let ticks = tick.await.expect("ticker task");
        let f = Figures {
            issue,
            issue_os_wait,
            ticks,
            total,
        };
        tracing::info!(
            rank,
            round,
            issue_us = issue.as_micros() as u64,
            issue_os_wait_us = issue_os_wait.as_micros() as u64,
            max_tick_gap_us = ticks.gap.as_micros() as u64,
            max_stall_us = ticks.stall.as_micros() as u64,
            total_ms = total.as_secs_f64() * 1e3,
            "64 MiB all_reduce_async"
        );
        let got = out.as_slice::<f32>();
        assert_eq!(got.len(), n, "rank {rank}: result length");
        if let Some(i) = (0..n).find(|&i| got[i] != expected(op, i)) {
            panic!(
                "rank {rank} round {round}: element {i} of {op:?} is {}, want {}",
                got[i],
                expected(op, i)
            );
        }
        figures.push(f);
        t = out;
    }
    comm.finalize_async().await.expect("finalize");
    figures
}

/// Run the measured all_reduce on 2 ranks over `links` and check the
/// figures against the bounds.
fn issue_and_ticker_within_bounds(links: &str, op: ReduceOp) {
    let name = format!("yield-64m-{links}-{}", op.to_string().to_lowercase());
    let figures = on_rank_runtimes(&name, move |comm| measured_all_reduce(comm, op));
    let all: Vec<(usize, Figures)> = figures
        .iter()
        .enumerate()
        .flat_map(|(r, v)| v.iter().map(move |f| (r, *f)))
        .collect();
    let worst_issue = all.iter().map(|(_, f)| f.issue).max().unwrap_or_default();
    let worst_gap = all
        .iter()
        .map(|(_, f)| f.ticks.gap)
        .max()
        .unwrap_or_default();
    let worst_issue_own = all.iter().map(|(_, f)| f.issue_own()).max();
    let worst_issue_own = worst_issue_own.unwrap_or_default();
    let mut stalls: Vec<Duration> = all.iter().map(|(_, f)| f.ticks.stall).collect();
    stalls.sort();
    let worst_stall = stalls.last().copied().unwrap_or_default();
    let median_stall = stalls.get(stalls.len() / 2).copied().unwrap_or_default();
    let mut totals: Vec<Duration> = all.iter().map(|(_, f)| f.total).collect();
    totals.sort();
    let median_total = totals.get(totals.len() / 2).copied().unwrap_or_default();
    tracing::info!(
        links,
        worst_issue_us = worst_issue.as_micros() as u64,
        worst_issue_less_os_wait_us = worst_issue_own.as_micros() as u64,
        worst_tick_gap_us = worst_gap.as_micros() as u64,
        median_stall_us = median_stall.as_micros() as u64,
        worst_stall_us = worst_stall.as_micros() as u64,
        median_total_ms = median_total.as_secs_f64() * 1e3,
        "64 MiB all_reduce_async, 2 ranks, {ROUNDS} rounds"
    );
    let report = format!("{links}, per (rank, figures): {all:?}");
    // The bounds hold for what the runtime itself spent: the time the OS
    // kept its worker off the CPUs (other builds) is taken out.
    assert!(
        worst_issue_own < ISSUE_BOUND,
        "issuing took up to {worst_issue_own:?} (bound {ISSUE_BOUND:?}); {report}"
    );
    assert!(
        median_stall < STALL_BOUND,
        "the 1 ms ticker's median stall was {median_stall:?} (bound {STALL_BOUND:?}); {report}"
    );
    assert!(
        worst_stall < WORST_STALL_BOUND,
        "the 1 ms ticker stalled for up to {worst_stall:?} (bound {WORST_STALL_BOUND:?}); {report}"
    );
    for (rank, f) in &all {
        assert!(
            f.issue_own() * 3 < f.total,
            "rank {rank}: issuing took over a third of the op ({f:?}); {report}"
        );
        assert!(
            f.ticks.stall * 2 < f.total,
            "rank {rank}: the ticker stalled for over half the op ({f:?}); {report}"
        );
    }
}

/// A 64 MiB all_reduce issued from a task on a single-worker runtime
/// returns its `Work` at once, and a 1 ms ticker on that worker keeps
/// ticking while the transfer runs, over shared memory and over TCP; the
/// result is correct.
#[test]
fn large_all_reduce_async_returns_at_once_and_keeps_a_ticker_running() {
    let _one = serial();
    init_tracing();
    issue_and_ticker_within_bounds("shm", ReduceOp::Sum);
    // Read when the links are set up; no other test runs meanwhile.
    std::env::set_var("CHORUS_SHM", "0");
    let tcp = std::panic::catch_unwind(|| issue_and_ticker_within_bounds("tcp", ReduceOp::Sum));
    std::env::remove_var("CHORUS_SHM");
    if let Err(p) = tcp {
        std::panic::resume_unwind(p);
    }
}

/// What each rank saw of the aborted op: its result and, on the aborting
/// rank, how long after the abort was raised the op ended.
type AbortOutcome = (std::result::Result<(), Error>, Option<Duration>);

/// Rank 0 aborts while a 128 MiB all_reduce is moving data: its op ends
/// with `Aborted` promptly (the turn gives the runtime back between chunks,
/// so the abort task runs and the turn sees the signal), and rank 1's op
/// fails too instead of hanging.
/// The host passes around a reduction are paced too: `PremulSum`'s scaling
/// (before the transfer) and `Avg`'s division (after it) run inside the
/// turn in pieces, so issuing stays quick and the ticker keeps ticking.
#[test]
fn premul_scaling_and_avg_division_keep_a_ticker_running() {
    let _one = serial();
    init_tracing();
    issue_and_ticker_within_bounds("shm", ReduceOp::Avg);
    issue_and_ticker_within_bounds("shm", ReduceOp::PremulSum(2.0));
}

#[test]
fn abort_ends_a_large_transfer_in_flight_promptly() {
    let _one = serial();
    init_tracing();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = seen.clone();
    let out = on_rank_runtimes("yield-abort", move |comm| {
        let log = log.clone();
        async move {
            let rank = comm.rank();
            let n = (128 << 20) / 4;
            comm.all_reduce_async(Tensor::full(1u8, 1), ReduceOp::Sum)
                .await
                .expect("line up");
            let work = comm.all_reduce_async(input(rank, n), ReduceOp::Sum);
            if rank != 0 {
                let r = work.await.map(|_| ());
                return (r, None) as AbortOutcome;
            }
            // Let data flow for a few ticks (not a synchronisation: the
            // test holds whichever point of the transfer the abort meets).
            let mut iv = tokio::time::interval(Duration::from_millis(1));
            for _ in 0..4 {
                iv.tick().await;
            }
            let in_flight = !work.is_completed();
            log.lock()
                .unwrap_or_else(|e| e.into_inner())
                .push(format!("rank 0: op in flight when aborted: {in_flight}"));
            let t0 = Instant::now();
            let c = comm.clone();
            let abort = tokio::spawn(async move { c.abort_async().await });
            let r = work.await.map(|_| ());
            let took = t0.elapsed();
            abort.await.expect("abort task");
            (r, Some(took))
        }
    });
    let notes = seen.lock().unwrap_or_else(|e| e.into_inner()).join("; ");
    let (r0, took) = &out[0];
    let took = took.unwrap_or_default();
    tracing::info!(
        abort_to_end_us = took.as_micros() as u64,
        rank1 = ?out[1].0,
        "abort during a 128 MiB all_reduce"
    );
    assert!(
        notes.contains("in flight when aborted: true"),
        "the op was over before the abort: it never gave the worker back ({notes})"
    );
    match r0 {
        Err(Error::Aborted { .. }) => {}
        other => panic!("rank 0's op ended with {other:?}, want Aborted ({notes})"),
    }
    assert!(
        took < ABORT_BOUND,
        "the aborted op ended {took:?} after the abort (bound {ABORT_BOUND:?}; {notes})"
    );
    assert!(
        out[1].0.is_err(),
        "rank 1's op completed although rank 0 aborted mid-transfer ({notes})"
    );
}
