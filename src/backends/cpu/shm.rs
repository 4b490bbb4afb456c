//! Shared-memory rings: the data links between ranks on the same host.
//!
//! One [`ShmSegment`] per directed pair of ranks holds a single-producer,
//! single-consumer byte ring. The receiver creates the segment (a `0600`
//! file under `/dev/shm` named by [`ring_file_name`]: a random tag and the
//! creator's pid; unlinked as soon as both ends mapped it, and on every
//! error path), the sender maps it; see `link::setup::shm_pair` for the exchange,
//! which runs over the authenticated TCP link (so only a peer that proved
//! the job secret learns the name). A process killed between creating and
//! unlinking (SIGKILL, or a signal with no handler) leaves its file behind;
//! [`sweep_stale`] removes such files once their creator is gone.
//!
//! Layout (every counter on its own 64-byte line, to avoid false sharing):
//!
//! | offset | field |
//! |--------|-------|
//! | 0      | `head: u64` — bytes ever produced (written by the producer) |
//! | 64     | `tail: u64` — bytes ever consumed (written by the consumer) |
//! | 128    | `data_seq: u32`, `cons_waiting: u32` — consumer futex word and flag |
//! | 192    | `space_seq: u32`, `prod_waiting: u32` — producer futex word and flag |
//! | 256    | `magic: u64`, `capacity: u64` |
//! | 512    | `capacity` data bytes (a power of two, multiple of 8) |
//!
//! # Invariants
//! - SH-1: `tail <= head <= tail + capacity` at all times; the producer only
//!   writes bytes `[head, tail + capacity)` and the consumer only reads bytes
//!   `[tail, head)` (positions modulo `capacity`). `head` is published with
//!   Release after the bytes are written, `tail` with Release after they were
//!   read; each side loads the other's counter with Acquire.
//! - SH-2: no syscall on the fast path: a side calls `futex` wake only when
//!   the other side announced (flag + `SeqCst` fence) that it is about to
//!   sleep, and a sleeping side re-checks the ring after announcing, so a
//!   wake-up is never lost; every sleep also has a timeout.
//! - SH-3: a peer that writes garbage into the counters cannot make this
//!   side read or write outside the mapping: available byte counts are
//!   clamped to `[0, capacity]`, and positions are taken modulo `capacity`.
//! - SH-4: each side publishes its counter at least every [`PUBLISH`]
//!   bytes, so producer and consumer copy concurrently (pipelining) instead
//!   of taking turns over the whole ring.
//! - SH-5: single copy (CMA). The producer advertises its pid and the
//!   address of a known word in the ring header; the consumer probes it with
//!   `process_vm_readv` and, only if that reads back the right value, sets
//!   `cma_ok`. Only then may the producer send a large payload as its
//!   address instead of its bytes; the consumer reads it straight out of the
//!   producer's memory and counts it in `cma_done`, and the producer keeps
//!   the buffer untouched until `cma_done` reaches its ticket. A consumer
//!   that cannot read the producer (Yama `ptrace_scope` >= 1, other pid
//!   namespaces, `CHORUS_SHM_CMA=0`) never sets `cma_ok`, and everything
//!   goes through the ring as before. A producer that abandons a transfer
//!   before its ack (cancelled op) sets `cma_revoked` before its buffer can
//!   be freed; a consumer checks it after every read and fails rather than
//!   keep bytes that may have changed under it.
//! - SH-7: a ring's pages are allocated when its file is created
//!   (`posix_fallocate`) and mapped into both sides' page tables when they
//!   map it (`MAP_POPULATE`), so no op takes a page fault in a ring. Before,
//!   the first pass through a ring faulted a page every 4 KiB of data on
//!   each side: 2 KiB all_reduces on 4 ranks ran at 52–64 µs for their
//!   first few hundred ops and 19–25 µs after. A full `/dev/shm` fails the
//!   ring's creation (the pair then uses TCP, with a warning) rather than
//!   raising SIGBUS at a write past the space left.

use std::fs::File;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

const OFF_HEAD: usize = 0;
const OFF_TAIL: usize = 64;
const OFF_DATA_SEQ: usize = 128;
const OFF_CONS_WAITING: usize = 132;
const OFF_SPACE_SEQ: usize = 192;
const OFF_PROD_WAITING: usize = 196;
const OFF_MAGIC: usize = 256;
const OFF_CAPACITY: usize = 264;
/// CMA ([SH-5]): the producer's pid, and the address of [`CMA_PROBE`] in its
/// address space, for the consumer's probe.
///
/// [SH-5]: self#invariants
const OFF_CMA_PID: usize = 272;
const OFF_CMA_ADDR: usize = 280;
/// Set to 1 by the consumer once it can read the producer's memory.
const OFF_CMA_OK: usize = 288;
/// Single-copy transfers the consumer has finished reading ([SH-5]).
///
/// [SH-5]: self#invariants
const OFF_CMA_DONE: usize = 320;
/// Set by a producer that gave up on a transfer the consumer may still be
/// reading (its op was cancelled): the buffer may be gone ([SH-5]).
///
/// [SH-5]: self#invariants
const OFF_CMA_REVOKED: usize = 328;
const OFF_DATA: usize = 512;
const MAGIC: u64 = u64::from_le_bytes(*b"CHSHMRG1");

/// Default data capacity of one ring.
pub(crate) const RING_CAPACITY: usize = 1 << 20;

/// [SH-4]: the most bytes one `write_some` or `consume_with` moves before
/// publishing its counter. Publishing per whole free region made the two
/// sides take turns (the producer filled the ring while the consumer
/// waited, then the reverse); publishing every 64 KiB lets them copy at the
/// same time. Measured, 2 ranks, idle 2-core box, broadcast busbw: 1 MiB
/// 8.5 -> 19 GB/s, 8 MiB 4.4 -> 6.6, 64 MiB 6.5 -> 7.8 (16 KiB and 256 KiB
/// were within noise of 64 KiB; all_reduce/all_gather, bound by copies,
/// unchanged).
///
/// [SH-4]: self#invariants
const PUBLISH: usize = 64 << 10;

/// A shared mapping holding one ring.
#[derive(Debug)]
pub(crate) struct ShmSegment {
    ptr: *mut u8,
    len: usize,
    capacity: usize,
    /// The file behind the mapping, if any (unlinked by `unlink`).
    path: Option<PathBuf>,
}

// SAFETY: the mapping is plain shared memory; every access to it from this
// type goes through atomics (counters) or through the SPSC protocol (SH-1),
// which gives each byte range a single writer at a time.
unsafe impl Send for ShmSegment {}
// SAFETY: as above; `&ShmSegment` only exposes atomic counters and the
// protocol-guarded copies of `RingProducer`/`RingConsumer`.
unsafe impl Sync for ShmSegment {}

fn os_err(what: &str) -> std::io::Error {
    let e = std::io::Error::last_os_error();
    std::io::Error::new(e.kind(), format!("{what}: {e}"))
}

impl ShmSegment {
    fn map(fd: Option<i32>, len: usize) -> std::io::Result<*mut u8> {
        let (flags, fd) = match fd {
            // SH-7: the pages of a ring file are in the page tables from
            // the start.
            Some(fd) => (libc::MAP_SHARED | libc::MAP_POPULATE, fd),
            None => (libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1),
        };
        // SAFETY: a fresh mapping chosen by the kernel (null hint); the
        // arguments are valid and the result is checked.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                flags,
                fd,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(os_err("mmap"));
        }
        Ok(p.cast())
    }

    fn init(ptr: *mut u8, len: usize, capacity: usize, path: Option<PathBuf>) -> ShmSegment {
        let s = ShmSegment {
            ptr,
            len,
            capacity,
            path,
        };
        s.u64_at(OFF_MAGIC).store(MAGIC, Ordering::Relaxed);
        s.u64_at(OFF_CAPACITY)
            .store(capacity as u64, Ordering::Release);
        s
    }

    /// An anonymous shared ring (for rings inside one process: tests).
    #[cfg(test)]
    pub(crate) fn anonymous(capacity: usize) -> std::io::Result<ShmSegment> {
        let capacity = check_capacity(capacity)?;
        let len = OFF_DATA + capacity;
        let ptr = Self::map(None, len)?;
        Ok(Self::init(ptr, len, capacity, None))
    }

    /// Create a new ring in a fresh `0600` file at `path` (which must not exist).
    pub(crate) fn create(path: &Path, capacity: usize) -> std::io::Result<ShmSegment> {
        use std::os::unix::fs::OpenOptionsExt;
        let capacity = check_capacity(capacity)?;
        let len = OFF_DATA + capacity;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        file.set_len(len as u64)?;
        // SH-7: every page of the ring exists before the first op. A full
        // /dev/shm fails here, with an error (the pair then uses TCP),
        // instead of a SIGBUS at the first write past the space left.
        // SAFETY: a plain call on the file's open descriptor.
        let rc = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, len as libc::off_t) };
        if rc != 0 {
            let _ = std::fs::remove_file(path);
            let e = std::io::Error::from_raw_os_error(rc);
            return Err(std::io::Error::new(
                e.kind(),
                format!("allocating {len} bytes of shared memory for a ring: {e}"),
            ));
        }
        let ptr = Self::map(Some(file.as_raw_fd()), len).inspect_err(|_| {
            let _ = std::fs::remove_file(path);
        })?;
        Ok(Self::init(ptr, len, capacity, Some(path.to_path_buf())))
    }

    /// Map an existing ring created by a peer.
    pub(crate) fn open(path: &Path) -> std::io::Result<ShmSegment> {
        let file: File = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        let len = usize::try_from(file.metadata()?.len()).unwrap_or(0);
        if len <= OFF_DATA {
            return Err(std::io::Error::other("shm ring file too small"));
        }
        let ptr = Self::map(Some(file.as_raw_fd()), len)?;
        let mut s = ShmSegment {
            ptr,
            len,
            capacity: 0,
            path: None,
        };
        let magic = s.u64_at(OFF_MAGIC).load(Ordering::Acquire);
        let cap = s.u64_at(OFF_CAPACITY).load(Ordering::Acquire) as usize;
        if magic != MAGIC || cap != len - OFF_DATA || check_capacity(cap).is_err() {
            return Err(std::io::Error::other("not a chorus shm ring"));
        }
        s.capacity = cap;
        Ok(s)
    }

    /// Remove the backing file (the mapping stays valid). Idempotent.
    pub(crate) fn unlink(&mut self) {
        if let Some(p) = self.path.take() {
            let _ = std::fs::remove_file(p);
        }
    }

    fn u64_at(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off + 8 <= OFF_DATA && off % 8 == 0);
        // SAFETY: `off` is one of the 8-aligned header offsets, inside the
        // mapping (len > OFF_DATA), and the mapping is page aligned; the
        // memory is only ever accessed atomically at these offsets.
        unsafe { &*self.ptr.add(off).cast::<AtomicU64>() }
    }

    fn u32_at(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off + 4 <= OFF_DATA && off % 4 == 0);
        // SAFETY: as `u64_at`, for 4-aligned u32 header fields.
        unsafe { &*self.ptr.add(off).cast::<AtomicU32>() }
    }

    fn data(&self) -> *mut u8 {
        // SAFETY: OFF_DATA < len, so the result is inside the mapping.
        unsafe { self.ptr.add(OFF_DATA) }
    }
}

impl Drop for ShmSegment {
    fn drop(&mut self) {
        self.unlink();
        // SAFETY: `ptr`/`len` are exactly what mmap returned; no reference
        // into the mapping outlives `self` (borrows of ring data are tied to
        // `&self` of the producer/consumer holding this segment).
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// Every ring file name starts with this.
pub(crate) const FILE_PREFIX: &str = "chorus-";

/// The name of the ring file `me` creates for data from `peer`:
/// `chorus-<16 hex tag>-<creator pid>-<peer>-<me>`.
pub(crate) fn ring_file_name(tag: &str, pid: u32, peer: usize, me: usize) -> String {
    format!("{FILE_PREFIX}{tag}-{pid}-{peer}-{me}")
}

/// The creator pid of a ring file named by [`ring_file_name`] (with a
/// 16-hex-digit tag), or `None` for any other name.
fn creator_pid(name: &str) -> Option<i32> {
    let rest = name.strip_prefix(FILE_PREFIX)?;
    let mut parts = rest.split('-');
    let (tag, pid, peer, me) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let digits = |s: &str| !s.is_empty() && s.bytes().all(|b| b.is_ascii_digit());
    let ok = parts.next().is_none()
        && tag.len() == 16
        && tag.bytes().all(|b| b.is_ascii_hexdigit())
        && digits(pid)
        && digits(peer)
        && digits(me);
    ok.then(|| pid.parse::<i32>().ok())
        .flatten()
        .filter(|&p| p > 0)
}

/// Whether no process with `pid` exists (`kill(pid, 0)` fails with ESRCH).
/// A process we may not signal (EPERM) counts as alive.
fn pid_gone(pid: i32) -> bool {
    // SAFETY: signal 0 only checks for existence and permission; nothing is
    // delivered.
    let r = unsafe { libc::kill(pid, 0) };
    r == -1 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ESRCH)
}

/// Remove the ring files in `dir` left by processes that died before they
/// could unlink them: regular files named exactly as [`ring_file_name`]
/// makes them, owned by this user, whose creator pid no longer exists.
/// Anything else (other names, other owners, live creators) is left alone.
/// Returns how many files were removed. Errors reading `dir` mean nothing
/// is swept (the sweep is best effort; a ring never depends on it).
pub(crate) fn sweep_stale(dir: &Path) -> usize {
    use std::os::unix::fs::MetadataExt;
    let Ok(entries) = std::fs::read_dir(dir) else {
        return 0;
    };
    // SAFETY: geteuid has no preconditions and cannot fail.
    let uid = unsafe { libc::geteuid() };
    let mut removed = 0;
    for e in entries.flatten() {
        let name = e.file_name();
        let Some(pid) = name.to_str().and_then(creator_pid) else {
            continue;
        };
        let Ok(meta) = std::fs::symlink_metadata(e.path()) else {
            continue;
        };
        if !meta.file_type().is_file() || meta.uid() != uid || !pid_gone(pid) {
            continue;
        }
        match std::fs::remove_file(e.path()) {
            Ok(()) => {
                tracing::debug!(file = ?e.path(), pid, "removed a stale shm ring file");
                removed += 1;
            }
            Err(err) => {
                tracing::debug!(file = ?e.path(), error = %err, "cannot remove a stale shm ring file")
            }
        }
    }
    removed
}

fn check_capacity(c: usize) -> std::io::Result<usize> {
    if c.is_power_of_two() && (64..=(1 << 30)).contains(&c) {
        Ok(c)
    } else {
        Err(std::io::Error::other(format!(
            "shm ring capacity {c} is not a power of two in [64, 1 GiB]"
        )))
    }
}

fn futex_wait(word: &AtomicU32, expected: u32, timeout: Duration) {
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `word` is a valid, aligned u32 in shared memory that outlives
    // the call; FUTEX_WAIT only reads it. Spurious returns are fine.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAIT,
            expected,
            &ts as *const libc::timespec,
            std::ptr::null::<u32>(),
            0,
        );
    }
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a valid, aligned u32; FUTEX_WAKE does not access
    // memory beyond looking up waiters on that address.
    unsafe {
        libc::syscall(
            libc::SYS_futex,
            word.as_ptr(),
            libc::FUTEX_WAKE,
            i32::MAX,
            std::ptr::null::<libc::timespec>(),
            std::ptr::null::<u32>(),
            0,
        );
    }
}

/// Announce a sleep on `seq` (flag + fence), re-check `ready`, then sleep
/// at most `timeout` ([SH-2]).
///
/// [SH-2]: self#invariants
pub(crate) fn sleep_unless(
    seq: &AtomicU32,
    flag: &AtomicU32,
    timeout: Duration,
    ready: impl Fn() -> bool,
) {
    flag.store(1, Ordering::Relaxed);
    fence(Ordering::SeqCst);
    let s = seq.load(Ordering::Acquire);
    if !ready() {
        futex_wait(seq, s, timeout);
    }
    flag.store(0, Ordering::Relaxed);
}

/// Wake the other side if it announced a sleep ([SH-2]).
///
/// [SH-2]: self#invariants
pub(crate) fn wake_if_waiting(seq: &AtomicU32, flag: &AtomicU32) {
    fence(Ordering::SeqCst);
    if flag.load(Ordering::Relaxed) != 0 {
        seq.fetch_add(1, Ordering::Release);
        futex_wake(seq);
    }
}

/// The word a consumer reads through `process_vm_readv` to check that it
/// may ([SH-5]).
///
/// [SH-5]: self#invariants
static CMA_PROBE: u64 = u64::from_le_bytes(*b"CHCMAOK1");

/// Copy `dst.len()` bytes at `addr` in process `pid` into `dst` with
/// `process_vm_readv` (cross-memory attach). Any failure, including a
/// short read the kernel will not finish, is an error.
pub(crate) fn cma_read(pid: i32, addr: u64, dst: &mut [u8]) -> std::io::Result<()> {
    let mut done = 0usize;
    while done < dst.len() {
        let rest = &mut dst[done..];
        let local = libc::iovec {
            iov_base: rest.as_mut_ptr().cast(),
            iov_len: rest.len(),
        };
        let remote = libc::iovec {
            iov_base: (addr as usize).wrapping_add(done) as *mut libc::c_void,
            iov_len: rest.len(),
        };
        // SAFETY: `local` describes `rest`, memory this process owns and
        // may write; the remote range is only read, by the kernel, which
        // checks it against the other process's mappings (EFAULT if bad).
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
        if n < 0 {
            return Err(os_err("process_vm_readv"));
        }
        if n == 0 {
            return Err(std::io::Error::other("process_vm_readv read nothing"));
        }
        done += n as usize;
    }
    Ok(())
}

/// The writing end of a ring.
#[derive(Debug, Clone)]
pub(crate) struct RingProducer {
    seg: Arc<ShmSegment>,
    /// Single-copy transfers sent so far ([SH-5]).
    ///
    /// [SH-5]: self#invariants
    tickets: Arc<AtomicU64>,
}

/// The reading end of a ring.
#[derive(Debug, Clone)]
pub(crate) struct RingConsumer {
    seg: Arc<ShmSegment>,
    /// The producer's pid once the CMA probe succeeded, else 0 ([SH-5]).
    ///
    /// [SH-5]: self#invariants
    cma_pid: Arc<std::sync::atomic::AtomicI32>,
}

/// Both ends of one ring over the same segment.
#[cfg(test)]
pub(crate) fn ring(seg: ShmSegment) -> (RingProducer, RingConsumer) {
    let seg = Arc::new(seg);
    (
        RingProducer::from_arc(seg.clone()),
        RingConsumer::from_arc(seg),
    )
}

impl RingProducer {
    /// The producing end of `seg`.
    pub(crate) fn new(seg: ShmSegment) -> RingProducer {
        RingProducer::from_arc(Arc::new(seg))
    }

    fn from_arc(seg: Arc<ShmSegment>) -> RingProducer {
        RingProducer {
            seg,
            tickets: Arc::new(AtomicU64::new(0)),
        }
    }

    /// [SH-5]: publish this process's pid and the address of [`CMA_PROBE`]
    /// for the consumer's probe.
    ///
    /// [SH-5]: self#invariants
    pub(crate) fn advertise_cma(&self) {
        let s = &self.seg;
        s.u32_at(OFF_CMA_PID)
            .store(std::process::id(), Ordering::Relaxed);
        s.u64_at(OFF_CMA_ADDR).store(
            std::ptr::addr_of!(CMA_PROBE) as usize as u64,
            Ordering::Release,
        );
    }

    /// Whether the consumer can read this process's memory ([SH-5]).
    ///
    /// [SH-5]: self#invariants
    pub(crate) fn cma_ok(&self) -> bool {
        self.seg.u32_at(OFF_CMA_OK).load(Ordering::Acquire) == 1
    }

    /// Take the ticket of a single-copy transfer whose descriptor was just
    /// written: the buffer is free again once [`RingProducer::cma_done`]
    /// reaches it.
    pub(crate) fn take_ticket(&self) -> u64 {
        self.tickets.fetch_add(1, Ordering::Relaxed) + 1
    }

    /// Whether the consumer finished reading transfer `ticket` ([SH-5]).
    ///
    /// [SH-5]: self#invariants
    pub(crate) fn cma_done(&self, ticket: u64) -> bool {
        self.seg.u64_at(OFF_CMA_DONE).load(Ordering::Acquire) >= ticket
    }

    /// Give up on every transfer not yet read: the consumer must not trust
    /// what it reads from now on ([SH-5]). Called before the buffers can go.
    ///
    /// [SH-5]: self#invariants
    pub(crate) fn revoke_cma(&self) {
        self.seg.u64_at(OFF_CMA_REVOKED).store(1, Ordering::SeqCst);
    }

    /// Sleep until transfer `ticket` was read or `timeout` passes.
    pub(crate) fn wait_cma(&self, ticket: u64, timeout: Duration) {
        let s = &self.seg;
        sleep_unless(
            s.u32_at(OFF_SPACE_SEQ),
            s.u32_at(OFF_PROD_WAITING),
            timeout,
            || self.cma_done(ticket),
        );
    }

    /// Bytes that can be written now ([SH-3]: clamped).
    ///
    /// [SH-3]: self#invariants
    pub(crate) fn writable(&self) -> usize {
        let s = &self.seg;
        let head = s.u64_at(OFF_HEAD).load(Ordering::Relaxed);
        let tail = s.u64_at(OFF_TAIL).load(Ordering::Acquire);
        let used = head.wrapping_sub(tail).min(s.capacity as u64) as usize;
        s.capacity - used
    }

    /// Whether the consumer has read every byte written so far.
    pub(crate) fn drained(&self) -> bool {
        self.writable() == self.seg.capacity
    }

    /// Copy as much of `src` as fits, publish it, and return the bytes written.
    pub(crate) fn write_some(&self, src: &[u8]) -> usize {
        let s = &self.seg;
        let n = self.writable().min(src.len()).min(PUBLISH);
        if n == 0 {
            return 0;
        }
        let head = s.u64_at(OFF_HEAD).load(Ordering::Relaxed);
        let pos = (head as usize) & (s.capacity - 1);
        let first = n.min(s.capacity - pos);
        // SAFETY: `pos + first <= capacity` and `n - first <= capacity`, so
        // both copies stay inside the data area; by SH-1 the consumer does
        // not read these bytes until `head` is published below; `src` is a
        // separate (private) buffer, so the ranges do not overlap.
        unsafe {
            std::ptr::copy_nonoverlapping(src.as_ptr(), s.data().add(pos), first);
            std::ptr::copy_nonoverlapping(src.as_ptr().add(first), s.data(), n - first);
        }
        s.u64_at(OFF_HEAD)
            .store(head.wrapping_add(n as u64), Ordering::Release);
        wake_if_waiting(s.u32_at(OFF_DATA_SEQ), s.u32_at(OFF_CONS_WAITING));
        n
    }

    /// Sleep until space frees up or `timeout` passes.
    pub(crate) fn wait_space(&self, timeout: Duration) {
        let s = &self.seg;
        sleep_unless(
            s.u32_at(OFF_SPACE_SEQ),
            s.u32_at(OFF_PROD_WAITING),
            timeout,
            || self.writable() > 0,
        );
    }
}

impl RingConsumer {
    /// The consuming end of `seg`.
    pub(crate) fn new(seg: ShmSegment) -> RingConsumer {
        RingConsumer::from_arc(Arc::new(seg))
    }

    fn from_arc(seg: Arc<ShmSegment>) -> RingConsumer {
        RingConsumer {
            seg,
            cma_pid: Arc::new(std::sync::atomic::AtomicI32::new(0)),
        }
    }

    /// [SH-5]: try to read the producer's advertised probe word; on success
    /// remember its pid and tell the producer (`cma_ok`). Returns whether
    /// single copy is on for this ring.
    ///
    /// [SH-5]: self#invariants
    pub(crate) fn probe_cma(&self) -> bool {
        let s = &self.seg;
        let addr = s.u64_at(OFF_CMA_ADDR).load(Ordering::Acquire);
        let pid = s.u32_at(OFF_CMA_PID).load(Ordering::Relaxed);
        let Ok(pid) = i32::try_from(pid) else {
            return false;
        };
        if pid <= 0 || addr == 0 {
            return false;
        }
        let mut word = [0u8; 8];
        match cma_read(pid, addr, &mut word) {
            Ok(()) if u64::from_le_bytes(word) == CMA_PROBE => {
                self.cma_pid.store(pid, Ordering::Relaxed);
                s.u32_at(OFF_CMA_OK).store(1, Ordering::Release);
                true
            }
            _ => false,
        }
    }

    /// The producer's pid if single copy is on for this ring ([SH-5]).
    ///
    /// [SH-5]: self#invariants
    pub(crate) fn cma_pid(&self) -> Option<i32> {
        Some(self.cma_pid.load(Ordering::Relaxed)).filter(|&p| p > 0)
    }

    /// Whether the producer abandoned its transfers ([SH-5]): checked after
    /// each read, so bytes read before the producer let its buffer go are
    /// the only ones ever kept.
    ///
    /// [SH-5]: self#invariants
    pub(crate) fn cma_revoked(&self) -> bool {
        fence(Ordering::SeqCst);
        self.seg.u64_at(OFF_CMA_REVOKED).load(Ordering::SeqCst) != 0
    }

    /// Count one single-copy transfer as read and wake the producer ([SH-5]).
    ///
    /// [SH-5]: self#invariants
    pub(crate) fn cma_ack(&self) {
        let s = &self.seg;
        s.u64_at(OFF_CMA_DONE).fetch_add(1, Ordering::Release);
        wake_if_waiting(s.u32_at(OFF_SPACE_SEQ), s.u32_at(OFF_PROD_WAITING));
    }

    /// Bytes readable now ([SH-3]: clamped).
    ///
    /// [SH-3]: self#invariants
    pub(crate) fn readable(&self) -> usize {
        let s = &self.seg;
        let head = s.u64_at(OFF_HEAD).load(Ordering::Acquire);
        let tail = s.u64_at(OFF_TAIL).load(Ordering::Relaxed);
        head.wrapping_sub(tail).min(s.capacity as u64) as usize
    }

    /// Call `f` on the longest contiguous readable run (at most `max` bytes);
    /// `f` returns how many bytes it used, which are then released to the
    /// producer. Returns that count.
    pub(crate) fn consume_with(&self, max: usize, f: impl FnOnce(&[u8]) -> usize) -> usize {
        let s = &self.seg;
        let avail = self.readable().min(max).min(PUBLISH);
        if avail == 0 {
            return 0;
        }
        let tail = s.u64_at(OFF_TAIL).load(Ordering::Relaxed);
        let pos = (tail as usize) & (s.capacity - 1);
        let n = avail.min(s.capacity - pos);
        // SAFETY: `pos + n <= capacity`: inside the data area. By SH-1 the
        // producer does not write `[tail, head)` until `tail` moves, which
        // happens only after `f` returned and the slice is gone.
        let run = unsafe { std::slice::from_raw_parts(s.data().add(pos), n) };
        let used = f(run).min(n);
        if used > 0 {
            s.u64_at(OFF_TAIL)
                .store(tail.wrapping_add(used as u64), Ordering::Release);
            wake_if_waiting(s.u32_at(OFF_SPACE_SEQ), s.u32_at(OFF_PROD_WAITING));
        }
        used
    }

    /// Sleep until data arrives or `timeout` passes.
    pub(crate) fn wait_data(&self, timeout: Duration) {
        let s = &self.seg;
        sleep_unless(
            s.u32_at(OFF_DATA_SEQ),
            s.u32_at(OFF_CONS_WAITING),
            timeout,
            || self.readable() > 0,
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sh_5_single_copy_is_on_only_after_a_successful_probe() {
        let (p, c) = ring(ShmSegment::anonymous(4096).unwrap());
        // Nothing advertised: the probe fails, the producer keeps the ring.
        assert!(!c.probe_cma());
        assert!(!p.cma_ok());
        assert_eq!(c.cma_pid(), None);
        p.advertise_cma();
        assert!(c.probe_cma(), "this process can read itself");
        assert!(p.cma_ok());
        assert_eq!(c.cma_pid(), Some(std::process::id() as i32));
        // Tickets complete in order as the consumer acks them.
        let (t1, t2) = (p.take_ticket(), p.take_ticket());
        assert!(!p.cma_done(t1));
        c.cma_ack();
        assert!(p.cma_done(t1) && !p.cma_done(t2));
        c.cma_ack();
        assert!(p.cma_done(t2));
        // A producer that abandons a transfer tells the consumer.
        assert!(!c.cma_revoked());
        p.revoke_cma();
        assert!(c.cma_revoked());
    }

    #[test]
    fn sh_5_cma_read_copies_and_reports_bad_addresses() {
        let src: Vec<u8> = (0..3 * 4096 + 17).map(|i| (i % 251) as u8).collect();
        let mut dst = vec![0u8; src.len()];
        let pid = std::process::id() as i32;
        cma_read(pid, src.as_ptr() as usize as u64, &mut dst).unwrap();
        assert_eq!(dst, src);
        // An address the "peer" does not map is an error, not a crash.
        let err = cma_read(pid, 8, &mut dst[..16]).unwrap_err();
        assert!(err.to_string().contains("process_vm_readv"), "{err}");
        // A probe word that is not ours is refused.
        let (p, c) = ring(ShmSegment::anonymous(4096).unwrap());
        p.advertise_cma();
        p.seg
            .u64_at(OFF_CMA_ADDR)
            .store(src.as_ptr() as usize as u64, Ordering::Release);
        assert!(!c.probe_cma());
    }

    #[test]
    fn sh_4_large_transfers_are_published_in_steps() {
        let (p, c) = ring(ShmSegment::anonymous(4 * PUBLISH).unwrap());
        let data = vec![7u8; 4 * PUBLISH];
        // One call publishes at most PUBLISH bytes, so the consumer can start.
        assert_eq!(p.write_some(&data), PUBLISH);
        assert_eq!(c.readable(), PUBLISH);
        assert_eq!(p.write_some(&data[PUBLISH..]), PUBLISH);
        assert_eq!(c.consume_with(usize::MAX, |b| b.len()), PUBLISH);
        assert_eq!(p.writable(), 3 * PUBLISH);
    }

    #[test]
    fn ring_round_trips_across_wraparound() {
        let (p, c) = ring(ShmSegment::anonymous(64).unwrap());
        let mut got = Vec::new();
        let data: Vec<u8> = (0..1000u32).map(|i| (i * 7 % 251) as u8).collect();
        let mut sent = 0;
        // Odd-sized writes and reads force every wrap position.
        while got.len() < data.len() {
            sent += p.write_some(&data[sent..(sent + 37).min(data.len())]);
            c.consume_with(23, |b| {
                got.extend_from_slice(b);
                b.len()
            });
        }
        assert_eq!(got, data);
        assert_eq!(p.writable(), 64);
        assert_eq!(c.readable(), 0);
    }

    #[test]
    fn full_ring_refuses_writes_until_consumed() {
        let (p, c) = ring(ShmSegment::anonymous(64).unwrap());
        assert_eq!(p.write_some(&[1u8; 100]), 64);
        assert_eq!(p.write_some(&[1u8; 1]), 0);
        assert_eq!(c.consume_with(usize::MAX, |b| b.len().min(10)), 10);
        assert_eq!(p.writable(), 10);
    }

    #[test]
    fn garbage_counters_are_clamped_sh_3() {
        let (p, c) = ring(ShmSegment::anonymous(64).unwrap());
        p.seg
            .u64_at(OFF_HEAD)
            .store(u64::MAX - 3, Ordering::Relaxed);
        assert!(c.readable() <= 64);
        assert!(p.writable() <= 64);
        c.consume_with(usize::MAX, |b| {
            assert!(b.len() <= 64);
            b.len()
        });
    }

    #[test]
    fn concurrent_producer_and_consumer_threads_see_every_byte_in_order() {
        let (p, c) = ring(ShmSegment::anonymous(4096).unwrap());
        const N: usize = 4 << 20;
        let producer = std::thread::spawn(move || {
            let chunk: Vec<u8> = (0..=255u8).cycle().take(1000).collect();
            let mut sent = 0usize;
            while sent < N {
                let off = sent % 256;
                let want = (N - sent).min(chunk.len() - off);
                let n = p.write_some(&chunk[off..off + want]);
                if n == 0 {
                    p.wait_space(Duration::from_millis(5));
                }
                sent += n;
            }
        });
        let mut seen = 0usize;
        while seen < N {
            let n = c.consume_with(usize::MAX, |b| {
                for (i, &x) in b.iter().enumerate() {
                    assert_eq!(x, ((seen + i) % 256) as u8, "byte {}", seen + i);
                }
                b.len()
            });
            if n == 0 {
                c.wait_data(Duration::from_millis(5));
            }
            seen += n;
        }
        producer.join().unwrap();
    }

    #[test]
    fn file_backed_ring_is_shared_between_two_mappings() {
        let path = std::env::temp_dir().join(format!("chorus-shm-test-{}", std::process::id()));
        let mut created = ShmSegment::create(&path, 128).unwrap();
        let opened = ShmSegment::open(&path).unwrap();
        created.unlink();
        assert!(!path.exists());
        let p = RingProducer::new(opened);
        let c = RingConsumer::new(created);
        assert_eq!(p.write_some(b"hello"), 5);
        let mut got = Vec::new();
        c.consume_with(usize::MAX, |b| {
            got.extend_from_slice(b);
            b.len()
        });
        assert_eq!(got, b"hello");
    }

    #[test]
    fn ring_file_names_carry_the_creator_pid() {
        let tag = "0123456789abcdef";
        assert_eq!(creator_pid(&ring_file_name(tag, 4242, 1, 0)), Some(4242));
        for bad in [
            "chorus-0123456789abcdef-4242-1",
            "chorus-0123456789abcdef-4242-1-0-9",
            "chorus-0123456789abcdeg-4242-1-0",
            "chorus-0123-4242-1-0",
            "chorus-0123456789abcdef-0-1-0",
            "chorus-0123456789abcdef-+42-1-0",
            "chorus-shm-test-4242",
            "other-0123456789abcdef-4242-1-0",
        ] {
            assert_eq!(creator_pid(bad), None, "{bad}");
        }
    }

    #[test]
    fn sweep_removes_only_ring_files_of_dead_creators() {
        let dir = std::env::temp_dir().join(format!("chorus-sweep-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir(&dir).unwrap();
        // A pid that existed and is gone: a child we spawned and reaped.
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let dead = child.id();
        child.wait().unwrap();
        assert!(pid_gone(dead as i32));
        let live = std::process::id();
        assert!(!pid_gone(live as i32));
        let tag = "00112233445566ff";
        let stale = dir.join(ring_file_name(tag, dead, 1, 0));
        let in_use = dir.join(ring_file_name(tag, live, 1, 0));
        let foreign = dir.join(format!("chorus-not-a-ring-{dead}"));
        let subdir = dir.join(ring_file_name(tag, dead, 2, 0));
        for f in [&stale, &in_use, &foreign] {
            std::fs::write(f, b"x").unwrap();
        }
        std::fs::create_dir(&subdir).unwrap();
        assert_eq!(sweep_stale(&dir), 1);
        assert!(!stale.exists());
        assert!(in_use.exists() && foreign.exists() && subdir.exists());
        // Idempotent: nothing left to remove.
        assert_eq!(sweep_stale(&dir), 0);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn open_rejects_a_file_that_is_not_a_ring() {
        let path = std::env::temp_dir().join(format!("chorus-shm-bad-{}", std::process::id()));
        std::fs::write(&path, vec![0u8; 4096]).unwrap();
        assert!(ShmSegment::open(&path).is_err());
        let _ = std::fs::remove_file(&path);
    }
}
