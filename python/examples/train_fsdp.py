"""Train a small model with torch's FSDP (``fully_shard``, on CPU) over the
``chorus`` torch.distributed backend, then the same run over ``gloo``, and
check that both end with the same weights.

    python -m chorus.run -n 4 python/examples/train_fsdp.py [--steps N]

Each layer's parameters are sharded over the ranks: every step all-gathers
them for the forward and backward passes and reduce-scatters the
gradients. The script prints the largest difference between the two runs'
final (unsharded) weights and exits 1 when it is above 1e-5 (the two
backends add the ranks' gradients in different orders). Needs torch (CPU).
"""

import argparse
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard

import chorus.torch  # noqa: F401 (registers the "chorus" backend)


def train(mesh, steps, rank):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1)
    )
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(1 + rank)
    for _ in range(steps):
        x = torch.randn(16, 32, generator=gen)
        y = x.sum(dim=1, keepdim=True).sin()
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return torch.cat([p.full_tensor().reshape(-1) for p in model.parameters()])


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()

    dist.init_process_group("chorus")
    rank, size = dist.get_rank(), dist.get_world_size()
    gloo = dist.new_group(backend="gloo")
    w_chorus = train(DeviceMesh.from_group(dist.group.WORLD, "cpu"), args.steps, rank)
    w_gloo = train(DeviceMesh.from_group(gloo, "cpu"), args.steps, rank)
    diff = (w_chorus - w_gloo).abs().max().item()
    if rank == 0:
        print(f"{size} ranks, {args.steps} FSDP steps, {w_chorus.numel()} weights")
        print(f"largest |chorus - gloo| weight difference: {diff:.3g}")
    dist.destroy_process_group()
    if diff > 1e-5:
        print(f"rank {rank}: weights differ by {diff:.3g} > 1e-5", file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
