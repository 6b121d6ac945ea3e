"""sparse_all_reduce over any group: three all_gathers, numbered at once, and a merge in rank order.

Every rank's rows (unique sorted indices, each index's rows added in rank order, then in each rank's
own order) -- the same bits on every rank and on both topologies, since it is made of the group's own
all_gathers. First the ranks' metadata (row counts, width, table height, dtype, a bad index), so a
problem anywhere is named on every rank before anything is summed; then the padded indices and rows.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import numpy as np

from ..core import gpu
from ..core.sparse import SparseRows, merge_rows
from ..errors import MismatchError

if TYPE_CHECKING:
    from .collective import Collective
    from .runtime import CollectiveRuntime

#: the group's all_gather body: (the collective, a flat host array) -> every rank's, as rows
AllGather = Callable[["Collective", np.ndarray], Awaitable[np.ndarray]]


async def sparse_all_reduce(g: CollectiveRuntime, all_gather: AllGather, rows: SparseRows) -> SparseRows:
    if not isinstance(rows, SparseRows):
        raise TypeError(f"sparse_all_reduce takes a psring.SparseRows, got {type(rows).__name__}")
    idx, xp = gpu.host_of(rows.indices)
    val, _ = gpu.host_of(rows.values)
    problem = rows.problem()
    meta = np.array([idx.size, rows.width, rows.num_rows, val.dtype.num, problem is not None], np.int64)
    # three collectives, all numbered now, before any wait: calls made while this one runs take
    # later numbers on every rank, whichever of them the loop resumes first
    first = g.begin("all_gather", meta)
    seqs = g.reserve(2)
    try:
        metas = np.array(await g.run(first, all_gather(first, meta))).reshape(g.world_size, -1)
    except BaseException:  # as a compressed all_reduce's agreement: give the numbers back
        g.give_back(seqs)
        raise
    try:
        merged = await _merge(g, all_gather, rows, idx, val, metas, problem, seqs)
    finally:  # numbers not begun (every rank stopped at the same check): skipped alike everywhere
        g.settle(seqs)
    if xp is np:
        return merged
    return SparseRows(gpu.back_to(merged.indices, xp), gpu.back_to(merged.values, xp), merged.num_rows)


async def _all_gather_at(g: CollectiveRuntime, all_gather: AllGather, x: np.ndarray, seq: int) -> list[np.ndarray]:
    """all_gather of a host array as collective number ``seq`` (reserved)."""
    coll = g.begin("all_gather", x, seq=seq)
    out = await g.run(coll, all_gather(coll, x.reshape(-1)))
    return [out[r].reshape(x.shape) for r in range(g.world_size)]


async def _merge(
    g: CollectiveRuntime, all_gather: AllGather, rows: SparseRows, idx: np.ndarray, val: np.ndarray,
    metas: np.ndarray, problem: str | None, seqs: list[int],
) -> SparseRows:  # fmt: skip
    n = g.world_size
    bad = [r for r in range(n) if metas[r, 4]]
    if bad:
        mine = f" (this rank: {problem})" if problem is not None else ""
        raise ValueError(
            f"sparse_all_reduce: rank(s) {', '.join(map(str, bad))} passed an index outside the table's "
            f"rows{mine}; nothing was summed"
        )
    for col, what in ((1, "width"), (2, "num_rows"), (3, "dtype")):
        differ = [r for r in range(n) if metas[r, col] != metas[0, col]]
        if differ:
            raise MismatchError(
                f"sparse_all_reduce: rank(s) {', '.join(map(str, differ))} passed rows of another {what} than "
                f"rank 0 (this is rank {g.rank}: {rows!r}); nothing was summed"
            )
    top = int(metas[:, 0].max())
    if top == 0:
        return merge_rows([], rows.num_rows, rows.width, val.dtype)
    pad_idx = np.zeros(top, np.int64)
    pad_idx[: idx.size] = idx
    pad_val = np.zeros((top, rows.width), val.dtype)
    pad_val[: idx.size] = val
    all_idx = await _all_gather_at(g, all_gather, pad_idx, seqs[0])
    all_val = await _all_gather_at(g, all_gather, pad_val, seqs[1])
    counts = [int(c) for c in metas[:, 0]]
    parts = [(all_idx[r][: counts[r]], all_val[r][: counts[r]]) for r in range(n)]
    return merge_rows(parts, rows.num_rows, rows.width, val.dtype)
