//! Process resource limits Chorus depends on: the open-file limit, which
//! bounds how many links a rank can hold (a few descriptors per peer: a
//! link, ring mappings, the listener). A leaf module: it uses nothing of
//! the crate, so any layer may ask it.

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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_soft_open_file_limit_is_raised_to_the_hard_one() {
        let (_, hard) = fd_limit().expect("getrlimit");
        let soft = raise_fd_limit().expect("a limit");
        assert_eq!(fd_limit().map(|(s, _)| s), Some(soft));
        // Raising is allowed for any process (up to the hard limit).
        assert_eq!(soft, hard);
    }
}
