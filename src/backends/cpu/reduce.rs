//! Reduction kernels on raw little-endian bytes.
//!
//! STUB: to be implemented.

use crate::error::Result;
use crate::op::ReduceOp;
use crate::tensor::DType;

/// `dst[i] = dst[i] (op) src[i]` for every element; `dst` and `src` hold
/// elements of `dtype` and have equal length. `op` must be a combining
/// operator (not `Avg`/`PremulSum`, see [`ReduceOp::combine_op`]).
pub fn reduce_into(dtype: DType, op: ReduceOp, dst: &mut [u8], src: &[u8]) -> Result<()> {
    let _ = (dtype, op, dst, src);
    Err(crate::Error::Internal("reduce_into not implemented".into()))
}

/// Multiply every element by `scalar` (for `PremulSum`).
pub fn scale(dtype: DType, data: &mut [u8], scalar: f64) {
    let _ = (dtype, data, scalar);
}

/// Divide every element by `n` (for `Avg`; integer division for integers).
pub fn divide(dtype: DType, data: &mut [u8], n: usize) {
    let _ = (dtype, data, n);
}
