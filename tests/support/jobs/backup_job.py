"""SyncSGD(backup=BACKUP) over ps with a straggler: rank SLOW_RANK sleeps SLOW_S before each of
its steps (the straggler is set here, by the job, never by psring). Every rank pushes gradient
rank+1 and drives its loop by opt.step_count (a worker that fell behind skips the steps the others
completed without it). Prints one JSON line per step call (the step reached and w), then a summary."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np

import psring
from psring.core.optim import SGD
from psring.training.sgd import SyncSGD


async def main() -> None:
    backup, steps = int(os.environ.get("BACKUP", "1")), int(os.environ.get("STEPS", "12"))
    slow_rank, slow_s = int(os.environ.get("SLOW_RANK", "-1")), float(os.environ.get("SLOW_S", "0"))
    g = await psring.init_group(timeout=60)
    opt = SyncSGD(g, {"w": np.zeros(4, np.float32)}, SGD(lr=1.0), backup=backup)
    await opt.start()
    first = opt.step_count  # 0, or 1+ where the others completed steps before this worker pulled the parameters
    calls = 0
    while opt.step_count < steps:
        if g.rank == slow_rank:
            await asyncio.sleep(slow_s)
        params = await opt.step({"w": np.full(4, g.rank + 1.0, np.float32)})
        calls += 1
        print(json.dumps({"rank": g.rank, "step": opt.step_count, "w": float(params["w"][0])}), flush=True)
    stats = g.stats()
    total = await g.all_reduce(np.array([1.0]))  # every worker is still in the group
    print(json.dumps({"rank": g.rank, "first": first, "calls": calls, "skipped": opt.skipped,
                      "final": float(params["w"][0]), "dropped": stats.get("backup_dropped"),
                      "sum": float(total[0])}), flush=True)  # fmt: skip
    await g.close()


asyncio.run(main())
