//! GPU backends (`nccl`, `rccl`) on a real device: every collective against
//! a host reference, plus an all-reduce bandwidth report. Each test skips
//! with a printed reason when the libraries or a device are missing (this
//! is what happens in CI); `scripts/gpu-check.sh` runs them on a GPU box.
//!
//! NCCL does not allow two ranks of one communicator on the same device,
//! so the world size is the number of visible devices (capped at 4).
#![cfg(any(feature = "nccl", feature = "rccl"))]

mod common;

use std::time::{Duration, Instant};

use chorus::backends::xccl::{probe, Flavor};
use chorus::{DType, Error, ReduceOp, Tensor};
use common::{assert_close, input, run_ranks_on, value};

fn flavors() -> Vec<Flavor> {
    let mut v = Vec::new();
    if cfg!(feature = "nccl") {
        v.push(Flavor::Nccl);
    }
    if cfg!(feature = "rccl") {
        v.push(Flavor::Rccl);
    }
    v
}

/// World size to test on, or `None` (with the reason printed) to skip.
fn world(flavor: Flavor) -> Option<usize> {
    match probe(flavor) {
        Ok(n) => Some(n.min(4)),
        Err(e) => {
            eprintln!("SKIP {}: {e}", flavor.name());
            None
        }
    }
}

#[test]
fn gpu_backend_without_library_or_device_is_backend_unavailable_not_a_panic() {
    for flavor in flavors() {
        if let Err(e) = probe(flavor) {
            assert!(matches!(e, Error::BackendUnavailable { .. }), "{e:?}");
            let opts = chorus::CommOptions::single();
            let got = chorus::new_comm(flavor.name(), chorus::Device::Cuda(0), "nogpu", opts);
            match got {
                Err(Error::BackendUnavailable { backend, .. }) => {
                    assert_eq!(backend, flavor.name())
                }
                Err(other) => panic!("{other:?}"),
                Ok(_) => panic!("probe failed but new_comm succeeded"),
            }
        }
    }
}

#[test]
fn gpu_every_collective_matches_host_reference() {
    for flavor in flavors() {
        let Some(n) = world(flavor) else { continue };
        run_ranks_on(
            flavor.name(),
            n,
            "gpu-all",
            |_, o| o,
            move |comm| {
                let r = comm.rank();
                for dtype in [
                    DType::F32,
                    DType::F64,
                    DType::F16,
                    DType::BF16,
                    DType::I32,
                    DType::I8,
                ] {
                    for op in [
                        ReduceOp::Sum,
                        ReduceOp::Max,
                        ReduceOp::Min,
                        ReduceOp::Avg,
                        ReduceOp::PremulSum(2.0),
                    ] {
                        for count in [0usize, 4, 1024, 1 << 20] {
                            let out = comm.all_reduce(input(dtype, r, count), op).unwrap();
                            let want: Vec<f64> = (0..count)
                                .map(|i| {
                                    let v: Vec<f64> = (0..n).map(|q| value(q, i)).collect();
                                    match op {
                                        ReduceOp::Sum => v.iter().sum(),
                                        ReduceOp::Max => v.iter().cloned().fold(f64::MIN, f64::max),
                                        ReduceOp::Min => v.iter().cloned().fold(f64::MAX, f64::min),
                                        ReduceOp::Avg if dtype.is_float() => {
                                            v.iter().sum::<f64>() / n as f64
                                        }
                                        ReduceOp::Avg => {
                                            (v.iter().sum::<f64>() as i64 / n as i64) as f64
                                        }
                                        _ => v.iter().map(|x| x * 2.0).sum(),
                                    }
                                })
                                .collect();
                            assert_close(dtype, &out, &want, &format!("{dtype} {op} {count}"));
                        }
                    }
                }
                // Rooted and gathering ops.
                let b = comm.broadcast(input(DType::F32, r, 7), 0).unwrap();
                assert_close(
                    DType::F32,
                    &b,
                    &(0..7).map(|i| value(0, i)).collect::<Vec<_>>(),
                    "broadcast",
                );
                let g = comm.all_gather(input(DType::F32, r, 3)).unwrap();
                let want: Vec<f64> = (0..n)
                    .flat_map(|q| (0..3).map(move |i| value(q, i)))
                    .collect();
                assert_close(DType::F32, &g, &want, "all_gather");
                comm.barrier().unwrap();
                comm.finalize().unwrap();
            },
        );
    }
}

/// `split_by_color` on a GPU communicator goes through `ncclCommSplit`
/// when the library has it (BE-4): children by parity, one opt-out rank
/// when there are three or more, each child all-reduces its own members,
/// and the parent stays usable.
#[test]
fn gpu_split_children_reduce_their_own_members() {
    for flavor in flavors() {
        let Some(n) = world(flavor) else { continue };
        run_ranks_on(
            flavor.name(),
            n,
            "gpu-split",
            |_, o| o,
            move |comm| {
                let r = comm.rank();
                let color = if n >= 3 && r == n - 1 {
                    None
                } else {
                    Some((r % 2) as u32)
                };
                let child = comm.split_by_color(color, r as i64, "parity").unwrap();
                match (color, child) {
                    (None, None) => {}
                    (Some(c), Some(child)) => {
                        let members: Vec<usize> = (0..n)
                            .filter(|&q| !(n >= 3 && q == n - 1) && (q % 2) as u32 == c)
                            .collect();
                        assert_eq!(child.size(), members.len());
                        let out = child
                            .all_reduce(input(DType::F32, r, 1024), ReduceOp::Sum)
                            .unwrap();
                        let want: Vec<f64> = (0..1024)
                            .map(|i| members.iter().map(|&q| value(q, i)).sum())
                            .collect();
                        assert_close(DType::F32, &out, &want, "child all_reduce");
                    }
                    (c, got) => panic!("color {c:?} but child {:?}", got.map(|g| g.size())),
                }
                comm.barrier().unwrap();
                comm.finalize().unwrap();
            },
        );
    }
}

/// One-sided windows on a real NCCL (2.29 or later): every rank puts into
/// the next rank's window, signals it, waits for the previous rank and
/// reads what it wrote. An older library refuses windows on every rank
/// (printed, not a failure).
#[test]
fn gpu_windows_ring_put_signal_wait_read() {
    for flavor in flavors() {
        let Some(n) = world(flavor) else { continue };
        run_ranks_on(
            flavor.name(),
            n,
            "gpu-win",
            |_, o| o,
            move |comm| {
                let r = comm.rank();
                let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
                let win = match comm.new_window(1 << 20) {
                    Ok(w) => w,
                    Err(Error::UnsupportedOp { op, .. }) => {
                        eprintln!(
                            "SKIP windows on {}: {op} ({})",
                            comm.backend(),
                            comm.backend_version()
                        );
                        comm.finalize().unwrap();
                        return;
                    }
                    Err(e) => panic!("rank {r}: {e}"),
                };
                for round in 0..4u64 {
                    let bytes: Vec<u8> = (0..(1usize << 20))
                        .map(|i| (i as u64 * 7 + r as u64 + round) as u8)
                        .collect();
                    win.put_bytes(&bytes, next, 0).unwrap();
                    win.signal(next, 1).unwrap();
                    win.wait_signal(prev, round + 1).unwrap();
                    let got = win.read(0, 1 << 20).unwrap();
                    let want: Vec<u8> = (0..(1usize << 20))
                        .map(|i| (i as u64 * 7 + prev as u64 + round) as u8)
                        .collect();
                    assert!(got == want, "rank {r} round {round}: window bytes differ");
                    comm.barrier().unwrap();
                }
                win.free().unwrap();
                comm.finalize().unwrap();
            },
        );
    }
}

/// Bus bandwidth of all-reduce, f32, 1 MiB .. 256 MiB (staged through the
/// host, so this measures the whole current data path, not NCCL alone).
#[test]
fn gpu_all_reduce_bandwidth_report() {
    for flavor in flavors() {
        let Some(n) = world(flavor) else { continue };
        run_ranks_on(
            flavor.name(),
            n,
            "gpu-bw",
            |_, o| o,
            move |comm| {
                for mib in [1usize, 16, 64, 256] {
                    let count = mib * (1 << 20) / 4;
                    let mut t = Tensor::zeros(DType::F32, count);
                    t = comm.all_reduce(t, ReduceOp::Sum).unwrap();
                    let iters = 5;
                    let start = Instant::now();
                    for _ in 0..iters {
                        t = comm.all_reduce(t, ReduceOp::Sum).unwrap();
                    }
                    let dt = start.elapsed().max(Duration::from_nanos(1)) / iters;
                    let bytes = (count * 4) as f64;
                    let bus =
                        bytes * 2.0 * (n as f64 - 1.0).max(1.0) / n as f64 / dt.as_secs_f64() / 1e9;
                    if comm.rank() == 0 {
                        println!(
                        "BW {} world={n} all_reduce {mib:>4} MiB: {:>8.3} ms, algbw {:.2} GB/s, busbw {:.2} GB/s",
                        comm.backend(),
                        dt.as_secs_f64() * 1e3,
                        bytes / dt.as_secs_f64() / 1e9,
                        bus
                    );
                    }
                }
                comm.finalize().unwrap();
            },
        );
    }
}

/// Device tensors on a real GPU: every collective and point-to-point op on
/// `Comm::device_zeros`/`to_device` tensors, with no host staging, equals
/// the same op on host tensors (whose results the test above checks
/// against references); `Avg` and `PremulSum` run on the device (`ncclAvg`,
/// `ncclRedOpCreatePreMulSum`) and match the reference; a stream-ordered
/// op (`with_stream` on the legacy default stream) completes.
#[test]
fn gpu_every_op_on_device_tensors_matches_the_host_op() {
    for flavor in flavors() {
        let Some(n) = world(flavor) else { continue };
        run_ranks_on(
            flavor.name(),
            n,
            "gpu-dev",
            |_, o| o,
            move |comm| {
                let r = comm.rank();
                let dev = |t: &Tensor| comm.to_device(t).expect("to_device");
                let same = |d: &Tensor, h: &Tensor, what: &str| {
                    assert!(d.is_device(), "{what}: not on the device");
                    assert_eq!(&comm.to_host(d).expect("to_host"), h, "{what} rank {r}");
                };
                let count = 1000;
                for dtype in [DType::F32, DType::F16, DType::BF16, DType::I32] {
                    for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::PremulSum(2.0)] {
                        if !op.supports(dtype) {
                            continue;
                        }
                        let out = comm.all_reduce(dev(&input(dtype, r, count)), op).unwrap();
                        let want: Vec<f64> = (0..count)
                            .map(|i| {
                                let s: f64 = (0..n).map(|p| value(p, i)).sum();
                                match op {
                                    ReduceOp::Avg if dtype.is_float() => s / n as f64,
                                    ReduceOp::Avg => (s as i64 / n as i64) as f64,
                                    ReduceOp::PremulSum(k) => s * k,
                                    _ => s,
                                }
                            })
                            .collect();
                        let host = comm.to_host(&out).unwrap();
                        assert_close(
                            dtype,
                            &host,
                            &want,
                            &format!("device all_reduce {dtype} {op}"),
                        );
                    }
                }
                let dtype = DType::F32;
                for root in 0..n {
                    same(
                        &comm
                            .reduce(dev(&input(dtype, r, count)), ReduceOp::Sum, root)
                            .unwrap(),
                        &comm
                            .reduce(input(dtype, r, count), ReduceOp::Sum, root)
                            .unwrap(),
                        "reduce",
                    );
                    let b = input(dtype, root, count);
                    same(
                        &comm.broadcast(dev(&b), root).unwrap(),
                        &comm.broadcast(b, root).unwrap(),
                        "broadcast",
                    );
                    same(
                        &comm
                            .gather_single(dev(&input(dtype, r, count)), root)
                            .unwrap(),
                        &comm.gather_single(input(dtype, r, count), root).unwrap(),
                        "gather_single",
                    );
                }
                same(
                    &comm.all_gather(dev(&input(dtype, r, count))).unwrap(),
                    &comm.all_gather(input(dtype, r, count)).unwrap(),
                    "all_gather",
                );
                same(
                    &comm
                        .reduce_scatter(dev(&input(dtype, r, count * n)), ReduceOp::Sum)
                        .unwrap(),
                    &comm
                        .reduce_scatter(input(dtype, r, count * n), ReduceOp::Sum)
                        .unwrap(),
                    "reduce_scatter",
                );
                same(
                    &comm
                        .all_to_all_single(dev(&input(dtype, r, count * n)))
                        .unwrap(),
                    &comm.all_to_all_single(input(dtype, r, count * n)).unwrap(),
                    "all_to_all_single",
                );
                if n > 1 {
                    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
                    let got = comm
                        .batch_p2p(vec![
                            chorus::P2POp::send(dev(&input(dtype, r, count)), next),
                            chorus::P2POp::recv(comm.device_zeros(dtype, count).unwrap(), prev),
                        ])
                        .unwrap();
                    same(
                        got.last().expect("recv"),
                        &input(dtype, prev, count),
                        "p2p ring",
                    );
                }
                // SAFETY: 0 is the legacy default stream of the runtime.
                let s = unsafe { chorus::DeviceStream::from_raw(std::ptr::null_mut()) };
                let w = comm
                    .with_stream(s)
                    .unwrap()
                    .all_reduce_async(dev(&Tensor::full(1.0f32, 8)), ReduceOp::Sum);
                w.wait_stream(s).unwrap();
                let out = w.wait().unwrap();
                assert_eq!(
                    comm.to_host(&out).unwrap().to_vec::<f32>(),
                    vec![n as f32; 8]
                );
                comm.finalize().unwrap();
            },
        );
    }
}
