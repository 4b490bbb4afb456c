//! One-sided windows (TorchComms' `new_window` / `TorchCommWindow`): each
//! rank exposes a byte buffer that its peers write into with
//! [`Window::put`], and synchronises with them through per-pair signal
//! counters ([`Window::signal`], [`Window::wait_signal`]).
//!
//! Owns only the handle and its argument checks. Every window op is a turn
//! of the communicator's actor, like any other op, and runs on the
//! backend's [`Backend::window`](crate::Backend::window): creation is
//! collective (ordered with the communicator's collectives, checked across
//! ranks by the header exchange); puts, signals, waits and local reads are
//! one-sided (no header, no sequence number) and run in this rank's issue
//! order, ordered with its other ops.
//!
//! # Invariants
//! - WN-1: a window op's ranks and byte ranges are checked against the
//!   window's sizes before anything is submitted: a bad rank, offset or
//!   length is `InvalidArgument` and nothing moves.
//! - WN-2: puts from one rank to one target land in issue order, and a
//!   signal to a target is counted only after every earlier put to it
//!   landed; so once `wait_signal(src, v)` returns, every put `src` issued
//!   before the signal that reached `v` is visible in the local window.
//! - WN-3: a window lives until [`Window::free`] (collective) or its
//!   communicator's finalize or abort, which free it on every rank (memory
//!   unmapped, shared-memory files removed, connections closed); a window
//!   op after that fails (`InvalidArgument` after `free`, like any op of a
//!   closed communicator after finalize or abort).

use crate::actors::Request;
use crate::backends::{WindowAccess, WindowDone, WindowInfo, WindowOp};
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::tensor::{DType, Tensor};
use crate::work::{Completion, Work};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// A one-sided window of a communicator ([`Comm::new_window`]).
///
/// Rank `r`'s window is `sizes()[r]` bytes, zeroed at creation. Any rank
/// may [`put`](Self::put) bytes into any rank's window (its own included)
/// and [`signal`](Self::signal) it; the owner reads its window with
/// [`read`](Self::read) once [`wait_signal`](Self::wait_signal) says the
/// data is there. Each (source, target) pair has a signal counter in the
/// target's window: `signal(dst, v)` adds `v` to it, after every earlier
/// put from this rank to `dst` landed, and `wait_signal(src, v)` waits until
/// the counter `src` adds to reaches `v`.
///
/// Reading a range that a peer is writing at the same time gives
/// unspecified bytes (no tearing guarantees); synchronise with signals.
///
/// ```
/// use chorus::{new_comm, CommOptions, Device};
///
/// let comm = new_comm("cpu", Device::Cpu, "win-doc", CommOptions::single())?;
/// let win = comm.new_window(16)?;
/// win.put_bytes(&[1, 2, 3, 4], 0, 8)?; // into this rank's own window
/// win.signal(0, 1)?;
/// win.wait_signal(0, 1)?;
/// assert_eq!(win.read(8, 4)?, vec![1, 2, 3, 4]);
/// win.free()?; // collective; or leave it to finalize
/// comm.finalize()?;
/// # Ok::<(), chorus::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct Window {
    comm: Comm,
    info: WindowInfo,
    /// Set by [`Window::free`], shared by clones.
    freed: Arc<AtomicBool>,
}

/// A window's attributes for one peer ([`Window::get_attr`]), as
/// TorchComms' `TorchCommWindowAttr`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WindowAttr {
    /// How this rank reaches the peer's window.
    pub access_type: WindowAccess,
    /// The peer's window size in bytes.
    pub size: usize,
}

fn to_window_info(c: Completion) -> Result<WindowInfo> {
    match c {
        Completion::Window(WindowDone::Created(info)) => Ok(info),
        other => Err(Error::Internal(format!(
            "new_window completed with {other:?}"
        ))),
    }
}

fn to_buffer(c: Completion) -> Result<Tensor> {
    match c {
        Completion::Window(WindowDone::Buffer(t)) => Ok(t),
        other => Err(Error::Internal(format!(
            "a window op completed with {other:?}, not a buffer"
        ))),
    }
}

fn to_bytes(c: Completion) -> Result<Vec<u8>> {
    to_buffer(c).map(|t| t.as_bytes().to_vec())
}

fn to_done(c: Completion) -> Result<()> {
    match c {
        Completion::Window(WindowDone::Done) => Ok(()),
        other => Err(Error::Internal(format!(
            "a window op completed with {other:?}"
        ))),
    }
}

impl Comm {
    /// Create a one-sided window of `size_bytes` bytes on this rank (ranks
    /// may pass different sizes), connected with every rank's window.
    /// Collective: every rank calls it, in order with the communicator's
    /// other collectives. On the `cpu` backend, same-host peers map each
    /// other's windows (shared memory) and other peers are reached over
    /// authenticated TCP connections.
    ///
    /// # Errors
    /// [`Error::UnsupportedOp`] on a backend without windows (every
    /// backend but `cpu`, and `nccl` with NCCL 2.29 or later), before any
    /// I/O; [`Error::Mismatch`] if the
    /// ranks are out of step; the communicator's failures otherwise.
    pub fn new_window(&self, size_bytes: usize) -> Result<Window> {
        let info = self.blocking("new_window", || self.new_window_work(size_bytes))?;
        Ok(Window {
            comm: self.clone(),
            info,
            freed: Arc::new(AtomicBool::new(false)),
        })
    }

    /// Async form of [`Comm::new_window`].
    ///
    /// # Errors
    /// As [`Comm::new_window`].
    pub async fn new_window_async(&self, size_bytes: usize) -> Result<Window> {
        let info = self.new_window_work(size_bytes).await?;
        Ok(Window {
            comm: self.clone(),
            info,
            freed: Arc::new(AtomicBool::new(false)),
        })
    }

    fn new_window_work(&self, size_bytes: usize) -> Work<WindowInfo> {
        self.submit(to_window_info, || {
            if !self.shared.windows {
                return Err(Error::UnsupportedOp {
                    op: format!(
                        "new_window (one-sided windows) on backend {}",
                        self.backend()
                    ),
                    dtype: DType::U8,
                });
            }
            Ok(Request::window(
                WindowOp::Create { size: size_bytes },
                size_bytes,
            ))
        })
    }
}

impl Window {
    /// The window's id: windows of a communicator are numbered in creation
    /// order, the same on every rank.
    pub fn id(&self) -> u64 {
        self.info.id
    }

    /// The communicator this window belongs to.
    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    /// This rank's window size in bytes (TorchComms' `get_size`).
    pub fn size(&self) -> usize {
        self.info.sizes[self.comm.rank()]
    }

    /// Every rank's window size in bytes, by rank.
    pub fn sizes(&self) -> &[usize] {
        &self.info.sizes
    }

    /// The attributes of `peer`'s window as this rank sees it: how it is
    /// reached ([`WindowAccess::Unified`] when mapped into this process,
    /// [`WindowAccess::Separate`] over the network) and its size.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `peer` is not a rank.
    pub fn get_attr(&self, peer: usize) -> Result<WindowAttr> {
        self.check_rank("window_get_attr", peer)?;
        Ok(WindowAttr {
            access_type: self.info.access[peer],
            size: self.info.sizes[peer],
        })
    }

    /// A handle on the same window whose ops use `timeout`
    /// (as [`Comm::with_timeout`]); `wait_signal` waits at most that long.
    pub fn with_timeout(&self, timeout: std::time::Duration) -> Window {
        Window {
            comm: self.comm.with_timeout(timeout),
            info: self.info.clone(),
            freed: self.freed.clone(),
        }
    }

    fn invalid(&self, op: &'static str, reason: String) -> Error {
        Error::InvalidArgument {
            comm: self.comm.name().to_string(),
            rank: self.comm.rank(),
            op,
            reason,
        }
    }

    fn check_rank(&self, op: &'static str, r: usize) -> Result<()> {
        if self.freed.load(Ordering::Acquire) {
            return Err(self.invalid(op, format!("window {} was freed", self.info.id)));
        }
        if r >= self.comm.size() {
            return Err(self.invalid(
                op,
                format!("rank {r} is out of range for {} ranks", self.comm.size()),
            ));
        }
        Ok(())
    }

    /// WN-1: `[offset, offset + len)` fits rank `r`'s window.
    fn check_range(&self, op: &'static str, r: usize, offset: usize, len: usize) -> Result<()> {
        self.check_rank(op, r)?;
        let size = self.info.sizes[r];
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(self.invalid(
                op,
                format!(
                    "{len} bytes at offset {offset} do not fit rank {r}'s window of {size} bytes"
                ),
            )),
        }
    }

    /// Write `data`'s bytes into rank `dst`'s window at byte `offset`, and
    /// hand `data` back. Completes once the bytes are in the target's
    /// window (shared memory) or written to its connection (TCP); either
    /// way they land before any later signal from this rank to `dst`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `dst` is not a rank, the bytes do not
    /// fit its window, or `data` is a device tensor (before any I/O);
    /// [`Error::PeerFailed`] if `dst` is
    /// gone; the communicator's failures otherwise.
    pub fn put(&self, data: Tensor, dst: usize, offset: usize) -> Result<Tensor> {
        self.comm
            .blocking("window_put", || self.put_async(data, dst, offset))
    }

    /// Async form of [`Window::put`].
    pub fn put_async(&self, data: Tensor, dst: usize, offset: usize) -> Work<Tensor> {
        self.comm.submit(to_buffer, || {
            if data.is_device() {
                return Err(self.invalid(
                    "window_put",
                    format!(
                        "windows take host memory; the tensor is on {} (copy it with Comm::to_host)",
                        data.device()
                    ),
                ));
            }
            self.check_range("window_put", dst, offset, data.len_bytes())?;
            let len = data.len_bytes();
            Ok(Request::window(
                WindowOp::Put {
                    window: self.info.id,
                    dst,
                    offset,
                    data,
                },
                len,
            ))
        })
    }

    /// [`Window::put`] of a byte slice (copied into the op).
    ///
    /// # Errors
    /// As [`Window::put`].
    pub fn put_bytes(&self, data: &[u8], dst: usize, offset: usize) -> Result<()> {
        self.put(Tensor::from_slice(data), dst, offset).map(drop)
    }

    /// Add `value` to this rank's signal counter in `dst`'s window, after
    /// every put this rank issued to `dst` before it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `dst` is not a rank;
    /// [`Error::PeerFailed`] if `dst` is gone; the communicator's failures.
    pub fn signal(&self, dst: usize, value: u64) -> Result<()> {
        self.comm
            .blocking("window_signal", || self.signal_async(dst, value))
    }

    /// Async form of [`Window::signal`].
    pub fn signal_async(&self, dst: usize, value: u64) -> Work<()> {
        self.comm.submit(to_done, || {
            self.check_rank("window_signal", dst)?;
            Ok(Request::window(
                WindowOp::Signal {
                    window: self.info.id,
                    dst,
                    value,
                },
                0,
            ))
        })
    }

    /// Wait until the signal counter of `src` in this rank's window reaches
    /// at least `value` (counters start at 0 and only grow). Every put `src`
    /// issued before the signal that reached it is then visible to
    /// [`Window::read`]. Bounded by the communicator's (or this handle's)
    /// timeout; like every op, it holds up this rank's later ops while it
    /// waits.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if `src` is not a rank;
    /// [`Error::PeerFailed`] if `src` died (or closed its window) first;
    /// [`Error::Timeout`] when the timeout passes (fatal, as for any op);
    /// [`Error::Aborted`] if the communicator is aborted meanwhile.
    pub fn wait_signal(&self, src: usize, value: u64) -> Result<()> {
        self.comm
            .blocking("window_wait_signal", || self.wait_signal_async(src, value))
    }

    /// Async form of [`Window::wait_signal`].
    pub fn wait_signal_async(&self, src: usize, value: u64) -> Work<()> {
        self.comm.submit(to_done, || {
            self.check_rank("window_wait_signal", src)?;
            Ok(Request::window(
                WindowOp::WaitSignal {
                    window: self.info.id,
                    src,
                    value,
                },
                0,
            ))
        })
    }

    /// Copy `len` bytes at byte `offset` out of this rank's own window.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the range does not fit the window; the
    /// communicator's failures otherwise.
    pub fn read(&self, offset: usize, len: usize) -> Result<Vec<u8>> {
        self.comm
            .blocking("window_read", || self.read_async(offset, len))
    }

    /// Async form of [`Window::read`].
    pub fn read_async(&self, offset: usize, len: usize) -> Work<Vec<u8>> {
        self.comm
            .submit(to_bytes, || self.read_request(offset, len))
    }

    /// Copy `count` elements of `dtype` at byte `offset` out of this rank's
    /// window, as a tensor (TorchComms' `get_tensor`, as a copy).
    ///
    /// # Errors
    /// As [`Window::read`].
    pub fn read_tensor(&self, dtype: DType, offset: usize, count: usize) -> Result<Tensor> {
        let len = count
            .checked_mul(dtype.size())
            .ok_or_else(|| self.invalid("window_read", format!("{count} x {dtype} overflows")))?;
        let bytes = self.comm.blocking("window_read", || {
            self.comm
                .submit(to_buffer, || self.read_request(offset, len))
        })?;
        Tensor::from_bytes(dtype, bytes.as_bytes())
            .ok_or_else(|| Error::Internal(format!("{len} bytes are not {count} x {dtype}")))
    }

    /// Free this window on every rank: its memory, files and connections.
    /// Collective: every rank frees the same window, in order with the
    /// communicator's other collectives. Every handle of the window (its
    /// clones too) refuses ops from the call on with `InvalidArgument`,
    /// even if the free itself fails (the window then stays allocated
    /// until finalize). Not needed before [`Comm::finalize`], which frees
    /// every window.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] if the window was already freed;
    /// [`Error::Mismatch`] if ranks free different windows (or issue other
    /// ops); the communicator's failures otherwise.
    pub fn free(self) -> Result<()> {
        self.comm.blocking("free_window", || self.free_work())
    }

    /// Async form of [`Window::free`].
    ///
    /// # Errors
    /// As [`Window::free`].
    pub async fn free_async(self) -> Result<()> {
        self.free_work().await
    }

    fn free_work(&self) -> Work<()> {
        self.comm.submit(to_done, || {
            if self.freed.swap(true, Ordering::AcqRel) {
                return Err(self.invalid(
                    "free_window",
                    format!("window {} was freed already", self.info.id),
                ));
            }
            Ok(Request::window(
                WindowOp::Free {
                    window: self.info.id,
                },
                self.info.id as usize,
            ))
        })
    }

    fn read_request(&self, offset: usize, len: usize) -> Result<Request> {
        self.check_range("window_read", self.comm.rank(), offset, len)?;
        Ok(Request::window(
            WindowOp::Read {
                window: self.info.id,
                offset,
                len,
            },
            len,
        ))
    }
}
