//! Chorus's concurrency primitives, each small enough to model-check with
//! [loom](https://docs.rs/loom) (`cargo test --features loom`; the models
//! live in `tests/loom_*.rs`, as tokio's do in `src/sync/tests/`).
//!
//! The primitives are written against the shim in [`mod@sync`], which is
//! `std` in a normal build and loom's model types under the `loom`
//! feature, so the model checks the very code Chorus runs.
#![deny(missing_docs)]

pub mod gate;
pub mod oneshot;
pub mod serial;
pub mod sync;
