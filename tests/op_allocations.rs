//! Heap allocations per small blocking op, counted on the calling thread.
//!
//! A small op on an idle communicator runs on its caller's thread, and its
//! cost there is a few hundred nanoseconds, so every allocation shows (a
//! `malloc`/`free` pair is 15–30 ns on the hosts we measure on). This
//! binary counts the allocations each rank's thread makes per op, in
//! steady state, for the `cpu` backend over shared memory on 2 in-process
//! ranks. What is left, and why:
//! - the `Work`'s completion cell (one `Arc` the caller and the turn
//!   share; an op's stream-fence slot lives in it unless the op is
//!   ordered with a device stream);
//! - the boxed request, which the ordering gate queues when the op cannot
//!   run at once;
//! - the backend's boxed op future (`Backend::execute` is an async trait
//!   method).
//!
//! A send or a receive also allocates its one-element transfer list (the
//! request's `OpData::P2P`); the flight recorder keeps its peers inline.
//! A barrier computes its rounds as it goes.
//!
//! A non-root rank of a small `reduce` makes no working copy: its buffer
//! is only sent, so the caller's tensor is lent to the op as it is.
//!
//! A rare step that waits long enough to check its peers' liveness builds
//! a short list of them, hence the small slack over the counts above.
//!
//! The step itself (plan, per-peer frame lists, ring jobs, link lookup)
//! allocates nothing. Counts, not times: the numbers are exact and the
//! same on every machine.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::sync::{mpsc, Arc};
use std::time::Duration;

use chorus::transport::MemoryStore;
use chorus::{new_comm, Checks, CommOptions, DType, Device, ReduceOp, Rendezvous, Tensor};

/// Counts the allocations (and reallocations) of the current thread.
struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

fn count() {
    // `try_with`: the allocator also runs while thread locals are torn down.
    let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
}

// SAFETY: forwards every call to the system allocator unchanged.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        count();
        // SAFETY: the caller's contract is passed on.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: the caller's contract is passed on.
        unsafe { System.dealloc(ptr, layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new: usize) -> *mut u8 {
        count();
        // SAFETY: the caller's contract is passed on.
        unsafe { System.realloc(ptr, layout, new) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

fn allocs() -> u64 {
    ALLOCS.with(Cell::get)
}

/// The allocations a small collective makes on its caller's thread (see
/// the module docs).
const PER_OP: f64 = 3.0;
/// ... and a send or a receive, with its transfer list.
const PER_P2P: f64 = 4.0;
/// Slack for the rare step that builds its list of peers to check.
const SLACK: f64 = 0.05;
const WARMUP: usize = 200;
const OPS: usize = 2000;

/// Per op, on 2 ranks: the mean allocations of each rank's thread over
/// [`OPS`] ops after [`WARMUP`].
fn per_op(name: &'static str, op: fn(&chorus::Comm, Tensor) -> Tensor) -> Vec<f64> {
    let store = Arc::new(MemoryStore::new());
    let (tx, rx) = mpsc::channel();
    let threads: Vec<_> = (0..2)
        .map(|rank| {
            let (store, tx) = (store.clone(), tx.clone());
            std::thread::spawn(move || {
                let opts = CommOptions::default()
                    .with_rank(rank, 2)
                    .with_secret(b"allocs".to_vec())
                    .with_checks(Checks::Fingerprint)
                    .with_rendezvous(Rendezvous::Store(store));
                let comm = new_comm("cpu", Device::Cpu, name, opts).expect("new_comm");
                let mut t = Tensor::zeros(DType::F32, 2);
                for _ in 0..WARMUP {
                    t = op(&comm, t);
                }
                let before = allocs();
                for _ in 0..OPS {
                    t = op(&comm, t);
                }
                let after = allocs();
                comm.finalize().expect("finalize");
                let _ = tx.send((after - before) as f64 / OPS as f64);
            })
        })
        .collect();
    drop(tx);
    let got: Vec<f64> = (0..2)
        .map(|_| {
            rx.recv_timeout(Duration::from_secs(120))
                .expect("a rank finished within the bound")
        })
        .collect();
    for t in threads {
        t.join().expect("rank thread");
    }
    got
}

/// Every rank's thread allocates at most `max` times per op (plus
/// [`SLACK`]).
fn assert_bounded(name: &'static str, max: f64, op: fn(&chorus::Comm, Tensor) -> Tensor) {
    // The counts are those of the shared-memory path without checksums;
    // TCP links and CRC snapshots allocate by design.
    for (var, off) in [("CHORUS_SHM", "0"), ("CHORUS_CHECKSUM", "1")] {
        if std::env::var(var).is_ok_and(|v| v == off) {
            eprintln!("{name}: skipped, {var}={off} is set");
            return;
        }
    }
    let got = per_op(name, op);
    assert!(
        got.iter().all(|&a| a <= max + SLACK),
        "{name}: {got:?} allocations per op on the ranks' threads, at most {max} expected"
    );
}

#[test]
fn a_small_all_reduce_allocates_only_its_work_request_and_future() {
    assert_bounded("alloc-all-reduce", PER_OP, |c, t| {
        c.all_reduce(t, ReduceOp::Sum).expect("all_reduce")
    });
}

#[test]
fn a_small_broadcast_allocates_only_its_work_request_and_future() {
    assert_bounded("alloc-broadcast", PER_OP, |c, t| {
        c.broadcast(t, 0).expect("broadcast")
    });
}

#[test]
fn a_small_reduce_allocates_only_its_work_request_and_future() {
    assert_bounded("alloc-reduce", PER_OP, |c, t| {
        c.reduce(t, ReduceOp::Sum, 0).expect("reduce")
    });
}

#[test]
fn a_small_send_or_recv_allocates_only_its_work_request_transfer_and_future() {
    assert_bounded("alloc-send-recv", PER_P2P, |c, t| {
        if c.rank() == 0 {
            c.send(t, 1).expect("send")
        } else {
            c.recv(t, 0).expect("recv")
        }
    });
}

#[test]
fn a_barrier_allocates_only_its_work_request_and_future() {
    assert_bounded("alloc-barrier", PER_OP, |c, t| {
        c.barrier().expect("barrier");
        t
    });
}
