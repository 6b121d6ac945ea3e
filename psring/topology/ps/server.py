"""A server process: its shards behind one listening port, registered in the store."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

from ... import settings as settings_mod
from ...errors import PeerLostError, ProtocolError
from ...settings import Settings
from ...transport.connection import Connection
from ...transport.listener import Listener
from ...transport.local import local_pair
from ...transport.samehost import host_key
from ...transport.shmpool import ShmPool
from .paramstore import configure_checkpoints
from .shard import Shard

logger = logging.getLogger(__name__)


class ShardServer:
    """One process's shards behind one listening port, registered in the store."""

    def __init__(
        self, shard_ids: list[int], num_shards: int, *, job: str, secret: bytes | None, settings: Settings | None = None
    ) -> None:
        self.settings = settings or settings_mod.current()
        self.shards = {i: Shard(i, num_shards, job, self.settings) for i in shard_ids}
        self.num_shards = num_shards
        self.job = job
        self.secret = secret
        self.listener: Listener | None = None
        self.store: Any = None
        self.address = ""
        self.on_stop: Any = None  # parameter mode: the final checkpoint
        self.local: set[Connection] = set()  # shard ends of in-process workers (colocated shards)
        self.pool: ShmPool | None = None  # results for workers on this host (made at the first offer)
        self._pool_failed = False

    @property
    def port(self) -> int:
        return self.listener.port if self.listener is not None else 0

    def _route(self, conn: Connection) -> Shard:
        shard_id = conn.peer.get("shard")
        if conn.peer.get("job") != self.job:
            raise ProtocolError(f"worker of job {conn.peer.get('job')!r} dialed a server of job {self.job!r}")
        if shard_id not in self.shards:
            raise ProtocolError(f"this process hosts shards {sorted(self.shards)}, not {shard_id!r}")
        return self.shards[shard_id]

    def _router_for(self, conn: Connection) -> Any:
        return _ShardRouter(self._route(conn))

    def _accepted(self, conn: Connection) -> None:
        self._route(conn).attach(conn)
        conn.pool_factory = self._pool_for_peers

    def _pool_for_peers(self) -> ShmPool | None:
        """This process's shared-memory pool for results, made when a worker first offers its own."""
        if self.pool is None and not self._pool_failed and self.settings.ps_shm_slots > 0:
            try:
                self.pool = ShmPool(self.settings.ps_shm_slots, self.settings.ps_piece)
            except (OSError, ValueError) as exc:
                self._pool_failed = True
                logger.warning("server shard(s) %s: no shared memory for results (%s)", sorted(self.shards), exc)
        return self.pool

    def attach_local(self, hello: dict[str, Any], name: str) -> Connection:
        """Connect a worker of this very process to shard ``hello["shard"]`` without a socket.

        Returns the worker's end. The frames are the same as over TCP, so the shard cannot tell.
        """
        worker_end, shard_end = local_pair(name, f"server shard {hello.get('shard')}")
        shard_end.peer = dict(hello)
        shard_end.router = self._router_for(shard_end)  # checks job and shard, as for a dial
        self._accepted(shard_end)
        self.local.add(shard_end)
        shard_end._closed.add_done_callback(lambda _f: self.local.discard(shard_end))  # no pool: no socket either
        worker_end.peer = {"role": "server", "shards": [hello.get("shard")], "job": self.job}
        return worker_end

    async def start(self, host: str, port: int, advertise: str) -> ShardServer:
        self.listener = Listener(
            self._accepted,
            secret=self.secret,
            info={"role": "server", "shards": sorted(self.shards), "job": self.job, "host": host_key()},
            router_for=self._router_for,
            name=f"server shard(s) {sorted(self.shards)}",
            settings=self.settings,
        )
        await self.listener.start(host, port)
        self.address = f"{advertise}:{self.listener.port}"
        return self

    async def register(self, store: Any) -> None:
        """Publish each shard's address (and the shard count) under the job's prefix."""
        self.store = store
        prefix = f"psring/{self.job}"
        await store.set(f"{prefix}/num_servers", str(self.num_shards).encode())
        for i in self.shards:
            await store.set(f"{prefix}/server/{i}", self.address.encode())

    async def drain(self, timeout: float) -> None:
        """Wait (up to timeout) until every worker has disconnected."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.gather(*(s.idle.wait() for s in self.shards.values())), timeout)

    async def close(self) -> None:
        if self.listener is not None:
            for conn in list(self.listener.connections):
                with contextlib.suppress(Exception):
                    await conn.close()
            await self.listener.close()
            self.listener = None
        for conn in list(self.local):
            conn.abort(PeerLostError("server shut down"))
        if self.pool is not None:
            self.pool.close()
        if self.store is not None:
            with contextlib.suppress(Exception):
                await self.store.close()
            self.store = None


class _ShardRouter:
    def __init__(self, shard: Shard) -> None:
        self.shard = shard

    def buffer_for(self, conn: Connection, header: dict[str, Any]) -> memoryview | None:
        return self.shard.buffer_for(conn, header)

    def deliver(self, conn: Connection, header: dict[str, Any], payload: Any) -> None:
        self.shard.deliver(conn, header, payload)

    def connection_lost(self, conn: Connection, error: PeerLostError | None) -> None:
        self.shard.detach(conn, error)


async def start_servers(
    store: Any,
    num_shards: int,
    *,
    job: str = "default",
    secret: bytes | None = None,
    host: str = "127.0.0.1",
    port: int = 0,
    advertise: str | None = None,
    shard_ids: list[int] | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 1,
    restore: bool = False,
    settings: Settings | None = None,
) -> ShardServer:
    """Start shards (all of them, or shard_ids) in this event loop and register them in store."""
    if num_shards < 1:
        raise ValueError(f"--shards must be at least 1, got {num_shards}")
    ids = list(range(num_shards)) if shard_ids is None else shard_ids
    for i in ids:
        if not 0 <= i < num_shards:
            raise ValueError(f"shard {i} is out of range for {num_shards} shards")
    server = ShardServer(ids, num_shards, job=job, secret=secret, settings=settings)
    if checkpoint_dir is not None or restore:
        configure_checkpoints(server, checkpoint_dir, checkpoint_every, restore)
    await server.start(host, port, advertise or ("127.0.0.1" if host in ("127.0.0.1", "0.0.0.0") else host))
    await server.register(store)
    return server


async def serve_forever(server: ShardServer, on_stop: Any = None) -> None:
    """Run until SIGTERM/SIGINT, then (optionally) checkpoint and close."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    await stop.wait()
    for hook in (on_stop, server.on_stop):
        if hook is not None:
            hook()
    await server.close()
