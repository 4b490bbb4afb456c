//! `chorus-run`: start N local ranks of a program, torchrun style.
//!
//! ```text
//! chorus-run -n 4 [--master-port P] [--store-on-rank0] [--timeout SECS] [--grace SECS] [--] program args...
//! ```
//!
//! The launcher hosts the job's rendezvous store itself (a
//! [`RendezvousServer`] on `127.0.0.1`), so the death of any rank, rank 0
//! included, never takes the store down: the survivors still agree on who
//! failed. `--store-on-rank0` restores the torchrun layout, where rank 0
//! hosts the store (and its death takes the store with it). A
//! `CHORUS_STORE_ADDR` or `CHORUS_STORE` already set in the environment (a
//! standalone `chorus-rendezvous`, an etcd cluster) is passed through and
//! `chorus-run` hosts nothing.
//!
//! Each rank is started with the environment that
//! [`chorus::bootstrap`] reads:
//!
//! | variable | value |
//! |----------|-------|
//! | `RANK`, `LOCAL_RANK` | 0..N |
//! | `WORLD_SIZE`, `LOCAL_WORLD_SIZE` | N |
//! | `CHORUS_STORE_ADDR` | `127.0.0.1:P`, the store `chorus-run` hosts (not set with `--store-on-rank0`) |
//! | `MASTER_ADDR` | `127.0.0.1` |
//! | `MASTER_PORT` | P: `--master-port`, else a port free for both UDP (the QUIC store) and TCP |
//! | `CHORUS_SECRET` | inherited if set and non-empty, else 32 fresh random bytes, hex |
//! | `CHORUS_JOB_ID` | inherited if set and non-empty, else fresh for each launch: scopes every store key, so a relaunch on a reused store never sees the last job's keys |
//!
//! Variables of launchers that bootstrap would prefer over `RANK`/`WORLD_SIZE`
//! (`CHORUS_RANK`/`CHORUS_SIZE`, `OMPI_COMM_WORLD_*`, `PMI_*`) are removed
//! from the ranks' environment, so a `chorus-run` started under mpirun or
//! Slurm still gives each rank the identity it assigned.
//!
//! Every line a rank writes is prefixed with `[rank R] ` (stdout to stdout,
//! stderr to stderr, whole lines, never interleaved within a line).
//!
//! Exit status:
//! - 0 when every rank exits 0;
//! - when a rank exits non-zero or is killed by a signal, the other ranks are
//!   stopped (SIGTERM to each rank's process group, SIGKILL after `--grace`
//!   seconds) and `chorus-run` exits with that rank's code, or 128+signal;
//! - 124 when `--timeout` expires (every rank is stopped first);
//! - 128+signal when `chorus-run` itself gets SIGINT, SIGTERM or SIGHUP (the
//!   signal is forwarded to the ranks, then SIGKILL after the grace period;
//!   a second signal kills at once);
//! - 2 for a usage error (e.g. `-n 0`, no program), 127 when the program
//!   cannot be started.
//!
//! Each rank runs in its own process group, so stopping a rank also stops
//! whatever it started (e.g. the `sleep` inside an `sh -c` rank). Unix only.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{Ipv4Addr, SocketAddrV4, TcpListener, UdpSocket};
use std::process::{Child, Command, ExitCode, ExitStatus, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use chorus::transport::RendezvousServer;
use clap::Parser;

/// Exit code when `--timeout` expires (as coreutils `timeout`).
const EXIT_TIMEOUT: u8 = 124;
/// Exit code when the program cannot be started (as shells do).
const EXIT_CANNOT_START: u8 = 127;
/// How long to wait for output still buffered in pipes once every rank has exited.
const OUTPUT_DRAIN: Duration = Duration::from_secs(2);

/// Start N local ranks of a program with the environment Chorus bootstraps from.
#[derive(Debug, Parser)]
#[command(name = "chorus-run", version)]
struct Args {
    /// Number of ranks to start (at least 1).
    #[arg(short = 'n', long = "nproc", value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..=65536))]
    nproc: u32,

    /// Port of the rendezvous store (default: a free port).
    #[arg(long, value_name = "PORT")]
    master_port: Option<u16>,

    /// Let rank 0 host the rendezvous store (torchrun style) instead of
    /// `chorus-run`; the death of rank 0 then takes the store with it.
    #[arg(long)]
    store_on_rank0: bool,

    /// Stop every rank and exit 124 after this many seconds.
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    timeout: Option<Duration>,

    /// Seconds between SIGTERM and SIGKILL when stopping ranks.
    #[arg(long, value_name = "SECS", value_parser = parse_secs, default_value = "5")]
    grace: Duration,

    /// The program to run, and its arguments.
    #[arg(
        required = true,
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "PROGRAM [ARGS]..."
    )]
    command: Vec<OsString>,
}

fn parse_secs(s: &str) -> Result<Duration, String> {
    let v: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    Duration::try_from_secs_f64(v).map_err(|e| format!("{s:?}: {e}"))
}

/// Something the supervising loop reacts to.
enum Event {
    /// A rank's process exited.
    Exited(usize, std::io::Result<ExitStatus>),
    /// One of a rank's output streams reached end of file.
    OutputClosed,
    /// `chorus-run` got this signal.
    Signal(i32),
}

fn main() -> ExitCode {
    let args = Args::parse();
    match run(args) {
        Ok(code) => ExitCode::from(code),
        Err(msg) => {
            eprintln!("chorus-run: {msg}");
            ExitCode::from(EXIT_CANNOT_START)
        }
    }
}

/// Pick a port that is free for both UDP (the QUIC store) and TCP on loopback.
fn free_port() -> Result<u16, String> {
    let mut last_err = String::new();
    for _ in 0..64 {
        let udp = match UdpSocket::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0)) {
            Ok(s) => s,
            Err(e) => {
                last_err = e.to_string();
                continue;
            }
        };
        let port = match udp.local_addr() {
            Ok(a) => a.port(),
            Err(e) => {
                last_err = e.to_string();
                continue;
            }
        };
        match TcpListener::bind(SocketAddrV4::new(Ipv4Addr::LOCALHOST, port)) {
            Ok(_tcp) => return Ok(port),
            Err(e) => last_err = e.to_string(),
        }
    }
    Err(format!(
        "cannot find a free port on 127.0.0.1 ({last_err}); pass --master-port"
    ))
}

/// The job secret: `CHORUS_SECRET` if set, else 32 random bytes in hex.
fn job_secret() -> Result<OsString, String> {
    inherited_or_random("CHORUS_SECRET", 32)
}

/// `var` if set and non-empty, else `len` random bytes in hex.
fn inherited_or_random(var: &str, len: usize) -> Result<OsString, String> {
    if let Some(s) = std::env::var_os(var).filter(|s| !s.is_empty()) {
        return Ok(s);
    }
    use ring::rand::SecureRandom;
    let mut bytes = vec![0u8; len];
    ring::rand::SystemRandom::new()
        .fill(&mut bytes)
        .map_err(|_| "the system random number generator failed".to_string())?;
    Ok(bytes
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<String>()
        .into())
}

/// Copy `from` to `to` line by line, each line prefixed with `prefix`.
/// A final line without a newline gets one. Bytes need not be UTF-8.
fn prefix_lines<W: Write>(from: impl Read, prefix: &[u8], to: impl Fn() -> W) {
    let mut reader = BufReader::new(from);
    let mut line = Vec::with_capacity(256);
    loop {
        line.clear();
        match reader.read_until(b'\n', &mut line) {
            Ok(0) | Err(_) => return,
            Ok(_) => {
                if line.last() != Some(&b'\n') {
                    line.push(b'\n');
                }
                // One locked write per line: lines of different ranks never mix.
                let mut out = to();
                if out
                    .write_all(prefix)
                    .and_then(|_| out.write_all(&line))
                    .and_then(|_| out.flush())
                    .is_err()
                {
                    // Our own output is gone (closed pipe): keep draining so the
                    // rank does not block on a full pipe.
                    continue;
                }
            }
        }
    }
}

/// Signal the process group `pgid` (each rank leads its own group).
fn signal_group(pgid: u32, sig: i32) {
    extern "C" {
        fn kill(pid: i32, sig: i32) -> i32;
    }
    let Ok(pid) = i32::try_from(pgid) else {
        return;
    };
    if pid > 0 {
        // SAFETY: kill(2) takes plain integers and has no memory effects. A
        // negative pid addresses the process group; ESRCH (already gone) is fine.
        unsafe {
            kill(-pid, sig);
        }
    }
}

const SIGINT: i32 = 2;
const SIGKILL: i32 = 9;
const SIGTERM: i32 = 15;

/// Exit code for a rank's status: its code, or 128+signal.
fn status_code(status: &ExitStatus) -> u8 {
    if let Some(c) = status.code() {
        return u8::try_from(c & 0xff).unwrap_or(1);
    }
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(s) = status.signal() {
            return u8::try_from((128 + s).min(255)).unwrap_or(255);
        }
    }
    1
}

fn describe(status: &ExitStatus) -> String {
    {
        use std::os::unix::process::ExitStatusExt;
        if let Some(s) = status.signal() {
            return format!("was killed by signal {s}");
        }
    }
    match status.code() {
        Some(c) => format!("exited with code {c}"),
        None => "exited abnormally".into(),
    }
}

/// The launcher's own runtime: one worker thread runs the signal watcher and
/// the rendezvous store it hosts.
fn runtime() -> Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("chorus-run")
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start the launcher's runtime: {e}"))
}

/// Forward SIGINT, SIGTERM and SIGHUP to the event loop, from tasks on `rt`.
fn watch_signals(rt: &tokio::runtime::Runtime, tx: mpsc::Sender<Event>) -> Result<(), String> {
    use tokio::signal::unix::{signal, SignalKind};
    // Register the handlers before any rank starts, so no signal is lost.
    let kinds = [
        (SignalKind::interrupt(), SIGINT),
        (SignalKind::terminate(), SIGTERM),
        (SignalKind::hangup(), 1),
    ];
    let _g = rt.enter();
    for (kind, num) in kinds {
        let mut s = signal(kind).map_err(|e| format!("cannot watch signal {num}: {e}"))?;
        let tx = tx.clone();
        rt.spawn(async move {
            while s.recv().await.is_some() {
                if tx.send(Event::Signal(num)).is_err() {
                    return;
                }
            }
        });
    }
    Ok(())
}

/// Where the ranks find the store.
enum StoreEnv {
    /// The store this launcher hosts, at `127.0.0.1:port`.
    Hosted(u16),
    /// Rank 0 hosts it (`--store-on-rank0`).
    Rank0,
    /// `CHORUS_STORE_ADDR`/`CHORUS_STORE` from the environment: passed through.
    Inherited,
}

/// Host the job's store on `127.0.0.1:port` unless the environment names
/// one or `--store-on-rank0` asks rank 0 to host it.
fn host_store(
    rt: &tokio::runtime::Runtime,
    args: &Args,
    port: u16,
    secret: &OsString,
) -> Result<(StoreEnv, Option<RendezvousServer>), String> {
    let inherited = ["CHORUS_STORE_ADDR", "CHORUS_STORE"]
        .iter()
        .any(|v| std::env::var_os(v).is_some_and(|s| !s.is_empty()));
    if inherited {
        return Ok((StoreEnv::Inherited, None));
    }
    if args.store_on_rank0 {
        return Ok((StoreEnv::Rank0, None));
    }
    let addr = SocketAddrV4::new(Ipv4Addr::LOCALHOST, port).into();
    let server = rt
        .block_on(RendezvousServer::bind(addr, secret.as_encoded_bytes()))
        .map_err(|e| format!("cannot host the rendezvous store on {addr}: {e}"))?;
    let port = server.local_addr().port();
    Ok((StoreEnv::Hosted(port), Some(server)))
}

struct Rank {
    pid: u32,
    exited: bool,
}

fn spawn_rank(
    args: &Args,
    rank: usize,
    port: u16,
    store: &StoreEnv,
    secret: &OsString,
    job_id: &OsString,
    tx: &mpsc::Sender<Event>,
) -> Result<Rank, String> {
    let n = args.nproc.to_string();
    let (program, rest) = args
        .command
        .split_first()
        .ok_or_else(|| "no program given".to_string())?;
    let mut cmd = Command::new(program);
    cmd.args(rest)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", &n)
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", &n)
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("CHORUS_SECRET", secret)
        .env("CHORUS_JOB_ID", job_id)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    match store {
        StoreEnv::Hosted(p) => {
            cmd.env("CHORUS_STORE_ADDR", format!("127.0.0.1:{p}"));
        }
        StoreEnv::Rank0 => {
            cmd.env_remove("CHORUS_STORE_ADDR")
                .env_remove("CHORUS_STORE");
        }
        StoreEnv::Inherited => {}
    }
    for var in [
        "CHORUS_RANK",
        "CHORUS_SIZE",
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "PMI_RANK",
        "PMI_SIZE",
    ] {
        cmd.env_remove(var);
    }
    {
        use std::os::unix::process::CommandExt;
        cmd.process_group(0);
    }
    let mut child: Child = cmd.spawn().map_err(|e| {
        format!(
            "cannot start rank {rank}: {}: {e}",
            std::path::Path::new(program).display()
        )
    })?;
    let pid = child.id();
    let prefix = format!("[rank {rank}] ").into_bytes();
    if let Some(out) = child.stdout.take() {
        let (p, tx) = (prefix.clone(), tx.clone());
        thread::Builder::new()
            .name(format!("rank{rank}-stdout"))
            .spawn(move || {
                prefix_lines(out, &p, || std::io::stdout().lock());
                let _ = tx.send(Event::OutputClosed);
            })
            .map_err(|e| format!("cannot start an output thread: {e}"))?;
    }
    if let Some(err) = child.stderr.take() {
        let tx = tx.clone();
        thread::Builder::new()
            .name(format!("rank{rank}-stderr"))
            .spawn(move || {
                prefix_lines(err, &prefix, || std::io::stderr().lock());
                let _ = tx.send(Event::OutputClosed);
            })
            .map_err(|e| format!("cannot start an output thread: {e}"))?;
    }
    let tx = tx.clone();
    thread::Builder::new()
        .name(format!("rank{rank}-wait"))
        .spawn(move || {
            let status = child.wait();
            let _ = tx.send(Event::Exited(rank, status));
        })
        .map_err(|e| format!("cannot start a wait thread: {e}"))?;
    Ok(Rank { pid, exited: false })
}

/// Why the ranks are being stopped.
enum Stop {
    RankFailed(u8),
    Timeout,
    Signal(i32),
}

fn run(args: Args) -> Result<u8, String> {
    let (tx, rx) = mpsc::channel();
    let rt = runtime()?;
    watch_signals(&rt, tx.clone())?;
    let port = match args.master_port {
        Some(p) => p,
        None => free_port()?,
    };
    let secret = job_secret()?;
    // Lives until every rank has exited.
    let (store, _server) = host_store(&rt, &args, port, &secret)?;
    let job_id = inherited_or_random("CHORUS_JOB_ID", 8)?;
    let started = Instant::now();
    let deadline = args.timeout.map(|t| started + t);

    let mut ranks: Vec<Rank> = Vec::with_capacity(args.nproc as usize);
    let mut streams_open = 0usize;
    let mut stop: Option<Stop> = None;
    for r in 0..args.nproc as usize {
        match spawn_rank(&args, r, port, &store, &secret, &job_id, &tx) {
            Ok(rank) => {
                ranks.push(rank);
                streams_open += 2;
            }
            Err(msg) => {
                eprintln!("chorus-run: {msg}");
                stop = Some(Stop::RankFailed(EXIT_CANNOT_START));
                break;
            }
        }
    }
    drop(tx);

    let mut running = ranks.len();
    // When SIGTERM was sent, and whether SIGKILL followed.
    let mut terminated_at: Option<Instant> = None;
    let mut killed = false;
    let mut drain_until: Option<Instant> = None;

    loop {
        if let Some(why) = &stop {
            if terminated_at.is_none() {
                let sig = match why {
                    Stop::Signal(s) => *s,
                    _ => SIGTERM,
                };
                for r in &ranks {
                    signal_group(r.pid, sig);
                }
                terminated_at = Some(Instant::now());
            }
        }
        if running == 0 {
            if streams_open == 0 {
                break;
            }
            // Every rank has exited; give their pipes a moment to drain (a
            // background process of a rank may keep one open forever).
            let until = *drain_until.get_or_insert_with(|| Instant::now() + OUTPUT_DRAIN);
            if Instant::now() >= until {
                break;
            }
        }
        // Next instant something must happen without an event.
        let mut wake: Option<Instant> = drain_until;
        if stop.is_none() {
            wake = min_instant(wake, deadline);
        }
        if let (Some(t), false) = (terminated_at, killed) {
            wake = min_instant(wake, Some(t + args.grace));
        }
        let event = match wake {
            Some(w) => match rx.recv_timeout(w.saturating_duration_since(Instant::now())) {
                Ok(e) => Some(e),
                Err(mpsc::RecvTimeoutError::Timeout) => None,
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
            },
            None => match rx.recv() {
                Ok(e) => Some(e),
                Err(_) => break,
            },
        };
        let now = Instant::now();
        match event {
            Some(Event::Exited(r, status)) => {
                if let Some(rank) = ranks.get_mut(r) {
                    if !rank.exited {
                        rank.exited = true;
                        running -= 1;
                    }
                }
                let failed = match &status {
                    Ok(s) if s.success() => None,
                    Ok(s) => Some((status_code(s), describe(s))),
                    Err(e) => Some((1, format!("could not be waited for: {e}"))),
                };
                if let (Some((code, what)), None) = (failed, &stop) {
                    eprintln!("chorus-run: rank {r} {what}; stopping the other ranks");
                    stop = Some(Stop::RankFailed(code));
                }
            }
            Some(Event::OutputClosed) => streams_open = streams_open.saturating_sub(1),
            Some(Event::Signal(sig)) => match stop {
                None => {
                    eprintln!("chorus-run: got signal {sig}; stopping every rank");
                    stop = Some(Stop::Signal(sig));
                }
                Some(_) if !killed => {
                    eprintln!("chorus-run: got signal {sig} again; killing every rank");
                    for r in &ranks {
                        signal_group(r.pid, SIGKILL);
                    }
                    killed = true;
                }
                Some(_) => {}
            },
            None => {}
        }
        if stop.is_none() && deadline.is_some_and(|d| now >= d) {
            eprintln!(
                "chorus-run: timeout of {:?} expired; stopping every rank",
                args.timeout.unwrap_or_default()
            );
            stop = Some(Stop::Timeout);
        }
        if let (Some(t), false) = (terminated_at, killed) {
            if now >= t + args.grace && running > 0 {
                eprintln!(
                    "chorus-run: {running} rank(s) still running {:?} after SIGTERM; sending SIGKILL",
                    args.grace
                );
                for r in ranks.iter().filter(|r| !r.exited) {
                    signal_group(r.pid, SIGKILL);
                }
                killed = true;
            }
        }
    }
    // Whatever a rank left behind in its process group goes with it when the
    // job failed; on success leftovers are the program's business.
    if stop.is_some() {
        for r in &ranks {
            signal_group(r.pid, SIGKILL);
        }
    }
    Ok(match stop {
        None => 0,
        Some(Stop::RankFailed(code)) => code,
        Some(Stop::Timeout) => EXIT_TIMEOUT,
        Some(Stop::Signal(sig)) => u8::try_from(128 + sig).unwrap_or(255),
    })
}

fn min_instant(a: Option<Instant>, b: Option<Instant>) -> Option<Instant> {
    match (a, b) {
        (Some(a), Some(b)) => Some(a.min(b)),
        (a, None) => a,
        (None, b) => b,
    }
}
