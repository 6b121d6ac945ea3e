"""Same-host posting boards: small messages to every rank of a host through shared memory, no syscall.

Each process keeps one *board*: a shared-memory pool (:mod:`.shmpool`) of two slots, each a
header and room for ``max_bytes`` of payload. Every peer on the host maps it read-only. A post
carries the caller's number for it ``k`` (the collective's sequence number: the same on every
rank, increasing, not every number posted) and goes into slot ``k % 2``. It is written payload
first, header fields next and its number last, so a reader that sees the number ``k`` in a
peer's slot finds the whole post there (x86's total store order keeps stores in program
order, and loads in order: on other architectures the board is not offered, see
:func:`board_possible`). Readers poll: no wake-up crosses the kernel, which is the point
(a 4-byte exchange between two processes costs a few microseconds this way, against tens
through sockets and an event loop).

A post may be *marked* once its owner rewrote part of it in place (``mark``: the spare header field
set to the post's number, written after what it covers): the ring folds one chunk of every rank's
post into its own post's copy of that chunk, marks it, and reads its peers' folded chunks once
they are all marked (a reduce-scatter and an all-gather through the same two slots).

A writer may reuse a slot only once every rank, the writer too, has finished reading what it holds:
each board's header page carries an *ack*, a number up to which its owner has finished everything
(the caller's: for a collective, every collective up to it ended), and
:meth:`Board.clear_to_post` checks every peer's and its own against what the slot holds (the owner
reads its own post back: the split fold's folded chunk).

Where the C extension ``psring._native`` is built (``setup.py``; pip builds it from the sdist where
a compiler is) and ``native`` is on (PSRING_NATIVE), posting, polling, checking and the fold of every
rank's post run in C (:meth:`Board.spin`, :meth:`Board.fold`): the same fields written in the same
order, so a native rank and a pure-Python one share a board, and the same bits.

An all_reduce too large for a post may be *streamed* through the boards where every rank is native
(:meth:`Board.stream`: the split fold a block at a time through the slot, in C, so that each block is
folded while it is in the caches): from the smallest size every rank offers (``stream`` in
:meth:`Board.describe`; 0: never), the same on every rank (:meth:`Board.attach`).

This module knows posts and peers, not collectives: the ring's board path
(``psring.topology.ring.board``) decides what a post carries.
"""

from __future__ import annotations

import contextlib
import platform
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from .shmpool import PAGE, TOKEN_BYTES, PeerPool, ShmPool

if TYPE_CHECKING:
    from .._native import NBoard
try:  # the C extension (psring/native/board.c, a leaf: it imports nothing of psring)
    from .._native import NBoard as _NBoard
except ImportError:  # not built here (no compiler where it was installed): the pure-Python path
    _NBoard = None  # type: ignore[assignment,misc]

#: the largest payload a post carries (a slot is this plus its header, page-rounded)
BOARD_BYTES = 16 << 10
#: bytes before a slot's payload: 4 int64 fields (post number, mark, payload bytes, tag bytes)
#: and the caller's tag (what the post is, to check it against the reader's own)
HEAD = 256
TAG_MAX = HEAD - 32
_ACK_AT = 64  # the owner's ack: an int64 in the pool's header page, after the token
_SLEEP_AT = 72  # the post its owner sleeps waiting on (-1: none), beside it
#: a streamed call's counters (blocks posted, folded, done: an int64 a cache line each) fill the payload's
#: first bytes, its blocks follow (psring/native/board.c, ST_*)
_STREAM_DATA = 256
#: the most blocks a streamed call keeps in flight
STREAM_DEPTH = 8
assert _ACK_AT >= TOKEN_BYTES


def native_built() -> bool:
    """Whether the C extension (psring._native) was built and imports here."""
    return _NBoard is not None


#: the dtypes the native fold takes, by the letter it knows them by
_NATIVE_KINDS = {
    np.dtype(np.float32): "f",
    np.dtype(np.float64): "d",
    np.dtype(np.int32): "i",
    np.dtype(np.uint32): "I",
    np.dtype(np.int64): "q",
    np.dtype(np.uint64): "Q",
}


def fold_kind(dtype: np.dtype, op: str) -> str | None:
    """The letter the C extension's folds know ``dtype`` by, where they fold (dtype, op) -- sum, avg
    and prod of float32/64, prod and sum of the 32- and 64-bit integers -- and it was built; else None."""
    if _NBoard is None or op not in ("sum", "avg", "prod"):
        return None
    kind = _NATIVE_KINDS.get(dtype)
    return None if kind is None or (op == "avg" and kind not in "fd") else kind


def board_possible() -> bool:
    """Whether this machine orders stores to shared memory as the board needs (x86: total store order)."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


class _Views:
    """Views of one board's fields: its own (writable) or a peer's (read-only)."""

    __slots__ = ("ack", "body", "head", "rank", "sleep", "tag")

    def __init__(self, rank: int, mem: memoryview, slot_bytes: int) -> None:
        self.rank = rank
        slots = [(PAGE + p * slot_bytes, PAGE + (p + 1) * slot_bytes) for p in (0, 1)]
        self.head = [mem[a : a + 32].cast("q") for a, _b in slots]  # post number, mark, payload bytes, tag bytes
        self.tag = [mem[a + 32 : a + HEAD] for a, _b in slots]
        self.body = [mem[a + HEAD : b] for a, b in slots]
        self.ack = mem[_ACK_AT : _ACK_AT + 8].cast("q")
        self.sleep = mem[_SLEEP_AT : _SLEEP_AT + 8].cast("q")

    def release(self) -> None:
        for v in (*self.head, *self.tag, *self.body, self.ack, self.sleep):
            with contextlib.suppress(BufferError):  # still exported (an array kept somewhere): it goes with it
                v.release()


class Board:
    """This process's posting board, and read-only maps of its peers' boards."""

    def __init__(self, max_bytes: int = BOARD_BYTES, native: bool = True, stream: int = 0) -> None:
        if not 1 <= max_bytes <= 1 << 30:
            raise ValueError(f"a board holds 1 byte to 1 GiB, not {max_bytes}")
        if stream < 0:
            raise ValueError(f"a board streams calls from 0 bytes (never) up, not {stream}")
        self.max_bytes = max_bytes
        self.limit = max_bytes  # the most every rank's board holds (see attach)
        self.pool = ShmPool(2, HEAD + max_bytes)
        self._mems = [memoryview(self.pool.mm)]
        self._own = _Views(-1, self._mems[0], self.pool.slot_bytes)
        for head in self._own.head:
            head[0] = head[1] = -1  # nothing posted or marked yet (a post number is >= 0)
        self._own.ack[0] = self._own.sleep[0] = -1
        self.peers: dict[int, PeerPool] = {}
        self._peers: list[_Views] = []  # in rank order
        self._by_rank: dict[int, _Views] = {}
        self._arrays: dict[tuple[int, np.dtype, int], list[np.ndarray]] = {}
        self.last = [-1, -1]  # the number of the post each own slot holds
        self.bytes_posted = 0
        self.bytes_read = 0
        self.closed = False
        self._want_native = native
        self._nat: NBoard | None = None  # psring._native.NBoard over the same maps, once attached (see native)
        #: the smallest call this rank offers to stream (0: none), and what every rank agreed (see attach)
        self.stream_offer = stream if native and _NBoard is not None else 0
        self.stream_min = 0
        self._streaming = threading.Lock()  # held while a thread runs a streamed call (close waits for it)
        self._stream_thread: ThreadPoolExecutor | None = None

    def describe(self) -> dict[str, Any]:
        """What a peer needs to map this board (published through the store)."""
        return {**self.pool.describe(), "max_bytes": self.max_bytes, "stream": self.stream_offer}

    def attach(self, peers: dict[int, Any]) -> None:
        """Map every peer's board (ValueError for a malformed or foreign description, OSError);
        ``limit`` becomes the smallest board's payload room (what every rank may post), and
        ``stream_min`` the largest size any rank streams from where every rank offers to (else 0)."""
        offers = [self.stream_offer]
        for peer, desc in sorted(peers.items()):
            room = desc.get("max_bytes") if isinstance(desc, dict) else None
            if type(room) is not int or room < 1 or desc.get("slots") != 2 or desc.get("slot_bytes", 0) < HEAD + room:
                raise ValueError(f"peer {peer}'s board is not a board: {desc!r:.200}")
            pool = PeerPool.open(desc)
            offer = desc.get("stream", 0)
            offers.append(offer if type(offer) is int and offer > 0 else 0)
            self.limit = min(self.limit, room)
            self.peers[peer] = pool
            self._mems.append(memoryview(pool.mm))
            views = _Views(peer, self._mems[-1], pool.slot_bytes)
            self._peers.append(views)
            self._by_rank[peer] = views
        if self._want_native and _NBoard is not None and len(self._peers) <= 63:
            self._nat = _NBoard(
                self._mems[0],
                self.pool.slot_bytes,
                [(self._mems[1 + i], self.peers[v.rank].slot_bytes) for i, v in enumerate(self._peers)],
                PAGE,
                HEAD,
                TAG_MAX,
                _ACK_AT,
                _SLEEP_AT,
            )
        self.stream_min = max(offers) if min(offers) > 0 and self._nat is not None else 0

    @property
    def native(self) -> bool:
        """Whether this board's hot loop runs in C (psring._native)."""
        return self._nat is not None

    # ----------------------------------------------------------------- posting
    def clear_to_post(self, k: int) -> bool:
        """Whether every rank -- this one too -- is done with the post that slot k % 2 holds (post k may
        replace it). This one: the ring's split fold reads its own post's folded chunk back after every
        peer has marked and may have acked, and a later call in flight (async_op) must not post over it
        before then."""
        before = self.last[k & 1]
        if self._own.ack[0] < before:
            return False
        for peer in self._peers:
            if peer.ack[0] < before:
                return False
        return True

    def unacked(self, k: int) -> list[int]:
        """The peers not done yet with the post that slot k % 2 holds (see clear_to_post)."""
        before = self.last[k & 1]
        return [peer.rank for peer in self._peers if peer.ack[0] < before]

    def post(self, k: int, tag: bytes, payload: memoryview | None) -> list[int]:
        """Post number k: ``payload`` (a byte memoryview of at most max_bytes) with the caller's tag
        (at most TAG_MAX bytes), into slot k % 2 (see clear_to_post). Returns the peers asleep on
        it (:meth:`sleepers`: to poke)."""
        p, own = k & 1, self._own
        n = len(tag)
        size = payload.nbytes if payload is not None else 0
        if size > self.limit or n > TAG_MAX:
            raise ValueError(f"a post carries at most {self.limit} bytes and a {TAG_MAX}-byte tag")
        if self._nat is not None:
            asleep = self._nat.post(k, tag, payload if payload is not None else b"")
            self.bytes_posted += size
            self.last[p] = k
            return [v.rank for i, v in enumerate(self._peers) if asleep >> i & 1] if asleep else []
        head = own.head[p]
        if size:
            own.body[p][:size] = payload  # type: ignore[assignment]  # not None when size > 0
            self.bytes_posted += size
        own.tag[p][:n] = tag
        head[2] = size
        head[3] = n
        head[0] = k  # last: a reader that sees k finds everything above
        self.last[p] = k
        return self.sleepers(k)

    def missing(self, k: int) -> list[int]:
        """The peers that have not posted number k yet."""
        return self._behind(k, 0)

    def mark(self, k: int) -> None:
        """Say that this process's post k was rewritten in place as its caller intended (call
        after the writes: a reader that sees the mark finds them)."""
        self._own.head[k & 1][1] = k

    def all_marked(self, k: int) -> bool:
        """Whether every peer has marked its post number k."""
        return self._all_at(k, 1)

    def unmarked(self, k: int) -> list[int]:
        """The peers that have not marked post number k yet."""
        return self._behind(k, 1)

    def all_posted(self, k: int) -> bool:
        """Whether every peer has posted number k (or a later one in its slot: a mismatch to name)."""
        return self._all_at(k, 0)

    def _all_at(self, k: int, field: int) -> bool:
        """Whether every peer's slot k % 2 has header ``field`` (0: post number, 1: mark) at k or past it."""
        if self._nat is not None:
            return self._nat.all_at(k, field)
        p = k & 1
        for peer in self._peers:
            if peer.head[p][field] < k:
                return False
        return True

    def _behind(self, k: int, field: int) -> list[int]:
        return [peer.rank for peer in self._peers if peer.head[k & 1][field] < k]

    def differs(self, k: int, tag: bytes, nbytes: int) -> int | None:
        """The first peer (by rank) whose slot k % 2 does not hold post k with this tag and
        ``nbytes`` of payload, or None (call once all_posted(k))."""
        if self._nat is not None:
            i = self._nat.differs(k, tag, nbytes)
            return self._peers[i].rank if i >= 0 else None
        p, n = k & 1, len(tag)
        for peer in self._peers:
            head = peer.head[p]
            if head[0] != k or head[2] != nbytes or head[3] != n or peer.tag[p][:n] != tag:
                return peer.rank
        return None

    def spin(self, k: int, marked: bool, hot: int, budget: float) -> bool | None:
        """Poll until every peer posted k (``marked``: marked it): ``hot`` polls back to back, then
        with the core yielded between polls for ``budget`` seconds; whether it came true. None where
        the board is not native (the caller polls in Python)."""
        if self._nat is None:
            return None
        return self._nat.spin(k, int(marked), hot, budget)

    def fold(self, k: int, me: int, x: np.ndarray, out: np.ndarray, op: str) -> bool:
        """Fold every rank's post k -- this rank's (``me``) from ``x`` -- into ``out`` in the canonical
        flat order (psring.core.fold.canonical_fold), in C; False where it cannot (not native, or a
        dtype or op it does not fold: min and max, float16, ...), and the caller folds. Call once
        :meth:`differs` found every post this call's; x and out flat and contiguous."""
        kind = self.native_kind(x.dtype, op)
        if kind is None or self._nat is None or not self._nat.fold(k, me, x, out, kind, op):
            return False
        self.bytes_read += x.nbytes * len(self._peers)
        return True

    def native_kind(self, dtype: np.dtype, op: str) -> str | None:
        """The native fold's letter for dtype, where this board is native and folds (dtype, op) in C
        (:meth:`exchange` takes the call); else None."""
        return None if self._nat is None else fold_kind(dtype, op)

    def exchange(
        self,
        k: int,
        tag: bytes,
        x: np.ndarray,
        out: np.ndarray,
        kind: str,
        op: str,
        me: int,
        hot: int,
        budget: float,
        split: bool = False,
    ) -> int:
        """A whole small all_reduce in one native call: post x as post k; when every peer's post k is
        there within the spin (:meth:`spin`'s hot polls and budget) and is this call's (tag, size),
        fold every rank's post into ``out`` (this rank's, ``me``, from x). Returns 0: done; 1: posted,
        the peers not all there; 2: posted, a peer's post differs (name it as :meth:`differs` does);
        3: posted, and peers sleep on it (poke :meth:`sleepers`; nothing else done). x and out flat
        or not, contiguous, alike; (dtype, op) one :meth:`native_kind` takes.

        ``split``: the fold split over the ranks, as the ring's split path does it -- fold ring chunk
        ``me`` of every post over this rank's own post of it, :meth:`mark` the post, and once every peer
        marked its own within the spin, copy every rank's folded chunk into ``out``; besides the codes
        above, 4: marked, and peers sleep on the mark (poke ``sleepers(k, marked=True)``, then wait for
        the marks); 5: marked, the peers' marks not all there within the spin."""
        assert self._nat is not None
        if x.nbytes > self.limit or len(tag) > TAG_MAX:
            raise ValueError(f"a post carries at most {self.limit} bytes and a {TAG_MAX}-byte tag")
        code = self._nat.exchange(k, tag, x, out, kind, op, me, hot, budget, split)
        self.bytes_posted += x.nbytes
        self.last[k & 1] = k
        if code == 0:
            n = len(self._peers) + 1
            self.bytes_read += x.nbytes * (n - 1) * 2 // n if split else x.nbytes * (n - 1)
        if code >= 4 and code % 4 == 0:
            return 3  # (4 x the mask of the peers asleep on the post)
        return {3: 4}.get(code, code)

    # ---------------------------------------------------------------- streaming
    def stream_post(self, k: int, tag: bytes, nbytes: int) -> list[int]:
        """Post number k for a streamed call of ``nbytes`` (no payload: the stream's counters, zeroed
        first, so that a reader that sees post k reads this call's); the peers asleep on it."""
        p, own = k & 1, self._own
        n = len(tag)
        if n > TAG_MAX or self._nat is None:
            raise ValueError(f"a streamed post needs a native board and at most a {TAG_MAX}-byte tag")
        counters = own.body[p][:_STREAM_DATA].cast("q")
        try:
            for i in range(len(counters)):
                counters[i] = 0
        finally:
            counters.release()
        own.tag[p][:n] = tag
        head = own.head[p]
        head[2] = nbytes
        head[3] = n
        head[0] = k  # last, as post's
        self.last[p] = k
        return self.sleepers(k)

    def stream_depth(self, block: int) -> int:
        """Blocks of ``block`` bytes a streamed call keeps in flight: as many as the smallest slot holds,
        up to STREAM_DEPTH (0: not one fits)."""
        return min(STREAM_DEPTH, max(0, self.limit - _STREAM_DATA) // block)

    def stream(
        self, k: int, me: int, x: np.ndarray, out: np.ndarray, kind: str, op: str, piece: int, depth: int,
        hot: int, budget: float, nt: bool, yield_us: int = -1, nap_us: int = 50, stores: int = -1,
    ) -> int:
        """Run streamed call k (posted by every rank: :meth:`stream_post`, checked with :meth:`differs`)
        on from where this rank stands: 0 done, ``out`` holds the fold; 1 a peer was not there within
        ``budget`` seconds at some wait (call again); 2 cancelled (:meth:`cancel_stream`) or the board
        closed. ``piece``: elements of each ring chunk per block; x and out flat, contiguous, of a native
        fold's kind. ``yield_us``: a wait yields the core for that long, then naps ``nap_us`` between polls
        (-1: it only yields). ``stores``: how the blocks go into the slots: -1 this rank chooses from how
        its last calls' posts went (:meth:`stream_stores`), 0 plain stores, 1 streaming stores."""
        with self._streaming:
            nat = self._nat
            if nat is None:
                return 2
            code = nat.stream(k, me, x, out, kind, op, piece, depth, hot, budget, int(nt), yield_us, nap_us, stores)
        if code == 0:
            self.bytes_posted += x.nbytes
            self.bytes_read += x.nbytes * len(self._peers) // (len(self._peers) + 1) * 2
        return code

    def stream_stores(self) -> tuple[bool, float, float]:
        """How this rank's next streamed call stores its blocks into the slots (True: streaming stores,
        which do not first take each line back from a peer's cache), and the last call's cheapest post of
        each kind, seconds a byte (0.0: not timed): board.c's ST_PROBE_EVERY says how it chooses."""
        if self._nat is None:
            return (False, 0.0, 0.0)
        streaming, plain, stream = self._nat.stream_stores()
        return (bool(streaming), float(plain), float(stream))

    def stream_thread(self) -> ThreadPoolExecutor:
        """The thread this board's streamed calls run on (one, its own: not an event loop's default executor,
        which a caller's own work may fill); made on first use, ended by :meth:`close`."""
        if self._stream_thread is None:
            self._stream_thread = ThreadPoolExecutor(1, thread_name_prefix="psring-stream")
        return self._stream_thread

    def cancel_stream(self, flag: bool = True) -> None:
        """Make a streamed call return (2) at its next wait; ``flag`` False: calls run again."""
        if self._nat is not None:
            self._nat.cancel_stream(flag)

    def stream_behind(self, k: int) -> list[int]:
        """The peers behind this rank in streamed call k (fewer blocks posted, folded and done)."""
        p = k & 1
        mine = self._counters(self._own.body[p])
        return [v.rank for v in self._peers if v.head[p][0] == k and self._counters(v.body[p]) < mine] + [
            v.rank for v in self._peers if v.head[p][0] != k
        ]

    @staticmethod
    def _counters(body: memoryview) -> int:
        view = body[:_STREAM_DATA].cast("q")
        try:
            return sum(view[i * 8] for i in range(3))
        finally:
            view.release()

    def read(self, peer: int, k: int) -> tuple[int, bytes]:
        """What peer's slot k % 2 holds: (its post number, its tag)."""
        views = self._by_rank[peer]
        head = views.head[k & 1]
        n = head[3]
        return head[0], bytes(views.tag[k & 1][:n]) if 0 <= n <= TAG_MAX else b""

    def arrays(self, k: int, dtype: np.dtype, count: int) -> list[np.ndarray]:
        """Every peer's post k (checked with :meth:`differs`) as ``count`` elements of dtype, in rank
        order: views of the peers' boards, valid until this process acks k. The caller counts what
        it reads (``bytes_read``)."""
        key = (k & 1, dtype, count)
        views = self._arrays.get(key)
        if views is None:
            if len(self._arrays) >= 64:
                self._arrays.clear()
            views = self._arrays[key] = [np.frombuffer(peer.body[k & 1], dtype, count) for peer in self._peers]
        return views

    def own_array(self, k: int, dtype: np.dtype, count: int) -> np.ndarray:
        """This process's post k as ``count`` elements of dtype, writable (see :meth:`mark`)."""
        key = (k & 1 | 2, dtype, count)
        views = self._arrays.get(key)
        if views is None:
            if len(self._arrays) >= 64:
                self._arrays.clear()
            views = self._arrays[key] = [np.frombuffer(self._own.body[k & 1], dtype, count)]
        return views[0]

    def ack(self, k: int) -> None:
        """This process is done with every post numbered up to k, its own and its peers' (their
        slots may be reused); never goes back."""
        if k > self._own.ack[0]:
            self._own.ack[0] = k

    # ---------------------------------------------------------------- sleeping
    def sleep_on(self, k: int, marked: bool = False) -> None:
        """Say that this process sleeps until post k is in (or marked) everywhere (k = -1: awake),
        for the peers that post (or mark) it to poke it."""
        self._own.sleep[0] = 2 * k + marked if k >= 0 else -1

    def sleepers(self, k: int, marked: bool = False) -> list[int]:
        """The peers asleep on post k (or its mark: to poke once this process posted or marked it)."""
        want = 2 * k + marked
        return [peer.rank for peer in self._peers if peer.sleep[0] == want]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._nat is not None:
            self._nat.cancel_stream(True)
            with self._streaming:  # a streamed call in another thread returns at its next wait
                self._nat.close()  # its buffers first: the maps close below
            self._nat = None
        if self._stream_thread is not None:
            self._stream_thread.shutdown(wait=False)
            self._stream_thread = None
        self._arrays.clear()
        for views in (self._own, *self._peers):
            views.release()
        self._peers.clear()
        self._by_rank.clear()
        for mem in self._mems:
            with contextlib.suppress(BufferError):
                mem.release()
        for pool in self.peers.values():
            pool.close()
        self.pool.close()


__all__ = ["BOARD_BYTES", "Board", "board_possible", "fold_kind", "native_built"]
