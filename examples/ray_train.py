"""Ray Train over psring: ``TorchConfig(backend="psring")``, and one line so that every Ray worker
registers the backend before Ray Train makes the process group:
``ray.init(runtime_env={"worker_process_setup_hook": "psring.torch.register"})``.

    python examples/ray_train.py --workers 2                    # the ring
    PSRING_TOPOLOGY=ps python examples/ray_train.py --workers 2 # the parameter server (set before ray.init:
                                                                # the workers inherit the driver's environment)
    python examples/ray_train.py --workers 2 --backend gloo     # the same run over gloo

``--out F`` writes each worker's final weights and loss to F.RANK.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

import ray
import torch
import torch.nn.functional as F
from ray.train import ScalingConfig
from ray.train.torch import TorchConfig, TorchTrainer
from torch import nn


def train_loop(config: dict[str, Any]) -> None:
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 2, (512,), generator=g)
    x = torch.randn(512, 16, generator=g) + (y[:, None].float() * 2 - 1) * 0.75
    torch.manual_seed(0)
    model = ray.train.torch.prepare_model(nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2)))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    rank, world = ray.train.get_context().get_world_rank(), ray.train.get_context().get_world_size()
    mine = torch.arange(rank, 512, world)  # each worker its share of the rows
    t0, steps = time.perf_counter(), 0
    for _epoch in range(config["epochs"]):
        for start in range(0, len(mine), 32):
            idx = mine[start : start + 32]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            steps += 1
    seconds = time.perf_counter() - t0
    record = {
        "rank": rank,
        "backend": str(dist.get_backend()),
        "loss": loss.item(),
        "weights": [p.detach().reshape(-1).tolist() for p in model.parameters()],
        "seconds": seconds,
        "steps": steps,
    }
    if config["out"]:
        with open(f"{config['out']}.{rank}.json", "w") as fh:
            json.dump(record, fh)
    ray.train.report({"loss": loss.item()})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--backend", default="psring")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    ray.init(
        runtime_env={"worker_process_setup_hook": "psring.torch.register"},  # every worker: the backend
        include_dashboard=False,
        _node_ip_address=os.environ.get("RAY_NODE_IP", None),
    )
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={"epochs": args.epochs, "out": os.path.abspath(args.out) if args.out else None},
        torch_config=TorchConfig(backend=args.backend),
        scaling_config=ScalingConfig(num_workers=args.workers, use_gpu=False),
    )
    result = trainer.fit()
    print(json.dumps({"backend": args.backend, "metrics": result.metrics, "error": repr(result.error)}), flush=True)
    ray.shutdown()


if __name__ == "__main__":
    main()
