"""Where a SyncSGD's parameters live and who runs its optimizer: a strategy its group provides.

A group whose topology keeps the model itself (``group.params``, and ``group.tables`` for sparse
tables: the parameter server's shards) gets :class:`Sharded`: workers push gradients and take the
parameters back, the shards run the optimizer. Any other gets :class:`Replicated`: every rank holds
the parameters and the optimizer state, all_reduces the gradients and steps itself. SyncSGD chooses
once (:func:`placement_for`) and never asks which topology it runs on; both fold in the canonical
order, so both give the same bits.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ..core.sparse import SparseRows

if TYPE_CHECKING:
    from .sgd import SyncSGD


def _to_host(x: Any) -> np.ndarray:
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "get"):
        return x.get()  # cupy
    return np.asarray(x)


def _like(xp: Any, host: np.ndarray) -> Any:
    return host if xp is np else xp.asarray(host)


class Replicated:
    """Every rank holds the parameters (and sparse tables) and runs the optimizer on the averages."""

    #: the topology keeps the model: a worker is only a source of gradients (backup workers, elastic)
    holds_model = False

    async def start(self, sgd: SyncSGD, loaded: dict[str, Any] | None) -> None:
        sgd._flat = [await sgd.group.broadcast(f, src=0) for f in sgd._flat]
        sgd._state = [sgd.optimizer.init_state(f) for f in sgd._flat]
        if loaded is not None:  # every rank loaded the same checkpoint (rank 0's params won anyway)
            for state, saved in zip(sgd._state, loaded["state"], strict=True):
                for k, v in saved.items():
                    state[k][...] = sgd.xp.asarray(v)
                state["step"] = loaded["step"]
            sgd.step_count = loaded["step"]

    async def start_table(self, sgd: SyncSGD, k: int, name: str) -> None:
        """Every rank takes a copy of rank 0's table (and a checkpoint's optimizer state: every rank
        loaded the same one)."""
        sgd._tables[name] = await sgd.group.broadcast(sgd._tables[name], src=0)
        sgd._table_state[name] = state = sgd.optimizer.init_state(sgd._tables[name])
        for key, saved in sgd._loaded_tables.pop(name, {}).items():
            state[key][...] = sgd.xp.asarray(saved)

    async def table_state(self, sgd: SyncSGD, name: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """A table's rows and their optimizer state, as host arrays (a checkpoint's)."""
        state = sgd.optimizer.state_arrays(sgd._table_state[name])
        return _to_host(sgd._tables[name]).copy(), {k: _to_host(v).copy() for k, v in state.items()}

    async def pull_rows(self, sgd: SyncSGD, name: str, idx: np.ndarray) -> Any:
        return sgd.xp.take(sgd._tables[name], sgd.xp.asarray(idx), axis=0)

    async def step(self, sgd: SyncSGD, flats: list[Any]) -> tuple[float, float]:
        """The exchange and the update; (when the exchange ended, when the update did)."""
        avgs = await asyncio.gather(*(sgd.group.all_reduce(f, op="avg", compression=sgd.compression) for f in flats))
        t1 = time.perf_counter()
        for flat, avg, state in zip(sgd._flat, avgs, sgd._state, strict=True):
            sgd.optimizer.update(flat, avg, state)
        return t1, time.perf_counter()

    async def table_step(self, sgd: SyncSGD, k: int, name: str, g: SparseRows, pull: np.ndarray | None) -> None:
        """One sparse table's step: every rank checks every rank's rows (bad ones named everywhere,
        nothing applied), sums them in rank order and runs the optimizer on those rows."""
        summed = await sgd.group.sparse_all_reduce(g)
        if summed.indices.size == 0:
            return
        grad = summed.values / summed.values.dtype.type(sgd.group.world_size)
        sgd.optimizer.update_rows(sgd._tables[name], sgd._table_state[name], summed.indices, grad, sgd.step_count)

    async def state(self, sgd: SyncSGD, keys: list[str]) -> tuple[list[dict[str, np.ndarray]], int]:
        """The optimizer state by bucket, and the step."""
        return [{k: _to_host(s[k]) for k in keys} for s in sgd._state], sgd.step_count


class Sharded:
    """The topology's shards hold the parameters (``group.params``) and sparse tables (``group.tables``)
    and run the optimizer; a worker pushes gradients and takes the new parameters back."""

    holds_model = True

    def __init__(self, params: Any, tables: Any) -> None:
        self.params = params
        self.tables = tables

    async def start(self, sgd: SyncSGD, loaded: dict[str, Any] | None) -> None:
        host = [_to_host(f) for f in sgd._flat]
        step, state = (loaded["step"], loaded["state"]) if loaded is not None else (None, None)
        outs, step = await self.params.init(host, sgd.optimizer.config(), step, state)
        sgd._flat = [_like(sgd.xp, o) for o in outs]
        sgd.step_count = step

    async def start_table(self, sgd: SyncSGD, k: int, name: str) -> None:
        """The shards take their row ranges of rank 0's table (and of a checkpoint's optimizer state,
        at its step); the workers drop theirs."""
        rows, width, dtype = sgd._table_shape[name]
        table = _to_host(sgd._tables[name]) if sgd.group.rank == 0 else None
        loaded = sgd._loaded_tables.pop(name, None)
        await self.tables.init(
            k, table, rows, width, dtype, sgd.optimizer.config(), step=sgd.step_count,
            state=loaded if sgd.group.rank == 0 else None,
        )  # fmt: skip
        sgd._tables[name] = None  # the shards hold it now: workers never do

    async def table_state(self, sgd: SyncSGD, name: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """A table's rows and their optimizer state, read from the shards (a checkpoint's)."""
        k, (rows, width, dtype) = sgd.sparse.index(name), sgd._table_shape[name]
        every = np.arange(rows, dtype=np.int64)
        values = await self.tables.pull(k, every, rows, width, np.dtype(dtype))
        state = {}
        for key in sgd.optimizer.state_keys():
            state[key] = await self.tables.pull(k, every, rows, width, np.dtype(dtype), of=key)
        return values, state

    async def pull_rows(self, sgd: SyncSGD, name: str, idx: np.ndarray) -> Any:
        got = sgd._prefetched.pop(name, None)
        if got is not None and np.array_equal(got[0], idx):  # they came back with the last step
            return _like(sgd.xp, got[1])
        rows, width, dtype = sgd._table_shape[name]
        out = await self.tables.pull(sgd.sparse.index(name), idx.astype(np.int64), rows, width, np.dtype(dtype))
        return _like(sgd.xp, out)

    async def step(self, sgd: SyncSGD, flats: list[Any]) -> tuple[float, float]:
        host = [_to_host(f) for f in flats]
        outs = [np.empty_like(h) for h in host]
        taken = await self.params.step(sgd.step_count, host, outs, compression=sgd.compression)
        sgd.skipped += taken - 1
        sgd.step_count += taken - 1  # backup workers: a worker that was behind skips ahead
        sgd._flat = [_like(sgd.xp, o) for o in outs]
        t1 = time.perf_counter()
        return t1, t1  # the update ran on the servers, inside the exchange

    async def table_step(self, sgd: SyncSGD, k: int, name: str, g: SparseRows, pull: np.ndarray | None) -> None:
        """Each rank's word on its rows goes with its push; the shards apply none if one is bad."""
        rows = sgd._table_shape[name][0]
        problem = g.problem()
        bad, pulled = await self.tables.step(
            k, sgd.step_count, _to_host(g.indices), _to_host(g.values), rows, bad=problem is not None,
            pull=None if pull is None else pull.astype(np.int64, copy=False),
        )  # fmt: skip
        if pulled is not None and pull is not None:
            sgd._prefetched[name] = (pull, pulled)
        if bad:
            mine = f" (this rank: {problem})" if problem is not None else ""
            raise ValueError(f"grads[{name!r}]: rank(s) {', '.join(map(str, bad))} pushed an index outside "
                             f"the table's rows{mine}; nothing was applied")  # fmt: skip

    async def state(self, sgd: SyncSGD, keys: list[str]) -> tuple[list[dict[str, np.ndarray]], int]:
        return await self.params.state([_to_host(f) for f in sgd._flat], keys)


Placement = Replicated | Sharded


def placement_for(group: Any) -> Placement:
    """The strategy the group's topology provides: its own parameter home where it has one."""
    params = getattr(group, "params", None)
    if params is not None:
        return Sharded(params, getattr(group, "tables", None))
    return Replicated()
