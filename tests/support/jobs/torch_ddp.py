"""An unmodified DDP training script (but the backend name): every rank prints its parameters' digest.

    python tests/support/jobs/torch_ddp.py BACKEND [--steps N] [--subgroup] [--fail-at STEP]

Started by torchrun or with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT set. ``--subgroup`` gives DDP
``process_group=dist.new_group(every rank)``; ``--fail-at`` makes rank 1 exit at that step (the
others must get an error naming it). Prints one JSON line per rank.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

import psring.torch  # noqa: F401 - registers the backend "psring"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("backend")
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--subgroup", action="store_true")
    p.add_argument("--fail-at", type=int, default=None)
    p.add_argument("--save", default=None, help="rank 0 saves the final state_dict here")
    args = p.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(1234 + rank)  # different initial weights: DDP must broadcast rank 0's
    model = torch.nn.Sequential(
        torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 4)
    )
    model.register_buffer("seen", torch.zeros(1))  # a buffer, broadcast from rank 0 each step
    group = dist.new_group(list(range(world))) if args.subgroup else None
    ddp = DDP(model, process_group=group, bucket_cap_mb=0.1)  # several buckets: overlap with backward
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05, momentum=0.9)
    gen = torch.Generator().manual_seed(rank)
    error = None
    try:
        for step in range(args.steps):
            if args.fail_at is not None and step == args.fail_at and rank == 1:
                os._exit(3)
            x = torch.randn(16, 32, generator=gen)
            y = torch.randint(0, 4, (16,), generator=gen)
            opt.zero_grad()
            torch.nn.functional.cross_entropy(ddp(x), y).backward()
            opt.step()
    except Exception as exc:
        error = {"type": type(exc).__name__, "dist_error": isinstance(exc, dist.DistError), "message": str(exc)}
    h = hashlib.sha256()
    for t in model.state_dict().values():
        h.update(t.detach().numpy().tobytes())
    if args.save and rank == 0:
        torch.save(model.state_dict(), args.save)
    row = {"rank": rank, "digest": h.hexdigest(), "error": error, "backend": dist.get_backend()}
    sys.stdout.write(json.dumps(row) + "\n")  # one write: ranks that share a stdout (torchrun) never split a line
    sys.stdout.flush()
    if error is None:
        dist.destroy_process_group()
        sys.stdout.flush()
        os._exit(0)  # not through interpreter exit, where gloo's threads can abort it (pytorch/pytorch#179291)
    else:
        time.sleep(0.2)
        os._exit(1)


if __name__ == "__main__":
    main()
