//! The records Chorus keeps in the rendezvous store besides plain values
//! (addresses, counters): failure notices, epoch-close decisions and the
//! pointer to a communicator's newest epoch.
//!
//! Each value is one validated rkyv archive of [`Record`], the same format as
//! the control-plane messages in [`wire`](super::wire). A value that does not
//! validate, or holds another kind of record than the reader expects, is
//! treated as absent by the readers, never as a panic.

use rkyv::rancor;
use rkyv::util::AlignedVec;

/// One store record. Ranks travel as `u64`.
#[derive(Debug, Clone, PartialEq, Eq, rkyv::Archive, rkyv::Serialize, rkyv::Deserialize)]
pub(crate) enum Record {
    /// A failure notice of one epoch of a communicator.
    Notice {
        /// Epoch the notice is about.
        epoch: u64,
        /// Rank that published it.
        by: u64,
        /// Ranks declared failed.
        failed_ranks: Vec<u64>,
        /// What was observed.
        detail: String,
        /// The ranks issued different ops (no rank failed): the notice
        /// ends the epoch with a mismatch.
        mismatch: bool,
    },
    /// The membership decision that closes an epoch.
    Closed {
        /// Whether a quorum of the old epoch survived.
        quorum: bool,
        /// Size of the closed epoch.
        old_size: u64,
        /// Old ranks that go on, ascending.
        survivors: Vec<u64>,
        /// How many joiners are admitted.
        joiners: u64,
        /// Each survivor's presence endpoint (`host:port`, empty for none),
        /// in `survivors` order: what the members probe while the epoch
        /// starts.
        presence: Vec<String>,
    },
    /// Where the newest epoch of a top-level communicator lives.
    Latest {
        /// The communicator's key base.
        base: String,
        /// Its newest epoch.
        epoch: u64,
    },
}

impl Record {
    /// Encode as a store value.
    pub(crate) fn encode(&self) -> Vec<u8> {
        // Serialising owned plain data into a growable buffer cannot fail;
        // an empty value (read back as malformed) is the safe fallback.
        rkyv::to_bytes::<rancor::Error>(self)
            .map(|v| v.to_vec())
            .unwrap_or_default()
    }

    /// Decode and validate a store value; `None` if it is not a record.
    pub(crate) fn decode(raw: &[u8]) -> Option<Record> {
        let mut aligned = AlignedVec::<16>::with_capacity(raw.len());
        aligned.extend_from_slice(raw);
        rkyv::from_bytes::<Record, rancor::Error>(&aligned).ok()
    }
}

/// Ranks as stored.
pub(crate) fn ranks_out(ranks: &[usize]) -> Vec<u64> {
    ranks.iter().map(|&r| r as u64).collect()
}

/// Ranks as read back; `None` if one does not fit this machine's `usize`.
pub(crate) fn ranks_in(ranks: &[u64]) -> Option<Vec<usize>> {
    ranks.iter().map(|&r| usize::try_from(r).ok()).collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn records_round_trip() {
        for r in [
            Record::Notice {
                epoch: 3,
                by: 1,
                failed_ranks: vec![2, 0],
                detail: "heartbeat | lost, with commas".into(),
                mismatch: false,
            },
            Record::Notice {
                epoch: 4,
                by: 0,
                failed_ranks: vec![],
                detail: "ranks issued different ops".into(),
                mismatch: true,
            },
            Record::Closed {
                quorum: true,
                old_size: 4,
                survivors: vec![0, 1, 3],
                joiners: 2,
                presence: vec!["127.0.0.1:4000".into(), String::new(), "[::1]:5".into()],
            },
            Record::Latest {
                base: "chorus/job/world/0".into(),
                epoch: 7,
            },
        ] {
            assert_eq!(Record::decode(&r.encode()), Some(r));
        }
        assert_eq!(Record::decode(b"3|1|2|old text format"), None);
        assert_eq!(Record::decode(&[]), None);
    }

    proptest! {
        #[test]
        fn decoding_arbitrary_bytes_never_panics(raw in proptest::collection::vec(any::<u8>(), 0..256)) {
            let _ = Record::decode(&raw);
        }
    }
}
