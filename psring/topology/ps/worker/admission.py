"""An elastic ps job's membership, on the worker side: a new worker waits until a boundary admits it and
takes the shards' parameters of that step (``join``); the live workers admit the waiting ones at a boundary
(``admit``) and close joins as the job nears its end (``close_joins``); the group of the live workers
(``live_subgroup``). The parameters move through :class:`~psring.topology.ps.worker.params.ParameterClient`.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from ....errors import CollectiveTimeoutError, PeerLostError, PsringError
from .. import frames
from ..plan import live_gid

if TYPE_CHECKING:
    from .view import WorkerGroup


class Params(Protocol):
    """What admission needs of the group's parameter client (ps.worker.params.ParameterClient)."""

    async def pull_all(self, buckets: list[np.ndarray], what: str) -> tuple[list[np.ndarray], list[int]]: ...

    def result_tags(self, t: int, grads: list[np.ndarray]) -> list[tuple[tuple[Any, ...], int, int, int]]: ...

    def layout(self, b: int, flat: np.ndarray) -> list[tuple[int, int, list[tuple[int, int]]]]: ...

logger = logging.getLogger(__name__)

#: a worker waiting to join looks this often whether the job closed joins (SyncSGD.close_joins)
JOIN_LOOK_S = 1.0
#: the most workers one boundary admits (the rest wait for the next)
MAX_JOINERS = 64


def joins_closed_key(prefix: str) -> str:
    """The store key an elastic job's loop sets when it admits no more workers (SyncSGD.close_joins)."""
    return f"{prefix}/join/closed"


def joins_closed(value: bytes) -> str:
    """What a worker that asks to join is told once joins are closed (``value``: the key's)."""
    step = json.loads(value).get("step")
    return (
        f"admits no more workers (its loop closed joins at step {step}: SyncSGD.close_joins, as the job nears its end)"
    )


class Admission:
    """A PsGroup's elastic membership (``group.params.admission``): joining, admitting, closing joins."""

    def __init__(self, g: WorkerGroup, params: Params) -> None:
        self.g = g
        self.params = params

    async def join(self, buckets: list[np.ndarray]) -> tuple[list[np.ndarray], int, int, dict[str, Any]]:
        """A joining worker (init_group(join=True)): wait until a boundary of the running job admits
        it, then take the shards' parameters of that step. Returns them, the boundary's step, the step
        they are of (later with backup workers: steps the others took meanwhile), and what the
        admitting loop said (``extra``: e.g. the epoch it starts)."""
        store, key = self.g.links.store, f"{self.g.links.prefix}/join/{self.g.rank}/admitted"
        deadline = time.monotonic() + self.g.timeout
        while True:  # admitted, or told that no boundary will come (SyncSGD.close_joins), or the timeout
            raw = await store.get(key, max(min(JOIN_LOOK_S, deadline - time.monotonic()), 0.0))
            if raw is not None:
                break
            closed = await store.get(joins_closed_key(self.g.links.prefix))
            if closed is not None:
                job = self.g.links.prefix.partition("/")[2]
                raise PsringError(f"rank {self.g.rank} cannot join: the elastic job {job!r} {joins_closed(closed)}")
            if time.monotonic() >= deadline:
                raise CollectiveTimeoutError(
                    f"rank {self.g.rank} was not admitted to the running elastic job within {self.g.timeout:g}s (its "
                    "loop admits new workers at its boundaries: SyncSGD.admit_waiting)"
                )
        admitted = json.loads(raw)
        at, members = int(admitted["step"]), [int(r) for r in admitted["members"]]
        while True:
            outs, steps = await self.params.pull_all(buckets, f"pulling the parameters of step {at}")
            if any(s < at or (s > at and not self.g.backup) for s in steps):
                raise PsringError(
                    f"rank {self.g.rank} was admitted at step {at} but the shards hold steps {sorted(set(steps))}"
                )
            if len(set(steps)) <= 1:
                break
            if time.monotonic() >= deadline:
                raise CollectiveTimeoutError(
                    f"rank {self.g.rank} was admitted at step {at} but every pull of the parameters within "
                    f"{self.g.timeout:g}s straddled a step (the shards held steps {sorted(set(steps))})"
                )
            # backup workers: the others may complete steps without a new worker too (it is one of the
            # stragglers a step does not wait for), so a pull can straddle one: pull again
        now = steps[0] if steps else at
        # the steps completed without it since ``at``: their results came before the pull's answers (one
        # connection per shard, in order) and are dropped, as a straggler skips them
        for t in range(at, now):
            for tag, *_ in self.params.result_tags(t, buckets):
                if not self.g.mailbox.expect(tag).done():
                    self.g.mailbox.unpost(tag)
        self.g.live_members = members
        self.g.joining = False
        return outs, at, now, dict(admitted.get("extra") or {})

    async def close_joins(self, step: int) -> None:
        """No boundary will admit workers any more (every live worker calls it; the live rank 0 says
        so in the store): workers waiting to join, and any that ask later, raise at once."""
        if self.g.members[self.g.rank] == self.g.live_members[0]:
            await self.g.links.store.set(joins_closed_key(self.g.links.prefix), json.dumps({"step": step}).encode())

    async def admit(self, step: int, buckets: list[np.ndarray], extra: dict[str, Any] | None = None) -> list[int]:
        """At a boundary (between steps; called by every live worker with the same arguments): admit
        the workers waiting to join. The live rank 0 finds them in the store and tells the others and
        the new workers; every live worker tells the shards, before its own pushes of ``step``.
        Returns the new ranks."""
        live = self.g.live_members
        me = self.g.members[self.g.rank]
        found = np.zeros(MAX_JOINERS + 2, np.int64) - 1
        found[MAX_JOINERS:] = step, -step  # the max and (negated) min of the workers' steps come back too
        if me == live[0]:
            count = int(await self.g.links.store.add(f"{self.g.links.prefix}/joiners", 0))
            first = self.g.links.world_size
            waiting = [
                r for r in range(first, first + count)
                if r not in live and await self.g.links.store.get(f"{self.g.links.prefix}/join/{r}") == b"waiting"
            ][:MAX_JOINERS]  # fmt: skip
            found[: len(waiting)] = waiting
        try:
            # an all_reduce (max over -1s and rank 0's list), not a broadcast: a broadcast's root
            # returns once it has sent, so it could admit while the others saw a loss end the call
            found = await self.live_subgroup().all_reduce(found, op="max")
        except PeerLostError as exc:
            if type(exc.rank) is not int:
                raise  # a server: not this boundary's to absorb
            # a worker was lost during the call: the shard ended it alike for every survivor (or it
            # finished for all), so all of them take this branch; the joiners wait for the next boundary
            logger.warning("%r: elastic: %s; nobody joins at step %d", self.g, exc, step)
            return []
        top, bottom = int(found[MAX_JOINERS]), -int(found[MAX_JOINERS + 1])
        if top != bottom:  # every worker sees the same: all raise alike
            raise PsringError(
                f"admit_waiting at step {step} on worker {me}, but the live workers are at steps {bottom} to "
                f"{top}: a boundary is one step on every worker (with backup workers a loop skips the "
                "batches the others took: SyncSGD.batches_done, as psring's own loop does)"
            )
        new = [int(r) for r in found[:MAX_JOINERS] if r >= 0]
        if not new:
            return []
        members = sorted(set(live) | set(new))
        # every live worker tells the shards, before its own pushes of ``step`` (the first word counts):
        # no piece of the step can complete without the new workers, even where backup workers let
        # it complete without some of the old ones
        for b, flat in enumerate(buckets):  # every shard that holds a slice of it
            for shard, _a, _parts in self.params.layout(b, flat):
                self.g.links.shards[shard].send_frame(frames.admit(b, new, step))
        for conn in self.g.links.shards:  # every shard holds rows of every sparse table (if any)
            conn.send_frame(frames.sp_admit(new, step))
        if me == live[0]:
            for r in new:
                await self.g.links.store.set(f"{self.g.links.prefix}/join/{r}", b"admitted")
                value = json.dumps({"step": step, "members": members, "extra": extra or {}})
                await self.g.links.store.set(f"{self.g.links.prefix}/join/{r}/admitted", value.encode())
        logger.warning(
            "%r: elastic: worker(s) %s join at step %d; %d workers (results now depend on membership)",
            self.g, new, step, len(members),
        )  # fmt: skip
        self.g.live_members = members
        return new

    def live_subgroup(self) -> Any:
        """A group of the live workers (this group while they are its members, in order)."""
        live = self.g.live_members
        if live == self.g.members == list(range(self.g.links.world_size)):  # the job's own world, as it began
            return self.g
        gid = live_gid(live)  # the shards read the members from it (plan.may_need)
        group = self.g.links.groups.get(gid)
        if group is None:
            me = live.index(self.g.members[self.g.rank])
            group = self.g.sibling(me, list(live), gid)
        return group
