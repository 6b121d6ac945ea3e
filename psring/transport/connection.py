"""Connections: authenticated, heartbeating asyncio transports that move frames.

A :class:`Connection` is an ``asyncio.BufferedProtocol`` (uvloop reads straight into
the buffer it hands out): headers are parsed from a small staging buffer, and a
large payload is read directly into its destination buffer, with no intermediate
``bytes``. Sending writes the header bytes and a memoryview of the payload (no
copy); :meth:`Connection.flush` waits until the kernel has taken every byte, after
which the caller may reuse the payload's memory.

Frames that are not connection-level (handshake, ping, bye) go to a router; the
:class:`Mailbox` here is the router groups use: receives are matched by the
header's ``tag``, whether posted before or after the frame arrives.

Knows frames, not collectives.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import zlib
from collections.abc import Callable
from typing import Any, Protocol, cast

import numpy as np

from .. import settings as settings_mod
from ..core import wire
from ..errors import PeerLostError, ProtocolError
from ..settings import Settings
from . import traffic
from .framereader import FrameReader
from .handshake import HANDSHAKE_TIMEOUT, Handshake
from .heartbeat import Heartbeat
from .slots import SharedMemory

logger = logging.getLogger(__name__)


def _crc32c(data: Any) -> int:
    try:
        import crc32c
    except ImportError:
        raise ProtocolError("a crc32c checksum needs the crc32c package (pip install crc32c)") from None
    return int(crc32c.crc32c(data))


#: payload checksums by name (PSRING_CHECKSUM): the sender names the one it used in the frame header
CHECKSUMS: dict[str, Callable[[Any], int]] = {"crc32": zlib.crc32, "crc32c": _crc32c}

#: payloads up to this many bytes are copied next to their header and written in one call
SMALL_COPY = 16 << 10


class Router(Protocol):
    """Where a Connection sends the frames it does not handle itself."""

    def buffer_for(self, conn: Connection, header: dict[str, Any]) -> memoryview | None: ...

    def deliver(self, conn: Connection, header: dict[str, Any], payload: Any) -> None: ...

    def connection_lost(self, conn: Connection, error: PeerLostError | None) -> None: ...


class Connection(asyncio.BufferedProtocol):
    """One authenticated frame stream to a peer.

    This module holds the framing: the receive path that parses headers and reads
    payloads into place, the send path, flush and close. Its parts are objects of their own,
    each with the small interface it needs of the connection written down in its module: the
    handshake and its authentication (``handshake``, :mod:`.handshake`), the heartbeat
    (``heartbeat``, :mod:`.heartbeat`) and payloads in shared memory (``shm``, :mod:`.slots`).
    """

    def __init__(
        self,
        *,
        secret: bytes | None,
        limits: wire.Limits | None = None,
        name: str = "connection",
        heartbeat_interval: float | None = None,
        heartbeat_timeout: float | None = None,
        settings: Settings | None = None,
    ) -> None:
        settings = settings or settings_mod.current()
        self.settings = settings
        self.name = name
        self._limits = limits or wire.Limits.from_settings(settings)
        self.reader = FrameReader(self, self._limits)

        self.transport: asyncio.Transport | None = None
        self.router: Router | None = None
        self.peer: dict[str, Any] = {}  # the peer's hello/challenge fields
        self.peername: str = "?"
        self.bytes_sent = 0
        self.bytes_received = 0
        self.frames_sent = 0
        self.frames_received = 0
        self.last_heard = time.monotonic()
        self.last_sent = self.last_heard
        self._closing = False
        #: the peer's goodbye frame, once it said goodbye (it may carry where the peer stopped)
        self.farewell: dict[str, Any] | None = None
        self._lost: PeerLostError | None = None
        self._closed = asyncio.get_running_loop().create_future()
        self._flush_waiters: list[asyncio.Future[None]] = []
        self.handshake = Handshake(self, secret, self._closed)
        #: the payload checksum this side sends and asks for (PSRING_CHECKSUM), or None
        self.checksum = settings.checksum
        self.heartbeat = Heartbeat(
            self, heartbeat_interval or settings.heartbeat_interval, heartbeat_timeout or settings.heartbeat_timeout
        )
        self.shm = SharedMemory(self)
        self._slot_in: int | None = None  # the peer's slot holding the payload being delivered

    def __repr__(self) -> str:
        return f"Connection({self.name} <-> {self.peername})"

    # ---------------------------------------------------------------- handshake
    async def client_handshake(self, hello: dict[str, Any], timeout: float = HANDSHAKE_TIMEOUT) -> None:
        await self.handshake.client(hello, timeout)

    async def server_handshake(
        self, info: dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]], timeout: float = HANDSHAKE_TIMEOUT
    ) -> None:
        """``info``: the fields this side tells the client, or a function of the client's hello
        that returns them (one port serving several jobs answers each as its own)."""
        await self.handshake.server(info, timeout)

    def handshake_done(self) -> None:
        queue, self.handshake.frames = self.handshake.frames, None
        if queue is not None and not queue.empty():
            early = queue.get_nowait()
            if early.get("kind") == "reject":  # welcomed, then turned away (wrong job, rank, world size)
                raise ProtocolError(f"{self.peername} refused this connection: {str(early.get('reason'))[:2000]}")
            raise ProtocolError(f"{self.peername} sent frames before the handshake completed")
        self.reader.use_full_staging()
        self.heartbeat.start()
        self.reader.replay()

    @property
    def peer_rank(self) -> int | None:
        """The peer's rank when the peer is a rank of a group (None for servers, stores, ...)."""
        rank = self.peer.get("rank")
        return rank if self.peer.get("role") == "rank" and type(rank) is int else None

    def lost_error(self, message: str) -> PeerLostError:
        return PeerLostError(message, rank=self.peer_rank)

    @property
    def peer_label(self) -> str:
        rank = self.peer.get("rank")
        role = self.peer.get("role", "peer")
        shards = self.peer.get("shards")
        if role == "server" and isinstance(shards, (list, tuple)) and shards:
            return f"server shard{'s' if len(shards) > 1 else ''} {', '.join(map(str, shards))}"
        return f"{role} {rank}" if rank is not None else str(role)

    # ----------------------------------------------------------- transport events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # a stream socket's (uvloop's own class)
        # high=0/low=0: pause_writing after any write the kernel did not take at once,
        # resume_writing when the buffer is empty again -- the flush signal.
        self.transport.set_write_buffer_limits(high=0, low=0)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # pragma: no cover - platform dependent
                pass
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.peername = f"{peer[0]}:{peer[1]}"
        self.last_heard = self.last_sent = time.monotonic()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lost is None and not self._closing:
            detail = f": {exc}" if exc else " (closed by the peer)"
            self._lost = self.lost_error(f"connection to {self.peer_label} at {self.peername} lost{detail}")
            if exc is not None:
                self._lost.__cause__ = exc
        self._teardown()

    def pause_writing(self) -> None:
        pass

    def resume_writing(self) -> None:
        self._wake_flushers(None)

    def eof_received(self) -> bool:
        return False  # close the transport

    # ------------------------------------------------------------- receive path
    def get_buffer(self, sizehint: int) -> memoryview:
        return self.reader.get_buffer(sizehint)

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_received += nbytes
        traffic.note(nbytes)
        self.last_heard = time.monotonic()
        try:
            self.reader.updated(nbytes)
        except Exception as exc:  # a bad frame or a router failure ends this connection
            self.abort(exc)

    @property
    def handshaking(self) -> bool:
        return self.handshake.frames is not None

    def resume_reading(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.resume_reading()

    def transport_gone(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def frame(self, header: dict[str, Any], payload: Any, slot: int | None = None) -> None:
        """A whole frame arrived (``slot``: its payload is in that slot of the peer's pool): the connection's
        own (ping, bye, pool, the handshake's) are handled here, the rest go to the router."""
        self.frames_received += 1
        kind = header["kind"]
        if "free" in header:
            self.shm.taken_back(header.pop("free"))
        if slot is not None and (
            kind in ("ping", "bye", "pool", "free") or self.handshake.frames is not None or self.router is None
        ):
            self.shm.release_slot(slot)  # nobody will read it
        if kind == "ping":
            return
        if kind == "bye":
            self._closing = True  # the peer is leaving on purpose: not a loss
            self.farewell = header
            return
        if self.handshake.frames is not None:
            if self.handshake.frames.qsize() >= 4:  # a handshake is 2-3 frames, one at a time
                raise ProtocolError(f"{self.peername} sent a stream of frames before the handshake completed")
            self.handshake.frames.put_nowait(header)
            if kind == "welcome":
                # the server is done and may send at once; its frames wait for the handshake to end
                self.reader.held = True
                if self.transport is not None:
                    self.transport.pause_reading()
            return
        if kind == "pool":
            self.shm.on_pool(header)
            return
        if kind == "free":
            return
        if kind == "reject" and self.reader.replaying:  # welcomed, then turned away at once (wrong job, rank, ...)
            raise ProtocolError(f"{self.peername} refused this connection: {str(header.get('reason'))[:2000]}")
        if self.router is None:
            raise ProtocolError(f"unexpected {kind!r} frame from {self.peername} before it was routed")
        if "sum" in header:
            self._verify(header, payload)
        if slot is None:
            self.router.deliver(self, header, payload)
            return
        self._slot_in = slot
        try:
            self.router.deliver(self, header, payload)
        finally:
            if self._slot_in is not None:  # the router is done with it (it did not hold it)
                self._slot_in = None
                self.shm.release_slot(slot)

    def _verify(self, header: dict[str, Any], payload: Any) -> None:
        """The sender put a checksum of the payload in the header: check it before anyone uses the bytes."""
        claim = header["sum"]
        if not (isinstance(claim, tuple) and len(claim) == 2 and claim[0] in CHECKSUMS and type(claim[1]) is int):
            raise ProtocolError(f"{self.peer_label} at {self.peername} sent a malformed checksum field: {claim!r}")
        got = CHECKSUMS[claim[0]](memoryview(payload).cast("B") if header["nbytes"] else b"")
        if got != claim[1]:
            raise ProtocolError(
                f"payload checksum mismatch on a {header['kind']!r} frame from {self.peer_label} at {self.peername} "
                f"({claim[0]} {got:#010x}, sender said {claim[1]:#010x}): the bytes were corrupted in transit"
            )

    # ---------------------------------------------------------------- send path
    def send_frame(
        self, header: dict[str, Any], payload: memoryview | bytes | None = None, *, nbytes: int | None = None
    ) -> None:
        """Queue one frame (header + payload) for sending; never blocks, never copies payload.

        The payload's memory must stay unchanged until :meth:`flush` returns. (``nbytes``:
        the size of a payload that is in a shared-memory slot rather than given here.)
        """
        transport = self._open_transport()
        head, size = self._encode(header, payload, nbytes)
        if size and size <= SMALL_COPY:
            transport.write(b"".join((head, payload)))  # type: ignore[arg-type]  # one syscall, one segment: small frames are latency-bound
            self.bytes_sent += len(head) + size
        elif size:
            transport.writelines((head, payload))  # type: ignore[arg-type]  # size > 0: a payload
            self.bytes_sent += len(head) + size
        else:
            transport.write(head)
            self.bytes_sent += len(head)
        self.frames_sent += 1
        self.last_sent = time.monotonic()

    def send_frames(self, frames: list[tuple[dict[str, Any], memoryview | bytes | None]]) -> None:
        """Queue several frames (header, payload) at once, in order, as :meth:`send_frame` would each:
        in one write -- one system call, and one segment where they are small (a parameter server's
        join and the pieces behind it: the kernel's send is most of a small frame's cost)."""
        transport = self._open_transport()
        parts: list[bytes | memoryview] = []
        total = 0
        for header, payload in frames:
            head, size = self._encode(header, payload, None)
            parts.append(head)
            total += len(head) + size
            if size:
                parts.append(payload)  # type: ignore[arg-type]  # size > 0: a payload
        if total <= SMALL_COPY:
            transport.write(b"".join(parts))
        else:
            transport.writelines(parts)
        self.bytes_sent += total
        self.frames_sent += len(frames)
        self.last_sent = time.monotonic()

    def _open_transport(self) -> asyncio.Transport:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise self._lost or self.lost_error(f"connection to {self.peer_label} at {self.peername} is closed")
        return transport

    def _encode(
        self, header: dict[str, Any], payload: memoryview | bytes | None, nbytes: int | None
    ) -> tuple[bytes, int]:
        """A frame's encoded header (it gains nbytes, and what rides along: slots to free, a checksum)
        and its payload's size."""
        size = len(payload) if payload is not None else 0
        if isinstance(payload, memoryview):
            size = payload.nbytes
        if nbytes is None:
            header.pop("pool", None)  # a relayed header says nothing of where its payload is
            nbytes = size
        header["nbytes"] = nbytes
        if self.handshake.frames is None and (free := self.shm.to_free()):
            header["free"] = free
        if self.checksum is not None and size and self.handshake.frames is None:
            header["sum"] = (self.checksum, CHECKSUMS[self.checksum](payload))
        return wire.encode_header(header), size

    def send_tensor(
        self, header: dict[str, Any], x: np.ndarray, shared: bool = False, owner: tuple[Any, int] | None = None
    ) -> None:
        """Send a C-contiguous host array as a frame; the header gains dtype/shape/nbytes.

        ``shared=True``: when the peer maps this side's pool and a slot is free, the array is
        copied into the slot (taken for ``owner``, see ShmPool.may_wait) and only its number
        crosses the socket. The receiving router must be done with such a payload when its
        ``deliver`` returns, or hold the slot.
        """
        header = {**header, **wire.tensor_fields(x)}
        pool = self.shm.pool
        if shared and self.shm.peer_maps_pool and pool is not None and 0 < x.nbytes <= pool.slot_bytes:
            k = pool.take(owner)
            if k is not None:
                try:
                    np.copyto(pool.view(k, x.nbytes), wire.byte_view(x))
                    self.shm.write_pooled(header, pool, k, x.nbytes)
                finally:
                    pool.give_back(k)
                return
        self.send_frame(header, wire.byte_view(x) if x.nbytes else None)

    async def flush(self) -> None:
        """Wait until every byte queued so far has been handed to the kernel."""
        transport = self.transport
        if transport is None or transport.get_write_buffer_size() == 0:
            if self._lost is not None and transport is None:
                raise self._lost
            return
        fut = asyncio.get_running_loop().create_future()
        self._flush_waiters.append(fut)
        await fut

    def _wake_flushers(self, exc: BaseException | None) -> None:
        waiters, self._flush_waiters = self._flush_waiters, []
        for fut in waiters:
            if not fut.done():
                if exc is None:
                    fut.set_result(None)
                else:
                    fut.set_exception(exc)

    # ------------------------------------------------------------------- close
    @property
    def lost(self) -> PeerLostError | None:
        return self._lost

    @property
    def is_open(self) -> bool:
        return not self.transport_gone() and self._lost is None

    #: an in-process end (no socket, no shared memory)
    is_local = False

    def abort(self, exc: BaseException) -> None:
        """Drop the connection because of an error (bad frame, silent peer)."""
        logger.debug("%r aborted: %s", self, exc)
        if self._lost is None:
            if isinstance(exc, PeerLostError):
                self._lost = exc
            else:
                self._lost = self.lost_error(f"connection to {self.peer_label} at {self.peername} dropped: {exc}")
                self._lost.__cause__ = exc
        if self.transport is not None:
            self.transport.abort()
        self._teardown()

    def detach(self) -> socket.socket:
        """Take this connection's socket out of the event loop, as a blocking socket for a thread.

        Call it right after the handshake, before either side sent anything else: bytes the
        transport already read would be lost. This Connection is closed quietly (no goodbye,
        no loss reported to its router); the socket itself stays open.
        """
        transport = self.transport
        if transport is None or transport.is_closing() or self._lost is not None:
            raise self._lost or self.lost_error(f"connection to {self.peer_label} at {self.peername} is closed")
        if transport.get_extra_info("ssl_object") is not None:
            raise ProtocolError("a TLS connection cannot be detached from its transport")
        if self.reader.mid_stream:
            raise ProtocolError(f"{self.peername} sent bytes before its link was taken over")
        sock = transport.get_extra_info("socket")
        raw = socket.socket(fileno=os.dup(sock.fileno()))
        raw.setblocking(True)
        transport.pause_reading()
        self._closing = True
        self.router = None
        transport.abort()  # closes this fd only: the dup keeps the socket (no RST, no FIN)
        self._teardown()
        return raw

    async def close(self, timeout: float = 2.0, farewell: dict[str, Any] | None = None) -> None:
        """Say goodbye, flush, and close; idempotent, and closes even if the goodbye fails.

        ``farewell`` adds fields to the goodbye frame (the peer sees them as its ``farewell``).
        """
        if self.transport is None or (self._closing and self.transport.is_closing()):
            self._teardown()
            return
        self._closing = True
        try:
            if not self.transport.is_closing() and self.handshake.frames is None:
                self.send_frame({**(farewell or {}), "kind": "bye"})
                async with asyncio.timeout(timeout):
                    await self.flush()
        except (Exception, asyncio.CancelledError):  # the goodbye is best effort: close anyway
            pass
        finally:
            if self.transport is not None:
                self.transport.close()
            self._teardown()

    def _teardown(self) -> None:
        self.heartbeat.stop()
        self.shm.release(said_goodbye=self.farewell is not None and self._lost is None)
        err = self._lost or self.lost_error(f"connection to {self.peer_label} at {self.peername} closed")
        self._wake_flushers(err)
        if not self._closed.done():
            self._closed.set_result(None)
            router = self.router
            if router is not None:
                router.connection_lost(self, None if self._closing and self._lost is None else self._lost)

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)

    def on_closed(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (on the loop) once this connection has closed, for whatever reason."""
        self._closed.add_done_callback(lambda _f: callback())

    def hold_slot(self) -> int:
        """Called by a router while a frame is delivered whose payload is in the peer's pool:
        keep the slot (the payload stays valid) until ``conn.shm.release_slot``."""
        slot, self._slot_in = self._slot_in, None
        if slot is None:
            raise RuntimeError("no shared-memory payload is being delivered")
        return slot
