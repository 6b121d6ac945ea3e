"""Store clients: the TCP client of a ``psring store``, a file-system store, and store addresses."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import os
import time
import urllib.parse
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .. import settings as settings_mod
from ..errors import AuthError, PeerLostError, PsringError, StoreDiskError, StoreError
from ..transport.connection import Connection
from ..transport.handshake import HANDSHAKE_TIMEOUT
from ..transport.listener import open_connection
from ..transport.mailbox import Mailbox
from .barrier import store_barrier
from .store import CHANGES

logger = logging.getLogger(__name__)


# --------------------------------------------------------------------- clients
class StoreClient:
    """Async client of a :class:`StoreServer` that rides out a store restart.

    When the connection to the store is lost, a call reconnects with backoff for up to
    ``reconnect_s`` seconds (PSRING_STORE_RECONNECT_S, default 60) and is sent again; past that
    it raises PeerLostError naming the store and how long it was tried. Every mutating call
    carries a token the store remembers (in its log, with ``--data-dir``), so one that the store
    applied before the connection broke is not applied twice. ``on_reconnect`` callbacks run
    after each reconnection (with ``restarted=True`` when the store is a new instance: a store
    without a data dir then lost what it held, and owners re-register it).
    """

    def __init__(
        self,
        conn: Connection,
        mailbox: Mailbox,
        address: str,
        *,
        store_host: str = "",
        store_port: int = 0,
        secret: bytes | None = None,
        role: str = "client",
        reconnect_s: float | None = None,
    ) -> None:
        self._conn = conn
        self._mailbox = mailbox
        self._ids = itertools.count()
        self.address = address
        #: where to dial again when the connection is lost ("": never)
        self._host, self._port, self._secret, self._role = store_host, store_port, secret, role
        self.reconnect_s = settings_mod.current().store_reconnect if reconnect_s is None else reconnect_s
        self._client_id = uuid.uuid4().hex[:12]
        self._reconnecting: asyncio.Future[None] | None = None
        self._closed = False
        self._unreachable: PeerLostError | None = None  # set once the store stayed away past the bound
        self.instance = conn.peer.get("instance")
        #: async callables ``cb(restarted: bool)`` run after every reconnection
        self.on_reconnect: list[Any] = []
        #: seconds a change the store could not put on its disk is tried again (StoreDiskError): 0 for a
        #: caller that should say so at once (a submitter); daemons wait as for a lost store
        self.disk_retry_s = 0.0
        #: calls waiting to try again a change the store's disk refused (a daemon told to stop then does
        #: not wait for the store's goodbyes: its disk would refuse them too)
        self.waiting_for_disk = 0
        self.reconnects = 0

    @classmethod
    async def connect(
        cls,
        host: str,
        port: int,
        *,
        secret: bytes | None = None,
        timeout: float = 30.0,
        role: str = "client",
        reconnect_s: float | None = None,
    ) -> StoreClient:
        mailbox = Mailbox()
        conn = await cls._dial(host, port, secret, timeout, role, mailbox)
        return cls(
            conn,
            mailbox,
            f"{host}:{port}",
            store_host=host,
            store_port=port,
            secret=secret,
            role=role,
            reconnect_s=reconnect_s,
        )

    @staticmethod
    async def _dial(
        host: str, port: int, secret: bytes | None, timeout: float, role: str, mailbox: Mailbox
    ) -> Connection:
        try:
            return await open_connection(
                host,
                port,
                secret=secret,
                hello={"role": role},
                router=mailbox,
                timeout=timeout,
                name="store-client",
                handshake_timeout=HANDSHAKE_TIMEOUT,
            )
        except PeerLostError as exc:
            raise PeerLostError(
                f"cannot reach the rendezvous store at {host}:{port} within {timeout:g}s ({exc}); "
                "start one with 'psring store --port PORT' or check MASTER_ADDR/MASTER_PORT"
            ) from exc
        except AuthError as exc:
            if "did not complete the handshake" not in str(exc):
                raise
            raise StoreError(
                f"{host}:{port} accepted a connection but did not answer as a psring store within "
                f"{HANDSHAKE_TIMEOUT:g}s: another service listens there (torch's TCPStore? under torchrun psring "
                "uses torch's own store; elsewhere give psring a port of its own with PSRING_STORE)"
            ) from exc

    async def _call(self, op: str, value: bytes = b"", **fields: Any) -> tuple[dict[str, Any], Any]:
        if op in CHANGES:
            fields["token"] = f"{self._client_id}:{next(self._ids)}"  # the same on every retry of this call
        timeout = fields.get("timeout")
        deadline = time.monotonic() + timeout if isinstance(timeout, (int, float)) and timeout > 0 else None
        refused_since: float | None = None
        pause = 0.1
        while True:
            if self._unreachable is not None:  # past the bound once: every later call says so at once
                raise PeerLostError(str(self._unreachable)) from self._unreachable
            conn = self._conn
            try:
                return await self._call_once(conn, op, value, fields)
            except PeerLostError:
                if self._closed or not self.reconnect_s or not self._host:
                    raise
            except StoreDiskError as exc:  # the store is up, its disk is not: wait for it where asked to
                now = time.monotonic()
                refused_since = now if refused_since is None else refused_since
                if now - refused_since + pause > self.disk_retry_s or self._closed:
                    raise
                if refused_since == now:
                    logger.warning("%s; retrying for up to %gs", exc, self.disk_retry_s)
                self.waiting_for_disk += 1
                try:
                    await asyncio.sleep(pause)
                finally:
                    self.waiting_for_disk -= 1
                pause = min(pause * 2, 1.0)
                continue
            await self._reconnect(conn)
            if deadline is not None:  # a wait goes on with what is left of its one deadline
                fields["timeout"] = max(deadline - time.monotonic(), 0.001)

    async def _call_once(
        self, conn: Connection, op: str, value: bytes, fields: dict[str, Any]
    ) -> tuple[dict[str, Any], Any]:
        rid = next(self._ids)
        fut = self._mailbox.expect(("store", rid))
        lost = asyncio.ensure_future(conn.wait_closed())
        try:
            conn.send_frame({"kind": "store_req", "id": rid, "op": op, **fields}, value)
            done, _ = await asyncio.wait({fut, lost}, return_when=asyncio.FIRST_COMPLETED)
        except (Exception, asyncio.CancelledError):
            self._mailbox.unpost(("store", rid))
            raise
        finally:
            lost.cancel()
        if fut not in done:
            self._mailbox.unpost(("store", rid))
            raise conn.lost or PeerLostError(f"rendezvous store at {self.address} closed the connection")
        _conn, header, payload = fut.result()
        if "error" in header:
            kind = StoreDiskError if header.get("disk") else StoreError
            raise kind(f"store at {self.address} refused {op}: {header['error']}")
        return header, payload

    async def _reconnect(self, broken: Connection) -> None:
        """Reconnect once for every caller that saw ``broken`` fail (they wait on the same attempt)."""
        if self._unreachable is not None:  # given up on meanwhile (give_up)
            raise self._unreachable
        if self._conn is not broken:
            return  # somebody reconnected already
        if self._reconnecting is None or self._reconnecting.done():
            self._reconnecting = asyncio.ensure_future(self._redial(broken))
        reconnecting = self._reconnecting
        try:
            await asyncio.shield(reconnecting)
        except asyncio.CancelledError:
            if reconnecting.cancelled() and self._unreachable is not None:  # given up on (give_up)
                raise self._unreachable from None
            raise

    @property
    def reconnecting(self) -> bool:
        """Whether the connection is lost and being dialled again (calls wait for it)."""
        return self._reconnecting is not None and not self._reconnecting.done()

    def give_up(self, reason: str) -> None:
        """Stop waiting for a store that went away: the reconnection under way ends, and every call
        waiting on it and every later call raises PeerLostError(``reason``) at once. A daemon told to
        stop does this rather than wait out PSRING_STORE_RECONNECT_S."""
        if self._unreachable is None:
            self._unreachable = PeerLostError(f"the rendezvous store at {self.address}: {reason}")
        if self._reconnecting is not None and not self._reconnecting.done():
            self._reconnecting.cancel()
        elif self._conn.is_open:  # up, but a call may wait on an answer that does not come (a stopped store)
            self._conn.abort(self._unreachable)

    async def _redial(self, broken: Connection) -> None:
        started = time.monotonic()
        deadline = started + self.reconnect_s
        delay = 0.05
        last: BaseException | None = broken.lost
        logger.warning("store at %s: connection lost (%s); reconnecting for up to %gs", self.address, last,
                       self.reconnect_s)  # fmt: skip
        # (given up on -- give_up -- ends it too, not only the cancellation of this task: a cancellation that
        # meets a dial's own timeout can come out as a TimeoutError, an OSError retried below)
        while not self._closed and self._unreachable is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                conn = await self._dial(
                    self._host, self._port, self._secret, min(max(remaining, 0.1), 5.0), self._role, self._mailbox
                )
            except (PeerLostError, StoreError, OSError) as exc:
                last = exc
                await asyncio.sleep(min(delay, max(deadline - time.monotonic(), 0)))
                delay = min(delay * 2, 1.0)  # at most a second between tries: back soon after the store is
                continue
            with contextlib.suppress(Exception):  # cleanup: a close may fail any way (the peer is gone)
                await broken.close()
            self._conn = conn
            instance = conn.peer.get("instance")
            restarted = instance != self.instance
            self.instance = instance
            self.reconnects += 1
            logger.warning("store at %s: reconnected after %.1fs%s", self.address, time.monotonic() - started,
                           " (a restarted store)" if restarted else "")  # fmt: skip
            for callback in list(self.on_reconnect):
                try:
                    await callback(restarted)
                except (PsringError, OSError) as exc:
                    logger.warning("store at %s: re-registering after a reconnect failed: %s", self.address, exc)
            return
        if self._unreachable is not None:  # given up on meanwhile
            raise self._unreachable
        self._unreachable = PeerLostError(
            f"the rendezvous store at {self.address} has been unreachable for {time.monotonic() - started:.0f}s "
            f"(tried for up to PSRING_STORE_RECONNECT_S={self.reconnect_s:g}s): {last}"
        )
        raise self._unreachable

    async def set(self, key: str, value: bytes | str, ttl: float | None = None) -> None:
        """Set ``key``. ``ttl`` marks a record that is rewritten to stay alive (a daemon's): this store
        tells its age by its own clock (get_aged) and keeps it; etcd puts it on a lease."""
        if isinstance(value, str):
            value = value.encode()
        if ttl:  # a record rewritten to stay alive: the store need not wait for its disk (see StoreServer)
            await self._call("set", value, key=key, ttl=float(ttl))
        else:
            await self._call("set", value, key=key)

    async def get(self, key: str, timeout: float | None = None) -> bytes | None:
        """The value, waiting up to ``timeout`` seconds for the key to appear (None: don't wait)."""
        return (await self.get_aged(key, timeout))[0]

    async def get_aged(self, key: str, timeout: float | None = None) -> tuple[bytes | None, float | None]:
        """The value and how many seconds ago it was written, by the store's clock."""
        header, payload = await self._call("get", key=key, timeout=timeout or 0)
        if not header.get("found"):
            return None, None
        age = header.get("age")
        return bytes(payload), float(age) if isinstance(age, (int, float)) else None

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

    async def wait(self, keys: Sequence[str], timeout: float) -> None:
        header, _ = await self._call("wait", keys=list(keys), timeout=timeout)
        if not header.get("ok"):
            missing = [k for k in keys if await self.get(k) is None]
            raise StoreError(f"timed out after {timeout:g}s waiting for store keys {missing}")

    async def barrier(self, name: str, world_size: int, timeout: float) -> None:
        """Block until ``world_size`` callers reached the barrier ``name``."""
        await store_barrier(self, name, world_size, timeout)

    async def close(self) -> None:
        self._closed = True
        if self._reconnecting is not None and not self._reconnecting.done():
            self._reconnecting.cancel()
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

    async def set(self, key: str, value: bytes | str, ttl: float | None = None) -> None:
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

    async def wait(self, keys: Sequence[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for key in keys:
            if await self.get(key, max(deadline - time.monotonic(), 0)) is None:
                raise StoreError(f"timed out after {timeout:g}s waiting for store keys {[key]} in {self.directory}")

    barrier = StoreClient.barrier

    async def get_aged(self, key: str, timeout: float | None = None) -> tuple[bytes | None, float | None]:
        value = await self.get(key, timeout)
        if value is None:
            return None, None
        with contextlib.suppress(OSError):
            return value, max(time.time() - os.stat(self._path(key)).st_mtime, 0.0)
        return value, None

    async def close(self) -> None:
        pass


# --------------------------------------------------------------- addressing
@dataclass(frozen=True)
class StoreAddress:
    """Where the store is: ``scheme`` is 'tcp' (a psring store at host, port), 'torch' (torch's
    c10d TCPStore at host, port: torchrun's) or 'file' (path)."""

    scheme: str
    host: str = ""
    port: int = 0
    path: str = ""
    #: etcd: every member's (host, port); host and port are the first's
    endpoints: tuple[tuple[str, int], ...] = ()

    def __str__(self) -> str:
        if self.scheme == "file":
            return f"file://{self.path}"
        if self.scheme == "etcd":
            hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.endpoints)
            return f"etcd://{hosts}" + (f"/{self.path}" if self.path else "")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"torch://{host}:{self.port}" if self.scheme == "torch" else f"{host}:{self.port}"


def parse_store_address(spec: str | None, env: Mapping[str, str] | None = None) -> StoreAddress:
    """Parse 'host:port', 'tcp://host:port', 'env://' or 'file:///dir' (None means env://,
    MASTER_ADDR and MASTER_PORT from ``env``, default this process's environment)."""
    env = settings_mod.scheduler_env() if env is None else env
    if spec is None or spec == "" or spec == "env://":
        addr = env.get("MASTER_ADDR")
        master_port = env.get("MASTER_PORT")
        missing = [name for name, v in (("MASTER_ADDR", addr), ("MASTER_PORT", master_port)) if not v]
        if missing:
            raise ValueError(
                f"store='env://' needs the environment variable(s) {', '.join(missing)}; "
                "set them, or pass store='host:port' (or use 'psring launch', which sets them)"
            )
        return parse_store_address(f"{addr}:{master_port}", env)
    if spec.startswith("etcd://"):
        from .etcd import parse_endpoints

        endpoints, prefix = parse_endpoints(spec[len("etcd://") :])
        return StoreAddress("etcd", host=endpoints[0][0], port=endpoints[0][1], path=prefix, endpoints=tuple(endpoints))
    if spec.startswith("file://"):
        path = urllib.parse.urlparse(spec).path
        if not path:
            raise ValueError(f"store={spec!r}: a file store needs a directory, as in file:///shared/dir")
        return StoreAddress("file", path=path)
    scheme = "tcp"
    if spec.startswith("tcp://"):
        spec = spec[len("tcp://") :]
    elif spec.startswith("torch://"):
        scheme, spec = "torch", spec[len("torch://") :]
    if "://" in spec:
        raise ValueError(
            f"store={spec!r}: unknown scheme (use host:port, tcp://, env://, torch://, file:// or etcd://)"
        )
    host, sep, port_s = spec.rpartition(":")
    if not sep or not host:
        raise ValueError(f"store={spec!r} is not host:port")
    try:
        port = int(port_s)
    except ValueError:
        raise ValueError(f"store={spec!r}: port {port_s!r} is not a number") from None
    if not 0 < port < 65536:
        raise ValueError(f"store={spec!r}: port {port} is out of range")
    return StoreAddress(scheme, host=host.strip("[]"), port=port)


async def connect_store(
    address: StoreAddress, *, secret: bytes | None, timeout: float, role: str = "client"
) -> Any:
    if address.scheme == "file":
        return FileStoreClient(address.path)
    if address.scheme == "torch":
        raise ValueError(f"store {address}: torch's store is joined with init_group (it needs the rank)")
    if address.scheme == "etcd":
        from .etcd import EtcdStoreClient

        return await EtcdStoreClient.connect(address.endpoints, address.path, timeout=timeout)
    return await StoreClient.connect(address.host, address.port, secret=secret, timeout=timeout, role=role)
