//! The `mpi` backend: collectives through the system MPI (Open MPI) via
//! rsmpi, for jobs launched by `mpirun`.
//!
//! Each communicator duplicates `MPI_COMM_WORLD` (so two communicators never
//! match each other's messages) and runs every op as the matching MPI
//! collective, blocking, inside `tokio::task::block_in_place`.
//!
//! Invariants:
//! - MP-1: MPI owns rank and size: the world rank/size must equal the ones
//!   Chorus bootstrapped with (`CommOptions` or the launcher's environment,
//!   `OMPI_COMM_WORLD_RANK/SIZE` under mpirun), else `new_comm` fails with
//!   `Config` before any collective.
//! - MP-2: MPI is initialised once per process (`MPI_THREAD_MULTIPLE` asked,
//!   at least `SERIALIZED` required) and finalised by [`shutdown`], which
//!   is also registered with `atexit` when this backend initialises MPI
//!   (mpirun reports a process that exits without `MPI_Finalize` as
//!   failed). Communicators still alive then are leaked, not freed.
//! - MP-3: `abort` never calls `MPI_Abort` (which kills the whole job): it
//!   aborts the control mesh and stops using the MPI communicator, whose
//!   later calls return `Aborted`-style errors without touching MPI.
//! - MP-4: f16 and bf16 have no MPI datatype: reductions on them are done
//!   in f64 (exact for every value they hold) and rounded back once; data
//!   movement is byte-wise for every dtype.
//! - MP-5: the header exchange, abort notices and finalize run over a
//!   [`CpuBackend`] control mesh, like every vendor backend.

use std::sync::Mutex;

use async_trait::async_trait;
use mpi::collective::SystemOperation;
use mpi::datatype::{Partition, PartitionMut};
use mpi::environment::Universe;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use mpi::Threading;

use super::cpu::CpuBackend;
use super::{Backend, BackendInit, OpCtx, OpData};
use crate::error::{Error, Result};
use crate::op::ReduceOp;
use crate::tensor::{DType, Tensor};

struct UniverseCell(Option<Universe>);
// SAFETY: the universe is only created and dropped (MPI_Finalize) under the
// mutex; MPI is initialised with at least MPI_THREAD_SERIALIZED.
unsafe impl Send for UniverseCell {}

static UNIVERSE: Mutex<UniverseCell> = Mutex::new(UniverseCell(None));

/// Initialise MPI for this process if needed (MP-2).
fn ensure_initialized() -> Result<()> {
    let mut cell = UNIVERSE
        .lock()
        .map_err(|_| Error::Internal("mpi: universe lock poisoned".into()))?;
    if cell.0.is_some() {
        return Ok(());
    }
    if mpi::is_finalized() {
        return Err(Error::BackendUnavailable {
            backend: "mpi",
            reason: "MPI was already finalized in this process (chorus::backends::mpi::shutdown)"
                .into(),
        });
    }
    match mpi::initialize_with_threading(Threading::Multiple) {
        Some((u, provided)) => {
            if matches!(provided, Threading::Single | Threading::Funneled) {
                return Err(Error::BackendUnavailable {
                    backend: "mpi",
                    reason: format!(
                        "MPI provides thread level {provided:?}; Chorus needs at least Serialized"
                    ),
                });
            }
            cell.0 = Some(u);
            // SAFETY: registering a plain extern "C" function.
            if unsafe { atexit(finalize_at_exit) } != 0 {
                tracing::warn!("mpi: cannot register MPI_Finalize at exit; call chorus::backends::mpi::shutdown()");
            }
            Ok(())
        }
        // Initialised by someone else (e.g. the application): use it.
        None => Ok(()),
    }
}

extern "C" {
    fn atexit(cb: extern "C" fn()) -> std::ffi::c_int;
}

extern "C" fn finalize_at_exit() {
    // Never unwind out of an atexit handler.
    let _ = std::panic::catch_unwind(shutdown);
}

/// Finalise MPI if this backend initialised it (MP-2). Call once, at the
/// end of the process, after every `mpi` communicator was finalized and
/// dropped. Idempotent.
pub fn shutdown() {
    if let Ok(mut cell) = UNIVERSE.lock() {
        cell.0.take();
    }
}

/// The world size when this process was started by `mpirun` (Open MPI's
/// environment), for tests that only make sense under a launcher.
pub fn launched_world_size() -> Option<usize> {
    std::env::var("OMPI_COMM_WORLD_SIZE")
        .ok()
        .or_else(|| std::env::var("PMI_SIZE").ok())
        .and_then(|s| s.parse().ok())
}

struct MpiComm(SimpleCommunicator);
// SAFETY: one op at a time per communicator (BE-1); MPI is initialised with
// at least MPI_THREAD_SERIALIZED, so calls from different threads are fine
// as long as they do not overlap, which the executor guarantees.
unsafe impl Send for MpiComm {}
unsafe impl Sync for MpiComm {}

/// The MPI backend of one communicator on one rank.
pub struct MpiBackend {
    comm_name: String,
    rank: usize,
    mpi: Option<MpiComm>,
    ctrl: CpuBackend,
    stopped: Option<Error>,
}

impl std::fmt::Debug for MpiBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MpiBackend")
            .field("comm", &self.comm_name)
            .field("rank", &self.rank)
            .finish_non_exhaustive()
    }
}

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
fn partition(counts: &[usize], esize: usize) -> Result<(Vec<i32>, Vec<i32>)> {
    let mut c = Vec::with_capacity(counts.len());
    let mut d = Vec::with_capacity(counts.len());
    let mut off: usize = 0;
    for &n in counts {
        let bytes = n * esize;
        let too_big = |_| Error::InvalidArgument {
            comm: String::new(),
            rank: 0,
            op: "mpi",
            reason: "a block or offset exceeds 2 GiB, MPI's int count limit".into(),
        };
        c.push(i32::try_from(bytes).map_err(too_big)?);
        d.push(i32::try_from(off).map_err(too_big)?);
        off += bytes;
    }
    Ok((c, d))
}

impl MpiBackend {
    /// Initialise MPI if needed, check rank/size (MP-1), duplicate the world
    /// communicator and connect the control mesh.
    ///
    /// # Errors
    /// `BackendUnavailable` if MPI cannot start; `Config` if MPI's world
    /// disagrees with Chorus's rank/size; control-mesh errors as `cpu`.
    pub async fn connect(init: BackendInit) -> Result<MpiBackend> {
        ensure_initialized()?;
        let (wr, ws, dup) = {
            let world = SimpleCommunicator::world();
            let (wr, ws) = (world.rank() as usize, world.size() as usize);
            let dup = if (wr, ws) == (init.rank, init.size) {
                Some(MpiComm(world.duplicate()))
            } else {
                None
            };
            (wr, ws, dup)
        };
        let Some(dup) = dup else {
            return Err(Error::Config(format!(
                "mpi backend: MPI says rank {wr} of {ws} but communicator {:?} was created as \
                 rank {} of {}; launch with mpirun and let Chorus read OMPI_COMM_WORLD_RANK/SIZE",
                init.comm, init.rank, init.size
            )));
        };
        let ctrl = CpuBackend::connect(init.clone()).await?;
        tracing::info!(comm = %init.comm, rank = init.rank, size = init.size, "mpi communicator ready");
        Ok(MpiBackend {
            comm_name: init.comm,
            rank: init.rank,
            mpi: Some(dup),
            ctrl,
            stopped: None,
        })
    }

    fn run(comm: &SimpleCommunicator, data: &mut OpData) -> Result<()> {
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
            OpData::AllReduce { buf, op } => all_reduce(comm, buf, *op),
            OpData::Reduce { buf, op, root } => {
                let dt = buf.dtype();
                let rootp = comm.process_at_rank(*root as i32);
                let me = comm.rank() as usize == *root;
                typed!(dt, T => {
                    let send: Vec<T> = buf.as_slice::<T>().to_vec();
                    if me {
                        rootp.reduce_into_root(&send[..], buf.as_mut_slice::<T>(), op_of(*op));
                    } else {
                        rootp.reduce_into(&send[..], op_of(*op));
                    }
                }, half => {
                    let send = buf.to_f64_vec();
                    let mut out = send.clone();
                    if me {
                        rootp.reduce_into_root(&send[..], &mut out[..], op_of(*op));
                        *buf = Tensor::from_f64s(dt, &out);
                    } else {
                        rootp.reduce_into(&send[..], op_of(*op));
                    }
                });
                Ok(())
            }
            OpData::ReduceScatter {
                input,
                output,
                counts,
                op,
            } => {
                // Reduce everything, keep this rank's block.
                all_reduce(comm, input, *op)?;
                let me = comm.rank() as usize;
                let start: usize = counts[..me].iter().sum::<usize>() * input.dtype().size();
                let n = output.len_bytes();
                output
                    .as_bytes_mut()
                    .copy_from_slice(&input.as_bytes()[start..start + n]);
                Ok(())
            }
            OpData::AllGather {
                input,
                output,
                counts,
            } => {
                let (c, d) = partition(counts, input.dtype().size())?;
                let mut part = PartitionMut::new(output.as_bytes_mut(), c, d);
                comm.all_gather_varcount_into(input.as_bytes(), &mut part);
                Ok(())
            }
            OpData::Broadcast { buf, root } => {
                comm.process_at_rank(*root as i32)
                    .broadcast_into(buf.as_bytes_mut());
                Ok(())
            }
            OpData::Scatter {
                input,
                output,
                root,
            } => {
                let rootp = comm.process_at_rank(*root as i32);
                if comm.rank() as usize == *root {
                    rootp.scatter_into_root(input.as_bytes(), output.as_bytes_mut());
                } else {
                    rootp.scatter_into(output.as_bytes_mut());
                }
                Ok(())
            }
            OpData::Gather {
                input,
                output,
                root,
            } => {
                let rootp = comm.process_at_rank(*root as i32);
                if comm.rank() as usize == *root {
                    rootp.gather_into_root(input.as_bytes(), output.as_bytes_mut());
                } else {
                    rootp.gather_into(input.as_bytes());
                }
                Ok(())
            }
            OpData::AllToAll {
                input,
                output,
                send_counts,
                recv_counts,
            } => {
                let es = input.dtype().size();
                let (sc, sd) = partition(send_counts, es)?;
                let (rc, rd) = partition(recv_counts, es)?;
                let send = Partition::new(input.as_bytes(), sc, sd);
                let mut recv = PartitionMut::new(output.as_bytes_mut(), rc, rd);
                comm.all_to_all_varcount_into(&send, &mut recv);
                Ok(())
            }
            // The header exchange already synchronised every rank.
            OpData::Barrier => Ok(()),
            OpData::P2P { ops } => {
                mpi::request::scope(|scope| {
                    let mut reqs = Vec::with_capacity(ops.len());
                    for t in ops.iter_mut() {
                        let p = comm.process_at_rank(t.peer as i32);
                        if t.send {
                            reqs.push(p.immediate_send(scope, t.buf.as_bytes()));
                        } else {
                            reqs.push(p.immediate_receive_into(scope, t.buf.as_bytes_mut()));
                        }
                    }
                    for r in reqs {
                        r.wait();
                    }
                });
                Ok(())
            }
        }
    }
}

fn all_reduce(comm: &SimpleCommunicator, buf: &mut Tensor, op: ReduceOp) -> Result<()> {
    let dt = buf.dtype();
    typed!(dt, T => {
        let send: Vec<T> = buf.as_slice::<T>().to_vec();
        comm.all_reduce_into(&send[..], buf.as_mut_slice::<T>(), op_of(op));
    }, half => {
        // MP-4.
        let send = buf.to_f64_vec();
        let mut out = send.clone();
        comm.all_reduce_into(&send[..], &mut out[..], op_of(op));
        *buf = Tensor::from_f64s(dt, &out);
    });
    Ok(())
}

#[async_trait]
impl Backend for MpiBackend {
    fn name(&self) -> &'static str {
        "mpi"
    }

    async fn exchange_headers(
        &mut self,
        ctx: &OpCtx,
        outgoing: Vec<(usize, u64, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>> {
        if let Some(e) = &self.stopped {
            return Err(e.clone());
        }
        self.ctrl.exchange_headers(ctx, outgoing).await
    }

    async fn execute(&mut self, ctx: &OpCtx, data: &mut OpData) -> Result<()> {
        if let Some(e) = &self.stopped {
            return Err(e.clone());
        }
        let Some(comm) = &self.mpi else {
            return Err(Error::Internal(format!(
                "mpi communicator {:?} is closed",
                self.comm_name
            )));
        };
        let _span = tracing::debug_span!("mpi_op", op = ctx.kind.name(), seq = ctx.seq).entered();
        tokio::task::block_in_place(|| MpiBackend::run(&comm.0, data))
    }

    async fn abort(&mut self, reason: &str, failed: &[usize]) {
        // MP-3: never MPI_Abort.
        self.stopped = Some(Error::Internal(format!(
            "mpi communicator {:?} was aborted: {reason}",
            self.comm_name
        )));
        self.ctrl.abort(reason, failed).await;
    }

    async fn finalize(&mut self) {
        self.ctrl.finalize().await;
    }
}

impl Drop for MpiBackend {
    fn drop(&mut self) {
        if let Some(c) = self.mpi.take() {
            if mpi::is_finalized() || self.stopped.is_some() {
                // Freeing a communicator after MPI_Finalize (or one a peer may
                // still be using after an abort) is undefined: leak it.
                std::mem::forget(c);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn partition_is_in_bytes_with_prefix_displacements() {
        let (c, d) = partition(&[1, 0, 3], 4).unwrap();
        assert_eq!(c, vec![4, 0, 12]);
        assert_eq!(d, vec![0, 4, 4]);
        assert!(partition(&[1 << 30], 4).is_err());
    }
}
