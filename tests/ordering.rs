//! Issue 25: ops run in issue order on every path.
//!
//! The contract (docs: ARCHITECTURE.md, "Ordering"): an op takes its place
//! in its communicator's order when it is issued, in the program order of
//! the issuing code, and runs only when its place is next, whichever thread
//! runs it (the actor, a turn lent to a blocked caller, a task on the
//! caller's runtime). Every rank issues the same ops in the same order, so
//! every rank runs them in that order and each op meets its own peers.
//!
//! This file proves it through the public API only:
//!
//! - `lognet`, a test backend registered with [`chorus::register_backend`]
//!   (the in-memory `memnet` of `tests/common/memnet.rs`, wrapped), records on each
//!   rank the order in which it executes ops (each op's tensor carries a tag
//!   that the backend appends to the rank's log) and delays ops by a seeded
//!   random time, so that ops overlap in every way the runtime allows.
//! - ORD-1 `ops_run_in_issue_order_on_every_rank_across_2000_generated_cases`:
//!   2 000 generated sequences of 2-8 ops on 2 and 4 in-process ranks,
//!   issued with a mix of blocking ops, `_async` + `.await`, `_async` +
//!   `Work::wait()` or `Work::wait_timeout()` (inside `spawn_blocking` on a
//!   task), Works dropped right after issue, and Works waited out of order; issued from 1-3 threads or tokio tasks that hand the issuing
//!   on in a fixed program order (so the issue order is the same on every
//!   rank) while the waits happen on any of them. Every rank's log must be
//!   the issue order, and every op's result must be its own (distinct values
//!   per op catch ops whose data was swapped between ranks). A blocking
//!   all_reduce closes each case, so a dropped Work's op must have run by
//!   then. The communicators are created once per world size; only a case
//!   that breaks the order (and may have left them out of step or aborted)
//!   makes the ranks start fresh ones.
//! - ORD-2 `a_later_op_never_overtakes_a_slow_barrier_across_40_runs`: the
//!   reported sequence `a = barrier_async(); b = all_reduce_async();
//!   a.await; c = all_gather_async(); b.await; c.await` with a 20 ms
//!   barrier, 40 times.
//! - ORD-3 `a_blocking_op_never_overtakes_an_awaited_one_on_the_cpu_backend`:
//!   the reported `cpu`-backend reproduction, 60 rounds of two async
//!   all_reduces and a blocking one issued from inside the same async
//!   context; every value must be its own op's.
//!
//! Every case and every test is bounded in time: a hang fails (with what
//! was seen so far) rather than hangs. ORD-1's cases come from a seeded
//! generator, the same on every rank; a failure prints the seed and the
//! failing cases, and `CHORUS_ORDERING_SEED=<seed>` replays them.

mod common;

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::fmt;
use std::future::Future;
use std::sync::{mpsc, Arc, LazyLock, Mutex, Once};
use std::task::{Context, Poll, Wake, Waker};
use std::time::{Duration, Instant};

use chorus::backends::{async_trait, Backend, BackendInit, OpCtx, OpData};
use chorus::transport::{MemoryStore, Store};
use chorus::{new_comm, Comm, Device, Error, ReduceOp, Result, Tensor, Work};
use common::memnet::MemNet;

/// How long a blocking op may take before the communicator fails it.
const OP_TIMEOUT: Duration = Duration::from_secs(5);

/// How long one case (every op of it, on one rank) may take.
const CASE_LIMIT: Duration = Duration::from_secs(10);

/// How many violating cases a failure message lists.
const SHOWN: usize = 5;

// ------------------------------------------------------------------ rng

/// SplitMix64: a tiny seeded generator, identical on every rank.
#[derive(Clone)]
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        let mut r = Rng(seed);
        r.next();
        r
    }

    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n`.
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    /// Uniform in `lo..=hi`.
    fn between(&mut self, lo: usize, hi: usize) -> usize {
        lo + self.below(hi - lo + 1)
    }

    fn shuffle<T>(&mut self, v: &mut [T]) {
        for i in (1..v.len()).rev() {
            v.swap(i, self.below(i + 1));
        }
    }
}

/// A seed derived from several numbers (a hash, for per-op delays).
fn mix(parts: &[u64]) -> u64 {
    parts
        .iter()
        .fold(0x5EED, |acc, &p| Rng::new(acc ^ p.rotate_left(17)).next())
}

// ------------------------------------------------------------------ lognet

/// The collectives the cases use.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kind {
    Barrier,
    AllReduce,
    AllGather,
    Broadcast,
}

/// One line of a rank's execution log: what ran, and the tag its tensor
/// carried (0 for a barrier, which has none).
#[derive(Clone, Copy, PartialEq, Eq)]
struct Entry {
    kind: Kind,
    tag: u64,
}

impl fmt::Debug for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.kind {
            Kind::Barrier => write!(f, "barrier"),
            Kind::AllReduce => write!(f, "all_reduce#{}", self.tag),
            Kind::AllGather => write!(f, "all_gather#{}", self.tag),
            Kind::Broadcast => write!(f, "broadcast#{}", self.tag),
        }
    }
}

type Log = Arc<Mutex<Vec<Entry>>>;

/// Execution logs by (communicator name, rank).
static LOGS: LazyLock<Mutex<HashMap<(String, usize), Log>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// The execution log of `rank` of the communicator `comm`.
fn log_of(comm: &str, rank: usize) -> Log {
    LOGS.lock()
        .unwrap()
        .entry((comm.to_string(), rank))
        .or_default()
        .clone()
}

/// How `lognet` delays the ops of a communicator.
#[derive(Clone, Copy, Debug)]
enum Delays {
    /// None.
    Off,
    /// A random delay per op (none, a few yields, a busy spin of up to
    /// 300 µs, or a sleep of up to 2 ms), drawn from `seed`, the rank and
    /// the op's sequence number.
    Random { seed: u64 },
    /// Every barrier takes this long; other ops are not delayed.
    SlowBarrier(Duration),
}

/// Delays by communicator name, set before the communicator is created.
static DELAYS: LazyLock<Mutex<HashMap<String, Delays>>> =
    LazyLock::new(|| Mutex::new(HashMap::new()));

/// `memnet` (tests/common/memnet.rs) plus the execution log and delays.
struct LogNet {
    net: MemNet,
    log: Log,
    delays: Delays,
}

impl LogNet {
    /// Hold the op for the time its communicator's [`Delays`] say.
    async fn delay(&self, ctx: &OpCtx, kind: Kind) {
        match self.delays {
            Delays::Off => {}
            Delays::SlowBarrier(d) => {
                if kind == Kind::Barrier {
                    tokio::time::sleep(d).await;
                }
            }
            Delays::Random { seed } => {
                let mut rng = Rng::new(mix(&[seed, ctx.rank as u64, ctx.seq]));
                match rng.below(5) {
                    0 | 1 => {}
                    2 => {
                        for _ in 0..rng.between(1, 8) {
                            tokio::task::yield_now().await;
                        }
                    }
                    3 => {
                        let until =
                            Instant::now() + Duration::from_micros(rng.between(20, 300) as u64);
                        while Instant::now() < until {
                            std::hint::spin_loop();
                        }
                    }
                    _ => {
                        let d = Duration::from_micros(rng.between(100, 2000) as u64);
                        tokio::time::sleep(d).await;
                    }
                }
            }
        }
    }
}

/// The tag an op's tensor carries: its first element.
fn tag_of(t: &Tensor) -> u64 {
    t.to_f64_vec().first().map_or(0, |&v| v as u64)
}

#[async_trait]
impl Backend for LogNet {
    fn name(&self) -> &'static str {
        "lognet"
    }

    async fn exchange_headers(
        &mut self,
        ctx: &OpCtx,
        outgoing: Vec<(usize, u64, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>> {
        self.net.exchange_headers(ctx, outgoing).await
    }

    async fn execute(&mut self, ctx: &OpCtx, data: &mut OpData) -> Result<()> {
        // The core runs one op at a time: the order of these entries is
        // the order in which this rank runs its ops.
        let entry = match data {
            OpData::Barrier => Entry {
                kind: Kind::Barrier,
                tag: 0,
            },
            OpData::AllReduce { buf, .. } => Entry {
                kind: Kind::AllReduce,
                tag: tag_of(buf),
            },
            OpData::AllGather { input, .. } => Entry {
                kind: Kind::AllGather,
                tag: tag_of(input),
            },
            OpData::Broadcast { buf, .. } => Entry {
                kind: Kind::Broadcast,
                tag: tag_of(buf),
            },
            other => {
                return Err(Error::NotSupported {
                    comm: ctx.comm.to_string(),
                    rank: ctx.rank,
                    backend: "lognet",
                    op: ctx.kind.name(),
                    detail: format!(
                        "lognet runs barrier, all_reduce, all_gather and broadcast, not {other:?}"
                    ),
                })
            }
        };
        self.log.lock().unwrap().push(entry);
        self.delay(ctx, entry.kind).await;
        self.net.execute(ctx, data).await
    }

    async fn abort(&mut self, reason: &str, failed: &[usize]) {
        self.net.abort(reason, failed).await
    }

    async fn finalize(&mut self) {
        self.net.finalize().await
    }
}

fn register() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        chorus::register_backend("lognet", |device, init: BackendInit| async move {
            if device != Device::Cpu {
                return Err(Error::BackendUnavailable {
                    backend: "lognet",
                    reason: format!("lognet runs on the cpu device, not {device}"),
                });
            }
            let delays = DELAYS
                .lock()
                .unwrap()
                .get(&init.comm)
                .copied()
                .unwrap_or(Delays::Off);
            let log = log_of(&init.comm, init.rank);
            let net = MemNet::connect(&init);
            Ok(Box::new(LogNet { net, log, delays }) as Box<dyn Backend>)
        })
        .expect("lognet registers");
    });
}

// ------------------------------------------------------------------ worlds

/// What a world of ranks saw over its cases.
struct WorldReport {
    size: usize,
    /// Cases run on every rank.
    run: usize,
    /// Violating cases: by case index, what each rank that saw one saw.
    violations: BTreeMap<usize, Vec<(usize, String)>>,
    /// Why the world stopped before its last case, if it did.
    stopped: Option<String>,
}

impl WorldReport {
    /// The first few violating cases, one paragraph each.
    fn show(&self, describe: impl Fn(usize) -> String) -> String {
        let mut s = format!(
            "world {}: {} of {} cases violated the issue order",
            self.size,
            self.violations.len(),
            self.run
        );
        if let Some(why) = &self.stopped {
            s += &format!(" (stopped early: {why})");
        }
        for (case, seen) in self.violations.iter().take(SHOWN) {
            s += &format!("\n  case {case}: {}", describe(*case));
            for (rank, what) in seen {
                s += &format!("\n    rank {rank}: {what}");
            }
        }
        if self.violations.len() > SHOWN {
            s += &format!("\n  ... and {} more", self.violations.len() - SHOWN);
        }
        s
    }
}

/// What the ranks of a world share between cases.
struct Shared {
    barrier: std::sync::Barrier,
    /// Per case: the ranks that saw a violation, and what.
    seen: Mutex<BTreeMap<usize, Vec<(usize, String)>>>,
    /// Per case: some rank found the time budget spent after it.
    late: Mutex<BTreeSet<usize>>,
    /// Cases run on every rank.
    run: Mutex<usize>,
}

/// Run `cases` cases on `size` in-process ranks (threads) of `backend`,
/// in step: every rank runs case `i` on its communicator, then the ranks
/// meet. A case that violates the order on any rank may leave the ranks'
/// communicators out of step or aborted, so after one every rank aborts its
/// communicator and creates a fresh one (`<name>-g<generation>`, with
/// `delays`); a correct runtime creates each communicator once.
///
/// `case(comm, i)` returns what the rank saw wrong, if anything; a panic
/// counts as a violation. The world stops after the case during which
/// `budget` ran out; a rank that does not come back within `budget` plus a
/// grace period fails the test (a hang), with what was seen so far.
fn run_world<C>(
    backend: &'static str,
    size: usize,
    name: &str,
    delays: Delays,
    cases: usize,
    budget: Duration,
    case: C,
) -> WorldReport
where
    C: Fn(&Comm, usize) -> std::result::Result<(), String> + Send + Sync + 'static,
{
    let store: Arc<dyn Store> = Arc::new(MemoryStore::new());
    let shared = Arc::new(Shared {
        barrier: std::sync::Barrier::new(size),
        seen: Mutex::new(BTreeMap::new()),
        late: Mutex::new(BTreeSet::new()),
        run: Mutex::new(0),
    });
    let case = Arc::new(case);
    let stop_at = Instant::now() + budget;
    let (tx, rx) = mpsc::channel();
    for rank in 0..size {
        let (store, shared, case, tx, name) = (
            store.clone(),
            shared.clone(),
            case.clone(),
            tx.clone(),
            name.to_string(),
        );
        std::thread::Builder::new()
            .name(format!("{name}-rank-{rank}"))
            .spawn(move || {
                let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let make = |generation: usize| {
                        let name = format!("{name}-g{generation}");
                        DELAYS.lock().unwrap().insert(name.clone(), delays);
                        let o = common::opts(&store, rank, size).with_timeout(OP_TIMEOUT);
                        new_comm(backend, Device::Cpu, &name, o)
                            .unwrap_or_else(|e| panic!("rank {rank}: new_comm {name}: {e}"))
                    };
                    let mut generation = 0;
                    let mut comm = make(generation);
                    for i in 0..cases {
                        let got = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            case(&comm, i)
                        }))
                        .unwrap_or_else(|p| Err(format!("panicked: {}", panic_text(&p))));
                        if let Err(what) = got {
                            shared
                                .seen
                                .lock()
                                .unwrap()
                                .entry(i)
                                .or_default()
                                .push((rank, what));
                        }
                        if Instant::now() >= stop_at {
                            shared.late.lock().unwrap().insert(i);
                        }
                        shared.barrier.wait();
                        let bad = shared.seen.lock().unwrap().contains_key(&i);
                        let late = shared.late.lock().unwrap().contains(&i);
                        if rank == 0 {
                            *shared.run.lock().unwrap() = i + 1;
                        }
                        if late {
                            break;
                        }
                        if bad {
                            comm.abort();
                            generation += 1;
                            comm = make(generation);
                        }
                    }
                    let _ = comm.finalize();
                }));
                let _ = tx.send((rank, out.map_err(|p| panic_text(&p))));
            })
            .expect("spawn rank thread");
    }
    drop(tx);
    let grace = CASE_LIMIT * 2 + Duration::from_secs(10);
    let mut stopped = None;
    for _ in 0..size {
        let left = (stop_at + grace).saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok((_, Ok(()))) => {}
            Ok((rank, Err(p))) => {
                stopped = Some(format!("rank {rank} panicked: {p}"));
                break;
            }
            Err(_) => {
                stopped = Some(format!(
                    "a rank did not come back within {budget:?} + {grace:?} (hang)"
                ));
                break;
            }
        }
    }
    let run = *shared.run.lock().unwrap();
    let late = shared.late.lock().unwrap().first().copied();
    if stopped.is_none() && run < cases {
        stopped = Some(format!(
            "the {budget:?} budget ran out after case {}",
            late.unwrap_or(run)
        ));
    }
    let violations = shared.seen.lock().unwrap().clone();
    WorldReport {
        size,
        run,
        violations,
        stopped,
    }
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

/// Drive `fut` to completion on this (plain) thread, or give up after
/// `limit`: `.await` outside any tokio runtime, bounded.
fn block_on_timeout<F: Future>(fut: F, limit: Duration) -> Option<F::Output> {
    struct Unpark(std::thread::Thread);
    impl Wake for Unpark {
        fn wake(self: Arc<Self>) {
            self.0.unpark();
        }
    }
    let waker = Waker::from(Arc::new(Unpark(std::thread::current())));
    let mut cx = Context::from_waker(&waker);
    let mut fut = std::pin::pin!(fut);
    let deadline = Instant::now() + limit;
    loop {
        if let Poll::Ready(v) = fut.as_mut().poll(&mut cx) {
            return Some(v);
        }
        let now = Instant::now();
        if now >= deadline {
            return None;
        }
        std::thread::park_timeout(deadline - now);
    }
}

/// A runtime for the tasks of the cases (the caller's runtime, as Chorus
/// sees it).
fn test_runtime() -> Arc<tokio::runtime::Runtime> {
    Arc::new(
        tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("ordering-test-worker")
            .enable_all()
            .build()
            .expect("test runtime"),
    )
}

// ------------------------------------------------------------------ ops and values

/// The input of an op with `tag` on `rank`: `[tag, rank + 1]` (f64).
fn input(tag: u64, rank: usize) -> Tensor {
    Tensor::from_vec(vec![tag as f64, (rank + 1) as f64])
}

/// What an op with `tag` returns on every rank of `size`, when it met its
/// own peers: all_reduce (Sum) `[size * tag, size (size + 1) / 2]`,
/// all_gather every rank's input in rank order, broadcast the root's input.
fn expected(kind: Kind, root: usize, tag: u64, size: usize) -> Option<Vec<f64>> {
    let t = tag as f64;
    match kind {
        Kind::Barrier => None,
        Kind::AllReduce => Some(vec![size as f64 * t, (size * (size + 1) / 2) as f64]),
        Kind::AllGather => Some((0..size).flat_map(|r| [t, (r + 1) as f64]).collect()),
        Kind::Broadcast => Some(vec![t, (root + 1) as f64]),
    }
}

/// An op in flight.
enum Pending {
    Unit(Work<()>),
    Tensor(Work<Tensor>),
}

impl Pending {
    fn issue(comm: &Comm, kind: Kind, root: usize, tag: u64) -> Pending {
        let t = input(tag, comm.rank());
        match kind {
            Kind::Barrier => Pending::Unit(comm.barrier_async()),
            Kind::AllReduce => Pending::Tensor(comm.all_reduce_async(t, ReduceOp::Sum)),
            Kind::AllGather => Pending::Tensor(comm.all_gather_async(t)),
            Kind::Broadcast => Pending::Tensor(comm.broadcast_async(t, root)),
        }
    }

    async fn finish(self) -> Result<Option<Tensor>> {
        match self {
            Pending::Unit(w) => w.await.map(|()| None),
            Pending::Tensor(w) => w.await.map(Some),
        }
    }

    /// `Work::wait`: a hang is caught by the bound on the whole case.
    fn wait_unbounded(self) -> Result<Option<Tensor>> {
        match self {
            Pending::Unit(w) => w.wait().map(|()| None),
            Pending::Tensor(w) => w.wait().map(Some),
        }
    }

    /// `Work::wait_timeout`, bounded by [`CASE_LIMIT`].
    fn wait(self) -> std::result::Result<Result<Option<Tensor>>, String> {
        let late = || format!("Work::wait did not return within {CASE_LIMIT:?}");
        match self {
            Pending::Unit(w) => w
                .wait_timeout(CASE_LIMIT)
                .map(|r| r.map(|()| None))
                .map_err(|_| late()),
            Pending::Tensor(w) => w
                .wait_timeout(CASE_LIMIT)
                .map(|r| r.map(Some))
                .map_err(|_| late()),
        }
    }
}

/// The blocking form of an op.
fn run_blocking(comm: &Comm, kind: Kind, root: usize, tag: u64) -> Result<Option<Tensor>> {
    let t = input(tag, comm.rank());
    match kind {
        Kind::Barrier => comm.barrier().map(|()| None),
        Kind::AllReduce => comm.all_reduce(t, ReduceOp::Sum).map(Some),
        Kind::AllGather => comm.all_gather(t).map(Some),
        Kind::Broadcast => comm.broadcast(t, root).map(Some),
    }
}

/// What is wrong with an op's outcome, if anything.
fn check_value(
    kind: Kind,
    root: usize,
    tag: u64,
    size: usize,
    got: &Result<Option<Tensor>>,
) -> Option<String> {
    let want = expected(kind, root, tag, size);
    let what = Entry { kind, tag };
    match got {
        Err(e) => Some(format!("{what:?} failed: {e}")),
        Ok(t) => {
            let got = t.as_ref().map(Tensor::to_f64_vec);
            (got != want).then(|| format!("{what:?} returned {got:?}, want {want:?}"))
        }
    }
}

/// Compare a rank's execution log with the issue order.
fn check_log(log: &[Entry], issued: &[Entry]) -> Option<String> {
    (log != issued).then(|| format!("executed {log:?}, issued {issued:?}"))
}

// ------------------------------------------------------------------ generated cases

/// How an op is issued and waited for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Style {
    /// The blocking form.
    Blocking,
    /// `_async`, then `.await`.
    Await,
    /// `_async`, then `Work::wait()` (on a tokio task: inside
    /// `spawn_blocking`).
    Wait,
    /// `_async`, then `Work::wait_timeout()` (bounded by [`CASE_LIMIT`];
    /// on a tokio task: inside `spawn_blocking`).
    WaitTimeout,
    /// `_async`, the Work dropped at once: the op still runs, in order.
    Dropped,
}

/// One op of a case.
#[derive(Clone, Debug)]
struct Step {
    kind: Kind,
    root: usize,
    style: Style,
    /// The thread/task that issues it.
    issuer: usize,
    /// The thread/task that waits for it (Await, Wait, WaitTimeout).
    waiter: usize,
}

/// What one thread/task of a case does, in its program order.
#[derive(Clone, Copy, Debug)]
enum Action {
    /// Issue op `k`, once op `k - 1` was issued (by whichever thread/task).
    Issue(usize),
    /// Wait for op `k` (issued by whichever thread/task).
    Wait(usize),
}

/// A generated case: the same on every rank.
#[derive(Clone, Debug)]
struct Case {
    index: usize,
    size: usize,
    /// Issue (and wait) from tokio tasks rather than plain threads.
    on_tasks: bool,
    steps: Vec<Step>,
    /// Per thread/task, its actions.
    programs: Vec<Vec<Action>>,
}

impl Case {
    /// Case `index` of the world of `size` for `seed`.
    fn generate(seed: u64, size: usize, index: usize) -> Case {
        let mut rng = Rng::new(mix(&[seed, size as u64, index as u64]));
        let n = rng.between(2, 8);
        let contexts = rng.between(1, 3);
        let on_tasks = rng.below(2) == 1;
        let steps: Vec<Step> = (0..n)
            .map(|_| Step {
                kind: [
                    Kind::Barrier,
                    Kind::AllReduce,
                    Kind::AllReduce,
                    Kind::AllGather,
                    Kind::Broadcast,
                ][rng.below(5)],
                root: rng.below(size),
                style: [
                    Style::Blocking,
                    Style::Await,
                    Style::Await,
                    Style::Wait,
                    Style::WaitTimeout,
                    Style::Dropped,
                ][rng.below(6)],
                issuer: rng.below(contexts),
                waiter: rng.below(contexts),
            })
            .collect();
        // The global program: issue op k, then the waits placed after it
        // (each waited op is placed after a random later issue, or at the
        // end), in a random order: waits come late, early, out of order.
        let mut waits_after: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (k, s) in steps.iter().enumerate() {
            if matches!(s.style, Style::Await | Style::Wait | Style::WaitTimeout) {
                waits_after[rng.between(k, n - 1)].push(k);
            }
        }
        let mut programs = vec![Vec::new(); contexts];
        for (k, waits) in waits_after.iter_mut().enumerate() {
            programs[steps[k].issuer].push(Action::Issue(k));
            rng.shuffle(waits);
            for &j in waits.iter() {
                programs[steps[j].waiter].push(Action::Wait(j));
            }
        }
        Case {
            index,
            size,
            on_tasks,
            steps,
            programs,
        }
    }

    fn tag(&self, k: usize) -> u64 {
        (self.index * 16 + k + 1) as u64
    }

    /// The tag of the blocking all_reduce that closes the case.
    fn fence_tag(&self) -> u64 {
        (self.index * 16 + 15) as u64
    }

    /// What every rank's log must be: the ops in issue order, then the fence.
    fn issued(&self) -> Vec<Entry> {
        let mut v: Vec<Entry> = self
            .steps
            .iter()
            .enumerate()
            .map(|(k, s)| Entry {
                kind: s.kind,
                tag: if s.kind == Kind::Barrier {
                    0
                } else {
                    self.tag(k)
                },
            })
            .collect();
        v.push(Entry {
            kind: Kind::AllReduce,
            tag: self.fence_tag(),
        });
        v
    }

    fn describe(&self) -> String {
        let ops: Vec<String> = self
            .steps
            .iter()
            .enumerate()
            .map(|(k, s)| {
                let e = Entry {
                    kind: s.kind,
                    tag: self.tag(k),
                };
                let root = if s.kind == Kind::Broadcast {
                    format!("(root {})", s.root)
                } else {
                    String::new()
                };
                format!("{e:?}{root} {:?} by {}", s.style, s.issuer)
            })
            .collect();
        format!(
            "{} {}{}: [{}]; programs {:?}",
            self.programs.len(),
            if self.on_tasks { "task" } else { "thread" },
            if self.programs.len() == 1 { "" } else { "s" },
            ops.join(", "),
            self.programs
        )
    }
}

/// What the threads/tasks of one case on one rank share.
struct Board {
    /// How many ops were issued: op `k` is issued when this is `k`.
    issued: tokio::sync::watch::Sender<usize>,
    works: Mutex<Vec<Option<Pending>>>,
    problems: Mutex<Vec<String>>,
}

impl Board {
    fn check(&self, case: &Case, k: usize, got: &Result<Option<Tensor>>) {
        let s = &case.steps[k];
        if let Some(p) = check_value(s.kind, s.root, case.tag(k), case.size, got) {
            self.problems.lock().unwrap().push(p);
        }
    }
}

/// One thread's/task's program of `case` on `comm`.
async fn play(comm: Comm, case: Arc<Case>, board: Arc<Board>, who: usize) {
    let mut issued = board.issued.subscribe();
    for &action in &case.programs[who] {
        match action {
            Action::Issue(k) => {
                if issued.wait_for(|&n| n == k).await.is_err() {
                    return;
                }
                let (s, tag) = (&case.steps[k], case.tag(k));
                match s.style {
                    Style::Blocking => {
                        let got = run_blocking(&comm, s.kind, s.root, tag);
                        // The next op is issued only after this one returned.
                        board.issued.send_replace(k + 1);
                        board.check(&case, k, &got);
                        continue;
                    }
                    Style::Dropped => drop(Pending::issue(&comm, s.kind, s.root, tag)),
                    Style::Await | Style::Wait | Style::WaitTimeout => {
                        board.works.lock().unwrap()[k] =
                            Some(Pending::issue(&comm, s.kind, s.root, tag));
                    }
                }
                board.issued.send_replace(k + 1);
            }
            Action::Wait(k) => {
                if issued.wait_for(|&n| n > k).await.is_err() {
                    return;
                }
                let Some(work) = board.works.lock().unwrap()[k].take() else {
                    board
                        .problems
                        .lock()
                        .unwrap()
                        .push(format!("op {k}: no work"));
                    continue;
                };
                let got = match case.steps[k].style {
                    style @ (Style::Wait | Style::WaitTimeout) => {
                        let blocking_wait = move || match style {
                            Style::Wait => Ok(work.wait_unbounded()),
                            _ => work.wait(),
                        };
                        if case.on_tasks {
                            // Never block a worker of the caller's runtime.
                            match tokio::task::spawn_blocking(blocking_wait).await {
                                Ok(got) => got,
                                Err(e) => Err(format!("spawn_blocking: {e}")),
                            }
                        } else {
                            blocking_wait()
                        }
                    }
                    _ => Ok(work.finish().await),
                };
                match got {
                    Ok(got) => board.check(&case, k, &got),
                    Err(late) => board
                        .problems
                        .lock()
                        .unwrap()
                        .push(format!("op {k}: {late}")),
                }
            }
        }
    }
}

/// Run `case` on this rank: its threads/tasks, the closing fence, then
/// compare the rank's log with the issue order.
fn run_case(
    comm: &Comm,
    rt: &tokio::runtime::Runtime,
    case: Case,
) -> std::result::Result<(), String> {
    let log = log_of(comm.name(), comm.rank());
    let stale = std::mem::take(&mut *log.lock().unwrap());
    let case = Arc::new(case);
    let board = Arc::new(Board {
        issued: tokio::sync::watch::channel(0).0,
        works: Mutex::new((0..case.steps.len()).map(|_| None).collect()),
        problems: Mutex::new(Vec::new()),
    });
    if !stale.is_empty() {
        board
            .problems
            .lock()
            .unwrap()
            .push(format!("ops ran after the previous case ended: {stale:?}"));
    }
    let contexts = case.programs.len();
    if case.on_tasks {
        let all = rt.block_on(async {
            let tasks: Vec<_> = (0..contexts)
                .map(|who| tokio::spawn(play(comm.clone(), case.clone(), board.clone(), who)))
                .collect();
            tokio::time::timeout(CASE_LIMIT, futures::future::join_all(tasks)).await
        });
        match all {
            Ok(joined) => {
                for j in joined {
                    if let Err(e) = j {
                        board.problems.lock().unwrap().push(format!("task: {e}"));
                    }
                }
            }
            Err(_) => board
                .problems
                .lock()
                .unwrap()
                .push(format!("the tasks did not finish within {CASE_LIMIT:?}")),
        }
    } else {
        // Detached threads, so that one stuck in `Work::wait()` is left
        // behind (and reported) rather than holding the case up forever.
        let (done, finished) = mpsc::channel();
        for who in 0..contexts {
            let (comm, case, board, done) =
                (comm.clone(), case.clone(), board.clone(), done.clone());
            std::thread::spawn(move || {
                let _ = done.send(block_on_timeout(play(comm, case, board, who), CASE_LIMIT));
            });
        }
        let until = Instant::now() + CASE_LIMIT + Duration::from_secs(1);
        for _ in 0..contexts {
            let left = until.saturating_duration_since(Instant::now());
            if !matches!(finished.recv_timeout(left), Ok(Some(()))) {
                board
                    .problems
                    .lock()
                    .unwrap()
                    .push(format!("a thread did not finish within {CASE_LIMIT:?}"));
                break;
            }
        }
    }
    // The fence: once it returned, every op issued before it has run.
    let fence = run_blocking(comm, Kind::AllReduce, 0, case.fence_tag());
    if let Some(p) = check_value(Kind::AllReduce, 0, case.fence_tag(), case.size, &fence) {
        board.problems.lock().unwrap().push(format!("fence: {p}"));
    }
    let ran = std::mem::take(&mut *log.lock().unwrap());
    let mut problems = std::mem::take(&mut *board.problems.lock().unwrap());
    if let Some(p) = check_log(&ran, &case.issued()) {
        problems.insert(0, p);
    }
    summarize(problems)
}

/// `Ok` for no problems, else the first few, each cut short (an aborted
/// communicator fails every later op with the same long cause).
fn summarize(problems: Vec<String>) -> std::result::Result<(), String> {
    const FIRST: usize = 3;
    const CHARS: usize = 320;
    if problems.is_empty() {
        return Ok(());
    }
    let mut shown: Vec<String> = problems
        .iter()
        .take(FIRST)
        .map(|p| match p.char_indices().nth(CHARS) {
            Some((at, _)) => format!("{}...", &p[..at]),
            None => p.clone(),
        })
        .collect();
    if problems.len() > FIRST {
        shown.push(format!("(+{} more)", problems.len() - FIRST));
    }
    Err(shown.join("; "))
}

/// The seed of the generated cases: `CHORUS_ORDERING_SEED`, else fixed.
fn seed() -> u64 {
    std::env::var("CHORUS_ORDERING_SEED")
        .ok()
        .and_then(|s| {
            let s = s.trim();
            match s.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16).ok(),
                None => s.parse().ok(),
            }
        })
        .unwrap_or(0x2500_0D3E)
}

/// ORD-1.
#[test]
fn ops_run_in_issue_order_on_every_rank_across_2000_generated_cases() {
    register();
    let seed = seed();
    let started = Instant::now();
    let mut reports = Vec::new();
    for (size, cases) in [(2, 1000), (4, 1000)] {
        let rt = test_runtime();
        let report = run_world(
            "lognet",
            size,
            &format!("ordering-generated-w{size}"),
            Delays::Random { seed },
            cases,
            Duration::from_secs(45),
            move |comm, i| run_case(comm, &rt, Case::generate(seed, size, i)),
        );
        let on_tasks = report
            .violations
            .keys()
            .filter(|&&i| Case::generate(seed, size, i).on_tasks)
            .count();
        eprintln!(
            "ORD-1 world {size}: {} cases, {} violating ({} issued from threads, {on_tasks} \
             from tasks), {:?} so far{}",
            report.run,
            report.violations.len(),
            report.violations.len() - on_tasks,
            started.elapsed(),
            report
                .stopped
                .as_deref()
                .map(|s| format!(", {s}"))
                .unwrap_or_default()
        );
        let stopped = report.stopped.is_some();
        reports.push(report);
        if stopped {
            // Hung or out of time: the next world would only add to the wait.
            break;
        }
    }
    let clean = reports
        .iter()
        .all(|r| r.violations.is_empty() && r.stopped.is_none());
    assert!(
        clean,
        "ops ran out of issue order (seed {seed:#x}; replay with CHORUS_ORDERING_SEED={seed:#x}):\n{}",
        reports
            .iter()
            .map(|r| r.show(|i| Case::generate(seed, r.size, i).describe()))
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// ORD-2: the reported sequence, with a barrier that takes 20 ms.
#[test]
fn a_later_op_never_overtakes_a_slow_barrier_across_40_runs() {
    register();
    const RUNS: usize = 40;
    let rt = test_runtime();
    let report = run_world(
        "lognet",
        2,
        "ordering-slow-barrier",
        Delays::SlowBarrier(Duration::from_millis(20)),
        RUNS,
        Duration::from_secs(60),
        move |comm, run| {
            let (rank, size) = (comm.rank(), comm.size());
            let log = log_of(comm.name(), rank);
            log.lock().unwrap().clear();
            let (b_tag, c_tag) = ((2 * run + 1) as u64, (2 * run + 2) as u64);
            let comm = comm.clone();
            let task = rt.spawn(async move {
                let a = comm.barrier_async();
                let b = comm.all_reduce_async(input(b_tag, rank), ReduceOp::Sum);
                let a = a.await.map(|()| None);
                let c = comm.all_gather_async(input(c_tag, rank));
                let b = b.await.map(Some);
                let c = c.await.map(Some);
                (a, b, c)
            });
            let (a, b, c) =
                match rt.block_on(async { tokio::time::timeout(CASE_LIMIT, task).await }) {
                    Ok(Ok(abc)) => abc,
                    Ok(Err(e)) => return Err(format!("the task failed: {e}")),
                    Err(_) => return Err(format!("the ops did not finish within {CASE_LIMIT:?}")),
                };
            let ran = std::mem::take(&mut *log.lock().unwrap());
            let issued = [
                Entry {
                    kind: Kind::Barrier,
                    tag: 0,
                },
                Entry {
                    kind: Kind::AllReduce,
                    tag: b_tag,
                },
                Entry {
                    kind: Kind::AllGather,
                    tag: c_tag,
                },
            ];
            summarize(
                [
                    check_log(&ran, &issued),
                    check_value(Kind::Barrier, 0, 0, size, &a),
                    check_value(Kind::AllReduce, 0, b_tag, size, &b),
                    check_value(Kind::AllGather, 0, c_tag, size, &c),
                ]
                .into_iter()
                .flatten()
                .collect(),
            )
        },
    );
    eprintln!(
        "ORD-2: {} of {} runs out of order",
        report.violations.len(),
        report.run
    );
    assert!(
        report.violations.is_empty() && report.stopped.is_none(),
        "a later op overtook an earlier one:\n{}",
        report.show(|run| format!(
            "a = barrier_async() (20 ms); b = all_reduce_async(#{}); a.await; \
             c = all_gather_async(#{}); b.await; c.await",
            2 * run + 1,
            2 * run + 2
        ))
    );
}

/// ORD-3: the reported `cpu`-backend reproduction, through the public API.
#[test]
fn a_blocking_op_never_overtakes_an_awaited_one_on_the_cpu_backend() {
    const ROUNDS: usize = 60;
    const BIG: usize = 4 << 20;
    let limit = Duration::from_secs(10);
    let started = Instant::now();
    let seen = common::run_ranks_on(
        "cpu",
        2,
        "ordering-cpu-blocking-in-async",
        move |_, o| o.with_timeout(limit),
        move |comm| {
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .expect("rank runtime");
            // One async context for all rounds; the blocking op `c` is
            // issued from inside it (block_in_place on this runtime).
            rt.block_on(async {
                let mut wrong = Vec::new();
                for round in 0..ROUNDS {
                    let a = comm.all_reduce_async(Tensor::full(1.0f32, BIG), ReduceOp::Sum);
                    let b = comm.all_reduce_async(Tensor::full(1000.0f32, 4), ReduceOp::Sum);
                    let a = tokio::time::timeout(limit, a).await;
                    let c = comm.all_reduce(Tensor::full(1.0f32, 4), ReduceOp::Sum);
                    let b = tokio::time::timeout(limit, b).await;
                    let (a, b) = match (a, b) {
                        (Ok(a), Ok(b)) => (a, b),
                        _ => {
                            wrong.push(format!(
                                "round {round}: an op did not finish within {limit:?}; rounds \
                                 {round}.. not run"
                            ));
                            break;
                        }
                    };
                    let mut problems = Vec::new();
                    match &a {
                        Ok(t) if t.as_slice::<f32>().iter().all(|&v| v == 2.0) => {}
                        Ok(_) => problems.push("a != 2".to_string()),
                        Err(e) => problems.push(format!("a failed: {e}")),
                    }
                    for (name, got, want) in [("b", &b, 2000.0f32), ("c", &c, 2.0)] {
                        match got {
                            Ok(t) if t.to_vec::<f32>() == vec![want; 4] => {}
                            Ok(t) => problems
                                .push(format!("{name} = {:?}, want {want}", t.to_vec::<f32>())),
                            Err(e) => problems.push(format!("{name} failed: {e}")),
                        }
                    }
                    if !problems.is_empty() {
                        wrong.push(format!("round {round}: {}", problems.join(", ")));
                    }
                    if a.is_err() || b.is_err() || c.is_err() {
                        wrong.push(format!(
                            "round {round}: an op failed; rounds {round}.. not run"
                        ));
                        break;
                    }
                }
                let _ = comm.finalize_async().await;
                wrong
            })
        },
    );
    let bad_rounds: std::collections::BTreeSet<String> = seen
        .iter()
        .flatten()
        .filter_map(|w| w.split(':').next().map(str::to_string))
        .collect();
    eprintln!(
        "ORD-3: {} of {ROUNDS} rounds wrong on some rank, in {:?}",
        bad_rounds.len(),
        started.elapsed()
    );
    assert!(
        seen.iter().all(Vec::is_empty),
        "a blocking op overtook an awaited one (a = all_reduce_async(1.0 x {BIG}), \
         b = all_reduce_async(1000.0 x 4), a.await, c = all_reduce(1.0 x 4), b.await; \
         want b = 2000, c = 2):\n{}",
        seen.iter()
            .enumerate()
            .map(|(r, w)| format!(
                "  rank {r}: {} wrong: {}",
                w.len(),
                w.iter().take(SHOWN).cloned().collect::<Vec<_>>().join("; ")
            ))
            .collect::<Vec<_>>()
            .join("\n")
    );
}
