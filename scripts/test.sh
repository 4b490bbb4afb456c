#!/usr/bin/env bash
# The test command, as in the README and CI: every target of the workspace
# (unit, integration, examples, benches in test mode) under cargo-nextest when
# it is installed (per-test timeouts from .config/nextest.toml; set
# NEXTEST_PROFILE=ci for the CI profile), else plain cargo test; then the
# doctests, which nextest does not run.
#
# Extra arguments go to the first command, e.g. ./scripts/test.sh launcher
set -euo pipefail
cd "$(dirname "$0")/.."

if cargo nextest --version >/dev/null 2>&1; then
  cargo nextest run --workspace --all-targets "$@"
else
  echo "cargo-nextest not found; using cargo test (no per-test timeouts)" >&2
  cargo test --workspace --all-targets "$@"
fi

# The data-path suites again with every link opened on demand: above, the
# small communicators of the tests open all their links at creation
# (CHORUS_LINKS=auto), so this pass covers links that open mid-op, from
# either side or both at once. About 40 s on 2 cores.
lazy_suites=(--test collectives --test cpu_backend --test checksum --test windows
  --test shm_fallback --test faults --test message_counts)
if cargo nextest --version >/dev/null 2>&1; then
  CHORUS_LINKS=lazy cargo nextest run "${lazy_suites[@]}"
else
  CHORUS_LINKS=lazy cargo test "${lazy_suites[@]}"
fi

# The concurrency primitives (sync/, a crate of its own): unit tests, then the
# loom models of the ordering gate and the completion cell (release build;
# about a minute, bounded like the doctests).
(cd sync && cargo test --quiet)
loom_timeout=${CHORUS_LOOM_TIMEOUT:-600}
if command -v timeout >/dev/null 2>&1; then
  (cd sync && timeout "$loom_timeout" cargo test --release --features loom)
else
  (cd sync && cargo test --release --features loom)
fi

# Doctests have no per-test timeout: bound the whole run instead.
doctest_timeout=${CHORUS_DOCTEST_TIMEOUT:-1200}
if command -v timeout >/dev/null 2>&1; then
  timeout "$doctest_timeout" cargo test --workspace --doc
else
  cargo test --workspace --doc
fi
