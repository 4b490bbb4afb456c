#!/usr/bin/env bash
# Install the system packages the optional backends need (Debian/Ubuntu).
# Idempotent: installs only what is missing, runs `apt-get update` at most once.
#
#   gloo : libgloo-dev (headers + libgloo.so), g++ (the C++ shim, built by the cc crate)
#   mpi  : libopenmpi-dev openmpi-bin (rsmpi + mpirun), libclang-dev (bindgen in rsmpi)
#   nccl, rccl : nothing at build time (cudarc/our RCCL layer load libraries at run time)
#   etcd : protobuf-compiler (protoc, for etcd-client's build), libprotobuf-dev
#          (google/protobuf/*.proto, which etcd's protos import; only a
#          Recommends of protobuf-compiler, so --no-install-recommends skips it),
#          etcd-server (the tests start their own etcd on loopback; the
#          packaged service is not used)
set -euo pipefail

pkgs=(libgloo-dev g++ libopenmpi-dev openmpi-bin libclang-dev pkg-config protobuf-compiler libprotobuf-dev etcd-server)
missing=()
for p in "${pkgs[@]}"; do
  if ! dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed"; then
    missing+=("$p")
  fi
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all present (${pkgs[*]})"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
sudo_cmd=()
if [ "$(id -u)" -ne 0 ]; then sudo_cmd=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo_cmd[@]}" apt-get update -qq
"${sudo_cmd[@]}" apt-get install -y -qq --no-install-recommends "${missing[@]}"
