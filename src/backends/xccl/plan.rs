//! Pure-Rust parts of the NCCL/RCCL backend, unit-tested without a GPU:
//! dtype and reduce-op mapping, NCCL result codes, and how each [`OpData`]
//! becomes NCCL calls ([`Call`] plans), including all-to-all(v), gather,
//! scatter and uneven all-gather/reduce-scatter as grouped calls.
//!
//! # Invariants
//! - XP-1: a plan only names byte ranges inside the staged input (`In`) and
//!   output (`Out`) device buffers whose sizes [`Plan`] reports.
//! - XP-2: every `Send` to a peer in a plan is matched, in order, by a `Recv`
//!   from this rank in that peer's plan for the same op (all-to-all, gather,
//!   scatter and P2P are symmetric by construction).
//! - XP-3: bitwise reduce ops have no NCCL equivalent and are
//!   `UnsupportedOp`. On host buffers `Avg` and `PremulSum` never reach
//!   NCCL, because the executor pre/post-scales and passes their combining
//!   op (`Sum`); on device buffers they are `ncclAvg` (NCCL >= 2.10) and a
//!   `ncclRedOpCreatePreMulSum` op (NCCL >= 2.11), or `UnsupportedOp` on a
//!   library without them ([`nccl_device_op`]).

use std::ops::Range;

use super::sys::{ncclDataType_t, ncclRedOp_t, ncclResult_t};
use crate::backends::OpData;
use crate::error::{Error, Result};
use crate::op::ReduceOp;
use crate::tensor::DType;

/// `ncclDataType_t` for a Chorus dtype (every Chorus dtype has one; `Bool`
/// travels as `ncclUint8`, its 0/1 bytes reduced with max/min/xor).
pub fn nccl_dtype(d: DType) -> ncclDataType_t {
    match d {
        DType::I8 => 0,
        DType::U8 | DType::Bool => 1,
        DType::I32 => 2,
        DType::U32 => 3,
        DType::I64 => 4,
        DType::U64 => 5,
        DType::F16 => 6,
        DType::F32 => 7,
        DType::F64 => 8,
        DType::BF16 => 9,
    }
}

/// `ncclRedOp_t` for a combining op ([XP-3]).
///
/// # Errors
/// `UnsupportedOp` for `BAnd`/`BOr`/`BXor`.
///
/// [XP-3]: self#invariants
pub fn nccl_op(op: ReduceOp, dtype: DType) -> Result<ncclRedOp_t> {
    match op.combine_op() {
        ReduceOp::Sum => Ok(0),
        ReduceOp::Product => Ok(1),
        ReduceOp::Max => Ok(2),
        ReduceOp::Min => Ok(3),
        other => Err(Error::UnsupportedOp {
            op: format!("{other} (NCCL/RCCL have no bitwise reductions; use the cpu backend)"),
            dtype,
        }),
    }
}

/// The reduce op of an op on device buffers ([XP-3]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum DeviceRedOp {
    /// A built-in `ncclRedOp_t`.
    Builtin(ncclRedOp_t),
    /// `ncclRedOpCreatePreMulSum` with this scalar, created per op.
    PreMulSum(f64),
}

/// The NCCL reduce op for `op` on device buffers of `dtype` ([XP-3]):
/// `has_avg` when the library has `ncclAvg` (NCCL >= 2.10), `has_premul`
/// when it exports `ncclRedOpCreatePreMulSum`.
///
/// # Errors
/// `UnsupportedOp` for bitwise ops, and for `Avg`/`PremulSum` on a library
/// without them.
///
/// [XP-3]: self#invariants
pub fn nccl_device_op(
    op: ReduceOp,
    dtype: DType,
    has_avg: bool,
    has_premul: bool,
) -> Result<DeviceRedOp> {
    match op {
        ReduceOp::Avg if has_avg => Ok(DeviceRedOp::Builtin(super::sys::NCCL_AVG)),
        ReduceOp::PremulSum(s) if has_premul => Ok(DeviceRedOp::PreMulSum(s)),
        ReduceOp::Avg | ReduceOp::PremulSum(_) => Err(Error::UnsupportedOp {
            op: format!(
                "{op} on device tensors (needs ncclAvg, NCCL >= 2.10, and \
                 ncclRedOpCreatePreMulSum, NCCL >= 2.11; this library lacks it)"
            ),
            dtype,
        }),
        other => nccl_op(other, dtype).map(DeviceRedOp::Builtin),
    }
}

/// The bytes of one `dtype` element of value `s` (a PreMulSum scalar in
/// the element type, as NCCL reads it).
pub fn scalar_bytes(dtype: DType, s: f64) -> Vec<u8> {
    crate::tensor::Tensor::from_f64s(dtype, &[s])
        .as_bytes()
        .to_vec()
}

/// NCCL's name for a result code.
pub fn result_name(r: ncclResult_t) -> &'static str {
    match r {
        0 => "ncclSuccess",
        1 => "ncclUnhandledCudaError",
        2 => "ncclSystemError",
        3 => "ncclInternalError",
        4 => "ncclInvalidArgument",
        5 => "ncclInvalidUsage",
        6 => "ncclRemoteError",
        7 => "ncclInProgress",
        8 => "ncclTimeout",
        _ => "unknown ncclResult_t",
    }
}

/// Whether a result code means a peer (or the network to it) failed, so
/// the communicator must be aborted and the op reported as `PeerFailed`.
pub fn is_peer_failure(r: ncclResult_t) -> bool {
    matches!(r, 2 | 6)
}

/// Which staged device buffer a range refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Buf {
    /// The staged input (copied host → device before the calls).
    In,
    /// The staged output (copied device → host after the calls).
    Out,
}

/// One NCCL call; ranges are in elements of the op's dtype.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    /// `ncclAllReduce(In[r] -> Out[r])`.
    AllReduce(Range<usize>),
    /// `ncclReduce(In[src] -> Out[dst], root)`.
    Reduce {
        /// Source range in `In`.
        src: Range<usize>,
        /// Destination range in `Out` (same length).
        dst: Range<usize>,
        /// Root.
        root: usize,
    },
    /// `ncclBroadcast(buf[src] -> Out[dst], root)`; `src` is read on root only.
    Broadcast {
        /// Source buffer and range (root).
        src: (Buf, Range<usize>),
        /// Destination range in `Out`.
        dst: Range<usize>,
        /// Root.
        root: usize,
    },
    /// `ncclAllGather(In[0..n] -> Out[0..n*size])`.
    AllGather(usize),
    /// `ncclReduceScatter(In[0..n*size] -> Out[0..n])`.
    ReduceScatter(usize),
    /// `ncclSend(buf[r], peer)`.
    Send(Buf, Range<usize>, usize),
    /// `ncclRecv(Out[r], peer)`.
    Recv(Range<usize>, usize),
    /// Device-local copy `In[src] -> Out[dst]` (this rank's own block).
    Copy {
        /// Source range in `In`.
        src: Range<usize>,
        /// Destination range in `Out`.
        dst: Range<usize>,
    },
}

/// The staging and calls of one op.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// Elements of the staged input buffer.
    pub in_len: usize,
    /// Elements of the staged output buffer.
    pub out_len: usize,
    /// Calls, all issued inside one `ncclGroupStart/End` when `grouped`.
    pub calls: Vec<Call>,
    /// Whether the calls form one NCCL group.
    pub grouped: bool,
}

fn offsets(counts: &[usize]) -> Vec<usize> {
    let mut o = Vec::with_capacity(counts.len() + 1);
    let mut acc = 0;
    o.push(0);
    for c in counts {
        acc += c;
        o.push(acc);
    }
    o
}

/// The plan of a collective `data` on `rank` of `size` (everything but P2P,
/// which the backend plans byte-wise itself). The reduce op must already be
/// validated by [`nccl_op`].
pub fn plan(data: &OpData, rank: usize, size: usize) -> Plan {
    let single = |calls: Vec<Call>, in_len, out_len| Plan {
        in_len,
        out_len,
        calls,
        grouped: false,
    };
    match data {
        // Never given (Capabilities::list_all_to_all is false): the
        // executor hands it over as an AllToAll. Nothing to plan.
        OpData::AllToAllList { .. } => single(vec![], 0, 0),
        OpData::AllReduce { buf, .. } => {
            let n = buf.len();
            single(vec![Call::AllReduce(0..n)], n, n)
        }
        OpData::Reduce { buf, root, .. } => {
            let n = buf.len();
            single(
                vec![Call::Reduce {
                    src: 0..n,
                    dst: 0..n,
                    root: *root,
                }],
                n,
                n,
            )
        }
        OpData::Broadcast { buf, root } => {
            let n = buf.len();
            single(
                vec![Call::Broadcast {
                    src: (Buf::In, 0..n),
                    dst: 0..n,
                    root: *root,
                }],
                n,
                n,
            )
        }
        OpData::AllGather { input, counts, .. } => {
            let off = offsets(counts);
            let total = off[size.min(counts.len())];
            if counts.iter().all(|&c| c == input.len()) {
                return single(vec![Call::AllGather(input.len())], input.len(), total);
            }
            // Uneven blocks: one broadcast per rank, grouped.
            let calls = (0..counts.len())
                .map(|r| Call::Broadcast {
                    src: (Buf::In, 0..if r == rank { input.len() } else { 0 }),
                    dst: off[r]..off[r + 1],
                    root: r,
                })
                .collect();
            Plan {
                in_len: input.len(),
                out_len: total,
                calls,
                grouped: true,
            }
        }
        OpData::ReduceScatter { input, counts, .. } => {
            let off = offsets(counts);
            let mine = counts.get(rank).copied().unwrap_or(0);
            if counts.iter().all(|&c| c == mine) {
                return single(vec![Call::ReduceScatter(mine)], input.len(), mine);
            }
            // Uneven blocks: one reduce per block to its owner, grouped;
            // only the owner's destination is meaningful.
            let calls = (0..counts.len())
                .map(|r| Call::Reduce {
                    src: off[r]..off[r + 1],
                    dst: if r == rank {
                        0..mine
                    } else {
                        0..counts[r].min(mine)
                    },
                    root: r,
                })
                .filter(|c| matches!(c, Call::Reduce { src, .. } if !src.is_empty()))
                .collect();
            Plan {
                in_len: input.len(),
                // Non-owners need scratch as large as the largest block.
                out_len: counts.iter().copied().max().unwrap_or(0),
                calls: fix_scratch(calls, rank),
                grouped: true,
            }
        }
        OpData::Scatter {
            input,
            output,
            root,
        } => {
            let n = output.len();
            let mut calls = Vec::new();
            if rank == *root {
                for p in 0..size {
                    if p == rank {
                        calls.push(Call::Copy {
                            src: p * n..(p + 1) * n,
                            dst: 0..n,
                        });
                    } else {
                        calls.push(Call::Send(Buf::In, p * n..(p + 1) * n, p));
                    }
                }
            } else {
                calls.push(Call::Recv(0..n, *root));
            }
            Plan {
                in_len: input.len(),
                out_len: n,
                calls,
                grouped: true,
            }
        }
        OpData::Gather {
            input,
            output,
            root,
        } => {
            let n = input.len();
            let mut calls = Vec::new();
            if rank == *root {
                for p in 0..size {
                    if p == rank {
                        calls.push(Call::Copy {
                            src: 0..n,
                            dst: p * n..(p + 1) * n,
                        });
                    } else {
                        calls.push(Call::Recv(p * n..(p + 1) * n, p));
                    }
                }
            } else {
                calls.push(Call::Send(Buf::In, 0..n, *root));
            }
            Plan {
                in_len: n,
                out_len: output.len(),
                calls,
                grouped: true,
            }
        }
        OpData::AllToAll {
            input,
            output,
            send_counts,
            recv_counts,
        } => Plan {
            in_len: input.len(),
            out_len: output.len(),
            calls: all_to_all_calls(rank, send_counts, recv_counts),
            grouped: true,
        },
        OpData::Barrier | OpData::P2P { .. } => Plan {
            in_len: 0,
            out_len: 0,
            calls: vec![],
            grouped: false,
        },
    }
}

/// Non-owner destinations of an uneven reduce-scatter all start at 0 of the
/// scratch output; the owner's is `0..mine` too (it is the real output).
fn fix_scratch(calls: Vec<Call>, _rank: usize) -> Vec<Call> {
    calls
        .into_iter()
        .map(|c| match c {
            Call::Reduce { src, root, .. } => Call::Reduce {
                dst: 0..src.len(),
                src,
                root,
            },
            other => other,
        })
        .collect()
}

/// All-to-all(v) as grouped send/recv ([XP-2]): to every peer `j` send block
/// `j` of the input and receive block `j` of the output; the own block is a
/// local copy. Empty blocks make no call.
///
/// [XP-2]: self#invariants
pub fn all_to_all_calls(rank: usize, send_counts: &[usize], recv_counts: &[usize]) -> Vec<Call> {
    let so = offsets(send_counts);
    let ro = offsets(recv_counts);
    let mut calls = Vec::new();
    for j in 0..send_counts.len().min(recv_counts.len()) {
        if j == rank {
            if recv_counts[j] > 0 {
                calls.push(Call::Copy {
                    src: so[j]..so[j + 1],
                    dst: ro[j]..ro[j + 1],
                });
            }
            continue;
        }
        if send_counts[j] > 0 {
            calls.push(Call::Send(Buf::In, so[j]..so[j + 1], j));
        }
        if recv_counts[j] > 0 {
            calls.push(Call::Recv(ro[j]..ro[j + 1], j));
        }
    }
    calls
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Tensor;

    #[test]
    fn every_dtype_maps_to_a_distinct_nccl_type() {
        let mut seen: Vec<_> = DType::ALL.iter().map(|&d| nccl_dtype(d)).collect();
        seen.sort();
        seen.dedup();
        assert_eq!(seen, (0..10).collect::<Vec<_>>());
        assert_eq!(nccl_dtype(DType::F32), 7);
        assert_eq!(nccl_dtype(DType::BF16), 9);
    }

    #[test]
    fn xp_3_premul_and_avg_reduce_as_sum_and_bitwise_ops_are_unsupported() {
        assert_eq!(nccl_op(ReduceOp::PremulSum(3.0), DType::F32).unwrap(), 0);
        assert_eq!(nccl_op(ReduceOp::Avg, DType::F32).unwrap(), 0);
        assert_eq!(nccl_op(ReduceOp::Max, DType::I8).unwrap(), 2);
        assert_eq!(nccl_op(ReduceOp::Min, DType::I8).unwrap(), 3);
        assert_eq!(nccl_op(ReduceOp::Product, DType::F64).unwrap(), 1);
        for op in [ReduceOp::BAnd, ReduceOp::BOr, ReduceOp::BXor] {
            assert!(matches!(
                nccl_op(op, DType::I32),
                Err(Error::UnsupportedOp { .. })
            ));
        }
    }

    #[test]
    fn xp_3_device_avg_and_premul_are_native_or_unsupported() {
        assert_eq!(
            nccl_device_op(ReduceOp::Avg, DType::F32, true, true).unwrap(),
            DeviceRedOp::Builtin(4)
        );
        assert_eq!(
            nccl_device_op(ReduceOp::PremulSum(0.5), DType::F16, true, true).unwrap(),
            DeviceRedOp::PreMulSum(0.5)
        );
        assert_eq!(
            nccl_device_op(ReduceOp::Max, DType::I32, false, false).unwrap(),
            DeviceRedOp::Builtin(2)
        );
        for op in [ReduceOp::Avg, ReduceOp::PremulSum(2.0), ReduceOp::BXor] {
            assert!(matches!(
                nccl_device_op(op, DType::F32, false, false),
                Err(Error::UnsupportedOp { .. })
            ));
        }
        assert_eq!(scalar_bytes(DType::F32, 2.0), 2.0f32.to_le_bytes().to_vec());
        assert_eq!(
            scalar_bytes(DType::F16, 1.0),
            half::f16::ONE.to_bits().to_le_bytes().to_vec()
        );
    }

    #[test]
    fn result_codes_have_names_and_peer_failures_are_classified() {
        assert_eq!(result_name(0), "ncclSuccess");
        assert_eq!(result_name(7), "ncclInProgress");
        assert_eq!(result_name(99), "unknown ncclResult_t");
        assert!(is_peer_failure(6) && is_peer_failure(2));
        assert!(!is_peer_failure(4));
    }

    /// [XP-2]: for every ordered pair, what `i` sends to `j` is what `j`
    /// receives from `i`, in size.
    ///
    /// [XP-2]: self#invariants
    #[test]
    fn xp_2_all_to_all_v_sends_match_receives() {
        let size = 4;
        let send: Vec<Vec<usize>> = (0..size)
            .map(|i| (0..size).map(|j| (i * 7 + j * 3) % 5).collect())
            .collect();
        let recv: Vec<Vec<usize>> = (0..size)
            .map(|j| (0..size).map(|i| send[i][j]).collect())
            .collect();
        let plans: Vec<_> = (0..size)
            .map(|r| all_to_all_calls(r, &send[r], &recv[r]))
            .collect();
        for i in 0..size {
            for j in 0..size {
                let sent: Vec<usize> = plans[i]
                    .iter()
                    .filter_map(|c| match c {
                        Call::Send(_, r, p) if *p == j => Some(r.len()),
                        _ => None,
                    })
                    .collect();
                let got: Vec<usize> = plans[j]
                    .iter()
                    .filter_map(|c| match c {
                        Call::Recv(r, p) if *p == i => Some(r.len()),
                        _ => None,
                    })
                    .collect();
                assert_eq!(sent, got, "{i}->{j}");
                if i == j {
                    assert!(sent.is_empty());
                }
            }
        }
    }

    #[test]
    fn even_all_gather_is_one_call_and_uneven_is_grouped_broadcasts() {
        let even = OpData::AllGather {
            input: Tensor::zeros(DType::F32, 3),
            output: Tensor::zeros(DType::F32, 9),
            counts: vec![3, 3, 3],
            in_place: false,
        };
        let p = plan(&even, 1, 3);
        assert_eq!(p.calls, vec![Call::AllGather(3)]);
        assert!(!p.grouped);
        let uneven = OpData::AllGather {
            input: Tensor::zeros(DType::F32, 2),
            output: Tensor::zeros(DType::F32, 6),
            counts: vec![1, 2, 3],
            in_place: false,
        };
        let p = plan(&uneven, 1, 3);
        assert!(p.grouped);
        assert_eq!(p.out_len, 6);
        assert_eq!(
            p.calls[1],
            Call::Broadcast {
                src: (Buf::In, 0..2),
                dst: 1..3,
                root: 1
            }
        );
    }

    /// [XP-1]: every range of every plan lies inside its staged buffer.
    ///
    /// [XP-1]: self#invariants
    #[test]
    #[allow(clippy::single_range_in_vec_init)]
    fn xp_1_plans_stay_inside_staged_buffers() {
        let size = 3;
        for rank in 0..size {
            let datas = vec![
                OpData::ReduceScatter {
                    input: Tensor::zeros(DType::F32, 6),
                    output: Tensor::zeros(DType::F32, [1, 2, 3][rank]),
                    counts: vec![1, 2, 3],
                    op: ReduceOp::Sum,
                },
                OpData::Scatter {
                    input: Tensor::zeros(DType::F32, if rank == 0 { 6 } else { 0 }),
                    output: Tensor::zeros(DType::F32, 2),
                    root: 0,
                },
                OpData::Gather {
                    input: Tensor::zeros(DType::F32, 2),
                    output: Tensor::zeros(DType::F32, if rank == 2 { 6 } else { 0 }),
                    root: 2,
                },
            ];
            for d in &datas {
                let p = plan(d, rank, size);
                for c in &p.calls {
                    let (ins, outs): (Vec<Range<usize>>, Vec<Range<usize>>) = match c {
                        Call::AllReduce(r) => (vec![r.clone()], vec![r.clone()]),
                        Call::Reduce { src, dst, .. } | Call::Copy { src, dst } => {
                            (vec![src.clone()], vec![dst.clone()])
                        }
                        Call::Broadcast { dst, .. } => (vec![], vec![dst.clone()]),
                        Call::AllGather(n) => (vec![0..*n], vec![0..n * size]),
                        Call::ReduceScatter(n) => (vec![0..n * size], vec![0..*n]),
                        Call::Send(_, r, _) => (vec![r.clone()], vec![]),
                        Call::Recv(r, _) => (vec![], vec![r.clone()]),
                    };
                    assert!(ins.iter().all(|r| r.end <= p.in_len), "{d:?} {c:?}");
                    assert!(outs.iter().all(|r| r.end <= p.out_len), "{d:?} {c:?}");
                }
            }
        }
    }
}
