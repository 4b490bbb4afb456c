"""DLPack import, in a world of one rank: objects with only ``__dlpack__``
work like buffers, without a copy, and the DLPack tensor's deleter runs once."""

import datetime
import gc
import sys
import weakref

import numpy as np
import pytest

import chorus
from chorus import ReduceOp

from _dlpack import DLPackOnly


@pytest.fixture
def comm():
    c = chorus.new_comm("cpu", "cpu", "dlpack", rank=0, size=1, timeout=datetime.timedelta(seconds=30))
    yield c
    if not c.is_aborted():
        c.finalize()


def released():
    """Free what finished ops held (exports parked off the Python thread)."""
    chorus._chorus._release_parked()
    gc.collect()


def test_a_dlpack_only_object_has_no_buffer_protocol():
    with pytest.raises(TypeError):
        memoryview(DLPackOnly(np.ones(3)))


@pytest.mark.parametrize("legacy", [False, True], ids=["versioned", "legacy"])
def test_in_place_all_reduce_writes_into_the_producers_memory_without_a_copy(comm, legacy):
    a = np.arange(1 << 12, dtype=np.float32)
    p = DLPackOnly(a, legacy=legacy)
    before = chorus._chorus._copy_stats()
    comm.all_reduce(p, ReduceOp.PREMUL_SUM(3.0))
    assert np.array_equal(a, 3.0 * np.arange(1 << 12, dtype=np.float32))
    assert chorus._chorus._copy_stats() == before, "the DLPack path copied"
    assert p.calls == 1


@pytest.mark.parametrize("legacy", [False, True], ids=["versioned", "legacy"])
def test_the_deleter_runs_once_when_the_op_is_done(comm, legacy):
    a = np.ones(1024, dtype=np.int32)
    refs = sys.getrefcount(a)
    p = DLPackOnly(a, legacy=legacy)
    refs_with_p = sys.getrefcount(a)
    for _ in range(3):
        comm.all_reduce(p, ReduceOp.SUM)
        released()
        # NumPy's DLPack tensor holds a reference to the array until its
        # deleter runs: not called leaves one more, called twice one less.
        assert sys.getrefcount(a) == refs_with_p
    del p
    assert sys.getrefcount(a) == refs


def test_an_in_flight_op_keeps_the_producers_memory_alive(comm):
    a = np.full(1 << 14, 2, dtype=np.float32)
    ref = weakref.ref(a)
    w = comm.all_reduce(DLPackOnly(a), ReduceOp.SUM, async_op=True)
    del a
    gc.collect()
    assert ref() is not None, "the array was freed while its op was in flight"
    w.wait()
    released()
    assert ref() is None, "the op kept the DLPack tensor after it was waited on"


def test_an_unused_capsule_error_path_still_calls_the_deleter(comm):
    # Non-contiguous: refused after the capsule was taken, so the consumer
    # must still call the deleter (the array's refcount comes back).
    a = np.zeros(16, dtype=np.float32)
    refs = sys.getrefcount(a)
    v = a[::2]
    with pytest.raises(ValueError, match="not C-contiguous"):
        comm.all_reduce(DLPackOnly(v), ReduceOp.SUM)
    del v
    released()
    assert sys.getrefcount(a) == refs


def test_non_contiguous_dlpack_tensors_raise_value_error(comm):
    for v in (np.zeros(8, dtype=np.float32)[::2], np.zeros((3, 4), dtype=np.int32).T):
        with pytest.raises(ValueError, match="not C-contiguous"):
            comm.all_reduce(DLPackOnly(v), ReduceOp.SUM)
    # Extent-1 dimensions may have any stride; they are still contiguous.
    col = np.zeros((4, 3), dtype=np.float64)[:, :1]  # shape (4, 1), strides (3, 1)
    with pytest.raises(ValueError, match="not C-contiguous"):
        comm.all_reduce(DLPackOnly(col), ReduceOp.SUM)
    row = np.arange(12, dtype=np.float64).reshape(3, 4)[1:2]  # shape (1, 4)
    comm.all_reduce(DLPackOnly(row), ReduceOp.PREMUL_SUM(2.0))
    assert np.array_equal(row, [[8.0, 10.0, 12.0, 14.0]])


def test_a_tensor_on_another_device_raises_value_error_naming_it(comm):
    p = DLPackOnly(np.zeros(4, dtype=np.float32), device=(2, 0))
    with pytest.raises(ValueError, match="kDLCUDA"):
        comm.all_reduce(p, ReduceOp.SUM)
    assert p.calls == 0, "the producer was asked to export a tensor Chorus refuses"


@pytest.mark.parametrize("dtype", ["int16", "bool", "complex64", "float16"])
def test_dtypes_map_or_raise_type_error(comm, dtype):
    a = np.zeros(4, dtype=dtype)
    if dtype == "bool":
        a[1] = True
        comm.all_reduce(DLPackOnly(a), ReduceOp.MAX)
        assert a.tolist() == [False, True, False, False]
        return
    if dtype == "float16":
        a[:] = 1.5
        comm.all_reduce(DLPackOnly(a), ReduceOp.PREMUL_SUM(2.0))
        assert (a == 3.0).all()
        return
    with pytest.raises(TypeError, match="unsupported DLPack element type"):
        comm.all_reduce(DLPackOnly(a), ReduceOp.SUM)


def test_read_only_dlpack_tensors_are_inputs_only(comm):
    ro = np.arange(4, dtype=np.float32)
    ro.setflags(write=False)
    out = np.zeros(4, dtype=np.float32)
    comm.all_gather_single(out, DLPackOnly(ro))
    assert np.array_equal(out, ro)
    with pytest.raises(ValueError, match="read-only"):
        comm.all_reduce(DLPackOnly(ro), ReduceOp.SUM)


def test_empty_and_zero_dim_dlpack_tensors(comm):
    comm.all_reduce(DLPackOnly(np.zeros(0, dtype=np.float32)), ReduceOp.SUM)
    s = np.array(5.0, dtype=np.float64)
    comm.all_reduce(DLPackOnly(s), ReduceOp.PREMUL_SUM(2.0))
    assert s == 10.0


def test_the_capsule_is_renamed_used(comm):
    a = np.ones(4, dtype=np.float32)
    capsules = []

    class Keep(DLPackOnly):
        def __dlpack__(self, **kw):
            c = super().__dlpack__(**kw)
            capsules.append(c)
            return c

    comm.all_reduce(Keep(a), ReduceOp.SUM)
    assert "used_dltensor_versioned" in repr(capsules[0])
    capsules.clear()
    comm.all_reduce(Keep(a, legacy=True), ReduceOp.SUM)
    assert '"used_dltensor"' in repr(capsules[0])


def test_a_copy_made_by_the_producer_is_an_input_only(comm):
    # NumPy sets DLPack 1.x's IS_COPIED flag for copy=True: a result written
    # there would never reach the caller's array, so it is no output.
    class Copying(DLPackOnly):
        def __dlpack__(self, **kw):
            if "max_version" not in kw:
                raise AssertionError("Chorus did not ask for DLPack 1.x")
            return super().__dlpack__(copy=True, **kw)

    a = np.arange(4, dtype=np.float32)
    with pytest.raises(ValueError, match="read-only"):
        comm.all_reduce(Copying(a), ReduceOp.SUM)
    out = np.zeros(4, dtype=np.float32)
    comm.all_gather_single(out, Copying(a))
    assert np.array_equal(out, a)
