//! The machine's floor for any exchange between two ranks on one host:
//! two threads passing a counter back and forth through one cache line
//! (a release store, an acquire spin), the way a shared-memory ring hands
//! a message's header from one core to the other.
//!
//! ```text
//! cargo run --release --example core_round_trip [round trips, default 2000000]
//! ```
//!
//! Prints the nanoseconds per round trip. docs/performance.md uses it to
//! tell the host's own state from the software's: on a VM this figure can
//! change severalfold from one minute to the next (where the hypervisor
//! runs the two virtual CPUs), and every small op's time with it.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Instant;

fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(2_000_000);
    let line = Arc::new(AtomicU64::new(0));
    let peer = line.clone();
    // The peer answers each odd value `2i + 1` with `2i + 2`.
    let echo = std::thread::spawn(move || {
        for i in 0..n {
            while peer.load(Ordering::Acquire) != 2 * i + 1 {
                std::hint::spin_loop();
            }
            peer.store(2 * i + 2, Ordering::Release);
        }
    });
    let start = Instant::now();
    for i in 0..n {
        line.store(2 * i + 1, Ordering::Release);
        while line.load(Ordering::Acquire) != 2 * i + 2 {
            std::hint::spin_loop();
        }
    }
    let per = start.elapsed().as_secs_f64() * 1e9 / n.max(1) as f64;
    echo.join().expect("the echo thread");
    println!("{per:.0} ns per round trip ({n} round trips)");
}
