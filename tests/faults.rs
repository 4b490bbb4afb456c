//! Fault tests: every survivor gets a typed error within the configured
//! timeout, no data is corrupted, the process stays alive, and
//! `reconfigure` yields a working communicator.
//!
//! In-process tests (ranks as threads) inject faults through a store
//! wrapper: muting a rank's heartbeats (a hung rank whose sockets stay
//! open) or cutting it off from the store (a partition). Multi-process
//! tests re-execute this binary as the ranks (the ignored test `worker`,
//! selected by `CHORUS_TEST_WORKER`) and `kill -9` or `SIGSTOP` one of them.
//! Heartbeats run every 100 ms with a 2 s timeout (slack for loaded CI machines); every test is bounded.

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use chorus::backends::cpu::CpuBackend;
use chorus::backends::{Backend, BackendInit};
use chorus::transport::{MemoryStore, Store, TransportError};

use chorus::{
    new_comm, Comm, CommOptions, Device, Error, ReconfigureOptions, ReduceOp, Rendezvous, Tensor,
};
use common::hooked::{Hooked, Req};
use common::{opts, run_ranks_with};

const HB: Duration = Duration::from_millis(100);
const HB_TIMEOUT: Duration = Duration::from_secs(2);
/// A survivor must see the failure within the heartbeat timeout plus this.
const SLACK: Duration = Duration::from_secs(3);

/// Per-rank fault switches.
#[derive(Default)]
struct Faults {
    mute_heartbeats: AtomicBool,
    /// Heartbeat reads this rank made (`get` of a `/hb/` key).
    heartbeat_reads: std::sync::atomic::AtomicUsize,
    partitioned: AtomicBool,
    /// The shared store, unwrapped (to forge keys).
    store: std::sync::Mutex<Option<Arc<dyn Store>>>,
}

/// A store that can stop a rank's heartbeats or cut the rank off, and
/// counts the rank's heartbeat reads.
fn faulty_store(inner: Arc<dyn Store>, faults: Arc<Faults>) -> Hooked {
    Hooked {
        inner,
        hook: Box::new(move |req, key| {
            if faults.partitioned.load(Ordering::Acquire) {
                return Err(TransportError::ConnectionLost {
                    addr: "test-store".into(),
                    detail: "partitioned by the test".into(),
                });
            }
            let heartbeat = key.contains("/hb/");
            if heartbeat && req == Req::Get {
                faults.heartbeat_reads.fetch_add(1, Ordering::Relaxed);
            }
            Ok(!(heartbeat && req == Req::Set && faults.mute_heartbeats.load(Ordering::Acquire)))
        }),
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
            o.with_rendezvous(Rendezvous::Store(Arc::new(faulty_store(
                inner,
                f2[rank].clone(),
            ))))
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

/// On 8 ranks each rank reads only its four ring neighbours' heartbeats,
/// yet a hung rank is reported to every survivor, watcher or not (the
/// others through the failure notice), naming it, within the bound.
#[test]
fn a_hung_rank_among_eight_reaches_every_survivor_while_each_reads_four_heartbeats() {
    const HUNG: usize = 5;
    let out = run_faulty(8, "hang-8", |comm, faults| {
        let r = comm.rank();
        comm.barrier().unwrap();
        let reads0 = faults.heartbeat_reads.load(Ordering::Relaxed);
        let t0 = Instant::now();
        if r == HUNG {
            faults.mute_heartbeats.store(true, Ordering::Release);
            wait_inactive(&comm);
            return None;
        }
        let (e, took) = reduce_until_error(&comm);
        let reads = faults.heartbeat_reads.load(Ordering::Relaxed) - reads0;
        let rounds = t0.elapsed().as_secs_f64() / HB.as_secs_f64();
        match &e {
            Error::PeerFailed { failed_ranks, .. } => {
                assert_eq!(failed_ranks, &vec![HUNG], "rank {r}: {e}")
            }
            other => panic!("rank {r}: expected PeerFailed, got {other}"),
        }
        assert!(
            took < HB_TIMEOUT + SLACK,
            "rank {r}: detected after {took:?}"
        );
        // Four heartbeats a round, and a round or two of slack for the
        // rounds that were under way at either end of the measurement.
        assert!(
            reads as f64 <= 4.0 * (rounds + 2.0),
            "rank {r}: {reads} heartbeat reads in {rounds:.1} rounds"
        );
        Some(failed_ranks_of(&e))
    });
    for (r, o) in out.iter().enumerate() {
        if r != HUNG {
            assert_eq!(o.as_deref(), Some(&[HUNG][..]), "rank {r}");
        }
    }
}

fn failed_ranks_of(e: &Error) -> Vec<usize> {
    match e {
        Error::PeerFailed { failed_ranks, .. } => failed_ranks.clone(),
        _ => vec![],
    }
}

/// A lent turn that can never finish is fatal: rank 0 issues an
/// all_reduce from a task of its own tokio runtime (the turn is lent to
/// that runtime) and shuts the runtime down while the op waits for rank 1.
/// Rank 0's op and communicator fail with a cause that says what happened,
/// and rank 1, which issues its all_reduces only then, fails with
/// `PeerFailed` naming rank 0 within the heartbeat bound, not the op's
/// 30 s timeout.
#[test]
fn runtime_shut_down_mid_lent_turn_fails_the_peer_with_peer_failed_within_the_heartbeat_bound() {
    let (gone_tx, gone_rx) = mpsc::channel::<()>();
    let gone_tx = std::sync::Mutex::new(Some(gone_tx));
    let gone_rx = std::sync::Mutex::new(gone_rx);
    let out = run_ranks_with(
        2,
        "lent-turn-runtime-down",
        |_, o| o.with_heartbeat(HB, HB_TIMEOUT),
        move |comm| {
            if comm.rank() == 0 {
                let rt = tokio::runtime::Builder::new_multi_thread()
                    .worker_threads(1)
                    .enable_all()
                    .build()
                    .expect("runtime");
                // Issued inside `rt`, the idle communicator lends the turn
                // to it: the turn becomes a task of `rt`.
                let entered = rt.enter();
                let work = comm.all_reduce_async(Tensor::full(1.0f32, 1024), ReduceOp::Sum);
                drop(entered);
                assert!(!work.is_completed(), "rank 1 has not issued its op yet");
                // The turn is a task of `rt` now: shutting it down drops it.
                drop(rt);
                let sender = gone_tx.lock().unwrap().take();
                if let Some(tx) = sender {
                    tx.send(()).expect("rank 1 waits");
                }
                match work.wait() {
                    Err(Error::Aborted { reason, .. }) => {
                        assert!(reason.contains("dropped before it finished"), "{reason}")
                    }
                    other => panic!("rank 0: expected Aborted for the dropped turn, got {other:?}"),
                }
                wait_inactive(&comm);
                None
            } else {
                let ready = gone_rx
                    .lock()
                    .unwrap()
                    .recv_timeout(Duration::from_secs(30));
                ready.expect("rank 0 shut its runtime down");
                // The op that pairs with rank 0's dropped one may still
                // succeed (rank 0 had sent its part); the failure must
                // show by the next op, within the heartbeat bound.
                let t0 = Instant::now();
                let (e, _) = reduce_until_error(&comm);
                Some((e, t0.elapsed()))
            }
        },
    );
    let (e, took) = out[1].clone().expect("rank 1's outcome");
    match e {
        Error::PeerFailed { failed_ranks, .. } => assert_eq!(failed_ranks, vec![0]),
        other => panic!("rank 1: expected PeerFailed naming rank 0, got {other:?}"),
    }
    assert!(
        took < HB_TIMEOUT + SLACK,
        "rank 1 saw the failure after {took:?}, beyond the heartbeat bound"
    );
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
                Error::PeerFailed { epoch: 0, .. }
                    | Error::Aborted { epoch: 0, .. }
                    | Error::StoreUnreachable { epoch: 0, .. }
            ),
            "rank {r}: {e}"
        );
        if r == 3 {
            // It is alive: what it lost is the store, and it says so.
            assert!(lost_the_store(&e), "rank {r}: {e}");
        } else {
            assert_eq!(e.failed_ranks(), &[3], "rank {r}: {e}");
        }
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

/// Whether `e` reports the loss of the store: `StoreUnreachable` for the op
/// in flight, `Aborted` by it for an op issued just after.
fn lost_the_store(e: &Error) -> bool {
    match e {
        Error::StoreUnreachable { .. } => true,
        Error::Aborted {
            reason,
            failed_ranks,
            ..
        } => failed_ranks.is_empty() && reason.contains("lost the rendezvous store"),
        _ => false,
    }
}

/// The store runs on its own runtime in this process; every rank reaches it
/// over QUIC. Once every rank runs ops, the store goes away: cleanly
/// (`shutdown`, connections closed) or as a killed or stopped process does
/// (its runtime dropped: the socket stays, nothing answers). Every rank is
/// alive, so every rank must report the lost store, never a peer's or its
/// own failure, within the heartbeat timeout plus slack.
fn store_lost(kill: bool, name: &str) {
    use chorus::transport::RendezvousServer;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let server = rt
        .block_on(RendezvousServer::bind(
            "127.0.0.1:0".parse().unwrap(),
            b"test-secret",
        ))
        .unwrap();
    let addr = server.local_addr();
    let held = Arc::new(std::sync::Mutex::new(Some((rt, server))));
    let all = Arc::new(std::sync::Barrier::new(3));
    let out = run_ranks_with(
        3,
        name,
        move |_, o| {
            o.with_rendezvous(Rendezvous::Server(addr))
                .with_heartbeat(HB, HB_TIMEOUT)
        },
        move |comm| {
            let r = comm.rank();
            comm.barrier().unwrap();
            all.wait();
            if r == 0 {
                let (rt, server) = held.lock().unwrap().take().unwrap();
                if kill {
                    // No close packets: the socket stays open, unread.
                    drop(rt);
                    std::mem::forget(server);
                } else {
                    server.shutdown();
                    held.lock().unwrap().replace((rt, server));
                }
            }
            let lost = Instant::now();
            let (e, _) = reduce_until_error(&comm);
            let took = lost.elapsed();
            assert!(lost_the_store(&e), "rank {r}: {e}");
            assert!(e.is_fatal());
            assert!(
                took < HB_TIMEOUT + SLACK,
                "rank {r}: detected after {took:?}"
            );
            assert!(
                matches!(
                    comm.health().failure,
                    Some(Error::StoreUnreachable { rank, .. }) if rank == r
                ),
                "rank {r}: {:?}",
                comm.health().failure
            );
            took
        },
    );
    assert_eq!(out.len(), 3);
}

#[test]
fn store_shut_down_is_reported_as_store_unreachable_on_every_live_rank() {
    store_lost(false, "store-shutdown");
}

#[test]
fn store_that_stops_answering_is_reported_as_store_unreachable_on_every_live_rank() {
    store_lost(true, "store-silent");
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
        let job = chorus::bootstrap::job_id(b"test-secret").unwrap();
        let prefix = format!("chorus/{job}/stale/0/epoch/1");
        if next.rank() == 0 {
            // A notice stamped with epoch 0, under the new epoch's key.
            futures::executor::block_on(
                store.set(
                    &format!("{prefix}/failed"),
                    chorus::test_support::Notice {
                        epoch: 0,
                        by: 9,
                        failed_ranks: vec![1],
                        detail: "forged notice from an older epoch".into(),
                        mismatch: false,
                    }
                    .encode(),
                ),
            )
            .unwrap();
        }
        next.barrier().unwrap();
        // Epoch 0 is over: its keys (its failure notice included) are gone.
        let old = format!("chorus/{job}/stale/0/epoch/0");
        for k in ["failed", "hb/0", "hb/1"] {
            let v = futures::executor::block_on(store.get(&format!("{old}/{k}"))).unwrap();
            assert_eq!(v, None, "{old}/{k} outlived its epoch");
        }
        // Let this rank's watchdog read the forged notice a few times.
        let hb = format!("{prefix}/hb/{}", next.rank());
        let beat = || -> u64 {
            futures::executor::block_on(store.get(&hb))
                .unwrap()
                // The counter, then what the beat announces (if anything).
                .and_then(|v| String::from_utf8(v).ok()?.split(' ').next()?.parse().ok())
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

#[tokio::test]
async fn data_link_from_an_older_epoch_is_rejected_at_the_handshake() {
    use chorus::backends::cpu::CpuBackend;
    use chorus::backends::BackendInit;
    // Rank 0 is in epoch 1; a process still in epoch 0 tries to connect to it
    // as rank 1 (same key prefix, same secret): the handshake MAC covers the
    // epoch, so the stale link is refused with a typed error, never used.
    let store = Arc::new(MemoryStore::new());
    let t = Duration::from_secs(2);
    let init = |rank: usize, epoch: u64| BackendInit {
        comm: "stale-link".into(),
        key_prefix: "chorus/stale-link/0/epoch/1".into(),
        rank,
        size: 2,
        epoch,
        store: store.clone(),
        secret: Arc::from(&b"secret"[..]),
        connect_timeout: t,
        bind_ip: "127.0.0.1".parse().unwrap(),
        // The handshake is what is tested: open the link at creation.
        links: chorus::backends::LinkPolicy::Eager,
        host_id: None,
        peers_failed: chorus::backends::PeerFailures::none(),
    };
    let start = Instant::now();
    let (new, old) = futures::join!(
        CpuBackend::connect(init(0, 1)),
        CpuBackend::connect(init(1, 0))
    );
    assert!(start.elapsed() < t + SLACK, "took {:?}", start.elapsed());
    assert!(
        matches!(old, Err(Error::Transport(_) | Error::PeerFailed { .. })),
        "stale rank: {:?}",
        old.err()
    );
    assert!(
        matches!(new, Err(Error::Transport(_) | Error::PeerFailed { .. })),
        "new-epoch rank: {:?}",
        new.err()
    );
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

// ------------------------------------------------------------------ processes

#[path = "../examples/elastic_train.rs"]
#[allow(dead_code)]
mod elastic_train;

/// Every multi-process test finishes within this (nextest kills at 2 min).
const MP_DEADLINE: Duration = Duration::from_secs(40);

fn worker_cmd(mode: &str) -> Command {
    let mut c = Command::new(std::env::current_exe().expect("current exe"));
    c.args([
        "--ignored",
        "--exact",
        "worker",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("CHORUS_TEST_WORKER", mode);
    c
}

struct Ranks {
    /// The rank processes, or the one `chorus-run` that started them.
    children: Vec<Child>,
    /// The rank processes' ids, by rank.
    pids: Vec<u32>,
    /// Number of ranks.
    n: usize,
    lines: mpsc::Receiver<(usize, String)>,
    /// Every line received so far (a later wait may look for an earlier line).
    log: std::cell::RefCell<Vec<(usize, String)>>,
}

impl Drop for Ranks {
    fn drop(&mut self) {
        // Ranks under chorus-run are in their own process groups: kill them
        // by pid while the launcher still runs (it exits only after every
        // rank did), then the launcher.
        let launcher_running = self.children.len() == 1
            && self.n > 1
            && matches!(self.children[0].try_wait(), Ok(None));
        if launcher_running && !self.pids.is_empty() {
            let pids: Vec<String> = self.pids.iter().map(u32::to_string).collect();
            let _ = Command::new("sh")
                .args(["-c", &format!("kill -9 {} 2>/dev/null", pids.join(" "))])
                .status();
        }
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn spawn_ranks(n: usize, mode: &str) -> Ranks {
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .expect("free port")
        .port();
    let (tx, lines) = mpsc::channel();
    let mut children = Vec::new();
    for rank in 0..n {
        let mut child = worker_cmd(mode)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("CHORUS_SECRET", "faults-secret")
            .env_remove("CHORUS_RANK")
            .env_remove("CHORUS_SIZE")
            .env_remove("CHORUS_STORE_ADDR")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn rank");
        let out = child.stdout.take().expect("stdout");
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(at) = line.find("@@") {
                    if tx.send((rank, line[at..].to_string())).is_err() {
                        break;
                    }
                }
            }
        });
        children.push(child);
    }
    let pids = children.iter().map(Child::id).collect();
    Ranks {
        children,
        pids,
        n,
        lines,
        log: Default::default(),
    }
}

/// Start `n` ranks of `mode` under `chorus-run` (which hosts the store), and
/// learn their pids. The ranks ignore the SIGTERM with which chorus-run
/// stops the job once a rank died, so the survivors can report and
/// recover; `--grace` bounds them.
fn spawn_under_launcher(n: usize, mode: &str, deadline: Instant) -> Ranks {
    let exe = std::env::current_exe().expect("current exe");
    let mut child = Command::new(env!("CARGO_BIN_EXE_chorus-run"))
        .args(["-n", &n.to_string(), "--grace", "30", "--"])
        .arg(exe)
        .args([
            "--ignored",
            "--exact",
            "worker",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("CHORUS_TEST_WORKER", mode)
        .env("CHORUS_TEST_IGNORE_TERM", "1")
        .env_remove("CHORUS_SECRET")
        .env_remove("CHORUS_STORE_ADDR")
        .env_remove("CHORUS_JOB_ID")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn chorus-run");
    let out = child.stdout.take().expect("stdout");
    let (tx, lines) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            // `[rank R] ...@@what`
            let rank = line
                .strip_prefix("[rank ")
                .and_then(|l| l.split(']').next())
                .and_then(|r| r.parse::<usize>().ok());
            if let (Some(rank), Some(at)) = (rank, line.find("@@")) {
                if tx.send((rank, line[at..].to_string())).is_err() {
                    break;
                }
            }
        }
    });
    let mut ranks = Ranks {
        children: vec![child],
        pids: Vec::new(),
        n,
        lines,
        log: Default::default(),
    };
    let all: Vec<usize> = (0..n).collect();
    ranks.pids = ranks
        .wait_lines(&all, "@@pid ", deadline)
        .iter()
        .map(|l| l["@@pid ".len()..].trim().parse().expect("pid"))
        .collect();
    ranks
}

impl Ranks {
    /// Wait until each of `ranks` printed a line starting with `what`.
    fn wait_lines(&self, ranks: &[usize], what: &str, deadline: Instant) -> Vec<String> {
        let mut seen: Vec<Option<String>> = vec![None; self.n];
        for (r, line) in self.log.borrow().iter() {
            if line.starts_with(what) {
                seen[*r].get_or_insert(line.clone());
            }
        }
        while ranks.iter().any(|&r| seen[r].is_none()) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok((r, line)) => {
                    self.log.borrow_mut().push((r, line.clone()));
                    if line.starts_with(what) {
                        seen[r].get_or_insert(line);
                    }
                }
                Err(_) => panic!("ranks {ranks:?} did not print {what:?} in time; saw {seen:?}"),
            }
        }
        ranks
            .iter()
            .map(|&r| seen[r].clone().unwrap_or_default())
            .collect()
    }

    fn signal(&mut self, rank: usize, sig: &str) {
        let pid = self.pids[rank];
        let st = Command::new("sh")
            .args(["-c", &format!("kill -{sig} {pid}")])
            .status()
            .expect("sh");
        assert!(st.success(), "kill -{sig} {pid}");
    }
}

/// Parse `@@error kind=K ms=M failed=[..]`.
fn parse_error(line: &str) -> (String, u128, String) {
    let field = |k: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(k))
            .unwrap_or_default()
            .to_string()
    };
    (
        field("kind="),
        field("ms=").parse().unwrap_or(u128::MAX),
        field("failed="),
    )
}

fn kind(e: &Error) -> &'static str {
    match e {
        Error::PeerFailed { .. } => "PeerFailed",
        Error::Aborted { .. } => "Aborted",
        Error::Timeout { .. } => "Timeout",
        Error::StoreUnreachable { .. } => "StoreUnreachable",
        Error::Transport(_) => "Transport",
        Error::Mismatch { .. } => "Mismatch",
        _ => "Other",
    }
}

fn fault_worker(what: &str) {
    let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
    println!("@@pid {}", std::process::id());
    // Under chorus-run, outlive the SIGTERM that stops the job once a rank
    // died (the launcher's SIGKILL after its grace period still ends us).
    let _term = std::env::var_os("CHORUS_TEST_IGNORE_TERM").map(|_| {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        let sig = rt
            .block_on(async {
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            })
            .expect("SIGTERM handler");
        (rt, sig)
    });
    if (what == "boot" || what == "boot_host") && rank == 3 {
        println!("@@booting");
        let mut s = String::new();
        let _ = std::io::stdin().read_line(&mut s); // killed here
        return;
    }
    let connect = match what {
        "boot" | "split" => Duration::from_secs(3),
        // Rank 0 (which hosts the store) gives up long before the others.
        "boot_host" if rank == 0 => Duration::from_secs(1),
        _ => Duration::from_secs(20),
    };
    let o = CommOptions::default()
        .with_heartbeat(HB, HB_TIMEOUT)
        .with_timeout(Duration::from_secs(20))
        .with_connect_timeout(connect);
    let t0 = Instant::now();
    let comm = match new_comm("cpu", Device::Cpu, "faults", o) {
        Ok(c) => c,
        Err(e) => {
            println!(
                "@@error kind={} ms={} failed={:?} {e}",
                kind(&e),
                t0.elapsed().as_millis(),
                e.failed_ranks()
            );
            println!("@@alive");
            return;
        }
    };
    let mut done = 0;
    let (e, took) = loop {
        let t = Instant::now();
        let r = if what == "split" {
            comm.split_by_color(Some(0), rank as i64, "sub")
                .and_then(|c| {
                    let c = c.expect("member");
                    let s = c.all_reduce(Tensor::full(1i32, 256), ReduceOp::Sum)?;
                    assert!(s.to_vec::<i32>().iter().all(|&v| v == 4), "corrupt");
                    c.finalize()
                })
        } else {
            // "allreduce_small": small enough to travel with its header.
            let count = if what == "allreduce_small" {
                4
            } else {
                1 << 16
            };
            comm.all_reduce(Tensor::full(1.0f32, count), ReduceOp::Sum)
                .map(|s| assert!(s.as_slice::<f32>().iter().all(|&v| v == 4.0), "corrupt"))
        };
        match r {
            Ok(()) => {
                done += 1;
                if done == 3 {
                    println!("@@running");
                }
            }
            Err(e) => break (e, t.elapsed()),
        }
    };
    println!(
        "@@error kind={} ms={} failed={:?} {e}",
        kind(&e),
        took.as_millis(),
        e.failed_ranks()
    );
    let (next, map) = comm
        .reconfigure(ReconfigureOptions::default())
        .expect("reconfigure");
    report_epoch(next, &map);
}

/// All-reduce once on the epoch a worker reconfigured into, and report it
/// (`@@reconf`, then `@@alive`).
fn report_epoch(next: Comm, map: &chorus::RankMap) {
    let s = next
        .all_reduce(Tensor::full(1i64, 64), ReduceOp::Sum)
        .expect("new epoch all_reduce");
    let ok = s.to_vec::<i64>().iter().all(|&v| v == next.size() as i64);
    println!(
        "@@reconf size={} epoch={} ok={ok} map={:?}",
        next.size(),
        next.epoch(),
        map.old_to_new
    );
    next.finalize().expect("finalize");
    println!("@@alive");
}

/// The backend of `reconf_connect` and `reconf_unpublished` workers:
/// `cpu`, except that rank 2 kills its own process (SIGKILL: nothing of it
/// runs on) while epoch 1 starts. With `published`, it first publishes the
/// address of a listener that is already closed, as a process killed
/// between publishing its data-link record and accepting leaves behind;
/// without, it dies before its record exists, and only its presence
/// endpoint's refusal tells the others.
const DIES_CONNECTING: &str = "cpu-killed-connecting-epoch-1";

fn register_dies_connecting(published: bool, victim: usize) {
    chorus::register_backend(
        DIES_CONNECTING,
        move |_device, init: BackendInit| async move {
            if init.epoch == 1 && init.rank == victim {
                if published {
                    common::publish_dead_listener(&init).await;
                }
                println!("@@dying");
                // SAFETY: raising a signal on this process; SIGKILL never returns.
                unsafe { libc::raise(libc::SIGKILL) };
            }
            Ok(Box::new(CpuBackend::connect(init).await?) as Box<dyn Backend>)
        },
    )
    .expect("register the backend");
}

/// What every process of the tests of a death while epoch 1 starts does
/// first: report its pid, register [`register_dies_connecting`] for
/// `victim`, and take the options they share (heartbeats, and a 20 s
/// connect timeout that the detection bound must beat). Returns `RANK`.
fn dies_connecting_rank(published: bool, victim: usize) -> (usize, CommOptions) {
    let rank: usize = std::env::var("RANK").unwrap().parse().unwrap();
    println!("@@pid {}", std::process::id());
    register_dies_connecting(published, victim);
    let o = CommOptions::default()
        .with_heartbeat(HB, HB_TIMEOUT)
        .with_timeout(Duration::from_secs(20))
        .with_connect_timeout(Duration::from_secs(20));
    (rank, o)
}

/// A rank of `reconf_connect`: all-reduces until rank 3 is killed, then
/// reconfigures into epoch 1, where rank 2 dies while it connects
/// ([`register_dies_connecting`]); reports the first failure naming rank
/// 2 (the reconfigure's, or the new epoch's first op's) and how long after
/// the reconfigure began, then reconfigures again into epoch 2.
fn reconf_connect_worker(published: bool) {
    let (rank, o) = dies_connecting_rank(published, 2);
    let comm = new_comm(DIES_CONNECTING, Device::Cpu, "faults", o).expect("new_comm");
    let mut done = 0;
    let e = loop {
        match comm.all_reduce(Tensor::full(1.0f32, 1024), ReduceOp::Sum) {
            Ok(_) => {
                done += 1;
                if done == 3 {
                    println!("@@running");
                }
            }
            Err(e) => break e,
        }
    };
    println!(
        "@@error kind={} failed={:?} {e}",
        kind(&e),
        e.failed_ranks()
    );
    let t0 = Instant::now();
    let failed = match comm.reconfigure(ReconfigureOptions::default()) {
        Err(e) => e,
        Ok((next, _)) => {
            // The epoch formed where this rank's links to rank 2 were not
            // needed yet: its first op meets the death.
            let e = next
                .all_reduce(Tensor::full(1i64, 64), ReduceOp::Sum)
                .expect_err("rank 2 died while epoch 1 connected");
            let again = next.reconfigure(ReconfigureOptions::default());
            report_second(rank, &e, t0, again);
            return;
        }
    };
    let again = comm.reconfigure(ReconfigureOptions::default());
    report_second(rank, &failed, t0, again);
}

fn report_second(
    rank: usize,
    first: &Error,
    t0: Instant,
    again: chorus::Result<(Comm, chorus::RankMap)>,
) {
    println!(
        "@@first kind={} ms={} failed={:?} {first}",
        kind(first),
        t0.elapsed().as_millis(),
        first.failed_ranks()
    );
    let (next, map) = again.unwrap_or_else(|e| panic!("rank {rank}: second reconfigure: {e}"));
    report_epoch(next, &map);
}

/// Rank 3 killed, then rank 2 killed (a process of its own, SIGKILL)
/// while the survivors' epoch 1 connects, after it published its address:
/// ranks 0 and 1 learn it within the heartbeat bound (not at the 20 s
/// connect timeout), naming rank 2, and their next reconfigure forms epoch
/// 2 of the two of them.
#[test]
fn rank_killed_while_epoch_1_connects_is_found_and_the_next_reconfigure_forms() {
    killed_while_epoch_1_connects("reconf_connect");
}

/// As above, but rank 2 dies before it published its data-link address, so
/// no connection of the others can fail: its ring neighbours' probes of its
/// presence endpoint find it (EL-8), within the heartbeat bound, not at
/// the 20 s connect timeout.
#[test]
fn rank_killed_before_publishing_its_address_in_epoch_1_is_found_by_its_neighbours() {
    killed_while_epoch_1_connects("reconf_unpublished");
}

/// Ranks 0..3 form a communicator of 3; the fourth process joins it, and
/// dies (SIGKILL) in its backend factory while epoch 1, which admitted it
/// as rank 3, starts, before it published anything. Its ring neighbours
/// probe its presence endpoint (EL-8): ranks 0..3 get `PeerFailed` naming
/// rank 3 within the heartbeat bound, and their next reconfigure forms
/// epoch 2 of the three of them.
#[test]
fn joiner_killed_while_epoch_1_starts_is_found_by_its_neighbours() {
    let deadline = Instant::now() + MP_DEADLINE;
    let ranks = spawn_ranks(4, "joiner_dies");
    ranks.wait_lines(&[3], "@@dying", deadline);
    for line in ranks.wait_lines(&[0, 1, 2], "@@first", deadline) {
        eprintln!("joiner_dies: {line}");
        let (k, ms, failed) = parse_error(&line);
        assert_eq!(k, "PeerFailed", "{line}");
        assert_eq!(failed, "[3]", "{line}");
        assert!(ms < (HB_TIMEOUT + SLACK).as_millis(), "too slow: {line}");
    }
    for line in ranks.wait_lines(&[0, 1, 2], "@@reconf", deadline) {
        assert!(line.contains("size=3 epoch=2 ok=true"), "{line}");
    }
    ranks.wait_lines(&[0, 1, 2], "@@alive", deadline);
}

/// A process of `joiner_dies`: ranks 0..3 run a communicator of 3 until
/// they agree a joiner waits, then reconfigure with it (which fails when it
/// dies) and again without it; the fourth process joins and dies
/// ([`register_dies_connecting`] with victim 3).
fn joiner_dies_worker() {
    let (rank, o) = dies_connecting_rank(false, 3);
    if rank == 3 {
        let e = chorus::join_comm(DIES_CONNECTING, Device::Cpu, "faults", o)
            .expect_err("the joiner dies while it starts");
        panic!("the joiner outlived its own SIGKILL: {e}");
    }
    let comm =
        new_comm(DIES_CONNECTING, Device::Cpu, "faults", o.with_rank(rank, 3)).expect("new_comm");
    // Every rank leaves the loop after the same op: the largest count of
    // waiting joiners any rank saw decides.
    loop {
        let seen = comm.pending_joiners().expect("pending_joiners") as i64;
        let agreed = comm
            .all_reduce(Tensor::full(seen, 1), ReduceOp::Max)
            .expect("all_reduce");
        if agreed.to_vec::<i64>()[0] > 0 {
            break;
        }
    }
    let t0 = Instant::now();
    let with_joiner = ReconfigureOptions {
        wait_joiners: 1,
        ..ReconfigureOptions::default()
    };
    let failed = match comm.reconfigure(with_joiner) {
        Err(e) => e,
        Ok((next, _)) => next
            .all_reduce(Tensor::full(1i64, 64), ReduceOp::Sum)
            .expect_err("the joiner died while epoch 1 started"),
    };
    let again = comm.reconfigure(ReconfigureOptions::default());
    report_second(rank, &failed, t0, again);
}

fn killed_while_epoch_1_connects(mode: &str) {
    let deadline = Instant::now() + MP_DEADLINE;
    let mut ranks = spawn_ranks(4, mode);
    ranks.wait_lines(&[0, 1, 2, 3], "@@running", deadline);
    ranks.signal(3, "KILL");
    ranks.wait_lines(&[2], "@@dying", deadline);
    for line in ranks.wait_lines(&[0, 1], "@@first", deadline) {
        eprintln!("{mode}: {line}");
        let (k, ms, failed) = parse_error(&line);
        assert!(
            ["PeerFailed", "Aborted", "Transport"].contains(&k.as_str()),
            "{line}"
        );
        assert!(ms < (HB_TIMEOUT + SLACK).as_millis(), "too slow: {line}");
        assert!(k == "Transport" || failed.contains('2'), "{line}");
    }
    for line in ranks.wait_lines(&[0, 1], "@@reconf", deadline) {
        assert!(line.contains("size=2 epoch=2 ok=true"), "{line}");
    }
    ranks.wait_lines(&[0, 1], "@@alive", deadline);
}

/// The body of one rank process (run by the tests below, not on its own).
#[test]
#[ignore = "a rank of the multi-process tests; run by them"]
fn worker() {
    match std::env::var("CHORUS_TEST_WORKER").as_deref() {
        Ok("elastic") => elastic_train::run_rank().expect("elastic rank"),
        Ok("reconf_connect") => reconf_connect_worker(true),
        Ok("reconf_unpublished") => reconf_connect_worker(false),
        Ok("joiner_dies") => joiner_dies_worker(),
        Ok(mode) => fault_worker(mode),
        Err(_) => {}
    }
}

/// Kill (or stop) `victim` once every rank runs `mode`; every survivor must
/// report a typed error naming it within the bound, then reconfigure to 3.
fn survivors_recover(mode: &str, victim: usize, sig: &str, bound: Duration) {
    let deadline = Instant::now() + MP_DEADLINE;
    let ranks = spawn_ranks(4, mode);
    survivors_recover_in(ranks, deadline, mode, victim, sig, bound);
}

fn survivors_recover_in(
    mut ranks: Ranks,
    deadline: Instant,
    mode: &str,
    victim: usize,
    sig: &str,
    bound: Duration,
) {
    ranks.wait_lines(&[0, 1, 2, 3], "@@running", deadline);
    ranks.signal(victim, sig);
    let survivors: Vec<usize> = (0..4).filter(|&r| r != victim).collect();
    for line in ranks.wait_lines(&survivors, "@@error", deadline) {
        let (k, ms, failed) = parse_error(&line);
        assert!(
            ["PeerFailed", "Aborted", "Transport"].contains(&k.as_str()),
            "{line}"
        );
        assert!(ms < bound.as_millis(), "too slow: {line}");
        if mode == "split" {
            // A death during a split's child bootstrap: the survivor whose
            // child never connected abandons it, so a survivor already in the
            // child may see that rank's reset first and name it; the parent's
            // reconfigure below still excludes exactly the victim.
            assert!(k == "Transport" || failed != "[]", "{line}");
        } else if mode == "launcher" {
            assert!(["PeerFailed", "Aborted"].contains(&k.as_str()), "{line}");
            assert_eq!(failed, format!("[{victim}]"), "{line}");
        } else if k != "Transport" {
            assert!(failed.contains(&victim.to_string()), "{line}");
        }
    }
    for line in ranks.wait_lines(&survivors, "@@reconf", deadline) {
        assert!(line.contains("size=3 epoch=1 ok=true"), "{line}");
        // Exactly the victim is dropped from the new epoch.
        let map: Vec<&str> = line
            .split("map=[")
            .nth(1)
            .unwrap_or_default()
            .trim_end_matches(']')
            .split(", ")
            .collect();
        assert_eq!(map.get(victim), Some(&"None"), "{line}");
        assert_eq!(map.iter().filter(|m| **m == "None").count(), 1, "{line}");
    }
    ranks.wait_lines(&survivors, "@@alive", deadline);
}

#[test]
fn peer_killed_mid_all_reduce_errors_every_survivor_within_timeout_then_reconfigures() {
    survivors_recover("allreduce", 3, "KILL", HB_TIMEOUT + SLACK);
}

#[test]
fn peer_killed_mid_small_all_reduce_errors_every_survivor_within_timeout_then_reconfigures() {
    // 16 B per op: the payload travels with the header frames, and a
    // survivor may be waiting for the victim's frame when it dies.
    survivors_recover("allreduce_small", 3, "KILL", HB_TIMEOUT + SLACK);
}

#[test]
fn rank_0_killed_under_chorus_run_fails_every_survivor_with_peer_failed_naming_it() {
    // chorus-run hosts the store, so rank 0's death leaves it up: every
    // survivor names rank 0 (never a store error, never itself), fast,
    // and the survivors form the next epoch through the same store.
    let deadline = Instant::now() + MP_DEADLINE;
    let ranks = spawn_under_launcher(4, "allreduce", deadline);
    let bound = Duration::from_secs(2);
    survivors_recover_in(ranks, deadline, "launcher", 0, "KILL", bound);
}

#[test]
fn peer_killed_during_split_errors_every_survivor_then_reconfigures() {
    // A split's child bootstrap waits at most the connect timeout (3 s).
    survivors_recover("split", 3, "KILL", Duration::from_secs(3) + SLACK);
}

#[test]
fn hung_process_sigstop_is_detected_by_heartbeats_then_survivors_reconfigure() {
    survivors_recover("hang", 2, "STOP", HB_TIMEOUT + SLACK);
}

#[test]
fn peer_killed_during_bootstrap_fails_new_comm_on_every_rank_in_time() {
    let deadline = Instant::now() + MP_DEADLINE;
    let mut ranks = spawn_ranks(4, "boot");
    ranks.wait_lines(&[3], "@@booting", deadline);
    ranks.signal(3, "KILL");
    for line in ranks.wait_lines(&[0, 1, 2], "@@error", deadline) {
        let (k, ms, _) = parse_error(&line);
        assert!(["PeerFailed", "Transport"].contains(&k.as_str()), "{line}");
        assert!(ms < (Duration::from_secs(3) + SLACK).as_millis(), "{line}");
    }
    ranks.wait_lines(&[0, 1, 2], "@@alive", deadline);
}

#[test]
fn a_store_hosting_rank_whose_start_fails_closes_the_store_before_it_exits() {
    // Rank 3 never starts. Rank 0, which hosts the store, gives up after
    // 1 s and its process exits at once; ranks 1 and 2 would wait 20 s,
    // so they can fail in time only by hearing that the store closed.
    let deadline = Instant::now() + MP_DEADLINE;
    let mut ranks = spawn_ranks(4, "boot_host");
    ranks.wait_lines(&[3], "@@booting", deadline);
    for line in ranks.wait_lines(&[0, 1, 2], "@@error", deadline) {
        let (k, ms, _) = parse_error(&line);
        assert!(["PeerFailed", "Transport"].contains(&k.as_str()), "{line}");
        assert!(ms < (Duration::from_secs(1) + SLACK).as_millis(), "{line}");
    }
    ranks.signal(3, "KILL");
}

#[test]
fn elastic_train_example_survives_a_killed_rank_and_regrows_with_a_joiner() {
    let s = elastic_train::launch(|| worker_cmd("elastic"), MP_DEADLINE).expect("launch");
    assert_eq!(s.failures.len(), 3, "{s:?}");
    let want = format!("param={}", elastic_train::expected_param());
    for f in &s.finals {
        assert!(
            f.contains(&want) && f.contains("size=4"),
            "{f} (want {want})"
        );
    }
}
