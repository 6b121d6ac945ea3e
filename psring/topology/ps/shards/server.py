"""A server process: its shards behind one listening port, registered in the store.

A process serves one job's shards on a port of their own (:meth:`ShardServer.start`), or the
shards of any number of jobs on one port it already has (:class:`ShardHost`, a server daemon's
declared port): connections are routed by the job and shard their hello names.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from typing import Any

from .... import settings as settings_mod
from ....core.arrays import keep_freed_memory
from ....errors import PeerLostError, ProtocolError
from ....settings import Settings
from ....transport.connection import Connection
from ....transport.listener import Listener
from ....transport.local import local_pair
from ....transport.mailbox import Mailbox
from ....transport.samehost import host_key
from ....transport.shmpool import ShmPool
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
        self.host: ShardHost | None = None  # the shared port it serves on, instead of a listener of its own

    @property
    def port(self) -> int:
        if self.host is not None:
            return self.host.port
        return self.listener.port if self.listener is not None else 0

    def _route(self, conn: Connection) -> Shard:
        shard_id = conn.peer.get("shard")
        if conn.peer.get("job") != self.job:
            raise ProtocolError(f"worker of job {conn.peer.get('job')!r} dialed a server of job {self.job!r}")
        if shard_id not in self.shards:
            raise ProtocolError(f"this process hosts shards {sorted(self.shards)}, not {shard_id!r}")
        return self.shards[shard_id]

    def router_for(self, conn: Connection) -> Any:
        return _ShardRouter(self._route(conn))

    def accepted(self, conn: Connection) -> None:
        self._route(conn).attach(conn)
        conn.shm.pool_factory = self._pool_for_peers

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
        shard_end.router = self.router_for(shard_end)  # checks job and shard, as for a dial
        self.accepted(shard_end)
        self.local.add(shard_end)
        shard_end.on_closed(lambda: self.local.discard(shard_end))  # no pool: no socket either
        worker_end.peer = {"role": "server", "shards": [hello.get("shard")], "job": self.job}
        return worker_end

    async def start(self, host: str, port: int, advertise: str) -> ShardServer:
        self.listener = Listener(
            self.accepted,
            secret=self.secret,
            info=self.info(),
            router_for=self.router_for,
            name=f"server shard(s) {sorted(self.shards)}",
            settings=self.settings,
        )
        await self.listener.start(host, port)
        self.address = f"{advertise}:{self.listener.port}"
        return self

    def serve_on(self, host: ShardHost, advertise: str) -> ShardServer:
        """Serve on a port this process already listens on (a server daemon's, for many jobs)."""
        host.add(self)
        self.host = host
        self.address = f"{advertise}:{host.port}"
        return self

    def info(self) -> dict[str, Any]:
        """What this server tells a worker in its handshake."""
        return {"role": "server", "shards": sorted(self.shards), "job": self.job, "host": host_key()}

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
            async with asyncio.timeout(timeout):
                await asyncio.gather(*(s.idle.wait() for s in self.shards.values()))

    async def close(self) -> None:
        if self.listener is not None:
            for conn in list(self.listener.connections):
                with contextlib.suppress(Exception):  # cleanup: a close may fail any way (the peer is gone)
                    await conn.close()
            await self.listener.close()
            self.listener = None
        if self.host is not None:  # the port stays: close this job's connections only
            self.host.remove(self)
            for conn in [c for shard in self.shards.values() for c in list(shard.conns) if c not in self.local]:
                with contextlib.suppress(Exception):  # cleanup: a close may fail any way (the peer is gone)
                    await conn.close()
            self.host = None
        for conn in list(self.local):
            conn.abort(PeerLostError("server shut down"))
        if self.pool is not None:
            self.pool.close()
        if self.store is not None:
            with contextlib.suppress(Exception):  # cleanup: a close may fail any way (the peer is gone)
                await self.store.close()
            self.store = None


class ShardHost:
    """One listening port serving the shards of any number of jobs, each job's connections routed
    to that job's :class:`ShardServer` by the job their hello names. A server daemon listens on
    its declared port this way for its whole life: idle (doctor's probes land here) and busy."""

    def __init__(self, *, secret: bytes | None, name: str, settings: Settings | None = None) -> None:
        self.secret = secret
        self.name = name
        self.settings = settings or settings_mod.current()
        self.servers: dict[str, ShardServer] = {}
        self.listener: Listener | None = None

    @property
    def port(self) -> int:
        return self.listener.port if self.listener is not None else 0

    async def start(self, host: str, port: int, *, serving: bool = True) -> ShardHost:
        """Listen on host:port; ``serving=False`` binds only, until :meth:`start_serving`."""
        self.listener = Listener(
            self.accepted,
            secret=self.secret,
            info=self._info,
            router_for=self.router_for,
            name=self.name,
            settings=self.settings,
        )
        await self.listener.start(host, port, serving=serving)
        return self

    async def start_serving(self) -> None:
        if self.listener is not None:
            await self.listener.start_serving()

    def add(self, server: ShardServer) -> None:
        if server.job in self.servers:
            raise ValueError(f"{self.name} already serves shards of job {server.job!r}")
        self.servers[server.job] = server

    def remove(self, server: ShardServer) -> None:
        if self.servers.get(server.job) is server:
            del self.servers[server.job]

    def _info(self, hello: dict[str, Any]) -> dict[str, Any]:
        server = self.servers.get(hello.get("job"))  # type: ignore[arg-type]
        return server.info() if server is not None else {"role": "server", "shards": [], "host": host_key()}

    def _server(self, conn: Connection) -> ShardServer | None:
        if conn.peer.get("role") == "doctor":  # a reachability and secret check: accepted, then closed by it
            return None
        job = conn.peer.get("job")
        server = self.servers.get(job)  # type: ignore[arg-type]
        if server is None:
            raise ProtocolError(f"{self.name} serves no shards of job {job!r} (it serves jobs {sorted(self.servers)})")
        return server

    def router_for(self, conn: Connection) -> Any:
        server = self._server(conn)
        return server.router_for(conn) if server is not None else Mailbox()

    def accepted(self, conn: Connection) -> None:
        server = self._server(conn)
        if server is not None:
            server.accepted(conn)

    async def close(self) -> None:
        for server in list(self.servers.values()):
            await server.close()
        if self.listener is not None:
            await self.listener.close()
            self.listener = None


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
    shard_host: ShardHost | None = None,
    checkpoint_name: str | None = None,
) -> ShardServer:
    """Start shards (all of them, or shard_ids) in this event loop and register them in store:
    on a port of their own (host, port), or on ``shard_host``'s port."""
    if num_shards < 1:
        raise ValueError(f"--shards must be at least 1, got {num_shards}")
    ids = list(range(num_shards)) if shard_ids is None else shard_ids
    for i in ids:
        if not 0 <= i < num_shards:
            raise ValueError(f"shard {i} is out of range for {num_shards} shards")
    server = ShardServer(ids, num_shards, job=job, secret=secret, settings=settings)
    if checkpoint_dir is not None or restore:
        configure_checkpoints(server, checkpoint_dir, checkpoint_every, restore, name=checkpoint_name)
    advertise = advertise or ("127.0.0.1" if host in ("127.0.0.1", "0.0.0.0") else host)
    if shard_host is not None:
        server.serve_on(shard_host, advertise)
    else:
        await server.start(host, port, advertise)
    try:
        await server.register(store)
    except (Exception, asyncio.CancelledError):  # cleanup, then the error stands: no half-registered job
        server.store = None  # (the caller's store: it closes it)
        await server.close()
        raise
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


async def run_shards(
    store: str,
    num_shards: int,
    *,
    shard_ids: list[int] | None = None,
    job: str | None = None,
    secret: bytes | None = None,
    host: str | None = None,
    port: int | None = None,
    advertise: str | None = None,
    checkpoint_dir: str | None = None,
    checkpoint_every: int = 1,
    restore: bool = False,
    store_timeout: float = 60.0,
) -> int:
    """A process of shards, until SIGTERM/SIGINT: ``psring server``, and the shard processes
    ``psring launch`` starts (``python -m psring.topology.ps SPEC``). Prints one line once the
    shards are registered. ``None`` means the setting (PSRING_JOB, PSRING_SECRET, ...)."""
    from ....rendezvous.client import connect_store, parse_store_address
    from ....rendezvous.scheduler import default_route_host, routable_host_towards

    config = settings_mod.current()
    if num_shards < 1:
        raise ValueError(f"--shards must be at least 1, got {num_shards}")
    keep_freed_memory()  # this process is the shards': a sparse step's rows would fault in fresh pages
    address = parse_store_address(store)
    secret = secret if secret is not None else config.secret_bytes
    client = await connect_store(address, secret=secret, timeout=store_timeout, role="server")
    advertise = advertise or config.advertise_host or (
        routable_host_towards(address.host) if address.scheme == "tcp" else default_route_host()
    )
    server = await start_servers(
        client,
        num_shards,
        job=job or config.job,
        secret=secret,
        host=host or config.bind_host or "0.0.0.0",
        port=config.port if port is None else port,
        advertise=advertise,
        shard_ids=shard_ids,
        checkpoint_dir=checkpoint_dir if checkpoint_dir is not None else config.checkpoint_dir,
        checkpoint_every=checkpoint_every,
        restore=restore,
    )
    restored = sum(len(s.params.buckets) for s in server.shards.values() if s.params is not None) if restore else 0
    print(
        f"psring server: shard(s) {sorted(server.shards)} of {num_shards} for job {job or config.job!r} on "
        f"{server.address}" + (f", restored {restored} bucket(s) from {checkpoint_dir}" if restore else ""),
        flush=True,
    )
    await serve_forever(server)
    return 0
