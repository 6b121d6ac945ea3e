"""init_process_group("psring") by each init method, then an all_reduce; or a mismatched call.

    python tests/support/jobs/torch_init.py RANK WORLD INIT_METHOD [--mismatch]

Prints one JSON line: the sum, or the error a mismatched call raised (its class, whether it is a
torch.distributed.DistBackendError, its message).
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.distributed as dist

import psring.torch  # noqa: F401 - registers the backend "psring"


def main() -> None:
    rank, world, method = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    if method == "env://":
        dist.init_process_group("psring")  # RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT from the environment
    else:
        dist.init_process_group("psring", init_method=method, rank=rank, world_size=world)
    t = torch.full((4,), float(rank + 1))
    out: dict[str, object] = {"rank": rank, "backend": dist.get_backend()}
    t0 = time.monotonic()
    try:
        if "--mismatch" in sys.argv and rank == 1:
            dist.broadcast(t, src=0)
        else:
            dist.all_reduce(t)
        out["sum"] = t[0].item()
    except Exception as exc:
        out["error"] = {"type": type(exc).__name__, "dist": isinstance(exc, dist.DistBackendError), "message": str(exc)}
    out["took"] = time.monotonic() - t0
    sys.stdout.write(json.dumps(out) + "\n")  # one write: ranks that share a stdout never split a line
    sys.stdout.flush()
    dist.destroy_process_group()
    # gloo's worker threads can still hold work at interpreter exit and abort the process
    # ("terminate called without an active exception", pytorch/pytorch#179291): all is done, leave now
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
