"""Mismatched calls, every pair: rank 2 makes call B while ranks 0 and 1 make call A.

Every rank must raise ``MismatchError`` within the stall threshold + 1 s: in the call itself, or,
where its side of the call needs nothing back (a broadcast's root, a reduce's other ranks), in the
next collective it makes. After a pair of collectives the group works again (an all_reduce, retried
while ranks skip what was abandoned, gives every rank the right sum).

    python tests/support/harness/mismatch.py                      # both topologies, every size path
    python tests/support/harness/mismatch.py --topologies ps --sizes small --stall 1

tests/topology/test_stall.py runs the same pairs (a short form of the sizes) in the suite.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

import psring

#: elements of float32: the one-hop paths, the ring pipeline / ps pieces, the data plane and shared memory
SIZES = {"small": 10, "medium": 256 << 10, "large": 4 << 20}


def _recv(g: Any, x: np.ndarray) -> Awaitable[Any]:
    return g.recv(0 if g.rank == 2 else 2)  # rank 2 from rank 0; ranks 0 and 1 from rank 2


#: name -> call(group, x); recv waits for a send that never comes (its partner makes another call)
CALLS: dict[str, Callable[[Any, np.ndarray], Awaitable[Any]]] = {
    "all_reduce": lambda g, x: g.all_reduce(x),
    "broadcast(src=0)": lambda g, x: g.broadcast(x, 0),
    "broadcast(src=1)": lambda g, x: g.broadcast(x, 1),
    "all_gather": lambda g, x: g.all_gather(x),
    "reduce_scatter": lambda g, x: g.reduce_scatter(x),
    "reduce(dst=0)": lambda g, x: g.reduce(x, dst=0),
    "gather(dst=1)": lambda g, x: g.gather(x, dst=1),
    "scatter(src=0)": lambda g, x: g.scatter([x] * 3 if g.rank == 0 else None, src=0),
    "barrier": lambda g, x: g.barrier(),
    "recv": _recv,
}

PAIRS = [(a, b) for a in CALLS for b in CALLS if a != b]


@dataclass
class Outcome:
    rank: int
    error: BaseException | None  # what it raised (None: nothing within the limit)
    seconds: float
    where: str  # "call", "next" (the collective after it), or "none"


@dataclass
class PairResult:
    a: str
    b: str
    outcomes: list[Outcome]
    usable: bool | None  # the group worked again afterwards (None: not checked, a recv was in it)

    def problems(self, within: float) -> list[str]:
        found = []
        for o in self.outcomes:
            if not isinstance(o.error, psring.MismatchError):
                found.append(f"rank {o.rank} raised {o.error!r} ({o.where}, {o.seconds:.1f}s)")
            elif o.seconds > within:
                found.append(f"rank {o.rank} raised after {o.seconds:.1f}s, over {within:g}s")
        if self.usable is False:
            found.append("the group did not work again afterwards")
        return found


async def run_pair(groups: list[Any], a: str, b: str, size: str, limit: float) -> PairResult:
    """One pair on a fresh subgroup of three ranks (so pairs do not disturb each other)."""
    subs = await asyncio.gather(*(g.new_group([0, 1, 2]) for g in groups))
    n = SIZES[size]
    t0 = time.monotonic()

    async def one(g: Any) -> Outcome:
        x = np.full(n, g.rank + 1, np.float32)
        call = CALLS[b] if g.rank == 2 else CALLS[a]
        where = "call"
        try:
            await asyncio.wait_for(call(g, x), limit)
            where = "next"  # its side needed nothing back: the next collective must raise
            await asyncio.wait_for(g.all_reduce(np.ones(2, np.float32)), limit)
        except TimeoutError:
            return Outcome(g.rank, None, time.monotonic() - t0, "none")
        except Exception as exc:
            return Outcome(g.rank, exc, time.monotonic() - t0, where)
        return Outcome(g.rank, None, time.monotonic() - t0, "none")

    try:
        outcomes = list(await asyncio.gather(*(one(g) for g in subs)))
        usable = None
        if "recv" not in (a, b) and all(o.error is not None for o in outcomes):
            usable = all(ok for ok in await asyncio.gather(*(_works(g, limit) for g in subs)))
        return PairResult(a, b, outcomes, usable)
    finally:
        await asyncio.gather(*(g.close() for g in subs), return_exceptions=True)


async def _works(g: Any, limit: float) -> bool:
    """An all_reduce gives the right sum, after at most three tries (calls abandoned on every
    rank during the mismatch raise once more on the ranks that had not reached them)."""
    for _ in range(3):
        try:
            y = await asyncio.wait_for(g.all_reduce(np.ones(3, np.float32)), limit)
        except psring.MismatchError:
            continue
        except Exception:
            return False
        return bool(np.array_equal(y, np.full(3, 3.0, np.float32)))
    return False


async def _main(args: argparse.Namespace) -> int:
    from psring.rendezvous.client import connect_store, parse_store_address
    from psring.rendezvous.store import start_store
    from psring.topology.ps.shards.server import start_servers

    os.environ["PSRING_STALL_S"] = str(args.stall)
    within = args.stall + 1.0
    failed = 0
    store = await start_store("127.0.0.1", 0)
    try:
        for topology in args.topologies:
            os.environ["PSRING_JOB"] = job = f"mismatch-{topology}"
            servers = None
            if topology == "ps":
                client = await connect_store(parse_store_address(f"127.0.0.1:{store.port}"), secret=None, timeout=10)
                servers = await start_servers(client, 2, job=job)
            groups = await asyncio.gather(
                *(
                    psring.init_group(topology, rank=r, world_size=3, store=f"127.0.0.1:{store.port}", timeout=60)
                    for r in range(3)
                )
            )
            try:
                for size in args.sizes:
                    for a, b in PAIRS:
                        result = await run_pair(groups, a, b, size, limit=within + 5)
                        problems = result.problems(within)
                        failed += bool(problems)
                        times = " ".join(f"{o.seconds:.1f}{'*' if o.where == 'next' else ''}" for o in result.outcomes)
                        verdict = "FAIL " + "; ".join(problems) if problems else "ok"
                        print(f"{topology:4} {size:6} {a:>16} vs {b:<16} {times:18} {verdict}", flush=True)
            finally:
                await asyncio.gather(*(g.close() for g in groups), return_exceptions=True)
                if servers is not None:
                    await servers.close()
    finally:
        await store.close()
    print(f"{failed} pair(s) failed" if failed else "every rank named every mismatch in time", flush=True)
    return 1 if failed else 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--topologies", nargs="+", default=["ring", "ps"], choices=["ring", "ps"])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--stall", type=float, default=1.0, help="PSRING_STALL_S for the run")
    import uvloop

    return uvloop.run(_main(p.parse_args()))


if __name__ == "__main__":
    sys.exit(main())
