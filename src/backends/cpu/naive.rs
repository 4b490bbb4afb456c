//! TEMPORARY: direct (one-step, pairwise) schedules with the signatures of the
//! builders in `schedule.rs`, so the executor can be tested before the real
//! algorithms land. Replaced by `schedule::*` when the `sched` branch merges.

use super::schedule::{BufId, RecvAction, Schedule, Step, Transfer};

pub(crate) fn offsets(counts: &[usize]) -> Vec<usize> {
    let mut o = vec![0];
    for c in counts {
        o.push(o[o.len() - 1] + c);
    }
    o
}

fn one(transfers: Vec<Transfer>) -> Schedule {
    Schedule {
        steps: vec![Step { transfers }],
    }
}

fn send(peer: usize, buf: BufId, a: usize, b: usize) -> Transfer {
    Transfer::Send {
        peer,
        buf,
        range: a..b,
    }
}

fn recv(peer: usize, buf: BufId, a: usize, b: usize, action: RecvAction) -> Transfer {
    Transfer::Recv {
        peer,
        buf,
        range: a..b,
        action,
    }
}

pub(crate) fn all_reduce(rank: usize, size: usize, count: usize) -> Schedule {
    let mut t = Vec::new();
    for p in (0..size).filter(|&p| p != rank) {
        t.push(send(p, BufId::Dst, 0, count));
        t.push(recv(p, BufId::Dst, 0, count, RecvAction::Reduce));
    }
    one(t)
}

pub(crate) fn reduce(rank: usize, size: usize, count: usize, root: usize) -> Schedule {
    let mut t = Vec::new();
    if rank == root {
        for p in (0..size).filter(|&p| p != rank) {
            t.push(recv(p, BufId::Dst, 0, count, RecvAction::Reduce));
        }
    } else {
        t.push(send(root, BufId::Dst, 0, count));
    }
    one(t)
}

pub(crate) fn reduce_scatter(rank: usize, size: usize, counts: &[usize]) -> Schedule {
    let o = offsets(counts);
    let mut t = Vec::new();
    for p in (0..size).filter(|&p| p != rank) {
        t.push(send(p, BufId::Dst, o[p], o[p + 1]));
        t.push(recv(
            p,
            BufId::Dst,
            o[rank],
            o[rank + 1],
            RecvAction::Reduce,
        ));
    }
    one(t)
}

pub(crate) fn all_gather(rank: usize, size: usize, counts: &[usize]) -> Schedule {
    let o = offsets(counts);
    let mut t = vec![Transfer::LocalCopy {
        src: 0..counts[rank],
        dst: o[rank]..o[rank + 1],
    }];
    for p in (0..size).filter(|&p| p != rank) {
        t.push(send(p, BufId::Src, 0, counts[rank]));
        t.push(recv(p, BufId::Dst, o[p], o[p + 1], RecvAction::Copy));
    }
    one(t)
}

pub(crate) fn broadcast(rank: usize, size: usize, count: usize, root: usize) -> Schedule {
    let mut t = Vec::new();
    if rank == root {
        for p in (0..size).filter(|&p| p != rank) {
            t.push(send(p, BufId::Dst, 0, count));
        }
    } else {
        t.push(recv(root, BufId::Dst, 0, count, RecvAction::Copy));
    }
    one(t)
}

pub(crate) fn scatter(rank: usize, size: usize, count: usize, root: usize) -> Schedule {
    let mut t = Vec::new();
    if rank == root {
        for p in 0..size {
            if p == rank {
                t.push(Transfer::LocalCopy {
                    src: p * count..(p + 1) * count,
                    dst: 0..count,
                });
            } else {
                t.push(send(p, BufId::Src, p * count, (p + 1) * count));
            }
        }
    } else {
        t.push(recv(root, BufId::Dst, 0, count, RecvAction::Copy));
    }
    one(t)
}

pub(crate) fn gather(rank: usize, size: usize, count: usize, root: usize) -> Schedule {
    let mut t = Vec::new();
    if rank == root {
        for p in 0..size {
            if p == rank {
                t.push(Transfer::LocalCopy {
                    src: 0..count,
                    dst: p * count..(p + 1) * count,
                });
            } else {
                t.push(recv(
                    p,
                    BufId::Dst,
                    p * count,
                    (p + 1) * count,
                    RecvAction::Copy,
                ));
            }
        }
    } else {
        t.push(send(root, BufId::Src, 0, count));
    }
    one(t)
}

pub(crate) fn all_to_all(
    rank: usize,
    size: usize,
    send_counts: &[usize],
    recv_counts: &[usize],
) -> Schedule {
    let so = offsets(send_counts);
    let ro = offsets(recv_counts);
    let mut t = vec![Transfer::LocalCopy {
        src: so[rank]..so[rank + 1],
        dst: ro[rank]..ro[rank + 1],
    }];
    for p in (0..size).filter(|&p| p != rank) {
        t.push(send(p, BufId::Src, so[p], so[p + 1]));
        t.push(recv(p, BufId::Dst, ro[p], ro[p + 1], RecvAction::Copy));
    }
    one(t)
}
