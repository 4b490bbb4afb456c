//! Loom models of the serial queue (`src/serial.rs`): a serving thread, a
//! pushing thread and a helping waiter in every interleaving. A job run
//! twice or out of order fails the recorded order; a job never run, or a
//! lost wake-up of the server, shows as a wrong order or a loom deadlock.
//!
//! Run with `cargo test --release --features loom` in `sync/`.
#![cfg(feature = "loom")]

use chorus_sync::serial::SerialQueue;
use loom::sync::{Arc, Mutex};
use loom::thread;

type Job = Box<dyn FnOnce() + Send>;
type Log = Arc<Mutex<Vec<u32>>>;
type Queue = Arc<SerialQueue<Job>>;

fn recorder(log: &Log, n: u32) -> Job {
    let log = log.clone();
    Box::new(move || log.lock().unwrap().push(n))
}

/// A queue with a serving thread, and two jobs pushed that record 1 and 2.
fn served_with_two_jobs() -> (Queue, Log, thread::JoinHandle<()>) {
    let q = Arc::new(SerialQueue::<Job>::new());
    let log = Arc::new(Mutex::new(Vec::new()));
    let server = {
        let q = q.clone();
        thread::spawn(move || q.serve())
    };
    q.push(recorder(&log, 1));
    q.push(recorder(&log, 2));
    (q, log, server)
}

/// SQ-1, SQ-2: jobs pushed while the server sleeps, runs or is closing all
/// run once, in order, and `serve` returns after the close.
#[test]
fn sq_1_2_pushes_race_the_server_and_the_close() {
    loom::model(|| {
        let (q, log, server) = served_with_two_jobs();
        q.close();
        server.join().unwrap();
        assert_eq!(*log.lock().unwrap(), vec![1, 2]);
    });
}

/// SQ-1, SQ-3: a waiter helps while the server may be running: between
/// them every job runs once, in push order, and the waiter's job has run
/// when `help` returned having held the runner.
#[test]
fn sq_1_3_a_helping_waiter_races_the_server() {
    loom::model(|| {
        let (q, log, server) = served_with_two_jobs();
        let seen = log.clone();
        if q.help(|| seen.lock().unwrap().len() == 2) {
            assert_eq!(*log.lock().unwrap(), vec![1, 2]);
        }
        q.close();
        server.join().unwrap();
        assert_eq!(*log.lock().unwrap(), vec![1, 2]);
    });
}
