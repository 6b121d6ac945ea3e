"""The ring's board path: small all_reduces between the ranks of one host through shared-memory
posting boards (psring.transport.shmboard), from the event loop or straight from the caller's thread.

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
group is in flight (:meth:`BoardAllReduce.soon`): it posts, and when every peer's post comes
within its spin it folds there, with no hop to the event loop and back (which costs more than the
exchange itself). A call whose peers are late is handed to the event loop where it stands, and from
there on is a collective like any other: timed out, reported when it stalls, abandoned on an abort.
Large all_reduces stream through the same boards: ring.streamed.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import TYPE_CHECKING, Any

import msgpack
import numpy as np

from ...core import wire
from ...core.arrays import byte_view, dtype_name
from ...core.fold import canonical_fold, fold_rows, reduce_op, ring_chunk_bounds
from ...core.reduceop import OPS
from ...errors import MismatchError
from ...transport.shmboard import Board
from ..collective import Collective, mismatch_message
from ..now import Carry, Done, Now
from .chooser import Algorithm, Call
from .constants import BOARD_HERE, BOARD_WAKE, MESH_EARLY_MAX
from .net import PeerNet
from .paths import Path

if TYPE_CHECKING:
    from .context import RingContext
    from .exchange import Exchange
    from .hier import Hierarchical
    from .shortways import ShortWays

#: the call descriptor of a wake-up message (it carries no call; messages must name one)
_WAKE = ("wake", None, None, None, None, None)
#: the longest a waiting rank sleeps before it looks at the board again (a poke may cross its sleep)
NAP = 0.002
#: board all_reduces of this many bytes or more split the fold over the ranks (below it the second wait
#: costs more than the fold it saves; measured side by side at 4 ranks)
SPLIT_BYTES = 64 << 10
#: polls of the board before the spin starts yielding the core between them (each yield is a syscall,
#: which on a VM costs more than the wait for a peer running on another core)
#: (only where every rank of the host can have a core of its own: else a poll holds a core a peer needs)
HOT_POLLS = 20
CORES = os.cpu_count() or 1


class BoardAllReduce(Algorithm):
    """All_reduces between the ranks of one host through their shared-memory boards (ring.chooser's
    BOARD route): from the loop, or from the caller's thread (:meth:`soon`)."""

    route = Path.BOARD

    def __init__(self, ctx: RingContext, short: ShortWays, exchange: Exchange, hier: Hierarchical) -> None:
        super().__init__(ctx)
        self.short, self.exchange, self.hier = short, exchange, hier
        self.unposted: set[int] = set()  # the loop's board calls begun and not posted yet, in call order
        #: calls that took the short way (start) and ended there, and those the loop took over
        self.ran_now = 0
        self.adopted = 0
        self.wake_futs: set[asyncio.Future[None]] = set()  # the loop's sleepers
        self._tags: dict[tuple[Any, ...], bytes] = {}
        #: by (dtype, shape, op): (call, tag, the native fold's letter, split) where quick takes it, else False
        self._quick: dict[tuple[Any, ...], tuple[tuple[Any, ...], bytes, str, bool, int, float] | bool] = {}
        self._wake_msg = wire.encode_message((self.gid, 0, BOARD_WAKE, _WAKE), None)

    def eligible(self, call: Call) -> bool:
        board = self.net.board
        return board is not None and call.world and call.numpy and call.nbytes <= board.limit

    def _board(self, x: Any) -> Board | None:
        """The board, when this call takes it (the same answer on every rank for the same call)."""
        board = self.net.board
        if board is None or self.gid != "0" or type(x) is not np.ndarray or x.nbytes > board.limit:
            return None
        return board

    def soon(self, x: np.ndarray, op: str, on_loop: bool = False) -> Now:
        """The short way: the whole call in one native call (quick) where it can, else numbered and
        posted here (start), folded here when every peer's post comes within the spin (posted)."""
        quick = self.quick(x, op)
        if quick is not None:
            return quick
        begun = self.start(x, op)
        return None if begun is None else self.posted(*begun, op)

    async def all_reduce(self, x: np.ndarray, op: str) -> np.ndarray:
        """The call from the loop, as a collective (numbered in call order: it posts after the calls
        begun before it, whichever way they went)."""
        board = self.net.board
        assert board is not None
        x = self.short.checked(x, op)
        coll = self.rt.begin("all_reduce", x, op)
        self.unposted.add(coll.seq)
        try:
            return await self.rt.run(coll, self._body(coll, board, x, op))
        finally:
            self.unposted.discard(coll.seq)
            if self.wake_futs:  # a call after it may wait for its turn
                self.on_wake()

    async def run(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray:
        board = self.net.board
        assert board is not None
        self.unposted.add(coll.seq)
        try:
            return await self._body(coll, board, x, op)
        finally:
            self.unposted.discard(coll.seq)
            if self.wake_futs:
                self.on_wake()

    def tag(self, desc: tuple[Any, ...]) -> bytes:
        tag = self._tags.get(desc)
        if tag is None:
            tag = msgpack.packb(desc)
            if len(self._tags) < 1024:
                self._tags[desc] = tag
        return tag

    async def _body(self, coll: Collective, board: Board, x: np.ndarray, op: str) -> np.ndarray:
        k = coll.seq
        unposted = self.unposted
        if min(unposted) != k or not board.clear_to_post(k):  # calls still in flight before it (async_op)
            await self.sleep(lambda: min(unposted) == k and board.clear_to_post(k), board, -1)
        self._post(board, k, coll.desc, x)
        unposted.discard(k)
        if self.wake_futs:
            self.on_wake()
        return await self._rest(coll, board, x, op)

    async def _rest(self, coll: Collective, board: Board, x: np.ndarray, op: str, folded: bool = False) -> np.ndarray:
        """Posted: wait for every peer's post, then fold (split: fold this rank's chunk, then wait for
        every peer's mark and gather; ``folded``: this rank's chunk is folded and marked already)."""
        k = coll.seq
        if not folded:
            await self.all_posted(coll, board, x.nbytes)
            if not self._split(x):
                return self._fold(board, k, coll.desc, x, op)
            self._fold_mine(board, k, coll.desc, x, op)
        if not board.all_marked(k):
            await self.sleep(lambda: board.all_marked(k), board, k, coll, marked=True, nbytes=x.nbytes)
            coll.waiting_on.clear()
        return self._gather(board, k, x)

    async def all_posted(self, coll: Collective, board: Board, nbytes: int) -> None:
        """Until every peer posted coll's number (asleep past the spin; ``coll.waiting_on`` names who has not)."""
        k = coll.seq
        if not board.all_posted(k):
            if self.exchange.early:  # a peer's message for this number that came first: another call?
                self.exchange.check_early(coll)
            await self.sleep(lambda: board.all_posted(k), board, k, coll, nbytes=nbytes)
            coll.waiting_on.clear()

    async def _adopt(
        self, board: Board, seq: int, x: np.ndarray, op: str, started: float, folded: bool = False
    ) -> np.ndarray:
        """A call start numbered and posted, and whose peers were not all there within its
        spin: from here on a collective like any other (deadline, stall reports, aborts)."""
        coll = self.rt.begin("all_reduce", x, op, seq=seq, started=started)
        return await self.rt.run(coll, self._rest(coll, board, x, op, folded))

    async def sleep(
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
                for _ in range(HOT_POLLS):  # as _spin
                    if ready():
                        return
            end = time.perf_counter() + self.short.spin_budget(nbytes)
            while time.perf_counter() < end:
                if ready():
                    return
                os.sched_yield()
        loop = asyncio.get_running_loop()
        told = False
        while not ready():
            if coll is not None:
                missing = board.unmarked(k) if marked else board.missing(k)
                coll.waiting_on = {self.ctx.local[p] for p in missing}
                # a peer in another call there says so now
                if not told and not marked and self.net.small.unix is not None:
                    told = True
                    here = wire.encode_message((self.gid, k, BOARD_HERE, coll.desc), None)
                    for peer in missing:
                        self.net.small.unix.poke(peer, here)
            fut = loop.create_future()
            self.wake_futs.add(fut)
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
                self.wake_futs.discard(fut)

    def posted(
        self, board: Board, seq: int, desc: tuple[Any, ...], x: np.ndarray, started: float, op: str, late: bool = False
    ) -> Done | Carry:
        """soon once the call is numbered and posted (``late``: its peers were not all there
        within the spin already)."""
        if late or not (board.all_posted(seq) or self._spin(board, False, seq, x.nbytes)):
            self.adopted += 1
            return Carry((self._adopt(board, seq, x, op, started),))
        if not self._split(x):
            self.ran_now += 1
            return Done((self._end_now(board, seq, desc, x, op, started),))
        try:
            self._fold_mine(board, seq, desc, x, op)
        except BaseException as exc:
            self._books(board, seq, desc, started, exc)
            raise
        if board.all_marked(seq) or self._spin(board, True, seq, x.nbytes):
            self.ran_now += 1
            return Done((self._end_now(board, seq, desc, x, op, started, folded=True),))
        self.adopted += 1
        return Carry((self._adopt(board, seq, x, op, started, folded=True),))

    def quick(self, x: Any, op: str) -> Now:
        """The short way whole in one native call (Board.exchange: post, poll, check, fold in C -- the split
        fold too: this rank's chunk, the mark, the peers' folded chunks) where the board is native, folds
        the call's dtype and op, and the call is not two-level; else None, and nothing was done. A call
        whose peers are late, whose posts differ or that wakes a sleeping peer goes on as start's
        would, from its post (or from its mark)."""
        board = self.net.board
        if board is None or self.gid != "0" or type(x) is not np.ndarray:
            return None
        key = (x.dtype, x.shape, op)
        plan = self._quick.get(key)
        if plan is None:
            plan = False
            kind = board.native_kind(x.dtype, op)
            if kind is not None and x.nbytes <= board.limit:  # (streamed calls: the chooser's, not this)
                desc = ("all_reduce", dtype_name(x.dtype), tuple(x.shape), op, None, None)
                hot = HOT_POLLS if self.world_size <= CORES else 0
                plan = (desc, self.tag(desc), kind, self._split(x), hot, self.short.spin_budget(x.nbytes))
            if len(self._quick) < 1024:
                self._quick[key] = plan
        if plan is False or self.net.hosts is not None:
            return None
        flags = x.flags
        if (
            not (flags.c_contiguous and flags.aligned)
            or not self.short.idle()
            or not board.clear_to_post(self.rt.next_seq)
        ):
            return None
        desc, tag, kind, split, hot, budget = plan  # type: ignore[misc]
        seq = self.rt.take_number()  # (raises what is wrong, or finds a departed peer's calls still to run)
        started = time.monotonic()
        if not (PeerNet.live == 1 and self.net.config.spin_us > 0):
            hot, budget = 0, 0.0
        out = np.empty_like(x)
        try:
            code = board.exchange(seq, tag, x, out, kind, op, self.rank, hot, budget, split)
        except BaseException as exc:
            self._books(board, seq, desc, started, exc)
            raise
        if code == 0:
            self.ran_now += 1
            self._books(board, seq, desc, started, None)
            return Done((out,))
        if code == 3:
            self.poke(board.sleepers(seq))
        if code <= 3:
            return self.posted(board, seq, desc, x, started, op, late=code == 1)
        # split: this rank's chunk folded and marked, the peers' marks not all there within the spin
        if code == 4:
            self.poke(board.sleepers(seq, marked=True))
            if board.all_marked(seq) or self._spin(board, True, seq, x.nbytes):
                self.ran_now += 1
                return Done((self._end_now(board, seq, desc, x, op, started, folded=True),))
        self.adopted += 1
        return Carry((self._adopt(board, seq, x, op, started, folded=True),))

    def start(self, x: Any, op: str) -> tuple[Board, int, tuple[Any, ...], np.ndarray, float] | None:
        """The short way (any thread, nothing of this group in flight): number the call and post it;
        (board, seq, call, x, when it began), or None: take the long way (all_reduce)."""
        board = self._board(x)
        if board is None or not self.short.idle(numbered=True) or not board.clear_to_post(self.rt.next_seq):
            return None
        x, seq, desc, started = self.short.number(x, op)
        self._post(board, seq, desc, x)
        return board, seq, desc, x, started

    def _end_now(
        self,
        board: Board,
        seq: int,
        desc: tuple[Any, ...],
        x: np.ndarray,
        op: str,
        started: float,
        folded: bool = False,
    ) -> np.ndarray:
        """Fold (``folded``: gather) a call start numbered and found ready, and close its books."""
        error: BaseException | None = None
        try:
            return self._gather(board, seq, x) if folded else self._fold(board, seq, desc, x, op)
        except BaseException as exc:
            error = exc
            raise
        finally:
            self._books(board, seq, desc, started, error)

    def _books(
        self, board: Board, seq: int, desc: tuple[Any, ...], started: float, error: BaseException | None
    ) -> None:
        """A board call the caller's thread ended: its books (the runtime's close_number), and the board acked."""
        self.rt.close_number(seq, desc, started, error)
        board.ack(self.rt.stopped_at() - 1)

    def _spin(self, board: Board, marked: bool, k: int, nbytes: int) -> bool:
        """Poll until every peer's post k is there (``marked``: marked) for up to PSRING_SPIN_US and the
        call's share (SPIN_PER_BYTE; a lone rank in its process); whether it came true."""
        if self.net.config.spin_us <= 0 or PeerNet.live != 1:
            return False
        hot = HOT_POLLS if self.world_size <= CORES else 0
        got = board.spin(k, marked, hot, self.short.spin_budget(nbytes))  # in C where the board is native
        if got is not None:
            return got
        ready = board.all_marked if marked else board.all_posted
        for _ in range(hot):  # a peer on another core posts within these: no syscall in between
            if ready(k):
                return True
        end = time.perf_counter() + self.short.spin_budget(nbytes)
        while time.perf_counter() < end:
            os.sched_yield()
            if ready(k):
                return True
        return False

    def _post(self, board: Board, k: int, desc: tuple[Any, ...], x: np.ndarray) -> None:
        self.poke(board.post(k, self.tag(desc), byte_view(x) if x.nbytes else None))

    def poke(self, sleepers: list[int]) -> None:
        """Wake the peers asleep on what this rank just posted or marked."""
        if sleepers and self.net.small.unix is not None:
            for peer in sleepers:
                self.net.small.unix.poke(peer, self._wake_msg)

    def _rows(self, board: Board, k: int, x: np.ndarray) -> list[np.ndarray]:
        """Every rank's post k as flat arrays in rank order, this rank's own (writable) among them."""
        parts = board.arrays(k, x.dtype, x.size)
        return [*parts[: self.rank], board.own_array(k, x.dtype, x.size), *parts[self.rank :]]

    def _fold(self, board: Board, k: int, desc: tuple[Any, ...], x: np.ndarray, op: str) -> np.ndarray:
        """Every rank's post k, folded in the canonical order (read in place: the peers keep their
        posts until this rank finishes k)."""
        me = self.rank
        peer = board.differs(k, self.tag(desc), x.nbytes)
        if peer is not None:
            raise MismatchError(self.mismatch(board, k, peer, desc))
        flat = x.reshape(-1) if x.ndim != 1 else x
        out = np.empty_like(flat)
        hosts = self.hier.hosts()
        if hosts is None and board.fold(k, me, flat, out, op):  # in C, where the board is native
            return out if x.ndim == 1 else out.reshape(x.shape)
        parts = board.arrays(k, x.dtype, flat.size)
        board.bytes_read += x.nbytes * len(parts)
        parts = [*parts[:me], flat, *parts[me:]]
        out = canonical_fold(parts, op, out, hosts=hosts)  # views: no row copied
        return out if x.ndim == 1 else out.reshape(x.shape)

    def _split(self, x: np.ndarray) -> bool:
        """Whether this board call splits its fold over the ranks (the same answer on every rank)."""
        return x.nbytes >= SPLIT_BYTES and x.size >= self.world_size and self.hier.hosts() is None

    def _fold_mine(self, board: Board, k: int, desc: tuple[Any, ...], x: np.ndarray, op: str) -> None:
        """Split fold, first half: check every post k, fold ring chunk ``rank`` of them (canonical order:
        this rank's first, from x, then the next ranks') over this rank's own post of that chunk, and mark it."""
        me, n = self.rank, self.world_size
        peer = board.differs(k, self.tag(desc), x.nbytes)
        if peer is not None:
            raise MismatchError(self.mismatch(board, k, peer, desc))
        parts = self._rows(board, k, x)
        a, b = ring_chunk_bounds(x.size, n)[me]
        mine = parts[me][a:b]
        # this rank's own chunk read from x: a native post leaves it out of the board (Board.exchange, split)
        own = x.reshape(-1)[a:b]
        fold_rows([own, *(parts[(me + j) % n][a:b] for j in range(1, n))], reduce_op(op), mine)
        OPS[op].finish(mine, n)
        board.bytes_read += (b - a) * x.itemsize * (n - 1)
        board.mark(k)
        self.poke(board.sleepers(k, marked=True))

    def _gather(self, board: Board, k: int, x: np.ndarray) -> np.ndarray:
        """Split fold, second half: every rank's folded chunk (all marked), copied out in rank order."""
        parts = self._rows(board, k, x)
        out = np.empty(x.size, x.dtype)
        for r, (a, b) in enumerate(ring_chunk_bounds(x.size, self.world_size)):
            out[a:b] = parts[r][a:b]
            if r != self.rank:
                board.bytes_read += (b - a) * x.itemsize
        return out if x.ndim == 1 else out.reshape(x.shape)

    def mismatch(self, board: Board, seq: int, peer: int, desc: tuple[Any, ...]) -> str:
        src = self.ctx.local[peer]
        their_seq, their_tag = board.read(peer, seq)
        try:
            call = msgpack.unpackb(their_tag, use_list=False)
        except Exception:  # a peer's bytes: only for the message
            call = None
        if their_seq == seq:
            return mismatch_message(seq, src, call, self.rank, desc)
        return (
            f"rank {src} called all_reduce as collective #{their_seq}, rank {self.rank} as #{seq}: the ranks' "
            "calls diverged before it (every rank must make the same calls, in the same order)"
        )

    def on_wake(self) -> None:
        """A peer posted what this rank may be sleeping on (the loop thread)."""
        for fut in self.wake_futs:
            if not fut.done():
                fut.set_result(None)

    def on_here(self, peer: int, seq: int, call: tuple[Any, ...]) -> None:
        """Peer waits on the board for this rank's post of collective seq, as ``call``: if this rank
        is in (or was in) another call there, that is a mismatch to name now, not a stall."""
        src = self.ctx.local.get(peer)
        if src is None:
            return
        coll = self.rt.active(seq)
        if coll is not None:
            if call != coll.desc and not coll.done.done():
                self.rt.abort_mismatch(coll, src, call)
        elif self.rt.ended(seq):
            self.rt.on_stray(seq, call, src)  # ended here: a mismatch found late, if the calls differ
        elif len(self.exchange.early) < MESH_EARLY_MAX:  # not begun: a one-hop call there checks it (_check_early)
            self.exchange.early[(seq, BOARD_HERE, src)] = (call, b"")

    def end(self, coll: Collective) -> None:
        """A collective of the group ended: every one up to there did, their slots may be reused."""
        board = self.net.board
        if board is not None and self.gid == "0":
            board.ack(self.rt.stopped_at() - 1)
            if self.wake_futs:  # a call after it may wait for this rank to be done with its slot
                self.on_wake()


def _settle(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
