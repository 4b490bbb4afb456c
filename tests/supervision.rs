//! SV-1: a child never outlives its parent, and nothing of a communicator
//! (actor, backend links, watchdog task, socket) outlives its abort.
//!
//! Alone in its test binary so that no other test's communicators disturb
//! the process-wide counts.

mod common;

use chorus::{debug, Error};
use common::run_ranks;

/// TCP and UDP sockets open in this process (Linux; 0 elsewhere). Unix
/// sockets are left out: runtimes create some lazily, once per process.
fn open_sockets() -> usize {
    let mut inet = std::collections::HashSet::new();
    for table in ["tcp", "tcp6", "udp", "udp6"] {
        let text = std::fs::read_to_string(format!("/proc/self/net/{table}")).unwrap_or_default();
        for line in text.lines().skip(1) {
            if let Some(inode) = line.split_whitespace().nth(9) {
                if inode != "0" {
                    inet.insert(inode.to_string());
                }
            }
        }
    }
    std::fs::read_dir("/proc/self/fd")
        .map(|d| {
            d.filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
                .filter_map(|l| {
                    let l = l.to_string_lossy().to_string();
                    Some(l.strip_prefix("socket:[")?.strip_suffix(']')?.to_string())
                })
                .filter(|inode| inet.contains(inode))
                .count()
        })
        .unwrap_or(0)
}

#[test]
fn sv1_parent_abort_stops_children_and_leaves_no_actor_backend_watchdog_or_socket() {
    let (a0, b0, w0, s0) = (
        debug::live_actors(),
        debug::live_backends(),
        debug::live_watchdogs(),
        open_sockets(),
    );
    run_ranks(2, "sv1", |comm| {
        let child = comm.split(&[0, 1], "kid").unwrap().expect("member");
        let grandchild = child.split(&[0, 1], "grandkid").unwrap().expect("member");
        child.barrier().unwrap();
        comm.barrier().unwrap();
        assert!(open_sockets() > 0, "the links are counted while alive");
        comm.abort();
        assert!(!child.is_active(), "parent abort aborts the child");
        assert!(!grandchild.is_active(), "and the grandchild");
        let e = child.barrier().unwrap_err();
        assert!(matches!(e, Error::Aborted { .. }), "{e}");
    });
    // Every handle is dropped: nothing of the 6 communicators survives.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
    let now = || {
        (
            debug::live_actors(),
            debug::live_backends(),
            debug::live_watchdogs(),
            open_sockets(),
        )
    };
    while now() != (a0, b0, w0, s0) {
        assert!(
            std::time::Instant::now() < deadline,
            "leaked (actors, backends, watchdogs, sockets): {:?}, was {:?}",
            now(),
            (a0, b0, w0, s0)
        );
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(a0 + b0 + w0 == 0, "the test starts from a clean process");
}
