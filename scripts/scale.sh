#!/usr/bin/env bash
# What a communicator of N ranks costs on this host, as N grows: for each N
# in NS, with shared memory (the default) and with CHORUS_SHM=0 (TCP only),
# runs examples/scale_probe.rs under chorus-run and prints one table row:
# start-up time (launch to new_comm returning, slowest rank), the whole
# launch's wall time, resident memory, threads and open files per rank after
# a few collectives, /dev/shm in use, and the time of an 8 B and a 1 MiB
# all_reduce. Where scripts/compare-peers.sh has installed MPICH and Open MPI
# (their venvs under PEERS_DIR), the same N also gets each MPI's start-up
# (its launcher running a Python hello that initialises MPI and passes a
# barrier) and its 1 MiB Allreduce, measured in the same run.
#
#   ./scripts/scale.sh                      # NS="8 16 32 64 128"
#   NS="8 16" MODES=shm ./scripts/scale.sh  # fewer runs
#
# Environment: NS (rank counts), MODES ("shm tcp"), RUNS (launches per N and
# mode, the row shows the median start-up and how many launches succeeded;
# default 1), TIMEOUT (seconds per launch, default 300), IDLE (seconds each
# launch stays idle before its last all_reduce, default 0), PEERS_DIR,
# KILL (1: after the table, one more launch per N with shared memory in
# which rank N/3 is killed with SIGKILL, and a second table of how many
# survivors got PeerFailed naming it, and how fast), HOSTS (H: lay the N ranks
# out as H simulated hosts of N/H consecutive ranks, by giving rank r
# CHORUS_HOST_ID=sim-(r*H/N): shared memory within a simulated host, TCP
# between them, and hierarchical collectives; CHORUS_HIER=0 alongside
# measures the same layout with flat ones).
# Not run in CI: it oversubscribes the machine on purpose.
set -euo pipefail
cd "$(dirname "$0")/.."

NS=${NS:-"8 16 32 64 128"}
MODES=${MODES:-"shm tcp"}
RUNS=${RUNS:-1}
TIMEOUT=${TIMEOUT:-300}
IDLE=${IDLE:-0}
PEERS_DIR=${PEERS_DIR:-target/peers}
MPICH=("$PEERS_DIR/mpich-venv/bin/mpiexec")
MPICH_PY=$PEERS_DIR/mpich-venv/bin/python
OMPI=(/usr/bin/mpirun.openmpi --oversubscribe --allow-run-as-root)
OMPI_PY=$PEERS_DIR/ompi-venv/bin/python

cargo build --release --example scale_probe --bin chorus-run >&2
RUN=target/release/chorus-run
PROBE=(target/release/examples/scale_probe)
if [ -n "${HOSTS:-}" ]; then
  # chorus-run gives each rank RANK and WORLD_SIZE; the host id follows.
  PROBE=(sh -c 'CHORUS_HOST_ID=sim-$((RANK * HOSTS / WORLD_SIZE)) exec "$0"' "${PROBE[0]}")
  export HOSTS
fi
shm_before=$(df -B1 --output=used /dev/shm | tail -1)

echo "# $(date -u +%FT%TZ) $(nproc) CPUs${HOSTS:+, $HOSTS simulated hosts}${CHORUS_HIER:+, CHORUS_HIER=$CHORUS_HIER}, load $(cut -d' ' -f1-3 /proc/loadavg); /dev/shm used before: $((shm_before >> 20)) MiB"
have_mpich=0; have_ompi=0
[ -x "${MPICH[0]}" ] && [ -x "$MPICH_PY" ] && have_mpich=1
[ -x "${OMPI[0]}" ] && [ -x "$OMPI_PY" ] && have_ompi=1
hdr="| N | links | launches ok | start-up s | wall s | RSS MiB max | threads max | fds max / mean | /dev/shm MiB | 8 B all_reduce µs | 1 MiB all_reduce ms |"
sep="|---|---|---|---|---|---|---|---|---|---|---|"
if [ $have_mpich = 1 ]; then
  hdr="$hdr MPICH start-up s | MPICH 1 MiB Allreduce ms |"
  sep="$sep---|---|"
fi
if [ $have_ompi = 1 ]; then
  hdr="$hdr Open MPI start-up s | Open MPI 1 MiB Allreduce ms |"
  sep="$sep---|---|"
fi
echo "$hdr"
echo "$sep"

# An MPI's columns: the wall time of a Python hello under its launcher, and
# a 1 MiB Allreduce (mean of 5 after 2, slowest rank). Args: python, N,
# launcher command...
mpi_row() {
  local py=$1 n=$2 t0 t1 ar
  shift 2
  t0=$(date +%s.%N)
  timeout "$TIMEOUT" "$@" -n "$n" "$py" -c 'from mpi4py import MPI; MPI.COMM_WORLD.Barrier()' \
    >/dev/null 2>&1 || { echo " failed | failed |"; return; }
  t1=$(date +%s.%N)
  ar=$(timeout "$TIMEOUT" "$@" -n "$n" "$py" -c '
import time, numpy as np
from mpi4py import MPI
c = MPI.COMM_WORLD
b = np.ones(1 << 18, dtype=np.float32)
for _ in range(2): c.Allreduce(MPI.IN_PLACE, b)
c.Barrier(); t = time.perf_counter()
for _ in range(5): c.Allreduce(MPI.IN_PLACE, b)
m = c.allreduce((time.perf_counter() - t) / 5, op=MPI.MAX)
if c.rank == 0: print(f"{m * 1e3:.1f}")' 2>/dev/null) || ar=failed
  printf ' %.2f | %s |' "$(echo "$t1 - $t0" | bc -l)" "$ar"
}

for n in $NS; do
  for mode in $MODES; do
    shm=1
    [ "$mode" = tcp ] && shm=0
    ok=0; starts=(); line=""; wall=""
    for _ in $(seq "$RUNS"); do
      t0=$(date +%s.%N)
      if out=$(SCALE_T0=$t0 SCALE_IDLE_S=$IDLE CHORUS_SHM=$shm \
          timeout "$TIMEOUT" "$RUN" -n "$n" --timeout "$TIMEOUT" -- "${PROBE[@]}" 2>/dev/null \
          | sed -n 's/^\[rank 0\] //p' | grep '^n='); then
        t1=$(date +%s.%N)
        ok=$((ok + 1)); line=$out
        wall=$(printf '%.2f' "$(echo "$t1 - $t0" | bc -l)")
        starts+=("$(echo "$out" | sed 's/.*startup_s=\([0-9.]*\).*/\1/')")
      fi
    done
    if [ -z "$line" ]; then
      row="| $n | $mode | 0/$RUNS | — | — | — | — | — | — | — | — |"
    else
      get() { echo "$line" | sed "s/.*$1=\([0-9.]*\).*/\1/"; }
      median=$(printf '%s\n' "${starts[@]}" | sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}')
      shm_mib=$(get shm_used_mib)
      shm_mib=$(echo "$shm_mib - $shm_before / 1048576" | bc -l)
      row=$(printf '| %s | %s | %s/%s | %.2f | %s | %.1f | %.0f | %.0f / %.1f | %.0f | %.1f | %.2f |' \
        "$n" "$mode" "$ok" "$RUNS" "$median" "$wall" "$(get rss_mib_max)" "$(get threads_max)" \
        "$(get fds_max)" "$(get fds_mean)" "$shm_mib" "$(get ar8_us)" "$(get ar1m_ms)")
    fi
    # The MPIs once per N, on the shared-memory row.
    if [ $have_mpich = 1 ]; then
      if [ "$mode" = shm ]; then row="$row$(mpi_row "$MPICH_PY" "$n" "${MPICH[@]}")"; else row="$row | |"; fi
    fi
    if [ $have_ompi = 1 ]; then
      if [ "$mode" = shm ]; then row="$row$(mpi_row "$OMPI_PY" "$n" "${OMPI[@]}")"; else row="$row | |"; fi
    fi
    echo "$row"
  done
done

if [ "${KILL:-0}" = 1 ]; then
  echo
  echo "| N | killed rank | survivors told (PeerFailed naming it) | slowest ms | median ms |"
  echo "|---|---|---|---|---|"
  for n in $NS; do
    k=$((n / 3))
    out=$(SCALE_KILL=$k timeout "$TIMEOUT" "$RUN" -n "$n" --timeout "$TIMEOUT" -- "${PROBE[@]}" 2>/dev/null \
      | grep "killed $k: told in" || true)
    told=$(printf '%s\n' "$out" | grep -c "blamed \[$k\]$" || true)
    times=$(printf '%s\n' "$out" | sed -n 's/.*told in \([0-9.]*\) ms.*/\1/p' | sort -g)
    slowest=$(printf '%s\n' "$times" | tail -1)
    median=$(printf '%s\n' "$times" | awk '{a[NR]=$1} END {if (NR) print a[int((NR+1)/2)]}')
    echo "| $n | $k | $told of $((n - 1)) | ${slowest:-—} | ${median:-—} |"
  done
fi
