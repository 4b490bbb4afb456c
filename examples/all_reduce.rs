//! All-reduce quick start, mirroring TorchComms' quick-start: every rank
//! fills a 1024-element `f32` tensor with `rank + 1`, sums it across all
//! ranks, and checks that every element equals `n(n+1)/2`.
//!
//! Run it on 4 local ranks from the repository root:
//!
//! ```text
//! ./scripts/run-example.sh all_reduce 4
//! ```
//!
//! (by hand: `cargo build --example all_reduce --bin chorus-run && \
//! target/debug/chorus-run -n 4 target/debug/examples/all_reduce`). Under
//! torchrun, mpirun or Slurm it picks up rank and size from their
//! environment instead (see `chorus::bootstrap`).
//!
//! The backend is a string: `CHORUS_BACKEND` (default `cpu`); the device is
//! `CHORUS_DEVICE` (default `cpu`, or `cuda:N`). Exits non-zero with a
//! message if any element is wrong or the collective fails.

use std::process::ExitCode;

use chorus::{new_comm, CommOptions, Device, ReduceOp, Tensor};

const LEN: usize = 1024;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("all_reduce: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let backend = std::env::var("CHORUS_BACKEND").unwrap_or_else(|_| "cpu".into());
    let device: Device = std::env::var("CHORUS_DEVICE")
        .unwrap_or_else(|_| "cpu".into())
        .parse()?;
    let comm = new_comm(&backend, device, "world", CommOptions::default())?;
    let (rank, n) = (comm.rank(), comm.size());

    let tensor = Tensor::full(rank as f32 + 1.0, LEN);
    let sum = comm.all_reduce(tensor, ReduceOp::Sum)?;

    let expected = (n * (n + 1) / 2) as f32;
    let values = sum.as_slice::<f32>();
    if values.len() != LEN {
        return Err(format!(
            "rank {rank}/{n}: got {} elements, expected {LEN}",
            values.len()
        )
        .into());
    }
    if let Some((i, v)) = values.iter().enumerate().find(|(_, &v)| v != expected) {
        return Err(format!("rank {rank}/{n}: element {i} is {v}, expected {expected}").into());
    }
    println!(
        "rank {rank}/{n}: all_reduce sum = {} (expected {expected}) ok",
        values[0]
    );
    comm.finalize()?;
    Ok(())
}
