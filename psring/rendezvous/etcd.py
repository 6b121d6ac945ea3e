"""``etcd://h1:2379,h2:2379[/prefix]``: the store on an etcd v3 cluster, a control plane that never goes down.

Which client, and why: etcd's own JSON gateway (``/v3/kv/range``, ``/v3/kv/txn``, ``/v3/watch``,
``/v3/lease/*``: the gRPC API as HTTP+JSON, served by every etcd member since 3.3), spoken here over
asyncio streams in a few lines. The asyncio gRPC clients on PyPI (aetcd, etcetra) pull in grpcio and
generated protobuf code for the same six calls; the gateway needs nothing beyond the standard library
and runs on uvloop like everything else in psring.

How the store's operations map onto etcd:
- ``set``/``get``/``delete``/``list``: put, range, delete range, range over the prefix (keys only).
- ``compare_set``: a transaction comparing the value (or, for "absent", the create revision 0).
- ``add``: a transaction on the key's mod revision, retried on conflict; it also writes the request's
  token under ``<prefix>/.tokens/`` (on a lease of 10 minutes) in the same transaction, so a call
  retried after an ambiguous failure (a leader lost mid-request) returns the first answer instead of
  adding twice.
- ``get(key, timeout)`` and ``wait``: a watch from the revision the read saw (no polling).
- ``set(key, value, ttl=)`` (a daemon's record): the key on a lease of ``ttl`` seconds, so a record
  nobody refreshes goes away; ``get_aged`` reads its age from the lease (granted minus remaining TTL).
Every request goes to one member and fails over to the next on a connection error or a 5xx (a
member down, an election in progress), for up to PSRING_STORE_RECONNECT_S; any member answers for
the cluster (followers forward writes to the leader). The psring secret does not apply to etcd:
protect it with etcd's own TLS and authentication.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import logging
import time
import uuid
from collections.abc import Sequence
from typing import Any

from .. import settings as settings_mod
from ..errors import PeerLostError, StoreError
from .barrier import store_barrier

logger = logging.getLogger(__name__)

#: seconds a retried add's token (and answer) is kept
TOKEN_TTL_S = 600
#: seconds one request waits on one member before the next is asked (an election takes about one)
REQUEST_TIMEOUT_S = 2.0


def _b64(text: str | bytes) -> str:
    return base64.b64encode(text.encode() if isinstance(text, str) else text).decode()


def _unb64(text: str) -> bytes:
    return base64.b64decode(text)


def _range_end(prefix: bytes) -> bytes:
    """The first key after every key that starts with ``prefix`` (etcd's prefix range)."""
    end = bytearray(prefix)
    for i in range(len(end) - 1, -1, -1):
        if end[i] < 0xFF:
            end[i] += 1
            return bytes(end[: i + 1])
    return b"\x00"


class _Unavailable(Exception):
    """This member did not answer (connection refused or cut, a 5xx): try another."""


class EtcdStoreClient:
    """The store interface (as StoreClient) over an etcd v3 cluster."""

    def __init__(self, endpoints: Sequence[tuple[str, int]], prefix: str, reconnect_s: float | None = None) -> None:
        if not endpoints:
            raise ValueError("etcd:// needs at least one host:port")
        self.endpoints = list(endpoints)
        self.prefix = "/" + prefix.strip("/") + "/" if prefix.strip("/") else "/psring/"
        hosts = ",".join(f"{h}:{p}" for h, p in self.endpoints)
        self.address = f"etcd://{hosts}{self.prefix.rstrip('/')}"
        self.reconnect_s = settings_mod.current().store_reconnect if reconnect_s is None else reconnect_s
        self._unreachable: PeerLostError | None = None  # set once no member answered past the bound
        self._trouble_since: float | None = None  # no member answered the last round: retrying since then
        self._current = 0
        self._client_id = uuid.uuid4().hex[:12]
        self._ids = 0
        self._closed = False
        self.on_reconnect: list[Any] = []  # the daemons' hook: etcd keeps everything, nothing to re-register
        self._leases: dict[str, str] = {}  # key -> the lease its ttl'd record is on

    @classmethod
    async def connect(
        cls, endpoints: Sequence[tuple[str, int]], prefix: str = "", timeout: float = 30.0
    ) -> EtcdStoreClient:
        client = cls(endpoints, prefix)
        deadline = time.monotonic() + timeout
        last: BaseException | None = None
        mute = 0  # rounds in which every member accepted the connection and closed it without an answer
        while time.monotonic() < deadline:
            silent = 0
            for i, (host, port) in enumerate(client.endpoints):
                try:
                    status = await client.post_to(host, port, "/v3/maintenance/status", {}, timeout=5.0)
                except _Unavailable as exc:
                    last = exc
                    silent += "without an answer" in str(exc)
                    continue
                except StoreError as exc:  # something else listens there: a wrong address, named at start
                    raise ValueError(f"store={client.address}: {exc}") from None
                if not isinstance(status, dict) or "version" not in status or "header" not in status:
                    raise ValueError(
                        f"store={client.address}: {host}:{port} answered, but not as etcd v3 ({str(status)[:200]})"
                    )
                client.use_endpoint(i)
                return client
            mute = mute + 1 if silent == len(client.endpoints) else 0
            if mute >= 3:  # something listens there, but it does not speak HTTP
                raise ValueError(f"store={client.address}: {last}: is it an etcd client port?")
            await asyncio.sleep(0.2)
        raise PeerLostError(f"no etcd member of {client.address} answered within {timeout:g}s ({last})")

    @property
    def reconnecting(self) -> bool:
        """Whether no member answered the last round of tries and calls are retrying (they wait for it)."""
        return self._trouble_since is not None

    def give_up(self, reason: str) -> None:
        """Stop retrying: every call waiting on a member and every later call raises PeerLostError(``reason``)
        at once (within a request's REQUEST_TIMEOUT_S). A daemon told to stop does this rather than wait out
        PSRING_STORE_RECONNECT_S, as with psring's own store (StoreClient.give_up)."""
        if self._unreachable is None:
            self._unreachable = PeerLostError(f"the etcd store at {self.address}: {reason}")

    # ------------------------------------------------------------------ HTTP
    def use_endpoint(self, i: int) -> None:
        """Send requests to ``endpoints[i]`` first (one that answered)."""
        self._current = i

    async def post_to(self, host: str, port: int, path: str, body: dict[str, Any], timeout: float) -> Any:
        payload = json.dumps(body).encode()
        request = (
            f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n"
        ).encode() + payload
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_connection(host, port)
                try:
                    writer.write(request)
                    raw = await reader.read()
                finally:
                    writer.close()
                    with contextlib.suppress(OSError):
                        await writer.wait_closed()
        except (OSError, TimeoutError) as exc:
            raise _Unavailable(f"{host}:{port}: {exc or type(exc).__name__}") from None
        if not raw:  # closed without an answer (a member going down): another may answer
            raise _Unavailable(f"{host}:{port} closed the connection without an answer")
        head, _, rest = raw.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        try:
            status = int(lines[0].split()[1])
        except (IndexError, ValueError):
            raise StoreError(f"{host}:{port} does not speak HTTP (is it an etcd client port?)") from None
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        body_bytes = _dechunk(rest) if headers.get("transfer-encoding") == "chunked" else rest
        if status >= 500:
            raise _Unavailable(f"{host}:{port}: HTTP {status} {body_bytes[:200]!r}")
        try:
            answer = json.loads(body_bytes or b"{}")
        except ValueError:
            raise StoreError(f"{host}:{port} answered {path} with something that is not JSON") from None
        if status >= 400 or "error" in answer:
            message = answer.get("message") or answer.get("error") if isinstance(answer, dict) else answer
            if "leader" in str(message) or "timed out" in str(message):  # an election: another member may know
                raise _Unavailable(f"{host}:{port}: {message}")
            raise StoreError(f"etcd at {host}:{port} refused {path}: {message}")
        return answer

    async def _post(self, path: str, body: dict[str, Any], retried: list[bool] | None = None) -> Any:
        """One request, to the member in use or, failing that, the others, for up to reconnect_s.
        ``retried`` (if given) is set when a try failed after it may have reached etcd."""
        if self._unreachable is not None:  # past the bound once: every later call says so at once
            raise PeerLostError(str(self._unreachable)) from self._unreachable
        started = time.monotonic()
        delay = 0.05
        last: BaseException | None = None
        while not self._closed:
            if self._unreachable is not None:  # given up on meanwhile (give_up)
                raise PeerLostError(str(self._unreachable)) from self._unreachable
            for k in range(len(self.endpoints)):
                i = (self._current + k) % len(self.endpoints)
                host, port = self.endpoints[i]
                try:
                    # a member that cannot reach a leader holds a request for seconds: ask another sooner
                    answer = await self.post_to(host, port, path, body, timeout=REQUEST_TIMEOUT_S)
                except _Unavailable as exc:
                    last = exc
                    if retried is not None:
                        retried[:] = [True]
                    continue
                if i != self._current:
                    was = self.endpoints[self._current]
                    logger.warning("etcd: %s:%s answers now (%s:%s did not: %s)", host, port, *was, last)
                    self._current = i
                self._trouble_since = None
                return answer
            if self._trouble_since is None:
                self._trouble_since = started
            if time.monotonic() - started > self.reconnect_s:
                break
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)
        if self._closed:
            raise PeerLostError(f"the etcd store client for {self.address} is closed")
        self._unreachable = PeerLostError(
            f"no member of the etcd store {self.address} answered for {time.monotonic() - started:.0f}s "
            f"(tried for up to PSRING_STORE_RECONNECT_S={self.reconnect_s:g}s): {last}"
        )
        raise self._unreachable

    def _key(self, key: str) -> str:
        return _b64(self.prefix + key)

    # ------------------------------------------------------------------ the store interface
    async def set(self, key: str, value: bytes | str, ttl: float | None = None) -> None:
        """Put ``key``; with ``ttl``, on this client's lease for the key, kept alive by each such set
        (so its age is the time since the last one, and it goes away ``ttl`` seconds after it)."""
        body: dict[str, Any] = {"key": self._key(key), "value": _b64(value)}
        if ttl is not None:
            lease = self._leases.get(key)
            if lease is not None:
                alive = await self._post("/v3/lease/keepalive", {"ID": lease})
                if int((alive.get("result") or {}).get("TTL", 0)) <= 0:
                    lease = None  # expired meanwhile: a new one
            if lease is None:
                lease = self._leases[key] = await self._lease(ttl)
            body["lease"] = lease
        await self._post("/v3/kv/put", body)

    async def _lease(self, ttl: float) -> str:
        answer = await self._post("/v3/lease/grant", {"TTL": max(int(ttl), 1)})
        return str(answer["ID"])

    async def _range(self, key: str) -> tuple[dict[str, Any] | None, int]:
        answer = await self._post("/v3/kv/range", {"key": self._key(key)})
        kvs = answer.get("kvs") or []
        return (kvs[0] if kvs else None), int(answer["header"]["revision"])

    async def get(self, key: str, timeout: float | None = None) -> bytes | None:
        kv, revision = await self._range(key)
        if kv is None and timeout:
            kv = await self._watch_put(key, revision + 1, timeout)
        return _unb64(kv.get("value", "")) if kv is not None else None

    async def get_aged(self, key: str, timeout: float | None = None) -> tuple[bytes | None, float | None]:
        kv, revision = await self._range(key)
        if kv is None and timeout:
            kv = await self._watch_put(key, revision + 1, timeout)
        if kv is None:
            return None, None
        age = None
        lease = kv.get("lease")
        if lease and lease != "0":
            life = await self._post("/v3/lease/timetolive", {"ID": lease})
            granted, left = int(life.get("grantedTTL", 0)), int(life.get("TTL", -1))
            if left >= 0:
                age = float(max(granted - left, 0))
        return _unb64(kv.get("value", "")), age

    async def _watch_put(self, key: str, start_revision: int, timeout: float) -> dict[str, Any] | None:
        """Wait up to ``timeout`` for the key to be put (a watch from start_revision), then its kv."""
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            if self._unreachable is not None:  # given up on (give_up)
                raise PeerLostError(str(self._unreachable)) from self._unreachable
            host, port = self.endpoints[self._current]
            try:
                return await self._watch_once(host, port, key, start_revision, remaining)
            except _Unavailable as exc:  # this member went away: read again from another, and watch there
                logger.info("etcd: watch on %s:%s ended (%s); going on elsewhere", host, port, exc)
                self._current = (self._current + 1) % len(self.endpoints)
                kv, revision = await self._range(key)
                if kv is not None:
                    return kv
                start_revision = revision + 1

    async def _watch_once(
        self, host: str, port: int, key: str, start_revision: int, timeout: float
    ) -> dict[str, Any] | None:
        body = json.dumps(
            {"create_request": {"key": self._key(key), "start_revision": str(start_revision), "filters": ["NODELETE"]}}
        ).encode()
        request = (
            f"POST /v3/watch HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode() + body
        try:
            async with asyncio.timeout(min(timeout, 5.0)):
                reader, writer = await asyncio.open_connection(host, port)
        except (OSError, TimeoutError) as exc:
            raise _Unavailable(str(exc)) from None
        try:
            writer.write(request)
            try:
                async with asyncio.timeout(timeout):
                    head = await reader.readuntil(b"\r\n\r\n")
                    if b" 200 " not in head.split(b"\r\n", 1)[0]:
                        raise _Unavailable(head.split(b"\r\n", 1)[0].decode("latin-1"))
                    while True:
                        size_line = await reader.readline()
                        if not size_line:
                            raise _Unavailable("the watch stream ended")
                        size = int(size_line.strip() or b"0", 16)
                        chunk = await reader.readexactly(size + 2)
                        for line in chunk[:-2].split(b"\n"):
                            if not line.strip():
                                continue
                            event = json.loads(line)
                            for ev in (event.get("result") or {}).get("events") or []:
                                if ev.get("type", "PUT") == "PUT":
                                    return dict(ev["kv"])
            except TimeoutError:
                return None
            except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                raise _Unavailable(str(exc)) from None
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def add(self, key: str, amount: int = 1) -> int:
        self._ids += 1
        token_key = self._key(f".tokens/{self._client_id}:{self._ids}")
        lease: str | None = None
        while True:
            answer = await self._post("/v3/kv/range", {"key": token_key})
            if answer.get("kvs"):  # an earlier try of this very call went through
                return int(_unb64(answer["kvs"][0]["value"]))
            kv, _revision = await self._range(key)
            current = int(_unb64(kv["value"])) if kv is not None else 0
            total = current + amount
            compare = (
                {"key": self._key(key), "target": "MOD", "result": "EQUAL", "mod_revision": kv["mod_revision"]}
                if kv is not None
                else {"key": self._key(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            )
            lease = lease or await self._lease(TOKEN_TTL_S)
            answer = await self._post(
                "/v3/kv/txn",
                {
                    "compare": [compare],
                    "success": [
                        {"request_put": {"key": self._key(key), "value": _b64(str(total))}},
                        {"request_put": {"key": token_key, "value": _b64(str(total)), "lease": lease}},
                    ],
                },
            )
            if answer.get("succeeded"):
                return total

    async def compare_set(self, key: str, expected: bytes | None, desired: bytes) -> tuple[bool, bytes | None]:
        compare = (
            {"key": self._key(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
            if expected is None
            else {"key": self._key(key), "target": "VALUE", "result": "EQUAL", "value": _b64(expected)}
        )
        retried: list[bool] = []
        answer = await self._post(
            "/v3/kv/txn",
            {
                "compare": [compare],
                "success": [{"request_put": {"key": self._key(key), "value": _b64(desired)}}],
                "failure": [{"request_range": {"key": self._key(key)}}],
            },
            retried,
        )
        if answer.get("succeeded"):
            return True, desired
        kvs = ((answer.get("responses") or [{}])[0].get("response_range") or {}).get("kvs") or []
        current = _unb64(kvs[0].get("value", "")) if kvs else None
        if retried and current == desired and expected != desired:
            return True, desired  # an earlier try went through before its answer was lost (a leader change)
        return False, current

    async def delete(self, key: str) -> bool:
        answer = await self._post("/v3/kv/deleterange", {"key": self._key(key)})
        return int(answer.get("deleted", 0)) > 0

    async def list(self, prefix: str = "") -> list[str]:
        full = (self.prefix + prefix).encode()
        answer = await self._post(
            "/v3/kv/range", {"key": _b64(full), "range_end": _b64(_range_end(full)), "keys_only": True}
        )
        keys = [_unb64(kv["key"]).decode()[len(self.prefix) :] for kv in answer.get("kvs") or []]
        return sorted(k for k in keys if not k.startswith(".tokens/"))

    async def wait(self, keys: Sequence[str], timeout: float) -> None:
        deadline = time.monotonic() + timeout
        for key in keys:
            if await self.get(key, max(deadline - time.monotonic(), 0.001)) is None:
                raise StoreError(f"timed out after {timeout:g}s waiting for store keys {[key]} in {self.address}")

    async def barrier(self, name: str, world_size: int, timeout: float) -> None:
        """Block until ``world_size`` callers reached the barrier ``name``."""
        await store_barrier(self, name, world_size, timeout)

    async def close(self) -> None:
        self._closed = True


def _dechunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0].strip() or b"0", 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2 :]
    return bytes(out)


def parse_endpoints(spec: str) -> tuple[list[tuple[str, int]], str]:
    """``h1:2379,h2:2379[/prefix]`` (the part after ``etcd://``) -> endpoints and prefix."""
    hosts, _, prefix = spec.partition("/")
    endpoints = []
    for item in hosts.split(","):
        host, sep, port = item.strip().rpartition(":")
        if not sep or not host:
            raise ValueError(f"store='etcd://{spec}': {item!r} is not host:port")
        try:
            number = int(port)
        except ValueError:
            raise ValueError(f"store='etcd://{spec}': port {port!r} is not a number") from None
        if not 0 < number < 65536:
            raise ValueError(f"store='etcd://{spec}': port {number} is out of range")
        endpoints.append((host.strip("[]"), number))
    return endpoints, prefix


__all__ = ["EtcdStoreClient", "parse_endpoints"]
