//! Operations: reduce ops, op kinds, and the cross-rank consistency header.
//!
//! With strict checks ([`crate::checks`]), before any data moves, the participants of an operation exchange a small
//! [`OpHeader`] (kind, dtype, counts, root, reduce op). Every participant sees
//! the same set of headers and applies the same deterministic rule
//! ([`check_collective`], [`check_p2p`]), so a disagreement is reported as
//! [`Error::Mismatch`](crate::Error::Mismatch) on *every* rank — never a hang
//! and never corrupt data.
//!
//! # Invariants
//! - OP-1: the verdict of [`check_collective`] depends only on the multiset of
//!   headers, so all ranks reach the same verdict.
//! - OP-2: a parameter mismatch is found before any payload byte is sent, so
//!   the communicator stays usable after it.

use std::fmt;

use rkyv::{Archive, Deserialize, Serialize};

use crate::tensor::{DType, Tensor};

/// Reduction operator.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Element-wise product.
    Product,
    /// Element-wise minimum.
    Min,
    /// Element-wise maximum.
    Max,
    /// Sum divided by the number of ranks (integer division for integer dtypes).
    Avg,
    /// Bitwise AND (integer dtypes only).
    BAnd,
    /// Bitwise OR (integer dtypes only).
    BOr,
    /// Bitwise XOR (integer dtypes only).
    BXor,
    /// Each rank multiplies its input by its own scalar, then the results are
    /// summed (NCCL's `ncclRedOpCreatePreMulSum`). For integer dtypes the scalar
    /// is converted with `as` (truncating).
    PremulSum(f64),
}

impl ReduceOp {
    /// `PremulSum` with this rank's factor held in a one-element tensor of
    /// any dtype (TorchComms' `PREMUL_SUM(tensor)`). Each rank passes its
    /// own factor; Chorus tensors live in host memory, so the factor is
    /// read here, when the op is built. `None` unless `factor` holds
    /// exactly one element, or if that element is not finite.
    ///
    /// ```
    /// use chorus::{ReduceOp, Tensor};
    /// assert_eq!(ReduceOp::premul_sum_tensor(&Tensor::from_vec(vec![0.5f32])), Some(ReduceOp::PremulSum(0.5)));
    /// assert_eq!(ReduceOp::premul_sum_tensor(&Tensor::from_vec(vec![1i32, 2])), None);
    /// ```
    pub fn premul_sum_tensor(factor: &Tensor) -> Option<ReduceOp> {
        match factor.to_f64_vec().as_slice() {
            [f] if f.is_finite() => Some(ReduceOp::PremulSum(*f)),
            _ => None,
        }
    }

    /// A code that identifies the operator (not the scalar) on the wire.
    pub const fn code(self) -> u8 {
        match self {
            ReduceOp::Sum => 0,
            ReduceOp::Product => 1,
            ReduceOp::Min => 2,
            ReduceOp::Max => 3,
            ReduceOp::Avg => 4,
            ReduceOp::BAnd => 5,
            ReduceOp::BOr => 6,
            ReduceOp::BXor => 7,
            ReduceOp::PremulSum(_) => 8,
        }
    }

    /// Operator name.
    pub const fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Product => "product",
            ReduceOp::Min => "min",
            ReduceOp::Max => "max",
            ReduceOp::Avg => "avg",
            ReduceOp::BAnd => "band",
            ReduceOp::BOr => "bor",
            ReduceOp::BXor => "bxor",
            ReduceOp::PremulSum(_) => "premul_sum",
        }
    }

    /// Whether this operator is only defined for integers.
    pub const fn is_bitwise(self) -> bool {
        matches!(self, ReduceOp::BAnd | ReduceOp::BOr | ReduceOp::BXor)
    }

    /// Whether the operator can be applied to `dtype`. On [`DType::Bool`]
    /// the operators are logical: `Sum`, `Max` and `BOr` are OR; `Product`,
    /// `Min` and `BAnd` are AND; `BXor` is XOR. `Avg` and `PremulSum` are
    /// not defined on booleans.
    pub const fn supports(self, dtype: DType) -> bool {
        match dtype {
            DType::Bool => !matches!(self, ReduceOp::Avg | ReduceOp::PremulSum(_)),
            _ => !(self.is_bitwise() && dtype.is_float()),
        }
    }

    /// [`combine_op`](ReduceOp::combine_op) for data of `dtype`: on
    /// [`DType::Bool`] (with every element 0 or 1, which the generic layer
    /// ensures before an op), OR combines as `Max`, AND as `Min` and XOR as
    /// `BXor`, so every backend can run boolean reductions as `u8` ones.
    pub const fn combine_op_on(self, dtype: DType) -> ReduceOp {
        match (dtype, self) {
            (DType::Bool, ReduceOp::Sum | ReduceOp::Max | ReduceOp::BOr) => ReduceOp::Max,
            (DType::Bool, ReduceOp::Product | ReduceOp::Min | ReduceOp::BAnd) => ReduceOp::Min,
            (DType::Bool, ReduceOp::BXor) => ReduceOp::BXor,
            _ => self.combine_op(),
        }
    }

    /// The operator used to combine values between ranks: `Avg` and
    /// `PremulSum` combine as `Sum` (with a local pre/post step).
    pub const fn combine_op(self) -> ReduceOp {
        match self {
            ReduceOp::Avg | ReduceOp::PremulSum(_) => ReduceOp::Sum,
            other => other,
        }
    }
}

impl fmt::Display for ReduceOp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReduceOp::PremulSum(s) => write!(f, "premul_sum({s})"),
            other => f.write_str(other.name()),
        }
    }
}

/// The kinds of operation a communicator runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum OpKind {
    /// all_reduce
    AllReduce = 0,
    /// reduce
    Reduce = 1,
    /// reduce_scatter and reduce_scatter_v
    ReduceScatter = 2,
    /// all_gather and all_gather_v
    AllGather = 3,
    /// broadcast
    Broadcast = 4,
    /// scatter
    Scatter = 5,
    /// gather
    Gather = 6,
    /// all_to_all (list form)
    AllToAll = 7,
    /// all_to_all_single and all_to_all_v_single
    AllToAllSingle = 8,
    /// barrier
    Barrier = 9,
    /// send / recv / batched point-to-point
    P2P = 10,
    /// new_window: collective creation of a one-sided window
    NewWindow = 11,
    /// one-sided window ops (put, signal, wait_signal, read): no header,
    /// no collective sequence number
    Window = 12,
    /// free_window: collective release of a one-sided window
    FreeWindow = 13,
}

impl OpKind {
    /// Operation name as used in errors and tracing.
    pub const fn name(self) -> &'static str {
        match self {
            OpKind::AllReduce => "all_reduce",
            OpKind::Reduce => "reduce",
            OpKind::ReduceScatter => "reduce_scatter",
            OpKind::AllGather => "all_gather",
            OpKind::Broadcast => "broadcast",
            OpKind::Scatter => "scatter",
            OpKind::Gather => "gather",
            OpKind::AllToAll => "all_to_all",
            OpKind::AllToAllSingle => "all_to_all_single",
            OpKind::Barrier => "barrier",
            OpKind::P2P => "p2p",
            OpKind::NewWindow => "new_window",
            OpKind::Window => "window",
            OpKind::FreeWindow => "free_window",
        }
    }

    fn from_code(c: u8) -> Option<OpKind> {
        use OpKind::*;
        [
            AllReduce,
            Reduce,
            ReduceScatter,
            AllGather,
            Broadcast,
            Scatter,
            Gather,
            AllToAll,
            AllToAllSingle,
            Barrier,
            P2P,
            NewWindow,
            Window,
            FreeWindow,
        ]
        .get(c as usize)
        .copied()
    }
}

/// The consistency header one rank sends to each participant of an op.
///
/// For collectives the same header goes to every rank; for point-to-point the
/// header sent to peer `p` lists only the transfers with `p`.
#[derive(Debug, Clone, PartialEq, Archive, Serialize, Deserialize)]
pub struct OpHeader {
    /// Sequence number (collective counter, or per-peer p2p counter).
    pub seq: u64,
    /// Communicator epoch.
    pub epoch: u64,
    /// [`OpKind`] code.
    pub kind: u8,
    /// [`DType`] code.
    pub dtype: u8,
    /// [`ReduceOp::code`], or `u8::MAX` for ops without reduction.
    pub redop: u8,
    /// Root rank, or `u32::MAX` for rootless ops.
    pub root: u32,
    /// This rank's element count (meaning depends on the op, see `check_collective`).
    pub count: u64,
    /// Per-rank counts (split sizes) where the op has them, else empty.
    pub counts: Vec<u64>,
    /// For p2p: the transfers with the receiving peer, in issue order:
    /// `(is_send, dtype code, count)` from the sender's point of view.
    pub p2p: Vec<(bool, u8, u64)>,
}

impl OpHeader {
    /// Encode with rkyv (straight into the returned vector: one
    /// allocation per header, which every op sends).
    pub fn encode(&self) -> Vec<u8> {
        rkyv::api::high::to_bytes_in::<_, rkyv::rancor::Error>(self, Vec::with_capacity(64))
            .unwrap_or_default()
    }

    /// Decode and validate untrusted bytes (copied into aligned memory
    /// first: on the stack for the common small header, else the heap).
    pub fn decode(bytes: &[u8]) -> Option<OpHeader> {
        const SMALL: usize = 256;
        if bytes.len() <= SMALL {
            let mut aligned = rkyv::util::Align([0u8; SMALL]);
            let buf = aligned.0.get_mut(..bytes.len())?;
            buf.copy_from_slice(bytes);
            return rkyv::from_bytes::<OpHeader, rkyv::rancor::Error>(buf).ok();
        }
        let mut aligned = rkyv::util::AlignedVec::<16>::with_capacity(bytes.len());
        aligned.extend_from_slice(bytes);
        rkyv::from_bytes::<OpHeader, rkyv::rancor::Error>(&aligned).ok()
    }

    /// The op kind, if the code is valid.
    pub fn op_kind(&self) -> Option<OpKind> {
        OpKind::from_code(self.kind)
    }

    fn describe(&self) -> String {
        let kind = self.op_kind().map(OpKind::name).unwrap_or("<invalid>");
        let dtype = DType::from_code(self.dtype)
            .map(DType::name)
            .unwrap_or("<invalid>");
        format!(
            "{kind}(dtype={dtype}, count={}, root={}, redop={}, counts={:?})",
            self.count,
            if self.root == u32::MAX {
                "-".to_string()
            } else {
                self.root.to_string()
            },
            self.redop,
            self.counts
        )
    }
}

/// Why a header set was rejected; `fatal` when the ranks are out of step
/// (different op kind or sequence), which leaves the links unusable.
#[derive(Debug, Clone, PartialEq)]
pub struct HeaderMismatch {
    /// Human-readable description naming the disagreeing ranks.
    pub detail: String,
    /// Whether the streams between ranks are desynchronised.
    pub fatal: bool,
}

/// Check the headers of a collective, indexed by rank (`headers[r]` is rank
/// `r`'s header). Pure and deterministic ([OP-1]).
///
/// [OP-1]: self#invariants
pub fn check_collective(headers: &[OpHeader]) -> Result<(), HeaderMismatch> {
    let Some(h0) = headers.first() else {
        return Ok(());
    };
    let n = headers.len();
    let fail = |detail: String| {
        Err(HeaderMismatch {
            detail,
            fatal: false,
        })
    };
    // Kind and sequence first: a difference there means the ranks are out of step.
    for (r, h) in headers.iter().enumerate() {
        if h.kind != h0.kind || h.seq != h0.seq || h.epoch != h0.epoch {
            return Err(HeaderMismatch {
                detail: format!(
                    "rank 0 issued {} (seq {}, epoch {}) but rank {r} issued {} (seq {}, epoch {})",
                    h0.describe(),
                    h0.seq,
                    h0.epoch,
                    h.describe(),
                    h.seq,
                    h.epoch
                ),
                fatal: true,
            });
        }
    }
    let kind = match h0.op_kind() {
        Some(k) => k,
        None => {
            return Err(HeaderMismatch {
                detail: format!("invalid op kind code {}", h0.kind),
                fatal: true,
            })
        }
    };
    // Compares with `same` (no allocation on the success path: this runs
    // on every op) and formats with `show` only to report a difference.
    let differ_by = |what: &str,
                     same: &dyn Fn(&OpHeader, &OpHeader) -> bool,
                     show: &dyn Fn(&OpHeader) -> String|
     -> Result<(), HeaderMismatch> {
        match headers
            .iter()
            .enumerate()
            .skip(1)
            .find(|(_, h)| !same(h0, h))
        {
            Some((r, h)) => fail(format!(
                "{what} differs: rank 0 has {}, rank {r} has {} (rank 0: {}, rank {r}: {})",
                show(h0),
                show(h),
                h0.describe(),
                h.describe()
            )),
            None => Ok(()),
        }
    };
    let count = || {
        differ_by("count", &|a, b| a.count == b.count, &|h| {
            h.count.to_string()
        })
    };
    let redop = || {
        differ_by("reduce op", &|a, b| a.redop == b.redop, &|h| {
            h.redop.to_string()
        })
    };
    let root = || differ_by("root", &|a, b| a.root == b.root, &|h| h.root.to_string());
    let counts = || {
        differ_by("split sizes", &|a, b| a.counts == b.counts, &|h| {
            format!("{:?}", h.counts)
        })
    };
    if kind != OpKind::Barrier {
        differ_by("dtype", &|a, b| a.dtype == b.dtype, &|h| {
            DType::from_code(h.dtype)
                .map(|d| d.name().to_string())
                .unwrap_or_else(|| format!("code {}", h.dtype))
        })?;
    }
    match kind {
        OpKind::AllReduce => {
            count()?;
            redop()?;
        }
        OpKind::Reduce => {
            root()?;
            count()?;
            redop()?;
        }
        OpKind::Broadcast => {
            root()?;
            count()?;
        }
        OpKind::ReduceScatter => {
            redop()?;
            counts()?;
            if h0.counts.len() != n {
                return fail(format!(
                    "split sizes have {} entries for {n} ranks",
                    h0.counts.len()
                ));
            }
        }
        OpKind::AllGather => {
            counts()?;
            if h0.counts.len() != n {
                return fail(format!(
                    "split sizes have {} entries for {n} ranks",
                    h0.counts.len()
                ));
            }
            for (r, h) in headers.iter().enumerate() {
                if h.count != h0.counts[r] {
                    return fail(format!(
                        "rank {r} contributes {} elements but the split sizes say {}",
                        h.count, h0.counts[r]
                    ));
                }
            }
        }
        OpKind::Scatter | OpKind::Gather => {
            root()?;
            count()?;
        }
        OpKind::AllToAll => {
            for (r, h) in headers.iter().enumerate() {
                if h.counts.len() != n {
                    return fail(format!(
                        "rank {r} passed {} tensors for {n} ranks",
                        h.counts.len()
                    ));
                }
            }
        }
        OpKind::AllToAllSingle => {
            // counts = send sizes (n) ++ recv sizes (n).
            for (r, h) in headers.iter().enumerate() {
                if h.counts.len() != 2 * n {
                    return fail(format!(
                        "rank {r} passed {} split sizes for {n} ranks",
                        h.counts.len() / 2
                    ));
                }
            }
            for (i, hi) in headers.iter().enumerate() {
                for (j, hj) in headers.iter().enumerate() {
                    let sent = hi.counts[j];
                    let expected = hj.counts[n + i];
                    if sent != expected {
                        return fail(format!(
                            "rank {i} sends {sent} elements to rank {j}, which expects {expected}"
                        ));
                    }
                }
            }
        }
        // Window sizes may differ per rank; the backend exchanges them.
        OpKind::Barrier | OpKind::NewWindow => {}
        OpKind::FreeWindow => differ_by("window", &|a, b| a.count == b.count, &|h| {
            h.count.to_string()
        })?,
        OpKind::P2P | OpKind::Window => {
            return Err(HeaderMismatch {
                detail: format!("{} header in a collective slot", kind.name()),
                fatal: true,
            })
        }
    }
    Ok(())
}

/// Check a point-to-point exchange between this rank and `peer`.
///
/// `mine` is the header this rank sent to `peer`; `theirs` the one received.
/// The transfers must pair up in order: each of my sends with one of their
/// receives of the same dtype and count, and vice versa. Symmetric, so both
/// ends reach the same verdict.
pub fn check_p2p(
    me: usize,
    peer: usize,
    mine: &OpHeader,
    theirs: &OpHeader,
) -> Result<(), HeaderMismatch> {
    if theirs.kind != OpKind::P2P as u8 || theirs.seq != mine.seq || theirs.epoch != mine.epoch {
        return Err(HeaderMismatch {
            detail: format!(
                "rank {me} issued point-to-point #{} with rank {peer}, which issued {} (seq {}, epoch {})",
                mine.seq,
                theirs.describe(),
                theirs.seq,
                theirs.epoch
            ),
            fatal: true,
        });
    }
    let dir = |sends: bool| -> Vec<(u8, u64)> {
        mine.p2p
            .iter()
            .filter(|t| t.0 == sends)
            .map(|t| (t.1, t.2))
            .collect()
    };
    let their = |sends: bool| -> Vec<(u8, u64)> {
        theirs
            .p2p
            .iter()
            .filter(|t| t.0 == sends)
            .map(|t| (t.1, t.2))
            .collect()
    };
    let show = |v: &[(u8, u64)]| -> String {
        v.iter()
            .map(|(d, c)| {
                format!(
                    "{}x{}",
                    c,
                    DType::from_code(*d).map(DType::name).unwrap_or("?")
                )
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let (my_sends, their_recvs) = (dir(true), their(false));
    if my_sends != their_recvs {
        return Err(HeaderMismatch {
            detail: format!(
                "rank {me} sends [{}] to rank {peer}, which receives [{}]",
                show(&my_sends),
                show(&their_recvs)
            ),
            fatal: false,
        });
    }
    let (my_recvs, their_sends) = (dir(false), their(true));
    if my_recvs != their_sends {
        return Err(HeaderMismatch {
            detail: format!(
                "rank {peer} sends [{}] to rank {me}, which receives [{}]",
                show(&their_sends),
                show(&my_recvs)
            ),
            fatal: false,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn header(counts: Vec<u64>, p2p: Vec<(bool, u8, u64)>) -> OpHeader {
        OpHeader {
            seq: 7,
            epoch: 2,
            kind: OpKind::AllToAllSingle as u8,
            dtype: 3,
            redop: u8::MAX,
            root: u32::MAX,
            count: 12,
            counts,
            p2p,
        }
    }

    proptest! {
        // Headers below and above the stack buffer decode alike.
        #[test]
        fn header_round_trips(counts in proptest::collection::vec(any::<u64>(), 0..80),
                              p2p in proptest::collection::vec(any::<(bool, u8, u64)>(), 0..20)) {
            let h = header(counts, p2p);
            prop_assert_eq!(OpHeader::decode(&h.encode()), Some(h));
        }

        // Untrusted bytes of any length (either side of the stack buffer)
        // never panic.
        #[test]
        fn untrusted_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..600)) {
            let _ = OpHeader::decode(&bytes);
        }
    }

    #[test]
    fn empty_input_is_refused() {
        assert_eq!(OpHeader::decode(&[]), None);
    }
}
