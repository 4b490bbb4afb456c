//! What bootstrap and an elastic membership cost the rendezvous store,
//! counted: a store that counts the requests its ranks make. Bootstrap
//! costs each rank two requests (its data-link record written, every
//! rank's read in one wait), so the total grows linearly with the number
//! of ranks; while a reconfigure's membership is open, only its
//! coordinator reads the members' keys.

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};
use std::time::Duration;

use chorus::transport::{MemoryStore, Store};
use chorus::{new_comm, Device, ReduceOp, Rendezvous, Tensor};
use common::hooked::{Hooked, Req};

/// A store that counts the requests made through it in `requests`, and
/// the reads of membership keys among them in `member_reads`.
fn counting(
    inner: Arc<dyn Store>,
    requests: Arc<AtomicUsize>,
    member_reads: Arc<AtomicUsize>,
) -> Arc<dyn Store> {
    Arc::new(Hooked {
        inner,
        hook: Box::new(move |req, key| {
            requests.fetch_add(1, Ordering::Relaxed);
            if req == Req::Get && key.contains("/member/") {
                member_reads.fetch_add(1, Ordering::Relaxed);
            }
            Ok(true)
        }),
    })
}

/// Store requests made by `size` ranks' `new_comm` (heartbeats off), and
/// the same ranks' first all_reduce checked.
fn bootstrap_requests(size: usize) -> usize {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let requests = Arc::new(AtomicUsize::new(0));
    let created = Arc::new(Barrier::new(size));
    let (tx, rx) = std::sync::mpsc::channel();
    for rank in 0..size {
        let (store, requests, created, tx) =
            (store.clone(), requests.clone(), created.clone(), tx.clone());
        std::thread::spawn(move || {
            let counting = counting(store.clone(), requests.clone(), Arc::default());
            let o = common::opts(&store, rank, size)
                .with_rendezvous(Rendezvous::Store(counting))
                .with_heartbeat(Duration::ZERO, Duration::from_secs(10));
            let comm = new_comm("cpu", Device::Cpu, "boot-scale", o).expect("new_comm");
            created.wait();
            let at_bootstrap = requests.load(Ordering::Relaxed);
            let out = comm
                .all_reduce(Tensor::full(1.0f32, 4), ReduceOp::Sum)
                .expect("all_reduce");
            assert_eq!(out.to_vec::<f32>(), vec![size as f32; 4]);
            created.wait();
            comm.finalize().expect("finalize");
            let _ = tx.send(at_bootstrap);
        });
    }
    drop(tx);
    let counts: Vec<usize> = (0..size)
        .map(|_| {
            rx.recv_timeout(Duration::from_secs(60))
                .expect("a rank hung")
        })
        .collect();
    // Every rank read the counter after all had created theirs.
    counts[0]
}

#[test]
fn bootstrap_store_requests_grow_linearly_with_the_ranks() {
    let per_rank: Vec<(usize, usize)> = [4usize, 8, 12]
        .into_iter()
        .map(|n| (n, bootstrap_requests(n)))
        .collect();
    for &(n, total) in &per_rank {
        // Two per rank (its record written, every record read in one
        // wait) and rank 0's pointer to the newest epoch: 2n + 1.
        assert!(
            total <= 2 * n + 2,
            "{n} ranks made {total} store requests at bootstrap: {per_rank:?}"
        );
    }
    // Linear, not quadratic: three times the ranks, at most about three
    // times the requests (with a wait per lower rank's address and a key
    // per record field it was 19, 53 and 103 requests for 4, 8 and 12).
    let (small, large) = (per_rank[0].1, per_rank[2].1);
    assert!(
        large <= 3 * small + 4,
        "4 ranks: {small}, 12 ranks: {large} store requests"
    );
}

/// While a reconfigure's membership is open, only its coordinator (the
/// lowest rank still expected) reads the members' keys; the other ranks
/// wait for the closed record. On 5 ranks with nobody failed, rank 0
/// coordinates and the others never read a member key.
#[test]
fn only_the_coordinator_reads_the_members_of_an_open_membership() {
    let size = 5;
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let (tx, rx) = std::sync::mpsc::channel();
    for rank in 0..size {
        let (store, tx) = (store.clone(), tx.clone());
        std::thread::spawn(move || {
            let member_reads = Arc::new(AtomicUsize::new(0));
            let counting = counting(store.clone(), Arc::default(), member_reads.clone());
            let o = common::opts(&store, rank, size).with_rendezvous(Rendezvous::Store(counting));
            let comm = new_comm("cpu", Device::Cpu, "membership-2", o).expect("new_comm");
            let (next, map) = comm
                .reconfigure(chorus::ReconfigureOptions {
                    timeout: Duration::from_secs(20),
                    ..Default::default()
                })
                .expect("reconfigure");
            assert_eq!(map.size, size);
            let s = next
                .all_reduce(Tensor::full(1.0f32, 2), ReduceOp::Sum)
                .expect("all_reduce in the new epoch");
            assert_eq!(s.to_vec::<f32>(), vec![size as f32; 2]);
            next.finalize().expect("finalize");
            let _ = tx.send((rank, member_reads.load(Ordering::Relaxed)));
        });
    }
    drop(tx);
    for _ in 0..size {
        let (rank, reads) = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("a rank hung");
        if rank == 0 {
            assert!(reads >= size, "the coordinator read {reads} member keys");
        } else {
            assert_eq!(reads, 0, "rank {rank} read member keys");
        }
    }
}
