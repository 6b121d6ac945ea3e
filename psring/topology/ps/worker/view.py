"""What the parts of a parameter-server worker see of its group: a Protocol, not the group.

The parameter client and its elastic admission (ps.worker.params, ps.worker.admission), the host reduce
(ps.worker.hostreduce) and the set-up (ps.worker.setup) are built from a :class:`WorkerGroup` -- the
group's ranks and membership, its links to the shards, the runtime's public calls, and the few
verbs the group offers them -- so none imports the group (ps.worker.group's ``PsGroup``, which is one).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from ....errors import PsringError
    from ....transport.mailbox import Mailbox
    from .links import ServerLinks


class WorkerGroup(Protocol):
    """A worker's group as its parts see it."""

    rank: int
    world_size: int
    gid: str
    timeout: float
    mailbox: Mailbox
    #: the links to every shard (and the job's other groups over them)
    links: ServerLinks
    #: the world ranks of this group's ranks; those the shards last averaged over (elastic)
    members: list[int]
    live_members: list[int]
    elastic: bool
    joining: bool
    #: SyncSGD(backup=b), and what it cost this worker
    backup: int
    backup_dropped: int
    backup_skipped: int
    #: the shards fold this group's all_reduces in rank order (a host-reduce subgroup)
    ordered: bool
    host_reduce: Any

    @property
    def num_servers(self) -> int: ...

    @property
    def broken_error(self) -> PsringError | None: ...

    def check_usable(self, peer: int | None = None, receiving: bool = False, seq: int | None = None) -> None: ...

    def mend(self) -> None: ...

    def watch_broken(self) -> asyncio.Future[None]: ...

    def unwatch_broken(self, fut: asyncio.Future[None]) -> None: ...

    def send_abort(self, seq: int, err: PsringError, reason: str) -> None: ...

    def make_subgroup(self, gid: str, ranks: list[int]) -> Any: ...

    def sibling(self, rank: int, members: list[int], gid: str) -> WorkerGroup: ...

    async def all_reduce(self, x: Any, op: str = "sum", compression: Any = None) -> Any: ...

    async def close(self) -> None: ...


__all__ = ["WorkerGroup"]
