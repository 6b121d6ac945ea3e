"""Parameter-server topology: every collective through sharded servers.

Ranks are the workers; the S server shards are found through the store
(``psring/{job}/server/{i}``). Every tensor is split over the shards by
:func:`psring.server.plan`; for each collective a worker sends each involved shard a
join frame and its pieces, and receives result pieces straight into its output
array. Shards fold in the ring's canonical order, so ``all_reduce`` over ps returns
the same bits as over the ring. Pushes to different shards go out together. Between
processes on one host, pushed pieces of folding and relaying collectives and of
parameter mode go through the worker's shared-memory pool, and results come back
through the server process's (see :meth:`ServerLinks.share_memory` and psring.shmpool).

``init_group(topology="ps")`` waits (up to its timeout) for the servers registered in
the store. It starts servers itself only when asked (``servers=S``) or on the local
default, where rank 0 embedded the store and so nobody else can have started any.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from . import wire
from .arrays import byte_view, result_empty
from .compress import check_codec, dequantize, quantize, scale_exponent
from .config import GroupSettings
from .connection import Connection, Mailbox, open_connection
from .errors import CollectiveTimeoutError, PeerLostError, ProtocolError, PsringError
from .group import Collective, Group, farewell, ring_chunk_bounds
from .rendezvous import assign_rank, open_store_for
from .server import PIECE_BYTES, SHARED_KINDS, SHM_MIN, SHM_SLOTS, ShardServer, per_piece, pieces, plan, start_servers
from .shmpool import ShmPool, host_key

logger = logging.getLogger(__name__)

#: seconds a worker waits for the shards to name the missing ranks after its deadline
TIMEOUT_REPORT_GRACE = 1.0


def colocate_from_env(env: Mapping[str, str] | None = None) -> bool:
    """PSRING_PS_COLOCATE=1: each worker process hosts server shards (see README, ps topology)."""
    raw = (os.environ if env is None else env).get("PSRING_PS_COLOCATE", "").strip().lower()
    if raw in ("", "0", "false", "no", "off"):
        return False
    if raw in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"PSRING_PS_COLOCATE must be 0 or 1, got {raw!r}")


class ServerLinks:
    """A worker's connections to the server shards, and the mailbox they deliver to."""

    def __init__(self, rank: int, world_size: int, settings: GroupSettings, store: Any, prefix: str) -> None:
        self.rank = rank
        self.world_size = world_size
        self.settings = settings
        self.store = store
        self.prefix = prefix
        self.mailbox = Mailbox()
        self.mailbox.on_lost = self._on_conn_lost
        self.mailbox.on_control = self._on_control
        self.shards: list[Connection] = []
        self.addresses: list[str] = []
        self.groups: dict[str, PsGroup] = {}
        self.stopped_at: dict[str, int] = {}  # per group: the first seq this rank did not finish
        self.lost: PsringError | None = None
        self.embedded_store: Any = None
        self.own_servers: ShardServer | None = None
        self.reconnect_servers = True  # parameter mode re-sends to a restarted shard
        self.colocated = False  # the shards live in the ranks' processes (shard i in rank i % N)
        self._loss_waiters: set[asyncio.Future[None]] = set()
        self._closing = False
        self.pool: ShmPool | None = None  # pushes to shards on this host (psring.shmpool)
        self._pool_failed = False
        self._pool_checked: set[int] = set()  # ids of the shard connections offered it (or not able to)

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
                raw = await self.store.get(key)
                host, _, port = (raw or b"").decode().rpartition(":")
                try:
                    new = await open_connection(
                        host,
                        int(port),
                        secret=self.settings.secret,
                        hello=self._hello(i),
                        router=self.mailbox,
                        timeout=min(2.0, max(deadline - time.monotonic(), 0.1)),
                        name=f"rank {self.rank}",
                    )
                    break
                except (PsringError, ValueError, OSError) as exc:
                    if time.monotonic() > deadline:
                        raise PeerLostError(f"server shard {i} did not come back: {exc}") from exc
                    await asyncio.sleep(0.2)
            new.peer["shard"] = i
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
        }

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
        todo = [c for c in self.shards if id(c) not in self._pool_checked and c.can_share_memory()]
        self._pool_checked = {id(c) for c in self.shards}
        if self.pool is None and todo and not self._pool_failed and SHM_SLOTS > 0:
            try:
                self.pool = ShmPool(SHM_SLOTS, PIECE_BYTES)
            except (OSError, ValueError) as exc:
                self._pool_failed = True
                logger.warning("rank %d: no shared memory for pushes to the servers (%s)", self.rank, exc)
        if self.pool is not None and todo:
            await asyncio.gather(*(c.offer_pool(self.pool, min(self.settings.timeout, 10.0)) for c in todo))

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
                )
            except PeerLostError as exc:
                raise PeerLostError(f"server shard {i} at {self.addresses[i]} is unreachable: {exc}") from exc
            conn.peer["shard"] = i
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

    def _on_control(self, conn: Connection, header: dict[str, Any], payload: Any) -> bool:
        kind = header["kind"]
        if kind == "reject":
            self._break(ProtocolError(str(header.get("reason", "the server rejected this worker"))[:2000]))
            return True
        if kind != "abort":
            return False
        tag, reason = header.get("tag"), header.get("reason")
        if not isinstance(tag, tuple) or len(tag) != 2 or reason not in ("lost", "mismatch", "timeout"):
            raise ProtocolError(f"malformed abort frame from {conn.peername}")
        message = str(header.get("message", ""))[:2000]
        if reason == "lost":
            lost = header.get("lost")
            for fut in list(self._loss_waiters):
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
            missing = header.get("missing") or ()
            group.on_abort(tag[1], reason, message, [m for m in missing if type(m) is int])
        return True

    def stats(self) -> dict[str, int]:
        """Bytes to and from the shards, payloads in shared memory included (and counted apart)."""
        return {
            "bytes_sent": sum(c.bytes_sent + c.pool_bytes_sent for c in self.shards),
            "bytes_received": sum(c.bytes_received + c.pool_bytes_received for c in self.shards),
            "shm_bytes_sent": sum(c.pool_bytes_sent for c in self.shards),
            "shm_bytes_received": sum(c.pool_bytes_received for c in self.shards),
        }

    def per_shard(self) -> list[tuple[int, int]]:
        """(bytes this worker sent to, received from) each shard."""
        return [(c.bytes_sent + c.pool_bytes_sent, c.bytes_received + c.pool_bytes_received) for c in self.shards]

    async def close(self) -> None:
        self._closing = True
        goodbye = farewell(self.groups, self.stopped_at)
        await asyncio.gather(*(c.close(farewell=goodbye) for c in self.shards), return_exceptions=True)
        if self.own_servers is not None:
            await self.own_servers.drain(timeout=10.0)
            await self.own_servers.close()
        with contextlib.suppress(Exception):
            await self.store.close()
        if self.embedded_store is not None:
            await self.embedded_store.close()
        if self.pool is not None:
            self.pool.close()


class PsGroup(Group):
    """Collectives through parameter-server shards."""

    topology = "ps"

    def __init__(self, links: ServerLinks, rank: int, world_size: int, members: list[int], gid: str, timeout: float):
        super().__init__(rank, world_size, timeout=timeout, gid=gid, mailbox=links.mailbox)
        self.links = links
        self._broken_waiters: set[asyncio.Future[None]] = set()
        self.members = members
        self._owns_resources = gid == "0"
        links.groups[gid] = self

    @property
    def num_servers(self) -> int:
        return len(self.links.shards)

    @classmethod
    async def create(cls, settings: GroupSettings, **options: Any) -> PsGroup:
        servers = options.pop("servers", None)
        colocate = options.pop("colocate", None)
        if colocate is None:
            colocate = colocate_from_env()
        elif not isinstance(colocate, bool):
            raise TypeError(f"colocate={colocate!r} must be True or False")
        if options:
            raise TypeError(f"init_group(topology='ps') got unexpected options {sorted(options)}")
        if servers is not None and (type(servers) is not int or servers < 1):
            raise ValueError(f"servers={servers!r} must be a positive number of shards")
        assert settings.world_size is not None
        world = settings.world_size
        prefix = f"psring/{settings.job}"
        store, embedded = await open_store_for(settings, settings.rank)
        links: ServerLinks | None = None
        try:
            rank = await assign_rank(store, prefix, settings.rank, world)
            links = ServerLinks(rank, world, settings, store, prefix)
            links.embedded_store = embedded
            # a colocated shard dies with its rank and never comes back: no waiting to re-send to it
            links.colocated = colocate
            links.reconnect_servers = not colocate
            hosted: list[int] | None = None  # the shards this process starts (None: none)
            if colocate:  # every rank hosts its share of the shards (i % world == rank) in its own process
                count = servers or settings.servers or world
                hosted = [i for i in range(count) if i % world == rank] or None
            elif rank == 0 and (servers is not None or embedded is not None):
                # asked to, or the local default (this process serves the store): every shard here
                count = servers or settings.servers or 1
                hosted = list(range(count))
            if hosted is not None:
                links.own_servers = await start_servers(
                    store,
                    count,
                    job=settings.job,
                    secret=settings.secret,
                    host=settings.bind_host,
                    advertise=settings.advertise_host,
                    shard_ids=hosted,
                )
            await links.resolve(settings.timeout)
            await links.connect(settings.timeout)
            group = cls(links, rank, world, list(range(world)), "0", settings.timeout)
            await store.barrier(f"{prefix}/ready", world, settings.timeout)
            logger.info("%r ready with %d server shard(s)", group, len(links.shards))
            return group
        except (Exception, asyncio.CancelledError):
            if links is not None:
                await links.close()
            else:
                with contextlib.suppress(Exception):
                    await store.close()
                if embedded is not None:
                    await embedded.close()
            raise

    # ---------------------------------------------------------------- plumbing
    def local_rank(self, global_rank: Any) -> int | None:
        return self.members.index(global_rank) if global_rank in self.members else None

    def on_server_error(self, err: PsringError) -> None:
        if self._broken is None:
            self._broken = err
        for coll in list(self._active.values()):
            coll.fail(type(err)(f"{err} (while {coll.label} was pending on rank {self.rank})"))

    def _send_abort(self, seq: int, err: PsringError, reason: str) -> None:
        header = {"kind": "abort", "tag": (self.gid, seq), "reason": reason, "message": str(err), "src": self.rank}
        for conn in self.links.shards:
            if conn.is_open:
                with contextlib.suppress(PsringError):
                    conn.send_frame(dict(header))

    def _deadline_passed(self, coll: Collective) -> None:
        """Ask the shards who is missing; they answer every worker with an abort naming them."""
        if coll.done.done():
            return
        header = {
            "kind": "abort",
            "tag": (self.gid, coll.seq),
            "reason": "timeout",
            "timeout": self.timeout,
            "src": self.rank,
            "message": f"{coll.label} timed out after {self.timeout:g}s on rank {self.rank}",
        }
        for conn in self.links.shards:
            if conn.is_open:
                with contextlib.suppress(PsringError):
                    conn.send_frame(dict(header))
        asyncio.get_running_loop().call_later(TIMEOUT_REPORT_GRACE, self._timeout_unanswered, coll)

    def _timeout_unanswered(self, coll: Collective) -> None:
        coll.fail(
            CollectiveTimeoutError(
                f"{coll.label} on rank {self.rank} timed out after {self.timeout:g}s (the servers did not say why)"
            )
        )

    def _make_subgroup(self, gid: str, ranks: list[int]) -> PsGroup:
        return PsGroup(
            self.links, ranks.index(self.rank), len(ranks), [self.members[r] for r in ranks], gid, self.timeout
        )

    def stats(self) -> dict[str, int]:
        return self.links.stats()

    def _layer(self) -> Any:
        return self.links

    def _check_usable(self, peer: int | None = None, receiving: bool = False, seq: int | None = None) -> None:
        super()._check_usable(peer, receiving, seq)
        if self.links.lost is not None and self._broken is None:
            self._broken = self.links.lost
            super()._check_usable(peer, receiving, seq)

    # ------------------------------------------------------------- the engine
    def _join(self, coll: Collective) -> dict[str, Any]:
        return {
            "kind": "ps_req",
            "tag": (self.gid, coll.seq, "join"),
            "call": coll.desc,
            "src": self.rank,
            "size": self.world_size,
        }

    def _push(self, coll: Collective, j: int) -> dict[str, Any]:
        return {"kind": "ps_data", "tag": (self.gid, coll.seq, "p", j), "call": coll.desc, "src": self.rank}

    async def _exchange(
        self,
        coll: Collective,
        x: np.ndarray | None,
        expects: list[tuple[tuple[Any, ...], np.ndarray | None]],
        push: bool,
        n: int,
        itemsize: int,
    ) -> None:
        """Join every involved shard, push x's pieces (if push), and receive every (tag, dest) in expects."""
        gid, seq = self.gid, coll.seq
        layout = plan(coll.kind, n, itemsize, self.num_servers, seq)
        step = per_piece(itemsize)
        total = sum(len(pieces(a, b, step)) for _, a, b in layout)
        if total == 0 and coll.kind != "scatter":
            expects = [((gid, seq, "done"), None)]
        remaining = [len(expects)]
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        coll.waiting_on = set()

        def make_cb(dest: np.ndarray | None) -> Callable[..., None]:
            def cb(conn: Connection, hdr: dict[str, Any], payload: Any) -> None:
                want = dest.nbytes if dest is not None else 0
                if hdr["nbytes"] != want:
                    raise ProtocolError(f"server sent {hdr['nbytes']} bytes for {hdr['tag']}, expected {want}")
                remaining[0] -= 1
                if remaining[0] == 0 and not done.done():
                    done.set_result(None)

            return cb

        for tag, dest in expects:
            view = byte_view(dest) if dest is not None and dest.nbytes else None
            self.mailbox.post(tag, view, self._guard(coll, make_cb(dest)))
        if not expects:
            done.set_result(None)
        # pieces may go through shared memory (the shard holds them there until folded or forwarded),
        # and results come back through the server's (a receiver that pushes nothing offers its pool too)
        large = coll.kind in SHARED_KINDS and min(step, n) * itemsize >= SHM_MIN
        if large and self.links.share_memory_pending():
            await self.links.share_memory()
        shared = push and large
        used = []
        owner = (gid, seq)
        for shard, a, b in layout:
            conn = self.links.shards[shard]
            conn.send_frame(self._join(coll))
            if push and x is not None:
                for j, (pa, pb) in enumerate(pieces(a, b, step)):
                    if shared and conn.peer_maps_pool:
                        await self.links.slot_for(owner)
                    conn.send_tensor(self._push(coll, j), x[pa:pb], shared=shared, owner=owner)
            used.append(conn)
        await done
        for conn in used:
            await conn.flush()

    def _guard(self, coll: Collective, fn: Callable[..., None]) -> Callable[..., None]:
        def callback(conn: Connection, header: dict[str, Any], payload: Any) -> None:
            try:
                fn(conn, header, payload)
            except PsringError as exc:
                coll.fail(exc)

        return callback

    def _result_tags(self, coll: Collective, n: int, itemsize: int, out: np.ndarray, src: int | None = None):
        """(tag, destination view) for every result piece of a fold, or relayed pieces from src."""
        step = per_piece(itemsize)
        tags = []
        for shard, a, b in plan(coll.kind, n, itemsize, self.num_servers, coll.seq):
            for j, (pa, pb) in enumerate(pieces(a, b, step)):
                tag = (self.gid, coll.seq, "r", shard, j) + ((src,) if src is not None else ())
                tags.append((tag, out[pa:pb], pa, pb))
        return tags

    # -------------------------------------------------------------- collectives
    async def _all_reduce(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray:
        out = result_empty(x)
        expects = [(t, d) for t, d, _, _ in self._result_tags(coll, x.size, x.itemsize, out)]
        await self._exchange(coll, x, expects, True, x.size, x.itemsize)
        return out

    async def _all_reduce_fp16(self, coll: Collective, x: np.ndarray, op: str, e: int) -> np.ndarray:
        # the layout is the float32 tensor's (as the shard computes it from the call); pieces travel as float16
        q = quantize(x, e)
        r16 = np.empty_like(q)
        expects = [(t, d) for t, d, _, _ in self._result_tags(coll, x.size, x.itemsize, r16)]
        await self._exchange(coll, q, expects, True, x.size, x.itemsize)
        return dequantize(r16, e)

    async def _reduce(self, coll: Collective, x: np.ndarray, op: str, dst: int) -> np.ndarray | None:
        out = np.empty_like(x)
        me = self.rank == dst
        expects = [(t, d) for t, d, _, _ in self._result_tags(coll, x.size, x.itemsize, out)] if me else []
        await self._exchange(coll, x, expects, True, x.size, x.itemsize)
        return out if me else None

    async def _reduce_scatter(self, coll: Collective, x: np.ndarray, op: str) -> np.ndarray:
        a, b = ring_chunk_bounds(x.size, self.world_size)[self.rank]
        out = np.empty_like(x)
        expects = [(t, d) for t, d, pa, pb in self._result_tags(coll, x.size, x.itemsize, out) if a < pb and pa < b]
        await self._exchange(coll, x, expects if a < b else [], True, x.size, x.itemsize)
        return out[a:b].copy()

    async def _broadcast(self, coll: Collective, x: np.ndarray, src: int) -> np.ndarray:
        if self.rank == src:
            await self._exchange(coll, x, [], True, x.size, x.itemsize)
            return x.copy()
        out = np.empty_like(x)
        expects = [(t, d) for t, d, _, _ in self._result_tags(coll, x.size, x.itemsize, out, src)]
        await self._exchange(coll, None, expects, False, x.size, x.itemsize)
        return out

    async def _barrier(self, coll: Collective) -> None:
        await self._exchange(coll, None, [], False, 0, 1)

    async def _all_gather(self, coll: Collective, x: np.ndarray) -> np.ndarray:
        n_ranks, me = self.world_size, self.rank
        out = np.empty((n_ranks, x.size), x.dtype)
        out[me] = x
        expects = []
        for r in range(n_ranks):
            if r != me:
                expects += [(t, d) for t, d, _, _ in self._result_tags(coll, x.size, x.itemsize, out[r], r)]
        await self._exchange(coll, x, expects, True, x.size, x.itemsize)
        return out

    async def _gather(self, coll: Collective, x: np.ndarray, dst: int) -> np.ndarray | None:
        n_ranks, me = self.world_size, self.rank
        if me != dst:
            await self._exchange(coll, x, [], True, x.size, x.itemsize)
            return None
        out = np.empty((n_ranks, x.size), x.dtype)
        out[me] = x
        expects = []
        for r in range(n_ranks):
            if r != me:
                expects += [(t, d) for t, d, _, _ in self._result_tags(coll, x.size, x.itemsize, out[r], r)]
        await self._exchange(coll, x, expects, True, x.size, x.itemsize)
        return out

    async def _scatter(
        self, coll: Collective, xs: np.ndarray | None, src: int, meta: np.ndarray | None
    ) -> tuple[np.ndarray, tuple[str, tuple[int, ...]], str]:
        me, shards = self.rank, self.num_servers
        tag = (self.gid, coll.seq, "row")
        if me == src:
            assert xs is not None and meta is not None
            for s, conn in enumerate(self.links.shards):
                conn.send_frame(self._join(coll))
                for r in range(self.world_size):
                    if r != me and r % shards == s:
                        conn.send_tensor(
                            {"kind": "ps_data", "tag": (self.gid, coll.seq, "p", r), "call": coll.desc, "src": me},
                            xs[r],
                        )
            for conn in self.links.shards:
                await conn.flush()
            return xs[me].copy(), (str(meta.dtype), meta.shape), "cpu"
        fut = self.mailbox.expect(tag)
        try:
            for conn in self.links.shards:
                conn.send_frame(self._join(coll))
            _conn, hdr, payload = await fut
        finally:
            self.mailbox.unpost(tag)
        if "dtype" not in hdr:
            raise ProtocolError(f"scatter row from the servers carries no array (rank {src} scattered)")
        y = wire.decode_tensor(hdr, payload)
        return y, (hdr["dtype"], tuple(hdr["shape"])), str(hdr.get("dev", "cpu"))

    # -------------------------------------------------------- parameter mode
    # Used by SyncSGD: the shards hold the parameters and the optimizer state.

    def _param_layout(self, b: int, flat: np.ndarray) -> list[tuple[int, int, list[tuple[int, int]]]]:
        step = per_piece(flat.itemsize)
        return [
            (s, a, pieces(a, z, step)) for s, a, z in plan("all_reduce", flat.size, flat.itemsize, self.num_servers, b)
        ]

    async def param_init(self, buckets: list[np.ndarray], optimizer: dict[str, Any]) -> tuple[list[np.ndarray], int]:
        """Rank 0 offers its parameters; every rank then pulls what the shards hold (and their step)."""
        self._check_usable()
        if self.gid != "0":
            raise ValueError("parameter mode runs on the main group, not a subgroup")
        if self.rank == 0:
            for b, flat in enumerate(buckets):
                for shard, _a, parts in self._param_layout(b, flat):
                    conn = self.links.shards[shard]
                    base = {
                        "kind": "ps_param",
                        "op": "init",
                        "n": flat.size,
                        "dtype": wire.tensor_fields(flat)["dtype"],
                        "size": self.world_size,
                        "optimizer": optimizer,
                    }
                    if not parts:
                        conn.send_frame({**base, "tag": ("param", b, "init", -1), "piece": None})
                    for j, (pa, pb) in enumerate(parts):
                        conn.send_tensor({**base, "tag": ("param", b, "init", j), "piece": j}, flat[pa:pb])
        outs = [np.empty_like(flat) for flat in buckets]
        steps: list[int] = []

        async def pull(b: int, shard: int, parts: list[tuple[int, int]]) -> None:
            futs = [
                self.mailbox.expect(("param", b, "pull", shard, j), byte_view(outs[b][pa:pb]) if pb > pa else None)
                for j, (pa, pb) in enumerate(parts)
            ]
            marker = self.mailbox.expect(("param", b, "pulled", shard))
            self.links.shards[shard].send_frame(
                {"kind": "ps_param", "op": "pull", "tag": ("param", b, "pull"), "src": self.rank}
            )
            for fut in futs:
                _c, hdr, payload = await fut
                if payload is not None and hdr["nbytes"] and not _same(payload, outs[b]):
                    raise ProtocolError("parameter piece did not land in place")
            _c, hdr, _p = await marker
            steps.append(int(hdr["step"]))

        jobs = [
            pull(b, shard, parts) for b, flat in enumerate(buckets) for shard, _a, parts in self._param_layout(b, flat)
        ]
        await self._param_wait(asyncio.gather(*jobs), "pulling the initial parameters")
        if len(set(steps)) > 1:
            raise PsringError(f"server shards hold parameters of different steps {sorted(set(steps))}")
        return outs, (steps[0] if steps else 0)

    async def param_step(
        self, t: int, grads: list[np.ndarray], outs: list[np.ndarray], compression: str | None = None
    ) -> None:
        """Push step t's gradients; the new parameters land in outs. Re-sends after a server restart.

        With ``compression="fp16"`` the gradients travel as float16 at a scale the workers
        agree on first, exactly as a compressed all_reduce does (psring.compress).
        """
        wire_grads: list[tuple[np.ndarray, int | None]] = [(g, None) for g in grads]
        if compression is not None:
            for g in grads:
                check_codec(compression, g.dtype, "avg")
            amax = np.array([np.max(np.abs(g)) if g.size else 0.0 for g in grads], np.float32)
            amax = await self.all_reduce(amax, op="max")
            exps = [scale_exponent(float(a), self.world_size) for a in amax]
            wire_grads = [(quantize(g, e), e) for g, e in zip(grads, exps, strict=True)]
        got: set[tuple[Any, ...]] = set()
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                lost = self.links.lost
                if isinstance(lost, PeerLostError) and lost.rank is None:
                    raise lost  # a server went away since the last step: reconnect first
                self._check_usable()
                await self._param_round(t, grads, wire_grads, outs, got, deadline)
                return
            except PeerLostError as exc:
                if exc.rank is not None or not self.links.reconnect_servers:
                    raise
                logger.warning("%r: %s; reconnecting to re-send step %d", self, exc, t)
                await self.links.reconnect(deadline)
                self._broken = None

    async def _param_round(
        self,
        t: int,
        grads: list[np.ndarray],
        wire_grads: list[tuple[np.ndarray, int | None]],
        outs: list[np.ndarray],
        got: set[tuple[Any, ...]],
        deadline: float,
    ) -> None:
        futs = []
        if self.links.share_memory_pending() and any(g.nbytes >= SHM_MIN for g, _e in wire_grads):
            await self.links.share_memory()
        for b, flat in enumerate(grads):
            sent, e = wire_grads[b]
            push = {"kind": "ps_param", "op": "push", "src": self.rank}
            if e is not None:
                push["scale"] = e
            for shard, _a, parts in self._param_layout(b, flat):
                conn = self.links.shards[shard]
                for j, (pa, pb) in enumerate(parts):
                    tag = ("param", b, t, "r", shard, j)
                    if tag in got:
                        continue
                    self.mailbox.unpost(tag)
                    fut = self.mailbox.expect(tag, byte_view(outs[b][pa:pb]))
                    fut.add_done_callback(lambda f, tag=tag: got.add(tag) if not f.cancelled() else None)
                    futs.append(fut)
                    piece = sent[pa:pb]
                    shared = piece.nbytes >= SHM_MIN and conn.peer_maps_pool
                    if shared:
                        await self.links.slot_for(("param", t))
                    conn.send_tensor({**push, "tag": ("param", b, t, j)}, piece, shared=shared, owner=("param", t))
        await self._param_wait(asyncio.gather(*futs), f"step {t}", deadline)

    def on_peer_lost(self, err: PeerLostError) -> None:
        super().on_peer_lost(err)
        for fut in list(self._broken_waiters):
            if not fut.done():
                fut.set_result(None)

    async def _param_wait(self, work: Any, what: str, deadline: float | None = None) -> None:
        lost = self.links.loss_future()
        broken: asyncio.Future[None] = asyncio.get_running_loop().create_future()  # a worker was lost
        if self._broken is not None:
            broken.set_result(None)
        self._broken_waiters.add(broken)
        remaining = (deadline or time.monotonic() + self.timeout) - time.monotonic()
        try:
            done, _ = await asyncio.wait(
                {work, lost, broken}, timeout=max(remaining, 0), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            self._broken_waiters.discard(broken)
            if not lost.done():
                lost.cancel()
        if work in done:
            work.result()
            return
        work.cancel()
        with contextlib.suppress(BaseException):
            await work
        if lost in done:
            raise lost.exception() or PeerLostError("a server shard was lost")
        if broken in done and isinstance(self._broken, PeerLostError):
            lost_rank = self._broken.rank if self._broken.rank is not None else -1  # a worker, not a server
            raise PeerLostError(f"{self!r}: {self._broken} (during {what})", rank=lost_rank) from self._broken
        raise CollectiveTimeoutError(f"rank {self.rank}: the servers did not answer {what} within {self.timeout:g}s")

    # ------------------------------------------------------------------- p2p
    def _relay_shard(self, a: int, b: int) -> Connection:
        return self.links.shards[(self.members[a] + self.members[b]) % self.num_servers]

    async def _send(self, x: np.ndarray, dst: int, n: int, device: str) -> None:
        conn = self._relay_shard(self.rank, dst)
        header = {"kind": "ps_data", "tag": (self.gid, "p2p", self.rank, n), "dev": device, "to": self.members[dst]}
        conn.send_tensor(header, x)
        await conn.flush()


def _same(payload: Any, out: np.ndarray) -> bool:
    try:
        return bool(np.shares_memory(np.frombuffer(payload, np.uint8), out))
    except (TypeError, ValueError):
        return False


__all__ = ["PsGroup", "ServerLinks"]
