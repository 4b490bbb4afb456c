//! The `cpu` backend: Chorus's own data plane, built in and the default.
//!
//! Every pair of ranks that talks shares one authenticated TCP link, opened
//! when an op first needs it, or for every pair at creation on small
//! communicators ([`super::LinkPolicy`]; see the `link` module for the link
//! pool, setup and the frame format). Every op opens its peers' links
//! before it moves a byte. Peers on the same host (equal host ids in the
//! store) additionally get a pair of shared-memory rings (`shm`), which then
//! carry every header and data frame; their TCP link only carries Abort
//! frames and tells the ring engine (`shm_exec`) when the peer is gone. A
//! collective is turned into a sans-IO
//! [`Schedule`] by the builders in [`schedule`], and each step is checked
//! against the op's buffers by the pure planner in `plan`; this module only
//! executes schedules: per step, every send and every receive runs concurrently (each
//! link is split into a read and a write half, so a rank can write to one peer
//! while reading from another, or from the same one), then the received blocks
//! are applied in order (copy, or [`kernels::reduce_into`]) together with local
//! copies. Point-to-point batches run every transfer concurrently across
//! peers, in order per (peer, direction).
//!
//! Small ops skip the schedules: their payload travels in the Header
//! frames, and `execute` only combines what arrived (see `fused` for the
//! frame layout, the size limits and its invariants FU-1..FU-5).
//!
//! # Invariants
//! - CPU-1: a schedule step runs per [SC-1]/[SC-2]: sends read the buffers as they
//!   were before the step. A `Copy` receive whose range no other transfer of
//!   the step reads or writes lands in place ([SC-6] makes this the common
//!   case, but it is checked per step, not assumed); every other receive
//!   lands in reusable scratch memory and is applied, in order, after every
//!   transfer of the step completed.
//! - CPU-2: any error of an op is fatal for the links: the next
//!   `exchange_headers`/`execute` fails with `Aborted` until `abort` runs
//!   ([BE-2]). An op whose future was dropped mid-transfer counts as failed.
//! - CPU-3: when an op fails, sends already in flight get a short bounded
//!   time to finish their frame before the error is returned, so that the
//!   Abort frame sent by `abort` is read by peers as an Abort, not as payload
//!   (LK-4); a link left mid-frame is closed without an Abort frame.
//! - CPU-4: after `abort` every call returns `Aborted` immediately, and after
//!   `finalize` every call returns `Finalized`; both are idempotent and
//!   bounded in time. Nothing here panics on peer input or in `Drop`.
//! - CPU-5: an op of any size gives the runtime back at least every 100 µs
//!   of work while it makes progress (PA-1 in `crate::pace`): the shm
//!   engine paces itself (SX-8), each TCP transfer (one per peer and
//!   direction) paces its frames (LK-8), and the local work of a step
//!   (growing scratch, applying staged receives, local copies) runs a piece
//!   at a time under the op's own pacer. An op that moves less than 64 KiB
//!   never reads the clock for it (PA-2). The turn reads the abort signal
//!   on every poll, so an abort ends a long op within about a slice (PA-3).
//!
//! - CPU-6: an op that reaches `execute` without a header exchange
//!   (fingerprint or no checks, [`crate::checks`]) sends only its
//!   algorithm's messages, each stamped with the op's fingerprint (LK-9):
//!   a small op its fused plan's non-empty data parts, one Data frame each
//!   (the direct algorithm of `fused`), a larger one its schedule, a barrier
//!   the dissemination rounds of [`schedule::barrier_rounds`] (across
//!   hosts those of [`hier::barrier_rounds`]), a
//!   point-to-point batch one frame per transfer with that transfer's
//!   fingerprint, an all_to_all one block per ordered pair of ranks, an
//!   empty one for an empty block (its split sizes agree only pair by
//!   pair), received by all_to_all_single only into a block of exactly its
//!   length and by the list form into a buffer of the length it brings
//!   (pairwise, or across hosts forwarded along rails: [`alltoall`]). An
//!   abort caused by a mismatch marks its Abort frames, so peers report a
//!   `Mismatch` too.
//!
//! [BE-2]: crate::backends#invariants
//! [SC-1]: crate::backends::cpu::schedule#invariants
//! [SC-2]: crate::backends::cpu::schedule#invariants
//! [SC-6]: crate::backends::cpu::schedule#invariants

use std::ops::Range;
use std::time::Duration;

use async_trait::async_trait;
use smallvec::SmallVec;
use tracing::Instrument;

use super::{Backend, BackendInit, OpCtx, OpData, P2PTransfer};
use crate::error::{Error, Result};
use crate::kernels;
use crate::op::{OpKind, ReduceOp};
use crate::tensor::Tensor;

pub mod alltoall;
mod fused;
pub mod hier;
mod link;
mod plan;
pub mod schedule;
mod shm;
mod shm_exec;
mod tcp_exec;
mod window;

use crate::pace::Pacer;
use link::{
    FrameClass, FrameKind, LinkReader, LinkWriter, RecvInto, Recvs, Sends, Tag, MAX_HEADER_FRAME,
    WORK_UNIT,
};
use plan::{carve, plan_step_with, read_from, Item};
use schedule as builders;
use schedule::{BufId, RecvAction, Schedule};
use shm_exec::ShmLink;
use tcp_exec::run_tcp;

/// How long `abort` waits for each peer to take its Abort frame.
const ABORT_BOUND: Duration = Duration::from_secs(1);
/// How long an aborted link keeps draining its peer's data before closing.
const ABORT_LINGER: Duration = Duration::from_secs(2);

#[derive(Debug)]
enum State {
    /// Links usable, no op in flight.
    Ready,
    /// An op is running (still set if its future was dropped).
    InOp,
    /// An op failed; links unusable until `abort`.
    Broken(Error),
    /// `abort` ran.
    Aborted { reason: String, failed: Vec<usize> },
    /// `finalize` ran.
    Finalized,
}

/// The cpu backend of one communicator on one rank.
#[derive(Debug)]
pub struct CpuBackend {
    comm: String,
    rank: usize,
    size: usize,
    epoch: u64,
    /// The open links, and the pool that opens the others on demand.
    links: Links,
    /// Reusable receive buffers for schedule steps.
    scratch: Vec<Vec<u8>>,
    /// Reusable Header frames, sent and received, one per peer of an op.
    out_frames: Vec<Vec<u8>>,
    in_frames: Vec<Vec<u8>>,
    /// Reusable memory for combining a fused op's data.
    fuse_scratch: Vec<u8>,
    /// What came with the headers of the op whose headers were exchanged
    /// last, waiting for `execute` ([FU-3]).
    ///
    /// [FU-3]: self::fused#invariants
    carried: Option<Carried>,
    state: State,
    /// One-sided windows (`window`), freed at finalize and abort.
    windows: window::Windows,
    /// The communicator is aborted because its ranks' ops disagree
    /// ([`Backend::abort_for`]): the Abort frames say so (LK-9).
    abort_mismatch: bool,
    /// The hosts of a communicator that spans several, whose collectives
    /// then run hierarchically ([`hier`], and all_to_all on rails,
    /// [`alltoall`]). O(N).
    topo: Option<hier::Topology>,
    /// Reusable staging of all_to_all across hosts ([`alltoall`]). O(N)
    /// vectors once used.
    a2a: alltoall::Staging,
}

/// The data parts of the Header frames of one op ([FU-3]): what each peer
/// sent after its header, not yet used.
///
/// [FU-3]: self::fused#invariants
#[derive(Debug)]
struct Carried {
    kind: OpKind,
    seq: u64,
    /// `Some` when this rank sent its own data with its headers (the op's
    /// fused plan; otherwise it expects none from its peers): the plan's
    /// expected length per peer, and per peer whether data went to it
    /// (kept from the exchange, so `execute` does not plan the op again).
    plan: Option<(Vec<Option<usize>>, Vec<bool>)>,
    /// Per received frame (`in_frames[i]`): the peer, the frame's seq and
    /// the frame split into header, data part and the sender's fused flag.
    peers: Vec<(usize, u64, fused::Split)>,
}

/// What `execute` still has to do after the carried data was used.
enum AfterCarried {
    /// Nothing: the op was fused and is complete.
    Done,
    /// Run the op's own algorithm.
    Unfused,
    /// Point-to-point: skip the transfers of the directions that were
    /// fused (per peer: sends to it, receives from it).
    P2P(Vec<bool>, Vec<bool>),
}

impl CpuBackend {
    /// Bootstrap this rank's data links through the store, and, under the
    /// eager [`super::LinkPolicy`] (by default up to 8 ranks), open a link
    /// to every peer (see the `link` module for the pool and the
    /// handshake). Under the lazy policy links open as ops need them.
    ///
    /// # Errors
    /// `PeerFailed` naming the ranks that did not publish their address (or,
    /// eager, did not connect) within `init.connect_timeout`; `Transport` if
    /// the store fails or times out, or, eager, if a peer could not prove
    /// the job secret to this rank; `Config` for a malformed `CHORUS_LINKS`.
    pub async fn connect(init: BackendInit) -> Result<CpuBackend> {
        let span = tracing::debug_span!("cpu_connect", comm = %init.comm, rank = init.rank, size = init.size, epoch = init.epoch);
        let checksum = link::checksum_from_env();
        let policy = init.links.resolve(init.size, fused::FUSE_MAX_RANKS)?;
        let hierarchical = hier_from_env()?;
        let pool = link::Pool::open(&init, checksum)
            .instrument(span.clone())
            .await?;
        let host_ids = pool.host_ids();
        let topo = hierarchical
            .then(|| hier::Topology::from_ids(&host_ids))
            .flatten();
        // SX-5, once (O(N)): the ranks of this communicator on this host,
        // whether or not their links are open yet.
        let local = match host_ids.get(init.rank) {
            Some(me) => host_ids.iter().filter(|h| *h == me).count(),
            None => init.size,
        };
        if let Some(t) = &topo {
            tracing::debug!(comm = %init.comm, rank = init.rank, hosts = t.hosts(), uniform = t.uniform(), "hierarchical collectives");
        }
        let mut links = Links {
            rank: init.rank,
            size: init.size,
            writers: (0..init.size).map(|_| None).collect(),
            readers: (0..init.size).map(|_| None).collect(),
            shm: (0..init.size).map(|_| None).collect(),
            fallbacks: Default::default(),
            pool,
            checksum,
            scratch: Default::default(),
            oversubscribed: local > shm_exec::cpus(),
        };
        if policy == super::LinkPolicy::Eager {
            links.open_all().instrument(span).await?;
        }
        let windows = window::Windows::new(&init);
        Ok(CpuBackend {
            comm: init.comm,
            rank: init.rank,
            size: init.size,
            epoch: init.epoch,
            links,
            scratch: Vec::new(),
            out_frames: Vec::new(),
            in_frames: Vec::new(),
            fuse_scratch: Vec::new(),
            carried: None,
            state: State::Ready,
            windows,
            abort_mismatch: false,
            topo,
            a2a: Default::default(),
        })
    }

    /// The hosts this communicator's hierarchical collectives run over
    /// ([`hier`]), or `None` when its ops are flat: one host, a host per
    /// rank, a rank that uses no shared memory (`CHORUS_SHM=0`), or
    /// `CHORUS_HIER=0`.
    pub fn topology(&self) -> Option<&hier::Topology> {
        self.topo.as_ref()
    }

    /// The peers this rank holds a data link to, in rank order. Links open
    /// when an op first needs them (unless the communicator opened every
    /// link at creation, [`super::LinkPolicy`]), so after some ops this is
    /// the set of peers their algorithms talked to.
    pub fn linked_peers(&self) -> Vec<usize> {
        (0..self.size)
            .filter(|&p| self.links.writers[p].is_some())
            .collect()
    }

    /// Run one hand-built [`Schedule`] over the links (what `execute` does
    /// after choosing the schedule). `src` is the schedule's `Src` buffer; when
    /// `None`, `Src` is empty (in-place ops). `op` combines `Reduce` receives.
    ///
    /// # Errors
    /// As [`Backend::execute`]; `Internal` if a transfer's range is outside
    /// its buffer or names this rank or a rank outside the communicator.
    pub async fn run_schedule(
        &mut self,
        ctx: &OpCtx,
        schedule: &Schedule,
        src: Option<&mut Tensor>,
        dst: &mut Tensor,
        op: ReduceOp,
    ) -> Result<()> {
        let bytes = dst.len_bytes();
        let span = crate::hot_span!(DEBUG, "cpu_op", comm = %ctx.comm, rank = ctx.rank, op = ctx.kind.name(), seq = ctx.seq, bytes);
        self.enter(ctx)?;
        let r = self
            .schedule_inner(ctx, schedule, src, dst, op)
            .instrument(span)
            .await;
        self.leave(&r);
        r
    }

    fn enter(&mut self, ctx: &OpCtx) -> Result<()> {
        let aborted = |reason: String, failed: Vec<usize>| Error::Aborted {
            comm: self.comm.clone(),
            rank: self.rank,
            epoch: self.epoch,
            failed_ranks: failed,
            reason,
        };
        let err = match &self.state {
            State::Ready => None,
            State::InOp => Some(aborted(
                format!(
                    "an earlier op was cancelled while moving data, the links are out of step \
                     (before {} #{}); abort and reconfigure",
                    ctx.kind.name(),
                    ctx.seq
                ),
                Vec::new(),
            )),
            State::Broken(e) => Some(aborted(
                format!("the links are unusable after an earlier error: {e}"),
                e.failed_ranks().to_vec(),
            )),
            State::Aborted { reason, failed } => Some(aborted(reason.clone(), failed.clone())),
            State::Finalized => Some(Error::Finalized {
                comm: self.comm.clone(),
                rank: self.rank,
            }),
        };
        match err {
            Some(e) => Err(e),
            None => {
                self.state = State::InOp;
                Ok(())
            }
        }
    }

    fn leave(&mut self, r: &Result<()>) {
        if matches!(self.state, State::InOp) {
            self.state = match r {
                Ok(()) => State::Ready,
                Err(e) => State::Broken(e.clone()),
            };
        }
    }

    async fn schedule_inner(
        &mut self,
        ctx: &OpCtx,
        schedule: &Schedule,
        src: Option<&mut Tensor>,
        dst: &mut Tensor,
        op: ReduceOp,
    ) -> Result<()> {
        let dtype = dst.dtype();
        let es = dtype.size();
        let class = class_of(ctx);
        let combine = op.combine_op();
        let mut no_src = Tensor::zeros(dtype, 0);
        let src: &mut Tensor = match src {
            Some(s) => s,
            None => &mut no_src,
        };
        let bad = |what: String| {
            Error::Internal(format!(
                "cpu schedule for {} #{} on rank {}: {what}",
                ctx.kind.name(),
                ctx.seq,
                ctx.rank
            ))
        };
        // Open the schedule's links first (links on demand), so that the
        // plan knows which peers are shared-memory ones.
        self.links
            .ensure(
                schedule
                    .steps
                    .iter()
                    .flat_map(|s| s.transfers.iter())
                    .filter_map(schedule::Transfer::peer),
            )
            .await?;
        // CPU-5: the local work between transfers (growing scratch, applying
        // staged receives, local copies) gives the runtime back too.
        let mut pace = Pacer::new();
        for (step_no, step) in schedule.steps.iter().enumerate() {
            let shm = &self.links.shm;
            let items = plan_step_with(
                step,
                self.rank,
                self.size,
                es,
                [src.len_bytes(), dst.len_bytes()],
                &|p| shm.get(p).is_some_and(Option::is_some),
            )
            .map_err(|w| bad(format!("step {step_no}: {w}")))?;
            let n_staged = items
                .iter()
                .filter(|i| matches!(i, Item::Recv { direct: false, .. }))
                .count();
            if self.scratch.len() < n_staged {
                self.scratch.resize_with(n_staged, Vec::new);
            }
            // Network phase: sends read ranges nobody writes during the step,
            // receives land in place where their range is private, else in
            // scratch (CPU-1).
            {
                let direct_of = |b: BufId| -> Vec<(usize, Range<usize>)> {
                    items
                        .iter()
                        .enumerate()
                        .filter_map(|(k, i)| match i {
                            Item::Recv {
                                buf,
                                bytes,
                                direct: true,
                                ..
                            } if *buf == b => Some((k, bytes.clone())),
                            _ => None,
                        })
                        .collect()
                };
                let (src_gaps, src_direct) = carve(src.as_bytes_mut(), direct_of(BufId::Src));
                let (dst_gaps, dst_direct) = carve(dst.as_bytes_mut(), direct_of(BufId::Dst));
                let mut direct: Vec<Option<&mut [u8]>> = (0..items.len()).map(|_| None).collect();
                for (k, slot) in src_direct.into_iter().chain(dst_direct) {
                    direct[k] = Some(slot);
                }
                let mut sends = Sends::new();
                let mut recvs = Recvs::new();
                let mut scratch = self.scratch.iter_mut();
                for (k, item) in items.iter().enumerate() {
                    match item {
                        Item::Send { peer, buf, bytes } => {
                            let gaps = match buf {
                                BufId::Src => &src_gaps,
                                BufId::Dst => &dst_gaps,
                            };
                            let payload = read_from(gaps, bytes).ok_or_else(|| {
                                bad(format!("step {step_no}: send range {bytes:?} of {buf:?} is being written"))
                            })?;
                            push_grouped(
                                &mut sends,
                                *peer,
                                (FrameKind::Data, Tag::of(ctx), payload),
                            );
                        }
                        Item::Recv {
                            peer,
                            bytes,
                            action,
                            direct: true,
                            ..
                        } => {
                            let slot = direct[k].take().ok_or_else(|| {
                                bad(format!("step {step_no}: lost in-place slot {bytes:?}"))
                            })?;
                            let into = match action {
                                RecvAction::Copy => RecvInto::Exact(slot),
                                RecvAction::Reduce => RecvInto::Reduce(slot, dtype, combine),
                            };
                            push_grouped(&mut recvs, *peer, (FrameKind::Data, Tag::of(ctx), into));
                        }
                        Item::Recv {
                            peer,
                            bytes,
                            direct: false,
                            ..
                        } => {
                            let Some(s) = scratch.next() else {
                                return Err(bad("scratch buffers exhausted".into()));
                            };
                            // CPU-5: first-touch pages cost more than a
                            // copy; grow a piece at a time.
                            if s.len() < bytes.len() {
                                s.reserve_exact(bytes.len() - s.len());
                                while s.len() < bytes.len() {
                                    let to = bytes.len().min(s.len() + WORK_UNIT);
                                    let grew = to - s.len();
                                    s.resize(to, 0);
                                    pace.account(grew).await;
                                }
                            }
                            push_grouped(
                                &mut recvs,
                                *peer,
                                (
                                    FrameKind::Data,
                                    Tag::of(ctx),
                                    RecvInto::Exact(&mut s[..bytes.len()]),
                                ),
                            );
                        }
                        Item::LocalCopy { .. } => {}
                    }
                }
                run_links(&mut self.links, ctx, class, &mut sends, &mut recvs).await?;
            }
            // Apply staged receives and local copies in order (SC-2), a
            // piece at a time (CPU-5). Ranges were bounds-checked by
            // `plan_step`; WORK_UNIT is a multiple of every element size.
            let mut k = 0;
            for item in &items {
                match item {
                    Item::Recv {
                        buf,
                        bytes,
                        action,
                        direct: false,
                        ..
                    } => {
                        let data = &self.scratch[k][..bytes.len()];
                        k += 1;
                        let target = match buf {
                            BufId::Src => &mut src.as_bytes_mut()[bytes.clone()],
                            BufId::Dst => &mut dst.as_bytes_mut()[bytes.clone()],
                        };
                        for (t, d) in target.chunks_mut(WORK_UNIT).zip(data.chunks(WORK_UNIT)) {
                            match action {
                                RecvAction::Copy => t.copy_from_slice(d),
                                RecvAction::Reduce => kernels::reduce_into(dtype, combine, t, d)?,
                            }
                            pace.account(d.len()).await;
                        }
                    }
                    Item::LocalCopy { from, to } => {
                        for off in (0..from.len()).step_by(WORK_UNIT) {
                            let n = WORK_UNIT.min(from.len() - off);
                            let (f, t) = (from.start + off, to.start + off);
                            dst.as_bytes_mut()[t..t + n].copy_from_slice(&src.as_bytes()[f..f + n]);
                            pace.account(n).await;
                        }
                    }
                    Item::Send { .. } | Item::Recv { direct: true, .. } => {}
                }
            }
        }
        Ok(())
    }

    /// Run the transfers of a batch, but for the directions in `done`
    /// (sends to peer `p` when `done.0[p]`, receives from it when
    /// `done.1[p]`), which travelled with the headers.
    async fn p2p_inner(
        &mut self,
        ctx: &OpCtx,
        ops: &mut [P2PTransfer],
        done: Option<(Vec<bool>, Vec<bool>)>,
    ) -> Result<()> {
        let mut sends = Sends::new();
        let mut recvs = Recvs::new();
        // LK-9: the i-th message of a batch in one direction between two
        // ranks carries the fingerprint of (pair seq, i, dtype, length),
        // which both ends compute from their own side of the transfer; i is
        // the length of that peer's list so far (no per-op vector of N).
        for t in ops.iter_mut() {
            if t.peer >= self.size || t.peer == self.rank {
                return Err(Error::Internal(format!(
                    "p2p transfer with rank {} on rank {} of {}",
                    t.peer, self.rank, self.size
                )));
            }
            let skip = done.as_ref().is_some_and(|(s, r)| {
                let d = if t.send { s } else { r };
                d.get(t.peer).copied().unwrap_or(false)
            });
            if skip {
                continue;
            }
            let nth = if t.send {
                grouped_len(&sends, t.peer)
            } else {
                grouped_len(&recvs, t.peer)
            };
            let tag = Tag {
                seq: t.seq,
                fp: if ctx.fingerprint == 0 {
                    0
                } else {
                    crate::checks::p2p_fingerprint(
                        ctx.epoch,
                        t.seq,
                        nth,
                        t.buf.dtype(),
                        t.buf.len_bytes(),
                    )
                },
            };
            if t.send {
                push_grouped(&mut sends, t.peer, (FrameKind::Data, tag, t.buf.as_bytes()));
            } else {
                push_grouped(
                    &mut recvs,
                    t.peer,
                    (FrameKind::Data, tag, RecvInto::Exact(t.buf.as_bytes_mut())),
                );
            }
        }
        if sends.is_empty() && recvs.is_empty() {
            return Ok(());
        }
        run_links(
            &mut self.links,
            ctx,
            FrameClass::P2P,
            &mut sends,
            &mut recvs,
        )
        .await
    }

    /// The header exchange, with this rank's data for each peer in the
    /// same frame when `data`'s op is fused ([`fused`]).
    async fn exchange(
        &mut self,
        ctx: &OpCtx,
        outgoing: &[(usize, u64, Vec<u8>)],
        data: Option<&OpData>,
    ) -> Result<Vec<(usize, Vec<u8>)>> {
        let bytes: usize = outgoing.iter().map(|o| o.2.len()).sum();
        let span = tracing::debug_span!("cpu_headers", comm = %ctx.comm, rank = ctx.rank, op = ctx.kind.name(), seq = ctx.seq, bytes, peers = outgoing.len());
        // FU-3: whatever an earlier op left is dropped, used or not.
        self.carried = None;
        self.enter(ctx)?;
        let r = self
            .exchange_inner(ctx, outgoing, data)
            .instrument(span)
            .await;
        let r = r.map(|(received, carried)| {
            self.carried = Some(carried);
            received
        });
        self.leave(&r.as_ref().map(|_| ()).map_err(Clone::clone));
        r
    }

    async fn exchange_inner(
        &mut self,
        ctx: &OpCtx,
        outgoing: &[(usize, u64, Vec<u8>)],
        data: Option<&OpData>,
    ) -> Result<(Vec<(usize, Vec<u8>)>, Carried)> {
        let class = class_of(ctx);
        let plan = data.and_then(|d| fused::plan(self.rank, self.size, d));
        let k = outgoing.len();
        if self.out_frames.len() < k {
            self.out_frames.resize_with(k, Vec::new);
        }
        if self.in_frames.len() < k {
            self.in_frames.resize_with(k, Vec::new);
        }
        for (i, (peer, _, header)) in outgoing.iter().enumerate() {
            if *peer >= self.size {
                return Err(Error::Internal(format!(
                    "header for rank {peer} on a communicator of {}",
                    self.size
                )));
            }
            let parts = plan
                .as_ref()
                .and_then(|p| p.send.get(*peer))
                .and_then(Option::as_ref)
                .map_or(&[][..], |v| &v[..]);
            fused::encode_frame(&mut self.out_frames[i], header, parts, plan.is_some())
                .map_err(|w| Error::Internal(format!("header frame for rank {peer}: {w}")))?;
        }
        // FU-2: the largest header frame plus the largest data part.
        let bound = MAX_HEADER_FRAME + (fused::PREFIX + 8 + fused::FUSE_PEER_MAX) as u64;
        let mut sends = Sends::new();
        let mut recvs = Recvs::new();
        for (((peer, seq, _), out), slot) in outgoing
            .iter()
            .zip(self.out_frames.iter())
            .zip(self.in_frames.iter_mut())
        {
            if *peer == self.rank {
                // A header to oneself comes straight back.
                slot.clone_from(out);
                continue;
            }
            push_grouped(
                &mut sends,
                *peer,
                (FrameKind::Header, Tag::seq(*seq), &out[..]),
            );
            push_grouped(
                &mut recvs,
                *peer,
                (
                    FrameKind::Header,
                    Tag::seq(*seq),
                    RecvInto::Bounded(slot, bound),
                ),
            );
        }
        run_links(&mut self.links, ctx, class, &mut sends, &mut recvs).await?;
        drop((sends, recvs));
        let mut received = Vec::with_capacity(k);
        let mut peers = Vec::with_capacity(k);
        for ((peer, seq, _), frame) in outgoing.iter().zip(&self.in_frames) {
            let sp = fused::split_frame(frame).map_err(|w| {
                ctx.peer_failed(
                    vec![*peer],
                    format!("rank {peer} sent a malformed header frame: {w}"),
                )
            })?;
            received.push((*peer, frame[sp.header.clone()].to_vec()));
            peers.push((*peer, *seq, sp));
        }
        let carried = Carried {
            kind: ctx.kind,
            seq: ctx.seq,
            plan: plan.map(|p| {
                (
                    p.recv.into_vec(),
                    p.send.iter().map(Option::is_some).collect(),
                )
            }),
            peers,
        };
        Ok((received, carried))
    }

    /// Use the data that came with this op's headers, now that the check
    /// passed ([FU-3]): check its lengths against this rank's own plan
    /// ([FU-5]) and combine it ([FU-4]).
    ///
    /// [FU-3]: self::fused#invariants
    /// [FU-4]: self::fused#invariants
    /// [FU-5]: self::fused#invariants
    fn use_carried(&mut self, ctx: &OpCtx, c: Carried, data: &mut OpData) -> Result<AfterCarried> {
        let (rank, size) = (self.rank, self.size);
        // FU-1: an op chosen per rank runs fused only if every rank chose it;
        // otherwise every rank drops the data and runs the algorithm.
        let peer_flags = c
            .peers
            .iter()
            .filter(|(p, _, _)| *p != rank)
            .map(|(_, _, sp)| sp.fused);
        if !fused::all_chose(data, c.plan.is_some(), peer_flags) {
            return Ok(AfterCarried::Unfused);
        }
        let (recv, sent): (Option<Vec<Option<usize>>>, Vec<bool>) = match c.plan {
            Some((recv, sent)) => (Some(recv), sent),
            None => (None, vec![false; size]),
        };
        let mut got: Vec<&[u8]> = vec![&[]; size];
        let mut fused_recv = vec![false; size];
        for ((peer, _, sp), frame) in c.peers.iter().zip(&self.in_frames) {
            if *peer == rank || *peer >= size {
                continue;
            }
            let d = &sp.data;
            let want = recv.as_ref().and_then(|r| r[*peer]);
            if d.len() != want.unwrap_or(0) {
                return Err(ctx.mismatch(format!(
                    "rank {peer} sent {} data bytes with its header, but this rank expects {}; \
                     the ranks do not run the same version or settings (CHORUS_FUSED)",
                    d.len(),
                    want.unwrap_or(0)
                )));
            }
            fused_recv[*peer] = want.is_some();
            got[*peer] = frame.get(d.clone()).unwrap_or(&[]);
        }
        let Some(recv) = recv else {
            return Ok(AfterCarried::Unfused);
        };
        if let OpData::P2P { ops } = data {
            // Each fused direction's data, split over its receives in order.
            let mut at = vec![0usize; size];
            for t in ops.iter_mut().filter(|t| !t.send && fused_recv[t.peer]) {
                let n = t.buf.len_bytes();
                let from = got[t.peer].get(at[t.peer]..at[t.peer] + n).ok_or_else(|| {
                    Error::Internal(format!("fused p2p data from rank {} ran short", t.peer))
                })?;
                t.buf.as_bytes_mut().copy_from_slice(from);
                at[t.peer] += n;
            }
            let recv_done = (0..size).map(|p| recv[p].is_some()).collect();
            return Ok(AfterCarried::P2P(sent, recv_done));
        }
        fused::apply(rank, size, data, &got, &mut self.fuse_scratch)?;
        Ok(AfterCarried::Done)
    }

    fn op_buffers<'d>(&self, data: &'d mut OpData) -> Result<Option<Planned<'d>>> {
        let (rank, size) = (self.rank, self.size);
        let p = match data {
            OpData::AllToAllList { .. } => {
                return Err(Error::Internal(
                    "a list all_to_all runs as all_to_all, not as a schedule".into(),
                ))
            }
            OpData::AllReduce { buf, op } => Planned {
                schedule: match &self.topo {
                    _ if !small_all_reduce_enabled() => builders::all_reduce(rank, size, buf.len()),
                    Some(t) => hier::all_reduce(rank, t, buf.len(), buf.dtype().size()),
                    None => builders::all_reduce_auto(rank, size, buf.len(), buf.dtype().size()),
                },
                src: None,
                dst: buf,
                op: *op,
                copy_out: None,
                scratch: None,
            },
            OpData::Reduce { buf, op, root } => Planned {
                schedule: match &self.topo {
                    Some(t) => hier::reduce(rank, t, buf.len(), *root, buf.dtype().size()),
                    None => builders::reduce_auto(rank, size, buf.len(), *root, buf.dtype().size()),
                },
                src: None,
                dst: buf,
                op: *op,
                copy_out: None,
                scratch: None,
            },
            OpData::ReduceScatter {
                input,
                output,
                counts,
                op,
            } => {
                if counts.len() != size {
                    return Err(Error::Internal(format!(
                        "reduce_scatter with {} split sizes for {size} ranks",
                        counts.len()
                    )));
                }
                let o = builders::offsets(counts);
                Planned {
                    schedule: match &self.topo {
                        Some(t) => hier::reduce_scatter(rank, t, counts),
                        None => builders::reduce_scatter(rank, size, counts),
                    },
                    src: None,
                    dst: input,
                    op: *op,
                    copy_out: Some((o[rank]..o[rank + 1], output)),
                    scratch: None,
                }
            }
            OpData::AllGather {
                input,
                output,
                counts,
                in_place,
            } => {
                if counts.len() != size {
                    return Err(Error::Internal(format!(
                        "all_gather with {} split sizes for {size} ranks",
                        counts.len()
                    )));
                }
                let es = output.dtype().size();
                Planned {
                    schedule: match &self.topo {
                        Some(t) => hier::all_gather(rank, t, counts, *in_place, es),
                        None => builders::all_gather_auto(rank, size, counts, *in_place, es),
                    },
                    src: (!*in_place).then_some(input),
                    dst: output,
                    op: ReduceOp::Sum,
                    copy_out: None,
                    scratch: None,
                }
            }
            OpData::Broadcast { buf, root } => Planned {
                schedule: match &self.topo {
                    Some(t) => hier::broadcast(rank, t, buf.len(), *root),
                    None => builders::broadcast(rank, size, buf.len(), *root),
                },
                src: None,
                dst: buf,
                op: ReduceOp::Sum,
                copy_out: None,
                scratch: None,
            },
            OpData::Scatter {
                input,
                output,
                root,
            } => {
                let es = output.dtype().size();
                let (schedule, n) = match &self.topo {
                    Some(t) => hier::scatter(rank, t, output.len(), *root, es),
                    None => builders::scatter_auto(rank, size, output.len(), *root, es),
                };
                Planned {
                    schedule,
                    src: Some(input),
                    dst: output,
                    op: ReduceOp::Sum,
                    copy_out: None,
                    scratch: (n > 0).then_some((BufId::Src, n)),
                }
            }
            OpData::Gather {
                input,
                output,
                root,
            } => {
                let es = input.dtype().size();
                let (schedule, n) = match &self.topo {
                    Some(t) => hier::gather(rank, t, input.len(), *root, es),
                    None => builders::gather_auto(rank, size, input.len(), *root, es),
                };
                Planned {
                    schedule,
                    src: Some(input),
                    dst: output,
                    op: ReduceOp::Sum,
                    copy_out: None,
                    scratch: (n > 0).then_some((BufId::Dst, n)),
                }
            }
            OpData::AllToAll {
                input,
                output,
                send_counts,
                recv_counts,
            } => {
                if send_counts.len() != size || recv_counts.len() != size {
                    return Err(Error::Internal(format!(
                        "all_to_all with {}/{} split sizes for {size} ranks",
                        send_counts.len(),
                        recv_counts.len()
                    )));
                }
                Planned {
                    schedule: builders::all_to_all(rank, size, send_counts, recv_counts),
                    src: Some(input),
                    dst: output,
                    op: ReduceOp::Sum,
                    copy_out: None,
                    scratch: None,
                }
            }
            OpData::Barrier | OpData::P2P { .. } => return Ok(None),
        };
        Ok(Some(p))
    }
}

/// Whether the small-message all-reduce of the tuning table is used
/// (`CHORUS_SMALL_ALLREDUCE=0` forces the ring, for A/B measurements).
fn small_all_reduce_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("CHORUS_SMALL_ALLREDUCE").map_or(true, |v| v != "0"))
}

/// Whether collectives run hierarchically on a communicator that spans
/// several hosts: `CHORUS_HIER` unset or `1` (the default), `0` for flat
/// schedules everywhere (for A/B measurements).
///
/// # Errors
/// `Config` for any other value.
fn hier_from_env() -> Result<bool> {
    match std::env::var("CHORUS_HIER") {
        Err(_) => Ok(true),
        Ok(v) => match v.trim() {
            "" | "1" => Ok(true),
            "0" => Ok(false),
            other => Err(Error::Config(format!(
                "CHORUS_HIER must be 0 or 1, not {other:?}"
            ))),
        },
    }
}

/// The buffers and schedule of one collective.
struct Planned<'d> {
    schedule: Schedule,
    src: Option<&'d mut Tensor>,
    dst: &'d mut Tensor,
    op: ReduceOp,
    /// For reduce_scatter: copy this element range of `dst` into the tensor.
    copy_out: Option<(Range<usize>, &'d mut Tensor)>,
    /// For a tree gather or scatter on an inner rank: the schedule runs on a
    /// scratch buffer of this many elements in place of `Src` or `Dst`
    /// ([`builders::tree_scratch`]).
    scratch: Option<(BufId, usize)>,
}

/// Whether `c` came with the headers of the op `ctx`/`data` (the one whose
/// headers were exchanged last; for point-to-point, every transfer's
/// per-peer seq).
fn carried_for(c: &Carried, ctx: &OpCtx, data: &OpData) -> bool {
    if c.kind != ctx.kind || c.seq != ctx.seq {
        return false;
    }
    match data {
        OpData::P2P { ops } => ops
            .iter()
            .all(|t| c.peers.iter().any(|(p, s, _)| *p == t.peer && *s == t.seq)),
        _ => true,
    }
}

fn class_of(ctx: &OpCtx) -> FrameClass {
    if ctx.kind == OpKind::P2P {
        FrameClass::P2P
    } else {
        FrameClass::Collective
    }
}

/// How many items the list of `peer` holds so far.
fn grouped_len<B: smallvec::Array>(groups: &[(usize, SmallVec<B>)], peer: usize) -> usize {
    groups
        .iter()
        .find(|(p, _)| *p == peer)
        .map_or(0, |(_, v)| v.len())
}

/// Append `item` to the list of `peer`, keeping first-seen peer order.
fn push_grouped<A, B>(groups: &mut SmallVec<A>, peer: usize, item: B::Item)
where
    A: smallvec::Array<Item = (usize, SmallVec<B>)>,
    B: smallvec::Array,
{
    match groups.iter_mut().find(|(p, _)| *p == peer) {
        Some((_, v)) => v.push(item),
        None => groups.push((peer, smallvec::smallvec![item])),
    }
}

/// The frames of a fused plan's direct algorithm: each non-empty slice of
/// `plan` one Data frame to its peer, and each expected payload received
/// into that peer's slot of `slots` (resized to it).
fn direct_frames<'a>(
    plan: &fused::Plan<'a>,
    slots: &'a mut [Vec<u8>],
    tag: Tag,
) -> (Sends<'a>, Recvs<'a>) {
    let mut sends = Sends::new();
    for (peer, parts) in plan.send.iter().enumerate() {
        for part in parts.iter().flatten().filter(|p| !p.is_empty()) {
            push_grouped(&mut sends, peer, (FrameKind::Data, tag, *part));
        }
    }
    let mut recvs = Recvs::new();
    for (peer, slot) in slots.iter_mut().enumerate() {
        slot.clear();
        if let Some(len) = plan.recv.get(peer).copied().flatten().filter(|&l| l > 0) {
            slot.resize(len, 0);
            recvs.push((
                peer,
                smallvec::smallvec![(FrameKind::Data, tag, RecvInto::Exact(&mut slot[..]))],
            ));
        }
    }
    (sends, recvs)
}

/// This rank's open links by peer, and the pool that opens the others when
/// an op first needs them (`link::pool`). O(N) slots per rank; an op whose
/// links are open checks them in O(its peers), with no allocation.
#[derive(Debug)]
struct Links {
    rank: usize,
    size: usize,
    writers: Vec<Option<LinkWriter>>,
    readers: Vec<Option<LinkReader>>,
    /// Shared-memory rings of same-host peers (their TCP link then only
    /// carries Abort frames and liveness).
    shm: Vec<Option<ShmLink>>,
    /// Same-host peers without rings, and why (shared with
    /// [`Backend::tcp_fallbacks`]' readers).
    fallbacks: super::TcpFallbacks,
    pool: link::Pool,
    checksum: bool,
    /// The job vectors of shared-memory steps, reused from step to step.
    scratch: shm_exec::ShmScratch,
    /// More ranks of this communicator on this host than CPUs (SX-5).
    oversubscribed: bool,
}

impl Links {
    /// Open the links to `peers` that are not open yet (ranks out of range
    /// and this rank's own are skipped; the transfers report them).
    async fn ensure(&mut self, peers: impl Iterator<Item = usize> + Clone) -> Result<()> {
        let (rank, size) = (self.rank, self.size);
        let wanted = move |p: &usize| *p < size && *p != rank;
        if peers
            .clone()
            .filter(wanted)
            .all(|p| self.writers[p].is_some())
        {
            return Ok(());
        }
        let (pool, install) = self.split();
        // Boxed: opening links is rare and slow, and its state would
        // otherwise weigh on every op's future.
        Box::pin(pool.ensure(peers.filter(wanted), install)).await
    }

    /// Open every link now (the eager policy).
    async fn open_all(&mut self) -> Result<()> {
        let (pool, install) = self.split();
        pool.open_all(install).await
    }

    /// Stop opening links and take every open one, including those that
    /// opened but no op took yet (so that an abort reaches their peers).
    fn take_all(&mut self) -> (Vec<LinkWriter>, Vec<LinkReader>) {
        {
            let (pool, mut install) = self.split();
            for (p, l) in pool.close() {
                install(p, l);
            }
        }
        (
            self.writers.iter_mut().filter_map(Option::take).collect(),
            self.readers.iter_mut().filter_map(Option::take).collect(),
        )
    }

    /// The pool, and what puts a link it opened in its place among the
    /// other fields.
    fn split(&mut self) -> (&link::Pool, impl FnMut(usize, link::pool::Link) + '_) {
        let Links {
            writers,
            readers,
            shm,
            fallbacks,
            pool,
            checksum,
            ..
        } = self;
        let checksum = *checksum;
        let install = move |p: usize, l: link::pool::Link| {
            writers[p] = Some(l.writer);
            readers[p] = Some(l.reader);
            match l.rings {
                Some(Ok((tx, rx))) => shm[p] = Some(ShmLink { tx, rx, checksum }),
                Some(Err(f)) => fallbacks
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .push(f),
                None => {}
            }
        };
        (&*pool, install)
    }
}

/// Run per-peer send and receive lists: shared-memory peers through the
/// ring engine ([`shm_exec::run_shm`]), the others over TCP
/// ([`run_transfers`]), both at once.
///
/// The lists are emptied (taken by the step); the caller keeps them, so
/// that this future holds only their addresses.
async fn run_links<'a>(
    links: &'a mut Links,
    ctx: &'a OpCtx,
    class: FrameClass,
    sends: &mut Sends<'a>,
    recvs: &mut Recvs<'a>,
) -> Result<()> {
    links
        .ensure(
            sends
                .iter()
                .map(|(p, _)| *p)
                .chain(recvs.iter().map(|(p, _)| *p)),
        )
        .await?;
    let is_shm = |p: usize| links.shm.get(p).is_some_and(Option::is_some);
    // The common step, every peer on this host: no sorting into kinds of
    // link, and each reader looked up by rank when needed.
    if sends.iter().all(|(p, _)| is_shm(*p)) && recvs.iter().all(|(p, _)| is_shm(*p)) {
        if sends.is_empty() && recvs.is_empty() {
            return Ok(());
        }
        let Links {
            readers,
            shm,
            scratch,
            oversubscribed,
            ..
        } = links;
        let readers = shm_exec::Readers::All(&mut readers[..]);
        return shm_exec::run_shm(
            shm,
            scratch,
            *oversubscribed,
            readers,
            ctx,
            class,
            sends,
            recvs,
            ctx.may_block,
        )
        .await;
    }
    // Boxed: a step across hosts is slow enough that one allocation does
    // not count, and its state would otherwise weigh on every step's future.
    Box::pin(run_mixed(
        links,
        ctx,
        class,
        std::mem::take(sends),
        std::mem::take(recvs),
    ))
    .await
}

/// [`run_links`] for a step with some peer across hosts: the TCP transfers
/// and the shared-memory ones at once.
async fn run_mixed<'a>(
    links: &'a mut Links,
    ctx: &'a OpCtx,
    class: FrameClass,
    sends: Sends<'a>,
    recvs: Recvs<'a>,
) -> Result<()> {
    let Links {
        writers,
        readers,
        shm,
        scratch,
        oversubscribed,
        ..
    } = links;
    let shm = &shm[..];
    let is_shm = |p: usize| shm.get(p).is_some_and(Option::is_some);
    let (mut shm_sends, mut tcp_sends): (Sends<'_>, Sends<'_>) =
        sends.into_iter().partition(|(p, _)| is_shm(*p));
    let (mut shm_recvs, mut tcp_recvs): (Recvs<'_>, Recvs<'_>) =
        recvs.into_iter().partition(|(p, _)| is_shm(*p));
    // Only the step's peers' links, in O(its peers), whatever N is.
    tcp_sends.sort_unstable_by_key(|(p, _)| *p);
    tcp_recvs.sort_unstable_by_key(|(p, _)| *p);
    let mut shm_peers: Vec<usize> = shm_sends.iter().map(|(p, _)| *p).collect();
    shm_peers.extend(shm_recvs.iter().map(|(p, _)| *p));
    shm_peers.sort_unstable();
    shm_peers.dedup();
    // The readers: of the TCP receives, and of the shared-memory peers for
    // their liveness (never the same peer).
    let (n_tcp, n_shm) = (tcp_recvs.len(), shm_peers.len());
    let mut reader_peers = shm_peers;
    if n_tcp > 0 {
        reader_peers.extend(tcp_recvs.iter().map(|(p, _)| *p));
        reader_peers.sort_unstable();
    }
    let mut tcp_r = Vec::with_capacity(n_tcp);
    let mut shm_r = Vec::with_capacity(n_shm);
    for (p, r) in pick(readers, reader_peers.into_iter()) {
        if is_shm(p) {
            shm_r.push((p, r));
        } else {
            tcp_r.push((p, r));
        }
    }
    let tcp_w = pick(writers, tcp_sends.iter().map(|(p, _)| *p));
    // SX-3, TX-2: sleep in the kernel only where the turn may block
    // its thread, and when no transfer of the other kind in this step needs
    // this thread to poll it.
    if shm_sends.is_empty() && shm_recvs.is_empty() {
        // TX-2: poll before sleeping only when each rank can have a CPU.
        let spin = ctx.size <= shm_exec::cpus();
        let how = tcp_exec::Wait {
            may_block: ctx.may_block,
            spin,
        };
        return run_tcp(tcp_w, tcp_r, ctx, class, tcp_sends, tcp_recvs, how).await;
    }
    futures::future::try_join(
        run_tcp(
            tcp_w,
            tcp_r,
            ctx,
            class,
            tcp_sends,
            tcp_recvs,
            tcp_exec::Wait::default(),
        ),
        shm_exec::run_shm(
            shm,
            scratch,
            *oversubscribed,
            shm_exec::Readers::Picked(shm_r),
            ctx,
            class,
            &mut shm_sends,
            &mut shm_recvs,
            false,
        ),
    )
    .await
    .map(|_| ())
}

/// The entries of `v` at `peers`, each with its index, as disjoint
/// mutable borrows: one entry per item of `peers`, in order, `None` for an
/// index past `v`, one that repeats or one below its predecessor (the
/// callers pass ascending, distinct indices). O(peers), not O(`v.len()`):
/// a step touches only its own peers' links.
fn pick<T, I: Iterator<Item = usize>>(
    v: &mut [Option<T>],
    peers: I,
) -> Vec<(usize, Option<&mut T>)> {
    let mut out = Vec::with_capacity(peers.size_hint().0);
    let mut rest = v;
    // The index of `rest[0]`.
    let mut base = 0;
    for p in peers {
        let found = match p.checked_sub(base) {
            Some(skip) => match std::mem::take(&mut rest)
                .get_mut(skip..)
                .and_then(<[Option<T>]>::split_first_mut)
            {
                Some((first, tail)) => {
                    rest = tail;
                    base = p + 1;
                    first.as_mut()
                }
                None => None,
            },
            None => None,
        };
        out.push((p, found));
    }
    out
}

#[async_trait]
impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn tcp_fallbacks(&self) -> super::TcpFallbacks {
        self.links.fallbacks.clone()
    }

    fn capabilities(&self) -> crate::backends::Capabilities {
        crate::backends::Capabilities {
            in_place_all_gather: true,
            in_band_checks: true,
            headerless_ops: true,
            list_all_to_all: true,
            ..Default::default()
        }
    }

    fn supports_windows(&self) -> bool {
        true
    }

    /// A non-root rank of a reduce small enough for the one-step (fused)
    /// algorithm only sends its buffer.
    fn leaves_input_unchanged(&self, ctx: &OpCtx, data: &OpData) -> bool {
        match data {
            OpData::Reduce { buf, root, .. } => {
                ctx.rank != *root
                    && fused::plan(self.rank, self.size, data).is_some()
                    && !buf.is_device()
            }
            _ => false,
        }
    }

    async fn window(&mut self, ctx: &OpCtx, op: super::WindowOp) -> Result<super::WindowDone> {
        self.window_op(ctx, op).await
    }

    async fn exchange_headers(
        &mut self,
        ctx: &OpCtx,
        outgoing: Vec<(usize, u64, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>> {
        self.exchange(ctx, &outgoing, None).await
    }

    async fn exchange_headers_with_data(
        &mut self,
        ctx: &OpCtx,
        outgoing: Vec<(usize, u64, Vec<u8>)>,
        data: &OpData,
    ) -> Result<Vec<(usize, Vec<u8>)>> {
        self.exchange(ctx, &outgoing, Some(data)).await
    }

    async fn execute(&mut self, ctx: &OpCtx, data: &mut OpData) -> Result<()> {
        self.enter(ctx)?;
        let r = self.execute_inner(ctx, data).await;
        self.leave(&r);
        r
    }

    async fn abort_for(&mut self, cause: Option<&Error>, reason: &str, failed: &[usize]) {
        self.abort_mismatch |= matches!(cause, Some(Error::Mismatch { .. }));
        self.abort(reason, failed).await;
    }

    async fn abort(&mut self, reason: &str, failed: &[usize]) {
        if matches!(self.state, State::Aborted { .. } | State::Finalized) {
            return;
        }
        // LK-9: peers learn that this abort is a mismatch.
        let mismatch =
            self.abort_mismatch || matches!(self.state, State::Broken(Error::Mismatch { .. }));
        self.windows.close(false).await;
        self.state = State::Aborted {
            reason: reason.to_string(),
            failed: failed.to_vec(),
        };
        let payload = link::encode_abort(reason, failed);
        tracing::debug!(comm = %self.comm, rank = self.rank, reason, ?failed, "aborting data links");
        let payload = &payload;
        // Links that opened but no op took yet count too: their peers may
        // be waiting on them, so they hear of the abort.
        let (writers, readers) = self.links.take_all();
        futures::future::join_all(writers.into_iter().map(|mut w| async move {
            if !w.mid_frame() {
                let sent =
                    tokio::time::timeout(ABORT_BOUND, w.write_abort(payload, mismatch)).await;
                if !matches!(sent, Ok(Ok(()))) {
                    tracing::debug!(peer = w.peer(), "could not deliver the abort frame");
                }
            }
            let _ = tokio::time::timeout(ABORT_BOUND, w.shutdown()).await;
        }))
        .await;
        // Keep reading (and discarding) for a while in the background so the
        // Abort frames are not lost to a reset, then close (see LinkReader::drain).
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => {
                for r in readers {
                    rt.spawn(r.drain(ABORT_LINGER));
                }
            }
            Err(_) => drop(readers),
        }
    }

    async fn finalize(&mut self) {
        if matches!(self.state, State::Aborted { .. }) {
            return;
        }
        self.windows.close(true).await;
        self.state = State::Finalized;
        let (writers, readers) = self.links.take_all();
        futures::future::join_all(writers.into_iter().map(|mut w| async move {
            let _ = tokio::time::timeout(ABORT_BOUND, w.shutdown()).await;
        }))
        .await;
        drop(readers);
    }
}

impl CpuBackend {
    /// CPU-6: a barrier without a header exchange: the dissemination
    /// barrier's empty messages, `ceil(log2 N)` rounds, or, across hosts,
    /// the two-level rounds of [`hier::barrier_rounds`].
    async fn barrier(&mut self, ctx: &OpCtx) -> Result<()> {
        let class = class_of(ctx);
        // Across hosts the two-level rounds (a short list); on one host
        // the dissemination rounds, computed as they go: no allocation.
        let (two_level, flat) = match &self.topo {
            Some(t) => (Some(hier::barrier_rounds(self.rank, t)), None),
            None => (
                None,
                Some(
                    builders::barrier_round_iter(self.rank, self.size)
                        .map(|(to, from)| (Some(to), Some(from))),
                ),
            ),
        };
        let rounds = two_level
            .into_iter()
            .flatten()
            .chain(flat.into_iter().flatten());
        for (to, from) in rounds {
            let mut none: [u8; 0] = [];
            let mut sends = to
                .map(|to| {
                    (
                        to,
                        smallvec::smallvec![(FrameKind::Data, Tag::of(ctx), &[][..])],
                    )
                })
                .into_iter()
                .collect();
            let mut recvs = from
                .map(|from| {
                    (
                        from,
                        smallvec::smallvec![(
                            FrameKind::Data,
                            Tag::of(ctx),
                            RecvInto::Exact(&mut none[..]),
                        )],
                    )
                })
                .into_iter()
                .collect();
            run_links(&mut self.links, ctx, class, &mut sends, &mut recvs).await?;
        }
        Ok(())
    }

    /// CPU-6: a small op without a header exchange: the direct algorithm of
    /// its fused plan ([`fused`]), whose messages are exactly the plan's
    /// non-empty data parts, each one Data frame. `false` when the op has no
    /// fused plan, and runs its schedule instead.
    async fn direct(&mut self, ctx: &OpCtx, data: &mut OpData) -> Result<bool> {
        let (rank, size) = (self.rank, self.size);
        if self.in_frames.len() < size {
            self.in_frames.resize_with(size, Vec::new);
        }
        // The plan is not kept across the wait (the frames borrow the op's
        // buffers, not the plan), so the op's future does not hold its slots.
        {
            let frames = fused::plan(rank, size, data)
                .map(|plan| direct_frames(&plan, &mut self.in_frames[..size], Tag::of(ctx)));
            let Some((mut sends, mut recvs)) = frames else {
                return Ok(false);
            };
            run_links(&mut self.links, ctx, class_of(ctx), &mut sends, &mut recvs).await?;
        }
        let got: SmallVec<[&[u8]; fused::FUSE_MAX_RANKS]> =
            self.in_frames.iter().take(size).map(|f| &f[..]).collect();
        fused::apply(rank, size, data, &got, &mut self.fuse_scratch)?;
        Ok(true)
    }

    async fn execute_inner(&mut self, ctx: &OpCtx, data: &mut OpData) -> Result<()> {
        let mut p2p_done = None;
        match self.carried.take().filter(|c| carried_for(c, ctx, data)) {
            Some(c) => match self.use_carried(ctx, c, data)? {
                AfterCarried::Done => return Ok(()),
                AfterCarried::Unfused => {}
                AfterCarried::P2P(s, r) => p2p_done = Some((s, r)),
            },
            // A world of one: the ops that work in place on one buffer
            // have nothing to move (`Avg` and `PremulSum` are applied
            // above the backend).
            None if self.size == 1
                && matches!(
                    data,
                    OpData::AllReduce { .. }
                        | OpData::Broadcast { .. }
                        | OpData::Reduce { .. }
                        | OpData::Barrier
                ) =>
            {
                return Ok(())
            }
            // CPU-6: no header exchange ran for this op.
            None => match data {
                OpData::Barrier => return self.barrier(ctx).await,
                OpData::AllToAll { .. } | OpData::AllToAllList { .. } => {
                    return self.all_to_all(ctx, data).await
                }
                OpData::P2P { .. } => {}
                _ => {
                    if self.direct(ctx, data).await? {
                        return Ok(());
                    }
                }
            },
        }
        if let OpData::AllToAllList { .. } = data {
            // After a header exchange (strict checks): the same exchange.
            return self.all_to_all(ctx, data).await;
        }
        if let OpData::P2P { ops } = data {
            let bytes: usize = ops.iter().map(|t| t.buf.len_bytes()).sum();
            let span = crate::hot_span!(DEBUG, "cpu_op", comm = %ctx.comm, rank = ctx.rank, op = "p2p", transfers = ops.len(), bytes);
            return self.p2p_inner(ctx, ops, p2p_done).instrument(span).await;
        }
        let Some(plan) = self.op_buffers(data)? else {
            return Ok(()); // Barrier: the header exchange already synchronised.
        };
        // Boxed: a scheduled op is large enough that one allocation does
        // not count, and its state would otherwise make every op's future,
        // a small op's included, as big as its own.
        Box::pin(self.run_planned(ctx, plan)).await
    }

    /// Run a collective's schedule on its buffers.
    async fn run_planned(&mut self, ctx: &OpCtx, plan: Planned<'_>) -> Result<()> {
        let Planned {
            schedule,
            src,
            dst,
            op,
            copy_out,
            scratch,
        } = plan;
        // An inner rank of a tree gather or scatter forwards its subtree's
        // blocks through scratch, of the dtype of the buffer it stands in for.
        let mut tmp = scratch.map(|(which, n)| {
            let dtype = match (which, &src) {
                (BufId::Src, _) | (BufId::Dst, None) => dst.dtype(),
                (BufId::Dst, Some(s)) => s.dtype(),
            };
            (which, Tensor::zeros(dtype, n))
        });
        let (src, dst) = match &mut tmp {
            Some((BufId::Src, t)) => (Some(t), dst),
            Some((BufId::Dst, t)) => (src, t),
            None => (src, dst),
        };
        let bytes = dst.len_bytes();
        let span = crate::hot_span!(DEBUG, "cpu_op", comm = %ctx.comm, rank = ctx.rank, op = ctx.kind.name(), seq = ctx.seq, bytes, steps = schedule.steps.len());
        self.schedule_inner(ctx, &schedule, src, dst, op)
            .instrument(span)
            .await?;
        if let Some((range, out)) = copy_out {
            let es = dst.dtype().size();
            let from = dst
                .as_bytes()
                .get(range.start * es..range.end * es)
                .filter(|b| b.len() == out.len_bytes())
                .ok_or_else(|| {
                    Error::Internal(format!(
                        "reduce_scatter output holds {} elements, block is {range:?}",
                        out.len()
                    ))
                })?;
            out.as_bytes_mut().copy_from_slice(from);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::pick;

    #[test]
    fn pick_borrows_exactly_the_named_entries_and_flags_bad_indices() {
        let mut v: Vec<Option<u32>> = vec![Some(0), None, Some(2), Some(3), Some(4)];
        let got: Vec<(usize, Option<u32>)> = pick(&mut v, [0, 1, 3, 3, 2, 9].into_iter())
            .into_iter()
            .map(|(p, r)| (p, r.map(|x| *x)))
            .collect();
        // 1 holds no link; the repeated 3, the 2 after it and 9 past the end are None.
        assert_eq!(
            got,
            vec![
                (0, Some(0)),
                (1, None),
                (3, Some(3)),
                (3, None),
                (2, None),
                (9, None)
            ]
        );
        for (_, r) in pick(&mut v, [2, 4].into_iter()) {
            if let Some(x) = r {
                *x += 10;
            }
        }
        assert_eq!(v, vec![Some(0), None, Some(12), Some(3), Some(14)]);
        assert!(pick(&mut v, std::iter::empty()).is_empty());
    }
}
