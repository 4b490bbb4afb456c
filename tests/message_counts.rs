//! With fingerprint checks an op sends only its algorithm's messages: no
//! header frames, no extra round. Counted on N = 2, 4 and 8 in-process
//! ranks with [`chorus::debug::data_messages_sent`] (every Header and Data
//! message of the cpu backend, TCP and shared memory alike).

mod common;

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Barrier};

use chorus::backends::cpu::schedule::{self, Schedule};
use chorus::{Checks, Comm, CommOptions, ReduceOp, Tensor};
use common::run_ranks_with;

/// An op every rank runs, as a test case.
type Op = Box<dyn Fn(&Comm) + Send + Sync>;

/// Messages every rank together sends for `op` with fingerprint checks,
/// counted between thread barriers once a warm-up run of `op` has passed on
/// every rank (it opens the links the op needs, when links open on demand:
/// opening a link is not a message of the op).
fn messages(n: usize, name: &str, op: impl Fn(&Comm) + Send + Sync + 'static) -> usize {
    messages_with(n, name, Checks::Fingerprint, op)
}

/// [`messages`] with the given checks.
fn messages_with(
    n: usize,
    name: &str,
    checks: Checks,
    op: impl Fn(&Comm) + Send + Sync + 'static,
) -> usize {
    let sync = Arc::new(Barrier::new(n));
    let count = Arc::new(AtomicUsize::new(0));
    let c = count.clone();
    let opts = move |_rank: usize, o: CommOptions| o.with_checks(checks);
    run_ranks_with(n, name, opts, move |comm| {
        op(&comm);
        sync.wait();
        let before = chorus::debug::data_messages_sent();
        sync.wait();
        op(&comm);
        sync.wait();
        if comm.rank() == 0 {
            c.store(
                chorus::debug::data_messages_sent() - before,
                Ordering::SeqCst,
            );
        }
        sync.wait();
    });
    count.load(Ordering::SeqCst)
}

/// The sends of every rank's schedule: the algorithm's messages.
fn sends(n: usize, build: impl Fn(usize) -> Schedule) -> usize {
    (0..n)
        .map(|r| {
            build(r)
                .steps
                .iter()
                .flat_map(|s| s.transfers.iter())
                .filter(|t| matches!(t, schedule::Transfer::Send { .. }))
                .count()
        })
        .sum()
}

#[test]
fn small_ops_send_their_direct_algorithms_messages_and_nothing_else() {
    for n in [2usize, 4, 8] {
        let one_to_all = n - 1;
        let all_to_all = n * (n - 1);
        let rounds = (n as f64).log2().ceil() as usize;
        let cases: Vec<(&str, usize, Op)> = vec![
            (
                "broadcast",
                one_to_all,
                Box::new(|c: &Comm| {
                    c.broadcast(Tensor::full(1.0f32, 2), 0).expect("broadcast");
                }),
            ),
            (
                "reduce",
                one_to_all,
                Box::new(|c: &Comm| {
                    c.reduce(Tensor::full(1.0f32, 2), ReduceOp::Sum, 1 % c.size())
                        .expect("reduce");
                }),
            ),
            (
                "gather",
                one_to_all,
                Box::new(|c: &Comm| {
                    c.gather(Tensor::full(1.0f32, 2), 0).expect("gather");
                }),
            ),
            (
                "scatter",
                one_to_all,
                Box::new(|c: &Comm| {
                    let inputs = (c.rank() == 0).then(|| vec![Tensor::full(1.0f32, 2); c.size()]);
                    c.scatter(Tensor::zeros(chorus::DType::F32, 2), inputs, 0)
                        .expect("scatter");
                }),
            ),
            (
                "all_reduce",
                all_to_all,
                Box::new(|c: &Comm| {
                    c.all_reduce(Tensor::full(1.0f32, 2), ReduceOp::Sum)
                        .expect("all_reduce");
                }),
            ),
            (
                "all_gather",
                all_to_all,
                Box::new(|c: &Comm| {
                    c.all_gather(Tensor::full(1.0f32, 2)).expect("all_gather");
                }),
            ),
            (
                "all_to_all_single",
                all_to_all,
                Box::new(|c: &Comm| {
                    c.all_to_all_single(Tensor::full(1.0f32, 2 * c.size()))
                        .expect("all_to_all_single");
                }),
            ),
            (
                // Every pair exchanges one message, an empty one for an
                // empty block, so that the op checks each pair's sizes.
                "all_to_all_v_single",
                all_to_all,
                Box::new(|c: &Comm| {
                    let (r, n) = (c.rank(), c.size());
                    let split = |i: usize, j: usize| usize::from((i + j) % 2 == 1);
                    let send: Vec<usize> = (0..n).map(|j| split(r, j)).collect();
                    let recv: Vec<usize> = (0..n).map(|j| split(j, r)).collect();
                    let t = Tensor::full(1.0f32, send.iter().sum());
                    c.all_to_all_v_single(t, &send, &recv)
                        .expect("all_to_all_v_single");
                }),
            ),
            (
                // The list form learns its sizes from these messages.
                "all_to_all",
                all_to_all,
                Box::new(|c: &Comm| {
                    let (r, n) = (c.rank(), c.size());
                    let inputs = (0..n)
                        .map(|j| Tensor::full(r as f32, (r + j) % 3))
                        .collect();
                    let out = c.all_to_all(inputs).expect("all_to_all");
                    for (j, t) in out.iter().enumerate() {
                        assert_eq!(t.to_vec::<f32>(), vec![j as f32; (r + j) % 3]);
                    }
                }),
            ),
            (
                "barrier",
                n * rounds,
                Box::new(|c: &Comm| c.barrier().expect("barrier")),
            ),
        ];
        for (what, want, op) in cases {
            let got = messages(n, &format!("mc-{what}-{n}"), op);
            assert_eq!(
                got, want,
                "{what} on {n} ranks: {got} messages, expected {want}"
            );
        }
    }
}

#[test]
fn large_ops_send_their_schedules_messages_and_nothing_else() {
    // 1 MiB of f32: above every small-op limit.
    const COUNT: usize = 1 << 18;
    for n in [2usize, 4, 8] {
        let got = messages(n, &format!("mc-bcast-large-{n}"), |c| {
            c.broadcast(Tensor::full(1.0f32, COUNT), 0)
                .expect("broadcast");
        });
        let want = sends(n, |r| schedule::broadcast(r, n, COUNT, 0));
        assert_eq!(want, n - 1, "a broadcast tree sends to every rank once");
        assert_eq!(got, want, "broadcast on {n} ranks");
        let got = messages(n, &format!("mc-ar-large-{n}"), |c| {
            c.all_reduce(Tensor::full(1.0f32, COUNT), ReduceOp::Sum)
                .expect("all_reduce");
        });
        let want = sends(n, |r| schedule::all_reduce_auto(r, n, COUNT, 4));
        assert_eq!(got, want, "all_reduce on {n} ranks");
        let got = messages(n, &format!("mc-ag-large-{n}"), move |c| {
            c.all_gather(Tensor::full(1.0f32, COUNT / n))
                .expect("all_gather");
        });
        let want = sends(n, |r| schedule::all_gather(r, n, &vec![COUNT / n; n]));
        assert_eq!(got, want, "all_gather on {n} ranks");
        // Pairwise steps: one message per ordered pair.
        let got = messages(n, &format!("mc-a2a-large-{n}"), move |c| {
            c.all_to_all_single(Tensor::full(1.0f32, COUNT))
                .expect("all_to_all_single");
        });
        assert_eq!(got, n * (n - 1), "all_to_all_single on {n} ranks");
    }
}

/// With strict checks the same broadcast also sends a header from every
/// rank to every other one: the cost the fingerprint removes.
#[test]
fn strict_checks_add_a_header_from_every_rank_to_every_other() {
    let n = 4;
    let got = messages_with(n, "mc-strict", Checks::Strict, |c| {
        c.broadcast(Tensor::full(1.0f32, 2), 0).expect("broadcast");
    });
    // The small payload rides in the root's headers.
    assert_eq!(got, n * (n - 1));
}

/// Per-rank data for the rooted ops below: rank `r`'s element `i`.
fn val(r: usize, i: usize) -> f32 {
    (r * 1000 + i % 997) as f32
}

/// A rooted op of every kind, on `n` ranks with `count` f32 per rank (per
/// block for gather and scatter) and root `root`, checking every result.
fn rooted_cases(n: usize, count: usize, root: usize) -> Vec<(&'static str, Op)> {
    let mine = move |r: usize| Tensor::from_vec((0..count).map(|i| val(r, i)).collect::<Vec<_>>());
    vec![
        (
            "reduce",
            Box::new(move |c: &Comm| {
                let out = c
                    .reduce(
                        Tensor::full(1.0f32 + c.rank() as f32, count),
                        ReduceOp::Sum,
                        root,
                    )
                    .expect("reduce");
                if c.rank() == root {
                    let want = (n * (n + 1) / 2) as f32;
                    assert!(
                        out.to_vec::<f32>().iter().all(|&x| x == want),
                        "reduce on {n}"
                    );
                }
            }),
        ),
        (
            "gather",
            Box::new(move |c: &Comm| {
                let out = c.gather(mine(c.rank()), root).expect("gather");
                if c.rank() == root {
                    assert_eq!(out.len(), n);
                    for (r, t) in out.iter().enumerate() {
                        assert_eq!(
                            t.to_vec::<f32>(),
                            mine(r).to_vec::<f32>(),
                            "gather block {r}"
                        );
                    }
                }
            }),
        ),
        (
            "scatter",
            Box::new(move |c: &Comm| {
                let inputs = (c.rank() == root).then(|| (0..n).map(mine).collect::<Vec<_>>());
                let out = c
                    .scatter(Tensor::zeros(chorus::DType::F32, count), inputs, root)
                    .expect("scatter");
                assert_eq!(
                    out.to_vec::<f32>(),
                    mine(c.rank()).to_vec::<f32>(),
                    "scatter"
                );
            }),
        ),
    ]
}

/// Above the direct algorithm's world (8 ranks), small ops run O(log N)
/// schedules: recursive doubling for all_reduce and all_gather, binomial
/// trees for broadcast, reduce, gather and scatter. Counted on 16 ranks,
/// with every result checked.
#[test]
fn small_ops_above_eight_ranks_send_their_log_schedules_messages() {
    let n = 16usize;
    let log = n.trailing_zeros() as usize;
    let root = 5;
    let mut cases = rooted_cases(n, 2, root);
    cases.push((
        "all_reduce",
        Box::new(move |c: &Comm| {
            let out = c
                .all_reduce(Tensor::full(1.0f32, 2), ReduceOp::Sum)
                .expect("all_reduce");
            assert_eq!(out.to_vec::<f32>(), vec![n as f32; 2]);
        }),
    ));
    cases.push((
        "all_gather",
        Box::new(move |c: &Comm| {
            let out = c
                .all_gather(Tensor::full(c.rank() as f32, 2))
                .expect("all_gather");
            let want: Vec<f32> = (0..n).flat_map(|r| [r as f32; 2]).collect();
            assert_eq!(out.to_vec::<f32>(), want);
        }),
    ));
    for (what, op) in cases {
        let want = match what {
            "reduce" => sends(n, |r| schedule::reduce_tree(r, n, 2, root)),
            "gather" => sends(n, |r| schedule::gather_tree(r, n, 2, root)),
            "scatter" => sends(n, |r| schedule::scatter_tree(r, n, 2, root)),
            "all_reduce" => sends(n, |r| schedule::all_reduce_auto(r, n, 2, 4)),
            _ => sends(n, |r| schedule::all_gather_auto(r, n, &[2; 16], false, 4)),
        };
        assert!(want <= n * log, "{what}: {want} messages");
        let got = messages(n, &format!("mc-log-{what}"), op);
        assert_eq!(got, want, "{what} on {n} ranks");
    }
}

/// Blocks too large for the direct algorithm but below the tree limit:
/// a reduce takes its binomial tree on 5 ranks, gathers and scatters take
/// theirs from 9 ranks (here 10, not a power of two, so a subtree wraps
/// past the last rank) and the root's one step below.
#[test]
fn medium_rooted_ops_take_the_trees_and_are_right() {
    let count = 8 << 10;
    // Relative ranks 4..8 of 10 wrap (real ranks 8, 9, 0, 1): that
    // subtree's blocks travel in two messages, so the trees send one
    // message more than the root's one step would.
    assert_eq!(sends(10, |r| schedule::gather_tree(r, 10, count, 4)), 10);
    for (n, root, trees) in [(5usize, 2, false), (10, 4, true)] {
        for (what, op) in rooted_cases(n, count, root) {
            let want = match (what, trees) {
                ("reduce", _) => sends(n, |r| schedule::reduce_tree(r, n, count, root)),
                ("gather", true) => sends(n, |r| schedule::gather_tree(r, n, count, root)),
                ("gather", false) => sends(n, |r| schedule::gather(r, n, count, root)),
                (_, true) => sends(n, |r| schedule::scatter_tree(r, n, count, root)),
                (_, false) => sends(n, |r| schedule::scatter(r, n, count, root)),
            };
            let got = messages(n, &format!("mc-tree{n}-{what}"), op);
            assert_eq!(got, want, "{what} on {n} ranks");
        }
    }
}
