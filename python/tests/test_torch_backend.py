"""The ``chorus`` torch.distributed backend (``chorus.torch``) on 4 ranks:
every c10d op against a reference, futures, subgroups and device meshes,
mismatches, monitored_barrier, and DDP and FSDP training against gloo.
Skipped without torch (``./scripts/python-test.sh --torch``
installs it)."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch.distributed")

from conftest import RANK_TIMEOUT  # noqa: E402

WORKER = Path(__file__).with_name("_torch_worker.py")
EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.mark.parametrize(
    "scenario",
    [
        "collectives",
        "futures",
        "groups",
        "mismatch",
        "monitored_barrier_names_the_missing_rank",
        "device_mesh_over_communicators",
    ],
)
def test_torch_backend(ranks, scenario):
    ranks(4, scenario, worker=WORKER).assert_ok(scenario)


def _launch(*args):
    return subprocess.run(
        [sys.executable, "-m", "chorus.run", "-n", "4", *args],
        capture_output=True,
        text=True,
        timeout=RANK_TIMEOUT * 2,
    )


def test_ddp_trains_to_the_same_weights_as_gloo():
    res = _launch(str(EXAMPLES / "train_ddp.py"), "--steps", "30")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "largest |chorus - gloo| weight difference" in res.stdout, res.stdout


def test_fsdp_trains_to_the_same_weights_as_gloo():
    res = _launch(str(EXAMPLES / "train_fsdp.py"), "--steps", "20")
    assert res.returncode == 0, res.stdout + res.stderr
    assert "largest |chorus - gloo| weight difference" in res.stdout, res.stdout
