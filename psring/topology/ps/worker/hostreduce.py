"""The parameter server's all_reduce across hosts with several ranks on each: reduce within the host
before pushing, as BytePS does.

Pushed as they are, R ranks on a host each send their whole tensor's remote share to the shards
and take it back: 2 S per direction crosses a host's link at 2 hosts where the ring's hierarchical
all_reduce sends S. Here each block of the tensor goes through three steps:

1. every rank posts the block on its same-host board (psring.transport.shmboard, sized for a block);
   local rank l folds slice l (of R) of the host's posts in rank order: the host's partial P_h;
2. local rank l all_reduces P_h's slice with its counterparts on the other hosts (local rank l of
   every host) through the shards, in a subgroup whose shards fold the hosts in host order;
3. it writes the finished slice over its own post's copy of it and marks the post; each rank
   copies the other slices out of its peers' marked posts.

So only partial sums leave a host: between hosts each host sends and receives 2(H-1)/H of the
tensor, what the hierarchical ring moves. The result is the two-level order of
psring.core.fold, bit for bit the shards' own fold (and the ring's) for the same layout. A
board has two slots: the next block is posted and folded while this one is on the wire.

The ranks agree at set-up: every rank publishes its host and board, and the path is taken only
if every rank mapped the boards of its host's other ranks (else every rank pushes as before).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from ....core.arrays import byte_view, pooled_empty, result_empty
from ....core.fold import Layout, fold_rows, host_layout, reduce_op, ring_chunk_bounds
from ....core.reduceop import OPS
from ....errors import CollectiveTimeoutError, MismatchError
from ....transport.samehost import host_key, same_host_paths
from ....transport.shmboard import Board, board_possible
from ...collective import Collective

if TYPE_CHECKING:
    from .view import WorkerGroup

logger = logging.getLogger(__name__)

#: blocks in flight: a board's two slots
DEPTH = 2


def _key(prefix: str, what: str, rank: int) -> str:
    return f"{prefix}/host_reduce/{what}/{rank}"


async def offer(store: Any, prefix: str, rank: int, config: Any) -> Board | None:
    """Publish this rank's host and, where it may take the path, a board for it (before the ready
    barrier; :func:`agree` reads every rank's after it)."""
    board = None
    if config.ps_host_reduce > 0 and config.hierarchical != "off" and same_host_paths(config) and board_possible():
        try:
            board = Board(config.ps_host_block, native=config.native)
        except (OSError, ValueError) as exc:
            logger.info("rank %d: no same-host board for the ps (%s): every rank pushes its own tensor", rank, exc)
    record = {
        "where": (config.host_id or host_key()) if config.hierarchical != "off" else None,
        "host": host_key(),
        "board": board.describe() if board is not None else None,
        "block": config.ps_host_block,
        "from": config.ps_host_reduce,
    }
    await store.set(_key(prefix, "offer", rank), msgpack.packb(record))
    return board


async def agree(
    store: Any, prefix: str, rank: int, world: int, board: Board | None, timeout: float
) -> tuple[Layout, int, int] | None:
    """The hosts, the bytes of a block (the smallest any rank's board holds) and the size from which
    calls take the path (the largest any rank set: every rank takes it for the same calls), if every
    rank can reduce within its host (then this rank's board maps its host's others'); else None, on
    every rank alike, and the board is closed."""
    records = []
    for r in range(world):
        raw = await store.get(_key(prefix, "offer", r))
        records.append(msgpack.unpackb(raw) if raw else {})
    layout = host_layout([rec.get("where") for rec in records])
    if layout is None:  # every rank read the same records: none takes the path (one host, most often)
        if board is not None:
            board.close()
        return None
    ok = board is not None
    if ok:
        assert board is not None
        home = next(h for h in layout if rank in h)
        peers = {r: records[r].get("board") for r in home if r != rank}
        if any(records[r].get("host") != records[rank].get("host") or peers[r] is None for r in peers):
            ok = False  # PSRING_HOST_ID groups ranks that share no memory: they push as before
        else:
            try:
                board.attach(peers)
            except (OSError, ValueError) as exc:
                logger.info("rank %d: cannot map a same-host peer's board (%s)", rank, exc)
                ok = False
    await store.set(_key(prefix, "ok", rank), b"1" if ok else b"0")
    keys = [_key(prefix, "ok", r) for r in range(world)]
    await store.wait(keys, timeout)
    for k in keys:
        if await store.get(k) != b"1":
            ok = False
    if not ok:
        if board is not None:
            board.close()
        return None
    return layout, min(int(rec["block"]) for rec in records), max(int(rec["from"]) for rec in records)


def _shown(tag: bytes) -> str:
    """A board post's tag (seq/block/dtype/op/elements/after) as the call it is: all_reduce(sum, <f4[1000]) #3."""
    parts = tag.decode(errors="replace").split("/")
    if len(parts) != 6:
        return repr(tag)
    seq, block, dtype, op, n, after = parts
    try:
        dtype = np.dtype(dtype).name
    except TypeError:
        pass
    shown = f"all_reduce({op}, {dtype}[{n}]) #{seq} (block {block})"
    return shown if after == "None" else f"{shown}, after the call of digest {after} before it"


class HostReduce:
    """One rank's part of the ps's host-reduced all_reduce (see the module's docstring)."""

    def __init__(self, group: WorkerGroup, board: Board, hosts: Layout, block_bytes: int, min_bytes: int) -> None:
        me = group.rank
        self.group = group
        self.board = board
        self.block_bytes = block_bytes
        self.min_bytes = min_bytes  # all_reduces from this size take the path (agreed)
        self.hosts = hosts
        self.home = next(h for h in hosts if me in h)
        self.local = self.home.index(me)
        # this rank's counterparts, one a host, in host order: the subgroup's ranks are host indices
        cross = [h[self.local] for h in hosts]
        self.cross = group.make_subgroup(f"{group.gid}.host{self.local}", cross)
        self.cross.ordered = True  # its shards fold the hosts in host order, not from a ring chunk's owner
        self.next_post = 0  # board post numbers: one a block, the same sequence on every rank
        self.blocks_done = 0
        #: calls go one after another, in the order they began (their sequence numbers' order: a call
        #: reaches all_reduce without an await after taking its number): an ack covers every post before it
        self._tail: asyncio.Future[None] | None = None

    def close(self) -> None:
        self.board.close()

    async def all_reduce(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray:
        out = result_empty(x)
        per_block = max(len(self.home), self.block_bytes // max(x.itemsize, 1))
        blocks = [(a, min(a + per_block, x.size)) for a in range(0, x.size, per_block)]
        first = self.next_post
        self.next_post += len(blocks)
        before, self._tail = self._tail, asyncio.get_running_loop().create_future()
        mine = self._tail
        try:
            if before is not None and not before.done():
                await asyncio.shield(before)
            return await self._blocks(coll, x, op, out, blocks, first)
        finally:
            mine.set_result(None)
            if self._tail is mine:
                self._tail = None

    async def _blocks(
        self, coll: Collective, x: np.ndarray, op: str, out: np.ndarray, blocks: list[tuple[int, int]], first: int
    ) -> np.ndarray:
        board, home = self.board, self.home
        ufunc = reduce_op(op)
        cross_op = OPS[op].partial  # avg's partial sums are sums
        inflight: list[tuple[int, int, int, asyncio.Task[np.ndarray]]] = []
        try:
            for b, (a0, a1) in enumerate(blocks):
                k = first + b
                if len(inflight) == DEPTH:
                    await self._finish(coll, out, op, *inflight.pop(0))
                await self._wait(coll, k, board.clear_to_post, board.unacked, "read a block to its end")
                tag = f"{coll.seq}/{b}/{x.dtype.str}/{op}/{x.size}/{coll.desc[5]}".encode()  # [5]: after_of
                board.post(k, tag, byte_view(x[a0:a1]))
                await self._wait(coll, k, board.all_posted, board.missing, "post a block")
                self._check(coll, k, tag, (a1 - a0) * x.itemsize)
                sa, sb = ring_chunk_bounds(a1 - a0, len(home))[self.local]
                rows = self._rows(k, x.dtype, a1 - a0)
                partial = pooled_empty(sb - sa, x.dtype)  # recycled: no page faults per block
                fold_rows([row[sa:sb] for row in rows], ufunc, partial)
                board.bytes_read += partial.nbytes * (len(home) - 1)
                # started in block order on every rank: the subgroup's calls line up
                task = asyncio.ensure_future(self.cross.all_reduce(partial, cross_op))
                inflight.append((k, a0, a1, task))
            while inflight:
                await self._finish(coll, out, op, *inflight.pop(0))
        finally:
            for *_, task in inflight:
                task.cancel()
            for *_, task in inflight:
                with contextlib.suppress(BaseException):  # cancelled by us: nothing to hear
                    await task
        return out

    async def _finish(
        self, coll: Collective, out: np.ndarray, op: str, k: int, a0: int, a1: int, task: asyncio.Task[np.ndarray]
    ) -> None:
        board, home = self.board, self.home
        y = await task
        OPS[op].finish(y, len(home) * len(self.hosts))
        bounds = ring_chunk_bounds(a1 - a0, len(home))
        sa, sb = bounds[self.local]
        own = board.own_array(k, out.dtype, a1 - a0)
        own[sa:sb] = y
        board.mark(k)
        out[a0 + sa : a0 + sb] = y
        await self._wait(coll, k, board.all_marked, board.unmarked, "finish a slice")
        for r, row in zip(home, self._rows(k, out.dtype, a1 - a0), strict=True):
            if r != self.group.rank:
                pa, pb = bounds[home.index(r)]
                out[a0 + pa : a0 + pb] = row[pa:pb]
                board.bytes_read += (pb - pa) * out.itemsize
        board.ack(k)
        self.blocks_done += 1

    def _rows(self, k: int, dtype: np.dtype, count: int) -> list[np.ndarray]:
        """The host's posts of block k, in rank order (this rank's own among them)."""
        peers = iter(self.board.arrays(k, dtype, count))
        own = self.board.own_array(k, dtype, count)
        return [own if r == self.group.rank else next(peers) for r in self.home]

    def _check(self, coll: Collective, k: int, tag: bytes, nbytes: int) -> None:
        peer = self.board.differs(k, tag, nbytes)
        if peer is None:
            return
        _number, theirs = self.board.read(peer, k)
        err = MismatchError(
            f"{coll.label}: rank {peer} called {_shown(theirs)} where rank {self.group.rank} called {_shown(tag)} "
            f"(on their host's board): every rank must make the same calls, with the same arguments, in the "
            f"same order"
        )
        self.group.send_abort(coll.seq, err, "mismatch")  # the shards tell every rank of the job
        raise err

    async def _wait(
        self, coll: Collective, k: int, ready: Callable[[int], bool], missing: Callable[[int], list[int]], what: str
    ) -> None:
        """Poll the board until ready(k), sleeping a little longer each time (the waits are a
        block's time on the wire); the collective's deadline names the ranks still missing."""
        delay = 0.0
        while not ready(k):
            if time.monotonic() > coll.deadline:
                late = missing(k)
                raise CollectiveTimeoutError(
                    f"{coll.label} on rank {self.group.rank} timed out after {self.group.timeout:g}s: rank(s) "
                    f"{late} on this host did not {what} (a host-reduced all_reduce's same-host board)",
                    missing=tuple(late),
                )
            self.group.check_usable()
            await asyncio.sleep(delay)
            delay = min(delay * 2 or 50e-6, 2e-3)
