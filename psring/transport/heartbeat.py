"""Heartbeats: an idle connection pings, and a peer silent past the timeout is lost."""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

from ..errors import PeerLostError

if TYPE_CHECKING:
    from .host import ConnectionHost as _Host
else:
    _Host = object


class Heartbeats(_Host):
    """Part of :class:`~psring.transport.connection.Connection`: pings while idle; a connection
    silent for longer than the timeout is dropped as lost. A loop that was itself blocked
    does not judge its peers until it has caught up with what they sent."""

    def _init_heartbeats(self, interval: float, timeout: float) -> None:
        self._hb_interval = interval
        self._hb_timeout = timeout
        self._hb_handle: asyncio.TimerHandle | None = None
        self._hb_last_tick = 0.0

    # -------------------------------------------------------------- heartbeats
    def _schedule_heartbeat(self) -> None:
        loop = asyncio.get_running_loop()
        self._hb_last_tick = loop.time()
        self._hb_handle = loop.call_later(self._hb_interval, self._heartbeat)

    def _heartbeat(self) -> None:
        if self._transport_gone():
            return
        loop = asyncio.get_running_loop()
        now_loop = loop.time()
        lag = now_loop - self._hb_last_tick - self._hb_interval
        now = time.monotonic()
        # If our own loop was blocked, unread bytes may be waiting: do not judge the peer now.
        if lag < self._hb_interval and now - self.last_heard > self._hb_timeout:
            self.abort(
                self._lost_error(
                    f"{self.peer_label} at {self.peername} silent for {now - self.last_heard:.1f}s "
                    f"(heartbeat timeout {self._hb_timeout:g}s)"
                )
            )
            return
        if now - self._last_sent >= self._hb_interval * 0.5:
            try:
                self.send_frame({"kind": "ping"})
            except PeerLostError:
                return
        self._hb_last_tick = now_loop
        self._hb_handle = loop.call_later(self._hb_interval, self._heartbeat)
