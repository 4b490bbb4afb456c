//! The watchdog: heartbeats and failure notices over the rendezvous store.
//!
//! Every rank of a communicator with more than one rank runs one watchdog
//! task, owned by the communicator's executor. Each `heartbeat_interval` it
//! writes its heartbeat counter (followed, with fingerprint checks, by what
//! [`super::stall`] announces: WD-7) to `<prefix>/hb/<rank>` and reads its
//! watched neighbours' (WD-9) and the communicator's failure notice `<prefix>/failed` (the
//! prefix is `chorus/<name>/<instance>/epoch/<epoch>`, so every key is
//! stamped with the epoch). A peer whose counter did not advance for
//! `heartbeat_timeout` is declared failed: the watchdog publishes a failure
//! notice with `compare_set` (the first notice wins, so every rank reports
//! the same failed ranks) and tells its [`CommActor`](super::CommActor),
//! which fails every outstanding op with [`Error::PeerFailed`] and aborts the
//! communicator. A rank that cannot reach the store for `heartbeat_timeout`
//! aborts with [`Error::StoreUnreachable`]: the store (or the path to it) is
//! what failed, not this rank, and without it the ranks can no longer agree
//! on failures.
//!
//! # Invariants
//! - WD-1: a failure notice names the epoch it belongs to; a notice of another
//!   epoch is ignored ([`Notice::parse`]).
//! - WD-2: the first published notice wins; every rank that learns of a failure
//!   through the store reports the same failed ranks.
//! - WD-3: a rank that finalizes writes `done` as its heartbeat, so peers never
//!   mistake a clean exit for a failure.
//! - WD-4: the task ends when the communicator finalizes or aborts; it never
//!   outlives its executor (counted by [`crate::debug::live_watchdogs`]).
//! - WD-5: losing the store is reported as [`Error::StoreUnreachable`],
//!   never as this (live) rank's failure; `StoreHealth` tells the
//!   executor how long the store has been silent, so a peer's link loss
//!   seen while the store is down is reported the same way.
//! - WD-7: with fingerprinted ops, a heartbeat also announces this rank's
//!   op once it has run for `heartbeat_interval` (a stall) and the history
//!   hash after its last finished op, and every stall and hash a peer
//!   announces is compared with this rank's op or history of that sequence
//!   number ([`super::stall`]); a difference aborts the communicator with a
//!   fatal [`Error::Mismatch`], like a peer failure. It costs no store
//!   request of its own.
//! - WD-8: a mismatch is also published as the epoch's failure notice
//!   (marked as a mismatch, naming no failed rank) before this rank aborts;
//!   a rank that reads such a notice fails its op with a fatal
//!   [`Error::Mismatch`] and aborts, and a rank whose backend reports a
//!   peer failure that names no rank (a vendor library's remote error)
//!   adopts the notice's mismatch as the cause (the executor's EX-4).
//! - WD-9: a rank reads the heartbeats of its nearest neighbours only
//!   ([`watched`]: two on each side around the ring of ranks), plus the
//!   failure notice, so a round costs each rank at most six store requests
//!   and its state is O(1) (one [`Watched`] per neighbour)
//!   whatever the size of the job, O(N) for the whole job. A failed rank
//!   is declared by the ranks that watch it (within `heartbeat_timeout`
//!   and one interval); the others learn it from the notice on their next
//!   round. The stall and history checks (WD-7) compare along the same
//!   neighbours, which is enough: if every rank agrees with its neighbours
//!   on an op, all ranks agree on it.
//! - WD-6: every peer heartbeat that was seen vanishing at once means the
//!   epoch's keys were deleted (the next epoch formed without this rank, or
//!   it is over): this rank declares itself out (`failed_ranks == [me]`) and
//!   deletes its own heartbeat.
//!
//! [`Error::PeerFailed`]: crate::Error::PeerFailed
//! [`Error::StoreUnreachable`]: crate::Error::StoreUnreachable
//! [`Error::Mismatch`]: crate::Error::Mismatch

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ractor::ActorRef;
use tokio_util::sync::CancellationToken;

use super::stall::{self, Beat, OpLog};
use super::CommMsg;
use crate::transport::records::{ranks_in, ranks_out, Record};
use crate::transport::{CompareSet, Store};

/// Heartbeat value written by a rank that finalized cleanly ([WD-3]).
///
/// [WD-3]: self#invariants
const DONE: &[u8] = b"done";

/// A failure notice, as published in the store.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Notice {
    /// Epoch of the communicator the notice is about.
    pub epoch: u64,
    /// The rank that published it.
    pub by: usize,
    /// Ranks declared failed.
    pub failed_ranks: Vec<usize>,
    /// What was observed.
    pub detail: String,
    /// The ranks issued different ops: no rank failed, and `failed_ranks`
    /// is empty.
    pub mismatch: bool,
}

impl Notice {
    /// Encode as a store record.
    pub fn encode(&self) -> Vec<u8> {
        Record::Notice {
            epoch: self.epoch,
            by: self.by as u64,
            failed_ranks: ranks_out(&self.failed_ranks),
            detail: self.detail.clone(),
            mismatch: self.mismatch,
        }
        .encode()
    }

    /// Decode a notice; `None` if malformed or about another epoch than
    /// `epoch` (a notice of another epoch is rejected).
    pub fn parse(raw: &[u8], epoch: u64) -> Option<Notice> {
        let Record::Notice {
            epoch: e,
            by,
            failed_ranks,
            detail,
            mismatch,
        } = Record::decode(raw)?
        else {
            return None;
        };
        (e == epoch).then_some(Notice {
            epoch: e,
            by: usize::try_from(by).ok()?,
            failed_ranks: ranks_in(&failed_ranks)?,
            detail,
            mismatch,
        })
    }
}

/// The store key of a communicator's failure notice.
pub(crate) fn notice_key(prefix: &str) -> String {
    format!("{prefix}/failed")
}

/// When the watchdog last heard from the store ([WD-5]), shared with the
/// executor.
///
/// [WD-5]: self#invariants
#[derive(Debug)]
pub(crate) struct StoreHealth {
    base: Instant,
    /// Milliseconds after `base` of the last round the store answered.
    last_ok_ms: AtomicU64,
    /// Why the last round failed, if it did.
    last_error: std::sync::Mutex<Option<String>>,
}

impl Default for StoreHealth {
    fn default() -> StoreHealth {
        StoreHealth {
            base: Instant::now(),
            last_ok_ms: AtomicU64::new(0),
            last_error: std::sync::Mutex::new(None),
        }
    }
}

impl StoreHealth {
    fn ok(&self) {
        let ms = u64::try_from(self.base.elapsed().as_millis()).unwrap_or(u64::MAX);
        self.last_ok_ms.store(ms, Ordering::Release);
        *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }

    fn failed(&self, why: String) {
        *self.last_error.lock().unwrap_or_else(|e| e.into_inner()) = Some(why);
    }

    /// How long the store has not answered a heartbeat round.
    pub(crate) fn silent_for(&self) -> Duration {
        let last = Duration::from_millis(self.last_ok_ms.load(Ordering::Acquire));
        self.base.elapsed().saturating_sub(last)
    }

    /// Why the last round failed (`None`: it did not, or is still waiting).
    pub(crate) fn last_error(&self) -> Option<String> {
        self.last_error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }
}

/// What a watchdog needs.
#[derive(Clone)]
pub(crate) struct WatchdogConfig {
    pub(crate) prefix: String,
    pub(crate) rank: usize,
    pub(crate) size: usize,
    pub(crate) epoch: u64,
    pub(crate) interval: Duration,
    pub(crate) timeout: Duration,
    pub(crate) store: Arc<dyn Store>,
    /// Shared with the executor ([WD-5]).
    ///
    /// [WD-5]: self#invariants
    pub(crate) health: Arc<StoreHealth>,
    /// This communicator's rank whose process hosts the store, if one does
    /// (the torchrun layout, store on rank 0): that rank's death takes the
    /// store with it, so a failure naming it is not checked against the
    /// store ([EX-4]).
    ///
    /// [EX-4]: crate::actors::executor#invariants
    pub(crate) store_host: Option<usize>,
    /// This rank's recent ops, for the stall check ([WD-7]); `None` when
    /// ops carry no fingerprint.
    ///
    /// [WD-7]: self#invariants
    pub(crate) ops: Option<Arc<OpLog>>,
}

impl WatchdogConfig {
    /// Whether the store has been silent long enough that a peer's link
    /// loss is more likely its abort over the lost store than its death
    /// ([WD-5]): three missed rounds, and at least 300 ms.
    ///
    /// [WD-5]: self#invariants
    pub(crate) fn store_down(&self) -> Option<Duration> {
        let silent = self.health.silent_for();
        (silent > (self.interval * 3).max(Duration::from_millis(300))).then_some(silent)
    }

    /// Publish a failure notice (first wins, [WD-2]) and return the winning one.
    /// Bounded by the heartbeat timeout; `None` if the store did not answer.
    ///
    /// [WD-2]: self#invariants
    pub(crate) async fn publish(&self, failed_ranks: Vec<usize>, detail: String) -> Option<Notice> {
        self.publish_notice(Notice {
            epoch: self.epoch,
            by: self.rank,
            failed_ranks,
            detail,
            mismatch: false,
        })
        .await
    }

    /// Publish that the ranks issued different ops ([WD-8]; first wins,
    /// [WD-2]) and return the winning notice.
    ///
    /// [WD-2]: self#invariants
    /// [WD-8]: self#invariants
    pub(crate) async fn publish_mismatch(&self, detail: String) -> Option<Notice> {
        self.publish_notice(Notice {
            epoch: self.epoch,
            by: self.rank,
            failed_ranks: vec![],
            detail,
            mismatch: true,
        })
        .await
    }

    /// The epoch's failure notice, if one was published; `None` also when
    /// the store did not answer within the heartbeat timeout.
    pub(crate) async fn notice(&self) -> Option<Notice> {
        let key = notice_key(&self.prefix);
        match tokio::time::timeout(self.timeout, self.store.get(&key)).await {
            Ok(Ok(Some(raw))) => Notice::parse(&raw, self.epoch),
            _ => None,
        }
    }

    async fn publish_notice(&self, mine: Notice) -> Option<Notice> {
        let key = notice_key(&self.prefix);
        let r = tokio::time::timeout(
            self.timeout,
            self.store.compare_set(&key, None, mine.encode()),
        )
        .await;
        match r {
            Ok(Ok(CompareSet::Swapped)) => Some(mine),
            Ok(Ok(CompareSet::Current(Some(v)))) => Notice::parse(&v, self.epoch).or(Some(mine)),
            _ => None,
        }
    }
}

/// A running watchdog task.
pub(crate) struct Watchdog {
    cancel: CancellationToken,
    clean: Arc<AtomicBool>,
    handle: tokio::task::JoinHandle<()>,
    pub(crate) config: WatchdogConfig,
}

struct LiveGuard;
impl Drop for LiveGuard {
    fn drop(&mut self) {
        crate::debug::LIVE_WATCHDOGS.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Watchdog {
    /// Start a watchdog, unless heartbeats are off or the world has one rank.
    /// Its verdict raises `home`'s abort signal (ending the turn in flight)
    /// and tells `actor`.
    pub(crate) fn start(
        config: WatchdogConfig,
        actor: ActorRef<CommMsg>,
        home: Arc<super::Home>,
    ) -> Option<Watchdog> {
        if config.size < 2 || config.interval.is_zero() {
            return None;
        }
        let cancel = CancellationToken::new();
        let clean = Arc::new(AtomicBool::new(false));
        crate::debug::LIVE_WATCHDOGS.fetch_add(1, Ordering::AcqRel);
        let handle = tokio::spawn(run(
            config.clone(),
            actor,
            home,
            cancel.clone(),
            clean.clone(),
        ));
        Some(Watchdog {
            cancel,
            clean,
            handle,
            config,
        })
    }

    /// A watchdog that sends no heartbeats, for tests of what the executor
    /// does with its config.
    #[cfg(test)]
    pub(crate) fn detached(config: WatchdogConfig) -> Watchdog {
        crate::debug::LIVE_WATCHDOGS.fetch_add(1, Ordering::AcqRel);
        Watchdog {
            cancel: CancellationToken::new(),
            clean: Arc::new(AtomicBool::new(false)),
            handle: tokio::spawn(async { drop(LiveGuard) }),
            config,
        }
    }

    /// Stop the task and wait for it; `clean` writes the `done` heartbeat ([WD-3]).
    ///
    /// [WD-3]: self#invariants
    pub(crate) async fn stop(self, clean: bool) {
        self.clean.store(clean, Ordering::Release);
        self.cancel.cancel();
        let _ = self.handle.await;
    }
}

/// How far each way around the ring of ranks a rank watches ([WD-9]).
///
/// [WD-9]: self#invariants
const WATCH_RADIUS: usize = 2;

/// The ranks whose heartbeats rank `me` of `size` reads ([WD-9]): the
/// nearest [`WATCH_RADIUS`] on each side around the ring of ranks, so every
/// rank is watched by as many others, and a job of up to
/// `2 * WATCH_RADIUS + 1` ranks watches every peer. Ascending; O(1) in
/// `size`.
///
/// [WD-9]: self#invariants
pub(crate) fn watched(me: usize, size: usize) -> Vec<usize> {
    let mut w: Vec<usize> = (1..=WATCH_RADIUS.min(size / 2))
        .flat_map(|d| [(me + d) % size, (me + size - d) % size])
        .filter(|&p| p != me)
        .collect();
    w.sort_unstable();
    w.dedup();
    w
}

/// A watched neighbour's heartbeat, as this rank last saw it ([WD-9]).
///
/// [WD-9]: self#invariants
struct Watched {
    rank: usize,
    key: String,
    /// The last value read and when it changed.
    last: (Option<Vec<u8>>, Instant),
    /// It finalized cleanly ([WD-3]): no longer read.
    ///
    /// [WD-3]: self#invariants
    done: bool,
}

/// Why a watchdog ended the communicator.
enum Verdict {
    /// These ranks failed.
    Peers(Vec<usize>, String),
    /// The store did not answer for this long ([WD-5]).
    ///
    /// [WD-5]: self#invariants
    Store(Duration, String),
    /// A peer's stall disagrees with this rank's op ([WD-7]).
    ///
    /// [WD-7]: self#invariants
    Mismatch(stall::Disagreement),
    /// A peer published that the ranks issued different ops ([WD-8]).
    ///
    /// [WD-8]: self#invariants
    MismatchNotice(Notice),
}

async fn run(
    cfg: WatchdogConfig,
    actor: ActorRef<CommMsg>,
    home: Arc<super::Home>,
    cancel: CancellationToken,
    clean: Arc<AtomicBool>,
) {
    let _live = LiveGuard;
    let me = cfg.rank;
    let my_key = format!("{}/hb/{me}", cfg.prefix);
    let nkey = notice_key(&cfg.prefix);
    let start = Instant::now();
    // WD-9: the watched neighbours, the only heartbeats this rank reads.
    let mut peers: Vec<Watched> = watched(me, cfg.size)
        .into_iter()
        .map(|rank| Watched {
            rank,
            key: format!("{}/hb/{rank}", cfg.prefix),
            last: (None, start),
            done: false,
        })
        .collect();
    let mut store_ok = start;
    let mut counter: u64 = 0;
    let mut tick = tokio::time::interval(cfg.interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let bound = cfg.timeout.max(cfg.interval);
    cfg.health.ok();
    let verdict: Option<Verdict> = loop {
        tokio::select! {
            biased;
            _ = cancel.cancelled() => break None,
            _ = tick.tick() => {}
        }
        counter += 1;
        let now = Instant::now();
        let round = async {
            // WD-7: a stall and the history hash ride on the heartbeat.
            let beat = cfg.ops.as_ref().map_or_else(Beat::default, |o| Beat {
                stall: o.stalled(cfg.interval).map(|(s, f, _)| (s, f)),
                latest: o.latest(),
            });
            cfg.store
                .set(&my_key, stall::encode_beat(counter, beat))
                .await?;
            let notice = cfg.store.get(&nkey).await?;
            let mut beats = Vec::with_capacity(peers.len());
            for w in &peers {
                beats.push(if w.done {
                    None
                } else {
                    cfg.store.get(&w.key).await?
                });
            }
            Ok::<_, crate::transport::TransportError>((notice, beats))
        };
        let r = tokio::select! {
            biased;
            _ = cancel.cancelled() => break None,
            r = tokio::time::timeout(bound, round) => r,
        };
        match r {
            Ok(Ok((notice, beats))) => {
                store_ok = Instant::now();
                cfg.health.ok();
                if let Some(n) = notice.and_then(|raw| Notice::parse(&raw, cfg.epoch)) {
                    if n.mismatch {
                        // WD-8: a peer found that the ranks issued different ops.
                        break Some(Verdict::MismatchNotice(n));
                    }
                    break Some(Verdict::Peers(
                        n.failed_ranks,
                        format!("failure notice from rank {}: {}", n.by, n.detail),
                    ));
                }
                // WD-7: compare the stalls and histories peers announce
                // with this rank's ops.
                let disagree = cfg.ops.as_ref().and_then(|o| {
                    peers.iter().zip(&beats).find_map(|(w, b)| {
                        let p = w.rank;
                        let beat = stall::parse_beat(b.as_deref()?);
                        let stalled = beat.stall.and_then(|(seq, fp)| o.check(me, p, seq, fp));
                        stalled.or_else(|| {
                            let (seq, chain) = beat.latest?;
                            o.check_history(me, p, seq, chain)
                        })
                    })
                });
                if let Some(d) = disagree {
                    tracing::warn!(
                        rank = me,
                        epoch = cfg.epoch,
                        seq = d.seq,
                        "ranks issued different ops"
                    );
                    break Some(Verdict::Mismatch(d));
                }
                let mut failed = vec![];
                // WD-6 needs every heartbeat seen so far to be gone at once
                // (the epoch's keys were deleted), not one peer's: a single
                // key can vanish for that peer's own reasons.
                let (mut seen, mut vanished) = (0usize, 0usize);
                for (w, beat) in peers.iter_mut().zip(beats) {
                    if w.done {
                        continue;
                    }
                    if beat.as_deref() == Some(DONE) {
                        w.done = true;
                        continue;
                    }
                    if w.last.0.is_some() {
                        seen += 1;
                        vanished += usize::from(beat.is_none());
                    }
                    if beat.is_some() && beat != w.last.0 {
                        w.last = (beat, now);
                    } else if now.duration_since(w.last.1) > cfg.timeout {
                        failed.push(w.rank);
                    }
                }
                if seen > 0 && vanished == seen {
                    // WD-6: the epoch's keys were deleted while this rank
                    // runs, so the others formed the next epoch without it.
                    let _ = cfg.store.delete(&my_key).await;
                    tracing::warn!(
                        rank = me,
                        epoch = cfg.epoch,
                        "the epoch ended without this rank"
                    );
                    break Some(Verdict::Peers(
                        vec![me],
                        format!(
                            "the keys of epoch {} were deleted: the other ranks formed the next \
                             epoch without rank {me}",
                            cfg.epoch
                        ),
                    ));
                }
                if !failed.is_empty() {
                    let detail = format!(
                        "no heartbeat from ranks {failed:?} for {:?} (detected by rank {me})",
                        cfg.timeout
                    );
                    tracing::warn!(rank = me, epoch = cfg.epoch, ?failed, "heartbeat lost");
                    let n = cfg.publish(failed.clone(), detail.clone()).await;
                    break Some(match n {
                        Some(n) => Verdict::Peers(n.failed_ranks, n.detail),
                        None => Verdict::Peers(failed, detail),
                    });
                }
            }
            r => {
                let why = match r {
                    Ok(Err(e)) => e.to_string(),
                    _ => format!("no answer within {bound:?}"),
                };
                cfg.health.failed(why.clone());
                let silent = Instant::now().duration_since(store_ok);
                if silent > cfg.timeout {
                    tracing::warn!(rank = me, epoch = cfg.epoch, error = %why, "rendezvous store unreachable");
                    break Some(Verdict::Store(silent, why));
                }
            }
        }
    };
    // WD-7, WD-8: the op this rank runs (or the last it ran) fails with the
    // mismatch, and the communicator is aborted.
    let raise_mismatch = |fallback_seq: u64, detail: String| {
        let info = &home.info;
        let (seq, op) = cfg
            .ops
            .as_ref()
            .and_then(|o| o.current())
            .map_or((fallback_seq, "watchdog"), |(s, k)| (s, k.name()));
        home.signal.raise(crate::error::Error::Mismatch {
            comm: info.name.clone(),
            rank: info.rank,
            op,
            seq,
            epoch: info.epoch,
            detail: format!("{detail}; the communicator is aborted"),
            fatal: true,
        });
        let _ = actor.send_message(CommMsg::Abort { done: None });
    };
    match verdict {
        Some(Verdict::Mismatch(d)) => {
            // WD-8: the notice goes out before the abort, so a peer whose
            // library call fails because this rank's backend aborted
            // finds the mismatch as the cause, not a peer failure. The
            // store gets NOTICE_ADOPT; past that the notice is published
            // in the background.
            let publish = {
                let cfg = cfg.clone();
                let detail = d.detail.clone();
                tokio::spawn(async move { cfg.publish_mismatch(detail).await })
            };
            let _ = tokio::time::timeout(super::executor::NOTICE_ADOPT, publish).await;
            raise_mismatch(d.seq, d.detail);
        }
        Some(Verdict::MismatchNotice(n)) => {
            let seq = cfg
                .ops
                .as_ref()
                .and_then(|o| o.latest())
                .map_or(0, |(s, _)| s);
            raise_mismatch(
                seq,
                format!("failure notice from rank {}: {}", n.by, n.detail),
            );
        }
        Some(Verdict::Store(after, detail)) => {
            let info = &home.info;
            // WD-5: the store failed, not this rank; the abort carries that.
            home.signal.raise(crate::error::Error::StoreUnreachable {
                comm: info.name.clone(),
                rank: info.rank,
                epoch: info.epoch,
                op: "watchdog",
                after,
                detail,
            });
            let _ = actor.send_message(CommMsg::Abort { done: None });
        }
        Some(Verdict::Peers(failed_ranks, detail)) => {
            let info = &home.info;
            home.signal.raise(crate::error::Error::PeerFailed {
                comm: info.name.clone(),
                rank: info.rank,
                epoch: info.epoch,
                op: "watchdog",
                failed_ranks: failed_ranks.clone(),
                detail: detail.clone(),
            });
            let _ = actor.send_message(CommMsg::PeerFailed {
                failed_ranks,
                detail,
            });
        }
        None if clean.load(Ordering::Acquire) => {
            let _ = tokio::time::timeout(
                Duration::from_secs(1).min(bound),
                cfg.store.set(&my_key, DONE.to_vec()),
            )
            .await;
        }
        None => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wd9_each_rank_watches_its_ring_neighbours_and_is_watched_as_often() {
        assert_eq!(watched(0, 1), Vec::<usize>::new());
        assert_eq!(watched(0, 2), vec![1]);
        assert_eq!(watched(1, 3), vec![0, 2]);
        assert_eq!(watched(2, 5), vec![0, 1, 3, 4]);
        assert_eq!(watched(0, 4096), vec![1, 2, 4094, 4095]);
        for size in [2, 3, 4, 5, 6, 7, 64, 4096] {
            let mut watchers = vec![0usize; size];
            for me in 0..size {
                let w = watched(me, size);
                assert!(w.len() <= 2 * WATCH_RADIUS && !w.contains(&me));
                for p in w {
                    watchers[p] += 1;
                }
            }
            let want = (size - 1).min(2 * WATCH_RADIUS);
            assert!(
                watchers.iter().all(|&c| c == want),
                "size {size}: {watchers:?}"
            );
        }
    }

    #[test]
    fn wd1_notice_of_another_epoch_is_rejected() {
        let n = Notice {
            epoch: 3,
            by: 1,
            failed_ranks: vec![2, 5],
            detail: "no heartbeat | really".into(),
            mismatch: false,
        };
        let raw = n.encode();
        assert_eq!(Notice::parse(&raw, 3), Some(n));
        assert_eq!(Notice::parse(&raw, 4), None);
        assert_eq!(Notice::parse(b"garbage", 3), None);
    }
}
