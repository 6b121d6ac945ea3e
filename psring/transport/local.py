"""An in-process connection pair: a worker and a shard it hosts talk in frames without a socket."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from ..core import wire
from ..core.arrays import pooled_bytes
from ..errors import PeerLostError, ProtocolError
from .connection import Connection
from .shmpool import ShmPool
from .slots import SharedMemory


# ------------------------------------------------------------ in-process pair
class _LocalTransport(asyncio.Transport):
    """What a LocalConnection's users may ask of a transport: nothing is ever buffered."""

    def __init__(self) -> None:
        super().__init__()
        self._closing = False

    def get_write_buffer_size(self) -> int:
        return 0

    def is_closing(self) -> bool:
        return self._closing

    def close(self) -> None:
        self._closing = True

    def abort(self) -> None:
        self._closing = True

    def pause_reading(self) -> None:  # in-process pushes are bounded by the sender's own arrays
        pass

    def resume_reading(self) -> None:
        pass

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


class _InProcessSlots(SharedMemory):
    """An in-process end's "shared memory": a slot's payload is handed to the partner (send_slot)."""

    def __init__(self, conn: LocalConnection) -> None:
        super().__init__(conn)
        self.local = conn

    def send_slot(self, header: dict[str, Any], pool: ShmPool, k: int, x: np.ndarray) -> None:
        self.local.send_slot(header, pool, k, x)


class LocalConnection(Connection):
    """One end of a connection between two parts of one process (a worker and a shard it hosts).

    Frames keep their wire semantics -- the header goes through msgpack and validation, the
    payload is copied once, into the receiver's posted buffer when it has one (not at all when
    lent, or when the sender built it in that buffer: :meth:`peer_buffer`) -- but no socket,
    kernel copy or handshake is involved. Delivery is on the next loop iteration, in order;
    :meth:`flush` returns once the peer has taken every frame, which is when the sender may
    reuse its payload's memory, as with a socket.
    """

    is_local = True

    def __init__(self, name: str, peername: str) -> None:
        super().__init__(secret=None, name=name)
        self.handshake.frames = None
        self.shm = _InProcessSlots(self)
        self._partner: LocalConnection | None = None
        self._in_flight = 0
        self.transport = _LocalTransport()
        self.peername = peername

    def send_frame(
        self, header: dict[str, Any], payload: memoryview | bytes | None = None, *, nbytes: int | None = None
    ) -> None:
        self._queue(header, payload, None)

    def send_frames(self, frames: list[tuple[dict[str, Any], memoryview | bytes | None]]) -> None:
        for header, payload in frames:
            self._queue(header, payload, None)

    def lend_tensor(self, header: dict[str, Any], x: np.ndarray) -> None:
        """Like send_tensor, but the partner takes ``x``'s memory itself rather than a copy of it: only
        for a payload the sender will not change until the partner is done with it (the receiver's
        reply to this very frame is what the sender waits for)."""
        self._queue({**header, **wire.tensor_fields(x)}, wire.byte_view(x), None, lent=True)

    def _queue(
        self, header: dict[str, Any], payload: Any, taken: Callable[[], None] | None, lent: bool = False
    ) -> None:
        partner = self._partner
        if self.transport_gone() or partner is None:
            raise self._lost or self.lost_error(f"connection to {self.peer_label} ({self.peername}) is closed")
        size = 0 if payload is None else (payload.nbytes if isinstance(payload, memoryview) else len(payload))
        header.pop("pool", None)
        header["nbytes"] = size
        head = wire.encode_header(header)
        self.bytes_sent += len(head) + size
        self.frames_sent += 1
        self.last_sent = time.monotonic()
        self._in_flight += 1
        asyncio.get_running_loop().call_soon(self._hand_over, partner, head, payload, taken, lent)

    def send_slot(self, header: dict[str, Any], pool: ShmPool, k: int, x: np.ndarray) -> None:
        """In process: the slot stays lent until the partner has copied the payload out."""
        pool.lend(k)
        try:
            self._queue({**header, **wire.tensor_fields(x)}, wire.byte_view(x), lambda: pool.give_back(k))
        except BaseException:
            pool.give_back(k)
            raise

    def _hand_over(
        self, partner: LocalConnection, head: bytes, payload: Any, taken: Callable[[], None] | None, lent: bool
    ) -> None:
        try:
            if not partner.transport_gone():
                try:
                    partner._take(head, payload, lent)  # copied out here (unless lent), so flush may return after
                except Exception as exc:  # a bad frame or a router failure ends this connection, as on a socket
                    partner.abort(exc)
        finally:
            if taken is not None:
                taken()
        self._in_flight -= 1
        if self._in_flight == 0:
            self._wake_flushers(None)

    def _take(self, head: bytes, payload: Any, lent: bool = False) -> None:
        header = wire.decode_header(head, self._limits)
        nbytes = header["nbytes"]
        self.bytes_received += len(head) + nbytes
        self.last_heard = time.monotonic()
        dest: Any = None
        if lent and nbytes:
            dest = np.frombuffer(payload, np.uint8, nbytes)
        elif nbytes and self.router is not None and header["kind"] not in ("ping", "bye"):
            dest = self.router.buffer_for(self, header)
            if dest is not None and len(dest) != nbytes:
                dest = None
        if nbytes and not lent:
            src = np.frombuffer(payload, np.uint8, nbytes)
            if dest is None:
                dest = pooled_bytes(nbytes)
                np.copyto(dest, src)
            else:
                into = np.frombuffer(dest, np.uint8, nbytes)
                if into.ctypes.data != src.ctypes.data:  # else the sender wrote it in place (peer_buffer)
                    np.copyto(into, src)
        self.frame(header, dest)

    def peer_buffer(self, header: dict[str, Any]) -> memoryview | None:
        """Where the partner would receive a frame with this header (its posted buffer), or None.

        A sender that builds the payload there itself saves the copy: sent from that memory,
        the frame is taken without one. The partner may use the buffer the moment the frame
        arrives, so the sender must be done with it (every other send of it flushed) first.
        """
        partner = self._partner
        if partner is None or partner.router is None or partner.transport_gone() or self.transport_gone():
            return None
        return partner.router.buffer_for(partner, header)

    async def flush(self) -> None:
        if self._in_flight == 0 or self.transport_gone():
            if self._lost is not None:
                raise self._lost
            return
        fut = asyncio.get_running_loop().create_future()
        self._flush_waiters.append(fut)
        await fut

    def detach(self) -> socket.socket:
        raise ProtocolError("an in-process connection has no socket to detach")

    async def close(self, timeout: float = 2.0, farewell: dict[str, Any] | None = None) -> None:
        if not self.transport_gone():
            self._closing = True
            with contextlib.suppress(Exception):  # the goodbye is best effort: close anyway
                self.send_frame({**(farewell or {}), "kind": "bye"})
                async with asyncio.timeout(timeout):
                    await self.flush()
        self._shut(None)

    def abort(self, exc: BaseException) -> None:
        if self._lost is None:
            self._lost = (
                exc
                if isinstance(exc, PeerLostError)
                else self.lost_error(f"in-process connection to {self.peer_label} dropped: {exc}")
            )
            if not isinstance(exc, PeerLostError):
                self._lost.__cause__ = exc
        self._shut(self._lost)

    def _shut(self, error: PeerLostError | None) -> None:
        """Close this end and the partner's: the partner sees a goodbye (error None) or a loss."""
        partner, self._partner = self._partner, None
        assert self.transport is not None
        self.transport.close()
        self._teardown()
        if partner is not None and partner._partner is self:
            partner._partner = None
            if error is None:
                partner._closing = True
            elif partner._lost is None:
                partner._lost = partner.lost_error(f"in-process connection to {partner.peer_label} lost: {error}")
            assert partner.transport is not None
            partner.transport.close()
            partner._teardown()


def local_pair(a_name: str, b_name: str) -> tuple[LocalConnection, LocalConnection]:
    """Two connected in-process ends (set each one's ``peer`` and ``router`` before sending)."""
    a = LocalConnection(a_name, peername=f"in-process {b_name}")
    b = LocalConnection(b_name, peername=f"in-process {a_name}")
    a._partner, b._partner = b, a
    return a, b
