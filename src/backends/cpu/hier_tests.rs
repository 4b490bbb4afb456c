//! Tests of the hierarchical schedules: every builder run on many
//! topologies (contiguous, interleaved, hosts of unequal sizes) by the
//! in-memory executor of the flat schedules' tests, against a reference,
//! and their cross-host traffic counted, up to 4 096 ranks.

use std::collections::BTreeSet;

use super::*;
use crate::backends::cpu::schedule::tests::{broadcast_input, data, reduced, simulate, JUNK};
use crate::backends::cpu::schedule::BufId;
use crate::backends::cpu::schedule::TREE_MAX_BYTES;
use crate::op::ReduceOp;

/// Host ids from a host index per rank.
fn ids(host_of: &[usize]) -> Vec<String> {
    host_of.iter().map(|h| format!("host-{h}")).collect()
}

/// Topologies worth testing: contiguous and interleaved, equal and
/// unequal hosts, with one-rank hosts among others.
fn topologies() -> Vec<Topology> {
    let layouts: Vec<Vec<usize>> = vec![
        vec![0, 0, 1, 1],
        vec![0, 0, 0, 0, 1, 1, 1, 1],
        vec![0, 0, 0, 1, 1, 1, 2, 2, 2],
        (0..9).map(|r| r % 3).collect(),
        vec![0, 0, 0, 1, 2, 2, 2, 2],
        vec![1, 0, 0, 1, 2, 0, 1, 2, 2, 0, 0],
        (0..16).map(|r| r / 4).collect(),
        (0..12).map(|r| r / 2).collect(),
        vec![0, 1, 1, 1, 1, 1],
    ];
    layouts
        .iter()
        .map(|l| Topology::from_ids(&ids(l)).expect("a hierarchical layout"))
        .collect()
}

/// Counts around the small/large boundary of `f64` all-reduces.
fn counts() -> Vec<usize> {
    let small = SMALL_ALL_REDUCE_BYTES / 8;
    vec![0, 1, 5, small, small + 1, 3 * small + 7]
}

fn cross_host_sends(topo: &Topology, scheds: &[Schedule]) -> usize {
    scheds
        .iter()
        .enumerate()
        .map(|(r, s)| {
            s.transfers()
                .filter(|t| matches!(t, Transfer::Send { peer, .. } if topo.host_of(*peer) != topo.host_of(r)))
                .count()
        })
        .sum()
}

/// Run the schedules in the in-memory executor. Not through the flat
/// tests' `run`, which also checks [SC-6]: a phase that is a small
/// all-reduce breaks it on purpose.
///
/// [SC-6]: crate::backends::cpu::schedule#invariants
fn run(
    scheds: Vec<Schedule>,
    src: Vec<Vec<f64>>,
    dst: Vec<Vec<f64>>,
    op: ReduceOp,
) -> Vec<Vec<f64>> {
    let n = scheds.len();
    for (r, s) in scheds.iter().enumerate() {
        for t in s.transfers() {
            assert!(!t.is_empty(), "rank {r}: zero-length {t:?}");
            assert!(t.peer().is_none_or(|p| p < n && p != r), "rank {r}: {t:?}");
        }
    }
    match simulate(scheds, src, dst, op) {
        Ok(out) => out,
        Err(e) => panic!("{e}"),
    }
}

fn uses_src(s: &Schedule) -> bool {
    s.transfers().any(|t| match t {
        Transfer::Send { buf, .. } | Transfer::Recv { buf, .. } => *buf == BufId::Src,
        Transfer::LocalCopy { .. } => true,
    })
}

#[test]
fn topology_groups_ranks_by_host_id_in_rank_order() {
    let t = Topology::from_ids(&["b", "a", "b", "c", "a"]).expect("three hosts");
    assert_eq!(t.hosts(), 3);
    assert_eq!(t.members(0), &[0, 2]);
    assert_eq!(t.members(1), &[1, 4]);
    assert_eq!(t.members(2), &[3]);
    assert_eq!((t.host_of(4), t.size()), (1, 5));
    assert!(!t.uniform());
    assert!(Topology::from_ids(&["a", "a", "b", "b"])
        .expect("two hosts")
        .uniform());
}

#[test]
fn topology_is_none_where_a_hierarchy_gains_nothing() {
    assert_eq!(Topology::from_ids(&["a", "a", "a"]), None, "one host");
    assert_eq!(
        Topology::from_ids(&["a", "b", "c"]),
        None,
        "a host per rank"
    );
    assert_eq!(
        Topology::from_ids(&["a", "", "a", "b"]),
        None,
        "unknown host"
    );
    assert_eq!(Topology::from_ids::<&str>(&[]), None);
    assert_eq!(Topology::from_ids(&["a"]), None);
}

#[test]
fn all_reduce_matches_the_reference_on_every_rank_and_topology() {
    for topo in topologies() {
        let n = topo.size();
        for count in counts() {
            for op in [ReduceOp::Sum, ReduceOp::Max] {
                let scheds: Vec<Schedule> =
                    (0..n).map(|r| all_reduce(r, &topo, count, 8)).collect();
                assert!(!scheds.iter().any(uses_src));
                let out = run(
                    scheds,
                    vec![vec![]; n],
                    (0..n).map(|r| data(r, count)).collect(),
                    op,
                );
                let want = reduced(n, count, op);
                for (r, got) in out.iter().enumerate() {
                    assert_eq!(got, &want, "rank {r} of {topo:?}, count {count}, {op}");
                }
            }
        }
    }
}

#[test]
fn broadcast_and_reduce_match_the_reference_from_every_root() {
    for topo in topologies() {
        let n = topo.size();
        for count in [1, 6, 9000] {
            for root in 0..n {
                let scheds: Vec<Schedule> =
                    (0..n).map(|r| broadcast(r, &topo, count, root)).collect();
                assert_eq!(
                    cross_host_sends(&topo, &scheds),
                    topo.hosts() - 1,
                    "broadcast crosses hosts once per other host"
                );
                let dst = broadcast_input(n, count, root);
                let out = run(scheds, vec![vec![]; n], dst, ReduceOp::Sum);
                assert!(
                    out.iter().all(|o| *o == data(root, count)),
                    "broadcast from {root} on {topo:?}"
                );

                let scheds: Vec<Schedule> =
                    (0..n).map(|r| reduce(r, &topo, count, root, 8)).collect();
                assert!(!scheds.iter().any(uses_src));
                let out = run(
                    scheds,
                    vec![vec![]; n],
                    (0..n).map(|r| data(r, count)).collect(),
                    ReduceOp::Sum,
                );
                assert_eq!(
                    out[root],
                    reduced(n, count, ReduceOp::Sum),
                    "reduce to {root} on {topo:?}, count {count}"
                );
            }
        }
    }
}

/// A small all-reduce crosses hosts only between leaders; a large one on
/// equal hosts crosses only along rails (each rank with its peers of the
/// same index on the other hosts), and moves `1/L` of the buffer each.
#[test]
fn all_reduce_crosses_hosts_only_between_leaders_or_along_rails() {
    let topo = Topology::from_ids(&ids(&(0..16).map(|r| r % 4).collect::<Vec<_>>()))
        .expect("4 interleaved hosts of 4");
    let big = 4 * SMALL_ALL_REDUCE_BYTES / 8;
    for r in 0..16 {
        let h = topo.host_of(r);
        let li = topo.members(h).iter().position(|&x| x == r).unwrap_or(0);
        let far = |s: &Schedule| -> Vec<usize> {
            s.transfers()
                .filter_map(Transfer::peer)
                .filter(|&p| topo.host_of(p) != h)
                .collect()
        };
        let small = far(&all_reduce(r, &topo, 1, 8));
        assert_eq!(small.is_empty(), li != 0, "rank {r}: {small:?}");
        let large = all_reduce(r, &topo, big, 8);
        for p in far(&large) {
            assert_eq!(topo.members(topo.host_of(p))[li], p, "rank {r} to {p}");
        }
        let cross_elems: usize = large
            .transfers()
            .filter(|t| t.peer().is_some_and(|p| topo.host_of(p) != h))
            .filter(|t| matches!(t, Transfer::Send { .. }))
            .map(Transfer::len)
            .sum();
        assert!(
            cross_elems <= 2 * big / 4,
            "rank {r} sends {cross_elems} of {big} elements off its host"
        );
    }
}

/// Every rank ends with the leaders' result, bitwise equal, also when a
/// host has one rank and the sum depends on its order.
#[test]
fn every_rank_ends_bitwise_equal_with_lone_ranks_on_hosts() {
    let topo = Topology::from_ids(&["x", "y", "y", "z", "y"]).expect("three hosts");
    let n = topo.size();
    // Non-associative in floating point: sums of values of very different
    // magnitudes; every rank must still end with the same bits.
    let dst: Vec<Vec<f64>> = (0..n)
        .map(|r| vec![1e16 * (r as f64) - 1.0, 0.1 * r as f64])
        .collect();
    let scheds: Vec<Schedule> = (0..n).map(|r| all_reduce(r, &topo, 2, 8)).collect();
    let out = simulate(scheds, vec![vec![]; n], dst, ReduceOp::Sum).expect("runs");
    let bits = |v: &Vec<f64>| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(out.iter().all(|o| bits(o) == bits(&out[0])), "{out:?}");
}

/// The scale bound with hosts: 4 096 ranks, 8 per host. An 8 B all-reduce
/// is right on every rank, sends O(N log N) messages of which only those
/// of a 512-rank all-reduce cross hosts; a broadcast crosses hosts 511
/// times; and after an 8 B and a 1 MiB all-reduce and a broadcast a rank
/// has talked to O(log H + L) peers, O(log H) of them on other hosts.
#[test]
fn on_4096_ranks_of_8_per_host_ops_cross_hosts_o_h_log_h_times() {
    const N: usize = 4096;
    const L: usize = 8;
    const H: usize = N / L;
    let topo =
        Topology::from_ids(&ids(&(0..N).map(|r| r / L).collect::<Vec<_>>())).expect("512 hosts");
    let log_n = N.trailing_zeros() as usize;
    let log_h = H.trailing_zeros() as usize;

    let scheds: Vec<Schedule> = (0..N).map(|r| all_reduce(r, &topo, 1, 8)).collect();
    let total: usize = scheds
        .iter()
        .map(|s| {
            s.transfers()
                .filter(|t| matches!(t, Transfer::Send { .. }))
                .count()
        })
        .sum();
    assert!(total <= N * log_n, "{total} messages");
    assert_eq!(cross_host_sends(&topo, &scheds), H * log_h);
    let out = simulate(
        scheds,
        vec![vec![]; N],
        (0..N).map(|r| data(r, 1)).collect(),
        ReduceOp::Sum,
    )
    .expect("runs");
    let want = reduced(N, 1, ReduceOp::Sum);
    assert!(out.iter().all(|o| *o == want));

    let scheds: Vec<Schedule> = (0..N).map(|r| broadcast(r, &topo, 1, 1234)).collect();
    assert_eq!(cross_host_sends(&topo, &scheds), H - 1);

    let (most, most_far) = (0..N)
        .map(|r| {
            let peers: BTreeSet<usize> = [
                all_reduce(r, &topo, 1, 8),
                all_reduce(r, &topo, 1 << 17, 8),
                broadcast(r, &topo, 1, 1234),
            ]
            .iter()
            .flat_map(|s| s.transfers().filter_map(Transfer::peer).collect::<Vec<_>>())
            .collect();
            let far = peers
                .iter()
                .filter(|&&p| topo.host_of(p) != topo.host_of(r))
                .count();
            (peers.len(), far)
        })
        .fold((0, 0), |(a, b), (c, d)| (a.max(c), b.max(d)));
    assert!(most <= 2 * log_h + L, "{most} peers on one rank");
    assert!(most_far <= 2 * log_h + 1, "{most_far} peers off the host");
}

/// Per-rank counts of `f64` blocks for gather and scatter: below the flat
/// binomial tree's limit (the flat schedules run) and above it (two levels
/// on hosts of consecutive ranks).
fn rooted_counts() -> Vec<usize> {
    let tree = TREE_MAX_BYTES / 8;
    vec![1, 5, tree, tree + 1, tree + 3]
}

#[test]
fn gather_and_scatter_match_the_reference_on_every_topology_and_root() {
    for topo in topologies() {
        let n = topo.size();
        for count in rooted_counts() {
            for root in 0..n {
                let case = format!("{:?} count {count} root {root}", topo.members);
                // Gather: a non-root's Dst is its scratch.
                let built: Vec<(Schedule, usize)> =
                    (0..n).map(|r| gather(r, &topo, count, root, 8)).collect();
                let src: Vec<Vec<f64>> = (0..n).map(|r| data(r, count)).collect();
                let dst = built
                    .iter()
                    .enumerate()
                    .map(|(r, (_, scratch))| {
                        vec![JUNK; if r == root { n * count } else { *scratch }]
                    })
                    .collect();
                let scheds: Vec<Schedule> = built.into_iter().map(|(s, _)| s).collect();
                let out = run(scheds, src.clone(), dst, ReduceOp::Sum);
                assert_eq!(out[root], src.concat(), "gather {case}");

                // Scatter: a non-root's Src is its scratch.
                let all = data(root, n * count);
                let built: Vec<(Schedule, usize)> =
                    (0..n).map(|r| scatter(r, &topo, count, root, 8)).collect();
                let src = built
                    .iter()
                    .enumerate()
                    .map(|(r, (_, scratch))| {
                        if r == root {
                            all.clone()
                        } else {
                            vec![JUNK; *scratch]
                        }
                    })
                    .collect();
                let scheds: Vec<Schedule> = built.into_iter().map(|(s, _)| s).collect();
                let out = run(scheds, src, vec![vec![JUNK; count]; n], ReduceOp::Sum);
                for (r, got) in out.iter().enumerate() {
                    assert_eq!(
                        got[..],
                        all[r * count..(r + 1) * count],
                        "scatter {case} rank {r}"
                    );
                }
            }
        }
    }
}

/// Large blocks on 4 096 ranks of 8 per host: a gather and a scatter cross
/// hosts exactly 511 times (one message per other host) and the root
/// handles 7 + 511 messages instead of 4 095; a leader's scratch is its
/// host's span. Small blocks keep the flat binomial tree.
#[test]
fn on_4096_ranks_a_large_gather_or_scatter_crosses_hosts_once_per_host() {
    const N: usize = 4096;
    const L: usize = 8;
    const H: usize = N / L;
    let topo =
        Topology::from_ids(&ids(&(0..N).map(|r| r / L).collect::<Vec<_>>())).expect("512 hosts");
    let count = TREE_MAX_BYTES / 8 + 1;
    let root = 1234;
    for (what, built) in [
        (
            "gather",
            (0..N)
                .map(|r| gather(r, &topo, count, root, 8))
                .collect::<Vec<_>>(),
        ),
        (
            "scatter",
            (0..N).map(|r| scatter(r, &topo, count, root, 8)).collect(),
        ),
    ] {
        let scheds: Vec<Schedule> = built.iter().map(|(s, _)| s.clone()).collect();
        assert_eq!(cross_host_sends(&topo, &scheds), H - 1, "{what}");
        let at_root = scheds[root]
            .transfers()
            .filter(|t| t.peer().is_some())
            .count();
        assert_eq!(at_root, L - 1 + H - 1, "{what}: messages at the root");
        let leader = topo.members(0)[0];
        assert_eq!(built[leader].1, L * count, "{what}: a leader's scratch");
        assert_eq!(built[leader + 1].1, 0, "{what}: a member needs no scratch");
        // No rank handles more messages than the root.
        let most = scheds
            .iter()
            .map(|s| s.transfers().filter(|t| t.peer().is_some()).count())
            .max();
        assert_eq!(most, Some(at_root), "{what}");
    }
    let (small, _) = gather(5, &topo, 1, root, 8);
    let (flat, _) = crate::backends::cpu::schedule::gather_auto(5, N, 1, root, 8);
    assert_eq!(
        small.transfers().count(),
        flat.transfers().count(),
        "small blocks stay flat"
    );
}

/// A barrier's rounds as a schedule the in-memory executor runs: each
/// message carries what its sender knows of who entered the barrier (one
/// element per rank, combined with `Max`), sent as it was before the
/// round, as the empty messages of a real barrier are sent at its start.
fn barrier_schedule(rounds: &[(Option<usize>, Option<usize>)], n: usize) -> Schedule {
    let steps = rounds
        .iter()
        .map(|&(to, from)| Step {
            transfers: to
                .map(|peer| Transfer::Send {
                    peer,
                    buf: BufId::Dst,
                    range: 0..n,
                })
                .into_iter()
                .chain(from.map(|peer| Transfer::Recv {
                    peer,
                    buf: BufId::Dst,
                    range: 0..n,
                    action: crate::backends::cpu::schedule::RecvAction::Reduce,
                }))
                .collect(),
        })
        .collect();
    Schedule { steps }
}

/// Every rank of the two-level barrier finishes knowing that every rank
/// entered it, its rounds pair up (no deadlock, no unmatched message), it
/// crosses hosts only between leaders, and it takes at most
/// `2 ceil(log2 L) + ceil(log2 H)` rounds.
#[test]
fn barrier_rounds_reach_every_rank_and_cross_hosts_only_between_leaders() {
    let mut layouts: Vec<Topology> = topologies();
    layouts.push(
        Topology::from_ids(&ids(&(0..64).map(|r| r / 8).collect::<Vec<_>>())).expect("8 × 8"),
    );
    for topo in layouts {
        let n = topo.size();
        let rounds: Vec<Vec<(Option<usize>, Option<usize>)>> =
            (0..n).map(|r| barrier_rounds(r, &topo)).collect();
        let scheds: Vec<Schedule> = rounds.iter().map(|r| barrier_schedule(r, n)).collect();
        let known: Vec<Vec<f64>> = (0..n)
            .map(|r| (0..n).map(|q| f64::from(u8::from(q == r))).collect())
            .collect();
        let out = simulate(scheds, vec![vec![]; n], known, ReduceOp::Max)
            .unwrap_or_else(|e| panic!("{topo:?}: {e}"));
        for (r, k) in out.iter().enumerate() {
            assert!(
                k.iter().all(|&x| x == 1.0),
                "rank {r} of {topo:?} left early: {k:?}"
            );
        }
        let ceil_log = |x: usize| x.next_power_of_two().trailing_zeros() as usize;
        for (r, mine) in rounds.iter().enumerate() {
            let h = topo.host_of(r);
            let l = topo.members(h).len();
            assert!(mine.len() <= 2 * ceil_log(l) + ceil_log(topo.hosts()));
            for p in mine.iter().flat_map(|&(a, b)| [a, b]).flatten() {
                if topo.host_of(p) != h {
                    assert!(
                        topo.members(h)[0] == r && topo.members(topo.host_of(p))[0] == p,
                        "{r} and {p} are not both leaders"
                    );
                }
            }
        }
    }
    assert!(barrier_rounds(9, &Topology::from_ids(&["a", "a", "b"]).expect("2 hosts")).is_empty());
}

/// The two-level all-gather is right on every layout (two levels on hosts
/// of consecutive ranks, flat on the others), with equal and unequal
/// blocks (some empty), in place or not; on consecutive hosts only the
/// leaders cross hosts.
#[test]
fn all_gather_matches_the_reference_and_crosses_hosts_only_between_leaders() {
    let mut layouts = topologies();
    layouts.push(Topology::from_ids(&ids(&[0, 0, 0, 1, 2, 2])).expect("unequal, consecutive"));
    for topo in layouts {
        let n = topo.size();
        let uneven: Vec<usize> = (0..n)
            .map(|r| (r * 7 + 3) % 5 * usize::from(r % 4 != 2))
            .collect();
        for counts in [vec![3; n], uneven, vec![0; n]] {
            let offs = offsets(&counts);
            let want: Vec<f64> = (0..n).flat_map(|r| data(r, counts[r])).collect();
            for in_place in [false, true] {
                let scheds: Vec<Schedule> = (0..n)
                    .map(|r| all_gather(r, &topo, &counts, in_place, 8))
                    .collect();
                if topo.contiguous() {
                    let leaders = (0..n).filter(|&r| topo.members(topo.host_of(r))[0] == r);
                    let far = cross_host_sends(&topo, &scheds);
                    let bound: usize = leaders.count() * topo.hosts();
                    assert!(far <= bound, "{far} messages between hosts on {topo:?}");
                    for (r, s) in scheds.iter().enumerate() {
                        let leader = topo.members(topo.host_of(r))[0];
                        if r != leader {
                            assert!(s
                                .transfers()
                                .filter_map(Transfer::peer)
                                .all(|p| topo.host_of(p) == topo.host_of(r)));
                        }
                    }
                }
                let (src, dst): (Vec<Vec<f64>>, Vec<Vec<f64>>) = (0..n)
                    .map(|r| {
                        let mut d = vec![-1.0e9; offs[n]];
                        if in_place {
                            d[offs[r]..offs[r + 1]].copy_from_slice(&data(r, counts[r]));
                            (vec![], d)
                        } else {
                            (data(r, counts[r]), d)
                        }
                    })
                    .unzip();
                for (r, s) in scheds.iter().enumerate() {
                    // No phase breaks SC-6 here: the full check applies.
                    s.validate(r, n, src[r].len(), offs[n])
                        .unwrap_or_else(|e| panic!("{e} on {topo:?}"));
                }
                let out = run(scheds, src, dst, ReduceOp::Sum);
                for (r, got) in out.iter().enumerate() {
                    assert_eq!(
                        got, &want,
                        "rank {r} of {topo:?}, {counts:?}, in place {in_place}"
                    );
                }
            }
        }
    }
    assert!(all_gather(
        0,
        &Topology::from_ids(&["a", "a", "b"]).expect("2 hosts"),
        &[1, 1],
        false,
        8
    )
    .is_empty());
}

/// Block `r` of `Dst` after rank `r`'s reduce-scatter: every rank's input
/// reduced over that block.
#[test]
fn reduce_scatter_matches_the_reference_on_every_topology() {
    let mut layouts = topologies();
    layouts.push(
        Topology::from_ids(&ids(&(0..16).map(|r| r / 2).collect::<Vec<_>>()))
            .expect("8 hosts of 2"),
    );
    layouts.push(
        Topology::from_ids(&ids(&(0..15).map(|r| r / 3).collect::<Vec<_>>()))
            .expect("5 hosts of 3"),
    );
    for topo in layouts {
        let n = topo.size();
        let uneven: Vec<usize> = (0..n)
            .map(|r| (r * 7 + 3) % 5 * usize::from(r % 4 != 2))
            .collect();
        for counts in [vec![3; n], uneven, vec![0; n], vec![1; n]] {
            let offs = offsets(&counts);
            for op in [ReduceOp::Sum, ReduceOp::Max] {
                let scheds: Vec<Schedule> =
                    (0..n).map(|r| reduce_scatter(r, &topo, &counts)).collect();
                assert!(!scheds.iter().any(uses_src));
                let two_level = topo.contiguous() && topo.uniform();
                for (r, s) in scheds.iter().enumerate() {
                    s.validate(r, n, 0, offs[n])
                        .unwrap_or_else(|e| panic!("{e} on {topo:?}"));
                    if two_level {
                        // Off the host only along the rail.
                        let (h, members) = (topo.host_of(r), topo.members(topo.host_of(r)));
                        let li = members.iter().position(|&x| x == r).unwrap_or(0);
                        for p in s.transfers().filter_map(Transfer::peer) {
                            if topo.host_of(p) != h {
                                assert_eq!(topo.members(topo.host_of(p))[li], p, "rank {r} to {p}");
                            }
                        }
                        let (l, hosts) = (members.len(), topo.hosts());
                        let rail_steps = if hosts.is_power_of_two() {
                            hosts.trailing_zeros() as usize
                        } else {
                            hosts - 1
                        };
                        assert!(
                            s.steps.len() <= l - 1 + rail_steps,
                            "rank {r}: {} steps",
                            s.steps.len()
                        );
                    }
                }
                let out = run(
                    scheds,
                    vec![vec![]; n],
                    (0..n).map(|r| data(r, offs[n])).collect(),
                    op,
                );
                let want = reduced(n, offs[n], op);
                for (r, got) in out.iter().enumerate() {
                    assert_eq!(
                        got[offs[r]..offs[r + 1]],
                        want[offs[r]..offs[r + 1]],
                        "rank {r} of {topo:?}, {counts:?}, {op}"
                    );
                }
            }
        }
    }
    assert!(reduce_scatter(
        0,
        &Topology::from_ids(&["a", "a", "b"]).expect("2 hosts"),
        &[1, 1]
    )
    .is_empty());
}

/// At scale, 8 ranks per host: a reduce-scatter takes `L - 1 + log2 H`
/// steps instead of the flat ring's `N - 1`, crosses hosts only along
/// rails, and each rank sends at most `N - 1` messages (its host's spans
/// on the host, then its rail's blocks). Simulated in full on 1 024 ranks;
/// on 4 096 ranks, the schedules of a sample of ranks are checked.
#[test]
fn at_scale_a_reduce_scatter_takes_l_plus_log_h_steps_along_rails() {
    const L: usize = 8;
    for n in [1024usize, 4096] {
        let h = n / L;
        let topo = Topology::from_ids(&ids(&(0..n).map(|r| r / L).collect::<Vec<_>>()))
            .expect("hosts of 8");
        let counts = vec![1; n];
        let steps = L - 1 + h.trailing_zeros() as usize;
        let sample: Vec<usize> = if n <= 1024 {
            (0..n).collect()
        } else {
            (0..n).step_by(97).chain([n - 1, L, L - 1]).collect()
        };
        for &r in &sample {
            let s = reduce_scatter(r, &topo, &counts);
            assert_eq!(s.steps.len(), steps, "rank {r}");
            let sends: Vec<usize> = s
                .transfers()
                .filter_map(|t| match t {
                    Transfer::Send { peer, .. } => Some(*peer),
                    _ => None,
                })
                .collect();
            assert_eq!(sends.len(), (L - 1) * h + h - 1, "rank {r}");
            let far = sends
                .iter()
                .filter(|&&p| topo.host_of(p) != topo.host_of(r))
                .count();
            assert_eq!(far, h - 1, "rank {r}");
        }
        if n <= 1024 {
            let scheds: Vec<Schedule> = (0..n).map(|r| reduce_scatter(r, &topo, &counts)).collect();
            let out = simulate(
                scheds,
                vec![vec![]; n],
                (0..n).map(|r| data(r, n)).collect(),
                ReduceOp::Sum,
            )
            .expect("runs");
            let want = reduced(n, n, ReduceOp::Sum);
            for (r, got) in out.iter().enumerate() {
                assert_eq!(got[r], want[r], "rank {r}");
            }
        }
    }
}
