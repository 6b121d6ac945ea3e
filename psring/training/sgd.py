"""Synchronous SGD over either topology: one call, the same parameters.

``SyncSGD(group, params, optimizer)`` keeps the parameters in a few flat *buckets*
(many tensors each, so a model with hundreds of tensors sends few frames). Over the
ring, ``step(grads)`` averages each bucket with ``all_reduce(op="avg")`` and applies the
optimizer locally; over ps, the shards average, apply the same optimizer code and the
workers pull the new parameters. Both average in one canonical order and the
optimizers are elementwise, so every rank -- and both topologies -- hold bit-identical
parameters after any number of steps (same device type).

Knows a Group and an optimizer, not sockets.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ..core.arrays import byte_view, check_array
from ..core.codec import Codec, codec_named
from ..core.optim import SGD, Optimizer
from ..core.sparse import SparseRows, merge_rows
from ..errors import CollectiveTimeoutError, MismatchError, PeerLostError
from ..topology.blocking import BlockingGroup
from .compressors import Compressor
from .local import BUCKET_BYTES, Bucket, LocalModel, like, make_buckets, to_host
from .localsgd import LocalSteps
from .placement import Placement, placement_for
from .streaming import Flight, Streaming

logger = logging.getLogger(__name__)


class SyncSGD:
    """Synchronous data-parallel SGD: ``params = await opt.step(grads)`` on every rank."""

    def __new__(cls, group: Any, *args: Any, **kwargs: Any) -> Any:

        if cls is SyncSGD and isinstance(group, BlockingGroup):
            return BlockingSyncSGD(group, *args, **kwargs)
        return super().__new__(cls)

    def __init__(
        self,
        group: Any,
        params: Mapping[str, Any],
        optimizer: Optimizer | None = None,
        *,
        bucket_bytes: int = BUCKET_BYTES,
        accumulate: int = 1,
        compression: str | Codec | Compressor | None = None,
        elastic: bool = False,
        backup: int = 0,
        sparse: Sequence[str] = (),
        local_steps: int = 1,
        outer: Optimizer | None = None,
        reset_inner: bool = False,
        fragments: int = 1,
    ) -> None:
        if not params:
            raise ValueError("SyncSGD needs at least one parameter")
        if type(fragments) is not int or fragments < 1:
            raise ValueError(f"fragments={fragments!r} must be a positive integer")
        if fragments > 1:
            why = (
                "needs local_steps > 1 (streaming local SGD)" if local_steps == 1
                else "takes a codec (int8, bf16, fp16), not a compressor (not yet)"
                if isinstance(compression, Compressor)
                else "takes no elastic=True (not yet)" if elastic
                else None
            )  # fmt: skip
            if why:
                raise ValueError(f"fragments={fragments} {why}")
        #: local SGD / DiLoCo (local_steps=H, outer=...): the rank's own copy and inner optimizer, else None
        self.local: LocalSteps | None = None
        if local_steps != 1 or outer is not None:
            self.local = LocalSteps(optimizer or SGD(lr=0.01), local_steps, reset_inner)
            if sparse:
                raise ValueError(f"local_steps={local_steps} takes no sparse tables (not yet)")
            if backup:
                raise ValueError(f"local_steps={local_steps} takes no backup workers (not yet)")
            optimizer = outer or SGD(lr=1.0)  # what the placement runs: the outer step
        sparse = [sparse] if isinstance(sparse, str) else list(sparse)
        check_sparse(params, sparse, optimizer)
        if type(backup) is not int or not 0 <= backup < group.world_size:
            raise ValueError(
                f"backup={backup!r}: the number of backup workers must be an integer from 0 to "
                f"{group.world_size - 1} (world size {group.world_size}: at least one worker's push completes a step)"
            )
        #: a compressor with error feedback (TopK, PowerSGD), else None (a codec, or nothing)
        self.compressor: Compressor | None = compression if isinstance(compression, Compressor) else None
        #: where the parameters live and who runs the optimizer: what the group's topology provides (with a
        #: compressor every rank holds them: its averages are made of the workers' collectives)
        self.placement: Placement = placement_for(group, elastic, replicated=self.compressor is not None)
        if backup:
            if self.compressor is not None:
                raise ValueError(
                    f"backup={backup} takes no compression: a compressor's averages are collectives of every "
                    "worker, which backup workers exist not to wait for"
                )
            if not self.placement.holds_model:
                raise ValueError(
                    f"backup={backup} needs the ps topology: there a shard applies each piece once all but "
                    f"{backup} workers pushed it; a ring all_reduce needs every rank's part"
                )
            if compression is not None:
                raise ValueError(
                    f"backup={backup} takes no compression: its scale is agreed over every worker before a step, "
                    "which backup workers exist not to wait for"
                )
            group.backup = backup
        self.backup = backup
        if elastic and self.placement.holds_model:
            group.elastic = True  # (the shards average over the workers still there; else the group re-forms)
        self.elastic = elastic
        #: a worker that joined a running elastic job: what the admitting loop told it (else None)
        self.joined_with: dict[str, Any] | None = None
        #: ... and the step of the boundary that admitted it (with backup workers it may start a few steps
        #: later: the others took them without it, as they do a straggler's)
        self.joined_at: int | None = None
        if type(accumulate) is not int or accumulate < 1:
            raise ValueError(f"accumulate={accumulate!r} must be a positive integer")
        codec = None if self.compressor is not None else codec_named(compression)  # type: ignore[arg-type]
        if codec is not None:
            for name, v in params.items():
                try:
                    codec.check(check_array(v, f"params[{name!r}]").dtype, "avg")
                except TypeError as exc:
                    raise TypeError(f"SyncSGD: params[{name!r}]: {exc}") from None
        #: the codec's name or the compressor's description (what the ranks agree on and a checkpoint
        #: records), or None
        self.compression = (
            self.compressor.describe() if self.compressor is not None else codec.name if codec is not None else None
        )
        self.group = group
        self.optimizer = optimizer or SGD(lr=0.01)
        self.accumulate = accumulate
        #: the parameters, optimizer state and tables as this rank holds them
        self.model = LocalModel(params, sparse, bucket_bytes, fragments)
        #: streaming local SGD (fragments=K > 1): the fragments' schedule and the exchange in flight
        self.streaming: Streaming | None = None
        if self.local is not None and fragments > 1:
            self.streaming = Streaming(fragments, self.local.every, self.model.fragments)
        self._acc: list[Any] | None = None
        #: sparse tables' rows of the micro-batches so far (accumulate=k), in their order, by table
        self._acc_rows: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}
        self._micro = 0
        self.step_count = 0  # optimizer steps taken (server-side step for ps)
        #: backup workers: the steps this worker skipped because the others completed them without it
        self.skipped = 0
        self.started = False
        self.last_timing = {"exchange_s": 0.0, "update_s": 0.0}  # of the last step that exchanged
        #: seconds ``step`` spent waiting on exchanges in all (streaming: on an exchange that had not landed
        #: by its step, and the digest check): what compute use is measured against
        self.waited_s = 0.0
        self.params = self.model.views()
        self._loaded: dict[str, Any] | None = None  # a checkpoint to resume from (load_state_dict)
        #: every rank's error feedback from a checkpoint (load_state_dict), taken at start
        self._loaded_feedback: list[list[Any]] | None = None
        #: local SGD: every rank's inner optimizer state from a checkpoint, taken at start
        self._loaded_inner: list[list[dict[str, Any]]] | None = None
        self._loaded_inner_steps: list[int] = []
        #: local SGD: ranks repaired after an outer step found their global state differing (see _compare_global)
        self.repaired = 0
        if self.compressor is not None:
            if self.model.xp is not np:
                raise TypeError(f"compression={self.compression!r} takes numpy parameters (not yet cupy's)")
            self.compressor.bind(self.model.buckets)

    @property
    def sparse(self) -> list[str]:
        """The sparse tables (SyncSGD(..., sparse=[name])): not in the buckets; over the ring every rank
        holds the table (``model.tables``), over ps the shards do (the model's is None after start)."""
        return self.model.sparse

    @property
    def xp(self) -> Any:
        """The array module of the parameters (numpy, or cupy for a GPU's)."""
        return self.model.xp

    @property
    def buckets(self) -> list[Bucket]:
        """The dense parameters' flat buckets, in the order they are exchanged."""
        return self.model.buckets

    # ---------------------------------------------------------- the work
    @property
    def topology(self) -> str:
        return str(self.group.topology)

    @property
    def batches_done(self) -> int:
        """The calls to ``step`` the optimizer steps so far stand for (accumulate=k: k each), and the
        micro-batches summed since the last exchange: where a loop that skips with backup workers is."""
        return self.step_count * self.accumulate + self._micro

    @property
    def members(self) -> list[int]:
        """The ranks whose gradients the last step averaged (elastic: the workers still there)."""
        return self.placement.members(self)

    def live_group(self) -> Any:
        """A group of the workers there now (elastic; the group itself while nobody left or joined),
        for the loop's own collectives. Every worker makes the same one at the same step."""
        return self.placement.live_group(self)

    async def admit_waiting(self, extra: dict[str, Any] | None = None) -> list[int]:
        """Elastic: at a boundary of the loop's choosing (between steps; every live worker calls it),
        admit the workers waiting to join (``init_group(topology="ps", join=True)``): from the next
        step on they push too, and ``members`` has them. ``extra`` reaches the new workers
        (``joined_with``): the loop's position, e.g. the epoch they start. Returns the new ranks."""
        if not self.elastic:
            raise RuntimeError("admit_waiting is for SyncSGD(elastic=True)")
        if self._micro:  # a new worker starts at an exchange: it would push a step the others have not
            raise RuntimeError(
                f"admit_waiting in the middle of an accumulation ({self._micro} of {self.accumulate} "
                "micro-batches summed): call it after a step that exchanged"
            )
        if self.local is not None and self.local.since:  # a new worker starts at an outer step, from its result
            raise RuntimeError(
                f"admit_waiting between outer steps ({self.local.since} of local_steps={self.local.every} inner "
                "steps taken since the last): call it right after the step that ended an outer step"
            )
        if not self.started:
            await self.start()
        return await self.placement.admit(self, extra)

    async def close_joins(self) -> None:
        """Elastic: no boundary will admit workers any more (the loop is near its end; every live
        worker calls it, like ``admit_waiting``). Workers waiting to join, and any that ask later,
        raise at once, saying so, instead of waiting out their timeout."""
        if not self.elastic:
            raise RuntimeError("close_joins is for SyncSGD(elastic=True)")
        await self.placement.close_joins(self)

    async def start(self) -> dict[str, Any]:
        """Agree on the starting parameters (rank 0's, or a restored server's); returns them.

        Called by the first ``step`` if you do not; call it yourself before computing the
        first gradients so that they are taken at the agreed parameters.
        """
        if self.started:
            return self.params
        if getattr(self.group, "joining", False):  # a new worker of a running elastic job
            if not self.elastic:
                raise ValueError("a worker that joins a running job (join=True) needs SyncSGD(elastic=True)")
            await self.placement.join(self)
            if self.local is not None:  # local SGD: from the global parameters (and outer state) of the boundary
                self.local.begin(self.model.flat)
                self.local.inner_steps = self.step_count * self.local.every
            self.started = True
            self.params = self.model.views()
            return self.params
        await self._check_setup()
        loaded, self._loaded = self._loaded, None
        await self._start_tables()
        await self.placement.start(self, loaded)
        feedback, self._loaded_feedback = self._loaded_feedback, None
        if self.compressor is not None and feedback is not None:
            if len(feedback) == self.group.world_size:  # every rank's own error, as it was
                self.compressor.load(feedback[self.group.rank])
            else:
                logger.warning(
                    "%r: the checkpoint's error feedback is of %d ranks, this group has %d: it starts at zero",
                    self, len(feedback), self.group.world_size,
                )  # fmt: skip
        if self.local is not None:
            self.local.begin(self.model.flat)
            inner, self._loaded_inner = self._loaded_inner, None
            if inner is not None and len(inner) == self.group.world_size and not self.local.reset_inner:
                for st, saved in zip(self.local.state, inner[self.group.rank], strict=True):
                    for k, v in saved.items():
                        st[k][...] = np.asarray(v)
                for st, n in zip(self.local.state, self._loaded_inner_steps, strict=False):
                    st["step"] = n
        self.started = True
        self.params = self.model.views()
        return self.params

    async def _start_tables(self) -> None:
        """Every sparse table from rank 0: over the ring every rank takes a copy, over ps the shards
        take their row ranges and the workers drop theirs."""
        for k, name in enumerate(self.sparse):
            await self.placement.start_table(self, k, name)

    async def pull_rows(self, name: str, indices: Any) -> Any:
        """The current rows ``indices`` (any order, duplicates allowed) of sparse table ``name``:
        what the next batch needs. Over ps from the shards that hold them; over the ring a copy of
        this rank's. An index out of range: IndexError, naming it (nothing is sent)."""
        idx = self.model.row_ids(name, indices, "pull_rows")
        if not self.started:
            await self.start()
        return await self.placement.pull_rows(self, name, idx)

    def _accumulate_rows(self, rows: Mapping[str, SparseRows]) -> dict[str, SparseRows] | None:
        """accumulate=k: keep this micro-batch's rows; at the k-th, every micro-batch's rows summed in
        their order (merge_rows: the same bits on every topology) and divided by k, as the dense
        gradients are. None while the accumulation goes on."""
        for name, g in rows.items():
            self._acc_rows.setdefault(name, []).append((to_host(g.indices), to_host(g.values).copy()))
        if self._micro + 1 < self.accumulate:
            return None
        out = {}
        for name, parts in self._acc_rows.items():
            num_rows, width, dtype = self.model.table_shape[name]
            summed = merge_rows(parts, num_rows, width, np.dtype(dtype))
            values = summed.values / summed.values.dtype.type(self.accumulate)
            out[name] = SparseRows(like(self.xp, summed.indices), like(self.xp, values), num_rows)
        self._acc_rows = {}
        return out

    @property
    def state_dict_needs_every_rank(self) -> bool:
        """Whether :meth:`state_dict` gathers every rank's own state (local SGD's inner optimizers, a
        compressor's error feedback): then every rank must call it, not only the one that saves."""
        return self.local is not None or self.compressor is not None

    async def state_dict(self) -> dict[str, Any]:
        """A checkpoint: parameters, optimizer state and step, as host (numpy) arrays by parameter
        name, and the setup every rank agreed on. Over ps the optimizer state is read from the
        servers. Every rank returns the same; save rank 0's. Call it between steps."""
        if not self.started:
            await self.start()
        if self.accumulate > 1 and self._micro:
            raise RuntimeError("state_dict in the middle of an accumulation: call it after a step that exchanged")
        keys = self.optimizer.state_keys()
        per_bucket, step = await self.placement.state(self, keys)
        state = {k: self.model.by_name([b[k] for b in per_bucket]) for k in keys}
        out: dict[str, Any] = {
            "format": "psring.SyncSGD/1",
            "step": step,
            "setup": self.setup(),
            "params": self.model.by_name([to_host(f) for f in self.model.flat]),
            "optimizer_state": state,
        }
        if self.sparse:  # each table whole, and its rows' optimizer state (over ps, read from the shards)
            out["tables"] = {}
            for name in self.sparse:
                rows, table_state = await self.placement.table_state(self, name)
                out["tables"][name] = {"rows": rows, "state": table_state}
        if self.streaming is not None:
            raise RuntimeError(
                f"state_dict with fragments={self.streaming.count}: not yet (some fragment's exchange is always "
                "between its start and its step); checkpoint a local SGD run with fragments=1"
            )
        if self.local is not None:  # at a boundary local == global; every rank's inner state, by rank
            if self.local.since:
                raise RuntimeError(
                    f"state_dict between outer steps ({self.local.since} of {self.local.every} inner steps "
                    "taken): call it after a step that synchronised"
                )
            keys = self.local.inner.state_keys()
            inner_all = {(b, k): await self.group.all_gather(np.asarray(st[k]))
                        for b, st in enumerate(self.local.state) for k in keys}  # fmt: skip
            out["inner"] = [
                [{k: np.asarray(inner_all[(b, k)][r]) for k in keys} for b in range(len(self.local.state))]
                for r in range(self.group.world_size)
            ]
            out["inner_steps"] = self.local.inner_steps
            out["inner_state_steps"] = [int(st.get("step", 0)) for st in self.local.state]  # alike on every rank
        if self.compressor is not None:  # every rank's error feedback (each rank's own differs), by rank
            mine = self.compressor.state()
            gathered = [await self.group.all_gather(a) for a in mine]
            out["feedback"] = [[np.asarray(g[r]) for g in gathered] for r in range(self.group.world_size)]
        return out

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a checkpoint made by :meth:`state_dict` (every rank loads the same one),
        before :meth:`start`. Over ps, shards that already hold the parameters (alive, or restored
        from their own checkpoints) keep theirs, and their step wins."""
        if self.started:
            raise RuntimeError("load_state_dict must come before start() (or the first step)")
        if state.get("format") != "psring.SyncSGD/1":
            raise ValueError(f"not a SyncSGD checkpoint (format {state.get('format')!r})")
        mine = json.dumps(self.setup(), sort_keys=True, default=str)
        theirs = json.dumps(state.get("setup"), sort_keys=True, default=str)
        if mine != theirs:
            raise ValueError(
                "the checkpoint was made with another optimizer, compression, accumulation or parameter layout: "
                f"it has {theirs[:300]}, this has {mine[:300]}"
            )
        tables = state.get("tables") or {}
        if sorted(tables) != sorted(self.sparse):
            raise ValueError(f"the checkpoint has sparse tables {sorted(tables)}, this SyncSGD {sorted(self.sparse)}")
        keys = self.optimizer.state_keys()
        loaded_tables = {name: self.model.table_from(name, tables[name], keys) for name in self.sparse}
        params = state["params"]
        self.model.flat = [like(self.xp, np.asarray(f)) for f in self.model.host_flats(params)]
        per_key = {k: self.model.host_flats(v) for k, v in state["optimizer_state"].items()}
        buckets = [{k: per_key[k][b] for k in per_key} for b in range(len(self.buckets))]
        self._loaded = {"step": int(state["step"]), "state": buckets}
        self.step_count = int(state["step"])
        self._loaded_feedback = state.get("feedback") if self.compressor is not None else None
        if self.local is not None:
            self._loaded_inner = state.get("inner")
            self.local.inner_steps = int(state.get("inner_steps", 0))
            self._loaded_inner_steps = list(state.get("inner_state_steps") or [])
        for name, (rows, table_state) in loaded_tables.items():
            self.model.tables[name] = like(self.xp, rows)
            self.model.loaded_tables[name] = table_state
        self.params = self.model.views()

    def setup(self) -> dict[str, Any]:
        """What every rank must agree on: optimizer, compression, accumulation, parameter layout (and
        local SGD's inner optimizer and steps)."""
        out = {
            "optimizer": self.optimizer.config(),
            "compression": self.compression,
            "accumulate": self.accumulate,
            "buckets": self.model.layout(),
        }
        if self.local is not None:
            out["local"] = self.local.config()
        if self.streaming is not None:
            out["streaming"] = self.streaming.config()
        return out

    async def _check_setup(self) -> None:
        """One small all_gather: a rank set up differently fails at once on every rank, named."""
        # backup workers too (not in a checkpoint's setup: a run may resume with other backups)
        mine = json.dumps(
            {**self.setup(), "backup": self.backup, "sparse": self.model.table_shape}, sort_keys=True, default=str
        )
        digest = int.from_bytes(hashlib.sha256(mine.encode()).digest()[:8], "little", signed=True)
        digests = await self.group.all_gather(np.array([digest], np.int64))
        differ = [r for r, d in enumerate(digests) if int(d[0]) != int(digests[0][0])]
        if differ:
            shown = mine if len(mine) < 400 else mine[:397] + "..."
            raise MismatchError(
                f"SyncSGD: rank(s) {', '.join(map(str, differ))} set up a different optimizer, compression, "
                f"accumulate, backup or parameter layout than rank 0 (this is rank {self.group.rank}: {shown})"
            )

    async def step(self, grads: Mapping[str, Any], prefetch: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """Average grads over the group, apply the optimizer; returns the new parameters.

        ``prefetch``: sparse table name -> the row indices the next ``pull_rows`` of that table will
        ask for (the next batch's). Over ps they come back with this step's answer from the shards,
        read after its update, and that ``pull_rows`` returns them without asking again (one round
        trip a step saved; the same rows a pull after the step reads). Over the ring it changes
        nothing (``pull_rows`` reads this rank's own copy).

        With ``accumulate=k`` the gradients of k calls are summed locally and exchanged
        once, divided by k (so the step equals one over a k-times larger batch and the
        learning rate needs no change); the k-1 calls in between return the unchanged
        parameters.
        """
        wanted = {name: self.model.row_ids(name, ids, "step(prefetch)") for name, ids in (prefetch or {}).items()}
        self.model.prefetched.clear()  # rows from before this step are no longer current
        if not self.started:
            await self.start()
        names = self.model.names
        missing = [n for n in [*names, *self.sparse] if n not in grads]
        extra = [n for n in grads if n not in names and n not in self.model.table_shape]
        if missing or extra:
            raise KeyError(f"grads must have exactly the parameters' names: missing {missing}, unexpected {extra}")
        # local SGD's inner step updates its copy from the gradients where they lie (no bucket copy)
        flats: list[Any] = (
            self.model.pieces(grads) if self.local is not None and self.accumulate == 1 else self.model.flats(grads)
        )
        rows = self.model.rows_of(grads) if self.sparse else {}
        if self.accumulate > 1 and self.sparse:
            summed = self._accumulate_rows(rows)
            rows = summed if summed is not None else rows
        if self.accumulate > 1:
            if self._acc is None:
                self._acc = flats
            else:
                for acc, f in zip(self._acc, flats, strict=True):
                    acc += f
            self._micro += 1
            if self._micro < self.accumulate:
                return self.params
            flats = [acc / acc.dtype.type(self.accumulate) for acc in self._acc]
            self._acc, self._micro = None, 0
        if self.local is not None and self.streaming is not None:  # an inner step; a fragment lands or starts
            self.local.step(flats)
            await self._stream(self.local.inner_steps)
            self.params = self.model.views(self.local.local)
            return self.params
        if self.local is not None:  # an inner step; every H of them the pseudo-gradients' outer step
            if not self.local.step(flats):
                self.params = self.model.views(self.local.local)
                return self.params
            flats = self.local.pseudo(self.model.flat)
        t0 = time.perf_counter()
        # the exchange and the update, the sparse tables' too (each table's rows summed over the
        # workers in rank order, divided by their number, the optimizer run on those rows only)
        t1, t2 = await self.placement.step(self, flats, rows, wanted)
        self.last_timing = {"exchange_s": t1 - t0, "update_s": t2 - t1}
        self.waited_s += t1 - t0
        self.step_count += 1
        if self.local is not None:
            await self._compare_global()
            self.local.synced(self.model.flat)
        self.params = self.model.views()
        return self.params

    async def _stream(self, t: int) -> None:
        """Streaming local SGD after inner step t: the exchange due now is applied (waited for if it has
        not landed), then the fragment due now starts its exchange, which runs on as a task."""
        s, local = self.streaming, self.local
        assert s is not None and local is not None
        t0 = time.perf_counter()
        if s.flight is not None and s.flight.due <= t:
            await s.land(self._apply_fragment)
        i = s.starting(t)
        if i is not None and s.flight is not None:  # (the schedule keeps one in flight at most; were it late, wait)
            await s.land(self._apply_fragment)
        self.waited_s += time.perf_counter() - t0
        if i is None:
            return
        ids = s.buckets_of[i]
        snaps = [local.local[b].copy() for b in ids]
        pseudo = [self.model.flat[b] - local.local[b] for b in ids]
        s.launch(i, t, snaps, self._fragment_round(ids, pseudo, s.rounds[i]))
        await asyncio.sleep(0)  # the exchange takes its first step (its collectives start) before compute

    async def _fragment_round(self, ids: list[int], pseudo: list[Any], round_: int) -> list[int]:
        """A fragment's exchange (in its task): the average and the outer step, then every rank's digest
        of its global state (the comparison travels with the exchange, not at the step it lands)."""
        await self.placement.fragment_step(self, ids, pseudo, round_)
        return await self._global_digests()

    async def _apply_fragment(self, flight: Flight) -> None:
        """A fragment's outer step landed: the digests the ranks exchanged with it are judged (a forked
        rank repaired, or the job stopped), and the local copies of the fragment become the new global
        parameters plus the inner steps taken meanwhile."""
        local, s = self.local, self.streaming
        assert local is not None and s is not None
        self.step_count += 1
        await self._judge_digests(flight.task.result())
        for b, snap in zip(s.buckets_of[flight.fragment], flight.snaps, strict=True):
            local.local[b][...] = self.model.flat[b] + (local.local[b] - snap)
            if local.reset_inner:
                local.state[b] = local.inner.init_state(local.local[b])

    async def global_params(self) -> dict[str, Any]:
        """The global parameters (the same bits on every rank), once no exchange is in flight: with local
        SGD what the last outer steps made (``params`` are this rank's local copy between outer steps);
        with fragments, waiting for the exchange in flight to land (its step on the local copies still
        comes at its due step). Without local SGD, ``params``."""
        if not self.started:
            await self.start()
        if self.streaming is not None:
            await self.streaming.settle()
        return self.model.views()

    async def _compare_global(self) -> None:
        """Local SGD, after each outer step: the ranks compare a digest of their global parameters and
        outer state (one 8-byte all_gather). A rank that differs from the majority is named and takes
        the majority's state from its lowest rank; with no majority the job stops, naming every rank's.

        Elastic: a rank lost during the comparison ends it on the survivors unjudged (some may have
        completed it, so none redoes it); their states are alike, as the step they just took was, and
        the next outer step compares them again, among the survivors."""
        try:
            digests = await self._global_digests()
        except (PeerLostError, CollectiveTimeoutError) as exc:
            if not self.elastic:
                raise
            logger.warning("%r: elastic: the comparison after outer step %d lost a rank (%s); the next outer "
                           "step compares again among the survivors", self, self.step_count, exc)  # fmt: skip
            return
        await self._judge_digests(digests)

    async def _global_digests(self) -> list[int]:
        """Every rank's digest of its global parameters and outer state (one 8-byte all_gather)."""
        h = hashlib.sha256()
        for flat in self.model.flat:  # (hashed in place: no copy of the model)
            h.update(byte_view(np.ascontiguousarray(to_host(flat))))
        if not self.placement.holds_model:  # the outer state too where every rank holds it (over ps: the shards)
            for state in self.model.state:
                for key in sorted(state):
                    h.update(key.encode())
                    h.update(byte_view(np.ascontiguousarray(to_host(state[key]))))
        digest = int.from_bytes(h.digest()[:8], "little", signed=True)
        group = self.placement.live_group(self)
        return [int(d[0]) for d in await group.all_gather(np.array([digest], np.int64))]

    async def _judge_digests(self, digests: list[int]) -> None:
        """All alike: nothing. Else the ranks that differ from the majority take its state; no majority:
        MismatchError naming every rank's digest."""
        group = self.placement.live_group(self)
        if len(set(digests)) == 1:
            return
        counts = {d: digests.count(d) for d in digests}
        best = max(counts.values())
        if list(counts.values()).count(best) > 1:
            raise MismatchError(
                f"SyncSGD: after outer step {self.step_count} the ranks' global parameters differ with no "
                f"majority (digests by rank: {digests}); the job stops rather than train on forked state"
            )
        good = next(d for d, c in counts.items() if c == best)
        src = digests.index(good)
        bad = [r for r, d in enumerate(digests) if d != good]
        logger.warning("%r: after outer step %d rank(s) %s held other global parameters than the others: "
                       "repaired from rank %d", self, self.step_count, bad, src)  # fmt: skip
        self.repaired += len(bad)
        for flat in self.model.flat:
            flat[...] = await group.broadcast(flat, src=src)
        if not self.placement.holds_model:
            for state in self.model.state:
                for key in sorted(state):
                    if key == "step":
                        continue
                    state[key][...] = await group.broadcast(state[key], src=src)


class BlockingSyncSGD:
    """SyncSGD for the blocking facade: ``params = opt.step(grads)``."""

    def __init__(self, group: Any, params: Mapping[str, Any], optimizer: Optimizer | None = None, **kwargs: Any):
        self._portal = group.portal
        self._group = group
        self._inner = SyncSGD(group.group, params, optimizer, **kwargs)

    @property
    def params(self) -> dict[str, Any]:
        return self._inner.params

    @property
    def step_count(self) -> int:
        return self._inner.step_count

    @property
    def members(self) -> list[int]:
        return self._inner.members

    @property
    def backup(self) -> int:
        return self._inner.backup

    @property
    def waited_s(self) -> float:
        return self._inner.waited_s

    @property
    def skipped(self) -> int:
        return self._inner.skipped

    @property
    def batches_done(self) -> int:
        return self._inner.batches_done

    @property
    def joined_with(self) -> dict[str, Any] | None:
        return self._inner.joined_with

    @property
    def joined_at(self) -> int | None:
        return self._inner.joined_at

    def live_group(self) -> BlockingGroup:
        group = self._inner.live_group()
        return self._group if group is self._group.group else BlockingGroup(group, self._portal, owns_portal=False)

    def admit_waiting(self, extra: dict[str, Any] | None = None) -> list[int]:
        return self._portal.call(self._inner.admit_waiting(extra))

    def close_joins(self) -> None:
        self._portal.call(self._inner.close_joins())

    def start(self) -> dict[str, Any]:
        return self._portal.call(self._inner.start())

    def global_params(self) -> dict[str, Any]:
        return self._portal.call(self._inner.global_params())

    def step(self, grads: Mapping[str, Any], prefetch: Mapping[str, Any] | None = None) -> dict[str, Any]:
        return self._portal.call(self._inner.step(grads, prefetch))

    def pull_rows(self, name: str, indices: Any) -> Any:
        return self._portal.call(self._inner.pull_rows(name, indices))

    def state_dict(self) -> dict[str, Any]:
        return self._portal.call(self._inner.state_dict())

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self._inner.load_state_dict(state)


def check_sparse(params: Mapping[str, Any], sparse: list[str], optimizer: Any) -> None:
    """ValueError naming what SyncSGD(sparse=...) cannot take: a name that is no parameter, a table that
    is not 2-D floating, weight decay.
    Compression applies to the dense buckets only (a table's rows travel as they are)."""
    for name in sparse:
        if name not in params:
            raise ValueError(f"sparse={sparse!r}: {name!r} is not one of the parameters {sorted(params)}")
        v = params[name]
        if getattr(v, "ndim", 0) != 2 or np.dtype(v.dtype).kind != "f":
            raise ValueError(f"sparse table {name!r} must be a 2-D floating array (rows x width), got "
                             f"{getattr(v, 'dtype', type(v).__name__)} {getattr(v, 'shape', '')}")  # fmt: skip
    decay = float(getattr(optimizer, "weight_decay", 0.0)) if optimizer is not None else 0.0
    if sparse and decay:
        raise ValueError(
            "sparse tables take no weight_decay: it would decay every row each step, which a sparse update "
            "does not touch (torch's SparseAdam has none either)"
        )


__all__ = ["BlockingSyncSGD", "SyncSGD", "make_buckets"]
