"""An elastic ring's membership: after a loss, the survivors agree who is left and re-form.

A ring has no server that outlives a worker, so an elastic ring (``SyncSGD(elastic=True)`` over
the ring) keeps its state on every rank and, when a step's exchange fails for a lost, killed or
hung peer, runs one quorum round through the job's store (as torchft's lighthouse does per step):

1. each survivor proposes the ring's members less those it knows are gone (its links' losses,
   which every rank's net floods at once, and a failed call's missing ranks after a timeout) with
   compare-and-set on ``<prefix>/elastic/q<e>/members``: the first proposal written is the round's
   record, and every rank takes it (one store round trip), so all agree whoever comes late;
2. the ranks in it form a new group over the same endpoint (``RingGroup`` over the same ``PeerNet``:
   no new rendezvous, only links to new neighbours), numbered in the old order, and all_gather the
   steps each completed (its first call). If a member of the record is gone too (it died meanwhile,
   or hangs: that call times out), the survivors run the next round from there.

A rank the record leaves out (it was silent past the timeout, e.g. stopped) raises
``PeerLostError`` saying so. What the survivors then do with the steps each completed (hand the
furthest one's state to the others, or redo the step) is the training layer's (training.placement).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import numpy as np

from ...errors import CollectiveTimeoutError, PeerLostError, PsringError, StoreError

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Round:
    """A closed quorum round: the new group, and the steps each of its ranks had completed."""

    group: Any
    done: list[int]


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

    def ids_of(self, group: Any) -> list[int]:
        """The job's ids of a group's ranks (a group over this ring's endpoint)."""
        return [self.ids[r] for r in group.members]

    # ------------------------------------------------------------------ joins
    async def admit(self, group: Any, extra: dict[str, Any] | None, step: int) -> Any | None:
        """At the boundary after ``step`` (every rank of ``group`` calls it): the new workers that asked
        to join since the last one, admitted into a new ring of ``group``'s ranks then them (a full
        rendezvous under the job's prefix + ``/e<round>``: links, boards and plane as at start); None if
        nobody asked. The caller hands the state over on the new ring (rank 0 is ``group``'s rank 0).

        The ranks agree how many asked through the store, not a collective: each reads the registry's
        count and proposes it with compare-and-set on ``<registry>/boundary/<step>``, and all take the
        first proposal written. A rank killed meanwhile then leaves no call half done on some ranks
        and done on others (a broadcast from it would: the others would disagree whether they had
        admitted anyone); they meet its loss in the next step's exchange, as anywhere else. A rank that
        proposes while it knows a member is gone proposes nobody (that member would never meet the new
        ring). One lost after the proposals (its links' end not yet seen) abandons the round (``_meet``):
        every rank of it, the new workers too, drops the new ring's set-up at once rather than wait out
        the timeout for a rank that will never come; the new workers wait for the next boundary."""
        store, reg = self.net.store, self.registry
        mine = int(await store.add(f"{reg.prefix}/asked", 0))
        if set(self.net.lost) & set(group.members):  # a member is known gone: its ring could not form;
            mine = self.admitted  # admit nobody here (the next step re-forms, the next boundary admits)
        _, agreed = await store.compare_set(f"{reg.prefix}/boundary/{step}", None, str(mine).encode())
        asked = int(agreed or mine)
        new = list(range(self.admitted, asked))
        if not new:
            return None
        e = self.epoch + 1
        ids = self.ids_of(group) + [reg.world0 + k for k in new]
        for i, k in enumerate(new):  # every rank writes the same records: any survivor's stand
            record = {"round": e, "rank": group.world_size + i, "ids": ids, "extra": extra, "asked": asked,
                      "world0": reg.world0, "registry": reg.prefix}  # fmt: skip
            await store.set(f"{reg.prefix}/admitted/{k}", json.dumps(record).encode())
        logger.warning("elastic ring: round %d: admitting new worker(s) %s (ranks %s)", e, ids[group.world_size :], ids)
        members = set(group.members)
        ring = await _meet(
            type(self.root).reformed(self.net.settings, self.job_of(reg), e, group.rank, len(ids)),
            store, f"{reg.prefix}/round/{e}", lambda: not members.isdisjoint(self.net.lost), self.net.settings.timeout,
        )  # fmt: skip
        self.epoch = e  # (an abandoned round's prefix is not used again)
        if ring is None:
            logger.warning("elastic ring: round %d abandoned (ring rank(s) %s lost meanwhile, or a set-up failed); new "
                           "worker(s) %s wait for the next boundary", e, sorted(members & set(self.net.lost)),
                           ids[group.world_size :])  # fmt: skip
            return None
        ring.keep_quorum(Quorum(ring, ids, reg, e, asked))
        self.spawned.append(ring)
        return ring

    async def close_joins(self, group: Any, step: int) -> None:
        """No boundary admits anyone from now on: waiting new workers, and later ones, are told so."""
        if group.rank == 0:
            await self.net.store.set(f"{self.registry.prefix}/closed", json.dumps({"step": step}).encode())

    @staticmethod
    def job_of(reg: Registry) -> str:
        """The job name of the first ring (its prefix is psring/<job>; later rings psring/<job>/e<n>)."""
        return reg.prefix.removeprefix("psring/").removesuffix("/elastic")

    async def reform(self, group: Any, failed: BaseException, done: int) -> Round:
        """The survivors of ``group``, which just ``failed`` a call: a round through the store agrees
        who they are, a new group of them over this endpoint, and what each completed (``done``:
        this rank's steps). A round whose new group loses a rank too is followed by another."""
        t0 = time.perf_counter()
        while True:
            e = self.epoch + 1
            gone = gone_in(group, failed) | set(self.net.lost)
            proposal = [r for r in group.members if r not in gone]
            # the first proposal written is the round's: one store round trip for everyone
            won, current = await self.net.store.compare_set(
                f"{self.prefix}/q{e}/members", None, json.dumps(proposal).encode()
            )
            members = proposal if won else [int(r) for r in json.loads(current or b"[]")]
            if self.me not in members:
                raise PeerLostError(
                    f"rank {self.me} was left out of the elastic ring's round {e} (the others found it silent "
                    f"past their timeout, or lost): the ring went on with ranks {members}",
                    rank=self.me,
                )
            self.epoch = e
            if group.gid != self.root.gid and self.net.groups.get(group.gid) is group:
                del self.net.groups[group.gid]  # an earlier round's group: nothing more comes for it
            at = members.index(self.me)
            new = type(self.root)(self.net, at, len(members), members, f"e{e}", self.root.timeout)
            try:  # every member's completed steps, over the new group: its first call
                dones = [int(d[0]) for d in await new.all_gather(np.array([done], np.int64))]
            except (PeerLostError, CollectiveTimeoutError) as exc:
                group, failed = new, exc  # a member of the round is gone too: another round
                continue
            logger.warning("elastic ring: round %d: ranks %s go on without %s (steps completed %s; %.1f ms)", e,
                           members, sorted(set(group.members) - set(members)), dones,
                           1e3 * (time.perf_counter() - t0))  # fmt: skip
            return Round(new, dones)


FORMED, ABANDONED = b"formed", b"abandoned"


async def _meet(form: Coroutine[Any, Any, Any], store: Any, decision: str, lost: Callable[[], bool],
                timeout: float) -> Any | None:  # fmt: skip
    """A boundary's new ring (``form``: its set-up), or None where the round was abandoned, the same on
    every rank of the round: each writes its word with compare-and-set under ``decision`` and all take
    the first -- ``formed`` from a rank whose set-up returned (it passed the new ring's ready barrier,
    which every rank had reached), ``abandoned`` from a rank whose set-up failed or that saw a rank of
    the old ring lost meanwhile (``lost``: that rank will never meet the new ring). A rank told
    ``abandoned`` drops its set-up (or closes the ring it formed); one told ``formed`` finishes its own."""
    task = asyncio.ensure_future(form)
    watch = asyncio.ensure_future(store.wait([decision], timeout))
    said: bytes | None = None
    try:
        while not task.done() and said != ABANDONED:
            if said == FORMED:  # formed by another: this set-up completes too (or fails, said below)
                await asyncio.wait({task})
            elif lost():
                said = (await store.compare_set(decision, None, ABANDONED))[1]
            elif watch.done():
                said = await store.get(decision) if not watch.cancelled() and watch.exception() is None else None
                if said is None:  # (the watch timed out: the set-up times out too, and says so)
                    watch = asyncio.ensure_future(asyncio.sleep(timeout))
            else:
                await asyncio.wait({task, watch}, timeout=0.02, return_when=asyncio.FIRST_COMPLETED)
        if said is None:
            failed = task.cancelled() or task.exception() is not None
            said = (await store.compare_set(decision, None, ABANDONED if failed else FORMED))[1]
    finally:
        watch.cancel()
        task.cancel()  # (a no-op once done)
        await asyncio.wait({task, watch})
    if said == FORMED:
        return task.result()  # (formed by the others while this set-up failed after the barrier: its error)
    if not task.cancelled():
        if task.exception() is None:
            await task.result().close()  # formed here, abandoned by another: nothing goes over it
        else:
            logger.warning("elastic ring: the new ring's set-up failed: %s", task.exception())
    return None


def _closed(value: bytes) -> str:
    step = json.loads(value).get("step")
    return (
        f"admits no more workers (its loop closed joins at step {step}: SyncSGD.close_joins, as the job nears its end)"
    )


async def join(ring_class: Any, settings: Any) -> Any:
    """A new worker of a running elastic ring (``init_group(topology="ring", join=True)``): ask the
    job's registry, wait for a boundary that admits it (or the job's word that none will), and meet
    the ring that boundary re-forms (a ``ring_class``, RingGroup: this module knows the group only
    through the groups it is given, never by import). The group it returns has ``joining`` set and
    ``joined_with`` (what the boundary said); SyncSGD.start takes the state from the ring's rank 0. A
    boundary whose round is abandoned (a rank of the ring lost meanwhile) leaves it waiting for the next."""
    from ...rendezvous.join import connect_store_of
    reg_prefix = f"psring/{settings.job}/elastic"
    closed = f"{reg_prefix}/closed"
    store = await connect_store_of(settings)
    try:
        said = await store.get(closed)
        if said is not None:
            raise PsringError(f"the elastic job {settings.job!r} {_closed(said)}")
        k = int(await store.add(f"{reg_prefix}/asked", 1)) - 1
        key = f"{reg_prefix}/admitted/{k}"
        abandoned: set[int] = set()
        while True:
            record = await _admitted(store, key, closed, abandoned, settings)
            reg = Registry(record["registry"], int(record["world0"]))
            e = int(record["round"])
            form = ring_class.reformed(settings, Quorum.job_of(reg), e, int(record["rank"]), len(record["ids"]))
            ring = await _meet(form, store, f"{reg.prefix}/round/{e}", lambda: False, settings.timeout)
            if ring is not None:
                break
            logger.warning("elastic ring: round %d, which admitted this worker, was abandoned (a rank of the ring "
                           "was lost meanwhile); waiting for the next boundary", e)  # fmt: skip
            abandoned.add(e)
    finally:
        if store is not settings.client:
            with contextlib.suppress(Exception):  # cleanup: the store may be gone with the job
                await store.close()
    ring.keep_quorum(Quorum(ring, record["ids"], reg, e, int(record["asked"])))
    ring.joining = True
    ring.joined_with = record["extra"]
    return ring


async def _admitted(store: Any, key: str, closed: str, abandoned: set[int], settings: Any) -> dict[str, Any]:
    """The record of the boundary that admits this worker (``key``), not one of an ``abandoned`` round."""
    deadline = time.monotonic() + settings.timeout
    while True:
        said = await store.get(closed)
        if said is not None:
            raise PsringError(f"this worker cannot join: the elastic job {settings.job!r} {_closed(said)}")
        if time.monotonic() > deadline:
            raise CollectiveTimeoutError(
                f"no boundary of job {settings.job!r} admitted this worker within {settings.timeout:g}s"
            )
        raw = await store.get(key)
        if raw is None:
            with contextlib.suppress(StoreError):
                await store.wait([key], 0.5)
            continue
        record = json.loads(raw)
        if int(record["round"]) not in abandoned:
            return record
        await asyncio.sleep(0.1)  # (the next boundary writes this key again, for its round)


__all__ = ["Quorum", "Registry", "Round", "gone_in", "join"]
