"""An elastic ring's membership: after a loss, the survivors agree who is left and re-form.

A ring has no server that outlives a worker, so an elastic ring (``SyncSGD(elastic=True)`` over
the ring) keeps its state on every rank and, when a step's exchange fails for a lost, killed or
hung peer, runs one quorum round through the job's store (as torchft's lighthouse does per step):

1. each survivor posts ``<prefix>/elastic/q<e>/<rank>``: the steps it completed and the ranks it
   knows are gone (its links' losses, which every rank's net floods, and a timeout's missing ranks);
2. the round closes once every member of the ring it left has posted or is known gone (or the
   group's timeout passed: the silent are left out); the first rank to see that writes the round's
   record with compare-and-set, and every rank takes that record, so all agree even if a late
   poster arrives;
3. the ranks in it form a new group over the same endpoint (``RingGroup`` over the same ``PeerNet``:
   no new rendezvous, only links to new neighbours), numbered in the old order.

A rank the record leaves out (it was silent past the timeout, e.g. stopped) raises
``PeerLostError`` saying so. What the survivors then do with the steps each completed (hand the
furthest one's state to the others, or redo the step) is the training layer's (training.placement).
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import CollectiveTimeoutError, PeerLostError, PsringError, StoreError

logger = logging.getLogger(__name__)

#: how long a survivor waits for the others' posts before it looks at the round again (seconds)
WAIT_S = 0.05


@dataclass(frozen=True)
class Round:
    """A closed quorum round: the new group, and the steps each of its ranks had completed."""

    group: Any
    done: list[int]
    epoch: int


def gone_in(group: Any, exc: BaseException) -> set[int]:
    """The world ranks a failed call says are gone: a lost peer, or a timeout's missing ranks."""
    if isinstance(exc, PeerLostError) and type(exc.rank) is int:
        return {exc.rank}
    if isinstance(exc, CollectiveTimeoutError):
        return {group.members[r] for r in exc.missing if 0 <= r < len(group.members)}
    return set()


@dataclass(frozen=True)
class Registry:
    """Where a job's new workers ask to join its elastic ring: under the job's first ring's prefix
    (every later ring a join re-forms has its own), and that ring's size (the first new worker's id)."""

    prefix: str
    world0: int


class Quorum:
    """The rounds of one elastic ring: one per ring endpoint (``PeerNet``), kept by its root group.

    ``ids``: the job's ids of this ring's ranks (the first ring's ranks, then the new workers'
    ``world0 + k`` in the order they asked), what ``SyncSGD.members`` names."""

    def __init__(
        self, root: Any, ids: list[int] | None = None, registry: Registry | None = None, epoch: int = 0,
        admitted: int = 0,
    ) -> None:  # fmt: skip
        self.root = root
        self.net = root.net
        self.me = root.members[root.rank]  # this rank's rank in the ring: its name in every round
        self.prefix = f"{self.net.prefix}/elastic"
        self.ids = list(ids) if ids is not None else list(range(root.world_size))
        self.registry = registry or Registry(self.prefix, root.world_size)
        self.epoch = epoch
        #: new workers admitted so far (the next to admit asked as number ``admitted``)
        self.admitted = admitted
        #: the rings later joins re-formed into, from this one (closed with it)
        self.spawned: list[Any] = []
        #: the rounds' wall times, kill to new group (what benchmarks/chaos.py --elastic reports)
        self.took: list[float] = []

    def ids_of(self, group: Any) -> list[int]:
        """The job's ids of a group's ranks (a group over this ring's endpoint)."""
        return [self.ids[r] for r in group.members]

    # ------------------------------------------------------------------ joins
    async def admit(self, group: Any, extra: dict[str, Any] | None) -> Any | None:
        """At a boundary (every rank of ``group`` calls it): the new workers that asked to join since
        the last one, admitted into a new ring of ``group``'s ranks then them (a full rendezvous under
        the job's prefix + ``/e<round>``: links, boards and plane as at start); None if nobody asked.
        The caller hands the state over on the new ring (rank 0 is ``group``'s rank 0)."""
        store, reg = self.net.store, self.registry
        asked = 0
        if group.rank == 0:  # one rank reads the registry; all take its count (the same admissions)
            asked = int(await store.add(f"{reg.prefix}/asked", 0))
        asked = int((await group.broadcast(np.array([asked], np.int64), src=0))[0])
        new = list(range(self.admitted, asked))
        if not new:
            return None
        e = self.epoch + 1
        ids = self.ids_of(group) + [reg.world0 + k for k in new]
        if group.rank == 0:
            for i, k in enumerate(new):
                record = {"round": e, "rank": group.world_size + i, "ids": ids, "extra": extra, "asked": asked,
                          "world0": reg.world0, "registry": reg.prefix}  # fmt: skip
                await store.set(f"{reg.prefix}/admitted/{k}", json.dumps(record).encode())
        logger.warning("elastic ring: round %d: admitting new worker(s) %s (ranks %s)", e, ids[group.world_size :], ids)
        ring = await type(self.root).reformed(self.net.settings, self._job(reg), e, group.rank, len(ids))
        ring._quorum = Quorum(ring, ids, reg, e, asked)
        self.spawned.append(ring)
        return ring

    async def close_joins(self, group: Any, step: int) -> None:
        """No boundary admits anyone from now on: waiting new workers, and later ones, are told so."""
        if group.rank == 0:
            await self.net.store.set(f"{self.registry.prefix}/closed", json.dumps({"step": step}).encode())

    @staticmethod
    def _job(reg: Registry) -> str:
        """The job name of the first ring (its prefix is psring/<job>; later rings psring/<job>/e<n>)."""
        return reg.prefix.removeprefix("psring/").removesuffix("/elastic")

    async def reform(self, group: Any, failed: BaseException, done: int) -> Round:
        """The survivors of ``group``, which just ``failed`` a call, agreed through the store;
        ``done``: the steps this rank completed."""
        t0 = time.perf_counter()
        e = self.epoch + 1
        store, at = self.net.store, f"{self.prefix}/q{e}"
        gone = gone_in(group, failed) | set(self.net.lost)
        await store.set(f"{at}/{self.me}", json.dumps({"done": done, "gone": sorted(gone)}))
        record = await self._close(store, at, group.members, group.timeout)
        members = [int(r) for r in record["members"]]
        if self.me not in members:
            raise PeerLostError(
                f"rank {self.me} was left out of the elastic ring's round {e} (the others found it silent "
                f"for {group.timeout:.0f}s or lost): the ring went on with ranks {members}",
                rank=self.me,
            )
        self.epoch = e
        old = self.net.groups.get(group.gid)
        if group.gid != self.root.gid and old is group:
            del self.net.groups[group.gid]  # an earlier round's group: nothing more comes for it
        new = type(self.root)(self.net, members.index(self.me), len(members), members, f"e{e}", self.root.timeout)
        self.took.append(time.perf_counter() - t0)
        logger.warning("elastic ring: round %d: ranks %s go on without %s (steps completed %s; %.1f ms)", e, members,
                       sorted(set(group.members) - set(members)), [record["done"][str(r)] for r in members],
                       1e3 * self.took[-1])  # fmt: skip
        return Round(new, [int(record["done"][str(r)]) for r in members], e)

    async def _close(self, store: Any, at: str, members: list[int], timeout: float) -> dict[str, Any]:
        """The round's record: the one written first (compare-and-set), by whoever saw every member
        posted or gone (or the timeout pass)."""
        deadline = time.monotonic() + timeout
        posts: dict[int, dict[str, Any]] = {}
        while True:
            decided = await store.get(f"{at}/members")
            if decided is not None:
                return dict(json.loads(decided))
            for r in members:  # (one get each, not a listing: torch's store cannot list keys)
                if r not in posts:
                    raw = await store.get(f"{at}/{r}")
                    if raw is not None:
                        posts[r] = json.loads(raw)
            gone = set(self.net.lost).union(*(set(p["gone"]) for p in posts.values()))
            waiting = [r for r in members if r not in posts and r not in gone]
            if not waiting or time.monotonic() > deadline:
                chosen = sorted(posts)
                record = {"members": chosen, "done": {str(r): posts[r]["done"] for r in chosen}}
                won, current = await store.compare_set(f"{at}/members", None, json.dumps(record).encode())
                return record if won else dict(json.loads(current or b"{}"))
            with contextlib.suppress(StoreError):  # not all there yet: look again (someone may have decided)
                await store.wait([f"{at}/{r}" for r in waiting], WAIT_S)


def _closed(value: bytes) -> str:
    step = json.loads(value).get("step")
    return (
        f"admits no more workers (its loop closed joins at step {step}: SyncSGD.close_joins, as the job nears its end)"
    )


async def join(ring_class: Any, settings: Any) -> Any:
    """A new worker of a running elastic ring (``init_group(topology="ring", join=True)``): ask the
    job's registry, wait for a boundary that admits it (or the job's word that none will), and meet
    the ring that boundary re-forms (a ``ring_class``, RingGroup: this module knows the group only
through the groups it is given, never by import). The group it returns has ``joining`` set and ``joined_with`` (what
    the boundary said); SyncSGD.start takes the state from the ring's rank 0."""
    from ...rendezvous.join import connect_store_of
    reg_prefix = f"psring/{settings.job}/elastic"
    store = await connect_store_of(settings)
    try:
        closed = f"{reg_prefix}/closed"
        said = await store.get(closed)
        if said is not None:
            raise PsringError(f"the elastic job {settings.job!r} {_closed(said)}")
        k = int(await store.add(f"{reg_prefix}/asked", 1)) - 1
        key = f"{reg_prefix}/admitted/{k}"
        deadline = time.monotonic() + settings.timeout
        raw = None
        while raw is None:
            said = await store.get(closed)
            if said is not None:
                raise PsringError(f"this worker cannot join: the elastic job {settings.job!r} {_closed(said)}")
            if time.monotonic() > deadline:
                raise CollectiveTimeoutError(
                    f"no boundary of job {settings.job!r} admitted this worker within {settings.timeout:g}s"
                )
            with contextlib.suppress(StoreError):
                await store.wait([key], 0.5)
            raw = await store.get(key)
    finally:
        if store is not settings.client:
            with contextlib.suppress(Exception):  # cleanup: the store may be gone with the job
                await store.close()
    record = json.loads(raw)
    reg = Registry(record["registry"], int(record["world0"]))
    ring = await ring_class.reformed(settings, Quorum._job(reg), int(record["round"]), int(record["rank"]),
                                    len(record["ids"]))  # fmt: skip
    ring._quorum = Quorum(ring, record["ids"], reg, int(record["round"]), int(record["asked"]))
    ring.joining = True
    ring.joined_with = record["extra"]
    return ring


__all__ = ["Quorum", "Registry", "Round", "gone_in", "join"]
