"""The parts of one ring group, made from its context in the one order their needs allow.

Every part sees the context (ring.context) and the parts it works with, handed to it here: the short
ways' helpers (``short``), the small-message exchange, then the algorithms (ring.chooser), each owning
its state and plan caches, and the chooser over them. The group and the tests that take the chooser
alone (on a context of data, no sockets) build them the same way.
"""

from __future__ import annotations

from .board import BoardAllReduce
from .chooser import Algorithm, Chooser
from .coded import CodedRing
from .context import RingContext
from .exchange import Exchange
from .hier import Hierarchical
from .onehop import OneHop
from .paths import Path
from .pipeline import PipelinedRing
from .plane.allreduce import PlaneAllReduce
from .shortways import ShortWays
from .streamed import StreamedBoard
from .tcpdirect import TcpDirect
from .twohop import TwoHop


class RingParts:
    """One group's parts (made once, with the group)."""

    def __init__(self, ctx: RingContext) -> None:
        self.short = ShortWays(ctx)
        self.exchange = Exchange(ctx)
        self.hier = Hierarchical(ctx)
        self.board = BoardAllReduce(ctx, self.short, self.exchange, self.hier)
        self.streamed = StreamedBoard(ctx, self.board)
        self.tcp = TcpDirect(ctx, self.short, self.exchange, self.hier)  # (the DIRECT route's short way between hosts)
        self.direct = OneHop(ctx, Path.DIRECT, self.exchange, self.hier, self.tcp)
        self.rooted = OneHop(ctx, Path.ROOTED, self.exchange, self.hier, self.tcp)
        self.two_hop = TwoHop(ctx, self.short, self.exchange)
        self.ring = PipelinedRing(ctx, self.exchange)
        self.plane = PlaneAllReduce(ctx, self.short)
        # (gather_and_fold for reduce_scatter and reduce, either route)
        self.coded = CodedRing(ctx, self.direct, self.exchange, self.ring)
        by_route: dict[Path, Algorithm] = {
            Path.HIERARCHICAL: self.hier,
            Path.TWO_HOP: self.two_hop,
            Path.PLANE: self.plane,
            Path.DIRECT: self.direct,
            Path.ROOTED: self.rooted,
            Path.RING: self.ring,
        }
        self.chooser = Chooser(ctx, [self.streamed, self.board], by_route)


__all__ = ["RingParts"]
