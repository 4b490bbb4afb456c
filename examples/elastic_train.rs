//! Elastic data-parallel training, toy edition.
//!
//! `cargo run --example elastic_train` launches 4 ranks (copies of this
//! program) that train one parameter by all-reducing their gradients. Mid-run
//! the launcher kills rank 3 with SIGKILL: the survivors get a typed
//! `PeerFailed`, call `reconfigure()` and continue as 3 ranks in epoch 1.
//! The launcher then restarts the killed rank, which joins through
//! `join_comm`; at the next step boundary everyone reconfigures into epoch 2
//! with 4 ranks again. Every step checks that the gradient sum equals the
//! number of ranks, and every rank ends with the same parameter.
//!
//! Each iteration starts with a small control broadcast from rank 0 (step,
//! parameter, pending joiners), so a joiner learns where training is and all
//! ranks agree on when to grow.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use chorus::{
    join_comm, new_comm, Comm, CommOptions, Device, Error, ReconfigureOptions, ReduceOp, Tensor,
};

/// Steps of training.
pub const STEPS: u64 = 40;
/// Learning rate: each step moves the parameter by `-LR * mean gradient`.
pub const LR: f64 = 0.125;
const WORLD: usize = 4;
const NAME: &str = "elastic-train";

fn options() -> CommOptions {
    CommOptions::default()
        .with_heartbeat(Duration::from_millis(100), Duration::from_secs(1))
        .with_timeout(Duration::from_secs(20))
        .with_connect_timeout(Duration::from_secs(20))
}

/// The body of one rank: `ELASTIC_ROLE=rank` (started with the job) or
/// `joiner` (restarted after a failure). Prints `@@` lines the launcher reads.
pub fn run_rank() -> Result<(), Error> {
    let joiner = std::env::var("ELASTIC_ROLE").as_deref() == Ok("joiner");
    let mut comm: Comm = if joiner {
        join_comm("cpu", Device::Cpu, NAME, options())?
    } else {
        new_comm("cpu", Device::Cpu, NAME, options())?
    };
    println!(
        "@@ready epoch={} rank={} size={}",
        comm.epoch(),
        comm.rank(),
        comm.size()
    );
    let mut step: u64 = 0;
    let mut param: f64 = 0.0;
    while step < STEPS {
        match iteration(&comm, &mut step, &mut param) {
            Ok(None) => {}
            Ok(Some(joiners)) => {
                let (next, map) = comm.reconfigure(ReconfigureOptions {
                    wait_joiners: joiners,
                    ..Default::default()
                })?;
                println!(
                    "@@grew epoch={} size={} map={:?}",
                    map.epoch, map.size, map.old_to_new
                );
                comm = next;
            }
            Err(e) if e.is_fatal() => {
                println!("@@failure {e}");
                let (next, map) = comm.reconfigure(ReconfigureOptions::default())?;
                println!(
                    "@@shrunk epoch={} size={} map={:?}",
                    map.epoch, map.size, map.old_to_new
                );
                comm = next;
            }
            Err(e) => return Err(e),
        }
    }
    println!(
        "@@final param={param} epoch={} size={}",
        comm.epoch(),
        comm.size()
    );
    comm.finalize()
}

/// One training step. Returns `Some(n)` when `n` joiners wait and every rank
/// must reconfigure before training on.
fn iteration(comm: &Comm, step: &mut u64, param: &mut f64) -> Result<Option<usize>, Error> {
    // Control: rank 0 says which step this is, the parameter, and how many
    // ranks wait to join. (It waits for the restarted rank when asked to, so
    // the demo always shows a rejoin.)
    let mut pending = 0;
    if comm.rank() == 0 {
        pending = comm.pending_joiners()?;
        if pending == 0 && comm.size() < WORLD && std::env::var("ELASTIC_AWAIT_REJOIN").is_ok() {
            let deadline = Instant::now() + Duration::from_secs(20);
            while pending == 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(20));
                pending = comm.pending_joiners()?;
            }
        }
    }
    let ctl = Tensor::from_vec(vec![*step as f64, *param, pending as f64]);
    let ctl = comm.broadcast(ctl, 0)?.to_vec::<f64>();
    (*step, *param) = (ctl[0] as u64, ctl[1]);
    if ctl[2] > 0.0 {
        return Ok(Some(ctl[2] as usize));
    }
    // "Backward pass": every rank's gradient is 1.0 (plus simulated compute).
    std::thread::sleep(Duration::from_millis(10));
    let grads = Tensor::full(1.0f64, 4096);
    let sum = comm.all_reduce(grads, ReduceOp::Sum)?;
    let n = comm.size() as f64;
    if sum.as_slice::<f64>().iter().any(|&g| g != n) {
        return Err(Error::Internal(format!(
            "gradient sum is not {n}: data corrupted"
        )));
    }
    *param -= LR * sum.as_slice::<f64>()[0] / n;
    *step += 1;
    println!("@@step {step} epoch={} size={}", comm.epoch(), comm.size());
    Ok(None)
}

/// What a launch observed.
#[derive(Debug)]
pub struct Summary {
    /// `@@final` line of each rank that finished (launch ranks 0..3, then the joiner).
    pub finals: Vec<String>,
    /// `@@failure` lines seen (one per survivor).
    pub failures: Vec<String>,
}

struct Procs(Vec<Child>);
impl Drop for Procs {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Launch the job: `cmd()` builds the command of one rank (this program, or
/// a test binary that calls [`run_rank`]). Kills rank 3 after its 5th step,
/// restarts it as a joiner once the others shrank, and waits for all four to
/// finish (bounded by `deadline`).
pub fn launch(cmd: impl Fn() -> Command, deadline: Duration) -> Result<Summary, String> {
    let deadline = Instant::now() + deadline;
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .map_err(|e| e.to_string())?
        .port();
    let (tx, rx) = mpsc::channel::<(usize, String)>();
    let start = |id: usize, role: &str| -> Result<Child, String> {
        let mut c = cmd();
        c.env("ELASTIC_ROLE", role)
            .env("ELASTIC_AWAIT_REJOIN", "1")
            .env("RANK", id.min(WORLD - 1).to_string())
            .env("WORLD_SIZE", WORLD.to_string())
            .env("MASTER_ADDR", "127.0.0.1")
            .env("MASTER_PORT", port.to_string())
            .env("CHORUS_SECRET", "elastic-train-demo")
            .env_remove("CHORUS_RANK")
            .env_remove("CHORUS_SIZE")
            .env_remove("CHORUS_STORE_ADDR")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = c.spawn().map_err(|e| format!("spawn rank {id}: {e}"))?;
        let out = child.stdout.take().ok_or("no stdout")?;
        let tx = tx.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                if let Some(at) = line.find("@@") {
                    if tx.send((id, line[at..].to_string())).is_err() {
                        break;
                    }
                }
            }
        });
        Ok(child)
    };
    let mut procs = Procs(Vec::new());
    for r in 0..WORLD {
        procs.0.push(start(r, "rank")?);
    }
    let mut killed = false;
    let mut shrunk = 0;
    let mut finals = vec![];
    let mut failures = vec![];
    while finals.len() < WORLD {
        let left = deadline.saturating_duration_since(Instant::now());
        let (id, line) = rx
            .recv_timeout(left)
            .map_err(|_| format!("timed out; finished: {finals:?}, failures: {failures:?}"))?;
        println!("[{id}] {line}");
        if id == 3 && !killed && line.starts_with("@@step 5 ") {
            procs.0[3].kill().map_err(|e| e.to_string())?; // SIGKILL
            let _ = procs.0[3].wait();
            killed = true;
            println!("launcher: killed rank 3 (SIGKILL)");
        } else if line.starts_with("@@failure") {
            failures.push(line);
        } else if line.starts_with("@@shrunk") {
            shrunk += 1;
            if shrunk == WORLD - 1 {
                println!("launcher: survivors are in epoch 1; restarting rank 3 as a joiner");
                procs.0.push(start(WORLD, "joiner")?);
            }
        } else if line.starts_with("@@final") {
            finals.push(line);
        }
    }
    for c in &mut procs.0 {
        if let Ok(Some(st)) = c.try_wait() {
            let _ = st;
        }
    }
    Ok(Summary { finals, failures })
}

/// The parameter every rank must end with.
pub fn expected_param() -> f64 {
    -(STEPS as f64) * LR
}

#[allow(dead_code)]
fn main() {
    if std::env::var("ELASTIC_ROLE").is_ok() {
        if let Err(e) = run_rank() {
            eprintln!("rank failed: {e}");
            std::process::exit(1);
        }
        return;
    }
    let exe = match std::env::current_exe() {
        Ok(e) => e,
        Err(e) => {
            eprintln!("cannot find this program: {e}");
            std::process::exit(1);
        }
    };
    match launch(|| Command::new(&exe), Duration::from_secs(60)) {
        Ok(s) => {
            let want = format!("param={}", expected_param());
            let ok = s
                .finals
                .iter()
                .all(|f| f.contains(&want) && f.contains("size=4"));
            println!(
                "{} ranks finished; {} survivors saw the failure",
                s.finals.len(),
                s.failures.len()
            );
            if !ok {
                eprintln!("wrong final state: {:?} (want {want})", s.finals);
                std::process::exit(1);
            }
            println!("elastic training recovered from a killed rank and regrew to 4: OK");
        }
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(1);
        }
    }
}
