#!/usr/bin/env bash
# Build what scripts/gpu-check.sh runs into one folder and one compressed
# archive, to ship to a GPU machine that has a driver but no Rust toolchain
# and no network:
#   ./scripts/gpu-bundle.sh [OUT]   # default target/gpu-bundle (+ target/gpu-bundle.tar.xz)
# Ship target/gpu-bundle.tar.xz (at most 64 MiB, checked here) together with
# a checkout of this repository, then on the GPU machine, from the checkout:
#   scripts/gpu-check.sh target/gpu-bundle.tar.xz
# (gpu-check.sh unpacks the archive into a temporary folder and runs the
# bundled copy of itself.) With only the archive at hand:
#   tar -xJf gpu-bundle.tar.xz && gpu-bundle/gpu-check.sh
#
# Contents: exactly the binaries gpu-check.sh runs, built in release with
# features nccl,rccl (the vendor libraries are loaded at run time) and
# stripped of symbols: gpu-tests (tests/gpu.rs), lib-tests (the library
# unit tests; gpu-check.sh runs their backends::xccl part), chorus-run,
# chorus-perf and examples/all_reduce; plus gpu-check.sh itself and COMMIT.
# Panic messages keep their file:line; backtraces show addresses only.
# NCCL and the CUDA runtime are not bundled: the GPU machine needs them
# (e.g. PyTorch's nvidia-nccl-cu13 + CUDA 13 runtime wheels, or the cu12
# ones, or a CUDA install); gpu-check.sh finds them in the Python site
# folders and passes them on through CHORUS_LIB_DIRS.
#
# CHORUS_GPU_FEATURES: cargo features (default nccl,rccl).
# CHORUS_BUNDLE_ARCHIVE=0: the folder only, no archive (to run it here).
# CHORUS_BUNDLE_MAX_BYTES: the archive size limit (default 64 MiB, what the
# tool that ships the bundle carries); a larger archive fails the script.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${1:-target/gpu-bundle}
out=${out%/}
archive="$out.tar.xz"
features=${CHORUS_GPU_FEATURES:-nccl,rccl}
max_bytes=${CHORUS_BUNDLE_MAX_BYTES:-$((64 * 1024 * 1024))}
die() { echo "gpu-bundle: ERROR: $*" >&2; exit 1; }
command -v cargo >/dev/null 2>&1 || die "cargo not found: build the bundle on a machine with Rust"
archive_wanted=${CHORUS_BUNDLE_ARCHIVE:-1}
if [ "$archive_wanted" != 0 ]; then
  command -v xz >/dev/null 2>&1 || die "xz not found (apt-get install xz-utils): the archive is .tar.xz"
fi
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

# Artifact paths come from cargo's JSON messages, so CARGO_TARGET_DIR
# anywhere works. Diagnostics still go to stderr, rendered.
json=$(mktemp)
trap 'rm -f "$json"' EXIT
cargo_json() { cargo "$@" --message-format=json-render-diagnostics >"$json"; }
# The executable of the artifact whose target is named $1 and whose
# profile.test is $2 (true: a test harness; false: a bin or example).
exe_of() {
  grep '"reason":"compiler-artifact"' "$json" \
    | grep "\"name\":\"$1\"" | grep "\"test\":$2" \
    | grep -o '"executable":"[^"]*"' | sed 's/^"executable":"//; s/"$//' | tail -1
}

cargo_json test --release --features "$features" --lib --test gpu --no-run
gpu=$(exe_of gpu true)
lib=$(exe_of chorus true)
cargo_json build --release --features "$features" \
  --bin chorus-run --bin chorus-perf --example all_reduce
run=$(exe_of chorus-run false)
perf=$(exe_of chorus-perf false)
ex=$(exe_of all_reduce false)
for f in "$gpu" "$lib" "$run" "$perf" "$ex"; do
  [ -n "$f" ] && [ -x "$f" ] || die "a binary was not found in cargo's output (gpu=$gpu lib=$lib run=$run perf=$perf all_reduce=$ex)"
done

rm -rf "$out" "$archive"
mkdir -p "$out/examples"
cp "$gpu" "$out/gpu-tests"
cp "$lib" "$out/lib-tests"
cp "$run" "$out/chorus-run"
cp "$perf" "$out/chorus-perf"
cp "$ex" "$out/examples/all_reduce"
if command -v strip >/dev/null 2>&1; then
  strip --strip-all "$out/gpu-tests" "$out/lib-tests" "$out/chorus-run" \
    "$out/chorus-perf" "$out/examples/all_reduce"
else
  echo "gpu-bundle: warning: no strip (binutils): binaries keep their symbols" >&2
fi
cp scripts/gpu-check.sh "$out/"
git rev-parse HEAD > "$out/COMMIT" 2>/dev/null || true
if ! git diff --quiet HEAD 2>/dev/null; then echo "(plus uncommitted changes)" >> "$out/COMMIT"; fi

echo "gpu-bundle: $out: $(mib "$(du -sb "$out" | cut -f1)") unpacked"
if [ "$archive_wanted" = 0 ]; then
  echo "gpu-bundle: no archive (CHORUS_BUNDLE_ARCHIVE=0)"
  exit 0
fi
# xz -9: about a third of the size gzip -9 gives on these binaries
# (4.4 MiB against 12.9 MiB, measured December 2026).
tar -C "$(dirname "$out")" -cf - "$(basename "$out")" | xz -9 -T1 > "$archive"
bytes=$(stat -c %s "$archive")
echo "gpu-bundle: $archive: $bytes bytes ($(mib "$bytes")), limit $max_bytes ($(mib "$max_bytes"))"
if [ "$bytes" -gt "$max_bytes" ]; then
  rm -f "$archive"
  die "$archive (removed) was $(mib "$bytes"), over the $(mib "$max_bytes") that can be shipped to the GPU machine: drop binaries or shrink them (strip, fewer features)"
fi
echo "gpu-bundle: on the GPU machine, from a checkout: scripts/gpu-check.sh $archive"
