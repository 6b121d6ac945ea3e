"""The ring's pipelined paths on the event loop: reduce-scatter then all-gather in pieces, the broadcast
chain and the all_gather ring. Each piece is folded and forwarded in a receive callback.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ...core.arrays import byte_view, result_empty
from ...core.fold import pieces, reduce_op, ring_chunk_bounds
from ...core.reduceop import OPS
from ...errors import ProtocolError
from ...transport.connection import Connection
from ..collective import Collective
from .chooser import Algorithm, Call
from .constants import AG, BCAST, DIRECT, GATHER_RING, RS
from .paths import SMALL_BYTES, Path

if TYPE_CHECKING:
    from .context import RingContext
    from .exchange import Exchange

logger = logging.getLogger(__name__)


class PipelinedRing(Algorithm):
    """The RING route: the pipelined ring on the event loop (all_reduce, reduce_scatter, reduce), and the
    broadcast chain and the all_gather ring."""

    route = Path.RING

    def __init__(self, ctx: RingContext, exchange: Exchange) -> None:
        super().__init__(ctx)
        self.exchange = exchange

    def eligible(self, call: Call) -> bool:
        return self.ctx.loop_path(call.nbytes) is Path.RING

    async def run(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray:
        return await self.reduce(coll, x, op, mode="all")

    def _wait_piece(self, coll: Collective, conn_count: int) -> tuple[asyncio.Future[None], Callable[[], None]]:
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        remaining = [conn_count]

        def one_done() -> None:
            remaining[0] -= 1
            if remaining[0] == 0 and not done.done():
                coll.waiting_on.clear()  # every frame is in: a peer leaving now costs nothing
                done.set_result(None)

        if conn_count == 0:
            done.set_result(None)
        return done, one_done

    async def ring_pass(
        self,
        coll: Collective,
        right: Connection,
        chunk_pieces: list[list[tuple[int, int]]],
        ag_chunks: list[int],
        sends: np.ndarray,
        rs_into: np.ndarray,
        ag_into: np.ndarray,
        rs_arrived: Callable[[int, int, int, int], Callable[..., None]],
        ag_arrived: Callable[[int, int, int, int], Callable[..., None]],
        ag_from: Callable[[int], int] | None = None,
    ) -> None:
        """The pipelined ring's skeleton, for every element type on the wire: post a receive for every
        reduce-scatter piece (each chunk but this rank's, into ``rs_into``) and every all-gather piece of
        ``ag_chunks`` (into ``ag_into``), send this rank's own chunk of ``sends`` to the right, and return
        once every receive's callback (``rs_arrived``/``ag_arrived(c, j, a, b)``: fold, forward) has run.

        ``ag_from(c)``: the rank chunk c's all-gather pieces come from (default the left neighbour; a
        reduce's destination hears from the rank that finished each chunk). ``coll.waiting_on`` is the
        ranks with pieces still owed: a peer that finished the call and left once all of its pieces are
        in costs nothing, even while the call still waits for another rank's."""
        n_ranks, me = self.world_size, self.rank
        left = (me - 1) % n_ranks
        ag_src = [left if ag_from is None else ag_from(c) for c in ag_chunks]  # who sends each one's pieces
        coll.waiting_on = set()  # (the senders of its pieces, by coll.expect_from)
        needed = 0
        for c in range(n_ranks):
            if c != me:
                coll.expect_from(left, len(chunk_pieces[c]))
                needed += len(chunk_pieces[c])
        for c, src in zip(ag_chunks, ag_src, strict=True):
            coll.expect_from(src, len(chunk_pieces[c]))
            needed += len(chunk_pieces[c])
        done, one_done = self._wait_piece(coll, needed)

        def counted(cb: Callable[..., None], src: int) -> Callable[..., None]:
            def run(conn: Connection, hdr: dict[str, Any], payload: Any) -> None:
                cb(conn, hdr, payload)
                coll.arrived_from(src)
                one_done()  # every posted receive counts once: done means all forwarding duties are met too

            return self.rt.guard(coll, run)

        post, gid, seq = self.ctx.mailbox.post, self.gid, coll.seq
        for c in range(n_ranks):
            if c != me:
                for j, (a, b) in enumerate(chunk_pieces[c]):
                    post((gid, seq, RS, c, j), byte_view(rs_into[a:b]), counted(rs_arrived(c, j, a, b), left))
        for c, src in zip(ag_chunks, ag_src, strict=True):
            for j, (a, b) in enumerate(chunk_pieces[c]):
                post((gid, seq, AG, c, j), byte_view(ag_into[a:b]), counted(ag_arrived(c, j, a, b), src))
        for j, (a, b) in enumerate(chunk_pieces[me]):
            right.send_tensor(self.ctx.header(coll, RS, me, j), sends[a:b])
        await done
        await right.flush()

    async def reduce(self, coll: Collective, x: np.ndarray, op: str, mode: str, dst: int = 0) -> np.ndarray:
        """Pipelined ring reduce-scatter, then (mode) all-gather / hand chunk to owner / gather to dst."""
        n_ranks, me = self.world_size, self.rank
        right_rank, left_rank = (me + 1) % n_ranks, (me - 1) % n_ranks
        per_piece = max(1, self.net.config.ring_piece // x.itemsize)
        bounds = ring_chunk_bounds(x.size, n_ranks)
        chunk_pieces = [pieces(a, b, per_piece) for a, b in bounds]
        out = result_empty(x)
        ufunc = reduce_op(op)
        final_chunk = right_rank  # the chunk whose fold completes here
        right = await self.ctx.link(right_rank)
        to_dst = await self.ctx.link(dst) if mode == "reduce" and me != dst else None
        ag_chunks = [
            c
            for c in range(n_ranks)
            if c != final_chunk
            and (mode == "all" or (mode == "scatter" and c == me) or (mode == "reduce" and me == dst))
        ]
        header = self.ctx.header

        def rs_arrived(c: int, j: int, a: int, b: int) -> Callable[..., None]:
            def cb(conn: Connection, hdr: dict[str, Any], payload: Any) -> None:
                seg = out[a:b]
                if payload is not None and hdr["nbytes"] != seg.nbytes:
                    raise ProtocolError(f"ring piece {c}.{j} from rank {left_rank} has {hdr['nbytes']} bytes")
                ufunc(seg, x[a:b], out=seg)  # canonical: (fold so far) op own
                if c != final_chunk:
                    right.send_tensor(header(coll, RS, c, j), seg)
                else:
                    OPS[op].finish(seg, n_ranks)
                    if mode in ("all", "scatter"):  # to the next rank (in scatter mode: c's owner)
                        right.send_tensor(header(coll, AG, c, j), seg)
                    elif to_dst is not None:
                        to_dst.send_tensor(header(coll, AG, c, j), seg)

            return cb

        def ag_arrived(c: int, j: int, a: int, b: int) -> Callable[..., None]:
            forward = mode == "all" and right_rank != (c - 1) % n_ranks

            def cb(conn: Connection, hdr: dict[str, Any], payload: Any) -> None:
                if forward:
                    right.send_tensor(header(coll, AG, c, j), out[a:b])

            return cb

        # (a reduce's destination hears chunk c from the rank that finished its fold, c's left neighbour)
        ag_from = (lambda c: (c - 1) % n_ranks) if mode == "reduce" else None
        await self.ring_pass(coll, right, chunk_pieces, ag_chunks, x, out, out, rs_arrived, ag_arrived, ag_from)
        if to_dst is not None:
            await to_dst.flush()
        return out

    async def broadcast(self, coll: Collective, x: np.ndarray, src: int) -> np.ndarray:
        n_ranks, me = self.world_size, self.rank
        out = x.copy() if me == src else np.empty_like(x)
        if n_ranks == 1:
            return out
        if x.nbytes <= SMALL_BYTES:
            if me == src:
                await self.exchange.direct(coll, x, BCAST, None, [], list(range(n_ranks)))
            else:
                await self.exchange.direct(coll, None, BCAST, {src: out}, [src], [])
            return out
        # pipelined chain src -> src+1 -> ... -> src-1
        right_rank = (me + 1) % n_ranks
        forward = right_rank != src
        right = await self.ctx.link(right_rank) if (forward or me == src) else None
        per_piece = max(1, self.net.config.ring_piece // x.itemsize)
        parts = pieces(0, x.size, per_piece)
        if me == src:
            assert right is not None
            for j, (a, b) in enumerate(parts):
                right.send_tensor(self.ctx.header(coll, BCAST, "p", j), x[a:b])
            await right.flush()
            return out
        done, one_done = self._wait_piece(coll, len(parts))
        coll.waiting_on = {(me - 1) % n_ranks}

        def arrived(a: int, b: int) -> Callable[..., None]:
            def cb(conn: Connection, hdr: dict[str, Any], payload: Any) -> None:
                if forward and right is not None:
                    right.send_tensor(self.ctx.header(coll, *hdr["tag"][2:]), out[a:b])
                one_done()

            return cb

        for j, (a, b) in enumerate(parts):
            self.ctx.mailbox.post(
                (self.gid, coll.seq, BCAST, "p", j), byte_view(out[a:b]), self.rt.guard(coll, arrived(a, b))
            )
        await done
        if right is not None:
            await right.flush()
        return out

    async def all_gather(self, coll: Collective, x: np.ndarray) -> np.ndarray:
        n_ranks, me = self.world_size, self.rank
        out = np.empty((n_ranks, x.size), x.dtype)
        out[me] = x
        if n_ranks == 1:
            return out
        ranks = list(range(n_ranks))
        if x.nbytes <= SMALL_BYTES:
            await self.exchange.direct(coll, x, DIRECT, out, ranks, ranks)
            return out
        right_rank = (me + 1) % n_ranks
        right = await self.ctx.link(right_rank)
        per_piece = max(1, self.net.config.ring_piece // x.itemsize)
        parts = pieces(0, x.size, per_piece)
        done, one_done = self._wait_piece(coll, (n_ranks - 1) * len(parts))
        coll.waiting_on = {(me - 1) % n_ranks}

        def arrived(c: int, a: int, b: int) -> Callable[..., None]:
            forward = right_rank != c

            def cb(conn: Connection, hdr: dict[str, Any], payload: Any) -> None:
                if forward:
                    right.send_tensor(self.ctx.header(coll, GATHER_RING, c, hdr["tag"][4]), out[c, a:b])
                one_done()

            return cb

        for c in ranks:
            if c == me:
                continue
            for j, (a, b) in enumerate(parts):
                self.ctx.mailbox.post(
                    (self.gid, coll.seq, GATHER_RING, c, j),
                    byte_view(out[c, a:b]),
                    self.rt.guard(coll, arrived(c, a, b)),
                )
        for j, (a, b) in enumerate(parts):
            right.send_tensor(self.ctx.header(coll, GATHER_RING, me, j), x[a:b])
        await done
        await right.flush()
        return out


def _same_memory(payload: Any, out: np.ndarray) -> bool:
    try:
        return np.shares_memory(np.frombuffer(payload, np.uint8), out)
    except (TypeError, ValueError):
        return False
