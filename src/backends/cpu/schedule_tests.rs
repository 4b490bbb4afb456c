//! Schedule tests: an in-memory executor for N ranks (quinn-proto `Pair`
//! style) with exactly the [SC-1]/[SC-2] semantics and rendezvous sends, and every
//! builder checked against a locally computed reference.
//!
//! Values are small integers stored in `f64`, so sums are exact whatever the
//! reduction order.
//!
//! [SC-1]: crate::backends::cpu::schedule#invariants
//! [SC-2]: crate::backends::cpu::schedule#invariants

use std::collections::HashMap;
use std::fmt::Write as _;

use proptest::prelude::*;

use super::*;
use crate::op::ReduceOp;

// ---------------------------------------------------------------------------
// Harness.

/// Where a transfer sits: (rank, step, index in step).
type Loc = (usize, usize, usize);

/// One matched send/receive pair ([SC-3]).
///
/// [SC-3]: crate::backends::cpu::schedule#invariants
struct Match {
    send: Loc,
    recv: Loc,
    done: bool,
    payload: Vec<f64>,
}

pub(crate) fn combine(op: ReduceOp, a: f64, b: f64) -> f64 {
    match op {
        ReduceOp::Sum => a + b,
        ReduceOp::Product => a * b,
        ReduceOp::Min => a.min(b),
        ReduceOp::Max => a.max(b),
        other => panic!("harness supports sum/product/min/max, not {other}"),
    }
}

fn buf_mut<'a>(src: &'a mut [f64], dst: &'a mut [f64], b: BufId) -> &'a mut [f64] {
    match b {
        BufId::Src => src,
        BufId::Dst => dst,
    }
}

/// Run one schedule per rank (`schedules[r]` for rank `r`) over per-rank
/// `src`/`dst` buffers and return every rank's `dst`.
///
/// - [SC-1]: a rank posts all transfers of its current step at once and moves
///   to the next step when all have completed.
/// - Rendezvous: a send and its receive complete together, only when both
///   ranks are at the steps that hold them.
/// - [SC-2]: the payload is captured when the pair completes (the sender has
///   not applied its step yet, so it reads pre-step data); receives and local
///   copies are applied when the receiving rank's step completes.
/// - [SC-3]: the k-th send from a to b matches the k-th receive at b from a;
///   an unmatched transfer or a length mismatch is an error.
/// - [SC-4]: if no rank can move and some are not finished, the run is a
///   deadlock and the error dumps every rank's pending transfers.
///
/// Each schedule is first checked with [`Schedule::validate`] (bounds, [SC-5],
/// [SC-6]); [`simulate`] alone runs any schedule with [SC-1]..[SC-4] semantics.
///
/// [SC-1]: crate::backends::cpu::schedule#invariants
/// [SC-2]: crate::backends::cpu::schedule#invariants
/// [SC-3]: crate::backends::cpu::schedule#invariants
/// [SC-4]: crate::backends::cpu::schedule#invariants
/// [SC-5]: crate::backends::cpu::schedule#invariants
/// [SC-6]: crate::backends::cpu::schedule#invariants
fn run_schedules(
    schedules: Vec<Schedule>,
    src: Vec<Vec<f64>>,
    dst: Vec<Vec<f64>>,
    op: ReduceOp,
) -> Result<Vec<Vec<f64>>, String> {
    let n = schedules.len();
    assert_eq!(src.len(), n);
    assert_eq!(dst.len(), n);
    for (r, s) in schedules.iter().enumerate() {
        s.validate(r, n, src[r].len(), dst[r].len())
            .map_err(|e| e.to_string())?;
    }
    simulate(schedules, src, dst, op)
}

/// The executor behind [`run_schedules`], without the [SC-5]/[SC-6] checks.
/// Ranges must be in bounds.
///
/// [SC-5]: crate::backends::cpu::schedule#invariants
/// [SC-6]: crate::backends::cpu::schedule#invariants
pub(crate) fn simulate(
    schedules: Vec<Schedule>,
    mut src: Vec<Vec<f64>>,
    mut dst: Vec<Vec<f64>>,
    op: ReduceOp,
) -> Result<Vec<Vec<f64>>, String> {
    let n = schedules.len();

    // SC-3: pair sends and receives per ordered pair, in order.
    let mut sends: HashMap<(usize, usize), Vec<Loc>> = HashMap::new();
    let mut recvs: HashMap<(usize, usize), Vec<Loc>> = HashMap::new();
    for (r, s) in schedules.iter().enumerate() {
        for (i, step) in s.steps.iter().enumerate() {
            for (j, t) in step.transfers.iter().enumerate() {
                match t {
                    Transfer::Send { peer, .. } => {
                        sends.entry((r, *peer)).or_default().push((r, i, j))
                    }
                    Transfer::Recv { peer, .. } => {
                        recvs.entry((*peer, r)).or_default().push((r, i, j))
                    }
                    Transfer::LocalCopy { .. } => {}
                }
            }
        }
    }
    let get = |l: Loc| &schedules[l.0].steps[l.1].transfers[l.2];
    let mut matches: Vec<Match> = Vec::new();
    let mut match_of: HashMap<Loc, usize> = HashMap::new();
    let mut pairs: Vec<(usize, usize)> = sends.keys().chain(recvs.keys()).copied().collect();
    pairs.sort();
    pairs.dedup();
    for pair in pairs {
        let (ss, rs) = (
            sends.get(&pair).cloned().unwrap_or_default(),
            recvs.get(&pair).cloned().unwrap_or_default(),
        );
        if ss.len() != rs.len() {
            return Err(format!(
                "SC-3: rank {} sends {} times to rank {}, which receives {} times from it",
                pair.0,
                ss.len(),
                pair.1,
                rs.len()
            ));
        }
        for (s, r) in ss.into_iter().zip(rs) {
            if get(s).len() != get(r).len() {
                return Err(format!(
                    "SC-3: {:?} at {s:?} matched with {:?} at {r:?}: lengths differ",
                    get(s),
                    get(r)
                ));
            }
            match_of.insert(s, matches.len());
            match_of.insert(r, matches.len());
            matches.push(Match {
                send: s,
                recv: r,
                done: false,
                payload: Vec::new(),
            });
        }
    }

    let mut cur = vec![0usize; n];
    loop {
        let mut progress = false;
        // Rendezvous: complete every pair whose both ends are posted.
        for m in matches.iter_mut().filter(|m| !m.done) {
            if cur[m.send.0] == m.send.1 && cur[m.recv.0] == m.recv.1 {
                if let Transfer::Send { buf, range, .. } = get(m.send) {
                    let r = m.send.0;
                    m.payload = buf_mut(&mut src[r], &mut dst[r], *buf)[range.clone()].to_vec();
                }
                m.done = true;
                progress = true;
            }
        }
        // SC-1/SC-2: finish every step whose transfers all completed.
        for r in 0..n {
            let Some(step) = schedules[r].steps.get(cur[r]) else {
                continue;
            };
            let complete = step.transfers.iter().enumerate().all(|(j, t)| {
                matches!(t, Transfer::LocalCopy { .. }) || matches[match_of[&(r, cur[r], j)]].done
            });
            if !complete {
                continue;
            }
            // Reads first (pre-step state), then writes.
            let mut writes: Vec<(BufId, Range<usize>, Vec<f64>, RecvAction)> = Vec::new();
            for (j, t) in step.transfers.iter().enumerate() {
                match t {
                    Transfer::Send { .. } => {}
                    Transfer::Recv {
                        buf, range, action, ..
                    } => {
                        let m = &matches[match_of[&(r, cur[r], j)]];
                        writes.push((*buf, range.clone(), m.payload.clone(), *action));
                    }
                    Transfer::LocalCopy { src: s, dst: d } => {
                        writes.push((
                            BufId::Dst,
                            d.clone(),
                            src[r][s.clone()].to_vec(),
                            RecvAction::Copy,
                        ));
                    }
                }
            }
            for (buf, range, data, action) in writes {
                let target = &mut buf_mut(&mut src[r], &mut dst[r], buf)[range];
                for (t, v) in target.iter_mut().zip(data) {
                    *t = match action {
                        RecvAction::Copy => v,
                        RecvAction::Reduce => combine(op, *t, v),
                    };
                }
            }
            cur[r] += 1;
            progress = true;
        }
        if (0..n).all(|r| cur[r] == schedules[r].steps.len()) {
            return Ok(dst);
        }
        if !progress {
            let mut dump = String::from("SC-4: deadlock (no rank can progress)\n");
            for r in 0..n {
                let total = schedules[r].steps.len();
                let _ = writeln!(dump, "rank {r}: step {}/{total}", cur[r]);
                if let Some(step) = schedules[r].steps.get(cur[r]) {
                    for (j, t) in step.transfers.iter().enumerate() {
                        let state = match match_of.get(&(r, cur[r], j)) {
                            Some(&m) => {
                                let m = &matches[m];
                                let other = if m.send.0 == r { m.recv } else { m.send };
                                format!(
                                    "waits for rank {} step {} (it is at step {})",
                                    other.0, other.1, cur[other.0]
                                )
                            }
                            None => "local".into(),
                        };
                        let _ = writeln!(dump, "    {t:?}: {state}");
                    }
                }
            }
            return Err(dump);
        }
    }
}

// ---------------------------------------------------------------------------
// Data and references.

/// Distinct small integers per (rank, index): exact in f64 under any sum order.
pub(crate) fn value(rank: usize, i: usize) -> f64 {
    ((rank * 7919 + i * 104_729) % 1009) as f64 - 500.0
}

pub(crate) fn data(rank: usize, len: usize) -> Vec<f64> {
    (0..len).map(|i| value(rank, i)).collect()
}

/// Filler for buffers whose content must be overwritten.
pub(crate) const JUNK: f64 = -1.0e9;

pub(crate) fn reduced(size: usize, len: usize, op: ReduceOp) -> Vec<f64> {
    (0..len)
        .map(|i| (1..size).fold(value(0, i), |acc, r| combine(op, acc, value(r, i))))
        .collect()
}

pub(crate) fn run(
    schedules: Vec<Schedule>,
    src: Vec<Vec<f64>>,
    dst: Vec<Vec<f64>>,
    op: ReduceOp,
) -> Vec<Vec<f64>> {
    let dump: Vec<String> = schedules
        .iter()
        .enumerate()
        .map(|(r, s)| format!("rank {r}: {s:?}"))
        .collect();
    match run_schedules(schedules, src, dst, op) {
        Ok(out) => out,
        Err(e) => panic!("{e}\nschedules:\n{}", dump.join("\n")),
    }
}

fn sizes_and_counts() -> Vec<(usize, usize)> {
    let mut v = Vec::new();
    for size in 1..=9usize {
        let mut counts = vec![0, 1, size - 1, size, 7, 1000 + (2 * size + 1)];
        counts.sort();
        counts.dedup();
        v.extend(counts.into_iter().map(|c| (size, c)));
    }
    v
}

/// Uneven per-rank block sizes, including zeros.
fn uneven_counts(size: usize, count: usize) -> Vec<usize> {
    (0..size)
        .map(|r| (count + r * 5) % (count + 3) * (r % 3 != 1) as usize)
        .collect()
}

// ---------------------------------------------------------------------------
// Checks, one per builder.

fn check_all_reduce(size: usize, count: usize, op: ReduceOp) {
    let scheds = (0..size).map(|r| all_reduce(r, size, count)).collect();
    let out = run(
        scheds,
        vec![vec![]; size],
        (0..size).map(|r| data(r, count)).collect(),
        op,
    );
    let want = reduced(size, count, op);
    for (r, got) in out.iter().enumerate() {
        assert_eq!(
            got, &want,
            "all_reduce rank {r} size {size} count {count} {op}"
        );
    }
}

fn check_reduce(size: usize, count: usize, root: usize, op: ReduceOp) {
    let scheds = (0..size).map(|r| reduce(r, size, count, root)).collect();
    let out = run(
        scheds,
        vec![vec![]; size],
        (0..size).map(|r| data(r, count)).collect(),
        op,
    );
    assert_eq!(
        out[root],
        reduced(size, count, op),
        "reduce size {size} count {count} root {root}"
    );
}

fn check_reduce_scatter(size: usize, counts: &[usize], op: ReduceOp) {
    let offs = offsets(counts);
    let total = offs[size];
    let scheds = (0..size).map(|r| reduce_scatter(r, size, counts)).collect();
    let out = run(
        scheds,
        vec![vec![]; size],
        (0..size).map(|r| data(r, total)).collect(),
        op,
    );
    let want = reduced(size, total, op);
    for (r, got) in out.iter().enumerate() {
        let b = offs[r]..offs[r + 1];
        assert_eq!(
            got[b.clone()],
            want[b],
            "reduce_scatter rank {r} counts {counts:?}"
        );
    }
}

fn check_all_gather(size: usize, counts: &[usize]) {
    let offs = offsets(counts);
    let total = offs[size];
    let scheds = (0..size).map(|r| all_gather(r, size, counts)).collect();
    let src: Vec<Vec<f64>> = (0..size).map(|r| data(r, counts[r])).collect();
    let want: Vec<f64> = src.concat();
    let out = run(scheds, src, vec![vec![JUNK; total]; size], ReduceOp::Sum);
    for (r, got) in out.iter().enumerate() {
        assert_eq!(got, &want, "all_gather rank {r} counts {counts:?}");
    }
}

fn check_all_gather_in_place(size: usize, counts: &[usize]) {
    let offs = offsets(counts);
    let total = offs[size];
    let scheds = (0..size)
        .map(|r| all_gather_in_place(r, size, counts))
        .collect();
    let blocks: Vec<Vec<f64>> = (0..size).map(|r| data(r, counts[r])).collect();
    let want: Vec<f64> = blocks.concat();
    // Each rank's output holds junk except its own block; there is no Src.
    let dst = (0..size)
        .map(|r| {
            let mut d = vec![JUNK; total];
            d[offs[r]..offs[r + 1]].copy_from_slice(&blocks[r]);
            d
        })
        .collect();
    let out = run(scheds, vec![vec![]; size], dst, ReduceOp::Sum);
    for (r, got) in out.iter().enumerate() {
        assert_eq!(got, &want, "all_gather_in_place rank {r} counts {counts:?}");
    }
}

/// A broadcast's buffers: the root's data on `root`, filler elsewhere.
pub(crate) fn broadcast_input(size: usize, count: usize, root: usize) -> Vec<Vec<f64>> {
    (0..size)
        .map(|r| {
            if r == root {
                data(r, count)
            } else {
                vec![JUNK; count]
            }
        })
        .collect()
}

fn check_broadcast(size: usize, count: usize, root: usize) {
    let scheds = (0..size).map(|r| broadcast(r, size, count, root)).collect();
    let dst = broadcast_input(size, count, root);
    let out = run(scheds, vec![vec![]; size], dst, ReduceOp::Sum);
    for (r, got) in out.iter().enumerate() {
        assert_eq!(
            got,
            &data(root, count),
            "broadcast rank {r} size {size} count {count} root {root}"
        );
    }
}

fn check_scatter(size: usize, count: usize, root: usize) {
    let scheds = (0..size).map(|r| scatter(r, size, count, root)).collect();
    let src = (0..size)
        .map(|r| {
            if r == root {
                data(r, size * count)
            } else {
                vec![]
            }
        })
        .collect();
    let out = run(scheds, src, vec![vec![JUNK; count]; size], ReduceOp::Sum);
    let all = data(root, size * count);
    for (r, got) in out.iter().enumerate() {
        assert_eq!(
            got[..],
            all[r * count..(r + 1) * count],
            "scatter rank {r} size {size} count {count} root {root}"
        );
    }
}

fn check_gather(size: usize, count: usize, root: usize) {
    let scheds = (0..size).map(|r| gather(r, size, count, root)).collect();
    let src: Vec<Vec<f64>> = (0..size).map(|r| data(r, count)).collect();
    let want = src.concat();
    let dst = (0..size)
        .map(|r| {
            if r == root {
                vec![JUNK; size * count]
            } else {
                vec![]
            }
        })
        .collect();
    let out = run(scheds, src, dst, ReduceOp::Sum);
    assert_eq!(
        out[root], want,
        "gather size {size} count {count} root {root}"
    );
}

/// `matrix[i][j]`: elements rank `i` sends to rank `j`.
fn check_all_to_all(matrix: &[Vec<usize>]) {
    let size = matrix.len();
    let recv: Vec<Vec<usize>> = (0..size)
        .map(|j| (0..size).map(|i| matrix[i][j]).collect())
        .collect();
    let scheds = (0..size)
        .map(|r| all_to_all(r, size, &matrix[r], &recv[r]))
        .collect();
    let src: Vec<Vec<f64>> = (0..size).map(|r| data(r, matrix[r].iter().sum())).collect();
    let dst = (0..size)
        .map(|r| vec![JUNK; recv[r].iter().sum()])
        .collect();
    let out = run(scheds, src.clone(), dst, ReduceOp::Sum);
    for (r, got) in out.iter().enumerate() {
        let want: Vec<f64> = (0..size)
            .flat_map(|i| {
                let so = offsets(&matrix[i]);
                src[i][so[r]..so[r + 1]].to_vec()
            })
            .collect();
        assert_eq!(got, &want, "all_to_all rank {r} matrix {matrix:?}");
    }
}

// ---------------------------------------------------------------------------
// Grid tests: sizes 1..=9 × counts {0, 1, size-1, size, 7, 1000+odd}.

#[test]
fn all_reduce_sum_max_min_match_reference_any_size_and_count() {
    for (size, count) in sizes_and_counts() {
        check_all_reduce(size, count, ReduceOp::Sum);
        check_all_reduce(size, count, ReduceOp::Max);
        check_all_reduce(size, count.min(20), ReduceOp::Min);
    }
}

#[test]
fn reduce_sum_lands_on_root_any_size_count_and_root() {
    for (size, count) in sizes_and_counts() {
        for root in 0..size {
            check_reduce(size, count, root, ReduceOp::Sum);
        }
        check_reduce(size, count, size - 1, ReduceOp::Max);
    }
}

#[test]
fn reduce_scatter_leaves_reduced_own_block_even_and_uneven_counts() {
    for (size, count) in sizes_and_counts() {
        check_reduce_scatter(size, &even_counts(count, size), ReduceOp::Sum);
        check_reduce_scatter(size, &vec![count; size], ReduceOp::Max);
        check_reduce_scatter(size, &uneven_counts(size, count), ReduceOp::Sum);
    }
}

#[test]
fn all_gather_concatenates_blocks_even_and_uneven_counts() {
    for (size, count) in sizes_and_counts() {
        check_all_gather(size, &vec![count; size]);
        check_all_gather(size, &uneven_counts(size, count));
    }
}

#[test]
fn all_gather_in_place_concatenates_blocks_without_a_source() {
    for (size, count) in sizes_and_counts() {
        check_all_gather_in_place(size, &vec![count; size]);
        check_all_gather_in_place(size, &uneven_counts(size, count));
    }
}

#[test]
fn broadcast_copies_root_data_to_every_rank_any_root() {
    for (size, count) in sizes_and_counts() {
        for root in 0..size {
            check_broadcast(size, count, root);
        }
    }
}

#[test]
fn scatter_and_gather_move_blocks_to_and_from_any_root() {
    for (size, count) in sizes_and_counts() {
        for root in 0..size {
            check_scatter(size, count, root);
            check_gather(size, count, root);
        }
    }
}

#[test]
fn all_to_all_delivers_every_block_uniform_and_uneven_counts() {
    for (size, count) in sizes_and_counts() {
        check_all_to_all(&vec![vec![count; size]; size]);
        let m: Vec<Vec<usize>> = (0..size).map(|i| uneven_counts(size, count + i)).collect();
        check_all_to_all(&m);
    }
}

// ---------------------------------------------------------------------------
// Structure.

#[test]
fn single_rank_schedules_are_empty_or_local_only() {
    for count in [0, 1, 5] {
        assert!(all_reduce(0, 1, count).is_empty());
        assert!(reduce(0, 1, count, 0).is_empty());
        assert!(reduce_scatter(0, 1, &[count]).is_empty());
        assert!(broadcast(0, 1, count, 0).is_empty());
        for s in [
            all_gather(0, 1, &[count]),
            scatter(0, 1, count, 0),
            gather(0, 1, count, 0),
            all_to_all(0, 1, &[count], &[count]),
        ] {
            assert!(
                s.transfers()
                    .all(|t| matches!(t, Transfer::LocalCopy { .. })),
                "{s:?}"
            );
            assert_eq!(s.steps.len(), usize::from(count > 0));
        }
    }
}

#[test]
fn invalid_arguments_give_empty_schedules_not_panics() {
    assert!(all_reduce(3, 3, 10).is_empty());
    assert!(all_reduce(0, 0, 10).is_empty());
    assert!(reduce(0, 3, 10, 3).is_empty());
    assert!(broadcast(0, 3, 10, 7).is_empty());
    assert!(scatter(0, 3, 10, 3).is_empty());
    assert!(gather(5, 3, 10, 0).is_empty());
    assert!(reduce_scatter(0, 3, &[1, 2]).is_empty());
    assert!(all_gather(0, 3, &[1, 2, 3, 4]).is_empty());
    assert!(all_to_all(0, 2, &[1, 2], &[1]).is_empty());
    // Absurd sizes still do not overflow or panic.
    assert!(!broadcast(0, usize::MAX, 1, 0).is_empty());
    let s = scatter(0, 3, usize::MAX / 2, 0);
    assert_eq!(s.steps.len(), 1);
}

#[test]
fn all_reduce_is_bandwidth_optimal_and_takes_two_p_minus_one_steps() {
    for size in 2..=9 {
        let count = 1000 * size;
        for r in 0..size {
            let s = all_reduce(r, size, count);
            assert_eq!(s.steps.len(), 2 * (size - 1));
            assert_eq!(s.elements_sent(), 2 * (size - 1) * count / size);
        }
    }
}

#[test]
fn broadcast_takes_ceil_log2_steps() {
    for size in 1..=33usize {
        let depth = (0..size)
            .map(|r| broadcast(r, size, 4, 0).steps.len())
            .max()
            .unwrap_or(0);
        let want = usize::BITS - (size - 1).leading_zeros();
        assert_eq!(depth, want as usize, "size {size}");
        // Every non-root rank receives exactly once.
        for r in 1..size {
            let recvs = broadcast(r, size, 4, 0)
                .transfers()
                .filter(|t| matches!(t, Transfer::Recv { .. }))
                .count();
            assert_eq!(recvs, 1);
        }
    }
}

#[test]
fn even_counts_partition_near_equally_and_offsets_are_prefix_sums() {
    assert_eq!(even_counts(10, 4), vec![3, 3, 2, 2]);
    assert_eq!(even_counts(0, 3), vec![0, 0, 0]);
    assert!(even_counts(5, 0).is_empty());
    assert_eq!(offsets(&[]), vec![0]);
    assert_eq!(offsets(&[2, 0, 3]), vec![0, 2, 2, 5]);
    assert_eq!(offsets(&[usize::MAX, 1]), vec![0, usize::MAX, usize::MAX]);
}

// ---------------------------------------------------------------------------
// The harness itself catches broken schedules.

fn send(peer: usize, range: Range<usize>) -> Transfer {
    Transfer::Send {
        peer,
        buf: BufId::Dst,
        range,
    }
}

fn recv(peer: usize, range: Range<usize>) -> Transfer {
    Transfer::Recv {
        peer,
        buf: BufId::Dst,
        range,
        action: RecvAction::Copy,
    }
}

fn sched(steps: Vec<Vec<Transfer>>) -> Schedule {
    Schedule {
        steps: steps
            .into_iter()
            .map(|transfers| Step { transfers })
            .collect(),
    }
}

#[test]
fn harness_reports_rendezvous_deadlock_with_a_dump() {
    // Both ranks send first, then receive: fine with buffering, deadlock under
    // rendezvous semantics (SC-4).
    let a = sched(vec![vec![send(1, 0..2)], vec![recv(1, 0..2)]]);
    let b = sched(vec![vec![send(0, 0..2)], vec![recv(0, 0..2)]]);
    let err = run_schedules(
        vec![a, b],
        vec![vec![]; 2],
        vec![vec![0.0; 2]; 2],
        ReduceOp::Sum,
    )
    .unwrap_err();
    assert!(
        err.contains("deadlock") && err.contains("rank 1: step 0/2"),
        "{err}"
    );
}

#[test]
fn harness_reports_length_mismatch_and_unmatched_transfers() {
    let a = sched(vec![vec![send(1, 0..2)]]);
    let b = sched(vec![vec![recv(0, 0..1)]]);
    let err = run_schedules(
        vec![a.clone(), b],
        vec![vec![]; 2],
        vec![vec![0.0; 2]; 2],
        ReduceOp::Sum,
    )
    .unwrap_err();
    assert!(err.contains("lengths differ"), "{err}");
    let err = run_schedules(
        vec![a, Schedule::default()],
        vec![vec![]; 2],
        vec![vec![0.0; 2]; 2],
        ReduceOp::Sum,
    )
    .unwrap_err();
    assert!(err.contains("receives 0 times"), "{err}");
}

#[test]
fn harness_sends_read_pre_step_data_sc2() {
    // A swap in one step: each rank sends its value and overwrites it with the
    // peer's. Correct only if sends read the pre-step value.
    let a = sched(vec![vec![send(1, 0..1), recv(1, 0..1)]]);
    let b = sched(vec![vec![recv(0, 0..1), send(0, 0..1)]]);
    let out = simulate(
        vec![a, b],
        vec![vec![]; 2],
        vec![vec![1.0], vec![2.0]],
        ReduceOp::Sum,
    )
    .unwrap();
    assert_eq!(out, vec![vec![2.0], vec![1.0]]);
}

#[test]
fn validate_rejects_out_of_bounds_self_peer_and_overlapping_writes() {
    let bad = sched(vec![vec![send(0, 0..1)]]);
    assert!(bad.validate(0, 2, 0, 4).is_err(), "send to self");
    let bad = sched(vec![vec![send(1, 0..5)]]);
    assert!(bad.validate(0, 2, 0, 4).is_err(), "out of bounds");
    let bad = sched(vec![vec![
        recv(1, 0..3),
        Transfer::LocalCopy {
            src: 0..2,
            dst: 2..4,
        },
    ]]);
    assert!(bad.validate(0, 2, 2, 4).is_err(), "overlapping writes");
    let bad = sched(vec![vec![send(1, 2..2)]]);
    assert!(bad.validate(0, 2, 0, 4).is_err(), "zero length");
    let ok = sched(vec![vec![
        recv(1, 0..2),
        Transfer::LocalCopy {
            src: 0..2,
            dst: 2..4,
        },
    ]]);
    assert!(ok.validate(0, 2, 2, 4).is_ok());
    // SC-6: a receive may not overwrite what a send of the same step reads
    // (sends to 1 read 4..8, receive writes 6..7) ...
    let bad = sched(vec![vec![send(1, 4..8), recv(1, 6..7)]]);
    let err = bad.validate(0, 2, 0, 8).unwrap_err().to_string();
    assert!(err.contains("overlaps read"), "{err}");
    // ... but adjacent ranges, or the same range in another buffer, are fine.
    let ok = sched(vec![vec![
        send(1, 4..8),
        recv(1, 8..9),
        recv(1, 0..4),
        Transfer::Send {
            peer: 1,
            buf: BufId::Src,
            range: 8..9,
        },
    ]]);
    assert!(ok.validate(0, 2, 9, 9).is_ok());
}

#[test]
fn all_reduce_gives_bitwise_identical_results_on_every_rank() {
    // Inexact fractions: each block is reduced once and then copied, so the
    // summation order may differ between blocks but never between ranks.
    for size in [3usize, 5, 8] {
        let count = 101;
        let dst: Vec<Vec<f64>> = (0..size)
            .map(|r| {
                (0..count)
                    .map(|i| 1.0 / (1.0 + (r * 31 + i) as f64))
                    .collect()
            })
            .collect();
        let scheds = (0..size).map(|r| all_reduce(r, size, count)).collect();
        let out = run(scheds, vec![vec![]; size], dst, ReduceOp::Sum);
        for r in 1..size {
            let same = out[r]
                .iter()
                .zip(&out[0])
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "rank {r} differs from rank 0 (size {size})");
        }
    }
}

// ---------------------------------------------------------------------------
// Properties over random sizes, counts and roots.

fn size_counts() -> impl Strategy<Value = (usize, Vec<usize>, usize)> {
    (1usize..=9).prop_flat_map(|size| {
        (
            Just(size),
            proptest::collection::vec(prop_oneof![Just(0usize), 0usize..40], size),
            0..size,
        )
    })
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 64, ..ProptestConfig::default() })]

    #[test]
    fn rooted_and_rootless_collectives_match_reference_random_size_count_root(
        (size, counts, root) in size_counts()
    ) {
        let count = counts.iter().sum::<usize>();
        check_all_reduce(size, count, ReduceOp::Sum);
        check_reduce(size, count, root, ReduceOp::Sum);
        check_broadcast(size, count, root);
        check_scatter(size, counts[0], root);
        check_gather(size, counts[0], root);
    }

    #[test]
    fn reduce_scatter_and_all_gather_match_reference_random_counts(
        (size, counts, _root) in size_counts()
    ) {
        check_reduce_scatter(size, &counts, ReduceOp::Sum);
        check_all_gather(size, &counts);
    }

    #[test]
    fn all_to_all_matches_reference_random_count_matrix(
        matrix in (1usize..=9).prop_flat_map(|size| {
            proptest::collection::vec(proptest::collection::vec(0usize..12, size), size)
        })
    ) {
        check_all_to_all(&matrix);
    }
}

#[test]
fn all_reduce_small_matches_reference_and_is_bitwise_equal_on_every_rank() {
    for size in 1usize..=17 {
        for count in [0usize, 1, 3, 64] {
            for op in [ReduceOp::Sum, ReduceOp::Max] {
                let scheds: Vec<Schedule> = (0..size)
                    .map(|r| all_reduce_small(r, size, count))
                    .collect();
                let floor_log = (usize::BITS - 1 - size.leading_zeros()) as usize;
                let fold = if size.is_power_of_two() { 0 } else { 2 };
                let longest = scheds.iter().map(|s| s.steps.len()).max().unwrap_or(0);
                assert_eq!(
                    longest,
                    if count == 0 { 0 } else { floor_log + fold },
                    "size {size}"
                );
                let out = simulate(
                    scheds,
                    vec![vec![]; size],
                    (0..size).map(|r| data(r, count)).collect(),
                    op,
                )
                .unwrap();
                let want = reduced(size, count, op);
                for (r, o) in out.iter().enumerate() {
                    assert_eq!(o.len(), count);
                    for (a, b) in o.iter().zip(&want) {
                        assert!((a - b).abs() <= 1e-9 * b.abs().max(1.0), "rank {r}");
                    }
                    assert_eq!(o, &out[0], "rank {r} differs from rank 0");
                }
            }
        }
    }
}

#[test]
fn all_reduce_auto_picks_doubling_then_halving_then_the_ring() {
    assert_eq!(all_reduce_auto(0, 4, 2, 4), all_reduce_small(0, 4, 2));
    assert_eq!(all_reduce_auto(0, 3, 2, 4), all_reduce_small(0, 3, 2));
    let medium = SMALL_ALL_REDUCE_BYTES / 4 + 1;
    assert_eq!(
        all_reduce_auto(1, 4, medium, 4),
        all_reduce_halving(1, 4, medium)
    );
    assert_eq!(all_reduce_auto(1, 2, medium, 4), all_reduce(1, 2, medium));
    // The ring once its blocks reach RING_MIN_BLOCK_BYTES.
    let large = 4 * RING_MIN_BLOCK_BYTES / 4;
    assert_eq!(all_reduce_auto(1, 4, large, 4), all_reduce(1, 4, large));
    assert_eq!(
        all_reduce_auto(1, 4, large - 1, 4),
        all_reduce_halving(1, 4, large - 1)
    );
    assert_eq!(all_reduce_auto(0, 1, 2, 4), all_reduce(0, 1, 2));
}

#[test]
fn all_reduce_halving_matches_reference_is_bitwise_equal_and_takes_2_log_steps() {
    for size in tree_sizes() {
        for count in [0usize, 1, 3, 10, 1000 + 2 * size + 1] {
            for op in [ReduceOp::Sum, ReduceOp::Max] {
                let scheds: Vec<Schedule> = (0..size)
                    .map(|r| all_reduce_halving(r, size, count))
                    .collect();
                let q_log = (usize::BITS - 1 - size.leading_zeros()) as usize;
                let fold = if size.is_power_of_two() { 0 } else { 2 };
                let longest = scheds.iter().map(|s| s.steps.len()).max().unwrap_or(0);
                assert!(longest <= 2 * q_log + fold, "size {size}: {longest} steps");
                let out = run(
                    scheds,
                    vec![vec![]; size],
                    (0..size).map(|r| data(r, count)).collect(),
                    op,
                );
                let want = reduced(size, count, op);
                for (r, o) in out.iter().enumerate() {
                    assert_eq!(o, &want, "size {size} count {count} rank {r} {op}");
                }
            }
        }
    }
}

/// Sizes for the tree and doubling schedules: every size up to 9, then
/// powers of two and their neighbours.
fn tree_sizes() -> Vec<usize> {
    let mut v: Vec<usize> = (1..=9).collect();
    v.extend([15, 16, 17, 31, 32, 33]);
    v
}

#[test]
fn tree_reduce_gather_and_scatter_match_reference_any_size_root_and_count() {
    for size in tree_sizes() {
        let roots: Vec<usize> = if size <= 9 {
            (0..size).collect()
        } else {
            vec![0, 1, size / 2, size - 1]
        };
        for root in roots {
            for count in [0usize, 1, 3, 10] {
                // Reduce: Dst of every rank in, the reduction on root out.
                let scheds = (0..size)
                    .map(|r| reduce_tree(r, size, count, root))
                    .collect();
                let out = run(
                    scheds,
                    vec![vec![]; size],
                    (0..size).map(|r| data(r, count)).collect(),
                    ReduceOp::Sum,
                );
                assert_eq!(
                    out[root],
                    reduced(size, count, ReduceOp::Sum),
                    "reduce {size} {root}"
                );

                // Gather: non-roots' Dst is their scratch.
                let scheds = (0..size)
                    .map(|r| gather_tree(r, size, count, root))
                    .collect();
                let src: Vec<Vec<f64>> = (0..size).map(|r| data(r, count)).collect();
                let dst = (0..size)
                    .map(|r| {
                        let n = if r == root {
                            size * count
                        } else {
                            tree_scratch(r, size, count, root)
                        };
                        vec![JUNK; n]
                    })
                    .collect();
                let out = run(scheds, src.clone(), dst, ReduceOp::Sum);
                assert_eq!(out[root], src.concat(), "gather {size} {root} {count}");

                // Scatter: non-roots' Src is their scratch.
                let all = data(root, size * count);
                let scheds = (0..size)
                    .map(|r| scatter_tree(r, size, count, root))
                    .collect();
                let src = (0..size)
                    .map(|r| {
                        if r == root {
                            all.clone()
                        } else {
                            vec![JUNK; tree_scratch(r, size, count, root)]
                        }
                    })
                    .collect();
                let out = run(scheds, src, vec![vec![JUNK; count]; size], ReduceOp::Sum);
                for (r, got) in out.iter().enumerate() {
                    assert_eq!(
                        got[..],
                        all[r * count..(r + 1) * count],
                        "scatter {size} {root} rank {r}"
                    );
                }
            }
        }
    }
}

#[test]
fn trees_take_ceil_log2_steps_and_send_once_per_rank() {
    for size in tree_sizes() {
        let log = size.next_power_of_two().trailing_zeros() as usize;
        for root in [0, size - 1] {
            for (name, build) in [
                (
                    "reduce",
                    reduce_tree as fn(usize, usize, usize, usize) -> Schedule,
                ),
                ("gather", gather_tree),
                ("scatter", scatter_tree),
            ] {
                let scheds: Vec<Schedule> = (0..size).map(|r| build(r, size, 4, root)).collect();
                let steps = scheds.iter().map(|s| s.steps.len()).max().unwrap_or(0);
                assert!(steps <= log.max(1), "{name} size {size}: {steps} steps");
                // Every non-root rank talks to its parent once (twice when its
                // subtree wraps), so O(p) messages in all.
                let msgs: usize = scheds
                    .iter()
                    .map(|s| {
                        s.transfers()
                            .filter(|t| matches!(t, Transfer::Send { .. }))
                            .count()
                    })
                    .sum();
                assert!(
                    msgs <= 2 * (size - 1),
                    "{name} size {size}: {msgs} messages"
                );
            }
        }
    }
}

#[test]
fn all_gather_doubling_concatenates_blocks_in_log2_steps() {
    for size in tree_sizes() {
        for count in [0usize, 1, 7] {
            for counts in [vec![count; size], uneven_counts(size, count + 2)] {
                let offs = offsets(&counts);
                let total = offs[size];
                let blocks: Vec<Vec<f64>> = (0..size).map(|r| data(r, counts[r])).collect();
                let want = blocks.concat();
                let scheds: Vec<Schedule> = (0..size)
                    .map(|r| all_gather_doubling(r, size, &counts, false))
                    .collect();
                if size.is_power_of_two() && total > 0 {
                    let steps = scheds.iter().map(|s| s.steps.len()).max().unwrap_or(0);
                    assert!(
                        steps <= (size.trailing_zeros() as usize).max(1),
                        "size {size}"
                    );
                }
                let out = run(
                    scheds,
                    blocks.clone(),
                    vec![vec![JUNK; total]; size],
                    ReduceOp::Sum,
                );
                for (r, got) in out.iter().enumerate() {
                    assert_eq!(got, &want, "all_gather_doubling rank {r} counts {counts:?}");
                }
                let scheds = (0..size)
                    .map(|r| all_gather_doubling(r, size, &counts, true))
                    .collect();
                let dst = (0..size)
                    .map(|r| {
                        let mut d = vec![JUNK; total];
                        d[offs[r]..offs[r + 1]].copy_from_slice(&blocks[r]);
                        d
                    })
                    .collect();
                let out = run(scheds, vec![vec![]; size], dst, ReduceOp::Sum);
                for (r, got) in out.iter().enumerate() {
                    assert_eq!(got, &want, "in place rank {r} counts {counts:?}");
                }
            }
        }
    }
}

#[test]
fn the_tuning_table_picks_trees_and_doubling_for_small_messages_only() {
    assert!(rooted_tree(Rooted::Reduce, 8, 3));
    assert!(!rooted_tree(Rooted::Reduce, 8, 2));
    assert!(!rooted_tree(Rooted::Reduce, TREE_MAX_BYTES + 1, 8));
    assert!(!rooted_tree(Rooted::GatherOrScatter, 8, 8));
    assert!(rooted_tree(
        Rooted::GatherOrScatter,
        8,
        GATHER_TREE_MIN_RANKS
    ));
    assert_eq!(
        all_gather_auto(0, 4, &[1; 4], false, 4),
        all_gather_doubling(0, 4, &[1; 4], false)
    );
    assert_eq!(
        all_gather_auto(0, 3, &[1; 3], true, 4),
        all_gather_in_place(0, 3, &[1; 3])
    );
    let big = SMALL_ALL_GATHER_BYTES / 16 + 1;
    assert_eq!(
        all_gather_auto(2, 4, &[big; 4], false, 4),
        all_gather(2, 4, &[big; 4])
    );
}

/// The scale bound of the small-message algorithms, at the size of a large
/// job: on 4 096 ranks an 8 B all_reduce, a broadcast, a reduce, a gather, a
/// scatter and a barrier each send O(N log N) messages in all (the old
/// direct and linear algorithms sent N(N-1), or N-1 from one rank), no rank
/// sends more than O(log N) of them, and the all_reduce, reduce, gather and
/// scatter results are right on every rank.
#[test]
fn small_ops_on_4096_ranks_send_o_n_log_n_messages_and_are_right() {
    const N: usize = 4096;
    let log = N.trailing_zeros() as usize;
    let count_sends = |scheds: &[Schedule]| -> (usize, usize) {
        let per: Vec<usize> = scheds
            .iter()
            .map(|s| {
                s.transfers()
                    .filter(|t| matches!(t, Transfer::Send { .. }))
                    .count()
            })
            .collect();
        (per.iter().sum(), per.iter().copied().max().unwrap_or(0))
    };
    // all_reduce of one f64.
    let scheds: Vec<Schedule> = (0..N).map(|r| all_reduce_auto(r, N, 1, 8)).collect();
    let (total, most) = count_sends(&scheds);
    assert!(
        total <= N * log && most <= log,
        "all_reduce: {total} messages, {most} at most"
    );
    let out = simulate(
        scheds,
        vec![vec![]; N],
        (0..N).map(|r| data(r, 1)).collect(),
        ReduceOp::Sum,
    )
    .unwrap();
    let want = reduced(N, 1, ReduceOp::Sum);
    assert!(out.iter().all(|o| o == &want));

    // The cpu backend opens a link when a schedule first names its peer, so
    // a rank's links after a barrier, an 8 B and a 1 MiB all_reduce are the
    // distinct peers of those schedules: O(log N), not N - 1.
    let most_links = (0..N)
        .map(|r| {
            let mut peers: std::collections::BTreeSet<usize> = [
                all_reduce_auto(r, N, 1, 8),
                all_reduce_auto(r, N, 1 << 17, 8),
            ]
            .iter()
            .flat_map(|s| s.transfers().filter_map(Transfer::peer).collect::<Vec<_>>())
            .collect();
            peers.extend(barrier_rounds(r, N).into_iter().flat_map(|(a, b)| [a, b]));
            peers.len()
        })
        .max()
        .unwrap_or(0);
    assert!(
        most_links <= 3 * log,
        "{most_links} links on one rank after three small ops on {N} ranks"
    );

    let root = 1234;
    let scheds: Vec<Schedule> = (0..N).map(|r| reduce_tree(r, N, 1, root)).collect();
    let (total, most) = count_sends(&scheds);
    assert!(total < N && most <= 1, "reduce: {total} messages");
    let out = run(
        scheds,
        vec![vec![]; N],
        (0..N).map(|r| data(r, 1)).collect(),
        ReduceOp::Sum,
    );
    assert_eq!(out[root], want);

    let scheds: Vec<Schedule> = (0..N).map(|r| gather_tree(r, N, 1, root)).collect();
    let (total, most) = count_sends(&scheds);
    assert!(total < 2 * N && most <= 2, "gather: {total} messages");
    let src: Vec<Vec<f64>> = (0..N).map(|r| data(r, 1)).collect();
    let dst = (0..N)
        .map(|r| {
            vec![
                JUNK;
                if r == root {
                    N
                } else {
                    tree_scratch(r, N, 1, root)
                }
            ]
        })
        .collect();
    let out = run(scheds, src.clone(), dst, ReduceOp::Sum);
    assert_eq!(out[root], src.concat());

    let scheds: Vec<Schedule> = (0..N).map(|r| scatter_tree(r, N, 1, root)).collect();
    let (total, most) = count_sends(&scheds);
    assert!(
        total < 2 * N && most <= 2 * log,
        "scatter: {total} messages, {most} at most"
    );

    let scheds: Vec<Schedule> = (0..N).map(|r| broadcast(r, N, 1, root)).collect();
    let (total, most) = count_sends(&scheds);
    assert!(
        total < N && most <= log,
        "broadcast: {total} messages, {most} at most"
    );

    let rounds: usize = (0..N).map(|r| barrier_rounds(r, N).len()).sum();
    assert_eq!(rounds, N * log);
}

/// Every round of the dissemination barrier pairs up: what rank `r` sends
/// in round `k` is what its target waits for in that round, and every rank
/// has heard from every other one, transitively, by the last round.
#[test]
fn barrier_rounds_pair_up_and_reach_every_rank() {
    for size in 1..=33 {
        let rounds: Vec<Vec<(usize, usize)>> = (0..size).map(|r| barrier_rounds(r, size)).collect();
        let k = rounds[0].len();
        assert_eq!(k, (size as f64).log2().ceil() as usize, "size {size}");
        // heard[r] = the ranks whose arrival r has learned of.
        let mut heard: Vec<Vec<bool>> = (0..size)
            .map(|r| (0..size).map(|q| q == r).collect())
            .collect();
        for round in 0..k {
            let before = heard.clone();
            for (r, (mine, h)) in rounds.iter().zip(heard.iter_mut()).enumerate() {
                let (to, from) = mine[round];
                assert_eq!(rounds[to][round].1, r, "size {size} round {round}");
                assert_ne!(from, r);
                for (q, b) in h.iter_mut().enumerate() {
                    *b |= before[from][q];
                }
            }
        }
        assert!(heard.iter().all(|h| h.iter().all(|&b| b)), "size {size}");
    }
}
