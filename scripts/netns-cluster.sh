#!/usr/bin/env bash
# Multi-host fault tests on one machine: four "hosts" in network namespaces
# (chorus-h0..chorus-h3, addresses 10.213.0.1-4/24, each with its own
# CHORUS_HOST_ID so no shared memory is used between them) joined by a
# bridge in a fifth namespace (chorus-hsw, 10.213.0.254, where the store
# and the launcher run). Runs examples/fault_matrix across them: kill -9
# and SIGSTOP of each rank role with the store on the launcher and on rank
# 0, a partition (the victim's link set down), and tc netem delay and
# loss. Only addresses inside these namespaces are used; everything is
# torn down at the end, also on failure.
#
# Needs root and `ip netns` (iproute2); prints a SKIP line and exits 0
# where they are missing. Arguments go to fault_matrix (e.g. --slack 3,
# --store launcher). FAULT_MATRIX_BIN picks the binary (default: the
# release build, built here).
set -euo pipefail
cd "$(dirname "$0")/.."

p=chorus-h
if [ "$(id -u)" != 0 ] || ! command -v ip >/dev/null || ! ip netns add "${p}probe" 2>/dev/null; then
  echo "SKIP netns-cluster: needs root and 'ip netns' (iproute2)"
  exit 0
fi
ip netns del "${p}probe"

cleanup() {
  for n in 0 1 2 3 sw; do ip netns del "$p$n" 2>/dev/null || true; done
}
trap cleanup EXIT
cleanup

setup() {
  ip netns add "${p}sw" || return 1
  ip -n "${p}sw" link set lo up || return 1
  ip -n "${p}sw" link add br0 type bridge || return 1
  ip -n "${p}sw" addr add 10.213.0.254/24 dev br0 || return 1
  ip -n "${p}sw" link set br0 up || return 1
  for i in 0 1 2 3; do
    ip netns add "$p$i" || return 1
    ip -n "${p}sw" link add "v$i" type veth peer name eth0 netns "$p$i" || return 1
    ip -n "${p}sw" link set "v$i" master br0 up || return 1
    ip -n "$p$i" addr add "10.213.0.$((i + 1))/24" dev eth0 || return 1
    ip -n "$p$i" link set eth0 up || return 1
    ip -n "$p$i" link set lo up || return 1
  done
}
if ! setup; then
  echo "SKIP netns-cluster: could not create the namespaces, bridge and veth pairs here"
  exit 0
fi

bin=${FAULT_MATRIX_BIN:-}
if [ -z "$bin" ]; then
  cargo build --release --example fault_matrix
  bin=target/release/examples/fault_matrix
fi
bin=$(realpath "$bin")
timeout 600 ip netns exec "${p}sw" "$bin" --netns "$p" "$@"
