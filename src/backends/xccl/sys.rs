//! Raw FFI of the NCCL C API (also exported, unchanged, by RCCL) and of the
//! few CUDA/HIP runtime calls the backend needs, loaded at run time.
//!
//! Layer 1 of 3 (sys / result / safe, as in cudarc): C types and function
//! tables, nothing else. Every symbol is resolved when the table is loaded,
//! so a missing library or symbol is an error string at load time
//! (XS-1), never a panic or a failure at the first call.
//! XS-2: a symbol only newer releases have (`ncclCommSplit`) is optional:
//! `None` when absent, and the feature that needs it falls back.
//!
//! The CUDA runtime (`cuda*`) and HIP (`hip*`) entry points used here have
//! identical signatures and the same numeric values for the constants used
//! (`*MemcpyHostToDevice` = 1, `*MemcpyDeviceToHost` = 2, `*ErrorNotReady` =
//! 600, `*StreamNonBlocking` = 1, `*EventDisableTiming` = 2), so one table
//! serves both, loaded with a different symbol prefix.
#![allow(non_camel_case_types)]

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::path::PathBuf;

/// `ncclResult_t`.
pub type ncclResult_t = c_int;
/// `ncclComm_t` (opaque).
pub type ncclComm_t = *mut c_void;
/// `cudaStream_t` / `hipStream_t` (opaque).
pub type Stream = *mut c_void;
/// `cudaEvent_t` / `hipEvent_t` (opaque).
pub type Event = *mut c_void;
/// `ncclDataType_t`.
pub type ncclDataType_t = c_int;
/// `ncclRedOp_t`.
pub type ncclRedOp_t = c_int;
/// `cudaError_t` / `hipError_t`.
pub type RtError = c_int;

/// `ncclSuccess`.
pub const NCCL_SUCCESS: ncclResult_t = 0;
/// `ncclInProgress`: a non-blocking communicator is still working.
pub const NCCL_IN_PROGRESS: ncclResult_t = 7;
/// `ncclTimeout` (NCCL >= 2.30).
pub const NCCL_TIMEOUT: ncclResult_t = 8;
/// `cudaStreamNonBlocking` / `hipStreamNonBlocking`.
pub const STREAM_NON_BLOCKING: c_uint = 1;
/// `cudaEventDisableTiming` / `hipEventDisableTiming`: an event only for
/// completion (cheaper to record and query).
pub const EVENT_DISABLE_TIMING: c_uint = 2;
/// `cudaErrorNotReady` / `hipErrorNotReady`.
pub const RT_NOT_READY: RtError = 600;
/// `cudaMemcpyHostToDevice` / `hipMemcpyHostToDevice`.
pub const MEMCPY_H2D: c_int = 1;
/// `cudaMemcpyDeviceToHost` / `hipMemcpyDeviceToHost`.
pub const MEMCPY_D2H: c_int = 2;
/// `ncclAvg` (NCCL >= 2.10): sum, then divide by the rank count.
pub const NCCL_AVG: ncclRedOp_t = 4;
/// `ncclScalarHostImmediate`: a PreMulSum scalar in host memory, read
/// before `ncclRedOpCreatePreMulSum` returns.
pub const NCCL_SCALAR_HOST_IMMEDIATE: c_int = 1;
/// `NCCL_SPLIT_NOCOLOR`: this rank takes part in a split but joins no child.
pub const NCCL_SPLIT_NOCOLOR: c_int = -1;
/// `NCCL_UNIQUE_ID_BYTES`.
pub const UNIQUE_ID_BYTES: usize = 128;
/// `ncclWindow_t` (opaque): a buffer registered with
/// `ncclCommWindowRegister` (NCCL >= 2.27).
pub type ncclWindow_t = *mut c_void;
/// `NCCL_WIN_DEFAULT`: register a window for every capability the
/// communicator supports (one-sided puts and signals included).
pub const NCCL_WIN_DEFAULT: c_int = 0;
/// `NCCL_WIN_REQUIRED_ALIGNMENT`: a window's buffer starts on this many
/// bytes (`ncclMemAlloc` returns such buffers).
pub const NCCL_WIN_REQUIRED_ALIGNMENT: usize = 4096;
/// The first NCCL release with the one-sided host API (`ncclPutSignal`,
/// `ncclSignal`, `ncclWaitSignal`): 2.29.0.
pub const NCCL_ONE_SIDED_VERSION: c_int = 22900;
/// `ncclUint8`.
pub const NCCL_UINT8: ncclDataType_t = 1;
/// `ncclUint64`.
pub const NCCL_UINT64: ncclDataType_t = 5;

/// `ncclWaitSignalDesc_t` (NCCL >= 2.29): wait for `op_cnt` signal
/// operations from `peer` on signal index `sig_idx` of context `ctx`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ncclWaitSignalDesc_t {
    /// Number of signal operations to wait for.
    pub op_cnt: c_int,
    /// The signalling rank.
    pub peer: c_int,
    /// Signal index.
    pub sig_idx: c_int,
    /// Context.
    pub ctx: c_int,
}

/// `ncclUniqueId`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ncclUniqueId {
    /// Opaque bytes, exchanged between ranks through the store.
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

/// `ncclConfig_t`, the NCCL 2.17 layout. NCCL reads `size` and `version`
/// and accepts older layouts, so this prefix is understood by every later
/// release (fields added since keep their defaults).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct ncclConfig_t {
    /// `sizeof(ncclConfig_t)` as the caller knows it.
    pub size: usize,
    /// `0xcafebeef`.
    pub magic: c_uint,
    /// `NCCL_VERSION(2, 17, 0)`.
    pub version: c_uint,
    /// 0 = non-blocking communicator.
    pub blocking: c_int,
    /// Unset (`INT_MIN`).
    pub cga_cluster_size: c_int,
    /// Unset (`INT_MIN`).
    pub min_ctas: c_int,
    /// Unset (`INT_MIN`).
    pub max_ctas: c_int,
    /// Unset (null).
    pub net_name: *const c_char,
    /// Unset (`INT_MIN`).
    pub split_share: c_int,
    /// Unset (`INT_MIN`); NCCL >= 2.26 reads it at offset 44, so it must
    /// never be left as uninitialised padding.
    pub traffic_class: c_int,
}

impl ncclConfig_t {
    /// `NCCL_CONFIG_INITIALIZER` with `blocking` set.
    pub fn new(blocking: bool) -> ncclConfig_t {
        ncclConfig_t {
            size: std::mem::size_of::<ncclConfig_t>(),
            magic: 0xcafe_beef,
            version: 21700,
            blocking: c_int::from(blocking),
            cga_cluster_size: c_int::MIN,
            min_ctas: c_int::MIN,
            max_ctas: c_int::MIN,
            net_name: std::ptr::null(),
            split_share: c_int::MIN,
            traffic_class: c_int::MIN,
        }
    }
}

macro_rules! fn_table {
    ($(#[$m:meta])* $name:ident {
        $($field:ident : $sym:literal => fn($($arg:ty),*) -> $ret:ty;)*
    } $(optional {
        $($ofield:ident : $osym:literal => fn($($oarg:ty),*) -> $oret:ty;)*
    })?) => {
        $(#[$m])*
        #[allow(missing_docs)]
        pub struct $name {
            _lib: libloading::Library,
            /// The file the library was loaded from.
            pub path: String,
            $(pub $field: unsafe extern "C" fn($($arg),*) -> $ret,)*
            $($(pub $ofield: Option<unsafe extern "C" fn($($oarg),*) -> $oret>,)*)?
        }

        impl $name {
            /// Resolve every symbol (with `prefix` prepended) from `lib`;
            /// an optional symbol the library lacks is `None` (XS-2).
            ///
            /// # Safety
            /// `lib` must be the library these signatures describe.
            unsafe fn from_lib(lib: libloading::Library, path: String, prefix: &str) -> Result<$name, String> {
                $(
                    let sym = format!("{}{}\0", prefix, $sym);
                    let $field = *lib
                        .get::<unsafe extern "C" fn($($arg),*) -> $ret>(sym.as_bytes())
                        .map_err(|e| format!("{path} lacks {}: {e}", sym.trim_end_matches('\0')))?;
                )*
                $($(
                    let sym = format!("{}{}\0", prefix, $osym);
                    let $ofield = lib
                        .get::<unsafe extern "C" fn($($oarg),*) -> $oret>(sym.as_bytes())
                        .ok()
                        .map(|f| *f);
                )*)?
                Ok($name { _lib: lib, path, $($field,)* $($($ofield,)*)? })
            }
        }
    };
}

fn_table! {
    /// The NCCL API (NCCL or RCCL).
    NcclApi {
        get_version: "GetVersion" => fn(*mut c_int) -> ncclResult_t;
        get_unique_id: "GetUniqueId" => fn(*mut ncclUniqueId) -> ncclResult_t;
        comm_init_rank_config: "CommInitRankConfig" => fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int, *mut ncclConfig_t) -> ncclResult_t;
        comm_get_async_error: "CommGetAsyncError" => fn(ncclComm_t, *mut ncclResult_t) -> ncclResult_t;
        comm_abort: "CommAbort" => fn(ncclComm_t) -> ncclResult_t;
        comm_destroy: "CommDestroy" => fn(ncclComm_t) -> ncclResult_t;
        get_error_string: "GetErrorString" => fn(ncclResult_t) -> *const c_char;
        all_reduce: "AllReduce" => fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclRedOp_t, ncclComm_t, Stream) -> ncclResult_t;
        reduce: "Reduce" => fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclRedOp_t, c_int, ncclComm_t, Stream) -> ncclResult_t;
        broadcast: "Broadcast" => fn(*const c_void, *mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, Stream) -> ncclResult_t;
        all_gather: "AllGather" => fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclComm_t, Stream) -> ncclResult_t;
        reduce_scatter: "ReduceScatter" => fn(*const c_void, *mut c_void, usize, ncclDataType_t, ncclRedOp_t, ncclComm_t, Stream) -> ncclResult_t;
        send: "Send" => fn(*const c_void, usize, ncclDataType_t, c_int, ncclComm_t, Stream) -> ncclResult_t;
        recv: "Recv" => fn(*mut c_void, usize, ncclDataType_t, c_int, ncclComm_t, Stream) -> ncclResult_t;
        group_start: "GroupStart" => fn() -> ncclResult_t;
        group_end: "GroupEnd" => fn() -> ncclResult_t;
    } optional {
        // NCCL >= 2.18, RCCL from ROCm 6.0.
        comm_split: "CommSplit" => fn(ncclComm_t, c_int, c_int, *mut ncclComm_t, *mut ncclConfig_t) -> ncclResult_t;
        // NCCL >= 2.13.
        comm_finalize: "CommFinalize" => fn(ncclComm_t) -> ncclResult_t;
        get_last_error: "GetLastError" => fn(ncclComm_t) -> *const c_char;
        // NCCL >= 2.11: `ncclRedOpCreatePreMulSum(ncclRedOp_t* op, void*
        // scalar, ncclDataType_t, ncclScalarResidence_t, ncclComm_t)` and
        // `ncclRedOpDestroy(ncclRedOp_t, ncclComm_t)`.
        red_op_create_pre_mul_sum: "RedOpCreatePreMulSum" => fn(*mut ncclRedOp_t, *mut c_void, ncclDataType_t, c_int, ncclComm_t) -> ncclResult_t;
        red_op_destroy: "RedOpDestroy" => fn(ncclRedOp_t, ncclComm_t) -> ncclResult_t;
        // NCCL >= 2.19: `ncclMemAlloc(void** ptr, size_t size)`,
        // `ncclMemFree(void* ptr)`.
        mem_alloc: "MemAlloc" => fn(*mut *mut c_void, usize) -> ncclResult_t;
        mem_free: "MemFree" => fn(*mut c_void) -> ncclResult_t;
        // NCCL >= 2.27: `ncclCommWindowRegister(ncclComm_t, void* buff,
        // size_t size, ncclWindow_t* win, int winFlags)`,
        // `ncclCommWindowDeregister(ncclComm_t, ncclWindow_t)`.
        comm_window_register: "CommWindowRegister" => fn(ncclComm_t, *mut c_void, usize, *mut ncclWindow_t, c_int) -> ncclResult_t;
        comm_window_deregister: "CommWindowDeregister" => fn(ncclComm_t, ncclWindow_t) -> ncclResult_t;
        // NCCL >= 2.29: `ncclPutSignal(const void* localbuff, size_t count,
        // ncclDataType_t, int peer, ncclWindow_t peerWin, size_t
        // peerWinOffset, int sigIdx, int ctx, unsigned int flags,
        // ncclComm_t, cudaStream_t)` and `ncclWaitSignal(int nDesc,
        // ncclWaitSignalDesc_t* signalDescs, ncclComm_t, cudaStream_t)`.
        put_signal: "PutSignal" => fn(*const c_void, usize, ncclDataType_t, c_int, ncclWindow_t, usize, c_int, c_int, c_uint, ncclComm_t, Stream) -> ncclResult_t;
        wait_signal: "WaitSignal" => fn(c_int, *mut ncclWaitSignalDesc_t, ncclComm_t, Stream) -> ncclResult_t;
    }
}

fn_table! {
    /// The CUDA runtime (`cuda*`) or HIP (`hip*`) calls the backend uses.
    RtApi {
        get_device_count: "GetDeviceCount" => fn(*mut c_int) -> RtError;
        set_device: "SetDevice" => fn(c_int) -> RtError;
        get_device: "GetDevice" => fn(*mut c_int) -> RtError;
        malloc: "Malloc" => fn(*mut *mut c_void, usize) -> RtError;
        free: "Free" => fn(*mut c_void) -> RtError;
        memcpy_async: "MemcpyAsync" => fn(*mut c_void, *const c_void, usize, c_int, Stream) -> RtError;
        memset_async: "MemsetAsync" => fn(*mut c_void, c_int, usize, Stream) -> RtError;
        stream_create_with_flags: "StreamCreateWithFlags" => fn(*mut Stream, c_uint) -> RtError;
        stream_query: "StreamQuery" => fn(Stream) -> RtError;
        stream_synchronize: "StreamSynchronize" => fn(Stream) -> RtError;
        stream_destroy: "StreamDestroy" => fn(Stream) -> RtError;
        // cudaEventCreateWithFlags(cudaEvent_t*, unsigned int),
        // cudaEventRecord(cudaEvent_t, cudaStream_t), cudaEventQuery(cudaEvent_t),
        // cudaEventDestroy(cudaEvent_t), cudaStreamWaitEvent(cudaStream_t,
        // cudaEvent_t, unsigned int); hip* alike.
        event_create_with_flags: "EventCreateWithFlags" => fn(*mut Event, c_uint) -> RtError;
        event_record: "EventRecord" => fn(Event, Stream) -> RtError;
        event_query: "EventQuery" => fn(Event) -> RtError;
        event_destroy: "EventDestroy" => fn(Event) -> RtError;
        stream_wait_event: "StreamWaitEvent" => fn(Stream, Event, c_uint) -> RtError;
        get_error_string: "GetErrorString" => fn(RtError) -> *const c_char;
    }
}

/// Directories searched for a library after the loader's own path: the
/// `CHORUS_LIB_DIRS` list, `/opt/rocm/lib`, `/usr/local/cuda/lib64`, and the
/// pip-wheel folders ([`wheel_lib_dirs`]) of the Python site directories
/// found on this machine (system, virtualenv, conda, user).
pub fn search_dirs() -> Vec<PathBuf> {
    let mut dirs: Vec<PathBuf> = std::env::var("CHORUS_LIB_DIRS")
        .map(|v| std::env::split_paths(&v).collect())
        .unwrap_or_default();
    dirs.push("/opt/rocm/lib".into());
    dirs.push("/usr/local/cuda/lib64".into());
    let mut roots: Vec<PathBuf> = vec!["/usr/lib".into(), "/usr/local/lib".into()];
    // PyTorch images often ship a conda environment rather than the system
    // Python: its site folders are under $CONDA_PREFIX/lib (/opt/conda).
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Ok(v) = std::env::var(var) {
            roots.push(PathBuf::from(v).join("lib"));
        }
    }
    roots.push("/opt/conda/lib".into());
    if let Ok(h) = std::env::var("HOME") {
        roots.push(PathBuf::from(h).join(".local/lib"));
    }
    for root in roots {
        let Ok(entries) = std::fs::read_dir(&root) else {
            continue;
        };
        for e in entries.flatten() {
            let name = e.file_name();
            if !name.to_string_lossy().starts_with("python3") {
                continue;
            }
            for site in ["site-packages", "dist-packages"] {
                dirs.extend(wheel_lib_dirs(&e.path().join(site)));
            }
        }
    }
    dirs
}

/// The folders of one Python site directory where NVIDIA's pip wheels put
/// NCCL and the CUDA runtime:
/// - `nvidia/nccl/lib`: `libnccl.so.2` of `nvidia-nccl-cu12` and of
///   `nvidia-nccl-cu13` alike (the cu13 NCCL wheel keeps the old layout);
/// - `nvidia/cuda_runtime/lib`: `libcudart.so.12` of
///   `nvidia-cuda-runtime-cu12`;
/// - `nvidia/cu13/lib`: `libcudart.so.13` of `nvidia-cuda-runtime` 13.x,
///   like every CUDA 13 wheel but NCCL.
pub fn wheel_lib_dirs(site: &std::path::Path) -> Vec<PathBuf> {
    let nv = site.join("nvidia");
    ["nccl", "cuda_runtime", "cu13"]
        .iter()
        .map(|sub| nv.join(sub).join("lib"))
        .collect()
}

/// Try each file name with the system loader, then in each of
/// [`search_dirs`]; the first that loads wins. The error lists what was tried.
fn open_first(names: &[&str]) -> Result<(libloading::Library, String), String> {
    let mut tried = Vec::new();
    let mut candidates: Vec<String> = names.iter().map(|n| n.to_string()).collect();
    for d in search_dirs() {
        for n in names {
            let p = d.join(n);
            if p.exists() {
                candidates.push(p.to_string_lossy().into_owned());
            }
        }
    }
    for c in candidates {
        // SAFETY: loading a vendor library runs its initialisers; these are
        // the well-known NCCL/RCCL/CUDA/HIP libraries named by the caller.
        match unsafe { libloading::Library::new(&c) } {
            Ok(lib) => return Ok((lib, c)),
            Err(e) => tried.push(format!("{c} ({e})")),
        }
    }
    Err(format!(
        "none of {names:?} could be loaded: {}",
        tried.join("; ")
    ))
}

/// Load the NCCL API from the first of `names` that loads.
///
/// # Errors
/// Which libraries were tried and why each failed, or which symbol is missing.
pub fn load_nccl(names: &[&str]) -> Result<NcclApi, String> {
    let (lib, path) = open_first(names)?;
    // SAFETY: the NCCL API has these signatures in NCCL >= 2.17 and RCCL.
    unsafe { NcclApi::from_lib(lib, path, "nccl") }
}

/// Load the CUDA runtime or HIP (`prefix` "cuda" or "hip") from `names`.
///
/// # Errors
/// As [`load_nccl`].
pub fn load_rt(names: &[&str], prefix: &str) -> Result<RtApi, String> {
    let (lib, path) = open_first(names)?;
    // SAFETY: cudart 12 and 13 and HIP >= 5 export these with these signatures.
    unsafe { RtApi::from_lib(lib, path, prefix) }
}
