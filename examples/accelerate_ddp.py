"""Hugging Face Accelerate over psring, the way that works with Accelerate as it is: make the
process group before the Accelerator (on CPU Accelerate itself names only gloo and mpi; given a
group, it uses it). Start it with torchrun or ``accelerate launch``:

    torchrun --nproc-per-node 2 examples/accelerate_ddp.py
    accelerate launch --multi_gpu --num_processes 2 --num_machines 1 --mixed_precision no \\
        --dynamo_backend no examples/accelerate_ddp.py      # --multi_gpu: its torchrun launcher, on CPU too
    PSRING_TOPOLOGY=ps torchrun --nproc-per-node 2 examples/accelerate_ddp.py
    torchrun --nproc-per-node 2 examples/accelerate_ddp.py --backend gloo     # the same run over gloo

``--out F`` writes each rank's final weights and mean loss to F.RANK.json.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import psring.torch  # noqa: F401  (registers the "psring" backend)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--backend", default="psring")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dist.init_process_group(args.backend)  # before the Accelerator: it takes the group it finds

    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    g = torch.Generator().manual_seed(1)
    y = torch.randint(0, 2, (512,), generator=g)
    x = torch.randn(512, 16, generator=g) + (y[:, None].float() * 2 - 1) * 0.75
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(x, y), batch_size=32)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    t0, steps = time.perf_counter(), 0
    for _epoch in range(args.epochs):
        losses = []
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.detach())
            steps += 1
        mean = accelerator.reduce(torch.stack(losses).mean(), reduction="mean")
    seconds = time.perf_counter() - t0
    seen = accelerator.gather_for_metrics(torch.tensor([len(loader)]))
    record = {
        "rank": accelerator.process_index,
        "backend": str(dist.get_backend()),
        "processes": accelerator.num_processes,
        "loss": float(mean),
        "batches": seen.tolist(),
        "weights": [p.detach().reshape(-1).tolist() for p in accelerator.unwrap_model(model).parameters()],
        "topology": os.environ.get("PSRING_TOPOLOGY", "ring"),
        "seconds": seconds,
        "steps": steps,
    }
    if args.out:
        with open(f"{args.out}.{accelerator.process_index}.json", "w") as fh:
            json.dump(record, fh)
    if accelerator.is_main_process:
        print(json.dumps({"loss": round(record["loss"], 4), "backend": record["backend"]}), flush=True)
    # every rank done before any tears its process group down: gloo's own teardown aborted the process
    # ("terminate called without an active exception") about one run in ten when a peer had gone first
    accelerator.wait_for_everyone()
    accelerator.end_training()  # destroys the process group too


if __name__ == "__main__":
    main()
