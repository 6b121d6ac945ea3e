"""What the small-message meshes share: one link per peer rank, a queue per link for what the kernel did
not take, waiting for those queues to drain, and a link's end.

Two meshes build on it: the same-host Unix links (``unixmesh``, read by the event loop all the time)
and the TCP links between hosts (``tcpmesh``, read by the loop only while it waits on them). Both carry
:func:`psring.core.wire.encode_message` messages and call ``on_message(peer, head, payload)`` and
``on_closed(peer, error)`` alike, so the ring's one-hop code drives either.
"""

from __future__ import annotations

import asyncio
import collections
import socket
from collections.abc import Callable
from typing import Any, Generic, TypeVar


class MeshLink:
    """One socket to one peer rank, with a queue for what the kernel did not take."""

    __slots__ = ("bytes_received", "bytes_sent", "closed", "deferred", "frames_sent", "peer", "pending", "sock")

    def __init__(self, peer: int, sock: socket.socket) -> None:
        self.peer = peer
        self.sock = sock
        self.pending: collections.deque[Any] = collections.deque()
        self.closed = False
        self.bytes_sent = 0
        self.bytes_received = 0
        self.frames_sent = 0
        self.deferred = 0  #: messages that had to wait for room in the kernel's buffer


L = TypeVar("L", bound=MeshLink)


class Mesh(Generic[L]):
    """A rank's links to its peers (see the module's docstring)."""

    #: whether a rank alone in its process may poll these links before it sleeps (``poll``)
    spins = True

    def __init__(
        self,
        rank: int,
        on_message: Callable[[int, tuple[Any, ...], memoryview], None],
        on_closed: Callable[[int, BaseException | None], None],
    ) -> None:
        self.rank = rank
        self.on_message = on_message
        self.on_closed = on_closed
        self.links: dict[int, L] = {}
        self.backlog = 0  #: links with messages the kernel has not taken yet
        self._loop: asyncio.AbstractEventLoop | None = None  #: the loop that watches the links
        self._drained: asyncio.Future[None] | None = None
        self._closing = False

    def __repr__(self) -> str:
        return f"{type(self).__name__}(rank {self.rank}, {len(self.links)} links)"

    def hold(self) -> None:
        """A collective on the event loop is about to wait for messages (see ``tcpmesh``)."""

    def release(self) -> None:
        """... and no longer does."""

    def catch_up(self, peer: int) -> None:
        """Read and hand on, without blocking, every message from ``peer`` the kernel holds now (when
        the loop reads these links): what a peer sent before it crashed, before its crash is acted on."""

    async def drain(self) -> None:
        """Wait until every queued message is with the kernel (or its link has ended)."""
        while self.backlog:
            if self._drained is None or self._drained.done():
                self._drained = asyncio.get_running_loop().create_future()
            await asyncio.shield(self._drained)

    def _wake_drain(self) -> None:
        if self._drained is not None and not self._drained.done() and not self.backlog:
            self._drained.set_result(None)

    def _ended(self, link: L, error: BaseException | None) -> None:
        """Close ``link`` once: drop its queue, stop watching it, and tell on_closed (unless closing)."""
        if link.closed:
            return
        link.closed = True
        loop, fd = self._loop, link.sock.fileno()
        if loop is not None and not loop.is_closed() and fd >= 0:
            loop.remove_reader(fd)
            loop.remove_writer(fd)
        link.sock.close()
        if link.pending:
            link.pending.clear()
            self.backlog -= 1
        self._wake_drain()
        if not self._closing:
            self.on_closed(link.peer, error)

    def close(self) -> None:
        """Close every link (no callbacks)."""
        self._closing = True
        for link in list(self.links.values()):
            self._ended(link, None)

    def stats(self) -> tuple[int, int]:
        """(bytes sent, bytes received) over every link."""
        links = self.links.values()
        return sum(link.bytes_sent for link in links), sum(link.bytes_received for link in links)
