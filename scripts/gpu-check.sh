#!/usr/bin/env bash
# The GPU check: run the nccl (or rccl) backend on a real device, within
# 8 minutes, on a machine with a driver and NCCL/cudart but no Rust and no
# network. Run it from a bundle made by scripts/gpu-bundle.sh (preferred):
#   gpu-bundle/gpu-check.sh
# or from a checkout with cargo (it then builds the release tests first).
#
# It prints the GPUs, the NCCL version and the library paths; sets
# NCCL_DEBUG=WARN and NCCL_CHECK_POINTERS=1; runs the GPU suite (every
# collective against a host reference on as many ranks as devices, split,
# an all-reduce bandwidth report), the xccl unit tests, and two ranks on
# GPU 0 as separate processes (distinct NCCL_HOSTIDs, and
# NCCL_MULTI_RANK_GPU_ENABLE=1 for NCCL >= 2.30).
# CHORUS_REQUIRE_GPU=1: fail, never skip, when no GPU or library is found.
#   CHORUS_GPU_FLAVOR=rccl gpu-check.sh     # a ROCm box
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
flavor=${CHORUS_GPU_FLAVOR:-nccl}
require=${CHORUS_REQUIRE_GPU:-0}
start=$(date +%s)
fail() { echo "gpu-check: FAIL: $*" >&2; exit 1; }
skip_or_fail() {
  if [ "$require" = 1 ]; then fail "$*"; fi
  echo "gpu-check: SKIP: $*" >&2
  exit 0
}

export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_CHECK_POINTERS=${NCCL_CHECK_POINTERS:-1}
export RUST_LOG=${RUST_LOG:-warn,chorus::backends::xccl=info}

if [ "$flavor" = nccl ]; then
  command -v nvidia-smi >/dev/null 2>&1 || skip_or_fail "nvidia-smi not found (no NVIDIA driver)"
  nvidia-smi -L || skip_or_fail "nvidia-smi sees no GPU"
  libs="libnccl.so libcudart.so"
else
  command -v rocm-smi >/dev/null 2>&1 && rocm-smi --showproductname || true
  libs="librccl.so libamdhip64.so"
fi

# Library paths: the loader's cache, then pip wheels of the running Python.
py=$(command -v python3 || true)
if [ -n "$py" ]; then
  for site in $("$py" -c 'import site,sys; print(" ".join(site.getsitepackages()+[site.getusersitepackages(), sys.prefix+"/lib"]))' 2>/dev/null); do
    for sub in nccl cuda_runtime; do
      for cu in "" cu13/; do
        d="$site/nvidia/$cu$sub/lib"
        [ -d "$d" ] && CHORUS_LIB_DIRS="$d${CHORUS_LIB_DIRS:+:$CHORUS_LIB_DIRS}"
      done
    done
  done
fi
export CHORUS_LIB_DIRS=${CHORUS_LIB_DIRS:-}
export LD_LIBRARY_PATH="$CHORUS_LIB_DIRS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "gpu-check: CHORUS_LIB_DIRS=$CHORUS_LIB_DIRS"
for l in $libs; do
  found=$(ldconfig -p 2>/dev/null | grep -o "/[^ ]*$l[.0-9]*" | head -1 || true)
  for d in ${CHORUS_LIB_DIRS//:/ }; do
    [ -z "$found" ] && found=$(ls "$d"/$l* 2>/dev/null | head -1 || true)
  done
  echo "gpu-check: $l -> ${found:-not found}"
  [ -n "$found" ] || skip_or_fail "$l not found (pip install nvidia-nccl-cu12 nvidia-cuda-runtime-cu12, or set CHORUS_LIB_DIRS)"
  if [ "$l" = libnccl.so ] || [ "$l" = librccl.so ]; then
    if [ -n "$py" ]; then
      "$py" -c "import ctypes,sys; l=ctypes.CDLL(sys.argv[1]); v=ctypes.c_int(); l.ncclGetVersion(ctypes.byref(v)); print('gpu-check: ncclGetVersion =', v.value)" "$found" || true
    fi
  fi
done

# The binaries: from the bundle, else built here.
if [ -x "$here/gpu-tests" ]; then
  gpu="$here/gpu-tests"; lib="$here/lib-tests"; run="$here/chorus-run"; ex="$here/examples"
  cat "$here/COMMIT" 2>/dev/null | sed 's/^/gpu-check: commit /' || true
else
  cd "$here/.."
  command -v cargo >/dev/null 2>&1 || fail "no bundle next to this script and no cargo: run scripts/gpu-bundle.sh elsewhere and copy it here"
  "$here/gpu-bundle.sh" target/gpu-bundle >/dev/null
  exec target/gpu-bundle/gpu-check.sh
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
echo "== GPU suite ($flavor)"
timeout 240 "$gpu" --nocapture --test-threads 1 2>&1 | tee "$log"
if grep -q "SKIP $flavor" "$log"; then
  [ "$require" = 1 ] && fail "the GPU suite skipped $flavor"
fi
echo "== chorus-perf --device cuda (1 rank, GPU 0, device buffers)"
timeout 90 "$here/chorus-perf" all_reduce -n 1 -b 8 -e 64M -f 8 --budget 0.5 \
  --backend "$flavor" --device cuda --timeout 80 \
  || fail "chorus-perf --device cuda"
echo "== xccl unit tests"
timeout 60 "$lib" backends::xccl --nocapture

echo "== 2 ranks on GPU 0, separate processes"
# Distinct host ids make NCCL accept two ranks on one device (over its
# network transport); NCCL >= 2.30 also accepts NCCL_MULTI_RANK_GPU_ENABLE=1.
CHORUS_BACKEND=$flavor CHORUS_DEVICE=cuda:0 NCCL_MULTI_RANK_GPU_ENABLE=1 \
  timeout 120 "$run" -n 2 --timeout 100 -- \
  sh -c 'NCCL_HOSTID=chorus-gpu-check-$CHORUS_RANK exec "$0"' "$ex/all_reduce" \
  || fail "2 ranks on one GPU"
echo "gpu-check: done in $(( $(date +%s) - start )) s"
