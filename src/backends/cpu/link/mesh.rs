//! Setting up a communicator's data links: the full TCP mesh and, for
//! same-host pairs, the shared-memory rings.
//!
//! Every rank binds a listener on `(bind_ip, 0)` and publishes one record,
//! its address and its host id, under `{key_prefix}/cpu/rank/{rank}`, then
//! reads every rank's record with one batched wait. Rank `r` connects to
//! every rank below it and accepts from every rank above it; each
//! connection is authenticated by [`handshake`] before it carries frames.
//! The listener accepts from the moment it is bound, while the records are
//! awaited, with a deep accept queue; which unauthenticated connections it
//! keeps is the [`admission`](super::admission) policy (LK-12).
//! Once the mesh is up, same-host pairs set up shared-memory rings over
//! their link ([`setup_shm`]).
//!
//! # Invariants
//! - LK-1: a connection is used for frames only after its handshake
//!   verified; a connection with a bad handshake is closed and accepting
//!   continues, so a stranger cannot break setup.
//! - LK-2: setup finishes within `connect_timeout` (plus a short grace), with
//!   `PeerFailed` naming the ranks that never connected when it does not.
//! - LK-11: bootstrap costs each rank two store requests (one record
//!   written, every record read in one wait), so O(N) requests for the job
//!   (O(N) bytes read per rank); a rank whose record does not appear
//!   within `connect_timeout` is named in the `PeerFailed` of every rank.
//! - LK-10: a failed accept pauses accepting (5 ms, doubling to 500 ms)
//!   instead of spinning; when setup then runs out of time and an accept
//!   failed because this process had no file descriptor left, the error is
//!   `Config`, saying so and naming the limit, not `PeerFailed` blaming
//!   peers that tried to connect. (The process's soft open-file limit is
//!   raised to its hard limit when the first communicator is created,
//!   `crate::limits::raise_fd_limit`.)

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use futures::future::{abortable, AbortHandle, Aborted};
use futures::stream::{FuturesUnordered, StreamExt};
use ring::rand::{SecureRandom, SystemRandom};
use tokio::net::{TcpListener, TcpStream};
use tokio::time::Instant;

use super::admission::Admission;
use super::frame::{FrameClass, FrameKind, LinkReader, LinkWriter, RecvInto, Tag};
use super::handshake::{self, Auth};
use crate::backends::cpu::shm::{self, RingConsumer, RingProducer, ShmSegment};
use crate::backends::{BackendInit, OpCtx, TcpFallback};
use crate::error::{Error, Result};
use crate::transport::TransportError;

/// Extra time given to the store's own timeout before setup reports missing ranks.
const SETUP_GRACE: Duration = Duration::from_millis(250);
/// How long an accepted connection may take to finish its handshake; a
/// silent stranger is dropped after this instead of lingering until setup
/// ends (and sooner when newer connections need its place, LK-12).
const HANDSHAKE_BOUND: Duration = Duration::from_secs(2);
/// Connections a connector opens to one peer whose listener closes them
/// before answering its hello (LK-12).
const HANDSHAKE_ATTEMPTS: u32 = 3;
/// Pause between connection attempts to a published address.
const CONNECT_RETRY: Duration = Duration::from_millis(50);
/// The first pause of accepting after a failed accept (LK-10).
const ACCEPT_BACKOFF: Duration = Duration::from_millis(5);
/// The longest pause of accepting after failed accepts (LK-10).
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_millis(500);

/// LK-10: how long accepting pauses after each failed accept, and the
/// last failure that said this process was out of file descriptors
/// (`EMFILE`, `ENFILE`). O(1).
#[derive(Debug)]
struct AcceptBackoff {
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
    fn failed(&mut self, e: std::io::Error) -> Duration {
        if matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE)) {
            self.out_of_fds = Some(e);
        }
        let pause = self.next;
        self.next = (self.next * 2).min(ACCEPT_BACKOFF_MAX);
        pause
    }

    /// An accept succeeded: the next failure pauses briefly again.
    fn succeeded(&mut self) {
        self.next = ACCEPT_BACKOFF;
    }

    /// The last accept failure for want of file descriptors, if any.
    fn out_of_fds(&self) -> Option<&std::io::Error> {
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
fn encode_record(addr: SocketAddr, host: &str) -> Vec<u8> {
    format!("{addr}\n{host}").into_bytes()
}

/// The listener address and host id of a stored record; `None` if it is
/// not one.
fn decode_record(raw: &[u8]) -> Option<(SocketAddr, String)> {
    let text = std::str::from_utf8(raw).ok()?;
    let (addr, host) = text.split_once('\n')?;
    Some((addr.parse().ok()?, host.to_string()))
}

/// What the data links' setup learnt of every rank: the authenticated
/// stream per peer (`None` at this rank's own index) and every rank's host
/// id (from its record, [LK-11]), which decides the shared-memory pairs.
///
/// [LK-11]: self#invariants
pub(crate) struct Mesh {
    pub(crate) streams: Vec<Option<TcpStream>>,
    pub(crate) hosts: Vec<String>,
}

/// This host's identity for choosing shared-memory links: `/etc/machine-id`
/// and the kernel boot id (equal for two processes that can share
/// `/dev/shm`), or `CHORUS_HOST_ID` when set (the same variable that names
/// hosts for `Comm::hierarchy`; e.g. one per network namespace to test
/// multi-host jobs on one machine). Empty, meaning "never use shared
/// memory", when neither is available, when `/dev/shm` is missing, or when
/// `CHORUS_SHM=0`. Ranks that share an id but cannot open each other's ring
/// file fall back to TCP.
pub(crate) fn host_id() -> String {
    if std::env::var("CHORUS_SHM").is_ok_and(|v| v == "0") || !Path::new(SHM_DIR).is_dir() {
        return String::new();
    }
    if let Some(id) = std::env::var("CHORUS_HOST_ID")
        .ok()
        .filter(|v| !v.trim().is_empty())
    {
        return format!("env:{}", id.trim());
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
/// The shared-memory rings of same-host peers, by rank, and the same-host
/// peers that fell back to TCP, with why.
pub(crate) type ShmLinks = (Vec<Option<(RingProducer, RingConsumer)>>, Vec<TcpFallback>);

pub(crate) async fn setup_shm(
    init: &BackendInit,
    hosts: &[String],
    writers: &mut [Option<LinkWriter>],
    readers: &mut [Option<LinkReader>],
) -> Result<ShmLinks> {
    let (me, size) = (init.rank, init.size);
    let mut out: Vec<Option<(RingProducer, RingConsumer)>> = (0..size).map(|_| None).collect();
    let Some(mine) = hosts.get(me).filter(|h| !h.is_empty()) else {
        return Ok((out, Vec::new()));
    };
    if size <= 1 {
        return Ok((out, Vec::new()));
    }
    let same: Vec<usize> = (0..size)
        .filter(|&r| r != me && hosts.get(r) == Some(mine))
        .collect();
    if same.is_empty() {
        return Ok((out, Vec::new()));
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
        fingerprint: 0,
        headers: true,
        may_block: false,
        order: Default::default(),
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
            // Why this pair falls back to TCP, when it does.
            let mut why: Option<String> = None;
            let mut incoming = match ShmSegment::create(&path, capacity) {
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
            let mut theirs = Vec::new();
            let (sent, got) = futures::future::join(
                w.send(
                    ctx,
                    FrameKind::Header,
                    FrameClass::Collective,
                    Tag::seq(SHM_SETUP_SEQ),
                    &offer,
                ),
                r.recv(
                    ctx,
                    FrameKind::Header,
                    FrameClass::Collective,
                    Tag::seq(SHM_SETUP_SEQ),
                    RecvInto::Bounded(&mut theirs, 4096),
                ),
            )
            .await;
            sent?;
            got?;
            let offered = String::from_utf8(theirs).ok().filter(|p| {
                p.starts_with(&format!("{SHM_DIR}/{}", shm::FILE_PREFIX)) && !p.contains("..")
            });
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
                        why.get_or_insert_with(|| {
                            format!("could not map rank {peer}'s ring file: {e}")
                        });
                        None
                    }
                },
            };
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
                        Tag::seq(SHM_SETUP_SEQ),
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
                    Tag::seq(SHM_SETUP_SEQ),
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
                    Ok((peer, o, rx))
                }
                _ => Err(TcpFallback {
                    peer,
                    reason: why.unwrap_or_else(|| {
                        format!("rank {peer} could not map this rank's ring file")
                    }),
                }),
            })
        }
    }))
    .await;
    let mut fallbacks = Vec::new();
    for r in results {
        match r? {
            Ok((peer, tx, rx)) => out[peer] = Some((tx, rx)),
            Err(f) => {
                tracing::warn!(
                    comm = %init.comm, rank = me, peer = f.peer, reason = %f.reason,
                    "a same-host peer is reached over TCP, not shared memory"
                );
                fallbacks.push(f);
            }
        }
    }
    tracing::debug!(rank = me, peers = ?same, "shared-memory links set up");
    Ok((out, fallbacks))
}

/// Whether single-copy transfers may be used ([SH-5]); `CHORUS_SHM_CMA=0`
/// turns them off.
///
/// [SH-5]: crate::backends::cpu::shm#invariants
fn cma_enabled() -> bool {
    std::env::var("CHORUS_SHM_CMA").map_or(true, |v| v != "0")
}

/// LK-2: setup of `init` gives up on the links to `failed`, for the reason
/// `why`.
fn not_connected(init: &BackendInit, failed: Vec<usize>, why: &str) -> Error {
    Error::PeerFailed {
        comm: init.comm.clone(),
        rank: init.rank,
        epoch: init.epoch,
        op: "connect",
        detail: format!(
            "data links to ranks {failed:?} were not established within {:?}: {why}",
            init.connect_timeout
        ),
        failed_ranks: failed,
    }
}

/// Connect the full mesh for `init`: one authenticated stream per peer,
/// and every rank's host id. See the [invariants](self#invariants).
pub(crate) async fn connect_mesh(init: &BackendInit) -> Result<Mesh> {
    let (me, size, epoch) = (init.rank, init.size, init.epoch);
    let mut streams: Vec<Option<TcpStream>> = (0..size).map(|_| None).collect();
    if size <= 1 {
        return Ok(Mesh {
            streams,
            hosts: vec![host_id()],
        });
    }
    let start = Instant::now();
    let deadline = start + init.connect_timeout;
    let auth = Arc::new(Auth::new(&init.secret, &init.key_prefix));
    let listener = listen(init.bind_ip).map_err(|e| {
        Error::Transport(TransportError::Io(format!(
            "binding the data-link listener on {}: {e}",
            init.bind_ip
        )))
    })?;
    let local = listener
        .local_addr()
        .map_err(|e| Error::Transport(TransportError::Io(format!("listener address: {e}"))))?;
    // LK-11: one record per rank, and one read of every rank's.
    init.store
        .set(
            &record_key(&init.key_prefix, me),
            encode_record(local, &host_id()),
        )
        .await?;
    tracing::debug!(comm = %init.comm, rank = me, addr = %local, "data-link listener published");
    let keys: Vec<String> = (0..size).map(|r| record_key(&init.key_prefix, r)).collect();
    let records = init
        .store
        .wait(&keys, deadline.saturating_duration_since(Instant::now()));
    tokio::pin!(records);
    let mut hosts: Option<Vec<String>> = None;

    // Connector side: one future per lower rank, once the records are in.
    let mut connects = FuturesUnordered::new();
    // Acceptor side: handshakes in progress with accepted connections,
    // from the moment the listener is bound (LK-12: a flood that fills the
    // kernel's accept queue while this rank waits for the records would
    // otherwise make a real peer's connect wait for its SYN to be resent).
    let mut accepting = FuturesUnordered::new();
    let mut admission = Admission::new(size - 1 - me);
    let mut pending: HashMap<u64, AbortHandle> = HashMap::new();
    let mut next_id = 0u64;
    let missing = |streams: &[Option<TcpStream>]| -> Vec<usize> {
        (0..size)
            .filter(|&r| r != me && streams[r].is_none())
            .collect()
    };
    let give_up = tokio::time::sleep_until(deadline + SETUP_GRACE);
    tokio::pin!(give_up);
    // LK-10: after a failed accept (out of file descriptors, most often),
    // accepting pauses, for ACCEPT_BACKOFF doubling up to its cap, instead
    // of failing again at once for the rest of the connect timeout.
    let mut backoff = AcceptBackoff::default();
    let resume = tokio::time::sleep(Duration::ZERO);
    tokio::pin!(resume);
    let mut paused = false;
    while hosts.is_none() || !missing(&streams).is_empty() {
        let need_accept = streams[me + 1..].iter().any(Option::is_none);
        tokio::select! {
            got = &mut records, if hosts.is_none() => {
                let got = match got {
                    Ok(r) => r,
                    Err(TransportError::WaitTimeout { keys: missing, .. }) => {
                        let failed = (0..size).filter(|&r| missing.contains(&keys[r])).collect();
                        return Err(not_connected(
                            init,
                            failed,
                            "they never published their address: they did not start, or died",
                        ));
                    }
                    Err(e) => return Err(e.into()),
                };
                let mut h = Vec::with_capacity(size);
                for (r, raw) in got.iter().enumerate() {
                    let (addr, host) = decode_record(raw).ok_or_else(|| {
                        Error::Transport(TransportError::Malformed(format!(
                            "store key {} holds {:?}, not a data-link record",
                            keys[r],
                            String::from_utf8_lossy(raw)
                        )))
                    })?;
                    h.push(host);
                    if r < me {
                        connects.push(connect_to(auth.clone(), me, r, epoch, addr));
                    }
                }
                hosts = Some(h);
            }
            _ = &mut resume, if paused => paused = false,
            acc = listener.accept(), if need_accept && !paused => match acc {
                Ok((mut stream, from)) => {
                    backoff.succeeded();
                    let id = next_id;
                    next_id += 1;
                    for old in admission.admit(id, from.ip()) {
                        if let Some(h) = pending.remove(&old) {
                            tracing::debug!(rank = me, "closing the oldest unauthenticated data-link connection");
                            h.abort();
                        }
                    }
                    let auth = auth.clone();
                    let (shake, handle) = abortable(async move {
                        let r = tokio::time::timeout(
                            HANDSHAKE_BOUND,
                            handshake::accept(&auth, me, size, epoch, &mut stream),
                        )
                        .await
                        .unwrap_or_else(|_| {
                            Err(format!("handshake not finished within {HANDSHAKE_BOUND:?}"))
                        });
                        (stream, r)
                    });
                    pending.insert(id, handle);
                    accepting.push(async move { (id, from, shake.await) });
                }
                Err(e) => {
                    tracing::warn!(rank = me, error = %e, "accept failed; pausing accepts");
                    let pause = backoff.failed(e);
                    resume.as_mut().reset(tokio::time::Instant::now() + pause);
                    paused = true;
                }
            },
            Some(res) = connects.next(), if !connects.is_empty() => {
                let (peer, stream) = res?;
                streams[peer] = Some(stream);
                tracing::debug!(rank = me, peer, "data link connected");
            }
            Some((id, from, res)) = accepting.next(), if !accepting.is_empty() => {
                admission.done(id);
                pending.remove(&id);
                match res {
                    Ok((stream, Ok(peer))) if streams[peer].is_none() => {
                        tracing::debug!(rank = me, peer, "data link accepted");
                        streams[peer] = Some(stream);
                    }
                    Ok((_, Ok(peer))) => tracing::warn!(
                        rank = me, %from, peer,
                        "second data link claiming an already connected rank refused"
                    ),
                    Ok((_, Err(detail))) => tracing::warn!(
                        rank = me, %from, %detail,
                        "refused a data-link connection with a bad handshake"
                    ),
                    Err(Aborted) => {}
                }
            }
            _ = &mut give_up => {
                let failed = missing(&streams);
                // This rank could not take connections: say so, rather than
                // blaming peers that may well have tried.
                if let Some(e) = backoff.out_of_fds() {
                    return Err(Error::Config(format!(
                        "communicator {:?}, rank {me}: data links to ranks {failed:?} were not \
                         established within {:?} because this process ran out of file \
                         descriptors ({e}; open-file limit {}); raise it (`ulimit -n`) or run \
                         fewer ranks per host",
                        init.comm,
                        init.connect_timeout,
                        crate::limits::fd_limit()
                            .map_or_else(|| "unknown".to_string(), |(soft, _)| soft.to_string()),
                    )));
                }
                return Err(not_connected(
                    init,
                    failed,
                    "they did not start, died, or use a different job secret",
                ));
            }
        }
    }
    let hosts = hosts.unwrap_or_default();
    drop(listener);
    tracing::debug!(rank = me, size, elapsed = ?start.elapsed(), "data-link mesh connected");
    Ok(Mesh { streams, hosts })
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

/// Connect to `peer` at `addr` and run the handshake. A connection the
/// peer closes before it answers is tried again, up to
/// [`HANDSHAKE_ATTEMPTS`] times in all: the peer's listener may have closed
/// it to make room for newer ones (LK-12). A peer that rejects our proof
/// closes it too, so a wrong secret is reported after those attempts.
async fn connect_to(
    auth: Arc<Auth>,
    me: usize,
    peer: usize,
    epoch: u64,
    addr: SocketAddr,
) -> Result<(usize, TcpStream)> {
    let mut attempt = 1;
    loop {
        let mut stream = loop {
            match TcpStream::connect(addr).await {
                Ok(s) => break s,
                Err(e) => {
                    tracing::debug!(peer, %addr, error = %e, "connect failed; retrying");
                    tokio::time::sleep(CONNECT_RETRY).await;
                }
            }
        };
        match handshake::connect_attempt(&auth, me, peer, epoch, &mut stream).await {
            Ok(()) => return Ok((peer, stream)),
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
