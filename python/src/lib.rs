//! `chorus._chorus`: the native half of the `chorus` Python package.
//!
//! The Python half (`python/chorus/__init__.py`) gives TorchComms' API
//! (argument order, `async_op=`, lists of tensors, `timedelta`s); this module
//! is the thin layer under it: one method per Chorus op, taking byte
//! buffers (C-contiguous `memoryview`s cast to `'B'`) plus a dtype code, and
//! returning a `PyWork`.
//!
//! Buffers:
//! - A buffer an op writes into (the tensor of `all_reduce`, `broadcast`,
//!   `recv`, the output of `all_gather_single`, ...) becomes an external
//!   [`Tensor`] over the caller's memory when it is writable and 8-byte
//!   aligned: the op writes straight into the array, no copy. Otherwise (and
//!   for ops whose Chorus form returns a new buffer, such as
//!   `all_to_all_single`) the result is copied into the caller's array when
//!   the work is waited on.
//! - The Python buffer export is held by the tensor's keep-alive owner, so
//!   the array cannot be freed or resized while an op uses it, even after a
//!   timeout. The owner may be dropped on a runtime thread without the GIL:
//!   it then parks the export in `RELEASES`, released under the GIL at the
//!   next call into this module (never blocking a runtime thread on the GIL).
//! - The GIL is released while an op is submitted and while it is waited on.
//! - Objects without the buffer protocol but with `__dlpack__` arrive as
//!   `memoryview`s of a `dlpack::DlpackView`, which owns the DLPack tensor
//!   (see the `dlpack` module); from then on they are buffers like any other.
//!
//! Hooks: a Python hook is a Chorus hook that takes the GIL on the thread
//! running hooks (the communicator's hook thread, or a thread waiting for
//! one of its ops, which released the GIL to wait) and calls the callable
//! with a dict of the event; the Python
//! half turns that into TorchComms' call. Windows: `PyWindow` is the Rust
//! `Window` with byte offsets and explicit signal values; the Python half
//! counts signals per peer as TorchComms does.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use std::collections::BTreeMap;

use chorus::{
    AbortHookArgs, CommOptions, DType, Device, FlightEntry, P2POp, PostHookArgs,
    ReconfigureOptions, ReduceOp, RemovableHandle, Rendezvous, Tensor, WindowAccess,
};
use pyo3::buffer::PyBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

mod dlpack;

// ------------------------------------------------------------------ buffers

/// Bytes copied into Chorus tensors from callers' buffers, and out of
/// results into them: the zero-copy path leaves both unchanged (tests read
/// them through `_copy_stats()`).
static COPIED_IN: AtomicU64 = AtomicU64::new(0);
static COPIED_OUT: AtomicU64 = AtomicU64::new(0);

/// Buffer exports dropped off the Python thread, released under the GIL.
static RELEASES: Mutex<Vec<PyBuffer<u8>>> = Mutex::new(Vec::new());

/// Release the parked buffer exports (called with the GIL held).
fn drain_releases(py: Python<'_>) {
    let parked = std::mem::take(&mut *RELEASES.lock().unwrap_or_else(|e| e.into_inner()));
    for b in parked {
        b.release(py);
    }
}

/// Keeps a Python buffer export alive; see the module docs.
struct Export(Option<PyBuffer<u8>>);

impl Drop for Export {
    fn drop(&mut self) {
        if let Some(b) = self.0.take() {
            RELEASES.lock().unwrap_or_else(|e| e.into_inner()).push(b);
        }
    }
}

/// Where an op's result goes: a caller's buffer, by address.
struct Dest {
    addr: usize,
    len_bytes: usize,
    /// The export that keeps `addr` valid.
    _export: Arc<Export>,
}

impl Dest {
    /// Put `t`'s bytes into the caller's buffer, unless the op already
    /// wrote them there (an external tensor handed back).
    fn fill(&self, t: &Tensor) -> Result<(), Failure> {
        if t.len_bytes() != self.len_bytes {
            return Err(Failure::Value(format!(
                "the result has {} bytes, but the output buffer holds {}",
                t.len_bytes(),
                self.len_bytes
            )));
        }
        if self.len_bytes > 0 && t.as_ptr() as usize != self.addr {
            // SAFETY: `addr` is valid for `len_bytes` writable bytes while
            // `_export` holds the buffer export; `t` is a different buffer
            // (checked above), so the ranges do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(t.as_ptr(), self.addr as *mut u8, self.len_bytes)
            };
            COPIED_OUT.fetch_add(self.len_bytes as u64, Ordering::Relaxed);
        }
        Ok(())
    }
}

/// A buffer of the caller's: its export, address and dtype.
struct Buf {
    export: Arc<Export>,
    addr: usize,
    len_bytes: usize,
    readonly: bool,
    dtype: DType,
}

fn dtype_of(code: u8) -> PyResult<DType> {
    DType::from_code(code)
        .ok_or_else(|| PyValueError::new_err(format!("unknown dtype code {code}")))
}

impl Buf {
    fn get(obj: &Bound<'_, PyAny>, dtype: u8) -> PyResult<Buf> {
        let dtype = dtype_of(dtype)?;
        let b = PyBuffer::<u8>::get(obj)?;
        if !b.is_c_contiguous() {
            return Err(PyValueError::new_err(
                "the buffer is not contiguous; pass a contiguous array (numpy.ascontiguousarray)",
            ));
        }
        let len_bytes = b.len_bytes();
        if len_bytes % dtype.size() != 0 {
            return Err(PyValueError::new_err(format!(
                "a buffer of {len_bytes} bytes is not a whole number of {dtype} elements"
            )));
        }
        Ok(Buf {
            addr: b.buf_ptr() as usize,
            len_bytes,
            readonly: b.readonly(),
            dtype,
            export: Arc::new(Export(Some(b))),
        })
    }

    fn len(&self) -> usize {
        self.len_bytes / self.dtype.size()
    }

    /// Whether the two buffers share any byte.
    fn overlaps(&self, other: &Buf) -> bool {
        self.len_bytes > 0
            && other.len_bytes > 0
            && self.addr < other.addr + other.len_bytes
            && other.addr < self.addr + self.len_bytes
    }

    /// The tensor of an input read while `outputs` are written: over the
    /// caller's memory unless it overlaps one of them (then a copy, so no
    /// two tensors ever alias one buffer).
    fn input_beside(&self, outputs: &[&Buf]) -> Tensor {
        if outputs.iter().any(|o| self.overlaps(o)) {
            self.copy()
        } else {
            self.tensor()
        }
    }

    /// An owned copy of the bytes.
    fn copy(&self) -> Tensor {
        let mut t = Tensor::zeros(self.dtype, self.len());
        if self.len_bytes > 0 {
            // SAFETY: the export keeps `addr` valid for `len_bytes` bytes.
            let src = unsafe { std::slice::from_raw_parts(self.addr as *const u8, self.len_bytes) };
            t.as_bytes_mut().copy_from_slice(src);
            COPIED_IN.fetch_add(self.len_bytes as u64, Ordering::Relaxed);
        }
        t
    }

    /// A tensor over the caller's memory when it is writable, 8-byte
    /// aligned and non-empty; else an owned copy.
    fn tensor(&self) -> Tensor {
        if self.readonly || self.len_bytes == 0 || self.addr % 8 != 0 {
            return self.copy();
        }
        // SAFETY: the export (the owner) keeps the `len_bytes` bytes at
        // `addr` valid and writable (not readonly); Python code must not
        // touch the array while the op runs (documented in docs/python.md,
        // as for TorchComms' tensors).
        match unsafe {
            Tensor::from_external(
                self.dtype,
                self.addr as *mut u8,
                self.len(),
                Box::new(self.export.clone()),
            )
        } {
            Ok(t) => t,
            Err(_) => self.copy(),
        }
    }

    /// The tensor an op writes into, and where its result goes.
    fn output(&self) -> PyResult<(Tensor, Dest)> {
        if self.readonly {
            return Err(PyValueError::new_err("the output buffer is read-only"));
        }
        Ok((self.tensor(), self.dest()))
    }

    fn dest(&self) -> Dest {
        Dest {
            addr: self.addr,
            len_bytes: self.len_bytes,
            _export: self.export.clone(),
        }
    }
}

fn bufs(list: &Bound<'_, PyList>, dtype: u8) -> PyResult<Vec<Buf>> {
    list.iter().map(|o| Buf::get(&o, dtype)).collect()
}

fn dests(list: &[Buf]) -> PyResult<Vec<Dest>> {
    list.iter()
        .map(|b| {
            if b.readonly {
                Err(PyValueError::new_err("an output buffer is read-only"))
            } else {
                Ok(b.dest())
            }
        })
        .collect()
}

/// Fill `dests` from consecutive parts of `t`.
fn fill_split(dests: &[Dest], t: &Tensor) -> Result<(), Failure> {
    let total: usize = dests.iter().map(|d| d.len_bytes).sum();
    if total != t.len_bytes() {
        return Err(Failure::Value(format!(
            "the result has {} bytes, but the output buffers hold {total}",
            t.len_bytes()
        )));
    }
    let mut off = 0;
    for d in dests {
        let part = Tensor::from_bytes(t.dtype(), &t.as_bytes()[off..off + d.len_bytes])
            .ok_or_else(|| Failure::Value("output sizes are not whole elements".into()))?;
        d.fill(&part)?;
        off += d.len_bytes;
    }
    Ok(())
}

// ------------------------------------------------------------------ errors

/// Why an op failed: a Chorus error, or a problem with the Python arguments
/// found after the op ran (an output of the wrong size).
#[derive(Debug, Clone)]
enum Failure {
    Chorus(chorus::Error),
    Value(String),
}

impl From<chorus::Error> for Failure {
    fn from(e: chorus::Error) -> Failure {
        Failure::Chorus(e)
    }
}

/// The `chorus` exception class for a Chorus error (see chorus/_errors.py).
fn class_of(e: &chorus::Error) -> &'static str {
    use chorus::Error as E;
    match e {
        E::UnknownBackend { .. } => "UnknownBackendError",
        E::BackendUnavailable { .. } => "BackendUnavailableError",
        E::InvalidArgument { .. } => "InvalidArgumentError",
        E::Mismatch { .. } => "MismatchError",
        E::Timeout { .. } => "TimeoutError",
        E::PeerFailed { .. } => "PeerFailedError",
        E::StoreUnreachable { .. } => "StoreUnreachableError",
        E::Corrupted { .. } => "CorruptedError",
        E::Aborted { .. } => "AbortedError",
        E::Finalized { .. } => "FinalizedError",
        E::UnsupportedOp { .. } => "UnsupportedOpError",
        E::NotSupported { .. } => "NotSupportedError",
        E::NoQuorum { .. } => "NoQuorumError",
        E::Excluded { .. } => "ExcludedError",
        E::Config(_) => "ConfigError",
        E::Transport(_) => "TransportError",
        E::Internal(_) => "InternalError",
        _ => "ChorusError",
    }
}

fn to_pyerr(py: Python<'_>, f: &Failure) -> PyErr {
    let e = match f {
        Failure::Value(msg) => return PyValueError::new_err(msg.clone()),
        Failure::Chorus(e) => e,
    };
    let build = || -> PyResult<PyErr> {
        let module = py.import("chorus._errors")?;
        let cls = module.getattr(class_of(e))?;
        let kw = PyDict::new(py);
        kw.set_item("failed_ranks", e.failed_ranks().to_vec())?;
        kw.set_item("fatal", e.is_fatal())?;
        let value = cls.call((e.to_string(),), Some(&kw))?;
        Ok(PyErr::from_value(value))
    };
    build().unwrap_or_else(|err| err)
}

fn chorus_err(py: Python<'_>, e: chorus::Error) -> PyErr {
    to_pyerr(py, &Failure::Chorus(e))
}

// ------------------------------------------------------------------ work

/// An op in flight, type-erased.
trait Pending: Send {
    fn is_completed(&self) -> bool;
    /// Wait up to `d` for the op; once done, deliver its result into the
    /// callers' buffers. Gives itself back if the op is still running.
    fn wait_for(self: Box<Self>, d: Duration) -> Result<Result<(), Failure>, Box<dyn Pending>>;
}

struct Op<T, F> {
    work: chorus::Work<T>,
    deliver: F,
}

impl<T, F> Pending for Op<T, F>
where
    T: Send + 'static,
    F: FnOnce(T) -> Result<(), Failure> + Send + 'static,
{
    fn is_completed(&self) -> bool {
        self.work.is_completed()
    }
    fn wait_for(self: Box<Self>, d: Duration) -> Result<Result<(), Failure>, Box<dyn Pending>> {
        let Op { work, deliver } = *self;
        match work.wait_timeout(d) {
            Ok(Ok(value)) => Ok(deliver(value)),
            Ok(Err(e)) => Ok(Err(Failure::Chorus(e))),
            Err(work) => Err(Box::new(Op { work, deliver })),
        }
    }
}

/// How long `wait()` blocks between checks for Python signals (Ctrl-C).
const SIGNAL_POLL: Duration = Duration::from_millis(50);

enum WorkState {
    Pending(Box<dyn Pending>),
    Done(Result<(), Failure>),
}

/// The handle of an op (TorchComms' `TorchWork`).
///
/// `wait()` may be called any number of times; each call after the first
/// returns (or raises) what the first did.
#[pyclass(name = "Work", module = "chorus._chorus")]
struct PyWork {
    state: Mutex<WorkState>,
}

impl PyWork {
    fn new<T, F>(work: chorus::Work<T>, deliver: F) -> PyWork
    where
        T: Send + 'static,
        F: FnOnce(T) -> Result<(), Failure> + Send + 'static,
    {
        PyWork {
            state: Mutex::new(WorkState::Pending(Box::new(Op { work, deliver }))),
        }
    }

    /// Finish the op if it is pending: wait without the GIL, checking for
    /// Python signals every [`SIGNAL_POLL`] (a `KeyboardInterrupt` leaves
    /// the op pending; a later `wait()` resumes).
    fn settle(&self, py: Python<'_>) -> PyResult<Result<(), Failure>> {
        loop {
            let step = py.detach(|| {
                let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
                let placeholder = WorkState::Done(Ok(()));
                match std::mem::replace(&mut *state, placeholder) {
                    WorkState::Pending(p) => match p.wait_for(SIGNAL_POLL) {
                        Ok(result) => {
                            *state = WorkState::Done(result.clone());
                            Some(result)
                        }
                        Err(p) => {
                            *state = WorkState::Pending(p);
                            None
                        }
                    },
                    WorkState::Done(r) => {
                        *state = WorkState::Done(r.clone());
                        Some(r)
                    }
                }
            });
            drain_releases(py);
            match step {
                Some(result) => return Ok(result),
                None => py.check_signals()?,
            }
        }
    }
}

#[pymethods]
impl PyWork {
    /// Whether the op has finished (successfully or not). Once true, the
    /// results are in the output buffers and `wait()` does not block.
    fn is_completed(&self, py: Python<'_>) -> PyResult<bool> {
        let done = {
            // Busy: another thread is waiting on it, so it was not done.
            let Ok(state) = self.state.try_lock() else {
                return Ok(false);
            };
            match &*state {
                WorkState::Pending(p) => p.is_completed(),
                WorkState::Done(_) => return Ok(true),
            }
        };
        if done {
            // Deliver the results now, so the buffers hold them (no wait).
            let _ = self.settle(py)?;
        }
        Ok(done)
    }

    /// Block (without the GIL) until the op has finished; raise its error.
    fn wait(&self, py: Python<'_>) -> PyResult<()> {
        self.settle(py)?.map_err(|f| to_pyerr(py, &f))
    }

    /// Same as `wait()`: Chorus ops run on host memory, so there is no
    /// stream to wait on separately.
    fn wait_blocking(&self, py: Python<'_>) -> PyResult<()> {
        self.wait(py)
    }

    fn __repr__(&self) -> String {
        let Ok(state) = self.state.try_lock() else {
            return "Work(pending)".into();
        };
        match &*state {
            WorkState::Pending(_) => "Work(pending)".into(),
            WorkState::Done(Ok(())) => "Work(completed)".into(),
            WorkState::Done(Err(_)) => "Work(failed)".into(),
        }
    }
}

// ------------------------------------------------------------------ comm

fn reduce_op(code: u8, factor: f64) -> PyResult<ReduceOp> {
    Ok(match code {
        0 => ReduceOp::Sum,
        1 => ReduceOp::Product,
        2 => ReduceOp::Min,
        3 => ReduceOp::Max,
        4 => ReduceOp::Avg,
        5 => ReduceOp::BAnd,
        6 => ReduceOp::BOr,
        7 => ReduceOp::BXor,
        8 => ReduceOp::PremulSum(factor),
        _ => {
            return Err(PyValueError::new_err(format!(
                "unknown reduce op code {code}"
            )))
        }
    })
}

fn duration(secs: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(secs).map_err(|_| {
        PyValueError::new_err(format!("timeout {secs} s is not a non-negative duration"))
    })
}

/// A communicator (TorchComms' `TorchComm`), low-level form.
#[pyclass(name = "Comm", module = "chorus._chorus")]
struct PyComm {
    comm: chorus::Comm,
}

impl PyComm {
    /// The communicator with this op's timeout, if one was given.
    fn with(&self, timeout: Option<f64>) -> PyResult<chorus::Comm> {
        Ok(match timeout {
            Some(s) => self.comm.with_timeout(duration(s)?),
            None => self.comm.clone(),
        })
    }

    /// Submit `op` without the GIL and wrap its work.
    fn submit<T, S, F>(
        &self,
        py: Python<'_>,
        timeout: Option<f64>,
        op: S,
        deliver: F,
    ) -> PyResult<PyWork>
    where
        T: Send + 'static,
        S: FnOnce(&chorus::Comm) -> chorus::Work<T> + Send,
        F: FnOnce(T) -> Result<(), Failure> + Send + 'static,
    {
        drain_releases(py);
        let comm = self.with(timeout)?;
        let work = py.detach(|| op(&comm));
        Ok(PyWork::new(work, deliver))
    }
}

#[pymethods]
impl PyComm {
    fn get_rank(&self) -> usize {
        self.comm.rank()
    }
    fn get_size(&self) -> usize {
        self.comm.size()
    }
    fn get_name(&self) -> String {
        self.comm.name().to_string()
    }
    fn get_device(&self) -> String {
        self.comm.device().to_string()
    }
    fn get_backend(&self) -> &'static str {
        self.comm.backend()
    }
    fn get_epoch(&self) -> u64 {
        self.comm.epoch()
    }
    /// The default op timeout, in seconds.
    fn get_timeout(&self) -> f64 {
        self.comm.timeout().as_secs_f64()
    }
    fn is_aborted(&self) -> bool {
        self.comm.is_aborted()
    }
    fn is_active(&self) -> bool {
        self.comm.is_active()
    }

    fn finalize(&self, py: Python<'_>) -> PyResult<()> {
        drain_releases(py);
        let comm = self.comm.clone();
        py.detach(move || comm.finalize())
            .map_err(|e| chorus_err(py, e))
    }

    #[pyo3(signature = (reason=None))]
    fn abort(&self, py: Python<'_>, reason: Option<String>) {
        drain_releases(py);
        let comm = self.comm.clone();
        py.detach(move || match reason {
            Some(r) => comm.abort_with_reason(&r),
            None => comm.abort(),
        });
    }

    /// `{active, epoch, failed_ranks, failure, child_failures, tcp_fallbacks}`.
    fn health<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let h = self.comm.health();
        let d = PyDict::new(py);
        d.set_item("active", h.active)?;
        d.set_item("epoch", h.epoch)?;
        d.set_item("failed_ranks", h.failed_ranks)?;
        d.set_item("failure", h.failure.map(|e| e.to_string()))?;
        d.set_item("child_failures", h.child_failures.len())?;
        let fallbacks: Vec<(usize, String)> = h
            .tcp_fallbacks
            .into_iter()
            .map(|f| (f.peer, f.reason))
            .collect();
        d.set_item("tcp_fallbacks", fallbacks)?;
        Ok(d)
    }

    /// This communicator with `hints` over its own (a new handle on the
    /// same communicator, as Rust's `Comm::with_hints`).
    fn with_hints(&self, py: Python<'_>, hints: BTreeMap<String, String>) -> PyResult<PyComm> {
        self.comm
            .with_hints(hints)
            .map(|comm| PyComm { comm })
            .map_err(|e| chorus_err(py, e))
    }

    /// Every hint of this handle.
    fn get_hints(&self) -> BTreeMap<String, String> {
        self.comm.hints().clone()
    }

    /// Set the default op timeout (seconds) in place.
    fn set_timeout(&self, seconds: f64) -> PyResult<()> {
        self.comm.set_timeout(duration(seconds)?);
        Ok(())
    }

    fn get_backend_version(&self) -> String {
        self.comm.backend_version().to_string()
    }

    /// The flight recorder's entries, oldest first, as dicts (the fields of
    /// Rust's `FlightEntry`; timestamps in microseconds since the epoch).
    fn flight_record<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        self.comm
            .flight_record()
            .iter()
            .map(|e| flight_entry(py, e))
            .collect()
    }

    /// Call `hook(dict)` for every op when it completes.
    fn register_post_hook(&self, hook: Py<PyAny>) -> PyHandle {
        let h = self.comm.register_post_hook(move |a: &PostHookArgs| {
            call_hook(&hook, |py| post_args(py, a));
        });
        PyHandle::new(h)
    }

    /// Call `hook(dict)` once when the communicator is aborted, before its
    /// outstanding ops are failed.
    fn register_abort_hook(&self, hook: Py<PyAny>) -> PyHandle {
        let h = self.comm.register_abort_hook(move |a: &AbortHookArgs| {
            call_hook(&hook, |py| abort_args(py, a));
        });
        PyHandle::new(h)
    }

    /// A one-sided window of `size` bytes on this rank (collective).
    #[pyo3(signature = (size, timeout=None))]
    fn new_window(&self, py: Python<'_>, size: usize, timeout: Option<f64>) -> PyResult<PyWindow> {
        drain_releases(py);
        let comm = self.with(timeout)?;
        py.detach(move || comm.new_window(size))
            .map(|win| PyWindow { win })
            .map_err(|e| chorus_err(py, e))
    }

    #[pyo3(signature = (ranks, name, timeout=None))]
    fn split(
        &self,
        py: Python<'_>,
        ranks: Vec<usize>,
        name: String,
        timeout: Option<f64>,
    ) -> PyResult<Option<PyComm>> {
        drain_releases(py);
        let comm = self.with(timeout)?;
        py.detach(move || comm.split(&ranks, &name))
            .map(|c| c.map(|comm| PyComm { comm }))
            .map_err(|e| chorus_err(py, e))
    }

    #[pyo3(signature = (timeout=None, min_size=None, wait_joiners=0))]
    fn reconfigure<'py>(
        &self,
        py: Python<'py>,
        timeout: Option<f64>,
        min_size: Option<usize>,
        wait_joiners: usize,
    ) -> PyResult<(PyComm, Bound<'py, PyDict>)> {
        drain_releases(py);
        let mut opts = ReconfigureOptions {
            min_size,
            wait_joiners,
            ..ReconfigureOptions::default()
        };
        if let Some(t) = timeout {
            opts.timeout = duration(t)?;
        }
        let comm = self.comm.clone();
        let (next, map) = py
            .detach(move || comm.reconfigure(opts))
            .map_err(|e| chorus_err(py, e))?;
        let d = PyDict::new(py);
        d.set_item("epoch", map.epoch)?;
        d.set_item("size", map.size)?;
        d.set_item("old_to_new", map.old_to_new)?;
        d.set_item("joined", map.joined)?;
        Ok((PyComm { comm: next }, d))
    }

    // -------------------------------------------------------------- collectives

    #[pyo3(signature = (tensor, dtype, op, factor, timeout=None))]
    fn all_reduce(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        dtype: u8,
        op: u8,
        factor: f64,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        let op = reduce_op(op, factor)?;
        let (t, dest) = Buf::get(tensor, dtype)?.output()?;
        self.submit(
            py,
            timeout,
            move |c| c.all_reduce_async(t, op),
            move |t| dest.fill(&t),
        )
    }

    #[pyo3(signature = (tensor, dtype, root, op, factor, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        dtype: u8,
        root: usize,
        op: u8,
        factor: f64,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        let op = reduce_op(op, factor)?;
        let (t, dest) = Buf::get(tensor, dtype)?.output()?;
        self.submit(
            py,
            timeout,
            move |c| c.reduce_async(t, op, root),
            move |t| dest.fill(&t),
        )
    }

    #[pyo3(signature = (tensor, dtype, root, timeout=None))]
    fn broadcast(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        dtype: u8,
        root: usize,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        let (t, dest) = Buf::get(tensor, dtype)?.output()?;
        self.submit(
            py,
            timeout,
            move |c| c.broadcast_async(t, root),
            move |t| dest.fill(&t),
        )
    }

    #[pyo3(signature = (output, input, dtype, timeout=None))]
    fn all_gather_single(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        dtype: u8,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        let out_buf = Buf::get(output, dtype)?;
        let (out, dest) = out_buf.output()?;
        let input = Buf::get(input, dtype)?.input_beside(&[&out_buf]);
        self.submit(
            py,
            timeout,
            move |c| c.all_gather_into_async(input, out),
            move |(out, _)| dest.fill(&out),
        )
    }

    /// `all_gather` and `all_gather_v`: `outputs` lists one buffer per rank
    /// (equal sizes, or any sizes for the `v` form).
    #[pyo3(signature = (outputs, input, dtype, timeout=None))]
    fn all_gather_v(
        &self,
        py: Python<'_>,
        outputs: &Bound<'_, PyList>,
        input: &Bound<'_, PyAny>,
        dtype: u8,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        let outs = bufs(outputs, dtype)?;
        let counts: Vec<usize> = outs.iter().map(Buf::len).collect();
        let dests = dests(&outs)?;
        let input = Buf::get(input, dtype)?.tensor();
        self.submit(
            py,
            timeout,
            move |c| c.all_gather_v_async(input, &counts),
            move |t| fill_split(&dests, &t),
        )
    }

    #[pyo3(signature = (output, input, dtype, op, factor, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter_single(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        dtype: u8,
        op: u8,
        factor: f64,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        let op = reduce_op(op, factor)?;
        let (out, dest) = Buf::get(output, dtype)?.output()?;
        // The cpu backend reduces into its input (and PREMUL_SUM scales it):
        // work on a copy, so the caller's input stays as it was.
        let input = Buf::get(input, dtype)?.copy();
        self.submit(
            py,
            timeout,
            move |c| c.reduce_scatter_into_async(input, out, op),
            move |(out, _)| dest.fill(&out),
        )
    }

    /// `reduce_scatter` and `reduce_scatter_v`: `inputs` lists one buffer
    /// per rank (equal sizes, or any sizes for the `v` form).
    #[pyo3(signature = (output, inputs, dtype, op, factor, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn reduce_scatter_v(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        inputs: &Bound<'_, PyList>,
        dtype: u8,
        op: u8,
        factor: f64,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        let op = reduce_op(op, factor)?;
        let (_, dest) = Buf::get(output, dtype)?.output()?;
        let ins = bufs(inputs, dtype)?;
        let counts: Vec<usize> = ins.iter().map(Buf::len).collect();
        let parts: Vec<Tensor> = ins.iter().map(Buf::copy).collect();
        let input = Tensor::concat(dtype_of(dtype)?, &parts)
            .ok_or_else(|| PyValueError::new_err("no memory for the concatenated inputs"))?;
        self.submit(
            py,
            timeout,
            move |c| c.reduce_scatter_v_async(input, &counts, op),
            move |t| dest.fill(&t),
        )
    }

    #[pyo3(signature = (output, input, dtype, timeout=None))]
    fn all_to_all_single(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        dtype: u8,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        let dest = Buf::get(output, dtype)?.output()?.1;
        let input = Buf::get(input, dtype)?.tensor();
        self.submit(
            py,
            timeout,
            move |c| c.all_to_all_single_async(input),
            move |t| dest.fill(&t),
        )
    }

    #[pyo3(signature = (output, input, output_split_sizes, input_split_sizes, dtype, timeout=None))]
    #[allow(clippy::too_many_arguments)]
    fn all_to_all_v_single(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        output_split_sizes: Vec<usize>,
        input_split_sizes: Vec<usize>,
        dtype: u8,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        let dest = Buf::get(output, dtype)?.output()?.1;
        let input = Buf::get(input, dtype)?.tensor();
        self.submit(
            py,
            timeout,
            move |c| c.all_to_all_v_single_async(input, &input_split_sizes, &output_split_sizes),
            move |t| dest.fill(&t),
        )
    }

    #[pyo3(signature = (outputs, inputs, dtype, timeout=None))]
    fn all_to_all(
        &self,
        py: Python<'_>,
        outputs: &Bound<'_, PyList>,
        inputs: &Bound<'_, PyList>,
        dtype: u8,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        let outs = bufs(outputs, dtype)?;
        let dests = dests(&outs)?;
        // The outputs as views of the caller's buffers where they can be
        // (then filled in place, and `fill` below copies nothing).
        let outputs: Vec<Tensor> = outs.iter().map(Buf::tensor).collect();
        let inputs: Vec<Tensor> = bufs(inputs, dtype)?.iter().map(Buf::tensor).collect();
        self.submit(
            py,
            timeout,
            move |c| c.all_to_all_into_async(inputs, outputs),
            move |(ts, _inputs): (Vec<Tensor>, Vec<Tensor>)| {
                if ts.len() != dests.len() {
                    return Err(Failure::Value(format!(
                        "{} results for {} output buffers",
                        ts.len(),
                        dests.len()
                    )));
                }
                dests.iter().zip(&ts).try_for_each(|(d, t)| d.fill(t))
            },
        )
    }

    #[pyo3(signature = (timeout=None))]
    fn barrier(&self, py: Python<'_>, timeout: Option<f64>) -> PyResult<PyWork> {
        self.submit(py, timeout, |c| c.barrier_async(), |()| Ok(()))
    }

    /// `inputs` is `None` on ranks other than `root`.
    #[pyo3(signature = (output, inputs, root, dtype, timeout=None))]
    fn scatter(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        inputs: Option<&Bound<'_, PyList>>,
        root: usize,
        dtype: u8,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        let (out, dest) = Buf::get(output, dtype)?.output()?;
        let inputs = match inputs {
            Some(l) => Some(bufs(l, dtype)?.iter().map(Buf::copy).collect::<Vec<_>>()),
            None => None,
        };
        self.submit(
            py,
            timeout,
            move |c| c.scatter_async(out, inputs, root),
            move |t| dest.fill(&t),
        )
    }

    /// `outputs` (one buffer per rank) is only used on `root`.
    #[pyo3(signature = (outputs, input, root, dtype, timeout=None))]
    fn gather(
        &self,
        py: Python<'_>,
        outputs: &Bound<'_, PyList>,
        input: &Bound<'_, PyAny>,
        root: usize,
        dtype: u8,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        let dests = dests(&bufs(outputs, dtype)?)?;
        let input = Buf::get(input, dtype)?.tensor();
        self.submit(
            py,
            timeout,
            move |c| c.gather_async(input, root),
            move |ts: Vec<Tensor>| {
                if ts.is_empty() {
                    return Ok(()); // not the root
                }
                if ts.len() != dests.len() {
                    return Err(Failure::Value(format!(
                        "{} results for {} output buffers",
                        ts.len(),
                        dests.len()
                    )));
                }
                dests.iter().zip(&ts).try_for_each(|(d, t)| d.fill(t))
            },
        )
    }

    /// `gather` into one buffer (rank order) on `root`.
    #[pyo3(signature = (output, input, root, dtype, timeout=None))]
    fn gather_single(
        &self,
        py: Python<'_>,
        output: &Bound<'_, PyAny>,
        input: &Bound<'_, PyAny>,
        root: usize,
        dtype: u8,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        let dtype_ = dtype_of(dtype)?;
        let dest = Buf::get(output, dtype)?.output()?.1;
        let input = Buf::get(input, dtype)?.tensor();
        self.submit(
            py,
            timeout,
            move |c| c.gather_async(input, root),
            move |ts: Vec<Tensor>| {
                if ts.is_empty() {
                    return Ok(());
                }
                let all = Tensor::concat(dtype_, &ts)
                    .ok_or_else(|| Failure::Value("no memory to gather into".into()))?;
                dest.fill(&all)
            },
        )
    }

    // -------------------------------------------------------------- p2p

    #[pyo3(signature = (tensor, dst, dtype, timeout=None))]
    fn send(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        dst: usize,
        dtype: u8,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        let t = Buf::get(tensor, dtype)?.tensor();
        self.submit(py, timeout, move |c| c.send_async(t, dst), |_| Ok(()))
    }

    #[pyo3(signature = (tensor, src, dtype, timeout=None))]
    fn recv(
        &self,
        py: Python<'_>,
        tensor: &Bound<'_, PyAny>,
        src: usize,
        dtype: u8,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        let (t, dest) = Buf::get(tensor, dtype)?.output()?;
        self.submit(
            py,
            timeout,
            move |c| c.recv_async(t, src),
            move |t| dest.fill(&t),
        )
    }

    /// `ops`: `(is_send, buffer, dtype, peer)` tuples, issued as one batch.
    #[pyo3(signature = (ops, timeout=None))]
    fn batch_p2p(
        &self,
        py: Python<'_>,
        ops: Vec<(bool, Bound<'_, PyAny>, u8, usize)>,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        let bufs = ops
            .iter()
            .map(|(_, obj, dtype, _)| Buf::get(obj, *dtype))
            .collect::<PyResult<Vec<Buf>>>()?;
        let recvs: Vec<&Buf> = bufs
            .iter()
            .zip(&ops)
            .filter(|(_, op)| !op.0)
            .map(|(b, _)| b)
            .collect();
        if recvs
            .iter()
            .enumerate()
            .any(|(i, a)| recvs[i + 1..].iter().any(|b| a.overlaps(b)))
        {
            return Err(PyValueError::new_err(
                "two receives of one batch write into the same memory",
            ));
        }
        let mut p2p = Vec::with_capacity(ops.len());
        let mut dests: Vec<Option<Dest>> = Vec::with_capacity(ops.len());
        for (b, (is_send, _, _, peer)) in bufs.iter().zip(&ops) {
            if *is_send {
                p2p.push(P2POp::send(b.input_beside(&recvs), *peer));
                dests.push(None);
            } else {
                let (t, d) = b.output()?;
                p2p.push(P2POp::recv(t, *peer));
                dests.push(Some(d));
            }
        }
        self.submit(
            py,
            timeout,
            move |c| c.batch_p2p_async(p2p),
            move |ts: Vec<Tensor>| {
                if ts.len() != dests.len() {
                    return Err(Failure::Value(format!(
                        "{} results for {} ops",
                        ts.len(),
                        dests.len()
                    )));
                }
                for (d, t) in dests.iter().zip(&ts) {
                    if let Some(d) = d {
                        d.fill(t)?;
                    }
                }
                Ok(())
            },
        )
    }

    fn __repr__(&self) -> String {
        format!(
            "Comm(name={:?}, rank={}, size={}, backend={:?}, device={:?})",
            self.comm.name(),
            self.comm.rank(),
            self.comm.size(),
            self.comm.backend(),
            self.comm.device().to_string()
        )
    }
}

// ------------------------------------------------------------------ hooks

/// A registered hook (TorchComms' `RemovableHandle`). Unlike the Rust
/// handle, dropping the Python object leaves the hook registered (as
/// `torch.utils.hooks.RemovableHandle` does); only `remove()` removes it.
#[pyclass(name = "RemovableHandle", module = "chorus._chorus")]
struct PyHandle {
    handle: Mutex<Option<RemovableHandle>>,
}

impl PyHandle {
    fn new(h: RemovableHandle) -> PyHandle {
        PyHandle {
            handle: Mutex::new(Some(h)),
        }
    }
}

impl Drop for PyHandle {
    fn drop(&mut self) {
        let slot = self.handle.get_mut().unwrap_or_else(|e| e.into_inner());
        // Keep the hook: forget the Rust handle (a weak reference) instead
        // of dropping it, which would unregister the hook.
        std::mem::forget(slot.take());
    }
}

#[pymethods]
impl PyHandle {
    /// Unregister the hook: it is not called again (a call already running
    /// finishes). Calling it again does nothing.
    fn remove(&self) {
        drop(self.handle.lock().unwrap_or_else(|e| e.into_inner()).take());
    }
}

/// Run a Python hook where hooks run: take the GIL, build its argument,
/// call it; an exception goes to `sys.unraisablehook`, as for any Python
/// callback that has no caller to raise into.
fn call_hook(hook: &Py<PyAny>, args: impl FnOnce(Python<'_>) -> PyResult<Bound<'_, PyDict>>) {
    Python::attach(|py| {
        let r = args(py).and_then(|a| hook.call1(py, (a,)));
        if let Err(e) = r {
            e.write_unraisable(py, Some(hook.bind(py)));
        }
    });
}

fn post_args<'py>(py: Python<'py>, a: &PostHookArgs) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("op_id", a.op_id)?;
    d.set_item("op", a.op)?;
    d.set_item("comm", &a.comm)?;
    d.set_item("rank", a.rank)?;
    d.set_item("seq", a.seq)?;
    d.set_item("duration", a.duration.as_secs_f64())?;
    d.set_item("run_duration", a.run_duration.map(|t| t.as_secs_f64()))?;
    let error = match &a.result {
        Ok(()) => None,
        Err(e) => Some(chorus_err(py, e.clone()).into_value(py)),
    };
    d.set_item("error", error)?;
    Ok(d)
}

fn abort_args<'py>(py: Python<'py>, a: &AbortHookArgs) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("comm", &a.comm)?;
    d.set_item("rank", a.rank)?;
    d.set_item("epoch", a.epoch)?;
    d.set_item("cause", chorus_err(py, a.cause.clone()).into_value(py))?;
    Ok(d)
}

fn flight_entry<'py>(py: Python<'py>, e: &FlightEntry) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("id", e.id)?;
    d.set_item("op_id", e.op_id)?;
    d.set_item("seq", e.seq)?;
    d.set_item("op", e.op)?;
    d.set_item("dtype", e.dtype.to_string())?;
    d.set_item("count", e.count)?;
    d.set_item("bytes", e.bytes)?;
    d.set_item("root", e.root)?;
    d.set_item("peers", &e.peers)?;
    d.set_item("tag", &e.tag)?;
    let state = match e.state {
        chorus::FlightState::Queued => "queued",
        chorus::FlightState::Started => "started",
        chorus::FlightState::Completed => "completed",
        chorus::FlightState::Failed => "failed",
    };
    d.set_item("state", state)?;
    d.set_item("error", &e.error)?;
    d.set_item("issued_us", e.issued_us)?;
    d.set_item("started_us", e.started_us)?;
    d.set_item("completed_us", e.completed_us)?;
    Ok(d)
}

// ------------------------------------------------------------------ windows

/// A one-sided window (low-level form of `chorus.Window`): byte offsets,
/// explicit signal values.
#[pyclass(name = "Window", module = "chorus._chorus")]
struct PyWindow {
    win: chorus::Window,
}

impl PyWindow {
    fn with(&self, timeout: Option<f64>) -> PyResult<chorus::Window> {
        Ok(match timeout {
            Some(s) => self.win.with_timeout(duration(s)?),
            None => self.win.clone(),
        })
    }
}

#[pymethods]
impl PyWindow {
    /// This rank's window size in bytes.
    fn get_size(&self) -> usize {
        self.win.size()
    }

    /// Every rank's window size in bytes.
    fn sizes(&self) -> Vec<usize> {
        self.win.sizes().to_vec()
    }

    /// `(unified, size)` of `peer`'s window: whether it is mapped into this
    /// process, and its size in bytes.
    fn get_attr(&self, py: Python<'_>, peer: usize) -> PyResult<(bool, usize)> {
        let a = self.win.get_attr(peer).map_err(|e| chorus_err(py, e))?;
        Ok((a.access_type == WindowAccess::Unified, a.size))
    }

    /// Put `data`'s bytes into `dst`'s window at byte `offset`.
    #[pyo3(signature = (data, dtype, dst, offset, timeout=None))]
    fn put(
        &self,
        py: Python<'_>,
        data: &Bound<'_, PyAny>,
        dtype: u8,
        dst: usize,
        offset: usize,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        drain_releases(py);
        let data = Buf::get(data, dtype)?.tensor();
        let win = self.with(timeout)?;
        let work = py.detach(|| win.put_async(data, dst, offset));
        Ok(PyWork::new(work, |_| Ok(())))
    }

    /// Add `value` to this rank's signal counter in `dst`'s window.
    #[pyo3(signature = (dst, value, timeout=None))]
    fn signal(
        &self,
        py: Python<'_>,
        dst: usize,
        value: u64,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        drain_releases(py);
        let win = self.with(timeout)?;
        let work = py.detach(|| win.signal_async(dst, value));
        Ok(PyWork::new(work, |()| Ok(())))
    }

    /// Wait until `src`'s signal counter in this window reaches `value`.
    #[pyo3(signature = (src, value, timeout=None))]
    fn wait_signal(
        &self,
        py: Python<'_>,
        src: usize,
        value: u64,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        drain_releases(py);
        let win = self.with(timeout)?;
        let work = py.detach(|| win.wait_signal_async(src, value));
        Ok(PyWork::new(work, |()| Ok(())))
    }

    /// Copy this rank's window bytes from `offset` into `out`.
    #[pyo3(signature = (out, offset, timeout=None))]
    fn read(
        &self,
        py: Python<'_>,
        out: &Bound<'_, PyAny>,
        offset: usize,
        timeout: Option<f64>,
    ) -> PyResult<PyWork> {
        drain_releases(py);
        let buf = Buf::get(out, DType::U8.code())?;
        if buf.readonly {
            return Err(PyValueError::new_err("the output buffer is read-only"));
        }
        let dest = buf.dest();
        let win = self.with(timeout)?;
        let work = py.detach(|| win.read_async(offset, buf.len_bytes));
        Ok(PyWork::new(work, move |bytes: Vec<u8>| {
            dest.fill(&Tensor::from_slice(&bytes))
        }))
    }

    /// Free the window on every rank (collective).
    fn free(&self, py: Python<'_>) -> PyResult<()> {
        drain_releases(py);
        let win = self.win.clone();
        py.detach(move || win.free()).map_err(|e| chorus_err(py, e))
    }

    fn __repr__(&self) -> String {
        format!("Window(id={}, sizes={:?})", self.win.id(), self.win.sizes())
    }
}

/// Options from `new_comm`'s / `join_comm`'s keywords; `host_store`: rank 0
/// hosts the store at `store` (the rendezvous `MASTER_ADDR`/`MASTER_PORT`
/// give), instead of `store` naming a running `chorus-rendezvous`.
#[allow(clippy::too_many_arguments)]
fn options(
    timeout: Option<f64>,
    connect_timeout: Option<f64>,
    store: Option<String>,
    host_store: bool,
    secret: Option<String>,
    rank: Option<usize>,
    size: Option<usize>,
    hints: Option<BTreeMap<String, String>>,
) -> PyResult<CommOptions> {
    let mut opts = CommOptions {
        hints: hints.unwrap_or_default(),
        ..CommOptions::default()
    };
    if let Some(t) = timeout {
        opts.timeout = duration(t)?;
    }
    if let Some(t) = connect_timeout {
        opts.connect_timeout = duration(t)?;
    }
    if let Some(addr) = store {
        let sa = std::net::ToSocketAddrs::to_socket_addrs(&addr)
            .ok()
            .and_then(|mut a| a.next())
            .ok_or_else(|| {
                PyValueError::new_err(format!("store {addr:?} is not a host:port address"))
            })?;
        opts.rendezvous = if host_store {
            Rendezvous::Master(sa)
        } else {
            Rendezvous::Server(sa)
        };
    }
    if let Some(s) = secret {
        opts = opts.with_secret(s.into_bytes());
    }
    match (rank, size) {
        (Some(r), Some(s)) => opts = opts.with_rank(r, s),
        (None, None) => {}
        _ => return Err(PyValueError::new_err("pass both rank and size, or neither")),
    }
    Ok(opts)
}

/// Create a communicator (blocking, without the GIL, until every rank has
/// joined or `connect_timeout` passed).
#[pyfunction]
#[pyo3(signature = (backend, device, name, timeout=None, connect_timeout=None, store=None, secret=None, rank=None, size=None, hints=None, checks=None, host_store=false))]
#[allow(clippy::too_many_arguments)]
fn new_comm(
    py: Python<'_>,
    backend: String,
    device: String,
    name: String,
    timeout: Option<f64>,
    connect_timeout: Option<f64>,
    store: Option<String>,
    secret: Option<String>,
    rank: Option<usize>,
    size: Option<usize>,
    hints: Option<BTreeMap<String, String>>,
    checks: Option<String>,
    host_store: bool,
) -> PyResult<PyComm> {
    drain_releases(py);
    let device: Device = device.parse().map_err(|e| chorus_err(py, e))?;
    let mut opts = options(
        timeout,
        connect_timeout,
        store,
        host_store,
        secret,
        rank,
        size,
        hints,
    )?;
    if let Some(c) = checks {
        opts.checks = chorus::checks::parse_checks(&c).map_err(|e| chorus_err(py, e))?;
    }
    py.detach(move || chorus::new_comm(&backend, device, &name, opts))
        .map(|comm| PyComm { comm })
        .map_err(|e| chorus_err(py, e))
}

/// This process's `(rank, size)` as `new_comm` resolves them: `rank` and
/// `size` when given, else the launcher's environment, else `(0, 1)`.
#[pyfunction]
#[pyo3(signature = (rank=None, size=None))]
fn rank_size(py: Python<'_>, rank: Option<usize>, size: Option<usize>) -> PyResult<(usize, usize)> {
    let opts = options(None, None, None, false, None, rank, size, None)?;
    chorus::bootstrap::rank_size(&opts).map_err(|e| chorus_err(py, e))
}

/// Join a running communicator as a new rank: blocks (without the GIL)
/// until the survivors `reconfigure` with this rank admitted.
#[pyfunction]
#[pyo3(signature = (backend, device, name, timeout=None, connect_timeout=None, store=None, secret=None))]
#[allow(clippy::too_many_arguments)]
fn join_comm(
    py: Python<'_>,
    backend: String,
    device: String,
    name: String,
    timeout: Option<f64>,
    connect_timeout: Option<f64>,
    store: Option<String>,
    secret: Option<String>,
) -> PyResult<PyComm> {
    drain_releases(py);
    let device: Device = device.parse().map_err(|e| chorus_err(py, e))?;
    let opts = options(
        timeout,
        connect_timeout,
        store,
        false,
        secret,
        None,
        None,
        None,
    )?;
    py.detach(move || chorus::join_comm(&backend, device, &name, opts))
        .map(|comm| PyComm { comm })
        .map_err(|e| chorus_err(py, e))
}

/// Release buffer exports parked by ops that ended off the Python thread
/// (also done by every other call); for tests that count references.
#[pyfunction]
fn _release_parked(py: Python<'_>) {
    drain_releases(py);
}

/// `(bytes copied in, bytes copied out)` by this process so far.
#[pyfunction]
fn _copy_stats() -> (u64, u64) {
    (
        COPIED_IN.load(Ordering::Relaxed),
        COPIED_OUT.load(Ordering::Relaxed),
    )
}

/// A fresh op id (Rust's `chorus::hooks::reserve_op_id`), for the pre
/// hooks the Python layer runs before it issues an op.
#[pyfunction]
fn _reserve_op_id() -> u64 {
    chorus::hooks::reserve_op_id()
}

/// Call `f()` with `op_id` reserved for the first op it issues on this
/// thread (Rust's `chorus::hooks::with_op_id`): the op's post hooks and
/// flight-recorder entry carry the id its pre hooks saw. Returns `(f's
/// result, whether an op took the id)`.
#[pyfunction]
fn _with_op_id(op_id: u64, f: &Bound<'_, PyAny>) -> PyResult<(Py<PyAny>, bool)> {
    let (out, taken) = chorus::hooks::with_op_id(op_id, || f.call0().map(Bound::unbind));
    Ok((out?, taken))
}

/// Report `exc`, raised by the hook `hook`, to `sys.unraisablehook`, as
/// the errors of hooks Chorus runs itself are.
#[pyfunction]
fn _write_unraisable(exc: &Bound<'_, PyAny>, hook: &Bound<'_, PyAny>) {
    PyErr::from_value(exc.clone()).write_unraisable(exc.py(), Some(hook));
}

#[pymodule]
fn _chorus(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyComm>()?;
    m.add_class::<PyWork>()?;
    m.add_class::<PyHandle>()?;
    m.add_class::<PyWindow>()?;
    m.add_function(wrap_pyfunction!(new_comm, m)?)?;
    m.add_function(wrap_pyfunction!(rank_size, m)?)?;
    m.add_function(wrap_pyfunction!(join_comm, m)?)?;
    m.add_function(wrap_pyfunction!(_release_parked, m)?)?;
    m.add_function(wrap_pyfunction!(_copy_stats, m)?)?;
    m.add_function(wrap_pyfunction!(_reserve_op_id, m)?)?;
    m.add_function(wrap_pyfunction!(_with_op_id, m)?)?;
    m.add_function(wrap_pyfunction!(_write_unraisable, m)?)?;
    m.add_class::<dlpack::DlpackView>()?;
    m.add_function(wrap_pyfunction!(dlpack::_dlpack_view, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
