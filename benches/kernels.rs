//! Layer benchmarks for the cpu backend's pure parts: the reduction kernels
//! (throughput in bytes of `dst` per second) and schedule construction.
//!
//! Run with `cargo bench --bench kernels`; compare runs with critcmp.

use std::hint::black_box;
use std::time::Duration;

use chorus::backends::cpu::schedule::{all_reduce, all_reduce_auto};
use chorus::kernels::reduce_into;
use chorus::{DType, ReduceOp};
use criterion::{criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};

/// 8-byte-aligned, pre-faulted buffer of `bytes` bytes (first touch is ≈6×
/// slower on these machines, so it must not be measured).
fn buffer(bytes: usize, fill: u64) -> Vec<u64> {
    vec![fill; bytes / 8]
}

fn reduce_sum(c: &mut Criterion) {
    let mut group = c.benchmark_group("reduce_into_sum");
    group
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(20);
    // Bit patterns that are small normal values for every dtype here.
    let fill = 0x3c00_3c00_3c00_3c00u64;
    for dtype in [DType::F32, DType::BF16, DType::I32] {
        for (label, bytes) in [("4KiB", 4 << 10), ("1MiB", 1 << 20), ("16MiB", 16 << 20)] {
            let mut dst = buffer(bytes, fill);
            let src = buffer(bytes, fill);
            group.throughput(Throughput::Bytes(bytes as u64));
            group.bench_with_input(BenchmarkId::new(dtype.name(), label), &bytes, |b, _| {
                b.iter(|| {
                    let d: &mut [u8] = bytemuck::cast_slice_mut(&mut dst);
                    let s: &[u8] = bytemuck::cast_slice(&src);
                    // Sum of small values repeated: stays finite long enough
                    // for the benchmark (bf16 saturates to inf harmlessly).
                    reduce_into(dtype, ReduceOp::Sum, black_box(d), black_box(s))
                })
            });
        }
    }
    group.finish();
}

fn build_schedule(c: &mut Criterion) {
    let mut group = c.benchmark_group("schedule");
    group
        .measurement_time(Duration::from_secs(2))
        .warm_up_time(Duration::from_millis(500))
        .sample_size(20);
    group.bench_function("all_reduce_size_64_count_16Mi", |b| {
        b.iter(|| all_reduce(black_box(17), black_box(64), black_box(16 << 20)))
    });
    // The small-message path of the tuning table (recursive doubling).
    group.bench_function("all_reduce_auto_size_64_count_2", |b| {
        b.iter(|| all_reduce_auto(black_box(17), black_box(64), black_box(2), 4))
    });
    group.finish();
}

criterion_group!(benches, reduce_sum, build_schedule);
criterion_main!(benches);
