//! The flight recorder: a per-communicator ring of the last ops, in the
//! spirit of TorchComms' (and PyTorch NCCL's) `fr_trace`.
//!
//! Every op issued on a communicator gets one [`FlightEntry`] when it is
//! issued (`queued`), updated when its turn starts (`started`, with its
//! sequence number) and when it completes (`completed`, or `failed` with the
//! error's text). The ring keeps the last
//! [`CommOptions::flight_recorder_size`](crate::CommOptions::flight_recorder_size)
//! entries (2000 by default; 0 turns the recorder off).
//! [`Comm::flight_record`](crate::Comm::flight_record) returns a snapshot,
//! and when the communicator is aborted and
//! [`CommOptions::flight_recorder_dir`](crate::CommOptions::flight_recorder_dir)
//! (`CHORUS_FLIGHT_RECORDER_DIR`) is set, the ring is written there as JSON
//! ([`dump_file_name`]) before the ops still queued are failed. The format
//! is described in `docs/observability.md`.
//!
//! # Invariants
//! - FR-1: entries are in issue order with consecutive `id`s; an entry
//!   pushed out of the ring is gone, and [`FlightDump::dropped`] counts them.
//! - FR-2: an entry's state only moves forward (queued → started →
//!   completed / failed), and it reaches completed or failed before the
//!   op's `Work` does, so a caller that waited on an op sees it finished.
//! - FR-3: recording never blocks on anything but the ring's own short
//!   critical section; the dump runs off the communicator's threads, bounded
//!   by [`DUMP_DEADLINE`].

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use serde::Serialize;

use crate::tensor::DType;

/// The default number of ops a communicator's flight recorder keeps.
pub const DEFAULT_FLIGHT_RECORDER_SIZE: usize = 2000;

/// The version of the dump's JSON format ([`FlightDump::version`]).
pub const DUMP_FORMAT_VERSION: u32 = 1;

/// How long an aborting communicator waits for its dump to be written.
pub const DUMP_DEADLINE: Duration = Duration::from_secs(5);

/// Where an op is in its life.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FlightState {
    /// Issued, waiting for its turn.
    Queued,
    /// Its turn started: it is exchanging headers or moving data.
    Started,
    /// Completed successfully.
    Completed,
    /// Completed with an error ([`FlightEntry::error`]).
    Failed,
}

/// One op in the flight recorder.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FlightEntry {
    /// Position in this communicator's record, from 0, in issue order.
    pub id: u64,
    /// The op's process-wide id, as hooks see it ([`crate::PreHookArgs::op_id`]).
    pub op_id: u64,
    /// The op's sequence number, once its turn started: the collective
    /// number, or for point-to-point ops the per-peer number of the first
    /// transfer. `None` while queued, or if the op never ran.
    pub seq: Option<u64>,
    /// The op's name (`all_reduce`, `send`, `batch_p2p`, ...).
    pub op: &'static str,
    /// Element type.
    #[serde(serialize_with = "display")]
    pub dtype: DType,
    /// This rank's element count (for point-to-point, of all transfers).
    pub count: usize,
    /// This rank's payload in bytes.
    pub bytes: usize,
    /// The root of a rooted collective.
    pub root: Option<usize>,
    /// The peers of a point-to-point op (empty for collectives).
    pub peers: Vec<usize>,
    /// The op's [`crate::hints::TAG`] hint.
    pub tag: Option<String>,
    /// Where the op is.
    pub state: FlightState,
    /// The error's text, when [`FlightState::Failed`].
    pub error: Option<String>,
    /// When it was issued, in microseconds since the Unix epoch.
    pub issued_us: u64,
    /// When its turn started.
    pub started_us: Option<u64>,
    /// When it completed or failed.
    pub completed_us: Option<u64>,
}

fn display<S: serde::Serializer>(d: &DType, s: S) -> Result<S::Ok, S::Error> {
    s.collect_str(d)
}

/// The JSON document written when a communicator is aborted.
#[derive(Debug, Clone, Serialize)]
pub struct FlightDump {
    /// [`DUMP_FORMAT_VERSION`].
    pub version: u32,
    /// The communicator's name.
    pub comm: String,
    /// This rank.
    pub rank: usize,
    /// Number of ranks.
    pub size: usize,
    /// The communicator's epoch.
    pub epoch: u64,
    /// The backend's name.
    pub backend: String,
    /// Why the communicator was aborted.
    pub cause: Option<String>,
    /// When the dump was taken, in microseconds since the Unix epoch.
    pub dumped_us: u64,
    /// How many entries the ring holds at most.
    pub capacity: usize,
    /// How many older entries were pushed out of the ring.
    pub dropped: u64,
    /// The entries, oldest first.
    pub entries: Vec<FlightEntry>,
}

/// One op as the ring holds it: the fields of a [`FlightEntry`], with the
/// times as the clock's `Instant`s and the peers and tag in forms that
/// recording copies without allocating. A slot is overwritten in place
/// when the ring wraps; [`Slot::entry`] turns it into the public entry.
struct Slot {
    id: u64,
    op_id: u64,
    seq: Option<u64>,
    op: &'static str,
    dtype: DType,
    count: usize,
    bytes: usize,
    root: Option<usize>,
    peers: Peers,
    tag: Option<Arc<str>>,
    state: FlightState,
    error: Option<String>,
    issued: Instant,
    started: Option<Instant>,
    completed: Option<Instant>,
}

impl Slot {
    fn new(id: u64, op_id: u64, desc: &OpDesc, tag: Option<&Arc<str>>, now: Instant) -> Slot {
        Slot {
            id,
            op_id,
            seq: None,
            op: desc.op,
            dtype: desc.dtype,
            count: desc.count,
            bytes: desc.bytes,
            root: desc.root,
            peers: desc.peers.clone(),
            tag: tag.cloned(),
            state: FlightState::Queued,
            error: None,
            issued: now,
            started: None,
            completed: None,
        }
    }

    /// Make this slot entry `id`, reusing what it holds: no allocation
    /// unless the new op has more peers than a slot holds inline.
    fn reuse(&mut self, id: u64, op_id: u64, desc: &OpDesc, tag: Option<&Arc<str>>, now: Instant) {
        self.id = id;
        self.op_id = op_id;
        self.seq = None;
        self.op = desc.op;
        self.dtype = desc.dtype;
        self.count = desc.count;
        self.bytes = desc.bytes;
        self.root = desc.root;
        self.peers.clear();
        self.peers.extend_from_slice(&desc.peers);
        if self.tag.as_ref().map(Arc::as_ptr) != tag.map(Arc::as_ptr) {
            self.tag = tag.cloned();
        }
        self.state = FlightState::Queued;
        self.error = None;
        self.issued = now;
        self.started = None;
        self.completed = None;
    }

    fn entry(&self, us: impl Fn(Instant) -> u64) -> FlightEntry {
        FlightEntry {
            id: self.id,
            op_id: self.op_id,
            seq: self.seq,
            op: self.op,
            dtype: self.dtype,
            count: self.count,
            bytes: self.bytes,
            root: self.root,
            peers: self.peers.to_vec(),
            tag: self.tag.as_deref().map(str::to_string),
            state: self.state,
            error: self.error.clone(),
            issued_us: us(self.issued),
            started_us: self.started.map(&us),
            completed_us: self.completed.map(&us),
        }
    }
}

/// The ring: entry `id` lives in `slots[id % capacity]` while it is one of
/// the last `capacity` ids. O(capacity) memory (reserved at the start up
/// to 4 096 slots, grown past that as ops arrive); O(1) per record and
/// update.
struct Ring {
    slots: Vec<Slot>,
    /// The id the next entry gets.
    next: u64,
}

impl Ring {
    /// The slot of entry `id`, if it is still in the ring.
    fn get_mut(&mut self, id: u64) -> Option<&mut Slot> {
        let first = self.next - self.slots.len() as u64;
        if id < first || id >= self.next {
            return None;
        }
        let cap = self.slots.len() as u64;
        self.slots.get_mut((id % cap) as usize)
    }
}

/// The peers of a point-to-point op: inline up to two, so recording a send
/// or a receive allocates nothing.
pub(crate) type Peers = smallvec::SmallVec<[usize; 2]>;

/// What the recorder needs to describe a new op.
pub(crate) struct OpDesc {
    pub(crate) op: &'static str,
    pub(crate) dtype: DType,
    pub(crate) count: usize,
    pub(crate) bytes: usize,
    pub(crate) root: Option<usize>,
    pub(crate) peers: Peers,
}

/// A communicator's ring of recent ops.
pub(crate) struct FlightRecorder {
    capacity: usize,
    /// `Instant` ↔ wall clock, taken once.
    anchor: (Instant, u64),
    ring: Mutex<Ring>,
}

fn unix_us(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

impl FlightRecorder {
    /// A recorder of `capacity` entries; `None` when `capacity` is 0.
    pub(crate) fn new(capacity: usize) -> Option<FlightRecorder> {
        (capacity > 0).then(|| FlightRecorder {
            capacity,
            anchor: (Instant::now(), unix_us(SystemTime::now())),
            ring: Mutex::new(Ring {
                slots: Vec::with_capacity(capacity.min(4096)),
                next: 0,
            }),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Ring> {
        self.ring.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// `t` as microseconds since the Unix epoch.
    pub(crate) fn us(&self, t: Instant) -> u64 {
        let (at, us) = self.anchor;
        us + t.saturating_duration_since(at).as_micros() as u64
    }

    /// Record a newly issued op; returns its id. Once the ring is full the
    /// oldest entry's slot is overwritten in place (FR-1).
    pub(crate) fn push(
        &self,
        op_id: u64,
        desc: &OpDesc,
        tag: Option<&Arc<str>>,
        now: Instant,
    ) -> u64 {
        let mut ring = self.lock();
        let id = ring.next;
        ring.next += 1;
        if ring.slots.len() < self.capacity {
            ring.slots.push(Slot::new(id, op_id, desc, tag, now));
        } else {
            let at = (id % self.capacity as u64) as usize;
            if let Some(slot) = ring.slots.get_mut(at) {
                slot.reuse(id, op_id, desc, tag, now);
            }
        }
        id
    }

    /// Update entry `id`, if it is still in the ring.
    fn update(&self, id: u64, f: impl FnOnce(&mut Slot)) {
        let mut ring = self.lock();
        if let Some(e) = ring.get_mut(id) {
            f(e);
        }
    }

    /// Entry `id`'s turn started.
    pub(crate) fn started(&self, id: u64, seq: Option<u64>, now: Instant) {
        self.update(id, |e| {
            if e.state == FlightState::Queued {
                e.state = FlightState::Started;
                e.seq = seq;
                e.started = Some(now);
            }
        });
    }

    /// Entry `id` completed (`error: None`) or failed.
    pub(crate) fn finished(&self, id: u64, error: Option<String>, now: Instant) {
        self.update(id, |e| {
            if matches!(e.state, FlightState::Queued | FlightState::Started) {
                e.state = if error.is_some() {
                    FlightState::Failed
                } else {
                    FlightState::Completed
                };
                e.error = error;
                e.completed = Some(now);
            }
        });
    }

    /// The entries, oldest first, and how many were pushed out.
    pub(crate) fn snapshot(&self) -> (Vec<FlightEntry>, u64) {
        let ring = self.lock();
        let kept = ring.slots.len() as u64;
        let first = ring.next - kept;
        let entries = (first..ring.next)
            .filter_map(|id| ring.slots.get((id % kept.max(1)) as usize))
            .map(|s| s.entry(|t| self.us(t)))
            .collect();
        (entries, first)
    }

    /// The dump document.
    pub(crate) fn dump(&self, id: &DumpId, cause: Option<String>) -> FlightDump {
        let (entries, dropped) = self.snapshot();
        FlightDump {
            version: DUMP_FORMAT_VERSION,
            comm: id.comm.clone(),
            rank: id.rank,
            size: id.size,
            epoch: id.epoch,
            backend: id.backend.to_string(),
            cause,
            dumped_us: unix_us(SystemTime::now()),
            capacity: self.capacity,
            dropped,
            entries,
        }
    }
}

/// Which communicator a dump is of.
#[derive(Debug, Clone)]
pub(crate) struct DumpId {
    pub(crate) comm: String,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) epoch: u64,
    pub(crate) backend: &'static str,
}

/// The dump's file name: `<comm>-epoch<epoch>-rank<rank>.json`, with every
/// character of the name outside `[A-Za-z0-9._-]` replaced by `_`.
pub fn dump_file_name(comm: &str, epoch: u64, rank: usize) -> String {
    let safe: String = comm
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{safe}-epoch{epoch}-rank{rank}.json")
}

/// Write `dump` into `dir` (created if missing), atomically: a reader never
/// sees a half-written file. Returns the file's path.
pub(crate) fn write_dump(dir: &Path, dump: &FlightDump) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    let name = dump_file_name(&dump.comm, dump.epoch, dump.rank);
    let path = dir.join(&name);
    let tmp = dir.join(format!(".{name}.{}.tmp", std::process::id()));
    let json = serde_json::to_vec_pretty(dump).map_err(std::io::Error::other)?;
    std::fs::write(&tmp, json)?;
    std::fs::rename(&tmp, &path)?;
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn desc() -> OpDesc {
        OpDesc {
            op: "all_reduce",
            dtype: DType::F32,
            count: 2,
            bytes: 8,
            root: None,
            peers: Peers::new(),
        }
    }

    #[test]
    fn fr_1_the_ring_keeps_the_last_entries_in_order() {
        let r = FlightRecorder::new(3).unwrap();
        let now = Instant::now();
        let ids: Vec<u64> = (0..5)
            .map(|i| r.push(100 + i, &desc(), None, now))
            .collect();
        assert_eq!(ids, vec![0, 1, 2, 3, 4]);
        // An entry pushed out is not updated (nor resurrected).
        r.finished(0, None, now);
        r.finished(3, Some("boom".into()), now);
        let (entries, dropped) = r.snapshot();
        assert_eq!(dropped, 2);
        assert_eq!(
            entries.iter().map(|e| (e.id, e.op_id)).collect::<Vec<_>>(),
            vec![(2, 102), (3, 103), (4, 104)]
        );
        assert_eq!(entries[1].state, FlightState::Failed);
        assert_eq!(entries[1].error.as_deref(), Some("boom"));
        assert!(FlightRecorder::new(0).is_none());
    }

    #[test]
    fn fr_2_states_only_move_forward() {
        let r = FlightRecorder::new(4).unwrap();
        let t0 = Instant::now();
        let id = r.push(1, &desc(), Some(&Arc::from("tag")), t0);
        r.started(id, Some(7), t0 + Duration::from_micros(10));
        r.finished(id, None, t0 + Duration::from_micros(30));
        r.started(id, Some(9), t0 + Duration::from_micros(40));
        r.finished(id, Some("late".into()), t0 + Duration::from_micros(50));
        let e = &r.snapshot().0[0];
        assert_eq!(e.state, FlightState::Completed);
        assert_eq!(e.seq, Some(7));
        assert_eq!(e.error, None);
        assert_eq!(e.tag.as_deref(), Some("tag"));
        assert_eq!(e.started_us, Some(e.issued_us + 10));
        assert_eq!(e.completed_us, Some(e.issued_us + 30));
    }

    #[test]
    fn fr_1_an_overwritten_slot_holds_only_the_new_op() {
        let r = FlightRecorder::new(2).unwrap();
        let t0 = Instant::now();
        let tag: Arc<str> = Arc::from("old");
        let send = OpDesc {
            op: "send",
            peers: Peers::from_slice(&[3]),
            ..desc()
        };
        let a = r.push(1, &send, Some(&tag), t0);
        r.started(a, Some(4), t0);
        r.finished(a, Some("boom".into()), t0);
        r.push(2, &desc(), None, t0);
        // Entry 2 takes entry 0's slot.
        let c = r.push(3, &desc(), None, t0 + Duration::from_micros(5));
        let (entries, dropped) = r.snapshot();
        assert_eq!(dropped, 1);
        let e = &entries[1];
        assert_eq!((e.id, e.op_id, e.op), (c, 3, "all_reduce"));
        assert_eq!(e.state, FlightState::Queued);
        assert!(e.peers.is_empty() && e.tag.is_none() && e.error.is_none());
        assert_eq!((e.seq, e.started_us, e.completed_us), (None, None, None));
        assert_eq!(e.issued_us, entries[0].issued_us + 5);
    }

    #[test]
    fn dump_is_json_with_the_documented_fields() {
        let r = FlightRecorder::new(2).unwrap();
        r.push(5, &desc(), None, Instant::now());
        let id = DumpId {
            comm: "we/ird name".into(),
            rank: 1,
            size: 2,
            epoch: 3,
            backend: "cpu",
        };
        let dir = std::env::temp_dir().join(format!("chorus-fr-unit-{}", std::process::id()));
        let path = write_dump(&dir, &r.dump(&id, Some("why".into()))).unwrap();
        assert_eq!(
            path.file_name().unwrap().to_str().unwrap(),
            "we_ird_name-epoch3-rank1.json"
        );
        let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        assert_eq!(v["version"], DUMP_FORMAT_VERSION);
        assert_eq!(v["cause"], "why");
        assert_eq!(v["entries"][0]["op"], "all_reduce");
        assert_eq!(v["entries"][0]["dtype"], "float32");
        assert_eq!(v["entries"][0]["state"], "queued");
        assert_eq!(v["entries"][0]["seq"], serde_json::Value::Null);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
