"""What a part of a ring group sees of it: a narrow context, not the group.

The ring's algorithms (ring.chooser), its small-message exchange and the helpers of its short ways are
built from a :class:`RingContext`: this rank's endpoint (``net``), who the group's ranks are, the life of
its calls (``runtime``: numbering, deadlines, aborts -- psring.topology.runtime's public methods), the
links to its peers and the frame header they carry, and the one decision every path asks (``loop_path``).
A part gets the other parts it works with from its maker (ring.parts), never by reaching through the
group; no part imports the group.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from . import frames
from .paths import Path, choose_all_reduce

if TYPE_CHECKING:
    import numpy as np

    from ...transport.connection import Connection
    from ...transport.mailbox import Mailbox
    from ..collective import Collective
    from ..runtime import CollectiveRuntime
    from .net import PeerNet


class RingContext:
    """One ring group's context, as its parts see it (made once per group)."""

    def __init__(
        self,
        net: PeerNet,
        rank: int,
        world_size: int,
        members: list[int],
        gid: str,
        *,
        runtime: CollectiveRuntime,
        timeout: float,
        mailbox: Mailbox,
        all_reduce_by: Callable[[np.ndarray, str, Any], Awaitable[Any]],
    ) -> None:
        self.net = net
        self.rank = rank
        self.world_size = world_size
        #: the world ranks of this group's ranks, in its rank order; and the way back
        self.members = members
        self.local = {g: r for r, g in enumerate(members)}
        self.gid = gid
        #: the peers in the order this rank sends to them (not everyone to rank 0 first)
        self.peer_order = tuple((rank + k) % world_size for k in range(1, world_size))
        #: the life of the group's calls: begin/run/guard, tickets for the short ways, aborts
        self.runtime = runtime
        self.timeout = timeout
        self.mailbox = mailbox
        #: all_reduce as a collective on the loop whose body is the algorithm the chooser picked (the
        #: group's checks, a Collective, then ``body``): the call is decided once (Group.all_reduce_by)
        self.all_reduce_by = all_reduce_by

    async def link(self, local_rank: int) -> Connection:
        """The connection to rank ``local_rank`` of the group (dialled if it is not open)."""
        conn = self.net.links.get(self.members[local_rank])
        if conn is not None and conn.is_open:
            return conn  # the common case, without a dial
        return await self.net.link(self.members[local_rank], self.timeout)

    async def links(self, local_ranks: list[int]) -> list[Connection]:
        links, members = self.net.links, self.members
        conns = [links.get(members[r]) for r in local_ranks]
        if all(c is not None and c.is_open for c in conns):
            return conns  # type: ignore[return-value]
        return list(await asyncio.gather(*(self.link(r) for r in local_ranks)))

    def header(self, coll: Collective, *tag: Any) -> dict[str, Any]:
        """A data frame's header for collective coll (its descriptor, so a mismatch is named)."""
        return frames.data(self.gid, coll.seq, tag, coll.desc, self.rank)

    def loop_path(self, nbytes: int, coded: bool = False) -> Path:
        """The route of a call that did not take the boards: ring.paths decides, from what every rank agreed."""
        plane = self.net.plane
        return choose_all_reduce(
            nbytes,
            self.world_size,
            self.net.paths,
            world=self.gid == "0",
            coded=coded,
            plane_up=plane is not None and plane.ready,
        )

    def __repr__(self) -> str:
        return f"RingGroup(rank={self.rank}/{self.world_size}, gid={self.gid})"  # (as the group says itself)


class RingPart:
    """A part of a ring group (an algorithm, the exchange, a short way's helper): its context, and what
    never changes for it, kept here because the hot paths read them on every call."""

    def __init__(self, ctx: RingContext) -> None:
        self.ctx = ctx
        self.net = ctx.net
        self.rank = ctx.rank
        self.world_size = ctx.world_size
        self.gid = ctx.gid
        self.members = ctx.members
        self.rt = ctx.runtime


__all__ = ["RingContext", "RingPart"]
