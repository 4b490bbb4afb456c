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
//! compared with the closed form), a warm-up, then the timed ops. By default
//! both are time-based, so that a default run is representative: the warm-up
//! lasts at least 50 ms, and the timed run at least 1000 ops and as many as
//! the warm-up's per-op time says take 200 ms, cut short when one size would
//! take more than `--budget` seconds (at least 3 ops). `-w` and `-i` give exact counts instead (`-i` still capped by the
//! budget). Each op is timed on every rank; per op the maximum over ranks is
//! kept (the slowest rank finishes the collective), and the table shows the
//! median. Rooted ops use root 0.
//!
//! Bandwidths follow nccl-tests (`doc/PERFORMANCE.md` and the `*GetBw`
//! functions there):
//!
//! - `algbw = size / time`, `size` in bytes as nccl-tests counts it: for
//!   all_gather, gather, scatter, all_to_all and all_to_all_single the whole
//!   gathered / scattered / exchanged buffer (`n` blocks), for reduce_scatter
//!   the input, otherwise the buffer;
//! - `busbw = algbw × factor`: all_reduce `2(n-1)/n`; all_gather,
//!   reduce_scatter, gather, scatter and both all_to_all forms `(n-1)/n`;
//!   broadcast, reduce, send_recv and ping_pong `1`.
//!
//! `send_recv` times rank 0 sending to rank 1 (one way, as each rank sees
//! its own call return). `ping_pong` times rank 0 → 1 → 0 and reports half
//! the round trip, like MPI latency benchmarks.
//!
//! Chorus ops move their buffers in and out, so they are in place by nature;
//! the in-place columns reuse the same buffers op after op. all_gather's
//! in-place column is a true in-place all_gather (`all_gather_in_place`:
//! this rank's block already sits in the output, as in nccl-tests);
//! reduce_scatter's, all_to_all_single's, gather's, scatter's and the list
//! all_to_all's go through `reduce_scatter_into`, `all_to_all_single_into`,
//! `gather_single_into`, `scatter_single_into` and `all_to_all_into`,
//! which take every buffer (on a device the list all_to_all keeps its
//! allocating form, handed a copy of its inputs made outside the timed
//! region). The
//! out-of-place columns time an op on a fresh copy of its arguments (the copy
//! included) with a fresh output, which is what a caller who keeps the input
//! and uses the allocating forms pays.
//!
//! `--device cuda` (with `--backend nccl` or `rccl`) runs every op on
//! device tensors, allocated once per size on rank `r`'s GPU `r` (or
//! `LOCAL_RANK`'s): no host staging inside the timed region, and only the
//! in-place column (device ops write in place; copies for gather and
//! scatter are made on the device, outside the timed region). Without a
//! usable GPU it refuses with the backend's reason and exit code 2.
//!
//! `--async` issues every op through its `_async` form and awaits the `Work`
//! from a task on a tokio multi-thread runtime (2 workers), to compare with
//! the blocking forms (the default), which may run an op on the calling
//! thread. The communicator runs on that same runtime
//! ([`CommOptions::with_runtime`]), as in an async service that passes its
//! own handle; `--own-runtime` leaves it on Chorus's own runtime instead.

use std::ffi::OsString;
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, UdpSocket};
use std::process::{Child, Command, ExitCode, Stdio};
use std::time::{Duration, Instant};

use chorus::{new_comm, Comm, CommOptions, DType, Device, ReduceOp, Tensor};
use clap::{Parser, ValueEnum};

/// The shortest default warm-up per size and mode.
const WARMUP_MIN: Duration = Duration::from_millis(50);
/// The default timed run per size and mode, as estimated from the warm-up ...
const TIMED_MIN: Duration = Duration::from_millis(200);
/// ... and the fewest default timed ops (both must hold, within `--budget`).
const TIMED_MIN_OPS: usize = 1000;

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
    #[value(name = "broadcast")]
    Broadcast,
    /// Sum, then keep one block per rank.
    #[value(name = "reduce_scatter", alias = "reduce-scatter")]
    ReduceScatter,
    /// Sum onto rank 0.
    #[value(name = "reduce")]
    Reduce,
    /// Every rank's block onto rank 0.
    #[value(name = "gather")]
    Gather,
    /// One block from rank 0 to every rank.
    #[value(name = "scatter")]
    Scatter,
    /// One tensor per peer (the list form).
    #[value(name = "all_to_all", alias = "all-to-all")]
    AllToAll,
    /// One tensor split into one block per peer.
    #[value(name = "all_to_all_single", alias = "all-to-all-single")]
    AllToAllSingle,
    /// Rank 0 sends to rank 1 (others idle).
    #[value(name = "send_recv", alias = "send-recv")]
    SendRecv,
    /// Rank 0 sends to rank 1, which sends back (others idle); half the round trip.
    #[value(name = "ping_pong", alias = "ping-pong")]
    PingPong,
}

impl Op {
    fn name(self) -> &'static str {
        match self {
            Op::AllReduce => "all_reduce",
            Op::AllGather => "all_gather",
            Op::Broadcast => "broadcast",
            Op::ReduceScatter => "reduce_scatter",
            Op::Reduce => "reduce",
            Op::Gather => "gather",
            Op::Scatter => "scatter",
            Op::AllToAll => "all_to_all",
            Op::AllToAllSingle => "all_to_all_single",
            Op::SendRecv => "send_recv",
            Op::PingPong => "ping_pong",
        }
    }

    /// nccl-tests' bus bandwidth factor.
    fn bus_factor(self, n: usize) -> f64 {
        let n = n as f64;
        match self {
            Op::AllReduce => 2.0 * (n - 1.0) / n,
            Op::AllGather
            | Op::ReduceScatter
            | Op::Gather
            | Op::Scatter
            | Op::AllToAll
            | Op::AllToAllSingle => (n - 1.0) / n,
            Op::Broadcast | Op::Reduce | Op::SendRecv | Op::PingPong => 1.0,
        }
    }

    /// Whether nccl-tests' size counts `n` blocks of one per-rank block.
    fn blocked(self) -> bool {
        matches!(
            self,
            Op::AllGather
                | Op::ReduceScatter
                | Op::Gather
                | Op::Scatter
                | Op::AllToAll
                | Op::AllToAllSingle
        )
    }

    fn point_to_point(self) -> bool {
        matches!(self, Op::SendRecv | Op::PingPong)
    }
}

/// How ops are issued.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Api {
    /// The blocking forms, from a plain thread.
    Blocking,
    /// The `_async` forms, awaited from a tokio multi-thread runtime.
    Async,
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
    /// Warm-up ops per size [default: as many as take 50 ms].
    #[arg(short = 'w', long = "warmup")]
    warmup: Option<usize>,
    /// Timed ops per size, fewer where `--budget` would be exceeded (at least 3)
    /// [default: as many as take about 200 ms, at least 1000].
    #[arg(short = 'i', long = "iters")]
    iters: Option<usize>,
    /// Rough seconds per size and mode: caps the timed ops of slow sizes.
    #[arg(long, default_value = "2")]
    budget: f64,
    /// Issue ops through their async forms, awaited from a task on a tokio
    /// multi-thread runtime that also runs the communicator.
    #[arg(long = "async")]
    use_async: bool,
    /// With `--async`: leave the communicator on Chorus's own runtime, so
    /// that every completion wakes a task on another runtime.
    #[arg(long, requires = "use_async")]
    own_runtime: bool,
    /// Skip the correctness check.
    #[arg(long)]
    no_check: bool,
    /// Only the in-place column (skip out-of-place).
    #[arg(long)]
    in_place_only: bool,
    /// Print one JSON object per size instead of the table.
    #[arg(long)]
    json: bool,
    /// Where the buffers live: `cpu` (host memory) or `cuda` (device
    /// tensors on the rank's GPU; needs `--backend nccl` or `rccl`).
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    device: String,
    /// Kill the ranks after this many seconds.
    #[arg(long, default_value = "600")]
    timeout: u64,
}

impl Args {
    fn on_device(&self) -> bool {
        self.device == "cuda"
    }

    fn api(&self) -> Api {
        if self.use_async {
            Api::Async
        } else {
            Api::Blocking
        }
    }
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
    if args.device == "cuda" && !matches!(args.backend.as_str(), "nccl" | "rccl") {
        eprintln!("chorus-perf: --device cuda needs --backend nccl or rccl");
        return ExitCode::from(2);
    }
    if args.factor < 2 || args.min_bytes == 0 || args.min_bytes > args.max_bytes {
        eprintln!("chorus-perf: need -f >= 2 and 0 < -b <= -e");
        return ExitCode::from(2);
    }
    if args.budget.is_nan() || args.budget <= 0.0 {
        eprintln!("chorus-perf: need --budget > 0");
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
    /// Timed ops.
    ops: usize,
}

fn run_rank(args: &Args) -> Result<(), String> {
    let rt = match args.api() {
        Api::Blocking => None,
        Api::Async => Some(
            tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .map_err(|e| format!("tokio runtime: {e}"))?,
        ),
    };
    let mut options = CommOptions::default().with_timeout(Duration::from_secs(args.timeout));
    if let Some(rt) = rt.as_ref().filter(|_| !args.own_runtime) {
        options = options.with_runtime(rt.handle().clone());
    }
    let device = if args.on_device() {
        let local = ["LOCAL_RANK", "CHORUS_LOCAL_RANK", "CHORUS_RANK"]
            .iter()
            .find_map(|k| std::env::var(k).ok()?.parse::<usize>().ok())
            .unwrap_or(0);
        Device::Cuda(local)
    } else {
        Device::Cpu
    };
    let comm = match new_comm(&args.backend, device, "perf", options) {
        Ok(c) => c,
        Err(e @ chorus::Error::BackendUnavailable { .. }) if args.on_device() => {
            eprintln!("chorus-perf: --device cuda refused: {e}");
            std::process::exit(2);
        }
        Err(e) => return Err(format!("new_comm: {e}")),
    };
    if args.op.point_to_point() && comm.size() < 2 {
        return Err(format!("{} needs at least 2 ranks", args.op.name()));
    }
    let all_ok = match &rt {
        // The blocking forms wait on this (plain, non-worker) thread: a
        // multi-thread runtime lets them (a current-thread one would make
        // them fail `WouldBlock`); its one worker stays idle.
        None => tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .map_err(|e| format!("tokio runtime: {e}"))?
            .block_on(sweep(args.clone(), comm.clone())),
        Some(rt) => {
            let task = rt.spawn(sweep(args.clone(), comm.clone()));
            rt.block_on(task)
                .map_err(|e| format!("benchmark task: {e}"))?
        }
    }?;
    comm.finalize().map_err(|e| format!("finalize: {e}"))?;
    if all_ok {
        Ok(())
    } else {
        Err(format!("rank {}: correctness check failed", comm.rank()))
    }
}

/// Every size, in order; `Ok(false)` if a correctness check failed.
async fn sweep(args: Args, comm: Comm) -> Result<bool, String> {
    let (rank, n, api) = (comm.rank(), comm.size(), args.api());
    settle(&comm, api)
        .await
        .map_err(|e| format!("warm-up: {e}"))?;
    if rank == 0 && !args.json {
        let count = |c: Option<usize>, auto: &str| c.map_or(auto.to_string(), |c| c.to_string());
        println!(
            "# chorus-perf {} backend={} device={} nranks={n} api={} warmup={} iters={} budget={}s (median over ops of the max over ranks)",
            args.op.name(),
            args.backend,
            args.device,
            match (api, args.own_runtime) {
                (Api::Blocking, _) => "blocking",
                (Api::Async, false) => "async",
                (Api::Async, true) => "async(own-runtime)",
            },
            count(args.warmup, "50ms"),
            count(args.iters, "200ms+1000"),
            args.budget,
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
        let row = measure(&args, &comm, bytes)
            .await
            .map_err(|e| format!("{bytes} bytes: {e}"))?;
        all_ok &= row.check_ok;
        if rank == 0 {
            print_row(&args, n, &row);
        }
        match bytes.checked_mul(args.factor) {
            Some(b) => bytes = b,
            None => break,
        }
    }
    Ok(all_ok)
}

fn print_row(args: &Args, n: usize, row: &Row) {
    if args.json {
        let oop = row
            .out_of_place
            .map(|t| {
                format!(
                    "{{\"time_us\":{:.3},\"algbw_gbs\":{:.4},\"busbw_gbs\":{:.4},\"ops\":{}}}",
                    t.us, t.algbw, t.busbw, t.ops
                )
            })
            .unwrap_or_else(|| "null".into());
        println!(
            "{{\"system\":\"chorus\",\"backend\":\"{}\",\"api\":\"{}\",\"op\":\"{}\",\"nranks\":{n},\"size\":{},\"count\":{},\"type\":\"float\",\"in_place\":{{\"time_us\":{:.3},\"algbw_gbs\":{:.4},\"busbw_gbs\":{:.4},\"ops\":{}}},\"out_of_place\":{oop},\"check\":{}}}",
            args.backend,
            if args.use_async { "async" } else { "blocking" },
            args.op.name(),
            row.bytes,
            row.count,
            row.in_place.us,
            row.in_place.algbw,
            row.in_place.busbw,
            row.in_place.ops,
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

/// `(count, per)`: the elements nccl-tests counts for `bytes` (the whole
/// buffer of `n` blocks for blocked ops), and one rank's block.
fn counts(op: Op, bytes: usize, n: usize) -> (usize, usize) {
    let total = (bytes / 4).max(1);
    if op.blocked() {
        let per = (total / n).max(1);
        (per * n, per)
    } else {
        (total, total)
    }
}

/// Issue `$comm.$sync(args)` or, with [`Api::Async`], await
/// `$comm.$asy(args)`; `?` on the result.
macro_rules! go {
    ($api:expr, $comm:ident . $sync:ident / $asy:ident ( $($a:expr),* $(,)? )) => {
        match $api {
            Api::Blocking => $comm.$sync($($a),*)?,
            Api::Async => $comm.$asy($($a),*).await?,
        }
    };
}

/// The arguments of one op.
enum Call {
    One(Tensor),
    /// `(input, output)` of the `_into` forms; `(send, recv)` of ping_pong.
    Two(Tensor, Tensor),
    List(Vec<Tensor>),
    /// `(inputs, outputs)` of `all_to_all_into`.
    Lists(Vec<Tensor>, Vec<Tensor>),
    Scatter(Tensor, Option<Vec<Tensor>>),
    /// The output of an in-place all_gather (this rank's block in place).
    InPlace(Tensor),
}

/// What one op hands back.
enum Back {
    One(Tensor),
    /// `(output, input)` of the `_into` forms; `(send, recv)` of ping_pong.
    Two(Tensor, Tensor),
    List(Vec<Tensor>),
    /// `(outputs, inputs)` of `all_to_all_into`.
    Lists(Vec<Tensor>, Vec<Tensor>),
    /// The output of an in-place all_gather, to reuse as the next one's.
    Out(Tensor),
}

/// Run one op.
async fn issue(comm: &Comm, op: Op, api: Api, call: Call) -> chorus::Result<Back> {
    let sum = ReduceOp::Sum;
    Ok(match (op, call) {
        (Op::AllReduce, Call::One(t)) => {
            Back::One(go!(api, comm.all_reduce / all_reduce_async(t, sum)))
        }
        (Op::Reduce, Call::One(t)) => Back::One(go!(api, comm.reduce / reduce_async(t, sum, 0))),
        (Op::Broadcast, Call::One(t)) => {
            Back::One(go!(api, comm.broadcast / broadcast_async(t, 0)))
        }
        (Op::AllGather, Call::One(t)) => Back::One(go!(api, comm.all_gather / all_gather_async(t))),
        (Op::AllGather, Call::InPlace(o)) => Back::Out(go!(
            api,
            comm.all_gather_in_place / all_gather_in_place_async(o)
        )),
        (Op::ReduceScatter, Call::One(t)) => {
            Back::One(go!(api, comm.reduce_scatter / reduce_scatter_async(t, sum)))
        }
        (Op::ReduceScatter, Call::Two(i, o)) => {
            let (o, i) = go!(
                api,
                comm.reduce_scatter_into / reduce_scatter_into_async(i, o, sum)
            );
            Back::Two(o, i)
        }
        (Op::Gather, Call::One(t)) => Back::List(go!(api, comm.gather / gather_async(t, 0))),
        (Op::Gather, Call::Two(i, o)) => {
            let (o, i) = go!(
                api,
                comm.gather_single_into / gather_single_into_async(i, o, 0)
            );
            Back::Two(o, i)
        }
        // Call::Two(output, input); Back::Two(input, output), so that
        // `keep` puts each back where `call` took it from.
        (Op::Scatter, Call::Two(o, i)) => {
            let (o, i) = go!(
                api,
                comm.scatter_single_into / scatter_single_into_async(i, o, 0)
            );
            Back::Two(i, o)
        }
        (Op::Scatter, Call::Scatter(out, inputs)) => {
            Back::One(go!(api, comm.scatter / scatter_async(out, inputs, 0)))
        }
        (Op::AllToAll, Call::List(v)) => {
            Back::List(go!(api, comm.all_to_all / all_to_all_async(v)))
        }
        (Op::AllToAll, Call::Lists(i, o)) => {
            let (o, i) = go!(api, comm.all_to_all_into / all_to_all_into_async(i, o));
            Back::Lists(o, i)
        }
        (Op::AllToAllSingle, Call::One(t)) => Back::One(go!(
            api,
            comm.all_to_all_single / all_to_all_single_async(t)
        )),
        (Op::AllToAllSingle, Call::Two(i, o)) => {
            let (o, i) = go!(
                api,
                comm.all_to_all_single_into / all_to_all_single_into_async(i, o)
            );
            Back::Two(o, i)
        }
        (Op::SendRecv, Call::One(t)) => Back::One(match comm.rank() {
            0 => go!(api, comm.send / send_async(t, 1)),
            1 => go!(api, comm.recv / recv_async(t, 0)),
            _ => t,
        }),
        (Op::PingPong, Call::Two(s, r)) => match comm.rank() {
            0 => {
                let s = go!(api, comm.send / send_async(s, 1));
                Back::Two(s, go!(api, comm.recv / recv_async(r, 1)))
            }
            1 => {
                let r = go!(api, comm.recv / recv_async(r, 0));
                Back::Two(go!(api, comm.send / send_async(s, 0)), r)
            }
            _ => Back::Two(s, r),
        },
        (op, _) => {
            return Err(chorus::Error::Internal(format!(
                "chorus-perf: no call shape for {}",
                op.name()
            )))
        }
    })
}

/// The check's input: rank `r`'s element `i` for the reducing and gathering ops.
fn val(r: usize, i: usize) -> f32 {
    (r + 1 + i % 7) as f32
}

/// The check's input: element `i` of the block that rank `src` sends to `dst`.
fn pair(n: usize, src: usize, dst: usize, i: usize) -> f32 {
    (src * n + dst + 1 + i % 7) as f32
}

/// One rank's buffers for `op`, reused op after op in the in-place columns
/// (no allocation, no first-touch page faults inside the timed region).
struct Buffers {
    op: Op,
    rank: usize,
    /// The input (all_gather, reduce_scatter, gather), the buffer (the
    /// in-place ops), the output (scatter), the send buffer (ping_pong).
    a: Tensor,
    /// The output (all_gather, reduce_scatter), the receive buffer (ping_pong).
    b: Tensor,
    /// all_to_all's inputs; scatter's inputs on the root.
    list: Vec<Tensor>,
    /// all_to_all's outputs for `all_to_all_into` (host buffers only).
    outs: Vec<Tensor>,
    /// With `--device cuda`: the communicator whose device holds the
    /// buffers (device copies go through it).
    dev: Option<Comm>,
}

fn empty() -> Tensor {
    Tensor::zeros(DType::F32, 0)
}

impl Buffers {
    /// Buffers of `op` for `count` elements (`per` per block); with
    /// `pattern`, filled with the check's input, else zeros (whose sums stay
    /// finite however often they are reused).
    fn new(
        op: Op,
        rank: usize,
        n: usize,
        count: usize,
        per: usize,
        pattern: bool,
        dev: Option<&Comm>,
    ) -> chorus::Result<Buffers> {
        let fill = |len: usize, f: &dyn Fn(usize) -> f32| {
            if pattern {
                Tensor::from_vec((0..len).map(f).collect::<Vec<f32>>())
            } else {
                Tensor::zeros(DType::F32, len)
            }
        };
        let (a, b, list) = match op {
            // The output holds this rank's block in place, zeros elsewhere.
            Op::AllGather => (
                fill(per, &|i| val(rank, i)),
                fill(count, &|i| {
                    if i / per == rank {
                        val(rank, i % per)
                    } else {
                        0.0
                    }
                }),
                vec![],
            ),
            Op::ReduceScatter => (fill(count, &|i| val(rank, i)), fill(per, &|_| 0.0), vec![]),
            // b: the root's gathered output (for gather_single_into).
            Op::Gather => (
                fill(per, &|i| val(rank, i)),
                if rank == 0 {
                    fill(count, &|_| 0.0)
                } else {
                    empty()
                },
                vec![],
            ),
            // b: the root's inputs as one tensor (for scatter_single_into).
            Op::Scatter => {
                let inputs = if rank == 0 {
                    (0..n).map(|d| fill(per, &|i| pair(n, 0, d, i))).collect()
                } else {
                    vec![]
                };
                let whole = if rank == 0 {
                    fill(count, &|i| pair(n, 0, i / per, i % per))
                } else {
                    empty()
                };
                (fill(per, &|_| 0.0), whole, inputs)
            }
            Op::AllToAll => {
                let inputs = (0..n).map(|d| fill(per, &|i| pair(n, rank, d, i)));
                (empty(), empty(), inputs.collect())
            }
            Op::AllToAllSingle => (
                fill(count, &|i| pair(n, rank, i / per, i % per)),
                fill(count, &|_| 0.0),
                vec![],
            ),
            Op::PingPong => (
                fill(count, &|i| val(rank, i)),
                fill(count, &|_| 0.0),
                vec![],
            ),
            Op::AllReduce | Op::Reduce | Op::Broadcast | Op::SendRecv => {
                (fill(count, &|i| val(rank, i)), empty(), vec![])
            }
        };
        let Some(comm) = dev else {
            let outs = match op {
                Op::AllToAll => (0..n).map(|_| fill(per, &|_| 0.0)).collect(),
                _ => vec![],
            };
            return Ok(Buffers {
                op,
                rank,
                a,
                b,
                list,
                outs,
                dev: None,
            });
        };
        let list = list
            .iter()
            .map(|t| comm.to_device(t))
            .collect::<chorus::Result<Vec<_>>>()?;
        Ok(Buffers {
            op,
            rank,
            a: comm.to_device(&a)?,
            b: comm.to_device(&b)?,
            list,
            outs: vec![],
            dev: Some(comm.clone()),
        })
    }

    /// A copy of `t`: on the host, or on the device for device buffers.
    fn dup(dev: &Option<Comm>, t: &Tensor) -> Tensor {
        match dev {
            Some(c) if t.is_device() => match c.device_clone(t) {
                Ok(t) => t,
                Err(e) => panic!("device copy: {e}"),
            },
            _ => t.clone(),
        }
    }

    /// The next op's arguments: the buffers themselves (`fresh == false`,
    /// given back by [`Buffers::keep`]) or fresh copies of them.
    fn call(&mut self, fresh: bool) -> Call {
        let dev = &self.dev;
        let take = |t: &mut Tensor| {
            if fresh {
                Buffers::dup(dev, t)
            } else {
                std::mem::replace(t, empty())
            }
        };
        let dup_list = |v: &[Tensor]| v.iter().map(|t| Buffers::dup(dev, t)).collect();
        match self.op {
            Op::AllGather | Op::ReduceScatter if fresh => Call::One(Buffers::dup(dev, &self.a)),
            Op::AllGather => Call::InPlace(take(&mut self.b)),
            Op::ReduceScatter | Op::PingPong => {
                let a = take(&mut self.a);
                Call::Two(a, take(&mut self.b))
            }
            // The in-place columns reuse the buffers through the _into forms.
            Op::Gather | Op::Scatter if !fresh => {
                let a = take(&mut self.a);
                Call::Two(a, take(&mut self.b))
            }
            // gather consumes its input, scatter its inputs, all_to_all its list.
            Op::Gather => Call::One(Buffers::dup(dev, &self.a)),
            Op::Scatter => Call::Scatter(
                take(&mut self.a),
                (self.rank == 0).then(|| dup_list(&self.list)),
            ),
            Op::AllToAllSingle if !fresh => {
                let a = take(&mut self.a);
                Call::Two(a, take(&mut self.b))
            }
            Op::AllToAll if fresh => Call::List(dup_list(&self.list)),
            Op::AllToAll if self.outs.is_empty() => Call::List(std::mem::take(&mut self.list)),
            Op::AllToAll => Call::Lists(
                std::mem::take(&mut self.list),
                std::mem::take(&mut self.outs),
            ),
            Op::AllReduce | Op::Reduce | Op::Broadcast | Op::AllToAllSingle | Op::SendRecv => {
                Call::One(take(&mut self.a))
            }
        }
    }

    /// Take the buffers back from an op that [`Buffers::call`] fed them to.
    fn keep(&mut self, back: Back) {
        match (self.op, back) {
            (Op::Gather, Back::List(_)) => {}
            (Op::AllToAll, Back::List(v)) => self.list = v,
            (Op::AllToAll, Back::Lists(o, i)) => (self.outs, self.list) = (o, i),
            (Op::PingPong, Back::Two(s, r)) => (self.a, self.b) = (s, r),
            (_, Back::Two(o, i)) => (self.b, self.a) = (o, i),
            (_, Back::One(t)) => self.a = t,
            (_, Back::Out(t)) => self.b = t,
            (_, Back::List(_) | Back::Lists(..)) => {}
        }
    }
}

/// Correctness: one op on the check's input, compared with the closed form.
async fn check(
    comm: &Comm,
    op: Op,
    api: Api,
    count: usize,
    per: usize,
    on_device: bool,
) -> chorus::Result<bool> {
    let (rank, n) = (comm.rank(), comm.size());
    let dev = on_device.then_some(comm);
    let mut bufs = Buffers::new(op, rank, n, count, per, true, dev)?;
    let call = bufs.call(false);
    let back = issue(comm, op, api, call).await?;
    let sum_over = |i: usize| (0..n).map(|r| val(r, i)).sum::<f32>();
    let is = |t: &Tensor, len: usize, f: &dyn Fn(usize) -> f32| {
        // Device results are checked through a host copy.
        let host = if t.is_device() {
            match comm.to_host(t) {
                Ok(h) => h,
                Err(_) => return false,
            }
        } else {
            t.clone()
        };
        host.len() == len
            && host
                .as_slice::<f32>()
                .iter()
                .enumerate()
                .all(|(i, &v)| v == f(i))
    };
    let ok = match (op, &back) {
        (Op::AllReduce, Back::One(t)) => is(t, count, &sum_over),
        (Op::Reduce, Back::One(t)) if rank == 0 => is(t, count, &sum_over),
        (Op::Reduce, Back::One(t)) => is(t, count, &|i| val(rank, i)),
        (Op::Broadcast, Back::One(t)) => is(t, count, &|i| val(0, i)),
        (Op::AllGather, Back::Out(out)) => is(out, count, &|i| val(i / per, i % per)),
        (Op::ReduceScatter, Back::Two(out, _)) => is(out, per, &|i| sum_over(rank * per + i)),
        (Op::Gather, Back::List(v)) if rank == 0 => {
            v.len() == n
                && v.iter()
                    .enumerate()
                    .all(|(r, t)| is(t, per, &|i| val(r, i)))
        }
        (Op::Gather, Back::List(v)) => v.is_empty(),
        (Op::Gather, Back::Two(o, _)) if rank == 0 => is(o, count, &|i| val(i / per, i % per)),
        (Op::Gather, Back::Two(..)) => true,
        (Op::Scatter, Back::Two(_, t)) => is(t, per, &|i| pair(n, 0, rank, i)),
        (Op::Scatter, Back::One(t)) => is(t, per, &|i| pair(n, 0, rank, i)),
        (Op::AllToAll, Back::List(v) | Back::Lists(v, _)) => {
            v.len() == n
                && v.iter()
                    .enumerate()
                    .all(|(s, t)| is(t, per, &|i| pair(n, s, rank, i)))
        }
        (Op::AllToAllSingle, Back::One(t)) => is(t, count, &|i| pair(n, i / per, rank, i % per)),
        (Op::AllToAllSingle, Back::Two(t, _)) => is(t, count, &|i| pair(n, i / per, rank, i % per)),
        (Op::SendRecv, Back::One(t)) if rank == 1 => is(t, count, &|i| val(0, i)),
        (Op::SendRecv, Back::One(_)) => true,
        (Op::PingPong, Back::Two(_, r)) if rank < 2 => is(r, count, &|i| val(1 - rank, i)),
        (Op::PingPong, Back::Two(..)) => true,
        _ => false,
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

/// Elementwise max over ranks.
async fn max_over_ranks(comm: &Comm, api: Api, v: Vec<f64>) -> chorus::Result<Vec<f64>> {
    let t = go!(
        api,
        comm.all_reduce / all_reduce_async(Tensor::from_vec(v), ReduceOp::Max)
    );
    Ok(t.to_vec::<f64>())
}

/// How many ops to time after a warm-up whose ops took `est` seconds each
/// (the max over ranks), so that one size and mode takes about `budget`
/// seconds at most.
fn timed_ops(iters: Option<usize>, budget: f64, est: f64) -> usize {
    let est = est.max(1e-7);
    let cap = budget / est;
    match iters {
        Some(i) => (cap as usize).clamp(3.min(i), i.max(1)),
        None => {
            let want = (TIMED_MIN.as_secs_f64() / est).max(TIMED_MIN_OPS as f64);
            (want.min(cap) as usize).max(3)
        }
    }
}

/// Warm up, then time ops; returns the per-op times (seconds) of this rank.
async fn time_ops(
    args: &Args,
    comm: &Comm,
    count: usize,
    per: usize,
    out_of_place: bool,
) -> chorus::Result<Vec<f64>> {
    let (op, api) = (args.op, args.api());
    let mut bufs = Buffers::new(
        op,
        comm.rank(),
        comm.size(),
        count,
        per,
        false,
        args.on_device().then_some(comm),
    )?;
    // Warm up in batches, each followed by one agreement (rank 0's clock
    // decides, so that every rank runs the same ops); the last batch gives
    // the per-op estimate for the timed count. `-w 0` still runs one op.
    let start = Instant::now();
    let mut batch = args.warmup.unwrap_or(1).max(1);
    let est = loop {
        let t0 = Instant::now();
        for _ in 0..batch {
            let call = bufs.call(out_of_place);
            let back = issue(comm, op, api, call).await?;
            if !out_of_place {
                bufs.keep(back);
            }
        }
        let per_op = t0.elapsed().as_secs_f64() / batch as f64;
        let more = args.warmup.is_none() && comm.rank() == 0 && start.elapsed() < WARMUP_MIN;
        let v = max_over_ranks(comm, api, vec![f64::from(u8::from(more)), per_op]).await?;
        if v.first() != Some(&1.0) {
            break v.get(1).copied().unwrap_or(per_op);
        }
        batch *= 2;
    };
    let iters = timed_ops(args.iters, args.budget, est);
    let mut times = Vec::with_capacity(iters);
    for _ in 0..iters {
        if out_of_place {
            let start = Instant::now();
            let call = bufs.call(true);
            issue(comm, op, api, call).await?;
            times.push(start.elapsed().as_secs_f64());
        } else {
            let call = bufs.call(false);
            let start = Instant::now();
            let back = issue(comm, op, api, call).await?;
            times.push(start.elapsed().as_secs_f64());
            bufs.keep(back);
        }
    }
    if op == Op::PingPong {
        // One timed op is a round trip; report one way.
        times.iter_mut().for_each(|t| *t /= 2.0);
    }
    Ok(times)
}

/// Small all-reduces for a fixed time before the first size: just-started
/// rank processes often share one core until the scheduler spreads them,
/// which made the first size measured (only) up to 10x slower.
async fn settle(comm: &Comm, api: Api) -> chorus::Result<()> {
    let start = Instant::now();
    loop {
        // Every rank leaves after the same op: rank 0's clock decides.
        let go_on = comm.rank() == 0 && start.elapsed() < Duration::from_millis(200);
        let v = max_over_ranks(comm, api, vec![f64::from(u8::from(go_on))]).await?;
        if v.first() != Some(&1.0) {
            return Ok(());
        }
    }
}

/// Max over ranks per op, then the median.
async fn reduce_times(comm: &Comm, api: Api, times: Vec<f64>) -> chorus::Result<f64> {
    let mut v = max_over_ranks(comm, api, times).await?;
    Ok(median(&mut v))
}

async fn measure(args: &Args, comm: &Comm, bytes: usize) -> chorus::Result<Row> {
    let (n, api) = (comm.size(), args.api());
    let (count, per) = counts(args.op, bytes, n);
    let size_bytes = count * 4;
    let check_ok = if args.no_check {
        true
    } else {
        let ok = check(comm, args.op, api, count, per, args.on_device()).await?;
        // Every rank learns whether any rank failed.
        let v = max_over_ranks(comm, api, vec![f64::from(u8::from(!ok))]).await?;
        v.first() == Some(&0.0)
    };
    let timing = |ops: usize, secs: f64| {
        let algbw = size_bytes as f64 / secs / 1e9;
        Timing {
            us: secs * 1e6,
            algbw,
            busbw: algbw * args.op.bus_factor(n),
            ops,
        }
    };
    let ip = time_ops(args, comm, count, per, false).await?;
    let in_place = timing(ip.len(), reduce_times(comm, api, ip).await?);
    // Device buffers: in place only (see the module docs).
    let out_of_place = if args.in_place_only || args.on_device() {
        None
    } else {
        let oop = time_ops(args, comm, count, per, true).await?;
        Some(timing(oop.len(), reduce_times(comm, api, oop).await?))
    };
    Ok(Row {
        bytes: size_bytes,
        count,
        in_place,
        out_of_place,
        check_ok,
    })
}
