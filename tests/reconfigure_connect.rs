//! A member that dies while a reconfigured epoch connects (issue: "a rank
//! killed during the connect phase of reconfigure"): the survivors'
//! `reconfigure` fails naming it, well before `connect_timeout`, and their
//! next `reconfigure` forms the epoch after it, without it.
//!
//! In-process ranks over one `MemoryStore`. The dying member is played by
//! a registered backend that wraps `cpu`: for rank 2 of epoch 1 it
//! publishes a data-link record whose listener is already closed (what a
//! process killed right after publishing leaves behind) and fails.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus::backends::cpu::CpuBackend;
use chorus::backends::{Backend, BackendInit};
use chorus::transport::{MemoryStore, Store};
use chorus::{
    new_comm_async, CommOptions, Device, Error, ReconfigureOptions, ReduceOp, Rendezvous, Tensor,
};

const DEADLINE: Duration = Duration::from_secs(90);
const BACKEND: &str = "cpu-dies-connecting-epoch-1";
/// The rank (in epoch 0 and in epoch 1: ranks 0..=2 keep their numbers
/// when rank 3 leaves) that dies while epoch 1 connects.
const DIES_CONNECTING: usize = 2;
/// The rank that dies in epoch 0.
const DIES_FIRST: usize = 3;
const CONNECT_TIMEOUT: Duration = Duration::from_secs(20);

fn opts(store: &Arc<dyn Store>, rank: usize, size: usize) -> CommOptions {
    CommOptions::default()
        .with_rank(rank, size)
        .with_rendezvous(Rendezvous::Store(store.clone()))
        .with_secret("reconfigure-connect")
        .with_timeout(Duration::from_secs(30))
        .with_connect_timeout(CONNECT_TIMEOUT)
        .with_heartbeat(Duration::from_millis(100), Duration::from_secs(2))
}

async fn backend(init: BackendInit) -> chorus::Result<Box<dyn Backend>> {
    if init.epoch == 1 && init.rank == DIES_CONNECTING {
        common::publish_dead_listener(&init).await;
        return Err(Error::Internal(
            "killed by the test while epoch 1 connects".into(),
        ));
    }
    Ok(Box::new(CpuBackend::connect(init).await?))
}

/// What each rank saw: `None` for the two that died, else the first
/// reconfigure's error, how long it took, and the second one's result.
type Seen = Option<(Error, Duration, usize, u64, Vec<Option<usize>>, f32)>;

async fn rank_body(store: Arc<dyn Store>, rank: usize) -> Seen {
    let n = 4;
    let comm = new_comm_async(
        BACKEND,
        Device::Cpu,
        "reconf-connect",
        opts(&store, rank, n),
    )
    .await
    .unwrap_or_else(|e| panic!("rank {rank}: new_comm: {e}"));
    let first = comm.barrier_async().await;
    if rank == DIES_FIRST {
        comm.abort_with_reason_async("killed by the test").await;
        return None;
    }
    let mut err = first.err();
    while err.is_none() {
        err = comm
            .all_reduce_async(Tensor::full(1.0f32, 4), ReduceOp::Sum)
            .await
            .err();
    }
    let reconf = |min| ReconfigureOptions {
        min_size: Some(min),
        timeout: Duration::from_secs(20),
        ..Default::default()
    };
    let start = Instant::now();
    let attempt = comm.reconfigure_async(reconf(3)).await;
    if rank == DIES_CONNECTING {
        assert!(attempt.is_err(), "rank {rank}: its epoch 1 cannot start");
        return None;
    }
    let e = match attempt {
        Err(e) => e,
        Ok((c, _)) => panic!("rank {rank}: epoch {} started without rank 2", c.epoch()),
    };
    let took = start.elapsed();
    let (next, map) = comm
        .reconfigure_async(reconf(2))
        .await
        .unwrap_or_else(|e| panic!("rank {rank}: second reconfigure: {e}"));
    let sum = next
        .all_reduce_async(Tensor::full(1.0f32, 4), ReduceOp::Sum)
        .await
        .unwrap_or_else(|e| panic!("rank {rank}: all_reduce in the new epoch: {e}"));
    let (size, epoch) = (next.size(), next.epoch());
    next.finalize_async().await.expect("finalize");
    Some((e, took, size, epoch, map.old_to_new, sum.to_vec::<f32>()[0]))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_member_dying_while_the_new_epoch_connects_is_dropped_by_the_next_reconfigure() {
    chorus::register_backend(BACKEND, |_device, init| backend(init)).expect("register");
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let tasks: Vec<_> = (0..4)
        .map(|rank| tokio::spawn(rank_body(store.clone(), rank)))
        .collect();
    let seen = tokio::time::timeout(DEADLINE, async {
        let mut out = Vec::new();
        for t in tasks {
            out.push(t.await.expect("rank task panicked"));
        }
        out
    })
    .await
    .expect("ranks did not finish within the deadline");
    for (rank, s) in seen.into_iter().enumerate() {
        let Some((e, took, size, epoch, map, sum)) = s else {
            assert!([DIES_FIRST, DIES_CONNECTING].contains(&rank));
            continue;
        };
        assert_eq!(
            e.failed_ranks(),
            &[DIES_CONNECTING],
            "rank {rank}: the first reconfigure names the rank that died connecting: {e}"
        );
        assert!(
            took < CONNECT_TIMEOUT / 4,
            "rank {rank}: the first reconfigure took {took:?}"
        );
        assert_eq!((size, epoch), (2, 2), "rank {rank}");
        assert_eq!(map, vec![Some(0), Some(1), None, None], "rank {rank}");
        assert_eq!(sum, 2.0, "rank {rank}");
    }
}
