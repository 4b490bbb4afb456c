//! Fault tests: every survivor gets a typed error within the configured
//! timeout, no data is corrupted, the process stays alive, and
//! `reconfigure` yields a working communicator.
//!
//! In-process tests (ranks as threads) inject faults through a store
//! wrapper: muting a rank's heartbeats (a hung rank whose sockets stay
//! open) or cutting it off from the store (a partition). Multi-process
//! tests re-execute this binary as the ranks (the ignored test `worker`,
//! selected by `CHORUS_TEST_WORKER`) and `kill -9` or `SIGSTOP` one of them.
//! Heartbeats run every 100 ms with a 1 s timeout; every test is bounded.

mod common;

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use async_trait::async_trait;
use chorus::transport::{CompareSet, MemoryStore, Store, TransportError};

use chorus::{new_comm, Comm, Device, Error, ReconfigureOptions, ReduceOp, Rendezvous, Tensor};
use common::{opts, run_ranks_with};

const HB: Duration = Duration::from_millis(100);
const HB_TIMEOUT: Duration = Duration::from_secs(1);
/// A survivor must see the failure within the heartbeat timeout plus this.
const SLACK: Duration = Duration::from_secs(3);

/// Per-rank fault switches.
#[derive(Default)]
struct Faults {
    mute_heartbeats: AtomicBool,
    partitioned: AtomicBool,
    /// The shared store, unwrapped (to forge keys).
    store: std::sync::Mutex<Option<Arc<dyn Store>>>,
}

/// A store that can stop a rank's heartbeats or cut the rank off.
struct FaultyStore {
    inner: Arc<dyn Store>,
    faults: Arc<Faults>,
}

impl FaultyStore {
    fn check(&self) -> Result<(), TransportError> {
        if self.faults.partitioned.load(Ordering::Acquire) {
            return Err(TransportError::ConnectionLost {
                addr: "test-store".into(),
                detail: "partitioned by the test".into(),
            });
        }
        Ok(())
    }
}

#[async_trait]
impl Store for FaultyStore {
    async fn set(&self, key: &str, value: Vec<u8>) -> Result<(), TransportError> {
        self.check()?;
        if key.contains("/hb/") && self.faults.mute_heartbeats.load(Ordering::Acquire) {
            return Ok(());
        }
        self.inner.set(key, value).await
    }
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, TransportError> {
        self.check()?;
        self.inner.get(key).await
    }
    async fn wait(
        &self,
        keys: &[String],
        timeout: Duration,
    ) -> Result<Vec<Vec<u8>>, TransportError> {
        self.check()?;
        self.inner.wait(keys, timeout).await
    }
    async fn add(&self, key: &str, delta: i64) -> Result<i64, TransportError> {
        self.check()?;
        self.inner.add(key, delta).await
    }
    async fn compare_set(
        &self,
        key: &str,
        expected: Option<Vec<u8>>,
        desired: Vec<u8>,
    ) -> Result<CompareSet, TransportError> {
        self.check()?;
        self.inner.compare_set(key, expected, desired).await
    }
    async fn delete(&self, key: &str) -> Result<bool, TransportError> {
        self.check()?;
        self.inner.delete(key).await
    }
}

/// Run `size` ranks on faulty stores; `f` gets the comm and its rank's switches.
fn run_faulty<T, F>(size: usize, name: &str, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(Comm, Arc<Faults>) -> T + Send + Sync + 'static,
{
    let faults: Arc<Vec<Arc<Faults>>> = Arc::new((0..size).map(|_| Arc::default()).collect());
    let f2 = faults.clone();
    run_ranks_with(
        size,
        name,
        move |rank, o| {
            let Rendezvous::Store(inner) = o.rendezvous.clone() else {
                unreachable!("run_ranks uses a shared store")
            };
            *f2[rank].store.lock().unwrap() = Some(inner.clone());
            o.with_rendezvous(Rendezvous::Store(Arc::new(FaultyStore {
                inner,
                faults: f2[rank].clone(),
            })))
            .with_heartbeat(HB, HB_TIMEOUT)
        },
        move |comm| {
            let fl = faults[comm.rank()].clone();
            f(comm, fl)
        },
    )
}

/// Wait (bounded) until the communicator has stopped accepting ops.
fn wait_inactive(comm: &Comm) {
    let deadline = Instant::now() + HB_TIMEOUT + SLACK;
    while comm.is_active() {
        assert!(
            Instant::now() < deadline,
            "rank {} never saw the failure",
            comm.rank()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// All-reduce until it fails; check every result on the way (no corruption).
fn reduce_until_error(comm: &Comm) -> (Error, Duration) {
    let n = comm.size() as f32;
    loop {
        let t0 = Instant::now();
        match comm.all_reduce(Tensor::full(1.0f32, 1024), ReduceOp::Sum) {
            Ok(t) => assert!(t.as_slice::<f32>().iter().all(|&v| v == n), "corrupt sum"),
            Err(e) => return (e, t0.elapsed()),
        }
    }
}

fn check_new_epoch(comm: &Comm, expect_size: usize) {
    assert_eq!(comm.size(), expect_size);
    assert_eq!(comm.epoch(), 1);
    let s = comm
        .all_reduce(Tensor::full(comm.rank() as i64 + 1, 64), ReduceOp::Sum)
        .unwrap();
    let n = expect_size as i64;
    assert_eq!(s.to_vec::<i64>(), vec![n * (n + 1) / 2; 64]);
}

#[test]
fn hung_rank_without_heartbeats_fails_every_survivor_with_peer_failed_then_reconfigure_shrinks() {
    let out = run_faulty(4, "hang", |comm, faults| {
        let r = comm.rank();
        comm.barrier().unwrap();
        if r == 2 {
            // Hung: sockets stay open, no more heartbeats, no more ops.
            faults.mute_heartbeats.store(true, Ordering::Release);
            wait_inactive(&comm);
            let e = comm.reconfigure(ReconfigureOptions::default()).unwrap_err();
            assert!(matches!(e, Error::Excluded { .. }), "{e}");
            return None;
        }
        let (e, took) = reduce_until_error(&comm);
        match &e {
            Error::PeerFailed {
                epoch,
                failed_ranks,
                ..
            } => {
                assert_eq!(*epoch, 0);
                assert_eq!(failed_ranks, &vec![2], "{e}");
            }
            other => panic!("rank {r}: expected PeerFailed, got {other}"),
        }
        assert!(
            took < HB_TIMEOUT + SLACK,
            "rank {r}: detected after {took:?}"
        );
        assert_eq!(comm.health().failed_ranks, vec![2]);
        let (next, map) = comm
            .reconfigure(ReconfigureOptions {
                timeout: Duration::from_secs(10),
                ..Default::default()
            })
            .unwrap();
        assert_eq!(map.old_to_new, vec![Some(0), Some(1), None, Some(2)]);
        check_new_epoch(&next, 3);
        next.finalize().unwrap();
        Some(map.size)
    });
    assert_eq!(out, vec![Some(3), Some(3), None, Some(3)]);
}

#[test]
fn rank_partitioned_from_the_store_is_detected_on_both_sides() {
    let out = run_faulty(4, "partition", |comm, faults| {
        let r = comm.rank();
        comm.barrier().unwrap();
        if r == 3 {
            faults.partitioned.store(true, Ordering::Release);
        }
        // Every rank keeps reducing: the data links still work, only the
        // control plane is cut.
        let (e, took) = reduce_until_error(&comm);
        // The op in flight gets PeerFailed; an op issued just after the abort
        // gets Aborted carrying the same failed ranks.
        assert!(
            matches!(
                &e,
                Error::PeerFailed { epoch: 0, .. } | Error::Aborted { epoch: 0, .. }
            ),
            "rank {r}: {e}"
        );
        assert_eq!(e.failed_ranks(), &[3], "rank {r}: {e}");
        assert!(
            took < HB_TIMEOUT + SLACK,
            "rank {r}: detected after {took:?}"
        );
        if r == 3 {
            // It knows it is the one cut off; it cannot take part in the next epoch.
            assert!(comm.reconfigure(ReconfigureOptions::default()).is_err());
            return 0;
        }
        let (next, _) = comm.reconfigure(ReconfigureOptions::default()).unwrap();
        check_new_epoch(&next, 3);
        next.finalize().unwrap();
        next.size()
    });
    assert_eq!(out, vec![3, 3, 3, 0]);
}

#[test]
fn minority_partition_cannot_form_an_epoch_no_quorum() {
    let out = run_faulty(4, "quorum", |comm, faults| {
        let r = comm.rank();
        comm.barrier().unwrap();
        if r >= 2 {
            // Two of four ranks hang: the two left are not a majority.
            faults.mute_heartbeats.store(true, Ordering::Release);
            wait_inactive(&comm);
            return None;
        }
        let (e, _) = reduce_until_error(&comm);
        assert!(matches!(e, Error::PeerFailed { .. }), "{e}");
        let e = comm
            .reconfigure(ReconfigureOptions {
                timeout: Duration::from_secs(2),
                ..Default::default()
            })
            .unwrap_err();
        match e {
            Error::NoQuorum {
                epoch, old_size, ..
            } => {
                assert_eq!((epoch, old_size), (1, 4));
            }
            other => panic!("rank {r}: expected NoQuorum, got {other}"),
        }
        Some(())
    });
    assert_eq!(out.iter().flatten().count(), 2);
}

#[test]
fn failure_notice_of_an_older_epoch_is_rejected_by_the_new_epoch() {
    run_faulty(3, "stale", |comm, faults| {
        let r = comm.rank();
        comm.barrier().unwrap();
        if r == 2 {
            faults.mute_heartbeats.store(true, Ordering::Release);
            wait_inactive(&comm);
            return;
        }
        reduce_until_error(&comm);
        let (next, _) = comm.reconfigure(ReconfigureOptions::default()).unwrap();
        let store = faults.store.lock().unwrap().clone().expect("store");
        let prefix = "chorus/stale/0/epoch/1";
        if next.rank() == 0 {
            // A notice stamped with epoch 0, under the new epoch's key.
            futures::executor::block_on(store.set(
                &format!("{prefix}/failed"),
                b"0|9|1|forged notice from an older epoch".to_vec(),
            ))
            .unwrap();
        }
        next.barrier().unwrap();
        // Let this rank's watchdog read the forged notice a few times.
        let hb = format!("{prefix}/hb/{}", next.rank());
        let beat = || -> u64 {
            futures::executor::block_on(store.get(&hb))
                .unwrap()
                .and_then(|v| String::from_utf8(v).ok()?.parse().ok())
                .unwrap_or(0)
        };
        let start = beat();
        let deadline = Instant::now() + SLACK;
        while beat() < start + 3 {
            assert!(Instant::now() < deadline, "watchdog stalled");
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(
            next.is_active(),
            "a stale notice must not abort the new epoch"
        );
        assert!(next.health().failure.is_none());
        check_new_epoch(&next, 2);
        next.finalize().unwrap();
    });
}

#[test]
fn rank_that_never_arrives_fails_bootstrap_with_a_typed_error_in_time() {
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let (tx, rx) = mpsc::channel();
    for rank in 0..3 {
        let (store, tx) = (store.clone(), tx.clone());
        std::thread::spawn(move || {
            let t0 = Instant::now();
            let o = opts(&store, rank, 4).with_connect_timeout(Duration::from_secs(1));
            let r = new_comm("cpu", Device::Cpu, "never", o).map(|_| ());
            let _ = tx.send((rank, r, t0.elapsed()));
        });
    }
    for _ in 0..3 {
        let (rank, r, took) = rx.recv_timeout(Duration::from_secs(20)).expect("hang");
        let e = r.expect_err("a world with a missing rank cannot form");
        assert!(
            matches!(e, Error::PeerFailed { .. } | Error::Transport(_)),
            "rank {rank}: {e}"
        );
        assert!(took < Duration::from_secs(6), "rank {rank}: {took:?}");
    }
}
