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

A writer may reuse a slot only once every peer has finished reading what it holds: each
board's header page carries an *ack*, a number up to which its owner has finished everything
(the caller's: for a collective, every collective up to it ended), and
:meth:`Board.clear_to_post` checks every peer's against what the slot holds.

This module knows posts and peers, not collectives: the ring's board path
(``psring.topology.ring.board``) decides what a post carries.
"""

from __future__ import annotations

import contextlib
import platform
from typing import Any

import numpy as np

from .shmpool import PAGE, TOKEN_BYTES, PeerPool, ShmPool

#: the largest payload a post carries (a slot is this plus its header, page-rounded)
BOARD_BYTES = 16 << 10
#: bytes before a slot's payload: 4 int64 fields (post number, spare, payload bytes, tag bytes)
#: and the caller's tag (what the post is, to check it against the reader's own)
HEAD = 256
TAG_MAX = HEAD - 32
_ACK_AT = 64  # the owner's ack: an int64 in the pool's header page, after the token
_SLEEP_AT = 72  # the post its owner sleeps waiting on (-1: none), beside it
assert _ACK_AT >= TOKEN_BYTES


def board_possible() -> bool:
    """Whether this machine orders stores to shared memory as the board needs (x86: total store order)."""
    return platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


class Board:
    """This process's posting board, and read-only maps of its peers' boards."""

    def __init__(self, max_bytes: int = BOARD_BYTES) -> None:
        if not 1 <= max_bytes <= 1 << 30:
            raise ValueError(f"a board holds 1 byte to 1 GiB, not {max_bytes}")
        self.max_bytes = max_bytes
        self.limit = max_bytes  # the most every rank's board holds (see attach)
        self.pool = ShmPool(2, HEAD + max_bytes)
        mem = memoryview(self.pool.mm)
        base = PAGE
        size = self.pool.slot_bytes
        self._head = [mem[base + p * size : base + p * size + 32].cast("q") for p in (0, 1)]
        self._tag = [mem[base + p * size + 32 : base + p * size + HEAD] for p in (0, 1)]
        self._body = [mem[base + p * size + HEAD : base + (p + 1) * size] for p in (0, 1)]
        self._ack = mem[_ACK_AT : _ACK_AT + 8].cast("q")
        self._sleep = mem[_SLEEP_AT : _SLEEP_AT + 8].cast("q")
        self._head[0][0] = self._head[1][0] = -1  # nothing posted yet (a post number is >= 0)
        self._ack[0] = self._sleep[0] = -1
        self._mems = [mem]
        self.peers: dict[int, PeerPool] = {}
        self._peer_head: dict[int, list[memoryview]] = {}
        self._peer_tag: dict[int, list[memoryview]] = {}
        self._peer_body: dict[int, list[memoryview]] = {}
        self._peer_ack: dict[int, memoryview] = {}
        self._peer_sleep: dict[int, memoryview] = {}
        #: the same, in rank order, for the per-call loops
        self._heads: list[list[memoryview]] = []
        self._checks: list[tuple[int, list[memoryview], list[memoryview]]] = []
        self._bodies: list[tuple[int, list[memoryview]]] = []
        self._arrays: dict[tuple[int, np.dtype, int], list[np.ndarray]] = {}
        self._sleeps: list[memoryview] = []
        self.last = [-1, -1]  # the number of the post each own slot holds
        self.bytes_posted = 0
        self.bytes_read = 0
        self.closed = False

    def describe(self) -> dict[str, Any]:
        """What a peer needs to map this board (published through the store)."""
        return {**self.pool.describe(), "max_bytes": self.max_bytes}

    def attach(self, peers: dict[int, Any]) -> None:
        """Map every peer's board (ValueError for a malformed or foreign description, OSError);
        ``limit`` becomes the smallest board's payload room (what every rank may post)."""
        for peer, desc in sorted(peers.items()):
            room = desc.get("max_bytes") if isinstance(desc, dict) else None
            if type(room) is not int or room < 1 or desc.get("slots") != 2 or desc.get("slot_bytes", 0) < HEAD + room:
                raise ValueError(f"peer {peer}'s board is not a board: {desc!r:.200}")
            pool = PeerPool.open(desc)
            self.limit = min(self.limit, room)
            self.peers[peer] = pool
            mem = memoryview(pool.mm)
            self._mems.append(mem)
            size = pool.slot_bytes
            self._peer_head[peer] = [mem[PAGE + p * size : PAGE + p * size + 32].cast("q") for p in (0, 1)]
            self._peer_tag[peer] = [mem[PAGE + p * size + 32 : PAGE + p * size + HEAD] for p in (0, 1)]
            self._peer_body[peer] = [mem[PAGE + p * size + HEAD : PAGE + (p + 1) * size] for p in (0, 1)]
            self._peer_ack[peer] = mem[_ACK_AT : _ACK_AT + 8].cast("q")
            self._peer_sleep[peer] = mem[_SLEEP_AT : _SLEEP_AT + 8].cast("q")
            self._heads.append(self._peer_head[peer])
            self._sleeps.append(self._peer_sleep[peer])
            self._checks.append((peer, self._peer_head[peer], self._peer_tag[peer]))
            self._bodies.append((peer, self._peer_body[peer]))

    # ----------------------------------------------------------------- posting
    def clear_to_post(self, k: int) -> bool:
        """Whether every peer is done with the post that slot k % 2 holds (post k may replace it)."""
        before = self.last[k & 1]
        for ack in self._peer_ack.values():
            if ack[0] < before:
                return False
        return True

    def post(self, k: int, tag: bytes, payload: memoryview | None) -> None:
        """Post number k: ``payload`` (a byte memoryview of at most max_bytes) with the caller's tag
        (at most TAG_MAX bytes), into slot k % 2 (see clear_to_post)."""
        p = k & 1
        n = len(tag)
        size = payload.nbytes if payload is not None else 0
        if size > self.limit or n > TAG_MAX:
            raise ValueError(f"a post carries at most {self.limit} bytes and a {TAG_MAX}-byte tag")
        head = self._head[p]
        if size:
            self._body[p][:size] = payload  # type: ignore[assignment]  # not None when size > 0
            self.bytes_posted += size
        self._tag[p][:n] = tag
        head[2] = size
        head[3] = n
        head[0] = k  # last: a reader that sees k finds everything above
        self.last[p] = k

    def missing(self, k: int) -> list[int]:
        """The peers that have not posted number k yet."""
        return [peer for peer, head in self._peer_head.items() if head[k & 1][0] < k]

    def all_posted(self, k: int) -> bool:
        """Whether every peer has posted number k (or a later one in its slot: a mismatch to name)."""
        p = k & 1
        for heads in self._heads:
            if heads[p][0] < k:
                return False
        return True

    def differs(self, k: int, tag: bytes, nbytes: int) -> int | None:
        """The first peer (by rank) whose slot k % 2 does not hold post k with this tag and
        ``nbytes`` of payload, or None (call once all_posted(k))."""
        p, n = k & 1, len(tag)
        for peer, heads, tags in self._checks:
            head = heads[p]
            if head[0] != k or head[2] != nbytes or head[3] != n or tags[p][:n] != tag:
                return peer
        return None

    def read(self, peer: int, k: int) -> tuple[int, bytes, memoryview]:
        """What peer's slot k % 2 holds: (its post number, its tag, its payload), views valid until
        this process acks k."""
        head = self._peer_head[peer][k & 1]
        seen, size, n = head[0], head[2], head[3]
        if not (0 <= size <= self.limit and 0 <= n <= TAG_MAX):
            return seen, b"", self._peer_body[peer][k & 1][:0]
        return seen, bytes(self._peer_tag[peer][k & 1][:n]), self._peer_body[peer][k & 1][:size]

    def arrays(self, k: int, dtype: np.dtype, count: int) -> list[np.ndarray]:
        """Every peer's post k (checked with :meth:`differs`) as ``count`` elements of dtype, in rank
        order: views of the peers' boards, valid until this process finishes k."""
        key = (k & 1, dtype, count)
        views = self._arrays.get(key)
        if views is None:
            if len(self._arrays) >= 64:
                self._arrays.clear()
            views = self._arrays[key] = [np.frombuffer(body[k & 1], dtype, count) for _p, body in self._bodies]
        self.bytes_read += count * dtype.itemsize * len(views)
        return views

    def ack(self, k: int) -> None:
        """This process is done with every post numbered up to k, its own and its peers' (their
        slots may be reused); never goes back."""
        if k > self._ack[0]:
            self._ack[0] = k

    # ---------------------------------------------------------------- sleeping
    def sleep_on(self, k: int) -> None:
        """Say that this process sleeps until post k is in (-1: awake), for the peers that post it."""
        self._sleep[0] = k

    def sleepers(self, k: int) -> list[int]:
        """The peers asleep on post k (to poke once this process posted it)."""
        for sleep in self._sleeps:
            if sleep[0] == k:
                return [peer for peer, sleep in self._peer_sleep.items() if sleep[0] == k]
        return []

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._arrays.clear()
        self._heads.clear()
        self._checks.clear()
        self._bodies.clear()
        self._sleeps.clear()
        views = [*self._head, *self._tag, *self._body, self._ack, self._sleep]
        for group in (*self._peer_head.values(), *self._peer_tag.values(), *self._peer_body.values()):
            views.extend(group)
        views.extend([*self._peer_ack.values(), *self._peer_sleep.values(), *self._mems])
        for v in views:  # a view still exported (an array someone kept) keeps its mapping until it goes
            with contextlib.suppress(BufferError):
                v.release()
        for pool in self.peers.values():
            pool.close()
        self.pool.close()


__all__ = ["BOARD_BYTES", "Board", "board_possible"]
