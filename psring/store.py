"""Rendezvous store: a small key-value server, its async client and a file-system variant.

Operations: set, get (optionally waiting for the key), add (atomic counter),
compare-and-set, delete, list by prefix, wait for keys, and a counting barrier.
Values are bytes and travel as frame payloads, never inside the msgpack header.

The server never trusts a client: frames are bounded (``STORE_MAX_VALUE``), so is
what it holds (``STORE_MAX_KEYS`` keys, ``STORE_MAX_BYTES`` of values) and what one
client may have in flight (``STORE_MAX_INFLIGHT`` requests); a bad request gets an
error response, a bad frame drops that client only, and a client that disconnects
mid-wait is forgotten (its waiting requests are cancelled).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
import urllib.parse
import uuid
from dataclasses import dataclass
from typing import Any

from . import wire
from .connection import Connection, Listener, Mailbox, open_connection
from .errors import PeerLostError, ProtocolError, StoreError

logger = logging.getLogger(__name__)

STORE_MAX_VALUE = 64 << 20
STORE_MAX_KEYS = 1_000_000
STORE_MAX_BYTES = 1 << 30
STORE_MAX_INFLIGHT = 1024
_OPS = ("set", "get", "add", "cas", "delete", "list", "wait", "ping")


def _key(req: dict[str, Any], field: str = "key") -> str:
    key = req.get(field)
    if not isinstance(key, str) or not key or len(key) > 1024:
        raise StoreError(f"store request field {field!r} must be a non-empty string of at most 1024 characters")
    return key


class StoreServer:
    """The store's state and request handling; one per ``psring store`` or embedded in rank 0."""

    def __init__(self, secret: bytes | None = None) -> None:
        self._secret = secret
        self._data: dict[str, bytes] = {}
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}
        self._listener: Listener | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._by_conn: dict[Connection, set[asyncio.Task[None]]] = {}
        self._bytes = 0
        self.requests = 0
        self.bad_requests = 0

    @property
    def port(self) -> int:
        return self._listener.port if self._listener else 0

    @property
    def host(self) -> str:
        return self._listener.host if self._listener else ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> StoreServer:
        router = _StoreRouter(self)
        self._listener = Listener(
            lambda conn: None,
            secret=self._secret,
            info={"role": "store"},
            router_for=lambda conn: router,
            name="store",
            limits=wire.Limits(max_frame=STORE_MAX_VALUE),
        )
        await self._listener.start(host, port)
        logger.info("store listening on %s:%d", host, self.port)
        return self

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self._listener is not None:
            await self._listener.close()
            self._listener = None
        for waiters in self._waiters.values():
            for fut in waiters:
                if not fut.done():
                    fut.cancel()
        self._waiters.clear()

    async def __aenter__(self) -> StoreServer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ state
    def _set(self, key: str, value: bytes) -> None:
        if key not in self._data and len(self._data) >= STORE_MAX_KEYS:
            raise StoreError(f"store is full ({STORE_MAX_KEYS} keys)")
        grown = self._bytes + len(value) - len(self._data.get(key, b""))
        if grown > STORE_MAX_BYTES:
            raise StoreError(f"store is full ({STORE_MAX_BYTES} bytes of values); {key!r} not set")
        self._bytes = grown
        self._data[key] = value
        for fut in self._waiters.pop(key, ()):
            if not fut.done():
                fut.set_result(None)

    async def _wait_keys(self, keys: list[str], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        loop = asyncio.get_running_loop()
        for key in keys:
            while key not in self._data:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                fut = loop.create_future()
                self._waiters.setdefault(key, set()).add(fut)
                try:
                    await asyncio.wait_for(fut, remaining)
                except TimeoutError:
                    return False
                finally:
                    waiters = self._waiters.get(key)
                    if waiters is not None:
                        waiters.discard(fut)
                        if not waiters:
                            del self._waiters[key]
        return True

    async def handle(self, req: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        """Apply one request; return the response fields and payload."""
        op = req.get("op")
        if op not in _OPS:
            raise StoreError(f"unknown store op {op!r} (expected one of {', '.join(_OPS)})")
        if op == "ping":
            return {}, b""
        if op == "set":
            self._set(_key(req), bytes(payload))
            return {}, b""
        if op == "get":
            key = _key(req)
            timeout = req.get("timeout")
            if key not in self._data and isinstance(timeout, (int, float)) and timeout > 0:
                await self._wait_keys([key], min(float(timeout), 86400.0))
            value = self._data.get(key)
            if value is None:
                return {"found": False}, b""
            return {"found": True}, value
        if op == "add":
            key = _key(req)
            amount = req.get("amount", 1)
            if type(amount) is not int:
                raise StoreError(f"store add: amount must be an integer, got {amount!r}")
            current = self._data.get(key, b"0")
            try:
                value = int(current.decode()) + amount
            except ValueError:
                raise StoreError(f"store add: key {key!r} does not hold an integer") from None
            self._set(key, str(value).encode())
            return {"value": value}, b""
        if op == "cas":
            key = _key(req)
            expected = req.get("expected")
            current = self._data.get(key)
            if (expected is None and current is None) or (expected is not None and current == expected):
                self._set(key, bytes(payload))
                return {"ok": True}, b""
            return {"ok": False, "found": current is not None}, current or b""
        if op == "delete":
            key = _key(req)
            old = self._data.pop(key, None)
            self._bytes -= len(old or b"")
            existed = old is not None
            return {"deleted": existed}, b""
        if op == "list":
            prefix = req.get("prefix", "")
            if not isinstance(prefix, str):
                raise StoreError("store list: prefix must be a string")
            keys = sorted(k for k in self._data if k.startswith(prefix))
            import msgpack

            return {}, msgpack.packb(keys)
        # wait
        keys = req.get("keys")
        timeout = req.get("timeout", 0)
        if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys) or len(keys) > 100_000:
            raise StoreError("store wait: keys must be a list of strings")
        if not isinstance(timeout, (int, float)) or timeout < 0:
            raise StoreError("store wait: timeout must be a non-negative number")
        ok = await self._wait_keys(list(keys), min(float(timeout), 86400.0))
        return {"ok": ok}, b""

    def serve(self, conn: Connection, header: dict[str, Any], payload: Any) -> None:
        self.requests += 1
        mine = self._by_conn.setdefault(conn, set())
        if len(mine) >= STORE_MAX_INFLIGHT:
            self.bad_requests += 1
            rid = header.get("id")
            error = f"too many requests in flight from this client ({STORE_MAX_INFLIGHT})"
            with contextlib.suppress(PeerLostError):
                tag = ("store", rid if type(rid) is int else -1)
                conn.send_frame({"kind": "store_resp", "tag": tag, "error": error})
            return
        task = asyncio.get_running_loop().create_task(self._serve(conn, header, payload))
        self._tasks.add(task)
        mine.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(mine.discard)

    def forget(self, conn: Connection) -> None:
        """A client went away: cancel whatever it is still waiting for."""
        for task in self._by_conn.pop(conn, ()):
            task.cancel()

    async def _serve(self, conn: Connection, header: dict[str, Any], payload: Any) -> None:
        rid = header.get("id")
        try:
            if header["kind"] != "store_req" or type(rid) is not int:
                raise ProtocolError(f"store expects 'store_req' frames with an integer id, got {header['kind']!r}")
            fields, value = await self.handle(header, payload)
            resp = {"kind": "store_resp", "tag": ("store", rid), **fields}
        except StoreError as exc:
            self.bad_requests += 1
            resp = {"kind": "store_resp", "tag": ("store", rid if type(rid) is int else -1), "error": str(exc)}
            value = b""
        except ProtocolError as exc:
            self.bad_requests += 1
            logger.warning("store: dropping %s: %s", conn.peername, exc)
            conn.abort(exc)
            return
        if conn.is_open:
            try:
                conn.send_frame(resp, value)
            except PeerLostError:
                pass


class _StoreRouter:
    def __init__(self, server: StoreServer) -> None:
        self._server = server

    def buffer_for(self, conn: Connection, header: dict[str, Any]) -> memoryview | None:
        return None

    def deliver(self, conn: Connection, header: dict[str, Any], payload: Any) -> None:
        self._server.serve(conn, header, payload)

    def connection_lost(self, conn: Connection, error: PeerLostError | None) -> None:
        self._server.forget(conn)


async def start_store(host: str = "127.0.0.1", port: int = 0, *, secret: bytes | None = None) -> StoreServer:
    """Start a store server; returns once listening, with ``.port`` set."""
    return await StoreServer(secret).start(host, port)


# --------------------------------------------------------------------- clients
class StoreClient:
    """Async client of a :class:`StoreServer`."""

    def __init__(self, conn: Connection, mailbox: Mailbox, address: str) -> None:
        self._conn = conn
        self._mailbox = mailbox
        self._ids = itertools.count()
        self.address = address

    @classmethod
    async def connect(
        cls, host: str, port: int, *, secret: bytes | None = None, timeout: float = 30.0, role: str = "client"
    ) -> StoreClient:
        mailbox = Mailbox()
        try:
            conn = await open_connection(
                host, port, secret=secret, hello={"role": role}, router=mailbox, timeout=timeout, name="store-client"
            )
        except PeerLostError as exc:
            raise PeerLostError(
                f"cannot reach the rendezvous store at {host}:{port} within {timeout:g}s ({exc}); "
                "start one with 'psring store --port PORT' or check MASTER_ADDR/MASTER_PORT"
            ) from exc
        return cls(conn, mailbox, f"{host}:{port}")

    async def _call(self, op: str, value: bytes = b"", **fields: Any) -> tuple[dict[str, Any], Any]:
        rid = next(self._ids)
        fut = self._mailbox.expect(("store", rid))
        lost = asyncio.ensure_future(self._conn.wait_closed())
        try:
            self._conn.send_frame({"kind": "store_req", "id": rid, "op": op, **fields}, value)
            done, _ = await asyncio.wait({fut, lost}, return_when=asyncio.FIRST_COMPLETED)
        except (Exception, asyncio.CancelledError):
            self._mailbox.unpost(("store", rid))
            raise
        finally:
            lost.cancel()
        if fut not in done:
            self._mailbox.unpost(("store", rid))
            raise self._conn.lost or PeerLostError(f"rendezvous store at {self.address} closed the connection")
        _conn, header, payload = fut.result()
        if "error" in header:
            raise StoreError(f"store at {self.address} refused {op}: {header['error']}")
        return header, payload

    async def set(self, key: str, value: bytes | str) -> None:
        if isinstance(value, str):
            value = value.encode()
        await self._call("set", value, key=key)

    async def get(self, key: str, timeout: float | None = None) -> bytes | None:
        """The value, waiting up to ``timeout`` seconds for the key to appear (None: don't wait)."""
        wait = timeout or 0
        header, payload = await self._call("get", key=key, timeout=wait)
        return bytes(payload) if header.get("found") else None

    async def add(self, key: str, amount: int = 1) -> int:
        header, _ = await self._call("add", key=key, amount=amount)
        return int(header["value"])

    async def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        header, payload = await self._call("cas", desired, key=key, expected=expected)
        if header.get("ok"):
            return True, desired
        return False, bytes(payload) if header.get("found") else None

    async def delete(self, key: str) -> bool:
        header, _ = await self._call("delete", key=key)
        return bool(header.get("deleted"))

    async def list(self, prefix: str = "") -> list[str]:
        import msgpack

        _header, payload = await self._call("list", prefix=prefix)
        return list(msgpack.unpackb(bytes(payload), raw=False))

    async def wait(self, keys: list[str], timeout: float) -> None:
        header, _ = await self._call("wait", keys=list(keys), timeout=timeout)
        if not header.get("ok"):
            missing = [k for k in keys if await self.get(k) is None]
            raise StoreError(f"timed out after {timeout:g}s waiting for store keys {missing}")

    async def barrier(self, name: str, world_size: int, timeout: float) -> None:
        """Block until ``world_size`` callers reached the barrier ``name``."""
        arrived = await self.add(f"{name}/arrived", 1)
        if arrived == world_size:
            await self.set(f"{name}/done", b"1")
        if arrived > world_size:
            raise StoreError(f"barrier {name!r}: {arrived} arrivals for a world of {world_size}")
        try:
            await self.wait([f"{name}/done"], timeout)
        except StoreError:
            raise StoreError(
                f"barrier {name!r}: only {arrived if arrived < world_size else '?'} of {world_size} "
                f"arrived within {timeout:g}s"
            ) from None

    async def close(self) -> None:
        await self._conn.close()


class FileStoreClient:
    """The store API over a shared directory (``file:///dir``): atomic create and rename only.

    Every key is one file; writes go to a unique temporary name then ``os.replace``,
    counters use compare-and-set through exclusive creation of a lock file per key.
    """

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.address = f"file://{directory}"
        os.makedirs(directory, exist_ok=True)

    def _path(self, key: str) -> str:
        return os.path.join(self.directory, urllib.parse.quote(key, safe=""))

    async def set(self, key: str, value: bytes | str) -> None:
        if isinstance(value, str):
            value = value.encode()
        path = self._path(key)
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as fh:
            fh.write(value)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    def _read(self, key: str) -> bytes | None:
        try:
            with open(self._path(key), "rb") as fh:
                return fh.read()
        except FileNotFoundError:
            return None

    async def get(self, key: str, timeout: float | None = None) -> bytes | None:
        deadline = time.monotonic() + (timeout or 0)
        delay = 0.005
        while True:
            value = self._read(key)
            if value is not None or time.monotonic() >= deadline:
                return value
            await asyncio.sleep(delay)
            delay = min(delay * 2, 0.1)

    @contextlib.asynccontextmanager
    async def _locked(self, key: str, timeout: float = 30.0) -> Any:
        lock = self._path(key) + ".lock"
        deadline = time.monotonic() + timeout
        while True:
            try:
                fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                os.close(fd)
                break
            except FileExistsError:
                if time.monotonic() > deadline:
                    raise StoreError(f"file store: lock {lock} held for over {timeout:g}s (stale? remove it)") from None
                await asyncio.sleep(0.002)
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(lock)

    async def add(self, key: str, amount: int = 1) -> int:
        async with self._locked(key):
            current = self._read(key) or b"0"
            value = int(current.decode()) + amount
            await self.set(key, str(value).encode())
            return value

    async def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        async with self._locked(key):
            current = self._read(key)
            if current == expected:
                await self.set(key, desired)
                return True, desired
            return False, current

    async def delete(self, key: str) -> bool:
        try:
            os.unlink(self._path(key))
            return True
        except FileNotFoundError:
            return False

    async def list(self, prefix: str = "") -> list[str]:
        keys = []
        for name in os.listdir(self.directory):
            if name.endswith((".tmp", ".lock")):
                continue
            key = urllib.parse.unquote(name)
            if key.startswith(prefix):
                keys.append(key)
        return sorted(keys)

    async def wait(self, keys: list[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for key in keys:
            if await self.get(key, max(deadline - time.monotonic(), 0)) is None:
                raise StoreError(f"timed out after {timeout:g}s waiting for store keys {[key]} in {self.directory}")

    barrier = StoreClient.barrier

    async def close(self) -> None:
        pass


# --------------------------------------------------------------- addressing
@dataclass(frozen=True)
class StoreAddress:
    """Where the store is: ``scheme`` is 'tcp' (host, port) or 'file' (path)."""

    scheme: str
    host: str = ""
    port: int = 0
    path: str = ""

    def __str__(self) -> str:
        return f"file://{self.path}" if self.scheme == "file" else f"{self.host}:{self.port}"


def parse_store_address(spec: str | None, env: Any = None) -> StoreAddress:
    """Parse 'host:port', 'tcp://host:port', 'env://' or 'file:///dir' (None means env://)."""
    env = os.environ if env is None else env
    if spec is None or spec == "" or spec == "env://":
        addr = env.get("MASTER_ADDR")
        port = env.get("MASTER_PORT")
        missing = [name for name, v in (("MASTER_ADDR", addr), ("MASTER_PORT", port)) if not v]
        if missing:
            raise ValueError(
                f"store='env://' needs the environment variable(s) {', '.join(missing)}; "
                "set them, or pass store='host:port' (or use 'psring launch', which sets them)"
            )
        return parse_store_address(f"{addr}:{port}", env)
    if spec.startswith("file://"):
        path = urllib.parse.urlparse(spec).path
        if not path:
            raise ValueError(f"store={spec!r}: a file store needs a directory, as in file:///shared/dir")
        return StoreAddress("file", path=path)
    if spec.startswith("tcp://"):
        spec = spec[len("tcp://") :]
    if "://" in spec:
        raise ValueError(f"store={spec!r}: unknown scheme (use host:port, tcp://, env:// or file://)")
    host, sep, port_s = spec.rpartition(":")
    if not sep or not host:
        raise ValueError(f"store={spec!r} is not host:port")
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"store={spec!r}: port {port_s!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"store={spec!r}: port {port} is out of range")
    return StoreAddress("tcp", host=host.strip("[]"), port=port)


async def connect_store(
    address: StoreAddress, *, secret: bytes | None, timeout: float, role: str = "client"
) -> StoreClient | FileStoreClient:
    if address.scheme == "file":
        return FileStoreClient(address.path)
    return await StoreClient.connect(address.host, address.port, secret=secret, timeout=timeout, role=role)
