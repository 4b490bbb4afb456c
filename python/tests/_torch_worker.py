"""One rank of a torch.distributed test over the ``chorus`` backend
(``chorus.torch``): ``python _torch_worker.py SCENARIO``, started by
conftest.spawn_ranks with the launcher's environment (env://). Prints
``OK SCENARIO`` when every check passed; an assertion or an error exits
non-zero."""

import datetime
import sys

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _coalescing_manager

import chorus
import chorus.torch  # noqa: F401 (registers "chorus")

SCENARIOS = {}


def scenario(fn):
    SCENARIOS[fn.__name__] = fn
    return fn


def init():
    dist.init_process_group("chorus", timeout=datetime.timedelta(seconds=60))
    return dist.get_rank(), dist.get_world_size()


def value(rank, n, dtype=torch.float32):
    """Rank ``rank``'s test input: ``rank + 1 + i`` at index i."""
    return (torch.arange(n) + rank + 1).to(dtype)


@scenario
def collectives():
    """Every c10d collective against a reference computed here, in several
    dtypes, sizes around the small/large switch, in place or not."""
    rank, n = init()
    ranks = range(n)
    for dtype in (torch.float32, torch.float64, torch.int64, torch.bfloat16):
        for count in (1, 7, 5000):
            inputs = [value(r, count, dtype) for r in ranks]
            # all_reduce, every op.
            for op, ref in (
                (dist.ReduceOp.SUM, sum(inputs[1:], inputs[0].clone())),
                (dist.ReduceOp.MAX, torch.stack(inputs).amax(0)),
                (dist.ReduceOp.MIN, torch.stack(inputs).amin(0)),
            ):
                t = inputs[rank].clone()
                dist.all_reduce(t, op=op)
                assert torch.equal(t, ref.to(dtype)), (dtype, count, op, t[:4], ref[:4])
            # broadcast from each root.
            for root in ranks:
                t = inputs[rank].clone()
                dist.broadcast(t, root)
                assert torch.equal(t, inputs[root])
            # reduce to the last rank.
            t = inputs[rank].clone()
            dist.reduce(t, n - 1, op=dist.ReduceOp.SUM)
            if rank == n - 1:
                assert torch.equal(t, sum(inputs[1:], inputs[0].clone()))
            # all_gather (list) and all_gather_into_tensor.
            outs = [torch.zeros(count, dtype=dtype) for _ in ranks]
            dist.all_gather(outs, inputs[rank])
            assert all(torch.equal(o, i) for o, i in zip(outs, inputs))
            flat = torch.zeros(n * count, dtype=dtype)
            dist.all_gather_into_tensor(flat, inputs[rank])
            assert torch.equal(flat, torch.cat(inputs))
            # reduce_scatter (list) and reduce_scatter_tensor.
            big = [value(r, n * count, dtype) for r in ranks]
            total = sum(big[1:], big[0].clone())
            out = torch.zeros(count, dtype=dtype)
            dist.reduce_scatter_tensor(out, big[rank])
            assert torch.equal(out, total[rank * count : (rank + 1) * count])
            out = torch.zeros(count, dtype=dtype)
            dist.reduce_scatter(out, list(big[rank].chunk(n)))
            assert torch.equal(out, total[rank * count : (rank + 1) * count])
            # gather and scatter through rank 1.
            got = [torch.zeros(count, dtype=dtype) for _ in ranks] if rank == 1 else None
            dist.gather(inputs[rank], got, dst=1)
            if rank == 1:
                assert all(torch.equal(g, i) for g, i in zip(got, inputs))
            out = torch.zeros(count, dtype=dtype)
            dist.scatter(out, inputs if rank == 1 else None, src=1)
            assert torch.equal(out, inputs[rank])
            # all_to_all_single, even, and all_to_all.
            send = torch.cat([value(rank * n + d, count, dtype) for d in ranks])
            recv = torch.zeros(n * count, dtype=dtype)
            dist.all_to_all_single(recv, send)
            assert torch.equal(recv, torch.cat([value(s * n + rank, count, dtype) for s in ranks]))
            outs = [torch.zeros(count, dtype=dtype) for _ in ranks]
            dist.all_to_all(outs, list(send.chunk(n)))
            assert torch.equal(torch.cat(outs), recv)
    # AVG and PREMUL_SUM on floats; PRODUCT and the bitwise ops on ints.
    t = value(rank, 4)
    dist.all_reduce(t, op=dist.ReduceOp.AVG)
    assert torch.allclose(t, sum(value(r, 4) for r in ranks) / n)
    t = value(rank, 4)
    dist.all_reduce(t, op=dist._make_nccl_premul_sum(0.5))
    assert torch.allclose(t, sum(value(r, 4) for r in ranks) * 0.5)
    t = torch.tensor([rank + 2, 3], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.PRODUCT)
    prod = 1
    for r in ranks:
        prod *= r + 2
    assert t.tolist() == [prod, 3**n]
    t = torch.tensor([1 << rank], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.BOR)
    assert t.item() == (1 << n) - 1
    t = torch.tensor([0b1111 ^ (1 << rank)], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.BAND)
    assert t.item() == 0b1111 & ~((1 << n) - 1)
    t = torch.tensor([1 << rank, 1], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.BXOR)
    assert t.tolist() == [(1 << n) - 1, n % 2]
    # all_to_all_single with uneven splits: rank r sends d+1 rows of 3 to rank d.
    send = torch.cat([torch.full((d + 1, 3), float(rank * 10 + d)) for d in ranks])
    recv = torch.zeros((n * (rank + 1), 3))
    dist.all_to_all_single(recv, send, [rank + 1] * n, [d + 1 for d in ranks])
    expect = torch.cat([torch.full((rank + 1, 3), float(s * 10 + rank)) for s in ranks])
    assert torch.equal(recv, expect), (recv, expect)
    # Uneven all_gather (list form).
    outs = [torch.zeros(r + 1) for r in ranks]
    dist.all_gather(outs, torch.full((rank + 1,), float(rank)))
    assert all(torch.equal(o, torch.full((r + 1,), float(r))) for r, o in enumerate(outs))
    # Non-contiguous and complex tensors.
    t = torch.ones(6, 4).t()[:, 1:4]
    assert not t.is_contiguous()
    dist.all_reduce(t)
    assert torch.equal(t, torch.full((4, 3), float(n)))
    c = torch.full((5,), complex(rank, 1), dtype=torch.complex64)
    dist.all_reduce(c)
    assert torch.equal(c, torch.full((5,), complex(sum(ranks), n), dtype=torch.complex64))
    try:
        dist.all_reduce(torch.ones(2, dtype=torch.complex64), op=dist.ReduceOp.MAX)
        raise AssertionError("MAX on complex tensors did not raise")
    except ValueError as e:
        assert "complex" in str(e)
    # Point to point, blocking and batched, around the ring.
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    got = torch.zeros(3)
    if rank % 2 == 0:
        dist.send(value(rank, 3), nxt)
        dist.recv(got, prv)
    else:
        dist.recv(got, prv)
        dist.send(value(rank, 3), nxt)
    assert torch.equal(got, value(prv, 3))
    got = torch.zeros(3)
    reqs = dist.batch_isend_irecv(
        [dist.P2POp(dist.isend, value(rank, 3), nxt), dist.P2POp(dist.irecv, got, prv)]
    )
    for req in reqs:
        req.wait()
    assert torch.equal(got, value(prv, 3))
    # Objects, barrier, monitored_barrier.
    objs = [None] * n
    dist.all_gather_object(objs, {"rank": rank})
    assert objs == [{"rank": r} for r in ranks]
    objs = [{"a": 1}, [2]] if rank == 0 else [None, None]
    dist.broadcast_object_list(objs, src=0)
    assert objs == [{"a": 1}, [2]]
    out = [None]
    dist.scatter_object_list(out, [i * 3 for i in ranks] if rank == 0 else None, src=0)
    assert out[0] == rank * 3
    got = [None] * n if rank == 0 else None
    dist.gather_object(rank, got, dst=0)
    assert rank != 0 or got == list(ranks)
    dist.barrier()
    dist.monitored_barrier(timeout=datetime.timedelta(seconds=30), wait_all_ranks=True)
    assert dist.get_backend() == "chorus"
    dist.destroy_process_group()
    print("OK collectives")


@scenario
def futures():
    """Async ops: 200 all_reduces in flight, their futures (with a
    ``then`` callback, as DDP's comm hooks use) complete with the right
    values; ``wait`` after the future; ``is_completed``; a coalesced group."""
    rank, n = init()
    tensors = [torch.full((64,), float(rank + i)) for i in range(200)]
    works = [dist.all_reduce(t, async_op=True) for t in tensors]
    futs = [w.get_future().then(lambda f: f.value()[0] * 2) for w in works[::2]]
    for i, f in enumerate(futs):
        want = 2 * sum(float(r + 2 * i) for r in range(n))
        assert torch.equal(f.wait(), torch.full((64,), want)), i
    for i, w in enumerate(works):
        w.wait()
        # torch's wrapper of a Python backend's work answers is_completed()
        # from its own flag (always false); the future is the reliable test.
        assert w.get_future().done()
        assert torch.equal(tensors[i], torch.full((64,), sum(float(r + i) for r in range(n))))
    # Coalesced all_reduces (the fast path), then a coalescing block on the
    # device: collectives and a ring of 4 MiB sends and receives in one block.
    ts = [torch.full((3,), float(rank)) for _ in range(4)]
    with _coalescing_manager(async_ops=True) as cm:
        for t in ts:
            dist.all_reduce(t)
    cm.wait()
    assert all(torch.equal(t, torch.full((3,), float(sum(range(n))))) for t in ts)
    big = torch.full((1 << 20,), float(rank))
    got = torch.zeros(1 << 20)
    nxt, prv = (rank + 1) % n, (rank - 1) % n
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, big, nxt), dist.P2POp(dist.irecv, got, prv)])
    for req in reqs:
        req.wait()
    assert torch.equal(got, torch.full((1 << 20,), float(prv)))
    t = torch.ones(2)
    with _coalescing_manager(device=torch.device("cpu"), async_ops=True) as cm:
        dist.all_reduce(t)
    cm.wait()
    assert torch.equal(t, torch.full((2,), float(n)))
    # A failed async op fails its future, and a then-callback's future.
    w = dist.all_reduce(torch.ones(3 if rank == 0 else 5), async_op=True)
    for fut in (w.get_future(), w.get_future().then(lambda f: f.value())):
        try:
            fut.wait()
            raise AssertionError("the future of a mismatched op succeeded")
        except RuntimeError as e:
            assert "mismatch" in str(e).lower(), str(e)
    dist.destroy_process_group()
    print("OK futures")


@scenario
def groups():
    """Subgroups (``new_group``) led by ranks other than 0, a device mesh
    over the backend, and process groups created and destroyed in cycles."""
    rank, n = init()
    # Two disjoint groups: {0, 2} led by rank 0 and {1, 3} led by rank 1,
    # so a process other than the job's rank 0 hosts a group's store.
    evens, odds = dist.new_group([0, 2]), dist.new_group([1, 3])
    mine = evens if rank % 2 == 0 else odds
    t = torch.tensor([float(rank)])
    dist.all_reduce(t, group=mine)
    assert t.item() == (0 + 2 if rank % 2 == 0 else 1 + 3)
    upper = dist.new_group([2, 3])
    if rank >= 2:
        t = torch.tensor([float(rank)])
        dist.broadcast(t, group_src=1, group=upper)
        assert t.item() == 3.0
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, n // 2), mesh_dim_names=("dp", "tp"))
    for dim in ("dp", "tp"):
        g = mesh.get_group(dim)
        t = torch.ones(2)
        dist.all_reduce(t, group=g)
        assert torch.equal(t, torch.full((2,), float(dist.get_world_size(g)))), dim
    try:
        dist.split_group(split_ranks=[[0, 1], [2, 3]])
        raise AssertionError("split_group worked: test and document it")
    except RuntimeError as e:
        assert "splitting" in str(e), str(e)
    dist.destroy_process_group()
    for cycle in range(5):
        dist.init_process_group("chorus", timeout=datetime.timedelta(seconds=60))
        t = torch.tensor([float(rank + cycle)])
        dist.all_reduce(t)
        assert t.item() == sum(r + cycle for r in range(n)), cycle
        dist.destroy_process_group()
    print("OK groups")


@scenario
def mismatch():
    """Ranks disagreeing on an op's size: a ``RuntimeError`` (Chorus's
    ``MismatchError``) on every rank, where gloo would not notice."""
    rank, _ = init()
    try:
        dist.all_reduce(torch.ones(3 if rank == 0 else 4))
        raise AssertionError("a mismatched all_reduce succeeded")
    except RuntimeError as e:
        assert isinstance(e, chorus.MismatchError), repr(e)
    dist.destroy_process_group()
    print("OK mismatch")


@scenario
def monitored_barrier_names_the_missing_rank():
    """The last rank never reaches the monitored barrier: rank 0 raises
    naming it; the others time out waiting for rank 0's release."""
    rank, n = init()
    dist.barrier()
    if rank == n - 1:
        print("OK monitored_barrier_names_the_missing_rank")
        return
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=2), wait_all_ranks=True)
        raise AssertionError("monitored_barrier passed without the last rank")
    except RuntimeError as e:
        if rank == 0:
            assert f"[{n - 1}]" in str(e), str(e)
        else:
            assert "did not release" in str(e), str(e)
    print("OK monitored_barrier_names_the_missing_rank")


@scenario
def device_mesh_over_communicators():
    """TorchComms' ``init_device_mesh`` over Chorus communicators split
    row-major (2 x 2): each dimension's group reduces within its line, the
    global communicator is the default group, and a ``DTensor`` sharded on
    one dimension gathers back whole."""
    from torch.distributed.tensor import Shard, distribute_tensor

    from chorus.device_mesh import init_device_mesh

    world = chorus.new_comm("cpu", "cpu", "world")
    r = world.get_rank()
    tp = world.split([r // 2 * 2, r // 2 * 2 + 1], f"tp{r // 2}")
    dp = world.split([r % 2, r % 2 + 2], f"dp{r % 2}")
    mesh = init_device_mesh((dp, tp), ("dp", "tp"), _global_comm=world)
    assert (mesh.get_local_rank("dp"), mesh.get_local_rank("tp")) == (r // 2, r % 2)
    t = torch.tensor([float(r)])
    dist.all_reduce(t, group=mesh.get_group("tp"))
    assert t.item() == (1.0 if r < 2 else 5.0)
    t = torch.tensor([float(r)])
    dist.all_reduce(t, group=mesh.get_group("dp"))
    assert t.item() == (2.0 if r % 2 == 0 else 4.0)
    t = torch.tensor([float(r)])
    dist.all_reduce(t)
    assert t.item() == 6.0 and dist.get_rank() == r and dist.get_world_size() == 4
    x = torch.arange(16, dtype=torch.float32).view(4, 4)
    d = distribute_tensor(x, mesh["tp"], [Shard(0)])
    assert d.to_local().shape == (2, 4)
    assert torch.equal(d.full_tensor(), x)
    try:
        init_device_mesh((dp, tp), ("dp", "tp"))
        raise AssertionError("a 2-D mesh without _global_comm was accepted")
    except ValueError as e:
        assert "_global_comm" in str(e)
    # TorchComms' _create_torchcomm_process_group: a group over a
    # communicator, its global ranks given by a mapping.
    from chorus.device_mesh import _create_torchcomm_process_group

    odd = world.split([r % 2, r % 2 + 2], f"pg{r % 2}")
    pg = _create_torchcomm_process_group(
        odd, f"pg{r % 2}", global_ranks_mapping={r % 2: 0, r % 2 + 2: 1}
    )
    assert dist.get_process_group_ranks(pg) == [r % 2, r % 2 + 2], dist.get_process_group_ranks(pg)
    t = torch.tensor([float(r)])
    dist.all_reduce(t, group=pg)
    assert t.item() == (2.0 if r % 2 == 0 else 4.0)
    dist.barrier(group=pg)
    for c in (odd, tp, dp, world):
        c.finalize()
    print("OK device_mesh_over_communicators")


if __name__ == "__main__":
    SCENARIOS[sys.argv[1]]()
