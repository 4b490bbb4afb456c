//! Jobs sharing one store never see each other's keys: every key is scoped
//! by the job id (`CHORUS_JOB_ID`, which `chorus-run` sets fresh for each
//! launch, else one agreed at rank 0 from the secret and its start time),
//! and a job that finalized leaves none of its keys behind.
//!
//! The store is a standalone `RendezvousServer` hosted by the test; ranks
//! are this test binary re-executed (the ignored test `job_rank`), so each
//! has fresh per-process counters, as separate jobs do. Bounded in time;
//! children are killed on failure.

use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use chorus::transport::RendezvousServer;
use chorus::{new_comm, CommOptions, Device, ReduceOp, Tensor};

const DEADLINE: Duration = Duration::from_secs(60);
const SECRET: &str = "job-isolation-secret";

struct Kids(Vec<Child>);

impl Drop for Kids {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Start a store server on loopback, on its own runtime thread.
fn store() -> (SocketAddr, tokio::runtime::Runtime, RendezvousServer) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("runtime");
    let server = rt
        .block_on(RendezvousServer::bind(
            "127.0.0.1:0".parse().expect("addr"),
            SECRET.as_bytes(),
        ))
        .expect("bind store");
    (server.local_addr(), rt, server)
}

/// Launch `n` ranks of job `job` (`None`: no `CHORUS_JOB_ID`, as a job
/// started by hand): each prints `@@sum <v>` (after finalizing) or `@@err <e>`.
fn launch(
    store: SocketAddr,
    job: Option<&str>,
    n: usize,
    mode: &str,
    value: i32,
    tx: &mpsc::Sender<(String, usize, String)>,
    kids: &mut Kids,
) {
    let exe = std::env::current_exe().expect("current exe");
    for rank in 0..n {
        let mut cmd = Command::new(&exe);
        match job {
            Some(j) => cmd.env("CHORUS_JOB_ID", j),
            None => cmd.env_remove("CHORUS_JOB_ID"),
        };
        let mut child = cmd
            .args([
                "--ignored",
                "--exact",
                "job_rank",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("CHORUS_JOB_RANK_MODE", mode)
            .env("CHORUS_JOB_VALUE", value.to_string())
            .env("CHORUS_STORE_ADDR", store.to_string())
            .env("CHORUS_SECRET", SECRET)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env_remove("CHORUS_RANK")
            .env_remove("CHORUS_SIZE")
            .env_remove("MASTER_ADDR")
            .env_remove("MASTER_PORT")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn rank");
        let out = child.stdout.take().expect("stdout");
        let (tx, job) = (tx.clone(), job.unwrap_or("-").to_string());
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(at) = line.find("@@") {
                    if tx
                        .send((job.clone(), rank, line[at..].to_string()))
                        .is_err()
                    {
                        break;
                    }
                }
            }
        });
        kids.0.push(child);
    }
}

/// Collect one `@@` line from each of `want` (job, rank) pairs.
fn collect(
    rx: &mpsc::Receiver<(String, usize, String)>,
    want: usize,
    deadline: Instant,
) -> Vec<(String, usize, String)> {
    let mut got = Vec::new();
    while got.len() < want {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(x) => got.push(x),
            Err(_) => panic!("ranks did not report in time; got {got:?}"),
        }
    }
    got.sort();
    got
}

/// The body of one rank (run by the tests below, not on its own).
#[test]
#[ignore = "rank body for the job isolation tests; run by them"]
fn job_rank() {
    let Ok(mode) = std::env::var("CHORUS_JOB_RANK_MODE") else {
        return;
    };
    let value: i32 = std::env::var("CHORUS_JOB_VALUE")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1);
    let opts = CommOptions::default()
        .with_timeout(Duration::from_secs(20))
        .with_connect_timeout(Duration::from_secs(20));
    let comm = match new_comm("cpu", Device::Cpu, "jobs", opts) {
        Ok(c) => c,
        Err(e) => {
            println!("@@err {e}");
            return;
        }
    };
    if mode == "die" && comm.rank() == 1 {
        // Leave this job's keys behind and vanish, as a killed rank does.
        println!("@@died");
        std::process::exit(3);
    }
    match comm
        .all_reduce(Tensor::from_vec(vec![value]), ReduceOp::Sum)
        .and_then(|t| comm.finalize().map(|()| t))
    {
        Ok(t) => println!("@@sum {}", t.as_slice::<i32>()[0]),
        Err(e) => println!("@@err {e}"),
    }
}

#[test]
fn two_jobs_on_one_store_with_the_same_names_stay_apart() {
    let (addr, _rt, server) = store();
    let (tx, rx) = mpsc::channel();
    let mut kids = Kids(Vec::new());
    launch(addr, Some("job-a"), 3, "sum", 1, &tx, &mut kids);
    launch(addr, Some("job-b"), 3, "sum", 10, &tx, &mut kids);
    let got = collect(&rx, 6, Instant::now() + DEADLINE);
    for (job, rank, line) in &got {
        let want = if job == "job-a" {
            "@@sum 3"
        } else {
            "@@sum 30"
        };
        assert_eq!(line, want, "{job} rank {rank}; all: {got:?}");
    }
    // Both finalized: the last rank out of each deleted its job's keys.
    assert_eq!(server.store().keys(), Vec::<String>::new());
}

#[test]
fn a_job_relaunched_on_the_same_store_ignores_the_last_jobs_keys() {
    let (addr, _rt, _server) = store();
    let (tx, rx) = mpsc::channel();
    let deadline = Instant::now() + DEADLINE;
    let mut kids = Kids(Vec::new());
    // The first launch loses rank 1 and fails, leaving its keys (and a
    // failure notice) in the store.
    launch(addr, Some("launch-1"), 2, "die", 1, &tx, &mut kids);
    let first = collect(&rx, 2, deadline);
    assert!(
        first.iter().any(|(_, _, l)| l == "@@died"),
        "rank 1 of the first launch should die: {first:?}"
    );
    // The relaunch (a fresh job id, as chorus-run gives it) must work.
    launch(addr, Some("launch-2"), 2, "sum", 5, &tx, &mut kids);
    let second = collect(&rx, 2, deadline);
    for (job, rank, line) in &second {
        assert_eq!(line, "@@sum 10", "{job} rank {rank}; all: {second:?}");
    }
}

#[test]
fn a_reused_store_serves_two_launches_without_a_job_id_apart_and_keeps_none_of_their_keys() {
    // No CHORUS_JOB_ID and the same secret both times, as jobs started by
    // hand against one standalone chorus-rendezvous: the job id comes from
    // the secret and the start time rank 0 publishes.
    let (addr, _rt, server) = store();
    let (tx, rx) = mpsc::channel();
    let deadline = Instant::now() + DEADLINE;
    let mut kids = Kids(Vec::new());
    // The first launch loses rank 1: its keys and failure notice stay.
    launch(addr, None, 2, "die", 1, &tx, &mut kids);
    let first = collect(&rx, 2, deadline);
    assert!(
        first.iter().any(|(_, _, l)| l == "@@died"),
        "rank 1 of the first launch should die: {first:?}"
    );
    let left_over = server.store().keys();
    assert!(
        left_over.iter().any(|k| k.ends_with("/failed")),
        "{left_over:?}"
    );
    // The second launch must not meet them.
    launch(addr, None, 2, "sum", 5, &tx, &mut kids);
    let second = collect(&rx, 2, deadline);
    for (_, rank, line) in &second {
        assert_eq!(line, "@@sum 10", "rank {rank}; all: {second:?}");
    }
    // What the second launch left: only the first's keys (it died) and the
    // one start time with its count.
    let start =
        chorus::bootstrap::job_start_key(&chorus::bootstrap::job_id(SECRET.as_bytes()).unwrap());
    let after: Vec<String> = server
        .store()
        .keys()
        .into_iter()
        .filter(|k| !left_over.contains(k))
        .collect();
    assert!(
        after.len() <= 1 && after.iter().all(|k| k.ends_with("/joined")),
        "{after:?}"
    );
    assert!(server.store().keys().contains(&start));
}
