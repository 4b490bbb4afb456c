#!/usr/bin/env bash
# Build everything scripts/gpu-check.sh runs into one folder, to copy to a
# GPU machine that has a driver but no Rust toolchain and no network:
#   ./scripts/gpu-bundle.sh [OUT]        # default target/gpu-bundle
#   scp -r target/gpu-bundle gpu-box: && ssh gpu-box gpu-bundle/gpu-check.sh
# Contents: the release test binaries of tests/gpu.rs and the library unit
# tests (features nccl,rccl; the vendor libraries are loaded at run time),
# the examples, chorus-run, and gpu-check.sh itself. NCCL and the CUDA
# runtime are not bundled: the box needs them (the nvidia-nccl-cu12 and
# nvidia-cuda-runtime-cu12 wheels, or a CUDA install), found through the
# loader path or CHORUS_LIB_DIRS.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/gpu-bundle}
features=${CHORUS_GPU_FEATURES:-nccl,rccl}
rm -rf "$out"
mkdir -p "$out/examples"

log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --release --features "$features" --lib --test gpu --no-run 2>&1 | tee "$log"
gpu=$(grep -o 'target/release/deps/gpu-[0-9a-f]*' "$log" | tail -1)
lib=$(grep -o 'target/release/deps/chorus-[0-9a-f]*' "$log" | tail -1)
[ -x "$gpu" ] && [ -x "$lib" ] || { echo "gpu-bundle: test binaries not found" >&2; exit 1; }
cp "$gpu" "$out/gpu-tests"
cp "$lib" "$out/lib-tests"
cargo build --release --features "$features" --examples --bins
cp target/release/chorus-run "$out/"
cp target/release/chorus-perf "$out/"
for e in examples/*.rs; do
  name=$(basename "$e" .rs)
  cp "target/release/examples/$name" "$out/examples/"
done
cp scripts/gpu-check.sh "$out/"
git rev-parse HEAD > "$out/COMMIT" 2>/dev/null || true
echo "gpu-bundle: $out ($(du -sh "$out" | cut -f1)); run $out/gpu-check.sh on the GPU machine"
