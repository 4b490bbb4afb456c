//! Pluggable backends: a backend written outside Chorus, registered by
//! name with `chorus::register_backend`, runs real collectives through
//! `Comm` (and splits, whose children it creates again by name); the
//! registration errors.
//!
//! The backend here, `memnet`, moves bytes between the ranks of one process
//! over in-memory channels, found through the communicator's key prefix.

mod common;

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex, Once};

use chorus::backends::{async_trait, Backend, BackendInit, OpCtx, OpData};
use chorus::{CommOptions, Device, Error, ReduceOp, Result, Tensor};
use common::run_ranks_on;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// One message on a link: the sequence number stamped by the sender
/// (headers) or `u64::MAX` (data), and the bytes.
type Msg = (u64, Vec<u8>);
type Ends = (Option<UnboundedSender<Msg>>, Option<UnboundedReceiver<Msg>>);

/// Links by (key prefix, from, to); created by whichever end comes first.
type Links = HashMap<(String, usize, usize), Ends>;
static HUB: LazyLock<Mutex<Links>> = LazyLock::new(|| Mutex::new(HashMap::new()));

/// Factory calls, by communicator name (to see that split children were
/// created through the registry too).
static CREATED: LazyLock<Mutex<Vec<String>>> = LazyLock::new(|| Mutex::new(Vec::new()));

struct MemNet {
    rank: usize,
    to: Vec<Option<UnboundedSender<Msg>>>,
    from: Vec<Option<UnboundedReceiver<Msg>>>,
}

impl MemNet {
    fn connect(init: &BackendInit) -> MemNet {
        let mut hub = HUB.lock().unwrap();
        // Take one end of the link `from -> to`; the hub forgets the link
        // once both ends are taken, so that dropping them closes it.
        let mut take = |from: usize, to: usize, sender: bool| {
            let key = (init.key_prefix.clone(), from, to);
            let ends = hub.entry(key.clone()).or_insert_with(|| {
                let (tx, rx) = unbounded_channel();
                (Some(tx), Some(rx))
            });
            let got = if sender {
                (ends.0.take(), None)
            } else {
                (None, ends.1.take())
            };
            if ends.0.is_none() && ends.1.is_none() {
                hub.remove(&key);
            }
            got
        };
        let (me, n) = (init.rank, init.size);
        let mut to = Vec::new();
        let mut from = Vec::new();
        for p in 0..n {
            if p == me {
                to.push(None);
                from.push(None);
                continue;
            }
            to.push(take(me, p, true).0);
            from.push(take(p, me, false).1);
        }
        MemNet { rank: me, to, from }
    }

    fn send(&self, ctx: &OpCtx, peer: usize, seq: u64, bytes: Vec<u8>) -> Result<()> {
        self.to[peer]
            .as_ref()
            .ok_or_else(|| ctx.peer_failed(vec![peer], "memnet: no link"))?
            .send((seq, bytes))
            .map_err(|_| ctx.peer_failed(vec![peer], "memnet: peer closed its link"))
    }

    async fn recv(&mut self, ctx: &OpCtx, peer: usize, seq: u64) -> Result<Vec<u8>> {
        let rx = self.from[peer]
            .as_mut()
            .ok_or_else(|| ctx.peer_failed(vec![peer], "memnet: no link"))?;
        let (got, bytes) = rx
            .recv()
            .await
            .ok_or_else(|| ctx.peer_failed(vec![peer], "memnet: peer closed its link"))?;
        if got != seq {
            return Err(ctx.mismatch(format!("frame #{got} from rank {peer}, expected #{seq}")));
        }
        Ok(bytes)
    }

    fn peers(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.to.len()).filter(move |&p| p != self.rank)
    }
}

const DATA: u64 = u64::MAX;

fn combine(op: ReduceOp, a: f64, b: f64) -> Option<f64> {
    Some(match op {
        ReduceOp::Sum => a + b,
        ReduceOp::Product => a * b,
        ReduceOp::Min => a.min(b),
        ReduceOp::Max => a.max(b),
        _ => return None,
    })
}

#[async_trait]
impl Backend for MemNet {
    fn name(&self) -> &'static str {
        "memnet"
    }

    async fn exchange_headers(
        &mut self,
        ctx: &OpCtx,
        outgoing: Vec<(usize, u64, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>> {
        for (peer, seq, h) in &outgoing {
            self.send(ctx, *peer, *seq, h.clone())?;
        }
        let mut got = Vec::with_capacity(outgoing.len());
        for (peer, seq, _) in outgoing {
            got.push((peer, self.recv(ctx, peer, seq).await?));
        }
        Ok(got)
    }

    async fn execute(&mut self, ctx: &OpCtx, data: &mut OpData) -> Result<()> {
        match data {
            OpData::Barrier => Ok(()),
            OpData::Broadcast { buf, root } => {
                if self.rank == *root {
                    for p in self.peers().collect::<Vec<_>>() {
                        self.send(ctx, p, DATA, buf.as_bytes().to_vec())?;
                    }
                } else {
                    let bytes = self.recv(ctx, *root, DATA).await?;
                    buf.as_bytes_mut().copy_from_slice(&bytes);
                }
                Ok(())
            }
            OpData::AllGather {
                input,
                output,
                counts,
                ..
            } => {
                for p in self.peers().collect::<Vec<_>>() {
                    self.send(ctx, p, DATA, input.as_bytes().to_vec())?;
                }
                let elem = input.dtype().size();
                let mut at = 0;
                for (r, &c) in counts.clone().iter().enumerate() {
                    let block = if r == self.rank {
                        input.as_bytes().to_vec()
                    } else {
                        self.recv(ctx, r, DATA).await?
                    };
                    output.as_bytes_mut()[at..at + c * elem].copy_from_slice(&block);
                    at += c * elem;
                }
                Ok(())
            }
            OpData::AllReduce { buf, op } => {
                for p in self.peers().collect::<Vec<_>>() {
                    self.send(ctx, p, DATA, buf.as_bytes().to_vec())?;
                }
                let dtype = buf.dtype();
                let mut acc: Option<Vec<f64>> = None;
                // In rank order, so that every rank computes the same values.
                for r in 0..self.to.len() {
                    let part = if r == self.rank {
                        buf.to_f64_vec()
                    } else {
                        let bytes = self.recv(ctx, r, DATA).await?;
                        Tensor::from_bytes(dtype, &bytes)
                            .ok_or_else(|| ctx.peer_failed(vec![r], "memnet: bad block"))?
                            .to_f64_vec()
                    };
                    acc = Some(match acc {
                        None => part,
                        Some(a) => a
                            .iter()
                            .zip(&part)
                            .map(|(&x, &y)| combine(*op, x, y))
                            .collect::<Option<Vec<f64>>>()
                            .ok_or_else(|| Error::UnsupportedOp {
                                op: op.to_string(),
                                dtype,
                            })?,
                    });
                }
                let out = Tensor::from_f64s(dtype, &acc.unwrap_or_default());
                buf.as_bytes_mut().copy_from_slice(out.as_bytes());
                Ok(())
            }
            other => Err(Error::NotSupported {
                comm: ctx.comm.clone(),
                rank: ctx.rank,
                backend: "memnet",
                op: ctx.kind.name(),
                detail: format!(
                    "memnet moves broadcast, all_gather and all_reduce only, not {other:?}"
                ),
            }),
        }
    }

    async fn abort(&mut self, _reason: &str, _failed: &[usize]) {
        self.to.clear();
        self.from.clear();
    }

    async fn finalize(&mut self) {
        self.to.clear();
        self.from.clear();
    }
}

fn register() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        chorus::register_backend("memnet", |device, init: BackendInit| async move {
            if device != Device::Cpu {
                return Err(Error::BackendUnavailable {
                    backend: "memnet",
                    reason: format!("memnet runs on the cpu device, not {device}"),
                });
            }
            CREATED.lock().unwrap().push(init.comm.clone());
            Ok(Box::new(MemNet::connect(&init)) as Box<dyn Backend>)
        })
        .expect("memnet registers");
    });
}

#[test]
fn a_registered_backend_runs_collectives_through_comm() {
    register();
    let out = run_ranks_on(
        "memnet",
        3,
        "memnet-world",
        |_, o| o,
        |comm| {
            let r = comm.rank();
            assert_eq!(comm.backend(), "memnet");
            let s = comm
                .all_reduce(Tensor::full((r + 1) as f32, 4), ReduceOp::Sum)
                .unwrap();
            assert_eq!(s.to_vec::<f32>(), vec![6.0; 4]);
            // Avg is Sum on the backend plus the executor's division.
            let a = comm
                .all_reduce(Tensor::full(r as f64 * 3.0, 2), ReduceOp::Avg)
                .unwrap();
            assert_eq!(a.to_vec::<f64>(), vec![3.0; 2]);
            let g = comm
                .all_gather(Tensor::from_vec(vec![r as i64, 10 * r as i64]))
                .unwrap();
            assert_eq!(g.to_vec::<i64>(), vec![0, 0, 1, 10, 2, 20]);
            let b = comm
                .broadcast(Tensor::full(if r == 2 { 7i32 } else { 0 }, 3), 2)
                .unwrap();
            assert_eq!(b.to_vec::<i32>(), vec![7; 3]);
            comm.barrier().unwrap();
            // The executor's cross-rank check runs over the backend's headers.
            let n = if r == 1 { 5 } else { 4 };
            match comm.all_reduce(Tensor::full(1i32, n), ReduceOp::Sum) {
                Err(Error::Mismatch { .. }) => {}
                other => panic!("rank {r}: expected Mismatch, got {other:?}"),
            }
            // A split's child is created by name, through the factory again.
            let child = comm.split(&[0, 2], "memnet-pair").unwrap();
            let pair = child.map(|c| {
                assert_eq!(c.backend(), "memnet");
                c.all_reduce(Tensor::full(r as i32, 1), ReduceOp::Max)
                    .unwrap()
                    .to_vec::<i32>()[0]
            });
            comm.finalize().unwrap();
            pair
        },
    );
    assert_eq!(out, vec![Some(2), None, Some(2)]);
    let created = CREATED.lock().unwrap().clone();
    assert_eq!(created.iter().filter(|c| *c == "memnet-world").count(), 3);
    assert_eq!(created.iter().filter(|c| *c == "memnet-pair").count(), 2);
}

#[test]
fn an_op_the_backend_refuses_is_its_error_on_every_rank_and_not_fatal() {
    register();
    let out = run_ranks_on(
        "memnet",
        2,
        "memnet-unsupported",
        |_, o| o,
        |comm| {
            let e = comm
                .reduce_scatter(Tensor::full(1.0f32, 4), ReduceOp::Sum)
                .unwrap_err();
            // Refused alike on every rank before any data moved, and not a
            // fatal error: the communicator stays usable.
            assert!(comm.is_active());
            let s = comm
                .all_reduce(Tensor::full(2u32, 3), ReduceOp::Product)
                .unwrap();
            assert_eq!(s.to_vec::<u32>(), vec![4; 3]);
            comm.finalize().unwrap();
            e
        },
    );
    for e in out {
        assert!(
            matches!(
                e,
                Error::NotSupported {
                    backend: "memnet",
                    ..
                }
            ),
            "{e}"
        );
    }
}

#[test]
fn a_single_rank_world_on_the_registered_backend() {
    register();
    let comm = chorus::new_comm("memnet", Device::Cpu, "memnet-one", CommOptions::single())
        .expect("memnet comm");
    let s = comm
        .all_reduce(Tensor::from_vec(vec![1.5f32, 2.5]), ReduceOp::Sum)
        .unwrap();
    assert_eq!(s.to_vec::<f32>(), vec![1.5, 2.5]);
    comm.finalize().unwrap();
    // The factory refuses a device it cannot use, before the communicator starts.
    match chorus::new_comm(
        "memnet",
        Device::Cuda(0),
        "memnet-gpu",
        CommOptions::single(),
    ) {
        Err(Error::BackendUnavailable { backend, .. }) => assert_eq!(backend, "memnet"),
        other => panic!("{other:?}"),
    }
}

#[test]
fn registration_errors_and_unknown_names() {
    register();
    let factory = |_d: Device, init: BackendInit| async move {
        Ok(Box::new(MemNet::connect(&init)) as Box<dyn Backend>)
    };
    for name in ["cpu", "nccl", "rccl", "gloo", "mpi"] {
        match chorus::register_backend(name, factory) {
            Err(Error::Config(m)) => assert!(m.contains("Chorus has a backend"), "{m}"),
            other => panic!("{name}: {other:?}"),
        }
    }
    match chorus::register_backend("memnet", factory) {
        Err(Error::Config(m)) => assert!(m.contains("already registered"), "{m}"),
        other => panic!("{other:?}"),
    }
    for name in ["", "a/b"] {
        assert!(matches!(
            chorus::register_backend(name, factory),
            Err(Error::Config(_))
        ));
    }
    match chorus::new_comm("no-such-net", Device::Cpu, "x", CommOptions::single()) {
        Err(Error::UnknownBackend { name, available }) => {
            assert_eq!(name, "no-such-net");
            assert!(available.contains(&"cpu"), "{available:?}");
            assert!(available.contains(&"memnet"), "{available:?}");
        }
        other => panic!("{other:?}"),
    }
    // The built-in one is still the built-in one.
    let cpu = chorus::new_comm("cpu", Device::Cpu, "still-cpu", CommOptions::single()).unwrap();
    assert_eq!(cpu.backend(), "cpu");
    cpu.finalize().unwrap();
}
