//! The `nccl` and `rccl` backends: one implementation over the NCCL C API,
//! which RCCL exports unchanged, with the CUDA runtime or HIP for streams and
//! device memory ([`Flavor`] picks the libraries and symbol prefix).
//!
//! Three layers, as in cudarc: [`sys`] (FFI tables loaded at run time with
//! `libloading`), [`result`] (status → `Result`), and this module (the
//! [`Backend`]). Pure-Rust planning lives in [`plan`] and is unit-tested
//! without a GPU.
//!
//! Device tensors ([`Tensor::is_device`], allocated through
//! [`XcclMemory`] or adopted with [`Tensor::from_device_ptr`]) are used in
//! place: the NCCL calls get their device pointers, with no host staging;
//! `Avg` is `ncclAvg` and `PremulSum` a `ncclRedOpCreatePreMulSum` op.
//! Host tensors are staged through device memory on the communicator's own
//! stream: host → device copy, the NCCL call(s), wait for the stream,
//! device → host copy.
//!
//! # Invariants
//! - XC-1: the libraries are loaded and a device is found before any I/O or
//!   NCCL call; a missing library, symbol or device is
//!   `BackendUnavailable{backend, reason}` naming what is missing — never a
//!   panic (cudarc panics here, hence our own loader).
//! - XC-2: the NCCL unique id travels through the store under
//!   `{key_prefix}/{backend}/id`; rank 0 writes it, every other rank waits
//!   for it within `connect_timeout`.
//! - XC-3: the communicator is created non-blocking (`blocking = 0`) and
//!   polled with `ncclCommGetAsyncError`; init that does not finish within
//!   `connect_timeout` is aborted (`ncclCommAbort`) and reported.
//! - XC-4: an op completes when an event recorded after it on the stream
//!   completed, not when it was enqueued; the communicator's
//!   [completion thread](completion) waits for it, polling
//!   `ncclCommGetAsyncError` meanwhile so a remote failure becomes
//!   `PeerFailed` instead of a hang, and wakes the op (no timer on the
//!   op's side). The device → host copy of a host op is only enqueued
//!   after that, so host buffers are never written by the device after
//!   `execute` returned or was dropped.
//! - XC-5: after an error the communicator is unusable until `abort`
//!   ([BE-2]), which calls `ncclCommAbort`; `Drop` aborts (never destroys,
//!   which could block) and never panics.
//! - XC-6: abort notices, finalize, barriers and (with strict checks, or
//!   for ops that always exchange them) op headers run over a
//!   [`CpuBackend`] control mesh. With fingerprint checks a collective
//!   launches with no message on it: NCCL cannot carry a fingerprint in its
//!   data, so a mismatch (which hangs the op, or gives wrong results) is
//!   found off the critical path by the heartbeats' stall and history
//!   checks (`crate::actors`' op log) and aborts every rank with
//!   `Mismatch`. Point-to-point keeps its pairwise exchange, since the op
//!   log cannot see it.
//! - XC-7: while no op runs, the executor polls `ncclCommGetAsyncError`
//!   ([BE-3]): an error NCCL finds between ops (a lost peer, a device fault)
//!   aborts the communicator and reaches `health()` without waiting for the
//!   next op. NCCL does not say which rank failed, so such an error names
//!   none unless the heartbeats (the watchdog's WD-2) name one first.
//! - XC-9: the memory of every device tensor an op uses is kept allocated
//!   (its keep-alive held by the backend) until the op finished on the
//!   device, or until the communicator was aborted (`ncclCommAbort`, then
//!   the stream drained), even when the op's `Work` and its tensors were
//!   dropped first; a PreMulSum op is destroyed once the op that uses it
//!   finished (or right away when enqueueing failed).
//! - XC-10: an op issued through `Comm::with_stream` waits on the device
//!   for the work queued on the caller's stream before it was issued: an
//!   event recorded there and `*StreamWaitEvent` on the communicator's
//!   stream, before the op's first call; once the op is enqueued, the
//!   completion thread publishes a fence (an event after the op) for
//!   `Work::wait_stream`. The host never waits for the caller's stream.
//! - XC-8: `split` uses `ncclCommSplit` when the library has it (NCCL >=
//!   2.18; [BE-4]): every parent rank calls it (non-members with
//!   `NCCL_SPLIT_NOCOLOR`), the child's rank is the key, and the child gets
//!   its own stream and control mesh. Without the symbol, a child connects
//!   from a fresh unique id like any new communicator.
//!
//! [BE-2]: crate::backends#invariants
//! [BE-3]: crate::backends#invariants
//! [BE-4]: crate::backends#invariants

use std::ffi::{c_int, c_void};
use std::sync::Arc;
use std::time::{Duration, Instant};

use async_trait::async_trait;

use super::cpu::CpuBackend;
use super::{Backend, BackendInit, IdleCtx, OpCtx, OpData, SplitArgs};
use crate::error::{Error, Result};
use crate::options::Device;
use crate::tensor::{DType, Tensor};

pub mod completion;
pub mod plan;
pub mod result;
pub mod sys;
pub mod window;

pub use completion::live_completion_threads;
use plan::{Buf, Call};
use result::CallError;

/// `cudaMemcpyDeviceToDevice` / `hipMemcpyDeviceToDevice`.
const MEMCPY_D2D: c_int = 3;
/// Poll interval while waiting for the stream or a non-blocking call.
const POLL: Duration = Duration::from_micros(50);

/// Which vendor stack a communicator uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// NVIDIA NCCL + CUDA runtime.
    Nccl,
    /// AMD RCCL + HIP.
    Rccl,
}

impl Flavor {
    /// Backend name.
    pub fn name(self) -> &'static str {
        match self {
            Flavor::Nccl => "nccl",
            Flavor::Rccl => "rccl",
        }
    }

    /// Collective library file names tried, in order. The NCCL pip wheels
    /// (`nvidia-nccl-cu12`, `nvidia-nccl-cu13`) ship only `libnccl.so.2`.
    pub fn collective_libs(self) -> &'static [&'static str] {
        match self {
            Flavor::Nccl => &["libnccl.so.2", "libnccl.so"],
            Flavor::Rccl => &["librccl.so.1", "librccl.so"],
        }
    }

    /// Runtime library file names tried, in order: CUDA 12 first (it runs
    /// on older drivers than 13), then CUDA 13 (`libcudart.so.13`, what
    /// PyTorch's CUDA 13 builds install), then the unversioned name.
    pub fn runtime_libs(self) -> &'static [&'static str] {
        match self {
            Flavor::Nccl => &["libcudart.so.12", "libcudart.so.13", "libcudart.so"],
            Flavor::Rccl => &[
                "libamdhip64.so.7",
                "libamdhip64.so.6",
                "libamdhip64.so.5",
                "libamdhip64.so",
            ],
        }
    }

    fn prefix(self) -> &'static str {
        match self {
            Flavor::Nccl => "cuda",
            Flavor::Rccl => "hip",
        }
    }
}

/// The loaded libraries of one flavor.
pub struct Vendor {
    nccl: sys::NcclApi,
    rt: sys::RtApi,
}

impl std::fmt::Debug for Vendor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Vendor")
            .field("nccl", &self.nccl.path)
            .field("runtime", &self.rt.path)
            .finish()
    }
}

impl Vendor {
    /// Load the runtime and collective libraries of `flavor` ([XC-1]).
    ///
    /// # Errors
    /// `BackendUnavailable` naming the libraries tried.
    ///
    /// [XC-1]: self#invariants
    pub fn load(flavor: Flavor) -> Result<Vendor> {
        let unavailable = |reason: String| Error::BackendUnavailable {
            backend: flavor.name(),
            reason,
        };
        let rt = sys::load_rt(flavor.runtime_libs(), flavor.prefix())
            .map_err(|e| unavailable(format!("{} runtime: {e}", flavor.prefix())))?;
        let nccl = sys::load_nccl(flavor.collective_libs()).map_err(|e| {
            unavailable(format!(
                "{e} (for NCCL: `pip install nvidia-nccl-cu13` or `nvidia-nccl-cu12`, and \
                 add its lib folder to LD_LIBRARY_PATH or CHORUS_LIB_DIRS)"
            ))
        })?;
        Ok(Vendor { nccl, rt })
    }

    /// Number of visible devices.
    ///
    /// # Errors
    /// `BackendUnavailable` when the runtime reports an error (no driver, no
    /// device) or zero devices.
    pub fn device_count(&self, flavor: Flavor) -> Result<usize> {
        let mut n: c_int = 0;
        // SAFETY: plain out-parameter call.
        let r = unsafe { (self.rt.get_device_count)(&mut n) };
        result::rt(&self.rt, "GetDeviceCount", r).map_err(|e| Error::BackendUnavailable {
            backend: flavor.name(),
            reason: format!("no usable device: {e}"),
        })?;
        if n <= 0 {
            return Err(Error::BackendUnavailable {
                backend: flavor.name(),
                reason: "the runtime sees no device".into(),
            });
        }
        Ok(n as usize)
    }

    /// NCCL/RCCL version code (e.g. 22105 for 2.21.5).
    pub fn version(&self) -> i32 {
        let mut v: c_int = 0;
        // SAFETY: plain out-parameter call.
        let _ = unsafe { (self.nccl.get_version)(&mut v) };
        v
    }
}

impl Vendor {
    /// The libraries of `flavor`, loaded once per process and never
    /// unloaded: NCCL keeps threads (RAS, bootstrap) alive for the life of
    /// the process, so a `dlclose` would pull code from under them. A failed
    /// load is not remembered (a later call tries again).
    ///
    /// # Errors
    /// As [`Vendor::load`].
    pub fn shared(flavor: Flavor) -> Result<Arc<Vendor>> {
        static LOADED: std::sync::Mutex<[Option<Arc<Vendor>>; 2]> =
            std::sync::Mutex::new([None, None]);
        let i = match flavor {
            Flavor::Nccl => 0,
            Flavor::Rccl => 1,
        };
        let mut slots = LOADED.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(v) = &slots[i] {
            return Ok(v.clone());
        }
        let v = Arc::new(Vendor::load(flavor)?);
        slots[i] = Some(v.clone());
        Ok(v)
    }
}

/// Sets a thread's current device for a scope and restores the caller's
/// device when dropped (each sync section of a turn; never held across an
/// await, which may move to another thread).
struct DeviceGuard<'a> {
    rt: &'a sys::RtApi,
    saved: Option<c_int>,
}

impl<'a> DeviceGuard<'a> {
    fn set(rt: &'a sys::RtApi, device: c_int) -> std::result::Result<DeviceGuard<'a>, CallError> {
        let mut cur: c_int = -1;
        // SAFETY: out-parameter call.
        let saved = (unsafe { (rt.get_device)(&mut cur) } == 0).then_some(cur);
        // SAFETY: plain runtime call.
        result::rt(rt, "SetDevice", unsafe { (rt.set_device)(device) })?;
        Ok(DeviceGuard { rt, saved })
    }
}

impl Drop for DeviceGuard<'_> {
    fn drop(&mut self) {
        if let Some(d) = self.saved {
            // SAFETY: restores a device the runtime reported.
            let _ = unsafe { (self.rt.set_device)(d) };
        }
    }
}

/// An open `ncclGroupStart`; dropping it always ends the group (group
/// state is per OS thread, so an early return must not leave it open).
struct GroupGuard<'a> {
    api: &'a sys::NcclApi,
    open: bool,
}

impl<'a> GroupGuard<'a> {
    fn start(api: &'a sys::NcclApi) -> std::result::Result<GroupGuard<'a>, CallError> {
        // SAFETY: plain call.
        result::nccl(api, "ncclGroupStart", unsafe { (api.group_start)() })?;
        Ok(GroupGuard { api, open: true })
    }

    fn end(mut self) -> std::result::Result<(), CallError> {
        self.open = false;
        // SAFETY: ends the group this guard started.
        result::nccl(self.api, "ncclGroupEnd", unsafe { (self.api.group_end)() })
    }
}

impl Drop for GroupGuard<'_> {
    fn drop(&mut self) {
        if self.open {
            // SAFETY: ends the group this guard started.
            let _ = unsafe { (self.api.group_end)() };
        }
    }
}

/// Whether `flavor` can run here: its libraries load and a device exists.
/// Returns the device count. Tests call this to skip with a printed reason.
///
/// # Errors
/// `BackendUnavailable` saying what is missing.
pub fn probe(flavor: Flavor) -> Result<usize> {
    let v = Vendor::shared(flavor)?;
    v.device_count(flavor)
}

/// A raw communicator pointer held across an await in `connect`.
#[derive(Clone, Copy)]
struct SendPtr(sys::ncclComm_t);
// SAFETY: only passed to ncclCommGetAsyncError, which is thread-safe.
unsafe impl Send for SendPtr {}

/// A device allocation that only grows.
#[derive(Debug)]
struct DevBuf {
    ptr: *mut c_void,
    cap: usize,
}

/// Device memory of one GPU through the vendor runtime: allocation
/// (`*Malloc` + `*MemsetAsync`) and copies (`*MemcpyAsync`), each on a
/// non-blocking stream of its own and synchronised before returning, never
/// on a communicator's stream. Device tensors it allocates are freed
/// (`*Free`, with the device set) when their last holder drops.
pub struct XcclMemory {
    api: Arc<Vendor>,
    device: c_int,
    stream: sys::Stream,
}

// SAFETY: the stream is only used for copies that are synchronised before
// the call returns; the runtime allows that from any thread, and every call
// sets the device first.
unsafe impl Send for XcclMemory {}
// SAFETY: as above; concurrent copies on one stream are serialised by the
// runtime, and each caller waits for its own.
unsafe impl Sync for XcclMemory {}

impl std::fmt::Debug for XcclMemory {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XcclMemory")
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

/// A device allocation made by [`XcclMemory`], freed when dropped.
struct DeviceAlloc {
    api: Arc<Vendor>,
    device: c_int,
    ptr: *mut c_void,
}

// SAFETY: a device address, only passed to `*Free`, which is thread-safe.
unsafe impl Send for DeviceAlloc {}
// SAFETY: shared access does nothing with the pointer.
unsafe impl Sync for DeviceAlloc {}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        let Ok(_dev) = DeviceGuard::set(&self.api.rt, self.device) else {
            return;
        };
        // SAFETY: allocated by `*Malloc` on this device; no op holds it (an
        // op keeps its own reference until finished, XC-9).
        let _ = unsafe { (self.api.rt.free)(self.ptr) };
    }
}

impl XcclMemory {
    fn new(api: Arc<Vendor>, device: c_int) -> std::result::Result<XcclMemory, CallError> {
        let rt = &api.rt;
        let mut stream: sys::Stream = std::ptr::null_mut();
        {
            let _dev = DeviceGuard::set(rt, device)?;
            // SAFETY: out-parameter call on the device.
            let r = unsafe { (rt.stream_create_with_flags)(&mut stream, sys::STREAM_NON_BLOCKING) };
            result::rt(rt, "StreamCreateWithFlags", r)?;
        }
        Ok(XcclMemory {
            api,
            device,
            stream,
        })
    }

    fn sync(&self) -> std::result::Result<(), CallError> {
        let rt = &self.api.rt;
        // SAFETY: live stream of this memory.
        result::rt(rt, "StreamSynchronize", unsafe {
            (rt.stream_synchronize)(self.stream)
        })
    }
}

impl Drop for XcclMemory {
    fn drop(&mut self) {
        if let Ok(_dev) = DeviceGuard::set(&self.api.rt, self.device) {
            // SAFETY: every copy on it was synchronised; destroyed once.
            let _ = unsafe { (self.api.rt.stream_destroy)(self.stream) };
        }
    }
}

impl super::DeviceMemory for XcclMemory {
    fn device(&self) -> Device {
        Device::Cuda(self.device as usize)
    }

    fn zeros(&self, dtype: DType, len: usize) -> std::result::Result<Tensor, String> {
        let bytes = len
            .checked_mul(dtype.size())
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| format!("{len} x {dtype} overflows"))?;
        let rt = &self.api.rt;
        let _dev = DeviceGuard::set(rt, self.device).map_err(|e| e.to_string())?;
        let mut p = std::ptr::null_mut();
        // Zero-length tensors get a real (small) allocation, so every
        // pointer NCCL sees is a valid device pointer.
        // SAFETY: out-parameter call, device set.
        let r = unsafe { (rt.malloc)(&mut p, bytes.max(256)) };
        result::rt(rt, "Malloc", r).map_err(|e| e.to_string())?;
        let owner = DeviceAlloc {
            api: self.api.clone(),
            device: self.device,
            ptr: p,
        };
        // SAFETY: `p` holds `bytes` bytes on this device.
        let r = unsafe { (rt.memset_async)(p, 0, bytes, self.stream) };
        result::rt(rt, "MemsetAsync", r)
            .and_then(|()| self.sync())
            .map_err(|e| e.to_string())?;
        Tensor::device_from_parts(p as usize, dtype, len, self.device(), Arc::new(owner))
            .map_err(|e| e.to_string())
    }

    fn copy(
        &self,
        src: &Tensor,
        src_off: usize,
        dst: &mut Tensor,
        dst_off: usize,
        len_bytes: usize,
    ) -> std::result::Result<(), String> {
        let fits = |t: &Tensor, off: usize| {
            off.checked_add(len_bytes)
                .is_some_and(|end| end <= t.len_bytes())
        };
        if !fits(src, src_off) || !fits(dst, dst_off) {
            return Err(format!(
                "copy of {len_bytes} bytes at {src_off} -> {dst_off} outside tensors of {} and {} bytes",
                src.len_bytes(),
                dst.len_bytes()
            ));
        }
        for t in [src, &*dst] {
            if t.is_device() && t.device() != self.device() {
                return Err(format!(
                    "a tensor on {} given to memory of {}",
                    t.device(),
                    self.device()
                ));
            }
        }
        if len_bytes == 0 {
            return Ok(());
        }
        let kind = match (src.is_device(), dst.is_device()) {
            (false, false) => {
                let from = src.as_bytes()[src_off..src_off + len_bytes].to_vec();
                dst.as_bytes_mut()[dst_off..dst_off + len_bytes].copy_from_slice(&from);
                return Ok(());
            }
            (false, true) => sys::MEMCPY_H2D,
            (true, false) => sys::MEMCPY_D2H,
            (true, true) => MEMCPY_D2D,
        };
        let s: *const u8 = match src.device_ptr() {
            Some(p) => p,
            None => src.as_bytes().as_ptr(),
        };
        let d: *mut u8 = match dst.device_ptr() {
            Some(p) => p,
            None => dst.as_bytes_mut().as_mut_ptr(),
        };
        let rt = &self.api.rt;
        let _dev = DeviceGuard::set(rt, self.device).map_err(|e| e.to_string())?;
        // SAFETY: ranges checked above; device pointers come from device
        // tensors of this device (valid while the tensors live, which they
        // do until `sync` returned), host pointers from live host tensors.
        let r = unsafe {
            (rt.memcpy_async)(
                d.wrapping_add(dst_off).cast(),
                s.wrapping_add(src_off).cast(),
                len_bytes,
                kind,
                self.stream,
            )
        };
        result::rt(rt, "MemcpyAsync", r)
            .and_then(|()| self.sync())
            .map_err(|e| e.to_string())
    }
}

/// The NCCL/RCCL backend of one communicator on one rank.
pub struct XcclBackend {
    flavor: Flavor,
    comm_name: String,
    rank: usize,
    device: c_int,
    api: Arc<Vendor>,
    comm: sys::ncclComm_t,
    stream: sys::Stream,
    bufs: [DevBuf; 2],
    ctrl: CpuBackend,
    broken: Option<Error>,
    /// Bound of `ncclCommFinalize` (the connect timeout).
    finalize_timeout: Duration,
    /// This device's memory, for device tensors (created with the backend).
    mem: Arc<XcclMemory>,
    /// Keep-alives of the device tensors of the op in flight (XC-9).
    inflight: Vec<crate::tensor::KeepAlive>,
    /// Finds when ops finished on the device (XC-4).
    done: completion::CompletionThread,
    /// Recorded on the caller's stream of a `with_stream` op (XC-10).
    wait_ev: sys::Event,
    /// The stream ordering of the op in flight (XC-10).
    order: super::StreamOrder,
    /// One-sided windows by id; `None` once freed ([`window`]).
    windows: Vec<Option<window::XcclWindow>>,
}

// SAFETY: the raw communicator, stream and device pointers are only used by
// the owning executor, one op at a time (BE-1); NCCL and the CUDA/HIP runtime
// allow that from any thread as long as calls on one communicator do not
// overlap, and every entry point sets the device first.
unsafe impl Send for XcclBackend {}
// SAFETY: `&self` methods only query stream/communicator state
// (`*StreamQuery`, `ncclCommGetAsyncError`), which is thread-safe.
unsafe impl Sync for XcclBackend {}

impl std::fmt::Debug for XcclBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("XcclBackend")
            .field("flavor", &self.flavor)
            .field("comm", &self.comm_name)
            .field("rank", &self.rank)
            .field("device", &self.device)
            .finish_non_exhaustive()
    }
}

impl XcclBackend {
    /// Load the libraries, find the device, connect the control mesh,
    /// exchange the unique id and create the communicator ([XC-1]..3).
    ///
    /// # Errors
    /// `BackendUnavailable` ([XC-1]), `InvalidArgument` for a cpu device,
    /// `Transport`/`PeerFailed` from the control mesh or store, `Timeout`
    /// style `PeerFailed` when NCCL init does not finish in time.
    ///
    /// [XC-1]: self#invariants
    pub async fn connect(flavor: Flavor, device: Device, init: BackendInit) -> Result<XcclBackend> {
        let ordinal = match device {
            Device::Cuda(i) => i,
            other => {
                return Err(Error::InvalidArgument {
                    comm: init.comm,
                    rank: init.rank,
                    op: "new_comm",
                    reason: format!("backend {} needs a GPU device, not {other}", flavor.name()),
                })
            }
        };
        let api = Vendor::shared(flavor)?;
        let count = api.device_count(flavor)?;
        if ordinal >= count {
            return Err(Error::BackendUnavailable {
                backend: flavor.name(),
                reason: format!("device {ordinal} requested but only {count} visible"),
            });
        }
        let device = ordinal as c_int;
        let ctx_err = |e: CallError| Error::BackendUnavailable {
            backend: flavor.name(),
            reason: format!("device {device}: {e}"),
        };
        // XC-6: the control mesh first, so every rank is known to be up.
        let ctrl = CpuBackend::connect(init.clone()).await?;
        let mut me =
            XcclBackend::with_stream(flavor, &init, device, api.clone(), ctrl).map_err(ctx_err)?;

        // XC-2: unique id through the store.
        let key = format!("{}/{}/id", init.key_prefix, flavor.name());
        let mut id = sys::ncclUniqueId {
            internal: [0; sys::UNIQUE_ID_BYTES],
        };
        if init.rank == 0 {
            // SAFETY: out-parameter call.
            let r = unsafe { (api.nccl.get_unique_id)(&mut id) };
            result::nccl(&api.nccl, "ncclGetUniqueId", r).map_err(ctx_err)?;
            let bytes: Vec<u8> = id.internal.iter().map(|&c| c as u8).collect();
            init.store.set(&key, bytes).await?;
        } else {
            let got = init
                .store
                .wait(std::slice::from_ref(&key), init.connect_timeout)
                .await?;
            let bytes = got.into_iter().next().unwrap_or_default();
            if bytes.len() != sys::UNIQUE_ID_BYTES {
                return Err(Error::PeerFailed {
                    comm: init.comm.clone(),
                    rank: init.rank,
                    epoch: init.epoch,
                    op: "new_comm",
                    failed_ranks: vec![0],
                    detail: format!(
                        "rank 0 published a {}-byte unique id, expected {}",
                        bytes.len(),
                        sys::UNIQUE_ID_BYTES
                    ),
                });
            }
            for (d, s) in id.internal.iter_mut().zip(bytes) {
                *d = s as std::ffi::c_char;
            }
        }

        // XC-3: non-blocking init, polled with a deadline.
        {
            let mut config = sys::ncclConfig_t::new(false);
            let mut comm: sys::ncclComm_t = std::ptr::null_mut();
            let _dev = DeviceGuard::set(&api.rt, device).map_err(ctx_err)?;
            // SAFETY: device set first; out-parameter and config live across the call.
            let r = unsafe {
                (api.nccl.comm_init_rank_config)(
                    &mut comm,
                    init.size as c_int,
                    id,
                    init.rank as c_int,
                    &mut config,
                )
            };
            me.comm = comm;
            result::nccl(&api.nccl, "ncclCommInitRankConfig", r).map_err(ctx_err)?;
        }
        let deadline = Instant::now() + init.connect_timeout;
        match settle_new(&api, SendPtr(me.comm), deadline).await {
            Ok(true) => {}
            Ok(false) => {
                return Err(init_timeout(flavor, &init, "communicator init"));
            }
            Err(e) => return Err(ctx_err(e)),
        }
        // Which files were loaded (a name the system loader resolved, or a
        // path from the search folders): the first thing to check on a box
        // with several CUDA generations installed.
        tracing::info!(comm = %init.comm, rank = init.rank, device, version = api.version(), backend = flavor.name(), nccl = %api.nccl.path, runtime = %api.rt.path, "vendor communicator ready");
        Ok(me)
    }

    /// [XC-5]: an op may run only on a communicator that is neither broken
    /// nor aborted.
    ///
    /// [XC-5]: self#invariants
    fn usable(&self) -> Result<()> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        if self.comm.is_null() {
            return Err(Error::Internal(format!(
                "{} communicator {:?} has no NCCL communicator (aborted)",
                self.flavor.name(),
                self.comm_name
            )));
        }
        Ok(())
    }

    /// [XC-5]: what a failed library call becomes, whether an op or the idle
    /// poll ([XC-7]) found it: `PeerFailed` (made by `peer_failed`) when
    /// NCCL's code means a peer is gone, else `Internal`; either way the
    /// communicator is broken from then on. `site` says where it was found.
    ///
    /// [XC-5]: self#invariants
    /// [XC-7]: self#invariants
    fn vendor_err(
        &mut self,
        e: CallError,
        site: &str,
        peer_failed: impl FnOnce(String) -> Error,
    ) -> Error {
        let name = self.flavor.name();
        let mut e = e;
        if let (true, Some(last)) = (e.nccl && !self.comm.is_null(), self.api.nccl.get_last_error) {
            // SAFETY: live communicator; NCCL returns a NUL-terminated string.
            let p = unsafe { last(self.comm) };
            if !p.is_null() {
                // SAFETY: as above, copied at once.
                let detail = unsafe { std::ffi::CStr::from_ptr(p) }.to_string_lossy();
                if !detail.is_empty() {
                    e.message = format!("{}; last error: {detail}", e.message);
                }
            }
        }
        let err = if e.nccl && plan::is_peer_failure(e.code) {
            peer_failed(format!("{name} ({site}): {e}"))
        } else {
            Error::Internal(format!(
                "{name} on communicator {:?} rank {} ({site}): {e}",
                self.comm_name, self.rank
            ))
        };
        self.broken = Some(err.clone());
        err
    }

    fn ensure(
        &mut self,
        which: usize,
        bytes: usize,
    ) -> std::result::Result<*mut c_void, CallError> {
        let need = bytes.max(256);
        let b = &mut self.bufs[which];
        if b.cap < need {
            // Grow geometrically: cudaFree synchronises the whole device,
            // so it must stay off the hot path.
            let need = need.next_power_of_two().max(b.cap.saturating_mul(2));
            let _dev = DeviceGuard::set(&self.api.rt, self.device)?;
            if !b.ptr.is_null() {
                // SAFETY: allocated by `malloc` below, no op in flight.
                let _ = unsafe { (self.api.rt.free)(b.ptr) };
                b.ptr = std::ptr::null_mut();
                b.cap = 0;
            }
            let mut p = std::ptr::null_mut();
            // SAFETY: out-parameter call.
            let r = unsafe { (self.api.rt.malloc)(&mut p, need) };
            result::rt(&self.api.rt, "Malloc", r)?;
            b.ptr = p;
            b.cap = need;
        }
        Ok(b.ptr)
    }

    /// Wait until the op just enqueued finished on the device: the
    /// completion thread settles the communicator, records an event and
    /// wakes this future when it completed ([XC-4]).
    ///
    /// [XC-4]: self#invariants
    async fn complete(&mut self) -> std::result::Result<(), CallError> {
        match self
            .done
            .submit(self.comm, self.stream, self.order.fence.take())
            .await
        {
            Ok(r) => r,
            Err(_) => Err(CallError {
                call: "completion thread",
                code: 0,
                nccl: false,
                message: "stopped before the op completed".into(),
            }),
        }
    }

    /// [XC-10]: make the communicator's stream wait for the work queued on
    /// the caller's stream so far (an event recorded there), without
    /// blocking the host. The device must be set.
    ///
    /// [XC-10]: self#invariants
    fn order_after(&self) -> std::result::Result<(), CallError> {
        let Some(user) = self.order.wait_for else {
            return Ok(());
        };
        let rt = &self.api.rt;
        // SAFETY: the caller's stream (valid, `DeviceStream::from_raw`'s
        // contract) and this communicator's event and stream, device set.
        unsafe {
            result::rt(
                rt,
                "EventRecord(caller's stream)",
                (rt.event_record)(self.wait_ev, user.as_raw()),
            )?;
            result::rt(
                rt,
                "StreamWaitEvent",
                (rt.stream_wait_event)(self.stream, self.wait_ev, 0),
            )
        }
    }

    /// Enqueue the plan's calls (inside one group when asked).
    ///
    /// # Safety
    /// `din`/`dout` hold at least the plan's element counts times `esize`.
    unsafe fn enqueue(
        &self,
        p: &plan::Plan,
        dtype: c_int,
        op: c_int,
        esize: usize,
        din: *mut c_void,
        dout: *mut c_void,
    ) -> std::result::Result<(), CallError> {
        self.order_after()?;
        let n = &self.api.nccl;
        let (comm, stream) = (self.comm, self.stream);
        let at = |b: Buf, off: usize| -> *mut c_void {
            let base = match b {
                Buf::In => din,
                Buf::Out => dout,
            };
            base.cast::<u8>().add(off * esize).cast()
        };
        let group = if p.grouped {
            Some(GroupGuard::start(n)?)
        } else {
            None
        };
        for c in &p.calls {
            match c {
                Call::AllReduce(r) => result::nccl(
                    n,
                    "ncclAllReduce",
                    (n.all_reduce)(
                        at(Buf::In, r.start),
                        at(Buf::Out, r.start),
                        r.len(),
                        dtype,
                        op,
                        comm,
                        stream,
                    ),
                )?,
                Call::Reduce { src, dst, root } => result::nccl(
                    n,
                    "ncclReduce",
                    (n.reduce)(
                        at(Buf::In, src.start),
                        at(Buf::Out, dst.start),
                        src.len(),
                        dtype,
                        op,
                        *root as c_int,
                        comm,
                        stream,
                    ),
                )?,
                Call::Broadcast { src, dst, root } => result::nccl(
                    n,
                    "ncclBroadcast",
                    (n.broadcast)(
                        at(src.0, src.1.start),
                        at(Buf::Out, dst.start),
                        dst.len(),
                        dtype,
                        *root as c_int,
                        comm,
                        stream,
                    ),
                )?,
                Call::AllGather(k) => result::nccl(
                    n,
                    "ncclAllGather",
                    (n.all_gather)(din, dout, *k, dtype, comm, stream),
                )?,
                Call::ReduceScatter(k) => result::nccl(
                    n,
                    "ncclReduceScatter",
                    (n.reduce_scatter)(din, dout, *k, dtype, op, comm, stream),
                )?,
                Call::Send(b, r, peer) => result::nccl(
                    n,
                    "ncclSend",
                    (n.send)(
                        at(*b, r.start),
                        r.len(),
                        dtype,
                        *peer as c_int,
                        comm,
                        stream,
                    ),
                )?,
                Call::Recv(r, peer) => result::nccl(
                    n,
                    "ncclRecv",
                    (n.recv)(
                        at(Buf::Out, r.start),
                        r.len(),
                        dtype,
                        *peer as c_int,
                        comm,
                        stream,
                    ),
                )?,
                Call::Copy { src, dst } => result::rt(
                    &self.api.rt,
                    "MemcpyAsync",
                    (self.api.rt.memcpy_async)(
                        at(Buf::Out, dst.start),
                        at(Buf::In, src.start),
                        src.len() * esize,
                        MEMCPY_D2D,
                        stream,
                    ),
                )?,
            }
        }
        match group {
            Some(g) => g.end(),
            None => Ok(()),
        }
    }

    /// Stage, run and unstage one op ([XC-4]).
    ///
    /// [XC-4]: self#invariants
    async fn run(&mut self, size: usize, data: &mut OpData) -> std::result::Result<(), CallError> {
        if on_device(data) {
            return self.run_device(size, data).await;
        }
        // Host views: what goes in, where results land.
        let (p, dtype, op, esize) = match &*data {
            OpData::P2P { ops } => {
                // Byte-level plan: sends from In, receives into Out, in order.
                let (mut si, mut ri) = (0, 0);
                let mut calls = Vec::new();
                for t in ops.iter() {
                    let b = t.buf.len_bytes();
                    if t.send {
                        calls.push(Call::Send(Buf::In, si..si + b, t.peer));
                        si += b;
                    } else {
                        calls.push(Call::Recv(ri..ri + b, t.peer));
                        ri += b;
                    }
                }
                let p = plan::Plan {
                    in_len: si,
                    out_len: ri,
                    calls,
                    grouped: true,
                };
                (p, plan::nccl_dtype(DType::U8), 0, 1)
            }
            other => {
                let (dt, op) = op_of(other);
                let nop = match op {
                    Some(o) => plan::nccl_op(o, dt).map_err(|e| CallError {
                        call: "plan",
                        code: 0,
                        nccl: false,
                        message: e.to_string(),
                    })?,
                    None => 0,
                };
                (
                    plan::plan(other, self.rank, size),
                    plan::nccl_dtype(dt),
                    nop,
                    dt.size(),
                )
            }
        };
        if p.calls.is_empty() {
            return Ok(());
        }
        // Addresses as integers: raw pointers may not live across an await.
        let din_addr = self.ensure(0, p.in_len * esize)? as usize;
        let dout_addr = self.ensure(1, p.out_len * esize)? as usize;
        let (din, dout) = (din_addr as *mut c_void, dout_addr as *mut c_void);
        let rt = &self.api.rt;
        // SAFETY: device set, buffers sized by the plan (XP-1); H2D from
        // pageable memory returns once the host bytes were staged.
        unsafe {
            let _dev = DeviceGuard::set(rt, self.device)?;
            let mut off = 0;
            for t in inputs(data) {
                let b = t.as_bytes();
                if !b.is_empty() {
                    result::rt(
                        rt,
                        "MemcpyAsync(H2D)",
                        (rt.memcpy_async)(
                            din.cast::<u8>().add(off).cast(),
                            b.as_ptr().cast(),
                            b.len(),
                            sys::MEMCPY_H2D,
                            self.stream,
                        ),
                    )?;
                }
                off += b.len();
            }
            self.enqueue(&p, dtype, op, esize, din, dout)?;
        }
        self.complete().await?;
        let dout = dout_addr as *mut c_void;
        let stream = self.stream;
        let rt = &self.api.rt;
        // SAFETY: the stream drained (XC-4); D2H into live host buffers,
        // then synchronise before returning.
        unsafe {
            let _dev = DeviceGuard::set(rt, self.device)?;
            let mut off = 0;
            for t in outputs(data, self.rank) {
                let b = t.as_bytes_mut();
                if !b.is_empty() {
                    result::rt(
                        rt,
                        "MemcpyAsync(D2H)",
                        (rt.memcpy_async)(
                            b.as_mut_ptr().cast(),
                            dout.cast::<u8>().add(off).cast(),
                            b.len(),
                            sys::MEMCPY_D2H,
                            stream,
                        ),
                    )?;
                }
                off += b.len();
            }
            result::rt(rt, "StreamSynchronize", (rt.stream_synchronize)(stream))?;
        }
        Ok(())
    }
}

impl XcclBackend {
    /// The NCCL op of a reduction on device buffers ([XP-3]).
    ///
    /// [XP-3]: plan#invariants
    fn device_op(&self, op: crate::op::ReduceOp, dt: DType) -> Result<plan::DeviceRedOp> {
        let n = &self.api.nccl;
        // ncclAvg since 2.10 (version code 21000).
        let has_avg = self.api.version() >= 21000;
        let has_premul = n.red_op_create_pre_mul_sum.is_some() && n.red_op_destroy.is_some();
        plan::nccl_device_op(op, dt, has_avg, has_premul)
    }

    /// Run one op on device buffers in place: no staging (XC-9).
    async fn run_device(
        &mut self,
        size: usize,
        data: &mut OpData,
    ) -> std::result::Result<(), CallError> {
        let plan_err = |message: String| CallError {
            call: "plan",
            code: 0,
            nccl: false,
            message,
        };
        // XC-9: hold the memory until the op finished or the comm aborted.
        self.inflight = tensors(data)
            .into_iter()
            .filter_map(Tensor::device_keep_alive)
            .collect();
        let addr = |t: &Tensor| t.device_ptr().map_or(0, |p| p as usize);
        let (p, dtype, redop, esize, din, dout) = match &*data {
            OpData::AllToAllList { .. } => return Err(plan_err("the list all_to_all reaches this backend as an all_to_all over the concatenated lists (Capabilities::list_all_to_all)".into())),
            OpData::P2P { ops } => {
                // Each transfer on its own buffer; bytes as ncclUint8.
                let calls = ops
                    .iter()
                    .map(|t| {
                        let b = t.buf.len_bytes();
                        if t.send {
                            (Some(addr(&t.buf)), None, b, t.peer)
                        } else {
                            (None, Some(addr(&t.buf)), b, t.peer)
                        }
                    })
                    .collect::<Vec<_>>();
                self.enqueue_p2p_device(&calls)?;
                self.complete().await?;
                self.inflight.clear();
                return Ok(());
            }
            OpData::AllReduce { buf, .. }
            | OpData::Reduce { buf, .. }
            | OpData::Broadcast { buf, .. } => {
                let (dt, op) = op_of(data);
                (
                    plan::plan(data, self.rank, size),
                    dt,
                    op,
                    dt.size(),
                    addr(buf),
                    addr(buf),
                )
            }
            OpData::ReduceScatter { input, output, .. }
            | OpData::AllGather { input, output, .. }
            | OpData::Scatter { input, output, .. }
            | OpData::Gather { input, output, .. }
            | OpData::AllToAll { input, output, .. } => {
                let (dt, op) = op_of(data);
                let p = plan::plan(data, self.rank, size);
                // XP-1 on the caller's buffers; an uneven reduce_scatter's
                // non-owner destinations are never written (NCCL's reduce
                // writes on the root only), so only the input is bounded.
                let scratch_out = matches!(data, OpData::ReduceScatter { .. });
                if p.in_len > input.len() || (!scratch_out && p.out_len > output.len()) {
                    return Err(plan_err(format!(
                        "plan needs {} in / {} out elements, buffers hold {} / {}",
                        p.in_len,
                        p.out_len,
                        input.len(),
                        output.len()
                    )));
                }
                (p, dt, op, dt.size(), addr(input), addr(output))
            }
            OpData::Barrier => return Ok(()),
        };
        if p.calls.is_empty() {
            self.inflight.clear();
            return Ok(());
        }
        let nop = match redop {
            Some(o) => self
                .device_op(o, dtype)
                .map_err(|e| plan_err(e.to_string()))?,
            None => plan::DeviceRedOp::Builtin(0),
        };
        let premul = {
            let rt = &self.api.rt;
            let _dev = DeviceGuard::set(rt, self.device)?;
            let ndt = plan::nccl_dtype(dtype);
            let (op, created) = match nop {
                plan::DeviceRedOp::Builtin(o) => (o, false),
                plan::DeviceRedOp::PreMulSum(s) => (self.create_premul(ndt, dtype, s)?, true),
            };
            // SAFETY: device set; the pointers are device tensors of this
            // device, sized for the plan (checked above, XP-1).
            let r = unsafe {
                self.enqueue(&p, ndt, op, esize, din as *mut c_void, dout as *mut c_void)
            };
            if r.is_err() {
                if created {
                    let _ = self.destroy_premul(op);
                }
                return r;
            }
            created.then_some(op)
        };
        let done = self.complete().await;
        // XC-9: destroyed once the op finished, when the communicator is
        // settled (a non-blocking communicator refuses calls while an
        // enqueue is in progress); a failed destroy fails the op.
        if let Some(op) = premul {
            self.destroy_premul(op)?;
        }
        done?;
        self.inflight.clear();
        Ok(())
    }

    /// `ncclRedOpDestroy` of a PreMulSum op made by `create_premul`.
    fn destroy_premul(&self, op: sys::ncclRedOp_t) -> std::result::Result<(), CallError> {
        let Some(destroy) = self.api.nccl.red_op_destroy else {
            return Ok(());
        };
        let _dev = DeviceGuard::set(&self.api.rt, self.device)?;
        // SAFETY: created by `create_premul` on this live communicator, and
        // destroyed once.
        let d = unsafe { destroy(op, self.comm) };
        result::nccl(&self.api.nccl, "ncclRedOpDestroy", d)
    }

    /// `ncclRedOpCreatePreMulSum` with the host-immediate scalar `s`.
    fn create_premul(
        &self,
        ndt: c_int,
        dtype: DType,
        s: f64,
    ) -> std::result::Result<sys::ncclRedOp_t, CallError> {
        let n = &self.api.nccl;
        let Some(create) = n.red_op_create_pre_mul_sum else {
            return Err(CallError {
                call: "ncclRedOpCreatePreMulSum",
                code: 0,
                nccl: false,
                message: "missing from the library".into(),
            });
        };
        let mut scalar = plan::scalar_bytes(dtype, s);
        let mut op: sys::ncclRedOp_t = 0;
        // SAFETY: live communicator, device set by the caller; the scalar
        // is host memory of one element of `dtype`, read before the call
        // returns (ncclScalarHostImmediate).
        let r = unsafe {
            create(
                &mut op,
                scalar.as_mut_ptr().cast(),
                ndt,
                sys::NCCL_SCALAR_HOST_IMMEDIATE,
                self.comm,
            )
        };
        result::nccl(n, "ncclRedOpCreatePreMulSum", r)?;
        Ok(op)
    }

    /// Grouped `ncclSend`/`ncclRecv` on device buffers: `(send addr, recv
    /// addr, bytes, peer)` per transfer, in order.
    fn enqueue_p2p_device(
        &self,
        calls: &[(Option<usize>, Option<usize>, usize, usize)],
    ) -> std::result::Result<(), CallError> {
        let n = &self.api.nccl;
        let _dev = DeviceGuard::set(&self.api.rt, self.device)?;
        let u8t = plan::nccl_dtype(DType::U8);
        self.order_after()?;
        let group = GroupGuard::start(n)?;
        for &(send, recv, bytes, peer) in calls {
            // SAFETY: device pointers of live device tensors of `bytes`
            // bytes (held by `inflight`, XC-9); device set; inside a group.
            unsafe {
                match (send, recv) {
                    (Some(p), _) => result::nccl(
                        n,
                        "ncclSend",
                        (n.send)(
                            p as *const c_void,
                            bytes,
                            u8t,
                            peer as c_int,
                            self.comm,
                            self.stream,
                        ),
                    )?,
                    (_, Some(p)) => result::nccl(
                        n,
                        "ncclRecv",
                        (n.recv)(
                            p as *mut c_void,
                            bytes,
                            u8t,
                            peer as c_int,
                            self.comm,
                            self.stream,
                        ),
                    )?,
                    (None, None) => {}
                }
            }
        }
        group.end()
    }
}

/// Whether an op runs on device buffers (the generic layer never mixes, CM-4).
fn on_device(d: &OpData) -> bool {
    tensors(d).iter().any(|t| t.is_device())
}

/// Every tensor of an op.
fn tensors(d: &OpData) -> Vec<&Tensor> {
    match d {
        OpData::AllReduce { buf, .. }
        | OpData::Reduce { buf, .. }
        | OpData::Broadcast { buf, .. } => vec![buf],
        OpData::ReduceScatter { input, output, .. }
        | OpData::AllGather { input, output, .. }
        | OpData::Scatter { input, output, .. }
        | OpData::Gather { input, output, .. }
        | OpData::AllToAll { input, output, .. } => vec![input, output],
        OpData::AllToAllList { inputs, outputs } => inputs.iter().chain(outputs).collect(),
        OpData::P2P { ops } => ops.iter().map(|t| &t.buf).collect(),
        OpData::Barrier => vec![],
    }
}

/// Dtype and reduce op of a collective.
fn op_of(d: &OpData) -> (DType, Option<crate::op::ReduceOp>) {
    match d {
        OpData::AllReduce { buf, op } | OpData::Reduce { buf, op, .. } => (buf.dtype(), Some(*op)),
        OpData::ReduceScatter { input, op, .. } => (input.dtype(), Some(*op)),
        OpData::AllGather { input, .. }
        | OpData::Scatter { input, .. }
        | OpData::Gather { input, .. }
        | OpData::AllToAll { input, .. } => (input.dtype(), None),
        OpData::AllToAllList { inputs, .. } => {
            (inputs.first().map_or(DType::U8, Tensor::dtype), None)
        }
        OpData::Broadcast { buf, .. } => (buf.dtype(), None),
        OpData::Barrier | OpData::P2P { .. } => (DType::U8, None),
    }
}

/// Host tensors staged into the device input buffer, in order.
fn inputs(d: &OpData) -> Vec<&Tensor> {
    match d {
        OpData::AllReduce { buf, .. }
        | OpData::Reduce { buf, .. }
        | OpData::Broadcast { buf, .. } => vec![buf],
        OpData::ReduceScatter { input, .. }
        | OpData::AllGather { input, .. }
        | OpData::Scatter { input, .. }
        | OpData::Gather { input, .. }
        | OpData::AllToAll { input, .. } => vec![input],
        OpData::AllToAllList { inputs, .. } => inputs.iter().collect(),
        OpData::P2P { ops } => ops.iter().filter(|t| t.send).map(|t| &t.buf).collect(),
        OpData::Barrier => vec![],
    }
}

/// Host tensors the device output buffer is copied back into, in order.
/// A reduce's non-root keeps its input: NCCL leaves its output untouched.
fn outputs(d: &mut OpData, rank: usize) -> Vec<&mut Tensor> {
    match d {
        OpData::Reduce { root, .. } if *root != rank => vec![],
        OpData::AllReduce { buf, .. }
        | OpData::Reduce { buf, .. }
        | OpData::Broadcast { buf, .. } => vec![buf],
        OpData::ReduceScatter { output, .. }
        | OpData::AllGather { output, .. }
        | OpData::Scatter { output, .. }
        | OpData::Gather { output, .. }
        | OpData::AllToAll { output, .. } => vec![output],
        OpData::AllToAllList { outputs, .. } => outputs.iter_mut().collect(),
        OpData::P2P { ops } => ops
            .iter_mut()
            .filter(|t| !t.send)
            .map(|t| &mut t.buf)
            .collect(),
        OpData::Barrier => vec![],
    }
}

/// Poll a communicator that a non-blocking init or split returned until it
/// is ready (`Ok(true)`) or `deadline` passed (`Ok(false)`).
async fn settle_new(
    api: &Vendor,
    comm: SendPtr,
    deadline: Instant,
) -> std::result::Result<bool, CallError> {
    loop {
        // SAFETY: `comm` was returned by init or split and not freed.
        if unsafe { result::async_error(&api.nccl, comm.0)? } {
            return Ok(true);
        }
        if Instant::now() >= deadline {
            return Ok(false);
        }
        tokio::time::sleep(POLL).await;
    }
}

/// The error of an init or split that did not finish in time ([XC-3]).
///
/// [XC-3]: self#invariants
fn init_timeout(flavor: Flavor, init: &BackendInit, what: &str) -> Error {
    Error::PeerFailed {
        comm: init.comm.clone(),
        rank: init.rank,
        epoch: init.epoch,
        op: "new_comm",
        failed_ranks: vec![],
        detail: format!(
            "{} {what} did not finish within {:?}; aborted",
            flavor.name(),
            init.connect_timeout
        ),
    }
}

impl XcclBackend {
    /// A backend with its own stream on `device` and no NCCL communicator
    /// yet (`Drop` cleans up whatever was created).
    fn with_stream(
        flavor: Flavor,
        init: &BackendInit,
        device: c_int,
        api: Arc<Vendor>,
        ctrl: CpuBackend,
    ) -> std::result::Result<XcclBackend, CallError> {
        let mut me = XcclBackend {
            mem: Arc::new(XcclMemory::new(api.clone(), device)?),
            done: completion::CompletionThread::start(api.clone(), device, &init.comm)?,
            flavor,
            comm_name: init.comm.clone(),
            rank: init.rank,
            device,
            api,
            comm: std::ptr::null_mut(),
            stream: std::ptr::null_mut(),
            bufs: [
                DevBuf {
                    ptr: std::ptr::null_mut(),
                    cap: 0,
                },
                DevBuf {
                    ptr: std::ptr::null_mut(),
                    cap: 0,
                },
            ],
            ctrl,
            broken: None,
            finalize_timeout: init.connect_timeout,
            inflight: Vec::new(),
            wait_ev: std::ptr::null_mut(),
            order: Default::default(),
            windows: Vec::new(),
        };
        let rt = &me.api.rt;
        let mut stream: sys::Stream = std::ptr::null_mut();
        // SAFETY: plain runtime calls with out-parameters.
        {
            let _dev = DeviceGuard::set(rt, device)?;
            // SAFETY: out-parameter call on the communicator's device.
            let r = unsafe { (rt.stream_create_with_flags)(&mut stream, sys::STREAM_NON_BLOCKING) };
            result::rt(rt, "StreamCreateWithFlags", r)?;
            me.stream = stream;
            let mut ev: sys::Event = std::ptr::null_mut();
            // SAFETY: out-parameter call on the communicator's device.
            let r = unsafe { (rt.event_create_with_flags)(&mut ev, sys::EVENT_DISABLE_TIMING) };
            result::rt(rt, "EventCreateWithFlags", r)?;
            me.wait_ev = ev;
        }
        Ok(me)
    }

    /// [XC-8]: `ncclCommSplit` of this communicator ([BE-4]). Members connect
    /// the child's control mesh first, then every parent rank calls the
    /// split (non-members with `NCCL_SPLIT_NOCOLOR`), non-blocking, and
    /// waits for the parent and the child to settle within the timeout.
    /// Any failure leaves the parent broken (the executor aborts it).
    ///
    /// [BE-4]: crate::backends#invariants
    /// [XC-8]: self#invariants
    async fn split_native(&mut self, args: SplitArgs) -> Result<Option<Box<dyn Backend>>> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        let flavor = self.flavor;
        let name = self.comm_name.clone();
        let unusable = move |what: String| {
            Error::Internal(format!(
                "{} split of communicator {name:?}: {what}",
                flavor.name()
            ))
        };
        let ctrl = match &args.child {
            Some(c) => Some(CpuBackend::connect(c.init.clone()).await?),
            None => None,
        };
        let (color, key) = match &args.child {
            Some(c) => (
                c_int::try_from(c.color)
                    .map_err(|_| unusable(format!("color {} too large", c.color)))?,
                c_int::try_from(c.init.rank)
                    .map_err(|_| unusable("child rank too large".into()))?,
            ),
            None => (sys::NCCL_SPLIT_NOCOLOR, 0),
        };
        let out = match self.start_split(color, key) {
            Ok(out) => out,
            Err(e) => return Err(self.split_failed(None, unusable(e))),
        };
        let deadline = Instant::now() + args.timeout;
        // The parent is busy until the split settled on it; NCCL may write
        // `*newcomm` from its own thread until then, so the out-pointer
        // lives in `out` (owned, boxed) and is only read after that.
        let settled = settle_new(&self.api, SendPtr(self.comm), deadline).await;
        let failed = match settled {
            Ok(true) => None,
            Ok(false) => Some(unusable(format!(
                "the parent did not settle within {:?}",
                args.timeout
            ))),
            Err(e) => Some(unusable(e.to_string())),
        };
        if let Some(e) = failed {
            // NCCL may still write into the box: never free it.
            let _ = Box::leak(out);
            return Err(self.split_failed(None, e));
        }
        let child = (!out.0.is_null()).then_some(SendPtr(out.0));
        let (Some(ctrl), Some(c)) = (ctrl, args.child) else {
            // NCCL_SPLIT_NOCOLOR: no child communicator.
            if let Some(child) = child {
                // SAFETY: an unexpected child of a non-member; never used.
                let _ = unsafe { (self.api.nccl.comm_abort)(child.0) };
            }
            return Ok(None);
        };
        let Some(child) = child else {
            let e = unusable("ncclCommSplit returned no child communicator".into());
            return Err(self.split_failed(None, e));
        };
        match settle_new(&self.api, child, deadline).await {
            Ok(true) => {}
            Ok(false) => {
                let e = init_timeout(flavor, &c.init, "split");
                return Err(self.split_failed(Some(child), e));
            }
            Err(e) => return Err(self.split_failed(Some(child), unusable(e.to_string()))),
        }
        let mut me =
            match XcclBackend::with_stream(flavor, &c.init, self.device, self.api.clone(), ctrl) {
                Ok(me) => me,
                Err(e) => return Err(self.split_failed(Some(child), unusable(e.to_string()))),
            };
        me.comm = child.0;
        tracing::info!(comm = %c.init.comm, rank = c.init.rank, size = c.init.size, parent = %self.comm_name, backend = flavor.name(), "vendor communicator split");
        Ok(Some(Box::new(me)))
    }

    /// Issue `ncclCommSplit` (non-blocking) on the parent; the child, if
    /// NCCL returned one.
    fn start_split(
        &mut self,
        color: c_int,
        key: c_int,
    ) -> std::result::Result<Box<SendPtr>, String> {
        let split = self
            .api
            .nccl
            .comm_split
            .ok_or_else(|| format!("{} has no ncclCommSplit", self.api.nccl.path))?;
        if self.comm.is_null() {
            return Err("the parent has no NCCL communicator (aborted)".into());
        }
        let mut config = sys::ncclConfig_t::new(false);
        let mut out = Box::new(SendPtr(std::ptr::null_mut()));
        let _dev = DeviceGuard::set(&self.api.rt, self.device).map_err(|e| e.to_string())?;
        // SAFETY: live parent communicator, no op in flight (BE-4); device
        // set first; the config is read during the call, and the boxed
        // out-parameter outlives any late write (the caller keeps it until
        // the parent settled, or leaks it).
        let r = unsafe { split(self.comm, color, key, &mut out.0, &mut config) };
        match result::nccl(&self.api.nccl, "ncclCommSplit", r) {
            Ok(()) => Ok(out),
            Err(e) => {
                if !out.0.is_null() {
                    // SAFETY: returned by the failed split; never used again.
                    let _ = unsafe { (self.api.nccl.comm_abort)(out.0) };
                }
                Err(e.to_string())
            }
        }
    }

    /// A failed split: abort the child NCCL may have created and mark the
    /// parent broken (its executor aborts it, [BE-4]).
    ///
    /// [BE-4]: crate::backends#invariants
    fn split_failed(&mut self, child: Option<SendPtr>, err: Error) -> Error {
        if let Some(c) = child {
            // SAFETY: returned by the split; never used again.
            let _ = unsafe { (self.api.nccl.comm_abort)(c.0) };
        }
        self.broken = Some(err.clone());
        err
    }

    /// Free the staging buffers and the stream (at finalize, abort and
    /// drop), after the stream drained.
    fn release(&mut self) {
        let rt = &self.api.rt;
        if self.stream.is_null()
            && self.bufs.iter().all(|b| b.ptr.is_null())
            && self.wait_ev.is_null()
        {
            return;
        }
        let _dev = DeviceGuard::set(rt, self.device);
        // SAFETY: the communicator is finalized or aborted, so the stream
        // drains; the pointers were allocated by this runtime.
        unsafe {
            if !self.stream.is_null() {
                let _ = (rt.stream_synchronize)(self.stream);
            }
            for b in &mut self.bufs {
                if !b.ptr.is_null() {
                    let _ = (rt.free)(b.ptr);
                    b.ptr = std::ptr::null_mut();
                    b.cap = 0;
                }
            }
            if !self.stream.is_null() {
                let _ = (rt.stream_destroy)(self.stream);
                self.stream = std::ptr::null_mut();
            }
            if !self.wait_ev.is_null() {
                let _ = (rt.event_destroy)(self.wait_ev);
                self.wait_ev = std::ptr::null_mut();
            }
        }
    }

    /// `ncclCommFinalize`, bounded by `finalize_timeout`: `true` when it
    /// settled (destroy is then safe), `false` when it failed or timed out
    /// (the caller aborts instead).
    async fn finalize_comm(&mut self) -> bool {
        let Some(fin) = self.api.nccl.comm_finalize else {
            return true;
        };
        let r = {
            let Ok(_dev) = DeviceGuard::set(&self.api.rt, self.device) else {
                return false;
            };
            // SAFETY: live communicator, no op in flight.
            unsafe { fin(self.comm) }
        };
        if let Err(e) = result::nccl(&self.api.nccl, "ncclCommFinalize", r) {
            tracing::warn!(comm = %self.comm_name, rank = self.rank, "{e}");
            return false;
        }
        let deadline = Instant::now() + self.finalize_timeout;
        match settle_new(&self.api, SendPtr(self.comm), deadline).await {
            Ok(true) => true,
            Ok(false) => {
                tracing::warn!(comm = %self.comm_name, rank = self.rank, timeout = ?self.finalize_timeout, "ncclCommFinalize did not finish in time; aborting");
                false
            }
            Err(e) => {
                tracing::warn!(comm = %self.comm_name, rank = self.rank, "{e}");
                false
            }
        }
    }

    fn abort_comm(&mut self) {
        if !self.comm.is_null() {
            let _dev = DeviceGuard::set(&self.api.rt, self.device);
            // SAFETY: live communicator; abort is allowed at any time.
            let r = unsafe { (self.api.nccl.comm_abort)(self.comm) };
            if let Err(e) = result::nccl(&self.api.nccl, "ncclCommAbort", r) {
                tracing::warn!(comm = %self.comm_name, rank = self.rank, "{e}");
            }
            self.comm = std::ptr::null_mut();
        }
    }
}

#[async_trait]
impl Backend for XcclBackend {
    fn name(&self) -> &'static str {
        self.flavor.name()
    }

    fn version(&self) -> String {
        // NCCL's code: major * 10000 + minor * 100 + patch (2.9 and later).
        let v = self.api.version();
        format!(
            "{} {}.{}.{}",
            self.flavor.name(),
            v / 10000,
            v / 100 % 100,
            v % 100
        )
    }

    async fn exchange_headers(
        &mut self,
        ctx: &OpCtx,
        outgoing: Vec<(usize, u64, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>> {
        if let Some(e) = &self.broken {
            return Err(e.clone());
        }
        self.ctrl.exchange_headers(ctx, outgoing).await
    }

    async fn execute(&mut self, ctx: &OpCtx, data: &mut OpData) -> Result<()> {
        self.usable()?;
        if matches!(data, OpData::Barrier) {
            // XC-6: a barrier moves no data. After a header exchange the
            // ranks have met already; without one the control links
            // synchronise them (ceil(log2 N) rounds, fingerprinted).
            return if ctx.headers {
                Ok(())
            } else {
                self.ctrl.execute(ctx, data).await
            };
        }
        // Reject unsupported reductions before touching the device (XP-3).
        if let (dt, Some(op)) = op_of(data) {
            if on_device(data) {
                self.device_op(op, dt)?;
            } else {
                plan::nccl_op(op, dt)?;
            }
        }
        let span = tracing::debug_span!("xccl_op", op = ctx.kind.name(), seq = ctx.seq);
        let _g = span.enter();
        drop(_g);
        self.order = ctx.order.clone();
        match self.run(ctx.size, data).await {
            Ok(()) => Ok(()),
            Err(e) => {
                let site = format!("op {}, seq {}", ctx.kind.name(), ctx.seq);
                Err(self.vendor_err(e, &site, |d| ctx.peer_failed(vec![], d)))
            }
        }
    }

    async fn abort(&mut self, reason: &str, failed: &[usize]) {
        self.abort_for(None, reason, failed).await;
    }

    async fn abort_for(&mut self, cause: Option<&Error>, reason: &str, failed: &[usize]) {
        // XT-1: the completion thread lets go of the communicator first.
        self.done.stop();
        self.abort_comm();
        self.free_windows();
        self.release();
        // XC-9: the device is done with the op's memory now.
        self.inflight.clear();
        self.broken = Some(Error::Internal(format!(
            "{} communicator {:?} was aborted: {reason}",
            self.flavor.name(),
            self.comm_name
        )));
        // The control links tell the peers when the cause is a mismatch.
        self.ctrl.abort_for(cause, reason, failed).await;
    }

    async fn finalize(&mut self) {
        // Finalize (bounded), then destroy; abort when either fails, so a
        // communicator is never leaked nor waited on forever. No op runs,
        // so the completion thread can go first (XT-1).
        if !self.comm.is_null() && self.broken.is_none() {
            // XW-3: windows are deregistered while the communicator lives.
            self.deregister_windows().await;
        }
        self.done.stop();
        if !self.comm.is_null() && self.broken.is_none() && self.finalize_comm().await {
            let r = {
                let _dev = DeviceGuard::set(&self.api.rt, self.device);
                // SAFETY: finalized, no op in flight.
                unsafe { (self.api.nccl.comm_destroy)(self.comm) }
            };
            match result::nccl(&self.api.nccl, "ncclCommDestroy", r) {
                Ok(()) => self.comm = std::ptr::null_mut(),
                Err(e) => tracing::warn!(comm = %self.comm_name, rank = self.rank, "{e}"),
            }
        }
        self.abort_comm();
        self.free_windows();
        self.release();
        self.inflight.clear();
        self.ctrl.finalize().await;
    }

    fn polls_async_errors(&self) -> bool {
        true
    }

    fn device_memory(&self) -> Option<Arc<dyn super::DeviceMemory>> {
        Some(self.mem.clone())
    }

    fn capabilities(&self) -> super::Capabilities {
        super::Capabilities {
            // Without ncclCommSplit (NCCL < 2.18) a child gets its own
            // unique id and ncclCommInitRank, like a new communicator.
            split: if self.api.nccl.comm_split.is_some() {
                super::SplitMode::Native
            } else {
                super::SplitMode::Reconnect
            },
            elastic: true,
            in_place_all_gather: false,
            // NCCL's messages cannot carry a fingerprint; a mismatch hangs
            // the op or gives wrong results, which the heartbeats' stall
            // and history checks find (XC-6).
            in_band_checks: false,
            headerless_ops: true,
            list_all_to_all: false,
        }
    }

    async fn split(&mut self, args: SplitArgs) -> Result<Option<Box<dyn Backend>>> {
        self.split_native(args).await
    }

    fn supports_windows(&self) -> bool {
        self.windows_supported()
    }

    async fn window(&mut self, ctx: &OpCtx, op: super::WindowOp) -> Result<super::WindowDone> {
        self.window_op(ctx, op).await
    }

    /// [XC-7]: between ops, `ncclCommGetAsyncError` ([BE-3]), so a peer lost
    /// while this rank is idle aborts the communicator now rather than at
    /// its next op.
    ///
    /// [BE-3]: crate::backends#invariants
    /// [XC-7]: self#invariants
    fn poll_async_error(&mut self, ctx: &IdleCtx) -> Result<()> {
        if self.broken.is_some() || self.comm.is_null() {
            // Already reported (the executor aborts after the first error).
            return Ok(());
        }
        // SAFETY: live communicator; no op in flight (BE-3).
        match unsafe { result::async_error(&self.api.nccl, self.comm) } {
            Ok(_) => Ok(()),
            Err(e) => Err(self.vendor_err(e, "found while idle", |d| ctx.peer_failed(vec![], d))),
        }
    }
}

impl Drop for XcclBackend {
    fn drop(&mut self) {
        // XC-5: abort, never destroy (which may block); errors are logged.
        self.done.stop();
        self.abort_comm();
        self.free_windows();
        self.release();
        self.inflight.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// [XC-1]: without the libraries (this machine, CI) loading is a clean
    /// `BackendUnavailable` naming the library, not a panic.
    ///
    /// [XC-1]: self#invariants
    #[test]
    fn xc_1_missing_libraries_are_backend_unavailable() {
        for flavor in [Flavor::Nccl, Flavor::Rccl] {
            match probe(flavor) {
                Ok(n) => eprintln!("{}: {n} device(s) present; nothing to check", flavor.name()),
                Err(Error::BackendUnavailable { backend, reason }) => {
                    assert_eq!(backend, flavor.name());
                    assert!(reason.contains(".so"), "{reason}");
                }
                Err(other) => panic!("{other:?}"),
            }
        }
    }

    /// The file names and wheel folders of both CUDA generations that pip
    /// installs (PyTorch's cu12 and cu13 builds) are among the candidates.
    #[test]
    fn loader_candidates_cover_cuda_12_and_13_wheels() {
        assert!(Flavor::Nccl.collective_libs().contains(&"libnccl.so.2"));
        let rt = Flavor::Nccl.runtime_libs();
        for name in ["libcudart.so.12", "libcudart.so.13"] {
            assert!(rt.contains(&name), "{name} not in {rt:?}");
        }
        let site = std::path::Path::new("/venv/lib/python3.12/site-packages");
        let dirs = sys::wheel_lib_dirs(site);
        for sub in [
            "nvidia/nccl/lib",
            "nvidia/cuda_runtime/lib",
            "nvidia/cu13/lib",
        ] {
            assert!(dirs.contains(&site.join(sub)), "{sub} not in {dirs:?}");
        }
    }

    #[test]
    fn a_reduce_copies_back_on_the_root_only() {
        let mut d = OpData::Reduce {
            buf: Tensor::zeros(DType::F32, 4),
            op: crate::op::ReduceOp::Sum,
            root: 1,
        };
        assert_eq!(outputs(&mut d, 0).len(), 0);
        assert_eq!(outputs(&mut d, 1).len(), 1);
        assert_eq!(inputs(&d).len(), 1);
    }

    #[test]
    fn config_initializer_marks_unset_fields() {
        let c = sys::ncclConfig_t::new(false);
        assert_eq!(c.blocking, 0);
        assert_eq!(c.magic, 0xcafe_beef);
        assert_eq!(c.size, std::mem::size_of::<sys::ncclConfig_t>());
        assert_eq!(c.min_ctas, c_int::MIN);
        // NCCL 2.26 reads trafficClass at offset 44: a field, not padding.
        assert_eq!(std::mem::offset_of!(sys::ncclConfig_t, traffic_class), 44);
        assert_eq!(c.traffic_class, c_int::MIN);
        assert_eq!(std::mem::size_of::<sys::ncclConfig_t>(), 48);
    }
}
