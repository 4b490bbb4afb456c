//! The control plane at the size of a large job, in one process: 4 096
//! communicators created over one counting in-memory store, on a backend
//! that moves no data, with heartbeats on. It asserts what the scale issue
//! asks of the control plane: store requests at creation and per heartbeat
//! interval are a constant per rank (O(N) for the job), and a rank whose
//! heartbeats stop is reported to every other rank within the heartbeat
//! bound (timeout + 2 intervals).
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
use chorus::{new_comm, Device, Error, Rendezvous, Result};
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
fn the_control_plane_of_4096_ranks_costs_the_store_o_n_and_finds_a_hung_rank() {
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
    for c in comms {
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
        missing.is_empty(),
        "{} ranks never told, e.g. rank {:?}: {example:?}",
        missing.len(),
        missing.first()
    );
    assert!(found <= bound, "told after {found:?}, bound {bound:?}");
}
