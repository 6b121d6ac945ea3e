"""The bulk bytes this process's links receive: what lets a heartbeat tell a peer that is gone from a
control connection that waits behind a full link.

On a thin link (10 Mbit/s, say) an exchange's bulk fills the bottleneck's queue, and a connection that
carries only control frames -- pings, the stall inspector's questions -- sees its few packets dropped
and sent again after timeouts that double each time: seconds of silence from a peer that is alive and
sending (measured on the slow-link bed: 10-11 s, past the 10 s heartbeat timeout, in a 10.5 MB
exchange at 10 Mbit/s). So while bulk bytes keep arriving here, a connection's silence is tolerated
up to ``GRACE`` heartbeat timeouts; once they stop, the plain timeout holds again. A peer that dies
closes its sockets and is lost at once either way; one that hangs stops the exchange, and so the bulk.

The count is the process's (the link is the machine's, not one group's): every Connection's bytes and
the ring's data-plane reader threads add to it. An approximate count is enough (no lock): it only says
whether bulk is moving.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

#: bytes received in one heartbeat interval from which the links count as moving bulk (a ping is tens)
BULK_BYTES = 64 << 10
#: how many heartbeat timeouts a connection may stay silent while bulk moves
GRACE = 3.0


class _Meter:
    __slots__ = ("received", "transfers")

    def __init__(self) -> None:
        self.received = 0
        #: native transfers running now on some thread (they count their bytes only when they return)
        self.transfers = 0


_meter = _Meter()


def note(nbytes: int) -> None:
    """``nbytes`` arrived on one of this process's links."""
    _meter.received += nbytes


def received() -> int:
    """Bytes this process's links received in all (approximate)."""
    return _meter.received


@contextlib.contextmanager
def transfer() -> Iterator[None]:
    """Around a native transfer that blocks its thread and counts its bytes when it returns (the data
    plane's ring run on the caller's thread): while one runs, bulk counts as moving."""
    _meter.transfers += 1
    try:
        yield
    finally:
        _meter.transfers -= 1


def moving(since: int) -> bool:
    """Whether bulk moved since the count was ``since`` (or a native transfer is running now)."""
    return _meter.received - since >= BULK_BYTES or _meter.transfers > 0


__all__ = ["BULK_BYTES", "GRACE", "moving", "note", "received", "transfer"]
