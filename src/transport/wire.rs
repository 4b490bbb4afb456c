//! Control-plane framing: length-prefixed, size-bounded, validated rkyv messages.
//!
//! STUB: to be implemented.

/// Largest control-plane frame accepted, in bytes.
pub const MAX_FRAME: usize = 16 << 20;
