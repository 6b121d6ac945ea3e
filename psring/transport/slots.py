"""Shared-memory payloads on a connection: offering and mapping pools, lending and handing back slots."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from ..core import wire
from ..errors import ProtocolError, PsringError
from .samehost import host_key, same_host_paths
from .shmpool import PeerPool, ShmPool

logger = logging.getLogger(__name__)


class Link(Protocol):
    """What the shared-memory part needs of its connection."""

    settings: Any
    peer: dict[str, Any]
    peername: str
    is_local: bool

    @property
    def peer_label(self) -> str: ...

    @property
    def is_open(self) -> bool: ...

    @property
    def checksum(self) -> str | None: ...

    def transport_gone(self) -> bool: ...

    def send_frame(
        self, header: dict[str, Any], payload: memoryview | bytes | None = None, *, nbytes: int | None = None
    ) -> None: ...

    def send_tensor(
        self, header: dict[str, Any], x: np.ndarray, shared: bool = False, owner: tuple[Any, int] | None = None
    ) -> None: ...


class SharedMemory:
    """A connection's payloads in shared memory (``conn.shm``).

    Between processes on one host a frame's payload may sit in a slot of the sender's
    pool (:mod:`.shmpool`) instead of on the socket: the frame carries ``pool: k`` and
    the payload's size, the receiver reads the slot while the frame is delivered and
    hands the slot back (``free`` in a later frame's header). Pools are offered and
    mapped with ``pool`` frames on the connection itself.
    """

    def __init__(self, conn: Link) -> None:
        self.conn = conn
        self.pool: ShmPool | None = None  # this side's pool, lent to the peer once it mapped it
        #: makes (or returns) the pool this side offers back when a peer offers its own
        self.pool_factory: Callable[[], ShmPool | None] | None = None
        self.peer_pool: PeerPool | None = None  # the peer's pool, mapped read-only
        self.peer_maps_pool = False  # the peer mapped this side's pool: slots may be lent to it
        self.pool_offered = False
        self._pool_answer: asyncio.Future[None] | None = None
        self._lent: collections.Counter[int] = collections.Counter()  # own slots the peer has yet to hand back
        self._to_free: list[int] = []  # the peer's slots this side is done with, to hand back
        self._free_scheduled = False
        self.pool_bytes_sent = 0
        self.pool_bytes_received = 0
        self.peer_pid: int | None = None  # the peer's process, as its pool frames say

    def release(self, said_goodbye: bool) -> None:
        """The connection is gone (``said_goodbye``: the peer said goodbye and closed, nothing was lost):
        settle the slots lent over it and unmap the peer's pool."""
        if self._lent and self.pool is not None:
            if said_goodbye:  # it said goodbye and closed: it reads no more
                for k, count in self._lent.items():
                    for _ in range(count):
                        self.pool.give_back(k)
            else:  # lost, or closed by this side: the peer may still be reading them, until its process ends
                self.pool.quarantine(self._lent, self.peer_pid)
            self._lent.clear()
        if self.peer_pool is not None:
            self.peer_pool.close()  # views the router still holds keep the mapping until they go
            self.peer_pool = None
        if self._pool_answer is not None and not self._pool_answer.done():
            self._pool_answer.set_result(None)

    def payload_in(self, header: dict[str, Any], nbytes: int) -> np.ndarray:
        """The payload of a frame that names a slot of the peer's pool, in place (read-only)."""
        slot, peer = header["pool"], self.peer_pool
        if peer is None or type(slot) is not int or not 0 <= slot < peer.slots or nbytes > peer.slot_bytes:
            where = "a pool this side never mapped" if peer is None else f"a pool of {peer.slots} x {peer.slot_bytes}"
            raise ProtocolError(
                f"{self.conn.peer_label} at {self.conn.peername} sent a {nbytes}-byte payload in shared-memory "
                f"slot {slot!r} of {where}"
            )
        self.pool_bytes_received += nbytes
        return peer.view(slot, nbytes)

    # ------------------------------------------------------------ shared memory
    async def offer_pool(self, pool: ShmPool, timeout: float) -> bool:
        """Offer the peer this process's pool (and map the one it offers back).

        Returns whether the peer mapped it: from then on :meth:`send_tensor` with
        ``shared=True`` may put payloads in its slots. False where the peer is on another
        host (its handshake said where it runs), either side turned shared memory off, a
        checksum is asked for, or the peer did not answer within timeout.
        """
        if self.pool_offered:
            return self.peer_maps_pool
        if not self.can_share_memory():
            return False
        self.pool, self.pool_offered = pool, True
        fut = self._pool_answer = asyncio.get_running_loop().create_future()
        self.conn.send_frame(
            {"kind": "pool", "offer": pool.describe(), "mapped": self.peer_pool is not None, "pid": os.getpid()}
        )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await asyncio.shield(fut)
        return self.peer_maps_pool

    def can_share_memory(self) -> bool:
        """Whether a pool offer to this peer could work: a socket to a peer whose handshake
        says it runs on this host, no payload checksum, and PSRING_SAME_HOST not off."""
        conn = self.conn
        host = conn.peer.get("host")
        return (
            not conn.is_local
            and conn.is_open
            and conn.checksum is None
            and host is not None
            and same_host_paths(conn.settings)
            and host == host_key()
        )

    def on_pool(self, header: dict[str, Any]) -> None:
        """A ``pool`` frame: the peer offers its pool, or says it mapped this side's."""
        pid = header.get("pid")
        if type(pid) is int and pid > 0:
            self.peer_pid = pid
        if header.get("mapped") is True and self.pool_offered:
            self.peer_maps_pool = True
        desc = header.get("offer")
        if desc is not None:
            if self.peer_pool is None and self.conn.checksum is None and same_host_paths(self.conn.settings):
                try:
                    self.peer_pool = PeerPool.open(desc)
                except (OSError, ValueError) as exc:
                    logger.info(
                        "%r: not mapping the peer's shared memory (%s): its payloads come on the socket", self.conn, exc
                    )
            reply: dict[str, Any] = {"kind": "pool", "mapped": self.peer_pool is not None, "pid": os.getpid()}
            if not self.pool_offered and self.peer_pool is not None:
                if self.pool is None and self.pool_factory is not None:
                    self.pool = self.pool_factory()
                if self.pool is not None:
                    reply["offer"] = self.pool.describe()
                    self.pool_offered = True
            self.conn.send_frame(reply)
        if self._pool_answer is not None and not self._pool_answer.done():
            self._pool_answer.set_result(None)

    def release_slot(self, slot: int) -> None:
        """Hand a slot of the peer's pool back (with the next frame, or on its own soon)."""
        self._to_free.append(slot)
        if not self._free_scheduled:
            self._free_scheduled = True
            asyncio.get_running_loop().call_soon(self._send_free)

    def _send_free(self) -> None:
        self._free_scheduled = False
        if self._to_free and not self.conn.transport_gone():
            with contextlib.suppress(PsringError):
                self.conn.send_frame({"kind": "free"})

    def to_free(self) -> list[int]:
        """The peer's slots to hand back with the next frame (taken: the caller sends them)."""
        slots, self._to_free = self._to_free, []
        return slots

    def taken_back(self, slots: Any) -> None:
        """The peer handed back slots (a frame's ``free``)."""
        pool = self.pool
        if not isinstance(slots, tuple) or pool is None:
            raise ProtocolError(
                f"{self.conn.peer_label} at {self.conn.peername} handed back slots {slots!r:.80} it was not lent"
            )
        for k in slots:
            if type(k) is not int or self._lent[k] <= 0:
                raise ProtocolError(
                    f"{self.conn.peer_label} at {self.conn.peername} handed back slot {k!r}, which it was not lent"
                )
            self._lent[k] -= 1
            if not self._lent[k]:
                del self._lent[k]
            pool.give_back(k)

    def write_pooled(self, header: dict[str, Any], pool: ShmPool, k: int, nbytes: int) -> None:
        """Send a frame whose payload is already in slot k of this side's pool, lending it."""
        header["pool"] = k
        self.conn.send_frame(header, None, nbytes=nbytes)
        pool.lend(k)
        self._lent[k] += 1
        self.pool_bytes_sent += nbytes

    def send_slot(self, header: dict[str, Any], pool: ShmPool, k: int, x: np.ndarray) -> None:
        """Send x, which lives in slot k of this process's ``pool``: only the slot's number when
        the peer maps that pool, else a copy on the socket (the slot may be reused at once)."""
        if pool is self.pool and self.peer_maps_pool:
            self.write_pooled({**header, **wire.tensor_fields(x)}, pool, k, x.nbytes)
        else:
            self.conn.send_tensor(header, x.copy())
