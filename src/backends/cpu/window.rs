//! One-sided windows of the cpu backend ([`WindowOp`]).
//!
//! Each rank's window is one mapping: a small header (with a futex word
//! that signals wake), one signal counter per source rank, then the
//! window's bytes. When the rank has a
//! same-host peer (a shared-memory link), the mapping is a `0600` file
//! under `/dev/shm`, named like the rings (`shm::ring_file_name`, so
//! `shm::sweep_stale` removes it if its creator is killed), offered to the
//! same-host peers over the authenticated links, and unlinked as soon as
//! every peer said it mapped it (or gave up). Otherwise it is anonymous
//! memory.
//!
//! Every pair of ranks also gets one TCP connection per window, opened at
//! creation (lower rank accepts, as for the data links) and authenticated
//! with the links' handshake under the window's own scope. A peer whose
//! window is mapped here is written directly (a put is a copy, a signal an
//! atomic add); any other peer is written over the connection (put and
//! signal frames), and a receiver task at the target applies the frames in
//! order to its mapping. The connection also tells the target when the
//! source is gone: EOF without a close frame marks the source failed, and a
//! `wait_signal` on it fails with `PeerFailed`.
//!
//! Frames on a window connection: `1 | offset u64 | len u64 | len bytes`
//! (put), `4 | offset u64 | len u64 | crc u32 | len bytes` (put with the
//! CRC32C of its bytes, sent instead of `1` under `CHORUS_CHECKSUM=1`),
//! `2 | value u64` (signal), `3` (close, sent at finalize); integers
//! little-endian.
//!
//! # Invariants
//! - CW-1: puts to one target are applied in issue order and a signal is
//!   added after every earlier put to that target: in shared memory the
//!   copy happens before the counter's `Release` add, which the waiter
//!   loads with `Acquire`; over TCP the frames are written and applied in
//!   order on one connection.
//! - CW-2: a peer cannot make this rank write outside its window: a put
//!   frame whose range does not fit is a protocol error that closes the
//!   connection and marks the source failed; offered files must be ring
//!   files under `/dev/shm` whose header matches the sizes exchanged.
//! - CW-3: a window file exists only during creation: unlinked once every
//!   same-host peer answered, and on every error path (`Mapping` unlinks on
//!   drop).
//! - CW-4: `Free`, finalize and abort free windows: receiver tasks
//!   stopped, mappings unmapped, connections closed (`Free` and finalize
//!   first send a close frame, bounded in time).
//! - CW-5: every change a `wait_signal` waits for (a counter add, in
//!   shared memory or by a receiver task, and a source ending) is followed
//!   by a wake of the target window's futex word, so a waiter parked on it
//!   (from a blocking thread, never a runtime worker) is woken at once;
//!   each park is also bounded by [`MAX_BACKOFF`].
//! - CW-6: with `CHORUS_CHECKSUM=1`, every put sent over a window
//!   connection carries the CRC32C of its bytes, and the receiver checks
//!   any CRC it is sent (setting or not). A put whose bytes fail it, or a
//!   put without one at a receiver with the setting on, ends the
//!   connection: every later `wait_signal` on that source fails
//!   (`Corrupted`, or a fatal `Mismatch` for the missing checksum), so no
//!   signal after the bad put is ever seen. Puts into a mapped window
//!   (this rank's own, or a same-host peer's) are one copy into the
//!   target's memory, with nothing in between to check.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, Ordering};
use std::sync::Arc;
use std::time::Duration;

use futures::stream::{FuturesUnordered, StreamExt};
use ring::rand::{SecureRandom, SystemRandom};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};

use super::link::handshake::{self, Auth};
use super::shm;
use super::CpuBackend;
use crate::backends::{
    Backend, BackendInit, OpCtx, WindowAccess, WindowDone, WindowInfo, WindowOp,
};
use crate::error::{Error, Result};
use crate::tensor::Tensor;
use crate::transport::TransportError;

const SHM_DIR: &str = "/dev/shm";
const MAGIC: u64 = u64::from_le_bytes(*b"CHWINDW1");
const TAG_PUT: u8 = 1;
const TAG_SIGNAL: u8 = 2;
const TAG_CLOSE: u8 = 3;
const TAG_PUT_CRC: u8 = 4;
/// Source states, per source rank.
const LIVE: u8 = 0;
const CLOSED: u8 = 1;
const FAILED: u8 = 2;
/// A put from the source failed its CRC32C (CW-6).
const CORRUPT: u8 = 3;
/// A put from the source came without a CRC32C, which this rank requires.
const UNCHECKED: u8 = 4;
/// How long finalize waits for each close frame.
const CLOSE_BOUND: Duration = Duration::from_secs(1);
/// How long an accepted window connection may take for its handshake.
const HANDSHAKE_BOUND: Duration = Duration::from_secs(5);
/// Receive chunk of the receiver task.
const CHUNK: usize = 64 << 10;
/// Longest single park of a `wait_signal` between two looks at its
/// counter (CW-5).
const MAX_BACKOFF: Duration = Duration::from_millis(1);
/// Header offsets of the futex word that signals bump and of the flag a
/// parked waiter sets (CW-5).
const OFF_WAKE_SEQ: usize = 24;
const OFF_WAKE_FLAG: usize = 28;

/// Where the window's bytes start: after the header and `n` counters.
fn data_offset(n: usize) -> usize {
    (64 + 8 * n).div_ceil(64) * 64
}

/// A shared mapping (a window file, or anonymous memory).
#[derive(Debug)]
struct Mapping {
    ptr: *mut u8,
    len: usize,
    /// The file behind the mapping while it is still linked.
    path: Option<PathBuf>,
}

// SAFETY: the mapping is plain memory; counters are only accessed through
// atomics and the bytes through bounds-checked copies (`WinMem`).
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

fn os_err(what: &str) -> std::io::Error {
    let e = std::io::Error::last_os_error();
    std::io::Error::new(e.kind(), format!("{what}: {e}"))
}

impl Mapping {
    fn map(fd: Option<i32>, len: usize) -> std::io::Result<*mut u8> {
        let (flags, fd) = match fd {
            Some(fd) => (libc::MAP_SHARED, fd),
            None => (libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1),
        };
        // SAFETY: a fresh mapping chosen by the kernel; arguments valid,
        // result checked.
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

    fn anonymous(len: usize) -> std::io::Result<Mapping> {
        Ok(Mapping {
            ptr: Self::map(None, len)?,
            len,
            path: None,
        })
    }

    /// A fresh `0600` file at `path` (which must not exist), mapped.
    fn create(path: &Path, len: usize) -> std::io::Result<Mapping> {
        use std::os::fd::AsRawFd;
        use std::os::unix::fs::OpenOptionsExt;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(path)?;
        let mapped = file
            .set_len(len as u64)
            .and_then(|()| Self::map(Some(file.as_raw_fd()), len));
        match mapped {
            Ok(ptr) => Ok(Mapping {
                ptr,
                len,
                path: Some(path.to_path_buf()),
            }),
            Err(e) => {
                let _ = std::fs::remove_file(path);
                Err(e)
            }
        }
    }

    /// Map a peer's window file of exactly `len` bytes.
    fn open(path: &Path, len: usize) -> std::io::Result<Mapping> {
        use std::os::fd::AsRawFd;
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)?;
        if file.metadata()?.len() != len as u64 {
            return Err(std::io::Error::other("window file has the wrong size"));
        }
        Ok(Mapping {
            ptr: Self::map(Some(file.as_raw_fd()), len)?,
            len,
            path: None,
        })
    }

    /// Remove the backing file (the mapping stays valid). Idempotent.
    fn unlink(&mut self) {
        if let Some(p) = self.path.take() {
            let _ = std::fs::remove_file(p);
        }
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        self.unlink();
        // SAFETY: exactly what mmap returned; no reference into the mapping
        // outlives it (all access goes through `&WinMem`, which owns it).
        unsafe {
            libc::munmap(self.ptr.cast(), self.len);
        }
    }
}

/// One rank's window memory: header, counters, bytes.
#[derive(Debug)]
struct WinMem {
    map: Mapping,
    n: usize,
    size: usize,
}

impl WinMem {
    /// Lay out a fresh (zeroed) mapping for `n` ranks and `size` bytes.
    fn init(map: Mapping, n: usize, size: usize) -> WinMem {
        let m = WinMem { map, n, size };
        m.word(8).store(size as u64, Ordering::Relaxed);
        m.word(16).store(n as u64, Ordering::Relaxed);
        m.word(0).store(MAGIC, Ordering::Release);
        m
    }

    /// A peer's mapping, checked against what it announced (CW-2).
    fn check(map: Mapping, n: usize, size: usize) -> std::io::Result<WinMem> {
        let m = WinMem { map, n, size };
        if m.word(0).load(Ordering::Acquire) != MAGIC
            || m.word(8).load(Ordering::Relaxed) != size as u64
            || m.word(16).load(Ordering::Relaxed) != n as u64
        {
            return Err(std::io::Error::other("not this window's file"));
        }
        Ok(m)
    }

    fn word(&self, off: usize) -> &AtomicU64 {
        debug_assert!(off % 8 == 0 && off + 8 <= data_offset(self.n));
        // SAFETY: `off` is 8-aligned and inside the header (the mapping is
        // at least `data_offset(n)` bytes, page aligned); header words are
        // only accessed atomically.
        unsafe { &*self.map.ptr.add(off).cast::<AtomicU64>() }
    }

    /// The signal counter `src` adds to.
    fn counter(&self, src: usize) -> Option<&AtomicU64> {
        (src < self.n).then(|| self.word(64 + 8 * src))
    }

    fn word32(&self, off: usize) -> &AtomicU32 {
        debug_assert!(off % 4 == 0 && (24..32).contains(&off));
        // SAFETY: `off` is 4-aligned and inside header bytes 24..32, which
        // are only ever accessed as these two atomic u32s (never through
        // `word`).
        unsafe { &*self.map.ptr.add(off).cast::<AtomicU32>() }
    }

    /// Wake a waiter parked on this window (CW-5).
    fn wake(&self) {
        shm::wake_if_waiting(self.word32(OFF_WAKE_SEQ), self.word32(OFF_WAKE_FLAG));
    }

    /// Park the calling thread until [`WinMem::wake`] or `timeout`, unless
    /// `ready` already holds (CW-5).
    fn park(&self, timeout: Duration, ready: impl Fn() -> bool) {
        shm::sleep_unless(
            self.word32(OFF_WAKE_SEQ),
            self.word32(OFF_WAKE_FLAG),
            timeout,
            ready,
        );
    }

    fn fits(&self, offset: usize, len: usize) -> bool {
        offset.checked_add(len).is_some_and(|end| end <= self.size)
    }

    /// Copy `bytes` in at `offset`; false (nothing written) if it does not fit.
    fn write(&self, offset: usize, bytes: &[u8]) -> bool {
        if !self.fits(offset, bytes.len()) {
            return false;
        }
        // SAFETY: the range is inside the window's bytes (checked above);
        // the mapping outlives `self`. Concurrent readers of the same range
        // see unspecified bytes, as documented on `Window`.
        unsafe {
            std::ptr::copy_nonoverlapping(
                bytes.as_ptr(),
                self.map.ptr.add(data_offset(self.n) + offset),
                bytes.len(),
            );
        }
        true
    }

    fn read(&self, offset: usize, len: usize) -> Option<Vec<u8>> {
        if !self.fits(offset, len) {
            return None;
        }
        let mut out = vec![0u8; len];
        // SAFETY: as `write`, reading.
        unsafe {
            std::ptr::copy_nonoverlapping(
                self.map.ptr.add(data_offset(self.n) + offset),
                out.as_mut_ptr(),
                len,
            );
        }
        Some(out)
    }
}

/// This rank's window, shared with its receiver tasks.
#[derive(Debug)]
struct Local {
    mem: WinMem,
    /// Per source rank: `LIVE`, `CLOSED`, `FAILED`, `CORRUPT` or
    /// `UNCHECKED`.
    sources: Vec<AtomicU8>,
    /// Require a CRC32C on every put received (CW-6).
    checksum: bool,
}

impl Local {
    /// Whether `src`'s counter reached `value` or `src` ended.
    fn settled(&self, src: usize, value: u64) -> bool {
        self.mem
            .counter(src)
            .is_none_or(|c| c.load(Ordering::Acquire) >= value)
            || self
                .sources
                .get(src)
                .is_none_or(|s| s.load(Ordering::Acquire) != LIVE)
    }
}

/// How this rank writes one rank's window.
#[derive(Debug)]
enum Target {
    /// This rank's own.
    Me,
    /// Mapped here (same host).
    Mapped(WinMem),
    /// Over the window connection.
    Remote,
}

#[derive(Debug)]
struct CpuWindow {
    local: Arc<Local>,
    targets: Vec<Target>,
    /// Write halves of the window connections, by rank.
    tx: Vec<Option<OwnedWriteHalf>>,
    /// Send a CRC32C with every put over a connection (CW-6).
    checksum: bool,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for CpuWindow {
    fn drop(&mut self) {
        crate::debug::LIVE_WINDOWS.fetch_sub(1, Ordering::AcqRel);
        for t in &self.tasks {
            t.abort();
        }
    }
}

/// The windows of one cpu communicator (CW-4).
#[derive(Debug)]
pub(super) struct Windows {
    /// The runtime the backend was connected on: window sockets and
    /// receiver tasks live there, so they outlive any caller's runtime.
    /// (Turns already run inside this runtime's context, even on a
    /// caller's worker; binding to it explicitly keeps the window
    /// independent of where a turn is polled.)
    rt: Option<tokio::runtime::Handle>,
    secret: Arc<[u8]>,
    key_prefix: String,
    bind_ip: std::net::IpAddr,
    /// `CHORUS_CHECKSUM` (CW-6).
    checksum: bool,
    /// By window id; `None` once freed.
    list: Vec<Option<CpuWindow>>,
}

impl Windows {
    pub(super) fn new(init: &BackendInit) -> Windows {
        Windows {
            rt: tokio::runtime::Handle::try_current().ok(),
            secret: init.secret.clone(),
            key_prefix: init.key_prefix.clone(),
            bind_ip: init.bind_ip,
            checksum: super::link::checksum_from_env(),
            list: Vec::new(),
        }
    }

    /// Free every window; with `graceful`, tell the peers first (CW-4).
    pub(super) async fn close(&mut self, graceful: bool) {
        let mut list = std::mem::take(&mut self.list);
        if graceful && !list.is_empty() {
            tracing::debug!(windows = list.len(), "closing windows");
            futures::future::join_all(list.iter_mut().flatten().map(close_one)).await;
        }
        drop(list);
    }
}

/// Tell every peer this window is closing (close frame, bounded in time).
async fn close_one(w: &mut CpuWindow) {
    let writers = w.tx.iter_mut().flatten().map(|tx| async move {
        let _ = tokio::time::timeout(CLOSE_BOUND, async {
            tx.write_all(&[TAG_CLOSE]).await?;
            tx.shutdown().await
        })
        .await;
    });
    futures::future::join_all(writers).await;
}

/// What a rank offers its peers when a window is created.
struct Offer {
    size: usize,
    addr: SocketAddr,
    /// Its window file, for a same-host peer; empty otherwise.
    path: String,
}

impl Offer {
    fn encode(&self) -> Vec<u8> {
        let addr = self.addr.to_string();
        let mut v = Vec::with_capacity(16 + addr.len() + self.path.len());
        v.extend_from_slice(&(self.size as u64).to_le_bytes());
        v.extend_from_slice(&(addr.len() as u16).to_le_bytes());
        v.extend_from_slice(addr.as_bytes());
        v.extend_from_slice(&(self.path.len() as u16).to_le_bytes());
        v.extend_from_slice(self.path.as_bytes());
        v
    }

    fn decode(b: &[u8]) -> Option<Offer> {
        let size = usize::try_from(u64::from_le_bytes(b.get(0..8)?.try_into().ok()?)).ok()?;
        let al = u16::from_le_bytes(b.get(8..10)?.try_into().ok()?) as usize;
        let addr = std::str::from_utf8(b.get(10..10 + al)?)
            .ok()?
            .parse()
            .ok()?;
        let rest = b.get(10 + al..)?;
        let pl = u16::from_le_bytes(rest.get(0..2)?.try_into().ok()?) as usize;
        let path = std::str::from_utf8(rest.get(2..2 + pl)?).ok()?.to_string();
        (rest.len() == 2 + pl).then_some(Offer { size, addr, path })
    }
}

fn io_err(what: &str, e: std::io::Error) -> Error {
    Error::Transport(TransportError::Io(format!("{what}: {e}")))
}

impl CpuBackend {
    /// Run one window op (see the module docs).
    pub(super) async fn window_op(&mut self, ctx: &OpCtx, op: WindowOp) -> Result<WindowDone> {
        // The links' state gates windows too: nothing runs after an abort,
        // a finalize or a broken op.
        self.enter(ctx)?;
        self.leave(&Ok(()));
        match op {
            WindowOp::Create { size } => self.create_window(ctx, size).await,
            WindowOp::Put {
                window,
                dst,
                offset,
                data,
            } => {
                let bad = self.bad_args(ctx, window, dst);
                let w = self
                    .windows
                    .list
                    .get_mut(window as usize)
                    .and_then(Option::as_mut)
                    .ok_or(bad)?;
                put(ctx, w, dst, offset, data.as_bytes()).await?;
                Ok(WindowDone::Buffer(data))
            }
            WindowOp::Signal { window, dst, value } => {
                let bad = self.bad_args(ctx, window, dst);
                let w = self
                    .windows
                    .list
                    .get_mut(window as usize)
                    .and_then(Option::as_mut)
                    .ok_or(bad)?;
                signal(ctx, w, dst, value).await?;
                Ok(WindowDone::Done)
            }
            WindowOp::WaitSignal { window, src, value } => {
                let bad = self.bad_args(ctx, window, src);
                let w = self
                    .windows
                    .list
                    .get(window as usize)
                    .and_then(Option::as_ref)
                    .ok_or(bad)?;
                wait_signal(ctx, &w.local, src, value).await?;
                Ok(WindowDone::Done)
            }
            WindowOp::Free { window } => {
                let bad = self.bad_args(ctx, window, ctx.rank);
                let mut w = self
                    .windows
                    .list
                    .get_mut(window as usize)
                    .and_then(Option::take)
                    .ok_or(bad)?;
                close_one(&mut w).await;
                drop(w);
                tracing::debug!(comm = %ctx.comm, rank = ctx.rank, window, "window freed");
                Ok(WindowDone::Done)
            }
            WindowOp::Read {
                window,
                offset,
                len,
            } => {
                let bad = self.bad_args(ctx, window, ctx.rank);
                let w = self
                    .windows
                    .list
                    .get(window as usize)
                    .and_then(Option::as_ref)
                    .ok_or(bad)?;
                let bytes = w
                    .local
                    .mem
                    .read(offset, len)
                    .ok_or_else(|| range_error(ctx, ctx.rank, offset, len, w.local.mem.size))?;
                Ok(WindowDone::Buffer(Tensor::from_vec(bytes)))
            }
        }
    }

    fn bad_args(&self, ctx: &OpCtx, window: u64, rank: usize) -> Error {
        Error::InvalidArgument {
            comm: ctx.comm.to_string(),
            rank: ctx.rank,
            op: ctx.kind.name(),
            reason: format!(
                "window {window} does not exist here or was freed (or rank {rank} is out of range): {} windows created",
                self.windows.list.len()
            ),
        }
    }

    async fn create_window(&mut self, ctx: &OpCtx, size: usize) -> Result<WindowDone> {
        let (me, n) = (self.rank, self.size);
        let id = self.windows.list.len() as u64;
        // A window reaches every peer: open every link first, so that the
        // same-host peers are known.
        self.links.ensure(0..n).await?;
        let is_shm: Vec<bool> = (0..n)
            .map(|p| self.links.shm.get(p).is_some_and(Option::is_some))
            .collect();
        let len = data_offset(n)
            .checked_add(size)
            .ok_or_else(|| Error::InvalidArgument {
                comm: ctx.comm.to_string(),
                rank: me,
                op: ctx.kind.name(),
                reason: format!("a window of {size} bytes cannot be mapped"),
            })?;
        let mapping = if is_shm.iter().any(|&s| s) {
            let swept = shm::sweep_stale(Path::new(SHM_DIR));
            if swept > 0 {
                tracing::info!(rank = me, files = swept, "removed stale shm files");
            }
            let mut nonce = [0u8; 8];
            SystemRandom::new()
                .fill(&mut nonce)
                .map_err(|_| Error::Internal("system random generator failed".into()))?;
            let tag: String = nonce.iter().map(|b| format!("{b:02x}")).collect();
            let path = Path::new(SHM_DIR).join(shm::ring_file_name(
                &tag,
                std::process::id(),
                id as usize,
                me,
            ));
            match Mapping::create(&path, len) {
                Ok(m) => Some(m),
                Err(e) => {
                    tracing::warn!(
                        window = id, error = %e,
                        "cannot create a window file: same-host peers reach this window over TCP (get_attr says Separate)"
                    );
                    None
                }
            }
        } else {
            None
        };
        let mapping = match mapping {
            Some(m) => m,
            None => Mapping::anonymous(len).map_err(|e| Error::InvalidArgument {
                comm: ctx.comm.to_string(),
                rank: me,
                op: ctx.kind.name(),
                reason: format!("cannot allocate a window of {size} bytes: {e}"),
            })?,
        };
        let my_path = mapping
            .path
            .as_ref()
            .map(|p| p.to_string_lossy().into_owned())
            .unwrap_or_default();
        let mut local = WinMem::init(mapping, n, size);

        let rt = self
            .windows
            .rt
            .clone()
            .unwrap_or_else(tokio::runtime::Handle::current);
        let bind_ip = self.windows.bind_ip;
        let listener = on(
            &rt,
            async move { crate::backends::cpu::link::listen(bind_ip) },
        )
        .await?
        .map_err(|e| io_err("binding a window listener", e))?;
        let addr = listener
            .local_addr()
            .map_err(|e| io_err("window listener address", e))?;
        let outgoing = (0..n)
            .filter(|&p| p != me)
            .map(|p| {
                let offer = Offer {
                    size,
                    addr,
                    path: if is_shm[p] {
                        my_path.clone()
                    } else {
                        String::new()
                    },
                };
                (p, ctx.seq, offer.encode())
            })
            .collect();
        let received = Backend::exchange_headers(self, ctx, outgoing).await?;
        let mut sizes = vec![size; n];
        let mut addrs: Vec<Option<SocketAddr>> = vec![None; n];
        let mut targets: Vec<Target> = (0..n).map(|_| Target::Remote).collect();
        targets[me] = Target::Me;
        for (p, raw) in received {
            let offer = Offer::decode(&raw)
                .filter(|_| p < n)
                .ok_or_else(|| ctx.peer_failed(vec![p], "peer sent an undecodable window offer"))?;
            sizes[p] = offer.size;
            addrs[p] = Some(offer.addr);
            if is_shm[p]
                && offer
                    .path
                    .starts_with(&format!("{SHM_DIR}/{}", shm::FILE_PREFIX))
                && !offer.path.contains("..")
            {
                let plen = data_offset(n).saturating_add(offer.size);
                match Mapping::open(Path::new(&offer.path), plen)
                    .and_then(|m| WinMem::check(m, n, offer.size))
                {
                    Ok(m) => targets[p] = Target::Mapped(m),
                    Err(e) => {
                        tracing::warn!(
                            window = id, peer = p, error = %e,
                            "cannot map a same-host peer's window: it is reached over TCP (get_attr says Separate)"
                        )
                    }
                }
            }
        }

        // One authenticated connection per pair: connect to lower ranks,
        // accept from higher ones.
        let auth = Auth::new(
            &self.windows.secret,
            &format!("{}/cpu/win/{id}", self.windows.key_prefix),
        );
        let pair_ctx = ctx.clone();
        let streams = on(&rt, async move {
            connect_pairs(&pair_ctx, &auth, &listener, &addrs).await
        })
        .await??;

        // Everyone mapped what it could: the files can go (CW-3).
        let acks = (0..n)
            .filter(|&p| p != me)
            .map(|p| (p, ctx.seq, vec![1u8]))
            .collect();
        Backend::exchange_headers(self, ctx, acks).await?;
        local.map.unlink();

        let local = Arc::new(Local {
            mem: local,
            sources: (0..n).map(|_| AtomicU8::new(LIVE)).collect(),
            checksum: self.windows.checksum,
        });
        let mut tx: Vec<Option<OwnedWriteHalf>> = (0..n).map(|_| None).collect();
        let mut tasks = Vec::new();
        for (p, s) in streams.into_iter().enumerate() {
            if let Some(s) = s {
                let _ = s.set_nodelay(true);
                let (r, w) = s.into_split();
                tx[p] = Some(w);
                tasks.push(rt.spawn(receive(local.clone(), p, r)));
            }
        }
        let access = targets
            .iter()
            .map(|t| match t {
                Target::Me | Target::Mapped(_) => WindowAccess::Unified,
                Target::Remote => WindowAccess::Separate,
            })
            .collect();
        crate::debug::LIVE_WINDOWS.fetch_add(1, Ordering::AcqRel);
        self.windows.list.push(Some(CpuWindow {
            local,
            targets,
            tx,
            checksum: self.windows.checksum,
            tasks,
        }));
        tracing::debug!(comm = %ctx.comm, rank = me, id, size, "window created");
        Ok(WindowDone::Created(WindowInfo { id, sizes, access }))
    }
}

/// Run `fut` as a task of `rt` (so the sockets it creates belong to that
/// runtime) and wait for it; dropping the wait (an abort, a timeout)
/// cancels the task.
async fn on<T: Send + 'static>(
    rt: &tokio::runtime::Handle,
    fut: impl std::future::Future<Output = T> + Send + 'static,
) -> Result<T> {
    struct Cancel(tokio::task::AbortHandle);
    impl Drop for Cancel {
        fn drop(&mut self) {
            self.0.abort();
        }
    }
    let task = rt.spawn(fut);
    let _cancel = Cancel(task.abort_handle());
    task.await
        .map_err(|e| Error::Internal(format!("window setup task failed: {e}")))
}

/// Open this window's connection with every peer (see `create_window`).
async fn connect_pairs(
    ctx: &OpCtx,
    auth: &Auth,
    listener: &TcpListener,
    addrs: &[Option<SocketAddr>],
) -> Result<Vec<Option<TcpStream>>> {
    let (me, n, epoch) = (ctx.rank, ctx.size, ctx.epoch);
    let mut streams: Vec<Option<TcpStream>> = (0..n).map(|_| None).collect();
    let mut connects = FuturesUnordered::new();
    for (peer, addr) in addrs.iter().enumerate().take(me) {
        let addr = addr.ok_or_else(|| ctx.peer_failed(vec![peer], "no window address"))?;
        connects.push(async move {
            let mut s = TcpStream::connect(addr)
                .await
                .map_err(|e| ctx.peer_failed(vec![peer], format!("window connect: {e}")))?;
            // A window's connections are its own: the acceptor always
            // takes them, so the verdict says nothing here.
            handshake::connect(auth, me, peer, epoch, &mut s).await?;
            Ok::<_, Error>((peer, s))
        });
    }
    let mut accepting = FuturesUnordered::new();
    let missing = |s: &[Option<TcpStream>]| (0..n).any(|r| r != me && s[r].is_none());
    while missing(&streams) {
        let need_accept = streams[me + 1..].iter().any(Option::is_none);
        tokio::select! {
            acc = listener.accept(), if need_accept => match acc {
                Ok((mut s, from)) => accepting.push(async move {
                    let r = tokio::time::timeout(
                        HANDSHAKE_BOUND,
                        handshake::accept(auth, me, n, epoch, &mut s, |_| true),
                    )
                    .await
                    .unwrap_or_else(|_| Err("window handshake timed out".into()));
                    (from, s, r)
                }),
                Err(e) => tracing::debug!(error = %e, "window accept failed"),
            },
            Some(r) = connects.next(), if !connects.is_empty() => {
                let (peer, s) = r?;
                streams[peer] = Some(s);
            }
            Some((from, s, r)) = accepting.next(), if !accepting.is_empty() => match r {
                Ok((peer, _)) if peer > me && peer < n && streams[peer].is_none() => {
                    streams[peer] = Some(s);
                }
                Ok((peer, _)) => tracing::warn!(%from, peer, "unexpected window connection refused"),
                Err(detail) => tracing::warn!(%from, %detail, "window connection with a bad handshake refused"),
            },
        }
    }
    Ok(streams)
}

fn range_error(ctx: &OpCtx, rank: usize, offset: usize, len: usize, size: usize) -> Error {
    Error::InvalidArgument {
        comm: ctx.comm.to_string(),
        rank: ctx.rank,
        op: ctx.kind.name(),
        reason: format!(
            "{len} bytes at offset {offset} do not fit rank {rank}'s window of {size} bytes"
        ),
    }
}

/// Write `bytes` into `dst`'s window at `offset` (CW-1).
async fn put(
    ctx: &OpCtx,
    w: &mut CpuWindow,
    dst: usize,
    offset: usize,
    bytes: &[u8],
) -> Result<()> {
    let mem = match w.targets.get(dst) {
        Some(Target::Me) => Some(&w.local.mem),
        Some(Target::Mapped(m)) => Some(m),
        Some(Target::Remote) => None,
        None => return Err(range_error(ctx, dst, offset, bytes.len(), 0)),
    };
    if let Some(mem) = mem {
        return if mem.write(offset, bytes) {
            Ok(())
        } else {
            Err(range_error(ctx, dst, offset, bytes.len(), mem.size))
        };
    }
    let tx =
        w.tx.get_mut(dst)
            .and_then(Option::as_mut)
            .ok_or_else(|| ctx.peer_failed(vec![dst], "no window connection"))?;
    let mut head = Vec::with_capacity(21 + bytes.len().min(CHUNK));
    head.push(if w.checksum { TAG_PUT_CRC } else { TAG_PUT });
    head.extend_from_slice(&(offset as u64).to_le_bytes());
    head.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    if w.checksum {
        head.extend_from_slice(&crc32c::crc32c(bytes).to_le_bytes());
    }
    let sent = if bytes.len() <= CHUNK {
        head.extend_from_slice(bytes);
        tx.write_all(&head).await
    } else {
        match tx.write_all(&head).await {
            Ok(()) => tx.write_all(bytes).await,
            Err(e) => Err(e),
        }
    };
    sent.map_err(|e| ctx.peer_failed(vec![dst], format!("window put to rank {dst}: {e}")))
}

/// Add `value` to this rank's counter in `dst`'s window (CW-1).
async fn signal(ctx: &OpCtx, w: &mut CpuWindow, dst: usize, value: u64) -> Result<()> {
    let me = ctx.rank;
    let mem = match w.targets.get(dst) {
        Some(Target::Me) => Some(&w.local.mem),
        Some(Target::Mapped(m)) => Some(m),
        Some(Target::Remote) => None,
        None => return Err(ctx.peer_failed(vec![dst], "no such rank")),
    };
    if let Some(m) = mem {
        let c = m
            .counter(me)
            .ok_or_else(|| ctx.peer_failed(vec![dst], "no signal counter for this rank"))?;
        // Release: every earlier put's bytes are visible with the count.
        c.fetch_add(value, Ordering::Release);
        m.wake();
        return Ok(());
    }
    let tx =
        w.tx.get_mut(dst)
            .and_then(Option::as_mut)
            .ok_or_else(|| ctx.peer_failed(vec![dst], "no window connection"))?;
    let mut frame = [0u8; 9];
    frame[0] = TAG_SIGNAL;
    frame[1..].copy_from_slice(&value.to_le_bytes());
    tx.write_all(&frame)
        .await
        .map_err(|e| ctx.peer_failed(vec![dst], format!("window signal to rank {dst}: {e}")))
}

/// Wait until `src`'s counter in `local` reaches `value`.
async fn wait_signal(ctx: &OpCtx, local: &Arc<Local>, src: usize, value: u64) -> Result<()> {
    let counter = local
        .mem
        .counter(src)
        .ok_or_else(|| ctx.peer_failed(vec![src], "no such rank"))?;
    let mut park = Duration::from_micros(50);
    let mut spins = 0u32;
    loop {
        if counter.load(Ordering::Acquire) >= value {
            return Ok(());
        }
        match local.sources.get(src).map(|s| s.load(Ordering::Acquire)) {
            Some(CLOSED) => {
                return Err(ctx.peer_failed(
                    vec![src],
                    format!(
                        "rank {src} closed its window (finalized) before its signal reached {value}"
                    ),
                ))
            }
            Some(FAILED) => {
                return Err(ctx.peer_failed(
                    vec![src],
                    format!(
                    "rank {src} is gone (window connection lost) before its signal reached {value}"
                ),
                ))
            }
            Some(CORRUPT) => {
                return Err(ctx.corrupted(
                    src,
                    format!(
                        "a window put from rank {src} failed its CRC32C before its signal \
                         reached {value}; the window's bytes from that put are not valid"
                    ),
                ))
            }
            Some(UNCHECKED) => {
                return Err(ctx.mismatch(format!(
                    "rank {src} sent a window put without a checksum, but this rank has \
                     CHORUS_CHECKSUM on: set it alike on every rank"
                )))
            }
            _ => {}
        }
        if spins < 64 {
            spins += 1;
            tokio::task::yield_now().await;
            continue;
        }
        // CW-5: park on the window's futex from a blocking thread (a turn
        // may run on a worker of the caller's runtime, which must not
        // sleep), woken by the signal itself. The park holds its own
        // handle to the window, so a wait dropped meanwhile frees nothing
        // under it; the bound grows while nothing arrives.
        let t = park;
        park = (park * 2).min(MAX_BACKOFF);
        let l = Arc::clone(local);
        let parked =
            tokio::task::spawn_blocking(move || l.mem.park(t, || l.settled(src, value))).await;
        if parked.is_err() {
            // No blocking pool (the runtime is shutting down): a timer.
            tokio::time::sleep(t).await;
        }
    }
}

/// Apply `src`'s frames to `local` until the connection ends (CW-1, CW-2).
async fn receive(local: Arc<Local>, src: usize, mut rx: OwnedReadHalf) {
    let mut buf = vec![0u8; CHUNK];
    let end = loop {
        let Ok(tag) = rx.read_u8().await else {
            break FAILED;
        };
        match tag {
            TAG_PUT | TAG_PUT_CRC => {
                let (Ok(offset), Ok(len)) = (rx.read_u64_le().await, rx.read_u64_le().await) else {
                    break FAILED;
                };
                let sent = if tag == TAG_PUT_CRC {
                    match rx.read_u32_le().await {
                        Ok(c) => Some(c),
                        Err(_) => break FAILED,
                    }
                } else {
                    None
                };
                if sent.is_none() && local.checksum {
                    tracing::error!(
                        src,
                        "window put without a checksum (CHORUS_CHECKSUM differs)"
                    );
                    break UNCHECKED;
                }
                let (Ok(offset), Ok(len)) = (usize::try_from(offset), usize::try_from(len)) else {
                    break FAILED;
                };
                if !local.mem.fits(offset, len) {
                    tracing::warn!(src, offset, len, "window put out of range; closing");
                    break FAILED;
                }
                let mut done = 0;
                let mut ok = true;
                let mut crc = 0u32;
                while done < len {
                    let k = (len - done).min(CHUNK);
                    if rx.read_exact(&mut buf[..k]).await.is_err() {
                        ok = false;
                        break;
                    }
                    if sent.is_some() {
                        crc = crc32c::crc32c_append(crc, &buf[..k]);
                    }
                    local.mem.write(offset + done, &buf[..k]);
                    done += k;
                }
                if !ok {
                    break FAILED;
                }
                if let Some(want) = sent.filter(|&want| want != crc) {
                    tracing::error!(
                        src,
                        offset,
                        len,
                        got = crc,
                        want,
                        "window put failed its CRC32C"
                    );
                    break CORRUPT;
                }
            }
            TAG_SIGNAL => {
                let Ok(v) = rx.read_u64_le().await else {
                    break FAILED;
                };
                if let Some(c) = local.mem.counter(src) {
                    c.fetch_add(v, Ordering::Release);
                }
                local.mem.wake();
            }
            TAG_CLOSE => break CLOSED,
            other => {
                tracing::warn!(src, tag = other, "unknown window frame; closing");
                break FAILED;
            }
        }
    };
    if let Some(s) = local.sources.get(src) {
        s.store(end, Ordering::Release);
    }
    local.mem.wake();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn offers_round_trip_and_truncated_ones_are_refused() {
        let o = Offer {
            size: 12345,
            addr: "127.0.0.1:4567".parse().expect("addr"),
            path: "/dev/shm/chorus-0123456789abcdef-42-0-1".into(),
        };
        let b = o.encode();
        let d = Offer::decode(&b).expect("decodes");
        assert_eq!(
            (d.size, d.addr, d.path.as_str()),
            (o.size, o.addr, o.path.as_str())
        );
        for cut in 0..b.len() {
            assert!(Offer::decode(&b[..cut]).is_none(), "prefix of {cut} bytes");
        }
        let mut long = b.clone();
        long.push(0);
        assert!(Offer::decode(&long).is_none(), "trailing bytes");
    }

    #[test]
    fn cw_2_window_memory_refuses_out_of_range_writes_and_reads() {
        let n = 3;
        let m = WinMem::init(Mapping::anonymous(data_offset(n) + 10).expect("map"), n, 10);
        assert!(m.write(6, &[1, 2, 3, 4]));
        assert_eq!(m.read(6, 4), Some(vec![1, 2, 3, 4]));
        assert!(!m.write(7, &[0; 4]));
        assert!(!m.write(usize::MAX, &[0]));
        assert_eq!(m.read(11, 0), None);
        assert_eq!(m.read(10, 0), Some(vec![]));
        assert!(m.counter(2).is_some() && m.counter(3).is_none());
        // The counters do not overlap the bytes.
        m.counter(2)
            .expect("counter")
            .fetch_add(u64::MAX, Ordering::Release);
        assert_eq!(m.read(0, 10), Some(vec![0, 0, 0, 0, 0, 0, 1, 2, 3, 4]));
    }

    /// Feed `frame` (then a close) to a receiver task over a loopback TCP
    /// pair; the source's end state and the window's 8 bytes.
    async fn receive_frame(checksum: bool, frame: Vec<u8>) -> (u8, Vec<u8>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
        let addr = listener.local_addr().expect("addr");
        let mut client = TcpStream::connect(addr).await.expect("connect");
        let (server, _) = listener.accept().await.expect("accept");
        let (rx, _keep) = server.into_split();
        let n = 2;
        let local = Arc::new(Local {
            mem: WinMem::init(Mapping::anonymous(data_offset(n) + 8).expect("map"), n, 8),
            sources: (0..n).map(|_| AtomicU8::new(LIVE)).collect(),
            checksum,
        });
        let task = tokio::spawn(receive(local.clone(), 1, rx));
        client.write_all(&frame).await.expect("frame");
        // The receiver may already have hung up on a bad frame.
        let _ = client.write_all(&[TAG_CLOSE]).await;
        task.await.expect("receiver");
        let state = local.sources[1].load(Ordering::Acquire);
        (state, local.mem.read(0, 8).expect("read"))
    }

    fn put_frame(offset: u64, bytes: &[u8], crc: Option<u32>) -> Vec<u8> {
        let mut f = vec![if crc.is_some() { TAG_PUT_CRC } else { TAG_PUT }];
        f.extend_from_slice(&offset.to_le_bytes());
        f.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
        if let Some(c) = crc {
            f.extend_from_slice(&c.to_le_bytes());
        }
        f.extend_from_slice(bytes);
        f
    }

    #[tokio::test]
    async fn cw_6_a_put_failing_its_crc_or_missing_one_ends_the_source() {
        let bytes = [1u8, 2, 3, 4];
        let good = Some(crc32c::crc32c(&bytes));
        let landed = vec![0, 0, 1, 2, 3, 4, 0, 0];
        // A put with its CRC lands, whatever this rank's setting.
        for checksum in [true, false] {
            let got = receive_frame(checksum, put_frame(2, &bytes, good)).await;
            assert_eq!(got, (CLOSED, landed.clone()), "checksum {checksum}");
        }
        // A wrong CRC is found with the setting off too.
        for checksum in [true, false] {
            let bad = good.map(|c| c ^ 1);
            let (state, _) = receive_frame(checksum, put_frame(2, &bytes, bad)).await;
            assert_eq!(state, CORRUPT, "checksum {checksum}");
        }
        // No CRC: refused where one is required, taken where it is not.
        let (state, mem) = receive_frame(true, put_frame(2, &bytes, None)).await;
        assert_eq!((state, mem), (UNCHECKED, vec![0; 8]));
        let got = receive_frame(false, put_frame(2, &bytes, None)).await;
        assert_eq!(got, (CLOSED, landed));
    }

    #[test]
    fn cw_2_a_mapping_with_another_layout_is_refused() {
        let m = WinMem::init(Mapping::anonymous(data_offset(2) + 8).expect("map"), 2, 8);
        let WinMem { map, .. } = m;
        assert!(WinMem::check(map, 2, 16).is_err(), "size differs");
        let blank = Mapping::anonymous(data_offset(2) + 8).expect("map");
        assert!(WinMem::check(blank, 2, 8).is_err(), "no magic");
    }
}
