"""A worker's links to the parameter-server shards: dialing, reconnecting to a restarted shard,
losses, shared memory."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any, ClassVar

from ....errors import CollectiveTimeoutError, PeerLostError, ProtocolError, PsringError
from ....rendezvous.scheduler import GroupSettings
from ....settings import parse_weights
from ....transport.connection import Connection
from ....transport.listener import open_connection
from ....transport.mailbox import Mailbox
from ....transport.samehost import elsewhere, host_key
from ....transport.shmpool import ShmPool
from ....transport.tcpsocket import limit_send_buffer
from ...group import farewell
from ...stall import StallInspector
from .. import frames
from ..plan import WIRE_PIECES, check_weights, piece_bytes
from ..shards.server import ShardServer
from . import linkprobe

logger = logging.getLogger(__name__)


class ServerLinks:
    """A worker's connections to the server shards, and the mailbox they deliver to."""

    #: workers open in this process (a lone one polls for a small call's answer: PSRING_SPIN_US)
    live: ClassVar[int] = 0

    def __init__(self, rank: int, world_size: int, settings: GroupSettings, store: Any, prefix: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self.settings = settings
        self.config = settings.config
        self.store = store
        self.prefix = prefix
        self.mailbox = Mailbox()
        self.mailbox.on_lost = self._on_conn_lost
        self.mailbox.on_control = self._on_control
        self.shards: list[Connection] = []
        self.addresses: list[str] = []
        self.groups: dict[str, Any] = {}  # gid -> PsGroup
        self.stopped_at: dict[str, int] = {}  # per group: the first seq this rank did not finish
        self.lost: PsringError | None = None
        self.embedded_store: Any = None
        self.own_servers: ShardServer | None = None
        self.reconnect_servers = True  # parameter mode re-sends to a restarted shard
        self.colocated = False  # the shards live in the ranks' processes (shard i in rank i % N)
        self._loss_waiters: set[asyncio.Future[None]] = set()
        self._closing = False
        self.pool: ShmPool | None = None  # pushes to shards on this host (psring.transport.shmpool)
        self._pool_failed = False
        self._pool_checked: set[int] = set()  # ids of the shard connections offered it (or not able to)
        self.stalls = StallInspector(self, self._stall_send)
        #: whether some worker of the job reaches a shard on another host (learn_piece): collectives are
        #: then split into smaller pieces (piece_for); every join says the size
        self.wire = False
        #: each shard's share of every large tensor (PSRING_PS_WEIGHTS as rank 0 set it; None: equal)
        self.weights: tuple[int, ...] | None = None
        self.host_reduce: Any = None  # the job's group's HostReduce (its board is closed with the links)
        #: the job's pieces a slice and send buffer between hosts (rank 0's choice: linkprobe); until
        #: learn_piece, this worker's own settings
        self.tuning = linkprobe.Tuning(self.config.ps_wire_pieces or WIRE_PIECES, self.config.ps_sndbuf or 0)
        self.probes: linkprobe.Probes = {}  # a link probe's answers (linkprobe)
        ServerLinks.live += 1
        self._counted = True

    def loss_future(self) -> asyncio.Future[None]:
        """A future that fails with the PeerLostError of the next lost shard connection."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        if isinstance(self.lost, PeerLostError):
            fut.set_exception(self.lost)
        else:
            self._loss_waiters.add(fut)
            fut.add_done_callback(self._loss_waiters.discard)
        return fut

    async def reconnect(self, deadline: float) -> None:
        """Dial every lost shard again at the address the store now has for it (a restarted server)."""
        for i, conn in enumerate(self.shards):
            if conn.is_open:
                continue
            key = f"{self.prefix}/server/{i}"
            while True:
                # the store says where a restarted shard listens now; a store that is away itself
                # (a rank cut off from everything) must not hold this past the deadline: dial the
                # address the shard had
                try:
                    async with asyncio.timeout(max(deadline - time.monotonic(), 0.1)):
                        raw = await self.store.get(key)
                except (TimeoutError, PsringError, OSError):
                    raw = None
                host, _, port = (raw.decode() if raw else self.addresses[i]).rpartition(":")
                try:
                    new = await open_connection(
                        host,
                        int(port),
                        secret=self.settings.secret,
                        hello=self._hello(i),
                        router=self.mailbox,
                        timeout=min(2.0, max(deadline - time.monotonic(), 0.1)),
                        name=f"rank {self.rank}",
                        settings=self.config,
                    )
                    break
                except (PsringError, ValueError, OSError) as exc:
                    if time.monotonic() > deadline:
                        raise PeerLostError(f"server shard {i} did not come back: {exc}") from exc
                    await asyncio.sleep(0.2)
            new.peer["shard"] = i
            self._tune(new)
            self.shards[i] = new
            self.addresses[i] = f"{host}:{port}"
        self.lost = None

    async def resolve(self, timeout: float) -> int:
        """Wait for the servers to register; return how many shards there are."""
        deadline = time.monotonic() + timeout
        key = f"{self.prefix}/num_servers"
        try:
            await self.store.wait([key], timeout)
        except PsringError:
            raise CollectiveTimeoutError(
                f"no parameter server registered for job {self.settings.job!r} at {self.store.address} within "
                f"{timeout:g}s: start them with `psring server --store HOST:PORT --shards S` "
                f"(psring launch --topology ps and psring train start local ones)"
            ) from None
        raw = await self.store.get(key)
        count = int(raw.decode()) if raw else 0
        keys = [f"{self.prefix}/server/{i}" for i in range(count)]
        try:
            await self.store.wait(keys, max(deadline - time.monotonic(), 0.1))
        except PsringError:
            missing = [i for i, k in enumerate(keys) if await self.store.get(k) is None]
            raise CollectiveTimeoutError(
                f"server shard(s) {missing} of {count} did not register within {timeout:g}s"
            ) from None
        for k in keys:
            raw = await self.store.get(k)
            assert raw is not None
            self.addresses.append(raw.decode())
        return count

    def _hello(self, i: int) -> dict[str, Any]:
        return {
            "role": "rank",
            "rank": self.rank,
            "world_size": self.world_size,
            "job": self.settings.job,
            "shard": i,
            "host": host_key(),
            # which host this rank counts as for all_reduce's two-level order, and whether that order is on
            "where": [self.config.host_id or host_key(), self.config.hierarchical],
        }

    def _tune(self, conn: Connection) -> None:
        """The job's send buffer (PSRING_PS_SNDBUF, or what rank 0 measured) on a connection to a shard on
        another host, at both ends: the shard takes the worker's word where its own setting is auto."""
        sndbuf = self.tuning.sndbuf
        if sndbuf > 0 and not conn.is_local and elsewhere(conn.peer.get("host")):
            limit_send_buffer(conn, sndbuf)
            with contextlib.suppress(PsringError):  # a connection lost meanwhile: its loss is reported
                conn.send_frame(frames.link(sndbuf=sndbuf))

    def reaches_other_hosts(self) -> bool:
        """Whether some shard connection of this worker leaves its host (its handshake says so)."""
        return any(not c.is_local and elsewhere(c.peer.get("host")) for c in self.shards)

    async def tell_piece(self, key: str) -> None:
        """Count, in the store, whether this worker reaches a shard on another host, and on rank 0 write
        its shard weights and its links' tuning there (measured now where a setting is left auto:
        linkprobe), before the ranks' ready barrier; :meth:`learn_piece` reads them after it."""
        await self.store.add(key, 1 if self.reaches_other_hosts() else 0)
        if self.rank == 0:  # rank 0's shard weights and tuning are the job's
            weights = self.config.ps_weights
            await self.store.set(f"{self.prefix}/weights", ",".join(map(str, weights)).encode() if weights else b"")
            measured = (
                await linkprobe.measure(self.shards, self.probes, self.settings.timeout, self.rank)
                if linkprobe.needs_measure(self.config)
                else None
            )
            await self.store.set(linkprobe.key(self.prefix), linkprobe.choose(self.config, measured).encode())

    async def learn_weights(self) -> None:
        """The job's shard weights (rank 0's PSRING_PS_WEIGHTS), checked against the shards there are."""
        raw = await self.store.get(f"{self.prefix}/weights")
        try:
            weights = parse_weights(raw.decode()) if raw else None
            self.weights = None if weights is None else check_weights(weights, len(self.shards))
        except ValueError as exc:
            raise ValueError(f"PSRING_PS_WEIGHTS (rank 0's): {exc}") from None

    async def learn_piece(self, key: str) -> None:
        """Whether any worker of the job reaches a shard on another host, the job's shard weights and
        its links' tuning (the same answers on every worker; one joining a running job takes them as
        they are). A setting this worker was given stands: one that differs from rank 0's pieces
        fails the first large collective with a MismatchError naming both, as ever."""
        wire = self.config.ps_wire_piece
        self.wire = 0 < wire < self.config.ps_piece and await self.store.add(key, 0) > 0
        await self.learn_weights()
        job = linkprobe.Tuning.decode(await self.store.get(linkprobe.key(self.prefix)))
        c = self.config
        self.tuning = linkprobe.Tuning(
            c.ps_wire_pieces or job.pieces, job.sndbuf if c.ps_sndbuf is None else c.ps_sndbuf, job.rate, job.round_trip
        )
        if c.ps_sndbuf is None:  # the connections were dialed before the job's choice was known
            for conn in self.shards:
                self._tune(conn)
        if self.wire and self.rank == 0:
            logger.info("job %r: %s", self.settings.job, self.tuning)

    def piece_for(self, nbytes: int) -> int:
        """The piece size of a collective of nbytes (:func:`~psring.topology.ps.plan.piece_bytes`)."""
        c = self.config
        return piece_bytes(nbytes, len(self.shards), c.ps_piece, c.ps_wire_piece, self.wire, self.tuning.pieces)

    def share_memory_pending(self) -> bool:
        """Whether a shard connection has not been considered for this worker's pool yet."""
        return any(id(c) not in self._pool_checked for c in self.shards)

    async def slot_for(self, owner: tuple[Any, int]) -> None:
        """Wait until the pool has a free slot, where waiting cannot deadlock (else the piece
        goes on the socket): pieces larger than the pool then stream through it."""
        pool = self.pool
        while pool is not None and not pool.free and pool.may_wait(*owner):
            await pool.wait_free()

    async def share_memory(self) -> None:
        """Offer every shard on this host not offered yet this worker's shared-memory pool (made
        now, at the first large collective); such a shard maps it and offers its own back."""
        todo = [c for c in self.shards if id(c) not in self._pool_checked and c.shm.can_share_memory()]
        self._pool_checked = {id(c) for c in self.shards}
        if self.pool is None and todo and not self._pool_failed and self.config.ps_shm_slots > 0:
            try:
                self.pool = ShmPool(self.config.ps_shm_slots, self.config.ps_piece)
            except (OSError, ValueError) as exc:
                self._pool_failed = True
                logger.warning("rank %d: no shared memory for pushes to the servers (%s)", self.rank, exc)
        if self.pool is not None and todo:
            await asyncio.gather(*(c.shm.offer_pool(self.pool, min(self.settings.timeout, 10.0)) for c in todo))

    async def connect(self, timeout: float) -> None:
        async def dial(i: int) -> Connection:
            own = self.own_servers
            if own is not None and i in own.shards:  # a shard this process hosts: no socket
                conn: Connection = own.attach_local(self._hello(i), name=f"rank {self.rank}")
                conn.router = self.mailbox
                conn.peer["shard"] = i
                return conn
            host, _, port = self.addresses[i].rpartition(":")
            try:
                conn = await open_connection(
                    host,
                    int(port),
                    secret=self.settings.secret,
                    hello=self._hello(i),
                    router=self.mailbox,
                    timeout=timeout,
                    name=f"rank {self.rank}",
                    settings=self.config,
                )
            except PeerLostError as exc:
                raise PeerLostError(f"server shard {i} at {self.addresses[i]} is unreachable: {exc}") from exc
            conn.peer["shard"] = i
            self._tune(conn)
            return conn

        self.shards = list(await asyncio.gather(*(dial(i) for i in range(len(self.addresses)))))

    # -------------------------------------------------------------- failures
    def _on_conn_lost(self, conn: Connection, error: PeerLostError | None) -> None:
        if self._closing:
            return
        i = conn.peer.get("shard")
        ago = time.monotonic() - conn.last_heard
        how = "closed its connection" if error is None else f"was lost: {error}"
        host = f", hosted by rank {i % self.world_size}," if self.colocated and isinstance(i, int) else ""
        err = PeerLostError(
            f"server shard {i} at {self.addresses[i] if isinstance(i, int) else conn.peername}{host} {how} "
            f"(last heard {ago:.1f}s ago)"
        )
        err.__cause__ = error
        self._break(err)

    def _break(self, err: PsringError) -> None:
        if self.lost is None:
            self.lost = err
        for fut in list(self._loss_waiters):
            if not fut.done():
                fut.set_exception(err)
                fut.exception()
        for group in list(self.groups.values()):
            if isinstance(err, PeerLostError):
                group.on_peer_lost(err)
            else:
                group.on_server_error(err)

    async def _stall_send(self, ranks: list[int], frame: dict[str, Any]) -> None:
        """A stall frame to other workers: through the first shard, which relays it to each of ranks."""
        conn = next((c for c in self.shards if c.is_open), None)
        if conn is not None:
            with contextlib.suppress(PsringError):
                conn.send_frame({**frame, "to": ranks})

    def _on_control(self, conn: Connection, header: dict[str, Any], payload: Any) -> bool:
        kind = header["kind"]
        if kind == "stall":
            self.stalls.on_frame(conn, header)
            return True
        if kind == frames.LINK:  # a shard's answer to a link probe
            fut = self.probes.pop(header.get("tag"), None)  # type: ignore[arg-type]  # wire values
            if fut is not None and not fut.done():
                fut.set_result(None)
            return True
        if kind == "reject":
            self._break(ProtocolError(str(header.get("reason", "the server rejected this worker"))[:2000]))
            return True
        if kind != "abort":
            return False
        tag, reason = header.get("tag"), header.get("reason")
        if not isinstance(tag, tuple) or len(tag) != 2 or reason not in ("lost", "mismatch", "timeout"):
            raise ProtocolError(f"malformed abort frame from {conn.peername}")
        message = str(header.get("message", ""))[:2000]
        if reason == "lost" and tag[0] == "*":  # a worker or server went away: every group hears it
            lost = header.get("lost")
            main = self.groups.get("0")
            elastic = type(lost) is int and getattr(main, "elastic", False)  # a worker of an elastic job
            for fut in [] if elastic else list(self._loss_waiters):
                if not fut.done():
                    fut.set_exception(PeerLostError(message, rank=lost if type(lost) is int else None))
                    fut.exception()
            for group in list(self.groups.values()):
                local = group.local_rank(lost)
                if local is not None or type(lost) is not int:  # a rank outside this job is none of its business
                    suffix = (
                        f" [rank {local} of subgroup {group.gid}]" if group.gid != "0" and local is not None else ""
                    )
                    group.on_peer_lost(PeerLostError(message + suffix, rank=lost if type(lost) is int else None))
            return True
        group = self.groups.get(tag[0])
        if group is not None and type(tag[1]) is int:
            # one collective abandoned (lost: because worker header["lost"] went away, which the
            # "*" frame above reported already): it fails where it is pending, and nowhere else
            missing = [m for m in header.get("missing") or () if type(m) is int]
            lost = header.get("lost")
            group.on_abort(tag[1], reason, message, missing, lost=lost if type(lost) is int else None)
        return True

    def stats(self) -> dict[str, int]:
        """Bytes to and from the shards, payloads in shared memory included (and counted apart)."""
        return {
            "bytes_sent": sum(c.bytes_sent + c.shm.pool_bytes_sent for c in self.shards),
            "bytes_received": sum(c.bytes_received + c.shm.pool_bytes_received for c in self.shards),
            "shm_bytes_sent": sum(c.shm.pool_bytes_sent for c in self.shards),
            "shm_bytes_received": sum(c.shm.pool_bytes_received for c in self.shards),
        }

    def link_stats(self) -> dict[str, list[int]]:
        """Bytes [sent, received] per link: one per server shard (shared memory included)."""
        return {f"shard {i}": [s, r] for i, (s, r) in enumerate(self.per_shard())}

    def per_shard(self) -> list[tuple[int, int]]:
        """(bytes this worker sent to, received from) each shard."""
        return [
            (c.bytes_sent + c.shm.pool_bytes_sent, c.bytes_received + c.shm.pool_bytes_received) for c in self.shards
        ]

    async def close(self) -> None:
        self._closing = True
        if self._counted:
            self._counted = False
            ServerLinks.live -= 1
        await self.stalls.close()
        goodbye = farewell(self.groups, self.stopped_at)
        await asyncio.gather(*(c.close(farewell=goodbye) for c in self.shards), return_exceptions=True)
        if self.own_servers is not None:
            await self.own_servers.drain(timeout=10.0)
            await self.own_servers.close()
        with contextlib.suppress(Exception):  # cleanup: a close may fail any way (the peer is gone)
            await self.store.close()
        if self.embedded_store is not None:
            await self.embedded_store.close()
        if self.pool is not None:
            self.pool.close()
        if self.host_reduce is not None:
            self.host_reduce.close()
