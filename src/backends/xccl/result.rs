//! Layer 2: `Result`-returning wrappers over [`sys`]. Each turns
//! a C status into a [`CallError`] carrying the library's own message; the
//! safe layer ([`super::XcclBackend`]) adds the communicator context.

use std::ffi::{c_int, CStr};

use super::plan::result_name;
use super::sys::{self, NcclApi, RtApi};

/// A failed vendor call: which call, the code, and the library's message.
#[derive(Debug, Clone)]
pub struct CallError {
    /// The C function, e.g. `ncclAllReduce`.
    pub call: &'static str,
    /// The status code.
    pub code: c_int,
    /// `true` for an NCCL result code, `false` for a CUDA/HIP error.
    pub nccl: bool,
    /// Human-readable description.
    pub message: String,
}

impl std::fmt::Display for CallError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} failed with {}: {}",
            self.call, self.code, self.message
        )
    }
}

fn cstr(p: *const std::ffi::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: the libraries return static NUL-terminated strings.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// Check an NCCL status (`ncclInProgress` counts as success: the caller
/// settles non-blocking communicators with [`async_error`]).
pub fn nccl(api: &NcclApi, call: &'static str, r: sys::ncclResult_t) -> Result<(), CallError> {
    if r == sys::NCCL_SUCCESS || r == sys::NCCL_IN_PROGRESS {
        return Ok(());
    }
    // SAFETY: plain lookup of a static string.
    let msg = cstr(unsafe { (api.get_error_string)(r) });
    Err(CallError {
        call,
        code: r,
        nccl: true,
        message: format!("{} ({msg})", result_name(r)),
    })
}

/// Check a CUDA/HIP status.
pub fn rt(api: &RtApi, call: &'static str, r: sys::RtError) -> Result<(), CallError> {
    if r == 0 {
        return Ok(());
    }
    // SAFETY: plain lookup of a static string.
    let msg = cstr(unsafe { (api.get_error_string)(r) });
    Err(CallError {
        call,
        code: r,
        nccl: false,
        message: msg,
    })
}

/// `ncclCommGetAsyncError`: `Ok(true)` when the communicator is idle and
/// healthy, `Ok(false)` while a non-blocking call is still in progress.
///
/// # Safety
/// `comm` must be a live communicator of `api`.
pub unsafe fn async_error(api: &NcclApi, comm: sys::ncclComm_t) -> Result<bool, CallError> {
    let mut state = sys::NCCL_SUCCESS;
    nccl(
        api,
        "ncclCommGetAsyncError",
        (api.comm_get_async_error)(comm, &mut state),
    )?;
    match state {
        sys::NCCL_SUCCESS => Ok(true),
        sys::NCCL_IN_PROGRESS => Ok(false),
        e => nccl(api, "ncclCommGetAsyncError(state)", e).map(|_| false),
    }
}

/// `*StreamQuery`: `Ok(true)` when all work on `stream` completed.
///
/// # Safety
/// `stream` must be a live stream of `api`.
pub unsafe fn stream_done(api: &RtApi, stream: sys::Stream) -> Result<bool, CallError> {
    match (api.stream_query)(stream) {
        0 => Ok(true),
        sys::RT_NOT_READY => Ok(false),
        e => rt(api, "StreamQuery", e).map(|_| false),
    }
}
