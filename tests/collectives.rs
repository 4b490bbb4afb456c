//! Every collective, on in-process ranks over the real cpu backend (TCP on
//! loopback), checked against a reference computed locally.

mod common;

use chorus::{DType, P2POp, ReduceOp, Tensor, Work};
use common::{assert_close, input, run_ranks, value};

const INT_DTYPES: [DType; 6] = [
    DType::I8,
    DType::U8,
    DType::I32,
    DType::I64,
    DType::U32,
    DType::U64,
];
const FLOAT_DTYPES: [DType; 4] = [DType::F16, DType::BF16, DType::F32, DType::F64];

/// Wrap an exact integer result to `dtype`'s width, as the kernels do.
fn wrap(dtype: DType, x: i128) -> f64 {
    match dtype {
        DType::I8 => x as i8 as f64,
        DType::U8 => x as u8 as f64,
        DType::I32 => x as i32 as f64,
        DType::U32 => x as u32 as f64,
        DType::I64 => x as i64 as f64,
        DType::U64 => x as u64 as f64,
        _ => x as f64,
    }
}

/// Reference reduction of element `i` over `n` ranks.
fn reference(dtype: DType, op: ReduceOp, n: usize, i: usize) -> f64 {
    let vals: Vec<f64> = (0..n).map(|r| value(r, i)).collect();
    if dtype.is_float() {
        match op {
            ReduceOp::Sum => vals.iter().sum(),
            ReduceOp::Product => vals.iter().product(),
            ReduceOp::Min => vals.iter().cloned().fold(f64::INFINITY, f64::min),
            ReduceOp::Max => vals.iter().cloned().fold(f64::NEG_INFINITY, f64::max),
            ReduceOp::Avg => vals.iter().sum::<f64>() / n as f64,
            ReduceOp::PremulSum(s) => vals.iter().map(|v| v * s).sum(),
            _ => unreachable!(),
        }
    } else {
        let iv: Vec<i128> = vals.iter().map(|&v| v as i128).collect();
        let x = match op {
            ReduceOp::Sum => iv.iter().sum(),
            ReduceOp::Product => iv.iter().product(),
            ReduceOp::Min => *iv.iter().min().unwrap(),
            ReduceOp::Max => *iv.iter().max().unwrap(),
            ReduceOp::Avg => iv.iter().sum::<i128>() / n as i128,
            ReduceOp::PremulSum(s) => iv.iter().map(|v| v * s as i128).sum(),
            ReduceOp::BAnd => iv.iter().fold(-1, |a, b| a & b),
            ReduceOp::BOr => iv.iter().fold(0, |a, b| a | b),
            ReduceOp::BXor => iv.iter().fold(0, |a, b| a ^ b),
        };
        wrap(dtype, x)
    }
}

fn ops_for(dtype: DType) -> Vec<ReduceOp> {
    let mut ops = vec![
        ReduceOp::Sum,
        ReduceOp::Product,
        ReduceOp::Min,
        ReduceOp::Max,
        ReduceOp::Avg,
        ReduceOp::PremulSum(2.0),
    ];
    if !dtype.is_float() {
        ops.extend([ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor]);
    }
    ops
}

fn all_reduce_every_dtype_and_op(n: usize) {
    run_ranks(n, &format!("ar-all-{n}"), move |comm| {
        let r = comm.rank();
        for dtype in FLOAT_DTYPES.into_iter().chain(INT_DTYPES) {
            for op in ops_for(dtype) {
                for count in [0usize, 1, 5, 1023] {
                    let out = comm
                        .all_reduce(input(dtype, r, count), op)
                        .unwrap_or_else(|e| panic!("{dtype} {op} {count}: {e}"));
                    let want: Vec<f64> = (0..count).map(|i| reference(dtype, op, n, i)).collect();
                    assert_close(
                        dtype,
                        &out,
                        &want,
                        &format!("all_reduce {dtype} {op} n={count}"),
                    );
                }
            }
        }
        comm.finalize().unwrap();
    });
}

#[test]
fn all_reduce_matches_reference_every_dtype_and_op_world_1() {
    all_reduce_every_dtype_and_op(1);
}
#[test]
fn all_reduce_matches_reference_every_dtype_and_op_world_2() {
    all_reduce_every_dtype_and_op(2);
}
#[test]
fn all_reduce_matches_reference_every_dtype_and_op_world_3() {
    all_reduce_every_dtype_and_op(3);
}
#[test]
fn all_reduce_matches_reference_every_dtype_and_op_world_4() {
    all_reduce_every_dtype_and_op(4);
}

/// The reference implementation's grid: counts {0, 4, 1Ki, 1Mi} x dtypes
/// {f32, i32, i8, f16, bf16, f64} x ops {Sum, Max, Avg, PremulSum}, sync and
/// async, 4 ranks.
#[test]
fn all_reduce_reference_grid_world_4_sync_and_async() {
    let n = 4;
    run_ranks(n, "grid", move |comm| {
        let r = comm.rank();
        let dtypes = [
            DType::F32,
            DType::I32,
            DType::I8,
            DType::F16,
            DType::BF16,
            DType::F64,
        ];
        let ops = [
            ReduceOp::Sum,
            ReduceOp::Max,
            ReduceOp::Avg,
            ReduceOp::PremulSum(2.0),
        ];
        for count in [0usize, 4, 1 << 10, 1 << 20] {
            for dtype in dtypes {
                // Async: issue every op first (input moved in, dropped by us), then wait.
                let works: Vec<(ReduceOp, Work<Tensor>)> = ops
                    .iter()
                    .map(|&op| (op, comm.all_reduce_async(input(dtype, r, count), op)))
                    .collect();
                for (op, w) in works {
                    let out = w.wait().unwrap();
                    let want: Vec<f64> = (0..count).map(|i| reference(dtype, op, n, i)).collect();
                    assert_close(dtype, &out, &want, &format!("async {dtype} {op} {count}"));
                }
                for op in ops {
                    let out = comm.all_reduce(input(dtype, r, count), op).unwrap();
                    let want: Vec<f64> = (0..count).map(|i| reference(dtype, op, n, i)).collect();
                    assert_close(dtype, &out, &want, &format!("sync {dtype} {op} {count}"));
                }
            }
        }
    });
}

fn rooted_and_gathering_ops(n: usize) {
    run_ranks(n, &format!("coll-{n}"), move |comm| {
        let r = comm.rank();
        for dtype in [DType::F32, DType::I32, DType::BF16, DType::U8] {
            for count in [0usize, 3, 257] {
                let what = |op: &str| format!("{op} {dtype} count={count} world={n}");
                // reduce: root gets the sum, others their input back.
                for root in 0..n {
                    let out = comm
                        .reduce(input(dtype, r, count), ReduceOp::Sum, root)
                        .unwrap();
                    let want: Vec<f64> = if r == root {
                        (0..count)
                            .map(|i| reference(dtype, ReduceOp::Sum, n, i))
                            .collect()
                    } else {
                        (0..count).map(|i| value(r, i)).collect()
                    };
                    assert_close(dtype, &out, &want, &what("reduce"));
                }
                // broadcast from every root.
                for root in 0..n {
                    let t = if r == root {
                        input(dtype, root, count)
                    } else {
                        Tensor::zeros(dtype, count)
                    };
                    let out = comm.broadcast(t, root).unwrap();
                    let want: Vec<f64> = (0..count).map(|i| value(root, i)).collect();
                    assert_close(dtype, &out, &want, &what("broadcast"));
                }
                // all_gather: rank blocks in order.
                let out = comm.all_gather(input(dtype, r, count)).unwrap();
                let want: Vec<f64> = (0..n)
                    .flat_map(|p| (0..count).map(move |i| value(p, i)))
                    .collect();
                assert_close(dtype, &out, &want, &what("all_gather"));
                // all_gather_v: rank p contributes count + p elements.
                let counts: Vec<usize> = (0..n).map(|p| count + p).collect();
                let out = comm
                    .all_gather_v(input(dtype, r, count + r), &counts)
                    .unwrap();
                let want: Vec<f64> = (0..n)
                    .flat_map(|p| (0..count + p).map(move |i| value(p, i)))
                    .collect();
                assert_close(dtype, &out, &want, &what("all_gather_v"));
                // reduce_scatter: input n*count, block r reduced.
                let full: Vec<f64> = (0..n * count).map(|i| value(r, i)).collect();
                let out = comm
                    .reduce_scatter(Tensor::from_f64s(dtype, &full), ReduceOp::Sum)
                    .unwrap();
                let want: Vec<f64> = (r * count..(r + 1) * count)
                    .map(|i| (0..n).map(|p| value(p, i)).sum())
                    .collect();
                assert_close(dtype, &out, &want, &what("reduce_scatter"));
                // reduce_scatter_v: block p has count + 2p elements.
                let counts: Vec<usize> = (0..n).map(|p| count + 2 * p).collect();
                let total: usize = counts.iter().sum();
                let full: Vec<f64> = (0..total).map(|i| value(r, i)).collect();
                let out = comm
                    .reduce_scatter_v(Tensor::from_f64s(dtype, &full), &counts, ReduceOp::Max)
                    .unwrap();
                let off: usize = counts[..r].iter().sum();
                let want: Vec<f64> = (off..off + counts[r])
                    .map(|i| (0..n).map(|p| value(p, i)).fold(f64::MIN, f64::max))
                    .collect();
                assert_close(dtype, &out, &want, &what("reduce_scatter_v"));
                // scatter and gather from every root.
                for root in 0..n {
                    let inputs =
                        (r == root).then(|| (0..n).map(|p| input(dtype, p + 10, count)).collect());
                    let out = comm
                        .scatter(Tensor::zeros(dtype, count), inputs, root)
                        .unwrap();
                    let want: Vec<f64> = (0..count).map(|i| value(r + 10, i)).collect();
                    assert_close(dtype, &out, &want, &what("scatter"));

                    let got = comm.gather(input(dtype, r, count), root).unwrap();
                    if r == root {
                        assert_eq!(got.len(), n, "{}", what("gather"));
                        for (p, t) in got.iter().enumerate() {
                            let want: Vec<f64> = (0..count).map(|i| value(p, i)).collect();
                            assert_close(dtype, t, &want, &what("gather"));
                        }
                    } else {
                        assert!(got.is_empty());
                    }
                    // gather_single: the same data, contiguous on the root.
                    let got = comm
                        .gather_single(input(dtype, r + 20, count), root)
                        .unwrap();
                    if r == root {
                        let want: Vec<f64> = (0..n)
                            .flat_map(|p| (0..count).map(move |i| value(p + 20, i)))
                            .collect();
                        assert_close(dtype, &got, &want, &what("gather_single"));
                    } else {
                        assert_eq!(got.len(), 0, "{}", what("gather_single"));
                        assert_eq!(got.dtype(), dtype);
                    }
                }
                // all_to_all_single: block j of rank i holds value(i, j*count + k).
                let full: Vec<f64> = (0..n * count).map(|i| value(r, i)).collect();
                let out = comm
                    .all_to_all_single(Tensor::from_f64s(dtype, &full))
                    .unwrap();
                let want: Vec<f64> = (0..n)
                    .flat_map(|j| (0..count).map(move |k| value(j, r * count + k)))
                    .collect();
                assert_close(dtype, &out, &want, &what("all_to_all_single"));
                // all_to_all_v_single: rank i sends i + j + count elements to j.
                let send: Vec<usize> = (0..n).map(|j| r + j + count).collect();
                let recv: Vec<usize> = (0..n).map(|j| j + r + count).collect();
                let total: usize = send.iter().sum();
                let data: Vec<f64> = (0..total).map(|i| value(r, i)).collect();
                let out = comm
                    .all_to_all_v_single(Tensor::from_f64s(dtype, &data), &send, &recv)
                    .unwrap();
                let want: Vec<f64> = (0..n)
                    .flat_map(|j| {
                        // rank j's block for us starts at sum of its sends to ranks < r.
                        let off: usize = (0..r).map(|q| j + q + count).sum();
                        (off..off + j + r + count).map(move |i| value(j, i))
                    })
                    .collect();
                assert_close(dtype, &out, &want, &what("all_to_all_v_single"));
                // all_to_all (list): rank i sends (i + 1) * (j + 1) elements to j.
                let inputs: Vec<Tensor> = (0..n)
                    .map(|j| {
                        Tensor::from_f64s(
                            dtype,
                            &vec![(r * 10 + j) as f64 % 100.0; (r + 1) * (j + 1) % 7],
                        )
                    })
                    .collect();
                let outs = comm.all_to_all(inputs.clone()).unwrap();
                assert_eq!(outs.len(), n);
                for (j, t) in outs.iter().enumerate() {
                    let want = vec![(j * 10 + r) as f64 % 100.0; (j + 1) * (r + 1) % 7];
                    assert_close(dtype, t, &want, &what("all_to_all"));
                }
                // all_to_all_into: the same exchange into given outputs.
                let outputs: Vec<Tensor> = (0..n)
                    .map(|j| Tensor::zeros(dtype, (j + 1) * (r + 1) % 7))
                    .collect();
                let (outs, _) = comm.all_to_all_into(inputs, outputs).unwrap();
                for (j, t) in outs.iter().enumerate() {
                    let want = vec![(j * 10 + r) as f64 % 100.0; (j + 1) * (r + 1) % 7];
                    assert_close(dtype, t, &want, &what("all_to_all_into"));
                }
            }
        }
        comm.barrier().unwrap();
        comm.finalize().unwrap();
    });
}

/// On a backend that is not elastic, `reconfigure` is refused with
/// `NotSupported` (and consumes nothing).
fn assert_reconfigure_refused(comm: &chorus::Comm, r: usize) {
    match comm.reconfigure(chorus::ReconfigureOptions::default()) {
        Err(chorus::Error::NotSupported {
            op: "reconfigure", ..
        }) => {}
        other => panic!(
            "rank {r}: expected NotSupported, got {:?}",
            other.map(|_| ())
        ),
    }
}

/// A split and a reconfigure do what the backend's capabilities say: they
/// work, or every rank gets `NotSupported` at once and the communicator
/// stays usable.
fn split_and_reconfigure_follow_capabilities(n: usize) {
    run_ranks(n, "caps", move |comm| {
        let (r, caps) = (comm.rank(), comm.capabilities());
        match comm.backend() {
            "mpi" => assert_eq!(
                caps,
                chorus::Capabilities {
                    split: chorus::SplitMode::Native,
                    elastic: false,
                    in_place_all_gather: false,
                    in_band_checks: false,
                    headerless_ops: false,
                    list_all_to_all: false,
                }
            ),
            "cpu" => assert_eq!(
                caps,
                chorus::Capabilities {
                    in_place_all_gather: true,
                    in_band_checks: true,
                    headerless_ops: true,
                    list_all_to_all: true,
                    ..Default::default()
                }
            ),
            "gloo" => assert_eq!(caps, chorus::Capabilities::default()),
            _ => {}
        }
        let half = comm.split_by_color(Some((r % 2) as u32), r as i64, "half");
        if caps.split == chorus::SplitMode::Unsupported {
            match half {
                Err(chorus::Error::NotSupported { op: "split", .. }) => {}
                other => panic!("rank {r}: expected NotSupported, got {other:?}"),
            }
        } else {
            let half = half.unwrap().expect("every rank has a colour");
            assert_eq!(half.size(), (n + 1 - r % 2) / 2);
            let s = half
                .all_reduce(Tensor::full(1i64, 3), ReduceOp::Sum)
                .unwrap();
            assert_eq!(s.to_vec::<i64>(), vec![half.size() as i64; 3]);
            half.finalize().unwrap();
        }
        if !caps.elastic {
            assert_reconfigure_refused(&comm, r);
        }
        // Refusals consumed nothing: the parent still works, in step.
        let s = comm
            .all_reduce(Tensor::full(1i64, 2), ReduceOp::Sum)
            .unwrap();
        assert_eq!(s.to_vec::<i64>(), vec![n as i64; 2]);
        comm.finalize().unwrap();
    });
}

#[test]
fn split_and_reconfigure_follow_capabilities_world_2() {
    split_and_reconfigure_follow_capabilities(2);
}
#[test]
fn split_and_reconfigure_follow_capabilities_world_3() {
    split_and_reconfigure_follow_capabilities(3);
}

/// Subgroups on 4 ranks: halves by colour (keys reversing the order), a
/// TorchComms-style `split(ranks)` with a non-member, and a split nested
/// in a child, each checked by an all-reduce of rank-dependent values; then
/// a reconfigure on a backend that is not elastic is refused on every rank.
#[test]
fn subgroups_reduce_in_children_world_4() {
    run_ranks(4, "subgroups4", move |comm| {
        let (r, caps) = (comm.rank(), comm.capabilities());
        if caps.split == chorus::SplitMode::Unsupported {
            eprintln!("SKIP subgroups: backend {} cannot split", comm.backend());
            comm.finalize().unwrap();
            return;
        }
        // Halves: {0, 2} and {1, 3}, child ranks in reverse parent order.
        let half = comm
            .split_by_color(Some((r % 2) as u32), -(r as i64), "half")
            .unwrap()
            .expect("every rank has a colour");
        assert_eq!(half.size(), 2);
        assert_eq!(half.rank(), 1 - r / 2, "rank {r}: keys order the child");
        let s = half
            .all_reduce(
                Tensor::from_vec(vec![r as i64 + 1, 10 * r as i64]),
                ReduceOp::Sum,
            )
            .unwrap();
        let (a, b) = (r % 2, r % 2 + 2);
        assert_eq!(
            s.to_vec::<i64>(),
            vec![(a + b + 2) as i64, 10 * (a + b) as i64],
            "rank {r}: half all_reduce"
        );
        // split(ranks): child rank i is ranks[i]; rank 0 joins none.
        let ranks = [3, 1, 2];
        let sub = comm.split(&ranks, "sub").unwrap();
        match (r, sub) {
            (0, None) => {}
            (0, Some(_)) => panic!("rank 0 is not in {ranks:?}"),
            (_, None) => panic!("rank {r} is in {ranks:?}"),
            (_, Some(sub)) => {
                assert_eq!(sub.size(), 3);
                assert_eq!(ranks[sub.rank()], r);
                let m = sub
                    .all_reduce(Tensor::full(r as f64 * 1.5, 5), ReduceOp::Max)
                    .unwrap();
                assert_eq!(m.to_vec::<f64>(), vec![4.5; 5], "rank {r}: sub max");
                let p = sub
                    .all_reduce(Tensor::full(r as i32, 2), ReduceOp::Product)
                    .unwrap();
                assert_eq!(p.to_vec::<i32>(), vec![6; 2], "rank {r}: sub product");
                // A child splits too: {3, 2} (child ranks 0 and 2).
                let pair = sub
                    .split_by_color((sub.rank() != 1).then_some(0), 0, "pair")
                    .unwrap();
                if let Some(pair) = pair {
                    let s = pair
                        .all_reduce(Tensor::full(r as i64, 1), ReduceOp::Sum)
                        .unwrap();
                    assert_eq!(s.to_vec::<i64>(), vec![5], "rank {r}: pair sum");
                    pair.finalize().unwrap();
                } else {
                    assert_eq!(r, 1);
                }
                sub.finalize().unwrap();
            }
        }
        half.finalize().unwrap();
        if !caps.elastic {
            assert_reconfigure_refused(&comm, r);
        }
        // The parent still works after its children ended.
        let s = comm
            .all_reduce(Tensor::full(r as i64, 1), ReduceOp::Sum)
            .unwrap();
        assert_eq!(s.to_vec::<i64>(), vec![6]);
        comm.finalize().unwrap();
    });
}

#[test]
fn every_collective_matches_reference_world_1() {
    rooted_and_gathering_ops(1);
}
#[test]
fn every_collective_matches_reference_world_2() {
    rooted_and_gathering_ops(2);
}
#[test]
fn every_collective_matches_reference_world_3() {
    rooted_and_gathering_ops(3);
}
#[test]
fn every_collective_matches_reference_world_4() {
    rooted_and_gathering_ops(4);
}

#[test]
fn send_recv_ring_and_batched_p2p_world_3() {
    let n = 3;
    run_ranks(n, "p2p", move |comm| {
        let r = comm.rank();
        let next = (r + 1) % n;
        let prev = (r + n - 1) % n;
        // Ring with plain send/recv: even ranks send first.
        let mine = Tensor::full(r as i64, 100);
        let got = if r % 2 == 0 {
            comm.send(mine, next).unwrap();
            comm.recv(Tensor::zeros(DType::I64, 100), prev).unwrap()
        } else {
            let got = comm.recv(Tensor::zeros(DType::I64, 100), prev).unwrap();
            comm.send(mine, next).unwrap();
            got
        };
        assert_eq!(got.to_vec::<i64>(), vec![prev as i64; 100]);
        // Batched: two sends to next and two receives from prev, completing together.
        let out = comm
            .batch_p2p(vec![
                P2POp::send(Tensor::full(r as f32, 10), next),
                P2POp::recv(Tensor::zeros(DType::F32, 10), prev),
                P2POp::send(Tensor::full(r as f32 + 0.5, 1000), next),
                P2POp::recv(Tensor::zeros(DType::F32, 1000), prev),
            ])
            .unwrap();
        assert_eq!(out[1].to_vec::<f32>(), vec![prev as f32; 10]);
        assert_eq!(out[3].to_vec::<f32>(), vec![prev as f32 + 0.5; 1000]);
        // P2P between two ranks does not disturb collectives of all three.
        let s = comm
            .all_reduce(Tensor::full(1u32, 3), ReduceOp::Sum)
            .unwrap();
        assert_eq!(s.to_vec::<u32>(), vec![3; 3]);
    });
}

#[test]
fn outstanding_works_complete_in_issue_order() {
    let n = 3;
    run_ranks(n, "overlap", move |comm| {
        let works: Vec<Work<Tensor>> = (0..16)
            .map(|k| comm.all_reduce_async(Tensor::full(k as f64, 4096), ReduceOp::Sum))
            .collect();
        let mut results = Vec::new();
        for (k, w) in works.into_iter().enumerate() {
            let t = w.wait().unwrap();
            results.push((k, t.as_slice::<f64>()[0]));
        }
        for (k, v) in results {
            assert_eq!(v, (k * n) as f64);
        }
        // Ordering: once a later op completed, every earlier one has.
        let a = comm.barrier_async();
        let b = comm.all_reduce_async(Tensor::full(1i32, 1), ReduceOp::Sum);
        let bv = b.wait().unwrap();
        assert!(a.is_completed(), "earlier op completes first");
        assert_eq!(bv.to_vec::<i32>(), vec![n as i32]);
        a.wait().unwrap();
    });
}

#[test]
fn dropping_a_work_does_not_cancel_the_op() {
    run_ranks(2, "drop-work", |comm| {
        let w = comm.all_reduce_async(Tensor::full(1.0f32, 1 << 16), ReduceOp::Sum);
        drop(w);
        // The dropped op still runs; the next one pairs with the next one.
        let t = comm
            .all_reduce(Tensor::full(2.0f32, 8), ReduceOp::Sum)
            .unwrap();
        assert_eq!(t.to_vec::<f32>(), vec![4.0; 8]);
    });
}

#[test]
fn async_ops_can_be_awaited_from_a_foreign_executor() {
    run_ranks(2, "await", |comm| {
        futures::executor::block_on(async {
            let a = comm.all_gather_async(Tensor::full(comm.rank() as u8, 2));
            let b = comm.broadcast_async(Tensor::full(comm.rank() as u8 + 7, 2), 1);
            assert_eq!(a.await.unwrap().to_vec::<u8>(), vec![0, 0, 1, 1]);
            assert_eq!(b.await.unwrap().to_vec::<u8>(), vec![8, 8]);
        })
    });
}

#[test]
fn work_dropped_mid_poll_still_completes_the_op_in_order() {
    use std::future::Future;
    use std::task::{Context, Poll};
    run_ranks(2, "drop-mid-poll", |comm| {
        let mut w = comm.all_reduce_async(Tensor::full(3i32, 1 << 15), ReduceOp::Sum);
        let waker = futures::task::noop_waker();
        let mut cx = Context::from_waker(&waker);
        // Poll once (registers a waker), then drop the future mid-flight.
        let first = std::pin::Pin::new(&mut w).poll(&mut cx);
        drop(w);
        if let Poll::Ready(r) = first {
            assert_eq!(r.unwrap().as_slice::<i32>()[0], 6);
        }
        // The abandoned op ran; the next op pairs with the next op.
        let t = comm
            .all_reduce(Tensor::full(5i32, 4), ReduceOp::Sum)
            .unwrap();
        assert_eq!(t.to_vec::<i32>(), vec![10; 4]);
    });
}

#[test]
fn into_forms_reuse_both_buffers_and_overwrite_stale_output_world_3() {
    let n = 3;
    run_ranks(n, "into", move |comm| {
        let r = comm.rank();
        let count = 257;
        // all_gather_into: output starts full of garbage and is reused.
        let mut inp = input(DType::F32, r, count);
        let mut output = Tensor::full(-7.0f32, n * count);
        for step in 0..3 {
            (output, inp) = if step % 2 == 0 {
                comm.all_gather_into(inp, output).unwrap()
            } else {
                comm.all_gather_into_async(inp, output).wait().unwrap()
            };
            let want: Vec<f64> = (0..n)
                .flat_map(|p| (0..count).map(move |i| value(p, i)))
                .collect();
            assert_close(
                DType::F32,
                &output,
                &want,
                &format!("all_gather_into step {step}"),
            );
            let mine: Vec<f64> = (0..count).map(|i| value(r, i)).collect();
            assert_close(DType::F32, &inp, &mine, "all_gather_into returns its input");
        }
        // reduce_scatter_into (the input is scratch: refill it each step).
        let mut inp = Tensor::zeros(DType::I64, n * count);
        let mut output = Tensor::full(-7i64, count);
        for (step, op) in [ReduceOp::Sum, ReduceOp::Max, ReduceOp::Avg]
            .into_iter()
            .enumerate()
        {
            let fresh = input(DType::I64, r, n * count);
            inp.as_bytes_mut().copy_from_slice(fresh.as_bytes());
            (output, inp) = if step == 1 {
                comm.reduce_scatter_into_async(inp, output, op)
                    .wait()
                    .unwrap()
            } else {
                comm.reduce_scatter_into(inp, output, op).unwrap()
            };
            assert_eq!(inp.len(), n * count);
            let want: Vec<f64> = (0..count)
                .map(|i| reference(DType::I64, op, n, r * count + i))
                .collect();
            assert_close(
                DType::I64,
                &output,
                &want,
                &format!("reduce_scatter_into {op}"),
            );
        }
        // A wrong output is refused before anything moves, on every rank.
        let e = comm
            .all_gather_into(Tensor::zeros(DType::F32, 4), Tensor::zeros(DType::F32, 4))
            .unwrap_err();
        assert!(matches!(e, chorus::Error::InvalidArgument { .. }), "{e}");
        let e = comm
            .reduce_scatter_into(
                Tensor::zeros(DType::F32, 3 * n),
                Tensor::zeros(DType::F64, 3),
                ReduceOp::Sum,
            )
            .unwrap_err();
        assert!(matches!(e, chorus::Error::InvalidArgument { .. }), "{e}");
        // The communicator is still in step.
        let s = comm
            .all_reduce(Tensor::full(1u8, 2), ReduceOp::Sum)
            .unwrap();
        assert_eq!(s.to_vec::<u8>(), vec![n as u8; 2]);
    });
}

#[test]
fn all_gather_in_place_fills_every_block_and_mixes_with_other_forms() {
    for n in [2, 3] {
        run_ranks(n, &format!("ag-in-place-{n}"), move |comm| {
            let r = comm.rank();
            let want = |count: usize| -> Vec<f64> {
                (0..n)
                    .flat_map(|p| (0..count).map(move |i| value(p, i)))
                    .collect()
            };
            // 0 elements, a fused small op, ring sizes (1 MiB of f32).
            for (step, count) in [0usize, 1, 257, 1 << 18].into_iter().enumerate() {
                let mut output = Tensor::full(-7.0f32, n * count);
                let mine = input(DType::F32, r, count);
                output.as_bytes_mut()[r * count * 4..][..count * 4]
                    .copy_from_slice(mine.as_bytes());
                let got = if step % 2 == 0 {
                    comm.all_gather_in_place(output).unwrap()
                } else {
                    comm.all_gather_in_place_async(output).wait().unwrap()
                };
                assert_close(
                    DType::F32,
                    &got,
                    &want(count),
                    &format!("all_gather_in_place {count}"),
                );
            }
            // Rank 0 in place, the others through all_gather / _into.
            let count = 33;
            let got = match r {
                0 => {
                    let mut output = Tensor::zeros(DType::F32, n * count);
                    output.as_bytes_mut()[..count * 4]
                        .copy_from_slice(input(DType::F32, 0, count).as_bytes());
                    comm.all_gather_in_place(output).unwrap()
                }
                1 => comm.all_gather(input(DType::F32, r, count)).unwrap(),
                _ => {
                    comm.all_gather_into(
                        input(DType::F32, r, count),
                        Tensor::zeros(DType::F32, n * count),
                    )
                    .unwrap()
                    .0
                }
            };
            assert_close(DType::F32, &got, &want(count), "mixed all_gather forms");
            // A length that is not n blocks is refused before anything moves.
            let e = comm
                .all_gather_in_place(Tensor::zeros(DType::F32, n * 3 + 1))
                .unwrap_err();
            assert!(matches!(e, chorus::Error::InvalidArgument { .. }), "{e}");
            // A rank passing a different block length is a typed mismatch.
            let len = if r == 0 { n * 2 } else { n * 3 };
            let e = comm
                .all_gather_in_place(Tensor::zeros(DType::F32, len))
                .unwrap_err();
            assert!(matches!(e, chorus::Error::Mismatch { .. }), "{e}");
        });
    }
}

#[test]
fn all_to_all_single_into_reuses_the_output_and_mixes_with_the_allocating_form() {
    for n in [2, 3] {
        run_ranks(n, &format!("a2a-into-{n}"), move |comm| {
            let r = comm.rank();
            // Block `j` of rank `p`'s input is `p * 1000 + j * 100 + i`.
            let block = |p: usize, j: usize, i: usize| (p * 1000 + j * 100 + i) as f32;
            let mk = |count: usize| {
                let v: Vec<f32> = (0..n)
                    .flat_map(|j| (0..count).map(move |i| block(r, j, i)))
                    .collect();
                Tensor::from_vec(v)
            };
            let want = |count: usize| -> Vec<f32> {
                (0..n)
                    .flat_map(|p| (0..count).map(move |i| block(p, r, i)))
                    .collect()
            };
            // 0 elements, a fused small op, the unfused schedule; the same
            // buffers go round again, sync and async.
            for count in [0usize, 3, 70_000] {
                let (mut input, mut output) = (mk(count), Tensor::full(-1.0f32, n * count));
                for step in 0..2 {
                    (output, input) = if step == 0 {
                        comm.all_to_all_single_into(input, output).unwrap()
                    } else {
                        comm.all_to_all_single_into_async(input, output)
                            .wait()
                            .unwrap()
                    };
                    assert_eq!(output.to_vec::<f32>(), want(count), "count {count}");
                    assert_eq!(input.to_vec::<f32>(), mk(count).to_vec::<f32>());
                }
            }
            // Rank 0 reuses a buffer, the others allocate: one op.
            let got = if r == 0 {
                comm.all_to_all_single_into(mk(5), Tensor::zeros(DType::F32, n * 5))
                    .unwrap()
                    .0
            } else {
                comm.all_to_all_single(mk(5)).unwrap()
            };
            assert_eq!(got.to_vec::<f32>(), want(5));
            // A wrong output is refused before anything moves, on its rank.
            let e = comm
                .all_to_all_single_into(mk(2), Tensor::zeros(DType::F32, n * 2 + 1))
                .unwrap_err();
            assert!(matches!(e, chorus::Error::InvalidArgument { .. }), "{e}");
            let e = comm
                .all_to_all_single_into(mk(2), Tensor::zeros(DType::I32, n * 2))
                .unwrap_err();
            assert!(matches!(e, chorus::Error::InvalidArgument { .. }), "{e}");
            comm.barrier().unwrap();
        });
    }
}

/// all_to_all_into fills the outputs it is given (external memory in
/// place), sync and async, and mixes with the allocating list form in one
/// op; a wrong number of outputs or a device tensor is refused before
/// anything moves.
#[test]
fn all_to_all_into_fills_the_given_outputs_and_mixes_with_the_list_form() {
    for n in [2, 3] {
        run_ranks(n, &format!("a2a-list-into-{n}"), move |comm| {
            let r = comm.rank();
            // Rank `p` sends rank `j` `size(p, j)` elements `p * 100 + j`.
            let size = |p: usize, j: usize| (p + 2 * j) % 4 + usize::from(p == j) * 70_000;
            let inputs = || -> Vec<Tensor> {
                (0..n)
                    .map(|j| Tensor::full((r * 100 + j) as i32, size(r, j)))
                    .collect()
            };
            let check = |outs: &[Tensor]| {
                assert_eq!(outs.len(), n);
                for (j, t) in outs.iter().enumerate() {
                    assert_eq!(t.to_vec::<i32>(), vec![(j * 100 + r) as i32; size(j, r)]);
                }
            };
            // Outputs over memory the test owns: written in place.
            let mut mem: Vec<Vec<i32>> = (0..n).map(|j| vec![-1; size(j, r).max(1)]).collect();
            let outputs: Vec<Tensor> = mem
                .iter_mut()
                .enumerate()
                .map(|(j, m)| {
                    // SAFETY: `m` outlives the op (it is read after `wait`)
                    // and nothing else touches it meanwhile.
                    unsafe {
                        Tensor::from_external(
                            DType::I32,
                            m.as_mut_ptr().cast(),
                            size(j, r),
                            Box::new(()),
                        )
                    }
                    .expect("external output")
                })
                .collect();
            let (outs, ins) = comm
                .all_to_all_into_async(inputs(), outputs)
                .wait()
                .unwrap();
            check(&outs);
            // The inputs come back unchanged, for the next op.
            assert!(ins.iter().zip(inputs()).all(|(a, b)| *a == b));
            drop(outs);
            for (j, m) in mem.iter().enumerate() {
                assert!(m[..size(j, r)].iter().all(|&x| x == (j * 100 + r) as i32));
            }
            // Rank 0 gives its outputs, the others let the op size them.
            let outs = if r == 0 {
                let outputs = (0..n)
                    .map(|j| Tensor::zeros(DType::I32, size(j, r)))
                    .collect();
                comm.all_to_all_into(inputs(), outputs).unwrap().0
            } else {
                comm.all_to_all(inputs()).unwrap()
            };
            check(&outs);
            let e = comm
                .all_to_all_into(inputs(), vec![Tensor::zeros(DType::I32, 1)])
                .unwrap_err();
            assert!(matches!(e, chorus::Error::InvalidArgument { .. }), "{e}");
            let outputs = (0..n).map(|_| Tensor::zeros(DType::F32, 1)).collect();
            let e = comm.all_to_all_into(inputs(), outputs).unwrap_err();
            assert!(matches!(e, chorus::Error::InvalidArgument { .. }), "{e}");
            comm.barrier().unwrap();
        });
    }
}

#[test]
fn gather_and_scatter_single_into_reuse_buffers_and_mix_with_the_list_forms() {
    for n in [2, 3] {
        run_ranks(n, &format!("gs-into-{n}"), move |comm| {
            let r = comm.rank();
            let root = n - 1;
            let val = |p: usize, i: usize| (p * 100 + i) as i32;
            let mine = |count: usize| Tensor::from_vec((0..count).map(|i| val(r, i)).collect());
            let all = |count: usize| -> Vec<i32> {
                (0..n)
                    .flat_map(|p| (0..count).map(move |i| val(p, i)))
                    .collect()
            };
            // 0 elements, a fused small op, the unfused schedule; the same
            // buffers go round twice.
            for count in [0usize, 3, 70_000] {
                let mut out = if r == root {
                    Tensor::full(-1i32, n * count)
                } else {
                    Tensor::full(9i32, 2) // not used off the root: comes back as is
                };
                let mut input = mine(count);
                for _ in 0..2 {
                    (out, input) = comm.gather_single_into(input, out, root).unwrap();
                    if r == root {
                        assert_eq!(out.to_vec::<i32>(), all(count), "gather {count}");
                    } else {
                        assert_eq!(out.to_vec::<i32>(), vec![9, 9]);
                    }
                    assert_eq!(input.to_vec::<i32>(), mine(count).to_vec::<i32>());
                }
                // Scatter the gathered blocks back out from the root.
                let mut src = if r == root {
                    Tensor::from_vec(all(count))
                } else {
                    Tensor::zeros(DType::I32, 0)
                };
                let mut got = Tensor::full(-1i32, count);
                for _ in 0..2 {
                    (got, src) = comm
                        .scatter_single_into_async(src, got, root)
                        .wait()
                        .unwrap();
                    assert_eq!(
                        got.to_vec::<i32>(),
                        mine(count).to_vec::<i32>(),
                        "scatter {count}"
                    );
                }
                assert_eq!(src.len(), if r == root { n * count } else { 0 });
            }
            // The root uses the _into forms, the others the list forms.
            let count = 4;
            if r == root {
                let (out, _) = comm
                    .gather_single_into(mine(count), Tensor::zeros(DType::I32, n * count), root)
                    .unwrap();
                assert_eq!(out.to_vec::<i32>(), all(count));
                let (got, _) = comm
                    .scatter_single_into(
                        Tensor::from_vec(all(count)),
                        Tensor::zeros(DType::I32, count),
                        root,
                    )
                    .unwrap();
                assert_eq!(got.to_vec::<i32>(), mine(count).to_vec::<i32>());
            } else {
                assert!(comm.gather(mine(count), root).unwrap().is_empty());
                let got = comm
                    .scatter(Tensor::zeros(DType::I32, count), None, root)
                    .unwrap();
                assert_eq!(got.to_vec::<i32>(), mine(count).to_vec::<i32>());
            }
            // A root buffer of the wrong size is refused on the root before
            // anything is sent, so only the root calls here.
            if r == root {
                let e = comm
                    .gather_single_into(mine(2), Tensor::zeros(DType::I32, n * 2 + 1), root)
                    .unwrap_err();
                assert!(matches!(e, chorus::Error::InvalidArgument { .. }), "{e}");
                let e = comm
                    .scatter_single_into(
                        Tensor::zeros(DType::I32, 3),
                        Tensor::zeros(DType::I32, 2),
                        root,
                    )
                    .unwrap_err();
                assert!(matches!(e, chorus::Error::InvalidArgument { .. }), "{e}");
            }
            comm.barrier().unwrap();
        });
    }
}

#[test]
fn blocking_ops_work_inside_a_callers_multi_thread_runtime() {
    // On a worker of a multi-thread runtime a blocking op waits inside
    // block_in_place (the runtime keeps running its other tasks), and still
    // runs as a turn on the calling thread when nothing is queued.
    run_ranks(2, "in-tokio-mt", |comm| {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            let comm2 = comm.clone();
            tokio::spawn(async move {
                let a = comm2.all_reduce_async(Tensor::full(1i32, 1 << 12), ReduceOp::Sum);
                let b = comm2
                    .all_reduce(Tensor::full(2i32, 3), ReduceOp::Sum)
                    .unwrap();
                assert_eq!(b.to_vec::<i32>(), vec![4; 3]);
                assert_eq!(a.await.unwrap().as_slice::<i32>()[0], 2);
                let c = comm2
                    .all_reduce(Tensor::full(3i32, 3), ReduceOp::Sum)
                    .unwrap();
                assert_eq!(c.to_vec::<i32>(), vec![6; 3]);
            })
            .await
            .unwrap();
        })
    });
}

#[test]
fn blocking_ops_on_a_current_thread_runtime_refuse_and_consume_no_seq() {
    // Blocking would stop the runtime's only thread: a typed error instead,
    // before anything is submitted, so the ranks stay in step.
    run_ranks(2, "in-tokio-ct", |comm| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async {
            match comm.all_reduce(Tensor::full(2i32, 3), ReduceOp::Sum) {
                Err(chorus::Error::WouldBlock { op }) => assert_eq!(op, "all_reduce"),
                other => panic!("expected WouldBlock, got {other:?}"),
            }
            let a = comm
                .all_reduce_async(Tensor::full(1i32, 4), ReduceOp::Sum)
                .await
                .unwrap();
            assert_eq!(a.to_vec::<i32>(), vec![2; 4]);
        })
    });
}

/// `Bool` tensors: logical reductions (any non-zero byte is true, results
/// are 0 or 1), broadcast and all_gather, on every backend the suite runs;
/// `Avg` on booleans is refused before any communication.
fn bool_ops(n: usize) {
    run_ranks(n, "bools", move |comm| {
        let r = comm.rank();
        // Element i is true on rank r iff bit r of i is set; true is stored
        // as 7 to check that inputs need not be 0/1.
        let mine: Vec<chorus::Bool> = (0..8)
            .map(|i| chorus::Bool(if i >> r & 1 == 1 { 7 } else { 0 }))
            .collect();
        let truth = |i: usize, q: usize| i >> q & 1 == 1;
        for (op, want) in [
            (
                ReduceOp::Sum,
                (|v: &[bool]| v.iter().any(|&b| b)) as fn(&[bool]) -> bool,
            ),
            (ReduceOp::Max, |v| v.iter().any(|&b| b)),
            (ReduceOp::BOr, |v| v.iter().any(|&b| b)),
            (ReduceOp::Product, |v| v.iter().all(|&b| b)),
            (ReduceOp::Min, |v| v.iter().all(|&b| b)),
            (ReduceOp::BAnd, |v| v.iter().all(|&b| b)),
            (ReduceOp::BXor, |v| {
                v.iter().filter(|&&b| b).count() % 2 == 1
            }),
        ] {
            let res = comm.all_reduce(Tensor::from_vec(mine.clone()), op);
            // NCCL and RCCL have no bitwise reductions, XOR included.
            if op == ReduceOp::BXor && matches!(comm.backend(), "nccl" | "rccl") {
                assert!(
                    matches!(res, Err(chorus::Error::UnsupportedOp { .. })),
                    "{res:?}"
                );
                continue;
            }
            let out = res.unwrap();
            assert_eq!(out.dtype(), DType::Bool);
            let expect: Vec<u8> = (0..8)
                .map(|i| u8::from(want(&(0..n).map(|q| truth(i, q)).collect::<Vec<_>>())))
                .collect();
            assert_eq!(out.as_bytes(), &expect[..], "{op} on rank {r}");
        }
        let b = comm
            .broadcast(Tensor::from_bools(&[r == 0, true, false]), 0)
            .unwrap();
        assert_eq!(b.to_bools(), vec![true, true, false]);
        let g = comm.all_gather(Tensor::from_bools(&[r % 2 == 0])).unwrap();
        assert_eq!(g.to_bools(), (0..n).map(|q| q % 2 == 0).collect::<Vec<_>>());
        let e = comm
            .all_reduce(Tensor::from_bools(&[true]), ReduceOp::Avg)
            .unwrap_err();
        assert!(matches!(e, chorus::Error::UnsupportedOp { .. }), "{e}");
        comm.barrier().unwrap();
    });
}

#[test]
fn bool_reductions_broadcast_and_gather_world_2() {
    bool_ops(2);
}
#[test]
fn bool_reductions_broadcast_and_gather_world_3() {
    bool_ops(3);
}

/// PremulSum with each rank's own factor in a one-element tensor (of
/// several dtypes), through all_reduce, reduce and reduce_scatter.
#[test]
fn premul_sum_with_per_rank_tensor_factors() {
    let n = 3;
    // Rank r's factor, exact in every dtype used below.
    let factor = |r: usize| (r + 1) as f64 * 0.5;
    run_ranks(n, "premul-tensor", move |comm| {
        let r = comm.rank();
        for fdtype in [DType::F64, DType::F32, DType::BF16] {
            let t = Tensor::from_f64s(fdtype, &[factor(r)]);
            let op = ReduceOp::premul_sum_tensor(&t).expect("one finite element");
            assert_eq!(op, ReduceOp::PremulSum(factor(r)));
            let count = 7;
            let want: Vec<f64> = (0..count)
                .map(|i| (0..n).map(|p| factor(p) * value(p, i)).sum())
                .collect();
            let out = comm.all_reduce(input(DType::F32, r, count), op).unwrap();
            assert_close(DType::F32, &out, &want, &format!("all_reduce {fdtype}"));
            let out = comm.reduce(input(DType::F64, r, count), op, 1).unwrap();
            if r == 1 {
                assert_close(DType::F64, &out, &want, &format!("reduce {fdtype}"));
            }
            let full: Vec<f64> = (0..n * 2).map(|i| value(r, i)).collect();
            let out = comm
                .reduce_scatter(Tensor::from_f64s(DType::F32, &full), op)
                .unwrap();
            let want: Vec<f64> = (0..2)
                .map(|i| (0..n).map(|p| factor(p) * value(p, r * 2 + i)).sum())
                .collect();
            assert_close(DType::F32, &out, &want, &format!("reduce_scatter {fdtype}"));
        }
        assert_eq!(
            ReduceOp::premul_sum_tensor(&Tensor::zeros(DType::F32, 2)),
            None
        );
        assert_eq!(
            ReduceOp::premul_sum_tensor(&Tensor::zeros(DType::F32, 0)),
            None
        );
        assert_eq!(
            ReduceOp::premul_sum_tensor(&Tensor::from_vec(vec![f64::NAN])),
            None
        );
        comm.finalize().unwrap();
    });
}

/// One-sided windows where the backend has them (`cpu`, and `nccl` with
/// NCCL 2.29 or later); on every other backend `new_window` is
/// `UnsupportedOp` on every rank before any I/O, and the communicator
/// stays usable and in step.
#[test]
fn new_window_works_where_the_backend_has_windows_and_is_unsupported_op_elsewhere_world_2() {
    run_ranks(2, "windows-caps", |comm| {
        let r = comm.rank();
        match comm.new_window(32) {
            Ok(win) => {
                // cpu, or nccl/rccl whose library has NCCL 2.29's one-sided API.
                assert!(
                    matches!(comm.backend(), "cpu" | "nccl" | "rccl"),
                    "{}",
                    comm.backend()
                );
                win.put_bytes(&[r as u8 + 1; 4], 1 - r, 0).unwrap();
                win.signal(1 - r, 1).unwrap();
                win.wait_signal(1 - r, 1).unwrap();
                assert_eq!(win.read(0, 4).unwrap(), vec![2 - r as u8; 4]);
            }
            Err(chorus::Error::UnsupportedOp { op, .. }) => {
                assert_ne!(comm.backend(), "cpu", "{op}");
            }
            Err(e) => panic!("rank {r}: {e}"),
        }
        let s = comm
            .all_reduce(Tensor::full(1i64, 2), ReduceOp::Sum)
            .unwrap();
        assert_eq!(s.to_vec::<i64>(), vec![2; 2]);
        comm.finalize().unwrap();
    });
}

/// A non-root rank of `reduce` gets its tensor back unchanged, also with
/// `PremulSum` (the turn scales a working copy it makes, in pieces), and
/// the root gets the scaled sum.
#[test]
fn reduce_premul_sum_leaves_the_non_root_input_unchanged_world_2() {
    const N: usize = 300_000; // 1.2 MB: several pieces of the paced copy
    run_ranks(2, "reduce-premul", |comm| {
        let r = comm.rank();
        let input = Tensor::full((r + 1) as f32, N);
        let out = comm
            .reduce(input, ReduceOp::PremulSum(2.0), 0)
            .expect("reduce");
        let want = if r == 0 { 2.0 * 1.0 + 2.0 * 2.0 } else { 2.0 };
        assert!(
            out.as_slice::<f32>().iter().all(|&v| v == want),
            "rank {r}: want {want} everywhere"
        );
    });
}

/// A non-root rank of a plain `reduce` gets its tensor back unchanged,
/// both where the backend only sends it (a small op, which the turn then
/// lends without a copy) and where the algorithm accumulates into it (a
/// tree on larger buffers, which runs on a working copy).
#[test]
fn reduce_leaves_the_non_root_input_unchanged_small_and_large_world_4() {
    run_ranks(4, "reduce-keep", |comm| {
        let r = comm.rank();
        for (round, n) in [2usize, 9_000, 2, 300_000].into_iter().enumerate() {
            let root = round % 4;
            let input = Tensor::full((r + 1) as f32, n);
            let out = comm.reduce(input, ReduceOp::Sum, root).expect("reduce");
            let want = if r == root {
                1.0 + 2.0 + 3.0 + 4.0
            } else {
                (r + 1) as f32
            };
            assert!(
                out.as_slice::<f32>().iter().all(|&v| v == want),
                "rank {r}, {n} elements, root {root}: want {want} everywhere"
            );
        }
    });
}

/// Every collective mismatch kind, with fingerprint checks, on the backend
/// under test: on every rank the op, or the barrier after it, fails with
/// `Mismatch` within the bound. On cpu it is found in the op's messages or
/// through the heartbeats, on nccl/rccl through the heartbeats (fatal: the
/// communicator is aborted); gloo and mpi keep the header exchange, so
/// there it is found before the library is called and the communicator
/// stays usable. Under mpirun only the cases for the job's size run.
#[test]
fn fingerprint_mismatches_end_as_mismatch_on_every_rank() {
    let backend = common::test_backend();
    for (size, name, op) in common::mismatch::collective_mismatches() {
        common::mismatch::mismatch_reaches_every_rank(&backend, size, name, op);
    }
}
