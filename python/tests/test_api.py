"""Single-process tests of the API surface (a world of one rank, no network)."""

import datetime
import gc
import weakref

import numpy as np
import pytest

import chorus
from chorus import ReduceOp


@pytest.fixture
def comm():
    c = chorus.new_comm("cpu", "cpu", "api", rank=0, size=1, timeout=datetime.timedelta(seconds=30))
    yield c
    if not c.is_aborted():
        c.finalize()


def test_identity_and_timeout(comm):
    assert (comm.get_rank(), comm.get_size(), comm.get_name()) == (0, 1, "api")
    assert comm.get_backend() == "cpu"
    assert str(comm.get_device()) == "cpu"
    assert comm.get_timeout() == datetime.timedelta(seconds=30)
    assert comm.is_abort_supported() and not comm.is_aborted()
    assert comm.health()["active"] is True


def test_reduce_op_names_and_premul_sum():
    assert ReduceOp.SUM.type is chorus.RedOpType.SUM
    p = ReduceOp.PREMUL_SUM(0.5)
    assert p.type is chorus.RedOpType.PREMUL_SUM and p == ReduceOp.PREMUL_SUM(0.5)
    assert ReduceOp.PREMUL_SUM(np.float32(2.0)) == ReduceOp.PREMUL_SUM(2.0)
    # This rank's factor in a one-element tensor, as TorchComms passes it.
    assert ReduceOp.PREMUL_SUM(np.array([0.25], dtype=np.float32)) == ReduceOp.PREMUL_SUM(0.25)
    with pytest.raises(TypeError):
        ReduceOp.PREMUL_SUM(np.ones(3))
    assert {repr(o) for o in (ReduceOp.AVG, p)} == {"ReduceOp.AVG", "ReduceOp.PREMUL_SUM(0.5)"}


def test_error_hierarchy():
    for name in chorus._errors.__all__:
        assert issubclass(getattr(chorus, name), chorus.ChorusError)
    assert issubclass(chorus.TimeoutError, TimeoutError)
    assert issubclass(chorus.InvalidArgumentError, ValueError)


def test_premul_sum_scales_in_place(comm):
    t = np.arange(5, dtype=np.float64)
    comm.all_reduce(t, ReduceOp.PREMUL_SUM(3.0))
    assert np.array_equal(t, 3.0 * np.arange(5))


def test_work_wait_twice_and_is_completed(comm):
    t = np.ones(1000, dtype=np.float32)
    w = comm.all_reduce(t, ReduceOp.SUM, async_op=True)
    w.wait()
    w.wait()
    w.wait_blocking()
    assert w.is_completed() and "completed" in repr(w)


def test_wrong_sizes_are_errors_not_corruption(comm):
    out = np.zeros(3, dtype=np.float32)
    with pytest.raises(chorus.InvalidArgumentError):
        comm.all_gather_single(out, np.ones(4, dtype=np.float32))
    with pytest.raises(TypeError):
        comm.all_gather_single(np.zeros(4, dtype=np.int32), np.ones(4, dtype=np.float32))
    with pytest.raises(chorus.InvalidArgumentError):
        comm.broadcast(np.ones(2, dtype=np.float32), 5)
    with pytest.raises(ValueError):
        comm.all_gather([], np.ones(2, dtype=np.float32))
    assert (out == 0).all()


def test_ops_after_finalize_and_abort(comm):
    comm.abort("test")
    assert comm.is_aborted()
    with pytest.raises(chorus.AbortedError) as e:
        comm.barrier()
    assert e.value.fatal
    c2 = chorus.new_comm("cpu", "cpu", "api-fin", rank=0, size=1)
    c2.finalize()
    with pytest.raises(chorus.FinalizedError):
        c2.all_reduce(np.ones(1, dtype=np.float32), ReduceOp.SUM)


def test_unknown_backend_and_unsupported_options():
    with pytest.raises(chorus.UnknownBackendError):
        chorus.new_comm("nope", "cpu", "x", rank=0, size=1)
    with pytest.raises(ValueError):
        chorus.new_comm("cpu", "cpu", "x", abort_process_on_timeout_or_error=True, rank=0, size=1)
    with pytest.raises(TypeError):
        chorus.new_comm("cpu", "cpu", "x", store=object(), rank=0, size=1)


def test_an_in_flight_op_keeps_its_array_alive_until_waited_on(comm):
    a = np.full(1 << 14, 2, dtype=np.float32)
    ref = weakref.ref(a)
    w = comm.all_reduce(a, ReduceOp.SUM, async_op=True)
    del a
    gc.collect()
    assert ref() is not None, "the array was freed while its op was in flight"
    w.wait()
    chorus._chorus._release_parked()
    gc.collect()
    assert ref() is None, "the op kept the array after it was waited on"


def copies():
    return chorus._chorus._copy_stats()


def test_in_place_ops_on_aligned_arrays_copy_nothing(comm):
    a = np.ones(1 << 16, dtype=np.float32)
    before = copies()
    comm.all_reduce(a, ReduceOp.SUM)
    comm.broadcast(a, 0)
    out = np.zeros(1 << 16, dtype=np.float32)
    comm.all_gather_single(out, a)
    assert copies() == before, "an aligned, writable array was copied"
    assert (out == 1).all()


def test_unaligned_views_are_copied_in_and_back_out(comm):
    base = np.zeros(9, dtype=np.int8)
    view = base[1:]
    view[:] = 7
    before = copies()
    comm.all_reduce(view, ReduceOp.SUM)
    after = copies()
    assert (after[0] - before[0], after[1] - before[1]) == (8, 8)
    assert base[0] == 0 and (view == 7).all()


def test_bool_arrays_reduce_logically_and_refuse_avg(comm):
    a = np.array([True, False, True])
    comm.all_reduce(a, ReduceOp.PRODUCT)
    assert a.tolist() == [True, False, True]
    b = np.zeros(2, dtype=bool)
    comm.broadcast(b, 0)
    assert b.tolist() == [False, False]
    with pytest.raises(chorus.UnsupportedOpError):
        comm.all_reduce(a, ReduceOp.AVG)


def test_hints_options_timeout_and_backend_version():
    c = chorus.new_comm("cpu", "cpu", "api-hints", rank=0, size=1, hints={"chorus.tag": "base", "x": 1})
    try:
        opts = c.get_options()
        assert opts.hints == {"chorus.tag": "base", "x": "1"}, opts
        assert opts.timeout == datetime.timedelta(minutes=10)
        c.set_timeout(datetime.timedelta(seconds=7))
        assert c.get_timeout() == c.get_options().timeout == datetime.timedelta(seconds=7)
        assert "chorus" in c.get_backend_version()
        # A malformed value of a known hint is refused, per op and per communicator.
        with pytest.raises(chorus.InvalidArgumentError):
            c.barrier(hints={"chorus.record": "maybe"})
        with pytest.raises(chorus.InvalidArgumentError):
            chorus.new_comm("cpu", "cpu", "api-bad", rank=0, size=1, hints={"chorus.record": "maybe"})
        # chorus.record=false keeps an op out of the flight recorder.
        c.barrier(hints={"chorus.record": "false"})
        c.barrier(hints={"chorus.tag": "mine"})
        assert [e["tag"] for e in c.flight_record()] == ["mine"], c.flight_record()
    finally:
        c.finalize()


def test_abort_hook_is_called_once_with_or_without_the_cause():
    import threading

    c = chorus.new_comm("cpu", "cpu", "api-abort-hook", rank=0, size=1)
    plain, cause = threading.Event(), []
    done = threading.Event()
    c.register_abort_hook(plain.set)
    c.register_abort_hook(lambda a: (cause.append(a), done.set()))
    removed = c.register_abort_hook(lambda: cause.append("removed hook ran"))
    removed.remove()
    c.abort("bye")
    assert plain.wait(10) and done.wait(10)
    assert len(cause) == 1 and isinstance(cause[0].cause, chorus.AbortedError), cause
    assert "bye" in str(cause[0].cause) and cause[0].comm == "api-abort-hook"


def test_a_raising_pre_hook_stops_the_op_and_a_raising_post_hook_goes_to_unraisablehook(
    comm, monkeypatch
):
    import sys
    import threading

    got, ran = [], threading.Event()
    monkeypatch.setattr(sys, "unraisablehook", lambda u: (got.append(u.exc_value), ran.set()))

    class Stop(RuntimeError):
        pass

    def bad(name, op_id, args):
        raise Stop(f"no {name} today")

    seen = []
    handle = comm.register_pre_hook(bad)
    comm.register_post_hook(lambda op_id, args: seen.append(op_id))
    t = np.ones(4, dtype=np.float32)
    with pytest.raises(Stop, match="no all_reduce today"):
        comm.all_reduce(t, ReduceOp.SUM)
    assert seen == [], "an op a pre hook stopped was not issued"
    handle.remove()
    handle.remove()  # a second remove does nothing

    def bad_post(op_id, args):
        raise RuntimeError("post hook bug")

    bad_handle = comm.register_post_hook(bad_post)
    comm.all_reduce(t, ReduceOp.SUM)
    assert ran.wait(10) and isinstance(got[0], RuntimeError), got
    assert (t == 1).all() and len(seen) == 1
    bad_handle.remove()


def test_typed_pre_hook_args_carry_the_tensors_and_lifecycle_events_reach_the_hooks():
    """TorchComms' tests/unit/py/test_hooks.py on one rank, plus the
    lifecycle events (split, new_window, finalize)."""
    c = chorus.new_comm("cpu", "cpu", "api-typed-hooks", rank=0, size=1)
    pre, post = [], []
    c.register_pre_hook(lambda name, op_id, args: pre.append((name, op_id, args)))
    c.register_post_hook(lambda op_id, args: post.append((op_id, args)))
    t = np.ones(10, dtype=np.float32)
    out = np.zeros(10, dtype=np.float32)
    c.broadcast(t, root=0)
    c.all_reduce(t, ReduceOp.SUM, async_op=True).wait()
    c.all_gather_single(out, t)
    c.all_to_all_v_single(out, t, [10], [10])
    c.barrier()
    child = c.split([0], "api-typed-hooks-child")
    win = c.new_window(size=16)
    win.free()
    c.finalize()
    names = [n for n, _, _ in pre]
    assert names == ["broadcast", "all_reduce", "all_gather_single", "all_to_all_v_single",
                     "barrier", "split", "new_window", "finalize"], names
    kinds = [type(a).__name__ for _, _, a in pre]
    assert kinds == ["BroadcastPreHookArgs", "AllReducePreHookArgs",
                     "AllGatherSinglePreHookArgs", "AllToAllVSinglePreHookArgs",
                     "BarrierPreHookArgs", "SplitPreHookArgs", "NewWindowPreHookArgs",
                     "FinalizePreHookArgs"], kinds
    bcast, ar, ag, a2a, _, split, _, fin = (a for _, _, a in pre)
    assert bcast.root == 0 and bcast.async_op is False and bcast.tensor is t
    assert ar.async_op is True and ar.tensor.size == 10
    assert ag.input is t and ag.output is out
    assert a2a.input_split_sizes == [10] and a2a.output_split_sizes == [10]
    assert split.ranks == [0] and split.name == "api-typed-hooks-child" and split.op == "split"
    assert fin.op_id == 2**64 - 1
    # Every op's post hook saw the id its pre hook saw, in order; the new
    # window's inner ops reach post hooks only.
    pre_ids = [i for _, i, _ in pre]
    post_ids = [i for i, _ in post]
    assert pre_ids[:5] == post_ids[:5], (pre_ids, post_ids)
    assert pre_ids[:5] == sorted(pre_ids[:5]) and len(set(pre_ids[:5])) == 5
    split_post = next(a for i, a in post if i == pre_ids[5])
    assert isinstance(split_post, chorus.SplitPostHookArgs)
    assert split_post.new_comm is child
    assert isinstance(post[-1][1], chorus.FinalizePostHookArgs) and post[-1][0] == 2**64 - 1
    child.finalize()


def test_window_of_one_rank_and_bad_arguments(comm):
    win = comm.new_window(size=16)
    assert win.get_tensor() is None and win.sizes() == [16]
    win.put(np.arange(2, dtype=np.int32), 0, 1)
    win.signal(0)
    win.wait_signal(0)
    out = win.read(np.zeros(4, dtype=np.int32))
    assert list(out) == [0, 0, 1, 0], out
    with pytest.raises(chorus.InvalidArgumentError):
        win.put(np.zeros(2, dtype=np.int32), 1, 0)  # no rank 1
    with pytest.raises(ValueError):
        comm.new_window()
    win.free()
    with pytest.raises(chorus.InvalidArgumentError):
        win.signal(0)
