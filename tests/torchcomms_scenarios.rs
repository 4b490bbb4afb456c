//! TorchComms' integration scenarios, ported to the `Comm` level with
//! their sizes: AllToAllvSingle's size patterns (uniform, variable, zero,
//! all-zero, asymmetric; counts 4, 1 Ki, 1 Mi; f32, i32, i8), in the flat
//! form and the row form of 2-D data; SendRecv repeated 4 and 8 times with
//! per-iteration values; BatchSendRecv; MultiComm (three communicators
//! with interleaved async ops); Abort with outstanding work; and
//! FinalizeWarning (a communicator dropped without `finalize`, with work
//! outstanding, neither hangs nor aborts).
//!
//! Chorus allocates each op's output itself, so TorchComms' sentinel
//! pre-fill of the output becomes: the output has exactly the expected
//! length and every element is the value its sender wrote (no element is
//! left as allocated), and in the row form the input rows beyond the split
//! sizes are filled with a sentinel that must never arrive anywhere.

mod common;

use std::time::{Duration, Instant};

use chorus::{Comm, DType, Error, P2POp, ReduceOp, Tensor};
use common::{run_ranks, run_ranks_with};

const COUNTS: [usize; 3] = [4, 1024, 1024 * 1024];
const DTYPES: [DType; 3] = [DType::F32, DType::I32, DType::I8];
const SENTINEL: f64 = -7.0;

#[derive(Debug, Clone, Copy)]
enum Pattern {
    Uniform,
    Variable,
    ZeroSizes,
    AllZero,
    Asymmetric,
}

const PATTERNS: [Pattern; 5] = [
    Pattern::Uniform,
    Pattern::Variable,
    Pattern::ZeroSizes,
    Pattern::AllZero,
    Pattern::Asymmetric,
];

/// Units (elements or rows) rank `i` sends rank `j` under `p`.
fn units(p: Pattern, count: usize, i: usize, j: usize) -> usize {
    match p {
        Pattern::Uniform => count,
        // 1x or 2x the count, varying by pair.
        Pattern::Variable => count * (1 + (i + 2 * j) % 2),
        // Every other pair sends nothing.
        Pattern::ZeroSizes => {
            if (i + j) % 2 == 0 {
                0
            } else {
                count
            }
        }
        Pattern::AllZero => 0,
        // i -> j differs from j -> i: the sender's rank sets the size.
        Pattern::Asymmetric => count * (i + 1) / 2,
    }
}

/// The value rank `i` writes at unit `k` of its block for rank `j` (exact
/// in every dtype tested, never the sentinel).
fn value(i: usize, j: usize, k: usize) -> f64 {
    ((i * 7 + j * 3 + k) % 50) as f64
}

/// One rank's input: the blocks for each rank in order, each unit
/// `width` elements wide, then `extra` sentinel units.
fn input_of(
    dtype: DType,
    p: Pattern,
    count: usize,
    me: usize,
    n: usize,
    width: usize,
    extra: usize,
) -> Tensor {
    let mut v = Vec::new();
    for j in 0..n {
        for k in 0..units(p, count, me, j) {
            v.extend(std::iter::repeat_n(value(me, j, k), width));
        }
    }
    v.extend(std::iter::repeat_n(SENTINEL, extra * width));
    Tensor::from_f64s(dtype, &v)
}

fn expected_output(p: Pattern, count: usize, me: usize, n: usize, width: usize) -> Vec<f64> {
    let mut v = Vec::new();
    for i in 0..n {
        for k in 0..units(p, count, i, me) {
            v.extend(std::iter::repeat_n(value(i, me, k), width));
        }
    }
    v
}

fn check(got: &Tensor, want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: output length");
    let got = got.to_f64_vec();
    if let Some(k) = (0..want.len()).find(|&k| got[k] != want[k]) {
        panic!(
            "{what}: element {k} is {} (sentinel {SENTINEL}), expected {}",
            got[k], want[k]
        );
    }
}

fn all_to_all_v_single_patterns(comm: &Comm, rows: bool) {
    let (me, n) = (comm.rank(), comm.size());
    // Rows of 3 elements; the row form also carries 2 unsent sentinel rows.
    let (width, extra) = if rows { (3, 2) } else { (1, 0) };
    for p in PATTERNS {
        for count in COUNTS {
            // The 1 Mi sweep of the row form (3 elements a row) would
            // triple the traffic without covering more: 1 Ki already
            // spans many rows per pair.
            if rows && count > 1024 {
                continue;
            }
            for dtype in DTYPES {
                let what = format!("{p:?} count={count} {dtype} rank {me} rows={rows}");
                let send: Vec<usize> = (0..n).map(|j| units(p, count, me, j)).collect();
                let recv: Vec<usize> = (0..n).map(|i| units(p, count, i, me)).collect();
                let input = input_of(dtype, p, count, me, n, width, extra);
                let out = if rows {
                    comm.all_to_all_v_single_rows(input, width, &send, &recv)
                } else {
                    comm.all_to_all_v_single(input, &send, &recv)
                }
                .unwrap_or_else(|e| panic!("{what}: {e}"));
                check(&out, &expected_output(p, count, me, n, width), &what);
            }
        }
    }
}

#[test]
fn all_to_all_v_single_size_patterns_match_the_reference_world_4() {
    run_ranks(4, "tc-a2av", |comm| {
        all_to_all_v_single_patterns(&comm, false);
        comm.finalize().expect("finalize");
    });
}

#[test]
fn all_to_all_v_single_row_splits_of_2d_data_match_the_reference_world_4() {
    run_ranks(4, "tc-a2av-rows", |comm| {
        all_to_all_v_single_patterns(&comm, true);
        comm.finalize().expect("finalize");
    });
}

#[test]
fn all_to_all_v_single_row_splits_reject_bad_shapes_with_invalid_argument() {
    run_ranks(2, "tc-a2av-rows-bad", |comm| {
        let t = || Tensor::zeros(DType::F32, 12);
        let cases = [
            // 12 elements are not rows of 5.
            comm.all_to_all_v_single_rows(t(), 5, &[1, 1], &[1, 1]),
            // Row width 0 for a non-empty input.
            comm.all_to_all_v_single_rows(t(), 0, &[0, 0], &[0, 0]),
            // 5 rows of 3 asked from 4.
            comm.all_to_all_v_single_rows(t(), 3, &[2, 3], &[2, 3]),
            // Wrong number of splits.
            comm.all_to_all_v_single_rows(t(), 3, &[1, 1, 1], &[1, 1]),
            comm.all_to_all_v_single_rows(t(), 3, &[1, 1], &[1]),
            // Overflow.
            comm.all_to_all_v_single_rows(t(), 3, &[usize::MAX, 1], &[1, 1]),
        ];
        for (k, r) in cases.into_iter().enumerate() {
            assert!(
                matches!(r, Err(Error::InvalidArgument { .. })),
                "case {k}: {r:?}"
            );
        }
        // An empty input with width 0 is fine.
        let out = comm
            .all_to_all_v_single_rows(Tensor::zeros(DType::F32, 0), 0, &[0, 0], &[0, 0])
            .expect("empty");
        assert!(out.is_empty());
        // A rank sending rows its peer does not expect: Mismatch on both,
        // on the op itself or, on rank 0, whose own receives are what it
        // expects, possibly on its next op (the sizes are checked by the
        // receiver of each pair's message; the mismatch is fatal).
        let recv = if comm.rank() == 0 { [1, 1] } else { [2, 1] };
        let e = comm
            .all_to_all_v_single_rows(t(), 3, &[1, 1], &recv)
            .err()
            .or_else(|| comm.barrier().err());
        assert!(
            matches!(e, Some(Error::Mismatch { .. })),
            "rank {}: expected a Mismatch, got {e:?}",
            comm.rank()
        );
    });
}

/// SendRecvTest: a ring, repeated, each iteration with its own values, so
/// a stale or reordered message is caught.
fn send_recv_iterations(comm: &Comm, iterations: usize) {
    let (me, n) = (comm.rank(), comm.size());
    let (next, prev) = ((me + 1) % n, (me + n - 1) % n);
    for count in [4usize, 1024, 1024 * 1024] {
        for it in 0..iterations {
            let val = |r: usize| ((r * 13 + it * 5) % 100) as i32;
            let mine = Tensor::full(val(me), count);
            let buf = Tensor::zeros(DType::I32, count);
            let got = if me % 2 == 0 {
                comm.send(mine, next).expect("send");
                comm.recv(buf, prev).expect("recv")
            } else {
                let got = comm.recv(buf, prev).expect("recv");
                comm.send(mine, next).expect("send");
                got
            };
            assert!(
                got.as_slice::<i32>().iter().all(|&x| x == val(prev)),
                "rank {me} iteration {it} count {count}: got {:?}.., expected {}",
                &got.as_slice::<i32>()[..4],
                val(prev)
            );
        }
    }
}

#[test]
fn send_recv_4_and_8_repeated_iterations_with_per_iteration_values_world_4() {
    run_ranks(4, "tc-sendrecv", |comm| {
        send_recv_iterations(&comm, 4);
        send_recv_iterations(&comm, 8);
        comm.finalize().expect("finalize");
    });
}

#[test]
fn batch_send_recv_to_every_peer_at_the_comm_level_world_4() {
    run_ranks(4, "tc-batch", |comm| {
        let (me, n) = (comm.rank(), comm.size());
        for count in COUNTS {
            for dtype in DTYPES {
                let val = |from: usize, to: usize| ((from * 10 + to) % 50) as f64;
                let mut ops = Vec::new();
                for peer in (0..n).filter(|&p| p != me) {
                    ops.push(P2POp::send(
                        Tensor::from_f64s(dtype, &vec![val(me, peer); count]),
                        peer,
                    ));
                    ops.push(P2POp::recv(Tensor::zeros(dtype, count), peer));
                }
                let bufs = comm.batch_p2p_async(ops).wait().expect("batch_p2p");
                assert_eq!(bufs.len(), 2 * (n - 1));
                for (k, peer) in (0..n).filter(|&p| p != me).enumerate() {
                    let got = bufs[2 * k + 1].to_f64_vec();
                    assert!(
                        got.iter().all(|&x| x == val(peer, me)),
                        "rank {me} {dtype} count {count}: from {peer} got {:?}..",
                        &got[..got.len().min(4)]
                    );
                }
            }
        }
        comm.finalize().expect("finalize");
    });
}

#[test]
fn three_communicators_with_interleaved_async_ops_world_4() {
    run_ranks(4, "tc-multi-a", |a| {
        let (me, n) = (a.rank(), a.size());
        // Two more communicators over the same ranks, formed by splits so
        // they share the parent's store (TorchComms' MultiComm makes three
        // communicators the same way, over one store).
        let b = a
            .split(&(0..n).collect::<Vec<_>>(), "tc-multi-b")
            .expect("b")
            .expect("member");
        let c = a
            .split(&(0..n).collect::<Vec<_>>(), "tc-multi-c")
            .expect("c")
            .expect("member");
        const ROUNDS: usize = 10;
        let mut ar = Vec::new();
        let mut bc = Vec::new();
        let mut ag = Vec::new();
        for r in 0..ROUNDS {
            ar.push(a.all_reduce_async(Tensor::full((me + r) as f32, 1024), ReduceOp::Sum));
            bc.push(b.broadcast_async(
                Tensor::full(if me == r % n { r as i32 } else { -1 }, 256),
                r % n,
            ));
            ag.push(c.all_gather_async(Tensor::full((me * 100 + r) as i64, 8)));
        }
        for (r, w) in ar.into_iter().enumerate() {
            let want = (0..n).map(|k| (k + r) as f32).sum::<f32>();
            assert!(w
                .wait()
                .expect("all_reduce")
                .as_slice::<f32>()
                .iter()
                .all(|&x| x == want));
        }
        for (r, w) in bc.into_iter().enumerate() {
            assert!(w
                .wait()
                .expect("broadcast")
                .as_slice::<i32>()
                .iter()
                .all(|&x| x == r as i32));
        }
        for (r, w) in ag.into_iter().enumerate() {
            let got = w.wait().expect("all_gather").to_vec::<i64>();
            let want: Vec<i64> = (0..n).flat_map(|k| [(k * 100 + r) as i64; 8]).collect();
            assert_eq!(got, want, "all_gather round {r}");
        }
        c.finalize().expect("finalize c");
        b.finalize().expect("finalize b");
        a.finalize().expect("finalize a");
    });
}

#[test]
fn abort_with_outstanding_work_completes_every_work_and_stops_every_rank() {
    run_ranks_with(
        4,
        "tc-abort",
        |_, o| o.with_timeout(Duration::from_secs(20)),
        |comm| {
            let me = comm.rank();
            comm.barrier().expect("barrier");
            let t0 = Instant::now();
            if me == 0 {
                // Work that cannot all finish: the peers stop issuing ops.
                let works: Vec<_> = (0..8)
                    .map(|_| comm.all_reduce_async(Tensor::full(1.0f32, 1 << 16), ReduceOp::Sum))
                    .collect();
                comm.abort_with_reason("abort test");
                assert!(comm.is_aborted());
                for w in works {
                    match w.wait() {
                        Ok(_) => {}
                        Err(Error::Aborted { .. }) => {}
                        Err(e) => panic!("rank 0: unexpected {e}"),
                    }
                }
                assert!(matches!(comm.barrier(), Err(Error::Aborted { .. })));
            } else {
                // The peers' next op fails once rank 0's abort reaches them.
                let r = loop {
                    if let Err(e) = comm.all_reduce(Tensor::full(1.0f32, 1 << 16), ReduceOp::Sum) {
                        break e;
                    }
                };
                assert!(r.is_fatal(), "rank {me}: {r}");
                assert!(!comm.is_active());
            }
            assert!(
                t0.elapsed() < Duration::from_secs(15),
                "rank {me} took {:?}",
                t0.elapsed()
            );
        },
    );
}

#[test]
fn finalize_warning_dropping_a_comm_without_finalize_with_work_outstanding_neither_hangs_nor_aborts(
) {
    run_ranks(2, "tc-finalize-warning", |comm| {
        let me = comm.rank();
        let works: Vec<_> = (0..4)
            .map(|k| comm.all_reduce_async(Tensor::full((me + k) as f64, 1024), ReduceOp::Sum))
            .collect();
        let status_probe = comm.clone();
        // Drop every handle without finalize: the communicator finalizes
        // itself once its queued work ran (TorchComms logs a warning and
        // does not abort).
        drop(comm);
        drop(status_probe);
        for (k, w) in works.into_iter().enumerate() {
            let want = (0..2).map(|r| (r + k) as f64).sum::<f64>();
            let t = w.wait().expect("outstanding work still completes");
            assert!(t.as_slice::<f64>().iter().all(|&x| x == want), "work {k}");
        }
    });
    // Everything the dropped communicators owned goes away.
    let deadline = Instant::now() + Duration::from_secs(20);
    while chorus::debug::live_actors() != 0 || chorus::debug::live_backends() != 0 {
        assert!(
            Instant::now() < deadline,
            "a dropped communicator left its actor or backend"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}
