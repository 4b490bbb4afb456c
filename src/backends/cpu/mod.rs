//! The `cpu` backend: Chorus's own data plane, built in and the default.
//!
//! Every pair of ranks shares one authenticated TCP link (see [`link`] for
//! setup and the frame format). A collective is turned into a sans-IO
//! [`Schedule`] by the builders in [`schedule`]; this module only executes
//! schedules: per step, every send and every receive runs concurrently (each
//! link is split into a read and a write half, so a rank can write to one peer
//! while reading from another, or from the same one), then the received blocks
//! are applied in order (copy, or [`reduce::reduce_into`]) together with local
//! copies. Point-to-point batches run every transfer concurrently across
//! peers, in order per (peer, direction).
//!
//! Invariants:
//! - CPU-1: a schedule step runs per SC-1/SC-2: sends read the buffers as they
//!   were before the step; receives land in scratch memory and are applied
//!   after every transfer of the step completed.
//! - CPU-2: any error of an op is fatal for the links: the next
//!   `exchange_headers`/`execute` fails with `Aborted` until `abort` runs
//!   (BE-2). An op whose future was dropped mid-transfer counts as failed.
//! - CPU-3: when an op fails, sends already in flight get a short bounded
//!   time to finish their frame before the error is returned, so that the
//!   Abort frame sent by `abort` is read by peers as an Abort, not as payload
//!   (LK-4); a link left mid-frame is closed without an Abort frame.
//! - CPU-4: after `abort` every call returns `Aborted` immediately, and after
//!   `finalize` every call returns `Finalized`; both are idempotent and
//!   bounded in time. Nothing here panics on peer input or in `Drop`.

use std::future::Future;
use std::ops::Range;
use std::pin::Pin;
use std::time::Duration;

use async_trait::async_trait;
use futures::stream::{FuturesUnordered, StreamExt};
use tracing::Instrument;

use super::{Backend, BackendInit, OpCtx, OpData, P2PTransfer};
use crate::error::{Error, Result};
use crate::op::{OpKind, ReduceOp};
use crate::tensor::Tensor;

mod link;
pub mod reduce;
pub mod schedule;

use link::{FrameClass, FrameKind, LinkReader, LinkWriter, RecvInto, MAX_HEADER_FRAME};
use schedule as builders;
use schedule::{BufId, RecvAction, Schedule, Transfer};

/// How long `abort` waits for each peer to take its Abort frame.
const ABORT_BOUND: Duration = Duration::from_secs(1);
/// How long a failed op lets its in-flight sends finish (CPU-3).
const DRAIN_BOUND: Duration = Duration::from_secs(1);

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
    writers: Vec<Option<LinkWriter>>,
    readers: Vec<Option<LinkReader>>,
    /// Reusable receive buffers for schedule steps.
    scratch: Vec<Vec<u8>>,
    state: State,
}

type SendFrames<'a> = Vec<(FrameKind, u64, &'a [u8])>;
type RecvFrames<'a> = Vec<(FrameKind, u64, RecvInto<'a>)>;
type BoxFut<'a> = Pin<Box<dyn Future<Output = Result<()>> + Send + 'a>>;

impl CpuBackend {
    /// Connect to every peer through the store (see [`link`] for the
    /// handshake).
    ///
    /// # Errors
    /// `PeerFailed` naming the ranks that did not connect within
    /// `init.connect_timeout`; `Transport` if the store fails or times out,
    /// or if a peer could not prove the job secret to this rank.
    pub async fn connect(init: BackendInit) -> Result<CpuBackend> {
        let span = tracing::debug_span!("cpu_connect", comm = %init.comm, rank = init.rank, size = init.size, epoch = init.epoch);
        let streams = link::connect_mesh(&init).instrument(span).await?;
        let mut writers = Vec::with_capacity(init.size);
        let mut readers = Vec::with_capacity(init.size);
        for (peer, s) in streams.into_iter().enumerate() {
            match s {
                Some(stream) => {
                    let (r, w) = link::split_link(peer, init.epoch, stream);
                    readers.push(Some(r));
                    writers.push(Some(w));
                }
                None => {
                    readers.push(None);
                    writers.push(None);
                }
            }
        }
        Ok(CpuBackend {
            comm: init.comm,
            rank: init.rank,
            size: init.size,
            epoch: init.epoch,
            writers,
            readers,
            scratch: Vec::new(),
            state: State::Ready,
        })
    }

    /// Run one hand-built [`Schedule`] over the links (what `execute` does
    /// after choosing the schedule). `src` is the schedule's `Src` buffer; when
    /// `None`, `Src` refers to `dst`. `op` combines `Reduce` receives.
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
        let span = tracing::debug_span!("cpu_op", comm = %ctx.comm, rank = ctx.rank, op = ctx.kind.name(), seq = ctx.seq, bytes);
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
        mut src: Option<&mut Tensor>,
        dst: &mut Tensor,
        op: ReduceOp,
    ) -> Result<()> {
        let dtype = dst.dtype();
        let es = dtype.size();
        let class = class_of(ctx);
        let combine = op.combine_op();
        let bad = |what: String| {
            Error::Internal(format!(
                "cpu schedule for {} #{} on rank {}: {what}",
                ctx.kind.name(),
                ctx.seq,
                ctx.rank
            ))
        };
        let byte_range = |r: &Range<usize>| -> Result<Range<usize>> {
            match (r.start.checked_mul(es), r.end.checked_mul(es)) {
                (Some(a), Some(b)) if a <= b => Ok(a..b),
                _ => Err(bad(format!("invalid element range {r:?}"))),
            }
        };
        for (step_no, step) in schedule.steps.iter().enumerate() {
            // Validate peers and count receives.
            let mut n_recv = 0;
            for t in &step.transfers {
                match t {
                    Transfer::Send { peer, .. } | Transfer::Recv { peer, .. } => {
                        if *peer >= self.size || *peer == self.rank {
                            return Err(bad(format!("step {step_no} names peer {peer}")));
                        }
                        if matches!(t, Transfer::Recv { .. }) {
                            n_recv += 1;
                        }
                    }
                    Transfer::LocalCopy { .. } => {}
                }
            }
            if self.scratch.len() < n_recv {
                self.scratch.resize_with(n_recv, Vec::new);
            }
            // Transfers: sends read the buffers as before the step (CPU-1).
            {
                let dst_bytes: &[u8] = dst.as_bytes();
                let src_bytes: &[u8] = match src.as_deref() {
                    Some(s) => s.as_bytes(),
                    None => dst_bytes,
                };
                let mut sends: Vec<(usize, SendFrames<'_>)> = Vec::new();
                let mut recvs: Vec<(usize, RecvFrames<'_>)> = Vec::new();
                let mut scratch = self.scratch.iter_mut();
                for t in &step.transfers {
                    match t {
                        Transfer::Send { peer, buf, range } => {
                            let bytes = match buf {
                                BufId::Src => src_bytes,
                                BufId::Dst => dst_bytes,
                            };
                            let br = byte_range(range)?;
                            let payload = bytes.get(br).ok_or_else(|| {
                                bad(format!("send range {range:?} outside {buf:?}"))
                            })?;
                            push_grouped(&mut sends, *peer, (FrameKind::Data, ctx.seq, payload));
                        }
                        Transfer::Recv { peer, range, .. } => {
                            let n = byte_range(range)?.len();
                            let Some(s) = scratch.next() else {
                                return Err(bad("scratch buffers exhausted".into()));
                            };
                            s.resize(n, 0);
                            push_grouped(
                                &mut recvs,
                                *peer,
                                (FrameKind::Data, ctx.seq, RecvInto::Exact(&mut s[..n])),
                            );
                        }
                        Transfer::LocalCopy { .. } => {}
                    }
                }
                run_transfers(
                    &mut self.writers,
                    &mut self.readers,
                    ctx,
                    class,
                    sends,
                    recvs,
                )
                .await?;
            }
            // Apply receives and local copies in order (CPU-1, SC-2).
            let mut k = 0;
            for t in &step.transfers {
                match t {
                    Transfer::Send { .. } => {}
                    Transfer::Recv {
                        peer,
                        buf,
                        range,
                        action,
                    } => {
                        let data = &self.scratch[k];
                        k += 1;
                        let br = byte_range(range)?;
                        let target = match (buf, src.as_deref_mut()) {
                            (BufId::Src, Some(s)) => s.as_bytes_mut(),
                            _ => dst.as_bytes_mut(),
                        };
                        let target = target.get_mut(br).ok_or_else(|| {
                            bad(format!(
                                "receive range {range:?} from rank {peer} outside {buf:?}"
                            ))
                        })?;
                        match action {
                            RecvAction::Copy => target.copy_from_slice(data),
                            RecvAction::Reduce => {
                                reduce::reduce_into(dtype, combine, target, data)?
                            }
                        }
                    }
                    Transfer::LocalCopy { src: sr, dst: dr } => {
                        let (sb, db) = (byte_range(sr)?, byte_range(dr)?);
                        if sb.len() != db.len() {
                            return Err(bad(format!("local copy {sr:?} -> {dr:?} changes length")));
                        }
                        match src.as_deref() {
                            Some(s) => {
                                let from = s.as_bytes().get(sb).ok_or_else(|| {
                                    bad(format!("local copy source {sr:?} outside Src"))
                                })?;
                                let to = dst.as_bytes_mut().get_mut(db).ok_or_else(|| {
                                    bad(format!("local copy target {dr:?} outside Dst"))
                                })?;
                                to.copy_from_slice(from);
                            }
                            None => {
                                let d = dst.as_bytes_mut();
                                if sb.end > d.len() || db.end > d.len() {
                                    return Err(bad(format!(
                                        "local copy {sr:?} -> {dr:?} outside Dst"
                                    )));
                                }
                                d.copy_within(sb, db.start);
                            }
                        }
                    }
                }
            }
        }
        Ok(())
    }

    async fn p2p_inner(&mut self, ctx: &OpCtx, ops: &mut [P2PTransfer]) -> Result<()> {
        let mut sends: Vec<(usize, SendFrames<'_>)> = Vec::new();
        let mut recvs: Vec<(usize, RecvFrames<'_>)> = Vec::new();
        for t in ops.iter_mut() {
            if t.peer >= self.size || t.peer == self.rank {
                return Err(Error::Internal(format!(
                    "p2p transfer with rank {} on rank {} of {}",
                    t.peer, self.rank, self.size
                )));
            }
            if t.send {
                push_grouped(
                    &mut sends,
                    t.peer,
                    (FrameKind::Data, t.seq, t.buf.as_bytes()),
                );
            } else {
                push_grouped(
                    &mut recvs,
                    t.peer,
                    (
                        FrameKind::Data,
                        t.seq,
                        RecvInto::Exact(t.buf.as_bytes_mut()),
                    ),
                );
            }
        }
        run_transfers(
            &mut self.writers,
            &mut self.readers,
            ctx,
            FrameClass::P2P,
            sends,
            recvs,
        )
        .await
    }

    async fn exchange_inner(
        &mut self,
        ctx: &OpCtx,
        outgoing: &[(usize, u64, Vec<u8>)],
        received: &mut [Vec<u8>],
    ) -> Result<()> {
        let class = class_of(ctx);
        let mut sends: Vec<(usize, SendFrames<'_>)> = Vec::new();
        let mut recvs: Vec<(usize, RecvFrames<'_>)> = Vec::new();
        for ((peer, seq, bytes), slot) in outgoing.iter().zip(received.iter_mut()) {
            if *peer >= self.size {
                return Err(Error::Internal(format!(
                    "header for rank {peer} on a communicator of {}",
                    self.size
                )));
            }
            if *peer == self.rank {
                // A header to oneself comes straight back.
                slot.clone_from(bytes);
                continue;
            }
            push_grouped(&mut sends, *peer, (FrameKind::Header, *seq, &bytes[..]));
            push_grouped(
                &mut recvs,
                *peer,
                (
                    FrameKind::Header,
                    *seq,
                    RecvInto::Bounded(slot, MAX_HEADER_FRAME),
                ),
            );
        }
        run_transfers(
            &mut self.writers,
            &mut self.readers,
            ctx,
            class,
            sends,
            recvs,
        )
        .await
    }

    fn op_buffers<'d>(&self, data: &'d mut OpData) -> Result<Option<Planned<'d>>> {
        let (rank, size) = (self.rank, self.size);
        let p = match data {
            OpData::AllReduce { buf, op } => Planned {
                schedule: builders::all_reduce(rank, size, buf.len()),
                src: None,
                dst: buf,
                op: *op,
                copy_out: None,
            },
            OpData::Reduce { buf, op, root } => Planned {
                schedule: builders::reduce(rank, size, buf.len(), *root),
                src: None,
                dst: buf,
                op: *op,
                copy_out: None,
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
                    schedule: builders::reduce_scatter(rank, size, counts),
                    src: None,
                    dst: input,
                    op: *op,
                    copy_out: Some((o[rank]..o[rank + 1], output)),
                }
            }
            OpData::AllGather {
                input,
                output,
                counts,
            } => {
                if counts.len() != size {
                    return Err(Error::Internal(format!(
                        "all_gather with {} split sizes for {size} ranks",
                        counts.len()
                    )));
                }
                Planned {
                    schedule: builders::all_gather(rank, size, counts),
                    src: Some(input),
                    dst: output,
                    op: ReduceOp::Sum,
                    copy_out: None,
                }
            }
            OpData::Broadcast { buf, root } => Planned {
                schedule: builders::broadcast(rank, size, buf.len(), *root),
                src: None,
                dst: buf,
                op: ReduceOp::Sum,
                copy_out: None,
            },
            OpData::Scatter {
                input,
                output,
                root,
            } => Planned {
                schedule: builders::scatter(rank, size, output.len(), *root),
                src: Some(input),
                dst: output,
                op: ReduceOp::Sum,
                copy_out: None,
            },
            OpData::Gather {
                input,
                output,
                root,
            } => Planned {
                schedule: builders::gather(rank, size, input.len(), *root),
                src: Some(input),
                dst: output,
                op: ReduceOp::Sum,
                copy_out: None,
            },
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
                }
            }
            OpData::Barrier | OpData::P2P { .. } => return Ok(None),
        };
        Ok(Some(p))
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
}

fn class_of(ctx: &OpCtx) -> FrameClass {
    if ctx.kind == OpKind::P2P {
        FrameClass::P2P
    } else {
        FrameClass::Collective
    }
}

/// Append `item` to the list of `peer`, keeping first-seen peer order.
fn push_grouped<T>(groups: &mut Vec<(usize, Vec<T>)>, peer: usize, item: T) {
    match groups.iter_mut().find(|(p, _)| *p == peer) {
        Some((_, v)) => v.push(item),
        None => groups.push((peer, vec![item])),
    }
}

/// Run per-peer send and receive lists concurrently: one task-free future per
/// (peer, direction), frames in list order. On the first error the receives
/// are dropped and the sends get [`DRAIN_BOUND`] to finish (CPU-3).
async fn run_transfers<'a>(
    writers: &'a mut [Option<LinkWriter>],
    readers: &'a mut [Option<LinkReader>],
    ctx: &'a OpCtx,
    class: FrameClass,
    sends: Vec<(usize, SendFrames<'a>)>,
    recvs: Vec<(usize, RecvFrames<'a>)>,
) -> Result<()> {
    let mut send_futs: FuturesUnordered<BoxFut<'a>> = FuturesUnordered::new();
    let mut recv_futs: FuturesUnordered<BoxFut<'a>> = FuturesUnordered::new();
    let mut sends: Vec<Option<SendFrames<'a>>> = {
        let mut v: Vec<Option<SendFrames<'a>>> = (0..writers.len()).map(|_| None).collect();
        for (p, f) in sends {
            if let Some(slot) = v.get_mut(p) {
                *slot = Some(f);
            }
        }
        v
    };
    let mut recvs: Vec<Option<RecvFrames<'a>>> = {
        let mut v: Vec<Option<RecvFrames<'a>>> = (0..readers.len()).map(|_| None).collect();
        for (p, f) in recvs {
            if let Some(slot) = v.get_mut(p) {
                *slot = Some(f);
            }
        }
        v
    };
    for (peer, w) in writers.iter_mut().enumerate() {
        let Some(frames) = sends[peer].take() else {
            continue;
        };
        let Some(w) = w.as_mut() else {
            return Err(ctx.peer_failed(vec![peer], format!("no link to rank {peer}")));
        };
        send_futs.push(Box::pin(async move {
            for (kind, seq, payload) in frames {
                w.send(ctx, kind, class, seq, payload).await?;
            }
            Ok(())
        }));
    }
    for (peer, r) in readers.iter_mut().enumerate() {
        let Some(frames) = recvs[peer].take() else {
            continue;
        };
        let Some(r) = r.as_mut() else {
            return Err(ctx.peer_failed(vec![peer], format!("no link to rank {peer}")));
        };
        recv_futs.push(Box::pin(async move {
            for (kind, seq, into) in frames {
                r.recv(ctx, kind, class, seq, into).await?;
            }
            Ok(())
        }));
    }
    let mut failure = None;
    while !send_futs.is_empty() || !recv_futs.is_empty() {
        let r = tokio::select! {
            Some(r) = send_futs.next(), if !send_futs.is_empty() => r,
            Some(r) = recv_futs.next(), if !recv_futs.is_empty() => r,
        };
        if let Err(e) = r {
            failure = Some(e);
            break;
        }
    }
    match failure {
        None => Ok(()),
        Some(e) => {
            drop(recv_futs);
            let _ = tokio::time::timeout(DRAIN_BOUND, async {
                while send_futs.next().await.is_some() {}
            })
            .await;
            Err(e)
        }
    }
}

#[async_trait]
impl Backend for CpuBackend {
    fn name(&self) -> &'static str {
        "cpu"
    }

    async fn exchange_headers(
        &mut self,
        ctx: &OpCtx,
        outgoing: Vec<(usize, u64, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>> {
        let bytes: usize = outgoing.iter().map(|o| o.2.len()).sum();
        let span = tracing::debug_span!("cpu_headers", comm = %ctx.comm, rank = ctx.rank, op = ctx.kind.name(), seq = ctx.seq, bytes, peers = outgoing.len());
        let mut received: Vec<Vec<u8>> = vec![Vec::new(); outgoing.len()];
        self.enter(ctx)?;
        let r = self
            .exchange_inner(ctx, &outgoing, &mut received)
            .instrument(span)
            .await;
        self.leave(&r);
        r?;
        Ok(outgoing.iter().map(|o| o.0).zip(received).collect())
    }

    async fn execute(&mut self, ctx: &OpCtx, data: &mut OpData) -> Result<()> {
        self.enter(ctx)?;
        let r = self.execute_inner(ctx, data).await;
        self.leave(&r);
        r
    }

    async fn abort(&mut self, reason: &str, failed: &[usize]) {
        if matches!(self.state, State::Aborted { .. } | State::Finalized) {
            return;
        }
        self.state = State::Aborted {
            reason: reason.to_string(),
            failed: failed.to_vec(),
        };
        let payload = link::encode_abort(reason, failed);
        tracing::debug!(comm = %self.comm, rank = self.rank, reason, ?failed, "aborting data links");
        let payload = &payload;
        let writers: Vec<LinkWriter> = self.writers.iter_mut().filter_map(Option::take).collect();
        self.readers.iter_mut().for_each(|r| drop(r.take()));
        futures::future::join_all(writers.into_iter().map(|mut w| async move {
            if !w.mid_frame() {
                let sent = tokio::time::timeout(
                    ABORT_BOUND,
                    w.write_frame(FrameKind::Abort, FrameClass::Collective, 0, payload),
                )
                .await;
                if !matches!(sent, Ok(Ok(()))) {
                    tracing::debug!(peer = w.peer(), "could not deliver the abort frame");
                }
            }
            let _ = tokio::time::timeout(ABORT_BOUND, w.shutdown()).await;
        }))
        .await;
    }

    async fn finalize(&mut self) {
        if matches!(self.state, State::Aborted { .. }) {
            return;
        }
        self.state = State::Finalized;
        let writers: Vec<LinkWriter> = self.writers.iter_mut().filter_map(Option::take).collect();
        futures::future::join_all(writers.into_iter().map(|mut w| async move {
            let _ = tokio::time::timeout(ABORT_BOUND, w.shutdown()).await;
        }))
        .await;
        self.readers.iter_mut().for_each(|r| drop(r.take()));
    }
}

impl CpuBackend {
    async fn execute_inner(&mut self, ctx: &OpCtx, data: &mut OpData) -> Result<()> {
        if let OpData::P2P { ops } = data {
            let bytes: usize = ops.iter().map(|t| t.buf.len_bytes()).sum();
            let span = tracing::debug_span!("cpu_op", comm = %ctx.comm, rank = ctx.rank, op = "p2p", transfers = ops.len(), bytes);
            return self.p2p_inner(ctx, ops).instrument(span).await;
        }
        let Some(plan) = self.op_buffers(data)? else {
            return Ok(()); // Barrier: the header exchange already synchronised.
        };
        let Planned {
            schedule,
            src,
            dst,
            op,
            copy_out,
        } = plan;
        let bytes = dst.len_bytes();
        let span = tracing::debug_span!("cpu_op", comm = %ctx.comm, rank = ctx.rank, op = ctx.kind.name(), seq = ctx.seq, bytes, steps = schedule.steps.len());
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
