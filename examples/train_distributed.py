"""Data-parallel DP-SGD on scikit-learn's digits over several processes (Gloo on CPU).

Run it on 2 local processes::

    torchrun --nproc_per_node 2 examples/train_distributed.py
    torchrun --nproc_per_node 2 examples/train_distributed.py --epochs 5 --backend aot_eager

Every rank holds its strided shard of the training data (``distributed.local_shard``) and draws
its part of one global Poisson batch (``DistributedPoissonSampler``: the union over ranks is a
Poisson sample of the whole training set at rate q). Each step, every rank computes the clipped
sum of its own examples with the compiled step, ``distributed.sum_gradients`` all-reduces the
sums, and every rank's ``DPOptimizer``, built from the same broadcast key, adds the identical
noise once to the global sum and divides by the global expected batch size q*N; so the replicas
stay identical and the accountant (the same on every rank) sees the whole dataset. Rank 0
prints the held-out accuracy and the epsilon spent.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from sklearn.datasets import load_digits

import opake_compile as opake
from opake_compile import distributed
from opake_compile import random as oprandom


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=128, help="global expected batch size q*N")
    p.add_argument("--noise-multiplier", type=float, default=1.0)
    p.add_argument("--clipping-norm", type=float, default=1.0)
    p.add_argument("--lr", type=float, default=0.5)
    p.add_argument("--delta", type=float, default=1e-5)
    p.add_argument("--backend", default="inductor", help="compile_dp backend (aot_eager compiles fastest)")
    args = p.parse_args()

    dist.init_process_group("gloo")  # torchrun sets RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    rank, world = distributed.get_rank(), distributed.get_world_size()

    # Public preprocessing only: pixels / 16 (a fixed constant), a fixed train/test split.
    digits = load_digits()
    x = torch.tensor(digits.data, dtype=torch.float32) / 16.0
    y = torch.tensor(digits.target)
    perm = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    test, train = perm[:360], perm[360:]
    shard = list(distributed.local_shard(range(len(train))).indices)  # this rank's examples
    x_shard, y_shard = x[train[shard]], y[train[shard]]

    model = nn.Sequential(nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 10))
    distributed.broadcast_parameters(model)  # identical replicas

    # One root key for the whole job, rank 0's; split for the noise and the sampler.
    noise_key, sampler_key = oprandom.split(distributed.broadcast_key(oprandom.random_key()))
    sampler = distributed.DistributedPoissonSampler(len(train), args.batch_size / len(train), key=sampler_key)

    @opake.compile_dp(model=model, clipping_norm=args.clipping_norm, backend=args.backend,
                      physical_batch_size=max(8, 2 * args.batch_size // world))
    def step(model, xb, yb):
        return F.cross_entropy(model(xb), yb)

    optimizer = opake.DPOptimizer(torch.optim.SGD(model.parameters(), lr=args.lr),
                                  noise_multiplier=args.noise_multiplier, sampler=sampler, key=noise_key)

    for epoch in range(args.epochs):
        for batch in sampler:  # positions into this rank's shard; may be empty: still step
            out = step(x_shard[batch], y_shard[batch])
            optimizer.step(distributed.sum_gradients(out.clipped))
        with torch.no_grad():
            accuracy = (model(x[test]).argmax(1) == y[test]).float().mean().item()
        if rank == 0:
            print(f"epoch {epoch + 1}: test accuracy {accuracy:.3f}, "
                  f"epsilon {optimizer.epsilon(args.delta):.2f} (delta {args.delta:g}, q {sampler.sample_rate:.4f})")

    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    in_sync = torch.equal(distributed.all_reduce(flat, "max"), distributed.all_reduce(flat, "min"))
    if rank == 0:
        print(f"{world} ranks, {optimizer.steps} steps, replicas identical: {in_sync}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
