//! The failure-detection matrix: for each scenario, start a 4-rank job as
//! separate processes on this machine, let it run all-reduces, then kill
//! (SIGKILL) or stop (SIGSTOP) one rank, and measure how long each survivor
//! takes to get a typed error, and which ranks it blames.
//!
//! ```sh
//! cargo run --release --example fault_matrix            # the table, exit 1 on a miss
//! cargo run --release --example fault_matrix -- --slack 5
//! ```
//!
//! One row per scenario: the store's host (the launcher, as `chorus-run`
//! hosts it, or rank 0), the fault and its victim, the survivors' detection
//! times (median and max, from the fault to the error), the ranks they
//! blamed, and the verdict. A row passes when every survivor got an error
//! naming exactly the victim (or, when the victim hosts the store,
//! `StoreUnreachable`, shown as `store`), within the bound: 200 ms after a kill, and
//! `heartbeat_timeout + 2 × heartbeat_interval` (here 1 s + 2 × 100 ms)
//! after a stop. `--slack F` multiplies the bounds (for loaded machines;
//! CI uses it). `--store launcher` or `--store rank0` runs only the
//! scenarios of one store placement. `--store etcd` (built with `--features
//! etcd`, and an `etcd` binary on `PATH` or in `CHORUS_TEST_ETCD`) starts an
//! etcd server on loopback and runs the kill and stop rows with every rank
//! on `CHORUS_STORE=etcd://...`, as a job spanning hosts would. The process
//! exits non-zero if any row fails.
//!
//! The example re-executes itself as the ranks (`FAULT_MATRIX_RANK` set).
//!
//! With `--netns PREFIX` (run by `scripts/netns-cluster.sh`, as root, from
//! inside the namespace `PREFIXsw` that holds the store address
//! 10.213.0.254), rank `r` runs in namespace `PREFIX{r}` with address
//! 10.213.0.{r+1} and its own host id, so ranks talk over TCP across a
//! bridge as on separate hosts, and a "link down" scenario (the victim's
//! interface `eth0` set down: a partition) is added.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use chorus::{new_comm, CommOptions, Device, ReduceOp, Tensor};

const WORLD: usize = 4;
const HB_INTERVAL: Duration = Duration::from_millis(100);
const HB_TIMEOUT: Duration = Duration::from_secs(1);
const KILL_BOUND: Duration = Duration::from_millis(200);
/// How long one scenario may take before the launcher gives up on it.
const SCENARIO_DEADLINE: Duration = Duration::from_secs(30);

fn now_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros())
        .unwrap_or(0)
}

/// The body of one rank: all-reduce until an error, then report it.
fn rank_main() -> std::process::ExitCode {
    let opts = CommOptions::default()
        .with_timeout(Duration::from_secs(20))
        .with_connect_timeout(Duration::from_secs(20))
        .with_heartbeat(HB_INTERVAL, HB_TIMEOUT);
    let comm = match new_comm("cpu", Device::Cpu, "matrix", opts) {
        Ok(c) => c,
        Err(e) => {
            println!("@@setup-error {e}");
            return std::process::ExitCode::from(3);
        }
    };
    let mut k = 0u64;
    loop {
        match comm.all_reduce(Tensor::full(1.0f32, 1024), ReduceOp::Sum) {
            Ok(t) => {
                if t.as_slice::<f32>()[0] != WORLD as f32 {
                    println!("@@corrupt");
                    return std::process::ExitCode::from(4);
                }
                if k == 20 {
                    println!("@@running");
                }
                k += 1;
            }
            Err(e) => {
                let blamed: Vec<String> = e.failed_ranks().iter().map(|r| r.to_string()).collect();
                // The cause: a named peer, or the store itself.
                let cause = if matches!(e, chorus::Error::StoreUnreachable { .. }) {
                    "store".to_string()
                } else {
                    format!("[{}]", blamed.join(","))
                };
                println!("@@error {} {} {cause} {e}", now_us(), comm.rank());
                // Stay up, as an elastic job's survivors do to reconfigure,
                // until the launcher ends the scenario (closes our stdin).
                // A survivor that exits at once can reset its links before
                // its peers have read its abort notice.
                let _ = std::io::Write::flush(&mut std::io::stdout());
                let _ = std::io::copy(&mut std::io::stdin(), &mut std::io::sink());
                return std::process::ExitCode::SUCCESS;
            }
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum StoreHost {
    Launcher,
    Rank0,
    /// An etcd server the launcher starts (`--store etcd`).
    Etcd,
}

/// A running etcd server on loopback; killed and its data removed on drop.
struct Etcd {
    child: Child,
    dir: std::path::PathBuf,
    endpoint: String,
}

impl Drop for Etcd {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Start etcd on free loopback ports and wait until its client port
/// accepts connections (at most 20 s).
fn start_etcd() -> Result<Etcd, String> {
    let bin = std::env::var("CHORUS_TEST_ETCD").unwrap_or_else(|_| "etcd".into());
    let port = || free_port().map_err(|e| format!("no free port: {e}"));
    let (client, peer) = (port()?, port()?);
    let dir = std::env::temp_dir().join(format!("chorus-fault-matrix-etcd-{}", std::process::id()));
    let c = format!("http://127.0.0.1:{client}");
    let p = format!("http://127.0.0.1:{peer}");
    let child = Command::new(&bin)
        .args(["--name", "fm", "--data-dir"])
        .arg(&dir)
        .args(["--listen-client-urls", &c, "--advertise-client-urls", &c])
        .args(["--listen-peer-urls", &p, "--initial-advertise-peer-urls", &p])
        .args(["--initial-cluster", &format!("fm={p}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| {
            format!("cannot start `{bin}` ({e}): install Debian etcd-server (./scripts/install-deps.sh)")
        })?;
    let etcd = Etcd {
        child,
        dir,
        endpoint: format!("etcd://127.0.0.1:{client}"),
    };
    let deadline = Instant::now() + Duration::from_secs(20);
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], client));
    while std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(100)).is_err() {
        if Instant::now() > deadline {
            return Err(format!("etcd did not listen on {addr} within 20 s"));
        }
        // Polling a port that is not up yet: nothing to wait on instead.
        std::thread::sleep(Duration::from_millis(20));
    }
    Ok(etcd)
}

#[derive(Clone, Copy, Debug, PartialEq)]
enum Fault {
    Kill,
    Stop,
    LinkDown,
    /// `tc netem` delay and loss on the victim's link from the start: the
    /// job must still run, with correct results.
    Netem,
}

/// What the netem scenario applies to the victim's interface.
const NETEM: [&str; 5] = ["delay", "20ms", "5ms", "loss", "2%"];

/// Where the ranks run: this namespace, or one namespace per rank.
#[derive(Clone, Debug)]
struct Net {
    netns: Option<String>,
}

impl Net {
    fn rank_ip(&self, rank: usize) -> String {
        match self.netns {
            Some(_) => format!("10.213.0.{}", rank + 1),
            None => "127.0.0.1".into(),
        }
    }
    fn store_ip(&self) -> &'static str {
        match self.netns {
            Some(_) => "10.213.0.254",
            None => "127.0.0.1",
        }
    }
    /// Run `args` inside rank `rank`'s namespace; whether it succeeded.
    fn in_ns(&self, rank: usize, args: &[&str]) -> bool {
        let Some(p) = &self.netns else { return false };
        Command::new("ip")
            .args(["netns", "exec", &format!("{p}{rank}")])
            .args(args)
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    }
}

struct Job {
    children: Vec<Child>,
    lines: mpsc::Receiver<(usize, String)>,
}

impl Drop for Job {
    fn drop(&mut self) {
        for c in &mut self.children {
            // A stopped process must be continued to die promptly.
            signal(c, libc::SIGCONT);
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Send `sig` to `child`; whether it was delivered.
fn signal(child: &Child, sig: i32) -> bool {
    let Ok(pid) = i32::try_from(child.id()) else {
        return false;
    };
    // SAFETY: kill(2) on the pid of our own, not yet reaped child.
    unsafe { libc::kill(pid, sig) == 0 }
}

fn free_port() -> std::io::Result<u16> {
    Ok(std::net::UdpSocket::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn spawn_job(net: &Net, host: StoreHost, store_addr: &str, job: &str) -> std::io::Result<Job> {
    let exe = std::env::current_exe()?;
    let port = free_port()?;
    let (tx, lines) = mpsc::channel();
    let mut children = Vec::new();
    for rank in 0..WORLD {
        let mut cmd = match &net.netns {
            Some(p) => {
                let mut c = Command::new("ip");
                c.args(["netns", "exec", &format!("{p}{rank}")]).arg(&exe);
                c.env("CHORUS_HOST_ID", format!("{p}{rank}"))
                    .env("CHORUS_DATA_IP", net.rank_ip(rank));
                c
            }
            None => Command::new(&exe),
        };
        cmd.env("FAULT_MATRIX_RANK", rank.to_string())
            .env("CHORUS_SECRET", "fault-matrix-secret")
            .env("CHORUS_JOB_ID", job)
            .env_remove("CHORUS_STORE_ADDR")
            .env_remove("CHORUS_STORE")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::null());
        match host {
            StoreHost::Launcher => {
                cmd.env("CHORUS_RANK", rank.to_string())
                    .env("CHORUS_SIZE", WORLD.to_string())
                    .env("CHORUS_STORE_ADDR", store_addr);
            }
            StoreHost::Etcd => {
                cmd.env("CHORUS_RANK", rank.to_string())
                    .env("CHORUS_SIZE", WORLD.to_string())
                    .env("CHORUS_STORE", store_addr);
            }
            StoreHost::Rank0 => {
                cmd.env("RANK", rank.to_string())
                    .env("WORLD_SIZE", WORLD.to_string())
                    .env("MASTER_ADDR", net.rank_ip(0))
                    .env("MASTER_PORT", port.to_string())
                    .env_remove("CHORUS_RANK")
                    .env_remove("CHORUS_SIZE");
            }
        }
        let mut child = cmd.spawn()?;
        let out = child
            .stdout
            .take()
            .ok_or_else(|| std::io::Error::other("no stdout"))?;
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
    Ok(Job { children, lines })
}

struct Row {
    name: String,
    survivors: usize,
    median: Option<Duration>,
    max: Option<Duration>,
    blamed: String,
    pass: bool,
    /// Not run here (e.g. no netem in this kernel); not a failure.
    skip: bool,
    note: String,
}

fn run_scenario(
    net: &Net,
    host: StoreHost,
    fault: Fault,
    victim: usize,
    store_addr: &str,
    slack: f64,
    n: usize,
) -> Row {
    let name = format!(
        "store on {}, {} rank {victim}",
        match host {
            StoreHost::Launcher => "launcher",
            StoreHost::Rank0 => "rank 0",
            StoreHost::Etcd => "etcd",
        },
        match fault {
            Fault::Kill => "kill -9",
            Fault::Stop => "SIGSTOP",
            Fault::LinkDown => "link down",
            Fault::Netem => "netem delay 20±5 ms, loss 2%, on",
        }
    );
    let bound = match fault {
        Fault::Kill => KILL_BOUND,
        Fault::Stop | Fault::LinkDown | Fault::Netem => HB_TIMEOUT + 2 * HB_INTERVAL,
    }
    .mul_f64(slack);
    let fail = |note: String| Row {
        name: name.clone(),
        survivors: WORLD - 1,
        median: None,
        max: None,
        blamed: "-".into(),
        pass: false,
        skip: false,
        note,
    };
    let job = format!("fault-matrix-{}-{n}", std::process::id());
    struct Qdisc<'a>(&'a Net, usize, bool);
    impl Drop for Qdisc<'_> {
        fn drop(&mut self) {
            if self.2 {
                self.0
                    .in_ns(self.1, &["tc", "qdisc", "del", "dev", "eth0", "root"]);
            }
        }
    }
    let _qdisc = Qdisc(net, victim, fault == Fault::Netem);
    if fault == Fault::Netem {
        let mut args = vec!["tc", "qdisc", "add", "dev", "eth0", "root", "netem"];
        args.extend_from_slice(&NETEM);
        if !net.in_ns(victim, &args) {
            return Row {
                skip: true,
                ..fail("this kernel has no netem qdisc (sch_netem)".into())
            };
        }
    }
    let job = match spawn_job(net, host, store_addr, &job) {
        Ok(j) => j,
        Err(e) => return fail(format!("cannot start the ranks: {e}")),
    };
    let deadline = Instant::now() + SCENARIO_DEADLINE;
    let mut running = [false; WORLD];
    while running.iter().any(|r| !r) {
        match job
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            Ok((r, l)) if l.starts_with("@@running") => running[r] = true,
            Ok((r, l)) if l.starts_with("@@") => {
                return fail(format!("rank {r} before the fault: {l}"))
            }
            Ok(_) => {}
            Err(_) => return fail("the job did not start in time".into()),
        }
    }
    if fault == Fault::Netem {
        return Row {
            name,
            survivors: WORLD,
            median: None,
            max: None,
            blamed: "-".into(),
            pass: true,
            skip: false,
            note: "every rank ran 20 correct all-reduces".into(),
        };
    }
    let t0 = now_us();
    let injected = match fault {
        Fault::Netem => true,
        Fault::Kill => signal(&job.children[victim], libc::SIGKILL),
        Fault::Stop => signal(&job.children[victim], libc::SIGSTOP),
        Fault::LinkDown => net.in_ns(victim, &["ip", "link", "set", "eth0", "down"]),
    };
    // Restore the link whatever happens next (the namespaces are reused).
    struct Restore<'a>(&'a Net, usize, bool);
    impl Drop for Restore<'_> {
        fn drop(&mut self) {
            if self.2 {
                self.0.in_ns(self.1, &["ip", "link", "set", "eth0", "up"]);
            }
        }
    }
    let _restore = Restore(net, victim, fault == Fault::LinkDown);
    if !injected {
        return fail(format!("cannot inject {fault:?} on rank {victim}"));
    }
    // Per survivor: detection time, blamed ranks, the error's text.
    let mut seen: Vec<Option<(Duration, String, String)>> = vec![None; WORLD];
    let survivors: Vec<usize> = (0..WORLD).filter(|&r| r != victim).collect();
    while survivors.iter().any(|&r| seen[r].is_none()) {
        match job
            .lines
            .recv_timeout(deadline.saturating_duration_since(Instant::now()))
        {
            Ok((r, l)) => {
                let mut it = l.split_whitespace();
                if it.next() != Some("@@error") {
                    continue;
                }
                let at: u128 = it.next().and_then(|v| v.parse().ok()).unwrap_or(t0);
                let _rank = it.next();
                let blamed = it.next().unwrap_or("[]").to_string();
                let text = it.collect::<Vec<_>>().join(" ");
                let dt = Duration::from_micros(at.saturating_sub(t0) as u64);
                seen[r] = Some((dt, blamed, text));
            }
            Err(_) => {
                let missing: Vec<usize> = survivors
                    .iter()
                    .copied()
                    .filter(|&r| seen[r].is_none())
                    .collect();
                return fail(format!(
                    "ranks {missing:?} saw no error within {SCENARIO_DEADLINE:?}"
                ));
            }
        }
    }
    let mut times: Vec<Duration> = survivors
        .iter()
        .filter_map(|&r| seen[r].as_ref().map(|s| s.0))
        .collect();
    times.sort();
    let want = format!("[{victim}]");
    // Losing the store is its own cause: when the victim hosts it, a
    // survivor may report the store rather than the rank.
    let store_victim = host == StoreHost::Rank0 && victim == 0;
    let blamed: Vec<String> = survivors
        .iter()
        .map(|&r| {
            let b = seen[r].as_ref().map(|s| s.1.clone()).unwrap_or_default();
            format!("r{r}:{b}")
        })
        .collect();
    let wrong: Vec<usize> = survivors
        .iter()
        .copied()
        .filter(|&r| {
            seen[r]
                .as_ref()
                .map(|s| s.1 != want && !(store_victim && s.1 == "store"))
                .unwrap_or(true)
        })
        .collect();
    let max = times.last().copied();
    let late = max.is_some_and(|m| m > bound);
    let mut note = Vec::new();
    if !wrong.is_empty() {
        note.push(format!(
            "ranks {wrong:?} named neither exactly rank {victim}{}",
            if store_victim { " nor the store" } else { "" }
        ));
        for &r in &wrong {
            if let Some((_, _, text)) = &seen[r] {
                note.push(format!("r{r}: {text}"));
            }
        }
    }
    if late {
        note.push(format!("slower than the {bound:?} bound"));
    }
    Row {
        name,
        survivors: survivors.len(),
        median: times.get(times.len() / 2).copied(),
        max,
        blamed: blamed.join(" "),
        pass: wrong.is_empty() && !late,
        skip: false,
        note: if note.is_empty() {
            format!("bound {bound:?}")
        } else {
            note.join("; ")
        },
    }
}

fn main() -> std::process::ExitCode {
    if std::env::var_os("FAULT_MATRIX_RANK").is_some() {
        return rank_main();
    }
    let mut slack = 1.0f64;
    let mut net = Net { netns: None };
    let mut hosts = vec![StoreHost::Launcher, StoreHost::Rank0];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        let v = args.next();
        match (a.as_str(), v) {
            ("--slack", Some(v)) if v.parse::<f64>().is_ok_and(|v| v >= 1.0) => {
                slack = v.parse().unwrap_or(1.0)
            }
            ("--netns", Some(p)) if !p.is_empty() => net.netns = Some(p),
            ("--store", Some(h)) if h == "launcher" => hosts = vec![StoreHost::Launcher],
            ("--store", Some(h)) if h == "rank0" => hosts = vec![StoreHost::Rank0],
            ("--store", Some(h)) if h == "etcd" => hosts = vec![StoreHost::Etcd],
            _ => {
                eprintln!(
                    "usage: fault_matrix [--slack FACTOR>=1] [--netns PREFIX] [--store launcher|rank0|etcd]"
                );
                return std::process::ExitCode::from(2);
            }
        }
    }
    // The launcher-hosted store, as chorus-run runs it: it outlives any rank.
    let rt = match tokio::runtime::Runtime::new() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("fault_matrix: cannot start a runtime: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let server = match rt.block_on(chorus::transport::RendezvousServer::bind(
        std::net::SocketAddr::new(net.store_ip().parse().expect("a valid IP address"), 0),
        b"fault-matrix-secret",
    )) {
        Ok(s) => s,
        Err(e) => {
            eprintln!("fault_matrix: cannot start the store: {e}");
            return std::process::ExitCode::from(2);
        }
    };
    let addr = server.local_addr().to_string();
    let etcd = if hosts.contains(&StoreHost::Etcd) {
        if !cfg!(feature = "etcd") {
            eprintln!("fault_matrix: --store etcd needs a build with --features etcd");
            return std::process::ExitCode::from(2);
        }
        if net.netns.is_some() {
            eprintln!("fault_matrix: --store etcd runs on loopback only, not with --netns");
            return std::process::ExitCode::from(2);
        }
        match start_etcd() {
            Ok(e) => Some(e),
            Err(e) => {
                eprintln!("fault_matrix: {e}");
                return std::process::ExitCode::from(2);
            }
        }
    } else {
        None
    };
    let mut scenarios = vec![
        (StoreHost::Launcher, Fault::Kill, 0),
        (StoreHost::Launcher, Fault::Kill, 2),
        (StoreHost::Launcher, Fault::Stop, 0),
        (StoreHost::Launcher, Fault::Stop, 2),
        (StoreHost::Rank0, Fault::Kill, 0),
        (StoreHost::Rank0, Fault::Kill, 2),
        (StoreHost::Rank0, Fault::Stop, 0),
        (StoreHost::Rank0, Fault::Stop, 2),
        (StoreHost::Etcd, Fault::Kill, 0),
        (StoreHost::Etcd, Fault::Kill, 2),
        (StoreHost::Etcd, Fault::Stop, 0),
        (StoreHost::Etcd, Fault::Stop, 2),
    ];
    if net.netns.is_some() {
        scenarios.push((StoreHost::Launcher, Fault::LinkDown, 2));
        scenarios.push((StoreHost::Rank0, Fault::LinkDown, 2));
        scenarios.push((StoreHost::Launcher, Fault::Netem, 2));
    }
    scenarios.retain(|(h, _, _)| hosts.contains(h));
    println!("| scenario | survivors | detection median | detection max | blamed | verdict |");
    println!("|---|---|---|---|---|---|");
    let mut all_pass = true;
    for (n, (host, fault, victim)) in scenarios.into_iter().enumerate() {
        let store_addr = match (&etcd, host) {
            (Some(e), StoreHost::Etcd) => e.endpoint.as_str(),
            _ => addr.as_str(),
        };
        let row = run_scenario(&net, host, fault, victim, store_addr, slack, n);
        let ms = |d: Option<Duration>| {
            d.map(|d| format!("{:.1} ms", d.as_secs_f64() * 1e3))
                .unwrap_or_else(|| "-".into())
        };
        println!(
            "| {} | {} | {} | {} | {} | {} ({}) |",
            row.name,
            row.survivors,
            ms(row.median),
            ms(row.max),
            row.blamed,
            if row.skip {
                "skip"
            } else if row.pass {
                "pass"
            } else {
                "FAIL"
            },
            row.note
        );
        all_pass &= row.pass || row.skip;
    }
    drop(server);
    drop(etcd);
    if all_pass {
        std::process::ExitCode::SUCCESS
    } else {
        std::process::ExitCode::FAILURE
    }
}
