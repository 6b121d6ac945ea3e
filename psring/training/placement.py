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
from collections.abc import Mapping
from typing import Any, Protocol

import numpy as np

from ..core.optim import Optimizer
from ..core.sparse import SparseRows
from ..errors import CollectiveTimeoutError, PeerLostError
from .compressors import Compressor
from .local import LocalModel, like, to_host
from .localsgd import LocalSteps


class Trainer(Protocol):
    """What a placement sees of the training it places (training.sgd.SyncSGD): the model as this rank
    holds it, the group and the optimizer it runs, how the exchange is coded, and the step counters a
    placement moves (a ps step taken by others, a joiner's boundary, a re-formed group)."""

    group: Any
    model: LocalModel
    optimizer: Optimizer
    compression: str | None
    compressor: Compressor | None
    local: LocalSteps | None
    elastic: bool
    step_count: int
    skipped: int
    joined_at: int | None
    joined_with: dict[str, Any] | None

    @property
    def sparse(self) -> list[str]: ...

    @property
    def xp(self) -> Any: ...


class Replicated:
    """Every rank holds the parameters (and sparse tables) and runs the optimizer on the averages."""

    #: the topology keeps the model: a worker is only a source of gradients (backup workers, elastic)
    holds_model = False

    async def start(self, sgd: Trainer, loaded: dict[str, Any] | None) -> None:
        sgd.model.flat = [await sgd.group.broadcast(f, src=0) for f in sgd.model.flat]
        sgd.model.state = [sgd.optimizer.init_state(f) for f in sgd.model.flat]
        if loaded is not None:  # every rank loaded the same checkpoint (rank 0's params won anyway)
            for state, saved in zip(sgd.model.state, loaded["state"], strict=True):
                for k, v in saved.items():
                    state[k][...] = sgd.xp.asarray(v)
                state["step"] = loaded["step"]
            sgd.step_count = loaded["step"]

    async def start_table(self, sgd: Trainer, k: int, name: str) -> None:
        """Every rank takes a copy of rank 0's table (and a checkpoint's optimizer state: every rank
        loaded the same one)."""
        sgd.model.tables[name] = await sgd.group.broadcast(sgd.model.tables[name], src=0)
        sgd.model.table_state[name] = state = sgd.optimizer.init_state(sgd.model.tables[name])
        for key, saved in sgd.model.loaded_tables.pop(name, {}).items():
            state[key][...] = sgd.xp.asarray(saved)

    async def table_state(self, sgd: Trainer, name: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """A table's rows and their optimizer state, as host arrays (a checkpoint's)."""
        state = sgd.optimizer.state_arrays(sgd.model.table_state[name])
        return to_host(sgd.model.tables[name]).copy(), {k: to_host(v).copy() for k, v in state.items()}

    async def pull_rows(self, sgd: Trainer, name: str, idx: np.ndarray) -> Any:
        return sgd.xp.take(sgd.model.tables[name], sgd.xp.asarray(idx), axis=0)

    async def step(
        self, sgd: Trainer, flats: list[Any], rows: Mapping[str, SparseRows], pull: Mapping[str, np.ndarray]
    ) -> tuple[float, float]:
        """The exchange and the update, the sparse tables' too; (when the dense exchange ended, when
        the updates did)."""
        avgs = await self.exchange(sgd, flats)
        t1 = time.perf_counter()
        self.update(sgd, avgs)
        for name in sgd.sparse:
            self.update_rows(sgd, name, await self.table_exchange(sgd, rows[name]))
        return t1, time.perf_counter()

    async def exchange(self, sgd: Trainer, flats: list[Any]) -> list[Any]:
        """Every bucket averaged over the group; the first error once every bucket's call ended (none
        is left running)."""
        if sgd.compressor is not None:  # error feedback: the compressor's averages
            return await sgd.compressor.exchange(sgd.group, flats)
        calls = (sgd.group.all_reduce(f, op="avg", compression=sgd.compression) for f in flats)
        got = await asyncio.gather(*calls, return_exceptions=True)
        for g in got:
            if isinstance(g, BaseException):
                raise g
        return got

    def update(self, sgd: Trainer, avgs: list[Any]) -> None:
        for flat, avg, state in zip(sgd.model.flat, avgs, sgd.model.state, strict=True):
            sgd.optimizer.update(flat, avg, state)

    async def fragment_step(self, sgd: Trainer, ids: list[int], pseudo: list[Any], round_: int) -> None:
        """Streaming local SGD: buckets ``ids`` only -- their pseudo-gradients averaged and the outer
        step on them (``sgd.model.flat[b]`` in place); ``round_`` is the fragment's outer steps so far."""
        avgs = await self.exchange(sgd, pseudo)
        for b, avg in zip(ids, avgs, strict=True):
            sgd.optimizer.update(sgd.model.flat[b], avg, sgd.model.state[b])

    async def table_exchange(self, sgd: Trainer, g: SparseRows) -> SparseRows:
        """One sparse table's rows summed over the group: every rank checks every rank's rows (bad
        ones named everywhere, nothing applied) and sums them in rank order."""
        return await sgd.group.sparse_all_reduce(g)

    def update_rows(self, sgd: Trainer, name: str, summed: SparseRows) -> None:
        """The optimizer on the rows the group's gradients touched, by their average."""
        if summed.indices.size == 0:
            return
        grad = summed.values / summed.values.dtype.type(sgd.group.world_size)
        model = sgd.model
        sgd.optimizer.update_rows(model.tables[name], model.table_state[name], summed.indices, grad, sgd.step_count)

    def live_group(self, sgd: Trainer) -> Any:
        return sgd.group

    def members(self, sgd: Trainer) -> list[int]:
        return list(sgd.group.members)

    async def join(self, sgd: Trainer) -> None:
        raise ValueError("a worker that joins a running job (join=True) needs SyncSGD(elastic=True)")

    async def admit(self, sgd: Trainer, extra: dict[str, Any] | None) -> list[int]:
        raise RuntimeError("admit_waiting is for SyncSGD(elastic=True)")

    async def close_joins(self, sgd: Trainer) -> None:
        raise RuntimeError("close_joins is for SyncSGD(elastic=True)")

    async def state(self, sgd: Trainer, keys: list[str]) -> tuple[list[dict[str, np.ndarray]], int]:
        """The optimizer state by bucket, and the step."""
        return [{k: to_host(s[k]) for k in keys} for s in sgd.model.state], sgd.step_count


class Sharded:
    """The topology's shards hold the parameters (``group.params``) and sparse tables (``group.tables``)
    and run the optimizer; a worker pushes gradients and takes the new parameters back."""

    holds_model = True

    def __init__(self, params: Any, tables: Any) -> None:
        self.params = params
        self.tables = tables

    async def start(self, sgd: Trainer, loaded: dict[str, Any] | None) -> None:
        host = [to_host(f) for f in sgd.model.flat]
        step, state = (loaded["step"], loaded["state"]) if loaded is not None else (None, None)
        outs, step = await self.params.init(host, sgd.optimizer.config(), step, state)
        sgd.model.flat = [like(sgd.xp, o) for o in outs]
        sgd.step_count = step

    async def start_table(self, sgd: Trainer, k: int, name: str) -> None:
        """The shards take their row ranges of rank 0's table (and of a checkpoint's optimizer state,
        at its step); the workers drop theirs."""
        rows, width, dtype = sgd.model.table_shape[name]
        table = to_host(sgd.model.tables[name]) if sgd.group.rank == 0 else None
        loaded = sgd.model.loaded_tables.pop(name, None)
        await self.tables.init(
            k, table, rows, width, dtype, sgd.optimizer.config(), step=sgd.step_count,
            state=loaded if sgd.group.rank == 0 else None,
        )  # fmt: skip
        sgd.model.tables[name] = None  # the shards hold it now: workers never do

    async def table_state(self, sgd: Trainer, name: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        """A table's rows and their optimizer state, read from the shards (a checkpoint's)."""
        k, (rows, width, dtype) = sgd.sparse.index(name), sgd.model.table_shape[name]
        every = np.arange(rows, dtype=np.int64)
        values = await self.tables.pull(k, every, rows, width, np.dtype(dtype))
        state = {}
        for key in sgd.optimizer.state_keys():
            state[key] = await self.tables.pull(k, every, rows, width, np.dtype(dtype), of=key)
        return values, state

    async def pull_rows(self, sgd: Trainer, name: str, idx: np.ndarray) -> Any:
        got = sgd.model.prefetched.pop(name, None)
        if got is not None and np.array_equal(got[0], idx):  # they came back with the last step
            return like(sgd.xp, got[1])
        rows, width, dtype = sgd.model.table_shape[name]
        out = await self.tables.pull(sgd.sparse.index(name), idx.astype(np.int64), rows, width, np.dtype(dtype))
        return like(sgd.xp, out)

    async def step(
        self, sgd: Trainer, flats: list[Any], rows: Mapping[str, SparseRows], pull: Mapping[str, np.ndarray]
    ) -> tuple[float, float]:
        t1, t2 = await self.dense_step(sgd, flats)
        for k, name in enumerate(sgd.sparse):
            await self.table_step(sgd, k, name, rows[name], pull.get(name))
            t2 = time.perf_counter()
        return t1, t2

    async def dense_step(self, sgd: Trainer, flats: list[Any]) -> tuple[float, float]:
        host = [to_host(f) for f in flats]
        # local SGD's outer step: the new global parameters land in the old ones' memory (what the loop
        # holds are its local copies, which carry the pseudo-gradients now: no model's worth more)
        in_place = sgd.local is not None and sgd.xp is np
        outs = sgd.model.flat if in_place else [np.empty_like(h) for h in host]
        taken = await self.params.step(sgd.step_count, host, outs, compression=sgd.compression)
        sgd.skipped += taken - 1
        sgd.step_count += taken - 1  # backup workers: a worker that was behind skips ahead
        sgd.model.flat = [like(sgd.xp, o) for o in outs]
        t1 = time.perf_counter()
        return t1, t1  # the update ran on the servers, inside the exchange

    async def fragment_step(self, sgd: Trainer, ids: list[int], pseudo: list[Any], round_: int) -> None:
        """Streaming local SGD: buckets ``ids`` pushed as the fragment's ``round_``-th step (the step its
        buckets are at on the shards, which run the outer optimizer); the new global parameters pulled."""
        host = [to_host(p) for p in pseudo]
        outs = [np.empty_like(h) for h in host]
        await self.params.step(round_, host, outs, compression=sgd.compression, buckets=ids)
        for b, o in zip(ids, outs, strict=True):
            sgd.model.flat[b] = like(sgd.xp, o)

    async def table_step(self, sgd: Trainer, k: int, name: str, g: SparseRows, pull: np.ndarray | None) -> None:
        """Each rank's word on its rows goes with its push; the shards apply none if one is bad."""
        rows = sgd.model.table_shape[name][0]
        problem = g.problem()
        bad, pulled = await self.tables.step(
            k, sgd.step_count, to_host(g.indices), to_host(g.values), rows, bad=problem is not None,
            pull=None if pull is None else pull.astype(np.int64, copy=False),
        )  # fmt: skip
        if pulled is not None and pull is not None:
            sgd.model.prefetched[name] = (pull, pulled)
        if bad:
            mine = f" (this rank: {problem})" if problem is not None else ""
            raise ValueError(f"grads[{name!r}]: rank(s) {', '.join(map(str, bad))} pushed an index outside "
                             f"the table's rows{mine}; nothing was applied")  # fmt: skip

    async def state(self, sgd: Trainer, keys: list[str]) -> tuple[list[dict[str, np.ndarray]], int]:
        return await self.params.state([to_host(f) for f in sgd.model.flat], keys)

    def live_group(self, sgd: Trainer) -> Any:
        """Elastic: a group of the workers the shards averaged over last (the group itself otherwise)."""
        return self.params.admission.live_subgroup() if sgd.elastic else sgd.group

    def members(self, sgd: Trainer) -> list[int]:
        live = getattr(sgd.group, "live_members", None)
        return list(live if live is not None else sgd.group.members)

    async def join(self, sgd: Trainer) -> None:
        """A new worker: the shards' parameters (and tables) of the step a boundary admitted it at."""
        host = [to_host(f) for f in sgd.model.flat]
        outs, sgd.joined_at, step, sgd.joined_with = await self.params.admission.join(host)
        sgd.model.flat = [like(sgd.xp, o) for o in outs]
        for k, name in enumerate(sgd.sparse):  # the shards hold the tables, at the step it joins at
            sgd.model.tables[name] = None
            self.tables.joined(k, sgd.joined_at)
        sgd.skipped += step - sgd.joined_at
        sgd.step_count = step

    async def admit(self, sgd: Trainer, extra: dict[str, Any] | None) -> list[int]:
        return list(await self.params.admission.admit(sgd.step_count, [to_host(f) for f in sgd.model.flat], extra))

    async def close_joins(self, sgd: Trainer) -> None:
        await self.params.admission.close_joins(sgd.step_count)


class Reformed(Replicated):
    """Replicated, elastic: a step whose exchange fails for a lost, killed or hung rank is finished
    among the survivors. They agree who is left and re-form (the group's ``quorum()``: a round
    through the store, a new group of the survivors over the same endpoint); then, if some survivor
    had completed the step (its exchange ended before the loss), the first such hands its
    parameters, optimizer state and tables to the others, who take the step as done; if none had,
    all redo it among themselves. Every exchange of a step ends before any update (so a step is
    whole on a rank or not at all), and the survivors stay bit-identical."""

    def __init__(self, quorum: Any) -> None:
        self.quorum = quorum

    async def step(
        self, sgd: Trainer, flats: list[Any], rows: Mapping[str, SparseRows], pull: Mapping[str, np.ndarray]
    ) -> tuple[float, float]:
        while True:
            try:
                avgs = await self.exchange(sgd, flats)
                summed = [await self.table_exchange(sgd, rows[name]) for name in sgd.sparse]
                break
            except (PeerLostError, CollectiveTimeoutError) as exc:
                if await self._recover(sgd, exc):
                    t = time.perf_counter()
                    return t, t  # a survivor that completed the step handed it over
        t1 = time.perf_counter()
        self.update(sgd, avgs)
        for name, got in zip(sgd.sparse, summed, strict=True):
            self.update_rows(sgd, name, got)
        return t1, time.perf_counter()

    async def _recover(self, sgd: Trainer, exc: BaseException) -> bool:
        """Re-form without the lost; True when this rank took the step from a survivor that completed it."""
        agreed = await self.quorum.reform(sgd.group, exc, sgd.step_count)
        sgd.group = agreed.group
        best = max(agreed.done)
        if min(agreed.done) == best:
            return False  # nobody completed it: redo it among the survivors
        await self._hand_over(sgd, agreed.done.index(best))
        if sgd.step_count >= best:
            return False  # this rank had completed the steps before: it redoes its own
        sgd.step_count = best - 1  # (SyncSGD.step counts the step taken)
        return True

    async def _hand_over(self, sgd: Trainer, src: int) -> None:
        """Parameters, optimizer state and sparse tables (with theirs) from rank ``src`` of the
        (new) group to all."""
        g = sgd.group
        for flat in sgd.model.flat:  # in place: the views the loop holds (opt.params) stay the parameters
            flat[...] = await g.broadcast(flat, src=src)
        for state in [*sgd.model.state, *(sgd.model.table_state[n] for n in sgd.sparse)]:
            for key in sorted(state):
                if key == "step":
                    state[key] = int((await g.broadcast(np.array([state[key]], np.int64), src=src))[0])
                else:
                    state[key][...] = await g.broadcast(state[key], src=src)
        for name in sgd.sparse:
            sgd.model.tables[name][...] = await g.broadcast(sgd.model.tables[name], src=src)

    def live_group(self, sgd: Trainer) -> Any:
        return sgd.group  # the survivors' group since the last loss or join

    def members(self, sgd: Trainer) -> list[int]:
        return self.quorum.ids_of(sgd.group)

    async def admit(self, sgd: Trainer, extra: dict[str, Any] | None) -> list[int]:
        """The new workers waiting (``init_group(topology="ring", join=True)``), admitted into a new
        ring of this group's ranks then them; its rank 0 streams them the step, parameters, optimizer
        state and tables. Returns their ids (none waiting: [], and nothing re-formed)."""
        before = len(sgd.group.members)
        ring = await self.quorum.admit(sgd.group, extra, sgd.step_count)
        if ring is None:
            return []
        sgd.group, self.quorum = ring, ring.quorum()
        await ring.broadcast(np.array([sgd.step_count], np.int64), src=0)
        await self._hand_over(sgd, 0)
        return self.quorum.ids[before:]

    async def join(self, sgd: Trainer) -> None:
        """A new worker: the step, parameters, optimizer state and tables from the ring's rank 0, at
        the boundary that admitted it."""
        g = sgd.group
        sgd.model.state = [sgd.optimizer.init_state(f) for f in sgd.model.flat]
        for name in sgd.sparse:
            sgd.model.table_state[name] = sgd.optimizer.init_state(sgd.model.tables[name])
        sgd.step_count = sgd.joined_at = int((await g.broadcast(np.array([0], np.int64), src=0))[0])
        await self._hand_over(sgd, 0)
        sgd.joined_with, g.joining = g.joined_with, False

    async def close_joins(self, sgd: Trainer) -> None:
        await self.quorum.close_joins(sgd.group, sgd.step_count)


Placement = Replicated | Sharded | Reformed


def placement_for(group: Any, elastic: bool = False, replicated: bool = False) -> Placement:
    """The strategy the group's topology provides: its own parameter home where it has one (unless
    ``replicated``: a compressor's averages are made of collectives, and every rank applies them);
    else, elastic, its survivors' re-forming (``group.quorum()``); else every rank's own copy."""
    params = getattr(group, "params", None)
    if params is not None and replicated and elastic:
        raise ValueError(
            "elastic=True with a compressor needs the ring: over ps the shards average each step over the "
            "workers still there, and a compressor's averages are made of collectives among the workers"
        )
    if params is not None and not replicated:
        return Sharded(params, getattr(group, "tables", None))
    if elastic:
        quorum = group.quorum()
        if quorum is None:
            raise ValueError(f"elastic=True: the {group.topology} topology neither keeps the model nor re-forms")
        return Reformed(quorum)
    return Replicated()
