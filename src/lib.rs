//! # Chorus
//!
//! An actor-based runtime for distributed collective communication: a
//! Rust-native take on PyTorch's TorchComms.
//!
//! ## A tour
//!
//! Communicators are explicit and named — there is no hidden global group.
//! [`new_comm`] bootstraps one from the environment your launcher set
//! (`chorus-run`, torchrun, mpirun, Slurm) or from explicit
//! [`CommOptions`]:
//!
//! ```
//! use chorus::{new_comm, CommOptions, Device, ReduceOp, Tensor};
//!
//! // Under `chorus-run -n 4`, CommOptions::default() picks up rank and size
//! // from the environment; here, a world of one rank.
//! let comm = new_comm("cpu", Device::Cpu, "world", CommOptions::single())?;
//! let t = Tensor::full(comm.rank() as f32 + 1.0, 1024);
//! let sum = comm.all_reduce(t, ReduceOp::Sum)?;
//! assert_eq!(sum.as_slice::<f32>()[0], 1.0);
//!
//! // Every op also has an async form returning a `Work`.
//! let work = comm.all_gather_async(Tensor::from_vec(vec![7i32]));
//! assert!(work.wait()?.to_vec::<i32>() == vec![7]);
//! comm.finalize()?;
//! # Ok::<(), chorus::Error>(())
//! ```
//!
//! Each communicator is a [ractor](https://docs.rs/ractor) actor owning
//! its backend; the [`Comm`] handle sends it
//! requests and gets exactly one completion per request. Ranks find each
//! other through a rendezvous store served over QUIC with TLS and a job
//! secret ([`transport`]); data moves over the backend's own links
//! ([`backends`]).
//!
//! ## Backends
//!
//! | name | feature | needs | collectives |
//! |------|---------|-------|-------------|
//! | `cpu` | built in (default) | nothing | all |
//! | `nccl` | `nccl` | libnccl + libcudart at run time, a CUDA GPU | all but bitwise ops, on host or device tensors |
//! | `rccl` | `rccl` | librccl + libamdhip64 at run time, a ROCm GPU | all but bitwise ops, on host or device tensors |
//! | `gloo` | `gloo` | `libgloo-dev` (Debian) | all |
//! | `mpi` | `mpi` | Open MPI, launched by `mpirun` | all |
//!
//! On `nccl` and `rccl`, ops also take device tensors ([`Tensor::is_device`]:
//! [`Comm::device_zeros`], [`Comm::to_device`], or adopted with
//! [`Tensor::from_device_ptr`]) and run on them in place, and
//! [`Comm::with_stream`] / [`Work::wait_stream`] order ops with the caller's
//! device stream (see `docs/backends.md`).
//!
//! Switching backends is a string: `new_comm("cpu", ..)`, and a program can
//! add its own data plane under a name with [`register_backend`] (implementing
//! [`Backend`]). An unknown name is
//! [`Error::UnknownBackend`]; a known backend whose cargo feature is off, or
//! whose library or device is missing at run time, is
//! [`Error::BackendUnavailable`] saying what to enable or install.
//!
//! ## Semantics
//!
//! Ordering, completion and failure rules are in `docs/runtime-semantics.md`:
//! all ranks issue collectives in the same order; a disagreement between
//! ranks (op, dtype, count, root, split sizes) is [`Error::Mismatch`] on every
//! rank; a dead peer or an expired timeout completes every outstanding op with
//! a typed error and aborts the communicator, never the process.
//!
//! ## Subgroups and fault tolerance
//!
//! [`Comm::split`] / [`Comm::split_by_color`] create child communicators
//! (actors linked under the parent's; finalized or aborted before it), and
//! [`Comm::hierarchy`] builds intra-host × inter-host groups; a [`DeviceMesh`]
//! lays the ranks out on a named N-D grid with one child per dimension. A watchdog
//! heartbeats through the store ([`CommOptions::heartbeat_interval`]); a dead,
//! hung or partitioned rank completes every outstanding op with
//! [`Error::PeerFailed`] stamped with the epoch, and [`Comm::reconfigure`]
//! forms the next epoch from the survivors (and ranks that [`join_comm`]ed),
//! under a majority rule ([`Error::NoQuorum`]).
//!
//! ## One-sided windows
//!
//! [`Comm::new_window`] gives every rank a byte buffer its peers write into
//! with [`Window::put`], without the owner posting a receive, and per-pair
//! signal counters ([`Window::signal`], [`Window::wait_signal`]) that are
//! counted only after the puts before them landed. The `cpu` backend maps
//! same-host peers' windows (shared memory) and reaches other hosts over
//! TCP; `nccl` (with NCCL 2.29 or later) registers them with NCCL and moves
//! the bytes with its one-sided puts and signals; other backends refuse
//! windows with [`Error::UnsupportedOp`] (`docs/windows.md`).
//!
//! ## Observing ops
//!
//! [`Comm::register_pre_hook`], [`Comm::register_post_hook`] and
//! [`Comm::register_abort_hook`] call your functions when an op is issued,
//! when it completes, and when the communicator is aborted ([`hooks`]);
//! [`Comm::flight_record`] returns the last ops with their states, dumped
//! as JSON on an abort when `CHORUS_FLIGHT_RECORDER_DIR` is set
//! ([`flight_recorder`]); [`Comm::with_hints`] attaches [`hints`] to ops.
#![deny(missing_docs)]

use std::sync::Arc;

use ractor::Actor;

pub(crate) mod actors;
pub mod backends;
pub mod bootstrap;
pub mod checks;
mod comm;
pub mod debug;
mod elastic;
pub mod error;
pub mod flight_recorder;
pub mod hints;
pub mod hooks;
pub mod kernels;
mod limits;
mod mesh;
pub mod op;
mod options;
mod pace;
mod persistent;
mod presence;
mod runtime;
pub mod tensor;
pub mod transport;
mod window;
mod work;

/// Internals that integration tests need and users do not; not part of the
/// API and may change at any time.
#[doc(hidden)]
pub mod test_support {
    /// A watchdog failure notice, as stored for the other ranks (tests
    /// forge one to check that a new epoch rejects an old epoch's notice).
    pub use crate::actors::watchdog::Notice;
}

pub use actors::status::{ChildFailure, State, Status};
pub use backends::{
    register_backend, Backend, BackendInit, Capabilities, LinkPolicy, PeerFailures, SplitMode,
    WindowAccess,
};
pub use checks::Checks;
pub use comm::{Comm, P2POp};
pub use elastic::{
    join_comm, join_comm_async, CommRanks, Health, Hierarchy, RankMap, ReconfigureOptions,
};
pub use error::{Error, Result};
pub use flight_recorder::{FlightEntry, FlightState};
pub use hooks::{AbortHookArgs, PostHookArgs, PreHookArgs, RemovableHandle};
pub use mesh::DeviceMesh;
pub use op::{OpKind, ReduceOp};
pub use options::{
    parse_flight_recorder_size, parse_timeout_seconds, CommOptions, Device, Rendezvous,
};
pub use persistent::PersistentAllGather;
pub use tensor::{Bool, DType, Element, ExternalError, Tensor};
pub use window::{Window, WindowAttr};
pub use work::{DeviceStream, FenceSlot, StreamFence, Work};

/// Create a communicator: connect this rank to the others and start its actor.
///
/// Blocks until every rank of the communicator has connected (or
/// `options.connect_timeout` expired). Collective over all ranks: each must
/// call `new_comm` with the same backend and name. In an async service,
/// await [`new_comm_async`] instead.
///
/// # Errors
/// [`Error::UnknownBackend`] for a backend name this binary does not know
/// and [`Error::BackendUnavailable`] for one not compiled in (before any
/// I/O) or whose library/device is missing; [`Error::Config`] for a bad environment or options;
/// [`Error::Transport`] if the store cannot be reached or refuses our secret;
/// [`Error::PeerFailed`] if a peer never connects; [`Error::WouldBlock`] on
/// a current-thread tokio runtime.
pub fn new_comm(backend: &str, device: Device, name: &str, options: CommOptions) -> Result<Comm> {
    let (backend, name) = (backend.to_string(), name.to_string());
    let rt = runtime::handle_for(&options);
    runtime::block_on("new_comm", &rt, create(backend, device, name, options))?
}

/// Async form of [`new_comm`]; can be awaited from any executor, and never
/// blocks a thread of the caller's runtime.
///
/// # Errors
/// As [`new_comm`].
pub async fn new_comm_async(
    backend: &str,
    device: Device,
    name: &str,
    options: CommOptions,
) -> Result<Comm> {
    backends::check_name(backend)?;
    let (backend, name) = (backend.to_string(), name.to_string());
    let rt = runtime::handle_for(&options);
    runtime::run_on(&rt, create(backend, device, name, options)).await?
}

async fn create(
    backend: String,
    device: Device,
    name: String,
    options: CommOptions,
) -> Result<Comm> {
    let (rank, size) = bootstrap::rank_size(&options)?;
    // Every call takes its instance number first, whether or not it fails
    // on this rank: a call that fails here alone (an unknown backend, a
    // device the backend cannot use, a store it cannot reach) must not
    // leave this rank's count behind its peers', whose next communicator
    // of this name would then wait under other keys than this rank's.
    let instance = bootstrap::next_instance(&name, rank, size);
    backends::check_name(&backend)?;
    limits::raise_fd_limit();
    options::check_env()?;
    hints::Hints::parse(options.hints.clone(), &name, rank)?;
    if let Err(reason) = backends::check_device(&backend, device) {
        return Err(Error::InvalidArgument {
            comm: name,
            rank,
            op: "new_comm",
            reason,
        });
    }
    if name.is_empty() || name.contains('/') {
        return Err(Error::InvalidArgument {
            comm: name,
            rank,
            op: "new_comm",
            reason: "a communicator name must be non-empty and contain no '/'".into(),
        });
    }
    let span = tracing::info_span!("new_comm", comm = %name, rank, size, backend = %backend);
    let _g = span.enter();
    let secret = bootstrap::secret(&options);
    let connected = bootstrap::connect_store(
        options.rendezvous.clone(),
        rank,
        size,
        &secret,
        options.connect_timeout,
    )
    .await?;
    drop(_g);
    // A store this rank hosts is closed with a bounded wait when creation
    // fails, so that its clients hear of it before this process can exit.
    let server = connected.server.clone();
    let res: Result<Comm> = async move {
        let job = if connected.shared {
            let role = if rank == 0 {
                bootstrap::JobRole::Rank0
            } else {
                bootstrap::JobRole::Rank
            };
            bootstrap::agreed_job_id(
                connected.store.as_ref(),
                role,
                size,
                secret.as_deref().unwrap_or_default(),
                options.connect_timeout,
            )
            .await?
        } else {
            bootstrap::job_id(secret.as_deref().unwrap_or_default())?
        };
        let base = format!("chorus/{job}/{name}/{instance}");
        let spec = Spec {
            backend,
            device,
            rank,
            size,
            epoch: 0,
            key_prefix: format!("{base}/epoch/0"),
            ctx: Arc::new(elastic::CommCtx {
                name,
                job,
                base,
                store: connected.store.clone(),
                secret: Arc::from(secret.unwrap_or_default()),
                bind_ip: bootstrap::bind_ip(&options, connected.local_ip)?,
                options,
                server: connected
                    .server
                    .map(|s| s as Arc<dyn std::any::Any + Send + Sync>),
                store_host: connected.store_host,
                lineage: None,
            }),
            parent: None,
        };
        let comm = start(spec).await?;
        if comm.rank() == 0 && comm.size() > 1 {
            elastic::publish_latest(&comm).await;
        }
        Ok(comm)
    }
    .await;
    if res.is_err() {
        if let Some(s) = server {
            bootstrap::close_hosted_store(s).await;
        }
    }
    res
}

/// Everything needed to start one communicator on one rank whose store is
/// already connected.
pub(crate) struct Spec {
    pub(crate) backend: String,
    pub(crate) device: Device,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) epoch: u64,
    pub(crate) key_prefix: String,
    pub(crate) ctx: Arc<elastic::CommCtx>,
    /// The parent, for a split: the child's actor is linked under the
    /// parent's, its abort signal derives from the parent's, and its
    /// handles keep the parent alive.
    pub(crate) parent: Option<Arc<comm::Shared>>,
}

/// Connect the backend and start the communicator's actor.
pub(crate) async fn start(spec: Spec) -> Result<Comm> {
    let backend_impl = backends::create_on(&spec.backend, spec.device, spec.backend_init()).await?;
    start_with_backend(spec, backend_impl).await
}

impl Spec {
    /// How this communicator's backend connects.
    pub(crate) fn backend_init(&self) -> backends::BackendInit {
        let ctx = &self.ctx;
        backends::BackendInit {
            comm: ctx.name.clone(),
            key_prefix: self.key_prefix.clone(),
            rank: self.rank,
            size: self.size,
            epoch: self.epoch,
            store: ctx.store.clone(),
            secret: ctx.secret.clone(),
            connect_timeout: ctx.options.connect_timeout,
            bind_ip: ctx.bind_ip,
            links: backends::LinkPolicy::Auto,
            host_id: None,
            peers_failed: backends::PeerFailures::none(),
        }
    }
}

/// Held from choosing an actor's name to registering it (spawn), so that
/// two communicators of one process never pick the same free name.
static NAMING: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A free actor name for `info`: `<name>/<epoch>/<rank>`, with `#k`
/// appended while another communicator of this process holds it (say, one
/// with the same name still shutting down, or the same rank of another
/// job in this process). Call it holding [`NAMING`].
fn actor_name(info: &actors::CommInfo) -> String {
    let base = info.actor_name();
    let mut name = base.clone();
    let mut k = 1;
    while ractor::registry::where_is(name.clone()).is_some() {
        name = format!("{base}#{k}");
        k += 1;
    }
    name
}

/// This communicator's rank whose process hosts the store, if one does.
/// Known for epoch 0 (a top-level communicator, or a split child through
/// its lineage); later epochs renumber ranks and report `None`.
fn store_host_rank(ctx: &elastic::CommCtx, epoch: u64) -> Option<usize> {
    let host = ctx.store_host?;
    match (&ctx.lineage, epoch) {
        (_, e) if e > 0 => None,
        (None, _) => Some(host),
        (Some(l), _) => l.in_world.iter().position(|&w| w == host),
    }
}

/// Start the communicator's actor over an already connected backend. Runs
/// on the communicator's runtime.
pub(crate) async fn start_with_backend(
    spec: Spec,
    backend_impl: Box<dyn backends::Backend>,
) -> Result<Comm> {
    let Spec {
        backend,
        device,
        rank,
        size,
        epoch,
        key_prefix,
        ctx,
        parent,
    } = spec;
    let name = ctx.name.clone();
    let options = &ctx.options;
    let backend_name = backend_impl.name();
    let caps = backend_impl.capabilities();
    let windows = backend_impl.supports_windows();
    let device_mem = backend_impl.device_memory();
    let backend_version = backend_impl.version();
    let tcp_fallbacks = backend_impl.tcp_fallbacks();
    let hints = Arc::new(hints::Hints::parse(options.hints.clone(), &name, rank)?);
    let observer = Arc::new(hooks::Observer::new(
        &name,
        rank,
        size,
        epoch,
        backend_name,
        options.flight_recorder_size,
        options.flight_recorder_dir.clone(),
    ));
    let info = actors::CommInfo {
        name: name.clone(),
        rank,
        size,
        epoch,
        checks: options.checks,
    };
    let (status_writer, status) = actors::status::status();
    let signal = match &parent {
        Some(p) => actors::status::AbortSignal::child_of(&p.home.signal, &p.name),
        None => actors::status::AbortSignal::new(),
    };
    let home = Arc::new(actors::Home::new(
        info.clone(),
        signal,
        status,
        runtime::handle_for(options),
        runtime::is_own(options),
        observer,
    ));
    let args = actors::CommArgs {
        backend: backend_impl,
        home: home.clone(),
        status: status_writer,
        watchdog: Some(actors::watchdog::WatchdogConfig {
            prefix: key_prefix.clone(),
            rank,
            size,
            epoch,
            interval: options.heartbeat_interval,
            timeout: options.heartbeat_timeout,
            store: ctx.store.clone(),
            health: Default::default(),
            store_host: store_host_rank(&ctx, epoch),
            ops: (options.checks == checks::Checks::Fingerprint)
                .then(|| Arc::new(actors::stall::OpLog::default())),
        }),
        keys: Some(actors::executor::KeyRelease {
            store: ctx.store.clone(),
            prefix: key_prefix.clone(),
            size,
            latest: (
                elastic::latest_key(&ctx.job, &ctx.name),
                elastic::latest_value(&ctx.base, epoch),
            ),
        }),
    };
    let naming = NAMING.lock().await;
    let actor_name = actor_name(&info);
    let spawned = match &parent {
        Some(p) => {
            Actor::spawn_linked(
                Some(actor_name),
                actors::CommActor,
                args,
                p.actor.get_cell(),
            )
            .await
        }
        None => Actor::spawn(Some(actor_name), actors::CommActor, args).await,
    };
    drop(naming);
    let (actor, _join) = spawned
        .map_err(|e| Error::Internal(format!("cannot start the communicator actor: {e}")))?;
    tracing::info!(comm = %name, rank, size, epoch, "communicator ready");
    let shared = Arc::new(comm::Shared {
        name,
        rank,
        size,
        epoch,
        device,
        backend: backend_name,
        caps,
        windows,
        device_mem,
        backend_version,
        tcp_fallbacks,
        default_timeout: comm::AtomicDuration::new(options.timeout),
        hints,
        actor,
        home,
        _server: ctx.server.clone(),
        ctx,
        key_prefix,
        unstarted: std::sync::Mutex::new(None),
        backend_requested: backend,
        splits: std::sync::atomic::AtomicU64::new(0),
        _parent: parent,
    });
    Ok(Comm::from_shared(shared))
}

/// `span`, or [`tracing::Span::none`] when no subscriber wants it. A
/// disabled span still does work on every enter and exit of an
/// instrumented future (tracing's `log` compatibility, which quinn's `log`
/// feature turns on, checks the `log` crate each time); `Span::none` does
/// none, which matters on the per-op path.
pub(crate) fn active_span(span: tracing::Span) -> tracing::Span {
    if span.is_disabled() {
        tracing::Span::none()
    } else {
        span
    }
}

/// A span for the per-op path: `tracing::span!($level, ...)` through
/// [`active_span`], built only when some subscriber enables `$level`
/// ([`tracing::level_filters::LevelFilter::current`], one relaxed load);
/// otherwise [`tracing::Span::none`]. Building even a disabled span costs
/// a few hundred instructions per op (its fields, and tracing's `log`
/// compatibility on creation and drop), about a tenth of a small blocking
/// op's software. Without a subscriber these spans are therefore not
/// forwarded to a `log` logger either.
macro_rules! hot_span {
    ($level:ident, $($span:tt)+) => {
        if tracing::Level::$level <= tracing::level_filters::LevelFilter::current() {
            $crate::active_span(tracing::span!(tracing::Level::$level, $($span)+))
        } else {
            tracing::Span::none()
        }
    };
}
pub(crate) use hot_span;
