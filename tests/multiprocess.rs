//! Ranks as separate OS processes, bootstrapped torchrun-style through the
//! QUIC store hosted by rank 0 (MASTER_ADDR/MASTER_PORT on loopback).
//!
//! The test binary re-executes itself as the ranks: the ignored test
//! `worker` is the rank's body, selected by `CHORUS_TEST_WORKER`. Every
//! child is killed if the test fails or runs past its deadline.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use chorus::{new_comm, CommOptions, Device, Error, ReduceOp, Tensor};

const DEADLINE: Duration = Duration::from_secs(60);

fn free_port() -> u16 {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind udp");
    s.local_addr().expect("addr").port()
}

struct Ranks {
    children: Vec<Child>,
    lines: mpsc::Receiver<(usize, String)>,
}

impl Drop for Ranks {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn spawn_ranks(
    n: usize,
    mode: &str,
    connect_secs: u64,
    secret_of: impl Fn(usize) -> String,
) -> Ranks {
    let port = free_port();
    let exe = std::env::current_exe().expect("current exe");
    let (tx, lines) = mpsc::channel();
    let mut children = Vec::new();
    for rank in 0..n {
        let mut child = Command::new(&exe)
            .args([
                "--ignored",
                "--exact",
                "worker",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("CHORUS_TEST_WORKER", mode)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", n.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("CHORUS_SECRET", secret_of(rank))
            .env("CHORUS_TEST_CONNECT_SECS", connect_secs.to_string())
            .env_remove("CHORUS_RANK")
            .env_remove("CHORUS_SIZE")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn rank");
        let out = child.stdout.take().expect("stdout");
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if tx.send((rank, line)).is_err() {
                    break;
                }
            }
        });
        children.push(child);
    }
    Ranks { children, lines }
}

impl Ranks {
    /// Wait until each rank in `ranks` printed a line starting with `what`
    /// (ranks mark their lines with `@@`, apart from the test harness's own output).
    fn wait_lines(&self, ranks: &[usize], what: &str, deadline: Instant) -> Vec<String> {
        let mut seen: Vec<Option<String>> = vec![None; self.children.len()];
        while ranks.iter().any(|&r| seen[r].is_none()) {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.lines.recv_timeout(left) {
                Ok((r, line)) => {
                    // libtest may print "test worker ... " before our marker.
                    if let Some(at) = line.find("@@") {
                        if line[at..].starts_with(what) {
                            seen[r].get_or_insert(line[at..].to_string());
                        }
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

    fn wait_exit(&mut self, rank: usize, deadline: Instant) -> std::process::ExitStatus {
        loop {
            if let Some(st) = self.children[rank].try_wait().expect("try_wait") {
                return st;
            }
            if Instant::now() > deadline {
                panic!("rank {rank} did not exit in time");
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

/// The body of one rank process (run by the tests below, not on its own).
#[test]
#[ignore = "rank body for the multi-process tests; run by them"]
fn worker() {
    let Ok(mode) = std::env::var("CHORUS_TEST_WORKER") else {
        return;
    };
    let connect_secs = std::env::var("CHORUS_TEST_CONNECT_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(20);
    let opts = CommOptions::default()
        .with_timeout(Duration::from_secs(20))
        .with_connect_timeout(Duration::from_secs(connect_secs));
    let comm = match new_comm("cpu", Device::Cpu, "world", opts) {
        Ok(c) => c,
        Err(e) => {
            println!("@@new_comm-error: {e}");
            if let Error::Transport(t) = &e {
                println!("@@transport-error: {t:?}");
            }
            std::process::exit(3);
        }
    };
    let n = comm.size();
    match mode.as_str() {
        "all_reduce" => {
            let t = Tensor::full(comm.rank() as f32 + 1.0, 1024);
            let out = comm.all_reduce(t, ReduceOp::Sum).expect("all_reduce");
            let want = (n * (n + 1) / 2) as f32;
            assert!(out.as_slice::<f32>().iter().all(|&v| v == want));
            let g = comm
                .all_gather(Tensor::full(comm.rank() as i64, 3))
                .expect("all_gather");
            assert_eq!(g.len(), 3 * n);
            comm.finalize().expect("finalize");
            println!("@@ok {}", out.as_slice::<f32>()[0]);
        }
        "loop_until_error" => {
            let mut k = 0u64;
            loop {
                match comm.all_reduce(Tensor::full(1.0f32, 4096), ReduceOp::Sum) {
                    Ok(t) => {
                        assert!(
                            t.as_slice::<f32>().iter().all(|&v| v == n as f32),
                            "corrupt data"
                        );
                        if k < 3 {
                            println!("@@iter {k}");
                        }
                        k += 1;
                    }
                    Err(e) => {
                        let kind = match e {
                            Error::PeerFailed { .. } => "PeerFailed",
                            Error::Aborted { .. } => "Aborted",
                            Error::Timeout { .. } => "Timeout",
                            _ => "Other",
                        };
                        println!("@@error-kind: {kind} {e}");
                        // The process stays alive after the failure: a new op is
                        // refused with a typed error, not a crash.
                        let again = comm.barrier().unwrap_err();
                        println!("@@after: {}", again.is_fatal());
                        std::process::exit(if kind == "Other" { 4 } else { 0 });
                    }
                }
            }
        }
        other => panic!("unknown worker mode {other}"),
    }
}

#[test]
fn four_processes_all_reduce_through_quic_store() {
    let deadline = Instant::now() + DEADLINE;
    let mut ranks = spawn_ranks(4, "all_reduce", 20, |_| "s3cret".into());
    let lines = ranks.wait_lines(&[0, 1, 2, 3], "@@ok", deadline);
    assert!(lines.iter().all(|l| l == "@@ok 10"), "{lines:?}");
    for r in 0..4 {
        assert!(ranks.wait_exit(r, deadline).success(), "rank {r}");
    }
}

#[test]
fn peer_killed_mid_all_reduce_errors_every_survivor_within_timeout() {
    let deadline = Instant::now() + DEADLINE;
    let mut ranks = spawn_ranks(3, "loop_until_error", 20, |_| "s3cret".into());
    ranks.wait_lines(&[0, 1, 2], "@@iter 2", deadline);
    let killed_at = Instant::now();
    ranks.children[2].kill().expect("kill -9 rank 2");
    let errs = ranks.wait_lines(&[0, 1], "@@error-kind:", deadline);
    for e in &errs {
        assert!(
            e.starts_with("@@error-kind: PeerFailed") || e.starts_with("@@error-kind: Aborted"),
            "{e}"
        );
    }
    // Detected from the broken links, well inside the 20 s op timeout.
    assert!(
        killed_at.elapsed() < Duration::from_secs(15),
        "{:?}",
        killed_at.elapsed()
    );
    for r in 0..2 {
        assert!(
            ranks.wait_exit(r, deadline).success(),
            "survivor {r} stays alive and exits cleanly"
        );
    }
}

#[test]
fn rank_with_wrong_secret_is_refused() {
    let deadline = Instant::now() + DEADLINE;
    let mut ranks = spawn_ranks(2, "all_reduce", 4, |r| {
        if r == 1 {
            "bad".into()
        } else {
            "good".into()
        }
    });
    let lines = ranks.wait_lines(&[1], "@@transport-error:", deadline);
    assert!(lines[0].contains("AuthFailed"), "{lines:?}");
    assert!(!ranks.wait_exit(1, deadline).success());
    // Rank 0 gives up (its peer never arrives) within its connect timeout.
    assert!(!ranks.wait_exit(0, deadline).success());
}
