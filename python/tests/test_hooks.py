"""Hooks as TorchComms' tests use them, on one rank: TorchComms'
tests/unit/py/test_hooks.py, hooks/nan_check/tests/py/test_nan_check.py
and the single-rank cases of hooks/fr/tests/py/FlightRecorderTest.py and
FlightRecorderFinalizeOpIdTest.py, with their sizes and assertions, over
NumPy arrays and (when torch is installed) CPU torch tensors. The
multi-rank flight-recorder cases are scenarios of _worker.py
(test_collectives.py)."""

import datetime
import json
import os
import pickle

import numpy as np
import pytest

import chorus
from chorus import OpName, ReduceOp
from chorus.hooks import FlightRecorderHook, NanCheckHook, clog

try:
    import torch
except ImportError:
    torch = None

ARRAYS = ["numpy"] + (["torch"] if torch is not None else [])


class Arrays:
    """``ones``, ``rand`` and ``tensor`` in NumPy or torch."""

    def __init__(self, kind):
        self.kind = kind

    def ones(self, *shape, dtype="float32"):
        if self.kind == "torch":
            return torch.ones(*shape, dtype=getattr(torch, dtype))
        return np.ones(shape, dtype=dtype)

    def rand(self, *shape):
        if self.kind == "torch":
            return torch.rand(*shape)
        return np.random.default_rng(0).random(shape, dtype=np.float32)

    def tensor(self, values, dtype="float32"):
        if self.kind == "torch":
            return torch.tensor(values, dtype=getattr(torch, dtype))
        return np.array(values, dtype=dtype)


@pytest.fixture(params=ARRAYS)
def arrays(request):
    return Arrays(request.param)


_made = []


def new(name):
    c = chorus.new_comm("cpu", "cpu", name, rank=0, size=1, timeout=datetime.timedelta(seconds=300))
    _made.append(c)
    return c


@pytest.fixture(autouse=True)
def _finalize_leftovers():
    yield
    while _made:
        c = _made.pop()
        try:
            c.finalize()
        except chorus.ChorusError:
            pass


# ------------------------------------------------ TorchComms' test_hooks.py


def test_register_pre_hook(arrays):
    comm = new("test_pre_hook")
    calls = []
    handle = comm.register_pre_hook(lambda name, op_id, args: calls.append(name))
    assert isinstance(handle, chorus.RemovableHandle)
    comm.all_reduce(arrays.ones(10), ReduceOp.SUM, async_op=False)
    assert calls == [OpName.all_reduce]


def test_register_post_hook(arrays):
    comm = new("test_post_hook")
    count = []
    handle = comm.register_post_hook(lambda op_id, args: count.append(op_id))
    assert isinstance(handle, chorus.RemovableHandle)
    comm.all_reduce(arrays.ones(10), ReduceOp.SUM, async_op=False)
    assert len(count) == 1


def test_hook_op_id_correlation(arrays):
    comm = new("test_op_id")
    pre_ids, post_ids = [], []
    comm.register_pre_hook(lambda name, op_id, args: pre_ids.append(op_id))
    comm.register_post_hook(lambda op_id, args: post_ids.append(op_id))
    comm.all_reduce(arrays.ones(10), ReduceOp.SUM, async_op=False)
    comm.barrier(async_op=False)
    assert len(pre_ids) == 2 and pre_ids == post_ids
    assert pre_ids[0] < pre_ids[1]


def test_hook_removal(arrays):
    comm = new("test_removal")
    calls = []
    handle = comm.register_pre_hook(lambda name, op_id, args: calls.append(1))
    t = arrays.ones(10)
    comm.all_reduce(t, ReduceOp.SUM, async_op=False)
    assert len(calls) == 1
    handle.remove()
    comm.all_reduce(t, ReduceOp.SUM, async_op=False)
    assert len(calls) == 1


def test_multiple_hooks(arrays):
    comm = new("test_multi")
    calls = []
    comm.register_pre_hook(lambda name, op_id, args: calls.append("hook1"))
    comm.register_pre_hook(lambda name, op_id, args: calls.append("hook2"))
    comm.all_reduce(arrays.ones(10), ReduceOp.SUM, async_op=False)
    assert calls == ["hook1", "hook2"]


def test_pre_hook_args_typed(arrays):
    comm = new("test_args")
    captured = []
    comm.register_pre_hook(lambda name, op_id, args: captured.append((name, op_id, args)))
    comm.broadcast(arrays.ones(10), root=0, async_op=False)
    (name, op_id, args), = captured
    assert name == OpName.broadcast and isinstance(op_id, int)
    assert isinstance(args, chorus.BroadcastPreHookArgs)
    assert args.root == 0 and args.async_op is False


def test_pre_hook_args_all_reduce(arrays):
    comm = new("test_ar_args")
    captured = []
    comm.register_pre_hook(lambda name, op_id, args: captured.append(args))
    tensor = arrays.ones(10)
    comm.all_reduce(tensor, ReduceOp.SUM, async_op=True).wait()
    (args,) = captured
    assert isinstance(args, chorus.AllReducePreHookArgs)
    assert args.tensor is tensor and args.tensor.shape[0] == 10 and args.async_op is True


def test_register_abort_hook():
    comm = new("test_abort")
    called = []
    handle = comm.register_abort_hook(lambda: called.append(True))
    assert isinstance(handle, chorus.RemovableHandle)
    handle.remove()
    comm.abort("test")
    assert called == []


def test_a_pre_hook_may_stop_an_op_before_it_is_issued():
    comm = new("test_stop")

    def veto(name, op_id, args):
        if name == OpName.all_gather_single:
            raise ValueError("not this one")

    comm.register_pre_hook(veto)
    out = np.full(1, 7.0, dtype=np.float32)
    with pytest.raises(ValueError, match="not this one"):
        comm.all_gather_single(out, np.ones(1, dtype=np.float32))
    assert out[0] == 7.0, "the op did not run"
    comm.barrier()  # the communicator is fine


# ------------------------------------------------ TorchComms' test_nan_check.py


def test_nan_clean_tensor_passes(arrays):
    comm = new("test_clean")
    NanCheckHook().register_with_comm(comm)
    comm.all_reduce(arrays.ones(10), ReduceOp.SUM, async_op=False)


def test_nan_detected_in_input(arrays):
    comm = new("test_nan_input")
    NanCheckHook().register_with_comm(comm)
    with pytest.raises(RuntimeError) as e:
        comm.all_reduce(arrays.tensor([1.0, float("nan"), 3.0]), ReduceOp.SUM, async_op=False)
    assert "all_reduce" in str(e.value) and "test_nan_input" in str(e.value)


def test_nan_in_broadcast(arrays):
    comm = new("test_nan_broadcast")
    NanCheckHook().register_with_comm(comm)
    with pytest.raises(RuntimeError, match="broadcast"):
        comm.broadcast(arrays.tensor([float("nan")]), root=0, async_op=False)


def test_inf_not_detected(arrays):
    comm = new("test_inf")
    NanCheckHook().register_with_comm(comm)
    comm.all_reduce(arrays.tensor([1.0, float("inf"), 3.0]), ReduceOp.SUM, async_op=False)


def test_non_float_tensor_passes(arrays):
    comm = new("test_int")
    NanCheckHook().register_with_comm(comm)
    comm.all_reduce(arrays.tensor([1, 2, 3], dtype="int32"), ReduceOp.SUM, async_op=False)


def test_check_outputs(arrays):
    comm = new("test_check_out")
    NanCheckHook(check_inputs=False, check_outputs=True).register_with_comm(comm)
    output = arrays.tensor([float("nan")])
    with pytest.raises(RuntimeError, match="output"):
        comm.all_gather_single(output, arrays.tensor([1.0]), async_op=False)


def test_nan_in_lists_and_batches(arrays):
    comm = new("test_nan_lists")
    NanCheckHook(check_inputs=True, check_outputs=True).register_with_comm(comm)
    bad = arrays.tensor([float("nan")])
    with pytest.raises(RuntimeError, match="input tensor for 'reduce_scatter'"):
        comm.reduce_scatter(arrays.tensor([0.0]), [bad], ReduceOp.SUM)
    with pytest.raises(RuntimeError, match="output tensor for 'all_to_all'"):
        comm.all_to_all([bad], [arrays.tensor([1.0])])
    batch = comm.batch_op_create()
    batch.send(bad, 0)
    batch.recv(arrays.tensor([0.0]), 0)
    with pytest.raises(RuntimeError, match="batch_op_issue"):
        batch.issue()


def test_barrier_no_tensors():
    comm = new("test_barrier")
    NanCheckHook().register_with_comm(comm)
    comm.barrier(async_op=False)


def test_register_multiple_comms(arrays):
    comm1, comm2 = new("test_multi_1"), new("test_multi_2")
    hook = NanCheckHook()
    hook.register_with_comm(comm1)
    hook.register_with_comm(comm2)
    assert hook.is_enabled()
    t = arrays.ones(10)
    comm1.all_reduce(t, ReduceOp.SUM, async_op=False)
    comm2.all_reduce(t, ReduceOp.SUM, async_op=False)
    with pytest.raises(RuntimeError, match="test_multi_1"):
        comm1.all_reduce(arrays.tensor([float("nan")]), ReduceOp.SUM, async_op=False)


def test_nan_hook_is_enabled():
    hook = NanCheckHook()
    assert not hook.is_enabled()
    hook.register_with_comm(new("test_enabled"))
    assert hook.is_enabled()


# ------------------------------------------------ TorchComms' FlightRecorderTest.py

REQUIRED = {
    "record_id": int, "pg_id": int, "process_group": list, "collective_seq_id": int,
    "p2p_seq_id": int, "op_id": int, "profiling_name": str, "input_sizes": list,
    "input_dtypes": list, "output_sizes": list, "output_dtypes": list,
    "time_created_ns": int, "state": str, "is_p2p": bool, "retired": bool, "timeout_ms": int,
}


def validate_entry(entry, backend="cpu"):
    for field, kind in REQUIRED.items():
        assert field in entry, f"missing {field!r} in {entry}"
        assert isinstance(entry[field], kind), (field, entry[field])
    assert len(entry["process_group"]) == 2
    assert entry["state"] in ("scheduled", "started", "completed")
    assert entry["profiling_name"].startswith(f"{backend}:")
    assert entry["time_created_ns"] > 0 and entry["timeout_ms"] > 0
    if "duration_ms" in entry:
        assert entry["duration_ms"] >= 0


def entries(recorder, include_completed=True):
    return json.loads(recorder.dump_json(include_completed)).get("entries", [])


def test_create_flight_recorder():
    recorder = FlightRecorderHook(isolated=True)
    assert recorder.size() == 0 and not recorder.is_enabled()
    assert FlightRecorderHook(max_entries=100, isolated=True).size() == 0


def test_dump_json_empty():
    data = json.loads(FlightRecorderHook(isolated=True).dump_json())
    assert data["version"] == "2.10" and "pg_config" in data and "pg_status" in data


def test_size_across_reset(arrays):
    comm = new("test_size_reset")
    recorder = FlightRecorderHook(max_entries=100, isolated=True)
    recorder.register_with_comm(comm)
    t = arrays.rand(10, 10)
    assert recorder.size() == 0
    comm.all_reduce(t, ReduceOp.SUM)
    assert recorder.size() == 1
    comm.all_reduce(t, ReduceOp.SUM)
    assert recorder.size() == 2
    recorder.reset()
    assert recorder.size() == 0
    comm.all_reduce(t, ReduceOp.SUM)
    assert recorder.size() == 1


@pytest.mark.parametrize("size,before,after", [(100, 5, 4), (10, 10, 10), (10, 10, 3)])
def test_fr_record_reset_and_the_ring(arrays, size, before, after):
    comm = new(f"test_comm_reset_{size}_{before}_{after}")
    recorder = FlightRecorderHook(max_entries=size, isolated=True)
    recorder.register_with_comm(comm)
    t = arrays.rand(10, 10)
    for _ in range(before):
        comm.all_reduce(t, ReduceOp.SUM)
    assert len(entries(recorder)) == min(before, size)
    recorder.reset()
    assert entries(recorder) == []
    for _ in range(after):
        comm.all_reduce(t, ReduceOp.SUM)
    got = entries(recorder)
    assert len(got) == after
    for e in got:
        validate_entry(e)
        assert e["profiling_name"] == "cpu:all_reduce"


def test_fr_ring_keeps_the_newest(arrays):
    comm = new("test_ring_newest")
    recorder = FlightRecorderHook(max_entries=4, isolated=True)
    recorder.register_with_comm(comm)
    ids = []
    comm.register_post_hook(lambda op_id, args: ids.append(op_id))
    for _ in range(9):
        comm.barrier()
    assert [e["op_id"] for e in entries(recorder)] == ids[-4:]
    assert recorder.size() == 9


def test_fr_multiple_collective_operations_and_ordering(arrays):
    comm = new("test_comm_multi_ops")
    recorder = FlightRecorderHook(max_entries=100, isolated=True)
    recorder.register_with_comm(comm)
    t = arrays.rand(10, 10)
    comm.all_reduce(t, ReduceOp.SUM)
    comm.broadcast(t, root=0)
    comm.all_reduce(t, ReduceOp.SUM)
    got = entries(recorder, True)
    assert [e["profiling_name"] for e in got] == ["cpu:all_reduce", "cpu:broadcast",
                                                  "cpu:all_reduce"]
    for prev, e in zip(got, got[1:]):
        assert e["record_id"] > prev["record_id"]
        assert e["time_created_ns"] >= prev["time_created_ns"]
        assert e["collective_seq_id"] == prev["collective_seq_id"] + 1
    for e in got:
        validate_entry(e)
        assert e["state"] == "completed" and e["retired"] and e["duration_ms"] >= 0


def test_fr_tensor_sizes_and_dtypes(arrays):
    comm = new("test_comm_sizes")
    recorder = FlightRecorderHook(max_entries=100, isolated=True)
    recorder.register_with_comm(comm)
    comm.all_reduce(arrays.ones(3, 4, dtype="float32"), ReduceOp.SUM)
    comm.all_reduce(arrays.ones(5, 6, dtype="int64"), ReduceOp.SUM)
    first, second = entries(recorder)
    assert [3, 4] in first["input_sizes"] and "Float" in first["input_dtypes"]
    assert [5, 6] in second["input_sizes"] and "Long" in second["input_dtypes"]


def test_fr_ranks_str_and_enable(arrays):
    comm = new("test_comm_single_rank")
    recorder = FlightRecorderHook(max_entries=100, isolated=True)
    assert not recorder.is_enabled()
    recorder.register_with_comm(comm)
    assert recorder.is_enabled()
    config = json.loads(recorder.dump_json())["pg_config"]["test_comm_single_rank"]
    assert config["ranks"] == "[0]" and config["desc"] == "cpu"


def test_fr_dump_to_configured_file_and_only_active(arrays, tmp_path, monkeypatch):
    comm = new("test_comm_dump_file")
    recorder = FlightRecorderHook(max_entries=100, isolated=True)
    recorder.register_with_comm(comm)
    t = arrays.rand(10, 10)
    for _ in range(3):
        comm.all_reduce(t, ReduceOp.SUM)
    monkeypatch.setenv("TORCHCOMM_FR_DUMP_DYNAMIC_FILE_NAME", "1")
    path = tmp_path / "fr_trace_0"
    monkeypatch.setenv("TORCHCOMM_FR_DUMP_TEMP_FILE", str(path))
    assert recorder.dump_file(0) == str(path)
    with open(path, "rb") as f:
        data = pickle.load(f)
    assert data["version"] == "2.10" and len(data["entries"]) == 3
    assert all(e["profiling_name"] == "cpu:all_reduce" for e in data["entries"])
    recorder.dump_file(0, False)
    with open(path, "rb") as f:
        assert pickle.load(f)["entries"] == []
    assert entries(recorder, False) == [] and len(entries(recorder, True)) == 3
    # Without the dynamic name, the rank follows the prefix.
    monkeypatch.delenv("TORCHCOMM_FR_DUMP_DYNAMIC_FILE_NAME")
    monkeypatch.setenv("TORCHCOMM_FR_DUMP_TEMP_FILE", str(tmp_path / "prefix_"))
    assert recorder.dump_file(0) == str(tmp_path / "prefix_0")


def test_finalize_does_not_consume_op_id(arrays):
    """FlightRecorderFinalizeOpIdTest: finalize takes no id of the
    sequence, so two communicators' ops in a row have consecutive ids."""
    recorder = FlightRecorderHook(max_entries=100, isolated=True)
    comm1 = new("fr_finalize_op_id_1")
    recorder.register_with_comm(comm1)
    t = arrays.rand(4)
    comm1.all_reduce(t, ReduceOp.SUM)
    comm1.finalize()
    comm2 = new("fr_finalize_op_id_2")
    recorder.register_with_comm(comm2)
    comm2.all_reduce(t, ReduceOp.SUM)
    assert recorder.size() == 2
    op_ids = sorted(e["op_id"] for e in entries(recorder))
    assert len(op_ids) == 2 and op_ids[1] - op_ids[0] == 1, op_ids


def test_fr_follows_split_children_and_pending_ops_stay_scheduled(arrays):
    comm = new("test_fr_split")
    recorder = FlightRecorderHook(max_entries=100, isolated=True)
    recorder.register_with_comm(comm)
    child = comm.split([0], "test_fr_split_child")
    _made.append(child)
    child.all_reduce(arrays.ones(2), ReduceOp.SUM)
    got = entries(recorder)
    assert [(e["process_group"][0], e["profiling_name"]) for e in got] == [
        ("test_fr_split", "cpu:split"), ("test_fr_split_child", "cpu:all_reduce")], got
    assert all(e["state"] == "completed" for e in got), got
    # An op Chorus rejects before issuing it (a send to this rank itself)
    # is retired too: every entry has its post.
    with pytest.raises(chorus.InvalidArgumentError):
        comm.send(arrays.ones(2), 0)
    assert entries(recorder, False) == []
    assert entries(recorder)[-1]["profiling_name"] == "cpu:send 0->0"


# ------------------------------------------------ TorchComms' ClogHookTest.py


def read_lines(path):
    with open(path) as f:
        return [line.strip() for line in f if line.strip()]


def test_clog_end_to_end(arrays, tmp_path):
    path = tmp_path / "clog_test.log"
    handle = clog(output=str(path), events=["ALL"])
    lines = read_lines(path)
    assert lines and lines[0].startswith("V|1|base_timestamp=")
    comm = new("test_clog_comm")
    handle.register_with_comm(comm)
    assert any("new_comm|comm=test_clog_comm" in ln for ln in read_lines(path))
    t = arrays.ones(1024)
    comm.all_reduce(t, ReduceOp.SUM, async_op=False)
    comm.all_reduce(t, ReduceOp.SUM, async_op=False)
    lines = read_lines(path)
    sig = "sig|all_reduce|in_count=1024|out_count=1024|dtype=f32|red_op=sum"
    assert sum(sig in ln for ln in lines) == 1, "a signature is logged once"
    comm.broadcast(arrays.ones(256), root=0, async_op=False)
    assert any("sig|broadcast|in_count=256|out_count=256|dtype=f32|root=0" in ln
               for ln in read_lines(path))
    comm.barrier(async_op=False)
    assert any("sig|barrier|async_op=f" in ln for ln in read_lines(path))
    comm.all_reduce(arrays.ones(128, dtype="float16"), ReduceOp.SUM, async_op=False)
    lines = read_lines(path)
    assert any("dtype=f16|red_op=sum" in ln for ln in lines)
    # Every issue is a Q event, and each op started and ended.
    q = [ln for ln in lines if "|Q|" in ln]
    assert len(q) == 5, q
    assert sum("|S|" in ln for ln in lines) == 5 and sum("|E|" in ln for ln in lines) == 5
    first = next(ln for ln in lines if sig in ln).split("|")[0]
    assert sum(ln.startswith(first + "|Q|") for ln in lines) == 2
    with pytest.raises(RuntimeError, match="already registered"):
        handle.register_with_comm(comm)


def test_clog_multiple_comms_shared_handle(arrays, tmp_path):
    path = tmp_path / "clog_multi.log"
    handle = clog(output=str(path), events=["ALL"])
    comm_a, comm_b = new("comm_a"), new("comm_b")
    handle.register_with_comm(comm_a)
    handle.register_with_comm(comm_b)
    t = arrays.ones(64)
    comm_a.all_reduce(t, ReduceOp.SUM)
    comm_b.all_reduce(t, ReduceOp.SUM)
    lines = read_lines(path)
    assert any("comm=comm_a" in ln for ln in lines) and any("comm=comm_b" in ln for ln in lines)


def test_clog_independent_handles(arrays, tmp_path):
    path_a, path_b = tmp_path / "clog_a.log", tmp_path / "clog_b.log"
    clog_a = clog(output=str(path_a), events=["ALL"])
    clog_b = clog(output=str(path_b), events=["ALL"])
    comm_a, comm_b = new("iso_a"), new("iso_b")
    clog_a.register_with_comm(comm_a)
    clog_b.register_with_comm(comm_b)
    t = arrays.ones(32)
    comm_a.all_reduce(t, ReduceOp.SUM)
    comm_b.all_reduce(t, ReduceOp.SUM)
    lines_a, lines_b = read_lines(path_a), read_lines(path_b)
    assert any("comm=iso_a" in ln for ln in lines_a)
    assert not any("comm=iso_b" in ln for ln in lines_a)
    assert any("comm=iso_b" in ln for ln in lines_b)
    assert not any("comm=iso_a" in ln for ln in lines_b)


def test_clog_splits_signatures_buffers_and_leaks(tmp_path):
    path = tmp_path / "clog_split.log"
    handle = clog(output=str(path), events=["Q"], verbose=["buffers"])
    comm = new("clog_parent")
    handle.register_with_comm(comm)
    child = comm.split([0], "clog_child")
    _made.append(child)
    out = np.zeros(4, dtype=np.float32)
    x = np.ones(4, dtype=np.float32)
    child.all_gather_single(out, x)
    comm.all_to_all_v_single(out, x, [4], [4], async_op=True).wait()
    lines = read_lines(path)
    assert "split|parent=clog_parent|child=clog_child|ranks=0" in lines, lines
    assert any(f"sig|all_gather_single|in_count=4|out_count=4|dtype=f32|async_op=f"
               f"|in={hex(x.ctypes.data)}|out={hex(out.ctypes.data)}|comm=clog_child" in ln
               for ln in lines), lines
    assert any("sig|all_to_all_v_single|in_splits=4|out_splits=4|dtype=f32|async_op=t" in ln
               for ln in lines), lines
    assert not any("|S|" in ln for ln in lines), "no lifecycle events without ALL"
    # Even an op Chorus rejected has its post call: when the last
    # communicator finalizes, no op is left unfinished (no WARN line).
    with pytest.raises(chorus.InvalidArgumentError):
        comm.recv(np.zeros(1, dtype=np.float32), 0)
    child.finalize()
    comm.finalize()
    _made.remove(child)
    _made.remove(comm)
    lines = read_lines(path)
    assert any("sig|recv|in_count=0|out_count=1|dtype=f32|peer=0" in ln for ln in lines), lines
    assert not any(ln.startswith("WARN") for ln in lines), lines
