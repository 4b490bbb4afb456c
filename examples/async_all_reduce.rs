//! Several async collectives in flight at once.
//!
//! Each rank issues an `all_reduce`, an `all_gather`, a `broadcast` and a
//! second `all_reduce` back to back without waiting, polls
//! [`Work::is_completed`](chorus::Work::is_completed) while doing other work,
//! then awaits every [`Work`](chorus::Work) on a tokio runtime and checks the
//! results. Ops complete in the order they were issued (all ranks issue them
//! in the same order).
//!
//! Run it on 4 local ranks from the repository root:
//!
//! ```text
//! ./scripts/run-example.sh async_all_reduce 4
//! ```
//!
//! The backend is `CHORUS_BACKEND` (default `cpu`).

use std::process::ExitCode;
use std::time::{Duration, Instant};

use chorus::{new_comm_async, CommOptions, DType, Device, ReduceOp, Tensor};

type Res<T> = Result<T, Box<dyn std::error::Error>>;

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    match run().await {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("async_all_reduce: {e}");
            ExitCode::FAILURE
        }
    }
}

fn check(what: &str, ok: bool, detail: impl FnOnce() -> String) -> Res<()> {
    if ok {
        Ok(())
    } else {
        Err(format!("{what}: {}", detail()).into())
    }
}

async fn run() -> Res<()> {
    let backend = std::env::var("CHORUS_BACKEND").unwrap_or_else(|_| "cpu".into());
    let comm = new_comm_async(&backend, Device::Cpu, "world", CommOptions::default()).await?;
    let (rank, n) = (comm.rank(), comm.size());

    // Four ops in flight; none is waited on yet.
    let sum = comm.all_reduce_async(Tensor::full(rank as f32 + 1.0, 1024), ReduceOp::Sum);
    let gathered = comm.all_gather_async(Tensor::full(rank as i32, 4));
    let root_data = if rank == 0 {
        Tensor::from_vec((0..16).map(f64::from).collect::<Vec<_>>())
    } else {
        Tensor::zeros(DType::F64, 16)
    };
    let bcast = comm.broadcast_async(root_data, 0);
    let max = comm.all_reduce_async(Tensor::full(rank as i64, 8), ReduceOp::Max);

    // The caller is free meanwhile: poll the last op (ops complete in order).
    let start = Instant::now();
    let mut polls = 0u64;
    while !max.is_completed() {
        polls += 1;
        if start.elapsed() > Duration::from_secs(120) {
            return Err(format!("rank {rank}/{n}: ops not completed after 120 s").into());
        }
        tokio::time::sleep(Duration::from_millis(1)).await;
    }

    let sum = sum.await?;
    let expected = (n * (n + 1) / 2) as f32;
    check(
        "all_reduce sum",
        sum.as_slice::<f32>().iter().all(|&v| v == expected),
        || {
            format!(
                "expected every element to be {expected}, got {:?}..",
                &sum.as_slice::<f32>()[..4]
            )
        },
    )?;

    let gathered = gathered.await?;
    let want: Vec<i32> = (0..n as i32).flat_map(|r| [r; 4]).collect();
    check("all_gather", gathered.to_vec::<i32>() == want, || {
        format!("expected {want:?}, got {:?}", gathered.to_vec::<i32>())
    })?;

    let bcast = bcast.await?;
    let want: Vec<f64> = (0..16).map(f64::from).collect();
    check("broadcast", bcast.to_vec::<f64>() == want, || {
        format!("expected {want:?}, got {:?}", bcast.to_vec::<f64>())
    })?;

    let max = max.await?;
    check(
        "all_reduce max",
        max.to_vec::<i64>() == vec![n as i64 - 1; 8],
        || format!("expected {}, got {:?}", n - 1, max.to_vec::<i64>()),
    )?;

    println!("rank {rank}/{n}: 4 async ops ok (polled {polls} times before the last completed)");
    comm.finalize_async().await?;
    Ok(())
}
