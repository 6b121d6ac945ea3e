"""The Mailbox: tag-matched delivery of frames from any number of connections to the receives a group posts."""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import PeerLostError, ProtocolError
from .connection import Connection

# ------------------------------------------------------------------- mailbox
Callback = Callable[[Connection, dict[str, Any], Any], None]


class _Posted:
    __slots__ = ("callback", "dest", "future")

    def __init__(self, dest: memoryview | None, callback: Callback | None, future: asyncio.Future[Any] | None):
        self.dest = dest
        self.callback = callback
        self.future = future


class Mailbox:
    """Tag-matched delivery of frames from any number of connections.

    A receive is posted with a tag (and optionally a destination buffer, which the
    payload is then read straight into, and a callback run on arrival). Frames that
    arrive before their receive is posted wait in an unexpected queue. Inspectors
    registered for a tag prefix see every header with that prefix (groups check a
    collective's arguments there); an inspector returning False drops the frame.
    """

    def __init__(self) -> None:
        self._posted: dict[tuple[Any, ...], _Posted] = {}
        self._unexpected: dict[tuple[Any, ...], collections.deque[tuple[Connection, dict[str, Any], Any]]] = {}
        self._inspectors: dict[tuple[Any, ...], Callable[[Connection, dict[str, Any]], bool]] = {}
        self.on_lost: Callable[[Connection, PeerLostError | None], None] | None = None
        self.on_control: Callable[[Connection, dict[str, Any], Any], bool] | None = None
        #: frames no inspector claims: called with (conn, header); False drops the frame
        self.on_stray: Callable[[Connection, dict[str, Any]], bool] | None = None
        self.unexpected_bytes = 0

    # Router protocol
    def buffer_for(self, conn: Connection, header: dict[str, Any]) -> memoryview | None:
        tag = header.get("tag")
        posted = self._posted.get(tag) if tag is not None else None
        return posted.dest if posted is not None else None

    def deliver(self, conn: Connection, header: dict[str, Any], payload: Any) -> None:
        tag = header.get("tag")
        if self.on_control is not None and self.on_control(conn, header, payload):
            return
        if not isinstance(tag, tuple) or len(tag) < 2:
            raise ProtocolError(f"{header['kind']!r} frame from {conn.peername} has no valid 'tag'")
        inspector = self._inspectors.get(tag[:2])
        if inspector is not None:
            if not inspector(conn, header):
                return
        elif self.on_stray is not None and not self.on_stray(conn, header):
            return
        posted = self._posted.pop(tag, None)
        if posted is None:
            if "pool" in header:  # the slot goes back when deliver returns: keep a copy
                payload = np.array(payload)
            self._unexpected.setdefault(tag, collections.deque()).append((conn, header, payload))
            self.unexpected_bytes += header["nbytes"]
            return
        self._complete(posted, conn, header, payload)

    def connection_lost(self, conn: Connection, error: PeerLostError | None) -> None:
        if self.on_lost is not None:
            self.on_lost(conn, error)

    # receives
    @staticmethod
    def _complete(posted: _Posted, conn: Connection, header: dict[str, Any], payload: Any) -> None:
        if posted.dest is not None and payload is not posted.dest and len(posted.dest) == header["nbytes"]:
            posted.dest[:] = payload  # arrived before it was posted, or in shared memory: one copy into place
            payload = posted.dest
        elif "pool" in header:  # the slot goes back when deliver returns: keep a copy
            payload = np.array(payload)
        if posted.callback is not None:
            posted.callback(conn, header, payload)
        if posted.future is not None and not posted.future.done():
            posted.future.set_result((conn, header, payload))

    def _pop_unexpected(self, tag: tuple[Any, ...]) -> tuple[Connection, dict[str, Any], Any] | None:
        queue = self._unexpected.get(tag)
        if not queue:
            return None
        item = queue.popleft()
        if not queue:
            del self._unexpected[tag]
        self.unexpected_bytes -= item[1]["nbytes"]
        return item

    def post(self, tag: tuple[Any, ...], dest: memoryview | None = None, callback: Callback | None = None) -> None:
        """Expect one frame with ``tag``; run ``callback(conn, header, payload)`` when it arrives."""
        item = self._pop_unexpected(tag)
        posted = _Posted(dest, callback, None)
        if item is not None:
            self._complete(posted, *item)
            return
        if tag in self._posted:
            raise RuntimeError(f"a receive is already posted for tag {tag}")
        self._posted[tag] = posted

    def expect(self, tag: tuple[Any, ...], dest: memoryview | None = None) -> asyncio.Future[Any]:
        """Like :meth:`post`, returning a future of ``(conn, header, payload)``."""
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        item = self._pop_unexpected(tag)
        posted = _Posted(dest, None, fut)
        if item is not None:
            self._complete(posted, *item)
            return fut
        if tag in self._posted:
            raise RuntimeError(f"a receive is already posted for tag {tag}")
        self._posted[tag] = posted
        return fut

    def unpost(self, tag: tuple[Any, ...]) -> None:
        self._posted.pop(tag, None)

    def is_posted(self, tag: tuple[Any, ...]) -> bool:
        return tag in self._posted

    def is_queued(self, tag: tuple[Any, ...]) -> bool:
        """Whether a frame with ``tag`` arrived and waits for its receive."""
        return bool(self._unexpected.get(tag))

    def inspect(self, prefix: tuple[Any, ...], inspector: Callable[[Connection, dict[str, Any]], bool]) -> None:
        """Register an inspector for a tag prefix and run it over frames already queued."""
        self._inspectors[prefix] = inspector
        for tag in [t for t in self._unexpected if t[:2] == prefix]:
            queue = self._unexpected[tag]
            kept = collections.deque(item for item in queue if inspector(item[0], item[1]))
            if kept:
                self._unexpected[tag] = kept
            else:
                del self._unexpected[tag]
            self.unexpected_bytes -= sum(i[1]["nbytes"] for i in queue) - sum(i[1]["nbytes"] for i in kept)

    def forget(self, prefix: tuple[Any, ...], drop_queued: bool = False) -> None:
        """Remove the inspector and posted receives under a prefix (a collective ended)."""
        self._inspectors.pop(prefix, None)
        for tag in [t for t in self._posted if t[:2] == prefix]:
            del self._posted[tag]
        if drop_queued:
            for tag in [t for t in self._unexpected if t[:2] == prefix]:
                self.unexpected_bytes -= sum(i[1]["nbytes"] for i in self._unexpected.pop(tag))

