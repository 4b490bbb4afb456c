#!/usr/bin/env bash
# Run the GPU suite and an all-reduce bandwidth report on a machine with an
# NVIDIA GPU, in one go (sized for < 5 minutes on one GPU; most of it is the
# build). Works on a bare Debian/Ubuntu GPU box with a driver: if NCCL or the
# CUDA runtime are not found, they are installed from pip wheels
# (nvidia-nccl-cu12 ships only libnccl.so.2, which our loader searches for)
# and the loader is pointed at them.
#
#   ./scripts/gpu-check.sh            # nccl
#   CHORUS_GPU_FEATURES=rccl ./scripts/gpu-check.sh   # ROCm box
set -euo pipefail
cd "$(dirname "$0")/.."
features=${CHORUS_GPU_FEATURES:-nccl}

if ! command -v nvidia-smi >/dev/null 2>&1 && [ "$features" = nccl ]; then
  echo "gpu-check: nvidia-smi not found; the tests will skip (no GPU)" >&2
else
  nvidia-smi -L || true
fi

if [ "$features" = nccl ]; then
  have_lib() { ldconfig -p 2>/dev/null | grep -q "$1"; }
  py=$(command -v python3 || true)
  if ! have_lib libnccl.so || ! have_lib libcudart.so; then
    if [ -n "$py" ]; then
      site=$("$py" -c 'import site,sys; print(site.getsitepackages()[0])' 2>/dev/null || true)
      if [ -z "$site" ] || ! ls "$site"/nvidia/nccl/lib/libnccl.so* >/dev/null 2>&1; then
        "$py" -m pip install -q nvidia-nccl-cu12 nvidia-cuda-runtime-cu12 \
          || "$py" -m pip install -q --break-system-packages nvidia-nccl-cu12 nvidia-cuda-runtime-cu12 \
          || echo "gpu-check: pip install of NCCL wheels failed" >&2
        site=$("$py" -c 'import site; print(site.getsitepackages()[0])')
      fi
      export CHORUS_LIB_DIRS="$site/nvidia/nccl/lib:$site/nvidia/cuda_runtime/lib${CHORUS_LIB_DIRS:+:$CHORUS_LIB_DIRS}"
      export LD_LIBRARY_PATH="$CHORUS_LIB_DIRS${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
  fi
fi

if ! command -v cargo >/dev/null 2>&1 && [ -x "$HOME/.cargo/bin/cargo" ]; then
  export PATH="$HOME/.cargo/bin:$PATH"
fi
if ! command -v cargo >/dev/null 2>&1; then
  if command -v curl >/dev/null 2>&1; then
    echo "gpu-check: installing Rust with rustup" >&2
    curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
    export PATH="$HOME/.cargo/bin:$PATH"
  else
    echo "gpu-check: cargo not found and no curl to install it; install Rust first" >&2
    exit 1
  fi
fi

export RUST_LOG=${RUST_LOG:-warn}
start=$(date +%s)
timeout 240 cargo test --release --features "$features" --test gpu -- --nocapture --test-threads 1
timeout 60 cargo test --release --features "$features" --lib -- xccl --nocapture
echo "gpu-check: done in $(( $(date +%s) - start )) s"
