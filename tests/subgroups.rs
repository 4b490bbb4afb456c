//! Subgroups: `split`, `split_by_color`, hierarchies, and the supervision
//! rules SV-1 (a child never outlives its parent) and AC-4 (children are
//! finalized/aborted before their parent).

mod common;

use chorus::{Error, ReduceOp, Tensor};
use common::run_ranks;

#[test]
fn split_by_color_forms_children_that_reduce_within_their_color() {
    let out = run_ranks(4, "split-color", |comm| {
        let r = comm.rank();
        let child = comm
            .split_by_color(Some((r % 2) as u32), -(r as i64), "parity")
            .unwrap()
            .expect("every rank has a color");
        assert_eq!(child.size(), 2);
        // Keys are descending ranks: the higher parent rank is child rank 0.
        assert_eq!(child.rank(), if r >= 2 { 0 } else { 1 });
        let s = child
            .all_reduce(Tensor::full(r as f32, 8), ReduceOp::Sum)
            .unwrap();
        // The parent still works, in order with the split.
        let p = comm
            .all_reduce(Tensor::full(1i32, 2), ReduceOp::Sum)
            .unwrap();
        assert_eq!(p.to_vec::<i32>(), vec![4, 4]);
        comm.finalize().unwrap();
        assert!(
            !child.is_active(),
            "finalizing the parent finalizes the child"
        );
        s.as_slice::<f32>()[0]
    });
    assert_eq!(out, vec![2.0, 4.0, 2.0, 4.0]);
}

#[test]
fn split_by_ranks_gives_none_outside_and_sequential_ranks_inside() {
    let out = run_ranks(4, "split-ranks", |comm| {
        let child = comm.split(&[3, 1], "pair").unwrap();
        let res = child.as_ref().map(|c| {
            let g = c
                .all_gather(Tensor::from_vec(vec![comm.rank() as i32]))
                .unwrap();
            (c.rank(), g.to_vec::<i32>())
        });
        comm.finalize().unwrap();
        res
    });
    assert_eq!(out[0], None);
    assert_eq!(out[2], None);
    assert_eq!(out[3], Some((0, vec![3, 1])));
    assert_eq!(out[1], Some((1, vec![3, 1])));
}

/// TorchComms' SplitTest: contiguous halves, each half passing its own
/// list, at once; the children reduce within their half and know their
/// ranks in the parent and in the world, through a split of a split.
#[test]
fn split_into_halves_each_passing_its_own_list() {
    let out = run_ranks(4, "split-halves", |comm| {
        let r = comm.rank();
        let mine: Vec<usize> = if r < 2 { vec![0, 1] } else { vec![3, 2] };
        let half = comm.split(&mine, "half").unwrap().expect("member");
        assert_eq!(half.size(), 2);
        assert_eq!(half.ranks().in_parent, mine);
        assert_eq!(half.ranks().in_world, mine);
        let s = half
            .all_reduce(Tensor::full(r as i32, 4), ReduceOp::Sum)
            .unwrap()
            .to_vec::<i32>()[0];
        // A split of the split: child rank 1 of each half alone.
        let solo = half.split(if half.rank() == 1 { &[1][..] } else { &[] }, "solo");
        let solo = solo.unwrap();
        let world = solo.as_ref().map(|c| (c.size(), c.ranks()));
        comm.finalize().unwrap();
        (half.rank(), s, world)
    });
    assert_eq!(out[0].0, 0);
    assert_eq!(out[1].0, 1);
    assert_eq!(out[3].0, 0, "rank 3 is first in its half's list");
    assert_eq!(out[2].0, 1);
    assert_eq!([out[0].1, out[1].1, out[2].1, out[3].1], [1, 1, 5, 5]);
    // Child rank 1 of [0, 1] is world rank 1; of [3, 2] it is world rank 2.
    let solo = |i: usize| {
        out[i]
            .2
            .clone()
            .map(|(n, rk)| (n, rk.in_parent, rk.in_world))
    };
    assert_eq!(solo(1), Some((1, vec![1], vec![1])));
    assert_eq!(solo(2), Some((1, vec![1], vec![2])));
    assert_eq!(solo(0), None);
    assert_eq!(solo(3), None);
}

/// TorchComms' SplitTest: even ranks form a child, odd ranks pass `[]`.
#[test]
fn split_even_ranks_with_empty_lists_outside() {
    let out = run_ranks(4, "split-even", |comm| {
        let r = comm.rank();
        let list: &[usize] = if r % 2 == 0 { &[0, 2] } else { &[] };
        let child = comm.split(list, "even").unwrap();
        let res = child.as_ref().map(|c| {
            let g = c.all_gather(Tensor::from_vec(vec![r as i32])).unwrap();
            (c.rank(), g.to_vec::<i32>(), c.ranks().in_parent)
        });
        comm.finalize().unwrap();
        res
    });
    assert_eq!(out[0], Some((0, vec![0, 2], vec![0, 2])));
    assert_eq!(out[2], Some((1, vec![0, 2], vec![0, 2])));
    assert_eq!(out[1], None);
    assert_eq!(out[3], None);
}

/// A non-empty list without the caller that no group formed is the
/// caller's error (`InvalidArgument`) and a `Mismatch` elsewhere; mixing
/// `split` with `split_by_color` is a `Mismatch`. The parent stays usable.
#[test]
fn split_errors_are_typed_on_every_rank_and_leave_the_parent_usable() {
    run_ranks(3, "split-errs", |comm| {
        let r = comm.rank();
        // Ranks 0 and 1 form [0, 1]; rank 2 passes [0] without itself.
        let list: &[usize] = if r < 2 { &[0, 1] } else { &[0] };
        match comm.split(list, "bad").unwrap_err() {
            Error::InvalidArgument { op: "split", .. } if r == 2 => {}
            Error::Mismatch { op: "split", .. } if r < 2 => {}
            e => panic!("rank {r}: {e}"),
        }
        let e = if r == 0 {
            comm.split_by_color(Some(0), 0, "mixed").unwrap_err()
        } else {
            comm.split(&[0, 1, 2], "mixed").unwrap_err()
        };
        assert!(matches!(e, Error::Mismatch { .. }), "rank {r}: {e}");
        let s = comm
            .all_reduce(Tensor::full(1i32, 2), ReduceOp::Sum)
            .unwrap();
        assert_eq!(s.to_vec::<i32>(), vec![3, 3]);
        comm.finalize().unwrap();
    });
}

#[test]
fn split_with_different_rank_lists_is_a_mismatch_on_every_rank() {
    run_ranks(2, "split-mm", |comm| {
        let ranks: &[usize] = if comm.rank() == 0 { &[0, 1] } else { &[1, 0] };
        let e = comm.split(ranks, "bad").unwrap_err();
        assert!(matches!(e, Error::Mismatch { op: "split", .. }), "{e}");
        comm.barrier().unwrap();
    });
}

#[test]
fn split_rejects_duplicate_and_out_of_range_ranks_before_any_io() {
    run_ranks(2, "split-bad", |comm| {
        for bad in [&[0, 0][..], &[0, 2][..]] {
            let e = comm.split(bad, "x").unwrap_err();
            assert!(
                matches!(e, Error::InvalidArgument { op: "split", .. }),
                "{e}"
            );
        }
        comm.barrier().unwrap();
    });
}

#[test]
fn two_level_all_reduce_through_hierarchy_matches_flat_all_reduce() {
    let out = run_ranks(4, "hier", |comm| {
        let r = comm.rank();
        // Two "hosts" of two ranks each.
        let h = comm.hierarchy_by(&format!("host{}", r / 2)).unwrap();
        assert_eq!((h.local.size(), h.cross.size()), (2, 2));
        let x = Tensor::full((r + 1) as f64, 16);
        let flat = comm.all_reduce(x.clone(), ReduceOp::Sum).unwrap();
        let local = h.local.all_reduce(x, ReduceOp::Sum).unwrap();
        let two_level = h.cross.all_reduce(local, ReduceOp::Sum).unwrap();
        assert_eq!(flat.to_vec::<f64>(), two_level.to_vec::<f64>());
        comm.finalize().unwrap();
        two_level.as_slice::<f64>()[0]
    });
    assert_eq!(out, vec![10.0; 4]);
}

#[test]
fn child_failure_reaches_the_parent_as_a_supervision_event_in_health() {
    run_ranks(2, "kid-fail", |comm| {
        let child = comm.split(&[0, 1], "kid").unwrap().expect("member");
        child.abort_with_reason("injected child failure");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            let h = comm.health();
            if !h.child_failures.is_empty() {
                assert!(h.active, "a child's failure does not abort the parent");
                break;
            }
            assert!(std::time::Instant::now() < deadline, "no supervision event");
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        comm.barrier().unwrap();
    });
}
