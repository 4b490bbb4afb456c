"""Train a small model with torch's DistributedDataParallel over the
``chorus`` torch.distributed backend, then the same run over ``gloo``, and
check that both end with the same weights.

    python -m chorus.run -n 4 python/examples/train_ddp.py [--steps N] [--bench] [--gloo-first]

Both runs start from the same weights, see the same data (each rank its own
shard) and take the same steps; DDP averages the gradients over the ranks
each step. The script prints the largest difference between the two runs'
final weights and exits 1 when it is above 1e-6. ``--bench`` also prints the
median time of a training step with each backend (after 10 warm-up steps);
``--gloo-first`` runs gloo before chorus, to check that the order does not
favour either. Needs torch (CPU).
"""

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import chorus.torch  # noqa: F401 (registers the "chorus" backend)


def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(32, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 64),
        torch.nn.ReLU(),
        torch.nn.Linear(64, 1),
    )


def train(group, steps, rank):
    """``steps`` SGD steps of a DDP replica over ``group``; returns the final
    weights (flat) and each step's seconds."""
    ddp = DDP(model(), process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1 + rank)
    times = []
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen)
        y = x.sum(dim=1, keepdim=True).sin()
        start = time.perf_counter()
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(ddp(x), y)
        loss.backward()
        opt.step()
        times.append(time.perf_counter() - start)
    flat = torch.cat([p.detach().reshape(-1) for p in ddp.parameters()])
    return flat, times


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--bench", action="store_true")
    parser.add_argument("--gloo-first", action="store_true")
    args = parser.parse_args()

    dist.init_process_group("chorus")
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")

    if args.gloo_first:
        w_gloo, t_gloo = train(gloo, args.steps, rank)
        w_chorus, t_chorus = train(None, args.steps, rank)
    else:
        w_chorus, t_chorus = train(None, args.steps, rank)
        w_gloo, t_gloo = train(gloo, args.steps, rank)

    # Every replica must hold the same weights, and both backends the same.
    diff = (w_chorus - w_gloo).abs().max().item()
    spread = w_chorus.clone()
    dist.all_reduce(spread, op=dist.ReduceOp.MAX)
    replica_diff = (spread - w_chorus).abs().max().item()
    if rank == 0:
        print(f"{size} ranks, {args.steps} steps, {w_chorus.numel()} weights")
        print(f"largest |chorus - gloo| weight difference: {diff:.3g}")
        print(f"largest difference between chorus replicas: {replica_diff:.3g}")
        if args.bench:
            for name, times in (("chorus", t_chorus), ("gloo", t_gloo)):
                med = statistics.median(times[10:] or times)
                print(f"{name}: median DDP step {med * 1e6:.0f} us")
    dist.destroy_process_group()
    if diff > 1e-6 or replica_diff > 1e-6:
        print(f"rank {rank}: weights differ by {max(diff, replica_diff):.3g} > 1e-6", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
