//! One-sided windows on the `nccl` backend, through NCCL's window
//! registration and one-sided host API (NCCL >= 2.29: `ncclMemAlloc`,
//! `ncclCommWindowRegister`, `ncclPutSignal`, `ncclWaitSignal`).
//!
//! Owns each window's device memory, its NCCL registration and the signal
//! bookkeeping that turns NCCL's *counted* signals into Chorus's *valued*
//! ones ([`Window::signal`](crate::Window::signal) adds a value,
//! `wait_signal` waits for a total). Nothing here is generic: the checks
//! above the [`Backend`] trait (ranks and ranges,
//! [`WindowOp`]'s contract) already ran.
//!
//! **Layout.** Every rank allocates the same number of bytes
//! ([`Layout`]): room for the largest rank's window, then one 8-byte
//! *slot* per rank, rounded up to `NCCL_WIN_REQUIRED_ALIGNMENT`. Rank `r`'s
//! window is the first `sizes[r]` bytes of its buffer; slot `s` holds the
//! running total that rank `s` signalled to this rank. The buffer is
//! zeroed before it is registered.
//!
//! **Ops**, each on the communicator's stream and complete when the stream
//! passed it (the backend's completion thread, as for collectives):
//! - `put(dst, offset)`: the host bytes are staged into device memory, then
//!   one `ncclPutSignal` into `dst`'s window at `offset`.
//! - `signal(dst, v)`: this rank's running total for `dst` grows by `v`,
//!   and one `ncclPutSignal` writes the new total into this rank's slot in
//!   `dst`'s buffer.
//! - `wait_signal(src, v)`: until the total last read from slot `src` is
//!   at least `v`, consume one more of `src`'s signal operations with
//!   `ncclWaitSignal` (one op), then read the slot.
//! - `read`: a device → host copy of this rank's own window.
//!
//! Puts and signals to this rank's own window never go through NCCL (a
//! device copy, and a slot written directly), and a `wait_signal` on this
//! rank's own slot that is not already satisfied is refused: no later op
//! of this rank could satisfy it while it waits.
//!
//! # Invariants
//! - XW-1: windows exist only where the loaded library has every symbol
//!   above and reports version 2.29 or later; otherwise
//!   the backend's `supports_windows` is false and `new_window` is
//!   `UnsupportedOp` on every rank before any I/O.
//! - XW-2: every put and every signal from this rank to a peer is one NCCL
//!   signal operation on signal index 0 of context 0, issued in program
//!   order on the communicator's stream; `wait_signal` consumes those
//!   operations one at a time and reads a slot only after a consumed
//!   operation, so the bytes of every put the peer issued before the
//!   signal that reached the value have been waited for. This relies on
//!   NCCL delivering one rank's one-sided operations to one peer on one
//!   context in issue order, as the stream orders them.
//! - XW-3: a window's memory is released once: at `free` (deregistered,
//!   then freed), at finalize (the same, before the communicator is
//!   finalized), or after an abort (freed once `ncclCommAbort` returned and
//!   the stream drained).

use std::ffi::c_void;
use std::time::Instant;

use super::sys::{self, ncclWaitSignalDesc_t};
use super::{result, settle_new, DeviceGuard, SendPtr, XcclBackend, MEMCPY_D2D};
use crate::backends::{Backend, OpCtx, WindowAccess, WindowDone, WindowInfo, WindowOp};
use crate::error::{Error, Result};
use crate::tensor::Tensor;

use result::CallError;

/// Where the parts of a window's buffer are, the same on every rank.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Byte offset of slot 0 (after the largest rank's window, 8-aligned).
    pub slots_at: usize,
    /// Bytes allocated and registered on every rank.
    pub len: usize,
}

impl Layout {
    /// The layout for windows of `sizes` bytes (by rank), or `None` when the
    /// sizes overflow the address space.
    pub fn new(sizes: &[usize]) -> Option<Layout> {
        let largest = sizes.iter().copied().max().unwrap_or(0);
        let slots_at = largest.checked_next_multiple_of(8)?;
        let end = slots_at.checked_add(sizes.len().checked_mul(8)?)?;
        let len = end
            .max(1)
            .checked_next_multiple_of(sys::NCCL_WIN_REQUIRED_ALIGNMENT)?;
        Some(Layout { slots_at, len })
    }

    /// Byte offset of the slot rank `src` signals into.
    pub fn slot(&self, src: usize) -> usize {
        self.slots_at + 8 * src
    }
}

/// One registered window on this rank.
pub(super) struct XcclWindow {
    /// The registration; null once deregistered.
    win: sys::ncclWindow_t,
    /// This rank's buffer (`ncclMemAlloc`), as an address.
    base: usize,
    layout: Layout,
    sizes: Vec<usize>,
    /// The running total this rank signalled to each rank.
    sent: Vec<u64>,
    /// The total last read from each rank's slot after a consumed signal.
    seen: Vec<u64>,
}

// SAFETY: the registration handle is only used by the backend that owns
// the window, one op at a time (BE-1), as the communicator itself is.
unsafe impl Send for XcclWindow {}

impl XcclBackend {
    /// Whether the loaded library can run one-sided windows (XW-1).
    pub(super) fn windows_supported(&self) -> bool {
        let n = &self.api.nccl;
        n.mem_alloc.is_some()
            && n.mem_free.is_some()
            && n.comm_window_register.is_some()
            && n.comm_window_deregister.is_some()
            && n.put_signal.is_some()
            && n.wait_signal.is_some()
            && self.api.version() >= sys::NCCL_ONE_SIDED_VERSION
    }

    fn unsupported(&self) -> CallError {
        CallError {
            call: "window",
            code: 0,
            nccl: false,
            message: format!(
                "{} {} lacks the one-sided window API (NCCL 2.29 or later)",
                self.flavor.name(),
                self.api.version()
            ),
        }
    }

    fn no_window(&self, ctx: &OpCtx, window: u64) -> Error {
        Error::InvalidArgument {
            comm: ctx.comm.to_string(),
            rank: ctx.rank,
            op: ctx.kind.name(),
            reason: format!(
                "window {window} does not exist here or was freed: {} windows created",
                self.windows.len()
            ),
        }
    }

    /// Run one window op (see the module docs).
    pub(super) async fn window_op(&mut self, ctx: &OpCtx, op: WindowOp) -> Result<WindowDone> {
        self.usable()?;
        let name = op.name();
        let window = match &op {
            WindowOp::Create { .. } => None,
            WindowOp::Put { window, .. }
            | WindowOp::Signal { window, .. }
            | WindowOp::WaitSignal { window, .. }
            | WindowOp::Free { window }
            | WindowOp::Read { window, .. } => Some(*window),
        };
        if let Some(w) = window {
            if self.windows.get(w as usize).is_none_or(Option::is_none) {
                return Err(self.no_window(ctx, w));
            }
        }
        // XC-10: a window op issued through `Comm::with_stream` waits for
        // the caller's stream like any other op.
        self.order = ctx.order.clone();
        let ordered =
            DeviceGuard::set(&self.api.rt, self.device).and_then(|_dev| self.order_after());
        if let Err(e) = ordered {
            let site = format!("{name}, stream order");
            return Err(self.vendor_err(e, &site, |d| ctx.peer_failed(vec![], d)));
        }
        let r = match op {
            WindowOp::Create { size } => return self.create_window(ctx, size).await,
            WindowOp::Put {
                window,
                dst,
                offset,
                data,
            } => self
                .put(window as usize, dst, offset, data.as_bytes())
                .await
                .map(|()| WindowDone::Buffer(data)),
            WindowOp::Signal { window, dst, value } => self
                .signal(window as usize, dst, value)
                .await
                .map(|()| WindowDone::Done),
            WindowOp::WaitSignal { window, src, value } => {
                if src == self.rank {
                    return self.wait_own(ctx, window as usize, value);
                }
                self.wait_signal(window as usize, src, value)
                    .await
                    .map(|()| WindowDone::Done)
            }
            WindowOp::Read {
                window,
                offset,
                len,
            } => {
                // Checked above the trait too; a bad range is the caller's
                // error, never one that breaks the communicator.
                let w = self.win(window as usize);
                let size = w.sizes[self.rank];
                if offset.checked_add(len).is_none_or(|end| end > size) {
                    return Err(Error::InvalidArgument {
                        comm: ctx.comm.to_string(),
                        rank: ctx.rank,
                        op: ctx.kind.name(),
                        reason: format!(
                            "{len} bytes at offset {offset} do not fit this rank's window of \
                             {size} bytes"
                        ),
                    });
                }
                self.read_raw(w.base + offset, len)
                    .map(|b| WindowDone::Buffer(Tensor::from_vec(b)))
            }
            WindowOp::Free { window } => self
                .free_window(window as usize)
                .await
                .map(|()| WindowDone::Done),
        };
        r.map_err(|e| {
            let site = format!("{name}, window op");
            self.vendor_err(e, &site, |d| ctx.peer_failed(vec![], d))
        })
    }

    async fn create_window(&mut self, ctx: &OpCtx, size: usize) -> Result<WindowDone> {
        let (me, n) = (self.rank, ctx.size);
        // Every rank's size, over the control mesh (the header exchange
        // already checked that every rank creates a window now).
        let outgoing = (0..n)
            .filter(|&p| p != me)
            .map(|p| (p, ctx.seq, (size as u64).to_le_bytes().to_vec()))
            .collect();
        let received = Backend::exchange_headers(&mut self.ctrl, ctx, outgoing).await?;
        let mut sizes = vec![size; n];
        for (p, raw) in received {
            let got = <[u8; 8]>::try_from(raw.as_slice())
                .ok()
                .map(u64::from_le_bytes)
                .and_then(|s| usize::try_from(s).ok())
                .filter(|_| p < n)
                .ok_or_else(|| ctx.peer_failed(vec![p], "peer sent an undecodable window size"))?;
            sizes[p] = got;
        }
        let layout = Layout::new(&sizes).ok_or_else(|| Error::InvalidArgument {
            comm: ctx.comm.to_string(),
            rank: me,
            op: ctx.kind.name(),
            reason: format!("window sizes {sizes:?} overflow the address space"),
        })?;
        let w = match self.register(layout).await {
            Ok(w) => w,
            Err(e) => {
                let site = "new_window".to_string();
                return Err(self.vendor_err(e, &site, |d| ctx.peer_failed(vec![], d)));
            }
        };
        let id = self.windows.len() as u64;
        self.windows.push(Some(XcclWindow {
            win: w.0,
            base: w.1,
            layout,
            sent: vec![0; n],
            seen: vec![0; n],
            sizes: sizes.clone(),
        }));
        crate::debug::LIVE_WINDOWS.fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        tracing::debug!(comm = %ctx.comm, rank = me, id, size, len = layout.len, "nccl window registered");
        let access = (0..n)
            .map(|p| {
                if p == me {
                    WindowAccess::Unified
                } else {
                    WindowAccess::Separate
                }
            })
            .collect();
        Ok(WindowDone::Created(WindowInfo { id, sizes, access }))
    }

    /// Allocate, zero and register one buffer; on failure nothing stays
    /// allocated.
    async fn register(
        &mut self,
        layout: Layout,
    ) -> std::result::Result<(sys::ncclWindow_t, usize), CallError> {
        let n = &self.api.nccl;
        let (Some(alloc), Some(free), Some(reg)) =
            (n.mem_alloc, n.mem_free, n.comm_window_register)
        else {
            return Err(self.unsupported());
        };
        // Addresses as integers: raw pointers may not live across an await.
        let base = {
            let mut p: *mut c_void = std::ptr::null_mut();
            let _dev = DeviceGuard::set(&self.api.rt, self.device)?;
            // SAFETY: out-parameter call, device set.
            result::nccl(n, "ncclMemAlloc", unsafe { alloc(&mut p, layout.len) })?;
            p as usize
        };
        let device = self.device;
        let freed = |api: &super::Vendor| {
            let _dev = DeviceGuard::set(&api.rt, device);
            // SAFETY: allocated above, not registered, no work queued on it.
            let _ = unsafe { free(base as *mut c_void) };
        };
        let zeroed = {
            let rt = &self.api.rt;
            DeviceGuard::set(rt, self.device).and_then(|_dev| {
                // SAFETY: `len` bytes at `base`, device set.
                result::rt(rt, "MemsetAsync", unsafe {
                    (rt.memset_async)(base as *mut c_void, 0, layout.len, self.stream)
                })
            })
        };
        if let Err(e) = zeroed {
            freed(&self.api);
            return Err(e);
        }
        if let Err(e) = self.complete().await {
            freed(&self.api);
            return Err(e);
        }
        let registered = {
            let mut win: sys::ncclWindow_t = std::ptr::null_mut();
            let _dev = DeviceGuard::set(&self.api.rt, self.device)?;
            // SAFETY: live communicator, buffer of `len` bytes on its device.
            let r = unsafe {
                reg(
                    self.comm,
                    base as *mut c_void,
                    layout.len,
                    &mut win,
                    sys::NCCL_WIN_DEFAULT,
                )
            };
            result::nccl(&self.api.nccl, "ncclCommWindowRegister", r).map(|()| win as usize)
        };
        let settled = match registered {
            Ok(win) => self.settle("ncclCommWindowRegister").await.map(|()| win),
            Err(e) => Err(e),
        };
        match settled {
            Ok(win) => Ok((win as sys::ncclWindow_t, base)),
            Err(e) => {
                // The registration is collective: a failure breaks the
                // communicator, and its abort releases what NCCL holds.
                freed(&self.api);
                Err(e)
            }
        }
    }

    /// Wait until a non-blocking call on the communicator finished, within
    /// the connect timeout.
    async fn settle(&self, call: &'static str) -> std::result::Result<(), CallError> {
        let deadline = Instant::now() + self.finalize_timeout;
        if settle_new(&self.api, SendPtr(self.comm), deadline).await? {
            Ok(())
        } else {
            Err(CallError {
                call,
                code: 0,
                nccl: false,
                message: format!("did not finish within {:?}", self.finalize_timeout),
            })
        }
    }

    fn win(&self, id: usize) -> &XcclWindow {
        // Checked by `window_op` before any op runs.
        self.windows[id]
            .as_ref()
            .expect("window checked before the op")
    }

    fn win_mut(&mut self, id: usize) -> &mut XcclWindow {
        self.windows[id]
            .as_mut()
            .expect("window checked before the op")
    }

    /// Stage `bytes` on the device and put them into `dst`'s window (XW-2).
    async fn put(
        &mut self,
        id: usize,
        dst: usize,
        offset: usize,
        bytes: &[u8],
    ) -> std::result::Result<(), CallError> {
        if bytes.is_empty() {
            return Ok(());
        }
        let staging = self.ensure(0, bytes.len())? as usize;
        let (win, base) = (self.win(id).win, self.win(id).base);
        {
            let rt = &self.api.rt;
            let _dev = DeviceGuard::set(rt, self.device)?;
            // SAFETY: staging holds `len` bytes; H2D from pageable memory
            // returns once the host bytes were staged.
            unsafe {
                result::rt(
                    rt,
                    "MemcpyAsync(H2D)",
                    (rt.memcpy_async)(
                        staging as *mut c_void,
                        bytes.as_ptr().cast(),
                        bytes.len(),
                        sys::MEMCPY_H2D,
                        self.stream,
                    ),
                )?;
                if dst == self.rank {
                    result::rt(
                        rt,
                        "MemcpyAsync(D2D)",
                        (rt.memcpy_async)(
                            (base + offset) as *mut c_void,
                            staging as *const c_void,
                            bytes.len(),
                            MEMCPY_D2D,
                            self.stream,
                        ),
                    )?;
                } else {
                    self.put_signal(staging, bytes.len(), sys::NCCL_UINT8, dst, win, offset)?;
                }
            }
        }
        self.complete().await
    }

    /// # Safety
    /// `src` holds `count` elements of `dtype` on this communicator's device.
    unsafe fn put_signal(
        &self,
        src: usize,
        count: usize,
        dtype: sys::ncclDataType_t,
        dst: usize,
        win: sys::ncclWindow_t,
        offset: usize,
    ) -> std::result::Result<(), CallError> {
        let n = &self.api.nccl;
        let put = n.put_signal.ok_or_else(|| self.unsupported())?;
        result::nccl(
            n,
            "ncclPutSignal",
            put(
                src as *const c_void,
                count,
                dtype,
                dst as std::ffi::c_int,
                win,
                offset,
                0,
                0,
                0,
                self.comm,
                self.stream,
            ),
        )
    }

    /// Add `value` to this rank's total for `dst` and write the total into
    /// its slot in `dst`'s buffer (XW-2).
    async fn signal(
        &mut self,
        id: usize,
        dst: usize,
        value: u64,
    ) -> std::result::Result<(), CallError> {
        let staging = self.ensure(0, 8)? as usize;
        let me = self.rank;
        let (total, win, slot) = {
            let w = self.win_mut(id);
            w.sent[dst] = w.sent[dst].wrapping_add(value);
            (w.sent[dst], w.win, w.base + w.layout.slot(me))
        };
        let bytes = total.to_le_bytes();
        {
            let rt = &self.api.rt;
            let _dev = DeviceGuard::set(rt, self.device)?;
            let to = if dst == me { slot } else { staging };
            // SAFETY: 8 bytes at `to` (this rank's slot or the staging
            // buffer); pageable H2D returns once staged.
            unsafe {
                result::rt(
                    rt,
                    "MemcpyAsync(H2D)",
                    (rt.memcpy_async)(
                        to as *mut c_void,
                        bytes.as_ptr().cast(),
                        8,
                        sys::MEMCPY_H2D,
                        self.stream,
                    ),
                )?;
                if dst != me {
                    let at = self.win(id).layout.slot(me);
                    self.put_signal(staging, 1, sys::NCCL_UINT64, dst, win, at)?;
                }
            }
        }
        self.complete().await
    }

    /// Read `len` bytes at `at` of this rank's buffer into host memory,
    /// after everything queued on the stream.
    fn read_raw(&self, at: usize, len: usize) -> std::result::Result<Vec<u8>, CallError> {
        let mut out = vec![0u8; len];
        if len == 0 {
            return Ok(out);
        }
        let rt = &self.api.rt;
        let _dev = DeviceGuard::set(rt, self.device)?;
        // SAFETY: `len` bytes at `at` inside this rank's window buffer
        // (checked by the callers); synchronised before `out` is used.
        unsafe {
            result::rt(
                rt,
                "MemcpyAsync(D2H)",
                (rt.memcpy_async)(
                    out.as_mut_ptr().cast(),
                    at as *const c_void,
                    len,
                    sys::MEMCPY_D2H,
                    self.stream,
                ),
            )?;
            result::rt(
                rt,
                "StreamSynchronize",
                (rt.stream_synchronize)(self.stream),
            )?;
        }
        Ok(out)
    }

    fn read_slot(&self, id: usize, src: usize) -> std::result::Result<u64, CallError> {
        let w = self.win(id);
        let b = self.read_raw(w.base + w.layout.slot(src), 8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(&b);
        Ok(u64::from_le_bytes(a))
    }

    /// Consume `src`'s signal operations one at a time until its total
    /// reaches `value` (XW-2).
    async fn wait_signal(
        &mut self,
        id: usize,
        src: usize,
        value: u64,
    ) -> std::result::Result<(), CallError> {
        let wait = self
            .api
            .nccl
            .wait_signal
            .ok_or_else(|| self.unsupported())?;
        while self.win(id).seen[src] < value {
            {
                let _dev = DeviceGuard::set(&self.api.rt, self.device)?;
                let mut d = ncclWaitSignalDesc_t {
                    op_cnt: 1,
                    peer: src as std::ffi::c_int,
                    sig_idx: 0,
                    ctx: 0,
                };
                // SAFETY: one descriptor, live communicator and stream.
                let r = unsafe { wait(1, &mut d, self.comm, self.stream) };
                result::nccl(&self.api.nccl, "ncclWaitSignal", r)?;
            }
            self.complete().await?;
            let total = self.read_slot(id, src)?;
            let w = self.win_mut(id);
            w.seen[src] = w.seen[src].max(total);
        }
        Ok(())
    }

    /// `wait_signal` on this rank's own slot: only this rank writes it, so
    /// it is either reached already or never will be while this op waits.
    fn wait_own(&self, ctx: &OpCtx, id: usize, value: u64) -> Result<WindowDone> {
        let sent = self.win(id).sent[self.rank];
        if sent >= value {
            return Ok(WindowDone::Done);
        }
        Err(Error::InvalidArgument {
            comm: ctx.comm.to_string(),
            rank: ctx.rank,
            op: ctx.kind.name(),
            reason: format!(
                "this rank signalled itself {sent} in window {id}; waiting for {value} would \
                 never end, since no later op of this rank runs while it waits"
            ),
        })
    }

    /// Collective: deregister and free one window (XW-3).
    async fn free_window(&mut self, id: usize) -> std::result::Result<(), CallError> {
        let Some(w) = self.windows[id].take() else {
            return Ok(());
        };
        self.release_window(w, true).await
    }

    /// Deregister `w` (when `deregister` and the communicator is live),
    /// then free its memory once the stream drained (XW-3).
    async fn release_window(
        &mut self,
        mut w: XcclWindow,
        deregister: bool,
    ) -> std::result::Result<(), CallError> {
        let mut outcome = Ok(());
        if deregister && !w.win.is_null() && !self.comm.is_null() {
            if let Some(dereg) = self.api.nccl.comm_window_deregister {
                let r = {
                    let _dev = DeviceGuard::set(&self.api.rt, self.device)?;
                    // SAFETY: registered on this live communicator, no op in flight.
                    unsafe { dereg(self.comm, w.win) }
                };
                outcome = result::nccl(&self.api.nccl, "ncclCommWindowDeregister", r);
                if outcome.is_ok() {
                    outcome = self.settle("ncclCommWindowDeregister").await;
                }
            }
            w.win = std::ptr::null_mut();
        }
        self.free_memory(&w);
        outcome
    }

    /// Free a window's buffer after the stream drained.
    fn free_memory(&self, w: &XcclWindow) {
        let Some(free) = self.api.nccl.mem_free else {
            return;
        };
        let rt = &self.api.rt;
        let _dev = DeviceGuard::set(rt, self.device);
        // SAFETY: the buffer came from `ncclMemAlloc`; the stream is
        // synchronised first, so no queued work still touches it.
        unsafe {
            if !self.stream.is_null() {
                let _ = (rt.stream_synchronize)(self.stream);
            }
            let _ = free(w.base as *mut c_void);
        }
        crate::debug::LIVE_WINDOWS.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
    }

    /// Finalize: deregister and free every window while the communicator
    /// is still live (XW-3).
    pub(super) async fn deregister_windows(&mut self) {
        for i in 0..self.windows.len() {
            if let Some(w) = self.windows[i].take() {
                if let Err(e) = self.release_window(w, true).await {
                    tracing::warn!(comm = %self.comm_name, rank = self.rank, "{e}");
                }
            }
        }
    }

    /// After an abort (or on drop): free the memory of every window left;
    /// `ncclCommAbort` already released the registrations (XW-3).
    pub(super) fn free_windows(&mut self) {
        for i in 0..self.windows.len() {
            if let Some(w) = self.windows[i].take() {
                self.free_memory(&w);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layout_puts_slots_after_the_largest_window_and_aligns_the_buffer() {
        let l = Layout::new(&[10, 4096, 3]).expect("fits");
        assert_eq!(l.slots_at, 4096);
        assert_eq!(l.slot(0), 4096);
        assert_eq!(l.slot(2), 4096 + 16);
        assert_eq!(l.len, 8192);
        assert_eq!(l.len % sys::NCCL_WIN_REQUIRED_ALIGNMENT, 0);

        let l = Layout::new(&[13, 1]).expect("fits");
        assert_eq!(l.slots_at, 16);
        assert!(l.slot(1) + 8 <= l.len);
        assert_eq!(l.len, 4096);

        // Empty windows still get their slots.
        let l = Layout::new(&[0, 0, 0, 0]).expect("fits");
        assert_eq!((l.slots_at, l.len), (0, 4096));
    }

    #[test]
    fn layout_overflow_is_none() {
        assert_eq!(Layout::new(&[usize::MAX, 1]), None);
        assert_eq!(Layout::new(&[usize::MAX - 7, 1]), None);
    }

    #[test]
    fn every_slot_of_every_rank_fits_in_the_buffer() {
        for n in 1..9 {
            for size in [0usize, 1, 7, 8, 4095, 4096, 4097, 1 << 20] {
                let sizes: Vec<usize> = (0..n).map(|r| size + r * 3).collect();
                let l = Layout::new(&sizes).expect("fits");
                for (r, s) in sizes.iter().enumerate() {
                    assert!(*s <= l.slots_at, "window of rank {r} overlaps the slots");
                    assert!(l.slot(r) + 8 <= l.len);
                    assert_eq!(l.slot(r) % 8, 0);
                }
            }
        }
    }
}
