//! Running one step's transfers over TCP links: every (peer, direction)
//! at once, frames in list order per (peer, direction).
//!
//! Two ways to wait. An op polled by a task (an awaited op, or any op on a
//! runtime worker) waits through tokio's reactor, like any socket. An op
//! whose caller blocks on it (`OpCtx::may_block`, the turn runs on that
//! caller's own thread) takes the latency path once every send of the step
//! has been written: it waits for its receives on that thread, reading
//! the sockets itself (`link::direct`), so an arriving message wakes the
//! waiting thread directly instead of the reactor's thread first. This
//! removes a wake-up and a thread hop per message; the measured effect is
//! in docs/performance.md ("The TCP latency path").
//!
//! # Invariants
//! - TX-1: the frames of one (peer, direction) go in list order; on the
//!   first error the receives are dropped and the sends get
//!   [`DRAIN_BOUND`] to finish their frame ([CPU-3]).
//! - TX-2: the latency path runs only on a thread that may block
//!   (`may_block`, SX-3's rule for the shared-memory engine), only for a
//!   step that receives less than [`CHECK_BYTES`](crate::pace::CHECK_BYTES)
//!   in all (so a pending receive is always waiting for its socket, never
//!   for its own pacing, PA-2), and only while every send of the step is
//!   done, so a blocked wait never holds back this rank's own sends. It
//!   polls the sockets it waits for
//!   ([`SPIN_FOR`], only when the communicator has no more ranks than this
//!   process has CPUs), then sleeps in `ppoll` on them, and returns to the
//!   runtime at least every [`ROUND`], so aborts and op timeouts fire
//!   (PA-3).
//!
//! Memory: O(the step's peers) per step.
//!
//! [CPU-3]: super#invariants

use std::future::Future;
use std::os::fd::RawFd;
use std::pin::Pin;
use std::task::Poll;
use std::time::{Duration, Instant};

use futures::stream::{FuturesUnordered, StreamExt};

use super::link::direct::{wait_readable, Switch};
use super::link::{FrameClass, LinkReader, LinkWriter, RecvFrames, SendFrames};
use crate::backends::OpCtx;
use crate::error::Result;
use crate::pace::Pacer;

type BoxFut<'a> = Pin<Box<dyn Future<Output = Result<()>> + Send + 'a>>;
/// One peer's receives: its socket, its reader's direct switch, and the
/// future (`None` once done).
type Recv<'a> = (RawFd, Switch, Option<BoxFut<'a>>);

/// How long a failed step's sends may take to finish their frame ([TX-1]).
///
/// [TX-1]: self#invariants
pub(crate) const DRAIN_BOUND: Duration = Duration::from_secs(1);
/// How long the latency path polls before it first sleeps ([TX-2]): about
/// a loopback round trip on a virtual machine.
///
/// [TX-2]: self#invariants
const SPIN_FOR: Duration = Duration::from_micros(50);
/// Longest time the latency path blocks before returning to the runtime
/// ([TX-2]).
///
/// [TX-2]: self#invariants
const ROUND: Duration = Duration::from_millis(1);

/// How a step may wait ([TX-2]).
///
/// [TX-2]: self#invariants
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Wait {
    /// The turn runs on its caller's own thread, which may block, and no
    /// other kind of transfer of this step needs the thread meanwhile.
    pub(crate) may_block: bool,
    /// The blocked caller may poll before it sleeps (each rank can have a
    /// CPU).
    pub(crate) spin: bool,
}

/// Run `sends` and `recvs` over the links of their peers: `writers` and
/// `readers` hold exactly those links, one entry per peer, in the order
/// of `sends` and `recvs` (a `None` link is `PeerFailed`); `how` says
/// whether the latency path may run ([TX-2]).
///
/// [TX-2]: self#invariants
pub(crate) async fn run_tcp<'a>(
    writers: Vec<(usize, Option<&'a mut LinkWriter>)>,
    readers: Vec<(usize, Option<&'a mut LinkReader>)>,
    ctx: &'a OpCtx,
    class: FrameClass,
    sends: Vec<(usize, SendFrames<'a>)>,
    recvs: Vec<(usize, RecvFrames<'a>)>,
    how: Wait,
) -> Result<()> {
    // TX-2: small steps only: a receive under CHECK_BYTES never yields to
    // pace itself (PA-2), so a pending receive always waits for its socket.
    let direct = how.may_block
        && recvs
            .iter()
            .flat_map(|(_, frames)| frames.iter())
            .try_fold(0usize, |acc, (_, _, into)| {
                Some(acc.saturating_add(into.capacity())).filter(|&n| n < crate::pace::CHECK_BYTES)
            })
            .is_some();
    let mut send_futs: FuturesUnordered<BoxFut<'a>> = FuturesUnordered::new();
    for ((peer, frames), (_, w)) in sends.into_iter().zip(writers) {
        let Some(w) = w else {
            return Err(ctx.peer_failed(vec![peer], format!("no link to rank {peer}")));
        };
        send_futs.push(Box::pin(async move {
            // CPU-5: one pacer per (peer, direction), across its frames.
            let mut pace = Pacer::new();
            for (kind, tag, payload) in frames {
                w.send_paced(ctx, kind, class, tag, payload, &mut pace)
                    .await?;
            }
            Ok(())
        }));
    }
    let mut recv_futs: Vec<Recv<'a>> = Vec::with_capacity(recvs.len());
    for ((peer, frames), (_, r)) in recvs.into_iter().zip(readers) {
        let Some(r) = r else {
            return Err(ctx.peer_failed(vec![peer], format!("no link to rank {peer}")));
        };
        let (fd, switch) = (r.fd(), r.direct_switch());
        recv_futs.push((
            fd,
            switch,
            Some(Box::pin(async move {
                let mut pace = Pacer::new();
                for (kind, tag, into) in frames {
                    r.recv_paced(ctx, kind, class, tag, into, &mut pace).await?;
                }
                Ok(())
            })),
        ));
    }
    let res = drive(&mut send_futs, &mut recv_futs, direct, how.spin).await;
    if let Err(e) = res {
        drop(recv_futs);
        let _ = tokio::time::timeout(DRAIN_BOUND, async {
            while send_futs.next().await.is_some() {}
        })
        .await;
        return Err(e);
    }
    Ok(())
}

/// Poll the step's transfers until all are done or one fails; with
/// `direct`, wait for receives on this thread once the sends are done
/// ([TX-2]).
///
/// [TX-2]: self#invariants
async fn drive<'a>(
    sends: &mut FuturesUnordered<BoxFut<'a>>,
    recvs: &mut [Recv<'a>],
    direct: bool,
    spin: bool,
) -> Result<()> {
    let mut round = Instant::now();
    let mut spin_since: Option<Instant> = None;
    let mut fds: Vec<RawFd> = Vec::new();
    std::future::poll_fn(|cx| loop {
        while let Poll::Ready(Some(r)) = sends.poll_next_unpin(cx) {
            if let Err(e) = r {
                return Poll::Ready(Err(e));
            }
        }
        let mut waiting = 0usize;
        let mut moved = false;
        // DR-1: straight from the socket, without a waker, only where this
        // loop will poll again itself.
        let direct_now = direct && sends.is_empty();
        // DR-3: while this loop polls, the reactor need not hear of what it
        // reads itself; the socket stays quiet between blocking ops, until
        // something waits on it (and is not quieted again after its first
        // sleep, so a long wait costs no socket option calls).
        let quieting = direct_now && spin && spin_since.is_none_or(|t| t.elapsed() < SPIN_FOR);
        for (fd, switch, slot) in recvs.iter_mut() {
            if let Some(f) = slot {
                if quieting {
                    switch.quiet(*fd);
                }
                switch.set_direct(direct_now);
                let r = f.as_mut().poll(cx);
                switch.set_direct(false);
                match r {
                    Poll::Ready(Ok(())) => {
                        *slot = None;
                        moved = true;
                    }
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => waiting += 1,
                }
            }
        }
        if sends.is_empty() && waiting == 0 {
            return Poll::Ready(Ok(()));
        }
        if !direct_now {
            return Poll::Pending;
        }
        if moved {
            spin_since = None;
        }
        let elapsed = round.elapsed();
        if elapsed >= ROUND {
            // PA-3: back to the turn, which reads the abort signal and
            // polls again at once.
            round = Instant::now();
            cx.waker().wake_by_ref();
            return Poll::Pending;
        }
        if spin && spin_since.get_or_insert_with(Instant::now).elapsed() < SPIN_FOR {
            std::hint::spin_loop();
            continue;
        }
        fds.clear();
        fds.extend(
            recvs
                .iter()
                .filter(|(_, _, f)| f.is_some())
                .map(|(fd, _, _)| *fd),
        );
        // DR-3: readable again before sleeping on it.
        for (fd, switch, f) in recvs.iter() {
            if f.is_some() {
                switch.wake(*fd);
            }
        }
        wait_readable(&fds, ROUND - elapsed);
    })
    .await
}
