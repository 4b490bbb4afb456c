//! Subgroups and elasticity: `split`, hierarchies, health, `reconfigure`
//! into a new epoch, and joining a running job.
//!
//! **Split** is collective over the parent and ordered with its other ops:
//! every rank all-gathers `(color, key, check)` through the parent's
//! executor, so a rank that issued another op instead gets a `Mismatch`.
//! Members of one color form a child whose store keys live under
//! `<parent prefix>/split/<split seq>/<color>`, created through the same
//! store and backend as the parent; its actor is linked under the parent's.
//!
//! **Reconfigure** forms epoch `N+1` of a communicator. Under
//! `chorus/<job>/<name>/<instance>/epoch/<N+1>/`, survivors register as `member/<old
//! rank>` (and count themselves in `arrived`) and joiners take a ticket from the `joiners` counter. The first
//! rank that sees every expected survivor registered (or whose deadline
//! passes) closes the membership with `compare_set` on `closed`; the first
//! close wins, and carries the verdict, so every rank reaches the same one.
//!
//! # Invariants
//! - EL-1: split keys are derived from the parent's key prefix and the
//!   parent's split count, never from a process-wide counter.
//! - EL-2: the membership of an epoch is decided once (`compare_set`), and
//!   every participant (survivor or joiner) adopts that decision.
//! - EL-3 (quorum): epoch `N+1` starts only with more than half of epoch `N`'s
//!   ranks (or `min_size` ranks when the user sets it); otherwise every
//!   participant gets `Error::NoQuorum` and no communicator is formed.
//! - EL-4: new ranks are dense: surviving old ranks in old-rank order, then
//!   joiners in ticket order.
//! - EL-5: every key, heartbeat and data link of epoch `N+1` is scoped by the
//!   new epoch; data frames and failure notices of epoch `N` are rejected.
//! - EL-6: every member counts itself in `arrived` after setting its key.
//!   While the membership is open, only its coordinator (the lowest old
//!   rank not known to have failed) polls, every 20 ms: it reads the
//!   count, and only once the count covers every expected member (or at
//!   the deadline) the member keys it has not yet seen set (a member key
//!   stays for the epoch). Every other rank waits for the closed record,
//!   one store request per [`MEMBERSHIP_SLICE`], and looks again at who
//!   failed between slices (the coordinator may be among them). At the
//!   deadline every rank closes. So an open membership costs the store
//!   O(1) requests per rank and O(1) per 20 ms while members arrive, and
//!   O(N) when the coordinator reads the keys, not O(N) per poll.
//! - EL-7: an epoch whose membership closed but whose start failed on a
//!   rank (a member died while the epoch connected) is failed like any
//!   epoch: that rank publishes the epoch's failure notice (the first one
//!   wins), in the epoch's own numbering, and its next `reconfigure` goes
//!   on from that epoch as its member, as ranks whose start succeeded do
//!   once their first op fails. So every rank forms the following epoch
//!   from one numbering, and a retry never meets the same closed
//!   membership again.
//! - EL-8: with heartbeats on, a member's key holds its process's presence
//!   endpoint ([`crate::presence`]), and the closed membership lists the
//!   survivors' endpoints. While the epoch's backend connects, each survivor
//!   probes its ring neighbours among the survivors every heartbeat
//!   interval; one that is gone is named in the epoch's failure notice, and
//!   every member's connect stops waiting for it when that notice appears
//!   (`BackendInit::peers_failed`). A joiner writes its endpoint under its
//!   ticket and is probed like a survivor; one whose key was not there yet
//!   when the membership closed is not probed (found at
//!   `connect_timeout`).

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::actors::executor::NativeSplit;
use crate::actors::watchdog::{notice_key, Notice};
use crate::actors::Queued;
use crate::backends::{SplitArgs, SplitChild};
use crate::comm::Comm;
use crate::error::{Error, Result};
use crate::options::{CommOptions, Device};
use crate::presence::StartWatch;
use crate::tensor::Tensor;
use crate::transport::records::{ranks_in, ranks_out, Record};
use crate::transport::{CompareSet, Store, TransportError};

/// How long a rank other than the coordinator waits for the membership to
/// close before it looks again at who failed ([EL-6](self#invariants)).
const MEMBERSHIP_SLICE: Duration = Duration::from_millis(250);

/// What split and reconfigure need to build related communicators.
pub(crate) struct CommCtx {
    pub(crate) name: String,
    /// The job id that scopes this communicator's keys.
    pub(crate) job: String,
    /// `chorus/<job>/<name>/<instance>` (or a split's prefix): epochs live under it.
    pub(crate) base: String,
    pub(crate) store: Arc<dyn Store>,
    pub(crate) secret: Arc<[u8]>,
    pub(crate) bind_ip: IpAddr,
    pub(crate) options: CommOptions,
    pub(crate) server: Option<Arc<dyn std::any::Any + Send + Sync>>,
    /// The world rank whose process hosts the store, if a rank does
    /// ([`crate::bootstrap::Connected::store_host`]).
    pub(crate) store_host: Option<usize>,
    /// For a split child: its members' ranks in the parent and in the world,
    /// by child rank, at epoch 0. `None` for a top-level communicator.
    pub(crate) lineage: Option<CommRanks>,
}

/// Where a communicator's members sit in its parent and in the world
/// ([`Comm::ranks`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CommRanks {
    /// `in_parent[i]`: the parent rank of this communicator's rank `i`.
    pub in_parent: Vec<usize>,
    /// `in_world[i]`: the rank of this communicator's rank `i` in the
    /// top-level communicator the split chain started from.
    pub in_world: Vec<usize>,
}

/// Which split API a rank called, exchanged so that mixing them is a
/// `Mismatch` rather than a silently wrong grouping.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SplitForm {
    /// [`Comm::split`]: the fingerprint of the caller's list (0 if empty).
    List(i64),
    /// [`Comm::split_by_color`].
    Color,
}

/// The fingerprint of a rank list, as exchanged by [`Comm::split`].
fn list_check(ranks: &[usize]) -> i64 {
    if ranks.is_empty() {
        return 0;
    }
    let bytes: Vec<u8> = ranks
        .iter()
        .flat_map(|&r| (r as u64).to_le_bytes())
        .collect();
    // Never 0, which stands for the empty list.
    fnv(&bytes).max(1)
}

/// A communicator's health, as [`Comm::health`] reports it.
#[derive(Debug, Clone)]
pub struct Health {
    /// Whether it still accepts ops.
    pub active: bool,
    /// Its epoch.
    pub epoch: u64,
    /// Ranks known to have failed (from the watchdog or a failed op).
    pub failed_ranks: Vec<usize>,
    /// The failure that aborted it, if any.
    pub failure: Option<Error>,
    /// Children (splits) that failed.
    pub child_failures: Vec<crate::ChildFailure>,
    /// Same-host peers this rank reaches over TCP because shared memory
    /// could not be set up with them, and why (also logged at `warn`).
    pub tcp_fallbacks: Vec<crate::backends::TcpFallback>,
}

/// The two levels of a hierarchical communicator ([`Comm::hierarchy`]).
#[derive(Debug, Clone)]
pub struct Hierarchy {
    /// The ranks on this host.
    pub local: Comm,
    /// One rank per host: the ranks with the same local rank as this one.
    pub cross: Comm,
}

/// Options of [`Comm::reconfigure`].
#[derive(Debug, Clone)]
pub struct ReconfigureOptions {
    /// Minimum size of the new epoch (survivors + joiners). `None`: more than
    /// half of the old ranks must survive, which keeps a minority
    /// partition from forming its own epoch.
    pub min_size: Option<usize>,
    /// How long to wait for the other survivors and joiners.
    pub timeout: Duration,
    /// Wait (up to `timeout`) until at least this many joiners registered.
    pub wait_joiners: usize,
}

impl Default for ReconfigureOptions {
    fn default() -> Self {
        ReconfigureOptions {
            min_size: None,
            timeout: Duration::from_secs(30),
            wait_joiners: 0,
        }
    }
}

/// How ranks moved from one epoch to the next.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RankMap {
    /// The new epoch.
    pub epoch: u64,
    /// Size of the new epoch.
    pub size: usize,
    /// `old_to_new[old rank]`: the rank in the new epoch, `None` if it left.
    pub old_to_new: Vec<Option<usize>>,
    /// New ranks of the joiners, in ticket order.
    pub joined: Vec<usize>,
}

/// An epoch this rank is a member of but could not start (EL-7): where it
/// stands in it, and how the caller's ranks map into it.
#[derive(Debug, Clone)]
pub(crate) struct Unstarted {
    epoch: u64,
    rank: usize,
    size: usize,
    /// `from_caller[old rank of the handle's communicator]`: its rank in
    /// `epoch`.
    from_caller: Vec<Option<usize>>,
}

/// The membership decision of one epoch.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Closed {
    quorum: bool,
    old_size: usize,
    survivors: Vec<usize>,
    joiners: usize,
    /// Each member's presence endpoint ([`crate::presence`]) in new-rank
    /// order (survivors, then joiners); `None` for one without (O(size)).
    presence: Vec<Option<SocketAddr>>,
}

impl Closed {
    fn encode(&self) -> Vec<u8> {
        Record::Closed {
            quorum: self.quorum,
            old_size: self.old_size as u64,
            survivors: ranks_out(&self.survivors),
            joiners: self.joiners as u64,
            presence: self
                .presence
                .iter()
                .map(|a| a.map(|a| a.to_string()).unwrap_or_default())
                .collect(),
        }
        .encode()
    }

    fn parse(raw: &[u8]) -> Option<Closed> {
        let Record::Closed {
            quorum,
            old_size,
            survivors,
            joiners,
            presence,
        } = Record::decode(raw)?
        else {
            return None;
        };
        let survivors = ranks_in(&survivors)?;
        let joiners = usize::try_from(joiners).ok()?;
        // An endpoint that does not parse is not probed (it only speeds up
        // finding a death); a list of another length is malformed.
        if presence.len() != survivors.len().checked_add(joiners)? {
            return None;
        }
        Some(Closed {
            quorum,
            old_size: usize::try_from(old_size).ok()?,
            survivors,
            joiners,
            presence: presence.iter().map(|a| a.parse().ok()).collect(),
        })
    }

    fn size(&self) -> usize {
        self.survivors.len() + self.joiners
    }
}

/// The store key where joiner `ticket` of the epoch at `prefix` leaves its
/// presence endpoint (EL-8).
fn joiner_key(prefix: &str, ticket: usize) -> String {
    format!("{prefix}/joiner/{ticket}")
}

/// A presence endpoint as a member or joiner key holds it; `None` for
/// anything else (a member without one writes `1`).
fn parse_endpoint(raw: &[u8]) -> Option<SocketAddr> {
    std::str::from_utf8(raw).ok()?.parse().ok()
}

/// Whether a member with `options` watches its neighbours while an epoch
/// starts (heartbeats on), and the presence endpoint it advertises on `ip`
/// (only then; `None` also where none can be bound) (EL-8).
fn presence_of(options: &CommOptions, ip: IpAddr) -> (bool, Option<SocketAddr>) {
    let watched = !options.heartbeat_interval.is_zero();
    (
        watched,
        watched.then(|| crate::presence::endpoint(ip)).flatten(),
    )
}

/// The start watch of new rank `rank` of the epoch at `prefix` (EL-8): its
/// ring neighbours among every member of `closed`, leaving out this
/// process's own endpoint `mine`.
fn start_watch(
    ctx: &CommCtx,
    prefix: &str,
    epoch: u64,
    rank: usize,
    closed: &Closed,
    mine: Option<SocketAddr>,
) -> StartWatch {
    StartWatch {
        store: ctx.store.clone(),
        notice_key: notice_key(prefix),
        epoch,
        rank,
        neighbours: crate::presence::neighbours(rank, &closed.presence, mine),
        interval: ctx.options.heartbeat_interval,
        timeout: ctx.options.heartbeat_timeout,
        until: ctx.options.connect_timeout,
    }
}

fn epoch_prefix(base: &str, epoch: u64) -> String {
    format!("{base}/epoch/{epoch}")
}

pub(crate) fn latest_key(job: &str, name: &str) -> String {
    format!("chorus/{job}/{name}/latest")
}

/// The value of [`latest_key`] for `epoch` of the communicator at `base`
/// (deterministic, so a finalizing rank can tell whether it still points
/// at its own epoch).
pub(crate) fn latest_value(base: &str, epoch: u64) -> Vec<u8> {
    Record::Latest {
        base: base.to_string(),
        epoch,
    }
    .encode()
}

fn transport(e: crate::transport::TransportError) -> Error {
    Error::Transport(e)
}

/// Record where the newest epoch of a top-level communicator lives, for joiners.
pub(crate) async fn publish_latest(comm: &Comm) {
    let ctx = &comm.shared.ctx;
    let value = latest_value(&ctx.base, comm.epoch());
    if let Err(e) = ctx.store.set(&latest_key(&ctx.job, &ctx.name), value).await {
        tracing::warn!(comm = %ctx.name, error = %e, "cannot publish the latest epoch for joiners");
    }
}

pub(crate) fn fnv(s: &[u8]) -> i64 {
    let mut h: u64 = 0xcbf29ce484222325;
    for b in s {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x100000001b3);
    }
    (h >> 1) as i64
}

/// This host's identity for [`Comm::hierarchy`]: `CHORUS_HOST_ID`, else the
/// kernel host name.
fn host_id() -> String {
    std::env::var("CHORUS_HOST_ID")
        .ok()
        .or_else(|| std::fs::read_to_string("/proc/sys/kernel/hostname").ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "localhost".into())
}

impl Comm {
    /// This communicator's health: whether it is active, which ranks are known
    /// to have failed (watchdog notice or failed op), and which children failed.
    pub fn health(&self) -> Health {
        let status = &self.shared.home.status;
        let failure = status.cause();
        Health {
            active: self.is_active(),
            epoch: self.epoch(),
            failed_ranks: failure
                .as_ref()
                .map(|e| e.failed_ranks().to_vec())
                .unwrap_or_default(),
            failure,
            child_failures: status.child_failures(),
            tcp_fallbacks: self
                .shared
                .tcp_fallbacks
                .lock()
                .map_or_else(|e| e.into_inner().clone(), |f| f.clone()),
        }
    }

    /// Run `f(self)` as a task on the communicator's runtime and await it;
    /// the async forms of split and reconfigure use it, so that they can be
    /// awaited from any executor.
    async fn on_runtime<T, F, Fut>(&self, f: F) -> Result<T>
    where
        F: FnOnce(Comm) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<T>> + Send + 'static,
        T: Send + 'static,
    {
        let this = self.clone();
        crate::runtime::run_on(&self.shared.home.rt, f(this)).await?
    }

    /// Block (where allowed) on `f(self)` run on the communicator's runtime.
    pub(crate) fn block<T, F, Fut>(&self, op: &'static str, f: F) -> Result<T>
    where
        F: FnOnce(Comm) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = Result<T>> + Send + 'static,
        T: Send + 'static,
    {
        let this = self.clone();
        crate::runtime::block_on(op, &self.shared.home.rt, f(this))?
    }

    fn invalid_split(&self, reason: impl Into<String>) -> Error {
        Error::InvalidArgument {
            comm: self.shared.name.clone(),
            rank: self.shared.rank,
            op: "split",
            reason: reason.into(),
        }
    }

    /// Split off a child communicator of the ranks in `ranks` (parent ranks,
    /// unique, in range; child rank `i` is `ranks[i]`), with TorchComms'
    /// semantics. Collective over the parent: every parent rank calls it.
    /// Each group passes its own list, and a rank that joins no group passes
    /// `&[]` and gets `None`; so `split(&[0, 1])` on ranks 0 and 1 and
    /// `split(&[2, 3])` on ranks 2 and 3 form two children at once. Passing
    /// the same list on every rank also works: ranks not in it get `None`.
    /// The children's ranks in this communicator are in [`Comm::ranks`].
    ///
    /// ```
    /// let comm = chorus::new_comm("cpu", chorus::Device::Cpu, "split-doc", chorus::CommOptions::single())?;
    /// let child = comm.split(&[0], "child")?.expect("rank 0 is a member");
    /// assert_eq!(child.size(), 1);
    /// comm.finalize()?; // finalizes the child first
    /// assert!(!child.is_active());
    /// # Ok::<(), chorus::Error>(())
    /// ```
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for duplicate or out-of-range ranks or a bad
    /// name (before any communication), or for a non-empty list without the
    /// caller that is not the list some group passed (on that rank; the
    /// others get `Mismatch` naming it); [`Error::Mismatch`] if the members
    /// of one group pass different lists, or ranks mix `split` with
    /// `split_by_color` (or issue another op); the parent's failures
    /// otherwise. After a `Mismatch` or `InvalidArgument` from the exchange,
    /// the parent stays usable.
    pub fn split(&self, ranks: &[usize], name: &str) -> Result<Option<Comm>> {
        let (ranks, name) = (ranks.to_vec(), name.to_string());
        self.block("split", move |c| async move {
            c.split_async(&ranks, &name).await
        })
    }

    /// Async form of [`Comm::split`].
    ///
    /// # Errors
    /// As [`Comm::split`].
    pub async fn split_async(&self, ranks: &[usize], name: &str) -> Result<Option<Comm>> {
        let mut seen = vec![false; self.size()];
        for &r in ranks {
            if r >= self.size() {
                return Err(self.invalid_split(format!(
                    "rank {r} is out of range for {} ranks",
                    self.size()
                )));
            }
            if std::mem::replace(&mut seen[r], true) {
                return Err(self.invalid_split(format!("rank {r} is listed twice")));
            }
        }
        // TorchComms: color = the smallest rank of the group, key = position.
        let (color, key) = match ranks.iter().position(|&r| r == self.rank()) {
            Some(pos) => (ranks.iter().min().map(|&m| m as u32), pos as i64),
            None => (None, 0),
        };
        let form = SplitForm::List(list_check(ranks));
        let name = name.to_string();
        self.on_runtime(move |c| async move { c.split_inner(color, key, form, &name).await })
            .await
    }

    /// Split by color: ranks passing the same `color` form one child, ordered
    /// by `key` (ties by parent rank); `None` as color opts out. Collective over
    /// the parent; members of one color must pass the same `name`.
    ///
    /// # Errors
    /// As [`Comm::split`].
    pub fn split_by_color(&self, color: Option<u32>, key: i64, name: &str) -> Result<Option<Comm>> {
        let name = name.to_string();
        self.block("split_by_color", move |c| async move {
            c.split_inner(color, key, SplitForm::Color, &name).await
        })
    }

    /// Async form of [`Comm::split_by_color`].
    ///
    /// # Errors
    /// As [`Comm::split`].
    pub async fn split_by_color_async(
        &self,
        color: Option<u32>,
        key: i64,
        name: &str,
    ) -> Result<Option<Comm>> {
        let name = name.to_string();
        self.on_runtime(
            move |c| async move { c.split_inner(color, key, SplitForm::Color, &name).await },
        )
        .await
    }

    /// Where this communicator's members sit in its parent and in the
    /// world. For a top-level communicator, and after any reconfigure (which
    /// renumbers ranks), both lists are `0..size`.
    ///
    /// ```
    /// let comm = chorus::new_comm("cpu", chorus::Device::Cpu, "ranks-doc", chorus::CommOptions::single())?;
    /// assert_eq!(comm.ranks().in_world, vec![0]);
    /// let child = comm.split(&[0], "child")?.expect("rank 0 is a member");
    /// assert_eq!(child.ranks().in_parent, vec![0]);
    /// comm.finalize()?;
    /// # Ok::<(), chorus::Error>(())
    /// ```
    pub fn ranks(&self) -> CommRanks {
        match &self.shared.ctx.lineage {
            Some(l) if self.epoch() == 0 && l.in_parent.len() == self.size() => l.clone(),
            _ => CommRanks {
                in_parent: (0..self.size()).collect(),
                in_world: (0..self.size()).collect(),
            },
        }
    }

    /// The lineage of a child made of the parent ranks `members`.
    fn lineage_of(&self, in_parent: Vec<usize>) -> CommRanks {
        let mine = self.ranks();
        let in_world = in_parent
            .iter()
            .map(|&p| mine.in_world.get(p).copied().unwrap_or(p))
            .collect();
        CommRanks {
            in_parent,
            in_world,
        }
    }

    fn not_supported(&self, op: &'static str, detail: &str) -> Error {
        Error::NotSupported {
            comm: self.shared.name.clone(),
            rank: self.rank(),
            backend: self.backend(),
            op,
            detail: detail.to_string(),
        }
    }

    async fn split_inner(
        &self,
        color: Option<u32>,
        key: i64,
        form: SplitForm,
        name: &str,
    ) -> Result<Option<Comm>> {
        // Every rank has the same backend, so every rank refuses here,
        // before the agreement step, and the parent stays usable.
        if self.capabilities().split == crate::backends::SplitMode::Unsupported {
            return Err(self.not_supported(
                "split",
                "it cannot form a child communicator; create a new communicator on another backend for subgroups",
            ));
        }
        if name.is_empty() || name.contains('/') {
            return Err(
                self.invalid_split("a communicator name must be non-empty and contain no '/'")
            );
        }
        // EL-1: the parent's own split count, the same on every rank.
        let seq = self.shared.splits.fetch_add(1, Ordering::AcqRel);
        let (kind, check) = match form {
            SplitForm::List(check) => (1, check),
            SplitForm::Color => (2, 0),
        };
        let mine = vec![
            color.map(i64::from).unwrap_or(-1),
            key,
            check,
            fnv(name.as_bytes()),
            kind,
        ];
        let all = self
            .all_gather_async(Tensor::from_vec(mine))
            .skip_hooks()
            .await?
            .to_vec::<i64>();
        let mismatch = |detail: String| Error::Mismatch {
            comm: self.shared.name.clone(),
            rank: self.rank(),
            op: "split",
            seq,
            epoch: self.epoch(),
            detail,
            // Found after a completed all_gather: every rank agrees, the parent stays usable.
            fatal: false,
        };
        if all.len() != 5 * self.size() {
            return Err(mismatch("split exchange returned a wrong size".into()));
        }
        let rows: Vec<&[i64]> = all.chunks(5).collect();
        let api = |k: i64| if k == 1 { "split" } else { "split_by_color" };
        if let Some(r) = rows.iter().position(|row| row[4] != rows[0][4]) {
            return Err(mismatch(format!(
                "rank 0 called {} and rank {r} called {}",
                api(rows[0][4]),
                api(rows[r][4])
            )));
        }
        // BE-4: children numbered densely, the same way on every rank.
        let mut colors: Vec<i64> = rows.iter().map(|row| row[0]).filter(|&c| c >= 0).collect();
        colors.sort_unstable();
        colors.dedup();
        // The members of `c`, as (key, parent rank), in child-rank order.
        let members_of = |c: i64| -> Vec<(i64, usize)> {
            let mut m: Vec<(i64, usize)> = rows
                .iter()
                .enumerate()
                .filter(|(_, row)| row[0] == c)
                .map(|(r, row)| (row[1], r))
                .collect();
            m.sort_unstable();
            m
        };
        if matches!(form, SplitForm::List(_)) {
            // Each group's members passed exactly the list they form.
            let mut group_checks = Vec::with_capacity(colors.len());
            for &c in &colors {
                let list: Vec<usize> = members_of(c).iter().map(|&(_, r)| r).collect();
                let expect = list_check(&list);
                if let Some(&r) = list.iter().find(|&&r| rows[r][2] != expect) {
                    return Err(mismatch(format!(
                        "rank {r} passed a rank list to split that differs from the group \
                         its other members formed ({list:?})"
                    )));
                }
                group_checks.push(expect);
            }
            // A non-member's non-empty list must be some group's list (the
            // same-list form); anything else is a caller error.
            let stray = rows
                .iter()
                .position(|row| row[0] < 0 && row[2] != 0 && !group_checks.contains(&row[2]));
            if let Some(r) = stray {
                let detail = format!(
                    "rank {r} passed a non-empty rank list without itself that no group \
                     formed; a rank that joins no group passes an empty list"
                );
                return Err(if r == self.rank() {
                    self.invalid_split(detail)
                } else {
                    mismatch(detail)
                });
            }
        }
        let Some(color) = color else {
            // A native split needs every parent rank, members or not.
            self.native_split(None).await?;
            return Ok(None);
        };
        let members = members_of(i64::from(color));
        if let Some((_, r)) = members
            .iter()
            .find(|(_, r)| rows[*r][3] != fnv(name.as_bytes()))
        {
            return Err(mismatch(format!(
                "rank {r} named its child of color {color} differently"
            )));
        }
        let rank = members
            .iter()
            .position(|&(_, r)| r == self.rank())
            .ok_or_else(|| Error::Internal("split: this rank is not in its own color".into()))?;
        let parent = &self.shared.ctx;
        let key_prefix = format!("{}/split/{seq}/{color}", self.shared.key_prefix);
        let spec = crate::Spec {
            backend: self.shared.backend_requested.clone(),
            device: self.device(),
            rank,
            size: members.len(),
            epoch: 0,
            key_prefix: format!("{key_prefix}/epoch/0"),
            ctx: Arc::new(CommCtx {
                name: name.to_string(),
                job: parent.job.clone(),
                base: key_prefix,
                store: parent.store.clone(),
                secret: parent.secret.clone(),
                bind_ip: parent.bind_ip,
                options: parent.options.clone(),
                server: parent.server.clone(),
                store_host: parent.store_host,
                lineage: Some(self.lineage_of(members.iter().map(|&(_, r)| r).collect())),
            }),
            parent: Some(self.shared.clone()),
        };
        let dense = colors
            .iter()
            .position(|&c| c == i64::from(color))
            .ok_or_else(|| {
                Error::Internal("split: this rank's color is not in the exchange".into())
            })?;
        let native = self
            .native_split(Some(SplitChild {
                color: dense as u32,
                init: spec.backend_init(),
            }))
            .await?;
        // The child's actor is spawned linked under this one's: it is
        // finalized or aborted first (AC-4), and its failure is reported here.
        let child = match native {
            NativeSplit::Unsupported => crate::start(spec).await?,
            NativeSplit::Child(backend) => crate::start_with_backend(spec, backend).await?,
            NativeSplit::NoChild => {
                return Err(Error::Internal(
                    "split: the backend's native split gave a member no child".into(),
                ))
            }
        };
        Ok(Some(child))
    }

    /// Let the backend split its own communicator (every parent rank
    /// calls this once per split, right after the agreement all_gather), as
    /// one turn of the actor, ordered with the parent's ops.
    async fn native_split(&self, child: Option<SplitChild>) -> Result<NativeSplit> {
        let args = SplitArgs {
            child,
            timeout: self.shared.ctx.options.connect_timeout,
        };
        let home = &self.shared.home;
        if home.status.state() != crate::State::Active {
            return Err(self.closed_error());
        }
        let (reply, rx) = tokio::sync::oneshot::channel();
        home.enqueue(Queued::Split { args, reply });
        rx.await.map_err(|_| self.closed_error())?
    }

    /// Build the two levels of a hierarchy from this communicator: `local`
    /// (the ranks on this host, as named by `CHORUS_HOST_ID` or the host
    /// name) and `cross` (the ranks with the same local rank on every host).
    /// Collective over this communicator.
    ///
    /// # Errors
    /// As [`Comm::split`].
    pub fn hierarchy(&self) -> Result<Hierarchy> {
        self.hierarchy_by(&host_id())
    }

    /// Async form of [`Comm::hierarchy`].
    ///
    /// # Errors
    /// As [`Comm::split`].
    pub async fn hierarchy_async(&self) -> Result<Hierarchy> {
        self.hierarchy_by_async(&host_id()).await
    }

    /// [`Comm::hierarchy`] with an explicit host identity: ranks passing the
    /// same `host` are grouped as local.
    ///
    /// # Errors
    /// As [`Comm::split`].
    pub fn hierarchy_by(&self, host: &str) -> Result<Hierarchy> {
        let host = host.to_string();
        self.block("hierarchy", move |c| async move {
            c.hierarchy_by_async(&host).await
        })
    }

    /// Async form of [`Comm::hierarchy_by`].
    ///
    /// # Errors
    /// As [`Comm::split`].
    pub async fn hierarchy_by_async(&self, host: &str) -> Result<Hierarchy> {
        let color = (fnv(host.as_bytes()) & 0x7fff_ffff) as u32;
        let local = self
            .split_by_color_async(
                Some(color),
                self.rank() as i64,
                &format!("{}.local", self.name()),
            )
            .await?
            .ok_or_else(|| Error::Internal("hierarchy: no local group".into()))?;
        let cross = self
            .split_by_color_async(
                Some(local.rank() as u32),
                self.rank() as i64,
                &format!("{}.cross", self.name()),
            )
            .await?
            .ok_or_else(|| Error::Internal("hierarchy: no cross group".into()))?;
        Ok(Hierarchy { local, cross })
    }

    /// How many ranks registered through [`join_comm`] for this
    /// communicator's next epoch.
    ///
    /// # Errors
    /// [`Error::Transport`] if the store cannot be read.
    pub fn pending_joiners(&self) -> Result<usize> {
        self.block("pending_joiners", |c| async move {
            c.pending_joiners_async().await
        })
    }

    /// Async form of [`Comm::pending_joiners`].
    ///
    /// # Errors
    /// As [`Comm::pending_joiners`].
    pub async fn pending_joiners_async(&self) -> Result<usize> {
        let ctx = self.shared.ctx.clone();
        let key = format!("{}/joiners", epoch_prefix(&ctx.base, self.epoch() + 1));
        self.on_runtime(move |_| async move {
            ctx.store
                .add(&key, 0)
                .await
                .map(|n| n.max(0) as usize)
                .map_err(transport)
        })
        .await
    }

    /// Form the next epoch of this communicator from the ranks that survive
    /// (and the ranks that joined through [`join_comm`]), and return it with
    /// the old→new rank map. Every surviving rank must call it. This
    /// communicator keeps its heartbeats while the survivors gather, so a
    /// rank that died without any op noticing (say, during a split's child)
    /// is found within `heartbeat_timeout` instead of being waited for; it is
    /// finalized (if still active) once the new membership is closed.
    ///
    /// # Errors
    /// [`Error::NoQuorum`] if too few ranks survived — a minority
    /// partition never forms an epoch; [`Error::Excluded`] if the membership
    /// was closed without this rank (it arrived after the deadline);
    /// [`Error::Transport`] if the store cannot be reached; errors of
    /// connecting the new epoch's links.
    pub fn reconfigure(&self, opts: ReconfigureOptions) -> Result<(Comm, RankMap)> {
        self.block("reconfigure", move |c| async move {
            c.reconfigure_async(opts).await
        })
    }

    /// Async form of [`Comm::reconfigure`].
    ///
    /// # Errors
    /// As [`Comm::reconfigure`].
    pub async fn reconfigure_async(&self, opts: ReconfigureOptions) -> Result<(Comm, RankMap)> {
        if !self.capabilities().elastic {
            return Err(self.not_supported(
                "reconfigure",
                "its world is fixed by the launcher; restart the job to change its size",
            ));
        }
        self.on_runtime(move |c| async move {
            let r = c.reconfigure_inner(opts).await;
            // Whatever the outcome, this epoch is over on this rank.
            let _ = c.finalize_async().await;
            r
        })
        .await
    }

    /// The ranks known to have failed in this epoch: the published failure
    /// notice (what every rank agreed on, WD-2), else this rank's own view.
    /// Sorted, deduplicated, in range. For an epoch this rank could not
    /// start (EL-7), that epoch's notice.
    async fn known_failed(&self, unstarted: Option<&Unstarted>) -> Vec<usize> {
        let store = &self.shared.ctx.store;
        let (prefix, epoch, size) = match unstarted {
            Some(u) => (
                epoch_prefix(&self.shared.ctx.base, u.epoch),
                u.epoch,
                u.size,
            ),
            None => (self.shared.key_prefix.clone(), self.epoch(), self.size()),
        };
        let mut failed: Vec<usize> = match store.get(&notice_key(&prefix)).await {
            Ok(Some(raw)) => Notice::parse(&raw, epoch)
                .map(|n| n.failed_ranks)
                .unwrap_or_default(),
            _ => vec![],
        };
        if failed.is_empty() && unstarted.is_none() {
            failed = self.health().failed_ranks;
        }
        failed.retain(|&r| r < size);
        failed.sort_unstable();
        failed.dedup();
        failed
    }

    async fn reconfigure_inner(&self, opts: ReconfigureOptions) -> Result<(Comm, RankMap)> {
        let ctx = self.shared.ctx.clone();
        let store = ctx.store.clone();
        // EL-7: go on from an epoch a previous attempt formed but could not
        // start, as its member.
        let unstarted = self
            .shared
            .unstarted
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .clone();
        let unstarted = unstarted.as_ref();
        let (me, n, old_epoch) = match unstarted {
            Some(u) => (u.rank, u.size, u.epoch),
            None => (self.rank(), self.size(), self.epoch()),
        };
        let next = old_epoch + 1;
        let prefix = epoch_prefix(&ctx.base, next);
        let excluded = || Error::Excluded {
            comm: ctx.name.clone(),
            epoch: next,
            reason: format!(
                "rank {me} was declared failed in epoch {old_epoch}; join again with join_comm"
            ),
        };
        let mut failed = self.known_failed(unstarted).await;
        if failed.contains(&me) {
            // Declared failed (hung, partitioned): the others moved on without us.
            return Err(excluded());
        }
        tracing::info!(comm = %ctx.name, rank = me, epoch = next, ?failed, "reconfiguring");
        // The member key carries this process's presence endpoint, which
        // the member's ring neighbours probe while the epoch starts (EL-8).
        let (watched, presence) = presence_of(&ctx.options, ctx.bind_ip);
        store
            .set(
                &format!("{prefix}/member/{me}"),
                presence.map_or_else(|| b"1".to_vec(), |a| a.to_string().into_bytes()),
            )
            .await
            .map_err(transport)?;
        // Counted after the key is set: a count of k means at least k
        // member keys can be read (EL-6).
        let arrived_key = format!("{prefix}/arrived");
        store.add(&arrived_key, 1).await.map_err(transport)?;
        let mut expected: Vec<usize> = (0..n).filter(|r| !failed.contains(r)).collect();
        let closed_key = format!("{prefix}/closed");
        let joiners_key = format!("{prefix}/joiners");
        let deadline = Instant::now() + opts.timeout;
        // The coordinator's view of who registered (and with which presence
        // endpoint): a member key, once set, stays for the epoch, so each
        // poll reads only the keys not seen yet.
        let mut registered: Vec<Option<Option<SocketAddr>>> = vec![None; n];
        let closed = loop {
            if let Some(raw) = store.get(&closed_key).await.map_err(transport)? {
                break Closed::parse(&raw).ok_or_else(|| {
                    Error::Internal(format!("malformed membership record at {closed_key}"))
                })?;
            }
            // A failure found after this rank's own op failed (a death in a
            // split's child bootstrap shows here as a transport error; the
            // heartbeats name the dead rank a little later) stops the wait
            // for it, and may make this rank the coordinator.
            let now_failed = self.known_failed(unstarted).await;
            if now_failed != failed {
                if now_failed.contains(&me) {
                    return Err(excluded());
                }
                failed = now_failed;
                expected = (0..n).filter(|r| !failed.contains(r)).collect();
            }
            // EL-6: only the coordinator, the lowest rank expected to
            // arrive, polls the members; the others wait for the closed
            // record (one store request per slice), looking again at who
            // failed between slices, and every rank closes at the deadline.
            if expected.first() != Some(&me) {
                let now = Instant::now();
                if now < deadline {
                    match store
                        .wait(
                            std::slice::from_ref(&closed_key),
                            MEMBERSHIP_SLICE.min(deadline - now),
                        )
                        .await
                    {
                        Ok(_) | Err(TransportError::WaitTimeout { .. }) => {}
                        Err(e) => return Err(transport(e)),
                    }
                    continue;
                }
            }
            // The members' keys are read once enough ranks say they
            // arrived to cover every expected one (or at the deadline).
            let arrived = store.add(&arrived_key, 0).await.map_err(transport)?.max(0) as usize;
            if arrived >= expected.len() || Instant::now() >= deadline {
                for (r, seen) in registered
                    .iter_mut()
                    .enumerate()
                    .filter(|(_, s)| s.is_none())
                {
                    *seen = store
                        .get(&format!("{prefix}/member/{r}"))
                        .await
                        .map_err(transport)?
                        .map(|raw| parse_endpoint(&raw));
                }
            }
            let present: Vec<usize> = (0..n).filter(|&r| registered[r].is_some()).collect();
            let joiners = store.add(&joiners_key, 0).await.map_err(transport)?.max(0) as usize;
            let all_here = expected.iter().all(|r| present.contains(r));
            if (all_here && joiners >= opts.wait_joiners) || Instant::now() >= deadline {
                let size = present.len() + joiners;
                let quorum = match opts.min_size {
                    Some(m) => size >= m.max(1),
                    None => present.len() * 2 > n,
                };
                // The joiners' endpoints, by ticket (EL-8): O(joiners), read
                // only when closing.
                let mut presence: Vec<Option<SocketAddr>> =
                    present.iter().map(|&r| registered[r].flatten()).collect();
                for t in 0..joiners {
                    let raw = store
                        .get(&joiner_key(&prefix, t))
                        .await
                        .map_err(transport)?;
                    presence.push(raw.as_deref().and_then(parse_endpoint));
                }
                let mine = Closed {
                    quorum,
                    old_size: n,
                    presence,
                    survivors: present,
                    joiners,
                };
                match store
                    .compare_set(&closed_key, None, mine.encode())
                    .await
                    .map_err(transport)?
                {
                    CompareSet::Swapped => break mine,
                    CompareSet::Current(_) => continue,
                }
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        };
        // The old epoch kept running while the membership was open: its
        // heartbeats name a rank that died without its failure being seen
        // yet (above). Now close it (a no-op if a failure aborted it, or if
        // it was closed by an earlier attempt, EL-7).
        if unstarted.is_none() {
            if let Some(done) = self.finalize_request() {
                let _ = done.await;
            }
        }
        if !closed.quorum {
            return Err(Error::NoQuorum {
                comm: ctx.name.clone(),
                rank: me,
                epoch: next,
                survivors: closed.survivors,
                old_size: n,
            });
        }
        let Some(rank) = closed.survivors.iter().position(|&r| r == me) else {
            return Err(Error::Excluded {
                comm: ctx.name.clone(),
                epoch: next,
                reason: format!(
                    "rank {me} arrived after the membership of epoch {next} was closed \
                     with ranks {:?}",
                    closed.survivors
                ),
            });
        };
        // The caller's ranks, through the epoch that did not start (EL-7).
        let from_caller: Vec<Option<usize>> = match unstarted {
            Some(u) => u.from_caller.clone(),
            None => (0..n).map(Some).collect(),
        };
        let old_to_new: Vec<Option<usize>> = from_caller
            .iter()
            .map(|r| r.and_then(|r| closed.survivors.iter().position(|&s| s == r)))
            .collect();
        let map = RankMap {
            epoch: next,
            size: closed.size(),
            old_to_new: old_to_new.clone(),
            joined: (closed.survivors.len()..closed.size()).collect(),
        };
        // EL-8: watch the ring neighbours while the epoch's backend connects.
        let watch = watched.then(|| start_watch(&ctx, &prefix, next, rank, &closed, presence));
        let started = start_epoch(
            &ctx,
            self.shared.backend_requested.clone(),
            self.device(),
            rank,
            closed.size(),
            next,
            watch,
        )
        .await;
        let set_unstarted = |u: Option<Unstarted>| {
            *self
                .shared
                .unstarted
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner) = u;
        };
        match started {
            Ok(comm) => {
                set_unstarted(None);
                Ok((comm, map))
            }
            Err(e) => {
                // EL-7: fail the epoch in the store, so the ranks that did
                // start it fail too and every rank goes on from it.
                let failed: Vec<usize> = e
                    .failed_ranks()
                    .iter()
                    .copied()
                    .filter(|&r| r < closed.size() && r != rank)
                    .collect();
                if !failed.is_empty() {
                    let notice = Notice {
                        epoch: next,
                        by: rank,
                        failed_ranks: failed,
                        detail: format!("epoch {next} could not start: {e}"),
                        mismatch: false,
                    };
                    let key = notice_key(&epoch_prefix(&ctx.base, next));
                    let _ = store.compare_set(&key, None, notice.encode()).await;
                    set_unstarted(Some(Unstarted {
                        epoch: next,
                        rank,
                        size: closed.size(),
                        from_caller: old_to_new,
                    }));
                }
                Err(e)
            }
        }
    }
}

async fn start_epoch(
    ctx: &Arc<CommCtx>,
    backend: String,
    device: Device,
    rank: usize,
    size: usize,
    epoch: u64,
    watch: Option<StartWatch>,
) -> Result<Comm> {
    let spec = crate::Spec {
        backend,
        device,
        rank,
        size,
        epoch,
        key_prefix: epoch_prefix(&ctx.base, epoch),
        ctx: ctx.clone(),
        parent: None,
    };
    // The backend connects while the watch runs; the watch reports a dead
    // member to it through `peers_failed`, and ends with the connect.
    let (report, peers_failed) = crate::backends::PeerFailures::channel();
    let mut init = spec.backend_init();
    init.peers_failed = peers_failed;
    let connect = crate::backends::create_on(&spec.backend, spec.device, init);
    let watching = async move {
        if let Some(w) = watch {
            w.run(report).await;
        }
        std::future::pending::<std::convert::Infallible>().await
    };
    let backend = tokio::select! {
        b = connect => b?,
        never = watching => match never {},
    };
    let comm = crate::start_with_backend(spec, backend).await?;
    if rank == 0 {
        publish_latest(&comm).await;
        // Every member connected, so none reads the last epoch's keys any
        // more: they go (the last rank out of a clean finalize does the same).
        if let Some(prev) = epoch.checked_sub(1) {
            let old = format!("{}/", epoch_prefix(&ctx.base, prev));
            let done = tokio::time::timeout(
                crate::actors::executor::KEY_RELEASE,
                ctx.store.delete_prefix(&old),
            )
            .await;
            match done {
                Ok(Ok(n)) => {
                    tracing::debug!(prefix = %old, keys = n, "deleted the last epoch's keys")
                }
                Ok(Err(e)) => {
                    tracing::warn!(prefix = %old, error = %e, "cannot delete the last epoch's keys")
                }
                Err(_) => {
                    tracing::warn!(prefix = %old, "the store did not answer; the last epoch's keys stay")
                }
            }
        }
    }
    Ok(comm)
}

/// Join a running communicator called `name` as a new rank: register for
/// its next epoch and wait until the survivors [`reconfigure`](Comm::reconfigure)
/// with this rank admitted. `options` must reach the job's store (rendezvous
/// and secret); its rank and size are ignored.
///
/// # Errors
/// [`Error::Excluded`] if no epoch admitted this rank before
/// `options.connect_timeout`; [`Error::NoQuorum`] if the epoch it was waiting
/// for had no quorum; [`Error::Transport`] if the store cannot be reached.
pub fn join_comm(backend: &str, device: Device, name: &str, options: CommOptions) -> Result<Comm> {
    crate::backends::check_name(backend)?;
    let (backend, name) = (backend.to_string(), name.to_string());
    let rt = crate::runtime::handle_for(&options);
    crate::runtime::block_on("join_comm", &rt, join(backend, device, name, options))?
}

/// Async form of [`join_comm`].
///
/// # Errors
/// As [`join_comm`].
pub async fn join_comm_async(
    backend: &str,
    device: Device,
    name: &str,
    options: CommOptions,
) -> Result<Comm> {
    crate::backends::check_name(backend)?;
    let (backend, name) = (backend.to_string(), name.to_string());
    let rt = crate::runtime::handle_for(&options);
    crate::runtime::run_on(&rt, join(backend, device, name, options)).await?
}

async fn join(backend: String, device: Device, name: String, options: CommOptions) -> Result<Comm> {
    let secret = crate::bootstrap::secret(&options);
    let timeout = options.connect_timeout;
    // Rank 1 of 2: a joiner never hosts the store.
    let connected =
        crate::bootstrap::connect_store(options.rendezvous.clone(), 1, 2, &secret, timeout).await?;
    let store = connected.store.clone();
    let job = if connected.shared {
        crate::bootstrap::agreed_job_id(
            store.as_ref(),
            crate::bootstrap::JobRole::Joiner,
            usize::MAX,
            secret.as_deref().unwrap_or_default(),
            timeout,
        )
        .await?
    } else {
        crate::bootstrap::job_id(secret.as_deref().unwrap_or_default())?
    };
    let deadline = Instant::now() + timeout;
    let mut tried: Option<Vec<u8>> = None;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        let latest = loop {
            let v = store
                .wait(&[latest_key(&job, &name)], left)
                .await
                .map_err(transport)?
                .pop()
                .unwrap_or_default();
            if Some(&v) != tried.as_ref() {
                break v;
            }
            if Instant::now() >= deadline {
                return Err(Error::Excluded {
                    comm: name,
                    epoch: 0,
                    reason: "no epoch admitted this joiner in time".into(),
                });
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        tried = Some(latest.clone());
        let Some(Record::Latest { base, epoch }) = Record::decode(&latest) else {
            return Err(Error::Transport(TransportError::Malformed(format!(
                "the latest-epoch record of {name:?} is not a valid record"
            ))));
        };
        let next = epoch + 1;
        let prefix = epoch_prefix(&base, next);
        let ticket = store
            .add(&format!("{prefix}/joiners"), 1)
            .await
            .map_err(transport)?
            .max(1) as usize
            - 1;
        tracing::info!(comm = %name, epoch = next, ticket, "registered as a joiner");
        // EL-8: this process's presence endpoint, under the ticket.
        let bind_ip = crate::bootstrap::bind_ip(&options, connected.local_ip)?;
        let (watched, presence) = presence_of(&options, bind_ip);
        if let Some(a) = presence {
            store
                .set(&joiner_key(&prefix, ticket), a.to_string().into_bytes())
                .await
                .map_err(transport)?;
        }
        let left = deadline.saturating_duration_since(Instant::now());
        let raw = store
            .wait(&[format!("{prefix}/closed")], left)
            .await
            .map_err(transport)?
            .pop()
            .unwrap_or_default();
        let closed = Closed::parse(&raw)
            .ok_or_else(|| Error::Internal(format!("malformed membership record for {prefix}")))?;
        if !closed.quorum {
            return Err(Error::NoQuorum {
                comm: name,
                rank: usize::MAX,
                epoch: next,
                survivors: closed.survivors,
                old_size: closed.old_size,
            });
        }
        if ticket < closed.joiners {
            let ctx = Arc::new(CommCtx {
                name: name.clone(),
                job: job.clone(),
                base,
                store: store.clone(),
                secret: Arc::from(secret.clone().unwrap_or_default()),
                bind_ip,
                options: options.clone(),
                server: None,
                store_host: None,
                lineage: None,
            });
            let rank = closed.survivors.len() + ticket;
            let watch = watched.then(|| start_watch(&ctx, &prefix, next, rank, &closed, presence));
            return start_epoch(&ctx, backend, device, rank, closed.size(), next, watch).await;
        }
        // Closed before our ticket counted: try the epoch after it.
        tracing::info!(comm = %name, epoch = next, "membership closed without this joiner; retrying");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn el2_membership_record_round_trips() {
        let c = Closed {
            quorum: true,
            old_size: 4,
            survivors: vec![0, 1, 3],
            joiners: 1,
            presence: vec![
                Some(SocketAddr::from(([127, 0, 0, 1], 4000))),
                None,
                None,
                Some(SocketAddr::from(([0, 0, 0, 0, 0, 0, 0, 1], 9))),
            ],
        };
        assert_eq!(Closed::parse(&c.encode()), Some(c.clone()));
        assert_eq!(c.size(), 4);
        // EL-8: one endpoint per member, joiners included.
        let short = Closed {
            presence: c.presence[..3].to_vec(),
            ..c.clone()
        };
        assert_eq!(Closed::parse(&short.encode()), None);
        assert_eq!(parse_endpoint(b"127.0.0.1:4000"), c.presence[0]);
        assert_eq!(parse_endpoint(b"1"), None);
        assert_eq!(Closed::parse(b"maybe|1||0"), None);
    }
}
