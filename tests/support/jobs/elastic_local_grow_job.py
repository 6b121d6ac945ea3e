"""An elastic local SGD job (``local_steps=2``, inner and outer SGD at lr 1) that admits new workers at
every second outer step (JOIN=1: this process is one, started while the job runs). Every worker's
gradient is its id + 1, so an outer step moves the global parameters by 2 x the mean of its members'
(id + 1): each line says whose pseudo-gradients it averaged. One JSON line per outer step with the global
parameters; the last line each worker's digest comparison count (no rank repaired)."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np

import psring
from psring.core.optim import SGD
from psring.training.sgd import SyncSGD

H = 2


async def main() -> None:
    join = os.environ.get("JOIN") == "1"
    outer_steps = int(os.environ.get("OUTER_STEPS", "30"))
    g = await psring.init_group(topology=os.environ.get("TOPOLOGY", "ps"), timeout=60, join=join)
    opt = SyncSGD(g, {"w": np.zeros(3, np.float32)}, SGD(lr=1.0), elastic=True, local_steps=H, outer=SGD(lr=1.0))
    await opt.start()
    me = opt.members[opt.live_group().rank]  # this worker's id in the job (a joiner's: after the first ring's)
    start = opt.step_count
    print(json.dumps({"rank": me, "start": start, "joined_with": opt.joined_with, "members": opt.members}), flush=True)
    while opt.step_count < outer_steps:
        t = opt.step_count
        if t % 2 == 0 and t and not (join and t == start):
            new = await opt.admit_waiting({"t": t})  # at an outer step's end (a joiner starts after its own)
            if new:
                print(json.dumps({"rank": me, "admitted": new, "at": t}), flush=True)
        members = opt.members
        for _ in range(H):
            params = await opt.step({"w": np.full(3, me + 1.0, np.float32)})
        print(json.dumps({"rank": me, "step": opt.step_count, "members": members, "w": float(params["w"][0])}),
              flush=True)  # fmt: skip
        await asyncio.sleep(0.05)
    print(json.dumps({"rank": me, "repaired": opt.repaired, "end": opt.step_count}), flush=True)
    await g.close()


if __name__ == "__main__":
    asyncio.run(main())
