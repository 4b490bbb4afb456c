//! Presence: whether a member's process is still there while a
//! reconfigured epoch starts, before it has any data link or heartbeat.
//!
//! Owns three things:
//! - the process's **presence endpoint**: one TCP listener per bind address
//!   per process, served for the life of the process by one thread that
//!   accepts every connection and drops it ([`endpoint`]);
//! - the **probe** of a peer's endpoint ([`probe`]);
//! - the **start watch** ([`StartWatch`]) that `reconfigure` runs while the
//!   new epoch's backend connects.
//!
//! Why a listener, and not heartbeats: a killed process loses its listening
//! sockets at once, so a probe of its endpoint is refused, and a host that is
//! gone or cut off does not answer, so the probe times out after the
//! heartbeat timeout. A process that is alive but cannot run for a while
//! (thousands of ranks starting their epoch at once on a few cores) still
//! answers, because the kernel completes the handshake without it. A probe
//! therefore never takes a slow starter for a dead one, which a start-phase
//! heartbeat did in the 4 096-rank simulator.
//!
//! Invariants:
//! - PR-1: only a refused connection, an unreachable host or network, or no
//!   answer within the heartbeat timeout names a peer dead; an error of this
//!   process's own (out of descriptors, no local address) names no one.
//! - PR-2: a watch never probes an endpoint of its own process (equal
//!   addresses are the same process: two processes cannot listen on one).
//!
//! Costs: one socket and one thread, parked in `accept`, per bind address
//! per process, from its first reconfigure on. A watch holds O(1) state,
//! makes one store request (a wait for the epoch's failure notice, plus
//! one write when it finds a death) and one probe per neighbour (at most
//! two) per heartbeat interval.

use std::net::{IpAddr, SocketAddr, TcpListener};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::actors::watchdog::Notice;
use crate::backends::PeerReport;
use crate::transport::{CompareSet, Store};

/// The presence endpoints of this process, by bind address (O(bind
/// addresses), in practice one).
static ENDPOINTS: Mutex<Vec<(IpAddr, SocketAddr)>> = Mutex::new(Vec::new());

/// This process's presence endpoint on `ip`, bound and served on first use.
/// `None` (logged at `warn`) if it cannot be bound or served, and for a
/// wildcard `ip` (`0.0.0.0`, `::`), whose address names no host to a peer:
/// the members of a reconfigure then do not watch this process, and its
/// death while an epoch starts is found at `connect_timeout`.
pub(crate) fn endpoint(ip: IpAddr) -> Option<SocketAddr> {
    if ip.is_unspecified() {
        tracing::debug!(%ip, "a wildcard bind address: no presence endpoint is advertised");
        return None;
    }
    let mut eps = ENDPOINTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    if let Some((_, addr)) = eps.iter().find(|(i, _)| *i == ip) {
        return Some(*addr);
    }
    let bound = TcpListener::bind(SocketAddr::new(ip, 0)).and_then(|l| Ok((l.local_addr()?, l)));
    let (addr, listener) = match bound {
        Ok(b) => b,
        Err(e) => {
            tracing::warn!(%ip, error = %e, "cannot bind a presence endpoint; a death of this process while a reconfigured epoch starts is found at connect_timeout");
            return None;
        }
    };
    let served = std::thread::Builder::new()
        .name("chorus-presence".into())
        .spawn(move || serve(listener));
    if let Err(e) = served {
        tracing::warn!(%ip, error = %e, "cannot start the presence endpoint's thread");
        return None;
    }
    eps.push((ip, addr));
    Some(addr)
}

/// Accept and drop every connection, for the life of the process. A
/// connection is never read: a probe only needs the handshake.
fn serve(listener: TcpListener) {
    loop {
        match listener.accept() {
            Ok((conn, _)) => drop(conn),
            Err(e) => {
                // Out of descriptors or memory: back off rather than spin;
                // the kernel keeps completing handshakes meanwhile.
                let busy = matches!(
                    e.raw_os_error(),
                    Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
                );
                if busy {
                    std::thread::sleep(Duration::from_millis(50));
                }
            }
        }
    }
}

/// What a probe found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Probe {
    /// The endpoint answered, or this process could not tell (PR-1).
    Alive,
    /// The peer's process or host is gone: what was observed.
    Gone(String),
}

/// Ask the presence endpoint at `addr`, waiting at most `timeout` (PR-1).
pub(crate) async fn probe(addr: SocketAddr, timeout: Duration) -> Probe {
    match tokio::time::timeout(timeout, tokio::net::TcpStream::connect(addr)).await {
        Ok(Ok(_)) => Probe::Alive,
        Ok(Err(e)) => match e.raw_os_error() {
            Some(libc::ECONNREFUSED) => Probe::Gone(format!(
                "its process is gone: its presence endpoint {addr} refused a connection"
            )),
            Some(libc::EHOSTUNREACH | libc::ENETUNREACH | libc::EHOSTDOWN) => {
                Probe::Gone(format!("its presence endpoint {addr} is unreachable: {e}"))
            }
            _ => {
                tracing::debug!(%addr, error = %e, "presence probe failed here; not blaming the peer");
                Probe::Alive
            }
        },
        Err(_) => Probe::Gone(format!(
            "its presence endpoint {addr} did not answer within {timeout:?}"
        )),
    }
}

/// The watch one member runs while its new epoch's backend connects: it
/// probes its ring neighbours' presence endpoints every heartbeat interval,
/// publishes the epoch's failure notice naming one that is gone, and waits
/// for that notice, whoever publishes it. Its report is what the backend's
/// [`PeerFailures`](crate::backends::PeerFailures) sees.
pub(crate) struct StartWatch {
    pub(crate) store: Arc<dyn Store>,
    /// The new epoch's failure-notice key.
    pub(crate) notice_key: String,
    pub(crate) epoch: u64,
    /// This member's rank in the new epoch.
    pub(crate) rank: usize,
    /// Ranks in the new epoch and endpoints of the neighbours to probe
    /// (at most two, none of this process: PR-2).
    pub(crate) neighbours: Vec<(usize, SocketAddr)>,
    /// How often to probe (the heartbeat interval).
    pub(crate) interval: Duration,
    /// How long a probe may go unanswered (the heartbeat timeout).
    pub(crate) timeout: Duration,
    /// How long the notice is waited for (the connect timeout; the backend
    /// gives up by then anyway).
    pub(crate) until: Duration,
}

/// The ring neighbours of `rank` among `endpoints` (new rank order; `None`
/// for a member without an endpoint) to probe, leaving out this process's
/// own endpoint `mine` (PR-2). O(1): at most two.
pub(crate) fn neighbours(
    rank: usize,
    endpoints: &[Option<SocketAddr>],
    mine: Option<SocketAddr>,
) -> Vec<(usize, SocketAddr)> {
    let n = endpoints.len();
    if n < 2 || rank >= n {
        return Vec::new();
    }
    let mut out: Vec<(usize, SocketAddr)> = Vec::with_capacity(2);
    for r in [(rank + 1) % n, (rank + n - 1) % n] {
        if r == rank || out.iter().any(|(o, _)| *o == r) {
            continue;
        }
        if let Some(addr) = endpoints[r].filter(|a| Some(*a) != mine) {
            out.push((r, addr));
        }
    }
    out
}

impl StartWatch {
    /// Run until a failure is known (then report it on `report`) or the
    /// notice wait ends with no probe to make. Dropped by the caller once
    /// the backend connected.
    pub(crate) async fn run(self, report: tokio::sync::watch::Sender<Option<PeerReport>>) {
        let notice = self.notice();
        let probes = self.probe_loop();
        tokio::pin!(notice, probes);
        let mut notice_open = true;
        let found = loop {
            tokio::select! {
                n = &mut notice, if notice_open => match n {
                    Some(found) => break found,
                    None => notice_open = false,
                },
                found = &mut probes => break found,
            }
        };
        tracing::warn!(epoch = self.epoch, rank = self.rank, failed = ?found.0, detail = %found.1, "a member died while the epoch started");
        report.send_replace(Some(found));
    }

    /// The epoch's failure notice, once someone publishes it; `None` if the
    /// wait ends without one.
    async fn notice(&self) -> Option<PeerReport> {
        let key = std::slice::from_ref(&self.notice_key);
        let raw = self.store.wait(key, self.until).await.ok()?;
        self.read(raw.first()?)
    }

    fn read(&self, raw: &[u8]) -> Option<PeerReport> {
        let n = Notice::parse(raw, self.epoch)?;
        (!n.failed_ranks.is_empty()).then(|| {
            (
                n.failed_ranks,
                format!("{} (found by rank {})", n.detail, n.by),
            )
        })
    }

    /// Probe the neighbours every interval until one is gone; publish the
    /// notice naming it and return what won (a notice already there wins).
    /// Pending for ever without neighbours.
    async fn probe_loop(&self) -> PeerReport {
        if self.neighbours.is_empty() || self.interval.is_zero() {
            return std::future::pending().await;
        }
        loop {
            tokio::time::sleep(self.interval).await;
            for &(r, addr) in &self.neighbours {
                let Probe::Gone(why) = probe(addr, self.timeout).await else {
                    continue;
                };
                let detail = format!("rank {r} died while epoch {} started: {why}", self.epoch);
                let mine = Notice {
                    epoch: self.epoch,
                    by: self.rank,
                    failed_ranks: vec![r],
                    detail: detail.clone(),
                    mismatch: false,
                };
                match self
                    .store
                    .compare_set(&self.notice_key, None, mine.encode())
                    .await
                {
                    Ok(CompareSet::Current(Some(theirs))) => {
                        if let Some(found) = self.read(&theirs) {
                            return found;
                        }
                    }
                    Ok(_) => {}
                    Err(e) => {
                        tracing::warn!(error = %e, "cannot publish the failure notice; reporting it here only")
                    }
                }
                return (vec![r], detail);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn at(port: u16) -> Option<SocketAddr> {
        Some(SocketAddr::from(([127, 0, 0, 1], port)))
    }

    #[test]
    fn pr2_neighbours_are_the_ring_next_and_previous_but_not_this_process() {
        let eps = [at(1), at(2), at(3), at(4)];
        let ranks = |v: Vec<(usize, SocketAddr)>| v.into_iter().map(|(r, _)| r).collect::<Vec<_>>();
        assert_eq!(ranks(neighbours(0, &eps, at(1))), vec![1, 3]);
        assert_eq!(ranks(neighbours(3, &eps, at(4))), vec![0, 2]);
        // Two members: one neighbour. One member: none.
        assert_eq!(ranks(neighbours(0, &eps[..2], at(1))), vec![1]);
        assert!(neighbours(0, &eps[..1], at(1)).is_empty());
        // Members of this process, and members without an endpoint, are
        // not probed; nor is a wildcard address advertised.
        assert_eq!(endpoint(IpAddr::from([0, 0, 0, 0])), None);
        let shared = [at(1), at(1), None, at(1)];
        assert!(neighbours(0, &shared, at(1)).is_empty());
        assert_eq!(
            ranks(neighbours(2, &[at(1), at(2), at(3), at(4)], at(3))),
            vec![3, 1]
        );
    }

    fn closed_port() -> SocketAddr {
        TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("port")
    }

    fn watch(
        store: &Arc<crate::transport::MemoryStore>,
        neighbours: Vec<(usize, SocketAddr)>,
    ) -> StartWatch {
        StartWatch {
            store: store.clone(),
            notice_key: "w/epoch/1/failed".into(),
            epoch: 1,
            rank: 0,
            neighbours,
            interval: Duration::from_millis(20),
            timeout: Duration::from_secs(5),
            until: Duration::from_secs(60),
        }
    }

    /// A neighbour whose endpoint refuses is named in the epoch's notice
    /// and reported; a live one is not.
    #[tokio::test]
    async fn el8_a_watch_names_a_gone_neighbour_in_the_notice_and_reports_it() {
        let store = Arc::new(crate::transport::MemoryStore::new());
        let live = endpoint(IpAddr::from([127, 0, 0, 1])).expect("endpoint");
        let (tx, failures) = crate::backends::PeerFailures::channel();
        let w = watch(&store, vec![(1, live), (3, closed_port())]);
        let run = tokio::spawn(w.run(tx));
        let (failed, detail) = tokio::time::timeout(Duration::from_secs(10), failures.reported())
            .await
            .expect("reported within the bound");
        assert_eq!(failed, vec![3]);
        assert!(detail.contains("refused"), "{detail}");
        run.await.expect("watch task");
        let raw = store
            .get("w/epoch/1/failed")
            .await
            .unwrap()
            .expect("notice");
        let n = Notice::parse(&raw, 1).expect("a notice of epoch 1");
        assert_eq!((n.by, n.failed_ranks), (0, vec![3]));
    }

    /// A notice someone else published is reported at once, without a
    /// probe; one of another epoch is not.
    #[tokio::test]
    async fn el8_a_watch_reports_the_notice_of_its_epoch_only() {
        let store = Arc::new(crate::transport::MemoryStore::new());
        let old = Notice {
            epoch: 0,
            by: 2,
            failed_ranks: vec![1],
            detail: "old".into(),
            mismatch: false,
        };
        store.set("w/epoch/1/failed", old.encode()).await.unwrap();
        let (tx, failures) = crate::backends::PeerFailures::channel();
        let mut w = watch(&store, Vec::new());
        w.until = Duration::from_millis(200);
        // The stale notice ends the wait without a report, and with no
        // neighbour to probe the watch then waits for ever.
        let ended = tokio::time::timeout(Duration::from_millis(500), w.run(tx)).await;
        assert!(ended.is_err(), "a notice of another epoch was reported");
        assert!(
            tokio::time::timeout(Duration::from_millis(10), failures.reported())
                .await
                .is_err()
        );

        let store = Arc::new(crate::transport::MemoryStore::new());
        let (tx, failures) = crate::backends::PeerFailures::channel();
        let run = tokio::spawn(watch(&store, Vec::new()).run(tx));
        let theirs = Notice {
            epoch: 1,
            by: 2,
            failed_ranks: vec![5],
            detail: "rank 5 died while epoch 1 started".into(),
            mismatch: false,
        };
        store
            .set("w/epoch/1/failed", theirs.encode())
            .await
            .unwrap();
        let (failed, detail) = tokio::time::timeout(Duration::from_secs(10), failures.reported())
            .await
            .expect("reported");
        assert_eq!(failed, vec![5]);
        assert!(detail.contains("found by rank 2"), "{detail}");
        run.await.expect("watch task");
    }

    /// The cpu backend's connect, waiting for a peer that never publishes
    /// its address, stops when the watch reports it, long before its
    /// connect timeout, with `PeerFailed` naming it.
    #[tokio::test]
    async fn el8_a_connect_stops_waiting_for_a_member_the_watch_reports() {
        let store = Arc::new(crate::transport::MemoryStore::new());
        let (tx, failures) = crate::backends::PeerFailures::channel();
        let init = crate::backends::BackendInit {
            comm: "w".into(),
            key_prefix: "w/epoch/1".into(),
            rank: 0,
            size: 2,
            epoch: 1,
            store: store.clone(),
            secret: Arc::from(&b"s"[..]),
            connect_timeout: Duration::from_secs(60),
            bind_ip: IpAddr::from([127, 0, 0, 1]),
            links: crate::backends::LinkPolicy::Auto,
            host_id: None,
            peers_failed: failures,
        };
        let connect = tokio::spawn(crate::backends::cpu::CpuBackend::connect(init));
        tokio::time::sleep(Duration::from_millis(50)).await;
        tx.send_replace(Some((vec![1], "rank 1 died while epoch 1 started".into())));
        let r = tokio::time::timeout(Duration::from_secs(10), connect)
            .await
            .expect("the connect stopped within the bound")
            .expect("connect task");
        match r {
            Err(crate::Error::PeerFailed {
                failed_ranks,
                detail,
                ..
            }) => {
                assert_eq!(failed_ranks, vec![1]);
                assert!(detail.contains("died while epoch 1 started"), "{detail}");
            }
            Err(e) => panic!("not PeerFailed: {e}"),
            Ok(_) => panic!("connected without rank 1"),
        }
    }

    #[tokio::test]
    async fn pr1_an_endpoint_answers_and_a_closed_port_is_gone() {
        let addr = endpoint(IpAddr::from([127, 0, 0, 1])).expect("endpoint");
        // The same endpoint for every caller on that address.
        assert_eq!(endpoint(IpAddr::from([127, 0, 0, 1])), Some(addr));
        for _ in 0..3 {
            assert_eq!(probe(addr, Duration::from_secs(5)).await, Probe::Alive);
        }
        // A port nobody listens on any more: refused.
        match probe(closed_port(), Duration::from_secs(5)).await {
            Probe::Gone(why) => assert!(why.contains("refused"), "{why}"),
            Probe::Alive => panic!("a closed port answered"),
        }
    }
}
