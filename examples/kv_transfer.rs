//! KV-cache push with one-sided windows: rank 0 (the "prefill" side)
//! writes a model's key/value cache layer by layer into rank 1's window
//! (the "decode" side) with `put`, and signals after each layer; rank 1
//! waits for each layer's signal and checks it, without ever posting a
//! receive. The same pattern pushes updated parameters to a serving rank.
//!
//! Every rank takes part in `new_window` (it is collective); ranks other
//! than 0 and 1 only hold an (unused) window. Run it on 2 local ranks from
//! the repository root:
//!
//! ```text
//! ./scripts/run-example.sh kv_transfer 2
//! ```
//!
//! Same-host ranks write into each other's shared memory; with
//! `CHORUS_SHM=0` (or ranks on different hosts) the puts go over TCP.
//! The backend is `CHORUS_BACKEND` (default `cpu`; the only one with
//! windows today).

use std::process::ExitCode;
use std::time::Instant;

use chorus::{new_comm, CommOptions, DType, Device, Tensor};

/// Layers of the toy model, and f32 values per K (or V) block of a layer:
/// 2 heads × 128 tokens × 64 dims.
const LAYERS: usize = 8;
const BLOCK: usize = 2 * 128 * 64;

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("kv_transfer: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The value the sender writes at element `i` of layer `layer`'s K (`kv`
/// 0) or V (`kv` 1) block.
fn expected(layer: usize, kv: usize, i: usize) -> f32 {
    (layer * 1000 + kv * 100) as f32 + (i % 97) as f32
}

fn run() -> Res<()> {
    let backend = std::env::var("CHORUS_BACKEND").unwrap_or_else(|_| "cpu".into());
    let comm = new_comm(&backend, Device::Cpu, "world", CommOptions::default())?;
    let (rank, n) = (comm.rank(), comm.size());
    if n < 2 {
        return Err("needs at least 2 ranks: run it under `chorus-run -n 2` or more".into());
    }
    let block_bytes = BLOCK * DType::F32.size();
    let layer_bytes = 2 * block_bytes;
    // Only the receiver needs room; the others expose an empty window.
    let size = if rank == 1 { LAYERS * layer_bytes } else { 0 };
    let win = comm.new_window(size)?;
    // Unified: rank 1's window is mapped here (same host); Separate: TCP.
    let access = win.get_attr(1)?.access_type;

    let t0 = Instant::now();
    match rank {
        0 => {
            let mut k = Tensor::zeros(DType::F32, BLOCK);
            let mut v = Tensor::zeros(DType::F32, BLOCK);
            for layer in 0..LAYERS {
                // "Compute" this layer's cache, then push it as soon as it is ready.
                for (i, x) in k.as_mut_slice::<f32>().iter_mut().enumerate() {
                    *x = expected(layer, 0, i);
                }
                for (i, x) in v.as_mut_slice::<f32>().iter_mut().enumerate() {
                    *x = expected(layer, 1, i);
                }
                let base = layer * layer_bytes;
                let pk = win.put_async(k, 1, base);
                let pv = win.put_async(v, 1, base + block_bytes);
                // One signal per layer: delivered after both puts.
                let sig = win.signal_async(1, 1);
                k = pk.wait()?;
                v = pv.wait()?;
                sig.wait()?;
            }
            let mib = (LAYERS * layer_bytes) as f64 / (1 << 20) as f64;
            println!(
                "rank 0/{n}: pushed {LAYERS} layers ({mib:.1} MiB) into rank 1's window \
                 ({access:?} access) in {:?} ok",
                t0.elapsed()
            );
        }
        1 => {
            for layer in 0..LAYERS {
                // The counter counts layers: wait until `layer + 1` arrived.
                win.wait_signal(0, layer as u64 + 1)?;
                for kv in 0..2 {
                    let offset = layer * layer_bytes + kv * block_bytes;
                    let got = win.read_tensor(DType::F32, offset, BLOCK)?;
                    let bad = got
                        .as_slice::<f32>()
                        .iter()
                        .enumerate()
                        .find(|(i, x)| **x != expected(layer, kv, *i));
                    if let Some((i, x)) = bad {
                        return Err(format!(
                            "rank 1: layer {layer} {} element {i} is {x}, expected {}",
                            ["K", "V"][kv],
                            expected(layer, kv, i)
                        )
                        .into());
                    }
                }
            }
            println!(
                "rank 1/{n}: received and verified {LAYERS} layers in {:?} ok",
                t0.elapsed()
            );
        }
        _ => println!("rank {rank}/{n}: holds an empty window, nothing to move ok"),
    }
    comm.barrier()?;
    comm.finalize()?;
    Ok(())
}
