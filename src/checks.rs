//! Cross-rank consistency checks: how a communicator finds that its ranks
//! issued different ops, and the 64-bit op fingerprint that carries the check
//! with the data.
//!
//! Every rank of a communicator must issue the same collectives, in the same
//! order, with the same parameters. [`Checks`] says how that is verified:
//!
//! - [`Checks::Strict`]: before any byte of an op moves, every participant
//!   sends every other one its [`OpHeader`](crate::op::OpHeader) and all of
//!   them apply the same rule ([`crate::op::check_collective`]). A mismatch
//!   is found before any data moves, is reported on every rank with the
//!   field that differs, and leaves the communicator usable. It costs an
//!   all-to-all exchange and a full barrier per op: for debugging.
//! - [`Checks::Fingerprint`]: an op's signature (sequence number, epoch,
//!   kind, dtype, reduce op, root, count and a hash of per-rank counts, as
//!   far as the op requires them to agree) is hashed into a 64-bit
//!   [`fingerprint`]. A backend that can ([`Capabilities::in_band_checks`])
//!   stamps it on every data message of the op and checks it on every
//!   message it receives, before it uses a byte; the op sends only its
//!   algorithm's messages. A disagreement is a fatal
//!   [`Error::Mismatch`]: the rank that finds it
//!   aborts the communicator, and the abort reaches its peers over the data
//!   links as a mismatch. Every rank also announces a hash of its op
//!   history with its heartbeats, and a mismatch that no message reveals
//!   is found there (see "Mismatches" in docs/runtime-semantics.md). A backend that does not
//!   run ops without the exchange
//!   ([`Capabilities::headerless_ops`]) keeps it in this mode.
//!
//! [`Capabilities::headerless_ops`]: crate::backends::Capabilities::headerless_ops
//! - [`Checks::Off`]: no check at all (frames carry a zero fingerprint),
//!   for measurement.
//!
//! The mode comes from [`CommOptions::checks`](crate::CommOptions::checks),
//! whose default reads `CHORUS_CHECKS` (`strict`, `fingerprint` or `off`),
//! else [`Checks::Fingerprint`].
//! Every rank must use the same mode; ranks that do not are out of step on
//! their first op with more than one rank (a fatal `Mismatch`).
//!
//! # Invariants
//! - CK-1: [`fingerprint`] depends only on the fields [`check_collective`]
//!   requires to agree for the op's kind (and on the sequence number and
//!   epoch), so ranks whose strict check would pass compute the same
//!   fingerprint, and a field the check compares changes it.
//! - CK-2: a fingerprint is never 0; 0 on a frame means "not checked"
//!   ([`Checks::Off`]).
//! - CK-3: hashing costs O(1) per op, except for ops with per-rank counts
//!   (all_gather_v, reduce_scatter_v), which hash their O(N) counts once.
//!
//! [`check_collective`]: crate::op::check_collective
//! [`Capabilities::in_band_checks`]: crate::backends::Capabilities::in_band_checks

use crate::error::{Error, Result};
use crate::op::OpKind;
use crate::tensor::DType;

/// The environment variable the default [`Checks`] mode is read from.
pub const CHECKS_ENV: &str = "CHORUS_CHECKS";

/// How a communicator checks that its ranks issued the same op (see the
/// [module docs](self)).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Checks {
    /// Every rank's op header reaches every other rank before any data
    /// moves; a mismatch names the field and leaves the communicator usable.
    Strict,
    /// A 64-bit fingerprint of the op rides on every data message and is
    /// checked on receipt; a mismatch aborts the communicator. The default.
    #[default]
    Fingerprint,
    /// No check (for measurement).
    Off,
}

impl Checks {
    /// The mode's name, as `CHORUS_CHECKS` spells it.
    pub const fn name(self) -> &'static str {
        match self {
            Checks::Strict => "strict",
            Checks::Fingerprint => "fingerprint",
            Checks::Off => "off",
        }
    }
}

/// Parse a `CHORUS_CHECKS` value: `strict`, `fingerprint` or `off` (any case).
///
/// ```
/// use chorus::checks::{parse_checks, Checks};
/// assert_eq!(parse_checks("Fingerprint").unwrap(), Checks::Fingerprint);
/// assert!(parse_checks("loose").is_err());
/// ```
///
/// # Errors
/// [`Error::Config`] naming the variable and the accepted values.
pub fn parse_checks(v: &str) -> Result<Checks> {
    match v.trim().to_ascii_lowercase().as_str() {
        "strict" => Ok(Checks::Strict),
        "fingerprint" => Ok(Checks::Fingerprint),
        "off" => Ok(Checks::Off),
        other => Err(Error::Config(format!(
            "{CHECKS_ENV}={other:?}: expected strict, fingerprint or off"
        ))),
    }
}

/// The fields of a collective that its ranks must agree on, borrowed from
/// the request (nothing is copied to build it).
#[derive(Debug, Clone, Copy)]
pub struct Signature<'a> {
    /// Collective sequence number.
    pub seq: u64,
    /// Communicator epoch.
    pub epoch: u64,
    /// Op kind.
    pub kind: OpKind,
    /// Element type.
    pub dtype: DType,
    /// [`ReduceOp::code`](crate::ReduceOp::code), `u8::MAX` without one.
    pub redop: u8,
    /// Root rank, `u32::MAX` for rootless ops.
    pub root: u32,
    /// This rank's element count.
    pub count: u64,
    /// Per-rank counts (split sizes), empty where the op has none.
    pub counts: &'a [usize],
}

/// SplitMix64's finaliser: every input bit affects every output bit.
const fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Fold `x` into the running hash `h`.
const fn fold(h: u64, x: u64) -> u64 {
    mix(h ^ mix(x.wrapping_add(0x9e37_79b9_7f4a_7c15)))
}

/// Never 0 ([CK-2](self#invariants)).
const fn nonzero(h: u64) -> u64 {
    if h == 0 {
        1
    } else {
        h
    }
}

/// The 64-bit fingerprint of a collective ([CK-1](self#invariants)): the
/// sequence number, epoch and kind, and of the other fields those the
/// strict check compares for that kind. all_to_all's split sizes agree only
/// pair by pair, so they are left out; the receiver checks every message's
/// length instead. Never 0.
pub fn fingerprint(s: &Signature<'_>) -> u64 {
    let mut h = fold(fold(fold(0, s.seq), s.epoch), s.kind as u64);
    if s.kind != OpKind::Barrier {
        h = fold(h, s.dtype.code() as u64);
    }
    let counts = |h: u64| {
        let mut c = fold(0, s.counts.len() as u64);
        for &x in s.counts {
            c = fold(c, x as u64);
        }
        fold(h, c)
    };
    h = match s.kind {
        OpKind::AllReduce => fold(fold(h, s.count), s.redop as u64),
        OpKind::Reduce => fold(fold(fold(h, s.count), s.redop as u64), s.root as u64),
        OpKind::Broadcast | OpKind::Scatter | OpKind::Gather => {
            fold(fold(h, s.count), s.root as u64)
        }
        OpKind::ReduceScatter => counts(fold(h, s.redop as u64)),
        OpKind::AllGather => counts(h),
        OpKind::FreeWindow => fold(h, s.count),
        OpKind::AllToAll
        | OpKind::AllToAllSingle
        | OpKind::Barrier
        | OpKind::NewWindow
        | OpKind::P2P
        | OpKind::Window => h,
    };
    nonzero(h)
}

/// The history hash after an op: `prev` (the hash after the op before it,
/// 0 before the first) folded with the op's fingerprint. Two ranks whose
/// hashes after op `s` agree issued the same ops up to `s`, but with
/// probability about 2^-64.
pub fn chain(prev: u64, fp: u64) -> u64 {
    fold(prev, fp)
}

/// The fingerprint of the `index`-th message between two ranks in one
/// point-to-point batch: the pair's sequence number, the epoch, the element
/// type and the message's length in bytes. The sender and the receiver
/// compute it alike from their own side of the transfer. Never 0.
pub fn p2p_fingerprint(epoch: u64, seq: u64, index: usize, dtype: DType, bytes: usize) -> u64 {
    let h = fold(fold(0, seq), epoch);
    let h = fold(fold(h, OpKind::P2P as u64), index as u64);
    nonzero(fold(fold(h, dtype.code() as u64), bytes as u64))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::op::{check_collective, OpHeader};

    fn sig(kind: OpKind) -> Signature<'static> {
        Signature {
            seq: 7,
            epoch: 1,
            kind,
            dtype: DType::F32,
            redop: 0,
            root: 2,
            count: 4,
            counts: &[4, 4],
        }
    }

    fn header(s: &Signature<'_>) -> OpHeader {
        OpHeader {
            seq: s.seq,
            epoch: s.epoch,
            kind: s.kind as u8,
            dtype: s.dtype.code(),
            redop: s.redop,
            root: s.root,
            count: s.count,
            counts: s.counts.iter().map(|&c| c as u64).collect(),
            p2p: vec![],
        }
    }

    /// CK-1: for every kind and every field, the fingerprints of two
    /// signatures differ exactly when the strict check (or the sequence
    /// number or epoch) tells them apart.
    #[test]
    fn ck_1_fingerprints_differ_where_the_strict_check_does() {
        let kinds = [
            OpKind::AllReduce,
            OpKind::Reduce,
            OpKind::ReduceScatter,
            OpKind::AllGather,
            OpKind::Broadcast,
            OpKind::Scatter,
            OpKind::Gather,
            OpKind::Barrier,
            OpKind::FreeWindow,
        ];
        let other_counts = [4usize, 5];
        for kind in kinds {
            let base = sig(kind);
            let variants: Vec<(&str, Signature<'_>)> = vec![
                ("seq", Signature { seq: 8, ..base }),
                ("epoch", Signature { epoch: 2, ..base }),
                (
                    "dtype",
                    Signature {
                        dtype: DType::F64,
                        ..base
                    },
                ),
                ("redop", Signature { redop: 3, ..base }),
                ("root", Signature { root: 1, ..base }),
                ("count", Signature { count: 17, ..base }),
                (
                    "counts",
                    Signature {
                        counts: &other_counts,
                        ..base
                    },
                ),
            ];
            for (what, v) in variants {
                // all_gather's own count is checked against the split
                // sizes, so keep them consistent in that pair.
                let hs = [header(&base), header(&v)];
                let strict_differs = check_collective(&hs).is_err()
                    && !(kind == OpKind::AllGather && what == "count");
                let fp_differs = fingerprint(&base) != fingerprint(&v);
                if kind == OpKind::AllGather && what == "count" {
                    assert!(!fp_differs, "{kind:?}: own count is not in the fingerprint");
                    continue;
                }
                assert_eq!(
                    fp_differs, strict_differs,
                    "{kind:?}, {what}: fingerprint differs {fp_differs}, strict check differs {strict_differs}"
                );
            }
            assert_eq!(fingerprint(&base), fingerprint(&sig(kind)));
        }
    }

    #[test]
    fn ck_2_fingerprints_are_never_zero_and_kinds_differ() {
        let a = fingerprint(&sig(OpKind::AllReduce));
        let b = fingerprint(&sig(OpKind::Broadcast));
        assert_ne!(a, 0);
        assert_ne!(a, b);
        assert_ne!(p2p_fingerprint(0, 0, 0, DType::U8, 0), 0);
        assert_ne!(
            p2p_fingerprint(0, 3, 0, DType::I32, 40),
            p2p_fingerprint(0, 3, 0, DType::I32, 36)
        );
        assert_ne!(
            p2p_fingerprint(0, 3, 0, DType::I32, 40),
            p2p_fingerprint(0, 3, 1, DType::I32, 40)
        );
    }

    #[test]
    fn checks_parse_names_the_variable() {
        for c in [Checks::Strict, Checks::Fingerprint, Checks::Off] {
            assert_eq!(parse_checks(c.name()).unwrap(), c);
        }
        let e = parse_checks("sometimes").unwrap_err();
        assert!(e.to_string().contains(CHECKS_ENV), "{e}");
    }
}
