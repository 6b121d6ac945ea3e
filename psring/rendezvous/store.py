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
import collections
import contextlib
import logging
import time
import uuid
from typing import Any

from ..core import wire
from ..errors import PeerLostError, ProtocolError, StoreDiskError, StoreError
from ..transport.connection import Connection
from ..transport.listener import Listener
from .storelog import COMPACT_MIN_BYTES, DiskError, StoreLog, _remember

logger = logging.getLogger(__name__)

STORE_MAX_VALUE = 64 << 20
STORE_MAX_KEYS = 1_000_000
STORE_MAX_BYTES = 1 << 30
STORE_MAX_INFLIGHT = 1024
_OPS = ("set", "get", "add", "cas", "delete", "list", "wait", "ping")
#: the requests that change the store: each appended to its log (with a data dir), and each sent with a
#: token by the client, so that a retry after a lost answer is not made twice
CHANGES = frozenset(("set", "add", "cas", "delete"))


def _key(req: dict[str, Any], field: str = "key") -> str:
    key = req.get(field)
    if not isinstance(key, str) or not key or len(key) > 1024:
        raise StoreError(f"store request field {field!r} must be a non-empty string of at most 1024 characters")
    return key


class StoreServer:
    """The store's state and request handling; one per ``psring store`` or embedded in rank 0.

    With ``data_dir`` every change is on disk before it is acknowledged (see storelog), so a
    restarted store has what it had. ``instance`` (new at every start) and ``epoch`` (starts of
    this data dir) are in the store's handshake: clients tell a restarted store from a brief cut.
    """

    def __init__(
        self, secret: bytes | None = None, data_dir: str | None = None, compact_bytes: int = COMPACT_MIN_BYTES
    ) -> None:
        self._secret = secret
        self._log = StoreLog(data_dir, compact_bytes) if data_dir else None
        self.instance = uuid.uuid4().hex
        self.epoch = self._log.epoch if self._log is not None else 1
        #: answers to recent mutating requests, by the client's token (a retried request gets the first answer)
        self._tokens: collections.OrderedDict[str, Any] = collections.OrderedDict()
        self._data: dict[str, bytes] = {}
        self._written: dict[str, float] = {}  # key -> when it was last set (monotonic)
        self._waiters: dict[str, set[asyncio.Future[None]]] = {}
        self._listener: Listener | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._by_conn: dict[Connection, set[asyncio.Task[None]]] = {}
        self._bytes = 0
        self.requests = 0
        self.bad_requests = 0
        self.disk_errors = 0  #: changes the data dir refused (and so not made)
        #: the data dir's last refusal, while it lasts (every request answers with it)
        self._disk_error: DiskError | None = None

    @property
    def port(self) -> int:
        return self._listener.port if self._listener else 0

    @property
    def host(self) -> str:
        return self._listener.host if self._listener else ""

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> StoreServer:
        if self._log is not None:
            self._data, self._tokens = self._log.load()
            now = time.monotonic()  # ages start again: a record nobody refreshes expires by time
            self._written = dict.fromkeys(self._data, now)
            self._bytes = sum(len(v) for v in self._data.values())
        router = _StoreRouter(self)
        self._listener = Listener(
            lambda conn: None,
            secret=self._secret,
            info={"role": "store", "instance": self.instance, "epoch": self.epoch},
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
        if self._log is not None:
            self._log.close()
            self._log = None

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
        self._written[key] = time.monotonic()
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
                    async with asyncio.timeout(remaining):
                        await fut
                except TimeoutError:
                    return False
                finally:
                    waiters = self._waiters.get(key)
                    if waiters is not None:
                        waiters.discard(fut)
                        if not waiters:
                            del self._waiters[key]
        return True

    async def _durable(self, key: str, token: Any, response: dict[str, Any], sync: bool = True) -> None:
        """Remember a change's answer by its token and, with a data dir, put the change on disk.

        ``sync=False`` (a record its owner rewrites every second: a daemon's heartbeat) appends
        without waiting for the fsync: the write survives the store's process being killed (it is in
        the kernel's page cache) and the next durable change's fsync takes it; only a machine crash
        can lose it, and its owner writes it again within a second. A heartbeat that waited on the
        disk was as slow as the disk: on a busy machine a daemon then looked dead (a CI run failed a
        job for "stopped heartbeating")."""
        if isinstance(token, str) and len(token) <= 128:
            _remember(self._tokens, token, response)
        else:
            token = None
        if self._log is not None:
            try:
                self._log.append(key, self._data.get(key), token, response)
                if sync:
                    await self._log.sync()
            except DiskError:
                if token is not None:
                    self._tokens.pop(token, None)  # not made: a retry must try again, not get this answer
                raise
            if self._log is not None and self._log.wants_compaction():
                await self._log.compact(self._data, self._tokens)

    async def _change(
        self, key: str, token: Any, response: dict[str, Any], value: bytes | None, sync: bool = True
    ) -> None:
        """Make a change (``value`` None: delete the key) and put it on disk; where the disk refuses it,
        the change is undone here too (nothing a client was not told of stands) and DiskError says why."""
        old = self._data.get(key)
        if value is None:
            self._forget(key)
        else:
            self._set(key, value)
        try:
            await self._durable(key, token, response, sync=sync)
        except DiskError as exc:
            self.disk_errors += 1
            self._disk_error = exc
            if self._data.get(key) is (None if value is None else value):  # (unless a later change followed)
                if old is None:
                    self._forget(key)
                else:
                    self._set(key, old)
            logger.error("store: %s", exc)
            raise

    def _disk_back(self) -> bool:
        """Whether the data dir takes writes again: tried at every request while it refused them (a block
        written, synced and removed; on a full disk the write fails at once, a few system calls). Until
        then every request but ping answers with the disk's error, so a client learns at once what is
        wrong instead of reading a state no change can follow; the first request after the operator made
        room is served (a probe only every so often refused a job submitted just after: a CI run failed
        so, the submitter saying the disk was full a second after it had been emptied)."""
        if self._log is None or not self._log.probe():
            return False
        logger.warning("store: %s takes writes again", self._log.directory)
        self._disk_error = None
        return True

    def _forget(self, key: str) -> None:
        old = self._data.pop(key, None)
        self._written.pop(key, None)
        self._bytes -= len(old or b"")

    async def handle(self, req: dict[str, Any], payload: bytes) -> tuple[dict[str, Any], bytes]:
        """Apply one request; return the response fields and payload."""
        op = req.get("op")
        if op not in _OPS:
            raise StoreError(f"unknown store op {op!r} (expected one of {', '.join(_OPS)})")
        if op == "ping":
            return {"instance": self.instance, "epoch": self.epoch}, b""
        if self._disk_error is not None and not self._disk_back():
            raise self._disk_error.since()  # every request says so until the disk takes writes again
        if op in CHANGES and self._log is not None:
            # not while the log is compacted; from here to the change's append nothing awaits, so what a
            # change reads (add's count, cas's value, a retry's token) is what it changes
            await self._log.writable()
        token = req.get("token")
        if token is not None and token in self._tokens:  # a retry of a change already made
            return dict(self._tokens[token]), b""
        if op == "set":
            key = _key(req)
            await self._change(key, token, {}, bytes(payload), sync=not req.get("ttl"))
            return {}, b""
        if op == "get":
            key = _key(req)
            timeout = req.get("timeout")
            if key not in self._data and isinstance(timeout, (int, float)) and timeout > 0:
                await self._wait_keys([key], min(float(timeout), 86400.0))
            value = self._data.get(key)
            if value is None:
                return {"found": False}, b""
            # how long ago it was written, by the store's clock (liveness without trusting clients' clocks)
            return {"found": True, "age": time.monotonic() - self._written.get(key, 0.0)}, value
        if op == "add":
            key = _key(req)
            amount = req.get("amount", 1)
            if type(amount) is not int:
                raise StoreError(f"store add: amount must be an integer, got {amount!r}")
            held = self._data.get(key, b"0")
            try:
                total = int(held.decode()) + amount
            except ValueError:
                raise StoreError(f"store add: key {key!r} does not hold an integer") from None
            await self._change(key, token, {"value": total}, str(total).encode())
            return {"value": total}, b""
        if op == "cas":
            key = _key(req)
            expected = req.get("expected")
            current = self._data.get(key)
            if (expected is None and current is None) or (expected is not None and current == expected):
                await self._change(key, token, {"ok": True}, bytes(payload))
                return {"ok": True}, b""
            return {"ok": False, "found": current is not None}, current or b""
        if op == "delete":
            key = _key(req)
            existed = key in self._data
            if existed:
                await self._change(key, token, {"deleted": True}, None)
            return {"deleted": existed}, b""
        if op == "list":
            prefix = req.get("prefix", "")
            if not isinstance(prefix, str):
                raise StoreError("store list: prefix must be a string")
            keys = sorted(k for k in self._data if k.startswith(prefix))
            import msgpack

            return {}, msgpack.packb(keys)
        # wait
        wanted = req.get("keys")
        timeout = req.get("timeout", 0)
        if not (isinstance(wanted, (list, tuple)) and len(wanted) <= 100_000 and all(type(k) is str for k in wanted)):
            raise StoreError("store wait: keys must be a list of strings")
        if not isinstance(timeout, (int, float)) or timeout < 0:
            raise StoreError("store wait: timeout must be a non-negative number")
        ok = await self._wait_keys(list(wanted), min(float(timeout), 86400.0))
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
            if isinstance(exc, StoreDiskError):
                resp["disk"] = True  # (a client may retry it: StoreDiskError)
            value = b""
        except ProtocolError as exc:
            self.bad_requests += 1
            logger.warning("store: dropping %s: %s", conn.peername, exc)
            conn.abort(exc)
            return
        except Exception as exc:  # broad on purpose: whatever went wrong, the request gets an answer
            logger.exception("store: %s failed", header.get("op"))
            self.bad_requests += 1
            error = f"store failed on {header.get('op')!r}: {type(exc).__name__}: {exc}"
            resp = {"kind": "store_resp", "tag": ("store", rid if type(rid) is int else -1), "error": error}
            value = b""
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


async def start_store(
    host: str = "127.0.0.1",
    port: int = 0,
    *,
    secret: bytes | None = None,
    data_dir: str | None = None,
    compact_bytes: int = COMPACT_MIN_BYTES,
) -> StoreServer:
    """Start a store server; returns once listening, with ``.port`` set. ``data_dir``: keep the keys
    there (fsync'd), and start from what it holds; its log is compacted into a snapshot once it
    outgrows ``compact_bytes``."""
    return await StoreServer(secret, data_dir, compact_bytes).start(host, port)
