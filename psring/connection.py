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
import collections
import contextlib
import hashlib
import hmac
import ipaddress
import logging
import os
import secrets
import socket
import ssl
import time
import zlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import numpy as np

from . import wire
from .arrays import pooled_bytes
from .errors import AuthError, PeerLostError, ProtocolError, PsringError
from .shmpool import PeerPool, ShmPool, host_key, pools_enabled

logger = logging.getLogger(__name__)

#: payloads at least this large (still to read) are read straight into their destination
DIRECT_READ_MIN = 32 << 10
STAGING_SIZE = 256 << 10
HANDSHAKE_STAGING_SIZE = 4 << 10
HANDSHAKE_TIMEOUT = 10.0
MAX_PENDING_HANDSHAKES = 256

_warned_open_listen: set[str] = set()


def _mac(secret: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, label + a + b, hashlib.sha256).digest()


def _env_float(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if not raw:
        return default
    try:
        value = float(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a number of seconds") from None
    if value <= 0:
        raise ValueError(f"{name}={raw!r} must be positive")
    return value


def _crc32c(data: Any) -> int:
    try:
        import crc32c
    except ImportError:
        raise ProtocolError("a crc32c checksum needs the crc32c package (pip install crc32c)") from None
    return int(crc32c.crc32c(data))


#: payload checksums by name: the sender names the one it used in the frame header
CHECKSUMS: dict[str, Callable[[Any], int]] = {"crc32": zlib.crc32, "crc32c": _crc32c}


def checksum_from_env() -> str | None:
    """PSRING_CHECKSUM: "crc32c" (hardware-accelerated, needs the crc32c package), "crc32"
    (zlib), or unset/"0" for none (the default: TCP's checksum and TLS's MAC guard the bytes)."""
    name = os.environ.get("PSRING_CHECKSUM", "").strip().lower()
    if name in ("", "0", "none", "off", "no"):
        return None
    if name not in CHECKSUMS:
        raise ValueError(f"PSRING_CHECKSUM={name!r}: expected one of {', '.join(CHECKSUMS)} (or unset)")
    if name == "crc32c":
        _crc32c(b"")  # fail now, not on the first frame
    return name


#: payloads up to this many bytes are copied next to their header and written in one call
SMALL_COPY = 16 << 10


class Router(Protocol):
    """Where a Connection sends the frames it does not handle itself."""

    def buffer_for(self, conn: Connection, header: dict[str, Any]) -> memoryview | None: ...

    def deliver(self, conn: Connection, header: dict[str, Any], payload: Any) -> None: ...

    def connection_lost(self, conn: Connection, error: PeerLostError | None) -> None: ...


class Connection(asyncio.BufferedProtocol):
    """One authenticated frame stream to a peer."""

    def __init__(
        self,
        *,
        secret: bytes | None,
        limits: wire.Limits | None = None,
        name: str = "connection",
        heartbeat_interval: float | None = None,
        heartbeat_timeout: float | None = None,
    ) -> None:
        self.name = name
        self._secret = secret
        self._limits = limits or wire.Limits.from_env()
        self._decoder = wire.HeaderDecoder(self._limits)
        # a small buffer until the peer has proved itself: a flood of connections costs little
        self._staging = bytearray(HANDSHAKE_STAGING_SIZE)
        self._stage = memoryview(self._staging)
        self._start = 0
        self._end = 0
        # the payload being read
        self._header: dict[str, Any] | None = None
        self._dest: memoryview | None = None
        self._dest_obj: Any = None
        self._dest_off = 0
        self._direct = False

        self.transport: asyncio.Transport | None = None
        self.router: Router | None = None
        self.peer: dict[str, Any] = {}  # the peer's hello/challenge fields
        self.peername: str = "?"
        self.bytes_sent = 0
        self.bytes_received = 0
        self.frames_sent = 0
        self.frames_received = 0
        self.last_heard = time.monotonic()
        self._last_sent = self.last_heard
        self._closing = False
        #: the peer's goodbye frame, once it said goodbye (it may carry where the peer stopped)
        self.farewell: dict[str, Any] | None = None
        self._lost: PeerLostError | None = None
        self._closed = asyncio.get_running_loop().create_future()
        self._flush_waiters: list[asyncio.Future[None]] = []
        self._handshake_frames: asyncio.Queue[dict[str, Any]] | None = asyncio.Queue()
        self._checksum = checksum_from_env()
        self._hb_interval = heartbeat_interval or _env_float("PSRING_HEARTBEAT_INTERVAL", 1.0)
        self._hb_timeout = heartbeat_timeout or _env_float("PSRING_HEARTBEAT_TIMEOUT", 10.0)
        self._hb_handle: asyncio.TimerHandle | None = None
        self._hb_last_tick = 0.0
        # shared-memory payloads with a peer on this host (psring.shmpool; see offer_pool)
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
        self._slot_in: int | None = None  # the peer's slot holding the payload being delivered
        self.pool_bytes_sent = 0
        self.pool_bytes_received = 0
        self.peer_pid: int | None = None  # the peer's process, as its pool frames say

    def __repr__(self) -> str:
        return f"Connection({self.name} <-> {self.peername})"

    # ----------------------------------------------------------- transport events
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        # high=0/low=0: pause_writing after any write the kernel did not take at once,
        # resume_writing when the buffer is empty again -- the flush signal.
        transport.set_write_buffer_limits(high=0, low=0)
        sock = transport.get_extra_info("socket")
        if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            except OSError:  # pragma: no cover - platform dependent
                pass
        peer = transport.get_extra_info("peername")
        if isinstance(peer, tuple):
            self.peername = f"{peer[0]}:{peer[1]}"
        self.last_heard = self._last_sent = time.monotonic()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._lost is None and not self._closing:
            detail = f": {exc}" if exc else " (closed by the peer)"
            self._lost = self._lost_error(f"connection to {self.peer_label} at {self.peername} lost{detail}")
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
        dest = self._dest
        if dest is not None and self._start == self._end:
            remaining = len(dest) - self._dest_off
            if remaining >= DIRECT_READ_MIN:
                self._direct = True
                return dest[self._dest_off :]
        self._direct = False
        if self._start == self._end:
            self._start = self._end = 0
        elif len(self._staging) - self._end < 4096:
            # compact: move the unparsed tail to the front
            n = self._end - self._start
            self._stage[:n] = self._stage[self._start : self._end]
            self._start, self._end = 0, n
        return self._stage[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        self.bytes_received += nbytes
        self.last_heard = time.monotonic()
        try:
            if self._direct:
                self._direct = False
                self._dest_off += nbytes
                if self._dest is not None and self._dest_off == len(self._dest):
                    self._finish_frame()
                return
            self._end += nbytes
            self._process_staging()
        except Exception as exc:  # a bad frame or a router failure ends this connection
            self.abort(exc)

    def _process_staging(self) -> None:
        stage = self._stage
        while self._start < self._end:
            if self._dest is None:
                header, used = self._decoder.feed(stage[self._start : self._end])
                self._start += used
                if header is None:
                    break
                self._begin_frame(header)
            else:
                take = min(self._end - self._start, len(self._dest) - self._dest_off)
                self._dest[self._dest_off : self._dest_off + take] = stage[self._start : self._start + take]
                self._dest_off += take
                self._start += take
                if self._dest_off == len(self._dest):
                    self._finish_frame()
            if self._transport_gone():
                return
        if self._start == self._end:
            self._start = self._end = 0

    def _transport_gone(self) -> bool:
        return self.transport is None or self.transport.is_closing()

    def _begin_frame(self, header: dict[str, Any]) -> None:
        nbytes = header["nbytes"]
        if nbytes and self._handshake_frames is not None:
            # nothing is allocated for a party that has not proved itself yet
            kind = header["kind"]
            raise ProtocolError(f"a {kind!r} frame with a {nbytes}-byte payload before the handshake completed")
        self._header = header
        if "pool" in header:  # the payload is in a slot of the peer's pool, not on the socket
            self._pooled_payload(header, nbytes)
            return
        dest: memoryview | None = None
        if (
            nbytes
            and self._handshake_frames is None
            and self.router is not None
            and header["kind"] not in ("ping", "bye")
        ):
            dest = self.router.buffer_for(self, header)
            if dest is not None and len(dest) != nbytes:
                dest = None
        if dest is None:
            obj = np.empty(nbytes, dtype=np.uint8)
            dest = memoryview(obj)
            self._dest_obj = obj
        else:
            self._dest_obj = dest
        self._dest = dest
        self._dest_off = 0
        if nbytes == 0:
            self._finish_frame()

    def _pooled_payload(self, header: dict[str, Any], nbytes: int) -> None:
        slot, peer = header["pool"], self.peer_pool
        if peer is None or type(slot) is not int or not 0 <= slot < peer.slots or nbytes > peer.slot_bytes:
            where = "a pool this side never mapped" if peer is None else f"a pool of {peer.slots} x {peer.slot_bytes}"
            raise ProtocolError(
                f"{self.peer_label} at {self.peername} sent a {nbytes}-byte payload in shared-memory slot "
                f"{slot!r} of {where}"
            )
        self._dest_obj = peer.view(slot, nbytes)
        self._slot_in = slot
        self.pool_bytes_received += nbytes
        self._finish_frame()

    def _finish_frame(self) -> None:
        header, payload = self._header, self._dest_obj
        self._header = self._dest = self._dest_obj = None
        self._dest_off = 0
        slot, self._slot_in = self._slot_in, None
        self.frames_received += 1
        assert header is not None
        kind = header["kind"]
        if "free" in header:
            self._taken_back(header.pop("free"))
        if slot is not None and (
            kind in ("ping", "bye", "pool", "free") or self._handshake_frames is not None or self.router is None
        ):
            self.release_slot(slot)  # nobody will read it
        if kind == "ping":
            return
        if kind == "bye":
            self._closing = True  # the peer is leaving on purpose: not a loss
            self.farewell = header
            return
        if self._handshake_frames is not None:
            if self._handshake_frames.qsize() >= 4:  # a handshake is 2-3 frames, one at a time
                raise ProtocolError(f"{self.peername} sent a stream of frames before the handshake completed")
            self._handshake_frames.put_nowait(header)
            return
        if kind == "pool":
            self._on_pool(header)
            return
        if kind == "free":
            return
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
                self.release_slot(slot)

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
        self.send_frame(
            {"kind": "pool", "offer": pool.describe(), "mapped": self.peer_pool is not None, "pid": os.getpid()}
        )
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(fut), timeout)
        return self.peer_maps_pool

    def can_share_memory(self) -> bool:
        """Whether a pool offer to this peer could work: a socket to a peer whose handshake
        says it runs on this host, no payload checksum, and PSRING_SAME_HOST not off."""
        host = self.peer.get("host")
        return (
            not self.is_local
            and self.is_open
            and self._checksum is None
            and host is not None
            and pools_enabled()
            and host == host_key()
        )

    def _on_pool(self, header: dict[str, Any]) -> None:
        pid = header.get("pid")
        if type(pid) is int and pid > 0:
            self.peer_pid = pid
        if header.get("mapped") is True and self.pool_offered:
            self.peer_maps_pool = True
        desc = header.get("offer")
        if desc is not None:
            if self.peer_pool is None and self._checksum is None and pools_enabled():
                try:
                    self.peer_pool = PeerPool.open(desc)
                except (OSError, ValueError) as exc:
                    logger.info(
                        "%r: not mapping the peer's shared memory (%s): its payloads come on the socket", self, exc
                    )
            reply: dict[str, Any] = {"kind": "pool", "mapped": self.peer_pool is not None, "pid": os.getpid()}
            if not self.pool_offered and self.peer_pool is not None:
                if self.pool is None and self.pool_factory is not None:
                    self.pool = self.pool_factory()
                if self.pool is not None:
                    reply["offer"] = self.pool.describe()
                    self.pool_offered = True
            self.send_frame(reply)
        if self._pool_answer is not None and not self._pool_answer.done():
            self._pool_answer.set_result(None)

    def hold_slot(self) -> int:
        """Called by a router while a frame is delivered whose payload is in the peer's pool:
        keep the slot (the payload stays valid) until :meth:`release_slot`."""
        slot, self._slot_in = self._slot_in, None
        if slot is None:
            raise RuntimeError("no shared-memory payload is being delivered")
        return slot

    def release_slot(self, slot: int) -> None:
        """Hand a slot of the peer's pool back (with the next frame, or on its own soon)."""
        self._to_free.append(slot)
        if not self._free_scheduled:
            self._free_scheduled = True
            asyncio.get_running_loop().call_soon(self._send_free)

    def _send_free(self) -> None:
        self._free_scheduled = False
        if self._to_free and not self._transport_gone():
            with contextlib.suppress(PsringError):
                self.send_frame({"kind": "free"})

    def _taken_back(self, slots: Any) -> None:
        pool = self.pool
        if not isinstance(slots, tuple) or pool is None:
            raise ProtocolError(f"{self.peer_label} at {self.peername} handed back slots {slots!r:.80} it was not lent")
        for k in slots:
            if type(k) is not int or self._lent[k] <= 0:
                raise ProtocolError(
                    f"{self.peer_label} at {self.peername} handed back slot {k!r}, which it was not lent"
                )
            self._lent[k] -= 1
            if not self._lent[k]:
                del self._lent[k]
            pool.give_back(k)

    def _write_pooled(self, header: dict[str, Any], pool: ShmPool, k: int, nbytes: int) -> None:
        """Send a frame whose payload is already in slot k of this side's pool, lending it."""
        header["pool"] = k
        self.send_frame(header, None, nbytes=nbytes)
        pool.lend(k)
        self._lent[k] += 1
        self.pool_bytes_sent += nbytes

    def send_slot(self, header: dict[str, Any], pool: ShmPool, k: int, x: np.ndarray) -> None:
        """Send x, which lives in slot k of this process's ``pool``: only the slot's number when
        the peer maps that pool, else a copy on the socket (the slot may be reused at once)."""
        if pool is self.pool and self.peer_maps_pool:
            self._write_pooled({**header, **wire.tensor_fields(x)}, pool, k, x.nbytes)
        else:
            self.send_tensor(header, x.copy())

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
        transport = self.transport
        if transport is None or transport.is_closing():
            raise self._lost or self._lost_error(f"connection to {self.peer_label} at {self.peername} is closed")
        size = len(payload) if payload is not None else 0
        if isinstance(payload, memoryview):
            size = payload.nbytes
        if nbytes is None:
            header.pop("pool", None)  # a relayed header says nothing of where its payload is
            nbytes = size
        header["nbytes"] = nbytes
        if self._to_free and self._handshake_frames is None:
            header["free"], self._to_free = self._to_free, []
        if self._checksum is not None and size and self._handshake_frames is None:
            header["sum"] = (self._checksum, CHECKSUMS[self._checksum](payload))
        head = wire.encode_header(header)
        if size and size <= SMALL_COPY:
            transport.write(b"".join((head, payload)))  # one syscall, one segment: small frames are latency-bound
            self.bytes_sent += len(head) + size
        elif size:
            transport.writelines((head, payload))
            self.bytes_sent += len(head) + size
        else:
            transport.write(head)
            self.bytes_sent += len(head)
        self.frames_sent += 1
        self._last_sent = time.monotonic()

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
        pool = self.pool
        if shared and self.peer_maps_pool and pool is not None and 0 < x.nbytes <= pool.slot_bytes:
            k = pool.take(owner)
            if k is not None:
                try:
                    np.copyto(pool.view(k, x.nbytes), wire.byte_view(x))
                    self._write_pooled(header, pool, k, x.nbytes)
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

    # --------------------------------------------------------------- handshake
    @property
    def peer_rank(self) -> int | None:
        """The peer's rank when the peer is a rank of a group (None for servers, stores, ...)."""
        rank = self.peer.get("rank")
        return rank if self.peer.get("role") == "rank" and type(rank) is int else None

    def _lost_error(self, message: str) -> PeerLostError:
        return PeerLostError(message, rank=self.peer_rank)

    @property
    def peer_label(self) -> str:
        rank = self.peer.get("rank")
        role = self.peer.get("role", "peer")
        shards = self.peer.get("shards")
        if role == "server" and isinstance(shards, (list, tuple)) and shards:
            return f"server shard{'s' if len(shards) > 1 else ''} {', '.join(map(str, shards))}"
        return f"{role} {rank}" if rank is not None else str(role)

    async def _handshake_frame(self, deadline: float, expect: str) -> dict[str, Any]:
        assert self._handshake_frames is not None
        remaining = deadline - time.monotonic()
        get = asyncio.ensure_future(self._handshake_frames.get())
        done, _ = await asyncio.wait(
            {get, self._closed}, timeout=max(remaining, 0), return_when=asyncio.FIRST_COMPLETED
        )
        if get not in done:
            get.cancel()
            if self._closed in done:
                raise AuthError(
                    f"{self.peername} closed the connection during the handshake (waiting for {expect!r}); "
                    "check that both sides use the same PSRING_SECRET"
                )
            raise AuthError(f"{self.peername} did not complete the handshake in time (waiting for {expect!r})")
        frame = get.result()
        if frame["kind"] == "reject":
            raise AuthError(f"{self.peername} refused the connection: {frame.get('reason', '?')}")
        if frame["kind"] != expect:
            raise ProtocolError(f"handshake with {self.peername}: got {frame['kind']!r}, expected {expect!r}")
        return frame

    async def client_handshake(self, hello: dict[str, Any], timeout: float = HANDSHAKE_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        nonce = secrets.token_bytes(32)
        self.send_frame(
            {"kind": "hello", "version": wire.WIRE_VERSION, "nonce": nonce, "auth": self._secret is not None, **hello}
        )
        challenge = await self._handshake_frame(deadline, "challenge")
        self.peer = {k: v for k, v in challenge.items() if k not in ("kind", "nonce", "mac", "nbytes")}
        if self._secret is None:
            if challenge.get("auth"):
                raise AuthError(f"{self.peername} requires a shared secret; set PSRING_SECRET (or secret=)")
        else:
            if not challenge.get("auth"):
                self._reject("this process has a shared secret but the server has none")
                raise AuthError(
                    f"{self.peername} has no shared secret configured but this process has one; "
                    "set the same PSRING_SECRET on both"
                )
            server_nonce = challenge.get("nonce")
            mac = challenge.get("mac")
            if not isinstance(server_nonce, bytes) or not isinstance(mac, bytes):
                raise ProtocolError(f"handshake with {self.peername}: challenge lacks nonce or mac")
            if not hmac.compare_digest(mac, _mac(self._secret, b"psring-server", nonce, server_nonce)):
                self._reject("wrong secret: the server's proof did not verify")
                raise AuthError(f"{self.peername} failed to prove the shared secret (wrong PSRING_SECRET?)")
            self.send_frame({"kind": "auth", "mac": _mac(self._secret, b"psring-client", server_nonce, nonce)})
        await self._handshake_frame(deadline, "welcome")
        self._handshake_done()

    async def server_handshake(self, info: dict[str, Any], timeout: float = HANDSHAKE_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        hello = await self._handshake_frame(deadline, "hello")
        self.peer = {k: v for k, v in hello.items() if k not in ("kind", "nonce", "auth", "nbytes", "version")}
        if hello.get("version") != wire.WIRE_VERSION:
            reason = f"wire version {hello.get('version')!r} is not this server's {wire.WIRE_VERSION}"
            self._reject(reason)
            raise ProtocolError(f"{self.peername}: {reason}")
        nonce = secrets.token_bytes(32)
        client_nonce = hello.get("nonce")
        if not isinstance(client_nonce, bytes) or len(client_nonce) < 16:
            self._reject("hello lacks a nonce")
            raise ProtocolError(f"{self.peername}: hello lacks a nonce")
        if self._secret is None:
            self.send_frame({"kind": "challenge", "auth": False, **info})
            if hello.get("auth"):
                # the client will refuse us; wait for its reject or close
                await self._expect_close(deadline)
                raise AuthError(f"{self.peername} has a shared secret but this server has none")
        else:
            if not hello.get("auth"):
                self._reject("a shared secret is required; set PSRING_SECRET")
                raise AuthError(f"{self.peername} has no shared secret; this server requires one")
            mac = _mac(self._secret, b"psring-server", client_nonce, nonce)
            self.send_frame({"kind": "challenge", "auth": True, "nonce": nonce, "mac": mac, **info})
            proof = await self._handshake_frame(deadline, "auth")
            given = proof.get("mac")
            if not isinstance(given, bytes) or not hmac.compare_digest(
                given, _mac(self._secret, b"psring-client", nonce, client_nonce)
            ):
                self._reject("wrong secret: the client's proof did not verify")
                raise AuthError(f"{self.peername} failed to prove the shared secret (wrong PSRING_SECRET?)")
        self.send_frame({"kind": "welcome"})
        self._handshake_done()

    async def _expect_close(self, deadline: float) -> None:
        try:
            await self._handshake_frame(deadline, "auth")
        except (AuthError, ProtocolError):
            pass

    def _reject(self, reason: str) -> None:
        try:
            self.send_frame({"kind": "reject", "reason": reason})
        except PeerLostError:
            pass

    def _handshake_done(self) -> None:
        queue, self._handshake_frames = self._handshake_frames, None
        if queue is not None and not queue.empty():
            early = queue.get_nowait()
            if early.get("kind") == "reject":  # welcomed, then turned away (wrong job, rank, world size)
                raise ProtocolError(f"{self.peername} refused this connection: {str(early.get('reason'))[:2000]}")
            raise ProtocolError(f"{self.peername} sent frames before the handshake completed")
        n = self._end - self._start  # bytes already read past the handshake move to the full-size buffer
        staging = bytearray(STAGING_SIZE)
        staging[:n] = self._stage[self._start : self._end]
        self._staging, self._stage = staging, memoryview(staging)
        self._start, self._end = 0, n
        self._schedule_heartbeat()

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

    # ------------------------------------------------------------------- close
    @property
    def lost(self) -> PeerLostError | None:
        return self._lost

    @property
    def is_open(self) -> bool:
        return not self._transport_gone() and self._lost is None

    #: an in-process end (no socket, no shared memory)
    is_local = False

    def abort(self, exc: BaseException) -> None:
        """Drop the connection because of an error (bad frame, silent peer)."""
        logger.debug("%r aborted: %s", self, exc)
        if self._lost is None:
            if isinstance(exc, PeerLostError):
                self._lost = exc
            else:
                self._lost = self._lost_error(f"connection to {self.peer_label} at {self.peername} dropped: {exc}")
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
            raise self._lost or self._lost_error(f"connection to {self.peer_label} at {self.peername} is closed")
        if transport.get_extra_info("ssl_object") is not None:
            raise ProtocolError("a TLS connection cannot be detached from its transport")
        if self._end != self._start or self._header is not None:
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
            if not self.transport.is_closing() and self._handshake_frames is None:
                self.send_frame({**(farewell or {}), "kind": "bye"})
                await asyncio.wait_for(self.flush(), timeout)
        except (Exception, asyncio.CancelledError):
            pass
        finally:
            if self.transport is not None:
                self.transport.close()
            self._teardown()

    def _teardown(self) -> None:
        if self._hb_handle is not None:
            self._hb_handle.cancel()
            self._hb_handle = None
        if self._lent and self.pool is not None:
            if self.farewell is not None and self._lost is None:  # it said goodbye and closed: it reads no more
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
        err = self._lost or self._lost_error(f"connection to {self.peer_label} at {self.peername} closed")
        self._wake_flushers(err)
        if not self._closed.done():
            self._closed.set_result(None)
            router = self.router
            if router is not None:
                router.connection_lost(self, None if self._closing and self._lost is None else self._lost)

    async def wait_closed(self) -> None:
        await asyncio.shield(self._closed)


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


class LocalConnection(Connection):
    """One end of a connection between two parts of one process (a worker and a shard it hosts).

    Frames keep their wire semantics -- the header goes through msgpack and validation, the
    payload is copied once, into the receiver's posted buffer when it has one -- but no socket,
    kernel copy or handshake is involved. Delivery is on the next loop iteration, in order;
    :meth:`flush` returns once the peer has taken every frame, which is when the sender may
    reuse its payload's memory, as with a socket.
    """

    is_local = True

    def __init__(self, name: str, peername: str) -> None:
        super().__init__(secret=None, name=name)
        self._handshake_frames = None
        self._partner: LocalConnection | None = None
        self._in_flight = 0
        self.transport = _LocalTransport()
        self.peername = peername

    def send_frame(
        self, header: dict[str, Any], payload: memoryview | bytes | None = None, *, nbytes: int | None = None
    ) -> None:
        self._queue(header, payload, None)

    def _queue(self, header: dict[str, Any], payload: Any, taken: Callable[[], None] | None) -> None:
        partner = self._partner
        if self._transport_gone() or partner is None:
            raise self._lost or self._lost_error(f"connection to {self.peer_label} ({self.peername}) is closed")
        size = 0 if payload is None else (payload.nbytes if isinstance(payload, memoryview) else len(payload))
        header.pop("pool", None)
        header["nbytes"] = size
        head = wire.encode_header(header)
        self.bytes_sent += len(head) + size
        self.frames_sent += 1
        self._last_sent = time.monotonic()
        self._in_flight += 1
        asyncio.get_running_loop().call_soon(self._hand_over, partner, head, payload, taken)

    def send_slot(self, header: dict[str, Any], pool: ShmPool, k: int, x: np.ndarray) -> None:
        """In process: the slot stays lent until the partner has copied the payload out."""
        pool.lend(k)
        try:
            self._queue({**header, **wire.tensor_fields(x)}, wire.byte_view(x), lambda: pool.give_back(k))
        except BaseException:
            pool.give_back(k)
            raise

    def _hand_over(self, partner: LocalConnection, head: bytes, payload: Any, taken: Callable[[], None] | None) -> None:
        try:
            if not partner._transport_gone():
                try:
                    partner._take(head, payload)  # the payload is copied out here, so flush may return after
                except Exception as exc:  # a bad frame or a router failure ends this connection, as on a socket
                    partner.abort(exc)
        finally:
            if taken is not None:
                taken()
        self._in_flight -= 1
        if self._in_flight == 0:
            self._wake_flushers(None)

    def _take(self, head: bytes, payload: Any) -> None:
        header = wire.decode_header(head, self._limits)
        nbytes = header["nbytes"]
        self.bytes_received += len(head) + nbytes
        self.last_heard = time.monotonic()
        dest: Any = None
        if nbytes and self.router is not None and header["kind"] not in ("ping", "bye"):
            dest = self.router.buffer_for(self, header)
            if dest is not None and len(dest) != nbytes:
                dest = None
        if nbytes:
            src = np.frombuffer(payload, np.uint8, nbytes)
            if dest is None:
                dest = pooled_bytes(nbytes)
                np.copyto(dest, src)
            else:
                np.copyto(np.frombuffer(dest, np.uint8, nbytes), src)
        self._header, self._dest_obj = header, dest
        self._finish_frame()

    async def flush(self) -> None:
        if self._in_flight == 0 or self._transport_gone():
            if self._lost is not None:
                raise self._lost
            return
        fut = asyncio.get_running_loop().create_future()
        self._flush_waiters.append(fut)
        await fut

    def detach(self) -> socket.socket:
        raise ProtocolError("an in-process connection has no socket to detach")

    async def close(self, timeout: float = 2.0, farewell: dict[str, Any] | None = None) -> None:
        if not self._transport_gone():
            self._closing = True
            with contextlib.suppress(Exception):
                self.send_frame({**(farewell or {}), "kind": "bye"})
                await asyncio.wait_for(self.flush(), timeout)
        self._shut(None)

    def abort(self, exc: BaseException) -> None:
        if self._lost is None:
            self._lost = (
                exc
                if isinstance(exc, PeerLostError)
                else self._lost_error(f"in-process connection to {self.peer_label} dropped: {exc}")
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
                partner._lost = partner._lost_error(f"in-process connection to {partner.peer_label} lost: {error}")
            assert partner.transport is not None
            partner.transport.close()
            partner._teardown()


def local_pair(a_name: str, b_name: str) -> tuple[LocalConnection, LocalConnection]:
    """Two connected in-process ends (set each one's ``peer`` and ``router`` before sending)."""
    a = LocalConnection(a_name, peername=f"in-process {b_name}")
    b = LocalConnection(b_name, peername=f"in-process {a_name}")
    a._partner, b._partner = b, a
    return a, b


# ------------------------------------------------------------------ open / listen
def make_ssl_context(server: bool) -> ssl.SSLContext | None:
    """TLS from PSRING_TLS_CERT / PSRING_TLS_KEY / PSRING_TLS_CA, or None when unset."""
    cert = os.environ.get("PSRING_TLS_CERT")
    key = os.environ.get("PSRING_TLS_KEY")
    ca = os.environ.get("PSRING_TLS_CA")
    if not (cert or ca):
        return None
    if server:
        ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH, cafile=ca)
        if not cert:
            raise ValueError("PSRING_TLS_CA is set but PSRING_TLS_CERT is not: a TLS server needs a certificate")
        ctx.load_cert_chain(cert, key)
        if ca:
            ctx.verify_mode = ssl.CERT_REQUIRED
    else:
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=ca)
        ctx.check_hostname = False  # peers are addressed by IP; the CA pins identity
        if cert:
            ctx.load_cert_chain(cert, key)
    return ctx


async def open_connection(
    host: str,
    port: int,
    *,
    secret: bytes | None,
    hello: dict[str, Any],
    router: Router | None = None,
    timeout: float = 30.0,
    name: str = "client",
    retry_refused: bool = True,
) -> Connection:
    """Dial host:port, authenticate, and return the ready Connection.

    Refused connections are retried until ``timeout`` (the peer may still be starting).
    """
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout
    ctx = make_ssl_context(server=False)
    delay = 0.02
    while True:
        conn = Connection(secret=secret, name=name)
        try:
            remaining = deadline - time.monotonic()
            await asyncio.wait_for(
                loop.create_connection(lambda conn=conn: conn, host, port, ssl=ctx),  # type: ignore[misc]
                timeout=max(remaining, 0.001),
            )
            break
        except (TimeoutError, ConnectionRefusedError, ConnectionResetError, OSError) as exc:
            refused = isinstance(exc, (ConnectionRefusedError, ConnectionResetError))
            if not (retry_refused and refused) or time.monotonic() + delay >= deadline:
                raise PeerLostError(f"cannot connect to {host}:{port}: {exc or 'timed out'}") from exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
    conn.router = router
    try:
        await conn.client_handshake(hello, timeout=max(deadline - time.monotonic(), HANDSHAKE_TIMEOUT))
    except (Exception, asyncio.CancelledError):
        conn.abort(AuthError("handshake failed"))
        raise
    return conn


def _is_loopback(host: str) -> bool:
    if host in ("localhost", ""):
        return host == "localhost"
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Listener:
    """One listening socket; every accepted connection is authenticated, then handed over."""

    def __init__(
        self,
        on_connection: Callable[[Connection], Awaitable[None] | None],
        *,
        secret: bytes | None,
        info: dict[str, Any] | None = None,
        router_for: Callable[[Connection], Router | None] | None = None,
        name: str = "server",
        limits: wire.Limits | None = None,
    ) -> None:
        self._limits = limits
        self._on_connection = on_connection
        self._secret = secret
        self._info = info or {}
        self._router_for = router_for
        self.name = name
        self._server: asyncio.base_events.Server | None = None
        self._pending: set[asyncio.Task[None]] = set()
        self.connections: set[Connection] = set()
        self.host = ""
        self.port = 0
        self.auth_failures = 0
        self._warn_window = 0.0
        self._warned = self._quiet = 0

    async def start(self, host: str, port: int) -> Listener:
        checksum_from_env()  # a bad PSRING_CHECKSUM fails here, not in every accepted connection
        loop = asyncio.get_running_loop()
        ctx = make_ssl_context(server=True)
        self._server = await loop.create_server(self._make_protocol, host, port, ssl=ctx, reuse_address=True)
        sock = self._server.sockets[0]
        self.host, self.port = host, sock.getsockname()[1]
        if self._secret is None and not _is_loopback(host) and host not in _warned_open_listen:
            _warned_open_listen.add(host)
            logger.warning(
                "%s listening on %s:%d without a shared secret: anyone who can reach it may join (set PSRING_SECRET)",
                self.name,
                host,
                self.port,
            )
        logger.debug("%s listening on %s:%d", self.name, host, self.port)
        return self

    def _make_protocol(self) -> Connection:
        conn = Connection(secret=self._secret, name=self.name, limits=self._limits)
        if len(self._pending) >= MAX_PENDING_HANDSHAKES:
            asyncio.get_running_loop().call_soon(conn.abort, ProtocolError("too many pending handshakes"))
            return conn
        task = asyncio.get_running_loop().create_task(self._accept(conn))
        self._pending.add(task)
        task.add_done_callback(self._pending.discard)
        return conn

    async def _accept(self, conn: Connection) -> None:
        await asyncio.sleep(0)  # let connection_made run
        try:
            await conn.server_handshake(self._info)
        except asyncio.CancelledError:
            conn.abort(AuthError("listener closed"))
            raise
        except (AuthError, ProtocolError) as exc:
            self.auth_failures += 1
            self._log_rejection(conn, exc)
            await asyncio.sleep(0.05)  # let the reject frame go out
            conn.abort(exc)
            return
        except Exception as exc:  # pragma: no cover - defensive
            logger.error("%s: handshake with %s failed: %s", self.name, conn.peername, exc)
            conn.abort(exc)
            return
        self.connections.add(conn)
        conn._closed.add_done_callback(lambda _f: self.connections.discard(conn))
        try:
            if self._router_for is not None:
                conn.router = self._router_for(conn)
            result = self._on_connection(conn)
            if asyncio.iscoroutine(result):
                await result
        except Exception as exc:
            if isinstance(exc, ProtocolError):  # a hello this listener does not take (job, rank, ...)
                self._log_rejection(conn, exc)
                conn._reject(str(exc)[:2000])  # tell the client why (close() sends it before closing)
            else:
                logger.error("%s: handling %s failed: %s", self.name, conn.peername, exc)
            conn.abort(exc)

    def _log_rejection(self, conn: Connection, exc: Exception) -> None:
        """Warn about refused connections, but at most a few times a second (a flood must not flood the log)."""
        now = time.monotonic()
        if now - self._warn_window >= 1.0:
            if self._quiet:
                logger.warning("%s: %d more connection(s) rejected in the last second", self.name, self._quiet)
            self._warn_window, self._warned, self._quiet = now, 0, 0
        if self._warned < 5:
            self._warned += 1
            logger.warning("%s: rejected %s: %s", self.name, conn.peername, exc)
        else:
            self._quiet += 1
            logger.debug("%s: rejected %s: %s", self.name, conn.peername, exc)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            self._server = None
        for task in list(self._pending):
            task.cancel()
        for conn in list(self.connections):
            conn.abort(PeerLostError(f"{self.name} shut down"))
        await asyncio.sleep(0)


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
        if inspector is not None and not inspector(conn, header):
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

    def drop_where(self, predicate: Callable[[tuple[Any, ...]], bool]) -> None:
        for tag in [t for t in self._unexpected if predicate(t)]:
            self.unexpected_bytes -= sum(i[1]["nbytes"] for i in self._unexpected.pop(tag))
        for tag in [t for t in self._posted if predicate(t)]:
            del self._posted[tag]
