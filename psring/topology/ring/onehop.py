"""The ring's one-hop paths for small tensors: every rank's tensor to every other (DIRECT) or through
a rotating root (ROOTED), folded in the canonical order; the barrier and gather the same way.

The messages go through the group's exchange (ring.exchange): the same-host Unix links, the TCP
small-message links between hosts, or the ranks' connections. Between hosts the DIRECT all_reduce also
has a short way on the caller's thread (ring.tcpdirect).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ...core.fold import Layout, canonical_fold
from ..collective import Collective
from ..now import Now
from .chooser import Algorithm, Call
from .constants import DIRECT, RESULT, ROOT_REPORT_GRACE, TO_ROOT
from .paths import Path

if TYPE_CHECKING:
    from .context import RingContext
    from .exchange import Exchange
    from .hier import Hierarchical
    from .tcpdirect import TcpDirect


class OneHop(Algorithm):
    """The DIRECT or ROOTED route (one object each): small calls in one hop."""

    def __init__(self, ctx: RingContext, route: Path, exchange: Exchange, hier: Hierarchical, tcp: TcpDirect) -> None:
        super().__init__(ctx)
        self.route = route  # type: ignore[misc]
        self.exchange, self.hier, self.tcp = exchange, hier, tcp

    def eligible(self, call: Call) -> bool:
        return self.ctx.loop_path(call.nbytes) is self.route

    def soon(self, x: np.ndarray, op: str, on_loop: bool = False) -> Now:
        """Between hosts, a DIRECT call on the caller's thread over the TCP small-message links."""
        if self.route is Path.DIRECT and self.net.small.tcp is not None:
            return self.tcp.soon(x, op, on_loop)
        return None

    async def all_reduce(self, x: np.ndarray, op: str) -> Any:
        """The latency path: a contiguous array whose (op, dtype) passed the checks once goes straight
        to the exchange, past the generic staging and dispatch (the same checks hold; the same bits)."""
        rt = self.rt
        if self.net.small.active is not None and x.flags.c_contiguous and (op, x.dtype) in _VALID_OPS:
            coll = rt.begin("all_reduce", x, op)
            out = await rt.run(coll, self.run(coll, x, op))
            return out.reshape(x.shape)
        out = await self.ctx.all_reduce_by(x, op, self.run)
        _VALID_OPS.add((op, x.dtype))  # it passed the checks: next time take the short way
        return out

    async def run(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray:
        return await self.gather_and_fold(coll, x.reshape(-1), op, hosts=self.hier.hosts(), path=self.route)

    async def gather_and_fold(
        self,
        coll: Collective,
        x: np.ndarray,
        op: str,
        dst: int | None = None,
        hosts: Layout | None = None,
        path: Path = Path.DIRECT,
    ) -> Any:
        """One-hop path (``path``, chosen by ring.paths: DIRECT or, to every rank, ROOTED): every rank's x
        goes to dst (None: to every rank), folded there in canonical order (with ``hosts``, all_reduce
        across hosts: the two-level order)."""
        n_ranks, me = self.world_size, self.rank
        if dst is None and path is Path.ROOTED:
            return await self.rooted(coll, x, lambda bufs: canonical_fold(bufs, op, np.empty_like(x), hosts=hosts))
        ranks = list(range(n_ranks))
        receives = dst is None or me == dst
        bufs = np.empty((n_ranks, x.size), x.dtype) if receives else None
        if bufs is not None:
            bufs[me] = x
        if n_ranks > 1:
            await self.exchange.direct(
                coll, x, DIRECT, bufs, ranks if receives else [], ranks if dst is None else [dst]
            )
        return None if bufs is None else canonical_fold(bufs, op, np.empty_like(x), hosts=hosts)

    async def rooted(self, coll: Collective, x: np.ndarray, fold: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Small all_reduce through one root (``seq % N``): it gathers every rank's x (rows in
        rank order), applies ``fold`` (the canonical order) and sends the result to all. The
        root sees every rank's call, so a mismatch anywhere is caught there; the others check
        the root's."""
        n_ranks, me = self.world_size, self.rank
        root = coll.seq % n_ranks
        if me == root:
            bufs = np.empty((n_ranks, x.size), x.dtype)
            bufs[me] = x
            await self.exchange.direct(coll, None, DIRECT, bufs, list(range(n_ranks)), [])
            out = fold(bufs)
            await self.exchange.direct(coll, out, RESULT, None, [], list(range(n_ranks)))
            return out
        out = np.empty_like(x)
        coll.report_grace = ROOT_REPORT_GRACE  # a silent rank is the root's to name
        await self.exchange.direct(coll, x, DIRECT, {root: out}, [root], [root], recv_phase=RESULT)
        return out

    async def barrier(self, coll: Collective) -> None:
        n_ranks, me = self.world_size, self.rank
        ranks = list(range(n_ranks))
        if self.net.paths.one_hop(n_ranks) is Path.ROOTED:  # through a rotating root, as a small all_reduce
            root = coll.seq % n_ranks
            if me == root:
                await self.exchange.direct(coll, None, DIRECT, None, ranks, [])
                await self.exchange.direct(coll, None, RESULT, None, [], ranks)
            else:
                coll.report_grace = ROOT_REPORT_GRACE
                await self.exchange.direct(coll, None, DIRECT, None, [root], [root], recv_phase=RESULT)
        elif n_ranks > 1:
            await self.exchange.direct(coll, None, DIRECT, None, ranks, ranks)

    async def gather(self, coll: Collective, x: np.ndarray, dst: int) -> np.ndarray | None:
        n_ranks, me = self.world_size, self.rank
        if me == dst:
            out = np.empty((n_ranks, x.size), x.dtype)
            out[me] = x
            if n_ranks > 1:
                await self.exchange.direct(coll, None, TO_ROOT, out, list(range(n_ranks)), [])
            return out
        await self.exchange.direct(coll, x, TO_ROOT, None, [], [dst])
        return None


#: (op, dtype) pairs that passed Group.all_reduce's checks (a valid op for a supported dtype)
_VALID_OPS: set[tuple[str, np.dtype]] = set()
