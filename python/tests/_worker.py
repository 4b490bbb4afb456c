"""One rank of a multi-rank test: ``python _worker.py SCENARIO [ARGS...]``.

The test (test_*.py) starts every rank as its own process with the launcher's
environment and a hard timeout. A rank checks its own results against a
reference computed locally, prints ``OK <scenario>`` and exits 0; any failed
check is an exception, so a non-zero exit and a traceback.
"""

import os
import signal
import sys
import threading

import numpy as np

import chorus
from chorus import ReduceOp

COUNTS = (0, 4, 1024, 1 << 20)


def values(dtype, rank, count):
    """Rank `rank`'s input: small integers, exact in every dtype."""
    return (1 + (np.arange(count) + rank) % 3).astype(dtype)


def reference(op, dtype, size, count):
    xs = [values(dtype, r, count) for r in range(size)]
    if op.type is chorus.RedOpType.SUM:
        return np.sum(xs, axis=0, dtype=dtype)
    if op.type is chorus.RedOpType.PRODUCT:
        return np.prod(xs, axis=0, dtype=dtype)
    if op.type is chorus.RedOpType.MIN:
        return np.min(xs, axis=0)
    if op.type is chorus.RedOpType.MAX:
        return np.max(xs, axis=0)
    if op.type is chorus.RedOpType.AVG:
        s = np.sum(xs, axis=0, dtype=np.int64 if np.issubdtype(dtype, np.integer) else dtype)
        return (s // size if np.issubdtype(dtype, np.integer) else s / size).astype(dtype)
    if op.type is chorus.RedOpType.BAND:
        return np.bitwise_and.reduce(xs)
    if op.type is chorus.RedOpType.BOR:
        return np.bitwise_or.reduce(xs)
    if op.type is chorus.RedOpType.BXOR:
        return np.bitwise_xor.reduce(xs)
    if op.type is chorus.RedOpType.PREMUL_SUM:
        # Each rank's factor is rank + 1 (see premul()).
        return np.sum([x * dtype(r + 1) for r, x in enumerate(xs)], axis=0, dtype=dtype)
    raise AssertionError(op)


def premul(rank):
    return ReduceOp.PREMUL_SUM(rank + 1)


def check(got, want, what):
    if np.issubdtype(got.dtype, np.floating):
        ok = np.allclose(got, want, rtol=1e-6, atol=0)
    else:
        ok = np.array_equal(got, want)
    if not ok:
        bad = np.flatnonzero(got != want)[:5]
        raise AssertionError(f"{what}: got {got[bad]} want {np.asarray(want)[bad]} at {bad}")


def ops_for(dtype, rank):
    ops = [ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX, ReduceOp.AVG, premul(rank)]
    if np.issubdtype(dtype, np.integer):
        ops += [ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR]
    return ops


def run(work, async_op):
    """Finish an op issued with `async_op`: wait twice (allowed) if async."""
    if async_op:
        work.wait()
        assert work.is_completed()
        work.wait()
    else:
        assert work.is_completed()


def grid(comm, dtype_name):
    dtype = np.dtype(dtype_name).type
    rank, size = comm.get_rank(), comm.get_size()
    for count in COUNTS:
        for async_op in (False, True):
            tag = f"{dtype_name} x {count} async={async_op}"
            # all_reduce, every op (the op of PREMUL_SUM differs per rank:
            # its factor).
            for op in ops_for(dtype, rank):
                t = values(dtype, rank, count)
                run(comm.all_reduce(t, op, async_op=async_op), async_op)
                want_op = op if op.type is not chorus.RedOpType.PREMUL_SUM else premul(0)
                check(t, reference(want_op, dtype, size, count), f"all_reduce {op} {tag}")

            # reduce onto the last rank; the others keep their input.
            root = size - 1
            t = values(dtype, rank, count)
            run(comm.reduce(t, root, ReduceOp.SUM, async_op=async_op), async_op)
            want = reference(ReduceOp.SUM, dtype, size, count) if rank == root else values(dtype, rank, count)
            check(t, want, f"reduce {tag}")

            # broadcast from rank 1.
            t = values(dtype, rank, count)
            run(comm.broadcast(t, 1, async_op=async_op), async_op)
            check(t, values(dtype, 1, count), f"broadcast {tag}")

            # Per-rank blocks: `count` elements per rank.
            blocks = [values(dtype, r, count) for r in range(size)]
            mine = values(dtype, rank, count)
            out = np.zeros(count * size, dtype=dtype)
            run(comm.all_gather_single(out, mine, async_op=async_op), async_op)
            check(out, np.concatenate(blocks), f"all_gather_single {tag}")
            check(mine, values(dtype, rank, count), f"all_gather_single input intact {tag}")

            outs = [np.zeros(count, dtype=dtype) for _ in range(size)]
            run(comm.all_gather(outs, mine, async_op=async_op), async_op)
            for r in range(size):
                check(outs[r], blocks[r], f"all_gather[{r}] {tag}")

            # reduce_scatter: rank r's input block j is values(r, ...) + j.
            ins = [(values(dtype, rank, count) + dtype(j)).astype(dtype) for j in range(size)]
            flat = np.concatenate(ins) if count else np.zeros(0, dtype=dtype)
            out = np.zeros(count, dtype=dtype)
            want = np.sum(
                [(values(dtype, r, count) + dtype(rank)).astype(dtype) for r in range(size)],
                axis=0,
                dtype=dtype,
            )
            run(comm.reduce_scatter_single(out, flat, ReduceOp.SUM, async_op=async_op), async_op)
            check(out, want, f"reduce_scatter_single {tag}")
            check(flat, np.concatenate(ins) if count else flat, f"reduce_scatter_single input intact {tag}")
            out2 = np.zeros(count, dtype=dtype)
            run(comm.reduce_scatter(out2, ins, ReduceOp.SUM, async_op=async_op), async_op)
            check(out2, want, f"reduce_scatter {tag}")

            # all_to_all_single: block j of rank r is values(r) * (j + 1).
            def a2a_block(src, dst):
                return (values(dtype, src, count) * dtype(dst + 1)).astype(dtype)

            send = np.concatenate([a2a_block(rank, j) for j in range(size)])
            out = np.zeros(count * size, dtype=dtype)
            sent = send.copy()
            run(comm.all_to_all_single(out, send, async_op=async_op), async_op)
            check(send, sent, f"all_to_all_single input intact {tag}")
            check(out, np.concatenate([a2a_block(j, rank) for j in range(size)]), f"all_to_all_single {tag}")

            outs = [np.zeros(count, dtype=dtype) for _ in range(size)]
            a2a_in = [a2a_block(rank, j) for j in range(size)]
            run(comm.all_to_all(outs, a2a_in, async_op=async_op), async_op)
            for j in range(size):
                check(a2a_in[j], a2a_block(rank, j), f"all_to_all input intact {tag}")
            for j in range(size):
                check(outs[j], a2a_block(j, rank), f"all_to_all[{j}] {tag}")

            # all_to_all_v_single: rank r sends (r + j) % 2 * count elements to j.
            def n(src, dst):
                return ((src + dst) % 2) * count

            send = np.concatenate([a2a_block(rank, j)[: n(rank, j)] for j in range(size)])
            out = np.zeros(sum(n(j, rank) for j in range(size)), dtype=dtype)
            run(
                comm.all_to_all_v_single(
                    out,
                    send,
                    [n(j, rank) for j in range(size)],
                    [n(rank, j) for j in range(size)],
                    async_op=async_op,
                ),
                async_op,
            )
            check(
                out,
                np.concatenate([a2a_block(j, rank)[: n(j, rank)] for j in range(size)]),
                f"all_to_all_v_single {tag}",
            )

            # scatter / gather with root 0.
            out = np.zeros(count, dtype=dtype)
            run(comm.scatter(out, blocks if rank == 0 else [], 0, async_op=async_op), async_op)
            check(out, blocks[rank], f"scatter {tag}")
            outs = [np.zeros(count, dtype=dtype) for _ in range(size)]
            run(comm.gather(outs, mine, 0, async_op=async_op), async_op)
            check(mine, blocks[rank], f"gather input intact {tag}")
            if rank == 0:
                for r in range(size):
                    check(outs[r], blocks[r], f"gather[{r}] {tag}")

            # A ring exchange as one batch, and plain send/recv pairs.
            nxt, prv = (rank + 1) % size, (rank - 1) % size
            got = np.zeros(count, dtype=dtype)
            batch = comm.batch_op_create()
            batch.send(mine, nxt)
            batch.recv(got, prv)
            run(batch.issue(async_op), async_op)
            check(got, blocks[prv], f"batch ring {tag}")
            check(mine, blocks[rank], f"batch send input intact {tag}")
            got = np.zeros(count, dtype=dtype)
            if rank == 0:
                run(comm.send(mine, 1, async_op=async_op), async_op)
                check(mine, blocks[0], f"send input intact {tag}")
            elif rank == 1:
                run(comm.recv(got, 0, async_op=async_op), async_op)
                check(got, blocks[0], f"send/recv {tag}")
            run(comm.barrier(async_op=async_op), async_op)


def buffers(comm):
    """Buffer edge cases: unaligned views, read-only inputs, bad outputs."""
    rank, size = comm.get_rank(), comm.get_size()
    # An int8 view at offset 1: contiguous but not 8-byte aligned, so Chorus
    # works on a copy; the caller's memory must still be updated in place.
    base = np.zeros(17, dtype=np.int8)
    view = base[1:]
    view[:] = rank + 1
    comm.all_reduce(view, ReduceOp.SUM)
    assert base[0] == 0 and (view == sum(range(1, size + 1))).all(), base
    # A read-only input is fine for an input-only op.
    ro = np.full(4, rank, dtype=np.float32)
    ro.setflags(write=False)
    out = np.zeros(4 * size, dtype=np.float32)
    comm.all_gather_single(out, ro)
    check(out, np.repeat(np.arange(size, dtype=np.float32), 4), "read-only input")
    # ... but not as the buffer an op writes into.
    try:
        comm.all_reduce(ro, ReduceOp.SUM)
        raise AssertionError("all_reduce on a read-only array did not raise")
    except ValueError as e:
        assert "read-only" in str(e), e
    # Non-contiguous: a ValueError before anything is sent.
    strided = np.zeros(8, dtype=np.float32)[::2]
    try:
        comm.all_reduce(strided, ReduceOp.SUM)
        raise AssertionError("a strided array did not raise")
    except ValueError as e:
        assert "contiguous" in str(e), e
    # A 2-D C-contiguous array is a flat buffer.
    m = np.full((3, 5), rank, dtype=np.float64)
    comm.all_reduce(m, ReduceOp.MAX)
    assert (m == size - 1).all()
    # bytearray works too (uint8).
    b = bytearray([rank] * 3)
    comm.all_reduce(b, ReduceOp.MAX)
    assert b == bytearray([size - 1] * 3)
    # Unsupported dtype: TypeError.
    try:
        comm.all_reduce(np.zeros(2, dtype=np.int16), ReduceOp.SUM)
        raise AssertionError("int16 did not raise")
    except TypeError:
        pass
    # Bitwise op on floats: UnsupportedOpError, which is also a ValueError;
    # the communicator stays usable.
    try:
        comm.all_reduce(np.zeros(2, dtype=np.float32), ReduceOp.BXOR)
        raise AssertionError("BXOR on f32 did not raise")
    except chorus.UnsupportedOpError as e:
        assert isinstance(e, ValueError) and not e.fatal
    # In-place all_gather: the input is this rank's block of the output.
    n = 4
    out = np.zeros(n * size, dtype=np.float32)
    out[rank * n : (rank + 1) * n] = rank + 1
    comm.all_gather_single(out, out[rank * n : (rank + 1) * n])
    check(out, np.repeat(np.arange(1, size + 1, dtype=np.float32), n), "in-place all_gather")
    # A ring shift in place: send and receive the same array in one batch.
    a = np.full(5, rank, dtype=np.int32)
    batch = comm.batch_op_create()
    batch.send(a, (rank + 1) % size)
    batch.recv(a, (rank - 1) % size)
    batch.issue()
    assert (a == (rank - 1) % size).all(), a
    # The arrays of an async op stay alive even when the caller drops them.
    w = comm.all_reduce(np.ones(1 << 16, dtype=np.float32), ReduceOp.SUM, async_op=True)
    w.wait()


def mismatch(comm):
    rank = comm.get_rank()
    t = np.ones(4 + rank, dtype=np.float32)  # a different count on every rank
    try:
        comm.all_reduce(t, ReduceOp.SUM)
        raise AssertionError("no mismatch")
    except chorus.MismatchError as e:
        assert not e.fatal, e
        assert "mismatch" in str(e)
    # A parameter mismatch leaves the communicator usable.
    t = np.ones(4, dtype=np.float32)
    comm.all_reduce(t, ReduceOp.SUM)
    assert (t == comm.get_size()).all()
    # A failed async work raises from every wait().
    w = comm.all_reduce(np.ones(1 + rank, dtype=np.int32), ReduceOp.SUM, async_op=True)
    for _ in range(2):
        try:
            w.wait()
            raise AssertionError("no mismatch on wait")
        except chorus.MismatchError:
            pass


def split(comm):
    rank, size = comm.get_rank(), comm.get_size()
    evens = list(range(0, size, 2))
    sub = comm.split(evens, "evens")
    if rank % 2:
        assert sub is None
    else:
        assert sub.get_size() == len(evens) and sub.get_rank() == rank // 2, sub
        t = np.full(8, rank, dtype=np.int32)
        sub.all_reduce(t, ReduceOp.SUM)
        assert (t == sum(evens)).all(), t
        sub.finalize()
    # TorchComms' form: each group passes its own list (contiguous halves),
    # so both children form in one call.
    half = size // 2
    mine = list(range(0, half)) if rank < half else list(range(half, size))
    sub = comm.split(mine, "halves")
    assert sub.get_size() == len(mine) and sub.get_rank() == mine.index(rank), sub
    t = np.full(4, rank, dtype=np.int64)
    sub.all_reduce(t, ReduceOp.SUM)
    assert (t == sum(mine)).all(), t
    sub.finalize()
    # A non-empty list without the caller is refused on that rank.
    try:
        comm.split([r for r in range(size) if r != rank], "bad")
        raise AssertionError("a list without the caller was accepted")
    except (chorus.ChorusError, ValueError):
        pass
    # The parent still works.
    t = np.ones(3, dtype=np.float32)
    comm.all_reduce(t, ReduceOp.SUM)
    assert (t == size).all()


def abort(comm):
    rank = comm.get_rank()
    comm.barrier()
    if rank == 0:
        comm.abort()
        assert comm.is_aborted()
        try:
            comm.all_reduce(np.ones(4, dtype=np.float32), ReduceOp.SUM)
            raise AssertionError("op after abort did not raise")
        except chorus.AbortedError as e:
            assert e.fatal
    else:
        # Rank 0 aborted (and stopped taking part): this op fails on us too.
        try:
            comm.all_reduce(np.ones(4, dtype=np.float32), ReduceOp.SUM, timeout=60)
            raise AssertionError("op with an aborted peer did not raise")
        except chorus.ChorusError as e:
            assert e.fatal, e
        assert comm.is_aborted()
    print("health", comm.health())


def killed(comm):
    rank, size = comm.get_rank(), comm.get_size()
    victim = size - 1
    comm.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.all_reduce(np.ones(1024, dtype=np.float32), ReduceOp.SUM, timeout=60)
        raise AssertionError("all_reduce with a dead peer did not raise")
    except (chorus.PeerFailedError, chorus.AbortedError) as e:
        assert victim in e.failed_ranks, (e, e.failed_ranks)
        print("failed_ranks", e.failed_ranks, type(e).__name__)
    # Elastic: the survivors form the next epoch without the dead rank.
    nxt, rank_map = comm.reconfigure(timeout=60)
    assert nxt.get_size() == size - 1, rank_map
    assert rank_map["old_to_new"][victim] is None, rank_map
    t = np.ones(16, dtype=np.float32)
    nxt.all_reduce(t, ReduceOp.SUM)
    assert (t == size - 1).all(), t
    nxt.finalize()


def rejoin(comm):
    """The last rank dies; a new process joins; the next epoch has the two
    survivors and the joiner."""
    rank, size = comm.get_rank(), comm.get_size()
    victim = size - 1
    comm.barrier()
    if rank == victim:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.all_reduce(np.ones(4, dtype=np.float32), ReduceOp.SUM, timeout=60)
        raise AssertionError("all_reduce with a dead peer did not raise")
    except (chorus.PeerFailedError, chorus.AbortedError):
        pass
    nxt, rank_map = comm.reconfigure(timeout=60, wait_joiners=1)
    assert nxt.get_size() == size and len(rank_map["joined"]) == 1, rank_map
    after_reconfigure(nxt)


def after_reconfigure(nxt):
    t = np.ones(16, dtype=np.float32)
    nxt.all_reduce(t, ReduceOp.SUM)
    assert (t == nxt.get_size()).all(), t
    nxt.finalize()


def interrupt(comm):
    """Ctrl-C reaches a rank blocked in wait(): KeyboardInterrupt, the op
    still pending."""
    rank = comm.get_rank()
    side = chorus.new_comm("cpu", "cpu", "side", connect_timeout=60)
    if rank == 0:
        # Rank 1 never joins this all_reduce (a 60 s timeout).
        w = comm.all_reduce(np.ones(4, dtype=np.float32), ReduceOp.SUM, async_op=True, timeout=60)
        try:
            side.send(np.array([os.getpid()], dtype=np.int64), 1)
            w.wait()
            raise AssertionError("wait() returned")
        except KeyboardInterrupt:
            pass
        assert not w.is_completed()
        side.send(np.ones(1, dtype=np.int64), 1)  # rank 1 may go now
        comm.abort("interrupted")
        try:
            w.wait()
            raise AssertionError("an aborted op completed")
        except (chorus.AbortedError, chorus.PeerFailedError) as e:
            assert e.fatal, e
    else:
        pid = np.zeros(1, dtype=np.int64)
        side.recv(pid, 0)
        os.kill(int(pid[0]), signal.SIGINT)
        side.recv(pid, 0)
        comm.abort()
    side.finalize()


def timeout(comm):
    rank = comm.get_rank()
    # A second, independent communicator: rank 1 waits on it, so that it
    # issues nothing on `comm` (which would be a mismatch, not a timeout).
    side = chorus.new_comm("cpu", "cpu", "side", connect_timeout=60)
    if rank == 0:
        try:
            comm.all_reduce(np.ones(4, dtype=np.float32), ReduceOp.SUM, timeout=1.0)
            raise AssertionError("no timeout")
        except chorus.TimeoutError as e:
            assert isinstance(e, TimeoutError) and e.fatal, e
        assert comm.is_aborted()
        side.send(np.ones(1, dtype=np.float32), 1)
    else:
        got = np.zeros(1, dtype=np.float32)
        side.recv(got, 0, timeout=60)
        assert got[0] == 1.0
        comm.abort()
    side.finalize()


def gil(comm):
    """A thread blocked in an op must not hold the GIL."""
    rank = comm.get_rank()
    side = comm.split([0, 1], "side")
    if rank == 0:
        done = []
        t = threading.Thread(target=lambda: done.append(comm.barrier()))
        t.start()
        # This thread runs Python while the other is blocked in barrier,
        # which rank 1 only joins after our message below.
        acc = sum(i * i for i in range(100_000))
        assert not done
        side.send(np.array([acc], dtype=np.int64), 1)
        t.join(timeout=60)
        assert done and not t.is_alive()
    else:
        got = np.zeros(1, dtype=np.int64)
        side.recv(got, 0)
        comm.barrier()
    side.finalize()


def dlpack(comm):
    """Arrays seen only through __dlpack__: ops read and write the producer's
    memory in place, across ranks."""
    from _dlpack import DLPackOnly

    rank, size = comm.get_rank(), comm.get_size()
    for legacy in (False, True):
        a = values(np.float32, rank, 1 << 16)
        comm.all_reduce(DLPackOnly(a, legacy=legacy), ReduceOp.SUM)
        check(a, reference(ReduceOp.SUM, np.float32, size, 1 << 16), f"all_reduce legacy={legacy}")
    b = np.full(100, rank + 7, dtype=np.int64)
    comm.broadcast(DLPackOnly(b), 1)
    check(b, np.full(100, 8, dtype=np.int64), "broadcast")
    out = np.zeros(4 * size, dtype=np.int32)
    comm.all_gather_single(DLPackOnly(out), DLPackOnly(np.full(4, rank, dtype=np.int32)))
    check(out, np.repeat(np.arange(size, dtype=np.int32), 4), "all_gather_single")
    got = np.zeros(1000, dtype=np.uint8)
    w = comm.all_reduce(DLPackOnly(np.ones(16, dtype=np.float64)), ReduceOp.SUM, async_op=True)
    if rank == 0:
        comm.send(DLPackOnly(np.arange(1000, dtype=np.uint8)), 1)
    elif rank == 1:
        comm.recv(DLPackOnly(got), 0)
        check(got, np.arange(1000, dtype=np.uint8), "recv")
    w.wait()


def torch_tensors(comm):
    import torch

    rank, size = comm.get_rank(), comm.get_size()
    t = torch.full((4, 4), float(rank + 1))
    comm.all_reduce(t, ReduceOp.SUM)
    assert torch.all(t == sum(range(1, size + 1)))
    b = torch.full((8,), float(rank), dtype=torch.bfloat16)
    comm.all_reduce(b, ReduceOp.MAX)
    assert torch.all(b == size - 1)
    try:
        comm.all_reduce(torch.zeros(4, 4).t(), ReduceOp.SUM)
        raise AssertionError("non-contiguous tensor did not raise")
    except ValueError:
        pass


class Collector:
    """Hook events, gathered on the hook thread; `wait_for(n)` blocks (with
    a deadline) until `n` have arrived."""

    def __init__(self):
        self.items = []
        self.cond = threading.Condition()

    def add(self, item):
        with self.cond:
            self.items.append(item)
            self.cond.notify_all()

    def wait_for(self, n, timeout=30):
        with self.cond:
            ok = self.cond.wait_for(lambda: len(self.items) >= n, timeout)
        assert ok, f"{len(self.items)} of {n} hook calls arrived"
        return list(self.items)


def hooks(comm):
    rank = comm.get_rank()
    pre, post = Collector(), Collector()
    hp = comm.register_pre_hook(lambda name, op_id, a: pre.add((name, op_id, a)))
    # No handle kept: dropping it leaves the hook registered.
    comm.register_post_hook(lambda op_id, a: post.add((op_id, a)))
    t = np.ones(16, dtype=np.float32)
    comm.all_reduce(t, ReduceOp.SUM, hints={"chorus.tag": "grads", "site": "x"})
    comm.broadcast(np.zeros(4, dtype=np.int32), 1)
    try:
        comm.all_reduce(np.ones(4 + rank, dtype=np.float32), ReduceOp.SUM)
        raise AssertionError("no mismatch")
    except chorus.MismatchError:
        pass
    b = comm.batch_op_create()
    peer = 1 - rank
    b.send(np.full(2, rank, dtype=np.int64), peer)
    got = np.zeros(2, dtype=np.int64)
    b.recv(got, peer)
    b.issue(hints={"chorus.tag": "ring"})
    assert (got == peer).all(), got
    # Pre hooks ran on this thread, before each op was issued.
    seen = list(pre.items)
    done = post.wait_for(4)
    names = [n for n, _, _ in seen]
    assert names == ["all_reduce", "broadcast", "all_reduce", "batch_op_issue"], names
    assert names[0] is chorus.OpName.all_reduce
    first = seen[0][2]
    assert isinstance(first, chorus.AllReducePreHookArgs), first
    assert (first.tag, first.hints["site"], first.count, first.bytes, first.dtype) == (
        "grads", "x", 16, 64, "float32"), first
    assert first.tensor is t and first.reduce_op == ReduceOp.SUM and first.async_op is False
    assert first.comm == comm.get_name() and first.rank == rank
    assert seen[1][2].root == 1 and seen[3][2].tag == "ring"
    assert set(seen[3][2].peers) == {peer} and seen[3][2].num_ops == 2, seen[3][2]
    # Post hooks see each op by its kind.
    assert [a.op for _, a in done] == ["all_reduce", "broadcast", "all_reduce", "batch_p2p"]
    # Post hooks see the same ids, each op once, with its outcome.
    assert [i for i, _ in done] == [i for _, i, _ in seen], (done, seen)
    assert [a.error is None for _, a in done] == [True, True, False, True], done
    assert isinstance(done[2][1].error, chorus.MismatchError), done[2]
    assert all(a.duration >= 0 for _, a in done)
    # The flight recorder holds the same ops, the failure included.
    rec = comm.flight_record()
    assert [e["op_id"] for e in rec] == [i for _, i, _ in seen], rec
    assert [e["state"] for e in rec] == ["completed", "completed", "failed", "completed"], rec
    assert rec[0]["tag"] == "grads" and "ismatch" in rec[2]["error"], rec
    # Removed: not called for later ops (the post hook still is).
    hp.remove()
    comm.barrier()
    post.wait_for(5)
    assert len(pre.items) == 4, pre.items


def hooks_before_return(comm):
    """By the time a blocking op returns, or ``wait()`` on an async one,
    its pre and post hooks have run: 1 000 ops, none late. Also TorchComms'
    one-argument hook form."""
    counts = {"pre": 0, "post": 0}
    names = []

    def pre(args):
        counts["pre"] += 1
        names.append(args.name)

    def post(args):
        counts["post"] += 1
        assert args.op_id >= 0

    comm.register_pre_hook(pre)
    comm.register_post_hook(post)
    t = np.ones(4, dtype=np.float32)
    late = 0
    for i in range(1, 1001):
        if i % 2:
            comm.all_reduce(t, ReduceOp.SUM)
        else:
            comm.all_reduce(t, ReduceOp.SUM, async_op=True).wait()
        if counts["pre"] != i or counts["post"] != i:
            late += 1
    assert late == 0, f"{late} of 1000 ops returned before their hooks ran"
    assert set(names) == {chorus.OpName.all_reduce}, set(names)


def flight_recorder(comm):
    """TorchComms' FlightRecorderTest on every rank: the traces of all ranks,
    gathered with objcol, parse in torch's flight-recorder analyzer
    (``build_db``, when torch is installed) into one group with matching
    collectives; p2p ops count apart; an op pending on a peer is
    ``scheduled`` until it completes."""
    import json

    from chorus.hooks import FlightRecorderHook
    from chorus.objcol import all_gather_object

    rank, size = comm.get_rank(), comm.get_size()
    recorder = FlightRecorderHook(max_entries=100, isolated=True)
    recorder.register_with_comm(comm)
    t = np.random.default_rng(rank).random((10, 10), dtype=np.float32)
    comm.all_reduce(t, ReduceOp.SUM)
    comm.broadcast(t, 0)
    nxt, prv = (rank + 1) % size, (rank - 1) % size
    # A communicator split off is recorded as a group of its own.
    side = comm.split(list(range(size)), "fr-side")
    # Rank 0 receives before its peer sends: its recv stays scheduled until
    # the peer has passed a barrier on the other communicator.
    got = np.zeros(4, dtype=np.float32)
    if rank == 0:
        pending = comm.recv(got, prv, async_op=True)
        active = json.loads(recorder.dump_json(False)).get("entries", [])
        assert [e["profiling_name"] for e in active] == [f"cpu:recv 0<-{prv}"], active
        assert active[0]["state"] == "scheduled" and active[0]["is_p2p"], active
    side.barrier()
    if rank == size - 1:
        comm.send(np.full(4, 9.0, dtype=np.float32), nxt)
    if rank == 0:
        pending.wait()
        assert (got == 9).all(), got
    comm.all_reduce(t, ReduceOp.SUM)
    side.finalize()
    data = json.loads(recorder.dump_json())
    mine = [e for e in data["entries"] if e["process_group"][0] == comm.get_name()]
    names = [e["profiling_name"] for e in mine if not e["is_p2p"]]
    assert names == ["cpu:all_reduce", "cpu:broadcast", "cpu:split", "cpu:all_reduce"], names
    assert [e["collective_seq_id"] for e in mine if not e["is_p2p"]] == [1, 2, 3, 4]
    others = [e["profiling_name"] for e in data["entries"] if e not in mine]
    assert others == ["cpu:barrier"], others
    assert all(e["state"] == "completed" for e in data["entries"]), data["entries"]
    assert data["pg_config"][comm.get_name()]["ranks"] == "[" + ",".join(
        str(r) for r in range(size)) + "]"
    traces = [None] * size
    all_gather_object(comm, traces, data)
    try:
        import argparse

        from torch.distributed.flight_recorder.components.builder import build_db
    except ImportError:
        return
    details = {
        f"rank_{r}": {
            "version": d["version"],
            "rank": r,
            "pg_config": d["pg_config"],
            "pg_status": d["pg_status"],
            "entries": d["entries"],
        }
        for r, d in enumerate(traces)
    }
    args = argparse.Namespace(verbose=False, just_print_entries=False,
                              allow_incomplete_ranks=True, mismatch_cap=10)
    db = build_db(details, args, "2.10")
    assert len(db.groups) == 2 and len(db.memberships) == 2 * size, (db.groups, db.memberships)
    assert len(db.collectives) >= 4, db.collectives


def flight_recorder_abort(comm, trace_dir):
    """TorchComms' FlightRecorderAbortTest: rank 0 skips an all_reduce, the
    others' time out; the abort that follows writes every rank's trace
    (``TORCHCOMM_FR_DUMP_TEMP_FILE``) from the abort hook, with the
    all_reduces in it, and ``dump_file`` writes it again on demand."""
    import pickle

    from chorus.hooks import FlightRecorderHook

    rank = comm.get_rank()
    path = os.path.join(trace_dir, f"fr_crash_trace_{rank}")
    os.environ["TORCHCOMM_FR_DUMP_DYNAMIC_FILE_NAME"] = "1"
    os.environ["TORCHCOMM_FR_DUMP_TEMP_FILE"] = path
    recorder = FlightRecorderHook(max_entries=100, isolated=True)
    recorder.register_with_comm(comm)
    # Registered after the recorder's, so it runs after the trace is written.
    aborted = threading.Event()
    comm.register_abort_hook(aborted.set)
    t = np.ones((10, 10), dtype=np.float32)
    comm.all_reduce(t, ReduceOp.SUM)
    if rank != 0:
        try:
            comm.all_reduce(t, ReduceOp.SUM, timeout=2)
            raise AssertionError("no timeout")
        except chorus.ChorusError:
            pass
    # Every rank learns of the abort (rank 0 from its peers' notice).
    assert aborted.wait(30), f"rank {rank} never heard of the abort"
    with open(path, "rb") as f:
        data = pickle.load(f)
    assert data["version"] == "2.10"
    assert any(e["profiling_name"] == "cpu:all_reduce" for e in data["entries"]), data
    os.remove(path)
    assert recorder.dump_file(rank) == path and os.path.exists(path)


def persistent(comm):
    rank, size = comm.get_rank(), comm.get_size()
    out = np.zeros(3 * size, dtype=np.int32)
    h = comm.all_gather_p_init(out)
    for step in range(3):
        w = comm.all_gather_p_exec(h, np.full(3, rank * 10 + step, dtype=np.int32), async_op=True)
        w.wait()
        want = np.repeat(np.arange(size, dtype=np.int32) * 10 + step, 3)
        assert (out == want).all(), (step, out)
    try:
        comm.all_gather_p_exec(h, np.zeros(4, dtype=np.int32))
        raise AssertionError("a wrong count was accepted")
    except ValueError:
        pass
    comm.all_gather_p_free(h)
    # Ranks that disagree on the count learn it at init, on every rank.
    try:
        comm.all_gather_p_init(np.zeros((2 + rank) * size, dtype=np.float32))
        raise AssertionError("no mismatch")
    except chorus.MismatchError as e:
        assert not e.fatal


def window(comm):
    rank, size = comm.get_rank(), comm.get_size()
    peer = (rank + 1) % size
    src = (rank - 1) % size
    # This rank's window is its tensor: size, dtype and first contents.
    mine = np.full(8, -1, dtype=np.float32)
    win = comm.new_window(mine)
    assert win.get_size() == 32 and win.dtype == "float32"
    attr = win.get_attr(peer)
    assert attr.access_type is chorus.TorchCommWinAccessType.WIN_ACCESS_TYPE_UNIFIED, attr
    for step in range(3):
        kv = np.full(4, rank * 100 + step, dtype=np.float32)
        w = win.put(kv, peer, 2, async_op=True)
        w.wait()
        win.signal(peer)
        win.wait_signal(src)
        got = win.get_tensor()
        assert got is mine
        want = np.array([-1, -1] + [src * 100 + step] * 4 + [-1, -1], dtype=np.float32)
        assert (mine == want).all(), (step, mine)
        comm.barrier()  # the peer read its window before the next put
    # Bad ranges are refused before anything moves.
    try:
        win.put(np.zeros(4, dtype=np.float32), peer, 6)
        raise AssertionError("a put past the window's end was accepted")
    except chorus.InvalidArgumentError:
        pass
    win.free()


def fingerprint_mismatch(comm):
    """With fingerprint checks a mismatch fails every rank and aborts."""
    rank = comm.get_rank()
    t = np.ones(4 + rank, dtype=np.float32)
    try:
        comm.all_reduce(t, ReduceOp.SUM)
        comm.barrier()
        raise AssertionError("no mismatch")
    except chorus.MismatchError as e:
        assert e.fatal, e
    try:
        comm.barrier()
        raise AssertionError("the communicator was not aborted")
    except chorus.AbortedError:
        pass
    try:
        chorus.new_comm("cpu", "cpu", "bad-checks", rank=0, size=1, checks="sometimes")
        raise AssertionError("an unknown checks mode was accepted")
    except chorus.ConfigError as e:
        assert "CHORUS_CHECKS" in str(e), e


class Point:
    """A class instance: refused with weights_only=True, fine without."""

    def __init__(self, x):
        self.x = x

    def __eq__(self, other):
        return isinstance(other, Point) and other.x == self.x


def objcol(comm):
    """chorus.objcol on every count of the grid (TorchComms' ObjCol tests
    use tensors of these counts as the objects) and root, plus the
    weights_only rule and argument errors raised before anything is sent."""
    import pickle

    from chorus import objcol as oc

    rank, n = comm.get_rank(), comm.get_size()

    try:
        import torch
    except ImportError:
        torch = None

    def obj(r, count):
        data = values(np.float32, r, count)
        if torch is not None:
            # torch.load(weights_only=True), as TorchComms uses it, refuses
            # NumPy arrays; torch tensors are what its ObjCol tests send.
            data = torch.from_numpy(data)
        return {"rank": r, "data": data, "tag": ("t", r, None)}

    def same(a, b):
        return (
            a["rank"] == b["rank"]
            and a["tag"] == b["tag"]
            and a["data"].dtype == b["data"].dtype
            and np.array_equal(np.asarray(a["data"]), np.asarray(b["data"]))
        )

    for count in COUNTS:
        got = [None] * n
        oc.all_gather_object(comm, got, obj(rank, count))
        assert all(same(got[r], obj(r, count)) for r in range(n)), "all_gather_object"
        for root in range(n):
            # Objects of different sizes on different ranks: padded.
            mine = obj(rank, count + rank)
            out = [None] * n if rank == root else None
            oc.gather_object(comm, mine, root, out)
            if rank == root:
                assert all(same(out[r], obj(r, count + r)) for r in range(n)), "gather_object"
            lst = [obj(root, count), "second", 3] if rank == root else [None, None, None]
            oc.broadcast_object_list(comm, lst, root)
            assert same(lst[0], obj(root, count)) and lst[1:] == ["second", 3], "broadcast"
            inputs = [obj(r, count * r) for r in range(n)] if rank == root else None
            out1 = [None]
            oc.scatter_object_list(comm, root, out1, inputs)
            assert same(out1[0], obj(rank, count * rank)), "scatter_object_list"
        if rank == 0:
            oc.send_object_list(comm, [obj(0, count), {"k": [1, 2]}], 1)
            back = [None]
            oc.recv_object_list(comm, back, 1)
            assert back == [count], back
        elif rank == 1:
            got = [None, None]
            oc.recv_object_list(comm, got, 0)
            assert same(got[0], obj(0, count)) and got[1] == {"k": [1, 2]}, got
            oc.send_object_list(comm, [count], 0)
    # Only plain data by default: a class instance is refused on every
    # receiving rank, after the bytes moved (the communicator goes on).
    got = [None] * n
    try:
        oc.all_gather_object(comm, got, Point(rank) if rank == 0 else rank)
        raise AssertionError("a class instance was unpickled with weights_only=True")
    except pickle.UnpicklingError as e:
        assert "Point" in str(e), e
    oc.all_gather_object(comm, got, Point(rank), weights_only=False)
    assert got == [Point(r) for r in range(n)], got
    # Argument errors are raised on the calling rank before anything is sent.
    for bad in (
        lambda: oc.all_gather_object(comm, [None] * (n + 1), 1),
        lambda: oc.scatter_object_list(comm, 0, [], [1] * n),
        lambda: oc.broadcast_object_list(comm, "not a list", 0),
    ):
        try:
            bad()
            raise AssertionError("a bad argument was accepted")
        except ValueError:
            pass
    if rank == 0:
        try:
            oc.gather_object(comm, 1, 0, [None])
            raise AssertionError("a short gather list was accepted on the root")
        except ValueError:
            pass
    comm.barrier()


def a2av_rows(comm):
    """all_to_all_v_single counts rows of dimension 0 (TorchComms'
    AllToAllvSingle test shape): rank r sends r + j + 1 rows of width 3 to
    rank j; 1-D arrays count elements; differing row shapes are refused."""
    rank, n = comm.get_rank(), comm.get_size()
    width = 3
    ins = [rank + j + 1 for j in range(n)]
    outs = [i + rank + 1 for i in range(n)]
    rows_in = np.concatenate(
        [np.full((k, width), 100 * rank + j, dtype=np.int32) for j, k in enumerate(ins)]
    )
    out = np.full((sum(outs), width), -1, dtype=np.int32)
    comm.all_to_all_v_single(out, rows_in, outs, ins)
    want = np.concatenate(
        [np.full((k, width), 100 * i + rank, dtype=np.int32) for i, k in enumerate(outs)]
    )
    assert np.array_equal(out, want), out
    flat = np.arange(sum(ins), dtype=np.float32) + rank
    out1 = np.zeros(sum(outs), dtype=np.float32)
    comm.all_to_all_v_single(out1, flat, outs, ins)
    at = 0
    for i, k in enumerate(outs):
        start = sum(i + j + 1 for j in range(rank))
        assert np.array_equal(out1[at : at + k], np.arange(start, start + k, dtype=np.float32) + i)
        at += k
    try:
        comm.all_to_all_v_single(np.zeros((sum(outs), 2), np.int32), rows_in, outs, ins)
        raise AssertionError("row shapes that differ were accepted")
    except ValueError:
        pass
    comm.barrier()


def torchcomms_surface(comm):
    """TorchComms' tensor_register/tensor_deregister around a broadcast
    (its RegisterTensor test), and get_init_handle and the uuid form of
    reconfigure refused with a RuntimeError saying so (its GetInitHandle
    test for a backend without them)."""
    rank = comm.get_rank()
    for count in (4, 1024, 1 << 20):
        for dtype in (np.float32, np.int32, np.int8):
            t = np.full(count, 99, dtype=dtype) if rank == 0 else np.zeros(count, dtype=dtype)
            comm.tensor_register(t)
            try:
                work = comm.broadcast(t, 0, False)
                assert work.is_completed()
                assert np.array_equal(t, np.full(count, 99, dtype=dtype)), t[:4]
            finally:
                comm.tensor_deregister(t)
    try:
        comm.tensor_register([1, 2, 3])
        raise AssertionError("a list was registered")
    except (TypeError, ValueError):
        pass
    try:
        comm.get_init_handle()
        raise AssertionError("get_init_handle returned")
    except RuntimeError as e:
        assert "getInitHandle not implemented" in str(e), e
        assert isinstance(e, chorus.NotSupportedError), type(e)
    try:
        comm.reconfigure(uuid="u", init_handles=["h"])
        raise AssertionError("reconfigure(uuid, init_handles) returned")
    except RuntimeError as e:
        assert isinstance(e, chorus.NotSupportedError), type(e)
        assert "reconfigure not implemented" in str(e), e
    # TorchComms' enable_reconfigure=True is refused before anything is sent.
    try:
        chorus.new_comm("cpu", "cpu", "never-made", enable_reconfigure=True)
        raise AssertionError("enable_reconfigure=True was accepted")
    except RuntimeError as e:
        assert isinstance(e, chorus.NotSupportedError), type(e)
    comm.barrier()


class CommStore:
    """A stand-in for a torch.distributed Store, for runs without torch: the
    two methods Chorus calls, ``set`` on rank 0 and a blocking ``get``
    elsewhere, carried by a broadcast over an existing communicator."""

    def __init__(self, comm):
        self.comm = comm

    def set(self, key, value):
        from chorus import objcol

        objcol.broadcast_object_list(self.comm, [(key, bytes(value))], 0)

    def get(self, key):
        from chorus import objcol

        got = [None]
        objcol.broadcast_object_list(self.comm, got, 0)
        assert got[0][0] == key, got
        return got[0][1]


def torch_store(comm):
    """new_comm(store=<torch Store>) with no CHORUS_SECRET and no
    MASTER_PORT: rank 0 hosts the QUIC store on a free port and publishes it
    with a fresh secret; two communicators of one name in sequence; a store
    of another type is refused."""
    os.environ.pop("CHORUS_SECRET", None)
    os.environ.pop("MASTER_PORT", None)
    store = CommStore(comm)
    n = comm.get_size()
    for _ in range(2):
        c = chorus.new_comm("cpu", "cpu", "via-torch-store", store=store, connect_timeout=60)
        assert (c.get_rank(), c.get_size()) == (comm.get_rank(), n)
        t = np.ones(8, dtype=np.float32)
        c.all_reduce(t, ReduceOp.SUM)
        assert t.tolist() == [float(n)] * 8, t
        c.finalize()
    try:
        chorus.new_comm("cpu", "cpu", "bad-store", store=42)
        raise AssertionError("a store of another type was accepted")
    except TypeError:
        pass


def split_errors(comm):
    """TorchComms' Split tests of bad lists: every rank passing duplicates,
    or every rank a list without itself, raises a RuntimeError on every
    rank, and the communicator goes on."""
    n, rank = comm.get_size(), comm.get_rank()
    try:
        comm.split(list(range(n)) * 2, "duplicate_comm")
        raise AssertionError("duplicate ranks were accepted")
    except RuntimeError as e:
        assert isinstance(e, chorus.InvalidArgumentError), type(e)
    try:
        comm.split([r for r in range(n) if r != rank], "exclude_self_comm")
        raise AssertionError("a list without the caller was accepted")
    except RuntimeError as e:
        assert isinstance(e, (chorus.InvalidArgumentError, chorus.MismatchError)), type(e)
    assert not comm.is_aborted()
    t = np.ones(4, dtype=np.float32)
    comm.all_reduce(t, ReduceOp.SUM)
    assert t.tolist() == [float(n)] * 4, t


SCENARIOS = {
    "split_errors": split_errors,
    "torch_store": torch_store,
    "torchcomms_surface": torchcomms_surface,
    "a2av_rows": a2av_rows,
    "objcol": objcol,
    "grid": grid,
    "fingerprint_mismatch": fingerprint_mismatch,
    "buffers": buffers,
    "mismatch": mismatch,
    "split": split,
    "abort": abort,
    "killed": killed,
    "timeout": timeout,
    "interrupt": interrupt,
    "rejoin": rejoin,
    "gil": gil,
    "torch": torch_tensors,
    "dlpack": dlpack,
    "hooks": hooks,
    "hooks_before_return": hooks_before_return,
    "flight_recorder": flight_recorder,
    "flight_recorder_abort": flight_recorder_abort,
    "persistent": persistent,
    "window": window,
}


def main():
    scenario, *args = sys.argv[1:]
    if os.environ.get("CHORUS_TEST_JOINER"):
        nxt = chorus.join_comm("cpu", "cpu", f"test-{scenario}", connect_timeout=60)
        assert nxt.get_epoch() == 1, nxt.get_epoch()
        after_reconfigure(nxt)
        print(f"OK {scenario}", flush=True)
        return
    # "mismatch" and "hooks" pin the strict checks' guarantees (a mismatch
    # leaves the communicator usable).
    checks = {
        "mismatch": "strict",
        "hooks": "strict",
        "fingerprint_mismatch": "fingerprint",
    }.get(scenario)
    comm = chorus.new_comm("cpu", "cpu", f"test-{scenario}", connect_timeout=60, checks=checks)
    SCENARIOS[scenario](comm, *args)
    if not comm.is_aborted():
        comm.finalize()
    print(f"OK {scenario}", flush=True)


if __name__ == "__main__":
    main()
