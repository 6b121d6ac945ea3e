"""The ring's all_reduce with float16 on the wire (psring.core.compress gives the rounding rules)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from ...core.compress import dequantize, fold_fp16, quantize
from ...core.fold import finish_avg, pieces, ring_chunk_bounds
from ...errors import ProtocolError
from ...transport.connection import Connection
from ..collective import Collective
from .chooser import GroupPart
from .constants import AG, DIRECT, RS
from .paths import Path

if TYPE_CHECKING:
    pass

logger = logging.getLogger(__name__)


class Fp16Ring(GroupPart):
    """all_reduce with float16 on the wire (compression="fp16"): one hop when small, else the pipelined
    ring's skeleton with float16 pieces."""

    async def all_reduce(self, coll: Collective, x: np.ndarray, op: str, e: int) -> np.ndarray:
        n_ranks = self.world_size
        q = quantize(x, e)
        path = self.g.chooser.loop_path(x.nbytes, fp16=True)
        if path is Path.ROOTED:  # the result travels as float16 too
            return dequantize(await self.g.one_hop.rooted(coll, q, lambda b: fold_fp16(b, op, e, np.empty_like(q))), e)
        if path is Path.DIRECT:
            bufs = np.empty((n_ranks, x.size), np.float16)
            bufs[self.rank] = q
            if n_ranks > 1:
                ranks = list(range(n_ranks))
                await self.g.exchange.direct(coll, q, DIRECT, bufs, ranks, ranks)
            return dequantize(fold_fp16(bufs, op, e, np.empty(x.size, np.float16)), e)
        return await self._ring(coll, q, op, e)

    async def _ring(self, coll: Collective, q: np.ndarray, op: str, e: int) -> np.ndarray:
        """The pipelined ring all_reduce with float16 on the wire (psring.core.compress gives the rules)."""
        n_ranks, me = self.world_size, self.rank
        right_rank, left_rank = (me + 1) % n_ranks, (me - 1) % n_ranks
        chunk_pieces = [pieces(a, b, self.net.config.ring_piece // 2) for a, b in ring_chunk_bounds(q.size, n_ranks)]
        own = dequantize(q, e)  # what this rank contributes
        out = np.empty(q.size, np.float32)
        rs16, ag16 = np.empty_like(q), np.empty_like(q)  # partial sums in, final values in and out
        final_chunk = right_rank
        right = await self.g._link(right_rank)
        ag_chunks = [c for c in range(n_ranks) if c != final_chunk]
        header = self.g._header

        def rs_arrived(c: int, j: int, a: int, b: int) -> Callable[..., None]:
            def cb(conn: Connection, hdr: dict[str, Any], payload: Any) -> None:
                if hdr["nbytes"] != 2 * (b - a):
                    raise ProtocolError(f"ring piece {c}.{j} from rank {left_rank} has {hdr['nbytes']} bytes")
                seg = out[a:b]
                dequantize(rs16[a:b], e, out=seg)
                np.add(seg, own[a:b], out=seg)
                if c != final_chunk:
                    right.send_tensor(header(coll, RS, c, j), quantize(seg, e, out=rs16[a:b]))
                else:
                    if op == "avg":
                        finish_avg(seg, n_ranks)
                    dequantize(quantize(seg, e, out=ag16[a:b]), e, out=seg)
                    right.send_tensor(header(coll, AG, c, j), ag16[a:b])

            return cb

        def ag_arrived(c: int, j: int, a: int, b: int) -> Callable[..., None]:
            forward = right_rank != (c - 1) % n_ranks

            def cb(conn: Connection, hdr: dict[str, Any], payload: Any) -> None:
                if hdr["nbytes"] != 2 * (b - a):
                    raise ProtocolError(f"ring piece {c}.{j} from rank {left_rank} has {hdr['nbytes']} bytes")
                dequantize(ag16[a:b], e, out=out[a:b])
                if forward:
                    right.send_tensor(header(coll, AG, c, j), ag16[a:b])

            return cb

        await self.g.ring.ring_pass(coll, right, chunk_pieces, ag_chunks, q, rs16, ag16, rs_arrived, ag_arrived)
        return out
