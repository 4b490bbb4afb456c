//! Running one step's transfers over TCP links: every (peer, direction)
//! at once, frames in list order per (peer, direction).
//!
//! Two ways to wait. An op polled by a task (an awaited op, or any op on a
//! runtime the caller gave) waits through tokio's reactor, like any
//! socket. An op whose caller blocks on it (`OpCtx::may_block`: the turn
//! runs on a thread that may sleep in the kernel) takes the direct path:
//! that thread reads and writes the step's sockets itself (`link::direct`)
//! and, when none is ready, waits for them in `ppoll`, so the kernel wakes
//! it directly instead of waking the reactor's thread first. This removes
//! a wake-up and a thread hop each time a socket runs dry or its send
//! buffer fills: per message for small ops, many times per frame for
//! large ones. The measured effect is in docs/performance.md ("The TCP
//! latency path", "The TCP bandwidth path").
//!
//! # Invariants
//! - TX-1: the frames of one (peer, direction) go in list order; on the
//!   first error the receives are dropped and the sends get
//!   [`DRAIN_BOUND`] to finish their frame ([CPU-3]).
//! - TX-2: the direct path runs only on a thread that may block
//!   (`may_block`, SX-3's rule for the shared-memory engine). It polls
//!   every pending send and receive of the step, sleeps only when a whole
//!   pass moved no byte and no transfer yielded, and then waits for the
//!   readiness of exactly the pending transfers (readable for receives,
//!   writable for sends), so a blocked wait never holds back this rank's
//!   own sends. It polls ([`SPIN_FOR`] since the last byte moved, only
//!   when the communicator has no more ranks than this process has CPUs)
//!   before it sleeps, and returns to the runtime at least every
//!   [`ROUND`], so aborts and op timeouts fire (PA-3), and whenever a
//!   transfer's pacer yields (PA-1).
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

use super::link::direct::{moved, wait_ready, Switch};
use super::link::{FrameClass, LinkReader, LinkWriter, Recvs, Sends};
use crate::backends::OpCtx;
use crate::error::Result;
use crate::pace::Pacer;

type BoxFut<'a> = Pin<Box<dyn Future<Output = Result<()>> + Send + 'a>>;
/// One peer's transfers in one direction: its socket, its half's direct
/// switch, and the future (`None` once done).
type Xfer<'a> = (RawFd, Switch, Option<BoxFut<'a>>);

/// How long a failed step's sends may take to finish their frame ([TX-1]).
///
/// [TX-1]: self#invariants
pub(crate) const DRAIN_BOUND: Duration = Duration::from_secs(1);
/// How long the direct path polls before it sleeps ([TX-2]): about a
/// loopback round trip on a virtual machine.
///
/// [TX-2]: self#invariants
const SPIN_FOR: Duration = Duration::from_micros(50);
/// Longest time the direct path keeps the thread before returning to the
/// runtime ([TX-2]).
///
/// [TX-2]: self#invariants
const ROUND: Duration = Duration::from_millis(1);

/// How a step may wait ([TX-2]).
///
/// [TX-2]: self#invariants
#[derive(Debug, Clone, Copy, Default)]
pub(crate) struct Wait {
    /// The turn runs on a thread that may block, and no other kind of
    /// transfer of this step needs the thread meanwhile.
    pub(crate) may_block: bool,
    /// The blocked caller may poll before it sleeps (each rank can have a
    /// CPU).
    pub(crate) spin: bool,
}

/// Run `sends` and `recvs` over the links of their peers: `writers` and
/// `readers` hold exactly those links, one entry per peer, in the order
/// of `sends` and `recvs` (a `None` link is `PeerFailed`); `how` says
/// whether the direct path may run ([TX-2]).
///
/// [TX-2]: self#invariants
pub(crate) async fn run_tcp<'a>(
    writers: Vec<(usize, Option<&'a mut LinkWriter>)>,
    readers: Vec<(usize, Option<&'a mut LinkReader>)>,
    ctx: &'a OpCtx,
    class: FrameClass,
    sends: Sends<'a>,
    recvs: Recvs<'a>,
    how: Wait,
) -> Result<()> {
    // A link that carries data both ways in this step writes smaller
    // pieces (`EXCHANGE_UNIT`): the peers this step receives from, sorted,
    // O(P log P) for the step's P peers.
    let mut from: smallvec::SmallVec<[usize; 4]> = recvs
        .iter()
        .filter(|(_, f)| !f.is_empty())
        .map(|(p, _)| *p)
        .collect();
    from.sort_unstable();
    let mut send_futs: Vec<Xfer<'a>> = Vec::with_capacity(sends.len());
    for ((peer, frames), (_, w)) in sends.into_iter().zip(writers) {
        let Some(w) = w else {
            return Err(ctx.peer_failed(vec![peer], format!("no link to rank {peer}")));
        };
        w.set_exchange(from.binary_search(&peer).is_ok());
        let (fd, switch) = (w.fd(), w.direct_switch());
        send_futs.push((
            fd,
            switch,
            Some(Box::pin(async move {
                // CPU-5: one pacer per (peer, direction), across its frames.
                let mut pace = Pacer::new();
                for (kind, tag, payload) in frames {
                    w.send_paced(ctx, kind, class, tag, payload, &mut pace)
                        .await?;
                }
                // Writes outside a step (window ops) are one-way.
                w.set_exchange(false);
                Ok(())
            })),
        ));
    }
    let mut recv_futs: Vec<Xfer<'a>> = Vec::with_capacity(recvs.len());
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
    if how.may_block {
        let res = drive_direct(&mut send_futs, &mut recv_futs, how.spin).await;
        if let Err(e) = res {
            drop(recv_futs);
            drain(send_futs.into_iter().filter_map(|(_, _, f)| f).collect()).await;
            return Err(e);
        }
        return Ok(());
    }
    let mut sends: FuturesUnordered<BoxFut<'a>> =
        send_futs.into_iter().filter_map(|(_, _, f)| f).collect();
    let res = drive_reactor(&mut sends, &mut recv_futs).await;
    if let Err(e) = res {
        drop(recv_futs);
        drain(sends).await;
        return Err(e);
    }
    Ok(())
}

/// Give a failed step's sends [`DRAIN_BOUND`] to finish their frame
/// ([TX-1]), through the reactor.
///
/// [TX-1]: self#invariants
async fn drain(mut sends: FuturesUnordered<BoxFut<'_>>) {
    let _ =
        tokio::time::timeout(DRAIN_BOUND, async { while sends.next().await.is_some() {} }).await;
}

/// Poll the step's transfers through the reactor until all are done or
/// one fails.
async fn drive_reactor<'a>(
    sends: &mut FuturesUnordered<BoxFut<'a>>,
    recvs: &mut [Xfer<'a>],
) -> Result<()> {
    std::future::poll_fn(|cx| {
        while let Poll::Ready(Some(r)) = sends.poll_next_unpin(cx) {
            if let Err(e) = r {
                return Poll::Ready(Err(e));
            }
        }
        let mut waiting = 0usize;
        for (_, _, slot) in recvs.iter_mut() {
            if let Some(f) = slot {
                match f.as_mut().poll(cx) {
                    Poll::Ready(Ok(())) => *slot = None,
                    Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
                    Poll::Pending => waiting += 1,
                }
            }
        }
        if sends.is_empty() && waiting == 0 {
            Poll::Ready(Ok(()))
        } else {
            Poll::Pending
        }
    })
    .await
}

/// Poll one direction's pending transfers in direct mode (DR-1); `quiet`
/// first quiets the sockets (DR-3, receives only). Returns how many are
/// still pending.
fn poll_direct(
    xfers: &mut [Xfer<'_>],
    quiet: bool,
    cx: &mut std::task::Context<'_>,
) -> Result<usize> {
    let mut waiting = 0usize;
    for (fd, switch, slot) in xfers.iter_mut() {
        if let Some(f) = slot {
            if quiet {
                switch.quiet(*fd);
            }
            switch.set_direct(true);
            let r = f.as_mut().poll(cx);
            switch.set_direct(false);
            match r {
                Poll::Ready(Ok(())) => *slot = None,
                Poll::Ready(Err(e)) => {
                    // A finished future is never polled again (the drain).
                    *slot = None;
                    return Err(e);
                }
                Poll::Pending => waiting += 1,
            }
        }
    }
    Ok(waiting)
}

/// The sockets of the pending transfers in `xfers`.
fn pending_fds(xfers: &[Xfer<'_>], into: &mut Vec<RawFd>) {
    into.clear();
    into.extend(
        xfers
            .iter()
            .filter(|(_, _, f)| f.is_some())
            .map(|(fd, _, _)| *fd),
    );
}

/// Poll the step's transfers on this thread, reading and writing the
/// sockets directly, until all are done or one fails ([TX-2]).
///
/// [TX-2]: self#invariants
async fn drive_direct<'a>(
    sends: &mut [Xfer<'a>],
    recvs: &mut [Xfer<'a>],
    spin: bool,
) -> Result<()> {
    let mut round = Instant::now();
    let mut spin_since: Option<Instant> = None;
    let (mut rfds, mut wfds) = (Vec::new(), Vec::new());
    std::future::poll_fn(|cx| loop {
        let (bytes, yields) = (moved(), crate::pace::yields());
        // DR-3: while this loop polls, the reactor need not hear of what it
        // reads itself; the socket stays quiet between blocking ops, until
        // something waits on it (and is not quieted again after its first
        // sleep, so a long wait costs no socket option calls).
        let quieting = spin && spin_since.is_none_or(|t| t.elapsed() < SPIN_FOR);
        let pending = poll_direct(sends, false, cx)? + poll_direct(recvs, quieting, cx)?;
        if pending == 0 {
            return Poll::Ready(Ok(()));
        }
        if crate::pace::yields() != yields {
            // PA-1: a transfer gave the runtime back; its waker (deferred
            // by the runtime) polls this step again.
            round = Instant::now();
            return Poll::Pending;
        }
        if moved() != bytes {
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
        if moved() != bytes {
            continue;
        }
        if spin && spin_since.get_or_insert_with(Instant::now).elapsed() < SPIN_FOR {
            std::hint::spin_loop();
            continue;
        }
        pending_fds(recvs, &mut rfds);
        pending_fds(sends, &mut wfds);
        // DR-3: readable again before sleeping on it.
        for (fd, switch, f) in recvs.iter() {
            if f.is_some() {
                switch.wake(*fd);
            }
        }
        wait_ready(&rfds, &wfds, ROUND - elapsed);
    })
    .await
}
