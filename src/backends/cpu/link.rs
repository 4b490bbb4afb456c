//! Data links of the cpu backend: one authenticated TCP connection per pair of
//! ranks, carrying length-prefixed frames.
//!
//! # Setup
//! Every rank binds a listener on `(bind_ip, 0)` and publishes its address in
//! the store under `{key_prefix}/cpu/addr/{rank}`. It also publishes its
//! host id under `{key_prefix}/cpu/host/{rank}`; once the mesh is up,
//! same-host pairs set up shared-memory rings over their link
//! ([`setup_shm`]). Rank `r` connects to every
//! rank below it and accepts from every rank above it (a full mesh). The
//! connector sends a [`HELLO_LEN`]-byte hello proving the job secret; the
//! acceptor checks it and answers with its own proof, bound to the
//! connector's nonce and computed under a different label, so a hello can be
//! neither reflected nor replayed as an answer.
//!
//! Hello layout (little endian): magic `b"CHLK"`, version `u16`, flags `u16`
//! (0 = hello, 1 = answer), from `u32`, to `u32`, epoch `u64`, nonce `[u8; 16]`,
//! HMAC-SHA256 `[u8; 32]`.
//! - hello MAC: `"chorus-link-v1" || key_prefix || from || to || epoch || nonce`
//! - answer MAC: `"chorus-link-v1-accept" || key_prefix || to || from || epoch || nonce || hello MAC`
//!   (`from`/`to` as `u64`; `from` is the connector, `to` the acceptor).
//!
//! # Frames
//! Every message on a link is a [`FRAME_HEADER_LEN`]-byte header followed by
//! `len` payload bytes. Header layout (little endian):
//!
//! | bytes  | field |
//! |--------|-------|
//! | 0      | kind: 1 = Header, 2 = Data, 3 = Abort |
//! | 1      | class: 1 = Collective, 2 = P2P |
//! | 2..8   | zero padding |
//! | 8..16  | epoch `u64` |
//! | 16..24 | seq `u64` |
//! | 24..32 | len `u64` |
//!
//! An Abort payload is `count u32`, `count` failed ranks as `u32`, then the
//! UTF-8 reason.
//!
//! Invariants:
//! - LK-1: a connection is used for frames only after its hello verified; a
//!   connection with a bad hello is closed and accepting continues, so a
//!   stranger cannot break setup.
//! - LK-2: setup finishes within `connect_timeout` (plus a short grace), with
//!   `PeerFailed` naming the ranks that never connected when it does not.
//! - LK-3: a frame's kind, class, epoch, seq and length are checked against
//!   what the reader expects *before* any payload is buffered; Header frames
//!   are at most [`MAX_HEADER_FRAME`] bytes, Abort frames at most
//!   [`MAX_ABORT_FRAME`]. Anything unexpected is a `Mismatch`, never a panic.
//! - LK-4: a writer knows whether it stopped in the middle of a frame
//!   ([`LinkWriter::mid_frame`]); an Abort frame is only written on a link
//!   that is at a frame boundary, so it is never read as payload.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use ring::hmac;
use ring::rand::{SecureRandom, SystemRandom};
use tokio::io::{AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use super::shm::{self, RingConsumer, RingProducer, ShmSegment};
use crate::backends::{BackendInit, OpCtx};
use crate::error::{Error, Result};
use crate::op::ReduceOp;
use crate::tensor::DType;
use crate::transport::TransportError;

/// Size of a frame header in bytes.
pub(crate) const FRAME_HEADER_LEN: usize = 32;
/// Largest Header frame payload accepted (LK-3).
pub(crate) const MAX_HEADER_FRAME: u64 = 16 << 20;
/// Largest Abort frame payload accepted (LK-3).
pub(crate) const MAX_ABORT_FRAME: u64 = 64 << 10;
/// Size of a hello or answer in bytes.
pub(crate) const HELLO_LEN: usize = 72;

const HELLO_MAGIC: [u8; 4] = *b"CHLK";
const LINK_VERSION: u16 = 1;
const HELLO_LABEL: &[u8] = b"chorus-link-v1";
const ANSWER_LABEL: &[u8] = b"chorus-link-v1-accept";
/// Payloads up to this size are written together with their header.
const COALESCE_LIMIT: usize = 16 << 10;
/// Extra time given to the store's own timeout before setup reports missing ranks.
const SETUP_GRACE: Duration = Duration::from_millis(250);
/// How long an accepted connection may take to send its hello; a silent
/// stranger is dropped after this instead of lingering until setup ends.
const HELLO_BOUND: Duration = Duration::from_secs(5);
/// Pause between connection attempts to a published address.
const CONNECT_RETRY: Duration = Duration::from_millis(50);

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
    seq: u64,
    len: u64,
) -> [u8; FRAME_HEADER_LEN] {
    let mut h = [0u8; FRAME_HEADER_LEN];
    h[0] = kind as u8;
    h[1] = class as u8;
    h[8..16].copy_from_slice(&epoch.to_le_bytes());
    h[16..24].copy_from_slice(&seq.to_le_bytes());
    h[24..32].copy_from_slice(&len.to_le_bytes());
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
    half: OwnedWriteHalf,
    /// Set while a frame is partly written; still set if that write was
    /// cancelled, in which case the link cannot carry another frame (LK-4).
    mid_frame: bool,
}

impl LinkWriter {
    /// The rank at the other end.
    pub(crate) fn peer(&self) -> usize {
        self.peer
    }

    /// Whether a frame was left half-written (LK-4).
    pub(crate) fn mid_frame(&self) -> bool {
        self.mid_frame
    }

    /// Write one frame. Not cancel safe: a cancelled write leaves
    /// `mid_frame` set.
    pub(crate) async fn write_frame(
        &mut self,
        kind: FrameKind,
        class: FrameClass,
        seq: u64,
        payload: &[u8],
    ) -> std::io::Result<()> {
        let hdr = encode_frame_header(kind, class, self.epoch, seq, payload.len() as u64);
        self.mid_frame = true;
        if payload.len() <= COALESCE_LIMIT {
            let mut buf = Vec::with_capacity(FRAME_HEADER_LEN + payload.len());
            buf.extend_from_slice(&hdr);
            buf.extend_from_slice(payload);
            self.half.write_all(&buf).await?;
        } else {
            self.half.write_all(&hdr).await?;
            self.half.write_all(payload).await?;
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
        seq: u64,
        payload: &[u8],
    ) -> Result<()> {
        let peer = self.peer;
        tracing::trace!(
            peer,
            kind = kind.name(),
            seq,
            bytes = payload.len(),
            "send frame"
        );
        self.write_frame(kind, class, seq, payload)
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
}

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
    half: BufReader<OwnedReadHalf>,
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
    /// itself) and reason; anything else unexpected is a `Mismatch` (LK-3).
    pub(crate) async fn recv(
        &mut self,
        ctx: &OpCtx,
        kind: FrameKind,
        class: FrameClass,
        seq: u64,
        into: RecvInto<'_>,
    ) -> Result<()> {
        let peer = self.peer;
        let mut hdr = [0u8; FRAME_HEADER_LEN];
        self.half
            .read_exact(&mut hdr)
            .await
            .map_err(|e| self.io_error(ctx, e))?;
        let got_epoch = le_u64(&hdr[8..16]);
        let got_seq = le_u64(&hdr[16..24]);
        let len = le_u64(&hdr[24..32]);
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
            if failed.is_empty() {
                failed.push(peer);
            }
            return Err(ctx.peer_failed(failed, format!("rank {peer} aborted: {reason}")));
        }
        let expect = format!(
            "expected a {} {} frame (epoch {}, seq {seq})",
            FrameClass::name(class as u8),
            kind.name(),
            self.epoch
        );
        if got_kind != Some(kind)
            || hdr[1] != class as u8
            || hdr[2..8] != [0u8; 6]
            || got_epoch != self.epoch
            || got_seq != seq
        {
            return Err(ctx.mismatch(format!(
                "rank {peer} is out of step: {expect} but got a {} {} frame (epoch {got_epoch}, seq {got_seq}, {len} bytes)",
                FrameClass::name(hdr[1]),
                got_kind.map(FrameKind::name).unwrap_or("<invalid kind>"),
            )));
        }
        match into {
            RecvInto::Exact(buf) => {
                if len != buf.len() as u64 {
                    return Err(ctx.mismatch(format!(
                        "rank {peer} sent {len} bytes but this rank expects {} ({expect})",
                        buf.len()
                    )));
                }
                self.half
                    .read_exact(buf)
                    .await
                    .map_err(|e| self.io_error(ctx, e))?;
            }
            RecvInto::Reduce(buf, dtype, op) => {
                if len != buf.len() as u64 {
                    return Err(ctx.mismatch(format!(
                        "rank {peer} sent {len} bytes but this rank expects {} ({expect})",
                        buf.len()
                    )));
                }
                let mut tmp = vec![0u8; buf.len()];
                self.half
                    .read_exact(&mut tmp)
                    .await
                    .map_err(|e| self.io_error(ctx, e))?;
                crate::kernels::reduce_into(dtype, op, buf, &tmp)?;
            }
            RecvInto::Bounded(buf, max) => {
                if len > max {
                    return Err(ctx.mismatch(format!(
                        "rank {peer} sent a {len}-byte {} frame (limit {max})",
                        kind.name()
                    )));
                }
                buf.clear();
                buf.resize(len as usize, 0);
                self.half
                    .read_exact(buf)
                    .await
                    .map_err(|e| self.io_error(ctx, e))?;
            }
        }
        tracing::trace!(peer, kind = kind.name(), seq, bytes = len, "received frame");
        Ok(())
    }
}

impl LinkReader {
    /// Peek at the socket without blocking: closed, readable, or quiet.
    pub(crate) fn liveness(&self) -> Liveness {
        use std::os::fd::AsRawFd;
        if !self.half.buffer().is_empty() {
            return Liveness::Readable;
        }
        let fd = self.half.get_ref().as_ref().as_raw_fd();
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

/// Split a connected, authenticated stream into the two halves of a link.
pub(crate) fn split_link(peer: usize, epoch: u64, stream: TcpStream) -> (LinkReader, LinkWriter) {
    if let Err(e) = stream.set_nodelay(true) {
        tracing::debug!(peer, error = %e, "could not set TCP_NODELAY");
    }
    let (r, w) = stream.into_split();
    (
        LinkReader {
            peer,
            epoch,
            half: BufReader::with_capacity(64 << 10, r),
        },
        LinkWriter {
            peer,
            epoch,
            half: w,
            mid_frame: false,
        },
    )
}

/// The parsed fields of a hello or answer.
struct Hello {
    flags: u16,
    from: usize,
    to: usize,
    epoch: u64,
    nonce: [u8; 16],
    mac: [u8; 32],
}

impl Hello {
    fn encode(&self) -> [u8; HELLO_LEN] {
        let mut b = [0u8; HELLO_LEN];
        b[0..4].copy_from_slice(&HELLO_MAGIC);
        b[4..6].copy_from_slice(&LINK_VERSION.to_le_bytes());
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..12].copy_from_slice(&(self.from as u32).to_le_bytes());
        b[12..16].copy_from_slice(&(self.to as u32).to_le_bytes());
        b[16..24].copy_from_slice(&self.epoch.to_le_bytes());
        b[24..40].copy_from_slice(&self.nonce);
        b[40..72].copy_from_slice(&self.mac);
        b
    }

    fn decode(b: &[u8; HELLO_LEN]) -> std::result::Result<Hello, String> {
        if b[0..4] != HELLO_MAGIC {
            return Err("bad magic (not a chorus data link)".into());
        }
        let version = u16::from_le_bytes([b[4], b[5]]);
        if version != LINK_VERSION {
            return Err(format!(
                "link protocol version {version}, this rank speaks {LINK_VERSION}"
            ));
        }
        let mut nonce = [0u8; 16];
        nonce.copy_from_slice(&b[24..40]);
        let mut mac = [0u8; 32];
        mac.copy_from_slice(&b[40..72]);
        Ok(Hello {
            flags: u16::from_le_bytes([b[6], b[7]]),
            from: le_u32(&b[8..12]) as usize,
            to: le_u32(&b[12..16]) as usize,
            epoch: le_u64(&b[16..24]),
            nonce,
            mac,
        })
    }
}

/// The job secret and scope shared by all handshakes of one setup.
struct Auth {
    key: hmac::Key,
    prefix: String,
}

impl Auth {
    fn hello_msg(&self, from: usize, to: usize, epoch: u64, nonce: &[u8; 16]) -> Vec<u8> {
        let mut m = Vec::with_capacity(64 + self.prefix.len());
        m.extend_from_slice(HELLO_LABEL);
        m.extend_from_slice(self.prefix.as_bytes());
        m.extend_from_slice(&(from as u64).to_le_bytes());
        m.extend_from_slice(&(to as u64).to_le_bytes());
        m.extend_from_slice(&epoch.to_le_bytes());
        m.extend_from_slice(nonce);
        m
    }

    fn answer_msg(&self, hello: &Hello) -> Vec<u8> {
        let mut m = Vec::with_capacity(96 + self.prefix.len());
        m.extend_from_slice(ANSWER_LABEL);
        m.extend_from_slice(self.prefix.as_bytes());
        m.extend_from_slice(&(hello.to as u64).to_le_bytes());
        m.extend_from_slice(&(hello.from as u64).to_le_bytes());
        m.extend_from_slice(&hello.epoch.to_le_bytes());
        m.extend_from_slice(&hello.nonce);
        m.extend_from_slice(&hello.mac);
        m
    }

    fn sign(&self, msg: &[u8]) -> [u8; 32] {
        let tag = hmac::sign(&self.key, msg);
        let mut out = [0u8; 32];
        out.copy_from_slice(tag.as_ref());
        out
    }

    fn verify(&self, msg: &[u8], mac: &[u8; 32]) -> bool {
        hmac::verify(&self.key, msg, mac).is_ok()
    }
}

fn auth_failed(peer: impl std::fmt::Display, detail: impl Into<String>) -> Error {
    Error::Transport(TransportError::AuthFailed {
        peer: peer.to_string(),
        detail: detail.into(),
    })
}

/// Connector side: send our hello to `peer`, check its answer.
async fn handshake_connect(
    auth: &Auth,
    me: usize,
    peer: usize,
    epoch: u64,
    stream: &mut TcpStream,
) -> Result<()> {
    let mut nonce = [0u8; 16];
    SystemRandom::new()
        .fill(&mut nonce)
        .map_err(|_| Error::Internal("system random generator failed".into()))?;
    let mut hello = Hello {
        flags: 0,
        from: me,
        to: peer,
        epoch,
        nonce,
        mac: [0u8; 32],
    };
    hello.mac = auth.sign(&auth.hello_msg(me, peer, epoch, &nonce));
    let who = format!("rank {peer} data link");
    stream
        .write_all(&hello.encode())
        .await
        .map_err(|e| auth_failed(&who, format!("sending the hello failed: {e}")))?;
    let mut buf = [0u8; HELLO_LEN];
    stream.read_exact(&mut buf).await.map_err(|e| {
        auth_failed(
            &who,
            format!(
                "rank {peer} closed the connection instead of answering our hello ({e}); \
                 it rejected our proof (different job secret, communicator or epoch?)"
            ),
        )
    })?;
    let answer = Hello::decode(&buf).map_err(|d| auth_failed(&who, d))?;
    if answer.flags != 1
        || answer.from != peer
        || answer.to != me
        || answer.epoch != epoch
        || answer.nonce != nonce
    {
        return Err(auth_failed(
            &who,
            format!(
                "answer does not match our hello (from {}, to {}, epoch {})",
                answer.from, answer.to, answer.epoch
            ),
        ));
    }
    if !auth.verify(&auth.answer_msg(&hello), &answer.mac) {
        return Err(auth_failed(
            &who,
            format!("rank {peer} could not prove the job secret"),
        ));
    }
    Ok(())
}

/// Acceptor side: read and check a hello; returns it (the answer is sent by
/// the caller once the rank is known not to be a duplicate).
async fn handshake_accept_read(
    auth: &Auth,
    me: usize,
    size: usize,
    epoch: u64,
    stream: &mut TcpStream,
) -> std::result::Result<Hello, String> {
    let mut buf = [0u8; HELLO_LEN];
    stream
        .read_exact(&mut buf)
        .await
        .map_err(|e| format!("reading the hello failed: {e}"))?;
    let hello = Hello::decode(&buf)?;
    if hello.flags != 0 {
        return Err("not a hello".into());
    }
    if hello.to != me || hello.from <= me || hello.from >= size || hello.epoch != epoch {
        return Err(format!(
            "hello from rank {} to rank {} for epoch {} does not fit this rank {me} of {size}, epoch {epoch}",
            hello.from, hello.to, hello.epoch
        ));
    }
    if !auth.verify(
        &auth.hello_msg(hello.from, hello.to, hello.epoch, &hello.nonce),
        &hello.mac,
    ) {
        return Err(format!(
            "claimed rank {} could not prove the job secret",
            hello.from
        ));
    }
    Ok(hello)
}

/// The store key under which `rank` publishes its listener address.
pub(crate) fn addr_key(prefix: &str, rank: usize) -> String {
    format!("{prefix}/cpu/addr/{rank}")
}

/// The store key under which `rank` publishes its host id (see [`host_id`]).
pub(crate) fn host_key(prefix: &str, rank: usize) -> String {
    format!("{prefix}/cpu/host/{rank}")
}

/// This host's identity for choosing shared-memory links: `/etc/machine-id`
/// and the kernel boot id (equal for two processes that can share
/// `/dev/shm`). Empty, meaning "never use shared memory", when either is
/// unreadable, when `/dev/shm` is missing, or when `CHORUS_SHM=0`.
pub(crate) fn host_id() -> String {
    if std::env::var("CHORUS_SHM").is_ok_and(|v| v == "0") || !Path::new(SHM_DIR).is_dir() {
        return String::new();
    }
    let read = |p: &str| std::fs::read_to_string(p).map(|s| s.trim().to_string());
    match (
        read("/etc/machine-id"),
        read("/proc/sys/kernel/random/boot_id"),
    ) {
        (Ok(m), Ok(b)) if !m.is_empty() && !b.is_empty() => format!("{m}/{b}"),
        _ => String::new(),
    }
}

/// Where ring files are created.
const SHM_DIR: &str = "/dev/shm";
/// Sequence number of the frames of the shared-memory setup exchange.
const SHM_SETUP_SEQ: u64 = u64::MAX - 1;

/// After the mesh is up: for every peer on the same host (equal non-empty
/// [`host_id`]s), create this rank's incoming ring, exchange ring paths over
/// the authenticated link, map the peer's ring, and agree (both ends mapped)
/// before unlinking. Returns one `Some((to_peer, from_peer))` per peer that
/// uses shared memory; both ends of a pair always decide the same.
///
/// # Errors
/// `PeerFailed` if a link fails during the exchange; `Transport` if the
/// store does not answer.
pub(crate) async fn setup_shm(
    init: &BackendInit,
    writers: &mut [Option<LinkWriter>],
    readers: &mut [Option<LinkReader>],
) -> Result<Vec<Option<(RingProducer, RingConsumer)>>> {
    let (me, size) = (init.rank, init.size);
    let mut out: Vec<Option<(RingProducer, RingConsumer)>> = (0..size).map(|_| None).collect();
    let mine = host_id();
    if size <= 1 || mine.is_empty() {
        return Ok(out);
    }
    let keys: Vec<String> = (0..size).map(|r| host_key(&init.key_prefix, r)).collect();
    let hosts = init.store.wait(&keys, init.connect_timeout).await?;
    let same: Vec<usize> = (0..size)
        .filter(|&r| r != me && hosts.get(r).is_some_and(|h| h == mine.as_bytes()))
        .collect();
    if same.is_empty() {
        return Ok(out);
    }
    // CHORUS_SHM_RING (bytes, a power of two) overrides the ring size for
    // tuning; both ends size their own incoming ring, so ranks may differ.
    let capacity = std::env::var("CHORUS_SHM_RING")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .filter(|c| c.is_power_of_two() && (4096..=(256 << 20)).contains(c))
        .unwrap_or(if size <= 8 {
            shm::RING_CAPACITY
        } else {
            shm::RING_CAPACITY / 4
        });
    let ctx = OpCtx {
        comm: init.comm.clone(),
        rank: me,
        size,
        epoch: init.epoch,
        kind: crate::op::OpKind::Barrier,
        seq: SHM_SETUP_SEQ,
        may_block: false,
    };
    let mut nonce = [0u8; 8];
    SystemRandom::new()
        .fill(&mut nonce)
        .map_err(|_| Error::Internal("system random generator failed".into()))?;
    let tag: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
    let ctx = &ctx;
    let mut pairs: Vec<(usize, &mut LinkWriter, &mut LinkReader)> = Vec::new();
    for (peer, (w, r)) in writers.iter_mut().zip(readers.iter_mut()).enumerate() {
        if let (true, Some(w), Some(r)) = (same.contains(&peer), w.as_mut(), r.as_mut()) {
            pairs.push((peer, w, r));
        }
    }
    // Files of ranks that were killed before they could unlink theirs.
    let swept = shm::sweep_stale(Path::new(SHM_DIR));
    if swept > 0 {
        tracing::info!(rank = me, files = swept, "removed stale shm ring files");
    }
    let results = futures::future::join_all(pairs.into_iter().map(|(peer, w, r)| {
        let path = Path::new(SHM_DIR).join(shm::ring_file_name(&tag, std::process::id(), peer, me));
        async move {
            // Our incoming ring (peer -> me).
            let mut incoming = match ShmSegment::create(&path, capacity) {
                Ok(s) => Some(s),
                Err(e) => {
                    tracing::debug!(peer, error = %e, "cannot create a shm ring; using TCP");
                    None
                }
            };
            let offer = if incoming.is_some() {
                path.to_string_lossy().into_owned().into_bytes()
            } else {
                Vec::new()
            };
            let mut theirs = Vec::new();
            let (sent, got) = futures::future::join(
                w.send(
                    ctx,
                    FrameKind::Header,
                    FrameClass::Collective,
                    SHM_SETUP_SEQ,
                    &offer,
                ),
                r.recv(
                    ctx,
                    FrameKind::Header,
                    FrameClass::Collective,
                    SHM_SETUP_SEQ,
                    RecvInto::Bounded(&mut theirs, 4096),
                ),
            )
            .await;
            sent?;
            got?;
            let outgoing = String::from_utf8(theirs)
                .ok()
                .filter(|p| {
                    p.starts_with(&format!("{SHM_DIR}/{}", shm::FILE_PREFIX)) && !p.contains("..")
                })
                .and_then(|p| match ShmSegment::open(Path::new(&p)) {
                    Ok(s) => Some(RingProducer::new(s)),
                    Err(e) => {
                        tracing::debug!(peer, error = %e, "cannot map the peer's shm ring");
                        None
                    }
                });
            // SH-5: before our ok, so the peer can probe us once it has it.
            if let Some(p) = &outgoing {
                p.advertise_cma();
            }
            let ok = [u8::from(incoming.is_some() && outgoing.is_some())];
            let mut ack = Vec::new();
            // The peer's answer means it has mapped our ring (or given up
            // on it): unlink right then, whatever the answer or error, so
            // the file exists only for this handshake. Earlier exits drop
            // `incoming`, which unlinks too.
            let recv_ack = async {
                let got = r
                    .recv(
                        ctx,
                        FrameKind::Header,
                        FrameClass::Collective,
                        SHM_SETUP_SEQ,
                        RecvInto::Bounded(&mut ack, 1),
                    )
                    .await;
                if let Some(s) = incoming.as_mut() {
                    s.unlink();
                }
                got
            };
            let (sent, got) = futures::future::join(
                w.send(
                    ctx,
                    FrameKind::Header,
                    FrameClass::Collective,
                    SHM_SETUP_SEQ,
                    &ok,
                ),
                recv_ack,
            )
            .await;
            sent?;
            got?;
            Ok::<_, Error>(match (incoming, outgoing) {
                (Some(i), Some(o)) if ok[0] == 1 && ack == [1] => {
                    let rx = RingConsumer::new(i);
                    let cma = cma_enabled() && rx.probe_cma();
                    tracing::debug!(peer, cma, "shared-memory link");
                    Some((peer, o, rx))
                }
                _ => None,
            })
        }
    }))
    .await;
    for r in results {
        if let Some((peer, tx, rx)) = r? {
            out[peer] = Some((tx, rx));
        }
    }
    tracing::debug!(rank = me, peers = ?same, "shared-memory links set up");
    Ok(out)
}

/// Whether single-copy transfers may be used (SH-5); `CHORUS_SHM_CMA=0`
/// turns them off.
fn cma_enabled() -> bool {
    std::env::var("CHORUS_SHM_CMA").map_or(true, |v| v != "0")
}

/// Connect the full mesh for `init`: returns one authenticated stream per
/// peer (`None` at this rank's own index). See the module docs (LK-1, LK-2).
pub(crate) async fn connect_mesh(init: &BackendInit) -> Result<Vec<Option<TcpStream>>> {
    let (me, size, epoch) = (init.rank, init.size, init.epoch);
    let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    if size <= 1 {
        return Ok(streams);
    }
    let start = Instant::now();
    let deadline = start + init.connect_timeout;
    let auth = Arc::new(Auth {
        key: hmac::Key::new(hmac::HMAC_SHA256, &init.secret),
        prefix: init.key_prefix.clone(),
    });
    let listener = TcpListener::bind((init.bind_ip, 0)).await.map_err(|e| {
        Error::Transport(TransportError::Io(format!(
            "binding the data-link listener on {}: {e}",
            init.bind_ip
        )))
    })?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::Transport(TransportError::Io(format!("listener address: {e}"))))?;
    init.store
        .set(
            &addr_key(&init.key_prefix, me),
            local.to_string().into_bytes(),
        )
        .await?;
    init.store
        .set(&host_key(&init.key_prefix, me), host_id().into_bytes())
        .await?;
    tracing::debug!(comm = %init.comm, rank = me, addr = %local, "data-link listener published");

    // Connector side: one future per lower rank.
    let mut connects = FuturesUnordered::new();
    for peer in 0..me {
        let auth = auth.clone();
        let store = init.store.clone();
        let key = addr_key(&init.key_prefix, peer);
        connects.push(async move {
            let remaining = deadline.saturating_duration_since(Instant::now());
            let vals = store.wait(std::slice::from_ref(&key), remaining).await?;
            let text = vals
                .first()
                .map(|v| String::from_utf8_lossy(v).into_owned());
            let addr: SocketAddr =
                text.as_deref()
                    .and_then(|t| t.parse().ok())
                    .ok_or_else(|| {
                        Error::Transport(TransportError::Malformed(format!(
                            "store key {key} holds {text:?}, not a socket address"
                        )))
                    })?;
            let mut stream = loop {
                match TcpStream::connect(addr).await {
                    Ok(s) => break s,
                    Err(e) => {
                        tracing::debug!(peer, %addr, error = %e, "connect failed; retrying");
                        tokio::time::sleep(CONNECT_RETRY).await;
                    }
                }
            };
            handshake_connect(&auth, me, peer, epoch, &mut stream).await?;
            Ok::<_, Error>((peer, stream))
        });
    }

    // Acceptor side: handshakes in progress with accepted connections.
    let mut accepting = FuturesUnordered::new();
    let missing = |streams: &[Option<TcpStream>]| -> Vec<usize> {
        (0..size)
            .filter(|&r| r != me && streams[r].is_none())
            .collect()
    };
    let give_up = tokio::time::sleep_until(deadline + SETUP_GRACE);
    tokio::pin!(give_up);
    while !missing(&streams).is_empty() {
        let need_accept = streams[me + 1..].iter().any(Option::is_none);
        tokio::select! {
            acc = listener.accept(), if need_accept => match acc {
                Ok((mut stream, from)) => {
                    let auth = auth.clone();
                    accepting.push(async move {
                        let r = tokio::time::timeout(
                            HELLO_BOUND,
                            handshake_accept_read(&auth, me, size, epoch, &mut stream),
                        )
                        .await
                        .unwrap_or_else(|_| Err(format!("no hello within {HELLO_BOUND:?}")));
                        (from, stream, r)
                    });
                }
                Err(e) => tracing::debug!(error = %e, "accept failed"),
            },
            Some(res) = connects.next(), if !connects.is_empty() => {
                let (peer, stream) = res?;
                streams[peer] = Some(stream);
                tracing::debug!(rank = me, peer, "data link connected");
            }
            Some((from, mut stream, res)) = accepting.next(), if !accepting.is_empty() => {
                match res {
                    Ok(hello) if streams[hello.from].is_none() => {
                        let answer = Hello {
                            flags: 1,
                            from: me,
                            to: hello.from,
                            epoch,
                            nonce: hello.nonce,
                            mac: auth.sign(&auth.answer_msg(&hello)),
                        };
                        match stream.write_all(&answer.encode()).await {
                            Ok(()) => {
                                tracing::debug!(rank = me, peer = hello.from, "data link accepted");
                                streams[hello.from] = Some(stream);
                            }
                            Err(e) => tracing::debug!(%from, error = %e, "answering a hello failed"),
                        }
                    }
                    Ok(hello) => tracing::warn!(
                        rank = me, %from, peer = hello.from,
                        "second data link claiming an already connected rank refused"
                    ),
                    Err(detail) => tracing::warn!(
                        rank = me, %from, %detail,
                        "refused a data-link connection with a bad hello"
                    ),
                }
            }
            _ = &mut give_up => {
                let failed = missing(&streams);
                return Err(Error::PeerFailed {
                    comm: init.comm.clone(),
                    rank: me,
                    epoch,
                    op: "connect",
                    detail: format!(
                        "data links to ranks {failed:?} were not established within {:?}; \
                         they did not start, died, or use a different job secret",
                        init.connect_timeout
                    ),
                    failed_ranks: failed,
                });
            }
        }
    }
    drop(listener);
    tracing::debug!(rank = me, size, elapsed = ?start.elapsed(), "data-link mesh connected");
    Ok(streams)
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
        let h = encode_frame_header(FrameKind::Data, FrameClass::P2P, 7, 9, 300);
        assert_eq!(h[0], 2);
        assert_eq!(h[1], 2);
        assert_eq!(&h[2..8], &[0u8; 6]);
        assert_eq!(le_u64(&h[8..]), 7);
        assert_eq!(le_u64(&h[16..]), 9);
        assert_eq!(le_u64(&h[24..]), 300);
    }

    #[test]
    fn hello_round_trips_and_answer_mac_differs_from_hello_mac() {
        let auth = Auth {
            key: hmac::Key::new(hmac::HMAC_SHA256, b"s"),
            prefix: "p".into(),
        };
        let nonce = [5u8; 16];
        let mut h = Hello {
            flags: 0,
            from: 2,
            to: 1,
            epoch: 4,
            nonce,
            mac: [0; 32],
        };
        h.mac = auth.sign(&auth.hello_msg(2, 1, 4, &nonce));
        let d = Hello::decode(&h.encode()).unwrap();
        assert_eq!((d.from, d.to, d.epoch, d.nonce), (2, 1, 4, nonce));
        assert!(auth.verify(&auth.hello_msg(2, 1, 4, &nonce), &d.mac));
        // A reflected hello is not a valid answer.
        assert!(!auth.verify(&auth.answer_msg(&h), &h.mac));
    }
}
