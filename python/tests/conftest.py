"""Helpers for multi-rank tests: every rank is a process started with the
launcher's environment (chorus.run.rank_env) on loopback, each with a hard
timeout, so a hung rank fails its test instead of hanging the run."""

import os
import secrets
import subprocess
import sys
from pathlib import Path

import pytest

from chorus.run import free_port, rank_env

WORKER = Path(__file__).with_name("_worker.py")
# Per-test limit on the whole group of ranks (seconds).
RANK_TIMEOUT = float(os.environ.get("CHORUS_PYTEST_RANK_TIMEOUT", "120"))


class Ranks:
    def __init__(self, procs):
        self.procs = procs  # (returncode, stdout, stderr) per rank

    def assert_ok(self, scenario, ranks=None):
        for r, (code, out, err) in enumerate(self.procs):
            if ranks is not None and r not in ranks:
                continue
            assert code == 0 and f"OK {scenario}" in out, (
                f"rank {r} exited {code}\n--- stdout\n{out}\n--- stderr\n{err}"
            )


def spawn_ranks(n, *args, extra_env=None, timeout=RANK_TIMEOUT, port=None, joiners=0, worker=WORKER):
    """Run `worker args...` (default `_worker.py`) on `n` ranks (plus
    `joiners` processes with CHORUS_TEST_JOINER=1 and the last rank's
    environment); kill them all on timeout."""
    port = port or free_port()
    secret, job = secrets.token_hex(16), secrets.token_hex(8)
    procs = []
    for r in range(n + joiners):
        env = rank_env(min(r, n - 1), n, port, secret, job)
        env.update(extra_env or {})
        if r >= n:
            env["CHORUS_TEST_JOINER"] = "1"
        procs.append(
            subprocess.Popen(
                [sys.executable, str(worker), *args],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    try:
        for p in procs:
            out, err = p.communicate(timeout=timeout)
            results.append((p.returncode, out, err))
    except subprocess.TimeoutExpired:
        for p in procs:
            p.kill()
        dump = [p.communicate() for p in procs]
        pytest.fail(f"ranks of {args} did not finish within {timeout} s: {dump}")
    return Ranks(results)


@pytest.fixture
def ranks():
    return spawn_ranks
