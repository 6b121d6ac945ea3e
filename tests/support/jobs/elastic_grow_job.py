"""An elastic SyncSGD job over ps (TOPOLOGY=ring: the ring) that admits new workers every 3 steps
(JOIN=1: this process is one, started while the job runs; CLOSE_AT=t: no boundary admits anyone,
the one at step t closes joins, and the job goes on to STEPS). Every worker pushes gradient rank+1
with lr 1, so each step's result says whose gradients it averaged (SPARSE=1: a sparse table's row 9
too, pushed alike). LEAVE=id@t: the worker of that id exits (like a crash) before its step t. One
JSON line per step; the live group's all_reduce last. PROPOSE=1 (the ring, LEAVE at a boundary step):
no boundary before it admits anyone; there every worker waits until a new worker asked, and the leaving
one first proposes admitting it, as if it died right after its proposal (the others take the first
proposal written)."""

from __future__ import annotations

import asyncio
import json
import os
import time

import numpy as np

import psring
from psring.core.optim import SGD
from psring.training.sgd import SyncSGD


async def main() -> None:
    join = os.environ.get("JOIN") == "1"
    steps = int(os.environ.get("STEPS", "60"))
    close_at = int(os.environ.get("CLOSE_AT", "0"))
    g = await psring.init_group(topology=os.environ.get("TOPOLOGY", "ps"), timeout=60, join=join)
    sparse = os.environ.get("SPARSE") == "1"  # a sparse table too, whose row 9 every worker pushes
    params = {"w": np.zeros(3, np.float32), **({"emb": np.zeros((10, 2), np.float32)} if sparse else {})}
    opt = SyncSGD(g, params, SGD(lr=1.0), elastic=True, sparse=["emb"] if sparse else ())
    await opt.start()
    me = opt.members[opt.live_group().rank]  # this worker's id in the job (a joiner's: after the first ring's)
    start = opt.step_count
    print(json.dumps({"rank": me, "start": start, "joined_with": opt.joined_with, "members": opt.members}), flush=True)
    t = start
    leave, _, leave_at = os.environ.get("LEAVE", "-1@-1").partition("@")
    propose = os.environ.get("PROPOSE") == "1"
    while t < steps:
        if t == int(leave_at) and propose:
            await _propose(opt, t, me == int(leave))
        if me == int(leave) and t == int(leave_at):
            os._exit(9)
        if close_at and t == close_at:
            await opt.close_joins()
            print(json.dumps({"rank": me, "closed": t}), flush=True)
        elif t % 3 == 0 and t and not (join and t == start) and not close_at and not (propose and t < int(leave_at)):
            new = await opt.admit_waiting({"t": t})  # a boundary every 3 steps (a joiner starts after its own)
            if new:
                print(json.dumps({"rank": me, "admitted": new, "at": t}), flush=True)
        members = opt.members
        grads = {"w": np.full(3, me + 1.0, np.float32)}
        if sparse:
            grads["emb"] = psring.SparseRows(np.array([9]), np.full((1, 2), me + 1.0, np.float32), 10)
        params = await opt.step(grads)
        t = opt.step_count
        row = {"rank": me, "step": t, "members": members, "w": float(params["w"][0])}
        if sparse:
            row["emb9"] = float((await opt.pull_rows("emb", np.array([9])))[0, 0])
        print(json.dumps(row), flush=True)
        await asyncio.sleep(0.05)
    live = opt.live_group()
    total = await live.all_reduce(np.array([1.0]))
    print(json.dumps({"rank": me, "live": live.world_size, "sum": float(total[0])}), flush=True)
    await g.close()


async def _propose(opt: SyncSGD, t: int, mine: bool) -> None:
    """Wait until a new worker asked to join; the leaving worker proposes admitting it at boundary t."""
    q = opt.placement.quorum  # type: ignore[union-attr]
    store, reg = q.net.store, q.registry
    deadline = time.monotonic() + 60
    while (asked := int(await store.add(f"{reg.prefix}/asked", 0))) <= q.admitted:
        if time.monotonic() > deadline:
            raise TimeoutError(f"no new worker asked to join within 60 s (admitted {q.admitted}, asked {asked})")
        await asyncio.sleep(0.05)
    if mine:
        await store.compare_set(f"{reg.prefix}/boundary/{t}", None, str(asked).encode())


asyncio.run(main())
