//! Shared-memory ring files under `/dev/shm` never outlive their job: ranks
//! killed (SIGKILL, so no destructor runs) at spread-out moments of startup
//! may leave ring files behind, and the next job on the host removes every
//! one whose creator is gone. The second test does the same through
//! `chorus-run`, stopped by SIGTERM (which it forwards to the ranks).
//!
//! The test binary re-executes itself as the ranks: the ignored test
//! `worker` is the rank's body, selected by `CHORUS_TEST_WORKER`. The kill
//! times are fault injection, not synchronisation: each round waits for
//! both ranks to exit (or kills them), and the final job is checked by its
//! output. Every child is killed if the test fails or runs past its deadline.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use chorus::{new_comm, CommOptions, Device, ReduceOp, Tensor};

const DEADLINE: Duration = Duration::from_secs(60);
const SHM_DIR: &str = "/dev/shm";

fn free_port() -> u16 {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind udp");
    s.local_addr().expect("addr").port()
}

/// Ranks of one job, killed and reaped on drop.
struct Job(Vec<Child>);

impl Drop for Job {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn spawn_job(n: usize) -> Job {
    let port = free_port();
    let exe = std::env::current_exe().expect("current exe");
    let children = (0..n)
        .map(|rank| {
            Command::new(&exe)
                .args(["--ignored", "--exact", "worker", "--nocapture"])
                .env("CHORUS_TEST_WORKER", "1")
                .env("RANK", rank.to_string())
                .env("WORLD_SIZE", n.to_string())
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("CHORUS_SECRET", "shm-files")
                .env_remove("CHORUS_SHM")
                .env_remove("CHORUS_RANK")
                .env_remove("CHORUS_SIZE")
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn rank")
        })
        .collect();
    Job(children)
}

/// Ring files in `/dev/shm` created by any of `pids`.
fn ring_files_of(pids: &[u32]) -> Vec<String> {
    all_ring_files()
        .into_iter()
        .filter(|(_, pid)| pids.contains(pid))
        .map(|(name, _)| name)
        .collect()
}

/// The body of one rank process (run by the test below, not on its own).
#[test]
#[ignore = "rank body for the shm file test; run by it"]
fn worker() {
    if std::env::var("CHORUS_TEST_WORKER").is_err() {
        return;
    }
    let opts = CommOptions::default()
        .with_timeout(Duration::from_secs(20))
        .with_connect_timeout(Duration::from_secs(20));
    let comm = new_comm("cpu", Device::Cpu, "world", opts).expect("new_comm");
    let out = comm
        .all_reduce(Tensor::full(1.0f32, 256), ReduceOp::Sum)
        .expect("all_reduce");
    assert!(out
        .as_slice::<f32>()
        .iter()
        .all(|&v| v == comm.size() as f32));
    comm.finalize().expect("finalize");
    println!("@@ok");
}

#[test]
fn ring_files_of_killed_jobs_are_removed_by_the_next_job() {
    if !std::path::Path::new(SHM_DIR).is_dir() {
        eprintln!("no {SHM_DIR}: shared-memory links are never used here");
        return;
    }
    let start = Instant::now();
    const ROUNDS: u64 = 30;
    let mut killed: Vec<u32> = Vec::new();
    for i in 0..ROUNDS {
        let mut job = spawn_job(2);
        killed.extend(job.0.iter().map(Child::id));
        // Kill both ranks the moment one of their ring files shows up (or,
        // in every other round, at once), so kills land in the window where
        // a rank holds a ring file it has not unlinked yet.
        let pids: Vec<u32> = job.0.iter().map(Child::id).collect();
        let round_end = Instant::now() + Duration::from_secs(5);
        while i % 2 == 0 && ring_files_of(&pids).is_empty() && Instant::now() < round_end {
            if job
                .0
                .iter_mut()
                .any(|c| c.try_wait().ok().flatten().is_some())
            {
                break;
            }
        }
        for c in &mut job.0 {
            let _ = c.kill();
        }
        for c in &mut job.0 {
            let _ = c.wait();
        }
        assert!(start.elapsed() < DEADLINE, "kill rounds took too long");
    }
    let leaked = ring_files_of(&killed);
    eprintln!("ring files left by {ROUNDS} killed jobs: {}", leaked.len());

    // A job that runs to completion sweeps what the killed ones left.
    let mut job = spawn_job(2);
    for (r, c) in job.0.iter_mut().enumerate() {
        let out = c.stdout.take().expect("stdout");
        // Read to the end: closing the pipe early would fail the rank.
        let lines: Vec<String> = BufReader::new(out).lines().map_while(Result::ok).collect();
        let ok = lines.iter().any(|l| l.contains("@@ok"));
        assert!(ok, "rank {r} of the final job did not finish");
    }
    for (r, c) in job.0.iter_mut().enumerate() {
        assert!(c.wait().expect("wait").success(), "rank {r}");
    }
    let final_pids: Vec<u32> = job.0.iter().map(Child::id).collect();
    assert_eq!(
        ring_files_of(&killed),
        Vec::<String>::new(),
        "stale ring files"
    );
    assert_eq!(
        ring_files_of(&final_pids),
        Vec::<String>::new(),
        "final job's files"
    );
    assert!(start.elapsed() < DEADLINE);
}

/// All ring files in `/dev/shm` (`chorus-<tag>-<pid>-<peer>-<me>`), with
/// their creator pids.
fn all_ring_files() -> Vec<(String, u32)> {
    let Ok(entries) = std::fs::read_dir(SHM_DIR) else {
        return Vec::new();
    };
    entries
        .flatten()
        .filter_map(|e| e.file_name().into_string().ok())
        .filter_map(|name| {
            let parts: Vec<&str> = name.split('-').collect();
            let pid = (parts.len() == 5 && parts[0] == "chorus")
                .then(|| parts[2].parse::<u32>().ok())
                .flatten()?;
            Some((name, pid))
        })
        .collect()
}

/// `chorus-run` running the worker on `n` ranks.
fn chorus_run(n: usize) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_chorus-run"));
    cmd.args([
        "-n",
        &n.to_string(),
        "--timeout",
        "30",
        "--grace",
        "5",
        "--",
    ])
    .arg(std::env::current_exe().expect("current exe"))
    .args(["--ignored", "--exact", "worker", "--nocapture"])
    .env("CHORUS_TEST_WORKER", "1")
    .env_remove("CHORUS_SHM")
    .stdin(Stdio::null())
    .stdout(Stdio::null())
    .stderr(Stdio::null());
    cmd
}

#[test]
fn sigterm_to_chorus_run_during_startup_leaks_no_ring_files() {
    if !std::path::Path::new(SHM_DIR).is_dir() {
        eprintln!("no {SHM_DIR}: shared-memory links are never used here");
        return;
    }
    let start = Instant::now();
    let mut seen: Vec<(String, u32)> = Vec::new();
    for i in 0..30 {
        let mut run = Job(vec![chorus_run(2).spawn().expect("spawn chorus-run")]);
        let before = all_ring_files();
        let round_end = Instant::now() + Duration::from_secs(5);
        // Every other round: SIGTERM the moment a new ring file shows up.
        while i % 2 == 0 && Instant::now() < round_end {
            let now = all_ring_files();
            let new: Vec<_> = now.into_iter().filter(|f| !before.contains(f)).collect();
            if !new.is_empty() {
                seen.extend(new);
                break;
            }
            if run.0[0].try_wait().ok().flatten().is_some() {
                break;
            }
        }
        // SAFETY: kill(2) with a pid we own (our live or unreaped child).
        unsafe {
            libc::kill(run.0[0].id() as i32, libc::SIGTERM);
        }
        let _ = run.0[0].wait();
        assert!(start.elapsed() < DEADLINE, "kill rounds took too long");
    }
    // Creators that are gone now; their files must be swept by a full run.
    let dead: Vec<(String, u32)> = seen
        .into_iter()
        // SAFETY: signal 0 only checks for existence.
        .filter(|(_, pid)| unsafe { libc::kill(*pid as i32, 0) } == -1)
        .collect();
    let ok = chorus_run(2).status().expect("final chorus-run");
    assert!(ok.success(), "final job failed: {ok:?}");
    let left: Vec<String> = all_ring_files()
        .into_iter()
        .filter(|f| dead.contains(f))
        .map(|(n, _)| n)
        .collect();
    assert_eq!(left, Vec::<String>::new(), "stale ring files");
    assert!(start.elapsed() < DEADLINE);
}
