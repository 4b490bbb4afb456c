//! The synchronisation types the primitives use: `std`'s, or loom's
//! model-checked ones under the `loom` feature.

#[cfg(feature = "loom")]
pub use loom::sync::atomic;
#[cfg(feature = "loom")]
pub use loom::sync::{Arc, Mutex, MutexGuard};
#[cfg(feature = "loom")]
pub use loom::thread;

#[cfg(not(feature = "loom"))]
pub use std::sync::atomic;
#[cfg(not(feature = "loom"))]
pub use std::sync::{Arc, Mutex, MutexGuard};
#[cfg(not(feature = "loom"))]
pub use std::thread;

/// Lock `m`, ignoring poisoning (a panic while holding one of these locks
/// leaves the protected state consistent: every critical section is a few
/// field updates).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
