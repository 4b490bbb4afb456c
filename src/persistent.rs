//! Persistent all-gather (TorchComms' `all_gather_p_init` / `_exec` /
//! `_free`): the dtype, the count and both buffers are agreed on and
//! allocated once, and every exec reuses them.
//!
//! Owns only the handle and its buffers; each exec is an ordinary
//! all-gather of the communicator (ordered with its other ops, checked
//! across ranks like any op). What is fixed at init is everything Chorus
//! decides above the backend: the ranks' agreement on dtype and count, the
//! output's size and its memory. The backend still plans each exec's
//! transfers as for any all-gather.

use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};

/// A persistent all-gather over one communicator
/// ([`Comm::all_gather_p_init`]): fill [`input_mut`](Self::input_mut),
/// [`exec`](Self::exec), read the result; repeat. Dropping it (or
/// [`free`](Self::free)) releases the buffers.
///
/// ```
/// use chorus::{new_comm, CommOptions, DType, Device};
///
/// let comm = new_comm("cpu", Device::Cpu, "agp-doc", CommOptions::single())?;
/// let mut ag = comm.all_gather_p_init(DType::F32, 4)?;
/// for step in 0..3 {
///     ag.input_mut().as_mut_slice::<f32>().fill(step as f32);
///     let out = ag.exec()?;
///     assert_eq!(out.as_slice::<f32>(), &[step as f32; 4]);
/// }
/// ag.free();
/// comm.finalize()?;
/// # Ok::<(), chorus::Error>(())
/// ```
#[derive(Debug)]
pub struct PersistentAllGather {
    comm: Comm,
    dtype: DType,
    count: usize,
    input: Tensor,
    output: Tensor,
}

impl Comm {
    /// Set up a persistent all-gather of `count` elements of `dtype` per
    /// rank: the ranks agree on `dtype` and `count` once (an all-gather of
    /// both), and the handle allocates the input (`count`) and the output
    /// (`size() × count`) once. Collective: every rank calls it, in order
    /// with the communicator's other ops.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the output would not fit in memory
    /// (before any communication); [`Error::Mismatch`] if ranks pass a
    /// different dtype or count (the communicator stays usable); the
    /// communicator's failures otherwise.
    pub fn all_gather_p_init(&self, dtype: DType, count: usize) -> Result<PersistentAllGather> {
        let this = self.clone();
        self.block("all_gather_p_init", move |_| async move {
            this.all_gather_p_init_async(dtype, count).await
        })
    }

    /// Async form of [`Comm::all_gather_p_init`].
    ///
    /// # Errors
    /// As [`Comm::all_gather_p_init`].
    pub async fn all_gather_p_init_async(
        &self,
        dtype: DType,
        count: usize,
    ) -> Result<PersistentAllGather> {
        const OP: &str = "all_gather_p_init";
        let invalid = |reason: String| Error::InvalidArgument {
            comm: self.name().to_string(),
            rank: self.rank(),
            op: OP,
            reason,
        };
        let total = count
            .checked_mul(self.size())
            .ok_or_else(|| invalid("the gathered output would overflow usize".into()))?;
        let no_memory = || invalid(format!("{total} x {dtype} does not fit in memory"));
        let output = Tensor::try_zeros(dtype, total).ok_or_else(no_memory)?;
        let input = Tensor::try_zeros(dtype, count).ok_or_else(no_memory)?;
        let mine = [i64::from(dtype.code()), count as i64];
        let all = self
            .all_gather_async(Tensor::from_vec(mine.to_vec()))
            .skip_hooks()
            .await?
            .to_vec::<i64>();
        if let Some(r) = all.chunks(2).position(|row| row != mine) {
            return Err(Error::Mismatch {
                comm: self.name().to_string(),
                rank: self.rank(),
                op: OP,
                seq: 0,
                epoch: self.epoch(),
                detail: format!(
                    "rank {r} set up a persistent all_gather of another dtype or count \
                     than this rank's {count} x {dtype}"
                ),
                fatal: false,
            });
        }
        Ok(PersistentAllGather {
            comm: self.clone(),
            dtype,
            count,
            input,
            output,
        })
    }
}

impl PersistentAllGather {
    /// The element type, fixed at init.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Elements per rank, fixed at init.
    pub fn count(&self) -> usize {
        self.count
    }

    /// This rank's input buffer: fill it before [`exec`](Self::exec). It
    /// keeps its contents across execs.
    pub fn input_mut(&mut self) -> &mut Tensor {
        &mut self.input
    }

    /// The result of the last successful exec (zeros before the first):
    /// rank `r`'s input at `r * count()`.
    pub fn output(&self) -> &Tensor {
        &self.output
    }

    /// Gather every rank's input into the output, in place; every rank
    /// calls it, in the same order relative to the communicator's other
    /// ops. Returns the output.
    ///
    /// # Errors
    /// The errors of [`Comm::all_gather_into`]. After an error the
    /// handle's buffers are zeroed (the op consumed them) but stay usable.
    pub fn exec(&mut self) -> Result<&Tensor> {
        let (input, output) = self.take();
        let r = self.comm.all_gather_into(input, output);
        self.put(r)
    }

    /// Async form of [`PersistentAllGather::exec`].
    ///
    /// # Errors
    /// As [`PersistentAllGather::exec`].
    pub async fn exec_async(&mut self) -> Result<&Tensor> {
        let (input, output) = self.take();
        let r = self.comm.all_gather_into_async(input, output).await;
        self.put(r)
    }

    /// Release the buffers (as dropping the handle does). Local: no
    /// communication.
    pub fn free(self) {}

    fn take(&mut self) -> (Tensor, Tensor) {
        let empty = || Tensor::zeros(self.dtype, 0);
        (
            std::mem::replace(&mut self.input, empty()),
            std::mem::replace(&mut self.output, empty()),
        )
    }

    fn put(&mut self, r: Result<(Tensor, Tensor)>) -> Result<&Tensor> {
        match r {
            Ok((output, input)) => {
                self.input = input;
                self.output = output;
                Ok(&self.output)
            }
            Err(e) => {
                // The buffers went down with the op; stay usable.
                let total = self.count * self.comm.size();
                match (
                    Tensor::try_zeros(self.dtype, self.count),
                    Tensor::try_zeros(self.dtype, total),
                ) {
                    (Some(i), Some(o)) => {
                        self.input = i;
                        self.output = o;
                    }
                    _ => tracing::warn!("persistent all_gather: no memory to restore its buffers"),
                }
                Err(e)
            }
        }
    }
}
