//! Shared helpers for multi-rank integration tests: run N ranks as threads of
//! this process, each with its own communicator, sharing one in-memory store,
//! bounded in time.
#![allow(dead_code)]

pub mod hooked;
pub mod memnet;
pub mod mismatch;

use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use chorus::transport::{MemoryStore, Store};
use chorus::{new_comm, Comm, CommOptions, DType, Device, Rendezvous, Tensor};

/// Every multi-rank test finishes within this, or fails (never hangs CI).
pub const TEST_DEADLINE: Duration = Duration::from_secs(60);

/// The backend the shared suite runs on: `CHORUS_TEST_BACKEND` (e.g.
/// `gloo`, with the matching cargo feature), else `cpu`. GPU backends put
/// rank `r` on device `r`.
pub fn test_backend() -> String {
    std::env::var("CHORUS_TEST_BACKEND").unwrap_or_else(|_| "cpu".to_string())
}

/// The device of `rank` for [`test_backend`].
pub fn test_device(backend: &str, rank: usize) -> Device {
    match backend {
        "nccl" | "rccl" => Device::Cuda(rank),
        _ => Device::Cpu,
    }
}

/// Options for rank `rank` of `size` on a shared store.
pub fn opts(store: &Arc<dyn Store>, rank: usize, size: usize) -> CommOptions {
    CommOptions::default()
        .with_rank(rank, size)
        .with_rendezvous(Rendezvous::Store(store.clone()))
        .with_secret("test-secret")
        .with_timeout(Duration::from_secs(30))
        .with_connect_timeout(Duration::from_secs(20))
}

/// Run `f` on `size` ranks (threads), each with a communicator called `name`,
/// and return the results by rank. Panics (failing the test) if any rank
/// panics or the whole run exceeds [`TEST_DEADLINE`].
pub fn run_ranks<T, F>(size: usize, name: &str, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(Comm) -> T + Send + Sync + 'static,
{
    run_ranks_with(size, name, |_r, o| o, f)
}

/// Like [`run_ranks`], with a hook to adjust each rank's options.
pub fn run_ranks_with<T, F, O>(size: usize, name: &str, tweak: O, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(Comm) -> T + Send + Sync + 'static,
    O: Fn(usize, CommOptions) -> CommOptions + Send + Sync + 'static,
{
    run_ranks_on(&test_backend(), size, name, tweak, f)
}

/// Like [`run_ranks_with`], on the named backend.
pub fn run_ranks_on<T, F, O>(backend: &str, size: usize, name: &str, tweak: O, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(Comm) -> T + Send + Sync + 'static,
    O: Fn(usize, CommOptions) -> CommOptions + Send + Sync + 'static,
{
    let backend = backend.to_string();
    if backend == "mpi" {
        return run_this_mpi_rank(size, name, tweak, f);
    }
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let f = Arc::new(f);
    let tweak = Arc::new(tweak);
    let (tx, rx) = mpsc::channel();
    for rank in 0..size {
        let (f, tweak, tx, store, name, backend) = (
            f.clone(),
            tweak.clone(),
            tx.clone(),
            store.clone(),
            name.to_string(),
            backend.clone(),
        );
        std::thread::Builder::new()
            .name(format!("rank-{rank}"))
            .spawn(move || {
                let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let comm = new_comm(
                        &backend,
                        test_device(&backend, rank),
                        &name,
                        tweak(rank, opts(&store, rank, size)),
                    )
                    .unwrap_or_else(|e| panic!("rank {rank}: new_comm failed: {e}"));
                    assert_eq!(
                        comm.backend(),
                        backend,
                        "the suite runs on the asked backend"
                    );
                    f(comm)
                }));
                let _ = tx.send((rank, result));
            })
            .expect("spawn rank thread");
    }
    drop(tx);
    let deadline = std::time::Instant::now() + TEST_DEADLINE;
    let mut out: Vec<Option<T>> = (0..size).map(|_| None).collect();
    for _ in 0..size {
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        match rx.recv_timeout(left) {
            Ok((rank, Ok(v))) => out[rank] = Some(v),
            Ok((rank, Err(p))) => {
                let msg = p
                    .downcast_ref::<String>()
                    .cloned()
                    .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                    .unwrap_or_default();
                panic!("rank {rank} panicked: {msg}");
            }
            Err(_) => panic!("ranks did not finish within {TEST_DEADLINE:?} (hang)"),
        }
    }
    out.into_iter()
        .map(|v| v.expect("every rank reported"))
        .collect()
}

/// Under `mpirun -n N` (backend `mpi`) each process is one rank: run `f`
/// on this process's rank when the test wants a world of `N`, else skip
/// (printed). Rendezvous through `MASTER_ADDR`/`MASTER_PORT`, which the CI
/// script exports. Run with `--test-threads 1` so every process creates its
/// communicators in the same order. Returns this rank's result only.
fn run_this_mpi_rank<T, F, O>(size: usize, name: &str, tweak: O, f: F) -> Vec<T>
where
    F: Fn(Comm) -> T,
    O: Fn(usize, CommOptions) -> CommOptions,
{
    let env = |k: &str| std::env::var(k).ok().and_then(|v| v.parse::<usize>().ok());
    let (Some(rank), Some(world)) = (env("OMPI_COMM_WORLD_RANK"), env("OMPI_COMM_WORLD_SIZE"))
    else {
        eprintln!("SKIP {name}: backend mpi needs mpirun (no OMPI_COMM_WORLD_RANK/SIZE)");
        return Vec::new();
    };
    if world != size {
        eprintln!("SKIP {name}: needs mpirun -n {size}, this job has {world}");
        return Vec::new();
    }
    // A fresh store port per communicator (rank 0 hosts it; the previous
    // one may still be closing): MASTER_PORT + k for the k-th, the same k
    // on every process because every process runs the same tests in order.
    static NEXT: std::sync::atomic::AtomicU16 = std::sync::atomic::AtomicU16::new(0);
    let k = NEXT.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    let base: u16 = std::env::var("MASTER_PORT")
        .ok()
        .and_then(|p| p.parse().ok())
        .unwrap_or(29500);
    let addr = std::net::SocketAddr::from(([127, 0, 0, 1], base.wrapping_add(k)));
    let o = CommOptions::default()
        .with_rendezvous(Rendezvous::Master(addr))
        .with_rank(rank, size)
        .with_secret("test-secret")
        .with_timeout(Duration::from_secs(60))
        .with_connect_timeout(Duration::from_secs(30));
    let comm = new_comm("mpi", Device::Cpu, name, tweak(rank, o))
        .unwrap_or_else(|e| panic!("rank {rank}: new_comm failed: {e}"));
    assert_eq!(comm.backend(), "mpi");
    vec![f(comm)]
}

/// Deterministic small test values (exact in every dtype, sums fit in i8).
pub fn value(rank: usize, i: usize) -> f64 {
    (1 + (rank * 3 + i) % 5) as f64
}

/// A tensor of `dtype` with `count` elements of [`value`] for `rank`.
pub fn input(dtype: DType, rank: usize, count: usize) -> Tensor {
    let v: Vec<f64> = (0..count).map(|i| value(rank, i)).collect();
    Tensor::from_f64s(dtype, &v)
}

/// Compare with a tolerance suited to the dtype.
pub fn assert_close(dtype: DType, got: &Tensor, want: &[f64], what: &str) {
    assert_eq!(got.dtype(), dtype, "{what}: dtype");
    let g = got.to_f64_vec();
    assert_eq!(g.len(), want.len(), "{what}: length");
    let tol = match dtype {
        DType::F16 | DType::BF16 => 1e-2,
        DType::F32 => 1e-6,
        DType::F64 => 1e-12,
        _ => 0.0,
    };
    for (i, (a, b)) in g.iter().zip(want).enumerate() {
        let err = (a - b).abs();
        assert!(
            err <= tol * b.abs().max(1.0),
            "{what}: element {i}: got {a}, want {b}"
        );
    }
}

/// Run this test binary's ignored test `name` in a child process, with the
/// environment variable `flag` set to `1` (so the test knows it is the
/// child) and `CHORUS_SHM` unset, for tests that must change process-wide
/// state (resource limits). Panics with the child's output if it fails,
/// does not print `@@ checked`, or runs past `limit` (it is killed then).
pub fn run_child_test(name: &str, flag: &str, limit: Duration) {
    use std::process::{Command, Stdio};
    let exe = std::env::current_exe().expect("current exe");
    let mut child = Command::new(exe)
        .args(["--ignored", "--exact", name, "--nocapture"])
        .env(flag, "1")
        .env_remove("CHORUS_SHM")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn the child test");
    let deadline = std::time::Instant::now() + limit;
    loop {
        if let Some(status) = child.try_wait().expect("wait") {
            let out = child.wait_with_output().expect("output");
            let stdout = String::from_utf8_lossy(&out.stdout);
            assert!(
                status.success(),
                "{name} failed: {stdout}\n{}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                stdout.contains("@@ checked"),
                "{name} did not run its checks:\n{stdout}"
            );
            return;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("{name} did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Publish, as rank `init.rank`'s `cpu` data-link record, the address of a
/// listener that is already closed: what a process killed between
/// publishing its record and accepting leaves behind.
pub async fn publish_dead_listener(init: &chorus::backends::BackendInit) {
    let closed = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = closed.local_addr().expect("address");
    drop(closed);
    init.store
        .set(
            &format!("{}/cpu/rank/{}", init.key_prefix, init.rank),
            format!("{addr}\n").into_bytes(),
        )
        .await
        .expect("publish the record");
}
