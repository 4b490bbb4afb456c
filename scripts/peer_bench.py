#!/usr/bin/env python3
"""Peer benchmark for scripts/compare-peers.sh: the same measurement as
chorus-perf (per-op time on every rank, max over ranks, median over ops;
nccl-tests algbw/busbw), for MPI (mpi4py, run under mpiexec) and PyTorch's
gloo backend (this script starts the ranks itself).

Prints one JSON object per size, in chorus-perf's --json schema. Rooted
ops use root 0; ping_pong reports half the round trip, as chorus-perf does.
MPI has no list form of all-to-all, so all_to_all and all_to_all_single
both run MPI_Alltoall; gloo has no list all_to_all either (that op exits
with an error there). all_gather runs in place on MPI (MPI_IN_PLACE), as
chorus-perf's --in-place-only does; PyTorch's gloo has no in-place
all_gather, so there it copies from a separate input.

  mpiexec -n 2 python peer_bench.py --system mpich --op all_reduce -b 8 -e 128M -f 4
  python peer_bench.py --system gloo --op all_reduce -n 2 -b 8 -e 128M -f 4
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import time

import numpy as np


def parse_size(s):
    s = s.strip().upper()
    mul = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(s[-1:], 1)
    return int(s[:-1] if mul > 1 else s) * mul


BLOCKED = ("all_gather", "reduce_scatter", "gather", "scatter", "all_to_all", "all_to_all_single")
OPS = BLOCKED + ("all_reduce", "broadcast", "reduce", "send_recv", "ping_pong")


def bus_factor(op, n):
    """nccl-tests' busbw factors (its *GetBw functions)."""
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in BLOCKED:
        return (n - 1) / n
    return 1.0


def sizes(a):
    b = a.minbytes
    while b <= a.maxbytes:
        yield b
        b *= a.stepfactor


def counts(op, nbytes, n):
    total = max(nbytes // 4, 1)
    if op in BLOCKED:
        per = max(total // n, 1)
        return per * n, per
    return total, total


def settle(rank, max_over_ranks):
    """200 ms of tiny collectives before the first size, as chorus-perf does:
    freshly started ranks may share a core until the scheduler spreads them."""
    t0 = time.perf_counter()
    while True:
        stop = 1.0 if rank == 0 and time.perf_counter() - t0 > 0.2 else 0.0
        if max_over_ranks([stop])[0] > 0:
            return


def run(a, rank, n, do_op, barrier, max_over_ranks, make):
    settle(rank, max_over_ranks)
    for nbytes in sizes(a):
        count, per = counts(a.op, nbytes, n)
        bufs = make(count, per)
        do_op(bufs)  # probe
        t0 = time.perf_counter(); do_op(bufs); est = max_over_ranks([time.perf_counter() - t0])[0]
        iters = int(min(a.iters, max(3, a.budget / max(est, 1e-7))))
        for _ in range(min(a.warmup, iters)):
            do_op(bufs)
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            do_op(bufs)
            times.append(time.perf_counter() - t0)
        t = float(np.median(max_over_ranks(times)))
        if a.op == "ping_pong":
            t /= 2  # one timed op is a round trip
        algbw = count * 4 / t / 1e9
        if rank == 0:
            print(json.dumps({"system": a.system, "op": a.op, "nranks": n, "size": count * 4,
                              "count": count, "type": "float",
                              "in_place": {"time_us": t * 1e6, "algbw_gbs": algbw,
                                           "busbw_gbs": algbw * bus_factor(a.op, n)}}),
                  flush=True)


def mpi_main(a):
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    rank, n = comm.Get_rank(), comm.Get_size()
    if a.op in ("send_recv", "ping_pong") and n < 2:
        sys.exit(f"{a.op} needs at least 2 ranks")

    def make(count, per):
        src_len = per if a.op in ("all_gather", "gather", "scatter") else count
        if a.op == "scatter":
            src_len = count if rank == 0 else 0
        dst_len = {"reduce_scatter": per, "scatter": per,
                   "gather": count if rank == 0 else 0}.get(a.op, count)
        return np.ones(src_len, dtype=np.float32), np.empty(dst_len, dtype=np.float32)

    def do_op(b):
        src, dst = b
        op = a.op
        if op == "all_reduce":
            comm.Allreduce(MPI.IN_PLACE, src, op=MPI.SUM)
        elif op == "all_gather":
            # In place, as chorus-perf --in-place-only runs it: this rank's
            # block already sits in dst.
            comm.Allgather(MPI.IN_PLACE, dst)
        elif op == "broadcast":
            comm.Bcast(src, root=0)
        elif op == "reduce_scatter":
            comm.Reduce_scatter_block(src, dst, op=MPI.SUM)
        elif op == "reduce":
            if rank == 0:
                comm.Reduce(MPI.IN_PLACE, src, op=MPI.SUM, root=0)
            else:
                comm.Reduce(src, None, op=MPI.SUM, root=0)
        elif op == "gather":
            comm.Gather(src, dst if rank == 0 else None, root=0)
        elif op == "scatter":
            comm.Scatter(src if rank == 0 else None, dst, root=0)
        elif op in ("all_to_all", "all_to_all_single"):
            comm.Alltoall(src, dst)
        elif op == "send_recv":
            if rank == 0:
                comm.Send(src, dest=1)
            elif rank == 1:
                comm.Recv(src, source=0)
        elif op == "ping_pong":
            if rank == 0:
                comm.Send(src, dest=1)
                comm.Recv(dst, source=1)
            elif rank == 1:
                comm.Recv(dst, source=0)
                comm.Send(src, dest=0)

    def max_over(times):
        t = np.array(times, dtype=np.float64)
        out = np.empty_like(t)
        comm.Allreduce(t, out, op=MPI.MAX)
        return out

    run(a, rank, n, do_op, comm.Barrier, max_over, make)


def gloo_rank(a):
    import torch
    import torch.distributed as dist
    rank, n = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dist.init_process_group("gloo", rank=rank, world_size=n)

    if a.op == "all_to_all":
        sys.exit("gloo has no list all_to_all")

    def make(count, per):
        if a.op == "all_gather":
            return torch.ones(per), torch.empty(count)
        if a.op == "reduce_scatter":
            return torch.ones(count), torch.empty(per)
        if a.op == "gather":
            return torch.ones(per), [torch.empty(per) for _ in range(n)] if rank == 0 else None
        if a.op == "scatter":
            return [torch.ones(per) for _ in range(n)] if rank == 0 else None, torch.empty(per)
        if a.op in ("all_to_all_single", "ping_pong"):
            return torch.ones(count), torch.empty(count)
        return torch.ones(count), None

    def do_op(b):
        src, dst = b
        if a.op == "all_reduce":
            dist.all_reduce(src)
        elif a.op == "all_gather":
            dist.all_gather_into_tensor(dst, src)
        elif a.op == "broadcast":
            dist.broadcast(src, 0)
        elif a.op == "reduce_scatter":
            # gloo has no native reduce_scatter: PyTorch's fallback is what users get.
            dist.reduce_scatter_tensor(dst, src)
        elif a.op == "reduce":
            dist.reduce(src, 0)
        elif a.op == "gather":
            dist.gather(src, dst, dst=0)
        elif a.op == "scatter":
            dist.scatter(dst, src, src=0)
        elif a.op == "all_to_all_single":
            dist.all_to_all_single(dst, src)
        elif a.op == "send_recv":
            if rank == 0:
                dist.send(src, 1)
            elif rank == 1:
                dist.recv(src, 0)
        elif a.op == "ping_pong":
            if rank == 0:
                dist.send(src, 1)
                dist.recv(dst, 1)
            elif rank == 1:
                dist.recv(dst, 0)
                dist.send(src, 0)

    def max_over(times):
        t = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.numpy()

    run(a, rank, n, do_op, dist.barrier, max_over, make)
    dist.destroy_process_group()


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--system", required=True)
    p.add_argument("--op", required=True, choices=OPS)
    p.add_argument("-b", dest="minbytes", type=parse_size, default=8)
    p.add_argument("-e", dest="maxbytes", type=parse_size, default=128 << 20)
    p.add_argument("-f", dest="stepfactor", type=int, default=2)
    p.add_argument("-n", dest="nranks", type=int, default=2)
    p.add_argument("-w", dest="warmup", type=int, default=3)
    p.add_argument("-i", dest="iters", type=int, default=20)
    p.add_argument("--budget", type=float, default=1.0)
    a = p.parse_args()
    if a.system == "gloo":
        if "RANK" in os.environ:
            return gloo_rank(a)
        env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   WORLD_SIZE=str(a.nranks), OMP_NUM_THREADS="1")
        procs = [subprocess.Popen([sys.executable] + sys.argv, env=dict(env, RANK=str(r)),
                                  stdout=None if r == 0 else subprocess.DEVNULL)
                 for r in range(a.nranks)]
        sys.exit(max(pr.wait() for pr in procs))
    mpi_main(a)


if __name__ == "__main__":
    main()
