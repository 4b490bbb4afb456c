//! Hints: free-form `key = value` strings attached to a communicator
//! ([`CommOptions::hints`](crate::CommOptions::hints)) or to the ops of one
//! handle ([`Comm::with_hints`](crate::Comm::with_hints)), like TorchComms'
//! `hints` dictionaries.
//!
//! A few keys are known to Chorus (the constants of this module); their
//! values are checked when the hints are given, and a malformed value is
//! [`Error::InvalidArgument`]. Every other key is kept, readable with
//! [`Comm::get_hint`](crate::Comm::get_hint), and otherwise ignored, so a
//! program can carry hints meant for another backend or another version.
//!
//! # Invariants
//! - HN-1: a handle's hints are its communicator's hints overlaid with those
//!   of every `with_hints` call that made it, later calls winning per key.
//! - HN-2: known keys are validated once, when given; an op never fails
//!   because of a hint.

use std::collections::BTreeMap;
use std::str::FromStr;
use std::sync::Arc;

use crate::error::{Error, Result};

/// A label carried by every op issued with it: pre hooks see it
/// ([`PreHookArgs::tag`](crate::PreHookArgs::tag)) and the flight recorder
/// stores it ([`FlightEntry::tag`](crate::FlightEntry::tag)). Any string.
pub const TAG: &str = "chorus.tag";

/// Whether the flight recorder records the ops issued with it: `true` (the
/// default) or `false`, e.g. to keep a hot loop of tiny ops from pushing
/// the interesting ones out of the ring. Hooks see the ops either way.
pub const RECORD: &str = "chorus.record";

/// The hints of a communicator or a handle, with the known ones parsed.
#[derive(Debug, Clone)]
pub(crate) struct Hints {
    pub(crate) map: Arc<BTreeMap<String, String>>,
    /// [`TAG`].
    pub(crate) tag: Option<Arc<str>>,
    /// [`RECORD`] (true unless set to false).
    pub(crate) record: bool,
}

impl Default for Hints {
    fn default() -> Hints {
        Hints {
            map: Arc::default(),
            tag: None,
            record: true,
        }
    }
}

impl Hints {
    /// Parse `map`, checking the known keys.
    pub(crate) fn parse(map: BTreeMap<String, String>, comm: &str, rank: usize) -> Result<Hints> {
        let record = match map.get(RECORD) {
            None => true,
            Some(v) => parse_value::<bool>(v, RECORD, comm, rank, "true or false")?,
        };
        let tag = map.get(TAG).map(|t| Arc::from(t.as_str()));
        Ok(Hints {
            map: Arc::new(map),
            tag,
            record,
        })
    }

    /// These hints overlaid with `over`, checked.
    pub(crate) fn overlay(
        &self,
        over: BTreeMap<String, String>,
        comm: &str,
        rank: usize,
    ) -> Result<Hints> {
        let mut map = (*self.map).clone();
        map.extend(over);
        Hints::parse(map, comm, rank)
    }

    /// The value of `key` as a `T`.
    pub(crate) fn get<T: FromStr>(&self, key: &str, comm: &str, rank: usize) -> Result<Option<T>> {
        self.map
            .get(key)
            .map(|v| parse_value(v, key, comm, rank, std::any::type_name::<T>()))
            .transpose()
    }
}

fn parse_value<T: FromStr>(v: &str, key: &str, comm: &str, rank: usize, want: &str) -> Result<T> {
    v.trim().parse().map_err(|_| Error::InvalidArgument {
        comm: comm.to_string(),
        rank,
        op: "hints",
        reason: format!("hint {key:?} = {v:?} is not a valid value (expected {want})"),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn hn_2_known_hints_are_checked_and_unknown_ones_kept() {
        let h = Hints::parse(map(&[(TAG, "step 3"), ("nccl.algo", "ring")]), "c", 0).unwrap();
        assert_eq!(h.tag.as_deref(), Some("step 3"));
        assert!(h.record);
        assert_eq!(
            h.get::<String>("nccl.algo", "c", 0).unwrap().as_deref(),
            Some("ring")
        );
        assert_eq!(h.get::<u32>("absent", "c", 0).unwrap(), None);
        match Hints::parse(map(&[(RECORD, "maybe")]), "c", 1) {
            Err(Error::InvalidArgument { rank, reason, .. }) => {
                assert_eq!(rank, 1);
                assert!(reason.contains("chorus.record"), "{reason}");
            }
            other => panic!("expected InvalidArgument, got {other:?}"),
        }
        assert!(matches!(
            h.get::<u32>("nccl.algo", "c", 0),
            Err(Error::InvalidArgument { .. })
        ));
    }

    #[test]
    fn hn_1_later_hints_win_per_key() {
        let base = Hints::parse(map(&[(TAG, "a"), ("x", "1")]), "c", 0).unwrap();
        let h = base
            .overlay(map(&[(TAG, "b"), (RECORD, "false")]), "c", 0)
            .unwrap();
        assert_eq!(h.tag.as_deref(), Some("b"));
        assert!(!h.record);
        assert_eq!(h.get::<u8>("x", "c", 0).unwrap(), Some(1));
        assert!(base.overlay(map(&[(RECORD, "no")]), "c", 0).is_err());
    }
}
