"""The ring's all_reduce with a codec on the wire (psring.core.codec: the codec encodes, decodes and
folds; the ring only moves its pieces)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import numpy as np

from ...core.codec import Codec
from ...core.fold import pieces, ring_chunk_bounds
from ...core.reduceop import OPS
from ...errors import ProtocolError
from ...transport.connection import Connection
from ..collective import Collective
from .constants import AG, DIRECT, RS
from .context import RingContext, RingPart
from .exchange import Exchange
from .onehop import OneHop
from .paths import Path
from .pipeline import PipelinedRing

logger = logging.getLogger(__name__)


class CodedRing(RingPart):
    """all_reduce with a codec on the wire (``compression=``): one hop when small, else the pipelined
    ring's skeleton with encoded pieces, every partial sum rounded through the codec where it is sent."""

    def __init__(self, ctx: RingContext, one_hop: OneHop, exchange: Exchange, ring: PipelinedRing) -> None:
        super().__init__(ctx)
        self.one_hop, self.exchange, self.ring = one_hop, exchange, ring

    async def all_reduce(self, coll: Collective, x: np.ndarray, op: str, codec: Codec, e: Any) -> np.ndarray:
        n_ranks = self.world_size
        q = codec.encode(x, e)
        path = self.ctx.loop_path(x.nbytes, coded=True)
        if path is Path.ROOTED:  # the result travels encoded too
            folded = await self.one_hop.rooted(coll, q, lambda b: codec.fold(b, op, e, np.empty_like(q)))
            return codec.decode(folded, e)
        if path is Path.DIRECT:
            bufs = np.empty((n_ranks, x.size), codec.wire)
            bufs[self.rank] = q
            if n_ranks > 1:
                ranks = list(range(n_ranks))
                await self.exchange.direct(coll, q, DIRECT, bufs, ranks, ranks)
            return codec.decode(codec.fold(bufs, op, e, np.empty(x.size, codec.wire)), e)
        return await self._ring(coll, q, op, codec, e)

    async def _ring(self, coll: Collective, q: np.ndarray, op: str, codec: Codec, e: Any) -> np.ndarray:
        """The pipelined ring all_reduce with encoded pieces (the fold's rules are the codec's)."""
        n_ranks, me = self.world_size, self.rank
        right_rank, left_rank = (me + 1) % n_ranks, (me - 1) % n_ranks
        width = codec.wire.itemsize
        piece = self.net.config.ring_piece * width // 4  # as many elements a piece as float32's bytes allow
        chunk_pieces = [pieces(a, b, piece) for a, b in ring_chunk_bounds(q.size, n_ranks)]
        out = np.empty(q.size, np.float32)
        rs_in, ag_io = np.empty_like(q), np.empty_like(q)  # partial sums in, final values in and out
        final_chunk = right_rank
        right = await self.ctx.link(right_rank)
        ag_chunks = [c for c in range(n_ranks) if c != final_chunk]
        header = self.ctx.header

        def rs_arrived(c: int, j: int, a: int, b: int) -> Callable[..., None]:
            def cb(conn: Connection, hdr: dict[str, Any], payload: Any) -> None:
                if hdr["nbytes"] != width * (b - a):
                    raise ProtocolError(f"ring piece {c}.{j} from rank {left_rank} has {hdr['nbytes']} bytes")
                seg = out[a:b]
                codec.decode(rs_in[a:b], e, out=seg, offset=a)
                np.add(seg, codec.decode(q[a:b], e, offset=a), out=seg)  # what this rank contributes (a piece's)
                if c != final_chunk:
                    right.send_tensor(header(coll, RS, c, j), codec.encode(seg, e, out=rs_in[a:b], offset=a))
                else:
                    OPS[op].finish(seg, n_ranks)
                    codec.decode(codec.encode(seg, e, out=ag_io[a:b], offset=a), e, out=seg, offset=a)
                    right.send_tensor(header(coll, AG, c, j), ag_io[a:b])

            return cb

        def ag_arrived(c: int, j: int, a: int, b: int) -> Callable[..., None]:
            forward = right_rank != (c - 1) % n_ranks

            def cb(conn: Connection, hdr: dict[str, Any], payload: Any) -> None:
                if hdr["nbytes"] != width * (b - a):
                    raise ProtocolError(f"ring piece {c}.{j} from rank {left_rank} has {hdr['nbytes']} bytes")
                codec.decode(ag_io[a:b], e, out=out[a:b], offset=a)
                if forward:
                    right.send_tensor(header(coll, AG, c, j), ag_io[a:b])

            return cb

        await self.ring.ring_pass(coll, right, chunk_pieces, ag_chunks, q, rs_in, ag_io, rs_arrived, ag_arrived)
        return out
