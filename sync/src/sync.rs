//! The synchronisation types the primitives use: `std`'s, or loom's
//! model-checked ones under the `loom` feature.

#[cfg(feature = "loom")]
pub use loom::sync::atomic;
#[cfg(feature = "loom")]
pub use loom::sync::{Arc, Condvar, Mutex, MutexGuard};
#[cfg(feature = "loom")]
pub use loom::thread;

#[cfg(not(feature = "loom"))]
pub use std::sync::atomic;
#[cfg(not(feature = "loom"))]
pub use std::sync::{Arc, Condvar, Mutex, MutexGuard};
#[cfg(not(feature = "loom"))]
pub use std::thread;

#[cfg(feature = "loom")]
pub use loom::cell::UnsafeCell;

/// `std`'s `UnsafeCell` with loom's access API: every access goes through
/// [`UnsafeCell::with`] (shared) or [`UnsafeCell::with_mut`] (exclusive),
/// which loom checks for data races and which are plain pointer accesses
/// here.
#[cfg(not(feature = "loom"))]
#[derive(Debug, Default)]
pub struct UnsafeCell<T>(std::cell::UnsafeCell<T>);

#[cfg(not(feature = "loom"))]
impl<T> UnsafeCell<T> {
    /// A cell holding `data`.
    pub const fn new(data: T) -> UnsafeCell<T> {
        UnsafeCell(std::cell::UnsafeCell::new(data))
    }

    /// Run `f` with a pointer for reading the contents. The caller of `f`
    /// must make sure no write to the cell happens meanwhile.
    #[inline(always)]
    pub fn with<R>(&self, f: impl FnOnce(*const T) -> R) -> R {
        f(self.0.get())
    }

    /// Run `f` with a pointer for writing the contents. The caller of `f`
    /// must make sure no other access to the cell happens meanwhile.
    #[inline(always)]
    pub fn with_mut<R>(&self, f: impl FnOnce(*mut T) -> R) -> R {
        f(self.0.get())
    }
}

/// Park the current thread for at most `dur` (it may return earlier, as
/// `std::thread::park_timeout` may). Under loom, which has no clock, it
/// only yields: to the model a timed park is a park that may return at
/// any moment, which loom explores by yielding.
#[cfg(not(feature = "loom"))]
pub fn park_timeout(dur: std::time::Duration) {
    std::thread::park_timeout(dur)
}

/// Park the current thread for at most `dur` (it may return earlier, as
/// `std::thread::park_timeout` may). Under loom, which has no clock, it
/// only yields: to the model a timed park is a park that may return at
/// any moment, which loom explores by yielding.
#[cfg(feature = "loom")]
pub fn park_timeout(_dur: std::time::Duration) {
    loom::thread::yield_now()
}

/// Where another thread may run, to the model: nothing in a normal build;
/// under loom a branch point. Loom switches threads only at its own
/// operations, so a plain cell access right after an atomic RMW would look
/// indivisible from it; a preemption point between them lets the model
/// run the other thread in that window, as a real machine may.
#[inline(always)]
pub fn preemption_point() {
    #[cfg(feature = "loom")]
    loom::thread::yield_now();
}

/// Lock `m`, ignoring poisoning (a panic while holding one of these locks
/// leaves the protected state consistent: every critical section is a few
/// field updates).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
