"""The error tree: every failure psring raises is one class under PsringError.

Each class also inherits the builtin that callers already catch (ValueError,
TimeoutError, ConnectionError, PermissionError), so generic handlers keep working.
"""

from __future__ import annotations


class PsringError(Exception):
    """Base class of every error psring raises."""


class ProtocolError(PsringError, ValueError):
    """A malformed, oversized or unexpected frame."""


class AuthError(PsringError, PermissionError):
    """The peer could not prove knowledge of the shared secret (or we could not)."""


class PeerLostError(PsringError, ConnectionError):
    """A peer, server or store went away (process died, connection dropped, silent)."""

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank


class CollectiveTimeoutError(PsringError, TimeoutError):
    """A collective did not complete within its deadline."""

    def __init__(self, message: str, *, missing: tuple[int, ...] = ()) -> None:
        super().__init__(message)
        self.missing = missing


class MismatchError(PsringError, ValueError):
    """Ranks called different collectives, or the same one with different arguments."""


class GroupClosedError(PsringError, RuntimeError):
    """The group was closed by this process; it cannot be used any more."""


class StoreError(PsringError, RuntimeError):
    """The rendezvous store refused or failed a request."""


class StoreDiskError(StoreError):
    """The store could not put a change on its disk (full, failing): the change was not made. Daemons
    retry within PSRING_STORE_RECONNECT_S; the store goes on by itself once the disk takes writes."""


__all__ = [
    "AuthError",
    "CollectiveTimeoutError",
    "GroupClosedError",
    "MismatchError",
    "PeerLostError",
    "ProtocolError",
    "PsringError",
    "StoreDiskError",
    "StoreError",
]
