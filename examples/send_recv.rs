//! Point-to-point around a ring.
//!
//! 1. Blocking `send`/`recv`: each rank sends `[rank; 256]` to the next rank
//!    and receives from the previous one. Even ranks send first and odd ranks
//!    receive first, so no two neighbours both wait to send.
//! 2. `batch_p2p`: the send to the next rank and the receive from the
//!    previous one are issued together (no ordering trick needed), repeated
//!    `n - 1` times, each rank forwarding what it received, so every rank
//!    sees every other rank's value once: a hand-made ring all-gather.
//!
//! Needs at least 2 ranks. Run it on 4 local ranks from the repository root:
//!
//! ```text
//! ./scripts/run-example.sh send_recv 4
//! ```
//!
//! The backend is `CHORUS_BACKEND` (default `cpu`).

use std::process::ExitCode;

use chorus::{new_comm, CommOptions, DType, Device, P2POp, Tensor};

const LEN: usize = 256;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("send_recv: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Res<()> {
    let backend = std::env::var("CHORUS_BACKEND").unwrap_or_else(|_| "cpu".into());
    let comm = new_comm(&backend, Device::Cpu, "world", CommOptions::default())?;
    let (rank, n) = (comm.rank(), comm.size());
    if n < 2 {
        return Err("needs at least 2 ranks: run it under `chorus-run -n 2` or more".into());
    }
    let next = (rank + 1) % n;
    let prev = (rank + n - 1) % n;

    // 1. Blocking send/recv, even ranks first.
    let mine = Tensor::full(rank as i32, LEN);
    let buf = Tensor::zeros(DType::I32, LEN);
    let got = if rank % 2 == 0 {
        comm.send(mine, next)?;
        comm.recv(buf, prev)?
    } else {
        let got = comm.recv(buf, prev)?;
        comm.send(mine, next)?;
        got
    };
    if got.to_vec::<i32>() != vec![prev as i32; LEN] {
        return Err(format!(
            "rank {rank}/{n}: recv from {prev} got {:?}..",
            &got.to_vec::<i32>()[..4]
        )
        .into());
    }

    // 2. batch_p2p ring: forward what came in, n - 1 times.
    let mut outgoing = Tensor::full(rank as f32, LEN);
    let mut seen = vec![rank];
    for step in 1..n {
        let mut bufs = comm.batch_p2p(vec![
            P2POp::send(outgoing, next),
            P2POp::recv(Tensor::zeros(DType::F32, LEN), prev),
        ])?;
        let incoming = bufs.pop().ok_or("batch_p2p returned no receive buffer")?;
        // After `step` steps we hold the value of the rank `step` places back.
        let from = (rank + n - step) % n;
        if incoming.to_vec::<f32>() != vec![from as f32; LEN] {
            return Err(format!(
                "rank {rank}/{n}: ring step {step} expected rank {from}'s data, got {:?}..",
                &incoming.to_vec::<f32>()[..4]
            )
            .into());
        }
        seen.push(from);
        outgoing = incoming;
    }
    seen.sort_unstable();
    if seen != (0..n).collect::<Vec<_>>() {
        return Err(format!("rank {rank}/{n}: ring saw ranks {seen:?}").into());
    }
    println!("rank {rank}/{n}: send/recv from {prev} ok; batch_p2p ring saw all {n} ranks ok");
    comm.finalize()?;
    Ok(())
}
