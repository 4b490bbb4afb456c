//! Reading and writing a link's socket from a blocked caller's own thread,
//! without the async runtime's reactor in between (the TCP direct path).
//!
//! A link's halves normally wait through tokio: the reactor thread sees the
//! socket become readable (or writable) in `epoll_wait`, wakes the task,
//! and the thread that runs the op is woken in turn: two wake-ups and a
//! thread hop each time the socket runs dry or its send buffer fills. A
//! caller that blocks on its op can instead wait in `ppoll(2)` on the
//! sockets itself ([`wait_ready`]), so the kernel wakes it directly, and
//! then read and write the sockets itself ([`DirectRead`], [`DirectWrite`]
//! in direct mode), since tokio only tries a socket call once its reactor
//! has said the socket is ready.
//!
//! # Invariants
//! - DR-1: in direct mode a read or write tries only the socket, with a
//!   non-blocking `recv` or `send`, and registers no waker: direct mode is
//!   on only while the direct path polls (its [`Switch`]), which polls
//!   again itself. Otherwise a read or write goes through tokio, which
//!   registers the task's waker. Bytes are never read or written twice or
//!   skipped: both paths use the same socket in order, under the one
//!   `&mut` of the half.
//! - DR-2: [`wait_ready`] blocks the calling thread for at most its
//!   timeout, and only the caller of a blocking op calls it (a thread that
//!   may block), so no task of the runtime is held up.
//! - DR-3: while a caller polls sockets itself it may make them quiet
//!   (`SO_RCVLOWAT` raised, so `epoll` does not report them and the
//!   reactor is not woken for each message it reads itself); a socket is
//!   made readable again before anything waits on it: before a `ppoll`
//!   sleep, and by any read through the reactor. A quiet socket still
//!   reports a closed connection. Nothing else waits on a link's socket.
//!   (Linux caps the raised mark at half of `tcp_rmem`'s maximum and
//!   grows the socket's receive buffer to hold it, up to that maximum,
//!   where autotuning may take it anyway; putting the mark back leaves the
//!   buffer so.)
//! - DR-4: every byte a direct read or write moves is counted on the
//!   calling thread ([`moved`]), so the direct path can tell a pass that
//!   moved bytes from one that only found its sockets not ready.

use std::cell::Cell;
use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};

thread_local! {
    /// Bytes moved by direct reads and writes on this thread (DR-4).
    static MOVED: Cell<u64> = const { Cell::new(0) };
}

/// Bytes this thread's direct reads and writes have moved so far (DR-4);
/// only differences between two calls mean anything.
pub(crate) fn moved() -> u64 {
    MOVED.with(Cell::get)
}

fn count_moved(n: usize) {
    MOVED.with(|m| m.set(m.get().wrapping_add(n as u64)));
}

/// A reader's mode, set from outside the future that holds the reader.
#[derive(Debug, Default)]
pub(crate) struct Mode {
    /// Reads go straight to the socket (DR-1).
    direct: AtomicBool,
    /// The socket does not report itself readable (DR-3).
    quiet: AtomicBool,
}

/// The handle on a reader's [`Mode`].
pub(crate) type Switch = Arc<Mode>;

impl Mode {
    /// Turn direct mode on or off (DR-1).
    pub(crate) fn set_direct(&self, on: bool) {
        self.direct.store(on, Ordering::Relaxed);
    }

    /// Quiet the socket `fd` (DR-3): from now until [`Mode::wake`] (or the
    /// next read through the reactor), a message arriving on it does not
    /// wake the runtime's reactor; a non-blocking `recv` still gets it.
    pub(crate) fn quiet(&self, fd: RawFd) {
        if !self.quiet.swap(true, Ordering::Relaxed) {
            set_rcvlowat(fd, i32::MAX);
        }
    }

    /// Undo [`Mode::quiet`], so that `epoll` and `ppoll` see the socket
    /// readable again (DR-3).
    pub(crate) fn wake(&self, fd: RawFd) {
        if self.quiet.swap(false, Ordering::Relaxed) {
            set_rcvlowat(fd, 1);
        }
    }
}

/// A link's socket half that, in direct mode, reads or writes the socket
/// itself instead of asking tokio (DR-1): [`DirectRead`] and
/// [`DirectWrite`]. O(1).
#[derive(Debug)]
pub(crate) struct Direct<H> {
    inner: H,
    fd: RawFd,
    mode: Switch,
}

/// A link's read half with a direct mode (DR-1).
pub(crate) type DirectRead = Direct<OwnedReadHalf>;
/// A link's write half with a direct mode (DR-1).
pub(crate) type DirectWrite = Direct<OwnedWriteHalf>;

impl<H: AsRef<tokio::net::TcpStream>> Direct<H> {
    /// Wrap `inner`, with direct mode off.
    pub(crate) fn new(inner: H) -> Direct<H> {
        let fd = inner.as_ref().as_raw_fd();
        Direct {
            inner,
            fd,
            mode: Switch::default(),
        }
    }

    /// The socket's file descriptor (to wait on with [`wait_ready`]).
    pub(crate) fn fd(&self) -> RawFd {
        self.fd
    }

    /// The switch of this half's direct mode (off until turned on).
    pub(crate) fn switch(&self) -> Switch {
        self.mode.clone()
    }
}

impl AsyncRead for DirectRead {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        if self.mode.direct.load(Ordering::Relaxed) {
            if buf.remaining() == 0 {
                return Poll::Ready(Ok(()));
            }
            loop {
                // SAFETY: `unfilled_mut` is valid for writes of its length;
                // `recv` writes at most that many bytes, and exactly the
                // `n` it returns are then marked initialized and filled.
                let n = unsafe {
                    let spare = buf.unfilled_mut();
                    libc::recv(
                        self.fd,
                        spare.as_mut_ptr().cast(),
                        spare.len(),
                        libc::MSG_DONTWAIT,
                    )
                };
                if n >= 0 {
                    let n = n as usize;
                    // SAFETY: `recv` initialized the first `n` bytes.
                    unsafe { buf.assume_init(n) };
                    buf.advance(n);
                    count_moved(n);
                    return Poll::Ready(Ok(()));
                }
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::Interrupted => continue,
                    // DR-1: the direct path polls again itself.
                    io::ErrorKind::WouldBlock => return Poll::Pending,
                    _ => return Poll::Ready(Err(e)),
                }
            }
        }
        // DR-3: the reactor must see this socket again before it waits.
        self.mode.wake(self.fd);
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl DirectWrite {
    /// One non-blocking `sendmsg` of `bufs` (DR-1); `None` when the socket
    /// cannot take a byte now.
    fn send_now(&self, bufs: &[io::IoSlice<'_>]) -> Option<io::Result<usize>> {
        loop {
            // SAFETY: `IoSlice` is ABI-compatible with `iovec` and every
            // slice outlives the call; the message header is zeroed (no
            // address, no control data) apart from the vector.
            let n = unsafe {
                let mut msg: libc::msghdr = std::mem::zeroed();
                msg.msg_iov = bufs.as_ptr() as *mut libc::iovec;
                msg.msg_iovlen = bufs.len() as _;
                libc::sendmsg(self.fd, &msg, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
            };
            if n >= 0 {
                let n = n as usize;
                count_moved(n);
                return Some(Ok(n));
            }
            let e = io::Error::last_os_error();
            match e.kind() {
                io::ErrorKind::Interrupted => continue,
                io::ErrorKind::WouldBlock => return None,
                _ => return Some(Err(e)),
            }
        }
    }
}

impl AsyncWrite for DirectWrite {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if self.mode.direct.load(Ordering::Relaxed) {
            if buf.is_empty() {
                return Poll::Ready(Ok(0));
            }
            // DR-1: the direct path polls again itself.
            return self
                .send_now(&[io::IoSlice::new(buf)])
                .map_or(Poll::Pending, Poll::Ready);
        }
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        if self.mode.direct.load(Ordering::Relaxed) {
            if bufs.iter().all(|b| b.is_empty()) {
                return Poll::Ready(Ok(0));
            }
            return self.send_now(bufs).map_or(Poll::Pending, Poll::Ready);
        }
        Pin::new(&mut self.inner).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        true
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

fn set_rcvlowat(fd: RawFd, v: i32) {
    // SAFETY: `v` is a valid c_int for the duration of the call; a failure
    // (a closed socket) only leaves the option as it was.
    unsafe {
        libc::setsockopt(
            fd,
            libc::SOL_SOCKET,
            libc::SO_RCVLOWAT,
            (&v as *const i32).cast(),
            std::mem::size_of::<i32>() as libc::socklen_t,
        );
    }
}

/// Block the calling thread until one of `read` is readable or one of
/// `write` writable (or either closed, or in error), or `timeout` passes
/// (DR-2); with a zero `timeout`, only look. Whether one is. O(sockets).
/// Looking takes no socket lock, unlike a `recv`, so polling this way does
/// not slow the peer's sends into the socket.
pub(crate) fn wait_ready(read: &[RawFd], write: &[RawFd], timeout: Duration) -> bool {
    let want = |fds: &[RawFd], events| {
        fds.iter()
            .map(move |&fd| libc::pollfd {
                fd,
                events,
                revents: 0,
            })
            .collect::<Vec<_>>()
    };
    let mut pfds = want(read, libc::POLLIN);
    pfds.extend(want(write, libc::POLLOUT));
    let ts = libc::timespec {
        tv_sec: timeout.as_secs() as libc::time_t,
        tv_nsec: timeout.subsec_nanos() as libc::c_long,
    };
    // SAFETY: `pfds` is a valid array of `pfds.len()` pollfd structures and
    // `ts` a valid timespec; a null signal mask leaves the mask unchanged.
    let n = unsafe {
        libc::ppoll(
            pfds.as_mut_ptr(),
            pfds.len() as libc::nfds_t,
            &ts,
            std::ptr::null(),
        )
    };
    n > 0
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    async fn pair() -> (tokio::net::TcpStream, tokio::net::TcpStream) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind");
        let a = tokio::net::TcpStream::connect(l.local_addr().expect("addr"))
            .await
            .expect("connect");
        let (b, _) = l.accept().await.expect("accept");
        (a, b)
    }

    /// Bytes arrive in order whether a read goes through the socket or
    /// through tokio, in direct mode a read finds data the reactor has not
    /// reported, and with direct mode off again a read waits through the
    /// reactor.
    #[tokio::test]
    async fn direct_and_reactor_reads_share_one_ordered_stream() {
        let (a, b) = pair().await;
        let (r, _w) = b.into_split();
        let mut r = DirectRead::new(r);
        let (_ra, mut wa) = a.into_split();
        wa.write_all(b"hello").await.expect("write");
        // Wait in the kernel, as a blocked caller does, then read directly.
        assert!(wait_ready(&[r.fd()], &[], Duration::from_secs(5)));
        let switch = r.switch();
        switch.set_direct(true);
        // Quiet: no longer reported readable, still read directly.
        switch.quiet(r.fd());
        let mut got = [0u8; 5];
        r.read_exact(&mut got).await.expect("direct read");
        assert_eq!(&got, b"hello");
        // Direct mode with nothing to read is pending.
        let mut one = [0u8; 1];
        assert!(futures::FutureExt::now_or_never(r.read(&mut one)).is_none());
        wa.write_all(b"?").await.expect("write");
        assert!(!wait_ready(&[r.fd()], &[], Duration::from_millis(50)));
        r.read_exact(&mut one)
            .await
            .expect("direct read of a quiet socket");
        assert_eq!(one[0], b'?');
        // With direct mode off, a read wakes the socket and waits through
        // the reactor.
        switch.set_direct(false);
        let reader = tokio::spawn(async move {
            let mut one = [0u8; 1];
            r.read_exact(&mut one).await.map(|_| one[0])
        });
        tokio::task::yield_now().await;
        wa.write_all(b"!").await.expect("write");
        assert_eq!(reader.await.expect("join").expect("read"), b'!');
    }

    /// `wait_ready` returns when data arrives, and after its timeout
    /// when none does; with no timeout it only looks.
    #[tokio::test]
    async fn wait_ready_wakes_on_data_and_times_out_without() {
        let (a, b) = pair().await;
        let (r, _w) = b.into_split();
        let r = DirectRead::new(r);
        let t = Instant::now();
        assert!(!wait_ready(&[r.fd()], &[], Duration::from_millis(20)));
        assert!(t.elapsed() >= Duration::from_millis(20));
        assert!(!wait_ready(&[r.fd()], &[], Duration::ZERO));
        let (_ra, mut wa) = a.into_split();
        wa.write_all(b"x").await.expect("write");
        let t = Instant::now();
        assert!(wait_ready(&[r.fd()], &[], Duration::from_secs(10)));
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(wait_ready(&[r.fd()], &[], Duration::ZERO));
    }

    /// A direct write fills the socket without waiting, is pending (with
    /// no waker) once the send buffer is full, counts what it moved, and
    /// the bytes arrive in order with the ones written through tokio;
    /// `wait_ready` reports the socket writable again once the peer reads.
    #[tokio::test]
    async fn direct_writes_fill_the_socket_and_wait_ready_sees_it_drain() {
        let (a, b) = pair().await;
        let (_ra, wa) = a.into_split();
        let mut w = DirectWrite::new(wa);
        let (rb, _wb) = b.into_split();
        let mut rb = DirectRead::new(rb);
        w.write_all(b"via tokio;").await.expect("write");
        let switch = w.switch();
        switch.set_direct(true);
        let chunk = vec![7u8; 64 << 10];
        let before = moved();
        let mut sent = 0usize;
        // Fill the send and receive buffers: a direct write never waits.
        loop {
            match futures::FutureExt::now_or_never(w.write(&chunk)) {
                Some(Ok(n)) => sent += n,
                Some(Err(e)) => panic!("direct write failed: {e}"),
                None => break,
            }
            assert!(sent < 1 << 30, "the socket never filled");
        }
        assert!(sent > 0);
        assert_eq!(moved().wrapping_sub(before), sent as u64);
        assert!(!wait_ready(&[], &[w.fd()], Duration::ZERO));
        // The reader drains everything; then the socket is writable again.
        let mut head = [0u8; 10];
        rb.read_exact(&mut head).await.expect("read");
        assert_eq!(&head, b"via tokio;");
        let mut rest = vec![0u8; sent];
        rb.read_exact(&mut rest).await.expect("read");
        assert!(rest.iter().all(|&b| b == 7));
        assert!(wait_ready(&[], &[w.fd()], Duration::from_secs(10)));
        switch.set_direct(false);
        w.write_all(b"!").await.expect("write through tokio");
        let mut one = [0u8; 1];
        rb.read_exact(&mut one).await.expect("read");
        assert_eq!(one[0], b'!');
    }
}
