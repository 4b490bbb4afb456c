//! Moving frames over shared-memory rings: the progress engine used for
//! same-host peers.
//!
//! A message on a ring is a 32-byte prefix (`kind u8`, `class u8`, the
//! single-copy flag `u8`, the checksum flag `u8` and the payload's CRC32C
//! `u32` or zeros, `seq u64`, `len u64`, the op's fingerprint `u64` or zero,
//! little endian; the same fields as a TCP frame header), `len` payload bytes, and zero padding to a multiple of 8,
//! so every payload starts 8-aligned in the ring and no element of any dtype
//! straddles the wrap point. One thread drives every transfer of a step:
//! it copies send payloads into the peers' rings and copies — or reduces —
//! received bytes straight out of the rings as they arrive, chunk by chunk,
//! so a reduction overlaps the peer's copy (pipelining) and no staging
//! buffer is needed.
//!
//! # Invariants
//! - SX-1: messages between one ordered pair of ranks are matched in order
//!   ([SC-3]); a prefix whose kind, class, seq, fingerprint (where this
//!   rank expects one) or length is not the expected one is a `Mismatch`,
//!   checked before any payload byte is used (as LK-3 and LK-9).
//! - SX-6: with `CHORUS_CHECKSUM=1` every message carries the CRC32C of its
//!   payload, computed by the sender over its buffer before the prefix is
//!   written; the receiver folds every payload byte it takes out of the ring
//!   (or reads from the sender's memory) into a running CRC, always from its
//!   own copy of those bytes (the destination, or a private snapshot for a
//!   reduction), never by a second read of the shared ring, and checks it
//!   when the last byte is in, before the op can complete: a mismatch is
//!   `Error::Corrupted`, a missing checksum a fatal `Mismatch`, as on TCP
//!   links ([LK-7]).
//! - SX-2: waiting never spins unboundedly: a short spin, then futex sleeps
//!   of at most [`SLEEP`] (no `sched_yield`: on a loaded machine a yielding
//!   rank lost its CPU for a whole time slice, measured as bimodal 2-4 ms
//!   ops, while a futex sleeper is woken promptly); at least every [`ROUND`] of
//!   waiting the engine returns to the async runtime (so op timeouts and
//!   aborts fire) and checks the TCP link of every peer it waits for: a
//!   closed link is `PeerFailed`, a readable one carries the peer's Abort
//!   frame (nothing else travels on the TCP link of a shared-memory peer)
//!   and becomes `PeerFailed` with the peer's reason. A closed link fails
//!   the step only after one more pass over the rings moved nothing: a
//!   peer whose sends completed may exit while its data is still in the
//!   ring.
//! - SX-8: while it makes progress the engine also returns to the runtime,
//!   at least every [`pace::SLICE`] of work ([PA-1]): each job moves at
//!   most [`UNIT`] bytes (or one single-copy read step) before the engine
//!   turns to the next job and counts the bytes; a step that moved fewer
//!   than [`pace::CHECK_BYTES`] never reads the clock or yields for it
//!   ([PA-2]). The turn's next poll reads the abort signal before it polls
//!   the step again ([PA-3]), whether the turn runs on a task or on a
//!   blocked caller's thread.
//! - SX-4: in a step that both sends and receives, a payload to a peer
//!   that can read this process's memory (SH-5) travels as its address
//!   (prefix flag byte 2 = 1, 8 address bytes) when it is at least
//!   [`CMA_MIN`] bytes and the step reduces what it receives, or at least
//!   [`cma_min_copy`] bytes and the step only copies; the receiver copies
//!   or reduces it straight from the sender's buffer with
//!   `process_vm_readv`, then acks, and the send completes only after the
//!   ack, so the buffer is never changed while it is read. A send-only
//!   step keeps the ring, whose copy-in runs on this otherwise idle CPU.
//!   The sender chooses per message and says so in the prefix, so ranks
//!   need not agree on the thresholds.
//! - SX-5: when this communicator has more ranks on this host than the
//!   process has CPUs, a waiting rank polls only [`SPIN_SHARED`] times,
//!   then yields its CPU (`sched_yield`) [`YIELDS`] times and for
//!   [`YIELD_FOR`] more before it sleeps: a peer that holds data this rank waits for is then usually
//!   runnable at once, instead of the CPU idling through a futex wake-up
//!   (Open MPI yields when idle on an oversubscribed host for the same
//!   reason). Measured, 4 ranks on 2 cores, all_reduce: 8 B 124-160 ->
//!   57-97 us, 256 KiB 0.91-1.02 -> 1.50-1.86 GB/s busbw; the machine went
//!   from 0.71 CPUs busy to fully used (8 yields then). Polling 16 times
//!   instead of 200 before the first yield, and yielding for 20 us instead
//!   of 8 times, then took 16 B to 2 KiB all_gather, all_to_all_single and
//!   all_reduce from 25-52 us to 11-17 us: 200 polls are about 15 us that
//!   the awaited peer, waiting for this CPU, cannot use. With 8 yields a
//!   ping-pong between 2 of 4 ranks (the others idle) often slept before
//!   its answer came (2.2-6.9 us per message against 1.2-1.9 now). Not
//!   done when every rank has its own CPU: there a yield only loses the
//!   time slice to other load (bimodal 2-4 ms ops on a loaded box,
//!   measured earlier). A wait whose every awaited peer has read all this
//!   rank sent it polls the full [`SPIN`] rounds before yielding: that peer
//!   runs, or ran just now, on another CPU, and its answer is likely a
//!   round trip away (a ping-pong between 2 of 4 ranks: 4.3-5.9 us per
//!   message with 16 polls, 2.3-2.4 with this, short runs).
//! - SX-7: when every rank has a CPU of its own, a wait on a thread that
//!   may sleep polls for [`SPIN_FOR`] before its first futex sleep, not
//!   just [`SPIN`] rounds. A futex wake-up costs tens of microseconds on a
//!   virtual machine; with a shorter poll, two ranks that once slept fell
//!   into waking each other on every op (8 B all_reduce through the
//!   blocking API bimodal at 3 or 60 us per op, the same binary from run to
//!   run). An awaited op already polls this long ([`HANDOFF`]).
//! - SX-3: on a worker of a caller's runtime (and on a current-thread
//!   runtime, where the peer may be a task on the same thread) the engine
//!   never sleeps in the kernel itself: it yields to the runtime, and a
//!   wait that made no progress for [`HANDOFF`] sleeps on the ring's futex
//!   from a blocking thread (`spawn_blocking`) while the task awaits it.
//!
//! [SC-3]: crate::backends::cpu::schedule#invariants
//! [LK-7]: crate::backends::cpu::link::frame#invariants
//! [PA-1]: crate::backends::cpu::pace#invariants
//! [PA-2]: crate::backends::cpu::pace#invariants
//! [PA-3]: crate::backends::cpu::pace#invariants
//! [`pace::SLICE`]: crate::pace::SLICE
//! [`pace::CHECK_BYTES`]: crate::pace::CHECK_BYTES

use std::time::{Duration, Instant};

use super::link::{self, FrameClass, FrameKind, LinkReader, Liveness, RecvInto, Recvs, Sends, Tag};
use super::shm::{self, RingConsumer, RingProducer};
use crate::backends::OpCtx;
use crate::error::Result;
use crate::kernels;
use crate::pace::Pacer;

/// Bytes of the prefix in front of every message.
const PREFIX: usize = 32;
/// Spins before yielding the CPU.
const SPIN: u32 = 200;
/// Spins before yielding the CPU when the host is oversubscribed ([SX-5]),
/// about a microsecond here: long enough for a peer that runs on another
/// CPU to answer (a ping-pong), short enough not to hold up a peer that
/// waits for this CPU.
///
/// [SX-5]: self#invariants
const SPIN_SHARED: u32 = 16;
/// Most bytes one job moves before the engine turns to the next job and
/// counts the work ([SX-8]); a single-copy read step may move up to
/// [`CMA_COPY_STEP`].
///
/// [SX-8]: self#invariants
const UNIT: usize = 128 << 10;
/// Smallest payload sent as an address ([SX-4]) in a step whose receives
/// reduce (reduce_scatter, all_reduce's first phase). Below it the ring's
/// two pipelined copies cost less than the ack round trip.
///
/// [SX-4]: self#invariants
const CMA_MIN: usize = 256 << 10;
/// Smallest payload sent as an address in a step whose receives only copy
/// (all_gather's ring, all_reduce's second phase, all_to_all_single), by
/// default. Which path wins depends on the host (docs/performance.md,
/// "Single copy: when it pays"): on 2026-12-06's host single copy took
/// 2-rank all_gather from 7.0 to 14.7 GB/s busbw at 512 KiB and from 4.7
/// to 8.0 at 16 MiB, idle and interleaved; on 2026-12-04's the rings won
/// from 16 to 128 MiB (22 against 14 GB/s at 16 MiB).
const CMA_MIN_COPY: usize = 256 << 10;

/// [`CMA_MIN_COPY`], or the byte count in `CHORUS_SHM_CMA_COPY_MIN`, so
/// that a host where the rings win can keep them without a rebuild.
fn cma_min_copy() -> usize {
    static MIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MIN.get_or_init(|| {
        std::env::var("CHORUS_SHM_CMA_COPY_MIN")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(CMA_MIN_COPY)
    })
}
/// Bytes read per `process_vm_readv` into a reduction's scratch buffer
/// (fits in cache, so the reduction reads it back from there).
const CMA_REDUCE_STEP: usize = 256 << 10;
/// Bytes read per `process_vm_readv` straight into the destination.
const CMA_COPY_STEP: usize = 1 << 20;
/// Yields before a futex sleep when the host is oversubscribed ([SX-5]).
///
/// [SX-5]: self#invariants
const YIELDS: u32 = 8;

/// How long a wait keeps yielding, after its first [`YIELDS`] yields,
/// before its first futex sleep when the host is oversubscribed ([SX-5]).
///
/// [SX-5]: self#invariants
const YIELD_FOR: Duration = Duration::from_micros(20);

/// CPUs this process may run on (cached).
pub(crate) fn cpus() -> usize {
    static V: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *V.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// How long a wait keeps polling before its first futex sleep when every
/// rank has a CPU of its own ([SX-7]): longer than a futex wake-up takes
/// on a virtual machine, so that ranks do not settle into waking each
/// other on every op.
///
/// [SX-7]: self#invariants
const SPIN_FOR: Duration = Duration::from_micros(100);
/// Longest single futex sleep.
const SLEEP: Duration = Duration::from_micros(50);
/// Longest time spent blocking before returning to the runtime ([SX-2]).
///
/// [SX-2]: self#invariants
const ROUND: Duration = Duration::from_millis(1);
/// Without kernel sleeps (a turn on a caller's runtime), how long the
/// engine polls and yields to the runtime before it parks the wait on a
/// blocking thread instead ([SX-3]).
///
/// [SX-3]: self#invariants
const HANDOFF: Duration = Duration::from_micros(100);

/// A futex wait on the ring a stalled engine most likely waits for.
enum Park {
    Data(RingConsumer),
    Space(RingProducer),
    Cma(RingProducer, u64),
}

impl Park {
    /// The ring to wait on: the first pending receive's, else the first
    /// pending send's (for space, or for the read of its single-copy payload).
    fn pick(sends: &[SendJob<'_>], recvs: &[RecvJob<'_>]) -> Option<Park> {
        if let Some(j) = recvs.iter().find(|j| !j.finished) {
            return Some(Park::Data(j.ring.clone()));
        }
        let j = sends.iter().find(|j| !j.finished)?;
        Some(match j.awaiting_read() {
            Some(t) => Park::Cma(j.ring.clone(), t),
            None => Park::Space(j.ring.clone()),
        })
    }

    /// Sleep until the ring changes or `timeout` passed.
    fn wait(&self, timeout: Duration) {
        match self {
            Park::Data(r) => r.wait_data(timeout),
            Park::Space(r) => r.wait_space(timeout),
            Park::Cma(r, t) => r.wait_cma(*t, timeout),
        }
    }
}

/// The job vectors of a step, kept between steps so that a step allocates
/// none (two vectors of O(the largest step's frames), per communicator).
/// Between steps they are empty; [`ShmScratch::take`] hands them out typed
/// for the step's buffers, [`ShmScratch::put`] takes them back.
#[derive(Default)]
pub(crate) struct ShmScratch {
    sends: Vec<SendJob<'static>>,
    recvs: Vec<RecvJob<'static>>,
}

impl std::fmt::Debug for ShmScratch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmScratch")
            .field("sends", &self.sends.capacity())
            .field("recvs", &self.recvs.capacity())
            .finish()
    }
}

impl ShmScratch {
    fn take<'a>(&mut self) -> (Vec<SendJob<'a>>, Vec<RecvJob<'a>>) {
        (
            recycle(std::mem::take(&mut self.sends)),
            recycle(std::mem::take(&mut self.recvs)),
        )
    }

    fn put(&mut self, sends: Vec<SendJob<'_>>, recvs: Vec<RecvJob<'_>>) {
        self.sends = recycle(sends);
        self.recvs = recycle(recvs);
    }
}

/// `v` emptied, as a vector of `U`, keeping its allocation when `T` and `U`
/// have the same layout (here: the same type for another lifetime). The
/// standard library's in-place `collect` does the re-typing, without
/// `unsafe`; where it could not, the result is a new, empty vector.
fn recycle<T, U>(mut v: Vec<T>) -> Vec<U> {
    v.clear();
    v.into_iter().filter_map(|_| None).collect()
}

/// The TCP readers of a step's shared-memory peers, for their liveness and
/// Abort frames ([SX-2](self#invariants)).
pub(crate) enum Readers<'r> {
    /// Every peer's slot, by rank: the step moves nothing over TCP.
    All(&'r mut [Option<LinkReader>]),
    /// The step's shared-memory peers only, with their ranks (the step's
    /// TCP transfers hold the other readers).
    Picked(Vec<(usize, Option<&'r mut LinkReader>)>),
}

impl Readers<'_> {
    fn get(&mut self, peer: usize) -> Option<&mut LinkReader> {
        match self {
            Readers::All(v) => v.get_mut(peer).and_then(Option::as_mut),
            Readers::Picked(v) => v
                .iter_mut()
                .find(|(p, _)| *p == peer)
                .and_then(|(_, r)| r.as_deref_mut()),
        }
    }
}

/// Both rings of a same-host peer.
#[derive(Debug)]
pub(crate) struct ShmLink {
    /// This rank -> peer.
    pub(crate) tx: RingProducer,
    /// Peer -> this rank.
    pub(crate) rx: RingConsumer,
    /// Send and require a CRC32C per message ([SX-6](self#invariants)).
    pub(crate) checksum: bool,
}

fn prefix(
    kind: FrameKind,
    class: FrameClass,
    tag: Tag,
    len: u64,
    cma: bool,
    crc: Option<u32>,
) -> [u8; PREFIX] {
    let mut h = [0u8; PREFIX];
    h[0] = kind as u8;
    h[1] = class as u8;
    h[2] = u8::from(cma);
    if let Some(c) = crc {
        h[3] = link::FLAG_CRC;
        h[4..8].copy_from_slice(&c.to_le_bytes());
    }
    h[8..16].copy_from_slice(&tag.seq.to_le_bytes());
    h[16..24].copy_from_slice(&len.to_le_bytes());
    h[24..32].copy_from_slice(&tag.fp.to_le_bytes());
    h
}

fn padded(len: usize) -> usize {
    PREFIX + len.div_ceil(8) * 8
}

struct SendJob<'a> {
    peer: usize,
    /// Done, and no longer looked at.
    finished: bool,
    ring: &'a RingProducer,
    prefix: [u8; PREFIX],
    payload: &'a [u8],
    /// [SX-4]: the payload's address, sent instead of its bytes.
    ///
    /// [SX-4]: self#invariants
    desc: Option<[u8; 8]>,
    /// [SX-4]: the ticket of the descriptor, once written.
    ///
    /// [SX-4]: self#invariants
    ticket: Option<u64>,
    pos: usize,
}

impl SendJob<'_> {
    /// Bytes this job puts in the ring after the prefix.
    fn wire_len(&self) -> usize {
        match self.desc {
            Some(d) => d.len(),
            None => self.payload.len(),
        }
    }

    fn total(&self) -> usize {
        padded(self.wire_len())
    }

    fn written(&self) -> bool {
        self.pos >= self.total()
    }

    fn done(&self) -> bool {
        self.written() && self.ticket.is_none_or(|t| self.ring.cma_done(t))
    }

    /// [SX-4]: the ticket this job waits on, if it is waiting for a read.
    ///
    /// [SX-4]: self#invariants
    fn awaiting_read(&self) -> Option<u64> {
        self.ticket.filter(|&t| !self.ring.cma_done(t))
    }

    /// Write what fits, stopping once `max` bytes went in ([SX-8]);
    /// returns the bytes written.
    ///
    /// [SX-8]: self#invariants
    fn progress(&mut self, max: usize) -> usize {
        const ZEROS: [u8; 8] = [0u8; 8];
        let mut moved = 0;
        while !self.written() && moved < max {
            let p = self.pos;
            let l = self.wire_len();
            let body: &[u8] = match &self.desc {
                Some(d) => d,
                None => self.payload,
            };
            let src = if p < PREFIX {
                &self.prefix[p..]
            } else if p < PREFIX + l {
                &body[p - PREFIX..]
            } else {
                &ZEROS[..self.total() - p]
            };
            let n = self.ring.write_some(&src[..src.len().min(max - moved)]);
            if n == 0 {
                break;
            }
            self.pos += n;
            moved += n;
        }
        if self.written() && self.desc.is_some() && self.ticket.is_none() {
            self.ticket = Some(self.ring.take_ticket());
        }
        moved
    }
}

impl Drop for SendJob<'_> {
    /// [SX-4]: an op cancelled while the peer may still read this buffer
    /// revokes the transfer before the buffer can be freed (SH-5).
    ///
    /// [SX-4]: self#invariants
    fn drop(&mut self) {
        let in_flight = self.desc.is_some() && self.pos > 0 && !self.done();
        if in_flight {
            self.ring.revoke_cma();
        }
    }
}

/// [SX-4]: a payload being read from the sender's memory.
///
/// [SX-4]: self#invariants
struct CmaRecv {
    pid: i32,
    /// The sender's address, as it arrives from the ring.
    desc: [u8; 8],
    /// Payload bytes read so far.
    off: usize,
    acked: bool,
    scratch: Vec<u8>,
}

struct RecvJob<'a> {
    ring: &'a RingConsumer,
    peer: usize,
    /// Done, and no longer looked at.
    finished: bool,
    kind: FrameKind,
    class: FrameClass,
    tag: Tag,
    into: RecvInto<'a>,
    head: [u8; PREFIX],
    got: usize,
    /// Payload length, once the prefix is in.
    len: usize,
    /// [SX-4]: set when the prefix announces a single-copy payload.
    ///
    /// [SX-4]: self#invariants
    cma: Option<CmaRecv>,
    /// [SX-6]: require a checksum; the one sent; the CRC of the payload
    /// bytes taken so far.
    ///
    /// [SX-6]: self#invariants
    checksum: bool,
    sent_crc: Option<u32>,
    crc: u32,
    /// [SX-6]: a private copy of the ring bytes a checked reduction takes,
    /// so that the bytes checked are the bytes combined (the ring is shared
    /// memory and may change between two reads). Grows to one step, once
    /// per job; unused without checksums.
    ///
    /// [SX-6]: self#invariants
    snap: Vec<u8>,
}

impl RecvJob<'_> {
    fn done(&self) -> bool {
        match &self.cma {
            Some(c) => c.acked,
            None => self.got >= PREFIX && self.got >= padded(self.len),
        }
    }

    /// [SX-4]: take the address out of the ring, read the payload from the
    /// sender's memory a step at a time, then ack. Returns the bytes moved
    /// (the ack counts as one), 0 if nothing could be done.
    ///
    /// [SX-4]: self#invariants
    fn progress_cma(&mut self, ctx: &OpCtx) -> Result<usize> {
        let Some(c) = self.cma.as_mut() else {
            return Ok(0);
        };
        if self.got < PREFIX + 8 {
            let (at, desc) = (self.got - PREFIX, &mut c.desc);
            let n = self.ring.consume_with(PREFIX + 8 - self.got, |b| {
                desc[at..at + b.len()].copy_from_slice(b);
                b.len()
            });
            self.got += n;
            return Ok(n);
        }
        let peer = self.peer;
        let addr = u64::from_le_bytes(c.desc).wrapping_add(c.off as u64);
        let failed = |e: std::io::Error| {
            ctx.peer_failed(
                vec![peer],
                format!("cannot read rank {peer}'s buffer (single copy): {e}"),
            )
        };
        if c.off < self.len {
            let off = c.off;
            // `accepts` checked the length against every target (SX-1).
            let (dst, reduce_with) = match &mut self.into {
                RecvInto::Exact(b) => (&mut b[..], None),
                RecvInto::Bounded(b, _) => (&mut b[..], None),
                RecvInto::Reduce(b, dtype, op) => (&mut b[..], Some((*dtype, *op))),
            };
            let step = match reduce_with {
                None => {
                    let step = (self.len - off).min(CMA_COPY_STEP);
                    shm::cma_read(c.pid, addr, &mut dst[off..off + step]).map_err(failed)?;
                    if self.sent_crc.is_some() {
                        self.crc = crc32c::crc32c_append(self.crc, &dst[off..off + step]);
                    }
                    step
                }
                Some((dtype, op)) => {
                    let es = dtype.size();
                    let step = (self.len - off).min(CMA_REDUCE_STEP / es * es);
                    c.scratch.resize(step, 0);
                    shm::cma_read(c.pid, addr, &mut c.scratch).map_err(failed)?;
                    if self.sent_crc.is_some() {
                        self.crc = crc32c::crc32c_append(self.crc, &c.scratch);
                    }
                    kernels::reduce_into(dtype, op, &mut dst[off..off + step], &c.scratch)?;
                    step
                }
            };
            if self.ring.cma_revoked() {
                return Err(ctx.peer_failed(
                    vec![peer],
                    format!("rank {peer} abandoned a transfer while it was being read"),
                ));
            }
            c.off += step;
            return Ok(step);
        }
        if !c.acked {
            // SX-6: check before the ack, so the op cannot complete with
            // bytes that changed under the read.
            let (sent, crc) = (self.sent_crc, self.crc);
            link::verify_crc(
                ctx,
                peer,
                self.checksum,
                sent,
                || crc,
                "single-copy payload",
            )?;
            self.ring.cma_ack();
            c.acked = true;
            crate::debug::SINGLE_COPY_READS.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
            return Ok(1);
        }
        Ok(0)
    }

    /// Read what has arrived, stopping once `max` bytes were taken
    /// ([SX-8]); returns the bytes taken.
    ///
    /// [SX-8]: self#invariants
    fn progress(&mut self, ctx: &OpCtx, max: usize) -> Result<usize> {
        let mut moved = 0;
        loop {
            if moved >= max {
                return Ok(moved);
            }
            if self.cma.is_some() {
                let n = self.progress_cma(ctx)?;
                moved += n;
                if n == 0 || self.done() {
                    return Ok(moved);
                }
                continue;
            }
            if self.got < PREFIX {
                let (got, head) = (self.got, &mut self.head);
                let n = self.ring.consume_with(PREFIX - got, |b| {
                    head[got..got + b.len()].copy_from_slice(b);
                    b.len()
                });
                if n == 0 {
                    return Ok(moved);
                }
                moved += n;
                self.got += n;
                if self.got == PREFIX {
                    self.check_prefix(ctx)?;
                }
                continue;
            }
            if self.done() {
                return Ok(moved);
            }
            let off = self.got - PREFIX;
            let n = if off < self.len {
                // A multiple of 8, so a reduction still takes whole
                // elements (every payload starts 8-aligned in the ring).
                let cap = ((max - moved) & !7).max(8);
                let want = (self.len - off).min(cap);
                let folding = self.sent_crc.is_some();
                let crc = &mut self.crc;
                let mut fold = |b: &[u8]| {
                    if folding {
                        *crc = crc32c::crc32c_append(*crc, b);
                    }
                };
                // SX-6: the checksum covers the bytes this rank keeps (its
                // copy, or a private snapshot for a reduction), never a
                // second read of the shared ring.
                let n = match &mut self.into {
                    RecvInto::Exact(buf) => self.ring.consume_with(want, |b| {
                        let kept = &mut buf[off..off + b.len()];
                        kept.copy_from_slice(b);
                        fold(kept);
                        b.len()
                    }),
                    RecvInto::Bounded(buf, _) => self.ring.consume_with(want, |b| {
                        let kept = &mut buf[off..off + b.len()];
                        kept.copy_from_slice(b);
                        fold(kept);
                        b.len()
                    }),
                    RecvInto::Reduce(buf, dtype, op) => {
                        let es = dtype.size();
                        let mut res = Ok(());
                        let snap = &mut self.snap;
                        let n = self.ring.consume_with(want, |b| {
                            let k = b.len() / es * es;
                            let dst = &mut buf[off..off + k];
                            res = if folding {
                                snap.clear();
                                snap.extend_from_slice(&b[..k]);
                                fold(snap);
                                kernels::reduce_into(*dtype, *op, dst, snap)
                            } else {
                                kernels::reduce_into(*dtype, *op, dst, &b[..k])
                            };
                            k
                        });
                        res?;
                        n
                    }
                };
                if n > 0 && off + n == self.len {
                    // SX-6: the last payload byte is in.
                    let (sent, crc) = (self.sent_crc, self.crc);
                    link::verify_crc(ctx, self.peer, self.checksum, sent, || crc, "ring message")?;
                }
                n
            } else {
                let pad = padded(self.len) - self.got;
                self.ring.consume_with(pad, |b| b.len())
            };
            if n == 0 {
                return Ok(moved);
            }
            moved += n;
            self.got += n;
        }
    }

    fn check_prefix(&mut self, ctx: &OpCtx) -> Result<()> {
        let h = &self.head;
        let le = |b: &[u8]| {
            let mut a = [0u8; 8];
            a.copy_from_slice(b);
            u64::from_le_bytes(a)
        };
        let (seq, len, fp) = (le(&h[8..16]), le(&h[16..24]), le(&h[24..32]));
        let peer = self.peer;
        // Bytes 3..8 have the layout of a TCP frame header's (LK-7).
        let mut field = [0u8; 8];
        field[3..8].copy_from_slice(&h[3..8]);
        let crc = if h[2] > 1 {
            None
        } else {
            link::crc_field(&field)
        };
        if h[0] != self.kind as u8
            || h[1] != self.class as u8
            || crc.is_none()
            || seq != self.tag.seq
        {
            return Err(ctx.mismatch(format!(
                "rank {peer} is out of step: expected frame kind {} class {} seq {} on the shared-memory link, got kind {} class {} seq {seq} ({len} bytes){}",
                self.kind as u8,
                self.class as u8,
                self.tag.seq,
                h[0],
                h[1],
                link::checks_hint(h[0], self.kind)
            )));
        }
        // LK-9: the op's fingerprint, before any payload byte.
        if self.tag.fp != 0 && fp != self.tag.fp {
            return Err(link::fingerprint_mismatch(ctx, peer, self.tag.fp, fp));
        }
        self.into
            .accepts(len)
            .map_err(|w| ctx.mismatch(format!("rank {peer} {w} (seq {seq})")))?;
        self.len = len as usize;
        self.sent_crc = crc.flatten();
        if self.len == 0 {
            // SX-6: no payload byte will arrive to trigger the check.
            link::verify_crc(
                ctx,
                peer,
                self.checksum,
                self.sent_crc,
                || 0,
                "ring message",
            )?;
        }
        if let RecvInto::Bounded(buf, _) = &mut self.into {
            buf.clear();
            link::reserve(buf, len).map_err(|w| ctx.mismatch(format!("rank {peer} {w}")))?;
            buf.resize(self.len, 0);
        }
        if h[2] == 1 {
            // SX-4: only a sender this rank probed successfully sends addresses.
            let pid = self.ring.cma_pid().ok_or_else(|| {
                ctx.mismatch(format!(
                    "rank {peer} sent a buffer address, but this rank cannot read its memory"
                ))
            })?;
            self.cma = Some(CmaRecv {
                pid,
                desc: [0; 8],
                off: 0,
                acked: false,
                scratch: Vec::new(),
            });
        }
        Ok(())
    }
}

/// Whether every peer of an unfinished receive in `recv_q` has read all
/// this rank wrote to it (SX-5), and there is at least one.
fn awake(links: &[Option<ShmLink>], recv_q: &[RecvJob<'_>]) -> bool {
    let mut any = false;
    for j in recv_q.iter().filter(|j| !j.finished) {
        match links.get(j.peer).and_then(Option::as_ref) {
            Some(l) if l.tx.drained() => any = true,
            _ => return false,
        }
    }
    any
}

/// Run every frame of `sends` and `recvs` over the peers' rings, in order
/// per (peer, direction), all peers at once (each peer appears at most
/// once in each). `readers` gives the TCP reader of every peer of the step
/// (liveness and Abort frames, [SX-2]). `may_block`: whether the engine
/// may sleep in the kernel ([SX-3]); `oversubscribed`: this communicator
/// has more ranks on this host than there are CPUs ([SX-5]). The step's
/// jobs live in `scratch`'s vectors: a step allocates nothing.
///
/// [SX-2]: self#invariants
/// [SX-3]: self#invariants
/// [SX-5]: self#invariants
#[allow(clippy::too_many_arguments)]
pub(crate) async fn run_shm<'a>(
    links: &'a [Option<ShmLink>],
    scratch: &mut ShmScratch,
    oversubscribed: bool,
    mut readers: Readers<'_>,
    ctx: &OpCtx,
    class: FrameClass,
    sends: &mut Sends<'a>,
    recvs: &mut Recvs<'a>,
    may_block: bool,
) -> Result<()> {
    let link = |peer: usize| {
        links.get(peer).and_then(Option::as_ref).ok_or_else(|| {
            ctx.peer_failed(vec![peer], format!("no shared-memory link to rank {peer}"))
        })
    };
    // SX-4: single copy only in steps that also receive, where this rank's
    // CPU has its own work; a send-only step (a broadcast root) keeps the
    // ring, whose copy-in runs on this otherwise idle CPU in parallel with
    // the reader's copy-out.
    let receives_too = recvs.iter().any(|(_, frames)| !frames.is_empty());
    // The peer's receives mirror this rank's in the ring steps that send
    // and receive at once, so this rank's tell which threshold applies.
    let reduces = recvs.iter().any(|(_, frames)| {
        frames
            .iter()
            .any(|(_, _, into)| matches!(into, RecvInto::Reduce(..)))
    });
    let cma_min = if reduces { CMA_MIN } else { cma_min_copy() };
    // The jobs, each peer's in order; the engine works on each peer's
    // first unfinished one.
    let (mut send_q, mut recv_q) = scratch.take();
    for (peer, frames) in sends.drain(..) {
        let l = link(peer)?;
        send_q.extend(frames.into_iter().map(|(kind, tag, payload)| {
            let cma = receives_too && payload.len() >= cma_min && l.tx.cma_ok();
            crate::debug::DATA_MESSAGES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let crc = l.checksum.then(|| crc32c::crc32c(payload));
            SendJob {
                peer,
                finished: false,
                ring: &l.tx,
                prefix: prefix(kind, class, tag, payload.len() as u64, cma, crc),
                payload,
                desc: cma.then(|| (payload.as_ptr() as usize as u64).to_le_bytes()),
                ticket: None,
                pos: 0,
            }
        }));
    }
    for (peer, frames) in recvs.drain(..) {
        let l = link(peer)?;
        recv_q.extend(frames.into_iter().map(|(kind, tag, into)| RecvJob {
            ring: &l.rx,
            peer,
            finished: false,
            kind,
            class,
            tag,
            into,
            head: [0u8; PREFIX],
            got: 0,
            len: 0,
            cma: None,
            checksum: l.checksum,
            sent_crc: None,
            crc: 0,
            snap: Vec::new(),
        }));
    }
    let (mut sends_left, mut recvs_left) = (send_q.len(), recv_q.len());
    // SX-5: polls before the first yield.
    let first_spin = if oversubscribed { SPIN_SHARED } else { SPIN };
    let mut last_progress = Instant::now();
    let mut park_for = SLEEP;
    // SX-5, SX-7: when this wait started yielding or polling past SPIN.
    let mut spin_since: Option<Instant> = None;
    // SX-8: when a step that keeps moving bytes gives the runtime back.
    let mut pace = Pacer::new();
    // SX-2: a peer seen closed, and whether any byte moved since.
    let mut closed_seen: Option<usize> = None;
    let mut moved_since_close = false;
    'rounds: loop {
        // Every round after the first follows an await: the runtime had
        // its turn.
        pace.rested();
        let round = Instant::now();
        let mut idle = 0u32;
        let mut spin = first_spin;
        let mut slice_used = false;
        loop {
            let mut moved = 0usize;
            // A peer's jobs are consecutive: one that is not done holds
            // back the rest of its peer's.
            let mut held = usize::MAX;
            for j in send_q.iter_mut().filter(|j| !j.finished) {
                if j.peer == held {
                    continue;
                }
                moved += j.progress(UNIT);
                if j.done() {
                    j.finished = true;
                    sends_left -= 1;
                } else {
                    held = j.peer;
                }
            }
            held = usize::MAX;
            for j in recv_q.iter_mut().filter(|j| !j.finished) {
                if j.peer == held {
                    continue;
                }
                moved += j.progress(ctx, UNIT)?;
                if j.done() {
                    j.finished = true;
                    recvs_left -= 1;
                } else {
                    held = j.peer;
                }
            }
            if sends_left == 0 && recvs_left == 0 {
                scratch.put(send_q, recv_q);
                return Ok(());
            }
            if moved > 0 {
                moved_since_close = true;
                idle = 0;
                spin = first_spin;
                spin_since = None;
                if !may_block {
                    last_progress = Instant::now();
                    park_for = SLEEP;
                }
                // SX-8: counting bytes costs a small op nothing more; only
                // a step past CHECK_BYTES reads the clock.
                if pace.spent(moved) {
                    slice_used = true;
                    break;
                }
                continue;
            }
            idle += 1;
            if idle < spin {
                std::hint::spin_loop();
                continue;
            }
            // SX-5: every peer this rank still waits for has read all this
            // rank sent it, so it runs (or ran just now) on another CPU:
            // poll as long as with a CPU per rank before yielding.
            if idle == spin && spin < SPIN && awake(links, &recv_q) {
                spin = SPIN;
                continue;
            }
            // SX-5: give the CPU to a peer that may hold what this rank
            // waits for. Also on a caller's runtime: a yield keeps the
            // worker runnable (it is not a sleep), while returning to the
            // runtime alone would spin through the whole time slice.
            if oversubscribed
                && (idle < spin + YIELDS
                    || spin_since.get_or_insert_with(Instant::now).elapsed() < YIELD_FOR)
            {
                std::thread::yield_now();
                continue;
            }
            if !may_block || round.elapsed() >= ROUND {
                break;
            }
            // SX-7: with a CPU per rank, keep polling for SPIN_FOR before
            // the first sleep of a wait.
            if !oversubscribed && spin_since.get_or_insert_with(Instant::now).elapsed() < SPIN_FOR {
                std::hint::spin_loop();
                continue;
            }
            // Sleep on the ring we most likely wait for.
            if let Some(p) = Park::pick(&send_q, &recv_q) {
                p.wait(SLEEP);
            }
        }
        if slice_used {
            // SX-8: data is moving, so no peer is gone quiet; the turn's
            // next poll reads the abort signal first (PA-3).
            pace.yield_now().await;
            continue;
        }
        // SX-2: liveness of every peer still pending.
        let mut peers: Vec<usize> = send_q
            .iter()
            .filter(|j| !j.finished)
            .map(|j| j.peer)
            .collect();
        peers.extend(recv_q.iter().filter(|j| !j.finished).map(|j| j.peer));
        peers.sort_unstable();
        peers.dedup();
        for peer in peers {
            let Some(r) = readers.get(peer) else {
                continue;
            };
            match r.liveness() {
                Liveness::Quiet => {}
                Liveness::Closed => {
                    // A peer whose sends completed may finish and close
                    // while what it sent still sits in the ring: fail only
                    // if a pass over the rings after seeing the close
                    // moved nothing.
                    if closed_seen != Some(peer) || moved_since_close {
                        closed_seen = Some(peer);
                        moved_since_close = false;
                        continue 'rounds;
                    }
                    return Err(ctx.peer_failed(
                        vec![peer],
                        format!("rank {peer} closed its link (process exited or aborted)"),
                    ));
                }
                Liveness::Readable => {
                    let mut junk = Vec::new();
                    // An Abort frame becomes PeerFailed; anything else is out
                    // of step. Boxed: rare, and its state would otherwise
                    // weigh on every step's future.
                    Box::pin(r.recv(
                        ctx,
                        FrameKind::Data,
                        class,
                        Tag::of(ctx),
                        RecvInto::Bounded(&mut junk, 0),
                    ))
                    .await?;
                    return Err(ctx.mismatch(format!(
                        "rank {peer} sent a frame on the control link of a shared-memory peer"
                    )));
                }
            }
        }
        if !may_block && last_progress.elapsed() >= HANDOFF {
            if let Some(p) = Park::pick(&send_q, &recv_q) {
                // SX-3: a stalled wait on a caller's runtime sleeps on a
                // blocking thread, so the worker runs other tasks (or the
                // peer's, on a current-thread runtime) and no CPU spins.
                // The timeout grows while nothing moves, so that a long
                // wait costs few hand-offs; the wait holds its own handles
                // to the ring, so a turn dropped meanwhile frees nothing
                // under it.
                let t = park_for;
                park_for = (park_for * 2).min(ROUND);
                if tokio::task::spawn_blocking(move || p.wait(t)).await.is_ok() {
                    continue;
                }
            }
        }
        tokio::task::yield_now().await;
    }
}
