"""What Connection's parts (``handshake``, ``heartbeat``, ``slots``) need from it: read by type checkers only.

Each part names :class:`ConnectionHost` as its base under ``TYPE_CHECKING`` (``object`` at run
time), so the interface between Connection and its parts is written down once and checked by
mypy in CI.
"""

from __future__ import annotations

import abc
import asyncio
from typing import Any

import numpy as np

from ..errors import PeerLostError
from ..settings import Settings


class ConnectionHost(abc.ABC):
    """A Connection as its parts see it (never instantiated)."""

    settings: Settings
    peer: dict[str, Any]
    peername: str
    farewell: dict[str, Any] | None
    last_heard: float
    _last_sent: float
    _lost: PeerLostError | None
    _secret: bytes | None
    _checksum: str | None
    _handshake_frames: asyncio.Queue[dict[str, Any]] | None
    _closed: asyncio.Future[Any]
    #: an in-process end (no socket, no shared memory)
    is_local: bool

    @abc.abstractmethod
    def send_frame(
        self, header: dict[str, Any], payload: memoryview | bytes | None = None, *, nbytes: int | None = None
    ) -> None: ...

    @abc.abstractmethod
    def send_tensor(
        self, header: dict[str, Any], x: np.ndarray, shared: bool = False, owner: tuple[Any, int] | None = None
    ) -> None: ...

    @abc.abstractmethod
    def abort(self, exc: BaseException) -> None: ...

    @property
    @abc.abstractmethod
    def is_open(self) -> bool: ...

    @property
    @abc.abstractmethod
    def peer_label(self) -> str: ...

    @abc.abstractmethod
    def _lost_error(self, message: str) -> PeerLostError: ...

    @abc.abstractmethod
    def _transport_gone(self) -> bool: ...

    @abc.abstractmethod
    def _finish_frame(self) -> None: ...

    @abc.abstractmethod
    def _schedule_heartbeat(self) -> None: ...

    @abc.abstractmethod
    def _use_full_staging(self) -> None: ...

    @abc.abstractmethod
    def _replay_held(self) -> None: ...
