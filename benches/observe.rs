//! What observing ops costs on the blocking fast path: an 8 B all_reduce
//! on a world of one rank (no transfer, so the actor layer is all that is
//! measured), with the flight recorder off, on (2000 entries), and with a
//! post hook. Prints ns/op for three interleaved rounds.
//!
//! `cargo bench --bench observe`. Under `cargo test`/nextest (no
//! `--bench` flag) it lists no tests and, if run, does a short smoke run.

use std::time::Instant;

use chorus::{new_comm, CommOptions, Device, ReduceOp, Tensor};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    // A test runner listing tests (libtest protocol): this bench has none.
    if args.iter().any(|a| a == "--list") {
        return;
    }
    let n = if args.iter().any(|a| a == "--bench") {
        200_000
    } else {
        1_000
    };
    let single = |size| CommOptions::single().with_flight_recorder_size(size);
    let off = new_comm("cpu", Device::Cpu, "observe-off", single(0)).expect("comm");
    let on = new_comm("cpu", Device::Cpu, "observe-on", single(2000)).expect("comm");
    let hooked = new_comm("cpu", Device::Cpu, "observe-hook", single(0)).expect("comm");
    let _hook = hooked.register_post_hook(|a| {
        std::hint::black_box(a.duration);
    });
    for round in 0..3 {
        for (name, comm) in [
            ("recorder off, no hooks", &off),
            ("recorder on (2000)", &on),
            ("recorder off, one post hook", &hooked),
        ] {
            let mut t = Tensor::full(1.0f32, 2);
            let start = Instant::now();
            for _ in 0..n {
                t = comm.all_reduce(t, ReduceOp::Sum).expect("all_reduce");
            }
            let ns = start.elapsed().as_nanos() as f64 / n as f64;
            println!("round {round}  {name:<28} {ns:>7.0} ns/op");
        }
    }
}
