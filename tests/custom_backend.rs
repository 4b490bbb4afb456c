//! Pluggable backends: a backend written outside Chorus, registered by
//! name with `chorus::register_backend`, runs real collectives through
//! `Comm` (and splits, whose children it creates again by name); the
//! registration errors.
//!
//! The backend here, `memnet` (`tests/common/memnet.rs`), moves bytes
//! between the ranks of one process over in-memory channels, found through
//! the communicator's key prefix.

mod common;

use std::sync::{LazyLock, Mutex, Once};

use chorus::backends::{Backend, BackendInit};
use chorus::{CommOptions, Device, Error, ReduceOp, Tensor};
use common::memnet::MemNet;
use common::run_ranks_on;

/// Factory calls, by communicator name (to see that split children were
/// created through the registry too).
static CREATED: LazyLock<Mutex<Vec<String>>> = LazyLock::new(|| Mutex::new(Vec::new()));

fn register() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        chorus::register_backend("memnet", |device, init: BackendInit| async move {
            if device != Device::Cpu {
                return Err(Error::BackendUnavailable {
                    backend: "memnet",
                    reason: format!("memnet runs on the cpu device, not {device}"),
                });
            }
            CREATED.lock().unwrap().push(init.comm.clone());
            Ok(Box::new(MemNet::connect(&init)) as Box<dyn Backend>)
        })
        .expect("memnet registers");
    });
}

#[test]
fn a_registered_backend_runs_collectives_through_comm() {
    register();
    let out = run_ranks_on(
        "memnet",
        3,
        "memnet-world",
        |_, o| o,
        |comm| {
            let r = comm.rank();
            assert_eq!(comm.backend(), "memnet");
            let s = comm
                .all_reduce(Tensor::full((r + 1) as f32, 4), ReduceOp::Sum)
                .unwrap();
            assert_eq!(s.to_vec::<f32>(), vec![6.0; 4]);
            // Avg is Sum on the backend plus the executor's division.
            let a = comm
                .all_reduce(Tensor::full(r as f64 * 3.0, 2), ReduceOp::Avg)
                .unwrap();
            assert_eq!(a.to_vec::<f64>(), vec![3.0; 2]);
            let g = comm
                .all_gather(Tensor::from_vec(vec![r as i64, 10 * r as i64]))
                .unwrap();
            assert_eq!(g.to_vec::<i64>(), vec![0, 0, 1, 10, 2, 20]);
            let b = comm
                .broadcast(Tensor::full(if r == 2 { 7i32 } else { 0 }, 3), 2)
                .unwrap();
            assert_eq!(b.to_vec::<i32>(), vec![7; 3]);
            comm.barrier().unwrap();
            // The executor's cross-rank check runs over the backend's headers.
            let n = if r == 1 { 5 } else { 4 };
            match comm.all_reduce(Tensor::full(1i32, n), ReduceOp::Sum) {
                Err(Error::Mismatch { .. }) => {}
                other => panic!("rank {r}: expected Mismatch, got {other:?}"),
            }
            // A split's child is created by name, through the factory again.
            let child = comm.split(&[0, 2], "memnet-pair").unwrap();
            let pair = child.map(|c| {
                assert_eq!(c.backend(), "memnet");
                c.all_reduce(Tensor::full(r as i32, 1), ReduceOp::Max)
                    .unwrap()
                    .to_vec::<i32>()[0]
            });
            comm.finalize().unwrap();
            pair
        },
    );
    assert_eq!(out, vec![Some(2), None, Some(2)]);
    let created = CREATED.lock().unwrap().clone();
    assert_eq!(created.iter().filter(|c| *c == "memnet-world").count(), 3);
    assert_eq!(created.iter().filter(|c| *c == "memnet-pair").count(), 2);
}

#[test]
fn an_op_the_backend_refuses_is_its_error_on_every_rank_and_not_fatal() {
    register();
    let out = run_ranks_on(
        "memnet",
        2,
        "memnet-unsupported",
        |_, o| o,
        |comm| {
            let e = comm
                .reduce_scatter(Tensor::full(1.0f32, 4), ReduceOp::Sum)
                .unwrap_err();
            // Refused alike on every rank before any data moved, and not a
            // fatal error: the communicator stays usable.
            assert!(comm.is_active());
            let s = comm
                .all_reduce(Tensor::full(2u32, 3), ReduceOp::Product)
                .unwrap();
            assert_eq!(s.to_vec::<u32>(), vec![4; 3]);
            comm.finalize().unwrap();
            e
        },
    );
    for e in out {
        assert!(
            matches!(
                e,
                Error::NotSupported {
                    backend: "memnet",
                    ..
                }
            ),
            "{e}"
        );
    }
}

#[test]
fn a_single_rank_world_on_the_registered_backend() {
    register();
    let comm = chorus::new_comm("memnet", Device::Cpu, "memnet-one", CommOptions::single())
        .expect("memnet comm");
    let s = comm
        .all_reduce(Tensor::from_vec(vec![1.5f32, 2.5]), ReduceOp::Sum)
        .unwrap();
    assert_eq!(s.to_vec::<f32>(), vec![1.5, 2.5]);
    comm.finalize().unwrap();
    // The factory refuses a device it cannot use, before the communicator starts.
    match chorus::new_comm(
        "memnet",
        Device::Cuda(0),
        "memnet-gpu",
        CommOptions::single(),
    ) {
        Err(Error::BackendUnavailable { backend, .. }) => assert_eq!(backend, "memnet"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn registration_errors_and_unknown_names() {
    register();
    let factory = |_d: Device, init: BackendInit| async move {
        Ok(Box::new(MemNet::connect(&init)) as Box<dyn Backend>)
    };
    for name in ["cpu", "nccl", "rccl", "gloo", "mpi"] {
        match chorus::register_backend(name, factory) {
            Err(Error::Config(m)) => assert!(m.contains("Chorus has a backend"), "{m}"),
            other => panic!("{name}: {other:?}"),
        }
    }
    match chorus::register_backend("memnet", factory) {
        Err(Error::Config(m)) => assert!(m.contains("already registered"), "{m}"),
        other => panic!("{other:?}"),
    }
    for name in ["", "a/b"] {
        assert!(matches!(
            chorus::register_backend(name, factory),
            Err(Error::Config(_))
        ));
    }
    match chorus::new_comm("no-such-net", Device::Cpu, "x", CommOptions::single()) {
        Err(Error::UnknownBackend { name, available }) => {
            assert_eq!(name, "no-such-net");
            assert!(available.contains(&"cpu"), "{available:?}");
            assert!(available.contains(&"memnet"), "{available:?}");
        }
        other => panic!("{other:?}"),
    }
    // The built-in one is still the built-in one.
    let cpu = chorus::new_comm("cpu", Device::Cpu, "still-cpu", CommOptions::single()).unwrap();
    assert_eq!(cpu.backend(), "cpu");
    cpu.finalize().unwrap();
}
