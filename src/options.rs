//! A communicator's options and the types they name: [`Device`],
//! [`Rendezvous`] and [`CommOptions`]. Every layer may read them (the
//! bootstrap, the backends); they depend on nothing but the transport's
//! `Store` trait.

use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::time::Duration;

use crate::error::{Error, Result};
use crate::transport::Store;

/// The device a communicator's buffers live on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Device {
    /// Host memory.
    Cpu,
    /// A CUDA device, by ordinal.
    Cuda(usize),
}

impl std::fmt::Display for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(i) => write!(f, "cuda:{i}"),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = Error;
    fn from_str(s: &str) -> Result<Device> {
        match s {
            "cpu" => Ok(Device::Cpu),
            "cuda" => Ok(Device::Cuda(0)),
            _ => s
                .strip_prefix("cuda:")
                .and_then(|i| i.parse().ok())
                .map(Device::Cuda)
                .ok_or_else(|| {
                    Error::Config(format!("unknown device {s:?}; use \"cpu\" or \"cuda:N\""))
                }),
        }
    }
}

/// How the ranks of a communicator find each other.
#[derive(Clone, Default)]
pub enum Rendezvous {
    /// From the environment, as launchers set it: `CHORUS_STORE_ADDR` (a
    /// running `chorus-rendezvous`), else `MASTER_ADDR`/`MASTER_PORT` (rank 0
    /// hosts the store, torchrun style). A world of one rank needs neither.
    #[default]
    Env,
    /// Rank 0 hosts the store at this address; the other ranks connect to it.
    Master(SocketAddr),
    /// Connect to an already running store (e.g. `chorus-rendezvous`).
    Server(SocketAddr),
    /// Use this store object (ranks in one process; tests).
    Store(Arc<dyn Store>),
}

impl std::fmt::Debug for Rendezvous {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Rendezvous::Env => f.write_str("Env"),
            Rendezvous::Master(a) => write!(f, "Master({a})"),
            Rendezvous::Server(a) => write!(f, "Server({a})"),
            Rendezvous::Store(_) => f.write_str("Store(..)"),
        }
    }
}

/// Options of [`new_comm`](crate::new_comm).
///
/// ```
/// use std::time::Duration;
/// use chorus::CommOptions;
/// let opts = CommOptions::default().with_timeout(Duration::from_secs(30));
/// assert_eq!(opts.timeout, Duration::from_secs(30));
/// ```
#[derive(Debug, Clone)]
pub struct CommOptions {
    /// Default timeout of every op (10 minutes); override per op with
    /// [`Comm::with_timeout`](crate::Comm::with_timeout).
    pub timeout: Duration,
    /// How long bootstrap (store connection, connecting to every peer) may take.
    pub connect_timeout: Duration,
    /// How ranks find each other.
    pub rendezvous: Rendezvous,
    /// The job secret every rank must share; `None` reads `CHORUS_SECRET`.
    pub secret: Option<Vec<u8>>,
    /// This rank; `None` reads the environment (`CHORUS_RANK`,
    /// `OMPI_COMM_WORLD_RANK`, `PMI_RANK`, `RANK`), else 0.
    pub rank: Option<usize>,
    /// Number of ranks; `None` reads the environment (`CHORUS_SIZE`,
    /// `OMPI_COMM_WORLD_SIZE`, `PMI_SIZE`, `WORLD_SIZE`), else 1.
    pub size: Option<usize>,
    /// IP address for data links; `None` reads `CHORUS_DATA_IP`, else uses the
    /// address this host uses to reach the store.
    pub bind_ip: Option<IpAddr>,
    /// How often each rank writes its heartbeat to the store and reads its
    /// peers' (1 s). `Duration::ZERO` turns the watchdog off. A world of one
    /// rank never runs one.
    pub heartbeat_interval: Duration,
    /// A peer whose heartbeat did not advance for this long (10 s) is declared
    /// failed, and so is this rank if it cannot reach the store for this long.
    pub heartbeat_timeout: Duration,
    /// The tokio runtime the communicator's actor, links and heartbeats run
    /// on; `None` (the default) uses a multi-thread runtime owned by
    /// Chorus. A current-thread runtime works for the async API only:
    /// blocking methods called on its thread return [`Error::WouldBlock`].
    pub runtime: Option<tokio::runtime::Handle>,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            timeout: Duration::from_secs(600),
            connect_timeout: Duration::from_secs(120),
            rendezvous: Rendezvous::Env,
            secret: None,
            rank: None,
            size: None,
            bind_ip: None,
            heartbeat_interval: Duration::from_secs(1),
            heartbeat_timeout: Duration::from_secs(10),
            runtime: None,
        }
    }
}

impl CommOptions {
    /// Options for a world of one rank, independent of the environment.
    pub fn single() -> CommOptions {
        CommOptions::default().with_rank(0, 1)
    }

    /// Set the default op timeout.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Set the bootstrap timeout.
    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// Set rank and world size explicitly.
    pub fn with_rank(mut self, rank: usize, size: usize) -> Self {
        self.rank = Some(rank);
        self.size = Some(size);
        self
    }

    /// Set the rendezvous.
    pub fn with_rendezvous(mut self, rendezvous: Rendezvous) -> Self {
        self.rendezvous = rendezvous;
        self
    }

    /// Set the job secret.
    pub fn with_secret(mut self, secret: impl Into<Vec<u8>>) -> Self {
        self.secret = Some(secret.into());
        self
    }

    /// Set the data-link IP address.
    pub fn with_bind_ip(mut self, ip: IpAddr) -> Self {
        self.bind_ip = Some(ip);
        self
    }

    /// Run the communicator's tasks on `runtime` (e.g. `Handle::current()`
    /// in an async service) instead of Chorus's own runtime.
    pub fn with_runtime(mut self, runtime: tokio::runtime::Handle) -> Self {
        self.runtime = Some(runtime);
        self
    }

    /// Set the watchdog's heartbeat interval and failure timeout
    /// (`interval == Duration::ZERO` turns heartbeats off).
    pub fn with_heartbeat(mut self, interval: Duration, timeout: Duration) -> Self {
        self.heartbeat_interval = interval;
        self.heartbeat_timeout = timeout;
        self
    }
}
