//! Chorus: an actor-based runtime for distributed collective communication.
#![deny(missing_docs)]

pub mod backends;
pub mod error;
pub mod op;
pub mod tensor;
pub mod transport;

pub use error::{Error, Result};
pub use op::{OpKind, ReduceOp};
pub use tensor::{DType, Element, Tensor};
