//! Opening one data link: the bootstrap records, the listener, dialing a
//! peer, and the shared-memory rings of a same-host pair. When links open
//! is the [`pool`](super::pool)'s policy; this module opens them.
//!
//! Every rank binds a listener on `(bind_ip, 0)` and publishes one record,
//! its address and its host id, under `{key_prefix}/cpu/rank/{rank}`, then
//! reads every rank's record with one batched wait. A connection is
//! authenticated by [`handshake`] before it carries frames. A same-host
//! pair then sets up shared-memory rings over its new link ([`shm_pair`]).
//!
//! # Invariants
//! - LK-1: a connection is used for frames only after its handshake
//!   verified and its verdict kept it; a connection with a bad handshake is
//!   closed and accepting continues, so a stranger cannot break setup.
//! - LK-2: a link an op needs opens within `connect_timeout`, or the op
//!   fails with `PeerFailed` naming the ranks whose links did not open.
//! - LK-11: bootstrap costs each rank two store requests (one record
//!   written, every record read in one wait), so O(N) requests for the job
//!   (O(N) bytes read per rank); a rank whose record does not appear
//!   within `connect_timeout` is named in the `PeerFailed` of every rank.
//! - LK-10: a failed accept pauses accepting (5 ms, doubling to 500 ms)
//!   instead of spinning; when a link then does not open in time and an
//!   accept failed because this process had no file descriptor left, the
//!   error is `Config`, saying so and naming the limit, not `PeerFailed`
//!   blaming peers that tried to connect. (The process's soft open-file
//!   limit is raised to its hard limit when the first communicator is
//!   created, `crate::limits::raise_fd_limit`.)

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use ring::rand::{SecureRandom, SystemRandom};
use tokio::net::{TcpListener, TcpStream};

use super::frame::{FrameClass, FrameKind, LinkReader, LinkWriter, RecvInto, Tag};
use super::handshake::{self, Auth};
use crate::backends::cpu::shm::{self, RingConsumer, RingProducer, ShmSegment};
use crate::backends::{OpCtx, TcpFallback};
use crate::error::{Error, Result};

/// Extra time given to the store's own timeout before setup reports missing ranks.
pub(crate) const SETUP_GRACE: Duration = Duration::from_millis(250);
/// How long an accepted connection may take to finish its handshake; a
/// silent stranger is dropped after this instead of lingering until setup
/// ends (and sooner when newer connections need its place, LK-12).
pub(crate) const HANDSHAKE_BOUND: Duration = Duration::from_secs(2);
/// Connections a connector opens to one peer whose listener closes them
/// before answering its hello (LK-12).
const HANDSHAKE_ATTEMPTS: u32 = 3;
/// Pause between connection attempts to a published address.
const CONNECT_RETRY: Duration = Duration::from_millis(50);
/// Refused connections after which a peer's listener counts as gone.
const CONNECT_REFUSALS: u32 = 3;
/// The first pause of accepting after a failed accept (LK-10).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(5);
/// The longest pause of accepting after failed accepts (LK-10).
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_millis(500);

/// LK-10: how long accepting pauses after each failed accept, and the
/// last failure that said this process was out of file descriptors
/// (`EMFILE`, `ENFILE`). O(1).
#[derive(Debug)]
pub(crate) struct AcceptBackoff {
    next: Duration,
    out_of_fds: Option<std::io::Error>,
}

impl Default for AcceptBackoff {
    fn default() -> AcceptBackoff {
        AcceptBackoff {
            next: ACCEPT_BACKOFF,
            out_of_fds: None,
        }
    }
}

impl AcceptBackoff {
    /// An accept failed with `e`: how long to pause before the next one.
    pub(crate) fn failed(&mut self, e: std::io::Error) -> Duration {
        if matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE)) {
            self.out_of_fds = Some(e);
        }
        let pause = self.next;
        self.next = (self.next * 2).min(ACCEPT_BACKOFF_MAX);
        pause
    }

    /// An accept succeeded: the next failure pauses briefly again.
    pub(crate) fn succeeded(&mut self) {
        self.next = ACCEPT_BACKOFF;
    }

    /// The last accept failure for want of file descriptors, if any.
    pub(crate) fn out_of_fds(&self) -> Option<&std::io::Error> {
        self.out_of_fds.as_ref()
    }
}

/// The store key of `rank`'s one bootstrap record ([LK-11]): its
/// listener address and its host id (see [`host_id`]).
///
/// [LK-11]: self#invariants
pub(crate) fn record_key(prefix: &str, rank: usize) -> String {
    format!("{prefix}/cpu/rank/{rank}")
}

/// A rank's bootstrap record as stored: `<listener address>\n<host id>`.
pub(crate) fn encode_record(addr: SocketAddr, host: &str) -> Vec<u8> {
    format!("{addr}\n{host}").into_bytes()
}

/// The listener address and host id of a stored record; `None` if it is
/// not one.
pub(crate) fn decode_record(raw: &[u8]) -> Option<(SocketAddr, String)> {
    let text = std::str::from_utf8(raw).ok()?;
    let (addr, host) = text.split_once('\n')?;
    Some((addr.parse().ok()?, host.to_string()))
}

/// This host's identity for choosing shared-memory links and the hosts of
/// hierarchical collectives: `given` (`BackendInit::host_id`), else
/// `CHORUS_HOST_ID` when set (the same variable that names hosts for
/// `Comm::hierarchy`; e.g. one per network namespace to test multi-host
/// jobs on one machine), else `/etc/machine-id` and the kernel boot id
/// (equal for two processes that can share `/dev/shm`). Empty, meaning
/// "never use shared memory, and no hierarchy", when none is available,
/// when `/dev/shm` is missing, or when `CHORUS_SHM=0`. Ranks that share an
/// id but cannot open each other's ring file fall back to TCP.
pub(crate) fn host_id(given: Option<&str>) -> String {
    if std::env::var("CHORUS_SHM").is_ok_and(|v| v == "0") || !Path::new(SHM_DIR).is_dir() {
        return String::new();
    }
    let env = std::env::var("CHORUS_HOST_ID").ok();
    if let Some(id) = given
        .or(env.as_deref())
        .map(str::trim)
        .filter(|v| !v.is_empty())
    {
        return format!("env:{id}");
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

/// What a same-host pair's ring setup ([`shm_pair`]) needs that is the
/// same for every pair of this rank: the ring size and this rank's random
/// file tag. O(1).
#[derive(Debug, Clone)]
pub(crate) struct ShmConf {
    capacity: usize,
    tag: String,
}

impl ShmConf {
    /// The ring size for a communicator of `size` ranks
    /// (`CHORUS_SHM_RING`, bytes and a power of two, overrides it for
    /// tuning; both ends size their own incoming ring, so ranks may
    /// differ) and a fresh file tag; also removes the ring files of killed
    /// processes.
    pub(crate) fn new(rank: usize, size: usize) -> Result<ShmConf> {
        let capacity = std::env::var("CHORUS_SHM_RING")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .filter(|c| c.is_power_of_two() && (4096..=(256 << 20)).contains(c))
            .unwrap_or(if size <= 8 {
                shm::RING_CAPACITY
            } else {
                shm::RING_CAPACITY / 4
            });
        let mut nonce = [0u8; 8];
        SystemRandom::new()
            .fill(&mut nonce)
            .map_err(|_| Error::Internal("system random generator failed".into()))?;
        // Files of ranks that were killed before they could unlink theirs.
        let swept = shm::sweep_stale(Path::new(SHM_DIR));
        if swept > 0 {
            tracing::info!(rank, files = swept, "removed stale shm ring files");
        }
        Ok(ShmConf {
            capacity,
            tag: nonce.iter().map(|b| format!("{b:02x}")).collect(),
        })
    }
}

/// The shared-memory rings of a same-host pair (to the peer, from it), or
/// why the pair falls back to TCP.
pub(crate) type ShmPair = std::result::Result<(RingProducer, RingConsumer), TcpFallback>;

/// Over the new, authenticated link to same-host `peer` (both ends run
/// this at once, right after the link opened): create this rank's
/// incoming ring, exchange ring paths, map the peer's ring, and agree
/// (both ends mapped) before unlinking. Both ends of a pair always decide
/// the same.
///
/// # Errors
/// `PeerFailed` if the link fails during the exchange.
pub(crate) async fn shm_pair(
    ctx: &OpCtx,
    conf: &ShmConf,
    peer: usize,
    w: &mut LinkWriter,
    r: &mut LinkReader,
) -> Result<ShmPair> {
    let me = ctx.rank;
    let path =
        Path::new(SHM_DIR).join(shm::ring_file_name(&conf.tag, std::process::id(), peer, me));
    // Our incoming ring (peer -> me).
    // Why this pair falls back to TCP, when it does.
    let mut why: Option<String> = None;
    let mut incoming = match ShmSegment::create(&path, conf.capacity) {
        Ok(s) => Some(s),
        Err(e) => {
            why = Some(format!("could not create this rank's ring file: {e}"));
            None
        }
    };
    let offer = if incoming.is_some() {
        path.to_string_lossy().into_owned().into_bytes()
    } else {
        Vec::new()
    };
    let theirs = swap(ctx, w, r, &offer, 4096).await?;
    let offered = String::from_utf8(theirs)
        .ok()
        .filter(|p| p.starts_with(&format!("{SHM_DIR}/{}", shm::FILE_PREFIX)) && !p.contains(".."));
    let outgoing = match offered {
        None => {
            why.get_or_insert_with(|| {
                format!("rank {peer} offered no usable ring file (it could not create one)")
            });
            None
        }
        Some(p) => match ShmSegment::open(Path::new(&p)) {
            Ok(s) => Some(RingProducer::new(s)),
            Err(e) => {
                why.get_or_insert_with(|| format!("could not map rank {peer}'s ring file: {e}"));
                None
            }
        },
    };
    // SH-5: before our ok, so the peer can probe us once it has it.
    if let Some(p) = &outgoing {
        p.advertise_cma();
    }
    let ok = [u8::from(incoming.is_some() && outgoing.is_some())];
    // The peer's answer means it has mapped our ring (or given up on it):
    // unlink right then, whatever the answer or error, so the file exists
    // only for this handshake. Earlier exits drop `incoming`, which
    // unlinks too.
    let ack = swap(ctx, w, r, &ok, 1).await;
    if let Some(s) = incoming.as_mut() {
        s.unlink();
    }
    let ack = ack?;
    Ok(match (incoming, outgoing) {
        (Some(i), Some(o)) if ok[0] == 1 && ack == [1] => {
            let rx = RingConsumer::new(i);
            let cma = cma_enabled() && rx.probe_cma();
            // One more empty frame each way: when it arrives, the peer has
            // probed too, so this rank's first large send already knows
            // whether it may use the single-copy path.
            swap(ctx, w, r, &[], 0).await?;
            tracing::debug!(peer, cma, "shared-memory link");
            Ok((o, rx))
        }
        _ => {
            let f = TcpFallback {
                peer,
                reason: why
                    .unwrap_or_else(|| format!("rank {peer} could not map this rank's ring file")),
            };
            tracing::warn!(
                comm = %ctx.comm, rank = me, peer, reason = %f.reason,
                "a same-host peer is reached over TCP, not shared memory"
            );
            Err(f)
        }
    })
}

/// One ring-setup frame each way over the pair's link: send `out`, and
/// return what the peer sent (at most `bound` bytes).
async fn swap(
    ctx: &OpCtx,
    w: &mut LinkWriter,
    r: &mut LinkReader,
    out: &[u8],
    bound: u64,
) -> Result<Vec<u8>> {
    let mut theirs = Vec::new();
    let (sent, got) = futures::future::join(
        w.send(
            ctx,
            FrameKind::Header,
            FrameClass::Collective,
            Tag::seq(SHM_SETUP_SEQ),
            out,
        ),
        r.recv(
            ctx,
            FrameKind::Header,
            FrameClass::Collective,
            Tag::seq(SHM_SETUP_SEQ),
            RecvInto::Bounded(&mut theirs, bound),
        ),
    )
    .await;
    sent?;
    got?;
    Ok(theirs)
}

/// The context of the frames of a ring setup ([`shm_pair`]) of
/// communicator `comm`.
pub(crate) fn shm_setup_ctx(comm: &str, rank: usize, size: usize, epoch: u64) -> OpCtx {
    OpCtx {
        comm: comm.into(),
        rank,
        size,
        epoch,
        kind: crate::op::OpKind::Barrier,
        seq: SHM_SETUP_SEQ,
        fingerprint: 0,
        headers: true,
        may_block: false,
        order: Default::default(),
    }
}

/// Whether single-copy transfers may be used ([SH-5]); `CHORUS_SHM_CMA=0`
/// turns them off.
///
/// [SH-5]: crate::backends::cpu::shm#invariants
fn cma_enabled() -> bool {
    std::env::var("CHORUS_SHM_CMA").map_or(true, |v| v != "0")
}

/// LK-2: the links of rank `rank` of `comm` (in `epoch`) to `failed`
/// did not open within `timeout`, for the reason `why`.
pub(crate) fn not_connected(
    comm: &str,
    rank: usize,
    epoch: u64,
    timeout: Duration,
    failed: Vec<usize>,
    why: &str,
) -> Error {
    Error::PeerFailed {
        comm: comm.to_string(),
        rank,
        epoch,
        op: "connect",
        detail: format!(
            "data links to ranks {failed:?} were not established within {timeout:?}: {why}"
        ),
        failed_ranks: failed,
    }
}

/// The accept queue asked for a data-link listener (the kernel caps it at
/// `net.core.somaxconn`). A rank of a large job is connected to by many
/// peers at once, and a full queue drops a connection's SYN, which the
/// peer resends only after a second.
const LISTEN_BACKLOG: u32 = 4096;

/// A data-link listener on `(ip, any port)` with a [`LISTEN_BACKLOG`] queue.
pub(crate) fn listen(ip: std::net::IpAddr) -> std::io::Result<TcpListener> {
    let socket = match ip {
        std::net::IpAddr::V4(_) => tokio::net::TcpSocket::new_v4()?,
        std::net::IpAddr::V6(_) => tokio::net::TcpSocket::new_v6()?,
    };
    socket.bind(SocketAddr::new(ip, 0))?;
    socket.listen(LISTEN_BACKLOG)
}

/// Connect to `peer` at `addr` and run the handshake; `true` when the
/// peer keeps this connection as the pair's link (its verdict). A
/// connection the peer closes before it answers is tried again, up to
/// [`HANDSHAKE_ATTEMPTS`] times in all: the peer's listener may have closed
/// it to make room for newer ones (LK-12). A peer that rejects our proof
/// closes it too, so a wrong secret is reported after those attempts. A
/// refused connection is tried again a few times, then reported as the
/// peer's failure: its listener, bound before it published its address
/// and open while it is a member, is gone.
///
/// # Errors
/// `Transport(AuthFailed)` as [`handshake::connect`]; `PeerFailed` when
/// the peer's listener refuses connections.
pub(crate) async fn dial(
    ctx: &OpCtx,
    auth: &Auth,
    peer: usize,
    addr: SocketAddr,
) -> Result<(TcpStream, bool)> {
    let (me, epoch) = (ctx.rank, ctx.epoch);
    let mut attempt = 1;
    let mut refused = 0;
    loop {
        let mut stream = loop {
            match TcpStream::connect(addr).await {
                Ok(s) => break s,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionRefused => {
                    refused += 1;
                    if refused >= CONNECT_REFUSALS {
                        return Err(Error::PeerFailed {
                            comm: ctx.comm.to_string(),
                            rank: me,
                            epoch,
                            op: "connect",
                            failed_ranks: vec![peer],
                            detail: format!(
                                "rank {peer}'s data-link listener at {addr} refuses connections \
                                 ({e}): it exited or left the communicator"
                            ),
                        });
                    }
                    tokio::time::sleep(CONNECT_RETRY).await;
                }
                Err(e) => {
                    tracing::debug!(peer, %addr, error = %e, "connect failed; retrying");
                    tokio::time::sleep(CONNECT_RETRY).await;
                }
            }
        };
        match handshake::connect_attempt(auth, me, peer, epoch, &mut stream).await {
            Ok(take) => return Ok((stream, take)),
            Err(r) if r.unanswered && attempt < HANDSHAKE_ATTEMPTS => {
                tracing::debug!(peer, %addr, attempt, error = %r.error, "handshake closed unanswered; connecting again");
                attempt += 1;
                tokio::time::sleep(CONNECT_RETRY).await;
            }
            Err(r) => return Err(r.error),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lk10_failed_accepts_pause_doubling_to_a_cap_and_a_success_resets() {
        let mut b = AcceptBackoff::default();
        let other = || std::io::Error::from_raw_os_error(libc::ECONNABORTED);
        let pauses: Vec<u64> = (0..9)
            .map(|_| b.failed(other()).as_millis() as u64)
            .collect();
        assert_eq!(pauses, [5, 10, 20, 40, 80, 160, 320, 500, 500]);
        assert!(
            b.out_of_fds().is_none(),
            "ECONNABORTED is not fd exhaustion"
        );
        b.succeeded();
        assert_eq!(b.failed(other()), ACCEPT_BACKOFF);
    }

    #[test]
    fn lk10_fd_exhaustion_is_remembered_for_the_error() {
        for errno in [libc::EMFILE, libc::ENFILE] {
            let mut b = AcceptBackoff::default();
            b.failed(std::io::Error::from_raw_os_error(errno));
            b.failed(std::io::Error::from_raw_os_error(libc::ECONNABORTED));
            assert_eq!(b.out_of_fds().and_then(|e| e.raw_os_error()), Some(errno));
        }
    }
}
