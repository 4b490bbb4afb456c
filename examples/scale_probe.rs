//! What one communicator of N ranks costs each rank, for `scripts/scale.sh`:
//! start-up time, resident memory, threads and open files after a few
//! collectives, and the time of an 8 B and a 1 MiB all_reduce. Every
//! collective's result is checked (all_reduce, broadcast, all_gather, a
//! split and an all_reduce in each half).
//!
//! Run under `chorus-run` (or any launcher Chorus understands):
//!
//! ```text
//! cargo build --release --example scale_probe --bin chorus-run
//! SCALE_T0=$(date +%s.%N) target/release/chorus-run -n 16 -- target/release/examples/scale_probe
//! ```
//!
//! `SCALE_T0` is the launch time (seconds since the epoch); start-up is
//! measured from it to `new_comm` returning, the slowest rank's. Without
//! it, from the process's own start. `SCALE_IDLE_S` keeps the
//! communicator idle that many seconds (heartbeats only) before a last
//! all_reduce. Rank 0 prints one line of `key=value` pairs. `RUST_LOG`
//! turns Chorus's logs on (to stderr). `SCALE_LINGER_MS` keeps a survivor
//! of the kill check alive that long after its abort. `SCALE_KILL=k`
//! then kills rank `k` and has every survivor report how long it took to
//! learn of it (see [`kill_check`]).

use std::process::ExitCode;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use chorus::{new_comm, Comm, CommOptions, DType, Device, ReduceOp, Tensor};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("scale_probe: {e}");
            ExitCode::FAILURE
        }
    }
}

type Res<T> = Result<T, Box<dyn std::error::Error>>;

/// Seconds since the epoch.
fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// `VmRSS` (KiB) and `Threads` of this process, from /proc.
fn status() -> (f64, f64) {
    let text = std::fs::read_to_string("/proc/self/status").unwrap_or_default();
    let field = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    (field("VmRSS:"), field("Threads:"))
}

/// Open file descriptors of this process.
fn fds() -> f64 {
    std::fs::read_dir("/proc/self/fd").map_or(0.0, |d| d.count() as f64)
}

/// Bytes used on /dev/shm now.
fn shm_used() -> f64 {
    let out = std::process::Command::new("df")
        .args(["-B1", "--output=used", "/dev/shm"])
        .output();
    out.ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.lines().nth(1).and_then(|l| l.trim().parse().ok()))
        .unwrap_or(0.0)
}

/// Each rank's mean time of `iters` all_reduces of `count` f32, after
/// `warmup` untimed ones; the slowest rank's, in seconds.
fn time_all_reduce(comm: &Comm, count: usize, warmup: usize, iters: usize) -> Res<f64> {
    let n = comm.size() as f32;
    // Each op sums ones to n; dividing back by n keeps the values exact.
    let step = |t: Tensor| -> Res<Tensor> {
        let mut t = comm.all_reduce(t, ReduceOp::Sum)?;
        t.as_mut_slice::<f32>().iter_mut().for_each(|x| *x /= n);
        Ok(t)
    };
    let mut t = Tensor::full(1.0f32, count);
    for _ in 0..warmup {
        t = step(t)?;
    }
    comm.barrier()?;
    let start = Instant::now();
    for _ in 0..iters {
        t = step(t)?;
    }
    let mine = start.elapsed().as_secs_f64() / iters as f64;
    if t.as_slice::<f32>().iter().any(|&x| x != 1.0) {
        return Err("all_reduce gave a wrong sum".into());
    }
    max(comm, mine)
}

/// The largest `x` over the ranks.
fn max(comm: &Comm, x: f64) -> Res<f64> {
    let t = comm.all_reduce(Tensor::from_f64s(DType::F64, &[x]), ReduceOp::Max)?;
    Ok(t.to_f64_vec()[0])
}

/// The mean of `x` over the ranks.
fn mean(comm: &Comm, x: f64) -> Res<f64> {
    let t = comm.all_reduce(Tensor::from_f64s(DType::F64, &[x]), ReduceOp::Sum)?;
    Ok(t.to_f64_vec()[0] / comm.size() as f64)
}

/// `SCALE_KILL=k`: after a barrier, rank `k` kills itself (SIGKILL) and
/// every other rank runs all_reduces until one fails, then prints
/// `killed k: told in T ms, blamed [..]` (the error must be `PeerFailed`).
/// The survivors ignore SIGTERM, which `chorus-run` sends once a rank has
/// died, so that each gets to report.
fn kill_check(comm: &Comm, victim: usize) -> Res<()> {
    // SAFETY: setting a signal's disposition to ignore has no preconditions.
    unsafe {
        libc::signal(libc::SIGTERM, libc::SIG_IGN);
    }
    comm.barrier()?;
    if comm.rank() == victim {
        // SAFETY: kill has no memory preconditions; this process ends here.
        unsafe {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
    }
    let start = Instant::now();
    let err = loop {
        if start.elapsed() > Duration::from_secs(60) {
            return Err("no error within 60 s of the kill".into());
        }
        if let Err(e) = comm.all_reduce(Tensor::full(1.0f32, 1), ReduceOp::Sum) {
            break e;
        }
    };
    let ms = start.elapsed().as_secs_f64() * 1e3;
    // Let the abort finish (peers told, links closed) before this process
    // exits: a process that exits at once closes its links without telling
    // its peers why, and they then blame it.
    comm.abort();
    let result = match err {
        chorus::Error::PeerFailed { failed_ranks, .. } => {
            println!("killed {victim}: told in {ms:.1} ms, blamed {failed_ranks:?}");
            Ok(())
        }
        other => Err(format!("after the kill: {other}").into()),
    };
    if let Ok(ms) = std::env::var("SCALE_LINGER_MS") {
        std::thread::sleep(Duration::from_millis(ms.parse()?));
    }
    result
}

fn run() -> Res<()> {
    // `RUST_LOG` (e.g. `chorus=debug`) turns Chorus's logs on, to stderr.
    if std::env::var_os("RUST_LOG").is_some() {
        tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
            .with_writer(std::io::stderr)
            .init();
    }
    let t0: f64 = std::env::var("SCALE_T0")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(now);
    let comm = new_comm("cpu", Device::Cpu, "scale", CommOptions::default())?;
    let ready = now() - t0;
    let (rank, n) = (comm.rank(), comm.size());

    // Correctness of the collectives a job starts with.
    let s = comm.all_reduce(Tensor::full(rank as f32, 2), ReduceOp::Sum)?;
    if s.as_slice::<f32>() != [(n * (n - 1) / 2) as f32; 2] {
        return Err("all_reduce gave a wrong sum".into());
    }
    let root = n - 1;
    let b = comm.broadcast(Tensor::full(rank as f32, 3), root)?;
    if b.as_slice::<f32>() != [root as f32; 3] {
        return Err("broadcast gave wrong data".into());
    }
    let g = comm.all_gather(Tensor::full(rank as i32, 1))?;
    if g.as_slice::<i32>()
        .iter()
        .enumerate()
        .any(|(r, &v)| v != r as i32)
    {
        return Err("all_gather gave wrong data".into());
    }
    let half = comm.split_by_color(Some((rank % 2) as u32), rank as i64, "half")?;
    if let Some(half) = &half {
        let h = half.all_reduce(Tensor::full(1.0f32, 1), ReduceOp::Sum)?;
        if h.as_slice::<f32>()[0] as usize != half.size() {
            return Err("all_reduce in a split gave a wrong sum".into());
        }
    }

    let small = time_all_reduce(&comm, 2, 20, 100)?;
    let large = time_all_reduce(&comm, 1 << 18, 2, 5)?;
    let (rss, threads) = status();
    let files = fds();
    let shm = if rank == 0 { shm_used() } else { 0.0 };
    let row = [
        ("startup_s", max(&comm, ready)?),
        ("rss_mib_max", max(&comm, rss / 1024.0)?),
        ("rss_mib_mean", mean(&comm, rss / 1024.0)?),
        ("threads_max", max(&comm, threads)?),
        ("fds_max", max(&comm, files)?),
        ("fds_mean", mean(&comm, files)?),
        ("shm_used_mib", max(&comm, shm / (1 << 20) as f64)?),
        ("ar8_us", small * 1e6),
        ("ar1m_ms", large * 1e3),
    ];
    if let Ok(idle) = std::env::var("SCALE_IDLE_S") {
        let secs: u64 = idle.parse()?;
        std::thread::sleep(Duration::from_secs(secs));
        let s = comm.all_reduce(Tensor::full(1.0f32, 1), ReduceOp::Sum)?;
        if s.as_slice::<f32>()[0] as usize != n {
            return Err("all_reduce after the idle time gave a wrong sum".into());
        }
    }
    if rank == 0 {
        let fields: Vec<String> = row.iter().map(|(k, v)| format!("{k}={v:.3}")).collect();
        println!("n={n} {}", fields.join(" "));
    }
    if let Ok(victim) = std::env::var("SCALE_KILL") {
        return kill_check(&comm, victim.parse()?);
    }
    if let Some(half) = half {
        half.finalize()?;
    }
    comm.finalize()?;
    Ok(())
}
