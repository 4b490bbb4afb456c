//! Links on demand: which data links of a communicator exist on this rank,
//! and opening the ones an op needs when it first needs them (NCCL's
//! runtime connect), so a rank holds links to the peers its algorithms
//! talk to, not to every rank.
//!
//! At creation a rank binds its listener, starts accepting, publishes its
//! record and reads every rank's ([`setup`](super::setup)); under the
//! eager policy it then opens every link, as a full mesh. Under the lazy
//! one it opens none: [`Pool::ensure`] opens the links of an op's peers
//! before the op moves a byte. The listener stays open, answered by a
//! background task, for the life of the communicator, so a link opens
//! whatever the peer is doing: its own op never has to take part.
//!
//! Either rank of a pair may dial the other, and in a collective both
//! usually do at once. The handshake's verdict settles which connection the
//! pair keeps: an acceptor takes an incoming connection unless it has a
//! link to that peer already, or is dialing that peer itself and its rank
//! is the higher of the two. So of two crossing dials the higher rank's
//! wins on both sides, and the lower rank, told no, waits for it.
//!
//! # Invariants
//! - LK-13: a pair keeps at most one link per epoch, and both of its ranks
//!   keep the same one: the acceptor's verdict, decided atomically with its
//!   own dialing state, is the only place a connection becomes a link.
//! - LK-14: opening a link never waits for the peer's program: dials are
//!   answered by the peer's background acceptor; a rank told no waits only
//!   for the peer's dial already under way (and at eager creation, where
//!   every rank is bootstrapping, a lower rank gives a higher one
//!   [`LOWER_DIAL_GRACE`] to dial first). Every wait ends by
//!   `connect_timeout` with `PeerFailed` naming the peers whose links did
//!   not open (LK-2).
//! - LK-15: memory is one slot per rank, O(N) per rank; an op whose links
//!   are open costs O(its peers) to check, with no allocation.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use futures::future::{abortable, AbortHandle, Aborted};
use futures::stream::{FuturesUnordered, StreamExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{watch, Notify};
use tokio::time::Instant;

use super::admission::Admission;
use super::frame::{split_link, LinkReader, LinkWriter};
use super::handshake::{self, Auth};
use super::setup::{
    self, decode_record, encode_record, host_id, listen, not_connected, record_key, shm_pair,
    shm_setup_ctx, AcceptBackoff, ShmConf, ShmPair, HANDSHAKE_BOUND, SETUP_GRACE,
};
use crate::backends::{BackendInit, OpCtx};
use crate::error::{Error, Result};
use crate::transport::TransportError;

/// How long a lower rank waits at creation (eager links) for a higher
/// rank's dial before it dials that rank itself (see [`Pool::open_all`]).
const LOWER_DIAL_GRACE: Duration = Duration::from_millis(500);

/// One open link: its TCP halves and, for a same-host pair, its rings (or
/// why the pair uses TCP).
pub(crate) struct Link {
    pub(crate) reader: LinkReader,
    pub(crate) writer: LinkWriter,
    /// `None` for a pair on different hosts.
    pub(crate) rings: Option<ShmPair>,
}

/// Where the link to one peer stands.
enum Slot {
    /// No link, and nobody dialing.
    Absent,
    /// This rank is dialing the peer.
    Dialing,
    /// The peer declined this rank's dial: its own dial is under way.
    Awaiting,
    /// A connection became the link; its rings are being set up.
    Opening,
    /// Open, for the backend to take.
    Ready(Box<Link>),
    /// The backend holds the link, or the pool is closed.
    Taken,
    /// The link could not be opened.
    Failed(Error),
}

/// LK-13: whether rank `me`, whose link to `from` stands at `slot`, keeps
/// a verified connection dialed by `from`: yes when it has no link and is
/// not dialing (or was told no and waits for this very dial), and, when it
/// is dialing `from` itself, only if `from` is the higher rank.
fn verdict(slot: &Slot, from: usize, me: usize) -> bool {
    match slot {
        Slot::Absent | Slot::Awaiting => true,
        Slot::Dialing => from > me,
        Slot::Opening | Slot::Ready(_) | Slot::Taken | Slot::Failed(_) => false,
    }
}

/// What every rank published at bootstrap (LK-11).
struct Records {
    addrs: Vec<SocketAddr>,
    hosts: Vec<String>,
    /// Ring setup of this rank; `None` when it shares no host id.
    shm: Option<ShmConf>,
}

/// State shared by the backend and the pool's tasks.
struct Shared {
    comm: String,
    me: usize,
    size: usize,
    epoch: u64,
    timeout: Duration,
    auth: Auth,
    checksum: bool,
    /// One slot per rank (this rank's own stays `Taken`), LK-15.
    slots: Mutex<Vec<Slot>>,
    /// Woken whenever a slot changes.
    changed: Notify,
    records: watch::Sender<Option<Arc<Records>>>,
    /// The last accept that failed for want of file descriptors (LK-10).
    out_of_fds: Mutex<Option<String>>,
    /// The acceptor and every dial or ring setup under way.
    tasks: Mutex<Vec<tokio::task::AbortHandle>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Shared {
    /// The acceptor's verdict on a verified connection from `from`
    /// (LK-13).
    fn decide(&self, from: usize) -> bool {
        let mut slots = lock(&self.slots);
        let Some(slot) = slots.get_mut(from) else {
            return false;
        };
        let take = verdict(slot, from, self.me);
        if take {
            *slot = Slot::Opening;
        }
        take
    }

    /// Set `peer`'s slot to `to` if it is in a state `when` accepts.
    fn set_if(&self, peer: usize, when: impl Fn(&Slot) -> bool, to: Slot) {
        let mut slots = lock(&self.slots);
        if let Some(slot) = slots.get_mut(peer).filter(|s| when(s)) {
            *slot = to;
        }
        drop(slots);
        self.changed.notify_waiters();
    }

    async fn records(&self) -> Arc<Records> {
        let mut rx = self.records.subscribe();
        let got = match rx.wait_for(Option::is_some).await {
            Ok(r) => r.clone(),
            Err(_) => None,
        };
        match got {
            Some(r) => r,
            // The sender lives in `self`, so the channel is never closed
            // while we wait; an empty answer can only be a bug, and is
            // reported as a failed link by the callers' deadlines.
            None => std::future::pending().await,
        }
    }

    fn ctx(&self) -> OpCtx {
        shm_setup_ctx(&self.comm, self.me, self.size, self.epoch)
    }

    /// A link to `peer` was agreed on `stream`: set up its rings when the
    /// pair shares a host, then offer it to the backend.
    async fn open(self: Arc<Self>, peer: usize, stream: TcpStream) {
        let records = self.records().await;
        let (mut reader, mut writer) = split_link(peer, self.epoch, stream, self.checksum);
        let same_host = records
            .shm
            .as_ref()
            .filter(|_| records.hosts.get(peer) == records.hosts.get(self.me));
        let rings = match same_host {
            None => Ok(None),
            Some(conf) => {
                let ctx = self.ctx();
                match tokio::time::timeout(
                    self.timeout,
                    shm_pair(&ctx, conf, peer, &mut writer, &mut reader),
                )
                .await
                {
                    Ok(Ok(pair)) => Ok(Some(pair)),
                    Ok(Err(e)) => Err(e),
                    Err(_) => Err(not_connected(
                        &self.comm,
                        self.me,
                        self.epoch,
                        self.timeout,
                        vec![peer],
                        "the shared-memory setup did not finish",
                    )),
                }
            }
        };
        let to = match rings {
            Ok(rings) => Slot::Ready(Box::new(Link {
                reader,
                writer,
                rings,
            })),
            Err(e) => Slot::Failed(e),
        };
        self.set_if(peer, |s| matches!(s, Slot::Opening), to);
    }

    /// Dial `peer` (its slot is `Dialing`) and settle the slot.
    async fn dial(self: Arc<Self>, peer: usize) {
        let records = self.records().await;
        let Some(&addr) = records.addrs.get(peer) else {
            return;
        };
        let ctx = self.ctx();
        let dialed = tokio::time::timeout(self.timeout, setup::dial(&ctx, &self.auth, peer, addr))
            .await
            .unwrap_or_else(|_| {
                Err(not_connected(
                    &self.comm,
                    self.me,
                    self.epoch,
                    self.timeout,
                    vec![peer],
                    "it did not answer: it died, hangs, or uses a different job secret",
                ))
            });
        match dialed {
            Ok((stream, true)) => {
                let took = {
                    let mut slots = lock(&self.slots);
                    match slots.get_mut(peer) {
                        Some(s @ Slot::Dialing) => {
                            *s = Slot::Opening;
                            true
                        }
                        _ => false,
                    }
                };
                if took {
                    self.open(peer, stream).await;
                } else {
                    // LK-13 makes this unreachable: say so loudly rather
                    // than keep two links to one peer.
                    self.set_if(
                        peer,
                        |_| true,
                        Slot::Failed(Error::Internal(format!(
                            "rank {} kept two links to rank {peer}",
                            self.me
                        ))),
                    );
                }
            }
            Ok((_, false)) => {
                tracing::debug!(rank = self.me, peer, "dial declined; the peer's dial wins");
                self.set_if(peer, |s| matches!(s, Slot::Dialing), Slot::Awaiting);
            }
            Err(e) => self.set_if(peer, |s| matches!(s, Slot::Dialing), Slot::Failed(e)),
        }
    }

    /// Accept, authenticate and settle incoming connections for the life of
    /// the pool (LK-10, LK-12, LK-13).
    async fn accept_loop(self: Arc<Self>, listener: TcpListener) {
        let (me, size, epoch) = (self.me, self.size, self.epoch);
        let mut accepting = FuturesUnordered::new();
        let mut admission = Admission::new(size.saturating_sub(1));
        let mut pending: std::collections::HashMap<u64, AbortHandle> = Default::default();
        let mut next_id = 0u64;
        let mut backoff = AcceptBackoff::default();
        let resume = tokio::time::sleep(Duration::ZERO);
        tokio::pin!(resume);
        let mut paused = false;
        loop {
            tokio::select! {
                _ = &mut resume, if paused => paused = false,
                acc = listener.accept(), if !paused => match acc {
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
                        let shared = self.clone();
                        let (shake, handle) = abortable(async move {
                            let mut taken = None;
                            let r = tokio::time::timeout(
                                HANDSHAKE_BOUND,
                                handshake::accept(&shared.auth, me, size, epoch, &mut stream, |peer| {
                                    let take = shared.decide(peer);
                                    if take {
                                        taken = Some(peer);
                                    }
                                    take
                                }),
                            )
                            .await
                            .unwrap_or_else(|_| {
                                Err(format!("handshake not finished within {HANDSHAKE_BOUND:?}"))
                            });
                            (stream, r, taken)
                        });
                        pending.insert(id, handle);
                        accepting.push(async move { (id, from, shake.await) });
                    }
                    Err(e) => {
                        tracing::warn!(rank = me, error = %e, "accept failed; pausing accepts");
                        let pause = backoff.failed(e);
                        if let Some(e) = backoff.out_of_fds() {
                            *lock(&self.out_of_fds) = Some(e.to_string());
                        }
                        resume.as_mut().reset(Instant::now() + pause);
                        paused = true;
                    }
                },
                Some((id, from, res)) = accepting.next(), if !accepting.is_empty() => {
                    admission.done(id);
                    pending.remove(&id);
                    match res {
                        Ok((stream, Ok((peer, true)), _)) => {
                            tracing::debug!(rank = me, peer, "data link accepted");
                            let task = tokio::spawn(self.clone().open(peer, stream));
                            self.track(task.abort_handle());
                        }
                        Ok((_, Ok((peer, false)), _)) => tracing::debug!(
                            rank = me, %from, peer, "declined a data link: the pair has or dials another"
                        ),
                        Ok((_, Err(detail), taken)) => {
                            tracing::warn!(rank = me, %from, %detail, "refused a data-link connection with a bad handshake");
                            // The verdict was given but never arrived: the
                            // link is lost on both sides.
                            if let Some(peer) = taken {
                                self.set_if(peer, |s| matches!(s, Slot::Opening), Slot::Failed(
                                    not_connected(&self.comm, me, epoch, self.timeout, vec![peer], &detail),
                                ));
                            }
                        }
                        Err(Aborted) => {}
                    }
                }
            }
        }
    }

    /// Remember a task, so that closing the pool stops it.
    fn track(&self, task: tokio::task::AbortHandle) {
        let mut tasks = lock(&self.tasks);
        tasks.retain(|t| !t.is_finished());
        tasks.push(task);
    }
}

/// The links of one communicator on one rank (see the
/// [module docs](self)).
pub(crate) struct Pool {
    shared: Arc<Shared>,
    rt: tokio::runtime::Handle,
}

impl std::fmt::Debug for Pool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pool")
            .field("comm", &self.shared.comm)
            .field("rank", &self.shared.me)
            .finish_non_exhaustive()
    }
}

impl Drop for Pool {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Pool {
    /// Bootstrap the links of `init`: bind the listener and start
    /// accepting, publish this rank's record and read every rank's (LK-11).
    /// No link opens yet.
    ///
    /// # Errors
    /// `PeerFailed` naming the ranks whose records did not appear within
    /// `connect_timeout`; `Transport` if the store fails.
    pub(crate) async fn open(init: &BackendInit, checksum: bool) -> Result<Pool> {
        let (me, size) = (init.rank, init.size);
        let mut slots: Vec<Slot> = (0..size).map(|_| Slot::Absent).collect();
        if let Some(s) = slots.get_mut(me) {
            *s = Slot::Taken;
        }
        let shared = Arc::new(Shared {
            comm: init.comm.clone(),
            me,
            size,
            epoch: init.epoch,
            timeout: init.connect_timeout,
            auth: Auth::new(&init.secret, &init.key_prefix),
            checksum,
            slots: Mutex::new(slots),
            changed: Notify::new(),
            records: watch::Sender::new(None),
            out_of_fds: Mutex::new(None),
            tasks: Mutex::new(Vec::new()),
        });
        let pool = Pool {
            shared: shared.clone(),
            rt: tokio::runtime::Handle::current(),
        };
        if size <= 1 {
            return Ok(pool);
        }
        let listener = listen(init.bind_ip).map_err(|e| {
            Error::Transport(TransportError::Io(format!(
                "binding the data-link listener on {}: {e}",
                init.bind_ip
            )))
        })?;
        let local = listener
            .local_addr()
            .map_err(|e| Error::Transport(TransportError::Io(format!("listener address: {e}"))))?;
        // LK-12: accept from the moment the listener is bound, so that a
        // flood that fills the kernel's queue while this rank waits for the
        // records cannot make a real peer's connect wait for a resent SYN.
        let task = pool.rt.spawn(shared.clone().accept_loop(listener));
        shared.track(task.abort_handle());
        let mine = host_id(init.host_id.as_deref());
        init.store
            .set(
                &record_key(&init.key_prefix, me),
                encode_record(local, &mine),
            )
            .await?;
        tracing::debug!(comm = %init.comm, rank = me, addr = %local, "data-link listener published");
        let keys: Vec<String> = (0..size).map(|r| record_key(&init.key_prefix, r)).collect();
        // A reconfigure's watch may find a member dead before it published
        // its record: stop waiting then, naming it.
        let waited = tokio::select! {
            r = init.store.wait(&keys, init.connect_timeout) => r,
            (failed_ranks, detail) = init.peers_failed.reported() => {
                return Err(Error::PeerFailed {
                    comm: init.comm.clone(),
                    rank: me,
                    epoch: init.epoch,
                    op: "connect",
                    detail,
                    failed_ranks,
                });
            }
        };
        let got = match waited {
            Ok(r) => r,
            Err(TransportError::WaitTimeout { keys: missing, .. }) => {
                let failed = (0..size).filter(|&r| missing.contains(&keys[r])).collect();
                return Err(not_connected(
                    &init.comm,
                    me,
                    init.epoch,
                    init.connect_timeout,
                    failed,
                    "they never published their address: they did not start, or died",
                ));
            }
            Err(e) => return Err(e.into()),
        };
        let mut addrs = Vec::with_capacity(size);
        let mut hosts = Vec::with_capacity(size);
        for (r, raw) in got.iter().enumerate() {
            let (addr, host) = decode_record(raw).ok_or_else(|| {
                Error::Transport(TransportError::Malformed(format!(
                    "store key {} holds {:?}, not a data-link record",
                    keys[r],
                    String::from_utf8_lossy(raw)
                )))
            })?;
            addrs.push(addr);
            hosts.push(host);
        }
        let shares_host =
            !mine.is_empty() && hosts.iter().enumerate().any(|(r, h)| r != me && *h == mine);
        let shm = if shares_host {
            Some(ShmConf::new(me, size)?)
        } else {
            None
        };
        shared
            .records
            .send_replace(Some(Arc::new(Records { addrs, hosts, shm })));
        Ok(pool)
    }

    /// Open the links to `peers` that are not open yet (LK-14), dialing
    /// every one of them that nobody dials, and hand each to `put` once it
    /// is ready. `put` sees every link exactly once over the pool's life.
    ///
    /// # Errors
    /// The error that ended a link's opening (`PeerFailed`, or
    /// `Transport(AuthFailed)` for a peer with another secret);
    /// `PeerFailed` naming the peers whose links were not open within
    /// `connect_timeout`; `Config` when this process ran out of file
    /// descriptors meanwhile.
    pub(crate) async fn ensure(
        &self,
        peers: impl Iterator<Item = usize> + Clone,
        put: impl FnMut(usize, Link),
    ) -> Result<()> {
        let now = Instant::now();
        self.ensure_with(peers, now + self.shared.timeout, |_| now, put)
            .await
    }

    /// Open every link, as a full mesh, right after [`Pool::open`] (the
    /// eager policy). Every rank is bootstrapping too, so the higher rank
    /// of each pair dials at once and the lower one waits for it; a lower
    /// rank whose peer has not dialed within [`LOWER_DIAL_GRACE`] (or a
    /// quarter of `connect_timeout`, if less) dials it itself. A peer that
    /// died after it published its record refuses that dial, so every rank
    /// names it within the grace instead of waiting out `connect_timeout`.
    ///
    /// # Errors
    /// As [`Pool::ensure`]; also `Transport(AuthFailed)` for a peer with
    /// another job secret.
    pub(crate) async fn open_all(&self, put: impl FnMut(usize, Link)) -> Result<()> {
        let start = Instant::now();
        let me = self.shared.me;
        let deadline = start + self.shared.timeout + SETUP_GRACE;
        let grace = (self.shared.timeout / 4).min(LOWER_DIAL_GRACE);
        let dial_from = |p: usize| if p < me { start } else { start + grace };
        self.ensure_with(0..self.shared.size, deadline, dial_from, put)
            .await?;
        tracing::debug!(rank = me, size = self.shared.size, elapsed = ?start.elapsed(), "data-link mesh connected");
        Ok(())
    }

    async fn ensure_with(
        &self,
        peers: impl Iterator<Item = usize> + Clone,
        deadline: Instant,
        dial_from: impl Fn(usize) -> Instant,
        mut put: impl FnMut(usize, Link),
    ) -> Result<()> {
        let shared = &self.shared;
        let mut waiting: Vec<usize> = peers
            .filter(|&p| p < shared.size && p != shared.me)
            .collect();
        let expire = tokio::time::sleep_until(deadline);
        tokio::pin!(expire);
        loop {
            let changed = shared.changed.notified();
            tokio::pin!(changed);
            changed.as_mut().enable();
            let mut failed = None;
            let mut dial = Vec::new();
            // The earliest time a peer not dialed yet is due.
            let mut next_dial: Option<Instant> = None;
            let now = Instant::now();
            {
                let mut slots = lock(&shared.slots);
                waiting.retain(|&p| {
                    let slot = &mut slots[p];
                    match slot {
                        Slot::Ready(_) => {
                            if let Slot::Ready(link) = std::mem::replace(slot, Slot::Taken) {
                                put(p, *link);
                            }
                            false
                        }
                        Slot::Taken => false,
                        Slot::Absent => {
                            let due = dial_from(p);
                            if due <= now {
                                *slot = Slot::Dialing;
                                dial.push(p);
                            } else {
                                next_dial = Some(next_dial.map_or(due, |n| n.min(due)));
                            }
                            true
                        }
                        Slot::Failed(e) => {
                            failed.get_or_insert_with(|| e.clone());
                            true
                        }
                        _ => true,
                    }
                });
            }
            for p in dial {
                let task = self.rt.spawn(shared.clone().dial(p));
                shared.track(task.abort_handle());
            }
            if let Some(e) = failed {
                return Err(e);
            }
            if waiting.is_empty() {
                return Ok(());
            }
            let due = tokio::time::sleep_until(next_dial.unwrap_or(deadline));
            tokio::select! {
                _ = &mut changed => {}
                _ = due, if next_dial.is_some() => {}
                _ = &mut expire => {
                    if let Some(e) = lock(&shared.out_of_fds).clone() {
                        return Err(Error::Config(format!(
                            "communicator {:?}, rank {}: data links to ranks {waiting:?} were not \
                             established within {:?} because this process ran out of file \
                             descriptors ({e}; open-file limit {}); raise it (`ulimit -n`) or run \
                             fewer ranks per host",
                            shared.comm,
                            shared.me,
                            shared.timeout,
                            crate::limits::fd_limit()
                                .map_or_else(|| "unknown".to_string(), |(soft, _)| soft.to_string()),
                        )));
                    }
                    return Err(not_connected(
                        &shared.comm,
                        shared.me,
                        shared.epoch,
                        shared.timeout,
                        waiting,
                        "they did not start, died, or use a different job secret",
                    ));
                }
            }
        }
    }

    /// The host id every rank published, by rank (empty for a rank that
    /// uses no shared memory). O(N); the records are there once
    /// [`Pool::open`] returned.
    pub(crate) fn host_ids(&self) -> Vec<String> {
        self.shared
            .records
            .borrow()
            .as_ref()
            .map(|r| r.hosts.clone())
            .unwrap_or_default()
    }

    /// Stop accepting and dialing, and return the links that opened but
    /// were not taken yet (an abort still tells their peers). Idempotent.
    pub(crate) fn close(&self) -> Vec<(usize, Link)> {
        self.stop();
        let mut slots = lock(&self.shared.slots);
        let mut out = Vec::new();
        for (p, slot) in slots.iter_mut().enumerate() {
            if let Slot::Ready(link) = std::mem::replace(slot, Slot::Taken) {
                out.push((p, *link));
            }
        }
        drop(slots);
        self.shared.changed.notify_waiters();
        out
    }

    fn stop(&self) {
        for t in lock(&self.shared.tasks).drain(..) {
            t.abort();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two ranks that dial each other at once each run the other's dial
    /// through `verdict` while their own slot says `Dialing`: exactly one
    /// of the two connections is kept, the higher rank's, on both sides;
    /// the lower rank's own dial then comes back `false` and it waits
    /// (`Awaiting`), which still takes the higher rank's dial.
    #[test]
    fn lk13_crossing_dials_keep_exactly_the_higher_ranks_connection() {
        for (a, b) in [(0usize, 1usize), (3, 7), (9, 2)] {
            // a's acceptor judges b's dial; b's acceptor judges a's.
            let a_takes = verdict(&Slot::Dialing, b, a);
            let b_takes = verdict(&Slot::Dialing, a, b);
            assert!(a_takes ^ b_takes, "{a} and {b}: exactly one dial kept");
            assert_eq!(a_takes, b > a, "{a} and {b}: the higher rank's dial");
            let (lower, higher) = (a.min(b), a.max(b));
            assert!(verdict(&Slot::Awaiting, higher, lower));
        }
    }

    /// A dial to a rank that is not dialing is kept; one to a rank that
    /// already has or is opening a link, or whose link failed, is not.
    #[test]
    fn lk13_a_single_dial_is_kept_and_a_second_link_never_is() {
        assert!(verdict(&Slot::Absent, 0, 5));
        assert!(verdict(&Slot::Absent, 9, 5));
        for slot in [
            Slot::Opening,
            Slot::Taken,
            Slot::Failed(Error::Internal("x".into())),
        ] {
            assert!(!verdict(&slot, 0, 5));
            assert!(!verdict(&slot, 9, 5));
        }
    }
}
