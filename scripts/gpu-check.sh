#!/usr/bin/env bash
# The GPU check: run the nccl (or rccl) backend on a real device, within
# 8 minutes, on a machine with a driver and NCCL/cudart but no Rust and no
# network. Run it on a bundle made by scripts/gpu-bundle.sh (preferred).
# On the GPU machine, from a checkout that has the archive next to it:
#   scripts/gpu-check.sh target/gpu-bundle.tar.xz
# It unpacks the archive into a temporary folder and runs the bundled copy
# of this script, which matches the binaries. From an unpacked bundle:
#   gpu-bundle/gpu-check.sh        (or: scripts/gpu-check.sh path/to/gpu-bundle)
# From a checkout with cargo and no argument, it builds the bundle first.
#
# It prints the GPUs, the NCCL version and the library paths; sets
# NCCL_DEBUG=WARN and NCCL_CHECK_POINTERS=1; runs the GPU suite (every
# collective against a host reference on as many ranks as devices, split,
# an all-reduce bandwidth report), the xccl unit tests, and two ranks on
# GPU 0 as separate processes (distinct NCCL_HOSTIDs, and
# NCCL_MULTI_RANK_GPU_ENABLE=1 for NCCL >= 2.30).
# Libraries: NCCL and the CUDA runtime are looked up in the loader's path
# and in the nvidia/*/lib folders of the Python environment's site folders
# (pip wheels: nvidia-nccl-cu13 puts libnccl.so.2 in nvidia/nccl/lib, the
# CUDA 13 runtime puts libcudart.so.13 in nvidia/cu13/lib; cu12 wheels use
# nvidia/nccl/lib and nvidia/cuda_runtime/lib). Those folders are prepended
# to CHORUS_LIB_DIRS (set it yourself to add others) and LD_LIBRARY_PATH.
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

# A bundle given as an argument: an archive is unpacked into a temporary
# folder (removed afterwards); either way the bundle's own gpu-check.sh runs,
# with no argument, and its exit status is this script's.
if [ $# -gt 0 ]; then
  bundle=$1
  [ -e "$bundle" ] || fail "$bundle: no such archive or folder"
  if [ -f "$bundle" ]; then
    dest=$(mktemp -d "${TMPDIR:-/tmp}/chorus-gpu-bundle.XXXXXX")
    trap 'rm -rf "$dest"' EXIT
    echo "gpu-check: unpacking $bundle into $dest"
    if ! tar -C "$dest" -xf "$bundle" 2>/dev/null; then
      # tar needs the xz program for .tar.xz; Python's tarfile does not.
      py=$(command -v python3 || command -v python || true)
      [ -n "$py" ] || fail "cannot unpack $bundle (tar failed, and no python3 to try)"
      "$py" -c 'import sys, tarfile
kw = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
try:
    tarfile.open(sys.argv[1]).extractall(sys.argv[2], **kw)
except Exception as e:
    sys.exit("gpu-check: " + " ".join(str(e).split()))' "$bundle" "$dest" \
        || fail "cannot unpack $bundle (is it an archive from scripts/gpu-bundle.sh?)"
    fi
    bundle=$(find "$dest" -mindepth 2 -maxdepth 2 -name gpu-check.sh -printf '%h\n' | head -1)
    [ -n "$bundle" ] || fail "$1 holds no gpu-check.sh: not an archive from scripts/gpu-bundle.sh"
  fi
  [ -x "$bundle/gpu-check.sh" ] && [ -x "$bundle/gpu-tests" ] \
    || fail "$bundle is not a bundle folder (no gpu-check.sh and gpu-tests in it)"
  rc=0
  "$bundle/gpu-check.sh" || rc=$?
  exit "$rc"
fi

# The binaries: in a bundle, all of them, checked before anything runs.
if [ -x "$here/gpu-tests" ]; then
  gpu="$here/gpu-tests"; lib="$here/lib-tests"; run="$here/chorus-run"
  perf="$here/chorus-perf"; ex="$here/examples"
  for f in "$gpu" "$lib" "$run" "$perf" "$ex/all_reduce"; do
    [ -x "$f" ] || fail "incomplete bundle: $f is missing (rebuild it with scripts/gpu-bundle.sh)"
  done
  cat "$here/COMMIT" 2>/dev/null | sed 's/^/gpu-check: commit /' || true
fi

export NCCL_DEBUG=${NCCL_DEBUG:-WARN}
export NCCL_CHECK_POINTERS=${NCCL_CHECK_POINTERS:-1}
export RUST_LOG=${RUST_LOG:-warn,chorus::backends::xccl=info}

# The device and the libraries are both probed and reported; a skip (or,
# with CHORUS_REQUIRE_GPU=1, a failure) comes after, naming every reason.
missing=()
if [ "$flavor" = nccl ]; then
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    missing+=("no GPU: nvidia-smi not found (no NVIDIA driver)")
  elif ! nvidia-smi -L; then
    missing+=("no GPU: nvidia-smi sees none")
  fi
  libs="libnccl.so libcudart.so"
else
  command -v rocm-smi >/dev/null 2>&1 && rocm-smi --showproductname || true
  libs="librccl.so libamdhip64.so"
fi

# Library paths: the nvidia/*/lib folders of the Python environment's pip
# wheels (nvidia/nccl/lib, nvidia/cu13/lib, nvidia/cuda_runtime/lib, ...),
# then the loader's cache. LD_LIBRARY_PATH gets the same folders first, so
# what is printed below is what the backend loads.
py=$(command -v python3 || command -v python || true)
if [ -n "$py" ]; then
  sites=$("$py" -c 'import site, sys
dirs = list(getattr(site, "getsitepackages", lambda: [])())
dirs.append(site.getusersitepackages())
dirs += [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
print("\n".join(dict.fromkeys(dirs)))' 2>/dev/null || true)
  while IFS= read -r site; do
    [ -n "$site" ] || continue
    for d in "$site"/nvidia/*/lib; do
      [ -d "$d" ] || continue
      case ":${CHORUS_LIB_DIRS:-}:" in *":$d:"*) ;; *) CHORUS_LIB_DIRS="${CHORUS_LIB_DIRS:+$CHORUS_LIB_DIRS:}$d" ;; esac
    done
  done <<< "$sites"
fi
export CHORUS_LIB_DIRS=${CHORUS_LIB_DIRS:-}
export LD_LIBRARY_PATH="$CHORUS_LIB_DIRS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
echo "gpu-check: python=${py:-none} CHORUS_LIB_DIRS=$CHORUS_LIB_DIRS"
for l in $libs; do
  found=
  for d in ${CHORUS_LIB_DIRS//:/ }; do
    [ -z "$found" ] && found=$(ls "$d"/$l* 2>/dev/null | head -1 || true)
  done
  [ -n "$found" ] || found=$(ldconfig -p 2>/dev/null | grep -o "/[^ ]*$l[.0-9]*" | head -1 || true)
  echo "gpu-check: $l -> ${found:-not found}"
  if [ -z "$found" ]; then
    missing+=("library not found: $l (in CHORUS_LIB_DIRS, the Python site folders' nvidia/*/lib or the loader's cache)")
    continue
  fi
  if [ "$l" = libnccl.so ] || [ "$l" = librccl.so ]; then
    if [ -n "$py" ]; then
      "$py" -c "import ctypes,sys; l=ctypes.CDLL(sys.argv[1]); v=ctypes.c_int(); l.ncclGetVersion(ctypes.byref(v)); print('gpu-check: ncclGetVersion =', v.value)" "$found" || true
    fi
  fi
done
if [ ${#missing[@]} -gt 0 ]; then
  for m in "${missing[@]}"; do echo "gpu-check: $m" >&2; done
  hint="pip install nvidia-nccl-cu13 nvidia-cuda-runtime (or the -cu12 wheels), or set CHORUS_LIB_DIRS"
  [ "$flavor" = nccl ] || hint="install ROCm/RCCL, or set CHORUS_LIB_DIRS"
  case "${missing[*]}" in *"library not found"*) echo "gpu-check: for the libraries: $hint" >&2 ;; esac
  skip_or_fail "${missing[0]}$([ ${#missing[@]} -gt 1 ] && echo " (and $(( ${#missing[@]} - 1 )) more, above)")"
fi

# Not in a bundle: build one here, then run its copy of this script.
if [ -z "${gpu:-}" ]; then
  cd "$here/.."
  command -v cargo >/dev/null 2>&1 || fail "no bundle next to this script and no cargo: run scripts/gpu-bundle.sh elsewhere and copy it here"
  # Built to run here, not to ship: no archive.
  CHORUS_BUNDLE_ARCHIVE=0 "$here/gpu-bundle.sh" target/gpu-bundle >/dev/null
  exec target/gpu-bundle/gpu-check.sh
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
echo "== GPU suite ($flavor)"
timeout 240 "$gpu" --nocapture --test-threads 1 2>&1 | tee "$log" \
  || fail "the GPU suite (tests/gpu.rs) failed or timed out: see above"
if grep -q "SKIP $flavor" "$log"; then
  [ "$require" = 1 ] && fail "the GPU suite skipped $flavor"
fi
echo "== chorus-perf --device cuda (1 rank, GPU 0, device buffers)"
timeout 90 "$perf" all_reduce -n 1 -b 8 -e 64M -f 8 --budget 0.5 \
  --backend "$flavor" --device cuda --timeout 80 \
  || fail "chorus-perf --device cuda"
echo "== xccl unit tests"
timeout 60 "$lib" backends::xccl --nocapture || fail "the xccl unit tests"

echo "== 2 ranks on GPU 0, separate processes"
# Distinct host ids make NCCL accept two ranks on one device (over its
# network transport); NCCL >= 2.30 also accepts NCCL_MULTI_RANK_GPU_ENABLE=1.
CHORUS_BACKEND=$flavor CHORUS_DEVICE=cuda:0 NCCL_MULTI_RANK_GPU_ENABLE=1 \
  timeout 120 "$run" -n 2 --timeout 100 -- \
  sh -c 'NCCL_HOSTID=chorus-gpu-check-$CHORUS_RANK exec "$0"' "$ex/all_reduce" \
  || fail "2 ranks on one GPU"
echo "gpu-check: done in $(( $(date +%s) - start )) s"
