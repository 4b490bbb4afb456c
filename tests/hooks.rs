//! Hooks, the flight recorder, hints and timeouts at the `Comm` level, on
//! in-process ranks over the real `cpu` backend.
//!
//! Hooks run on Chorus's hook thread, so every test collects the events a
//! hook sends into a channel and waits for the number it expects, bounded
//! by a deadline: no sleeps.

mod common;

use std::collections::BTreeMap;
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Barrier, Mutex};
use std::time::{Duration, Instant};

use chorus::{
    hints, new_comm, AbortHookArgs, CommOptions, DType, Device, Error, FlightState, P2POp,
    PostHookArgs, PreHookArgs, ReduceOp, Tensor,
};
use common::run_ranks_on;

const WAIT: Duration = Duration::from_secs(20);

#[derive(Debug)]
enum Ev {
    Pre(PreHookArgs),
    Post(PostHookArgs),
    Abort(AbortHookArgs),
}

/// `n` events from `rx`, or a failure after [`WAIT`].
fn take(rx: &Receiver<Ev>, n: usize) -> Vec<Ev> {
    let deadline = Instant::now() + WAIT;
    (0..n)
        .map(|i| {
            let left = deadline.saturating_duration_since(Instant::now());
            rx.recv_timeout(left)
                .unwrap_or_else(|_| panic!("only {i} of {n} hook events arrived"))
        })
        .collect()
}

fn sink(tx: &Sender<Ev>) -> Mutex<Sender<Ev>> {
    Mutex::new(tx.clone())
}

fn send(tx: &Mutex<Sender<Ev>>, ev: Ev) {
    let _ = tx.lock().unwrap().send(ev);
}

fn opts_hint(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
    kv.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn hooks_see_every_op_once_in_issue_order_with_matching_ids_world_2() {
    run_ranks_on(
        "cpu",
        2,
        "hooks-order",
        |_, o| o,
        |comm| {
            let me = comm.rank();
            let peer = 1 - me;
            let (tx, rx) = channel();
            let (pre_tx, post_tx) = (sink(&tx), sink(&tx));
            let _pre = comm.register_pre_hook(move |a| send(&pre_tx, Ev::Pre(a.clone())));
            let _post = comm.register_post_hook(move |a| send(&post_tx, Ev::Post(a.clone())));
            // Blocking (the inline fast path), async (queued), rooted and p2p.
            comm.all_reduce(Tensor::full(1.0f32, 2), ReduceOp::Sum)
                .unwrap();
            let works: Vec<_> = (0..3)
                .map(|_| comm.all_reduce_async(Tensor::full(1i32, 4), ReduceOp::Sum))
                .collect();
            for w in works {
                assert_eq!(w.wait().unwrap().to_vec::<i32>(), vec![2; 4]);
            }
            comm.broadcast(Tensor::full(7u8, 5), 1).unwrap();
            let t = Tensor::full(me as f64, 3);
            let got = if me == 0 {
                comm.send(t, peer).unwrap();
                comm.recv(Tensor::zeros(DType::F64, 3), peer).unwrap()
            } else {
                let r = comm.recv(Tensor::zeros(DType::F64, 3), peer).unwrap();
                comm.send(t, peer).unwrap();
                r
            };
            assert_eq!(got.to_vec::<f64>(), vec![peer as f64; 3]);
            comm.batch_p2p(vec![
                P2POp::send(Tensor::full(1u32, 1), peer),
                P2POp::recv(Tensor::zeros(DType::U32, 1), peer),
            ])
            .unwrap();
            comm.barrier_async().wait().unwrap();
            // A rejected op (bad root) is no op: no events.
            assert!(comm.broadcast(Tensor::full(1u8, 1), 9).is_err());

            let ops = 9;
            let evs = take(&rx, 2 * ops);
            let pres: Vec<&PreHookArgs> = evs
                .iter()
                .filter_map(|e| match e {
                    Ev::Pre(a) => Some(a),
                    _ => None,
                })
                .collect();
            let names: Vec<&str> = pres.iter().map(|a| a.op).collect();
            let p2p = if me == 0 {
                ["send", "recv"]
            } else {
                ["recv", "send"]
            };
            assert_eq!(
                names,
                [
                    "all_reduce",
                    "all_reduce",
                    "all_reduce",
                    "all_reduce",
                    "broadcast",
                    p2p[0],
                    p2p[1],
                    "batch_p2p",
                    "barrier"
                ]
            );
            assert!(
                pres.windows(2).all(|w| w[0].op_id < w[1].op_id),
                "ids increase"
            );
            for a in &pres {
                assert_eq!((a.comm.as_str(), a.rank), ("hooks-order", me));
            }
            assert_eq!(
                (pres[0].dtype, pres[0].count, pres[0].bytes),
                (DType::F32, 2, 8)
            );
            assert_eq!((pres[4].root, pres[4].bytes), (Some(1), 5));
            assert_eq!((pres[5].peers.as_slice(), pres[5].bytes), (&[peer][..], 24));
            assert_eq!((pres[7].peers.as_slice(), pres[7].count), (&[peer][..], 2));
            // Each op: one pre, then one post with the same id, and success.
            for p in &pres {
                let pre_at = evs
                    .iter()
                    .position(|e| matches!(e, Ev::Pre(a) if a.op_id == p.op_id))
                    .unwrap();
                let posts: Vec<usize> = evs
                    .iter()
                    .enumerate()
                    .filter(|(_, e)| matches!(e, Ev::Post(a) if a.op_id == p.op_id))
                    .map(|(i, _)| i)
                    .collect();
                assert_eq!(posts.len(), 1, "one post for op {}", p.op_id);
                assert!(posts[0] > pre_at, "post after pre for op {}", p.op_id);
                let Ev::Post(post) = &evs[posts[0]] else {
                    unreachable!()
                };
                assert_eq!(post.op, p.op);
                assert!(post.result.is_ok(), "{:?}", post.result);
                assert!(post.run_duration.is_some() && post.seq.is_some());
                assert!(post.run_duration.unwrap() <= post.duration);
            }
            assert!(rx.try_recv().is_err(), "no extra events");
            comm.finalize().unwrap();
        },
    );
}

#[test]
fn removed_and_dropped_hooks_are_not_called_again_and_panics_are_contained() {
    let comm = new_comm("cpu", Device::Cpu, "hooks-remove", CommOptions::single()).unwrap();
    let (tx, rx) = channel();
    let (a_tx, b_tx, keep_tx) = (sink(&tx), sink(&tx), sink(&tx));
    let a = comm.register_pre_hook(move |x| send(&a_tx, Ev::Pre(x.clone())));
    let b = comm.register_pre_hook(move |x| send(&b_tx, Ev::Pre(x.clone())));
    // Panicking hooks of every kind, registered before the one that keeps
    // reporting: it must still be called, on a live hook thread.
    let _p1 = comm.register_pre_hook(|_| panic!("pre hook panics"));
    let _p2 = comm.register_post_hook(|_| panic!("post hook panics"));
    let _p3 = comm.register_abort_hook(|_| panic!("abort hook panics"));
    let _keep = comm.register_post_hook(move |x| send(&keep_tx, Ev::Post(x.clone())));

    let out = comm
        .all_reduce(Tensor::full(3.0f32, 2), ReduceOp::Sum)
        .unwrap();
    assert_eq!(
        out.to_vec::<f32>(),
        vec![3.0, 3.0],
        "a panicking hook does not touch the op"
    );
    let evs = take(&rx, 3);
    assert_eq!(evs.iter().filter(|e| matches!(e, Ev::Pre(_))).count(), 2);

    a.remove();
    drop(b);
    comm.barrier().unwrap();
    // The post of the barrier is the only event: neither pre hook ran.
    match &take(&rx, 1)[0] {
        Ev::Post(p) => assert_eq!(p.op, "barrier"),
        other => panic!("a removed hook ran: {other:?}"),
    }
    comm.abort();
    assert!(comm.is_aborted());
    assert!(rx.try_recv().is_err());
}

#[test]
fn an_op_issued_inside_with_op_id_takes_the_reserved_id_and_only_the_first_does() {
    let comm = new_comm("cpu", Device::Cpu, "hooks-reserved", CommOptions::single()).unwrap();
    let (tx, rx) = channel();
    let (pre_tx, post_tx) = (sink(&tx), sink(&tx));
    let _pre = comm.register_pre_hook(move |a| send(&pre_tx, Ev::Pre(a.clone())));
    let _post = comm.register_post_hook(move |a| send(&post_tx, Ev::Post(a.clone())));
    let id = chorus::hooks::reserve_op_id();
    let t = Tensor::full(1.0f32, 2);
    // Two ops inside one reservation: the first takes it, the second a
    // fresh id; an op after the scope takes a fresh one as well.
    let ((), taken) = chorus::hooks::with_op_id(id, || {
        comm.all_reduce(t.clone(), ReduceOp::Sum).unwrap();
        comm.barrier().unwrap();
    });
    assert!(taken);
    comm.broadcast(t.clone(), 0).unwrap();
    // A reservation no op used ends with its scope: an op that fails its
    // argument checks does not take it.
    let unused = chorus::hooks::reserve_op_id();
    let (sent, taken) = chorus::hooks::with_op_id(unused, || comm.send(t.clone(), 0));
    assert!(
        matches!(sent, Err(Error::InvalidArgument { .. })),
        "{sent:?}"
    );
    assert!(!taken, "a rejected op takes no id");
    comm.barrier().unwrap();
    let ids: Vec<(bool, &str, u64)> = take(&rx, 8)
        .iter()
        .map(|e| match e {
            Ev::Pre(a) => (true, a.op, a.op_id),
            Ev::Post(a) => (false, a.op, a.op_id),
            Ev::Abort(_) => panic!("no abort here"),
        })
        .collect();
    let pre: Vec<_> = ids.iter().filter(|e| e.0).map(|e| (e.1, e.2)).collect();
    let post: Vec<_> = ids.iter().filter(|e| !e.0).map(|e| (e.1, e.2)).collect();
    assert_eq!(pre, post, "pre and post hooks see the same ids");
    assert_eq!(pre[0], ("all_reduce", id));
    assert!(pre[1].1 > id && pre[2].1 > pre[1].1, "{pre:?}");
    assert!(
        pre[3].1 > unused,
        "an unused reservation is not taken later: {pre:?}"
    );
    let record = comm.flight_record();
    assert_eq!(
        record[0].op_id, id,
        "the flight recorder has the reserved id too"
    );
}

#[test]
fn abort_hook_runs_once_with_the_cause_before_queued_ops_fail_world_2() {
    let gate = Arc::new(Barrier::new(2));
    run_ranks_on(
        "cpu",
        2,
        "hooks-abort",
        |_, o| o,
        move |comm| {
            if comm.rank() == 1 {
                // Never sends: rank 0's recv stays in flight until its abort.
                gate.wait();
                return;
            }
            let (tx, rx) = channel();
            let (ab_tx, post_tx) = (sink(&tx), sink(&tx));
            let _ab = comm.register_abort_hook(move |a| send(&ab_tx, Ev::Abort(a.clone())));
            let _post = comm.register_post_hook(move |a| send(&post_tx, Ev::Post(a.clone())));
            let recv = comm.recv_async(Tensor::zeros(DType::F32, 4), 1);
            let queued = comm.all_reduce_async(Tensor::full(1.0f32, 1), ReduceOp::Sum);
            comm.abort_with_reason("stop the job");
            comm.abort_with_reason("a second abort changes nothing");
            for w in [recv.wait().map(|_| ()), queued.wait().map(|_| ())] {
                match w {
                    Err(Error::Aborted { reason, .. }) => assert!(reason.contains("stop the job")),
                    other => panic!("expected Aborted, got {other:?}"),
                }
            }
            let evs = take(&rx, 3);
            match &evs[0] {
                Ev::Abort(a) => {
                    assert_eq!((a.comm.as_str(), a.rank, a.epoch), ("hooks-abort", 0, 0));
                    assert!(a.cause.to_string().contains("stop the job"), "{}", a.cause);
                }
                other => panic!("the abort hook must come before the ops fail: {other:?}"),
            }
            for e in &evs[1..] {
                assert!(matches!(e, Ev::Post(p) if p.result.is_err()), "{e:?}");
            }
            // A submit after the abort is refused; still no second abort event.
            assert!(comm.barrier().is_err());
            let more = take(&rx, 1);
            assert!(
                matches!(&more[0], Ev::Post(p) if p.op == "barrier" && p.run_duration.is_none())
            );
            assert!(rx.try_recv().is_err(), "abort hook ran once");
            gate.wait();
        },
    );
}

#[test]
fn a_hung_abort_hook_delays_the_abort_at_most_its_deadline() {
    let comm = new_comm("cpu", Device::Cpu, "hooks-hung", CommOptions::single()).unwrap();
    let (release_tx, release_rx) = channel::<()>();
    let release_rx = Mutex::new(release_rx);
    let (tx, rx) = channel();
    let ab_tx = sink(&tx);
    let _hung = comm.register_abort_hook(move |a| {
        send(&ab_tx, Ev::Abort(a.clone()));
        // Hangs until the test lets it go (bounded, so it never outlives it).
        let _ = release_rx.lock().unwrap().recv_timeout(WAIT);
    });
    let queued = comm.barrier_async();
    let start = Instant::now();
    comm.abort();
    let took = start.elapsed();
    assert!(matches!(take(&rx, 1)[0], Ev::Abort(_)));
    assert!(
        took < chorus::hooks::ABORT_HOOK_DEADLINE + Duration::from_secs(5),
        "the abort waited {took:?} for a hung hook"
    );
    assert!(comm.is_aborted());
    // The barrier either ran before the abort or was failed by it, and
    // either way completed without the hook's help.
    let _ = queued.wait();
    release_tx.send(()).unwrap();
}

#[test]
fn flight_record_follows_ops_tags_and_skips_unrecorded_ones_world_2() {
    run_ranks_on(
        "cpu",
        2,
        "fr-contents",
        |_, o| o.with_hint(hints::TAG, "comm-level"),
        |comm| {
            let me = comm.rank();
            let peer = 1 - me;
            comm.all_reduce(Tensor::full(1.0f32, 4), ReduceOp::Sum)
                .unwrap();
            let quiet = comm
                .with_hints(opts_hint(&[(hints::RECORD, "false")]))
                .unwrap();
            quiet.barrier().unwrap();
            let tagged = comm
                .with_hints(opts_hint(&[(hints::TAG, "step-1")]))
                .unwrap();
            tagged.all_gather(Tensor::full(me as i64, 2)).unwrap();
            let t = Tensor::full(1u8, 16);
            if me == 0 {
                comm.send(t, peer).unwrap();
            } else {
                comm.recv(t, peer).unwrap();
            }
            let fr = comm.flight_record();
            assert_eq!(fr.len(), 3, "{fr:#?}");
            let names: Vec<&str> = fr.iter().map(|e| e.op).collect();
            let p2p = if me == 0 { "send" } else { "recv" };
            assert_eq!(names, ["all_reduce", "all_gather", p2p]);
            assert_eq!(fr.iter().map(|e| e.id).collect::<Vec<_>>(), [0, 1, 2]);
            // The unrecorded barrier still took collective seq 1.
            assert_eq!(fr[0].seq, Some(0));
            assert_eq!(fr[1].seq, Some(2));
            assert_eq!(fr[2].seq, Some(0), "first p2p op with this peer");
            assert_eq!((fr[0].dtype, fr[0].count, fr[0].bytes), (DType::F32, 4, 16));
            assert_eq!((fr[2].peers.as_slice(), fr[2].bytes), (&[peer][..], 16));
            assert_eq!(fr[0].tag.as_deref(), Some("comm-level"));
            assert_eq!(fr[1].tag.as_deref(), Some("step-1"));
            for e in &fr {
                assert_eq!(e.state, FlightState::Completed, "{e:?}");
                assert_eq!(e.error, None);
                let (s, c) = (e.started_us.unwrap(), e.completed_us.unwrap());
                assert!(e.issued_us <= s && s <= c, "{e:?}");
            }
            assert!(fr[0].op_id < fr[1].op_id && fr[1].op_id < fr[2].op_id);
            comm.finalize().unwrap();
        },
    );
}

#[test]
fn flight_recorder_size_bounds_the_ring_and_zero_turns_it_off() {
    let small = new_comm(
        "cpu",
        Device::Cpu,
        "fr-small",
        CommOptions::single().with_flight_recorder_size(2),
    )
    .unwrap();
    for _ in 0..5 {
        small.barrier().unwrap();
    }
    let fr = small.flight_record();
    assert_eq!(
        fr.iter().map(|e| (e.id, e.seq)).collect::<Vec<_>>(),
        [(3, Some(3)), (4, Some(4))]
    );
    let off = new_comm(
        "cpu",
        Device::Cpu,
        "fr-off",
        CommOptions::single().with_flight_recorder_size(0),
    )
    .unwrap();
    off.barrier().unwrap();
    assert!(off.flight_record().is_empty());
}

fn temp_dir(tag: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("chorus-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    d
}

#[test]
fn set_timeout_bounds_the_next_recv_and_the_failure_is_recorded_and_dumped_world_2() {
    let dir = temp_dir("fr-dump");
    let gate = Arc::new(Barrier::new(2));
    let d = dir.clone();
    run_ranks_on(
        "cpu",
        2,
        "fr-dump",
        move |r, o| {
            if r == 0 {
                o.with_flight_recorder_dir(d.clone())
            } else {
                o
            }
        },
        move |comm| {
            comm.all_reduce(Tensor::full(1.0f32, 4), ReduceOp::Sum)
                .unwrap();
            if comm.rank() == 1 {
                // Rank 0's recv finds no sender; stay until it gave up.
                gate.wait();
                return;
            }
            let (tx, rx) = channel();
            let (ab_tx, post_tx) = (sink(&tx), sink(&tx));
            let _ab = comm.register_abort_hook(move |a| send(&ab_tx, Ev::Abort(a.clone())));
            let _post = comm.register_post_hook(move |a| send(&post_tx, Ev::Post(a.clone())));
            let old = comm.timeout();
            assert_eq!(old, Duration::from_secs(30), "the test options' timeout");
            let other_handle = comm.clone();
            comm.set_timeout(Duration::from_millis(300));
            assert_eq!(
                other_handle.timeout(),
                Duration::from_millis(300),
                "in place"
            );
            assert_eq!(comm.options().timeout, Duration::from_millis(300));
            let own = comm.with_timeout(Duration::from_secs(5));
            comm.set_timeout(Duration::from_millis(300));
            assert_eq!(
                own.timeout(),
                Duration::from_secs(5),
                "a handle's own timeout stays"
            );
            let start = Instant::now();
            let err = comm
                .recv(Tensor::zeros(DType::F32, 4), 1)
                .expect_err("no sender");
            let took = start.elapsed();
            match &err {
                Error::Timeout { after, op, .. } => {
                    assert_eq!(*after, Duration::from_millis(300));
                    assert_eq!(*op, "p2p");
                }
                other => panic!("expected Timeout, got {other:?}"),
            }
            assert!(
                took >= Duration::from_millis(300) && took < Duration::from_secs(10),
                "{took:?}"
            );
            assert!(comm.is_aborted());
            // The fatal error is the abort's cause, reported once, before
            // the op's own failure.
            let evs = take(&rx, 2);
            match &evs[..] {
                [Ev::Abort(a), Ev::Post(p)] => {
                    assert!(matches!(a.cause, Error::Timeout { .. }), "{}", a.cause);
                    assert_eq!(p.op, "recv");
                    assert!(
                        matches!(p.result, Err(Error::Timeout { .. })),
                        "{:?}",
                        p.result
                    );
                }
                other => panic!("expected the abort hook, then the recv's post: {other:?}"),
            }
            assert!(rx.try_recv().is_err());
            let fr = comm.flight_record();
            assert_eq!(fr.len(), 2);
            assert_eq!(fr[0].state, FlightState::Completed);
            assert_eq!((fr[1].op, fr[1].state), ("recv", FlightState::Failed));
            assert!(
                fr[1].error.as_deref().unwrap().contains("timed out"),
                "{:?}",
                fr[1].error
            );
            // The dump is written before the failing op completes.
            let path = d_path(&comm);
            let v: serde_json::Value =
                serde_json::from_slice(&std::fs::read(&path).expect("dump written")).unwrap();
            assert_eq!(v["version"], 1);
            assert_eq!(
                (v["comm"].as_str(), v["rank"].as_u64()),
                (Some("fr-dump"), Some(0))
            );
            assert_eq!(
                (v["size"].as_u64(), v["backend"].as_str()),
                (Some(2), Some("cpu"))
            );
            assert!(
                v["cause"].as_str().unwrap().contains("timed out"),
                "{}",
                v["cause"]
            );
            assert_eq!(v["dropped"], 0);
            let entries = v["entries"].as_array().unwrap();
            assert_eq!(entries.len(), 2);
            assert_eq!(entries[0]["op"], "all_reduce");
            assert_eq!(entries[0]["state"], "completed");
            assert_eq!(entries[0]["dtype"], "float32");
            assert_eq!(entries[1]["op"], "recv");
            assert_eq!(entries[1]["state"], "failed");
            assert_eq!(entries[1]["peers"], serde_json::json!([1]));
            gate.wait();
        },
    );
    std::fs::remove_dir_all(&dir).unwrap();

    fn d_path(comm: &chorus::Comm) -> std::path::PathBuf {
        comm.options().flight_recorder_dir.expect("dir set").join(
            chorus::flight_recorder::dump_file_name(comm.name(), 0, comm.rank()),
        )
    }
}

#[test]
fn hints_are_checked_kept_and_typed() {
    match new_comm(
        "cpu",
        Device::Cpu,
        "hints-bad",
        CommOptions::single().with_hint(hints::RECORD, "perhaps"),
    ) {
        Err(Error::InvalidArgument { reason, .. }) => assert!(reason.contains("chorus.record")),
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
    let comm = new_comm(
        "cpu",
        Device::Cpu,
        "hints-ok",
        CommOptions::single()
            .with_hint("vendor.algo", "ring")
            .with_hint("vendor.chunks", "8"),
    )
    .unwrap();
    assert_eq!(
        comm.get_hint::<String>("vendor.algo").unwrap().as_deref(),
        Some("ring")
    );
    assert_eq!(comm.get_hint::<u32>("vendor.chunks").unwrap(), Some(8));
    assert_eq!(comm.get_hint::<u32>("absent").unwrap(), None);
    assert!(matches!(
        comm.get_hint::<u32>("vendor.algo"),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        comm.with_hints(opts_hint(&[(hints::RECORD, "nope")])),
        Err(Error::InvalidArgument { .. })
    ));
    let per_op = comm
        .with_hints(opts_hint(&[("vendor.chunks", "16"), (hints::TAG, "x")]))
        .unwrap();
    assert_eq!(per_op.get_hint::<u32>("vendor.chunks").unwrap(), Some(16));
    assert_eq!(
        comm.get_hint::<u32>("vendor.chunks").unwrap(),
        Some(8),
        "the base keeps its own"
    );
    assert_eq!(per_op.hints().len(), 3);
    assert_eq!(
        per_op.options().hints.get(hints::TAG).map(String::as_str),
        Some("x")
    );
    // Unknown hints change nothing about the op.
    let out = per_op
        .all_reduce(Tensor::full(2i32, 3), ReduceOp::Sum)
        .unwrap();
    assert_eq!(out.to_vec::<i32>(), vec![2; 3]);
    assert!(
        comm.backend_version().starts_with("cpu"),
        "{}",
        comm.backend_version()
    );
    assert!(!comm.is_aborted());
    comm.finalize().unwrap();
    assert!(!comm.is_aborted(), "finalized is not aborted");
}

/// Run by [`timeout_env_sets_the_default_op_timeout`] in a child process
/// with the environment it sets (env vars are process-wide, so only this
/// child, alone in its process, may change them).
#[test]
#[ignore = "run as a child process by timeout_env_sets_the_default_op_timeout"]
fn timeout_env_child() {
    let want = std::env::var("CHORUS_TEST_WANT").expect("run by the parent test");
    if want == "config-error" {
        match new_comm("cpu", Device::Cpu, "env-bad", CommOptions::single()) {
            Err(Error::Config(m)) => assert!(m.contains("CHORUS_TIMEOUT_SECONDS"), "{m}"),
            other => panic!("expected Config, got {other:?}"),
        }
        assert_eq!(CommOptions::default().timeout, Duration::from_secs(600));
        std::env::set_var("CHORUS_TIMEOUT_SECONDS", "5");
        std::env::set_var("CHORUS_FLIGHT_RECORDER_SIZE", "many");
        match new_comm("cpu", Device::Cpu, "env-bad-size", CommOptions::single()) {
            Err(Error::Config(m)) => assert!(m.contains("CHORUS_FLIGHT_RECORDER_SIZE"), "{m}"),
            other => panic!("expected Config, got {other:?}"),
        }
    } else {
        let want = Duration::from_secs_f64(want.parse().unwrap());
        let defaults = CommOptions::default();
        assert_eq!(defaults.timeout, want);
        assert_eq!(defaults.flight_recorder_size, 7);
        assert_eq!(
            defaults.flight_recorder_dir.as_deref(),
            Some(std::path::Path::new("/nonexistent/fr"))
        );
        let comm = new_comm("cpu", Device::Cpu, "env-ok", CommOptions::single()).unwrap();
        assert_eq!(comm.timeout(), want);
        assert_eq!(comm.options().timeout, want);
    }
}

#[test]
fn timeout_env_sets_the_default_op_timeout() {
    for (value, want) in [
        ("2.5", "2.5"),
        ("45", "45"),
        ("soon", "config-error"),
        ("0", "config-error"),
    ] {
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "timeout_env_child",
                "--ignored",
                "--test-threads",
                "1",
            ])
            .env("CHORUS_TIMEOUT_SECONDS", value)
            .env("CHORUS_TEST_WANT", want)
            .env("CHORUS_FLIGHT_RECORDER_SIZE", "7")
            .env("CHORUS_FLIGHT_RECORDER_DIR", "/nonexistent/fr")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "CHORUS_TIMEOUT_SECONDS={value}: {text}"
        );
        assert!(text.contains("1 passed"), "the child ran the probe: {text}");
    }
}

#[test]
fn a_waited_op_returns_after_its_pre_and_post_hooks_ran_1000_ops_world_2() {
    use std::sync::atomic::{AtomicU64, Ordering};
    run_ranks_on(
        "cpu",
        2,
        "hooks-before-return",
        |_, o| o,
        |comm| {
            let pres = Arc::new(AtomicU64::new(0));
            let posts = Arc::new(AtomicU64::new(0));
            let (p, q) = (pres.clone(), posts.clone());
            let _pre = comm.register_pre_hook(move |_| {
                p.fetch_add(1, Ordering::SeqCst);
            });
            let _post = comm.register_post_hook(move |_| {
                q.fetch_add(1, Ordering::SeqCst);
            });
            let mut late = 0;
            for i in 1..=1000u64 {
                // Blocking, waited and awaited forms in turn.
                match i % 3 {
                    0 => drop(
                        comm.all_reduce(Tensor::full(1.0f32, 2), ReduceOp::Sum)
                            .unwrap(),
                    ),
                    1 => drop(
                        comm.all_reduce_async(Tensor::full(1.0f32, 2), ReduceOp::Sum)
                            .wait()
                            .unwrap(),
                    ),
                    _ => drop(
                        futures::executor::block_on(
                            comm.all_reduce_async(Tensor::full(1.0f32, 2), ReduceOp::Sum),
                        )
                        .unwrap(),
                    ),
                }
                if pres.load(Ordering::SeqCst) != i || posts.load(Ordering::SeqCst) != i {
                    late += 1;
                }
            }
            assert_eq!(late, 0, "ops returned before their hooks had run");
        },
    );
}

#[test]
fn a_slow_hook_delays_its_own_communicators_waits_and_no_other() {
    let a = new_comm("cpu", Device::Cpu, "hooks-slow-a", CommOptions::single()).unwrap();
    let b = new_comm("cpu", Device::Cpu, "hooks-slow-b", CommOptions::single()).unwrap();
    // A's post hook says it started, then holds until the gate opens.
    let (open, gate) = channel::<()>();
    let (entered_tx, entered) = channel::<()>();
    let gate = Mutex::new((gate, entered_tx));
    let _slow = a.register_post_hook(move |_| {
        let g = gate.lock().unwrap();
        let _ = g.1.send(());
        let _ = g.0.recv_timeout(WAIT);
    });
    let (tx, rx) = channel();
    let b_tx = sink(&tx);
    let _b_hook = b.register_post_hook(move |args| send(&b_tx, Ev::Post(args.clone())));

    let held = a.all_reduce_async(Tensor::full(1.0f32, 1), ReduceOp::Sum);
    // Nobody waits for A's op yet, so its hook thread runs the hook.
    entered
        .recv_timeout(WAIT)
        .expect("A's post hook did not start");
    // B's ops return while A's hook still holds (each on its own thread).
    for _ in 0..10 {
        b.all_reduce(Tensor::full(1.0f32, 1), ReduceOp::Sum)
            .unwrap();
    }
    assert_eq!(take(&rx, 10).len(), 10);
    // A's op is done, but waiting for it waits for its hook.
    assert!(held.is_completed());
    let held = match held.wait_timeout(Duration::from_millis(50)) {
        Err(work) => work,
        Ok(r) => panic!("A's wait returned before its hook ran: {r:?}"),
    };
    open.send(()).unwrap();
    assert_eq!(held.wait().unwrap().to_vec::<f32>(), vec![1.0]);
}

#[test]
fn an_op_waited_inside_a_hook_does_not_wait_for_its_own_hooks() {
    let comm = new_comm("cpu", Device::Cpu, "hooks-reentrant", CommOptions::single()).unwrap();
    let inner = comm.clone();
    let (tx, rx) = channel();
    let tx = sink(&tx);
    let _pre = comm.register_pre_hook(move |a| {
        if a.tag.as_deref() == Some("outer") {
            // On the hook thread: the inner op's hooks queue behind this one.
            let r = inner.all_reduce(Tensor::full(2.0f32, 1), ReduceOp::Sum);
            // A split waits for its own agreement op inside: not for hooks.
            let child = inner.split(&[0], "hooks-reentrant-child");
            send(&tx, Ev::Pre(a.clone()));
            assert_eq!(r.unwrap().to_vec::<f32>(), vec![2.0]);
            assert!(child.unwrap().is_some());
        }
    });
    let outer = comm
        .with_hints(opts_hint(&[(hints::TAG, "outer")]))
        .unwrap();
    outer
        .all_reduce(Tensor::full(1.0f32, 1), ReduceOp::Sum)
        .unwrap();
    assert_eq!(take(&rx, 1).len(), 1);
}

/// Records the names of the spans created while it is the subscriber.
#[derive(Clone, Default)]
struct SpanNames(Arc<Mutex<Vec<&'static str>>>);

impl<S: tracing::Subscriber> tracing_subscriber::Layer<S> for SpanNames {
    fn on_new_span(
        &self,
        attrs: &tracing::span::Attributes<'_>,
        _: &tracing::span::Id,
        _: tracing_subscriber::layer::Context<'_, S>,
    ) {
        self.0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .push(attrs.metadata().name());
    }
}

/// Per-op spans are built only when a subscriber enables their level (a
/// disabled span costs a small op a tenth of its software): a subscriber
/// at `debug` sees the communicator's and the op's span for every op, one
/// at `info` only the communicator's.
#[test]
fn ops_have_spans_at_the_levels_a_subscriber_enables() {
    use tracing_subscriber::layer::SubscriberExt;
    let comm = new_comm("cpu", Device::Cpu, "spans", CommOptions::single()).expect("new_comm");
    let mut counts = Vec::new();
    for level in [
        tracing::level_filters::LevelFilter::DEBUG,
        tracing::level_filters::LevelFilter::INFO,
    ] {
        let names = SpanNames::default();
        let subscriber = tracing_subscriber::registry()
            .with(names.clone())
            .with(level);
        tracing::subscriber::with_default(subscriber, || {
            let mut t = Tensor::full(1.0f32, 2);
            for _ in 0..3 {
                t = comm.all_reduce(t, ReduceOp::Sum).expect("all_reduce");
            }
        });
        let names = names.0.lock().unwrap_or_else(|e| e.into_inner()).clone();
        let count = |n: &str| names.iter().filter(|&&x| x == n).count();
        counts.push((count("comm"), count("op")));
    }
    assert_eq!(counts, vec![(3, 3), (3, 0)]);
    comm.finalize().expect("finalize");
}
