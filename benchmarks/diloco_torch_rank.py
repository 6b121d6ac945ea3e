"""One rank of the DiLoCo bed for torch models: ``psring.torch.DistributedOptimizer`` wrapping torch's AdamW
with ``local_steps``, the outer Nesterov SGD, a codec and ``fragments`` -- the same torch model, data,
inner optimizer and compute as torchft's replica (benchmarks/torchft_diloco_rank.py), so the two differ
only in how the pseudo-gradients travel. A blocking loop (``psring.init()``): the gradients in this
thread, a streaming exchange in the event loop's. Rank 0 writes the fields of diloco_rank.py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

import psring
import psring.torch as pt

sys.path.insert(0, str(Path(__file__).resolve().parent))
from diloco_rank import Task, init_params


class MLP(torch.nn.Module):
    """diloco_rank's MLP in torch, from its starting parameters bit for bit."""

    def __init__(self, widths: list[int]) -> None:
        super().__init__()
        start = init_params(widths, 0)
        self.layers = torch.nn.ModuleList()
        for i in range(len(widths) - 1):
            lin = torch.nn.Linear(widths[i], widths[i + 1])
            with torch.no_grad():
                lin.weight.copy_(torch.from_numpy(start[f"w{i}"].T.copy()))
                lin.bias.copy_(torch.from_numpy(start[f"b{i}"]))
            self.layers.append(lin)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for i, lin in enumerate(self.layers):
            x = lin(x)
            if i < len(self.layers) - 1:
                x = torch.relu(x)
        return x


def host_params(model: MLP) -> dict[str, np.ndarray]:
    """The model's parameters as diloco_rank names them (for Task.test_loss)."""
    out = {}
    with torch.no_grad():
        for i, lin in enumerate(model.layers):
            out[f"w{i}"] = lin.weight.detach().numpy().T.copy()
            out[f"b{i}"] = lin.bias.detach().numpy().copy()
    return out


def main(spec: dict[str, Any]) -> None:
    torch.set_num_threads(1)
    widths = [int(w) for w in spec.get("widths", [256, 1024, 1024, 1024, 256])]
    task = Task(widths, int(spec.get("seed", 0)))
    h, batch, steps = int(spec["local_steps"]), int(spec.get("batch", 32)), int(spec["steps"])
    g = psring.init()
    try:
        model = MLP(widths)
        inner = torch.optim.AdamW(model.parameters(), lr=float(spec.get("lr", 1e-3)), weight_decay=0.01)
        outer = psring.optim.SGD(lr=0.7, momentum=0.9, nesterov=True)
        opt = pt.DistributedOptimizer(inner, g, local_steps=h, outer=outer, compression=spec.get("compression"),
                                      fragments=int(spec.get("fragments", 1)))  # fmt: skip
        g.barrier()
        compute, curve = 0.0, []
        sent0 = g.stats()["bytes_sent"]
        t0 = time.perf_counter()
        for t in range(steps):
            x, y = (torch.from_numpy(a) for a in task.batch(g.rank, t, batch))
            c0 = time.perf_counter()
            opt.zero_grad()
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            compute += time.perf_counter() - c0
            opt.step()
            if (t + 1) % max(1, steps // 20) == 0:
                curve.append([t + 1, float(loss.detach())])
        opt.use_global()
        wall = time.perf_counter() - t0
        mine = [g.stats()["bytes_sent"] - sent0, int(compute * 1e6), int(wall * 1e6), int(opt.waited_s * 1e6)]
        every = g.all_gather(np.array(mine, np.int64))
        params = host_params(model)
        if g.rank == 0 and spec.get("out"):
            with open(spec["out"], "w") as fh:
                json.dump({
                    "spec": spec, "world": g.world_size, "model_bytes": sum(v.nbytes for v in params.values()),
                    "steps": steps, "samples_per_s": g.world_size * batch * steps / wall, "wall_s": wall,
                    "compute_use": min(1 - int(e[3]) / int(e[2]) for e in every),
                    "grad_share": min(int(e[1]) / int(e[2]) for e in every),
                    "bytes_sent": [int(e[0]) for e in every], "test_loss": task.test_loss(params), "curve": curve,
                }, fh)  # fmt: skip
    finally:
        g.close()


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
