//! Bootstrap: who am I, how many are we, and where is the store.
//!
//! Rank and world size come from [`CommOptions`] if set, else from the first
//! launcher convention present in the environment:
//!
//! | launcher | rank | size |
//! |----------|------|------|
//! | chorus   | `CHORUS_RANK` | `CHORUS_SIZE` |
//! | mpirun (Open MPI) | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` |
//! | Slurm / MPICH (PMI) | `PMI_RANK` | `PMI_SIZE` |
//! | torchrun, `chorus-run` | `RANK` | `WORLD_SIZE` |
//!
//! else rank 0 of 1. The store is found through [`Rendezvous`]: for
//! `Rendezvous::Env`, `CHORUS_STORE=etcd://host:port,...` names an etcd
//! cluster (feature `etcd`), else `CHORUS_STORE_ADDR` names a running
//! store (the one `chorus-run` hosts, or a `chorus-rendezvous`); otherwise
//! `MASTER_ADDR`/`MASTER_PORT` name the store that rank 0 hosts. Keys are
//! scoped by a job id ([`job_id`], [`agreed_job_id`]).
//!
//! Store keys are scoped by communicator name, instance and epoch
//! (`chorus/<job>/<name>/<instance>/epoch/<epoch>/…`), where `instance` counts the
//! calls to create a communicator of that name on this rank, failed ones
//! included (a call takes its number before anything can fail) — never a
//! process-wide counter, so ranks that create different subgroups, or
//! whose call failed on one rank only, stay in step.

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr, SocketAddr, ToSocketAddrs};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::options::{CommOptions, Rendezvous};
use crate::transport::{MemoryStore, RendezvousServer, Store, StoreClient};

const RANK_VARS: [(&str, &str); 4] = [
    ("CHORUS_RANK", "CHORUS_SIZE"),
    ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
    ("PMI_RANK", "PMI_SIZE"),
    ("RANK", "WORLD_SIZE"),
];

fn env_usize(var: &str) -> Result<Option<usize>> {
    match std::env::var(var) {
        Ok(v) => v
            .trim()
            .parse()
            .map(Some)
            .map_err(|_| Error::Config(format!("{var}={v:?} is not a non-negative integer"))),
        Err(_) => Ok(None),
    }
}

/// Rank and size from the environment, per the table above.
pub fn env_rank_size() -> Result<Option<(usize, usize)>> {
    for (r, s) in RANK_VARS {
        match (env_usize(r)?, env_usize(s)?) {
            (Some(rank), Some(size)) => return Ok(Some((rank, size))),
            (None, None) => {}
            _ => {
                return Err(Error::Config(format!(
                    "only one of {r} and {s} is set; set both or neither"
                )))
            }
        }
    }
    Ok(None)
}

/// Resolve rank and size from options, then environment, else 0 of 1.
pub fn rank_size(opts: &CommOptions) -> Result<(usize, usize)> {
    let (rank, size) = match (opts.rank, opts.size) {
        (Some(r), Some(s)) => (r, s),
        (None, None) => env_rank_size()?.unwrap_or((0, 1)),
        _ => {
            return Err(Error::Config(
                "CommOptions: set both rank and size, or neither".into(),
            ))
        }
    };
    if size == 0 || rank >= size {
        return Err(Error::Config(format!(
            "rank {rank} is not in a world of {size} ranks"
        )));
    }
    Ok((rank, size))
}

/// The job secret: from the options, else `CHORUS_SECRET`.
pub fn secret(opts: &CommOptions) -> Option<Vec<u8>> {
    opts.secret
        .clone()
        .or_else(|| std::env::var("CHORUS_SECRET").ok().map(String::into_bytes))
        .filter(|s| !s.is_empty())
}

fn resolve(host: &str, port: &str) -> Result<SocketAddr> {
    let port: u16 = port
        .trim()
        .parse()
        .map_err(|_| Error::Config(format!("MASTER_PORT={port:?} is not a port number")))?;
    (host.trim(), port)
        .to_socket_addrs()
        .map_err(|e| Error::Config(format!("cannot resolve MASTER_ADDR={host:?}: {e}")))?
        .next()
        .ok_or_else(|| Error::Config(format!("MASTER_ADDR={host:?} resolves to no address")))
}

/// Turn `Rendezvous::Env` into a concrete rendezvous.
pub fn resolve_env(size: usize) -> Result<Rendezvous> {
    if let Ok(addr) = std::env::var("CHORUS_STORE_ADDR") {
        let sa = addr
            .to_socket_addrs()
            .map_err(|e| Error::Config(format!("CHORUS_STORE_ADDR={addr:?}: {e}")))?
            .next()
            .ok_or_else(|| {
                Error::Config(format!("CHORUS_STORE_ADDR={addr:?} resolves to nothing"))
            })?;
        return Ok(Rendezvous::Server(sa));
    }
    match (std::env::var("MASTER_ADDR"), std::env::var("MASTER_PORT")) {
        (Ok(h), Ok(p)) => Ok(Rendezvous::Master(resolve(&h, &p)?)),
        _ if size == 1 => Ok(Rendezvous::Store(Arc::new(MemoryStore::new()))),
        _ => Err(Error::Config(format!(
            "a world of {size} ranks needs a rendezvous: set MASTER_ADDR and MASTER_PORT \
             (rank 0 hosts the store), or CHORUS_STORE_ADDR (a running chorus-rendezvous), \
             or pass CommOptions::rendezvous; `chorus-run -n N` sets these for you"
        ))),
    }
}

/// The store servers this process hosts, by the address asked for. A server
/// stays here, serving, until the process exits: rank 0 of every
/// communicator created at that address uses it, one after another or at
/// once, so finalizing one communicator never takes the store from under
/// the ranks that already create the next (their keys are scoped by the
/// communicator's name and instance). Only a communicator that fails to
/// start while no other uses the server closes it ([`close_hosted_store`]).
/// Each server is listed with the SHA-256 of the job secret it checks, so
/// that a communicator with another secret is told so instead of reaching
/// a store that refuses its ranks. O(addresses hosted).
fn servers() -> &'static Mutex<HashMap<SocketAddr, Hosted>> {
    static S: std::sync::OnceLock<Mutex<HashMap<SocketAddr, Hosted>>> = std::sync::OnceLock::new();
    S.get_or_init(Default::default)
}

/// A store server this process hosts, and the digest of its job secret.
type Hosted = (Arc<RendezvousServer>, ring::digest::Digest);

fn secret_digest(secret: &[u8]) -> ring::digest::Digest {
    ring::digest::digest(&ring::digest::SHA256, secret)
}

/// How long a rank whose communicator failed to start waits for the store
/// it hosts to close its clients' connections ([`close_hosted_store`]).
const STORE_CLOSE_WAIT: Duration = Duration::from_millis(200);

/// Close `server`, the store this rank hosts, when no communicator of this
/// process uses it, and wait up to [`STORE_CLOSE_WAIT`] for the close
/// to reach its clients. Called when a communicator fails to start: the
/// caller may exit right after, and a closing server's last datagrams are
/// sent by its endpoint task, so without the wait a client with a request
/// in flight heard nothing and waited for its response margin.
pub(crate) async fn close_hosted_store(server: Arc<RendezvousServer>) {
    {
        // Under the registry's lock, so that no other communicator takes
        // the server up between the check and the removal.
        let Ok(mut m) = servers().lock() else {
            return;
        };
        let listed = m.values().any(|(s, _)| Arc::ptr_eq(s, &server));
        if Arc::strong_count(&server) > 1 + usize::from(listed) {
            return;
        }
        m.retain(|_, (s, _)| !Arc::ptr_eq(s, &server));
    }
    server.shutdown();
    let _ = tokio::time::timeout(STORE_CLOSE_WAIT, server.stopped()).await;
}

/// A connected store, plus the server this rank hosts (kept alive with the comm).
pub struct Connected {
    /// The store.
    pub store: Arc<dyn Store>,
    /// The server hosted by this rank, if any.
    pub server: Option<Arc<RendezvousServer>>,
    /// The IP address to advertise for data links.
    pub local_ip: IpAddr,
    /// Whether the store is shared beyond this process (a server, not an
    /// in-process [`Rendezvous::Store`]): then ranks agree on a job id
    /// through it ([`agreed_job_id`]).
    pub shared: bool,
    /// The rank whose process hosts the store (rank 0 of a `Master`
    /// rendezvous, as torchrun lays it out), or `None` when the store lives
    /// outside the job's ranks (a launcher, `chorus-rendezvous`, etcd).
    pub store_host: Option<usize>,
}

fn need_secret(secret: &Option<Vec<u8>>) -> Result<Vec<u8>> {
    secret.clone().ok_or_else(|| {
        Error::Config(
            "no job secret: set CHORUS_SECRET (the same value on every rank) or \
             CommOptions::secret; `chorus-run` generates one for you"
                .into(),
        )
    })
}

/// Connect to (and, for rank 0 of a `Master` rendezvous, host) the store.
pub async fn connect_store(
    rendezvous: Rendezvous,
    rank: usize,
    size: usize,
    secret: &Option<Vec<u8>>,
    timeout: Duration,
) -> Result<Connected> {
    if matches!(rendezvous, Rendezvous::Env) {
        if let Some(url) = std::env::var("CHORUS_STORE").ok().filter(|s| !s.is_empty()) {
            return connect_url(&url, secret, timeout).await;
        }
    }
    let rendezvous = match rendezvous {
        Rendezvous::Env => resolve_env(size)?,
        other => other,
    };
    let loopback = IpAddr::V4(Ipv4Addr::LOCALHOST);
    match rendezvous {
        Rendezvous::Env => Err(Error::Internal("unresolved rendezvous".into())),
        Rendezvous::Store(store) => Ok(Connected {
            store,
            server: None,
            local_ip: loopback,
            shared: false,
            store_host: None,
        }),
        Rendezvous::Server(addr) => {
            let secret = need_secret(secret)?;
            let client = StoreClient::connect(addr, &secret, timeout).await?;
            let local_ip = client.local_ip();
            Ok(Connected {
                store: Arc::new(client),
                server: None,
                local_ip,
                shared: true,
                store_host: None,
            })
        }
        Rendezvous::Master(addr) => {
            let secret = need_secret(secret)?;
            let mut server = None;
            let mut connect_to = addr;
            if rank == 0 {
                let digest = secret_digest(&secret);
                let existing = servers()
                    .lock()
                    .ok()
                    .and_then(|m| m.get(&addr).filter(|(s, _)| s.is_serving()).cloned());
                let s = match existing {
                    Some((s, d)) if d.as_ref() == digest.as_ref() => s,
                    Some(_) => {
                        return Err(Error::Config(format!(
                            "rank 0 already hosts a store at {addr} for another job secret; give \
                             this communicator the same secret, or another MASTER_PORT"
                        )))
                    }
                    None => {
                        let s = Arc::new(RendezvousServer::bind(addr, &secret).await?);
                        if let Ok(mut m) = servers().lock() {
                            m.insert(addr, (s.clone(), digest));
                        }
                        s
                    }
                };
                if addr.ip().is_unspecified() {
                    connect_to = SocketAddr::new(loopback, s.local_addr().port());
                }
                server = Some(s);
            }
            let client = StoreClient::connect(connect_to, &secret, timeout).await?;
            let local_ip = client.local_ip();
            Ok(Connected {
                store: Arc::new(client),
                server,
                local_ip,
                shared: true,
                store_host: Some(0),
            })
        }
    }
}

/// Connect to the store `CHORUS_STORE` names (`etcd://host:port[,...]`).
async fn connect_url(url: &str, secret: &Option<Vec<u8>>, timeout: Duration) -> Result<Connected> {
    if !url.starts_with("etcd://") {
        return Err(Error::Config(format!(
            "CHORUS_STORE={url:?}: the only store URL known is etcd://host:port[,host:port...]"
        )));
    }
    #[cfg(feature = "etcd")]
    {
        let secret = need_secret(secret)?;
        let endpoints = crate::transport::etcd::parse_url(url)?;
        let user = match (
            std::env::var("CHORUS_ETCD_USER"),
            std::env::var("CHORUS_ETCD_PASSWORD"),
        ) {
            (Ok(u), Ok(p)) => Some((u, p)),
            (Err(_), Err(_)) => None,
            _ => {
                return Err(Error::Config(
                    "set both CHORUS_ETCD_USER and CHORUS_ETCD_PASSWORD, or neither".into(),
                ))
            }
        };
        let store =
            crate::transport::EtcdStore::connect(&endpoints, &secret, user, timeout).await?;
        let local_ip = store.local_ip();
        Ok(Connected {
            store: Arc::new(store),
            server: None,
            local_ip,
            shared: true,
            store_host: None,
        })
    }
    #[cfg(not(feature = "etcd"))]
    {
        let _ = (secret, timeout);
        Err(Error::Config(format!(
            "CHORUS_STORE={url:?} needs the etcd store: build chorus with the `etcd` feature"
        )))
    }
}

/// The job id of communicators whose store lives in this process
/// ([`Rendezvous::Store`]), and the base of [`agreed_job_id`]:
/// `CHORUS_JOB_ID` (set by `chorus-run`, fresh for each launch), else one
/// derived from the job secret, else `local`. Two jobs with different ids,
/// or different secrets, never read each other's keys on a shared store.
///
/// # Errors
/// [`Error::Config`] for an empty `CHORUS_JOB_ID` or one containing `/`.
pub fn job_id(secret: &[u8]) -> Result<String> {
    if let Some(v) = std::env::var_os("CHORUS_JOB_ID") {
        let v = v.to_string_lossy().into_owned();
        if v.is_empty() || v.contains('/') {
            return Err(Error::Config(format!(
                "CHORUS_JOB_ID={v:?} must be non-empty and contain no '/'"
            )));
        }
        return Ok(v);
    }
    if secret.is_empty() {
        return Ok("local".into());
    }
    let digest = ring::digest::digest(
        &ring::digest::SHA256,
        &[b"chorus-job-id-v1:".as_slice(), secret].concat(),
    );
    let hex: String = digest.as_ref()[..8]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    Ok(format!("s{hex}"))
}

/// Who asks for the job id in [`agreed_job_id`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JobRole {
    /// Rank 0 of a new job: it fixes the start time.
    Rank0,
    /// Another rank of a new job: it takes rank 0's start time if that is
    /// from this launch (no older than the window before this process asked).
    Rank,
    /// A rank joining a running job later (`join_comm`): it takes the
    /// current start time, however old.
    Joiner,
}

/// Milliseconds since the Unix epoch.
fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
        .unwrap_or(0)
}

/// The job id agreed on a shared store, once per process and secret.
type Agreed = Mutex<HashMap<String, String>>;
fn agreed() -> &'static Agreed {
    static A: std::sync::OnceLock<Agreed> = std::sync::OnceLock::new();
    A.get_or_init(Default::default)
}

/// When this process first asked for an agreed job id (ms since the epoch).
fn first_asked_ms() -> u64 {
    static T: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *T.get_or_init(unix_ms)
}

/// The store key under which rank 0 publishes the start of the job that
/// `base` (from [`job_id`]) names.
pub fn job_start_key(base: &str) -> String {
    format!("chorus/{base}/start")
}

/// The key counting the ranks that took the start `value` of the job `base`.
fn joined_key(base: &str, value: &str) -> String {
    format!("chorus/{base}-{value}/joined")
}

/// The job id that scopes every key of this process's communicators on a
/// shared store.
///
/// `CHORUS_JOB_ID` if set (`chorus-run` sets a fresh one for each launch),
/// or `local` without a secret. Otherwise rank 0 publishes the time it
/// started, with a random tag, under [`job_start_key`], and the job id is
/// the secret-derived id plus that: a relaunch with the same secret on a
/// reused store gets a new id, so it never reads the last launch's keys.
/// Every rank counts itself in; another rank takes a start time only if it
/// is of a world of `size` ranks, while fewer than `size` ranks took it (a
/// full count is the last launch's), and if it is no older than `window`
/// (the connect timeout) before this process first asked; otherwise it
/// waits for this launch's rank 0. A
/// joiner takes the current start time. Agreed once per process and
/// secret: every later communicator of this process uses the same id.
///
/// Without `CHORUS_JOB_ID`, a launch that died before all its ranks
/// arrived, relaunched within `window` with the same secret on one store,
/// can still be met; give launches distinct `CHORUS_JOB_ID`s (or use
/// `chorus-run`) where that matters. Hosts' clocks must agree to within
/// `window`. One start key and one count stay in the store per secret.
///
/// # Errors
/// [`Error::Config`] for a bad `CHORUS_JOB_ID`, or when no start time of
/// this launch appeared within `window`; [`Error::Transport`] if the store
/// fails.
pub async fn agreed_job_id(
    store: &dyn Store,
    role: JobRole,
    size: usize,
    secret: &[u8],
    window: Duration,
) -> Result<String> {
    let base = job_id(secret)?;
    if std::env::var_os("CHORUS_JOB_ID").is_some() || secret.is_empty() {
        return Ok(base);
    }
    if let Some(id) = agreed()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .get(&base)
    {
        return Ok(id.clone());
    }
    let asked = first_asked_ms();
    let key = job_start_key(&base);
    let window_ms = u64::try_from(window.as_millis()).unwrap_or(u64::MAX);
    let start = match role {
        JobRole::Rank0 => {
            use ring::rand::SecureRandom;
            let mut tag = [0u8; 4];
            ring::rand::SystemRandom::new()
                .fill(&mut tag)
                .map_err(|_| Error::Internal("the system random number generator failed".into()))?;
            let tag: String = tag.iter().map(|b| format!("{b:02x}")).collect();
            let v = format!("{}-{tag}-{size}", unix_ms());
            let old = store.get(&key).await?;
            store.add(&joined_key(&base, &v), 1).await?;
            store.set(&key, v.clone().into_bytes()).await?;
            if let Some(old) = old {
                let old = String::from_utf8_lossy(&old);
                store.delete(&joined_key(&base, &old)).await?;
            }
            v
        }
        JobRole::Rank | JobRole::Joiner => {
            // `<ms>-<tag>-<size>`: recent enough, and of a world this size.
            let ours = |v: &str| {
                let f: Vec<&str> = v.split('-').collect();
                let recent = f
                    .first()
                    .and_then(|t| t.parse::<u64>().ok())
                    .is_some_and(|t| t.saturating_add(window_ms) >= asked);
                let same = f.get(2).and_then(|s| s.parse::<usize>().ok()) == Some(size);
                f.len() == 3 && recent && same
            };
            let deadline = tokio::time::Instant::now() + window;
            let mut pause = Duration::from_millis(10);
            let mut refused = String::new();
            loop {
                let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                let v = match store.wait(std::slice::from_ref(&key), left).await {
                    Ok(mut v) => String::from_utf8_lossy(&v.pop().unwrap_or_default()).into_owned(),
                    Err(crate::transport::TransportError::WaitTimeout { .. }) => String::new(),
                    Err(e) => return Err(e.into()),
                };
                if !v.is_empty() && !v.contains('/') && v != refused {
                    if role == JobRole::Joiner {
                        break v;
                    }
                    if ours(&v) {
                        let joined = joined_key(&base, &v);
                        let n = store.add(&joined, 1).await?;
                        // Rank 0 replaces the start time before it deletes
                        // the old count: a count taken on a deleted key shows
                        // here as a start time that changed.
                        let now = store.get(&key).await?;
                        if now.as_deref() != Some(v.as_bytes()) {
                            store.delete(&joined).await?;
                        } else if usize::try_from(n).is_ok_and(|n| n <= size) {
                            break v;
                        }
                    }
                    // The last launch's start time: wait for this launch's rank 0.
                    refused = v;
                }
                if tokio::time::Instant::now() >= deadline {
                    return Err(Error::Config(format!(
                        "no start time of this launch from rank 0 under {key:?} within {window:?} \
                         (found {refused:?}, from an earlier launch with the same secret); set \
                         CHORUS_JOB_ID to the same fresh value on every rank, or launch with chorus-run"
                    )));
                }
                tokio::time::sleep(pause.min(left)).await;
                pause = (pause * 2).min(Duration::from_millis(100));
            }
        }
    };
    let id = format!("{base}-{start}");
    let mut m = agreed().lock().unwrap_or_else(|e| e.into_inner());
    Ok(m.entry(base).or_insert(id).clone())
}

/// The instance number of the next communicator called `name` on this rank.
pub fn next_instance(name: &str, rank: usize, size: usize) -> u64 {
    type Counts = Mutex<HashMap<(String, usize, usize), u64>>;
    static COUNTS: std::sync::OnceLock<Counts> = std::sync::OnceLock::new();
    let mut m = COUNTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    let c = m.entry((name.to_string(), rank, size)).or_insert(0);
    let k = *c;
    *c += 1;
    k
}

/// Where data links should listen: options, `CHORUS_DATA_IP`, else `fallback`.
pub fn bind_ip(opts: &CommOptions, fallback: IpAddr) -> Result<IpAddr> {
    if let Some(ip) = opts.bind_ip {
        return Ok(ip);
    }
    match std::env::var("CHORUS_DATA_IP") {
        Ok(v) => v
            .parse()
            .map_err(|_| Error::Config(format!("CHORUS_DATA_IP={v:?} is not an IP address"))),
        Err(_) => Ok(fallback),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn explicit_rank_out_of_range_is_a_config_error() {
        let opts = CommOptions::default().with_rank(4, 4);
        assert!(matches!(rank_size(&opts), Err(Error::Config(_))));
    }

    #[tokio::test]
    async fn store_urls_other_than_etcd_are_refused() {
        let secret = Some(b"s".to_vec());
        let e = connect_url("redis://h:1", &secret, Duration::from_secs(1)).await;
        assert!(matches!(e, Err(Error::Config(_))));
        #[cfg(not(feature = "etcd"))]
        {
            let e = connect_url("etcd://h:1", &secret, Duration::from_secs(1)).await;
            assert!(matches!(e, Err(Error::Config(m)) if m.contains("`etcd` feature")));
        }
    }

    #[test]
    fn instances_count_per_name_and_rank() {
        let a = next_instance("bootstrap-test-x", 0, 2);
        let b = next_instance("bootstrap-test-x", 1, 2);
        let c = next_instance("bootstrap-test-x", 0, 2);
        assert_eq!((a, b, c), (0, 0, 1));
    }
}
