//! A fake CUDA runtime + HIP + NCCL/RCCL, built as a cdylib
//! (`cargo build --example fake_xccl`) and loaded by the `nccl`/`rccl`
//! backends through `CHORUS_LIB_DIRS`, exactly as the real libraries are
//! (the test symlinks it as `libnccl.so.2`, `libcudart.so.12`,
//! `librccl.so.1` and `libamdhip64.so.6`). Test-only; never a backend.
//!
//! It exports the symbols `src/backends/xccl/sys.rs` resolves, with the C
//! signatures of `nccl.h` (2.26) and `cuda_runtime_api.h` (12.x); HIP's
//! entry points have the same signatures. What it models, because each is
//! something the real stack does and a bug in the backend would hide from a
//! simpler fake:
//! - a per-thread current device (`cudaSetDevice`/`cudaGetDevice`), and
//!   device memory tagged with the device current at `cudaMalloc`; every
//!   NCCL call checks that its buffers live on the communicator's device,
//!   as `NCCL_CHECK_POINTERS=1` does;
//! - streams as FIFOs run by one thread each: `cudaStreamQuery` is
//!   `cudaErrorNotReady` until the queued work ran, and a collective only
//!   runs once every rank's stream reached it;
//! - non-blocking communicators (`config.blocking = 0`): init, ops, split
//!   and finalize return `ncclInProgress` and finish on another thread; any
//!   call on a communicator still in progress is `ncclInvalidUsage`;
//! - per-thread group depth: calls inside `ncclGroupStart/End` are queued
//!   and issued at the outermost `ncclGroupEnd` (sends before receives, so
//!   matched pairs never deadlock);
//! - `ncclCommSplit` on a non-blocking parent writes `*newcomm` late, from
//!   another thread, after every parent rank called it;
//! - `ncclCommAbort` marks the rank dead: peers waiting for it in a
//!   collective get `ncclRemoteError` (a peer failure);
//! - `ncclCommDestroy` of a communicator that was not finalized finalizes
//!   it implicitly and blocks until every peer finalized (as NCCL does);
//! - `ncclAvg`, and `ncclRedOpCreatePreMulSum` (host-immediate scalars)
//!   with `ncclRedOpDestroy`: a created op is valid for its communicator
//!   and datatype only, its scalar is read at creation, and ops never
//!   destroyed show in the leak counters;
//! - `cudaMemsetAsync` on the stream, checked like a copy;
//! - events: `cudaEventRecord` captures the work queued on a stream so
//!   far (`cudaEventQuery` is `cudaErrorNotReady` until that ran, success
//!   for an event never recorded), an event is tagged with the device
//!   current at creation and refuses a stream of another device, and
//!   `cudaStreamWaitEvent` makes a stream's later work wait until the
//!   event's work ran on the other stream (a stream thread blocks), so an
//!   op that forgot to wait for its input's stream reads stale data;
//! - one-sided windows (NCCL 2.29's host API): `ncclMemAlloc`/`ncclMemFree`
//!   (4096-aligned device memory that `cudaFree` refuses),
//!   `ncclCommWindowRegister` (collective: ranks pair by registration order,
//!   and a non-blocking communicator is in progress meanwhile) and
//!   `ncclCommWindowDeregister`; `ncclPutSignal` writes into the peer's
//!   registered buffer from the sender's stream and then counts one signal
//!   operation for (sender, receiver, signal index, context);
//!   `ncclWaitSignal` blocks the receiver's stream until that many more
//!   operations arrived than it consumed (a dead sender is
//!   `ncclRemoteError`); the version `ncclGetVersion` reports is settable
//!   (`fake_xccl_set_version`, or `FAKE_XCCL_VERSION` in the environment;
//!   2.26.3 by default), so a test can model a library older than 2.29;
//! - error injection and leak counters, through the `fake_xccl_*` symbols.
//!
//! Ranks of one test process meet through in-process state keyed by the
//! unique id.
#![allow(clippy::missing_safety_doc, non_snake_case)]

use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::ffi::{c_char, c_int, c_uint, c_void, CString};
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Condvar, LazyLock, Mutex, MutexGuard};
use std::time::Duration;

type NcclResult = c_int;
type RtError = c_int;

const SUCCESS: c_int = 0;
const NCCL_SYSTEM_ERROR: c_int = 2;
const NCCL_INTERNAL_ERROR: c_int = 3;
const NCCL_INVALID_ARGUMENT: c_int = 4;
const NCCL_INVALID_USAGE: c_int = 5;
const NCCL_REMOTE_ERROR: c_int = 6;
const NCCL_IN_PROGRESS: c_int = 7;
const RT_INVALID_VALUE: c_int = 1;
const RT_INVALID_DEVICE: c_int = 101;
const RT_INVALID_DEVPTR: c_int = 17;
const RT_NOT_READY: c_int = 600;
const NOCOLOR: c_int = -1;
/// `ncclNumOps`: created reduction ops are numbered from here.
const NUM_OPS: c_int = 5;
/// `ncclScalarHostImmediate`.
const SCALAR_HOST_IMMEDIATE: c_int = 1;
/// How often a blocked stream task re-checks abort and hang flags.
const RECHECK: Duration = Duration::from_millis(20);

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

// ------------------------------------------------------------ global state

struct Counters {
    mallocs: AtomicU64,
    frees: AtomicU64,
    streams_created: AtomicU64,
    blocking_streams: AtomicU64,
    streams_destroyed: AtomicU64,
    comms_created: AtomicU64,
    comms_freed: AtomicU64,
    destroy_unfinalized: AtomicU64,
    finalizes: AtomicU64,
    aborts: AtomicU64,
    bad_pointer: AtomicU64,
    in_progress_misuse: AtomicU64,
    redops_created: AtomicU64,
    redops_destroyed: AtomicU64,
    events_created: AtomicU64,
    events_destroyed: AtomicU64,
    freed_in_use: AtomicU64,
    windows_registered: AtomicU64,
    windows_released: AtomicU64,
    mismatched_collectives: AtomicU64,
}

static COUNTERS: Counters = Counters {
    mallocs: AtomicU64::new(0),
    frees: AtomicU64::new(0),
    streams_created: AtomicU64::new(0),
    blocking_streams: AtomicU64::new(0),
    streams_destroyed: AtomicU64::new(0),
    comms_created: AtomicU64::new(0),
    comms_freed: AtomicU64::new(0),
    destroy_unfinalized: AtomicU64::new(0),
    finalizes: AtomicU64::new(0),
    aborts: AtomicU64::new(0),
    bad_pointer: AtomicU64::new(0),
    in_progress_misuse: AtomicU64::new(0),
    redops_created: AtomicU64::new(0),
    redops_destroyed: AtomicU64::new(0),
    events_created: AtomicU64::new(0),
    events_destroyed: AtomicU64::new(0),
    freed_in_use: AtomicU64::new(0),
    windows_registered: AtomicU64::new(0),
    windows_released: AtomicU64::new(0),
    mismatched_collectives: AtomicU64::new(0),
};

/// `trafficClass` as the last `ncclCommInitRankConfig`/`ncclCommSplit` saw
/// it (offset 44 of `ncclConfig_t`, read when `size >= 48`).
static LAST_TRAFFIC_CLASS: AtomicI32 = AtomicI32::new(0);
static DEVICE_COUNT: AtomicI32 = AtomicI32::new(8);
static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// Device allocations: start address -> (device, bytes).
static ALLOCS: LazyLock<Mutex<BTreeMap<usize, (c_int, usize)>>> =
    LazyLock::new(|| Mutex::new(BTreeMap::new()));
static STREAMS: LazyLock<Mutex<HashMap<usize, Arc<Stream>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));
static COMMS: LazyLock<Mutex<HashMap<usize, Arc<Comm>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));
static CLIQUES: LazyLock<Mutex<HashMap<u64, Arc<Clique>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));
/// Injection: devices whose ranks stop making progress (a hung peer).
static HUNG: LazyLock<Mutex<HashSet<c_int>>> = LazyLock::new(|| Mutex::new(HashSet::new()));
/// Injection: (device, calls to let through, code) for the next NCCL op call.
static FAIL: LazyLock<Mutex<Option<(c_int, u32, c_int)>>> = LazyLock::new(|| Mutex::new(None));
static LAST_ERROR: LazyLock<Mutex<CString>> = LazyLock::new(|| Mutex::new(CString::default()));
/// What `ncclGetVersion` reports when set (`fake_xccl_set_version`);
/// negative: `FAKE_XCCL_VERSION` from the environment, else 2.26.3.
static VERSION: AtomicI32 = AtomicI32::new(-1);

fn version() -> c_int {
    match VERSION.load(SeqCst) {
        v if v >= 0 => v,
        _ => std::env::var("FAKE_XCCL_VERSION")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(22603),
    }
}
/// Allocations made by `ncclMemAlloc` (start addresses).
static NCCL_MEM: LazyLock<Mutex<HashSet<usize>>> = LazyLock::new(|| Mutex::new(HashSet::new()));
/// Registered windows by handle.
static WINS: LazyLock<Mutex<HashMap<usize, Win>>> = LazyLock::new(|| Mutex::new(HashMap::new()));
/// Next window handle.
static NEXT_WIN: AtomicU64 = AtomicU64::new(0x5700_0000);
/// `NCCL_WIN_REQUIRED_ALIGNMENT`.
const WIN_ALIGN: usize = 4096;

thread_local! {
    static DEVICE: Cell<c_int> = const { Cell::new(0) };
    static GROUP: RefCell<(u32, Vec<Pending>)> = const { RefCell::new((0, Vec::new())) };
}

fn set_last_error(msg: String) {
    *lock(&LAST_ERROR) = CString::new(msg).unwrap_or_default();
}

fn hung(dev: c_int) -> bool {
    lock(&HUNG).contains(&dev)
}

// ------------------------------------------------------------- memory

/// The device of the allocation holding `[p, p + len)`, if any.
fn device_of(p: usize, len: usize) -> Option<c_int> {
    let allocs = lock(&ALLOCS);
    let (&start, &(dev, size)) = allocs.range(..=p).next_back()?;
    (p + len <= start + size).then_some(dev)
}

fn layout(size: usize) -> std::alloc::Layout {
    std::alloc::Layout::from_size_align(size.max(1), 256).expect("layout")
}

// ------------------------------------------------------------- streams

type Task = Box<dyn FnOnce() + Send>;

struct StreamQ {
    tasks: VecDeque<Task>,
    busy: bool,
    closed: bool,
}

struct Stream {
    device: c_int,
    q: Mutex<StreamQ>,
    cv: Condvar,
}

impl Stream {
    fn push(&self, t: Task) {
        lock(&self.q).tasks.push_back(t);
        self.cv.notify_all();
    }

    fn idle(&self) -> bool {
        let q = lock(&self.q);
        q.tasks.is_empty() && !q.busy
    }

    fn worker(self: Arc<Stream>) {
        loop {
            let task = {
                let mut q = lock(&self.q);
                loop {
                    if let Some(t) = q.tasks.pop_front() {
                        q.busy = true;
                        break t;
                    }
                    if q.closed {
                        return;
                    }
                    q = self.cv.wait(q).unwrap_or_else(|p| p.into_inner());
                }
            };
            task();
            lock(&self.q).busy = false;
            self.cv.notify_all();
        }
    }
}

fn stream_of(s: *mut c_void) -> Option<Arc<Stream>> {
    if s.is_null() {
        return Some(default_stream(DEVICE.with(Cell::get)));
    }
    lock(&STREAMS).get(&(s as usize)).cloned()
}

/// The legacy default stream (`0`) of `device`: created on first use, never
/// destroyed, not counted as a live stream. (It does not model the legacy
/// stream's implicit synchronisation, which non-blocking streams, the only
/// kind the backends create, do not take part in.)
fn default_stream(device: c_int) -> Arc<Stream> {
    static DEFAULTS: LazyLock<Mutex<HashMap<c_int, Arc<Stream>>>> =
        LazyLock::new(|| Mutex::new(HashMap::new()));
    lock(&DEFAULTS)
        .entry(device)
        .or_insert_with(|| {
            let s = Arc::new(Stream {
                device,
                q: Mutex::new(StreamQ {
                    tasks: VecDeque::new(),
                    busy: false,
                    closed: false,
                }),
                cv: Condvar::new(),
            });
            let w = s.clone();
            std::thread::Builder::new()
                .name("fake-default-stream".into())
                .spawn(move || w.worker())
                .expect("spawn stream thread");
            s
        })
        .clone()
}

fn create_stream(out: *mut *mut c_void, blocking: bool) -> RtError {
    if out.is_null() {
        return RT_INVALID_VALUE;
    }
    let s = Arc::new(Stream {
        device: DEVICE.with(Cell::get),
        q: Mutex::new(StreamQ {
            tasks: VecDeque::new(),
            busy: false,
            closed: false,
        }),
        cv: Condvar::new(),
    });
    let id = Arc::as_ptr(&s) as usize;
    let w = s.clone();
    std::thread::Builder::new()
        .name("fake-stream".into())
        .spawn(move || w.worker())
        .expect("spawn stream thread");
    lock(&STREAMS).insert(id, s);
    COUNTERS.streams_created.fetch_add(1, SeqCst);
    if blocking {
        COUNTERS.blocking_streams.fetch_add(1, SeqCst);
    }
    // SAFETY: checked non-null; the caller's out-parameter.
    unsafe { *out = id as *mut c_void };
    SUCCESS
}

// ------------------------------------------------------------- runtime API

unsafe fn rt_get_device_count(n: *mut c_int) -> RtError {
    if n.is_null() {
        return RT_INVALID_VALUE;
    }
    *n = DEVICE_COUNT.load(SeqCst);
    SUCCESS
}

fn rt_set_device(d: c_int) -> RtError {
    if d < 0 || d >= DEVICE_COUNT.load(SeqCst) {
        return RT_INVALID_DEVICE;
    }
    DEVICE.with(|c| c.set(d));
    SUCCESS
}

unsafe fn rt_get_device(d: *mut c_int) -> RtError {
    if d.is_null() {
        return RT_INVALID_VALUE;
    }
    *d = DEVICE.with(Cell::get);
    SUCCESS
}

unsafe fn rt_malloc(p: *mut *mut c_void, size: usize) -> RtError {
    if p.is_null() {
        return RT_INVALID_VALUE;
    }
    let mem = std::alloc::alloc_zeroed(layout(size));
    if mem.is_null() {
        return 2; // cudaErrorMemoryAllocation
    }
    lock(&ALLOCS).insert(mem as usize, (DEVICE.with(Cell::get), size));
    COUNTERS.mallocs.fetch_add(1, SeqCst);
    *p = mem.cast();
    SUCCESS
}

unsafe fn rt_free(p: *mut c_void) -> RtError {
    if p.is_null() {
        return SUCCESS;
    }
    if lock(&NCCL_MEM).contains(&(p as usize)) {
        set_last_error(format!("cudaFree of {p:p}, which ncclMemAlloc allocated"));
        return RT_INVALID_VALUE;
    }
    if lock(&IN_USE).contains_key(&(p as usize)) {
        // Real CUDA would synchronise the device first (and hang behind a
        // kernel waiting for a dead peer), or the kernel would use freed
        // memory: either way a bug in the caller.
        COUNTERS.freed_in_use.fetch_add(1, SeqCst);
    }
    let Some((_, size)) = lock(&ALLOCS).remove(&(p as usize)) else {
        return RT_INVALID_DEVPTR;
    };
    // cudaFree synchronises the device; here every stream is independent,
    // so only the counter records that it happened.
    std::alloc::dealloc(p.cast(), layout(size));
    COUNTERS.frees.fetch_add(1, SeqCst);
    SUCCESS
}

unsafe fn rt_memcpy_async(
    dst: *mut c_void,
    src: *const c_void,
    n: usize,
    kind: c_int,
    stream: *mut c_void,
) -> RtError {
    let Some(s) = stream_of(stream) else {
        return 400; // cudaErrorInvalidResourceHandle
    };
    if n == 0 {
        return SUCCESS;
    }
    let (d, sa) = (dst as usize, src as usize);
    match kind {
        1 => {
            // Host -> device from pageable memory: the host bytes are staged
            // before the call returns.
            if device_of(d, n).is_none() {
                return RT_INVALID_VALUE;
            }
            let staged = std::slice::from_raw_parts(src.cast::<u8>(), n).to_vec();
            s.push(Box::new(move || {
                // SAFETY: checked device allocation; freed only by cudaFree.
                unsafe { std::ptr::copy_nonoverlapping(staged.as_ptr(), d as *mut u8, n) };
            }));
        }
        2 | 3 => {
            if device_of(sa, n).is_none() || (kind == 3 && device_of(d, n).is_none()) {
                return RT_INVALID_VALUE;
            }
            s.push(Box::new(move || {
                // SAFETY: the caller keeps the host buffer alive until the
                // stream drained (the contract of cudaMemcpyAsync).
                unsafe { std::ptr::copy(sa as *const u8, d as *mut u8, n) };
            }));
        }
        _ => return RT_INVALID_VALUE,
    }
    SUCCESS
}

fn rt_memset_async(dst: *mut c_void, value: c_int, n: usize, stream: *mut c_void) -> RtError {
    let Some(s) = stream_of(stream) else {
        return 400;
    };
    if n == 0 {
        return SUCCESS;
    }
    let d = dst as usize;
    if device_of(d, n).is_none() {
        return RT_INVALID_VALUE;
    }
    s.push(Box::new(move || {
        // SAFETY: checked device allocation; freed only by cudaFree.
        unsafe { std::ptr::write_bytes(d as *mut u8, value as u8, n) };
    }));
    SUCCESS
}

// ------------------------------------------------------------- events

/// An event: the generation last recorded and the last one whose
/// preceding stream work ran.
struct Event {
    device: c_int,
    m: Mutex<(u64, u64)>,
    cv: Condvar,
}

static EVENTS: LazyLock<Mutex<HashMap<usize, Arc<Event>>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

fn event_of(e: *mut c_void) -> Option<Arc<Event>> {
    lock(&EVENTS).get(&(e as usize)).cloned()
}

unsafe fn rt_event_create(out: *mut *mut c_void, _flags: c_uint) -> RtError {
    if out.is_null() {
        return RT_INVALID_VALUE;
    }
    let e = Arc::new(Event {
        device: DEVICE.with(Cell::get),
        m: Mutex::new((0, 0)),
        cv: Condvar::new(),
    });
    let id = Arc::as_ptr(&e) as usize;
    lock(&EVENTS).insert(id, e);
    COUNTERS.events_created.fetch_add(1, SeqCst);
    *out = id as *mut c_void;
    SUCCESS
}

fn rt_event_record(ev: *mut c_void, stream: *mut c_void) -> RtError {
    let (Some(e), Some(s)) = (event_of(ev), stream_of(stream)) else {
        return 400;
    };
    if e.device != s.device {
        // CUDA: the event and the stream must belong to the same device.
        return RT_INVALID_VALUE;
    }
    let gen = {
        let mut g = lock(&e.m);
        g.0 += 1;
        g.0
    };
    let e2 = e.clone();
    s.push(Box::new(move || {
        let mut g = lock(&e2.m);
        g.1 = g.1.max(gen);
        e2.cv.notify_all();
    }));
    SUCCESS
}

fn rt_event_query(ev: *mut c_void) -> RtError {
    let Some(e) = event_of(ev) else {
        return 400;
    };
    let g = lock(&e.m);
    if g.1 >= g.0 {
        SUCCESS
    } else {
        RT_NOT_READY
    }
}

fn rt_event_destroy(ev: *mut c_void) -> RtError {
    if lock(&EVENTS).remove(&(ev as usize)).is_none() {
        return 400;
    }
    COUNTERS.events_destroyed.fetch_add(1, SeqCst);
    SUCCESS
}

fn rt_stream_wait_event(stream: *mut c_void, ev: *mut c_void, _flags: c_uint) -> RtError {
    let (Some(s), Some(e)) = (stream_of(stream), event_of(ev)) else {
        return 400;
    };
    // The generation recorded now; later records do not count (as CUDA).
    let gen = lock(&e.m).0;
    s.push(Box::new(move || {
        let mut g = lock(&e.m);
        while g.1 < gen {
            g =
                e.cv.wait_timeout(g, RECHECK)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
        }
    }));
    SUCCESS
}

macro_rules! event_exports {
    ($($create:ident $record:ident $query:ident $destroy:ident $wait:ident),*) => {$(
        #[no_mangle]
        pub unsafe extern "C" fn $create(e: *mut *mut c_void, flags: c_uint) -> RtError { rt_event_create(e, flags) }
        #[no_mangle]
        pub extern "C" fn $record(e: *mut c_void, s: *mut c_void) -> RtError { rt_event_record(e, s) }
        #[no_mangle]
        pub extern "C" fn $query(e: *mut c_void) -> RtError { rt_event_query(e) }
        #[no_mangle]
        pub extern "C" fn $destroy(e: *mut c_void) -> RtError { rt_event_destroy(e) }
        #[no_mangle]
        pub extern "C" fn $wait(s: *mut c_void, e: *mut c_void, flags: c_uint) -> RtError {
            rt_stream_wait_event(s, e, flags)
        }
    )*};
}

event_exports!(
    cudaEventCreateWithFlags cudaEventRecord cudaEventQuery cudaEventDestroy cudaStreamWaitEvent,
    hipEventCreateWithFlags hipEventRecord hipEventQuery hipEventDestroy hipStreamWaitEvent
);

fn rt_stream_query(stream: *mut c_void) -> RtError {
    match stream_of(stream) {
        Some(s) if s.idle() => SUCCESS,
        Some(_) => RT_NOT_READY,
        None => 400,
    }
}

fn rt_stream_synchronize(stream: *mut c_void) -> RtError {
    let Some(s) = stream_of(stream) else {
        return 400;
    };
    let mut q = lock(&s.q);
    while !q.tasks.is_empty() || q.busy {
        q = s.cv.wait(q).unwrap_or_else(|p| p.into_inner());
    }
    SUCCESS
}

fn rt_stream_destroy(stream: *mut c_void) -> RtError {
    let Some(s) = lock(&STREAMS).remove(&(stream as usize)) else {
        return 400;
    };
    // Like CUDA: queued work still completes, then the worker exits.
    lock(&s.q).closed = true;
    s.cv.notify_all();
    COUNTERS.streams_destroyed.fetch_add(1, SeqCst);
    SUCCESS
}

fn rt_error_string(e: RtError) -> *const c_char {
    let s: &'static [u8] = match e {
        0 => b"no error\0",
        1 => b"invalid argument\0",
        2 => b"out of memory\0",
        17 => b"invalid device pointer\0",
        101 => b"invalid device ordinal\0",
        400 => b"invalid resource handle\0",
        600 => b"device not ready\0",
        _ => b"unknown error\0",
    };
    s.as_ptr().cast()
}

macro_rules! runtime_exports {
    ($($getcount:ident $setdev:ident $getdev:ident $malloc:ident $free:ident $memcpy:ident
       $memset:ident
       $screate:ident $screateflags:ident $squery:ident $ssync:ident $sdestroy:ident $errstr:ident),*) => {$(
        #[no_mangle]
        pub extern "C" fn $memset(p: *mut c_void, v: c_int, n: usize, s: *mut c_void) -> RtError {
            rt_memset_async(p, v, n, s)
        }
        #[no_mangle]
        pub unsafe extern "C" fn $getcount(n: *mut c_int) -> RtError { rt_get_device_count(n) }
        #[no_mangle]
        pub extern "C" fn $setdev(d: c_int) -> RtError { rt_set_device(d) }
        #[no_mangle]
        pub unsafe extern "C" fn $getdev(d: *mut c_int) -> RtError { rt_get_device(d) }
        #[no_mangle]
        pub unsafe extern "C" fn $malloc(p: *mut *mut c_void, size: usize) -> RtError { rt_malloc(p, size) }
        #[no_mangle]
        pub unsafe extern "C" fn $free(p: *mut c_void) -> RtError { rt_free(p) }
        #[no_mangle]
        pub unsafe extern "C" fn $memcpy(dst: *mut c_void, src: *const c_void, n: usize, kind: c_int, s: *mut c_void) -> RtError {
            rt_memcpy_async(dst, src, n, kind, s)
        }
        #[no_mangle]
        pub extern "C" fn $screate(s: *mut *mut c_void) -> RtError { create_stream(s, true) }
        #[no_mangle]
        pub extern "C" fn $screateflags(s: *mut *mut c_void, flags: c_uint) -> RtError {
            // cudaStreamNonBlocking / hipStreamNonBlocking = 1.
            create_stream(s, flags & 1 == 0)
        }
        #[no_mangle]
        pub extern "C" fn $squery(s: *mut c_void) -> RtError { rt_stream_query(s) }
        #[no_mangle]
        pub extern "C" fn $ssync(s: *mut c_void) -> RtError { rt_stream_synchronize(s) }
        #[no_mangle]
        pub extern "C" fn $sdestroy(s: *mut c_void) -> RtError { rt_stream_destroy(s) }
        #[no_mangle]
        pub extern "C" fn $errstr(e: RtError) -> *const c_char { rt_error_string(e) }
    )*};
}

runtime_exports!(
    cudaGetDeviceCount cudaSetDevice cudaGetDevice cudaMalloc cudaFree cudaMemcpyAsync
    cudaMemsetAsync cudaStreamCreate cudaStreamCreateWithFlags cudaStreamQuery cudaStreamSynchronize
    cudaStreamDestroy cudaGetErrorString,
    hipGetDeviceCount hipSetDevice hipGetDevice hipMalloc hipFree hipMemcpyAsync
    hipMemsetAsync hipStreamCreate hipStreamCreateWithFlags hipStreamQuery hipStreamSynchronize
    hipStreamDestroy hipGetErrorString
);

// ------------------------------------------------------------- NCCL state

/// One collective call's meeting point on a clique.
struct Slot {
    meta: Option<(u8, usize, c_int, c_int, c_int)>,
    inputs: Vec<Option<Vec<u8>>>,
    taken: usize,
    mismatch: bool,
}

struct SplitSlot {
    /// (color, key) by parent rank.
    entries: Vec<Option<(c_int, c_int)>>,
    /// Child clique by color, created by the first rank to see all entries.
    children: HashMap<c_int, Arc<Clique>>,
}

#[derive(Default)]
struct CliqueState {
    joined: usize,
    devices: HashSet<c_int>,
    colls: HashMap<u64, Slot>,
    p2p: HashMap<(usize, usize), VecDeque<Vec<u8>>>,
    splits: HashMap<u64, SplitSlot>,
    finalized: HashSet<usize>,
    dead: HashSet<usize>,
    /// Window registrations by order: each rank's (buffer, bytes), `None`
    /// before it registered and after it deregistered.
    wins: HashMap<u64, Vec<Option<(usize, usize)>>>,
    /// The next registration number of each rank.
    win_next: HashMap<usize, u64>,
    /// Signal operations delivered: (from, to, signal index, context).
    signals: HashMap<(usize, usize, c_int, c_int), u64>,
    /// Signal operations the receiver consumed, keyed alike.
    consumed: HashMap<(usize, usize, c_int, c_int), u64>,
}

/// A registered window: its communicator and registration number.
struct Win {
    comm: Arc<Comm>,
    seq: u64,
}

struct Clique {
    nranks: usize,
    m: Mutex<CliqueState>,
    cv: Condvar,
}

impl Clique {
    fn new(nranks: usize) -> Arc<Clique> {
        Arc::new(Clique {
            nranks,
            m: Mutex::new(CliqueState::default()),
            cv: Condvar::new(),
        })
    }
}

struct Comm {
    clique: Arc<Clique>,
    rank: usize,
    nranks: usize,
    device: c_int,
    blocking: bool,
    /// `ncclCommGetAsyncError`'s answer.
    state: AtomicI32,
    aborted: AtomicBool,
    finalizing: AtomicBool,
    coll_seq: AtomicU64,
    split_seq: AtomicU64,
    /// `ncclRedOpCreatePreMulSum` ops of this communicator: op -> (dtype,
    /// scalar).
    redops: Mutex<HashMap<c_int, (c_int, f64)>>,
}

impl Comm {
    fn fail(&self, code: c_int, msg: String) {
        set_last_error(msg);
        let _ = self.state.fetch_update(SeqCst, SeqCst, |s| {
            (s == SUCCESS || s == NCCL_IN_PROGRESS).then_some(code)
        });
    }

    /// Mark the communicator in progress and finish on another thread.
    fn in_progress_then_settle(self: &Arc<Comm>) {
        let _ = self
            .state
            .compare_exchange(SUCCESS, NCCL_IN_PROGRESS, SeqCst, SeqCst);
        let me = self.clone();
        std::thread::spawn(move || {
            let _ = me
                .state
                .compare_exchange(NCCL_IN_PROGRESS, SUCCESS, SeqCst, SeqCst);
        });
    }

    /// Wait (on a stream or helper thread) while this rank's device hangs.
    fn wait_while_hung(&self) {
        while hung(self.device) && !self.aborted.load(SeqCst) {
            std::thread::sleep(RECHECK);
        }
    }
}

fn comm_of(c: *mut c_void) -> Option<Arc<Comm>> {
    lock(&COMMS).get(&(c as usize)).cloned()
}

fn register(comm: Arc<Comm>) -> *mut c_void {
    let id = Arc::as_ptr(&comm) as usize;
    lock(&COMMS).insert(id, comm);
    COUNTERS.comms_created.fetch_add(1, SeqCst);
    id as *mut c_void
}

/// A communicator usable for a new call: known, not aborted, not busy.
fn usable(c: *mut c_void, call: &str) -> Result<Arc<Comm>, NcclResult> {
    let Some(comm) = comm_of(c) else {
        set_last_error(format!("{call}: unknown or freed communicator {c:p}"));
        return Err(NCCL_INVALID_ARGUMENT);
    };
    match comm.state.load(SeqCst) {
        SUCCESS => Ok(comm),
        NCCL_IN_PROGRESS => {
            COUNTERS.in_progress_misuse.fetch_add(1, SeqCst);
            set_last_error(format!("{call}: communicator is still in progress"));
            Err(NCCL_INVALID_USAGE)
        }
        e => Err(e),
    }
}

fn esize(dtype: c_int) -> Option<usize> {
    Some(match dtype {
        0 | 1 => 1,
        6 | 9 => 2,
        2 | 3 | 7 => 4,
        4 | 5 | 8 => 8,
        _ => return None,
    })
}

// ------------------------------------------------------------- reductions

/// Element-wise `acc = acc (op) x` over native-endian elements of `T`
/// (the buffers are byte vectors, so no alignment is assumed).
fn fold<T: Copy, const N: usize>(
    acc: &mut [u8],
    x: &[u8],
    get: impl Fn([u8; N]) -> T,
    put: impl Fn(T) -> [u8; N],
    f: impl Fn(T, T) -> T,
) {
    for (a, b) in acc.chunks_exact_mut(N).zip(x.chunks_exact(N)) {
        let (va, vb) = (
            get(a.try_into().expect("chunk")),
            get(b.try_into().expect("chunk")),
        );
        a.copy_from_slice(&put(f(va, vb)));
    }
}

macro_rules! int_op {
    ($t:ty, $acc:expr, $x:expr, $op:expr) => {
        fold::<$t, { std::mem::size_of::<$t>() }>(
            $acc,
            $x,
            <$t>::from_ne_bytes,
            <$t>::to_ne_bytes,
            |a, b| match $op {
                0 | 4 => a.wrapping_add(b),
                1 => a.wrapping_mul(b),
                2 => a.max(b),
                _ => a.min(b),
            },
        )
    };
}

fn float_op(a: f64, b: f64, op: c_int) -> f64 {
    match op {
        0 | 4 => a + b,
        1 => a * b,
        2 => a.max(b),
        _ => a.min(b),
    }
}

fn reduce_into(acc: &mut [u8], x: &[u8], dtype: c_int, op: c_int) {
    use half::{bf16, f16};
    match dtype {
        0 => int_op!(i8, acc, x, op),
        1 => int_op!(u8, acc, x, op),
        2 => int_op!(i32, acc, x, op),
        3 => int_op!(u32, acc, x, op),
        4 => int_op!(i64, acc, x, op),
        5 => int_op!(u64, acc, x, op),
        6 => fold::<f16, 2>(acc, x, f16::from_ne_bytes, f16::to_ne_bytes, |a, b| {
            f16::from_f64(float_op(a.to_f64(), b.to_f64(), op))
        }),
        7 => fold::<f32, 4>(acc, x, f32::from_ne_bytes, f32::to_ne_bytes, |a, b| {
            float_op(f64::from(a), f64::from(b), op) as f32
        }),
        8 => fold::<f64, 8>(acc, x, f64::from_ne_bytes, f64::to_ne_bytes, |a, b| {
            float_op(a, b, op)
        }),
        _ => fold::<bf16, 2>(acc, x, bf16::from_ne_bytes, bf16::to_ne_bytes, |a, b| {
            bf16::from_f64(float_op(a.to_f64(), b.to_f64(), op))
        }),
    }
}

/// `ncclAvg`: divide the sum by the rank count (in place, element-wise).
fn average(acc: &mut [u8], dtype: c_int, n: usize) {
    let zero = vec![0u8; acc.len()];
    macro_rules! div {
        ($t:ty, $get:expr, $put:expr, $f:expr) => {
            fold::<$t, { std::mem::size_of::<$t>() }>(acc, &zero, $get, $put, |a, _| $f(a))
        };
    }
    use half::{bf16, f16};
    match dtype {
        0 => div!(i8, i8::from_ne_bytes, i8::to_ne_bytes, |a: i8| a / n as i8),
        1 => div!(u8, u8::from_ne_bytes, u8::to_ne_bytes, |a: u8| a / n as u8),
        2 => div!(i32, i32::from_ne_bytes, i32::to_ne_bytes, |a: i32| a / n
            as i32),
        3 => div!(u32, u32::from_ne_bytes, u32::to_ne_bytes, |a: u32| a / n
            as u32),
        4 => div!(i64, i64::from_ne_bytes, i64::to_ne_bytes, |a: i64| a / n
            as i64),
        5 => div!(u64, u64::from_ne_bytes, u64::to_ne_bytes, |a: u64| a / n
            as u64),
        6 => div!(f16, f16::from_ne_bytes, f16::to_ne_bytes, |a: f16| {
            f16::from_f64(a.to_f64() / n as f64)
        }),
        7 => div!(f32, f32::from_ne_bytes, f32::to_ne_bytes, |a: f32| a / n
            as f32),
        8 => div!(f64, f64::from_ne_bytes, f64::to_ne_bytes, |a: f64| a / n
            as f64),
        _ => div!(bf16, bf16::from_ne_bytes, bf16::to_ne_bytes, |a: bf16| {
            bf16::from_f64(a.to_f64() / n as f64)
        }),
    }
}

/// `ncclRedOpCreatePreMulSum`'s local step: multiply every element by `s`
/// (in the element type, as NCCL does with a scalar of that type).
fn premultiply(acc: &mut [u8], dtype: c_int, s: f64) {
    let zero = vec![0u8; acc.len()];
    macro_rules! mul {
        ($t:ty, $f:expr) => {
            fold::<$t, { std::mem::size_of::<$t>() }>(
                acc,
                &zero,
                <$t>::from_ne_bytes,
                <$t>::to_ne_bytes,
                |a, _| $f(a),
            )
        };
    }
    use half::{bf16, f16};
    match dtype {
        0 => mul!(i8, |a: i8| a.wrapping_mul(s as i8)),
        1 => mul!(u8, |a: u8| a.wrapping_mul(s as u8)),
        2 => mul!(i32, |a: i32| a.wrapping_mul(s as i32)),
        3 => mul!(u32, |a: u32| a.wrapping_mul(s as u32)),
        4 => mul!(i64, |a: i64| a.wrapping_mul(s as i64)),
        5 => mul!(u64, |a: u64| a.wrapping_mul(s as u64)),
        6 => mul!(f16, |a: f16| f16::from_f64(
            a.to_f64() * f16::from_f64(s).to_f64()
        )),
        7 => mul!(f32, |a: f32| a * s as f32),
        8 => mul!(f64, |a: f64| a * s),
        _ => mul!(bf16, |a: bf16| bf16::from_f64(
            a.to_f64() * bf16::from_f64(s).to_f64()
        )),
    }
}

// ------------------------------------------------------------- operations

#[derive(Clone, Copy)]
enum Kind {
    AllReduce,
    Reduce,
    Broadcast,
    AllGather,
    ReduceScatter,
}

#[derive(Clone, Copy)]
enum Op {
    Coll {
        kind: Kind,
        send: usize,
        recv: usize,
        count: usize,
        dtype: c_int,
        op: c_int,
        root: c_int,
        /// The scalar of a PreMulSum op, resolved when the call was made
        /// (the op may be destroyed right after).
        premul: Option<f64>,
    },
    Send {
        buf: usize,
        bytes: usize,
        peer: usize,
    },
    Recv {
        buf: usize,
        bytes: usize,
        peer: usize,
    },
}

struct Pending {
    comm: Arc<Comm>,
    stream: Arc<Stream>,
    op: Op,
}

/// Read `n` bytes of device memory (on a stream thread).
fn read(p: usize, n: usize) -> Vec<u8> {
    if n == 0 {
        return Vec::new();
    }
    // SAFETY: checked at enqueue to be inside a live device allocation.
    unsafe { std::slice::from_raw_parts(p as *const u8, n).to_vec() }
}

fn write(p: usize, data: &[u8]) {
    if data.is_empty() {
        return;
    }
    // SAFETY: as `read`.
    unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p as *mut u8, data.len()) };
}

/// Run one collective on this rank's stream thread: post the input, wait
/// for every peer, compute this rank's output.
fn run_coll(comm: &Comm, seq: u64, op: Op) {
    let Op::Coll {
        kind,
        send,
        recv,
        count,
        dtype,
        op: red,
        root,
        premul,
    } = op
    else {
        return;
    };
    comm.wait_while_hung();
    let es = esize(dtype).unwrap_or(1);
    let n = comm.nranks;
    let in_bytes = match kind {
        Kind::ReduceScatter => count * n * es,
        Kind::Broadcast if comm.rank as c_int != root => 0,
        _ => count * es,
    };
    let mut input = read(send, in_bytes);
    if let Some(s) = premul {
        premultiply(&mut input, dtype, s);
    }
    // A PreMulSum op sums (after the local scaling).
    let red = if premul.is_some() { 0 } else { red };
    let cl = &comm.clique;
    let mut st = lock(&cl.m);
    {
        let slot = st.colls.entry(seq).or_insert_with(|| Slot {
            meta: None,
            inputs: vec![None; n],
            taken: 0,
            mismatch: false,
        });
        let meta = (kind as u8, count, dtype, red, root);
        match slot.meta {
            None => slot.meta = Some(meta),
            Some(m) if m != meta => slot.mismatch = true,
            Some(_) => {}
        }
        slot.inputs[comm.rank] = Some(input);
    }
    cl.cv.notify_all();
    let mut counted = false;
    loop {
        if comm.aborted.load(SeqCst) {
            return;
        }
        let slot = st.colls.get(&seq).expect("slot");
        let all_in = slot.inputs.iter().all(Option::is_some);
        if all_in && !slot.mismatch {
            break;
        }
        // NCCL has no check here: ranks that issued different collectives
        // wait for bytes that never come (or, when the sizes happen to
        // agree, compute garbage). The fake hangs, until this rank is
        // aborted or a peer is, which is what Chorus must detect.
        if all_in && !counted {
            counted = true;
            COUNTERS.mismatched_collectives.fetch_add(1, SeqCst);
        }
        let gone = |r: &usize| {
            *r != comm.rank && st.dead.contains(r) && (slot.mismatch || slot.inputs[*r].is_none())
        };
        if let Some(d) = (0..n).find(gone) {
            drop(st);
            comm.fail(
                NCCL_REMOTE_ERROR,
                format!(
                    "rank {d} aborted while rank {} waited in a collective",
                    comm.rank
                ),
            );
            return;
        }
        st = cl
            .cv
            .wait_timeout(st, RECHECK)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
    let slot = st.colls.get_mut(&seq).expect("slot");
    let ins: Vec<&[u8]> = slot
        .inputs
        .iter()
        .map(|i| i.as_deref().unwrap_or(&[]))
        .collect();
    let reduce_all = |off: usize, len: usize| -> Vec<u8> {
        let mut acc = ins[0][off..off + len].to_vec();
        for x in &ins[1..] {
            reduce_into(&mut acc, &x[off..off + len], dtype, red);
        }
        if red == 4 {
            average(&mut acc, dtype, n);
        }
        acc
    };
    let out: Option<Vec<u8>> = match kind {
        Kind::AllReduce => Some(reduce_all(0, count * es)),
        Kind::Reduce => (comm.rank as c_int == root).then(|| reduce_all(0, count * es)),
        Kind::Broadcast => Some(ins[root as usize].to_vec()),
        Kind::AllGather => Some(ins.concat()),
        Kind::ReduceScatter => Some(reduce_all(comm.rank * count * es, count * es)),
    };
    slot.taken += 1;
    if slot.taken == n {
        st.colls.remove(&seq);
    }
    drop(st);
    if let Some(out) = out {
        write(recv, &out);
    }
}

fn run_send(comm: &Comm, buf: usize, bytes: usize, peer: usize) {
    comm.wait_while_hung();
    let data = read(buf, bytes);
    let cl = &comm.clique;
    lock(&cl.m)
        .p2p
        .entry((comm.rank, peer))
        .or_default()
        .push_back(data);
    cl.cv.notify_all();
}

fn run_recv(comm: &Comm, buf: usize, bytes: usize, peer: usize) {
    comm.wait_while_hung();
    let cl = &comm.clique;
    let mut st = lock(&cl.m);
    loop {
        if comm.aborted.load(SeqCst) {
            return;
        }
        if let Some(msg) = st
            .p2p
            .get_mut(&(peer, comm.rank))
            .and_then(VecDeque::pop_front)
        {
            drop(st);
            if msg.len() != bytes {
                comm.fail(
                    NCCL_INVALID_USAGE,
                    format!("recv of {bytes} bytes matched a send of {}", msg.len()),
                );
                return;
            }
            write(buf, &msg);
            return;
        }
        if st.dead.contains(&peer) {
            drop(st);
            comm.fail(
                NCCL_REMOTE_ERROR,
                format!("rank {peer} aborted before its send"),
            );
            return;
        }
        st = cl
            .cv
            .wait_timeout(st, RECHECK)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

/// Issue a batch of calls (a group, or one call outside any group): one
/// stream task per (communicator, stream), sends first.
fn issue(batch: Vec<Pending>) -> NcclResult {
    type PerStream = (Arc<Comm>, Arc<Stream>, Vec<(u64, Op)>);
    let mut by: Vec<PerStream> = Vec::new();
    for p in batch {
        let seq = match p.op {
            Op::Coll { .. } => p.comm.coll_seq.fetch_add(1, SeqCst),
            _ => 0,
        };
        match by
            .iter_mut()
            .find(|(c, s, _)| Arc::ptr_eq(c, &p.comm) && Arc::ptr_eq(s, &p.stream))
        {
            Some(e) => e.2.push((seq, p.op)),
            None => by.push((p.comm, p.stream, vec![(seq, p.op)])),
        }
    }
    let mut r = SUCCESS;
    for (comm, stream, mut ops) in by {
        ops.sort_by_key(|(_, o)| !matches!(o, Op::Send { .. }));
        let c = comm.clone();
        // The allocations these calls use are in use until the task ran.
        let used: Vec<usize> = ops
            .iter()
            .flat_map(|(_, o)| match *o {
                Op::Coll { send, recv, .. } => vec![send, recv],
                Op::Send { buf, .. } | Op::Recv { buf, .. } => vec![buf],
            })
            .filter_map(alloc_start)
            .collect();
        {
            let mut u = lock(&IN_USE);
            for &a in &used {
                *u.entry(a).or_insert(0) += 1;
            }
        }
        stream.push(Box::new(move || {
            let _release = InUse(used);
            for (seq, op) in ops {
                let s = c.state.load(SeqCst);
                if c.aborted.load(SeqCst) || (s != SUCCESS && s != NCCL_IN_PROGRESS) {
                    return;
                }
                match op {
                    Op::Coll { .. } => run_coll(&c, seq, op),
                    Op::Send { buf, bytes, peer } => run_send(&c, buf, bytes, peer),
                    Op::Recv { buf, bytes, peer } => run_recv(&c, buf, bytes, peer),
                }
            }
        }));
        if !comm.blocking {
            comm.in_progress_then_settle();
            r = NCCL_IN_PROGRESS;
        }
    }
    r
}

/// Device allocations (by start address) that queued NCCL work will still
/// touch, with how many stream tasks hold each.
static IN_USE: LazyLock<Mutex<HashMap<usize, usize>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// Releases a stream task's hold on its allocations when the task ends.
struct InUse(Vec<usize>);

impl Drop for InUse {
    fn drop(&mut self) {
        let mut u = lock(&IN_USE);
        for a in &self.0 {
            if let Some(n) = u.get_mut(a) {
                *n -= 1;
                if *n == 0 {
                    u.remove(a);
                }
            }
        }
    }
}

/// The start of the device allocation holding `p`.
fn alloc_start(p: usize) -> Option<usize> {
    let allocs = lock(&ALLOCS);
    let (&start, &(_, size)) = allocs.range(..=p).next_back()?;
    (p < start + size.max(1)).then_some(start)
}

/// Check and queue (or issue) one call.
unsafe fn enqueue(call: &str, c: *mut c_void, stream: *mut c_void, op: Op) -> NcclResult {
    let comm = match usable(c, call) {
        Ok(comm) => comm,
        Err(e) => return e,
    };
    {
        let mut f = lock(&FAIL);
        if let Some((dev, left, code)) = *f {
            if dev == comm.device {
                if left == 0 {
                    *f = None;
                    set_last_error(format!("{call}: injected failure {code}"));
                    return code;
                }
                *f = Some((dev, left - 1, code));
            }
        }
    }
    let mut op = op;
    if let Op::Coll {
        op: red,
        dtype,
        premul,
        ..
    } = &mut op
    {
        if *red >= NUM_OPS {
            match lock(&comm.redops).get(red) {
                Some(&(d, s)) if d == *dtype => *premul = Some(s),
                Some(&(d, _)) => {
                    set_last_error(format!(
                        "{call}: reduction op {red} was created for datatype {d}, used with {dtype}"
                    ));
                    return NCCL_INVALID_ARGUMENT;
                }
                None => {
                    set_last_error(format!(
                        "{call}: reduction op {red} is not an op of this communicator"
                    ));
                    return NCCL_INVALID_ARGUMENT;
                }
            }
        } else if *red < 0 {
            set_last_error(format!("{call}: invalid reduction op {red}"));
            return NCCL_INVALID_ARGUMENT;
        }
    }
    let Some(stream) = stream_of(stream) else {
        set_last_error(format!("{call}: invalid stream {stream:p}"));
        return NCCL_INVALID_ARGUMENT;
    };
    if stream.device != comm.device {
        set_last_error(format!(
            "{call}: stream of device {} used with the communicator of device {}",
            stream.device, comm.device
        ));
        return NCCL_INVALID_ARGUMENT;
    }
    // NCCL_CHECK_POINTERS: every buffer on the communicator's device.
    let spans: Vec<(usize, usize)> = match op {
        Op::Coll {
            kind,
            send,
            recv,
            count,
            dtype,
            root,
            ..
        } => {
            let Some(es) = esize(dtype) else {
                set_last_error(format!("{call}: invalid datatype {dtype}"));
                return NCCL_INVALID_ARGUMENT;
            };
            if matches!(kind, Kind::Reduce | Kind::Broadcast)
                && (root < 0 || root as usize >= comm.nranks)
            {
                set_last_error(format!("{call}: invalid root {root}"));
                return NCCL_INVALID_ARGUMENT;
            }
            let n = comm.nranks;
            let (sb, rb) = match kind {
                Kind::AllReduce => (count * es, count * es),
                Kind::Reduce => (
                    count * es,
                    if comm.rank as c_int == root {
                        count * es
                    } else {
                        0
                    },
                ),
                Kind::Broadcast => (
                    if comm.rank as c_int == root {
                        count * es
                    } else {
                        0
                    },
                    count * es,
                ),
                Kind::AllGather => (count * es, count * n * es),
                Kind::ReduceScatter => (count * n * es, count * es),
            };
            vec![(send, sb), (recv, rb)]
        }
        Op::Send { buf, bytes, peer } | Op::Recv { buf, bytes, peer } => {
            if peer >= comm.nranks {
                set_last_error(format!("{call}: invalid peer {peer}"));
                return NCCL_INVALID_ARGUMENT;
            }
            vec![(buf, bytes)]
        }
    };
    for (p, len) in spans {
        if len == 0 {
            continue;
        }
        match device_of(p, len) {
            Some(d) if d == comm.device => {}
            other => {
                COUNTERS.bad_pointer.fetch_add(1, SeqCst);
                set_last_error(format!(
                    "{call}: pointer {p:#x} ({len} bytes) is on device {other:?}, the \
                     communicator on device {}",
                    comm.device
                ));
                return NCCL_INVALID_ARGUMENT;
            }
        }
    }
    let p = Pending { comm, stream, op };
    let in_group = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.0 > 0 {
            g.1.push(Pending {
                comm: p.comm.clone(),
                stream: p.stream.clone(),
                op: p.op,
            });
            true
        } else {
            false
        }
    });
    if in_group {
        SUCCESS
    } else {
        issue(vec![p])
    }
}

// ------------------------------------------------------------- NCCL API

#[no_mangle]
pub unsafe extern "C" fn ncclGetVersion(v: *mut c_int) -> NcclResult {
    if v.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    *v = version();
    SUCCESS
}

/// `ncclUniqueId`: 128 opaque bytes, passed by value to init.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct UniqueId {
    internal: [u8; 128],
}

#[no_mangle]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut UniqueId) -> NcclResult {
    if id.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    let mut bytes = [0u8; 128];
    let n = NEXT_ID.fetch_add(1, SeqCst) | (u64::from(std::process::id()) << 32);
    bytes[..8].copy_from_slice(&n.to_le_bytes());
    bytes[8..12].copy_from_slice(b"fake");
    *id = UniqueId { internal: bytes };
    SUCCESS
}

/// Read `blocking` (offset 16) and `trafficClass` (offset 44, when the
/// caller's `size` covers it) of an `ncclConfig_t`.
unsafe fn read_config(config: *const u8) -> Result<bool, NcclResult> {
    if config.is_null() {
        return Ok(true);
    }
    let size = std::ptr::read_unaligned(config.cast::<usize>());
    let magic = std::ptr::read_unaligned(config.add(8).cast::<c_uint>());
    if magic != 0xcafe_beef || size < 44 {
        set_last_error("ncclConfig_t not initialised with NCCL_CONFIG_INITIALIZER".into());
        return Err(NCCL_INVALID_ARGUMENT);
    }
    if size >= 48 {
        let tc = std::ptr::read_unaligned(config.add(44).cast::<c_int>());
        LAST_TRAFFIC_CLASS.store(tc, SeqCst);
    }
    let blocking = std::ptr::read_unaligned(config.add(16).cast::<c_int>());
    Ok(blocking != 0)
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    out: *mut *mut c_void,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
    config: *mut c_void,
) -> NcclResult {
    if out.is_null() || nranks < 1 || rank < 0 || rank >= nranks {
        return NCCL_INVALID_ARGUMENT;
    }
    let blocking = match read_config(config.cast()) {
        Ok(b) => b,
        Err(e) => return e,
    };
    let key = u64::from_le_bytes(id.internal[..8].try_into().expect("8 bytes"));
    let clique = lock(&CLIQUES)
        .entry(key)
        .or_insert_with(|| Clique::new(nranks as usize))
        .clone();
    if clique.nranks != nranks as usize {
        set_last_error("ranks disagree on nranks".into());
        return NCCL_INVALID_ARGUMENT;
    }
    let device = DEVICE.with(Cell::get);
    {
        let mut st = lock(&clique.m);
        if !st.devices.insert(device) && std::env::var_os("NCCL_MULTI_RANK_GPU_ENABLE").is_none() {
            set_last_error(format!(
                "Duplicate GPU detected: rank {rank} on device {device}"
            ));
            return NCCL_INVALID_USAGE;
        }
    }
    let comm = Arc::new(Comm {
        clique: clique.clone(),
        rank: rank as usize,
        nranks: nranks as usize,
        device,
        blocking,
        state: AtomicI32::new(NCCL_IN_PROGRESS),
        aborted: AtomicBool::new(false),
        finalizing: AtomicBool::new(false),
        coll_seq: AtomicU64::new(0),
        split_seq: AtomicU64::new(0),
        redops: Mutex::new(HashMap::new()),
    });
    *out = register(comm.clone());
    let join = move || {
        comm.wait_while_hung();
        let cl = &comm.clique;
        let mut st = lock(&cl.m);
        st.joined += 1;
        cl.cv.notify_all();
        while st.joined < cl.nranks {
            if comm.aborted.load(SeqCst) {
                return;
            }
            st = cl
                .cv
                .wait_timeout(st, RECHECK)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        drop(st);
        let _ = comm
            .state
            .compare_exchange(NCCL_IN_PROGRESS, SUCCESS, SeqCst, SeqCst);
    };
    if blocking {
        join();
        SUCCESS
    } else {
        std::thread::spawn(join);
        NCCL_IN_PROGRESS
    }
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommGetAsyncError(c: *mut c_void, state: *mut c_int) -> NcclResult {
    let Some(comm) = comm_of(c) else {
        return NCCL_INVALID_ARGUMENT;
    };
    if state.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    *state = comm.state.load(SeqCst);
    SUCCESS
}

#[no_mangle]
pub extern "C" fn ncclGetLastError(_comm: *mut c_void) -> *const c_char {
    // The string lives until the next error; copied by the caller at once.
    lock(&LAST_ERROR).as_ptr()
}

fn free_comm(c: *mut c_void) -> Option<Arc<Comm>> {
    let comm = lock(&COMMS).remove(&(c as usize))?;
    COUNTERS.comms_freed.fetch_add(1, SeqCst);
    Some(comm)
}

#[no_mangle]
pub extern "C" fn ncclCommAbort(c: *mut c_void) -> NcclResult {
    let Some(comm) = free_comm(c) else {
        return NCCL_INVALID_ARGUMENT;
    };
    COUNTERS.aborts.fetch_add(1, SeqCst);
    comm.aborted.store(true, SeqCst);
    drop_windows_of(&comm);
    let cl = &comm.clique;
    lock(&cl.m).dead.insert(comm.rank);
    cl.cv.notify_all();
    SUCCESS
}

/// Wait until every live rank of the clique finalized (or died).
fn wait_finalized(comm: &Comm) {
    let cl = &comm.clique;
    let mut st = lock(&cl.m);
    while (0..cl.nranks).any(|r| !st.finalized.contains(&r) && !st.dead.contains(&r)) {
        if comm.aborted.load(SeqCst) {
            return;
        }
        st = cl
            .cv
            .wait_timeout(st, RECHECK)
            .unwrap_or_else(|p| p.into_inner())
            .0;
    }
}

fn mark_finalized(comm: &Comm) {
    comm.finalizing.store(true, SeqCst);
    COUNTERS.finalizes.fetch_add(1, SeqCst);
    let cl = &comm.clique;
    lock(&cl.m).finalized.insert(comm.rank);
    cl.cv.notify_all();
}

#[no_mangle]
pub extern "C" fn ncclCommFinalize(c: *mut c_void) -> NcclResult {
    let comm = match usable(c, "ncclCommFinalize") {
        Ok(comm) => comm,
        Err(e) => return e,
    };
    if comm.finalizing.load(SeqCst) {
        return NCCL_INVALID_USAGE;
    }
    comm.wait_while_hung();
    mark_finalized(&comm);
    if comm.blocking {
        wait_finalized(&comm);
        return SUCCESS;
    }
    comm.state.store(NCCL_IN_PROGRESS, SeqCst);
    std::thread::spawn(move || {
        wait_finalized(&comm);
        let _ = comm
            .state
            .compare_exchange(NCCL_IN_PROGRESS, SUCCESS, SeqCst, SeqCst);
    });
    NCCL_IN_PROGRESS
}

#[no_mangle]
pub extern "C" fn ncclCommDestroy(c: *mut c_void) -> NcclResult {
    let Some(comm) = comm_of(c) else {
        return NCCL_INVALID_ARGUMENT;
    };
    if !comm.finalizing.load(SeqCst) {
        // NCCL finalizes implicitly, which waits for every peer.
        COUNTERS.destroy_unfinalized.fetch_add(1, SeqCst);
        mark_finalized(&comm);
        wait_finalized(&comm);
    } else if comm.state.load(SeqCst) == NCCL_IN_PROGRESS {
        return NCCL_INVALID_USAGE;
    }
    drop_windows_of(&comm);
    free_comm(c);
    SUCCESS
}

#[no_mangle]
pub extern "C" fn ncclGetErrorString(r: NcclResult) -> *const c_char {
    let s: &'static [u8] = match r {
        0 => b"no error\0",
        1 => b"unhandled cuda error\0",
        2 => b"unhandled system error\0",
        3 => b"internal error\0",
        4 => b"invalid argument\0",
        5 => b"invalid usage\0",
        6 => b"remote process exited or there was a network error\0",
        7 => b"NCCL operation in progress\0",
        8 => b"NCCL timeout\0",
        _ => b"unknown result code\0",
    };
    s.as_ptr().cast()
}

#[no_mangle]
pub unsafe extern "C" fn ncclAllReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    let kind = Kind::AllReduce;
    let (send, recv, root) = (send as usize, recv as usize, 0);
    enqueue(
        "ncclAllReduce",
        comm,
        stream,
        Op::Coll {
            kind,
            send,
            recv,
            count,
            dtype,
            op,
            root,
            premul: None,
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn ncclReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    let kind = Kind::Reduce;
    let (send, recv) = (send as usize, recv as usize);
    enqueue(
        "ncclReduce",
        comm,
        stream,
        Op::Coll {
            kind,
            send,
            recv,
            count,
            dtype,
            op,
            root,
            premul: None,
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn ncclBroadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    let kind = Kind::Broadcast;
    let (send, recv, op) = (send as usize, recv as usize, 0);
    enqueue(
        "ncclBroadcast",
        comm,
        stream,
        Op::Coll {
            kind,
            send,
            recv,
            count,
            dtype,
            op,
            root,
            premul: None,
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn ncclAllGather(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    let kind = Kind::AllGather;
    let (send, recv, op, root) = (send as usize, recv as usize, 0, 0);
    enqueue(
        "ncclAllGather",
        comm,
        stream,
        Op::Coll {
            kind,
            send,
            recv,
            count,
            dtype,
            op,
            root,
            premul: None,
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn ncclReduceScatter(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    dtype: c_int,
    op: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    let kind = Kind::ReduceScatter;
    let (send, recv, root) = (send as usize, recv as usize, 0);
    enqueue(
        "ncclReduceScatter",
        comm,
        stream,
        Op::Coll {
            kind,
            send,
            recv,
            count,
            dtype,
            op,
            root,
            premul: None,
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn ncclSend(
    buf: *const c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    let Some(es) = esize(dtype) else {
        return NCCL_INVALID_ARGUMENT;
    };
    let Ok(peer) = usize::try_from(peer) else {
        return NCCL_INVALID_ARGUMENT;
    };
    let op = Op::Send {
        buf: buf as usize,
        bytes: count * es,
        peer,
    };
    enqueue("ncclSend", comm, stream, op)
}

#[no_mangle]
pub unsafe extern "C" fn ncclRecv(
    buf: *mut c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    let Some(es) = esize(dtype) else {
        return NCCL_INVALID_ARGUMENT;
    };
    let Ok(peer) = usize::try_from(peer) else {
        return NCCL_INVALID_ARGUMENT;
    };
    let op = Op::Recv {
        buf: buf as usize,
        bytes: count * es,
        peer,
    };
    enqueue("ncclRecv", comm, stream, op)
}

/// Read one scalar of NCCL datatype `dtype` at `p` (host memory).
unsafe fn read_scalar(p: *const c_void, dtype: c_int) -> Option<f64> {
    use half::{bf16, f16};
    Some(match dtype {
        0 => f64::from(p.cast::<i8>().read_unaligned()),
        1 => f64::from(p.cast::<u8>().read_unaligned()),
        2 => f64::from(p.cast::<i32>().read_unaligned()),
        3 => f64::from(p.cast::<u32>().read_unaligned()),
        4 => p.cast::<i64>().read_unaligned() as f64,
        5 => p.cast::<u64>().read_unaligned() as f64,
        6 => f16::from_bits(p.cast::<u16>().read_unaligned()).to_f64(),
        7 => f64::from(p.cast::<f32>().read_unaligned()),
        8 => p.cast::<f64>().read_unaligned(),
        9 => bf16::from_bits(p.cast::<u16>().read_unaligned()).to_f64(),
        _ => return None,
    })
}

#[no_mangle]
pub unsafe extern "C" fn ncclRedOpCreatePreMulSum(
    op: *mut c_int,
    scalar: *mut c_void,
    dtype: c_int,
    residence: c_int,
    c: *mut c_void,
) -> NcclResult {
    let comm = match usable(c, "ncclRedOpCreatePreMulSum") {
        Ok(comm) => comm,
        Err(e) => return e,
    };
    if op.is_null() || scalar.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    if residence != SCALAR_HOST_IMMEDIATE {
        // Device-resident scalars are read while the collective runs; the
        // backend never uses them, so the fake does not model them.
        set_last_error("fake: only ncclScalarHostImmediate scalars are modelled".into());
        return NCCL_INVALID_ARGUMENT;
    }
    let Some(s) = read_scalar(scalar, dtype) else {
        set_last_error(format!(
            "ncclRedOpCreatePreMulSum: invalid datatype {dtype}"
        ));
        return NCCL_INVALID_ARGUMENT;
    };
    let mut ops = lock(&comm.redops);
    let id = (NUM_OPS..)
        .find(|k| !ops.contains_key(k))
        .unwrap_or(NUM_OPS);
    ops.insert(id, (dtype, s));
    COUNTERS.redops_created.fetch_add(1, SeqCst);
    *op = id;
    SUCCESS
}

#[no_mangle]
pub extern "C" fn ncclRedOpDestroy(op: c_int, c: *mut c_void) -> NcclResult {
    // Like every call on a non-blocking communicator: refused while an
    // enqueue is still in progress.
    let comm = match usable(c, "ncclRedOpDestroy") {
        Ok(comm) => comm,
        Err(e) => return e,
    };
    if lock(&comm.redops).remove(&op).is_none() {
        set_last_error(format!(
            "ncclRedOpDestroy: {op} is not an op of this communicator"
        ));
        return NCCL_INVALID_ARGUMENT;
    }
    COUNTERS.redops_destroyed.fetch_add(1, SeqCst);
    SUCCESS
}

#[no_mangle]
pub extern "C" fn ncclGroupStart() -> NcclResult {
    GROUP.with(|g| g.borrow_mut().0 += 1);
    SUCCESS
}

#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> NcclResult {
    let batch = GROUP.with(|g| {
        let mut g = g.borrow_mut();
        if g.0 == 0 {
            return Err(NCCL_INVALID_USAGE);
        }
        g.0 -= 1;
        Ok(if g.0 == 0 {
            std::mem::take(&mut g.1)
        } else {
            Vec::new()
        })
    });
    match batch {
        Ok(b) if b.is_empty() => SUCCESS,
        Ok(b) => issue(b),
        Err(e) => e,
    }
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommSplit(
    c: *mut c_void,
    color: c_int,
    key: c_int,
    newcomm: *mut *mut c_void,
    config: *mut c_void,
) -> NcclResult {
    let parent = match usable(c, "ncclCommSplit") {
        Ok(comm) => comm,
        Err(e) => return e,
    };
    if newcomm.is_null() || (color < 0 && color != NOCOLOR) {
        return NCCL_INVALID_ARGUMENT;
    }
    let child_blocking = match read_config(config.cast()) {
        Ok(b) => b,
        Err(e) => return e,
    };
    *newcomm = std::ptr::null_mut();
    let seq = parent.split_seq.fetch_add(1, SeqCst);
    let out = newcomm as usize;
    let device = DEVICE.with(Cell::get);
    let p = parent.clone();
    let work = move || -> NcclResult {
        p.wait_while_hung();
        let cl = &p.clique;
        let mut st = lock(&cl.m);
        st.splits
            .entry(seq)
            .or_insert_with(|| SplitSlot {
                entries: vec![None; cl.nranks],
                children: HashMap::new(),
            })
            .entries[p.rank] = Some((color, key));
        cl.cv.notify_all();
        loop {
            if p.aborted.load(SeqCst) {
                return NCCL_INVALID_USAGE;
            }
            if st.splits[&seq].entries.iter().all(Option::is_some) {
                break;
            }
            if st
                .dead
                .iter()
                .any(|d| st.splits[&seq].entries[*d].is_none())
            {
                drop(st);
                p.fail(
                    NCCL_REMOTE_ERROR,
                    "a rank aborted during ncclCommSplit".into(),
                );
                return NCCL_REMOTE_ERROR;
            }
            st = cl
                .cv
                .wait_timeout(st, RECHECK)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
        if color == NOCOLOR {
            return SUCCESS;
        }
        let slot = st.splits.get_mut(&seq).expect("split slot");
        let mut members: Vec<(c_int, usize)> = slot
            .entries
            .iter()
            .enumerate()
            .filter_map(|(r, e)| e.filter(|(c, _)| *c == color).map(|(_, k)| (k, r)))
            .collect();
        members.sort_unstable();
        let nranks = members.len();
        let child_rank = members
            .iter()
            .position(|(_, r)| *r == p.rank)
            .expect("member");
        let clique = slot
            .children
            .entry(color)
            .or_insert_with(|| {
                let c = Clique::new(nranks);
                lock(&c.m).joined = nranks;
                c
            })
            .clone();
        drop(st);
        let child = Arc::new(Comm {
            clique,
            rank: child_rank,
            nranks,
            device,
            blocking: child_blocking,
            state: AtomicI32::new(SUCCESS),
            aborted: AtomicBool::new(false),
            finalizing: AtomicBool::new(false),
            coll_seq: AtomicU64::new(0),
            split_seq: AtomicU64::new(0),
            redops: Mutex::new(HashMap::new()),
        });
        let ptr = register(child);
        // The late write NCCL does from its own thread.
        // SAFETY: the caller must keep `*newcomm` alive until the parent
        // settled; that is what this fake checks.
        unsafe { *(out as *mut *mut c_void) = ptr };
        SUCCESS
    };
    if parent.blocking {
        return work();
    }
    parent.state.store(NCCL_IN_PROGRESS, SeqCst);
    let p = parent.clone();
    std::thread::spawn(move || {
        let r = work();
        // Let the caller observe the in-progress window before settling.
        std::thread::sleep(Duration::from_millis(2));
        if r == SUCCESS {
            let _ = p
                .state
                .compare_exchange(NCCL_IN_PROGRESS, SUCCESS, SeqCst, SeqCst);
        } else {
            p.fail(r, "ncclCommSplit failed".into());
        }
    });
    NCCL_IN_PROGRESS
}

// ------------------------------------------------------------- controls

/// Leak and misuse counters, for the tests.
#[repr(C)]
#[derive(Default)]
pub struct FakeCounters {
    /// `cudaMalloc` calls.
    pub mallocs: u64,
    /// `cudaFree` calls that freed something.
    pub frees: u64,
    /// Allocations still live.
    pub live_allocs: u64,
    /// Streams created, and how many of them blocking (`cudaStreamCreate`).
    pub streams_created: u64,
    /// Streams created without `cudaStreamNonBlocking`.
    pub blocking_streams: u64,
    /// Streams still live.
    pub live_streams: u64,
    /// Communicators still live (not destroyed nor aborted).
    pub live_comms: u64,
    /// `ncclCommDestroy` on a communicator never finalized.
    pub destroy_unfinalized: u64,
    /// `ncclCommFinalize` (or implicit) calls.
    pub finalizes: u64,
    /// `ncclCommAbort` calls.
    pub aborts: u64,
    /// NCCL calls rejected for a buffer on the wrong device.
    pub bad_pointer: u64,
    /// NCCL calls on a communicator still in progress.
    pub in_progress_misuse: u64,
    /// `trafficClass` of the last config read.
    pub last_traffic_class: i64,
    /// PreMulSum reduction ops created and not destroyed.
    pub live_redops: u64,
    /// Events created and not destroyed.
    pub live_events: u64,
    /// `cudaFree` of an allocation that queued NCCL work still uses.
    pub freed_in_use: u64,
    /// Allocations queued NCCL work still uses.
    pub in_use_allocs: u64,
    /// Windows registered and not yet deregistered (nor released by an
    /// abort or destroy of their communicator).
    pub live_windows: u64,
    /// Collectives whose ranks disagreed (kind, count, dtype, op or root);
    /// each rank of one counts once, and hangs until aborted.
    pub mismatched_collectives: u64,
}

#[no_mangle]
pub unsafe extern "C" fn fake_xccl_counters(out: *mut FakeCounters) {
    if out.is_null() {
        return;
    }
    let c = &COUNTERS;
    let created = c.streams_created.load(SeqCst);
    *out = FakeCounters {
        mallocs: c.mallocs.load(SeqCst),
        frees: c.frees.load(SeqCst),
        live_allocs: lock(&ALLOCS).len() as u64,
        streams_created: created,
        blocking_streams: c.blocking_streams.load(SeqCst),
        live_streams: created - c.streams_destroyed.load(SeqCst),
        live_comms: c.comms_created.load(SeqCst) - c.comms_freed.load(SeqCst),
        destroy_unfinalized: c.destroy_unfinalized.load(SeqCst),
        finalizes: c.finalizes.load(SeqCst),
        aborts: c.aborts.load(SeqCst),
        bad_pointer: c.bad_pointer.load(SeqCst),
        in_progress_misuse: c.in_progress_misuse.load(SeqCst),
        last_traffic_class: i64::from(LAST_TRAFFIC_CLASS.load(SeqCst)),
        live_redops: c.redops_created.load(SeqCst) - c.redops_destroyed.load(SeqCst),
        live_events: c.events_created.load(SeqCst) - c.events_destroyed.load(SeqCst),
        freed_in_use: c.freed_in_use.load(SeqCst),
        in_use_allocs: lock(&IN_USE).len() as u64,
        live_windows: c.windows_registered.load(SeqCst) - c.windows_released.load(SeqCst),
        mismatched_collectives: c.mismatched_collectives.load(SeqCst),
    };
}

/// The calling thread's NCCL group depth (0 outside any group).
#[no_mangle]
pub extern "C" fn fake_xccl_group_depth() -> c_int {
    GROUP.with(|g| g.borrow().0 as c_int)
}

/// Inject `code` as the asynchronous error of every live communicator on
/// `device` (what NCCL reports when it finds a fault between ops).
#[no_mangle]
pub extern "C" fn fake_xccl_inject_async_error(device: c_int, code: c_int) -> c_int {
    let comms: Vec<Arc<Comm>> = lock(&COMMS).values().cloned().collect();
    let mut n = 0;
    for c in comms.iter().filter(|c| c.device == device) {
        c.fail(code, format!("injected error {code} on device {device}"));
        n += 1;
    }
    n
}

/// Make the NCCL op call after the next `skip` ones on `device` fail with
/// `code` (returned by the call itself, as a bad argument would be).
#[no_mangle]
pub extern "C" fn fake_xccl_fail_call(device: c_int, skip: c_uint, code: c_int) {
    *lock(&FAIL) = Some((device, skip, code));
}

/// Make the ranks on `device` stop (`hang != 0`) or resume making progress.
#[no_mangle]
pub extern "C" fn fake_xccl_hang(device: c_int, hang: c_int) {
    let mut h = lock(&HUNG);
    if hang != 0 {
        h.insert(device);
    } else {
        h.remove(&device);
    }
}

static GATES: LazyLock<(Mutex<HashSet<usize>>, Condvar)> =
    LazyLock::new(|| (Mutex::new(HashSet::new()), Condvar::new()));

/// Close (`close != 0`: work queued on `stream` from now on waits) or
/// open the gate of `stream`, so a test controls when a stream makes
/// progress. Returns 0, or 400 for an unknown stream.
#[no_mangle]
pub extern "C" fn fake_xccl_stream_gate(stream: *mut c_void, close: c_int) -> c_int {
    let Some(s) = stream_of(stream) else {
        return 400;
    };
    let id = stream as usize;
    let (m, cv) = &*GATES;
    if close != 0 {
        lock(m).insert(id);
        s.push(Box::new(move || {
            let (m, cv) = &*GATES;
            let mut g = lock(m);
            while g.contains(&id) {
                g = cv.wait(g).unwrap_or_else(|p| p.into_inner());
            }
        }));
    } else {
        lock(m).remove(&id);
        cv.notify_all();
    }
    SUCCESS
}

/// Forget the cliques of finished tests (their communicators are gone).
#[no_mangle]
pub extern "C" fn fake_xccl_reset() {
    VERSION.store(-1, SeqCst);
    lock(&HUNG).clear();
    *lock(&FAIL) = None;
    let live: HashSet<usize> = lock(&COMMS)
        .values()
        .map(|c| Arc::as_ptr(&c.clique) as usize)
        .collect();
    lock(&CLIQUES).retain(|_, c| live.contains(&(Arc::as_ptr(c) as usize)));
    let _ = (NCCL_SYSTEM_ERROR, NCCL_INTERNAL_ERROR);
}

/// Make `ncclGetVersion` report `version` (until `fake_xccl_reset`).
#[no_mangle]
pub extern "C" fn fake_xccl_set_version(version: c_int) {
    VERSION.store(version, SeqCst);
}

// ------------------------------------------------------ one-sided windows

#[no_mangle]
pub unsafe extern "C" fn ncclMemAlloc(p: *mut *mut c_void, size: usize) -> NcclResult {
    if p.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    let size = size.max(1).next_multiple_of(WIN_ALIGN);
    let layout = std::alloc::Layout::from_size_align(size, WIN_ALIGN).expect("layout");
    let mem = std::alloc::alloc_zeroed(layout);
    if mem.is_null() {
        return NCCL_SYSTEM_ERROR;
    }
    lock(&ALLOCS).insert(mem as usize, (DEVICE.with(Cell::get), size));
    lock(&NCCL_MEM).insert(mem as usize);
    COUNTERS.mallocs.fetch_add(1, SeqCst);
    *p = mem.cast();
    SUCCESS
}

#[no_mangle]
pub unsafe extern "C" fn ncclMemFree(p: *mut c_void) -> NcclResult {
    if p.is_null() {
        return SUCCESS;
    }
    if !lock(&NCCL_MEM).remove(&(p as usize)) {
        set_last_error(format!(
            "ncclMemFree of {p:p}, which ncclMemAlloc did not allocate"
        ));
        return NCCL_INVALID_ARGUMENT;
    }
    if lock(&IN_USE).contains_key(&(p as usize)) {
        COUNTERS.freed_in_use.fetch_add(1, SeqCst);
    }
    let Some((_, size)) = lock(&ALLOCS).remove(&(p as usize)) else {
        return NCCL_INVALID_ARGUMENT;
    };
    let registered = lock(&WINS).values().any(|w| {
        lock(&w.comm.clique.m)
            .wins
            .get(&w.seq)
            .and_then(|b| b[w.comm.rank])
            .is_some_and(|(b, _)| b == p as usize)
    });
    if registered {
        // NCCL would keep using the memory: a bug in the caller.
        COUNTERS.freed_in_use.fetch_add(1, SeqCst);
    }
    std::alloc::dealloc(
        p.cast(),
        std::alloc::Layout::from_size_align(size, WIN_ALIGN).expect("layout"),
    );
    COUNTERS.frees.fetch_add(1, SeqCst);
    SUCCESS
}

/// Forget every window of `comm` (its abort or destroy released them).
fn drop_windows_of(comm: &Arc<Comm>) {
    let mine: Vec<u64> = {
        let mut w = lock(&WINS);
        let keys: Vec<usize> = w
            .iter()
            .filter(|(_, w)| Arc::ptr_eq(&w.comm, comm))
            .map(|(k, _)| *k)
            .collect();
        keys.iter()
            .filter_map(|k| w.remove(k))
            .map(|w| w.seq)
            .collect()
    };
    if mine.is_empty() {
        return;
    }
    let cl = &comm.clique;
    let mut st = lock(&cl.m);
    for seq in mine {
        if let Some(b) = st.wins.get_mut(&seq) {
            b[comm.rank] = None;
        }
        COUNTERS.windows_released.fetch_add(1, SeqCst);
    }
    drop(st);
    cl.cv.notify_all();
}

#[no_mangle]
pub unsafe extern "C" fn ncclCommWindowRegister(
    c: *mut c_void,
    buff: *mut c_void,
    size: usize,
    win: *mut *mut c_void,
    flags: c_int,
) -> NcclResult {
    let comm = match usable(c, "ncclCommWindowRegister") {
        Ok(comm) => comm,
        Err(e) => return e,
    };
    if win.is_null() || flags & !0x07 != 0 {
        set_last_error(format!(
            "ncclCommWindowRegister: bad arguments (flags {flags:#x})"
        ));
        return NCCL_INVALID_ARGUMENT;
    }
    let p = buff as usize;
    if p % WIN_ALIGN != 0 || !lock(&NCCL_MEM).contains(&p) {
        set_last_error(format!(
            "ncclCommWindowRegister: {buff:p} is not an ncclMemAlloc buffer aligned to {WIN_ALIGN}"
        ));
        return NCCL_INVALID_ARGUMENT;
    }
    match device_of(p, size) {
        Some(d) if d == comm.device => {}
        other => {
            COUNTERS.bad_pointer.fetch_add(1, SeqCst);
            set_last_error(format!(
                "ncclCommWindowRegister: {size} bytes at {p:#x} are on device {other:?}, the \
                 communicator on device {}",
                comm.device
            ));
            return NCCL_INVALID_ARGUMENT;
        }
    }
    let cl = comm.clique.clone();
    let seq = {
        let mut st = lock(&cl.m);
        let next = st.win_next.entry(comm.rank).or_insert(0);
        let seq = *next;
        *next += 1;
        st.wins.entry(seq).or_insert_with(|| vec![None; cl.nranks])[comm.rank] = Some((p, size));
        seq
    };
    cl.cv.notify_all();
    let handle = NEXT_WIN.fetch_add(1, SeqCst) as usize;
    lock(&WINS).insert(
        handle,
        Win {
            comm: comm.clone(),
            seq,
        },
    );
    COUNTERS.windows_registered.fetch_add(1, SeqCst);
    *win = handle as *mut c_void;
    // Collective: done once every rank registered this window.
    let join = {
        let comm = comm.clone();
        move || {
            let cl = &comm.clique;
            let mut st = lock(&cl.m);
            loop {
                if comm.aborted.load(SeqCst) {
                    return;
                }
                let all = st
                    .wins
                    .get(&seq)
                    .is_some_and(|b| b.iter().all(Option::is_some));
                if all {
                    break;
                }
                if let Some(d) = (0..cl.nranks).find(|r| st.dead.contains(r)) {
                    drop(st);
                    comm.fail(
                        NCCL_REMOTE_ERROR,
                        format!("rank {d} aborted before it registered window {seq}"),
                    );
                    return;
                }
                st = cl
                    .cv
                    .wait_timeout(st, RECHECK)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
            drop(st);
            let _ = comm
                .state
                .compare_exchange(NCCL_IN_PROGRESS, SUCCESS, SeqCst, SeqCst);
        }
    };
    if comm.blocking {
        join();
        comm.state.load(SeqCst)
    } else {
        comm.state.store(NCCL_IN_PROGRESS, SeqCst);
        std::thread::spawn(join);
        NCCL_IN_PROGRESS
    }
}

/// The registered window `w` of communicator `comm`.
fn win_of(call: &str, comm: &Arc<Comm>, w: *mut c_void) -> Result<u64, NcclResult> {
    match lock(&WINS).get(&(w as usize)) {
        Some(win) if Arc::ptr_eq(&win.comm, comm) => Ok(win.seq),
        Some(_) => {
            set_last_error(format!(
                "{call}: window {w:p} belongs to another communicator"
            ));
            Err(NCCL_INVALID_ARGUMENT)
        }
        None => {
            set_last_error(format!("{call}: unknown or deregistered window {w:p}"));
            Err(NCCL_INVALID_ARGUMENT)
        }
    }
}

#[no_mangle]
pub extern "C" fn ncclCommWindowDeregister(c: *mut c_void, w: *mut c_void) -> NcclResult {
    let comm = match usable(c, "ncclCommWindowDeregister") {
        Ok(comm) => comm,
        Err(e) => return e,
    };
    let seq = match win_of("ncclCommWindowDeregister", &comm, w) {
        Ok(s) => s,
        Err(e) => return e,
    };
    lock(&WINS).remove(&(w as usize));
    let cl = &comm.clique;
    if let Some(b) = lock(&cl.m).wins.get_mut(&seq) {
        b[comm.rank] = None;
    }
    cl.cv.notify_all();
    COUNTERS.windows_released.fetch_add(1, SeqCst);
    SUCCESS
}

/// Whether queued work of `comm` still runs: not aborted, no error.
fn live(comm: &Comm) -> bool {
    let s = comm.state.load(SeqCst);
    !comm.aborted.load(SeqCst) && (s == SUCCESS || s == NCCL_IN_PROGRESS)
}

/// Check the common arguments of a one-sided call and return the stream.
fn one_sided_stream(
    call: &str,
    comm: &Comm,
    stream: *mut c_void,
) -> Result<Arc<Stream>, NcclResult> {
    let Some(s) = stream_of(stream) else {
        set_last_error(format!("{call}: invalid stream {stream:p}"));
        return Err(NCCL_INVALID_ARGUMENT);
    };
    if s.device != comm.device {
        set_last_error(format!(
            "{call}: stream of device {} used with the communicator of device {}",
            s.device, comm.device
        ));
        return Err(NCCL_INVALID_ARGUMENT);
    }
    Ok(s)
}

#[no_mangle]
pub unsafe extern "C" fn ncclPutSignal(
    localbuff: *const c_void,
    count: usize,
    dtype: c_int,
    peer: c_int,
    peer_win: *mut c_void,
    offset: usize,
    sig_idx: c_int,
    ctx: c_int,
    flags: c_uint,
    c: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    let call = "ncclPutSignal";
    let comm = match usable(c, call) {
        Ok(comm) => comm,
        Err(e) => return e,
    };
    let seq = match win_of(call, &comm, peer_win) {
        Ok(s) => s,
        Err(e) => return e,
    };
    let Some(es) = esize(dtype) else {
        set_last_error(format!("{call}: invalid datatype {dtype}"));
        return NCCL_INVALID_ARGUMENT;
    };
    if peer < 0 || peer as usize >= comm.nranks || flags != 0 || sig_idx < 0 || ctx < 0 {
        set_last_error(format!(
            "{call}: bad peer {peer}, flags {flags}, signal {sig_idx} or context {ctx}"
        ));
        return NCCL_INVALID_ARGUMENT;
    }
    let peer = peer as usize;
    let bytes = count * es;
    let src = localbuff as usize;
    if bytes > 0 {
        match device_of(src, bytes) {
            Some(d) if d == comm.device => {}
            other => {
                COUNTERS.bad_pointer.fetch_add(1, SeqCst);
                set_last_error(format!(
                    "{call}: pointer {src:#x} ({bytes} bytes) is on device {other:?}, the \
                     communicator on device {}",
                    comm.device
                ));
                return NCCL_INVALID_ARGUMENT;
            }
        }
    }
    // The target's registered buffer bounds the put.
    let target = lock(&comm.clique.m).wins.get(&seq).and_then(|b| b[peer]);
    match target {
        Some((_, size)) if offset.checked_add(bytes).is_some_and(|e| e <= size) => {}
        Some((_, size)) => {
            set_last_error(format!(
                "{call}: {bytes} bytes at offset {offset} overflow rank {peer}'s window of {size}"
            ));
            return NCCL_INVALID_ARGUMENT;
        }
        None => {
            set_last_error(format!(
                "{call}: rank {peer} has no registered window {seq}"
            ));
            return NCCL_INVALID_USAGE;
        }
    }
    let stream = match one_sided_stream(call, &comm, stream) {
        Ok(s) => s,
        Err(e) => return e,
    };
    let used: Vec<usize> = alloc_start(src).into_iter().collect();
    {
        let mut u = lock(&IN_USE);
        for &a in &used {
            *u.entry(a).or_insert(0) += 1;
        }
    }
    let me = comm.rank;
    let task = comm.clone();
    stream.push(Box::new(move || {
        let comm = task;
        let _release = InUse(used);
        comm.wait_while_hung();
        if !live(&comm) {
            return;
        }
        let data = read(src, bytes);
        let cl = &comm.clique;
        let mut st = lock(&cl.m);
        if st.dead.contains(&peer) {
            drop(st);
            comm.fail(
                NCCL_REMOTE_ERROR,
                format!("rank {peer} aborted before a put"),
            );
            return;
        }
        match st.wins.get(&seq).and_then(|b| b[peer]) {
            // Written under the clique lock, so the target cannot free its
            // registered buffer meanwhile.
            Some((base, _)) => write(base + offset, &data),
            None => {
                drop(st);
                comm.fail(
                    NCCL_INVALID_USAGE,
                    format!("rank {peer} deregistered window {seq} before a put reached it"),
                );
                return;
            }
        }
        *st.signals.entry((me, peer, sig_idx, ctx)).or_insert(0) += 1;
        drop(st);
        cl.cv.notify_all();
    }));
    if !comm.blocking {
        comm.in_progress_then_settle();
        return NCCL_IN_PROGRESS;
    }
    SUCCESS
}

/// `ncclWaitSignalDesc_t`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct WaitSignalDesc {
    op_cnt: c_int,
    peer: c_int,
    sig_idx: c_int,
    ctx: c_int,
}

#[no_mangle]
pub unsafe extern "C" fn ncclWaitSignal(
    n: c_int,
    descs: *mut WaitSignalDesc,
    c: *mut c_void,
    stream: *mut c_void,
) -> NcclResult {
    let call = "ncclWaitSignal";
    let comm = match usable(c, call) {
        Ok(comm) => comm,
        Err(e) => return e,
    };
    if n < 1 || descs.is_null() {
        set_last_error(format!("{call}: {n} descriptors"));
        return NCCL_INVALID_ARGUMENT;
    }
    let descs = std::slice::from_raw_parts(descs, n as usize).to_vec();
    if descs.iter().any(|d| {
        d.op_cnt < 0 || d.peer < 0 || d.peer as usize >= comm.nranks || d.sig_idx < 0 || d.ctx < 0
    }) {
        set_last_error(format!("{call}: a descriptor is out of range"));
        return NCCL_INVALID_ARGUMENT;
    }
    let stream = match one_sided_stream(call, &comm, stream) {
        Ok(s) => s,
        Err(e) => return e,
    };
    let me = comm.rank;
    let task = comm.clone();
    stream.push(Box::new(move || {
        let comm = task;
        comm.wait_while_hung();
        let cl = &comm.clique;
        let mut st = lock(&cl.m);
        for d in descs {
            let key = (d.peer as usize, me, d.sig_idx, d.ctx);
            loop {
                if !live(&comm) {
                    return;
                }
                let arrived = st.signals.get(&key).copied().unwrap_or(0);
                let used = st.consumed.get(&key).copied().unwrap_or(0);
                if arrived >= used + d.op_cnt as u64 {
                    st.consumed.insert(key, used + d.op_cnt as u64);
                    break;
                }
                if st.dead.contains(&key.0) {
                    drop(st);
                    comm.fail(
                        NCCL_REMOTE_ERROR,
                        format!(
                            "rank {} aborted while rank {me} waited for its signal",
                            key.0
                        ),
                    );
                    return;
                }
                st = cl
                    .cv
                    .wait_timeout(st, RECHECK)
                    .unwrap_or_else(|p| p.into_inner())
                    .0;
            }
        }
    }));
    if !comm.blocking {
        comm.in_progress_then_settle();
        return NCCL_IN_PROGRESS;
    }
    SUCCESS
}
