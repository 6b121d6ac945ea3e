"""The handshake every connection starts with: versions, roles and mutual proof of the shared secret.

The client sends ``hello`` (wire version, a nonce, its role and fields); the server
answers ``challenge`` with its own nonce and, when a secret is configured, an HMAC
proving it knows the secret; the client proves it back (``auth``), and the server says
``welcome``. Either side ``reject``s with a reason. No payload byte is accepted before
the handshake completes.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import secrets
import time
from collections.abc import Callable
from typing import Any, Protocol

from ..core import wire
from ..errors import AuthError, PeerLostError, ProtocolError

HANDSHAKE_TIMEOUT = 10.0


def _mac(secret: bytes, label: bytes, a: bytes, b: bytes) -> bytes:
    return hmac.new(secret, label + a + b, hashlib.sha256).digest()


class Shaking(Protocol):
    """What the handshake needs of its connection."""

    peername: str
    peer: dict[str, Any]

    def send_frame(self, header: dict[str, Any]) -> None: ...

    def handshake_done(self) -> None: ...


class Handshake:
    """A connection's handshake (``conn.handshake``), client and server side: the frames that arrive
    before it completes come to :attr:`frames`; ``conn.handshake_done()`` when it did."""

    def __init__(self, conn: Shaking, secret: bytes | None, closed: asyncio.Future[Any]) -> None:
        self.conn = conn
        self._secret = secret
        self._closed = closed
        #: frames received while the handshake runs (None once it is done)
        self.frames: asyncio.Queue[dict[str, Any]] | None = asyncio.Queue()

    @property
    def peername(self) -> str:
        return self.conn.peername

    def send_frame(self, header: dict[str, Any]) -> None:
        self.conn.send_frame(header)

    async def _handshake_frame(self, deadline: float, expect: str) -> dict[str, Any]:
        assert self.frames is not None
        remaining = deadline - time.monotonic()
        get: asyncio.Future[Any] = asyncio.ensure_future(self.frames.get())
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

    async def client(self, hello: dict[str, Any], timeout: float = HANDSHAKE_TIMEOUT) -> None:
        deadline = time.monotonic() + timeout
        nonce = secrets.token_bytes(32)
        self.send_frame(
            {"kind": "hello", "version": wire.WIRE_VERSION, "nonce": nonce, "auth": self._secret is not None, **hello}
        )
        challenge = await self._handshake_frame(deadline, "challenge")
        self.conn.peer = {k: v for k, v in challenge.items() if k not in ("kind", "nonce", "mac", "nbytes")}
        if self._secret is None:
            if challenge.get("auth"):
                raise AuthError(f"{self.peername} requires a shared secret; set PSRING_SECRET (or secret=)")
        else:
            if not challenge.get("auth"):
                self.reject("this process has a shared secret but the server has none")
                raise AuthError(
                    f"{self.peername} has no shared secret configured but this process has one; "
                    "set the same PSRING_SECRET on both"
                )
            server_nonce = challenge.get("nonce")
            mac = challenge.get("mac")
            if not isinstance(server_nonce, bytes) or not isinstance(mac, bytes):
                raise ProtocolError(f"handshake with {self.peername}: challenge lacks nonce or mac")
            if not hmac.compare_digest(mac, _mac(self._secret, b"psring-server", nonce, server_nonce)):
                self.reject("wrong secret: the server's proof did not verify")
                raise AuthError(f"{self.peername} failed to prove the shared secret (wrong PSRING_SECRET?)")
            self.send_frame({"kind": "auth", "mac": _mac(self._secret, b"psring-client", server_nonce, nonce)})
        await self._handshake_frame(deadline, "welcome")
        self.conn.handshake_done()

    async def server(
        self,
        info: dict[str, Any] | Callable[[dict[str, Any]], dict[str, Any]],
        timeout: float = HANDSHAKE_TIMEOUT,
    ) -> None:
        """``info``: the fields this side tells the client, or a function of the client's hello
        that returns them (one port serving several jobs answers each as its own)."""
        deadline = time.monotonic() + timeout
        hello = await self._handshake_frame(deadline, "hello")
        self.conn.peer = {k: v for k, v in hello.items() if k not in ("kind", "nonce", "auth", "nbytes", "version")}
        if hello.get("version") != wire.WIRE_VERSION:
            reason = f"wire version {hello.get('version')!r} is not this server's {wire.WIRE_VERSION}"
            self.reject(reason)
            raise ProtocolError(f"{self.peername}: {reason}")
        if callable(info):
            info = info(self.conn.peer)
        nonce = secrets.token_bytes(32)
        client_nonce = hello.get("nonce")
        if not isinstance(client_nonce, bytes) or len(client_nonce) < 16:
            self.reject("hello lacks a nonce")
            raise ProtocolError(f"{self.peername}: hello lacks a nonce")
        if self._secret is None:
            self.send_frame({"kind": "challenge", "auth": False, **info})
            if hello.get("auth"):
                # the client will refuse us; wait for its reject or close
                await self._expect_close(deadline)
                raise AuthError(f"{self.peername} has a shared secret but this server has none")
        else:
            if not hello.get("auth"):
                self.reject("a shared secret is required; set PSRING_SECRET")
                raise AuthError(f"{self.peername} has no shared secret; this server requires one")
            mac = _mac(self._secret, b"psring-server", client_nonce, nonce)
            self.send_frame({"kind": "challenge", "auth": True, "nonce": nonce, "mac": mac, **info})
            proof = await self._handshake_frame(deadline, "auth")
            given = proof.get("mac")
            if not isinstance(given, bytes) or not hmac.compare_digest(
                given, _mac(self._secret, b"psring-client", nonce, client_nonce)
            ):
                self.reject("wrong secret: the client's proof did not verify")
                raise AuthError(f"{self.peername} failed to prove the shared secret (wrong PSRING_SECRET?)")
        self.send_frame({"kind": "welcome"})
        self.conn.handshake_done()

    async def _expect_close(self, deadline: float) -> None:
        try:
            await self._handshake_frame(deadline, "auth")
        except (AuthError, ProtocolError):
            pass

    def reject(self, reason: str) -> None:
        try:
            self.send_frame({"kind": "reject", "reason": reason})
        except PeerLostError:
            pass
