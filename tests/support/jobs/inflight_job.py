"""A job whose ranks keep several all_reduces in flight at once through the blocking API (``async_op=True``,
now and then a blocking call behind them), of sizes across every path (one hop, the boards whole and
split, two hops, the streamed boards or the data plane), with sum, max and avg, for ROUNDS rounds (seeded
by SEED: every rank draws the same calls). Each result is compared with the canonical fold of every
rank's input (the two-level order where HIER_HOSTS=block:2 puts ranks r // 2 on one "host"), and each rank
prints 'INFLIGHT <rank> <results not in that order> <results>', and one 'WRONG ...' line per such result.
"""

import os

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
if os.environ.get("HIER_HOSTS"):
    os.environ["PSRING_HOST_ID"] = f"host{rank // 2}"

import numpy as np  # noqa: E402

import psring  # noqa: E402
from psring.core.fold import canonical_fold, host_layout  # noqa: E402

SIZES = [1, 7, 1000, 16_384, 20_000, 100_003, 300_000, 1_500_001]
hosts = host_layout([f"host{r // 2}" for r in range(world)]) if os.environ.get("HIER_HOSTS") else None
g = psring.init(timeout=60.0)
rng = np.random.default_rng(int(os.environ.get("SEED", "1")))
wrong = total = 0
for rnd in range(int(os.environ.get("ROUNDS", "6"))):
    calls = [(int(rng.choice(SIZES)), str(rng.choice(["sum", "max", "avg"]))) for _ in range(int(rng.integers(2, 6)))]
    xs = [
        np.stack([np.random.default_rng((rnd, i, r)).standard_normal(s).astype(np.float32) for r in range(world)])
        for i, (s, _) in enumerate(calls)
    ]
    blocking_last = bool(rng.integers(0, 2))  # a blocking call behind the async ones: it takes the loop, in order
    results = [
        g.all_reduce(x[rank], op=op, async_op=not (blocking_last and i == len(calls) - 1))
        for i, ((_, op), x) in enumerate(zip(calls, xs, strict=True))
    ]
    for i, ((size, op), y) in enumerate(zip(calls, results, strict=True)):
        y = y if isinstance(y, np.ndarray) else y.wait()
        total += 1
        if y.tobytes() != canonical_fold(list(xs[i]), op, np.empty(size, np.float32), hosts=hosts).tobytes():
            wrong += 1
            print(f"WRONG rank {rank} round {rnd} call {i} of {len(calls)}: {size} floats, {op}", flush=True)
print(f"INFLIGHT {rank} {wrong} {total}", flush=True)
g.close()
