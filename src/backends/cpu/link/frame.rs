//! Frames on an established data link: the fixed header, the Abort payload,
//! and the two halves of a link ([`LinkWriter`], [`LinkReader`]).
//!
//! Every message on a link is a [`FRAME_HEADER_LEN`]-byte header followed by
//! `len` payload bytes. The header is a fixed little-endian layout rather
//! than an rkyv archive: it is read on every chunk of every op, before the
//! payload, and its size must be known before anything is buffered.
//!
//! | bytes  | field |
//! |--------|-------|
//! | 0      | kind: 1 = Header, 2 = Data, 3 = Abort |
//! | 1      | class: 1 = Collective, 2 = P2P |
//! | 2      | zero; on an Abort frame, 1 when the sender aborted because the ranks' ops disagree |
//! | 3      | flags: bit 0 = bytes 4..8 hold a checksum |
//! | 4..8   | CRC32C (Castagnoli) of the payload, `u32`, or zero |
//! | 8..16  | epoch `u64` |
//! | 16..24 | seq `u64` |
//! | 24..32 | len `u64` |
//! | 32..40 | the op's fingerprint `u64` ([`crate::checks`]), or zero when unchecked |
//!
//! An Abort payload is `count u32`, `count` failed ranks as `u32`, then the
//! UTF-8 reason. A Header payload is the encoded op header, followed, for
//! a small op, by this rank's data for the peer (layout in the backend's
//! `fused` module); the frame header is the same for every kind.
//!
//! With `CHORUS_CHECKSUM=1` ([`checksum_from_env`]) every Header and Data
//! frame carries the CRC32C of its payload, and a reader with the setting on
//! requires one on every such frame and checks it before the payload is
//! used (a reduction's bytes are checked before they are combined).
//!
//! # Invariants
//! - LK-3: a frame's kind, class, epoch, seq, fingerprint and length are
//!   checked against what the reader expects ([`Tag`]) *before* any payload
//!   is buffered (a fingerprint only where the reader expects a nonzero
//!   one, LK-9); Header frames
//!   are at most [`MAX_HEADER_FRAME`] bytes, Abort frames at most
//!   [`MAX_ABORT_FRAME`]. Anything unexpected is a `Mismatch`, never a panic.
//! - LK-7: with checksums on, a payload whose CRC32C does not match is
//!   `Error::Corrupted` naming the sending rank, and a frame without a
//!   checksum is a fatal `Mismatch` (the ranks disagree on the setting); a
//!   reader with checksums off still checks any checksum it is sent.
//! - LK-4: a writer knows whether it stopped in the middle of a frame
//!   ([`LinkWriter::mid_frame`]); an Abort frame is only written on a link
//!   that is at a frame boundary, so it is never read as payload.
//! - LK-8: a payload is written and read in pieces of at most
//!   [`SOCKET_UNIT`] bytes (one above [`EXCHANGE_SPLIT`] written in pieces
//!   of [`EXCHANGE_UNIT`] while the link carries data both ways in the
//!   step), and checksummed and reduced in pieces of at most
//!   [`WORK_UNIT`], and the transfer counts each piece with its [`Pacer`],
//!   so a frame of any size gives the runtime back at least every
//!   [`SLICE`](crate::pace::SLICE) of work ([PA-1]), give or
//!   take one socket call; a frame under
//!   [`CHECK_BYTES`](crate::pace::CHECK_BYTES) never reads
//!   the clock ([PA-2]). The CRC32C of a received payload is folded
//!   piece by piece as it arrives, and a reduction still combines only
//!   bytes whose checksum was checked (LK-7).
//!
//! - LK-9: a frame whose fingerprint differs from the nonzero one the
//!   reader expects is a fatal `Mismatch` naming the sender, found before a
//!   payload byte is read; an Abort frame whose byte 2 is 1 becomes a fatal
//!   `Mismatch` on the reader (the sender found the ranks' ops disagree),
//!   any other Abort frame `PeerFailed`.
//! - LK-10: without checksums, a reduction combines each piece of
//!   [`REDUCE_PIECE`] bytes as soon as it has arrived, through the link's
//!   one scratch buffer (no allocation per frame); a step that fails in the
//!   middle of a frame leaves its reduction target partly combined, which
//!   only a failed op can observe. With checksums the whole payload is
//!   checked first (LK-7).
//!
//! [PA-1]: crate::backends::cpu::pace#invariants
//! [PA-2]: crate::backends::cpu::pace#invariants

use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

use super::direct::{DirectRead, DirectWrite};
use crate::backends::OpCtx;
use crate::error::{Error, Result};
use crate::op::ReduceOp;
use crate::pace::Pacer;
use crate::tensor::DType;

/// Size of a frame header in bytes.
pub(crate) const FRAME_HEADER_LEN: usize = 40;
/// Byte 2 of an Abort frame sent because the ranks' ops disagree ([LK-9](self#invariants)).
pub(crate) const ABORT_MISMATCH: u8 = 1;

/// What a Header or Data frame is matched on besides its kind and class:
/// the op's sequence number (collective, or per peer for point-to-point)
/// and its fingerprint, 0 when unchecked ([LK-9](self#invariants)).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Tag {
    /// Sequence number.
    pub(crate) seq: u64,
    /// Fingerprint ([`crate::checks`]); 0: not checked.
    pub(crate) fp: u64,
}

impl Tag {
    /// The tag of a collective's frames: its seq and fingerprint.
    pub(crate) fn of(ctx: &OpCtx) -> Tag {
        Tag {
            seq: ctx.seq,
            fp: ctx.fingerprint,
        }
    }

    /// A tag that checks no fingerprint.
    pub(crate) const fn seq(seq: u64) -> Tag {
        Tag { seq, fp: 0 }
    }
}

/// A hint for an out-of-step error where one side sent or expected a
/// Header frame (code `got` arrived, `want` was expected): ranks that
/// disagree on `CHORUS_CHECKS` meet that way (one exchanges headers, the
/// other not).
pub(crate) fn checks_hint(got: u8, want: FrameKind) -> &'static str {
    if got == FrameKind::Header as u8 || want == FrameKind::Header {
        "; do all ranks use the same CHORUS_CHECKS?"
    } else {
        ""
    }
}

/// The error for a frame or ring message from `peer` whose fingerprint
/// `got` is not the `want` this rank's op has ([LK-9](self#invariants)).
pub(crate) fn fingerprint_mismatch(ctx: &OpCtx, peer: usize, want: u64, got: u64) -> Error {
    let why = if got == 0 {
        format!("rank {peer} does not check its ops (CHORUS_CHECKS=off there?)")
    } else if ctx.kind == crate::op::OpKind::P2P {
        format!(
            "rank {peer}'s matching transfer has another dtype or length than this rank's \
             (fingerprint {got:#018x}, this rank's {want:#018x})"
        )
    } else {
        format!(
            "rank {peer} issued a different op: its kind, dtype, count, root, reduce op or \
             split sizes differ from this rank's (fingerprint {got:#018x}, this rank's {want:#018x}); \
             run with CHORUS_CHECKS=strict to have the field named"
        )
    };
    ctx.mismatch(format!(
        "{} #{} on rank {}: {why}; the communicator is aborted",
        ctx.kind.name(),
        ctx.seq,
        ctx.rank
    ))
}
/// Largest Header frame payload accepted ([LK-3](self#invariants)).
pub(crate) const MAX_HEADER_FRAME: u64 = 16 << 20;
/// Largest Abort frame payload accepted ([LK-3](self#invariants)).
pub(crate) const MAX_ABORT_FRAME: u64 = 64 << 10;
/// Largest piece of an unchecksummed reduction read before it is combined
/// ([LK-10](self#invariants)): small enough to stay in cache between the
/// read and the reduction, a multiple of every element size.
pub(crate) const REDUCE_PIECE: usize = 64 << 10;
/// Payloads up to this size are written together with their header, in one
/// `write`: a small op's Header frame carries up to 16 KiB of data plus its
/// op header, and two writes would be two segments on a `TCP_NODELAY` link.
const COALESCE_LIMIT: usize = 32 << 10;
/// Frame flag: bytes 4..8 of the header hold the payload's CRC32C.
pub(crate) const FLAG_CRC: u8 = 1;
/// Largest piece of a payload checksummed, reduced or copied between two
/// counts of the transfer's [`Pacer`] ([LK-8](self#invariants)): 25-100 µs
/// of work. A multiple of every element size.
pub(crate) const WORK_UNIT: usize = 256 << 10;
/// Largest piece of a payload written or read between two counts of the
/// [`Pacer`] ([LK-8](self#invariants)): 100-300 µs on loopback. Measured on
/// a 2-rank TCP all_reduce (docs/performance.md, "Long transfers yield"):
/// pieces of [`WORK_UNIT`] cost 5-14 % of the bandwidth at 16-64 MiB;
/// 1-4 MiB pieces 4-7 % at 16 MiB and nothing measurable at 64 MiB.
pub(crate) const SOCKET_UNIT: usize = 1 << 20;
/// Largest piece of a payload above [`EXCHANGE_SPLIT`] written in one
/// socket call while the same link also carries the peer's data the other
/// way in the step (an exchange: recursive halving and doubling, a 2-rank
/// ring). Measured on loopback, 2 ranks, alternating builds, the kernel's
/// TCP metrics flushed before each launch (docs/performance.md, "The TCP
/// bandwidth path"): a 2 MiB all_gather (1 MiB each way) took 165-176 µs
/// with 256 KiB writes against 279-288 µs with 1 MiB ones, a 4 MiB
/// all_reduce 787-849 against 1 126-1 270 µs; one-way transfers
/// (send_recv) were 20-50 % slower with 256 KiB writes, so they keep
/// [`SOCKET_UNIT`].
pub(crate) const EXCHANGE_UNIT: usize = 256 << 10;
/// Payloads up to this size go in one piece even in an exchange: split in
/// two, a 512 KiB one made a 1 MiB all_gather 5 % slower.
pub(crate) const EXCHANGE_SPLIT: usize = 512 << 10;

/// The CRC32C of `bytes`, computed [`WORK_UNIT`] at a time ([LK-8](self#invariants)).
async fn crc32c_paced(bytes: &[u8], pace: &mut Pacer) -> u32 {
    let mut crc = 0;
    for piece in bytes.chunks(WORK_UNIT) {
        crc = crc32c::crc32c_append(crc, piece);
        pace.account(piece.len()).await;
    }
    crc
}

/// Whether `CHORUS_CHECKSUM` asks for a CRC32C on every frame and ring
/// message ([LK-7](self#invariants)): `1`, `true`, `yes` or `on`. Read when
/// a communicator's links are set up.
pub(crate) fn checksum_from_env() -> bool {
    std::env::var("CHORUS_CHECKSUM").is_ok_and(|v| {
        matches!(
            v.trim().to_ascii_lowercase().as_str(),
            "1" | "true" | "yes" | "on"
        )
    })
}

/// The checksum bytes of a header: `(flags, crc)`; `None` if malformed
/// (a nonzero byte 2, unknown flags, or a checksum without its flag).
pub(crate) fn crc_field(b: &[u8]) -> Option<Option<u32>> {
    let crc = le_u32(&b[4..8]);
    match (b[2], b[3]) {
        (0, 0) if crc == 0 => Some(None),
        (0, FLAG_CRC) => Some(Some(crc)),
        _ => None,
    }
}

/// Check `payload` against the checksum `sent` with it ([LK-7](self#invariants)).
pub(crate) fn verify_crc(
    ctx: &OpCtx,
    peer: usize,
    required: bool,
    sent: Option<u32>,
    payload_crc: impl FnOnce() -> u32,
    what: &str,
) -> Result<()> {
    match sent {
        Some(want) => {
            let got = payload_crc();
            if got != want {
                return Err(ctx.corrupted(
                    peer,
                    format!(
                        "{what}: CRC32C {got:#010x} of the received bytes, {want:#010x} sent (seq {})",
                        ctx.seq
                    ),
                ));
            }
            Ok(())
        }
        None if required => Err(ctx.mismatch(format!(
            "rank {peer} sent a {what} without a checksum, but this rank has CHORUS_CHECKSUM on: \
             set it alike on every rank"
        ))),
        None => Ok(()),
    }
}

/// What a frame carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FrameKind {
    /// An op header (consistency check).
    Header = 1,
    /// Payload of a transfer.
    Data = 2,
    /// The sender is aborting; payload = failed ranks and reason.
    Abort = 3,
}

impl FrameKind {
    fn from_code(c: u8) -> Option<FrameKind> {
        match c {
            1 => Some(FrameKind::Header),
            2 => Some(FrameKind::Data),
            3 => Some(FrameKind::Abort),
            _ => None,
        }
    }

    fn name(self) -> &'static str {
        match self {
            FrameKind::Header => "header",
            FrameKind::Data => "data",
            FrameKind::Abort => "abort",
        }
    }
}

/// Which sequence space a frame belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FrameClass {
    /// Collective ops (seq = collective counter).
    Collective = 1,
    /// Point-to-point (seq = per-peer counter).
    P2P = 2,
}

impl FrameClass {
    fn name(c: u8) -> &'static str {
        match c {
            1 => "collective",
            2 => "p2p",
            _ => "<invalid class>",
        }
    }
}

fn encode_frame_header(
    kind: FrameKind,
    class: FrameClass,
    epoch: u64,
    tag: Tag,
    len: u64,
    crc: Option<u32>,
) -> [u8; FRAME_HEADER_LEN] {
    let mut h = [0u8; FRAME_HEADER_LEN];
    h[0] = kind as u8;
    h[1] = class as u8;
    if let Some(c) = crc {
        h[3] = FLAG_CRC;
        h[4..8].copy_from_slice(&c.to_le_bytes());
    }
    h[8..16].copy_from_slice(&epoch.to_le_bytes());
    h[16..24].copy_from_slice(&tag.seq.to_le_bytes());
    h[24..32].copy_from_slice(&len.to_le_bytes());
    h[32..40].copy_from_slice(&tag.fp.to_le_bytes());
    h
}

fn le_u64(b: &[u8]) -> u64 {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    u64::from_le_bytes(a)
}

fn le_u32(b: &[u8]) -> u32 {
    let mut a = [0u8; 4];
    a.copy_from_slice(&b[..4]);
    u32::from_le_bytes(a)
}

/// Encode an Abort payload: failed ranks and reason (truncated to fit).
pub(crate) fn encode_abort(reason: &str, failed: &[usize]) -> Vec<u8> {
    let max_ranks = 1024;
    let ranks: Vec<u32> = failed
        .iter()
        .take(max_ranks)
        .map(|&r| u32::try_from(r).unwrap_or(u32::MAX))
        .collect();
    let mut out = Vec::with_capacity(4 + 4 * ranks.len() + reason.len().min(4096));
    out.extend_from_slice(&(ranks.len() as u32).to_le_bytes());
    for r in &ranks {
        out.extend_from_slice(&r.to_le_bytes());
    }
    let mut end = reason.len().min(4096);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    out.extend_from_slice(&reason.as_bytes()[..end]);
    out
}

/// Decode an Abort payload leniently: `(failed ranks, reason)`.
fn decode_abort(payload: &[u8]) -> (Vec<usize>, String) {
    if payload.len() < 4 {
        return (Vec::new(), "<malformed abort frame>".into());
    }
    let n = le_u32(payload) as usize;
    let Some(rest) = payload.get(4..).filter(|r| r.len() >= n.saturating_mul(4)) else {
        return (Vec::new(), "<malformed abort frame>".into());
    };
    let failed = rest[..4 * n]
        .chunks_exact(4)
        .map(|c| le_u32(c) as usize)
        .collect();
    let reason = String::from_utf8_lossy(&rest[4 * n..]).into_owned();
    (failed, reason)
}

/// The sending half of a link.
#[derive(Debug)]
pub(crate) struct LinkWriter {
    peer: usize,
    epoch: u64,
    half: DirectWrite,
    /// Set while a frame is partly written; still set if that write was
    /// cancelled, in which case the link cannot carry another frame ([LK-4](self#invariants)).
    mid_frame: bool,
    /// Send a CRC32C with every Header and Data frame ([LK-7](self#invariants)).
    checksum: bool,
    /// Reused to write a small frame's header and payload at once.
    coalesce: Vec<u8>,
    /// The step also receives on this link: payloads above
    /// [`EXCHANGE_SPLIT`] are written [`EXCHANGE_UNIT`] at a time.
    exchange: bool,
}

impl LinkWriter {
    /// The rank at the other end.
    pub(crate) fn peer(&self) -> usize {
        self.peer
    }

    /// Write large payloads in pieces of [`EXCHANGE_UNIT`] while `exchange`
    /// (the link carries the peer's data the other way at the same time),
    /// else of [`SOCKET_UNIT`].
    pub(crate) fn set_exchange(&mut self, exchange: bool) {
        self.exchange = exchange;
    }

    /// Whether a frame was left half-written ([LK-4](self#invariants)).
    pub(crate) fn mid_frame(&self) -> bool {
        self.mid_frame
    }

    /// Write one frame. Not cancel safe: a cancelled write leaves
    /// `mid_frame` set.
    #[cfg(test)]
    pub(crate) async fn write_frame(
        &mut self,
        kind: FrameKind,
        class: FrameClass,
        tag: Tag,
        payload: &[u8],
    ) -> std::io::Result<()> {
        self.write_frame_paced(kind, class, tag, payload, &mut Pacer::new())
            .await
    }

    /// Write an Abort frame; `mismatch` marks an abort because the ranks'
    /// ops disagree ([LK-9](self#invariants)).
    pub(crate) async fn write_abort(
        &mut self,
        payload: &[u8],
        mismatch: bool,
    ) -> std::io::Result<()> {
        let mut hdr = encode_frame_header(
            FrameKind::Abort,
            FrameClass::Collective,
            self.epoch,
            Tag::seq(0),
            payload.len() as u64,
            None,
        );
        if mismatch {
            hdr[2] = ABORT_MISMATCH;
        }
        self.write_raw(&hdr, payload, &mut Pacer::new()).await
    }

    /// [`LinkWriter::write_frame`], counting the work with `pace` ([LK-8](self#invariants)).
    pub(crate) async fn write_frame_paced(
        &mut self,
        kind: FrameKind,
        class: FrameClass,
        tag: Tag,
        payload: &[u8],
        pace: &mut Pacer,
    ) -> std::io::Result<()> {
        let crc = if self.checksum && kind != FrameKind::Abort {
            // Before the first byte: a write cancelled here leaves the
            // link at a frame boundary.
            Some(crc32c_paced(payload, pace).await)
        } else {
            None
        };
        let hdr = encode_frame_header(kind, class, self.epoch, tag, payload.len() as u64, crc);
        crate::debug::DATA_MESSAGES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.write_raw(&hdr, payload, pace).await
    }

    /// Write `hdr` and `payload` as one frame: together in one `write` up to
    /// [`COALESCE_LIMIT`], else the header with the first unit
    /// ([`SOCKET_UNIT`], or [`EXCHANGE_UNIT`] for a payload above
    /// [`EXCHANGE_SPLIT`] in an exchange) of the payload in one vectored
    /// `write`, then the rest a unit at a time;
    /// `mid_frame` is set while it is under way ([LK-4](self#invariants)).
    async fn write_raw(
        &mut self,
        hdr: &[u8; FRAME_HEADER_LEN],
        payload: &[u8],
        pace: &mut Pacer,
    ) -> std::io::Result<()> {
        self.mid_frame = true;
        if payload.len() <= COALESCE_LIMIT {
            let buf = &mut self.coalesce;
            buf.clear();
            buf.extend_from_slice(hdr);
            buf.extend_from_slice(payload);
            self.half.write_all(buf).await?;
            pace.account(buf.len()).await;
        } else {
            let unit = if self.exchange && payload.len() > EXCHANGE_SPLIT {
                EXCHANGE_UNIT
            } else {
                SOCKET_UNIT
            };
            let (first, rest) = payload.split_at(unit.min(payload.len()));
            let mut n = self
                .half
                .write_vectored(&[std::io::IoSlice::new(hdr), std::io::IoSlice::new(first)])
                .await?;
            if n < hdr.len() {
                self.half.write_all(&hdr[n..]).await?;
                n = hdr.len();
            }
            self.half.write_all(&first[n - hdr.len()..]).await?;
            pace.account(first.len()).await;
            for piece in rest.chunks(unit) {
                self.half.write_all(piece).await?;
                pace.account(piece.len()).await;
            }
        }
        self.mid_frame = false;
        Ok(())
    }

    /// Write a frame, mapping failures to `PeerFailed` for `ctx`.
    pub(crate) async fn send(
        &mut self,
        ctx: &OpCtx,
        kind: FrameKind,
        class: FrameClass,
        tag: Tag,
        payload: &[u8],
    ) -> Result<()> {
        self.send_paced(ctx, kind, class, tag, payload, &mut Pacer::new())
            .await
    }

    /// [`LinkWriter::send`], counting the work with `pace` ([LK-8](self#invariants)).
    pub(crate) async fn send_paced(
        &mut self,
        ctx: &OpCtx,
        kind: FrameKind,
        class: FrameClass,
        tag: Tag,
        payload: &[u8],
        pace: &mut Pacer,
    ) -> Result<()> {
        let peer = self.peer;
        tracing::trace!(
            peer,
            kind = kind.name(),
            seq = tag.seq,
            bytes = payload.len(),
            "send frame"
        );
        self.write_frame_paced(kind, class, tag, payload, pace)
            .await
            .map_err(|e| {
                ctx.peer_failed(
                    vec![peer],
                    format!("sending a {} frame to rank {peer} failed: {e}", kind.name()),
                )
            })
    }

    /// Shut down the sending direction (best effort).
    pub(crate) async fn shutdown(&mut self) {
        let _ = self.half.shutdown().await;
    }

    /// The socket's file descriptor, to wait on it in the kernel
    /// ([`super::direct::wait_ready`]).
    pub(crate) fn fd(&self) -> std::os::fd::RawFd {
        self.half.fd()
    }

    /// The switch that makes writes go straight to the socket (DR-1 in
    /// [`super::direct`]): on only while a blocked caller's direct path
    /// polls.
    pub(crate) fn direct_switch(&self) -> super::direct::Switch {
        self.half.switch()
    }
}

/// The frames to send to one peer in one step, in order (most steps send
/// one, which needs no heap allocation).
pub(crate) type SendFrames<'a> = smallvec::SmallVec<[(FrameKind, Tag, &'a [u8]); 1]>;
/// The frames to receive from one peer in one step, in order.
pub(crate) type RecvFrames<'a> = smallvec::SmallVec<[(FrameKind, Tag, RecvInto<'a>); 1]>;
/// A step's sends, per peer (each peer at most once). Inline up to two
/// peers, the most any step of a tree, ring or recursive-doubling schedule
/// and a 2-rank direct op has: such a step allocates nothing for them.
pub(crate) type Sends<'a> = smallvec::SmallVec<[(usize, SendFrames<'a>); 2]>;
/// A step's receives, per peer (each peer at most once), as [`Sends`].
pub(crate) type Recvs<'a> = smallvec::SmallVec<[(usize, RecvFrames<'a>); 2]>;

/// Where a received payload goes.
pub(crate) enum RecvInto<'a> {
    /// Exactly this many bytes, into this slice.
    Exact(&'a mut [u8]),
    /// Any length up to the bound, into this vector (replacing its contents).
    Bounded(&'a mut Vec<u8>, u64),
    /// Exactly this many bytes, combined into this slice with `op`
    /// (elements of `dtype`; used by shared-memory links to reduce straight
    /// out of the ring).
    Reduce(&'a mut [u8], DType, ReduceOp),
}

impl RecvInto<'_> {
    /// Whether a payload of `len` bytes fits this target (`Err` says why not).
    pub(crate) fn accepts(&self, len: u64) -> std::result::Result<(), String> {
        match self {
            RecvInto::Exact(b) | RecvInto::Reduce(b, ..) if len != b.len() as u64 => Err(format!(
                "sent {len} bytes but this rank expects {}",
                b.len()
            )),
            RecvInto::Bounded(_, max) if len > *max => {
                Err(format!("sent a {len}-byte frame (limit {max})"))
            }
            _ => Ok(()),
        }
    }
}

/// Make room for a `len`-byte message in `buf` (a [`RecvInto::Bounded`]
/// target), failing instead of aborting when it cannot be allocated.
pub(crate) fn reserve(buf: &mut Vec<u8>, len: u64) -> std::result::Result<(), String> {
    usize::try_from(len)
        .ok()
        .and_then(|l| buf.try_reserve_exact(l).ok())
        .ok_or_else(|| format!("sent a {len}-byte message, more than this rank can allocate"))
}

/// Whether the peer's end of a link is still there, without blocking.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Liveness {
    /// Nothing to read and not closed.
    Quiet,
    /// Bytes are waiting (on a link used only for control, an Abort frame).
    Readable,
    /// The peer closed the connection or its process died.
    Closed,
}

/// The receiving half of a link.
#[derive(Debug)]
pub(crate) struct LinkReader {
    peer: usize,
    epoch: u64,
    half: BufReader<DirectRead>,
    /// Require and check a CRC32C on every Header and Data frame ([LK-7](self#invariants)).
    checksum: bool,
    /// Where an unchecksummed reduction's pieces land before they are
    /// combined ([LK-10](self#invariants)): empty until this link first
    /// reduces, then at most [`REDUCE_PIECE`] bytes, kept for the link's
    /// life.
    scratch: Vec<u8>,
}

impl LinkReader {
    fn io_error(&self, ctx: &OpCtx, e: std::io::Error) -> Error {
        let peer = self.peer;
        if e.kind() == std::io::ErrorKind::UnexpectedEof {
            ctx.peer_failed(
                vec![peer],
                format!("rank {peer} closed its link (process exited or aborted)"),
            )
        } else {
            ctx.peer_failed(
                vec![peer],
                format!("receiving from rank {peer} failed: {e}"),
            )
        }
    }

    /// Read one frame of `kind`/`class`/`seq` into `into`. An Abort frame from
    /// the peer becomes `PeerFailed` with the peer's failed ranks (or the peer
    /// itself) and reason; anything else unexpected is a `Mismatch` ([LK-3](self#invariants)).
    pub(crate) async fn recv(
        &mut self,
        ctx: &OpCtx,
        kind: FrameKind,
        class: FrameClass,
        tag: Tag,
        into: RecvInto<'_>,
    ) -> Result<()> {
        self.recv_paced(ctx, kind, class, tag, into, &mut Pacer::new())
            .await
    }

    /// Read `buf.len()` payload bytes [`SOCKET_UNIT`] at a time, folding their
    /// CRC32C when `fold` ([LK-8](self#invariants)); returns the CRC (0
    /// when not folded).
    async fn read_paced(
        &mut self,
        ctx: &OpCtx,
        buf: &mut [u8],
        fold: bool,
        pace: &mut Pacer,
    ) -> Result<u32> {
        let mut crc = 0;
        for piece in buf.chunks_mut(SOCKET_UNIT) {
            self.half
                .read_exact(piece)
                .await
                .map_err(|e| self.io_error(ctx, e))?;
            if fold {
                crc = crc32c::crc32c_append(crc, piece);
            }
            pace.account(piece.len()).await;
        }
        Ok(crc)
    }

    /// [`LinkReader::recv`], counting the work with `pace` ([LK-8](self#invariants)).
    pub(crate) async fn recv_paced(
        &mut self,
        ctx: &OpCtx,
        kind: FrameKind,
        class: FrameClass,
        tag: Tag,
        into: RecvInto<'_>,
        pace: &mut Pacer,
    ) -> Result<()> {
        let peer = self.peer;
        let seq = tag.seq;
        let mut hdr = [0u8; FRAME_HEADER_LEN];
        self.half
            .read_exact(&mut hdr)
            .await
            .map_err(|e| self.io_error(ctx, e))?;
        let got_epoch = le_u64(&hdr[8..16]);
        let got_seq = le_u64(&hdr[16..24]);
        let len = le_u64(&hdr[24..32]);
        let got_fp = le_u64(&hdr[32..40]);
        let got_kind = FrameKind::from_code(hdr[0]);
        if got_kind == Some(FrameKind::Abort) {
            if len > MAX_ABORT_FRAME {
                return Err(ctx.mismatch(format!(
                    "rank {peer} sent an abort frame of {len} bytes (limit {MAX_ABORT_FRAME})"
                )));
            }
            let mut payload = vec![0u8; len as usize];
            self.half
                .read_exact(&mut payload)
                .await
                .map_err(|e| self.io_error(ctx, e))?;
            let (mut failed, reason) = decode_abort(&payload);
            if hdr[2] == ABORT_MISMATCH {
                return Err(ctx.mismatch(format!(
                    "rank {peer} found that the ranks' ops disagree and aborted the communicator: {reason}"
                )));
            }
            if failed.is_empty() {
                failed.push(peer);
            }
            return Err(ctx.peer_failed(failed, format!("rank {peer} aborted: {reason}")));
        }
        let expect = || {
            format!(
                "expected a {} {} frame (epoch {}, seq {seq})",
                FrameClass::name(class as u8),
                kind.name(),
                self.epoch
            )
        };
        let crc = crc_field(&hdr);
        if got_kind != Some(kind)
            || hdr[1] != class as u8
            || crc.is_none()
            || got_epoch != self.epoch
            || got_seq != seq
        {
            return Err(ctx.mismatch(format!(
                "rank {peer} is out of step: {} but got a {} {} frame (epoch {got_epoch}, seq {got_seq}, {len} bytes){}",
                expect(),
                FrameClass::name(hdr[1]),
                got_kind.map(FrameKind::name).unwrap_or("<invalid kind>"),
                checks_hint(hdr[0], kind)
            )));
        }
        // LK-9: the op's fingerprint, before any payload byte.
        if tag.fp != 0 && got_fp != tag.fp {
            return Err(fingerprint_mismatch(ctx, peer, tag.fp, got_fp));
        }
        let crc = crc.flatten();
        let required = self.checksum;
        // LK-8: the CRC is folded as the pieces arrive, when one was sent.
        let fold = crc.is_some();
        let check = |got: u32| verify_crc(ctx, peer, required, crc, || got, kind.name());
        match into {
            RecvInto::Exact(buf) => {
                if len != buf.len() as u64 {
                    return Err(ctx.mismatch(format!(
                        "rank {peer} sent {len} bytes but this rank expects {} ({})",
                        buf.len(),
                        expect()
                    )));
                }
                let got = self.read_paced(ctx, buf, fold, pace).await?;
                check(got)?;
            }
            RecvInto::Reduce(buf, dtype, op) => {
                if len != buf.len() as u64 {
                    return Err(ctx.mismatch(format!(
                        "rank {peer} sent {len} bytes but this rank expects {} ({})",
                        buf.len(),
                        expect()
                    )));
                }
                if fold {
                    let mut tmp = vec![0u8; buf.len()];
                    let got = self.read_paced(ctx, &mut tmp, fold, pace).await?;
                    // LK-7: checked before a byte is combined.
                    check(got)?;
                    // WORK_UNIT is a multiple of every element size.
                    for (dst, src) in buf.chunks_mut(WORK_UNIT).zip(tmp.chunks(WORK_UNIT)) {
                        crate::kernels::reduce_into(dtype, op, dst, src)?;
                        pace.account(src.len()).await;
                    }
                } else {
                    // LK-10: no checksum to wait for, so each piece is
                    // combined as it arrives, while the next one is on
                    // its way.
                    check(0)?;
                    let mut scratch = std::mem::take(&mut self.scratch);
                    // Grown once to its largest need, never shrunk: a
                    // smaller frame after a larger one fills no bytes.
                    let need = REDUCE_PIECE.min(buf.len());
                    if scratch.len() < need {
                        scratch.resize(need, 0);
                    }
                    // REDUCE_PIECE is a multiple of every element size.
                    for dst in buf.chunks_mut(REDUCE_PIECE) {
                        let src = &mut scratch[..dst.len()];
                        self.read_paced(ctx, src, false, pace).await?;
                        crate::kernels::reduce_into(dtype, op, dst, src)?;
                        pace.account(src.len()).await;
                    }
                    self.scratch = scratch;
                }
            }
            RecvInto::Bounded(buf, max) => {
                if len > max {
                    return Err(ctx.mismatch(format!(
                        "rank {peer} sent a {len}-byte {} frame (limit {max})",
                        kind.name()
                    )));
                }
                buf.clear();
                reserve(buf, len).map_err(|w| ctx.mismatch(format!("rank {peer} {w}")))?;
                buf.resize(len as usize, 0);
                let got = self.read_paced(ctx, buf, fold, pace).await?;
                check(got)?;
            }
        }
        tracing::trace!(peer, kind = kind.name(), seq, bytes = len, "received frame");
        Ok(())
    }
}

impl LinkReader {
    /// The socket's file descriptor, to wait on it in the kernel
    /// ([`super::direct::wait_ready`]).
    pub(crate) fn fd(&self) -> std::os::fd::RawFd {
        self.half.get_ref().fd()
    }

    /// The switch that makes reads go straight to the socket (DR-1 in
    /// [`super::direct`]): on only while a blocked caller's direct path
    /// polls.
    pub(crate) fn direct_switch(&self) -> super::direct::Switch {
        self.half.get_ref().switch()
    }

    /// Peek at the socket without blocking: closed, readable, or quiet.
    pub(crate) fn liveness(&self) -> Liveness {
        if !self.half.buffer().is_empty() {
            return Liveness::Readable;
        }
        let fd = self.half.get_ref().fd();
        let mut b = [0u8; 1];
        // SAFETY: `fd` is the live socket owned by this reader; the 1-byte
        // buffer is valid for writes; MSG_PEEK leaves the data in the socket.
        let n = unsafe {
            libc::recv(
                fd,
                b.as_mut_ptr().cast(),
                1,
                libc::MSG_PEEK | libc::MSG_DONTWAIT,
            )
        };
        match n {
            0 => Liveness::Closed,
            n if n > 0 => Liveness::Readable,
            _ => match std::io::Error::last_os_error().kind() {
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted => Liveness::Quiet,
                _ => Liveness::Closed,
            },
        }
    }

    /// Read and discard whatever the peer still sends, until it closes or
    /// `linger` passes, then drop the link. Used after an abort: a peer
    /// blocked writing to us is released, and our Abort frame is not lost
    /// to a reset caused by closing a socket with unread data.
    pub(crate) async fn drain(mut self, linger: Duration) {
        let mut buf = vec![0u8; 64 << 10];
        let _ = tokio::time::timeout(linger, async {
            while let Ok(n) = self.half.read(&mut buf).await {
                if n == 0 {
                    break;
                }
            }
        })
        .await;
    }
}

/// Split a connected, authenticated stream into the two halves of a link;
/// `checksum`: whether frames carry and require a CRC32C ([LK-7](self#invariants)).
pub(crate) fn split_link(
    peer: usize,
    epoch: u64,
    stream: TcpStream,
    checksum: bool,
) -> (LinkReader, LinkWriter) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(peer, error = %e, "could not set TCP_NODELAY");
    }
    let (r, w) = stream.into_split();
    (
        LinkReader {
            peer,
            epoch,
            half: BufReader::with_capacity(64 << 10, DirectRead::new(r)),
            checksum,
            scratch: Vec::new(),
        },
        LinkWriter {
            peer,
            epoch,
            half: DirectWrite::new(w),
            mid_frame: false,
            checksum,
            coalesce: Vec::new(),
            exchange: false,
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn abort_payload_round_trips_and_tolerates_garbage() {
        let p = encode_abort("boom", &[3, 1]);
        assert_eq!(decode_abort(&p), (vec![3, 1], "boom".to_string()));
        assert_eq!(decode_abort(&[1, 2]).0, Vec::<usize>::new());
        assert_eq!(decode_abort(&[9, 0, 0, 0, 1]).0, Vec::<usize>::new());
    }

    #[test]
    fn frame_header_layout_is_little_endian() {
        let h = encode_frame_header(
            FrameKind::Data,
            FrameClass::P2P,
            7,
            Tag { seq: 9, fp: 11 },
            300,
            None,
        );
        assert_eq!(h[0], 2);
        assert_eq!(h[1], 2);
        assert_eq!(&h[2..8], &[0u8; 6]);
        assert_eq!(le_u64(&h[8..]), 7);
        assert_eq!(le_u64(&h[16..]), 9);
        assert_eq!(le_u64(&h[24..]), 300);
        assert_eq!(le_u64(&h[32..]), 11);
        let h = encode_frame_header(
            FrameKind::Data,
            FrameClass::P2P,
            7,
            Tag::seq(9),
            300,
            Some(0xdead_beef),
        );
        assert_eq!((h[2], h[3]), (0, FLAG_CRC));
        assert_eq!(le_u32(&h[4..]), 0xdead_beef);
        assert_eq!(crc_field(&h), Some(Some(0xdead_beef)));
        assert_eq!(crc_field(&[0u8; 8]), Some(None));
        // A checksum without its flag, unknown flags, a nonzero byte 2.
        assert_eq!(crc_field(&[0, 0, 0, 0, 1, 0, 0, 0]), None);
        assert_eq!(crc_field(&[0, 0, 0, 2, 0, 0, 0, 0]), None);
        assert_eq!(crc_field(&[0, 0, 1, FLAG_CRC, 0, 0, 0, 0]), None);
    }

    fn ctx() -> OpCtx {
        OpCtx {
            comm: "crc".into(),
            rank: 1,
            size: 2,
            epoch: 0,
            kind: crate::backends::OpKind::Broadcast,
            seq: 4,
            fingerprint: 0,
            headers: true,
            may_block: false,
            order: Default::default(),
        }
    }

    /// A connected link pair on loopback: (this end's reader, the peer's
    /// writer), with checksums on or off at each end.
    async fn pair(reader_crc: bool, writer_crc: bool) -> (LinkReader, LinkWriter) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let addr = l.local_addr().expect("addr");
        let (a, b) = tokio::join!(TcpStream::connect(addr), l.accept());
        // This rank's link to rank 1, and rank 1's to this rank.
        let (reader, _) = split_link(1, 0, a.expect("connect"), reader_crc);
        let (_, writer) = split_link(0, 0, b.expect("accept").0, writer_crc);
        (reader, writer)
    }

    /// The header of a collective data frame #4 carrying `payload`, with
    /// its checksum, for a test to send a payload other than the one checked.
    fn checked_header(payload: &[u8]) -> [u8; FRAME_HEADER_LEN] {
        encode_frame_header(
            FrameKind::Data,
            FrameClass::Collective,
            0,
            Tag::seq(4),
            payload.len() as u64,
            Some(crc32c::crc32c(payload)),
        )
    }

    async fn recv(r: &mut LinkReader) -> Result<Vec<u8>> {
        let mut buf = Vec::new();
        r.recv(
            &ctx(),
            FrameKind::Data,
            FrameClass::Collective,
            Tag::seq(4),
            RecvInto::Bounded(&mut buf, 1 << 20),
        )
        .await
        .map(|()| buf)
    }

    /// LK-7 on a TCP link: checked frames arrive intact, a flipped payload
    /// bit is `Corrupted` naming the sender, a missing checksum is a fatal
    /// `Mismatch` for a reader that requires one, and a reader without the
    /// setting still checks what it is sent.
    #[tokio::test]
    async fn lk_7_checksums_on_tcp_frames() {
        let payload: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        // Intact, both ends on.
        let (mut r, mut w) = pair(true, true).await;
        w.write_frame(
            FrameKind::Data,
            FrameClass::Collective,
            Tag::seq(4),
            &payload,
        )
        .await
        .expect("write");
        assert_eq!(recv(&mut r).await.expect("intact"), payload);

        // One bit flipped after the checksum was taken.
        let (mut r, mut w) = pair(true, true).await;
        let hdr = checked_header(&payload);
        let mut bad = payload.clone();
        bad[54_321] ^= 0x10;
        w.half.write_all(&hdr).await.expect("write");
        w.half.write_all(&bad).await.expect("write");
        match recv(&mut r).await {
            Err(Error::Corrupted { peer: 1, .. }) => {}
            other => panic!("expected Corrupted from rank 1, got {other:?}"),
        }

        // The writer does not checksum; this reader requires it.
        let (mut r, mut w) = pair(true, false).await;
        w.write_frame(
            FrameKind::Data,
            FrameClass::Collective,
            Tag::seq(4),
            &payload,
        )
        .await
        .expect("write");
        match recv(&mut r).await {
            Err(e @ Error::Mismatch { fatal: true, .. }) => {
                assert!(e.to_string().contains("CHORUS_CHECKSUM"), "{e}")
            }
            other => panic!("expected a fatal Mismatch, got {other:?}"),
        }

        // A reader without the setting checks a checksum it is sent.
        let (mut r, mut w) = pair(false, true).await;
        let hdr = checked_header(b"abcd");
        w.half.write_all(&hdr).await.expect("write");
        w.half.write_all(b"abce").await.expect("write");
        assert!(matches!(recv(&mut r).await, Err(Error::Corrupted { .. })));
    }

    /// LK-8: in an exchange a payload above `EXCHANGE_SPLIT` goes in
    /// `EXCHANGE_UNIT` pieces and one up to it in one piece; either way the
    /// frame arrives whole and checked, and the writer can leave the
    /// exchange for the next step.
    #[tokio::test]
    async fn lk_8_exchange_pieces_arrive_as_one_frame() {
        let (mut r, mut w) = pair(true, true).await;
        let sizes = [
            EXCHANGE_SPLIT,
            EXCHANGE_SPLIT + 1,
            3 * EXCHANGE_UNIT + 777,
            SOCKET_UNIT + 5,
        ];
        let payloads: Vec<Vec<u8>> = sizes
            .iter()
            .map(|&n| (0..n as u32).map(|i| (i * 7 + n as u32) as u8).collect())
            .collect();
        let sent = payloads.clone();
        let writer = tokio::spawn(async move {
            for (i, p) in sent.iter().enumerate() {
                w.set_exchange(i < 3);
                w.write_frame_paced(
                    FrameKind::Data,
                    FrameClass::Collective,
                    Tag::seq(i as u64),
                    p,
                    &mut Pacer::new(),
                )
                .await
                .expect("write");
            }
            w
        });
        for (i, want) in payloads.iter().enumerate() {
            let mut got = Vec::new();
            r.recv(
                &ctx(),
                FrameKind::Data,
                FrameClass::Collective,
                Tag::seq(i as u64),
                RecvInto::Bounded(&mut got, 4 << 20),
            )
            .await
            .expect("intact");
            assert!(got == *want, "frame {i} of {} bytes", want.len());
        }
        let w = writer.await.expect("writer");
        assert!(!w.mid_frame());
    }

    /// LK-8: a payload of several pieces is checked across them (the CRC
    /// folded piece by piece), and a reduction over TCP combines it only
    /// once the whole payload checked out.
    #[tokio::test]
    async fn lk_8_payloads_of_many_pieces_are_checked_whole() {
        let n = SOCKET_UNIT * 2 + 12_345;
        let payload: Vec<u8> = (0..n as u32).map(|i| (i * 13 + 1) as u8).collect();
        let (mut r, mut w) = pair(true, true).await;
        let mut pace = Pacer::new();
        let sent = payload.clone();
        let writer = tokio::spawn(async move {
            w.write_frame_paced(
                FrameKind::Data,
                FrameClass::Collective,
                Tag::seq(4),
                &sent,
                &mut pace,
            )
            .await
            .expect("write");
            w
        });
        let mut got = Vec::new();
        r.recv(
            &ctx(),
            FrameKind::Data,
            FrameClass::Collective,
            Tag::seq(4),
            RecvInto::Bounded(&mut got, 4 << 20),
        )
        .await
        .expect("intact");
        assert_eq!(got, payload);
        let _w = writer.await.expect("writer");

        // A bit flipped in the last piece: nothing is combined.
        let (mut r, mut w) = pair(true, true).await;
        let hdr = checked_header(&payload);
        let mut bad = payload.clone();
        bad[n - 7] ^= 0x01;
        let writer = tokio::spawn(async move {
            w.half.write_all(&hdr).await.expect("write");
            w.half.write_all(&bad).await.expect("write");
            w
        });
        let mut acc = vec![0u8; n];
        let got = r
            .recv(
                &ctx(),
                FrameKind::Data,
                FrameClass::Collective,
                Tag::seq(4),
                RecvInto::Reduce(&mut acc, DType::U8, ReduceOp::Sum),
            )
            .await;
        assert!(matches!(got, Err(Error::Corrupted { .. })), "{got:?}");
        assert!(
            acc.iter().all(|&b| b == 0),
            "bytes combined before the check"
        );
        let _w = writer.await.expect("writer");
    }
}
