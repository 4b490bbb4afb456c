//! N-D device meshes ([`chorus::DeviceMesh`]): per-dimension
//! sub-communicators laid out row-major, flatten, and the argument errors.

mod common;

use chorus::{Comm, DeviceMesh, Error, ReduceOp, Tensor};
use common::run_ranks;

/// The row-major coordinates of `rank` on `shape`, computed independently
/// of the library (by counting through the grid).
fn reference_coords(rank: usize, shape: &[usize]) -> Vec<usize> {
    let mut c = vec![0; shape.len()];
    for _ in 0..rank {
        for d in (0..shape.len()).rev() {
            c[d] += 1;
            if c[d] < shape[d] {
                break;
            }
            c[d] = 0;
        }
    }
    c
}

/// The ranks whose coordinates equal `rank`'s outside `dims`, in the order
/// of their row-major index over `dims`.
fn reference_group(rank: usize, shape: &[usize], dims: &[usize]) -> Vec<usize> {
    let size: usize = shape.iter().product();
    let me = reference_coords(rank, shape);
    let mut g: Vec<(usize, usize)> = (0..size)
        .filter_map(|r| {
            let c = reference_coords(r, shape);
            let same_outside = (0..shape.len()).all(|d| dims.contains(&d) || c[d] == me[d]);
            same_outside.then(|| (dims.iter().fold(0, |k, &d| k * shape[d] + c[d]), r))
        })
        .collect();
    g.sort_unstable();
    g.into_iter().map(|(_, r)| r).collect()
}

fn value(rank: usize) -> i64 {
    (rank as i64 + 1) * 10 + 3
}

/// On every dimension's communicator: its size, this rank's rank in it,
/// who its members are (all_gather) and an all_reduce, each checked
/// against the reference.
fn check_dims(comm: &Comm, mesh: &DeviceMesh, names: &[&str], shape: &[usize]) {
    let r = comm.rank();
    assert_eq!(mesh.shape(), shape);
    assert_eq!(mesh.coords(), reference_coords(r, shape).as_slice());
    for (d, name) in names.iter().enumerate() {
        let sub = mesh.get(name).unwrap();
        let group = reference_group(r, shape, &[d]);
        assert_eq!(sub.size(), shape[d], "{name}");
        assert_eq!(sub.rank(), mesh.coords()[d], "{name}");
        assert_eq!(sub.ranks().in_parent, group, "{name}");
        let members = sub
            .all_gather(Tensor::from_vec(vec![r as i64]))
            .unwrap()
            .to_vec::<i64>();
        let want: Vec<i64> = group.iter().map(|&g| g as i64).collect();
        assert_eq!(members, want, "{name}: members in coordinate order");
        let sum = sub
            .all_reduce(Tensor::full(value(r), 5), ReduceOp::Sum)
            .unwrap()
            .to_vec::<i64>();
        let want: i64 = group.iter().map(|&g| value(g)).sum();
        assert_eq!(sum, vec![want; 5], "{name}: all_reduce");
    }
}

#[test]
fn mesh_2x2_gives_row_and_column_groups() {
    run_ranks(4, "mesh-2x2", |comm| {
        let mesh = DeviceMesh::new(&comm, &[2, 2], &["dp", "tp"]).unwrap();
        check_dims(&comm, &mesh, &["dp", "tp"], &[2, 2]);
        let tp = mesh.get("tp").unwrap().ranks().in_parent;
        let dp = mesh.get("dp").unwrap().ranks().in_parent;
        assert_eq!(mesh.get("tp").unwrap().name(), "mesh-2x2.tp");
        // Written out: PyTorch's init_device_mesh((2, 2), ("dp", "tp")).
        let want = [
            (vec![0, 2], vec![0, 1]),
            (vec![1, 3], vec![0, 1]),
            (vec![0, 2], vec![2, 3]),
            (vec![1, 3], vec![2, 3]),
        ];
        assert_eq!((dp, tp), want[comm.rank()], "rank {}", comm.rank());
        // The parent keeps working after the mesh's splits.
        let p = comm
            .all_reduce(Tensor::full(1i32, 1), ReduceOp::Sum)
            .unwrap();
        assert_eq!(p.to_vec::<i32>(), vec![4]);
        comm.finalize().unwrap();
        assert!(!mesh.get("tp").unwrap().is_active());
    });
}

#[test]
fn mesh_2x3_and_its_flattenings() {
    run_ranks(6, "mesh-2x3", |comm| {
        let r = comm.rank();
        let mesh = mesh_via_async(&comm, &[2, 3], &["dp", "tp"]);
        check_dims(&comm, &mesh, &["dp", "tp"], &[2, 3]);
        // Both dimensions: the whole world, in mesh order.
        let all = mesh.flatten(&["dp", "tp"], "dp_tp").unwrap();
        assert_eq!(all.size(), 6);
        assert_eq!(all.rank(), r);
        assert_eq!(all.name(), "mesh-2x3.dp_tp");
        let s = all
            .all_reduce(Tensor::full(value(r), 3), ReduceOp::Sum)
            .unwrap()
            .to_vec::<i64>();
        assert_eq!(s, vec![(0..6).map(value).sum::<i64>(); 3]);
        // Reversed: ranked column-major.
        let rev = mesh.flatten(&["tp", "dp"], "tp_dp").unwrap();
        assert_eq!(rev.ranks().in_parent, reference_group(r, &[2, 3], &[1, 0]));
        assert_eq!(rev.ranks().in_parent, vec![0, 3, 1, 4, 2, 5]);
        let g = rev
            .all_gather(Tensor::from_vec(vec![r as i32]))
            .unwrap()
            .to_vec::<i32>();
        assert_eq!(g, vec![0, 3, 1, 4, 2, 5]);
        // One dimension: the same group as get().
        let tp = mesh.flatten(&["tp"], "tp_again").unwrap();
        assert_eq!(
            tp.ranks().in_parent,
            mesh.get("tp").unwrap().ranks().in_parent
        );
        // Under mpirun rank 0's process hosts the store: keep it until
        // every rank is done with its splits.
        comm.barrier().unwrap();
        comm.finalize().unwrap();
    });
}

#[test]
fn mesh_2x2x2_with_a_flattened_pair() {
    run_ranks(8, "mesh-2x2x2", |comm| {
        let r = comm.rank();
        let shape = [2, 2, 2];
        let names = ["pp", "dp", "tp"];
        let mesh = DeviceMesh::new(&comm, &shape, &names).unwrap();
        check_dims(&comm, &mesh, &names, &shape);
        let dp_tp = mesh.flatten(&["dp", "tp"], "dp_tp").unwrap();
        let group = reference_group(r, &shape, &[1, 2]);
        assert_eq!(group.len(), 4);
        assert_eq!(dp_tp.ranks().in_parent, group);
        let s = dp_tp
            .all_reduce(Tensor::full(value(r), 2), ReduceOp::Max)
            .unwrap()
            .to_vec::<i64>();
        let want = group.iter().map(|&g| value(g)).max().unwrap();
        assert_eq!(s, vec![want; 2]);
        // Under mpirun rank 0's process hosts the store: keep it until
        // every rank is done with its splits.
        comm.barrier().unwrap();
        comm.finalize().unwrap();
    });
}

#[test]
fn mesh_arguments_are_checked_before_any_communication() {
    run_ranks(4, "mesh-errors", |comm| {
        let bad = |shape: &[usize], names: &[&str], what: &str| match DeviceMesh::new(
            &comm, shape, names,
        ) {
            Err(Error::InvalidArgument { op, reason, .. }) => {
                assert_eq!(op, "device_mesh", "{what}");
                reason
            }
            other => panic!("{what}: {other:?}"),
        };
        let reason = bad(&[2, 3], &["dp", "tp"], "product");
        assert!(reason.contains("4 ranks"), "{reason}");
        bad(&[], &[], "no dimension");
        bad(&[2, 2], &["dp"], "names length");
        bad(&[4, 0], &["dp", "tp"], "size 0");
        let reason = bad(&[2, 2], &["dp", "dp"], "duplicate");
        assert!(reason.contains("twice"), "{reason}");
        bad(&[2, 2], &["dp", ""], "empty name");
        bad(&[2, 2], &["dp", "t/p"], "slash");
        // Nothing was exchanged: the parent's next op is its first.
        let p = comm
            .all_reduce(Tensor::full(1i32, 1), ReduceOp::Sum)
            .unwrap();
        assert_eq!(p.to_vec::<i32>(), vec![4]);
        assert_eq!(comm.flight_record().len(), 1);

        let mesh = DeviceMesh::new(&comm, &[4], &["dp"]).unwrap();
        assert!(matches!(mesh.get("tp"), Err(Error::InvalidArgument { .. })));
        for (dims, name) in [
            (&[][..], "x"),
            (&["dp", "dp"][..], "x"),
            (&["tp"][..], "x"),
            (&["dp"][..], "dp"),
            (&["dp"][..], ""),
        ] {
            match mesh.flatten(dims, name) {
                Err(Error::InvalidArgument { op, .. }) => assert_eq!(op, "device_mesh.flatten"),
                other => panic!("flatten({dims:?}, {name:?}): {other:?}"),
            }
        }
        // Under mpirun rank 0's process hosts the store: keep it until
        // every rank is done with its splits.
        comm.barrier().unwrap();
        comm.finalize().unwrap();
    });
}

/// Ranks passing different layouts of the same size get `Mismatch` (not
/// silently wrong groups), and the parent stays usable.
#[test]
fn mesh_layouts_that_differ_between_ranks_are_a_mismatch() {
    run_ranks(4, "mesh-mismatch", |comm| {
        let shape: &[usize] = if comm.rank() == 3 { &[4, 1] } else { &[2, 2] };
        match DeviceMesh::new(&comm, shape, &["dp", "tp"]) {
            Err(Error::Mismatch { op, fatal, .. }) => {
                assert_eq!(op, "device_mesh");
                assert!(!fatal);
            }
            other => panic!("{other:?}"),
        }
        let mesh = DeviceMesh::new(&comm, &[2, 2], &["dp", "tp"]).unwrap();
        assert_eq!(mesh.get("dp").unwrap().size(), 2);
        // Under mpirun rank 0's process hosts the store: keep it until
        // every rank is done with its splits.
        comm.barrier().unwrap();
        comm.finalize().unwrap();
    });
}

/// The async forms, awaited on the caller's own (current-thread) runtime.
fn mesh_via_async(comm: &Comm, shape: &[usize], names: &[&str]) -> DeviceMesh {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mesh = DeviceMesh::new_async(comm, shape, names).await.unwrap();
        let flat = mesh.flatten_async(&["tp"], "tp_async").await.unwrap();
        assert_eq!(
            flat.ranks().in_parent,
            mesh.get("tp").unwrap().ranks().in_parent
        );
        mesh
    })
}
