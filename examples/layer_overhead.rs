//! Overhead of the actor layer: the same all_reduce (f32 sum, 2 ranks in one
//! process, shared-memory links) through [`Comm`] (blocking calls from plain
//! threads, and `_async` forms awaited from tasks of a tokio runtime), and
//! through the cpu backend directly, as a turn calls it for the check mode
//! of `CHORUS_CHECKS` (strict: header exchange + execute; fingerprint:
//! execute with the op's fingerprint; off: execute).
//!
//! ```text
//! cargo run --release --example layer_overhead [iters]
//! cargo run --release --example layer_overhead <iters> one
//! ```
//!
//! Prints the median time per op of each layer for 8 B, 64 KiB and 1 MiB,
//! and of the same blocking op on a world of one rank (the layers alone:
//! that backend moves nothing).
//!
//! With `one`, it only runs `iters` blocking 8 B all_reduces on a world of
//! one and prints nothing: the loop to count the layers' instructions per
//! op with, deterministically, e.g. as the difference of two
//! `valgrind --tool=callgrind` runs at 20 000 and 60 000 iterations.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus::backends::cpu::CpuBackend;
use chorus::backends::{Backend, BackendInit, OpCtx, OpData};
use chorus::checks::{fingerprint, Signature};
use chorus::transport::MemoryStore;
use chorus::{new_comm, Checks, CommOptions, Device, OpKind, ReduceOp, Rendezvous, Tensor};

const SIZES: [usize; 3] = [8, 64 << 10, 1 << 20];

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v.get(v.len() / 2).copied().unwrap_or(0.0)
}

fn init(store: &Arc<MemoryStore>, rank: usize) -> BackendInit {
    BackendInit {
        comm: "layers".into(),
        key_prefix: "comm/layers#0/epoch/0".into(),
        rank,
        size: 2,
        epoch: 0,
        store: store.clone(),
        secret: Arc::from(&b"layers"[..]),
        connect_timeout: Duration::from_secs(10),
        bind_ip: "127.0.0.1".parse().expect("ip"),
        links: chorus::backends::LinkPolicy::Auto,
        host_id: None,
        peers_failed: chorus::backends::PeerFailures::none(),
    }
}

/// Per size, the median seconds per op over both ranks (max of the two per op).
fn backend_direct(iters: usize) -> Vec<f64> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let store = Arc::new(MemoryStore::new());
        let tasks: Vec<_> = (0..2)
            .map(|rank| {
                let store = store.clone();
                tokio::spawn(async move {
                    let mut b = CpuBackend::connect(init(&store, rank))
                        .await
                        .expect("connect");
                    let mut per_size = Vec::new();
                    let mut seq = 0u64;
                    let checks = CommOptions::default().checks;
                    for bytes in SIZES {
                        let mut buf = Tensor::zeros(chorus::DType::F32, bytes / 4);
                        let mut times = Vec::with_capacity(iters);
                        for i in 0..iters + 10 {
                            let fingerprint = match checks {
                                Checks::Fingerprint => fingerprint(&Signature {
                                    seq,
                                    epoch: 0,
                                    kind: OpKind::AllReduce,
                                    dtype: buf.dtype(),
                                    redop: ReduceOp::Sum.code(),
                                    root: u32::MAX,
                                    count: buf.len() as u64,
                                    counts: &[],
                                }),
                                _ => 0,
                            };
                            let ctx = OpCtx {
                                comm: "layers".into(),
                                rank,
                                size: 2,
                                epoch: 0,
                                kind: OpKind::AllReduce,
                                seq,
                                fingerprint,
                                headers: checks == Checks::Strict,
                                may_block: true,
                                order: Default::default(),
                            };
                            let start = Instant::now();
                            let mut data = OpData::AllReduce {
                                buf,
                                op: ReduceOp::Sum,
                            };
                            // As a turn calls it: with strict checks, with the
                            // op's buffers, so a small op's payload travels
                            // with the header.
                            if checks == Checks::Strict {
                                b.exchange_headers_with_data(
                                    &ctx,
                                    vec![(1 - rank, seq, vec![0u8; 48])],
                                    &data,
                                )
                                .await
                                .expect("headers");
                            }
                            b.execute(&ctx, &mut data).await.expect("execute");
                            buf = match data {
                                OpData::AllReduce { buf, .. } => buf,
                                _ => unreachable!("all_reduce data"),
                            };
                            if i >= 10 {
                                times.push(start.elapsed().as_secs_f64());
                            }
                            seq += 1;
                        }
                        per_size.push(times);
                    }
                    b.finalize().await;
                    per_size
                })
            })
            .collect();
        let mut res = Vec::new();
        for t in tasks {
            res.push(t.await.expect("rank task"));
        }
        max_median(&res)
    })
}

/// Median per size of the per-op max over both ranks.
fn max_median(res: &[Vec<Vec<f64>>]) -> Vec<f64> {
    (0..SIZES.len())
        .map(|s| {
            median(
                res[0][s]
                    .iter()
                    .zip(&res[1][s])
                    .map(|(a, b)| a.max(*b))
                    .collect(),
            )
        })
        .collect()
}

/// Each rank a task of one multi-thread tokio runtime (2 workers), awaiting
/// `all_reduce_async`; the communicators on Chorus's own runtime, or on the
/// caller's (`with_runtime`) when `callers` is set.
fn awaited(iters: usize, callers: bool) -> Vec<f64> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let store: Arc<MemoryStore> = Arc::new(MemoryStore::new());
    let res: Vec<Vec<Vec<f64>>> = rt.block_on(async {
        let tasks: Vec<_> = (0..2)
            .map(|rank| {
                let store = store.clone();
                tokio::spawn(async move {
                    let mut opts = CommOptions::default()
                        .with_rank(rank, 2)
                        .with_secret(b"layers".to_vec())
                        .with_rendezvous(Rendezvous::Store(store));
                    if callers {
                        opts = opts.with_runtime(tokio::runtime::Handle::current());
                    }
                    let comm = chorus::new_comm_async("cpu", Device::Cpu, "layers-async", opts)
                        .await
                        .expect("new_comm");
                    let mut per_size = Vec::new();
                    for bytes in SIZES {
                        let mut t = Tensor::zeros(chorus::DType::F32, bytes / 4);
                        let mut times = Vec::with_capacity(iters);
                        for i in 0..iters + 10 {
                            let start = Instant::now();
                            t = comm
                                .all_reduce_async(t, ReduceOp::Sum)
                                .await
                                .expect("all_reduce");
                            if i >= 10 {
                                times.push(start.elapsed().as_secs_f64());
                            }
                        }
                        per_size.push(times);
                    }
                    comm.finalize_async().await.expect("finalize");
                    per_size
                })
            })
            .collect();
        let mut res = Vec::new();
        for t in tasks {
            res.push(t.await.expect("rank task"));
        }
        res
    });
    max_median(&res)
}

fn through_comm(iters: usize) -> Vec<f64> {
    let store: Arc<MemoryStore> = Arc::new(MemoryStore::new());
    let threads: Vec<_> = (0..2)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                let opts = CommOptions::default()
                    .with_rank(rank, 2)
                    .with_secret(b"layers".to_vec())
                    .with_rendezvous(Rendezvous::Store(store));
                let comm = new_comm("cpu", Device::Cpu, "layers", opts).expect("new_comm");
                let per_size = blocking_times(&comm, iters);
                comm.finalize().expect("finalize");
                per_size
            })
        })
        .collect();
    let res: Vec<Vec<Vec<f64>>> = threads
        .into_iter()
        .map(|t| t.join().expect("rank thread"))
        .collect();
    max_median(&res)
}

/// The layers alone: the same blocking all_reduce on a world of one rank,
/// where the backend moves nothing, so what is timed is the `Comm`, the
/// ordering gate, the turn, hooks and flight recorder, and the completion.
fn world_of_one(iters: usize) -> Vec<f64> {
    let comm = new_comm("cpu", Device::Cpu, "layers-one", CommOptions::single()).expect("new_comm");
    let per_size = blocking_times(&comm, iters)
        .into_iter()
        .map(median)
        .collect();
    comm.finalize().expect("finalize");
    per_size
}

/// Per size, the seconds of each of `iters` blocking all_reduces on
/// `comm`, after 10 not timed.
fn blocking_times(comm: &chorus::Comm, iters: usize) -> Vec<Vec<f64>> {
    SIZES
        .iter()
        .map(|bytes| {
            let mut t = Tensor::zeros(chorus::DType::F32, bytes / 4);
            let mut times = Vec::with_capacity(iters);
            for i in 0..iters + 10 {
                let start = Instant::now();
                t = comm.all_reduce(t, ReduceOp::Sum).expect("all_reduce");
                if i >= 10 {
                    times.push(start.elapsed().as_secs_f64());
                }
            }
            times
        })
        .collect()
}

fn main() {
    let iters: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(200);
    if std::env::args().nth(2).as_deref() == Some("one") {
        let comm =
            new_comm("cpu", Device::Cpu, "layers-one", CommOptions::single()).expect("new_comm");
        let mut t = Tensor::zeros(chorus::DType::F32, 2);
        for _ in 0..iters {
            t = comm.all_reduce(t, ReduceOp::Sum).expect("all_reduce");
        }
        comm.finalize().expect("finalize");
        return;
    }
    // Interleave the layers so machine load hits them alike.
    let (mut direct, mut comm, mut own, mut callers, mut one) =
        (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for _ in 0..3 {
        one.push(world_of_one(iters));
        direct.push(backend_direct(iters));
        comm.push(through_comm(iters));
        own.push(awaited(iters, false));
        callers.push(awaited(iters, true));
    }
    println!(
        "{:>10} {:>13} {:>11} {:>13} {:>15} {:>11} {:>11} {:>13}",
        "bytes",
        "backend (us)",
        "block (us)",
        "await, own rt",
        "await, caller's",
        "own/block",
        "caller/block",
        "world of 1"
    );
    let med = |v: &[Vec<f64>], s: usize| median(v.iter().map(|v| v[s]).collect()) * 1e6;
    for (s, bytes) in SIZES.iter().enumerate() {
        let (d, c) = (med(&direct, s), med(&comm, s));
        let (a, b) = (med(&own, s), med(&callers, s));
        println!(
            "{bytes:>10} {d:>13.2} {c:>11.2} {a:>13.2} {b:>15.2} {:>11.2} {:>11.2} {:>13.2}",
            a / c,
            b / c,
            med(&one, s)
        );
    }
}
