#!/usr/bin/env bash
# The Python package's tests: a venv (.venv-py/, gitignored) with maturin,
# numpy and pytest from PyPI; the extension built in the dev profile into
# the root's target/ (python/Cargo.toml mirrors the root's dev profile, so
# the dependencies ./scripts/test.sh compiled are reused) and installed
# editable; then pytest on python/tests/ (numpy only; torch tests skip
# without torch). Every multi-rank test kills its ranks after
# CHORUS_PYTEST_RANK_TIMEOUT seconds (120); the whole run is bounded too.
#
# Needs CPython >= 3.11 (PYTHON=..., default python3) and a Rust toolchain.
# Extra arguments go to pytest, e.g. ./scripts/python-test.sh -k grid
# --torch (first argument; or CHORUS_PY_TORCH=1) also installs torch from
# PyPI (several GB, with its CUDA libraries) into target/torch-venv (unless
# CHORUS_PY_VENV names another), so that the torch tests run: the
# torch.distributed backend (DDP, FSDP, device meshes), the real torchrun
# launch. CI runs without it (the torch tests skip):
#   ./scripts/python-test.sh --torch [-k torch]
set -euo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = --torch ]; then
  shift
  export CHORUS_PY_TORCH=1
  export CHORUS_PY_VENV=${CHORUS_PY_VENV:-target/torch-venv}
fi

python=${PYTHON:-python3}
venv=${CHORUS_PY_VENV:-.venv-py}
"$python" -c 'import sys; sys.exit(sys.version_info < (3, 11))' || {
  echo "python-test.sh: needs CPython >= 3.11 (set PYTHON=...)" >&2
  exit 2
}
if [ ! -x "$venv/bin/python" ]; then
  "$python" -m venv "$venv"
fi
venv=$(cd "$venv" && pwd)
"$venv/bin/python" -m pip install --quiet --disable-pip-version-check \
  "maturin>=1.9,<2" numpy pytest
if [ "${CHORUS_PY_TORCH:-0}" = 1 ]; then
  "$venv/bin/python" -m pip install --quiet --disable-pip-version-check torch expecttest pydot
fi

export CARGO_TARGET_DIR="$PWD/target"
(cd python && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" \
  maturin develop --quiet --profile dev)

timeout "${CHORUS_PYTEST_TIMEOUT:-900}" \
  "$venv/bin/python" -m pytest -q python/tests "$@"
