//! [`Comm`]: the user's handle on a communicator.
//!
//! A `Comm` is a cheap, cloneable handle over the communicator's actor
//! ([`crate::actors`]). Each collective comes in a blocking form
//! (`all_reduce`) and an async form (`all_reduce_async`) returning a
//! [`Work`]. Arguments that can never work are rejected here, before any
//! message is sent, with [`Error::InvalidArgument`] or
//! [`Error::UnsupportedOp`]; disagreements *between* ranks are found by the
//! executor's header exchange and reported as [`Error::Mismatch`] on every
//! rank.
//!
//! Buffers move into the op and come back in its completion: no buffer is
//! shared between the caller and an op in flight.
//!
//! On a backend that takes device memory (`nccl`, `rccl`), every op also
//! accepts device tensors ([`Tensor::is_device`]) of the communicator's
//! device, used in place with no host staging; outputs an op allocates
//! are then allocated on that device. [`Comm::device_zeros`],
//! [`Comm::to_device`] and [`Comm::to_host`] allocate and copy. Device
//! tensors on a backend without device memory, on another device, or mixed
//! with host tensors in one op are refused with [`Error::InvalidArgument`]
//! before anything is sent (CM-4).
//!
//! A handle also carries what its ops are issued with: a timeout of its own
//! ([`Comm::with_timeout`], else the communicator's, [`Comm::set_timeout`])
//! and hints ([`Comm::with_hints`]). When an op is issued, the handle hands
//! it to the communicator's observer (hooks, flight recorder:
//! [`crate::hooks`]), which follows it through its `Work`'s completion.
//!
//! # Invariants
//! - CM-1: every method returns a `Work` that completes exactly once, even when
//!   the communicator is finalized or aborted.
//! - CM-2: all ranks must issue collectives in the same order; point-to-point
//!   ops must be issued in the same relative order by both ends.
//! - CM-3: an op rejected by its argument checks is no op: it gets no op id,
//!   no hook call and no flight-recorder entry; every other op gets all three.
//! - CM-4: the buffers of one op are all host memory, or all device memory
//!   of the communicator's device on a backend that has device memory
//!   ([`Backend::device_memory`](crate::backends::Backend::device_memory));
//!   anything else is `InvalidArgument` before any I/O, and the host never
//!   reads or writes a device tensor (no host-side `PremulSum` scaling,
//!   `Avg` division, split or concatenation on device memory).

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

use ractor::ActorRef;

use crate::actors::status::{State, Status};
use crate::actors::{CommMsg, Home, Queued, Request};
use crate::backends::{DeviceMemory, OpData, P2PTransfer};
use crate::error::{Error, Result};
use crate::flight_recorder::{FlightEntry, OpDesc, Peers};
use crate::hints::Hints;
use crate::hooks::{AbortHookArgs, PostHookArgs, PreHookArgs, RemovableHandle};
use crate::op::{OpKind, ReduceOp};
use crate::options::{CommOptions, Device};
use crate::tensor::{DType, Tensor};
use crate::work::{to_lists, to_pair, to_tensor, to_tensors, to_unit, Completion, Work};

/// One operation of a batched point-to-point call ([`Comm::batch_p2p`]).
#[derive(Debug)]
pub enum P2POp {
    /// Send this tensor to `peer`.
    Send {
        /// The data.
        tensor: Tensor,
        /// Destination rank.
        peer: usize,
    },
    /// Receive into this tensor (its length and dtype say what is expected) from `peer`.
    Recv {
        /// The destination buffer.
        tensor: Tensor,
        /// Source rank.
        peer: usize,
    },
}

impl P2POp {
    /// A send of `tensor` to `peer`.
    pub fn send(tensor: Tensor, peer: usize) -> P2POp {
        P2POp::Send { tensor, peer }
    }
    /// A receive into `tensor` from `peer`.
    pub fn recv(tensor: Tensor, peer: usize) -> P2POp {
        P2POp::Recv { tensor, peer }
    }
}

thread_local! {
    /// Set by [`Comm::blocking`] around the call that builds and submits a
    /// blocking op: `submit` takes it, so only that one op may run as a
    /// turn on this thread.
    static INLINE: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

pub(crate) struct Shared {
    pub(crate) name: String,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) epoch: u64,
    pub(crate) device: Device,
    pub(crate) backend: &'static str,
    /// What the backend can do beyond the ops, asked when it started.
    pub(crate) caps: crate::backends::Capabilities,
    /// Whether the backend implements one-sided windows, asked when it started.
    pub(crate) windows: bool,
    /// The backend's device memory, if it takes device tensors (CM-4).
    pub(crate) device_mem: Option<Arc<dyn DeviceMemory>>,
    /// The backend's version, asked when it started.
    pub(crate) backend_version: String,
    /// Same-host peers reached over TCP, as the backend's links open.
    pub(crate) tcp_fallbacks: crate::backends::TcpFallbacks,
    /// The op timeout of handles without their own ([`Comm::set_timeout`]).
    pub(crate) default_timeout: AtomicDuration,
    /// The communicator's hints, from its options.
    pub(crate) hints: Arc<Hints>,
    pub(crate) actor: ActorRef<CommMsg>,
    /// The actor's home: its offer of the core to blocked callers, its abort
    /// signal and status, its runtime.
    pub(crate) home: Arc<Home>,
    pub(crate) _server: Option<Arc<dyn std::any::Any + Send + Sync>>,
    /// What split and reconfigure need to build related communicators.
    pub(crate) ctx: Arc<crate::elastic::CommCtx>,
    /// Store key prefix of this communicator instance and epoch.
    pub(crate) key_prefix: String,
    /// The backend name as the user asked for it (children and new epochs use it).
    pub(crate) backend_requested: String,
    /// Splits issued on this handle's communicator (part of child key prefixes).
    pub(crate) splits: std::sync::atomic::AtomicU64,
    /// A split's parent, kept alive (not finalized by its handles' drop)
    /// while this child lives.
    pub(crate) _parent: Option<Arc<Shared>>,
    /// The epoch a `reconfigure` of this communicator formed but could not
    /// start (a member died while it connected): the next `reconfigure`
    /// goes on from it (EL-7).
    pub(crate) unstarted: std::sync::Mutex<Option<crate::elastic::Unstarted>>,
}

/// A `Duration` that can be changed in place (nanoseconds, saturating).
pub(crate) struct AtomicDuration(AtomicU64);

impl AtomicDuration {
    pub(crate) fn new(d: Duration) -> AtomicDuration {
        AtomicDuration(AtomicU64::new(nanos(d)))
    }
    fn get(&self) -> Duration {
        Duration::from_nanos(self.0.load(Ordering::Relaxed))
    }
    fn set(&self, d: Duration) {
        self.0.store(nanos(d), Ordering::Relaxed)
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl Drop for Shared {
    fn drop(&mut self) {
        // RAII: the last handle finalizes (flushes queued ops, closes links).
        if self.home.status.state() == State::Active {
            self.home.enqueue(Queued::Finalize(None));
        }
    }
}

/// A communicator: a named group of ranks that run collectives together.
///
/// Cloning is cheap; all clones drive the same communicator. When the last
/// clone is dropped the communicator is finalized.
///
/// Every collective has a blocking form and an `_async` form returning a
/// [`Work`]; the blocking form behaves exactly as `..._async(..).wait()`.
/// (When nothing is queued, a blocking op runs as a turn of the
/// communicator's actor on the calling thread instead of waking the actor,
/// which makes small ops several times faster; ordering, timeouts, aborts
/// and errors are the same. Inside a multi-thread tokio runtime the wait
/// runs in `block_in_place`; on a current-thread runtime blocking forms
/// return [`Error::WouldBlock`]: await the `_async` form there.)
///
/// A child communicator (from [`Comm::split`]) keeps its parent alive:
/// dropping every handle of the parent finalizes it only once its children
/// are dropped too. An explicit [`Comm::finalize`] or [`Comm::abort`] of the
/// parent ends its children first.
#[derive(Clone)]
pub struct Comm {
    pub(crate) shared: Arc<Shared>,
    /// This handle's own op timeout ([`Comm::with_timeout`]); `None`: the
    /// communicator's ([`Comm::set_timeout`]).
    pub(crate) timeout: Option<Duration>,
    /// This handle's hints: the communicator's, overlaid by `with_hints`.
    pub(crate) hints: Arc<Hints>,
    /// The caller's stream this handle's ops are ordered with
    /// ([`Comm::with_stream`]).
    pub(crate) stream: Option<crate::DeviceStream>,
}

impl std::fmt::Debug for Comm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Comm")
            .field("name", &self.shared.name)
            .field("rank", &self.shared.rank)
            .field("size", &self.shared.size)
            .field("backend", &self.shared.backend)
            .field("device", &self.shared.device)
            .field("epoch", &self.shared.epoch)
            .finish()
    }
}

impl Comm {
    pub(crate) fn from_shared(shared: Arc<Shared>) -> Comm {
        Comm {
            hints: shared.hints.clone(),
            shared,
            timeout: None,
            stream: None,
        }
    }

    /// This rank, in `0..size()`.
    pub fn rank(&self) -> usize {
        self.shared.rank
    }
    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.shared.size
    }
    /// The communicator's name.
    pub fn name(&self) -> &str {
        &self.shared.name
    }
    /// The device its buffers live on.
    pub fn device(&self) -> Device {
        self.shared.device
    }
    /// What its backend can do beyond the ops: how a split's child is
    /// formed, and whether `reconfigure` can change the world.
    pub fn capabilities(&self) -> crate::backends::Capabilities {
        self.shared.caps
    }
    /// The backend's name.
    pub fn backend(&self) -> &'static str {
        self.shared.backend
    }
    /// The communicator's epoch (0 for a new communicator).
    pub fn epoch(&self) -> u64 {
        self.shared.epoch
    }
    /// The timeout of ops issued through this handle: its own
    /// ([`Comm::with_timeout`]), else the communicator's
    /// ([`Comm::set_timeout`], [`CommOptions::timeout`]).
    pub fn timeout(&self) -> Duration {
        self.timeout
            .unwrap_or_else(|| self.shared.default_timeout.get())
    }

    /// A handle on the same communicator whose ops use `timeout`, whatever
    /// [`Comm::set_timeout`] later sets.
    pub fn with_timeout(&self, timeout: Duration) -> Comm {
        Comm {
            timeout: Some(timeout),
            ..self.clone()
        }
    }

    /// A handle on the same communicator whose ops are ordered with the
    /// caller's device stream `stream`, as TorchComms' async ops on the
    /// current stream: each op waits, on the device and without blocking
    /// the host, for the work queued on `stream` before it was issued (an
    /// event recorded there, and `cudaStreamWaitEvent` on the
    /// communicator's own stream, which its actor owns). Use
    /// [`Work::wait_stream`] to make `stream` wait for the op in turn;
    /// [`Work::wait`] and `.await` still mean "finished on the device".
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the backend has no device memory
    /// (streams exist on `nccl` and `rccl` only).
    pub fn with_stream(&self, stream: crate::DeviceStream) -> Result<Comm> {
        self.device_mem("with_stream")?;
        Ok(Comm {
            stream: Some(stream),
            ..self.clone()
        })
    }

    /// The stream this handle's ops are ordered with, if any
    /// ([`Comm::with_stream`]).
    pub fn stream(&self) -> Option<crate::DeviceStream> {
        self.stream
    }

    /// Set the communicator's op timeout in place: ops issued from now on,
    /// through every handle without a [`Comm::with_timeout`] of its own,
    /// use `timeout` (TorchComms' `set_timeout`). Ops already issued keep
    /// the timeout they were issued with.
    pub fn set_timeout(&self, timeout: Duration) {
        self.shared.default_timeout.set(timeout);
    }

    /// The backend's version: the vendor library's (e.g. `nccl 2.21.5`)
    /// where there is one, else the backend's name and Chorus's version.
    pub fn backend_version(&self) -> &str {
        &self.shared.backend_version
    }

    /// The options the communicator was created with, with its current
    /// timeout (as [`Comm::set_timeout`] left it) and this handle's hints.
    pub fn options(&self) -> CommOptions {
        let mut o = self.shared.ctx.options.clone();
        o.timeout = self.shared.default_timeout.get();
        o.hints = (*self.hints.map).clone();
        o
    }

    // ---------------------------------------------------------------- hints

    /// A handle on the same communicator whose ops carry `hints`, over
    /// this handle's (later keys win; see [`crate::hints`]). Known keys
    /// are checked now; unknown ones are kept and ignored.
    ///
    /// ```
    /// # use chorus::{hints, new_comm, CommOptions, Device};
    /// let comm = new_comm("cpu", Device::Cpu, "doc-hints", CommOptions::single())?;
    /// let tagged = comm.with_hints([(hints::TAG.to_string(), "warmup".to_string())].into())?;
    /// assert_eq!(tagged.get_hint::<String>(hints::TAG)?.as_deref(), Some("warmup"));
    /// assert_eq!(comm.get_hint::<String>(hints::TAG)?, None);
    /// # Ok::<(), chorus::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a malformed value of a known hint.
    pub fn with_hints(&self, hints: BTreeMap<String, String>) -> Result<Comm> {
        let hints = self.hints.overlay(hints, self.name(), self.rank())?;
        Ok(Comm {
            hints: Arc::new(hints),
            ..self.clone()
        })
    }

    /// Every hint of this handle (the communicator's and its `with_hints`).
    pub fn hints(&self) -> &BTreeMap<String, String> {
        &self.hints.map
    }

    /// Hint `key` of this handle, parsed as a `T`; `None` if it is not set.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the value does not parse as a `T`.
    pub fn get_hint<T: std::str::FromStr>(&self, key: &str) -> Result<Option<T>> {
        self.hints.get(key, self.name(), self.rank())
    }

    // ---------------------------------------------------------------- hooks

    /// Call `hook` with every op issued on this communicator from now on,
    /// when it is issued ([`crate::hooks`]: on the hook thread, in order,
    /// never blocking the communicator). Dropping the handle unregisters it.
    pub fn register_pre_hook(
        &self,
        hook: impl Fn(&PreHookArgs) + Send + Sync + 'static,
    ) -> RemovableHandle {
        self.shared.home.obs.hooks.add_pre(Arc::new(hook))
    }

    /// Call `hook` with every op of this communicator when it completes:
    /// the op id its pre hook saw, its duration and its result.
    pub fn register_post_hook(
        &self,
        hook: impl Fn(&PostHookArgs) + Send + Sync + 'static,
    ) -> RemovableHandle {
        self.shared.home.obs.hooks.add_post(Arc::new(hook))
    }

    /// Call `hook` once, with the cause, when this communicator is aborted
    /// (by a failure or by [`Comm::abort`]), before its outstanding ops are
    /// failed (waiting for it at most [`crate::hooks::ABORT_HOOK_DEADLINE`]).
    pub fn register_abort_hook(
        &self,
        hook: impl Fn(&AbortHookArgs) + Send + Sync + 'static,
    ) -> RemovableHandle {
        self.shared.home.obs.hooks.add_abort(Arc::new(hook))
    }

    /// The flight recorder: the last
    /// [`CommOptions::flight_recorder_size`] ops of this communicator,
    /// oldest first ([`crate::flight_recorder`]). Empty when it is off.
    pub fn flight_record(&self) -> Vec<FlightEntry> {
        match &self.shared.home.obs.recorder {
            Some(r) => r.snapshot().0,
            None => Vec::new(),
        }
    }

    fn invalid(&self, op: &'static str, reason: impl Into<String>) -> Error {
        Error::InvalidArgument {
            comm: self.shared.name.clone(),
            rank: self.shared.rank,
            op,
            reason: reason.into(),
        }
    }

    fn check_root(&self, op: &'static str, root: usize) -> Result<()> {
        if root >= self.size() {
            return Err(self.invalid(
                op,
                format!("root {root} is out of range for {} ranks", self.size()),
            ));
        }
        Ok(())
    }

    fn check_peer(&self, op: &'static str, peer: usize) -> Result<()> {
        if peer >= self.size() {
            return Err(self.invalid(
                op,
                format!("peer {peer} is out of range for {} ranks", self.size()),
            ));
        }
        if peer == self.rank() {
            return Err(self.invalid(op, "a rank cannot send to or receive from itself"));
        }
        Ok(())
    }

    fn check_redop(&self, op: ReduceOp, dtype: DType) -> Result<()> {
        if op.supports(dtype) {
            Ok(())
        } else {
            Err(Error::UnsupportedOp {
                op: op.to_string(),
                dtype,
            })
        }
    }

    fn check_counts(&self, op: &'static str, counts: &[usize], total: usize) -> Result<()> {
        if counts.len() != self.size() {
            return Err(self.invalid(
                op,
                format!(
                    "{} split sizes given for {} ranks",
                    counts.len(),
                    self.size()
                ),
            ));
        }
        let sum = self.checked_total(op, counts)?;
        if sum != total {
            return Err(self.invalid(
                op,
                format!(
                    "split sizes {counts:?} add up to {sum}, but the tensor has {total} elements"
                ),
            ));
        }
        Ok(())
    }

    /// The sum of user-given sizes, or `InvalidArgument` if it overflows.
    fn checked_total(&self, op: &'static str, counts: &[usize]) -> Result<usize> {
        crate::tensor::checked_sum(counts)
            .ok_or_else(|| self.invalid(op, format!("split sizes {counts:?} overflow usize")))
    }

    /// An output buffer sized from user input, or `InvalidArgument` if it
    /// cannot exist.
    fn output(&self, op: &'static str, dtype: DType, len: usize) -> Result<Tensor> {
        Tensor::try_zeros(dtype, len).ok_or_else(|| {
            self.invalid(
                op,
                format!("an output of {len} x {dtype} does not fit in memory"),
            )
        })
    }

    /// CM-4: where the buffers of `op` live: `Ok(None)` for host memory,
    /// the backend's device memory for device tensors of this
    /// communicator's device; `InvalidArgument` for anything else.
    fn placement(
        &self,
        op: &'static str,
        tensors: &[&Tensor],
    ) -> Result<Option<&Arc<dyn DeviceMemory>>> {
        let Some(first) = tensors.iter().find(|t| t.is_device()) else {
            return Ok(None);
        };
        let Some(mem) = &self.shared.device_mem else {
            return Err(self.invalid(
                op,
                format!(
                    "a tensor on {} was given, but backend {} works on host memory only; \
                     copy it to the host first",
                    first.device(),
                    self.backend()
                ),
            ));
        };
        let want = mem.device();
        if let Some(t) = tensors.iter().find(|t| t.device() != want) {
            let reason = if t.is_device() {
                format!(
                    "a tensor on {} was given to a communicator on {want}",
                    t.device()
                )
            } else {
                format!(
                    "host and device ({want}) tensors are mixed in one op; pass all of them \
                     on the device (Comm::to_device) or all on the host"
                )
            };
            return Err(self.invalid(op, reason));
        }
        Ok(Some(mem))
    }

    /// The reduce op a backend gets: the combining op for host buffers
    /// (the generic layer pre/post-scales), the user's own for device
    /// buffers (CM-4: the backend applies `Avg`/`PremulSum` on the device).
    fn wire_op(op: ReduceOp, dtype: DType, dev: Option<&Arc<dyn DeviceMemory>>) -> ReduceOp {
        match (dev, op) {
            (Some(_), ReduceOp::Avg | ReduceOp::PremulSum(_)) => op,
            _ => op.combine_op_on(dtype),
        }
    }

    /// An output buffer of `len` x `dtype`, on the device when `dev` is set.
    fn output_on(
        &self,
        op: &'static str,
        dtype: DType,
        len: usize,
        dev: Option<&Arc<dyn DeviceMemory>>,
    ) -> Result<Tensor> {
        match dev {
            None => self.output(op, dtype, len),
            Some(mem) => mem.zeros(dtype, len).map_err(|e| {
                self.invalid(
                    op,
                    format!(
                        "cannot allocate an output of {len} x {dtype} on {}: {e}",
                        mem.device()
                    ),
                )
            }),
        }
    }

    /// The backend's device memory, or `InvalidArgument` naming `op`.
    fn device_mem(&self, op: &'static str) -> Result<&Arc<dyn DeviceMemory>> {
        self.shared.device_mem.as_ref().ok_or_else(|| {
            self.invalid(
                op,
                format!(
                    "backend {} on {} has no device memory (device tensors need nccl or rccl)",
                    self.backend(),
                    self.device()
                ),
            )
        })
    }

    // ---------------------------------------------------------------- device memory

    /// A tensor of `len` zeroed elements of `dtype` in this communicator's
    /// device memory (CM-4). Freed through the device's runtime when the
    /// last tensor or op holding it is dropped.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the backend has no device memory
    /// (every backend but `nccl` and `rccl`) or the allocation fails.
    pub fn device_zeros(&self, dtype: DType, len: usize) -> Result<Tensor> {
        let mem = self.device_mem("device_zeros")?;
        self.output_on("device_zeros", dtype, len, Some(mem))
    }

    /// A copy of the host tensor `host` in this communicator's device
    /// memory. Synchronous: the data is on the device when it returns.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the backend has no device memory,
    /// `host` is a device tensor, or the allocation or copy fails.
    pub fn to_device(&self, host: &Tensor) -> Result<Tensor> {
        let op = "to_device";
        let mem = self.device_mem(op)?;
        if host.is_device() {
            return Err(self.invalid(op, format!("the tensor is already on {}", host.device())));
        }
        let mut out = self.output_on(op, host.dtype(), host.len(), Some(mem))?;
        mem.copy(host, 0, &mut out, 0, host.len_bytes())
            .map_err(|e| self.invalid(op, e))?;
        Ok(out)
    }

    /// A host copy of the device tensor `dev` (of this communicator's
    /// device). Synchronous; call it once the ops writing `dev` completed
    /// (their `Work` did): it does not wait for ops in flight.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `dev` is not a tensor of this
    /// communicator's device or the copy fails.
    pub fn to_host(&self, dev: &Tensor) -> Result<Tensor> {
        let op = "to_host";
        let mem = self.device_mem(op)?;
        if dev.device() != mem.device() {
            return Err(self.invalid(
                op,
                format!(
                    "the tensor is on {}, this communicator on {}",
                    dev.device(),
                    mem.device()
                ),
            ));
        }
        let mut out = self.output(op, dev.dtype(), dev.len())?;
        mem.copy(dev, 0, &mut out, 0, dev.len_bytes())
            .map_err(|e| self.invalid(op, e))?;
        Ok(out)
    }

    /// A new device tensor holding a copy of the device tensor `dev`
    /// (copied on the device, never through the host; what [`Clone`] cannot
    /// do for device memory). Synchronous, like [`Comm::to_host`].
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `dev` is not a tensor of this
    /// communicator's device, or the allocation or copy fails.
    pub fn device_clone(&self, dev: &Tensor) -> Result<Tensor> {
        let op = "device_clone";
        let mem = self.device_mem(op)?;
        if dev.device() != mem.device() {
            return Err(self.invalid(
                op,
                format!(
                    "the tensor is on {}, this communicator on {}",
                    dev.device(),
                    mem.device()
                ),
            ));
        }
        let mut out = self.output_on(op, dev.dtype(), dev.len(), Some(mem))?;
        mem.copy(dev, 0, &mut out, 0, dev.len_bytes())
            .map_err(|e| self.invalid(op, e))?;
        Ok(out)
    }

    /// Async form of [`Comm::device_zeros`]: the allocation runs on a
    /// blocking thread, never on the caller's runtime worker.
    ///
    /// # Errors
    /// As [`Comm::device_zeros`].
    pub async fn device_zeros_async(&self, dtype: DType, len: usize) -> Result<Tensor> {
        let me = self.clone();
        off_runtime(move || me.device_zeros(dtype, len)).await
    }

    /// Async form of [`Comm::to_device`] (the host data is copied once on
    /// the host first, so the copy can run on a blocking thread).
    ///
    /// # Errors
    /// As [`Comm::to_device`].
    pub async fn to_device_async(&self, host: &Tensor) -> Result<Tensor> {
        let Some(owned) = host.try_clone() else {
            return self.to_device(host);
        };
        let me = self.clone();
        off_runtime(move || me.to_device(&owned)).await
    }

    /// Async form of [`Comm::to_host`] (the copy runs on a blocking thread,
    /// which keeps the device memory alive while it copies).
    ///
    /// # Errors
    /// As [`Comm::to_host`].
    pub async fn to_host_async(&self, dev: &Tensor) -> Result<Tensor> {
        let Some(alias) = dev.device_alias() else {
            return self.to_host(dev);
        };
        let me = self.clone();
        off_runtime(move || me.to_host(&alias)).await
    }

    pub(crate) fn submit<T>(
        &self,
        map: fn(Completion) -> Result<T>,
        build: impl FnOnce() -> Result<Request>,
    ) -> Work<T> {
        let inline = INLINE.replace(false);
        let mut req = match build() {
            Ok(r) => r,
            Err(e) => return Work::ready(map, Err(e)),
        };
        // WK-4: a fence slot of its own only for an op ordered with a stream.
        let (work, mut completer) = if self.stream.is_some() {
            Work::ordered(map)
        } else {
            Work::new(map)
        };
        let home = &self.shared.home;
        if home.obs.watching(&self.hints) {
            completer.track(home.obs.issue(describe(&req), &self.hints));
        }
        req.timeout = self.timeout();
        req.stream = self.stream;
        req.completer = Some(completer);
        if home.status.state() != State::Active {
            if let Some(c) = req.completer.take() {
                c.complete(Err(self.closed_error()));
            }
            return work;
        }
        // AC-6: the op takes its place in the order here, in this caller's
        // program order; it runs now only if nothing is ahead of it.
        if let Some((lease, mut req)) = home.submit(Box::new(req)) {
            if inline {
                req.issued = req.completer.as_ref().and_then(|c| c.issued());
                // A turn on this (blocked) thread, which may sleep in the kernel.
                crate::runtime::run_here(&home.rt, || lease.run(req, true));
            } else {
                // A turn as a task next to the caller (the caller's
                // runtime, else the communicator's): one hand-off, and
                // none across threads when the caller is a task.
                crate::runtime::spawn_near(&home.rt, home.own_rt, |may_block| {
                    lease.run(req, may_block)
                });
            }
        }
        work
    }

    /// The blocking form of an op: `submit` (called by `op`) may run it as
    /// a turn on this thread when the communicator is idle, so a blocking
    /// op costs no thread hand-off. Never blocks a worker of the caller's
    /// runtime ([`crate::runtime::blocking`]).
    pub(crate) fn blocking<T>(
        &self,
        name: &'static str,
        op: impl FnOnce() -> Work<T>,
    ) -> Result<T> {
        struct Reset;
        impl Drop for Reset {
            fn drop(&mut self) {
                INLINE.set(false);
            }
        }
        crate::runtime::blocking(name, || {
            INLINE.set(true);
            let reset = Reset;
            let work = op();
            drop(reset);
            work.wait()
        })
    }

    /// The error of an op submitted once this communicator no longer runs
    /// ops: `Aborted` carrying the cause's failed ranks, or `Finalized`.
    pub(crate) fn closed_error(&self) -> Error {
        let info = &self.shared.home.info;
        self.shared
            .home
            .status
            .closed_error(&info.name, info.rank, info.epoch)
    }

    // ---------------------------------------------------------------- all_reduce

    /// Reduce `tensor` across all ranks with `op`; every rank gets the result.
    ///
    /// # Errors
    /// [`Error::UnsupportedOp`] for a bitwise op on floats; [`Error::Mismatch`]
    /// if ranks disagree on count, dtype or op; [`Error::Timeout`],
    /// [`Error::PeerFailed`], [`Error::Aborted`] on failures.
    pub fn all_reduce(&self, tensor: Tensor, op: ReduceOp) -> Result<Tensor> {
        self.blocking("all_reduce", || self.all_reduce_async(tensor, op))
    }

    /// Async form of [`Comm::all_reduce`].
    ///
    /// # Cancel safety
    /// Dropping the `Work` does not cancel the op.
    pub fn all_reduce_async(&self, tensor: Tensor, op: ReduceOp) -> Work<Tensor> {
        self.submit(to_tensor, || {
            self.check_redop(op, tensor.dtype())?;
            let dev = self.placement("all_reduce", &[&tensor])?;
            Ok(Request::collective(
                OpKind::AllReduce,
                Some(op),
                tensor.dtype(),
                None,
                tensor.len(),
                vec![],
                OpData::AllReduce {
                    op: Self::wire_op(op, tensor.dtype(), dev),
                    buf: tensor,
                },
            ))
        })
    }

    // ---------------------------------------------------------------- reduce

    /// Reduce `tensor` across all ranks onto `root`. Root gets the result;
    /// the other ranks get their input back unchanged.
    ///
    /// # Errors
    /// As [`Comm::all_reduce`], plus [`Error::InvalidArgument`] for a root out
    /// of range and [`Error::Mismatch`] if ranks disagree on the root.
    pub fn reduce(&self, tensor: Tensor, op: ReduceOp, root: usize) -> Result<Tensor> {
        self.blocking("reduce", || self.reduce_async(tensor, op, root))
    }

    /// Async form of [`Comm::reduce`].
    pub fn reduce_async(&self, tensor: Tensor, op: ReduceOp, root: usize) -> Work<Tensor> {
        self.submit(to_tensor, || {
            self.check_root("reduce", root)?;
            self.check_redop(op, tensor.dtype())?;
            let dev = self.placement("reduce", &[&tensor])?;
            // A non-root rank's host buffer comes back unchanged: the turn
            // reduces from a copy it makes (`keep` holds the original); a
            // device buffer is reduced in place (NCCL leaves a non-root's
            // buffer untouched, CM-4).
            Ok(Request::collective(
                OpKind::Reduce,
                Some(op),
                tensor.dtype(),
                Some(root),
                tensor.len(),
                vec![],
                OpData::Reduce {
                    op: Self::wire_op(op, tensor.dtype(), dev),
                    buf: tensor,
                    root,
                },
            ))
        })
    }

    // ---------------------------------------------------------------- reduce_scatter

    /// Reduce `input` (one equal block per rank, `size()` blocks) across ranks;
    /// rank `r` gets reduced block `r`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the length is not divisible by `size()`;
    /// otherwise as [`Comm::all_reduce`].
    pub fn reduce_scatter(&self, input: Tensor, op: ReduceOp) -> Result<Tensor> {
        self.blocking("reduce_scatter", || self.reduce_scatter_async(input, op))
    }

    /// Async form of [`Comm::reduce_scatter`].
    pub fn reduce_scatter_async(&self, input: Tensor, op: ReduceOp) -> Work<Tensor> {
        if input.len() % self.size() != 0 {
            let e = self.invalid(
                "reduce_scatter",
                format!(
                    "input has {} elements, not divisible by {} ranks; use reduce_scatter_v",
                    input.len(),
                    self.size()
                ),
            );
            return Work::ready(to_tensor, Err(e));
        }
        let counts = vec![input.len() / self.size(); self.size()];
        self.reduce_scatter_v_async(input, &counts, op)
    }

    /// Reduce `input` (blocks of `counts[r]` elements, one per rank) across
    /// ranks; rank `r` gets reduced block `r` (`counts[r]` elements). Every
    /// rank must pass the same `counts`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `counts` does not have `size()` entries
    /// adding up to the input length; [`Error::Mismatch`] if ranks pass
    /// different `counts`; otherwise as [`Comm::all_reduce`].
    pub fn reduce_scatter_v(
        &self,
        input: Tensor,
        counts: &[usize],
        op: ReduceOp,
    ) -> Result<Tensor> {
        self.blocking("reduce_scatter_v", || {
            self.reduce_scatter_v_async(input, counts, op)
        })
    }

    /// Async form of [`Comm::reduce_scatter_v`].
    pub fn reduce_scatter_v_async(
        &self,
        input: Tensor,
        counts: &[usize],
        op: ReduceOp,
    ) -> Work<Tensor> {
        self.submit(to_tensor, || {
            self.reduce_scatter_request(input, counts, op, None)
        })
    }

    /// [`Comm::reduce_scatter`] into a caller-provided `output` of
    /// `input.len() / size()` elements and the input's dtype, so that a loop
    /// reuses its buffers instead of allocating (and page-faulting in) a new
    /// output for every op. Returns `(output, input)`; the input buffer is
    /// the op's scratch space, so its contents afterwards are unspecified.
    ///
    /// ```
    /// # use chorus::{new_comm, CommOptions, Device, ReduceOp, Tensor};
    /// let comm = new_comm("cpu", Device::Cpu, "doc-rs-into", CommOptions::single())?;
    /// let (mut input, mut output) = (Tensor::zeros(chorus::DType::F32, 4), Tensor::zeros(chorus::DType::F32, 4));
    /// for step in 0..3 {
    ///     input.as_mut_slice::<f32>().fill(step as f32);
    ///     (output, input) = comm.reduce_scatter_into(input, output, ReduceOp::Sum)?;
    ///     assert_eq!(output.to_vec::<f32>(), vec![step as f32; 4]);
    /// }
    /// # Ok::<(), chorus::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`Comm::reduce_scatter`], plus [`Error::InvalidArgument`] if
    /// `output` has the wrong length or dtype.
    pub fn reduce_scatter_into(
        &self,
        input: Tensor,
        output: Tensor,
        op: ReduceOp,
    ) -> Result<(Tensor, Tensor)> {
        self.blocking("reduce_scatter_into", || {
            self.reduce_scatter_into_async(input, output, op)
        })
    }

    /// Async form of [`Comm::reduce_scatter_into`].
    pub fn reduce_scatter_into_async(
        &self,
        input: Tensor,
        output: Tensor,
        op: ReduceOp,
    ) -> Work<(Tensor, Tensor)> {
        self.submit(to_pair, || {
            let n = self.size();
            if input.len() % n != 0 {
                return Err(self.invalid(
                    "reduce_scatter",
                    format!(
                        "input has {} elements, not divisible by {n} ranks",
                        input.len()
                    ),
                ));
            }
            let counts = vec![input.len() / n; n];
            self.reduce_scatter_request(input, &counts, op, Some(output))
        })
    }

    fn reduce_scatter_request(
        &self,
        input: Tensor,
        counts: &[usize],
        op: ReduceOp,
        output: Option<Tensor>,
    ) -> Result<Request> {
        self.check_counts("reduce_scatter", counts, input.len())?;
        self.check_redop(op, input.dtype())?;
        let mine = counts[self.rank()];
        let return_input = output.is_some();
        let dev = match &output {
            Some(o) => self.placement("reduce_scatter", &[&input, o])?,
            None => self.placement("reduce_scatter", &[&input])?,
        };
        let output = match output {
            Some(o) => {
                self.check_output("reduce_scatter", &o, input.dtype(), mine)?;
                o
            }
            None => self.output_on("reduce_scatter", input.dtype(), mine, dev)?,
        };
        let wire = Self::wire_op(op, input.dtype(), dev);
        let mut req = Request::collective(
            OpKind::ReduceScatter,
            Some(op),
            input.dtype(),
            None,
            input.len(),
            counts.to_vec(),
            OpData::ReduceScatter {
                op: wire,
                input,
                output,
                counts: counts.to_vec(),
            },
        );
        req.return_input = return_input;
        Ok(req)
    }

    /// `InvalidArgument` unless `output` holds `len` elements of `dtype`.
    fn check_output(
        &self,
        op: &'static str,
        output: &Tensor,
        dtype: DType,
        len: usize,
    ) -> Result<()> {
        if output.dtype() != dtype || output.len() != len {
            return Err(self.invalid(
                op,
                format!(
                    "output is {} x {}, but this op needs {len} x {dtype}",
                    output.len(),
                    output.dtype()
                ),
            ));
        }
        Ok(())
    }

    // ---------------------------------------------------------------- all_gather

    /// Gather every rank's `input` (all the same length) into one tensor,
    /// rank 0's block first, on every rank.
    ///
    /// # Errors
    /// [`Error::Mismatch`] if ranks pass different lengths or dtypes; failures
    /// as [`Comm::all_reduce`].
    pub fn all_gather(&self, input: Tensor) -> Result<Tensor> {
        self.blocking("all_gather", || self.all_gather_async(input))
    }

    /// Async form of [`Comm::all_gather`].
    pub fn all_gather_async(&self, input: Tensor) -> Work<Tensor> {
        let counts = vec![input.len(); self.size()];
        self.all_gather_v_async(input, &counts)
    }

    /// Gather blocks of different lengths: rank `r` contributes `counts[r]`
    /// elements. Every rank must pass the same `counts`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `counts` has the wrong length or
    /// `counts[rank()]` is not the input length; [`Error::Mismatch`] if ranks
    /// disagree.
    pub fn all_gather_v(&self, input: Tensor, counts: &[usize]) -> Result<Tensor> {
        self.blocking("all_gather_v", || self.all_gather_v_async(input, counts))
    }

    /// Async form of [`Comm::all_gather_v`].
    pub fn all_gather_v_async(&self, input: Tensor, counts: &[usize]) -> Work<Tensor> {
        self.submit(to_tensor, || self.all_gather_request(input, counts, None))
    }

    /// [`Comm::all_gather`] into a caller-provided `output` of
    /// `size() × input.len()` elements and the input's dtype, so that a loop
    /// reuses its buffers instead of allocating (and page-faulting in) a new
    /// output for every op. Returns `(output, input)`, the input unchanged.
    ///
    /// ```
    /// # use chorus::{new_comm, CommOptions, Device, Tensor};
    /// let comm = new_comm("cpu", Device::Cpu, "doc-ag-into", CommOptions::single())?;
    /// let (mut input, mut output) = (Tensor::full(1i32, 3), Tensor::zeros(chorus::DType::I32, 3));
    /// for _ in 0..3 {
    ///     (output, input) = comm.all_gather_into(input, output)?;
    ///     assert_eq!(output.to_vec::<i32>(), vec![1, 1, 1]);
    /// }
    /// # Ok::<(), chorus::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`Comm::all_gather`], plus [`Error::InvalidArgument`] if `output`
    /// has the wrong length or dtype.
    pub fn all_gather_into(&self, input: Tensor, output: Tensor) -> Result<(Tensor, Tensor)> {
        self.blocking("all_gather_into", || {
            self.all_gather_into_async(input, output)
        })
    }

    /// Async form of [`Comm::all_gather_into`].
    pub fn all_gather_into_async(&self, input: Tensor, output: Tensor) -> Work<(Tensor, Tensor)> {
        let counts = vec![input.len(); self.size()];
        self.submit(to_pair, || {
            self.all_gather_request(input, &counts, Some(output))
        })
    }

    fn all_gather_request(
        &self,
        input: Tensor,
        counts: &[usize],
        output: Option<Tensor>,
    ) -> Result<Request> {
        if counts.len() != self.size() {
            return Err(self.invalid(
                "all_gather",
                format!("{} sizes given for {} ranks", counts.len(), self.size()),
            ));
        }
        if counts[self.rank()] != input.len() {
            return Err(self.invalid(
                "all_gather",
                format!(
                    "counts[{}] = {} but this rank's input has {} elements",
                    self.rank(),
                    counts[self.rank()],
                    input.len()
                ),
            ));
        }
        let total = self.checked_total("all_gather", counts)?;
        let return_input = output.is_some();
        let dev = match &output {
            Some(o) => self.placement("all_gather", &[&input, o])?,
            None => self.placement("all_gather", &[&input])?,
        };
        let output = match output {
            Some(o) => {
                self.check_output("all_gather", &o, input.dtype(), total)?;
                o
            }
            None => self.output_on("all_gather", input.dtype(), total, dev)?,
        };
        let mut req = Request::collective(
            OpKind::AllGather,
            None,
            input.dtype(),
            None,
            input.len(),
            counts.to_vec(),
            OpData::AllGather {
                input,
                output,
                counts: counts.to_vec(),
                in_place: false,
            },
        );
        req.return_input = return_input;
        Ok(req)
    }

    /// [`Comm::all_gather`] in place: `output` holds `size()` equal blocks,
    /// and block `rank()` already holds this rank's data (as nccl-tests'
    /// in-place mode and TorchComms' `all_gather_single` with the input a
    /// view of the output). Every other block is overwritten with its
    /// rank's block. Saves the copy of this rank's own block, and a
    /// separate input buffer. Ranks may mix this form with
    /// [`Comm::all_gather`] and [`Comm::all_gather_into`] in one op.
    ///
    /// Backends that cannot run it in place (see
    /// [`Capabilities::in_place_all_gather`](crate::backends::Capabilities::in_place_all_gather))
    /// get a copy of the block as their input; the result is the same.
    ///
    /// ```
    /// # use chorus::{new_comm, CommOptions, Device, Tensor};
    /// let comm = new_comm("cpu", Device::Cpu, "doc-ag-in-place", CommOptions::single())?;
    /// let out = comm.all_gather_in_place(Tensor::full(4u8, 2))?;
    /// assert_eq!(out.to_vec::<u8>(), vec![4, 4]);
    /// # Ok::<(), chorus::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `output.len()` is not a multiple of
    /// `size()`; otherwise as [`Comm::all_gather`].
    pub fn all_gather_in_place(&self, output: Tensor) -> Result<Tensor> {
        self.blocking("all_gather_in_place", || {
            self.all_gather_in_place_async(output)
        })
    }

    /// Async form of [`Comm::all_gather_in_place`].
    pub fn all_gather_in_place_async(&self, output: Tensor) -> Work<Tensor> {
        self.submit(to_tensor, || self.all_gather_in_place_request(output))
    }

    fn all_gather_in_place_request(&self, output: Tensor) -> Result<Request> {
        let op = "all_gather_in_place";
        let (n, rank) = (self.size(), self.rank());
        if output.len() % n != 0 {
            return Err(self.invalid(
                op,
                format!(
                    "the output's {} elements are not {n} equal blocks",
                    output.len()
                ),
            ));
        }
        let count = output.len() / n;
        let dev = self.placement(op, &[&output])?;
        let (dtype, es) = (output.dtype(), output.dtype().size());
        let native = self.shared.caps.in_place_all_gather && dev.is_none();
        let input = if native {
            Tensor::zeros(dtype, 0)
        } else {
            // A backend without an in-place form gets its block as input.
            let mut input = self.output_on(op, dtype, count, dev)?;
            match dev {
                Some(mem) => mem
                    .copy(&output, rank * count * es, &mut input, 0, count * es)
                    .map_err(|e| self.invalid(op, e))?,
                None => input
                    .as_bytes_mut()
                    .copy_from_slice(&output.as_bytes()[rank * count * es..][..count * es]),
            }
            input
        };
        let counts = vec![count; n];
        Ok(Request::collective(
            OpKind::AllGather,
            None,
            dtype,
            None,
            count,
            counts.clone(),
            OpData::AllGather {
                input,
                output,
                counts,
                in_place: native,
            },
        ))
    }

    // ---------------------------------------------------------------- broadcast

    /// Broadcast `tensor` from `root`; other ranks pass a buffer of the same
    /// length and dtype and get root's data in it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a root out of range; [`Error::Mismatch`]
    /// if ranks disagree on root, length or dtype.
    pub fn broadcast(&self, tensor: Tensor, root: usize) -> Result<Tensor> {
        self.blocking("broadcast", || self.broadcast_async(tensor, root))
    }

    /// Async form of [`Comm::broadcast`].
    pub fn broadcast_async(&self, tensor: Tensor, root: usize) -> Work<Tensor> {
        self.submit(to_tensor, || {
            self.check_root("broadcast", root)?;
            self.placement("broadcast", &[&tensor])?;
            Ok(Request::collective(
                OpKind::Broadcast,
                None,
                tensor.dtype(),
                Some(root),
                tensor.len(),
                vec![],
                OpData::Broadcast { buf: tensor, root },
            ))
        })
    }

    // ---------------------------------------------------------------- scatter

    /// Scatter from `root`: root passes `inputs` (one tensor per rank, all of
    /// `output`'s length and dtype); rank `r` gets `inputs[r]` in `output`.
    /// Non-root ranks pass `None`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if root passes no or wrongly sized inputs;
    /// [`Error::Mismatch`] if ranks disagree on root, length or dtype.
    pub fn scatter(
        &self,
        output: Tensor,
        inputs: Option<Vec<Tensor>>,
        root: usize,
    ) -> Result<Tensor> {
        self.blocking("scatter", || self.scatter_async(output, inputs, root))
    }

    /// Async form of [`Comm::scatter`].
    pub fn scatter_async(
        &self,
        output: Tensor,
        inputs: Option<Vec<Tensor>>,
        root: usize,
    ) -> Work<Tensor> {
        self.submit(to_tensor, || {
            self.check_root("scatter", root)?;
            let mut bufs: Vec<&Tensor> = vec![&output];
            bufs.extend(inputs.iter().flatten());
            let dev = self.placement("scatter", &bufs)?;
            let input = if self.rank() == root {
                let inputs = inputs.ok_or_else(|| {
                    self.invalid("scatter", "the root must pass one input tensor per rank")
                })?;
                if inputs.len() != self.size()
                    || inputs
                        .iter()
                        .any(|t| t.len() != output.len() || t.dtype() != output.dtype())
                {
                    return Err(self.invalid(
                        "scatter",
                        format!(
                            "the root must pass {} inputs of {} x {}",
                            self.size(),
                            output.len(),
                            output.dtype()
                        ),
                    ));
                }
                match dev {
                    Some(mem) => crate::backends::device_concat(&**mem, output.dtype(), &inputs)
                        .map_err(|e| {
                            self.invalid("scatter", format!("cannot concatenate the inputs: {e}"))
                        })?,
                    None => Tensor::concat(output.dtype(), &inputs).ok_or_else(|| {
                        self.invalid("scatter", "no memory for the concatenated inputs")
                    })?,
                }
            } else {
                self.output_on("scatter", output.dtype(), 0, dev)?
            };
            Ok(Request::collective(
                OpKind::Scatter,
                None,
                output.dtype(),
                Some(root),
                output.len(),
                vec![],
                OpData::Scatter {
                    input,
                    output,
                    root,
                },
            ))
        })
    }

    /// [`Comm::scatter`] with the root's inputs as one tensor: `input` on
    /// `root` holds `size()` blocks of `output`'s length and dtype, block
    /// `r` going to rank `r`. Nothing is allocated or concatenated, so a
    /// loop reuses its buffers. Returns `(output, input)`; `input` is not
    /// read on other ranks (pass an empty tensor) and comes back as given.
    /// Ranks may mix this form with [`Comm::scatter`] in one op.
    ///
    /// ```
    /// # use chorus::{new_comm, CommOptions, Device, Tensor};
    /// let comm = new_comm("cpu", Device::Cpu, "doc-scatter-into", CommOptions::single())?;
    /// let (out, _input) =
    ///     comm.scatter_single_into(Tensor::from_vec(vec![1i32, 2]), Tensor::zeros(chorus::DType::I32, 2), 0)?;
    /// assert_eq!(out.to_vec::<i32>(), vec![1, 2]);
    /// # Ok::<(), chorus::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`Comm::scatter`]; on `root`, [`Error::InvalidArgument`] if
    /// `input` is not `size()` blocks of `output`'s length and dtype.
    pub fn scatter_single_into(
        &self,
        input: Tensor,
        output: Tensor,
        root: usize,
    ) -> Result<(Tensor, Tensor)> {
        self.blocking("scatter_single_into", || {
            self.scatter_single_into_async(input, output, root)
        })
    }

    /// Async form of [`Comm::scatter_single_into`].
    pub fn scatter_single_into_async(
        &self,
        input: Tensor,
        output: Tensor,
        root: usize,
    ) -> Work<(Tensor, Tensor)> {
        self.submit(to_pair, || {
            let op = "scatter";
            let (input, keep) = self.root_whole(op, root, &output, input, "input")?;
            let mut req = Request::collective(
                OpKind::Scatter,
                None,
                output.dtype(),
                Some(root),
                output.len(),
                vec![],
                OpData::Scatter {
                    input,
                    output,
                    root,
                },
            );
            req.return_input = true;
            req.keep = keep;
            Ok(req)
        })
    }

    // ---------------------------------------------------------------- gather

    /// Gather every rank's `input` (all the same length) onto `root`, which
    /// gets one tensor per rank; other ranks get an empty list.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a root out of range; [`Error::Mismatch`]
    /// if ranks disagree on root, length or dtype.
    pub fn gather(&self, input: Tensor, root: usize) -> Result<Vec<Tensor>> {
        self.blocking("gather", || self.gather_async(input, root))
    }

    /// Async form of [`Comm::gather`].
    pub fn gather_async(&self, input: Tensor, root: usize) -> Work<Vec<Tensor>> {
        self.submit(to_tensors, || self.gather_request("gather", input, root))
    }

    /// Gather every rank's `input` (all the same length) onto `root` as one
    /// contiguous tensor, rank `r`'s input at `r * input.len()`; other ranks
    /// get an empty tensor of the same dtype. TorchComms' `gather_single`:
    /// the same op as [`Comm::gather`] (ranks may mix the two), without
    /// cutting the root's output into per-rank tensors.
    ///
    /// ```
    /// let comm = chorus::new_comm("cpu", chorus::Device::Cpu, "gs-doc", chorus::CommOptions::single())?;
    /// let all = comm.gather_single(chorus::Tensor::from_vec(vec![1i32, 2]), 0)?;
    /// assert_eq!(all.to_vec::<i32>(), vec![1, 2]);
    /// comm.finalize()?;
    /// # Ok::<(), chorus::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`Comm::gather`].
    pub fn gather_single(&self, input: Tensor, root: usize) -> Result<Tensor> {
        self.blocking("gather_single", || self.gather_single_async(input, root))
    }

    /// Async form of [`Comm::gather_single`].
    pub fn gather_single_async(&self, input: Tensor, root: usize) -> Work<Tensor> {
        self.submit(to_tensor, || {
            let mut req = self.gather_request("gather_single", input, root)?;
            req.whole = true;
            Ok(req)
        })
    }

    /// [`Comm::gather_single`] into a caller-provided `output` on `root`
    /// (`size()` × `input.len()` elements, the input's dtype), so that a
    /// loop reuses its buffers instead of allocating a new output for every
    /// op. Returns `(output, input)`; `output` is not touched on other ranks
    /// (pass an empty tensor) and comes back as given. Ranks may mix this
    /// form with [`Comm::gather`] and [`Comm::gather_single`].
    ///
    /// ```
    /// # use chorus::{new_comm, CommOptions, Device, Tensor};
    /// let comm = new_comm("cpu", Device::Cpu, "doc-gather-into", CommOptions::single())?;
    /// let (all, _input) =
    ///     comm.gather_single_into(Tensor::from_vec(vec![5i32, 6]), Tensor::zeros(chorus::DType::I32, 2), 0)?;
    /// assert_eq!(all.to_vec::<i32>(), vec![5, 6]);
    /// # Ok::<(), chorus::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`Comm::gather`]; on `root`, [`Error::InvalidArgument`] if
    /// `output` has the wrong length or dtype.
    pub fn gather_single_into(
        &self,
        input: Tensor,
        output: Tensor,
        root: usize,
    ) -> Result<(Tensor, Tensor)> {
        self.blocking("gather_single_into", || {
            self.gather_single_into_async(input, output, root)
        })
    }

    /// Async form of [`Comm::gather_single_into`].
    pub fn gather_single_into_async(
        &self,
        input: Tensor,
        output: Tensor,
        root: usize,
    ) -> Work<(Tensor, Tensor)> {
        self.submit(to_pair, || {
            let op = "gather_single";
            let (output, keep) = self.root_whole(op, root, &input, output, "output")?;
            let mut req = Request::collective(
                OpKind::Gather,
                None,
                input.dtype(),
                Some(root),
                input.len(),
                vec![],
                OpData::Gather {
                    input,
                    output,
                    root,
                },
            );
            req.return_input = true;
            req.keep = keep;
            Ok(req)
        })
    }

    /// The root's whole buffer of a rooted `_into` op (scatter's input,
    /// gather's output): on `root`, `whole` checked to be `size()` blocks of
    /// `each`'s length and dtype and used by the op; elsewhere an empty
    /// tensor for the op, and `whole` kept to be handed back untouched.
    fn root_whole(
        &self,
        op: &'static str,
        root: usize,
        each: &Tensor,
        whole: Tensor,
        what: &str,
    ) -> Result<(Tensor, Option<Tensor>)> {
        self.check_root(op, root)?;
        if self.rank() != root {
            let dev = self.placement(op, &[each])?;
            return Ok((self.output_on(op, each.dtype(), 0, dev)?, Some(whole)));
        }
        self.placement(op, &[each, &whole])?;
        let total = each
            .len()
            .checked_mul(self.size())
            .ok_or_else(|| self.invalid(op, format!("the root's {what} would overflow usize")))?;
        if whole.dtype() != each.dtype() || whole.len() != total {
            return Err(self.invalid(
                op,
                format!(
                    "the root's {what} is {} x {}, but this op needs {total} x {} ({} blocks of {} elements)",
                    whole.len(),
                    whole.dtype(),
                    each.dtype(),
                    self.size(),
                    each.len()
                ),
            ));
        }
        Ok((whole, None))
    }

    fn gather_request(&self, op: &'static str, input: Tensor, root: usize) -> Result<Request> {
        self.check_root(op, root)?;
        let dev = self.placement(op, &[&input])?;
        let out_len = if self.rank() == root {
            input
                .len()
                .checked_mul(self.size())
                .ok_or_else(|| self.invalid(op, "the gathered output would overflow usize"))?
        } else {
            0
        };
        let output = self.output_on(op, input.dtype(), out_len, dev)?;
        Ok(Request::collective(
            OpKind::Gather,
            None,
            input.dtype(),
            Some(root),
            input.len(),
            vec![],
            OpData::Gather {
                input,
                output,
                root,
            },
        ))
    }

    // ---------------------------------------------------------------- all_to_all

    /// All-to-all with one tensor per peer: `inputs[j]` goes to rank `j`;
    /// the result's entry `j` is what rank `j` sent here. Sizes may differ per
    /// pair (the receiver learns them from the header exchange).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `inputs.len() != size()` or dtypes are
    /// mixed; [`Error::Mismatch`] if ranks use different dtypes.
    pub fn all_to_all(&self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>> {
        self.blocking("all_to_all", || self.all_to_all_async(inputs))
    }

    /// Async form of [`Comm::all_to_all`].
    pub fn all_to_all_async(&self, inputs: Vec<Tensor>) -> Work<Vec<Tensor>> {
        self.submit(to_tensors, || {
            if inputs.len() != self.size() {
                return Err(self.invalid(
                    "all_to_all",
                    format!("{} inputs given for {} ranks", inputs.len(), self.size()),
                ));
            }
            let dtype = inputs[0].dtype();
            let send_counts: Vec<usize> = inputs.iter().map(Tensor::len).collect();
            if inputs.iter().any(|t| t.dtype() != dtype) {
                return Err(self.invalid("all_to_all", "inputs have mixed dtypes"));
            }
            let dev = self.placement("all_to_all", &inputs.iter().collect::<Vec<_>>())?;
            let input = match dev {
                Some(mem) => {
                    crate::backends::device_concat(&**mem, dtype, &inputs).map_err(|e| {
                        self.invalid("all_to_all", format!("cannot concatenate the inputs: {e}"))
                    })?
                }
                None => Tensor::concat(dtype, &inputs).ok_or_else(|| {
                    self.invalid("all_to_all", "no memory for the concatenated inputs")
                })?,
            };
            // Sized from the peers' messages or headers once they are known.
            let output = self.output_on("all_to_all", dtype, 0, dev)?;
            Ok(Request::collective(
                OpKind::AllToAll,
                None,
                dtype,
                None,
                input.len(),
                send_counts.clone(),
                OpData::AllToAll {
                    input,
                    output,
                    send_counts,
                    recv_counts: vec![],
                },
            ))
        })
    }

    /// [`Comm::all_to_all`] into buffers the caller provides, as
    /// `torch.distributed.all_to_all(output_tensor_list, input_tensor_list)`
    /// takes them: `inputs[j]` goes to rank `j`, and what rank `j` sent
    /// here lands in `outputs[j]`, whose length says how many elements this
    /// rank expects from `j`. Returns `(outputs, inputs)`, the outputs
    /// filled, so both lists can go round again. Nothing is allocated for
    /// the results: the `cpu` backend sends from the inputs and receives
    /// into the outputs directly (other backends get them concatenated and
    /// copied out), and
    /// every block's length is checked pair by pair, as
    /// [`Comm::all_to_all_v_single`] checks them.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `inputs` or `outputs` does not have
    /// `size()` entries, if dtypes are mixed, or for device tensors (use
    /// [`Comm::all_to_all_v_single`] there); [`Error::Mismatch`] if rank
    /// `i` sends rank `j` a different number of elements than `outputs[i]`
    /// on rank `j` holds, or ranks use different dtypes: on every rank on
    /// the `cpu` backend, which receives each block only into an output of
    /// exactly its length, as for `all_to_all_v_single`; on rank `j` alone
    /// on the backends that take the lists concatenated (`gloo`, `mpi`),
    /// which learn the sizes from a header exchange.
    ///
    /// ```no_run
    /// # fn demo(comm: &chorus::Comm) -> chorus::Result<()> {
    /// use chorus::Tensor;
    /// let n = comm.size();
    /// // One element to every rank, one from every rank.
    /// let inputs = (0..n).map(|j| Tensor::full(j as f32, 1)).collect();
    /// let outputs = (0..n).map(|_| Tensor::full(0.0f32, 1)).collect();
    /// let (got, _inputs) = comm.all_to_all_into(inputs, outputs)?;
    /// assert_eq!(got[0].as_slice::<f32>(), &[comm.rank() as f32]);
    /// # Ok(()) }
    /// ```
    pub fn all_to_all_into(
        &self,
        inputs: Vec<Tensor>,
        outputs: Vec<Tensor>,
    ) -> Result<(Vec<Tensor>, Vec<Tensor>)> {
        self.blocking("all_to_all", || self.all_to_all_into_async(inputs, outputs))
    }

    /// Async form of [`Comm::all_to_all_into`].
    pub fn all_to_all_into_async(
        &self,
        inputs: Vec<Tensor>,
        outputs: Vec<Tensor>,
    ) -> Work<(Vec<Tensor>, Vec<Tensor>)> {
        self.submit(to_lists, || {
            let n = self.size();
            if inputs.len() != n || outputs.len() != n {
                return Err(self.invalid(
                    "all_to_all",
                    format!(
                        "{} inputs and {} outputs given for {n} ranks",
                        inputs.len(),
                        outputs.len()
                    ),
                ));
            }
            let dtype = inputs[0].dtype();
            if inputs.iter().chain(&outputs).any(|t| t.dtype() != dtype) {
                return Err(self.invalid("all_to_all", "inputs and outputs have mixed dtypes"));
            }
            if inputs.iter().chain(&outputs).any(Tensor::is_device) {
                return Err(self.invalid(
                    "all_to_all",
                    "all_to_all_into takes host tensors; use all_to_all_v_single on the device",
                ));
            }
            let send_counts: Vec<usize> = inputs.iter().map(Tensor::len).collect();
            let total_in = self.checked_total("all_to_all", &send_counts)?;
            self.checked_total(
                "all_to_all",
                &outputs.iter().map(Tensor::len).collect::<Vec<_>>(),
            )?;
            // A backend that takes one tensor each way gets the lists
            // concatenated by the executor.
            Ok(Request::collective(
                OpKind::AllToAll,
                None,
                dtype,
                None,
                total_in,
                send_counts,
                OpData::AllToAllList { inputs, outputs },
            ))
        })
    }

    /// All-to-all on one tensor split into `size()` equal blocks: block `j`
    /// goes to rank `j`; block `j` of the result came from rank `j`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the length is not divisible by `size()`;
    /// [`Error::Mismatch`] if ranks disagree on length or dtype.
    pub fn all_to_all_single(&self, input: Tensor) -> Result<Tensor> {
        self.blocking("all_to_all_single", || self.all_to_all_single_async(input))
    }

    /// Async form of [`Comm::all_to_all_single`].
    pub fn all_to_all_single_async(&self, input: Tensor) -> Work<Tensor> {
        if input.len() % self.size() != 0 {
            let e = self.invalid(
                "all_to_all_single",
                format!(
                    "input has {} elements, not divisible by {} ranks; use all_to_all_v_single",
                    input.len(),
                    self.size()
                ),
            );
            return Work::ready(to_tensor, Err(e));
        }
        let counts = vec![input.len() / self.size(); self.size()];
        self.all_to_all_v_single_async(input, &counts, &counts)
    }

    /// All-to-all with explicit split sizes: `input_split_sizes[j]` elements
    /// go to rank `j`, `output_split_sizes[j]` elements come from rank `j`.
    /// Rank `i`'s `input_split_sizes[j]` must equal rank `j`'s
    /// `output_split_sizes[i]`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the sizes do not fit the input;
    /// [`Error::Mismatch`] (on every rank) if any pair of ranks disagrees.
    pub fn all_to_all_v_single(
        &self,
        input: Tensor,
        input_split_sizes: &[usize],
        output_split_sizes: &[usize],
    ) -> Result<Tensor> {
        self.blocking("all_to_all_v_single", || {
            self.all_to_all_v_single_async(input, input_split_sizes, output_split_sizes)
        })
    }

    /// Async form of [`Comm::all_to_all_v_single`].
    pub fn all_to_all_v_single_async(
        &self,
        input: Tensor,
        input_split_sizes: &[usize],
        output_split_sizes: &[usize],
    ) -> Work<Tensor> {
        self.submit(to_tensor, || {
            self.all_to_all_v_request(input, input_split_sizes, output_split_sizes, None)
        })
    }

    /// [`Comm::all_to_all_single`] into a caller-provided `output` of the
    /// input's length and dtype, so that a loop reuses its buffers instead
    /// of allocating (and page-faulting in) a new output for every op.
    /// Returns `(output, input)`, the input unchanged.
    ///
    /// ```
    /// # use chorus::{new_comm, CommOptions, Device, Tensor};
    /// let comm = new_comm("cpu", Device::Cpu, "doc-a2a-into", CommOptions::single())?;
    /// let (mut input, mut output) = (Tensor::full(7u8, 4), Tensor::zeros(chorus::DType::U8, 4));
    /// for _ in 0..3 {
    ///     (output, input) = comm.all_to_all_single_into(input, output)?;
    ///     assert_eq!(output.to_vec::<u8>(), vec![7; 4]);
    /// }
    /// # Ok::<(), chorus::Error>(())
    /// ```
    ///
    /// # Errors
    /// As [`Comm::all_to_all_single`], plus [`Error::InvalidArgument`] if
    /// `output` has the wrong length or dtype.
    pub fn all_to_all_single_into(
        &self,
        input: Tensor,
        output: Tensor,
    ) -> Result<(Tensor, Tensor)> {
        self.blocking("all_to_all_single_into", || {
            self.all_to_all_single_into_async(input, output)
        })
    }

    /// Async form of [`Comm::all_to_all_single_into`].
    pub fn all_to_all_single_into_async(
        &self,
        input: Tensor,
        output: Tensor,
    ) -> Work<(Tensor, Tensor)> {
        self.submit(to_pair, || {
            if input.len() % self.size() != 0 {
                return Err(self.invalid(
                    "all_to_all_single",
                    format!(
                        "input has {} elements, not divisible by {} ranks",
                        input.len(),
                        self.size()
                    ),
                ));
            }
            let counts = vec![input.len() / self.size(); self.size()];
            let mut req = self.all_to_all_v_request(input, &counts, &counts, Some(output))?;
            req.return_input = true;
            Ok(req)
        })
    }

    fn all_to_all_v_request(
        &self,
        input: Tensor,
        input_split_sizes: &[usize],
        output_split_sizes: &[usize],
        output: Option<Tensor>,
    ) -> Result<Request> {
        self.check_counts("all_to_all_single", input_split_sizes, input.len())?;
        if output_split_sizes.len() != self.size() {
            return Err(self.invalid(
                "all_to_all_single",
                format!(
                    "{} output split sizes given for {} ranks",
                    output_split_sizes.len(),
                    self.size()
                ),
            ));
        }
        let mut counts = input_split_sizes.to_vec();
        counts.extend_from_slice(output_split_sizes);
        let total = self.checked_total("all_to_all_single", output_split_sizes)?;
        let output = match output {
            Some(o) => {
                self.placement("all_to_all_single", &[&input, &o])?;
                self.check_output("all_to_all_single", &o, input.dtype(), total)?;
                o
            }
            None => {
                let dev = self.placement("all_to_all_single", &[&input])?;
                self.output_on("all_to_all_single", input.dtype(), total, dev)?
            }
        };
        Ok(Request::collective(
            OpKind::AllToAllSingle,
            None,
            input.dtype(),
            None,
            input.len(),
            counts,
            OpData::AllToAll {
                input,
                output,
                send_counts: input_split_sizes.to_vec(),
                recv_counts: output_split_sizes.to_vec(),
            },
        ))
    }

    /// [`Comm::all_to_all_v_single`] for 2-D data, with TorchComms' split
    /// semantics: `input` holds rows of `row_width` elements (dimension 0
    /// is `input.len() / row_width`), and the split sizes count rows, not
    /// elements. `input_split_rows[j]` rows go to rank `j` and
    /// `output_split_rows[j]` rows come from rank `j`; the input's split
    /// sizes may add up to fewer rows than it has (the rows after them are
    /// not sent). The result holds `sum(output_split_rows)` rows.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] (before any communication) if
    /// `row_width` is 0 for a non-empty input or does not divide its
    /// length, if a list does not have `size()` entries, if the input's
    /// split sizes add up to more rows than it has, or if a size overflows;
    /// [`Error::Mismatch`] (on every rank) if rank `i` sends rank `j` a
    /// different number of rows than `j` expects.
    pub fn all_to_all_v_single_rows(
        &self,
        input: Tensor,
        row_width: usize,
        input_split_rows: &[usize],
        output_split_rows: &[usize],
    ) -> Result<Tensor> {
        self.blocking("all_to_all_v_single", || {
            self.all_to_all_v_single_rows_async(
                input,
                row_width,
                input_split_rows,
                output_split_rows,
            )
        })
    }

    /// Async form of [`Comm::all_to_all_v_single_rows`].
    pub fn all_to_all_v_single_rows_async(
        &self,
        input: Tensor,
        row_width: usize,
        input_split_rows: &[usize],
        output_split_rows: &[usize],
    ) -> Work<Tensor> {
        const OP: &str = "all_to_all_v_single";
        let elems = |rows: &[usize], what: &str| -> Result<Vec<usize>> {
            if rows.len() != self.size() {
                return Err(self.invalid(
                    OP,
                    format!(
                        "{} {what} split sizes given for {} ranks",
                        rows.len(),
                        self.size()
                    ),
                ));
            }
            rows.iter()
                .map(|&r| {
                    r.checked_mul(row_width).ok_or_else(|| {
                        self.invalid(
                            OP,
                            format!("{r} rows of {row_width} elements overflow usize"),
                        )
                    })
                })
                .collect()
        };
        let prepared = (|| {
            if row_width == 0 && !input.is_empty() {
                return Err(self.invalid(OP, "row width 0 for a non-empty input"));
            }
            if row_width != 0 && input.len() % row_width != 0 {
                return Err(self.invalid(
                    OP,
                    format!(
                        "input has {} elements, not a whole number of rows of {row_width}",
                        input.len()
                    ),
                ));
            }
            let send = elems(input_split_rows, "input")?;
            let recv = elems(output_split_rows, "output")?;
            let used = self.checked_total(OP, &send)?;
            if used > input.len() {
                return Err(self.invalid(
                    OP,
                    format!(
                        "input split sizes {input_split_rows:?} add up to {} rows, but the input has {} rows of {row_width}",
                        used / row_width.max(1),
                        input.len() / row_width.max(1)
                    ),
                ));
            }
            self.checked_total(OP, &recv)?;
            let input = if used == input.len() {
                input
            } else {
                // Only the rows the splits cover are sent.
                let es = input.dtype().size();
                Tensor::from_bytes(input.dtype(), &input.as_bytes()[..used * es])
                    .ok_or_else(|| self.invalid(OP, "cannot copy the input's leading rows"))?
            };
            Ok((input, send, recv))
        })();
        match prepared {
            Ok((input, send, recv)) => self.all_to_all_v_single_async(input, &send, &recv),
            Err(e) => Work::ready(to_tensor, Err(e)),
        }
    }

    // ---------------------------------------------------------------- barrier

    /// Block until every rank has entered the barrier.
    ///
    /// # Errors
    /// [`Error::Timeout`], [`Error::PeerFailed`], [`Error::Aborted`].
    pub fn barrier(&self) -> Result<()> {
        self.blocking("barrier", || self.barrier_async())
    }

    /// Async form of [`Comm::barrier`].
    pub fn barrier_async(&self) -> Work<()> {
        self.submit(to_unit, || {
            Ok(Request::collective(
                OpKind::Barrier,
                None,
                DType::U8,
                None,
                0,
                vec![],
                OpData::Barrier,
            ))
        })
    }

    // ---------------------------------------------------------------- point-to-point

    /// Send `tensor` to rank `dst`; returns the buffer once sent.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a bad peer; [`Error::Mismatch`] (on both
    /// ends) if the receiver expects another length or dtype.
    pub fn send(&self, tensor: Tensor, dst: usize) -> Result<Tensor> {
        self.blocking("send", || self.send_async(tensor, dst))
    }

    /// Async form of [`Comm::send`].
    pub fn send_async(&self, tensor: Tensor, dst: usize) -> Work<Tensor> {
        self.submit(first_tensor, || self.p2p_one(tensor, dst, true))
    }

    /// Receive into `tensor` from rank `src` (its length and dtype say what is
    /// expected); returns it filled.
    ///
    /// # Errors
    /// As [`Comm::send`].
    pub fn recv(&self, tensor: Tensor, src: usize) -> Result<Tensor> {
        self.blocking("recv", || self.recv_async(tensor, src))
    }

    /// Async form of [`Comm::recv`].
    pub fn recv_async(&self, tensor: Tensor, src: usize) -> Work<Tensor> {
        self.submit(first_tensor, || self.p2p_one(tensor, src, false))
    }

    /// Issue several sends and receives together; they run concurrently and
    /// complete together. Returns the buffers in the order of `ops` (received
    /// data in the receive buffers). Transfers with the same peer in the same
    /// direction are matched in order.
    ///
    /// # Errors
    /// As [`Comm::send`].
    pub fn batch_p2p(&self, ops: Vec<P2POp>) -> Result<Vec<Tensor>> {
        self.blocking("batch_p2p", || self.batch_p2p_async(ops))
    }

    /// Async form of [`Comm::batch_p2p`].
    pub fn batch_p2p_async(&self, ops: Vec<P2POp>) -> Work<Vec<Tensor>> {
        self.submit(to_tensors, || self.p2p_request(ops))
    }

    /// The request of a lone send (`send`) or receive: what
    /// [`Comm::p2p_request`] builds for one op, without the list around it.
    fn p2p_one(&self, tensor: Tensor, peer: usize, send: bool) -> Result<Request> {
        self.placement(if send { "send" } else { "recv" }, &[&tensor])?;
        Ok(Request::p2p(vec![self.p2p_transfer(tensor, peer, send)?]))
    }

    /// One transfer of a point-to-point request, its peer checked.
    fn p2p_transfer(&self, buf: Tensor, peer: usize, send: bool) -> Result<P2PTransfer> {
        self.check_peer(if send { "send" } else { "recv" }, peer)?;
        Ok(P2PTransfer {
            peer,
            seq: 0,
            send,
            buf,
        })
    }

    fn p2p_request(&self, ops: Vec<P2POp>) -> Result<Request> {
        let bufs: smallvec::SmallVec<[&Tensor; 2]> = ops
            .iter()
            .map(|o| match o {
                P2POp::Send { tensor, .. } | P2POp::Recv { tensor, .. } => tensor,
            })
            .collect();
        self.placement(
            match ops.as_slice() {
                [P2POp::Send { .. }] => "send",
                [P2POp::Recv { .. }] => "recv",
                _ => "batch_p2p",
            },
            &bufs,
        )?;
        drop(bufs);
        let mut transfers = Vec::with_capacity(ops.len());
        for op in ops {
            let (tensor, peer, send) = match op {
                P2POp::Send { tensor, peer } => (tensor, peer, true),
                P2POp::Recv { tensor, peer } => (tensor, peer, false),
            };
            transfers.push(self.p2p_transfer(tensor, peer, send)?);
        }
        Ok(Request::p2p(transfers))
    }

    // ---------------------------------------------------------------- lifecycle

    /// Finish every queued op, then close the communicator's links and stop
    /// its actor; its children (splits) are finalized first. Later ops fail
    /// with [`Error::Finalized`].
    ///
    /// # Errors
    /// [`Error::WouldBlock`] on a current-thread tokio runtime (use
    /// [`Comm::finalize_async`]).
    pub fn finalize(&self) -> Result<()> {
        crate::runtime::blocking("finalize", || match self.finalize_request() {
            Some(done) => done.wait(),
            None => Ok(()),
        })
    }

    /// Async form of [`Comm::finalize`].
    ///
    /// # Errors
    /// None today; reserved for a finalize that cannot complete.
    pub async fn finalize_async(&self) -> Result<()> {
        match self.finalize_request() {
            Some(done) => done.await,
            None => Ok(()),
        }
    }

    /// Ask the actor to finalize; `None` if the communicator is already
    /// finalized or aborted, or its actor is gone.
    pub(crate) fn finalize_request(&self) -> Option<Work<()>> {
        let home = &self.shared.home;
        if home.status.state() != State::Active {
            return None;
        }
        let (work, completer) = Work::new(to_unit);
        home.enqueue(Queued::Finalize(Some(completer)));
        Some(work)
    }

    /// Abort: fail every outstanding and queued op with [`Error::Aborted`],
    /// tell the peers, close the links, abort the children and stop the
    /// actor. Never kills the process. Returns once the abort is done (on a
    /// current-thread tokio runtime it does not wait: use
    /// [`Comm::abort_async`] there).
    pub fn abort(&self) {
        self.abort_with_reason("abort() called by the user");
    }

    /// [`Comm::abort`] with a reason that peers and errors will show.
    pub fn abort_with_reason(&self, reason: &str) {
        if let Some(done) = self.abort_request(reason) {
            let _ = crate::runtime::blocking("abort", || done.wait());
        }
    }

    /// Async form of [`Comm::abort`].
    pub async fn abort_async(&self) {
        self.abort_with_reason_async("abort() called by the user")
            .await
    }

    /// Async form of [`Comm::abort_with_reason`].
    pub async fn abort_with_reason_async(&self, reason: &str) {
        if let Some(done) = self.abort_request(reason) {
            let _ = done.await;
        }
    }

    /// Raise the abort signal (the op in flight ends at once) and ask the
    /// actor to act on it; `None` if there is nothing to abort.
    fn abort_request(&self, reason: &str) -> Option<Work<()>> {
        let home = &self.shared.home;
        if home.status.state() != State::Active {
            return None;
        }
        home.signal.raise(Error::Aborted {
            comm: self.shared.name.clone(),
            rank: self.shared.rank,
            epoch: self.shared.epoch,
            failed_ranks: vec![],
            reason: reason.to_string(),
        });
        let (work, completer) = Work::new(to_unit);
        self.shared
            .actor
            .send_message(CommMsg::Abort {
                done: Some(completer),
            })
            .ok()?;
        Some(work)
    }

    /// Whether the communicator is still accepting ops.
    pub fn is_active(&self) -> bool {
        self.shared.home.status.state() == State::Active
    }

    /// Whether the communicator was aborted (by a failure or by a user).
    pub fn is_aborted(&self) -> bool {
        self.shared.home.status.state() == State::Aborted
    }

    /// The communicator's status: whether it runs ops, and what aborted it.
    pub fn status(&self) -> Status {
        self.shared.home.status.get()
    }
}

/// What hooks and the flight recorder are told about `req`.
fn describe(req: &Request) -> OpDesc {
    let (op, count, peers) = match &req.data {
        OpData::P2P { ops } => {
            let mut peers: Peers = ops.iter().map(|t| t.peer).collect();
            peers.sort_unstable();
            peers.dedup();
            let name = match ops.as_slice() {
                [t] if t.send => "send",
                [_] => "recv",
                _ => "batch_p2p",
            };
            (name, ops.iter().map(|t| t.buf.len()).sum(), peers)
        }
        _ => match &req.window {
            Some(w) => {
                let peers = match w {
                    crate::backends::WindowOp::Put { dst, .. }
                    | crate::backends::WindowOp::Signal { dst, .. } => Peers::from_slice(&[*dst]),
                    crate::backends::WindowOp::WaitSignal { src, .. } => Peers::from_slice(&[*src]),
                    _ => Peers::new(),
                };
                (w.name(), req.count, peers)
            }
            None => (req.kind.name(), req.count, Peers::new()),
        },
    };
    OpDesc {
        op,
        dtype: req.dtype,
        count,
        bytes: count.saturating_mul(req.dtype.size()),
        root: req.root,
        peers,
    }
}

fn first_tensor(c: Completion) -> Result<Tensor> {
    if let Completion::Tensor(t) = c {
        return Ok(t);
    }
    let mut v = to_tensors(c)?;
    v.pop()
        .ok_or_else(|| Error::Internal("point-to-point op returned no buffer".into()))
}

/// Run `f`, which blocks, on a blocking thread of the current tokio
/// runtime (or inline outside of one), for the async forms of the device
/// memory calls.
async fn off_runtime<T: Send + 'static>(
    f: impl FnOnce() -> Result<T> + Send + 'static,
) -> Result<T> {
    match tokio::runtime::Handle::try_current() {
        Ok(h) => h
            .spawn_blocking(f)
            .await
            .map_err(|e| Error::Internal(format!("device copy task failed: {e}")))?,
        Err(_) => f(),
    }
}
