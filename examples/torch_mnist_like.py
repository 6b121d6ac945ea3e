"""A plain PyTorch training loop with psring underneath (no downloads: scikit-learn's digits).

    psring launch -n 4 --topology ring -- python examples/torch_mnist_like.py
    psring launch -n 4 --topology ps   -- python examples/torch_mnist_like.py
    python examples/torch_mnist_like.py --single --world 4     # one process, the same global batches

Each step the global batch (batch-size x world samples) is split evenly over the ranks; every
rank's loss is the mean over its share, and DistributedOptimizer averages the gradients, so
the step equals one over the whole global batch -- what ``--single`` computes in one process.
Only the model, data loading and optimizer lines are torch; the three psring lines are marked.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch
from sklearn.datasets import load_digits

import psring
import psring.torch as pt


def data() -> tuple[torch.Tensor, torch.Tensor]:
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    return torch.from_numpy(x), torch.from_numpy(digits.target.astype(np.int64))


def model_for(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=16, help="samples per rank per step")
    p.add_argument("--lr", type=float, default=0.1)
    p.add_argument("--single", action="store_true", help="one process, full global batches (the reference)")
    p.add_argument("--world", type=int, default=4, help="with --single: the world size to imitate")
    p.add_argument("--out", default=None, help="save the final parameters (rank 0) to this .npz")
    args = p.parse_args(argv)
    torch.set_num_threads(1)

    if args.single:
        group, rank, world = None, 0, args.world
    else:
        group = psring.init()  # psring (1/3): join the group RANK/WORLD_SIZE describe
        rank, world = group.rank, group.world_size
    model = model_for(seed=rank)  # deliberately different on every rank...
    opt = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=0.9)
    if group is not None:
        pt.broadcast_parameters(model, group)  # psring (2/3): ...until rank 0's weights win
        opt = pt.DistributedOptimizer(opt, group)  # psring (3/3): averaged gradients
    x, y = data()
    global_batch = args.batch_size * world
    for epoch in range(args.epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        total, steps = 0.0, 0
        for start in range(0, len(order) - global_batch + 1, global_batch):
            idx = order[start : start + global_batch]
            if group is not None:
                idx = idx[rank * args.batch_size : (rank + 1) * args.batch_size]
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            opt.step()
            total += loss.item()
            steps += 1
        mean = total / steps
        if group is not None:
            mean = float(group.all_reduce(np.array([mean]), op="avg")[0])
        if rank == 0:
            with torch.no_grad():
                acc = float((model(x).argmax(1) == y).float().mean())
            print(f"epoch {epoch} loss {mean:.4f} accuracy {acc:.4f}", flush=True)
    if args.out and rank == 0:
        np.savez(args.out, **{k: v.detach().numpy() for k, v in model.state_dict().items()})
    if group is not None:
        group.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
