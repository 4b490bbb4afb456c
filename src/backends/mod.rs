//! Backends: the data plane behind a communicator.
//!
//! A backend moves bytes between ranks. Everything else — argument
//! validation, sequence numbers, the cross-rank consistency check, timeouts,
//! ordering and abort — lives once above the [`Backend`] trait, in
//! the communicator's executor. A backend never re-implements any of it.
//!
//! | name  | feature | needs | notes |
//! |-------|---------|-------|-------|
//! | `cpu` | always  | nothing | TCP links between the ranks that talk (opened on demand above 8 ranks), shared memory on one host; ring, tree and pairwise schedules |
//! | `nccl` | `nccl` | libnccl.so(.2) + libcudart.so(.12 or .13) at run time, a CUDA device | device tensors in place; host tensors staged through device memory |
//! | `rccl` | `rccl` | librccl.so + libamdhip64.so at run time, a ROCm device | same layer as `nccl` (module `xccl`) |
//! | `gloo` | `gloo` | Debian `libgloo-dev` at build time | C++ shim over Gloo's TCP transport |
//! | `mpi` | `mpi` | Open MPI (`libopenmpi-dev`, `libclang-dev` to build), run under `mpirun` | rsmpi |
//!
//! Backends are selected by name at run time ([`create`]); a program can
//! add its own with [`register_backend`]. Registry rules
//! (see `docs/backends.md`):
//! - REG-1: a name Chorus does not know at all is
//!   [`Error::UnknownBackend`], listing [`available`].
//! - REG-2: a known backend whose cargo feature was not enabled is
//!   [`Error::BackendUnavailable`] whose
//!   reason names the feature to enable; so is a compiled-in backend whose
//!   run-time library or device is missing (never a panic).
//! - REG-3: each built-in backend runs on one kind of
//!   [`Device`](crate::Device) ([`check_device`]); the wrong kind is
//!   rejected before any I/O. A registered backend's factory gets the
//!   device and decides.
//! - REG-4: [`register_backend`] adds a name to the ones [`create`] knows,
//!   for the life of the process; it never shadows a name of [`KNOWN`] and
//!   never replaces an earlier registration.
//!
//! The vendor backends (`nccl`, `rccl`, `gloo`, `mpi`) move data with their
//! library and use a [`cpu::CpuBackend`] mesh as their control links: the
//! header exchange ([BE-1]), abort notices and finalize run over it, so the
//! mismatch check and abort semantics are identical for every backend.
//! `gloo` and `mpi`, whose library calls block, share that glue in
//! `vendor`: each communicator runs its library calls on a dedicated OS
//! thread (its vendor worker, counted by [`live_vendor_workers`]), never
//! on a runtime thread.
//!
//! # Invariants
//! - BE-1: `execute` is only called after `exchange_headers` (or
//!   `exchange_headers_with_data`) succeeded for the
//!   same op on every participant, with buffers whose sizes match the headers;
//!   or, for a backend whose [`Capabilities::headerless_ops`] is true and a
//!   communicator whose checks are not strict, without any exchange, with
//!   the op's fingerprint in [`OpCtx::fingerprint`] (see
//!   [`crate::checks`]); such a backend's barrier synchronises by itself.
//! - BE-2: after `execute` or `exchange_headers` returns a fatal error
//!   ([`Error::is_fatal`]), or its future is dropped, the executor calls
//!   `abort` before anything else. A non-fatal error (`UnsupportedOp`,
//!   `NotSupported`, `InvalidArgument`) fails only that op and leaves the
//!   communicator usable; a backend returns one only when every rank
//!   refuses the op alike before moving any of its data.
//! - BE-3: a backend whose library finds errors on its own (NCCL's
//!   `ncclCommGetAsyncError`) says so with [`Backend::polls_async_errors`];
//!   the executor then calls [`Backend::poll_async_error`] while the
//!   communicator is idle, never during an op, and treats an error as fatal
//!   exactly as if an op had returned it ([BE-2] applies).
//! - BE-4: a backend whose library splits communicators itself
//!   (`ncclCommSplit`) says so in [`Backend::capabilities`]; a split
//!   of its communicator then calls [`Backend::split`] on every parent
//!   rank, between ops, after the ranks agreed on the split, and the child
//!   runs on the backend it returns. An error is fatal for the parent.
//!   Other backends' children connect from scratch, like a new
//!   communicator, or, where [`Capabilities::split`] is
//!   [`SplitMode::Unsupported`], a split fails with `NotSupported` on every
//!   rank before the agreement step. A backend that is not
//!   [`Capabilities::elastic`] refuses `reconfigure` the same way.
//!
//! - BE-5: a backend may send payload together with the headers
//!   ([`Backend::exchange_headers_with_data`]), but it uses none of the
//!   payload it received that way before `execute` is called for the same
//!   op, that is, before every rank's check passed. When the check fails,
//!   `execute` is not called and that payload is dropped; since every rank
//!   still sent and received exactly its header frames, the links stay
//!   usable and the mismatch is not fatal. Whether, and how much, a rank
//!   sends with its headers must follow from the fields the check compares
//!   (and the world size), so that ranks whose headers agree expect exactly
//!   what their peers sent.
//!
//! [BE-1]: self#invariants
//! [BE-2]: self#invariants

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, RwLock};
use std::time::Duration;

use crate::error::{Error, Result};
use crate::op::{OpKind, ReduceOp};
use crate::tensor::Tensor;
use crate::transport::Store;

/// The attribute a [`Backend`] implementation is written with
/// (`#[async_trait] impl Backend for MyBackend { .. }`), re-exported so
/// that an implementation outside Chorus uses the same version.
pub use async_trait::async_trait;

pub mod cpu;
#[cfg(feature = "gloo")]
pub mod gloo;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(any(feature = "gloo", feature = "mpi"))]
mod vendor;
#[cfg(any(feature = "nccl", feature = "rccl"))]
pub mod xccl;

/// Every backend Chorus knows: `(name, cargo feature that compiles it in)`;
/// `None` means always built.
pub const KNOWN: &[(&str, Option<&str>)] = &[
    ("cpu", None),
    ("nccl", Some("nccl")),
    ("rccl", Some("rccl")),
    ("gloo", Some("gloo")),
    ("mpi", Some("mpi")),
];

/// Names of the backends this process can create: those compiled into
/// this binary, then those registered with [`register_backend`].
pub fn available() -> Vec<&'static str> {
    let mut v = built_in();
    v.extend(registry().iter().map(|(name, _)| *name));
    v
}

/// Names of the backends compiled into this binary.
fn built_in() -> Vec<&'static str> {
    let mut v = vec!["cpu"];
    if cfg!(feature = "nccl") {
        v.push("nccl");
    }
    if cfg!(feature = "rccl") {
        v.push("rccl");
    }
    if cfg!(feature = "gloo") {
        v.push("gloo");
    }
    if cfg!(feature = "mpi") {
        v.push("mpi");
    }
    v
}

/// Whether backend `name` can run on `device` ([REG-3]): `nccl` and `rccl`
/// need [`Device::Cuda`](crate::Device::Cuda) (ROCm devices use the same
/// ordinal), every other backend [`Device::Cpu`](crate::Device::Cpu).
///
/// # Errors
/// A human-readable reason when the pair cannot work.
///
/// [REG-3]: self#invariants
pub fn check_device(name: &str, device: crate::Device) -> std::result::Result<(), String> {
    if registered(name).is_some() {
        // Its factory gets the device and decides.
        return Ok(());
    }
    let gpu = matches!(name, "nccl" | "rccl");
    match (gpu, device) {
        (true, crate::Device::Cuda(_)) | (false, crate::Device::Cpu) => Ok(()),
        (true, d) => Err(format!(
            "backend {name:?} runs on a GPU device (Device::Cuda(ordinal)), not {d}"
        )),
        (false, d) => Err(format!("backend {name:?} runs on the cpu device, not {d}")),
    }
}

/// Everything a backend needs to connect its ranks.
#[derive(Clone)]
pub struct BackendInit {
    /// Communicator name.
    pub comm: String,
    /// Store key prefix unique to this communicator instance and epoch
    /// (e.g. `comm/<name>#<k>/epoch/<e>`); every key a backend writes must start with it.
    pub key_prefix: String,
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// Epoch.
    pub epoch: u64,
    /// The rendezvous store shared by the ranks.
    pub store: Arc<dyn Store>,
    /// The job secret, used to authenticate data links.
    pub secret: Arc<[u8]>,
    /// How long connecting to every peer may take.
    pub connect_timeout: Duration,
    /// IP address to listen on and advertise for data links.
    pub bind_ip: std::net::IpAddr,
    /// When the data links open (backends with their own links).
    pub links: LinkPolicy,
    /// This rank's host identity, for backends that place ranks by host
    /// (the `cpu` backend: shared memory between ranks with equal ids, and
    /// hierarchical collectives when there are several hosts). `None`
    /// detects it: `CHORUS_HOST_ID`, else the machine and boot ids. Set it
    /// where the launcher knows the topology better, or to try a
    /// multi-host layout on one machine. `CHORUS_SHM=0` still turns shared
    /// memory and the hierarchy off.
    pub host_id: Option<String>,
    /// Peers found dead while this backend connects, by whoever creates it
    /// (a reconfigure watches the members of the epoch it starts; see
    /// [`PeerFailures`]). A backend that waits for its peers while it
    /// connects stops waiting when this reports, and fails with
    /// `PeerFailed` naming them. [`PeerFailures::none`] never reports.
    pub peers_failed: PeerFailures,
}

/// Peers found dead while a backend connects ([`BackendInit::peers_failed`]).
///
/// A communicator created by [`Comm::reconfigure`](crate::Comm::reconfigure)
/// watches its members while its backend connects: a member killed before it
/// published its address would otherwise be found only when
/// `connect_timeout` ran out. Cloning it gives another view of the same
/// report; it holds one report, O(failed ranks).
#[derive(Clone, Debug, Default)]
pub struct PeerFailures(Option<tokio::sync::watch::Receiver<Option<PeerReport>>>);

/// What a [`PeerFailures`] watch reports: the ranks found dead, and what
/// was observed.
pub type PeerReport = (Vec<usize>, String);

impl PeerFailures {
    /// A watch that never reports (what a communicator's first epoch, a
    /// split child, or a backend made by hand gets).
    pub fn none() -> PeerFailures {
        PeerFailures(None)
    }

    /// A watch and the sender that reports to it.
    pub(crate) fn channel() -> (tokio::sync::watch::Sender<Option<PeerReport>>, PeerFailures) {
        let (tx, rx) = tokio::sync::watch::channel(None);
        (tx, PeerFailures(Some(rx)))
    }

    /// Wait for a report: the ranks found dead and what was observed.
    /// Pending for ever when nothing will report (a watch of
    /// [`PeerFailures::none`], or one whose watcher ended without finding
    /// anyone), so it is meant to be raced against the wait it may cut
    /// short.
    pub async fn reported(&self) -> PeerReport {
        if let Some(rx) = &self.0 {
            let mut rx = rx.clone();
            let report = rx
                .wait_for(Option::is_some)
                .await
                .ok()
                .and_then(|v| v.clone());
            if let Some(report) = report {
                return report;
            }
        }
        std::future::pending().await
    }
}

/// When a backend opens its data links to its peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum LinkPolicy {
    /// Every link at creation on small communicators, where the first
    /// small op talks to every peer anyway (the `cpu` backend: up to 8
    /// ranks), and on demand above that; `CHORUS_LINKS` (`eager`, `lazy`
    /// or `auto`) overrides it.
    #[default]
    Auto,
    /// Every link at creation: a full mesh, and a peer that cannot be
    /// reached fails the creation.
    Eager,
    /// A link when an op first needs it: a rank holds links only to the
    /// peers its algorithms talk to.
    Lazy,
}

/// The environment variable that sets [`LinkPolicy::Auto`]'s choice.
pub const LINKS_ENV: &str = "CHORUS_LINKS";

impl LinkPolicy {
    /// The policy for a communicator of `size` ranks: `self` unless it is
    /// `Auto`, then [`LINKS_ENV`], then eager up to `eager_up_to` ranks.
    ///
    /// # Errors
    /// `Config` when [`LINKS_ENV`] holds anything but `eager`, `lazy` or
    /// `auto`.
    pub fn resolve(self, size: usize, eager_up_to: usize) -> Result<LinkPolicy> {
        if self != LinkPolicy::Auto {
            return Ok(self);
        }
        let by_size = if size <= eager_up_to {
            LinkPolicy::Eager
        } else {
            LinkPolicy::Lazy
        };
        match std::env::var(LINKS_ENV) {
            Err(_) => Ok(by_size),
            Ok(v) => match v.trim().to_ascii_lowercase().as_str() {
                "" | "auto" => Ok(by_size),
                "eager" => Ok(LinkPolicy::Eager),
                "lazy" => Ok(LinkPolicy::Lazy),
                other => Err(Error::Config(format!(
                    "{LINKS_ENV}={other:?}: expected eager, lazy or auto"
                ))),
            },
        }
    }
}

impl std::fmt::Debug for BackendInit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BackendInit")
            .field("comm", &self.comm)
            .field("key_prefix", &self.key_prefix)
            .field("rank", &self.rank)
            .field("size", &self.size)
            .field("epoch", &self.epoch)
            .field("bind_ip", &self.bind_ip)
            .field("links", &self.links)
            .field("host_id", &self.host_id)
            .finish_non_exhaustive()
    }
}

/// Identifies the op being run, for frames, errors and tracing.
#[derive(Debug, Clone)]
pub struct OpCtx {
    /// Communicator name (shared: building an op's context copies no
    /// string).
    pub comm: std::sync::Arc<str>,
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// Epoch.
    pub epoch: u64,
    /// Kind of op.
    pub kind: OpKind,
    /// Sequence number: the collective counter for collectives; for
    /// point-to-point, the per-peer counter is carried in [`P2PTransfer::seq`].
    pub seq: u64,
    /// The op's fingerprint ([`crate::checks::fingerprint`]) when its
    /// messages are to carry and check one
    /// ([`Capabilities::in_band_checks`]); 0 when they are not checked
    /// (the header exchange ran, or checks are off). For point-to-point,
    /// nonzero means each message carries its own
    /// [`crate::checks::p2p_fingerprint`].
    pub fingerprint: u64,
    /// Whether the header exchange ran for this op
    /// ([`Backend::exchange_headers`]): every rank had reached it. When
    /// false, a backend whose op relied on that for synchronisation (a
    /// barrier that moves no data) must synchronise the ranks itself.
    pub headers: bool,
    /// Whether the op may sleep in the kernel while it waits (a futex on a
    /// shared-memory ring). True when the turn runs on a thread that may
    /// block: a worker of Chorus's own runtime, or a caller blocked in a
    /// blocking op. False on a worker of the caller's runtime, where a wait
    /// must yield to the runtime instead.
    pub may_block: bool,
    /// Stream ordering asked for by the caller
    /// ([`Comm::with_stream`](crate::Comm::with_stream)); empty otherwise.
    pub order: StreamOrder,
}

/// How an op on device memory is ordered with the caller's stream
/// ([`Comm::with_stream`](crate::Comm::with_stream)).
#[derive(Debug, Clone, Default)]
pub struct StreamOrder {
    /// The op must wait for the work queued on this stream before it was
    /// issued (an event recorded there, and the communicator's stream made
    /// to wait for it), without blocking the host.
    pub wait_for: Option<crate::DeviceStream>,
    /// Where the backend publishes a fence once the op is enqueued, for
    /// [`Work::wait_stream`](crate::Work::wait_stream).
    pub fence: Option<Arc<crate::FenceSlot>>,
}

impl OpCtx {
    /// A `PeerFailed` error for this op.
    pub fn peer_failed(&self, failed: Vec<usize>, detail: impl Into<String>) -> Error {
        Error::PeerFailed {
            comm: self.comm.to_string(),
            rank: self.rank,
            epoch: self.epoch,
            op: self.kind.name(),
            failed_ranks: failed,
            detail: detail.into(),
        }
    }

    /// A `Corrupted` error for this op: bytes from `peer` failed their
    /// checksum.
    pub fn corrupted(&self, peer: usize, detail: impl Into<String>) -> Error {
        Error::Corrupted {
            comm: self.comm.to_string(),
            rank: self.rank,
            epoch: self.epoch,
            op: self.kind.name(),
            peer,
            detail: detail.into(),
        }
    }

    /// A fatal `Mismatch` error for this op (ranks out of step).
    pub fn mismatch(&self, detail: impl Into<String>) -> Error {
        Error::Mismatch {
            comm: self.comm.to_string(),
            rank: self.rank,
            op: self.kind.name(),
            seq: self.seq,
            epoch: self.epoch,
            detail: detail.into(),
            fatal: true,
        }
    }
}

/// Identifies an idle communicator polled for asynchronous errors ([BE-3]).
///
/// [BE-3]: self#invariants
#[derive(Debug, Clone)]
pub struct IdleCtx {
    /// Communicator name.
    pub comm: String,
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// Epoch.
    pub epoch: u64,
}

impl IdleCtx {
    /// The name errors found while idle carry as their op.
    pub const OP: &'static str = "async error poll";

    /// A `PeerFailed` error found while idle.
    pub fn peer_failed(&self, failed: Vec<usize>, detail: impl Into<String>) -> Error {
        Error::PeerFailed {
            comm: self.comm.clone(),
            rank: self.rank,
            epoch: self.epoch,
            op: Self::OP,
            failed_ranks: failed,
            detail: detail.into(),
        }
    }
}

/// How a backend forms the child communicator of a split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SplitMode {
    /// The library splits its own communicator ([`Backend::split`], e.g.
    /// `ncclCommSplit`).
    Native,
    /// The child connects from scratch through the store, like a new
    /// communicator.
    Reconnect,
    /// The backend cannot split: `split` fails with
    /// [`Error::NotSupported`] on every rank, before any exchange.
    Unsupported,
}

/// What a backend can do beyond the ops ([`Backend::capabilities`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Capabilities {
    /// How a split's child is formed.
    pub split: SplitMode,
    /// Whether `reconfigure` (a new epoch after a rank died or joined) and
    /// `join_comm` can form a communicator of a different size; if not,
    /// `reconfigure` fails with [`Error::NotSupported`] on every rank.
    pub elastic: bool,
    /// Whether the backend runs an all_gather whose own block already sits
    /// in the output ([`OpData::AllGather`]'s `in_place`) without a copy.
    /// If not, [`Comm::all_gather_in_place`](crate::Comm::all_gather_in_place)
    /// copies the block out first and runs an ordinary all_gather.
    pub in_place_all_gather: bool,
    /// Whether the backend carries the op's fingerprint
    /// ([`OpCtx::fingerprint`]) on every data message and checks it on
    /// every message it receives before using a byte, and receives a
    /// message only into a buffer of exactly its length. With
    /// [`Capabilities::headerless_ops`] too, the executor skips the header
    /// exchange of both all_to_all forms: such a backend sends one message
    /// per ordered pair of ranks, an empty one for an empty block, so that
    /// each pair's sizes are checked by the op, and it receives a list-form
    /// all_to_all ([`OpKind::AllToAll`]) with empty `recv_counts` and fills
    /// them, and the output, from the lengths of the messages.
    pub in_band_checks: bool,
    /// Whether the backend runs every op without the header exchange: a
    /// barrier synchronises by itself, and nothing else depends on the
    /// exchange having run. With [`Checks::Fingerprint`] or [`Checks::Off`]
    /// the executor then skips the exchange (but for window creation and
    /// release, and, unless the backend also checks in band, for both
    /// all_to_all forms: all_to_all_single's split sizes agree only pair by
    /// pair, and the list form sizes its output from the exchange); a
    /// backend that does not also check in band is checked
    /// asynchronously, by the history hashes its ranks announce with their
    /// heartbeats. A backend that leaves this false keeps the exchange in
    /// every mode.
    ///
    /// [`Checks::Fingerprint`]: crate::checks::Checks::Fingerprint
    /// [`Checks::Off`]: crate::checks::Checks::Off
    pub headerless_ops: bool,
    /// Whether the backend runs [`OpData::AllToAllList`], the list
    /// all_to_all straight from and into the caller's tensors. If not, the
    /// executor hands it an [`OpData::AllToAll`] over their concatenation.
    pub list_all_to_all: bool,
}

impl Default for Capabilities {
    /// Children reconnect through the store; elastic.
    fn default() -> Self {
        Capabilities {
            split: SplitMode::Reconnect,
            elastic: true,
            in_place_all_gather: false,
            in_band_checks: false,
            headerless_ops: false,
            list_all_to_all: false,
        }
    }
}

/// A native split as one parent rank sees it ([BE-4]).
///
/// [BE-4]: self#invariants
#[derive(Debug, Clone)]
pub struct SplitArgs {
    /// The child this rank joins; `None` on a rank that joins none (it
    /// still takes part: the library may need every parent rank).
    pub child: Option<SplitChild>,
    /// How long the split may take before it is abandoned.
    pub timeout: Duration,
}

/// The child a rank joins in a native split ([BE-4]).
///
/// [BE-4]: self#invariants
#[derive(Debug, Clone)]
pub struct SplitChild {
    /// The child's color, dense: `0..k` for the `k` children of this split,
    /// the same on every member of one child.
    pub color: u32,
    /// How the child connects: its name, key prefix, rank (members are
    /// ranked by the split's key, ties by parent rank, so `init.rank` is
    /// also the key to give the library) and size.
    pub init: BackendInit,
}

/// One point-to-point transfer of a batch.
#[derive(Debug)]
pub struct P2PTransfer {
    /// The other rank.
    pub peer: usize,
    /// Per-(peer) p2p sequence number of the batch this transfer belongs to.
    pub seq: u64,
    /// `true` to send `buf` to `peer`, `false` to receive into it.
    pub send: bool,
    /// The payload (send) or destination (receive), sized by the caller.
    pub buf: Tensor,
}

/// The buffers of one op, already validated and sized by the executor.
///
/// Every output buffer is allocated with its final size before `execute` is
/// called ([BE-1]); the backend only fills it.
///
/// [BE-1]: self#invariants
#[derive(Debug)]
pub enum OpData {
    /// In-place all-reduce of `buf`. `op` is the combining operator
    /// ([`ReduceOp::combine_op`]): pre/post scaling is done by the executor
    /// (for device tensors, `Avg` and `PremulSum` reach the backend as
    /// they are, see [`Backend::device_memory`]).
    AllReduce {
        /// Data in and result out.
        buf: Tensor,
        /// Combining operator.
        op: ReduceOp,
    },
    /// Reduce into `buf` on `root`. On other ranks `buf` is scratch.
    Reduce {
        /// Data in; result out on root.
        buf: Tensor,
        /// Combining operator.
        op: ReduceOp,
        /// Root rank.
        root: usize,
    },
    /// Reduce `input` (concatenation of one block per rank, sizes `counts`)
    /// and leave block `rank` in `output`. `input` may be used as scratch.
    ReduceScatter {
        /// All blocks.
        input: Tensor,
        /// This rank's reduced block (`counts[rank]` elements).
        output: Tensor,
        /// Block sizes per rank.
        counts: Vec<usize>,
        /// Combining operator.
        op: ReduceOp,
    },
    /// Gather every rank's `input` into `output` (blocks of `counts`).
    AllGather {
        /// This rank's block; empty when `in_place`.
        input: Tensor,
        /// Concatenation of all blocks.
        output: Tensor,
        /// Block sizes per rank.
        counts: Vec<usize>,
        /// This rank's block already sits at its place in `output`, and
        /// `input` is empty. Only a backend whose
        /// [`Capabilities::in_place_all_gather`] is true is given such an
        /// op; for the others the library copies the block into `input`.
        in_place: bool,
    },
    /// Broadcast `buf` from `root`.
    Broadcast {
        /// Data on root; destination elsewhere.
        buf: Tensor,
        /// Root rank.
        root: usize,
    },
    /// Root sends block `r` of `input` (equal blocks) to rank `r`'s `output`.
    Scatter {
        /// Concatenated blocks on root; empty elsewhere.
        input: Tensor,
        /// This rank's block.
        output: Tensor,
        /// Root rank.
        root: usize,
    },
    /// Every rank sends `input` to root, which stores rank `r`'s in block `r` of `output`.
    Gather {
        /// This rank's block.
        input: Tensor,
        /// Concatenated blocks on root; empty elsewhere.
        output: Tensor,
        /// Root rank.
        root: usize,
    },
    /// Block `send_counts[j]` of `input` goes to rank `j`; block `recv_counts[j]`
    /// of `output` comes from rank `j`.
    AllToAll {
        /// Concatenated send blocks.
        input: Tensor,
        /// Concatenated receive blocks.
        output: Tensor,
        /// Elements sent to each rank.
        send_counts: Vec<usize>,
        /// Elements received from each rank.
        recv_counts: Vec<usize>,
    },
    /// The list form into given outputs
    /// ([`Comm::all_to_all_into`](crate::Comm::all_to_all_into)): `inputs[j]`
    /// goes to rank `j`, and what rank `j` sends lands in `outputs[j]`, of
    /// exactly its length. Only a backend whose
    /// [`Capabilities::list_all_to_all`] is true is given it; for the
    /// others the executor concatenates the lists into an
    /// [`OpData::AllToAll`] and copies the result out.
    AllToAllList {
        /// One send block per rank.
        inputs: Vec<Tensor>,
        /// One receive block per rank.
        outputs: Vec<Tensor>,
    },
    /// Synchronise; the header exchange already did, nothing more to move.
    Barrier,
    /// A batch of point-to-point transfers, run concurrently; transfers with
    /// the same peer and direction are matched in order.
    P2P {
        /// The transfers.
        ops: Vec<P2PTransfer>,
    },
}

/// How a rank reaches a peer's window ([`WindowInfo::access`]), as
/// TorchComms' `TorchCommWindowAttr.access_type` says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WindowAccess {
    /// The peer's window memory is mapped into this process (this rank's
    /// own window, or a same-host peer's shared memory): a put is a copy.
    Unified,
    /// The peer's window is reached over the network: a put is sent and
    /// written by the peer's receiver.
    Separate,
}

/// One rank's view of a window, as [`WindowOp::Create`] returns it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowInfo {
    /// The window's id, the same on every rank (windows of a communicator
    /// are numbered in creation order).
    pub id: u64,
    /// Each rank's window size in bytes, by rank.
    pub sizes: Vec<usize>,
    /// How this rank reaches each rank's window, by rank.
    pub access: Vec<WindowAccess>,
}

/// A one-sided window op, as [`Backend::window`] gets it. Arguments are
/// validated above the trait: ranks are in range, and a put's range fits
/// the target's window as [`WindowInfo::sizes`] gives it.
#[derive(Debug)]
#[non_exhaustive]
pub enum WindowOp {
    /// Collective: allocate this rank's window of `size` bytes (zeroed) and
    /// connect it with every rank's. Runs after the header exchange, on
    /// every rank, in the same order.
    Create {
        /// This rank's window size in bytes (ranks may differ).
        size: usize,
    },
    /// Write `data`'s bytes into rank `dst`'s window at byte `offset`.
    /// Puts to one target land in issue order, before any later signal to
    /// that target.
    Put {
        /// Window id.
        window: u64,
        /// Target rank.
        dst: usize,
        /// Byte offset in the target's window.
        offset: usize,
        /// The bytes to write; handed back when the put completes.
        data: Tensor,
    },
    /// Add `value` to this rank's signal counter in `dst`'s window, after
    /// every earlier put to `dst`.
    Signal {
        /// Window id.
        window: u64,
        /// Target rank.
        dst: usize,
        /// Added to the counter.
        value: u64,
    },
    /// Wait until the signal counter `src` adds to in this rank's window
    /// reaches at least `value`; every put `src` issued before that signal
    /// is then visible.
    WaitSignal {
        /// Window id.
        window: u64,
        /// The signalling rank.
        src: usize,
        /// The counter value to reach.
        value: u64,
    },
    /// Collective: free window `window` on this rank (memory, files and
    /// connections). Runs after the header exchange, on every rank, in the
    /// same order; later ops on the window are refused.
    Free {
        /// Window id.
        window: u64,
    },
    /// Copy `len` bytes at byte `offset` of this rank's window out.
    Read {
        /// Window id.
        window: u64,
        /// Byte offset.
        offset: usize,
        /// Bytes to copy.
        len: usize,
    },
}

impl WindowOp {
    /// The op's name, for errors, hooks and tracing.
    pub fn name(&self) -> &'static str {
        match self {
            WindowOp::Create { .. } => "new_window",
            WindowOp::Free { .. } => "free_window",
            WindowOp::Put { .. } => "window_put",
            WindowOp::Signal { .. } => "window_signal",
            WindowOp::WaitSignal { .. } => "window_wait_signal",
            WindowOp::Read { .. } => "window_read",
        }
    }
}

/// What a [`WindowOp`] produced.
#[derive(Debug)]
#[non_exhaustive]
pub enum WindowDone {
    /// `Create`: the new window.
    Created(WindowInfo),
    /// `Put`: the data buffer, handed back; `Read`: the bytes read (`U8`).
    Buffer(Tensor),
    /// `Signal`, `WaitSignal`, `Free`.
    Done,
}

/// Device memory of one GPU, as a backend that runs ops on device tensors
/// provides it ([`Backend::device_memory`]): allocation and host ↔ device
/// copies for [`Comm::device_zeros`](crate::Comm::device_zeros),
/// [`Comm::to_device`](crate::Comm::to_device) and
/// [`Comm::to_host`](crate::Comm::to_host), and the device-side copies the
/// generic layer needs (outputs of `gather` and list-form `all_to_all`
/// split into per-rank tensors, `scatter`'s inputs concatenated).
///
/// Every call is synchronous: it returns when the copy finished, on a
/// stream of its own (never the communicator's), so it never orders
/// against an op in flight; callers only pass tensors that no op holds.
pub trait DeviceMemory: Send + Sync {
    /// The GPU this memory lives on.
    fn device(&self) -> crate::Device;

    /// A device tensor of `len` zeroed elements.
    ///
    /// # Errors
    /// The runtime's reason (out of device memory, ...).
    fn zeros(&self, dtype: crate::DType, len: usize) -> std::result::Result<Tensor, String>;

    /// Copy `len_bytes` bytes from `src` (at byte offset `src_off`) to
    /// `dst` (at `dst_off`); each side is host or device memory of this
    /// device, as the tensor says.
    ///
    /// # Errors
    /// The runtime's reason, or ranges outside the tensors.
    fn copy(
        &self,
        src: &Tensor,
        src_off: usize,
        dst: &mut Tensor,
        dst_off: usize,
        len_bytes: usize,
    ) -> std::result::Result<(), String>;
}

/// A device tensor holding the concatenation of `parts` (device tensors of
/// `dtype` on `mem`'s device).
pub(crate) fn device_concat(
    mem: &dyn DeviceMemory,
    dtype: crate::DType,
    parts: &[Tensor],
) -> std::result::Result<Tensor, String> {
    let lens: Vec<usize> = parts.iter().map(Tensor::len).collect();
    let total = crate::tensor::checked_sum(&lens).ok_or("sizes overflow usize")?;
    let mut out = mem.zeros(dtype, total)?;
    let mut off = 0;
    for p in parts {
        mem.copy(p, 0, &mut out, off, p.len_bytes())?;
        off += p.len_bytes();
    }
    Ok(out)
}

/// `t` (a device tensor on `mem`'s device) split into new device tensors of
/// `counts` elements.
pub(crate) fn device_split(
    mem: &dyn DeviceMemory,
    t: &Tensor,
    counts: &[usize],
) -> std::result::Result<Vec<Tensor>, String> {
    if crate::tensor::checked_sum(counts) != Some(t.len()) {
        return Err(format!("{counts:?} do not add up to {}", t.len()));
    }
    let es = t.dtype().size();
    let mut off = 0;
    let mut out = Vec::with_capacity(counts.len());
    for &c in counts {
        let mut part = mem.zeros(t.dtype(), c)?;
        mem.copy(t, off, &mut part, 0, c * es)?;
        off += c * es;
        out.push(part);
    }
    Ok(out)
}

/// A same-host peer reached over TCP instead of shared memory
/// ([`Backend::tcp_fallbacks`], [`Health::tcp_fallbacks`](crate::Health)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TcpFallback {
    /// The peer's rank.
    pub peer: usize,
    /// Why shared memory was not used with it.
    pub reason: String,
}

/// The same-host peers a backend reaches over TCP, shared between the
/// backend, which appends as its links open, and
/// [`Comm::health`](crate::Comm::health), which reads it. At most one entry
/// per peer: O(N).
pub type TcpFallbacks = Arc<std::sync::Mutex<Vec<TcpFallback>>>;

/// The data plane of one communicator on one rank.
///
/// Called only by the communicator's executor, one op at a time, in issue
/// order. See the module invariants [BE-1] and [BE-2]. Implement it (with
/// [`macro@async_trait`]) and [`register_backend`] a factory to run
/// communicators on your own data plane; the executor does everything
/// above moving bytes (validation, output sizing, the header check,
/// timeouts, scaling for `Avg` and `PremulSum`).
///
/// [BE-1]: self#invariants
/// [BE-2]: self#invariants
#[async_trait]
pub trait Backend: Send {
    /// Backend name, as given to `new_comm`.
    fn name(&self) -> &'static str;

    /// The backend's version, as [`Comm::backend_version`](crate::Comm::backend_version)
    /// reports it: the vendor library's where there is one. Asked once,
    /// when the communicator starts.
    fn version(&self) -> String {
        format!("{} (chorus {})", self.name(), env!("CARGO_PKG_VERSION"))
    }

    /// For each `(peer, seq, header)` in `outgoing`, send `header` to `peer`
    /// and receive one header from `peer`, all concurrently. `seq` is stamped
    /// on the frames and must match on the received one (the collective
    /// sequence number for collectives, the per-peer point-to-point sequence
    /// number for `P2P`). Returns the received `(peer, header)` in the order of
    /// `outgoing`.
    async fn exchange_headers(
        &mut self,
        ctx: &OpCtx,
        outgoing: Vec<(usize, u64, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>>;

    /// [`Backend::exchange_headers`] for an op whose buffers are `data`,
    /// so that a backend may send (part of) the op's payload in the same
    /// frames as its headers, and run a small op in one round trip ([BE-5]).
    /// The executor calls this, not `exchange_headers`, for every op with
    /// more than one rank. The default ignores `data` and calls
    /// [`Backend::exchange_headers`].
    ///
    /// [BE-5]: self#invariants
    async fn exchange_headers_with_data(
        &mut self,
        ctx: &OpCtx,
        outgoing: Vec<(usize, u64, Vec<u8>)>,
        data: &OpData,
    ) -> Result<Vec<(usize, Vec<u8>)>> {
        let _ = data;
        self.exchange_headers(ctx, outgoing).await
    }

    /// Move the data of one op. Called after the header check passed ([BE-1]).
    ///
    /// [BE-1]: self#invariants
    async fn execute(&mut self, ctx: &OpCtx, data: &mut OpData) -> Result<()>;

    /// Tell every peer this rank is aborting (best effort, bounded in time) and
    /// close all links. Idempotent. `failed` lists the ranks believed dead.
    async fn abort(&mut self, reason: &str, failed: &[usize]);

    /// [`Backend::abort`], told the error that aborted the communicator,
    /// if any. The default ignores it; the cpu backend tells its peers when
    /// the cause is a [`Error::Mismatch`], so that they report one too.
    async fn abort_for(&mut self, cause: Option<&Error>, reason: &str, failed: &[usize]) {
        let _ = cause;
        self.abort(reason, failed).await;
    }

    /// Close all links after a clean shutdown (every rank finalizing).
    async fn finalize(&mut self);

    /// Whether the library can fail on its own, between ops, so that the
    /// executor must poll [`Backend::poll_async_error`] while idle ([BE-3]).
    /// Read once, when the communicator starts.
    ///
    /// [BE-3]: self#invariants
    fn polls_async_errors(&self) -> bool {
        false
    }

    /// Report an error the library found asynchronously (a peer lost while
    /// no op ran, a device fault). Called by the executor between ops only,
    /// and only when [`Backend::polls_async_errors`]; must not block. An
    /// error is fatal: the executor aborts the communicator ([BE-2], [BE-3]).
    ///
    /// [BE-2]: self#invariants
    /// [BE-3]: self#invariants
    fn poll_async_error(&mut self, ctx: &IdleCtx) -> Result<()> {
        let _ = ctx;
        Ok(())
    }

    /// Same-host peers this rank reaches over TCP because shared memory
    /// could not be set up with them, and why (a ring file that could not
    /// be created or mapped). Asked once, when the communicator starts, for
    /// a list the backend appends to as its links open (they may open on
    /// demand, after creation); the default stays empty.
    /// [`Comm::health`](crate::Comm::health) reports them.
    fn tcp_fallbacks(&self) -> TcpFallbacks {
        TcpFallbacks::default()
    }

    /// Whether [`Backend::execute`] will leave this rank's buffer of `data`
    /// as it found it: a non-root rank of a `reduce` whose algorithm only
    /// sends its buffer (the `cpu` backend's one-step algorithm for small
    /// ops). The executor then lends the caller's tensor to the op instead
    /// of a working copy, which it otherwise makes so that a non-root
    /// caller gets its tensor back unchanged. Asked per op, before it runs;
    /// must not block. The default, `false`, is always correct.
    fn leaves_input_unchanged(&self, ctx: &OpCtx, data: &OpData) -> bool {
        let _ = (ctx, data);
        false
    }

    /// What this backend can do beyond the ops ([BE-4]). Asked once, when the
    /// communicator starts; must give the same answer on every rank of a
    /// communicator.
    ///
    /// [BE-4]: self#invariants
    fn capabilities(&self) -> Capabilities {
        Capabilities::default()
    }

    /// The device memory this backend runs ops on, if it takes device
    /// tensors (`nccl`, `rccl`); `None` (the default) means every device
    /// tensor is refused with `InvalidArgument` before it reaches the
    /// backend. Asked once, when the communicator starts. A backend that
    /// returns `Some` gets device tensors of that device only, never mixed
    /// with host tensors in one op, and for reductions on them the user's
    /// own `Avg` or `PremulSum` in [`OpData`] (the host cannot scale device
    /// memory); it must keep every device tensor's memory alive until the
    /// op finished on the device, or its communicator was aborted.
    fn device_memory(&self) -> Option<Arc<dyn DeviceMemory>> {
        None
    }

    /// Split this communicator with the library's own call ([BE-4]). Called on
    /// every parent rank, in the same order relative to the parent's ops,
    /// only when [`Capabilities::split`] is [`SplitMode::Native`]. Returns the child's backend,
    /// connected, on a rank with [`SplitArgs::child`], `None` on the others.
    ///
    /// # Errors
    /// Whatever the library or the child's connection reports; fatal for
    /// the parent.
    ///
    /// [BE-4]: self#invariants
    async fn split(&mut self, args: SplitArgs) -> Result<Option<Box<dyn Backend>>> {
        let _ = args;
        Err(Error::Internal(format!(
            "backend {} has no native split",
            self.name()
        )))
    }

    /// Whether this backend implements one-sided windows ([`Backend::window`]).
    /// Asked once, when the communicator starts; must give the same answer
    /// on every rank. When false, `Comm::new_window` fails with
    /// [`Error::UnsupportedOp`] before any I/O.
    fn supports_windows(&self) -> bool {
        false
    }

    /// Run one window op ([`WindowOp`]). `Create` and `Free` are
    /// collective and run after the header exchange; the others are
    /// one-sided and run without one, in this rank's issue order. Called only when
    /// [`Backend::supports_windows`]; the default refuses every op.
    ///
    /// # Errors
    /// `UnsupportedOp` by default. Otherwise as [`Backend::execute`]; a
    /// `WaitSignal` whose source died is `PeerFailed`.
    async fn window(&mut self, ctx: &OpCtx, op: WindowOp) -> Result<WindowDone> {
        let _ = ctx;
        Err(Error::UnsupportedOp {
            op: format!(
                "{} (one-sided windows) on backend {}",
                op.name(),
                self.name()
            ),
            dtype: crate::tensor::DType::U8,
        })
    }
}

/// The future a [`BackendFactory`] returns: the connected backend.
pub type BackendFuture = Pin<Box<dyn Future<Output = Result<Box<dyn Backend>>> + Send>>;

/// Creates one rank's backend of a registered name ([`register_backend`]):
/// given the communicator's device and how to connect ([`BackendInit`]),
/// connect to the other ranks and return the backend.
pub type BackendFactory = Arc<dyn Fn(crate::Device, BackendInit) -> BackendFuture + Send + Sync>;

/// The registered backends, in registration order ([REG-4]).
///
/// [REG-4]: self#invariants
static REGISTRY: RwLock<Vec<(&'static str, BackendFactory)>> = RwLock::new(Vec::new());

fn registry() -> std::sync::RwLockReadGuard<'static, Vec<(&'static str, BackendFactory)>> {
    // A panic while holding the lock cannot leave the list half-written
    // (a push is the only write), so a poisoned lock is still sound.
    REGISTRY.read().unwrap_or_else(|e| e.into_inner())
}

fn registered(name: &str) -> Option<BackendFactory> {
    registry()
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, f)| f.clone())
}

/// Register a backend under `name`, so that [`new_comm`](crate::new_comm)
/// `(name, ..)` (and [`join_comm`](crate::join_comm)) create communicators
/// on it: a service's own data plane, or a fake for unit tests. See
/// [`Backend`] for the contract an implementation keeps, and
/// `docs/backends.md` for a walk-through.
///
/// `factory` is called once per communicator on each rank: by `new_comm`,
/// by every [`split`](crate::Comm::split) child (unless the backend's
/// [`Capabilities::split`] is [`SplitMode::Native`] or
/// [`SplitMode::Unsupported`]) and by every new epoch of
/// [`reconfigure`](crate::Comm::reconfigure). It gets the communicator's
/// device, which it may refuse (with [`Error::BackendUnavailable`], say),
/// and a [`BackendInit`] whose store and key prefix it uses to find its peers.
/// A registration lasts as long as the process.
///
/// ```
/// use chorus::backends::{Backend, BackendInit};
///
/// async fn connect(init: BackendInit) -> chorus::Result<Box<dyn Backend>> {
///     // A real data plane connects its ranks here; this one is Chorus's own.
///     Ok(Box::new(chorus::backends::cpu::CpuBackend::connect(init).await?))
/// }
/// chorus::register_backend("my-net", |_device, init| connect(init))?;
/// let comm = chorus::new_comm("my-net", chorus::Device::Cpu, "reg-doc", chorus::CommOptions::single())?;
/// assert_eq!(comm.backend(), "cpu"); // the name the backend reports
/// comm.finalize()?;
/// # Ok::<(), chorus::Error>(())
/// ```
///
/// # Errors
/// [`Error::Config`] if `name` is empty or contains `/`, is the name of a
/// backend Chorus has (built in or behind a cargo feature, [`KNOWN`]), or
/// is already registered; nothing is registered then.
pub fn register_backend<F, Fut>(name: &str, factory: F) -> Result<()>
where
    F: Fn(crate::Device, BackendInit) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = Result<Box<dyn Backend>>> + Send + 'static,
{
    let refuse = |why: String| {
        Err(Error::Config(format!(
            "cannot register backend {name:?}: {why}"
        )))
    };
    if name.is_empty() || name.contains('/') {
        return refuse("a backend name must be non-empty and contain no '/'".into());
    }
    if KNOWN.iter().any(|(known, _)| *known == name) {
        return refuse("Chorus has a backend of that name; pick another".into());
    }
    let mut reg = REGISTRY.write().unwrap_or_else(|e| e.into_inner());
    if reg.iter().any(|(n, _)| *n == name) {
        return refuse("it is already registered".into());
    }
    // Backend names are `&'static str` throughout (errors, `Comm::backend`);
    // registrations are few and last as long as the process.
    let name: &'static str = Box::leak(name.to_string().into_boxed_str());
    let factory: BackendFactory = Arc::new(move |device, init| Box::pin(factory(device, init)));
    reg.push((name, factory));
    tracing::info!(backend = name, "backend registered");
    Ok(())
}

/// Vendor worker threads (one per live `gloo` or `mpi` communicator) that
/// have not ended yet in this process; 0 without those features. Finalize
/// and abort end them (VW-2), except a worker still inside a vendor call
/// when its communicator was aborted, which ends when that call returns.
pub fn live_vendor_workers() -> usize {
    #[cfg(any(feature = "gloo", feature = "mpi"))]
    {
        vendor::live_workers()
    }
    #[cfg(not(any(feature = "gloo", feature = "mpi")))]
    {
        0
    }
}

/// Create and connect the backend called `name` on the cpu device.
pub async fn create(name: &str, init: BackendInit) -> Result<Box<dyn Backend>> {
    create_on(name, crate::Device::Cpu, init).await
}

/// Create and connect the backend called `name` for `device` ([REG-1]..3).
///
/// [REG-1]: self#invariants
pub async fn create_on(
    name: &str,
    device: crate::Device,
    init: BackendInit,
) -> Result<Box<dyn Backend>> {
    check_name(name)?;
    if let Some(factory) = registered(name) {
        return factory(device, init).await;
    }
    let _ = device;
    match name {
        "cpu" => Ok(Box::new(cpu::CpuBackend::connect(init).await?)),
        #[cfg(feature = "nccl")]
        "nccl" => Ok(Box::new(
            xccl::XcclBackend::connect(xccl::Flavor::Nccl, device, init).await?,
        )),
        #[cfg(feature = "rccl")]
        "rccl" => Ok(Box::new(
            xccl::XcclBackend::connect(xccl::Flavor::Rccl, device, init).await?,
        )),
        #[cfg(feature = "gloo")]
        "gloo" => Ok(Box::new(gloo::connect(init).await?)),
        #[cfg(feature = "mpi")]
        "mpi" => Ok(Box::new(mpi::connect(init).await?)),
        other => Err(Error::UnknownBackend {
            name: other.to_string(),
            available: available(),
        }),
    }
}

/// Whether `name` is a backend that this binary knows and has compiled in,
/// before any I/O ([REG-1], [REG-2]).
///
/// # Errors
/// `UnknownBackend` for a name Chorus does not know; `BackendUnavailable`
/// naming the cargo feature for a known backend that was not compiled in.
///
/// [REG-1]: self#invariants
/// [REG-2]: self#invariants
pub fn check_name(name: &str) -> Result<()> {
    if available().contains(&name) {
        return Ok(());
    }
    match KNOWN.iter().find(|(n, _)| *n == name) {
        Some((known, Some(feature))) => Err(Error::BackendUnavailable {
            backend: known,
            reason: format!(
                "chorus was built without its `{feature}` cargo feature; rebuild with \
                 `--features {feature}` (see docs/backends.md for what it needs)"
            ),
        }),
        _ => Err(Error::UnknownBackend {
            name: name.to_string(),
            available: available(),
        }),
    }
}

#[cfg(test)]
mod registry_tests {
    use super::*;

    #[test]
    fn reg_1_unknown_name_lists_available() {
        match check_name("nope") {
            Err(Error::UnknownBackend { name, available }) => {
                assert_eq!(name, "nope");
                assert!(available.contains(&"cpu"));
            }
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn reg_2_known_but_not_compiled_names_the_feature() {
        for (name, feature) in KNOWN {
            let r = check_name(name);
            match feature {
                Some(f) if !available().contains(name) => match r {
                    Err(Error::BackendUnavailable { backend, reason }) => {
                        assert_eq!(backend, *name);
                        assert!(reason.contains(&format!("--features {f}")), "{reason}");
                    }
                    other => panic!("{name}: {other:?}"),
                },
                _ => assert!(r.is_ok(), "{name}: {r:?}"),
            }
        }
    }

    #[test]
    fn reg_3_gpu_backends_need_a_gpu_device_and_others_the_cpu() {
        use crate::Device;
        assert!(check_device("cpu", Device::Cpu).is_ok());
        assert!(check_device("cpu", Device::Cuda(0)).is_err());
        assert!(check_device("gloo", Device::Cpu).is_ok());
        assert!(check_device("mpi", Device::Cuda(0)).is_err());
        assert!(check_device("nccl", Device::Cuda(1)).is_ok());
        assert!(check_device("rccl", Device::Cuda(0)).is_ok());
        assert!(check_device("nccl", Device::Cpu).is_err());
    }
}
