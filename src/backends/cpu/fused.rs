//! Small ops in one round trip: the payload travels in the header frame.
//!
//! Every op starts with each rank sending its encoded
//! [`OpHeader`](crate::op::OpHeader) to every peer of the op, and the
//! executor checks all of them before any payload moves. For a *fused* op
//! the same frame also carries this rank's payload for that peer, and the
//! op is then run by a direct, one-step algorithm: every rank sends its
//! data (or the block a peer needs) to every peer that needs it, and
//! combines what it received locally. The op costs one round trip instead
//! of a header exchange followed by the algorithm's own steps.
//!
//! The payload of every Header frame of the cpu backend, fused or not:
//!
//! | bytes | field |
//! |-------|-------|
//! | 0..4  | header length `h` (`u32`, little endian) |
//! | 4..8  | data length `d` (bits 0..31 of a `u32`, little endian); bit 31: this rank sent its fused plan's data |
//! | 8..8+h | the encoded `OpHeader` |
//! | to a multiple of 8 | zero padding |
//! | `d` bytes | this rank's data for the receiving peer (empty when not fused) |
//!
//! The frame header itself (kind, class, epoch, seq, length) is unchanged.
//!
//! This module is pure: [`plan`] says what a rank sends with its headers
//! and expects from each peer, [`apply`] combines what arrived; the backend
//! only moves the frames.
//!
//! # Invariants
//! - FU-1: whether an op is fused, and how many bytes each rank sends each
//!   peer, is a pure function of the fields the header check requires to
//!   agree (kind, dtype, count, root, split sizes, point-to-point lists)
//!   and the world size. Ranks whose headers pass the check always make the
//!   same choice and expect exactly what their peers sent; a rank whose
//!   header differs is caught by the check whatever it chose. The one
//!   exception is all_to_all_single, whose sizes agree only pair by pair:
//!   each rank chooses from its own send and receive sizes and says so in
//!   every Header frame (the flag bit), and the op runs fused only when
//!   every rank chose it ([`all_chose`]); every rank sees every rank's
//!   frame, so all decide alike, and otherwise all run the unfused
//!   algorithm and drop the data.
//! - FU-2: every rank sends exactly one Header frame to each peer of an op,
//!   fused or not, so the links stay aligned after a non-fatal mismatch.
//!   A received frame is bounded before it is buffered (the Header frame
//!   limit plus [`FUSE_PEER_MAX`]), and [`split_frame`] rejects any data
//!   part above [`FUSE_PEER_MAX`].
//! - FU-3: no received data byte is used before the header check passed:
//!   the executor calls `execute` only then, and data that came with the
//!   headers of an op that failed its check is dropped when the next op
//!   starts.
//! - FU-4: reductions combine in rank order, `((x0 ∘ x1) ∘ x2) ∘ …`, on
//!   every rank, so every rank gets bitwise the same result.
//! - FU-5: data whose length is not what this rank's own plan expects from
//!   that peer means the ranks are out of step (a fatal `Mismatch`); it is
//!   never read past its end.

use std::ops::Range;

use crate::backends::OpData;
use crate::kernels;
use crate::op::ReduceOp;
use smallvec::{smallvec, SmallVec};

/// Largest payload one rank sends one peer in a fused op (FU-2). Above it
/// the op runs its bandwidth-minded schedule after the header exchange.
pub(super) const FUSE_PEER_MAX: usize = 16 << 10;
/// Largest payload one rank sends all its peers together in a fused op:
/// a direct algorithm sends a whole buffer to every peer, which stops
/// paying on large worlds.
pub(super) const FUSE_TOTAL_MAX: usize = 256 << 10;
/// Bytes in front of the encoded header.
pub(super) const PREFIX: usize = 8;

/// Largest world a fused op runs on. The direct algorithm sends every rank's
/// data to every peer that needs it in one step: `p - 1` messages per rank
/// and `p(p - 1)` in all for an all_reduce. Above this the op runs its
/// O(log p) schedule instead (recursive doubling, binomial trees), whose
/// `log2 p` steps cost less than `p - 1` messages per rank.
pub(super) const FUSE_MAX_RANKS: usize = 8;

/// Whether a collective whose largest per-peer payload is `per_peer` bytes
/// runs fused on `size` ranks (FU-1).
pub(super) fn fits(per_peer: usize, size: usize) -> bool {
    size <= FUSE_MAX_RANKS && fits_any_world(per_peer, size)
}

/// [`fits`] without the bound on the world: an all_to_all sends `p - 1`
/// messages per rank whatever its algorithm, so the direct one never sends
/// more than its schedule would.
pub(super) fn fits_any_world(per_peer: usize, size: usize) -> bool {
    fused_enabled()
        && per_peer <= FUSE_PEER_MAX
        && per_peer.saturating_mul(size.saturating_sub(1)) <= FUSE_TOTAL_MAX
}

/// `CHORUS_FUSED=0` turns fusing off, for A/B measurements. It must be the
/// same on every rank: ranks that disagree fail their ops as out of step.
fn fused_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("CHORUS_FUSED").map_or(true, |v| v != "0"))
}

/// What one rank of a fused op sends with its headers and expects back,
/// indexed by peer. `None` for a direction that is not fused (only
/// point-to-point mixes the two: a direction whose payload is too large
/// moves in `execute`, after the check).
///
/// O(N) slots, inline (no heap allocation) up to [`FUSE_MAX_RANKS`] ranks
/// with one slice per peer, which covers every fused op but all_to_all on
/// larger worlds and point-to-point batches.
#[derive(Debug)]
pub(super) struct Plan<'a> {
    /// Per peer: the slices sent after the header, in order.
    pub(super) send: SmallVec<[Option<Slices<'a>>; FUSE_MAX_RANKS]>,
    /// Per peer: the data length expected from it.
    pub(super) recv: SmallVec<[Option<usize>; FUSE_MAX_RANKS]>,
}

/// The slices a fused op sends one peer, in order: one but for batches of
/// point-to-point.
pub(super) type Slices<'a> = SmallVec<[&'a [u8]; 1]>;

#[cfg(test)]
impl Plan<'_> {
    /// Bytes sent to `peer` with the header (0 when not fused).
    pub(super) fn send_len(&self, peer: usize) -> usize {
        self.send
            .get(peer)
            .and_then(Option::as_ref)
            .map_or(0, |v| v.iter().map(|s| s.len()).sum())
    }
}

fn block(bytes: &[u8], r: Range<usize>) -> Option<&[u8]> {
    bytes.get(r)
}

/// The fused plan of `data` on `rank` of `size`, or `None` when the op runs
/// unfused (too large, list-form all_to_all, barrier). See FU-1.
pub(super) fn plan(rank: usize, size: usize, data: &OpData) -> Option<Plan<'_>> {
    if rank >= size || size < 2 {
        return None;
    }
    // Only all_to_all and point-to-point fuse past FUSE_MAX_RANKS (`fits`
    // refuses every other op there): no O(N) slots for an op that would
    // not fuse anyway.
    if size > FUSE_MAX_RANKS && !matches!(data, OpData::AllToAll { .. } | OpData::P2P { .. }) {
        return None;
    }
    let peers = || (0..size).filter(move |&p| p != rank);
    let mut send: SmallVec<[Option<Slices<'_>>; FUSE_MAX_RANKS]> = smallvec![None; size];
    let mut recv: SmallVec<[Option<usize>; FUSE_MAX_RANKS]> = smallvec![None; size];
    let all = |send: &mut [Option<Slices<'_>>], recv: &mut [Option<usize>]| {
        for p in peers() {
            send[p] = Some(SmallVec::new());
            recv[p] = Some(0);
        }
    };
    match data {
        OpData::AllReduce { buf, .. } => {
            let b = buf.len_bytes();
            if !fits(b, size) {
                return None;
            }
            for p in peers() {
                send[p] = Some(smallvec![buf.as_bytes()]);
                recv[p] = Some(b);
            }
        }
        OpData::Reduce { buf, root, .. } => {
            let (b, root) = (buf.len_bytes(), *root);
            if !fits(b, size) || root >= size {
                return None;
            }
            all(&mut send, &mut recv);
            if rank == root {
                for p in peers() {
                    recv[p] = Some(b);
                }
            } else {
                send[root] = Some(smallvec![buf.as_bytes()]);
            }
        }
        OpData::ReduceScatter { input, counts, .. } | OpData::AllGather { input, counts, .. } => {
            if counts.len() != size {
                return None;
            }
            let es = input.dtype().size();
            let max = counts.iter().max().copied().unwrap_or(0);
            if !fits(max.saturating_mul(es), size) {
                return None;
            }
            let gather = matches!(data, OpData::AllGather { .. });
            // An all_gather sends every peer its own block (of the output
            // when in place), a reduce_scatter each peer that peer's block.
            let mut mine = input.as_bytes();
            // Rank p's block starts at element `at`: the ranks in order,
            // O(N) in all (`fits` bounded every count).
            let mut at = 0usize;
            for (p, &count) in counts.iter().enumerate() {
                let bytes = at * es..(at + count) * es;
                at += count;
                if gather {
                    if p != rank {
                        recv[p] = Some(count * es);
                    } else if let OpData::AllGather {
                        output,
                        in_place: true,
                        ..
                    } = data
                    {
                        mine = block(output.as_bytes(), bytes)?;
                    }
                } else if p != rank {
                    send[p] = Some(smallvec![block(input.as_bytes(), bytes)?]);
                    recv[p] = Some(counts[rank] * es);
                }
            }
            if gather {
                for p in peers() {
                    send[p] = Some(smallvec![mine]);
                }
            }
        }
        OpData::Broadcast { buf, root } => {
            let (b, root) = (buf.len_bytes(), *root);
            if !fits(b, size) || root >= size {
                return None;
            }
            all(&mut send, &mut recv);
            if rank == root {
                for p in peers() {
                    send[p] = Some(smallvec![buf.as_bytes()]);
                }
            } else {
                recv[root] = Some(b);
            }
        }
        OpData::Scatter {
            input,
            output,
            root,
        } => {
            let (b, root) = (output.len_bytes(), *root);
            if !fits(b, size) || root >= size {
                return None;
            }
            all(&mut send, &mut recv);
            if rank == root {
                for p in peers() {
                    send[p] = Some(smallvec![block(input.as_bytes(), p * b..(p + 1) * b)?]);
                }
            } else {
                recv[root] = Some(b);
            }
        }
        OpData::Gather { input, root, .. } => {
            let (b, root) = (input.len_bytes(), *root);
            if !fits(b, size) || root >= size {
                return None;
            }
            all(&mut send, &mut recv);
            if rank == root {
                for p in peers() {
                    recv[p] = Some(b);
                }
            } else {
                send[root] = Some(smallvec![input.as_bytes()]);
            }
        }
        OpData::P2P { ops } => {
            // Per direction: the sends to `p` (or receives from `p`) in
            // order, whose totals the p2p check makes agree end to end.
            let mut out = vec![0usize; size];
            let mut inn = vec![0usize; size];
            for t in ops.iter().filter(|t| t.peer < size && t.peer != rank) {
                let n = if t.send { &mut out } else { &mut inn };
                n[t.peer] = n[t.peer].saturating_add(t.buf.len_bytes());
            }
            for p in peers() {
                if out[p] <= FUSE_PEER_MAX && fused_enabled() {
                    send[p] = Some(
                        ops.iter()
                            .filter(|t| t.peer == p && t.send)
                            .map(|t| t.buf.as_bytes())
                            .collect(),
                    );
                }
                if inn[p] <= FUSE_PEER_MAX && fused_enabled() {
                    recv[p] = Some(inn[p]);
                }
            }
        }
        // Not fused: it runs as all_to_all's own exchange.
        OpData::AllToAllList { .. } => return None,
        // The single-tensor form (the list form's receive sizes are only
        // known from the peers' headers, so it arrives here without them).
        OpData::AllToAll {
            input,
            send_counts,
            recv_counts,
            ..
        } => {
            if send_counts.len() != size || recv_counts.len() != size {
                return None;
            }
            let es = input.dtype().size();
            let peer_max = peers()
                .flat_map(|p| [send_counts[p], recv_counts[p]])
                .max()
                .unwrap_or(0);
            if !fits_any_world(peer_max.saturating_mul(es), size) {
                return None;
            }
            let offs = super::schedule::offsets(send_counts);
            for p in peers() {
                send[p] = Some(smallvec![block(
                    input.as_bytes(),
                    offs[p] * es..offs[p + 1] * es,
                )?]);
                recv[p] = Some(recv_counts[p] * es);
            }
        }
        OpData::Barrier => return None,
    }
    Some(Plan { send, recv })
}

/// Whether an op whose plan is per rank (all_to_all_single, FU-1) runs
/// fused: this rank chose it and so did every peer that sent a frame.
pub(super) fn all_chose(data: &OpData, mine: bool, peers: impl IntoIterator<Item = bool>) -> bool {
    !per_rank_choice(data) || (mine && peers.into_iter().all(|f| f))
}

/// Whether `data`'s fused choice is made by each rank alone (FU-1).
pub(super) fn per_rank_choice(data: &OpData) -> bool {
    matches!(data, OpData::AllToAll { .. })
}

/// Bit 31 of a Header frame's data length field: the sender ran its fused
/// plan (FU-1).
const FLAG_FUSED: u32 = 1 << 31;

fn pad8(n: usize) -> Option<usize> {
    n.checked_add(7).map(|v| v / 8 * 8)
}

/// Encode the Header frame payload for one peer into `out` (replacing its
/// contents): prefix, `header`, padding, then `data` concatenated;
/// `fused`: whether this rank runs the op's fused plan.
///
/// # Errors
/// When the header or the data do not fit their `u32` length fields.
pub(super) fn encode_frame(
    out: &mut Vec<u8>,
    header: &[u8],
    data: &[&[u8]],
    fused: bool,
) -> std::result::Result<(), String> {
    let d: usize = data.iter().map(|s| s.len()).sum();
    let (Ok(h32), Some(d32)) = (
        u32::try_from(header.len()),
        u32::try_from(d).ok().filter(|d| d & FLAG_FUSED == 0),
    ) else {
        return Err(format!(
            "a {}-byte header with {d} data bytes does not fit a frame",
            header.len()
        ));
    };
    let start = PREFIX + pad8(header.len()).ok_or("header length overflows")?;
    out.clear();
    out.reserve(start + d);
    out.extend_from_slice(&h32.to_le_bytes());
    let flag = if fused { FLAG_FUSED } else { 0 };
    out.extend_from_slice(&(d32 | flag).to_le_bytes());
    out.extend_from_slice(header);
    out.resize(start, 0);
    for s in data {
        out.extend_from_slice(s);
    }
    Ok(())
}

/// A received Header frame, split (FU-2).
#[derive(Debug, Clone)]
pub(super) struct Split {
    /// The encoded header's bytes in the frame.
    pub(super) header: Range<usize>,
    /// The data part's bytes in the frame.
    pub(super) data: Range<usize>,
    /// The sender ran its fused plan.
    pub(super) fused: bool,
}

/// Split a received Header frame payload into the byte ranges of its
/// header and its data, and the sender's fused flag (FU-2).
///
/// # Errors
/// A description of what is malformed: a short frame, lengths that do not
/// add up to the frame's, or a data part above [`FUSE_PEER_MAX`].
pub(super) fn split_frame(frame: &[u8]) -> std::result::Result<Split, String> {
    let field = |at: usize| -> Option<u32> {
        let b: [u8; 4] = frame.get(at..at + 4)?.try_into().ok()?;
        Some(u32::from_le_bytes(b))
    };
    let (Some(h), Some(d)) = (field(0), field(4)) else {
        return Err(format!("a {}-byte header frame is too short", frame.len()));
    };
    let fused = d & FLAG_FUSED != 0;
    let (Ok(h), Ok(d)) = (usize::try_from(h), usize::try_from(d & !FLAG_FUSED)) else {
        return Err("header frame lengths overflow".into());
    };
    if d > FUSE_PEER_MAX {
        return Err(format!(
            "a header frame announces {d} data bytes (limit {FUSE_PEER_MAX})"
        ));
    }
    let start = pad8(h).and_then(|p| p.checked_add(PREFIX));
    match start.and_then(|s| s.checked_add(d).map(|e| (s, e))) {
        Some((s, e)) if e == frame.len() => Ok(Split {
            header: PREFIX..PREFIX + h,
            data: s..e,
            fused,
        }),
        _ => Err(format!(
            "a {}-byte header frame announces a {h}-byte header and {d} data bytes",
            frame.len()
        )),
    }
}

/// Combine a fused collective's data into `data` (FU-3, FU-4): `got[p]` is
/// what peer `p` sent with its header (its length already checked against
/// [`plan`]; `got[rank]` is ignored). `scratch` is reused between calls.
/// Point-to-point data is placed by the backend, not here.
///
/// # Errors
/// `Internal` if a buffer is not the size the plan was made for; a
/// reduction's own error.
pub(super) fn apply(
    rank: usize,
    size: usize,
    data: &mut OpData,
    got: &[&[u8]],
    scratch: &mut Vec<u8>,
) -> crate::Result<()> {
    let bad = |what: &str| crate::Error::Internal(format!("fused op on rank {rank}: {what}"));
    if got.len() != size {
        return Err(bad("one data slice per rank expected"));
    }
    // FU-4: `dst = x0 ∘ x1 ∘ … ∘ x(n-1)`, where this rank's own part is `own`.
    let reduce = |dst: &mut [u8], own: &[u8], op: ReduceOp, dtype| -> crate::Result<()> {
        let op = op.combine_op();
        for (k, src) in got.iter().enumerate() {
            let src = if k == rank { own } else { src };
            if k == 0 {
                dst.copy_from_slice(src);
            } else {
                kernels::reduce_into(dtype, op, dst, src)?;
            }
        }
        Ok(())
    };
    let fits_all = |len: usize, except: usize| {
        got.iter()
            .enumerate()
            .all(|(k, g)| k == except || g.len() == len)
    };
    match data {
        OpData::AllReduce { buf, op } => {
            let len = buf.len_bytes();
            if !fits_all(len, rank) {
                return Err(bad("all_reduce data of the wrong length"));
            }
            let dtype = buf.dtype();
            if rank == 0 {
                // x0 is already in place.
                for src in &got[1..] {
                    kernels::reduce_into(dtype, op.combine_op(), buf.as_bytes_mut(), src)?;
                }
            } else {
                scratch.clear();
                scratch.resize(len, 0);
                reduce(scratch, buf.as_bytes(), *op, dtype)?;
                buf.as_bytes_mut().copy_from_slice(scratch);
            }
        }
        OpData::Reduce { buf, op, root } => {
            if rank == *root {
                let len = buf.len_bytes();
                if !fits_all(len, rank) {
                    return Err(bad("reduce data of the wrong length"));
                }
                let dtype = buf.dtype();
                scratch.clear();
                scratch.resize(len, 0);
                reduce(scratch, buf.as_bytes(), *op, dtype)?;
                buf.as_bytes_mut().copy_from_slice(scratch);
            }
        }
        OpData::ReduceScatter {
            input,
            output,
            counts,
            op,
        } => {
            let es = input.dtype().size();
            let offs = super::schedule::offsets(counts);
            let mine = offs
                .get(rank + 1)
                .and_then(|&e| input.as_bytes().get(offs[rank] * es..e * es))
                .ok_or_else(|| bad("reduce_scatter input shorter than its split sizes"))?;
            if output.len_bytes() != mine.len() || !fits_all(mine.len(), rank) {
                return Err(bad("reduce_scatter data of the wrong length"));
            }
            reduce(output.as_bytes_mut(), mine, *op, input.dtype())?;
        }
        OpData::AllGather {
            input,
            output,
            counts,
            in_place,
        } => {
            let es = output.dtype().size();
            let offs = super::schedule::offsets(counts);
            let out = output.as_bytes_mut();
            for (k, src) in got.iter().enumerate() {
                if k == rank && *in_place {
                    continue; // already at its place
                }
                let src = if k == rank { input.as_bytes() } else { src };
                let dst = offs
                    .get(k + 1)
                    .and_then(|&e| out.get_mut(offs[k] * es..e * es))
                    .filter(|d| d.len() == src.len())
                    .ok_or_else(|| bad("all_gather block of the wrong length"))?;
                dst.copy_from_slice(src);
            }
        }
        OpData::AllToAllList { .. } => {
            return Err(bad("a list all_to_all is never fused"));
        }
        OpData::AllToAll {
            input,
            output,
            send_counts,
            recv_counts,
        } => {
            let es = input.dtype().size();
            let (so, ro) = (
                super::schedule::offsets(send_counts),
                super::schedule::offsets(recv_counts),
            );
            let own = so
                .get(rank + 1)
                .and_then(|&e| input.as_bytes().get(so[rank] * es..e * es))
                .ok_or_else(|| bad("all_to_all input shorter than its split sizes"))?;
            let out = output.as_bytes_mut();
            for (k, src) in got.iter().enumerate() {
                let src = if k == rank { own } else { src };
                let dst = ro
                    .get(k + 1)
                    .and_then(|&e| out.get_mut(ro[k] * es..e * es))
                    .filter(|d| d.len() == src.len())
                    .ok_or_else(|| bad("all_to_all block of the wrong length"))?;
                dst.copy_from_slice(src);
            }
        }
        OpData::Broadcast { buf, root } => {
            if rank != *root {
                let src = got.get(*root).ok_or_else(|| bad("root out of range"))?;
                if src.len() != buf.len_bytes() {
                    return Err(bad("broadcast data of the wrong length"));
                }
                buf.as_bytes_mut().copy_from_slice(src);
            }
        }
        OpData::Scatter {
            input,
            output,
            root,
        } => {
            let b = output.len_bytes();
            let src = if rank == *root {
                input.as_bytes().get(rank * b..(rank + 1) * b)
            } else {
                got.get(*root).copied()
            };
            let src = src
                .filter(|s| s.len() == b)
                .ok_or_else(|| bad("scatter block of the wrong length"))?;
            output.as_bytes_mut().copy_from_slice(src);
        }
        OpData::Gather {
            input,
            output,
            root,
        } => {
            if rank == *root {
                let b = input.len_bytes();
                let out = output.as_bytes_mut();
                for (k, src) in got.iter().enumerate() {
                    let src = if k == rank { input.as_bytes() } else { src };
                    let dst = out
                        .get_mut(k * b..(k + 1) * b)
                        .filter(|d| d.len() == src.len())
                        .ok_or_else(|| bad("gather block of the wrong length"))?;
                    dst.copy_from_slice(src);
                }
            }
        }
        OpData::P2P { .. } | OpData::Barrier => return Err(bad("not a fused collective")),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    //! The fused algorithms run in memory: N ranks' plans, frames routed by
    //! hand, results compared with a reference.
    use super::*;
    use crate::backends::P2PTransfer;
    use crate::tensor::{DType, Tensor};
    use proptest::prelude::*;

    /// Run one fused op on every rank in memory: encode each rank's frames,
    /// split them at the receivers, check lengths against the receivers'
    /// plans and apply. Returns `None` if the op does not fuse.
    fn run(mut datas: Vec<OpData>) -> Option<Vec<OpData>> {
        let n = datas.len();
        let header = b"hdr".to_vec();
        // frames[from][to]
        let mut frames = vec![vec![Vec::new(); n]; n];
        let mut fused = vec![false; n];
        for (r, d) in datas.iter().enumerate() {
            let Some(p) = plan(r, n, d) else { continue };
            fused[r] = true;
            for (to, f) in frames[r].iter_mut().enumerate().filter(|(to, _)| *to != r) {
                let empty = Slices::new();
                encode_frame(f, &header, p.send[to].as_ref().unwrap_or(&empty), true).unwrap();
            }
        }
        // FU-1: agreeing ranks all decide alike.
        assert!(fused.iter().all(|&f| f == fused[0]), "{fused:?}");
        if !fused[0] {
            return None;
        }
        for (r, d) in datas.iter_mut().enumerate() {
            let expect: Vec<Option<usize>> = plan(r, n, d).unwrap().recv.into_vec();
            let got: Vec<&[u8]> = (0..n)
                .map(|from| {
                    if from == r {
                        return &[][..];
                    }
                    let f = &frames[from][r];
                    let Split {
                        header: h,
                        data,
                        fused,
                    } = split_frame(f).unwrap();
                    assert!(fused);
                    assert_eq!(&f[h], &header[..]);
                    // FU-5: what arrives is what the receiver's own plan expects.
                    assert_eq!(Some(data.len()), expect[from], "{from} -> {r}");
                    &f[data]
                })
                .collect();
            apply(r, n, d, &got, &mut Vec::new()).unwrap();
        }
        Some(datas)
    }

    fn ints(v: &[i32]) -> Tensor {
        Tensor::from_slice(v)
    }

    #[test]
    fn fused_all_reduce_f32_is_bitwise_identical_on_every_rank_world_3() {
        let vals = [[0.1f32, 1e8], [0.2, 1.0], [0.3, -1e8]];
        let datas = vals
            .iter()
            .map(|v| OpData::AllReduce {
                buf: Tensor::from_slice(v),
                op: ReduceOp::Sum,
            })
            .collect();
        let out = run(datas).expect("fuses");
        // FU-4: ((x0 + x1) + x2), the same bits everywhere.
        let want = [(0.1f32 + 0.2) + 0.3, (1e8f32 + 1.0) + -1e8];
        for d in &out {
            let OpData::AllReduce { buf, .. } = d else {
                unreachable!()
            };
            let got = buf.to_vec::<f32>();
            assert_eq!(got[0].to_bits(), want[0].to_bits());
            assert_eq!(got[1].to_bits(), want[1].to_bits());
        }
    }

    #[test]
    fn ops_above_the_limit_or_without_a_direct_form_do_not_fuse() {
        let big = Tensor::zeros(DType::U8, FUSE_PEER_MAX + 1);
        assert!(plan(
            0,
            2,
            &OpData::AllReduce {
                buf: big,
                op: ReduceOp::Sum
            }
        )
        .is_none());
        assert!(plan(0, 2, &OpData::Barrier).is_none());
        // The list all_to_all arrives without its receive sizes.
        let list = OpData::AllToAll {
            input: Tensor::zeros(DType::U8, 4),
            output: Tensor::zeros(DType::U8, 0),
            send_counts: vec![2, 2],
            recv_counts: vec![],
        };
        assert!(plan(0, 2, &list).is_none());
        // all_to_all_single chooses per rank: one large direction is enough
        // to make this rank not fuse.
        let single = |to_peer: usize| OpData::AllToAll {
            input: Tensor::zeros(DType::U8, 1 + to_peer),
            output: Tensor::zeros(DType::U8, 2),
            send_counts: vec![1, to_peer],
            recv_counts: vec![1, 1],
        };
        assert!(plan(0, 2, &single(FUSE_PEER_MAX)).is_some());
        assert!(plan(0, 2, &single(FUSE_PEER_MAX + 1)).is_none());
        assert!(per_rank_choice(&single(1)));
        assert!(all_chose(&single(1), true, [true, true]));
        assert!(!all_chose(&single(1), true, [true, false]));
        assert!(!all_chose(&single(1), false, [true]));
        let ar = OpData::AllReduce {
            buf: Tensor::zeros(DType::U8, 4),
            op: ReduceOp::Sum,
        };
        assert!(
            all_chose(&ar, true, [false]),
            "other ops decide from agreed fields"
        );
        assert!(plan(0, 1, &OpData::Barrier).is_none());
        // 64 ranks x 16 KiB is above the total bound.
        let at_peer_max = Tensor::zeros(DType::U8, FUSE_PEER_MAX);
        let d = OpData::Broadcast {
            buf: at_peer_max,
            root: 0,
        };
        assert!(plan(0, 2, &d).is_some());
        assert!(plan(0, 64, &d).is_none());
    }

    #[test]
    fn p2p_fuses_each_direction_on_its_own() {
        let small = Tensor::zeros(DType::U8, 10);
        let big = Tensor::zeros(DType::U8, FUSE_PEER_MAX + 1);
        let ops = vec![
            P2PTransfer {
                peer: 1,
                seq: 0,
                send: true,
                buf: small,
            },
            P2PTransfer {
                peer: 1,
                seq: 0,
                send: false,
                buf: big,
            },
        ];
        let d = OpData::P2P { ops };
        let p = plan(0, 2, &d).expect("p2p plan");
        assert_eq!(p.send_len(1), 10);
        assert_eq!(p.recv[1], None, "the large direction moves after the check");
        assert!(p.send[0].is_none() && p.recv[0].is_none());
    }

    #[test]
    fn frame_rejects_data_above_the_limit_and_lengths_that_do_not_add_up() {
        let mut f = Vec::new();
        encode_frame(&mut f, b"abc", &[b"0123", b"45"], false).unwrap();
        assert_eq!(f.len(), PREFIX + 8 + 6);
        let sp = split_frame(&f).unwrap();
        assert_eq!(&f[sp.header], b"abc");
        assert_eq!(&f[sp.data], b"012345");
        assert!(!sp.fused);
        encode_frame(&mut f, b"abc", &[b"0123"], true).unwrap();
        let sp = split_frame(&f).unwrap();
        assert!(sp.fused);
        assert_eq!(&f[sp.data], b"0123");
        assert!(split_frame(&f[..f.len() - 1]).is_err());
        assert!(split_frame(&[1, 0, 0]).is_err());
        let mut huge = vec![0u8; 8];
        huge[4..8].copy_from_slice(&(FUSE_PEER_MAX as u32 + 1).to_le_bytes());
        assert!(split_frame(&huge).is_err());
    }

    proptest! {
        #[test]
        fn frame_round_trips(h in proptest::collection::vec(any::<u8>(), 0..300),
                             parts in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..4),
                             fused in any::<bool>()) {
            let slices: Vec<&[u8]> = parts.iter().map(|p| &p[..]).collect();
            let mut f = Vec::new();
            encode_frame(&mut f, &h, &slices, fused).unwrap();
            let sp = split_frame(&f).unwrap();
            prop_assert_eq!(&f[sp.header.clone()], &h[..]);
            prop_assert_eq!(f[sp.data.clone()].to_vec(), parts.concat());
            prop_assert_eq!(sp.data.start % 8, 0);
            prop_assert_eq!(sp.fused, fused);
        }

        #[test]
        fn split_never_panics_on_garbage(f in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = split_frame(&f);
        }

        /// Every fused collective, any world of 2..6 and split sizes, gives
        /// the reference result on every rank (i32 sums are exact).
        #[test]
        fn fused_collectives_match_the_reference(n in 2usize..6, seed in any::<u32>(),
                                                 counts in proptest::collection::vec(0usize..40, 6),
                                                 root in 0usize..6, c in 0usize..40) {
            let root = root % n;
            let counts = &counts[..n];
            let val = |r: usize, i: usize| (seed as i32).wrapping_mul(r as i32 + 1).wrapping_add(i as i32 * 7);
            let vec_of = |r: usize, len: usize| (0..len).map(|i| val(r, i)).collect::<Vec<i32>>();
            let sum_of = |len: usize, off: usize| (0..len).map(|i| (0..n).fold(0i32, |a, r| a.wrapping_add(val(r, off + i)))).collect::<Vec<i32>>();
            // all_reduce
            let out = run((0..n).map(|r| OpData::AllReduce { buf: ints(&vec_of(r, c)), op: ReduceOp::Sum }).collect()).unwrap();
            for d in out { if let OpData::AllReduce { buf, .. } = d { prop_assert_eq!(buf.to_vec::<i32>(), sum_of(c, 0)); } }
            // reduce
            let out = run((0..n).map(|r| OpData::Reduce { buf: ints(&vec_of(r, c)), op: ReduceOp::Sum, root }).collect()).unwrap();
            if let OpData::Reduce { buf, .. } = &out[root] { prop_assert_eq!(buf.to_vec::<i32>(), sum_of(c, 0)); }
            // reduce_scatter
            let total: usize = counts.iter().sum();
            let offs = crate::backends::cpu::schedule::offsets(counts);
            let out = run((0..n).map(|r| OpData::ReduceScatter { input: ints(&vec_of(r, total)), output: Tensor::zeros(DType::I32, counts[r]), counts: counts.to_vec(), op: ReduceOp::Sum }).collect()).unwrap();
            for (r, d) in out.into_iter().enumerate() { if let OpData::ReduceScatter { output, .. } = d { prop_assert_eq!(output.to_vec::<i32>(), sum_of(counts[r], offs[r])); } }
            // all_gather
            let want: Vec<i32> = (0..n).flat_map(|r| vec_of(r, counts[r])).collect();
            let out = run((0..n).map(|r| OpData::AllGather { input: ints(&vec_of(r, counts[r])), output: Tensor::zeros(DType::I32, total), counts: counts.to_vec(), in_place: false }).collect()).unwrap();
            for d in out { if let OpData::AllGather { output, .. } = d { prop_assert_eq!(output.to_vec::<i32>(), want.clone()); } }
            // broadcast
            let out = run((0..n).map(|r| OpData::Broadcast { buf: ints(&vec_of(r, c)), root }).collect()).unwrap();
            for d in out { if let OpData::Broadcast { buf, .. } = d { prop_assert_eq!(buf.to_vec::<i32>(), vec_of(root, c)); } }
            // scatter
            let out = run((0..n).map(|r| OpData::Scatter { input: if r == root { ints(&vec_of(r, n * c)) } else { ints(&[]) }, output: Tensor::zeros(DType::I32, c), root }).collect()).unwrap();
            for (r, d) in out.into_iter().enumerate() { if let OpData::Scatter { output, .. } = d { prop_assert_eq!(output.to_vec::<i32>(), vec_of(root, n * c)[r * c..(r + 1) * c].to_vec()); } }
            // gather
            let out = run((0..n).map(|r| OpData::Gather { input: ints(&vec_of(r, c)), output: if r == root { Tensor::zeros(DType::I32, n * c) } else { ints(&[]) }, root }).collect()).unwrap();
            if let OpData::Gather { output, .. } = &out[root] { prop_assert_eq!(output.to_vec::<i32>(), (0..n).flat_map(|r| vec_of(r, c)).collect::<Vec<_>>()); }
            // all_to_all_single with variable split sizes: rank i sends
            // sizes(i, j) elements to rank j (a matrix from `counts`).
            let sz = |i: usize, j: usize| counts[(i * 7 + j * 3) % n] % 9;
            let datas = (0..n).map(|r| {
                let send: Vec<usize> = (0..n).map(|j| sz(r, j)).collect();
                let recv: Vec<usize> = (0..n).map(|j| sz(j, r)).collect();
                OpData::AllToAll { input: ints(&vec_of(r, send.iter().sum())), output: Tensor::zeros(DType::I32, recv.iter().sum()), send_counts: send, recv_counts: recv }
            }).collect();
            let out = run(datas).unwrap();
            for (r, d) in out.into_iter().enumerate() {
                if let OpData::AllToAll { output, .. } = d {
                    let want: Vec<i32> = (0..n).flat_map(|j| { let off: usize = (0..r).map(|k| sz(j, k)).sum(); vec_of(j, off + sz(j, r))[off..].to_vec() }).collect();
                    prop_assert_eq!(output.to_vec::<i32>(), want);
                }
            }
        }

        /// FU-1 for point-to-point: what one end sends with its header is
        /// exactly what the other end's plan expects, direction by direction.
        #[test]
        fn p2p_plans_agree_end_to_end(lens in proptest::collection::vec((any::<bool>(), 0usize..(FUSE_PEER_MAX / 2)), 0..5)) {
            let side = |me: usize, flip: bool| OpData::P2P { ops: lens.iter().map(|&(s, l)| P2PTransfer { peer: 1 - me, seq: 0, send: s != flip, buf: Tensor::zeros(DType::U8, l) }).collect() };
            let (a, b) = (side(0, false), side(1, true));
            let (pa, pb) = (plan(0, 2, &a).unwrap(), plan(1, 2, &b).unwrap());
            prop_assert_eq!(pa.send[1].as_ref().map(|_| pa.send_len(1)), pb.recv[0]);
            prop_assert_eq!(pb.send[0].as_ref().map(|_| pb.send_len(0)), pa.recv[1]);
        }
    }
}
