"""The worker's side of parameter mode (SyncSGD over ps): the shards hold the parameters and the
optimizer state; workers push gradients and pull the new parameters, re-sending after a shard restart.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from ....core import wire
from ....core.arrays import byte_view
from ....core.codec import Codec, codec_named
from ....core.fold import pieces
from ....errors import CollectiveTimeoutError, PeerLostError, ProtocolError, PsringError
from .. import frames
from ..plan import per_piece, plan
from ..rows import pack_by_shard, row_range
from .admission import Admission

if TYPE_CHECKING:
    from .view import WorkerGroup

logger = logging.getLogger(__name__)

def _note_arrived(got: set[tuple[Any, ...]], tag: tuple[Any, ...], fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        got.add(tag)


class ParameterClient:
    """A PsGroup's parameter mode (SyncSGD over ps): parameters and optimizer state on the shards,
    gradients pushed and parameters pulled by piece; the group holds one (``group.params``)."""

    def __init__(self, g: WorkerGroup) -> None:
        self.g = g
        self._state_requests = 0
        #: an elastic job's membership: joining, admitting at boundaries, the live workers' group
        self.admission = Admission(g, self)

    def layout(self, b: int, flat: np.ndarray) -> list[tuple[int, int, list[tuple[int, int]]]]:
        step = per_piece(flat.itemsize, self.g.links.config.ps_piece)
        return [
            (s, a, pieces(a, z, step))
            for s, a, z in plan("all_reduce", flat.size, flat.itemsize, self.g.num_servers, b, self.g.links.weights)
        ]

    async def init(
        self,
        buckets: list[np.ndarray],
        optimizer: dict[str, Any],
        step: int | None = None,
        state: list[dict[str, np.ndarray]] | None = None,
    ) -> tuple[list[np.ndarray], int]:
        """Rank 0 offers its parameters; every rank then pulls what the shards hold (and their step).

        A resumed run (``step`` and, per bucket, the optimizer ``state`` of a checkpoint) offers
        those too: shards that hold nothing yet take them; shards that already hold the bucket
        (alive, or restored from their own checkpoints) keep theirs.
        """
        self.g.check_usable()
        if self.g.gid != "0":
            raise ValueError("parameter mode runs on the main group, not a subgroup")
        if self.g.rank == 0:
            for b, flat in enumerate(buckets):
                for shard, _a, parts in self.layout(b, flat):
                    conn = self.g.links.shards[shard]
                    base: dict[str, Any] = {
                        "n": flat.size,
                        "dtype": wire.tensor_fields(flat)["dtype"],
                        "size": self.g.world_size,
                        "optimizer": optimizer,
                        "elastic": self.g.elastic,
                    }
                    if self.g.backup:
                        base["backup"] = self.g.backup
                    if self.g.links.weights:
                        base["weights"] = list(self.g.links.weights)
                    if step is not None and state is not None:
                        base.update(step=step, state_keys=sorted(state[b]))
                    if not parts:
                        conn.send_frame(frames.init(b, -1, **base))
                    for j, (pa, pb) in enumerate(parts):
                        conn.send_tensor(frames.init(b, j, **base), flat[pa:pb])
                    if step is not None and state is not None:
                        for key in sorted(state[b]):
                            for j, (pa, pb) in enumerate(parts):
                                conn.send_tensor(frames.init_state(b, j, key), state[b][key][pa:pb])
        if self.g.elastic and self.g.rank == 0:  # new workers may join it (init_group(join=True))
            await self.g.links.store.set(f"{self.g.links.prefix}/elastic", b"1")
        outs, steps = await self.pull_all(buckets, "pulling the initial parameters")
        if len(set(steps)) > 1:
            raise PsringError(f"server shards hold parameters of different steps {sorted(set(steps))}")
        return outs, (steps[0] if steps else 0)

    async def pull_all(self, buckets: list[np.ndarray], what: str) -> tuple[list[np.ndarray], list[int]]:
        """What the shards hold of every bucket, and the step of each (shard, bucket) with a slice."""
        outs = [np.empty_like(flat) for flat in buckets]
        steps: list[int] = []

        async def pull(b: int, shard: int, parts: list[tuple[int, int]]) -> None:
            futs = [
                self.g.mailbox.expect(frames.pull_tag(b, shard, j), byte_view(outs[b][pa:pb]) if pb > pa else None)
                for j, (pa, pb) in enumerate(parts)
            ]
            marker = self.g.mailbox.expect(frames.pulled_tag(b, shard))
            self.g.links.shards[shard].send_frame(frames.pull(b, self.g.rank))
            for fut in futs:
                _c, hdr, payload = await fut
                if payload is not None and hdr["nbytes"] and not _same(payload, outs[b]):
                    raise ProtocolError("parameter piece did not land in place")
            _c, hdr, _p = await marker
            if parts:
                steps.append(int(hdr["step"]))

        jobs = [
            pull(b, shard, parts) for b, flat in enumerate(buckets) for shard, _a, parts in self.layout(b, flat)
        ]
        await self.wait(asyncio.gather(*jobs), what)
        return outs, steps

    async def state(self, buckets: list[np.ndarray], keys: list[str]) -> tuple[list[dict[str, np.ndarray]], int]:
        """The optimizer state the shards hold (``keys`` of it, per bucket, as flat arrays shaped
        like the buckets), and their step: what a worker-side checkpoint of a ps run needs. Asks
        again after a server restart, as a step re-sends."""
        deadline = time.monotonic() + self.g.timeout
        while True:
            try:
                lost = self.g.links.lost
                if isinstance(lost, PeerLostError) and lost.rank is None:
                    raise lost  # a server went away: reconnect first
                self.g.check_usable()
                return await self._param_state_once(buckets, keys)
            except PeerLostError as exc:
                if exc.rank is not None or not self.g.links.reconnect_servers:
                    raise
                logger.warning("%r: %s; reconnecting to read the optimizer state again", self.g, exc)
                await self.g.links.reconnect(deadline)
                self.g.mend()

    async def _param_state_once(
        self, buckets: list[np.ndarray], keys: list[str]
    ) -> tuple[list[dict[str, np.ndarray]], int]:
        outs = [{k: np.empty_like(flat) for k in keys} for flat in buckets]
        steps: list[int] = []
        # each request is numbered and the shards echo the number in their answers' tags, so an
        # answer to a try cut short by a server restart can never pass for one to this try
        self._state_requests = req = self._state_requests + 1

        async def fetch(b: int, shard: int, parts: list[tuple[int, int]]) -> None:
            tags = [
                (frames.state_tag(b, shard, k, j, req), outs[b][k][pa:pb])
                for k in keys
                for j, (pa, pb) in enumerate(parts)
            ]
            futs = [self.g.mailbox.expect(tag, byte_view(dest) if dest.size else None) for tag, dest in tags]
            marker = self.g.mailbox.expect(frames.stated_tag(b, shard, req))
            self.g.links.shards[shard].send_frame(frames.state_request(b, self.g.rank, req))
            try:
                for fut in futs:
                    await fut
                _c, hdr, _p = await marker
            finally:  # cut short (a server lost): nothing stays posted for answers that will not come
                for tag, _dest in tags:
                    self.g.mailbox.unpost(tag)
                self.g.mailbox.unpost(frames.stated_tag(b, shard, req))
            if sorted(hdr.get("keys") or []) != sorted(keys):
                raise ProtocolError(f"server shard {shard} holds optimizer state {hdr.get('keys')}, expected {keys}")
            steps.append(int(hdr["step"]))

        jobs = [fetch(b, s, parts) for b, flat in enumerate(buckets) for s, _a, parts in self.layout(b, flat)]
        await self.wait(asyncio.gather(*jobs), "reading the optimizer state")
        if len(set(steps)) > 1:
            raise PsringError(f"server shards hold parameters of different steps {sorted(set(steps))}")
        return outs, (steps[0] if steps else 0)

    async def step(
        self,
        t: int,
        grads: list[np.ndarray],
        outs: list[np.ndarray],
        compression: str | Codec | None = None,
        buckets: list[int] | None = None,
    ) -> int:
        """Push step t's gradients; the new parameters land in outs. Re-sends after a server restart.

        ``buckets``: the bucket each of ``grads`` is (default: all, in order). Streaming local SGD pushes
        one fragment's buckets at a time, each bucket at its own step on the shards.

        With ``compression`` (a codec or its name) the gradients travel encoded at a scale the
        workers agree on first, exactly as a compressed all_reduce does (psring.core.codec).

        Returns the steps taken: 1, or with backup workers more when this worker was behind (the
        shards completed later steps without it, and their results are here already: outs holds
        the newest, and this worker skips the steps in between instead of computing them).
        """
        wire_grads: list[tuple[np.ndarray, Any]] = [(g, None) for g in grads]
        codec = codec_named(compression)
        if codec is not None:
            for g in grads:
                codec.check(g.dtype, "avg")
            exps: list[Any] = [0] * len(grads)
            if codec.scaled:  # the workers agree on each bucket's scale first, in one max all_reduce
                mine = [codec.amax(g.reshape(-1)) for g in grads]
                agreed = await self._agreed_max(np.concatenate(mine) if mine else np.zeros(0, np.float32))
                cuts = np.cumsum([m.size for m in mine])[:-1]
                exps = [codec.scale(a, self.g.world_size) for a in np.split(agreed, cuts)]
            wire_grads = [(codec.encode(g, e), e) for g, e in zip(grads, exps, strict=True)]
        got: set[tuple[Any, ...]] = set()
        deadline = time.monotonic() + self.g.timeout
        resend = False
        while True:
            try:
                lost = self.g.links.lost
                if isinstance(lost, PeerLostError) and lost.rank is None:
                    raise lost  # a server went away since the last step: reconnect first
                self.g.check_usable()
                await self._param_round(t, grads, wire_grads, outs, got, deadline, resend, codec, buckets)
                return 1 + self._catch_up(t, grads, outs) if self.g.backup else 1
            except PeerLostError as exc:
                if exc.rank is not None or not self.g.links.reconnect_servers:
                    raise
                logger.warning("%r: %s; reconnecting to re-send step %d", self.g, exc, t)
                await self.g.links.reconnect(deadline)
                self.g.mend()
                resend = True

    async def _agreed_max(self, amax: np.ndarray) -> np.ndarray:
        """The max over the workers of each bucket's amax (compression's scale). Elastic: over the live
        workers; a worker lost meanwhile fails it on every survivor alike (the shards say who), and
        they agree again without it -- the step's pushes then go to shards that dropped it too."""
        if not self.g.elastic:
            return await self.g.all_reduce(amax, op="max")
        while True:
            try:
                return await self.admission.live_subgroup().all_reduce(amax, op="max")
            except PeerLostError as exc:
                me = self.g.members[self.g.rank]
                if type(exc.rank) is not int or exc.rank not in self.g.members or exc.rank == me:
                    raise  # a server shard (its own recovery), or not a worker of this job
                if exc.rank in self.g.live_members:
                    self.g.live_members = [m for m in self.g.live_members if m != exc.rank]
                    logger.warning(
                        "%r: elastic: worker %d left as the workers agreed on compression's scale; %d go on",
                        self.g, exc.rank, len(self.g.live_members),
                    )  # fmt: skip
                # else: the shards abandoned this call for a loss already dropped here (they fail it on
                # every survivor, a late one too), so every survivor agrees again, numbered alike

    def result_tags(self, t: int, grads: list[np.ndarray]) -> list[tuple[tuple[Any, ...], int, int, int]]:
        """(tag, bucket, start, end) of every result piece of step t."""
        return [
            (frames.result_tag(b, t, shard, j), b, pa, pb)
            for b, flat in enumerate(grads)
            for shard, _a, parts in self.layout(b, flat)
            for j, (pa, pb) in enumerate(parts)
        ]

    def _catch_up(self, t: int, grads: list[np.ndarray], outs: list[np.ndarray]) -> int:
        """Backup workers: the steps after t whose every result piece is here already (the others
        completed them without this worker); take the newest into outs, skip them. Returns how many."""
        skipped = 0
        while True:
            tags = self.result_tags(t + skipped + 1, grads)
            if not tags or not all(self.g.mailbox.is_queued(tag) for tag, *_ in tags):
                break
            for tag, b, pa, pb in tags:  # each step's pieces in turn (the last one's stay in outs)
                fut = self.g.mailbox.expect(tag, byte_view(outs[b][pa:pb]))
                assert fut.done()
            skipped += 1
        if skipped:
            self.g.backup_skipped += skipped
            logger.info("%r: behind by %d step(s): skipped to step %d", self.g, skipped, t + skipped + 1)
        return skipped

    async def _param_round(
        self,
        t: int,
        grads: list[np.ndarray],
        wire_grads: list[tuple[np.ndarray, Any]],
        outs: list[np.ndarray],
        got: set[tuple[Any, ...]],
        deadline: float,
        resend: bool = False,
        codec: Codec | None = None,
        buckets: list[int] | None = None,
    ) -> None:
        ids = list(range(len(grads))) if buckets is None else buckets
        futs = []
        if self.g.links.share_memory_pending() and any(
            g.nbytes >= self.g.links.config.ps_shm_min for g, _e in wire_grads
        ):
            await self.g.links.share_memory()
        for i, flat in enumerate(grads):
            b = ids[i]
            sent, e = wire_grads[i]
            # (after a reconnect, resend: a piece applied already is answered, not dropped as late)
            assert e is None or codec is not None
            push = frames.push(self.g.rank, codec.name if e is not None and codec is not None else None, resend)
            for shard, _a, parts in self.layout(b, flat):
                conn = self.g.links.shards[shard]
                for j, (pa, pb) in enumerate(parts):
                    tag = frames.result_tag(b, t, shard, j)
                    if tag in got:
                        continue
                    self.g.mailbox.unpost(tag)
                    fut = self.g.mailbox.expect(tag, byte_view(outs[i][pa:pb]))
                    fut.add_done_callback(functools.partial(_note_arrived, got, tag))
                    if self.g.elastic:
                        fut.add_done_callback(self._note_members)
                    futs.append(fut)
                    piece = sent[pa:pb]
                    shared = piece.nbytes >= self.g.links.config.ps_shm_min and conn.shm.peer_maps_pool
                    if shared:
                        await self.g.links.slot_for(("param", t))
                    header = frames.push_piece(push, b, t, j)
                    if e is not None:
                        assert codec is not None
                        header["scale"] = codec.wire_scale(e, pa, pb)  # what the shard decodes the piece's fold with
                    conn.send_tensor(header, piece, shared=shared, owner=("param", t))
        await self.wait(asyncio.gather(*futs), f"step {t}", deadline)
        # backup workers: a step whose results did not take this worker's pushes (it came late)
        if self.g.backup and any(self.g.rank not in f.result()[1].get("folded", (self.g.rank,)) for f in futs):
            self.g.backup_dropped += 1

    def _note_members(self, fut: asyncio.Future[Any]) -> None:
        """Elastic: the workers a shard averaged a piece over; the live workers are those every
        piece of the step was averaged over (every worker sees the same results, so the same set)."""
        if fut.cancelled() or fut.exception() is not None:
            return
        members = fut.result()[1].get("members")
        if isinstance(members, (list, tuple)):  # msgpack gives tuples
            live = set(members) & set(self.g.live_members)
            if live != set(self.g.live_members):
                gone = sorted(set(self.g.live_members) - live)
                logger.warning(
                    "%r: elastic: worker(s) %s left; %d go on (results now depend on membership)",
                    self.g, gone, len(live),
                )  # fmt: skip
                self.g.live_members = sorted(live)

    async def wait(self, work: Any, what: str, deadline: float | None = None) -> None:
        lost = self.g.links.loss_future()
        broken = self.g.watch_broken()  # a worker was lost
        remaining = (deadline or time.monotonic() + self.g.timeout) - time.monotonic()
        try:
            done, _ = await asyncio.wait(
                {work, lost, broken}, timeout=max(remaining, 0), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            self.g.unwatch_broken(broken)
            if not lost.done():
                lost.cancel()
        if work in done:
            work.result()
            return
        work.cancel()
        with contextlib.suppress(BaseException):  # cancelled by us: the loss is what we raise
            await work
        if lost in done:
            raise lost.exception() or PeerLostError("a server shard was lost")
        why = self.g.broken_error
        if broken in done and isinstance(why, PeerLostError):
            lost_rank = why.rank if why.rank is not None else -1  # a worker, not a server
            raise PeerLostError(f"{self.g!r}: {why} (during {what})", rank=lost_rank) from why
        raise CollectiveTimeoutError(
            f"rank {self.g.rank}: the servers did not answer {what} within {self.g.timeout:g}s"
        )


def _same(payload: Any, out: np.ndarray) -> bool:
    try:
        return bool(np.shares_memory(np.frombuffer(payload, np.uint8), out))
    except (TypeError, ValueError):
        return False


#: rank 0 waits for the kernel to take a sparse table's initial rows once this much is queued to a shard
INIT_QUEUE = 64 << 20


class SparseTables:
    """A PsGroup's sparse tables that live on the shards (SyncSGD(..., sparse=[...]) over ps; the shard
    side is ``tables``); the group holds one (``group.tables``)."""

    def __init__(self, g: WorkerGroup, params: ParameterClient) -> None:
        self.g = g
        #: the group's parameter client: its waits (a lost shard or worker ends them) serve the tables too
        self.params = params
        self._pull_requests = 0
        #: table -> the step of it this worker pushes next: with backup workers the steps before one it
        #: pushes were taken without it (it skipped them), and their answers are taken off the mailbox
        self.next_step: dict[int, int] = {}

    def _shard_rows(self, num_rows: int) -> list[tuple[int, int]]:
        return [row_range(num_rows, self.g.num_servers, s) for s in range(self.g.num_servers)]

    async def init(self, k: int, table: np.ndarray | None, num_rows: int, width: int, dtype: str,
                   optimizer: dict[str, Any], step: int = 0,
                   state: dict[str, np.ndarray] | None = None) -> None:  # fmt: skip
        """Rank 0 hands each shard its rows of table k (``table``; None elsewhere) and, resuming from a
        checkpoint, their optimizer ``state`` (by key) at the table's ``step``; every rank then waits
        until every shard holds them (an empty pull each)."""
        if self.g.rank == 0:
            assert table is not None
            state = state or {}
            per = max(1, self.g.links.config.ps_piece // max(width * table.itemsize, 1))
            for s, (a, b) in enumerate(self._shard_rows(num_rows)):
                conn = self.g.links.shards[s]
                base = frames.sp_init(
                    k, num_rows=num_rows, width=width, dtype=dtype, size=self.g.world_size, optimizer=optimizer,
                    step=step, state_keys=sorted(state), elastic=self.g.elastic, backup=self.g.backup,
                )
                for of, rows in [(None, table), *sorted(state.items())]:
                    for first in range(a, max(b, a + 1), per):
                        count = max(0, min(per, b - first))
                        part = rows[first : first + count]
                        conn.send_tensor({**base, "of": of, "first": first, "count": count}, part)
                        transport = conn.transport
                        if transport is not None and transport.get_write_buffer_size() > INIT_QUEUE:
                            await conn.flush()  # not the whole table queued in a second copy (a 4 GiB one: 8 GiB)
        await self.pull(k, np.empty(0, np.int64), num_rows, width, np.dtype(dtype))
        self.next_step[k] = step

    def joined(self, k: int, at: int) -> None:
        """A new worker takes part in table k from step ``at`` (the boundary that admitted it)."""
        self.next_step[k] = at

    async def step(
        self,
        k: int,
        t: int,
        indices: np.ndarray,
        values: np.ndarray,
        num_rows: int,
        bad: bool = False,
        pull: np.ndarray | None = None,
    ) -> tuple[list[int], np.ndarray | None]:
        """Push step t's rows of table k (each shard its range, empty where none) and wait until
        every shard applied the step. ``bad``: this rank's rows are not fit to apply (an index out
        of range): every shard hears every rank's word with its push and applies nothing if any
        said so. ``pull``: int64 row indices (in range) that come back with the shards' answers,
        read after the update (a pull saved). Returns the ranks that said bad (the same list on
        every rank; empty: applied) and the pulled rows (None when bad or not asked)."""
        for skipped in range(self.next_step.get(k, t), t):  # taken without this worker: answered all the same
            done = [self.g.mailbox.expect(frames.sp_done_tag(k, s, skipped)) for s in range(self.g.num_servers)]
            await self.params.wait(asyncio.gather(*done), f"sparse table {k}'s step {skipped}")
        self.next_step[k] = t + 1
        futs = []
        if bad:  # nothing will be applied: every shard gets the word and no rows
            indices, values, pull = indices[:0], values[:0], None
        wheres = pulls = None
        if pull is not None:
            wheres = [np.nonzero((pull >= a) & (pull < b))[0] for a, b in self._shard_rows(num_rows)]
            pulls = [pull[w] for w in wheres]
        packed = pack_by_shard(indices.astype(np.int64, copy=False), values, num_rows, self.g.num_servers, pulls)
        for s, (count, payload) in enumerate(packed):
            futs.append(self.g.mailbox.expect(frames.sp_done_tag(k, s, t)))
            header = frames.sp_push(
                k, t, self.g.rank, count, bool(bad), int(pulls[s].size) if pulls is not None else None
            )
            self.g.links.shards[s].send_tensor(header, payload)
        await self.params.wait(asyncio.gather(*futs), f"sparse table {k}'s step {t}")
        said = [int(r) for r in futs[0].result()[1].get("bad") or []]
        if said or pull is None or wheres is None:
            return said, None
        if any(w.size and "pull" not in f.result()[1] for f, w in zip(futs, wheres, strict=True)):
            return said, None  # backup workers: the step was taken without this push (its rows asked again)
        width = values.shape[1]
        out = np.empty((pull.size, width), values.dtype)
        for fut, where in zip(futs, wheres, strict=True):
            _c, hdr, payload = fut.result()
            size = where.size * width * out.itemsize
            if hdr.get("pull", 0) != where.size or (where.size and hdr.get("nbytes") != size):
                raise ProtocolError(f"sparse table {k}: a shard answered step {t} with {hdr.get('pull')!r} rows, "
                                    f"asked for {where.size}")  # fmt: skip
            if where.size:
                out[where] = np.frombuffer(payload, values.dtype).reshape(-1, width)
        return said, out

    async def pull(
        self, k: int, indices: np.ndarray, num_rows: int, width: int, dtype: np.dtype, of: str | None = None
    ) -> np.ndarray:
        """The current rows ``indices`` of table k, in that order (duplicates allowed); ``of``: those rows
        of the optimizer's state ``of`` instead (a checkpoint's)."""
        self._pull_requests = req = self._pull_requests + 1
        out = np.empty((indices.size, width), dtype)
        jobs = []
        for s, (a, b) in enumerate(self._shard_rows(num_rows)):
            where = np.nonzero((indices >= a) & (indices < b))[0]
            if where.size == 0 and indices.size:
                continue
            tag = frames.sp_rows_tag(k, s, req)
            fut = self.g.mailbox.expect(tag)
            header = frames.sp_pull(k, req, int(where.size), of)
            self.g.links.shards[s].send_tensor(header, indices[where].astype(np.int64))
            jobs.append((fut, where))

        async def land() -> None:
            for fut, where in jobs:
                _c, hdr, payload = await fut
                rows = np.frombuffer(payload, dtype).reshape(-1, width) if hdr["nbytes"] else None
                if where.size:
                    if rows is None or rows.shape[0] != where.size:
                        raise ProtocolError(
                            f"sparse table {k}: a shard sent {hdr['nbytes']} bytes for {where.size} rows"
                        )
                    out[where] = rows

        try:
            await self.params.wait(asyncio.ensure_future(land()), f"pulling rows of sparse table {k}")
        finally:  # cut short: nothing stays posted for answers that will not come
            for s in range(self.g.num_servers):
                self.g.mailbox.unpost(frames.sp_rows_tag(k, s, req))
        return out
