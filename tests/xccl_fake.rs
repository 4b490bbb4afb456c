//! The `nccl` and `rccl` backends, end to end, on the fake vendor libraries
//! of `tests/fakes/xccl.rs` (a cdylib built by `cargo build --example
//! fake_xccl`), loaded through `CHORUS_LIB_DIRS` like the real ones. The
//! fake models per-thread devices, checked device pointers, streams that
//! only drain when peers meet, non-blocking communicators, per-thread NCCL
//! groups, late split out-pointers, aborts and injected errors, so these
//! tests catch what a first GPU run would otherwise find.
//!
//! Tests share the fake's process-wide state (counters, injections), so
//! they run one at a time (`SERIAL`).
#![cfg(any(feature = "nccl", feature = "rccl"))]

mod common;

use std::ffi::{c_int, c_uint, c_void};
use std::path::PathBuf;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

use chorus::backends::xccl::{live_completion_threads, probe, Flavor};
use chorus::{DType, Error, P2POp, ReduceOp, Tensor};
use common::{assert_close, input, run_ranks_on, value};

/// `FakeCounters` of the fake (same layout).
#[repr(C)]
#[derive(Debug, Default, Clone, Copy)]
struct Counters {
    mallocs: u64,
    frees: u64,
    live_allocs: u64,
    streams_created: u64,
    blocking_streams: u64,
    live_streams: u64,
    live_comms: u64,
    destroy_unfinalized: u64,
    finalizes: u64,
    aborts: u64,
    bad_pointer: u64,
    in_progress_misuse: u64,
    last_traffic_class: i64,
    live_redops: u64,
    live_events: u64,
    freed_in_use: u64,
    in_use_allocs: u64,
    live_windows: u64,
    mismatched_collectives: u64,
}

struct Fake {
    lib: libloading::Library,
}

impl Fake {
    fn counters(&self) -> Counters {
        let mut c = Counters::default();
        // SAFETY: the fake's control symbol with this signature.
        unsafe {
            let f = self
                .lib
                .get::<unsafe extern "C" fn(*mut Counters)>(b"fake_xccl_counters\0")
                .expect("fake_xccl_counters");
            f(&mut c);
        }
        c
    }

    fn call_i(&self, name: &[u8], a: c_int, b: c_int) -> c_int {
        // SAFETY: control symbols taking two ints.
        unsafe {
            let f = self
                .lib
                .get::<unsafe extern "C" fn(c_int, c_int) -> c_int>(name)
                .expect("fake symbol");
            f(a, b)
        }
    }

    fn set_device(&self, d: c_int) {
        // SAFETY: `cudaSetDevice(int)`.
        let r = unsafe {
            (self
                .lib
                .get::<unsafe extern "C" fn(c_int) -> c_int>(b"cudaSetDevice\0")
                .expect("cudaSetDevice"))(d)
        };
        assert_eq!(r, 0);
    }

    fn device(&self) -> c_int {
        let mut d = -1;
        // SAFETY: `cudaGetDevice(int*)`.
        unsafe {
            (self
                .lib
                .get::<unsafe extern "C" fn(*mut c_int) -> c_int>(b"cudaGetDevice\0")
                .expect("cudaGetDevice"))(&mut d)
        };
        d
    }

    fn group_depth(&self) -> c_int {
        // SAFETY: control symbol.
        unsafe {
            (self
                .lib
                .get::<unsafe extern "C" fn() -> c_int>(b"fake_xccl_group_depth\0")
                .expect("fake_xccl_group_depth"))()
        }
    }

    fn fail_call(&self, device: c_int, skip: c_uint, code: c_int) {
        // SAFETY: control symbol.
        unsafe {
            (self
                .lib
                .get::<unsafe extern "C" fn(c_int, c_uint, c_int)>(b"fake_xccl_fail_call\0")
                .expect("fake_xccl_fail_call"))(device, skip, code)
        }
    }

    fn set_version(&self, v: c_int) {
        // SAFETY: control symbol.
        unsafe {
            (self
                .lib
                .get::<unsafe extern "C" fn(c_int)>(b"fake_xccl_set_version\0")
                .expect("fake_xccl_set_version"))(v)
        }
    }

    fn reset(&self) {
        // SAFETY: control symbol.
        unsafe {
            (self
                .lib
                .get::<unsafe extern "C" fn()>(b"fake_xccl_reset\0")
                .expect("fake_xccl_reset"))()
        }
    }
}

static FAKE: OnceLock<Fake> = OnceLock::new();
static SERIAL: Mutex<()> = Mutex::new(());

/// The fake, found next to this test binary (`target/<profile>/examples`)
/// and exposed under the vendor file names in a private folder that
/// `CHORUS_LIB_DIRS` points at.
fn fake() -> &'static Fake {
    FAKE.get_or_init(|| {
        let exe = std::env::current_exe().expect("current_exe");
        let so = exe
            .parent()
            .and_then(|d| d.parent())
            .map(|d| d.join("examples/libfake_xccl.so"))
            .expect("target dir");
        assert!(
            so.exists(),
            "{} missing: build it with `cargo build --example fake_xccl` \
             (scripts/test-backends.sh does)",
            so.display()
        );
        let dir = std::env::temp_dir().join(format!("chorus-fake-xccl-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("fake lib dir");
        for name in [
            "libnccl.so.2",
            "libcudart.so.12",
            "librccl.so.1",
            "libamdhip64.so.6",
        ] {
            let link: PathBuf = dir.join(name);
            let _ = std::fs::remove_file(&link);
            std::os::unix::fs::symlink(&so, &link).expect("symlink");
        }
        std::env::set_var("CHORUS_LIB_DIRS", &dir);
        // SAFETY: the fake's initialisers only set up empty state.
        let lib = unsafe { libloading::Library::new(dir.join("libnccl.so.2")) }.expect("load fake");
        Fake { lib }
    })
}

/// Serialise the tests and start each from a clean fake.
fn setup() -> (MutexGuard<'static, ()>, &'static Fake) {
    let g = SERIAL.lock().unwrap_or_else(|p| p.into_inner());
    let f = fake();
    f.reset();
    // Communicators of the previous test are dropped by their actors on
    // their own threads: let that finish, so leak checks start from zero.
    eventually(Duration::from_secs(10), || {
        let c = f.counters();
        (c.live_allocs, c.live_streams, c.live_comms, c.live_events) == (0, 0, 0, 0)
            && live_completion_threads() == 0
    });
    (g, f)
}

fn flavors() -> Vec<Flavor> {
    let mut v = Vec::new();
    if cfg!(feature = "nccl") {
        v.push(Flavor::Nccl);
    }
    if cfg!(feature = "rccl") {
        v.push(Flavor::Rccl);
    }
    v
}

/// A one-shot signal between rank threads, waited on with a bound.
#[derive(Clone, Default)]
struct Signal(Arc<(Mutex<bool>, Condvar)>);

impl Signal {
    fn raise(&self) {
        *self.0 .0.lock().unwrap() = true;
        self.0 .1.notify_all();
    }
    fn wait(&self, bound: Duration) -> bool {
        let g = self.0 .0.lock().unwrap();
        let (g, _) = self.0 .1.wait_timeout_while(g, bound, |s| !*s).unwrap();
        *g
    }
}

/// Wait (bounded) until `cond` holds; the fake and the actor work on their
/// own threads, so the test can only observe their results.
fn eventually(bound: Duration, cond: impl Fn() -> bool) -> bool {
    let end = Instant::now() + bound;
    while Instant::now() < end {
        if cond() {
            return true;
        }
        std::thread::yield_now();
    }
    cond()
}

fn sum_ref(n: usize, i: usize) -> f64 {
    (0..n).map(|r| value(r, i)).sum()
}

#[test]
fn the_fake_is_what_the_backends_load() {
    let (_g, f) = setup();
    for flavor in flavors() {
        let n = probe(flavor).unwrap_or_else(|e| panic!("{}: {e}", flavor.name()));
        assert_eq!(n, 8, "the fake reports 8 devices");
    }
    let before = f.counters();
    run_ranks_on(
        flavors()[0].name(),
        2,
        "xf-load",
        |_, o| o,
        |comm| {
            comm.finalize().unwrap();
        },
    );
    let after = f.counters();
    assert_eq!(after.finalizes - before.finalizes, 2, "{after:?}");
}

#[test]
fn every_collective_matches_the_reference_world_2_to_4() {
    let (_g, _f) = setup();
    for flavor in flavors() {
        for n in 2..=4 {
            run_ranks_on(
                flavor.name(),
                n,
                &format!("xf-coll-{n}"),
                |_, o| o,
                move |comm| {
                    let r = comm.rank();
                    let what = |s: &str| format!("{} world {n}: {s}", comm.backend());
                    for dtype in [
                        DType::F32,
                        DType::I32,
                        DType::F16,
                        DType::BF16,
                        DType::F64,
                        DType::I8,
                    ] {
                        for op in [
                            ReduceOp::Sum,
                            ReduceOp::Max,
                            ReduceOp::Avg,
                            ReduceOp::PremulSum(2.0),
                        ] {
                            for count in [0usize, 4, 1 << 10] {
                                let out = comm.all_reduce(input(dtype, r, count), op).unwrap();
                                let want: Vec<f64> = (0..count)
                                    .map(|i| {
                                        let v: Vec<f64> = (0..n).map(|p| value(p, i)).collect();
                                        match op {
                                            ReduceOp::Sum => v.iter().sum(),
                                            ReduceOp::Max => {
                                                v.iter().cloned().fold(f64::MIN, f64::max)
                                            }
                                            ReduceOp::Avg if dtype.is_float() => {
                                                v.iter().sum::<f64>() / n as f64
                                            }
                                            ReduceOp::Avg => {
                                                (v.iter().sum::<f64>() as i64 / n as i64) as f64
                                            }
                                            _ => v.iter().map(|x| x * 2.0).sum(),
                                        }
                                    })
                                    .map(|x| {
                                        if dtype == DType::I8 {
                                            x as i64 as i8 as f64
                                        } else {
                                            x
                                        }
                                    })
                                    .collect();
                                assert_close(
                                    dtype,
                                    &out,
                                    &want,
                                    &what(&format!("all_reduce {dtype} {op} {count}")),
                                );
                            }
                        }
                    }
                    let dtype = DType::F32;
                    let count = 33;
                    for root in 0..n {
                        let out = comm
                            .reduce(input(dtype, r, count), ReduceOp::Sum, root)
                            .unwrap();
                        let want: Vec<f64> = (0..count)
                            .map(|i| {
                                if r == root {
                                    sum_ref(n, i)
                                } else {
                                    value(r, i)
                                }
                            })
                            .collect();
                        assert_close(dtype, &out, &want, &what("reduce"));
                        let t = if r == root {
                            input(dtype, root, count)
                        } else {
                            Tensor::zeros(dtype, count)
                        };
                        let out = comm.broadcast(t, root).unwrap();
                        let want: Vec<f64> = (0..count).map(|i| value(root, i)).collect();
                        assert_close(dtype, &out, &want, &what("broadcast"));
                    }
                    let out = comm.all_gather(input(dtype, r, count)).unwrap();
                    let want: Vec<f64> = (0..n)
                        .flat_map(|p| (0..count).map(move |i| value(p, i)))
                        .collect();
                    assert_close(dtype, &out, &want, &what("all_gather"));
                    // Uneven blocks: grouped broadcasts.
                    let counts: Vec<usize> = (0..n).map(|p| count + p).collect();
                    let out = comm
                        .all_gather_v(input(dtype, r, count + r), &counts)
                        .unwrap();
                    let want: Vec<f64> = (0..n)
                        .flat_map(|p| (0..count + p).map(move |i| value(p, i)))
                        .collect();
                    assert_close(dtype, &out, &want, &what("all_gather_v"));
                    let out = comm
                        .reduce_scatter(input(dtype, r, count * n), ReduceOp::Sum)
                        .unwrap();
                    let want: Vec<f64> = (0..count).map(|i| sum_ref(n, r * count + i)).collect();
                    assert_close(dtype, &out, &want, &what("reduce_scatter"));
                    // all_to_all_single: block j of rank p is value(p, j * count + i).
                    let out = comm.all_to_all_single(input(dtype, r, count * n)).unwrap();
                    let want: Vec<f64> = (0..n)
                        .flat_map(|p| (0..count).map(move |i| value(p, r * count + i)))
                        .collect();
                    assert_close(dtype, &out, &want, &what("all_to_all_single"));
                    // A ring of sends and receives in one batch.
                    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
                    let got = comm
                        .batch_p2p(vec![
                            P2POp::send(input(dtype, r, count), next),
                            P2POp::recv(Tensor::zeros(dtype, count), prev),
                        ])
                        .unwrap();
                    let want: Vec<f64> = (0..count).map(|i| value(prev, i)).collect();
                    assert_close(dtype, got.last().expect("recv"), &want, &what("p2p ring"));
                    comm.barrier().unwrap();
                    comm.finalize().unwrap();
                },
            );
        }
    }
}

/// Bug 1: with a non-blocking parent NCCL writes the child into
/// `*newcomm` later, from its own thread; members must get it.
#[test]
fn split_gives_members_their_child_and_nocolor_ranks_none() {
    let (_g, _f) = setup();
    for flavor in flavors() {
        let out = run_ranks_on(
            flavor.name(),
            4,
            "xf-split",
            |_, o| o,
            |comm| {
                let r = comm.rank();
                let color = (r != 3).then_some((r % 2) as u32);
                let child = comm.split_by_color(color, r as i64, "parity").unwrap();
                let res = child.as_ref().map(|c| {
                    let s = c
                        .all_reduce(Tensor::full(r as f32, 4), ReduceOp::Sum)
                        .unwrap();
                    (c.size(), s.as_slice::<f32>()[0])
                });
                // The parent still works after the split.
                let p = comm
                    .all_reduce(Tensor::full(1i32, 2), ReduceOp::Sum)
                    .unwrap();
                assert_eq!(p.to_vec::<i32>(), vec![4, 4]);
                comm.finalize().unwrap();
                res
            },
        );
        assert_eq!(
            out,
            vec![Some((2, 2.0)), Some((1, 1.0)), Some((2, 2.0)), None],
            "{}",
            flavor.name()
        );
    }
}

/// Bug 2: a call that fails inside `ncclGroupStart/End` must still end
/// the group, or every later NCCL call on that thread is queued forever.
#[test]
fn a_call_failing_inside_a_group_still_ends_the_group() {
    let (_g, f) = setup();
    for flavor in flavors() {
        run_ranks_on(
            flavor.name(),
            2,
            "xf-group",
            |_, o| o,
            move |comm| {
                let r = comm.rank();
                let t = Tensor::full(r as f32, 4);
                comm.all_reduce(t.clone(), ReduceOp::Sum).unwrap();
                if r == 0 {
                    // The second broadcast of the grouped all_gather_v fails.
                    f.fail_call(0, 1, 4);
                }
                let got = comm.all_gather_v(Tensor::full(1.0f32, 3 + r), &[3, 4]);
                let e = got.expect_err("the op fails on every rank");
                if r == 0 {
                    // ncclGetLastError's detail is part of the error.
                    assert!(e.to_string().contains("injected failure"), "{e}");
                }
                // The blocking op ran its turn on this thread (idle communicator).
                assert_eq!(
                    f.group_depth(),
                    0,
                    "rank {r}: NCCL group left open on the caller's thread"
                );
            },
        );
    }
}

/// Bug 3: buffers are allocated on the communicator's device, and the
/// caller's thread keeps its own current device.
#[test]
fn ops_keep_the_callers_device_and_allocate_on_the_comms_device() {
    let (_g, f) = setup();
    for flavor in flavors() {
        let before = f.counters();
        run_ranks_on(
            flavor.name(),
            2,
            "xf-dev",
            |_, o| o,
            move |comm| {
                let r = comm.rank();
                f.set_device(7);
                for count in [16usize, 1 << 12] {
                    let out = comm.all_reduce(input(DType::F32, r, count), ReduceOp::Sum);
                    let out = out.unwrap_or_else(|e| panic!("rank {r}: {e}"));
                    let want: Vec<f64> = (0..count).map(|i| sum_ref(2, i)).collect();
                    assert_close(DType::F32, &out, &want, "all_reduce");
                    assert_eq!(
                        f.device(),
                        7,
                        "rank {r}: the op switched the caller's device"
                    );
                }
                comm.finalize().unwrap();
            },
        );
        let after = f.counters();
        assert_eq!(after.bad_pointer, before.bad_pointer, "{after:?}");
        assert_eq!(
            after.in_progress_misuse, before.in_progress_misuse,
            "a call on a communicator still in progress: {after:?}"
        );
    }
}

/// Bug 7: finalize is `ncclCommFinalize` then destroy, bounded: a peer
/// that never finalizes makes it fall back to `ncclCommAbort` in time.
#[test]
fn finalize_is_bounded_when_a_peer_never_finalizes() {
    let (_g, f) = setup();
    for flavor in flavors() {
        let before = f.counters();
        let done = Signal::default();
        let tweak = |_, o: chorus::CommOptions| o.with_connect_timeout(Duration::from_secs(2));
        run_ranks_on(flavor.name(), 2, "xf-fin-hung", tweak, move |comm| {
            comm.all_reduce(Tensor::full(1.0f32, 4), ReduceOp::Sum)
                .unwrap();
            if comm.rank() == 0 {
                let t0 = Instant::now();
                let _ = comm.finalize();
                let took = t0.elapsed();
                done.raise();
                assert!(took < Duration::from_secs(15), "finalize took {took:?}");
            } else {
                assert!(
                    done.wait(Duration::from_secs(40)),
                    "rank 0 never finished finalize"
                );
                let _ = comm.finalize();
            }
        });
        let after = f.counters();
        assert_eq!(
            after.destroy_unfinalized, before.destroy_unfinalized,
            "{after:?}"
        );
        assert!(
            after.aborts > before.aborts,
            "the hung finalize fell back to abort: {after:?}"
        );
    }
}

/// Bug 7 and leak checks: a clean finalize finalizes before destroying, and
/// frees every communicator, stream and device buffer.
#[test]
fn clean_finalize_leaks_nothing_and_uses_nonblocking_streams() {
    let (_g, f) = setup();
    for flavor in flavors() {
        let before = f.counters();
        run_ranks_on(
            flavor.name(),
            3,
            "xf-leak",
            |_, o| o,
            |comm| {
                let r = comm.rank();
                // Growing sizes: buffers grow geometrically, not one cudaFree per op.
                for k in 1..=64usize {
                    comm.all_reduce(input(DType::F32, r, 64 * k), ReduceOp::Sum)
                        .unwrap();
                }
                // Ops complete through the communicator's completion thread,
                // which finalize ends (checked after the run).
                assert!(live_completion_threads() >= 1);
                comm.finalize().unwrap();
            },
        );
        let after = f.counters();
        assert_eq!(
            after.destroy_unfinalized, before.destroy_unfinalized,
            "{after:?}"
        );
        assert_eq!(after.finalizes - before.finalizes, 3, "{after:?}");
        assert_eq!(after.blocking_streams, before.blocking_streams, "{after:?}");
        assert_eq!(after.last_traffic_class, i64::from(c_int::MIN), "{after:?}");
        assert!(
            after.frees - before.frees <= 3 * 2 * 8,
            "cudaFree on the hot path: {} frees",
            after.frees - before.frees
        );
        assert!(
            eventually(Duration::from_secs(10), || {
                let c = f.counters();
                (c.live_allocs, c.live_streams, c.live_comms, c.live_events)
                    == (
                        before.live_allocs,
                        before.live_streams,
                        before.live_comms,
                        before.live_events,
                    )
                    && live_completion_threads() == 0
            }),
            "leaked: {:?} (before {before:?})",
            f.counters()
        );
    }
}

/// Abort while an op waits for a peer that never joins it.
#[test]
fn abort_mid_op_fails_the_op_and_frees_everything() {
    let (_g, f) = setup();
    for flavor in flavors() {
        let before = f.counters();
        let done = Signal::default();
        run_ranks_on(
            flavor.name(),
            2,
            "xf-abort",
            |_, o| o,
            move |comm| {
                comm.all_reduce(Tensor::full(1.0f32, 4), ReduceOp::Sum)
                    .unwrap();
                if comm.rank() == 0 {
                    let w = comm.all_reduce_async(Tensor::full(1.0f32, 4), ReduceOp::Sum);
                    comm.abort();
                    let e = w.wait().expect_err("aborted op");
                    assert!(matches!(e, Error::Aborted { .. }), "{e:?}");
                    done.raise();
                } else {
                    assert!(done.wait(Duration::from_secs(40)));
                    comm.abort();
                }
            },
        );
        assert!(
            eventually(Duration::from_secs(10), || {
                let c = f.counters();
                (c.live_allocs, c.live_streams, c.live_comms, c.live_events)
                    == (
                        before.live_allocs,
                        before.live_streams,
                        before.live_comms,
                        before.live_events,
                    )
                    && live_completion_threads() == 0
            }),
            "leaked after abort: {:?} (before {before:?})",
            f.counters()
        );
    }
}

/// An error NCCL finds while no op runs aborts the communicator without
/// waiting for the next op (the idle poll).
#[test]
fn an_idle_async_error_aborts_the_communicator() {
    let (_g, f) = setup();
    for flavor in flavors() {
        run_ranks_on(
            flavor.name(),
            2,
            "xf-idle",
            |_, o| o,
            move |comm| {
                comm.all_reduce(Tensor::full(1.0f32, 4), ReduceOp::Sum)
                    .unwrap();
                if comm.rank() == 0 {
                    assert_eq!(f.call_i(b"fake_xccl_inject_async_error\0", 0, 6), 1);
                }
                assert!(
                    eventually(Duration::from_secs(20), || !comm.is_active()),
                    "rank {}: still active",
                    comm.rank()
                );
                if comm.rank() == 0 {
                    let cause = comm.status().cause.expect("a cause");
                    assert!(matches!(cause, Error::PeerFailed { .. }), "{cause:?}");
                }
            },
        );
    }
}

/// A peer that aborts while the others wait in a collective: they fail
/// with an error instead of hanging.
#[test]
fn a_peer_failure_fails_the_waiting_ranks() {
    let (_g, _f) = setup();
    for flavor in flavors() {
        run_ranks_on(
            flavor.name(),
            3,
            "xf-peer",
            |_, o| o,
            |comm| {
                comm.all_reduce(Tensor::full(1.0f32, 4), ReduceOp::Sum)
                    .unwrap();
                if comm.rank() == 2 {
                    comm.abort();
                    return;
                }
                let e = comm
                    .all_reduce(Tensor::full(1.0f32, 4), ReduceOp::Sum)
                    .expect_err("the peer is gone");
                assert!(
                    matches!(e, Error::PeerFailed { .. } | Error::Aborted { .. }),
                    "{e:?}"
                );
                assert!(eventually(Duration::from_secs(20), || !comm.is_active()));
            },
        );
    }
}

/// The reference value of `op` over every rank's [`value`] at `i`, in the
/// element type's arithmetic (integer `Avg` truncates, as NCCL's does).
fn reduce_ref(dtype: DType, op: ReduceOp, n: usize, i: usize) -> f64 {
    let v: Vec<f64> = (0..n).map(|p| value(p, i)).collect();
    match op {
        ReduceOp::Sum => v.iter().sum(),
        ReduceOp::Max => v.iter().cloned().fold(f64::MIN, f64::max),
        ReduceOp::Avg if dtype.is_float() => v.iter().sum::<f64>() / n as f64,
        ReduceOp::Avg => (v.iter().sum::<f64>() as i64 / n as i64) as f64,
        ReduceOp::PremulSum(s) => v.iter().map(|x| x * s).sum(),
        other => panic!("no reference for {other}"),
    }
}

/// Every collective and point-to-point op on device tensors, for both
/// flavours at worlds 2 to 4: results come back as device tensors of the
/// communicator's device (in place where the op is in place), and equal
/// the reference (reductions) or the same op on host tensors (data
/// movement, whose host path the test above checks against references).
/// `Avg` and `PremulSum` run on the device (`ncclAvg`, a PreMulSum op that
/// is destroyed after use), and nothing leaks.
#[test]
fn every_op_on_device_tensors_matches_the_host_reference_world_2_to_4() {
    let (_g, f) = setup();
    for flavor in flavors() {
        let before = f.counters();
        for n in 2..=4 {
            run_ranks_on(
                flavor.name(),
                n,
                &format!("xf-dev-{n}"),
                |_, o| o,
                move |comm| {
                    let r = comm.rank();
                    let what = |s: &str| format!("{} world {n} rank {r}: {s}", comm.backend());
                    let dev = |t: &Tensor| comm.to_device(t).expect("to_device");
                    let host = |t: &Tensor, s: &str| {
                        assert!(t.is_device(), "{}: not a device tensor", what(s));
                        assert_eq!(t.device(), comm.device(), "{}", what(s));
                        comm.to_host(t).expect("to_host")
                    };
                    // Reductions against the reference, every op on device.
                    for dtype in [
                        DType::F32,
                        DType::I32,
                        DType::F16,
                        DType::BF16,
                        DType::F64,
                        DType::I8,
                    ] {
                        for op in [
                            ReduceOp::Sum,
                            ReduceOp::Max,
                            ReduceOp::Avg,
                            ReduceOp::PremulSum(2.0),
                        ] {
                            for count in [0usize, 4, 1 << 10] {
                                let t = dev(&input(dtype, r, count));
                                let at = t.as_ptr();
                                let out = comm.all_reduce(t, op).unwrap();
                                assert_eq!(out.as_ptr(), at, "all_reduce is in place");
                                let want: Vec<f64> =
                                    (0..count).map(|i| reduce_ref(dtype, op, n, i)).collect();
                                let s = format!("all_reduce {dtype} {op} {count}");
                                assert_close(dtype, &host(&out, &s), &want, &what(&s));
                            }
                            let count = 3 * n;
                            let out = comm
                                .reduce_scatter(dev(&input(dtype, r, count)), op)
                                .unwrap();
                            let want: Vec<f64> = (0..3)
                                .map(|i| reduce_ref(dtype, op, n, r * 3 + i))
                                .collect();
                            let s = format!("reduce_scatter {dtype} {op}");
                            assert_close(dtype, &host(&out, &s), &want, &what(&s));
                        }
                    }
                    let dtype = DType::F32;
                    let count = 33;
                    // Data movement: the device result equals the host op's.
                    let same = |d: &Tensor, h: &Tensor, s: &str| {
                        assert_eq!(&host(d, s), h, "{}", what(s));
                    };
                    for root in 0..n {
                        let op = ReduceOp::Avg;
                        let out = comm.reduce(dev(&input(dtype, r, count)), op, root).unwrap();
                        let want = comm.reduce(input(dtype, r, count), op, root).unwrap();
                        same(&out, &want, "reduce");
                        let b = if r == root {
                            input(dtype, root, count)
                        } else {
                            Tensor::zeros(dtype, count)
                        };
                        same(
                            &comm.broadcast(dev(&b), root).unwrap(),
                            &comm.broadcast(b, root).unwrap(),
                            "broadcast",
                        );
                        let inputs = (r == root).then(|| {
                            (0..n)
                                .map(|p| input(dtype, p + 7, count))
                                .collect::<Vec<_>>()
                        });
                        let dinputs = inputs.as_ref().map(|v| v.iter().map(dev).collect());
                        same(
                            &comm
                                .scatter(dev(&Tensor::zeros(dtype, count)), dinputs, root)
                                .unwrap(),
                            &comm
                                .scatter(Tensor::zeros(dtype, count), inputs, root)
                                .unwrap(),
                            "scatter",
                        );
                        let g = comm.gather(dev(&input(dtype, r, count)), root).unwrap();
                        let h = comm.gather(input(dtype, r, count), root).unwrap();
                        assert_eq!(g.len(), h.len(), "{}", what("gather"));
                        for (d, h) in g.iter().zip(&h) {
                            same(d, h, "gather");
                        }
                        same(
                            &comm
                                .gather_single(dev(&input(dtype, r, count)), root)
                                .unwrap(),
                            &comm.gather_single(input(dtype, r, count), root).unwrap(),
                            "gather_single",
                        );
                    }
                    same(
                        &comm.all_gather(dev(&input(dtype, r, count))).unwrap(),
                        &comm.all_gather(input(dtype, r, count)).unwrap(),
                        "all_gather",
                    );
                    let counts: Vec<usize> = (0..n).map(|p| count + p).collect();
                    same(
                        &comm
                            .all_gather_v(dev(&input(dtype, r, count + r)), &counts)
                            .unwrap(),
                        &comm
                            .all_gather_v(input(dtype, r, count + r), &counts)
                            .unwrap(),
                        "all_gather_v",
                    );
                    let (o, i) = comm
                        .all_gather_into(
                            dev(&input(dtype, r, count)),
                            comm.device_zeros(dtype, count * n).unwrap(),
                        )
                        .unwrap();
                    same(
                        &o,
                        &comm.all_gather(input(dtype, r, count)).unwrap(),
                        "all_gather_into",
                    );
                    same(&i, &input(dtype, r, count), "all_gather_into input");
                    same(
                        &comm
                            .reduce_scatter_v(
                                dev(&input(dtype, r, counts.iter().sum())),
                                &counts,
                                ReduceOp::Sum,
                            )
                            .unwrap(),
                        &comm
                            .reduce_scatter_v(
                                input(dtype, r, counts.iter().sum()),
                                &counts,
                                ReduceOp::Sum,
                            )
                            .unwrap(),
                        "reduce_scatter_v",
                    );
                    let (o, _) = comm
                        .reduce_scatter_into(
                            dev(&input(dtype, r, count * n)),
                            comm.device_zeros(dtype, count).unwrap(),
                            ReduceOp::Max,
                        )
                        .unwrap();
                    same(
                        &o,
                        &comm
                            .reduce_scatter(input(dtype, r, count * n), ReduceOp::Max)
                            .unwrap(),
                        "reduce_scatter_into",
                    );
                    same(
                        &comm
                            .all_to_all_single(dev(&input(dtype, r, count * n)))
                            .unwrap(),
                        &comm.all_to_all_single(input(dtype, r, count * n)).unwrap(),
                        "all_to_all_single",
                    );
                    let send: Vec<usize> = (0..n).map(|p| (r + p) % 3 + 1).collect();
                    let recv: Vec<usize> = (0..n).map(|p| (p + r) % 3 + 1).collect();
                    let total = send.iter().sum();
                    same(
                        &comm
                            .all_to_all_v_single(dev(&input(dtype, r, total)), &send, &recv)
                            .unwrap(),
                        &comm
                            .all_to_all_v_single(input(dtype, r, total), &send, &recv)
                            .unwrap(),
                        "all_to_all_v_single",
                    );
                    let parts: Vec<Tensor> =
                        (0..n).map(|p| input(dtype, r * n + p, p + 1)).collect();
                    let d = comm.all_to_all(parts.iter().map(dev).collect()).unwrap();
                    let h = comm.all_to_all(parts).unwrap();
                    assert_eq!(d.len(), n);
                    for (d, h) in d.iter().zip(&h) {
                        same(d, h, "all_to_all");
                    }
                    // Point-to-point: a ring in one batch, then single
                    // send/recv pairs, all on device buffers.
                    let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
                    let got = comm
                        .batch_p2p(vec![
                            P2POp::send(dev(&input(dtype, r, count)), next),
                            P2POp::recv(comm.device_zeros(dtype, count).unwrap(), prev),
                        ])
                        .unwrap();
                    same(
                        got.last().expect("recv"),
                        &input(dtype, prev, count),
                        "p2p ring",
                    );
                    if r == 0 {
                        comm.send(dev(&input(DType::I64, 0, 9)), 1).unwrap();
                    } else if r == 1 {
                        let got = comm
                            .recv(comm.device_zeros(DType::I64, 9).unwrap(), 0)
                            .unwrap();
                        same(&got, &input(DType::I64, 0, 9), "recv");
                    }
                    // Async, with the input dropped right after enqueue.
                    let works: Vec<_> = (0..3)
                        .map(|_| comm.all_reduce_async(dev(&input(dtype, r, count)), ReduceOp::Sum))
                        .collect();
                    for w in works {
                        let want: Vec<f64> = (0..count).map(|i| sum_ref(n, i)).collect();
                        assert_close(
                            dtype,
                            &host(&w.wait().unwrap(), "async"),
                            &want,
                            &what("async"),
                        );
                    }
                    comm.finalize().unwrap();
                },
            );
        }
        let after = f.counters();
        assert_eq!(after.bad_pointer, before.bad_pointer, "{after:?}");
        assert!(
            eventually(Duration::from_secs(10), || {
                let c = f.counters();
                (c.live_allocs, c.live_streams, c.live_comms, c.live_redops)
                    == (
                        before.live_allocs,
                        before.live_streams,
                        before.live_comms,
                        before.live_redops,
                    )
            }),
            "leaked: {:?} (before {before:?})",
            f.counters()
        );
    }
}

/// Device tensors where they cannot go are `InvalidArgument` before any
/// I/O, never a crash: another device, mixed with host tensors, on the
/// cpu backend; and the host never reads a device tensor.
#[test]
fn misplaced_device_tensors_are_invalid_arguments() {
    let (_g, f) = setup();
    for flavor in flavors() {
        run_ranks_on(
            flavor.name(),
            2,
            "xf-dev-invalid",
            |_, o| o,
            |comm| {
                let r = comm.rank();
                let invalid = |res: chorus::Result<Tensor>, s: &str| match res {
                    Err(Error::InvalidArgument { reason, .. }) => reason,
                    other => panic!("{s}: expected InvalidArgument, got {other:?}"),
                };
                let d = comm.device_zeros(DType::F32, 4).unwrap();
                assert!(d.try_as_slice::<f32>().is_none() && d.try_as_bytes().is_none());
                assert!(d.try_clone().is_none() && d.split(&[4]).is_none());
                let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    d.as_slice::<f32>().to_vec()
                }));
                assert!(panicked.is_err(), "a host view of device memory must panic");
                // The same memory, claimed to be on another GPU.
                // SAFETY: refused before use; the alias is never dereferenced.
                let other = unsafe {
                    Tensor::from_device_ptr(
                        d.device_ptr().unwrap(),
                        DType::F32,
                        4,
                        chorus::Device::Cuda(7),
                        Box::new(()),
                    )
                }
                .unwrap();
                let reason = invalid(comm.all_reduce(other, ReduceOp::Sum), "wrong device");
                assert!(reason.contains("cuda:7"), "{reason}");
                // Host and device mixed in one op.
                let reason = invalid(
                    comm.all_gather_into(d, Tensor::zeros(DType::F32, 8))
                        .map(|(o, _)| o),
                    "mixed",
                );
                assert!(reason.contains("mixed"), "{reason}");
                let peer = 1 - r;
                let batch = comm.batch_p2p(vec![
                    P2POp::send(Tensor::zeros(DType::F32, 4), peer),
                    P2POp::recv(comm.device_zeros(DType::F32, 4).unwrap(), peer),
                ]);
                assert!(
                    matches!(batch, Err(Error::InvalidArgument { .. })),
                    "{batch:?}"
                );
                invalid(
                    comm.to_host(&Tensor::zeros(DType::F32, 1)),
                    "to_host of a host tensor",
                );
                // A device tensor on the cpu backend, and no device memory there.
                let cpu = chorus::new_comm(
                    "cpu",
                    chorus::Device::Cpu,
                    &format!("xf-dev-cpu-{r}"),
                    chorus::CommOptions::single(),
                )
                .unwrap();
                let reason = invalid(
                    cpu.broadcast(comm.device_zeros(DType::F32, 4).unwrap(), 0),
                    "device tensor on cpu",
                );
                assert!(reason.contains("host memory only"), "{reason}");
                invalid(cpu.device_zeros(DType::F32, 1), "cpu device_zeros");
                cpu.finalize().unwrap();
                // Nothing was sent: the communicator still works.
                let out = comm
                    .all_reduce(
                        comm.to_device(&Tensor::full(1i32, 3)).unwrap(),
                        ReduceOp::Sum,
                    )
                    .unwrap();
                assert_eq!(comm.to_host(&out).unwrap().to_vec::<i32>(), vec![2, 2, 2]);
                comm.finalize().unwrap();
            },
        );
        assert_eq!(f.counters().bad_pointer, 0);
    }
}

impl Fake {
    fn sym<T: Copy>(&self, name: &[u8]) -> T {
        // SAFETY: each caller names a symbol of the fake with type `T`.
        unsafe { *self.lib.get::<T>(name).expect("fake symbol") }
    }

    /// A non-blocking stream on the calling thread's current device.
    fn stream(&self) -> *mut c_void {
        let f: unsafe extern "C" fn(*mut *mut c_void, c_uint) -> c_int =
            self.sym(b"cudaStreamCreateWithFlags\0");
        let mut s = std::ptr::null_mut();
        // SAFETY: out-parameter call.
        assert_eq!(unsafe { f(&mut s, 1) }, 0);
        s
    }

    fn memcpy(&self, dst: *mut c_void, src: *const c_void, n: usize, kind: c_int, s: *mut c_void) {
        let f: unsafe extern "C" fn(
            *mut c_void,
            *const c_void,
            usize,
            c_int,
            *mut c_void,
        ) -> c_int = self.sym(b"cudaMemcpyAsync\0");
        // SAFETY: the callers pass live buffers of `n` bytes.
        assert_eq!(unsafe { f(dst, src, n, kind, s) }, 0, "memcpy kind {kind}");
    }

    fn sync(&self, s: *mut c_void) {
        let f: unsafe extern "C" fn(*mut c_void) -> c_int = self.sym(b"cudaStreamSynchronize\0");
        // SAFETY: a live stream.
        assert_eq!(unsafe { f(s) }, 0);
    }

    fn destroy_stream(&self, s: *mut c_void) {
        let f: unsafe extern "C" fn(*mut c_void) -> c_int = self.sym(b"cudaStreamDestroy\0");
        // SAFETY: a live stream, destroyed once.
        assert_eq!(unsafe { f(s) }, 0);
    }

    fn gate(&self, s: *mut c_void, close: bool) {
        let f: unsafe extern "C" fn(*mut c_void, c_int) -> c_int =
            self.sym(b"fake_xccl_stream_gate\0");
        // SAFETY: control symbol over a live stream.
        assert_eq!(unsafe { f(s, c_int::from(close)) }, 0);
    }
}

/// Stream-ordered work: an op issued through `with_stream` waits, on the
/// device, for the caller's stream (here a copy into its input that a
/// closed gate holds back: without the wait the op would reduce the stale
/// zeros), and `Work::wait_stream` makes the caller's stream wait for the
/// op (a copy out queued after it sees the reduced values, not the input:
/// rank 1's stream stays gated until rank 0's copy is queued and its gate
/// open, so without the fence rank 0's copy would run before the op). Nothing blocks on the host, and the
/// events and completion threads are gone afterwards.
#[test]
fn with_stream_ops_wait_for_the_callers_stream_and_wait_stream_orders_it_after() {
    let (_g, f) = setup();
    for flavor in flavors() {
        let before = f.counters();
        let r0_queued = Signal::default();
        run_ranks_on(
            flavor.name(),
            2,
            "xf-stream",
            |_, o| o,
            move |comm| {
                let r = comm.rank();
                let f = fake();
                f.set_device(r as c_int);
                let us = f.stream();
                // SAFETY: a live stream of this rank's device, destroyed below.
                let stream = unsafe { chorus::DeviceStream::from_raw(us) };
                let t = comm.device_zeros(DType::F32, 4).unwrap();
                let ptr = t.device_ptr().unwrap();
                f.gate(us, true);
                let mine = [(r + 1) as f32; 4];
                f.memcpy(ptr.cast(), mine.as_ptr().cast(), 16, 1, us);
                let w = comm
                    .with_stream(stream)
                    .unwrap()
                    .all_reduce_async(t, ReduceOp::Sum);
                w.wait_stream(stream).unwrap();
                let mut seen = vec![0.0f32; 4];
                f.memcpy(seen.as_mut_ptr().cast(), ptr.cast(), 16, 2, us);
                // Rank 1's op waits for its gated stream until rank 0's copy
                // out is queued and free to run.
                if r == 1 {
                    assert!(
                        r0_queued.wait(Duration::from_secs(40)),
                        "rank 0 never queued"
                    );
                }
                f.gate(us, false);
                if r == 0 {
                    r0_queued.raise();
                }
                let out = w.wait().unwrap();
                f.sync(us);
                assert_eq!(
                    seen,
                    vec![3.0f32; 4],
                    "rank {r}: the caller's stream did not wait for the op"
                );
                assert_eq!(
                    comm.to_host(&out).unwrap().to_vec::<f32>(),
                    vec![3.0f32; 4],
                    "rank {r}: the op did not wait for the caller's stream"
                );
                f.destroy_stream(us);
                comm.finalize().unwrap();
            },
        );
        assert!(
            eventually(Duration::from_secs(10), || {
                let c = f.counters();
                (c.live_allocs, c.live_streams, c.live_comms, c.live_events)
                    == (
                        before.live_allocs,
                        before.live_streams,
                        before.live_comms,
                        before.live_events,
                    )
                    && live_completion_threads() == 0
            }),
            "leaked: {:?} (before {before:?})",
            f.counters()
        );
    }
    // No streams without device memory.
    let cpu = chorus::new_comm(
        "cpu",
        chorus::Device::Cpu,
        "xf-stream-cpu",
        chorus::CommOptions::single(),
    )
    .unwrap();
    // SAFETY: refused before use.
    let s = unsafe { chorus::DeviceStream::from_raw(std::ptr::null_mut()) };
    assert!(matches!(
        cpu.with_stream(s),
        Err(Error::InvalidArgument { .. })
    ));
    cpu.finalize().unwrap();
}

/// `chorus-perf --device cuda` on the fake: every collective on device
/// tensors, checked, one rank (the fake's ranks meet inside one process,
/// and chorus-perf starts one process per rank).
#[test]
fn chorus_perf_device_cuda_runs_every_collective_on_the_fake() {
    let (_g, _f) = setup();
    for flavor in flavors() {
        for op in [
            "all_reduce",
            "all_gather",
            "broadcast",
            "reduce_scatter",
            "reduce",
            "gather",
            "scatter",
            "all_to_all",
            "all_to_all_single",
        ] {
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_chorus-perf"))
                .args([
                    op, "-n", "1", "-b", "8", "-e", "4K", "-f", "8", "-w", "1", "-i", "3",
                ])
                .args([
                    "--backend",
                    flavor.name(),
                    "--device",
                    "cuda",
                    "--timeout",
                    "50",
                ])
                .stdin(std::process::Stdio::null())
                .output()
                .expect("chorus-perf could not be started");
            let stdout = String::from_utf8_lossy(&out.stdout);
            let stderr = String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{op}: {stdout}\n{stderr}");
            assert!(stdout.contains("device=cuda"), "{op}: {stdout}");
            let rows: Vec<&str> = stdout.lines().filter(|l| !l.starts_with('#')).collect();
            assert_eq!(rows.len(), 4, "{op}: {stdout}");
            assert!(
                rows.iter().all(|r| r.trim_end().ends_with("ok")),
                "{op}: {stdout}"
            );
        }
    }
}

/// XC-9: a device tensor whose op is still waiting on the device for a
/// hung peer stays allocated when its `Work` and the tensor are dropped,
/// and when the communicator aborts (which drops the op); it is freed only
/// after `ncclCommAbort` let the queued work go, never under it.
#[test]
fn device_memory_of_an_op_in_flight_is_freed_only_after_the_abort() {
    let (_g, f) = setup();
    for flavor in flavors() {
        let before = f.counters();
        let done = Signal::default();
        run_ranks_on(
            flavor.name(),
            2,
            "xf-dev-abort",
            |_, o| o,
            move |comm| {
                let f = fake();
                let warm = comm.device_zeros(DType::F32, 4).unwrap();
                comm.all_reduce(warm, ReduceOp::Sum).unwrap();
                let t = comm.device_zeros(DType::F32, 1 << 10).unwrap();
                if comm.rank() == 1 {
                    // Rank 1 joins the op but its device makes no progress.
                    f.call_i(b"fake_xccl_hang\0", 1, 1);
                }
                let live = f.counters().live_allocs;
                // The op waits on the device for rank 1's part.
                drop(comm.all_reduce_async(t, ReduceOp::Sum));
                if comm.rank() == 0 {
                    // Both ranks' calls are queued on their streams.
                    assert!(eventually(Duration::from_secs(20), || f
                        .counters()
                        .in_use_allocs
                        >= 2));
                    assert!(f.counters().live_allocs >= live, "freed while the op waits");
                    comm.abort();
                    done.raise();
                } else {
                    assert!(done.wait(Duration::from_secs(40)));
                    comm.abort();
                    f.call_i(b"fake_xccl_hang\0", 1, 0);
                }
            },
        );
        let after = f.counters();
        assert_eq!(
            after.freed_in_use, before.freed_in_use,
            "cudaFree under queued work: {after:?}"
        );
        assert!(
            eventually(Duration::from_secs(10), || {
                let c = f.counters();
                (c.live_allocs, c.live_streams, c.live_comms, c.live_events)
                    == (
                        before.live_allocs,
                        before.live_streams,
                        before.live_comms,
                        before.live_events,
                    )
                    && live_completion_threads() == 0
            }),
            "leaked after abort: {:?} (before {before:?})",
            f.counters()
        );
    }
}

/// NCCL 2.29's one-sided API, as the fake models it.
const ONE_SIDED: c_int = 22907;

/// A byte pattern of `len` bytes that names its writer and round.
fn pattern(from: usize, round: usize, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (from * 31 + round * 7 + i) as u8)
        .collect()
}

/// Windows on nccl (NCCL >= 2.29): every rank puts a pattern into the next
/// rank's window (ranks' windows differ in size), signals it, waits for the
/// previous rank's signal and reads what it wrote; signals add up; free is
/// collective; nothing stays registered or allocated.
#[test]
fn nccl_windows_put_signal_wait_read_world_2_to_3() {
    let (_g, f) = setup();
    if !cfg!(feature = "nccl") {
        return;
    }
    f.set_version(ONE_SIDED);
    for n in [2usize, 3] {
        let before = f.counters();
        run_ranks_on(
            "nccl",
            n,
            "xf-win",
            |_, o| o,
            move |comm| {
                let (r, n) = (comm.rank(), comm.size());
                let (next, prev) = ((r + 1) % n, (r + n - 1) % n);
                // Rank r's window is 1000 + 100 r bytes.
                let win = comm.new_window(1000 + 100 * r).unwrap();
                assert_eq!(
                    win.sizes(),
                    (0..n).map(|p| 1000 + 100 * p).collect::<Vec<_>>()
                );
                let attr = win.get_attr(next).unwrap();
                assert_eq!(attr.size, 1000 + 100 * next);
                assert_eq!(attr.access_type, chorus::WindowAccess::Separate);
                assert_eq!(
                    win.get_attr(r).unwrap().access_type,
                    chorus::WindowAccess::Unified
                );
                for round in 0..3usize {
                    // Two puts, then one signal that covers both.
                    let a = pattern(r, round, 300);
                    let b = pattern(r + 10, round, 200);
                    win.put_bytes(&a, next, 0).unwrap();
                    win.put_bytes(&b, next, 700 + 100 * next).unwrap();
                    win.signal(next, 2).unwrap();
                    win.wait_signal(prev, 2 * (round as u64 + 1)).unwrap();
                    assert_eq!(
                        win.read(0, 300).unwrap(),
                        pattern(prev, round, 300),
                        "rank {r} round {round}"
                    );
                    assert_eq!(
                        win.read(700 + 100 * r, 200).unwrap(),
                        pattern(prev + 10, round, 200),
                        "rank {r} round {round}"
                    );
                    // Everyone has read before the next round overwrites.
                    comm.barrier().unwrap();
                }
                // A put into this rank's own window, and its own signal.
                win.put_bytes(&[9, 8, 7], r, 5).unwrap();
                win.signal(r, 4).unwrap();
                win.wait_signal(r, 4).unwrap();
                assert_eq!(win.read(5, 3).unwrap(), vec![9, 8, 7]);
                let e = win
                    .wait_signal(r, 5)
                    .expect_err("no later op could reach it");
                assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
                // Out of range is refused above the backend.
                let e = win
                    .put_bytes(&[0; 8], next, 1000 + 100 * next - 4)
                    .expect_err("too far");
                assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
                // A second window works alongside; the first is freed.
                let w2 = comm.new_window(64).unwrap();
                win.clone().free().unwrap();
                w2.put_bytes(&[r as u8 + 1; 4], next, 60).unwrap();
                w2.signal(next, 1).unwrap();
                w2.wait_signal(prev, 1).unwrap();
                assert_eq!(w2.read(60, 4).unwrap(), vec![prev as u8 + 1; 4]);
                let e = win.signal(next, 1).expect_err("freed");
                assert!(matches!(e, Error::InvalidArgument { .. }), "{e:?}");
                // w2 is released by finalize.
                comm.finalize().unwrap();
            },
        );
        assert!(
            eventually(Duration::from_secs(10), || {
                let c = f.counters();
                (c.live_allocs, c.live_windows, c.live_comms)
                    == (before.live_allocs, 0, before.live_comms)
            }),
            "leaked: {:?} (before {before:?})",
            f.counters()
        );
        let c = f.counters();
        assert_eq!(
            (c.freed_in_use, c.bad_pointer),
            (before.freed_in_use, before.bad_pointer),
            "{c:?}"
        );
    }
}

/// A library older than 2.29 has no one-sided API: `new_window` is
/// `UnsupportedOp` on every rank before any I/O, and the communicator
/// goes on working.
#[test]
fn nccl_windows_before_2_29_are_unsupported_on_every_rank() {
    let (_g, f) = setup();
    for flavor in flavors() {
        let before = f.counters();
        run_ranks_on(
            flavor.name(),
            2,
            "xf-win-old",
            |_, o| o,
            |comm| {
                let e = comm
                    .new_window(128)
                    .expect_err("no windows before NCCL 2.29");
                assert!(matches!(e, Error::UnsupportedOp { .. }), "{e:?}");
                let s = comm
                    .all_reduce(Tensor::full(1i32, 4), ReduceOp::Sum)
                    .unwrap();
                assert_eq!(s.to_vec::<i32>(), vec![2; 4]);
                comm.finalize().unwrap();
            },
        );
        assert_eq!(f.counters().live_windows, before.live_windows);
    }
}

/// A rank that waits for a signal from a peer that aborts fails with an
/// error instead of hanging, and its window memory is released.
#[test]
fn nccl_window_wait_for_a_dead_peer_fails_and_frees_the_window() {
    let (_g, f) = setup();
    if !cfg!(feature = "nccl") {
        return;
    }
    f.set_version(ONE_SIDED);
    let before = f.counters();
    let waiting = Signal::default();
    run_ranks_on(
        "nccl",
        2,
        "xf-win-dead",
        |_, o| o,
        move |comm| {
            let win = comm.new_window(256).unwrap();
            if comm.rank() == 1 {
                assert!(waiting.wait(Duration::from_secs(40)));
                comm.abort();
                return;
            }
            let w = win.wait_signal_async(1, 1);
            waiting.raise();
            let e = w.wait().expect_err("the signaller is gone");
            assert!(
                matches!(e, Error::PeerFailed { .. } | Error::Aborted { .. }),
                "{e:?}"
            );
            assert!(eventually(Duration::from_secs(20), || !comm.is_active()));
        },
    );
    assert!(
        eventually(Duration::from_secs(10), || {
            let c = f.counters();
            (c.live_allocs, c.live_windows, c.live_comms)
                == (before.live_allocs, 0, before.live_comms)
        }),
        "leaked after the peer died: {:?} (before {before:?})",
        f.counters()
    );
}

/// Control-link messages (cpu Header and Data frames) sent in this process
/// while every rank runs `ops`, counted between two meetings of the rank
/// threads, so no rank's earlier or later traffic is included.
fn control_messages_during(
    comm: &chorus::Comm,
    meet: &std::sync::Barrier,
    ops: impl FnOnce(&chorus::Comm),
) -> usize {
    meet.wait();
    let before = chorus::debug::data_messages_sent();
    meet.wait();
    ops(comm);
    meet.wait();
    let after = chorus::debug::data_messages_sent();
    meet.wait();
    after - before
}

/// With fingerprint checks a collective launches with no host message: on
/// 2 and 4 ranks, every collective (an async all_reduce among them) sends
/// nothing on the control links, a barrier sends the dissemination
/// barrier's N * ceil(log2 N) messages, and with strict checks the same
/// all_reduce sends its N(N-1) headers (so the counter does see the
/// control links).
#[test]
fn fingerprint_collectives_launch_with_no_control_message() {
    let (_g, _f) = setup();
    for flavor in flavors() {
        for n in [2usize, 4] {
            for checks in [chorus::Checks::Fingerprint, chorus::Checks::Strict] {
                let meet = Arc::new(std::sync::Barrier::new(n));
                let counts = run_ranks_on(
                    flavor.name(),
                    n,
                    &format!("xf-launch-{n}-{checks:?}"),
                    move |_, o| o.with_checks(checks),
                    move |comm| {
                        let r = comm.rank();
                        let x = || input(DType::F32, r, 8);
                        let async_ar = control_messages_during(&comm, &meet, |c| {
                            let w = c.all_reduce_async(x(), ReduceOp::Sum);
                            w.wait().unwrap();
                        });
                        let others = control_messages_during(&comm, &meet, |c| {
                            c.broadcast(x(), 1).unwrap();
                            c.reduce(x(), ReduceOp::Max, 0).unwrap();
                            c.all_gather(x()).unwrap();
                            c.reduce_scatter(input(DType::F32, r, 8 * n), ReduceOp::Sum)
                                .unwrap();
                            c.gather(x(), 0).unwrap();
                            let parts = (r == 1).then(|| (0..n).map(|_| x()).collect());
                            c.scatter(Tensor::zeros(DType::F32, 8), parts, 1).unwrap();
                            c.all_reduce(input(DType::F32, r, 1 << 16), ReduceOp::Sum)
                                .unwrap();
                        });
                        let barrier = control_messages_during(&comm, &meet, |c| {
                            c.barrier().unwrap();
                        });
                        (async_ar, others, barrier)
                    },
                );
                let (async_ar, others, barrier) = counts[0];
                let rounds = n.next_power_of_two().trailing_zeros() as usize;
                let what = format!("{} {checks:?} on {n} ranks", flavor.name());
                if checks == chorus::Checks::Fingerprint {
                    assert_eq!(async_ar, 0, "{what}: async all_reduce");
                    assert_eq!(others, 0, "{what}: other collectives");
                    assert_eq!(barrier, n * rounds, "{what}: barrier");
                } else {
                    assert_eq!(async_ar, n * (n - 1), "{what}: async all_reduce");
                    assert_eq!(barrier, n * (n - 1), "{what}: barrier");
                }
            }
        }
    }
}

/// Every collective mismatch kind, with fingerprint checks, on the fake:
/// the library is reached (NCCL has no check of its own; the fake hangs,
/// as NCCL does when sizes disagree), and the heartbeats' stall and
/// history checks end it as a fatal `Mismatch` on every rank within the
/// bound the cpu backend meets.
#[test]
fn fingerprint_mismatches_reach_every_rank_through_the_heartbeats() {
    let (_g, f) = setup();
    let flavor = flavors()[0];
    let before = f.counters().mismatched_collectives;
    for (size, name, op) in common::mismatch::collective_mismatches() {
        common::mismatch::mismatch_reaches_every_rank(flavor.name(), size, name, op);
    }
    let seen = f.counters().mismatched_collectives - before;
    assert!(seen > 0, "no mismatched collective reached the fake");
}
