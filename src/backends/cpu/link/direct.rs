//! Reading a link's socket from a blocked caller's own thread, without the
//! async runtime's reactor in between (the TCP latency path).
//!
//! A link's receiving half normally waits for data through tokio: the
//! reactor thread sees the socket become readable in `epoll_wait`, wakes
//! the task, and the thread that runs the op is woken in turn: two
//! wake-ups and a thread hop per message. A caller that blocks on its op
//! can instead wait in `ppoll(2)` on the socket itself ([`wait_readable`]),
//! so the kernel wakes it directly when the message arrives, and then read
//! the socket itself ([`DirectRead`] in direct mode), since tokio only
//! tries a read once its reactor has said the socket is readable.
//!
//! # Invariants
//! - DR-1: in direct mode a read tries only the socket, with a
//!   non-blocking `recv`, and registers no waker: direct mode is on only
//!   while the latency path polls (its [`Switch`]), which polls again
//!   itself. Otherwise a read goes through tokio, which registers the
//!   task's waker. Bytes are never read twice or skipped: both paths read
//!   the same socket in order, under the one `&mut` of the reader.
//! - DR-2: [`wait_readable`] blocks the calling thread for at most its
//!   timeout, and only the caller of a blocking op calls it (a thread that
//!   is not a runtime worker), so no task of the runtime is held up.
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

use std::io;
use std::os::fd::{AsRawFd, RawFd};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, ReadBuf};
use tokio::net::tcp::OwnedReadHalf;

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

/// A link's read half that, in direct mode, reads the socket itself
/// instead of asking tokio (DR-1). O(1).
#[derive(Debug)]
pub(crate) struct DirectRead {
    inner: OwnedReadHalf,
    fd: RawFd,
    mode: Switch,
}

impl DirectRead {
    /// Wrap `inner`, with direct mode off.
    pub(crate) fn new(inner: OwnedReadHalf) -> DirectRead {
        let fd = inner.as_ref().as_raw_fd();
        DirectRead {
            inner,
            fd,
            mode: Switch::default(),
        }
    }

    /// The socket's file descriptor (to wait on with [`wait_readable`]).
    pub(crate) fn fd(&self) -> RawFd {
        self.fd
    }

    /// The switch of this reader's direct mode (off until turned on).
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
                    return Poll::Ready(Ok(()));
                }
                let e = io::Error::last_os_error();
                match e.kind() {
                    io::ErrorKind::Interrupted => continue,
                    // DR-1: the latency path polls again itself.
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

/// Block the calling thread until one of `fds` is readable (or closed, or
/// in error), or `timeout` passes (DR-2); with a zero `timeout`, only
/// look. Whether one is. O(`fds`). Looking takes no socket lock, unlike
/// a `recv`, so polling this way does not slow the peer's sends into the
/// socket.
pub(crate) fn wait_readable(fds: &[RawFd], timeout: Duration) -> bool {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
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
        assert!(wait_readable(&[r.fd()], Duration::from_secs(5)));
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
        assert!(!wait_readable(&[r.fd()], Duration::from_millis(50)));
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

    /// `wait_readable` returns when data arrives, and after its timeout
    /// when none does; with no timeout it only looks.
    #[tokio::test]
    async fn wait_readable_wakes_on_data_and_times_out_without() {
        let (a, b) = pair().await;
        let (r, _w) = b.into_split();
        let r = DirectRead::new(r);
        let t = Instant::now();
        assert!(!wait_readable(&[r.fd()], Duration::from_millis(20)));
        assert!(t.elapsed() >= Duration::from_millis(20));
        assert!(!wait_readable(&[r.fd()], Duration::ZERO));
        let (_ra, mut wa) = a.into_split();
        wa.write_all(b"x").await.expect("write");
        let t = Instant::now();
        assert!(wait_readable(&[r.fd()], Duration::from_secs(10)));
        assert!(t.elapsed() < Duration::from_secs(5));
        assert!(wait_readable(&[r.fd()], Duration::ZERO));
    }
}
