"""The PyTorch distributed tutorial's synchronous SGD, rewritten on psring.

Partition the data set, compute gradients on your part, average them over all ranks
after each backward pass -- either with ``all_reduce`` or with the tutorial's own
hand-written ring all-reduce built from ``send``/``recv`` -- and step. A numpy MLP on
scikit-learn's digits (no download). Run it with either topology:

    psring launch -n 4 --topology ring -- python examples/tutorial_sync_sgd.py
    psring launch -n 4 --topology ps   -- python examples/tutorial_sync_sgd.py --hand-written-ring

psring's hand-written ring below folds chunk c starting at rank c, which is psring's
canonical order, so it returns exactly the bits of ``all_reduce`` (checked at start).
"""

from __future__ import annotations

import argparse

import numpy as np

import psring
from psring.training.data import load_digits_split, shard_indices
from psring.training.model import accuracy, forward_backward, init_params


def ring_allreduce(group: psring.BlockingGroup, x: np.ndarray) -> np.ndarray:
    """Sum x over all ranks: ring reduce-scatter then all-gather, from send and recv alone."""
    rank, size = group.rank, group.world_size
    right, left = (rank + 1) % size, (rank - 1) % size
    flat = x.reshape(-1).copy()
    bounds = [(c * flat.size // size, (c + 1) * flat.size // size) for c in range(size)]

    def chunk(c: int) -> np.ndarray:
        a, b = bounds[c % size]
        return flat[a:b]

    # reduce-scatter: at step s, send chunk (rank - s) to the right, add the left's chunk to ours
    for s in range(size - 1):
        handle = group.send(chunk(rank - s), right, async_op=True)  # the tutorial's isend
        received = group.recv(left)
        mine = chunk(rank - s - 1)
        mine[...] = received + mine  # (fold so far) + own: the canonical order
        handle.wait()
    # all-gather: pass the finished chunks around the ring
    for s in range(size - 1):
        handle = group.send(chunk(rank + 1 - s), right, async_op=True)
        chunk(rank - s)[...] = group.recv(left)
        handle.wait()
    return flat.reshape(x.shape)


def average_gradients(group: psring.BlockingGroup, grads: dict[str, np.ndarray], hand_written: bool) -> None:
    n = np.float32(group.world_size)
    for name, g in grads.items():
        total = ring_allreduce(group, g) if hand_written else group.all_reduce(g, op="sum")
        grads[name] = total / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--lr", type=float, default=0.5)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--hand-written-ring", action="store_true", help="average with ring_allreduce, not all_reduce")
    args = parser.parse_args()

    group = psring.init()  # RANK, WORLD_SIZE, MASTER_ADDR/PORT from psring launch
    try:
        rank, size = group.rank, group.world_size
        probe = np.random.default_rng(rank).standard_normal(1001).astype(np.float32)
        same = bool(np.array_equal(ring_allreduce(group, probe), group.all_reduce(probe)))
        print(f"rank {rank}: hand-written ring == all_reduce: {same}", flush=True)

        xtr, ytr, xte, yte = load_digits_split(seed=0)
        params = {k: group.broadcast(v, src=0) for k, v in init_params(seed=rank).items()}
        for epoch in range(args.epochs):
            idx = shard_indices(len(xtr), epoch, 0, rank, size)  # this rank's partition
            losses = []
            for start in range(0, len(idx), args.batch_size):
                batch = idx[start : start + args.batch_size]
                loss, grads = forward_backward(params, xtr[batch], ytr[batch])
                average_gradients(group, grads, args.hand_written_ring)
                for name, g in grads.items():
                    params[name] -= np.float32(args.lr) * g
                losses.append(loss)
            print(f"rank {rank}: epoch {epoch + 1} loss {np.mean(losses):.4f}", flush=True)
        digest = np.array([sum(int(v.view(np.uint32).sum()) for v in params.values()) % (1 << 62)], np.int64)
        agree = len({int(d[0]) for d in group.all_gather(digest)}) == 1
        print(f"rank {rank}: test accuracy {accuracy(params, xte, yte):.4f}, ranks agree: {agree}", flush=True)
    finally:
        group.close()


if __name__ == "__main__":
    main()
