"""An elastic SyncSGD job over ps: rank LEAVE_RANK exits (os._exit, like a crash) before call
LEAVE_AT (with ACCUMULATE=k, k calls make a step; with LEAVE_IN=admit: at the boundary before call
LEAVE_AT, where every other rank calls admit_waiting, so the loss lands in that call's exchange; with
ADMIT_LATE=r, rank r gets there a second late, after the loss ended it); the others go on. Every rank
pushes gradient rank+1, so each step's result says whose gradients it averaged. Prints one JSON line
per call, then the live group's all_reduce. Over the ring (PSRING_TOPOLOGY=ring) too: SIZE floats of
parameters (a large one takes the ring's data plane), LEAVE_DURING=s: the rank dies s seconds into
call LEAVE_AT's exchange instead of before it, HANG=s: it hangs (its loop blocked) that long instead,
then tries to go on; TIMEOUT: the group's."""

from __future__ import annotations

import asyncio
import json
import os
import threading
import time

import numpy as np

import psring
from psring.core.optim import SGD
from psring.training.sgd import SyncSGD


def die_after_sends(n: int) -> None:
    """From now on, exit (like a crash) right after this rank's n-th frame: some peers then have all
    of its data for the call in flight and others do not."""
    from psring.transport.connection import Connection

    sent = [0]
    for name in ("send_frame", "send_frames", "send_tensor"):
        real = getattr(Connection, name)

        def counted(self, *args, _real=real, **kwargs):  # type: ignore[no-untyped-def]
            out = _real(self, *args, **kwargs)
            sent[0] += 1
            if sent[0] >= n:
                os._exit(9)
            return out

        setattr(Connection, name, counted)


async def main() -> None:
    leave_rank, leave_at = int(os.environ["LEAVE_RANK"]), int(os.environ["LEAVE_AT"])
    g = await psring.init_group(timeout=float(os.environ.get("TIMEOUT", "60")))
    size = int(os.environ.get("SIZE", "3"))
    accumulate = int(os.environ.get("ACCUMULATE", "1"))  # calls per exchange (summed locally)
    sparse = os.environ.get("SPARSE") == "1"  # a sparse table too: each rank pushes row 9 (and its own)
    params = {"w": np.zeros(size, np.float32), **({"emb": np.zeros((10, 2), np.float32)} if sparse else {})}
    opt = SyncSGD(g, params, SGD(lr=1.0), elastic=True, accumulate=accumulate, sparse=["emb"] if sparse else (),
                  compression=os.environ.get("COMPRESSION") or None)  # fmt: skip
    await opt.start()
    at_admit = os.environ.get("LEAVE_IN") == "admit"
    for t in range(int(os.environ.get("STEPS", "8"))):
        if g.rank == leave_rank and t == leave_at:
            if os.environ.get("HANG"):
                time.sleep(float(os.environ["HANG"]))  # hung: the loop blocked, its links open
            elif os.environ.get("DIE_AFTER_SENDS"):  # dies between the sends of that call's exchange
                die_after_sends(int(os.environ["DIE_AFTER_SENDS"]))
            elif os.environ.get("LEAVE_DURING"):
                threading.Timer(float(os.environ["LEAVE_DURING"]), os._exit, (9,)).start()
            else:
                os._exit(9)
        if at_admit and t == leave_at:
            if g.rank == int(os.environ.get("ADMIT_LATE", "-1")):  # reach the boundary after the loss ended it
                await asyncio.sleep(1.0)
            print(json.dumps({"rank": g.rank, "admitted": await opt.admit_waiting()}), flush=True)
        grads = {"w": np.full(size, g.rank + 1.0, np.float32)}
        if sparse:
            grads["emb"] = psring.SparseRows(np.array([9, g.rank]), np.full((2, 2), g.rank + 1.0, np.float32), 10)
        params = await opt.step(grads)
        row = {"rank": g.rank, "step": t, "members": opt.members, "w": float(params["w"][0])}
        if sparse:
            row["emb"] = (await opt.pull_rows("emb", np.arange(10)))[:, 0].tolist()
        print(json.dumps(row), flush=True)
    live = opt.live_group()
    total = await live.all_reduce(np.array([1.0]))
    stats = g.stats()
    print(json.dumps({"rank": g.rank, "live_size": live.world_size, "sum": float(total[0]),
                      "elastic_workers": stats.get("elastic_workers")}), flush=True)  # fmt: skip
    await g.close()


asyncio.run(main())
