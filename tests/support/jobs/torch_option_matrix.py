"""Every DistributedOptimizer option with every other (tests/torch/test_option_matrix.py runs this under
``psring launch`` on each topology): for each option set named in argv[1] (``a+b,c,...``), a small
model (with an nn.Embedding(sparse=True) for sparse_params) takes three steps; rank 0 prints one JSON
line: per cell, the digest of the parameters every rank agrees on and whether they moved, or the
ValueError's message. A cell with backup workers puts the parameters on the job's shards: one such
cell per job (a second would find the first's there, as after a restore, and go on from them)."""

from __future__ import annotations

import hashlib
import json
import sys

import numpy as np
import torch

import psring
import psring.torch as pt

OPTIONS = ["compression", "passes", "sparse", "backup"]
STEPS = 3


def digest(tensors: list[torch.Tensor]) -> bytes:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.detach().contiguous().numpy().tobytes())
    return h.digest()


def run(g: psring.BlockingGroup, cell: frozenset[str]) -> dict[str, object]:
    torch.manual_seed(0)  # the same model on every rank
    model = torch.nn.Sequential(torch.nn.Linear(6, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))
    emb = torch.nn.Embedding(10, 6, sparse=True)
    params = list(model.parameters()) + ([emb.weight] if "sparse" in cell else [])
    start = digest(params)
    kw: dict[str, object] = {}
    if "compression" in cell:
        kw["compression"] = "fp16"
    if "passes" in cell:
        kw["backward_passes_per_step"] = 2
    if "sparse" in cell:
        kw["sparse_params"] = [emb.weight]
    if "backup" in cell:
        kw["backup"] = 1
    try:
        opt = pt.DistributedOptimizer(torch.optim.SGD(params, lr=0.05), g, **kw)  # type: ignore[arg-type]
    except ValueError as exc:
        return {"refused": str(exc)}
    taken = 0
    # backup workers: a straggler skips the steps taken without it, so the loop runs on the job's step
    while (opt.step_count if "backup" in cell else taken) < STEPS:
        step = opt.step_count if "backup" in cell else taken
        opt.zero_grad()
        for p in range(int(kw.get("backward_passes_per_step", 1))):  # type: ignore[call-overload]
            torch.manual_seed(100 * step + 10 * p + g.rank)
            x = torch.randn(8, 6)
            if "sparse" in cell:
                x = x + emb(torch.randint(0, 10, (8,)))
            (model(x) ** 2).mean().backward()
        opt.step()
        taken += 1
    g.barrier()
    mine = digest(params)
    every = g.all_gather(np.frombuffer(mine, np.uint8).copy())
    return {"digest": mine.hex(), "agree": all(bytes(d) == mine for d in every), "moved": mine != start}


def main() -> None:
    g = psring.init()
    out = {name: run(g, frozenset(name.split("+"))) for name in sys.argv[1].split(",")}
    if g.rank == 0:
        print("MATRIX " + json.dumps(out), flush=True)
    g.close()


if __name__ == "__main__":
    main()
