"""DDP over a model with a sparse embedding (nn.Embedding(sparse=True)): torch's sparse gradient
path through the backend. Prints one JSON line per rank with its parameters' digest.

    python tests/support/jobs/torch_sparse_ddp.py BACKEND [--steps N] [--save FILE]
"""

from __future__ import annotations

import argparse
import hashlib
import json

import torch
import torch.distributed as dist
from torch import nn

import psring.torch  # noqa: F401 - registers the backend "psring"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("backend")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--save", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(200, 8, sparse=True), nn.Flatten(), nn.Linear(8 * 3, 2))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(rank)
    for _ in range(args.steps):
        x = torch.randint(0, 200, (6, 3), generator=g)  # rows repeat within and across ranks
        loss = ddp(x).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
    digest = hashlib.sha256(b"".join(q.detach().numpy().tobytes() for q in model.parameters())).hexdigest()[:16]
    if args.save and rank == 0:
        torch.save(model.state_dict(), args.save)
    print(json.dumps({"rank": rank, "digest": digest, "backend": str(dist.get_backend()), "error": None}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
