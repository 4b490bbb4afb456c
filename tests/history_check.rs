//! The asynchronous history check: a backend that neither checks
//! fingerprints on its messages nor needs the header exchange runs a
//! mismatched op to completion (with wrong results), and the heartbeats'
//! history hashes still abort every rank with a `Mismatch`.

mod common;

use std::sync::Once;
use std::time::{Duration, Instant};

use chorus::backends::{async_trait, Backend, BackendInit, OpCtx, OpData};
use chorus::{Capabilities, Checks, Error, ReduceOp, Result, Tensor};
use common::memnet::MemNet;
use common::run_ranks_on;

/// `memnet` (tests/common/memnet.rs) saying that it runs ops without the
/// header exchange, so that nothing checks them but the heartbeats. Its
/// barrier does not synchronise, which the test below does not rely on.
struct Headerless(MemNet);

#[async_trait]
impl Backend for Headerless {
    fn name(&self) -> &'static str {
        "memnet-headerless"
    }

    fn capabilities(&self) -> Capabilities {
        Capabilities {
            headerless_ops: true,
            ..Default::default()
        }
    }

    async fn exchange_headers(
        &mut self,
        ctx: &OpCtx,
        outgoing: Vec<(usize, u64, Vec<u8>)>,
    ) -> Result<Vec<(usize, Vec<u8>)>> {
        self.0.exchange_headers(ctx, outgoing).await
    }

    async fn execute(&mut self, ctx: &OpCtx, data: &mut OpData) -> Result<()> {
        self.0.execute(ctx, data).await
    }

    async fn abort(&mut self, reason: &str, failed: &[usize]) {
        self.0.abort(reason, failed).await
    }

    async fn finalize(&mut self) {
        self.0.finalize().await
    }
}

fn register() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        chorus::register_backend(
            "memnet-headerless",
            |_device, init: BackendInit| async move {
                Ok(Box::new(Headerless(MemNet::connect(&init))) as Box<dyn Backend>)
            },
        )
        .expect("memnet-headerless registers");
    });
}

/// Rank 0 reduces with `Max`, the others with `Sum`: every rank's op
/// completes, each with its own result, and no message tells a rank. The
/// history hashes the ranks announce with their heartbeats (every 100 ms
/// here) differ from that op on, so every rank's communicator is aborted
/// with a fatal `Mismatch` within a few intervals; its next op fails with
/// that `Mismatch`, and later ones with `Aborted` carrying it.
#[test]
fn a_mismatch_no_message_reveals_aborts_every_rank_through_the_history_hashes() {
    register();
    run_ranks_on(
        "memnet-headerless",
        3,
        "history",
        |_r, o| {
            o.with_checks(Checks::Fingerprint)
                .with_heartbeat(Duration::from_millis(100), Duration::from_secs(20))
        },
        |comm| {
            let r = comm.rank();
            let op = if r == 0 { ReduceOp::Max } else { ReduceOp::Sum };
            let out = comm
                .all_reduce(Tensor::full(1.0f32 + r as f32, 4), op)
                .expect("the backend does not see the mismatch");
            assert_eq!(out.len(), 4);
            let start = Instant::now();
            while comm.is_active() {
                assert!(
                    start.elapsed() < Duration::from_secs(8),
                    "rank {r}: no abort after {:?}",
                    start.elapsed()
                );
                std::thread::yield_now();
            }
            let cause = comm
                .status()
                .cause
                .expect("an aborted communicator has a cause");
            assert!(
                matches!(cause, Error::Mismatch { fatal: true, .. }),
                "rank {r}: {cause}"
            );
            assert!(cause.to_string().contains("op #0"), "rank {r}: {cause}");
            // The next op is told the mismatch itself, the one after that
            // that the communicator was aborted by it.
            let e = comm
                .all_reduce(Tensor::full(1.0f32, 4), ReduceOp::Sum)
                .unwrap_err();
            assert!(
                matches!(e, Error::Mismatch { fatal: true, .. }),
                "rank {r}: {e}"
            );
            let e = comm
                .all_reduce(Tensor::full(1.0f32, 4), ReduceOp::Sum)
                .unwrap_err();
            assert!(matches!(e, Error::Aborted { .. }), "rank {r}: {e}");
            assert!(e.to_string().contains("differ"), "rank {r}: {e}");
        },
    );
}
