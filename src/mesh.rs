//! N-D device meshes: a communicator's ranks laid out on a named grid, with
//! one sub-communicator per dimension, in the shape of PyTorch's
//! `init_device_mesh`.
//!
//! Owns only the arithmetic of the grid (row-major coordinates, which ranks
//! share a dimension) and the order of the splits; every sub-communicator
//! is formed by [`Comm::split_by_color`], so a mesh works on every backend
//! that can split, and fails with that backend's `NotSupported` otherwise.

use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// A communicator's ranks laid out on an N-D grid with named dimensions
/// ([`DeviceMesh::new`]).
///
/// Ranks are placed row-major, as PyTorch's `init_device_mesh` does: on a
/// `[2, 3]` mesh rank `r` sits at `(r / 3, r % 3)`. The sub-communicator of
/// a dimension holds the ranks whose coordinates differ only in that
/// dimension, ranked by their coordinate in it; so on a `["dp", "tp"]`
/// mesh of shape `[2, 2]`, `get("tp")` of rank 2 is the group `[2, 3]` and
/// `get("dp")` the group `[0, 2]`.
///
/// ```
/// use chorus::{new_comm, CommOptions, Device, DeviceMesh, ReduceOp, Tensor};
///
/// let comm = new_comm("cpu", Device::Cpu, "mesh-doc", CommOptions::single())?;
/// let mesh = DeviceMesh::new(&comm, &[1, 1], &["dp", "tp"])?;
/// assert_eq!(mesh.shape(), &[1, 1]);
/// assert_eq!(mesh.coords(), &[0, 0]);
/// let tp = mesh.get("tp")?;
/// let s = tp.all_reduce(Tensor::full(2.0f32, 4), ReduceOp::Sum)?;
/// assert_eq!(s.as_slice::<f32>()[0], 2.0);
/// let flat = mesh.flatten(&["dp", "tp"], "dp_tp")?;
/// assert_eq!(flat.size(), 1);
/// comm.finalize()?; // finalizes the mesh's communicators first
/// # Ok::<(), chorus::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct DeviceMesh {
    comm: Comm,
    shape: Vec<usize>,
    names: Vec<String>,
    coords: Vec<usize>,
    dims: Vec<Comm>,
}

impl DeviceMesh {
    /// Lay the ranks of `comm` out on a grid of `shape` whose dimensions are
    /// called `names`, and form one sub-communicator per dimension
    /// (called `<comm name>.<dim name>`). Collective over `comm`: every rank
    /// calls it with the same shape and names. The sub-communicators are
    /// split children of `comm`: finalizing or aborting `comm` ends them.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`], before any communication, for an empty
    /// shape, a shape whose product is not `comm.size()`, a dimension of
    /// size 0, a `names` of another length than `shape`, or a dimension name
    /// that is empty, contains `/` or appears twice; [`Error::Mismatch`] if
    /// the ranks pass different shapes or names (the parent stays usable);
    /// [`Error::NotSupported`] on a backend that cannot split; the errors of
    /// [`Comm::split_by_color`] otherwise.
    pub fn new(comm: &Comm, shape: &[usize], names: &[&str]) -> Result<DeviceMesh> {
        let names: Vec<String> = names.iter().map(|s| s.to_string()).collect();
        let (c, shape) = (comm.clone(), shape.to_vec());
        comm.block("device_mesh", move |_| async move {
            let names: Vec<&str> = names.iter().map(String::as_str).collect();
            DeviceMesh::new_async(&c, &shape, &names).await
        })
    }

    /// Async form of [`DeviceMesh::new`].
    ///
    /// # Errors
    /// As [`DeviceMesh::new`].
    pub async fn new_async(comm: &Comm, shape: &[usize], names: &[&str]) -> Result<DeviceMesh> {
        let invalid = |reason: String| Error::InvalidArgument {
            comm: comm.name().to_string(),
            rank: comm.rank(),
            op: "device_mesh",
            reason,
        };
        if shape.is_empty() {
            return Err(invalid("a mesh needs at least one dimension".into()));
        }
        if names.len() != shape.len() {
            return Err(invalid(format!(
                "{} dimension names for a shape of {} dimensions {shape:?}",
                names.len(),
                shape.len()
            )));
        }
        if let Some(d) = shape.iter().position(|&n| n == 0) {
            return Err(invalid(format!("dimension {:?} has size 0", names[d])));
        }
        let product = shape.iter().try_fold(1usize, |p, &n| p.checked_mul(n));
        if product != Some(comm.size()) {
            return Err(invalid(format!(
                "a mesh of shape {shape:?} does not hold the communicator's {} ranks",
                comm.size()
            )));
        }
        for (i, name) in names.iter().enumerate() {
            check_dim_name(name).map_err(&invalid)?;
            if names[..i].contains(name) {
                return Err(invalid(format!("dimension name {name:?} appears twice")));
            }
        }
        let coords = coords_of(comm.rank(), shape);
        let mesh_seq = comm
            .shared
            .splits
            .load(std::sync::atomic::Ordering::Acquire);
        // Agree on the layout first: ranks with different shapes would
        // otherwise form groups that look valid to each split.
        let digest = layout_digest(shape, names);
        let all = comm
            .all_gather_async(Tensor::from_vec(vec![digest]))
            .skip_hooks()
            .await?
            .to_vec::<i64>();
        if let Some(r) = all.iter().position(|&d| d != digest) {
            return Err(Error::Mismatch {
                comm: comm.name().to_string(),
                rank: comm.rank(),
                op: "device_mesh",
                seq: mesh_seq,
                epoch: comm.epoch(),
                detail: format!(
                    "rank {r} passed another mesh shape or other dimension names than \
                     this rank's {shape:?} {names:?}"
                ),
                fatal: false,
            });
        }
        let mut dims = Vec::with_capacity(shape.len());
        for (d, name) in names.iter().enumerate() {
            let child = group_of(
                comm,
                shape,
                &coords,
                &[d],
                &format!("{}.{name}", comm.name()),
            )
            .await?;
            dims.push(child);
        }
        Ok(DeviceMesh {
            comm: comm.clone(),
            shape: shape.to_vec(),
            names: names.iter().map(|s| s.to_string()).collect(),
            coords,
            dims,
        })
    }

    /// The communicator the mesh was laid over.
    pub fn comm(&self) -> &Comm {
        &self.comm
    }

    /// The size of each dimension.
    pub fn shape(&self) -> &[usize] {
        &self.shape
    }

    /// The dimension names, in order.
    pub fn dim_names(&self) -> &[String] {
        &self.names
    }

    /// This rank's coordinates on the grid (row-major): `coords()[d]` is its
    /// rank in [`get`](DeviceMesh::get) of dimension `d`.
    pub fn coords(&self) -> &[usize] {
        &self.coords
    }

    /// The sub-communicator of dimension `name`: the ranks whose
    /// coordinates differ from this rank's only in that dimension.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for a name that is not a dimension of the mesh.
    pub fn get(&self, name: &str) -> Result<&Comm> {
        let d = self.dim(name, "device_mesh.get")?;
        Ok(&self.dims[d])
    }

    fn dim(&self, name: &str, op: &'static str) -> Result<usize> {
        self.names
            .iter()
            .position(|n| n == name)
            .ok_or_else(|| Error::InvalidArgument {
                comm: self.comm.name().to_string(),
                rank: self.comm.rank(),
                op,
                reason: format!(
                    "{name:?} is not a dimension of the mesh (dimensions: {:?})",
                    self.names
                ),
            })
    }

    /// One communicator over the dimensions `dims` together (called
    /// `<comm name>.<name>`): the ranks whose coordinates differ from this
    /// rank's only in those dimensions, ranked row-major over `dims` in the
    /// order given (so flattening `["dp", "tp"]` of a `[dp, tp]` mesh ranks
    /// them as the mesh does). Collective over the mesh's communicator:
    /// every rank calls it with the same arguments. Like PyTorch's
    /// `DeviceMesh._flatten`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`], before any communication, for an empty
    /// `dims`, an unknown or repeated dimension, or a `name` that is empty,
    /// contains `/` or is already a dimension's name; the errors of
    /// [`Comm::split_by_color`] otherwise.
    pub fn flatten(&self, dims: &[&str], name: &str) -> Result<Comm> {
        let this = self.clone();
        let dims: Vec<String> = dims.iter().map(|s| s.to_string()).collect();
        let name = name.to_string();
        self.comm.block("device_mesh.flatten", move |_| async move {
            let dims: Vec<&str> = dims.iter().map(String::as_str).collect();
            this.flatten_async(&dims, &name).await
        })
    }

    /// Async form of [`DeviceMesh::flatten`].
    ///
    /// # Errors
    /// As [`DeviceMesh::flatten`].
    pub async fn flatten_async(&self, dims: &[&str], name: &str) -> Result<Comm> {
        const OP: &str = "device_mesh.flatten";
        let invalid = |reason: String| Error::InvalidArgument {
            comm: self.comm.name().to_string(),
            rank: self.comm.rank(),
            op: OP,
            reason,
        };
        if dims.is_empty() {
            return Err(invalid("flatten needs at least one dimension".into()));
        }
        check_dim_name(name).map_err(&invalid)?;
        if self.names.iter().any(|n| n == name) {
            return Err(invalid(format!(
                "{name:?} is already a dimension of the mesh; pick another name"
            )));
        }
        let mut idx = Vec::with_capacity(dims.len());
        for dim in dims {
            let d = self.dim(dim, OP)?;
            if idx.contains(&d) {
                return Err(invalid(format!("dimension {dim:?} is listed twice")));
            }
            idx.push(d);
        }
        group_of(
            &self.comm,
            &self.shape,
            &self.coords,
            &idx,
            &format!("{}.{name}", self.comm.name()),
        )
        .await
    }
}

fn check_dim_name(name: &str) -> std::result::Result<(), String> {
    if name.is_empty() || name.contains('/') {
        return Err(format!(
            "dimension name {name:?} must be non-empty and contain no '/'"
        ));
    }
    Ok(())
}

/// Row-major strides of `shape`.
fn strides(shape: &[usize]) -> Vec<usize> {
    let mut s = vec![1; shape.len()];
    for d in (0..shape.len().saturating_sub(1)).rev() {
        s[d] = s[d + 1] * shape[d + 1];
    }
    s
}

/// The row-major coordinates of `rank` on `shape`.
fn coords_of(rank: usize, shape: &[usize]) -> Vec<usize> {
    strides(shape)
        .iter()
        .zip(shape)
        .map(|(&st, &n)| (rank / st) % n)
        .collect()
}

/// The `(color, key)` of the rank at `coords` in the group over dimensions
/// `dims`: the color is the rank with those coordinates zeroed (the same
/// for exactly the ranks that differ only there), the key its row-major
/// index over `dims` in the order given.
fn color_key(shape: &[usize], coords: &[usize], dims: &[usize]) -> (usize, usize) {
    let st = strides(shape);
    let rank: usize = coords.iter().zip(&st).map(|(c, s)| c * s).sum();
    let color = rank - dims.iter().map(|&d| coords[d] * st[d]).sum::<usize>();
    let key = dims.iter().fold(0, |k, &d| k * shape[d] + coords[d]);
    (color, key)
}

/// A fingerprint of the layout, the same on ranks that agree on it.
fn layout_digest(shape: &[usize], names: &[&str]) -> i64 {
    let mut bytes = Vec::new();
    for (n, name) in shape.iter().zip(names) {
        bytes.extend_from_slice(&(*n as u64).to_le_bytes());
        bytes.extend_from_slice(&(name.len() as u64).to_le_bytes());
        bytes.extend_from_slice(name.as_bytes());
    }
    crate::elastic::fnv(&bytes)
}

/// Split `comm` into the groups over dimensions `dims`; this rank's group.
async fn group_of(
    comm: &Comm,
    shape: &[usize],
    coords: &[usize],
    dims: &[usize],
    name: &str,
) -> Result<Comm> {
    let (color, key) = color_key(shape, coords, dims);
    let color = u32::try_from(color).map_err(|_| Error::InvalidArgument {
        comm: comm.name().to_string(),
        rank: comm.rank(),
        op: "device_mesh",
        reason: "a mesh holds at most 2^32 ranks".into(),
    })?;
    comm.split_by_color_async(Some(color), key as i64, name)
        .await?
        .ok_or_else(|| Error::Internal(format!("device mesh: no group {name:?} for this rank")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn coordinates_are_row_major() {
        assert_eq!(coords_of(5, &[2, 3]), vec![1, 2]);
        assert_eq!(coords_of(3, &[2, 3]), vec![1, 0]);
        assert_eq!(coords_of(6, &[2, 2, 2]), vec![1, 1, 0]);
        assert_eq!(coords_of(0, &[4]), vec![0]);
    }

    #[test]
    fn groups_hold_the_ranks_that_differ_only_in_their_dimensions() {
        let shape = [2, 3];
        // Members of each (dims) group, by color, in key order.
        let groups = |dims: &[usize]| {
            let mut m: std::collections::BTreeMap<usize, Vec<(usize, usize)>> = Default::default();
            for r in 0..6 {
                let (c, k) = color_key(&shape, &coords_of(r, &shape), dims);
                m.entry(c).or_default().push((k, r));
            }
            m.into_values()
                .map(|mut v| {
                    v.sort_unstable();
                    v.into_iter().map(|(_, r)| r).collect::<Vec<_>>()
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(groups(&[1]), vec![vec![0, 1, 2], vec![3, 4, 5]]);
        assert_eq!(groups(&[0]), vec![vec![0, 3], vec![1, 4], vec![2, 5]]);
        assert_eq!(groups(&[0, 1]), vec![vec![0, 1, 2, 3, 4, 5]]);
        // Reversed order: ranked column-major.
        assert_eq!(groups(&[1, 0]), vec![vec![0, 3, 1, 4, 2, 5]]);
    }

    #[test]
    fn layouts_differ_in_their_digest() {
        assert_ne!(
            layout_digest(&[2, 2], &["dp", "tp"]),
            layout_digest(&[2, 2], &["tp", "dp"])
        );
        assert_ne!(
            layout_digest(&[4, 1], &["dp", "tp"]),
            layout_digest(&[2, 2], &["dp", "tp"])
        );
    }
}
