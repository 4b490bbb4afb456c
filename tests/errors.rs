//! Bad input and failures give typed errors on every rank: never a hang, a
//! panic or corrupt data.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus::transport::{MemoryStore, Store};
use chorus::{
    new_comm, Checks, Comm, CommOptions, DType, Device, Error, P2POp, ReduceOp, Rendezvous, Tensor,
};
use common::mismatch::{mismatch_reaches_every_rank, MismatchedOp};
use common::{opts, run_ranks, run_ranks_with};

/// The strict checks these mismatch tests were written for: every rank
/// sees every header before any data moves.
fn strict(_rank: usize, o: CommOptions) -> CommOptions {
    o.with_checks(Checks::Strict)
}

/// A parameter mismatch: reported on every rank, communicator still usable.
fn is_mismatch(e: &Error) -> bool {
    matches!(e, Error::Mismatch { fatal: false, .. })
}

#[test]
fn unknown_backend_is_a_typed_error_before_any_io() {
    let e = new_comm("nope", Device::Cpu, "x", CommOptions::single()).unwrap_err();
    match e {
        Error::UnknownBackend { name, available } => {
            assert_eq!(name, "nope");
            assert!(available.contains(&"cpu"));
        }
        other => panic!("unexpected {other:?}"),
    }
}

#[test]
fn a_world_of_several_ranks_without_rendezvous_is_a_config_error() {
    // Explicit rank/size and no rendezvous: Env is consulted; the test
    // environment sets no MASTER_ADDR, so this must fail cleanly, not hang.
    if std::env::var("MASTER_ADDR").is_ok() || std::env::var("CHORUS_STORE_ADDR").is_ok() {
        return;
    }
    let e = new_comm(
        "cpu",
        Device::Cpu,
        "x",
        CommOptions::default().with_rank(0, 2),
    )
    .unwrap_err();
    assert!(matches!(e, Error::Config(_)), "{e}");
}

#[test]
fn cuda_device_on_cpu_backend_is_invalid_argument() {
    let e = new_comm("cpu", Device::Cuda(0), "x", CommOptions::single()).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
}

#[test]
fn local_argument_errors_are_typed_and_leave_the_comm_usable() {
    let comm = new_comm("cpu", Device::Cpu, "local-args", CommOptions::single()).unwrap();
    let e = comm
        .all_reduce(Tensor::full(1.0f32, 4), ReduceOp::BXor)
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::UnsupportedOp {
                dtype: DType::F32,
                ..
            }
        ),
        "{e}"
    );
    let e = comm.broadcast(Tensor::full(1i32, 4), 1).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    let e = comm
        .reduce_scatter_v(Tensor::full(1i32, 4), &[3], ReduceOp::Sum)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    let e = comm.send(Tensor::full(1i32, 4), 0).unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    let e = comm
        .scatter(Tensor::zeros(DType::I32, 2), None, 0)
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    // Split sizes whose sum overflows are rejected, not a panic or a huge allocation.
    let e = comm
        .all_gather_v(Tensor::full(1i32, 1), &[usize::MAX])
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    let e = comm
        .all_to_all_v_single(Tensor::full(1i32, 1), &[1], &[usize::MAX])
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument { .. }), "{e}");
    let t = comm
        .all_reduce(Tensor::full(3u8, 2), ReduceOp::BXor)
        .unwrap();
    assert_eq!(t.to_vec::<u8>(), vec![3, 3]);
}

#[test]
fn mismatched_counts_give_mismatch_on_every_rank_and_comm_stays_usable() {
    let results = run_ranks_with(3, "mm-count", strict, |comm| {
        let count = if comm.rank() == 1 { 5 } else { 4 };
        let e = comm
            .all_reduce(Tensor::full(1.0f32, count), ReduceOp::Sum)
            .unwrap_err();
        assert!(is_mismatch(&e), "rank {}: {e}", comm.rank());
        // Usable afterwards (OP-2).
        let t = comm
            .all_reduce(Tensor::full(1.0f32, 4), ReduceOp::Sum)
            .unwrap();
        assert_eq!(t.to_vec::<f32>(), vec![3.0; 4]);
        e.to_string()
    });
    for msg in results {
        assert!(msg.contains("count"), "{msg}");
    }
}

#[test]
fn mismatched_dtypes_roots_and_ops_give_mismatch_on_every_rank() {
    run_ranks_with(4, "mm-misc", strict, |comm| {
        let r = comm.rank();
        let dtype = if r == 3 { DType::F64 } else { DType::F32 };
        let e = comm
            .all_reduce(Tensor::zeros(dtype, 8), ReduceOp::Sum)
            .unwrap_err();
        assert!(is_mismatch(&e), "dtype: {e}");
        let root = if r == 0 { 1 } else { 2 };
        let e = comm
            .broadcast(Tensor::zeros(DType::I32, 8), root)
            .unwrap_err();
        assert!(is_mismatch(&e), "root: {e}");
        let op = if r == 2 { ReduceOp::Max } else { ReduceOp::Sum };
        let e = comm
            .all_reduce(Tensor::zeros(DType::I32, 8), op)
            .unwrap_err();
        assert!(is_mismatch(&e), "op: {e}");
        let counts = if r == 0 {
            vec![1, 1, 1, 1]
        } else {
            vec![2, 0, 1, 1]
        };
        let e = comm
            .reduce_scatter_v(Tensor::zeros(DType::I32, 4), &counts, ReduceOp::Sum)
            .unwrap_err();
        assert!(is_mismatch(&e), "split sizes: {e}");
        // all_to_all_v: rank 0 sends 2 to rank 1, which expects 1.
        let send = if r == 0 {
            vec![0, 2, 0, 0]
        } else {
            vec![0, 0, 0, 0]
        };
        let recv = if r == 1 {
            vec![1, 0, 0, 0]
        } else {
            vec![0, 0, 0, 0]
        };
        let total = send.iter().sum();
        let e = comm
            .all_to_all_v_single(Tensor::zeros(DType::U8, total), &send, &recv)
            .unwrap_err();
        assert!(is_mismatch(&e), "all_to_all_v: {e}");
        // Still usable.
        comm.barrier().unwrap();
    });
}

/// Small ops carry their payload with their headers, large ones move it
/// after the check: both find the same mismatches, also when one rank's op
/// is small and another's is large, and the communicator stays usable.
#[test]
fn mismatches_between_small_and_large_ops_give_mismatch_on_every_rank_and_comm_stays_usable() {
    // 16 B of f32 travel with the header; 32 KiB per peer do not.
    const S: usize = 4;
    const L: usize = 8192;
    run_ranks_with(3, "mm-small-large", strict, |comm| {
        let (r, n) = (comm.rank(), comm.size());
        for (a, b) in [(S, S + 1), (L, L + 1), (S, L), (L, S)] {
            let c = if r == 1 { b } else { a };
            let what = |op: &str, e: &Error| {
                assert!(is_mismatch(e), "{op}, rank {r}, counts {a}/{b}: {e}");
            };
            let e = comm
                .all_reduce(Tensor::full(1.0f32, c), ReduceOp::Sum)
                .unwrap_err();
            what("all_reduce", &e);
            let e = comm
                .reduce(Tensor::full(1.0f32, c), ReduceOp::Sum, 2)
                .unwrap_err();
            what("reduce", &e);
            let e = comm.broadcast(Tensor::full(1.0f32, c), 0).unwrap_err();
            what("broadcast", &e);
            let e = comm.all_gather(Tensor::full(1.0f32, c)).unwrap_err();
            what("all_gather", &e);
            let e = comm
                .reduce_scatter(Tensor::full(1.0f32, n * c), ReduceOp::Sum)
                .unwrap_err();
            what("reduce_scatter", &e);
            let e = comm.gather(Tensor::full(1.0f32, c), 0).unwrap_err();
            what("gather", &e);
            let inputs = (r == 0).then(|| vec![Tensor::full(1.0f32, c); n]);
            let e = comm
                .scatter(Tensor::zeros(DType::F32, c), inputs, 0)
                .unwrap_err();
            what("scatter", &e);
            // A dtype that differs along with the size.
            let t = if r == 2 {
                Tensor::zeros(DType::F64, b)
            } else {
                Tensor::zeros(DType::F32, a)
            };
            let e = comm.all_reduce(t, ReduceOp::Sum).unwrap_err();
            what("all_reduce dtype", &e);
            match r {
                0 => what("send", &comm.send(Tensor::full(1i32, a), 1).unwrap_err()),
                1 => what(
                    "recv",
                    &comm.recv(Tensor::zeros(DType::I32, b), 0).unwrap_err(),
                ),
                _ => {}
            }
            // Usable, and correct, for small and large ops alike.
            for c in [S, L] {
                let t = comm
                    .all_reduce(Tensor::full(1.0f32, c), ReduceOp::Sum)
                    .unwrap();
                assert_eq!(t.to_vec::<f32>(), vec![n as f32; c]);
                let t = comm.broadcast(Tensor::full(r as i32, c), 1).unwrap();
                assert_eq!(t.to_vec::<i32>(), vec![1; c]);
            }
        }
        assert!(comm.is_active());
    });
}

#[test]
fn p2p_length_mismatch_errors_both_ends_and_comm_stays_usable() {
    run_ranks_with(2, "mm-p2p", strict, |comm| {
        let e = if comm.rank() == 0 {
            comm.send(Tensor::full(1i32, 10), 1).unwrap_err()
        } else {
            comm.recv(Tensor::zeros(DType::I32, 9), 0).unwrap_err()
        };
        assert!(is_mismatch(&e), "{e}");
        let out = comm
            .batch_p2p(vec![
                P2POp::send(Tensor::full(comm.rank() as i32, 3), 1 - comm.rank()),
                P2POp::recv(Tensor::zeros(DType::I32, 3), 1 - comm.rank()),
            ])
            .unwrap();
        assert_eq!(out[1].to_vec::<i32>(), vec![1 - comm.rank() as i32; 3]);
    });
}

/// Point-to-point mismatches with fingerprint checks: each message carries
/// its own fingerprint, so a receive of another length or dtype than the
/// send fails both ranks with `Mismatch`. (The collective kinds run in the
/// shared suite, `tests/collectives.rs`, on every backend.)
#[test]
fn fingerprint_p2p_mismatches_fail_both_ranks_with_mismatch() {
    let backend = common::test_backend();
    let p2p: Vec<(&str, MismatchedOp)> = vec![
        (
            "fp-p2p-len",
            Box::new(|c: &Comm| {
                if c.rank() == 0 {
                    c.send(Tensor::full(1i32, 10), 1).map(drop)
                } else {
                    c.recv(Tensor::zeros(DType::I32, 9), 0).map(drop)
                }
            }),
        ),
        (
            "fp-p2p-dtype",
            Box::new(|c: &Comm| {
                if c.rank() == 0 {
                    c.send(Tensor::full(1i32, 4), 1).map(drop)
                } else {
                    c.recv(Tensor::zeros(DType::F32, 4), 0).map(drop)
                }
            }),
        ),
    ];
    for (name, op) in p2p {
        mismatch_reaches_every_rank(&backend, 2, name, op);
    }
}

/// An all_to_all_single whose rank `r` sends `send(r, j)` bytes to rank
/// `j` and expects `recv(r, j)` from it.
fn a2a(send: fn(usize, usize) -> usize, recv: fn(usize, usize) -> usize) -> MismatchedOp {
    Box::new(move |c: &Comm| {
        let (r, n) = (c.rank(), c.size());
        let s: Vec<usize> = (0..n).map(|j| send(r, j)).collect();
        let v: Vec<usize> = (0..n).map(|j| recv(r, j)).collect();
        c.all_to_all_v_single(Tensor::zeros(DType::U8, s.iter().sum()), &s, &v)
            .map(drop)
    })
}

/// all_to_all_single's split sizes agree only pair by pair. With
/// fingerprint checks on the cpu backend every ordered pair exchanges one
/// message, an empty one for an empty block, and the receiver checks its
/// length: a pair that disagrees (small or large block, empty on either
/// side, or a rank's own block) fails every rank with a fatal `Mismatch`
/// and the communicator is aborted. Where the backend keeps the exchange
/// for it, the mismatch is found before data moves and is not fatal.
#[test]
fn fingerprint_all_to_all_single_size_mismatches_reach_every_rank() {
    let backend = common::test_backend();
    let cases: Vec<(usize, &str, MismatchedOp)> = vec![
        (
            2,
            "fp-a2a-len",
            a2a(|r, j| if (r, j) == (0, 1) { 2 } else { 1 }, |_, _| 1),
        ),
        (
            4,
            "fp-a2a-empty-recv",
            a2a(
                |r, j| if (r, j) == (0, 2) { 3 } else { 1 + r + j },
                |r, j| if (r, j) == (2, 0) { 0 } else { 1 + r + j },
            ),
        ),
        (
            4,
            "fp-a2a-empty-send",
            a2a(
                |r, j| if (r, j) == (1, 3) { 0 } else { 1 + r + j },
                |r, j| if (r, j) == (3, 1) { 2 } else { 1 + r + j },
            ),
        ),
        (
            3,
            "fp-a2a-large",
            a2a(
                |r, j| if (r, j) == (0, 1) { 20_000 } else { 1 },
                |r, j| if (r, j) == (1, 0) { 20_001 } else { 1 },
            ),
        ),
        (
            2,
            "fp-a2a-self",
            a2a(|_, _| 2, |r, j| if (r, j) == (1, 1) { 3 } else { 2 }),
        ),
        (
            // all_to_all_into: rank 1's output for rank 0 holds one
            // element fewer than rank 0 sends it.
            3,
            "fp-a2a-into-len",
            Box::new(|c: &Comm| {
                let (r, n) = (c.rank(), c.size());
                let inputs = (0..n).map(|_| Tensor::zeros(DType::U8, 3)).collect();
                let outputs = (0..n)
                    .map(|j| Tensor::zeros(DType::U8, if (r, j) == (1, 0) { 2 } else { 3 }))
                    .collect();
                c.all_to_all_into(inputs, outputs).map(drop)
            }),
        ),
        (
            // The list form learns its sizes from the messages; its dtype
            // is in the fingerprint.
            3,
            "fp-a2a-list-dtype",
            Box::new(|c: &Comm| {
                let dtype = if c.rank() == 2 {
                    DType::I32
                } else {
                    DType::F32
                };
                c.all_to_all(vec![Tensor::zeros(dtype, 2); c.size()])
                    .map(drop)
            }),
        ),
    ];
    for (n, name, op) in cases {
        mismatch_reaches_every_rank(&backend, n, name, op);
    }
}

#[test]
fn ranks_out_of_step_error_every_rank_without_hanging() {
    run_ranks(3, "desync", |comm| {
        let r = comm.rank();
        let e = if r == 0 {
            comm.all_reduce(Tensor::full(1.0f32, 4), ReduceOp::Sum)
                .unwrap_err()
        } else {
            comm.broadcast(Tensor::full(1.0f32, 4), 0).unwrap_err()
        };
        assert!(
            matches!(
                e,
                Error::Mismatch { .. } | Error::Aborted { .. } | Error::PeerFailed { .. }
            ),
            "rank {r}: {e}"
        );
        // The links cannot be trusted after a desync: the comm is aborted.
        let e = comm.barrier().unwrap_err();
        assert!(matches!(e, Error::Aborted { .. }), "rank {r}: {e}");
    });
}

#[test]
fn missing_peer_op_times_out_with_typed_error_and_aborts_the_comm() {
    // Rank 1 issues its next op only after rank 0 timed out (a thread barrier).
    let timed_out = Arc::new(std::sync::Barrier::new(2));
    let results = run_ranks(2, "timeout", move |comm| {
        if comm.rank() == 0 {
            let start = Instant::now();
            let e = comm
                .with_timeout(Duration::from_millis(300))
                .all_reduce(Tensor::full(1.0f32, 4), ReduceOp::Sum)
                .unwrap_err();
            timed_out.wait();
            assert!(matches!(e, Error::Timeout { seq: 0, .. }), "{e}");
            assert!(start.elapsed() < Duration::from_secs(10));
            let e = comm.barrier().unwrap_err();
            assert!(matches!(e, Error::Aborted { .. }), "{e}");
        } else {
            // Never issues the all_reduce; its next op meets rank 0's stale
            // header (ranks out of step) or rank 0's abort notice.
            timed_out.wait();
            let e = comm.barrier().unwrap_err();
            assert!(e.is_fatal(), "{e}");
            let e = comm.barrier().unwrap_err();
            assert!(matches!(e, Error::Aborted { .. }), "{e}");
        }
        comm.rank()
    });
    assert_eq!(results, vec![0, 1]);
}

#[test]
fn aborting_one_rank_fails_its_peers_promptly_with_a_typed_error() {
    run_ranks(3, "abort-peer", |comm| {
        let start = Instant::now();
        if comm.rank() == 2 {
            // Join one op so every link is up, then abort instead of the next.
            comm.barrier().unwrap();
            comm.abort();
            assert!(!comm.is_active());
            let e = comm
                .all_reduce(Tensor::full(1.0f32, 4), ReduceOp::Sum)
                .unwrap_err();
            assert!(matches!(e, Error::Aborted { .. }), "{e}");
        } else {
            comm.barrier().unwrap();
            let e = comm
                .all_reduce(Tensor::full(1.0f32, 1 << 16), ReduceOp::Sum)
                .unwrap_err();
            assert!(
                matches!(e, Error::PeerFailed { .. } | Error::Aborted { .. }),
                "{e}"
            );
            // Well inside the 30 s op timeout: the abort notice travels on the links.
            assert!(
                start.elapsed() < Duration::from_secs(10),
                "{:?}",
                start.elapsed()
            );
        }
    });
}

#[test]
fn abort_completes_outstanding_work_with_aborted_and_keeps_the_process_alive() {
    // Rank 1 issues nothing until rank 0 has aborted (a thread barrier, not a
    // sleep), so rank 0's ops are truly outstanding when it aborts.
    let aborted = Arc::new(std::sync::Barrier::new(2));
    run_ranks(2, "abort-outstanding", move |comm| {
        if comm.rank() == 0 {
            let w = comm.all_reduce_async(Tensor::full(1.0f32, 4), ReduceOp::Sum);
            let w2 = comm.barrier_async();
            comm.abort_with_reason("test abort");
            aborted.wait();
            let e = w.wait().unwrap_err();
            assert!(matches!(e, Error::Aborted { .. }), "{e}");
            assert!(matches!(w2.wait().unwrap_err(), Error::Aborted { .. }));
        } else {
            aborted.wait();
            // The peer's abort reaches us as an error on our next op.
            let e = comm.barrier().unwrap_err();
            assert!(e.is_fatal(), "{e}");
        }
    });
}

#[test]
fn ops_after_finalize_fail_with_finalized() {
    let comm = new_comm("cpu", Device::Cpu, "fin", CommOptions::single()).unwrap();
    let clone = comm.clone();
    comm.finalize().unwrap();
    let e = clone
        .all_reduce(Tensor::full(1.0f32, 1), ReduceOp::Sum)
        .unwrap_err();
    assert!(matches!(e, Error::Finalized { .. }), "{e}");
    comm.finalize().unwrap();
}

#[test]
fn wrong_secret_is_refused_with_a_clear_error() {
    use chorus::transport::TransportError;
    // Rank 0 hosts the QUIC store with the job secret; rank 1 has another.
    let port = {
        let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        s.local_addr().unwrap().port()
    };
    let addr: std::net::SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let spawn = |rank: usize, secret: &'static str| {
        std::thread::spawn(move || {
            let o = CommOptions::default()
                .with_rank(rank, 2)
                .with_rendezvous(Rendezvous::Master(addr))
                .with_secret(secret)
                .with_connect_timeout(Duration::from_secs(3));
            new_comm("cpu", Device::Cpu, "secret", o).map(|c| c.rank())
        })
    };
    let start = Instant::now();
    let r0 = spawn(0, "right");
    let r1 = spawn(1, "wrong");
    let e1 = r1.join().unwrap().unwrap_err();
    assert!(
        matches!(e1, Error::Transport(TransportError::AuthFailed { .. })),
        "rank 1: {e1}"
    );
    assert!(e1.to_string().contains("secret"), "{e1}");
    // Rank 0 is not left hanging: its peer never arrives, bounded by connect_timeout.
    let e0 = r0.join().unwrap().unwrap_err();
    assert!(e0.is_fatal(), "rank 0: {e0}");
    assert!(start.elapsed() < Duration::from_secs(20));
}

#[test]
fn distinct_communicators_share_one_store_without_interfering() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let handles: Vec<_> = (0..2)
        .map(|rank| {
            let store = store.clone();
            std::thread::spawn(move || {
                let a = new_comm("cpu", Device::Cpu, "a", opts(&store, rank, 2)).unwrap();
                let b = new_comm("cpu", Device::Cpu, "b", opts(&store, rank, 2)).unwrap();
                let x = a.all_reduce(Tensor::full(1i64, 2), ReduceOp::Sum).unwrap();
                let y = b.all_reduce(Tensor::full(10i64, 2), ReduceOp::Sum).unwrap();
                // A second communicator with a reused name gets fresh keys.
                a.finalize().unwrap();
                let a2 = new_comm("cpu", Device::Cpu, "a", opts(&store, rank, 2)).unwrap();
                let z = a2
                    .all_reduce(Tensor::full(100i64, 2), ReduceOp::Sum)
                    .unwrap();
                (x.to_vec::<i64>(), y.to_vec::<i64>(), z.to_vec::<i64>())
            })
        })
        .collect();
    for h in handles {
        let (x, y, z) = h.join().unwrap();
        assert_eq!((x, y, z), (vec![2, 2], vec![20, 20], vec![200, 200]));
    }
}

/// A `new_comm` that fails on one rank alone (here an unknown backend)
/// still takes its instance number there, so the ranks' next
/// communicator of that name meets under the same store keys instead of
/// each waiting for the other under its own.
#[test]
fn a_new_comm_failing_on_one_rank_keeps_the_next_one_in_step() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let (tx, rx) = std::sync::mpsc::channel();
    for rank in 0..2 {
        let (store, tx) = (store.clone(), tx.clone());
        std::thread::spawn(move || {
            let quick = opts(&store, rank, 2).with_connect_timeout(Duration::from_millis(500));
            let backend = if rank == 1 { "no-such-backend" } else { "cpu" };
            let first = new_comm(backend, Device::Cpu, "in-step", quick).map(drop);
            let second =
                new_comm("cpu", Device::Cpu, "in-step", opts(&store, rank, 2)).and_then(|c| {
                    let out = c.all_reduce(Tensor::full(1.0f32, 2), ReduceOp::Sum)?;
                    c.finalize()?;
                    Ok(out.to_vec::<f32>())
                });
            let _ = tx.send((rank, first, second));
        });
    }
    drop(tx);
    for _ in 0..2 {
        let (rank, first, second) = rx
            .recv_timeout(Duration::from_secs(30))
            .expect("a rank hung");
        assert!(first.is_err(), "rank {rank}: the first new_comm succeeded");
        assert_eq!(
            second.expect("second new_comm"),
            vec![2.0; 2],
            "rank {rank}"
        );
    }
}
