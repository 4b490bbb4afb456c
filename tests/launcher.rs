//! Tests of the `chorus-run` launcher, driving the real binary with `sh -c`
//! ranks. Every run is bounded twice: `--timeout` inside chorus-run, and a
//! wall-clock bound in [`run`] so a broken launcher fails the test instead of
//! hanging CI. Nothing synchronises by sleeping: a test that needs a rank to
//! be running waits for the line that rank prints.

use std::io::{BufRead, BufReader};
use std::process::{Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

const BIN: &str = env!("CARGO_BIN_EXE_chorus-run");
/// Upper bound on any single launcher run in these tests.
const BOUND: Duration = Duration::from_secs(60);

struct Run {
    code: Option<i32>,
    stdout: String,
    stderr: String,
    elapsed: Duration,
}

/// Run chorus-run with `args`, extra `env`, and `remove` taken out of its
/// environment; panic if it does not finish within [`BOUND`].
fn run_env(args: &[&str], env: &[(&str, &str)], remove: &[&str]) -> Run {
    let mut cmd = Command::new(BIN);
    cmd.args(args).stdin(Stdio::null());
    for (k, v) in env {
        cmd.env(k, v);
    }
    for k in remove {
        cmd.env_remove(k);
    }
    let start = Instant::now();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(cmd.output());
    });
    let out: Output = rx
        .recv_timeout(BOUND)
        .unwrap_or_else(|_| panic!("chorus-run {args:?} did not finish within {BOUND:?}"))
        .expect("chorus-run could not be started");
    Run {
        code: out.status.code(),
        stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
        elapsed: start.elapsed(),
    }
}

fn run(args: &[&str]) -> Run {
    run_env(args, &[], &[])
}

/// Lines of `text` that rank `r` wrote, without the prefix.
fn rank_lines(text: &str, r: usize) -> Vec<String> {
    let prefix = format!("[rank {r}] ");
    text.lines()
        .filter_map(|l| l.strip_prefix(&prefix).map(str::to_string))
        .collect()
}

#[test]
fn every_rank_gets_rank_world_size_and_rendezvous_env() {
    let r = run(&[
        "-n",
        "3",
        "--timeout",
        "30",
        "--",
        "sh",
        "-c",
        "echo \"$RANK $WORLD_SIZE $LOCAL_RANK $LOCAL_WORLD_SIZE $MASTER_ADDR $MASTER_PORT $CHORUS_SECRET\"",
    ]);
    assert_eq!(r.code, Some(0), "stderr: {}", r.stderr);
    let mut ports = Vec::new();
    let mut secrets = Vec::new();
    for rank in 0..3 {
        let lines = rank_lines(&r.stdout, rank);
        assert_eq!(lines.len(), 1, "rank {rank} output: {}", r.stdout);
        let f: Vec<&str> = lines[0].split(' ').collect();
        assert_eq!(f.len(), 7, "{lines:?}");
        let rs = rank.to_string();
        assert_eq!(&f[..5], &[rs.as_str(), "3", rs.as_str(), "3", "127.0.0.1"]);
        let port: u16 = f[5].parse().expect("MASTER_PORT is a port number");
        assert_ne!(port, 0);
        ports.push(port);
        assert_eq!(
            f[6].len(),
            64,
            "CHORUS_SECRET is 32 bytes in hex: {:?}",
            f[6]
        );
        assert!(f[6].bytes().all(|b| b.is_ascii_hexdigit()));
        secrets.push(f[6].to_string());
    }
    assert!(ports.windows(2).all(|w| w[0] == w[1]), "{ports:?}");
    assert!(secrets.windows(2).all(|w| w[0] == w[1]), "{secrets:?}");
}

#[test]
fn fresh_secret_per_job_unless_chorus_secret_is_set() {
    let print = [
        "-n",
        "1",
        "--timeout",
        "30",
        "--",
        "sh",
        "-c",
        "echo $CHORUS_SECRET",
    ];
    let a = run_env(&print, &[], &["CHORUS_SECRET"]);
    let b = run_env(&print, &[], &["CHORUS_SECRET"]);
    assert_eq!((a.code, b.code), (Some(0), Some(0)));
    assert_ne!(rank_lines(&a.stdout, 0), rank_lines(&b.stdout, 0));
    let c = run_env(&print, &[("CHORUS_SECRET", "s3cret")], &[]);
    assert_eq!(rank_lines(&c.stdout, 0), vec!["s3cret"]);
}

#[test]
fn explicit_master_port_is_passed_through() {
    let r = run(&[
        "-n",
        "2",
        "--master-port",
        "29555",
        "--timeout",
        "30",
        "--",
        "sh",
        "-c",
        "echo $MASTER_PORT",
    ]);
    assert_eq!(r.code, Some(0));
    for rank in 0..2 {
        assert_eq!(rank_lines(&r.stdout, rank), vec!["29555"]);
    }
}

#[test]
fn the_launcher_hosts_the_store_unless_told_otherwise() {
    let echo = "echo ${CHORUS_STORE_ADDR:-unset} $MASTER_PORT";
    let plain = ["CHORUS_STORE_ADDR", "CHORUS_STORE"];
    // Default: every rank gets the store chorus-run hosts, on MASTER_PORT.
    let r = run_env(
        &["-n", "2", "--timeout", "30", "--", "sh", "-c", echo],
        &[],
        &plain,
    );
    assert_eq!(r.code, Some(0), "stderr: {}", r.stderr);
    for rank in 0..2 {
        let lines = rank_lines(&r.stdout, rank);
        let f: Vec<&str> = lines[0].split(' ').collect();
        assert_eq!(f[0], format!("127.0.0.1:{}", f[1]), "{lines:?}");
    }
    // --store-on-rank0: rank 0 hosts it on MASTER_PORT; an inherited
    // address is not passed on.
    let r = run_env(
        &[
            "-n",
            "2",
            "--store-on-rank0",
            "--timeout",
            "30",
            "--",
            "sh",
            "-c",
            echo,
        ],
        &[],
        &["CHORUS_STORE"],
    );
    assert_eq!(r.code, Some(0), "stderr: {}", r.stderr);
    for rank in 0..2 {
        assert!(rank_lines(&r.stdout, rank)[0].starts_with("unset "));
    }
    // A store named in the environment is passed through untouched.
    let r = run_env(
        &["-n", "1", "--timeout", "30", "--", "sh", "-c", echo],
        &[("CHORUS_STORE_ADDR", "10.1.2.3:29500")],
        &["CHORUS_STORE"],
    );
    assert_eq!(r.code, Some(0), "stderr: {}", r.stderr);
    assert!(rank_lines(&r.stdout, 0)[0].starts_with("10.1.2.3:29500 "));
}

#[test]
fn launcher_vars_that_bootstrap_prefers_are_removed_from_ranks() {
    let r = run_env(
        &[
            "-n",
            "1",
            "--timeout",
            "30",
            "--",
            "sh",
            "-c",
            "echo ${CHORUS_RANK:-unset} ${PMI_RANK:-unset} ${OMPI_COMM_WORLD_SIZE:-unset}",
        ],
        &[
            ("CHORUS_RANK", "7"),
            ("PMI_RANK", "7"),
            ("OMPI_COMM_WORLD_SIZE", "9"),
        ],
        &[],
    );
    assert_eq!(r.code, Some(0));
    assert_eq!(rank_lines(&r.stdout, 0), vec!["unset unset unset"]);
}

#[test]
fn every_output_line_is_prefixed_with_its_rank_on_the_same_stream() {
    let r = run(&[
        "-n",
        "2",
        "--timeout",
        "30",
        "--",
        "sh",
        "-c",
        "echo out1; echo err1 >&2; echo out2; printf 'no newline'",
    ]);
    assert_eq!(r.code, Some(0), "stderr: {}", r.stderr);
    for rank in 0..2 {
        assert_eq!(
            rank_lines(&r.stdout, rank),
            vec!["out1", "out2", "no newline"]
        );
        assert_eq!(rank_lines(&r.stderr, rank), vec!["err1"]);
    }
    assert!(
        r.stdout.lines().all(|l| l.starts_with("[rank ")),
        "unprefixed stdout line: {}",
        r.stdout
    );
    assert!(
        r.stderr.lines().all(|l| l.starts_with("[rank ")),
        "unprefixed stderr line: {}",
        r.stderr
    );
}

#[test]
fn all_ranks_succeeding_exits_zero() {
    let r = run(&["-n", "4", "--timeout", "30", "true"]);
    assert_eq!(r.code, Some(0), "stderr: {}", r.stderr);
}

#[test]
fn failing_rank_exits_with_its_code_and_kills_sleeping_rank_promptly() {
    let r = run(&[
        "-n",
        "3",
        "--timeout",
        "50",
        "--",
        "sh",
        "-c",
        "if [ \"$RANK\" = 1 ]; then exit 3; fi; sleep 60",
    ]);
    assert_eq!(r.code, Some(3), "stderr: {}", r.stderr);
    assert!(
        r.stderr.contains("rank 1 exited with code 3"),
        "{}",
        r.stderr
    );
    assert!(
        r.elapsed < Duration::from_secs(20),
        "the sleeping ranks were not stopped promptly: {:?}",
        r.elapsed
    );
}

#[test]
fn rank_that_ignores_sigterm_is_killed_after_the_grace_period() {
    // Rank 1 fails only once rank 0 has installed its SIGTERM trap (a marker
    // file), so the launcher's SIGTERM always meets a rank that ignores it.
    let marker = std::env::temp_dir().join(format!("chorus-trap-{}", std::process::id()));
    let _ = std::fs::remove_file(&marker);
    let script = format!(
        "m='{}'; if [ \"$RANK\" = 1 ]; then while [ ! -e \"$m\" ]; do sleep 0.01; done; exit 5; fi; \
         trap '' TERM; touch \"$m\"; while :; do sleep 1; done",
        marker.display()
    );
    let r = run(&[
        "-n",
        "2",
        "--timeout",
        "50",
        "--grace",
        "0.5",
        "--",
        "sh",
        "-c",
        &script,
    ]);
    let _ = std::fs::remove_file(&marker);
    assert_eq!(r.code, Some(5), "stderr: {}", r.stderr);
    assert!(r.stderr.contains("SIGKILL"), "{}", r.stderr);
    assert!(r.elapsed < Duration::from_secs(20), "{:?}", r.elapsed);
}

#[test]
fn rank_killed_by_a_signal_exits_128_plus_signal() {
    let r = run(&["-n", "2", "--timeout", "30", "--", "sh", "-c", "kill -9 $$"]);
    assert_eq!(r.code, Some(128 + 9), "stderr: {}", r.stderr);
}

#[test]
fn timeout_stops_every_rank_and_exits_124() {
    let r = run(&["-n", "2", "--timeout", "1", "--", "sleep", "60"]);
    assert_eq!(r.code, Some(124), "stderr: {}", r.stderr);
    assert!(r.stderr.contains("timeout"), "{}", r.stderr);
    assert!(r.elapsed < Duration::from_secs(20), "{:?}", r.elapsed);
}

#[test]
fn sigterm_to_the_launcher_stops_the_ranks_and_exits_143() {
    let mut child = Command::new(BIN)
        .args([
            "-n",
            "2",
            "--timeout",
            "50",
            "--",
            "sh",
            "-c",
            "echo ready; sleep 60",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("chorus-run starts");
    let start = Instant::now();
    let stdout = child.stdout.take().expect("piped stdout");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut ready = 0;
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.ends_with("] ready") {
                ready += 1;
                if ready == 2 {
                    let _ = tx.send(());
                }
            }
        }
    });
    rx.recv_timeout(BOUND)
        .expect("both ranks print 'ready' within the bound");
    // The shell's kill builtin: no dependency on a kill binary being installed.
    let kill = Command::new("sh")
        .args(["-c", &format!("kill -TERM {}", child.id())])
        .status()
        .expect("kill runs");
    assert!(kill.success());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    let status = rx
        .recv_timeout(BOUND)
        .expect("chorus-run exits after SIGTERM")
        .expect("wait succeeds");
    assert_eq!(status.code(), Some(128 + 15));
    assert!(
        start.elapsed() < Duration::from_secs(20),
        "{:?}",
        start.elapsed()
    );
}

#[test]
fn zero_ranks_is_a_usage_error() {
    let r = run(&["-n", "0", "true"]);
    assert_eq!(r.code, Some(2));
    assert!(r.stderr.contains("--nproc"), "{}", r.stderr);
}

#[test]
fn missing_program_is_a_usage_error() {
    let r = run(&["-n", "2"]);
    assert_eq!(r.code, Some(2));
    assert!(r.stderr.contains("PROGRAM"), "{}", r.stderr);
}

#[test]
fn program_that_cannot_start_exits_127_with_a_message() {
    let r = run(&[
        "-n",
        "2",
        "--timeout",
        "30",
        "/nonexistent/chorus-test-program",
    ]);
    assert_eq!(r.code, Some(127));
    assert!(r.stderr.contains("cannot start rank 0"), "{}", r.stderr);
}

// ------------------------------------------------------------------ examples
//
// The examples end to end: chorus-run starts the ranks, which rendezvous over
// the QUIC store and run their collectives on the cpu backend; each example
// checks its own results and exits non-zero otherwise.

/// The example binary `name`, next to chorus-run in the target directory, or
/// `None` when it was not built (e.g. `cargo test --test launcher`; the test
/// command `./scripts/test.sh` builds every target).
fn example(name: &str) -> Option<String> {
    let dir = std::path::Path::new(BIN).parent()?.join("examples");
    let path = dir.join(name);
    if path.is_file() {
        Some(path.to_string_lossy().into_owned())
    } else {
        eprintln!(
            "skipped: example {name} is not built in {}; run with --all-targets",
            dir.display()
        );
        None
    }
}

fn run_example_on(name: &str, ranks: &[usize]) {
    let Some(path) = example(name) else { return };
    for &n in ranks {
        let n_s = n.to_string();
        let r = run_env(
            &["-n", &n_s, "--timeout", "60", "--", &path],
            &[("CHORUS_BACKEND", "cpu")],
            &["CHORUS_STORE_ADDR", "CHORUS_DEVICE"],
        );
        assert_eq!(
            r.code,
            Some(0),
            "{name} on {n} ranks failed\nstdout:\n{}\nstderr:\n{}",
            r.stdout,
            r.stderr
        );
        for rank in 0..n {
            let lines = rank_lines(&r.stdout, rank);
            let want = format!("rank {rank}/{n}: ");
            assert!(
                lines.len() == 1 && lines[0].starts_with(&want) && lines[0].contains("ok"),
                "{name} on {n} ranks: rank {rank} printed {lines:?}"
            );
        }
    }
}

#[test]
fn example_all_reduce_passes_on_1_to_4_ranks() {
    run_example_on("all_reduce", &[1, 2, 3, 4]);
}

#[test]
fn example_async_all_reduce_passes_on_1_2_and_4_ranks() {
    run_example_on("async_all_reduce", &[1, 2, 4]);
}

#[test]
fn example_send_recv_passes_on_2_to_4_ranks() {
    run_example_on("send_recv", &[2, 3, 4]);
}

#[test]
fn example_kv_transfer_passes_on_2_and_3_ranks() {
    run_example_on("kv_transfer", &[2, 3]);
}

#[test]
fn example_window_signal_latency_passes_on_2_and_3_ranks() {
    run_example_on("window_signal_latency", &[2, 3]);
}

#[test]
fn example_hierarchical_all_reduce_passes_on_1_2_and_4_ranks() {
    run_example_on("hierarchical_all_reduce", &[1, 2, 4]);
}

#[test]
fn example_with_an_unknown_backend_fails_every_rank_with_the_backend_list() {
    let Some(path) = example("all_reduce") else {
        return;
    };
    let r = run_env(
        &["-n", "2", "--timeout", "60", "--", &path],
        &[("CHORUS_BACKEND", "no-such-backend")],
        &[],
    );
    assert_eq!(r.code, Some(1), "stderr: {}", r.stderr);
    assert!(
        r.stderr.contains("unknown backend") && r.stderr.contains("\"cpu\""),
        "{}",
        r.stderr
    );
}

/// all_to_all across simulated hosts, end to end: four processes under
/// chorus-run, rank `r` on host `h(r / 2)` (so each pair of ranks shares
/// memory and the two hosts talk TCP), which the `cpu` backend runs on
/// rails; chorus-perf's correctness check passes for both forms (the list
/// form through `all_to_all_into` and the allocating one) at every size.
#[test]
fn all_to_all_across_simulated_hosts_passes_chorus_perfs_checks() {
    let perf = env!("CARGO_BIN_EXE_chorus-perf");
    for op in ["all_to_all_single", "all_to_all"] {
        let script = format!(
            "CHORUS_HOST_ID=h$((CHORUS_RANK / 2)) exec {perf} {op} -b 8 -e 64K -f 16 -w 1 -i 3"
        );
        let r = run_env(
            &["-n", "4", "--timeout", "60", "--", "sh", "-c", &script],
            &[],
            &["CHORUS_STORE_ADDR", "CHORUS_SHM", "CHORUS_HIER"],
        );
        assert_eq!(
            r.code,
            Some(0),
            "{op} failed\nstdout:\n{}\nstderr:\n{}",
            r.stdout,
            r.stderr
        );
        let rows: Vec<String> = rank_lines(&r.stdout, 0)
            .into_iter()
            .filter(|l| !l.trim_start().starts_with('#'))
            .collect();
        assert!(
            rows.len() >= 3 && rows.iter().all(|l| l.trim_end().ends_with("ok")),
            "{op}: rank 0 printed {rows:?}"
        );
    }
}
