"""The ring's board path: small all_reduces between the ranks of one host through shared-memory
posting boards (psring.transport.board), from the event loop or straight from the caller's thread.

Every rank posts its tensor on its own board and reads every other rank's post, then folds in the
canonical order (the bits of every other path). From SPLIT_BYTES on, the fold is split as a ring
splits it: rank r folds only ring chunk r, reading every peer's post of it in place, and writes the
result over its own post's copy of that chunk (no other rank reads it), marks its post, and copies
its peers' folded chunks once they are all marked: each rank reads about twice the tensor instead of
N times it. Which all_reduces take it depends only on the call
(the job's group, no compression, at most the board's bytes), so every rank takes it for the same
calls and numbers their posts alike. A rank waits for its peers' posts by polling shared memory:
spinning for up to PSRING_SPIN_US (a lone rank in its process), then asleep until a peer that
posted pokes it over the same-host link (a short timed sleep covers a poke that crossed its
going to sleep).

The blocking API (``psring.init()``) runs the call on the caller's thread when nothing else of the
group is in flight (:meth:`BoardPath.all_reduce_now`): it posts, and when every peer's post comes
within its spin it folds there, with no hop to the event loop and back (which costs more than the
exchange itself). A call whose peers are late is handed to the event loop where it stands, and from
there on is a collective like any other: timed out, reported when it stalls, abandoned on an abort.

An all_reduce from PSRING_RING_STREAM up (every rank native and offering it: Board.attach) is *streamed*:
posted as a board call is (its post carries no payload), then the split fold runs a block at a time
through the slots in C (Board.stream), on the board's own thread with the GIL released, so
each block is copied in, folded and copied out while it is in the caches. Measured on this 2-core VM,
64 MiB, alternating: 2 ranks 14.3-16.8 ms against the data plane's 20.4-22.6, 4 ranks 31.0-35.5 against
58.2-60.4 (docs/performance.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from ...core import wire
from ...core.arrays import byte_view, dtype_name, result_empty
from ...core.fold import canonical_fold, check_op, finish_avg, fold_rows, reduce_op, ring_chunk_bounds
from ...errors import GroupClosedError, MismatchError
from ...transport.board import Board
from ..collective import Collective, mismatch_message
from ..recorder import OBSERVERS
from ..runtime import RECENT
from .constants import BOARD_HERE, BOARD_WAKE, MESH_EARLY_MAX
from .net import PeerNet

if TYPE_CHECKING:
    from .host import RingHost as _Host
else:
    _Host = object

#: the call descriptor of a wake-up message (it carries no call; messages must name one)
_WAKE = ("wake", None, None, None, None)
#: the longest a waiting rank sleeps before it looks at the board again (a poke may cross its sleep)
NAP = 0.002
#: board all_reduces of this many bytes or more split the fold over the ranks (measured, 4 ranks on this
#: VM: below it the second wait costs more than the fold it saves)
SPLIT_BYTES = 64 << 10
#: a rank spins PSRING_SPIN_US plus this per byte the call moves on the host (its size times the ranks)
#: before it sleeps: a peer is late by the copy and fold of a larger call, and waking an asleep rank
#: through the loop costs more than that (measured, 1 MiB at 4 ranks: 0.98 ms a call spinning, 2.4 ms
#: with half of them put to sleep after 500 us)
SPIN_PER_BYTE = 1e-9
#: and at most this much in all (a spinning rank takes a core its late peers may need)
SPIN_MAX = 0.02
#: polls of the board before the spin starts yielding the core between them (each yield is a syscall,
#: which on a VM costs more than the wait for a peer running on another core)
#: (only where every rank of the host can have a core of its own: else a poll holds a core a peer needs)
HOT_POLLS = 20
CORES = os.cpu_count() or 1
#: a streamed call moves this many bytes of the tensor through the slots at a time (every rank's piece of
#: each ring chunk): measured on this VM, 64 MiB at 2 and 4 ranks, 256 KiB beat 1 and 4 MiB
STREAM_BLOCK = 256 << 10
#: a streamed call's result from this size is written with streaming stores (it would leave the caches;
#: measured at 16 MiB, 4 ranks: 7.8-9.2 ms against 9.9-10.6)
STREAM_NT = 8 << 20
#: seconds a streamed call polls at one wait before the loop looks at its collective (then it goes on)
STREAM_WAIT = 0.05


class BoardPath(_Host):
    """Part of :class:`~psring.topology.ring.group.RingGroup`: small all_reduces through the boards."""

    def _init_board(self) -> None:
        self._unposted: set[int] = set()  # the loop's board calls begun and not posted yet, in call order
        #: calls that took the short way (_board_start) and ended there, and those the loop took over
        self.board_now = 0
        self.board_adopted = 0
        self._wake_futs: set[asyncio.Future[None]] = set()  # the loop's sleepers
        self._tags: dict[tuple[Any, ...], bytes] = {}
        self._valid: set[tuple[str, np.dtype]] = set()
        #: by (dtype, shape, op): (call, tag, the native fold's letter, split) where _board_quick takes it, else False
        self._quick: dict[tuple[Any, ...], tuple[tuple[Any, ...], bytes, str, bool, int, float] | bool] = {}
        self._wake_msg = wire.encode_message((self.gid, 0, BOARD_WAKE, _WAKE), None)
        #: a streamed call is running (the next one posts after it ended: every rank runs them in call order)
        self._streaming = False
        self.streamed = 0  # streamed calls that ended here

    def _board(self, x: Any, compression: str | None) -> Board | None:
        """The board, when this call takes it (the same answer on every rank for the same call)."""
        board = self.net.board
        if (
            board is None
            or compression is not None
            or self.gid != "0"
            or type(x) is not np.ndarray
            or x.nbytes > board.limit
        ):
            return None
        return board

    def _tag(self, desc: tuple[Any, ...]) -> bytes:
        tag = self._tags.get(desc)
        if tag is None:
            tag = msgpack.packb(desc)
            if len(self._tags) < 1024:
                self._tags[desc] = tag
        return tag

    def _checked(self, x: np.ndarray, op: str) -> np.ndarray:
        key = (op, x.dtype)
        if key not in self._valid:
            dtype_name(x.dtype)  # TypeError for a dtype psring does not carry, as on every path
            check_op(op, x.dtype)
            self._valid.add(key)
        return x if x.flags.c_contiguous else np.ascontiguousarray(x)

    # ---------------------------------------------------------------- the loop
    async def _board_all_reduce(self, board: Board, x: np.ndarray, op: str) -> np.ndarray:
        soon = self.all_reduce_soon(x, op)  # nothing else in flight: no Collective, no timer
        if soon is not None:
            done, value = soon
            return value if done else await value
        x = self._checked(x, op)
        coll = self._begin("all_reduce", x, op)
        self._unposted.add(coll.seq)
        try:
            return await self._run(coll, self._board_body(coll, board, x, op))
        finally:
            self._unposted.discard(coll.seq)
            if self._wake_futs:  # a call after it may wait for its turn
                self.on_board_wake()

    async def _board_body(self, coll: Collective, board: Board, x: np.ndarray, op: str) -> np.ndarray:
        k = coll.seq
        unposted = self._unposted
        if min(unposted) != k or not board.clear_to_post(k):  # calls still in flight before it (async_op)
            await self._board_sleep(lambda: min(unposted) == k and board.clear_to_post(k), board, -1)
        self._board_post(board, k, coll.desc, x)
        unposted.discard(k)
        if self._wake_futs:
            self.on_board_wake()
        return await self._board_rest(coll, board, x, op)

    async def _board_rest(
        self, coll: Collective, board: Board, x: np.ndarray, op: str, folded: bool = False
    ) -> np.ndarray:
        """Posted: wait for every peer's post, then fold (split: fold this rank's chunk, then wait for
        every peer's mark and gather; ``folded``: this rank's chunk is folded and marked already)."""
        k = coll.seq
        if not folded:
            await self._board_all_posted(coll, board, x.nbytes)
            if not self._board_split(x):
                return self._board_fold(board, k, coll.desc, x, op)
            self._board_fold_mine(board, k, coll.desc, x, op)
        if not board.all_marked(k):
            await self._board_sleep(lambda: board.all_marked(k), board, k, coll, marked=True, nbytes=x.nbytes)
            coll.waiting_on.clear()
        return self._board_gather(board, k, x)

    async def _board_all_posted(self, coll: Collective, board: Board, nbytes: int) -> None:
        """Until every peer posted coll's number (asleep past the spin; ``coll.waiting_on`` names who has not)."""
        k = coll.seq
        if not board.all_posted(k):
            if self._mesh_early:  # a peer's message for this number that came first: another call?
                self._check_early(coll)
            await self._board_sleep(lambda: board.all_posted(k), board, k, coll, nbytes=nbytes)
            coll.waiting_on.clear()

    async def _board_adopt(
        self, board: Board, seq: int, x: np.ndarray, op: str, started: float, folded: bool = False
    ) -> np.ndarray:
        """A call _board_start numbered and posted, and whose peers were not all there within its
        spin: from here on a collective like any other (deadline, stall reports, aborts)."""
        coll = self._begin("all_reduce", x, op, seq=seq)
        coll.started, coll.deadline = started, started + self.timeout
        return await self._run(coll, self._board_rest(coll, board, x, op, folded))

    async def _board_sleep(
        self,
        ready: Any,
        board: Board,
        k: int,
        coll: Collective | None = None,
        marked: bool = False,
        nbytes: int = 0,
    ) -> None:
        """Until ready(): spin (a lone rank), then sleep until poked (k >= 0: waiting on post k, or
        with ``marked`` on its marks) or NAP; with ``coll``, keep its ``waiting_on`` (who has not posted
        or marked k) for a timeout to name."""
        if self.net.config.spin_us > 0 and PeerNet.live == 1:
            if self.world_size <= CORES:
                for _ in range(HOT_POLLS):  # as _board_spin
                    if ready():
                        return
            end = time.perf_counter() + self._spin_budget(nbytes)
            while time.perf_counter() < end:
                if ready():
                    return
                os.sched_yield()
        loop = asyncio.get_running_loop()
        told = False
        while not ready():
            if coll is not None:
                missing = board.unmarked(k) if marked else board.missing(k)
                coll.waiting_on = {self._local[p] for p in missing}
                if not told and not marked and self.net.mesh is not None:  # a peer in another call there says so now
                    told = True
                    here = wire.encode_message((self.gid, k, BOARD_HERE, coll.desc), None)
                    for peer in missing:
                        self.net.mesh.poke(peer, here)
            fut = loop.create_future()
            self._wake_futs.add(fut)
            if k >= 0:
                board.sleep_on(k, marked)
            try:
                if ready():
                    return
                handle = loop.call_later(NAP, _settle, fut)
                try:
                    await fut
                finally:
                    handle.cancel()
            finally:
                if k >= 0:
                    board.sleep_on(-1)
                self._wake_futs.discard(fut)

    # ------------------------------------------------------------- streamed calls
    def _stream_kind(self, x: Any, op: str, compression: str | None) -> str | None:
        """The native fold's letter where this all_reduce is streamed through the boards (the same answer
        on every rank: its size, dtype and op, and what the ranks agreed), else None."""
        board = self.net.board
        if (
            board is None
            or board.stream_min <= 0
            or compression is not None
            or self.gid != "0"
            or type(x) is not np.ndarray
            or x.nbytes < board.stream_min
            or x.size < self.world_size
            or x.ndim > 16  # (its call descriptor must fit a post's tag)
            or self._hier_hosts() is not None
        ):
            return None
        kind = board.native_kind(x.dtype, op)
        if kind is None or board.stream_depth(self._stream_piece(x) * self.world_size * x.itemsize) < 2:
            return None
        return kind

    def _stream_piece(self, x: np.ndarray) -> int:
        """Elements of each ring chunk a streamed call's block holds."""
        return max(1, STREAM_BLOCK // (self.world_size * x.itemsize))

    async def _stream_all_reduce(self, board: Board, x: np.ndarray, op: str, kind: str) -> np.ndarray:
        x = self._checked(x, op)
        if not x.flags.aligned:
            x = x.copy()
        coll = self._begin("all_reduce", x, op)
        self._unposted.add(coll.seq)
        try:
            return await self._run(coll, self._stream_body(coll, board, x, op, kind))
        finally:
            self._unposted.discard(coll.seq)
            if self._wake_futs:
                self.on_board_wake()

    async def _stream_body(self, coll: Collective, board: Board, x: np.ndarray, op: str, kind: str) -> np.ndarray:
        k = coll.seq
        unposted = self._unposted

        def turn() -> bool:  # the calls before it posted, its slot free, no streamed call running
            return min(unposted) == k and board.clear_to_post(k) and not self._streaming

        if not turn():
            await self._board_sleep(turn, board, -1)
        tag = self._tag(coll.desc)
        self._poke(board.stream_post(k, tag, x.nbytes))
        unposted.discard(k)
        self._streaming = True
        try:
            return await self._stream_rest(coll, board, x, op, kind, tag)
        finally:
            self._streaming = False
            if self._wake_futs:  # a streamed call after it waits for its turn
                self.on_board_wake()

    async def _stream_rest(
        self, coll: Collective, board: Board, x: np.ndarray, op: str, kind: str, tag: bytes
    ) -> np.ndarray:
        """Posted: wait for every peer's post, then the stream, on the board's own thread."""
        k = coll.seq
        if self._wake_futs:
            self.on_board_wake()
        await self._board_all_posted(coll, board, x.nbytes)
        peer = board.differs(k, tag, x.nbytes)
        if peer is not None:
            raise MismatchError(self._board_mismatch(board, k, peer, coll.desc))
        flat = x.reshape(-1)
        out = result_empty(flat)
        piece = self._stream_piece(x)
        depth = board.stream_depth(piece * self.world_size * x.itemsize)
        hot = HOT_POLLS if self.world_size <= CORES else 0
        nt = x.nbytes >= STREAM_NT
        loop = asyncio.get_running_loop()
        while True:
            run = loop.run_in_executor(
                board.stream_thread(), board.stream, k, self.rank, flat, out, kind, op, piece, depth, hot,
                STREAM_WAIT, nt,
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
            coll.waiting_on = {self._local[p] for p in board.stream_behind(k)}
        coll.waiting_on.clear()
        self.streamed += 1
        return out if x.ndim == 1 else out.reshape(x.shape)

    # ------------------------------------------------------- the caller's thread
    def all_reduce_now(self, x: Any, op: str = "sum", compression: str | None = None) -> Any:
        """all_reduce from the caller's thread, or ``NotImplemented`` where the call must take the
        event loop (not a board call, or something of this group in flight there).

        The thread numbers the call, posts it and, when every peer's post is there within its spin
        (a lone rank in its process; PSRING_SPIN_US), folds: nothing crosses threads. Otherwise the
        event loop takes the call over where it stands (_board_adopt) and the thread waits for it.
        """
        soon = self.all_reduce_soon(x, op, compression)
        if soon is None:
            return NotImplemented
        done, value = soon
        if done:
            return value
        assert self.net.loop is not None
        fut = asyncio.run_coroutine_threadsafe(value, self.net.loop)
        try:
            return fut.result()
        except KeyboardInterrupt:
            fut.cancel()
            raise

    def all_reduce_soon(
        self, x: Any, op: str = "sum", compression: str | None = None, plane: bool = True
    ) -> tuple[bool, Any] | None:
        """all_reduce's short way for a caller off the event loop that waits in its own way (the
        blocking API, the torch backend), when nothing of this group is in flight on the loop:
        (True, the result) when it ended on the caller's thread; (False, a coroutine to run on the
        loop) when a peer was late; None: not this call, use all_reduce. ``plane``: a data-plane job
        may run on the caller's thread too (over TCP, in C: _plane_soon) -- a caller that has other
        work to overlap with the transfer (DDP's gradient hooks) says False.

        First the quick way that took this kind of call before, straight: each layer of Python before the
        native call costs, the more for the caches a call's copies (or the other ranks on its core) leave
        cold."""
        if self.net.board is not None:
            quick = self._board_quick(x, op, compression)
            if quick is not None:
                return quick
        elif compression is None and type(x) is np.ndarray:  # between hosts
            if plane and self._two_hop_plans:
                quick = self._two_hop_fast(x, op)
                if quick is not None:
                    return quick
            if self._tcp_plans:
                quick = self._tcp_quick(x, op, None)
                if quick is not None:
                    return quick
        begun = self._board_start(x, op, compression)
        if begun is None:  # between hosts: the TCP small-message links (one hop or two), or the plane in C
            soon = self._tcp_soon(x, op, compression)
            if soon is not None or not plane:
                return soon
            soon = self._two_hop_soon(x, op, compression)
            return soon if soon is not None else self._plane_soon(x, op, compression)
        return self._board_posted(*begun, op)

    def _board_posted(
        self, board: Board, seq: int, desc: tuple[Any, ...], x: np.ndarray, started: float, op: str, late: bool = False
    ) -> tuple[bool, Any]:
        """all_reduce_soon once the call is numbered and posted (``late``: its peers were not all there
        within the spin already)."""
        if late or not (board.all_posted(seq) or self._board_spin(board, False, seq, x.nbytes)):
            self.board_adopted += 1
            return False, self._board_adopt(board, seq, x, op, started)
        if not self._board_split(x):
            self.board_now += 1
            return True, self._board_end(board, seq, desc, x, op, started)
        try:
            self._board_fold_mine(board, seq, desc, x, op)
        except BaseException as exc:
            self._board_books(board, seq, desc, started, exc)
            raise
        if board.all_marked(seq) or self._board_spin(board, True, seq, x.nbytes):
            self.board_now += 1
            return True, self._board_end(board, seq, desc, x, op, started, folded=True)
        self.board_adopted += 1
        return False, self._board_adopt(board, seq, x, op, started, folded=True)

    def _board_quick(self, x: Any, op: str, compression: str | None) -> tuple[bool, Any] | None:
        """The short way whole in one native call (Board.exchange: post, poll, check, fold in C -- the split
        fold too: this rank's chunk, the mark, the peers' folded chunks) where the board is native, folds
        the call's dtype and op, and the call is not two-level; else None, and nothing was done. A call
        whose peers are late, whose posts differ or that wakes a sleeping peer goes on as _board_start's
        would, from its post (or from its mark)."""
        board = self.net.board
        if board is None or compression is not None or self.gid != "0" or type(x) is not np.ndarray:
            return None
        key = (x.dtype, x.shape, op)
        plan = self._quick.get(key)
        if plan is None:
            plan = False
            kind = board.native_kind(x.dtype, op)
            streamed = 0 < board.stream_min <= x.nbytes
            if kind is not None and x.nbytes <= board.limit and not streamed:
                desc = ("all_reduce", dtype_name(x.dtype), tuple(x.shape), op, None)
                hot = HOT_POLLS if self.world_size <= CORES else 0
                plan = (desc, self._tag(desc), kind, self._board_split(x), hot, self._spin_budget(x.nbytes))
            if len(self._quick) < 1024:
                self._quick[key] = plan
        if plan is False or self.net.hosts is not None:
            return None
        flags = x.flags
        if not (flags.c_contiguous and flags.aligned) or not self._idle() or not board.clear_to_post(self._seq):
            return None
        desc, tag, kind, split, hot, budget = plan  # type: ignore[misc]
        if self._closed or self._broken is not None or self._departed:
            self._check_usable()  # (raises what is wrong, or finds a departed peer's calls still to run)
        seq = self._seq
        self._seq += 1
        self._reserved.add(seq)
        started = time.monotonic()
        if not (PeerNet.live == 1 and self.net.config.spin_us > 0):
            hot, budget = 0, 0.0
        out = np.empty_like(x)
        try:
            code = board.exchange(seq, tag, x, out, kind, op, self.rank, hot, budget, split)
        except BaseException as exc:
            self._board_books(board, seq, desc, started, exc)
            raise
        if code == 0:
            self.board_now += 1
            self._board_books(board, seq, desc, started, None)
            return True, out
        if code == 3:
            self._poke(board.sleepers(seq))
        if code <= 3:
            return self._board_posted(board, seq, desc, x, started, op, late=code == 1)
        # split: this rank's chunk folded and marked, the peers' marks not all there within the spin
        if code == 4:
            self._poke(board.sleepers(seq, marked=True))
            if board.all_marked(seq) or self._board_spin(board, True, seq, x.nbytes):
                self.board_now += 1
                return True, self._board_end(board, seq, desc, x, op, started, folded=True)
        self.board_adopted += 1
        return False, self._board_adopt(board, seq, x, op, started, folded=True)

    def _board_start(
        self, x: Any, op: str, compression: str | None
    ) -> tuple[Board, int, tuple[Any, ...], np.ndarray, float] | None:
        """The short way (any thread, nothing of this group in flight): number the call and post it;
        (board, seq, call, x, when it began), or None: take the long way (_board_all_reduce)."""
        board = self._board(x, compression)
        if board is None or not self._idle() or not board.clear_to_post(self._seq):
            return None
        if board.stream_min and x.nbytes >= board.stream_min and self._stream_kind(x, op, compression) is not None:
            return None  # streamed, from the loop
        x, seq, desc, started = self._number_now(x, op)
        self._board_post(board, seq, desc, x)
        return board, seq, desc, x, started

    def _board_end(
        self,
        board: Board,
        seq: int,
        desc: tuple[Any, ...],
        x: np.ndarray,
        op: str,
        started: float,
        folded: bool = False,
    ) -> np.ndarray:
        """Fold (``folded``: gather) a call _board_start numbered and found ready, and close its books."""
        error: BaseException | None = None
        try:
            return self._board_gather(board, seq, x) if folded else self._board_fold(board, seq, desc, x, op)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._board_books(board, seq, desc, started, error)

    def _board_books(
        self, board: Board, seq: int, desc: tuple[Any, ...], started: float, error: BaseException | None
    ) -> None:
        """A board call the caller's thread ended: its books (_books_now), and the board acked."""
        self._books_now(seq, desc, started, error)
        board.ack(self.stopped_at() - 1)

    # ------------------------------------------------- the caller's thread, any short way (board, tcpnow)
    def _idle(self) -> bool:
        """Whether a call may take a short way on the caller's thread now: this rank runs a loop and
        nothing of the group is in flight there, numbered for later, or failed and not yet raised."""
        return (
            self.net.loop is not None
            and not self._active
            and not self._reserved
            and not self._aborted
            and self._late_error is None
        )

    def _number_now(self, x: np.ndarray, op: str) -> tuple[np.ndarray, int, tuple[Any, ...], float]:
        """Check an all_reduce a short way takes and number it: (x, contiguous; its number; its call
        descriptor; when it began). The number is reserved, so a peer's abort or early frame for it is
        kept, as for any number taken, until _books_now (or the loop's adoption) releases it."""
        x = self._checked(x, op)
        self._check_usable()
        seq = self._seq
        self._seq += 1
        self._reserved.add(seq)
        return x, seq, ("all_reduce", dtype_name(x.dtype), tuple(x.shape), op, None), time.monotonic()

    def _books_now(self, seq: int, desc: tuple[Any, ...], started: float, error: BaseException | None) -> None:
        """A call a short way ended on the caller's thread: as the loop's _end would (its number
        released, kept among the recent calls, observers told)."""
        self._reserved.discard(seq)
        self._recent[seq & (RECENT - 1)] = (seq, desc, error is None, time.monotonic())
        if OBSERVERS:
            self._observe(SimpleNamespace(seq=seq, desc=desc, started=started), error)  # type: ignore[arg-type]

    def _board_spin(self, board: Board, marked: bool, k: int, nbytes: int) -> bool:
        """Poll until every peer's post k is there (``marked``: marked) for up to PSRING_SPIN_US and the
        call's share (SPIN_PER_BYTE; a lone rank in its process); whether it came true."""
        if self.net.config.spin_us <= 0 or PeerNet.live != 1:
            return False
        hot = HOT_POLLS if self.world_size <= CORES else 0
        got = board.spin(k, marked, hot, self._spin_budget(nbytes))  # in C where the board is native
        if got is not None:
            return got
        ready = board.all_marked if marked else board.all_posted
        for _ in range(hot):  # a peer on another core posts within these: no syscall in between
            if ready(k):
                return True
        end = time.perf_counter() + self._spin_budget(nbytes)
        while time.perf_counter() < end:
            os.sched_yield()
            if ready(k):
                return True
        return False

    # ------------------------------------------------------------------ shared
    def _spin_budget(self, nbytes: int) -> float:
        """Seconds a waiting rank polls before it sleeps: PSRING_SPIN_US and the call's share."""
        return min(self.net.config.spin_s + nbytes * self.world_size * SPIN_PER_BYTE, SPIN_MAX)

    def _board_post(self, board: Board, k: int, desc: tuple[Any, ...], x: np.ndarray) -> None:
        self._poke(board.post(k, self._tag(desc), byte_view(x) if x.nbytes else None))

    def _poke(self, sleepers: list[int]) -> None:
        """Wake the peers asleep on what this rank just posted or marked."""
        if sleepers and self.net.mesh is not None:
            for peer in sleepers:
                self.net.mesh.poke(peer, self._wake_msg)

    def _board_rows(self, board: Board, k: int, x: np.ndarray) -> list[np.ndarray]:
        """Every rank's post k as flat arrays in rank order, this rank's own (writable) among them."""
        parts = board.arrays(k, x.dtype, x.size)
        return [*parts[: self.rank], board.own_array(k, x.dtype, x.size), *parts[self.rank :]]

    def _board_fold(self, board: Board, k: int, desc: tuple[Any, ...], x: np.ndarray, op: str) -> np.ndarray:
        """Every rank's post k, folded in the canonical order (read in place: the peers keep their
        posts until this rank finishes k)."""
        me = self.rank
        peer = board.differs(k, self._tag(desc), x.nbytes)
        if peer is not None:
            raise MismatchError(self._board_mismatch(board, k, peer, desc))
        flat = x.reshape(-1) if x.ndim != 1 else x
        out = np.empty_like(flat)
        hosts = self._hier_hosts()
        if hosts is None and board.fold(k, me, flat, out, op):  # in C, where the board is native
            return out if x.ndim == 1 else out.reshape(x.shape)
        parts = board.arrays(k, x.dtype, flat.size)
        board.bytes_read += x.nbytes * len(parts)
        parts = [*parts[:me], flat, *parts[me:]]
        out = canonical_fold(parts, op, out, hosts=hosts)  # views: no row copied
        return out if x.ndim == 1 else out.reshape(x.shape)

    def _board_split(self, x: np.ndarray) -> bool:
        """Whether this board call splits its fold over the ranks (the same answer on every rank)."""
        return x.nbytes >= SPLIT_BYTES and x.size >= self.world_size and self._hier_hosts() is None

    def _board_fold_mine(self, board: Board, k: int, desc: tuple[Any, ...], x: np.ndarray, op: str) -> None:
        """Split fold, first half: check every post k, fold ring chunk ``rank`` of them (canonical order:
        this rank's first, from x, then the next ranks') over this rank's own post of that chunk, and mark it."""
        me, n = self.rank, self.world_size
        peer = board.differs(k, self._tag(desc), x.nbytes)
        if peer is not None:
            raise MismatchError(self._board_mismatch(board, k, peer, desc))
        parts = self._board_rows(board, k, x)
        a, b = ring_chunk_bounds(x.size, n)[me]
        mine = parts[me][a:b]
        # this rank's own chunk read from x: a native post leaves it out of the board (Board.exchange, split)
        own = x.reshape(-1)[a:b]
        fold_rows([own, *(parts[(me + j) % n][a:b] for j in range(1, n))], reduce_op(op), mine)
        if op == "avg":
            finish_avg(mine, n)
        board.bytes_read += (b - a) * x.itemsize * (n - 1)
        board.mark(k)
        self._poke(board.sleepers(k, marked=True))

    def _board_gather(self, board: Board, k: int, x: np.ndarray) -> np.ndarray:
        """Split fold, second half: every rank's folded chunk (all marked), copied out in rank order."""
        parts = self._board_rows(board, k, x)
        out = np.empty(x.size, x.dtype)
        for r, (a, b) in enumerate(ring_chunk_bounds(x.size, self.world_size)):
            out[a:b] = parts[r][a:b]
            if r != self.rank:
                board.bytes_read += (b - a) * x.itemsize
        return out if x.ndim == 1 else out.reshape(x.shape)

    def _board_mismatch(self, board: Board, seq: int, peer: int, desc: tuple[Any, ...]) -> str:
        src = self._local[peer]
        their_seq, their_tag = board.read(peer, seq)
        try:
            call = msgpack.unpackb(their_tag, use_list=False)
        except Exception:
            call = None
        if their_seq == seq:
            return mismatch_message(seq, src, call, self.rank, desc)
        return (
            f"rank {src} called all_reduce as collective #{their_seq}, rank {self.rank} as #{seq}: the ranks' "
            "calls diverged before it (every rank must make the same calls, in the same order)"
        )

    def on_board_wake(self) -> None:
        """A peer posted what this rank may be sleeping on (the loop thread)."""
        for fut in self._wake_futs:
            if not fut.done():
                fut.set_result(None)

    def on_board_here(self, peer: int, seq: int, call: tuple[Any, ...]) -> None:
        """Peer waits on the board for this rank's post of collective seq, as ``call``: if this rank
        is in (or was in) another call there, that is a mismatch to name now, not a stall."""
        src = self._local.get(peer)
        if src is None:
            return
        coll = self._active.get(seq)
        if coll is not None:
            if call != coll.desc and not coll.done.done():
                self._abort_everywhere(coll, self._mismatch_error(coll, src, call), "mismatch")
        elif seq < self._seq and seq not in self._reserved:
            self.on_stray(seq, call, src)  # ended here: a mismatch found late, if the calls differ
        elif len(self._mesh_early) < MESH_EARLY_MAX:  # not begun: a one-hop call there checks it (_check_early)
            self._mesh_early[(seq, BOARD_HERE, src)] = (call, b"")

    def _end(self, coll: Collective, ok: bool) -> None:
        super()._end(coll, ok)
        board = self.net.board
        if board is not None and self.gid == "0":
            board.ack(self.stopped_at() - 1)  # every collective up to there ended: their slots may be reused


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
