//! One-sided windows at the `Comm` level on the `cpu` backend: puts and
//! signals over shared memory (ranks as threads of one process share a
//! host) and over TCP only (`CHORUS_SHM=0`; nextest runs each test in its
//! own process, so the variable stays within the test), ordering of puts
//! before signals, several targets, timeouts, abort, peer death (a rank
//! process that dies), freeing at finalize and abort, and `UnsupportedOp`
//! on a backend without windows.

mod common;

use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus::backends::{async_trait, Backend, BackendInit, OpCtx, OpData};
use chorus::{new_comm, CommOptions, DType, Device, Error, Rendezvous, Tensor, WindowAccess};
/// Windows exist on the cpu backend only: these tests run there whatever
/// `CHORUS_TEST_BACKEND` says.
fn run_ranks<T, F>(size: usize, name: &str, f: F) -> Vec<T>
where
    T: Send + 'static,
    F: Fn(chorus::Comm) -> T + Send + Sync + 'static,
{
    common::run_ranks_on("cpu", size, name, |_, o| o, f)
}

fn tcp_only() {
    // Only this test's process reads it (one process per test).
    std::env::set_var("CHORUS_SHM", "0");
}

/// The `/dev/shm` files this process created (ring or window files).
fn my_shm_files() -> Vec<String> {
    let pid = std::process::id().to_string();
    std::fs::read_dir("/dev/shm")
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().into_string().ok())
                .filter(|n| n.starts_with("chorus-") && n.split('-').nth(2) == Some(&pid))
                .collect()
        })
        .unwrap_or_default()
}

/// Wait (bounded) until no window is alive: an aborted communicator frees
/// its backend right after the failing op completes.
fn no_windows_left() {
    let deadline = Instant::now() + Duration::from_secs(20);
    while chorus::debug::live_windows() != 0 {
        assert!(
            Instant::now() < deadline,
            "{} windows still alive",
            chorus::debug::live_windows()
        );
        std::thread::sleep(Duration::from_millis(5));
    }
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len).map(|i| seed.wrapping_add((i * 7) as u8)).collect()
}

/// Rank 0 pushes `len` bytes into rank 1's window at `offset` and signals;
/// rank 1 waits and checks; `access` is how each sees the other.
fn push_and_check(name: &str, len: usize, access: WindowAccess) {
    let offset = 24;
    run_ranks(2, name, move |comm| {
        let win = comm.new_window(offset + len).expect("new_window");
        assert_eq!(win.size(), offset + len);
        let peer = 1 - comm.rank();
        let attr = win.get_attr(peer).expect("attr");
        assert_eq!(attr.access_type, access);
        assert_eq!(attr.size, offset + len);
        assert_eq!(
            win.get_attr(comm.rank()).expect("own").access_type,
            WindowAccess::Unified
        );
        if comm.rank() == 0 {
            let back = win
                .put(Tensor::from_slice(&pattern(3, len)), 1, offset)
                .expect("put");
            assert_eq!(back.len_bytes(), len, "the buffer comes back");
            win.signal(1, 1).expect("signal");
        } else {
            win.wait_signal(0, 1).expect("wait_signal");
            assert_eq!(win.read(offset, len).expect("read"), pattern(3, len));
            assert_eq!(
                win.read(0, offset).expect("read"),
                vec![0; offset],
                "untouched bytes stay zero"
            );
        }
        comm.barrier().expect("barrier");
        comm.finalize().expect("finalize");
    });
}

#[test]
fn put_then_signal_is_visible_at_the_target_over_shared_memory() {
    push_and_check("win-shm", 4096, WindowAccess::Unified);
    assert!(my_shm_files().is_empty(), "left: {:?}", my_shm_files());
}

#[test]
fn put_then_signal_is_visible_at_the_target_over_tcp() {
    tcp_only();
    // Larger than one receive chunk, so the receiver reassembles it.
    push_and_check("win-tcp", (1 << 20) + 13, WindowAccess::Separate);
}

/// Rank 0 overwrites a slot and appends to a log before each signal; at
/// every count rank 1 must see at least that put (WN-2), never an older one.
fn puts_are_ordered_before_signals(name: &str) {
    const ROUNDS: u64 = 200;
    run_ranks(2, name, |comm| {
        let size = 8 + 8 * ROUNDS as usize;
        let win = comm.new_window(size).expect("new_window");
        if comm.rank() == 0 {
            let mut puts = Vec::new();
            let mut signals = Vec::new();
            for i in 1..=ROUNDS {
                puts.push(win.put_async(Tensor::from_slice(&[i]), 1, 0));
                puts.push(win.put_async(Tensor::from_slice(&[i * 10]), 1, 8 * i as usize));
                // Async signals and puts: ordered per target anyway.
                signals.push(win.signal_async(1, 1));
            }
            for p in puts {
                p.wait().expect("put");
            }
            for s in signals {
                s.wait().expect("signal");
            }
            comm.barrier().expect("barrier");
        } else {
            for i in 1..=ROUNDS {
                win.wait_signal(0, i).expect("wait_signal");
                let slot = win
                    .read_tensor(DType::U64, 0, 1)
                    .expect("read")
                    .to_vec::<u64>()[0];
                assert!(
                    slot >= i,
                    "signal {i} arrived before its put (slot holds {slot})"
                );
                let log = win
                    .read_tensor(DType::U64, 8, i as usize)
                    .expect("read log")
                    .to_vec::<u64>();
                let want: Vec<u64> = (1..=i).map(|k| k * 10).collect();
                assert_eq!(log, want, "a put before signal {i} is missing");
            }
            comm.barrier().expect("barrier");
        }
        comm.finalize().expect("finalize");
    });
}

#[test]
fn puts_land_before_the_later_signal_over_shared_memory() {
    puts_are_ordered_before_signals("win-order-shm");
}

#[test]
fn puts_land_before_the_later_signal_over_tcp() {
    tcp_only();
    puts_are_ordered_before_signals("win-order-tcp");
}

/// Every rank writes its block into every rank's window (its own too) and
/// signals each; every rank then has every block.
fn all_to_all_through_windows(name: &str) {
    const N: usize = 4;
    const BLOCK: usize = 1000;
    run_ranks(N, name, |comm| {
        let me = comm.rank();
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        rt.block_on(async {
            let win = comm.new_window_async(N * BLOCK).await.expect("new_window");
            let works: Vec<_> = (0..N)
                .map(|dst| {
                    win.put_async(
                        Tensor::from_slice(&pattern(me as u8, BLOCK)),
                        dst,
                        me * BLOCK,
                    )
                })
                .collect();
            for w in works {
                w.await.expect("put");
            }
            for dst in 0..N {
                win.signal_async(dst, 5).await.expect("signal");
            }
            for src in 0..N {
                win.wait_signal_async(src, 5).await.expect("wait");
            }
            for src in 0..N {
                let got = win.read_async(src * BLOCK, BLOCK).await.expect("read");
                assert_eq!(
                    got,
                    pattern(src as u8, BLOCK),
                    "rank {me}: block of rank {src}"
                );
            }
            comm.barrier_async().await.expect("barrier");
        });
        comm.finalize().expect("finalize");
    });
}

#[test]
fn every_rank_puts_into_every_window_over_shared_memory_world_4() {
    all_to_all_through_windows("win-multi-shm");
}

#[test]
fn every_rank_puts_into_every_window_over_tcp_world_4() {
    tcp_only();
    all_to_all_through_windows("win-multi-tcp");
}

#[test]
fn a_window_created_on_a_callers_runtime_keeps_receiving_after_that_runtime_stops() {
    tcp_only();
    run_ranks(2, "win-caller-rt", |comm| {
        // The creating turn may run on this runtime's worker; the window's
        // sockets and receiver tasks must not belong to it.
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let c = comm.clone();
        let win = rt
            .block_on(
                async move { tokio::spawn(async move { c.new_window_async(64).await }).await },
            )
            .expect("join")
            .expect("new_window");
        drop(rt);
        if comm.rank() == 0 {
            win.put_bytes(&[5; 16], 1, 8).expect("put");
            win.signal(1, 1).expect("signal");
        } else {
            win.with_timeout(Duration::from_secs(10))
                .wait_signal(0, 1)
                .expect("the receiver still runs");
            assert_eq!(win.read(8, 16).expect("read"), vec![5; 16]);
        }
        comm.barrier().expect("barrier");
        comm.finalize().expect("finalize");
    });
}

#[test]
fn window_ops_show_in_the_flight_record_without_sequence_numbers() {
    run_ranks(2, "win-record", |comm| {
        let win = comm.new_window(16).expect("new_window");
        let peer = 1 - comm.rank();
        win.put_bytes(&[1; 4], peer, 0).expect("put");
        win.signal(peer, 1).expect("signal");
        win.wait_signal(peer, 1).expect("wait");
        win.read(0, 4).expect("read");
        comm.barrier().expect("barrier");
        let rec = comm.flight_record();
        let ops: Vec<(&str, Option<u64>, Vec<usize>)> =
            rec.iter().map(|e| (e.op, e.seq, e.peers.clone())).collect();
        assert_eq!(
            ops,
            vec![
                ("new_window", Some(0), vec![]),
                ("window_put", None, vec![peer]),
                ("window_signal", None, vec![peer]),
                ("window_wait_signal", None, vec![peer]),
                ("window_read", None, vec![]),
                // One-sided ops took no collective number.
                ("barrier", Some(1), vec![]),
            ]
        );
        assert!(rec
            .iter()
            .all(|e| e.state == chorus::FlightState::Completed));
        comm.finalize().expect("finalize");
    });
}

#[test]
fn windows_of_different_sizes_and_bad_ranges_are_invalid_argument_before_any_io() {
    run_ranks(2, "win-args", |comm| {
        let me = comm.rank();
        let win = comm.new_window(100 * (me + 1)).expect("new_window");
        assert_eq!(win.sizes(), &[100, 200]);
        let bad = [
            win.put(Tensor::from_slice(&[0u8; 8]), 0, 96).map(drop),
            win.put(Tensor::from_slice(&[0u8; 8]), 2, 0).map(drop),
            win.put(Tensor::from_slice(&[0u8; 1]), 1, usize::MAX)
                .map(drop),
            win.signal(7, 1),
            win.wait_signal(2, 1),
            win.read(win.size(), 1).map(drop),
            win.get_attr(2).map(drop),
        ];
        for (i, r) in bad.into_iter().enumerate() {
            assert!(
                matches!(r, Err(Error::InvalidArgument { .. })),
                "case {i}: {r:?}"
            );
        }
        // Rank 1's window is larger: this fits there.
        if me == 0 {
            win.put(Tensor::from_slice(&[9u8; 8]), 1, 192)
                .expect("fits rank 1");
            win.signal(1, 1).expect("signal");
        } else {
            win.wait_signal(0, 1).expect("wait");
            assert_eq!(win.read(192, 8).expect("read"), vec![9; 8]);
        }
        assert!(
            comm.is_active(),
            "argument errors leave the communicator usable"
        );
        comm.barrier().expect("barrier");
        comm.finalize().expect("finalize");
    });
}

#[test]
fn wait_signal_times_out_with_timeout_and_aborts_the_communicator() {
    let results = run_ranks(2, "win-timeout", |comm| {
        let win = comm.new_window(64).expect("new_window");
        if comm.rank() == 0 {
            let t0 = Instant::now();
            let r = win
                .with_timeout(Duration::from_millis(300))
                .wait_signal(1, 1);
            let took = t0.elapsed();
            assert!(matches!(r, Err(Error::Timeout { .. })), "{r:?}");
            assert!(took < Duration::from_secs(10), "took {took:?}");
            assert!(!comm.is_active(), "a timeout is fatal");
            true
        } else {
            // Rank 0's abort reaches this rank's next op.
            let r = comm.barrier();
            r.is_err()
        }
    });
    assert_eq!(results, vec![true, true]);
    no_windows_left();
}

#[test]
fn abort_fails_a_pending_wait_signal_with_aborted_and_frees_the_window() {
    run_ranks(2, "win-abort", |comm| {
        let win = comm.new_window(64).expect("new_window");
        if comm.rank() == 0 {
            let w = win.wait_signal_async(1, 1);
            // Whether the wait already runs or is still queued, the abort
            // completes it.
            comm.abort_with_reason("test abort");
            match w.wait() {
                Err(Error::Aborted { reason, .. }) => {
                    assert!(reason.contains("test abort"), "{reason}")
                }
                other => panic!("expected Aborted, got {other:?}"),
            }
            assert!(matches!(win.read(0, 1), Err(Error::Aborted { .. })));
        } else {
            let r = comm.barrier();
            assert!(r.is_err(), "the peer's abort reaches this rank: {r:?}");
        }
    });
    no_windows_left();
    assert!(my_shm_files().is_empty(), "left: {:?}", my_shm_files());
}

#[test]
fn windows_are_freed_at_finalize_with_no_files_left() {
    run_ranks(3, "win-finalize", |comm| {
        let a = comm.new_window(1 << 16).expect("window a");
        let b = comm.new_window(10).expect("window b");
        assert_eq!((a.id(), b.id()), (0, 1));
        comm.barrier().expect("barrier");
        assert!(chorus::debug::live_windows() >= 2);
        comm.finalize().expect("finalize");
        assert!(matches!(a.read(0, 1), Err(Error::Finalized { .. })));
    });
    assert_eq!(chorus::debug::live_windows(), 0);
    assert!(my_shm_files().is_empty(), "left: {:?}", my_shm_files());
}

#[test]
fn free_releases_a_window_on_every_rank_and_later_ops_are_invalid_argument() {
    run_ranks(3, "win-free", |comm| {
        let a = comm.new_window(1 << 12).expect("window a");
        let b = comm.new_window(64).expect("window b");
        let a2 = a.clone();
        a.free().expect("free a");
        for r in [
            a2.put_bytes(&[1], 0, 0),
            a2.signal(0, 1),
            a2.wait_signal(0, 1),
            a2.read(0, 1).map(drop),
            a2.clone().free(),
        ] {
            assert!(matches!(r, Err(Error::InvalidArgument { .. })), "{r:?}");
        }
        // The other window still works, and a new one gets the next id.
        let peer = (comm.rank() + 1) % comm.size();
        let from = (comm.rank() + comm.size() - 1) % comm.size();
        b.put_bytes(&[comm.rank() as u8; 8], peer, 0)
            .expect("put b");
        b.signal(peer, 1).expect("signal b");
        b.wait_signal(from, 1).expect("wait b");
        assert_eq!(b.read(0, 8).expect("read b"), vec![from as u8; 8]);
        let c = comm.new_window(8).expect("window c");
        assert_eq!(c.id(), 2);
        // Ranks freeing different windows: a non-fatal mismatch.
        let r = if comm.rank() == 0 {
            b.free()
        } else {
            c.clone().free()
        };
        assert!(
            matches!(r, Err(Error::Mismatch { fatal: false, .. })),
            "{r:?}"
        );
        assert!(comm.is_active());
        comm.finalize().expect("finalize");
    });
    no_windows_left();
    assert!(my_shm_files().is_empty(), "left: {:?}", my_shm_files());
}

/// A backend that moves data with the cpu backend but has no windows.
struct NoWindows(chorus::backends::cpu::CpuBackend);

#[async_trait]
impl Backend for NoWindows {
    fn name(&self) -> &'static str {
        "nowin"
    }
    async fn exchange_headers(
        &mut self,
        ctx: &OpCtx,
        outgoing: Vec<(usize, u64, Vec<u8>)>,
    ) -> chorus::Result<Vec<(usize, Vec<u8>)>> {
        self.0.exchange_headers(ctx, outgoing).await
    }
    async fn execute(&mut self, ctx: &OpCtx, data: &mut OpData) -> chorus::Result<()> {
        self.0.execute(ctx, data).await
    }
    async fn abort(&mut self, reason: &str, failed: &[usize]) {
        self.0.abort(reason, failed).await
    }
    async fn finalize(&mut self) {
        self.0.finalize().await
    }
}

#[test]
fn a_backend_without_windows_refuses_new_window_with_unsupported_op() {
    async fn connect(init: BackendInit) -> chorus::Result<Box<dyn Backend>> {
        Ok(Box::new(NoWindows(
            chorus::backends::cpu::CpuBackend::connect(init).await?,
        )))
    }
    chorus::register_backend("nowin", |_device, init| connect(init)).expect("register");
    let comm = new_comm(
        "nowin",
        Device::Cpu,
        "win-unsupported",
        CommOptions::single(),
    )
    .expect("new_comm");
    match comm.new_window(64) {
        Err(Error::UnsupportedOp { op, .. }) => assert!(op.contains("nowin"), "{op}"),
        other => panic!("expected UnsupportedOp, got {other:?}"),
    }
    comm.barrier().expect("the communicator stays usable");
    comm.finalize().expect("finalize");
}

fn free_port() -> u16 {
    let s = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind udp");
    s.local_addr().expect("addr").port()
}

/// Rank body of the peer-death test (run by it, as a child process).
#[test]
#[ignore = "rank body for the peer-death test; run by it"]
fn worker() {
    if std::env::var("CHORUS_TEST_WORKER").is_err() {
        return;
    }
    let env = |k: &str| std::env::var(k).expect(k).parse::<usize>().expect(k);
    let (rank, port) = (env("RANK"), env("PORT") as u16);
    let opts = CommOptions::default()
        .with_rank(rank, 2)
        .with_rendezvous(Rendezvous::Master(([127, 0, 0, 1], port).into()))
        .with_secret("win-death")
        .with_timeout(Duration::from_secs(30))
        .with_connect_timeout(Duration::from_secs(20));
    let comm = new_comm("cpu", Device::Cpu, "win-death", opts).expect("new_comm");
    let win = comm.new_window(64).expect("new_window");
    let access = win.get_attr(1 - rank).expect("attr").access_type;
    let want = if std::env::var("CHORUS_SHM").as_deref() == Ok("0") {
        WindowAccess::Separate
    } else {
        WindowAccess::Unified
    };
    assert_eq!(access, want, "the test covers the path it names");
    if rank == 1 {
        // Die without any cleanup while rank 0 waits for a signal.
        std::process::abort();
    }
    let t0 = Instant::now();
    let r = win.wait_signal(1, 1);
    let kind = match &r {
        Err(Error::PeerFailed { failed_ranks, .. }) if failed_ranks == &[1] => "peer_failed",
        Err(Error::PeerFailed { .. }) => "peer_failed_other_ranks",
        Err(_) => "other_error",
        Ok(()) => "ok",
    };
    println!("RESULT {kind} {} {r:?}", t0.elapsed().as_millis());
}

#[test]
fn a_dead_same_host_peer_fails_a_pending_wait_signal_with_peer_failed() {
    dead_peer(false);
}

#[test]
fn a_dead_peer_over_tcp_fails_a_pending_wait_signal_with_peer_failed() {
    dead_peer(true);
}

fn dead_peer(tcp: bool) {
    let port = free_port();
    let exe = std::env::current_exe().expect("exe");
    let mut children: Vec<_> = (0..2)
        .map(|rank| {
            Command::new(&exe)
                .args(["--ignored", "--exact", "worker", "--nocapture"])
                .env("CHORUS_TEST_WORKER", "1")
                .env("RANK", rank.to_string())
                .env("PORT", port.to_string())
                .env("CHORUS_SHM", if tcp { "0" } else { "1" })
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn")
        })
        .collect();
    struct Reap(Vec<std::process::Child>);
    impl Drop for Reap {
        fn drop(&mut self) {
            for c in &mut self.0 {
                let _ = c.kill();
                let _ = c.wait();
            }
        }
    }
    let out = children[0].stdout.take().expect("stdout");
    let guard = Arc::new(std::sync::Mutex::new(Reap(children)));
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        use std::io::BufRead;
        for line in std::io::BufReader::new(out).lines().map_while(Result::ok) {
            if let Some(rest) = line.strip_prefix("RESULT ") {
                let _ = tx.send(rest.to_string());
                return;
            }
        }
    });
    let line = rx
        .recv_timeout(Duration::from_secs(45))
        .expect("rank 0 reports within the deadline");
    drop(guard);
    assert!(line.starts_with("peer_failed "), "rank 0 got: {line}");
}

/// A device tensor (here an address that is never dereferenced) given to a
/// cpu window or a cpu collective is `InvalidArgument` before any I/O, and
/// the communicator stays usable.
#[test]
fn device_tensors_are_refused_by_cpu_windows_and_ops() {
    run_ranks(2, "win-device", |comm| {
        let win = comm.new_window(64).expect("new_window");
        let fake = || {
            // SAFETY: the tensor is refused before its memory is touched;
            // the address is aligned and non-null, and nothing owns it.
            unsafe {
                Tensor::from_device_ptr(
                    std::ptr::NonNull::<u64>::dangling().as_ptr().cast(),
                    DType::F32,
                    4,
                    Device::Cuda(0),
                    Box::new(()),
                )
            }
            .expect("device tensor")
        };
        let peer = 1 - comm.rank();
        match win.put(fake(), peer, 0) {
            Err(Error::InvalidArgument { reason, .. }) => {
                assert!(reason.contains("host memory"), "{reason}")
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
        assert!(matches!(
            comm.all_reduce(fake(), chorus::ReduceOp::Sum),
            Err(Error::InvalidArgument { .. })
        ));
        let t = comm
            .all_reduce(Tensor::full(1.0f32, 4), chorus::ReduceOp::Sum)
            .expect("still usable");
        assert_eq!(t.as_slice::<f32>(), &[2.0; 4]);
        win.free().expect("free");
        comm.finalize().expect("finalize");
    });
}
