//! The control plane at the size of a large job, in one process: 4 096
//! communicators created over one counting in-memory store, on a backend
//! that moves no data, with heartbeats on. It asserts what the scale issue
//! asks of the control plane: store requests at creation and per heartbeat
//! interval are a constant per rank (O(N) for the job), a rank whose
//! heartbeats stop is reported to every other rank within the heartbeat
//! bound (timeout + 2 intervals), and a `reconfigure` of every rank then
//! forms the next epoch without it (the hung rank is told it was left out)
//! for a constant number of store requests per rank.
//!
//! The rest of start-up is the data plane's: the `cpu` backend's two
//! requests per rank are counted in `tests/bootstrap_scale.rs`, and the
//! collective schedules at 4 096 ranks are simulated in the unit tests of
//! `schedule.rs` (`small_ops_on_4096_ranks_send_o_n_log_n_messages_and_are_right`).
//! Real time, not virtual: the interval is short, and the whole run takes
//! a few seconds on 2 CPUs.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Once};
use std::time::{Duration, Instant};

use chorus::backends::{async_trait, Backend, BackendInit, OpCtx, OpData};
use chorus::transport::{MemoryStore, Store};
use chorus::{new_comm, Device, Error, ReconfigureOptions, Rendezvous, Result};
use common::hooked::{Hooked, Req};

/// A backend with no data plane: the communicators only run their control
/// plane (creation, watchdog). The simulation runs no op; one would fail.
struct Idle;

#[async_trait]
impl Backend for Idle {
    fn name(&self) -> &'static str {
        "idle"
    }

    async fn exchange_headers(
        &mut self,
        _ctx: &OpCtx,
        _outgoing: Vec<(usize, u64, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>> {
        Err(Error::Internal("the idle backend moves no data".into()))
    }

    async fn execute(&mut self, _ctx: &OpCtx, _data: &mut OpData) -> Result<()> {
        Err(Error::Internal("the idle backend moves no data".into()))
    }

    async fn abort(&mut self, _reason: &str, _failed: &[usize]) {}

    async fn finalize(&mut self) {}
}

fn register() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        chorus::register_backend("idle", |_device, _init: BackendInit| async move {
            Ok(Box::new(Idle) as Box<dyn Backend>)
        })
        .expect("idle registers");
    });
}

const N: usize = 4096;
const INTERVAL: Duration = Duration::from_millis(500);
const TIMEOUT: Duration = Duration::from_secs(3);

#[test]
fn the_control_plane_of_4096_ranks_costs_the_store_o_n_finds_a_hung_rank_and_reconfigures() {
    register();
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let requests = Arc::new(AtomicUsize::new(0));
    // Requests other than the heartbeats and the failure notice's reads.
    let setup = Arc::new(AtomicUsize::new(0));
    let mute = Arc::new(AtomicBool::new(false));
    let victim = N / 3 + 1;
    let victim_hb = format!("/hb/{victim}");
    let counting: Arc<dyn Store> = {
        let (requests, setup, mute) = (requests.clone(), setup.clone(), mute.clone());
        Arc::new(Hooked {
            inner: store.clone(),
            hook: Box::new(move |req, key| {
                requests.fetch_add(1, Ordering::Relaxed);
                if !key.contains("/hb/") && !key.ends_with("/failed") {
                    setup.fetch_add(1, Ordering::Relaxed);
                }
                // The victim hangs: its heartbeats stop reaching the store.
                Ok(!(req == Req::Set && mute.load(Ordering::Relaxed) && key.ends_with(&victim_hb)))
            }),
        })
    };
    let t = Instant::now();
    let comms: Vec<chorus::Comm> = (0..N)
        .map(|rank| {
            let o = common::opts(&store, rank, N)
                .with_rendezvous(Rendezvous::Store(counting.clone()))
                .with_heartbeat(INTERVAL, TIMEOUT)
                .with_flight_recorder_size(0);
            new_comm("idle", Device::Cpu, "sim", o).expect("new_comm")
        })
        .collect();
    let created = t.elapsed();
    let at_bootstrap = setup.load(Ordering::Relaxed);
    println!("created {N} communicators in {created:?} with {at_bootstrap} store requests");

    // Heartbeat traffic over 4 intervals, once every watchdog is running.
    let before = requests.load(Ordering::Relaxed);
    let window = INTERVAL * 4;
    std::thread::sleep(window);
    let per_interval = (requests.load(Ordering::Relaxed) - before) as f64 / 4.0;
    println!("{per_interval} store requests per heartbeat interval");

    // Hang the victim; every other rank must learn of it.
    mute.store(true, Ordering::Relaxed);
    let hung = Instant::now();
    let bound = TIMEOUT + INTERVAL * 4;
    let mut told = vec![false; N];
    while hung.elapsed() < bound * 3 {
        for (r, c) in comms.iter().enumerate() {
            if !told[r] && c.health().failed_ranks == vec![victim] {
                told[r] = true;
            }
        }
        if told.iter().enumerate().all(|(r, &t)| t || r == victim) {
            break;
        }
        std::thread::sleep(INTERVAL / 5);
    }
    let found = hung.elapsed();
    let missing: Vec<usize> = (0..N).filter(|&r| r != victim && !told[r]).collect();
    println!("every rank told of the hung rank in {found:?}");
    let example = missing.first().map(|&m| format!("{:?}", comms[m].health()));

    // Every rank reconfigures: the hung one is told it was left out, the
    // others form epoch 1 without it. Its heartbeats may reach the store
    // again (the key of its old rank is a survivor's in epoch 1).
    mute.store(false, Ordering::Relaxed);
    let before = setup.load(Ordering::Relaxed);
    let t = Instant::now();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("runtime");
    let formed = rt.block_on(futures::future::join_all(comms.iter().map(|c| {
        c.reconfigure_async(ReconfigureOptions {
            timeout: Duration::from_secs(60),
            ..ReconfigureOptions::default()
        })
    })));
    let reconfigured = t.elapsed();
    let at_reconfigure = setup.load(Ordering::Relaxed) - before;
    println!("{N} ranks reconfigured in {reconfigured:?} with {at_reconfigure} store requests");
    let mut next = Vec::new();
    for (r, f) in formed.into_iter().enumerate() {
        match f {
            Ok((c, map)) => {
                assert_ne!(r, victim, "the hung rank was let in");
                let want = r - usize::from(r > victim);
                assert_eq!(
                    (c.rank(), c.size(), map.epoch),
                    (want, N - 1, 1),
                    "rank {r}"
                );
                assert_eq!(map.old_to_new[victim], None);
                assert_eq!(map.old_to_new[r], Some(want));
                next.push(c);
            }
            Err(Error::Excluded { .. }) if r == victim => {}
            Err(e) => panic!("rank {r}: {e}"),
        }
    }
    for c in next.into_iter().chain(comms) {
        c.abort();
    }
    assert!(
        at_bootstrap <= 4 * N,
        "{at_bootstrap} store requests at creation"
    );
    assert!(
        per_interval <= 7.0 * N as f64,
        "{per_interval} store requests per interval"
    );
    assert!(
        at_reconfigure <= 8 * N,
        "{at_reconfigure} store requests to reconfigure"
    );
    assert!(
        missing.is_empty(),
        "{} ranks never told, e.g. rank {:?}: {example:?}",
        missing.len(),
        missing.first()
    );
    assert!(found <= bound, "told after {found:?}, bound {bound:?}");
}
