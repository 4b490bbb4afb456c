//! `chorus-perf`: an nccl-tests-style benchmark of Chorus collectives.
//!
//! ```text
//! chorus-perf all_reduce -b 8 -e 128M -f 2 -n 4 --backend cpu
//! ```
//!
//! With `-n N` (and no rank in the environment) it starts `N` local ranks by
//! re-executing itself with the bootstrap environment (`CHORUS_RANK`,
//! `CHORUS_SIZE`, `MASTER_ADDR`, `MASTER_PORT`, `CHORUS_SECRET`), like
//! `chorus-run`; under `chorus-run`, mpirun or torchrun it runs as the rank
//! the environment names. Rank 0 prints the table.
//!
//! For every size it runs a correctness check (rank-dependent input, result
//! compared with the closed form), `-w` warm-up ops, then `-i` timed ops. Each
//! op is timed on every rank; per op the maximum over ranks is kept (the
//! slowest rank finishes the collective), and the table shows the median.
//! Bandwidths follow nccl-tests (`doc/PERFORMANCE.md` there):
//!
//! - `algbw = size / time`, `size` in bytes as nccl-tests counts it (for
//!   all_gather the gathered output, for reduce_scatter the input);
//! - `busbw = algbw × factor`: all_reduce `2(n-1)/n`, all_gather and
//!   reduce_scatter `(n-1)/n`, broadcast and send_recv `1`.
//!
//! Chorus ops move their buffers in and out, so they are in place by nature;
//! the in-place columns reuse the same buffers op after op (all_gather and
//! reduce_scatter through their `_into` forms, which take the output buffer
//! too). The out-of-place columns time an op on a fresh copy of the input
//! (the copy included) with a fresh output, which is what a caller who keeps
//! the input and uses the allocating forms pays.

use std::ffi::OsString;
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, UdpSocket};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use chorus::{new_comm, Comm, CommOptions, Device, ReduceOp, Tensor};
use clap::{Parser, ValueEnum};

/// Which collective to measure.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Op {
    /// In-place sum of f32.
    #[value(name = "all_reduce", alias = "all-reduce")]
    AllReduce,
    /// Gather every rank's block.
    #[value(name = "all_gather", alias = "all-gather")]
    AllGather,
    /// Broadcast from rank 0.
    #[value(name = "broadcast", alias = "broadcast")]
    Broadcast,
    /// Sum, then keep one block per rank.
    #[value(name = "reduce_scatter", alias = "reduce-scatter")]
    ReduceScatter,
    /// Rank 0 sends to rank 1 (others idle).
    #[value(name = "send_recv", alias = "send-recv")]
    SendRecv,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
            Op::ReduceScatter => "reduce_scatter",
            Op::SendRecv => "send_recv",
        }
    }

    /// nccl-tests' bus bandwidth factor.
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather | Op::ReduceScatter => (n - 1.0) / n,
            Op::Broadcast | Op::SendRecv => 1.0,
        }
    }
}

/// nccl-tests-style benchmark of Chorus collectives.
#[derive(Debug, Parser, Clone)]
#[command(name = "chorus-perf", version)]
struct Args {
    /// The collective to measure.
    #[arg(value_enum)]
    op: Op,
    /// Smallest size in bytes (suffixes K, M, G).
    #[arg(short = 'b', long = "minbytes", default_value = "8", value_parser = parse_size)]
    min_bytes: usize,
    /// Largest size in bytes (suffixes K, M, G).
    #[arg(short = 'e', long = "maxbytes", default_value = "32M", value_parser = parse_size)]
    max_bytes: usize,
    /// Multiplication factor between sizes.
    #[arg(short = 'f', long = "stepfactor", default_value = "2")]
    factor: usize,
    /// Number of local ranks to start (ignored when the environment names a rank).
    #[arg(short = 'n', long = "nranks", default_value = "2")]
    nranks: usize,
    /// Backend name.
    #[arg(long, default_value = "cpu")]
    backend: String,
    /// Warm-up ops per size.
    #[arg(short = 'w', long = "warmup", default_value = "5")]
    warmup: usize,
    /// Timed ops per size (fewer for large sizes when `--budget` would be exceeded, at least 3).
    #[arg(short = 'i', long = "iters", default_value = "20")]
    iters: usize,
    /// Rough seconds per size and mode: caps the timed ops of slow sizes.
    #[arg(long, default_value = "2")]
    budget: f64,
    /// Skip the correctness check.
    #[arg(long)]
    no_check: bool,
    /// Only the in-place column (skip out-of-place).
    #[arg(long)]
    in_place_only: bool,
    /// Print one JSON object per size instead of the table.
    #[arg(long)]
    json: bool,
    /// Kill the ranks after this many seconds.
    #[arg(long, default_value = "600")]
    timeout: u64,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let s = s.trim();
    let (num, mul) = match s.chars().last().map(|c| c.to_ascii_uppercase()) {
        Some('K') => (&s[..s.len() - 1], 1usize << 10),
        Some('M') => (&s[..s.len() - 1], 1 << 20),
        Some('G') => (&s[..s.len() - 1], 1 << 30),
        _ => (s, 1),
    };
    num.parse::<usize>()
        .map(|v| v * mul)
        .map_err(|_| format!("{s:?} is not a size (e.g. 8, 64K, 128M)"))
}

fn main() -> ExitCode {
    let args = Args::parse();
    if args.factor < 2 || args.min_bytes == 0 || args.min_bytes > args.max_bytes {
        eprintln!("chorus-perf: need -f >= 2 and 0 < -b <= -e");
        return ExitCode::from(2);
    }
    let under_launcher = chorus::bootstrap::env_rank_size().ok().flatten().is_some();
    let r = if under_launcher || args.nranks <= 1 {
        run_rank(&args)
    } else {
        launch(&args)
    };
    match r {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("chorus-perf: {e}");
            ExitCode::FAILURE
        }
    }
}

/// A port free for both UDP (the QUIC store) and TCP on loopback.
fn free_port() -> Result<u16, String> {
    for _ in 0..64 {
        let Ok(udp) = UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0)) else {
            continue;
        };
        let Ok(port) = udp.local_addr().map(|a| a.port()) else {
            continue;
        };
        if TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)).is_ok() {
            return Ok(port);
        }
    }
    Err("no free port on 127.0.0.1".into())
}

/// Start `-n` copies of this program as the ranks of one job.
fn launch(args: &Args) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| format!("own path: {e}"))?;
    let port = free_port()?;
    let secret: String = {
        let t = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        format!("{:032x}{:08x}", t, std::process::id())
    };
    let argv: Vec<OsString> = std::env::args_os().skip(1).collect();
    let mut children: Vec<Child> = Vec::new();
    for rank in 0..args.nranks {
        let mut cmd = Command::new(&exe);
        cmd.args(&argv)
            .env("CHORUS_RANK", rank.to_string())
            .env("CHORUS_SIZE", args.nranks.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("CHORUS_SECRET", &secret)
            .stdin(Stdio::null())
            .stdout(if rank == 0 {
                Stdio::inherit()
            } else {
                Stdio::null()
            });
        match cmd.spawn() {
            Ok(c) => children.push(c),
            Err(e) => {
                for c in &mut children {
                    let _ = c.kill();
                }
                return Err(format!("starting rank {rank}: {e}"));
            }
        }
    }
    let deadline = Instant::now() + Duration::from_secs(args.timeout);
    let mut failed = Vec::new();
    let mut done = vec![false; children.len()];
    while done.iter().any(|d| !d) {
        for (rank, c) in children.iter_mut().enumerate() {
            if done[rank] {
                continue;
            }
            match c.try_wait() {
                Ok(Some(st)) => {
                    done[rank] = true;
                    if !st.success() {
                        failed.push(rank);
                    }
                }
                Ok(None) => {}
                Err(_) => {
                    done[rank] = true;
                    failed.push(rank);
                }
            }
        }
        if !failed.is_empty() || Instant::now() > deadline {
            for (rank, c) in children.iter_mut().enumerate() {
                if !done[rank] {
                    let _ = c.kill();
                    let _ = c.wait();
                    done[rank] = true;
                }
            }
            if failed.is_empty() {
                return Err(format!("timed out after {} s", args.timeout));
            }
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    if failed.is_empty() {
        Ok(())
    } else {
        Err(format!("ranks {failed:?} failed"))
    }
}

/// One row of results.
struct Row {
    bytes: usize,
    count: usize,
    in_place: Timing,
    out_of_place: Option<Timing>,
    check_ok: bool,
}

#[derive(Clone, Copy)]
struct Timing {
    us: f64,
    algbw: f64,
    busbw: f64,
}

fn run_rank(args: &Args) -> Result<(), String> {
    let comm = new_comm(
        &args.backend,
        Device::Cpu,
        "perf",
        CommOptions::default().with_timeout(Duration::from_secs(args.timeout)),
    )
    .map_err(|e| format!("new_comm: {e}"))?;
    let (rank, n) = (comm.rank(), comm.size());
    if args.op == Op::SendRecv && n < 2 {
        return Err("send_recv needs at least 2 ranks".into());
    }
    settle(&comm).map_err(|e| format!("warm-up: {e}"))?;
    if rank == 0 && !args.json {
        println!(
            "# chorus-perf {} backend={} nranks={n} warmup={} iters={} (median over ops of the max over ranks)",
            args.op.name(),
            args.backend,
            args.warmup,
            args.iters
        );
        println!(
            "# {:>12} {:>12} {:>6} {:>10} {:>8} {:>8} {:>10} {:>8} {:>8} {:>6}",
            "size(B)",
            "count",
            "type",
            "oop(us)",
            "algbw",
            "busbw",
            "ip(us)",
            "algbw",
            "busbw",
            "check"
        );
    }
    let mut bytes = args.min_bytes;
    let mut all_ok = true;
    while bytes <= args.max_bytes {
        let row = measure(args, &comm, bytes).map_err(|e| format!("{bytes} bytes: {e}"))?;
        all_ok &= row.check_ok;
        if rank == 0 {
            print_row(args, n, &row);
        }
        match bytes.checked_mul(args.factor) {
            Some(b) => bytes = b,
            None => break,
        }
    }
    comm.finalize().map_err(|e| format!("finalize: {e}"))?;
    if all_ok {
        Ok(())
    } else {
        Err(format!("rank {rank}: correctness check failed"))
    }
}

fn print_row(args: &Args, n: usize, row: &Row) {
    if args.json {
        let oop = row
            .out_of_place
            .map(|t| {
                format!(
                    "{{\"time_us\":{:.3},\"algbw_gbs\":{:.4},\"busbw_gbs\":{:.4}}}",
                    t.us, t.algbw, t.busbw
                )
            })
            .unwrap_or_else(|| "null".into());
        println!(
            "{{\"system\":\"chorus\",\"backend\":\"{}\",\"op\":\"{}\",\"nranks\":{n},\"size\":{},\"count\":{},\"type\":\"float\",\"in_place\":{{\"time_us\":{:.3},\"algbw_gbs\":{:.4},\"busbw_gbs\":{:.4}}},\"out_of_place\":{oop},\"check\":{}}}",
            args.backend,
            args.op.name(),
            row.bytes,
            row.count,
            row.in_place.us,
            row.in_place.algbw,
            row.in_place.busbw,
            row.check_ok
        );
    } else {
        let (ou, oa, ob) = row
            .out_of_place
            .map(|t| {
                (
                    format!("{:.2}", t.us),
                    format!("{:.3}", t.algbw),
                    format!("{:.3}", t.busbw),
                )
            })
            .unwrap_or_else(|| ("-".into(), "-".into(), "-".into()));
        println!(
            "  {:>12} {:>12} {:>6} {:>10} {:>8} {:>8} {:>10.2} {:>8.3} {:>8.3} {:>6}",
            row.bytes,
            row.count,
            "float",
            ou,
            oa,
            ob,
            row.in_place.us,
            row.in_place.algbw,
            row.in_place.busbw,
            if row.check_ok { "ok" } else { "FAIL" }
        );
    }
}

/// Elements per rank's input for `bytes` as nccl-tests counts them.
fn counts(op: Op, bytes: usize, n: usize) -> (usize, usize) {
    let total = (bytes / 4).max(1);
    match op {
        // count = elements of the gathered output / reduce_scatter input, in nccl-tests terms.
        Op::AllGather | Op::ReduceScatter => {
            let per = (total / n).max(1);
            (per * n, per)
        }
        _ => (total, total),
    }
}

/// Run one op on `t` (the rank's input) and return the output.
fn run_op(comm: &Comm, op: Op, t: Tensor) -> chorus::Result<Tensor> {
    match op {
        Op::AllReduce => comm.all_reduce(t, ReduceOp::Sum),
        Op::AllGather => comm.all_gather(t),
        Op::Broadcast => comm.broadcast(t, 0),
        Op::ReduceScatter => comm.reduce_scatter(t, ReduceOp::Sum),
        Op::SendRecv => match comm.rank() {
            0 => comm.send(t, 1),
            1 => comm.recv(t, 0),
            _ => Ok(t),
        },
    }
}

fn input_len(op: Op, count: usize, per: usize) -> usize {
    match op {
        Op::AllGather => per,
        _ => count,
    }
}

/// Correctness: inputs `rank + 1 + i % 7`, compared with the closed form.
fn check(comm: &Comm, op: Op, count: usize, per: usize) -> chorus::Result<bool> {
    let (rank, n) = (comm.rank(), comm.size());
    let len = input_len(op, count, per);
    let val = |r: usize, i: usize| (r + 1 + i % 7) as f32;
    let input: Vec<f32> = (0..len).map(|i| val(rank, i)).collect();
    let out = run_op(comm, op, Tensor::from_vec(input))?;
    let got = out.as_slice::<f32>();
    let sum_over = |i: usize| (0..n).map(|r| val(r, i)).sum::<f32>();
    let ok = match op {
        Op::AllReduce => {
            got.len() == count && got.iter().enumerate().all(|(i, &v)| v == sum_over(i))
        }
        Op::ReduceScatter => {
            got.len() == per
                && got
                    .iter()
                    .enumerate()
                    .all(|(i, &v)| v == sum_over(rank * per + i))
        }
        Op::AllGather => {
            got.len() == per * n
                && got
                    .iter()
                    .enumerate()
                    .all(|(i, &v)| v == val(i / per, i % per))
        }
        Op::Broadcast => got.len() == count && got.iter().enumerate().all(|(i, &v)| v == val(0, i)),
        Op::SendRecv => rank != 1 || got.iter().enumerate().all(|(i, &v)| v == val(0, i)),
    };
    Ok(ok)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if v.is_empty() {
        return 0.0;
    }
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

/// Time `iters` ops (after `warmup`); returns the per-op times (seconds) of this rank.
fn time_ops(
    comm: &Comm,
    op: Op,
    len: usize,
    warmup: usize,
    iters: usize,
    out_of_place: bool,
) -> chorus::Result<Vec<f64>> {
    let mut bufs = Buffers::new(comm, op, len);
    let mut times = Vec::with_capacity(iters);
    for i in 0..warmup + iters {
        let start = Instant::now();
        if out_of_place {
            run_op(comm, op, bufs.input.clone())?;
        } else {
            bufs.run_in_place(comm, op)?;
        }
        if i >= warmup {
            times.push(start.elapsed().as_secs_f64());
        }
    }
    Ok(times)
}

/// The buffers of the in-place runs, reused op after op (no allocation, no
/// first-touch page faults inside the timed region).
struct Buffers {
    input: Tensor,
    /// all_gather and reduce_scatter: the caller-provided output.
    output: Tensor,
}

impl Buffers {
    fn new(comm: &Comm, op: Op, len: usize) -> Buffers {
        let out_len = match op {
            Op::AllGather => len * comm.size(),
            Op::ReduceScatter => len / comm.size().max(1),
            _ => 0,
        };
        Buffers {
            input: Tensor::zeros(chorus::DType::F32, len),
            output: Tensor::zeros(chorus::DType::F32, out_len),
        }
    }

    fn run_in_place(&mut self, comm: &Comm, op: Op) -> chorus::Result<()> {
        let input = std::mem::replace(&mut self.input, Tensor::zeros(chorus::DType::F32, 0));
        let output = std::mem::replace(&mut self.output, Tensor::zeros(chorus::DType::F32, 0));
        (self.output, self.input) = match op {
            Op::AllGather => comm.all_gather_into(input, output)?,
            Op::ReduceScatter => comm.reduce_scatter_into(input, output, ReduceOp::Sum)?,
            _ => (output, run_op(comm, op, input)?),
        };
        Ok(())
    }
}

/// Small all-reduces for a fixed time before the first size: just-started
/// rank processes often share one core until the scheduler spreads them,
/// which made the first size measured (only) up to 10x slower.
fn settle(comm: &Comm) -> chorus::Result<()> {
    let start = Instant::now();
    loop {
        // Every rank leaves after the same op: rank 0's clock decides.
        let go_on = u8::from(comm.rank() != 0 || start.elapsed() < Duration::from_millis(200));
        let t = comm.all_reduce(Tensor::full(go_on, 1), ReduceOp::Min)?;
        if t.as_slice::<u8>().first() != Some(&1) {
            return Ok(());
        }
    }
}

/// Max over ranks per op, then the median.
fn reduce_times(comm: &Comm, times: Vec<f64>) -> chorus::Result<f64> {
    let t = comm.all_reduce(Tensor::from_vec(times), ReduceOp::Max)?;
    let mut v = t.to_vec::<f64>();
    Ok(median(&mut v))
}

fn measure(args: &Args, comm: &Comm, bytes: usize) -> chorus::Result<Row> {
    let n = comm.size();
    let (count, per) = counts(args.op, bytes, n);
    let len = input_len(args.op, count, per);
    let size_bytes = count * 4;
    let check_ok = if args.no_check {
        true
    } else {
        let ok = check(comm, args.op, count, per)?;
        // Every rank learns whether any rank failed.
        let v = comm.all_reduce(Tensor::from_vec(vec![u32::from(!ok)]), ReduceOp::Max)?;
        v.as_slice::<u32>().first().copied() == Some(0)
    };
    // Estimate one op to cap the iterations of slow sizes.
    let probe = time_ops(comm, args.op, len, 1, 1, false)?;
    let est = reduce_times(comm, probe)?.max(1e-7);
    let iters = ((args.budget / est) as usize).clamp(3.min(args.iters), args.iters.max(1));
    let warmup = args.warmup.min(iters);
    let timing = |secs: f64| {
        let algbw = size_bytes as f64 / secs / 1e9;
        Timing {
            us: secs * 1e6,
            algbw,
            busbw: algbw * args.op.bus_factor(n),
        }
    };
    let ip = time_ops(comm, args.op, len, warmup, iters, false)?;
    let in_place = timing(reduce_times(comm, ip)?);
    let out_of_place = if args.in_place_only {
        None
    } else {
        let oop = time_ops(comm, args.op, len, warmup, iters, true)?;
        Some(timing(reduce_times(comm, oop)?))
    };
    Ok(Row {
        bytes: size_bytes,
        count,
        in_place,
        out_of_place,
        check_ok,
    })
}
