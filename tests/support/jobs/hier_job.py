"""A job whose ranks say which "host" they are on (PSRING_HOST_ID, from HIER_HOSTS: 'block' puts
ranks r // per on one host, 'interleave' r % per), as ranks in separate containers or machines
would be. Each rank all_reduces tensors of every path's size with every op, compares the result
with the two-level and the flat canonical orders computed here from all ranks' inputs, runs a
few SyncSGD steps, and prints one line: 'HIER <rank> <two-level matches> <flat matches> <total>
<params digest> <ps: all_reduce blocks reduced within the host before they were pushed> <the calls
not in the flat order, as size/op, comma-separated; '-': none>'.
"""

import hashlib
import os

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
mode, per = os.environ.get("HIER_HOSTS", "block:2").split(":")


def host(r: int) -> str:
    return f"host{r % int(per)}" if mode == "interleave" else f"host{r // int(per)}"


os.environ["PSRING_HOST_ID"] = host(rank)
if rank == 0 and os.environ.get("HIER_RANK0_HOST_REDUCE"):  # one rank set apart (the ranks must agree)
    os.environ["PSRING_PS_HOST_REDUCE"] = os.environ["HIER_RANK0_HOST_REDUCE"]

import numpy as np  # noqa: E402

import psring  # noqa: E402
from psring.core.fold import canonical_fold, host_layout  # noqa: E402

hosts = host_layout([host(r) for r in range(world)])  # None (uneven hosts): the flat order is expected
g = psring.init(timeout=60.0)
crash = os.environ.get("HIER_CRASH")
if crash is not None:  # rank HIER_CRASH dies (SIGKILL-like) in its third large all_reduce's turn; the rest report
    import time

    x = np.ones(4_000_000, np.float32)
    try:
        for i in range(50):
            if i == 2 and rank == int(crash):
                print(f"DIED {time.monotonic():.3f}", flush=True)
                os._exit(9)
            g.all_reduce(x)
        print(f"LOST {rank} none", flush=True)
    except psring.PeerLostError as exc:
        print(f"LOST {rank} {time.monotonic():.3f} {exc}", flush=True)
    os._exit(0)
odd = os.environ.get("HIER_MISMATCH")
if odd is not None:  # rank HIER_MISMATCH all_reduces a larger tensor than the others: every rank names it
    x = np.ones(1_000_000 + (1000 if rank == int(odd) else 0), np.float32)
    try:
        g.all_reduce(x)
        print(f"MISMATCH {rank} none", flush=True)
    except (psring.MismatchError, psring.PeerLostError) as exc:
        print(f"MISMATCH {rank} {type(exc).__name__} {exc}", flush=True)
    try:  # the group goes on after a mismatch: leave together (rank 0's process holds the store and shards)
        g.barrier()
    except psring.PsringError as exc:
        print(f"BARRIER {rank} {type(exc).__name__} {exc}", flush=True)
    # and in order: a rank that just exits may go before a peer heard that the barrier ended, which then
    # reads its going as a loss; closing says which collectives it finished
    g.close()
    os._exit(0)
two = flat = total = 0
odd_calls: list[str] = []  # the calls not in the flat order, for the test's message
# 1 element to blocks of the hierarchical path (4 MiB): the small path, one block, several
for size in (1, 7, 1000, 100_003, 1_500_001):
    for op in ("sum", "avg", "prod", "max"):
        xs = np.stack(
            [np.random.default_rng(size * 31 + r).standard_normal(size).astype(np.float32) for r in range(world)]
        )
        y = g.all_reduce(xs[rank], op=op)
        two += bool(np.array_equal(y, canonical_fold(xs, op, np.empty(size, np.float32), hosts=hosts)))
        is_flat = bool(np.array_equal(y, canonical_fold(xs, op, np.empty(size, np.float32))))
        flat += is_flat
        total += 1
        if not is_flat:
            odd_calls.append(f"{size}/{op}")
# three calls in flight at once (async_op), each large enough for the ps to reduce it within the host
xs3 = [
    np.stack([np.random.default_rng(7 * i + r).standard_normal(300_000).astype(np.float32) for r in range(world)])
    for i in range(3)
]
handles = [g.all_reduce(x[rank], async_op=True) for x in xs3]
for x, h in zip(xs3, handles, strict=True):
    y = h.wait()
    two += bool(np.array_equal(y, canonical_fold(x, "sum", np.empty(300_000, np.float32), hosts=hosts)))
    is_flat = bool(np.array_equal(y, canonical_fold(x, "sum", np.empty(300_000, np.float32))))
    flat += is_flat
    total += 1
    if not is_flat:
        odd_calls.append("300000/sum/async")
params = {"w": np.zeros(600_001, np.float32), "b": np.zeros(5, np.float32)}
opt = psring.SyncSGD(g, params, optimizer=psring.optim.SGD(lr=0.1, momentum=0.9))
for step in range(3):
    rng = np.random.default_rng(1000 * step + rank)
    params = opt.step({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in params.items()})
digest = hashlib.sha256(b"".join(np.ascontiguousarray(params[k]).tobytes() for k in sorted(params))).hexdigest()[:16]
blocks = g.stats().get("host_reduce_blocks", 0)  # ps: all_reduce blocks reduced within the host first
print(f"HIER {g.rank} {two} {flat} {total} {digest} {blocks} {','.join(odd_calls) or '-'}", flush=True)
g.close()
