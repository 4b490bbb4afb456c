//! The pure step planner: turns one [`Step`] of a [`Schedule`](super::schedule::Schedule)
//! into byte-range [`Item`]s checked against the op's buffers, and decides
//! which receives may land in place; plus the buffer carving that lets
//! in-place receives and sends share one buffer without aliasing.
//!
//! No I/O and no dtype: the executor in the parent module runs the items.

use std::ops::Range;

use super::schedule::{BufId, RecvAction, Step, Transfer};

/// One transfer of a step, in bytes, with its receive strategy decided.
#[derive(Debug)]
pub(super) enum Item {
    Send {
        peer: usize,
        buf: BufId,
        bytes: Range<usize>,
    },
    Recv {
        peer: usize,
        buf: BufId,
        bytes: Range<usize>,
        action: RecvAction,
        /// Received straight into the buffer: a `Copy` whose range no other
        /// transfer of the step reads or writes (what [SC-6] promises for the
        /// built schedules; checked here, not assumed).
        ///
        /// [SC-6]: crate::backends::cpu::schedule#invariants
        direct: bool,
    },
    LocalCopy {
        from: Range<usize>,
        to: Range<usize>,
    },
}

fn overlaps(a: &Range<usize>, b: &Range<usize>) -> bool {
    !a.is_empty() && !b.is_empty() && a.start < b.end && b.start < a.end
}

/// Check one step against the buffers (`lens` = byte lengths of Src, Dst)
/// and decide which receives can land in place.
#[cfg(test)]
fn plan_step(
    step: &Step,
    rank: usize,
    size: usize,
    es: usize,
    lens: [usize; 2],
) -> std::result::Result<Vec<Item>, String> {
    plan_step_with(step, rank, size, es, lens, &|_| false)
}

/// `plan_step`, where a `Reduce` receive from a peer for which
/// `reduce_in_place` holds may also land in place (combined straight into
/// the buffer as it arrives: shared-memory peers) when its range is private.
pub(super) fn plan_step_with(
    step: &Step,
    rank: usize,
    size: usize,
    es: usize,
    lens: [usize; 2],
    reduce_in_place: &dyn Fn(usize) -> bool,
) -> std::result::Result<Vec<Item>, String> {
    let slot = |b: BufId| usize::from(b == BufId::Dst);
    let bytes = |b: BufId, r: &Range<usize>| -> std::result::Result<Range<usize>, String> {
        match (r.start.checked_mul(es), r.end.checked_mul(es)) {
            (Some(a), Some(e)) if a <= e && e <= lens[slot(b)] => Ok(a..e),
            _ => Err(format!(
                "element range {r:?} is outside {b:?} ({} bytes)",
                lens[slot(b)]
            )),
        }
    };
    let peer_ok = |p: usize| -> std::result::Result<usize, String> {
        if p < size && p != rank {
            Ok(p)
        } else {
            Err(format!("names peer {p} on rank {rank} of {size}"))
        }
    };
    let mut items = Vec::with_capacity(step.transfers.len());
    // Ranges read and written per buffer, to decide in-place receives.
    let mut reads: [Vec<Range<usize>>; 2] = [Vec::new(), Vec::new()];
    let mut writes: [Vec<Range<usize>>; 2] = [Vec::new(), Vec::new()];
    for t in &step.transfers {
        match t {
            Transfer::Send { peer, buf, range } => {
                let b = bytes(*buf, range)?;
                reads[slot(*buf)].push(b.clone());
                items.push(Item::Send {
                    peer: peer_ok(*peer)?,
                    buf: *buf,
                    bytes: b,
                });
            }
            Transfer::Recv {
                peer,
                buf,
                range,
                action,
            } => {
                let b = bytes(*buf, range)?;
                writes[slot(*buf)].push(b.clone());
                items.push(Item::Recv {
                    peer: peer_ok(*peer)?,
                    buf: *buf,
                    bytes: b,
                    action: *action,
                    direct: false,
                });
            }
            Transfer::LocalCopy { src, dst } => {
                let (from, to) = (bytes(BufId::Src, src)?, bytes(BufId::Dst, dst)?);
                if from.len() != to.len() {
                    return Err(format!("local copy {src:?} -> {dst:?} changes length"));
                }
                reads[0].push(from.clone());
                writes[1].push(to.clone());
                items.push(Item::LocalCopy { from, to });
            }
        }
    }
    for item in &mut items {
        if let Item::Recv {
            peer,
            buf,
            bytes,
            action,
            direct,
        } = item
        {
            if *action == RecvAction::Reduce && !reduce_in_place(*peer) {
                continue;
            }
            let (s, range) = (slot(*buf), bytes.clone());
            let writers = writes[s].iter().filter(|w| overlaps(w, &range)).count();
            // Overlapping itself once is expected; anything more is shared.
            let shared = writers > usize::from(!range.is_empty())
                || reads[s].iter().any(|r| overlaps(r, &range));
            *direct = !shared;
        }
    }
    Ok(items)
}

/// Split `buf` into the private in-place receive slots `writes` (`(item
/// index, byte range)`, disjoint) and the shared gaps between them, which
/// sends may read.
#[allow(clippy::type_complexity)]
pub(super) fn carve(
    buf: &mut [u8],
    mut writes: Vec<(usize, Range<usize>)>,
) -> (Vec<(Range<usize>, &[u8])>, Vec<(usize, &mut [u8])>) {
    writes.sort_by_key(|(_, r)| r.start);
    let mut gaps = Vec::with_capacity(writes.len() + 1);
    let mut slots = Vec::with_capacity(writes.len());
    let mut rest = buf;
    let mut pos = 0;
    for (k, r) in writes {
        if r.is_empty() || r.start < pos || r.end - pos > rest.len() {
            // Empty, or (impossible after plan_step) not carvable: an empty slot.
            slots.push((k, &mut [][..]));
            continue;
        }
        let (gap, tail) = std::mem::take(&mut rest).split_at_mut(r.start - pos);
        let (slot, tail) = tail.split_at_mut(r.len());
        gaps.push((pos..r.start, &*gap));
        slots.push((k, slot));
        rest = tail;
        pos = r.end;
    }
    let end = pos + rest.len();
    gaps.push((pos..end, &*rest));
    (gaps, slots)
}

/// The bytes `r` from the gap that contains them (`None` if a private slot
/// cuts through `r`).
pub(super) fn read_from<'b>(
    gaps: &[(Range<usize>, &'b [u8])],
    r: &Range<usize>,
) -> Option<&'b [u8]> {
    if r.is_empty() {
        return Some(&[]);
    }
    gaps.iter()
        .find(|(g, _)| g.start <= r.start && r.end <= g.end)
        .map(|(g, bytes)| &bytes[r.start - g.start..r.end - g.start])
}

#[cfg(test)]
mod tests {
    use super::*;

    fn recv(peer: usize, range: Range<usize>, action: RecvAction) -> Transfer {
        Transfer::Recv {
            peer,
            buf: BufId::Dst,
            range,
            action,
        }
    }

    fn direct_flags(items: &[Item]) -> Vec<bool> {
        items
            .iter()
            .filter_map(|i| match i {
                Item::Recv { direct, .. } => Some(*direct),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn only_private_copy_receives_land_in_place() {
        let step = Step {
            transfers: vec![
                Transfer::Send {
                    peer: 1,
                    buf: BufId::Dst,
                    range: 0..4,
                },
                recv(1, 2..6, RecvAction::Copy), // overlaps the send: staged
                recv(2, 6..8, RecvAction::Copy), // private: in place
                recv(3, 8..10, RecvAction::Reduce), // reduce: always staged
                recv(1, 10..10, RecvAction::Copy), // empty: in place, trivially
            ],
        };
        let items = plan_step(&step, 0, 4, 4, [0, 40]).unwrap();
        assert_eq!(direct_flags(&items), vec![false, true, false, true]);
    }

    #[test]
    fn plan_rejects_out_of_bounds_and_self_transfers() {
        let oob = Step {
            transfers: vec![recv(1, 0..11, RecvAction::Copy)],
        };
        assert!(plan_step(&oob, 0, 2, 4, [0, 40]).is_err());
        let own = Step {
            transfers: vec![recv(0, 0..1, RecvAction::Copy)],
        };
        assert!(plan_step(&own, 0, 2, 4, [0, 40]).is_err());
        let copy = Step {
            transfers: vec![Transfer::LocalCopy {
                src: 0..1,
                dst: 0..1,
            }],
        };
        assert!(plan_step(&copy, 0, 2, 4, [0, 40]).is_err(), "no Src buffer");
    }

    #[test]
    fn carve_hands_out_slots_and_readable_gaps() {
        let mut buf: Vec<u8> = (0..10).collect();
        let (gaps, slots) = carve(&mut buf, vec![(7, 6..8), (3, 2..4), (9, 5..5)]);
        assert_eq!(read_from(&gaps, &(0..2)), Some(&[0u8, 1][..]));
        assert_eq!(read_from(&gaps, &(4..6)), Some(&[4u8, 5][..]));
        assert_eq!(read_from(&gaps, &(8..10)), Some(&[8u8, 9][..]));
        assert_eq!(read_from(&gaps, &(3..5)), None);
        let mut idx: Vec<(usize, usize)> = slots.iter().map(|(k, s)| (*k, s.len())).collect();
        idx.sort();
        assert_eq!(idx, vec![(3, 2), (7, 2), (9, 0)]);
    }
}
