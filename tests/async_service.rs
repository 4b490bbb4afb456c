//! Chorus driven from an async service: every rank is a task of the test's
//! own tokio runtime (multi-thread and current-thread), and awaits every
//! communicating method: ops, split, split_by_color, hierarchy,
//! pending_joiners, reconfigure after a killed rank, finalize and abort.
//! The communicators live on Chorus's own runtime, or on the caller's
//! (`CommOptions::with_runtime`).
//!
//! `Work::wait` (the blocking wait) called inside a task of a multi-thread
//! runtime completes even when the op's turn is queued on that very worker.
//!
//! A ticker task shows that no worker of the caller's runtime is blocked:
//! it must keep ticking while a rank waits two seconds in bootstrap for a
//! late peer, even on a current-thread runtime, whose only thread would
//! stop if anything blocked it.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus::transport::{MemoryStore, Store};
use chorus::{
    new_comm_async, Comm, CommOptions, Device, Error, ReconfigureOptions, ReduceOp, Rendezvous,
    State, Tensor,
};

/// Every test finishes within this, or fails.
const DEADLINE: Duration = Duration::from_secs(90);

fn opts(store: &Arc<dyn Store>, rank: usize, size: usize, callers_rt: bool) -> CommOptions {
    let o = CommOptions::default()
        .with_rank(rank, size)
        .with_rendezvous(Rendezvous::Store(store.clone()))
        .with_secret("async-service")
        .with_timeout(Duration::from_secs(30))
        .with_connect_timeout(Duration::from_secs(20))
        .with_heartbeat(Duration::from_millis(100), Duration::from_secs(2));
    if callers_rt {
        o.with_runtime(tokio::runtime::Handle::current())
    } else {
        o
    }
}

/// Start `size` ranks as tasks of the current runtime, each running `f` on
/// its communicator `name`; the results by rank.
async fn ranks<T, F, Fut>(size: usize, name: &str, callers_rt: bool, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(Comm) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = T> + Send + 'static,
{
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let f = Arc::new(f);
    let tasks: Vec<_> = (0..size)
        .map(|rank| {
            let (store, f, name) = (store.clone(), f.clone(), name.to_string());
            tokio::spawn(async move {
                let comm = new_comm_async(
                    "cpu",
                    Device::Cpu,
                    &name,
                    opts(&store, rank, size, callers_rt),
                )
                .await
                .unwrap_or_else(|e| panic!("rank {rank}: new_comm_async: {e}"));
                f(comm).await
            })
        })
        .collect();
    let all = async {
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.expect("rank task panicked"));
        }
        out
    };
    tokio::time::timeout(DEADLINE, all)
        .await
        .expect("ranks did not finish within the deadline")
}

/// Every collective and point-to-point op, awaited, checked by value.
async fn ops(comm: &Comm) {
    let (r, n) = (comm.rank(), comm.size());
    let ni = n as i64;

    let s = comm
        .all_reduce_async(Tensor::full(r as i64 + 1, 33), ReduceOp::Sum)
        .await
        .unwrap();
    assert_eq!(s.to_vec::<i64>(), vec![ni * (ni + 1) / 2; 33]);

    let m = comm
        .all_reduce_async(Tensor::full(r as f32, 5), ReduceOp::Max)
        .await
        .unwrap();
    assert_eq!(m.to_vec::<f32>(), vec![(n - 1) as f32; 5]);

    let root = n - 1;
    let b = comm
        .broadcast_async(Tensor::full(if r == root { 7i32 } else { 0 }, 9), root)
        .await
        .unwrap();
    assert_eq!(b.to_vec::<i32>(), vec![7; 9]);

    let g = comm
        .all_gather_async(Tensor::full(r as i64, 2))
        .await
        .unwrap();
    let want: Vec<i64> = (0..ni).flat_map(|k| [k, k]).collect();
    assert_eq!(g.to_vec::<i64>(), want);

    let rs = comm
        .reduce_scatter_async(Tensor::full(1i64, 3 * n), ReduceOp::Sum)
        .await
        .unwrap();
    assert_eq!(rs.to_vec::<i64>(), vec![ni; 3]);

    let input: Vec<i64> = (0..ni).map(|k| r as i64 * 100 + k).collect();
    let a2a = comm
        .all_to_all_single_async(Tensor::from_vec(input))
        .await
        .unwrap();
    let want: Vec<i64> = (0..ni).map(|k| k * 100 + r as i64).collect();
    assert_eq!(a2a.to_vec::<i64>(), want);

    comm.barrier_async().await.unwrap();

    // A ring: send to the next rank, receive from the previous one. Even
    // ranks send first, so a two-rank ring cannot deadlock.
    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
    let payload = Tensor::full(r as i64, 4);
    let got = if n == 1 {
        payload
    } else if r % 2 == 0 {
        comm.send_async(payload, next).await.unwrap();
        comm.recv_async(Tensor::zeros(chorus::DType::I64, 4), prev)
            .await
            .unwrap()
    } else {
        let got = comm
            .recv_async(Tensor::zeros(chorus::DType::I64, 4), prev)
            .await
            .unwrap();
        comm.send_async(payload, next).await.unwrap();
        got
    };
    assert_eq!(got.to_vec::<i64>(), vec![prev as i64; 4]);

    // Several ops in flight at once complete in order, each exactly once.
    let works: Vec<_> = (0..8)
        .map(|k| comm.all_reduce_async(Tensor::full(k as i64, 1), ReduceOp::Sum))
        .collect();
    for (k, w) in works.into_iter().enumerate() {
        assert_eq!(w.await.unwrap().to_vec::<i64>(), vec![k as i64 * ni]);
    }
}

/// Ops, then every lifecycle method, all awaited.
async fn service(comm: Comm) -> usize {
    let (r, n) = (comm.rank(), comm.size());
    ops(&comm).await;

    // A split of the first two ranks; the others get no communicator.
    let pair = comm.split_async(&[0, 1], "pair").await.unwrap();
    assert_eq!(pair.is_some(), r < 2);
    if let Some(p) = &pair {
        assert_eq!((p.rank(), p.size()), (r, 2));
        ops(p).await;
    }

    // Colours by parity, keyed by rank.
    let parity = comm
        .split_by_color_async(Some((r % 2) as u32), r as i64, "parity")
        .await
        .unwrap()
        .expect("every rank has a colour");
    assert_eq!(
        parity.size(),
        n.div_ceil(2) - usize::from(r % 2 == 1 && n % 2 == 1)
    );
    ops(&parity).await;

    assert_eq!(comm.pending_joiners_async().await.unwrap(), 0);

    // Abort a child: it ends, its parent keeps working.
    parity.abort_async().await;
    assert!(parity.is_aborted());
    assert!(parity.barrier_async().await.is_err());
    comm.barrier_async().await.unwrap();
    if let Some(p) = pair {
        p.finalize_async().await.unwrap();
        assert_eq!(p.status().state, State::Finalized);
        assert!(p.barrier_async().await.is_err());
    }

    // One host: the local level is the whole world, the cross level one rank.
    let h = comm.hierarchy_async().await.unwrap();
    assert_eq!((h.local.size(), h.cross.size()), (n, 1));
    // Dropping the parent's handle does not end the children the user
    // still holds: they keep what they need alive.
    drop(comm);
    ops(&h.local).await;
    ops(&h.cross).await;
    h.cross.finalize_async().await.unwrap();
    h.local.finalize_async().await.unwrap();
    assert_eq!(h.local.status().state, State::Finalized);
    n
}

/// One rank is killed (aborted by the test, its links cut); every survivor
/// gets a typed error naming it, then the survivors reconfigure, awaited.
async fn reconfigure_after_kill(comm: Comm, victim: usize) -> Option<usize> {
    let (r, n) = (comm.rank(), comm.size());
    // The victim may leave this barrier and die before a slower survivor
    // completes it: then the barrier is where that survivor sees it.
    let first = comm.barrier_async().await;
    if r == victim {
        comm.abort_with_reason_async("killed by the test").await;
        assert!(comm.is_aborted());
        return None;
    }
    let start = Instant::now();
    let err = loop {
        if let Err(e) = &first {
            break e.clone();
        }
        match comm
            .all_reduce_async(Tensor::full(1i64, 16), ReduceOp::Sum)
            .await
        {
            Ok(_) => assert!(
                start.elapsed() < Duration::from_secs(20),
                "rank {r} never saw the failure"
            ),
            Err(e) => break e,
        }
    };
    assert!(
        matches!(err, Error::PeerFailed { .. } | Error::Aborted { .. }),
        "rank {r}: {err}"
    );
    assert_eq!(err.failed_ranks(), &[victim], "rank {r}: {err}");
    let (next, map) = comm
        .reconfigure_async(ReconfigureOptions {
            min_size: Some(n - 1),
            timeout: Duration::from_secs(20),
            ..Default::default()
        })
        .await
        .unwrap_or_else(|e| panic!("rank {r}: reconfigure: {e}"));
    assert_eq!(map.old_to_new[victim], None);
    assert_eq!((next.size(), next.epoch()), (n - 1, 1));
    let s = next
        .all_reduce_async(Tensor::full(1i64, 8), ReduceOp::Sum)
        .await
        .unwrap();
    assert_eq!(s.to_vec::<i64>(), vec![(n - 1) as i64; 8]);
    next.finalize_async().await.unwrap();
    Some(next.size())
}

async fn every_method(callers_rt: bool) {
    for n in [2, 4] {
        let name = format!("svc{n}-{callers_rt}");
        assert_eq!(ranks(n, &name, callers_rt, service).await, vec![n; n]);
    }
}

async fn kill_then_reconfigure(callers_rt: bool) {
    for n in [2, 4] {
        let victim = n - 1;
        let name = format!("kill{n}-{callers_rt}");
        let out = ranks(n, &name, callers_rt, move |c| {
            reconfigure_after_kill(c, victim)
        })
        .await;
        let mut want = vec![Some(n - 1); n];
        want[victim] = None;
        assert_eq!(out, want);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_thread_service_awaits_every_method() {
    every_method(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_thread_service_with_comms_on_its_runtime_awaits_every_method() {
    every_method(true).await;
}

#[tokio::test(flavor = "current_thread")]
async fn current_thread_service_awaits_every_method() {
    every_method(false).await;
}

#[tokio::test(flavor = "current_thread")]
async fn current_thread_service_with_comms_on_its_runtime_awaits_every_method() {
    every_method(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn multi_thread_survivors_reconfigure_after_a_killed_rank() {
    kill_then_reconfigure(false).await;
}

#[tokio::test(flavor = "current_thread")]
async fn current_thread_survivors_reconfigure_after_a_killed_rank() {
    kill_then_reconfigure(true).await;
}

/// Ticks every 10 ms until stopped; returns the number of ticks and the
/// longest gap between two.
fn ticker(stop: Arc<AtomicBool>) -> tokio::task::JoinHandle<(usize, Duration)> {
    tokio::spawn(async move {
        let (mut ticks, mut gap) = (0usize, Duration::ZERO);
        let mut last = Instant::now();
        while !stop.load(Ordering::Acquire) {
            tokio::time::sleep(Duration::from_millis(10)).await;
            gap = gap.max(last.elapsed());
            last = Instant::now();
            ticks += 1;
        }
        (ticks, gap)
    })
}

/// Rank 0 waits in bootstrap for rank 1, which starts two seconds late.
async fn late_peer_keeps_ticker_running(callers_rt: bool) {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let stop = Arc::new(AtomicBool::new(false));
    let tick = ticker(stop.clone());
    let name = format!("late-{callers_rt}");
    let start = Instant::now();
    let early = {
        let (store, name) = (store.clone(), name.clone());
        tokio::spawn(async move {
            let c = new_comm_async("cpu", Device::Cpu, &name, opts(&store, 0, 2, callers_rt))
                .await
                .unwrap();
            (c, start.elapsed())
        })
    };
    tokio::time::sleep(Duration::from_secs(2)).await;
    let late = new_comm_async("cpu", Device::Cpu, &name, opts(&store, 1, 2, callers_rt));
    let (late, early) = tokio::time::timeout(DEADLINE, async {
        let late = late.await.unwrap();
        (late, early.await.unwrap())
    })
    .await
    .expect("bootstrap did not finish");
    let (early, waited) = early;
    stop.store(true, Ordering::Release);
    let (ticks, gap) = tick.await.unwrap();
    assert!(waited >= Duration::from_secs(2), "rank 0 waited {waited:?}");
    // Blocked for the wait, the ticker would show one gap of two seconds.
    assert!(
        gap < Duration::from_millis(1000),
        "longest tick gap {gap:?}"
    );
    assert!(ticks >= 20, "only {ticks} ticks in {waited:?}");
    let (a, b) = (
        early.all_reduce_async(Tensor::full(1i64, 4), ReduceOp::Sum),
        late.all_reduce_async(Tensor::full(2i64, 4), ReduceOp::Sum),
    );
    let (a, b) = (a.await.unwrap(), b.await.unwrap());
    assert_eq!(
        (a.to_vec::<i64>(), b.to_vec::<i64>()),
        (vec![3; 4], vec![3; 4])
    );
    let (fa, fb) = (early.finalize_async(), late.finalize_async());
    let (fa, fb) = futures::join!(fa, fb);
    fa.unwrap();
    fb.unwrap();
}

#[tokio::test(flavor = "current_thread")]
async fn bootstrap_wait_never_blocks_a_current_thread_runtime() {
    late_peer_keeps_ticker_running(false).await;
    late_peer_keeps_ticker_running(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bootstrap_wait_never_blocks_a_multi_thread_worker() {
    late_peer_keeps_ticker_running(false).await;
    late_peer_keeps_ticker_running(true).await;
}

/// On a worker of the caller's runtime, an op on an idle communicator gets
/// a first poll inside the async call itself: one that can finish at once
/// (here, a world of one) is complete before it is awaited, with no task in
/// between; one that cannot continues as a task, and runs even when its
/// `Work` is dropped unawaited.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_op_that_can_finish_at_once_is_done_before_it_is_awaited() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let one = new_comm_async("cpu", Device::Cpu, "first-poll-1", opts(&store, 0, 1, true))
        .await
        .expect("new_comm");
    for _ in 0..100 {
        let w = one.all_reduce_async(Tensor::full(2.0f32, 4), ReduceOp::Sum);
        assert!(
            w.is_completed(),
            "the turn did not finish in the first poll"
        );
        assert_eq!(w.await.expect("all_reduce").to_vec::<f32>(), vec![2.0; 4]);
    }
    one.finalize_async().await.expect("finalize");

    // Two ranks: whichever way each first poll goes (a peer may not have
    // called yet), rank 0's dropped op still runs, in order, on both.
    let got = ranks(2, "first-poll-2", true, |comm| async move {
        for step in 0..50 {
            let w = comm.all_reduce_async(Tensor::full(1.0f32, 4), ReduceOp::Sum);
            if comm.rank() == 0 {
                drop(w);
            } else {
                assert_eq!(w.await.expect("all_reduce").to_vec::<f32>(), vec![2.0; 4]);
            }
            let b = comm.broadcast_async(Tensor::full(step as u8, 1), 0).await;
            assert_eq!(b.expect("broadcast").to_vec::<u8>(), vec![step as u8]);
        }
        comm.all_reduce_async(Tensor::full(1.0f32, 4), ReduceOp::Sum)
            .await
            .expect("all_reduce")
            .to_vec::<f32>()
    })
    .await;
    assert_eq!(got, vec![vec![2.0f32; 4]; 2]);
}

/// Run `f` on a thread of its own, failing the test if it takes longer
/// than [`DEADLINE`]: for tests whose regression would block a runtime's
/// workers (and with them any timer a `tokio::time::timeout` needs).
fn bounded<R: Send + 'static>(what: &str, f: impl FnOnce() -> R + Send + 'static) -> R {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(f());
    });
    match rx.recv_timeout(DEADLINE) {
        Ok(r) => r,
        Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
            panic!("{what} did not finish within {DEADLINE:?} (a blocked worker?)")
        }
        Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => panic!("{what} panicked"),
    }
}

fn multi_thread(workers: usize) -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(workers)
        .enable_all()
        .build()
        .expect("runtime")
}

/// WK-6, as a user writes it: `comm.all_reduce_async(..).wait()` inside
/// `tokio::spawn` on a multi-thread runtime of one and of two workers.
/// (A world of one finishes each turn in its first poll, inside the call,
/// so this passed before `wait` used `block_in_place` too; the next test
/// is the one that hung.)
#[test]
fn work_wait_inside_a_multi_thread_task_completes() {
    for workers in [1usize, 2] {
        bounded("Work::wait inside a task", move || {
            let name = format!("wait-in-task-{workers}");
            let comm = chorus::new_comm("cpu", Device::Cpu, &name, CommOptions::single())
                .expect("new_comm");
            multi_thread(workers).block_on(async move {
                tokio::spawn(async move {
                    for i in 0..20u8 {
                        let out = comm
                            .all_reduce_async(Tensor::full(f32::from(i), 4), ReduceOp::Sum)
                            .wait()
                            .expect("all_reduce");
                        assert_eq!(out.to_vec::<f32>(), vec![f32::from(i); 4]);
                    }
                    comm.finalize_async().await.expect("finalize");
                })
                .await
                .expect("task");
            });
        });
    }
}

/// WK-6 where it used to hang: rank 0 issues an op from a task of a
/// one-worker runtime before rank 1 has issued its own, so the turn's
/// first poll (inside the call) cannot finish it and the turn goes on as a
/// task in that worker's LIFO slot, which no other thread steals; then the
/// task calls the blocking `wait`. The wait must hand the worker's tasks
/// to another thread (`block_in_place`), or the turn never runs.
#[test]
fn work_wait_inside_a_task_runs_the_turn_queued_on_its_own_worker() {
    const ROUNDS: usize = 20;
    let (got0, got1) = bounded("Work::wait with the turn queued on its worker", || {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
        let name = "wait-queued-turn";
        let peer = {
            let store = store.clone();
            std::thread::spawn(move || {
                chorus::new_comm("cpu", Device::Cpu, name, opts(&store, 1, 2, false))
            })
        };
        let comm0 = chorus::new_comm("cpu", Device::Cpu, name, opts(&store, 0, 2, false))
            .expect("rank 0: new_comm");
        let comm1 = peer
            .join()
            .expect("rank 1 thread")
            .expect("rank 1: new_comm");
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let rank1 = std::thread::spawn(move || {
            let mut outs = Vec::new();
            for _ in 0..ROUNDS {
                go_rx.recv().expect("rank 0 went away");
                let out = comm1
                    .all_reduce(Tensor::full(2.0f32, 4), ReduceOp::Sum)
                    .expect("rank 1: all_reduce");
                outs.push(out.to_vec::<f32>());
            }
            comm1.finalize().expect("rank 1: finalize");
            outs
        });
        let got0 = multi_thread(1).block_on(async move {
            tokio::spawn(async move {
                let mut outs = Vec::new();
                for _ in 0..ROUNDS {
                    let w = comm0.all_reduce_async(Tensor::full(1.0f32, 4), ReduceOp::Sum);
                    // Only now may rank 1 issue its op.
                    go_tx.send(()).expect("rank 1 went away");
                    outs.push(w.wait().expect("rank 0: all_reduce").to_vec::<f32>());
                }
                comm0.finalize_async().await.expect("rank 0: finalize");
                outs
            })
            .await
            .expect("rank 0 task")
        });
        (got0, rank1.join().expect("rank 1 thread"))
    });
    assert_eq!(got0, vec![vec![3.0f32; 4]; ROUNDS]);
    assert_eq!(got1, vec![vec![3.0f32; 4]; ROUNDS]);
}
