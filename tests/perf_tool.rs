//! `chorus-perf` end to end, tiny and bounded: 2 local ranks, sizes 8 B..4 KiB,
//! every op, both APIs, table and `--json` output, correctness check on, and
//! the time-based defaults.

use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_chorus-perf");
/// Upper bound on one chorus-perf run here.
const BOUND: Duration = Duration::from_secs(60);

const OPS: [&str; 11] = [
    "all_reduce",
    "all_gather",
    "broadcast",
    "reduce_scatter",
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "send_recv",
    "ping_pong",
];

/// Run chorus-perf with `args` (bounded in time): (success, stdout, stderr).
fn run(args: &[&str]) -> (bool, String, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .args(["--timeout", "50"])
        .stdin(Stdio::null());
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(cmd.output());
    });
    let out = rx
        .recv_timeout(BOUND)
        .unwrap_or_else(|_| panic!("chorus-perf {args:?} did not finish within {BOUND:?}"))
        .expect("chorus-perf could not be started");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// 2 ranks, 8 B..4 KiB (4 sizes), 1 warm-up and 3 timed ops.
fn perf(args: &[&str]) -> (bool, String, String) {
    let mut all = args.to_vec();
    all.extend([
        "-b", "8", "-e", "4K", "-f", "8", "-n", "2", "-w", "1", "-i", "3",
    ]);
    run(&all)
}

fn assert_checked_rows(op: &str, ok: bool, out: &str, err: &str) {
    assert!(ok, "{op}: chorus-perf failed\n{out}\n{err}");
    let rows: Vec<&str> = out.lines().filter(|l| !l.starts_with('#')).collect();
    // 8, 64, 512, 4096 bytes.
    assert_eq!(rows.len(), 4, "{op}:\n{out}");
    assert!(
        rows.iter().all(|r| r.trim_end().ends_with("ok")),
        "{op}:\n{out}"
    );
}

#[test]
fn chorus_perf_prints_checked_rows_for_every_op_on_2_ranks() {
    for op in OPS {
        let (ok, out, err) = perf(&[op]);
        assert_checked_rows(op, ok, &out, &err);
    }
}

#[test]
fn chorus_perf_async_api_prints_checked_rows_on_2_ranks() {
    for op in ["all_reduce", "reduce_scatter", "all_to_all", "ping_pong"] {
        let (ok, out, err) = perf(&[op, "--async"]);
        assert_checked_rows(op, ok, &out, &err);
        assert!(out.contains("api=async"), "{op}:\n{out}");
    }
    let (ok, out, err) = perf(&["all_reduce", "--async", "--own-runtime"]);
    assert_checked_rows("all_reduce --own-runtime", ok, &out, &err);
    assert!(out.contains("api=async(own-runtime)"), "{out}");
}

#[test]
fn chorus_perf_checks_rooted_and_all_to_all_ops_on_3_ranks() {
    for op in [
        "reduce",
        "gather",
        "scatter",
        "all_to_all",
        "all_to_all_single",
    ] {
        let (ok, out, err) = run(&[
            op,
            "-b",
            "24",
            "-e",
            "1536",
            "-f",
            "8",
            "-n",
            "3",
            "-w",
            "1",
            "-i",
            "3",
            "--in-place-only",
        ]);
        assert!(ok, "{op}: chorus-perf failed\n{out}\n{err}");
        let rows: Vec<&str> = out.lines().filter(|l| !l.starts_with('#')).collect();
        assert_eq!(rows.len(), 3, "{op}:\n{out}");
        assert!(
            rows.iter().all(|r| r.trim_end().ends_with("ok")),
            "{op}:\n{out}"
        );
    }
}

#[test]
fn chorus_perf_json_has_one_object_per_size_with_busbw() {
    let (ok, out, err) = perf(&["all_reduce", "--json"]);
    assert!(ok, "chorus-perf failed\n{out}\n{err}");
    let lines: Vec<&str> = out.lines().collect();
    assert_eq!(lines.len(), 4, "{out}");
    for l in lines {
        assert!(l.starts_with('{') && l.ends_with('}'), "{l}");
        assert!(
            l.contains("\"busbw_gbs\"") && l.contains("\"check\":true"),
            "{l}"
        );
        // -i 3 times exactly 3 ops in each mode.
        assert_eq!(l.matches("\"ops\":3}").count(), 2, "{l}");
    }
}

/// The number after `"ops":` in the `in_place` object of a JSON row.
fn in_place_ops(line: &str) -> usize {
    let ip = &line[line.find("\"in_place\"").expect("in_place object")..];
    let at = ip.find("\"ops\":").expect("ops field") + "\"ops\":".len();
    ip[at..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .expect("ops is a number")
}

#[test]
fn chorus_perf_default_run_times_at_least_1000_ops() {
    let (ok, out, err) = run(&[
        "all_reduce",
        "-b",
        "8",
        "-e",
        "8",
        "-n",
        "2",
        "--in-place-only",
        "--json",
    ]);
    assert!(ok, "chorus-perf failed\n{out}\n{err}");
    let line = out.lines().next().expect("one row");
    assert!(line.contains("\"check\":true"), "{line}");
    assert!(in_place_ops(line) >= 1000, "{line}");
}

/// nccl-tests' bus-bandwidth factor of `op` on `n` ranks, as
/// docs/performance.md states it.
fn documented_bus_factor(op: &str, n: f64) -> f64 {
    match op {
        "all_reduce" => 2.0 * (n - 1.0) / n,
        "all_gather" | "reduce_scatter" | "gather" | "scatter" | "all_to_all"
        | "all_to_all_single" => (n - 1.0) / n,
        "broadcast" | "reduce" | "send_recv" | "ping_pong" => 1.0,
        other => panic!("no documented factor for {other}"),
    }
}

#[test]
fn chorus_perf_json_of_every_op_parses_with_the_documented_bandwidths() {
    for op in OPS {
        // 64 KiB: large enough that algbw has significant digits in the
        // 4 decimals printed.
        let (ok, out, err) = run(&[
            op,
            "-b",
            "64K",
            "-e",
            "64K",
            "-n",
            "2",
            "-w",
            "1",
            "-i",
            "3",
            "--in-place-only",
            "--json",
        ]);
        assert!(ok, "{op}: chorus-perf failed\n{out}\n{err}");
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 1, "{op}:\n{out}");
        let v: serde_json::Value = serde_json::from_str(lines[0])
            .unwrap_or_else(|e| panic!("{op}: not JSON ({e}): {}", lines[0]));
        assert_eq!(v["op"], op, "{v}");
        assert_eq!(v["nranks"], 2, "{v}");
        assert_eq!(v["size"], 64 << 10, "{v}");
        assert_eq!(v["check"], true, "{v}");
        assert!(v["out_of_place"].is_null(), "{v}");
        let ip = &v["in_place"];
        assert_eq!(ip["ops"], 3, "{v}");
        let num = |k: &str| {
            ip[k]
                .as_f64()
                .unwrap_or_else(|| panic!("{op}: {k} is not a number: {v}"))
        };
        let (us, algbw, busbw) = (num("time_us"), num("algbw_gbs"), num("busbw_gbs"));
        assert!(us > 0.0, "{v}");
        // algbw = size / time (GB/s), busbw = algbw x factor, to the
        // printed precision.
        let want_alg = (64 << 10) as f64 / (us * 1e-6) / 1e9;
        assert!(
            (algbw - want_alg).abs() <= 1e-4 + want_alg * 1e-3,
            "{op}: algbw {algbw}, size/time {want_alg}"
        );
        let want_bus = algbw * documented_bus_factor(op, 2.0);
        assert!(
            (busbw - want_bus).abs() <= 2e-4 + want_bus * 1e-3,
            "{op}: busbw {busbw}, algbw x factor {want_bus}"
        );
    }
}

/// `--device cuda` needs a GPU backend: refused cleanly (exit 2, a reason),
/// never a crash, whatever machine this runs on.
#[test]
fn chorus_perf_device_cuda_on_the_cpu_backend_is_refused() {
    let out = Command::new(BIN)
        .args([
            "all_reduce",
            "-n",
            "1",
            "--device",
            "cuda",
            "--backend",
            "cpu",
        ])
        .stdin(Stdio::null())
        .output()
        .expect("chorus-perf could not be started");
    assert_eq!(out.status.code(), Some(2), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("--backend nccl or rccl"), "{err}");
}
