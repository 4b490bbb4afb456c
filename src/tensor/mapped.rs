//! Large host tensors in a mapping of their own, backed by huge pages where
//! the kernel allows.
//!
//! A tensor of at least [`HUGE_MIN`] bytes does not come from the global
//! allocator: glibc serves such sizes with a fresh `mmap` every time (its
//! threshold for reusing freed memory rises only to the size last freed, so
//! the next request of that size maps again), and a fresh mapping takes a
//! page fault for every 4 KiB page the first time it is touched. On the
//! 2-CPU virtual machine of docs/performance.md that is about 1.25 µs per
//! page, 640 µs for a 2 MiB buffer: more than moving its bytes. Here the
//! mapping is aligned to 2 MiB and marked `MADV_HUGEPAGE`, so with
//! transparent huge pages in `madvise` or `always` mode each 2 MiB of it
//! takes one fault (about 100 µs there, the kernel zeroing the page).
//! With huge pages off (`never`) the mapping behaves as glibc's would.
//!
//! `CHORUS_HUGE_PAGES=0` turns this off (tensors then come from the global
//! allocator at every size), for a host where the kernel's compaction for
//! huge pages (the `defrag` setting) stalls.
//!
//! # Invariants
//! - HP-1: a [`Mapped`] region is page-aligned (so 8-byte aligned, T-1),
//!   zeroed, readable and writable for its whole length, and unmapped once,
//!   when it is dropped.
//! - HP-2: a mapping that fails (no memory, an address-space limit) gives
//!   `None`, never an abort (T-3).

use std::ptr::NonNull;

/// The size of a transparent huge page on x86-64 and of the alignment the
/// mappings get (also the usual size on aarch64 with 4 KiB pages).
const HUGE_PAGE: usize = 2 << 20;

/// Host tensors of at least this many bytes get a mapping of their own.
pub const HUGE_MIN: usize = HUGE_PAGE;

/// Whether large tensors get their own mapping: not when
/// `CHORUS_HUGE_PAGES=0`. Read once.
pub(super) fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("CHORUS_HUGE_PAGES").map_or(true, |v| v.trim() != "0"))
}

/// An anonymous, zeroed, private mapping of `len` bytes (rounded up to the
/// page size), starting on a [`HUGE_PAGE`] boundary (HP-1).
#[derive(Debug)]
pub(super) struct Mapped {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: the mapping is owned by this value alone (nothing else holds its
// address), like a `Vec`'s buffer: moving it to another thread moves that
// ownership, and shared references only read.
unsafe impl Send for Mapped {}
// SAFETY: as `Send`; `&Mapped` hands out only shared views.
unsafe impl Sync for Mapped {}

impl Mapped {
    /// A zeroed mapping of at least `bytes` bytes, or `None` when the
    /// kernel refuses it (HP-2).
    pub(super) fn zeroed(bytes: usize) -> Option<Mapped> {
        let page = page_size();
        let len = bytes.checked_next_multiple_of(page)?.max(page);
        // Room to slide the start to a huge-page boundary.
        let span = len.checked_add(HUGE_PAGE)?;
        // SAFETY: a fresh anonymous private mapping at an address of the
        // kernel's choice; no existing memory is touched.
        let base = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                span,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        if base == libc::MAP_FAILED {
            return None;
        }
        let base = base as usize;
        let start = base.next_multiple_of(HUGE_PAGE);
        let (head, tail) = (start - base, base + span - (start + len));
        // SAFETY: `[base, start)` and `[start + len, base + span)` lie in
        // the mapping just made and are not used; unmapping them leaves
        // exactly `[start, start + len)`. A failure leaves them mapped,
        // unused, until the process exits: never unsound.
        unsafe {
            if head > 0 {
                libc::munmap(base as *mut libc::c_void, head);
            }
            if tail > 0 {
                libc::munmap((start + len) as *mut libc::c_void, tail);
            }
            // Advice only: refused where transparent huge pages are
            // unsupported, and then the small pages serve as before.
            libc::madvise(start as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
        Some(Mapped {
            ptr: NonNull::new(start as *mut u8)?,
            len,
        })
    }

    /// The whole mapping.
    pub(super) fn bytes(&self) -> &[u8] {
        // SAFETY: HP-1: `len` readable, zero-initialised or since written
        // bytes, owned by `self`; `&self` rules out a `&mut` view.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The whole mapping, mutably.
    pub(super) fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as `bytes`, with exclusive access through `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

impl Drop for Mapped {
    fn drop(&mut self) {
        // SAFETY: HP-1: the mapping made in `zeroed`, unmapped only here.
        // An error (never expected for a valid mapping) is ignored: `drop`
        // must not panic.
        unsafe {
            libc::munmap(self.ptr.as_ptr().cast(), self.len);
        }
    }
}

/// The kernel's page size (4 KiB when it cannot be read).
fn page_size() -> usize {
    // SAFETY: sysconf reads a constant of the system.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    usize::try_from(p).ok().filter(|p| *p > 0).unwrap_or(4096)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// HP-1: aligned, zeroed, writable for its length, rounded up to pages.
    #[test]
    fn a_mapping_is_aligned_zeroed_and_writable() {
        for bytes in [HUGE_MIN, HUGE_MIN + 1, 3 * HUGE_MIN + 12_345] {
            let mut m = Mapped::zeroed(bytes).expect("mapping");
            assert_eq!(m.ptr.as_ptr() as usize % HUGE_PAGE, 0);
            assert!(m.len >= bytes && m.len % page_size() == 0);
            assert!(m.bytes().iter().all(|b| *b == 0));
            m.bytes_mut().fill(7);
            assert!(m.bytes().iter().all(|b| *b == 7));
        }
    }

    /// HP-2: a size the address space cannot hold gives `None`.
    #[test]
    fn an_impossible_size_is_none() {
        assert!(Mapped::zeroed(usize::MAX - 4096).is_none());
        assert!(Mapped::zeroed(1 << 62).is_none());
    }
}
