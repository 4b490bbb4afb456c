#!/usr/bin/env bash
# Build an example and the launcher, then run the example on N local ranks.
#
#   ./scripts/run-example.sh NAME [N] [-- EXAMPLE ARGS...]
#
# NAME is a file in examples/ without .rs (all_reduce, async_all_reduce,
# send_recv); N defaults to 4. Environment:
#   CHORUS_PROFILE      cargo profile to build with: dev (default; shares the
#                       build with ./scripts/test.sh) or release
#   CHORUS_RUN_TIMEOUT  seconds before chorus-run stops every rank (default 300)
#   CHORUS_BACKEND      backend name the examples pass to new_comm (default cpu)
set -euo pipefail
cd "$(dirname "$0")/.."

usage() { echo "usage: $0 NAME [N] [-- ARGS...]   (NAME: $(ls examples | sed -n 's/\.rs$//p' | tr '\n' ' '))" >&2; exit 2; }
[ $# -ge 1 ] || usage
name=$1; shift
[ -f "examples/$name.rs" ] || { echo "no example named '$name'" >&2; usage; }
n=4
if [ $# -ge 1 ] && [ "$1" != "--" ]; then n=$1; shift; fi
[ $# -ge 1 ] && [ "$1" = "--" ] && shift

profile=${CHORUS_PROFILE:-dev}
case $profile in
  dev) dir=debug ;;
  release) dir=release ;;
  *) echo "CHORUS_PROFILE must be dev or release, not '$profile'" >&2; exit 2 ;;
esac
target=${CARGO_TARGET_DIR:-target}

cargo build --profile "$profile" --example "$name" --bin chorus-run
exec "$target/$dir/chorus-run" -n "$n" --timeout "${CHORUS_RUN_TIMEOUT:-300}" -- \
  "$target/$dir/examples/$name" "$@"
