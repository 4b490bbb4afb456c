//! all_to_all on the `cpu` backend: the pairwise exchange on one host, and
//! the rails algorithm on a communicator that spans hosts.
//!
//! Neither exchanges headers (CPU-6): a block is checked where it lands.
//! all_to_all's split sizes agree only pair by pair, so every ordered pair
//! of ranks has exactly one block, an empty one included, and each block is
//! received only into a block of exactly its length (all_to_all_single) or
//! into a buffer of the length it brings (the list form, which learns its
//! receive sizes). A block of the wrong length fails the op with
//! `Mismatch` on the rank it was meant for, and the abort that follows
//! reaches every rank.
//!
//! Both algorithms move one send slice and one receive block per rank:
//! cut from one tensor each way at the split sizes ([`OpData::AllToAll`]),
//! or the caller's own tensors ([`OpData::AllToAllList`], from
//! `Comm::all_to_all_into`), so a list is sent and received in place,
//! without a copy.
//!
//! # Pairwise (one host, hosts of unequal sizes, or `CHORUS_HIER=0`)
//! Every ordered pair of ranks exchanges one frame. A rank whose blocks are
//! small (the direct algorithm's limits, `fused`) moves all of them in one
//! step; otherwise it steps through the pairwise exchange, to `rank + s`
//! and from `rank - s`. The frames are the same either way, so ranks may
//! choose differently: a one-step rank serves every peer at once and never
//! holds up a stepping one. O(N) frames and O(N) offsets per rank.
//!
//! # Rails (hosts that each hold `L` ranks, `H` hosts)
//! A block crosses the network only along its *rail*, between the ranks
//! with the same index on two hosts, as NCCL's PXN routes through the GPU
//! on the NIC's rail ([`rail_steps`] is the plan, pure and tested in
//! memory; this module only executes it):
//! 1. each rank sends its rail peer on every other host one frame per rank
//!    of that host (that rank's block), and each rank of its own host that
//!    rank's block;
//! 2. it forwards to each rank of its host the blocks its rail peers sent
//!    for that rank, `H - 1` frames.
//!
//! | | pairwise | rails |
//! |---|---|---|
//! | peers off the host, per rank | `N - L` | `H - 1` |
//! | links a rank holds after an all_to_all | `N - 1` | `H - 1 + L - 1` |
//! | frames sent per rank | `N - 1` | `(H - 1) L + (L - 1) H` |
//! | bytes on the host | each block once | blocks between hosts once more, through the forwarding rank |
//!
//! So on many hosts a rank connects to `H - 1` remote peers instead of
//! `N - L`, and each remote message carries `L` blocks; the price is the
//! forwarding: a block between hosts is copied once more on each end's
//! host, and the two steps do not overlap. Every rank takes the same
//! choice from the topology all ranks share, so the frames always match.
//!
//! # Invariants
//! - RA-1: every rank ends with exactly the block each rank sent it, each
//!   received once, whatever the hosts' rank sets (consecutive or not) and
//!   the block sizes (empty ones included).
//! - RA-2: on rails a rank's peers off its host are its rail peers only,
//!   `H - 1` of them.
//! - RA-3: a block of the wrong length fails the op with `Mismatch` on the
//!   rank it was meant for. A forwarded block is checked there after it
//!   arrived, so the `Mismatch` names the rank that sent it and the one
//!   that forwarded it.
//!
//! Memory: the rails staging holds `(H - 1) L` blocks passing through this
//! rank and the `(H - 1)(L - 1)` forwarded to it, in O(N) reusable
//! vectors; after each op only [`RETAIN_BYTES`] of their capacity is kept.

use smallvec::SmallVec;

use super::hier::Topology;
use super::link::{FrameKind, RecvFrames, RecvInto, Recvs, SendFrames, Sends, Tag};
use super::{builders, class_of, fused, run_links, CpuBackend, Links};
use crate::backends::{OpCtx, OpData};
use crate::error::{Error, Result};
use crate::op::OpKind;
use crate::tensor::{DType, Tensor};

/// The staging capacity the rails algorithm keeps from one op to the next,
/// all vectors together; the rest is freed after the op.
pub const RETAIN_BYTES: usize = 1 << 20;

/// Reusable memory of the rails algorithm: the blocks passing through this
/// rank (`stage`, by [`In::Stage`] slot) and those received from a rank
/// other than their source or learned (`got`, by source rank). O(N)
/// vectors, created at the first all_to_all across hosts.
#[derive(Debug, Default)]
pub(super) struct Staging {
    stage: Vec<Vec<u8>>,
    got: Vec<Vec<u8>>,
}

/// One frame a rank sends in a step of [`rail_steps`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Out {
    /// This rank's input block for rank `r`.
    Input(usize),
    /// The block in staging slot `i` (received in step 1).
    Staged(usize),
}

/// Where a frame a rank receives in a step of [`rail_steps`] lands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum In {
    /// The block for this rank from rank `r`, sent by `r` itself.
    Direct(usize),
    /// A block passing through this rank, into staging slot `i`.
    Stage(usize),
    /// The block for this rank from rank `r`, forwarded by the sender.
    Forwarded(usize),
}

/// One step of the rails all_to_all on one rank: per peer, the frames it
/// sends and receives, in order (each peer at most once per list).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RailStep {
    /// Frames to send, per peer.
    pub sends: Vec<(usize, Vec<Out>)>,
    /// Frames to receive, per peer.
    pub recvs: Vec<(usize, Vec<In>)>,
}

/// Whether a communicator on `topo` runs its all_to_all on rails: several
/// hosts, each with the same number of ranks, at least two.
pub fn rails_apply(topo: &Topology) -> bool {
    topo.hosts() > 1 && topo.uniform() && topo.members(0).len() > 1
}

/// The two steps of the rails all_to_all on `rank` (see the module doc).
/// Staging slot `g L + j` holds the block from this rank's rail peer on
/// host `g` for the `j`-th rank of this rank's host. Empty steps when
/// [`rails_apply`] does not hold or `rank` is out of range. O(N) per rank:
/// `(H - 1) L + (L - 1) H` frames each way.
///
/// ```
/// use chorus::backends::cpu::alltoall::{rail_steps, In, Out};
/// use chorus::backends::cpu::hier::Topology;
/// // Two hosts of two ranks: 0 and 1 on "a", 2 and 3 on "b".
/// let topo = Topology::from_ids(&["a", "a", "b", "b"]).expect("two hosts");
/// let [first, second] = rail_steps(0, &topo);
/// // Rank 0 sends its rail peer (rank 2) the blocks for both ranks of
/// // host "b", and rank 1 its own block.
/// assert_eq!(first.sends, vec![(1, vec![Out::Input(1)]), (2, vec![Out::Input(2), Out::Input(3)])]);
/// // Then it forwards to rank 1 what rank 2 sent for rank 1 (slot 1 L + 1).
/// assert_eq!(second.sends, vec![(1, vec![Out::Staged(3)])]);
/// assert_eq!(second.recvs, vec![(1, vec![In::Forwarded(3)])]);
/// ```
pub fn rail_steps(rank: usize, topo: &Topology) -> [RailStep; 2] {
    if rank >= topo.size() || !rails_apply(topo) {
        return Default::default();
    }
    let (h, l) = (topo.host_of(rank), topo.local(rank));
    let per = topo.members(h).len();
    let mine = topo.members(h);
    let mut first = RailStep::default();
    let mut second = RailStep::default();
    for g in 0..topo.hosts() {
        let theirs = topo.members(g);
        if g == h {
            for (j, &q) in mine.iter().enumerate().filter(|&(j, _)| j != l) {
                first.sends.push((q, vec![Out::Input(q)]));
                first.recvs.push((q, vec![In::Direct(q)]));
                let others = (0..topo.hosts()).filter(|&f| f != h);
                second.sends.push((
                    q,
                    others.clone().map(|f| Out::Staged(f * per + j)).collect(),
                ));
                second.recvs.push((
                    q,
                    others.map(|f| In::Forwarded(topo.members(f)[j])).collect(),
                ));
            }
        } else {
            let p = theirs[l];
            first
                .sends
                .push((p, theirs.iter().map(|&q| Out::Input(q)).collect()));
            first.recvs.push((
                p,
                (0..per)
                    .map(|j| {
                        if j == l {
                            In::Direct(p)
                        } else {
                            In::Stage(g * per + j)
                        }
                    })
                    .collect(),
            ));
        }
    }
    // Peers in rank order, as every other step list.
    for s in [&mut first, &mut second] {
        s.sends.sort_by_key(|(p, _)| *p);
        s.recvs.sort_by_key(|(p, _)| *p);
    }
    [first, second]
}

impl CpuBackend {
    /// CPU-6: all_to_all without a header exchange (see the module doc):
    /// on rails across hosts when [`rails_apply`] holds, else pairwise;
    /// from and into one tensor each ([`OpData::AllToAll`]) or the
    /// caller's lists ([`OpData::AllToAllList`]).
    pub(super) async fn all_to_all(&mut self, ctx: &OpCtx, data: &mut OpData) -> Result<()> {
        let (rank, size) = (self.rank, self.size);
        let bad = |what: String| {
            Error::Internal(format!(
                "{} #{} on rank {rank} of {size}: {what}",
                ctx.kind.name(),
                ctx.seq
            ))
        };
        let own_mismatch = |sent: usize, expected: usize| {
            ctx.mismatch(format!(
                "this rank sends itself {sent} elements but expects {expected} from itself"
            ))
        };
        match data {
            OpData::AllToAllList { inputs, outputs } => {
                if inputs.len() != size || outputs.len() != size {
                    return Err(bad(format!(
                        "{} inputs and {} outputs for {size} ranks",
                        inputs.len(),
                        outputs.len()
                    )));
                }
                if inputs.iter().chain(outputs.iter()).any(Tensor::is_device) {
                    return Err(bad("a device tensor in a list all_to_all".into()));
                }
                if inputs[rank].len_bytes() != outputs[rank].len_bytes() {
                    return Err(own_mismatch(inputs[rank].len(), outputs[rank].len()));
                }
                let send: SmallVec<[&[u8]; fused::FUSE_MAX_RANKS]> =
                    inputs.iter().map(Tensor::as_bytes).collect();
                let recv = outputs.iter_mut().map(|t| Some(t.as_bytes_mut())).collect();
                self.exchange_blocks(ctx, &send, Recv::Into(recv)).await
            }
            OpData::AllToAll {
                input,
                output,
                send_counts,
                recv_counts,
            } => {
                let es = input.dtype().size();
                // Element offsets of every block, checked against the buffer once.
                let byte_ranges = |counts: &[usize], len: usize| {
                    let offs = builders::offsets(counts);
                    let total = offs.last().copied().unwrap_or(0).checked_mul(es);
                    match total {
                        Some(t) if counts.len() == size && t <= len => Ok(offs),
                        _ => Err(bad(format!(
                            "{} split sizes {counts:?} for {size} ranks and {len} bytes",
                            counts.len()
                        ))),
                    }
                };
                let so = byte_ranges(send_counts, input.len_bytes())?;
                let inp = input.as_bytes();
                let send: SmallVec<[&[u8]; fused::FUSE_MAX_RANKS]> =
                    so.windows(2).map(|w| &inp[w[0] * es..w[1] * es]).collect();
                if ctx.kind == OpKind::AllToAll && recv_counts.is_empty() {
                    let recv = Recv::Learn(input.dtype(), output, recv_counts);
                    return self.exchange_blocks(ctx, &send, recv).await;
                }
                let ro = byte_ranges(recv_counts, output.len_bytes())?;
                if send_counts[rank] != recv_counts[rank] {
                    return Err(own_mismatch(send_counts[rank], recv_counts[rank]));
                }
                let recv = split_blocks(output.as_bytes_mut(), &ro, es);
                self.exchange_blocks(ctx, &send, Recv::Into(recv)).await
            }
            _ => Err(bad("all_to_all without all_to_all data".into())),
        }
    }

    /// Move `send[j]` to rank `j` and each rank's block for this one into
    /// `recv`: on rails when [`rails_apply`] holds, else pairwise.
    async fn exchange_blocks(
        &mut self,
        ctx: &OpCtx,
        send: &[&[u8]],
        recv: Recv<'_, '_>,
    ) -> Result<()> {
        if let Some(topo) = self.topo.as_ref().filter(|t| rails_apply(t)) {
            let r = on_rails(&mut self.links, &mut self.a2a, ctx, topo, send, recv).await;
            trim(&mut self.a2a.stage, &mut self.a2a.got);
            return r;
        }
        match recv {
            Recv::Into(blocks) => self.all_to_all_pairs(ctx, send, blocks).await,
            Recv::Learn(dtype, output, counts) => {
                self.all_to_all_learned(ctx, send, dtype, output, counts)
                    .await
            }
        }
    }

    /// The pairwise exchange into blocks of known lengths (`send`: this
    /// rank's block for each rank; `blocks`: where each rank's block for
    /// this one lands, its own included, lengths checked by the caller).
    async fn all_to_all_pairs(
        &mut self,
        ctx: &OpCtx,
        send: &[&[u8]],
        mut blocks: Blocks<'_>,
    ) -> Result<()> {
        let (rank, size) = (self.rank, self.size);
        if let Some(own) = blocks.get_mut(rank).and_then(Option::as_deref_mut) {
            own.copy_from_slice(send[rank]);
        }
        let tag = Tag::of(ctx);
        let class = class_of(ctx);
        let peer_max = (0..size)
            .filter(|&p| p != rank)
            .map(|p| {
                let out = blocks[p].as_ref().map_or(0, |b| b.len());
                send[p].len().max(out)
            })
            .max()
            .unwrap_or(0);
        let taken = |k: usize| {
            Error::Internal(format!(
                "{} #{} on rank {rank}: block of rank {k} taken twice",
                ctx.kind.name(),
                ctx.seq
            ))
        };
        if fused::fits_any_world(peer_max, size) {
            let mut sends = Sends::new();
            let mut recvs = Recvs::new();
            for (p, out) in blocks.iter_mut().enumerate().filter(|(p, _)| *p != rank) {
                let out = out.take().ok_or_else(|| taken(p))?;
                sends.push((p, smallvec::smallvec![(FrameKind::Data, tag, send[p])]));
                recvs.push((
                    p,
                    smallvec::smallvec![(FrameKind::Data, tag, RecvInto::Exact(out))],
                ));
            }
            return run_links(&mut self.links, ctx, class, &mut sends, &mut recvs).await;
        }
        for s in 1..size {
            let (to, from) = ((rank + s) % size, (rank + size - s) % size);
            let out = blocks[from].take().ok_or_else(|| taken(from))?;
            let mut sends: Sends<'_> =
                smallvec::smallvec![(to, smallvec::smallvec![(FrameKind::Data, tag, send[to])])];
            let mut recvs: Recvs<'_> = smallvec::smallvec![(
                from,
                smallvec::smallvec![(FrameKind::Data, tag, RecvInto::Exact(out))]
            )];
            run_links(&mut self.links, ctx, class, &mut sends, &mut recvs).await?;
        }
        Ok(())
    }

    /// The list form of all_to_all, pairwise: every block in one step,
    /// each received into a buffer of the length its sender gives (the
    /// sizes are learned, not known); then the output and its receive sizes
    /// are built from them ([`assemble_learned`]). O(N) messages and N
    /// receive buffers per rank (the list form allocates its outputs
    /// anyway).
    async fn all_to_all_learned(
        &mut self,
        ctx: &OpCtx,
        send: &[&[u8]],
        dtype: DType,
        output: &mut Tensor,
        recv_counts: &mut Vec<usize>,
    ) -> Result<()> {
        let (rank, size) = (self.rank, self.size);
        let mut got: Vec<Vec<u8>> = vec![Vec::new(); size];
        {
            let tag = Tag::of(ctx);
            let mut sends = Sends::new();
            let mut recvs = Recvs::new();
            for (p, slot) in got.iter_mut().enumerate().filter(|(p, _)| *p != rank) {
                sends.push((p, smallvec::smallvec![(FrameKind::Data, tag, send[p])]));
                recvs.push((
                    p,
                    smallvec::smallvec![(FrameKind::Data, tag, RecvInto::Bounded(slot, u64::MAX))],
                ));
            }
            run_links(&mut self.links, ctx, class_of(ctx), &mut sends, &mut recvs).await?;
        }
        assemble_learned(ctx, dtype, send[rank], &got, output, recv_counts)
    }
}

/// `out` cut into one block per rank at the element offsets `offs`; `None`
/// for a rank past the offsets (never, once the caller checked them).
fn split_blocks<'b>(out: &'b mut [u8], offs: &[usize], es: usize) -> Blocks<'b> {
    let mut blocks = Vec::with_capacity(offs.len().saturating_sub(1));
    let mut rest = out;
    for w in offs.windows(2) {
        let (head, tail) = rest.split_at_mut(((w[1] - w[0]) * es).min(rest.len()));
        blocks.push(Some(head));
        rest = tail;
    }
    blocks
}

/// The list form's output from the blocks it received (`got`, by source
/// rank; this rank's own is `own`): the blocks concatenated in rank order,
/// and their element counts in `recv_counts`. A length that is not a whole
/// number of elements, or a total that cannot be allocated, is a
/// `Mismatch`.
fn assemble_learned(
    ctx: &OpCtx,
    dtype: DType,
    own: &[u8],
    got: &[Vec<u8>],
    output: &mut Tensor,
    recv_counts: &mut Vec<usize>,
) -> Result<()> {
    let es = dtype.size();
    let rank = ctx.rank;
    let part = |p: usize| if p == rank { own } else { &got[p][..] };
    let mut counts = Vec::with_capacity(got.len());
    for p in 0..got.len() {
        let len = part(p).len();
        if len % es != 0 {
            return Err(ctx.mismatch(format!(
                "rank {p} sent {len} bytes, not a whole number of {} elements",
                dtype.name()
            )));
        }
        counts.push(len / es);
    }
    let total = counts.iter().sum::<usize>();
    let mut out = Tensor::try_zeros(dtype, total).ok_or_else(|| {
        ctx.mismatch(format!(
            "peers sent {counts:?} elements for this rank, more than fits in memory"
        ))
    })?;
    let mut at = 0;
    let dst = out.as_bytes_mut();
    for p in 0..got.len() {
        let src = part(p);
        dst[at..at + src.len()].copy_from_slice(src);
        at += src.len();
    }
    *output = out;
    *recv_counts = counts;
    Ok(())
}

/// Where an all_to_all's received blocks go.
enum Recv<'a, 'b> {
    /// Into these blocks, one per source rank, each of exactly the length
    /// expected from it.
    Into(Blocks<'a>),
    /// Into an output of the dtype, built from what arrived, with the
    /// receive sizes learned (the list form without given outputs).
    Learn(DType, &'b mut Tensor, &'b mut Vec<usize>),
}

/// One mutable block per rank.
type Blocks<'a> = Vec<Option<&'a mut [u8]>>;

/// The rails all_to_all on one rank: [`rail_steps`] run over the links.
/// `send`: this rank's block for each rank; `recv`: where each rank's
/// block for this rank lands, of exactly its length, or, for the list form
/// that learns its sizes, where the output is built from what arrived.
async fn on_rails(
    links: &mut Links,
    staging: &mut Staging,
    ctx: &OpCtx,
    topo: &Topology,
    send: &[&[u8]],
    recv: Recv<'_, '_>,
) -> Result<()> {
    let (rank, size) = (ctx.rank, topo.size());
    let block = |k: usize| send[k];
    let [first, second] = rail_steps(rank, topo);
    let slots = topo.hosts() * topo.members(0).len();
    let Staging { stage, got } = staging;
    if stage.len() < slots {
        stage.resize_with(slots, Vec::new);
    }
    if got.len() < size {
        got.resize_with(size, Vec::new);
    }
    let (tag, class) = (Tag::of(ctx), class_of(ctx));
    let lost = |what: &str| {
        Error::Internal(format!(
            "{} #{} on rank {rank}: the rails plan names {what} twice or out of range",
            ctx.kind.name(),
            ctx.seq
        ))
    };
    // Known sizes: each source's block of the output, filled in place by
    // the blocks that come from their source and after step 2 from `got`.
    let (mut direct, learned) = match recv {
        Recv::Into(blocks) => (blocks, None),
        Recv::Learn(dtype, output, counts) => (Vec::new(), Some((dtype, output, counts))),
    };
    {
        let mut stage_in: Vec<Option<&mut Vec<u8>>> = stage.iter_mut().map(Some).collect();
        let mut got_in: Vec<Option<&mut Vec<u8>>> = got.iter_mut().map(Some).collect();
        let mut sends = Sends::new();
        let mut recvs = Recvs::new();
        for (p, frames) in &first.sends {
            let f: SendFrames<'_> = frames
                .iter()
                .map(|o| match *o {
                    Out::Input(q) => Ok((FrameKind::Data, tag, block(q))),
                    Out::Staged(_) => Err(lost("a staged block in step 1")),
                })
                .collect::<Result<_>>()?;
            sends.push((*p, f));
        }
        for (p, frames) in &first.recvs {
            let mut f = RecvFrames::new();
            for i in frames {
                let into = match *i {
                    In::Direct(s) => match direct.get_mut(s).and_then(Option::take) {
                        Some(b) => RecvInto::Exact(b),
                        None => RecvInto::Bounded(
                            got_in
                                .get_mut(s)
                                .and_then(Option::take)
                                .ok_or_else(|| lost("a source"))?,
                            u64::MAX,
                        ),
                    },
                    In::Stage(k) => RecvInto::Bounded(
                        stage_in
                            .get_mut(k)
                            .and_then(Option::take)
                            .ok_or_else(|| lost("a staging slot"))?,
                        u64::MAX,
                    ),
                    In::Forwarded(_) => return Err(lost("a forwarded block in step 1")),
                };
                f.push((FrameKind::Data, tag, into));
            }
            recvs.push((*p, f));
        }
        run_links(links, ctx, class, &mut sends, &mut recvs).await?;
    }
    {
        let mut got_in: Vec<Option<&mut Vec<u8>>> = got.iter_mut().map(Some).collect();
        let mut sends = Sends::new();
        let mut recvs = Recvs::new();
        for (p, frames) in &second.sends {
            let f: SendFrames<'_> = frames
                .iter()
                .map(|o| match *o {
                    Out::Staged(k) => stage
                        .get(k)
                        .map(|b| (FrameKind::Data, tag, &b[..]))
                        .ok_or_else(|| lost("a staging slot")),
                    Out::Input(q) => Ok((FrameKind::Data, tag, block(q))),
                })
                .collect::<Result<_>>()?;
            sends.push((*p, f));
        }
        for (p, frames) in &second.recvs {
            let mut f = RecvFrames::new();
            for i in frames {
                let In::Forwarded(s) = *i else {
                    return Err(lost("a block not forwarded in step 2"));
                };
                let slot = got_in
                    .get_mut(s)
                    .and_then(Option::take)
                    .ok_or_else(|| lost("a source"))?;
                f.push((FrameKind::Data, tag, RecvInto::Bounded(slot, u64::MAX)));
            }
            recvs.push((*p, f));
        }
        run_links(links, ctx, class, &mut sends, &mut recvs).await?;
    }
    if let Some((dtype, output, counts)) = learned {
        return assemble_learned(ctx, dtype, block(rank), &got[..size], output, counts);
    }
    // What is left of the output: this rank's own block and the forwarded
    // ones, each checked against the length this rank expects.
    for (s, out) in direct.iter_mut().enumerate() {
        let Some(out) = out.take() else { continue };
        let from = if s == rank { block(s) } else { &got[s][..] };
        if from.len() != out.len() {
            let via = topo.members(topo.host_of(rank))[topo.local(s)];
            return Err(ctx.mismatch(format!(
                "rank {s} sent {} bytes (forwarded by rank {via}) but this rank expects {}",
                from.len(),
                out.len()
            )));
        }
        out.copy_from_slice(from);
    }
    Ok(())
}

/// Free the staging vectors' capacity beyond [`RETAIN_BYTES`] in all
/// (those that come first keep theirs). O(N).
fn trim(stage: &mut [Vec<u8>], got: &mut [Vec<u8>]) {
    let mut kept = 0usize;
    for v in stage.iter_mut().chain(got.iter_mut()) {
        v.clear();
        match kept.checked_add(v.capacity()) {
            Some(k) if k <= RETAIN_BYTES => kept = k,
            _ => *v = Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    /// The block rank `s` sends rank `r` when it sends `n` bytes.
    fn payload(s: usize, r: usize, n: usize) -> Vec<u8> {
        (0..n).map(|k| (s * 31 + r * 7 + k) as u8).collect()
    }

    /// Run every rank's [`rail_steps`] in memory, delivering each step's
    /// frames from sender to receiver, and return what each rank ended with
    /// from each source (`out[r][s]`). Panics where a rank's receives do not
    /// match its peers' sends one for one, or a frame is left unread.
    fn simulate(topo: &Topology, bytes: impl Fn(usize, usize) -> usize) -> Vec<Vec<Vec<u8>>> {
        let n = topo.size();
        let plans: Vec<[RailStep; 2]> = (0..n).map(|r| rail_steps(r, topo)).collect();
        let mut stage: Vec<HashMap<usize, Vec<u8>>> = vec![HashMap::new(); n];
        let mut out: Vec<Vec<Vec<u8>>> = vec![vec![Vec::new(); n]; n];
        let mut seen = vec![vec![false; n]; n];
        for step in 0..2 {
            let mut wire: HashMap<(usize, usize), Vec<Vec<u8>>> = HashMap::new();
            for (r, plan) in plans.iter().enumerate() {
                for (p, frames) in &plan[step].sends {
                    let f = frames
                        .iter()
                        .map(|o| match *o {
                            Out::Input(q) => payload(r, q, bytes(r, q)),
                            Out::Staged(k) => stage[r].get(&k).cloned().expect("staged"),
                        })
                        .collect();
                    assert!(wire.insert((r, *p), f).is_none(), "{r} sends {p} twice");
                }
            }
            for (r, plan) in plans.iter().enumerate() {
                for (p, ins) in &plan[step].recvs {
                    let frames = wire.remove(&(*p, r)).expect("a message for each receive");
                    assert_eq!(frames.len(), ins.len(), "step {step}, {p} -> {r}");
                    for (i, f) in ins.iter().zip(frames) {
                        match *i {
                            In::Direct(s) | In::Forwarded(s) => {
                                assert_eq!(matches!(i, In::Direct(_)), s == *p);
                                assert!(!seen[r][s], "rank {r} got {s}'s block twice");
                                seen[r][s] = true;
                                out[r][s] = f;
                            }
                            In::Stage(k) => {
                                stage[r].insert(k, f);
                            }
                        }
                    }
                }
            }
            assert!(wire.is_empty(), "step {step}: frames left unread");
        }
        for (r, row) in out.iter_mut().enumerate() {
            row[r] = payload(r, r, bytes(r, r));
        }
        out
    }

    fn topologies() -> Vec<Topology> {
        let ids = |n: usize, host: &dyn Fn(usize) -> usize| -> Topology {
            let ids: Vec<String> = (0..n).map(|r| format!("h{}", host(r))).collect();
            Topology::from_ids(&ids).expect("hosts")
        };
        vec![
            ids(4, &|r| r / 2),
            ids(12, &|r| r / 4),
            // Hosts of interleaved ranks, as a round-robin launcher places them.
            ids(12, &|r| r % 3),
            ids(16, &|r| r / 8),
            ids(15, &|r| r / 3),
        ]
    }

    /// RA-1: on every topology and for uneven block sizes (empty ones
    /// included), each rank ends with exactly the block every rank sent it,
    /// each received once.
    #[test]
    fn rail_steps_deliver_every_block_once() {
        for topo in topologies() {
            let n = topo.size();
            for sizes in [
                (|s: usize, r: usize| 1 + (s * 5 + r * 3) % 7) as fn(usize, usize) -> usize,
                |s, r| if (s + r) % 3 == 0 { 0 } else { s + 2 * r },
                |_, _| 0,
            ] {
                let out = simulate(&topo, sizes);
                for (r, row) in out.iter().enumerate() {
                    for (s, got) in row.iter().enumerate() {
                        assert_eq!(
                            got,
                            &payload(s, r, sizes(s, r)),
                            "{} hosts of {}: rank {r} from {s}",
                            topo.hosts(),
                            n / topo.hosts()
                        );
                    }
                }
            }
        }
    }

    /// RA-2: a rank's peers off its host are its rail (the ranks with its
    /// index on the other hosts), `H - 1` of them, and it sends
    /// `(H - 1) L + (L - 1) H` frames in all.
    #[test]
    fn rail_steps_cross_hosts_only_along_the_rail() {
        for topo in topologies() {
            let (h, l) = (topo.hosts(), topo.members(0).len());
            for r in 0..topo.size() {
                let steps = rail_steps(r, &topo);
                let mut far = Vec::new();
                let mut frames = 0;
                for s in &steps {
                    for (p, f) in &s.sends {
                        frames += f.len();
                        if topo.host_of(*p) != topo.host_of(r) {
                            assert_eq!(topo.local(*p), topo.local(r), "rank {r} to {p}");
                            far.push(*p);
                        }
                    }
                }
                far.sort_unstable();
                far.dedup();
                assert_eq!(far.len(), h - 1, "rank {r}");
                assert_eq!(frames, (h - 1) * l + (l - 1) * h, "rank {r}");
            }
        }
    }

    /// At 4 096 ranks on 512 hosts of 8, a rank's all_to_all talks to
    /// `H - 1 + L - 1` = 518 peers instead of 4 095, and the frames between
    /// hosts are `N (H - 1) L`, as many as the pairwise exchange's but in
    /// `N (H - 1)` messages instead of `N (N - L)`.
    #[test]
    fn on_4096_ranks_of_8_per_host_a_rank_talks_to_518_peers() {
        const N: usize = 4096;
        const L: usize = 8;
        let ids: Vec<String> = (0..N).map(|r| format!("h{}", r / L)).collect();
        let topo = Topology::from_ids(&ids).expect("hosts");
        let h = N / L;
        let (mut messages, mut frames) = (0usize, 0usize);
        for r in 0..N {
            let mut peers: Vec<usize> = Vec::new();
            for s in rail_steps(r, &topo) {
                for (p, f) in &s.sends {
                    peers.push(*p);
                    if topo.host_of(*p) != topo.host_of(r) {
                        messages += 1;
                        frames += f.len();
                    }
                }
            }
            peers.sort_unstable();
            peers.dedup();
            assert_eq!(peers.len(), h - 1 + L - 1, "rank {r}");
        }
        assert_eq!(messages, N * (h - 1));
        assert_eq!(frames, N * (h - 1) * L);
    }

    /// Hosts of unequal sizes have no rails: the plan is empty and the op
    /// runs pairwise.
    #[test]
    fn unequal_hosts_have_no_rails() {
        let topo = Topology::from_ids(&["a", "a", "a", "b", "b"]).expect("two hosts");
        assert!(!rails_apply(&topo));
        assert_eq!(
            rail_steps(0, &topo),
            [RailStep::default(), RailStep::default()]
        );
    }

    /// The staging keeps at most [`RETAIN_BYTES`] of capacity between ops.
    #[test]
    fn trim_keeps_a_bounded_capacity() {
        let mut stage: Vec<Vec<u8>> = (0..8)
            .map(|_| Vec::with_capacity(RETAIN_BYTES / 3))
            .collect();
        let mut got: Vec<Vec<u8>> = (0..8).map(|_| vec![1u8; 100]).collect();
        trim(&mut stage, &mut got);
        let kept: usize = stage.iter().chain(&got).map(Vec::capacity).sum();
        assert!(kept <= RETAIN_BYTES, "{kept}");
        assert!(stage.iter().chain(&got).all(Vec::is_empty));
    }
}
