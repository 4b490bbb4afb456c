//! `chorus-perf` end to end, tiny and bounded: 2 local ranks, sizes 8 B..4 KiB,
//! every op, table and `--json` output, correctness check on.

use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

const BIN: &str = env!("CARGO_BIN_EXE_chorus-perf");
/// Upper bound on one chorus-perf run here.
const BOUND: Duration = Duration::from_secs(60);

fn perf(args: &[&str]) -> (bool, String, String) {
    let mut cmd = Command::new(BIN);
    cmd.args(args)
        .args([
            "-b", "8", "-e", "4K", "-f", "8", "-n", "2", "-w", "1", "-i", "3",
        ])
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

#[test]
fn chorus_perf_prints_checked_rows_for_every_op_on_2_ranks() {
    for op in [
        "all_reduce",
        "all_gather",
        "broadcast",
        "reduce_scatter",
        "send_recv",
    ] {
        let (ok, out, err) = perf(&[op]);
        assert!(ok, "{op}: chorus-perf failed\n{out}\n{err}");
        let rows: Vec<&str> = out.lines().filter(|l| !l.starts_with('#')).collect();
        // 8, 64, 512, 4096 bytes.
        assert_eq!(rows.len(), 4, "{op}:\n{out}");
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
    }
}
