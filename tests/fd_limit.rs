//! A rank that runs out of file descriptors while its data links connect:
//! it pauses accepting instead of spinning on `EMFILE`, and its error says
//! that it ran out of descriptors instead of blaming a peer.
//!
//! The rank runs in a child process (this test binary re-executed, the
//! ignored test `out_of_fds_rank`), since it lowers its own open-file limit
//! and then uses up every descriptor; the test plays its peer (a record in
//! the store, then a bare TCP connection). Bounded in time; the child is
//! killed on failure.

mod common;

use std::net::TcpStream;
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus::transport::{MemoryStore, Store};
use chorus::{new_comm, CommOptions, Device, Error, Rendezvous};

const CHILD: &str = "CHORUS_FD_LIMIT_CHILD";
/// The child's connect timeout: how long its setup waits for the peer.
const CONNECT_TIMEOUT: Duration = Duration::from_millis(1500);

#[test]
fn a_rank_out_of_file_descriptors_pauses_accepts_and_says_so() {
    common::run_child_test("out_of_fds_rank", CHILD, Duration::from_secs(60));
}

/// CPU seconds this process has used (user + system).
fn cpu_seconds() -> f64 {
    // SAFETY: getrusage writes the struct it is given.
    let mut u: libc::rusage = unsafe { std::mem::zeroed() };
    assert_eq!(unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut u) }, 0);
    let t = |v: libc::timeval| v.tv_sec as f64 + v.tv_usec as f64 / 1e6;
    t(u.ru_utime) + t(u.ru_stime)
}

/// The rank (run by the test above, not on its own): rank 0 of 2, whose
/// peer is this process connecting a raw socket once no descriptor is
/// left for rank 0 to accept it with.
#[test]
#[ignore = "rank body for a_rank_out_of_file_descriptors_pauses_accepts_and_says_so"]
fn out_of_fds_rank() {
    if std::env::var(CHILD).is_err() {
        return;
    }
    let limit = libc::rlimit {
        rlim_cur: 256,
        rlim_max: 256,
    };
    // SAFETY: setrlimit reads the struct it is given; lowering is allowed.
    assert_eq!(
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &limit) },
        0,
        "lower the open-file limit"
    );
    let store = Arc::new(MemoryStore::new());
    let opts = CommOptions::default()
        .with_rank(0, 2)
        .with_secret("fd-limit")
        .with_rendezvous(Rendezvous::Store(store.clone() as Arc<dyn Store>))
        .with_connect_timeout(CONNECT_TIMEOUT);
    let rank = std::thread::spawn(move || {
        let start = Instant::now();
        let r = new_comm("cpu", Device::Cpu, "fd-limit", opts).map(drop);
        (r, start.elapsed())
    });
    // Rank 0's listener address, once its bootstrap record is published.
    let published = Instant::now();
    let addr = loop {
        let key = store
            .keys()
            .into_iter()
            .find(|k| k.ends_with("/cpu/rank/0"));
        if let Some(k) = key {
            let rt = tokio::runtime::Builder::new_current_thread()
                .build()
                .expect("runtime");
            let v = rt.block_on(store.get(&k)).expect("get").expect("address");
            // The peer's record, so that rank 0 goes on to accept (it never
            // connects to rank 1 itself: it accepts from higher ranks).
            let peer = format!("{}1", k.trim_end_matches('0'));
            rt.block_on(store.set(&peer, b"127.0.0.1:9\nanother-host".to_vec()))
                .expect("set");
            // The record: the listener address, then the host id.
            let record = String::from_utf8(v).expect("utf-8");
            break record.lines().next().expect("an address").to_string();
        }
        assert!(
            published.elapsed() < Duration::from_secs(20),
            "no listener address published"
        );
        std::thread::sleep(Duration::from_millis(5));
    };
    // Use up every descriptor, then free one for the peer's socket: rank
    // 0's accept of that connection finds none left.
    let mut held = Vec::new();
    while let Ok(f) = std::fs::File::open("/dev/null") {
        held.push(f);
    }
    assert!(!held.is_empty(), "no descriptor was left to use up");
    held.pop();
    let cpu0 = cpu_seconds();
    let wall0 = Instant::now();
    let _peer = TcpStream::connect(addr.as_str()).expect("connect to rank 0");
    let (r, took) = rank.join().expect("rank thread");
    let (cpu, wall) = (cpu_seconds() - cpu0, wall0.elapsed().as_secs_f64());
    drop(held);
    let e = r.expect_err("rank 0 cannot finish setting up");
    assert!(
        matches!(&e, Error::Config(m) if m.contains("file descriptors") && m.contains("limit 256")),
        "{e}"
    );
    assert!(
        took < CONNECT_TIMEOUT + Duration::from_secs(5),
        "took {took:?}"
    );
    // Not spinning on the failing accept: most of the wait is asleep.
    assert!(
        cpu < 0.5 * wall,
        "{cpu:.2} s of CPU in {wall:.2} s while accepts failed"
    );
    println!("@@ checked: {e}");
}
