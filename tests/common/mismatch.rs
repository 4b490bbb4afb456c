//! Mismatched ops under fingerprint checks, shared by the shared suite
//! (`tests/collectives.rs`, every backend), `tests/errors.rs` and the fake
//! NCCL's tests (`tests/xccl_fake.rs`): every kind of disagreement the
//! strict tests cover, each of which must end as `Mismatch` on every rank
//! within [`MISMATCH_BOUND`].

use std::time::{Duration, Instant};

use chorus::{Checks, Comm, CommOptions, DType, Error, ReduceOp, Tensor};

use super::run_ranks_on;

/// How long a mismatch may take to reach every rank with fingerprint
/// checks: in band at once, through a stall in about two heartbeat
/// intervals (100 ms here), with room for a loaded CI machine.
pub const MISMATCH_BOUND: Duration = Duration::from_secs(8);

/// Fingerprint checks, heartbeats every 100 ms (the stall check rides on
/// them), and an op timeout far above [`MISMATCH_BOUND`], so that a
/// mismatch found by the timeout fails the test.
pub fn fingerprint(_rank: usize, o: CommOptions) -> CommOptions {
    o.with_checks(Checks::Fingerprint)
        .with_heartbeat(Duration::from_millis(100), Duration::from_secs(20))
        .with_timeout(Duration::from_secs(60))
}

/// One rank-dependent op that the ranks disagree on.
pub type MismatchedOp = Box<dyn Fn(&Comm) -> chorus::Result<()> + Send + Sync>;

/// On `size` ranks of `backend` with fingerprint checks, every rank runs
/// `op` (each with its own arguments) and then a barrier: on every rank
/// the first of the two that fails fails with `Mismatch` within
/// [`MISMATCH_BOUND`]. Where ops run without the header exchange
/// (`Capabilities::headerless_ops`: cpu, nccl, rccl) the mismatch is fatal
/// and the communicator is aborted after it; where the exchange stays
/// (gloo, mpi) it is found before the library is called and, unless the
/// ranks are out of step (different kinds of op), is not fatal, and the
/// communicator stays usable.
pub fn mismatch_reaches_every_rank(backend: &str, size: usize, name: &str, op: MismatchedOp) {
    let what = format!("{backend} {name}");
    run_ranks_on(backend, size, name, fingerprint, move |comm| {
        let r = comm.rank();
        let headerless = comm.capabilities().headerless_ops;
        let start = Instant::now();
        let first = op(&comm).err().or_else(|| comm.barrier().err());
        let e = first.unwrap_or_else(|| panic!("{what}, rank {r}: no error"));
        let fatal = match e {
            Error::Mismatch { fatal, .. } => fatal,
            _ => panic!("{what}, rank {r}: {e}"),
        };
        assert!(fatal || !headerless, "{what}, rank {r}: not fatal: {e}");
        assert!(
            start.elapsed() < MISMATCH_BOUND,
            "{what}, rank {r}: took {:?}",
            start.elapsed()
        );
        if fatal {
            let e = comm.barrier().unwrap_err();
            assert!(matches!(e, Error::Aborted { .. }), "{what}, rank {r}: {e}");
        } else {
            comm.barrier()
                .unwrap_or_else(|e| panic!("{what}, rank {r}: not usable after it: {e}"));
        }
    });
}

/// Every collective mismatch kind: (ranks, name, op). all_to_all is not
/// here: its list form keeps its size exchange in every mode, and
/// all_to_all_single's sizes are checked by the op only where the backend
/// checks in band (`tests/errors.rs`).
pub fn collective_mismatches() -> Vec<(usize, &'static str, MismatchedOp)> {
    vec![
        (
            3,
            "fp-count",
            Box::new(|c: &Comm| {
                let n = if c.rank() == 1 { 5 } else { 4 };
                c.all_reduce(Tensor::full(1.0f32, n), ReduceOp::Sum)
                    .map(drop)
            }),
        ),
        (
            3,
            "fp-count-large",
            Box::new(|c: &Comm| {
                let n = if c.rank() == 1 { 8193 } else { 8192 };
                c.all_reduce(Tensor::full(1.0f32, n), ReduceOp::Sum)
                    .map(drop)
            }),
        ),
        (
            3,
            "fp-small-large",
            Box::new(|c: &Comm| {
                let n = if c.rank() == 1 { 8192 } else { 4 };
                c.all_gather(Tensor::full(1.0f32, n)).map(drop)
            }),
        ),
        (
            4,
            "fp-dtype",
            Box::new(|c: &Comm| {
                let d = if c.rank() == 3 {
                    DType::F64
                } else {
                    DType::F32
                };
                c.all_reduce(Tensor::zeros(d, 8), ReduceOp::Sum).map(drop)
            }),
        ),
        (
            4,
            "fp-op",
            Box::new(|c: &Comm| {
                let op = if c.rank() == 2 {
                    ReduceOp::Max
                } else {
                    ReduceOp::Sum
                };
                c.all_reduce(Tensor::zeros(DType::I32, 8), op).map(drop)
            }),
        ),
        (
            4,
            "fp-bcast-root",
            Box::new(|c: &Comm| {
                let root = if c.rank() == 0 { 1 } else { 2 };
                c.broadcast(Tensor::zeros(DType::I32, 8), root).map(drop)
            }),
        ),
        (
            3,
            "fp-gather-root",
            Box::new(|c: &Comm| {
                let root = if c.rank() == 0 { 0 } else { 1 };
                c.gather(Tensor::full(1.0f32, 4), root).map(drop)
            }),
        ),
        (
            4,
            "fp-reduce-root",
            Box::new(|c: &Comm| {
                let root = if c.rank() == 0 { 1 } else { 2 };
                c.reduce(Tensor::full(1.0f32, 4), ReduceOp::Sum, root)
                    .map(drop)
            }),
        ),
        (
            4,
            "fp-split-sizes",
            Box::new(|c: &Comm| {
                let counts = if c.rank() == 0 {
                    vec![1, 1, 1, 1]
                } else {
                    vec![2, 0, 1, 1]
                };
                c.reduce_scatter_v(Tensor::zeros(DType::I32, 4), &counts, ReduceOp::Sum)
                    .map(drop)
            }),
        ),
        (
            3,
            "fp-kind",
            Box::new(|c: &Comm| {
                if c.rank() == 0 {
                    c.all_reduce(Tensor::full(1.0f32, 4), ReduceOp::Sum)
                        .map(drop)
                } else {
                    c.broadcast(Tensor::full(1.0f32, 4), 0).map(drop)
                }
            }),
        ),
    ]
}
