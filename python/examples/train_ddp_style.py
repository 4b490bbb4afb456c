"""DDP-style data-parallel training with Chorus: every rank computes the
gradient of a small linear model on its own shard of the data, then the
gradients are averaged with ``all_reduce(AVG)`` so every rank takes the same
step and the replicas stay identical.

    python -m chorus.run -n 4 python/examples/train_ddp_style.py

NumPy only; with torch installed, ``--torch`` runs the same loop on CPU torch
tensors.
"""

import sys

import numpy as np

import chorus


def main():
    use_torch = "--torch" in sys.argv
    comm = chorus.new_comm("cpu", "cpu", "ddp")
    rank, size = comm.get_rank(), comm.get_size()

    # The same true weights everywhere; each rank draws its own data shard.
    features, steps, lr = 64, 200, 0.1
    true_w = np.random.default_rng(0).standard_normal(features).astype(np.float32)
    rng = np.random.default_rng(1 + rank)
    x = rng.standard_normal((256, features)).astype(np.float32)
    y = x @ true_w

    # Replicas start from rank 0's weights (broadcast), as DDP does.
    w = rng.standard_normal(features).astype(np.float32)
    comm.broadcast(w, 0)

    if use_torch:
        import torch

        w_t = torch.from_numpy(w)  # shares memory with w
    grad = np.empty(features, dtype=np.float32)
    for step in range(steps):
        err = x @ w - y
        grad[:] = 2.0 * x.T @ err / len(x)
        # Average the gradients across ranks, in place (no copy).
        if use_torch:
            g = torch.from_numpy(grad)
            comm.all_reduce(g, chorus.ReduceOp.AVG)
        else:
            comm.all_reduce(grad, chorus.ReduceOp.AVG)
        w -= lr * grad
        if step % 50 == 0 and rank == 0:
            loss = float(np.mean(err * err))
            print(f"step {step:3d} loss {loss:.6f}")

    # Every replica must hold the same weights: compare with rank 0's.
    ref = w.copy()
    comm.broadcast(ref, 0)
    assert np.array_equal(ref, w), f"rank {rank}: replicas diverged"
    dist = float(np.max(np.abs(w - true_w)))
    if use_torch:
        assert w_t.data_ptr() == w.ctypes.data
    print(f"rank {rank}/{size}: done, max |w - w_true| = {dist:.2e}")
    assert dist < 1e-3, "did not converge"
    comm.finalize()


if __name__ == "__main__":
    main()
