//! Collective algorithms as sans-IO schedules.
//!
//! A [`Schedule`] is pure data: for one rank, an ordered list of [`Step`]s,
//! each a set of [`Transfer`]s (sends and receives with peers, on element
//! ranges of the op's buffers) that may run concurrently. Schedules are built
//! by pure functions of `(rank, size, counts, root)`; they contain no sockets,
//! no timers and no dtype. The cpu backend executes them over its links; the
//! in-memory harness in the tests executes N ranks at once and checks results.
//!
//! Execution semantics (shared by the backend and the harness):
//! - SC-1: steps run in order; a step completes when all its transfers have.
//! - SC-2: within a step, every `Send` reads its range as it was *before* the
//!   step; every `Recv` is applied (copy or reduce) after all of the step's
//!   transfers completed.
//! - SC-3: sends and receives between one ordered pair of ranks are matched in
//!   order, and a matched pair has the same length.
//! - SC-4: every schedule is deadlock-free even if a send completes only when
//!   the matching receive is posted (rendezvous semantics).
//!
//! Properties of every schedule built here (checked by [`Schedule::validate`]
//! and by the in-memory harness in the tests):
//! - SC-5: no transfer has length zero; a transfer of zero elements is skipped
//!   on both ends. The decision depends only on the counts, which every rank
//!   computes identically, so both ends always agree.
//! - SC-6: within a step, the ranges written (receives, local-copy
//!   destinations) are pairwise disjoint and disjoint from the ranges read
//!   (sends, local-copy sources) in the same buffer. So the order in which
//!   receives are applied does not matter, and an executor may write received
//!   data in place as it arrives: [SC-2] then holds with no staging copy.
//! - SC-7: a single rank (`size == 1`) gets an empty or local-only schedule,
//!   and invalid arguments (`rank >= size`, `root >= size`, per-rank counts of
//!   the wrong length) get an empty schedule — never a panic. Arguments are
//!   validated above the Backend trait; this is only a safety net.
//!
//! All ranges are in elements. The algorithms:
//!
//! | builder | algorithm | steps (`p` ranks) |
//! |---------|-----------|-------------------|
//! | [`all_reduce`] | ring reduce-scatter, then ring all-gather, in place on `Dst` | `2(p-1)` |
//! | [`all_reduce_small`] | recursive doubling, non-powers of two folded onto the largest power of two (breaks [SC-6] on purpose, staged by the executor) | `floor(log2 p)`, +2 if `p` is not a power of two |
//! | [`all_reduce_halving`] | Rabenseifner: recursive-halving reduce-scatter, recursive-doubling all-gather, non-powers of two folded | `2 log2 q`, +2 if `p` is not a power of two |
//! | [`reduce`] | ring reduce-scatter, then every rank sends its block to root | `p` |
//! | [`reduce_tree`] | binomial tree towards `root` | `ceil(log2 p)` |
//! | [`reduce_scatter`] | ring reduce-scatter; rank `r` ends with block `r` | `p-1` |
//! | [`reduce_scatter_blocks`] | the same on blocks anywhere in `Dst`: recursive halving on a power-of-two `p`, else the ring | `log2 p`, else `p-1` |
//! | [`reduce_scatter_sets`] | the ring on blocks that are lists of ranges of `Dst`, a message per range | `p-1` |
//! | [`all_gather`] | local copy, then ring all-gather | `p-1` (1 if `p == 1`) |
//! | [`all_gather_doubling`] | recursive doubling (power-of-two `p`, else the ring) | `log2 p` |
//! | [`broadcast`] | binomial tree rooted at `root` | `ceil(log2 p)` |
//! | [`scatter`], [`gather`] | root exchanges with every rank in one step | 1 |
//! | [`scatter_tree`], [`gather_tree`] | binomial tree; inner ranks forward their subtree's blocks through a scratch buffer ([`tree_scratch`]) | `ceil(log2 p)` |
//! | [`all_to_all`] | pairwise exchange: step `s` sends to `r+s`, receives from `r-s` | `p-1` (1 if `p == 1`) |
//! | [`barrier_rounds`] | dissemination: round `k` sends to `r+2^k`, receives from `r-2^k` (empty messages) | `ceil(log2 p)` |
//!
//! The tuning table, which the cpu backend follows (every choice is a pure
//! function of arguments all ranks agree on, so all ranks choose alike):
//!
//! | op | latency-minded, when | otherwise |
//! |----|----------------------|-----------|
//! | all_reduce | [`all_reduce_small`] up to [`SMALL_ALL_REDUCE_BYTES`], then [`all_reduce_halving`] on more than 2 ranks while the ring's blocks are below [`RING_MIN_BLOCK_BYTES`] ([`all_reduce_auto`]) | [`all_reduce`] |
//! | all_gather | [`all_gather_doubling`] up to [`SMALL_ALL_GATHER_BYTES`] of output on a power-of-two `p` ([`all_gather_auto`]) | [`all_gather`] |
//! | reduce, gather, scatter | the trees up to [`TREE_MAX_BYTES`] of buffer (reduce, more than 2 ranks) or block (gather, scatter, from [`GATHER_TREE_MIN_RANKS`]) ([`rooted_tree`]; [`reduce_auto`], [`gather_auto`], [`scatter_auto`]) | [`reduce`], [`gather`], [`scatter`] |
//! | broadcast, barrier | always [`broadcast`], [`barrier_rounds`] | |
//!
//! Step counts are upper bounds: steps left empty by zero-length blocks are
//! dropped. The buffers map onto [`OpData`](crate::backends::OpData) as
//! follows (`Src`/`Dst`):
//!
//! | op | `Src` | `Dst` | after the schedule |
//! |----|-------|-------|--------------------|
//! | `AllReduce`, `Reduce`, `Broadcast` | — | `buf` | |
//! | `ReduceScatter` | — | `input` | copy block `rank` of `input` to `output` |
//! | `AllGather`, `Scatter`, `Gather`, `AllToAll` | `input` | `output` | |
//!
//! ```
//! use chorus::backends::cpu::schedule::{all_reduce, even_counts};
//! // 3 ranks, 10 elements: blocks of 4, 3, 3; 2 reduce-scatter + 2 all-gather steps.
//! assert_eq!(even_counts(10, 3), vec![4, 3, 3]);
//! let s = all_reduce(0, 3, 10);
//! assert_eq!(s.steps.len(), 4);
//! assert!(all_reduce(0, 1, 10).is_empty());
//! ```
//!
//! [SC-2]: self#invariants
//! [SC-6]: self#invariants

use std::ops::Range;

use crate::error::{Error, Result};

/// Which buffer of the op a transfer reads or writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BufId {
    /// The op's source buffer (e.g. the concatenated inputs of scatter/all_to_all).
    Src,
    /// The op's destination / working buffer (in-place ops use only this one).
    Dst,
}

/// What to do with received data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RecvAction {
    /// Overwrite the range.
    Copy,
    /// Combine into the range with the op's reduce operator.
    Reduce,
}

/// One transfer, in elements.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Transfer {
    /// Send `buf[range]` to `peer`.
    Send {
        /// Destination rank.
        peer: usize,
        /// Buffer to read.
        buf: BufId,
        /// Element range.
        range: Range<usize>,
    },
    /// Receive `range.len()` elements from `peer` into `buf[range]`.
    Recv {
        /// Source rank.
        peer: usize,
        /// Buffer to write.
        buf: BufId,
        /// Element range.
        range: Range<usize>,
        /// Copy or reduce.
        action: RecvAction,
    },
    /// Copy `Src[src]` into `Dst[dst]` locally (same length).
    LocalCopy {
        /// Source range in `Src`.
        src: Range<usize>,
        /// Destination range in `Dst`.
        dst: Range<usize>,
    },
}

/// A set of transfers that may proceed concurrently.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Step {
    /// The transfers.
    pub transfers: Vec<Transfer>,
}

/// The steps one rank runs for one op.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Schedule {
    /// Steps in order.
    pub steps: Vec<Step>,
}

impl Transfer {
    /// Number of elements moved (for a `LocalCopy`, the destination length).
    pub fn len(&self) -> usize {
        match self {
            Transfer::Send { range, .. } | Transfer::Recv { range, .. } => range.len(),
            Transfer::LocalCopy { dst, .. } => dst.len(),
        }
    }

    /// Whether the transfer moves no element.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The peer of a `Send` or `Recv`; `None` for a `LocalCopy`.
    pub fn peer(&self) -> Option<usize> {
        match self {
            Transfer::Send { peer, .. } | Transfer::Recv { peer, .. } => Some(*peer),
            Transfer::LocalCopy { .. } => None,
        }
    }
}

impl Schedule {
    /// Whether the schedule has no step (nothing to do).
    pub fn is_empty(&self) -> bool {
        self.steps.is_empty()
    }

    /// Every transfer, in execution order.
    pub fn transfers(&self) -> impl Iterator<Item = &Transfer> {
        self.steps.iter().flat_map(|s| s.transfers.iter())
    }

    /// Total elements this rank sends.
    pub fn elements_sent(&self) -> usize {
        self.transfers()
            .filter(|t| matches!(t, Transfer::Send { .. }))
            .map(Transfer::len)
            .sum()
    }

    /// Check that the schedule of `rank` (of `size`) fits buffers of
    /// `src_len` and `dst_len` elements: peers in range and not `rank`,
    /// ranges in bounds and non-empty ([SC-5]), local copies of equal length,
    /// and, within each step, writes disjoint from each other and from reads
    /// ([SC-6]).
    ///
    /// Cheap (linear in the transfers, plus a sort per step); an executor may
    /// call it before running a schedule.
    ///
    /// # Errors
    /// [`Error::Internal`] describing the first violation.
    ///
    /// [SC-5]: self#invariants
    /// [SC-6]: self#invariants
    pub fn validate(&self, rank: usize, size: usize, src_len: usize, dst_len: usize) -> Result<()> {
        let fail = |step: usize, what: String| {
            Err(Error::Internal(format!(
                "invalid schedule for rank {rank} of {size}, step {step}: {what}"
            )))
        };
        let bound = |buf: BufId| match buf {
            BufId::Src => src_len,
            BufId::Dst => dst_len,
        };
        for (i, step) in self.steps.iter().enumerate() {
            // Per buffer (index 0: Src, 1: Dst).
            let mut writes: [Vec<Range<usize>>; 2] = [Vec::new(), Vec::new()];
            let mut reads: [Vec<Range<usize>>; 2] = [Vec::new(), Vec::new()];
            let slot = |buf: BufId| usize::from(buf == BufId::Dst);
            for t in &step.transfers {
                if t.is_empty() {
                    return fail(i, format!("zero-length transfer {t:?}"));
                }
                if let Some(peer) = t.peer() {
                    if peer >= size || peer == rank {
                        return fail(i, format!("bad peer in {t:?}"));
                    }
                }
                let (read, written) = match t {
                    Transfer::Send { buf, range, .. } => (Some((*buf, range)), None),
                    Transfer::Recv { buf, range, .. } => (None, Some((*buf, range))),
                    Transfer::LocalCopy { src, dst } => {
                        if src.len() != dst.len() {
                            return fail(i, format!("local copy of unequal lengths {t:?}"));
                        }
                        (Some((BufId::Src, src)), Some((BufId::Dst, dst)))
                    }
                };
                for (buf, range) in read.into_iter().chain(written) {
                    if range.start > range.end || range.end > bound(buf) {
                        return fail(
                            i,
                            format!("{t:?} is outside {buf:?} of {} elements", bound(buf)),
                        );
                    }
                }
                if let Some((buf, range)) = read {
                    reads[slot(buf)].push(range.clone());
                }
                if let Some((buf, range)) = written {
                    writes[slot(buf)].push(range.clone());
                }
            }
            for (b, buf) in [BufId::Src, BufId::Dst].into_iter().enumerate() {
                let w = &mut writes[b];
                w.sort_by_key(|r| r.start);
                if let Some(p) = w.windows(2).find(|p| p[1].start < p[0].end) {
                    let (a, c) = (&p[0], &p[1]);
                    return fail(i, format!("overlapping writes {a:?} and {c:?} in {buf:?}"));
                }
                // Disjoint and sorted by start, so also sorted by end: the only
                // candidate for overlapping a read is the first write ending
                // after the read starts.
                for r in &reads[b] {
                    let k = w.partition_point(|x| x.end <= r.start);
                    if let Some(x) = w.get(k).filter(|x| x.start < r.end) {
                        return fail(i, format!("write {x:?} overlaps read {r:?} in {buf:?}"));
                    }
                }
            }
        }
        Ok(())
    }
}

/// Near-equal partition of `count` elements into `size` blocks: the first
/// `count % size` blocks get one element more. Empty if `size == 0`.
///
/// ```
/// use chorus::backends::cpu::schedule::even_counts;
/// assert_eq!(even_counts(7, 3), vec![3, 2, 2]);
/// assert_eq!(even_counts(2, 4), vec![1, 1, 0, 0]);
/// ```
pub fn even_counts(count: usize, size: usize) -> Vec<usize> {
    if size == 0 {
        return Vec::new();
    }
    let (q, r) = (count / size, count % size);
    (0..size).map(|i| q + usize::from(i < r)).collect()
}

/// Exclusive prefix sums of `counts`, plus the total: block `i` is
/// `offsets[i]..offsets[i + 1]`; the result has `counts.len() + 1` entries.
/// Saturates instead of overflowing.
///
/// ```
/// use chorus::backends::cpu::schedule::offsets;
/// assert_eq!(offsets(&[3, 0, 2]), vec![0, 3, 3, 5]);
/// ```
pub fn offsets(counts: &[usize]) -> Vec<usize> {
    let mut out = Vec::with_capacity(counts.len() + 1);
    let mut acc = 0usize;
    out.push(acc);
    for &c in counts {
        acc = acc.saturating_add(c);
        out.push(acc);
    }
    out
}

/// In-place all-reduce of `count` elements in `Dst`.
///
/// Ring reduce-scatter (rank `r` ends with the fully reduced block `r` of
/// [`even_counts`]), then ring all-gather. Each rank sends `2(p-1)/p` of the
/// data: bandwidth-optimal, with `2(p-1)` latency steps.
pub fn all_reduce(rank: usize, size: usize, count: usize) -> Schedule {
    if rank >= size {
        return Schedule::default();
    }
    let offs = offsets(&even_counts(count, size));
    let mut b = Builder::new(rank, size);
    b.ring_reduce_scatter(&offs);
    b.ring_all_gather(&offs, false);
    b.finish()
}

/// All-reduce messages up to this many bytes use [`all_reduce_small`]
/// (the tuning table: latency-optimal below, bandwidth-optimal ring above).
pub const SMALL_ALL_REDUCE_BYTES: usize = 16 << 10;

/// The ring all-reduce takes over from [`all_reduce_halving`] once each of
/// its `2(p-1)` steps moves at least this many bytes (`bytes / p`): below
/// it, the ring's step count, not its bandwidth, sets its time.
pub const RING_MIN_BLOCK_BYTES: usize = 1 << 20;

/// The all-reduce schedule for `count` elements of `elem_bytes` bytes:
/// [`all_reduce_small`] for small messages, [`all_reduce_halving`] for
/// medium ones, the ring ([`all_reduce`]) once its blocks reach
/// [`RING_MIN_BLOCK_BYTES`].
pub fn all_reduce_auto(rank: usize, size: usize, count: usize, elem_bytes: usize) -> Schedule {
    let bytes = count.saturating_mul(elem_bytes);
    if size <= 1 {
        all_reduce(rank, size, count)
    } else if bytes <= SMALL_ALL_REDUCE_BYTES {
        all_reduce_small(rank, size, count)
    } else if size > 2 && bytes / size < RING_MIN_BLOCK_BYTES {
        all_reduce_halving(rank, size, count)
    } else {
        all_reduce(rank, size, count)
    }
}

/// Rabenseifner's all-reduce: a reduce-scatter by recursive halving, then
/// an all-gather by recursive doubling, in place on `Dst`. With `q` the
/// largest power of two not above `p`, the buffer is cut into `q` blocks
/// ([`even_counts`]); at each halving step a rank swaps half of the blocks
/// it still reduces with partner `rank ^ 2^k` and reduces the half it
/// keeps, so after `log2 q` steps it holds one fully reduced block; the
/// doubling steps then gather the blocks back. When `p` is not a power of
/// two the first `2(p - q)` ranks fold in pairs first, as in
/// [`all_reduce_small`]. `2 log2 q` steps (+2 when folding), each rank
/// sending `2(q-1)/q` of the buffer: bandwidth-optimal like the ring, with
/// logarithmically many steps.
pub fn all_reduce_halving(rank: usize, size: usize, count: usize) -> Schedule {
    folded_all_reduce(rank, size, count, |b, i, q, outer| {
        let offs = offsets(&even_counts(count, q));
        let blocks = |r: Range<usize>| offs[r.start]..offs[r.end];
        // Reduce-scatter by recursive halving: the blocks `lo..lo + 2m`
        // this rank still reduces are split, it keeps the half holding
        // block `i`.
        let mut lo = 0;
        let mut m = q / 2;
        while m > 0 {
            b.step();
            let partner = outer(i ^ m);
            let (keep, give) = if i & m == 0 {
                (lo..lo + m, lo + m..lo + 2 * m)
            } else {
                (lo + m..lo + 2 * m, lo..lo + m)
            };
            b.send(partner, BufId::Dst, blocks(give));
            b.recv(
                partner,
                BufId::Dst,
                blocks(keep.clone()),
                RecvAction::Reduce,
            );
            lo = keep.start;
            m /= 2;
        }
        // All-gather by recursive doubling: this rank holds blocks
        // `lo..lo + m` and swaps them for its partner's.
        let mut m = 1;
        while m < q {
            b.step();
            let partner = outer(i ^ m);
            let theirs = lo ^ m;
            b.send(partner, BufId::Dst, blocks(lo..lo + m));
            b.recv(
                partner,
                BufId::Dst,
                blocks(theirs..theirs + m),
                RecvAction::Copy,
            );
            lo = lo.min(theirs);
            m *= 2;
        }
    })
}

/// Latency-optimal in-place all-reduce: recursive doubling, `log2 q` steps
/// of a whole-buffer exchange with partner `rank ^ 2^k`, where `q` is the
/// largest power of two not above `p`. When `p` is not a power of two the
/// first `2(p - q)` ranks pair up first (MPICH's fold): each even one sends
/// its buffer to the odd one after it, which reduces it in and takes part
/// in the doubling, and hands the result back in a last step. So
/// `floor(log2 p)` steps, plus 2 when `p` is not a power of two; O(p log p)
/// messages in all.
///
/// Both partners of a doubling step combine the same two partial results,
/// so every rank ends with bitwise the same values. This schedule
/// deliberately breaks [SC-6] (each step's receive overlaps its send): the
/// executor then stages the receive and applies it after the step
/// ([CPU-1]), which for the small messages it is meant for costs one copy
/// of at most [`SMALL_ALL_REDUCE_BYTES`].
///
/// [CPU-1]: crate::backends::cpu#invariants
/// [SC-6]: self#invariants
pub fn all_reduce_small(rank: usize, size: usize, count: usize) -> Schedule {
    folded_all_reduce(rank, size, count, |b, i, q, outer| {
        let mut mask = 1usize;
        while mask < q {
            b.step();
            let partner = outer(i ^ mask);
            b.send(partner, BufId::Dst, 0..count);
            b.recv(partner, BufId::Dst, 0..count, RecvAction::Reduce);
            mask *= 2;
        }
    })
}

/// The power-of-two fold shared by [`all_reduce_small`] and
/// [`all_reduce_halving`] (MPICH's): with `q` the largest power of two not
/// above `size` and `rem = size - q`, the first `2 rem` ranks pair up, each
/// even one sending its buffer to the odd one after it, which reduces it in;
/// `core(builder, i, q, outer)` then adds the power-of-two algorithm of
/// group rank `i` (`outer` maps a group rank back to its rank), and the odd
/// ranks hand the result back to their even partners in a last step.
fn folded_all_reduce(
    rank: usize,
    size: usize,
    count: usize,
    core: impl FnOnce(&mut Builder, usize, usize, &dyn Fn(usize) -> usize),
) -> Schedule {
    if rank >= size {
        return Schedule::default();
    }
    let q = if size.is_power_of_two() {
        size
    } else {
        size.next_power_of_two() / 2
    };
    let rem = size - q;
    let folded = rank < 2 * rem;
    let mut b = Builder::new(rank, size);
    if count == 0 {
        return b.finish();
    }
    if folded {
        b.step();
        if rank % 2 == 0 {
            b.send(rank + 1, BufId::Dst, 0..count);
        } else {
            b.recv(rank - 1, BufId::Dst, 0..count, RecvAction::Reduce);
        }
    }
    // Rank in the power-of-two group (even folded ranks sit out), and back.
    let inner = if folded {
        (rank % 2 == 1).then_some(rank / 2)
    } else {
        Some(rank - rem)
    };
    let outer = |i: usize| if i < rem { 2 * i + 1 } else { i + rem };
    if let Some(i) = inner {
        core(&mut b, i, q, &outer);
    }
    if folded {
        b.step();
        if rank % 2 == 1 {
            b.send(rank - 1, BufId::Dst, 0..count);
        } else {
            b.recv(rank + 1, BufId::Dst, 0..count, RecvAction::Copy);
        }
    }
    b.finish()
}

/// Reduce `count` elements of `Dst` into `Dst` on `root` (other ranks' `Dst`
/// is scratch).
///
/// Ring reduce-scatter on [`even_counts`] blocks, then one step in which each
/// rank sends its reduced block to `root`, which receives them with
/// [`RecvAction::Copy`].
pub fn reduce(rank: usize, size: usize, count: usize, root: usize) -> Schedule {
    if rank >= size || root >= size {
        return Schedule::default();
    }
    let offs = offsets(&even_counts(count, size));
    let mut b = Builder::new(rank, size);
    b.ring_reduce_scatter(&offs);
    b.step();
    if rank == root {
        for q in (0..size).filter(|&q| q != root) {
            b.recv(q, BufId::Dst, block(&offs, q), RecvAction::Copy);
        }
    } else {
        b.send(root, BufId::Dst, block(&offs, rank));
    }
    b.finish()
}

/// Reduce-scatter in place on `Dst`, the concatenation of one block per rank
/// (`counts[r]` elements for rank `r`): afterwards block `rank` of `Dst` holds
/// the fully reduced block `rank` (other blocks are scratch).
///
/// Ring: at step `s`, rank `r` sends its partial block `r-s-1` to `r+1` and
/// reduces block `r-s-2` received from `r-1`.
pub fn reduce_scatter(rank: usize, size: usize, counts: &[usize]) -> Schedule {
    if rank >= size || counts.len() != size {
        return Schedule::default();
    }
    let offs = offsets(counts);
    let mut b = Builder::new(rank, size);
    b.ring_reduce_scatter(&offs);
    b.finish()
}

/// Reduce-scatter in place on `Dst` over blocks that need not follow one
/// another in the buffer: block `i` is `blocks(i)` (pairwise disjoint
/// ranges), and afterwards `blocks(rank)` holds the fully reduced block
/// `rank` (the rest is scratch). On a power-of-two `size`, recursive
/// halving: `log2 size` steps, in each of which a rank sends the blocks it
/// gives up to its partner, one message per non-empty block, in block
/// order (so `size - 1` messages in all, as many as the ring's). Otherwise
/// the ring of [`reduce_scatter`], `size - 1` steps. The two-level
/// reduce-scatter of [`hier`](super::hier) runs it along a rail, whose
/// blocks lie one host span apart.
pub fn reduce_scatter_blocks(
    rank: usize,
    size: usize,
    blocks: impl Fn(usize) -> Range<usize>,
) -> Schedule {
    if rank >= size {
        return Schedule::default();
    }
    let mut b = Builder::new(rank, size);
    if !size.is_power_of_two() {
        b.ring_reduce_scatter_by(|i| [blocks(i)]);
        return b.finish();
    }
    // The blocks `lo..lo + 2m` this rank still reduces are halved; it
    // keeps the half holding block `rank`.
    let mut lo = 0;
    let mut m = size / 2;
    while m > 0 {
        b.step();
        let partner = rank ^ m;
        let (keep, give) = if rank & m == 0 {
            (lo..lo + m, lo + m..lo + 2 * m)
        } else {
            (lo + m..lo + 2 * m, lo..lo + m)
        };
        for i in give {
            b.send(partner, BufId::Dst, blocks(i));
        }
        for i in keep.clone() {
            b.recv(partner, BufId::Dst, blocks(i), RecvAction::Reduce);
        }
        lo = keep.start;
        m /= 2;
    }
    b.finish()
}

/// The ring reduce-scatter of [`reduce_scatter`] where block `i` is a list
/// of ranges of `Dst`, `blocks(i)` (all pairwise disjoint), each sent as a
/// message of its own: afterwards the ranges of `blocks(rank)` hold their
/// full reduction. `size - 1` steps. The two-level reduce-scatter of
/// [`hier`](super::hier) runs it on a host, block `i` being local rank
/// `i`'s block of every host's span.
pub fn reduce_scatter_sets<I>(rank: usize, size: usize, blocks: impl Fn(usize) -> I) -> Schedule
where
    I: IntoIterator<Item = Range<usize>>,
{
    if rank >= size {
        return Schedule::default();
    }
    let mut b = Builder::new(rank, size);
    b.ring_reduce_scatter_by(blocks);
    b.finish()
}

/// All-gather: `Src` is this rank's block (`counts[rank]` elements), `Dst` the
/// concatenation of all blocks.
///
/// The first step copies `Src` into block `rank` of `Dst` and sends `Src` to
/// the next rank; then a ring forwards each block once around.
pub fn all_gather(rank: usize, size: usize, counts: &[usize]) -> Schedule {
    if rank >= size || counts.len() != size {
        return Schedule::default();
    }
    let offs = offsets(counts);
    let mut b = Builder::new(rank, size);
    b.step();
    b.copy(0..counts[rank], block(&offs, rank));
    b.ring_all_gather(&offs, true);
    b.finish()
}

/// All-gather in place: block `rank` of `Dst` (the concatenation of all
/// blocks) already holds this rank's data; there is no `Src` and no local
/// copy. The same ring as [`all_gather`] forwards each block once around.
pub fn all_gather_in_place(rank: usize, size: usize, counts: &[usize]) -> Schedule {
    if rank >= size || counts.len() != size {
        return Schedule::default();
    }
    let offs = offsets(counts);
    let mut b = Builder::new(rank, size);
    b.ring_all_gather(&offs, false);
    b.finish()
}

/// Broadcast `count` elements of `Dst` from `root`.
///
/// Binomial tree on ranks renumbered relative to `root` (`v = rank - root mod
/// p`): at step `k`, every `v < 2^k` that already holds the data sends it to
/// `v + 2^k`. A rank appears only in the steps where it sends or receives.
pub fn broadcast(rank: usize, size: usize, count: usize, root: usize) -> Schedule {
    if rank >= size || root >= size {
        return Schedule::default();
    }
    let v = (rank + size - root) % size;
    let real = |v: usize| (v + root) % size;
    let mut b = Builder::new(rank, size);
    let mut mask = 1usize;
    while mask < size {
        b.step();
        if v < mask {
            if let Some(to) = v.checked_add(mask).filter(|&t| t < size) {
                b.send(real(to), BufId::Dst, 0..count);
            }
        } else if v - mask < mask {
            b.recv(real(v - mask), BufId::Dst, 0..count, RecvAction::Copy);
        }
        mask = mask.saturating_mul(2);
    }
    b.finish()
}

/// Scatter: `Src` on `root` holds `size * count` elements; rank `r` receives
/// block `r` into `Dst` (`count` elements). `Src` is not read elsewhere.
///
/// One step: root sends every other block and copies its own locally.
pub fn scatter(rank: usize, size: usize, count: usize, root: usize) -> Schedule {
    if rank >= size || root >= size {
        return Schedule::default();
    }
    let offs = offsets(&vec![count; size]);
    let mut b = Builder::new(rank, size);
    b.step();
    if rank == root {
        for r in 0..size {
            if r == root {
                b.copy(block(&offs, r), 0..count);
            } else {
                b.send(r, BufId::Src, block(&offs, r));
            }
        }
    } else {
        b.recv(root, BufId::Dst, 0..count, RecvAction::Copy);
    }
    b.finish()
}

/// Gather: every rank's `Src` (`count` elements) lands in block `r` of `Dst`
/// on `root` (`size * count` elements). `Dst` is not written elsewhere.
///
/// One step: root receives every other block and copies its own locally.
pub fn gather(rank: usize, size: usize, count: usize, root: usize) -> Schedule {
    if rank >= size || root >= size {
        return Schedule::default();
    }
    let offs = offsets(&vec![count; size]);
    let mut b = Builder::new(rank, size);
    b.step();
    if rank == root {
        for r in 0..size {
            if r == root {
                b.copy(0..count, block(&offs, r));
            } else {
                b.recv(r, BufId::Dst, block(&offs, r), RecvAction::Copy);
            }
        }
    } else {
        b.send(root, BufId::Src, 0..count);
    }
    b.finish()
}

/// All-to-all: block `j` of `Src` (`send_counts[j]` elements, blocks laid out
/// by [`offsets`]) goes to rank `j`; block `j` of `Dst` (`recv_counts[j]`)
/// comes from rank `j`.
///
/// Pairwise exchange: the first step copies this rank's own block locally;
/// step `s` (1 ≤ s < p) sends to `rank + s` and receives from `rank - s`
/// (mod p), so every rank talks to exactly one peer in each direction per step.
/// If `send_counts[rank] != recv_counts[rank]` (inconsistent arguments, which
/// the header check rejects) the local copy moves the shorter length.
pub fn all_to_all(
    rank: usize,
    size: usize,
    send_counts: &[usize],
    recv_counts: &[usize],
) -> Schedule {
    if rank >= size || send_counts.len() != size || recv_counts.len() != size {
        return Schedule::default();
    }
    let (soffs, roffs) = (offsets(send_counts), offsets(recv_counts));
    let mut b = Builder::new(rank, size);
    b.step();
    let own = send_counts[rank].min(recv_counts[rank]);
    b.copy(
        soffs[rank]..soffs[rank].saturating_add(own),
        roffs[rank]..roffs[rank].saturating_add(own),
    );
    for s in 1..size {
        if s > 1 {
            b.step();
        }
        let (to, from) = ((rank + s) % size, (rank + size - s) % size);
        b.send(to, BufId::Src, block(&soffs, to));
        b.recv(from, BufId::Dst, block(&roffs, from), RecvAction::Copy);
    }
    b.finish()
}

/// The rounds of a dissemination barrier (Hensgen, Finkel and Manber) on
/// `rank` of `size`: in round `k` this rank sends an empty message to
/// `rank + 2^k` and waits for one from `rank - 2^k` (mod `size`), so after
/// `ceil(log2 size)` rounds every rank has heard, directly or through
/// others, from every rank. Returns `(to, from)` per round; empty for a
/// single rank or an invalid `rank`. O(log N) rounds and messages per rank.
///
/// ```
/// use chorus::backends::cpu::schedule::barrier_rounds;
/// assert_eq!(barrier_rounds(0, 5), vec![(1, 4), (2, 3), (4, 1)]);
/// assert!(barrier_rounds(0, 1).is_empty());
/// ```
pub fn barrier_rounds(rank: usize, size: usize) -> Vec<(usize, usize)> {
    barrier_round_iter(rank, size).collect()
}

/// The rounds of [`barrier_rounds`] one by one, without collecting them:
/// O(1) memory, so a barrier allocates nothing for its plan.
pub fn barrier_round_iter(rank: usize, size: usize) -> impl Iterator<Item = (usize, usize)> {
    std::iter::successors(Some(1usize), |d| d.checked_mul(2))
        .take_while(move |&d| rank < size && d < size)
        .map(move |d| ((rank + d) % size, (rank + size - d) % size))
}

/// Byte bound of the latency-minded rooted algorithms: [`reduce_tree`]
/// when the buffer, and [`gather_tree`]/[`scatter_tree`] when one rank's
/// block, is at most this large (see [`rooted_tree`]). Above it the
/// bandwidth-minded schedules ([`reduce`], [`gather`], [`scatter`]) move
/// every byte once.
pub const TREE_MAX_BYTES: usize = 64 << 10;

/// Gathers and scatters on more ranks than this run their trees (within
/// [`TREE_MAX_BYTES`]). On fewer, the root's `p - 1` concurrent messages
/// cost less than the tree's forwarding: 4 ranks, 64 KiB blocks, 12.6
/// against 14.5 µs (gather) on the 2-CPU host of docs/performance.md.
pub const GATHER_TREE_MIN_RANKS: usize = 9;

/// All-gathers whose whole output is at most this many bytes use
/// [`all_gather_doubling`] on a power-of-two number of ranks.
pub const SMALL_ALL_GATHER_BYTES: usize = 64 << 10;

/// Whether a rooted op moving `bytes` (the buffer of a reduce, one rank's
/// block of a gather or scatter) runs its binomial tree: `ceil(log2 p)`
/// steps instead of `p - 1` messages at the root (a reduce on more than 2
/// ranks, a gather or scatter from [`GATHER_TREE_MIN_RANKS`]). A pure
/// function of arguments every rank agrees on, so all ranks choose alike.
pub fn rooted_tree(kind: Rooted, bytes: usize, size: usize) -> bool {
    let min_ranks = match kind {
        Rooted::Reduce => 3,
        Rooted::GatherOrScatter => GATHER_TREE_MIN_RANKS,
    };
    size >= min_ranks && bytes <= TREE_MAX_BYTES
}

/// The reduce of the tuning table: [`reduce_tree`] where [`rooted_tree`]
/// says so, else [`reduce`].
pub fn reduce_auto(
    rank: usize,
    size: usize,
    count: usize,
    root: usize,
    elem_bytes: usize,
) -> Schedule {
    if rooted_tree(Rooted::Reduce, count.saturating_mul(elem_bytes), size) {
        reduce_tree(rank, size, count, root)
    } else {
        reduce(rank, size, count, root)
    }
}

/// The gather of the tuning table: [`gather_tree`] where [`rooted_tree`]
/// says so, else [`gather`]; with the elements of scratch `Dst` this rank
/// needs ([`tree_scratch`], 0 for none).
pub fn gather_auto(
    rank: usize,
    size: usize,
    count: usize,
    root: usize,
    elem_bytes: usize,
) -> (Schedule, usize) {
    tree_or_flat(gather_tree, gather, rank, size, count, root, elem_bytes)
}

/// The scatter of the tuning table: [`scatter_tree`] where [`rooted_tree`]
/// says so, else [`scatter`]; with the elements of scratch `Src` this rank
/// needs ([`tree_scratch`], 0 for none).
pub fn scatter_auto(
    rank: usize,
    size: usize,
    count: usize,
    root: usize,
    elem_bytes: usize,
) -> (Schedule, usize) {
    tree_or_flat(scatter_tree, scatter, rank, size, count, root, elem_bytes)
}

/// A builder of a rooted gather or scatter: `(rank, size, count, root)`.
type RootedBuilder = fn(usize, usize, usize, usize) -> Schedule;

/// `tree` with its scratch where [`rooted_tree`] picks trees for a gather
/// or scatter of this size, else `flat` with none.
fn tree_or_flat(
    tree: RootedBuilder,
    flat: RootedBuilder,
    rank: usize,
    size: usize,
    count: usize,
    root: usize,
    elem_bytes: usize,
) -> (Schedule, usize) {
    if rooted_tree(
        Rooted::GatherOrScatter,
        count.saturating_mul(elem_bytes),
        size,
    ) {
        (
            tree(rank, size, count, root),
            tree_scratch(rank, size, count, root),
        )
    } else {
        (flat(rank, size, count, root), 0)
    }
}

/// Which rooted op [`rooted_tree`] decides for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rooted {
    /// A reduce (its buffer's bytes).
    Reduce,
    /// A gather or a scatter (one rank's block's bytes).
    GatherOrScatter,
}

/// Relative rank `v`'s subtree in the binomial tree of `size` ranks rooted
/// at relative rank 0: it covers relative ranks `v..v + subtree(v, size)`.
/// The children of `v` are `v + 2^k` for every `2^k` below `v`'s lowest set
/// bit (every `2^k < size` for the root).
fn subtree(v: usize, size: usize) -> usize {
    if v == 0 {
        size
    } else {
        (v & v.wrapping_neg()).min(size - v)
    }
}

/// One rank's view of the binomial tree of a gather or scatter: its
/// relative rank `v` (`rank - root mod size`), its subtree's size, and
/// where the blocks of `count` elements of relative ranks live in its
/// buffer.
struct Tree {
    v: usize,
    sub: usize,
    size: usize,
    root: usize,
    count: usize,
}

impl Tree {
    fn new(rank: usize, size: usize, count: usize, root: usize) -> Tree {
        let v = (rank + size - root) % size;
        Tree {
            v,
            sub: subtree(v, size),
            size,
            root,
            count,
        }
    }

    /// The rank of relative rank `u`.
    fn real(&self, u: usize) -> usize {
        (u + self.root) % self.size
    }

    /// Where the blocks of relative ranks `r` (one piece of
    /// [`wrap_pieces`]) live in this rank's buffer: the root's by real
    /// rank, another rank's scratch from its own block on.
    fn at(&self, r: Range<usize>) -> Range<usize> {
        let first = if self.v == 0 {
            self.real(r.start)
        } else {
            r.start - self.v
        };
        first * self.count..(first + r.len()) * self.count
    }
}

/// Relative ranks `a..b` cut where real rank order wraps (relative rank
/// `size - root`), so that a subtree maps to contiguous blocks of the
/// root's buffer. Both ends of a transfer cut alike: the cut depends only
/// on `size` and `root`.
fn wrap_pieces(a: usize, b: usize, size: usize, root: usize) -> [Range<usize>; 2] {
    let w = (size - root) % size;
    let cut = if a < w && w < b { w } else { b };
    [a..cut, cut..b]
}

/// Elements of scratch buffer a non-root rank needs for [`gather_tree`]
/// (its `Dst`) or [`scatter_tree`] (its `Src`): one block per rank of its
/// subtree, or 0 for a leaf (which sends from `Src`, or receives into
/// `Dst`, directly) and for the root. O(subtree · count).
pub fn tree_scratch(rank: usize, size: usize, count: usize, root: usize) -> usize {
    if rank >= size || root >= size || rank == root {
        return 0;
    }
    let sub = subtree((rank + size - root) % size, size);
    if sub > 1 {
        sub.saturating_mul(count)
    } else {
        0
    }
}

/// Binomial-tree gather: the same buffers as [`gather`] on the root; a
/// non-root rank with children collects its subtree's blocks (in relative
/// rank order, its own first) in a scratch `Dst` of [`tree_scratch`]
/// elements and sends them to its parent in one message (two where the
/// subtree wraps past the last rank). `ceil(log2 p)` steps; every rank
/// sends once; O(p) messages in all.
pub fn gather_tree(rank: usize, size: usize, count: usize, root: usize) -> Schedule {
    if rank >= size || root >= size {
        return Schedule::default();
    }
    let t = Tree::new(rank, size, count, root);
    let (v, sub, real, at) = (t.v, t.sub, |u| t.real(u), |r| t.at(r));
    let mut b = Builder::new(rank, size);
    b.step();
    if sub > 1 || size == 1 {
        b.copy(0..count, at(v..v + 1));
    }
    let mut mask = 1usize;
    while mask < size {
        if mask > 1 {
            b.step();
        }
        if v & mask != 0 {
            for p in wrap_pieces(v, v + sub, size, root) {
                let range = if sub == 1 {
                    0..p.len() * count
                } else {
                    at(p.clone())
                };
                let buf = if sub == 1 { BufId::Src } else { BufId::Dst };
                b.send(real(v - mask), buf, range);
            }
            break;
        }
        let c = v + mask;
        if c < size {
            for p in wrap_pieces(c, c + subtree(c, size), size, root) {
                b.recv(real(c), BufId::Dst, at(p), RecvAction::Copy);
            }
        }
        mask = mask.saturating_mul(2);
    }
    b.finish()
}

/// Binomial-tree scatter, [`gather_tree`] run backwards: the same buffers
/// as [`scatter`] on the root; a non-root rank with children receives its
/// subtree's blocks into a scratch `Src` of [`tree_scratch`] elements,
/// forwards each child's part, and copies its own block to `Dst`; a leaf
/// receives straight into `Dst`. `ceil(log2 p)` steps; O(p) messages.
pub fn scatter_tree(rank: usize, size: usize, count: usize, root: usize) -> Schedule {
    if rank >= size || root >= size {
        return Schedule::default();
    }
    let t = Tree::new(rank, size, count, root);
    let (v, sub, real, at) = (t.v, t.sub, |u| t.real(u), |r| t.at(r));
    let lowest = if v == 0 {
        usize::MAX
    } else {
        v & v.wrapping_neg()
    };
    let mut b = Builder::new(rank, size);
    if size == 1 {
        b.step();
        b.copy(at(0..1), 0..count);
        return b.finish();
    }
    let mut own_copied = false;
    let mut mask = size.next_power_of_two() / 2;
    while mask > 0 {
        b.step();
        if mask == lowest {
            for p in wrap_pieces(v, v + sub, size, root) {
                if sub == 1 {
                    b.recv(
                        real(v - mask),
                        BufId::Dst,
                        0..p.len() * count,
                        RecvAction::Copy,
                    );
                } else {
                    b.recv(real(v - mask), BufId::Src, at(p), RecvAction::Copy);
                }
            }
        } else if mask < lowest && v + mask < size {
            let c = v + mask;
            for p in wrap_pieces(c, c + subtree(c, size), size, root) {
                b.send(real(c), BufId::Src, at(p));
            }
            if !own_copied {
                b.copy(at(v..v + 1), 0..count);
                own_copied = true;
            }
        }
        mask /= 2;
    }
    b.finish()
}

/// Binomial-tree reduce of `count` elements of `Dst` onto `root` (other
/// ranks' `Dst` is scratch): at step `k` a rank whose relative rank has
/// lowest set bit `2^k` sends its partial result to its parent, and every
/// rank still in the tree reduces its child's in. `ceil(log2 p)` steps,
/// each rank sends once, the whole buffer per message: latency-optimal for
/// the small buffers of [`rooted_tree`].
pub fn reduce_tree(rank: usize, size: usize, count: usize, root: usize) -> Schedule {
    if rank >= size || root >= size {
        return Schedule::default();
    }
    let v = (rank + size - root) % size;
    let real = |u: usize| (u + root) % size;
    let mut b = Builder::new(rank, size);
    let mut mask = 1usize;
    while mask < size {
        b.step();
        if v & mask != 0 {
            b.send(real(v - mask), BufId::Dst, 0..count);
            break;
        }
        if v + mask < size {
            b.recv(real(v + mask), BufId::Dst, 0..count, RecvAction::Reduce);
        }
        mask = mask.saturating_mul(2);
    }
    b.finish()
}

/// Recursive-doubling all-gather for a power-of-two number of ranks (other
/// sizes get the ring, [`all_gather`]): at step `k` a rank swaps the `2^k`
/// blocks its group holds with partner `rank ^ 2^k`, so `log2 p` steps
/// instead of `p - 1`. Buffers as [`all_gather`] (or, with `in_place`, as
/// [`all_gather_in_place`]).
pub fn all_gather_doubling(rank: usize, size: usize, counts: &[usize], in_place: bool) -> Schedule {
    if rank >= size || counts.len() != size || !size.is_power_of_two() {
        return if in_place {
            all_gather_in_place(rank, size, counts)
        } else {
            all_gather(rank, size, counts)
        };
    }
    let offs = offsets(counts);
    let mut b = Builder::new(rank, size);
    b.step();
    if !in_place {
        b.copy(0..counts[rank], block(&offs, rank));
    }
    let mut mask = 1usize;
    while mask < size {
        if mask > 1 {
            b.step();
        }
        let partner = rank ^ mask;
        let (mine, theirs) = (rank & !(mask - 1), partner & !(mask - 1));
        if mask == 1 && !in_place {
            // SC-2: the own block reaches Dst only at the end of this step.
            b.send(partner, BufId::Src, 0..counts[rank]);
        } else {
            b.send(partner, BufId::Dst, offs[mine]..offs[mine + mask]);
        }
        b.recv(
            partner,
            BufId::Dst,
            offs[theirs]..offs[theirs + mask],
            RecvAction::Copy,
        );
        mask *= 2;
    }
    b.finish()
}

/// The all-gather of the tuning table: [`all_gather_doubling`] when the
/// output is at most [`SMALL_ALL_GATHER_BYTES`] on a power-of-two number of
/// ranks, else the ring.
pub fn all_gather_auto(
    rank: usize,
    size: usize,
    counts: &[usize],
    in_place: bool,
    elem_bytes: usize,
) -> Schedule {
    let total: usize = counts.iter().fold(0usize, |a, &c| a.saturating_add(c));
    if size.is_power_of_two() && total.saturating_mul(elem_bytes) <= SMALL_ALL_GATHER_BYTES {
        all_gather_doubling(rank, size, counts, in_place)
    } else if in_place {
        all_gather_in_place(rank, size, counts)
    } else {
        all_gather(rank, size, counts)
    }
}

/// Block `i` of a layout given by [`offsets`].
fn block(offs: &[usize], i: usize) -> Range<usize> {
    offs[i]..offs[i + 1]
}

/// Accumulates the steps of one rank, dropping zero-length transfers ([SC-5])
/// and empty steps.
///
/// [SC-5]: self#invariants
struct Builder {
    rank: usize,
    size: usize,
    steps: Vec<Step>,
}

impl Builder {
    fn new(rank: usize, size: usize) -> Builder {
        Builder {
            rank,
            size,
            steps: Vec::new(),
        }
    }

    fn next(&self) -> usize {
        (self.rank + 1) % self.size
    }

    fn prev(&self) -> usize {
        (self.rank + self.size - 1) % self.size
    }

    /// `rank - k (mod size)`, for `k <= 2 * size`.
    fn back(&self, k: usize) -> usize {
        (self.rank + 2 * self.size - k) % self.size
    }

    /// Start a new step (an empty one is dropped by `finish`).
    fn step(&mut self) {
        self.steps.push(Step::default());
    }

    fn push(&mut self, t: Transfer) {
        if t.is_empty() {
            return;
        }
        if self.steps.is_empty() {
            self.step();
        }
        if let Some(step) = self.steps.last_mut() {
            step.transfers.push(t);
        }
    }

    fn send(&mut self, peer: usize, buf: BufId, range: Range<usize>) {
        self.push(Transfer::Send { peer, buf, range });
    }

    fn recv(&mut self, peer: usize, buf: BufId, range: Range<usize>, action: RecvAction) {
        self.push(Transfer::Recv {
            peer,
            buf,
            range,
            action,
        });
    }

    fn copy(&mut self, src: Range<usize>, dst: Range<usize>) {
        self.push(Transfer::LocalCopy { src, dst });
    }

    /// Ring reduce-scatter over the blocks `offs` of `Dst`: `p-1` steps, after
    /// which block `rank` holds the reduction over all ranks. At step `s` the
    /// partial block `rank-s-1` (reduced at step `s-1`, or local at `s = 0`)
    /// goes to the next rank, and block `rank-s-2` from the previous rank is
    /// reduced in ([SC-2]: different blocks, so no read-after-write hazard).
    ///
    /// [SC-2]: self#invariants
    fn ring_reduce_scatter(&mut self, offs: &[usize]) {
        self.ring_reduce_scatter_by(|i| [block(offs, i)]);
    }

    /// The ring reduce-scatter of [`Builder::ring_reduce_scatter`] over
    /// blocks anywhere in `Dst`, each a list of ranges: block `i` is
    /// `blocks(i)`, one message per range, in list order.
    fn ring_reduce_scatter_by<I>(&mut self, blocks: impl Fn(usize) -> I)
    where
        I: IntoIterator<Item = Range<usize>>,
    {
        let (next, prev) = (self.next(), self.prev());
        for s in 0..self.size.saturating_sub(1) {
            self.step();
            let (out, inc) = (self.back(s + 1), self.back(s + 2));
            for r in blocks(out) {
                self.send(next, BufId::Dst, r);
            }
            for r in blocks(inc) {
                self.recv(prev, BufId::Dst, r, RecvAction::Reduce);
            }
        }
    }

    /// Ring all-gather over the blocks `offs` of `Dst`, starting with block
    /// `rank` complete: at step `s` block `rank-s` goes to the next rank and
    /// block `rank-s-1` arrives from the previous one. With `first_from_src`,
    /// the step-0 send reads `Src` (the own block is being copied into `Dst` in
    /// that same step, so `Dst` does not hold it yet, [SC-2]) and shares the
    /// current step.
    ///
    /// [SC-2]: self#invariants
    fn ring_all_gather(&mut self, offs: &[usize], first_from_src: bool) {
        let (next, prev) = (self.next(), self.prev());
        for s in 0..self.size.saturating_sub(1) {
            if !(first_from_src && s == 0) {
                self.step();
            }
            let (out, inc) = (self.back(s), self.back(s + 1));
            if first_from_src && s == 0 {
                self.send(next, BufId::Src, 0..block(offs, out).len());
            } else {
                self.send(next, BufId::Dst, block(offs, out));
            }
            self.recv(prev, BufId::Dst, block(offs, inc), RecvAction::Copy);
        }
    }

    fn finish(mut self) -> Schedule {
        self.steps.retain(|s| !s.transfers.is_empty());
        Schedule { steps: self.steps }
    }
}

#[cfg(test)]
#[path = "schedule_tests.rs"]
pub(crate) mod tests;
