"""The ring's hierarchical all_reduce: for ranks on several hosts, several on each.

A flat ring sends 2(N-1)/N of the tensor over every link, the slow ones between hosts
included. Here each host first reduces within itself, and only partial sums cross hosts:

1. within each host, local rank j collects slice j (of R) from the host's other ranks and
   folds the host's ranks in rank order: P_h;
2. across hosts, among the ranks with the same local index, host k's rank collects
   sub-chunk k (of H) of the slice from every host and folds the hosts in order;
3. it hands the finished sub-chunk to its counterparts on the other hosts;
4. and each rank hands its finished slice to the other ranks of its host.

Between hosts, each host sends 2(H-1)/H of the tensor (the least a reduction can), against
2(N-1)/N·(ranks whose ring links leave the host) for the flat ring: at 2 hosts of 2 ranks, S
against 1.5 S. The tensor goes through in blocks (``HIER_BLOCK``), several in flight, so
the steps of one block overlap those of the next. The result is the two-level order of
:mod:`psring.core.fold`, which does not depend on slice or block boundaries: the small
path and parameter-server shards fold the same bits.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

import numpy as np

from ...core.arrays import byte_view, pooled_empty, result_empty
from ...core.fold import Layout, fold_rows, reduce_op, ring_chunk_bounds
from ...core.reduceop import OPS
from ...errors import ProtocolError
from ...transport.connection import Connection
from ..collective import Collective
from .chooser import Algorithm, Call
from .constants import HIER, HIER_BLOCK, HIER_DEPTH
from .paths import Path


class Hierarchical(Algorithm):
    """The HIERARCHICAL route: all_reduce in two levels across hosts."""

    route = Path.HIERARCHICAL

    def eligible(self, call: Call) -> bool:
        return self.ctx.loop_path(call.nbytes) is Path.HIERARCHICAL

    def hosts(self) -> Layout | None:
        """The hosts, when this group's all_reduces go hierarchical (the whole job's group only)."""
        return self.net.hosts if self.gid == "0" else None

    async def run(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray:
        hosts = self.net.hosts
        assert hosts is not None
        me: int = self.rank
        home = next(h for h in hosts if me in h)
        local = home.index(me)
        cross = [h[local] for h in hosts]  # this rank's counterparts, one per host, in host order
        peers = sorted({*home, *cross} - {me})
        conns = dict(zip(peers, await self.ctx.links(peers), strict=True))
        out = result_empty(x)  # recycled when large, as the flat ring's: no page faults per call
        ufunc = reduce_op(op)
        per_block = max(len(home) * len(hosts), HIER_BLOCK // max(x.itemsize, 1))
        blocks = [(a, min(a + per_block, x.size)) for a in range(0, x.size, per_block)]
        room = asyncio.Semaphore(HIER_DEPTH)

        async def block(b: int, a0: int, a1: int) -> None:
            async with room:
                await self._block(coll, x[a0:a1], out[a0:a1], ufunc, op, b, home, cross, conns)

        tasks = [asyncio.ensure_future(block(b, a0, a1)) for b, (a0, a1) in enumerate(blocks)]
        try:
            await asyncio.gather(*tasks)
        finally:
            for task in tasks:
                task.cancel()
        return out

    async def _block(
        self,
        coll: Collective,
        x: np.ndarray,
        out: np.ndarray,
        ufunc: np.ufunc,
        op: str,
        b: int,
        home: tuple[int, ...],
        cross: list[int],
        conns: dict[int, Connection],
    ) -> None:
        me: int = self.rank
        n_hosts, local = len(cross), home.index(me)
        here = cross.index(me)  # this rank's host, by number
        slices = ring_chunk_bounds(x.size, len(home))
        s, e = slices[local]
        subs = [(s + c, s + d) for c, d in ring_chunk_bounds(e - s, n_hosts)]
        cs, ce = subs[here]
        phase = HIER + 4 * b
        # every receive is posted first, so payloads land in place
        gathered = {q: pooled_empty(e - s, x.dtype) for q in home if q != me}
        partials = {r: pooled_empty(ce - cs, x.dtype) for r in cross if r != me}
        post = functools.partial(self._post, coll)
        step1 = post(phase, gathered)
        step2 = post(phase + 1, partials)
        step3 = post(phase + 2, {r: out[a:z] for r, (a, z) in zip(cross, subs, strict=True) if r != me})
        step4 = post(phase + 3, {q: out[a:z] for q, (a, z) in zip(home, slices, strict=True) if q != me})
        # 1: slice j of this host's ranks to local rank j; fold them in rank order
        await self._send(coll, phase, conns, {q: x[a:z] for q, (a, z) in zip(home, slices, strict=True) if q != me})
        await step1
        host_sum = fold_rows([x[s:e] if q == me else gathered[q] for q in home], ufunc, pooled_empty(e - s, x.dtype))
        del gathered
        # 2: sub-chunk k of it to host k's rank; fold the hosts in order
        await self._send(
            coll,
            phase + 1,
            conns,
            {r: host_sum[a - s : z - s] for r, (a, z) in zip(cross, subs, strict=True) if r != me},
        )
        await step2
        mine = fold_rows([host_sum[cs - s : ce - s] if r == me else partials[r] for r in cross], ufunc, out[cs:ce])
        OPS[op].finish(mine, len(home) * n_hosts)
        # 3: the finished sub-chunk to the other hosts; 4: the finished slice to this host's ranks
        await self._send(coll, phase + 2, conns, {r: mine for r in cross if r != me})
        await step3
        await self._send(coll, phase + 3, conns, {q: out[s:e] for q in home if q != me})
        await step4

    def _post(self, coll: Collective, phase: int, into: dict[int, np.ndarray]) -> asyncio.Future[None]:
        """Post one receive per sender, straight into its buffer; the future is done when all are in."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        left = len(into)
        if not left:
            done.set_result(None)
            return done
        gid, seq = self.gid, coll.seq
        for src in into:
            coll.expect_from(src)

        def arrived(conn: Connection, header: dict[str, Any], payload: Any) -> None:
            nonlocal left
            src = header["tag"][3]
            want = into[src].nbytes
            if header["nbytes"] != want:
                coll.fail(ProtocolError(f"rank {src} sent {header['nbytes']} bytes for {coll.label}, expected {want}"))
                return
            coll.arrived_from(src)  # all of its frames so far in: its leaving costs nothing now
            left -= 1
            if left == 0 and not done.done():
                done.set_result(None)

        post = self.ctx.mailbox.post
        for src, buf in into.items():
            post((gid, seq, phase, src), byte_view(buf) if buf.nbytes else None, arrived)
        return done

    async def _send(
        self, coll: Collective, phase: int, conns: dict[int, Connection], parts: dict[int, np.ndarray]
    ) -> None:
        me = self.rank
        for dst, part in parts.items():  # a header each: send_frame writes its size into it
            conns[dst].send_frame(self.ctx.header(coll, phase, me), byte_view(part) if part.nbytes else None)
        for dst in parts:
            await conns[dst].flush()
