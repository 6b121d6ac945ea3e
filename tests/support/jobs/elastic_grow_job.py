"""An elastic SyncSGD job over ps that admits new workers every 3 steps (JOIN=1: this process is
one, started while the job runs; CLOSE_AT=t: no boundary admits anyone, the one at step t closes
joins, and the job goes on to STEPS). Every worker pushes gradient rank+1 with lr 1, so each step's
result says whose gradients it averaged. One JSON line per step; the live group's all_reduce last."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np

import psring
from psring.core.optim import SGD
from psring.training.sgd import SyncSGD


async def main() -> None:
    join = os.environ.get("JOIN") == "1"
    steps = int(os.environ.get("STEPS", "60"))
    close_at = int(os.environ.get("CLOSE_AT", "0"))
    g = await psring.init_group(topology="ps", timeout=60, join=join)
    opt = SyncSGD(g, {"w": np.zeros(3, np.float32)}, SGD(lr=1.0), elastic=True)
    await opt.start()
    me = g.members[g.rank]
    start = opt.step_count
    print(json.dumps({"rank": me, "start": start, "joined_with": opt.joined_with, "members": opt.members}), flush=True)
    t = start
    while t < steps:
        if close_at and t == close_at:
            await opt.close_joins()
            print(json.dumps({"rank": me, "closed": t}), flush=True)
        elif t % 3 == 0 and t and not (join and t == start) and not close_at:
            new = await opt.admit_waiting({"t": t})  # a boundary every 3 steps (a joiner starts after its own)
            if new:
                print(json.dumps({"rank": me, "admitted": new, "at": t}), flush=True)
        members = opt.members
        params = await opt.step({"w": np.full(3, me + 1.0, np.float32)})
        t = opt.step_count
        print(json.dumps({"rank": me, "step": t, "members": members, "w": float(params["w"][0])}), flush=True)
        await asyncio.sleep(0.05)
    live = opt.live_group()
    total = await live.all_reduce(np.array([1.0]))
    print(json.dumps({"rank": me, "live": live.world_size, "sum": float(total[0])}), flush=True)
    await g.close()


asyncio.run(main())
