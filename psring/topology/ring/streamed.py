"""The ring's streamed boards: large all_reduces between the ranks of one host, a block at a time.

An all_reduce from PSRING_RING_STREAM up (every rank native and offering it: Board.attach) is *streamed*:
posted as a board call is (its post carries no payload), then the split fold runs a block at a time
through the slots in C (Board.stream), on the board's own thread with the GIL released, so
each block is copied in, folded and copied out while it is in the caches: at 64 MiB about half the
data plane's time at 4 ranks (the figures: docs/performance-history.md).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING

import numpy as np

from ...core.arrays import result_empty
from ...errors import GroupClosedError, MismatchError
from ...transport.shmboard import Board
from ..collective import Collective
from .board import CORES, HOT_POLLS
from .chooser import Algorithm, Call
from .paths import Path

if TYPE_CHECKING:
    from .board import BoardAllReduce
    from .context import RingContext

#: a streamed call moves this many bytes of the tensor through the slots at a time (every rank's piece of
#: each ring chunk): small enough to overlap the ranks' copies, large enough to wait seldom
#: (docs/defaults.md#streamed-boards)
STREAM_BLOCK = 256 << 10
#: a streamed call's result from this size is written with streaming stores (it would leave the caches)
STREAM_NT = 8 << 20
#: seconds a streamed call polls at one wait before the loop looks at its collective (then it goes on)
STREAM_WAIT = 0.05
#: a rank waiting for its peers within a streamed call yields its core for STREAM_YIELD_US, then naps
#: STREAM_NAP_US between polls (board.c's st_wait): with more runnable threads than cores (a busy
#: machine, more ranks than cores) a yielding rank stays runnable and takes the core from the peer it waits
#: for, where a napping one gives it up (docs/performance-history.md, "A busy machine")
STREAM_YIELD_US = 200
STREAM_NAP_US = 50


class StreamedBoard(Algorithm):
    """Large all_reduces of one host's ranks streamed through the boards (ring.chooser's STREAMED route),
    from the loop: posted as a board call is, then folded a block at a time in C on the board's thread."""

    route = Path.STREAMED

    def __init__(self, ctx: RingContext, board: BoardAllReduce) -> None:
        super().__init__(ctx)
        #: the board calls' machinery this shares: their turn in call order, sleeping, posting, mismatches
        self.board = board
        self.short, self.hier = board.short, board.hier
        #: a streamed call is running (the next one posts after it ended: every rank runs them in call order)
        self._streaming = False
        self.ran = 0  # streamed calls that ended here

    def eligible(self, call: Call) -> bool:
        board = self.net.board
        if (
            board is None
            or board.stream_min <= 0
            or not call.world
            or not call.numpy
            or call.nbytes < board.stream_min
            or call.size < self.world_size
            or call.ndim > 16  # (its call descriptor must fit a post's tag)
            or self.hier.hosts() is not None
        ):
            return False
        kind = board.native_kind(call.dtype, call.op)
        return (
            kind is not None
            and board.stream_depth(self._piece(call.dtype.itemsize) * self.world_size * call.dtype.itemsize) >= 2
        )

    def _piece(self, itemsize: int) -> int:
        """Elements of each ring chunk a streamed call's block holds."""
        return max(1, STREAM_BLOCK // (self.world_size * itemsize))

    async def all_reduce(self, x: np.ndarray, op: str) -> np.ndarray:
        board = self.net.board
        assert board is not None  # (the chooser took this route: eligible)
        kind = board.native_kind(x.dtype, op)
        assert kind is not None
        return await self._all_reduce(board, x, op, kind)

    async def run(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray:
        board = self.net.board
        assert board is not None
        kind = board.native_kind(x.dtype, op)
        assert kind is not None
        if not x.flags.aligned:
            x = x.copy()
        self.board.unposted.add(coll.seq)
        try:
            return await self._body(coll, board, x, op, kind)
        finally:
            self.board.unposted.discard(coll.seq)
            if self.board.wake_futs:
                self.board.on_wake()

    async def _all_reduce(self, board: Board, x: np.ndarray, op: str, kind: str) -> np.ndarray:
        x = self.short.checked(x, op)
        if not x.flags.aligned:
            x = x.copy()
        coll = self.rt.begin("all_reduce", x, op)
        self.board.unposted.add(coll.seq)
        try:
            return await self.rt.run(coll, self._body(coll, board, x, op, kind))
        finally:
            self.board.unposted.discard(coll.seq)
            if self.board.wake_futs:
                self.board.on_wake()

    async def _body(self, coll: Collective, board: Board, x: np.ndarray, op: str, kind: str) -> np.ndarray:
        k = coll.seq
        unposted = self.board.unposted

        def turn() -> bool:  # the calls before it posted, its slot free, no streamed call running
            return min(unposted) == k and board.clear_to_post(k) and not self._streaming

        if not turn():
            await self.board.sleep(turn, board, -1)
        tag = self.board.tag(coll.desc)
        self.board.poke(board.stream_post(k, tag, x.nbytes))
        unposted.discard(k)
        self._streaming = True
        try:
            return await self._rest(coll, board, x, op, kind, tag)
        finally:
            self._streaming = False
            if self.board.wake_futs:  # a streamed call after it waits for its turn
                self.board.on_wake()

    async def _rest(self, coll: Collective, board: Board, x: np.ndarray, op: str, kind: str, tag: bytes) -> np.ndarray:
        """Posted: wait for every peer's post, then the stream, on the board's own thread."""
        k = coll.seq
        if self.board.wake_futs:
            self.board.on_wake()
        await self.board.all_posted(coll, board, x.nbytes)
        peer = board.differs(k, tag, x.nbytes)
        if peer is not None:
            raise MismatchError(self.board.mismatch(board, k, peer, coll.desc))
        flat = x.reshape(-1)
        out = result_empty(flat)
        piece = self._piece(x.itemsize)
        depth = board.stream_depth(piece * self.world_size * x.itemsize)
        hot = HOT_POLLS if self.world_size <= CORES else 0
        nt = x.nbytes >= STREAM_NT
        loop = asyncio.get_running_loop()
        while True:
            run = loop.run_in_executor(
                board.stream_thread(),
                board.stream,
                k,
                self.rank,
                flat,
                out,
                kind,
                op,
                piece,
                depth,
                hot,
                STREAM_WAIT,
                nt,
                STREAM_YIELD_US,
                STREAM_NAP_US,
            )
            try:
                code = await asyncio.shield(run)
            except asyncio.CancelledError:  # abandoned (a peer's abort, the deadline): the thread stops first
                board.cancel_stream()
                while not run.done():
                    with contextlib.suppress(asyncio.CancelledError):
                        await asyncio.wait([run])
                board.cancel_stream(False)
                raise
            if code == 0:
                break
            if code == 2:
                raise GroupClosedError(f"{coll.label}: the same-host board closed while the call streamed")
            coll.waiting_on = {self.ctx.local[p] for p in board.stream_behind(k)}
        coll.waiting_on.clear()
        self.ran += 1
        return out if x.ndim == 1 else out.reshape(x.shape)
