//! The machine's memory bandwidth, as the ceiling of large on-host
//! collectives: one and two threads (the two ranks of a 2-rank job on this
//! 2-core machine) each copying, or reducing (`a += b`, f32), their own
//! buffers.
//!
//! ```text
//! cargo run --release --example memory_bandwidth [MiB per buffer, default 128]
//! ```
//!
//! Prints, per case, the bytes one thread copies (or reduces) per second and
//! the DRAM traffic that implies (reads + writes, summed over threads).
//! docs/performance.md uses it to bound what `all_reduce` can reach when each
//! rank must move `4.5 × size` bytes through memory (ring reduce-scatter +
//! all-gather through shared-memory rings on 2 ranks).

use std::time::Instant;

const REPS: usize = 5;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

/// Seconds per pass of `f` over buffers of `len` f32, median of [`REPS`].
fn time_pass(len: usize, f: fn(&mut [f32], &[f32])) -> f64 {
    let mut a = vec![1.0f32; len];
    let b = vec![2.0f32; len];
    f(&mut a, &b); // first touch outside the timing
    let times = (0..REPS)
        .map(|_| {
            let t = Instant::now();
            f(&mut a, &b);
            std::hint::black_box(&a);
            t.elapsed().as_secs_f64()
        })
        .collect();
    median(times)
}

fn copy(a: &mut [f32], b: &[f32]) {
    a.copy_from_slice(b);
}

fn reduce(a: &mut [f32], b: &[f32]) {
    for (x, y) in a.iter_mut().zip(b) {
        *x += *y;
    }
}

/// Median seconds per pass, each of `threads` threads on its own buffers.
fn run(threads: usize, len: usize, f: fn(&mut [f32], &[f32])) -> f64 {
    let barrier = std::sync::Barrier::new(threads);
    std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|_| {
                let barrier = &barrier;
                s.spawn(move || {
                    barrier.wait();
                    time_pass(len, f)
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| h.join().unwrap_or(f64::NAN))
            .fold(0.0, f64::max)
    })
}

fn main() {
    let mib: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(128);
    let bytes = mib << 20;
    let len = bytes / 4;
    println!("buffers of {mib} MiB; GB/s = 1e9 bytes/s");
    println!(
        "{:>8} {:>8} {:>16} {:>22}",
        "threads", "kernel", "per thread GB/s", "DRAM traffic GB/s"
    );
    // copy: read b, write a; reduce: read a and b, write a.
    for (name, f, traffic) in [
        ("copy", copy as fn(&mut [f32], &[f32]), 2.0),
        ("reduce", reduce as fn(&mut [f32], &[f32]), 3.0),
    ] {
        for threads in [1, 2] {
            let secs = run(threads, len, f);
            let per = bytes as f64 / secs / 1e9;
            println!(
                "{threads:>8} {name:>8} {per:>16.2} {:>22.2}",
                per * traffic * threads as f64
            );
        }
    }
}
