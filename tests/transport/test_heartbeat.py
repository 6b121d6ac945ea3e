"""A heartbeat judges a silent connection lost after its timeout -- and, while this process's links are
receiving bulk bytes (psring.transport.traffic), only after GRACE timeouts: on a thin link a connection
that carries only pings waits behind the bulk (its packets dropped and re-sent after doubling timeouts),
as the slow-link bed showed at 10 Mbit/s. Once the bulk stops, the plain timeout holds again."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from psring.errors import PeerLostError
from psring.transport import traffic
from psring.transport.heartbeat import Heartbeat

pytestmark = [pytest.mark.timeout(30)]

INTERVAL, TIMEOUT = 0.05, 0.3


class SilentPeer:
    """A connection (what Heartbeat needs of one) whose peer sends nothing from now on."""

    peername = "10.0.0.2:1"
    peer_label = "rank 1"

    def __init__(self) -> None:
        self.last_heard = self.last_sent = time.monotonic()
        self.lost: BaseException | None = None
        self.lost_at = 0.0

    def transport_gone(self) -> bool:
        return self.lost is not None

    def lost_error(self, message: str) -> PeerLostError:
        return PeerLostError(message, rank=1)

    def abort(self, exc: BaseException) -> None:
        self.lost, self.lost_at = exc, time.monotonic()

    def send_frame(self, header: dict[str, Any]) -> None:
        self.last_sent = time.monotonic()


async def silent_for(bulk_s: float) -> tuple[float, SilentPeer]:
    """Seconds from the peer's last word to its loss, with bulk bytes arriving for the first ``bulk_s``."""
    conn = SilentPeer()
    beat = Heartbeat(conn, INTERVAL, TIMEOUT)
    beat.start()
    end = time.monotonic() + bulk_s
    try:
        while conn.lost is None and time.monotonic() < conn.last_heard + 10 * TIMEOUT:
            if time.monotonic() < end:
                traffic.note(traffic.BULK_BYTES * 2)  # an exchange's bytes on another link
            await asyncio.sleep(INTERVAL / 5)
    finally:
        beat.stop()
    return conn.lost_at - conn.last_heard, conn


@pytest.mark.asyncio
async def test_a_silent_connection_is_lost_after_the_timeout_when_no_bulk_moves() -> None:
    took, conn = await silent_for(0.0)
    assert isinstance(conn.lost, PeerLostError) and "silent for" in str(conn.lost)
    assert TIMEOUT <= took < TIMEOUT + 4 * INTERVAL, took


@pytest.mark.asyncio
async def test_while_bulk_moves_a_silent_connection_gets_grace_timeouts() -> None:
    took, conn = await silent_for(60.0)
    assert isinstance(conn.lost, PeerLostError), "a peer silent past GRACE timeouts is lost all the same"
    assert traffic.GRACE * TIMEOUT <= took < traffic.GRACE * TIMEOUT + 4 * INTERVAL, took


@pytest.mark.asyncio
async def test_once_the_bulk_stops_the_plain_timeout_holds_again() -> None:
    took, _ = await silent_for(TIMEOUT * 1.5)  # bulk moved past one timeout, then stopped
    assert TIMEOUT * 1.5 <= took < TIMEOUT * 1.5 + 2 * INTERVAL + 4 * INTERVAL, took
