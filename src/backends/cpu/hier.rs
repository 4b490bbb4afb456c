//! Hierarchical collectives for communicators that span several hosts.
//!
//! This module owns the [`Topology`] of a communicator (which host each
//! rank is on, from the host ids of the bootstrap records) and the
//! two-level schedules built on it. Each is composed of the flat builders
//! of [`schedule`](super::schedule), run on subgroups of ranks: the ranks
//! of one host, one representative per host, or one *rail* (the ranks with
//! the same index on every host). So a collective crosses the network only
//! between representatives or along rails, and everything else stays on
//! the host, where the `cpu` backend uses shared memory.
//!
//! | builder | phases (`L` ranks on this host, `H` hosts) | cross-host messages per op |
//! |---------|---------------------------------------------|----------------------------|
//! | [`all_reduce`], small (up to [`SMALL_ALL_REDUCE_BYTES`]), or hosts of unequal sizes | reduce to the host's leader ([`reduce_auto`]), all-reduce among the `H` leaders ([`all_reduce_auto`]), broadcast from the leader | those of one `H`-rank all-reduce |
//! | [`all_reduce`], larger, every host with `L` ranks | reduce-scatter on the host (`L` blocks), then for each block an all-reduce along its rail (`H` ranks, [`all_reduce_auto`] on `1/L` of the buffer), then all-gather on the host | `L` all-reduces of `1/L` of the buffer, in parallel |
//! | [`broadcast`] | binomial tree among the hosts' representatives (the root on its host, the leader elsewhere), then within each host | `H - 1` |
//! | [`reduce`] | [`reduce_auto`] to each host's representative, then among the representatives to the root | those of one `H`-rank reduce |
//! | [`all_gather`], hosts of consecutive ranks | every rank's block to its host's leader, all-gather of the hosts' spans among the leaders ([`all_gather_auto`](super::schedule::all_gather_auto)), broadcast of the whole output from each leader | those of one `H`-rank all-gather |
//! | [`reduce_scatter`], hosts of consecutive ranks, every host with `L` ranks | ring reduce-scatter on the host over every host's span at once, then a reduce-scatter along each rail ([`reduce_scatter_blocks`]: recursive halving on a power-of-two `H`) | each rank its rail's `H - 1` blocks |
//! | [`gather`], [`scatter`], blocks too large for the flat binomial tree, hosts of consecutive ranks | the host's blocks to (from) its representative, then one message per host between the representatives and the root | `H - 1` |
//! | [`barrier_rounds`] | binomial fan-in to the leader, dissemination among the leaders, binomial fan-out | `H ceil(log2 H)` |
//!
//! all_to_all's two levels (rails) forward blocks between ranks rather
//! than run a schedule; they live in [`alltoall`](super::alltoall).
//!
//! A host's *leader* is its lowest rank. Every choice here is a pure
//! function of arguments every rank agrees on (the records every rank
//! read, the op's count and root), so all ranks build matching schedules.
//! The composed schedules keep [SC-1]..[SC-5]; a phase that uses
//! [`all_reduce_small`](super::schedule::all_reduce_small) breaks [SC-6] as
//! it does on its own, and the executor stages it the same way.
//!
//! Memory: a [`Topology`] is O(N) per rank, built once per communicator.
//! Building one rank's schedule is O(its transfers) plus the block layouts
//! of its phases, O(L) on the host and O(H) among hosts (as a flat
//! all-reduce on `H` ranks); nothing else per op is O(N). The ops that
//! take a count per rank (all_gather, reduce_scatter) lay out their N
//! blocks, O(N), as the flat ones do, and reduce_scatter sends `(L - 1) H`
//! messages on the host, its algorithm's.
//!
//! ```
//! use chorus::backends::cpu::hier::{all_reduce, Topology};
//! // 8 ranks on two hosts, ranks 0..4 on "a" and 4..8 on "b".
//! let ids: Vec<&str> = (0..8).map(|r| if r < 4 { "a" } else { "b" }).collect();
//! let topo = Topology::from_ids(&ids).expect("two hosts of four");
//! assert_eq!((topo.hosts(), topo.uniform()), (2, true));
//! // An 8 B all-reduce: rank 5 (not a leader) talks only to ranks of its host.
//! let s = all_reduce(5, &topo, 1, 8);
//! assert!(s.transfers().filter_map(|t| t.peer()).all(|p| (4..8).contains(&p)));
//! ```
//!
//! [SC-1]: super::schedule#invariants
//! [SC-5]: super::schedule#invariants
//! [SC-6]: super::schedule#invariants

use std::collections::HashMap;

use super::schedule::{
    all_gather_auto as flat_all_gather, all_gather_in_place, all_reduce_auto,
    broadcast as flat_broadcast, even_counts, gather_auto, offsets, reduce_auto,
    reduce_scatter as flat_reduce_scatter, reduce_scatter_blocks, reduce_scatter_sets, reduce_tree,
    rooted_tree, scatter_auto, BufId, RecvAction, Rooted, Schedule, Step, Transfer,
    SMALL_ALL_REDUCE_BYTES,
};

/// Which host every rank of a communicator is on. O(N): three words per
/// rank and one list of ranks per host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    /// Host index of each rank; hosts are numbered in the order of their
    /// lowest rank, so host 0 holds rank 0.
    host_of: Vec<usize>,
    /// Each rank's index among its host's ranks.
    local: Vec<usize>,
    /// The ranks of each host, ascending.
    members: Vec<Vec<usize>>,
}

impl Topology {
    /// The topology given by one host id per rank (`ids[r]` for rank `r`),
    /// or `None` where a hierarchy has nothing to gain: an empty id (a rank
    /// that does not know its host), a single host, or every rank on a host
    /// of its own.
    pub fn from_ids<S: AsRef<str>>(ids: &[S]) -> Option<Topology> {
        if ids.iter().any(|s| s.as_ref().is_empty()) {
            return None;
        }
        let mut index: HashMap<&str, usize> = HashMap::new();
        let mut host_of = Vec::with_capacity(ids.len());
        let mut local = Vec::with_capacity(ids.len());
        let mut members: Vec<Vec<usize>> = Vec::new();
        for (rank, id) in ids.iter().enumerate() {
            let h = *index.entry(id.as_ref()).or_insert_with(|| {
                members.push(Vec::new());
                members.len() - 1
            });
            host_of.push(h);
            local.push(members[h].len());
            members[h].push(rank);
        }
        (members.len() >= 2 && members.len() < ids.len()).then_some(Topology {
            host_of,
            local,
            members,
        })
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.host_of.len()
    }

    /// Number of hosts.
    pub fn hosts(&self) -> usize {
        self.members.len()
    }

    /// Whether every host has the same number of ranks (the rails of the
    /// large all-reduce need it).
    pub fn uniform(&self) -> bool {
        self.members.windows(2).all(|w| w[0].len() == w[1].len())
    }

    /// The host index of `rank`.
    pub fn host_of(&self, rank: usize) -> usize {
        self.host_of[rank]
    }

    /// `rank`'s index among its host's ranks (its rail).
    pub fn local(&self, rank: usize) -> usize {
        self.local[rank]
    }

    /// The ranks of host `h`, ascending.
    pub fn members(&self, h: usize) -> &[usize] {
        &self.members[h]
    }

    /// Whether every host's ranks are consecutive (hosts then follow one
    /// another in rank order), as block placement by a launcher makes
    /// them: the two-level all-gather needs it.
    pub fn contiguous(&self) -> bool {
        self.members
            .iter()
            .all(|m| m.windows(2).all(|w| w[1] == w[0] + 1))
    }

    /// Host `h`'s span of a buffer of `count` elements per rank, laid out
    /// by rank; one range when the topology is [`Topology::contiguous`].
    fn span(&self, h: usize, count: usize) -> std::ops::Range<usize> {
        let m = &self.members[h];
        m[0] * count..(m[m.len() - 1] + 1) * count
    }

    /// For `rank` in an op rooted at `root`: its host, that host's ranks
    /// and that host's representative ([`Topology::rep`]); `None` when
    /// either rank is outside the topology.
    fn rooted(&self, rank: usize, root: usize) -> Option<(usize, &[usize], usize)> {
        if rank >= self.size() || root >= self.size() {
            return None;
        }
        let h = self.host_of[rank];
        Some((h, &self.members[h], self.rep(h, root)))
    }

    /// Host `h`'s representative for an op rooted at `root`: the root on
    /// its own host, the leader (lowest rank) elsewhere.
    fn rep(&self, h: usize, root: usize) -> usize {
        if self.host_of[root] == h {
            root
        } else {
            self.members[h][0]
        }
    }
}

/// Appends sub-schedules of subgroups to one rank's schedule.
struct Composer {
    steps: Vec<Step>,
}

impl Composer {
    fn new() -> Composer {
        Composer { steps: Vec::new() }
    }

    /// Append `sub`, a schedule built for a subgroup, with its peers mapped
    /// to ranks by `rank_of` and every element range moved up by `shift`.
    fn embed(&mut self, sub: Schedule, rank_of: impl Fn(usize) -> usize, shift: usize) {
        let moved = |r: std::ops::Range<usize>| r.start + shift..r.end + shift;
        for step in sub.steps {
            let transfers = step
                .transfers
                .into_iter()
                .map(|t| match t {
                    Transfer::Send { peer, buf, range } => Transfer::Send {
                        peer: rank_of(peer),
                        buf,
                        range: moved(range),
                    },
                    Transfer::Recv {
                        peer,
                        buf,
                        range,
                        action,
                    } => Transfer::Recv {
                        peer: rank_of(peer),
                        buf,
                        range: moved(range),
                        action,
                    },
                    Transfer::LocalCopy { src, dst } => Transfer::LocalCopy {
                        src: moved(src),
                        dst: moved(dst),
                    },
                })
                .collect();
            self.steps.push(Step { transfers });
        }
    }

    fn finish(self) -> Schedule {
        Schedule { steps: self.steps }
    }
}

/// In-place all-reduce of `count` elements of `elem_bytes` bytes in
/// `Dst`, in two levels (see the module table): by leaders when the
/// message is small or the hosts differ in size, along rails otherwise.
/// Every rank ends with bitwise the same values. An empty schedule for a
/// `rank` outside the topology ([SC-7]).
///
/// [SC-7]: super::schedule#invariants
pub fn all_reduce(rank: usize, topo: &Topology, count: usize, elem_bytes: usize) -> Schedule {
    if rank >= topo.size() {
        return Schedule::default();
    }
    let (h, li) = (topo.host_of[rank], topo.local[rank]);
    let host = &topo.members[h];
    let l = host.len();
    let on_host = |i: usize| host[i];
    let mut c = Composer::new();
    if count.saturating_mul(elem_bytes) <= SMALL_ALL_REDUCE_BYTES || !topo.uniform() {
        c.embed(reduce_auto(li, l, count, 0, elem_bytes), on_host, 0);
        if li == 0 {
            let leader = |x: usize| topo.members[x][0];
            c.embed(
                all_reduce_auto(h, topo.hosts(), count, elem_bytes),
                leader,
                0,
            );
        }
        c.embed(flat_broadcast(li, l, count, 0), on_host, 0);
    } else {
        let counts = even_counts(count, l);
        let offs = offsets(&counts);
        let mine = offs[li]..offs[li + 1];
        c.embed(flat_reduce_scatter(li, l, &counts), on_host, 0);
        let rail = |x: usize| topo.members[x][li];
        c.embed(
            all_reduce_auto(h, topo.hosts(), mine.len(), elem_bytes),
            rail,
            mine.start,
        );
        c.embed(all_gather_in_place(li, l, &counts), on_host, 0);
    }
    c.finish()
}

/// Broadcast `count` elements of `Dst` from `root`: a binomial tree among
/// the hosts' representatives (the root on its host, the leader
/// elsewhere), then one within each host from its representative. Exactly
/// `H - 1` messages cross hosts.
pub fn broadcast(rank: usize, topo: &Topology, count: usize, root: usize) -> Schedule {
    let Some((h, host, rep)) = topo.rooted(rank, root) else {
        return Schedule::default();
    };
    let mut c = Composer::new();
    if rank == rep {
        c.embed(
            flat_broadcast(h, topo.hosts(), count, topo.host_of[root]),
            |x| topo.rep(x, root),
            0,
        );
    }
    c.embed(
        flat_broadcast(topo.local[rank], host.len(), count, topo.local[rep]),
        |i| host[i],
        0,
    );
    c.finish()
}

/// Reduce `count` elements of `Dst` into `Dst` on `root` (other ranks'
/// `Dst` is scratch): [`reduce_auto`] within each host to its
/// representative, then among the representatives to the root.
pub fn reduce(
    rank: usize,
    topo: &Topology,
    count: usize,
    root: usize,
    elem_bytes: usize,
) -> Schedule {
    let Some((h, host, rep)) = topo.rooted(rank, root) else {
        return Schedule::default();
    };
    let mut c = Composer::new();
    c.embed(
        reduce_auto(
            topo.local[rank],
            host.len(),
            count,
            topo.local[rep],
            elem_bytes,
        ),
        |i| host[i],
        0,
    );
    if rank == rep {
        c.embed(
            reduce_auto(h, topo.hosts(), count, topo.host_of[root], elem_bytes),
            |x| topo.rep(x, root),
            0,
        );
    }
    c.finish()
}

/// All-gather of `counts[r]` elements from every rank `r` (`elem_bytes`
/// each), buffers as the flat [`all_gather`](super::schedule::all_gather)
/// (or, with `in_place`, as
/// [`all_gather_in_place`]), in two
/// levels when every host's ranks are consecutive ([`Topology::contiguous`]):
/// each rank's block goes to its host's leader, the leaders all-gather
/// their hosts' spans of the output, and each leader broadcasts the whole
/// output on its host. Otherwise the flat all-gather of the tuning table.
/// An empty schedule for a `rank` outside the topology or `counts` of the
/// wrong length ([SC-7]).
///
/// [SC-7]: super::schedule#invariants
pub fn all_gather(
    rank: usize,
    topo: &Topology,
    counts: &[usize],
    in_place: bool,
    elem_bytes: usize,
) -> Schedule {
    let n = topo.size();
    if rank >= n || counts.len() != n {
        return Schedule::default();
    }
    if !topo.contiguous() {
        return flat_all_gather(rank, n, counts, in_place, elem_bytes);
    }
    let offs = offsets(counts);
    let total = offs[n];
    let (h, li) = (topo.host_of[rank], topo.local[rank]);
    let host = &topo.members[h];
    let mut c = Composer::new();
    // The host's blocks to its leader (one step; zero-length blocks skipped).
    let mut gather = Step::default();
    let mine = offs[rank]..offs[rank + 1];
    if li == 0 {
        for &r in &host[1..] {
            if counts[r] > 0 {
                gather.transfers.push(Transfer::Recv {
                    peer: r,
                    buf: BufId::Dst,
                    range: offs[r]..offs[r + 1],
                    action: super::schedule::RecvAction::Copy,
                });
            }
        }
        if !in_place && !mine.is_empty() {
            gather.transfers.push(Transfer::LocalCopy {
                src: 0..mine.len(),
                dst: mine,
            });
        }
    } else if !mine.is_empty() {
        gather.transfers.push(if in_place {
            Transfer::Send {
                peer: host[0],
                buf: BufId::Dst,
                range: mine,
            }
        } else {
            Transfer::Send {
                peer: host[0],
                buf: BufId::Src,
                range: 0..mine.len(),
            }
        });
    }
    if !gather.transfers.is_empty() {
        c.steps.push(gather);
    }
    if li == 0 {
        // The hosts' spans, consecutive in the output.
        let spans: Vec<usize> = topo
            .members
            .iter()
            .map(|m| offs[m[m.len() - 1] + 1] - offs[m[0]])
            .collect();
        let leader = |x: usize| topo.members[x][0];
        c.embed(
            flat_all_gather(h, topo.hosts(), &spans, true, elem_bytes),
            leader,
            0,
        );
    }
    c.embed(flat_broadcast(li, host.len(), total, 0), |i| host[i], 0);
    c.finish()
}

/// Reduce-scatter in place on `Dst`, the concatenation of one block per
/// rank (`counts[r]` elements for rank `r`), as the flat
/// [`reduce_scatter`](super::schedule::reduce_scatter): afterwards block
/// `rank` holds the fully reduced block `rank`. In two levels when every
/// host's ranks are consecutive and every host has `L` of them
/// ([`Topology::contiguous`], [`Topology::uniform`]):
///
/// 1. On the host, a ring reduce-scatter over each host's span at once
///    ([`reduce_scatter_sets`]: `L - 1` steps, one message per host's span
///    to the next rank on the host in each): the rank of local index `i` ends with its host's sum
///    of block `i` of every host's span, the blocks of its rail.
/// 2. Along the rail (the `H` ranks of local index `i`), a reduce-scatter
///    of those `H` blocks ([`reduce_scatter_blocks`]: `log2 H` steps on a
///    power-of-two `H`, else `H - 1`): each rank ends with the sum over all
///    hosts of its own block.
///
/// So `L - 1 + log2 H` steps instead of the flat ring's `N - 1`, and only
/// messages along rails cross hosts, each rank sending its rail's `H - 1`
/// blocks (the same bytes across hosts per host as the flat ring, spread
/// over `L` ranks). Otherwise the flat ring. An empty schedule for a
/// `rank` outside the topology or `counts` of the wrong length ([SC-7]).
///
/// [SC-7]: super::schedule#invariants
pub fn reduce_scatter(rank: usize, topo: &Topology, counts: &[usize]) -> Schedule {
    let n = topo.size();
    if rank >= n || counts.len() != n {
        return Schedule::default();
    }
    if !(topo.contiguous() && topo.uniform()) {
        return flat_reduce_scatter(rank, n, counts);
    }
    let offs = offsets(counts);
    let block = |r: usize| offs[r]..offs[r + 1];
    let (h, li) = (topo.host_of[rank], topo.local[rank]);
    let host = &topo.members[h];
    let mut c = Composer::new();
    // On the host: local rank `i`'s block is its block of every host's
    // span, one message per host, in host order.
    c.embed(
        reduce_scatter_sets(li, host.len(), |i| {
            topo.members.iter().map(move |m| block(m[i]))
        }),
        |i| host[i],
        0,
    );
    // Along the rail: block `x` of the rail is the block of its rank on host `x`.
    let rail = |x: usize| topo.members[x][li];
    c.embed(
        reduce_scatter_blocks(h, topo.hosts(), |x| block(rail(x))),
        rail,
        0,
    );
    c.finish()
}

/// Gather `count` elements of every rank's `Src` into block `r` of `Dst` on
/// `root`, with the elements of scratch `Dst` this rank needs (0 for
/// none), as [`gather_auto`] returns them.
/// In two levels where the flat gather would not run its tree (blocks
/// above its size limit) and every host's ranks are consecutive: each
/// host's blocks go to its representative (the root on its host, the
/// leader elsewhere), which holds them as one span in the order of the
/// output; each other representative then sends its span to the root, so
/// exactly `H - 1` messages cross hosts and the root receives `L - 1 + H -
/// 1` instead of `N - 1`. A leader's scratch is its host's span (`L *
/// count`). Otherwise the flat gather.
pub fn gather(
    rank: usize,
    topo: &Topology,
    count: usize,
    root: usize,
    elem_bytes: usize,
) -> (Schedule, usize) {
    let n = topo.size();
    if !two_level_rooted(topo, count, elem_bytes) {
        return gather_auto(rank, n, count, root, elem_bytes);
    }
    let Some((h, host, rep)) = topo.rooted(rank, root) else {
        return (Schedule::default(), 0);
    };
    let block = |r: usize| r * count..(r + 1) * count;
    let mut c = Composer::new();
    if rank == root {
        let mut all = Step::default();
        all.transfers.push(Transfer::LocalCopy {
            src: 0..count,
            dst: block(root),
        });
        for &r in host.iter().filter(|&&r| r != root) {
            all.transfers.push(recv_copy(r, block(r)));
        }
        for x in (0..topo.hosts()).filter(|&x| x != h) {
            all.transfers
                .push(recv_copy(topo.rep(x, root), topo.span(x, count)));
        }
        c.steps.push(all);
        return (c.finish(), 0);
    }
    if rank != rep {
        c.steps.push(Step {
            transfers: vec![Transfer::Send {
                peer: rep,
                buf: BufId::Src,
                range: 0..count,
            }],
        });
        return (c.finish(), 0);
    }
    // A leader (lowest rank, local index 0) of a host without the root:
    // its host's span, in scratch `Dst`, then to the root.
    let mut collect = Step::default();
    collect.transfers.push(Transfer::LocalCopy {
        src: 0..count,
        dst: 0..count,
    });
    for (i, &r) in host.iter().enumerate().skip(1) {
        collect.transfers.push(recv_copy(r, block(i)));
    }
    c.steps.push(collect);
    c.steps.push(Step {
        transfers: vec![Transfer::Send {
            peer: root,
            buf: BufId::Dst,
            range: 0..host.len() * count,
        }],
    });
    (c.finish(), host.len() * count)
}

/// Scatter block `r` of `Src` on `root` (`count` elements each) into every
/// rank `r`'s `Dst`, with the elements of scratch `Src` this rank needs (0
/// for none), as [`scatter_auto`] returns
/// them. Where [`gather`] runs in two levels, scatter is that schedule run
/// backwards: the root sends each other host's span to its leader in one
/// message (`H - 1` cross hosts) and the blocks of its own host directly;
/// a leader receives its span into scratch `Src` (`L * count`) and sends
/// each member its block. Otherwise the flat scatter.
pub fn scatter(
    rank: usize,
    topo: &Topology,
    count: usize,
    root: usize,
    elem_bytes: usize,
) -> (Schedule, usize) {
    if !two_level_rooted(topo, count, elem_bytes) {
        return scatter_auto(rank, topo.size(), count, root, elem_bytes);
    }
    // The same messages and ranges, the other way: the two-level gather
    // run backwards, whose scratch (`Dst` there) becomes `Src` here.
    let (gather, scratch) = gather(rank, topo, count, root, elem_bytes);
    (backwards(gather), scratch)
}

/// `s` run backwards, for a schedule that only copies: steps in reverse
/// order, each send a receive (a copy) of the same range from the same
/// peer, each receive a send, each local copy the other way, with `Src`
/// and `Dst` swapped throughout. What `s` gathers, the result scatters.
fn backwards(s: Schedule) -> Schedule {
    let other = |b: BufId| match b {
        BufId::Src => BufId::Dst,
        BufId::Dst => BufId::Src,
    };
    let steps = s
        .steps
        .into_iter()
        .rev()
        .map(|step| Step {
            transfers: step
                .transfers
                .into_iter()
                .map(|t| match t {
                    Transfer::Send { peer, buf, range } => Transfer::Recv {
                        peer,
                        buf: other(buf),
                        range,
                        action: RecvAction::Copy,
                    },
                    Transfer::Recv {
                        peer, buf, range, ..
                    } => Transfer::Send {
                        peer,
                        buf: other(buf),
                        range,
                    },
                    Transfer::LocalCopy { src, dst } => Transfer::LocalCopy { src: dst, dst: src },
                })
                .collect(),
        })
        .collect();
    Schedule { steps }
}

/// Whether a gather or scatter of `count` elements per rank runs in two
/// levels on `topo`: blocks the flat binomial tree does not take, and
/// hosts of consecutive ranks (each host's blocks one span of the root's
/// buffer).
fn two_level_rooted(topo: &Topology, count: usize, elem_bytes: usize) -> bool {
    count > 0
        && topo.contiguous()
        && !rooted_tree(
            Rooted::GatherOrScatter,
            count.saturating_mul(elem_bytes),
            topo.size(),
        )
}

/// A receive of `range` of `Dst` from `peer`, copied in.
fn recv_copy(peer: usize, range: std::ops::Range<usize>) -> Transfer {
    Transfer::Recv {
        peer,
        buf: BufId::Dst,
        range,
        action: RecvAction::Copy,
    }
}

/// The rounds of a two-level barrier for `rank`, as `(send to, receive
/// from)` pairs of empty messages, either side possibly absent: a binomial
/// fan-in to the host's leader, the dissemination rounds of
/// [`barrier_rounds`](super::schedule::barrier_rounds) among the `H`
/// leaders, and a binomial fan-out from the leader. A rank leaves its last
/// round only after every rank entered the barrier: its leader's fan-out
/// starts after the leaders' dissemination, which ends after every
/// leader's fan-in. At most `2 ceil(log2 L) + ceil(log2 H)` rounds;
/// messages between hosts only among leaders. Empty for a `rank` outside
/// the topology.
pub fn barrier_rounds(rank: usize, topo: &Topology) -> Vec<(Option<usize>, Option<usize>)> {
    if rank >= topo.size() {
        return Vec::new();
    }
    let (h, v) = (topo.host_of[rank], topo.local[rank]);
    let host = &topo.members[h];
    let l = host.len();
    let on_host = |i: usize| host[i];
    // Fan-in: the messages of a one-element `reduce_tree` to local index 0.
    let mut rounds = as_rounds(reduce_tree(v, l, 1, 0), on_host);
    if v == 0 {
        let leader = |x: usize| topo.members[x][0];
        rounds.extend(
            super::schedule::barrier_rounds(h, topo.hosts())
                .into_iter()
                .map(|(to, from)| (Some(leader(to)), Some(leader(from)))),
        );
    }
    // Fan-out: those of a one-element binomial broadcast from local index 0.
    rounds.extend(as_rounds(flat_broadcast(v, l, 1, 0), on_host));
    rounds
}

/// The steps of a schedule whose steps each hold at most one send and one
/// receive (a binomial tree's), as barrier rounds: the rank each step
/// sends to and receives from, through `rank_of`.
fn as_rounds(s: Schedule, rank_of: impl Fn(usize) -> usize) -> Vec<(Option<usize>, Option<usize>)> {
    s.steps
        .iter()
        .map(|step| {
            let peer = |send: bool| {
                step.transfers
                    .iter()
                    .find(|t| matches!(t, Transfer::Send { .. }) == send)
                    .and_then(Transfer::peer)
                    .map(&rank_of)
            };
            (peer(true), peer(false))
        })
        .collect()
}

#[cfg(test)]
#[path = "hier_tests.rs"]
mod tests;
