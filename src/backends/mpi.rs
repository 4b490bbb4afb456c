//! The `mpi` backend: collectives through the system MPI (Open MPI) via
//! rsmpi, for jobs launched by `mpirun`.
//!
//! Each communicator duplicates `MPI_COMM_WORLD` (so two communicators never
//! match each other's messages) and runs every op as the matching MPI
//! collective, on the communicator's vendor worker thread
//! (`super::vendor`): a dedicated OS thread that owns the duplicated
//! communicator, so no runtime thread ever blocks in MPI.
//!
//! # Invariants
//! - MP-1: MPI owns rank and size: the world rank/size must equal the ones
//!   Chorus bootstrapped with (`CommOptions` or the launcher's environment,
//!   `OMPI_COMM_WORLD_RANK/SIZE` under mpirun), else `new_comm` fails with
//!   `Config` before any collective.
//! - MP-2: MPI is initialised once per process (`MPI_THREAD_MULTIPLE` asked,
//!   at least `SERIALIZED` required, also when the application initialised
//!   it) and finalised by [`shutdown`], which is also registered with
//!   `atexit` when this backend initialises MPI (mpirun reports a process
//!   that exits without `MPI_Finalize` as failed). Communicators still alive
//!   then are leaked, not freed. `shutdown` skips `MPI_Finalize` while an
//!   MPI call is still in flight (a worker left in a call by an abort, [MP-3]),
//!   which would otherwise hang or be undefined.
//! - MP-3: `abort` never calls `MPI_Abort` (which kills the whole job): it
//!   aborts the control mesh and stops using the MPI communicator; later ops
//!   fail `Aborted` without touching MPI (VW-3). A blocking MPI call cannot
//!   be interrupted: if one is in flight, `abort` returns without waiting
//!   for it, and the worker thread ends (leaking the communicator, which a
//!   peer may still use) only if MPI ever returns — Open MPI usually tears
//!   the job down when a rank dies.
//! - MP-4: f16 and bf16 have no MPI datatype: reductions on them are done
//!   in f64 (exact for every value they hold) and rounded back once; data
//!   movement is byte-wise for every dtype.
//! - MP-5: the header exchange, abort notices and finalize run over a
//!   `CpuBackend` control mesh, like every vendor backend (the shared
//!   `super::vendor::VendorBackend`).
//! - MP-6: each communicator calls MPI from its own worker thread, so
//!   several threads may call MPI at once. At `MPI_THREAD_MULTIPLE` that is
//!   allowed: ops start under a process-wide lock and complete in `MPI_Wait`
//!   without it. At `SERIALIZED` (or with `CHORUS_MPI_SERIALIZE=1`) every
//!   MPI call is made under that lock, and no call blocks while holding it:
//!   ops (and the communicator's duplication) are started non-blocking and
//!   completed by `MPI_Test` under the lock, yielding between tests. A
//!   blocking collective held under a lock could deadlock two communicators
//!   whose ops ranks run in different orders; polling cannot.
//! - MP-7: `split` is `MPI_Comm_split` of the parent's communicator, called
//!   by every parent rank on the parent's worker (a rank that joins no
//!   child passes `MPI_UNDEFINED`), the child's color and rank being the
//!   ones Chorus agreed on; the child's communicator then moves to the
//!   child's own worker thread. MPI has no non-blocking split, so at
//!   `SERIALIZED` the split blocks under the lock: until every parent rank
//!   reached it, this process's other `mpi` communicators wait.
//!   `reconfigure` stays refused with `NotSupported` ([MP-1]).
//!
//! [MP-1]: self#invariants
//! [MP-3]: self#invariants

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};

use mpi::collective::SystemOperation;
use mpi::datatype::{Partition, PartitionMut};
use mpi::environment::Universe;
use mpi::raw::{AsRaw, FromRaw};
use mpi::request::{Request, Scope};
use mpi::topology::{Color, SimpleCommunicator};
use mpi::traits::*;
use mpi::Threading;

use super::vendor::{OpenChild, VendorBackend, VendorComm};
use super::{BackendInit, OpCtx, OpData, SplitChild};
use crate::error::{Error, Result};
use crate::op::ReduceOp;
use crate::tensor::{DType, Tensor};

/// This process's MPI state, behind [`PROCESS`], whose lock is also the
/// lock MPI calls are made under ([MP-6]).
///
/// [MP-6]: self#invariants
struct Process {
    /// Set when this backend initialised MPI; dropping it is `MPI_Finalize`.
    universe: Option<Universe>,
    /// How to call MPI, once initialised.
    calls: Option<Calls>,
}
// SAFETY: the universe is only created and dropped (MPI_Finalize) under the
// mutex; MPI is initialised with at least MPI_THREAD_SERIALIZED.
unsafe impl Send for Process {}

static PROCESS: Mutex<Process> = Mutex::new(Process {
    universe: None,
    calls: None,
});

/// MPI ops (and communicator duplications) started and not yet completed.
static IN_FLIGHT: AtomicUsize = AtomicUsize::new(0);

/// The process-wide MPI lock. A panic while it was held leaves nothing
/// half-done in `Process`, so poisoning is ignored.
fn lock() -> MutexGuard<'static, Process> {
    PROCESS.lock().unwrap_or_else(PoisonError::into_inner)
}

/// How this process calls MPI ([MP-6]).
///
/// [MP-6]: self#invariants
#[derive(Debug, Clone, Copy)]
struct Calls {
    /// Every MPI call under [`lock`], none blocking (below `MULTIPLE`).
    serialize: bool,
}

impl Calls {
    /// Complete `req`: `MPI_Wait` without the lock at `MULTIPLE`, else
    /// `MPI_Test` under the lock until done, yielding between tests.
    fn complete<'a, D: ?Sized + 'a, S: Scope<'a>>(self, mut req: Request<'a, D, S>) {
        if !self.serialize {
            req.wait_without_status();
            return;
        }
        loop {
            let tested = {
                let _g = lock();
                req.test()
            };
            match tested {
                Ok(_) => return,
                Err(r) => req = r,
            }
            std::thread::yield_now();
        }
    }

    /// Start one request under the lock, then complete it.
    fn run<'a, D: ?Sized + 'a, S: Scope<'a>>(self, start: impl FnOnce() -> Request<'a, D, S>) {
        let req = {
            let _g = lock();
            start()
        };
        self.complete(req);
    }

    /// Mark an MPI op in flight until the guard drops, or fail if MPI was
    /// finalised ([MP-2]).
    ///
    /// [MP-2]: self#invariants
    fn begin(self, what: impl FnOnce() -> String) -> Result<InFlight> {
        let _g = lock();
        if mpi::is_finalized() {
            return Err(Error::BackendUnavailable {
                backend: "mpi",
                reason: format!(
                    "{}: MPI was already finalized in this process \
                     (chorus::backends::mpi::shutdown)",
                    what()
                ),
            });
        }
        IN_FLIGHT.fetch_add(1, Ordering::AcqRel);
        Ok(InFlight)
    }
}

/// One MPI op in flight ([`IN_FLIGHT`]).
struct InFlight;

impl Drop for InFlight {
    fn drop(&mut self) {
        IN_FLIGHT.fetch_sub(1, Ordering::AcqRel);
    }
}

/// Initialise MPI for this process if needed ([MP-2]); how to call it ([MP-6]).
///
/// [MP-2]: self#invariants
/// [MP-6]: self#invariants
fn ensure_initialized() -> Result<Calls> {
    let mut p = lock();
    if let Some(c) = p.calls {
        if !mpi::is_finalized() {
            return Ok(c);
        }
    }
    if mpi::is_finalized() {
        return Err(Error::BackendUnavailable {
            backend: "mpi",
            reason: "MPI was already finalized in this process (chorus::backends::mpi::shutdown)"
                .into(),
        });
    }
    let provided = match mpi::initialize_with_threading(Threading::Multiple) {
        Some((u, provided)) => {
            p.universe = Some(u);
            // SAFETY: registering a plain extern "C" function.
            if unsafe { atexit(finalize_at_exit) } != 0 {
                tracing::warn!("mpi: cannot register MPI_Finalize at exit; call chorus::backends::mpi::shutdown()");
            }
            provided
        }
        // Initialised by someone else (e.g. the application): use it.
        None => mpi::environment::threading_support(),
    };
    if matches!(provided, Threading::Single | Threading::Funneled) {
        return Err(Error::BackendUnavailable {
            backend: "mpi",
            reason: format!(
                "MPI provides thread level {provided:?}; Chorus calls MPI from one thread per \
                 communicator and needs at least Serialized"
            ),
        });
    }
    let forced = std::env::var("CHORUS_MPI_SERIALIZE").is_ok_and(|v| v == "1");
    let calls = Calls {
        serialize: forced || provided != Threading::Multiple,
    };
    tracing::debug!(?provided, serialize = calls.serialize, "mpi initialised");
    p.calls = Some(calls);
    Ok(calls)
}

extern "C" {
    fn atexit(cb: extern "C" fn()) -> std::ffi::c_int;
}

extern "C" fn finalize_at_exit() {
    // Never unwind out of an atexit handler.
    let _ = std::panic::catch_unwind(shutdown);
}

/// Finalise MPI if this backend initialised it ([MP-2]). Call once, at the
/// end of the process, after every `mpi` communicator was finalized and
/// dropped. Idempotent. While an MPI call is still in flight (a
/// communicator aborted in the middle of an op, [MP-3]), MPI is left
/// initialised and a warning is logged.
///
/// [MP-2]: self#invariants
/// [MP-3]: self#invariants
pub fn shutdown() {
    let mut p = lock();
    if p.universe.is_none() {
        return;
    }
    let busy = IN_FLIGHT.load(Ordering::Acquire);
    if busy > 0 {
        tracing::warn!(
            calls = busy,
            "mpi: MPI calls are still in flight (a communicator was aborted mid-op); \
             not calling MPI_Finalize"
        );
        return;
    }
    p.universe.take();
}

/// The world size when this process was started by `mpirun` (Open MPI's
/// environment), for tests that only make sense under a launcher.
pub fn launched_world_size() -> Option<usize> {
    std::env::var("OMPI_COMM_WORLD_SIZE")
        .ok()
        .or_else(|| std::env::var("PMI_SIZE").ok())
        .and_then(|s| s.parse().ok())
}

/// The duplicated MPI communicator of one Chorus communicator on one rank,
/// owned by its vendor worker thread (VW-1).
pub(crate) struct MpiComm {
    comm: Option<SimpleCommunicator>,
    rank: usize,
    calls: Calls,
}

/// A split's child communicator on its way from the parent's worker thread
/// to the child's ([MP-7]). If it is dropped on the way (the child's worker
/// could not start), the handle is leaked, never freed.
///
/// [MP-7]: self#invariants
struct RawComm(mpi::ffi::MPI_Comm);
// SAFETY: an MPI handle is valid on every thread of the process; it is
// used by one thread at a time (the child's worker, VW-1).
unsafe impl Send for RawComm {}

/// The MPI backend of one communicator on one rank.
pub(crate) type MpiBackend = VendorBackend<MpiComm>;

fn op_of(op: ReduceOp) -> SystemOperation {
    match op.combine_op() {
        ReduceOp::Product => SystemOperation::product(),
        ReduceOp::Min => SystemOperation::min(),
        ReduceOp::Max => SystemOperation::max(),
        ReduceOp::BAnd => SystemOperation::bitwise_and(),
        ReduceOp::BOr => SystemOperation::bitwise_or(),
        ReduceOp::BXor => SystemOperation::bitwise_xor(),
        _ => SystemOperation::sum(),
    }
}

// SAFETY: `Bool` is `#[repr(transparent)]` over `u8`, so MPI's `u8`
// datatype describes its memory exactly.
unsafe impl Equivalence for crate::tensor::Bool {
    type Out = <u8 as Equivalence>::Out;
    fn equivalent_datatype() -> Self::Out {
        u8::equivalent_datatype()
    }
}

/// Run `$body` with `$T` bound to the Rust type of an MPI-typed dtype.
macro_rules! typed {
    ($dt:expr, $T:ident => $body:expr, half => $half:expr) => {
        match $dt {
            DType::I8 => {
                type $T = i8;
                $body
            }
            DType::U8 => {
                type $T = u8;
                $body
            }
            // 0/1 bytes, reduced with max/min/bxor (combine_op_on).
            DType::Bool => {
                type $T = crate::tensor::Bool;
                $body
            }
            DType::I32 => {
                type $T = i32;
                $body
            }
            DType::U32 => {
                type $T = u32;
                $body
            }
            DType::I64 => {
                type $T = i64;
                $body
            }
            DType::U64 => {
                type $T = u64;
                $body
            }
            DType::F32 => {
                type $T = f32;
                $body
            }
            DType::F64 => {
                type $T = f64;
                $body
            }
            DType::F16 | DType::BF16 => $half,
        }
    };
}

/// Counts and displacements in bytes, as MPI `Count`s.
fn partition(ctx: &OpCtx, counts: &[usize], esize: usize) -> Result<(Vec<i32>, Vec<i32>)> {
    let mut c = Vec::with_capacity(counts.len());
    let mut d = Vec::with_capacity(counts.len());
    let mut off: usize = 0;
    for &n in counts {
        let bytes = n * esize;
        let too_big = |_| Error::InvalidArgument {
            comm: ctx.comm.to_string(),
            rank: ctx.rank,
            op: ctx.kind.name(),
            reason: "mpi: a block or offset exceeds 2 GiB, MPI's int count limit".into(),
        };
        c.push(i32::try_from(bytes).map_err(too_big)?);
        d.push(i32::try_from(off).map_err(too_big)?);
        off += bytes;
    }
    Ok((c, d))
}

/// Start the worker thread; on it, initialise MPI if needed, check
/// rank/size ([MP-1]) and duplicate the world communicator; then connect the
/// control mesh.
///
/// # Errors
/// `BackendUnavailable` if MPI cannot start; `Config` if MPI's world
/// disagrees with Chorus's rank/size; control-mesh errors as `cpu`.
///
/// [MP-1]: self#invariants
pub(crate) async fn connect(init: BackendInit) -> Result<MpiBackend> {
    let (name, rank, size) = (init.comm.clone(), init.rank, init.size);
    VendorBackend::connect(init, move || {
        let calls = ensure_initialized()?;
        let _in_flight = calls.begin(|| format!("communicator {name:?}"))?;
        let world = SimpleCommunicator::world();
        let (wr, ws) = {
            let _g = lock();
            (world.rank() as usize, world.size() as usize)
        };
        if (wr, ws) != (rank, size) {
            return Err(Error::Config(format!(
                "mpi backend: MPI says rank {wr} of {ws} but communicator {name:?} was created as \
                 rank {rank} of {size}; launch with mpirun and let Chorus read \
                 OMPI_COMM_WORLD_RANK/SIZE"
            )));
        }
        Ok(MpiComm {
            comm: Some(duplicate(calls, &world)),
            rank,
            calls,
        })
    })
    .await
}

/// `MPI_Comm_dup(world)`, blocking at `MULTIPLE`; at `SERIALIZED`,
/// `MPI_Comm_idup` tested under the lock ([MP-6]).
///
/// [MP-6]: self#invariants
fn duplicate(calls: Calls, world: &SimpleCommunicator) -> SimpleCommunicator {
    if !calls.serialize {
        return world.duplicate();
    }
    // SAFETY: plain MPI calls on valid handles, made under the lock; `new`
    // is only read after the request completed.
    unsafe {
        let mut new = mpi::ffi::RSMPI_COMM_NULL;
        let mut req = mpi::ffi::RSMPI_REQUEST_NULL;
        {
            let _g = lock();
            mpi::ffi::MPI_Comm_idup(world.as_raw(), &mut new, &mut req);
        }
        loop {
            let mut done: std::ffi::c_int = 0;
            {
                let _g = lock();
                mpi::ffi::MPI_Test(&mut req, &mut done, mpi::ffi::RSMPI_STATUS_IGNORE);
            }
            if done != 0 {
                break;
            }
            std::thread::yield_now();
        }
        SimpleCommunicator::from_raw(new)
    }
}

impl VendorComm for MpiComm {
    const NAME: &'static str = "mpi";
    // MP-7: a split is MPI_Comm_split of the parent. MP-1: a new epoch
    // without a dead rank cannot be formed (MPI's world is fixed).
    const CAPABILITIES: super::Capabilities = super::Capabilities {
        split: super::SplitMode::Native,
        elastic: false,
        in_place_all_gather: false,
        in_band_checks: false,
        list_all_to_all: false,
        // The exchange stays, as a guard: with its default error handler
        // (MPI_ERRORS_ARE_FATAL) Open MPI ends the job on MPI_ERR_TRUNCATE,
        // so ranks whose sizes disagree must be stopped before MPI is
        // called (docs/backends.md, "Control mesh").
        headerless_ops: false,
    };

    fn split(&mut self, child: Option<SplitChild>) -> Result<Option<OpenChild<Self>>> {
        let me = self.rank;
        let fail = |what: String| Error::Internal(format!("mpi split (parent rank {me}): {what}"));
        let Some(comm) = &self.comm else {
            return Err(fail("the parent communicator is closed".into()));
        };
        let (color, key) = match &child {
            Some(c) => (
                Color::with_value(
                    i32::try_from(c.color)
                        .map_err(|_| fail(format!("color {} too large", c.color)))?,
                ),
                i32::try_from(c.init.rank).map_err(|_| fail("child rank too large".into()))?,
            ),
            // MPI_Comm_split is collective over the parent: non-members take
            // part with MPI_UNDEFINED.
            None => (Color::undefined(), 0),
        };
        let _in_flight = self.calls.begin(|| format!("split of parent rank {me}"))?;
        // MPI has no non-blocking split: at SERIALIZED it is called under
        // the lock (MP-7).
        let new = if self.calls.serialize {
            let _g = lock();
            comm.split_by_color_with_key(color, key)
        } else {
            comm.split_by_color_with_key(color, key)
        };
        let (new, child) = match (new, child) {
            (None, None) => return Ok(None),
            (Some(new), Some(child)) => (new, child),
            (Some(new), None) => {
                std::mem::forget(new);
                return Err(fail("MPI gave a child to a rank without a color".into()));
            }
            (None, Some(_)) => return Err(fail("MPI gave a member no child".into())),
        };
        let (rank, size) = {
            let _g = lock();
            (new.rank() as usize, new.size() as usize)
        };
        if (rank, size) != (child.init.rank, child.init.size) {
            // Peers may already use it: leak rather than free.
            std::mem::forget(new);
            return Err(fail(format!(
                "MPI made this rank {rank} of {size} in child {:?}, Chorus expected {} of {}",
                child.init.comm, child.init.rank, child.init.size
            )));
        }
        let raw = RawComm(new.as_raw());
        // The handle moves to the child's worker, which frees it (VW-1).
        std::mem::forget(new);
        let calls = self.calls;
        Ok(Some(Box::new(move || {
            let raw = raw;
            Ok(MpiComm {
                // SAFETY: `raw` is the live intra-communicator MPI_Comm_split
                // returned; nothing else owns it.
                comm: Some(unsafe { SimpleCommunicator::from_raw(raw.0) }),
                rank,
                calls,
            })
        })))
    }

    fn run(&mut self, ctx: &OpCtx, data: &mut OpData) -> Result<()> {
        let Some(comm) = &self.comm else {
            return Err(Error::Internal(format!(
                "mpi communicator {:?} (rank {}) is closed",
                ctx.comm, ctx.rank
            )));
        };
        let _in_flight = self.calls.begin(|| {
            format!(
                "communicator {:?} (rank {}, epoch {}): {} (seq {})",
                ctx.comm,
                ctx.rank,
                ctx.epoch,
                ctx.kind.name(),
                ctx.seq
            )
        })?;
        run(self.calls, comm, self.rank, ctx, data)
    }

    fn close(mut self, aborted: bool) {
        if let Some(c) = self.comm.take() {
            let _g = lock();
            if aborted || mpi::is_finalized() {
                // Freeing a communicator after MPI_Finalize (or one a peer may
                // still be using after an abort) is undefined: leak it.
                std::mem::forget(c);
            } else {
                drop(c);
            }
        }
    }
}

impl Drop for MpiComm {
    fn drop(&mut self) {
        // Only reached without `close` if the worker unwound: leak (MP-3).
        if let Some(c) = self.comm.take() {
            std::mem::forget(c);
        }
    }
}

/// Run one op: started non-blocking under the lock, then completed ([MP-6]).
///
/// [MP-6]: self#invariants
fn run(
    calls: Calls,
    comm: &SimpleCommunicator,
    me: usize,
    ctx: &OpCtx,
    data: &mut OpData,
) -> Result<()> {
    // Empty buffers: Open MPI rejects the dangling pointers of empty
    // slices in some collectives; the counts were matched by the header
    // exchange, so every rank skips together.
    match data {
        OpData::AllReduce { buf, .. }
        | OpData::Reduce { buf, .. }
        | OpData::Broadcast { buf, .. }
            if buf.is_empty() =>
        {
            return Ok(());
        }
        OpData::ReduceScatter { input, .. } if input.is_empty() => return Ok(()),
        _ => {}
    }
    match data {
        OpData::AllToAllList { .. } => return Err(Error::Internal("the list all_to_all reaches this backend as an all_to_all over the concatenated lists (Capabilities::list_all_to_all)".into())),
        OpData::AllReduce { buf, op } => all_reduce(calls, comm, buf, *op),
        OpData::Reduce { buf, op, root } => {
            let dt = buf.dtype();
            let root = *root as i32;
            let op = op_of(*op);
            typed!(dt, T => {
                let send: Vec<T> = buf.as_slice::<T>().to_vec();
                reduce(calls, comm, root, me, &send, buf.as_mut_slice::<T>(), op);
            }, half => {
                let send = buf.to_f64_vec();
                let mut out = send.clone();
                reduce(calls, comm, root, me, &send, &mut out, op);
                if me as i32 == root {
                    *buf = Tensor::from_f64s(dt, &out);
                }
            });
        }
        OpData::ReduceScatter {
            input,
            output,
            counts,
            op,
        } => {
            all_reduce(calls, comm, input, *op);
            super::vendor::keep_own_block(input, output, counts, me);
        }
        OpData::AllGather {
            input,
            output,
            counts,
            ..
        } => {
            let (c, d) = partition(ctx, counts, input.dtype().size())?;
            let mut part = PartitionMut::new(output.as_bytes_mut(), c, d);
            mpi::request::scope(|scope| {
                calls.run(|| {
                    comm.immediate_all_gather_varcount_into(scope, input.as_bytes(), &mut part)
                })
            });
        }
        OpData::Broadcast { buf, root } => {
            mpi::request::scope(|scope| {
                calls.run(|| {
                    comm.process_at_rank(*root as i32)
                        .immediate_broadcast_into(scope, buf.as_bytes_mut())
                })
            });
        }
        OpData::Scatter {
            input,
            output,
            root,
        } => {
            mpi::request::scope(|scope| {
                calls.run(|| {
                    let rootp = comm.process_at_rank(*root as i32);
                    if me == *root {
                        rootp.immediate_scatter_into_root(
                            scope,
                            input.as_bytes(),
                            output.as_bytes_mut(),
                        )
                    } else {
                        rootp.immediate_scatter_into(scope, output.as_bytes_mut())
                    }
                })
            });
        }
        OpData::Gather {
            input,
            output,
            root,
        } => {
            mpi::request::scope(|scope| {
                calls.run(|| {
                    let rootp = comm.process_at_rank(*root as i32);
                    if me == *root {
                        rootp.immediate_gather_into_root(
                            scope,
                            input.as_bytes(),
                            output.as_bytes_mut(),
                        )
                    } else {
                        rootp.immediate_gather_into(scope, input.as_bytes())
                    }
                })
            });
        }
        OpData::AllToAll {
            input,
            output,
            send_counts,
            recv_counts,
        } => {
            let es = input.dtype().size();
            let (sc, sd) = partition(ctx, send_counts, es)?;
            let (rc, rd) = partition(ctx, recv_counts, es)?;
            let send = Partition::new(input.as_bytes(), sc, sd);
            let mut recv = PartitionMut::new(output.as_bytes_mut(), rc, rd);
            mpi::request::scope(|scope| {
                calls.run(|| comm.immediate_all_to_all_varcount_into(scope, &send, &mut recv))
            });
        }
        // The header exchange already synchronised every rank.
        OpData::Barrier => {}
        OpData::P2P { ops } => {
            mpi::request::scope(|scope| {
                let reqs: Vec<_> = {
                    let _g = lock();
                    ops.iter_mut()
                        .map(|t| {
                            let p = comm.process_at_rank(t.peer as i32);
                            if t.send {
                                p.immediate_send(scope, t.buf.as_bytes())
                            } else {
                                p.immediate_receive_into(scope, t.buf.as_bytes_mut())
                            }
                        })
                        .collect()
                };
                for r in reqs {
                    calls.complete(r);
                }
            });
        }
    }
    Ok(())
}

/// Reduce `send` into `recv` on `root` (`recv` is untouched elsewhere).
fn reduce<T: Equivalence>(
    calls: Calls,
    comm: &SimpleCommunicator,
    root: i32,
    me: usize,
    send: &[T],
    recv: &mut [T],
    op: SystemOperation,
) {
    mpi::request::scope(|scope| {
        calls.run(|| {
            let rootp = comm.process_at_rank(root);
            if me as i32 == root {
                rootp.immediate_reduce_into_root(scope, send, recv, op)
            } else {
                rootp.immediate_reduce_into(scope, send, op)
            }
        })
    });
}

/// In-place all-reduce; f16/bf16 through f64 ([MP-4]).
///
/// [MP-4]: self#invariants
fn all_reduce(calls: Calls, comm: &SimpleCommunicator, buf: &mut Tensor, op: ReduceOp) {
    let dt = buf.dtype();
    let op = op_of(op);
    typed!(dt, T => {
        let send: Vec<T> = buf.as_slice::<T>().to_vec();
        all_reduce_into(calls, comm, &send, buf.as_mut_slice::<T>(), op);
    }, half => {
        let send = buf.to_f64_vec();
        let mut out = send.clone();
        all_reduce_into(calls, comm, &send, &mut out, op);
        *buf = Tensor::from_f64s(dt, &out);
    });
}

fn all_reduce_into<T: Equivalence>(
    calls: Calls,
    comm: &SimpleCommunicator,
    send: &[T],
    recv: &mut [T],
    op: SystemOperation,
) {
    mpi::request::scope(|scope| {
        calls.run(|| comm.immediate_all_reduce_into(scope, send, recv, op))
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::OpKind;

    #[test]
    fn partition_is_in_bytes_with_prefix_displacements() {
        let ctx = OpCtx {
            comm: "p".into(),
            rank: 1,
            size: 3,
            epoch: 0,
            kind: OpKind::AllGather,
            seq: 4,
            fingerprint: 0,
            headers: true,
            may_block: false,
            order: Default::default(),
        };
        let (c, d) = partition(&ctx, &[1, 0, 3], 4).unwrap();
        assert_eq!(c, vec![4, 0, 12]);
        assert_eq!(d, vec![0, 4, 4]);
        match partition(&ctx, &[1 << 30], 4) {
            Err(Error::InvalidArgument { comm, rank, .. }) => {
                assert_eq!((comm.as_str(), rank), ("p", 1))
            }
            other => panic!("{other:?}"),
        }
    }
}
