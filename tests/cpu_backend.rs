//! The cpu backend over real loopback TCP links, with in-process ranks on one
//! tokio runtime sharing a `MemoryStore`.

use std::sync::Arc;
use std::time::{Duration, Instant};

use chorus::backends::cpu::schedule::{
    barrier_rounds, BufId, RecvAction, Schedule, Step, Transfer,
};
use chorus::backends::cpu::CpuBackend;
use chorus::backends::{Backend, BackendInit, LinkPolicy, OpCtx, OpData, P2PTransfer};
use chorus::transport::{MemoryStore, Store};
use chorus::{DType, Error, OpKind, ReduceOp, Tensor};
use futures::future::join_all;

const TEST_BOUND: Duration = Duration::from_secs(30);

async fn bounded<T>(f: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(TEST_BOUND, f)
        .await
        .expect("test exceeded its 30 s bound")
}

fn init(
    store: &Arc<MemoryStore>,
    prefix: &str,
    rank: usize,
    size: usize,
    secret: &[u8],
    timeout: Duration,
) -> BackendInit {
    BackendInit {
        comm: "test".into(),
        key_prefix: prefix.into(),
        rank,
        size,
        epoch: 3,
        store: store.clone(),
        secret: Arc::from(secret),
        connect_timeout: timeout,
        bind_ip: "127.0.0.1".parse().unwrap(),
        links: chorus::backends::LinkPolicy::Auto,
        host_id: None,
        peers_failed: chorus::backends::PeerFailures::none(),
    }
}

async fn world(size: usize) -> Vec<CpuBackend> {
    world_with(size, LinkPolicy::Auto).await
}

/// A world whose links open by `links` (`Auto`: as `CHORUS_LINKS` says).
async fn world_with(size: usize, links: LinkPolicy) -> Vec<CpuBackend> {
    let store = Arc::new(MemoryStore::new());
    let prefix = format!("comm/test#{size}/epoch/3");
    let all = join_all((0..size).map(|r| {
        CpuBackend::connect(BackendInit {
            links,
            ..init(&store, &prefix, r, size, b"secret", Duration::from_secs(10))
        })
    }))
    .await;
    all.into_iter().map(|b| b.expect("connect")).collect()
}

/// One op as a turn runs it: an (empty) header to every other rank, with
/// the op's data when it is fused, then `execute`.
async fn turn(b: &mut CpuBackend, c: &OpCtx, data: &mut OpData) {
    let out = (0..c.size)
        .filter(|&p| p != c.rank)
        .map(|p| (p, c.seq, vec![]))
        .collect();
    b.exchange_headers_with_data(c, out, data)
        .await
        .expect("headers");
    b.execute(c, data).await.expect("execute");
}

fn ctx(rank: usize, size: usize, kind: OpKind, seq: u64) -> OpCtx {
    OpCtx {
        comm: "test".into(),
        rank,
        size,
        epoch: 3,
        kind,
        seq,
        fingerprint: 0,
        headers: true,
        // These tests drive several ranks from one task: a wait must yield.
        may_block: false,
        order: Default::default(),
    }
}

/// Exchange a header with every other rank; panics on failure.
async fn exchange_all(backends: &mut [CpuBackend], seq: u64) {
    let size = backends.len();
    let res = join_all(backends.iter_mut().enumerate().map(|(r, b)| async move {
        let out = (0..size)
            .filter(|&p| p != r)
            .map(|p| (p, seq, format!("{r}->{p}").into_bytes()))
            .collect();
        b.exchange_headers(&ctx(r, size, OpKind::Barrier, seq), out)
            .await
    }))
    .await;
    for (r, got) in res.into_iter().enumerate() {
        let got = got.expect("exchange");
        let want: Vec<(usize, Vec<u8>)> = (0..size)
            .filter(|&p| p != r)
            .map(|p| (p, format!("{p}->{r}").into_bytes()))
            .collect();
        assert_eq!(got, want, "rank {r}");
    }
}

#[tokio::test]
async fn mesh_connects_every_pair_for_world_sizes_1_to_4() {
    bounded(async {
        for size in 1..=4 {
            let mut w = world(size).await;
            exchange_all(&mut w, 0).await;
            exchange_all(&mut w, 1).await;
            for b in &mut w {
                b.finalize().await;
            }
        }
    })
    .await;
}

#[tokio::test]
async fn header_exchange_round_trips_including_empty_and_large_headers() {
    bounded(async {
        let mut w = world(3).await;
        let res = join_all(w.iter_mut().enumerate().map(|(r, b)| async move {
            let out = vec![
                ((r + 1) % 3, 7, vec![r as u8; 100_000]),
                ((r + 2) % 3, 7, Vec::new()),
            ];
            b.exchange_headers(&ctx(r, 3, OpKind::AllReduce, 7), out)
                .await
        }))
        .await;
        for (r, got) in res.into_iter().enumerate() {
            let got = got.unwrap();
            assert_eq!(got[0].0, (r + 1) % 3);
            assert_eq!(got[0].1, Vec::<u8>::new());
            assert_eq!(got[1].0, (r + 2) % 3);
            assert_eq!(got[1].1, vec![((r + 2) % 3) as u8; 100_000]);
        }
    })
    .await;
}

#[tokio::test]
async fn header_with_other_seq_is_a_mismatch() {
    bounded(async {
        let mut w = world(2).await;
        let res = join_all(w.iter_mut().enumerate().map(|(r, b)| async move {
            let seq = r as u64; // rank 0 at seq 0, rank 1 at seq 1
            b.exchange_headers(
                &ctx(r, 2, OpKind::AllReduce, seq),
                vec![(1 - r, seq, vec![1])],
            )
            .await
        }))
        .await;
        for r in res {
            assert!(matches!(r, Err(Error::Mismatch { .. })), "{r:?}");
        }
    })
    .await;
}

fn ring_shift(rank: usize, size: usize, n: usize) -> Schedule {
    Schedule {
        steps: vec![Step {
            transfers: vec![
                Transfer::Send {
                    peer: (rank + 1) % size,
                    buf: BufId::Dst,
                    range: 0..n,
                },
                Transfer::Recv {
                    peer: (rank + size - 1) % size,
                    buf: BufId::Dst,
                    range: 0..n,
                    action: RecvAction::Copy,
                },
            ],
        }],
    }
}

#[tokio::test]
async fn ring_shift_schedule_moves_each_block_to_the_next_rank() {
    bounded(async {
        let size = 3;
        let mut w = world(size).await;
        // 1 Mi elements: both directions of every link are busy at once.
        for n in [1000usize, 1 << 20] {
            let res = join_all(w.iter_mut().enumerate().map(|(r, b)| async move {
                let mut t = Tensor::from_vec((0..n).map(|i| (r * n + i) as i32).collect());
                b.run_schedule(
                    &ctx(r, size, OpKind::AllToAll, 1),
                    &ring_shift(r, size, n),
                    None,
                    &mut t,
                    ReduceOp::Sum,
                )
                .await
                .map(|()| t)
            }))
            .await;
            for (r, t) in res.into_iter().enumerate() {
                let from = (r + size - 1) % size;
                let want: Vec<i32> = (0..n).map(|i| (from * n + i) as i32).collect();
                assert_eq!(t.unwrap().to_vec::<i32>(), want, "rank {r}, n {n}");
            }
        }
    })
    .await;
}

/// SX-4: large payloads of steps that send and receive are read from the
/// sender's memory (one copy) when same-host ranks may read each other,
/// whether the receiver reduces or only copies them. Results are the same
/// either way.
#[tokio::test]
async fn large_transfers_between_same_host_ranks_take_the_single_copy_path() {
    bounded(async {
        let size = 2;
        let mut w = world(size).await;
        let before = chorus::debug::single_copy_reads();
        // 8 MiB of i32: all_reduce's blocks (4 MiB, reduced, then copied)
        // and all_gather's 8 MiB blocks are all above both thresholds.
        let n = 1 << 21;
        let res = join_all(w.iter_mut().enumerate().map(|(r, b)| async move {
            let mut reduce = OpData::AllReduce {
                buf: Tensor::from_vec((0..n).map(|i| (i + r) as i32).collect()),
                op: ReduceOp::Sum,
            };
            b.execute(&ctx(r, size, OpKind::AllReduce, 1), &mut reduce)
                .await
                .expect("all_reduce");
            let mut gather = OpData::AllGather {
                input: Tensor::from_vec(vec![r as i32 + 1; n]),
                output: Tensor::zeros(DType::I32, n * size),
                counts: vec![n; size],
                in_place: false,
            };
            b.execute(&ctx(r, size, OpKind::AllGather, 2), &mut gather)
                .await
                .expect("all_gather");
            (reduce, gather)
        }))
        .await;
        for (r, (reduce, gather)) in res.into_iter().enumerate() {
            let OpData::AllReduce { buf, .. } = reduce else {
                unreachable!()
            };
            let want: Vec<i32> = (0..n).map(|i| (2 * i + 1) as i32).collect();
            assert!(buf.to_vec::<i32>() == want, "rank {r}: all_reduce result");
            let OpData::AllGather { output, .. } = gather else {
                unreachable!()
            };
            let got = output.to_vec::<i32>();
            assert!(got[..n].iter().all(|&v| v == 1), "rank {r}: block 0");
            assert!(got[n..].iter().all(|&v| v == 2), "rank {r}: block 1");
        }
        let reads = chorus::debug::single_copy_reads() - before;
        if std::env::var("CHORUS_SHM_CMA").as_deref() == Ok("0") {
            assert_eq!(reads, 0);
        } else if std::env::var_os("CHORUS_SHM_CMA_COPY_MIN").is_some() {
            // Only the reduced blocks are certain to be read in place.
            assert!(reads >= 2, "only {reads} single-copy reads");
        } else {
            // Ranks in one process can always read each other: on each
            // rank one read of the peer's block in each of all_reduce's two
            // phases, and one for the all_gather. (Other tests of this
            // binary may run at the same time, so at least.)
            assert!(reads >= 6, "only {reads} single-copy reads");
        }
    })
    .await;
}

#[tokio::test]
async fn p2p_batch_with_several_transfers_per_peer_in_both_directions() {
    bounded(async {
        let size = 3;
        let lens = [10usize, 0, 200_000];
        let mut w = world(size).await;
        let val = |from: usize, to: usize, k: usize, i: usize| {
            (from * 1000 + to * 100 + k * 10) as f32 + i as f32
        };
        let res = join_all(w.iter_mut().enumerate().map(|(r, b)| async move {
            let mut ops = Vec::new();
            for p in (0..size).filter(|&p| p != r) {
                for (k, &n) in lens.iter().enumerate() {
                    ops.push(P2PTransfer {
                        peer: p,
                        seq: 5,
                        send: true,
                        buf: Tensor::from_vec((0..n).map(|i| val(r, p, k, i)).collect()),
                    });
                    ops.push(P2PTransfer {
                        peer: p,
                        seq: 5,
                        send: false,
                        buf: Tensor::zeros(DType::F32, n),
                    });
                }
            }
            let mut data = OpData::P2P { ops };
            b.execute(&ctx(r, size, OpKind::P2P, 0), &mut data)
                .await
                .map(|()| data)
        }))
        .await;
        for (r, data) in res.into_iter().enumerate() {
            let OpData::P2P { ops } = data.unwrap() else {
                unreachable!()
            };
            let mut k_of = [0usize; 3];
            for t in ops.iter().filter(|t| !t.send) {
                let k = k_of[t.peer];
                k_of[t.peer] += 1;
                let want: Vec<f32> = (0..lens[k]).map(|i| val(t.peer, r, k, i)).collect();
                assert_eq!(t.buf.to_vec::<f32>(), want, "rank {r} from {} #{k}", t.peer);
            }
        }
    })
    .await;
}

#[tokio::test]
async fn p2p_receive_of_a_different_length_is_a_mismatch_on_the_receiver() {
    bounded(async {
        let mut w = world(2).await;
        let res = join_all(w.iter_mut().enumerate().map(|(r, b)| async move {
            let t = if r == 0 {
                P2PTransfer {
                    peer: 1,
                    seq: 0,
                    send: true,
                    buf: Tensor::zeros(DType::I32, 5),
                }
            } else {
                P2PTransfer {
                    peer: 0,
                    seq: 0,
                    send: false,
                    buf: Tensor::zeros(DType::I32, 6),
                }
            };
            b.execute(
                &ctx(r, 2, OpKind::P2P, 0),
                &mut OpData::P2P { ops: vec![t] },
            )
            .await
        }))
        .await;
        assert!(res[0].is_ok(), "{:?}", res[0]);
        match &res[1] {
            Err(Error::Mismatch { detail, .. }) => assert!(detail.contains("20 bytes"), "{detail}"),
            other => panic!("expected a mismatch, got {other:?}"),
        }
    })
    .await;
}

/// `steps` ring shifts, so that every rank depends on every other (like a ring all-gather).
fn ring_shifts(rank: usize, size: usize, n: usize, steps: usize) -> Schedule {
    Schedule {
        steps: (0..steps)
            .flat_map(|_| ring_shift(rank, size, n).steps)
            .collect(),
    }
}

/// Ranks 0..size-1 run `size - 1` ring shifts while the last rank `leave`s mid-op; every
/// survivor must fail with PeerFailed naming the last rank, like an executor
/// would (abort after the error, BE-2).
async fn survivors_fail_naming_the_departed_rank(abort_instead_of_drop: bool) {
    let size = 4;
    let last = size - 1;
    let w = world(size).await;
    let start = Instant::now();
    let mut handles = Vec::new();
    for (r, mut b) in w.into_iter().enumerate() {
        handles.push(tokio::spawn(async move {
            if r == last {
                tokio::time::sleep(Duration::from_millis(200)).await;
                if abort_instead_of_drop {
                    b.abort("test abort", &[]).await;
                } else {
                    drop(b);
                }
                return None;
            }
            let mut t = Tensor::zeros(DType::F32, 1 << 16);
            let r = b
                .run_schedule(
                    &ctx(r, size, OpKind::AllToAll, 0),
                    &ring_shifts(r, size, 1 << 16, size - 1),
                    None,
                    &mut t,
                    ReduceOp::Sum,
                )
                .await;
            if let Err(e) = &r {
                b.abort(&e.to_string(), e.failed_ranks()).await;
            }
            Some(r)
        }));
    }
    for (r, h) in handles.into_iter().enumerate() {
        let Some(res) = h.await.unwrap() else {
            continue;
        };
        match res {
            Err(Error::PeerFailed { failed_ranks, .. }) => {
                assert_eq!(failed_ranks, vec![last], "rank {r}")
            }
            other => panic!("rank {r}: expected PeerFailed, got {other:?}"),
        }
    }
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "{:?}",
        start.elapsed()
    );
}

#[tokio::test]
async fn dropped_rank_mid_op_fails_every_survivor_with_peer_failed_naming_it() {
    bounded(survivors_fail_naming_the_departed_rank(false)).await;
}

#[tokio::test]
async fn aborted_rank_mid_op_fails_every_survivor_with_peer_failed_naming_it() {
    bounded(survivors_fail_naming_the_departed_rank(true)).await;
}

#[tokio::test]
async fn calls_after_abort_return_aborted_and_the_peer_sees_peer_failed() {
    bounded(async {
        // Abort frames travel over open links: open them all.
        let mut w = world_with(2, LinkPolicy::Eager).await;
        w[0].abort("user asked", &[]).await;
        w[0].abort("again", &[]).await; // idempotent
        let r0 = w[0]
            .exchange_headers(&ctx(0, 2, OpKind::Barrier, 0), vec![(1, 0, vec![])])
            .await;
        match r0 {
            Err(Error::Aborted { reason, .. }) => assert_eq!(reason, "user asked"),
            other => panic!("{other:?}"),
        }
        let r1 = w[1]
            .exchange_headers(&ctx(1, 2, OpKind::Barrier, 0), vec![(0, 0, vec![])])
            .await;
        match r1 {
            Err(Error::PeerFailed {
                failed_ranks,
                detail,
                ..
            }) => {
                assert_eq!(failed_ranks, vec![0]);
                assert!(detail.contains("user asked"), "{detail}");
            }
            other => panic!("{other:?}"),
        }
        // The failed rank's next call is refused without touching the links.
        let again = w[1]
            .execute(&ctx(1, 2, OpKind::Barrier, 1), &mut OpData::Barrier)
            .await;
        assert!(matches!(again, Err(Error::Aborted { .. })), "{again:?}");
    })
    .await;
}

#[tokio::test]
async fn abort_frame_carries_the_failed_ranks_and_reason_to_peers() {
    bounded(async {
        // Abort frames travel over open links: open them all.
        let mut w = world_with(3, LinkPolicy::Eager).await;
        w[0].abort("watchdog lost rank 2", &[2]).await;
        let res = join_all(w[1..].iter_mut().enumerate().map(|(i, b)| async move {
            let r = i + 1;
            b.exchange_headers(&ctx(r, 3, OpKind::Barrier, 0), vec![(0, 0, vec![])])
                .await
        }))
        .await;
        for r in res {
            match r {
                Err(Error::PeerFailed {
                    failed_ranks,
                    detail,
                    ..
                }) => {
                    assert_eq!(failed_ranks, vec![2]);
                    assert!(detail.contains("watchdog lost rank 2"), "{detail}");
                }
                other => panic!("{other:?}"),
            }
        }
    })
    .await;
}

#[tokio::test]
async fn calls_after_finalize_return_finalized() {
    bounded(async {
        let mut w = world(2).await;
        for b in &mut w {
            b.finalize().await;
            b.finalize().await;
        }
        let r = w[0]
            .exchange_headers(&ctx(0, 2, OpKind::Barrier, 0), vec![(1, 0, vec![])])
            .await;
        assert!(matches!(r, Err(Error::Finalized { .. })), "{r:?}");
    })
    .await;
}

#[tokio::test]
async fn op_cancelled_mid_transfer_leaves_the_links_refusing_further_ops() {
    bounded(async {
        let mut w = world(2).await;
        let recv = P2PTransfer {
            peer: 1,
            seq: 0,
            send: false,
            buf: Tensor::zeros(DType::U8, 8),
        };
        let mut data = OpData::P2P { ops: vec![recv] };
        // Rank 1 never sends: the op is abandoned by its caller.
        let c = ctx(0, 2, OpKind::P2P, 0);
        let fut = w[0].execute(&c, &mut data);
        assert!(tokio::time::timeout(Duration::from_millis(50), fut)
            .await
            .is_err());
        let r = w[0]
            .exchange_headers(&ctx(0, 2, OpKind::Barrier, 0), vec![(1, 0, vec![])])
            .await;
        match r {
            Err(Error::Aborted { reason, .. }) => assert!(reason.contains("cancelled"), "{reason}"),
            other => panic!("{other:?}"),
        }
    })
    .await;
}

#[tokio::test]
async fn stranger_with_a_bad_hello_does_not_break_setup() {
    use tokio::io::AsyncWriteExt;
    bounded(async {
        let store = Arc::new(MemoryStore::new());
        let prefix = "comm/stranger#0/epoch/3";
        let t = Duration::from_secs(10);
        let eager = |rank, secret: &[u8]| BackendInit {
            links: LinkPolicy::Eager,
            ..init(&store, prefix, rank, 2, secret, t)
        };
        let r0 = tokio::spawn(CpuBackend::connect(eager(0, b"s")));
        // Rank 0's bootstrap record: its listener address, then its host id.
        let record = store
            .wait(&[format!("{prefix}/cpu/rank/0")], t)
            .await
            .unwrap()
            .remove(0);
        let record = String::from_utf8(record).unwrap();
        let addr = record.lines().next().unwrap().to_string();
        // One stranger sends garbage, another connects and stays silent.
        let mut garbage = tokio::net::TcpStream::connect(&addr).await.unwrap();
        garbage.write_all(&[0xAB; 72]).await.unwrap();
        let _silent = tokio::net::TcpStream::connect(&addr).await.unwrap();
        // A third claims to be rank 1 with the wrong secret.
        let bad = tokio::spawn(CpuBackend::connect(eager(1, b"x")));
        assert!(matches!(bad.await.unwrap(), Err(Error::Transport(_))));
        let r1 = CpuBackend::connect(eager(1, b"s")).await;
        let mut w = vec![r0.await.unwrap().unwrap(), r1.unwrap()];
        exchange_all(&mut w, 0).await;
    })
    .await;
}

#[tokio::test]
async fn wrong_secret_on_one_rank_fails_setup_with_an_error_not_a_hang() {
    bounded(async {
        let store = Arc::new(MemoryStore::new());
        let prefix = "comm/secret#0/epoch/3";
        let t = Duration::from_secs(2);
        let start = Instant::now();
        let res = join_all((0..3).map(|r| {
            let secret: &[u8] = if r == 2 { b"wrong" } else { b"right" };
            CpuBackend::connect(BackendInit {
                links: LinkPolicy::Eager,
                ..init(&store, prefix, r, 3, secret, t)
            })
        }))
        .await;
        assert!(start.elapsed() < Duration::from_secs(6));
        for (r, res) in res.into_iter().enumerate() {
            match res {
                Err(Error::PeerFailed { failed_ranks, .. }) if r < 2 => {
                    assert_eq!(failed_ranks, vec![2])
                }
                // A good rank that dials rank 2 before it gave up hears
                // that rank 2 rejected its proof: it names rank 2 too.
                Err(Error::Transport(chorus::transport::TransportError::AuthFailed {
                    peer,
                    ..
                })) if r < 2 => assert!(peer.contains("rank 2"), "rank {r}: {peer}"),
                Err(Error::Transport(_)) if r == 2 => {}
                other => panic!("rank {r}: {other:?}"),
            }
        }
    })
    .await;
}

#[tokio::test]
async fn missing_rank_times_out_as_a_peer_failure_naming_it() {
    bounded(async {
        let store = Arc::new(MemoryStore::new());
        // Rank 1 of 3 waits for the records of ranks 0 and 2; rank 2
        // publishes one (and then gives up too), rank 0 never starts.
        let t = Duration::from_millis(300);
        let start = Instant::now();
        let (r1, r2) = tokio::join!(
            CpuBackend::connect(init(&store, "comm/missing#0/epoch/3", 1, 3, b"s", t)),
            CpuBackend::connect(init(&store, "comm/missing#0/epoch/3", 2, 3, b"s", t)),
        );
        for r in [r1, r2] {
            match r {
                Err(Error::PeerFailed { failed_ranks, .. }) => assert_eq!(failed_ranks, vec![0]),
                other => panic!("{other:?}"),
            }
        }
        assert!(start.elapsed() < Duration::from_secs(3));
    })
    .await;
}

/// A rank that dies after publishing its address, while the others open
/// their links to it at creation (eager): its listener is gone, so every
/// other rank names it at once, not after `connect_timeout`. The test plays
/// the dead rank: a record whose listener is closed.
#[tokio::test]
async fn a_rank_dead_after_publishing_is_named_at_once_not_after_the_timeout() {
    bounded(async {
        let store = Arc::new(MemoryStore::new());
        let prefix = "comm/dead-after-record#0/epoch/3";
        let t = Duration::from_secs(20);
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = closed.local_addr().unwrap();
        drop(closed);
        store
            .set(
                &format!("{prefix}/cpu/rank/2"),
                format!("{addr}\n").into_bytes(),
            )
            .await
            .unwrap();
        let start = Instant::now();
        let res = join_all((0..2).map(|r| {
            CpuBackend::connect(BackendInit {
                links: LinkPolicy::Eager,
                ..init(&store, prefix, r, 3, b"s", t)
            })
        }))
        .await;
        assert!(
            start.elapsed() < Duration::from_secs(2),
            "took {:?}",
            start.elapsed()
        );
        for (r, res) in res.into_iter().enumerate() {
            match res {
                Err(Error::PeerFailed { failed_ranks, .. }) => {
                    assert_eq!(failed_ranks, vec![2], "rank {r}")
                }
                other => panic!("rank {r}: {other:?}"),
            }
        }
    })
    .await;
}

/// Links on demand: a lazy world opens no link at creation, and each op
/// opens exactly the links of the peers its algorithm talks to.
#[tokio::test]
async fn lazy_links_open_only_for_the_peers_an_op_talks_to() {
    bounded(async {
        let n = 16;
        let mut w = world_with(n, LinkPolicy::Lazy).await;
        for b in &w {
            assert!(b.linked_peers().is_empty(), "no link at creation");
        }
        let res = join_all(w.iter_mut().enumerate().map(|(r, b)| async move {
            b.execute(&ctx(r, n, OpKind::Barrier, 0), &mut OpData::Barrier)
                .await
        }))
        .await;
        for (r, res) in res.into_iter().enumerate() {
            res.unwrap_or_else(|e| panic!("rank {r}: {e}"));
        }
        for (r, b) in w.iter().enumerate() {
            let mut want: Vec<usize> = barrier_rounds(r, n)
                .into_iter()
                .flat_map(|(to, from)| [to, from])
                .collect();
            want.sort_unstable();
            want.dedup();
            assert_eq!(b.linked_peers(), want, "rank {r}: the barrier's peers");
            assert!(want.len() < n - 1, "a barrier on {n} ranks is not a mesh");
        }
        // An all-to-all exchange needs every pair at once, so every pair's
        // two ranks dial each other at the same time: each pair still ends
        // with one working link.
        exchange_all(&mut w, 1).await;
        for (r, b) in w.iter().enumerate() {
            let all: Vec<usize> = (0..n).filter(|&p| p != r).collect();
            assert_eq!(b.linked_peers(), all, "rank {r}");
        }
        exchange_all(&mut w, 2).await;
    })
    .await;
}

/// A lazy link opens whatever the peer is doing: a small send completes
/// while its receiver has not reached the matching receive (either rank
/// of the pair sending first), as over an eager mesh.
#[tokio::test]
async fn a_lazy_link_opens_while_the_peer_is_not_in_an_op() {
    bounded(async {
        for sender in [0usize, 1] {
            let mut w = world_with(2, LinkPolicy::Lazy).await;
            let receiver = 1 - sender;
            let mut send = OpData::P2P {
                ops: vec![P2PTransfer {
                    peer: receiver,
                    seq: 0,
                    send: true,
                    buf: Tensor::from_vec(vec![7i32, 8, 9]),
                }],
            };
            tokio::time::timeout(
                Duration::from_secs(5),
                w[sender].execute(&ctx(sender, 2, OpKind::P2P, 0), &mut send),
            )
            .await
            .expect("the send completes before its receive is posted")
            .expect("send");
            let mut recv = OpData::P2P {
                ops: vec![P2PTransfer {
                    peer: sender,
                    seq: 0,
                    send: false,
                    buf: Tensor::zeros(DType::I32, 3),
                }],
            };
            w[receiver]
                .execute(&ctx(receiver, 2, OpKind::P2P, 0), &mut recv)
                .await
                .expect("recv");
            let OpData::P2P { ops } = recv else {
                unreachable!()
            };
            assert_eq!(ops[0].buf.to_vec::<i32>(), vec![7, 8, 9]);
        }
    })
    .await;
}

/// Under lazy links a rank with another secret is found at the first op
/// that needs its link: every rank of that op fails with a typed error in
/// bounded time, none hangs.
#[tokio::test]
async fn lazy_links_to_a_rank_with_another_secret_fail_the_first_op() {
    bounded(async {
        let store = Arc::new(MemoryStore::new());
        let prefix = "comm/lazy-secret#0/epoch/3";
        let t = Duration::from_secs(2);
        let mut w = join_all((0..3).map(|r| {
            let secret: &[u8] = if r == 2 { b"wrong" } else { b"right" };
            CpuBackend::connect(BackendInit {
                links: LinkPolicy::Lazy,
                ..init(&store, prefix, r, 3, secret, t)
            })
        }))
        .await
        .into_iter()
        .map(|b| b.expect("creation opens no link"))
        .collect::<Vec<_>>();
        let start = Instant::now();
        let res = join_all(w.iter_mut().enumerate().map(|(r, b)| async move {
            b.execute(&ctx(r, 3, OpKind::Barrier, 0), &mut OpData::Barrier)
                .await
        }))
        .await;
        assert!(start.elapsed() < t * 2, "took {:?}", start.elapsed());
        for (r, res) in res.into_iter().enumerate() {
            match res {
                Err(Error::Transport(e)) => {
                    assert!(
                        e.to_string().contains("proof") || e.to_string().contains("prove"),
                        "rank {r}: {e}"
                    )
                }
                Err(Error::PeerFailed { failed_ranks, .. }) if r < 2 => {
                    assert!(failed_ranks.contains(&2), "rank {r}: {failed_ranks:?}")
                }
                other => panic!("rank {r}: {other:?}"),
            }
        }
    })
    .await;
}

// ---------------------------------------------------------------------------
// Every OpData variant against a locally computed reference.
// ---------------------------------------------------------------------------

#[derive(Clone, Copy, Debug)]
enum Case {
    AllReduce(ReduceOp),
    Reduce,
    ReduceScatter,
    AllGather,
    Broadcast,
    Scatter,
    Gather,
    AllToAll,
    Barrier,
}

/// Element `i` of rank `r`'s input: small integers, exact in f32 and i32.
fn v(r: usize, i: usize) -> f64 {
    ((r + 1) * (i % 13) + r) as f64 - 6.0
}

fn vals(r: usize, from: usize, n: usize) -> Vec<f64> {
    (from..from + n).map(|i| v(r, i)).collect()
}

/// Uneven split of `total` over `size` ranks (the last ranks get less).
fn block_counts(total: usize, size: usize) -> Vec<usize> {
    let mut c: Vec<usize> = (0..size)
        .map(|r| total / size + usize::from(r < total % size))
        .collect();
    // Make the split lopsided where possible, including empty blocks.
    if size > 1 && c[size - 1] > 0 {
        c[0] += c[size - 1];
        c[size - 1] = 0;
    }
    c
}

/// Elements rank `from` sends to rank `to` in the all-to-all case.
fn a2a(c: usize, from: usize, to: usize) -> usize {
    (c + 3 * from + 7 * to) % (c + 1)
}

fn prefix(counts: &[usize]) -> Vec<usize> {
    let mut o = vec![0];
    for c in counts {
        o.push(o.last().unwrap() + c);
    }
    o
}

fn combine(op: ReduceOp, a: f64, b: f64) -> f64 {
    match op {
        ReduceOp::Sum => a + b,
        ReduceOp::Max => a.max(b),
        ReduceOp::Min => a.min(b),
        ReduceOp::Product => a * b,
        other => panic!("no reference for {other}"),
    }
}

fn reduced(op: ReduceOp, size: usize, from: usize, n: usize) -> Vec<f64> {
    (from..from + n)
        .map(|i| (1..size).fold(v(0, i), |acc, r| combine(op, acc, v(r, i))))
        .collect()
}

fn t(dtype: DType, values: &[f64]) -> Tensor {
    Tensor::from_f64s(dtype, values)
}

fn root_of(size: usize) -> usize {
    size - 1
}

fn build(case: Case, r: usize, size: usize, c: usize, dtype: DType) -> (OpKind, OpData) {
    let root = root_of(size);
    match case {
        Case::AllReduce(op) => (
            OpKind::AllReduce,
            OpData::AllReduce {
                buf: t(dtype, &vals(r, 0, c)),
                op,
            },
        ),
        Case::Reduce => (
            OpKind::Reduce,
            OpData::Reduce {
                buf: t(dtype, &vals(r, 0, c)),
                op: ReduceOp::Sum,
                root,
            },
        ),
        Case::ReduceScatter => {
            let counts = block_counts(c, size);
            (
                OpKind::ReduceScatter,
                OpData::ReduceScatter {
                    input: t(dtype, &vals(r, 0, c)),
                    output: Tensor::zeros(dtype, counts[r]),
                    counts,
                    op: ReduceOp::Sum,
                },
            )
        }
        Case::AllGather => {
            let counts = block_counts(c, size);
            (
                OpKind::AllGather,
                OpData::AllGather {
                    input: t(dtype, &vals(r, 0, counts[r])),
                    output: Tensor::zeros(dtype, c),
                    counts,
                    in_place: false,
                },
            )
        }
        Case::Broadcast => (
            OpKind::Broadcast,
            OpData::Broadcast {
                buf: if r == root {
                    t(dtype, &vals(r, 0, c))
                } else {
                    Tensor::zeros(dtype, c)
                },
                root,
            },
        ),
        Case::Scatter => (
            OpKind::Scatter,
            OpData::Scatter {
                input: if r == root {
                    t(dtype, &vals(r, 0, size * c))
                } else {
                    Tensor::zeros(dtype, 0)
                },
                output: Tensor::zeros(dtype, c),
                root,
            },
        ),
        Case::Gather => (
            OpKind::Gather,
            OpData::Gather {
                input: t(dtype, &vals(r, 0, c)),
                output: Tensor::zeros(dtype, if r == root { size * c } else { 0 }),
                root,
            },
        ),
        Case::AllToAll => {
            let send_counts: Vec<usize> = (0..size).map(|to| a2a(c, r, to)).collect();
            let recv_counts: Vec<usize> = (0..size).map(|from| a2a(c, from, r)).collect();
            (
                OpKind::AllToAllSingle,
                OpData::AllToAll {
                    input: t(dtype, &vals(r, 0, send_counts.iter().sum())),
                    output: Tensor::zeros(dtype, recv_counts.iter().sum()),
                    send_counts,
                    recv_counts,
                },
            )
        }
        Case::Barrier => (OpKind::Barrier, OpData::Barrier),
    }
}

/// The tensor to check on rank `r` and its expected values, if any.
fn check(
    case: Case,
    r: usize,
    size: usize,
    c: usize,
    data: &OpData,
) -> Option<(Vec<f64>, Vec<f64>)> {
    let root = root_of(size);
    match (case, data) {
        (Case::AllReduce(op), OpData::AllReduce { buf, .. }) => {
            Some((buf.to_f64_vec(), reduced(op, size, 0, c)))
        }
        (Case::Reduce, OpData::Reduce { buf, .. }) if r == root => {
            Some((buf.to_f64_vec(), reduced(ReduceOp::Sum, size, 0, c)))
        }
        (Case::ReduceScatter, OpData::ReduceScatter { output, counts, .. }) => {
            let o = prefix(counts);
            Some((
                output.to_f64_vec(),
                reduced(ReduceOp::Sum, size, o[r], counts[r]),
            ))
        }
        (Case::AllGather, OpData::AllGather { output, counts, .. }) => {
            let want = (0..size).flat_map(|j| vals(j, 0, counts[j])).collect();
            Some((output.to_f64_vec(), want))
        }
        (Case::Broadcast, OpData::Broadcast { buf, .. }) => {
            Some((buf.to_f64_vec(), vals(root, 0, c)))
        }
        (Case::Scatter, OpData::Scatter { output, .. }) => {
            Some((output.to_f64_vec(), vals(root, r * c, c)))
        }
        (Case::Gather, OpData::Gather { output, .. }) if r == root => {
            let want = (0..size).flat_map(|j| vals(j, 0, c)).collect();
            Some((output.to_f64_vec(), want))
        }
        (Case::AllToAll, OpData::AllToAll { output, .. }) => {
            let want = (0..size)
                .flat_map(|j| {
                    let off: usize = (0..r).map(|to| a2a(c, j, to)).sum();
                    vals(j, off, a2a(c, j, r))
                })
                .collect();
            Some((output.to_f64_vec(), want))
        }
        _ => None,
    }
}

async fn matches_reference(case: Case, dtype: DType) {
    for size in 1..=4 {
        let mut w = world(size).await;
        for (seq, c) in [0usize, 5, 1000].into_iter().enumerate() {
            let res = join_all(w.iter_mut().enumerate().map(|(r, b)| async move {
                let (kind, mut data) = build(case, r, size, c, dtype);
                b.execute(&ctx(r, size, kind, seq as u64), &mut data)
                    .await
                    .map(|()| data)
            }))
            .await;
            for (r, data) in res.into_iter().enumerate() {
                let data = data.unwrap_or_else(|e| {
                    panic!("{case:?} {dtype} world {size} count {c} rank {r}: {e}")
                });
                if let Some((got, want)) = check(case, r, size, c, &data) {
                    assert_eq!(
                        got, want,
                        "{case:?} {dtype} world {size} count {c} rank {r}"
                    );
                }
            }
        }
        for b in &mut w {
            b.finalize().await;
        }
    }
}

macro_rules! reference_tests {
    ($($name:ident: $case:expr, $dtype:expr;)*) => {$(
        #[tokio::test]
        async fn $name() {
            bounded(matches_reference($case, $dtype)).await;
        }
    )*};
}

reference_tests! {
    all_reduce_sum_matches_reference_worlds_1_to_4_f32: Case::AllReduce(ReduceOp::Sum), DType::F32;
    all_reduce_sum_matches_reference_worlds_1_to_4_i32: Case::AllReduce(ReduceOp::Sum), DType::I32;
    all_reduce_max_matches_reference_worlds_1_to_4_f32: Case::AllReduce(ReduceOp::Max), DType::F32;
    all_reduce_min_matches_reference_worlds_1_to_4_i32: Case::AllReduce(ReduceOp::Min), DType::I32;
    reduce_sum_to_last_rank_matches_reference_worlds_1_to_4_f32: Case::Reduce, DType::F32;
    reduce_sum_to_last_rank_matches_reference_worlds_1_to_4_i32: Case::Reduce, DType::I32;
    reduce_scatter_uneven_sum_matches_reference_worlds_1_to_4_f32: Case::ReduceScatter, DType::F32;
    reduce_scatter_uneven_sum_matches_reference_worlds_1_to_4_i32: Case::ReduceScatter, DType::I32;
    all_gather_uneven_matches_reference_worlds_1_to_4_f32: Case::AllGather, DType::F32;
    all_gather_uneven_matches_reference_worlds_1_to_4_i32: Case::AllGather, DType::I32;
    broadcast_from_last_rank_matches_reference_worlds_1_to_4_f32: Case::Broadcast, DType::F32;
    broadcast_from_last_rank_matches_reference_worlds_1_to_4_i32: Case::Broadcast, DType::I32;
    scatter_from_last_rank_matches_reference_worlds_1_to_4_f32: Case::Scatter, DType::F32;
    scatter_from_last_rank_matches_reference_worlds_1_to_4_i32: Case::Scatter, DType::I32;
    gather_to_last_rank_matches_reference_worlds_1_to_4_f32: Case::Gather, DType::F32;
    gather_to_last_rank_matches_reference_worlds_1_to_4_i32: Case::Gather, DType::I32;
    all_to_all_uneven_matches_reference_worlds_1_to_4_f32: Case::AllToAll, DType::F32;
    all_to_all_uneven_matches_reference_worlds_1_to_4_i32: Case::AllToAll, DType::I32;
    barrier_succeeds_worlds_1_to_4_f32: Case::Barrier, DType::F32;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "timing probe; run with --ignored --nocapture"]
async fn all_reduce_64_mib_world_4_timing_probe() {
    bounded(async {
        let n = 16 << 20;
        let mut w = world(4).await;
        for round in 0..3 {
            let start = Instant::now();
            let res = join_all(w.iter_mut().enumerate().map(|(r, b)| async move {
                let mut data = OpData::AllReduce {
                    buf: Tensor::full(1.0f32, n),
                    op: ReduceOp::Sum,
                };
                b.execute(&ctx(r, 4, OpKind::AllReduce, round), &mut data)
                    .await
            }))
            .await;
            assert!(res.iter().all(Result::is_ok));
            eprintln!(
                "round {round}: 64 MiB all_reduce on 4 ranks in {:?}",
                start.elapsed()
            );
        }
    })
    .await;
}

/// A small op's payload travels with its header ([BE-5]): when the executor
/// rejects the headers and never calls `execute`, the data that came with
/// them is dropped and the links carry the next op correctly, whether the
/// disagreeing ranks were both small or one small and one large.
#[tokio::test]
async fn data_sent_with_rejected_headers_is_dropped_and_the_links_stay_aligned() {
    bounded(async {
        let mut w = world(3).await;
        let mut seq = 0;
        // Rank 1's op differs: a bit larger, or far above the fused size.
        for other in [5usize, 1 << 14] {
            join_all(w.iter_mut().enumerate().map(|(r, b)| async move {
                let n = if r == 1 { other } else { 4 };
                let data = OpData::AllReduce {
                    buf: Tensor::full(1.0f32, n),
                    op: ReduceOp::Sum,
                };
                let out = (0..3)
                    .filter(|&p| p != r)
                    .map(|p| (p, seq, vec![r as u8; 8]))
                    .collect();
                let got = b
                    .exchange_headers_with_data(&ctx(r, 3, OpKind::AllReduce, seq), out, &data)
                    .await
                    .expect("headers");
                // Only the headers come back, never the data with them.
                for (p, h) in got {
                    assert_eq!(h, vec![p as u8; 8]);
                }
            }))
            .await;
            seq += 1;
            // The next op, small then large, on every rank.
            for n in [4usize, 1 << 14] {
                let res = join_all(w.iter_mut().enumerate().map(|(r, b)| async move {
                    let c = ctx(r, 3, OpKind::AllReduce, seq);
                    let mut data = OpData::AllReduce {
                        buf: Tensor::full((r + 1) as f32, n),
                        op: ReduceOp::Sum,
                    };
                    turn(b, &c, &mut data).await;
                    match data {
                        OpData::AllReduce { buf, .. } => buf.to_vec::<f32>(),
                        _ => unreachable!(),
                    }
                }))
                .await;
                for v in res {
                    assert_eq!(v, vec![6.0; n]);
                }
                seq += 1;
            }
        }
        for b in &mut w {
            b.finalize().await;
        }
    })
    .await;
}

/// all_to_all_single chooses to fuse per rank, from its own send and
/// receive sizes (FU-1 of the cpu backend's fused ops): when one large pair makes some ranks choose the
/// unfused algorithm, every rank runs it (the others' data is dropped), and
/// when all choose it the op completes from the headers alone. Results and
/// the links stay right either way.
#[tokio::test]
async fn all_to_all_single_fuses_only_when_every_rank_chose_it() {
    bounded(async {
        let mut w = world(3).await;
        // Elements rank i sends rank j; 4097 f32 is just above the 16 KiB
        // a fused op may carry per peer.
        let cases: [fn(usize, usize) -> usize; 3] = [
            |i, j| if (i, j) == (0, 1) { 4097 } else { 3 + i + j },
            |i, j| 1 + (i * 3 + j) % 4,
            |i, j| if i == j { 0 } else { 2 * i + j },
        ];
        for (seq, sz) in cases.into_iter().enumerate() {
            let seq = seq as u64;
            let val = move |i: usize, j: usize, k: usize| (i * 1_000_000 + j * 10_000 + k) as f32;
            let res = join_all(w.iter_mut().enumerate().map(|(r, b)| async move {
                let c = ctx(r, 3, OpKind::AllToAllSingle, seq);
                let send: Vec<usize> = (0..3).map(|j| sz(r, j)).collect();
                let recv: Vec<usize> = (0..3).map(|j| sz(j, r)).collect();
                let input: Vec<f32> = (0..3)
                    .flat_map(|j| (0..sz(r, j)).map(move |k| val(r, j, k)))
                    .collect();
                let mut data = OpData::AllToAll {
                    input: Tensor::from_slice(&input),
                    output: Tensor::full(-1.0f32, recv.iter().sum()),
                    send_counts: send,
                    recv_counts: recv,
                };
                turn(b, &c, &mut data).await;
                match data {
                    OpData::AllToAll { output, .. } => output.to_vec::<f32>(),
                    _ => unreachable!(),
                }
            }))
            .await;
            for (r, got) in res.into_iter().enumerate() {
                let want: Vec<f32> = (0..3)
                    .flat_map(|j| (0..sz(j, r)).map(move |k| val(j, r, k)))
                    .collect();
                assert_eq!(got, want, "case {seq}, rank {r}");
            }
        }
        for b in &mut w {
            b.finalize().await;
        }
    })
    .await;
}

/// all_to_all_single without a header exchange: every ordered pair sends
/// one message, an empty one for an empty block. Ranks whose blocks are all
/// small move them in one step, the others pairwise; they mix in one op
/// (a large block between two ranks, empty blocks, an empty op), on 3 and
/// 4 ranks, with every result checked and the links left in step.
#[tokio::test]
async fn all_to_all_single_without_headers_mixes_one_step_and_pairwise_ranks() {
    bounded(async {
        for n in [3usize, 4] {
            let mut w = world(n).await;
            // Elements rank i sends rank j; 4097 f32 is above the 16 KiB
            // per peer of the one-step algorithm.
            let cases: [fn(usize, usize) -> usize; 4] = [
                |i, j| if (i, j) == (0, 1) { 4097 } else { 3 + i + j },
                |i, j| if (i + j) % 2 == 0 { 0 } else { 1 + i },
                |i, j| {
                    if (i, j) == (2, 0) {
                        5000
                    } else {
                        usize::from(i == j)
                    }
                },
                |_, _| 0,
            ];
            for (seq, sz) in cases.into_iter().enumerate() {
                let mut data = a2a_single_data(n, sz);
                run_all(&mut w, OpKind::AllToAllSingle, seq as u64, &mut data).await;
                check_a2a_single(data, sz, &format!("{n} ranks, case {seq}"));
            }
            for b in &mut w {
                b.finalize().await;
            }
        }
    })
    .await;
}

/// The element `k` that rank `i` sends rank `j` in [`a2a_single_data`].
fn a2a_val(i: usize, j: usize, k: usize) -> f32 {
    (i * 1_000_000 + j * 10_000 + k) as f32
}

/// Every rank's all_to_all_single on `n` ranks, rank `i` sending rank `j`
/// `sz(i, j)` elements ([`a2a_val`]), into an output of -1s.
fn a2a_single_data(n: usize, sz: fn(usize, usize) -> usize) -> Vec<OpData> {
    (0..n)
        .map(|r| OpData::AllToAll {
            input: Tensor::from_vec(
                (0..n)
                    .flat_map(|j| (0..sz(r, j)).map(move |k| a2a_val(r, j, k)))
                    .collect(),
            ),
            output: Tensor::full(-1.0f32, (0..n).map(|j| sz(j, r)).sum()),
            send_counts: (0..n).map(|j| sz(r, j)).collect(),
            recv_counts: (0..n).map(|j| sz(j, r)).collect(),
        })
        .collect()
}

/// Check every rank's output of [`a2a_single_data`]'s op.
fn check_a2a_single(data: Vec<OpData>, sz: fn(usize, usize) -> usize, what: &str) {
    let n = data.len();
    for (r, d) in data.into_iter().enumerate() {
        let OpData::AllToAll { output, .. } = d else {
            unreachable!()
        };
        let want: Vec<f32> = (0..n)
            .flat_map(|j| (0..sz(j, r)).map(move |k| a2a_val(j, r, k)))
            .collect();
        assert!(output.to_vec::<f32>() == want, "{what}, rank {r}");
    }
}

/// Run one op on every rank of `w` at once, without a header exchange (the
/// default checks), and fail on any rank's error.
async fn run_all(w: &mut [CpuBackend], kind: OpKind, seq: u64, data: &mut [OpData]) {
    let n = w.len();
    let res = join_all(w.iter_mut().zip(data.iter_mut()).enumerate().map(
        |(r, (b, d))| async move {
            let c = OpCtx {
                headers: false,
                ..ctx(r, n, kind, seq)
            };
            b.execute(&c, d).await
        },
    ))
    .await;
    for (r, res) in res.into_iter().enumerate() {
        res.unwrap_or_else(|e| panic!("rank {r}, {kind:?} #{seq}: {e}"));
    }
}

/// `n` ranks in one process, rank `r` on host `h{host(r)}`
/// (`BackendInit::host_id`), with links on demand; `None` under
/// `CHORUS_SHM=0`, where host ids, and with them the hierarchy, are off
/// (checked here).
async fn across_hosts(
    n: usize,
    prefix: &str,
    host: impl Fn(usize) -> usize,
) -> Option<Vec<CpuBackend>> {
    let store = Arc::new(MemoryStore::new());
    let w: Vec<CpuBackend> = join_all((0..n).map(|r| {
        CpuBackend::connect(BackendInit {
            links: LinkPolicy::Lazy,
            host_id: Some(format!("h{}", host(r))),
            peers_failed: chorus::backends::PeerFailures::none(),
            ..init(&store, prefix, r, n, b"s", Duration::from_secs(10))
        })
    }))
    .await
    .into_iter()
    .map(|b| b.expect("connect"))
    .collect();
    if std::env::var("CHORUS_SHM").is_ok_and(|v| v == "0") {
        assert!(w.iter().all(|b| b.topology().is_none()));
        return None;
    }
    Some(w)
}

/// On a communicator that spans hosts (three of four ranks, named by
/// `BackendInit::host_id`), all-reduce, all-gather, broadcast, reduce,
/// reduce-scatter, gather, scatter and barrier run in two levels: their results are right, and the links a rank opens off its
/// host go only to its rail (the ranks with its index on the other hosts)
/// or, for a host's representative in a rooted or small op, to the other
/// hosts' representatives.
#[tokio::test]
async fn ops_across_hosts_run_in_two_levels_over_leaders_and_rails() {
    bounded(async {
        let (n, per_host) = (12usize, 4usize);
        let Some(mut w) = across_hosts(n, "comm/hier#0/epoch/3", |r| r / per_host).await else {
            return;
        };
        for b in &w {
            assert_eq!(
                b.topology().map(|t| (t.hosts(), t.uniform())),
                Some((3, true))
            );
        }
        let (root_b, root_r) = (5usize, 6usize);
        // 2 elements (by leaders) and 100 000 f32 (above 16 KiB: by rails).
        for (seq, count) in [(0u64, 2usize), (1, 100_000)] {
            let mut data: Vec<OpData> = (0..n)
                .map(|r| OpData::AllReduce {
                    buf: Tensor::from_vec((0..count).map(|i| (r * 3 + i % 7) as f32).collect()),
                    op: ReduceOp::Sum,
                })
                .collect();
            run_all(&mut w, OpKind::AllReduce, seq, &mut data).await;
            let want: Vec<f32> = (0..count).map(|i| (198 + 12 * (i % 7)) as f32).collect();
            for (r, d) in data.iter().enumerate() {
                let OpData::AllReduce { buf, .. } = d else {
                    unreachable!()
                };
                assert!(
                    buf.to_vec::<f32>() == want,
                    "all_reduce of {count} on rank {r}"
                );
            }
        }
        let mut data: Vec<OpData> = (0..n)
            .map(|r| OpData::Broadcast {
                buf: Tensor::from_vec(if r == root_b {
                    vec![4i64, 5, 6]
                } else {
                    vec![0; 3]
                }),
                root: root_b,
            })
            .collect();
        run_all(&mut w, OpKind::Broadcast, 2, &mut data).await;
        for (r, d) in data.iter().enumerate() {
            let OpData::Broadcast { buf, .. } = d else {
                unreachable!()
            };
            assert_eq!(buf.to_vec::<i64>(), vec![4, 5, 6], "broadcast on rank {r}");
        }
        let mut data: Vec<OpData> = (0..n)
            .map(|r| OpData::Reduce {
                buf: Tensor::from_vec(vec![r as i64, 1]),
                op: ReduceOp::Sum,
                root: root_r,
            })
            .collect();
        run_all(&mut w, OpKind::Reduce, 3, &mut data).await;
        let OpData::Reduce { buf, .. } = &data[root_r] else {
            unreachable!()
        };
        assert_eq!(buf.to_vec::<i64>(), vec![66, 12], "reduce at rank {root_r}");
        let mut data: Vec<OpData> = (0..n).map(|_| OpData::Barrier).collect();
        run_all(&mut w, OpKind::Barrier, 4, &mut data).await;
        let mut data: Vec<OpData> = (0..n)
            .map(|r| OpData::AllGather {
                input: Tensor::from_vec(vec![r as i32; 2]),
                output: Tensor::zeros(DType::I32, 2 * n),
                counts: vec![2; n],
                in_place: false,
            })
            .collect();
        run_all(&mut w, OpKind::AllGather, 5, &mut data).await;
        let want: Vec<i32> = (0..n as i32).flat_map(|r| [r, r]).collect();
        for (r, d) in data.iter().enumerate() {
            let OpData::AllGather { output, .. } = d else {
                unreachable!()
            };
            assert_eq!(output.to_vec::<i32>(), want, "all_gather on rank {r}");
        }
        // Gather and scatter of 20 000 i32 per rank (80 KB, above the flat
        // tree's limit): in two levels, through the hosts' leaders.
        let (root_g, big) = (9usize, 20_000usize);
        let block = |r: usize| (0..big).map(move |i| (r * 7 + i % 11) as i32);
        let mut data: Vec<OpData> = (0..n)
            .map(|r| OpData::Gather {
                input: Tensor::from_vec(block(r).collect()),
                output: Tensor::zeros(DType::I32, if r == root_g { n * big } else { 0 }),
                root: root_g,
            })
            .collect();
        run_all(&mut w, OpKind::Gather, 6, &mut data).await;
        let OpData::Gather { output, .. } = &data[root_g] else {
            unreachable!()
        };
        let want: Vec<i32> = (0..n).flat_map(block).collect();
        assert!(output.to_vec::<i32>() == want, "gather at rank {root_g}");
        let mut data: Vec<OpData> = (0..n)
            .map(|r| OpData::Scatter {
                input: Tensor::from_vec(if r == root_g { want.clone() } else { vec![] }),
                output: Tensor::zeros(DType::I32, big),
                root: root_g,
            })
            .collect();
        run_all(&mut w, OpKind::Scatter, 7, &mut data).await;
        for (r, d) in data.iter().enumerate() {
            let OpData::Scatter { output, .. } = d else {
                unreachable!()
            };
            assert!(
                output.to_vec::<i32>() == block(r).collect::<Vec<_>>(),
                "scatter on rank {r}"
            );
        }

        // Reduce-scatter of uneven blocks (one empty): on each host over
        // every host's span, then along the rails.
        let rs_count = |r: usize| if r == 7 { 0 } else { 1000 + 37 * r };
        let counts: Vec<usize> = (0..n).map(rs_count).collect();
        let total: usize = counts.iter().sum();
        let mut data: Vec<OpData> = (0..n)
            .map(|r| OpData::ReduceScatter {
                input: Tensor::from_vec((0..total).map(|i| (r + i % 13) as i64).collect()),
                output: Tensor::zeros(DType::I64, rs_count(r)),
                counts: counts.clone(),
                op: ReduceOp::Sum,
            })
            .collect();
        run_all(&mut w, OpKind::ReduceScatter, 8, &mut data).await;
        let mut start = 0;
        for (r, d) in data.iter().enumerate() {
            let OpData::ReduceScatter { output, .. } = d else {
                unreachable!()
            };
            let want: Vec<i64> = (start..start + rs_count(r))
                .map(|i| (0..n).map(|q| (q + i % 13) as i64).sum())
                .collect();
            assert!(output.to_vec::<i64>() == want, "reduce_scatter on rank {r}");
            start += rs_count(r);
        }

        let (host, local) = (|r: usize| r / per_host, |r: usize| r % per_host);
        let rep = |r: usize| local(r) == 0 || r == root_b || r == root_r || r == root_g;
        for (r, b) in w.iter().enumerate() {
            let far: Vec<usize> = b
                .linked_peers()
                .into_iter()
                .filter(|&p| host(p) != host(r))
                .collect();
            // A leader's links off its host: the other hosts' leaders and
            // the roots of the rooted ops above, at most 5 here.
            assert!(
                !far.is_empty() && far.len() <= 5,
                "rank {r} off its host: {far:?}"
            );
            for p in far {
                assert!(
                    local(p) == local(r) || (rep(r) && rep(p)),
                    "rank {r} linked to {p} on another host"
                );
            }
        }
    })
    .await;
}

/// all_to_all on a communicator across hosts (three hosts of four ranks,
/// placed round-robin so no host's ranks are consecutive) runs on rails:
/// uneven blocks (empty ones included), large blocks and the list form
/// that learns its sizes all arrive right, and a rank's links off its
/// host go only to its rail. A block of the wrong length that was
/// forwarded fails the op on the rank it was for, naming its sender and
/// the rank that forwarded it.
#[tokio::test]
async fn all_to_all_across_hosts_runs_on_rails() {
    bounded(async {
        let (n, hosts) = (12usize, 3usize);
        let host = |r: usize| r % hosts;
        let Some(mut w) = across_hosts(n, "comm/rails#0/epoch/3", host).await else {
            return;
        };
        let cases: [fn(usize, usize) -> usize; 2] = [
            |i, j| {
                if (i + j) % 5 == 0 {
                    0
                } else {
                    1 + (i * 7 + j) % 9
                }
            },
            |i, j| 3000 + i + j,
        ];
        for (seq, sz) in cases.into_iter().enumerate() {
            let mut data = a2a_single_data(n, sz);
            run_all(&mut w, OpKind::AllToAllSingle, seq as u64, &mut data).await;
            check_a2a_single(data, sz, &format!("case {seq}"));
        }
        // The list form: receive sizes learned from the frames.
        let sz = |i: usize, j: usize| (i + 2 * j) % 4;
        let mut data: Vec<OpData> = (0..n)
            .map(|r| OpData::AllToAll {
                input: Tensor::from_vec(
                    (0..n)
                        .flat_map(|j| (0..sz(r, j)).map(move |k| (r * 100 + j * 10 + k) as i64))
                        .collect(),
                ),
                output: Tensor::zeros(DType::I64, 0),
                send_counts: (0..n).map(|j| sz(r, j)).collect(),
                recv_counts: vec![],
            })
            .collect();
        run_all(&mut w, OpKind::AllToAll, 2, &mut data).await;
        for (r, d) in data.iter().enumerate() {
            let OpData::AllToAll {
                output,
                recv_counts,
                ..
            } = d
            else {
                unreachable!()
            };
            let want: Vec<i64> = (0..n)
                .flat_map(|j| (0..sz(j, r)).map(move |k| (j * 100 + r * 10 + k) as i64))
                .collect();
            assert_eq!(output.to_vec::<i64>(), want, "list form, rank {r}");
            assert_eq!(
                recv_counts,
                &(0..n).map(|j| sz(j, r)).collect::<Vec<_>>(),
                "list form, rank {r}"
            );
        }
        // RA-2: off the host, only the rail (same index on its host).
        for (r, b) in w.iter().enumerate() {
            let t = b.topology().expect("hosts");
            let far: Vec<usize> = b
                .linked_peers()
                .into_iter()
                .filter(|&p| host(p) != host(r))
                .collect();
            assert_eq!(far.len(), hosts - 1, "rank {r} off its host: {far:?}");
            assert!(
                far.iter().all(|&p| t.local(p) == t.local(r)),
                "rank {r} off its host: {far:?}"
            );
        }
        // RA-3: rank 1 (host 1, index 0) sends rank 5 (host 2, index 1) 3
        // elements where rank 5 expects 2; rank 2 (host 2, index 0)
        // forwards them.
        let mut data = a2a_single_data(n, |i, j| if (i, j) == (1, 5) { 3 } else { 2 });
        if let OpData::AllToAll {
            recv_counts,
            output,
            ..
        } = &mut data[5]
        {
            recv_counts[1] = 2;
            *output = Tensor::zeros(DType::F32, 2 * n);
        }
        let res = join_all(w.iter_mut().zip(data.iter_mut()).enumerate().map(
            |(r, (b, d))| async move {
                let c = OpCtx {
                    headers: false,
                    ..ctx(r, n, OpKind::AllToAllSingle, 3)
                };
                b.execute(&c, d).await
            },
        ))
        .await;
        for (r, res) in res.into_iter().enumerate() {
            match (r, res) {
                (5, Err(e @ Error::Mismatch { .. })) => {
                    let text = e.to_string();
                    assert!(
                        text.contains("rank 1 sent 12 bytes (forwarded by rank 2)"),
                        "{text}"
                    );
                }
                (5, other) => panic!("rank 5: {other:?}"),
                (_, res) => res.unwrap_or_else(|e| panic!("rank {r}: {e}")),
            }
        }
        for b in &mut w {
            b.finalize().await;
        }
    })
    .await;
}

/// Two ranks on different hosts (so their link is TCP) whose ops run as a
/// blocked caller runs them (`may_block`): each on its own thread, which
/// may wait in the kernel (the TCP latency path).
async fn tcp_pair() -> Vec<CpuBackend> {
    let store = Arc::new(MemoryStore::new());
    let prefix = "comm/tcp-pair#0/epoch/3";
    join_all((0..2).map(|r| {
        CpuBackend::connect(BackendInit {
            host_id: Some(format!("host-{r}")),
            peers_failed: chorus::backends::PeerFailures::none(),
            ..init(&store, prefix, r, 2, b"s", Duration::from_secs(10))
        })
    }))
    .await
    .into_iter()
    .map(|b| b.expect("connect"))
    .collect()
}

/// Run `f` on a thread of its own that may block, as a blocked caller's
/// turn does.
fn blocking<T: Send + 'static>(
    f: impl FnOnce(&tokio::runtime::Handle) -> T + Send + 'static,
) -> tokio::task::JoinHandle<T> {
    let h = tokio::runtime::Handle::current();
    tokio::task::spawn_blocking(move || f(&h))
}

fn blocked_ctx(rank: usize, kind: OpKind, seq: u64) -> OpCtx {
    OpCtx {
        headers: false,
        may_block: true,
        ..ctx(rank, 2, kind, seq)
    }
}

/// Ping-pong and all-reduce over TCP from blocked callers (the latency
/// path: sockets polled and waited on by the caller's thread) deliver every
/// message in order, interleaved with ops polled as tasks (the reactor
/// path) on the same links.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_callers_over_tcp_get_every_message_in_order() {
    bounded(async {
        let mut w = tcp_pair().await;
        let b1 = w.pop().expect("rank 1");
        let b0 = w.pop().expect("rank 0");
        let rounds = 300u64;
        let run = |mut b: CpuBackend, rank: usize| {
            blocking(move |h| {
                for i in 0..rounds {
                    // Every third round polled as a task: the reactor path.
                    let mut c = blocked_ctx(rank, OpKind::AllReduce, i);
                    c.may_block = i % 3 != 0;
                    let mut d = OpData::AllReduce {
                        buf: Tensor::from_vec(vec![(rank as i64 + 1) * i as i64; 3]),
                        op: ReduceOp::Sum,
                    };
                    h.block_on(b.execute(&c, &mut d))?;
                    let OpData::AllReduce { buf, .. } = d else {
                        unreachable!()
                    };
                    assert_eq!(buf.to_vec::<i64>(), vec![3 * i as i64; 3], "round {i}");
                    let mut p = OpData::P2P {
                        ops: vec![P2PTransfer {
                            peer: 1 - rank,
                            seq: i,
                            send: rank == (i % 2) as usize,
                            buf: Tensor::from_vec(vec![i as u32, rank as u32]),
                        }],
                    };
                    let c = OpCtx {
                        may_block: c.may_block,
                        ..blocked_ctx(rank, OpKind::P2P, i)
                    };
                    h.block_on(b.execute(&c, &mut p))?;
                    let OpData::P2P { ops } = p else {
                        unreachable!()
                    };
                    if rank != (i % 2) as usize {
                        assert_eq!(ops[0].buf.to_vec::<u32>(), vec![i as u32, 1 - rank as u32]);
                    }
                }
                Ok::<_, Error>(b)
            })
        };
        let (r0, r1) = (run(b0, 0), run(b1, 1));
        let b0 = r0.await.expect("join").expect("rank 0");
        let b1 = r1.await.expect("join").expect("rank 1");
        assert!(b0.topology().is_none() && b1.topology().is_none());
    })
    .await;
}

/// Large transfers over TCP from blocked callers (the direct path: both
/// ranks write and read their sockets themselves, each filling the other's
/// buffers) arrive whole and in order, including sizes that end mid-piece
/// of a reduction, interleaved with the same ops polled as tasks (the
/// reactor path) on the same links.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn blocked_callers_move_large_transfers_over_tcp_both_ways_at_once() {
    bounded(async {
        let mut w = tcp_pair().await;
        let b1 = w.pop().expect("rank 1");
        let b0 = w.pop().expect("rank 0");
        // f32 counts: below, at and above a 64 KiB reduction piece, and
        // several MiB, which fill both directions' socket buffers at once.
        let counts = [16 << 10, (256 << 10) + 3, (3 << 20) + 1];
        let run = |mut b: CpuBackend, rank: usize| {
            blocking(move |h| {
                for (i, &n) in counts.iter().chain(counts.iter()).enumerate() {
                    let seq = i as u64;
                    let may_block = i < counts.len();
                    let mut c = blocked_ctx(rank, OpKind::AllReduce, seq);
                    c.may_block = may_block;
                    let mine = |j: usize| ((j % 1000) * (rank + 1)) as f32;
                    let mut d = OpData::AllReduce {
                        buf: Tensor::from_vec((0..n).map(mine).collect::<Vec<f32>>()),
                        op: ReduceOp::Sum,
                    };
                    h.block_on(b.execute(&c, &mut d))?;
                    let OpData::AllReduce { buf, .. } = d else {
                        unreachable!()
                    };
                    let got = buf.to_vec::<f32>();
                    assert_eq!(got.len(), n);
                    for (j, v) in got.iter().enumerate() {
                        assert_eq!(*v, ((j % 1000) * 3) as f32, "size {n}, element {j}");
                    }
                    // Both ranks send n words to each other at once.
                    let word = |from: usize, j: usize| (from * 1_000_000_007 + j * 31) as u64;
                    let mut p = OpData::P2P {
                        ops: vec![
                            P2PTransfer {
                                peer: 1 - rank,
                                seq,
                                send: true,
                                buf: Tensor::from_vec((0..n).map(|j| word(rank, j)).collect()),
                            },
                            P2PTransfer {
                                peer: 1 - rank,
                                seq,
                                send: false,
                                buf: Tensor::from_vec(vec![0u64; n]),
                            },
                        ],
                    };
                    let c = OpCtx {
                        may_block,
                        ..blocked_ctx(rank, OpKind::P2P, seq)
                    };
                    h.block_on(b.execute(&c, &mut p))?;
                    let OpData::P2P { ops } = p else {
                        unreachable!()
                    };
                    let got = ops[1].buf.to_vec::<u64>();
                    assert!(
                        got.iter().enumerate().all(|(j, v)| *v == word(1 - rank, j)),
                        "size {n}: the words from rank {} differ",
                        1 - rank
                    );
                }
                Ok::<_, Error>(b)
            })
        };
        let (r0, r1) = (run(b0, 0), run(b1, 1));
        r0.await.expect("join").expect("rank 0");
        r1.await.expect("join").expect("rank 1");
    })
    .await;
}

/// A blocked caller waiting in the kernel for a TCP peer that dies gets
/// `PeerFailed` naming it promptly, not after a timeout.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_blocked_caller_over_tcp_learns_at_once_that_its_peer_died() {
    bounded(async {
        let mut w = tcp_pair().await;
        let mut b1 = w.pop().expect("rank 1");
        let mut b0 = w.pop().expect("rank 0");
        let p2p = |rank: usize, send: bool| OpData::P2P {
            ops: vec![P2PTransfer {
                peer: 1 - rank,
                seq: 0,
                send,
                buf: Tensor::from_vec(vec![7u8]),
            }],
        };
        let waiter = blocking(move |h| {
            // Tell rank 1 that this rank is about to wait.
            h.block_on(b0.execute(&blocked_ctx(0, OpKind::P2P, 0), &mut p2p(0, true)))
                .expect("send");
            let mut d = OpData::AllReduce {
                buf: Tensor::from_vec(vec![1.0f32; 4]),
                op: ReduceOp::Sum,
            };
            let t = Instant::now();
            let r = h.block_on(b0.execute(&blocked_ctx(0, OpKind::AllReduce, 0), &mut d));
            (r, t.elapsed())
        });
        // Once rank 0 is on its way into the wait, rank 1 goes away without
        // a word.
        b1.execute(
            &OpCtx {
                headers: false,
                ..ctx(1, 2, OpKind::P2P, 0)
            },
            &mut p2p(1, false),
        )
        .await
        .expect("recv");
        drop(b1);
        let (r, took) = waiter.await.expect("join");
        match r {
            Err(Error::PeerFailed { failed_ranks, .. }) => assert_eq!(failed_ranks, vec![1]),
            other => panic!("expected PeerFailed naming rank 1, got {other:?}"),
        }
        assert!(took < Duration::from_secs(5), "took {took:?}");
    })
    .await;
}
