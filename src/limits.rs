//! Process resource limits Chorus depends on: the open-file limit, which
//! bounds how many links a rank can hold (a few descriptors per peer: a
//! link, ring mappings, the listener), and socket buffer sizes, which the
//! kernel bounds per socket. A leaf module: it uses nothing of the crate,
//! so any layer may ask it.

use std::os::fd::AsRawFd;

/// This process's open-file limit, `(soft, hard)`; `None` if it cannot
/// be read.
pub(crate) fn fd_limit() -> Option<(u64, u64)> {
    let mut l = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes the struct it is given.
    let r = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut l) };
    // `rlim_t` is not `u64` on every target.
    #[allow(clippy::unnecessary_cast)]
    let limits = (l.rlim_cur as u64, l.rlim_max as u64);
    (r == 0).then_some(limits)
}

/// Raise this process's soft open-file limit to its hard limit, once per
/// process; returns the soft limit in force afterwards. Every rank holds a
/// few descriptors per peer (a link, a listener, ring mappings), and the
/// soft limit many systems start processes with (1 024) runs out long
/// before the hard one, as MPI implementations and Go's runtime also
/// assume. A limit that cannot be raised is left as it is (logged).
pub(crate) fn raise_fd_limit() -> Option<u64> {
    static RAISED: std::sync::OnceLock<Option<u64>> = std::sync::OnceLock::new();
    *RAISED.get_or_init(|| {
        let (soft, hard) = fd_limit()?;
        if soft >= hard {
            return Some(soft);
        }
        let want = libc::rlimit {
            rlim_cur: hard as libc::rlim_t,
            rlim_max: hard as libc::rlim_t,
        };
        // SAFETY: setrlimit reads the struct it is given.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &want) } == 0 {
            tracing::debug!(from = soft, to = hard, "raised the open-file limit");
            Some(hard)
        } else {
            tracing::debug!(
                soft,
                hard,
                error = %std::io::Error::last_os_error(),
                "could not raise the open-file limit"
            );
            Some(soft)
        }
    })
}

/// Ask for `bytes` of receive and send buffer on `socket` (the kernel caps
/// each at `net.core.rmem_max` / `wmem_max` and doubles what it grants for
/// its own bookkeeping). Returns the sizes in force afterwards, `(receive,
/// send)`, as the kernel reports them; `None` where they cannot be read.
/// Failures leave the socket as it was.
pub(crate) fn grow_socket_buffers(socket: &impl AsRawFd, bytes: usize) -> Option<(usize, usize)> {
    let fd = socket.as_raw_fd();
    let want = libc::c_int::try_from(bytes).unwrap_or(libc::c_int::MAX);
    for opt in [libc::SO_RCVBUF, libc::SO_SNDBUF] {
        // SAFETY: setsockopt reads `size_of::<c_int>()` bytes of `want`,
        // which lives for the call; `fd` is a socket the caller owns.
        let r = unsafe {
            libc::setsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                std::ptr::addr_of!(want).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            )
        };
        if r != 0 {
            tracing::debug!(opt, error = %std::io::Error::last_os_error(), "could not set a socket buffer size");
        }
    }
    let get = |opt| {
        let mut v: libc::c_int = 0;
        let mut len = std::mem::size_of::<libc::c_int>() as libc::socklen_t;
        // SAFETY: getsockopt writes at most `len` bytes into `v`.
        let r = unsafe {
            libc::getsockopt(
                fd,
                libc::SOL_SOCKET,
                opt,
                std::ptr::addr_of_mut!(v).cast(),
                &mut len,
            )
        };
        (r == 0).then(|| usize::try_from(v).unwrap_or(0))
    };
    Some((get(libc::SO_RCVBUF)?, get(libc::SO_SNDBUF)?))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A socket asked for 8 MiB gets more than the kernel's default, up to
    /// what `net.core.rmem_max` allows (doubled, as Linux reports it).
    #[test]
    fn socket_buffers_grow_to_what_the_kernel_allows() {
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").expect("bind");
        let (rcv, snd) = grow_socket_buffers(&socket, 8 << 20).expect("read");
        let max = std::fs::read_to_string("/proc/sys/net/core/rmem_max")
            .ok()
            .and_then(|s| s.trim().parse::<usize>().ok());
        if let Some(max) = max {
            assert_eq!(rcv, 2 * max.min(8 << 20), "receive buffer");
        }
        assert!(rcv > 0 && snd > 0);
    }

    #[test]
    fn the_soft_open_file_limit_is_raised_to_the_hard_one() {
        let (_, hard) = fd_limit().expect("getrlimit");
        let soft = raise_fd_limit().expect("a limit");
        assert_eq!(fd_limit().map(|(s, _)| s), Some(soft));
        // Raising is allowed for any process (up to the hard limit).
        assert_eq!(soft, hard);
    }
}
