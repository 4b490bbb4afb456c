//! Round-trip latency of one-sided window signals: rank 0 signals rank 1
//! and waits for rank 1's answer, `ITERS` times; rank 1 answers each
//! signal with one of its own. Prints the mean round trip and how rank 1's
//! window is reached (`Unified`: shared memory, `Separate`: TCP).
//!
//! ```text
//! cargo build --release --example window_signal_latency --bin chorus-run
//! target/release/chorus-run -n 2 target/release/examples/window_signal_latency [ITERS]
//! ```

use std::process::ExitCode;
use std::time::Instant;

use chorus::{new_comm, CommOptions, Device};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("window_signal_latency: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Res<()> {
    let iters: u64 = match std::env::args().nth(1) {
        Some(a) => a.parse()?,
        None => 2000,
    };
    let comm = new_comm("cpu", Device::Cpu, "world", CommOptions::default())?;
    if comm.size() < 2 {
        return Err("needs at least 2 ranks: run it under `chorus-run -n 2`".into());
    }
    let (rank, n) = (comm.rank(), comm.size());
    let win = comm.new_window(64)?;
    let access = win.get_attr(1)?.access_type;
    comm.barrier()?;
    let t0 = Instant::now();
    for i in 1..=iters {
        match rank {
            0 => {
                win.signal(1, 1)?;
                win.wait_signal(1, i)?;
            }
            1 => {
                win.wait_signal(0, i)?;
                win.signal(0, 1)?;
            }
            _ => {}
        }
    }
    if rank == 0 {
        let us = t0.elapsed().as_secs_f64() * 1e6 / iters as f64;
        println!(
            "rank 0/{n}: {iters} signal round trips to rank 1 ({access:?} access), {us:.2} µs each ok"
        );
    } else if rank == 1 {
        println!("rank 1/{n}: answered {iters} signals ok");
    } else {
        println!("rank {rank}/{n}: holds an unused window ok");
    }
    comm.barrier()?;
    comm.finalize()?;
    Ok(())
}
