"""A user's job as they write it: psring.init() from whatever launcher started it, a few collectives,
and a line per rank that the tests read: 'RESULT <rank> <world> <topology> <sum> <bcast> <seconds>'.

The seconds are from the start of the process to the end of the first collective.
"""

import sys
import time

T0 = time.monotonic()

import numpy as np  # noqa: E402

import psring  # noqa: E402

g = psring.init(timeout=float(sys.argv[1]) if len(sys.argv) > 1 else 120.0)
y = g.all_reduce(np.full(1000, g.rank + 1.0, np.float32))
first = time.monotonic() - T0
b = g.broadcast(np.full(3, g.rank * 10.0), src=g.world_size - 1)
big = g.all_reduce(np.ones(300_000, np.float32))  # the pipelined / sharded path too
assert np.all(big == g.world_size), big[:4]
print(f"RESULT {g.rank} {g.world_size} {g.topology} {float(y[0]):g} {float(b[0]):g} {first:.3f}", flush=True)
g.close()
