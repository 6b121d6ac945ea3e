"""Where a small all_reduce's time goes: wall time and user/system CPU per call, per rank.

    python benchmarks/small_latency.py --workers 2,4 --calls 3000

Starts the ranks with ``psring launch`` and runs back-to-back 4-byte all_reduces (no
barrier in between). On a 2-core machine with more ranks than cores the wall time is
bounded by the ranks' CPU added up and divided by two: that, not the network, is what
small-message latency costs here.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

RANK = """
import asyncio, os, sys, time
import numpy as np, psring, uvloop

async def main():
    g = await psring.init_group(timeout=120)
    x = np.ones(1, np.float32)
    calls = int(sys.argv[1])
    for _ in range(100):
        await g.all_reduce(x)
    t0, c0 = time.perf_counter(), os.times()
    for _ in range(calls):
        await g.all_reduce(x)
    wall, c1 = time.perf_counter() - t0, os.times()
    print(f"RESULT {g.rank} {wall / calls * 1e6:.0f} {(c1.user - c0.user) / calls * 1e6:.0f} "
          f"{(c1.system - c0.system) / calls * 1e6:.0f}", flush=True)
    await g.close()

uvloop.run(main())
"""


def run(workers: int, calls: int) -> list[tuple[int, int, int, int]]:
    cmd = [sys.executable, "-m", "psring", "launch", "-n", str(workers), "--", sys.executable, "-c", RANK, str(calls)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ), check=True)
    rows = []
    for line in out.stdout.splitlines():
        if "RESULT" in line:
            _, rank, wall, user, system = line.split("RESULT")[1].split(" ")
            rows.append((int(rank), int(wall), int(user), int(system)))
    return sorted(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", default="2,4")
    parser.add_argument("--calls", type=int, default=3000)
    args = parser.parse_args()
    for n in (int(w) for w in args.workers.split(",")):
        rows = run(n, args.calls)
        print(f"# 4-byte all_reduce, workers={n}, {args.calls} calls: microseconds per call")
        print(f"{'rank':>5} {'wall':>8} {'user CPU':>9} {'sys CPU':>8}")
        for rank, wall, user, system in rows:
            print(f"{rank:>5} {wall:>8} {user:>9} {system:>8}")
        cpu = sum(u + s for _, _, u, s in rows)
        print(
            f"# all ranks' CPU per call: {cpu} us; on {os.cpu_count()} cores that alone takes "
            f"{cpu / (os.cpu_count() or 1):.0f} us of wall time"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
