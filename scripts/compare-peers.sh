#!/usr/bin/env bash
# Compare Chorus's cpu backend with its peers on this host, in one run:
# PyTorch gloo, MPICH (PyPI wheel + mpi4py) and OpenMPI (Debian + mpi4py
# built against it). Same sizes, ops and rank counts for every system,
# interleaved per (ranks, op) so machine load hits all of them alike.
#
#   scripts/compare-peers.sh            # sizes 8 B .. 128 MiB, factor 4, 2 and 4 ranks
#   RANKS="2" OPS="all_reduce" FACTOR=2 scripts/compare-peers.sh
#
# Writes $OUT/results.jsonl (one JSON object per system/op/ranks/size),
# prints the ratio table, and draws $OUT/busbw.png (needs matplotlib, which
# the peers venv installs). Not run in CI: it installs packages and takes
# minutes. Environment: PEERS_DIR (venvs, default target/peers), OUT
# (default target/peers/run-<date>), MINBYTES, MAXBYTES, FACTOR, RANKS, OPS, BUDGET,
# ITERS, WARMUP, SYSTEMS, ROUNDS (repeat the whole interleaved sweep this
# many times; the report takes each point's median over rounds, which
# evens out a host whose speed drifts from minute to minute), CHORUS_PERF
# (a chorus-perf binary to measure instead of this tree's release build,
# e.g. one built at an earlier commit, for an A/B against the peers).
set -euo pipefail
cd "$(dirname "$0")/.."

PEERS_DIR=${PEERS_DIR:-target/peers}
OUT=${OUT:-$PEERS_DIR/run-$(date -u +%Y%m%dT%H%M%S)}
MINBYTES=${MINBYTES:-8}
MAXBYTES=${MAXBYTES:-128M}
FACTOR=${FACTOR:-4}
RANKS=${RANKS:-"2 4"}
# Every op chorus-perf has; MPI runs MPI_Alltoall for both all-to-all forms,
# and gloo has no list all_to_all (logged as failed, the sweep goes on).
OPS=${OPS:-"all_reduce all_gather broadcast reduce_scatter reduce gather scatter all_to_all all_to_all_single send_recv ping_pong"}
BUDGET=${BUDGET:-1}
ITERS=${ITERS:-100}     # timed ops per size (fewer where BUDGET seconds would be exceeded)
WARMUP=${WARMUP:-10}
# openmpi-tcp: Open MPI forced onto its TCP transport (--mca pml ob1 --mca
# btl self,tcp), the peer of chorus-tcp; tcp-raw: a C ping-pong over
# loopback TCP (scripts/tcp_pingpong.c), the limit either can reach, and
# under send_recv from 64 KiB the same program streaming (one stream's
# bandwidth).
SYSTEMS=${SYSTEMS:-"chorus chorus-tcp mpich openmpi openmpi-tcp tcp-raw gloo"}
ROUNDS=${ROUNDS:-1}
mkdir -p "$PEERS_DIR" "$OUT"

log() { echo "compare-peers: $*" >&2; }
# A size as chorus-perf takes it (8, 4K, 128M, 1G) in bytes.
bytes() {
  local v=${1^^}
  case $v in
    *K) echo $(( ${v%K} << 10 )) ;;
    *M) echo $(( ${v%M} << 20 )) ;;
    *G) echo $(( ${v%G} << 30 )) ;;
    *) echo "$v" ;;
  esac
}

# --- installs (idempotent) -------------------------------------------------
MPICH_VENV=$PEERS_DIR/mpich-venv     # mpich wheel + mpi4py + torch (gloo) + plotting
OMPI_VENV=$PEERS_DIR/ompi-venv       # mpi4py built against Debian's OpenMPI
if [ ! -x "$MPICH_VENV/bin/mpiexec" ]; then
  log "installing MPICH, mpi4py, numpy, matplotlib into $MPICH_VENV"
  python3 -m venv "$MPICH_VENV"
  "$MPICH_VENV/bin/pip" install -q mpich mpi4py numpy matplotlib
fi
if [[ " $SYSTEMS " == *" gloo "* ]] && ! "$MPICH_VENV/bin/python" -c "import torch.distributed" 2>/dev/null; then
  # download.pytorch.org (the CPU-only index) is not reachable here, and
  # PyPI's torch wheel refuses to import without its CUDA libraries, so it is
  # installed with all of its dependencies (several GB, ~3 min here).
  log "installing PyTorch (gloo) with its dependencies into $MPICH_VENV"
  "$MPICH_VENV/bin/pip" install -q torch
fi
if ! command -v /usr/bin/mpicc >/dev/null || ! [ -x /usr/bin/mpirun.openmpi ]; then
  log "installing OpenMPI from Debian"
  if [ "$(id -u)" = 0 ]; then apt-get install -y -q openmpi-bin libopenmpi-dev; else sudo apt-get install -y -q openmpi-bin libopenmpi-dev; fi
fi
if ! "$OMPI_VENV/bin/python" -c "import mpi4py" 2>/dev/null; then
  log "building mpi4py against OpenMPI into $OMPI_VENV"
  python3 -m venv "$OMPI_VENV"
  env MPICC=/usr/bin/mpicc "$OMPI_VENV/bin/pip" install -q --no-binary mpi4py --no-cache-dir mpi4py numpy
fi

if [ -n "${CHORUS_PERF:-}" ]; then
  PERF=$CHORUS_PERF
  log "measuring $PERF"
else
  log "building chorus-perf (release)"
  cargo build --release --quiet --bin chorus-perf
  PERF=target/release/chorus-perf
fi
RAW=$PEERS_DIR/tcp_pingpong
if [[ " $SYSTEMS " == *" tcp-raw "* ]]; then
  cc -O2 -o "$RAW" scripts/tcp_pingpong.c
fi
BENCH=scripts/peer_bench.py

# --- measurements ----------------------------------------------------------
{
  echo "# host: $(nproc) cores, $(uname -r), load: $(cut -d' ' -f1-3 /proc/loadavg)"
  echo "# torch: $("$MPICH_VENV/bin/python" -c 'import torch; print(torch.__version__)' 2>/dev/null)"
  echo "# mpich: $("$MPICH_VENV/bin/python" -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])' 2>/dev/null)"
  echo "# openmpi: $("$OMPI_VENV/bin/python" -c 'from mpi4py import MPI; print(MPI.Get_library_version().splitlines()[0])' 2>/dev/null)"
} > "$OUT/env.txt"
cat "$OUT/env.txt" >&2
RES=$OUT/results.jsonl
: > "$RES"
common=(-b "$MINBYTES" -e "$MAXBYTES" -f "$FACTOR" -w "$WARMUP" -i "$ITERS")
# Linux seeds a new TCP connection with what it cached about the last ones
# to the same address (`ip tcp_metrics`: RTT, cwnd, reordering). On
# loopback one system's run then sets the next one's start: after Open
# MPI's TCP runs (which leave an RTT of about 4 ms cached), a Chorus TCP
# launch ran its 1 MiB all_gather at 320-410 µs in 17 of 18 launches,
# against 97-128 µs in 3 of 3 launches after a flush (2026-12-07). So every
# launch starts from a flushed cache where the user may flush it (root).
if [ "$(id -u)" != 0 ]; then
  log "cannot flush the TCP metrics cache (needs root): TCP results may depend on the order of the runs"
fi
fresh_tcp() {
  # An address with nothing cached fails the flush; that is fine.
  if [ "$(id -u)" = 0 ]; then
    ip tcp_metrics flush 127.0.0.1 >/dev/null 2>&1 || true
    ip -6 tcp_metrics flush ::1 >/dev/null 2>&1 || true
  fi
}
for round in $(seq "$ROUNDS"); do
for n in $RANKS; do
  for op in $OPS; do
    for sys in $SYSTEMS; do
      log "round $round/$ROUNDS: $sys $op n=$n"
      fresh_tcp
      case $sys in
        chorus)
          timeout 600 "$PERF" "$op" "${common[@]}" -n "$n" --in-place-only --budget "$BUDGET" --json \
            | sed 's/"system":"chorus"/"system":"chorus"/' >> "$RES" || log "chorus $op n=$n failed" ;;
        chorus-tcp)
          CHORUS_SHM=0 timeout 600 "$PERF" "$op" "${common[@]}" -n "$n" --in-place-only --budget "$BUDGET" --json \
            | sed 's/"system":"chorus"/"system":"chorus-tcp"/' >> "$RES" || log "chorus-tcp $op n=$n failed" ;;
        mpich)
          timeout 600 "$MPICH_VENV/bin/mpiexec" -n "$n" "$MPICH_VENV/bin/python" "$BENCH" \
            --system mpich --op "$op" "${common[@]}" --budget "$BUDGET" >> "$RES" || log "mpich $op n=$n failed" ;;
        openmpi)
          timeout 600 /usr/bin/mpirun.openmpi --oversubscribe --allow-run-as-root -n "$n" \
            "$OMPI_VENV/bin/python" "$BENCH" --system openmpi --op "$op" "${common[@]}" --budget "$BUDGET" \
            >> "$RES" 2>"$OUT/openmpi-$op-$n.err" || log "openmpi $op n=$n failed" ;;
        openmpi-tcp)
          timeout 600 /usr/bin/mpirun.openmpi --oversubscribe --allow-run-as-root --mca pml ob1 --mca btl self,tcp -n "$n" \
            "$OMPI_VENV/bin/python" "$BENCH" --system openmpi-tcp --op "$op" "${common[@]}" --budget "$BUDGET" \
            >> "$RES" 2>"$OUT/openmpi-tcp-$op-$n.err" || log "openmpi-tcp $op n=$n failed" ;;
        tcp-raw)
          # 2 processes only: a ping-pong (the round trip) up to 1 MiB, and
          # for send_recv from 64 KiB one stream's bandwidth (messages back
          # to back; below that it would measure batching, not a transfer).
          if { [ "$op" = ping_pong ] || [ "$op" = send_recv ]; } && [ "$n" = 2 ]; then
            size=$(bytes "$MINBYTES"); top=$(bytes "$MAXBYTES")
            [ "$op" = ping_pong ] && [ "$top" -gt $((1 << 20)) ] && top=$((1 << 20))
            while [ "$size" -le "$top" ]; do
              if [ "$op" = ping_pong ]; then
                timeout 600 "$RAW" "$size" 20000 >> "$RES" || log "tcp-raw size $size failed"
              elif [ "$size" -ge $((64 << 10)) ]; then
                iters=$(( (1 << 30) / size )); [ "$iters" -lt 20 ] && iters=20
                [ "$iters" -gt 20000 ] && iters=20000
                timeout 600 "$RAW" "$size" "$iters" stream >> "$RES" || log "tcp-raw stream size $size failed"
              fi
              size=$((size * FACTOR))
            done
          fi ;;
        gloo)
          timeout 600 "$MPICH_VENV/bin/python" "$BENCH" --system gloo --op "$op" -n "$n" "${common[@]}" \
            --budget "$BUDGET" >> "$RES" 2>"$OUT/gloo-$op-$n.err" || log "gloo $op n=$n failed" ;;
      esac
    done
  done
done
done

"$MPICH_VENV/bin/python" scripts/peer_report.py "$RES" "$OUT" | tee "$OUT/report.md"
log "results in $OUT"
