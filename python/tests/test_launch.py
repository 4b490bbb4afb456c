"""The launcher (python -m chorus.run), the example, torchrun conventions."""

import os
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import chorus
from chorus.run import free_port

from conftest import spawn_ranks

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_ddp_style.py"


def launch(*args, timeout=120, env=None):
    return subprocess.run(
        [sys.executable, "-m", "chorus.run", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_launcher_sets_the_environment_of_every_rank(tmp_path):
    script = tmp_path / "env.py"
    script.write_text(
        textwrap.dedent(
            """
            import os
            keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                    "MASTER_PORT", "CHORUS_SECRET", "CHORUS_JOB_ID", "CHORUS_RANK"]
            print(" ".join(f"{k}={os.environ.get(k)}" for k in keys))
            """
        )
    )
    env = dict(os.environ, CHORUS_RANK="7", CHORUS_SIZE="9")
    env.pop("CHORUS_SECRET", None)
    res = launch("-n", "3", str(script), env=env)
    assert res.returncode == 0, res.stderr
    lines = sorted(res.stdout.splitlines())
    assert len(lines) == 3, res.stdout
    seen = []
    for r, line in enumerate(lines):
        assert line.startswith(f"[rank {r}] "), line
        kv = dict(item.split("=", 1) for item in line.split("] ", 1)[1].split())
        assert kv["RANK"] == kv["LOCAL_RANK"] == str(r)
        assert kv["WORLD_SIZE"] == kv["LOCAL_WORLD_SIZE"] == "3"
        assert kv["MASTER_ADDR"] == "127.0.0.1"
        assert kv["CHORUS_RANK"] == "None", "launcher variables must be removed"
        assert len(kv["CHORUS_SECRET"]) == 64
        seen.append((kv["MASTER_PORT"], kv["CHORUS_SECRET"], kv["CHORUS_JOB_ID"]))
    assert len(set(seen)) == 1, "every rank must share port, secret and job id"


def test_a_failing_rank_stops_the_others_and_sets_the_exit_code(tmp_path):
    script = tmp_path / "fail.py"
    # Rank 1 fails; rank 0 would wait forever for a signal: the launcher
    # must stop it.
    script.write_text(
        "import os, signal, sys\n"
        "if os.environ['RANK'] == '1':\n"
        "    sys.exit(3)\n"
        "signal.pause()\n"
    )
    res = launch("-n", "2", "--grace", "5", str(script))
    assert res.returncode == 3, (res.returncode, res.stderr)
    assert "rank 1 exited with status 3" in res.stderr


def test_communicators_come_and_go_with_rank_0_finalizing_late(tmp_path):
    """Under python -m chorus.run rank 0 hosts the store: five communicators
    in sequence on 4 ranks, as TorchComms' setUp/tearDown make them, with
    rank 0 finalizing 1 s after the others in every other one (the others
    meanwhile create the next), under a reused name and fresh ones."""
    script = tmp_path / "cycles.py"
    script.write_text(
        textwrap.dedent(
            """
            import time
            import numpy as np
            import chorus
            for cycle in range(5):
                name = "cycle" if cycle % 2 == 0 else f"cycle{cycle}"
                comm = chorus.new_comm("cpu", "cpu", name)
                t = np.ones(4, dtype=np.float32)
                comm.all_reduce(t, chorus.ReduceOp.SUM)
                assert t.tolist() == [4.0] * 4, t
                if comm.get_rank() == 0 and cycle % 2 == 1:
                    time.sleep(1.0)
                comm.finalize()
            print("cycles ok")
            """
        )
    )
    res = launch("-n", "4", str(script), timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.count("cycles ok") == 4, res.stdout


def test_launcher_timeout_exits_124(tmp_path):
    script = tmp_path / "hang.py"
    script.write_text("import signal\nsignal.pause()\n")
    res = launch("-n", "2", "--timeout", "1", str(script))
    assert res.returncode == 124, res.stderr


def test_example_trains_ddp_style_on_4_ranks():
    res = launch("-n", "4", str(EXAMPLE), timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr
    done = [line for line in res.stdout.splitlines() if ": done" in line]
    assert len(done) == 4, res.stdout


def test_example_with_torch():
    pytest.importorskip("torch")
    res = launch("-n", "2", str(EXAMPLE), "--torch", timeout=240)
    assert res.returncode == 0, res.stdout + res.stderr


def test_torchrun_environment_without_secret_is_a_clear_error(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "29500")
    monkeypatch.delenv("CHORUS_SECRET", raising=False)
    monkeypatch.delenv("CHORUS_STORE_ADDR", raising=False)
    with pytest.raises(chorus.ConfigError) as e:
        chorus.new_comm("cpu", "cpu", "torchrun-no-secret")
    msg = str(e.value)
    assert "CHORUS_SECRET" in msg and "torchrun" in msg and "chorus.run" in msg


def test_quic_store_shares_master_port_with_a_tcp_store():
    """torchrun's TCPStore listens on TCP MASTER_PORT; Chorus's store is
    QUIC, i.e. UDP on the same port number: both work at once."""
    port = free_port()
    tcp_store = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    tcp_store.bind(("127.0.0.1", port))
    tcp_store.listen()
    try:
        spawn_ranks(2, "mismatch", port=port).assert_ok("mismatch")
        # The TCP listener still accepts connections.
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            conn, _ = tcp_store.accept()
            conn.close()
    finally:
        tcp_store.close()


def test_under_torchrun_with_gloo_on_the_same_master_port(tmp_path):
    """A real torchrun launch: its agent hosts torch's TCPStore on TCP
    MASTER_PORT, every worker joins a gloo process group through it and a
    Chorus communicator through Chorus's QUIC store on UDP MASTER_PORT, and
    the two give the same all_reduce."""
    pytest.importorskip("torch.distributed")
    script = tmp_path / "both.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, time
            import numpy as np
            import torch
            import torch.distributed as dist
            import chorus

            dist.init_process_group("gloo")
            t0 = time.perf_counter()
            comm = chorus.new_comm("cpu", "cpu", "beside-torch", connect_timeout=60)
            boot = time.perf_counter() - t0
            rank = comm.get_rank()
            assert rank == dist.get_rank() and comm.get_size() == dist.get_world_size()
            x = torch.arange(8, dtype=torch.float32) * (rank + 1)
            y = x.clone()
            dist.all_reduce(x)
            comm.all_reduce(y, chorus.ReduceOp.SUM)
            assert torch.equal(x, y), (x, y)
            dist.barrier()
            comm.finalize()
            dist.destroy_process_group()
            print(f"OK rank {rank} port {os.environ['MASTER_PORT']} chorus bootstrap {boot * 1e3:.1f} ms")
            """
        )
    )
    env = dict(os.environ, CHORUS_SECRET=os.urandom(16).hex())
    port = free_port()
    res = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
         "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)],
        capture_output=True,
        text=True,
        timeout=240,
        env=env,
    )
    assert res.returncode == 0, res.stdout + res.stderr
    # The ranks' lines may interleave on the shared stdout.
    ok = re.findall(r"OK rank (\d) port (\d+) chorus bootstrap ([\d.]+) ms", res.stdout)
    assert sorted(r for r, _, _ in ok) == ["0", "1"], res.stdout
    assert all(p == str(port) for _, p, _ in ok), res.stdout
    print(ok)
