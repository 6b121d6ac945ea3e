"""Listening and dialing: one listening port per process, authenticated connections in, dials out (TLS optional)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import ssl
import time
from collections.abc import Awaitable, Callable
from typing import Any

from .. import settings as settings_mod
from ..core import wire
from ..errors import AuthError, PeerLostError, ProtocolError
from ..settings import Settings
from .connection import Connection, Router
from .handshake import HANDSHAKE_TIMEOUT
from .tcpsocket import dialed_itself, reset

logger = logging.getLogger(__name__)

#: handshakes a listener runs at once; connections beyond are dropped at once
MAX_PENDING_HANDSHAKES = 256

_warned_open_listen: set[str] = set()


def make_ssl_context(server: bool, settings: Settings) -> ssl.SSLContext | None:
    """TLS from PSRING_TLS_CERT / PSRING_TLS_KEY / PSRING_TLS_CA, or None when unset."""
    cert, key, ca = settings.tls_cert, settings.tls_key, settings.tls_ca
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
    settings: Settings | None = None,
    handshake_timeout: float | None = None,
) -> Connection:
    """Dial host:port, authenticate, and return the ready Connection.

    Refused connections are retried until ``timeout`` (the peer may still be starting). The
    handshake gets what is left of ``timeout`` (or ``handshake_timeout``, when given).
    """
    loop = asyncio.get_running_loop()
    deadline = time.monotonic() + timeout
    settings = settings or settings_mod.current()
    ctx = make_ssl_context(False, settings)
    delay = 0.02
    while True:
        conn = Connection(secret=secret, name=name, settings=settings)
        try:
            remaining = deadline - time.monotonic()
            # (asyncio.timeout, not wait_for: Python 3.11's wait_for returns a result that came as the
            # caller was cancelled and drops the cancellation -- a worker daemon's rank told to stop as
            # it dialled its peer set up its group and trained on; fixed in 3.12)
            async with asyncio.timeout(max(remaining, 0.001)):
                transport, _ = await loop.create_connection(lambda conn=conn: conn, host, port, ssl=ctx)
            if dialed_itself(transport):
                # nothing listens there and the kernel gave this socket that very port (a port in the
                # ephemeral range, dialed while its server is down). Reset, not closed: a close would hold
                # the port in TIME_WAIT, where a server restarted at it could not bind it
                reset(transport)
                raise ConnectionRefusedError(f"nothing listens on {host}:{port} (the dial reached itself)")
            break
        except (TimeoutError, ConnectionRefusedError, ConnectionResetError, OSError) as exc:
            refused = isinstance(exc, (ConnectionRefusedError, ConnectionResetError))
            if not (retry_refused and refused) or time.monotonic() + delay >= deadline:
                raise PeerLostError(f"cannot connect to {host}:{port}: {exc or 'timed out'}") from exc
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.5)
    conn.router = router
    try:
        await conn.client_handshake(
            hello, timeout=handshake_timeout or max(deadline - time.monotonic(), HANDSHAKE_TIMEOUT)
        )
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
        info: dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]] | None = None,
        router_for: Callable[[Connection], Router | None] | None = None,
        name: str = "server",
        limits: wire.Limits | None = None,
        settings: Settings | None = None,
    ) -> None:
        self.settings = settings or settings_mod.current()
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

    async def start(self, host: str, port: int, *, serving: bool = True) -> Listener:
        """Bind host:port and accept connections; with ``serving=False`` only bind (the port is
        taken and known, connections wait in the kernel's backlog) until :meth:`start_serving`."""
        loop = asyncio.get_running_loop()
        ctx = make_ssl_context(True, self.settings)
        self._server = await loop.create_server(
            self._make_protocol, host, port, ssl=ctx, reuse_address=True, start_serving=serving
        )
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

    async def start_serving(self) -> None:
        """Begin accepting on a port bound with ``start(..., serving=False)``."""
        if self._server is not None:
            await self._server.start_serving()

    def _make_protocol(self) -> Connection:
        conn = Connection(secret=self._secret, name=self.name, limits=self._limits, settings=self.settings)
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
        conn.on_closed(lambda: self.connections.discard(conn))
        try:
            if self._router_for is not None:
                conn.router = self._router_for(conn)
            result = self._on_connection(conn)
            if asyncio.iscoroutine(result):
                await result
        except Exception as exc:
            if isinstance(exc, ProtocolError):  # a hello this listener does not take (job, rank, ...)
                self._log_rejection(conn, exc)
                conn.handshake.reject(str(exc)[:2000])  # tell the client why (close() sends it before closing)
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
