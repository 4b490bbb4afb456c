//! T-3: sizes from a user or a peer never abort the process when memory
//! runs out; they give a typed error.
//!
//! Each scenario runs in a child process (this test binary re-executed as
//! the ignored test `alloc_child`) whose address space is capped with
//! `RLIMIT_AS` a little above what it already uses, so an allocation the
//! size of the cap fails for real. Before the fix such an allocation
//! aborted the child (SIGABRT, exit 134). Every child is killed if it runs
//! past its deadline.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use chorus::transport::MemoryStore;
use chorus::{new_comm, CommOptions, DType, Device, Error, Rendezvous, Tensor};

const DEADLINE: Duration = Duration::from_secs(60);
/// Room left above the child's current address space.
const HEADROOM: u64 = 192 << 20;
/// A block larger than [`HEADROOM`]: it can never fit under the cap.
const BIG: usize = 512 << 20;

/// The child's virtual size in bytes, from /proc/self/status.
fn vm_size() -> u64 {
    let status = std::fs::read_to_string("/proc/self/status").expect("read /proc/self/status");
    let line = status
        .lines()
        .find(|l| l.starts_with("VmSize:"))
        .expect("VmSize line");
    let kb: u64 = line
        .split_whitespace()
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("VmSize value");
    kb << 10
}

/// Cap this process's address space at its current size plus [`HEADROOM`].
fn cap_address_space() {
    let cap = vm_size() + HEADROOM;
    let lim = libc::rlimit {
        rlim_cur: cap as libc::rlim_t,
        rlim_max: cap as libc::rlim_t,
    };
    // SAFETY: plain syscall on a valid struct.
    let rc = unsafe { libc::setrlimit(libc::RLIMIT_AS, &lim) };
    assert_eq!(rc, 0, "setrlimit(RLIMIT_AS)");
}

struct Kids(Vec<Child>);

impl Drop for Kids {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn spawn_child(
    mode: &str,
    envs: &[(&str, String)],
    tx: &mpsc::Sender<(usize, String)>,
    id: usize,
) -> Child {
    let exe = std::env::current_exe().expect("current exe");
    let mut cmd = Command::new(exe);
    cmd.args([
        "--ignored",
        "--exact",
        "alloc_child",
        "--nocapture",
        "--test-threads=1",
    ])
    .env("CHORUS_ALLOC_CHILD", mode)
    // One malloc arena: threads do not each reserve 64 MiB of address space.
    .env("MALLOC_ARENA_MAX", "1")
    .env_remove("CHORUS_RANK")
    .env_remove("CHORUS_SIZE")
    .stdout(Stdio::piped())
    .stderr(Stdio::inherit());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    let mut child = cmd.spawn().expect("spawn child");
    let out = child.stdout.take().expect("stdout");
    let tx = tx.clone();
    std::thread::spawn(move || {
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            if tx.send((id, line)).is_err() {
                break;
            }
        }
    });
    child
}

/// Wait for child `id` to exit; return its status and its `@@` lines.
fn wait_child(
    kids: &mut Kids,
    id: usize,
    lines: &mpsc::Receiver<(usize, String)>,
    seen: &mut Vec<(usize, String)>,
    deadline: Instant,
) -> std::process::ExitStatus {
    loop {
        while let Ok((i, l)) = lines.try_recv() {
            if let Some(at) = l.find("@@") {
                seen.push((i, l[at..].to_string()));
            }
        }
        if let Some(st) = kids.0[id].try_wait().expect("try_wait") {
            // Drain what it printed before exiting.
            while let Ok((i, l)) = lines.recv_timeout(Duration::from_millis(200)) {
                if let Some(at) = l.find("@@") {
                    seen.push((i, l[at..].to_string()));
                }
            }
            return st;
        }
        assert!(Instant::now() < deadline, "child {id} did not exit in time");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn expect_clean_exit(st: std::process::ExitStatus, what: &str) {
    use std::os::unix::process::ExitStatusExt;
    assert!(
        st.signal().is_none(),
        "{what}: killed by signal {:?} (an allocation aborted the process)",
        st.signal()
    );
    assert!(st.success(), "{what}: exit status {st}");
}

/// The body of the child processes (run by the tests below, not on its own).
#[test]
#[ignore = "child body for the RLIMIT_AS tests; run by them"]
fn alloc_child() {
    let Ok(mode) = std::env::var("CHORUS_ALLOC_CHILD") else {
        return;
    };
    match mode.as_str() {
        "user" => user_sizes_under_cap(),
        "peer-victim" => peer_sizes_under_cap(),
        "peer-sender" => peer_sender(),
        other => panic!("unknown child mode {other}"),
    }
}

fn user_sizes_under_cap() {
    let store: Arc<dyn chorus::transport::Store> = Arc::new(MemoryStore::new());
    let comm = new_comm(
        "cpu",
        Device::Cpu,
        "alloc-user",
        CommOptions::default()
            .with_rank(0, 1)
            .with_rendezvous(Rendezvous::Store(store)),
    )
    .expect("world of one");
    // Reserved before the cap (zero pages, never touched): splitting or
    // concatenating it needs as much again, which the cap refuses.
    let held = Tensor::zeros(DType::U8, BIG);
    cap_address_space();

    assert!(
        Tensor::try_zeros(DType::U8, BIG).is_none(),
        "try_zeros above the cap must be None"
    );
    assert!(
        held.split(&[BIG / 2, BIG / 2]).is_none(),
        "split above the cap must be None"
    );
    assert!(
        Tensor::concat(DType::U8, std::slice::from_ref(&held)).is_none(),
        "concat above the cap must be None"
    );
    match comm.all_gather_v(Tensor::zeros(DType::U8, 1), &[BIG]) {
        Err(Error::InvalidArgument { .. }) => {}
        other => panic!("all_gather_v of {BIG} bytes: expected InvalidArgument, got {other:?}"),
    }
    match comm.all_gather_v(Tensor::zeros(DType::F32, 1), &[1 << 40]) {
        Err(Error::InvalidArgument { .. }) => {}
        other => panic!("all_gather_v of 2^40 x f32: expected InvalidArgument, got {other:?}"),
    }
    // The communicator is still usable afterwards.
    let out = comm
        .all_gather_v(Tensor::from_vec(vec![7u8]), &[1])
        .expect("small all_gather_v");
    assert_eq!(out.as_slice::<u8>(), &[7]);
    println!("@@ok user");
}

fn connect_pair(name: &str) -> chorus::Comm {
    new_comm(
        "cpu",
        Device::Cpu,
        name,
        CommOptions::default()
            .with_timeout(Duration::from_secs(20))
            .with_connect_timeout(Duration::from_secs(20)),
    )
    .expect("connect the pair")
}

fn peer_sizes_under_cap() {
    let comm = connect_pair("alloc-peer");
    cap_address_space();
    // Rank 1 announces BIG bytes for this rank, more than the cap allows.
    let inputs = vec![Tensor::zeros(DType::U8, 4), Tensor::zeros(DType::U8, 4)];
    match comm.all_to_all(inputs) {
        Err(e @ (Error::Mismatch { .. } | Error::PeerFailed { .. })) => {
            println!("@@ok peer {e}");
        }
        other => panic!("all_to_all with a {BIG}-byte block announced: got {other:?}"),
    }
}

fn peer_sender() {
    let comm = connect_pair("alloc-peer");
    let inputs = vec![Tensor::zeros(DType::U8, BIG), Tensor::zeros(DType::U8, 4)];
    // The victim refuses; this rank sees its failure as an error.
    let r = comm.all_to_all(inputs);
    println!("@@sender {}", if r.is_err() { "error" } else { "ok" });
}

#[test]
fn user_sizes_above_the_address_space_cap_give_invalid_argument_not_abort() {
    let (tx, rx) = mpsc::channel();
    let deadline = Instant::now() + DEADLINE;
    let mut kids = Kids(vec![spawn_child("user", &[], &tx, 0)]);
    let mut seen = Vec::new();
    let st = wait_child(&mut kids, 0, &rx, &mut seen, deadline);
    expect_clean_exit(st, "user-size child");
    assert!(
        seen.iter().any(|(_, l)| l == "@@ok user"),
        "child did not report success: {seen:?}"
    );
}

#[test]
fn peer_announced_block_above_the_cap_gives_typed_error_not_abort() {
    let port = std::net::UdpSocket::bind("127.0.0.1:0")
        .and_then(|s| s.local_addr())
        .expect("free port")
        .port();
    let env = |rank: usize| {
        vec![
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", "2".to_string()),
            ("MASTER_ADDR", "127.0.0.1".to_string()),
            ("MASTER_PORT", port.to_string()),
            ("CHORUS_SECRET", "alloc-limits".to_string()),
        ]
    };
    let (tx, rx) = mpsc::channel();
    let deadline = Instant::now() + DEADLINE;
    let mut kids = Kids(vec![
        spawn_child("peer-victim", &env(0), &tx, 0),
        spawn_child("peer-sender", &env(1), &tx, 1),
    ]);
    let mut seen = Vec::new();
    let st = wait_child(&mut kids, 0, &rx, &mut seen, deadline);
    expect_clean_exit(st, "victim rank");
    assert!(
        seen.iter()
            .any(|(i, l)| *i == 0 && l.starts_with("@@ok peer")),
        "victim did not report a typed error: {seen:?}"
    );
    let st = wait_child(&mut kids, 1, &rx, &mut seen, deadline);
    expect_clean_exit(st, "sender rank");
    assert!(
        seen.iter().any(|(i, l)| *i == 1 && l == "@@sender error"),
        "sender should see the victim's failure: {seen:?}"
    );
}
