//! `memnet`: a backend that moves bytes between the in-process ranks of one
//! test over in-memory channels, found through the communicator's key
//! prefix. It runs barrier, broadcast, all_gather and all_reduce (sum,
//! product, min, max). Registered by the tests that use it
//! (`tests/custom_backend.rs` as itself, `tests/ordering.rs` inside its
//! recording `lognet`).

use std::collections::HashMap;
use std::sync::{LazyLock, Mutex};

use chorus::backends::{async_trait, Backend, BackendInit, OpCtx, OpData};
use chorus::{Error, ReduceOp, Result, Tensor};
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver, UnboundedSender};

/// One message on a link: the sequence number stamped by the sender
/// (headers) or `u64::MAX` (data), and the bytes.
type Msg = (u64, Vec<u8>);
type Ends = (Option<UnboundedSender<Msg>>, Option<UnboundedReceiver<Msg>>);

/// Links by (key prefix, from, to); created by whichever end comes first.
type Links = HashMap<(String, usize, usize), Ends>;
static HUB: LazyLock<Mutex<Links>> = LazyLock::new(|| Mutex::new(HashMap::new()));

pub struct MemNet {
    rank: usize,
    to: Vec<Option<UnboundedSender<Msg>>>,
    from: Vec<Option<UnboundedReceiver<Msg>>>,
}

impl MemNet {
    /// Connect rank `init.rank` to every other rank of `init.key_prefix`.
    pub fn connect(init: &BackendInit) -> MemNet {
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
                comm: ctx.comm.to_string(),
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
