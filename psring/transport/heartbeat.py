"""Heartbeats: an idle connection pings, and a peer silent past the timeout is lost."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Protocol

from ..errors import PeerLostError
from . import traffic


class Beating(Protocol):
    """What the heartbeat needs of its connection."""

    peername: str
    last_heard: float
    last_sent: float

    @property
    def peer_label(self) -> str: ...

    def transport_gone(self) -> bool: ...

    def lost_error(self, message: str) -> PeerLostError: ...

    def abort(self, exc: BaseException) -> None: ...

    def send_frame(self, header: dict[str, Any]) -> None: ...


class Heartbeat:
    """A connection's heartbeat (``conn.heartbeat``): pings while idle; a connection silent for longer
    than the timeout is dropped as lost -- up to ``traffic.GRACE`` timeouts while this process's links
    are receiving bulk bytes (its packets may wait behind a full link). A loop that was itself blocked
    does not judge its peers until it has caught up with what they sent."""

    def __init__(self, conn: Beating, interval: float, timeout: float) -> None:
        self.conn = conn
        self.interval = interval
        self.timeout = timeout
        self._handle: asyncio.TimerHandle | None = None
        self._last_tick = 0.0
        #: this process's bulk bytes at the last tick, and when they last moved (psring.transport.traffic)
        self._seen = traffic.received()
        self._moved = 0.0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._last_tick = loop.time()
        self._handle = loop.call_later(self.interval, self._beat)

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _beat(self) -> None:
        conn = self.conn
        if conn.transport_gone():
            return
        loop = asyncio.get_running_loop()
        now_loop = loop.time()
        lag = now_loop - self._last_tick - self.interval
        now = time.monotonic()
        if traffic.moving(self._seen):
            self._moved = now
        self._seen = traffic.received()
        # while bulk bytes arrive, a control connection's packets may wait behind a full link: more time
        limit = self.timeout * (traffic.GRACE if now - self._moved <= 2 * self.interval else 1.0)
        # If our own loop was blocked, unread bytes may be waiting: do not judge the peer now.
        if lag < self.interval and now - conn.last_heard > limit:
            conn.abort(
                conn.lost_error(
                    f"{conn.peer_label} at {conn.peername} silent for {now - conn.last_heard:.1f}s "
                    f"(heartbeat timeout {self.timeout:g}s)"
                )
            )
            return
        if now - conn.last_sent >= self.interval * 0.5:
            try:
                conn.send_frame({"kind": "ping"})
            except PeerLostError:
                return
        self._last_tick = now_loop
        self._handle = loop.call_later(self.interval, self._beat)
