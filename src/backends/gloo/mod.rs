//! The `gloo` backend: Facebook's Gloo (Debian's `libgloo-dev`, TCP
//! transport) through a small C++ shim (`shim.cc`, built by `build.rs`)
//! called over a C ABI.
//!
//! # Invariants
//! - GL-1: no C++ exception crosses into Rust: every shim call returns a
//!   status and an error message, mapped to a typed [`Error`] with context.
//! - GL-2: Gloo's rendezvous goes through Chorus's store (callbacks into
//!   Rust, keys under `{key_prefix}/gloo/`), so it shares the job secret
//!   and the store's scoping by communicator and epoch.
//! - GL-3: the Gloo context lives on the communicator's vendor worker
//!   thread (`super::vendor`, VW-1): it is connected, used and freed there,
//!   and ops block that thread, never a runtime thread, with Gloo's own
//!   timeout ([`OP_TIMEOUT`] or `connect_timeout`, whichever is larger). So
//!   a dead peer fails the op instead of blocking the worker forever, and a
//!   worker left in a call by `abort` (VW-2) ends within that timeout.
//! - GL-4: reductions are typed in the shim (all ops incl. bitwise, which
//!   Gloo itself lacks); f16/bf16 reductions are done in f32 (exact for
//!   every value they hold) and rounded back once; reduce-scatter is an
//!   all-reduce followed by a local copy of this rank's block.
//! - GL-5: header exchange, abort notices and finalize run over a
//!   `CpuBackend` control mesh, like every vendor backend (the shared
//!   `super::vendor::VendorBackend`). Gloo has no abort: `abort` stops
//!   using the context, which the worker frees when it ends.

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::sync::Arc;
use std::time::Duration;

use super::vendor::{VendorBackend, VendorComm};
use super::{BackendInit, OpCtx, OpData};
use crate::error::{Error, Result};
use crate::op::ReduceOp;
use crate::tensor::{DType, Tensor};
use crate::transport::Store;

/// Lower bound of Gloo's per-op timeout ([GL-3]).
///
/// [GL-3]: self#invariants
pub const OP_TIMEOUT: Duration = Duration::from_secs(60);

#[repr(C)]
struct GlooCtx {
    _opaque: [u8; 0],
}

type SetFn = unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char, usize) -> c_int;
type SinkFn = unsafe extern "C" fn(*mut c_void, *const c_char, usize);
type GetFn = unsafe extern "C" fn(*mut c_void, *const c_char, *mut c_void, SinkFn) -> c_int;

extern "C" {
    fn chorus_gloo_connect(
        bind_ip: *const c_char,
        rank: c_int,
        size: c_int,
        timeout_ms: i64,
        ud: *mut c_void,
        set: SetFn,
        get: GetFn,
        out: *mut *mut GlooCtx,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
    fn chorus_gloo_free(g: *mut GlooCtx);
    fn chorus_gloo_allreduce(
        g: *mut GlooCtx,
        buf: *mut c_void,
        count: usize,
        dtype: c_int,
        op: c_int,
        tag: u32,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
    fn chorus_gloo_reduce(
        g: *mut GlooCtx,
        inp: *const c_void,
        out: *mut c_void,
        count: usize,
        dtype: c_int,
        op: c_int,
        root: c_int,
        tag: u32,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
    fn chorus_gloo_broadcast(
        g: *mut GlooCtx,
        buf: *mut c_void,
        bytes: usize,
        root: c_int,
        tag: u32,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
    fn chorus_gloo_allgatherv(
        g: *mut GlooCtx,
        inp: *const c_void,
        in_bytes: usize,
        out: *mut c_void,
        out_bytes: *const usize,
        n: usize,
        tag: u32,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
    fn chorus_gloo_gather(
        g: *mut GlooCtx,
        inp: *const c_void,
        bytes: usize,
        out: *mut c_void,
        root: c_int,
        tag: u32,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
    fn chorus_gloo_scatter(
        g: *mut GlooCtx,
        inp: *const c_void,
        out: *mut c_void,
        bytes: usize,
        root: c_int,
        tag: u32,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
    fn chorus_gloo_alltoallv(
        g: *mut GlooCtx,
        inp: *const c_void,
        in_bytes: *const i64,
        out: *mut c_void,
        out_bytes: *const i64,
        n: usize,
        tag: u32,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
    fn chorus_gloo_p2p(
        g: *mut GlooCtx,
        n: usize,
        bufs: *const *mut c_void,
        bytes: *const usize,
        peers: *const c_int,
        is_send: *const c_int,
        slot: u64,
        err: *mut c_char,
        errlen: usize,
    ) -> c_int;
}

/// What the store callbacks need; lives on the connecting thread's stack.
struct StoreCtx {
    store: Arc<dyn Store>,
    handle: tokio::runtime::Handle,
    prefix: String,
    timeout: Duration,
}

unsafe extern "C" fn store_set(
    ud: *mut c_void,
    key: *const c_char,
    data: *const c_char,
    len: usize,
) -> c_int {
    // SAFETY: `ud` is the StoreCtx passed to chorus_gloo_connect, alive for
    // the whole call; key is NUL-terminated; data has `len` bytes.
    let s = &*(ud as *const StoreCtx);
    let key = format!("{}/{}", s.prefix, CStr::from_ptr(key).to_string_lossy());
    let bytes = if len == 0 {
        Vec::new()
    } else {
        std::slice::from_raw_parts(data as *const u8, len).to_vec()
    };
    match s.handle.block_on(s.store.set(&key, bytes)) {
        Ok(()) => 0,
        Err(e) => {
            tracing::warn!(key, "gloo rendezvous set failed: {e}");
            1
        }
    }
}

unsafe extern "C" fn store_get(
    ud: *mut c_void,
    key: *const c_char,
    sink: *mut c_void,
    f: SinkFn,
) -> c_int {
    // SAFETY: as in `store_set`; `sink`/`f` come from the shim.
    let s = &*(ud as *const StoreCtx);
    let key = format!("{}/{}", s.prefix, CStr::from_ptr(key).to_string_lossy());
    match s
        .handle
        .block_on(s.store.wait(std::slice::from_ref(&key), s.timeout))
    {
        Ok(v) => {
            let data = v.into_iter().next().unwrap_or_default();
            f(sink, data.as_ptr() as *const c_char, data.len());
            0
        }
        Err(e) => {
            tracing::warn!(key, "gloo rendezvous get failed: {e}");
            1
        }
    }
}

/// The Gloo context of one communicator on one rank, owned by its vendor
/// worker thread: connected, used and freed there ([GL-3], VW-1).
///
/// [GL-3]: self#invariants
pub(crate) struct GlooComm {
    g: *mut GlooCtx,
    rank: usize,
}

/// The Gloo backend of one communicator on one rank.
pub(crate) type GlooBackend = VendorBackend<GlooComm>;

const ERRLEN: usize = 512;

/// Call a shim function with an error buffer; [GL-1].
///
/// [GL-1]: self#invariants
fn call(
    what: &'static str,
    f: impl FnOnce(*mut c_char, usize) -> c_int,
) -> std::result::Result<(), String> {
    let mut err = vec![0 as c_char; ERRLEN];
    let rc = f(err.as_mut_ptr(), ERRLEN);
    if rc == 0 {
        return Ok(());
    }
    // SAFETY: the shim always NUL-terminates within ERRLEN.
    let msg = unsafe { CStr::from_ptr(err.as_ptr()) }
        .to_string_lossy()
        .into_owned();
    Err(format!("gloo {what}: {msg}"))
}

/// Shim op code of a combining op ([GL-4]).
///
/// [GL-4]: self#invariants
fn op_code(op: ReduceOp) -> c_int {
    match op.combine_op() {
        ReduceOp::Product => 1,
        ReduceOp::Min => 2,
        ReduceOp::Max => 3,
        ReduceOp::BAnd => 4,
        ReduceOp::BOr => 5,
        ReduceOp::BXor => 6,
        _ => 0,
    }
}

fn is_half(d: DType) -> bool {
    matches!(d, DType::F16 | DType::BF16)
}

/// f16/bf16 tensors are reduced as f32 ([GL-4]).
///
/// [GL-4]: self#invariants
fn widen(t: &Tensor) -> Tensor {
    let v: Vec<f64> = t.to_f64_vec();
    Tensor::from_f64s(DType::F32, &v)
}

fn narrow(dtype: DType, t: &Tensor) -> Tensor {
    Tensor::from_f64s(dtype, &t.to_f64_vec())
}

/// Start the worker thread, connect Gloo's full mesh on it through the
/// store ([GL-2]), then the control mesh.
///
/// # Errors
/// `PeerFailed` if Gloo cannot connect; control-mesh errors as `cpu`.
///
/// [GL-2]: self#invariants
pub(crate) async fn connect(init: BackendInit) -> Result<GlooBackend> {
    let timeout = init.connect_timeout.max(Duration::from_secs(1));
    let op_timeout = OP_TIMEOUT.max(init.connect_timeout);
    let handle = tokio::runtime::Handle::try_current().map_err(|e| {
        Error::Internal(format!(
            "gloo connect needs a tokio runtime for the store: {e}"
        ))
    })?;
    let sctx = StoreCtx {
        store: init.store.clone(),
        handle,
        prefix: format!("{}/gloo", init.key_prefix),
        timeout,
    };
    let ip = CString::new(init.bind_ip.to_string())
        .map_err(|e| Error::Config(format!("bind ip: {e}")))?;
    let (comm, rank, size, epoch) = (init.comm.clone(), init.rank, init.size, init.epoch);
    VendorBackend::connect(init, move || {
        let mut out: *mut GlooCtx = std::ptr::null_mut();
        call("connect", |err, len| {
            // SAFETY: sctx outlives the call; callbacks match the shim's
            // typedefs; `out` is a valid out-parameter.
            unsafe {
                chorus_gloo_connect(
                    ip.as_ptr(),
                    rank as c_int,
                    size as c_int,
                    op_timeout.as_millis() as i64,
                    &sctx as *const StoreCtx as *mut c_void,
                    store_set,
                    store_get,
                    &mut out,
                    err,
                    len,
                )
            }
        })
        .map_err(|detail| Error::PeerFailed {
            comm,
            rank,
            epoch,
            op: "new_comm",
            failed_ranks: vec![],
            detail,
        })?;
        Ok(GlooComm { g: out, rank })
    })
    .await
}

fn all_reduce(
    g: *mut GlooCtx,
    buf: &mut Tensor,
    op: ReduceOp,
    tag: u32,
) -> std::result::Result<(), String> {
    let dtype = buf.dtype();
    if is_half(dtype) {
        let mut w = widen(buf);
        all_reduce(g, &mut w, op, tag)?;
        *buf = narrow(dtype, &w);
        return Ok(());
    }
    let n = buf.len();
    let p = buf.as_bytes_mut().as_mut_ptr() as *mut c_void;
    // SAFETY: `p` holds `n` elements of `dtype`.
    call("allreduce", |e, l| unsafe {
        chorus_gloo_allreduce(g, p, n, dtype.code() as c_int, op_code(op), tag, e, l)
    })
}

impl GlooComm {
    fn run_op(&self, ctx: &OpCtx, data: &mut OpData) -> std::result::Result<(), String> {
        let g = self.g;
        let tag = ctx.seq as u32;
        let me = self.rank;
        match data {
            OpData::AllToAllList { .. } => Err("the list all_to_all reaches this backend as an all_to_all over the concatenated lists (Capabilities::list_all_to_all)".into()),
            OpData::AllReduce { buf, op } => all_reduce(g, buf, *op, tag),
            OpData::Reduce { buf, op, root } => {
                let dtype = buf.dtype();
                let mut work = if is_half(dtype) {
                    widen(buf)
                } else {
                    buf.clone()
                };
                let input = work.clone();
                let n = work.len();
                let dt = work.dtype().code() as c_int;
                let (ip, op_) = (input.as_bytes().as_ptr() as *const c_void, op_code(*op));
                let outp = work.as_bytes_mut().as_mut_ptr() as *mut c_void;
                // SAFETY: both buffers hold `n` elements.
                call("reduce", |e, l| unsafe {
                    chorus_gloo_reduce(g, ip, outp, n, dt, op_, *root as c_int, tag, e, l)
                })?;
                if me == *root {
                    *buf = if is_half(dtype) {
                        narrow(dtype, &work)
                    } else {
                        work
                    };
                }
                Ok(())
            }
            OpData::ReduceScatter {
                input,
                output,
                counts,
                op,
            } => {
                all_reduce(g, input, *op, tag)?;
                super::vendor::keep_own_block(input, output, counts, me);
                Ok(())
            }
            OpData::AllGather {
                input,
                output,
                counts,
                ..
            } => {
                let es = input.dtype().size();
                let out_bytes: Vec<usize> = counts.iter().map(|c| c * es).collect();
                let (ip, il) = (
                    input.as_bytes().as_ptr() as *const c_void,
                    input.len_bytes(),
                );
                let op = output.as_bytes_mut().as_mut_ptr() as *mut c_void;
                // SAFETY: output holds sum(out_bytes) bytes.
                call("allgatherv", |e, l| unsafe {
                    chorus_gloo_allgatherv(
                        g,
                        ip,
                        il,
                        op,
                        out_bytes.as_ptr(),
                        out_bytes.len(),
                        tag,
                        e,
                        l,
                    )
                })
            }
            OpData::Broadcast { buf, root } => {
                let n = buf.len_bytes();
                let p = buf.as_bytes_mut().as_mut_ptr() as *mut c_void;
                // SAFETY: `p` holds `n` bytes.
                call("broadcast", |e, l| unsafe {
                    chorus_gloo_broadcast(g, p, n, *root as c_int, tag, e, l)
                })
            }
            OpData::Scatter {
                input,
                output,
                root,
            } => {
                let n = output.len_bytes();
                let ip = input.as_bytes().as_ptr() as *const c_void;
                let op = output.as_bytes_mut().as_mut_ptr() as *mut c_void;
                // SAFETY: on root input holds size*n bytes; output n bytes.
                call("scatter", |e, l| unsafe {
                    chorus_gloo_scatter(g, ip, op, n, *root as c_int, tag, e, l)
                })
            }
            OpData::Gather {
                input,
                output,
                root,
            } => {
                let n = input.len_bytes();
                let ip = input.as_bytes().as_ptr() as *const c_void;
                let op = output.as_bytes_mut().as_mut_ptr() as *mut c_void;
                // SAFETY: on root output holds size*n bytes.
                call("gather", |e, l| unsafe {
                    chorus_gloo_gather(g, ip, n, op, *root as c_int, tag, e, l)
                })
            }
            OpData::AllToAll {
                input,
                output,
                send_counts,
                recv_counts,
            } => {
                let es = input.dtype().size() as i64;
                let sb: Vec<i64> = send_counts.iter().map(|&c| c as i64 * es).collect();
                let rb: Vec<i64> = recv_counts.iter().map(|&c| c as i64 * es).collect();
                let ip = input.as_bytes().as_ptr() as *const c_void;
                let op = output.as_bytes_mut().as_mut_ptr() as *mut c_void;
                // SAFETY: buffers hold sum(sb) and sum(rb) bytes.
                call("alltoallv", |e, l| unsafe {
                    chorus_gloo_alltoallv(g, ip, sb.as_ptr(), op, rb.as_ptr(), sb.len(), tag, e, l)
                })
            }
            OpData::Barrier => Ok(()),
            OpData::P2P { ops } => {
                if ops.is_empty() {
                    return Ok(());
                }
                let slot = ops[0].seq;
                let mut bufs = Vec::with_capacity(ops.len());
                let mut bytes = Vec::with_capacity(ops.len());
                let mut peers = Vec::with_capacity(ops.len());
                let mut sends = Vec::with_capacity(ops.len());
                for t in ops.iter_mut() {
                    bytes.push(t.buf.len_bytes());
                    peers.push(t.peer as c_int);
                    sends.push(c_int::from(t.send));
                    bufs.push(t.buf.as_bytes_mut().as_mut_ptr() as *mut c_void);
                }
                // SAFETY: every buffer holds its byte count and stays alive.
                call("p2p", |e, l| unsafe {
                    chorus_gloo_p2p(
                        g,
                        bufs.len(),
                        bufs.as_ptr(),
                        bytes.as_ptr(),
                        peers.as_ptr(),
                        sends.as_ptr(),
                        slot,
                        e,
                        l,
                    )
                })
            }
        }
    }
}

impl VendorComm for GlooComm {
    const NAME: &'static str = "gloo";
    // Gloo contexts rendezvous through Chorus's store: a child or a new
    // epoch is a new context of its own size.
    const CAPABILITIES: super::Capabilities = super::Capabilities {
        split: super::SplitMode::Reconnect,
        elastic: true,
        in_place_all_gather: false,
        in_band_checks: false,
        list_all_to_all: false,
        // The exchange stays, as a guard: Gloo's TCP pair calls
        // std::terminate when a message is longer than the receive posted
        // for it, so ranks whose sizes disagree must be stopped before
        // Gloo is called (docs/backends.md, "Control mesh").
        headerless_ops: false,
    };

    fn run(&mut self, ctx: &OpCtx, data: &mut OpData) -> Result<()> {
        self.run_op(ctx, data)
            .map_err(|detail| ctx.peer_failed(vec![], detail))
    }

    fn close(self, _aborted: bool) {
        // Freed by Drop, on this (the worker) thread: Gloo has no abort.
    }
}

impl Drop for GlooComm {
    fn drop(&mut self) {
        if !self.g.is_null() {
            // SAFETY: created by chorus_gloo_connect, freed once; the shim
            // swallows exceptions from the destructor.
            unsafe { chorus_gloo_free(self.g) };
            self.g = std::ptr::null_mut();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_codes_match_the_shim() {
        assert_eq!(op_code(ReduceOp::Sum), 0);
        assert_eq!(op_code(ReduceOp::PremulSum(2.0)), 0);
        assert_eq!(op_code(ReduceOp::Avg), 0);
        assert_eq!(op_code(ReduceOp::Product), 1);
        assert_eq!(op_code(ReduceOp::BXor), 6);
        // The shim's dtype codes are chorus's DType::code.
        assert_eq!(DType::F32.code(), 2);
        assert_eq!(DType::U64.code(), 9);
    }
}
