//! `CHORUS_CHECKSUM=1`: every frame and ring message carries a CRC32C.
//!
//! - With checksums on, every op still gives exact results, over
//!   shared-memory rings (with and without single copy) and over TCP, and
//!   so do window puts (checked over TCP, copied directly in shared memory).
//! - Bytes scribbled into a shared-memory ring while ops run (as another
//!   process of the same user could, through `/proc/<pid>/mem`) are found:
//!   no op returns corrupted data as a success, and some rank reports
//!   `Error::Corrupted` (or a fatal `Mismatch` when a message prefix was
//!   hit). Without checksums the same scribbling gave silently wrong sums.
//!
//! The settings are process-wide environment variables, so everything runs
//! in one test function, one phase after another.

mod common;

use std::fs::OpenOptions;
use std::os::unix::fs::FileExt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus::{Error, ReduceOp, Tensor};
use common::run_ranks;

/// Exact results of the ops the checksum touches, at sizes that take every
/// path: empty, one-frame, pipelined ring, and (with CMA) single copy.
fn exact_results(phase: &'static str, size: usize) {
    let results = run_ranks(size, &format!("crc-{phase}-{size}"), move |comm| {
        let (rank, n) = (comm.rank(), comm.size());
        for count in [0usize, 2, 16 << 10, 1 << 20] {
            let t = comm
                .all_reduce(Tensor::full((rank + 1) as f32, count), ReduceOp::Sum)
                .expect("all_reduce");
            let want = (n * (n + 1) / 2) as f32;
            assert!(
                t.as_slice::<f32>().iter().all(|&v| v == want),
                "{phase}: all_reduce {count}"
            );
            let all = comm
                .all_gather(Tensor::full(rank as i32, count))
                .expect("all_gather");
            let all = all.as_slice::<i32>();
            assert_eq!(all.len(), n * count, "{phase}: all_gather length");
            for r in 0..n {
                let block = &all[r * count..(r + 1) * count];
                assert!(
                    block.iter().all(|&v| v == r as i32),
                    "{phase}: all_gather block {r}"
                );
            }
            let b = comm
                .broadcast(Tensor::full(if rank == 0 { 7u8 } else { 0 }, count), 0)
                .expect("broadcast");
            assert!(
                b.as_slice::<u8>().iter().all(|&v| v == 7),
                "{phase}: broadcast"
            );
        }
        comm.finalize().expect("finalize");
    });
    assert_eq!(results.len(), size);
}

/// Window puts (over TCP when `CHORUS_SHM=0`, where they carry a CRC32C)
/// land exactly: every rank puts a pattern into the next rank's window.
fn exact_window_puts(phase: &'static str, size: usize) {
    let len = (1 << 20) + 13;
    run_ranks(size, &format!("crc-win-{phase}-{size}"), move |comm| {
        let (rank, n) = (comm.rank(), comm.size());
        let win = comm.new_window(len).expect("new_window");
        let pattern = |r: usize| -> Vec<u8> { (0..len).map(|i| (i * 7 + r) as u8).collect() };
        win.put_bytes(&pattern(rank), (rank + 1) % n, 0)
            .expect("put");
        win.signal((rank + 1) % n, 1).expect("signal");
        let src = (rank + n - 1) % n;
        win.wait_signal(src, 1).expect("wait_signal");
        assert!(
            win.read(0, len).expect("read") == pattern(src),
            "{phase}: rank {rank}'s window holds other bytes than rank {src} put"
        );
        win.free().expect("free");
        comm.finalize().expect("finalize");
    });
}

/// The data areas of every chorus ring mapped in this process:
/// `(address, capacity)`.
fn ring_data_areas() -> Vec<(u64, u64)> {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("maps");
    let mem = OpenOptions::new()
        .read(true)
        .open("/proc/self/mem")
        .expect("mem");
    let mut out = Vec::new();
    for line in maps.lines().filter(|l| l.contains("/dev/shm/chorus-")) {
        let range = line.split_whitespace().next().unwrap_or_default();
        let Some((a, b)) = range.split_once('-') else {
            continue;
        };
        let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else {
            continue;
        };
        // The ring header: capacity at byte 264, data from byte 512.
        let mut cap = [0u8; 8];
        if mem.read_exact_at(&mut cap, a + 264).is_err() {
            continue;
        }
        let cap = u64::from_le_bytes(cap);
        if cap > 0 && a + 512 + cap <= b {
            out.push((a + 512, cap));
        }
    }
    out
}

/// Scribble garbage into every ring's data area until `stop`.
fn scribble(stop: Arc<AtomicBool>) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let mem = OpenOptions::new()
            .write(true)
            .open("/proc/self/mem")
            .expect("mem");
        let mut x = 0x9e37_79b9_7f4a_7c15u64;
        let mut writes = 0;
        while !stop.load(Ordering::Relaxed) {
            let areas = ring_data_areas();
            if areas.is_empty() {
                std::thread::yield_now();
                continue;
            }
            for _ in 0..64 {
                for &(at, cap) in &areas {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let off = (x % (cap - 8)) & !7;
                    if mem.write_all_at(&x.to_le_bytes(), at + off).is_ok() {
                        writes += 1;
                    }
                }
            }
            std::thread::yield_now();
        }
        writes
    })
}

#[test]
fn checksums_keep_results_exact_and_catch_scribbled_rings() {
    // SAFETY (edition 2021 `set_var`): every phase of this binary runs in
    // this one test; the variables are set before any communicator exists.
    std::env::set_var("CHORUS_CHECKSUM", "1");

    // Shared-memory rings, single copy allowed where the host permits it.
    exact_results("shm", 2);
    exact_results("shm", 3);
    // TCP links only.
    std::env::set_var("CHORUS_SHM", "0");
    exact_results("tcp", 2);
    exact_results("tcp", 3);
    exact_window_puts("tcp", 3);
    std::env::remove_var("CHORUS_SHM");
    exact_window_puts("shm", 2);

    // Scribbling: rings only (no single copy, whose bytes never sit in the
    // ring), 64 KiB all-reduces until an error or the deadline.
    std::env::set_var("CHORUS_SHM_CMA", "0");
    let stop = Arc::new(AtomicBool::new(false));
    let scribbler = scribble(stop.clone());
    let outcomes = run_ranks(2, "crc-scribble", |comm| {
        let (rank, n) = (comm.rank(), comm.size());
        let want = (n * (n + 1) / 2) as f32;
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut ops = 0u64;
        while Instant::now() < deadline {
            match comm.all_reduce(Tensor::full((rank + 1) as f32, 16 << 10), ReduceOp::Sum) {
                Ok(t) => {
                    let bad = t.as_slice::<f32>().iter().filter(|&&v| v != want).count();
                    assert_eq!(
                        bad, 0,
                        "rank {rank}: op {ops} returned {bad} corrupted elements"
                    );
                    ops += 1;
                }
                Err(e) => return (ops, Some(e)),
            }
        }
        (ops, None)
    });
    stop.store(true, Ordering::Relaxed);
    let writes = scribbler.join().expect("scribbler");
    assert!(writes > 0, "the scribbler found no ring to write into");
    let mut detected = false;
    for (rank, (ops, err)) in outcomes.iter().enumerate() {
        match err {
            Some(Error::Corrupted { peer, .. }) => {
                assert_eq!(*peer, 1 - rank, "rank {rank} blames the sender");
                detected = true;
            }
            Some(Error::Mismatch { fatal: true, .. }) => detected = true,
            // The other rank learns of the abort through its links.
            Some(e @ (Error::PeerFailed { .. } | Error::Aborted { .. })) => {
                assert!(e.is_fatal(), "{e}");
            }
            Some(e) => panic!("rank {rank} after {ops} ops: unexpected error {e}"),
            None => {}
        }
    }
    assert!(
        detected,
        "{writes} scribbles over 20 s were never detected: {outcomes:?}"
    );
    std::env::remove_var("CHORUS_SHM_CMA");
}
