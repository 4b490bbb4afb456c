//! A communicator's options and the types they name: [`Device`],
//! [`Rendezvous`] and [`CommOptions`]. Every layer may read them (the
//! bootstrap, the backends); they depend on nothing but the transport's
//! `Store` trait and the [`Checks`] mode.
//!
//! Defaults that the environment can change are read by
//! `CommOptions::default()`: `CHORUS_TIMEOUT_SECONDS` (the op timeout),
//! `CHORUS_FLIGHT_RECORDER_SIZE`, `CHORUS_FLIGHT_RECORDER_DIR` and
//! `CHORUS_CHECKS` (the consistency checks, [`crate::checks`]). A
//! malformed value there leaves the built-in default in place, and
//! [`new_comm`](crate::new_comm) then refuses to start with
//! [`Error::Config`] naming the variable, so a typo is never silently
//! ignored.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use crate::checks::{parse_checks, Checks, CHECKS_ENV};
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

/// The environment variable that sets the default op timeout, in seconds
/// (TorchComms: `TORCHCOMM_TIMEOUT_SECONDS`).
pub const TIMEOUT_ENV: &str = "CHORUS_TIMEOUT_SECONDS";
/// The environment variable that sets the flight recorder's size (0: off).
pub const FLIGHT_RECORDER_SIZE_ENV: &str = "CHORUS_FLIGHT_RECORDER_SIZE";
/// The environment variable naming the directory of flight-recorder dumps.
pub const FLIGHT_RECORDER_DIR_ENV: &str = "CHORUS_FLIGHT_RECORDER_DIR";

/// The built-in op timeout, when `CHORUS_TIMEOUT_SECONDS` is not set.
const DEFAULT_TIMEOUT: Duration = Duration::from_secs(600);

/// Parse a `CHORUS_TIMEOUT_SECONDS` value: a positive number of seconds,
/// fractions allowed (`"30"`, `"2.5"`).
///
/// # Errors
/// [`Error::Config`] for anything else.
pub fn parse_timeout_seconds(v: &str) -> Result<Duration> {
    v.trim()
        .parse::<f64>()
        .ok()
        .filter(|s| *s > 0.0)
        .and_then(|s| Duration::try_from_secs_f64(s).ok())
        .ok_or_else(|| {
            Error::Config(format!(
                "{TIMEOUT_ENV}={v:?} is not a positive number of seconds"
            ))
        })
}

/// Parse a `CHORUS_FLIGHT_RECORDER_SIZE` value: a number of entries, 0 to
/// turn the recorder off.
///
/// # Errors
/// [`Error::Config`] for anything else.
pub fn parse_flight_recorder_size(v: &str) -> Result<usize> {
    v.trim().parse::<usize>().map_err(|_| {
        Error::Config(format!(
            "{FLIGHT_RECORDER_SIZE_ENV}={v:?} is not a number of entries"
        ))
    })
}

/// The environment's value of `key`, parsed; `None` when unset.
fn env_parsed<T>(key: &str, parse: fn(&str) -> Result<T>) -> Option<Result<T>> {
    std::env::var(key).ok().map(|v| parse(&v))
}

/// Check the environment defaults `CommOptions::default()` read.
///
/// # Errors
/// [`Error::Config`] naming the first malformed variable.
pub(crate) fn check_env() -> Result<()> {
    if let Some(Err(e)) = env_parsed(TIMEOUT_ENV, parse_timeout_seconds) {
        return Err(e);
    }
    if let Some(Err(e)) = env_parsed(FLIGHT_RECORDER_SIZE_ENV, parse_flight_recorder_size) {
        return Err(e);
    }
    if let Some(Err(e)) = env_parsed(CHECKS_ENV, parse_checks) {
        return Err(e);
    }
    Ok(())
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
    /// Default timeout of every op: `CHORUS_TIMEOUT_SECONDS` if set, else
    /// 10 minutes. Change it later with
    /// [`Comm::set_timeout`](crate::Comm::set_timeout), or per handle with
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
    /// Hints for every op of the communicator (see [`crate::hints`]):
    /// known keys are checked by `new_comm` ([`Error::InvalidArgument`]
    /// for a malformed value), unknown ones are kept and ignored.
    pub hints: BTreeMap<String, String>,
    /// How many recent ops the flight recorder keeps
    /// ([`Comm::flight_record`](crate::Comm::flight_record)):
    /// `CHORUS_FLIGHT_RECORDER_SIZE` if set, else 2000; 0 turns it off.
    pub flight_recorder_size: usize,
    /// Where the flight recorder is written as JSON when the communicator
    /// is aborted: `CHORUS_FLIGHT_RECORDER_DIR` if set, else nowhere. See
    /// [`crate::flight_recorder`].
    pub flight_recorder_dir: Option<PathBuf>,
    /// How the ranks' ops are checked against each other
    /// ([`crate::checks`]): `CHORUS_CHECKS` if set, else
    /// [`Checks::Fingerprint`]. Every rank must use the same mode.
    pub checks: Checks,
}

impl Default for CommOptions {
    fn default() -> Self {
        CommOptions {
            timeout: env_parsed(TIMEOUT_ENV, parse_timeout_seconds)
                .and_then(Result::ok)
                .unwrap_or(DEFAULT_TIMEOUT),
            connect_timeout: Duration::from_secs(120),
            rendezvous: Rendezvous::Env,
            secret: None,
            rank: None,
            size: None,
            bind_ip: None,
            heartbeat_interval: Duration::from_secs(1),
            heartbeat_timeout: Duration::from_secs(10),
            runtime: None,
            hints: BTreeMap::new(),
            flight_recorder_size: env_parsed(FLIGHT_RECORDER_SIZE_ENV, parse_flight_recorder_size)
                .and_then(Result::ok)
                .unwrap_or(crate::flight_recorder::DEFAULT_FLIGHT_RECORDER_SIZE),
            flight_recorder_dir: std::env::var_os(FLIGHT_RECORDER_DIR_ENV)
                .filter(|d| !d.is_empty())
                .map(PathBuf::from),
            checks: env_parsed(CHECKS_ENV, parse_checks)
                .and_then(Result::ok)
                .unwrap_or_default(),
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

    /// Set one hint for every op of the communicator (see [`crate::hints`]).
    pub fn with_hint(mut self, key: impl Into<String>, value: impl Into<String>) -> Self {
        self.hints.insert(key.into(), value.into());
        self
    }

    /// Set the flight recorder's size (0 turns it off).
    pub fn with_flight_recorder_size(mut self, entries: usize) -> Self {
        self.flight_recorder_size = entries;
        self
    }

    /// Dump the flight recorder into `dir` when the communicator is aborted.
    pub fn with_flight_recorder_dir(mut self, dir: impl Into<PathBuf>) -> Self {
        self.flight_recorder_dir = Some(dir.into());
        self
    }

    /// Set how the ranks' ops are checked against each other
    /// ([`crate::checks`]).
    pub fn with_checks(mut self, checks: Checks) -> Self {
        self.checks = checks;
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeout_seconds_parse_positive_numbers_only() {
        assert_eq!(
            parse_timeout_seconds("30").unwrap(),
            Duration::from_secs(30)
        );
        assert_eq!(
            parse_timeout_seconds(" 2.5 ").unwrap(),
            Duration::from_millis(2500)
        );
        for bad in ["", "0", "-1", "ten", "1e400", "NaN", "inf"] {
            match parse_timeout_seconds(bad) {
                Err(Error::Config(m)) => assert!(m.contains(TIMEOUT_ENV), "{m}"),
                other => panic!("{bad:?}: expected Config, got {other:?}"),
            }
        }
    }

    #[test]
    fn flight_recorder_size_parses_counts_and_zero() {
        assert_eq!(parse_flight_recorder_size("0").unwrap(), 0);
        assert_eq!(parse_flight_recorder_size("64").unwrap(), 64);
        assert!(matches!(
            parse_flight_recorder_size("-3"),
            Err(Error::Config(_))
        ));
    }
}
