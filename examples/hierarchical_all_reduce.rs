//! Two-level all-reduce through `Comm::hierarchy`: reduce within each host
//! (`local`), then across hosts (`cross`), and check it against a flat
//! all-reduce.
//!
//! ```text
//! ./scripts/run-example.sh hierarchical_all_reduce 4
//! ```
//!
//! On one machine every rank is on the same host; to see two levels,
//! `CHORUS_RANKS_PER_HOST=2` pretends that ranks `2k` and `2k+1` share a host.
//! Across real hosts, leave it unset: the host name decides (or
//! `CHORUS_HOST_ID`).

use std::process::ExitCode;

use chorus::{new_comm, CommOptions, Device, ReduceOp, Tensor};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("hierarchical_all_reduce: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), Box<dyn std::error::Error>> {
    let comm = new_comm("cpu", Device::Cpu, "world", CommOptions::default())?;
    let (rank, n) = (comm.rank(), comm.size());
    let h = match std::env::var("CHORUS_RANKS_PER_HOST")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
    {
        Some(k) if k > 0 => comm.hierarchy_by(&format!("host{}", rank / k))?,
        _ => comm.hierarchy()?,
    };
    let x = Tensor::full(rank as f64 + 1.0, 1024);
    let flat = comm.all_reduce(x.clone(), ReduceOp::Sum)?;
    let within_host = h.local.all_reduce(x, ReduceOp::Sum)?;
    let two_level = h.cross.all_reduce(within_host, ReduceOp::Sum)?;
    let want = (n * (n + 1) / 2) as f64;
    if two_level.as_slice::<f64>() != flat.as_slice::<f64>()
        || two_level.as_slice::<f64>()[0] != want
    {
        return Err(format!("rank {rank}/{n}: two-level sum differs from {want}").into());
    }
    println!(
        "rank {rank}/{n}: local {}/{} x cross {}/{}: sum = {want} ok",
        h.local.rank(),
        h.local.size(),
        h.cross.rank(),
        h.cross.size()
    );
    comm.finalize()?; // finalizes local and cross first
    Ok(())
}
